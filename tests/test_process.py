"""Owning a child agent process: spawn, stderr tail, exit diagnosis, and process-group teardown.

Every test runs real child processes from ``fixtures/procs/`` on asyncio and on trio, and both ways: under
the supervisor (the default on Linux) and spawned directly (as elsewhere, or with ``supervise=False``); the
supervisor's own guarantees are in test_supervisor.py. Nothing sleeps to wait for something: each test waits
for the event itself (a line on stdout, the exit) under ``anyio.fail_after``. Grace periods are shortened
only in tests that are meant to exhaust them; elsewhere the defaults stand, and teardown returns as soon as
the group is gone.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import sys
from pathlib import Path

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

import subagent.acp.transports._local
from subagent.acp import AgentSpawnError
from subagent.acp.transports import AgentProcess, ExitInfo, TeardownReport, TeardownStep, open_agent_process
from tests.leaks import assert_no_leaks, live_group_members, process_is_gone

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

PROCS = Path(__file__).resolve().parent.parent / "fixtures" / "procs"
# For tests whose child is meant to outlast a grace period: short enough to keep the module fast, long
# enough for nothing else to depend on it.
SHORT_GRACE = 0.3
# For a teardown step the child honours: it ends as soon as the child is gone, so it costs nothing, and a
# loaded machine slow to run the child's exit cannot make teardown take the next step.
GENEROUS_GRACE = 30.0
WAIT = 30  # seconds: a hang guard on one step of a test, never a statement about speed
STDIN_THEN_SIGTERM = (TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM)
ALL_THREE_STEPS = (TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM, TeardownStep.SIGKILL)
# The stderr_flood fixture's block layout (see its docstring).
FLOOD_BLOCK_SIZE = 4096


@pytest.fixture(autouse=True, params=["supervised", "direct"])
def spawn_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each test with the agent under its supervisor, and spawned directly (the non-Linux path)."""
    mode: str = request.param
    if mode == "direct":
        monkeypatch.setattr(subagent.acp.transports._local, "supervision_available", lambda: False)
    return mode


def fixture_argv(name: str, *args: str) -> list[str]:
    """The argv that runs ``fixtures/procs/<name>`` with this interpreter."""
    return [sys.executable, str(PROCS / name), *args]


async def read_line(stdout: BufferedByteReceiveStream) -> bytes:
    """The next line from the child's stdout, without its newline."""
    with anyio.fail_after(WAIT):
        return await stdout.receive_until(b"\n", 4096)


def assert_reaped(pid: int) -> None:
    """The direct child was reaped by us: its pid no longer exists."""
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def flood_block(k: int) -> bytes:
    """Block ``k`` of what stderr_flood.py writes."""
    return b"%010d" % k + b"." * (FLOOD_BLOCK_SIZE - 11) + b"\n"


async def test_lines_written_to_stdin_come_back_on_stdout() -> None:
    async with assert_no_leaks(), open_agent_process(fixture_argv("echo_lines.py")) as proc:
        stdout = BufferedByteReceiveStream(proc.stdout)
        await proc.stdin.send(b"hello\n")
        assert await read_line(stdout) == b"hello"
        await proc.stdin.send(b"second line\n")
        assert await read_line(stdout) == b"second line"


async def test_a_child_that_exits_on_stdin_close_is_torn_down_by_closing_stdin_alone() -> None:
    async with assert_no_leaks():
        async with open_agent_process(
            fixture_argv("echo_lines.py"), stdin_close_timeout=GENEROUS_GRACE
        ) as proc:
            await proc.stdin.send(b"ping\n")
            assert await read_line(BufferedByteReceiveStream(proc.stdout)) == b"ping"
        assert proc.teardown_report == TeardownReport(
            steps=(TeardownStep.CLOSE_STDIN,), exited_before_teardown=False, group_gone=True
        )
        assert proc.teardown_report.graceful
        assert proc.returncode == 0
        assert_reaped(proc.pid)


