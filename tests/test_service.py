"""The seam's contract, against in-memory fake providers, on asyncio and trio."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup

from subagent import (
    DEFAULT_PROGRESS_INTERVAL,
    ErrorCode,
    Lineage,
    ObservableRun,
    ProviderSnapshot,
    QueueableRun,
    ResumableRun,
    RunState,
    ServiceRun,
    SteerableRun,
    SubagentCapabilities,
    SubagentError,
    SubagentProgressInfo,
    SubagentRequest,
    SubagentResult,
    SubagentRunEndInfo,
    SubagentRunInfo,
    SubagentService,
    ToolFilter,
)
from subagent.types import thaw_json
from tests.fakes import (
    FakeProvider,
    FakeRun,
    ObservableFakeRun,
    QueuedFakeRun,
    ResumableFakeRun,
    SteerableFakeRun,
)

pytestmark = pytest.mark.anyio

WAIT = 5  # seconds; a bound on every wait, never a sleep
BEAT = 0.05  # seconds between progress heartbeats in these tests: short, so tests stay fast


def state_of(run: ServiceRun) -> RunState:
    """The run's state, read through a call so the type checker does not narrow it between reads."""
    return run.state


def running_task_ids() -> set[int]:
    return {task.id for task in anyio.get_running_tasks()}


@asynccontextmanager
async def open_service(
    *providers: FakeProvider, progress_interval: float | None = DEFAULT_PROGRESS_INTERVAL
) -> AsyncIterator[SubagentService]:
    """An open service with `providers` registered; on exit, asserts no task was left running."""
    before = running_task_ids()
    async with SubagentService(progress_interval=progress_interval) as service:
        for provider in providers:
            service.register_provider(provider)
        yield service
    assert running_task_ids() == before


class Recorder:
    """Records lifecycle events in order."""

    def __init__(self, service: SubagentService) -> None:
        self.events: list[tuple[str, Any]] = []
        service.events.on("subagent/provider-added", lambda p: self.events.append(("provider-added", p)))
        service.events.on("subagent/provider-removed", lambda n: self.events.append(("provider-removed", n)))
        service.events.on("subagent/start", lambda info: self.events.append(("start", info)))
        service.events.on("subagent/end", lambda info: self.events.append(("end", info)))

    def names(self) -> list[str]:
        return [name for name, _ in self.events]

    def payload(self, name: str) -> Any:
        (payload,) = [payload for event, payload in self.events if event == name]
        return payload


def completed(output: str = "done") -> SubagentResult:
    return SubagentResult(output=output, stop_reason="completed")


@contextmanager
def fail_after_wait() -> Iterator[None]:
    with anyio.fail_after(WAIT):
        yield


# -- the registry ---------------------------------------------------------------------------------


def test_registering_a_second_provider_under_a_taken_name_fails_and_keeps_the_first() -> None:
    service = SubagentService()
    first = FakeProvider(name="acp")
    service.register_provider(first)
    service.register_provider(FakeProvider(name="spawn"))

    with pytest.raises(SubagentError) as caught:
        service.register_provider(FakeProvider(name="acp", inherits_parent_context=True))

    assert caught.value.code == ErrorCode.DUPLICATE_PROVIDER
    assert caught.value.provider == "acp"
    snapshot = service.get_provider("acp")
    assert snapshot is not None
    assert snapshot.inherits_parent_context is False
    assert service.list() == ["acp", "spawn"]


def test_list_keeps_registration_order_and_a_reregistered_name_goes_last() -> None:
    service = SubagentService()
    dispose_b = None
    for name in ["c", "a", "b", "d"]:
        disposer = service.register_provider(FakeProvider(name=name))
        if name == "b":
            dispose_b = disposer
    assert service.list() == ["c", "a", "b", "d"]
    assert dispose_b is not None
    dispose_b()
    service.register_provider(FakeProvider(name="b"))
    assert service.list() == ["c", "a", "d", "b"]


async def test_mutating_a_provider_after_registration_changes_nothing_the_registry_reports_or_does() -> None:
    provider = FakeProvider(name="spawn", capabilities=SubagentCapabilities(output_schema=True))
    async with open_service(provider) as service:
        provider.name = "renamed"
        provider.capabilities = SubagentCapabilities()
        provider.inherits_parent_context = True
        replacement = FakeProvider(name="impostor")
        provider.start = replacement.start  # type: ignore[method-assign]

        assert service.list() == ["spawn"]
        assert service.get_provider("renamed") is None
        snapshot = service.get_provider("spawn")
        assert snapshot is not None
        assert (snapshot.name, snapshot.capabilities, snapshot.inherits_parent_context) == (
            "spawn",
            SubagentCapabilities(output_schema=True),
            False,
        )

        # output_schema is still accepted, and the original object's start is what runs.
        request = SubagentRequest(prompt="p", output_schema={"type": "object"})
        async with service.start("spawn", request) as run:
            assert replacement.start_calls == 0
            assert provider.start_calls == 1
            assert run.id == provider.runs[0].id


