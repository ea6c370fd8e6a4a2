"""The model-facing ``subagent`` tool: a tool definition for an LLM tool loop, over a service.

The tool's wording is derived from the registry, never written by hand: the description lists the
providers registered now, says for each whether its child sees the parent conversation and which
optional parameters it accepts, and the input schema offers only what some registered provider can
honour. It follows registration and removal through the service's events; a version counter and an
``on_change`` callback tell the host that it must send the tool list to the model again.

Execution never raises for bad model input: unknown providers, wrong types, unsupported features
and failed starts all come back as an error result that names what was wrong and the valid choices,
so the model can correct itself. The arguments are checked against the schema the tool publishes, by
the check an in-process agent runs on every tool call (:func:`subagent.runtime._tools.parse_arguments`),
so both answer alike. Optional arguments may be null, which means the same as leaving them out
(models in strict modes send every parameter). The run is disposed on every path, cancellation
included.

```python
async with SubagentService() as subagents:
    subagents.register_provider(provider)
    with SubagentTool(subagents, parent_id="agent-1", timeout=300) as tool:
        tools = [tool.definition.to_openai()]
        ...  # the model calls the tool
        result = await tool.execute(call.arguments)
        messages.append(result.to_openai(call.id))
```
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

import anyio

from subagent._outcome import CloseOnExit, raise_sole_error
from subagent.budget import BudgetAccount
from subagent.delegation._background import (
    BackgroundChildren,
    BackgroundError,
    BackgroundOptions,
    Notice,
    WaitOutcome,
)
from subagent.delegation._results import Spill, SubagentToolResult, map_result, seam_failure
from subagent.runtime._inprocess_agent import Agent, _calling_agent
from subagent.runtime._messages import ToolSpec
from subagent.runtime._tools import InvalidArguments, ToolError, ToolInvocation, parse_arguments
from subagent.service import ServiceRun, SubagentService
from subagent.types import (
    BUDGET_FIELDS,
    START_TIME_FEATURES,
    Budget,
    BudgetField,
    CleanupPolicy,
    Disposer,
    ErrorCode,
    IsolationMode,
    ObservableRun,
    ProviderSnapshot,
    StartTimeFeature,
    SubagentError,
    SubagentRequest,
    SubagentResult,
    ToolFilter,
    thaw_json,
)

__all__ = [
    "COMPANION_ACTIONS",
    "DEFAULT_TOOL_NAME",
    "HOST_PARENT",
    "AgentCompanionTool",
    "AgentSubagentTool",
    "Spill",
    "SubagentTool",
    "SubagentToolResult",
    "ToolDefinition",
]

T = TypeVar("T")

DEFAULT_TOOL_NAME = "subagent"
"""The name the tool has unless the host picks another."""

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What OpenAI and Anthropic both accept as a function/tool name; checked at construction so a bad
name fails in the host's code, not as an API error in the middle of a conversation."""

COMPANION_ACTIONS = ("list", "wait", "send", "cancel", "result")
"""The companion tools of a tool with background delegation, named ``<tool name>_<action>``."""

HOST_PARENT = "host"
"""The parent a tool without a ``parent_id`` keeps its background children under: the host itself."""

# -- wording ----------------------------------------------------------------------------------------

_INTRO = (
    "Delegate a task to a subagent: another agent that works on `prompt` by itself and returns its final "
    "answer as this tool's result. It cannot ask you questions while it works, so state the task "
    "completely, including the form of the answer you want."
)
_NO_PROVIDER_NOTE = (
    "No subagent provider is registered right now, so this tool cannot start a subagent; a call returns "
    "an error."
)
_ERROR_NOTE = (
    'If the subagent does not finish its task, the result starts with "Error:", says why, and includes '
    "any partial output."
)
_FRESH_CONTEXT = (
    "starts fresh and does not see this conversation, so `prompt` must carry everything it needs."
)
_INHERITED_CONTEXT = "sees this conversation's earlier turns, so `prompt` may refer to them."
_BACKGROUND_PROPERTY: dict[str, Any] = {
    "type": ["boolean", "null"],
    "description": (
        "Start the subagent in the background: this call returns a handle as soon as the subagent has "
        "started, and you keep working; its result reaches you as a notice when it ends."
    ),
}

_ISOLATION_NOTES: dict[IsolationMode, str] = {
    "worktree": (
        "Workspaces: each subagent works in its own git worktree, on a new branch, never in your working "
        "tree. Its changes come back on that branch (the result names it, its commit and the files "
        "changed), which your host merges or not: until then they are not in your files."
    ),
    "copy": (
        "Workspaces: each subagent works in its own copy of the directory, never in your files. Its changes "
        "stay in that copy (the result names it and the files changed)."
    ),
}
_WORKSPACE_NAMES: dict[IsolationMode, str] = {"worktree": "git worktree", "copy": "copy of the directory"}
_DISCARDED_NOTE = (
    "Workspaces: each subagent works in a scratch {where}, never in your files, deleted with everything it "
    "changed when it ends: what you need from it must be in its answer."
)

_NON_BLANK = r"\S"
"""The pattern of a string with something in it besides white space."""


def _names_or_null(description: str) -> dict[str, Any]:
    """A property holding a list of names (of tools, of handles), or null for leaving it out."""
    return {"type": ["array", "null"], "items": {"type": "string"}, "description": description}


