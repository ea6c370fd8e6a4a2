"""The client side of ``terminal/*``: real commands on asyncio and trio, owned from spawn to reap.

Every test that spawns runs inside ``assert_no_leaks()``: no file descriptor, descendant or tagged orphan may
outlive it. Nothing sleeps to wait for something: a test waits for the event itself (the exit, or a line of
output through ``TerminalHost.wait_for_output``) under ``anyio.fail_after``.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from subagent.acp import AgentSpawnError, RequestError, schema
from subagent.acp.handlers import FsSandbox
from subagent.acp.terminals import (
    DEFAULT_OUTPUT_BYTE_LIMIT,
    MAX_OUTPUT_BYTE_LIMIT,
    TerminalHost,
    _OutputTail,
)
from subagent.acp.transports import open_agent_process
from tests.leaks import assert_no_leaks, process_is_gone

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

INVALID_PARAMS = -32602
METHOD_NOT_FOUND = -32601
INTERNAL_ERROR = -32603
RESOURCE_NOT_FOUND = -32002

SESSION = "sess-1"
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "terminals"
# Bounds every wait for an event: a hang guard, generous because a loaded machine starts interpreters slowly.
EVENT_TIMEOUT = 30
# For tests whose command outlasts SIGTERM: short enough to keep the module fast.
SHORT_GRACE = 0.3
# A command that prints "started" and then runs until a signal ends it.
LONG_RUNNING = "import signal; print('started', flush=True); signal.pause()"
# The same, but SIGTERM is ignored: only SIGKILL ends it.
IGNORES_SIGTERM = (
    "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('started', flush=True); "
    "signal.pause()"
)
PRINT_PID = "import os, signal; print(os.getpid(), flush=True); signal.pause()"


@pytest.fixture
async def host() -> AsyncIterator[TerminalHost]:
    """A host with the defaults, closed (and checked to have left nothing behind) after the test."""
    async with assert_no_leaks(), TerminalHost() as terminal_host:
        yield terminal_host


def python(code: str, **fields: Any) -> schema.CreateTerminalRequest:
    """A create request running ``code`` with this interpreter."""
    return schema.CreateTerminalRequest(
        session_id=SESSION, command=sys.executable, args=["-c", code], **fields
    )


async def start(host: TerminalHost, request: schema.CreateTerminalRequest) -> str:
    with anyio.fail_after(EVENT_TIMEOUT):
        return (await host.create(request)).terminal_id


async def output_of(host: TerminalHost, terminal_id: str) -> schema.TerminalOutputResponse:
    return await host.output(schema.TerminalOutputRequest(session_id=SESSION, terminal_id=terminal_id))


async def wait_exit(host: TerminalHost, terminal_id: str) -> schema.WaitForTerminalExitResponse:
    request = schema.WaitForTerminalExitRequest(session_id=SESSION, terminal_id=terminal_id)
    with anyio.fail_after(EVENT_TIMEOUT):
        return await host.wait_for_exit(request)


async def kill(host: TerminalHost, terminal_id: str) -> None:
    with anyio.fail_after(EVENT_TIMEOUT):
        await host.kill(schema.KillTerminalRequest(session_id=SESSION, terminal_id=terminal_id))


async def release(host: TerminalHost, terminal_id: str) -> None:
    with anyio.fail_after(EVENT_TIMEOUT):
        await host.release(schema.ReleaseTerminalRequest(session_id=SESSION, terminal_id=terminal_id))


async def wait_for_output(host: TerminalHost, terminal_id: str, done: Callable[[str], bool]) -> str:
    """The output once ``done(output)`` holds."""
    request = schema.TerminalOutputRequest(session_id=SESSION, terminal_id=terminal_id)
    with anyio.fail_after(EVENT_TIMEOUT):
        text = (await host.wait_for_output(request, done)).output
    assert done(text), f"the output ended before the awaited text arrived: {text!r}"
    return text


async def first_line(host: TerminalHost, terminal_id: str) -> str:
    """The command's first line of output, without its newline, once it is there."""
    text = await wait_for_output(host, terminal_id, lambda out: "\n" in out)
    return text.partition("\n")[0]


async def refused(coro: Any) -> RequestError:
    with anyio.fail_after(EVENT_TIMEOUT), pytest.raises(RequestError) as caught:
        await coro
    return caught.value


# -- running a command -------------------------------------------------------------------------------


async def test_a_command_s_output_and_exit_code_are_reported_once_it_exits(host: TerminalHost) -> None:
    terminal_id = await start(host, python("print('hi'); import sys; sys.exit(3)"))

    assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=3)
    assert await output_of(host, terminal_id) == schema.TerminalOutputResponse(
        output="hi\n", truncated=False, exit_status=schema.TerminalExitStatus(exit_code=3)
    )
    await release(host, terminal_id)