async def test_a_child_that_ignores_stdin_eof_ends_by_sigterm_sent_by_teardown() -> None:
    argv = fixture_argv("ignores_stdin_eof.py")
    async with assert_no_leaks():
        async with open_agent_process(
            argv, stdin_close_timeout=SHORT_GRACE, sigterm_timeout=GENEROUS_GRACE
        ) as proc:
            assert await read_line(BufferedByteReceiveStream(proc.stdout)) == b"ready"
        assert proc.teardown_report == TeardownReport(
            steps=STDIN_THEN_SIGTERM, exited_before_teardown=False, group_gone=True
        )
        info = proc.exit_info()
        assert info is not None
        assert (info.returncode, info.killed_by, info.teardown_signal) == (
            -signal.SIGTERM,
            signal.SIGTERM,
            signal.SIGTERM,
        )
        assert str(info) == (
            f"agent `{shlex.join(argv)}` (pid {proc.pid}) was killed by SIGTERM (signal 15), "
            "sent by teardown; stderr was empty"
        )
        assert_reaped(proc.pid)


async def test_a_child_that_ignores_sigterm_ends_by_sigkill_and_its_grandchild_with_it() -> None:
    async with assert_no_leaks():
        async with open_agent_process(
            fixture_argv("spawns_grandchild.py", "ignore-sigterm"),
            stdin_close_timeout=SHORT_GRACE,
            sigterm_timeout=SHORT_GRACE,
        ) as proc:
            pids = await read_line(BufferedByteReceiveStream(proc.stdout))
            child_pid, grandchild_pid = map(int, pids.split())
            assert child_pid == proc.pid == proc.pgid
        assert proc.teardown_report == TeardownReport(
            steps=ALL_THREE_STEPS, exited_before_teardown=False, group_gone=True
        )
        assert proc.returncode == -signal.SIGKILL
        assert_reaped(proc.pid)
        assert process_is_gone(grandchild_pid)
        assert live_group_members(proc.pgid) == []


async def test_a_grandchild_ignoring_sigterm_is_gone_after_teardown_though_the_child_exited() -> None:
    async with assert_no_leaks():
        async with open_agent_process(
            fixture_argv("spawns_grandchild.py", "exit-on-stdin-eof"),
            stdin_close_timeout=SHORT_GRACE,
            sigterm_timeout=SHORT_GRACE,
            stderr_settle_timeout=SHORT_GRACE,
        ) as proc:
            pids = await read_line(BufferedByteReceiveStream(proc.stdout))
            _, grandchild_pid = map(int, pids.split())
            # The child's cue to exit, given here rather than by teardown: however long a loaded machine
            # takes to run its exit, teardown starts after it, and the grandchild is all that is left.
            await proc.stdin.aclose()
            with anyio.fail_after(WAIT):
                await proc.wait_exit()
            assert not process_is_gone(grandchild_pid)
        assert proc.teardown_report == TeardownReport(
            steps=ALL_THREE_STEPS, exited_before_teardown=True, group_gone=True
        )
        # The child exited on its own, before any signal: its status and diagnosis say so.
        info = proc.exit_info()
        assert info is not None
        assert (info.returncode, info.teardown_signal) == (0, None)
        assert_reaped(proc.pid)
        assert process_is_gone(grandchild_pid)
        assert live_group_members(proc.pgid) == []


async def test_wait_exit_returns_while_a_grandchild_holds_the_pipes_and_teardown_then_kills_it() -> None:
    async with assert_no_leaks():
        async with open_agent_process(
            fixture_argv("child_exits_grandchild_holds_pipes.py"),
            stdin_close_timeout=SHORT_GRACE,
            stderr_settle_timeout=SHORT_GRACE,
        ) as proc:
            pids = await read_line(BufferedByteReceiveStream(proc.stdout))
            _, grandchild_pid = map(int, pids.split())
            with anyio.fail_after(WAIT):
                info = await proc.wait_exit()
            assert info.returncode == 0
            assert not process_is_gone(grandchild_pid)
        assert proc.teardown_report == TeardownReport(
            steps=STDIN_THEN_SIGTERM, exited_before_teardown=True, group_gone=True
        )
        assert_reaped(proc.pid)
        assert process_is_gone(grandchild_pid)


