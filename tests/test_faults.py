"""A fault battery: real ACP children (the stub agent) broken one way at one phase, through the public API.

Each case checks the exact outcome the caller sees (``START_FAILED`` or an ``error`` result whose message
names what happened: the signal, the stderr tail, "closed its stdout"; or a turn that completes despite the
fault) and that nothing is left behind: no process, no file descriptor (``assert_no_leaks``), no task
(``anyio.get_running_tasks()`` before and after). Every wait is bounded; nothing sleeps to wait for
something. Our client's request ids are predictable: initialize is 0, session/new 1, the first prompt 2.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import ctypes.util
import json
import logging
import math
import os
import shlex
import signal
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import pytest

import subagent.acp.client
import subagent.acp.connection
from subagent import (
    ErrorCode,
    ResumableRun,
    RunState,
    ServiceRun,
    SubagentError,
    SubagentRequest,
    SubagentResult,
    SubagentRunEndInfo,
    SubagentRunInfo,
    SubagentService,
)
from subagent.acp import (
    AgentExitedError,
    MalformedMessageError,
    MessageTooLargeError,
    ProtocolError,
    RequestError,
    UnexpectedResponseError,
    schema,
)
from subagent.acp.client import TurnResult, spawn_agent
from subagent.acp.connection import DEFAULT_MAX_LINE_BYTES
from subagent.acp.handlers import PermissionQuestion
from subagent.acp.transports import AgentProcess, TeardownStep
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.leaks import assert_no_leaks, process_is_gone

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

WAIT = 20  # seconds: bounds a whole case; a hang fails the test instead of the suite
SHORT_GRACE = 0.5
"""A teardown step's grace for a child that ignores that step: it always runs out, so its length decides no
outcome, only how long the test takes."""
GENEROUS_GRACE = 30.0
"""A teardown step's grace for a child that honours that step: it ends the moment the child is gone, so it
costs nothing, and a loaded machine slow to run the child's exit cannot turn one step into the next."""
MIB = 1024 * 1024


# -- helpers ---------------------------------------------------------------------------------------------


def running_task_ids() -> set[int]:
    return {task.id for task in anyio.get_running_tasks()}


@dataclass
class Lifecycle:
    """The ``subagent/start`` and ``subagent/end`` events, in order."""

    events: list[tuple[str, SubagentRunInfo | SubagentRunEndInfo]] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.events]

    def ends(self) -> dict[str, SubagentRunEndInfo]:
        return {info.id: info for _, info in self.events if isinstance(info, SubagentRunEndInfo)}

    def starts(self) -> list[str]:
        return [info.id for _, info in self.events if isinstance(info, SubagentRunInfo)]


@asynccontextmanager
async def open_service(*providers: AcpProvider) -> AsyncIterator[tuple[SubagentService, Lifecycle]]:
    """An open service with ``providers``, recording lifecycle events. Once closed, no process, file
    descriptor or task may be left."""
    lifecycle = Lifecycle()
    async with assert_no_leaks():
        before = running_task_ids()
        async with SubagentService() as service:
            for provider in providers:
                service.register_provider(provider)
            service.events.on("subagent/start", lambda info: lifecycle.events.append(("start", info)))
            service.events.on("subagent/end", lambda info: lifecycle.events.append(("end", info)))
            yield service, lifecycle
        assert running_task_ids() == before


def teardown_options(argv: list[str]) -> dict[str, float]:
    """Teardown graces for the stub agent `argv` runs: short for each step its scenario ignores (stdin EOF,
    SIGTERM, in the agent or in a grandchild), generous for each step it honours."""
    scenario: dict[str, Any] = {}
    if "--scenario" in argv:
        scenario = json.loads(Path(argv[argv.index("--scenario") + 1]).read_text(encoding="utf-8"))
    grandchild_ignores_sigterm = any(
        step.get("ignoreSigterm", True)
        for step in scenario_steps(scenario)
        if step.get("step") == "grandchild"
    )
    return {
        "stdin_close_timeout": SHORT_GRACE if scenario.get("onStdinEof") == "ignore" else GENEROUS_GRACE,
        "sigterm_timeout": (
            SHORT_GRACE if scenario.get("ignoreSigterm") or grandchild_ignores_sigterm else GENEROUS_GRACE
        ),
        "sigkill_timeout": GENEROUS_GRACE,
    }


def scenario_steps(node: object) -> Iterator[dict[str, Any]]:
    """Every step object anywhere in a scenario (turns, branches, handshake steps)."""
    if isinstance(node, dict):
        if "step" in node:
            yield node
        for value in node.values():
            yield from scenario_steps(value)
    elif isinstance(node, list):
        for item in node:
            yield from scenario_steps(item)


def acp_provider(argv: list[str], tmp_path: Path, **options: Any) -> AcpProvider:
    options.setdefault("process_options", teardown_options(argv))
    return AcpProvider(argv, cwd=tmp_path, **options)


def acp_run(run: ServiceRun) -> AcpRun:
    child = run.provider_run
    assert isinstance(child, AcpRun)
    return child


