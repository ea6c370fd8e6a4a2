"""The registry service: named providers, start-time checks, lifecycle events, ownership of runs.

How a run is watched: as soon as a provider hands back a run, the service starts an observer task
in its own task group. The observer awaits the provider run's readiness and, at the same time, its
result, so a failing result is always observed (never an unobserved exception). It emits
``subagent/start`` once readiness succeeded, and ``subagent/end`` once the result settled *and* the
start was emitted: a result that settles before readiness is buffered until then. A run whose
readiness fails emits neither. The caller's ``started()`` and ``result()`` return only after the
observer has emitted the matching event, so listeners always see a run before its caller does.

Progress: for a provider run that is an :class:`~subagent.types.ObservableRun`, the observer also
runs a heartbeat in its own task group, started right after ``subagent/start`` and stopped right
before ``subagent/end``: every ``progress_interval`` seconds it emits ``subagent/progress`` with the
child's idle time and whether it waits on a permission answer. Owned by the observer, it can neither
fire outside that window nor outlive the run.

Ownership: leaving ``async with service.start(...)`` disposes the run, whatever the exit path;
closing the service disposes every run still live, then ends its task group.

Tracing (:mod:`subagent.observability`, when a tracer provider is configured): each run is an
``invoke_agent`` span from ``start()`` to its end (the result settled, or the disposal). Its parent
is passed explicitly: the parent run's span when ``parent_id`` is a run of this service, else the
span current where ``start()`` is called. The span is current while the provider starts the run,
so what the provider starts from there (an in-process child's turn, an ACP child's handshake)
inherits it; each ``resume()`` is an ``invoke_agent`` span of its own below the run's.
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import enum
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, cast

import anyio

from subagent._budget_codec import spend_from_json, spend_to_json
from subagent._journaling import (
    DEFAULT_RESUME_PROMPT,
    provider_secrets,
    request_from_json,
    request_to_json,
    usage_json,
)
from subagent._outcome import DisposeOnExit, Outcome, raise_sole_error
from subagent.budget import WHOLE_NUMBER_CAPS, BudgetAccount, PriceTable, budget_result
from subagent.events import EventHub
from subagent.journal import JournalError, JournalState, RunJournal, RunRecord
from subagent.observability import _telemetry as telemetry
from subagent.types import (
    Budget,
    CheckpointedRun,
    Disposer,
    ErrorCode,
    Lineage,
    ObservableRun,
    ProviderSnapshot,
    QueueableRun,
    ReopenableProvider,
    ResumableRun,
    ResumePoint,
    SteerableRun,
    SubagentCapabilities,
    SubagentError,
    SubagentProgressInfo,
    SubagentProvider,
    SubagentRequest,
    SubagentResult,
    SubagentRun,
    SubagentRunEndInfo,
    SubagentRunInfo,
    Usage,
    sum_usage,
)

if TYPE_CHECKING:
    from anyio import CapacityLimiter
    from anyio.abc import TaskGroup
    from opentelemetry.trace import Span

    from subagent.journal import _Write

__all__ = ["DEFAULT_PROGRESS_INTERVAL", "ENDED_RUNS_KEPT", "RunState", "ServiceRun", "SubagentService"]

logger = logging.getLogger(__name__)

OBSERVER_SETTLE_TIMEOUT: float = 5.0
"""How long a disposed run's readiness and result may take to settle after the provider's
``dispose()`` returned. A provider that keeps its contract settles both before returning; this
bound only keeps a faulty provider from hanging the caller (its observer is then cancelled)."""

ENDED_RUNS_KEPT = 10_000
"""Ended runs whose usage :meth:`SubagentService.subtree_usage` can still count: a long-lived service
keeps a bounded record (about 1 MiB), the most recent ones."""

JOURNAL_COMMIT_TIMEOUT: float = 30.0
"""How long a run's end waits for the journal to commit it before its caller gets the result anyway
(a journal on a stalled disk must not hold every result back forever; the wait is logged)."""

DEFAULT_PROGRESS_INTERVAL: float = 10.0
"""Seconds between ``subagent/progress`` heartbeats: often enough that a person never stares at a
silent child for long, rare enough to cost nothing with a hundred runs."""


class RunState(enum.Enum):
    """Where a run is in its life, as the service has observed it."""

    QUEUED = "queued"
    """The provider holds the run back until a concurrency slot frees: no child exists yet."""
    STARTING = "starting"
    """The child is not ready yet."""
    RUNNING = "running"
    """The child is ready; its result has not settled."""
    ENDED = "ended"
    """The result settled (whatever the stop reason)."""
    FAILED = "failed"
    """Readiness failed: the child never became ready."""
    DISPOSED = "disposed"
    """``dispose()`` has returned; nothing of the run is left running."""


def _snapshot(provider: SubagentProvider) -> ProviderSnapshot:
    name: object = provider.name
    if not isinstance(name, str) or not name:
        raise TypeError(f"a provider's name must be a non-empty str, got {name!r}")
    declared = provider.capabilities
    # Copy into our own frozen record: the provider's capabilities object may be mutable.
    capabilities = SubagentCapabilities(
        output_schema=bool(declared.output_schema),
        depth_limit=bool(declared.depth_limit),
        tool_filter=bool(declared.tool_filter),
        # Read with a default: a provider's own capabilities record may predate this feature.
        additional_directories=bool(getattr(declared, "additional_directories", False)),
        budget=frozenset(getattr(declared, "budget", ())),
        isolation=frozenset(getattr(declared, "isolation", ())),
    )
    return ProviderSnapshot(
        name=name,
        capabilities=capabilities,
        inherits_parent_context=bool(provider.inherits_parent_context),
        start=provider.start,  # bound now, to this object: later reassignment changes nothing
    )


@dataclass(eq=False, slots=True)
class _Registration:
    snapshot: ProviderSnapshot


class SubagentService:
    """A registry of named providers that starts, watches and owns child runs.

    Use it as an async context manager: it owns a task group, and closing it disposes every run
    still live. Providers may be registered before or after it is opened.

    Args:
        progress_interval: seconds between ``subagent/progress`` heartbeats of each started run
            whose provider run is an :class:`~subagent.types.ObservableRun`; None emits none.
        prices: a :class:`~subagent.budget.PriceTable` for ``max_cost`` caps over children whose
            agent reports tokens but no cost.
        journal: a run journal (:mod:`subagent.journal`): a path, opened (created when absent) when the
            service opens and closed with it, or a :class:`~subagent.journal.RunJournal` the caller owns.
            Every run is recorded in it, runs whose owner died are marked ``interrupted`` when the
            service opens (each reported once, as ``subagent/interrupted``), and :meth:`resume`
            continues a journaled run. None (default): nothing is recorded and nothing outlives the
            service.
    """

    def __init__(
        self,
        *,
        progress_interval: float | None = DEFAULT_PROGRESS_INTERVAL,
        prices: PriceTable | None = None,
        journal: str | os.PathLike[str] | RunJournal | None = None,
    ) -> None:
        if progress_interval is not None and not progress_interval > 0:
            raise ValueError(f"progress_interval must be > 0 seconds or None, got {progress_interval}")
        self.progress_interval = progress_interval
        """Seconds between ``subagent/progress`` heartbeats (None: none); read when a run starts."""
        self.events = EventHub()
        """Lifecycle events: ``subagent/provider-added``, ``subagent/provider-removed``,
        ``subagent/start``, ``subagent/progress``, ``subagent/end``."""
        self._registrations: dict[str, _Registration] = {}
        self._runs: dict[ServiceRun, None] = {}  # live runs, in start order
        self._runs_by_id: dict[str, ServiceRun] = {}  # the same runs, to find a request's parent
        # Ended runs' parent and usage, most recent last, for subtree_usage (bounded: ENDED_RUNS_KEPT).
        self._ended: collections.OrderedDict[str, tuple[str | None, Usage | None]] = collections.OrderedDict()
        self._task_group: TaskGroup | None = None
        self._closing = False
        self._journal_spec = journal
        self.journal: RunJournal | None = None
        """The run journal, once the service is open (None: it keeps none)."""
        self.interrupted: tuple[RunRecord, ...] = ()
        """The runs this service found ``interrupted`` when it opened (their owner had died), as it
        marked them: each is reported by exactly one service, as ``subagent/interrupted``."""
        self._journal_waits: CapacityLimiter | None = None
        self._owns_journal = False
        self._taken: set[str] = set()  # interrupted runs handed to a parent (take_interrupted)
        self.prices = prices
        """The price table that turns reported tokens into cost for ``max_cost`` caps, where a child's
        agent reports no cost of its own (None: only reported costs count)."""

    # -- the registry ------------------------------------------------------------------------

    def register_provider(self, provider: SubagentProvider) -> Disposer:
        """Register a snapshot of ``provider`` under its name and return the disposer.

        Raises:
            SubagentError: ``DUPLICATE_PROVIDER`` when the name is taken; the first stays.
        """
        snapshot = _snapshot(provider)
        if snapshot.name in self._registrations:
            raise SubagentError(
                ErrorCode.DUPLICATE_PROVIDER,
                f"a provider named {snapshot.name!r} is already registered",
                provider=snapshot.name,
            )
        registration = _Registration(snapshot)
        self._registrations[snapshot.name] = registration
        if self.journal is not None:
            self.journal.add_secrets(provider_secrets(provider))
        self.events.emit("subagent/provider-added", snapshot)

        def dispose() -> None:
            # Identity, not name: a later registration under the same name is not ours to remove.
            if self._registrations.get(snapshot.name) is registration:
                del self._registrations[snapshot.name]
                self.events.emit("subagent/provider-removed", snapshot.name)

        return dispose

    def get_provider(self, name: str) -> ProviderSnapshot | None:
        """The snapshot registered under ``name``, or None."""
        registration = self._registrations.get(name)
        return None if registration is None else registration.snapshot

    def list(self) -> list[str]:
        """The registered provider names, in registration order."""
        return list(self._registrations)

    @property
    def live_runs(self) -> tuple[ServiceRun, ...]:
        """Runs started and not yet disposed, in start order."""
        return tuple(self._runs)

    # -- runs ----------------------------------------------------------------------------------

    def start(
        self, name: str, request: SubagentRequest, *, within: BudgetAccount | None = None
    ) -> ServiceRun:
        """Start a run on provider ``name``. Synchronous up to the child's creation.

        Every check happens before the provider is called: nothing requested is accepted and then
        ignored. Await ``run.started()`` for readiness and ``run.result()`` for the outcome, or use
        the run as an async context manager so that it is disposed on every exit path.

        Budgets: the run gets an account in its tree's ledger (``request.account``), below its parent
        run's, or below ``within`` (a host's ceiling for everything delegated below a root) when its
        parent is not a run of this service. Its caps are the request's ``budget`` narrowed to what
        every account above it has left; a cap set above it must be enforceable by the provider too.

        Raises:
            SubagentError: ``NO_PROVIDER`` for an unknown name; ``UNSUPPORTED_CAPABILITY`` naming
                the first requested start-time feature the provider lacks; ``DISPOSED`` when the
                service is closing or closed; ``START_FAILED`` when the provider's ``start`` raised.
            RuntimeError: the service was never opened with ``async with``.
        """
        task_group = self._require_open()
        snapshot = self._checked(name, request)
        return self._launch(snapshot, request, within, lambda request: snapshot.start(request, task_group))

    def _checked(self, name: str, request: SubagentRequest) -> ProviderSnapshot:
        """The provider registered as ``name``, once it offers every start-time feature ``request`` asks."""
        registration = self._registrations.get(name)
        if registration is None:
            known = ", ".join(repr(known) for known in self._registrations) or "none"
            raise SubagentError(
                ErrorCode.NO_PROVIDER, f"no provider named {name!r} (registered: {known})", provider=name
            )
        snapshot = registration.snapshot
        for feature in request.requested_features():
            if not snapshot.capabilities.supports(feature):
                raise SubagentError(
                    ErrorCode.UNSUPPORTED_CAPABILITY,
                    f"provider {name!r} does not support {feature!r}",
                    provider=name,
                    feature=feature,
                )
        if request.isolation is not None and request.isolation not in snapshot.capabilities.isolation:
            offered = ", ".join(sorted(snapshot.capabilities.isolation))
            raise SubagentError(
                ErrorCode.UNSUPPORTED_CAPABILITY,
                f"provider {name!r} cannot give a child isolation={request.isolation!r} "
                f"(it offers: {offered})",
                provider=name,
                feature="isolation",
            )
        return snapshot

    def _launch(
        self,
        snapshot: ProviderSnapshot,
        request: SubagentRequest,
        within: BudgetAccount | None,
        begin: Callable[[SubagentRequest], SubagentRun],
        *,
        resumed: RunRecord | None = None,
    ) -> ServiceRun:
        """Place the run in its tree (lineage, budget), have ``begin`` make the provider's run, watch it."""
        task_group = self._require_open()
        name = snapshot.name
        lineage = self._lineage(snapshot, request)
        account = self._account(snapshot, request, within)
        journal_id: str | None = None
        if self.journal is not None:
            journal_id = resumed.id if resumed is not None else self.journal.new_id()
        request = dataclasses.replace(
            request,
            lineage=lineage,
            account=account,
            on_checkpoint=None if journal_id is None else self._checkpoint_keeper(journal_id),
        )
        span = self._run_span(snapshot, request)
        try:
            # Current while the provider starts the run: what it starts inherits the span.
            with telemetry.current(span):
                provider_run = begin(request)
        except BaseException as exc:
            if account is not None:
                account.close()
            if isinstance(exc, SubagentError):
                telemetry.end_agent_span(span, exc)
                raise
            if not isinstance(exc, Exception):
                raise
            error = SubagentError(
                ErrorCode.START_FAILED, f"provider {name!r} failed to start a run: {exc}", provider=name
            )
            telemetry.end_agent_span(span, error)
            raise error from exc
        if account is not None:
            account.owner = provider_run.id
        run = _managed_run_class(provider_run)(self, snapshot.name, provider_run, request)
        if span is not None:
            run._span = span
            span.set_attribute("gen_ai.agent.id", run.id)
        self._runs[run] = None
        self._runs_by_id.setdefault(run.id, run)
        if journal_id is not None:
            self._journal_start(run, snapshot, resumed, journal_id)
        task_group.start_soon(run._observe, name=f"subagent observer {run.id}")
        return run

    # -- the run journal -----------------------------------------------------------------------

    def _checkpoint_keeper(self, journal_id: str) -> Callable[[Mapping[str, Any]], Awaitable[None]]:
        """What a provider awaits to have run ``journal_id``'s checkpoint kept (``request.on_checkpoint``)."""

        async def keep(checkpoint: Mapping[str, Any]) -> None:
            if self.journal is not None:
                await self._committed(self.journal.record_checkpoint(journal_id, checkpoint))

        return keep

    def _journal_start(
        self, run: ServiceRun, snapshot: ProviderSnapshot, resumed: RunRecord | None, journal_id: str
    ) -> None:
        journal = self.journal
        assert journal is not None
        if resumed is not None:
            run.journal_id = resumed.id
            explicit = run.request.metadata.get(_RESUME_PROMPT_KEY) is None
            run._journal_write = journal.record_resumed(
                resumed.id, run.id, run.request.prompt if explicit else None
            )
            return
        provider = getattr(snapshot.start, "__self__", None)
        agent = None
        if isinstance(provider, ReopenableProvider):
            try:
                agent = dict(provider.describe_agent())
            except Exception:
                logger.exception(
                    "provider %r: describe_agent() raised; the journal keeps no agent", snapshot.name
                )
        parent = self._runs_by_id.get(run.request.parent_id) if run.request.parent_id is not None else None
        run.journal_id = journal_id
        run._journal_write = journal.record_start(
            run.journal_id,
            run_id=run.id,
            provider=snapshot.name,
            parent=parent.journal_id if parent is not None else None,
            parent_id=run.request.parent_id,
            prompt=run.request.prompt,
            request=request_to_json(run.request),
            agent=agent,
        )

    async def _committed(self, write: _Write | None) -> None:
        """Wait (bounded) until ``write`` is committed; a failed write was logged by the journal."""
        if write is None:
            return
        if not await write.committed(JOURNAL_COMMIT_TIMEOUT, self._journal_waits):
            logger.error(
                "run journal %s: a write was not committed within %.0f s; going on without waiting",
                self.journal.path if self.journal is not None else "?",
                JOURNAL_COMMIT_TIMEOUT,
            )

    async def runs(
        self,
        *,
        states: Iterable[str] | None = None,
        provider: str | None = None,
        parent: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = 50,
    ) -> builtins.list[RunRecord]:
        """The journal's runs, newest first, filtered (see :meth:`~subagent.journal.RunJournal.runs`).

        Raises:
            SubagentError: ``NO_RUN`` when the service keeps no journal.
        """
        journal = self._require_journal()
        states = None if states is None else tuple(states)
        return await anyio.to_thread.run_sync(
            lambda: journal.runs(
                states=states, provider=provider, parent=parent, since=since, until=until, limit=limit
            )
        )

    async def run_record(self, run_id: str) -> RunRecord | None:
        """Journaled run ``run_id`` (its journal id, or a unique prefix of it) with its checkpoint and
        state changes; None when the journal has none.

        Raises:
            SubagentError: ``NO_RUN`` when the service keeps no journal, or the prefix is ambiguous.
        """
        journal = self._require_journal()
        try:
            return await anyio.to_thread.run_sync(journal.get, run_id)
        except JournalError as exc:
            raise SubagentError(ErrorCode.NO_RUN, str(exc)) from exc

    async def children_of(self, run_id: str) -> builtins.list[RunRecord]:
        """The journaled runs whose parent is run ``run_id`` (a journal id), oldest first."""
        journal = self._require_journal()
        return await anyio.to_thread.run_sync(journal.children, run_id)

    def _require_journal(self) -> RunJournal:
        if self.journal is None:
            raise SubagentError(
                ErrorCode.NO_RUN,
                "this service keeps no run journal: open it with SubagentService(journal=...)",
            )
        return self.journal

    def take_interrupted(self, parent_id: str) -> builtins.list[RunRecord]:
        """The runs this service found interrupted when it opened (:attr:`interrupted`) whose request's
        ``parent_id`` is ``parent_id``, each handed out once: for a parent that outlived its process (a
        served session, a host's own name) to be told of the children it lost."""
        taken = [
            record
            for record in self.interrupted
            if record.parent_id == parent_id and record.id not in self._taken
        ]
        self._taken.update(record.id for record in taken)
        return taken

    async def sweep(self) -> tuple[RunRecord, ...]:
        """Mark ``interrupted`` the journal's live runs whose owner process is gone, emit
        ``subagent/interrupted`` for each, and return them (a service sweeps once when it opens; a
        long-lived one may call this to notice other processes' deaths since)."""
        journal = self._require_journal()
        marked = tuple(await anyio.to_thread.run_sync(journal.mark_interrupted))
        for record in marked:
            self.events.emit("subagent/interrupted", record)
        return marked

    async def resume(
        self,
        run_id: str,
        prompt: str | None = None,
        *,
        within: BudgetAccount | None = None,
        timeout: float | None = None,
    ) -> ServiceRun:
        """Continue journaled run ``run_id`` (its journal id, :attr:`ServiceRun.journal_id`) in a new child,
        with ``prompt`` as its next turn, and return the run (the same journal id; a new provider run id).

        The provider registered under the run's provider name reopens it (a
        :class:`~subagent.types.ReopenableProvider`): an ACP child's session is reopened in a new agent
        process (``session/resume``, else ``session/load``); an in-process child continues from its log
        as of its last completed turn. A completed turn is never run again. ``prompt`` None: when the
        run's last turn did not complete, :data:`~subagent._journaling.DEFAULT_RESUME_PROMPT` naming
        what was interrupted; a run whose last turn completed needs a prompt.

        ``within``: a host's budget ceiling, as for :meth:`start`; ``timeout``: the resumed turns' inactivity
        timeout, in place of the journaled request's.

        Raises:
            SubagentError: ``NO_RUN`` when the journal has no such run (or the service keeps none);
                ``RESUME_UNSUPPORTED`` saying why it cannot be resumed (still live, its provider is
                not registered or cannot reopen runs, it never reached a checkpoint, ...); what
                :meth:`start` raises for the request.
        """
        self._require_open()
        journal = self._require_journal()
        record = await self.run_record(run_id)
        if record is None:
            raise SubagentError(
                ErrorCode.NO_RUN, f"no run {run_id!r} in the run journal {str(journal.path)!r}"
            )
        if record.live:
            await self.sweep()  # its owner may have died since this service opened
            record = await self.run_record(record.id)
            assert record is not None
        for live in self._runs:
            if live.journal_id == record.id:
                raise self._cannot_resume(
                    record, "it is open in this service: call resume() on its run instead"
                )
        if record.live:
            raise self._cannot_resume(
                record, f"it is still {record.state} in process {record.owner.get('pid')}, which is alive"
            )
        registration = self._registrations.get(record.provider)
        if registration is None:
            raise self._cannot_resume(record, f"no provider named {record.provider!r} is registered")
        snapshot = registration.snapshot
        provider = getattr(snapshot.start, "__self__", None)
        if not isinstance(provider, ReopenableProvider):
            raise self._cannot_resume(record, f"provider {record.provider!r} cannot reopen a run")
        metadata_extra: dict[str, Any] = {}
        if prompt is None:
            if record.state == "ended" and record.stop_reason == "completed":
                raise self._cannot_resume(record, "its last turn completed: give the prompt of its next turn")
            prompt = DEFAULT_RESUME_PROMPT.format(why=_why_stopped(record), prompt=record.turn_prompt)
            metadata_extra[_RESUME_PROMPT_KEY] = True
        try:
            request = request_from_json(record.request, prompt=prompt, parent_id=record.parent_id)
        except (TypeError, ValueError) as exc:
            raise self._cannot_resume(record, f"its journaled request is not readable: {exc}") from exc
        if metadata_extra:
            request = dataclasses.replace(request, metadata={**request.metadata, **metadata_extra})
        if timeout is not None:
            request = dataclasses.replace(request, timeout=timeout)
        if request.budget is not None and record.spent is not None:
            # The caps hold across restarts: the resumed run gets what its earlier children left.
            left, spent_out = _budget_left(request.budget, record.spent)
            if spent_out is not None:
                raise self._cannot_resume(record, f"its budget is spent: {spent_out}")
            request = dataclasses.replace(request, budget=left)
        snapshot = self._checked(record.provider, request)
        point = ResumePoint(
            run_id=record.id,
            checkpoint=record.checkpoint,
            agent=record.agent or {},
            turns_completed=record.turns,
        )
        claim = journal.claim_for_resume(record.id)
        await self._committed(claim)
        if claim.error is not None:
            raise self._cannot_resume(record, f"the journal could not record its resume: {claim.error}")
        if not claim.rowcounts or claim.rowcounts[0] == 0:
            raise self._cannot_resume(record, "another process took it over meanwhile")
        task_group = self._require_open()

        def begin(request: SubagentRequest) -> SubagentRun:
            return provider.reopen(request, point, task_group)

        try:
            run = self._launch(snapshot, request, within, begin, resumed=record)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._committed(
                    journal.release_claim(
                        record.id,
                        record.state,
                        str(exc),
                        stop_reason=record.stop_reason,
                        ended_at=record.ended_at,
                    )
                )
            raise
        if record.state == "interrupted":
            logger.info("run %s (%s) interrupted before is resumed as %s", record.id, record.provider, run.id)
        return run

    def _cannot_resume(self, record: RunRecord, why: str) -> SubagentError:
        return SubagentError(
            ErrorCode.RESUME_UNSUPPORTED,
            f"run {record.id} cannot be resumed: {why}",
            provider=record.provider,
        )

    def _run_span(self, snapshot: ProviderSnapshot, request: SubagentRequest) -> Span | None:
        """The run's ``invoke_agent`` span, begun (None when nothing is recorded)."""
        if not telemetry.enabled():
            return None
        parent = self._runs_by_id.get(request.parent_id) if request.parent_id is not None else None
        attributes = _run_attributes(snapshot.name, request)
        return telemetry.start_span(
            f"invoke_agent {snapshot.name}",
            _span_kind(snapshot),
            attributes,
            parent._span if parent is not None else None,
        )

    def _account(
        self, snapshot: ProviderSnapshot, request: SubagentRequest, within: BudgetAccount | None
    ) -> BudgetAccount | None:
        """The run's budget account, below its parent's; None when nothing above or in it caps anything."""
        parent = self._runs_by_id.get(request.parent_id) if request.parent_id is not None else None
        above = parent.request.account if parent is not None else within
        if request.budget is None and (above is None or not above.capped):
            return None
        if above is not None:
            # An ancestor's caps hold for every descendant: a provider that cannot enforce one cannot
            # promise that, so it is refused rather than trusted (as for an inherited tool filter).
            for account in above.chain():
                for cap in account.asked.fields():
                    if not snapshot.capabilities.supports(cap):
                        raise SubagentError(
                            ErrorCode.UNSUPPORTED_CAPABILITY,
                            f"provider {snapshot.name!r} cannot enforce {cap!r}, and the budget of "
                            f"{account.owner or 'the root'!r} above this run caps it",
                            provider=snapshot.name,
                            feature=cap,
                        )
        return BudgetAccount(request.budget, parent=above, prices=self.prices)

    def _lineage(self, snapshot: ProviderSnapshot, request: SubagentRequest) -> Lineage:
        """Count the child's place in its parent chain; refuse what an ancestor's limits forbid."""
        parent = self._runs_by_id.get(request.parent_id) if request.parent_id is not None else None
        if parent is None:
            # The parent is a root: an agent that is not a run of this service (or none at all).
            root = () if request.parent_id is None else (request.parent_id,)
            parent_lineage = Lineage(depth=0, ancestors=root)
        else:
            assert parent.request.lineage is not None
            parent_lineage = dataclasses.replace(
                parent.request.lineage, ancestors=(parent.id, *parent.request.lineage.ancestors)
            )
        budget = parent_lineage.depth_budget
        if budget == 0:
            raise SubagentError(
                ErrorCode.UNSUPPORTED_CAPABILITY,
                f"depth limit reached: {request.parent_id!r} is at depth {parent_lineage.depth} and its "
                "depth limit allows no subagent below it",
                provider=snapshot.name,
                feature="depth_limit",
            )
        if budget is not None:
            budget -= 1
        if request.depth_limit is not None:
            budget = request.depth_limit if budget is None else min(budget, request.depth_limit)
        inherited = parent_lineage.tool_filter
        tool_filter = (
            inherited.narrowed_by(request.tool_filter) if inherited is not None else request.tool_filter
        )
        if inherited is not None and not snapshot.capabilities.tool_filter:
            # An ancestor's filter must hold for every descendant; a provider that cannot narrow a
            # child's tools cannot promise that, so it is refused rather than trusted.
            raise SubagentError(
                ErrorCode.UNSUPPORTED_CAPABILITY,
                f"provider {snapshot.name!r} cannot narrow a child's tools, and the parent "
                f"{request.parent_id!r} runs under a tool filter its children must inherit",
                provider=snapshot.name,
                feature="tool_filter",
            )
        return Lineage(
            depth=parent_lineage.depth + 1,
            ancestors=parent_lineage.ancestors,
            depth_budget=budget,
            tool_filter=tool_filter,
        )

    def subtree_usage(self, run_id: str) -> Usage | None:
        """The usage of run ``run_id`` and of every run below it (its children, theirs, ...), added up
        with :func:`~subagent.types.sum_usage`: what delegating cost, as far as the children reported
        it. Counts runs that ended (live runs have reported nothing yet) among the last
        ``ENDED_RUNS_KEPT`` ended runs of this service. None when none of them reported usage."""
        children: dict[str, list[str]] = {}
        for ended_id, (parent_id, _usage) in self._ended.items():
            if parent_id is not None:
                children.setdefault(parent_id, []).append(ended_id)
        for run in self._runs:
            if run.request.parent_id is not None:
                children.setdefault(run.request.parent_id, []).append(run.id)
        usages: list[Usage | None] = []
        seen: set[str] = set()
        stack = [run_id]
        while stack:
            current = stack.pop()
            if current in seen:
                continue  # ids reused by another provider could make a cycle: count each once
            seen.add(current)
            ended = self._ended.get(current)
            if ended is not None:
                usages.append(ended[1])
            stack.extend(children.get(current, ()))
        return sum_usage(usages)

    def _record_end(self, run_id: str, parent_id: str | None, usage: Usage | None) -> None:
        self._ended[run_id] = (parent_id, usage)
        self._ended.move_to_end(run_id)
        while len(self._ended) > ENDED_RUNS_KEPT:
            self._ended.popitem(last=False)

    def _require_open(self) -> TaskGroup:
        if self._closing:
            raise SubagentError(ErrorCode.DISPOSED, "the subagent service is closed")
        if self._task_group is None:
            raise RuntimeError("the subagent service is not open: use `async with SubagentService() as ...`")
        return self._task_group

    def _forget(self, run: ServiceRun) -> None:
        self._runs.pop(run, None)
        if self._runs_by_id.get(run.id) is run:
            del self._runs_by_id[run.id]

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._task_group is not None or self._closing:
            raise RuntimeError("a SubagentService can be opened only once")
        if self._journal_spec is not None:
            await self._open_journal(self._journal_spec)
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        return self

    async def _open_journal(self, spec: str | os.PathLike[str] | RunJournal) -> None:
        """Open the journal (off the event loop), then mark and report the runs whose owner died.

        Raises:
            SubagentError: ``START_FAILED`` wrapping the :class:`~subagent.journal.JournalError` (not a
                journal, a newer schema, unwritable).
        """
        if isinstance(spec, RunJournal):
            journal = spec
        else:
            try:
                journal = await anyio.to_thread.run_sync(RunJournal.open, spec)
            except JournalError as exc:
                raise SubagentError(ErrorCode.START_FAILED, str(exc)) from exc
            self._owns_journal = True
        for registration in self._registrations.values():
            journal.add_secrets(provider_secrets(getattr(registration.snapshot.start, "__self__", None)))
        self.journal = journal
        self._journal_waits = anyio.CapacityLimiter(64)
        try:
            self.interrupted = await self.sweep()
        except JournalError as exc:
            logger.error("run journal %s: %s", journal.path, exc)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        task_group = self._task_group
        assert task_group is not None, "__aexit__ without __aenter__"
        self._closing = True
        try:
            # Shielded: a cancelled owner must still leave no child behind.
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as disposers:
                    for run in tuple(self._runs):
                        disposers.start_soon(run.dispose)
        finally:
            # Every run is disposed, so every provider task should have ended; cancel what a
            # faulty provider left behind rather than wait on it forever.
            task_group.cancel_scope.cancel()
        try:
            return await task_group.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # anyio wraps whatever left the block (the caller's own exception, a SubagentError
            # from a run) in an exception group; the caller gets it back as itself.
            raise_sole_error(group, preferred=exc)
            raise
        finally:
            if self.journal is not None and self._owns_journal:
                with anyio.CancelScope(shield=True):
                    # Commits what is queued (the runs' disposals) before closing.
                    await anyio.to_thread.run_sync(self.journal.close)