async def test_a_50_mib_stderr_flood_blocks_nothing_and_the_tail_keeps_exactly_its_last_bytes() -> None:
    flood_bytes = 50 * 1024 * 1024
    tail_limit = 10_000  # Deliberately not a multiple of the block size or of any read size.
    async with assert_no_leaks():
        async with open_agent_process(
            fixture_argv("stderr_flood.py", str(flood_bytes)), stderr_tail_bytes=tail_limit
        ) as proc:
            with anyio.fail_after(20):
                assert await BufferedByteReceiveStream(proc.stdout).receive_until(b"\n", 100) == b"flooded"
        assert proc.teardown_report is not None
        assert proc.teardown_report.graceful
        assert proc.stderr_bytes_total == flood_bytes
        blocks = flood_bytes // FLOOD_BLOCK_SIZE
        last_blocks = b"".join(flood_block(k) for k in range(blocks - 3, blocks))
        assert proc.stderr_tail_raw() == last_blocks[-tail_limit:]
        assert proc.stderr_tail() == last_blocks[-tail_limit:].decode()


async def test_a_crash_with_status_3_is_diagnosed_with_the_status_and_the_stderr_tail() -> None:
    argv = fixture_argv("exit_with_status.py", "3", "Traceback (most recent call last):", "ValueError: boom")
    async with assert_no_leaks():
        async with open_agent_process(argv) as proc:
            with anyio.fail_after(WAIT):
                info = await proc.wait_exit()
        assert info == ExitInfo(
            command=tuple(argv),
            pid=proc.pid,
            returncode=3,
            stderr_tail="Traceback (most recent call last):\nValueError: boom\n",
            stderr_bytes_total=52,
        )
        assert info.killed_by is None
        assert str(info) == (
            f"agent `{shlex.join(argv)}` (pid {proc.pid}) exited with status 3; "
            "last stderr: Traceback (most recent call last): | ValueError: boom"
        )
        assert proc.exit_info() == info
        assert proc.teardown_report == TeardownReport(
            steps=(TeardownStep.CLOSE_STDIN,), exited_before_teardown=True, group_gone=True
        )


@pytest.mark.parametrize("killer", [signal.SIGSEGV, signal.SIGKILL], ids=lambda sig: sig.name)
async def test_a_death_by_signal_is_diagnosed_with_the_signal_name(killer: signal.Signals) -> None:
    argv = fixture_argv("dies_by_signal.py", killer.name)
    async with assert_no_leaks():
        async with open_agent_process(argv) as proc:
            with anyio.fail_after(WAIT):
                info = await proc.wait_exit()
        assert (info.returncode, info.killed_by, info.teardown_signal) == (-killer, killer, None)
        assert str(info) == (
            f"agent `{shlex.join(argv)}` (pid {proc.pid}) was killed by {killer.name} "
            f"(signal {killer.value}); last stderr: about to die by {killer.name}"
        )


@pytest.mark.parametrize(
    ("program", "reason"),
    [
        ("definitely-not-an-agent-4f7c", "'definitely-not-an-agent-4f7c' was not found on PATH"),
        ("/nonexistent/agent", "'/nonexistent/agent' does not exist"),
    ],
)
async def test_a_missing_executable_raises_a_typed_error_naming_the_command(
    program: str, reason: str
) -> None:
    async with assert_no_leaks():
        with pytest.raises(AgentSpawnError) as caught:
            async with open_agent_process([program, "--acp"]):
                pytest.fail("the block must not run")
    assert caught.value.command == (program, "--acp")
    assert caught.value.reason.startswith(reason)
    assert str(caught.value).startswith(f"cannot start agent `{program} --acp`: {reason}")