_PROMPT_PROPERTY: dict[str, Any] = {
    "type": "string",
    "pattern": _NON_BLANK,
    "description": "The complete task for the subagent, including the form of the answer you want.",
}
_FEATURE_PROPERTIES: dict[StartTimeFeature, dict[str, Any]] = {
    "output_schema": {
        "type": ["object", "null"],
        "description": (
            "A JSON Schema the subagent's final answer must satisfy; the answer comes back as the "
            "validated JSON value."
        ),
    },
    "depth_limit": {
        "type": ["integer", "null"],
        "minimum": 0,
        "description": (
            "How many levels of subagents the subagent may start below itself; 0 forbids it to delegate, "
            "null (like leaving it out) sets no limit of its own."
        ),
    },
    "tool_filter": {
        "type": ["object", "null"],
        "description": (
            "Narrows the subagent's tools, which are otherwise yours; it can never gain a tool you lack."
        ),
        "properties": {
            "allow": _names_or_null("Only these of your tools (default: all of them)."),
            "deny": _names_or_null("Tools to take away."),
        },
        "additionalProperties": False,
    },
    "persona": {
        "type": ["string", "null"],
        "description": 'A system prompt giving the subagent its role, e.g. "a meticulous code reviewer".',
    },
}


_BUDGET_CAP_PROPERTIES: dict[BudgetField, dict[str, Any]] = {
    "max_tokens": {
        "type": ["integer", "null"],
        "minimum": 0,
        "description": "Input plus output tokens, over all its model calls.",
    },
    "max_cost": {
        "type": ["number", "null"],
        "minimum": 0,
        "description": "Cost, in the currency the tool description gives.",
    },
    "max_seconds": {
        "type": ["number", "null"],
        "exclusiveMinimum": 0,
        "description": "Wall time from its start, in seconds.",
    },
    "max_tool_calls": {"type": ["integer", "null"], "minimum": 0, "description": "Tool calls it makes."},
    "max_turns": {"type": ["integer", "null"], "minimum": 0, "description": "Model calls it makes."},
}
_BUDGET_DESCRIPTION = (
    "Caps on what the subagent, with every subagent it starts, may spend; it is stopped when it passes "
    "one, and the result is an error with its partial output. A cap may only be tighter than what is "
    "left of your own budget (the tool description says what is). Leave a cap out or null for none of "
    "its own."
)
_WHOLE_CAPS: frozenset[BudgetField] = frozenset({"max_tokens", "max_tool_calls", "max_turns"})


def _quoted(names: Sequence[str]) -> str:
    # JSON quoting: unambiguous for the model whatever characters a provider name holds.
    return ", ".join(json.dumps(name) for name in names)


def _code_names(names: Sequence[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)


def _supported(snapshot: ProviderSnapshot) -> list[StartTimeFeature]:
    return [feature for feature in START_TIME_FEATURES if snapshot.capabilities.supports(feature)]


def _optional_parameters(snapshot: ProviderSnapshot) -> str:
    """The optional parameters a provider accepts, as its line in the description names them."""
    names = _code_names(_supported(snapshot))
    caps = _caps(snapshot)
    if caps:
        names += (", " if names else "") + f"`budget` (with {_code_names(caps)})"
    return names or "none"


def _caps(snapshot: ProviderSnapshot) -> list[BudgetField]:
    """The caps of a :class:`~subagent.types.Budget` the provider enforces, in check order."""
    return [cap for cap in BUDGET_FIELDS if snapshot.capabilities.supports(cap)]


# -- the definition ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolDefinition:
    """The tool as a provider-neutral record: ``name``, ``description``, ``input_schema`` (JSON Schema).

    The ``to_*`` methods render it for the common tool-calling formats; each returns fresh plain
    dicts (JSON-serialisable), so the host may add to them (``strict``, ``cache_control``) freely.
    """

    name: str
    description: str
    input_schema: dict[str, Any] = field(hash=False)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI chat completions: ``{"type": "function", "function": {name, description, parameters}}``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(self.input_schema),
            },
        }

    def to_openai_responses(self) -> dict[str, Any]:
        """OpenAI Responses API: ``{"type": "function", name, description, parameters}``."""
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": copy.deepcopy(self.input_schema),
        }

    def to_anthropic(self) -> dict[str, Any]:
        """Anthropic Messages API: ``{name, description, input_schema}``."""
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": copy.deepcopy(self.input_schema),
        }

    def to_mcp(self) -> dict[str, Any]:
        """Model Context Protocol ``tools/list`` entry: ``{name, description, inputSchema}``."""
        return {
            "name": self.name,
            "description": self.description,
            "inputSchema": copy.deepcopy(self.input_schema),
        }


ACTIVITY_POLL_INTERVAL = 0.25
"""Seconds between two looks at a child's liveness for ``execute(on_activity=...)``: short against
any inactivity timeout worth setting, and an attribute read costs nothing."""


async def _result_reporting_activity(run: ServiceRun, on_activity: Callable[[], object]) -> SubagentResult:
    """``run.result()``, calling ``on_activity`` whenever the child showed a sign of life since the last
    look (a provider run that cannot say is taken as silent: the caller's clock runs)."""
    if not isinstance(run, ObservableRun):  # the service run is one exactly when its provider's is
        return await run.result()
    observable = run

    async def watch() -> None:
        seen = observable.last_activity
        while True:
            await anyio.sleep(ACTIVITY_POLL_INTERVAL)
            latest = observable.last_activity
            # Waiting on a permission answer is not silence either.
            if latest != seen or observable.pending_permissions:
                seen = latest
                on_activity()

    return await _awaited_beside(run.result(), watch)


async def _reporting_activity(awaitable: Awaitable[T], on_activity: Callable[[], object]) -> T:
    """``awaitable``'s value, calling ``on_activity`` every ``ACTIVITY_POLL_INTERVAL`` seconds until
    then: a parent waiting on its background children (a bounded wait) is not silent."""

    async def tick() -> None:
        while True:
            await anyio.sleep(ACTIVITY_POLL_INTERVAL)
            on_activity()

    return await _awaited_beside(awaitable, tick)