def child_pid(run: ServiceRun) -> int:
    pid = acp_run(run).pid
    assert pid is not None
    return pid


def killed_message(argv: list[str], pid: int, signum: signal.Signals, stderr: str) -> str:
    """What a child killed by ``signum`` (not by our teardown) is reported as."""
    return (
        f"agent `{shlex.join(argv)}` (pid {pid}) was killed by {signum.name} (signal {signum.value}); "
        f"last stderr: {stderr}"
    )


def closed_stdout_message(argv: list[str], pid: int, stderr: str) -> str:
    """What a child that closed its stdout but lives on is reported as."""
    return (
        f"agent `{shlex.join(argv)}` (pid {pid}) closed its stdout but is still running; "
        f"last stderr: {stderr}"
    )


async def first_update(run: AcpRun) -> None:
    """Return once the run has received a session update."""
    arrived = anyio.Event()
    dispose = run.on_update(lambda update: arrived.set())
    try:
        if not run.updates:
            await arrived.wait()
    finally:
        dispose()


def texts(updates: Iterable[schema.SessionUpdate]) -> list[str]:
    return [
        update.content.text
        for update in updates
        if isinstance(update, schema.AgentMessageChunk) and isinstance(update.content, schema.TextContent)
    ]


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``VmHWM``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def pin_malloc_mmap_threshold() -> None:
    """Fix glibc's mmap threshold at its initial 128 KiB for the rest of this process.

    glibc raises the threshold (up to 32 MiB) each time a large mmapped block is freed, so after other
    tests a growing buffer lives on the heap until it crosses the raised threshold, and that one realloc
    copies it: up to 32 MiB more at the peak, depending on which tests ran before (measured: 109.5 MiB
    instead of 64 MiB for a 64 MiB line buffer after a 30 MiB block was freed). Pinned, a large buffer
    is mmapped early and grows by mremap, so the peak measures what the reader holds, as in a fresh
    process. Not glibc: nothing to pin.
    """
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    mallopt = getattr(ctypes.CDLL(libc_name), "mallopt", None)
    if mallopt is not None:
        mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; setting it also turns the dynamic adjustment off


def reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0), so that the growth measured is this case's."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


# -- killed by a signal ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scenario", "signum"),
    [
        pytest.param(
            {"initialize": {"steps": [{"step": "stderr", "text": "loading the model\n"}, {"step": "kill"}]}},
            signal.SIGKILL,
            id="before initialize answers",
        ),
        pytest.param(
            {
                "requireAuth": "api-key",
                "authenticate": {
                    "steps": [
                        {"step": "stderr", "text": "loading the model\n"},
                        {"step": "kill", "signal": "SIGINT"},
                    ]
                },
            },
            signal.SIGINT,
            id="during authenticate",
        ),
        pytest.param(
            {
                "newSession": {
                    "steps": [
                        {"step": "stderr", "text": "loading the model\n"},
                        {"step": "kill", "signal": "SIGTERM"},
                    ]
                }
            },
            signal.SIGTERM,
            id="during session/new",
        ),
    ],
)
async def test_a_child_killed_by_a_signal_before_it_is_ready_fails_the_start_naming_the_signal_and_stderr(
    stub_agent_command: StubAgentCommand, tmp_path: Path, scenario: dict[str, Any], signum: signal.Signals
) -> None:
    argv = stub_agent_command(scenario)
    provider = acp_provider(argv, tmp_path, auth_method="api-key")
    async with open_service(provider) as (service, lifecycle):
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
        pid = child_pid(run)
        assert process_is_gone(pid)
    assert caught.value.code is ErrorCode.START_FAILED
    assert caught.value.message == killed_message(argv, pid, signum, "loading the model")
    exit_info = acp_run(run).exit_info
    assert exit_info is not None
    assert (exit_info.killed_by, exit_info.teardown_signal) == (signum, None)
    assert lifecycle.names == []  # a run that never became ready announces nothing
    assert run.state is RunState.DISPOSED


async def test_a_child_killed_mid_stream_ends_the_turn_with_an_error_naming_the_signal_and_keeps_the_output(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "message", "text": "The answer is", "chunks": 3},
                    {"step": "stderr", "text": "Out of memory: killed\n"},
                    {"step": "kill", "signal": "SIGKILL"},
                ]
            ]
        }
    )
    async with open_service(acp_provider(argv, tmp_path)) as (service, lifecycle):
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            assert isinstance(run, ResumableRun)
            with anyio.fail_after(WAIT):
                result = await run.result()
                again = await run.resume("are you still there?")  # a dead child: at once, no hang
        pid = child_pid(run)
        assert process_is_gone(pid)
    error = killed_message(argv, pid, signal.SIGKILL, "Out of memory: killed")
    assert result == SubagentResult(output="The answer is", stop_reason="error", error=error)
    assert again == SubagentResult(output="", stop_reason="error", error=error)
    assert texts(acp_run(run).updates) == ["The a", "nswe", "r is"]
    assert lifecycle.names == ["start", "end"]
    assert lifecycle.ends()[run.id] == SubagentRunEndInfo(
        id=run.id, provider="acp", stop_reason="error", last_assistant_message="The answer is", error=error
    )


