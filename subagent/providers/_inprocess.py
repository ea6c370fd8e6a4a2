"""What the ``spawn`` and ``fork`` providers share: a child :class:`~subagent.runtime.Agent` run
inside this process, and the run that owns it.

The child exists as soon as ``start()`` returns (an agent is only memory), registered in the
provider's :class:`~subagent.runtime.AgentRegistry` under the run's id, so a ``subagent/start``
listener finds it with ``agents.get(info.id)``. Its first turn runs in the service's task group;
after the turn the child stays, for ``resume()`` and ``send_message()``, until ``dispose()``.

Everything the seam promises is applied here, from the lineage the service counted: the child's
depth, its tools (its parent's, or the provider's for a root parent, narrowed by the effective tool
filter, so a tool an ancestor lost never comes back), its persona, the output schema (validated
and repaired once by the agent) and the inactivity timeout.

Durable runs (the service's run journal): a run's :meth:`~InProcessRun.checkpoint` is its child's
message log as of its last completed turn, and :meth:`~InProcessProvider.reopen` makes a new child
that starts from such a log and runs the resumed prompt as its next turn.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import anyio
import anyio.abc

from subagent import _structured
from subagent._outcome import DisposeOnExit, Outcome
from subagent.budget import account_for, budget_result
from subagent.isolation import IsolationError, IsolationSettings, Workspace, open_workspace
from subagent.runtime._inprocess_agent import (
    DEFAULT_MAX_MODEL_CALLS,
    Agent,
    AgentClosedError,
    AgentLifecycleEvent,
    AgentRegistry,
    TurnEnded,
)
from subagent.runtime._llm import LlmAdapter, LlmService
from subagent.runtime._log_codec import decode_log, encode_log, json_type
from subagent.runtime._messages import Message
from subagent.runtime._tools import Approver, Tool
from subagent.types import (
    BUDGET_FIELDS,
    ErrorCode,
    Lineage,
    ResumePoint,
    SubagentCapabilities,
    SubagentError,
    SubagentRequest,
    SubagentResult,
)

__all__ = ["InProcessProvider", "InProcessRun"]

logger = logging.getLogger(__name__)

_run_ids = itertools.count(1)

DISPOSED_REASON = "the run was disposed before the child's next idle point"
"""Why a message still queued for a child at its disposal is refused."""


class InProcessProvider:
    """The base of :class:`~subagent.providers.spawn.SpawnProvider` and
    :class:`~subagent.providers.fork.ForkProvider`; see those for the arguments."""

    inherits_parent_context: bool = False
    default_name: str = "in-process"
    """The name a provider of this class registers under unless given another."""

    def __init__(
        self,
        *,
        name: str | None = None,
        llm: LlmAdapter | str | None = None,
        llm_service: LlmService | None = None,
        agents: AgentRegistry | None = None,
        tools: Sequence[Tool] = (),
        persona: str | None = None,
        approver: Approver | None = None,
        max_model_calls: int = DEFAULT_MAX_MODEL_CALLS,
        isolation: IsolationSettings | None = None,
    ) -> None:
        if isinstance(llm, str) and llm_service is None:
            raise ValueError(f"llm={llm!r} names an adapter, so an llm_service to look it up in is needed")
        if max_model_calls < 1:
            raise ValueError(f"max_model_calls must be >= 1, got {max_model_calls}")
        self.name = name or self.default_name
        self.capabilities = SubagentCapabilities(
            output_schema=True,
            depth_limit=True,
            tool_filter=True,
            budget=frozenset(BUDGET_FIELDS),
            isolation=frozenset({"worktree", "copy"}),
        )
        self.llm = llm
        self.llm_service = llm_service
        self.agents = agents if agents is not None else AgentRegistry.default()
        """The live in-process agents: children join under their run id, and parents are found here."""
        self.tools: tuple[Tool, ...] = tuple(tools)
        self.persona = persona
        self.approver = approver
        self.max_model_calls = max_model_calls
        self.isolation = isolation if isolation is not None else IsolationSettings()
        """Where isolated children's workspaces are made (``SubagentRequest.isolation``)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} live={len(self.agents)}>"

    @property
    def kind(self) -> Literal["spawn", "fork"]:
        """What its children are: ``fork`` when they start from their parent's conversation."""
        return "fork" if self.inherits_parent_context else "spawn"

    def start(self, request: SubagentRequest, task_group: anyio.abc.TaskGroup) -> InProcessRun:
        """Create the child agent now and run its first turn in ``task_group``.

        Raises:
            SubagentError: ``START_FAILED`` when the child cannot be made (no LLM adapter, a fork
                without a live in-process parent, an invalid output schema).
        """
        self._check_schema(request, self._cannot_start)
        parent = self._parent_of(request)
        agent = self._make_agent(
            request,
            parent,
            llm=self._llm_for(parent, self._cannot_start),
            persona=self._persona_for(request, parent),
            history=self._history_for(request, parent),
            cwd=None,
        )
        return self._launch(InProcessRun(self, request, agent), task_group)

    # -- durable runs (the service's run journal) ----------------------------------------------------

    def describe_agent(self) -> dict[str, Any]:
        """What the journal keeps of how this provider runs children: ``{"kind": "spawn" | "fork",
        "llm": ...}``, the model adapter's name when it is given by name, else its class name (None:
        the parent's). Never a secret: an adapter's key or address is not in it."""
        llm = self.llm if isinstance(self.llm, str) or self.llm is None else type(self.llm).__name__
        return {"kind": self.kind, "llm": llm}

    def reopen(
        self, request: SubagentRequest, point: ResumePoint, task_group: anyio.abc.TaskGroup
    ) -> InProcessRun:
        """Continue a journaled run in a new child: its log is the checkpoint's (the run's last
        completed turn; none of its turns runs again), and it runs ``request.prompt`` as its next turn,
        in ``task_group``. The child is made as :meth:`start` makes one (its depth, tools narrowed by
        the lineage, approver, budget account and output schema from ``request``; its parent's tools,
        approver and model when the parent is a live agent here), under a new run id. A fork is not
        forked again: its log already holds what it was seeded with. A spawn that never checkpointed
        and completed no turn starts from an empty log (its persona as :meth:`start` chooses it):
        nothing of it is lost.

        Raises:
            SubagentError: ``RESUME_UNSUPPORTED``, before any child exists, when the run was another
                kind of child, worked in an isolated workspace (closed with it), has no log to continue
                from (a fork, or a spawn that completed turns), has a malformed log, or no model
                adapter can be found.
        """
        refuse = self._cannot_reopen
        kind = point.agent.get("kind")
        if kind is None:
            raise refuse(f"the journal does not say what kind of child run {point.run_id} was")
        if kind != self.kind:
            raise refuse(
                f"run {point.run_id} was a {kind!r} child, and this provider makes {self.kind!r} ones"
            )
        if request.isolation is not None:
            raise refuse(
                f"run {point.run_id} worked in an isolated workspace ({request.isolation}), which was "
                "closed with its child"
            )
        log, cwd = self._checkpointed(point)
        self._check_schema(request, refuse)
        parent = self._parent_of(request)
        llm = self._llm_for(parent, refuse)
        history: Sequence[Message]
        if log is None:
            persona, history = self._persona_for(request, None), ()
        elif log and log[0].role == "system" and log[0].content:
            # The agent puts its persona first: kept as the persona, so the model sees the same log.
            persona, history = log[0].content, log[1:]
        else:
            persona, history = None, log
        agent = self._make_agent(request, parent, llm=llm, persona=persona, history=history, cwd=cwd)
        return self._launch(InProcessRun(self, request, agent), task_group)

    def _checkpointed(self, point: ResumePoint) -> tuple[tuple[Message, ...] | None, str | None]:
        """The checkpoint's log (None: there is none, and a spawn may start afresh) and cwd."""
        checkpoint = point.checkpoint
        if checkpoint is not None and not isinstance(checkpoint, Mapping):
            raise self._cannot_reopen(
                f"run {point.run_id}'s checkpoint is malformed: it must be an object, "
                f"not {json_type(checkpoint)}"
            )
        if checkpoint is None or "messages" not in checkpoint:
            if self.inherits_parent_context:
                raise self._cannot_reopen(
                    f"run {point.run_id} has no checkpoint, so the context the fork was seeded with is "
                    "lost (a resumed fork is not forked again)"
                )
            if point.turns_completed:
                raise self._cannot_reopen(
                    f"run {point.run_id} completed {point.turns_completed} turn(s) but has no checkpoint, "
                    "so starting it afresh would lose them"
                )
            return None, None
        try:
            log = decode_log(checkpoint["messages"])
        except ValueError as exc:
            raise self._cannot_reopen(f"run {point.run_id}'s checkpoint is malformed: {exc}") from exc
        cwd = checkpoint.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise self._cannot_reopen(
                f"run {point.run_id}'s checkpoint is malformed: cwd must be a string or null, not "
                f"{json_type(cwd)}"
            )
        return log, cwd

    # -- what a child is made of (the fork provider overrides the history and defaults) ----------

    def _parent_of(self, request: SubagentRequest) -> Agent | None:
        return self.agents.get(request.parent_id) if request.parent_id is not None else None

    def _make_agent(
        self,
        request: SubagentRequest,
        parent: Agent | None,
        *,
        llm: LlmAdapter,
        persona: str | None,
        history: Sequence[Message],
        cwd: str | None,
    ) -> Agent:
        """A child under a new run id, live in the registry; ``cwd`` is used when the request has none."""
        lineage = request.lineage or Lineage(depth=1)
        if request.cwd is not None:
            cwd = request.cwd  # a child works where it was sent
        elif cwd is None and parent is not None:
            cwd = parent.cwd
        return Agent(
            llm=llm,
            id=f"{self.name}-{next(_run_ids)}",
            parent_id=request.parent_id,
            depth=lineage.depth,
            cwd=cwd,
            persona=persona,
            tools=self._tools_for(parent, lineage),
            history=history,
            approver=self.approver if self.approver is not None else (parent.approver if parent else None),
            max_model_calls=self.max_model_calls,
            registry=self.agents,
            budget=account_for(request),
        )

    def _launch(self, run: InProcessRun, task_group: anyio.abc.TaskGroup) -> InProcessRun:
        """Run the child's first turn in ``task_group``."""
        try:
            task_group.start_soon(run._main, name=f"{self.name} run {run.id}")
        except BaseException:
            self.agents._remove(run.agent)  # never started: it must not stay findable
            raise
        return run

    def _history_for(self, request: SubagentRequest, parent: Agent | None) -> Sequence[Message]:
        return ()

    def _persona_for(self, request: SubagentRequest, parent: Agent | None) -> str | None:
        return request.persona if request.persona is not None else self.persona

    def _llm_for(self, parent: Agent | None, fail: Callable[[str], SubagentError]) -> LlmAdapter:
        if isinstance(self.llm, str):
            assert self.llm_service is not None
            try:
                return self.llm_service.require(self.llm)
            except KeyError as exc:
                raise fail(str(exc.args[0])) from exc
        if self.llm is not None:
            return self.llm
        if parent is not None:
            return parent.llm
        raise fail("no LLM adapter: the provider has none and the parent is not an in-process agent")

    def _check_schema(self, request: SubagentRequest, fail: Callable[[str], SubagentError]) -> None:
        if request.output_schema is not None:
            try:
                _structured.check_schema(request.output_schema)
            except Exception as exc:
                raise fail(f"the output schema is not a valid JSON Schema: {exc}") from exc

    def _tools_for(self, parent: Agent | None, lineage: Lineage) -> tuple[Tool, ...]:
        # A child's tools are its parent's (the provider's own for a root parent), narrowed.
        base = parent.tools if parent is not None else self.tools
        narrowing = lineage.tool_filter
        if narrowing is None:
            return base
        return tuple(tool for tool in base if narrowing.permits(tool.spec.name))

    def _cannot_start(self, why: str) -> SubagentError:
        return SubagentError(ErrorCode.START_FAILED, f"provider {self.name!r}: {why}", provider=self.name)

    def _cannot_reopen(self, why: str) -> SubagentError:
        return SubagentError(
            ErrorCode.RESUME_UNSUPPORTED, f"provider {self.name!r}: {why}", provider=self.name
        )