async def _awaited_beside(awaitable: Awaitable[T], companion: Callable[[], Coroutine[Any, Any, None]]) -> T:
    """``awaitable``'s value, with ``companion`` running beside it until then."""
    try:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(companion)
            try:
                value = await awaitable
            finally:
                task_group.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise_sole_error(group)  # the awaited error as itself, not inside the task group's group
        raise
    return value


# -- the tool ---------------------------------------------------------------------------------------


class SubagentTool(CloseOnExit):
    """The ``subagent`` tool over a :class:`~subagent.service.SubagentService`.

    Args:
        service: the registry the tool lists and starts runs on.
        name: the tool's name as the model sees it (letters, digits, ``_``, ``-``; at most 64).
        parent_id: the id of the agent this tool belongs to; every request carries it, so the seam
            can count depth along the parent chain.
        timeout: the inactivity timeout (seconds) every run gets. Timeouts are the host's policy, so
            the model is not offered one.
        cwd: the working directory every run gets, when the host fixes one.
        on_change: called with the new definition each time the registry changes it (the host then
            sends the tool list again). Runs inside the registry's event; one that raises is logged.
        background: offer background delegation (:mod:`subagent.delegation`): the tool takes
            ``background: true`` and has companion tools (:attr:`companion_definitions`,
            :meth:`agent_tools`) to list, wait for, message, cancel and read background children;
            outputs longer than the options' ``spill_bytes`` are spilled to a file (foreground ones
            too). None (the default): no background delegation, no spilling.
        on_notice: called with each background child's :class:`~subagent.delegation.Notice` as it
            ends (the host's way to hear back; an in-process parent agent also gets it in its log).
        budget: the host's ceiling on every child started through the tool, together (background
            ones too, and everything below them): the tool owns a root
            :class:`~subagent.budget.BudgetAccount` of it (:attr:`budget_account`), and each child whose
            parent is not a run of ``service`` is started within it. The description says what is left
            of it, as of each time it is read; a call may set a ``budget`` of its own, never looser than
            what is left. A :class:`~subagent.budget.BudgetAccount` instead is used as that account
            itself: the children then share it with whatever else the host charges to it (``subagent
            serve`` gives a session's agent and its tool one account). None (the default): no ceiling
            (a call's own ``budget`` still holds).
        isolation: run every child started through the tool in a workspace of its own
            (:mod:`subagent.isolation`): ``"worktree"``, a git worktree of ``cwd``'s repository on a new
            branch, or ``"copy"``, a copy of ``cwd``. Only the providers that can give it are offered,
            the description tells the model that its children's changes come back on branches (or in
            copies), and each result ends with where they are (:attr:`SubagentToolResult.workspace`
            holds the change, for the host to :func:`~subagent.isolation.merge`, or not). Where the
            children work is the host's policy, as merging is: the model is not offered a choice.
        cleanup: with ``isolation``, what becomes of each child's workspace when it ends (default
            ``"remove"``: the worktree goes, its branch stays when it holds changes).

    The tool follows the registry from construction until :meth:`close` (or the end of its ``with``
    block). With background delegation, use it as an async context manager (or call :meth:`aclose`):
    closing it cancels and disposes every background child. Raises ``ValueError`` for a name the
    tool-calling APIs would refuse (with its companions' suffixes) or a timeout <= 0.
    """

    def __init__(
        self,
        service: SubagentService,
        *,
        name: str = DEFAULT_TOOL_NAME,
        parent_id: str | None = None,
        timeout: float | None = None,
        cwd: str | None = None,
        on_change: Callable[[ToolDefinition], object] | None = None,
        background: BackgroundOptions | None = None,
        on_notice: Callable[[Notice], object] | None = None,
        budget: Budget | BudgetAccount | None = None,
        isolation: IsolationMode | None = None,
        cleanup: CleanupPolicy = "remove",
    ) -> None:
        if not _TOOL_NAME.match(name):
            raise ValueError(f"a tool name must match {_TOOL_NAME.pattern}, got {name!r}")
        if background is not None and not _TOOL_NAME.match(f"{name}_cancel"):
            raise ValueError(
                f"a tool name with background delegation must leave room for '_cancel', got {name!r}"
            )
        if timeout is not None and not timeout > 0:  # `not >` also refuses NaN
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self._service = service
        self._name = name
        # What the host fixes for every run; each call fills in the model's part.
        # (SubagentRequest refuses an unknown isolation or cleanup with a ValueError.)
        self._template = SubagentRequest(
            prompt="", cwd=cwd, timeout=timeout, parent_id=parent_id, isolation=isolation, cleanup=cleanup
        )
        self._on_change = on_change
        self._version = 0
        self._closed = False
        if isinstance(budget, BudgetAccount):
            self._account: BudgetAccount | None = budget
        else:
            self._account = (
                BudgetAccount(budget, prices=service.prices)
                if budget is not None and budget.fields()
                else None
            )
        self._background = (
            BackgroundChildren(service, background, within=self._account) if background is not None else None
        )
        self._notice_disposer: Disposer | None = None
        if self._background is not None and on_notice is not None:
            self._notice_disposer = self._background.on_notice(on_notice)
        self._definition = self._build_definition()
        # The listeners re-read the registry rather than the payload: the registry is the truth, and
        # a removal's payload (a name) could not say what a remaining provider supports.
        self._disposers: list[Disposer] = [
            service.events.on("subagent/provider-added", lambda _snapshot: self._refresh()),
            service.events.on("subagent/provider-removed", lambda _name: self._refresh()),
        ]

    # -- the definition ----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The tool's name."""
        return self._name

    @property
    def parent_id(self) -> str | None:
        """The parent id every request carries."""
        return self._template.parent_id

    @property
    def timeout(self) -> float | None:
        """The inactivity timeout every run gets, in seconds (None: the provider's default)."""
        return self._template.timeout

    @property
    def isolation(self) -> IsolationMode | None:
        """The workspace every child gets (None: none, it works in ``cwd`` itself)."""
        return self._template.isolation

    @property
    def cleanup(self) -> CleanupPolicy:
        """What becomes of each child's workspace when it ends."""
        return self._template.cleanup

    @property
    def budget(self) -> Budget | None:
        """The host's ceiling on every child started through the tool together (None: none)."""
        return self._account.asked if self._account is not None else None

    @property
    def budget_account(self) -> BudgetAccount | None:
        """The ceiling's account: what the children started through the tool spent together, and
        what is left (None without a ceiling)."""
        return self._account

    @property
    def definition(self) -> ToolDefinition:
        """The definition as of now: a copy, the caller may change it. With a budget ceiling, the
        description ends with what is left of it as of this read (spending does not change
        :attr:`version`: a host that sends the tool list again before each model call shows the
        model the budget as it is then; an in-process agent does)."""
        current = self._definition
        description = current.description
        note = self._budget_note()
        if note is not None:
            description += "\n\n" + note
        return ToolDefinition(current.name, description, copy.deepcopy(current.input_schema))

    def _budget_note(self) -> str | None:
        """What the ceiling allows and what is left of it, for the model (None: no ceiling, or no
        provider to spend it on)."""
        account = self._account
        if account is None or not self._snapshots():
            return None
        currency = _currency(account)
        hit = account.check()
        if hit is not None:
            left = f"It is spent ({hit.describe(currency)}): no subagent can be started."
        else:
            left = f"Left now: {account.remaining().describe(currency)}."
        return (
            "Budget: every subagent you start, with every subagent it starts, shares one budget of "
            f"{account.asked.describe(currency)}. {left} A subagent that passes a cap is stopped, and its "
            "result is an error with its partial output."
        )

    @property
    def version(self) -> int:
        """Starts at 0 and goes up by one each time the definition changes."""
        return self._version

    @property
    def available(self) -> bool:
        """Whether a provider is registered (one that can give the host's isolation), so that a call can
        start a subagent at all."""
        return bool(self._snapshots())

    @property
    def closed(self) -> bool:
        """Whether the tool has stopped following the registry."""
        return self._closed

    @property
    def background(self) -> BackgroundChildren | None:
        """The background children started through the tool; None without background delegation."""
        return self._background

    @property
    def companion_definitions(self) -> tuple[ToolDefinition, ...]:
        """The companion tools (``<name>_list``, ``_wait``, ``_send``, ``_cancel``, ``_result``); empty
        without background delegation. They do not change with the registry."""
        if self._background is None:
            return ()
        return tuple(_companion_definition(self._name, action) for action in COMPANION_ACTIONS)

    async def aclose(self) -> None:
        """:meth:`close`, then cancel and dispose every background child and remove a spill directory
        the tool created. Idempotent; returns once none of them is running."""
        self._stop_following()
        if self._background is not None:
            await self._background.aclose()

    def close(self) -> None:
        """Stop following the registry: the definition and version stay as they are. Idempotent.

        :meth:`execute` keeps working and validates against the registry as it is at the call. With
        background delegation, prefer :meth:`aclose`, which returns once the background children are
        gone; this only starts their disposal (in the service's task group, which the service's own
        close awaits).
        """
        if not self._closed and self._background is not None:
            background = self._background
            try:
                self._service._require_open().start_soon(background.aclose, name="close background children")
            except (SubagentError, RuntimeError):
                background.discard_spill_directory()  # the service is gone, and its runs with it
        self._stop_following()

    def _stop_following(self) -> None:
        self._closed = True
        disposers, self._disposers = self._disposers, []
        if self._notice_disposer is not None:
            disposers.append(self._notice_disposer)
            self._notice_disposer = None
        for dispose in disposers:
            dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def for_agents(self) -> AgentSubagentTool:
        """This tool as a tool of in-process agents (:class:`~subagent.runtime.Agent`).

        One instance serves any number of agents: each call starts the child with the calling
        agent as its parent, so depth and tool filters follow the real chain. The spec the model
        sees is this tool's current definition, re-read at every model call.
        """
        return AgentSubagentTool(self)

    def agent_tools(self) -> tuple[AgentSubagentTool | AgentCompanionTool, ...]:
        """:meth:`for_agents` and, with background delegation, the companion tools, as tools of
        in-process agents. A calling agent is the parent of the children it starts in the background:
        it hears of their ends at its idle points, and they die with it (closed, or its turn
        cancelled)."""
        companions = tuple(AgentCompanionTool(self, action) for action in COMPANION_ACTIONS)
        return (self.for_agents(), *(companions if self._background is not None else ()))

    def _snapshots(self) -> list[ProviderSnapshot]:
        """The providers a call may choose: the registered ones, but those that cannot give the host's
        isolation (the model is never offered a provider that would refuse every call)."""
        snapshots = (self._service.get_provider(name) for name in self._service.list())
        isolation = self._template.isolation
        return [
            snapshot
            for snapshot in snapshots
            if snapshot is not None and (isolation is None or isolation in snapshot.capabilities.isolation)
        ]

    def _refresh(self) -> None:
        if self._closed:
            return
        definition = self._build_definition()
        if definition == self._definition:
            return
        self._definition = definition
        self._version += 1
        if self._on_change is not None:
            self._on_change(self.definition)

    def _build_definition(self) -> ToolDefinition:
        snapshots = self._snapshots()
        paragraphs = [_INTRO]
        if snapshots:
            lines = ["Providers (set `provider` to one of them):"]
            for snapshot in snapshots:
                context = _INHERITED_CONTEXT if snapshot.inherits_parent_context else _FRESH_CONTEXT
                optional = _optional_parameters(snapshot)
                lines.append(f"- {json.dumps(snapshot.name)}: {context} Optional parameters: {optional}.")
            paragraphs += ["\n".join(lines), _ERROR_NOTE]
            if self._template.isolation is not None:
                paragraphs.append(self._isolation_note(self._template.isolation))
            if self._background is not None:
                paragraphs.append(self._background_note())
        else:
            paragraphs.append(self._no_provider_note())
        return ToolDefinition(
            name=self._name, description="\n\n".join(paragraphs), input_schema=self._input_schema(snapshots)
        )

    def _input_schema(self, snapshots: Sequence[ProviderSnapshot]) -> dict[str, Any]:
        """The arguments the registry of ``snapshots`` makes valid: the published schema, and the one
        every call is checked against."""
        names = [snapshot.name for snapshot in snapshots]
        provider_property: dict[str, Any] = {"type": "string"}
        if names:
            provider_property["enum"] = names
            provider_property["description"] = (
                "Which provider runs the subagent; the tool description says what each one sees and accepts."
            )
        else:
            # An empty enum is invalid JSON Schema, and some APIs reject it; say it in words instead.
            provider_property["description"] = "No provider is registered now; the tool cannot run."
        properties: dict[str, Any] = {"prompt": dict(_PROMPT_PROPERTY), "provider": provider_property}
        for feature in START_TIME_FEATURES:
            supporters = [s.name for s in snapshots if s.capabilities.supports(feature)]
            # Offered only when some provider can honour it: the model is never shown a choice that
            # every provider would refuse.
            if not supporters:
                continue
            feature_property = copy.deepcopy(_FEATURE_PROPERTIES[feature])
            if len(supporters) < len(names):
                feature_property["description"] += f" Supported only by {_quoted(supporters)}."
            properties[feature] = feature_property
        budget_property = _budget_property(snapshots)
        if budget_property is not None:
            properties["budget"] = budget_property
        if self._background is not None and names:
            properties["background"] = dict(_BACKGROUND_PROPERTY)
        return {
            "type": "object",
            "properties": properties,
            "required": ["prompt", "provider"],
            "additionalProperties": False,
        }

    # -- execution ---------------------------------------------------------------------------------

    async def execute(
        self,
        arguments: Mapping[str, Any] | str | bytes,
        *,
        parent_id: str | None = None,
        on_activity: Callable[[], object] | None = None,
    ) -> SubagentToolResult:
        """Run one call of the tool, with ``arguments`` as the model produced them.

        ``parent_id`` overrides the tool's own for this call: one tool shared by several agents
        passes the calling agent's id, so the seam counts depth along the right chain.
        ``on_activity`` is called (at most every ``ACTIVITY_POLL_INTERVAL`` seconds) while the child
        shows signs of life, for a caller whose own inactivity clock must not run while its child
        works: an agent's turn waiting on this call.

        ``arguments`` is the decoded JSON object, or its JSON text. Bad input from the model (not an
        object, missing or blank ``prompt``, an unknown provider, a wrong type, an unknown parameter:
        anything the published schema rules out, in the words an in-process agent's check uses; or a
        feature the chosen provider lacks) gives an error result and starts nothing. Otherwise the
        run is started, awaited and mapped: ``completed`` is a success, any other stop reason an
        error result with the partial output, a ``SubagentError`` an error result with its code.

        The run is disposed before this returns, on every path; when the caller is cancelled, the
        run is disposed and the cancellation propagates.

        Raises:
            RuntimeError: the service was never opened (a host bug, not the model's).
            Exception: whatever a faulty provider's result raised other than a ``SubagentError``.
        """
        return await self._execute(arguments, parent_id, on_activity, None)

    async def _execute(
        self,
        arguments: Mapping[str, Any] | str | bytes,
        parent_id: str | None,
        on_activity: Callable[[], object] | None,
        agent: Agent | None,
    ) -> SubagentToolResult:
        prepared = self._prepare(arguments, parent_id if parent_id is not None else self._template.parent_id)
        if isinstance(prepared, SubagentToolResult):
            return prepared
        provider, request, background = prepared
        if background:
            return await self._start_background(provider, request, agent)
        try:
            run = self._service.start(provider, request, within=self._account)
        except SubagentError as exc:
            return seam_failure(exc, lead="the subagent could not be started", provider=provider)
        # Leaving the block disposes the run, shielded, whatever the exit: return, exception, cancel.
        async with run:
            try:
                await run.started()
            except SubagentError as exc:
                return seam_failure(
                    exc, lead="the subagent could not be started", provider=provider, run_id=run.id
                )
            try:
                if on_activity is None:
                    result = await run.result()
                else:
                    result = await _result_reporting_activity(run, on_activity)
            except SubagentError as exc:
                return seam_failure(exc, lead="the subagent run failed", provider=provider, run_id=run.id)
        spill = None
        if self._background is not None:
            spill = await self._background.spill_result(result, request, label=run.id)
        return map_result(result, request, provider=provider, run_id=run.id, spill=spill)

    async def _start_background(
        self, provider: str, request: SubagentRequest, agent: Agent | None
    ) -> SubagentToolResult:
        background = self._background
        assert background is not None  # `background` is accepted only with it
        parent = request.parent_id if request.parent_id is not None else HOST_PARENT
        if agent is not None and agent.id == parent:
            background.bind_agent(agent)
        try:
            child = await background.start(parent, provider, request)
        except SubagentError as exc:
            return seam_failure(exc, lead="the subagent could not be started", provider=provider)
        except BackgroundError as exc:
            return SubagentToolResult(is_error=True, error=exc.reason, provider=provider)
        if child.state == "queued":
            status = (
                f"Queued background subagent {child.handle} ({provider}): {background.options.max_running} "
                "of yours are running, the most at once; it starts when one of them ends."
            )
        else:
            status = f"Started background subagent {child.handle} ({provider}); it is running."
        return SubagentToolResult(
            is_error=False,
            output=(
                f"{status} Its result will reach you as a notice when it ends; meanwhile, go on with "
                f"other work. `{self._name}_wait` waits for it, `{self._name}_send` sends it a message, "
                f"`{self._name}_cancel` stops it."
            ),
            run_id=child.run_id,
            provider=provider,
            handle=child.handle,
        )

    def _no_provider_note(self) -> str:
        """Why the tool cannot start a subagent, for its description."""
        isolation = self._template.isolation
        if isolation is None or not self._service.list():
            return _NO_PROVIDER_NOTE
        return (
            f"No subagent provider registered now can give a subagent its own {_WORKSPACE_NAMES[isolation]}, "
            "as every subagent of this tool gets, so this tool cannot start a subagent; a call returns an "
            "error."
        )

    def _no_provider_error(self) -> str:
        """Why a call started no subagent, for its result."""
        isolation = self._template.isolation
        if isolation is None or not self._service.list():
            return "no subagent provider is registered right now, so no subagent can be started."
        return (
            f"no subagent provider registered now can give a subagent its own {_WORKSPACE_NAMES[isolation]}, "
            "as every subagent of this tool gets, so no subagent can be started."
        )

    def _isolation_note(self, isolation: IsolationMode) -> str:
        if self._template.cleanup == "remove-always":
            return _DISCARDED_NOTE.format(where=_WORKSPACE_NAMES[isolation])
        return _ISOLATION_NOTES[isolation]

    def _background_note(self) -> str:
        assert self._background is not None
        options = self._background.options
        note = (
            "Background: set `background` to true to start a subagent and get its handle at once; "
            "you keep working, and a notice with its result reaches you when it ends. "
            f"At most {options.max_running} of yours run at once; more are queued, "
            f"up to {options.max_queued}. "
            f"`{self._name}_list` lists your background subagents, `{self._name}_wait` waits for them, "
            f"`{self._name}_send` messages one, `{self._name}_cancel` stops one, `{self._name}_result` "
            "reads one's result."
        )
        if options.spill_bytes is not None:
            note += (
                f" A result longer than {options.spill_bytes} bytes is saved to a file: you get its start, "
                "its end and the file's path."
            )
        return note

    # -- the companion tools -------------------------------------------------------------------------

    async def execute_companion(
        self,
        action: str,
        arguments: Mapping[str, Any] | str | bytes,
        *,
        parent_id: str | None = None,
        on_activity: Callable[[], object] | None = None,
    ) -> SubagentToolResult:
        """Run one call of a companion tool: ``action`` is one of :data:`COMPANION_ACTIONS` (or the
        companion's full name). ``parent_id`` is the caller's, as for :meth:`execute`: a parent sees
        and touches only its own children. Bad input and refusals come back as error results.

        Raises:
            ValueError: no such companion, or the tool has no background delegation (host bugs).
        """
        background = self._background
        if background is None:
            raise ValueError("this tool has no background delegation, so no companion tools")
        action = action.removeprefix(f"{self._name}_")
        if action not in COMPANION_ACTIONS:
            raise ValueError(f"no companion tool {action!r}; they are {', '.join(COMPANION_ACTIONS)}")
        parent = parent_id if parent_id is not None else self._template.parent_id
        parent = parent if parent is not None else HOST_PARENT
        try:
            decoded = parse_arguments(arguments, _companion_definition(self._name, action).input_schema)
        except InvalidArguments as exc:
            return SubagentToolResult(is_error=True, error=str(exc))
        try:
            if action == "list":
                children = background.children(parent)
                if not children:
                    return SubagentToolResult(is_error=False, output="You have no background subagents.")
                return SubagentToolResult(
                    is_error=False, output="\n".join(f"- {child.describe()}" for child in children)
                )
            if action == "wait":
                return await self._wait(background, parent, decoded, on_activity)
            handle = decoded["handle"]
            if action == "send":
                await background.send(parent, handle, decoded["message"])
                return SubagentToolResult(
                    is_error=False,
                    output=f"Sent to {handle}; it reads the message at its next pause between steps.",
                    handle=handle,
                )
            notice = (
                await background.cancel(parent, handle)
                if action == "cancel"
                else background.result(parent, handle)
            )
        except BackgroundError as exc:
            return SubagentToolResult(is_error=True, error=exc.reason)
        except SubagentError as exc:
            return seam_failure(exc, lead="the message was not delivered", provider="")
        # The call did what it was asked; how the child ended is in the text.
        result = notice.result
        return SubagentToolResult(
            is_error=False,
            output=notice.text,
            stop_reason=result.stop_reason,
            structured=result.structured,
            run_id=result.run_id,
            provider=result.provider,
            usage=result.usage,
            handle=result.handle,
        )

    async def _wait(
        self,
        background: BackgroundChildren,
        parent: str,
        arguments: Mapping[str, Any],
        on_activity: Callable[[], object] | None,
    ) -> SubagentToolResult:
        handles = arguments.get("handles")
        mode: Literal["any", "all"] = "all" if arguments.get("mode") == "all" else "any"
        timeout = arguments.get("timeout")
        wait = background.wait(parent, handles, mode=mode, timeout=timeout)
        outcome = await (wait if on_activity is None else _reporting_activity(wait, on_activity))
        return SubagentToolResult(is_error=False, output=_render_wait(outcome, handles is None))

    def _prepare(
        self, arguments: Mapping[str, Any] | str | bytes, parent_id: str | None
    ) -> tuple[str, SubagentRequest, bool] | SubagentToolResult:
        """Validate the model's arguments into ``(provider, request, background)``, or an error result."""
        snapshots = self._snapshots()
        # The schema of the registry as it is now: the published one, unless the tool stopped following.
        try:
            valid = parse_arguments(arguments, self._input_schema(snapshots))
        except InvalidArguments as exc:
            return SubagentToolResult(is_error=True, error=str(exc))
        if not snapshots:
            return SubagentToolResult(
                is_error=True,
                error=self._no_provider_error(),
                # Providers there are, but none can isolate: a capability lacking, not a provider.
                error_code=ErrorCode.NO_PROVIDER
                if self._template.isolation is None or not self._service.list()
                else ErrorCode.UNSUPPORTED_CAPABILITY,
            )
        budget = self._call_budget(valid.get("budget"))
        if isinstance(budget, SubagentToolResult):
            return budget
        depth_limit = valid.get("depth_limit")
        request = replace(
            self._template,
            prompt=valid["prompt"],
            parent_id=parent_id,
            output_schema=valid.get("output_schema"),
            # JSON Schema counts 2.0 as an integer; the request holds an int.
            depth_limit=None if depth_limit is None else int(depth_limit),
            tool_filter=_tool_filter(valid.get("tool_filter")),
            persona=valid.get("persona"),
            budget=budget,
        )
        unsupported = self._unsupported(snapshots, valid["provider"], request)
        if unsupported is not None:
            return unsupported
        return valid["provider"], request, valid.get("background") is True

    def _call_budget(self, argument: Mapping[str, Any] | None) -> Budget | SubagentToolResult | None:
        """The call's own budget (a valid ``budget`` argument; a null cap counts as left out), or the
        refusal of a call the ceiling cannot take: it is spent, or a cap asks more than is left
        (``max_seconds`` excepted: the ceiling's deadline holds for the child anyway)."""
        account = self._account
        hit = account.check() if account is not None else None
        if account is not None and hit is not None:
            currency = _currency(account)
            return SubagentToolResult(
                is_error=True,
                error=f"no subagent was started: your budget for subagents is spent "
                f"({hit.describe(currency)}).",
                limit=hit,
                spent=account.spent(),
            )
        caps = {
            name: int(value) if name in _WHOLE_CAPS else float(value)
            for name, value in (argument or {}).items()
            if value is not None
        }
        if not caps:
            return None
        budget = Budget.from_mapping(caps)  # the schema already bounds every cap
        if account is None:
            return budget
        left = account.remaining()
        currency = _currency(account)
        over = [
            f"`budget.{name}` is {Budget.from_mapping({name: caps[name]}).describe(currency)}, more than the "
            f"{Budget.from_mapping({name: allowed}).describe(currency)} left of your budget."
            # Time left shrinks while the model writes its call: a longer max_seconds is narrowed to
            # the ceiling's deadline rather than refused.
            for name in budget.fields()
            if name != "max_seconds" and (allowed := left.cap(name)) is not None and caps[name] > allowed
        ]
        if over:
            lines = "\n".join(f"- {problem}" for problem in over)
            return SubagentToolResult(
                is_error=True,
                error="a subagent's budget may only be tighter than what is left of yours, no subagent "
                f"was started:\n{lines}",
            )
        return budget

    def _unsupported(
        self, snapshots: Sequence[ProviderSnapshot], provider: str, request: SubagentRequest
    ) -> SubagentToolResult | None:
        """The refusal of the features ``provider`` lacks: a rule across two arguments, so not the
        schema's (which offers a feature when any provider registered supports it)."""
        chosen = next(snapshot for snapshot in snapshots if snapshot.name == provider)
        # Every unmet feature at once, so the model can fix its call in one retry.
        problems = [
            f"`{feature}` is not supported by {json.dumps(provider)}; providers that support it: "
            f"{_quoted([s.name for s in snapshots if s.capabilities.supports(feature)])}."
            for feature in request.requested_features()
            if not chosen.capabilities.supports(feature)
        ]
        if not problems:
            return None
        lines = "\n".join(f"- {problem}" for problem in problems)
        return SubagentToolResult(
            is_error=True,
            error=(
                f"unsupported parameters for provider {json.dumps(provider)}, "
                f"no subagent was started:\n{lines}"
            ),
            error_code=ErrorCode.UNSUPPORTED_CAPABILITY,
            provider=provider,
        )


