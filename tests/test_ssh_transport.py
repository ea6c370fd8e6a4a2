"""The SSH transport against a real ``sshd`` on loopback (tests/sshd.py starts it with a throwaway key).

Each test runs real processes on asyncio and trio: the local ssh client under our supervisor, sshd's
session, the remote supervisor and the agent. "Nothing left" is asserted by `assert_no_leaks_over_ssh`
(the remote agent carries the leak tag in its environment, passed explicitly: ours is not forwarded)
and, where the point is teardown, on the reported pids themselves. Waits are for events, under
``anyio.fail_after`` as hang guards only.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pwd
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from hypothesis import given
from hypothesis import strategies as st

from subagent.acp import AgentSpawnError, schema
from subagent.acp.client import TurnResult, spawn_agent
from subagent.acp.transports import (
    UNKNOWN_RETURNCODE,
    Channel,
    SshTransport,
    TeardownStep,
    Transport,
    supervision_available,
)
from subagent.acp.transports import transport_from_url as any_transport_from_url
from subagent.acp.transports._ssh import _ReportedEndStream, transport_from_url
from subagent.acp.transports._supervisor import Supervisor
from subagent.testing import LEAK_TAG_VARIABLE, process_info, process_is_gone, stub_agent_argv
from tests.sshd import REQUIRE_SSH_VARIABLE, SshServer, assert_no_leaks_over_ssh, running_sshd, sshd_or_skip

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.subprocess,
    pytest.mark.skipif(not supervision_available(), reason="the supervisor needs Linux"),
]

ROOT = Path(__file__).resolve().parent.parent
PROCS = ROOT / "fixtures" / "procs"
SCENARIOS = ROOT / "fixtures" / "scenarios"
WAIT = 30  # seconds: a hang guard on one step, never a statement about speed
HOME = pwd.getpwuid(os.getuid()).pw_dir
"""The remote login's HOME: from the password database, as sshd sets it (ours may differ)."""
SHORT_GRACE = 0.5  # for a teardown step the agent ignores: it always runs out, and decides nothing


@pytest.fixture(scope="module")
def sshd() -> Iterator[SshServer]:
    """One loopback sshd for the module (it starts in milliseconds, and is gone after the module)."""
    with running_sshd() as server:
        yield server


@pytest.fixture
def transport(sshd: SshServer) -> SshTransport:
    return SshTransport(sshd.host, config_file=sshd.config_file, stdin_close_timeout=SHORT_GRACE)


def fixture_argv(name: str, *args: str) -> list[str]:
    """``fixtures/procs/<name>`` run by this interpreter (loopback: the remote host is this one)."""
    return [sys.executable, str(PROCS / name), *args]


async def read_line(channel: Channel) -> bytes:
    with anyio.fail_after(WAIT):
        return await BufferedByteReceiveStream(channel.stdout).receive_until(b"\n", 64 * 1024)


def running(pid: int) -> bool:
    return not process_is_gone(pid)


async def wait_gone(pids: list[int]) -> list[int]:
    """Wait (bounded) until none of ``pids`` runs; those still running then."""
    with anyio.move_on_after(WAIT):
        while True:
            if not any(running(pid) for pid in pids):
                break
            await anyio.sleep(0.02)  # A poll interval: the wait is bounded above.
    return [pid for pid in pids if running(pid)]


def texts(result: TurnResult) -> list[str]:
    return [
        update.content.text
        for update in result.updates
        if isinstance(update, schema.AgentMessageChunk) and isinstance(update.content, schema.TextContent)
    ]


# -- a whole turn -----------------------------------------------------------------------------------------


async def test_a_stub_agent_turn_over_ssh_streams_the_reply_and_asks_the_local_permission_policy(
    sshd: SshServer, transport: SshTransport, tmp_path: Path
) -> None:
    async with (
        assert_no_leaks_over_ssh(sshd) as tag,
        spawn_agent(
            stub_agent_argv(SCENARIOS / "full_turn.json"),
            env={LEAK_TAG_VARIABLE: tag},
            transport=transport,
            permission="allow",
        ) as client,
    ):
        assert isinstance(client.process, Channel)
        assert client.process.describe().endswith(f"via ssh to {sshd.host}")
        with anyio.fail_after(WAIT):
            await client.initialize()
            session = await client.new_session(tmp_path)
            result = await session.prompt("edit main.py")
    assert result.stop_reason == "end_turn"
    assert "".join(texts(result)) == "Looking at the code.Done: main.py is edited."
    assert result.output == "Done: main.py is edited."