class ServiceRun(DisposeOnExit):
    """A provider's run as the service hands it out: watched, gated and owned.

    Runtime capabilities pass through: the run is a :class:`~subagent.types.SteerableRun`,
    :class:`~subagent.types.ResumableRun` or :class:`~subagent.types.ObservableRun` exactly when the
    provider's run is. When the provider's run is observable, :meth:`progress` also reports its
    liveness and the service emits it as ``subagent/progress``; when it is a
    :class:`~subagent.types.QueueableRun`, :attr:`state` says :attr:`RunState.QUEUED` while it waits
    for a slot.
    """

    def __init__(
        self, service: SubagentService, provider: str, provider_run: SubagentRun, request: SubagentRequest
    ) -> None:
        self._service = service
        self._provider_run = provider_run
        self.provider = provider
        """The name of the provider that runs this child."""
        self.request = request
        """The request this run was started with."""
        self.info = SubagentRunInfo(
            id=provider_run.id, provider=provider, parent_id=request.parent_id, prompt=request.prompt
        )
        """The payload ``subagent/start`` carries."""
        self._ready: Outcome[None] = Outcome()
        self._start_emitted = False
        self._result: Outcome[SubagentResult] = Outcome()  # the provider's, as it settled
        self._end_info: SubagentRunEndInfo | None = None
        self._result_observed = anyio.Event()  # the result is the caller's: its end was emitted
        self._observer_scope = anyio.CancelScope()
        self._observer_done = anyio.Event()
        self._dispose_started = False
        self._disposed = anyio.Event()
        # Checked once: presence of the properties is the capability, as for the runtime methods.
        kind = _run_kind(provider_run)
        self._observable = cast(ObservableRun, provider_run) if kind.observable else None
        self._queueable = cast(QueueableRun, provider_run) if kind.queueable else None
        self._started_at: float | None = None
        self._created_at = time.monotonic()
        self._progress_scope = anyio.CancelScope()
        self._progress_stopped = False
        self._span: Span | None = None  # the run's invoke_agent span, when recorded
        self._span_ended = False
        self.journal_id: str | None = None
        """The run's id in the service's run journal (None: the service keeps none): what
        :meth:`SubagentService.resume` and ``subagent resume`` take."""
        self._journal_write: _Write | None = None  # the latest write of this run, to wait on

    @property
    def id(self) -> str:
        """The run's id, as its provider assigned it."""
        return self.info.id

    @property
    def provider_run(self) -> SubagentRun:
        """The provider's own run object, for provider-specific detail (narrow with isinstance)."""
        return self._provider_run

    @property
    def state(self) -> RunState:
        """Where the run is in its life."""
        if self._disposed.is_set():
            return RunState.DISPOSED
        if self._ready.error is not None:
            return RunState.FAILED
        if self._result_observed.is_set():
            return RunState.ENDED
        if self._start_emitted:
            return RunState.RUNNING
        if self._queueable is not None and not self._ready.is_set() and self._queueable.queued:
            return RunState.QUEUED
        return RunState.STARTING

    def __repr__(self) -> str:
        return f"<ServiceRun {self.id!r} provider={self.provider!r} {self.state.value}>"

    def progress(self) -> SubagentProgressInfo | None:
        """The child's liveness now, as ``subagent/progress`` carries it.

        None unless the provider's run is an :class:`~subagent.types.ObservableRun` and the run is
        between ``subagent/start`` and ``subagent/end``.
        """
        observable, started_at = self._observable, self._started_at
        if observable is None or started_at is None or self._progress_stopped:
            return None
        now = time.monotonic()
        last_activity = observable.last_activity
        since = started_at if last_activity is None else last_activity
        return SubagentProgressInfo(
            id=self.id,
            provider=self.provider,
            idle_seconds=max(0.0, now - since),
            waiting_on_permission=observable.pending_permissions > 0,
            updates=observable.update_count,
            elapsed_seconds=max(0.0, now - started_at),
        )

    async def started(self) -> None:
        """Return once the child is ready and ``subagent/start`` was emitted.

        Raises:
            SubagentError: ``START_FAILED`` when the child never became ready; ``DISPOSED`` when
                the run was disposed first.
        """
        await self._ready.wait()

    async def result(self) -> SubagentResult:
        """Return how the turn ended, once ``subagent/end`` (if owed) was emitted."""
        await self._result_observed.wait()
        return self._result.get()

    async def cancel(self) -> None:
        """Ask the child to stop; ``result()`` then settles with ``cancelled``. No-op once disposed."""
        if self._dispose_started:
            return
        await self._provider_run.cancel()

    async def dispose(self) -> None:
        """Tear the run down. Idempotent; returns once nothing of the run is left running.

        Shielded from cancellation: a cancelled caller still gets its child torn down.
        """
        if self._dispose_started:
            await self._disposed.wait()
            return
        self._dispose_started = True
        with anyio.CancelScope(shield=True):
            try:
                await self._provider_run.dispose()
            except Exception:
                logger.exception("provider %r: disposing run %r raised", self.provider, self.id)
            finally:
                await self._wait_observer_quiescent()
                if self.request.account is not None:
                    self.request.account.close()
                self._service._forget(self)
                # Ended with the result as a rule; an observer that never ran leaves it to us.
                if self._span is not None:
                    self._end_span(self._disposed_error("before its result settled"))
                self._disposed.set()

    async def _wait_observer_quiescent(self) -> None:
        with anyio.move_on_after(OBSERVER_SETTLE_TIMEOUT):
            await self._observer_done.wait()
            return
        logger.error(
            "provider %r: run %r did not settle within %.1f s of dispose(); its observer is cancelled",
            self.provider,
            self.id,
            OBSERVER_SETTLE_TIMEOUT,
        )
        self._observer_scope.cancel()
        with anyio.move_on_after(OBSERVER_SETTLE_TIMEOUT):
            await self._observer_done.wait()

    def _check_live(self) -> None:
        if self._dispose_started:
            raise SubagentError(ErrorCode.DISPOSED, f"run {self.id!r} is disposed", provider=self.provider)

    # -- the observer, run in the service's task group -----------------------------------------

    async def _observe(self) -> None:
        cancelled = anyio.get_cancelled_exc_class()
        try:
            with self._observer_scope:
                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(self._observe_result)
                    try:
                        await self._provider_run.started()
                    except cancelled:
                        raise
                    except SubagentError as exc:
                        self._journal_failed(exc)
                        self._ready.fail(exc)
                    except Exception as exc:
                        error = SubagentError(
                            ErrorCode.START_FAILED,
                            f"provider {self.provider!r}: run {self.id!r} failed to start: {exc}",
                            provider=self.provider,
                        )
                        error.__cause__ = exc
                        self._journal_failed(error)
                        self._ready.fail(error)
                    else:
                        self._journal_running()
                        # Journaled before anyone is told the child is there: a run seen is a run kept.
                        await self._service._committed(self._journal_write)
                        self._emit_start()
                        interval = self._service.progress_interval
                        if self._observable is not None and interval is not None:
                            task_group.start_soon(
                                self._heartbeat, interval, name=f"subagent progress {self.id}"
                            )
                        self._ready.settle(None)
                    await self._result.wait_settled()
                    # Committed before anyone sees the result: a result a caller got is in the journal.
                    await self._service._committed(self._journal_write)
                    self._emit_end_if_owed()
                    self._result_observed.set()
        finally:
            # Reached early only when cancelled: settle what is left so no waiter hangs.
            if not self._ready.is_set():
                self._ready.fail(self._disposed_error("before it became ready"))
            if not self._result.is_set():
                self._settle(self._disposed_error("before its result settled"))
            self._emit_end_if_owed()
            self._result_observed.set()
            self._observer_done.set()

    async def _observe_result(self) -> None:
        try:
            outcome: SubagentResult | BaseException = await self._provider_run.result()
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            outcome = exc
        self._settle(outcome)

    def _settle(self, outcome: SubagentResult | BaseException) -> None:
        # The end's payload is taken now, before any caller can see (and mutate) the result object.
        elapsed = time.monotonic() - self._created_at
        parent_id = self.request.parent_id
        account = self.request.account
        if isinstance(outcome, SubagentResult):
            # A copy carries the wall time: the provider's own object is left as it made it.
            outcome = dataclasses.replace(outcome, elapsed_seconds=elapsed)
            if account is not None:
                outcome = budget_result(outcome, account)
            if self._result.settle(outcome):
                self._end_info = SubagentRunEndInfo(
                    id=self.id,
                    provider=self.provider,
                    stop_reason=outcome.stop_reason,
                    last_assistant_message=str(outcome.output),
                    error=outcome.error,
                    usage=outcome.usage,
                    elapsed_seconds=elapsed,
                    parent_id=parent_id,
                    limit=outcome.limit,
                    budget=outcome.budget,
                    spent=outcome.spent,
                    workspace=outcome.workspace,
                )
                self._service._record_end(self.id, parent_id, outcome.usage)
                self._journal_turn(outcome)
                self._end_span(outcome)
        elif self._result.fail(outcome):
            self._end_info = SubagentRunEndInfo(
                id=self.id,
                provider=self.provider,
                stop_reason=None,
                last_assistant_message=None,
                error=str(outcome) or type(outcome).__name__,
                elapsed_seconds=elapsed,
                parent_id=parent_id,
            )
            self._service._record_end(self.id, parent_id, None)
            self._journal_turn(outcome)
            self._end_span(outcome)

    # -- what the run journal is told ------------------------------------------------------------

    def _checkpoint(self) -> Mapping[str, Any] | None:
        if not isinstance(self._provider_run, CheckpointedRun):
            return None
        try:
            return self._provider_run.checkpoint()
        except Exception:
            logger.exception("provider %r: run %r's checkpoint() raised", self.provider, self.id)
            return None

    def _spent_json(self) -> dict[str, Any] | None:
        account = self.request.account
        return spend_to_json(account.spent()) if account is not None else None

    def _journal_running(self) -> None:
        journal = self._service.journal
        if journal is None or self.journal_id is None:
            return
        session_id = getattr(self._provider_run, "session_id", None)
        self._journal_write = journal.record_running(
            self.journal_id,
            session_id=session_id if isinstance(session_id, str) else None,
            checkpoint=self._checkpoint(),
        )

    def _journal_failed(self, error: SubagentError) -> None:
        # The child never became ready: nothing of it to continue from, nothing spent on a turn.
        self._journal_end(
            error.message, "disposed" if error.code is ErrorCode.DISPOSED else "failed", kept=False
        )

    def _journal_turn(self, outcome: SubagentResult | BaseException) -> None:
        if isinstance(outcome, SubagentResult):
            self._journal_end(outcome)
        elif self._ready.error is None:  # else recorded as failed already (an ACP run's result fails alike)
            disposed = isinstance(outcome, SubagentError) and outcome.code is ErrorCode.DISPOSED
            self._journal_end(str(outcome) or type(outcome).__name__, "disposed" if disposed else "ended")

    def _journal_end(
        self, outcome: SubagentResult | str, state: JournalState = "ended", *, kept: bool = True
    ) -> _Write | None:
        """Record how a turn ended: its result, or why it has none (``state``); with the run's checkpoint
        and spending unless not ``kept``. The write, to wait on (None: no journal)."""
        journal = self._service.journal
        if journal is None or self.journal_id is None:
            return None
        checkpoint = self._checkpoint() if kept else None
        spent = self._spent_json() if kept else None
        if isinstance(outcome, SubagentResult):
            write = journal.record_turn(
                self.journal_id,
                stop_reason=outcome.stop_reason,
                output=outcome.output,
                structured=outcome.structured,
                error=outcome.error,
                usage=usage_json(outcome.usage),
                checkpoint=checkpoint,
                spent=spent,
            )
        else:
            write = journal.record_turn(
                self.journal_id,
                stop_reason=None,
                output=None,
                structured=None,
                error=outcome,
                usage=None,
                checkpoint=checkpoint,
                state=state,
                spent=spent,
            )
        self._journal_write = write
        return write

    def _end_span(self, outcome: SubagentResult | BaseException) -> None:
        if self._span is not None and not self._span_ended:
            self._span_ended = True
            telemetry.end_agent_span(self._span, outcome)

    def _emit_start(self) -> None:
        self._start_emitted = True
        self._started_at = time.monotonic()
        if self._span is not None:
            # An ACP child's session is its conversation; an in-process child's is the run itself.
            session_id = getattr(self._provider_run, "session_id", None)
            conversation = session_id if isinstance(session_id, str) else self.id
            self._span.set_attribute("gen_ai.conversation.id", conversation)
        self._service.events.emit("subagent/start", self.info)

    async def _heartbeat(self, interval: float) -> None:
        """Emit ``subagent/progress`` every ``interval`` seconds until the end is emitted."""
        with self._progress_scope:
            while True:
                await anyio.sleep(interval)
                # The flag, not only the scope: a sleep that ended just as the end was emitted
                # must not sneak one more heartbeat in after it.
                if self._progress_stopped:
                    return
                try:
                    info = self.progress()
                except Exception:
                    # A provider bug in a liveness property must not take the observer down.
                    logger.exception(
                        "provider %r: reading the liveness of run %r raised", self.provider, self.id
                    )
                    return
                if info is not None:
                    self._service.events.emit("subagent/progress", info)
                    journal = self._service.journal
                    if journal is not None and self.journal_id is not None:
                        progress = _progress_json(info, self._provider_run)
                        if self.request.account is not None:
                            progress["spent"] = spend_to_json(self.request.account.spent())
                        journal.record_progress(self.journal_id, progress)

    def _emit_end_if_owed(self) -> None:
        # Progress stops first: no heartbeat after the end, even when the end is not owed.
        self._progress_stopped = True
        self._progress_scope.cancel()
        end_info, self._end_info = self._end_info, None  # emitted at most once
        if self._start_emitted and end_info is not None:
            self._service.events.emit("subagent/end", end_info)

    def _disposed_error(self, when: str) -> SubagentError:
        return SubagentError.disposed(self.id, when, provider=self.provider)