async def test_stderr_is_interleaved_with_stdout_in_the_order_written(host: TerminalHost) -> None:
    code = (
        "import sys\n"
        "for stream, text in [(sys.stdout, 'out 1'), (sys.stderr, 'err 1'), (sys.stdout, 'out 2'),"
        " (sys.stderr, 'err 2')]:\n"
        "    print(text, file=stream, flush=True)\n"
    )
    terminal_id = await start(host, python(code))

    assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=0)
    assert (await output_of(host, terminal_id)).output == "out 1\nerr 1\nout 2\nerr 2\n"


async def test_env_entries_are_merged_over_the_client_environment_and_cwd_is_honoured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TERMINAL_TEST_INHERITED", "from the client")
    monkeypatch.setenv("TERMINAL_TEST_OVERRIDDEN", "from the client")
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    code = (
        "import os\n"
        "for name in ['TERMINAL_TEST_INHERITED', 'TERMINAL_TEST_OVERRIDDEN', 'TERMINAL_TEST_ADDED']:\n"
        "    print(name, '=', os.environ.get(name))\n"
        "print(os.getcwd())\n"
    )
    env = [
        schema.EnvVariable(name="TERMINAL_TEST_OVERRIDDEN", value="from the agent"),
        schema.EnvVariable(name="TERMINAL_TEST_ADDED", value="new"),
    ]
    async with assert_no_leaks(), TerminalHost(sandbox=FsSandbox([tmp_path])) as host:
        terminal_id = await start(host, python(code, env=env, cwd=str(workdir)))
        assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=0)
        assert (await output_of(host, terminal_id)).output == (
            "TERMINAL_TEST_INHERITED = from the client\n"
            "TERMINAL_TEST_OVERRIDDEN = from the agent\n"
            "TERMINAL_TEST_ADDED = new\n"
            f"{workdir}\n"
        )


async def test_a_host_with_its_own_base_environment_gives_commands_that_environment_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TERMINAL_TEST_SECRET", "must not leak")
    code = "import os; print(sorted(k for k in os.environ if k.startswith('TERMINAL_TEST')))"
    base = {"PATH": os.environ["PATH"], "TERMINAL_TEST_BASE": "1"}
    async with assert_no_leaks(), TerminalHost(env=base, cwd=tmp_path) as host:
        terminal_id = await start(
            host, python(code, env=[schema.EnvVariable(name="TERMINAL_TEST_X", value="")])
        )
        assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=0)
        assert (await output_of(host, terminal_id)).output == "['TERMINAL_TEST_BASE', 'TERMINAL_TEST_X']\n"


async def test_without_a_cwd_a_command_runs_in_the_first_sandbox_root(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    async with assert_no_leaks(), TerminalHost(sandbox=FsSandbox([first, second])) as host:
        assert host.cwd == str(first)
        terminal_id = await start(host, python("import os; print(os.getcwd())"))
        assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=0)
        assert (await output_of(host, terminal_id)).output == f"{first}\n"


async def test_a_command_reading_stdin_sees_end_of_file_instead_of_hanging(host: TerminalHost) -> None:
    terminal_id = await start(host, python("import sys; print(repr(sys.stdin.read()))"))

    assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=0)
    assert (await output_of(host, terminal_id)).output == "''\n"


async def test_a_command_killed_by_its_own_signal_reports_the_signal_name(host: TerminalHost) -> None:
    terminal_id = await start(host, python("import os, signal; os.kill(os.getpid(), signal.SIGUSR1)"))

    assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(signal="SIGUSR1")
    assert (await output_of(host, terminal_id)).exit_status == schema.TerminalExitStatus(signal="SIGUSR1")


async def test_a_command_starts_with_sigpipe_and_sigxfsz_not_ignored(host: TerminalHost) -> None:
    # Python ignores both at start-up and exec keeps ignored signals ignored: the trampoline must reset them.
    request = schema.CreateTerminalRequest(
        session_id=SESSION, command="grep", args=["^SigIgn:", "/proc/self/status"]
    )
    terminal_id = await start(host, request)

    assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=0)
    ignored = int((await output_of(host, terminal_id)).output.split()[1], 16)
    assert ignored & (1 << (signal.SIGPIPE - 1)) == 0
    assert ignored & (1 << (signal.SIGXFSZ - 1)) == 0


async def test_output_of_a_running_command_has_no_exit_status_yet(host: TerminalHost) -> None:
    terminal_id = await start(host, python(LONG_RUNNING))

    assert await first_line(host, terminal_id) == "started"
    assert await output_of(host, terminal_id) == schema.TerminalOutputResponse(
        output="started\n", truncated=False, exit_status=None
    )
    await release(host, terminal_id)


