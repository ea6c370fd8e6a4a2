"""Background delegation: a parent starts children, keeps working, and hears back when they end.

:class:`BackgroundChildren` keeps the background children of any number of parents (a parent is an
id: an in-process agent, a served session, or a host's own name for itself). For each child it holds
a short handle, meaningful only to its parent: every method takes the parent's id, and a handle of
another parent is answered exactly like one that does not exist.

* **Start**: :meth:`~BackgroundChildren.start` starts the run and waits for its readiness, so a
  failed start is reported at once, as a synchronous call would; then it returns. Past
  ``max_running`` children live at once for one parent, a child is queued (no run exists for it
  yet) and started when a slot frees, in order; past ``max_queued`` queued ones, a start is refused
  (``QUEUE_FULL``, naming the cap), so one parent cannot pile up work without end.
* **Hear back**: when a child ends, its run is disposed, its result kept (a long output spilled to a
  file: :class:`~subagent.delegation.Spill`) and a :class:`Notice` goes out: to every
  :meth:`~BackgroundChildren.on_notice` listener, and, when the parent is an in-process
  :class:`~subagent.runtime.Agent` bound with :meth:`~BackgroundChildren.bind_agent`, into its log
  at its next idle point (:meth:`~subagent.runtime.Agent.send_message`: between model calls while a
  turn runs, at once while it is idle). Notices come in the order the children ended.
* **What the parent does after its turn** is the host's choice (:attr:`BackgroundOptions.wake`):
  with ``wake=False`` the notices wait in the idle agent's log and the host runs the next turn when it
  decides (:meth:`~BackgroundChildren.next_turn_prompt` says whether and with what); with
  ``wake=True`` a notice that finds the agent idle starts a new turn of it by itself, and the turn's
  result goes to :meth:`~BackgroundChildren.on_wake` listeners.
* **Steer, wait, cancel, read**: :meth:`~BackgroundChildren.send`, :meth:`~BackgroundChildren.wait`
  (any, all, with a timeout), :meth:`~BackgroundChildren.cancel`, :meth:`~BackgroundChildren.result`.
* **Ownership**: a parent's children are cancelled and disposed when it closes (a bound agent's
  :meth:`~subagent.runtime.Agent.close`, or :meth:`~BackgroundChildren.close_parent`), when its turn
  is cancelled (:meth:`~subagent.runtime.Agent.cancel`), when :meth:`~BackgroundChildren.aclose` runs,
  and when the service closes (the children's tasks run in the service's task group, and the service
  disposes every run it started); closing a parent that had live children logs one line saying how
  many were queued and running. A spill directory the object created is removed by ``aclose``.
* **Notices cannot be forged**: a notice is framed by a first line ``[background subagent HANDLE
  ...]`` and a last line ``[end of background subagent HANDLE]``; any line of the child's own text
  that looks like either (of any handle) is shown quoted (``> [...``), so a child's output can neither
  end its own notice early nor pass for a sibling's.

The model-facing side (the ``background`` argument and the companion tools) is
:class:`~subagent.tool.SubagentTool`'s; this module is the machinery, usable without the tool.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import re
import secrets
import shutil
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import anyio

from subagent._outcome import CloseOnExit
from subagent._text import one_line
from subagent.budget import BudgetAccount
from subagent.delegation._results import Spill, SubagentToolResult, map_result, seam_failure
from subagent.events import Listeners
from subagent.journal import RunRecord
from subagent.runtime._inprocess_agent import (
    Agent,
    AgentClosed,
    AgentClosedError,
    AgentLifecycleEvent,
    ModelCallStarted,
    PendingMessage,
    TurnCancelRequested,
    TurnEnded,
)
from subagent.service import RunState, ServiceRun, SubagentService
from subagent.types import (
    Disposer,
    ObservableRun,
    SteerableRun,
    StopReason,
    SubagentError,
    SubagentRequest,
    SubagentResult,
)

__all__ = [
    "DEFAULT_MAX_QUEUED",
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_SPILL_BYTES",
    "WAKE_PROMPT",
    "BackgroundChildren",
    "BackgroundError",
    "BackgroundErrorKind",
    "BackgroundOptions",
    "ChildInfo",
    "ChildState",
    "Notice",
    "WaitOutcome",
    "WakeTurn",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING = 4
"""Background children one parent may have running at once before more are queued."""

DEFAULT_MAX_QUEUED = 64
"""Background children one parent may have queued (waiting for a running slot) before a start is
refused: enough for any fan-out a model plans, few enough that a runaway loop stops early."""

DEFAULT_SPILL_BYTES = 32 * 1024
"""Outputs larger than this (UTF-8 bytes) are written to a file and shown by head and tail: about
8,000 tokens, a fair share of a context window for one answer."""

WAKE_PROMPT = (
    "Background subagents you started have ended; their notices are above. Continue your task with "
    "what they reported."
)
"""The prompt of a turn a parent is woken for when its notices are already in its log."""

MAX_KEPT_COLLECTED = 100
"""Ended children whose result their parent has received that are kept per parent (still listed and
readable by handle); older ones are forgotten, so a parent's memory stays bounded."""

MAX_KEPT_ENDED = 1_000
"""Ended children kept per parent in all, their results read or not: a host that never asks for them
keeps a bounded amount (each notice also went to every listener as it came)."""

MAX_UNSEEN_NOTICES = 1_000
"""Notices kept per parent for a host that never asks for them (:meth:`BackgroundChildren.next_turn_prompt`);
past it the oldest are dropped (and logged): a notice is also given to every listener as it comes."""