def _currency(account: BudgetAccount) -> str | None:
    """The currency of the account's costs: its price table's, else the one its children reported."""
    return account.prices.currency if account.prices is not None else account.spent().cost_currency


def _budget_property(snapshots: Sequence[ProviderSnapshot]) -> dict[str, Any] | None:
    """The ``budget`` argument: an object of the caps some registered provider enforces (None when
    none does, so the model is never offered a cap every provider would refuse)."""
    caps: dict[str, Any] = {}
    for cap in BUDGET_FIELDS:
        supporters = [s.name for s in snapshots if s.capabilities.supports(cap)]
        if not supporters:
            continue
        cap_property = copy.deepcopy(_BUDGET_CAP_PROPERTIES[cap])
        if len(supporters) < len(snapshots):
            cap_property["description"] += f" Supported only by {_quoted(supporters)}."
        caps[cap] = cap_property
    if not caps:
        return None
    return {
        "type": ["object", "null"],
        "description": _BUDGET_DESCRIPTION,
        "properties": caps,
        "additionalProperties": False,
    }


def _tool_filter(argument: Mapping[str, Any] | None) -> ToolFilter | None:
    """The request's filter for a valid ``tool_filter`` argument (a null list counts as left out)."""
    if argument is None:
        return None
    allow, deny = argument.get("allow"), argument.get("deny")
    return ToolFilter(allow=None if allow is None else frozenset(allow), deny=frozenset(deny or ()))