PERMISSION_PENDING: Final = {
    "turns": [
        [
            {"step": "tool_call", "toolCallId": "c1", "title": "Edit config", "kind": "edit"},
            {"step": "message", "text": "I need to edit the config."},
            {"step": "stderr", "text": "waiting for permission\n"},
            {"step": "permission", "branches": {"allow": [{"step": "message", "text": "edited"}]}},
        ]
    ]
}
"""A turn that asks permission for tool call ``c1`` after a message and a stderr line, and waits."""


async def test_a_child_killed_while_its_permission_question_is_pending_ends_the_turn_with_an_error(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(PERMISSION_PENDING)
    runs: list[ServiceRun] = []
    asked: list[str] = []
    withdrawn = anyio.Event()

    async def kill_the_child_while_deciding(question: PermissionQuestion) -> str | None:
        asked.append(question.tool_call_id)
        os.kill(child_pid(runs[0]), signal.SIGKILL)
        try:
            await anyio.sleep_forever()  # the question stays pending while the child dies
        finally:
            withdrawn.set()
        return "allow"

    provider = acp_provider(argv, tmp_path, permission=kill_the_child_while_deciding)
    async with open_service(provider) as (service, lifecycle):
        async with service.start("acp", SubagentRequest(prompt="edit it")) as run:
            runs.append(run)
            with anyio.fail_after(WAIT):
                result = await run.result()
        pid = child_pid(run)
        assert process_is_gone(pid)
    error = killed_message(argv, pid, signal.SIGKILL, "waiting for permission")
    assert result == SubagentResult(output="I need to edit the config.", stop_reason="error", error=error)
    assert asked == ["c1"]
    assert withdrawn.is_set()  # the pending question was withdrawn, not left waiting
    assert lifecycle.names == ["start", "end"]


# -- stdout closed, the child alive ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scenario", "teardown_signal"),
    [
        pytest.param(
            {
                "initialize": {
                    "steps": [{"step": "stderr", "text": "closing stdout\n"}, {"step": "close_stdout"}]
                },
                "onStdinEof": "ignore",
            },
            signal.SIGTERM,
            id="during initialize",
        ),
        pytest.param(
            {
                "newSession": {
                    "steps": [{"step": "stderr", "text": "closing stdout\n"}, {"step": "close_stdout"}]
                },
                "onStdinEof": "ignore",
                "ignoreSigterm": True,
            },
            signal.SIGKILL,
            id="during session/new",
        ),
    ],
)
async def test_a_child_closing_stdout_before_it_is_ready_fails_the_start_fast_and_is_torn_down_by_escalation(
    stub_agent_command: StubAgentCommand,
    tmp_path: Path,
    scenario: dict[str, Any],
    teardown_signal: signal.Signals,
) -> None:
    # "Fast" is an outcome, not a duration: the child ignores stdin EOF (and maybe SIGTERM) and lives until
    # teardown, which begins only once the start has failed; an error that waited for its exit would hang.
    argv = stub_agent_command(scenario)
    provider = acp_provider(argv, tmp_path)
    async with open_service(provider) as (service, lifecycle):
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
            assert acp_run(run).exit_info is None  # still alive: the error did not wait for an exit
        pid = child_pid(run)
        assert process_is_gone(pid)
    assert caught.value.code is ErrorCode.START_FAILED
    assert caught.value.message == closed_stdout_message(argv, pid, "closing stdout")
    exit_info = acp_run(run).exit_info
    assert exit_info is not None
    assert (exit_info.killed_by, exit_info.teardown_signal) == (teardown_signal, teardown_signal)
    assert lifecycle.names == []


async def test_a_child_closing_stdout_mid_turn_ends_the_turn_fast_with_an_error_and_is_torn_down_by_sigkill(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "message", "text": "last words"},
                    {"step": "stderr", "text": "closing stdout\n"},
                    {"step": "close_stdout"},
                ]
            ],
            "onStdinEof": "ignore",
            "ignoreSigterm": True,
        }
    )
    async with open_service(acp_provider(argv, tmp_path)) as (service, lifecycle):
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            assert isinstance(run, ResumableRun)
            with anyio.fail_after(WAIT):
                result = await run.result()
                # Alive: the turn ended without waiting for an exit that only teardown brings.
                alive_when_it_ended = acp_run(run).exit_info is None
                again = await run.resume("hello?")
        pid = child_pid(run)
        assert process_is_gone(pid)
    error = closed_stdout_message(argv, pid, "closing stdout")
    assert result == SubagentResult(output="last words", stop_reason="error", error=error)
    assert again == SubagentResult(output="", stop_reason="error", error=error)
    assert alive_when_it_ended
    exit_info = acp_run(run).exit_info
    assert exit_info is not None
    assert (exit_info.killed_by, exit_info.teardown_signal) == (signal.SIGKILL, signal.SIGKILL)
    assert lifecycle.names == ["start", "end"]