async def test_a_snapshot_is_frozen() -> None:
    service = SubagentService()
    service.register_provider(FakeProvider(name="acp"))
    snapshot = service.get_provider("acp")
    assert snapshot is not None
    with pytest.raises(AttributeError):
        snapshot.name = "other"  # type: ignore[misc]


def test_a_disposer_removes_exactly_its_own_registration_and_events_fire_once_each() -> None:
    service = SubagentService()
    recorder = Recorder(service)
    first = FakeProvider(name="acp")
    dispose_first = service.register_provider(first)
    dispose_first()
    second = FakeProvider(name="acp", inherits_parent_context=True)
    service.register_provider(second)

    dispose_first()  # idempotent, and it must not remove the later registration
    dispose_first()

    snapshot = service.get_provider("acp")
    assert snapshot is not None
    assert snapshot.inherits_parent_context is True
    assert recorder.names() == ["provider-added", "provider-removed", "provider-added"]
    added_first, removed, added_second = (payload for _, payload in recorder.events)
    assert isinstance(added_first, ProviderSnapshot)
    assert added_first.name == "acp"
    assert added_first.inherits_parent_context is False
    assert removed == "acp"
    assert added_second == snapshot


# -- start-time checks ------------------------------------------------------------------------------


async def test_starting_an_unknown_provider_raises_no_provider() -> None:
    async with open_service(FakeProvider(name="acp")) as service:
        with pytest.raises(SubagentError) as caught:
            service.start("fork", SubagentRequest(prompt="p"))
    assert caught.value.code == ErrorCode.NO_PROVIDER
    assert caught.value.provider == "fork"


@pytest.mark.parametrize(
    ("capabilities", "request_fields", "unmet"),
    [
        (SubagentCapabilities(), {"output_schema": {"type": "object"}, "depth_limit": 2}, "output_schema"),
        (SubagentCapabilities(output_schema=True), {"output_schema": {}, "depth_limit": 2}, "depth_limit"),
        (
            SubagentCapabilities(output_schema=True, depth_limit=True),
            {"depth_limit": 1, "tool_filter": ToolFilter(deny={"bash"})},
            "tool_filter",
        ),
        (SubagentCapabilities(output_schema=True, depth_limit=True), {"persona": "a critic"}, "persona"),
    ],
)
async def test_an_unmet_start_time_feature_is_refused_by_name_before_the_provider_is_called(
    capabilities: SubagentCapabilities, request_fields: dict[str, Any], unmet: str
) -> None:
    provider = FakeProvider(name="acp", capabilities=capabilities)
    async with open_service(provider) as service:
        with pytest.raises(SubagentError) as caught:
            service.start("acp", SubagentRequest(prompt="p", **request_fields))
    assert caught.value.code == ErrorCode.UNSUPPORTED_CAPABILITY
    assert caught.value.feature == unmet
    assert provider.start_calls == 0


async def test_supported_start_time_features_reach_the_provider_unchanged() -> None:
    provider = FakeProvider(
        name="spawn",
        capabilities=SubagentCapabilities(output_schema=True, depth_limit=True, tool_filter=True),
    )
    request = SubagentRequest(
        prompt="p",
        output_schema={"type": "object"},
        depth_limit=2,
        tool_filter=ToolFilter(allow={"read", "grep"}, deny={"grep"}),
        persona="a careful reviewer",
    )
    async with open_service(provider) as service, service.start("spawn", request):
        seen = provider.runs[0].request
        assert seen == request
        assert (seen.output_schema, seen.depth_limit, seen.tool_filter, seen.persona) == (
            request.output_schema,
            request.depth_limit,
            request.tool_filter,
            request.persona,
        )
        # The only addition: where the child sits in its chain, as the service counted it.
        assert seen.lineage == Lineage(depth=1, ancestors=(), depth_budget=2, tool_filter=request.tool_filter)
        assert request.tool_filter is not None
        assert request.tool_filter.permits("read")
        assert not request.tool_filter.permits("grep")


async def test_a_provider_whose_start_raises_gives_start_failed_and_no_run() -> None:
    provider = FakeProvider(name="acp")

    def broken_start(request: SubagentRequest, task_group: TaskGroup) -> FakeRun:
        raise OSError("no such agent")

    provider.start = broken_start  # type: ignore[method-assign]
    async with open_service(provider) as service:
        with pytest.raises(SubagentError) as caught:
            service.start("acp", SubagentRequest(prompt="p"))
        assert caught.value.code == ErrorCode.START_FAILED
        assert isinstance(caught.value.__cause__, OSError)
        assert service.live_runs == ()


