"""The local transport: a child agent process of ours, owned completely: spawned under a supervisor, its
stderr drained, its whole process tree torn down (`open_agent_process`, `AgentProcess`, `LocalTransport`).

Spawn policy
    `open_agent_process` runs ``argv`` with no shell, as the leader of a process group of its own, so
    ``pgid == pid``. The group id is remembered at spawn and never looked up again: ``getpgid()`` fails once
    the leader is reaped, yet the group lives on while a grandchild remains. The environment is the parent's
    with ``env`` merged over it, unless ``inherit_env=False`` asks for exactly ``env`` (keep ``PATH`` and
    ``HOME`` then: Claude's ACP adapter reported missing auth when they were empty).
    A missing or non-executable program, or an argument, ``cwd`` or ``env`` entry exec cannot carry (a NUL;
    a variable name that is empty or holds ``=``), raises `AgentSpawnError` before anything starts.

The supervisor (Linux; ``supervise=False`` or elsewhere: the agent is spawned directly, in a new session)
    The agent is started by a small supervisor (``_supervisor`` here, run as ``python -I -S`` with
    the standard library only: it adds about 14 ms to a spawn, and 9 MiB resident, 4 MiB proportional),
    which leads its own session, sits between us and the agent, and is a *child subreaper*: descendants
    that leave the agent's group (``setsid``, double fork, ``setpgid``) are re-parented to it, not init.
    It reports the agent's pid, and its exit status the moment it is reaped, on a status pipe; it exits
    only once no descendant is left. On our request it sends SIGTERM, or SIGKILL again and again, to every
    descendant; and if our process dies, even by SIGKILL, it notices within 0.25 s, sends SIGTERM to every
    descendant, SIGKILL 1 s later, and exits. `AgentProcess.pid`, ``pgid``, ``returncode`` and `ExitInfo`
    stay the agent's own; `AgentProcess.supervisor_pid` names the supervisor. Limits: a process
    re-parented outside our tree (handed to a daemon manager over IPC, say) cannot be followed; a
    supervisor that is itself SIGKILLed leaves only the agent's group within reach (the agent's status is
    then unknown: `ExitInfo.status_known`).

Running
    stderr is drained at all times by a background task into a bounded tail (the last 64 KiB by default), so a
    chatty child never blocks on a full stderr pipe and memory stays bounded. ``stdin`` and ``stdout`` belong
    to the caller (the JSON-RPC connection). `AgentProcess.wait_exit` returns as soon as the agent itself
    exits, even when a grandchild still holds its pipes open: supervised, it is told so on the status pipe;
    spawned directly, it races the backend's ``wait()`` against a slow ``returncode`` poll, in case that
    ``wait()`` also waits for pipe EOF.

Teardown policy (`AgentProcess.aclose`, and always when the ``async with`` block exits)
    1. close stdin, the agent's cue to finish; give the whole tree `STDIN_CLOSE_TIMEOUT` to be gone;
    2. SIGTERM to every descendant (supervised: the supervisor relays it, once to each; else
       ``killpg(pgid, SIGTERM)``) and wait `SIGTERM_TIMEOUT`;
    3. SIGKILL: the supervisor sweeps the tree until nothing is left, and the agent's group is also killed
       from here; wait `SIGKILL_TIMEOUT` for the reap. A supervisor that is still there then (stopped, or
       waiting on a process in uninterruptible sleep) is SIGKILLed as well and given one more
       `SIGKILL_TIMEOUT`.

    "Gone" means the direct child (the supervisor, or the agent) has been reaped and no live (non-zombie)
    process is left in the agent's group; a supervisor exits only once it has no descendant left, so a
    grandchild is signalled even when the agent already exited on its own. Each wait polls ``returncode``,
    ``killpg(pgid, 0)`` and ``/proc`` rather than awaiting ``Process.wait()``: asyncio's ``wait()`` has also
    waited for pipe EOF, and a grandchild that inherited the pipes makes an exited child look hung. stdout is
    drained and stderr keeps draining throughout, so a child blocked writing to a full pipe can still exit.
    The sequence runs inside a cancellation shield and every wait is bounded: a cancelled caller can neither
    leak a live process or a file descriptor nor hang, and teardown takes at most the sum of the timeouts
    (plus one more `SIGKILL_TIMEOUT` if the supervisor must be killed) plus `STDERR_SETTLE_TIMEOUT`.
    Teardown is idempotent, and `TeardownReport` records the steps it needed.

Limits
    POSIX only; without the supervisor, a descendant that leaves the process group (``setsid``/``setpgid``,
    as daemons do) is not tracked. ``ESRCH`` from ``killpg`` means the group is gone; ``EPERM`` never proves
    that, so it is logged and the report says ``group_gone=False`` unless ``/proc`` shows no live member.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from subagent.acp._errors import AgentSpawnError
from subagent.acp.transports._channel import (
    UNKNOWN_RETURNCODE,
    BaseTransport,
    Channel,
    ExitInfo,
    Launch,
    StderrTail,
    TeardownReport,
    TeardownStep,
    check_command,
    own_channel,
)

__all__ = [
    "SIGKILL_TIMEOUT",
    "SIGTERM_TIMEOUT",
    "STDERR_SETTLE_TIMEOUT",
    "STDERR_TAIL_BYTES",
    "STDIN_CLOSE_TIMEOUT",
    "SUPERVISOR_DIED",
    "SUPERVISOR_START_TIMEOUT",
    "AgentProcess",
    "LocalTransport",
    "open_agent_process",
    "supervision_available",
]

logger = logging.getLogger(__name__)

STDIN_CLOSE_TIMEOUT = 2.0
"""Teardown step 1's grace, in seconds, after stdin closes: ACP agents exit then, and two seconds lets one
flush its state without stalling our shutdown."""
SIGTERM_TIMEOUT = 2.0
"""Teardown step 2's grace after SIGTERM: time for the SIGTERM handlers (the agent's and its tools') to clean
up before the group is killed outright."""
SIGKILL_TIMEOUT = 2.0
"""How long teardown waits for the reap after SIGKILL. SIGKILL cannot be caught, so this only bounds the
kernel's reap: a safety net, not a grace period."""
STDERR_SETTLE_TIMEOUT = 0.5
"""After the child exits, wait this long for stderr EOF so the tail holds its last words; only a descendant
still holding the pipe open makes the wait run out."""
STDERR_TAIL_BYTES = 64 * 1024
"""How many trailing bytes of stderr are kept: enough for a Python traceback or a Node stack trace, small
enough to keep for every agent."""

