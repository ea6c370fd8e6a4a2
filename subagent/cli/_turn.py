"""One turn through the seam: :func:`drive` starts the agent through
:class:`~subagent.service.SubagentService` and :class:`~subagent.providers.acp.AcpProvider`, exactly as
a library caller would, reports the run to a view, and turns every way it can end (a start failure,
an interrupt, a teardown, a denial the agent gave up on) into an :class:`TurnOutcome`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import anyio

from subagent import _isolation_core as isolation_core
from subagent._text import one_line
from subagent._usage_codec import usage_from_acp
from subagent.acp import schema
from subagent.acp._elicitation import ElicitationField, ElicitationQuestion
from subagent.acp.client import SubagentSession
from subagent.acp.handlers import PermissionDecision, PermissionOutcome, PermissionQuestion
from subagent.acp.transports._channel import Transport
from subagent.budget import BudgetAccount, PriceTable
from subagent.cli._console import sanitize
from subagent.cli._exits import UsageError
from subagent.cli._interrupts import Interrupts
from subagent.cli._journal import JournalChoice
from subagent.cli._options import UsageReport
from subagent.cli._permission import AnswerSource, PermissionMode, permission_policy
from subagent.cli._tool_call_tracker import ToolCalls, ToolCallState
from subagent.cli._views import RunView, StartInfo, run_meta
from subagent.isolation import IsolationError, IsolationSettings, Workspace
from subagent.journal import RunJournal, RunRecord
from subagent.providers.acp import DEFAULT_READY_TIMEOUT, AcpProvider, AcpRun
from subagent.service import ServiceRun, SubagentService
from subagent.types import (
    Budget,
    CleanupPolicy,
    ErrorCode,
    IsolationMode,
    SubagentError,
    SubagentRequest,
    SubagentResult,
    Usage,
    WorkspaceChange,
    sum_usage,
)

__all__ = ["CLI_META_KEY", "ResumeTarget", "TurnOutcome", "TurnSpec", "drive"]

CLI_META_KEY: Final = "subagent-seam/cli"
"""The key, in a run's request metadata (which the run journal keeps and no agent is sent), of how the
command line ran it: what ``subagent resume`` needs, beside the journaled agent, to run it the same way
(the configured agent's name, to take its environment from the config again; the provider's settings).
Never a secret: no environment value is in it."""


@dataclass(frozen=True, slots=True)
class ResumeTarget:
    """A journaled run that the turn continues, instead of starting a new run (``subagent resume``)."""

    id: str
    """Its journal id."""
    provider: str
    """The name its provider was registered under (the service reopens it through that name)."""
    prompt: str | None
    """The prompt of its next turn (None: the service's, which names what was interrupted)."""


logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TurnSpec:
    """Everything one turn needs, after options, config and defaults were merged: a field named like an
    option of :data:`~subagent.cli._options.RUN_OPTIONS` is set to its merged value."""

    command: list[str]
    prompt: str
    cwd: str
    permission_timeout: float
    additional_directories: tuple[str, ...] = ()
    """More directories the agent may work in (``--add-dir``), absolute."""
    env: Mapping[str, str] | None = None
    permission: PermissionMode | Literal["demo"] = "deny"
    answers: AnswerSource | None = None
    timeout: float | None = None
    ready_timeout: float | None = None
    auth_method: str | None = None
    fs: bool = True
    subagents: bool = True
    """Advertise ACP's subagents capability (``--no-subagents``: do not)."""
    mode: str | None = None
    """The session mode to switch to before the prompt (None: the agent's own)."""
    config_options: Mapping[str, str | bool] = dataclasses.field(default_factory=dict)
    """Session config options to set before the prompt."""
    transport: Transport | None = None
    """Where the agent runs (None: a local child process)."""
    json: bool = False
    """One JSON object on stdout (``--json``)."""
    events: bool = False
    events_file: str | None = None
    """Where the ``--events`` lines are written too."""
    trace: str | None = None
    """Where the trace page is written when the run ends."""
    progress: bool = False
    demo: bool = False
    max_tokens: int | None = None
    max_cost: float | None = None
    max_seconds: float | None = None
    max_tool_calls: int | None = None
    max_turns: int | None = None
    """The caps of the run's budget (``--max-*``), each None when not capped."""
    reports_usage: Sequence[UsageReport] | None = None
    """What the agent reports of its usage (``--reports-usage``; None: what is known of the agent)."""
    prices: PriceTable | None = None
    """The config's ``[prices]``, for ``max_cost`` over an agent that reports tokens but no cost."""
    isolation: IsolationMode | None = None
    """The run's workspace (``--isolation``): its own git worktree, a copy, or None (the cwd itself)."""
    cleanup: CleanupPolicy = "remove"
    """What becomes of the workspace at the end (``--cleanup``)."""
    worktree_root: str | None = None
    """Where the workspaces are made (``--worktree-root``; None: the repository's git directory)."""
    branch_prefix: str | None = None
    """What a worktree's branch name starts with (``--branch-prefix``; None: ``subagent/``)."""
    journal: JournalChoice | None = None
    """The run journal the run is recorded in (``--journal``...; None, or a choice without a path: none)."""
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The request's metadata: how the command line ran it (:data:`CLI_META_KEY`), for the journal."""
    resume: ResumeTarget | None = None
    """The journaled run to continue instead of starting one (``subagent resume``); ``command``, ``cwd``
    and ``transport`` are then its agent's, and ``timeout`` and the caps, when set, the command line's."""

    @property
    def isolation_settings(self) -> IsolationSettings:
        """Where the provider makes the run's workspace."""
        if self.branch_prefix is None:
            return IsolationSettings(root=self.worktree_root)
        return IsolationSettings(root=self.worktree_root, branch_prefix=self.branch_prefix)

    @property
    def budget(self) -> Budget | None:
        """The run's caps (None: none)."""
        budget = Budget(
            max_tokens=self.max_tokens,
            max_cost=self.max_cost,
            max_seconds=self.max_seconds,
            max_tool_calls=self.max_tool_calls,
            max_turns=self.max_turns,
        )
        return budget if budget.fields() else None


@dataclass(slots=True)
class TurnOutcome:
    """How a turn ended; ``start_error`` when the agent never became ready."""

    result: SubagentResult
    start_error: str | None = None
    elapsed: float = 0.0
    run_costs: dict[str, Usage] = dataclasses.field(default_factory=dict)
    """The usage of each run of the agent's subagent tree that ended reporting token counts or a cost
    (``subagent serve`` sends it in the run's ``_meta``, and so does the ACP provider for the subagent
    sessions an agent announces), by run id: bounded by ``MAX_COSTED_RUNS``."""
    runs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Each run of the agent's subagent tree as last reported (``runId``, ``parentId``, ``provider``,
    ``depth``, ``state``, ``title``, and once ended ``stopReason``, ``elapsedSeconds``, ``usage``), by
    run id, in the order first seen: bounded by ``MAX_COSTED_RUNS``."""

    journal_id: str | None = None
    """The run's id in the run journal (None: it keeps none, or the run never began)."""
    resumable: bool = False
    """The turn did not complete and ``subagent resume`` can continue it: its session is journaled and
    its agent offers ``session/resume`` or ``session/load``."""
    refused: str | None = None
    """Why the run could not be resumed, before any agent was started (``NO_RUN``, ``RESUME_UNSUPPORTED``,
    a cap the agent cannot be held to)."""

    @property
    def subtree_usage(self) -> Usage | None:
        """The turn's own usage and its subagent tree's, added up (None when nothing reported any)."""
        return sum_usage([self.result.usage, *self.run_costs.values()])


