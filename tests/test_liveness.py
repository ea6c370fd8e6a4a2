"""Liveness of long ACP turns: progress heartbeats from the service, and an inactivity timeout that
counts only the child's silence, never the time it waits on a permission answer."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import (
    ObservableRun,
    QueueableRun,
    SubagentProgressInfo,
    SubagentRequest,
    SubagentResult,
    SubagentService,
)
from subagent.acp.handlers import PermissionQuestion
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.leaks import assert_no_leaks

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

WAIT = 20  # seconds: a bound on a whole test step, never a sleep
BEAT = 0.05  # seconds between heartbeats: short, so the tests see many of them quickly
FAST = {"stdin_close_timeout": 1.0, "sigterm_timeout": 1.0, "sigkill_timeout": 2.0}


def provider_for(command: list[str], tmp_path: Path, **options: Any) -> AcpProvider:
    options.setdefault("process_options", FAST)
    return AcpProvider(command, cwd=tmp_path, **options)


@dataclasses.dataclass
class Beat:
    """One `subagent/progress` event and what the run said when it arrived."""

    info: SubagentProgressInfo
    received_at: float
    last_activity: float | None
    pending_permissions: int


class Timeline:
    """Records start, progress and end of ACP runs, in order."""

    def __init__(self, service: SubagentService) -> None:
        self.events: list[str] = []
        self.beats: list[Beat] = []
        self._runs: dict[str, AcpRun] = {}
        self._arrived = anyio.Event()
        service.events.on("subagent/start", lambda info: self.events.append("start"))
        service.events.on("subagent/end", lambda info: self.events.append("end"))
        service.events.on("subagent/progress", self._on_progress)

    def watch(self, run: AcpRun) -> None:
        self._runs[run.id] = run

    def _on_progress(self, info: SubagentProgressInfo) -> None:
        run = self._runs[info.id]
        self.beats.append(Beat(info, time.monotonic(), run.last_activity, run.pending_permissions))
        self.events.append("progress")
        self._arrived.set()

    async def wait_for(self, condition: Callable[[list[Beat]], bool]) -> None:
        """Return once `condition(beats)` holds, re-checked at each heartbeat (bounded by the caller)."""
        while not condition(self.beats):
            self._arrived = anyio.Event()
            await self._arrived.wait()


def asking(beats: list[Beat]) -> list[Beat]:
    return [beat for beat in beats if beat.info.waiting_on_permission]


async def test_an_acp_run_exposes_its_liveness_and_whether_it_is_queued(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    provider = provider_for(stub_agent_command({"turns": [[{"step": "message", "text": "hi"}]]}), tmp_path)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
            assert isinstance(acp_run, ObservableRun)
            assert isinstance(acp_run, QueueableRun)
            assert (acp_run.last_activity, acp_run.pending_permissions, acp_run.update_count) == (None, 0, 0)
            before = time.monotonic()
            with anyio.fail_after(WAIT):
                await run.result()
            assert acp_run.last_activity is not None
            assert acp_run.last_activity > before
            assert (acp_run.pending_permissions, acp_run.update_count, acp_run.queued) == (0, 1, False)


async def test_progress_of_an_acp_turn_flags_the_permission_wait_and_restarts_the_idle_clock_on_activity(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    answer = anyio.Event()

    async def human(question: PermissionQuestion) -> str | None:
        await answer.wait()
        return "allow"

    command = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "message", "text": "reading"},
                    {"step": "tool_call", "toolCallId": "c1", "title": "edit", "kind": "edit"},
                    {"step": "permission", "branches": {"allow": [{"step": "message", "text": "edited. "}]}},
                    # Thinking, silently, until the test has seen a heartbeat of the silence and cancels
                    # (a sleep could pass unobserved on a loaded machine).
                    {"step": "wait_for_cancel"},
                ]
            ]
        }
    )
    provider = provider_for(command, tmp_path, permission=human)
    async with assert_no_leaks(), SubagentService(progress_interval=BEAT) as service:
        service.register_provider(provider)
        timeline = Timeline(service)
        async with service.start("acp", SubagentRequest(prompt="edit it")) as run:
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
            timeline.watch(acp_run)
            with anyio.fail_after(WAIT):
                await timeline.wait_for(lambda beats: len(asking(beats)) >= 3)
            waiting = asking(timeline.beats)[:3]
            assert [beat.info.updates for beat in waiting] == [2, 2, 2]  # the message and the tool call
            assert [beat.pending_permissions for beat in waiting] == [1, 1, 1]
            assert waiting[0].info.idle_seconds < waiting[1].info.idle_seconds < waiting[2].info.idle_seconds
            assert waiting[2].info.describe().startswith("waiting on a permission answer for ")

            answer.set()
            with anyio.fail_after(WAIT):
                await timeline.wait_for(lambda beats: any(beat.info.updates >= 3 for beat in beats))
                await run.cancel()
                result = await run.result()
            beats_at_end = len(timeline.beats)
        assert result == SubagentResult(output="edited. ", stop_reason="cancelled")

    assert timeline.events[0] == "start"
    assert timeline.events[-1] == "end"
    assert timeline.events.count("progress") == beats_at_end  # none after the end
    answered = [beat for beat in timeline.beats if beat.info.updates >= 3]
    assert answered  # the silent stretch after the answer was observed
    assert not any(beat.info.waiting_on_permission for beat in answered)
    assert answered[-1].info.describe().startswith("child alive, last update ")
    for index, beat in enumerate(timeline.beats):
        # Idle time is always measured from the run's last sign of life, so every update restarts it. The
        # service read its clock between the previous heartbeat's delivery (listeners run synchronously)
        # and this one's, which bounds the idle time it reported whatever the machine's load.
        assert beat.last_activity is not None
        assert beat.info.idle_seconds <= beat.received_at - beat.last_activity
        if index > 0:
            assert beat.info.idle_seconds >= timeline.beats[index - 1].received_at - beat.last_activity
    assert answered[0].last_activity is not None
    assert waiting[-1].last_activity is not None
    assert answered[0].last_activity > waiting[-1].last_activity


async def test_a_long_permission_wait_followed_by_silence_times_out_counting_from_the_answer(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    # The child must send its tool call within this inactivity timeout of the prompt: short enough to keep
    # the test quick, long enough for a child on a loaded machine.
    timeout = 1.5
    moments: dict[str, float] = {}

    async def slow_human(question: PermissionQuestion) -> str | None:
        moments["asked"] = time.monotonic()
        await anyio.sleep(2 * timeout)  # a person taking longer than the inactivity timeout to answer
        moments["answered"] = time.monotonic()
        return "allow"

    command = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "tool_call", "toolCallId": "c1", "title": "edit", "kind": "edit"},
                    # After the answer the child goes silent until it is cancelled.
                    {"step": "permission", "branches": {"allow": [{"step": "wait_for_cancel"}]}},
                ]
            ]
        }
    )
    provider = provider_for(command, tmp_path, permission=slow_human)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start("acp", SubagentRequest(prompt="edit it", timeout=timeout)) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
            ended = time.monotonic()
    assert result == SubagentResult(output="", stop_reason="timeout", error="inactive for more than 1.5 s")
    assert moments["answered"] - moments["asked"] >= 2 * timeout  # the wait alone outlasted the timeout
    assert ended - moments["answered"] >= timeout  # yet the timeout counted only the silence after it
