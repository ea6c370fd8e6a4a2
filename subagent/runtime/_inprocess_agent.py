"""The in-process agent: a message log, a persona, tools, an LLM adapter, and the turn loop.

A turn appends the prompt, then loops: deliver injected messages, call the model, run the tool
calls it asked for, call the model again, until the model answers without tools. Idle points are
the moments between model calls and the end of the turn: messages sent with :meth:`Agent.send_message`
while a turn runs wait in a queue until the next one. A message sent while no turn runs goes into
the log at once (the agent is idle now), so the next turn sees it. Closing the agent refuses what
is still queued, with the reason, to the sender and in the log: a message is delivered or refused,
never dropped.

Turn results are :class:`~subagent.types.SubagentResult` values: the seam's vocabulary, so a
provider hands them on unchanged.

Tracing (:mod:`subagent.observability`, when a tracer provider is configured): each model call is a
``chat`` span with the completion's token counts and finish reason, each tool call an
``execute_tool`` span (current while the tool runs, so what it starts nests below it), and each
wait for the approver a ``permission_wait`` span inside it; all below the span current when the
turn runs (a run's ``invoke_agent`` span, for a child of the seam's providers).
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import sys
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import anyio

from subagent import _structured
from subagent._outcome import Outcome, raise_sole_error
from subagent.events import Listeners
from subagent.observability import _telemetry as telemetry
from subagent.runtime._llm import LlmAdapter, LlmError, LlmErrorKind
from subagent.runtime._messages import (
    Completion,
    CompletionRequest,
    Message,
    Retrying,
    TextDelta,
    ToolCall,
    ToolCallDelta,
)
from subagent.runtime._tools import (
    Approver,
    InvalidArguments,
    Tool,
    ToolContext,
    ToolError,
    ToolInvocation,
    parse_arguments,
)
from subagent.types import (
    _TOKEN_FIELDS,
    BudgetField,
    Disposer,
    LimitHit,
    StopReason,
    SubagentResult,
    Usage,
    freeze_json,
    thaw_json,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from subagent.budget import BudgetAccount, Reservation

__all__ = [
    "DEFAULT_MAX_MODEL_CALLS",
    "Agent",
    "AgentClosed",
    "AgentClosedError",
    "AgentEvent",
    "AgentLifecycleEvent",
    "AgentRegistry",
    "MessageDelivered",
    "MessageRefused",
    "MessageRefusedError",
    "ModelCallStarted",
    "PendingMessage",
    "ToolCallFinished",
    "ToolCallStarted",
    "TurnCancelRequested",
    "TurnEnded",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_CALLS = 32
"""Model calls one turn may make before it stops with ``max_turns``: a model that keeps calling
tools forever costs money and never answers."""


_TURNS_IN_FLIGHT: contextvars.ContextVar[tuple[Agent, ...]] = contextvars.ContextVar(
    "subagent_runtime_turns_in_flight", default=()
)
"""The agents whose turn the current code runs inside (its tools and approver inherit it): closing
one of them from there must not wait for that turn to end, which waits for the caller."""

_UNFINISHED = "error: the turn ended before this call finished"

_TEMPLATE_TOKENS = 8
"""Tokens a chat template may add per message (role markers, separators): part of a call's input estimate."""


def _nothing() -> None:
    return None


def _model_name(llm: LlmAdapter) -> str | None:
    model = getattr(llm, "model", None)
    return model if isinstance(model, str) and model else None


async def _expire_at_deadline(budget: BudgetAccount) -> None:
    """Sleep until the budget's deadline, then exhaust it: the turn's listener stops the turn."""
    deadline = budget.deadline
    if deadline is None:
        return
    await anyio.sleep(max(0.0, deadline - time.monotonic()))
    budget.expire()


"""The result of a tool call the turn ended before: chat APIs refuse a call without a result."""


class AgentClosedError(RuntimeError):
    """The agent was closed: it takes no more turns and no more messages."""


class MessageRefusedError(Exception):
    """A message sent to an agent was refused; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PendingMessage:
    """A message sent to an agent: queued until the next idle point, then delivered or refused."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.status: Literal["queued", "delivered", "refused", "withdrawn"] = "queued"
        self.reason: str | None = None
        """Why the message was refused, when it was."""
        self._outcome: Outcome[None] = Outcome()

    def __repr__(self) -> str:
        return f"<PendingMessage {self.status} {self.text[:40]!r}>"

    async def wait(self) -> None:
        """Return once the message is in the agent's log.

        Raises:
            MessageRefusedError: the message was refused (the agent closed first), with the reason.
        """
        await self._outcome.wait()

    def _deliver(self) -> None:
        self.status = "delivered"
        self._outcome.settle(None)

    def _refuse(self, reason: str) -> None:
        self.status = "refused"
        self.reason = reason
        self._outcome.fail(MessageRefusedError(reason))

    def _withdraw(self) -> None:
        self.status = "withdrawn"
        self.reason = "withdrawn by its sender before it was delivered"
        self._outcome.fail(MessageRefusedError(self.reason))


# -- events -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolCallStarted:
    """A tool call is about to run (after approval, when it needed one)."""

    invocation: ToolInvocation