CANCEL_GRACE = 10.0
"""Seconds a cancelled child may take to end by itself before it is disposed (killed)."""

_HANDLE_ALPHABET = "abcdefghijkmnpqrstuvwxyz23456789"
"""Lower-case letters and digits without look-alikes (l, o, 0, 1): handles are read and typed back
by models."""

ChildState = Literal["queued", "running", "completed", "failed", "cancelled"]
"""Where a background child is: waiting for a slot, running, or ended (``completed`` is a run that
completed its task; ``failed`` is any other end, a failed start included; ``cancelled`` is a run
cancelled by its parent, its owner or its own provider)."""

_LIVE: frozenset[ChildState] = frozenset({"queued", "running"})

_RUN_OVER = frozenset({RunState.ENDED, RunState.FAILED, RunState.DISPOSED})
"""States of a run that will take no more messages."""


@dataclass(frozen=True, slots=True)
class BackgroundOptions:
    """How background children are run and reported.

    Args:
        max_running: children one parent may have running at once; more are queued, in order.
        max_queued: children one parent may have queued at once; a start past it is refused
            (:attr:`BackgroundErrorKind.QUEUE_FULL`). 0 queues none.
        spill_bytes: outputs longer than this many UTF-8 bytes are written to a file and shown by
            head and tail; None never spills. Structured output is never spilled (it was validated,
            and a cut JSON value is useless).
        head_chars: characters of a spilled output shown from its start.
        tail_chars: characters of a spilled output shown from its end.
        run_dir: where spilled outputs are written; kept when given (the host owns it). None: a
            private temporary directory, created on first use and removed when the children's owner
            closes (:meth:`BackgroundChildren.aclose`).
        wake: a notice that finds its parent agent idle starts a new turn of it (see the module
            docstring); False leaves the next turn to the host.
        max_wait: the longest one :meth:`BackgroundChildren.wait` may block, in seconds, whatever
            timeout is asked for: a model cannot park its turn forever.
    """

    max_running: int = DEFAULT_MAX_RUNNING
    max_queued: int = DEFAULT_MAX_QUEUED
    spill_bytes: int | None = DEFAULT_SPILL_BYTES
    head_chars: int = 2_000
    tail_chars: int = 2_000
    run_dir: str | os.PathLike[str] | None = None
    wake: bool = False
    max_wait: float = 600.0

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.spill_bytes is not None and self.spill_bytes < 1:
            raise ValueError(f"spill_bytes must be >= 1 (or None), got {self.spill_bytes}")
        if self.head_chars < 0 or self.tail_chars < 0:
            raise ValueError("head_chars and tail_chars must be >= 0")
        if not self.max_wait > 0:  # `not >` also refuses NaN
            raise ValueError(f"max_wait must be > 0 seconds, got {self.max_wait}")


@dataclass(frozen=True, slots=True)
class ChildInfo:
    """A background child as of now. Times are ``time.monotonic()`` values.

    ``run_id`` is None while the child is queued (and for one cancelled before it started).
    ``last_activity`` is the child's last sign of life when its provider can say, else None.
    ``stop_reason`` and ``error`` are set once it ended (``error``: why a start or a run failed).
    """

    handle: str
    parent_id: str
    provider: str
    prompt: str
    state: ChildState
    run_id: str | None
    steerable: bool
    created_at: float
    ended_at: float | None = None
    last_activity: float | None = None
    stop_reason: StopReason | None = None
    error: str | None = None

    @property
    def live(self) -> bool:
        """Whether it is queued or running."""
        return self.state in _LIVE

    def describe(self, now: float | None = None) -> str:
        """One line for a model or a person: handle, provider, state, activity, the prompt's start."""
        now = time.monotonic() if now is None else now
        line = f"{self.handle} ({self.provider}): {self.state}"
        if self.state == "running":
            since = self.last_activity if self.last_activity is not None else self.created_at
            line += f", last activity {_ago(now - since)}"
        elif self.ended_at is not None:
            line += f" {_ago(now - self.ended_at)}"
            if self.stop_reason is not None and self.stop_reason != "completed":
                line += f" (stop reason: {self.stop_reason})"
        return f"{line}: {_excerpt(self.prompt)}"


@dataclass(frozen=True, slots=True)
class Notice:
    """A background child ended: ``child`` as it ended and ``result`` as the model reads it."""

    child: ChildInfo
    result: SubagentToolResult

    @property
    def parent_id(self) -> str:
        """The id of the child's parent."""
        return self.child.parent_id

    @property
    def text(self) -> str:
        """The notice as the parent model reads it: who ended, how, and the result (any line of it that
        looks like a notice's first or last line quoted, see the module docstring)."""
        child = self.child
        return (
            f"[background subagent {child.handle} ({child.provider}) {child.state}]\n"
            f"Task: {_excerpt(child.prompt)}\n\n{_quote_framing(self.result.render())}\n"
            f"[end of background subagent {child.handle}]"
        )


@dataclass(frozen=True, slots=True)
class WaitOutcome:
    """What :meth:`BackgroundChildren.wait` came to: the children that ended (with their results, in
    the order they ended), those still live, and whether the wait ran out of time first."""

    ended: tuple[Notice, ...]
    live: tuple[ChildInfo, ...]
    timed_out: bool


@dataclass(frozen=True, slots=True)
class WakeTurn:
    """A turn a notice woke its parent agent for (``wake=True``), and how it ended."""

    parent_id: str
    prompt: str
    result: SubagentResult