MAX_COSTED_RUNS: Final = 100_000
"""Runs of a subagent tree whose cost one turn remembers: a few MiB at most, whatever an agent sends."""


def _note_run(costs: dict[str, Usage], runs: dict[str, dict[str, Any]], update: schema.SessionUpdate) -> None:
    """Remember what a run's update says of it, and the usage its end update carries (the tree of runs
    of ``subagent serve``, or of the subagent sessions an agent announced)."""
    if not isinstance(update, schema.ToolCall | schema.ToolCallProgress):
        return
    run = run_meta(update)
    if run is None:
        return
    run_id = run["runId"]
    if run_id in runs or len(runs) < MAX_COSTED_RUNS:
        title = update.title if update.title is not None else runs.get(run_id, {}).get("title")
        runs[run_id] = {**run, "title": title}
    if not isinstance(update, schema.ToolCallProgress):
        return
    raw = run.get("usage")
    usage = usage_from_acp(raw) if isinstance(raw, Mapping) else None
    # A context window alone (all Codex says of its subagents) tells nothing of what a run spent: such
    # a run is not counted as one that reported its cost, so no subtree total leaves it out as zero.
    if usage is None or dataclasses.replace(usage, context_used=None, context_size=None) == Usage():
        return
    if run_id in costs or len(costs) < MAX_COSTED_RUNS:
        costs[run_id] = usage  # an agent that reports a run twice is counted once


