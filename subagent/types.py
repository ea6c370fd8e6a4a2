"""The seam's vocabulary: requests, results, capabilities, run protocols, event payloads, errors.

Nothing here knows how a child runs. Providers (ACP, spawn, fork) and the service speak only these
types, so a caller can switch provider by name without changing anything else.

Capabilities come in two kinds:

* start-time features (``output_schema``, ``depth_limit``, ``tool_filter`` with ``persona``) are
  flags on :class:`SubagentCapabilities`; the service refuses a request that asks for one the provider
  lacks, before any child exists;
* runtime features are optional methods on the run (``send_message``, ``resume``); their presence
  is the capability, checked with ``isinstance(run, SteerableRun)`` / ``isinstance(run, ResumableRun)``.

Runs may also expose what they are doing, again by presence: an :class:`ObservableRun` reports its
child's last sign of life and pending permission questions (the service turns that into
``subagent/progress`` heartbeats), and a :class:`QueueableRun` says whether it is still waiting for a
concurrency slot.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, fields
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self, runtime_checkable

from subagent.acp._frozen import freeze_json, thaw_json

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from subagent.budget import BudgetAccount

__all__ = [
    "BUDGET_FIELDS",
    "BUDGET_META_KEY",
    "LINEAGE_META_KEY",
    "RETRY_META_KEY",
    "RUN_META_KEY",
    "START_TIME_FEATURES",
    "TURN_META_KEY",
    "Budget",
    "BudgetField",
    "CheckpointedRun",
    "CleanupPolicy",
    "Disposer",
    "ErrorCode",
    "FileChange",
    "IsolationMode",
    "LimitHit",
    "LimitName",
    "Lineage",
    "ObservableRun",
    "ProviderSnapshot",
    "QueueableRun",
    "ReopenableProvider",
    "ResumableRun",
    "ResumePoint",
    "Spend",
    "StartTimeFeature",
    "SteerableRun",
    "StopReason",
    "SubagentCapabilities",
    "SubagentError",
    "SubagentProgressInfo",
    "SubagentProvider",
    "SubagentRequest",
    "SubagentResult",
    "SubagentRun",
    "SubagentRunEndInfo",
    "SubagentRunInfo",
    "ToolFilter",
    "Usage",
    "WorkspaceChange",
    "freeze_json",
    "sum_usage",
    "thaw_json",
]

StopReason = Literal[
    "completed", "cancelled", "error", "timeout", "max_tokens", "max_turns", "refusal", "budget"
]
"""Why a child's turn ended. Only ``completed`` is success; ``error`` carries a diagnosis; ``budget``
means a cap of the run's :class:`Budget` (or an ancestor's) was reached and the run was stopped
(:attr:`SubagentResult.limit` says which)."""

BudgetField = Literal["max_tokens", "max_cost", "max_seconds", "max_tool_calls", "max_turns"]
"""A cap of a :class:`Budget`."""

BUDGET_FIELDS: tuple[BudgetField, ...] = (
    "max_tokens",
    "max_cost",
    "max_seconds",
    "max_tool_calls",
    "max_turns",
)
"""Every cap of a :class:`Budget`, in the order they are checked and described."""

IsolationMode = Literal["worktree", "copy"]
"""How a child's workspace is isolated: its own git worktree on its own branch, or a plain copy."""

CleanupPolicy = Literal["remove", "keep", "remove-always"]
"""What becomes of an isolated workspace when its run is disposed (see :mod:`subagent.isolation`)."""

LimitName = Literal["max_tokens", "max_cost", "max_seconds", "max_tool_calls", "max_turns", "timeout"]
"""What a :class:`LimitHit` names: a budget's cap, or the inactivity ``timeout``."""

StartTimeFeature = Literal[
    "output_schema",
    "depth_limit",
    "tool_filter",
    "persona",
    "additional_directories",
    "max_tokens",
    "max_cost",
    "max_seconds",
    "max_tool_calls",
    "max_turns",
    "isolation",
]
"""A request field that needs the provider's support; checked in this order before any child exists."""

START_TIME_FEATURES: tuple[StartTimeFeature, ...] = ("output_schema", "depth_limit", "tool_filter", "persona")
"""The start-time features a model may ask for through the model-facing tool, in check order.
``additional_directories`` (the caller's, never the model's choice: it widens what the child may touch)
is checked after them, then the caps of the request's :class:`Budget`, each a feature of its own."""

Disposer = Callable[[], None]
"""Undoes one registration (a provider, an event listener). Idempotent."""