async def test_starting_on_a_closed_service_raises_disposed() -> None:
    async with open_service(FakeProvider()) as service:
        pass
    with pytest.raises(SubagentError) as caught:
        service.start("fake", SubagentRequest(prompt="p"))
    assert caught.value.code == ErrorCode.DISPOSED


# -- lifecycle events -------------------------------------------------------------------------------


async def test_start_fires_only_after_readiness_and_end_only_after_the_result() -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        recorder = Recorder(service)
        request = SubagentRequest(prompt="summarise", parent_id="parent-1")
        async with service.start("fake", request) as run:
            fake = provider.runs[0]
            await anyio.wait_all_tasks_blocked()
            assert recorder.names() == []
            assert state_of(run) is RunState.STARTING

            fake.make_ready()
            with fail_after_wait():
                await run.started()
            assert recorder.names() == ["start"]
            assert recorder.payload("start") == SubagentRunInfo(
                id=fake.id, provider="fake", parent_id="parent-1", prompt="summarise"
            )
            assert state_of(run) is RunState.RUNNING

            fake.finish(completed("the summary"))
            with fail_after_wait():
                result = await run.result()
            assert result == completed("the summary")
            assert recorder.names() == ["start", "end"]
            assert recorder.payload("end") == SubagentRunEndInfo(
                id=fake.id,
                provider="fake",
                stop_reason="completed",
                last_assistant_message="the summary",
                error=None,
                parent_id="parent-1",
            )
            # The wall time from the start request to the end rides along (on the result too).
            end_elapsed = recorder.payload("end").elapsed_seconds
            assert end_elapsed is not None
            assert end_elapsed >= 0
            assert result.elapsed_seconds == end_elapsed
            assert state_of(run) is RunState.ENDED
        assert state_of(run) is RunState.DISPOSED


async def test_a_result_that_settles_before_readiness_is_buffered_until_start_fires() -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        recorder = Recorder(service)
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            fake = provider.runs[0]
            fake.finish(completed("early"))
            await anyio.wait_all_tasks_blocked()
            assert recorder.names() == []

            fake.make_ready()
            with fail_after_wait():
                result = await run.result()
            assert result.output == "early"
            assert recorder.names() == ["start", "end"]


async def test_a_run_whose_readiness_fails_emits_neither_event_and_its_failed_result_is_observed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        recorder = Recorder(service)
        run = service.start("fake", SubagentRequest(prompt="p"))
        fake = provider.runs[0]
        crash = SubagentError(ErrorCode.START_FAILED, "agent exited with status 3")
        fake.fail_ready(crash)
        fake.fail_result(crash)  # nobody awaits this result: the service must observe it
        with fail_after_wait(), pytest.raises(SubagentError) as caught:
            await run.started()
        assert caught.value is crash
        assert state_of(run) is RunState.FAILED
        await anyio.wait_all_tasks_blocked()
    # Closing the service disposed the run; no event was emitted and nothing escaped.
    assert recorder.names() == []
    assert fake.dispose_calls == 1
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_a_readiness_failure_that_is_not_a_subagent_error_becomes_start_failed() -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            provider.runs[0].fail_ready(ConnectionResetError("pipe closed"))
            with fail_after_wait(), pytest.raises(SubagentError) as caught:
                await run.started()
        assert caught.value.code == ErrorCode.START_FAILED
        assert isinstance(caught.value.__cause__, ConnectionResetError)


async def test_end_carries_a_copy_of_the_output_that_the_caller_cannot_change() -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        recorder = Recorder(service)
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            provider.runs[0].make_ready()
            provider.runs[0].finish(
                SubagentResult(
                    output="partial answer", stop_reason="error", error="agent exited with status 1"
                )
            )
            with fail_after_wait():
                result = await run.result()
            result.output = "tampered"
            result.error = None
        end = recorder.payload("end")
        assert end == SubagentRunEndInfo(
            id=provider.runs[0].id,
            provider="fake",
            stop_reason="error",
            last_assistant_message="partial answer",
            error="agent exited with status 1",
        )


async def test_end_omits_the_message_when_the_result_itself_raised() -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        recorder = Recorder(service)
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            provider.runs[0].make_ready()
            provider.runs[0].fail_result(RuntimeError("transport broke"))
            with fail_after_wait(), pytest.raises(RuntimeError, match="transport broke"):
                await run.result()
        assert recorder.payload("end") == SubagentRunEndInfo(
            id=provider.runs[0].id,
            provider="fake",
            stop_reason=None,
            last_assistant_message=None,
            error="transport broke",
        )