_EXIT_FALLBACK_POLL_INTERVAL = 0.25
"""Backstop for backends whose Process.wait() also waits for pipe EOF; the backend's wait() is normally
first."""
_GROUP_POLL_FIRST_INTERVAL = 0.002
"""The first wait between two checks that the group is gone: short, as most children exit within
milliseconds of stdin closing. The wait doubles at each check, up to `_GROUP_POLL_MAX_INTERVAL`."""
_GROUP_POLL_MAX_INTERVAL = 0.05
"""The longest wait between two checks that the group is gone."""
_READ_SIZE = 64 * 1024
"""One pipe buffer's worth per read."""
SUPERVISOR_START_TIMEOUT = 30.0
"""A hang guard only: the supervisor reports the agent's pid about 14 ms after it was spawned."""
SUPERVISOR_DIED = "via a supervisor that died before reporting its exit"
"""`ExitInfo.via` of a local agent whose status is unknown because its supervisor died first."""
_SUPERVISOR_DIR = os.path.dirname(os.path.abspath(__file__))
_SUPERVISOR_PATH = os.path.join(_SUPERVISOR_DIR, "_supervisor.py")
_SUPERVISOR_COMMAND = (
    "-I",
    "-S",
    "-c",
    f"import sys; sys.path.append({_SUPERVISOR_DIR!r}); "
    "from _supervisor import main; sys.exit(main(sys.argv[1:]))",
)
"""The Python arguments that run the supervisor. It imports the standard library only (importing this
package would be slow), run isolated (-I: no PYTHON* variables, no user site, no current directory on
sys.path) and without site-packages (-S). It is imported from its directory, appended after the standard
library, rather than run as a script: an imported module's bytecode is cached, which saves compiling it at
every spawn (measured: 3 ms of ~17)."""
_STATUS_LINE_LIMIT = 1024
"""The supervisor's status lines are a few dozen bytes; anything longer is not from it."""


class _SerializedReceiveStream(anyio.abc.ByteReceiveStream):
    """stdout, read by one task at a time, so teardown can drain it while a caller's reader is active."""

    def __init__(self, inner: anyio.abc.ByteReceiveStream) -> None:
        self._inner = inner
        self._lock = anyio.Lock(fast_acquire=True)

    async def receive(self, max_bytes: int = _READ_SIZE) -> bytes:
        """Receive up to ``max_bytes``; `anyio.EndOfStream` once every holder of the write end closed it."""
        async with self._lock:
            return await self._inner.receive(max_bytes)

    async def aclose(self) -> None:
        """Close our end; a task blocked in `receive` gets `anyio.ClosedResourceError`."""
        await self._inner.aclose()