async def test_a_path_that_cannot_be_executed_raises_a_typed_error(tmp_path: Path) -> None:
    not_executable = tmp_path / "agent.sh"
    not_executable.write_text("#!/bin/sh\n")
    not_executable.chmod(0o644)
    garbage = tmp_path / "garbage-agent"
    garbage.write_bytes(b"\x00\x01\x02 not a program")
    garbage.chmod(0o755)
    async with assert_no_leaks():
        with pytest.raises(AgentSpawnError, match="is not executable"):
            async with open_agent_process([str(not_executable)]):
                pytest.fail("the block must not run")
        with pytest.raises(AgentSpawnError, match="is a directory"):
            async with open_agent_process([str(tmp_path)]):
                pytest.fail("the block must not run")
        with pytest.raises(AgentSpawnError, match="does not exist or is not a directory"):
            async with open_agent_process(fixture_argv("echo_lines.py"), cwd=tmp_path / "missing"):
                pytest.fail("the block must not run")
        # Passes every check but fails in exec itself: the error still comes typed, with the OSError as cause.
        with pytest.raises(AgentSpawnError, match="exec failed: Exec format error") as caught:
            async with open_agent_process([str(garbage)]):
                pytest.fail("the block must not run")
        assert isinstance(caught.value.__cause__, OSError)


async def test_argv_given_as_one_string_is_rejected_because_no_shell_is_used() -> None:
    with pytest.raises(TypeError, match="not a string"):
        # A str type-checks as a Sequence[str], so only the runtime check stands between it and "e", "c", ...
        async with open_agent_process("echo hi"):
            pytest.fail("the block must not run")


async def test_cancelling_the_caller_during_a_run_leaves_no_process_and_no_fd() -> None:
    async with assert_no_leaks():
        with anyio.CancelScope() as scope:
            async with open_agent_process(
                fixture_argv("ignores_sigterm.py"),
                stdin_close_timeout=SHORT_GRACE,
                sigterm_timeout=SHORT_GRACE,
            ) as proc:
                assert await read_line(BufferedByteReceiveStream(proc.stdout)) == b"ready"
                scope.cancel()
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert proc.teardown_report is not None
        assert proc.teardown_report.steps == ALL_THREE_STEPS
        assert_reaped(proc.pid)


async def test_cancelling_the_caller_during_teardown_neither_cuts_it_short_nor_hangs() -> None:
    body_finished = anyio.Event()
    scopes: list[anyio.CancelScope] = []
    procs: list[AgentProcess] = []

    async def run_agent() -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            async with open_agent_process(
                fixture_argv("ignores_sigterm.py"),
                stdin_close_timeout=SHORT_GRACE,
                sigterm_timeout=SHORT_GRACE,
            ) as proc:
                procs.append(proc)
                assert await read_line(BufferedByteReceiveStream(proc.stdout)) == b"ready"
                # Leaving the block starts the teardown before this task yields to the canceller below.
                body_finished.set()
        assert scope.cancelled_caught

    async with assert_no_leaks():
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(run_agent)
                await body_finished.wait()
                scopes[0].cancel()
        [proc] = procs
        assert proc.teardown_report is not None
        assert proc.teardown_report.steps == ALL_THREE_STEPS
        assert proc.teardown_report.group_gone
        assert_reaped(proc.pid)


@pytest.mark.parametrize("deadline", [0.0, 0.001, 0.005, 0.02, 0.05, 0.2])
async def test_a_cancellation_arriving_at_any_point_leaves_nothing_behind(deadline: float) -> None:
    # Depending on the deadline and the machine, the cancellation lands before the spawn, during it, in the
    # block, or not at all before the block ends; whichever it is, nothing may be left behind.
    async with assert_no_leaks():
        with anyio.fail_after(WAIT), anyio.move_on_after(deadline):
            async with open_agent_process(fixture_argv("echo_lines.py")) as proc:
                await proc.stdin.send(b"ping\n")
                await read_line(BufferedByteReceiveStream(proc.stdout))
                await anyio.sleep_forever()