# -- output limits -----------------------------------------------------------------------------------


# "xy€abc": x y (1 byte each), € (3 bytes: e2 82 ac), a b c: 8 bytes in all.
EURO_LINE = "import sys; sys.stdout.buffer.write(b'xy\\xe2\\x82\\xacabc')"


@pytest.mark.parametrize(
    ("limit", "expected", "truncated"),
    [
        pytest.param(8, "xy€abc", False, id="exactly-at-the-limit"),
        pytest.param(6, "€abc", True, id="cut-between-characters"),
        pytest.param(5, "abc", True, id="euro-straddles-the-limit"),
        pytest.param(4, "abc", True, id="euro-straddles-the-limit-by-one-byte"),
        pytest.param(0, "", True, id="nothing-retained"),
    ],
)
async def test_output_is_truncated_from_the_start_at_a_character_boundary(
    host: TerminalHost, limit: int, expected: str, truncated: bool
) -> None:
    terminal_id = await start(host, python(EURO_LINE, output_byte_limit=limit))

    assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=0)
    assert await output_of(host, terminal_id) == schema.TerminalOutputResponse(
        output=expected, truncated=truncated, exit_status=schema.TerminalExitStatus(exit_code=0)
    )


def flood_line(i: int) -> str:
    """Line ``i`` of the flood below: a number, then ten 3-byte characters."""
    return f"{i:06d}" + "€" * 10 + "\n"


async def test_a_large_output_keeps_exactly_its_last_bytes_under_the_default_limit(
    host: TerminalHost,
) -> None:
    lines = 60000  # 37 bytes each: about twice the 1 MiB default
    code = f"import sys\nfor i in range({lines}):\n    sys.stdout.write(f'{{i:06d}}' + '€' * 10 + '\\n')\n"
    full = "".join(flood_line(i) for i in range(lines)).encode()
    terminal_id = await start(host, python(code))

    assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=0)
    answer = await output_of(host, terminal_id)
    assert answer.truncated is True
    retained = answer.output.encode()
    assert DEFAULT_OUTPUT_BYTE_LIMIT - 3 < len(retained) <= DEFAULT_OUTPUT_BYTE_LIMIT  # one character at most
    assert full.endswith(retained)


async def test_a_character_split_across_writes_is_shown_only_once_whole(host: TerminalHost) -> None:
    # Writes "x" and the first two bytes of "€", waits for SIGUSR1, then writes the last byte and "!".
    code = (
        "import os, signal, sys\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
        "out = sys.stdout.buffer\n"
        "out.write(b'%d\\nx\\xe2\\x82' % os.getpid()); out.flush()\n"
        "signal.sigwait({signal.SIGUSR1})\n"
        "out.write(b'\\xac!'); out.flush()\n"
    )
    terminal_id = await start(host, python(code))
    text = await wait_for_output(host, terminal_id, lambda out: out.endswith("x"))
    pid = int(text.partition("\n")[0])
    assert text == f"{pid}\nx"  # the half character is held back, not shown as U+FFFD

    os.kill(pid, signal.SIGUSR1)

    assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=0)
    assert (await output_of(host, terminal_id)).output == f"{pid}\nx€!"


async def test_invalid_utf8_and_a_character_cut_off_by_the_exit_become_replacement_characters(
    host: TerminalHost,
) -> None:
    terminal_id = await start(
        host, python("import sys; sys.stdout.buffer.write(b'bad \\xff end \\xe2\\x82')")
    )

    assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=0)
    assert (await output_of(host, terminal_id)).output == "bad \ufffd end \ufffd"


async def test_an_output_byte_limit_above_the_host_maximum_is_clamped(tmp_path: Path) -> None:
    async with (
        assert_no_leaks(),
        TerminalHost(cwd=tmp_path, max_output_byte_limit=4, default_output_byte_limit=2) as host,
    ):
        clamped = await start(host, python("print('abcdefgh', end='')", output_byte_limit=1000))
        default = await start(host, python("print('abcdefgh', end='')"))
        await wait_exit(host, clamped)
        await wait_exit(host, default)
        assert (await output_of(host, clamped)).output == "efgh"
        assert (await output_of(host, default)).output == "gh"


# -- kill and release --------------------------------------------------------------------------------


async def test_kill_ends_a_long_running_command_and_the_terminal_stays_valid_until_released(
    host: TerminalHost,
) -> None:
    terminal_id = await start(host, python(PRINT_PID))
    pid = int(await first_line(host, terminal_id))

    await kill(host, terminal_id)

    assert process_is_gone(pid)
    killed = schema.TerminalOutputResponse(
        output=f"{pid}\n", truncated=False, exit_status=schema.TerminalExitStatus(signal="SIGTERM")
    )
    assert await output_of(host, terminal_id) == killed
    assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(signal="SIGTERM")
    await kill(host, terminal_id)  # a second kill changes nothing
    assert await output_of(host, terminal_id) == killed
    assert host.open_terminals == 1
    await release(host, terminal_id)
    assert host.open_terminals == 0