class BackgroundErrorKind(enum.Enum):
    """Why a call about a background child was refused."""

    UNKNOWN_HANDLE = "unknown_handle"
    NOT_STEERABLE = "not_steerable"
    NOT_RUNNING = "not_running"
    NOT_ENDED = "not_ended"
    QUEUE_FULL = "queue_full"
    CLOSED = "closed"


class BackgroundError(Exception):
    """A call about a background child was refused; ``reason`` says why, phrased for the model."""

    def __init__(self, kind: BackgroundErrorKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


# -- internals ----------------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Child:
    handle: str
    parent: _Parent
    provider: str
    request: SubagentRequest
    created_at: float
    state: ChildState = "queued"
    run: ServiceRun | None = None
    ended_at: float | None = None
    notice: Notice | None = None
    collected: bool = False
    cancel_requested: bool = False
    ended: anyio.Event = field(default_factory=anyio.Event)
    scope: anyio.CancelScope | None = None

    @property
    def live(self) -> bool:
        return self.state in _LIVE

    def info(self) -> ChildInfo:
        run: object = self.run  # a ServiceRun is observable, steerable... exactly when its provider's run is
        last_activity = (
            run.last_activity if isinstance(run, ObservableRun) and self.state == "running" else None
        )
        result = self.notice.result if self.notice is not None else None
        return ChildInfo(
            handle=self.handle,
            parent_id=self.parent.id,
            provider=self.provider,
            prompt=self.request.prompt,
            state=self.state,
            run_id=self.run.id if self.run is not None else (result.run_id if result is not None else None),
            steerable=isinstance(run, SteerableRun),
            created_at=self.created_at,
            ended_at=self.ended_at,
            last_activity=last_activity,
            stop_reason=result.stop_reason if result is not None else None,
            error=result.error if result is not None and result.is_error else None,
        )


@dataclass(eq=False, slots=True)
class _Parent:
    id: str
    children: dict[str, _Child] = field(default_factory=dict)
    queue: deque[_Child] = field(default_factory=deque)
    running: int = 0
    # Weak: a parent agent dropped without close() must not be kept alive by its children's records.
    agent_ref: weakref.ref[Agent] | None = None
    agent_disposer: Disposer | None = None
    # Notices the parent has not yet seen: for an agent, delivered or queued and not yet followed by a
    # model call; for a parent without an agent, not yet handed out by next_turn_prompt.
    unseen: list[tuple[Notice, PendingMessage | None]] = field(default_factory=list)
    changed: anyio.Event = field(default_factory=anyio.Event)
    waking: bool = False
    closed: bool = False

    @property
    def agent(self) -> Agent | None:
        return self.agent_ref() if self.agent_ref is not None else None

    def signal(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()


class BackgroundChildren(CloseOnExit):
    """The background children of any number of parents, started on ``service``.

    Use it while ``service`` is open; :meth:`aclose` (or ``async with``) cancels and disposes every
    child left and removes a spill directory it created. See the module docstring.

    Args:
        service: where the children's runs are started; its task group runs their watchers.
        options: limits, spilling and waking.
        within: a host's budget ceiling (:class:`~subagent.budget.BudgetAccount`): every child whose
            parent is not a run of ``service`` is started below it, so they all stay under it together.
    """

    def __init__(
        self,
        service: SubagentService,
        options: BackgroundOptions | None = None,
        *,
        within: BudgetAccount | None = None,
    ) -> None:
        self._service = service
        self.within = within
        """The budget ceiling the children are started within (None: none but their own)."""
        self.options = options if options is not None else BackgroundOptions()
        self._parents: dict[str, _Parent] = {}
        self._notice_listeners: Listeners[Notice] = Listeners(logger, "a background notice listener raised")
        self._wake_listeners: Listeners[WakeTurn] = Listeners(logger, "a wake-turn listener raised")
        self._spill_dir: str | None = None
        self._spilled = 0
        self._closed = False
        self._closing: set[_Parent] = set()

    def __repr__(self) -> str:
        live = sum(1 for parent in self._parents.values() for child in parent.children.values() if child.live)
        return f"<BackgroundChildren parents={len(self._parents)} live={live}>"

    # -- listening ---------------------------------------------------------------------------------------

    def on_notice(self, listener: Callable[[Notice], object]) -> Disposer:
        """Call ``listener`` with every notice, of every parent, in the order children end."""
        return self._notice_listeners.add(listener)

    def on_wake(self, listener: Callable[[WakeTurn], object]) -> Disposer:
        """Call ``listener`` with each turn a notice woke a parent agent for (``wake=True``)."""
        return self._wake_listeners.add(listener)

    # -- parents -----------------------------------------------------------------------------------------

    def bind_agent(self, agent: Agent) -> None:
        """Make ``agent`` the parent of the children started under its id: notices go into its log, and
        its children die when it closes or its turn is cancelled. Idempotent."""
        parent = self._parent(agent.id)
        if parent.agent is agent:
            return
        if parent.agent_disposer is not None:
            parent.agent_disposer()
        parent.agent_ref = weakref.ref(agent)
        parent.agent_disposer = agent.on_lifecycle(lambda event: self._on_lifecycle(parent, event))
        # Notices that came before the agent did (children a restarted parent lost) go into its log now.
        unsent = [notice for notice, pending in parent.unseen if pending is None]
        if unsent and not agent.closed:
            parent.unseen = [(notice, pending) for notice, pending in parent.unseen if pending is not None]
            for notice in unsent:
                try:
                    parent.unseen.append((notice, agent.send_message(notice.text)))
                except AgentClosedError:
                    break

    def parents(self) -> list[str]:
        """The ids of the parents that have children (live or ended and kept)."""
        return [parent.id for parent in self._parents.values() if parent.children]

    def children(self, parent_id: str) -> list[ChildInfo]:
        """The parent's children, in the order they were started."""
        parent = self._parents.get(parent_id)
        return [] if parent is None else [child.info() for child in parent.children.values()]

    def child(self, parent_id: str, handle: str) -> ChildInfo:
        """One child of the parent.

        Raises:
            BackgroundError: ``UNKNOWN_HANDLE``: the parent has no child by that handle.
        """
        return self._child(parent_id, handle).info()

    def live_count(self, parent_id: str) -> int:
        """The parent's children that are queued or running."""
        parent = self._parents.get(parent_id)
        return 0 if parent is None else sum(1 for child in parent.children.values() if child.live)

    # -- starting ----------------------------------------------------------------------------------------

    async def start(self, parent_id: str, provider: str, request: SubagentRequest) -> ChildInfo:
        """Start a background child of ``parent_id`` on ``provider`` and return once it is ready (or
        queued, past ``max_running``). ``request.parent_id`` is normally ``parent_id``; None for a host
        that is the root of its chain (its children are then kept under the key it passes here).

        Raises:
            SubagentError: the seam refused the request or the child failed to start (nothing is kept
                for it: the parent is told at once, as a synchronous call would be).
            BackgroundError: ``CLOSED``: this object is closed; ``QUEUE_FULL``: the parent has
                ``max_running`` children running and ``max_queued`` queued (nothing is kept).
        """
        if self._closed:
            raise BackgroundError(BackgroundErrorKind.CLOSED, "background delegation is closed")
        parent = self._parent(parent_id)
        options = self.options
        if parent.running >= options.max_running and len(parent.queue) >= options.max_queued:
            raise BackgroundError(
                BackgroundErrorKind.QUEUE_FULL,
                f"no subagent was started: {options.max_running} of yours are running and "
                f"{options.max_queued} queued, the most you may have waiting; wait for one to end, or "
                "cancel one, then start it again",
            )
        child = _Child(
            handle=self._new_handle(parent),
            parent=parent,
            provider=provider,
            request=request,
            created_at=time.monotonic(),
        )
        if parent.running >= self.options.max_running:
            parent.children[child.handle] = child
            parent.queue.append(child)
            parent.signal()
            return child.info()
        run = self._service.start(provider, request, within=self.within)  # raises SubagentError: nothing kept
        parent.running += 1
        child.run = run
        child.state = "running"
        parent.children[child.handle] = child  # listed in start order, starting ones included
        try:
            await run.started()
        except BaseException:
            parent.running -= 1
            del parent.children[child.handle]
            child.state = "failed"
            child.ended.set()  # a close waiting on it (the parent closed while it started) goes on
            with anyio.CancelScope(shield=True):
                await run.dispose()
            if self._open_for(parent):
                self._start_queued(parent)  # the slot it held is free again
            raise
        self._spawn_watcher(child)
        parent.signal()
        return child.info()

    def _spawn_watcher(self, child: _Child) -> None:
        task_group = self._service._require_open()
        task_group.start_soon(self._watch, child, name=f"background child {child.handle}")

    async def _watch(self, child: _Child) -> None:
        """Start the child if it was queued, await its end, dispose it, and tell its parent."""
        scope = anyio.CancelScope()
        child.scope = scope
        outcome: SubagentToolResult | None = None
        try:
            with scope:
                outcome = await self._run_to_end(child)
        except Exception as exc:
            # A faulty provider: the parent hears that the run failed (never the exception's text,
            # which could hold anything), the log gets the traceback.
            logger.exception("background child %s of %s: the run raised", child.handle, child.parent.id)
            outcome = SubagentToolResult(
                is_error=True,
                error=f"the subagent run failed: its provider raised {type(exc).__name__}",
                provider=child.provider,
                handle=child.handle,
            )
        finally:
            run = child.run
            if run is not None:
                with anyio.CancelScope(shield=True):
                    await run.dispose()
            if outcome is None:  # cut short: the owner is closing
                outcome = SubagentToolResult(
                    is_error=True,
                    error="the subagent was cancelled: its parent's owner closed",
                    stop_reason="cancelled",
                    run_id=run.id if run is not None else None,
                    provider=child.provider,
                    handle=child.handle,
                )
            # A child its parent cancelled answers the cancel call itself: no notice on top of that.
            self._end(child, outcome, notify=not scope.cancel_called and not child.cancel_requested)

    async def _run_to_end(self, child: _Child) -> SubagentToolResult:
        provider, handle = child.provider, child.handle
        run = child.run
        if run is None:  # dequeued: start it now
            if child.cancel_requested:  # cancelled between leaving the queue and this task's first step
                return SubagentToolResult(
                    is_error=True,
                    error="the subagent was cancelled before it started",
                    stop_reason="cancelled",
                    provider=provider,
                    handle=handle,
                )
            try:
                run = self._service.start(provider, child.request, within=self.within)
            except SubagentError as exc:
                return seam_failure(
                    exc, lead="the subagent could not be started", provider=provider, handle=handle
                )
            child.run = run
            try:
                await run.started()
            except SubagentError as exc:
                return seam_failure(
                    exc,
                    lead="the subagent could not be started",
                    provider=provider,
                    run_id=run.id,
                    handle=handle,
                )
        try:
            result = await run.result()
        except SubagentError as exc:
            if not child.cancel_requested:
                return seam_failure(
                    exc, lead="the subagent run failed", provider=provider, run_id=run.id, handle=handle
                )
            # Cancelled, and disposed after the grace: still a cancel, with what it said so far when its
            # provider keeps that (an ACP run's ``output``).
            partial = getattr(run.provider_run, "output", "")
            result = SubagentResult(
                output=partial if isinstance(partial, str) else "",
                stop_reason="cancelled",
                error=f"it did not stop within {CANCEL_GRACE:g} s of being cancelled and was disposed",
            )
        spill = await self.spill_result(result, child.request, label=f"{handle}-{run.id}")
        return map_result(result, child.request, provider=provider, run_id=run.id, handle=handle, spill=spill)

    def _end(self, child: _Child, result: SubagentToolResult, *, notify: bool) -> None:
        parent = child.parent
        if child.state == "running":
            parent.running -= 1
        if result.stop_reason == "cancelled" or (child.cancel_requested and result.is_error):
            child.state = "cancelled"
        else:
            child.state = "failed" if result.is_error else "completed"
        child.ended_at = time.monotonic()
        notice = Notice(child.info(), result)
        child.notice = notice
        child.ended.set()
        self._forget_collected(parent)
        if self._open_for(parent):
            if notify:
                self._notify(parent, notice)
            self._start_queued(parent)
        parent.signal()

    def _start_queued(self, parent: _Parent) -> None:
        while parent.queue and parent.running < self.options.max_running:
            child = parent.queue.popleft()
            if child.state != "queued":
                continue  # cancelled while it waited
            child.state = "running"
            parent.running += 1
            try:
                self._spawn_watcher(child)
            except (SubagentError, RuntimeError) as exc:
                # The service is closing: the child never starts.
                error = exc.message if isinstance(exc, SubagentError) else str(exc)
                self._end(
                    child,
                    SubagentToolResult(
                        is_error=True,
                        error=f"the subagent could not be started: {error}",
                        provider=child.provider,
                        handle=child.handle,
                    ),
                    notify=False,
                )

    # -- notices -----------------------------------------------------------------------------------------

    def _notify(self, parent: _Parent, notice: Notice) -> None:
        self._notice_listeners.emit(notice)
        agent = parent.agent
        if agent is None or agent.closed:
            parent.unseen.append((notice, None))
            if len(parent.unseen) > MAX_UNSEEN_NOTICES:
                dropped, _pending = parent.unseen.pop(0)
                # The child goes with its notice: nobody asked for either, and the listeners had both.
                forgotten = parent.children.get(dropped.child.handle)
                if forgotten is not None and not forgotten.live:
                    del parent.children[dropped.child.handle]
                logger.warning(
                    "parent %s: the notice of %s was dropped unread (%d kept)",
                    parent.id,
                    dropped.child.handle,
                    MAX_UNSEEN_NOTICES,
                )
            return
        if self.options.wake and not agent.busy and not parent.waking:
            parent.unseen.append((notice, None))
            self._wake(parent, agent)
            return
        try:
            pending = agent.send_message(notice.text)
        except AgentClosedError:
            return
        parent.unseen.append((notice, pending))

    def _on_lifecycle(self, parent: _Parent, event: AgentLifecycleEvent) -> None:
        if isinstance(event, ModelCallStarted):
            # The messages delivered before this call are in what the model reads now: those children's
            # results count as received (a wait without handles does not hand them out again).
            read = [
                notice
                for notice, pending in parent.unseen
                if pending is not None and pending.status != "queued"
            ]
            parent.unseen = [(n, p) for n, p in parent.unseen if p is None or p.status == "queued"]
            self._received(parent, read)
        elif isinstance(event, TurnEnded):
            agent = parent.agent
            if self.options.wake and agent is not None and parent.unseen and not parent.waking:
                self._wake(parent, agent)
        elif isinstance(event, TurnCancelRequested | AgentClosed):
            self._close_parent_soon(parent)

    def _wake(self, parent: _Parent, agent: Agent) -> None:
        parent.waking = True
        try:
            task_group = self._service._require_open()
        except (SubagentError, RuntimeError):
            parent.waking = False
            return

        async def wake() -> None:
            try:
                while not agent.closed:
                    prompt = self._take_prompt(parent)
                    if prompt is None:
                        return
                    try:
                        result = await agent.run_turn(prompt)
                    except AgentClosedError:
                        return
                    except Exception:
                        # A faulty adapter must not take the service's task group (every run) down.
                        logger.exception(
                            "parent %s: a turn woken by its children's notices raised", parent.id
                        )
                        return
                    self._wake_listeners.emit(WakeTurn(parent.id, prompt, result))
            finally:
                parent.waking = False

        task_group.start_soon(wake, name=f"wake {parent.id}")

    def _take_prompt(self, parent: _Parent) -> str | None:
        """The prompt of the parent's next turn from its unseen notices (and mark them seen), or None."""
        if not parent.unseen:
            return None
        unseen, parent.unseen = parent.unseen, []
        # Handed to the parent as its prompt (or read in its log by the turn it is for): received.
        self._received(parent, [notice for notice, _pending in unseen])
        texts = [notice.text for notice, pending in unseen if pending is None]
        if len(texts) < len(unseen):  # some are in its log already
            texts.insert(0, WAKE_PROMPT)
        return "\n\n".join(texts)

    async def next_turn_prompt(self, parent_id: str, *, timeout: float | None = None) -> str | None:
        """For a host that runs its parent's turns: the prompt of the next turn the parent owes its
        children, waiting for one while any child is live; None when no child is live and every notice
        was seen (or, with ``timeout``, when none came in time).

        The prompt is the notices the parent has not seen (or, when they are in its agent's log
        already, :data:`WAKE_PROMPT`); they count as seen once returned.
        """
        with anyio.move_on_after(math.inf if timeout is None else timeout):
            while True:
                parent = self._parents.get(parent_id)
                if parent is None:
                    return None
                prompt = self._take_prompt(parent)
                if prompt is not None:
                    return prompt
                if not any(child.live for child in parent.children.values()):
                    return None
                await parent.changed.wait()
        return None

    # -- steering, waiting, cancelling, reading -----------------------------------------------------------

    async def send(self, parent_id: str, handle: str, text: str) -> None:
        """Send ``text`` to a running child: it reaches the child at its next idle point.

        Raises:
            BackgroundError: ``UNKNOWN_HANDLE``; ``NOT_RUNNING`` (queued or ended);
                ``NOT_STEERABLE`` (its provider's runs take no messages).
            SubagentError: the provider refused the message.
        """
        child = self._child(parent_id, handle)
        if child.state == "running" and child.run is None:
            raise BackgroundError(
                BackgroundErrorKind.NOT_RUNNING,
                f"subagent {handle} is starting; send the message once it runs",
            )
        if child.state != "running" or child.run is None:
            what = (
                "has not started yet (it is queued)"
                if child.state == "queued"
                else f"has ended ({child.state})"
            )
            raise BackgroundError(BackgroundErrorKind.NOT_RUNNING, f"subagent {handle} {what}")
        run = child.run
        if run.state in _RUN_OVER:
            # Its result is in, its notice on the way: a message now would reach nobody.
            raise BackgroundError(BackgroundErrorKind.NOT_RUNNING, f"subagent {handle} has ended")
        if not isinstance(run, SteerableRun):
            raise BackgroundError(
                BackgroundErrorKind.NOT_STEERABLE,
                f"subagent {handle} runs on provider {child.provider!r}, whose subagents cannot take "
                "messages while they work",
            )
        await run.send_message(text)

    async def cancel(self, parent_id: str, handle: str) -> Notice:
        """Cancel a child and return its notice once it ended (a child that ended already: its notice).

        A running child is asked to stop and given ``CANCEL_GRACE`` seconds, then disposed.

        Raises:
            BackgroundError: ``UNKNOWN_HANDLE``.
        """
        child = self._child(parent_id, handle)
        if child.state == "queued":
            self._end_queued(child)
        elif child.state == "running":
            child.cancel_requested = True
            run = child.run
            # The grace bounds the provider's own cancel too (an ACP run waits for its agent's answer).
            with anyio.move_on_after(CANCEL_GRACE):
                if run is not None:
                    await run.cancel()
                await child.ended.wait()
            if not child.ended.is_set() and child.run is not None:
                await child.run.dispose()
            await child.ended.wait()
        notice = child.notice
        assert notice is not None
        self._collect(child)
        return notice

    def _end_queued(self, child: _Child) -> None:
        # Out of the queue at once: the queue holds exactly the children waiting, which the cap counts.
        with contextlib.suppress(ValueError):
            child.parent.queue.remove(child)
        result = SubagentToolResult(
            is_error=True,
            error="the subagent was cancelled before it started",
            stop_reason="cancelled",
            provider=child.provider,
            handle=child.handle,
        )
        child.cancel_requested = True
        self._end(child, result, notify=False)

    def result(self, parent_id: str, handle: str) -> Notice:
        """The notice of an ended child (its result included); it counts as collected.

        Raises:
            BackgroundError: ``UNKNOWN_HANDLE``; ``NOT_ENDED`` for a child still queued or running.
        """
        child = self._child(parent_id, handle)
        if child.notice is None:
            raise BackgroundError(
                BackgroundErrorKind.NOT_ENDED,
                f"subagent {handle} has no result yet: it is {child.state}",
            )
        self._collect(child)
        return child.notice

    async def wait(
        self,
        parent_id: str,
        handles: Sequence[str] | None = None,
        *,
        mode: Literal["any", "all"] = "any",
        timeout: float | None = None,
    ) -> WaitOutcome:
        """Wait for children of the parent to end: ``any`` returns once at least one of them ended,
        ``all`` once all did; each returns every one of them that ended, with its result (they count as
        collected). Without ``handles``: the children whose result was not collected yet.

        The wait lasts at most ``timeout`` seconds (capped at ``max_wait``); then it returns what
        ended so far with ``timed_out``.

        Raises:
            BackgroundError: ``UNKNOWN_HANDLE`` for any handle the parent does not have.
        """
        if handles is None:
            parent = self._parents.get(parent_id)
            targets = [] if parent is None else [c for c in parent.children.values() if not c.collected]
        else:
            targets = [self._child(parent_id, handle) for handle in dict.fromkeys(handles)]
        limit = self.options.max_wait if timeout is None else min(max(timeout, 0.0), self.options.max_wait)
        timed_out = False
        if targets:
            with anyio.move_on_after(limit) as scope:
                if mode == "all":
                    for child in targets:
                        await child.ended.wait()
                else:
                    await _first_set([child.ended for child in targets])
            # Out of time only if what was waited for had not happened: a zero timeout on a child that
            # has ended already is no timeout.
            ended_now = [child.ended.is_set() for child in targets]
            timed_out = scope.cancelled_caught and not (all(ended_now) if mode == "all" else any(ended_now))
        ended = sorted((c for c in targets if c.notice is not None), key=lambda c: c.ended_at or 0.0)
        for child in ended:
            self._collect(child)
        return WaitOutcome(
            ended=tuple(child.notice for child in ended if child.notice is not None),
            live=tuple(child.info() for child in targets if child.live),
            timed_out=timed_out,
        )

    # -- closing -----------------------------------------------------------------------------------------

    async def close_parent(self, parent_id: str) -> None:
        """Cancel and dispose every live child of the parent, and forget the parent. Returns once
        nothing of them is running."""
        parent = self._parents.pop(parent_id, None)
        if parent is not None:
            parent.closed = True
            await self._close(parent)

    def _close_parent_soon(self, parent: _Parent) -> None:
        # Lifecycle listeners are plain callbacks: the disposal runs in the service's task group.
        if self._parents.get(parent.id) is parent:
            del self._parents[parent.id]
        parent.closed = True
        try:
            task_group = self._service._require_open()
        except (SubagentError, RuntimeError):
            return  # the service is closing: it disposes every run itself
        self._closing.add(parent)  # until it is done, aclose() waits for it too
        task_group.start_soon(self._close, parent, name=f"close background children of {parent.id}")

    async def _close(self, parent: _Parent) -> None:
        if parent.agent_disposer is not None:
            parent.agent_disposer()
            parent.agent_disposer = None
        with anyio.CancelScope(shield=True):
            queued = list(parent.queue)
            for child in queued:
                self._end_queued(child)
            parent.queue.clear()
            running = [child for child in parent.children.values() if child.state == "running"]
            if queued or running:
                # One line for them all: a parent may go with dozens queued, and each is no news.
                logger.info(
                    "parent %s closed with live background children: %d queued (never started), "
                    "%d running (cancelled)",
                    parent.id,
                    len(queued),
                    len(running),
                )
            for child in running:
                child.cancel_requested = True
                if child.scope is not None:
                    child.scope.cancel()
                elif child.run is not None:
                    await child.run.dispose()
            for child in list(parent.children.values()):
                with anyio.move_on_after(CANCEL_GRACE * 3):
                    await child.ended.wait()
            parent.signal()
            self._closing.discard(parent)

    async def aclose(self) -> None:
        """Cancel and dispose every child of every parent; remove a spill directory created here.
        Idempotent; returns once nothing of them is running."""
        self._closed = True
        parents, self._parents = [*self._parents.values(), *self._closing], {}
        for parent in parents:
            parent.closed = True
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as task_group:
                for parent in parents:
                    task_group.start_soon(self._close, parent)
            spill_dir, self._spill_dir = self._spill_dir, None
            if spill_dir is not None:
                await anyio.to_thread.run_sync(lambda: shutil.rmtree(spill_dir, ignore_errors=True))

    def discard_spill_directory(self) -> None:
        """Remove the private spill directory now, synchronously, if one was made (for an owner that
        cannot await :meth:`aclose`: its service is closed, so no child is left to write there)."""
        spill_dir, self._spill_dir = self._spill_dir, None
        if spill_dir is not None:
            shutil.rmtree(spill_dir, ignore_errors=True)

    # -- helpers -----------------------------------------------------------------------------------------

    def _open_for(self, parent: _Parent) -> bool:
        """Whether the parent can still hear of its children and get new ones started."""
        return not self._closed and not parent.closed

    def _parent(self, parent_id: str) -> _Parent:
        parent = self._parents.get(parent_id)
        if parent is None:
            parent = self._parents[parent_id] = _Parent(parent_id)
            if self._service.journal is not None:
                for record in self._service.take_interrupted(parent_id):
                    self._notify(parent, _interrupted_notice(parent_id, record))
        return parent

    def _child(self, parent_id: str, handle: str) -> _Child:
        parent = self._parents.get(parent_id)
        child = parent.children.get(handle) if parent is not None and isinstance(handle, str) else None
        if child is None:
            # The same answer whether another parent has that handle or nobody does.
            raise BackgroundError(
                BackgroundErrorKind.UNKNOWN_HANDLE,
                f"no background subagent of yours has the handle {_excerpt(handle, 40)!r}",
            )
        return child

    @staticmethod
    def _new_handle(parent: _Parent) -> str:
        while True:
            handle = "".join(secrets.choice(_HANDLE_ALPHABET) for _ in range(6))
            if handle not in parent.children:
                return handle

    async def spill_result(
        self, result: SubagentResult, request: SubagentRequest, *, label: str
    ) -> Spill | None:
        """:meth:`spill` for a run's result: its output, unless the result is the structured value the
        request asked for (validated, and useless cut: never spilled)."""
        if request.output_schema is not None and result.structured is not None:
            return None
        return await self.spill(result.output, label=label)

    async def spill(self, output: str, *, label: str) -> Spill | None:
        """Write ``output`` to a new file in the spill directory when it is longer than ``spill_bytes``
        and return how to show it; None when it is short enough (or cannot be written: logged).
        ``label`` names the file (sanitised; a counter keeps names unique)."""
        limit = self.options.spill_bytes
        if limit is None:
            return None
        data = output.encode()
        if len(data) <= limit:
            return None
        try:
            directory = await self._spill_directory()
        except OSError as exc:
            logger.warning("could not make the spill directory for an output of %d bytes: %s", len(data), exc)
            return None
        self._spilled += 1
        name = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in label)[:120]
        # A name nobody can take first in a shared run_dir: the exclusive open below then never fails.
        path = os.path.join(directory, f"{name}-{self._spilled}-{secrets.token_hex(4)}.txt")

        def write() -> None:
            # Exclusive and private: a name taken by someone else is never written through.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(data)

        try:
            await anyio.to_thread.run_sync(write)
        except OSError as exc:
            logger.warning("could not spill an output of %d bytes to %s: %s", len(data), path, exc)
            return None
        head = output[: self.options.head_chars]
        tail = output[len(output) - self.options.tail_chars :] if self.options.tail_chars else ""
        return Spill(path=path, size=len(data), head=head, tail=tail)

    def _received(self, parent: _Parent, notices: Iterable[Notice]) -> None:
        """The parent has read these notices' results: their children count as collected."""
        for notice in notices:
            child = parent.children.get(notice.child.handle)
            if child is not None:
                child.collected = True
        self._forget_collected(parent)

    @staticmethod
    def _forget_collected(parent: _Parent) -> None:
        """Keep at most ``MAX_KEPT_COLLECTED`` children whose result the parent has, and at most
        ``MAX_KEPT_ENDED`` ended children in all (the oldest go first; an unread one goes with a
        warning): a long-lived parent that delegates all day, or never asks, must not keep every
        result."""
        collected = [c for c in parent.children.values() if c.collected and not c.live]
        for child in collected[: max(len(collected) - MAX_KEPT_COLLECTED, 0)]:
            del parent.children[child.handle]
        ended = [c for c in parent.children.values() if not c.live]
        for child in ended[: max(len(ended) - MAX_KEPT_ENDED, 0)]:
            if not child.collected and not parent.closed:  # a closed parent's close says it all once
                logger.warning("parent %s: the result of %s was dropped unread", parent.id, child.handle)
            del parent.children[child.handle]

    @staticmethod
    def _collect(child: _Child) -> None:
        """The parent has the child's result now (a wait, a read, a cancel): a notice of it still
        queued for the parent's agent is taken back, so the model does not read the same result twice."""
        child.collected = True
        parent = child.parent
        BackgroundChildren._forget_collected(parent)
        kept = []
        for notice, pending in parent.unseen:
            if notice.child.handle != child.handle:
                kept.append((notice, pending))
            elif (
                pending is not None
                and parent.agent is not None
                and not parent.agent.withdraw_message(pending)
            ):
                kept.append((notice, pending))  # in the log already: still to be seen by a model call
        parent.unseen = kept

    async def _spill_directory(self) -> str:
        if self.options.run_dir is not None:
            directory = os.fspath(self.options.run_dir)
            await anyio.to_thread.run_sync(lambda: os.makedirs(directory, mode=0o700, exist_ok=True))
            return directory
        if self._spill_dir is None:
            self._spill_dir = await anyio.to_thread.run_sync(
                lambda: tempfile.mkdtemp(prefix="subagent-spill-")
            )
        return self._spill_dir


async def _first_set(events: Iterable[anyio.Event]) -> None:
    """Return once any of ``events`` is set."""
    async with anyio.create_task_group() as task_group:

        async def wait_one(event: anyio.Event) -> None:
            await event.wait()
            task_group.cancel_scope.cancel()

        for event in events:
            task_group.start_soon(wait_one, event)


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    return f"{seconds:.1f} s ago" if seconds < 10 else f"{seconds:.0f} s ago"


_FRAMING_LINE = re.compile(r"[\s\u200b-\u200d\u2060\ufeff]*\[\s*(end\s+of\s+)?background\s+subagent\b", re.I)
"""The start of a line that reads as a notice's first or last line, blanks and invisible marks before it
and letter case aside: a child's text holding one could end its own notice or pass for a sibling's."""


def _quote_framing(text: str) -> str:
    """``text`` with each line that looks like a notice's framing (any handle) quoted, ``> `` before it."""
    lines = text.splitlines(keepends=True)
    if not any(_FRAMING_LINE.match(line) for line in lines):
        return text
    return "".join(f"> {line}" if _FRAMING_LINE.match(line) else line for line in lines)


def _excerpt(text: str, limit: int = 100) -> str:
    return one_line(text, limit)


def _interrupted_notice(parent_id: str, record: RunRecord) -> Notice:
    """The notice of a child its parent lost when the process that ran it stopped (a journaled run found
    ``interrupted``): it can be resumed (``subagent resume``), or started again."""
    handle = f"run-{record.id}"
    done = ""
    progress = record.progress or {}
    output = progress.get("output")
    if isinstance(output, str) and output.strip():
        done = f" Its last output: {_excerpt(output, 500)}"
    error = (
        "interrupted: the process that ran this subagent stopped before it finished "
        f"(journal run {record.id}).{done} Resume it with `subagent resume {record.id}`, or start it again."
    )
    info = ChildInfo(
        handle=handle,
        parent_id=parent_id,
        provider=record.provider,
        prompt=record.turn_prompt,
        state="failed",
        run_id=record.run_id,
        steerable=False,
        created_at=time.monotonic(),
        ended_at=time.monotonic(),
        error=error,
    )
    result = SubagentToolResult(
        is_error=True, error=error, provider=record.provider, run_id=record.run_id, handle=handle
    )
    return Notice(info, result)