@dataclass(frozen=True, slots=True)
class ToolCallFinished:
    """A tool call ended; ``output`` is what the model reads."""

    call: ToolCall
    output: str
    is_error: bool


@dataclass(frozen=True, slots=True)
class MessageDelivered:
    """A message sent with ``send_message`` entered the log."""

    text: str


@dataclass(frozen=True, slots=True)
class MessageRefused:
    """A message sent with ``send_message`` was refused, with the reason."""

    text: str
    reason: str


AgentEvent = (
    TextDelta
    | ToolCallDelta
    | Retrying
    | ToolCallStarted
    | ToolCallFinished
    | MessageDelivered
    | MessageRefused
)
"""What an agent reports to its listeners while it works, in order (a :class:`Retrying` when its
model adapter retries a failed call)."""


@dataclass(frozen=True, slots=True)
class ModelCallStarted:
    """A model call of the turn begins: the idle point before it has passed (queued messages are in
    the log, so the model sees them)."""

    index: int
    """1 for the turn's first call."""


@dataclass(frozen=True, slots=True)
class TurnEnded:
    """A turn ended, with how (queued messages were delivered into the log just before)."""

    result: SubagentResult


@dataclass(frozen=True, slots=True)
class TurnCancelRequested:
    """:meth:`Agent.cancel` reached a turn in flight (or one beginning)."""


@dataclass(frozen=True, slots=True)
class AgentClosed:
    """:meth:`Agent.close` was called; ``reason`` is what queued messages were refused with."""

    reason: str


AgentLifecycleEvent = ModelCallStarted | TurnEnded | TurnCancelRequested | AgentClosed
"""What happens to an agent as a whole (:meth:`Agent.on_lifecycle`), apart from the work it reports
as :data:`AgentEvent`: for owners of things bound to its turns or its life, such as its background
children."""


# -- what a tool sees ---------------------------------------------------------------------------------


class _AgentContext:
    """An agent as its tools see it (a :class:`~subagent.runtime.ToolContext`): its id and cwd,
    and its activity clock. Nothing here leads back to the agent by a public attribute, so a tool
    cannot close it or run a turn on it; the reference is weak, so a kept invocation does not keep
    a dropped agent alive (nor make a cycle that only the garbage collector breaks)."""

    __slots__ = ("_agent", "_id")

    def __init__(self, agent: Agent) -> None:
        self._agent = weakref.ref(agent)
        self._id = agent.id

    def __repr__(self) -> str:
        return f"<ToolContext of agent {self._id!r}>"

    @property
    def id(self) -> str:
        """The agent's id."""
        return self._id

    @property
    def cwd(self) -> str | None:
        """The agent's working directory (None when unset or the agent is gone)."""
        agent = self._agent()
        return agent.cwd if agent is not None else None

    def touch(self) -> None:
        """Record a sign of life on the agent's activity clock (nothing once the agent is gone)."""
        agent = self._agent()
        if agent is not None:
            agent.touch()


def _calling_agent(context: ToolContext) -> Agent | None:
    """The agent behind a tool context of this runtime (None for another context, or a dropped agent).

    For the library's own tools that owe the caller something beyond the call: the subagent tool's
    background children report to their parent agent and die with it. Not for tools in general.
    """
    return context._agent() if isinstance(context, _AgentContext) else None


# -- the registry -------------------------------------------------------------------------------------


class AgentRegistry:
    """The live agents of a context, by id.

    An agent joins the registry it is made with (the process-wide :meth:`default` one unless given
    another) and leaves it when closed, so ``get`` never returns a closed agent. The registry holds
    agents weakly: one that nothing else keeps (never closed, and dropped) leaves by itself rather
    than stay forever. In-process providers look parents up here and put their children here.
    """

    _default: AgentRegistry | None = None

    def __init__(self) -> None:
        self._agents: weakref.WeakValueDictionary[str, Agent] = weakref.WeakValueDictionary()
        self._newest_wins = False

    @classmethod
    def default(cls) -> AgentRegistry:
        """The process-wide registry: where agents made without one live, and what in-process
        providers made without one use, so that a fork finds its parent with no wiring at all.

        Unlike a registry of your own, it lets a new agent take an id another live agent has (the
        newer one is found from then on): code that never meant to share it cannot collide there.
        """
        if cls._default is None:
            cls._default = cls()
            cls._default._newest_wins = True
        return cls._default

    def get(self, agent_id: str) -> Agent | None:
        """The live agent with that id, or None."""
        return self._agents.get(agent_id)

    def list(self) -> list[str]:
        """The ids of the live agents, oldest first."""
        return list(self._agents.keys())

    def register(self, agent: Agent) -> Disposer:
        """Make ``agent`` findable here until it is closed (or the disposer is called).

        Raises:
            ValueError: another live agent has that id (not raised by :meth:`default`).
        """
        current = self._agents.get(agent.id)
        if current is not None and current is not agent and not current.closed and not self._newest_wins:
            raise ValueError(f"an agent with id {agent.id!r} is already live")
        self._agents[agent.id] = agent
        agent._registries.append(self)
        return lambda: self._remove(agent)

    def __contains__(self, agent_id: object) -> bool:
        return agent_id in self._agents

    def __len__(self) -> int:
        return len(self._agents)

    def _remove(self, agent: Agent) -> None:
        if self._agents.get(agent.id) is agent:
            del self._agents[agent.id]