async def test_kill_escalates_to_sigkill_when_the_command_ignores_sigterm(tmp_path: Path) -> None:
    async with assert_no_leaks(), TerminalHost(cwd=tmp_path, kill_grace=SHORT_GRACE) as host:
        terminal_id = await start(host, python(IGNORES_SIGTERM))
        assert await first_line(host, terminal_id) == "started"

        await kill(host, terminal_id)

        assert await output_of(host, terminal_id) == schema.TerminalOutputResponse(
            output="started\n", truncated=False, exit_status=schema.TerminalExitStatus(signal="SIGKILL")
        )


async def test_kill_after_a_command_exited_keeps_its_exit_code(host: TerminalHost) -> None:
    terminal_id = await start(host, python("raise SystemExit(5)"))
    assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=5)

    await kill(host, terminal_id)

    assert (await output_of(host, terminal_id)).exit_status == schema.TerminalExitStatus(exit_code=5)


async def test_release_of_a_running_command_kills_it_and_its_id_is_unknown_afterwards(
    host: TerminalHost,
) -> None:
    terminal_id = await start(host, python(PRINT_PID))
    pid = int(await first_line(host, terminal_id))

    await release(host, terminal_id)

    assert process_is_gone(pid)
    assert host.open_terminals == 0
    calls = [
        host.output(schema.TerminalOutputRequest(session_id=SESSION, terminal_id=terminal_id)),
        host.wait_for_exit(schema.WaitForTerminalExitRequest(session_id=SESSION, terminal_id=terminal_id)),
        host.kill(schema.KillTerminalRequest(session_id=SESSION, terminal_id=terminal_id)),
        host.release(schema.ReleaseTerminalRequest(session_id=SESSION, terminal_id=terminal_id)),
    ]
    for call in calls:
        error = await refused(call)
        assert error.code == INVALID_PARAMS
        assert error.data["terminalId"] == terminal_id
        assert "released" in error.data["reason"]


async def test_a_terminal_is_unknown_to_another_session(host: TerminalHost) -> None:
    terminal_id = await start(host, python("pass"))

    error = await refused(
        host.output(schema.TerminalOutputRequest(session_id="other", terminal_id=terminal_id))
    )

    assert error.code == INVALID_PARAMS
    assert error.data["terminalId"] == terminal_id
    await release(host, terminal_id)


async def test_a_grandchild_holding_the_output_pipe_is_gone_after_release(tmp_path: Path) -> None:
    command = [str(FIXTURES / "background_job.py"), "exit"]
    async with assert_no_leaks(), TerminalHost(cwd=tmp_path, kill_grace=SHORT_GRACE) as host:
        terminal_id = await start(
            host, schema.CreateTerminalRequest(session_id=SESSION, command=sys.executable, args=command)
        )
        child_pid, grandchild_pid = map(int, (await first_line(host, terminal_id)).split())
        # The command exited; its background job still holds the pipe, so the status comes after a settle.
        assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=0)
        assert process_is_gone(child_pid)
        assert not process_is_gone(grandchild_pid)

        await release(host, terminal_id)

        assert process_is_gone(grandchild_pid)


async def test_a_grandchild_is_gone_after_aclose(tmp_path: Path) -> None:
    command = [str(FIXTURES / "background_job.py"), "wait"]
    async with assert_no_leaks():
        async with TerminalHost(cwd=tmp_path, kill_grace=SHORT_GRACE) as host:
            terminal_id = await start(
                host, schema.CreateTerminalRequest(session_id=SESSION, command=sys.executable, args=command)
            )
            child_pid, grandchild_pid = map(int, (await first_line(host, terminal_id)).split())
            assert not process_is_gone(grandchild_pid)
        assert process_is_gone(child_pid)
        assert process_is_gone(grandchild_pid)


# -- refusals ----------------------------------------------------------------------------------------


async def test_a_cwd_outside_the_roots_is_refused_and_nothing_is_spawned(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "escape").symlink_to(outside, target_is_directory=True)
    marker = outside / "marker"
    create_marker = f"open({str(marker)!r}, 'w').close()"
    async with assert_no_leaks(), TerminalHost(sandbox=FsSandbox([root])) as host:
        for cwd in [str(outside), str(root / "escape"), str(root / ".." / "outside")]:
            error = await refused(host.create(python(create_marker, cwd=cwd)))
            assert error.code == INVALID_PARAMS
            assert error.data == {
                "path": cwd,
                "reason": "the path is outside the directories this agent may access",
            }
        assert host.open_terminals == 0
    assert not marker.exists()