class ErrorCode(enum.StrEnum):
    """What went wrong, for callers that branch on it. Compare codes, never message text."""

    DUPLICATE_PROVIDER = "DUPLICATE_PROVIDER"
    """A provider with that name is already registered."""
    NO_PROVIDER = "NO_PROVIDER"
    """No provider is registered under the requested name."""
    UNSUPPORTED_CAPABILITY = "UNSUPPORTED_CAPABILITY"
    """The request asks for a start-time feature the provider does not offer."""
    START_FAILED = "START_FAILED"
    """The child never became ready: it exited, failed, or timed out first."""
    DISPOSED = "DISPOSED"
    """The run or the service was disposed before the operation could happen."""
    NO_RUN = "NO_RUN"
    """No run with that id is in the service's run journal (or the service keeps none)."""
    RESUME_UNSUPPORTED = "RESUME_UNSUPPORTED"
    """The run cannot be resumed; the message says why (still live, its provider is not registered or
    cannot reopen a run, its agent offers neither ``session/resume`` nor ``session/load``...)."""


class SubagentError(Exception):
    """The seam's one exception type; ``code`` says which failure it is.

    ``feature`` names the unmet start-time feature for ``UNSUPPORTED_CAPABILITY`` and is None
    otherwise. ``provider`` names the provider involved, when there is one.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        provider: str | None = None,
        feature: StartTimeFeature | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.provider = provider
        self.feature = feature

    def __repr__(self) -> str:
        return f"SubagentError({self.code.value}, {self.message!r})"

    @classmethod
    def disposed(cls, run_id: str, when: str, *, provider: str | None) -> SubagentError:
        """``DISPOSED``: run ``run_id`` was disposed ``when`` (``"before its turn ended"``)."""
        return cls(ErrorCode.DISPOSED, f"run {run_id!r} was disposed {when}", provider=provider)


@dataclass(frozen=True, slots=True)
class ToolFilter:
    """Narrows a child's tools: ``allow`` (None = everything the parent has) minus ``deny``.

    A filter can only narrow: applied below an ancestor's filter it never brings back a tool the
    ancestor removed.
    """

    allow: AbstractSet[str] | None = None
    deny: AbstractSet[str] = frozenset()

    def __post_init__(self) -> None:
        # Accept any iterable of names, but store frozensets so the filter cannot change later.
        if self.allow is not None and not isinstance(self.allow, frozenset):
            object.__setattr__(self, "allow", frozenset(self.allow))
        if not isinstance(self.deny, frozenset):
            object.__setattr__(self, "deny", frozenset(self.deny))

    def permits(self, tool: str) -> bool:
        """Whether a tool of that name passes this filter."""
        return tool not in self.deny and (self.allow is None or tool in self.allow)

    def narrowed_by(self, other: ToolFilter | None) -> ToolFilter:
        """The filter that permits exactly what both this one and ``other`` permit."""
        if other is None:
            return self
        if self.allow is None:
            allow = other.allow
        elif other.allow is None:
            allow = self.allow
        else:
            allow = self.allow & other.allow
        return ToolFilter(allow=allow, deny=self.deny | other.deny)


@dataclass(frozen=True, slots=True)
class Lineage:
    """Where a child sits in its parent chain, as the service counted it from ``parent_id``.

    The service fills this in on the request it hands a provider; a caller never sets it.

    ``depth`` is 1 for a child of a root (an agent that is not itself a run of the service), 2 for
    a grandchild, and so on. ``ancestors`` lists the ids up the chain, nearest first (the root's id
    last, when the root had one). ``depth_budget`` is how many levels of subagents the child may
    still start below itself (None: no limit); it is the smallest of the request's
    ``depth_limit`` and every ancestor's remaining budget. ``tool_filter`` is the request's filter
    narrowed by every ancestor's: what the child may have, never more than an ancestor had.
    """

    depth: int = 1
    ancestors: tuple[str, ...] = ()
    depth_budget: int | None = None
    tool_filter: ToolFilter | None = None

    @property
    def parent_id(self) -> str | None:
        """The nearest ancestor's id, when there is one."""
        return self.ancestors[0] if self.ancestors else None


LINEAGE_META_KEY = "subagent-seam/lineage"
"""The ``_meta`` key under which the ACP provider tells a child agent its place in the chain:
``{"depth": int, "depthBudget": int}`` in ``session/new``, sent when a depth budget applies.
``subagent serve`` honours it, so a depth limit holds across the process boundary too."""

RUN_META_KEY = "subagent-seam/run"
"""The ``_meta`` key under which ``subagent serve`` marks the tool call that shows one run of its
subagent tree to the client: ``{"runId", "parentId", "provider", "state", "depth"}`` plus
``"stopReason"`` once the run ended with one. ``state`` is ``running``, ``completed``, ``failed``
or ``cancelled``; ``parentId`` is the session's id for the session's own children, and ``depth``
counts levels below the session (1 for those children). At a run's end it also carries
``"elapsedSeconds"`` and, when the run reported any, ``"usage"`` (ACP's camelCase counts); a run that
ran under a budget adds ``"budget"``, ``"spent"`` and ``"limit"`` (the cap that stopped it, or null),
in the form ``subagent run --json`` writes them."""