# -- what reaches the remote agent ------------------------------------------------------------------------


async def test_env_and_cwd_reach_the_remote_agent_over_its_login_environment_and_never_a_command_line(
    sshd: SshServer, transport: SshTransport, tmp_path: Path
) -> None:
    secret = "s3cret 'single' \"double\" $HOME `tick` ;|&\n line two \\ é"
    async with assert_no_leaks_over_ssh(sshd) as tag:
        env = {"AGENT_TOKEN": secret, "EMPTY": "", LEAK_TAG_VARIABLE: tag}
        async with transport.open(
            fixture_argv("prints_env_and_cwd.py", "AGENT_TOKEN", "EMPTY", "HOME", "UNSET"),
            env=env,
            cwd=str(tmp_path),
        ) as channel:
            report = json.loads(await read_line(channel))
            with anyio.fail_after(WAIT):
                info = await channel.wait_exit()
    assert report == {
        "cwd": str(tmp_path),
        # HOME comes from the remote login, not from us: the variables given are set over it.
        "env": {"AGENT_TOKEN": secret, "EMPTY": "", "HOME": HOME, "UNSET": None},
    }
    assert (info.returncode, info.status_known, info.via) == (0, True, f"via ssh to {sshd.host}")
    # Neither the argv of ssh here nor the remote command line carries the agent's argv or environment.
    ssh_argv = " ".join(transport.ssh_argv())
    for value in ("s3cret", "AGENT_TOKEN", "prints_env_and_cwd", str(tmp_path)):
        assert value not in ssh_argv


async def test_the_remote_exit_status_and_stderr_are_reported_and_the_supervisor_reports_are_not_shown(
    sshd: SshServer, transport: SshTransport
) -> None:
    seen: list[str] = []
    async with (
        assert_no_leaks_over_ssh(sshd) as tag,
        transport.open(
            # Lines that look like the supervisor's reports, without the per-run marker.
            fixture_argv("exit_with_status.py", "3", "pid 1", "exit 0", "", "boom"),
            env={LEAK_TAG_VARIABLE: tag},
            on_stderr_line=seen.append,
        ) as channel,
    ):
        with anyio.fail_after(WAIT):
            info = await channel.wait_exit()
        remote_pid = channel.remote_pid
    assert (info.returncode, info.status_known, info.pid) == (3, True, remote_pid)
    assert info.stderr_tail == "pid 1\nexit 0\n\nboom\n"
    assert seen == ["pid 1", "exit 0", "", "boom"]
    assert str(info).endswith(
        f"(pid {remote_pid} via ssh to {sshd.host}) exited with status 3; last stderr: pid 1 | exit 0 | boom"
    )


async def test_a_report_after_a_partial_stderr_line_is_still_read_and_the_partial_line_kept(
    sshd: SshServer, transport: SshTransport
) -> None:
    script = "import sys; sys.stderr.write('no newline at the end'); sys.stderr.flush(); sys.exit(4)"
    async with (
        assert_no_leaks_over_ssh(sshd) as tag,
        transport.open([sys.executable, "-c", script], env={LEAK_TAG_VARIABLE: tag}) as channel,
    ):
        with anyio.fail_after(WAIT):
            info = await channel.wait_exit()
    assert (info.returncode, info.status_known) == (4, True)
    assert info.stderr_tail == "no newline at the end\n"


