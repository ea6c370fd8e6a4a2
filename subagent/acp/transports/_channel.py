"""The channel protocol: what every transport opens, and the types every channel answers with.

The ACP client never spawns anything itself: `subagent.acp.client.spawn_agent` asks a `Transport` to
open a `Channel` (the agent's stdin and stdout as anyio byte streams, plus how it ended and what it
last wrote to stderr) and speaks JSON-RPC over the channel's streams. The transport owns the child
until its ``open`` block exits, and tears it down then, on every exit path. A channel ends with an
`ExitInfo` (its exit status and stderr, as one diagnosis) and its teardown with a `TeardownReport`.

Every transport's ``open`` first applies `check_command` to ``argv``, ``env`` and ``cwd``, so a command
is refused the same way wherever it would run: `BaseTransport` does it once for the transports of
this package, which implement its ``launch``.

Files and terminals
    The client serves the agent's ``fs/*`` and ``terminal/*`` requests on *this* host. A transport whose
    `Transport.local_files` is False runs the child where our paths mean nothing, so the client then
    offers the agent neither: it reads and writes files itself, where it runs.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import os
import shlex
import signal
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

import anyio
import anyio.abc
import anyio.lowlevel

from subagent.acp._errors import AgentSpawnError

__all__ = [
    "UNKNOWN_RETURNCODE",
    "BaseTransport",
    "Channel",
    "ExitInfo",
    "Launch",
    "StderrTail",
    "TeardownReport",
    "TeardownStep",
    "Transport",
    "check_command",
    "own_channel",
]

UNKNOWN_RETURNCODE = 255
"""The returncode of an agent whose exit status never reached us: its supervisor died before reporting
it, or the connection to it was lost (asyncio's choice for a child whose status was lost);
ExitInfo.status_known is False then."""
_STDERR_LINE_LIMIT = 8 * 1024
"""Longer stderr lines are forwarded to on_stderr_line in pieces, so a newline-free flood stays bounded."""
_DIAGNOSIS_STDERR_CHARS = 600
"""How much of the stderr tail ExitInfo.__str__ quotes; the full tail stays on ExitInfo.stderr_tail."""


class TeardownStep(enum.Enum):
    """One step of the teardown sequence, in the order they are taken."""

    CLOSE_STDIN = "close stdin"
    SIGTERM = "SIGTERM to the process group"
    SIGKILL = "SIGKILL to the process group"


@dataclass(frozen=True, slots=True)
class TeardownReport:
    """What teardown had to do.

    ``steps`` always starts with `TeardownStep.CLOSE_STDIN`; a later step was taken only because the process
    group was still alive when the previous step's timeout ran out.
    """

    steps: tuple[TeardownStep, ...]
    """The steps taken, in order."""
    exited_before_teardown: bool
    """The child had already exited (crashed, or finished) when teardown began."""
    group_gone: bool
    """The child was reaped and no live process remained in its group. False only if even SIGKILL did not
    clear it in time, or the group could not be signalled (EPERM)."""

    @property
    def ended_by(self) -> TeardownStep:
        """The last step taken: the one the process group finally yielded to (if ``group_gone``)."""
        return self.steps[-1]

    @property
    def graceful(self) -> bool:
        """The group was gone after closing stdin, without any signal."""
        return self.group_gone and self.steps == (TeardownStep.CLOSE_STDIN,)


@dataclass(frozen=True, slots=True)
class ExitInfo:
    """How a child agent ended, for any error reporting its death; ``str()`` is a one-paragraph diagnosis."""

    command: tuple[str, ...]
    """The argv the agent was started with."""
    pid: int | None
    """The agent's pid (on the host it ran on); None if a remote transport lost it before learning it."""
    returncode: int
    """The exit status; negative means killed by signal ``-returncode`` (the subprocess convention)."""
    stderr_tail: str
    """The last bytes of stderr (at most the configured tail size), decoded as UTF-8 with replacement."""
    stderr_bytes_total: int
    """How many bytes the agent wrote to stderr in all."""
    teardown_signal: signal.Signals | None = None
    """The last signal teardown sent to the group while this child was still alive, if any."""
    status_known: bool = True
    """False if the exit status never reached us (the agent's supervisor died before reporting it, or
    the connection to a remote agent was lost): ``returncode`` is then `UNKNOWN_RETURNCODE`, a
    placeholder, and `via` says why."""
    via: str | None = None
    """How the agent was reached, when that needs saying: a remote transport's route (``"via ssh to
    build-1"``, plus ``", connection lost: ..."`` when that is why the status is unknown), or a local
    supervisor that died before reporting the exit (`SUPERVISOR_DIED`); None for a local child whose
    status is known."""

    @classmethod
    def lost(
        cls, command: tuple[str, ...], pid: int | None, stderr_tail: str, stderr_bytes_total: int, via: str
    ) -> ExitInfo:
        """The end of an agent elsewhere whose route here was lost before its status arrived: an unknown
        status, ``via`` saying where it ran and why (``"via ssh to build-1, connection lost: ..."``)."""
        return cls(
            command, pid, UNKNOWN_RETURNCODE, stderr_tail, stderr_bytes_total, status_known=False, via=via
        )

    @property
    def killed_by(self) -> signal.Signals | None:
        """The signal that killed the child; None if it exited (or the number is unknown here)."""
        if self.returncode >= 0 or not self.status_known:
            return None
        try:
            return signal.Signals(-self.returncode)
        except ValueError:
            return None

    @property
    def status(self) -> str:
        """The exit status in words: ``"exited with status 3"``, ``"was killed by SIGSEGV (signal 11)"``,
        or ``"ended with an unknown status"`` (`via` says why)."""
        if not self.status_known:
            return "ended with an unknown status"
        if self.returncode >= 0:
            return f"exited with status {self.returncode}"
        killer = self.killed_by
        name = killer.name if killer is not None else "an unknown signal"
        return f"was killed by {name} (signal {-self.returncode})"

    def __str__(self) -> str:
        where = "pid unknown" if self.pid is None else f"pid {self.pid}"
        if self.via:
            where += f" {self.via}"
        text = f"agent `{shlex.join(self.command)}` ({where}) {self.status}"
        if self.teardown_signal is not None:
            if self.killed_by is self.teardown_signal:
                text += ", sent by teardown"
            else:
                text += f" after teardown sent {self.teardown_signal.name}"
        return f"{text}; {self._stderr_excerpt()}"

    def _stderr_excerpt(self) -> str:
        lines = [line.strip() for line in self.stderr_tail.splitlines() if line.strip()]
        if not lines:
            return "stderr was empty" if self.stderr_bytes_total == 0 else "stderr held only blank lines"
        excerpt = " | ".join(lines)
        if len(excerpt) > _DIAGNOSIS_STDERR_CHARS:
            excerpt = "…" + excerpt[-_DIAGNOSIS_STDERR_CHARS:]
        return f"last stderr: {excerpt}"


class StderrTail:
    """What a channel keeps of an agent's stderr: its last ``limit`` bytes, how many bytes came in all, and
    each line handed to ``on_line`` (decoded, without its newline; a longer line in 8 KiB pieces) as it
    completes. Memory stays bounded whatever the agent writes."""

    def __init__(self, limit: int, on_line: Callable[[str], object] | None) -> None:
        self._limit = limit
        self._on_line = on_line
        self._tail = bytearray()
        self._partial_line = b""
        self.bytes_total = 0
        """How many bytes the agent has written to stderr so far."""

    def absorb(self, chunk: bytes) -> None:
        """Take in the next bytes the agent wrote."""
        self.bytes_total += len(chunk)
        self._tail += chunk
        excess = len(self._tail) - self._limit
        if excess > 0:
            del self._tail[:excess]
        if self._on_line is not None:
            *lines, partial = (self._partial_line + chunk).split(b"\n")
            for line in lines:
                self._forward(line)
            while len(partial) > _STDERR_LINE_LIMIT:
                self._forward(partial[:_STDERR_LINE_LIMIT])
                partial = partial[_STDERR_LINE_LIMIT:]
            self._partial_line = partial

    def finish(self) -> None:
        """stderr ended: hand on the last line, even without its newline."""
        if self._partial_line:
            self._forward(self._partial_line)
            self._partial_line = b""

    def raw(self) -> bytes:
        """The tail exactly as written."""
        return bytes(self._tail)

    def text(self) -> str:
        """The tail decoded as UTF-8 with replacement, minus a character cut in half by the trim."""
        tail = bytes(self._tail)
        if self.bytes_total > len(tail):
            # The tail was trimmed at an arbitrary byte: skip UTF-8 continuation bytes of a clipped character.
            skip = 0
            while skip < min(3, len(tail)) and 0x80 <= tail[skip] <= 0xBF:
                skip += 1
            tail = tail[skip:]
        return tail.decode("utf-8", errors="replace")

    def _forward(self, line: bytes) -> None:
        if self._on_line is not None:
            self._on_line(line.rstrip(b"\r").decode("utf-8", errors="replace"))


@runtime_checkable
class Channel(Protocol):
    """A running child agent as the ACP client sees it, wherever it runs.

    `subagent.acp.transports.AgentProcess` is the local one. A channel is only valid inside the ``open``
    block of the transport that opened it; after the block it still answers `exit_info` and
    `stderr_tail`.
    """

    @property
    def stdin(self) -> anyio.abc.ByteSendStream:
        """The agent's stdin (the client writes JSON-RPC lines to it); closing it is the agent's cue
        to finish."""
        ...

    @property
    def stdout(self) -> anyio.abc.ByteReceiveStream:
        """The agent's stdout (the client reads JSON-RPC lines from it); ends with `anyio.EndOfStream`."""
        ...

    @property
    def command(self) -> tuple[str, ...]:
        """The argv the agent was started with (as the transport was given it, not a wrapper's)."""
        ...

    @property
    def pid(self) -> int | None:
        """The pid of the local process we spawned for this agent (the agent itself locally, the
        ``ssh`` client over SSH), or None if there is none on this host."""
        ...

    def describe(self) -> str:
        """Where the agent runs, for messages: ``"pid 123"``, ``"pid 456 via ssh to build-1"``."""
        ...

    def exit_info(self) -> ExitInfo | None:
        """How the agent ended, or None while it runs (or while its end is not known here yet)."""
        ...

    async def wait_exit(self) -> ExitInfo:
        """Wait until the agent itself exits (not its descendants), let stderr settle (bounded), and
        describe the exit; a lost connection to a remote agent is an exit too."""
        ...

    def stderr_tail(self) -> str:
        """The last of the agent's stderr received so far, decoded as UTF-8 with replacement."""
        ...

    def kill(self) -> None:
        """Kill the agent's whole tree now, without waiting: synchronous, idempotent, never raises.
        ``aclose`` still reaps and closes."""
        ...

    async def aclose(self, *, stdin_close_timeout: float | None = None) -> TeardownReport:
        """Tear the agent's tree down (close stdin, wait, SIGTERM, wait, SIGKILL) and close the
        streams; idempotent, shielded from cancellation, bounded in time. ``stdin_close_timeout``
        overrides the grace after stdin closes, for this teardown."""
        ...


@runtime_checkable
class Transport(Protocol):
    """Opens channels to child agents: a place where they run, and how they get there."""

    @property
    def name(self) -> str:
        """What to call it in messages and listings: ``"local"``, ``"ssh://build-1"``."""
        ...

    @property
    def local_files(self) -> bool:
        """Whether the child sees this host's files, so the client may serve its ``fs/*`` and
        ``terminal/*`` requests here. False: the agent is offered neither."""
        ...

    @property
    def stdin_close_timeout(self) -> float:
        """The grace teardown gives the agent after its stdin closes (its channel's ``aclose``
        default); an idle agent is given at most this."""
        ...

    def open(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        on_stderr_line: Callable[[str], object] | None = None,
    ) -> AbstractAsyncContextManager[Channel]:
        """Start ``argv`` and own it until the block exits; then tear its whole tree down.

        Args:
            argv: The program and its arguments, as the host it runs on resolves them. No shell.
            env: Variables for the child, over the environment it would get there anyway (locally:
                this process's).
            cwd: The child's working directory, a path on the host it runs on.
            on_stderr_line: Called with each stderr line (decoded, without its newline) as it arrives;
                it must not block or raise.

        Raises:
            TypeError: ``argv`` is a single string (`check_command`).
            ValueError: ``argv`` is empty (`check_command`).
            AgentSpawnError: The agent could not be started (``__aenter__``), or `check_command`
                refused an argument, ``cwd`` or ``env`` entry; the reason never quotes an environment
                value.

        An exception from the block propagates unchanged after teardown.
        """
        ...


@dataclass(frozen=True, slots=True)
class Launch:
    """What `Transport.open` was asked to start, once `check_command` accepted it."""

    argv: tuple[str, ...]
    """The program and its arguments, as strings."""
    env: Mapping[str, str] | None
    cwd: str | None
    on_stderr_line: Callable[[str], object] | None


def _exec_cannot_carry(text: str) -> str | None:
    """Why exec cannot pass ``text`` on (it becomes a C string in the file system encoding), or None."""
    if "\0" in text:
        return "contains a NUL character"
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        return "cannot be encoded (it holds a lone surrogate)"
    return None


def check_command(
    argv: Sequence[str | os.PathLike[str]], env: Mapping[str, str] | None, cwd: str | None
) -> tuple[str, ...]:
    """``argv`` as a tuple of strings, once it is known that exec can carry it, ``env`` and ``cwd``:
    the check every transport applies before it starts anything (`subagent.acp.transports._channel`).

    Raises:
        TypeError: ``argv`` is a single string (no shell is used, so it would not be split).
        ValueError: ``argv`` is empty.
        AgentSpawnError: A NUL or an unencodable character anywhere, or a variable name that is
            empty or holds ``=``. The reason names the argument or the variable, never a value
            (values may be secrets), so subprocess never gets to raise ValueError.
    """
    if isinstance(argv, (str, bytes)):
        raise TypeError("argv must be a sequence of arguments, not a string: no shell is used")
    command = tuple(os.fspath(arg) for arg in argv)
    if not command:
        raise ValueError("argv must name a program")
    for index, arg in enumerate(command):
        if problem := _exec_cannot_carry(arg):
            what = "the program name" if index == 0 else f"argument {index}"
            raise AgentSpawnError(command, f"{what} {problem}")
    if cwd is not None and (problem := _exec_cannot_carry(cwd)):
        raise AgentSpawnError(command, f"the working directory {problem}")
    for name, value in (env or {}).items():
        if not name:
            raise AgentSpawnError(command, "an environment variable name is empty")
        if problem := _exec_cannot_carry(name):
            raise AgentSpawnError(command, f"an environment variable name {problem}")
        if "=" in name:
            shown = name[: name.index("=") + 1]
            raise AgentSpawnError(command, f"environment variable name {shown + '…'!r} contains '='")
        if problem := _exec_cannot_carry(value):
            raise AgentSpawnError(command, f"the value of environment variable {name!r} {problem}")
    return command


ChannelT = TypeVar("ChannelT", bound=Channel, covariant=True)
"""The kind of channel a `BaseTransport` opens."""


class BaseTransport(abc.ABC, Generic[ChannelT]):
    """The part of every transport that is the same: `open` applies `check_command` and hands the checked
    command to `launch`, which a transport implements (with `Transport`'s ``name``, ``local_files`` and
    ``stdin_close_timeout``). Subclassing it is optional: any object with `Transport`'s members is one."""

    def open(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        on_stderr_line: Callable[[str], object] | None = None,
    ) -> AbstractAsyncContextManager[ChannelT]:
        """`Transport.open`: `check_command` (raising at once), then `launch`."""
        argv = check_command(argv, env, cwd)
        return self.launch(Launch(argv, None if env is None else dict(env), cwd, on_stderr_line))

    @abc.abstractmethod
    def launch(self, launch: Launch) -> AbstractAsyncContextManager[ChannelT]:
        """Start a checked command and own it until the block exits (`Transport.open` says the rest)."""


OwnedT = TypeVar("OwnedT", bound=Channel)


@contextlib.asynccontextmanager
async def own_channel(
    channel: OwnedT, start: Callable[[anyio.abc.TaskGroup], object], stop: Callable[[], object]
) -> AsyncIterator[OwnedT]:
    """The body of a ``launch``: yield ``channel`` with its background tasks running (``start`` starts
    them in a task group), and tear it down on every exit path, ``channel.aclose()`` while the tasks
    still run (they drain what teardown waits for: stderr, the relays), then ``stop`` them.

    An exception from the block propagates unchanged (not wrapped in an exception group) after teardown.
    Leaving the block is a cancellation point: a cancellation that arrives during the (shielded) teardown
    is delivered once it completes, on every backend.
    """
    body_error: BaseException | None = None
    try:
        async with anyio.create_task_group() as task_group:
            start(task_group)
            try:
                yield channel
            except BaseException as exc:
                # Re-raised below, after the task group has exited, so callers see their own exception
                # rather than an exception group wrapping it.
                body_error = exc
            finally:
                try:
                    await channel.aclose()
                finally:
                    stop()
                    task_group.cancel_scope.cancel()
    finally:
        # A no-op after the teardown above; it matters only if the task group itself failed to start.
        await channel.aclose()
    if body_error is not None:
        raise body_error
    await anyio.lowlevel.checkpoint_if_cancelled()
