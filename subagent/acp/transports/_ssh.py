"""The SSH transport: a child agent on another host, reached with the system ``ssh`` client.

`SshTransport` runs ``ssh -T -o BatchMode=yes HOST <command>`` (never a password prompt: keys or an
ssh-agent only) as a local child of ours, spawned by `subagent.acp.transports.open_agent_process`, so the
local side has every guarantee of a local agent: supervised, torn down with its tree, stderr drained into
a bounded tail. The agent's stdin and stdout are ssh's.

What runs on the remote host
    Only ``python3`` (`SshTransport.remote_python`) is needed there, not this package. The remote
    command line is a constant loader (``exec python3 -I -S -c '<loader>'``); everything else travels
    on the ssh channel's stdin, ahead of the agent's first byte, as length-prefixed JSON requests the
    loader reads exactly (never a byte of the agent's): first the working directory and the environment
    (stage 1 changes directory and re-executes the interpreter with the environment merged over the
    remote login's), then the agent's argv and the source of our supervisor
    (``_supervisor``, standard library only), which stage 2 runs in-process. So the agent's
    argv, environment values and working directory never appear on a command line (``ps`` on either
    host) nor in a log of ours.

    The remote supervisor is the local one's: it starts the agent in a process group of its own, is a
    child subreaper, kills the whole tree (descendants that left the group included) when asked or when
    its parent, sshd's session process, is gone: a dropped connection (ssh killed, network lost, our
    process killed) ends the session, the supervisor notices within 0.25 s, sends SIGTERM to every
    descendant, then SIGKILL 1 s later.

Status
    The supervisor reports on its status stream (``pid N``, ``exit N``, ``error ERRNO TEXT``, ``fail
    TEXT``, and here ``stdout N``: see below); over ssh the only stream left is stderr, so each report
    is written there as one line that starts with a marker: 32 random hex digits generated per run and
    sent on stdin, never on a command line or in the environment, so the agent cannot forge a report.
    A report starts with a newline of its own (one write, so it is never interleaved), so it begins a
    line even after a partial line of the agent's; that newline's empty line is dropped. Report lines
    are taken out of the stderr the channel shows. The agent's stderr written before it exited precedes
    its ``exit`` report on the same pipe, so the tail is complete when the exit is known.

stdout
    The ssh client keeps its stdout open until the remote command exits, so an agent that closed its
    stdout but lives on would not be seen here (locally, its end of file is). So the remote supervisor
    gives the agent a pipe as stdout and relays it to ssh's (``splice``: no copy through the process),
    and once every holder of that pipe closed it, reports ``stdout N``, N being the bytes relayed. The
    channel's stdout ends once it received N bytes: after every byte the agent wrote, however the
    report and the last bytes, on two streams, are ordered on arrival. Ahead of the agent's first byte
    the remote side writes a start line (the marker) on stdout; whatever came before it, such as the
    output of the login shell's start-up files, is dropped, so it neither reaches the client nor
    shifts the count.

Teardown
    `SshChannel.aclose` tears the local ssh down as a local agent is torn down: stdin closes (ssh sends
    EOF, the agent's cue to finish; once its tree is gone and its stdout relayed, the remote supervisor
    exits, and ssh with it), then SIGTERM and SIGKILL to ssh, which ends the connection and so the
    remote tree, as above. The remote side's end after a dropped connection is not waited for here: no
    channel is left to learn it on; the remote supervisor guarantees it.

Workspaces
    `SshTransport.isolation_runner` gives the provider a `subagent.isolation.CoreRunner` that runs one
    operation of the workspace core (``subagent._isolation_core``: make a worktree or a copy, commit a
    turn's work, clean up, list and reap records) on the remote host per call: a separate ``ssh`` with
    the same destination and options, whose remote command is the same constant loader; the core's
    source (read from this package's file) and the JSON request travel on stdin, so no path, branch or
    prompt appears on a command line. The remote side writes a start line (a marker, as above) and then
    the core's JSON reply on stdout; the remote stderr is kept out of replies (its last lines are quoted
    in an error, and the core's reports of what it recovered are logged here, at info). Each call is bounded
    (`ISOLATION_TIMEOUT`, then ssh's process group is killed) and so is its reply (`ISOLATION_REPLY_BYTES`).
    The workspace is owned by our process on this host (its record names our boot id and pid), so what a
    dead process of ours left there is reaped from here by name, once per process and host. A call given
    up on (timed out) ends the connection, not the operation: the remote core finishes what it began
    (each git command there is bounded), and a workspace it made that way is reaped once we are gone.

Limits
    The remote host must be Linux (the supervisor reads ``/proc``) with ``python3`` 3.9 or later, and
    the login shell must run ``exec PROGRAM ARGS`` (any POSIX shell does). The client serves no ``fs/*``
    or ``terminal/*`` requests for a remote child (`SshTransport.local_files` is False).

    Isolated workspaces (``isolation="worktree"`` or ``"copy"``) are made on the remote host, where
    the agent runs: `SshTransport.isolation_runner` runs each operation of the workspace core there
    (see "Workspaces" above). Each operation pays for a connection of its own (a core operation takes
    about 1.5 times an ``ssh HOST exit 0``; ``bench/ssh_isolation.py``): an isolated one-turn run makes
    four (two before the agent starts, one per turn, one at its end).

    A link that goes silent (a network cut, not a closed connection) ends the run here within
    `SERVER_ALIVE_INTERVAL` x `SERVER_ALIVE_COUNT_MAX`; the remote side learns of it only when sshd
    does: ``ClientAliveInterval`` in the server's config, else TCP keepalive (hours). Until then the
    remote tree lives on. Connection sharing (``ControlMaster``) is off, so each agent pays for its own
    connection (about 0.25 s on loopback).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import secrets
import shlex
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import anyio
import anyio.abc

from subagent import _isolation_core as isolation_core
from subagent._isolation_core import IsolationError
from subagent.acp._errors import AgentSpawnError
from subagent.acp.transports._channel import BaseTransport, ExitInfo, Launch, TeardownReport
from subagent.acp.transports._local import (
    STDERR_TAIL_BYTES,
    STDIN_CLOSE_TIMEOUT,
    AgentProcess,
    open_agent_process,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CONNECT_TIMEOUT",
    "ISOLATION_REPLY_BYTES",
    "ISOLATION_TIMEOUT",
    "SERVER_ALIVE_COUNT_MAX",
    "SERVER_ALIVE_INTERVAL",
    "SSH_CONNECTION_FAILED",
    "START_TIMEOUT",
    "SshChannel",
    "SshCoreRunner",
    "SshTransport",
    "transport_from_url",
]

CONNECT_TIMEOUT = 10
"""ssh's ``ConnectTimeout`` (seconds) unless ``ssh_options`` set one: an unreachable host fails then,
rather than after the kernel's TCP retries (minutes)."""
SERVER_ALIVE_INTERVAL = 15
"""ssh's ``ServerAliveInterval`` (seconds) unless ``ssh_options`` set one; with `SERVER_ALIVE_COUNT_MAX`,
a link that went silent (a host gone, a network cut) ends the run within about 45 s, as a lost
connection, rather than after TCP's own timeout (hours)."""
SERVER_ALIVE_COUNT_MAX = 3
"""ssh's ``ServerAliveCountMax`` unless ``ssh_options`` set one."""
START_TIMEOUT = 60.0
"""A hang guard on the agent starting: connecting, logging in, and the remote supervisor reporting the
agent's pid (about 0.3 s on loopback)."""
SSH_CONNECTION_FAILED = 255
"""ssh's own exit status when the connection failed (or was lost)."""