class _Steerable(ServiceRun):
    async def send_message(self, text: str) -> None:
        """Queue ``text`` for the child; it arrives at the child's next idle point."""
        self._check_live()
        await cast(SteerableRun, self._provider_run).send_message(text)


class _Resumable(ServiceRun):
    async def resume(self, prompt: str) -> SubagentResult:
        """Run another turn in the same child and return how that turn ended."""
        self._check_live()
        span: Span | None = None
        if self._span is not None and telemetry.enabled():
            attributes = _run_attributes(self.provider, dataclasses.replace(self.request, prompt=prompt))
            attributes["gen_ai.agent.id"] = self.id
            snapshot = self._service.get_provider(self.provider)
            kind: telemetry.SpanKind = "client" if snapshot is None else _span_kind(snapshot)
            span = telemetry.start_span(f"invoke_agent {self.provider}", kind, attributes, self._span)
        journal = self._service.journal
        if journal is not None and self.journal_id is not None:
            journal.record_turn_started(self.journal_id, prompt)
        try:
            with telemetry.current(span):
                result = await cast(ResumableRun, self._provider_run).resume(prompt)
        except BaseException as exc:
            telemetry.end_agent_span(span, exc)
            self._journal_end(
                str(exc) or type(exc).__name__, "disposed" if self._dispose_started else "ended"
            )
            raise
        telemetry.end_agent_span(span, result)
        # Committed before the caller sees the turn's result, as the first turn's is.
        await self._service._committed(self._journal_end(result))
        return result