async def test_stdout_eof_without_exit_during_initialize_is_a_typed_error_at_once_and_teardown_escalates(
    stub_agent_command: StubAgentCommand,
) -> None:
    argv = stub_agent_command(
        {
            "initialize": {
                "steps": [{"step": "stderr", "text": "closing stdout\n"}, {"step": "close_stdout"}]
            },
            "onStdinEof": "ignore",
            "ignoreSigterm": True,
        }
    )
    async with assert_no_leaks(), spawn_agent(argv, process_options=teardown_options(argv)) as client:
        assert isinstance(client.process, AgentProcess)  # a local child: its pid is known
        with anyio.fail_after(WAIT), pytest.raises(AgentExitedError) as caught:
            await client.initialize()
        report = await client.process.aclose()
        exit_info = client.process.exit_info()
        pid = client.process.pid
    assert caught.value.exit_info is None  # it had not exited: the error did not wait for it
    assert str(caught.value) == closed_stdout_message(argv, pid, "closing stdout")
    assert report.steps == (TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM, TeardownStep.SIGKILL)
    assert report.group_gone
    assert exit_info is not None
    assert exit_info.killed_by is signal.SIGKILL
    assert process_is_gone(pid)


async def test_a_child_that_closed_stdout_mid_turn_is_let_go_at_once_freeing_its_slot_for_a_waiting_run(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    # Like a dead child, a child whose connection is lost can never take another turn: holding it (and
    # its concurrency slot) until someone disposes the run only starves the runs queued behind it.
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "message", "text": "last words"},
                    {"step": "stderr", "text": "closing stdout\n"},
                    {"step": "close_stdout"},
                ]
            ],
            "onStdinEof": "ignore",
        }
    )
    provider = acp_provider(argv, tmp_path, max_concurrent=1)
    async with open_service(provider) as (service, _):
        first = service.start("acp", SubagentRequest(prompt="one"))
        assert isinstance(first, ResumableRun)
        with anyio.fail_after(WAIT):
            lost = await first.result()
        second = service.start("acp", SubagentRequest(prompt="two"))
        # The first run is not disposed: its turn ended with the lost connection, which freed the slot.
        with anyio.fail_after(WAIT):  # the first run still holds its child: a held slot would hang here
            await second.started()
        first_pid = child_pid(first)
        with anyio.fail_after(WAIT):
            acp_first = first.provider_run
            assert isinstance(acp_first, AcpRun)
            await acp_first.wait_child_exited()  # let go without anyone disposing the run
        assert process_is_gone(first_pid)
        with anyio.fail_after(WAIT):
            again = await first.resume("hello?")
        assert first.state is RunState.ENDED
    error = closed_stdout_message(argv, first_pid, "closing stdout")
    assert lost == SubagentResult(output="last words", stop_reason="error", error=error)
    assert again == SubagentResult(output="", stop_reason="error", error=error)


# -- a broken wire, a turn that goes on ------------------------------------------------------------------

_CHUNK_WITH_INVALID_UTF8 = (
    b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"session-1","update":'
    b'{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"caf\xe9"}}}}'
)
_UNKNOWN_METHOD_REPORT = json.dumps(
    {
        "method": "_vendor/telemetry",
        "error": {"code": -32601, "message": "Method not found", "data": {"method": "_vendor/telemetry"}},
    },
    separators=(",", ":"),
)


@dataclass(frozen=True)
class WireFault:
    steps: list[dict[str, Any]]
    protocol_errors: list[ProtocolError]
    """What the connection must report (and log), in order."""
    chunks: list[str] = field(default_factory=list)
    """Message chunks the fault itself adds to the turn."""
    client_warning: str | None = None
    """A warning the client must log instead of a protocol error."""

    def scenario(self) -> dict[str, Any]:
        """One turn with this fault between a message before and a message after, ending ``end_turn``."""
        return {
            "turns": [
                [
                    {"step": "message", "text": "before"},
                    *self.steps,
                    {"step": "message", "text": "after"},
                    {"step": "stop", "reason": "end_turn"},
                ]
            ]
        }

    def check_turn(
        self,
        result: TurnResult,
        reported: list[ProtocolError],
        caplog: pytest.LogCaptureFixture,
        pid: int | None,
    ) -> None:
        """`scenario`'s turn completed with every chunk, and the fault was reported and logged exactly once,
        under the connection named after ``pid``."""
        assert result.stop_reason == "end_turn"
        assert texts(result.updates) == ["before", *self.chunks, "after"]
        assert described(reported) == described(self.protocol_errors)
        connection_warnings = [
            record.getMessage() for record in caplog.records if record.name == "subagent.acp.connection"
        ]
        assert connection_warnings == [f"acp:{pid}: {error}" for error in self.protocol_errors]
        client_warnings = [
            record.getMessage() for record in caplog.records if record.name == "subagent.acp.client"
        ]
        assert client_warnings == ([] if self.client_warning is None else [self.client_warning])


