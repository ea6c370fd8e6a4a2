"""``subagent serve``'s runs as ACP subagent sessions, for a client that advertised ``subagents``.

ACP's subagents draft (its unstable schema, as shipped in @agentclientprotocol/sdk 2.4.0 and as
claude-agent-acp and codex-acp send it) lets an agent show each child it starts as a session of
its own. For such a client every run below a served session (spawn, fork or acp, background or
not, at any depth) is one, whose session id is the run's id:

* it is announced with a ``subagent_update`` on its parent's session (the served session for the
  session's own children, else the run that started it) before any of its traffic: title
  ``<provider> subagent: <prompt excerpt>``, the prompt as description, its cwd, ``cancel`` in its
  capabilities and state ``running``; every later ``subagent_update`` for it goes on that same
  parent session, as the schema asks;
* its own updates (text, tool calls, retries) are sent under its id, at most
  :data:`MAX_QUEUED_CHILD_UPDATES` waiting at a time (past it they are dropped, logged once, until
  the client catches up; state snapshots are never dropped);
* ``requires_action`` while a permission question of its is open (asked under its id), then
  ``running`` again;
* each run ends in exactly one ``idle`` snapshot with its stop reason (``end_turn``...; a failed
  run ``error`` with a JSON-RPC error object saying why) and usage, which also withdraws
  ``cancel``. A child lost with its process (an acp child whose agent died) is such a failed run:
  ``idle`` with stop reason ``error`` rather than ``unknown``, because its run is over for certain
  (the process is reaped, nothing works on), which ``unknown`` ("cannot currently determine
  foreground activity") would leave looking possibly busy; both real agents report a failed child
  that way too. A run still working when the session's turn ends gets its ``idle`` then:
  ``cancelled`` when the turn was cancelled (a cancel cascades down the whole tree), else
  ``error``;
* ``session/cancel`` with its id cancels that run alone (the parent's turn goes on, reading a
  cancelled result), while it grants ``cancel``.

An acp child's own announced children (its agent's subagents, which the ACP client reports to the
run's listeners as rows of its tree, ``_meta["subagent-seam/run"]``) are relayed one level further
down, with ids ``<run id>/<their id>`` (two agents may well use the same ids), so a tree of any
depth reaches the client; their state follows the rows, ``cancel`` only where their agent grants
it, and a cancel aimed at one goes to its agent. At most :data:`MAX_SUBAGENT_SESSIONS` are
announced per served session: past it a delegation is refused with a tool error the model reads,
and a relayed child is not shown (logged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

import anyio.abc

from subagent._acp_stop_reasons import TO_ACP
from subagent._text import cut, one_line
from subagent._usage_codec import prompt_response_usage, usage_from_acp, usage_to_acp
from subagent.acp import schema
from subagent.acp import schema_unstable as unstable
from subagent.acp._errors import AcpError, RpcErrorCode
from subagent.runtime._messages import Retrying, TextDelta
from subagent.runtime._tools import ToolError
from subagent.types import RETRY_META_KEY, RUN_META_KEY, Disposer, SubagentRunEndInfo, SubagentRunInfo, Usage

if TYPE_CHECKING:
    from subagent.runtime._inprocess_agent import Agent, AgentEvent
    from subagent.service import ServiceRun

__all__ = [
    "MAX_QUEUED_CHILD_UPDATES",
    "MAX_SUBAGENT_SESSIONS",
    "ChildSessions",
    "excerpt",
    "retry_update",
    "run_title",
]

logger = logging.getLogger(__name__)

MAX_SUBAGENT_SESSIONS: Final = 1000
"""The most subagent sessions one served session announces (its runs at every depth, relayed
children included), as our client keeps at most that many; real trees have a handful."""

MAX_QUEUED_CHILD_UPDATES: Final = 1000
"""The most updates of one child waiting to be sent: an acp child flooding a slow client must not
make us hold its whole stream."""

_TITLE_EXCERPT: Final = 80
_DESCRIPTION_CHARS: Final = 1000
_ERROR_CHARS: Final = 1000

_Queue = Callable[[str, schema.SessionUpdate], bool]
"""Queues an update to go out under a session id (in order with everything else); False when there
is no turn to send it in."""


def retry_update(event: Retrying) -> schema.SessionInfoUpdate:
    """A model call's retry, as the ``session_info_update`` that tells the client."""
    retry = {
        "attempt": event.attempt,
        "attempts": event.attempts,
        "delay": event.delay,
        "reason": event.reason,
    }
    return schema.SessionInfoUpdate(meta={RETRY_META_KEY: retry})


