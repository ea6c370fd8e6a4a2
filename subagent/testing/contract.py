"""The seam's lifecycle contract, written once, to check any provider against.

Describe how to make your provider behave three ways (a child that completes with a known output, one
that works until cancelled, one that fails to start) in a `ProviderContract`, then run every check in
`CONTRACT_CHECKS` on it, each as its own test::

    @pytest.mark.anyio
    @pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda check: check.__name__)
    async def test_my_provider_keeps_the_contract(check: ContractCheck) -> None:
        await check(ProviderContract(completing=..., working=..., failing_start=..., output="done"))

Every check drives the provider through a `~subagent.SubagentService`, bounds every wait with
``anyio.fail_after(contract.timeout)``, and fails (``AssertionError``) if the service's block leaves a
task running, a file descriptor open or a process alive (`subagent.testing._leaks`; Linux). What is
checked, from the RFC's "The contract" and "Obligations of a provider":

- ``subagent/start`` fires only once readiness succeeded, and before the caller's ``started()``
  returns; ``subagent/end`` fires once, after it, with the stop reason and the final message.
- A failed start (``start`` raising, or ``started()`` raising) is ``START_FAILED`` and emits neither.
- ``started()`` and ``result()``, awaited many times by many tasks, give the same outcome object.
- ``cancel()`` ends a working turn ``cancelled``.
- ``dispose()`` on every path (after the result, mid-turn, before readiness, by closing the service)
  settles what is unsettled with ``DISPOSED``, is idempotent, and leaves nothing running.
- Runtime capabilities by presence: the run offers ``send_message`` / ``resume`` exactly when the
  provider's run does and the contract says it should, and they raise ``DISPOSED`` after disposal.
- Isolation as declared: a provider that offers ``isolation="worktree"`` runs the child in a worktree
  of a throwaway repository and reports it (``result.workspace``), leaving the parent's tree, its
  worktree list and its branches as they were; one that does not is refused before any child exists.

Nothing here imports pytest: use the checks from any test runner on asyncio or trio.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from subagent import (
    ErrorCode,
    ResumableRun,
    ServiceRun,
    SteerableRun,
    SubagentError,
    SubagentProvider,
    SubagentRequest,
    SubagentResult,
    SubagentRun,
    SubagentRunEndInfo,
    SubagentRunInfo,
    SubagentService,
)
from subagent.testing._leaks import assert_no_leaks

__all__ = [
    "CONTRACT_CHECKS",
    "ContractCheck",
    "ProviderContract",
    "check_a_failed_start_emits_neither_start_nor_end",
    "check_cancel_ends_a_working_turn_cancelled",
    "check_closing_the_service_disposes_a_live_run",
    "check_dispose_after_the_result_keeps_the_result_and_is_idempotent",
    "check_dispose_before_readiness_fails_it_disposed_and_emits_nothing",
    "check_dispose_mid_turn_fails_the_result_disposed_and_ends_the_started_run",
    "check_isolation_is_honoured_as_declared_or_refused_before_any_child",
    "check_runtime_capabilities_are_present_exactly_when_offered",
    "check_start_fires_after_readiness_and_end_after_start",
    "check_started_and_result_give_every_awaiter_the_same_outcome",
]


@dataclass(frozen=True)
class ProviderContract:
    """How to make a provider behave each way the contract needs; each factory makes a fresh provider.

    Attributes:
        completing: a provider whose child becomes ready and completes its turn with ``output``.
        working: a provider whose child becomes ready and then works until cancelled or disposed.
        failing_start: a provider whose child never becomes ready (``start`` raising is fine too).
        output: the final message of ``completing``'s turn.
        steerable: whether this provider's runs offer ``send_message`` (`SteerableRun`).
        resumable: whether this provider's runs offer ``resume`` (`ResumableRun`).
        turn_under_way: awaited with the provider's run once ``started()`` returned on ``working``,
            until the turn is really under way (say, the child sent its first update), so that a cancel
            or dispose lands mid-turn. None: the turn is under way once ``started()`` returned.
        prompt: the prompt of every request.
        parent_id: the ``parent_id`` of every request (a provider that forks a live parent needs one).
        timeout: seconds each check may take: a hang guard, not a speed requirement.
    """

    completing: Callable[[], SubagentProvider]
    working: Callable[[], SubagentProvider]
    failing_start: Callable[[], SubagentProvider]
    output: str
    steerable: bool = False
    resumable: bool = False
    turn_under_way: Callable[[SubagentRun], Awaitable[None]] | None = field(default=None, compare=False)
    prompt: str = "go"
    parent_id: str | None = None
    timeout: float = 30.0


ContractCheck = Callable[[ProviderContract], Awaitable[None]]
"""One check of the contract: an async function of the contract that raises ``AssertionError`` on a breach."""

Event = tuple[str, SubagentRunInfo | SubagentRunEndInfo]


@dataclass
class _Harness:
    contract: ProviderContract
    service: SubagentService
    provider: str
    events: list[Event]

    def start(self) -> ServiceRun:
        contract = self.contract
        return self.service.start(
            self.provider, SubagentRequest(prompt=contract.prompt, parent_id=contract.parent_id)
        )

    async def start_working(self) -> ServiceRun:
        """A run of the ``working`` provider whose turn is under way."""
        run = self.start()
        await run.started()
        if self.contract.turn_under_way is not None:
            await self.contract.turn_under_way(run.provider_run)
        return run


def _running_task_ids() -> set[int]:
    return {task.id for task in anyio.get_running_tasks()}


@asynccontextmanager
async def _harness(
    contract: ProviderContract, make: Callable[[], SubagentProvider]
) -> AsyncIterator[_Harness]:
    """An open service with a provider from ``make`` registered, recording its lifecycle events, all
    within the contract's hang guard; on exit, nothing of it may be left: no task, no file descriptor,
    no process."""
    with anyio.fail_after(contract.timeout):
        tasks_before = _running_task_ids()
        events: list[Event] = []
        provider = make()
        async with assert_no_leaks():
            async with SubagentService(progress_interval=None) as service:
                service.register_provider(provider)
                service.events.on("subagent/start", lambda info: events.append(("start", info)))
                service.events.on("subagent/end", lambda info: events.append(("end", info)))
                yield _Harness(contract, service, provider.name, events)
            left = _running_task_ids() - tasks_before
            assert not left, f"tasks left running after the service closed: {left}"


async def _expect_error(code: ErrorCode, awaitable: Awaitable[Any], what: str) -> SubagentError:
    try:
        outcome = await awaitable
    except SubagentError as error:
        raised = error
    else:
        raise AssertionError(f"{what} returned {outcome!r}, expected SubagentError {code}")
    assert raised.code == code, f"{what} raised {raised.code} ({raised.message}), expected {code}"
    return raised


async def _expect_any_error(awaitable: Awaitable[Any], what: str) -> None:
    try:
        outcome = await awaitable
    except SubagentError:
        return
    raise AssertionError(f"{what} returned {outcome!r}, expected a SubagentError")


def _start_or_error(harness: _Harness) -> ServiceRun | SubagentError:
    try:
        return harness.start()
    except SubagentError as error:
        return error


def _names(events: list[Event]) -> list[str]:
    return [name for name, _ in events]


# -- the checks -------------------------------------------------------------------------------------------


async def check_start_fires_after_readiness_and_end_after_start(contract: ProviderContract) -> None:
    """``subagent/start`` precedes ``started()`` returning; one ``subagent/end`` follows with the outcome."""
    async with _harness(contract, contract.completing) as harness:
        async with harness.start() as run:
            await run.started()
            assert _names(harness.events)[:1] == ["start"], (
                f"started() returned before subagent/start: {harness.events}"
            )
            result = await run.result()
            assert _names(harness.events) == ["start", "end"], harness.events
        assert result.stop_reason == "completed", result
        assert result.output == contract.output, f"output {result.output!r}, expected {contract.output!r}"
    start, end = harness.events[0][1], harness.events[1][1]
    assert start == SubagentRunInfo(
        id=run.id, provider=harness.provider, parent_id=contract.parent_id, prompt=contract.prompt
    )
    assert end == SubagentRunEndInfo(
        id=run.id,
        provider=harness.provider,
        stop_reason="completed",
        last_assistant_message=contract.output,
        error=None,
        usage=result.usage,
        parent_id=contract.parent_id,
    )
    # The wall time from the start request to the end, the same on the end and on the result.
    assert end.elapsed_seconds is not None, end
    assert end.elapsed_seconds >= 0, end
    assert result.elapsed_seconds == end.elapsed_seconds, (result.elapsed_seconds, end.elapsed_seconds)
    assert _names(harness.events) == ["start", "end"], f"events after dispose: {harness.events}"


async def check_a_failed_start_emits_neither_start_nor_end(contract: ProviderContract) -> None:
    """A child that never becomes ready is ``START_FAILED``: from ``start`` itself or from ``started()``."""
    async with _harness(contract, contract.failing_start) as harness:
        started = _start_or_error(harness)
        if isinstance(started, SubagentError):
            code = started.code
            assert code == ErrorCode.START_FAILED, f"start raised {code}: {started.message}"
        else:
            async with started:
                await _expect_error(ErrorCode.START_FAILED, started.started(), "started()")
            # A provider may leave the result unsettled until dispose; after dispose it must have failed.
            await _expect_any_error(started.result(), "result() of a run that never started")
        assert harness.events == [], f"a failed start emitted {harness.events}"
    assert harness.events == [], f"a failed start emitted {harness.events}"


async def check_started_and_result_give_every_awaiter_the_same_outcome(contract: ProviderContract) -> None:
    """Five tasks await ``started()`` and ``result()`` twice each: all get the one result object."""
    results: list[SubagentResult] = []

    async def awaiter(run: ServiceRun) -> None:
        for _ in range(2):
            await run.started()
            results.append(await run.result())

    async with _harness(contract, contract.completing) as harness:
        async with harness.start() as run:
            async with anyio.create_task_group() as group:
                for _ in range(5):
                    group.start_soon(awaiter, run)
            first = results[0]
            assert len(results) == 10
            assert all(result is first for result in results), "awaiters got different result objects"
            assert await run.result() is first
        # After dispose, result() still gives the settled outcome.
        assert await run.result() is first
        assert first.output == contract.output


async def check_cancel_ends_a_working_turn_cancelled(contract: ProviderContract) -> None:
    """``cancel()`` mid-turn settles ``result()`` as ``cancelled``; ``subagent/end`` says so."""
    async with _harness(contract, contract.working) as harness, await harness.start_working() as run:
        await run.cancel()
        result = await run.result()
        assert result.stop_reason == "cancelled", result
        assert await run.result() is result
    assert _names(harness.events) == ["start", "end"], harness.events
    end = harness.events[1][1]
    assert isinstance(end, SubagentRunEndInfo)
    assert end.stop_reason == "cancelled", end


async def check_dispose_mid_turn_fails_the_result_disposed_and_ends_the_started_run(
    contract: ProviderContract,
) -> None:
    """Disposing a working run: ``result()`` raises ``DISPOSED``, the started run still gets its one end."""
    async with _harness(contract, contract.working) as harness:
        run = await harness.start_working()
        async with anyio.create_task_group() as group:
            for _ in range(3):  # concurrent disposers all return after the teardown
                group.start_soon(run.dispose)
        await _expect_error(ErrorCode.DISPOSED, run.result(), "result() after dispose mid-turn")
        await run.dispose()  # idempotent
        await run.started()  # readiness had succeeded; it stays so
        assert _names(harness.events) == ["start", "end"], harness.events
        end = harness.events[1][1]
        assert isinstance(end, SubagentRunEndInfo)
        assert end.stop_reason is None, f"the end of a disposed run: {end}"
        assert end.error, f"the end of a disposed run names no error: {end}"
        assert harness.service.live_runs == (), harness.service.live_runs


async def check_dispose_before_readiness_fails_it_disposed_and_emits_nothing(
    contract: ProviderContract,
) -> None:
    """A run disposed right after ``start`` never announces itself: ``started()`` raises ``DISPOSED``."""
    async with _harness(contract, contract.working) as harness:
        run = harness.start()
        await run.dispose()
        await _expect_error(ErrorCode.DISPOSED, run.started(), "started() after dispose before ready")
        await _expect_error(ErrorCode.DISPOSED, run.result(), "result() after dispose before ready")
        await run.dispose()
        assert harness.events == [], f"a run disposed before readiness emitted {harness.events}"


async def check_dispose_after_the_result_keeps_the_result_and_is_idempotent(
    contract: ProviderContract,
) -> None:
    """Disposing a finished run changes nothing it reported, however many times it is disposed."""
    async with _harness(contract, contract.completing) as harness:
        run = harness.start()
        result = await run.result()
        await run.dispose()
        await run.dispose()
        assert await run.result() is result
        await run.started()
        assert _names(harness.events) == ["start", "end"], harness.events


async def check_closing_the_service_disposes_a_live_run(contract: ProviderContract) -> None:
    """Leaving the service's block with a run still working disposes it: nothing is left behind."""
    async with _harness(contract, contract.working) as harness:
        run = await harness.start_working()
    await _expect_error(ErrorCode.DISPOSED, run.result(), "result() of a run the service closed on")
    assert _names(harness.events) == ["start", "end"], harness.events