WIRE_FAULTS = {
    "a response with a wrong id": WireFault(
        [{"step": "raw", "text": '{"jsonrpc":"2.0","id":999,"result":{}}\n'}],
        [UnexpectedResponseError(999)],
    ),
    "an error response with a null id": WireFault(
        [
            {
                "step": "raw",
                "text": '{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error"}}\n',
            }
        ],
        [UnexpectedResponseError(None, RequestError(-32700, "Parse error"))],
    ),
    "a duplicate response to session/new": WireFault(
        [{"step": "raw", "text": '{"jsonrpc":"2.0","id":1,"result":{"sessionId":"session-1"}}\n'}],
        [UnexpectedResponseError(1)],
    ),
    "an update for another session": WireFault(
        [
            {
                "step": "update",
                "sessionId": "session-elsewhere",
                "update": {
                    "sessionUpdate": "agent_message_chunk",
                    "content": {"type": "text", "text": "not yours"},
                },
            }
        ],
        [],
        client_warning="ignoring an update for unknown session 'session-elsewhere'",
    ),
    "a request for an unknown method": WireFault(
        [{"step": "call", "method": "_vendor/telemetry", "params": {"event": "start"}}],
        [],
        chunks=[_UNKNOWN_METHOD_REPORT],
    ),
    "invalid UTF-8": WireFault(
        [{"step": "raw", "base64": base64.b64encode(_CHUNK_WITH_INVALID_UTF8 + b"\n").decode()}],
        [MalformedMessageError("not UTF-8", _CHUNK_WITH_INVALID_UTF8[:120])],
    ),
}


def described(errors: list[ProtocolError]) -> list[tuple[type[ProtocolError], str]]:
    return [(type(error), str(error)) for error in errors]


@pytest.mark.parametrize("fault", list(WIRE_FAULTS.values()), ids=list(WIRE_FAULTS))
async def test_a_wire_fault_mid_turn_is_skipped_or_answered_and_reported_and_the_turn_completes(
    stub_agent_command: StubAgentCommand, tmp_path: Path, caplog: pytest.LogCaptureFixture, fault: WireFault
) -> None:
    argv = stub_agent_command(fault.scenario())
    reported: list[ProtocolError] = []
    caplog.set_level(logging.WARNING)
    async with (
        assert_no_leaks(),
        spawn_agent(
            argv, process_options=teardown_options(argv), on_protocol_error=reported.append
        ) as client,
    ):
        with anyio.fail_after(WAIT):
            await client.initialize()
            session = await client.new_session(tmp_path)
            result: TurnResult = await session.prompt("go")
        statistics = client.connection.statistics()
        assert client.process is not None
        pid = client.process.pid
    fault.check_turn(result, reported, caplog, pid)
    assert statistics.protocol_errors == len(fault.protocol_errors)


async def test_every_wire_fault_in_one_turn_leaves_the_run_completed_with_the_exact_output(
    stub_agent_command: StubAgentCommand, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    faults = list(WIRE_FAULTS.values())
    steps = [step for fault in faults for step in [*fault.steps, {"step": "message", "text": "|"}]]
    argv = stub_agent_command({"turns": [[{"step": "message", "text": "before"}, *steps]]})
    caplog.set_level(logging.WARNING)
    async with (
        open_service(acp_provider(argv, tmp_path)) as (service, lifecycle),
        service.start("acp", SubagentRequest(prompt="go")) as run,
    ):
        with anyio.fail_after(WAIT):
            result = await run.result()
        pid = child_pid(run)
    expected_chunks = ["before"] + [chunk for fault in faults for chunk in [*fault.chunks, "|"]]
    assert result == SubagentResult(output="".join(expected_chunks), stop_reason="completed")
    assert texts(acp_run(run).updates) == expected_chunks
    expected_errors = [error for fault in faults for error in fault.protocol_errors]
    connection_warnings = [
        record.getMessage() for record in caplog.records if record.name == "subagent.acp.connection"
    ]
    assert connection_warnings == [f"acp:{pid}: {error}" for error in expected_errors]
    assert lifecycle.names == ["start", "end"]


@pytest.mark.parametrize(
    "max_line_bytes", [DEFAULT_MAX_LINE_BYTES, 8 * MIB], ids=["the default 64 MiB limit", "an 8 MiB limit"]
)
async def test_a_100_mib_line_is_discarded_with_memory_bounded_by_the_line_limit_and_the_turn_goes_on(
    stub_agent_command: StubAgentCommand,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    max_line_bytes: int,
) -> None:
    size = 100 * MIB
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "message", "text": "before "},
                    {"step": "huge_line", "bytes": size},
                    {"step": "message", "text": "after"},
                ]
            ]
        }
    )
    caplog.set_level(logging.WARNING)
    pin_malloc_mmap_threshold()
    async with open_service(acp_provider(argv, tmp_path, max_line_bytes=max_line_bytes)) as (service, _):
        reset_peak_rss()
        baseline = peak_rss_bytes()
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
        growth = peak_rss_bytes() - baseline
        pid = child_pid(run)
    assert result == SubagentResult(output="before after", stop_reason="completed")
    assert texts(acp_run(run).updates) == ["before ", "after"]
    too_large = MessageTooLargeError(size, max_line_bytes)
    reports = [record.getMessage() for record in caplog.records if record.name == "subagent.acp.connection"]
    assert reports == [
        f"acp:{pid}: discarding a line longer than {max_line_bytes} bytes",
        f"acp:{pid}: {too_large}",
    ]
    # A line is held until its newline or the limit, whichever comes first (a line just under the limit
    # must be parsed whole), so the limit, never the line, bounds what reading it costs.
    assert growth < max_line_bytes + 8 * MIB, (
        f"peak RSS grew by {growth / MIB:.1f} MiB reading a {size // MIB} MiB line "
        f"with a {max_line_bytes // MIB} MiB limit"
    )