@runtime_checkable
class _RelayingRun(Protocol):
    """What an acp run (:class:`~subagent.providers.acp.AcpRun`) offers to relay its agent's own
    children: its updates, its session id, the children it was told of, and a cancel of one."""

    session_id: str | None

    def on_update(self, listener: Callable[[schema.SessionUpdate], object]) -> Callable[[], None]: ...

    def on_subagent_update(
        self, listener: Callable[[Any, schema.SessionUpdate], object]
    ) -> Callable[[], None]: ...

    @property
    def subagents(self) -> list[Any]: ...

    async def cancel_subagent(self, session_id: str) -> None: ...


@dataclass(slots=True, eq=False)
class _Child:
    """A subagent session announced to the client."""

    id: str
    parent_id: str
    """The session its ``subagent_update`` s go on: the served session, or the child above it."""
    cancel: Callable[[], Coroutine[Any, Any, None]] | None
    working: bool = True
    cancel_granted: bool = True  # what the client was last told of its `cancel`
    queued: int = 0  # its updates queued and not yet sent
    dropped: int = 0
    unrelay: Disposer | None = None  # an acp run's: stop relaying its updates
    provider: str | None = None  # which of our providers runs it (None: a relayed child of an acp run)


class ChildSessions:
    """The subagent sessions of one served session (see the module docstring).

    ``queue`` sends an update in order with the session's others; ``find_run`` looks a run of the
    service up by id; ``limit`` is :data:`MAX_SUBAGENT_SESSIONS` unless given.
    """

    def __init__(
        self,
        session_id: str,
        queue: _Queue,
        find_run: Callable[[str], ServiceRun | None],
        limit: int = MAX_SUBAGENT_SESSIONS,
    ) -> None:
        self.session_id = session_id
        self._queue = queue
        self._find_run = find_run
        self._limit = limit
        self._children: dict[str, _Child] = {}  # announced, by id, parents before their children
        self._agents: set[str] = {session_id}  # the in-process agents of the session's tree
        self._full_logged = False
        self._task_group: anyio.abc.TaskGroup | None = None
        self._turn_cancelled: Callable[[], bool] = lambda: False

    def __contains__(self, child_id: object) -> bool:
        return child_id in self._children

    def parent_of(self, child_id: str) -> str | None:
        """The session ``child_id`` was announced on, if it is one of these children."""
        child = self._children.get(child_id)
        return child.parent_id if child is not None else None

    def begin_turn(self, task_group: anyio.abc.TaskGroup, cancelled: Callable[[], bool]) -> None:
        """A turn begins: a cancel of one child runs in ``task_group`` (the turn's); ``cancelled``
        says whether the client cancelled the turn (then a run it takes down ended ``cancelled``)."""
        self._task_group = task_group
        self._turn_cancelled = cancelled

    def end_turn(self, *, cancelled: bool) -> None:
        """The turn ends: every child still working gets its ``idle`` now (the turn took it down)."""
        for child in reversed(tuple(self._children.values())):  # children before their parents
            if child.working:
                if cancelled:
                    self._idle(child, "cancelled", None, None)
                else:
                    self._idle(child, "error", "the turn ended before this subagent finished", None)
            if child.unrelay is not None:
                child.unrelay()
                child.unrelay = None
        self._task_group = None

    def check_room(self) -> None:
        """Refuse a delegation that would announce more children than the limit.

        Raises:
            ToolError: the session has announced its limit of subagent sessions.
        """
        if len(self._children) >= self._limit:
            raise ToolError(
                f"this session has shown its client {self._limit} subagent sessions, the most it "
                "may: no more subagents can be started in it"
            )

    # -- in-process agents -------------------------------------------------------------------------

    def adopt(self, agent: Agent) -> bool:
        """An in-process agent was made: follow its events if one of this session's agents started
        it (its text and retries then go out under its id). False when it is not this session's."""
        if agent.parent_id not in self._agents:
            return False
        self._agents.add(agent.id)
        child_id = agent.id
        agent.on_event(lambda event: self.agent_event(child_id, event))
        return True

    def agent_event(self, child_id: str, event: AgentEvent) -> None:
        """An event of an in-process child (its tool calls come through the session's reporter)."""
        if isinstance(event, TextDelta):
            if event.text:
                self.send(child_id, schema.AgentMessageChunk(content=schema.TextContent(text=event.text)))
        elif isinstance(event, Retrying):
            self.send(child_id, retry_update(event))

    # -- runs ----------------------------------------------------------------------------------------

    def announce(self, child_id: str) -> bool:
        """Make sure the run ``child_id`` was announced (at its start, or at its first traffic,
        whichever comes first); False when it is no run of this session, or past the limit."""
        if child_id in self._children:
            return True
        run = self._find_run(child_id)
        if run is None:
            return False
        info = run.info
        parent_id = info.parent_id
        if parent_id is None or not (parent_id == self.session_id or self.announce(parent_id)):
            return False
        if len(self._children) >= self._limit:
            if not self._full_logged:
                self._full_logged = True
                logger.warning(
                    "session %s: %d subagent sessions announced, the most it may; %s is not shown",
                    self.session_id,
                    self._limit,
                    child_id,
                )
            return False
        self._children[child_id] = _Child(child_id, parent_id, run.cancel, provider=info.provider)
        cwd = run.request.cwd
        self._patch(
            child_id,
            parent_id,
            title=run_title(info),
            description=cut(info.prompt, _DESCRIPTION_CHARS),
            capabilities=_CANCELLABLE,
            state=unstable.RunningStateUpdate(),
            cwd=cwd if cwd is not None and cwd.startswith("/") else None,
            # Which of our providers runs it (a client of ours names the row by it, as serve's own rows
            # are named); its spans are serve's own, below the caller's trace.
            meta=_served(self._children[child_id]),
        )
        return True

    def run_started(self, info: SubagentRunInfo) -> None:
        """``subagent/start``: announced (if not yet), and an acp child's updates relayed from now."""
        if not self.announce(info.id):
            return
        run = self._find_run(info.id)
        provider_run: object = run.provider_run if run is not None else None
        child = self._children[info.id]
        if isinstance(provider_run, _RelayingRun) and child.unrelay is None:
            acp_run = provider_run
            disposers = (
                acp_run.on_update(lambda update: self._relay(child, acp_run, update)),
                # Its children's own traffic (their text, tool calls), under the ids they are relayed as.
                acp_run.on_subagent_update(
                    lambda session, update: self._relay_traffic(child, session.session_id, update)
                ),
            )

            def unrelay() -> None:
                for dispose in disposers:
                    dispose()

            child.unrelay = unrelay

    def run_ended(self, info: SubagentRunEndInfo) -> None:
        """``subagent/end``: the run's one ``idle``, after those of its relayed children still working."""
        child = self._children.get(info.id)
        if child is None:
            return
        if child.unrelay is not None:
            child.unrelay()
            child.unrelay = None
        prefix = info.id + "/"
        for relayed in reversed(tuple(self._children.values())):
            if relayed.working and relayed.id.startswith(prefix):
                if info.stop_reason == "cancelled" or self._turn_cancelled():
                    self._idle(relayed, "cancelled", None, None)
                else:
                    why = f"lost: the agent of {info.id} ended before it reported this subagent's end"
                    self._idle(relayed, "error", why, None)
        if not child.working:
            return
        if info.stop_reason != "completed" and self._turn_cancelled():
            # Taken down by the cancel of the turn (a disposed run says only that it was disposed).
            self._idle(child, "cancelled", None, info.usage)
        else:
            self._idle(child, info.stop_reason, info.error, info.usage)

    def asking(self, child_id: str, asking: bool) -> None:
        """A permission question of the child is open (``requires_action``), or was answered."""
        child = self._children.get(child_id)
        if child is not None and child.working:
            state: unstable.StateUpdate = (
                unstable.RequiresActionStateUpdate() if asking else unstable.RunningStateUpdate()
            )
            self._patch(child.id, child.parent_id, state=state)

    def cancel(self, child_id: str) -> bool:
        """``session/cancel`` for ``child_id``: its current work is cancelled (in the background: a
        notification must not wait for it) while it grants ``cancel``. False: no such child."""
        child = self._children.get(child_id)
        if child is None:
            return False
        if not child.working or child.cancel is None or self._task_group is None:
            logger.info("session/cancel for subagent session %s, which has nothing to cancel", child_id)
            return True
        self._task_group.start_soon(child.cancel, name=f"cancel subagent {child_id}")
        return True

    # -- traffic -------------------------------------------------------------------------------------

    def send(self, child_id: str, update: schema.SessionUpdate) -> bool:
        """Send one of the child's own updates under its id (announcing it first); False when it is
        not shown (not this session's, past the limit) or its backlog is full (dropped)."""
        if not self.announce(child_id):
            return False
        child = self._children[child_id]
        if child.queued >= MAX_QUEUED_CHILD_UPDATES:
            child.dropped += 1
            if child.dropped == 1:
                logger.warning(
                    "session %s: subagent %s has %d updates waiting for the client; dropping more",
                    self.session_id,
                    child_id,
                    child.queued,
                )
            return False
        if self._queue(child_id, update):
            child.queued += 1
        return True

    def sent(self, session_id: str) -> None:
        """One update queued under ``session_id`` went out (or could not)."""
        child = self._children.get(session_id)
        if child is not None and child.queued:
            child.queued -= 1

    # -- an acp child's own children -----------------------------------------------------------------

    def _relay_traffic(self, child: _Child, own_id: str, update: schema.SessionUpdate) -> None:
        """An update of one of the acp child's own subagent sessions: sent under its relayed id once
        that is announced (the row that announces it comes first); never its agent's subagent traffic."""
        if _own_subagent_traffic(update):
            return
        relayed_id = f"{child.id}/{own_id}"
        if relayed_id in self._children:
            self.send(relayed_id, update)

    def _relay(self, child: _Child, run: _RelayingRun, update: schema.SessionUpdate) -> None:
        if _own_subagent_traffic(update):
            return  # in its agent's ids: relayed as the rows below instead
        row = _run_row(update)
        if row is None:
            self.send(child.id, update)
            return
        own_id, parent, state = row["runId"], row["parentId"], row["state"]
        relayed_id = f"{child.id}/{own_id}"
        parent_id = child.id if parent == run.session_id else f"{child.id}/{parent}"
        relayed = self._children.get(relayed_id)
        cancellable = any(
            getattr(session, "session_id", None) == own_id and getattr(session, "can_cancel", False)
            for session in run.subagents
        )
        capabilities = _CANCELLABLE if cancellable else _NOT_CANCELLABLE
        if relayed is None:
            if parent_id not in self._children or len(self._children) >= self._limit:
                logger.warning("session %s: not relaying subagent session %s", self.session_id, relayed_id)
                return
            relayed = self._children[relayed_id] = _Child(
                relayed_id, parent_id, _relayed_cancel(run, own_id), cancel_granted=cancellable
            )
            title = getattr(update, "title", None)
            self._patch(
                relayed_id,
                parent_id,
                title=title if isinstance(title, str) else own_id,
                capabilities=capabilities,
                state=unstable.RunningStateUpdate(),
            )
        elif state == "running" and (not relayed.working or cancellable != relayed.cancel_granted):
            relayed.working = True
            relayed.cancel_granted = cancellable
            self._patch(relayed_id, parent_id, capabilities=capabilities, state=unstable.RunningStateUpdate())
        if state != "running" and relayed.working:
            stop_reason, usage = row.get("stopReason"), row.get("usage")
            self._idle(
                relayed,
                stop_reason if isinstance(stop_reason, str) else None,
                None,
                usage_from_acp(usage) if isinstance(usage, Mapping) else None,
            )

    # -- snapshots -----------------------------------------------------------------------------------

    def _idle(self, child: _Child, stop_reason: str | None, error: str | None, usage: Usage | None) -> None:
        child.working = False
        child.cancel_granted = False
        acp_reason = _ACP_STOP_REASONS.get(stop_reason) if stop_reason is not None else None
        failure: schema.Error | None = None
        if acp_reason is None:
            acp_reason = "error"
            why = error or f"the subagent stopped ({stop_reason or 'no reason given'})"
            failure = schema.Error(code=RpcErrorCode.INTERNAL_ERROR, message=one_line(why, _ERROR_CHARS))
        counts = prompt_response_usage(usage)
        self._patch(
            child.id,
            child.parent_id,
            # The usage as our own rows give it too: ACP's needs input and output counts, which a model
            # may not both report.
            meta=_served(child, usage),
            capabilities=_NOT_CANCELLABLE,
            state=unstable.IdleStateUpdate(
                stop_reason=acp_reason,
                error=failure,
                usage=schema.convert(counts, type=unstable.Usage) if counts is not None else None,
            ),
        )

    def _patch(self, child_id: str, parent_id: str, **fields: Any) -> None:
        """Send a ``subagent_update`` for ``child_id`` (on its parent's session) with ``fields``."""
        update = unstable.SubagentUpdate(session_id=child_id, **fields)
        self._queue(parent_id, schema.UnknownSessionUpdate(raw=schema.to_builtins(update)))