class _CompletedLog:
    """The log of an agent as of its last completed turn: its first log, then the whole log at the
    end of each turn that ended ``completed`` (with the messages delivered as it ended). A turn that
    ended any other way leaves it as it was, and so does a turn in flight.

    It holds the agent weakly: the agent keeps it (as a listener), and a cycle would keep both."""

    __slots__ = ("_agent", "messages")

    def __init__(self, agent: Agent) -> None:
        self.messages = agent.messages
        self._agent = weakref.ref(agent)
        agent.on_lifecycle(self._on_lifecycle)

    def _on_lifecycle(self, event: AgentLifecycleEvent) -> None:
        # Emitted as the turn lock is let go, before any other task runs: no next turn is in the log.
        if isinstance(event, TurnEnded) and event.result.stop_reason == "completed":
            agent = self._agent()
            if agent is not None:
                self.messages = agent.messages


class InProcessRun(DisposeOnExit):
    """A child agent in this process. Offers ``send_message`` and ``resume``, reports its liveness
    (``last_activity``, ``pending_permissions`` counting approvals, ``update_count``) and its
    :meth:`checkpoint`."""

    def __init__(self, provider: InProcessProvider, request: SubagentRequest, agent: Agent) -> None:
        self.provider = provider
        self.request = request
        self.agent = agent
        """The child agent: its log, tools and persona, readable while it works."""
        self._completed = _CompletedLog(agent)
        self._result: Outcome[SubagentResult] = Outcome()  # the first turn's
        self._done = anyio.Event()
        self._cancelled_before_turn = False
        self._disposing = False
        self.workspace: Workspace | None = None
        """The child's isolated workspace (``request.isolation``), once made; None without isolation."""
        # Set once the child can work: at once, or when its workspace is made (or failed to be).
        self._ready = anyio.Event()
        self._start_error: SubagentError | None = None
        if request.isolation is None:
            self._ready.set()

    @property
    def id(self) -> str:
        """The run's id, which is also the child agent's id."""
        return self.agent.id

    def __repr__(self) -> str:
        if self._disposing:
            state = "disposed"
        elif self._result.is_set():
            state = "idle"
        else:
            state = "working"
        return f"<InProcessRun {self.id!r} provider={self.provider.name!r} {state}>"

    # -- liveness ----------------------------------------------------------------------------------

    @property
    def last_activity(self) -> float | None:
        """When the child's model or a tool last showed a sign of life (``time.monotonic()``)."""
        return self.agent.last_activity

    @property
    def pending_permissions(self) -> int:
        """Tool calls of the child waiting for approval now."""
        return self.agent.pending_approvals

    @property
    def update_count(self) -> int:
        """Deltas and tool calls the child produced so far."""
        return self.agent.update_count

    def checkpoint(self) -> dict[str, Any] | None:
        """What a new child needs to continue this run (:meth:`InProcessProvider.reopen`):
        ``{"messages": [...], "cwd": ...}``, the child's log as of its last completed turn (see
        :mod:`subagent.runtime._log_codec`) and its working directory. From the start on (a fork's
        seeded log, a persona); a turn in flight, or one that ended other than ``completed``
        (cancelled, failed, timed out, stopped by a limit), is not in it. None when the child never
        got to work (its workspace could not be made)."""
        if self._start_error is not None:
            return None
        return {"messages": encode_log(self._completed.messages), "cwd": self.agent.cwd}

    # -- the SubagentRun protocol ---------------------------------------------------------------

    async def started(self) -> None:
        """Return at once unless disposed: the child agent exists from ``start()`` on; with
        ``isolation``, once its workspace is made.

        Raises:
            SubagentError: ``DISPOSED`` when the run was disposed before its turn began;
                ``START_FAILED`` when its workspace could not be made.
        """
        if not self._ready.is_set():  # waiting on a set event still yields, reordering the runs
            await self._ready.wait()
        if self._start_error is not None:
            raise self._start_error
        if self._disposing and self._result.error is not None:
            self._result.get()  # raises it

    async def result(self) -> SubagentResult:
        """The first turn's outcome; a failing model call is an ``error`` result, not an exception.

        Raises:
            SubagentError: ``DISPOSED`` when the run was disposed before the turn ended.
        """
        return await self._result.wait()

    async def cancel(self) -> None:
        """Stop the running turn: ``result()`` settles with ``cancelled``. Messages still queued are
        delivered into the child's log (the cancelled turn's end is an idle point).

        After the first turn settled, this stops a turn started with :meth:`resume`, if one runs:
        that ``resume()`` returns a ``cancelled`` result.
        """
        # The agent's own cancel reaches a turn in flight, or one taking its lock right now.
        self.agent.cancel()
        if self._result.is_set():
            return
        self._cancelled_before_turn = True  # if the first turn has not begun, it never will
        await self._result.wait_settled()

    async def dispose(self) -> None:
        """Stop the child: cancel its turn, refuse its queued messages with the reason, take it out
        of the registry. Idempotent; returns once no task of the run is left."""
        if not self._disposing:
            self._disposing = True
            budget = self.agent.budget
            # A turn its budget is stopping ends with that (its parent's call, stopped by the same cap,
            # disposes it at that very moment): it is let end and tell so, rather than be "disposed".
            stopping = budget is not None and budget.exhausted is not None and self.agent.busy
            if not self._result.is_set() and not stopping:
                self._result.fail(self._disposed_error("before its turn ended"))
        with anyio.CancelScope(shield=True):
            await self.agent.close(DISPOSED_REASON)
            await self._done.wait()
            if self.workspace is not None:
                await self.workspace.close()

    async def send_message(self, text: str) -> None:
        """Send ``text`` to the child: at once into its log when it is idle, else at its next idle
        point (between model calls, or the end of the turn).

        Raises:
            SubagentError: ``DISPOSED`` once the run is disposed.
        """
        if self._disposing:
            raise self._disposed_error("so it takes no more messages")
        try:
            self.agent.send_message(text)
        except AgentClosedError as exc:
            raise self._disposed_error("so it takes no more messages") from exc

    async def resume(self, prompt: str) -> SubagentResult:
        """Run another turn in the same child (after the first ended) and return how it ended.

        Raises:
            SubagentError: ``DISPOSED`` once the run is disposed.
        """
        await self._result.wait_settled()
        if self._disposing:
            raise self._disposed_error("so it takes no more turns")
        try:
            outcome = await self.agent.run_turn(prompt, idle_timeout=self.request.timeout)
        except AgentClosedError as exc:
            raise self._disposed_error("so it takes no more turns") from exc
        if self._disposing:
            # dispose() cut the turn short: the same outcome as a first turn disposed mid-way.
            raise self._disposed_error("before its resumed turn ended")
        return await self._with_workspace(self._with_budget(outcome), prompt)

    def _with_budget(self, outcome: SubagentResult) -> SubagentResult:
        budget = self.agent.budget
        return outcome if budget is None else budget_result(outcome, budget)

    async def _with_workspace(self, outcome: SubagentResult, prompt: str) -> SubagentResult:
        """The turn's work committed on the child's branch, and said in the result."""
        if self.workspace is None:
            return outcome
        try:  # shielded in Workspace.commit: recorded even when the run is torn down
            change = await self.workspace.commit(prompt)
        except IsolationError as exc:
            logger.error("run %r: its workspace's work could not be committed: %s", self.id, exc)
            return outcome
        return dataclasses.replace(outcome, workspace=change)

    async def _open_workspace(self) -> bool:
        """Make the child's workspace and move the child into it; whether it can work."""
        request = self.request
        assert request.isolation is not None
        try:
            self.workspace = await open_workspace(
                self.agent.cwd or os.getcwd(),
                self.id,
                request.isolation,
                settings=self.provider.isolation,
                cleanup=request.cleanup,
            )
        except IsolationError as exc:
            self._start_error = SubagentError(
                ErrorCode.START_FAILED,
                f"provider {self.provider.name!r}: the child's workspace could not be made: {exc}",
                provider=self.provider.name,
            )
            self._result.fail(self._start_error)
            return False
        finally:
            self._ready.set()
        self.agent.cwd = self.workspace.cwd
        return True

    # -- the first turn, in the service's task group -----------------------------------------------

    async def _main(self) -> None:
        try:
            if self.request.isolation is not None and not await self._open_workspace():
                return
            if self._cancelled_before_turn or self._disposing:
                self._result.settle(SubagentResult(output="", stop_reason="cancelled"))
                return
            outcome = await self.agent.run_turn(
                self.request.prompt,
                output_schema=self.request.output_schema,
                idle_timeout=self.request.timeout,
            )
            outcome = await self._with_workspace(self._with_budget(outcome), self.request.prompt)
            # dispose() settles the result itself (DISPOSED) before the agent's turn comes back.
            self._result.settle(outcome)
        except AgentClosedError:
            self._result.fail(self._disposed_error("before its turn began"))
        except Exception as exc:
            # A bug, not a child-level failure: fail this run, never the service's task group.
            logger.exception("run %r of provider %r failed unexpectedly", self.id, self.provider.name)
            self._result.settle(
                SubagentResult(output="", stop_reason="error", error=f"internal error: {exc!r}")
            )
        finally:
            # Cancelled from outside (the service's task group): no waiter may hang on the result.
            self._result.settle(SubagentResult(output="", stop_reason="cancelled"))
            self._ready.set()
            self._done.set()

    def _disposed_error(self, when: str) -> SubagentError:
        return SubagentError.disposed(self.id, when, provider=self.provider.name)