async def test_a_relative_cwd_is_refused(host: TerminalHost) -> None:
    error = await refused(host.create(python("pass", cwd="relative/dir")))

    assert error.code == INVALID_PARAMS
    assert error.data == {"path": "relative/dir", "reason": "the cwd must be an absolute path"}


async def test_a_missing_cwd_is_resource_not_found(host: TerminalHost, tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")

    error = await refused(host.create(python("pass", cwd=missing)))

    assert error.code == RESOURCE_NOT_FOUND
    assert error.data == {"path": missing, "reason": "the cwd does not exist"}


async def test_a_missing_executable_is_resource_not_found(host: TerminalHost, tmp_path: Path) -> None:
    on_path = schema.CreateTerminalRequest(session_id=SESSION, command="no-such-command-for-terminal-tests")
    by_path = schema.CreateTerminalRequest(session_id=SESSION, command=str(tmp_path / "no-such-program"))

    for request in (on_path, by_path):
        error = await refused(host.create(request))
        assert error.code == RESOURCE_NOT_FOUND
        assert error.message == f"Command not found: {request.command}"
        assert error.data["command"] == request.command
    assert host.open_terminals == 0


async def test_a_program_that_is_not_executable_is_invalid_params(host: TerminalHost, tmp_path: Path) -> None:
    script = tmp_path / "script.sh"
    script.write_text("echo hi\n")

    error = await refused(host.create(schema.CreateTerminalRequest(session_id=SESSION, command=str(script))))

    assert error.code == INVALID_PARAMS
    assert error.data == {"command": str(script), "reason": f"{str(script)!r} is not executable"}


async def test_a_program_exec_cannot_run_reports_exit_126_and_the_reason_in_the_output(
    host: TerminalHost, tmp_path: Path
) -> None:
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x7fELF but not really")
    garbage.chmod(garbage.stat().st_mode | stat.S_IXUSR)

    terminal_id = await start(host, schema.CreateTerminalRequest(session_id=SESSION, command=str(garbage)))

    assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=126)
    assert (await output_of(host, terminal_id)).output == f"cannot run {str(garbage)!r}: Exec format error\n"


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        pytest.param({"args": ["a\0b"]}, "the argument contains a NUL character", id="nul-in-argument"),
        pytest.param(
            {"env": [schema.EnvVariable(name="A=B", value="x")]},
            "an environment variable name must be non-empty without '='",
            id="equals-in-env-name",
        ),
        pytest.param({"output_byte_limit": -1}, "outputByteLimit must not be negative", id="negative-limit"),
        pytest.param({"command": ""}, "the command must not be empty", id="empty-command"),
    ],
)
async def test_a_malformed_create_request_is_invalid_params(
    host: TerminalHost, fields: dict[str, Any], reason: str
) -> None:
    request = msgspec.structs.replace(
        schema.CreateTerminalRequest(session_id=SESSION, command=sys.executable), **fields
    )

    error = await refused(host.create(request))

    assert error.code == INVALID_PARAMS
    assert error.data["reason"] == reason
    assert host.open_terminals == 0


async def test_the_live_terminal_cap_refuses_one_more_until_one_is_released(tmp_path: Path) -> None:
    async with assert_no_leaks(), TerminalHost(cwd=tmp_path, max_terminals=2) as host:
        first = await start(host, python(LONG_RUNNING))
        second = await start(host, python("pass"))
        assert await wait_exit(host, second) == schema.WaitForTerminalExitResponse(exit_code=0)

        error = await refused(host.create(python(LONG_RUNNING)))  # a finished, unreleased one still counts

        assert error.code == INTERNAL_ERROR
        assert error.message == "Too many open terminals"
        assert error.data == {"reason": "2 terminals are open; release one first", "limit": 2}
        await release(host, second)
        third = await start(host, python(LONG_RUNNING))
        assert host.open_terminals == 2
        assert len({first, second, third}) == 3  # ids are never reused


# -- cancellation and closing ------------------------------------------------------------------------


async def test_a_cancelled_wait_for_exit_leaves_the_terminal_intact(host: TerminalHost) -> None:
    terminal_id = await start(host, python(LONG_RUNNING))
    assert await first_line(host, terminal_id) == "started"

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(
                host.wait_for_exit,
                schema.WaitForTerminalExitRequest(session_id=SESSION, terminal_id=terminal_id),
            )
            await anyio.wait_all_tasks_blocked()
            scope.cancel()

    assert scope.cancelled_caught
    assert await output_of(host, terminal_id) == schema.TerminalOutputResponse(
        output="started\n", truncated=False, exit_status=None
    )
    await kill(host, terminal_id)
    assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(signal="SIGTERM")
    await release(host, terminal_id)