ISOLATION_TIMEOUT = 600.0
"""A hang guard on one operation of the workspace core on the remote host (`SshCoreRunner`): connecting,
then its git commands, each bounded there by ``subagent._isolation_core.GIT_TIMEOUT`` (120 s; a checkout
of a large repository, the recovery of what dead runs left, may take several). About 0.5 s on loopback,
the connection included."""
ISOLATION_REPLY_BYTES = 16 * 1024 * 1024
"""The most a remote operation of the workspace core may write on stdout (its JSON reply: a change lists
each file changed, a listing each record); past it the call fails rather than hold more."""
ISOLATION_STDERR_TAIL_BYTES = 4096
"""How much of a remote operation's stderr is kept, for its error message and the log."""

_SUPERVISOR_SOURCE_PATH = Path(__file__).with_name("_supervisor.py")

_LOADER = """\
import os, sys
def read_exactly(count):
    data = b""
    while len(data) < count:
        chunk = os.read(0, count - len(data))
        if not chunk:
            sys.exit(125)
        data += chunk
    return data
def read_request():
    size = b""
    while not size.endswith(b"\\n"):
        if len(size) > 17:
            sys.exit(125)
        size += read_exactly(1)
    import json
    return json.loads(read_exactly(int(size)))
def run_request(request):
    exec(request["source"], {"__name__": "__subagent_remote__", "request": request,
                             "read_request": read_request, "run_request": run_request})
run_request(read_request())
"""
"""The remote command line's program. It reads one request (its length in decimal, at most 17 digits, and
a newline, then that many bytes of JSON) from fd 0 without reading a byte past it, and runs the request's
source with the request and the reader at hand. Shipped as exec() of its repr: one line, with no "!" (csh
would expand it)."""