class _Observable(ServiceRun):
    @property
    def last_activity(self) -> float | None:
        """When the child last showed a sign of life (``time.monotonic()``); None before it exists."""
        return cast(ObservableRun, self._provider_run).last_activity

    @property
    def pending_permissions(self) -> int:
        """How many permission questions from the child are waiting for an answer now."""
        return cast(ObservableRun, self._provider_run).pending_permissions

    @property
    def update_count(self) -> int:
        """How many updates the child has sent so far."""
        return cast(ObservableRun, self._provider_run).update_count


_RESUME_PROMPT_KEY = "subagent-seam/defaultResumePrompt"
"""Marks (in a resumed request's metadata) a prompt the service wrote: the journal keeps the
interrupted turn's prompt as the one to continue, not this one."""

_PROGRESS_OUTPUT_CHARS = 2_000


def _progress_json(info: SubagentProgressInfo, provider_run: SubagentRun) -> dict[str, Any]:
    """What the journal keeps of a live run at a heartbeat: enough to say where it was if it dies."""
    value: dict[str, Any] = {
        "updates": info.updates,
        "idleSeconds": round(info.idle_seconds, 3),
        "elapsedSeconds": round(info.elapsed_seconds, 3),
        "waitingOnPermission": info.waiting_on_permission,
    }
    output = getattr(provider_run, "output", None)
    if isinstance(output, str) and output:
        value["output"] = output[-_PROGRESS_OUTPUT_CHARS:]
    return value