# -- the agent ----------------------------------------------------------------------------------------


class Agent:
    """An in-process agent.

    Args:
        llm: the adapter its model calls go through.
        id: its id (default: a fresh ``agent-…`` id). Runs of the spawn and fork providers use
            the run's id, so ``registry.get(info.id)`` finds the child of a ``subagent/start``.
        parent_id: the id of the agent that started it, if any.
        depth: how far below the root of its chain it is (the root is 0).
        cwd: the directory its work is about, for tools that touch files (they read it as
            ``invocation.context.cwd``); the runtime itself never uses it.
        persona: the system prompt; the first message of the log when given.
        tools: what it can call. Names must be unique.
        history: messages it starts with (a fork's seed); counted as completed turns.
        approver: decides on calls of tools that need approval; without one they are refused.
        max_model_calls: how many model calls one turn may make before it stops with ``max_turns``.
        registry: where it is live until :meth:`close` (default: :meth:`AgentRegistry.default`).
        budget: the account its spending is charged to (:class:`~subagent.budget.BudgetAccount`).
            Before each model call the call's worst case is reserved on it (the input, estimated from
            the last call's reported counts plus one token per byte of what was added since, and, when
            the adapter bounds a call's output (``bounds_output``), the output it is allowed); before
            each tool call, one tool call. A step that cannot fit, a cap passed, the deadline, or the
            account exhausted from elsewhere in the tree ends the turn with ``budget``.
    """

    def __init__(
        self,
        *,
        llm: LlmAdapter,
        id: str | None = None,
        parent_id: str | None = None,
        depth: int = 0,
        cwd: str | None = None,
        persona: str | None = None,
        tools: Sequence[Tool] = (),
        history: Sequence[Message] = (),
        approver: Approver | None = None,
        max_model_calls: int = DEFAULT_MAX_MODEL_CALLS,
        registry: AgentRegistry | None = None,
        budget: BudgetAccount | None = None,
    ) -> None:
        if max_model_calls < 1:
            raise ValueError(f"max_model_calls must be >= 1, got {max_model_calls}")
        names = [tool.spec.name for tool in tools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"tool names must be unique; repeated: {', '.join(duplicates)}")
        self.id = id or f"agent-{uuid.uuid4().hex[:12]}"
        self.parent_id = parent_id
        self.depth = depth
        self.cwd = cwd
        self.persona = persona
        self.llm = llm
        self.tools: tuple[Tool, ...] = tuple(tools)
        self.approver = approver
        self.max_model_calls = max_model_calls
        self._log: list[Message] = []
        if persona:
            self._log.append(Message.system(persona))
        self._log.extend(history)
        self._completed_end = len(self._log)
        self._turn_start = len(self._log)
        self._streamed: list[str] = []  # text deltas of the model call in flight
        self._inbox: deque[PendingMessage] = deque()
        self._listeners: Listeners[AgentEvent] = Listeners(
            logger, f"agent {self.id}: an event listener raised"
        )
        self._lifecycle: Listeners[AgentLifecycleEvent] = Listeners(
            logger, f"agent {self.id}: a lifecycle listener raised"
        )
        self._turn_scope: anyio.CancelScope | None = None
        self._turn_lock = anyio.Lock()
        self._cancel_next_turn = False  # cancel() arrived while a turn was taking the lock
        self._closed = False
        self._last_activity: float | None = None
        self._pending_approvals = 0
        self._update_count = 0
        self._registries: list[AgentRegistry] = []
        self._context = _AgentContext(self)
        self.budget = budget
        """The account its spending is charged to, when it runs under a budget."""
        self._budget_hit: LimitHit | None = None  # the cap that stopped the turn in flight
        self._settling = False  # charging its own model call: a cap that passes is the loop's to handle
        self._known_tokens = 0  # the last model call's input plus output, as reported
        self._known_upto = 0  # the log's length at that call: what is counted in _known_tokens
        (registry if registry is not None else AgentRegistry.default()).register(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("busy" if self.busy else "idle")
        return f"<Agent {self.id!r} depth={self.depth} {state}>"

    # -- what can be read ---------------------------------------------------------------------------

    @property
    def context(self) -> ToolContext:
        """What its tools see of it (``invocation.context``): always the same object, so a wrapper
        tool can tell this agent's calls from others' by identity."""
        return self._context

    @property
    def messages(self) -> tuple[Message, ...]:
        """The whole log, a turn in flight included."""
        return tuple(self._log)

    @property
    def completed_messages(self) -> tuple[Message, ...]:
        """The log up to the end of the last turn that ended: never a turn in flight."""
        return tuple(self._log[: self._completed_end])

    @property
    def busy(self) -> bool:
        """Whether a turn is in flight."""
        return self._turn_scope is not None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def pending_messages(self) -> tuple[PendingMessage, ...]:
        """Messages waiting for the next idle point."""
        return tuple(self._inbox)

    @property
    def last_activity(self) -> float | None:
        """``time.monotonic()`` of the model's or a tool's last sign of life; None before any turn."""
        return self._last_activity

    @property
    def pending_approvals(self) -> int:
        """Tool calls waiting for the approver now."""
        return self._pending_approvals

    @property
    def update_count(self) -> int:
        """Deltas and tool calls seen so far, over every turn."""
        return self._update_count

    def tool(self, name: str) -> Tool | None:
        """The tool of that name, or None."""
        return next((tool for tool in self.tools if tool.spec.name == name), None)

    def on_event(self, listener: Callable[[AgentEvent], object]) -> Disposer:
        """Call ``listener`` with each event, in order; returns the disposer. A listener that raises is
        logged and changes nothing."""
        return self._listeners.add(listener)

    def on_lifecycle(self, listener: Callable[[AgentLifecycleEvent], object]) -> Disposer:
        """Call ``listener`` when a model call begins, a turn ends, a turn is cancelled or the agent
        closes; returns the disposer. A listener that raises is logged and changes nothing."""
        return self._lifecycle.add(listener)

    # -- messages -----------------------------------------------------------------------------------

    def send_message(self, text: str) -> PendingMessage:
        """Send ``text`` to the agent: into the log now when it is idle, else at the next idle point.

        Raises:
            AgentClosedError: the agent is closed.
        """
        if self._closed:
            raise AgentClosedError(f"agent {self.id!r} is closed")
        pending = PendingMessage(text)
        self._inbox.append(pending)
        if not self.busy:
            self._deliver_pending()
        return pending

    def withdraw_message(self, pending: PendingMessage) -> bool:
        """Take back a message that is still queued: True when it was (it will never enter the log;
        its ``wait()`` raises :class:`MessageRefusedError`), False when it was delivered or refused
        already. For a sender whose news reached the agent another way first."""
        try:
            self._inbox.remove(pending)
        except ValueError:
            return False
        pending._withdraw()
        return True

    def _deliver_pending(self) -> bool:
        delivered = False
        while self._inbox:
            pending = self._inbox.popleft()
            self._log.append(Message.user(pending.text))
            pending._deliver()
            self._listeners.emit(MessageDelivered(pending.text))
            delivered = True
        return delivered

    # -- turns --------------------------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop the turn in flight, if any: it ends with ``cancelled``. The agent stays usable.

        A turn that is beginning (its ``run_turn`` is taking the turn lock) counts as in flight: it
        begins cancelled. A ``run_turn`` whose task has not run at all yet is not affected.
        """
        if self._turn_scope is not None:
            self._turn_scope.cancel()
        elif self._turn_lock.locked():
            self._cancel_next_turn = True
        else:
            return
        self._lifecycle.emit(TurnCancelRequested())

    async def run_turn(
        self,
        prompt: str,
        *,
        output_schema: Any = None,
        idle_timeout: float | None = None,
    ) -> SubagentResult:
        """Run one turn and return how it ended. One turn at a time; a second call waits its turn.

        ``output_schema``: the answer must be JSON matching it; it is asked for, validated, and
        repaired once, else the turn ends with ``error``. ``idle_timeout``: seconds without a sign
        of life from the model or a tool before the turn ends with ``timeout`` (time spent waiting
        for approval does not count).

        Raises:
            AgentClosedError: the agent is closed.
        """
        async with self._turn_lock:
            try:
                if self._closed:
                    raise AgentClosedError(f"agent {self.id!r} is closed")
                inside = _TURNS_IN_FLIGHT.set((*_TURNS_IN_FLIGHT.get(), self))
                try:
                    result = await self._run_turn_locked(prompt, output_schema, idle_timeout)
                finally:
                    _TURNS_IN_FLIGHT.reset(inside)
            finally:
                # A cancel() meant for this turn must never reach the next one.
                self._cancel_next_turn = False
        self._lifecycle.emit(TurnEnded(result))
        return result

    async def _run_turn_locked(
        self, prompt: str, output_schema: Any, idle_timeout: float | None
    ) -> SubagentResult:
        """The turn itself, with the turn lock held."""
        scope = anyio.CancelScope()
        self._turn_scope = scope
        if self._cancel_next_turn:
            self._cancel_next_turn = False
            scope.cancel()  # cancel() came while this turn was taking the lock
        timed_out = False
        usage = _UsageSum()
        outcome: SubagentResult | None = None
        self._budget_hit = None
        stop_listening: Disposer = _nothing
        if self.budget is not None:
            hit = self.budget.check()
            if hit is not None:
                self._turn_scope = None
                return self._budget_stopped(hit, "", usage)

            def on_exhausted(hit: LimitHit) -> None:
                # A cap passed elsewhere in the tree, or the deadline: the turn stops now. A cap its own
                # model call passed is the loop's to handle (a final answer that passed it stays whole).
                if self._budget_hit is None:
                    self._budget_hit = hit
                if not self._settling:
                    scope.cancel()

            stop_listening = self.budget.on_exhausted(on_exhausted)
        try:
            with scope:
                async with anyio.create_task_group() as task_group:
                    if idle_timeout is not None:

                        async def on_idle() -> None:
                            nonlocal timed_out
                            timed_out = True
                            scope.cancel()

                        task_group.start_soon(self._watch_idle, idle_timeout, on_idle)
                    if self.budget is not None and self.budget.deadline is not None:
                        task_group.start_soon(_expire_at_deadline, self.budget)
                    outcome = await self._turn(prompt, output_schema, usage)
                    task_group.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # A bug (an adapter raising something other than LlmError) is raised as itself.
            raise_sole_error(group)
            raise
        finally:
            stop_listening()
            self._turn_scope = None
            self._close_dangling_calls()
            self._completed_end = len(self._log)
            if not self._closed:
                self._deliver_pending()
        # Cancelled (or timed out) while in flight, the turn ends so even if its answer came in the
        # same step: whoever cancelled is told what they asked for, and the answer is the output.
        if outcome is None or scope.cancel_called:
            output = self._partial_output() if outcome is None else outcome.output
            hit = self._stopping_hit()  # set meanwhile by the budget's listener or a refused tool call
            if hit is not None and not timed_out:
                return self._budget_stopped(hit, output, usage)
            reason: StopReason = "timeout" if timed_out else "cancelled"
            return SubagentResult(
                output=output,
                stop_reason=reason,
                error=f"no sign of life from the model or a tool for {idle_timeout:g} s"
                if timed_out and idle_timeout is not None
                else None,
                usage=usage.total(),
                limit=LimitHit("timeout", idle_timeout, idle_timeout) if timed_out and idle_timeout else None,
                output_final=outcome is not None and outcome.stop_reason == "completed",
            )
        outcome.usage = usage.total()
        return outcome

    def _stopping_hit(self) -> LimitHit | None:
        return self._budget_hit

    def _budget_stopped(self, hit: LimitHit, output: str, usage: _UsageSum) -> SubagentResult:
        currency = self.budget.spent().cost_currency if self.budget is not None else None
        return SubagentResult(
            output=output,
            stop_reason="budget",
            error=f"stopped by its budget: {hit.describe(currency)}",
            usage=usage.total(),
            limit=hit,
            output_final=False,
        )

    async def _turn(self, prompt: str, output_schema: Any, usage: _UsageSum) -> SubagentResult:
        self._turn_start = len(self._log)
        self._touch()
        wanted = freeze_json(output_schema) if output_schema is not None else None
        text = prompt if wanted is None else _structured.ask_for_json(prompt, wanted)
        self._log.append(Message.user(text))
        result = await self._loop(wanted, usage)
        if wanted is None:
            return result

        async def repair_turn(repair: str) -> SubagentResult:
            self._log.append(Message.user(repair))
            return await self._loop(wanted, usage)

        return await _structured.accept_or_repair(result, wanted, repair_turn, who=f"agent {self.id}")

    async def _loop(self, wanted: Any, usage: _UsageSum) -> SubagentResult:
        calls = 0
        while True:
            # A turn cancelled by code that did not yield since (a tool calling cancel() or close())
            # ends here rather than start one more model call.
            await anyio.lowlevel.checkpoint_if_cancelled()
            if calls >= self.max_model_calls:
                last = self._log[-1]
                if last.role == "assistant" and not last.tool_calls:
                    # It did answer; messages that arrived meanwhile wait for the next turn (they go
                    # into the log as the turn ends) rather than turn the answer into a failure.
                    return SubagentResult(output=last.content, stop_reason="completed")
                return SubagentResult(
                    output=self._partial_output(),
                    stop_reason="max_turns",
                    error=f"the model asked for tools {calls} times in one turn without answering",
                )
            self._deliver_pending()  # an idle point: before each model call
            reservation: Reservation | None = None
            max_tokens: int | None = None
            if self.budget is not None:
                reserved = await self._reserve_model_call()
                if isinstance(reserved, LimitHit):
                    return self._budget_stopped(reserved, self._partial_output(), usage)
                reservation, max_tokens, bound_by = reserved
            calls += 1
            self._lifecycle.emit(ModelCallStarted(calls))
            try:
                completion = await self._call_model(wanted, max_tokens)
            except LlmError as exc:
                if reservation is not None:
                    reservation.settle(tokens=0)  # the call was made (a turn); what it cost is not known
                return SubagentResult(
                    output=self._partial_output(),
                    stop_reason="error",
                    error=f"the model call failed ({exc.kind.value}): {exc.message}",
                )
            except BaseException:
                if reservation is not None:
                    # Cut short mid-call: the input was spent, the output so far is not reported.
                    reservation.settle(tokens=self._estimate())
                raise
            usage.add(completion.usage)
            message = completion.message
            self._log.append(message)
            hit = self._settle_model_call(reservation, completion) if reservation is not None else None
            if max_tokens is not None and completion.finish_reason == "length" and self.budget is not None:
                # Cut by the output the budget allowed it, not by the model's own limit.
                hit = hit or self.budget.spent_limit(bound_by)
            if hit is not None and (message.tool_calls or completion.finish_reason == "length"):
                # The cap is passed: the tools it asked for are not run; the answer so far is the output.
                self._close_dangling_calls()
                return self._budget_stopped(hit, message.content, usage)
            if completion.finish_reason == "length":
                return SubagentResult(output=message.content, stop_reason="max_tokens")
            if completion.finish_reason == "content_filter":
                return SubagentResult(output=message.content, stop_reason="refusal")
            if message.tool_calls:
                await self._run_tool_calls(message.tool_calls)
                continue
            if self._inbox:
                continue  # messages arrived during the call: the model answers them before the turn ends
            return SubagentResult(output=message.content, stop_reason="completed")

    async def _reserve_model_call(self) -> tuple[Reservation, int | None, BudgetField] | LimitHit:
        """Reserve the next model call's worst case on the budget: its input, plus its output when the
        adapter bounds it (the output allowed is then what is left after the input, by what was spent;
        while other calls' reservations hold that room, it waits for them to settle)."""
        assert self.budget is not None
        while True:
            sized = self._size_model_call()
            if isinstance(sized, LimitHit):
                return sized
            amounts, max_tokens, bound_by = sized
            reserved = self.budget.try_reserve(**amounts)
            if reserved is None:
                await self.budget.wait_released()
                continue
            if isinstance(reserved, LimitHit):
                return reserved
            return reserved, max_tokens, bound_by

    def _size_model_call(self) -> tuple[dict[str, Any], int | None, BudgetField] | LimitHit:
        assert self.budget is not None
        estimate = self._estimate()
        room = self.budget.remaining(reserved=False)
        model = _model_name(self.llm)
        price = self.budget.prices.price(model) if self.budget.prices is not None else None
        max_tokens: int | None = None
        bound_by: BudgetField = "max_tokens"  # the cap that sets max_tokens
        if getattr(self.llm, "bounds_output", False):
            # The output it may produce: what is left of the tokens after the input, and of the cost
            # after the input's price.
            if room.max_tokens is not None:
                max_tokens = room.max_tokens - estimate
                if max_tokens < 1:
                    return self.budget.spent_limit("max_tokens", needed=estimate + 1)
            if room.max_cost is not None and price is not None and price.output > 0:
                affordable = (room.max_cost - price.cost(input_tokens=estimate)) * 1_000_000 / price.output
                if affordable < 1:
                    needed = price.cost(input_tokens=estimate, output_tokens=1)
                    return self.budget.spent_limit("max_cost", needed=needed)
                bound = math.floor(affordable)
                if max_tokens is None or bound < max_tokens:
                    max_tokens, bound_by = bound, "max_cost"
        reserve = estimate + (max_tokens or 0)
        priced = self.budget.cost_of(model, Usage(input_tokens=estimate, output_tokens=max_tokens or 0))
        amounts = {"tokens": reserve, "cost": priced[0] if priced else 0.0, "turns": 1}
        return amounts, max_tokens, bound_by

    def _settle_model_call(self, reservation: Reservation, completion: Completion) -> LimitHit | None:
        """Charge the call's reported usage (its estimate, when the adapter reports none)."""
        from subagent.budget import usage_tokens

        reported = completion.usage
        if reported is None:
            output = len(completion.message.content.encode()) + sum(
                len(call.arguments.encode()) for call in completion.message.tool_calls
            )
            reported = Usage(input_tokens=self._estimate(), output_tokens=output)
        tokens = usage_tokens(reported)
        self._known_tokens, self._known_upto = tokens, len(self._log)
        assert self.budget is not None
        priced = self.budget.cost_of(_model_name(self.llm), reported)
        cost, currency = priced if priced is not None else (0.0, None)
        self._settling = True
        try:
            return reservation.settle(tokens=tokens, cost=cost, currency=currency)
        finally:
            self._settling = False

    def _estimate(self) -> int:
        """An upper bound of the next call's input tokens: the last call's input and output as reported,
        plus, for what the log gained since, a token per byte (no tokenizer makes a token of less than a
        byte) and a few per message for the chat template."""
        upto = min(self._known_upto, len(self._log))
        added = self._log[upto:]
        size = sum(
            len(m.content.encode()) + sum(len(c.arguments.encode()) for c in m.tool_calls) for m in added
        )
        if upto == 0:
            size += sum(
                len(json.dumps(thaw_json(t.spec.parameters)).encode()) + len(t.spec.description.encode())
                for t in self.tools
            )
        return self._known_tokens + size + _TEMPLATE_TOKENS * max(1, len(added))

    async def _call_model(self, wanted: Any, max_tokens: int | None = None) -> Completion:
        request = CompletionRequest(
            messages=tuple(self._log),
            tools=tuple(tool.spec for tool in self.tools),
            response_schema=wanted,
            max_tokens=max_tokens,
        )
        span = _chat_span(self.llm) if telemetry.enabled() else None
        try:
            completion = await self._stream_completion(request)
        except BaseException as exc:
            telemetry.end_span(
                span, exc.kind.value if isinstance(exc, LlmError) else telemetry.error_type(exc)
            )
            raise
        if span is not None:
            telemetry.set_usage(span, completion.usage)
            span.set_attribute("gen_ai.response.finish_reasons", (completion.finish_reason,))
            telemetry.end_span(span)
        return completion

    async def _stream_completion(self, request: CompletionRequest) -> Completion:
        completion: Completion | None = None
        self._streamed = []
        stream = self.llm.stream(request)
        try:
            async for event in stream:
                self._touch()
                if isinstance(event, Completion):
                    completion = event
                    self._streamed = []  # the answer is in the log now, whole
                    break
                if isinstance(event, Retrying):
                    # A sign of life (touched above), not a delta: no update, nothing streamed.
                    self._listeners.emit(event)
                    continue
                self._update_count += 1
                if isinstance(event, TextDelta):
                    self._streamed.append(event.text)
                self._listeners.emit(event)
        finally:
            # Closed at once on every exit, so an abandoned completion releases its connection.
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
        if completion is None:
            raise LlmError(LlmErrorKind.PROTOCOL, "the adapter's stream ended without a completion")
        return completion

    # -- tools --------------------------------------------------------------------------------------

    async def _run_tool_calls(self, calls: Sequence[ToolCall]) -> None:
        outputs: list[tuple[str, bool] | None] = [None] * len(calls)

        async def run_one(index: int, call: ToolCall) -> None:
            outputs[index] = await self._run_tool_call(call)

        try:
            if len(calls) == 1:
                await run_one(0, calls[0])
            else:
                # Independent calls run together (several subagents at once); results keep call order.
                async with anyio.create_task_group() as task_group:
                    for index, call in enumerate(calls):
                        task_group.start_soon(run_one, index, call)
        finally:
            # Also when the turn is cut short: a call that finished keeps its real result (its work
            # is done, and the model must not be told otherwise); a call cut short says so.
            for call, produced in zip(calls, outputs, strict=True):
                output, is_error = produced if produced is not None else (_UNFINISHED, True)
                self._log.append(Message.tool_result(call, output))
                self._listeners.emit(ToolCallFinished(call, output, is_error))
            self._touch()

    async def _run_tool_call(self, call: ToolCall) -> tuple[str, bool]:
        """The call's output and whether it failed, inside its ``execute_tool`` span; not run when the
        budget has no tool call left (the turn then ends ``budget``)."""
        if self.budget is not None:
            # Charged as it starts (never reserved through the call: it may wait on a subagent of this
            # very budget); one that does not fit is not run, and the turn ends.
            refused = self.budget.take(tool_calls=1)
            if refused is not None:
                if self._budget_hit is None:
                    self._budget_hit = refused
                if self._turn_scope is not None:
                    self._turn_scope.cancel()
                return f"error: not run: the budget's {refused.limit} is reached", True
        return await self._run_tool_call_traced(call)

    async def _run_tool_call_traced(self, call: ToolCall) -> tuple[str, bool]:
        if not telemetry.enabled():
            output, failure = await self._execute_tool_call(call)
            return output, failure is not None
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": telemetry.clip_id(call.name),
            "gen_ai.tool.call.id": telemetry.clip_id(call.id),
            "gen_ai.tool.type": "function",
        }
        capture = telemetry.capture_content()
        if capture:
            attributes["gen_ai.tool.call.arguments"] = telemetry.clip(call.arguments)
        span = telemetry.start_span(f"execute_tool {telemetry.clip_id(call.name)}", "internal", attributes)
        try:
            with telemetry.current(span):
                output, failure = await self._execute_tool_call(call)
        except BaseException as exc:
            telemetry.end_span(span, telemetry.error_type(exc))
            raise
        if capture and span is not None:
            span.set_attribute("gen_ai.tool.call.result", telemetry.clip(output))
        telemetry.end_span(span, failure)
        return output, failure is not None

    async def _execute_tool_call(self, call: ToolCall) -> tuple[str, str | None]:
        """The call's output, and None or the low-cardinality kind of its failure."""
        self._update_count += 1
        tool = self.tool(call.name)
        if tool is None:
            known = ", ".join(repr(t.spec.name) for t in self.tools) or "none"
            return f"error: there is no tool named {call.name!r} (available: {known})", "unknown_tool"
        try:
            decoded = parse_arguments(call.arguments, tool.spec.parameters)
        except InvalidArguments as exc:
            return f"error: {exc}", "invalid_arguments"
        # Frozen once: the approver decides on this snapshot and the tool runs with the same one.
        invocation = ToolInvocation(call.id, call.name, freeze_json(decoded), self._context)
        if tool.needs_approval and not await self._approve(invocation):
            return "error: this tool call was not approved, so it did not run", "not_approved"
        self._listeners.emit(ToolCallStarted(invocation))
        try:
            output = await tool.run(invocation)
        except ToolError as exc:
            return f"error: {exc}", "tool_error"
        except Exception as exc:
            logger.exception("agent %s: tool %r raised", self.id, call.name)
            return f"error: the tool failed ({type(exc).__name__}: {exc})", type(exc).__qualname__
        finally:
            self._touch()
        return output, None

    async def _approve(self, invocation: ToolInvocation) -> bool:
        if self.approver is None:
            return False
        span = (
            telemetry.start_span(
                f"permission_wait {invocation.tool}",
                "internal",
                {
                    "gen_ai.tool.name": invocation.tool,
                    "gen_ai.tool.call.id": telemetry.clip_id(invocation.call_id),
                },
            )
            if telemetry.enabled()
            else None
        )
        self._pending_approvals += 1
        outcome = "denied"
        failure: str | None = None
        try:
            decision = self.approver(invocation)
            if not isinstance(decision, bool):
                decision = await decision
            if decision is True:
                outcome = "allowed"
            return decision is True
        except Exception as exc:
            logger.exception("agent %s: the approver raised; the call is refused", self.id)
            failure = type(exc).__qualname__
            return False
        except BaseException as exc:
            outcome, failure = "cancelled", telemetry.error_type(exc)
            raise
        finally:
            self._pending_approvals -= 1
            self._touch()
            if span is not None:
                span.set_attribute("subagent.permission.outcome", outcome)
                telemetry.end_span(span, failure)

    # -- lifecycle ----------------------------------------------------------------------------------

    async def close(self, reason: str = "the agent was closed before its next idle point") -> None:
        """Stop: cancel the turn in flight, refuse queued messages with ``reason``, leave the
        registry. Idempotent; returns once no turn is running.

        Called from inside the agent's own turn (one of its tools, its approver), it returns at once
        instead: that turn cannot end before the caller returns, and ends ``cancelled`` when it does.
        """
        if not self._closed:
            self._closed = True
            self._lifecycle.emit(AgentClosed(reason))
            self.cancel()
            while self._inbox:
                pending = self._inbox.popleft()
                pending._refuse(reason)
                logger.warning("agent %s: message refused (%s): %r", self.id, reason, pending.text[:200])
                self._listeners.emit(MessageRefused(pending.text, reason))
            for joined in self._registries:
                joined._remove(self)
        if self in _TURNS_IN_FLIGHT.get():
            return
        # The turn lock is held for a turn's whole length: taking it means none is running.
        with anyio.CancelScope(shield=True):
            async with self._turn_lock:
                pass

    def touch(self) -> None:
        """Record a sign of life now. A tool that works for long (one waiting on a subagent that is
        busy) calls it while it makes progress, so the turn's ``idle_timeout`` counts real silence."""
        self._touch()

    # -- internals ----------------------------------------------------------------------------------

    def _touch(self) -> None:
        self._last_activity = time.monotonic()

    def _partial_output(self) -> str:
        # Text of an answer cut short (listeners already saw it stream) is the latest the model said.
        if self._streamed:
            return "".join(self._streamed)
        for message in reversed(self._log[self._turn_start :]):
            if message.role == "assistant":
                return message.content
        return ""

    def _close_dangling_calls(self) -> None:
        # A turn cut short can leave tool calls without results; chat APIs refuse such a log, so
        # each gets a result saying it never finished.
        answered = {m.tool_call_id for m in self._log[self._turn_start :] if m.role == "tool"}
        for message in self._log[self._turn_start :]:
            for call in message.tool_calls:
                if call.id not in answered:
                    self._log.append(Message.tool_result(call, _UNFINISHED))
                    answered.add(call.id)

    async def _watch_idle(self, timeout: float, on_idle: Callable[[], Any]) -> None:
        while True:
            if self._pending_approvals:
                # Waiting on a person is not silence: check again later. The approval's end restarts
                # the clock (``_approve`` touches); touching here too would stretch the silence
                # allowed after it by up to one polling interval.
                await anyio.sleep(min(timeout, 0.5))
                continue
            since = self._last_activity if self._last_activity is not None else time.monotonic()
            remaining = since + timeout - time.monotonic()
            if remaining <= 0:
                await on_idle()
                return
            await anyio.sleep(remaining)


def _chat_span(llm: LlmAdapter) -> Span | None:
    """A model call's ``chat`` span, begun: the model and provider as far as the adapter says."""
    model = getattr(llm, "model", None)
    model = model if isinstance(model, str) and model else None
    # Not imported when unused: then no adapter of that module can exist either.
    openai = sys.modules.get("subagent.runtime.openai")
    speaks_openai = openai is not None and isinstance(llm, openai.OpenAiChatAdapter)
    attributes = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai" if speaks_openai else "_OTHER",
        "gen_ai.request.model": model,
    }
    return telemetry.start_span("chat" if model is None else f"chat {model}", "client", attributes)


"""The usage counts that add up over model calls; the context window and cost are snapshots, never summed."""


class _UsageSum:
    def __init__(self) -> None:
        self._totals: dict[str, Any] = {}  # token counts only: ints (Any: Usage also has a str field)
        self._seen = False

    def add(self, usage: Usage | None) -> None:
        if usage is None:
            return
        self._seen = True
        for name in _TOKEN_FIELDS:
            value = getattr(usage, name)
            if isinstance(value, int):
                self._totals[name] = self._totals.get(name, 0) + value

    def total(self) -> Usage | None:
        return Usage(**self._totals) if self._seen else None
