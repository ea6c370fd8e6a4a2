"""The supervisor under every agent (Linux): no descendant outlives its run, even one that left the group,
even when our own process is SIGKILLed; and an agent started under it sees exactly what a direct spawn gives.

Real processes from ``fixtures/procs/`` on asyncio and trio. Helpers that escape their agent's process
group report their pids; "gone" is asserted on the pids themselves (``/proc`` and ``kill(pid, 0)``), and
every test that spawns also runs inside ``assert_no_leaks()``, which finds escaped processes by their
inherited environment tag. Waits are for events, under ``anyio.fail_after`` as a hang guard only.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from hypothesis import given
from hypothesis import strategies as st

from subagent.acp import AgentSpawnError, schema
from subagent.acp.terminals import TerminalHost
from subagent.acp.transports import (
    UNKNOWN_RETURNCODE,
    TeardownReport,
    TeardownStep,
    open_agent_process,
    supervision_available,
)
from tests.leaks import assert_no_leaks, leaked_processes, process_info, process_is_gone

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.subprocess,
    pytest.mark.skipif(not supervision_available(), reason="the supervisor needs Linux"),
]

PROCS = Path(__file__).resolve().parent.parent / "fixtures" / "procs"
SUPERVISOR_SCRIPT = (
    Path(__file__).resolve().parent.parent / "subagent" / "acp" / "transports" / "_supervisor.py"
)
SHORT_GRACE = 0.3  # for a teardown step the process ignores: it always runs out, and decides nothing
# For a teardown step the processes honour: it ends when they are gone, so it costs nothing, and a loaded
# machine slow to run their exit cannot make teardown take the next step.
GENEROUS_GRACE = 30.0
# For a signal handler to run before the next step, where the process ignores the step and so waits it out.
HANDLER_GRACE = 2.0
WAIT = 30  # seconds: a hang guard on one step of a test, never a statement about speed
ALL_THREE_STEPS = (TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM, TeardownStep.SIGKILL)
STDIN_THEN_SIGTERM = (TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM)
# Hang guard for everything to be gone once our process was SIGKILLed: the supervisor notices within 0.25 s,
# gives SIGTERM 1 s, then SIGKILLs; the rest is slack for a loaded machine.
GONE_AFTER_PARENT_DEATH_TIMEOUT = 30
SESSION = "sess-1"


def fixture_argv(name: str, *args: str) -> list[str]:
    """The argv that runs ``fixtures/procs/<name>`` with this interpreter."""
    return [sys.executable, str(PROCS / name), *args]


async def read_line(stdout: anyio.abc.ByteReceiveStream) -> bytes:
    with anyio.fail_after(WAIT):
        return await BufferedByteReceiveStream(stdout).receive_until(b"\n", 4096)


def assert_no_such_process(pid: int) -> None:
    """Not running and not even a zombie: the pid is free (its parent, the supervisor, reaped it)."""
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert process_info(pid) is None


def resident_kib(pid: int) -> int:
    """The resident set size of process ``pid``, in KiB."""
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1])


def running(pid: int) -> bool:
    info = process_info(pid)
    return info is not None and not info.is_zombie


async def survivors_after_polling(pids: Sequence[int], timeout: float) -> list[int]:
    """Poll /proc until none of ``pids`` runs (or ``timeout`` passes); the ones still running."""
    with anyio.move_on_after(timeout):
        # Polled: no event tells us of the death of a process that is not our child.
        while True:
            if all(process_is_gone(pid) for pid in pids):
                break
            await anyio.sleep(0.02)
    return [pid for pid in pids if not process_is_gone(pid)]


@asynccontextmanager
async def helpers_killed_afterwards(pids: list[int]) -> AsyncIterator[list[int]]:
    """For tests that expect processes to survive: SIGKILL whatever of ``pids`` is left, by pid."""
    try:
        yield pids
    finally:
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        await survivors_after_polling(pids, 10)


# -- descendants that left the process group ---------------------------------------------------------


@pytest.mark.parametrize(
    ("agent_mode", "helper_mode", "steps", "returncode"),
    [
        # The helpers obey SIGTERM: the supervisor's relay of it is enough.
        ("exit-on-stdin-eof", "obey-sigterm", STDIN_THEN_SIGTERM, 0),
        # Nothing obeys SIGTERM: only the supervisor's SIGKILL sweep reaches the helpers.
        ("exit-on-stdin-eof", "ignore-sigterm", ALL_THREE_STEPS, 0),
        ("ignore-sigterm", "ignore-sigterm", ALL_THREE_STEPS, -signal.SIGKILL),
    ],
)
async def test_helpers_that_left_the_group_by_setsid_setpgid_or_double_fork_are_gone_after_teardown(
    agent_mode: str, helper_mode: str, steps: tuple[TeardownStep, ...], returncode: int
) -> None:
    agent_exits_on_eof = agent_mode == "exit-on-stdin-eof"
    async with assert_no_leaks():
        async with open_agent_process(
            fixture_argv("escaping_descendants.py", agent_mode, helper_mode),
            stdin_close_timeout=SHORT_GRACE,
            sigterm_timeout=GENEROUS_GRACE if helper_mode == "obey-sigterm" else SHORT_GRACE,
        ) as proc:
            agent_pid, *helper_pids = map(int, (await read_line(proc.stdout)).split())
            assert agent_pid == proc.pid == proc.pgid
            assert proc.supervised
            for pid in helper_pids:
                info = process_info(pid)
                assert info is not None
                assert info.pgrp != proc.pgid  # they really left the agent's group
            if agent_exits_on_eof:
                # Its cue to exit, given before teardown: however long a loaded machine takes to run the
                # exit, no teardown signal can overtake it.
                await proc.stdin.aclose()
                with anyio.fail_after(WAIT):
                    await proc.wait_exit()
        assert proc.teardown_report == TeardownReport(
            steps=steps, exited_before_teardown=agent_exits_on_eof, group_gone=True
        )
        assert proc.returncode == returncode
        assert proc.supervisor_pid is not None
        for pid in (proc.supervisor_pid, proc.pid, *helper_pids):
            assert_no_such_process(pid)


async def test_kill_sigkills_the_agent_and_every_escaped_helper_at_once_and_teardown_then_ends() -> None:
    async with (
        assert_no_leaks(),
        open_agent_process(
            fixture_argv("escaping_descendants.py", "ignore-sigterm", "ignore-sigterm"),
            # Graces nobody should wait out: after kill() the tree is gone before the first one ends.
            stdin_close_timeout=GENEROUS_GRACE,
            sigterm_timeout=GENEROUS_GRACE,
        ) as proc,
    ):
        _, *helper_pids = map(int, (await read_line(proc.stdout)).split())
        proc.kill()
        proc.kill()  # idempotent
        with anyio.fail_after(WAIT):
            info = await proc.wait_exit()
        assert info.killed_by is signal.SIGKILL
        assert await survivors_after_polling(helper_pids, WAIT) == []
    # Teardown found the tree gone after closing stdin: it sent no signal of its own.
    assert proc.teardown_report == TeardownReport(
        steps=(TeardownStep.CLOSE_STDIN,), exited_before_teardown=True, group_gone=True
    )


async def test_without_a_supervisor_helpers_that_left_the_group_outlive_teardown() -> None:
    # The limit the supervisor lifts, shown with the same fixture: the group alone does not reach them.
    async with open_agent_process(
        fixture_argv("escaping_descendants.py", "exit-on-stdin-eof", "ignore-sigterm"), supervise=False
    ) as proc:
        agent_pid, *helper_pids = map(int, (await read_line(proc.stdout)).split())
    async with helpers_killed_afterwards(helper_pids):
        assert (proc.supervised, proc.supervisor_pid, proc.pid) == (False, None, agent_pid)
        assert proc.teardown_report is not None
        assert proc.teardown_report.graceful
        assert [pid for pid in helper_pids if running(pid)] == helper_pids


async def test_wait_exit_returns_when_the_agent_exits_while_its_escaped_helpers_keep_running() -> None:
    async with assert_no_leaks():
        async with open_agent_process(
            fixture_argv("escaping_descendants.py", "exit-on-stdin-eof", "obey-sigterm"),
            stdin_close_timeout=SHORT_GRACE,
            sigterm_timeout=GENEROUS_GRACE,
        ) as proc:
            _, *helper_pids = map(int, (await read_line(proc.stdout)).split())
            await proc.stdin.aclose()
            with anyio.fail_after(WAIT):
                info = await proc.wait_exit()
            assert (info.returncode, info.status_known) == (0, True)
            # The supervisor stays while descendants remain: it is what keeps them within reach.
            assert proc.supervisor_pid is not None
            assert running(proc.supervisor_pid)
            assert all(running(pid) for pid in helper_pids)
        assert proc.teardown_report == TeardownReport(
            steps=STDIN_THEN_SIGTERM, exited_before_teardown=True, group_gone=True
        )
        for pid in helper_pids:
            assert_no_such_process(pid)


async def test_a_terminal_command_s_double_forked_helpers_are_gone_after_release(tmp_path: Path) -> None:
    # TerminalHost spawns through open_agent_process, so its commands run under the supervisor too.
    args = [str(PROCS / "escaping_descendants.py"), "exit-on-stdin-eof", "ignore-sigterm"]
    async with assert_no_leaks(), TerminalHost(cwd=tmp_path, kill_grace=SHORT_GRACE) as host:
        with anyio.fail_after(WAIT):
            created = await host.create(
                schema.CreateTerminalRequest(session_id=SESSION, command=sys.executable, args=args)
            )
            output = await host.wait_for_output(
                schema.TerminalOutputRequest(session_id=SESSION, terminal_id=created.terminal_id),
                lambda text: "\n" in text,
            )
        command_pid, *helper_pids = map(int, output.output.split())
        with anyio.fail_after(WAIT):
            exit_status = await host.wait_for_exit(
                schema.WaitForTerminalExitRequest(session_id=SESSION, terminal_id=created.terminal_id)
            )
        # The command exits at once (its stdin is closed); its helpers live on until the release.
        assert exit_status == schema.WaitForTerminalExitResponse(exit_code=0)
        assert all(running(pid) for pid in helper_pids)
        with anyio.fail_after(WAIT):
            await host.release(
                schema.ReleaseTerminalRequest(session_id=SESSION, terminal_id=created.terminal_id)
            )
        for pid in (command_pid, *helper_pids):
            assert_no_such_process(pid)


async def test_a_terminal_command_s_escaped_helpers_are_gone_once_the_host_closes(tmp_path: Path) -> None:
    args = [str(PROCS / "escaping_descendants.py"), "ignore-sigterm", "ignore-sigterm"]
    async with assert_no_leaks():
        async with TerminalHost(cwd=tmp_path, kill_grace=SHORT_GRACE) as host:
            with anyio.fail_after(WAIT):
                created = await host.create(
                    schema.CreateTerminalRequest(session_id=SESSION, command=sys.executable, args=args)
                )
                output = await host.wait_for_output(
                    schema.TerminalOutputRequest(session_id=SESSION, terminal_id=created.terminal_id),
                    lambda text: "\n" in text,
                )
            pids = list(map(int, output.output.split()))
            assert all(running(pid) for pid in pids)
        for pid in pids:
            assert_no_such_process(pid)


# -- our own process SIGKILLed -----------------------------------------------------------------------


async def test_when_the_parent_is_sigkilled_its_agent_and_every_escaped_helper_are_gone(
    anyio_backend_name: str,
) -> None:
    # The parent runs the same backend as this test, so both backends' spawn paths are covered.
    async with assert_no_leaks():
        parent = await anyio.open_process(
            fixture_argv("parent_of_escapees.py", anyio_backend_name), stdin=None, stderr=None
        )
        async with parent:
            assert parent.stdout is not None
            supervisor_pid, agent_pid, *helper_pids = map(int, (await read_line(parent.stdout)).split())
            tree = [supervisor_pid, agent_pid, *helper_pids]
            assert all(running(pid) for pid in tree)
            parent.kill()
            with anyio.fail_after(WAIT):
                assert await parent.wait() == -signal.SIGKILL
        survivors = await survivors_after_polling(tree, GONE_AFTER_PARENT_DEATH_TIMEOUT)
        assert survivors == []


async def test_when_the_cli_is_sigkilled_mid_turn_its_agent_and_the_agent_s_daemon_are_gone(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "daemon.pid"
    scenario = tmp_path / "hang.json"
    scenario.write_text(json.dumps({"turns": [[{"step": "message", "text": "working"}, {"step": "hang"}]]}))
    agent = fixture_argv(
        "escape_then_exec.py", str(pid_file), sys.executable, "-m", "subagent.testing.stub_agent"
    )
    cli = [
        sys.executable,
        "-m",
        "subagent",
        "run",
        "--events",
        "-p",
        "go",
        "--",
        *agent,
        "--scenario",
        str(scenario),
    ]
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    async with assert_no_leaks():
        process = await anyio.open_process(cli, env=env, stdin=None, stdout=None, start_new_session=True)
        async with process:
            assert process.stderr is not None
            events = BufferedByteReceiveStream(process.stderr)
            with anyio.fail_after(30):
                while json.loads(await events.receive_until(b"\n", 65536)).get("event") != "update":
                    pass
            # The CLI's descendants: the supervisor, the agent, and the daemon re-parented to the supervisor.
            tree = [info.pid for info in leaked_processes() if info.pid != process.pid]
            daemon_pid = int(pid_file.read_text())
            assert daemon_pid in tree
            assert len(tree) == 3
            process.kill()
            with anyio.fail_after(WAIT):
                assert await process.wait() == -signal.SIGKILL
        survivors = await survivors_after_polling(tree, GONE_AFTER_PARENT_DEATH_TIMEOUT)
        assert survivors == []


# -- what the agent sees: the same as from a direct spawn --------------------------------------------


@pytest.mark.parametrize(
    ("argv", "returncode"),
    [
        (fixture_argv("exit_with_status.py", "0"), 0),
        (fixture_argv("exit_with_status.py", "3", "boom"), 3),
        (fixture_argv("exit_with_status.py", "255"), 255),
        (fixture_argv("dies_by_signal.py", "SIGSEGV"), -signal.SIGSEGV),
        (fixture_argv("dies_by_signal.py", "SIGKILL"), -signal.SIGKILL),
        (fixture_argv("dies_by_signal.py", "SIGTERM"), -signal.SIGTERM),
    ],
    ids=["0", "3", "255", "SIGSEGV", "SIGKILL", "SIGTERM"],
)
async def test_the_agent_s_exit_status_is_mirrored_exactly(argv: list[str], returncode: int) -> None:
    infos = []
    async with assert_no_leaks():
        for supervise in (True, False):
            async with open_agent_process(argv, supervise=supervise) as proc:
                assert proc.supervised is supervise
                with anyio.fail_after(WAIT):
                    infos.append(await proc.wait_exit())
    supervised, direct = infos
    assert (supervised.returncode, supervised.status_known) == (returncode, True)
    assert supervised.status == direct.status
    assert supervised.stderr_tail == direct.stderr_tail


async def test_an_agent_killed_outright_as_by_the_oom_killer_is_reported_killed_by_sigkill() -> None:
    async with assert_no_leaks(), open_agent_process(fixture_argv("ignores_stdin_eof.py")) as proc:
        assert await read_line(proc.stdout) == b"ready"
        os.kill(proc.pid, signal.SIGKILL)
        with anyio.fail_after(WAIT):
            info = await proc.wait_exit()
    assert (info.returncode, info.killed_by, info.teardown_signal) == (-signal.SIGKILL, signal.SIGKILL, None)


async def test_an_exact_environment_reaches_the_agent_exactly_without_python_s_locale_coercion() -> None:
    # No LANG or LC_*: a Python started with this environment adds LC_CTYPE to its own (PEP 538), and the
    # supervisor is one. The agent must still get exactly what was asked for.
    exact = {"PATH": os.environ["PATH"], "HOME": "/nonexistent-home", "ONLY": "this", "EMPTY": ""}
    async with (
        assert_no_leaks(),
        open_agent_process(fixture_argv("prints_environ.py"), env=exact, inherit_env=False) as proc,
    ):
        assert proc.supervised
        assert json.loads(await read_line(proc.stdout)) == exact


async def test_an_inherited_environment_reaches_the_agent_exactly_as_in_a_direct_spawn() -> None:
    seen = []
    async with assert_no_leaks():
        for supervise in (True, False):
            async with open_agent_process(
                fixture_argv("prints_environ.py"), env={"GIVEN": "value"}, supervise=supervise
            ) as proc:
                seen.append(json.loads(await read_line(proc.stdout)))
    assert seen[0] == seen[1]
    assert seen[0]["GIVEN"] == "value"


def signal_masks(status: str) -> dict[str, int]:
    return {
        line.split(":")[0]: int(line.split()[1], 16)
        for line in status.splitlines()
        if line.startswith(("SigBlk", "SigIgn"))
    }


async def test_the_agent_starts_with_default_sigpipe_and_the_signal_state_of_a_direct_spawn() -> None:
    seen = []
    async with assert_no_leaks():
        for supervise in (True, False):
            # cat reports its own signal state as exec left it (a Python agent would reset SIGPIPE itself).
            async with open_agent_process(["cat", "/proc/self/status"], supervise=supervise) as proc:
                with anyio.fail_after(WAIT):
                    output = b""
                    while b"SigIgn" not in output or not output.endswith(b"\n"):
                        output += await proc.stdout.receive()
                seen.append(signal_masks(output.decode()))
    supervised, direct = seen
    assert supervised == direct
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1):
        assert not supervised["SigIgn"] & (1 << (sig - 1)), sig.name
        assert not supervised["SigBlk"] & (1 << (sig - 1)), sig.name


async def test_no_descriptor_of_ours_reaches_the_agent_not_even_the_supervisor_s_status_pipe() -> None:
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, True)  # Even one we marked inheritable: the spawn closes it.
    try:
        async with assert_no_leaks(), open_agent_process(fixture_argv("lists_fds.py")) as proc:
            assert json.loads(await read_line(proc.stdout)) == [0, 1, 2]
    finally:
        os.close(read_end)
        os.close(write_end)


async def test_an_exec_failure_inside_the_supervisor_is_a_typed_spawn_error_with_the_os_error(
    tmp_path: Path,
) -> None:
    # Passes every check before the spawn (it exists and is executable); only exec finds its interpreter gone.
    script = tmp_path / "agent"
    script.write_text("#!/nonexistent/interpreter\n")
    script.chmod(0o755)
    async with assert_no_leaks():
        with pytest.raises(AgentSpawnError) as caught:
            async with open_agent_process([str(script), "--acp"]):
                pytest.fail("the block must not run")
    assert caught.value.reason == "exec failed: No such file or directory"
    assert isinstance(caught.value.__cause__, FileNotFoundError)


@pytest.mark.parametrize(
    ("argv", "env", "cwd", "reason"),
    [
        (["age\0nt"], None, None, "the program name contains a NUL character"),
        (["true", "ok", "a\0b"], None, None, "argument 2 contains a NUL character"),
        (
            ["true"],
            {"TOKEN": "sec\0ret"},
            None,
            "the value of environment variable 'TOKEN' contains a NUL character",
        ),
        (["true"], {"TO\0KEN": "x"}, None, "an environment variable name contains a NUL character"),
        (["true"], {"TOKEN=secret": "x"}, None, "environment variable name 'TOKEN=…' contains '='"),
        (["true"], {"": "x"}, None, "an environment variable name is empty"),
        (["true"], None, "/tmp\0/x", "the working directory contains a NUL character"),
    ],
    ids=["program", "argument", "env-value", "env-name-nul", "env-name-equals", "env-name-empty", "cwd"],
)
@pytest.mark.parametrize("inherit_env", [True, False])
async def test_what_exec_cannot_carry_is_refused_with_a_typed_error_that_names_no_value(
    argv: list[str], env: dict[str, str] | None, cwd: str | None, reason: str, inherit_env: bool
) -> None:
    async with assert_no_leaks():
        with pytest.raises(AgentSpawnError) as caught:
            async with open_agent_process(argv, env=env, cwd=cwd, inherit_env=inherit_env):
                pytest.fail("the block must not run")
    assert caught.value.reason == reason
    assert caught.value.command == tuple(argv)
    assert "secret" not in str(caught.value)
    assert "sec\0ret" not in str(caught.value)


# Any text, lone surrogates and NULs included: what a caller might hand over, and what exec cannot take.
EXEC_TEXT = st.text(st.characters(exclude_categories=()), max_size=8)


def exec_refuses(text: str) -> bool:
    """Whether exec cannot carry ``text``: a NUL, or a character the file system encoding cannot encode."""
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        return True
    return "\0" in text


async def read_to_end(stream: anyio.abc.ByteReceiveStream) -> bytes:
    with anyio.fail_after(WAIT):
        return b"".join([chunk async for chunk in stream])


@pytest.mark.fuzz
@given(env=st.dictionaries(EXEC_TEXT, EXEC_TEXT, max_size=4))
async def test_any_exact_environment_reaches_the_agent_byte_for_byte_or_is_refused_with_a_typed_error(
    env: dict[str, str],
) -> None:
    argv = ["/usr/bin/env", "-0"]
    if any(
        not name or "=" in name or exec_refuses(name) or exec_refuses(value) for name, value in env.items()
    ):
        with pytest.raises(AgentSpawnError):
            async with open_agent_process(argv, env=env, inherit_env=False):
                pytest.fail("the block must not run")
        return
    async with open_agent_process(argv, env=env, inherit_env=False) as proc:
        output = await read_to_end(proc.stdout)
    received = dict(entry.partition(b"=")[::2] for entry in output.split(b"\0") if entry)
    assert received == {os.fsencode(name): os.fsencode(value) for name, value in env.items()}


@pytest.mark.fuzz
@given(args=st.lists(EXEC_TEXT, max_size=4))
async def test_any_arguments_reach_the_agent_byte_for_byte_or_are_refused_with_a_typed_error(
    args: list[str],
) -> None:
    argv = ["/usr/bin/printf", "%s\\0", "first", *args]
    refused = [index for index, arg in enumerate(argv) if exec_refuses(arg)]
    if refused:
        with pytest.raises(AgentSpawnError) as caught:
            async with open_agent_process(argv):
                pytest.fail("the block must not run")
        assert caught.value.reason.startswith(f"argument {refused[0]} ")
        return
    async with open_agent_process(argv) as proc:
        output = await read_to_end(proc.stdout)
    assert output.split(b"\0")[:-1] == [b"first", *map(os.fsencode, args)]


# -- the supervisor itself ---------------------------------------------------------------------------


async def test_a_sigkilled_supervisor_hangs_nothing_and_the_agent_s_status_is_reported_unknown() -> None:
    async with assert_no_leaks():
        async with open_agent_process(
            fixture_argv("ignores_stdin_eof.py"),
            stdin_close_timeout=SHORT_GRACE,
            sigterm_timeout=GENEROUS_GRACE,
        ) as proc:
            assert await read_line(proc.stdout) == b"ready"
            assert proc.supervisor_pid is not None
            os.kill(proc.supervisor_pid, signal.SIGKILL)
        # The group is still reached without the supervisor: SIGTERM to it ends the agent.
        assert proc.teardown_report == TeardownReport(
            steps=STDIN_THEN_SIGTERM, exited_before_teardown=False, group_gone=True
        )
        info = proc.exit_info()
        assert info is not None
        assert (info.returncode, info.status_known, info.killed_by) == (UNKNOWN_RETURNCODE, False, None)
        assert (info.status, info.via) == (
            "ended with an unknown status",
            "via a supervisor that died before reporting its exit",
        )
        assert not running(proc.pid)


async def test_a_stopped_supervisor_is_killed_as_a_last_resort_and_teardown_still_ends() -> None:
    async with assert_no_leaks():
        async with open_agent_process(
            fixture_argv("ignores_sigterm.py"),
            stdin_close_timeout=SHORT_GRACE,
            sigterm_timeout=SHORT_GRACE,
            # Sat out once (the stopped supervisor reaps nothing), then the wait for the last resort to work.
            sigkill_timeout=HANDLER_GRACE,
        ) as proc:
            assert await read_line(proc.stdout) == b"ready"
            assert proc.supervisor_pid is not None
            os.kill(proc.supervisor_pid, signal.SIGSTOP)
        assert proc.teardown_report == TeardownReport(
            steps=ALL_THREE_STEPS, exited_before_teardown=False, group_gone=True
        )
        assert_no_such_process(proc.supervisor_pid)
        assert not running(proc.pid)


async def test_the_supervisor_stays_small() -> None:
    async with assert_no_leaks(), open_agent_process(fixture_argv("ignores_stdin_eof.py")) as proc:
        assert await read_line(proc.stdout) == b"ready"
        rss_kib = resident_kib(proc.supervisor_pid or 0)
    # About 9 MiB measured (4 MiB proportional, the interpreter's pages being shared): a bare interpreter
    # plus ctypes. Importing this package would double it.
    assert rss_kib < 20 * 1024


async def test_the_agent_runs_as_the_supervisor_s_child_in_a_group_and_session_of_its_own_making() -> None:
    async with assert_no_leaks(), open_agent_process(fixture_argv("ignores_stdin_eof.py")) as proc:
        assert await read_line(proc.stdout) == b"ready"
        agent, supervisor = process_info(proc.pid), process_info(proc.supervisor_pid or 0)
        assert agent is not None
        assert supervisor is not None
        assert (agent.ppid, agent.pgrp) == (proc.supervisor_pid, proc.pid)
        assert (supervisor.ppid, supervisor.pgrp) == (os.getpid(), proc.supervisor_pid)


async def run_supervisor_script(parent_pid: int, *argv: str) -> tuple[int, list[str], bytes, bytes]:
    """Run _supervisor.py as a script (as on a remote node): its status, status lines, stdout, stderr."""
    read_end, write_end = os.pipe()
    command = [sys.executable, "-I", "-S", str(SUPERVISOR_SCRIPT), "--status-fd", str(write_end)]
    try:
        with anyio.fail_after(WAIT):
            result = await anyio.run_process(
                [*command, "--parent-pid", str(parent_pid), "--", *argv], pass_fds=(write_end,), check=False
            )
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as status:
        lines = status.read().decode().splitlines()
    return result.returncode, lines, result.stdout, result.stderr


async def test_run_as_a_script_it_reports_the_agent_s_pid_then_its_exit_on_the_status_pipe() -> None:
    async with assert_no_leaks():
        returncode, lines, stdout, stderr = await run_supervisor_script(
            os.getpid(), *fixture_argv("exit_with_status.py", "3", "last words")
        )
    assert returncode == 0
    assert [line.split()[0] for line in lines] == ["pid", "exit"]
    assert lines[1] == "exit 3"
    assert (stdout, stderr) == (b"", b"last words\n")


async def test_run_as_a_script_it_reports_an_exec_failure_and_exits_127() -> None:
    async with assert_no_leaks():
        returncode, lines, _, _ = await run_supervisor_script(os.getpid(), "/nonexistent/agent")
    assert (returncode, lines) == (127, ["error 2 No such file or directory"])


async def test_a_supervisor_whose_parent_is_already_gone_starts_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    async with assert_no_leaks():
        # Its parent is this process, not pid 1: as if the real parent had died and it had been re-parented.
        returncode, lines, _, _ = await run_supervisor_script(1, "touch", str(marker))
    assert (returncode, lines) == (1, [])
    assert not marker.exists()


async def test_bad_usage_of_the_supervisor_script_exits_2_with_the_usage() -> None:
    async with assert_no_leaks():
        returncode, lines, _, stderr = await run_supervisor_script(os.getpid())
    assert (returncode, lines) == (2, [])
    assert stderr == b"usage: _supervisor.py --status-fd FD --parent-pid PID -- ARGV...\n"


async def test_teardown_s_sigterm_reaches_the_agent_exactly_once() -> None:
    # Relayed by the supervisor alone, not also sent to the group from here: a second SIGTERM makes some
    # programs skip their clean-up.
    async with assert_no_leaks():
        async with open_agent_process(
            fixture_argv("reports_sigterm.py"), stdin_close_timeout=SHORT_GRACE, sigterm_timeout=HANDLER_GRACE
        ) as proc:
            assert await read_line(proc.stdout) == b"ready"
        assert proc.teardown_report == TeardownReport(
            steps=ALL_THREE_STEPS, exited_before_teardown=False, group_gone=True
        )
        assert proc.stderr_tail() == "SIGTERM\n"


async def test_a_sigterm_sent_to_the_supervisor_by_anyone_stops_the_whole_tree() -> None:
    async with assert_no_leaks():
        async with open_agent_process(
            fixture_argv("escaping_descendants.py", "exit-on-stdin-eof", "obey-sigterm"),
            stdin_close_timeout=GENEROUS_GRACE,
        ) as proc:
            _, *helper_pids = map(int, (await read_line(proc.stdout)).split())
            assert proc.supervisor_pid is not None
            os.kill(proc.supervisor_pid, signal.SIGTERM)
            with anyio.fail_after(WAIT):
                info = await proc.wait_exit()
            assert (info.returncode, info.teardown_signal) == (-signal.SIGTERM, None)
        # Everything was gone before teardown began: closing stdin was all it had to do.
        assert proc.teardown_report == TeardownReport(
            steps=(TeardownStep.CLOSE_STDIN,), exited_before_teardown=True, group_gone=True
        )
        for pid in (proc.supervisor_pid, *helper_pids):
            assert_no_such_process(pid)


async def test_an_agent_starts_with_no_signal_blocked_whatever_the_spawning_thread_blocked() -> None:
    # A Ray worker's event-loop thread blocks SIGINT; a blocked signal survives fork and exec.
    program = "print(next(line.strip() for line in open('/proc/self/status') if line.startswith('SigBlk')))"
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        async with assert_no_leaks(), open_agent_process([sys.executable, "-c", program]) as process:
            printed = b""
            with anyio.fail_after(WAIT):
                while not printed.endswith(b"\n"):
                    printed += await process.stdout.receive()
                info = await process.wait_exit()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    assert printed == b"SigBlk:\t0000000000000000\n"
    assert info.returncode == 0