def _budget_left(budget: Budget, spent: Mapping[str, Any]) -> tuple[Budget, str | None]:
    """``budget`` less what a journaled run ``spent`` (its JSON form), and the first cap it used up (None)."""
    used = spend_from_json(spent)
    left: dict[str, float] = {}
    for name in budget.fields():
        cap = budget.cap(name)
        assert cap is not None
        remaining = cap - used.of(name)
        if remaining <= 0:
            return budget, f"{name} {cap:g}, of which {used.of(name):g} was used before"
        left[name] = int(remaining) if name in WHOLE_NUMBER_CAPS else remaining
    return Budget(**left), None  # type: ignore[arg-type]


def _why_stopped(record: RunRecord) -> str:
    """How a journaled run's last turn stopped, for the default resume prompt."""
    if record.state == "interrupted":
        return "the process that ran it stopped"
    if record.state == "disposed":
        return "it was shut down before its turn ended"
    if record.state == "failed":
        return "its agent failed to start"
    if record.stop_reason is not None:
        return f"its turn ended with {record.stop_reason}"
    return "its turn did not complete"


def _span_kind(snapshot: ProviderSnapshot) -> telemetry.SpanKind:
    """INTERNAL for a provider whose children run in this process, else CLIENT (the conventions')."""
    # Not imported when unused: then no provider of that module can exist either.
    in_process = sys.modules.get("subagent.providers._inprocess")
    owner = getattr(snapshot.start, "__self__", None)
    if in_process is not None and isinstance(owner, in_process.InProcessProvider):
        return "internal"
    return "client"


