"""Serve an agent's ``terminal/*`` requests: run the commands it asks for as processes we own completely.

One `TerminalHost` serves one agent connection. It is off unless the client is given one, and then it
answers ``terminal/create``, ``terminal/output``, ``terminal/wait_for_exit``, ``terminal/kill`` and
``terminal/release`` (`TerminalHost.serve` dispatches the raw params, or call the typed methods).

Spawning
    ``command`` + ``args`` run with no shell, through `~subagent.acp.transports.open_agent_process`: a new
    session and process group per command, so kill, release and close reach grandchildren too. The
    environment is the host's base environment (by default this process's, read at each create) with the
    request's ``env`` entries merged over it. ``cwd`` must be absolute; with a sandbox it must lie inside its
    roots (symlinks resolved); without one it defaults to the host's ``cwd`` (the first root when a sandbox
    is given, else this process's working directory). Confining the cwd is hygiene, not a security boundary:
    the command runs with our privileges and may ``cd`` anywhere. stdin is closed at once, so a command that
    reads input sees end of file instead of hanging on a terminal nobody types into.

One output stream
    A terminal shows stdout and stderr interleaved in the order they were written. That needs both to be
    the same pipe, but ``open_agent_process`` gives each its own. So the command is started through a tiny
    exec trampoline (``python -I -S -c``) that points fd 2 at fd 1, restores the signal dispositions Python
    changed at start-up (SIGPIPE, SIGXFSZ), and ``execvp``\\s the command: the command keeps the pid,
    process group and pipes, and stderr reaches us on stdout. No shell parses anything, and the trampoline
    costs one interpreter start-up (about 10 ms). process.py's own stderr pipe then sees EOF at once. If
    exec fails after our checks passed (a race, or an unsupported binary), the trampoline writes the
    reason to the output and exits 127 (not found) or 126, as a shell would.

Output buffer
    Bytes are decoded incrementally as UTF-8 (invalid bytes become U+FFFD; a character split across reads
    waits for its remaining bytes), so the buffer always holds valid UTF-8 and ``output`` is never cut
    inside a character. When it grows past ``outputByteLimit`` (default `DEFAULT_OUTPUT_BYTE_LIMIT`,
    clamped to the host's maximum) whole characters are dropped from the start and ``truncated`` stays
    true: the retained text encodes to at most the limit.

Exit, kill, release, close
    A terminal's exit status is published once the command itself has exited and its output has reached
    end of file, or `OUTPUT_SETTLE_TIMEOUT` later if a background job still holds the pipe; so after
    ``wait_for_exit`` returns, ``output`` holds everything the command wrote. ``kill`` sends SIGTERM to the
    whole process group, waits up to ``kill_grace`` for the command to exit and its output to end,
    SIGKILLs the group if not, and then hands the process to process.py's teardown, which reaps it,
    clears any group member left (with its own bounded SIGTERM/SIGKILL) and closes every pipe. (If the
    command had already exited and its output ended, the signals are skipped and teardown alone checks
    the group.) Our signals come first, and teardown only after the output ended, so teardown's stdout
    drain never takes output away from the terminal's reader. The terminal
    stays valid: its output and exit status remain readable until it is released. ``release`` forgets the
    id at once and kills as ``kill`` does. The kill sequence runs in the terminal's own task, shielded and
    bounded, so a caller that gives up waiting (``$/cancel_request``) never leaves it half done.

Ownership
    Each terminal's process lives in a task of the host's task group (entered by ``async with``), inside
    an ``open_agent_process`` block: whatever happens, leaving that block tears the group down. `aclose`
    kills every terminal and waits for all of them, shielded from cancellation and bounded.

Errors (JSON-RPC codes; ``data`` carries ``reason`` and the offending value)
    * -32602 invalid params: an unknown or already released ``terminalId`` (ids are ours to hand out, so
      only a confused agent sends one; a terminal of another session counts as unknown), a relative cwd or
      one outside the roots, a cwd or program that exists but is not a directory / not executable, a
      negative ``outputByteLimit``, a NUL character or a malformed environment variable name, and a
      command line exec would refuse as too long (one argument or environment entry over Linux's 128 KiB,
      or all of them over ``ARG_MAX``). Values the agent sent are echoed clipped to a few hundred
      characters, in replies and in log lines alike.
    * -32002 resource not found: the program (not on ``PATH``, or no such file) or the cwd does not
      exist; the same code ``fs/read_text_file`` uses for a missing file.
    * -32603 internal error: the live-terminal cap (`DEFAULT_MAX_TERMINALS`) is reached (message "Too many
      open terminals"; a released terminal counts until its kill has finished, so releasing and cancelling
      the release cannot outrun the kills), the host is closed, or the spawn failed for a reason we did not
      foresee (`~subagent.acp.AgentSpawnError`: its reason is in ``data``).
"""