async def test_the_report_marker_is_nowhere_the_agent_can_read_it(
    sshd: SshServer, transport: SshTransport
) -> None:
    # What a process of the same user can read of the agent and of its parent, the remote supervisor.
    script = (
        "import os, sys\n"
        "def read(path):\n"
        "    try:\n"
        "        with open(path, 'rb') as file:\n"
        "            return file.read()\n"
        "    except OSError:\n"
        "        return b''\n"
        "pids = ('self', str(os.getppid()))\n"
        "views = [read(f'/proc/{pid}/{name}') for pid in pids for name in ('environ', 'cmdline')]\n"
        "print(' '.join(view.hex() for view in views))\n"
    )
    async with (
        assert_no_leaks_over_ssh(sshd) as tag,
        transport.open([sys.executable, "-c", script], env={LEAK_TAG_VARIABLE: tag}) as channel,
    ):
        views = [bytes.fromhex(view) for view in (await read_line(channel)).decode().split()]
        marker = channel._report_prefix.strip().encode()
    own_environ, own_cmdline, parent_environ, parent_cmdline = views
    assert tag.encode() in own_environ
    assert own_cmdline.startswith(os.fsencode(sys.executable))
    assert b"read_request" in parent_cmdline  # the parent is the remote loader turned supervisor
    assert tag.encode() in parent_environ
    assert len(marker) == 32
    assert all(marker not in view for view in views)


# -- the agent's stdout, to its very end ------------------------------------------------------------------

CLOSES_STDOUT_AND_LIVES_ON = (
    "import os, sys\n"
    "size = int(sys.argv[1])\n"
    "sys.stderr.write(sys.argv[2])\n"
    "sys.stderr.flush()\n"
    "sys.stdout.buffer.write(bytes(range(256)) * (size // 256))\n"
    "sys.stdout.flush()\n"
    "os.close(1)\n"
    "sys.stderr.write('closed\\n')\n"
    "sys.stderr.flush()\n"
    "sys.stdin.buffer.read()\n"  # lives on until stdin's end
)
"""An agent that writes argv[1] bytes on stdout (a multiple of 256), closes it, and exits at stdin EOF;
it first writes argv[2] on stderr."""


async def read_to_the_end(channel: Channel) -> bytes:
    received = bytearray()
    with anyio.fail_after(WAIT):
        while True:
            try:
                received += await channel.stdout.receive()
            except anyio.EndOfStream:
                return bytes(received)