class _StatusPipe:
    """Our end of a supervisor's status pipe (see ``_supervisor``), parsed as lines arrive."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self._buffer = bytearray()
        self.agent_pid: int | None = None
        self.returncode: int | None = None
        self.failure: str | None = None
        """Why the agent was not started: ``exec failed: <strerror>`` or the supervisor's own reason."""
        self.exec_errno: int | None = None
        self.eof = False
        """Nothing more is read: the supervisor closed the pipe (it exited), the pipe was closed here, or
        it carried something the supervisor never writes."""

    @property
    def settled(self) -> bool:
        """Nothing more will come: the agent's exit was reported, or the pipe ended."""
        return self.returncode is not None or self.eof

    def pump(self) -> None:
        """Read and parse whatever has arrived, without blocking."""
        while not self.eof:
            try:
                chunk = os.read(self.fd, _STATUS_LINE_LIMIT)
            except BlockingIOError:
                return
            if not chunk:
                self.eof = True
                return
            self._buffer += chunk
            *lines, partial = self._buffer.split(b"\n")
            self._buffer = bytearray(partial)
            for line in lines:
                self._parse(bytes(line))
            if len(self._buffer) > _STATUS_LINE_LIMIT:
                logger.error("unexpected data on the supervisor's status pipe; ignoring the rest")
                # Not closed here: the exit watcher may be waiting on it. open_agent_process closes it.
                self._buffer.clear()
                self.eof = True

    def _parse(self, line: bytes) -> None:
        kind, _, rest = line.partition(b" ")
        text = rest.decode(errors="replace")
        try:
            if kind == b"pid":
                self.agent_pid = int(text)
            elif kind == b"exit":
                self.returncode = int(text)
            elif kind == b"error":
                code, _, reason = text.partition(" ")
                self.exec_errno = int(code)
                self.failure = f"exec failed: {reason}"
            elif kind == b"fail":
                self.failure = f"its supervisor failed: {text}"
            else:
                raise ValueError(kind)
        except ValueError:
            logger.error("unexpected line on the supervisor's status pipe: %r", line[:100])

    async def wait_readable(self) -> None:
        """Wait until `pump` has something to read (or the end of the pipe)."""
        await anyio.wait_readable(self.fd)

    def close(self) -> None:
        """Close our end; idempotent. Only once no task waits in `wait_readable`."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            self.eof = True
            os.close(fd)


class AgentProcess:
    """A running child agent, owned by `open_agent_process`; not constructed directly.

    ``stdin``/``stdout`` are the agent's protocol channel. A task reading ``stdout`` may still be running when
    `aclose` is called: reads are serialized, and teardown only drains what nobody else reads.
    """

    def __init__(
        self,
        process: anyio.abc.Process,
        command: tuple[str, ...],
        *,
        status: _StatusPipe | None,
        stderr_tail_bytes: int,
        on_stderr_line: Callable[[str], object] | None,
        stdin_close_timeout: float,
        sigterm_timeout: float,
        sigkill_timeout: float,
        stderr_settle_timeout: float,
    ) -> None:
        if process.stdin is None or process.stdout is None or process.stderr is None:
            raise RuntimeError("the agent process was spawned without pipes")
        # The supervisor's process when supervised, else the agent's.
        self._process = process
        self._status = status
        self.command = command
        """The argv the agent was started with."""
        agent_pid = process.pid if status is None else status.agent_pid
        if agent_pid is None:
            raise RuntimeError("the supervisor did not report the agent's pid")
        self.pid = agent_pid
        """The agent's process id (also when it runs under a supervisor)."""
        # Equal to the pid because the agent was started as a process group leader. Kept from spawn on:
        # getpgid() fails once the leader is reaped, while grandchildren may stay in the group.
        self.pgid = agent_pid
        """The agent's process group id, which every descendant inherits unless it leaves the group."""
        self.supervisor_pid: int | None = None if status is None else process.pid
        """The pid of the agent's supervisor (its parent), or None when it was spawned directly."""
        self._stdin = process.stdin
        self._stdout = _SerializedReceiveStream(process.stdout)
        self._stderr = process.stderr
        self._stderr_tail = StderrTail(stderr_tail_bytes, on_stderr_line)
        self._stdin_close_timeout = stdin_close_timeout
        self._sigterm_timeout = sigterm_timeout
        self._sigkill_timeout = sigkill_timeout
        self._stderr_settle_timeout = stderr_settle_timeout
        self._stderr_done = anyio.Event()
        self._stderr_scope: anyio.CancelScope | None = None
        self._exited = anyio.Event()
        self._teardown_signal: signal.Signals | None = None
        self._teardown_lock = anyio.Lock()
        self._teardown_report: TeardownReport | None = None
        self._exit_status_known = True

    def __repr__(self) -> str:
        returncode = self.returncode
        if self._teardown_report is not None:
            state = f"torn down ({self._teardown_report.ended_by.name})"
        elif returncode is None:
            state = "running"
        else:
            state = f"exited ({returncode})"
        return f"<AgentProcess pid={self.pid} {state} command={shlex.join(self.command)!r}>"

    @property
    def stdin(self) -> anyio.abc.ByteSendStream:
        """The agent's stdin. Closed by teardown; closing it yourself is the agent's cue to finish."""
        return self._stdin

    @property
    def stdout(self) -> anyio.abc.ByteReceiveStream:
        """The agent's stdout. Reads are serialized with teardown's drain; teardown closes it.

        Leave closing to teardown: a child blocked writing to a closed-but-unread stdout cannot exit until
        it is signalled.
        """
        return self._stdout

    @property
    def supervised(self) -> bool:
        """Whether the agent runs under a supervisor (see the module docstring)."""
        return self._status is not None

    @property
    def returncode(self) -> int | None:
        """The exit status once the child exited and was reaped, else None (negative: killed by signal)."""
        if self._status is None:
            return self._process.returncode
        self._status.pump()
        return self._status.returncode

    @property
    def teardown_report(self) -> TeardownReport | None:
        """What teardown did, once it has run."""
        return self._teardown_report

    @property
    def stderr_bytes_total(self) -> int:
        """How many bytes the agent has written to stderr so far."""
        return self._stderr_tail.bytes_total

    def stderr_tail_raw(self) -> bytes:
        """The last bytes of stderr received so far (at most ``stderr_tail_bytes``), exactly as written."""
        return self._stderr_tail.raw()

    def stderr_tail(self) -> str:
        """The stderr tail decoded as UTF-8 with replacement, minus a character cut in half by the trim."""
        return self._stderr_tail.text()

    def exit_info(self) -> ExitInfo | None:
        """How the child ended, or None while it runs. Prefer `wait_exit`, which also lets stderr settle."""
        returncode = self.returncode
        if returncode is None:
            return None
        return self._describe_exit(returncode)

    def _describe_exit(self, returncode: int) -> ExitInfo:
        return ExitInfo(
            command=self.command,
            pid=self.pid,
            returncode=returncode,
            stderr_tail=self.stderr_tail(),
            stderr_bytes_total=self.stderr_bytes_total,
            teardown_signal=self._teardown_signal,
            status_known=self._exit_status_known,
            via=None if self._exit_status_known else SUPERVISOR_DIED,
        )

    async def wait_exit(self) -> ExitInfo:
        """Wait until the child itself exits, then until stderr reaches EOF (bounded), and describe the exit.

        Returns even when a grandchild still holds the child's stdout/stderr open. Tears nothing down:
        descendants may live on until teardown.
        """
        returncode = self.returncode
        while returncode is None:
            await self._exited.wait()
            returncode = self.returncode
        with anyio.move_on_after(self._stderr_settle_timeout):
            await self._stderr_done.wait()
        return self._describe_exit(returncode)

    def describe(self) -> str:
        """``"pid 123"``: the agent, for messages (`subagent.acp.transports.Channel.describe`)."""
        return f"pid {self.pid}"

    def kill(self) -> None:
        """SIGKILL the agent's whole tree now: with a supervisor, every descendant, those that left the
        process group included; without one, the agent's process group. Synchronous and idempotent.

        For an emergency stop (a second Ctrl-C); it does not wait, reap or close anything: `aclose` still
        does that, and a teardown already waiting out a grace sees the tree gone at its next look.
        """
        self._signal_tree(signal.SIGKILL)

    async def aclose(self, *, stdin_close_timeout: float | None = None) -> TeardownReport:
        """Tear the process group down (see the module docstring) and close the pipes; idempotent.

        ``stdin_close_timeout`` overrides the configured grace after stdin closes, for this teardown: an
        owner that knows the agent is idle (nothing in flight) can give it a shorter one.

        Runs shielded from cancellation and bounded in time. Concurrent and later calls wait for the first and
        return the same report.
        """
        with anyio.CancelScope(shield=True):
            async with self._teardown_lock:
                if self._teardown_report is None:
                    if stdin_close_timeout is not None:
                        self._stdin_close_timeout = stdin_close_timeout
                    self._teardown_report = await self._tear_down()
                report = self._teardown_report
        return report

    def _start_background_tasks(self, task_group: anyio.abc.TaskGroup) -> None:
        """Start draining stderr and watching for exit. Synchronous: no cancellation can arrive in between."""
        task_group.start_soon(self._drain_stderr_shielded, name=f"drain stderr of agent pid {self.pid}")
        task_group.start_soon(self._watch_exit, name=f"watch exit of agent pid {self.pid}")

    async def _drain_stderr_shielded(self) -> None:
        # Shielded, so that a caller cancelled mid-run still has what the agent writes while it is torn down
        # (a crash's last lines; over SSH, the remote supervisor's exit report); `_stop_stderr_drain` ends it
        # once teardown is over.
        with anyio.CancelScope(shield=True) as scope:
            self._stderr_scope = scope
            await self._drain_stderr()

    def _stop_stderr_drain(self) -> None:
        if self._stderr_scope is not None:
            self._stderr_scope.cancel()

    async def _drain_stderr(self) -> None:
        try:
            while True:
                try:
                    chunk = await self._stderr.receive(_READ_SIZE)
                except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                    break
                self._stderr_tail.absorb(chunk)
            self._stderr_tail.finish()
        finally:
            self._stderr_done.set()

    async def _watch_exit(self) -> None:
        if self._status is not None:
            await self._watch_status(self._status)
        else:
            async with anyio.create_task_group() as task_group:

                async def wait_via_backend() -> None:
                    await self._process.wait()
                    task_group.cancel_scope.cancel()

                task_group.start_soon(wait_via_backend)
                await _poll_until(
                    self._has_exited, _EXIT_FALLBACK_POLL_INTERVAL, _EXIT_FALLBACK_POLL_INTERVAL
                )
                task_group.cancel_scope.cancel()
        self._exited.set()

    async def _watch_status(self, status: _StatusPipe) -> None:
        """Follow the supervisor's status pipe until it reports the agent's exit (or ends without it)."""
        # Cancelled, this leaves the pipe open: teardown reads the exit from it. open_agent_process closes it
        # once this task is over, so no wait is ever pending on a closed fd.
        status.pump()
        while not status.settled:
            await status.wait_readable()
            status.pump()
        if status.returncode is None:
            logger.warning(
                "the supervisor (pid %s) of agent pid %d ended without reporting the agent's exit; "
                "waiting for the agent itself to be gone",
                self.supervisor_pid,
                self.pid,
            )
            await _poll_until(
                self._lost_agent_is_gone, _EXIT_FALLBACK_POLL_INTERVAL, _EXIT_FALLBACK_POLL_INTERVAL
            )

    def _lost_agent_is_gone(self) -> bool:
        """With its supervisor dead, whether the agent is gone; if so its exit is recorded as unknown."""
        assert self._status is not None
        if self._status.returncode is not None:
            return True
        if _process_is_running(self.pid, self.pgid):
            return False
        self._status.returncode = UNKNOWN_RETURNCODE
        self._exit_status_known = False
        return True

    async def _tear_down(self) -> TeardownReport:
        exited_before_teardown = self.returncode is not None
        steps = [TeardownStep.CLOSE_STDIN]
        async with anyio.create_task_group() as drain:
            drain.start_soon(self._discard_stdout)
            await self._stdin.aclose()
            group_gone = await self._wait_for_group_exit(self._stdin_close_timeout)
            if not group_gone:
                logger.info(
                    "agent pid %d still running %.1fs after stdin closed; sending SIGTERM to its %s",
                    self.pid,
                    self._stdin_close_timeout,
                    self._tree_name,
                )
                steps.append(TeardownStep.SIGTERM)
                self._signal_tree(signal.SIGTERM)
                group_gone = await self._wait_for_group_exit(self._sigterm_timeout)
            if not group_gone:
                logger.warning(
                    "agent pid %d: its %s survived SIGTERM for %.1fs; sending SIGKILL",
                    self.pid,
                    self._tree_name,
                    self._sigterm_timeout,
                )
                steps.append(TeardownStep.SIGKILL)
                self._signal_tree(signal.SIGKILL)
                group_gone = await self._wait_for_group_exit(self._sigkill_timeout)
            if not group_gone and self._supervisor_running():
                # The supervisor did not finish its sweep in time (stopped, or a descendant in uninterruptible
                # sleep): kill it too. Descendants outside the agent's group that are left become init's.
                logger.error(
                    "the supervisor (pid %s) of agent pid %d outlived SIGKILL; killing it",
                    self.supervisor_pid,
                    self.pid,
                )
                self._signal_process(self._process.pid, signal.SIGKILL)
                self._signal_group(signal.SIGKILL)
                group_gone = await self._wait_for_group_exit(self._sigkill_timeout)
            drain.cancel_scope.cancel()
        if not group_gone:
            logger.error(
                "the %s of agent `%s` (process group %d) still has live members after SIGKILL; they may be "
                "leaked",
                self._tree_name,
                shlex.join(self.command),
                self.pgid,
            )
        if self.returncode is not None:
            self._exited.set()
        with anyio.move_on_after(self._stderr_settle_timeout):
            await self._stderr_done.wait()
        await self._close_pipes()
        report = TeardownReport(tuple(steps), exited_before_teardown, group_gone)
        logger.debug("agent pid %d torn down: %s", self.pid, report)
        return report

    @property
    def _tree_name(self) -> str:
        return "process group" if self._status is None else "process tree"

    async def _discard_stdout(self) -> None:
        with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            while True:
                await self._stdout.receive(_READ_SIZE)

    async def _wait_for_group_exit(self, timeout: float) -> bool:
        """Poll until everything is gone (see `_group_is_gone`); False if ``timeout`` ran out."""
        with anyio.move_on_after(timeout):
            await _poll_until(self._group_is_gone, _GROUP_POLL_FIRST_INTERVAL, _GROUP_POLL_MAX_INTERVAL)
            return True
        return False

    def _has_exited(self) -> bool:
        return self.returncode is not None

    def _supervisor_running(self) -> bool:
        # On trio, reading returncode is what reaps the process.
        return self._status is not None and self._process.returncode is None

    def _group_is_gone(self) -> bool:
        """The direct child (the supervisor, or the agent) is reaped and the agent's group has no live member.

        Under a supervisor that exited normally, nothing is left of the tree: it exits only once it has no
        descendant left. The returncode comes first: on trio, reading it is what reaps the child (a zombie
        counts as a group member).
        """
        if self._process.returncode is None or _group_has_live_members(self.pgid):
            return False
        if self._status is None or self.returncode is not None:
            return True
        # The supervisor is reaped, so its end of the pipe is closed: EOF comes once we drained it.
        return self._status.eof and self._lost_agent_is_gone()

    def _signal_tree(self, sig: signal.Signals) -> None:
        """Teardown's SIGTERM or SIGKILL: to the supervisor, which relays it to every descendant, else to
        the agent's process group."""
        if self.returncode is None:
            self._teardown_signal = sig
        if not self._supervisor_running():
            self._signal_group(sig)
            return
        assert self.supervisor_pid is not None
        self._signal_process(self.supervisor_pid, signal.SIGUSR1 if sig is signal.SIGKILL else sig)
        if sig is signal.SIGKILL:
            # At once and even if the supervisor is stopped; harmless twice. SIGTERM is not doubled: a second
            # one makes some programs skip their clean-up.
            self._signal_group(sig)

    def _signal_process(self, pid: int, sig: signal.Signals) -> None:
        # ESRCH: exited (and not reaped yet, or the pid would not be ours to signal).
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._status is not None and not _group_has_live_members(self.pgid):
            # The group may be empty while the supervisor still has work: its id could then be reused.
            return
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass  # ESRCH: the group emptied between the check and the signal.
        except PermissionError:
            logger.warning(
                "cannot send %s to process group %d of agent pid %d: permission denied; members may survive",
                sig.name,
                self.pgid,
                self.pid,
            )

    async def _close_pipes(self) -> None:
        if self._process.returncode is not None:
            # Closes every pipe (on asyncio the pipe transports too); the child is reaped: wait() is instant.
            await self._process.aclose()
            return
        # The child could not even be SIGKILLed and reaped (uninterruptible sleep, or another user's process):
        # close our ends and give up on it rather than hang in Process.aclose().
        for stream in (self._stdin, self._stdout, self._stderr):
            await stream.aclose()

    def _close_status(self) -> None:
        """Close the status pipe, once the exit watcher is over."""
        if self._status is not None:
            self._status.close()