@dataclass(frozen=True, slots=True)
class _Denial:
    """A permission question the policy answered with a rejection, or withdrew."""

    call: ToolCallState
    reason: str


class _StartGate(RunView):
    """Forwards to the real view, announcing the start (once) before anything of the session.
    Remembers the last permission decision: a denial may be why the agent ended its turn."""

    def __init__(self, inner: RunView) -> None:
        self.inner = inner
        self.announce: Callable[[], None] = lambda: None
        self.last_denial: _Denial | None = None
        """The last permission decision, if it was a denial (None after an allowing one)."""

    def spawning(self, command: Sequence[str], cwd: str) -> None:
        logger.info("starting agent `%s` in %s", shlex.join(command), cwd)
        self.inner.spawning(command, cwd)

    def started(self, info: StartInfo) -> None:
        logger.info(
            "agent ready: %s %s, protocol version %s, session %s",
            info.agent_name or "(unnamed)",
            info.agent_version or "",
            info.protocol_version,
            info.session_id,
        )
        self.inner.started(info)

    def update(self, update: schema.SessionUpdate, changed_call: ToolCallState | None) -> None:
        self.announce()
        self.inner.update(update, changed_call)

    def subagent_update(self, session_id: str, update: schema.SessionUpdate) -> None:
        self.announce()
        self.inner.subagent_update(session_id, update)

    def question(self, question: PermissionQuestion, call: ToolCallState, timeout: float) -> None:
        self.announce()
        self.inner.question(question, call, timeout)

    def answered(self, *, echoed: bool) -> None:
        self.inner.answered(echoed=echoed)

    def decided(
        self, question: PermissionQuestion, call: ToolCallState, decision: PermissionDecision, reason: str
    ) -> None:
        self.announce()
        answer = "cancelled" if isinstance(decision, PermissionOutcome) else decision.option_id
        logger.info("permission for tool call %r: %s (%s)", question.tool_call_id, answer, reason)
        denied = isinstance(decision, PermissionOutcome) or decision.kind in ("reject_once", "reject_always")
        self.last_denial = _Denial(call, reason) if denied else None
        self.inner.decided(question, call, decision, reason)

    def interrupted(self, signal_name: str, count: int, action: str) -> None:
        self.inner.interrupted(signal_name, count, action)

    def elicitation(self, question: ElicitationQuestion, timeout: float) -> None:
        self.announce()
        self.inner.elicitation(question, timeout)

    def elicitation_field(self, field: ElicitationField, problem: str | None) -> None:
        self.inner.elicitation_field(field, problem)

    def elicited(self, question: ElicitationQuestion, action: str, reason: str) -> None:
        self.announce()
        logger.info("elicitation: %s (%s)", action, reason)
        self.inner.elicited(question, action, reason)

    def interrupted_runs(self, runs: Sequence[RunRecord], resume: str) -> None:
        self.inner.interrupted_runs(runs, resume)

    def start_failed(self, message: str) -> None:
        self.inner.start_failed(message)

    def ended(self, result: SubagentResult, elapsed: float) -> None:
        self.announce()
        logger.info("turn ended: %s in %.2f s", result.stop_reason, elapsed)
        self.inner.ended(result, elapsed)

    def log(self, record: logging.LogRecord, message: str) -> None:
        self.inner.log(record, message)