# -- the caller cancelled --------------------------------------------------------------------------------

CANCEL_POINT = "cancel point"
_BUSY_TURN = [{"step": "message", "text": "one two three four", "chunks": 4}, {"step": "hang"}]


@dataclass(frozen=True)
class CancelPhase:
    scenario: dict[str, Any]
    ready: bool
    """Whether the child became ready before the caller was cancelled."""
    returncode: int
    """How the child ends after the disposal: 0 when it exits on stdin EOF, -15 when SIGTERM was needed."""


CANCEL_PHASES = {
    "while waiting for started, before the child exists": CancelPhase({}, ready=False, returncode=0),
    "during initialize": CancelPhase(
        {"initialize": {"steps": [{"step": "stderr", "text": f"{CANCEL_POINT}\n"}, {"step": "hang"}]}},
        ready=False,
        returncode=0,
    ),
    "during session/new": CancelPhase(
        {"newSession": {"steps": [{"step": "stderr", "text": f"{CANCEL_POINT}\n"}, {"step": "hang"}]}},
        ready=False,
        returncode=0,
    ),
    "mid-stream": CancelPhase({"turns": [_BUSY_TURN]}, ready=True, returncode=0),
    "during a permission question": CancelPhase(
        {
            "turns": [
                [
                    {"step": "tool_call", "toolCallId": "c1", "title": "rm -rf build", "kind": "execute"},
                    {"step": "permission"},
                ]
            ]
        },
        ready=True,
        returncode=0,
    ),
    "during result": CancelPhase(
        {"turns": [_BUSY_TURN], "onStdinEof": "ignore"}, ready=True, returncode=-signal.SIGTERM
    ),
}


@dataclass
class PhaseCaller:
    """The caller of one `CANCEL_PHASES` case, whatever the transport: it cancels itself where the phase
    says (give the provider `on_stderr_line` and `permission`), and `drive` follows the run to there."""

    phase: str
    caller: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    run: ServiceRun | None = None
    child: AcpRun | None = None

    @property
    def spec(self) -> CancelPhase:
        return CANCEL_PHASES[self.phase]

    def on_stderr_line(self, line: str) -> None:
        if line == CANCEL_POINT:
            self.caller.cancel()

    async def permission(self, question: PermissionQuestion) -> str | None:
        self.caller.cancel()
        await anyio.sleep_forever()
        return "allow"

    async def drive(self, service: SubagentService, wait: float = WAIT) -> tuple[ServiceRun, AcpRun]:
        """Start the run and follow it until the caller is cancelled at the phase; the run and its child."""
        with anyio.fail_after(wait), self.caller:
            if self.phase == "while waiting for started, before the child exists":
                self.caller.cancel()
            async with service.start("acp", SubagentRequest(prompt="go")) as run:
                self.run, self.child = run, acp_run(run)
                child = self.child
                if self.phase == "mid-stream":
                    # The caller follows the stream and gives up after two chunks.
                    send, receive = anyio.create_memory_object_stream[schema.SessionUpdate](math.inf)
                    stop_following = child.on_update(send.send_nowait)
                    try:
                        with send, receive:
                            received = 0
                            async for _ in receive:
                                received += 1
                                if received == 2:
                                    self.caller.cancel()
                    finally:
                        stop_following()
                elif self.phase == "during result":
                    child.on_update(lambda update: self.caller.cancel() if len(child.updates) == 2 else None)
                    await run.result()
                elif self.spec.ready:
                    await run.result()
                else:
                    await run.started()
        assert self.caller.cancelled_caught
        assert self.run is not None
        assert self.child is not None
        assert self.run.state is RunState.DISPOSED
        return self.run, self.child

    def check_disposed(self, error: SubagentError, pid: int | None, lifecycle: Lifecycle) -> None:
        """The run's result error and its lifecycle events say it was disposed, and when."""
        run = self.run
        assert run is not None
        assert error.code is ErrorCode.DISPOSED
        if self.spec.ready:
            assert error.message == f"run {run.id!r} was disposed before its turn ended"
            assert lifecycle.names == ["start", "end"]
            assert lifecycle.ends()[run.id] == SubagentRunEndInfo(
                id=run.id,
                provider="acp",
                stop_reason=None,
                last_assistant_message=None,
                error=f"run {run.id!r} was disposed before its turn ended",
            )
        else:
            when = "before its agent was spawned" if pid is None else "before the agent was ready"
            assert error.message == f"run {run.id!r} was disposed {when}"
            assert lifecycle.names == []