TURN_META_KEY = "subagent-seam/turn"
"""The ``_meta`` key of the ``session_info_update`` with which ``subagent serve`` tells its client that
a turn of the session's agent began or ended (a prompt may run several: one per call of its background
children): ``{"turn": n, "state": "started"}`` (with ``"woken": true`` for a turn its children's
notices called for), then ``{"turn": n, "state": "ended", "stopReason": ...}``."""

RETRY_META_KEY = "subagent-seam/retry"
"""The ``_meta`` key of the ``session_info_update`` with which ``subagent serve`` tells its client that
a model call of the session's agent failed and is retried: ``{"attempt": n, "attempts": most,
"delay": seconds, "reason": "rate_limited, HTTP 429"}`` (the failed attempt from 1; the reason names
the failure's kind and status only)."""


def _cap(name: str, value: object, *, whole: bool, positive: bool) -> None:
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (whole and not isinstance(value, int))
    ):
        kind = "a whole number" if whole else "a number"
        raise TypeError(f"{name} must be {kind}, not {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'} and finite, got {value!r}")


@dataclass(frozen=True, slots=True)
class Budget:
    """Hard caps on what a child run may spend, any subset of them (None: no cap).

    ``max_tokens`` counts input plus output tokens over the whole run (every turn, and every run
    below it); ``max_cost`` is in the currency the usage is reported in (the agent's own, or the
    service's :class:`~subagent.budget.PriceTable`); ``max_seconds`` is wall time from the run's
    start, unlike the inactivity ``timeout``; ``max_tool_calls`` counts tool calls the child starts;
    ``max_turns`` counts model calls (an agent loop's round trips). A run's spending includes its
    subtree's, and a child's caps are at most what its parent has left.
    """

    max_tokens: int | None = None
    max_cost: float | None = None
    max_seconds: float | None = None
    max_tool_calls: int | None = None
    max_turns: int | None = None

    def __post_init__(self) -> None:
        _cap("max_tokens", self.max_tokens, whole=True, positive=False)
        _cap("max_cost", self.max_cost, whole=False, positive=False)
        _cap("max_seconds", self.max_seconds, whole=False, positive=True)
        _cap("max_tool_calls", self.max_tool_calls, whole=True, positive=False)
        _cap("max_turns", self.max_turns, whole=True, positive=False)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> Budget:
        """A budget from ``{"max_tokens": ..., ...}`` (a tool call's arguments, a config table).

        Raises:
            ValueError: an unknown key, or a cap out of range; TypeError: a cap of the wrong type.
        """
        unknown = sorted(set(raw) - set(BUDGET_FIELDS))
        if unknown:
            raise ValueError(f"unknown budget keys: {', '.join(unknown)} (known: {', '.join(BUDGET_FIELDS)})")
        return cls(**raw)

    def to_mapping(self) -> dict[str, int | float]:
        """The caps that are set, by name (the inverse of :meth:`from_mapping`)."""
        return {name: value for name in BUDGET_FIELDS if (value := getattr(self, name)) is not None}

    def fields(self) -> tuple[BudgetField, ...]:
        """The caps that are set, in check order."""
        return tuple(name for name in BUDGET_FIELDS if getattr(self, name) is not None)

    def cap(self, name: BudgetField) -> float | None:
        """The value of cap ``name`` (None: not capped)."""
        value: float | None = getattr(self, name)
        return value

    def tighter(self, other: Budget | None) -> Budget:
        """The budget that allows only what both this one and ``other`` allow: each cap the smaller."""
        if other is None:
            return self
        caps: dict[str, Any] = {}
        for name in BUDGET_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            caps[name] = theirs if mine is None else (mine if theirs is None else min(mine, theirs))
        return Budget(**caps)

    def describe(self, currency: str | None = None) -> str:
        """The caps for a person: ``50,000 tokens, 0.5 USD, 120 s, 20 tool calls`` (``no caps``)."""
        parts = [
            _amount(name, value, currency) for name in BUDGET_FIELDS if (value := self.cap(name)) is not None
        ]
        return ", ".join(parts) if parts else "no caps"


def _amount(name: LimitName, value: float, currency: str | None = None) -> str:
    if name == "max_tokens":
        return f"{int(value):,} tokens"
    if name == "max_cost":
        return f"{value:.4g} {currency}" if currency else f"{value:.4g} (cost)"
    if name in ("max_seconds", "timeout"):
        return f"{value:.3g} s"
    if name == "max_tool_calls":
        return f"{int(value):,} tool call{'s' if value != 1 else ''}"
    return f"{int(value):,} turn{'s' if value != 1 else ''}"


