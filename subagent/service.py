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

import collections
import dataclasses
import enum
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, cast

import anyio

from subagent._outcome import DisposeOnExit, Outcome, raise_sole_error
from subagent.budget import BudgetAccount, PriceTable, budget_result
from subagent.events import EventHub
from subagent.observability import _telemetry as telemetry
from subagent.types import (
    Disposer,
    ErrorCode,
    Lineage,
    ObservableRun,
    ProviderSnapshot,
    QueueableRun,
    ResumableRun,
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
    from anyio.abc import TaskGroup
    from opentelemetry.trace import Span

__all__ = ["DEFAULT_PROGRESS_INTERVAL", "ENDED_RUNS_KEPT", "RunState", "ServiceRun", "SubagentService"]

logger = logging.getLogger(__name__)

OBSERVER_SETTLE_TIMEOUT: float = 5.0
"""How long a disposed run's readiness and result may take to settle after the provider's
``dispose()`` returned. A provider that keeps its contract settles both before returning; this
bound only keeps a faulty provider from hanging the caller (its observer is then cancelled)."""

ENDED_RUNS_KEPT = 10_000
"""Ended runs whose usage :meth:`SubagentService.subtree_usage` can still count: a long-lived service
keeps a bounded record (about 1 MiB), the most recent ones."""

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
    """

    def __init__(
        self,
        *,
        progress_interval: float | None = DEFAULT_PROGRESS_INTERVAL,
        prices: PriceTable | None = None,
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
        lineage = self._lineage(snapshot, request)
        account = self._account(snapshot, request, within)
        request = dataclasses.replace(request, lineage=lineage, account=account)
        span = self._run_span(snapshot, request)
        try:
            # Current while the provider starts the run: what it starts inherits the span.
            with telemetry.current(span):
                provider_run = snapshot.start(request, task_group)
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
        task_group.start_soon(run._observe, name=f"subagent observer {run.id}")
        return run

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
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        return self

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
                        self._ready.fail(exc)
                    except Exception as exc:
                        error = SubagentError(
                            ErrorCode.START_FAILED,
                            f"provider {self.provider!r}: run {self.id!r} failed to start: {exc}",
                            provider=self.provider,
                        )
                        error.__cause__ = exc
                        self._ready.fail(error)
                    else:
                        self._emit_start()
                        interval = self._service.progress_interval
                        if self._observable is not None and interval is not None:
                            task_group.start_soon(
                                self._heartbeat, interval, name=f"subagent progress {self.id}"
                            )
                        self._ready.settle(None)
                    await self._result.wait_settled()
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
            self._end_span(outcome)

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
        try:
            with telemetry.current(span):
                result = await cast(ResumableRun, self._provider_run).resume(prompt)
        except BaseException as exc:
            telemetry.end_agent_span(span, exc)
            raise
        telemetry.end_agent_span(span, result)
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