@pytest.mark.parametrize("phase", list(CANCEL_PHASES), ids=list(CANCEL_PHASES))
async def test_cancelling_the_caller_at_any_phase_disposes_the_run_and_leaves_no_child_task_or_fd(
    stub_agent_command: StubAgentCommand, tmp_path: Path, phase: str
) -> None:
    caller = PhaseCaller(phase)
    argv = stub_agent_command(caller.spec.scenario)
    provider = acp_provider(
        argv, tmp_path, on_stderr_line=caller.on_stderr_line, permission=caller.permission
    )
    async with open_service(provider) as (service, lifecycle):
        tasks_before = running_task_ids()
        run, child = await caller.drive(service)
        assert running_task_ids() == tasks_before  # nothing of the run outlives the block
        pid = child.pid
        if phase == "while waiting for started, before the child exists":
            assert pid is None  # disposed before the spawn: no child ever existed
        else:
            assert pid is not None
            assert process_is_gone(pid)
            assert child.exit_info is not None
            assert child.exit_info.returncode == caller.spec.returncode
        with pytest.raises(SubagentError) as result_error:
            await run.result()
    caller.check_disposed(result_error.value, pid, lifecycle)


HOLD_UP = 60.0
"""A wait longer than any bound in these tests: a disposal that sat out a wait this long would show."""