async def _poll_until(condition: Callable[[], bool], first_interval: float, max_interval: float) -> None:
    """Return once ``condition()`` holds, checking at intervals that double from the first to the maximum."""
    interval = first_interval
    while not condition():
        await anyio.sleep(interval)
        interval = min(interval * 2, max_interval)


def _group_has_live_members(pgid: int) -> bool:
    """Whether any process that is not a zombie remains in process group ``pgid``.

    ``killpg(pgid, 0)`` also succeeds for zombies, and an orphaned grandchild stays a zombie for good under an
    init that does not reap (common in containers), so a positive answer is checked against ``/proc``.
    EPERM says a member exists that we may not signal; it never proves the group is gone.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        entries = os.scandir("/proc")
    except FileNotFoundError:
        return True  # No /proc (macOS): trust killpg, zombies included; their init reaps promptly.
    with entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat_file:
                    stat = stat_file.read()
            except OSError:
                continue  # Exited while we looked.
            # "pid (comm) state ppid pgrp ...": comm may hold spaces or parentheses; split after the last ")".
            fields = stat[stat.rfind(b")") + 2 :].split()
            if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
                return True
    return False


def supervision_available() -> bool:
    """Whether agents can run under a supervisor here: Linux, with a Python interpreter to run it."""
    return sys.platform == "linux" and bool(sys.executable) and os.path.isfile(_SUPERVISOR_PATH)


def _process_is_running(pid: int, pgid: int) -> bool:
    """Whether ``pid`` is alive (not a zombie) and still in group ``pgid`` (so not a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read()
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 2 :].split()
    return len(fields) >= 3 and fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid


def _spawn_environment(env: Mapping[str, str] | None, *, inherit_env: bool) -> dict[str, str] | None:
    if inherit_env:
        return None if env is None else {**os.environ, **env}
    exact = dict(env or {})
    missing = [name for name in ("PATH", "HOME") if not exact.get(name)]
    if missing:
        logger.warning(
            "spawning an agent with an exact environment lacking %s; it may not find tools or credentials",
            " and ".join(missing),
        )
    return exact


def _check_executable(command: tuple[str, ...], env: Mapping[str, str] | None, cwd: str | None) -> None:
    """Raise AgentSpawnError if the program cannot be executed, resolved the way exec will resolve it."""
    program = command[0]
    if cwd is not None and not os.path.isdir(cwd):
        raise AgentSpawnError(command, f"working directory {cwd!r} does not exist or is not a directory")
    if os.sep not in program:
        search_path = os.pathsep.join(os.get_exec_path(env))
        if shutil.which(program, path=search_path) is None:
            raise AgentSpawnError(command, f"{program!r} was not found on PATH ({search_path or 'empty'})")
        return
    path = program if cwd is None else os.path.join(cwd, program)
    if not os.path.exists(path):
        raise AgentSpawnError(command, f"{program!r} does not exist")
    if os.path.isdir(path):
        raise AgentSpawnError(command, f"{program!r} is a directory")
    if not os.access(path, os.X_OK):
        raise AgentSpawnError(command, f"{program!r} is not executable")