async def test_a_wait_for_exit_in_progress_returns_when_the_terminal_is_released(host: TerminalHost) -> None:
    terminal_id = await start(host, python(LONG_RUNNING))
    results: list[schema.WaitForTerminalExitResponse] = []

    async def waiter() -> None:
        results.append(await wait_exit(host, terminal_id))

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        await release(host, terminal_id)

    assert results == [schema.WaitForTerminalExitResponse(signal="SIGTERM")]


async def test_a_create_cancelled_before_it_begins_starts_nothing(host: TerminalHost, tmp_path: Path) -> None:
    marker = tmp_path / "marker"

    with anyio.CancelScope() as scope:
        scope.cancel()
        await host.create(python(f"open({str(marker)!r}, 'w').close()"))

    assert scope.cancelled_caught
    assert host.open_terminals == 0
    assert not marker.exists()


async def test_requests_served_from_other_tasks_reach_the_host_s_terminals(host: TerminalHost) -> None:
    # A connection serves each request in a task of its own, outside the host's task group.
    answers: list[schema.WaitForTerminalExitResponse] = []

    async def handler() -> None:
        terminal_id = await start(host, python("raise SystemExit(7)"))
        answers.append(await wait_exit(host, terminal_id))
        await release(host, terminal_id)

    async with anyio.create_task_group() as handlers:
        handlers.start_soon(handler)
        handlers.start_soon(handler)

    assert answers == [schema.WaitForTerminalExitResponse(exit_code=7)] * 2
    assert host.open_terminals == 0


async def test_wait_for_output_returns_once_the_output_can_grow_no_more(host: TerminalHost) -> None:
    terminal_id = await start(host, python("print('only this')"))
    request = schema.TerminalOutputRequest(session_id=SESSION, terminal_id=terminal_id)

    with anyio.fail_after(EVENT_TIMEOUT):
        answer = await host.wait_for_output(request, lambda text: "never printed" in text)

    assert answer.output == "only this\n"
    assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=0)


async def test_aclose_with_several_running_terminals_leaves_no_process_or_descriptor(tmp_path: Path) -> None:
    async with assert_no_leaks():
        host = TerminalHost(cwd=tmp_path, kill_grace=SHORT_GRACE)
        async with host:
            ids = [await start(host, python(PRINT_PID)) for _ in range(3)]
            stubborn = await start(
                host,
                python(
                    "import os, signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                    "print(os.getpid(), flush=True); signal.pause()"
                ),
            )
            finished = await start(host, python("pass"))
            pids = [int(await first_line(host, terminal_id)) for terminal_id in [*ids, stubborn]]
            await wait_exit(host, finished)
            with anyio.fail_after(EVENT_TIMEOUT), anyio.CancelScope() as scope:
                scope.cancel()  # aclose is shielded: an already cancelled caller still gets a full close
                await host.aclose()
            assert host.closed
            assert host.open_terminals == 0
            assert all(process_is_gone(pid) for pid in pids)
            error = await refused(host.create(python("pass")))
            assert error.code == INTERNAL_ERROR
            error = await refused(output_of(host, ids[0]))
            assert error.code == INVALID_PARAMS


async def test_create_before_the_host_is_entered_is_a_programming_error() -> None:
    host = TerminalHost()

    with pytest.raises(RuntimeError, match="async context manager"):
        await host.create(python("pass"))


# -- dispatch from the wire --------------------------------------------------------------------------


async def test_serve_decodes_wire_params_and_dispatches_the_five_methods(host: TerminalHost) -> None:
    def wire(**params: Any) -> bytes:
        return msgspec.json.encode({"sessionId": SESSION, **params})

    created = await host.serve(
        schema.TERMINAL_CREATE,
        wire(command=sys.executable, args=["-c", "print('wire')"], outputByteLimit=100),
    )
    assert isinstance(created, schema.CreateTerminalResponse)
    terminal_id = created.terminal_id
    raw_id = msgspec.Raw(wire(terminalId=terminal_id))

    with anyio.fail_after(EVENT_TIMEOUT):
        waited = await host.serve(schema.TERMINAL_WAIT_FOR_EXIT, raw_id)
    assert schema.encode(waited) == b'{"exitCode":0}'
    output = await host.serve(schema.TERMINAL_OUTPUT, raw_id)
    assert schema.encode(output) == b'{"output":"wire\\n","truncated":false,"exitStatus":{"exitCode":0}}'
    assert schema.encode(await host.serve(schema.TERMINAL_KILL, raw_id)) == b"{}"
    assert schema.encode(await host.serve(schema.TERMINAL_RELEASE, raw_id)) == b"{}"

    unknown = await refused(host.serve("terminal/resize", raw_id))
    assert unknown.code == METHOD_NOT_FOUND
    with pytest.raises(msgspec.ValidationError):
        await host.serve(schema.TERMINAL_CREATE, wire(args=[]))


