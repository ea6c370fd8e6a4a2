"""The fault battery (test_faults.py, and the crashes, floods and teardowns of test_client_process.py)
over the SSH transport, against a real ``sshd`` on loopback, on asyncio and trio.

Each case asserts the outcome its local twin asserts, adapted where SSH differs: the agent's pid in a
message is the remote one (``pid N via ssh to HOST``), the run's `AcpRun.pid` is the local ssh client's,
and an agent that only teardown ends is reported as a lost connection (its status never comes back:
teardown ended ssh, and the remote supervisor then ended the agent). "Nothing left" is
`assert_no_leaks_over_ssh` (the remote agent carries the leak tag, passed in its environment: ours is
not forwarded) and no task left. Waits are for events, under ``anyio.fail_after`` as hang guards only.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import (
    ErrorCode,
    ResumableRun,
    RunState,
    SubagentError,
    SubagentRequest,
    SubagentResult,
    SubagentService,
)
from subagent.acp import schema
from subagent.acp.client import AcpClient, spawn_agent
from subagent.acp.errors import AgentExitedError, MessageTooLargeError, ProtocolError
from subagent.acp.handlers import PermissionQuestion
from subagent.acp.process import UNKNOWN_RETURNCODE, ExitInfo, TeardownStep, supervision_available
from subagent.acp.ssh import SshChannel, SshTransport
from subagent.providers.acp import AcpProvider
from subagent.testing.leaks import LEAK_TAG_VARIABLE, process_is_gone
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.sshd import SshServer, assert_no_leaks_over_ssh, running_sshd
from tests.test_faults import (
    CANCEL_PHASES,
    MIB,
    PERMISSION_PENDING,
    WIRE_FAULTS,
    Lifecycle,
    PhaseCaller,
    WireFault,
    acp_run,
    child_pid,
    peak_rss_bytes,
    pin_malloc_mmap_threshold,
    reset_peak_rss,
    running_task_ids,
    teardown_options,
    texts,
)

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.subprocess,
    pytest.mark.skipif(not supervision_available(), reason="the supervisor needs Linux"),
]

WAIT = 30  # seconds: a hang guard on one case, never a statement about speed


@pytest.fixture(scope="module")
def sshd() -> Iterator[SshServer]:
    """One loopback sshd for the module."""
    with running_sshd() as server:
        yield server


def ssh_transport(server: SshServer, argv: list[str]) -> SshTransport:
    """The transport to ``server``, with test_faults' grace after stdin closes for the stub agent ``argv``
    (short if its scenario ignores stdin EOF): ssh itself always honours SIGTERM."""
    grace = teardown_options(argv)["stdin_close_timeout"]
    return SshTransport(server.host, config_file=server.config_file, stdin_close_timeout=grace)


def ssh_provider(argv: list[str], tmp_path: Path, server: SshServer, tag: str, **options: Any) -> AcpProvider:
    return AcpProvider(
        argv, cwd=tmp_path, env={LEAK_TAG_VARIABLE: tag}, transport=ssh_transport(server, argv), **options
    )


@asynccontextmanager
async def open_ssh_service(server: SshServer) -> AsyncIterator[tuple[SubagentService, Lifecycle, str]]:
    """An open service recording lifecycle events, and the leak tag for its providers' agents. Once
    closed, no process (here or on the remote side), file descriptor or task may be left."""
    lifecycle = Lifecycle()
    async with assert_no_leaks_over_ssh(server) as tag:
        before = running_task_ids()
        async with SubagentService() as service:
            service.events.on("subagent/start", lambda info: lifecycle.events.append(("start", info)))
            service.events.on("subagent/end", lambda info: lifecycle.events.append(("end", info)))
            yield service, lifecycle, tag
        assert running_task_ids() == before


def channel_of(client: AcpClient) -> SshChannel:
    assert isinstance(client.process, SshChannel)
    return client.process


def where(info: ExitInfo, host: str) -> str:
    assert info.pid is not None
    return f"pid {info.pid} via ssh to {host}"


def killed_over_ssh(argv: list[str], info: ExitInfo, signum: signal.Signals, stderr: str, host: str) -> str:
    """A remote child killed by ``signum`` (not by teardown), as its remote supervisor reported it."""
    return (
        f"agent `{shlex.join(argv)}` ({where(info, host)}) was killed by {signum.name} "
        f"(signal {signum.value}); last stderr: {stderr}"
    )


def closed_stdout_over_ssh(argv: list[str], info: ExitInfo, stderr: str, host: str) -> str:
    return (
        f"agent `{shlex.join(argv)}` ({where(info, host)}) closed its stdout but is still running; "
        f"last stderr: {stderr}"
    )


def lost_by_teardown(info: ExitInfo | None, host: str) -> None:
    """``info`` is of an agent only teardown ended: ssh was signalled, so the status never came back."""
    assert info is not None
    assert (info.status_known, info.returncode, info.status) == (
        False,
        UNKNOWN_RETURNCODE,
        "ended with an unknown status",
    )
    # ssh ends on SIGTERM with its own status for a lost connection.
    assert info.via == f"via ssh to {host}, connection lost: ssh exited with status 255"


def gone(info: ExitInfo | None, ssh_pid: int) -> None:
    """The remote agent and the local ssh client are both gone."""
    assert info is not None
    assert info.pid is not None
    assert process_is_gone(info.pid)
    assert process_is_gone(ssh_pid)


# -- killed by a signal ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "signum"),
    [
        pytest.param("initialize", signal.SIGKILL, id="before initialize answers"),
        pytest.param("authenticate", signal.SIGINT, id="during authenticate"),
        pytest.param("newSession", signal.SIGTERM, id="during session/new"),
    ],
)
async def test_a_remote_child_killed_before_it_is_ready_fails_the_start_naming_the_signal_and_stderr(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path, phase: str, signum: signal.Signals
) -> None:
    steps = [{"step": "stderr", "text": "loading the model\n"}, {"step": "kill", "signal": signum.name}]
    argv = stub_agent_command({"requireAuth": "api-key", phase: {"steps": steps}})
    async with open_ssh_service(sshd) as (service, lifecycle, tag):
        service.register_provider(ssh_provider(argv, tmp_path, sshd, tag, auth_method="api-key"))
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
        info = acp_run(run).exit_info
        gone(info, child_pid(run))
    assert info is not None
    assert caught.value.code is ErrorCode.START_FAILED
    assert caught.value.message == killed_over_ssh(argv, info, signum, "loading the model", sshd.host)
    assert (info.killed_by, info.status_known, info.teardown_signal) == (signum, True, None)
    assert lifecycle.names == []
    assert run.state is RunState.DISPOSED


async def test_a_remote_child_killed_while_its_permission_question_is_pending_ends_the_turn_with_an_error(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(PERMISSION_PENDING)
    clients: list[AcpClient] = []
    asked: list[str] = []
    withdrawn = anyio.Event()

    async def kill_the_remote_child_while_deciding(question: PermissionQuestion) -> str | None:
        asked.append(question.tool_call_id)
        channel = channel_of(clients[0])
        assert channel.remote_pid is not None
        os.kill(channel.remote_pid, signal.SIGKILL)  # loopback: the remote host is this one
        try:
            await anyio.sleep_forever()  # the question stays pending while the child dies
        finally:
            withdrawn.set()
        return "allow"

    async with open_ssh_service(sshd) as (_, _, tag):
        async with spawn_agent(
            argv,
            env={LEAK_TAG_VARIABLE: tag},
            transport=ssh_transport(sshd, argv),
            permission=kill_the_remote_child_while_deciding,
        ) as client:
            clients.append(client)
            with anyio.fail_after(WAIT):
                await client.initialize()
                session = await client.new_session(tmp_path)
                with pytest.raises(AgentExitedError) as caught:
                    await session.prompt("edit it")
            ssh_pid = channel_of(client).pid
        assert ssh_pid is not None
        info = caught.value.exit_info
        gone(info, ssh_pid)
    assert info is not None
    assert str(caught.value) == killed_over_ssh(
        argv, info, signal.SIGKILL, "waiting for permission", sshd.host
    )
    assert asked == ["c1"]
    assert withdrawn.is_set()  # the pending question was withdrawn, not left waiting


# -- stdout closed, the child alive ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "scenario",
    [
        pytest.param(
            {
                "initialize": {
                    "steps": [{"step": "stderr", "text": "closing stdout\n"}, {"step": "close_stdout"}]
                },
                "onStdinEof": "ignore",
            },
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
            id="during session/new, SIGTERM ignored",
        ),
    ],
)
async def test_a_remote_child_closing_stdout_before_it_is_ready_fails_the_start_fast_and_is_torn_down(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path, scenario: dict[str, Any]
) -> None:
    # "Fast" is an outcome: the child ignores stdin EOF and lives until teardown, which begins only once
    # the start has failed; an error that waited for its exit would hang.
    argv = stub_agent_command(scenario)
    async with open_ssh_service(sshd) as (service, lifecycle, tag):
        service.register_provider(ssh_provider(argv, tmp_path, sshd, tag))
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
            assert acp_run(run).exit_info is None  # still alive: the error did not wait for an exit
        info = acp_run(run).exit_info
        ssh_pid = child_pid(run)
    # Checked once the service is closed: teardown dropped the connection, and the remote supervisor
    # ended the agent after it (assert_no_leaks_over_ssh waited for that).
    gone(info, ssh_pid)
    assert info is not None
    assert caught.value.code is ErrorCode.START_FAILED
    assert caught.value.message == closed_stdout_over_ssh(argv, info, "closing stdout", sshd.host)
    lost_by_teardown(info, sshd.host)
    assert lifecycle.names == []


async def test_a_remote_child_closing_stdout_mid_turn_ends_the_turn_fast_with_an_error_and_is_torn_down(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path
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
    async with open_ssh_service(sshd) as (service, lifecycle, tag):
        service.register_provider(ssh_provider(argv, tmp_path, sshd, tag))
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            assert isinstance(run, ResumableRun)
            with anyio.fail_after(WAIT):
                result = await run.result()
                alive_when_it_ended = acp_run(run).exit_info is None
                again = await run.resume("hello?")
        info = acp_run(run).exit_info
        ssh_pid = child_pid(run)
    gone(info, ssh_pid)  # once the service is closed, as above
    assert info is not None
    error = closed_stdout_over_ssh(argv, info, "closing stdout", sshd.host)
    assert result == SubagentResult(output="last words", stop_reason="error", error=error)
    assert again == SubagentResult(output="", stop_reason="error", error=error)
    assert alive_when_it_ended
    lost_by_teardown(info, sshd.host)
    assert lifecycle.names == ["start", "end"]


# -- a broken wire, a turn that goes on ------------------------------------------------------------------


@pytest.mark.parametrize("fault", list(WIRE_FAULTS.values()), ids=list(WIRE_FAULTS))
async def test_a_wire_fault_mid_turn_over_ssh_is_skipped_or_answered_and_reported_and_the_turn_completes(
    sshd: SshServer,
    stub_agent_command: StubAgentCommand,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    fault: WireFault,
) -> None:
    argv = stub_agent_command(fault.scenario())
    reported: list[ProtocolError] = []
    caplog.set_level(logging.WARNING)
    async with (
        assert_no_leaks_over_ssh(sshd) as tag,
        spawn_agent(
            argv,
            env={LEAK_TAG_VARIABLE: tag},
            transport=ssh_transport(sshd, argv),
            on_protocol_error=reported.append,
        ) as client,
    ):
        with anyio.fail_after(WAIT):
            await client.initialize()
            session = await client.new_session(tmp_path)
            result = await session.prompt("go")
        pid = channel_of(client).pid  # the ssh client's: what the connection's log names
    fault.check_turn(result, reported, caplog, pid)


async def test_a_100_mib_line_over_ssh_is_discarded_with_memory_bounded_by_the_line_limit(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    size, max_line_bytes = 100 * MIB, 8 * MIB
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
    async with open_ssh_service(sshd) as (service, _, tag):
        service.register_provider(ssh_provider(argv, tmp_path, sshd, tag, max_line_bytes=max_line_bytes))
        reset_peak_rss()
        baseline = peak_rss_bytes()
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
        growth = peak_rss_bytes() - baseline
        pid = child_pid(run)
    assert result == SubagentResult(output="before after", stop_reason="completed")
    assert texts(acp_run(run).updates) == ["before ", "after"]
    reports = [record.getMessage() for record in caplog.records if record.name == "subagent.acp.connection"]
    assert reports == [
        f"acp:{pid}: discarding a line longer than {max_line_bytes} bytes",
        f"acp:{pid}: {MessageTooLargeError(size, max_line_bytes)}",
    ]
    assert growth < max_line_bytes + 8 * MIB, (
        f"peak RSS grew by {growth / MIB:.1f} MiB reading a {size // MIB} MiB line over ssh "
        f"with a {max_line_bytes // MIB} MiB limit"
    )


async def test_a_50_mib_stderr_flood_over_ssh_deadlocks_nothing_and_leaves_a_bounded_tail(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    flood = 50 * MIB
    argv = stub_agent_command(
        {"turns": [[{"step": "stderr", "bytes": flood}, {"step": "message", "text": "after the flood"}]]}
    )
    transport = ssh_transport(sshd, argv)
    async with (
        assert_no_leaks_over_ssh(sshd) as tag,
        spawn_agent(argv, env={LEAK_TAG_VARIABLE: tag}, transport=transport) as client,
    ):
        with anyio.fail_after(60):
            await client.initialize()
            result = await (await client.new_session(tmp_path)).prompt("go")
        tail = channel_of(client).stderr_tail()
    assert result.output == "after the flood"
    assert 0 < len(tail.encode()) <= transport.stderr_tail_bytes
    info = channel_of(client).exit_info()
    assert info is not None
    assert info.stderr_bytes_total >= flood


# -- the caller cancelled --------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", list(CANCEL_PHASES))
async def test_cancelling_the_caller_at_any_phase_disposes_the_remote_run_and_leaves_nothing_anywhere(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path, phase: str
) -> None:
    caller = PhaseCaller(phase)
    argv = stub_agent_command(caller.spec.scenario)
    async with open_ssh_service(sshd) as (service, lifecycle, tag):
        provider = ssh_provider(
            argv, tmp_path, sshd, tag, on_stderr_line=caller.on_stderr_line, permission=caller.permission
        )
        service.register_provider(provider)
        tasks_before = running_task_ids()
        run, child = await caller.drive(service, WAIT)
        assert running_task_ids() == tasks_before
        pid = child.pid
        info = child.exit_info
        with pytest.raises(SubagentError) as result_error:
            await run.result()
    # Checked once the service is closed: the remote side of a dropped connection ends after it.
    if phase == "while waiting for started, before the child exists":
        assert pid is None  # disposed before the spawn: no ssh, no remote child ever existed
    else:
        assert pid is not None
        gone(info, pid)
        assert info is not None
        if caller.spec.returncode == 0:  # it exited on stdin EOF, and its remote supervisor said so
            assert (info.returncode, info.status_known) == (0, True)
        else:  # it needed SIGTERM: to ssh, so its status never came back
            lost_by_teardown(info, sshd.host)
    caller.check_disposed(result_error.value, pid, lifecycle)


async def test_a_cancel_the_remote_agent_honours_ends_the_turn_cancelled(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {"turns": [[{"step": "message", "text": "working"}, {"step": "wait_for_cancel"}]]}
    )
    async with (
        assert_no_leaks_over_ssh(sshd) as tag,
        spawn_agent(argv, env={LEAK_TAG_VARIABLE: tag}, transport=ssh_transport(sshd, argv)) as client,
    ):
        with anyio.fail_after(WAIT):
            await client.initialize()
            session = await client.new_session(tmp_path)
            first = anyio.Event()
            results: list[Any] = []

            async def run() -> None:
                results.append(await session.prompt("go", on_update=lambda update: first.set()))

            async with anyio.create_task_group() as task_group:
                task_group.start_soon(run)
                await first.wait()
                await session.cancel()
    assert (results[0].stop_reason, results[0].output) == ("cancelled", "working")


# -- hangs, ended by timeouts ----------------------------------------------------------------------------

READY_TIMEOUT = 3.0
"""Long enough for the stub agent's start-up and its first stderr line on a loaded machine (it hangs in
initialize: the timeout always runs out, so its length decides no outcome)."""
SILENCE_TIMEOUT = 1.0
"""The turn's inactivity timeout: the agent, already running, sends its first chunk well within it."""