@dataclass(frozen=True, slots=True)
class Spend:
    """What a run (with everything below it) has spent, in a budget's units.

    ``tokens`` is input plus output tokens; ``cost`` is in ``cost_currency`` (0 and None when
    nothing was priced); ``seconds`` is wall time since the run started; ``turns`` counts model calls.
    """

    tokens: int = 0
    cost: float = 0.0
    cost_currency: str | None = None
    seconds: float = 0.0
    tool_calls: int = 0
    turns: int = 0

    def of(self, name: BudgetField) -> float:
        """The amount spent against cap ``name``."""
        return {
            "max_tokens": self.tokens,
            "max_cost": self.cost,
            "max_seconds": self.seconds,
            "max_tool_calls": self.tool_calls,
            "max_turns": self.turns,
        }[name]

    def describe(self, budget: Budget | None = None) -> str:
        """The spent for a person, beside each cap of ``budget`` that is set:
        ``1,234 of 10,000 tokens, 3 of 5 tool calls, 12.5 of 60 s``."""
        if budget is None or not budget.fields():
            return "no caps"
        parts = []
        for name in budget.fields():
            cap = budget.cap(name)
            assert cap is not None
            limit = _amount(name, cap, self.cost_currency)
            spent = self.of(name)
            shown = f"{spent:.3g}" if name in ("max_cost", "max_seconds") else f"{int(spent):,}"
            parts.append(f"{shown} of {limit}")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class LimitHit:
    """Which cap or timeout ended a run, and by how much.

    ``limit`` names it; ``allowed`` is its value and ``spent`` what had been spent when the run was
    stopped (for a budget stopped before a model call that could not fit, ``spent`` may be below
    ``allowed``: ``needed`` is then what the call would have reserved). ``owner`` is the id of the run
    whose budget it was: the run itself, or the ancestor whose cap its tree reached (None: a budget
    the host set for everything below a root, or the run was not started by a service).
    """

    limit: LimitName
    allowed: float
    spent: float = field(compare=False)
    owner: str | None = None
    needed: float | None = field(default=None, compare=False)
    currency: str | None = field(default=None, compare=False)
    """The currency of a ``max_cost`` hit's amounts, when the spending had one."""

    def describe(self, currency: str | None = None) -> str:
        """One line for a person and for a model: what was hit, spent against allowed, whose."""
        currency = currency or self.currency
        if self.limit == "timeout":
            return f"no sign of life for {self.allowed:g} s (the inactivity timeout)"
        whose = f" (the budget of {self.owner})" if self.owner else ""
        spent = _amount(self.limit, self.spent, currency).split(" ", 1)[0]
        line = f"{self.limit}: {spent} spent of {_amount(self.limit, self.allowed, currency)}{whose}"
        if self.needed is not None and self.spent <= self.allowed:
            line += f"; the next step needed {_amount(self.limit, self.needed, currency)} more"
        return line


BUDGET_META_KEY = "subagent-seam/budget"
"""The ``_meta`` key under which the ACP provider tells a child agent the budget it has left, in
``session/new``: ``{"maxTokens", "maxCost", "maxSeconds", "maxToolCalls", "maxTurns"}`` (the caps
that are set). ``subagent serve`` enforces it on the session's whole tree."""