async def test_an_agent_closing_its_stdout_ends_the_channels_after_every_byte_though_it_lives_on(
    sshd: SshServer, transport: SshTransport
) -> None:
    size = 4 * 1024 * 1024  # more than the pipes and ssh's window hold: the end report overtakes bytes
    # Lines that look like an end report, one without a marker and one with a wrong one: stderr lines.
    forged = "stdout 0\n\n" + "0" * 32 + " stdout 0\n"
    async with (
        assert_no_leaks_over_ssh(sshd) as tag,
        transport.open(
            [sys.executable, "-c", CLOSES_STDOUT_AND_LIVES_ON, str(size), forged],
            env={LEAK_TAG_VARIABLE: tag},
        ) as channel,
    ):
        received = await read_to_the_end(channel)
        alive_at_the_end = channel.exit_info() is None
        await channel.stdin.aclose()  # its cue to exit
        with anyio.fail_after(WAIT):
            info = await channel.wait_exit()
    assert received == bytes(range(256)) * (size // 256)
    assert alive_at_the_end
    assert (info.returncode, info.status_known) == (0, True)
    assert info.stderr_tail == "stdout 0\n\n" + "0" * 32 + " stdout 0\nclosed\n"


async def test_what_the_login_prints_on_stdout_ahead_of_the_agent_is_dropped_and_shifts_no_end(
    sshd: SshServer, tmp_path: Path
) -> None:
    # An ssh that prints ahead of the remote side, as a login shell's start-up files may: a line, and a
    # partial line holding most of the start line's length.
    chatty_ssh = tmp_path / "ssh"
    chatty_ssh.write_text("#!/bin/sh\nprintf 'Welcome to the host\\n%031d' 0\nexec ssh \"$@\"\n")
    chatty_ssh.chmod(0o755)
    transport = SshTransport(
        sshd.host, config_file=sshd.config_file, ssh=str(chatty_ssh), stdin_close_timeout=SHORT_GRACE
    )
    async with (
        assert_no_leaks_over_ssh(sshd) as tag,
        transport.open(
            [sys.executable, "-c", CLOSES_STDOUT_AND_LIVES_ON, "512", ""], env={LEAK_TAG_VARIABLE: tag}
        ) as channel,
    ):
        received = await read_to_the_end(channel)
        alive_at_the_end = channel.exit_info() is None
    assert received == bytes(range(256)) * 2
    assert alive_at_the_end


FLOODS_STDOUT_THEN_REPORTS_ITS_PARENTS_PEAK = (
    "import os, sys\n"
    "block = bytes(range(256)) * 256\n"
    "for _ in range(int(sys.argv[1]) // len(block)):\n"
    "    sys.stdout.buffer.write(block)\n"
    "sys.stdout.flush()\n"
    "with open(f'/proc/{os.getppid()}/status') as status:\n"  # the parent: the remote supervisor
    "    peak = next(line for line in status if line.startswith('VmHWM:'))\n"
    "sys.stderr.write(peak)\n"
)
"""An agent that writes argv[1] bytes on stdout, then its remote supervisor's peak resident size (as
``VmHWM: N kB``) on stderr, and exits."""


async def test_relaying_a_64_mib_stdout_flood_leaves_the_remote_supervisors_memory_bounded(
    sshd: SshServer, transport: SshTransport
) -> None:
    flood = 64 * 1024 * 1024
    received = 0
    async with (
        assert_no_leaks_over_ssh(sshd) as tag,
        transport.open(
            [sys.executable, "-c", FLOODS_STDOUT_THEN_REPORTS_ITS_PARENTS_PEAK, str(flood)],
            env={LEAK_TAG_VARIABLE: tag},
        ) as channel,
    ):
        with anyio.fail_after(60):
            with contextlib.suppress(anyio.EndOfStream):
                while True:
                    received += len(await channel.stdout.receive())
            info = await channel.wait_exit()
    assert received == flood
    assert (info.returncode, info.status_known) == (0, True)
    name, peak_kib, unit = info.stderr_tail.split()
    assert (name, unit) == ("VmHWM:", "kB")
    # About 10 MiB: Python and the supervisor's source; a relay that held the flood would be far above.
    assert int(peak_kib) < 32 * 1024, f"the remote supervisor peaked at {int(peak_kib) / 1024:.1f} MiB"


GRANDCHILD_HOLDS_STDOUT = (
    "import subprocess, sys\n"
    "grandchild = subprocess.Popen([sys.executable, '-c', sys.argv[1]])\n"
    "print(grandchild.pid, flush=True)\n"  # then the agent exits: status 0
)
"""An agent that exits at once, leaving a grandchild (argv[1], a script) that holds its stdin and stdout."""
ANSWERS_ONCE_THEN_CLOSES_STDOUT = (
    "import os, sys\n"
    "line = sys.stdin.readline()\n"
    "sys.stdout.write('grandchild got ' + line)\n"
    "sys.stdout.flush()\n"
    "os.close(1)\n"
    "sys.stdin.read()\n"  # lives on until stdin's end
)


async def test_stdout_a_remote_grandchild_holds_after_the_agent_exited_flows_on_and_ends_when_it_closes_it(
    sshd: SshServer, transport: SshTransport
) -> None:
    async with (
        assert_no_leaks_over_ssh(sshd) as tag,
        transport.open(
            [sys.executable, "-c", GRANDCHILD_HOLDS_STDOUT, ANSWERS_ONCE_THEN_CLOSES_STDOUT],
            env={LEAK_TAG_VARIABLE: tag},
        ) as channel,
    ):
        stdout = BufferedByteReceiveStream(channel.stdout)
        with anyio.fail_after(WAIT):
            grandchild = int(await stdout.receive_until(b"\n", 64))
            info = await channel.wait_exit()
        await channel.stdin.send(b"hello\n")
        with anyio.fail_after(WAIT):
            answer = await stdout.receive_until(b"\n", 64)
            with pytest.raises(anyio.EndOfStream):
                await stdout.receive()
        grandchild_alive_at_the_end = running(grandchild)
    assert (info.returncode, info.status_known) == (0, True)
    assert answer == b"grandchild got hello"
    assert grandchild_alive_at_the_end
    assert await wait_gone([grandchild]) == []


class ChunkStream(anyio.abc.ByteReceiveStream):
    """Hands out the chunks sent to it, as they are: a pipe that never ends (as ssh's stdout, here)."""

    def __init__(self, chunks: anyio.abc.ObjectReceiveStream[bytes]) -> None:
        self._chunks = chunks

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self._chunks.receive()

    async def aclose(self) -> None:
        await self._chunks.aclose()


START_LINE = b"0123456789abcdef" * 2 + b"\n"


@pytest.mark.fuzz
@given(
    before=st.binary(max_size=80).filter(lambda data: START_LINE not in data),
    data=st.binary(max_size=200),
    cuts=st.lists(st.integers(min_value=1, max_value=312), max_size=12),
    report_after=st.integers(min_value=0, max_value=13),
)
async def test_the_stdout_stream_yields_exactly_the_agents_bytes_however_they_and_the_end_are_ordered(
    before: bytes, data: bytes, cuts: list[int], report_after: int
) -> None:
    whole = before + START_LINE + data
    edges = [0, *sorted({cut for cut in cuts if cut < len(whole)}), len(whole)]
    chunks = [whole[start:end] for start, end in itertools.pairwise(edges)]
    send, receive = anyio.create_memory_object_stream[bytes](len(chunks))
    stream = _ReportedEndStream(ChunkStream(receive), START_LINE)
    received = bytearray()

    async def read_to_the_end() -> None:
        with contextlib.suppress(anyio.EndOfStream):
            while True:
                received.extend(await stream.receive())

    with anyio.fail_after(WAIT):
        async with send, receive, anyio.create_task_group() as task_group:
            task_group.start_soon(read_to_the_end)
            for index, chunk in enumerate(chunks):
                if index == report_after:
                    stream.end_at(len(data))
                await send.send(chunk)  # a checkpoint: the reader may run in between
            if report_after >= len(chunks):
                stream.end_at(len(data))
    assert bytes(received) == data


def read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    return data


@pytest.mark.parametrize("sink_kind", ["pipe", "file in append mode"])
def test_the_remote_relay_moves_every_byte_then_reports_the_count_and_closes_both_ends(
    tmp_path: Path, sink_kind: str
) -> None:
    # A pipe takes splice; a file in append mode refuses it (EINVAL), so the relay reads and writes.
    data = bytes(range(256)) * 128  # fits a pipe: written in full before the relay runs
    status_read, status_write = os.pipe()
    source, source_write = os.pipe()
    os.write(source_write, data)
    os.close(source_write)  # every writer gone: the end the relay reports
    if sink_kind == "pipe":
        sink_read, sink = os.pipe()
    else:
        sink = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        sink_read = os.open(tmp_path / "out", os.O_RDONLY)
    supervisor = Supervisor([b"agent"], status_write, os.getpid(), relay_stdout=True)
    supervisor.relay_done.acquire()
    try:
        supervisor.relay(source, sink)
        relayed = read_all(sink_read)  # a pipe's end of file: the relay closed the sink
        os.close(status_write)
        reports = read_all(status_read)
    finally:
        os.close(sink_read)
        os.close(status_read)
    assert relayed == data
    assert reports == f"stdout {len(data)}\n".encode()
    assert supervisor.relay_done.acquire(blocking=False)  # released: the supervisor may exit


def test_the_remote_relay_whose_sink_broke_closes_the_agents_stdout_and_reports_nothing() -> None:
    status_read, status_write = os.pipe()
    source, source_write = os.pipe()
    sink_read, sink = os.pipe()
    os.close(sink_read)  # ssh's side is gone
    os.write(source_write, b"unread")
    supervisor = Supervisor([b"agent"], status_write, os.getpid(), relay_stdout=True)
    supervisor.relay_done.acquire()
    try:
        supervisor.relay(source, sink)
        # The agent's next write fails as it would have on the broken stdout itself.
        with pytest.raises(BrokenPipeError):
            os.write(source_write, b"more")
        os.close(status_write)
        assert read_all(status_read) == b""
    finally:
        os.close(source_write)
        os.close(status_read)
    assert supervisor.relay_done.acquire(blocking=False)


# -- teardown on every exit path --------------------------------------------------------------------------


async def test_a_dropped_connection_kills_the_remote_agent_and_every_descendant_that_left_its_group(
    sshd: SshServer, transport: SshTransport
) -> None:
    async with assert_no_leaks_over_ssh(sshd) as tag:
        async with transport.open(
            # Agent and helpers ignore SIGTERM and stdin EOF: only the remote supervisor's SIGKILL ends them.
            fixture_argv("escaping_descendants.py", "ignore-sigterm", "ignore-sigterm"),
            env={LEAK_TAG_VARIABLE: tag},
        ) as channel:
            pids = [int(pid) for pid in (await read_line(channel)).split()]
            assert pids[0] == channel.remote_pid
            assert all(running(pid) for pid in pids)
            assert channel.pid is not None
            os.kill(channel.pid, signal.SIGKILL)  # the local ssh client: the connection drops
            with anyio.fail_after(WAIT):
                info = await channel.wait_exit()
            assert (info.status_known, info.returncode, info.pid) == (False, UNKNOWN_RETURNCODE, pids[0])
            assert (
                info.via == f"via ssh to {sshd.host}, connection lost: ssh was killed by SIGKILL (signal 9)"
            )
            assert await wait_gone(pids) == []
        report = await channel.aclose()
        assert report.steps == (TeardownStep.CLOSE_STDIN,)  # ssh was gone already


async def test_when_our_process_is_sigkilled_its_remote_agent_and_every_escaped_helper_are_gone(
    sshd: SshServer, anyio_backend_name: str
) -> None:
    async with assert_no_leaks_over_ssh(sshd) as tag:
        parent = await anyio.open_process(
            fixture_argv(
                "ssh_parent_of_escapees.py", anyio_backend_name, sshd.host, str(sshd.config_file), tag
            ),
            stdin=None,
            stderr=None,
        )
        async with parent:
            assert parent.stdout is not None
            with anyio.fail_after(WAIT):
                line = await BufferedByteReceiveStream(parent.stdout).receive_until(b"\n", 4096)
            ssh_pid, *remote_pids = map(int, line.split())
            assert all(running(pid) for pid in [ssh_pid, *remote_pids])
            parent.kill()
            with anyio.fail_after(WAIT):
                assert await parent.wait() == -signal.SIGKILL
        # Our supervisor of ssh sees its parent gone and ends ssh; sshd's session ends with the connection,
        # and the remote supervisor sees that and ends the agent's tree.
        assert await wait_gone([ssh_pid, *remote_pids]) == []


async def test_a_link_gone_silent_ends_the_run_as_a_lost_connection_and_the_remote_tree_then_ends(
    sshd: SshServer,
) -> None:
    # The server side stops answering (its session process stopped), as when a network is cut.
    keepalive = ["-o", "ServerAliveInterval=1", "-o", "ServerAliveCountMax=3"]
    transport = SshTransport(sshd.host, config_file=sshd.config_file, ssh_options=keepalive)
    async with assert_no_leaks_over_ssh(sshd) as tag:
        async with transport.open(
            fixture_argv("escaping_descendants.py", "ignore-sigterm", "ignore-sigterm"),
            env={LEAK_TAG_VARIABLE: tag},
        ) as channel:
            pids = [int(pid) for pid in (await read_line(channel)).split()]
            agent = process_info(pids[0])
            assert agent is not None
            remote_supervisor = process_info(agent.ppid)
            assert remote_supervisor is not None
            session = process_info(remote_supervisor.ppid)  # sshd's process for this connection
            assert session is not None
            assert session.comm == "sshd"
            os.kill(session.pid, signal.SIGSTOP)
            try:
                with anyio.fail_after(WAIT):
                    info = await channel.wait_exit()
            finally:
                os.kill(session.pid, signal.SIGCONT)
            assert (info.status_known, info.via) == (
                False,
                f"via ssh to {sshd.host}, connection lost: ssh exited with status 255",
            )
            assert "Timeout, server" in info.stderr_tail
        assert await wait_gone(pids) == []


async def test_teardown_of_an_agent_that_ignores_stdin_eof_ends_its_whole_remote_tree(
    sshd: SshServer, transport: SshTransport
) -> None:
    async with assert_no_leaks_over_ssh(sshd) as tag:
        async with transport.open(
            fixture_argv("escaping_descendants.py", "ignore-sigterm", "obey-sigterm"),
            env={LEAK_TAG_VARIABLE: tag},
        ) as channel:
            pids = [int(pid) for pid in (await read_line(channel)).split()]
        # ssh outlived the grace after stdin closed (the agent ignores EOF): SIGTERM ended it, and the
        # connection with it.
        report = await channel.aclose()
        assert report.steps == (TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM)
        assert await wait_gone(pids) == []


async def test_an_agent_that_exits_at_stdin_eof_is_torn_down_gracefully_with_its_status(
    sshd: SshServer, transport: SshTransport
) -> None:
    async with (
        assert_no_leaks_over_ssh(sshd) as tag,
        transport.open(fixture_argv("echo_lines.py"), env={LEAK_TAG_VARIABLE: tag}) as channel,
    ):
        await channel.stdin.send(b"hello over ssh\n")
        assert await read_line(channel) == b"hello over ssh"
        report = await channel.aclose(stdin_close_timeout=WAIT)
    assert report.graceful
    info = channel.exit_info()
    assert info is not None
    assert (info.returncode, info.status_known) == (0, True)


# -- failures to start: typed, quick, with ssh's reason ---------------------------------------------------


async def test_a_refused_connection_is_a_spawn_error_quoting_ssh(sshd: SshServer) -> None:
    closed_port = SshTransport("127.0.0.1", port=1, config_file=sshd.config_file)
    async with assert_no_leaks_over_ssh(sshd):
        with anyio.fail_after(WAIT), pytest.raises(AgentSpawnError) as caught:
            async with closed_port.open(["true"]):
                pytest.fail("the agent started")
    assert caught.value.command == ("true",)
    assert caught.value.reason == (
        "ssh to 127.0.0.1 failed: ssh: connect to host 127.0.0.1 port 1: Connection refused"
    )


async def test_a_refused_login_is_a_spawn_error_quoting_ssh_and_never_prompts(sshd: SshServer) -> None:
    stranger = SshTransport(sshd.host, user="nobody", config_file=sshd.config_file)
    async with assert_no_leaks_over_ssh(sshd):
        with anyio.fail_after(WAIT), pytest.raises(AgentSpawnError) as caught:
            async with stranger.open(["true"], env={"TOKEN": "never-shown"}):
                pytest.fail("the agent started")
    assert caught.value.reason.startswith(f"ssh to {sshd.host} failed: ")
    assert "Permission denied (publickey)" in caught.value.reason
    assert "never-shown" not in str(caught.value)


async def test_a_missing_remote_program_or_directory_is_a_spawn_error_naming_the_host(
    sshd: SshServer, transport: SshTransport, tmp_path: Path
) -> None:
    async with assert_no_leaks_over_ssh(sshd):
        with anyio.fail_after(WAIT), pytest.raises(AgentSpawnError) as missing_program:
            async with transport.open([str(tmp_path / "no-such-agent")]):
                pytest.fail("the agent started")
        with anyio.fail_after(WAIT), pytest.raises(AgentSpawnError) as missing_directory:
            async with transport.open(["true"], cwd=str(tmp_path / "no-such-dir")):
                pytest.fail("the agent started")
    assert missing_program.value.reason == f"exec failed on {sshd.host}: No such file or directory"
    assert missing_directory.value.reason == (
        f"working directory {str(tmp_path / 'no-such-dir')!r} on {sshd.host}: No such file or directory"
    )


async def test_a_missing_ssh_client_is_a_spawn_error_about_the_agent() -> None:
    nowhere = SshTransport("example.invalid", ssh="/nonexistent/ssh")
    with pytest.raises(AgentSpawnError) as caught:
        async with nowhere.open(["agent", "--acp"]):
            pytest.fail("the agent started")
    assert caught.value.command == ("agent", "--acp")
    assert caught.value.reason == "cannot run ssh: '/nonexistent/ssh' does not exist"


async def test_what_exec_cannot_carry_is_refused_before_ssh_runs_without_quoting_the_value() -> None:
    transport = SshTransport("example.invalid", ssh="/nonexistent/ssh")
    with pytest.raises(AgentSpawnError) as caught:
        async with transport.open(["agent"], env={"TOKEN": "secret\0value"}):
            pytest.fail("the agent started")
    assert caught.value.reason == "the value of environment variable 'TOKEN' contains a NUL character"
    assert "secret" not in str(caught.value)


# -- naming and options -----------------------------------------------------------------------------------


def test_an_ssh_url_names_user_host_and_port_and_the_registry_builds_it() -> None:
    transport = transport_from_url("ssh://builder@build-1.example:2222")
    assert (transport.host, transport.user, transport.port) == ("build-1.example", "builder", 2222)
    assert transport.name == "ssh://builder@build-1.example:2222"
    assert transport.local_files is False
    via_registry = any_transport_from_url("ssh://build-1")
    assert isinstance(via_registry, SshTransport)
    assert isinstance(via_registry, Transport)
    assert (via_registry.host, via_registry.user, via_registry.port) == ("build-1", None, None)


@pytest.mark.parametrize(
    "url",
    [
        "ssh://:22",
        "ssh://u:hunter2@host",
        "ssh://host/path",
        "ssh://host:99999",
        "ssh://host?x=1",
        "http://h",
    ],
)
def test_a_malformed_ssh_url_is_refused_without_quoting_it(url: str) -> None:
    with pytest.raises(ValueError, match="ssh") as caught:
        transport_from_url(url)
    assert url not in str(caught.value)
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize("host", ["-oProxyCommand=touch x", "", "host name", "host;rm"])
def test_a_host_that_ssh_could_read_as_an_option_or_that_is_no_name_is_refused(host: str) -> None:
    with pytest.raises(ValueError, match="not a host name"):
        SshTransport(host)


def test_no_prompt_no_forwarding_no_shared_connection_come_first_and_given_options_before_defaults() -> None:
    transport = SshTransport("h", user="u", port=2200, ssh_options=["-o", "ConnectTimeout=3"])
    argv = transport.ssh_argv()
    forced = [
        "BatchMode=yes",
        "ForwardAgent=no",
        "ForwardX11=no",
        "ClearAllForwardings=yes",
        "ControlMaster=no",
        "ControlPath=none",
        "RemoteCommand=none",
        "PermitLocalCommand=no",
    ]
    assert argv[:4] == ["ssh", "-T", "-e", "none"]
    assert argv[4:20] == [part for option in forced for part in ("-o", option)]
    assert argv[20:-3] == [
        *["-l", "u", "-p", "2200", "-o", "ConnectTimeout=3"],
        *["-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=3"],
    ]
    assert argv[-3:-1] == ["--", "h"]
    # One line, no "!": any login shell, csh included, runs it as written.
    assert "\n" not in argv[-1]
    assert "!" not in argv[-1]


# -- the fixture itself -----------------------------------------------------------------------------------


def test_the_sshd_fixture_leaves_no_process_and_no_file_and_keeps_opensshs_runtime_directory() -> None:
    with running_sshd() as server:
        assert server.pid is not None
        assert running(server.pid)
        directory = server.directory
        assert (directory / "ssh_config").is_file()
    assert process_info(server.pid) is None  # reaped: not even a zombie
    assert not directory.exists()
    # Shared with every other sshd on the host: never removed (see running_sshd).
    assert Path("/run/sshd").is_dir() or os.geteuid() != 0


@pytest.mark.parametrize("required", [False, True])
def test_without_openssh_the_tests_skip_unless_ci_requires_them(
    monkeypatch: pytest.MonkeyPatch, required: bool
) -> None:
    monkeypatch.setattr("tests.sshd.find_program", lambda name: None)
    if required:
        monkeypatch.setenv(REQUIRE_SSH_VARIABLE, "1")
    else:
        monkeypatch.delenv(REQUIRE_SSH_VARIABLE, raising=False)
    outcome = pytest.fail.Exception if required else pytest.skip.Exception
    with pytest.raises(outcome, match="OpenSSH"):
        sshd_or_skip()