async def drive(spec: TurnSpec, view: RunView, journal: RunJournal | None = None) -> TurnOutcome:
    """Run the turn through the service (recording it in ``journal``, when given); never raises for a
    child-level failure or an interrupt."""
    gate = _StartGate(view)
    tool_calls = ToolCalls()
    try:
        provider = AcpProvider(
            spec.command,
            name=spec.resume.provider if spec.resume is not None else "acp",
            env=spec.env,
            cwd=spec.cwd,
            permission=permission_policy(
                spec.permission, gate, tool_calls, spec.answers, timeout=spec.permission_timeout
            ),
            auth_method=spec.auth_method,
            fs=spec.fs,
            subagents=spec.subagents,
            transport=spec.transport,
            mode=spec.mode,
            config_options=spec.config_options,
            ready_timeout=spec.ready_timeout if spec.ready_timeout is not None else DEFAULT_READY_TIMEOUT,
            reports_usage=spec.reports_usage,
            isolation=spec.isolation_settings if spec.isolation is not None else None,
        )
    except (ValueError, TypeError) as exc:
        # A command or environment no process could receive (a NUL in an argument, say).
        raise UsageError(str(exc)) from None
    _check_caps(provider, spec)
    _check_isolation(provider, spec)
    request = SubagentRequest(
        prompt=spec.prompt,
        cwd=spec.cwd,
        timeout=spec.timeout,
        additional_directories=spec.additional_directories,
        budget=spec.budget,
        isolation=spec.isolation,
        cleanup=spec.cleanup,
        metadata=spec.metadata,
    )
    # A resumed run's request is the journaled one: the command line's caps hold over it from above.
    ceiling = BudgetAccount(spec.budget, prices=spec.prices) if spec.resume and spec.budget else None
    began = time.monotonic()
    run_costs: dict[str, Usage] = {}
    runs: dict[str, dict[str, Any]] = {}
    async with anyio.create_task_group() as outer:
        interrupts = Interrupts(gate, outer)
        # The receiver stays open until the service has torn the agent down, so a Ctrl-C during
        # teardown is handled too, never raised as KeyboardInterrupt in the middle of it.
        await outer.start(interrupts.watch)
        # Keeps a live view's clock-driven parts current (the run block's ages); cancelled with the
        # task group below, before the gate reports the end.
        outer.start_soon(view.tick)
        try:
            async with SubagentService(prices=spec.prices, journal=journal) as service:
                service.register_provider(provider)
                _report_interrupted(service.interrupted, spec, gate)
                if spec.resume is None:
                    gate.spawning(spec.command, spec.cwd)
                    run = service.start(provider.name, request)
                else:
                    try:
                        run = await service.resume(
                            spec.resume.id, spec.resume.prompt, within=ceiling, timeout=spec.timeout
                        )
                    except SubagentError as exc:
                        return TurnOutcome(
                            SubagentResult(output="", stop_reason="error", error=exc.message),
                            refused=exc.message,
                        )
                    gate.spawning(spec.command, spec.cwd)
                acp_run = run.provider_run
                assert isinstance(acp_run, AcpRun)
                announced = False

                def announce() -> None:
                    nonlocal announced
                    if not announced and acp_run.session_id is not None:
                        announced = True
                        gate.started(_start_info(acp_run, spec, run.journal_id))

                gate.announce = announce

                def on_update(update: schema.SessionUpdate) -> None:
                    _note_run(run_costs, runs, update)
                    gate.update(update, tool_calls.observe(update))

                acp_run.on_update(on_update)

                # A child's calls name its questions as the agent's own calls name the agent's.
                def on_subagent_update(child: SubagentSession, update: schema.SessionUpdate) -> None:
                    tool_calls.observe(update, child.session_id)
                    gate.subagent_update(child.session_id, update)

                acp_run.on_subagent_update(on_subagent_update)
                interrupts.attach(run)
                async with run:
                    outcome = await _await_turn(run, acp_run, spec, gate, interrupts, announce)
                # Disposed: the workspace was cleaned up by its policy, and says what is left of it.
                outcome.result.workspace = await _final_workspace(acp_run, outcome.result.workspace, spec)
                outcome.journal_id = run.journal_id
                outcome.resumable = _resumable(acp_run, outcome, spec)
        finally:
            outer.cancel_scope.cancel()
            if ceiling is not None:
                ceiling.close()
    outcome.elapsed = time.monotonic() - began
    outcome.run_costs = run_costs
    outcome.runs = runs
    denial = gate.last_denial
    if outcome.result.stop_reason == "cancelled" and denial is not None and not interrupts.count:
        # Nobody pressed Ctrl-C: the agent ended its own turn on our denial (Codex, for one,
        # offers only a reject option that aborts the turn). Say so, and how to allow it.
        why = _denial_explanation(denial, spec.permission)
        error = outcome.result.error
        outcome.result = dataclasses.replace(outcome.result, error=f"{error}; {why}" if error else why)
    if outcome.start_error is None:
        gate.ended(outcome.result, outcome.elapsed)
    return outcome