class AgentSubagentTool:
    """:class:`SubagentTool` as a :class:`~subagent.runtime.Tool`: see :meth:`SubagentTool.for_agents`."""

    needs_approval = False

    def __init__(self, tool: SubagentTool) -> None:
        self.subagent_tool = tool
        # (the definition's version and its budget note, its spec)
        self._spec: tuple[tuple[int, str | None], ToolSpec] | None = None

    def __repr__(self) -> str:
        return f"<AgentSubagentTool {self.subagent_tool.name!r}>"

    @property
    def spec(self) -> ToolSpec:
        """The tool's current definition, as the runtime's tool spec."""
        # Read at every model call and tool lookup: rebuilt only when the registry changed it, or
        # what is left of the budget did.
        version = (self.subagent_tool.version, self.subagent_tool._budget_note())
        if self._spec is None or self._spec[0] != version:
            definition = self.subagent_tool.definition
            self._spec = (version, ToolSpec(definition.name, definition.description, definition.input_schema))
        return self._spec[1]

    async def run(self, invocation: ToolInvocation) -> str:
        """Start the child as the calling agent's, await it, and render the outcome for the model.

        Raises:
            ToolError: the delegation failed (refused, failed to start, or the child stopped early);
                its message is what the model reads.
        """
        arguments = thaw_json(invocation.arguments)
        # The calling agent's inactivity clock must not run out while its child is busy; a background
        # child reports to the calling agent and dies with it.
        context = invocation.context
        result = await self.subagent_tool._execute(
            arguments, context.id, context.touch, _calling_agent(context)
        )
        text = result.render()
        if result.is_error:
            # Raised, so the agent reports a failed call to its listeners; it words the error itself.
            raise ToolError(text.removeprefix("Error: "))
        return text