_STAGE_PLACE = """\
import os, sys
def fail(text):
    os.write(2, ("\\n%s fail %s\\n" % (request["marker"], text)).encode())
    sys.exit(127)
if request["cwd"] is not None:
    try:
        os.chdir(request["cwd"])
    except OSError as exc:
        fail("cwd %s" % (exc.strerror or exc))
if request["env"]:
    with open("/proc/self/environ", "rb") as environ_file:
        environ = environ_file.read()
    env = {}
    for item in environ.split(b"\\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            env.setdefault(name, value)
    for name, value in request["env"].items():
        env[os.fsencode(name)] = os.fsencode(value)
    python = sys.executable or "python3"
    os.execve(python, [python, "-I", "-S", "-c", request["loader"]], env)
run_request(read_request())
"""
"""Stage 1: the working directory and the environment, then stage 2. A new environment needs the
interpreter re-executed: the supervisor hands the agent its process's initial environment
(``/proc/self/environ``), which ``os.environ`` does not change."""

_STAGE_SUPERVISE = """\
import os, sys
supervisor_module = {"__name__": "_subagent_supervisor"}
exec(compile(request["supervisor"], "_supervisor.py", "exec"), supervisor_module)
class RemoteSupervisor(supervisor_module["Supervisor"]):
    def report(self, line):
        super().report("\\n" + request["marker"] + " " + line)
status_fd = os.dup(2)
command = [os.fsencode(arg) for arg in request["argv"]]
os.write(1, request["marker"].encode() + b"\\n")
sys.exit(RemoteSupervisor(command, status_fd, os.getppid(), relay_stdout=True).run())
"""
"""Stage 2: our supervisor, in this process (its parent is sshd's process for the connection), its
reports written to stderr behind the marker, relaying the agent's stdout after a start line, the marker
(see `_ReportedEndStream`)."""

_STAGE_CORE = """\
import os
core_module = {"__name__": "_subagent_isolation_core"}
exec(compile(request["core"], "_isolation_core.py", "exec"), core_module)
os.write(1, request["marker"].encode() + b"\\n")
core_module["main"]()
"""
"""One operation of the workspace core (`SshCoreRunner`): its source, in this process, then the start line
(the marker) on stdout, then its ``main()``, which reads the operation's JSON request (the rest of stdin)
and writes the JSON reply."""

_FORCED_OPTIONS = (
    # Never a prompt: keys or an ssh-agent only.
    "BatchMode=yes",
    # Nothing of ours reaches the child: not our ssh-agent, display or ports.
    "ForwardAgent=no",
    "ForwardX11=no",
    "ClearAllForwardings=yes",
    # One connection per agent. The remote supervisor watches its connection's own sshd process, which a
    # shared (multiplexed) connection would outlive; and a master's end would end every agent on it.
    "ControlMaster=no",
    "ControlPath=none",
    # The command is ours, and nothing runs here but ssh.
    "RemoteCommand=none",
    "PermitLocalCommand=no",
)
"""ssh options placed before all others (ssh takes the first value of each), so none can be undone."""

_HOST_PATTERN = re.compile(r"[A-Za-z0-9_.:%\[\]-]+")
_USER_PATTERN = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.@+-]*")


@functools.cache
def _supervisor_source() -> str:
    return _SUPERVISOR_SOURCE_PATH.read_text(encoding="utf-8")


@functools.cache
def _core_source() -> str:
    return Path(isolation_core.__file__).read_text(encoding="utf-8")


def _encode_request(request: Mapping[str, object]) -> bytes:
    body = json.dumps(request, ensure_ascii=True, separators=(",", ":")).encode()
    return b"%d\n" % len(body) + body