async def test_a_listener_that_raises_is_logged_and_affects_nothing_else(
    caplog: pytest.LogCaptureFixture,
) -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:

        def broken(info: SubagentRunInfo) -> None:
            raise ValueError("listener bug")

        service.events.on("subagent/start", broken)
        recorder = Recorder(service)  # registered after the broken one: it must still be called
        service.events.on("subagent/end", lambda info: 1 / 0)
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            provider.runs[0].make_ready()
            provider.runs[0].finish(completed("fine"))
            with fail_after_wait():
                await run.started()
                result = await run.result()
        assert result == completed("fine")
        assert recorder.names() == ["start", "end"]
    failures = [r for r in caplog.records if r.name == "subagent.events" and r.levelno == logging.ERROR]
    assert [r.getMessage() for r in failures] == [
        "listener for subagent/start raised; ignored",
        "listener for subagent/end raised; ignored",
    ]
    assert failures[0].exc_info is not None
    assert isinstance(failures[0].exc_info[1], ValueError)
    assert failures[1].exc_info is not None
    assert isinstance(failures[1].exc_info[1], ZeroDivisionError)


async def test_an_event_listener_disposer_removes_only_that_listener() -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        seen: list[str] = []
        off = service.events.on("subagent/start", lambda info: seen.append("first"))
        service.events.on("subagent/start", lambda info: seen.append("second"))
        off()
        off()
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            provider.runs[0].make_ready()
            with fail_after_wait():
                await run.started()
        assert seen == ["second"]
        assert service.events.listener_count("subagent/start") == 1


# -- awaiting readiness and results -----------------------------------------------------------------


async def test_started_and_result_give_the_same_outcome_to_many_tasks_and_repeated_awaits() -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            outcomes: list[object] = []

            async def waiter() -> None:
                await run.started()
                outcomes.append(await run.result())
                await run.started()
                outcomes.append(await run.result())

            with fail_after_wait():
                async with anyio.create_task_group() as tg:
                    for _ in range(5):
                        tg.start_soon(waiter)
                    await anyio.wait_all_tasks_blocked()
                    provider.runs[0].make_ready()
                    provider.runs[0].finish(completed("same"))
        assert len(outcomes) == 10
        assert all(outcome is outcomes[0] for outcome in outcomes)
        assert outcomes[0] == completed("same")


async def test_a_failed_readiness_raises_the_same_error_to_every_waiter() -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            errors: list[BaseException] = []

            async def waiter() -> None:
                for _ in range(2):
                    try:
                        await run.started()
                    except SubagentError as exc:
                        errors.append(exc)

            crash = SubagentError(ErrorCode.START_FAILED, "exited")
            with fail_after_wait():
                async with anyio.create_task_group() as tg:
                    for _ in range(3):
                        tg.start_soon(waiter)
                    await anyio.wait_all_tasks_blocked()
                    provider.runs[0].fail_ready(crash)
        assert errors == [crash] * 6


# -- ownership and disposal -------------------------------------------------------------------------


async def test_leaving_the_run_block_normally_disposes_the_run() -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            provider.runs[0].make_ready()
            with fail_after_wait():
                await run.started()
            assert provider.runs[0].child_running()
        assert provider.runs[0].dispose_calls == 1
        assert not provider.runs[0].child_running()
        assert service.live_runs == ()


async def test_leaving_the_run_block_by_an_exception_disposes_the_run_and_propagates_it() -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        with pytest.raises(LookupError, match="caller bug"):
            async with service.start("fake", SubagentRequest(prompt="p")):
                raise LookupError("caller bug")
        assert provider.runs[0].dispose_calls == 1
        assert not provider.runs[0].child_running()
        assert service.live_runs == ()


async def test_leaving_the_run_block_by_cancellation_disposes_the_run() -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        with fail_after_wait(), anyio.CancelScope() as scope:
            async with service.start("fake", SubagentRequest(prompt="p")) as run:
                provider.runs[0].make_ready()
                await run.started()
                scope.cancel()
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert provider.runs[0].dispose_calls == 1
        assert not provider.runs[0].child_running()
        assert state_of(run) is RunState.DISPOSED


async def test_disposing_before_readiness_fails_started_with_disposed_and_emits_nothing() -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        recorder = Recorder(service)
        run = service.start("fake", SubagentRequest(prompt="p"))
        with fail_after_wait():
            await run.dispose()
            with pytest.raises(SubagentError) as caught:
                await run.started()
        assert caught.value.code == ErrorCode.DISPOSED
        assert recorder.names() == []


async def test_dispose_is_idempotent_and_concurrent_disposers_all_return_after_teardown() -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        run = service.start("fake", SubagentRequest(prompt="p"))
        returned_while_child_ran: list[bool] = []

        async def dispose() -> None:
            await run.dispose()
            returned_while_child_ran.append(provider.runs[0].child_running())

        with fail_after_wait():
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(dispose)
            await run.dispose()
        assert returned_while_child_ran == [False, False, False]
        assert provider.runs[0].dispose_calls == 1