def _report_interrupted(found: Sequence[RunRecord], spec: TurnSpec, view: RunView) -> None:
    """Say which runs the journal's opening found interrupted, but the one this turn resumes."""
    others = [record for record in found if spec.resume is None or record.id != spec.resume.id]
    if others and spec.journal is not None:
        view.interrupted_runs(others, spec.journal.resume_command("ID"))


def _resumable(acp_run: AcpRun, outcome: TurnOutcome, spec: TurnSpec) -> bool:
    """Whether ``subagent resume`` can continue the turn: journaled, begun, not completed, in no
    workspace of its own (closed with it), with an agent that reopens sessions."""
    if outcome.journal_id is None or outcome.start_error is not None or spec.isolation is not None:
        return False
    if outcome.result.stop_reason == "completed":
        return False
    agent = acp_run.agent
    if agent is None or acp_run.session_id is None:
        return False
    capabilities = agent.agent_capabilities
    return capabilities.load_session or capabilities.session_capabilities.resume is not None


def _check_caps(provider: AcpProvider, spec: TurnSpec) -> None:
    """Refuse, before any agent is spawned, a cap the agent cannot be held to: it does not report what
    the cap counts (the service would refuse the run the same way)."""
    budget = spec.budget
    if budget is None:
        return
    unenforced = [cap for cap in budget.fields() if not provider.capabilities.supports(cap)]
    if not unenforced:
        return
    flags = ", ".join("--" + cap.replace("_", "-") for cap in unenforced)
    enforced = (
        ", ".join("--" + cap.replace("_", "-") for cap in sorted(provider.capabilities.budget)) or "none"
    )
    raise UsageError(
        f"{flags}: the agent cannot be held to {'it' if len(unenforced) == 1 else 'them'}: it does not "
        f"report what {'it counts' if len(unenforced) == 1 else 'they count'} as it works (the caps it can "
        f"be held to: {enforced}). If it does report its usage, say what with --reports-usage tokens,cost"
    )


def _check_isolation(provider: AcpProvider, spec: TurnSpec) -> None:
    """Refuse, before any agent is spawned, an isolation the provider cannot give, or a worktree of a
    directory that is in no git repository with a commit (the provider would fail the start)."""
    if spec.isolation is None:
        return
    offered = provider.capabilities.isolation
    if spec.isolation not in offered:
        if spec.transport is not None and not spec.transport.local_files:
            raise UsageError(
                f"--isolation {spec.isolation}: an agent on {spec.transport.name} cannot be isolated: its "
                "transport makes no workspace where the agent runs, and this host's files are not there"
            )
        can = ", ".join(sorted(offered)) or "none"
        raise UsageError(
            f"--isolation {spec.isolation}: the agent cannot be given one (it can be given: {can})"
        )
    if spec.isolation != "worktree" or (spec.transport is not None and not spec.transport.local_files):
        return
    top = _git(spec.cwd, "rev-parse", "--show-toplevel")
    if not top:
        raise UsageError(
            f"--isolation worktree: {spec.cwd} is not in a git repository, so it has no worktree to give "
            "the agent (--isolation copy gives it a copy of the directory)"
        )
    if not _git(spec.cwd, "rev-parse", "--verify", "--quiet", "HEAD^{commit}"):
        raise UsageError(
            f"--isolation worktree: the repository at {top} has no commit yet: a worktree needs one to "
            "start from"
        )


def _git(cwd: str, *args: str) -> str:
    """``git -C cwd args...``'s output as the workspace layer runs it; empty when it fails (or git cannot
    be run)."""
    try:
        return isolation_core.git(cwd, *args, check=False)
    except IsolationError:
        return ""


