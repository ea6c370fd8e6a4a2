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
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Sequence

import anyio
import anyio.abc

from subagent import _structured
from subagent._outcome import DisposeOnExit, Outcome
from subagent.budget import account_for, budget_result
from subagent.isolation import IsolationError, IsolationSettings, Workspace, open_workspace
from subagent.runtime._inprocess_agent import DEFAULT_MAX_MODEL_CALLS, Agent, AgentClosedError, AgentRegistry
from subagent.runtime._llm import LlmAdapter, LlmService
from subagent.runtime._messages import Message
from subagent.runtime._tools import Approver, Tool
from subagent.types import (
    BUDGET_FIELDS,
    ErrorCode,
    Lineage,
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

    def start(self, request: SubagentRequest, task_group: anyio.abc.TaskGroup) -> InProcessRun:
        """Create the child agent now and run its first turn in ``task_group``.

        Raises:
            SubagentError: ``START_FAILED`` when the child cannot be made (no LLM adapter, a fork
                without a live in-process parent, an invalid output schema).
        """
        if request.output_schema is not None:
            try:
                _structured.check_schema(request.output_schema)
            except Exception as exc:
                raise self._cannot_start(f"the output schema is not a valid JSON Schema: {exc}") from exc
        lineage = request.lineage or Lineage(depth=1)
        parent = self.agents.get(request.parent_id) if request.parent_id is not None else None
        run_id = f"{self.name}-{next(_run_ids)}"
        agent = Agent(
            llm=self._llm_for(parent),
            id=run_id,
            parent_id=request.parent_id,
            depth=lineage.depth,
            # The request's directory, else the parent's: a child works where it was sent.
            cwd=request.cwd if request.cwd is not None else (parent.cwd if parent is not None else None),
            persona=self._persona_for(request, parent),
            tools=self._tools_for(parent, lineage),
            history=self._history_for(request, parent),
            approver=self.approver if self.approver is not None else (parent.approver if parent else None),
            max_model_calls=self.max_model_calls,
            registry=self.agents,
            budget=account_for(request),
        )
        run = InProcessRun(self, request, agent)
        try:
            task_group.start_soon(run._main, name=f"{self.name} run {run.id}")
        except BaseException:
            self.agents._remove(agent)  # never started: it must not stay findable
            raise
        return run

    # -- what a child is made of (the fork provider overrides the history and defaults) ----------

    def _history_for(self, request: SubagentRequest, parent: Agent | None) -> Sequence[Message]:
        return ()

    def _persona_for(self, request: SubagentRequest, parent: Agent | None) -> str | None:
        return request.persona if request.persona is not None else self.persona

    def _llm_for(self, parent: Agent | None) -> LlmAdapter:
        if isinstance(self.llm, str):
            assert self.llm_service is not None
            try:
                return self.llm_service.require(self.llm)
            except KeyError as exc:
                raise self._cannot_start(str(exc.args[0])) from exc
        if self.llm is not None:
            return self.llm
        if parent is not None:
            return parent.llm
        raise self._cannot_start(
            "no LLM adapter: the provider has none and the parent is not an in-process agent"
        )

    def _tools_for(self, parent: Agent | None, lineage: Lineage) -> tuple[Tool, ...]:
        # A child's tools are its parent's (the provider's own for a root parent), narrowed.
        base = parent.tools if parent is not None else self.tools
        narrowing = lineage.tool_filter
        if narrowing is None:
            return base
        return tuple(tool for tool in base if narrowing.permits(tool.spec.name))

    def _cannot_start(self, why: str) -> SubagentError:
        return SubagentError(ErrorCode.START_FAILED, f"provider {self.name!r}: {why}", provider=self.name)


class InProcessRun(DisposeOnExit):
    """A child agent in this process. Offers ``send_message`` and ``resume``, and reports its
    liveness (``last_activity``, ``pending_permissions`` counting approvals, ``update_count``)."""

    def __init__(self, provider: InProcessProvider, request: SubagentRequest, agent: Agent) -> None:
        self.provider = provider
        self.request = request
        self.agent = agent
        """The child agent: its log, tools and persona, readable while it works."""
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