def _served(child: _Child, usage: Usage | None = None) -> dict[str, Any] | None:
    """The ``_meta`` of a child's ``subagent_update``: which of our providers runs it and, at its end,
    its usage in our rows' form (a client of ours shows the run as it shows serve's rows; see
    ``subagent.providers._acp_subagents``). None for a relayed child, which is no run of ours."""
    if child.provider is None:
        return None
    row: dict[str, Any] = {"provider": child.provider}
    acp_usage = usage_to_acp(usage)
    if acp_usage is not None:
        row["usage"] = acp_usage
    return {RUN_META_KEY: row}


_CANCELLABLE: Final = unstable.SubagentSessionCapabilities(cancel=unstable.SessionCancelCapabilities())
_NOT_CANCELLABLE: Final = unstable.SubagentSessionCapabilities()
_ACP_STOP_REASONS: Final[Mapping[str, str]] = TO_ACP
_NOT_RELAYED: Final = frozenset({"subagent_update", "session_message", "session_message_chunk"})


def _own_subagent_traffic(update: schema.SessionUpdate) -> bool:
    """Whether ``update`` is an acp child's agent speaking of its own subagents (announcements,
    messages between them), which is relayed as rows, never as it is."""
    return isinstance(update, schema.UnknownSessionUpdate) and update.tag in _NOT_RELAYED