class AgentCompanionTool:
    """A companion tool of :class:`SubagentTool` (``<name>_<action>``) as a tool of in-process agents:
    see :meth:`SubagentTool.agent_tools`. The calling agent is the parent whose children it lists,
    waits for, messages, cancels or reads."""

    needs_approval = False

    def __init__(self, tool: SubagentTool, action: str) -> None:
        if action not in COMPANION_ACTIONS:
            raise ValueError(f"no companion tool {action!r}; they are {', '.join(COMPANION_ACTIONS)}")
        self.subagent_tool = tool
        self.action = action
        definition = _companion_definition(tool.name, action)
        self.spec = ToolSpec(definition.name, definition.description, definition.input_schema)

    def __repr__(self) -> str:
        return f"<AgentCompanionTool {self.spec.name!r}>"

    async def run(self, invocation: ToolInvocation) -> str:
        """Run the companion call for the calling agent; a refusal is raised as :class:`ToolError`."""
        context = invocation.context
        result = await self.subagent_tool.execute_companion(
            self.action, thaw_json(invocation.arguments), parent_id=context.id, on_activity=context.touch
        )
        text = result.render()
        if result.is_error:
            raise ToolError(text.removeprefix("Error: "))
        return text


_HANDLE_PROPERTY: dict[str, Any] = {
    "type": "string",
    "pattern": _NON_BLANK,
    "description": "The background subagent's handle.",
}

