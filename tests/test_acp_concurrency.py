"""The ACP provider's concurrency limit: runs past it queue (first come, first served), never fail.

Every test drives real stub agent processes and checks, inside `assert_no_leaks()`, that a queued run
that is given up never spawns and that every slot comes back, whatever ended its child.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import (
    ErrorCode,
    QueueableRun,
    ResumableRun,
    RunState,
    ServiceRun,
    SubagentError,
    SubagentRequest,
    SubagentResult,
    SubagentService,
)
from subagent.acp.transports import supervision_available
from subagent.providers.acp import DEFAULT_MAX_CONCURRENT, AcpProvider, AcpRun
from subagent.testing import dump_scenario, stub_agent_argv
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.leaks import assert_no_leaks, leaked_processes

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

WAIT = 20  # seconds: a bound on a whole test step, never a sleep
FAST = {"stdin_close_timeout": 1.0, "sigterm_timeout": 1.0, "sigkill_timeout": 2.0}

ECHO = {"turns": [[{"step": "echo", "prefix": "done: "}]]}
"""Answers at once; the child then stays alive for resume(), idle and holding no slot, until disposed."""

BUSY = {"turns": [[{"step": "message", "text": "working"}, {"step": "wait_for_cancel"}]]}
"""A turn that runs until it is cancelled."""


def provider_for(command: list[str], tmp_path: Path, **options: Any) -> AcpProvider:
    options.setdefault("process_options", FAST)
    return AcpProvider(command, cwd=tmp_path, **options)


@asynccontextmanager
async def service_with(provider: AcpProvider) -> AsyncIterator[tuple[SubagentService, list[tuple[str, str]]]]:
    """An open service with `provider`, recording (event, run id); nothing may leak, no slot stay taken."""
    events: list[tuple[str, str]] = []
    async with assert_no_leaks():
        async with SubagentService() as service:
            service.register_provider(provider)
            service.events.on("subagent/start", lambda info: events.append(("start", info.id)))
            service.events.on("subagent/end", lambda info: events.append(("end", info.id)))
            yield service, events
        assert (provider.running, provider.waiting) == (0, 0)


def acp(run: ServiceRun) -> AcpRun:
    provider_run = run.provider_run
    assert isinstance(provider_run, AcpRun)
    return provider_run


def live_children() -> int:
    """How many stub agents of ours are running now (their supervisors, our direct children, not counted)."""
    processes = leaked_processes()
    if supervision_available():
        me = os.getpid()
        processes = [info for info in processes if info.ppid != me]
    return len(processes)


async def first_update(run: AcpRun) -> None:
    """Return once the run has received a session update."""
    arrived = anyio.Event()
    dispose = run.on_update(lambda update: arrived.set())
    try:
        if not run.updates:
            await arrived.wait()
    finally:
        dispose()


def scenario_dir(tmp_path: Path, name: str, scenario: dict[str, Any]) -> str:
    """A working directory holding `scenario.json`: with a relative scenario path in the command,
    each run plays the scenario of its own request's cwd."""
    directory = tmp_path / name
    directory.mkdir()
    (directory / "scenario.json").write_text(dump_scenario(scenario), encoding="utf-8")
    return str(directory)


# -- queueing and order ------------------------------------------------------------------------------------