def excerpt(text: str) -> str:
    """``text`` on one line, cut to a title's length."""
    return one_line(text, _TITLE_EXCERPT)


def run_title(info: SubagentRunInfo) -> str:
    """A run's title: ``<provider> subagent: <prompt excerpt>``."""
    return f"{info.provider} subagent: {excerpt(info.prompt)}"


def _run_row(update: schema.SessionUpdate) -> dict[str, Any] | None:
    """The ``_meta["subagent-seam/run"]`` of a row of a run's tree (with string ``runId``,
    ``parentId`` and ``state``), or None for any other update."""
    if not isinstance(update, schema.ToolCall | schema.ToolCallProgress) or update.meta is None:
        return None
    row = update.meta.get(RUN_META_KEY)
    if not isinstance(row, dict) or not update.tool_call_id.startswith("run/"):
        return None
    if not all(isinstance(row.get(key), str) for key in ("runId", "parentId", "state")):
        return None
    return row


def _relayed_cancel(run: _RelayingRun, session_id: str) -> Callable[[], Coroutine[Any, Any, None]]:
    async def cancel() -> None:
        try:
            await run.cancel_subagent(session_id)
        except (AcpError, LookupError) as exc:
            logger.info("cancelling the relayed subagent session %s: %s", session_id, exc)

    return cancel