_COMPANIONS: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "list": (
        "List your background subagents: handle, provider, state (queued, running, completed, failed, "
        "cancelled), last activity, and the start of the task.",
        {},
        (),
    ),
    "wait": (
        "Wait for your background subagents to end and get the results of those that did. `mode` "
        '"any" (the default) returns as soon as one has ended, "all" once all have. Without `handles`: '
        "every background subagent whose result you have not received yet. The wait ends after "
        "`timeout` seconds at most, with whatever ended by then.",
        {
            "handles": _names_or_null("The handles to wait for (default: every one whose result you lack)."),
            "mode": {
                "type": ["string", "null"],
                "enum": ["any", "all", None],
                "description": "Wait for any or for all.",
            },
            "timeout": {
                "type": ["number", "null"],
                "minimum": 0,
                "description": "The longest wait, in seconds.",
            },
        },
        (),
    ),
    "send": (
        "Send a message to a running background subagent: it reads it at its next pause between steps. "
        "Refused, with the reason, when its provider's subagents cannot take messages.",
        {
            "handle": _HANDLE_PROPERTY,
            "message": {"type": "string", "pattern": _NON_BLANK, "description": "The message."},
        },
        ("handle", "message"),
    ),
    "cancel": (
        "Stop a background subagent (a queued one never starts) and get what it produced so far.",
        {"handle": _HANDLE_PROPERTY},
        ("handle",),
    ),
    "result": (
        "Read the result of a background subagent that has ended.",
        {"handle": _HANDLE_PROPERTY},
        ("handle",),
    ),
}


def _companion_definition(name: str, action: str) -> ToolDefinition:
    description, properties, required = _COMPANIONS[action]
    schema: dict[str, Any] = {
        "type": "object",
        "properties": copy.deepcopy(properties),
        "required": list(required),
        "additionalProperties": False,
    }
    return ToolDefinition(f"{name}_{action}", description, schema)


def _render_wait(outcome: WaitOutcome, every: bool) -> str:
    parts = [notice.text for notice in outcome.ended]
    if not outcome.ended and not outcome.live:
        return (
            "You have no background subagent whose result you have not received."
            if every
            else "None of those subagents is running."
        )
    if outcome.live:
        still = "\n".join(f"- {child.describe()}" for child in outcome.live)
        lead = "The wait timed out. " if outcome.timed_out and not outcome.ended else ""
        parts.append(f"{lead}Still running or queued:\n{still}")
    return "\n\n".join(parts)