def _frozen_mapping(value: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    frozen: Mapping[str, Any] | None = None if value is None else freeze_json(value)
    return frozen


def _directories(value: Sequence[str]) -> tuple[str, ...]:
    """``additional_directories`` as a tuple of non-empty paths that a process can be given."""
    if isinstance(value, str):
        raise TypeError("additional_directories must be a sequence of paths, not one string")
    directories = tuple(os.fspath(path) for path in value)
    for path in directories:
        if not isinstance(path, str):
            raise TypeError(f"additional_directories holds a {type(path).__name__}, not a path: {path!r}")
        if not path or "\0" in path:
            raise ValueError(f"additional_directories holds an empty path or one with a NUL: {path!r}")
    return directories


@dataclass(frozen=True, slots=True)
class SubagentRequest:
    """What to ask a child to do, and under which constraints.

    ``timeout`` is an inactivity timeout in seconds: it counts silence from the child, not the
    turn's total length. ``output_schema``, ``depth_limit``, ``tool_filter`` and ``persona`` are
    start-time features: a provider that lacks one refuses the request before any child exists.
    Mappings are deep-copied and frozen on construction, so a caller changing its dicts later
    changes nothing here; :func:`thaw_json` gives plain copies for encoders.
    """

    prompt: str
    cwd: str | None = None
    output_schema: Mapping[str, Any] | None = None
    depth_limit: int | None = None
    tool_filter: ToolFilter | None = None
    persona: str | None = None
    timeout: float | None = None
    parent_id: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    lineage: Lineage | None = field(default=None, compare=False)
    """Filled in by the service before the provider sees the request; a caller's value is replaced."""
    additional_directories: Sequence[str] = ()
    """More directories the child may work in besides ``cwd`` (ACP's ``additionalDirectories``): each
    becomes a root of its file-system sandbox too. A relative path is resolved against the session's cwd
    when the child starts. A start-time feature: a provider that cannot honour it refuses the request."""
    budget: Budget | None = None
    """Hard caps on what the run, with everything below it, may spend. Each cap set is a start-time
    feature of its own: a provider that cannot enforce it refuses the request, naming the cap. The
    service narrows it to what the run's ancestors have left."""
    isolation: IsolationMode | None = None
    """Run the child in its own workspace: ``"worktree"`` (a git worktree of ``cwd``'s repository on
    a branch of its own, its changes handed back as that branch) or ``"copy"`` (a copy of ``cwd``).
    A start-time feature: a provider that cannot isolate refuses it (see :mod:`subagent.isolation`)."""
    cleanup: CleanupPolicy = "remove"
    """With ``isolation``: what becomes of the workspace when the run is disposed."""
    account: BudgetAccount | None = field(default=None, compare=False, repr=False)
    """The run's account in its tree's budget ledger: filled in by the service (a caller's value is
    replaced); a provider used without a service makes one from ``budget``."""
    on_checkpoint: Callable[[Mapping[str, Any]], Awaitable[None]] | None = field(
        default=None, compare=False, repr=False
    )
    """Filled in by a service that keeps a run journal (a caller's value is replaced): a provider awaits
    it with its run's checkpoint (:meth:`CheckpointedRun.checkpoint`) when the child must not go on
    before the checkpoint is kept: an ACP child's session, before its first prompt is sent (a parent
    killed during that prompt leaves the session to reopen). None: nobody keeps checkpoints."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_schema", _frozen_mapping(self.output_schema))
        object.__setattr__(self, "metadata", _frozen_mapping(self.metadata))
        object.__setattr__(self, "additional_directories", _directories(self.additional_directories))
        if self.depth_limit is not None and self.depth_limit < 0:
            raise ValueError(f"depth_limit must be >= 0, got {self.depth_limit}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.isolation not in (None, "worktree", "copy"):
            raise ValueError(f"isolation must be 'worktree', 'copy' or None, got {self.isolation!r}")
        if self.cleanup not in ("remove", "keep", "remove-always"):
            raise ValueError(f"cleanup must be 'remove', 'keep' or 'remove-always', got {self.cleanup!r}")

    def requested_features(self) -> tuple[StartTimeFeature, ...]:
        """The start-time features this request asks for, in the order they are checked."""
        asked = {
            "output_schema": self.output_schema is not None,
            "depth_limit": self.depth_limit is not None,
            "tool_filter": self.tool_filter is not None,
            "persona": self.persona is not None,
        }
        features = tuple(feature for feature in START_TIME_FEATURES if asked[feature])
        if self.additional_directories:
            features = (*features, "additional_directories")
        if self.budget is not None:
            features = (*features, *self.budget.fields())
        return features if self.isolation is None else (*features, "isolation")


@dataclass(slots=True)
class Usage:
    """What a child's turn used, as far as the child reports it: token counts, and for ACP agents
    that send ``usage_update`` (Claude Code, Codex, opencode) how full the context window is and
    what the session has cost so far."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    thought_tokens: int | None = None
    cached_read_tokens: int | None = None
    cached_write_tokens: int | None = None
    context_used: int | None = None
    """Tokens in the context window at the turn's last report (a snapshot, not a count to add up)."""
    context_size: int | None = None
    """The context window's size in tokens."""
    cost: float | None = None
    """What the session has cost so far, in ``cost_currency`` (cumulative, as the agent reports it)."""
    cost_currency: str | None = None


_TOKEN_FIELDS = tuple(f.name for f in fields(Usage) if f.name.endswith("_tokens"))
"""The fields of :class:`Usage` that count tokens (and so add up across turns and runs)."""


@dataclass(frozen=True, slots=True)
class FileChange:
    """One file a child changed: its path in the repository, and the lines added and deleted (None for
    a binary file)."""

    path: str
    added: int | None
    deleted: int | None


@dataclass(frozen=True, slots=True)
class WorkspaceChange:
    """Where an isolated child worked and what it changed.

    ``branch`` (worktree mode) holds the child's work: ``commit`` is its tip when the child changed
    anything (what the child left uncommitted is committed there, so nothing is lost), over ``base``,
    the commit the worktree started from. ``files`` lists what changed since ``base`` (a copy: against
    the directory copied). ``path`` is the workspace's directory; ``removed`` says whether the cleanup
    policy removed it (a removed worktree's work stays on its branch).
    """

    mode: IsolationMode
    path: str
    changed: bool
    files: tuple[FileChange, ...] = ()
    branch: str | None = None
    base: str | None = None
    commit: str | None = None
    removed: bool = False

    def describe(self) -> str:
        """One paragraph for a person and for a model: where the work is, and the files with their counts."""
        if not self.changed:
            return self.describe_files()
        commit = self.commit[:12] if self.commit else "?"
        base = self.base[:12] if self.base else "?"
        where = (
            f"its changes are on branch {self.branch} (commit {commit}, over {base})"
            if self.mode == "worktree"
            else f"its changes are in the copy at {self.path}"
        )
        return f"{where}: {self.describe_files()}"

    def describe_files(self) -> str:
        """What changed, without where: the files with their counts (the first 20), or that none did."""
        if not self.changed:
            return "it changed no file"
        files = ", ".join(
            f"{change.path} (+{change.added} -{change.deleted})"
            if change.added is not None
            else f"{change.path} (binary)"
            for change in self.files[:20]
        )
        more = f" and {len(self.files) - 20} more" if len(self.files) > 20 else ""
        return f"{len(self.files)} file(s) changed: {files}{more}"


@dataclass(slots=True)
class SubagentResult:
    """How a child's turn ended.

    A child-level failure is a result with ``stop_reason == "error"`` and a readable ``error``
    (for a child process: its exit status and the tail of its stderr), never an exception.
    ``output`` is the final assistant message, partial when the turn did not complete.
    ``structured`` holds the validated JSON value when the request carried ``output_schema``.
    ``elapsed_seconds`` is the run's wall time from its start request to its end, set by the
    service (None from a provider used directly); it is not part of equality.
    """

    output: str
    stop_reason: StopReason
    structured: Any = None
    error: str | None = None
    usage: Usage | None = None
    elapsed_seconds: float | None = field(default=None, compare=False)
    limit: LimitHit | None = None
    """Which cap of the budget (``stop_reason == "budget"``) or which timeout (``"timeout"``) ended
    the run, with the spent and the allowed; None when no limit did."""
    output_final: bool | None = None
    """Whether ``output`` is the agent's final message (True) or was cut short: a partial message,
    the last one before a stop. Defaults to whether the turn completed."""
    spent: Spend | None = field(default=None, compare=False)
    """What the run and its subtree spent, in the budget's units, when it ran under a budget (set
    by the service; not part of equality: it holds wall time)."""
    budget: Budget | None = None
    """The caps the run ran under (its own, narrowed by its ancestors'), when it had any."""
    workspace: WorkspaceChange | None = None
    """With ``isolation``: where the child worked and what it changed (its branch, base and commit)."""

    def __post_init__(self) -> None:
        if self.output_final is None:
            self.output_final = self.stop_reason == "completed"

    @property
    def ok(self) -> bool:
        """Whether the turn completed."""
        return self.stop_reason == "completed"


@dataclass(frozen=True, slots=True)
class SubagentCapabilities:
    """The start-time features a provider supports. ``tool_filter`` covers ``persona`` too."""

    output_schema: bool = False
    depth_limit: bool = False
    tool_filter: bool = False
    additional_directories: bool = False
    """Whether the provider can give a child more directories than its cwd (only ``acp`` can: an
    in-process child has no file-system sandbox to widen)."""
    budget: AbstractSet[BudgetField] = frozenset()
    """The caps of a :class:`Budget` the provider enforces (in-process providers: all of them; the acp
    provider: what its agent reports, see :class:`~subagent.providers.acp.AcpProvider`)."""

    isolation: AbstractSet[IsolationMode] = frozenset()
    """The workspace isolations the provider can give a child (``worktree``, ``copy``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.budget, frozenset):
            object.__setattr__(self, "budget", frozenset(self.budget))
        if not isinstance(self.isolation, frozenset):
            object.__setattr__(self, "isolation", frozenset(self.isolation))
        unknown = set(self.budget) - set(BUDGET_FIELDS)
        if unknown:
            raise ValueError(f"unknown budget caps: {', '.join(sorted(unknown))}")

    def supports(self, feature: StartTimeFeature) -> bool:
        """Whether a request asking for ``feature`` can be honoured."""
        if feature == "persona":
            return self.tool_filter
        if feature in BUDGET_FIELDS:
            return feature in self.budget
        if feature == "isolation":
            return bool(self.isolation)
        return bool(getattr(self, feature))


@runtime_checkable
class SubagentRun(Protocol):
    """One child run. Use it as an async context manager: leaving it awaits :meth:`dispose`.

    ``started()`` and ``result()`` may be awaited any number of times, by any number of tasks,
    and give the same outcome each time.
    """

    @property
    def id(self) -> str:
        """The run's id, unique within its provider."""
        ...

    async def started(self) -> None:
        """Return once a real child exists and is ready; raise if it failed or was disposed first."""
        ...

    async def result(self) -> SubagentResult:
        """Return how the turn ended. Child-level failure is a result, not an exception."""
        ...

    async def cancel(self) -> None:
        """Ask the child to stop; ``result()`` then settles with ``cancelled``."""
        ...

    async def dispose(self) -> None:
        """Tear the child down. Idempotent; returns once nothing of the run is left running."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class SteerableRun(Protocol):
    """A run that accepts messages while it works: they reach the child at its next idle point."""

    async def send_message(self, text: str) -> None:
        """Queue ``text`` for the child."""
        ...


@runtime_checkable
class ResumableRun(Protocol):
    """A run whose child can take another turn after its result settled."""

    async def resume(self, prompt: str) -> SubagentResult:
        """Run another turn in the same child and return how that turn ended."""
        ...


@runtime_checkable
class ObservableRun(Protocol):
    """A run whose child's liveness can be watched while it works.

    Timestamps are ``time.monotonic()`` values. The service reads these properties on a timer to
    emit ``subagent/progress`` between a run's ``subagent/start`` and ``subagent/end``; reading
    them must be cheap and must not block or raise.
    """

    @property
    def last_activity(self) -> float | None:
        """When the child last showed a sign of life (an update, a request); None before it exists."""
        ...

    @property
    def pending_permissions(self) -> int:
        """How many permission questions from the child are waiting for an answer now."""
        ...

    @property
    def update_count(self) -> int:
        """How many updates (messages, tool calls, plans...) the child has sent so far."""
        ...


@runtime_checkable
class QueueableRun(Protocol):
    """A run that may wait for a concurrency slot before its child is created."""

    @property
    def queued(self) -> bool:
        """Whether the run is waiting for a slot now: no child exists for it yet."""
        ...


@runtime_checkable
class CheckpointedRun(Protocol):
    """A run that can say, after each completed turn, what a new child needs to continue it: the
    service's run journal keeps it, and :meth:`ReopenableProvider.reopen` gets it back."""

    def checkpoint(self) -> Mapping[str, Any] | None:
        """A JSON-able record of the run as of its last completed turn (an ACP child: its session id;
        an in-process child: its message log), or None when there is nothing to continue from yet.
        Called by the service once the child is ready and after each completed turn; cheap, never
        raises, and never includes a turn still in flight."""
        ...


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """What a run journal kept of an earlier run: what its provider needs to continue it in a new
    child (see :meth:`ReopenableProvider.reopen`)."""

    run_id: str
    """The journal's id of the run being continued."""
    checkpoint: Mapping[str, Any] | None
    """The run's last :meth:`CheckpointedRun.checkpoint` (None: it never reached one)."""
    agent: Mapping[str, Any]
    """What the provider said of how it ran the child (:meth:`ReopenableProvider.describe_agent`)."""
    turns_completed: int
    """How many of the run's turns completed (none of them is run again)."""


@runtime_checkable
class ReopenableProvider(Protocol):
    """A provider that can continue a journaled run in a new child (``SubagentService.resume``)."""

    def describe_agent(self) -> Mapping[str, Any]:
        """How this provider runs its children, JSON-able, for the journal: an ACP provider's command,
        transport and cwd. Never a secret (no environment values)."""
        ...

    def reopen(self, request: SubagentRequest, point: ResumePoint, task_group: TaskGroup) -> SubagentRun:
        """Start a new child that continues the run ``point`` describes and runs ``request.prompt`` as its
        next turn, as :meth:`SubagentProvider.start` does for a new run.

        Raises:
            SubagentError: ``RESUME_UNSUPPORTED`` with the reason, before any child exists, when the
                point cannot be continued here (no checkpoint, a different agent). A child whose agent
                turns out to offer neither ``session/resume`` nor ``session/load`` fails its readiness
                with ``RESUME_UNSUPPORTED``.
        """
        ...


class SubagentProvider(Protocol):
    """One way to run a child agent. The service snapshots these fields at registration."""

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> SubagentCapabilities: ...

    @property
    def inherits_parent_context(self) -> bool: ...

    def start(self, request: SubagentRequest, task_group: TaskGroup) -> SubagentRun:
        """Create the run without waiting: readiness is reported by ``run.started()``.

        Tasks started in ``task_group`` belong to the service and must not raise: failures
        belong in the run's readiness or result. They must all end by the time ``dispose()``
        returns.
        """
        ...


@dataclass(frozen=True, slots=True)
class ProviderSnapshot:
    """What the registry holds for a provider, frozen at registration.

    ``start`` is bound to the original provider object, so replacing the provider's ``start``
    attribute afterwards changes nothing the registry does.
    """

    name: str
    capabilities: SubagentCapabilities
    inherits_parent_context: bool
    start: Callable[[SubagentRequest, TaskGroup], SubagentRun] = field(repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class SubagentRunInfo:
    """Payload of ``subagent/start``: a run whose child is ready."""

    id: str
    provider: str
    parent_id: str | None
    prompt: str


@dataclass(frozen=True, slots=True)
class SubagentRunEndInfo:
    """Payload of ``subagent/end``: how a started run ended.

    ``stop_reason`` and ``last_assistant_message`` are None when the result itself failed (an
    infrastructure failure rather than a child-level one); ``error`` then says why.
    """

    id: str
    provider: str
    stop_reason: StopReason | None
    last_assistant_message: str | None
    error: str | None
    usage: Usage | None = None
    """What the run's turn used, as far as its child reported it (None: nothing reported)."""
    elapsed_seconds: float | None = field(default=None, compare=False)
    """Wall time from the start request to the end, the child's start-up included (not part of
    equality: no two runs take the same time)."""
    parent_id: str | None = None
    """The run's parent, as in ``subagent/start``: enough to roll costs up a tree of ends."""
    limit: LimitHit | None = None
    """The cap or timeout that ended the run (:attr:`SubagentResult.limit`), when one did."""
    budget: Budget | None = None
    """The caps the run ran under, when it had any."""
    spent: Spend | None = field(default=None, compare=False)
    """What the run and its subtree spent against ``budget`` (None without one)."""
    workspace: WorkspaceChange | None = None
    """With ``isolation``: where the child worked and what it changed (:attr:`SubagentResult.workspace`)."""


def sum_usage(usages: Iterable[Usage | None]) -> Usage | None:
    """The total of several runs' usage: token counts added up (the total too, when every usage that
    counts tokens has one or its input and output), costs too when every cost given is in
    the same currency (else the cost is left out: adding dollars to euros says nothing). The context
    window fields are snapshots of one session, so a total has none. None when no usage was given."""
    seen = False
    tokens: dict[str, Any] = {}  # ints only (Any: Usage also has a str field)
    costs: list[tuple[float, str | None]] = []
    total: int | None = 0
    for usage in usages:
        if usage is None:
            continue
        seen = True
        for name in _TOKEN_FIELDS:
            value = getattr(usage, name)
            if isinstance(value, int) and name != "total_tokens":
                tokens[name] = tokens.get(name, 0) + value
        # A total is a total only if every part has one: given, or its input and output added up.
        own = usage.total_tokens
        if own is None and usage.input_tokens is not None and usage.output_tokens is not None:
            own = usage.input_tokens + usage.output_tokens
        counts_tokens = any(getattr(usage, name) is not None for name in _TOKEN_FIELDS)
        if own is not None and total is not None:
            total += own
        elif counts_tokens:
            total = None
        if usage.cost is not None:
            costs.append((usage.cost, usage.cost_currency))
    if not seen:
        return None
    if total is not None and (total or "input_tokens" in tokens or "output_tokens" in tokens):
        tokens["total_tokens"] = total
    currencies = {currency for _cost, currency in costs}
    if costs and len(currencies) == 1:
        return Usage(**tokens, cost=sum(cost for cost, _currency in costs), cost_currency=currencies.pop())
    return Usage(**tokens)


def _seconds(value: float) -> str:
    # Tenths while they matter to a reader, whole seconds after that.
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


@dataclass(frozen=True, slots=True)
class SubagentProgressInfo:
    """Payload of ``subagent/progress``: a heartbeat of a started run whose child is observable.

    ``idle_seconds`` is the time since the child's last sign of life; while
    ``waiting_on_permission`` it is how long the child has been waiting for the answer (time the
    inactivity timeout does not count). ``updates`` counts the updates the child has sent so far
    and ``elapsed_seconds`` is the time since ``subagent/start``.
    """

    id: str
    provider: str
    idle_seconds: float
    waiting_on_permission: bool
    updates: int
    elapsed_seconds: float

    def describe(self) -> str:
        """One line for a person: ``child alive, last update 12 s ago``,
        ``waiting on a permission answer for 40 s``."""
        if self.waiting_on_permission:
            return f"waiting on a permission answer for {_seconds(self.idle_seconds)}"
        if self.updates == 0:
            return f"child alive, no update yet after {_seconds(self.elapsed_seconds)}"
        return f"child alive, last update {_seconds(self.idle_seconds)} ago"