async def check_runtime_capabilities_are_present_exactly_when_offered(contract: ProviderContract) -> None:
    """``isinstance(run, SteerableRun / ResumableRun)`` is the truth about the provider's run."""
    async with _harness(contract, contract.completing) as harness:
        run = harness.start()
        for protocol, expected in (
            (SteerableRun, contract.steerable),
            (ResumableRun, contract.resumable),
        ):
            name = protocol.__name__
            inner = isinstance(run.provider_run, protocol)
            assert inner == expected, f"the provider's run is {'' if inner else 'not '}a {name}"
            assert isinstance(run, protocol) == expected, f"the service's run misreports {name}"
        await run.result()
        await run.dispose()
        if isinstance(run, SteerableRun):
            await _expect_error(ErrorCode.DISPOSED, run.send_message("more"), "send_message after dispose")
        if isinstance(run, ResumableRun):
            await _expect_error(ErrorCode.DISPOSED, run.resume("again"), "resume after dispose")


_GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "contract",
    "GIT_AUTHOR_EMAIL": "contract@example.invalid",
    "GIT_COMMITTER_NAME": "contract",
    "GIT_COMMITTER_EMAIL": "contract@example.invalid",
}


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **_GIT_IDENTITY},
        stdin=subprocess.DEVNULL,
    )
    return done.stdout.strip()