# -- a hostile agent ----------------------------------------------------------------------------------


def clipped(value: str) -> str:
    """What an error echoes of a long value the agent sent."""
    return value if len(value) <= 256 else f"{value[:256]}... ({len(value)} characters)"


async def test_a_release_whose_kill_is_still_running_keeps_its_slot_until_the_kill_ends(
    tmp_path: Path,
) -> None:
    async with (
        assert_no_leaks(),
        TerminalHost(cwd=tmp_path, max_terminals=1, kill_grace=SHORT_GRACE) as host,
    ):
        terminal_id = await start(host, python(IGNORES_SIGTERM))
        assert await first_line(host, terminal_id) == "started"
        with anyio.CancelScope() as scope:  # the agent cancels its release request at once
            scope.cancel()
            await host.release(schema.ReleaseTerminalRequest(session_id=SESSION, terminal_id=terminal_id))

        error = await refused(host.create(python("pass")))  # the SIGTERM is ignored: the kill is still on

        assert host.open_terminals == 0
        assert error.to_wire() == {
            "code": INTERNAL_ERROR,
            "message": "Too many open terminals",
            "data": {
                "reason": "1 terminals are open or still being killed after release (1 of them); "
                "release one, or let the kills finish",
                "limit": 1,
            },
        }


async def test_a_spawn_failure_is_an_internal_error_with_its_reason_and_frees_its_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    failures = [AgentSpawnError(["x"], "exec failed: Cannot allocate memory")]

    def flaky_open(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return open_agent_process(*args, **kwargs)

    monkeypatch.setattr("subagent.acp.terminals.open_agent_process", flaky_open)
    async with assert_no_leaks(), TerminalHost(cwd=tmp_path, max_terminals=1) as host:
        error = await refused(host.create(python("pass")))
        assert error.to_wire() == {
            "code": INTERNAL_ERROR,
            "message": "Internal error",
            "data": {"command": sys.executable, "reason": "exec failed: Cannot allocate memory"},
        }
        terminal_id = await start(host, python("pass"))  # the failed create gave its slot back
        assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=0)
    assert not [record for record in caplog.records if record.exc_info]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's per-string exec limit")
async def test_an_argument_exec_would_refuse_as_too_long_is_invalid_params(host: TerminalHost) -> None:
    longest = 128 * 1024 - 1  # 32 pages, NUL included
    fits = await start(
        host,
        schema.CreateTerminalRequest(
            session_id=SESSION,
            command=sys.executable,
            args=["-c", "import sys; print(len(sys.argv[1]))", "a" * longest],
        ),
    )
    too_long = schema.CreateTerminalRequest(
        session_id=SESSION, command=sys.executable, args=["-c", "pass", "a" * (longest + 1)]
    )
    env_too_long = python("pass", env=[schema.EnvVariable(name="BIG", value="v" * (longest - 3))])

    argument_error = await refused(host.create(too_long))
    env_error = await refused(host.create(env_too_long))

    assert await wait_exit(host, fits) == schema.WaitForTerminalExitResponse(exit_code=0)
    assert (await output_of(host, fits)).output == f"{longest}\n"
    assert argument_error.code == env_error.code == INVALID_PARAMS
    reason = f"one argument or environment entry is {longest + 1} bytes long; the system allows {longest}"
    assert argument_error.data == {"reason": reason}
    assert env_error.data == {"reason": reason}  # "BIG=" + the value