async def test_teardown_is_idempotent_and_every_call_returns_the_same_report() -> None:
    async with assert_no_leaks():
        async with open_agent_process(fixture_argv("echo_lines.py")) as proc:
            first = await proc.aclose()
            second = await proc.aclose()
            assert second is first
            assert first.graceful
            with pytest.raises(anyio.ClosedResourceError):
                await proc.stdin.send(b"too late\n")
        assert proc.teardown_report is first
        assert await proc.aclose() is first


async def test_a_child_blocked_on_a_full_stdout_pipe_can_still_exit_during_teardown() -> None:
    # Nobody reads the 4 MiB, far more than the pipe and asyncio's read buffer hold: only teardown's drain
    # lets the child finish writing and exit before any signal.
    async with assert_no_leaks():
        async with open_agent_process(fixture_argv("stdout_flood.py", str(4 * 1024 * 1024))) as proc:
            pass
        assert proc.teardown_report is not None
        assert proc.teardown_report.graceful
        assert proc.returncode == 0


async def test_the_given_env_is_merged_over_the_parents_and_cwd_is_honoured(tmp_path: Path) -> None:
    argv = fixture_argv("prints_env_and_cwd.py", "SUBAGENT_TEST_VARIABLE", "PATH", "HOME")
    async with (
        assert_no_leaks(),
        open_agent_process(argv, env={"SUBAGENT_TEST_VARIABLE": "given"}, cwd=tmp_path) as proc,
    ):
        report = json.loads(await read_line(BufferedByteReceiveStream(proc.stdout)))
    assert report == {
        "cwd": str(tmp_path),
        "env": {"SUBAGENT_TEST_VARIABLE": "given", "PATH": os.environ["PATH"], "HOME": os.environ["HOME"]},
    }


async def test_an_exact_env_replaces_the_parents_and_a_missing_home_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    argv = fixture_argv("prints_env_and_cwd.py", "SUBAGENT_TEST_VARIABLE", "PATH", "HOME")
    exact_env = {"SUBAGENT_TEST_VARIABLE": "given", "PATH": os.environ["PATH"]}
    with caplog.at_level(logging.WARNING, logger="subagent.acp.transports._local"):
        async with (
            assert_no_leaks(),
            open_agent_process(argv, env=exact_env, inherit_env=False) as proc,
        ):
            report = json.loads(await read_line(BufferedByteReceiveStream(proc.stdout)))
    assert report["env"] == {"SUBAGENT_TEST_VARIABLE": "given", "PATH": os.environ["PATH"], "HOME": None}
    assert [record.getMessage() for record in caplog.records] == [
        "spawning an agent with an exact environment lacking HOME; it may not find tools or credentials"
    ]


async def test_stderr_lines_are_forwarded_to_the_callback_as_they_arrive() -> None:
    lines: list[str] = []
    argv = fixture_argv("exit_with_status.py", "0", "first", "", "caf\u00e9 \u2615")
    async with assert_no_leaks(), open_agent_process(argv, on_stderr_line=lines.append) as proc:
        with anyio.fail_after(WAIT):
            await proc.wait_exit()
    assert lines == ["first", "", "caf\u00e9 \u2615"]


async def test_an_exception_in_the_block_propagates_unwrapped_after_teardown() -> None:
    async with assert_no_leaks():
        with pytest.raises(LookupError, match="from the block") as caught:
            async with open_agent_process(fixture_argv("echo_lines.py")) as proc:
                raise LookupError("from the block")
        assert type(caught.value) is LookupError
        assert proc.teardown_report is not None
        assert proc.teardown_report.graceful


async def test_the_agent_runs_under_a_supervisor_exactly_where_one_is_available(spawn_mode: str) -> None:
    async with assert_no_leaks(), open_agent_process(fixture_argv("echo_lines.py")) as proc:
        assert proc.supervised is (spawn_mode == "supervised" and sys.platform == "linux")
        assert (proc.supervisor_pid is not None) is proc.supervised
        assert proc.pid != proc.supervisor_pid