async def _spawn(
    command: tuple[str, ...], env: Mapping[str, str] | None, cwd: str | None, *, supervise: bool
) -> tuple[anyio.abc.Process, _StatusPipe | None]:
    """Start the agent, under a supervisor if ``supervise``: the process we own, and the status pipe."""
    # Shielded: once the child exists, no cancellation may escape before the caller owns the process (asyncio
    # would otherwise kill only the direct child itself; trio finishes the spawn in a thread regardless).
    with anyio.CancelScope(shield=True):
        if not supervise:
            process = await _open_process(command, list(command), env, cwd)
            return process, None
        read_end, write_end = os.pipe()
        status = _StatusPipe(read_end)
        try:
            if write_end < 3:
                # subprocess would overwrite a passed fd 0-2 with the child's stdio.
                write_end, low_fd = fcntl.fcntl(write_end, fcntl.F_DUPFD_CLOEXEC, 3), write_end
                os.close(low_fd)
            supervisor_argv = [
                sys.executable,
                *_SUPERVISOR_COMMAND,
                "--status-fd",
                str(write_end),
                "--parent-pid",
                str(os.getpid()),
                "--",
                *command,
            ]
            try:
                process = await _open_process(command, supervisor_argv, env, cwd, pass_fds=(write_end,))
            finally:
                os.close(write_end)
            failure = await _await_agent_pid(status)
            if failure is not None:
                await _reap_failed_supervisor(process)
                reason, cause = failure
                raise AgentSpawnError(command, reason) from cause
        except BaseException:
            status.close()
            raise
    return process, status