class SshTransport(BaseTransport["SshChannel"]):
    """Child agents on ``host``, reached with the system ``ssh`` client (see the module docstring).

    Args:
        host: The host (a name from ssh's config, a DNS name, an address).
        user: The login name; None: ssh's choice (the config's ``User``, else ours).
        port: The port; None: ssh's choice.
        ssh_options: More ssh arguments (``["-o", "ProxyJump=bastion"]``, ``["-i", KEYFILE]``), placed
            before the defaults this transport adds, so an ``-o`` given here wins (ssh takes the first
            value of each option). ``BatchMode=yes``, no forwarding of agent, X11 or ports, and no
            connection sharing (``ControlMaster``) are placed first and cannot be undone.
        config_file: An ssh config file (``ssh -F``), read instead of ``~/.ssh/config`` and the system's.
        ssh: The ssh client to run.
        remote_python: The Python 3 interpreter on the remote host, by name or path.
        stdin_close_timeout: Teardown's grace after stdin closes, before ssh is signalled.
        stderr_tail_bytes: How much of the agent's stderr (and ssh's) the channel keeps for diagnosis.
        start_timeout: A hang guard on connecting and starting the agent.
        isolation_timeout: A hang guard on each operation of the workspace core there
            (`isolation_runner`).
    """

    local_files = False

    def __init__(
        self,
        host: str,
        *,
        user: str | None = None,
        port: int | None = None,
        ssh_options: Sequence[str] = (),
        config_file: str | os.PathLike[str] | None = None,
        ssh: str = "ssh",
        remote_python: str = "python3",
        stdin_close_timeout: float = STDIN_CLOSE_TIMEOUT,
        stderr_tail_bytes: int = STDERR_TAIL_BYTES,
        start_timeout: float = START_TIMEOUT,
        isolation_timeout: float = ISOLATION_TIMEOUT,
    ) -> None:
        # ssh would read a leading "-" as an option: a host or user must never start one.
        if not host or host.startswith("-") or not _HOST_PATTERN.fullmatch(host):
            raise ValueError(f"not a host name or address: {host!r}")
        if user is not None and (not _USER_PATTERN.fullmatch(user)):
            raise ValueError(f"not a user name: {user!r}")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"not a port: {port!r}")
        if isinstance(ssh_options, str):
            raise TypeError("ssh_options is a sequence of arguments, not a string")
        if not remote_python:
            raise ValueError("remote_python must name an interpreter")
        if stderr_tail_bytes < 0:
            raise ValueError("stderr_tail_bytes must not be negative")
        self.host = host
        self.user = user
        self.port = port
        self.ssh_options = tuple(ssh_options)
        self.config_file = None if config_file is None else os.fspath(config_file)
        self.ssh = ssh
        self.remote_python = remote_python
        self._stdin_close_timeout = stdin_close_timeout
        self.stderr_tail_bytes = stderr_tail_bytes
        self.start_timeout = start_timeout
        self.isolation_timeout = isolation_timeout

    def __repr__(self) -> str:
        return f"SshTransport({self.name!r})"

    @property
    def name(self) -> str:
        """``ssh://[user@]host[:port]``."""
        user = "" if self.user is None else f"{self.user}@"
        port = "" if self.port is None else f":{self.port}"
        return f"ssh://{user}{self.host}{port}"

    @property
    def stdin_close_timeout(self) -> float:
        """Teardown's grace after stdin closes, before ssh (and so the remote tree) is signalled."""
        return self._stdin_close_timeout

    def remote_command(self) -> str:
        """The command ssh asks the remote login shell to run: the loader, the same for every agent."""
        loader = f"exec({_LOADER!r})"
        return shlex.join(["exec", self.remote_python, "-I", "-S", "-c", loader])

    def ssh_argv(self) -> list[str]:
        """The local ssh client's argv."""
        argv = [self.ssh, "-T", "-e", "none"]
        # First, so that neither ssh_options nor a config file can override them (see _FORCED_OPTIONS).
        for option in _FORCED_OPTIONS:
            argv += ["-o", option]
        if self.config_file is not None:
            argv += ["-F", self.config_file]
        if self.user is not None:
            argv += ["-l", self.user]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        argv += self.ssh_options
        for option in (
            f"ConnectTimeout={CONNECT_TIMEOUT}",
            f"ServerAliveInterval={SERVER_ALIVE_INTERVAL}",
            f"ServerAliveCountMax={SERVER_ALIVE_COUNT_MAX}",
        ):
            argv += ["-o", option]
        return [*argv, "--", self.host, self.remote_command()]

    def isolation_runner(self) -> SshCoreRunner:
        """Where this transport's agents get their isolated workspaces: on the host, by the workspace core
        run there one operation per ``ssh`` (see the module docstring)."""
        return SshCoreRunner(self)

    def _requests(
        self, command: tuple[str, ...], env: Mapping[str, str] | None, cwd: str | None, marker: str
    ) -> bytes:
        place = {
            "source": _STAGE_PLACE,
            "marker": marker,
            "cwd": cwd,
            "env": dict(env or {}),
            "loader": _LOADER,
        }
        supervise = {
            "source": _STAGE_SUPERVISE,
            "marker": marker,
            "argv": list(command),
            "supervisor": _supervisor_source(),
        }
        return _encode_request(place) + _encode_request(supervise)

    @contextlib.asynccontextmanager
    async def launch(self, launch: Launch) -> AsyncIterator[SshChannel]:
        """Start ``argv`` on the host and own it until the block exits; then tear it down.

        ``env`` is set over the remote login's environment (ours is not forwarded); ``cwd`` is a path
        there (None: the login's home directory).

        Raises:
            AgentSpawnError: ssh could not run, or could not connect or log in (the reason quotes ssh's
                own, ``ssh to HOST failed: ...``), the working directory or the program is missing there,
                or an argument, ``cwd`` or ``env`` entry holds what exec cannot carry. No environment
                value is ever quoted.
        """
        command, env, cwd, on_stderr_line = launch.argv, launch.env, launch.cwd, launch.on_stderr_line
        marker = secrets.token_hex(16)
        channel = SshChannel(self, command, marker, on_stderr_line, cwd)
        try:
            process_context = open_agent_process(
                self.ssh_argv(),
                on_stderr_line=channel._absorb_line,
                stdin_close_timeout=self._stdin_close_timeout,
                # The channel keeps its own tail (the reports taken out); this one is never shown.
                stderr_tail_bytes=1024,
            )
            async with process_context as process:
                channel._attach(process)
                await channel._start(self._requests(command, env, cwd, marker), self.start_timeout)
                yield channel
        except AgentSpawnError as exc:
            if exc.command == command:
                raise
            # ssh itself could not be run: say so about the agent, without ssh's long command line.
            raise AgentSpawnError(command, f"cannot run ssh: {exc.reason}") from exc