async def test_closing_the_service_disposes_every_live_run_and_leaves_nothing_running() -> None:
    provider = FakeProvider()
    before = running_task_ids()
    async with SubagentService() as service:
        service.register_provider(provider)
        recorder = Recorder(service)
        runs = [service.start("fake", SubagentRequest(prompt=f"job {i}")) for i in range(3)]
        provider.runs[0].make_ready()
        provider.runs[1].make_ready()
        provider.runs[1].finish(completed("second"))
        with fail_after_wait():
            await runs[0].started()
            await runs[1].result()
        assert len(service.live_runs) == 3
    assert running_task_ids() == before
    assert [fake.dispose_calls for fake in provider.runs] == [1, 1, 1]
    assert not any(fake.child_running() for fake in provider.runs)
    assert [run.state for run in runs] == [RunState.DISPOSED] * 3
    # The started-but-unfinished run still got its end, as an infrastructure failure.
    ends = [payload for name, payload in recorder.events if name == "end"]
    assert [(end.id, end.stop_reason) for end in ends] == [
        (provider.runs[1].id, "completed"),
        (runs[0].id, None),
    ]
    assert ends[1].error is not None
    assert ends[1].last_assistant_message is None


async def test_closing_the_service_from_a_cancelled_owner_still_disposes_every_run() -> None:
    provider = FakeProvider()
    before = running_task_ids()
    with fail_after_wait(), anyio.CancelScope() as scope:
        async with SubagentService() as service:
            service.register_provider(provider)
            for i in range(2):
                service.start("fake", SubagentRequest(prompt=f"job {i}"))
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert running_task_ids() == before
    assert [fake.dispose_calls for fake in provider.runs] == [1, 1]
    assert not any(fake.child_running() for fake in provider.runs)


async def test_cancel_settles_the_result_as_cancelled() -> None:
    provider = FakeProvider()
    async with open_service(provider) as service:
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            provider.runs[0].make_ready()
            with fail_after_wait():
                await run.started()
                await run.cancel()
                result = await run.result()
        assert result == SubagentResult(output="partial", stop_reason="cancelled")
        assert provider.runs[0].cancel_calls == 1


# -- progress heartbeats and queueing ---------------------------------------------------------------


@dataclasses.dataclass
class Beat:
    """One `subagent/progress` event, with what the test could see when it arrived."""

    info: SubagentProgressInfo
    received_at: float  # time.monotonic() in the listener
    last_activity: float | None  # the fake's last_activity at that moment