async def test_a_remote_child_that_never_answers_initialize_fails_the_start_after_the_ready_timeout(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {"initialize": {"steps": [{"step": "stderr", "text": "loading model...\n"}, {"step": "hang"}]}}
    )
    async with open_ssh_service(sshd) as (service, lifecycle, tag):
        service.register_provider(ssh_provider(argv, tmp_path, sshd, tag, ready_timeout=READY_TIMEOUT))
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
        ssh_pid = child_pid(run)
    assert process_is_gone(ssh_pid)
    assert caught.value.code is ErrorCode.START_FAILED
    assert caught.value.message == (
        f"agent `{shlex.join(argv)}` was not ready within {READY_TIMEOUT:g} s; last stderr: loading model..."
    )
    assert lifecycle.names == []


async def test_silence_past_the_timeout_ends_a_remote_turn_with_timeout_and_keeps_the_output(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {"turns": [[{"step": "message", "text": "thinking"}, {"step": "wait_for_cancel"}]]}
    )
    async with open_ssh_service(sshd) as (service, lifecycle, tag):
        service.register_provider(ssh_provider(argv, tmp_path, sshd, tag))
        async with service.start("acp", SubagentRequest(prompt="go", timeout=SILENCE_TIMEOUT)) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
    assert result == SubagentResult(
        output="thinking", stop_reason="timeout", error=f"inactive for more than {SILENCE_TIMEOUT:g} s"
    )
    assert lifecycle.names == ["start", "end"]