async def _final_workspace(
    acp_run: AcpRun, change: WorkspaceChange | None, spec: TurnSpec
) -> WorkspaceChange | None:
    """The run's workspace as its cleanup left it (``removed`` said), once the run is disposed."""
    workspace = getattr(acp_run, "workspace", None)
    if isinstance(workspace, Workspace):
        final = await workspace.close()  # idempotent: what the disposal's close returned
        if final is not None:
            return final
    if change is None or (spec.transport is not None and not spec.transport.local_files):
        return change
    gone = not await anyio.to_thread.run_sync(os.path.isdir, change.path)
    return dataclasses.replace(change, removed=gone)


_MAX_TITLE_CHARS: Final = 200
"""The longest tool-call title a denial's explanation quotes."""


def _denial_explanation(denial: _Denial, permission: str) -> str:
    title = one_line(sanitize(denial.call.title or denial.call.tool_call_id), _MAX_TITLE_CHARS)
    how = (
        "answer yes when asked, or use --permission allow to allow every request"
        if permission == "ask"
        else "use --permission allow to allow every request, or --permission ask to decide each one"
    )
    return (
        f"the agent ended its turn after its permission request for {title!r} was denied "
        f"({denial.reason}); to allow it, {how}"
    )


async def _await_turn(
    run: ServiceRun,
    acp_run: AcpRun,
    spec: TurnSpec,
    view: RunView,
    interrupts: Interrupts,
    announce: Callable[[], None],
) -> TurnOutcome:
    try:
        await run.started()
    except SubagentError as exc:
        if interrupts.count:
            return TurnOutcome(_interrupted_result(acp_run, "interrupted before the agent was ready"))
        message = _start_failure(exc, acp_run, spec)
        view.start_failed(message)
        # A reopened agent that turned out unable to reopen its session: the run cannot be resumed.
        refused = (
            f"run {run.journal_id} cannot be resumed: {message}"
            if exc.code is ErrorCode.RESUME_UNSUPPORTED
            else None
        )
        return TurnOutcome(
            SubagentResult(output="", stop_reason="error", error=message),
            start_error=message,
            refused=refused,
        )
    announce()
    try:
        result = await run.result()
    except SubagentError as exc:
        if interrupts.stopped_by is not None:
            return TurnOutcome(_torn_down_result(acp_run, interrupts.stopped_by))
        logger.debug("the run's result failed", exc_info=True)
        return TurnOutcome(SubagentResult(output=acp_run.output, stop_reason="error", error=exc.message))
    if interrupts.stopped_by is not None and result.stop_reason == "error":
        # Torn down at once while the turn ran: the child's death is our doing, not its failure.
        return TurnOutcome(_torn_down_result(acp_run, interrupts.stopped_by))
    return TurnOutcome(result)


def _torn_down_result(acp_run: AcpRun, stopped_by: str) -> SubagentResult:
    return _interrupted_result(acp_run, f"the agent was torn down at once on {stopped_by}")


def _interrupted_result(acp_run: AcpRun, why: str) -> SubagentResult:
    return SubagentResult(output=acp_run.output, stop_reason="cancelled", error=why)


def _start_info(acp_run: AcpRun, spec: TurnSpec, journal_id: str | None) -> StartInfo:
    agent = acp_run.agent
    info = agent.agent_info if agent is not None else None
    return StartInfo(
        run_id=acp_run.id,
        session_id=acp_run.session_id,
        command=spec.command,
        cwd=spec.cwd,
        agent_name=(info.title or info.name) if info is not None else None,
        agent_version=info.version if info is not None else None,
        protocol_version=agent.protocol_version if agent is not None else None,
        mode=acp_run.current_mode,
        config_options=[schema.to_builtins(option) for option in acp_run.config_options],
        journal_id=journal_id,
    )


def _start_failure(exc: SubagentError, acp_run: AcpRun, spec: TurnSpec) -> str:
    message = exc.message
    agent = acp_run.agent
    if (
        acp_run.authentication_failed
        and spec.auth_method is None
        and agent is not None
        and agent.auth_methods
    ):
        ids = [_auth_method_id(method) for method in agent.auth_methods]
        offered = ", ".join(repr(method_id) for method_id in ids if method_id)
        message += f" (to authenticate with one of {offered}: --auth-method ID, or auth_method in the config)"
    return message


def _auth_method_id(method: schema.AuthMethod) -> str | None:
    if isinstance(method, schema.UnknownAuthMethod):
        value = method.raw.get("id")
        return value if isinstance(value, str) else None
    return method.id