def _run_attributes(provider: str, request: SubagentRequest) -> dict[str, Any]:
    """What an ``invoke_agent`` span of a run says about it when it begins."""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": telemetry.PROVIDER_NAME,
        "gen_ai.agent.name": provider,
        "subagent.provider": provider,
        "subagent.parent.id": request.parent_id,
        "subagent.run.depth": request.lineage.depth if request.lineage is not None else None,
    }
    if telemetry.capture_content():
        attributes["gen_ai.input.messages"] = telemetry.messages_json("user", request.prompt)
    return attributes


_wrapper_classes: dict[tuple[bool, bool, bool], type[ServiceRun]] = {}


def _managed_run_class(
    provider_run: SubagentRun,
) -> Callable[[SubagentService, str, SubagentRun, SubagentRequest], ServiceRun]:
    # Presence is the capability, so the wrapper offers exactly what the run offers: one class per
    # combination of the optional protocols, made once.
    kind = _run_kind(provider_run)
    key = (kind.steerable, kind.resumable, kind.observable)
    wrapper = _wrapper_classes.get(key)
    if wrapper is None:
        mixins = [m for m, offered in zip((_Steerable, _Resumable, _Observable), key, strict=True) if offered]
        wrapper = type("ServiceRun", (*mixins, ServiceRun), {}) if mixins else ServiceRun
        wrapper.__qualname__ = "ServiceRun"
        _wrapper_classes[key] = wrapper
    return wrapper


@dataclass(frozen=True, slots=True)
class _RunKind:
    steerable: bool
    resumable: bool
    observable: bool
    queueable: bool


_run_kinds: dict[type, _RunKind] = {}


def _run_kind(provider_run: SubagentRun) -> _RunKind:
    """Which optional protocols a provider's run offers, checked once per run class.

    An ``isinstance`` check against a runtime-checkable Protocol walks its members every time
    (about 8 us each on 3.11, a sixth of an in-process run's cost through the seam), and what a
    run offers is a matter of its class: its methods and properties.
    """
    run_class = type(provider_run)
    kind = _run_kinds.get(run_class)
    if kind is None:
        kind = _run_kinds[run_class] = _RunKind(
            steerable=isinstance(provider_run, SteerableRun),
            resumable=isinstance(provider_run, ResumableRun),
            observable=isinstance(provider_run, ObservableRun),
            queueable=isinstance(provider_run, QueueableRun),
        )
    return kind