async def test_with_a_limit_of_two_five_runs_queue_start_in_fifo_order_as_slots_free_and_all_complete(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    provider = provider_for(stub_agent_command(BUSY), tmp_path, max_concurrent=2)
    running_at_each_start: list[int] = []
    async with service_with(provider) as (service, events):
        service.events.on("subagent/start", lambda info: running_at_each_start.append(provider.running))
        runs = [service.start("acp", SubagentRequest(prompt=f"run {i}")) for i in range(5)]
        acp_runs = [acp(run) for run in runs]
        assert (provider.running, provider.waiting) == (2, 3)
        assert [run.state for run in runs] == [RunState.STARTING] * 2 + [RunState.QUEUED] * 3
        assert all(isinstance(run, QueueableRun) for run in acp_runs)
        with anyio.fail_after(WAIT):
            await first_update(acp_runs[0])
            await first_update(acp_runs[1])
        # Both children are working: they keep their slots, the rest wait without a child.
        assert live_children() == 2
        assert [(run.queued, run.pid) for run in acp_runs[2:]] == [(True, None)] * 3
        assert [run.state for run in runs[2:]] == [RunState.QUEUED] * 3

        # Slots freed (turns ended) out of start order still go to the run that has waited longest.
        results: dict[int, SubagentResult] = {}
        for freed, granted in [(1, 2), (0, 3), (2, 4)]:
            with anyio.fail_after(WAIT):
                await runs[freed].cancel()
                results[freed] = await runs[freed].result()
            assert not acp_runs[granted].queued
            assert all(run.queued for run in acp_runs[granted + 1 :])
            assert (provider.running, provider.waiting) == (2, 4 - granted)
            with anyio.fail_after(WAIT):
                await first_update(acp_runs[granted])
        for last in (3, 4):
            with anyio.fail_after(WAIT):
                await runs[last].cancel()
                results[last] = await runs[last].result()
        assert (provider.running, provider.waiting) == (0, 0)

    assert results == {i: SubagentResult(output="working", stop_reason="cancelled") for i in range(5)}
    starts = [run_id for event, run_id in events if event == "start"]
    assert set(starts[:2]) == {runs[0].id, runs[1].id}
    assert starts[2:] == [runs[2].id, runs[3].id, runs[4].id]
    assert len({run.pid for run in acp_runs}) == 5  # every run got a child of its own, eventually
    assert max(running_at_each_start) == 2  # never a third child working


async def test_runs_awaited_together_before_any_is_disposed_all_complete_past_the_limit(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    # An idle child (its turn over, kept for resume) holds no slot: awaiting every result before
    # disposing any run cannot wait on itself.
    provider = provider_for(stub_agent_command(ECHO), tmp_path, max_concurrent=2)
    async with service_with(provider) as (service, _):
        runs = [service.start("acp", SubagentRequest(prompt=f"run {i}")) for i in range(5)]
        with anyio.fail_after(WAIT):
            outputs = [(await run.result()).output for run in runs]
        assert (provider.running, provider.waiting) == (0, 0)
        assert live_children() == 5  # all idle, none disposed yet, none holding a slot
    assert outputs == [f"done: run {i}" for i in range(5)]


async def test_a_resumed_turn_queues_for_a_slot_like_a_new_run(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    busy = scenario_dir(tmp_path, "busy", BUSY)
    echo = scenario_dir(tmp_path, "echo", {"turns": [[{"step": "echo", "prefix": "done: "}]]})
    provider = provider_for(stub_agent_argv("scenario.json"), tmp_path, max_concurrent=1)
    async with service_with(provider) as (service, _):
        idle = service.start("acp", SubagentRequest(prompt="first", cwd=echo))
        with anyio.fail_after(WAIT):
            assert (await idle.result()).output == "done: first"
        worker = service.start("acp", SubagentRequest(prompt="work", cwd=busy))
        assert isinstance(idle, ResumableRun)
        with anyio.fail_after(WAIT):
            await first_update(acp(worker))
            async with anyio.create_task_group() as tg:
                resumed: list[SubagentResult] = []

                async def resume() -> None:
                    resumed.append(await idle.resume("second"))

                tg.start_soon(resume)
                await anyio.wait_all_tasks_blocked()
                assert acp(idle).queued  # the worker holds the only slot
                assert (provider.running, provider.waiting) == (1, 1)
                await worker.cancel()
        assert resumed == [SubagentResult(output="done: second", stop_reason="completed")]
        assert (provider.running, provider.waiting) == (0, 0)


async def test_without_a_limit_no_run_ever_waits(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    provider = provider_for(stub_agent_command(ECHO), tmp_path, max_concurrent=None)
    async with service_with(provider) as (service, _):
        runs = [service.start("acp", SubagentRequest(prompt=f"run {i}")) for i in range(4)]
        assert (provider.running, provider.waiting) == (4, 0)
        assert not any(acp(run).queued for run in runs)
        with anyio.fail_after(WAIT):
            outputs = [(await run.result()).output for run in runs]
        assert live_children() == 4
    assert outputs == [f"done: run {i}" for i in range(4)]


# -- a run given up while it waits ---------------------------------------------------------------------------


async def test_a_run_cancelled_while_queued_never_spawns_fails_its_start_and_gives_way_to_the_next(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    provider = provider_for(stub_agent_command(BUSY), tmp_path, max_concurrent=1)
    async with service_with(provider) as (service, events):
        holder = service.start("acp", SubagentRequest(prompt="holder"))
        cancelled = service.start("acp", SubagentRequest(prompt="cancelled"))
        behind = service.start("acp", SubagentRequest(prompt="behind"))
        assert (provider.running, provider.waiting) == (1, 2)
        with anyio.fail_after(WAIT):
            await first_update(acp(holder))
            await cancelled.cancel()
            with pytest.raises(SubagentError) as caught:
                await cancelled.started()
            result = await cancelled.result()
        assert caught.value.code == ErrorCode.START_FAILED
        assert caught.value.message == "the start was cancelled while it waited for a concurrency slot"
        assert result == SubagentResult(output="", stop_reason="cancelled")
        assert (acp(cancelled).pid, acp(cancelled).exit_info) == (None, None)
        assert cancelled.state is RunState.FAILED
        assert (provider.running, provider.waiting) == (1, 1)
        assert live_children() == 1  # only the holder: nothing was spawned for the cancelled run

        with anyio.fail_after(WAIT):
            await holder.cancel()  # its turn ends: the slot goes to the run behind
            await first_update(acp(behind))
            await behind.cancel()
            assert await behind.result() == SubagentResult(output="working", stop_reason="cancelled")
    assert [run_id for _, run_id in events] == [holder.id, holder.id, behind.id, behind.id]
    assert acp(cancelled).pid is None


async def test_a_run_disposed_while_queued_never_spawns_and_fails_with_disposed(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    provider = provider_for(stub_agent_command(BUSY), tmp_path, max_concurrent=1)
    async with service_with(provider) as (service, events):
        holder = service.start("acp", SubagentRequest(prompt="holder"))
        disposed = service.start("acp", SubagentRequest(prompt="disposed"))
        with anyio.fail_after(WAIT):
            await first_update(acp(holder))
            await disposed.dispose()
        with pytest.raises(SubagentError) as started:
            await disposed.started()
        with pytest.raises(SubagentError) as result:
            await disposed.result()
        assert (started.value.code, result.value.code) == (ErrorCode.DISPOSED, ErrorCode.DISPOSED)
        assert "while it waited for a concurrency slot" in started.value.message
        assert (acp(disposed).pid, acp(disposed).exit_info) == (None, None)
        assert (provider.running, provider.waiting) == (1, 0)
        assert live_children() == 1
    assert [run_id for _, run_id in events] == [holder.id, holder.id]


async def test_closing_the_service_disposes_queued_runs_without_spawning_them(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    provider = provider_for(stub_agent_command(BUSY), tmp_path, max_concurrent=1)
    async with service_with(provider) as (service, _):
        runs = [service.start("acp", SubagentRequest(prompt=f"run {i}")) for i in range(3)]
        with anyio.fail_after(WAIT):
            await first_update(acp(runs[0]))
        assert (provider.running, provider.waiting) == (1, 2)
    assert [acp(run).pid is None for run in runs] == [False, True, True]
    assert [run.state for run in runs] == [RunState.DISPOSED] * 3


# -- every way a child ends gives its slot back ------------------------------------------------------------


async def test_a_child_crashing_mid_turn_frees_its_slot_for_the_next_waiting_run(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    provider = provider_for(stub_agent_command(BUSY), tmp_path, max_concurrent=1)
    async with service_with(provider) as (service, _):
        crashing = service.start("acp", SubagentRequest(prompt="crash"))
        waiting = service.start("acp", SubagentRequest(prompt="next"))
        with anyio.fail_after(WAIT):
            await first_update(acp(crashing))
        pid = acp(crashing).pid
        assert pid is not None
        assert acp(waiting).queued
        os.kill(pid, signal.SIGKILL)  # the child dies under us, as an OOM kill would do it
        with anyio.fail_after(WAIT):
            crashed = await crashing.result()
            await waiting.started()  # the dead child's slot went on, without anyone disposing it
        assert crashing.state is RunState.ENDED
        assert crashed.stop_reason == "error"
        assert crashed.output == "working"
        assert crashed.error is not None
        assert "SIGKILL" in crashed.error
        assert (provider.running, provider.waiting) == (1, 0)
        with anyio.fail_after(WAIT):
            await first_update(acp(waiting))
            await waiting.cancel()
            assert await waiting.result() == SubagentResult(output="working", stop_reason="cancelled")


async def test_an_idle_child_holds_no_slot_and_resume_reports_its_death(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    provider = provider_for(stub_agent_command(ECHO), tmp_path, max_concurrent=1)
    async with service_with(provider) as (service, _):
        first = service.start("acp", SubagentRequest(prompt="first"))
        second = service.start("acp", SubagentRequest(prompt="second"))
        with anyio.fail_after(WAIT):
            assert (await first.result()).output == "done: first"
            # The first child is idle (kept for resume) and not disposed: the second runs anyway.
            assert (await second.result()).output == "done: second"
        pid = acp(first).pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # idle, kept for resume(), and killed
        with anyio.fail_after(WAIT):
            assert isinstance(first, ResumableRun)
            resumed = await first.resume("again")
        assert resumed.stop_reason == "error"
        assert resumed.error is not None
        assert "SIGKILL" in resumed.error
        assert (provider.running, provider.waiting) == (0, 0)


async def test_a_failed_start_frees_its_slot_for_the_next_waiting_run(tmp_path: Path) -> None:
    broken = scenario_dir(
        tmp_path, "broken", {"initialize": {"steps": [{"step": "exit", "code": 3, "stderr": "no API key"}]}}
    )
    fine = scenario_dir(tmp_path, "fine", ECHO)
    provider = provider_for(stub_agent_argv("scenario.json"), tmp_path, max_concurrent=1)
    async with service_with(provider) as (service, events):
        failing = service.start("acp", SubagentRequest(prompt="a", cwd=broken))
        waiting = service.start("acp", SubagentRequest(prompt="b", cwd=fine))
        with anyio.fail_after(WAIT):
            with pytest.raises(SubagentError) as caught:
                await failing.started()
            assert await waiting.result() == SubagentResult(output="done: b", stop_reason="completed")
        assert caught.value.code == ErrorCode.START_FAILED
        assert "exited with status 3" in caught.value.message
    assert [run_id for _, run_id in events] == [waiting.id, waiting.id]


async def test_the_ready_timeout_counts_from_the_spawn_never_the_time_spent_queued(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    # The first child holds the only slot for longer than the ready timeout, by working that long. The
    # timeout itself is generous, so a loaded machine slow to start a child cannot run it out.
    slow_turn = {"turns": [[{"step": "sleep", "seconds": 6}, {"step": "message", "text": "slow"}]]}
    provider = provider_for(stub_agent_command(slow_turn), tmp_path, max_concurrent=1, ready_timeout=5.0)
    async with service_with(provider) as (service, _):
        queued_at = time.monotonic()
        holder = service.start("acp", SubagentRequest(prompt="holder"))
        waiting = service.start("acp", SubagentRequest(prompt="waiting"))
        assert acp(waiting).queued
        with anyio.fail_after(WAIT):
            assert (await holder.result()).output == "slow"  # its turn is over: the slot moves on
            await waiting.started()  # ready, though queued for longer than the ready timeout
        assert time.monotonic() - queued_at > provider.ready_timeout
        assert waiting.state in (RunState.RUNNING, RunState.ENDED)


# -- configuration -----------------------------------------------------------------------------------------


def test_the_default_limit_is_the_documented_constant() -> None:
    assert DEFAULT_MAX_CONCURRENT == 8
    provider = AcpProvider(["agent"])
    assert (provider.max_concurrent, provider.running, provider.waiting) == (8, 0, 0)


@pytest.mark.parametrize("limit", [0, -1, True, 2.5, "4"])
def test_a_limit_that_is_not_a_positive_int_is_refused(limit: Any) -> None:
    with pytest.raises(ValueError, match="max_concurrent"):
        AcpProvider(["agent"], max_concurrent=limit)