async def _open_process(
    command: tuple[str, ...],
    argv: list[str],
    env: Mapping[str, str] | None,
    cwd: str | None,
    pass_fds: Sequence[int] = (),
) -> anyio.abc.Process:
    try:
        return await anyio.open_process(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,
            pass_fds=pass_fds,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise AgentSpawnError(command, f"exec failed: {reason}") from exc


async def _await_agent_pid(status: _StatusPipe) -> tuple[str, OSError | None] | None:
    """Wait (bounded) for the supervisor's first report; if the agent did not start, why (and the cause)."""
    with anyio.move_on_after(SUPERVISOR_START_TIMEOUT):
        status.pump()
        while status.agent_pid is None and status.failure is None and not status.eof:
            await status.wait_readable()
            status.pump()
    if status.agent_pid is not None:
        return None
    if status.failure is not None:
        cause = OSError(status.exec_errno, os.strerror(status.exec_errno)) if status.exec_errno else None
        return status.failure, cause
    if status.eof:
        return "its supervisor exited before starting it", None
    return f"its supervisor did not report within {SUPERVISOR_START_TIMEOUT:g}s", None


async def _reap_failed_supervisor(process: anyio.abc.Process) -> None:
    """Reap a supervisor that failed to start the agent (it exits by itself; bounded), close its pipes."""
    with anyio.move_on_after(SIGKILL_TIMEOUT):
        with anyio.move_on_after(STDERR_SETTLE_TIMEOUT):
            await process.wait()
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        await process.aclose()
    if process.returncode is None:
        logger.error(
            "the supervisor pid %d of an agent that failed to start could not be reaped", process.pid
        )
        for stream in (process.stdin, process.stdout, process.stderr):
            if stream is not None:
                await stream.aclose()


@contextlib.asynccontextmanager
async def open_agent_process(
    argv: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
    inherit_env: bool = True,
    cwd: str | os.PathLike[str] | None = None,
    stderr_tail_bytes: int = STDERR_TAIL_BYTES,
    on_stderr_line: Callable[[str], object] | None = None,
    stdin_close_timeout: float = STDIN_CLOSE_TIMEOUT,
    sigterm_timeout: float = SIGTERM_TIMEOUT,
    sigkill_timeout: float = SIGKILL_TIMEOUT,
    stderr_settle_timeout: float = STDERR_SETTLE_TIMEOUT,
    supervise: bool = True,
) -> AsyncIterator[AgentProcess]:
    """Spawn ``argv`` as a child agent and own it until the block exits; then tear its process group down.

    Args:
        argv: The program and its arguments; no shell is involved, so a single string is rejected.
        env: Variables for the child. Merged over the parent's environment unless ``inherit_env`` is False.
        inherit_env: If False the child gets exactly ``env`` (empty if None); keep ``PATH`` and ``HOME``.
        cwd: The child's working directory (a relative program path is resolved against it, as exec does).
        stderr_tail_bytes: How many trailing bytes of stderr to keep for diagnosis.
        on_stderr_line: Called with each stderr line (decoded, without its newline) as it arrives, e.g.
            ``functools.partial(log.info, "agent: %s")``. It must not block or raise: an exception
            propagates and ends the block.
        stdin_close_timeout: Teardown step 1's grace: how long the group gets to exit after stdin closes.
        sigterm_timeout: Teardown step 2's grace after SIGTERM.
        sigkill_timeout: How long to wait for the reap after SIGKILL.
        stderr_settle_timeout: How long to wait for stderr EOF after the exit before describing it.
        supervise: Start the agent under a supervisor where `supervision_available` (Linux), so that
            descendants that leave its process group die with it too, even if this process is SIGKILLed.
            False: spawn the agent directly, as a process group of its own.

    Raises:
        AgentSpawnError: The program is missing or not executable, ``cwd`` is not a directory, exec failed,
            or an argument, ``cwd`` or ``env`` holds what exec cannot carry (a NUL character; a variable
            name that is empty or contains ``=``).

    An exception from the block propagates unchanged (not wrapped in an exception group) after teardown.
    Leaving the block is a cancellation point: a cancellation that arrives during the (shielded) teardown is
    delivered once it completes. After the block, the `AgentProcess` still answers `AgentProcess.exit_info`,
    the stderr tail and `AgentProcess.teardown_report`.
    """
    spawn_cwd = None if cwd is None else os.fspath(cwd)
    command = check_command(argv, env, spawn_cwd)
    if stderr_tail_bytes < 0:
        raise ValueError("stderr_tail_bytes must not be negative")
    spawn_env = _spawn_environment(env, inherit_env=inherit_env)
    _check_executable(command, spawn_env, spawn_cwd)
    # A caller that is already cancelled gets no child at all.
    await anyio.lowlevel.checkpoint_if_cancelled()
    process, status = await _spawn(
        command, spawn_env, spawn_cwd, supervise=supervise and supervision_available()
    )
    # No await from here to the try block, so no cancellation can arrive before teardown is guaranteed.
    agent = AgentProcess(
        process,
        command,
        status=status,
        stderr_tail_bytes=stderr_tail_bytes,
        on_stderr_line=on_stderr_line,
        stdin_close_timeout=stdin_close_timeout,
        sigterm_timeout=sigterm_timeout,
        sigkill_timeout=sigkill_timeout,
        stderr_settle_timeout=stderr_settle_timeout,
    )
    logger.debug(
        "spawned agent `%s` as pid %d (supervisor: %s)", shlex.join(command), agent.pid, agent.supervisor_pid
    )
    try:
        # Teardown runs while stderr is still drained; only then is the drain stopped.
        async with own_channel(agent, agent._start_background_tasks, agent._stop_stderr_drain):
            yield agent
    finally:
        agent._close_status()


class LocalTransport(BaseTransport[Channel]):
    """A child process of ours, supervised, torn down with its whole tree: the default transport.

    ``process_options`` are the keyword options of `subagent.acp.transports.open_agent_process` (teardown
    timings, ``inherit_env``, ``stderr_tail_bytes``, ``supervise``...); they are checked when a
    channel is opened, as ``open_agent_process`` checks them.
    """

    name = "local"
    local_files = True

    def __init__(self, **process_options: Any) -> None:
        for reserved in ("argv", "env", "cwd", "on_stderr_line"):
            if reserved in process_options:
                raise TypeError(f"{reserved!r} is given to LocalTransport.open, not to LocalTransport")
        self.process_options: Mapping[str, Any] = dict(process_options)
        """The options given to every `open_agent_process` call."""

    def __repr__(self) -> str:
        options = ", ".join(f"{key}={value!r}" for key, value in self.process_options.items())
        return f"LocalTransport({options})"

    @property
    def stdin_close_timeout(self) -> float:
        """The ``stdin_close_timeout`` process option (`STDIN_CLOSE_TIMEOUT` by default)."""
        return float(self.process_options.get("stdin_close_timeout", STDIN_CLOSE_TIMEOUT))

    @contextlib.asynccontextmanager
    async def launch(self, launch: Launch) -> AsyncIterator[Channel]:
        """`open_agent_process` with this transport's options; the channel is its `AgentProcess`."""
        async with open_agent_process(
            launch.argv,
            env=launch.env,
            cwd=launch.cwd,
            on_stderr_line=launch.on_stderr_line,
            **self.process_options,
        ) as process:
            yield process