def _throwaway_repository(top: str) -> tuple[Path, str]:
    repo = Path(top, "repo")
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "notes.txt").write_text("the parent's notes\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "initial")
    return repo, _git(repo, "rev-parse", "HEAD")


def _repository_state(repo: Path) -> tuple[str, str, str, str]:
    return (
        _git(repo, "rev-parse", "HEAD"),
        _git(repo, "status", "--porcelain"),
        _git(repo, "worktree", "list", "--porcelain"),
        _git(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/"),
    )


async def check_isolation_is_honoured_as_declared_or_refused_before_any_child(
    contract: ProviderContract,
) -> None:
    """A provider offering ``isolation="worktree"`` runs the completing child in a worktree of its own and
    leaves the parent's repository as it was; one that does not offer it refuses the request at once."""
    with tempfile.TemporaryDirectory(prefix="contract-isolation-") as top:
        repo, head = await anyio.to_thread.run_sync(_throwaway_repository, top)
        before = await anyio.to_thread.run_sync(_repository_state, repo)
        request = SubagentRequest(
            prompt=contract.prompt, parent_id=contract.parent_id, cwd=str(repo), isolation="worktree"
        )
        async with _harness(contract, contract.completing) as harness:
            snapshot = harness.service.get_provider(harness.provider)
            assert snapshot is not None
            if "worktree" not in snapshot.capabilities.isolation:
                try:
                    harness.service.start(harness.provider, request)
                except SubagentError as error:
                    refusal = error
                else:
                    raise AssertionError("a provider without isolation accepted isolation='worktree'")
                assert refusal.code == ErrorCode.UNSUPPORTED_CAPABILITY, f"refused with {refusal.code}"
                assert refusal.feature == "isolation", f"refused naming {refusal.feature!r}"
                return
            async with harness.service.start(harness.provider, request) as run:
                result = await run.result()
            change = result.workspace
            assert change is not None, "an isolated run's result has no workspace"
            assert change.mode == "worktree", f"workspace mode {change.mode!r}"
            assert change.base == head, f"the worktree started from {change.base}, not HEAD {head}"
            assert change.branch is not None, "an isolated run's result names no branch"
            assert not change.changed, f"the completing child changed files: {change.files}"
        after = await anyio.to_thread.run_sync(_repository_state, repo)
        assert after == before, f"the parent's repository changed: {before} -> {after}"


CONTRACT_CHECKS: tuple[ContractCheck, ...] = (
    check_start_fires_after_readiness_and_end_after_start,
    check_a_failed_start_emits_neither_start_nor_end,
    check_started_and_result_give_every_awaiter_the_same_outcome,
    check_cancel_ends_a_working_turn_cancelled,
    check_dispose_mid_turn_fails_the_result_disposed_and_ends_the_started_run,
    check_dispose_before_readiness_fails_it_disposed_and_emits_nothing,
    check_dispose_after_the_result_keeps_the_result_and_is_idempotent,
    check_closing_the_service_disposes_a_live_run,
    check_runtime_capabilities_are_present_exactly_when_offered,
    check_isolation_is_honoured_as_declared_or_refused_before_any_child,
)
"""Every check of the contract, in the order the RFC states it."""