class Timeline:
    """Records start, progress and end events in order; waits for progress events by run."""

    def __init__(self, service: SubagentService, *providers: FakeProvider) -> None:
        self.events: list[tuple[str, str]] = []  # (event, run id)
        self.beats: list[Beat] = []
        self._providers = providers
        self._arrived = anyio.Event()
        service.events.on("subagent/start", lambda info: self.events.append(("start", info.id)))
        service.events.on("subagent/end", lambda info: self.events.append(("end", info.id)))
        service.events.on("subagent/progress", self._on_progress)

    def _on_progress(self, info: SubagentProgressInfo) -> None:
        (fake,) = [run for provider in self._providers for run in provider.runs if run.id == info.id]
        last_activity = fake.last_activity if isinstance(fake, ObservableFakeRun) else None
        self.beats.append(Beat(info, time.monotonic(), last_activity))
        self.events.append(("progress", info.id))
        self._arrived.set()

    def beats_of(self, run_id: str) -> list[Beat]:
        return [beat for beat in self.beats if beat.info.id == run_id]

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Return once `condition()` holds, re-checking at each progress event (bounded by the caller)."""
        while not condition():
            self._arrived = anyio.Event()
            await self._arrived.wait()

    async def wait_for_beats(self, run_id: str, count: int) -> list[Beat]:
        """Return the first `count` progress events of `run_id`, once they all arrived."""
        await self.wait_for(lambda: len(self.beats_of(run_id)) >= count)
        return self.beats_of(run_id)[:count]

    def indexes(self, event: str, run_id: str) -> list[int]:
        return [index for index, entry in enumerate(self.events) if entry == (event, run_id)]


def assert_idle_is_time_since_last_activity(beat: Beat) -> None:
    assert beat.last_activity is not None
    # Computed just before the listener ran, in the same synchronous step: only microseconds apart.
    gap = (beat.received_at - beat.last_activity) - beat.info.idle_seconds
    assert 0 <= gap < 0.01


def progress_tasks() -> list[str]:
    return [str(task.name) for task in anyio.get_running_tasks() if "subagent progress" in str(task.name)]


async def test_progress_comes_every_interval_after_start_with_idle_growing_until_an_update_resets_it() -> (
    None
):
    provider = FakeProvider(run_class=ObservableFakeRun)
    async with open_service(provider, progress_interval=BEAT) as service:
        timeline = Timeline(service, provider)
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            fake = provider.runs[0]
            assert isinstance(fake, ObservableFakeRun)
            fake.make_ready()
            with fail_after_wait():
                await run.started()
                silent = await timeline.wait_for_beats(fake.id, 3)
            assert [beat.info.provider for beat in silent] == ["fake"] * 3
            assert [(beat.info.updates, beat.info.waiting_on_permission) for beat in silent] == [
                (0, False)
            ] * 3
            for count, beat in enumerate(silent, start=1):
                assert beat.info.elapsed_seconds >= count * BEAT - 0.001  # one interval between beats
                assert_idle_is_time_since_last_activity(beat)
            idle = [beat.info.idle_seconds for beat in silent]
            assert idle[0] < idle[1] < idle[2]

            fake.update()
            seen = len(timeline.beats_of(fake.id))
            with fail_after_wait():
                after = (await timeline.wait_for_beats(fake.id, seen + 1))[-1]
            assert after.info.updates == 1
            assert after.last_activity is not None
            assert silent[-1].last_activity is not None
            assert after.last_activity > silent[-1].last_activity  # the clock restarted at the update
            assert_idle_is_time_since_last_activity(after)
            assert after.info.describe().startswith("child alive, last update ")


async def test_progress_flags_a_pending_permission_question_and_says_how_long_it_has_waited() -> None:
    provider = FakeProvider(run_class=ObservableFakeRun)
    async with open_service(provider, progress_interval=BEAT) as service:
        timeline = Timeline(service, provider)
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            fake = provider.runs[0]
            assert isinstance(fake, ObservableFakeRun)
            fake.make_ready()
            fake.update()
            fake.pending_permissions = 1
            with fail_after_wait():
                await run.started()
                asking = await timeline.wait_for_beats(fake.id, 2)
            assert [beat.info.waiting_on_permission for beat in asking] == [True, True]
            assert asking[0].info.idle_seconds < asking[1].info.idle_seconds
            assert asking[1].info.describe().startswith("waiting on a permission answer for ")

            fake.pending_permissions = 0
            fake.update()  # the answer went out and the child went on
            with fail_after_wait():
                answered = (await timeline.wait_for_beats(fake.id, 3))[-1]
            assert answered.info.waiting_on_permission is False
            assert answered.info.updates == 2


async def test_progress_never_fires_before_start_or_after_end() -> None:
    provider = FakeProvider(run_class=ObservableFakeRun)
    async with open_service(provider, progress_interval=BEAT) as service:
        timeline = Timeline(service, provider)
        # A second run that keeps beating is the clock: waiting for its beats lets time pass
        # without a sleep, and proves the heartbeat machinery was running all along.
        clock = service.start("fake", SubagentRequest(prompt="clock"))
        subject = service.start("fake", SubagentRequest(prompt="subject"))
        provider.runs[0].make_ready()
        with fail_after_wait():
            await timeline.wait_for_beats(clock.id, 3)
        assert timeline.beats_of(subject.id) == []  # not started: no heartbeat

        provider.runs[1].make_ready()
        with fail_after_wait():
            await subject.started()
            await timeline.wait_for_beats(subject.id, 2)
        provider.runs[1].finish(completed())
        with fail_after_wait():
            await subject.result()
            clock_beats = len(timeline.beats_of(clock.id))
            await timeline.wait_for_beats(clock.id, clock_beats + 3)
        (start,) = timeline.indexes("start", subject.id)
        (end,) = timeline.indexes("end", subject.id)
        beats = timeline.indexes("progress", subject.id)
        assert len(beats) >= 2
        assert start < min(beats)
        assert max(beats) < end
        assert subject.progress() is None  # ended: nothing to report


async def test_no_progress_is_emitted_when_disabled_and_the_run_still_reports_it_on_demand() -> None:
    provider = FakeProvider(run_class=ObservableFakeRun)
    async with open_service(provider, progress_interval=None) as service:
        timeline = Timeline(service, provider)
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            provider.runs[0].make_ready()
            with fail_after_wait():
                await run.started()
            await anyio.wait_all_tasks_blocked()
            assert progress_tasks() == []  # no heartbeat exists to fire
            info = run.progress()
            assert info is not None
            assert (info.id, info.updates, info.waiting_on_permission) == (run.id, 0, False)
        assert timeline.beats == []


async def test_a_run_that_is_not_observable_gets_no_progress() -> None:
    observable = FakeProvider(name="observable", run_class=ObservableFakeRun)
    plain = FakeProvider(name="plain")
    async with open_service(observable, plain, progress_interval=BEAT) as service:
        timeline = Timeline(service, observable, plain)
        clock = service.start("observable", SubagentRequest(prompt="clock"))
        run = service.start("plain", SubagentRequest(prompt="p"))
        assert isinstance(observable.runs[0], ObservableRun)
        assert not isinstance(plain.runs[0], ObservableRun)
        observable.runs[0].make_ready()
        plain.runs[0].make_ready()
        with fail_after_wait():
            await run.started()
            await timeline.wait_for_beats(clock.id, 3)
        assert timeline.beats_of(run.id) == []
        assert run.progress() is None


async def test_closing_the_service_stops_every_heartbeat_before_the_end_and_leaves_no_task() -> None:
    provider = FakeProvider(run_class=ObservableFakeRun)
    async with open_service(provider, progress_interval=BEAT) as service:
        timeline = Timeline(service, provider)
        runs = [service.start("fake", SubagentRequest(prompt=f"job {i}")) for i in range(3)]
        for fake in provider.runs:
            fake.make_ready()
        with fail_after_wait():
            for run in runs:
                await timeline.wait_for_beats(run.id, 2)
        assert len(progress_tasks()) == 3
    # open_service asserted that no task is left; every run's beats all come before its end.
    for run in runs:
        (end,) = timeline.indexes("end", run.id)
        assert max(timeline.indexes("progress", run.id)) < end


async def test_a_liveness_property_that_raises_stops_only_the_heartbeat(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class BrokenLiveness(ObservableFakeRun):
        broken = False

        @property
        def update_count(self) -> int:
            if self.broken:
                raise RuntimeError("provider bug")
            return 0

        @update_count.setter
        def update_count(self, value: int) -> None:
            pass

    logged = anyio.Event()

    class Signal(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "liveness" in record.getMessage():
                logged.set()

    signal = Signal()
    logging.getLogger("subagent.service").addHandler(signal)
    provider = FakeProvider(run_class=BrokenLiveness)
    async with open_service(provider, progress_interval=BEAT) as service:
        timeline = Timeline(service, provider)
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            fake = provider.runs[0]
            assert isinstance(fake, BrokenLiveness)
            fake.make_ready()
            with fail_after_wait():
                await timeline.wait_for_beats(run.id, 1)
            fake.broken = True
            try:
                with fail_after_wait():
                    await logged.wait()
            finally:
                logging.getLogger("subagent.service").removeHandler(signal)
            await anyio.wait_all_tasks_blocked()
            assert progress_tasks() == []
            fake.finish(completed("fine"))
            with fail_after_wait():
                assert await run.result() == completed("fine")
    assert [name for name, run_id in timeline.events if name != "progress"] == ["start", "end"]
    assert [r.levelno for r in caplog.records if "liveness" in r.getMessage()] == [logging.ERROR]


async def test_a_queued_provider_run_reports_queued_until_it_gets_its_slot() -> None:
    provider = FakeProvider(run_class=QueuedFakeRun)
    async with open_service(provider) as service:
        async with service.start("fake", SubagentRequest(prompt="p")) as run:
            fake = provider.runs[0]
            assert isinstance(fake, QueuedFakeRun)
            assert isinstance(fake, QueueableRun)
            assert state_of(run) is RunState.QUEUED
            assert "queued" in repr(run)
            fake.admit()
            assert state_of(run) is RunState.STARTING
            fake.make_ready()
            with fail_after_wait():
                await run.started()
            assert state_of(run) is RunState.RUNNING
        assert state_of(run) is RunState.DISPOSED


async def test_a_run_disposed_while_queued_fails_its_start_with_disposed_and_emits_nothing() -> None:
    provider = FakeProvider(run_class=QueuedFakeRun)
    async with open_service(provider) as service:
        recorder = Recorder(service)
        run = service.start("fake", SubagentRequest(prompt="p"))
        assert state_of(run) is RunState.QUEUED
        with fail_after_wait():
            await run.dispose()
        with pytest.raises(SubagentError) as caught:
            await run.started()
        assert caught.value.code == ErrorCode.DISPOSED
        assert state_of(run) is RunState.DISPOSED
    assert recorder.names() == []


# -- runtime capabilities ---------------------------------------------------------------------------


class _SteerableObservableRun(SteerableFakeRun, ObservableFakeRun):
    pass


@pytest.mark.parametrize(
    ("run_class", "steerable", "resumable", "observable"),
    [
        (FakeRun, False, False, False),
        (SteerableFakeRun, True, False, False),
        (ResumableFakeRun, False, True, False),
        (ObservableFakeRun, False, False, True),
        (_SteerableObservableRun, True, False, True),
    ],
)
async def test_runtime_capabilities_are_exactly_those_of_the_provider_run(
    run_class: type[FakeRun], steerable: bool, resumable: bool, observable: bool
) -> None:
    provider = FakeProvider(run_class=run_class)
    async with open_service(provider) as service, service.start("fake", SubagentRequest(prompt="p")) as run:
        assert isinstance(run, SteerableRun) is steerable
        assert isinstance(run, ResumableRun) is resumable
        assert isinstance(run, ObservableRun) is observable
        assert isinstance(run, ServiceRun)


async def test_an_observable_provider_runs_liveness_reads_through_the_service_run() -> None:
    provider = FakeProvider(run_class=ObservableFakeRun)
    async with open_service(provider) as service, service.start("fake", SubagentRequest(prompt="p")) as run:
        fake = run.provider_run
        assert isinstance(fake, ObservableFakeRun)
        assert isinstance(run, ObservableRun)
        fake.update()
        fake.pending_permissions = 2
        assert (run.last_activity, run.pending_permissions, run.update_count) == (fake.last_activity, 2, 1)


async def test_steering_and_resuming_pass_through_and_are_refused_after_dispose() -> None:
    class BothRun(SteerableFakeRun, ResumableFakeRun):
        pass

    provider = FakeProvider(run_class=BothRun)
    async with open_service(provider) as service:
        run = service.start("fake", SubagentRequest(prompt="p"))
        assert isinstance(run, SteerableRun)
        assert isinstance(run, ResumableRun)
        with fail_after_wait():
            await run.send_message("also check the tests")
            assert await run.resume("again") == SubagentResult(
                output="resumed: again", stop_reason="completed"
            )
            await run.dispose()
        assert provider.runs[0].messages == ["also check the tests"]
        with pytest.raises(SubagentError) as caught:
            await run.send_message("too late")
        assert caught.value.code == ErrorCode.DISPOSED
        with pytest.raises(SubagentError) as caught:
            await run.resume("too late")
        assert caught.value.code == ErrorCode.DISPOSED


# -- vocabulary -------------------------------------------------------------------------------------


def test_a_request_copies_its_mappings_so_later_changes_to_the_callers_dicts_change_nothing() -> None:
    schema: dict[str, Any] = {"type": "object"}
    metadata: dict[str, Any] = {"ticket": 7}
    request = SubagentRequest(prompt="p", output_schema=schema, metadata=metadata)
    schema["type"] = "array"
    metadata["ticket"] = 8
    assert request.output_schema == {"type": "object"}
    assert request.metadata == {"ticket": 7}
    with pytest.raises(TypeError):
        request.metadata["ticket"] = 9  # type: ignore[index]


def test_a_requests_nested_schema_is_deep_frozen_and_thaws_to_plain_json() -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {"tags": {"type": "array", "items": ["a"]}}}
    request = SubagentRequest(prompt="p", output_schema=schema)
    schema["properties"]["tags"]["items"].append("b")
    assert request.output_schema is not None
    assert request.output_schema["properties"]["tags"]["items"] == ("a",)
    with pytest.raises(TypeError):
        request.output_schema["properties"]["x"] = {}
    assert thaw_json(request.output_schema) == {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": ["a"]}},
    }


def test_a_tool_filter_denies_over_allows_and_stores_frozen_sets() -> None:
    names = {"read", "write"}
    tool_filter = ToolFilter(allow=names, deny=frozenset(["write"]))
    names.add("bash")
    assert tool_filter.allow == frozenset({"read", "write"})
    assert [tool_filter.permits(t) for t in ("read", "write", "bash")] == [True, False, False]
    assert ToolFilter(deny={"bash"}).permits("anything")


@pytest.mark.parametrize("fields", [{"depth_limit": -1}, {"timeout": 0}])
def test_a_request_with_an_impossible_bound_is_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be"):
        SubagentRequest(prompt="p", **fields)


def test_requested_features_lists_what_the_request_asks_in_check_order() -> None:
    request = SubagentRequest(prompt="p", persona="x", depth_limit=0)
    assert request.requested_features() == ("depth_limit", "persona")


@pytest.mark.parametrize("interval", [0, -1.0])
def test_a_progress_interval_that_is_not_positive_is_refused(interval: float) -> None:
    with pytest.raises(ValueError, match="progress_interval"):
        SubagentService(progress_interval=interval)


def test_the_default_progress_interval_is_ten_seconds() -> None:
    assert DEFAULT_PROGRESS_INTERVAL == 10.0
    assert SubagentService().progress_interval == 10.0
    assert SubagentService(progress_interval=None).progress_interval is None


@pytest.mark.parametrize(
    ("idle", "waiting", "updates", "elapsed", "described"),
    [
        (12.4, False, 3, 60.0, "child alive, last update 12 s ago"),
        (0.34, False, 1, 2.0, "child alive, last update 0.3 s ago"),
        (40.2, True, 5, 90.0, "waiting on a permission answer for 40 s"),
        (3.4, False, 0, 3.4, "child alive, no update yet after 3.4 s"),
    ],
)
def test_progress_describes_itself_in_one_line(
    idle: float, waiting: bool, updates: int, elapsed: float, described: str
) -> None:
    info = SubagentProgressInfo(
        id="acp-1",
        provider="acp",
        idle_seconds=idle,
        waiting_on_permission=waiting,
        updates=updates,
        elapsed_seconds=elapsed,
    )
    assert info.describe() == described


def test_a_progress_payload_is_frozen() -> None:
    info = SubagentProgressInfo("acp-1", "acp", 1.0, False, 0, 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.idle_seconds = 0.0  # type: ignore[misc]