@pytest.mark.parametrize("phase", ["mid-stream", "during a permission question"])
async def test_disposing_a_run_mid_turn_costs_no_more_than_a_cooperative_childs_own_exit(
    stub_agent_command: StubAgentCommand, tmp_path: Path, phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every wait a disposal could sit out (the turn's cancel grace, a session/cancel or $/cancel_request stuck
    # on a cancelled writer) is stretched to HOLD_UP: a disposal that waited on one takes a minute, however
    # fast or slow the machine, while one that closes stdin at once ends with the child's own exit.
    monkeypatch.setattr(subagent.acp.client, "CANCEL_NOTIFY_TIMEOUT", HOLD_UP)
    monkeypatch.setattr(subagent.acp.connection, "COURTESY_CANCEL_TIMEOUT", HOLD_UP)
    asked = anyio.Event()

    async def never_answer(question: PermissionQuestion) -> str | None:
        asked.set()
        await anyio.sleep_forever()
        return "allow"

    argv = stub_agent_command(CANCEL_PHASES[phase].scenario)
    provider = acp_provider(argv, tmp_path, permission=never_answer, cancel_grace=HOLD_UP)
    async with open_service(provider) as (service, _):
        run = service.start("acp", SubagentRequest(prompt="go"))
        with anyio.fail_after(WAIT):
            if phase == "mid-stream":
                await first_update(acp_run(run))
            else:
                await asked.wait()
        disposing_from = time.monotonic()
        await run.dispose()  # shielded: a hang guard could not cut it short, so its duration is measured
        disposal_took = time.monotonic() - disposing_from
        exit_info = acp_run(run).exit_info
        assert process_is_gone(child_pid(run))
    assert exit_info is not None
    assert (exit_info.returncode, exit_info.teardown_signal) == (0, None)  # it exited on stdin EOF
    assert disposal_took < HOLD_UP / 2, f"disposal took {disposal_took:.2f} s: it sat out a wait"


async def test_cancelling_a_caller_whose_run_is_queued_for_a_slot_disposes_it_without_ever_spawning_a_child(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command({"turns": [_BUSY_TURN]})
    provider = acp_provider(argv, tmp_path, max_concurrent=1)
    async with open_service(provider) as (service, lifecycle):
        holder = service.start("acp", SubagentRequest(prompt="first"))
        with anyio.fail_after(WAIT):
            await first_update(acp_run(holder))
        tasks_before = running_task_ids()
        with anyio.fail_after(WAIT), anyio.CancelScope() as caller:
            async with service.start("acp", SubagentRequest(prompt="second")) as queued:
                assert queued.state is RunState.QUEUED
                caller.cancel()
                await queued.started()
        assert caller.cancelled_caught
        assert running_task_ids() == tasks_before
        assert acp_run(queued).pid is None  # it never had a child
        assert (provider.running, provider.waiting) == (1, 0)
        assert holder.state is RunState.RUNNING  # the run holding the slot is untouched
        assert not process_is_gone(child_pid(holder))
        with pytest.raises(SubagentError) as caught:
            await queued.started()
    assert caught.value.code is ErrorCode.DISPOSED
    assert caught.value.message == f"run {queued.id!r} was disposed while it waited for a concurrency slot"
    assert lifecycle.starts() == [holder.id]


# -- the service closed with many live runs --------------------------------------------------------------

RUNS_PER_PHASE = 4
STUBBORN_SIGTERM_GRACE = 3.0
"""Long enough that the stubborn children's teardowns, if they run at once, all send SIGTERM before any
sends SIGKILL; one after another, each SIGKILL would come before the next SIGTERM."""


def teardown_signals(caplog: pytest.LogCaptureFixture, pids: set[int]) -> list[tuple[str, int]]:
    """The signals teardown sent to the agents `pids`, in order, from its log."""
    sent = []
    for record in caplog.records:
        if record.name == "subagent.acp.transports._local" and isinstance(record.args, tuple) and record.args:
            pid = record.args[0]
            if pid in pids and record.msg.endswith(("sending SIGTERM to its %s", "sending SIGKILL")):
                sent.append(("SIGKILL" if record.msg.endswith("SIGKILL") else "SIGTERM", pid))
    return sent


async def test_closing_the_service_with_20_live_runs_in_mixed_phases_tears_down_every_child_and_ends_each_run(
    stub_agent_command: StubAgentCommand, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="subagent.acp.transports._local")
    initializing = 0
    all_initializing = anyio.Event()
    asking = 0
    all_asking = anyio.Event()

    def count_initializing(line: str) -> None:
        nonlocal initializing
        if line == "initializing":
            initializing += 1
            if initializing == RUNS_PER_PHASE:
                all_initializing.set()

    async def never_answer(question: PermissionQuestion) -> str | None:
        nonlocal asking
        asking += 1
        if asking == RUNS_PER_PHASE:
            all_asking.set()
        await anyio.sleep_forever()
        return "allow"

    busy_turn = [{"step": "message", "text": "working"}, {"step": "hang"}]
    providers = [
        acp_provider(
            stub_agent_command(
                {"initialize": {"steps": [{"step": "stderr", "text": "initializing\n"}, {"step": "hang"}]}}
            ),
            tmp_path,
            name="starting",
            on_stderr_line=count_initializing,
        ),
        acp_provider(stub_agent_command({"turns": [busy_turn]}), tmp_path, name="streaming"),
        acp_provider(
            stub_agent_command(
                {
                    "turns": [
                        [{"step": "tool_call", "toolCallId": "c1", "title": "edit"}, {"step": "permission"}]
                    ]
                }
            ),
            tmp_path,
            name="asking",
            permission=never_answer,
        ),
        acp_provider(
            stub_agent_command({"turns": [[{"step": "message", "text": "done"}]]}), tmp_path, name="finished"
        ),
        acp_provider(
            stub_agent_command({"turns": [busy_turn], "onStdinEof": "ignore", "ignoreSigterm": True}),
            tmp_path,
            name="stubborn",
            process_options={
                "stdin_close_timeout": SHORT_GRACE,
                "sigterm_timeout": STUBBORN_SIGTERM_GRACE,
                "sigkill_timeout": GENEROUS_GRACE,
            },
        ),
    ]
    async with open_service(*providers) as (service, lifecycle):
        runs = [
            service.start(providers[index % len(providers)].name, SubagentRequest(prompt=f"job {index}"))
            for index in range(RUNS_PER_PHASE * len(providers))
        ]
        with anyio.fail_after(WAIT):
            await all_initializing.wait()
            await all_asking.wait()
            for run in runs:
                if run.provider in ("streaming", "stubborn"):
                    await first_update(acp_run(run))
                elif run.provider == "finished":
                    await run.result()
        assert len(service.live_runs) == 20
        pids = [child_pid(run) for run in runs]
        stubborn_pids = {child_pid(run) for run in runs if run.provider == "stubborn"}
    # The runs were torn down at once, not one after another: every stubborn child was sent SIGTERM before
    # any was sent SIGKILL.
    sent = teardown_signals(caplog, stubborn_pids)
    assert sorted(sent[:RUNS_PER_PHASE]) == sorted(("SIGTERM", pid) for pid in stubborn_pids)
    assert sorted(sent[RUNS_PER_PHASE:]) == sorted(("SIGKILL", pid) for pid in stubborn_pids)
    assert [pid for pid in pids if not process_is_gone(pid)] == []
    assert [run.state for run in runs] == [RunState.DISPOSED] * 20
    started = [run for run in runs if run.provider != "starting"]
    assert (lifecycle.names.count("start"), lifecycle.names.count("end")) == (len(started), len(started))
    assert sorted(lifecycle.starts()) == sorted(run.id for run in started)
    ends = lifecycle.ends()
    assert sorted(ends) == sorted(run.id for run in started)
    for run in started:
        if run.provider == "finished":
            expected = SubagentRunEndInfo(run.id, run.provider, "completed", "done", None)
        else:
            expected = SubagentRunEndInfo(
                run.id, run.provider, None, None, f"run {run.id!r} was disposed before its turn ended"
            )
        assert ends[run.id] == expected
    stubborn_exits = [acp_run(run).exit_info for run in runs if run.provider == "stubborn"]
    assert [info.killed_by if info else None for info in stubborn_exits] == [signal.SIGKILL] * RUNS_PER_PHASE