# -- teardown of what will not go ------------------------------------------------------------------------


@pytest.mark.parametrize("ignore_sigterm", [False, True], ids=["SIGTERM honoured", "SIGTERM ignored"])
async def test_a_remote_agent_ignoring_stdin_eof_is_torn_down_by_signalling_ssh_and_its_tree_is_gone(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path, ignore_sigterm: bool
) -> None:
    argv = stub_agent_command({"onStdinEof": "ignore", "ignoreSigterm": ignore_sigterm})
    async with (
        assert_no_leaks_over_ssh(sshd) as tag,
        spawn_agent(argv, env={LEAK_TAG_VARIABLE: tag}, transport=ssh_transport(sshd, argv)) as client,
    ):
        with anyio.fail_after(WAIT):
            await client.initialize()
            await client.new_session(tmp_path)
        report = await channel_of(client).aclose()
        info = channel_of(client).exit_info()
    # ssh honours SIGTERM whatever the agent does; the remote supervisor then ends the agent's tree.
    assert report.steps == (TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM)
    assert report.group_gone
    lost_by_teardown(info, sshd.host)
    assert info is not None
    assert info.pid is not None
    assert process_is_gone(info.pid)


@pytest.mark.parametrize("ignore_sigterm", [False, True], ids=["SIGTERM honoured", "SIGTERM ignored"])
async def test_a_remote_grandchild_is_gone_after_teardown(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path, ignore_sigterm: bool
) -> None:
    pid_file = tmp_path / "grandchild.pid"
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "grandchild", "pidFile": str(pid_file), "ignoreSigterm": ignore_sigterm},
                    {"step": "message", "text": "spawned"},
                ]
            ]
        }
    )
    async with (
        assert_no_leaks_over_ssh(sshd) as tag,
        spawn_agent(argv, env={LEAK_TAG_VARIABLE: tag}, transport=ssh_transport(sshd, argv)) as client,
    ):
        with anyio.fail_after(WAIT):
            await client.initialize()
            result = await (await client.new_session(tmp_path)).prompt("go")
        grandchild = int(pid_file.read_text())
        assert not process_is_gone(grandchild)
    # assert_no_leaks_over_ssh waited for the remote tree to end (the grandchild holds the leak tag).
    assert process_is_gone(grandchild)
    report = json.dumps({"grandchild": grandchild}, separators=(",", ":"))
    assert [
        update.content.text
        for update in result.updates
        if isinstance(update, schema.AgentMessageChunk) and isinstance(update.content, schema.TextContent)
    ] == [report, "spawned"]