class SshCoreRunner:
    """A `subagent.isolation.CoreRunner` that runs each operation of the workspace core on ``transport``'s
    host: one ``ssh`` per call, the loader's request and the operation's JSON on its stdin (see the
    module docstring). ``key`` names the host as reached (destination, config file, options), so what this
    host's dead processes left there is reaped once per process and host."""

    def __init__(self, transport: SshTransport) -> None:
        self._transport = transport
        self.host = transport.host
        reached = [transport.name]
        if transport.config_file is not None:
            reached += ["-F", transport.config_file]
        self.key = shlex.join([*reached, *transport.ssh_options])
        """What identifies the host: the transport's ``ssh://`` name, and its config file and options."""

    def __repr__(self) -> str:
        return f"SshCoreRunner({self._transport.name!r})"

    async def __call__(self, operation: str, *args: Any) -> Any:
        """Run ``operation`` of the workspace core on the host with ``args``; its JSON value.

        Raises:
            IsolationError: the core's own error (its message as is); ssh could not run, connect or log
                in (``ssh to HOST failed: ...``); the core failed there, did not answer within the
                transport's ``isolation_timeout``, or replied more than `ISOLATION_REPLY_BYTES`.
        """
        transport = self._transport
        marker = secrets.token_hex(16)
        stage = {"source": _STAGE_CORE, "marker": marker, "core": _core_source()}
        request = json.dumps({"op": operation, "args": list(args)}, separators=(",", ":")).encode()
        ran = await _run_bounded(
            transport.ssh_argv(),
            _encode_request(stage) + request,
            transport.isolation_timeout,
            ISOLATION_REPLY_BYTES + len(marker) + 1,
        )
        tail = _last_lines(ran.stderr_tail)
        where = f"on {self.host}"
        if ran.timed_out:
            raise IsolationError(
                f"the workspace core {where} did not answer {operation!r} within "
                f"{transport.isolation_timeout:g}s: ssh was killed (last stderr: {tail})"
            )
        if ran.too_much:
            raise IsolationError(
                f"the workspace core {where} replied to {operation!r} with more than "
                f"{ISOLATION_REPLY_BYTES:,} bytes: refused"
            )
        start = ran.stdout.find(marker.encode() + b"\n")
        reply: Any = None
        if start >= 0:
            with contextlib.suppress(ValueError):
                reply = json.loads(ran.stdout[start + len(marker) + 1 :])
        if not isinstance(reply, dict) or not ("value" in reply or "error" in reply):
            if ran.returncode == SSH_CONNECTION_FAILED:
                raise IsolationError(f"ssh to {self.host} failed: {tail}")
            raise IsolationError(
                f"the workspace core {where} gave no reply to {operation!r} "
                f"(exit status {ran.returncode}): {tail}"
            )
        _log_recoveries(ran.stderr_tail, self.host)
        if "error" in reply:
            raise IsolationError(str(reply["error"]))
        return reply["value"]


@dataclasses.dataclass
class _Ran:
    """What `_run_bounded` saw of a process."""

    stdout: bytearray = dataclasses.field(default_factory=bytearray)
    stderr_tail: bytearray = dataclasses.field(default_factory=bytearray)
    returncode: int | None = None
    timed_out: bool = False
    too_much: bool = False
    """Its stdout ran past the limit (what was read of it is kept, the rest never read)."""


_REAP_TIMEOUT = 10.0
"""A hang guard on reaping a process killed with SIGKILL (it takes milliseconds)."""