async def test_a_command_line_over_arg_max_is_invalid_params(host: TerminalHost) -> None:
    arg_max = os.sysconf("SC_ARG_MAX")
    args = ["-c", "pass", *["a" * 100_000] * (arg_max // 100_000 + 2)]
    request = schema.CreateTerminalRequest(session_id=SESSION, command=sys.executable, args=args)

    error = await refused(host.create(request))

    assert error.code == INVALID_PARAMS
    assert error.data["reason"].startswith("the command, its arguments and the environment take ")
    assert error.data["reason"].endswith(f" bytes; the system allows {arg_max}")
    assert host.open_terminals == 0


async def test_refused_values_are_echoed_clipped_and_logged_without_a_traceback(
    host: TerminalHost, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    huge = "x" * 1_000_000
    cases = [
        (
            schema.CreateTerminalRequest(session_id=SESSION, command=sys.executable, args=[huge + "\0"]),
            {"value": clipped(huge + "\0")},
        ),
        (python("pass", env=[schema.EnvVariable(name=huge + "=", value="v")]), {"name": clipped(huge + "=")}),
        (schema.CreateTerminalRequest(session_id=SESSION, command=huge), {"command": clipped(huge)}),
    ]
    for request, echoed in cases:
        error = await refused(host.create(request))
        assert {key: error.data[key] for key in echoed} == echoed
    unknown = await refused(output_of(host, huge))
    assert unknown.data["terminalId"] == clipped(huge)
    assert not [record for record in caplog.records if record.exc_info]
    assert all(len(record.getMessage()) < 2000 for record in caplog.records)


def test_a_host_environment_exec_cannot_carry_is_a_configuration_error() -> None:
    for env in [{"A=B": "x"}, {"": "x"}, {"A\0": "x"}, {"A": "x\0y"}]:
        with pytest.raises(ValueError, match="TerminalHost env"):
            TerminalHost(env=env)


async def test_absurd_output_limits_from_the_wire_are_clamped_defaulted_or_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    code = "import sys; sys.stdout.write('x' * 100)"

    def wire(limit: Any) -> bytes:
        params = {"sessionId": SESSION, "command": sys.executable, "args": ["-c", code]}
        return msgspec.json.encode({**params, "outputByteLimit": limit})

    async with (
        assert_no_leaks(),
        TerminalHost(cwd=tmp_path, max_output_byte_limit=40, default_output_byte_limit=10) as host,
    ):
        retained = {}
        for limit in [10**30, 2**64 - 1, None]:
            created = await host.serve(schema.TERMINAL_CREATE, wire(limit))
            assert isinstance(created, schema.CreateTerminalResponse)
            await wait_exit(host, created.terminal_id)
            retained[repr(limit)] = len((await output_of(host, created.terminal_id)).output)
            await release(host, created.terminal_id)
        negative = await refused(host.serve(schema.TERMINAL_CREATE, wire(-(10**30))))
        mistyped = {}
        for mistyped_limit in [True, 2.5, "lots"]:
            # The connection answers a ValidationError from a handler with invalid params.
            with anyio.fail_after(EVENT_TIMEOUT), pytest.raises(msgspec.ValidationError) as caught:
                await host.serve(schema.TERMINAL_CREATE, wire(mistyped_limit))
            mistyped[repr(mistyped_limit)] = str(caught.value)

    # A huge limit is clamped, null takes the default; a mistyped one is refused (the schema no
    # longer lets a receiver default it).
    assert retained == {repr(10**30): 40, repr(2**64 - 1): 40, "None": 10}
    assert negative.code == INVALID_PARAMS
    assert negative.data == {"outputByteLimit": -(10**30), "reason": "outputByteLimit must not be negative"}
    assert mistyped == {
        repr(limit): f"Expected `int | null`, got `{kind}` - at `$.outputByteLimit`"
        for limit, kind in [(True, "bool"), (2.5, "float"), ("lots", "str")]
    }
    assert not [record for record in caplog.records if record.exc_info]


async def test_a_flood_with_an_absurd_limit_holds_no_more_than_the_maximum(tmp_path: Path) -> None:
    flood = 24 * 1024 * 1024
    code = (
        f"import sys\nblock = b'y' * 65536\nfor _ in range({flood // 65536}):\n"
        "    sys.stdout.buffer.write(block)"
    )
    async with assert_no_leaks(), TerminalHost(cwd=tmp_path) as host:
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            terminal_id = await start(host, python(code, output_byte_limit=2**62))
            assert await wait_exit(host, terminal_id) == schema.WaitForTerminalExitResponse(exit_code=0)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        answer = await output_of(host, terminal_id)
    assert answer.truncated is True
    assert answer.output == "y" * MAX_OUTPUT_BYTE_LIMIT
    # Measured: about 8.4 MiB for the 8 MiB maximum (a single shifted buffer peaked at 18.4 MiB).
    assert peak < MAX_OUTPUT_BYTE_LIMIT + 4 * 1024 * 1024


@pytest.mark.fuzz
@given(
    chunks=st.lists(st.text(alphabet=st.sampled_from("a€🙂é\n"), max_size=12), max_size=30),
    limit=st.integers(min_value=0, max_value=40),
    piece_bytes=st.integers(min_value=1, max_value=16),
)
def test_the_output_tail_keeps_the_last_bytes_cut_between_characters(
    chunks: list[str], limit: int, piece_bytes: int
) -> None:
    tail = _OutputTail(limit, piece_bytes)
    for chunk in chunks:
        tail.append(chunk.encode())
    full = "".join(chunks).encode()
    cut = max(0, len(full) - limit)
    while cut < len(full) and full[cut] & 0xC0 == 0x80:
        cut += 1
    assert tail.text() == full[cut:].decode()
    assert tail.truncated is (len(full) > limit)