from __future__ import annotations

import codecs
import collections
import itertools
import logging
import os
import secrets
import shlex
import shutil
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec

from subagent.acp import schema
from subagent.acp._errors import AgentSpawnError, RequestError, RpcErrorCode
from subagent.acp.handlers import FsSandbox, _clip
from subagent.acp.transports._local import AgentProcess, open_agent_process

__all__ = [
    "DEFAULT_KILL_GRACE",
    "DEFAULT_MAX_TERMINALS",
    "DEFAULT_OUTPUT_BYTE_LIMIT",
    "KILL_REAP_TIMEOUT",
    "MAX_OUTPUT_BYTE_LIMIT",
    "OUTPUT_SETTLE_TIMEOUT",
    "TerminalHost",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_TERMINALS = 16
"""How many terminals one agent may hold at once: enough for a build, a test suite and a dev server side by
side; it bounds the processes, pipes and buffers one agent can hold (an unreleased terminal counts, finished
or not)."""
DEFAULT_OUTPUT_BYTE_LIMIT = 1024 * 1024
"""How much of a terminal's output is kept when the agent sets no limit: a long build log's tail; sixteen
terminals at this size cost 16 MiB."""
MAX_OUTPUT_BYTE_LIMIT = 8 * 1024 * 1024
"""The largest output limit granted; a larger ``outputByteLimit`` from the agent is clamped to it.
``terminal/output`` answers in one JSON line: even escaped six-fold (``\\u00XX``) this stays below the
connection's 64 MiB line limit."""
DEFAULT_KILL_GRACE = 2.0
"""Time for the command's SIGTERM handler (and its children's) to clean up before the group is SIGKILLed."""
KILL_REAP_TIMEOUT = 2.0
"""How long to wait for the reap after SIGKILL. SIGKILL cannot be caught: this only bounds the kernel's
reap; a safety net, not a grace period."""
OUTPUT_SETTLE_TIMEOUT = 0.5
"""After the command exits, wait this long for output EOF so its last words are captured; only a background
job still holding the pipe makes the wait run out."""

_READ_SIZE = 64 * 1024
"""One pipe buffer's worth per read."""
_TRAMPOLINE_STDERR_TAIL = 4096
"""The trampoline's own stderr pipe only ever carries a failure of the interpreter itself."""
_EXIT_NOT_FOUND = 127
"""The exit status a POSIX shell uses for "command not found"."""
_EXIT_CANNOT_EXECUTE = 126
"""The exit status a POSIX shell uses for "found but cannot execute"."""
_TRAMPOLINE = f"""\
import os, signal, sys
for name in ("SIGPIPE", "SIGXFSZ"):
    if hasattr(signal, name):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
os.dup2(1, 2)
try:
    os.execvp(sys.argv[1], sys.argv[1:])
except OSError as exc:
    os.write(2, f"cannot run {{sys.argv[1]!r}}: {{exc.strerror or exc}}\\n".encode(errors="replace"))
    os._exit({_EXIT_NOT_FOUND} if isinstance(exc, FileNotFoundError) else {_EXIT_CANNOT_EXECUTE})
"""
"""The program a terminal's command is started through, with ``sys.argv`` ``["-c", command, *args]``.
Python ignores SIGPIPE and SIGXFSZ at start-up and exec keeps ignored signals ignored, so they are reset
first (as subprocess's restore_signals does)."""
_TRAMPOLINE_ARGV = (sys.executable, "-I", "-S", "-c", _TRAMPOLINE)
_MAX_ARG_STRLEN = 32 * 4096
"""Linux's cap on one argv or environment string, NUL included (32 pages); longer ones fail exec with
E2BIG."""
_DEFAULT_ARG_MAX = 4096
"""POSIX's minimum ARG_MAX, for a platform whose sysconf does not say."""
_POINTER_SIZE = 8
_PIECE_BYTES = 64 * 1024
"""The retained output is kept in pieces of about this size (see _OutputTail)."""
_CONTINUATION_MASK = 0xC0
_CONTINUATION_BITS = 0x80
"""A UTF-8 continuation byte is one whose bits under `_CONTINUATION_MASK` are these: 0b10xxxxxx."""


def _echo(data: dict[str, Any]) -> dict[str, Any]:
    # What the agent sent comes back clipped: a refused 60 MiB argument must not be answered in full.
    return {key: _clip(value) if isinstance(value, str) else value for key, value in data.items()}


def _refused(reason: str, **data: Any) -> RequestError:
    return RequestError.invalid_params({**_echo(data), "reason": reason})


def _not_found(message: str, reason: str, **data: Any) -> RequestError:
    return RequestError(RpcErrorCode.RESOURCE_NOT_FOUND, _clip(message), {**_echo(data), "reason": reason})


def _unknown_terminal(terminal_id: str) -> RequestError:
    return _refused(
        "no such terminal: it was never created here, or it was already released",
        terminalId=terminal_id,
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _check_environment(env: Mapping[str, str], what: str) -> None:
    """Refuse an environment exec cannot carry (our own configuration: a ValueError, not a reply)."""
    for name, value in env.items():
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise ValueError(f"{what}: the variable {name!r} has an empty name, '=' in its name, or a NUL")


def _check_exec_size(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Refuse a command line exec would reject with E2BIG, naming the limit the agent went over."""
    strings = [*argv, *(f"{name}={value}" for name, value in env.items())]
    sizes = [len(os.fsencode(string)) + 1 for string in strings]  # each is NUL-terminated
    if sys.platform.startswith("linux"):
        longest = max(sizes)
        if longest > _MAX_ARG_STRLEN:
            raise _refused(
                f"one argument or environment entry is {longest - 1} bytes long; "
                f"the system allows {_MAX_ARG_STRLEN - 1}"
            )
    # The kernel counts the strings and the pointers to them.
    total = sum(sizes) + _POINTER_SIZE * (len(sizes) + 2)
    limit = _arg_max()
    if total > limit:
        raise _refused(
            f"the command, its arguments and the environment take {total} bytes; the system allows {limit}"
        )


def _arg_max() -> int:
    try:
        limit = os.sysconf("SC_ARG_MAX")
    except (OSError, ValueError):
        limit = -1
    return limit if limit > 0 else _DEFAULT_ARG_MAX


def _check_text(value: str, what: str) -> None:
    """Refuse a value exec cannot carry: a NUL byte, or a string with no file-system encoding."""
    if "\0" in value:
        raise _refused(f"the {what} contains a NUL character", value=value)
    try:
        os.fsencode(value)
    except UnicodeError as exc:
        raise _refused(f"the {what} cannot be encoded for the operating system", value=value) from exc


@dataclass(frozen=True, slots=True)
class _Spawn:
    """A validated terminal/create request, ready to run."""

    session_id: str
    command: tuple[str, ...]
    """The command and its arguments, as the agent gave them."""
    env: dict[str, str]
    inherit_env: bool
    cwd: str
    byte_limit: int

    @property
    def argv(self) -> tuple[str, ...]:
        """What is actually executed: the command behind the stderr-merging trampoline."""
        return (*_TRAMPOLINE_ARGV, *self.command)


def _character_start(data: bytes | bytearray, cut: int) -> int:
    """The first offset at or after ``cut`` where a character of the valid UTF-8 ``data`` begins."""
    while cut < len(data) and data[cut] & _CONTINUATION_MASK == _CONTINUATION_BITS:
        cut += 1
    return cut


class _OutputTail:
    """The last ``limit`` bytes of a stream of UTF-8 text, cut only between characters.

    Held as sealed pieces of about `_PIECE_BYTES` plus a growing tail, so memory stays within the limit
    plus a piece or two: trimming drops whole pieces from the front and re-cuts only the first, where a
    single buffer shifted at its front would be reallocated (briefly twice its size) as it grows.
    """

    def __init__(self, limit: int, piece_bytes: int = _PIECE_BYTES) -> None:
        self.limit = limit
        self.truncated = False
        self._piece_bytes = piece_bytes
        self._pieces: collections.deque[tuple[str, int]] = collections.deque()
        """Sealed pieces: their text and its length in UTF-8 bytes."""
        self._tail = bytearray()
        self._size = 0
        """UTF-8 bytes retained: the pieces' and the tail's."""

    def append(self, data: bytes) -> None:
        """Add ``data``, which holds whole characters, and drop what no longer fits."""
        self._tail += data
        self._size += len(data)
        if len(self._tail) >= self._piece_bytes:
            self._pieces.append((self._tail.decode("utf-8"), len(self._tail)))
            self._tail = bytearray()
        excess = self._size - self.limit
        if excess <= 0:
            return
        self.truncated = True
        while self._pieces and self._pieces[0][1] <= excess:
            dropped = self._pieces.popleft()[1]
            excess -= dropped
            self._size -= dropped
        if excess <= 0:
            return
        if self._pieces:
            first = self._pieces[0][0].encode("utf-8")
            cut = _character_start(first, excess)
            self._pieces[0] = (first[cut:].decode("utf-8"), len(first) - cut)
        else:
            cut = _character_start(self._tail, excess)
            del self._tail[:cut]
        self._size -= cut

    def text(self) -> str:
        """The retained text."""
        return "".join([*(text for text, _ in self._pieces), self._tail.decode("utf-8")])


class _Terminal:
    """One command the agent started: its process, its output buffer and its exit status."""

    def __init__(self, terminal_id: str, spawn: _Spawn, process: AgentProcess) -> None:
        self.id = terminal_id
        self.session_id = spawn.session_id
        self.command = spawn.command
        self.process = process
        self.byte_limit = spawn.byte_limit
        self.exit_status: schema.TerminalExitStatus | None = None
        self.exited = anyio.Event()
        """The command itself exited (its descendants may live on)."""
        self.output_ended = anyio.Event()
        """The output pipe reached end of file, or was closed by teardown."""
        self.finished = anyio.Event()
        """`exit_status` is set."""
        self.kill_requested = anyio.Event()
        self.stopped = anyio.Event()
        """The kill sequence ran: the group is gone, the process reaped, the pipes closed."""
        self.changed = anyio.Event()
        """Set (and replaced by a fresh event) whenever the output grows or ends."""
        self._retained = _OutputTail(spawn.byte_limit)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __repr__(self) -> str:
        return f"<terminal {self.id} pid={self.process.pid} command={_clip(shlex.join(self.command))!r}>"

    @property
    def output(self) -> str:
        """The retained output (always whole characters)."""
        return self._retained.text()

    @property
    def truncated(self) -> bool:
        """Whether output was dropped from the start to stay within the byte limit."""
        return self._retained.truncated

    def answer(self) -> schema.TerminalOutputResponse:
        """The terminal/output answer as of now."""
        return schema.TerminalOutputResponse(
            output=self.output, truncated=self.truncated, exit_status=self.exit_status
        )

    def _notify_change(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    def _append(self, data: bytes, *, final: bool = False) -> None:
        text = self._decoder.decode(data, final)
        if not text:
            return
        self._retained.append(text.encode("utf-8"))
        self._notify_change()

    async def read_output(self) -> None:
        """Capture the merged stdout/stderr until end of file (or until teardown closes the pipe)."""
        try:
            while True:
                try:
                    chunk = await self.process.stdout.receive(_READ_SIZE)
                except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                    break
                self._append(chunk)
        finally:
            self._append(b"", final=True)
            self.output_ended.set()
            self._notify_change()

    async def watch_exit(self) -> None:
        """Publish the exit status once the command exited and its output ended (or settled)."""
        await self.process.wait_exit()
        self.exited.set()
        with anyio.move_on_after(OUTPUT_SETTLE_TIMEOUT):
            await self.output_ended.wait()
        self.publish_exit()

    def publish_exit(self) -> None:
        """Set the exit status from the process's return code, once; later calls change nothing."""
        if self.finished.is_set():
            return
        returncode = self.process.returncode
        if returncode is None:
            # Only if even SIGKILL did not get the command reaped: the status is unknown.
            logger.error("terminal %s: pid %d could not be reaped", self.id, self.process.pid)
            self.exit_status = schema.TerminalExitStatus()
        elif returncode >= 0:
            self.exit_status = schema.TerminalExitStatus(exit_code=returncode)
        else:
            self.exit_status = schema.TerminalExitStatus(signal=_signal_name(-returncode))
        logger.debug("terminal %s: pid %d ended: %s", self.id, self.process.pid, self.exit_status)
        self.finished.set()

    async def stop(self, grace: float) -> None:
        """The kill sequence (see the module docstring). Bounded; the caller shields it."""
        if not self._done_writing():
            self._signal_group(signal.SIGTERM)
            with anyio.move_on_after(grace):
                await self.exited.wait()
                await self.output_ended.wait()
        if not self._done_writing():
            logger.info("terminal %s: still running %.1fs after SIGTERM; sending SIGKILL", self.id, grace)
            self._signal_group(signal.SIGKILL)
            with anyio.move_on_after(KILL_REAP_TIMEOUT):
                await self.exited.wait()
            with anyio.move_on_after(OUTPUT_SETTLE_TIMEOUT):
                await self.output_ended.wait()
        # Reaps, clears whatever is left in the group (members that never held our pipe, with its own
        # bounded SIGTERM/SIGKILL), and closes the pipes. Called only now, so its stdout drain competes with
        # our reader for nothing the command wrote.
        await self.process.aclose()
        self.publish_exit()

    def _done_writing(self) -> bool:
        # The command exited and nothing holds the output pipe any more: nothing left for us to signal.
        # (A finished command's group is not signalled blindly: its id may have been reused by now.)
        return self.exited.is_set() and self.output_ended.is_set()

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.process.pgid, sig)
        except ProcessLookupError:
            pass  # ESRCH: the whole group is already gone.
        except PermissionError:
            logger.warning(
                "terminal %s: cannot send %s to process group %d: permission denied",
                self.id,
                sig.name,
                self.process.pgid,
            )


class TerminalHost:
    """The client side of ``terminal/*`` for one agent connection; owns every process it starts.

    Use as ``async with TerminalHost(...) as host:`` around the connection that serves the agent, and
    route every ``terminal/*`` request to `serve` (or to the typed methods). Leaving the block (or
    `aclose`) kills and reaps every terminal.

    Args:
        sandbox: confine each terminal's cwd to these roots; None allows any absolute cwd.
        cwd: the cwd of a terminal created without one (e.g. the session's cwd). Default: the sandbox's first
            root, else this process's working directory at construction. Must lie inside the sandbox.
        env: the environment commands start from, before the request's entries are merged over it.
            Default: this process's environment, read at each create.
        max_terminals: how many terminals may exist at once: unreleased ones (finished or not) and
            released ones whose kill is still under way; one more is refused (-32603).
        default_output_byte_limit: the output retained when the request gives no ``outputByteLimit``.
        max_output_byte_limit: a larger ``outputByteLimit`` is clamped to this.
        kill_grace: seconds between SIGTERM and SIGKILL when a terminal is killed, released or closed.
    """

    def __init__(
        self,
        *,
        sandbox: FsSandbox | None = None,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        max_terminals: int = DEFAULT_MAX_TERMINALS,
        default_output_byte_limit: int = DEFAULT_OUTPUT_BYTE_LIMIT,
        max_output_byte_limit: int = MAX_OUTPUT_BYTE_LIMIT,
        kill_grace: float = DEFAULT_KILL_GRACE,
    ) -> None:
        if max_terminals < 1:
            raise ValueError(f"max_terminals must be at least 1, not {max_terminals}")
        if not 0 <= default_output_byte_limit <= max_output_byte_limit:
            raise ValueError("need 0 <= default_output_byte_limit <= max_output_byte_limit")
        if kill_grace < 0:
            raise ValueError(f"kill_grace must not be negative, not {kill_grace}")
        if env is not None:
            _check_environment(env, "TerminalHost env")
        if cwd is None:
            default_cwd = sandbox.roots[0] if sandbox is not None else Path.cwd()
        else:
            default_cwd = Path(os.path.realpath(cwd))
            if not default_cwd.is_dir():
                raise ValueError(f"the default cwd {os.fspath(cwd)!r} is not an existing directory")
            if sandbox is not None and not sandbox.contains(default_cwd):
                raise ValueError(f"the default cwd {os.fspath(cwd)!r} is outside the sandbox roots")
        self.sandbox = sandbox
        self.cwd = str(default_cwd)
        """Where a terminal created without a cwd runs."""
        self.max_terminals = max_terminals
        self.default_output_byte_limit = default_output_byte_limit
        self.max_output_byte_limit = max_output_byte_limit
        self.kill_grace = kill_grace
        self._env = None if env is None else dict(env)
        self._terminals: dict[str, _Terminal] = {}
        """The terminals the agent may still address, by id."""
        self._owned: set[_Terminal] = set()
        """Every terminal whose task still runs, released or not: what `aclose` must stop."""
        self._live = 0
        """Terminals whose process may exist: starting, running, or released and still being killed.
        What the cap counts, so releasing (and cancelling the release) cannot outrun the kills."""
        self._counter = itertools.count(1)
        self._task_group: anyio.abc.TaskGroup | None = None
        self._entered = False
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._terminals)} open"
        return f"<TerminalHost {state} cwd={self.cwd!r}>"

    @property
    def open_terminals(self) -> int:
        """How many terminals exist and are not yet released (finished ones included)."""
        return len(self._terminals)

    @property
    def closed(self) -> bool:
        """Whether `aclose` has begun: no terminal can be created any more."""
        return self._closed

    async def __aenter__(self) -> Self:
        if self._entered:
            raise RuntimeError("a TerminalHost can be entered only once")
        self._entered = True
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._task_group is not None
        try:
            await self.aclose()
        finally:
            task_group, self._task_group = self._task_group, None
            # Nothing is left running in it: each terminal's task ended with its kill sequence.
            result = await task_group.__aexit__(exc_type, exc, tb)
        return result

    async def aclose(self) -> None:
        """Kill and reap every terminal and refuse new ones; idempotent.

        Shielded from cancellation and bounded: each terminal's kill sequence is bounded, and they run
        concurrently. Afterwards every terminal id is unknown.
        """
        self._closed = True
        self._terminals.clear()
        with anyio.CancelScope(shield=True):
            while self._owned:
                remaining = list(self._owned)
                for terminal in remaining:
                    terminal.kill_requested.set()
                for terminal in remaining:
                    await terminal.stopped.wait()

    # -- dispatch ------------------------------------------------------------------------------------

    async def serve(self, method: str, params: bytes | msgspec.Raw | None) -> msgspec.Struct:
        """Decode ``params`` for ``method`` (one of the five ``terminal/*`` methods) and answer it.

        Raises:
            RequestError: as the method does; -32601 for any other method.
            msgspec.ValidationError: the params do not fit the method (the connection answers -32602).
        """
        data = b"null" if params is None else bytes(memoryview(params))
        if method == schema.TERMINAL_CREATE:
            return await self.create(schema.decode(data, type=schema.CreateTerminalRequest))
        if method == schema.TERMINAL_OUTPUT:
            return await self.output(schema.decode(data, type=schema.TerminalOutputRequest))
        if method == schema.TERMINAL_WAIT_FOR_EXIT:
            return await self.wait_for_exit(schema.decode(data, type=schema.WaitForTerminalExitRequest))
        if method == schema.TERMINAL_KILL:
            return await self.kill(schema.decode(data, type=schema.KillTerminalRequest))
        if method == schema.TERMINAL_RELEASE:
            return await self.release(schema.decode(data, type=schema.ReleaseTerminalRequest))
        raise RequestError.method_not_found(method)

    # -- the five methods ----------------------------------------------------------------------------

    async def create(self, request: schema.CreateTerminalRequest) -> schema.CreateTerminalResponse:
        """Start ``command`` with ``args`` in the background and answer its new terminal id at once.

        Raises:
            RequestError: -32602 for a refused cwd or malformed request, -32002 when the program or cwd
                does not exist, -32603 when the live-terminal cap is reached or the host is closed.
        """
        task_group = self._require_open()
        # A create cancelled before it began starts nothing (the connection then answers -32800).
        await anyio.lowlevel.checkpoint_if_cancelled()
        spawn = self._prepare(request)
        if self._live >= self.max_terminals:
            stopping = self._live - len(self._terminals)
            reason = f"{self.max_terminals} terminals are open; release one first"
            if stopping > 0:
                reason = (
                    f"{self.max_terminals} terminals are open or still being killed after release "
                    f"({stopping} of them); release one, or let the kills finish"
                )
            raise RequestError(
                RpcErrorCode.INTERNAL_ERROR,
                "Too many open terminals",
                {"reason": reason, "limit": self.max_terminals},
            )
        terminal_id = f"term-{next(self._counter)}-{secrets.token_hex(4)}"
        self._live += 1
        try:
            # Shielded (a spawn takes milliseconds), so a started command always gets registered and its id
            # reaches the agent: a cancelled create could otherwise leave a terminal nobody can address.
            with anyio.CancelScope(shield=True):
                terminal: _Terminal = await task_group.start(self._run_terminal, terminal_id, spawn)
        except BaseException as exc:
            self._live -= 1  # nothing started: the terminal's task will not give the slot back
            if not isinstance(exc, AgentSpawnError):
                raise
            # Everything the agent can get wrong was refused above: this is our side failing (no memory,
            # no pids, or a race with the file system), and the reason says which.
            command = _clip(shlex.join(spawn.command))
            logger.warning("terminal/create: cannot start %s: %s", command, exc.reason)
            data = {"command": _clip(request.command), "reason": exc.reason}
            raise RequestError.internal_error(data) from exc
        if self._closed:  # aclose() ran while we were spawning
            terminal.kill_requested.set()
            with anyio.CancelScope(shield=True):
                await terminal.stopped.wait()
            raise self._closed_error()
        self._terminals[terminal_id] = terminal
        logger.info(
            "terminal %s: started `%s` as pid %d in %s",
            terminal_id,
            _clip(shlex.join(spawn.command)),
            terminal.process.pid,
            spawn.cwd,
        )
        return schema.CreateTerminalResponse(terminal_id=terminal_id)

    async def output(self, request: schema.TerminalOutputRequest) -> schema.TerminalOutputResponse:
        """The output so far, whether it was truncated, and the exit status once the command ended.

        Raises:
            RequestError: -32602 for an unknown or released terminal.
        """
        return self._lookup(request.session_id, request.terminal_id).answer()

    async def wait_for_output(
        self, request: schema.TerminalOutputRequest, until: Callable[[str], bool]
    ) -> schema.TerminalOutputResponse:
        """Wait until ``until(output)`` holds, or until the output can grow no more; then answer as `output`.

        Not an ACP method: for a client that shows a terminal's output live (``until=lambda text: text !=
        shown`` waits for the next change) or waits for a command to print something. The output can grow
        no more once the pipe reached end of file or the terminal was killed, released or closed. Cancel
        it freely: the terminal is unaffected.

        Raises:
            RequestError: -32602 for an unknown or released terminal.
        """
        terminal = self._lookup(request.session_id, request.terminal_id)
        while True:
            changed = terminal.changed
            answer = terminal.answer()
            if until(answer.output) or terminal.output_ended.is_set():
                return answer
            await changed.wait()

    async def wait_for_exit(
        self, request: schema.WaitForTerminalExitRequest
    ) -> schema.WaitForTerminalExitResponse:
        """Wait until the command exits (and its output is captured); cancelling the wait leaves it running.

        Raises:
            RequestError: -32602 for an unknown or released terminal.
        """
        terminal = self._lookup(request.session_id, request.terminal_id)
        await terminal.finished.wait()
        status = terminal.exit_status
        assert status is not None
        return schema.WaitForTerminalExitResponse(exit_code=status.exit_code, signal=status.signal)

    async def kill(self, request: schema.KillTerminalRequest) -> schema.KillTerminalResponse:
        """Kill the command's whole process group; the terminal stays valid until released.

        Returns once the command is dead and reaped, so ``output`` then shows its exit status. If this call
        is cancelled the kill still completes in the background.

        Raises:
            RequestError: -32602 for an unknown or released terminal.
        """
        terminal = self._lookup(request.session_id, request.terminal_id)
        terminal.kill_requested.set()
        await terminal.stopped.wait()
        return schema.KillTerminalResponse()

    async def release(self, request: schema.ReleaseTerminalRequest) -> schema.ReleaseTerminalResponse:
        """Kill the command if it still runs and forget the terminal: its id is unknown from now on.

        Raises:
            RequestError: -32602 for an unknown or already released terminal.
        """
        terminal = self._lookup(request.session_id, request.terminal_id)
        del self._terminals[terminal.id]
        terminal.kill_requested.set()
        await terminal.stopped.wait()
        logger.debug("terminal %s: released", terminal.id)
        return schema.ReleaseTerminalResponse()

    # -- internals -----------------------------------------------------------------------------------

    def _require_open(self) -> anyio.abc.TaskGroup:
        if self._closed:
            raise self._closed_error()
        if self._task_group is None:
            raise RuntimeError("use the TerminalHost as an async context manager before serving requests")
        return self._task_group

    @staticmethod
    def _closed_error() -> RequestError:
        return RequestError.internal_error({"reason": "terminals are closed: the client is shutting down"})

    def _lookup(self, session_id: str, terminal_id: str) -> _Terminal:
        terminal = self._terminals.get(terminal_id)
        if terminal is None or terminal.session_id != session_id:
            raise _unknown_terminal(terminal_id)
        return terminal

    def _prepare(self, request: schema.CreateTerminalRequest) -> _Spawn:
        """Validate a create request into a spawn; nothing is started here."""
        if not request.command:
            raise _refused("the command must not be empty", command=request.command)
        args = request.args or []
        for value, what in [(request.command, "command"), *((arg, "argument") for arg in args)]:
            _check_text(value, what)
        overrides: dict[str, str] = {}
        for variable in request.env or []:
            if not variable.name or "=" in variable.name:
                raise _refused(
                    "an environment variable name must be non-empty without '='", name=variable.name
                )
            _check_text(variable.name, "environment variable name")
            _check_text(variable.value, "environment variable value")
            overrides[variable.name] = variable.value
        cwd = self._resolve_cwd(request.cwd)
        limit = request.output_byte_limit
        if limit is None:
            limit = self.default_output_byte_limit
        elif limit < 0:
            raise _refused("outputByteLimit must not be negative", outputByteLimit=limit)
        elif limit > self.max_output_byte_limit:
            logger.debug(
                "terminal/create: an outputByteLimit above %d clamped to it", self.max_output_byte_limit
            )
            limit = self.max_output_byte_limit
        if self._env is None:
            env, inherit_env = overrides, True
            effective: Mapping[str, str] = {**os.environ, **overrides}
        else:
            env = effective = {**self._env, **overrides}
            inherit_env = False
        _check_program(request.command, effective, cwd)
        _check_exec_size((*_TRAMPOLINE_ARGV, request.command, *args), effective)
        return _Spawn(
            session_id=request.session_id,
            command=(request.command, *args),
            env=env,
            inherit_env=inherit_env,
            cwd=cwd,
            byte_limit=limit,
        )

    def _resolve_cwd(self, cwd: str | None) -> str:
        if cwd is None:
            return self.cwd
        if self.sandbox is not None:
            real = self.sandbox.resolve(cwd)  # -32602 {path, reason} for relative, NUL or outside the roots
        else:
            _check_text(cwd, "cwd")
            if not os.path.isabs(cwd):
                raise _refused("the cwd must be an absolute path", path=cwd)
            real = Path(os.path.realpath(cwd))
        if not real.exists():
            raise _not_found("Directory not found", "the cwd does not exist", path=cwd)
        if not real.is_dir():
            raise _refused("the cwd is not a directory", path=cwd)
        return str(real)

    async def _run_terminal(
        self, terminal_id: str, spawn: _Spawn, *, task_status: anyio.abc.TaskStatus[_Terminal]
    ) -> None:
        """A terminal's task: owns its process from spawn to teardown."""
        terminal: _Terminal | None = None
        started = False
        try:
            async with open_agent_process(
                spawn.argv,
                env=spawn.env,
                inherit_env=spawn.inherit_env,
                cwd=spawn.cwd,
                stderr_tail_bytes=_TRAMPOLINE_STDERR_TAIL,
                # stdin is closed right away, so the first teardown step has nothing to wait for.
                stdin_close_timeout=0,
                sigterm_timeout=self.kill_grace,
                sigkill_timeout=KILL_REAP_TIMEOUT,
                stderr_settle_timeout=OUTPUT_SETTLE_TIMEOUT,
            ) as process:
                terminal = _Terminal(terminal_id, spawn, process)
                self._owned.add(terminal)
                task_status.started(terminal)
                started = True
                await process.stdin.aclose()
                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(terminal.read_output, name=f"read terminal {terminal_id}")
                    task_group.start_soon(terminal.watch_exit, name=f"watch terminal {terminal_id}")
                    await terminal.kill_requested.wait()
                    with anyio.CancelScope(shield=True):
                        await terminal.stop(self.kill_grace)
                    task_group.cancel_scope.cancel()
        except Exception:
            if terminal is None:
                raise  # Before it started: create() reports it.
            # Boundary: one terminal's failure must not take the agent's connection down. The process was
            # torn down by open_agent_process on the way out.
            logger.exception("terminal %s failed", terminal_id)
        finally:
            if terminal is not None:
                terminal.publish_exit()
                terminal.stopped.set()
                self._owned.discard(terminal)
            if started:
                self._live -= 1  # the process is gone: its slot is free


def _check_program(program: str, env: Mapping[str, str], cwd: str) -> None:
    """Refuse a program exec would not find or could not run, resolved the way ``execvp`` will."""
    if os.sep not in program:
        search_path = os.pathsep.join(os.get_exec_path(env))
        if shutil.which(program, path=search_path) is None:
            raise _not_found(
                f"Command not found: {program}",
                f"{program!r} is not an executable on PATH ({search_path or 'empty'})",
                command=program,
            )
        return
    path = os.path.join(cwd, program)
    if not os.path.exists(path):
        raise _not_found(f"Command not found: {program}", f"{program!r} does not exist", command=program)
    if os.path.isdir(path):
        raise _refused(f"{program!r} is a directory", command=program)
    if not os.access(path, os.X_OK):
        raise _refused(f"{program!r} is not executable", command=program)