async def _run_bounded(argv: list[str], stdin: bytes, timeout: float, stdout_limit: int) -> _Ran:
    """Run ``argv``, in a process group of its own, with ``stdin``, and say what it did: its stdout (up to
    ``stdout_limit`` bytes), the end of its stderr, its exit status. Past ``timeout`` or the limit, or
    when cancelled, its whole group is killed (SIGKILL); it is always reaped.

    Raises:
        IsolationError: it could not be run.
    """
    try:
        process = await anyio.open_process(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise IsolationError(f"cannot run ssh: {reason}") from exc
    ran = _Ran()

    async def send() -> None:
        assert process.stdin is not None
        # ssh gone (it could not connect): its exit status and stderr say why.
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await process.stdin.send(stdin)
        await process.stdin.aclose()

    async def drain_stderr() -> None:
        assert process.stderr is not None
        async for chunk in process.stderr:
            ran.stderr_tail.extend(chunk)
            del ran.stderr_tail[:-ISOLATION_STDERR_TAIL_BYTES]

    try:
        with anyio.move_on_after(timeout) as bound:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(send)
                task_group.start_soon(drain_stderr)
                assert process.stdout is not None
                async for chunk in process.stdout:
                    ran.stdout.extend(chunk)
                    if len(ran.stdout) > stdout_limit:
                        ran.too_much = True
                        break
                if not ran.too_much:
                    await process.wait()
                task_group.cancel_scope.cancel()  # stderr: held open by a process ssh left, if any
        ran.timed_out = bound.cancelled_caught
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(_REAP_TIMEOUT):
            if process.returncode is None:
                # Over a bound, or cancelled: ssh and what it started (a ProxyCommand) go at once.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
            await process.aclose()
        if process.returncode is None:
            logger.error("ssh pid %d, killed, could not be reaped within %gs", process.pid, _REAP_TIMEOUT)
    ran.returncode = process.returncode
    return ran


def _last_lines(stderr: bytes | bytearray, count: int = 3) -> str:
    """The last ``count`` non-blank lines of ``stderr``, joined, for a message."""
    lines = [line.strip() for line in stderr.decode(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-count:])[-1000:] if lines else "no message"


def _log_recoveries(stderr: bytes | bytearray, host: str) -> None:
    """Log here (info: the caller says what it asked to be reaped) what the core, on ``host``, said it
    recovered."""
    for line in stderr.decode(errors="replace").splitlines():
        if line.startswith(isolation_core.RECOVERED):
            logger.info("on %s: %s", host, line)


class _ReportedEndStream(anyio.abc.ByteReceiveStream):
    """ssh's stdout: the agent's, from the start line on, ended where its remote supervisor reports the
    agent's stdout ended.

    The start line (the marker and a newline) is written by the remote side just before the agent
    starts; whatever precedes it (the login shell's start-up files may print) is dropped, keeping no
    more of it than the start line's length. The ssh client keeps its stdout open until the remote
    command exits, so an agent that closes its stdout but lives on would never be seen here: the remote
    supervisor relays the agent's stdout and reports ``stdout N`` (behind the marker, on stderr) once
    every writer closed it, N being the bytes relayed. The report and the last bytes travel on two
    pipes from ssh, in either order, so this stream ends once N bytes were received, never before.
    Chunks pass through as they are (counted, never copied or held).
    """

    def __init__(self, inner: anyio.abc.ByteReceiveStream, start_line: bytes) -> None:
        self._inner = inner
        self._start_line = start_line
        self._before_start: bytes | None = b""
        """While the start line is awaited, the end of what came so far (shorter than the line)."""
        self._received = 0
        self._end: int | None = None
        self._waiting: anyio.CancelScope | None = None

    def end_at(self, total: int) -> None:
        """The agent's stdout ended after ``total`` bytes: end this stream once they were all received
        (at once, if a receive waits for more)."""
        self._end = total
        if self._waiting is not None and self._received >= total:
            self._waiting.cancel()

    async def receive(self, max_bytes: int = 65536) -> bytes:
        """The next bytes of the agent's stdout; `anyio.EndOfStream` after the last."""
        while True:
            if self._end is not None and self._received >= self._end:
                raise anyio.EndOfStream
            with anyio.CancelScope() as scope:
                self._waiting = scope
                try:
                    chunk = await self._inner.receive(max_bytes)
                finally:
                    self._waiting = None
            if scope.cancelled_caught:  # end_at: everything was received.
                raise anyio.EndOfStream
            if self._before_start is not None:
                chunk = self._after_start_line(chunk)
                if not chunk:
                    continue
            self._received += len(chunk)
            return chunk

    def _after_start_line(self, chunk: bytes) -> bytes:
        """What follows the start line in ``chunk`` (it may straddle two chunks); b"" until it came."""
        assert self._before_start is not None
        seen = self._before_start + chunk
        found = seen.find(self._start_line)
        if found < 0:
            self._before_start = seen[-(len(self._start_line) - 1) :]
            return b""
        self._before_start = None
        return seen[found + len(self._start_line) :]

    async def aclose(self) -> None:
        """Close ssh's stdout (teardown does; see `AgentProcess.stdout`)."""
        await self._inner.aclose()


class SshChannel:
    """One agent on a remote host, as `SshTransport.open` yields it (a `subagent.acp.transports.Channel`).

    Its streams are the local ssh client's; `pid` is that client's pid, `remote_pid` the agent's own.
    """

    def __init__(
        self,
        transport: SshTransport,
        command: tuple[str, ...],
        marker: str,
        on_stderr_line: Callable[[str], object] | None,
        cwd: str | None = None,
    ) -> None:
        self._transport = transport
        self._cwd = cwd
        self._host = transport.host
        self.command = command
        """The argv the agent was started with on the remote host."""
        self._report_prefix = marker + " "
        self._on_stderr_line = on_stderr_line
        self._process: AgentProcess | None = None
        self._stdout: _ReportedEndStream | None = None
        self.remote_pid: int | None = None
        """The agent's pid on the remote host, once reported."""
        self._remote_returncode: int | None = None
        self._failure: str | None = None
        self._started = anyio.Event()
        self._exit_reported = anyio.Event()
        self._blank_pending = False
        self._tail: collections.deque[str] = collections.deque()
        self._tail_chars = 0
        self._stderr_bytes_total = 0

    def __repr__(self) -> str:
        return f"<SshChannel {self.describe()} command={shlex.join(self.command)!r}>"

    @property
    def _local(self) -> AgentProcess:
        if self._process is None:
            raise RuntimeError("the ssh client is not running yet")
        return self._process

    @property
    def stdin(self) -> anyio.abc.ByteSendStream:
        """The agent's stdin (ssh's); closing it is the agent's cue to finish."""
        return self._local.stdin

    @property
    def stdout(self) -> anyio.abc.ByteReceiveStream:
        """The agent's stdout (ssh's), ended where the agent's own ended (`_ReportedEndStream`)."""
        if self._stdout is None:
            raise RuntimeError("the ssh client is not running yet")
        return self._stdout

    def _attach(self, process: AgentProcess) -> None:
        self._process = process
        self._stdout = _ReportedEndStream(process.stdout, self._report_prefix.encode()[:-1] + b"\n")

    @property
    def pid(self) -> int | None:
        """The local ssh client's pid."""
        return None if self._process is None else self._process.pid

    @property
    def via(self) -> str:
        """``"via ssh to HOST"``."""
        return f"via ssh to {self._host}"

    def describe(self) -> str:
        """``"pid 456 via ssh to build-1"`` (the agent's remote pid), or the ssh client's pid until then."""
        if self.remote_pid is not None:
            return f"pid {self.remote_pid} {self.via}"
        return f"ssh pid {self.pid} to {self._host}"

    # stderr: the agent's lines, ssh's own, and the supervisor's reports (taken out here).

    def _absorb_line(self, line: str) -> None:
        if line.startswith(self._report_prefix):
            self._blank_pending = False  # A blank line just before was the report's own leading newline.
            self._take_report(line[len(self._report_prefix) :])
            return
        if self._blank_pending:
            self._blank_pending = False
            self._keep_line("")
        if line == "":
            self._blank_pending = True
        else:
            self._keep_line(line)

    def _keep_line(self, line: str) -> None:
        self._stderr_bytes_total += len(line.encode(errors="replace")) + 1
        limit = self._transport.stderr_tail_bytes
        if len(line) >= limit:
            self._tail.clear()
            self._tail_chars = 0
            line = line[len(line) - limit :] if limit else ""
        self._tail.append(line)
        self._tail_chars += len(line) + 1
        while self._tail_chars > limit and self._tail:
            self._tail_chars -= len(self._tail.popleft()) + 1
        if self._on_stderr_line is not None:
            self._on_stderr_line(line)

    def _take_report(self, report: str) -> None:
        kind, _, rest = report.partition(" ")
        try:
            if kind == "pid":
                self.remote_pid = int(rest)
                self._started.set()
            elif kind == "exit":
                self._remote_returncode = int(rest)
                self._exit_reported.set()
            elif kind == "stdout":
                if self._stdout is not None:
                    self._stdout.end_at(int(rest))
            elif kind == "error":
                self._failure = f"exec failed on {self._host}: {rest.partition(' ')[2]}"
                self._started.set()
            elif kind == "fail":
                what, _, reason = rest.partition(" ")
                if what == "cwd":
                    self._failure = f"working directory {self._cwd!r} on {self._host}: {reason}"
                else:
                    self._failure = f"its supervisor on {self._host} failed: {rest}"
                self._started.set()
        except ValueError:
            pass  # Not the supervisor's (which writes only well-formed reports): ignored.

    def stderr_tail(self) -> str:
        """The agent's last stderr lines (and ssh's own), without the supervisor's reports."""
        return "".join(line + "\n" for line in self._tail)

    def _last_stderr(self) -> str:
        lines = [line.strip() for line in self._tail if line.strip()]
        return " | ".join(lines[-3:]) if lines else "no message"

    async def _start(self, requests: bytes, timeout: float) -> None:
        """Send the requests and wait for the agent's pid; raise AgentSpawnError if it did not start."""
        local = self._local
        with anyio.move_on_after(timeout):
            # Within the bound too: ssh reads its stdin only once connected.
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await local.stdin.send(requests)  # If ssh is gone, its exit says why, below.
            await _first_of(self._started.wait, local.wait_exit)
        if self.remote_pid is not None:
            return
        reason = self._failure
        if reason is None:
            info = local.exit_info()
            if info is None:
                reason = f"ssh to {self._host} did not start it within {timeout:g}s"
            elif info.returncode == SSH_CONNECTION_FAILED:
                reason = f"ssh to {self._host} failed: {self._last_stderr()}"
            else:
                reason = f"ssh to {self._host} ended before it started ({info.status}): {self._last_stderr()}"
        raise AgentSpawnError(self.command, reason)

    def exit_info(self) -> ExitInfo | None:
        """How the agent ended: its exit status as its remote supervisor reported it, or, if ssh ended
        without that report (the connection was lost), an unknown status; None while it runs."""
        tail, total = self.stderr_tail(), self._stderr_bytes_total
        if self._remote_returncode is not None:
            return ExitInfo(self.command, self.remote_pid, self._remote_returncode, tail, total, via=self.via)
        local = self._local.exit_info()
        if local is None:
            return None
        lost_because = f"{self.via}, connection lost: ssh {local.status}"
        return ExitInfo.lost(self.command, self.remote_pid, tail, total, lost_because)

    async def wait_exit(self) -> ExitInfo:
        """Wait until the agent exits (as reported from the remote host) or ssh ends, and describe it."""
        local = self._local
        await _first_of(self._exit_reported.wait, local.wait_exit)
        info = self.exit_info()
        if info is None:  # ssh exited, its stderr not yet read: wait_exit lets it settle.
            await local.wait_exit()
            info = self.exit_info()
        assert info is not None
        return info

    def kill(self) -> None:
        """SIGKILL the local ssh client now: the connection drops, and the remote supervisor then ends
        the agent's tree (SIGTERM at once, SIGKILL 1 s later). Synchronous, idempotent."""
        if self._process is not None:
            self._process.kill()

    async def aclose(self, *, stdin_close_timeout: float | None = None) -> TeardownReport:
        """Tear the ssh client down (close stdin, wait, SIGTERM, wait, SIGKILL), which ends the remote
        tree; the report is the local ssh client's. Idempotent, shielded, bounded."""
        return await self._local.aclose(stdin_close_timeout=stdin_close_timeout)


async def _first_of(*waits: Callable[[], Awaitable[object]]) -> None:
    """Return as soon as one of ``waits`` returns; the others are cancelled."""
    async with anyio.create_task_group() as task_group:

        async def run(wait: Callable[[], Awaitable[object]]) -> None:
            await wait()
            task_group.cancel_scope.cancel()

        for wait in waits:
            task_group.start_soon(run, wait)


def transport_from_url(url: str) -> SshTransport:
    """``ssh://[user@]host[:port]`` -> `SshTransport` (defaults for everything else)."""
    # Messages never quote the URL: a mistaken one may hold a password.
    parts = urlsplit(url)
    if parts.scheme.lower() != "ssh" or not parts.hostname:
        raise ValueError("not an ssh transport URL: expected ssh://[user@]host[:port]")
    if parts.password is not None:
        raise ValueError("an ssh transport URL takes no password: ssh runs in batch mode (keys only)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError("an ssh transport URL is ssh://[user@]host[:port], with no path, query or fragment")
    try:
        port = parts.port
    except ValueError:
        raise ValueError("the port of the ssh transport URL is not a number from 1 to 65535") from None
    user = None if parts.username is None else unquote(parts.username)
    return SshTransport(parts.hostname, user=user, port=port)
