"""File descriptors as anyio byte streams, on any backend: the transport of an agent on stdio.

`FdReceiveStream` and `FdSendStream` put a descriptor in non-blocking mode and wait with
`anyio.wait_readable`/`anyio.wait_writable` (a regular file or ``/dev/null``, which cannot be waited for
and never blocks, is read and written directly). `stdio_streams` opens this process's stdin and stdout
as the protocol channel, pointing fd 1 at stderr meanwhile so that a stray ``print`` can never corrupt
the protocol (`subagent.acp.agent.serve_stdio` serves an agent on it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Awaitable, Callable, Iterator
from typing import Final, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

__all__ = ["FdReceiveStream", "FdSendStream", "stdio_streams"]

_Argument = TypeVar("_Argument")
_Result = TypeVar("_Result")

_READ_SIZE: Final = 64 * 1024
"""How much one `FdReceiveStream.receive` reads by default: one pipe buffer."""


def _pollable(fd: int) -> bool:
    """Whether readiness can be waited for on `fd`: pipes, sockets and terminals, not files or /dev/null."""
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or (stat.S_ISCHR(mode) and os.isatty(fd))


class _FdStream:
    """A file descriptor in non-blocking mode; restores its flags on close (shared with the process's 0/1)."""

    def __init__(self, fd: int, *, close_fd: bool = True) -> None:
        self._fd = fd
        self._close_fd = close_fd
        self._closed = False
        self._busy = False
        # epoll refuses regular files and /dev/null; they never block, so there is nothing to wait for.
        self._pollable = _pollable(fd)
        self._flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if self._pollable:
            fcntl.fcntl(fd, fcntl.F_SETFL, self._flags | os.O_NONBLOCK)

    @property
    def fd(self) -> int:
        """The file descriptor."""
        return self._fd

    @property
    def closed(self) -> bool:
        """Whether the stream was closed."""
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        if self._busy:
            raise anyio.BusyResourceError("using")

    async def _when_ready(
        self,
        call: Callable[[int, _Argument], _Result],
        argument: _Argument,
        ready: Callable[[int], Awaitable[None]],
    ) -> _Result:
        """``call(fd, argument)`` (a read or a write), waiting with ``ready`` each time it would block; the
        stream is busy until it returns.

        Raises:
            anyio.ClosedResourceError: the stream is closed, before or while waiting.
            anyio.BusyResourceError: another task is using it.
            anyio.BrokenResourceError: the call failed (EPIPE: the reader is gone; SIGPIPE is ignored in
                Python).
        """
        self._check()
        self._busy = True
        try:
            while True:
                try:
                    return call(self._fd, argument)
                except BlockingIOError:
                    await ready(self._fd)
                    if self._closed:
                        raise anyio.ClosedResourceError from None
                except OSError as exc:
                    raise anyio.BrokenResourceError from exc
        finally:
            self._busy = False

    async def aclose(self) -> None:
        """Restore the descriptor's flags and close it (if this stream owns it); idempotent.

        A task waiting on the descriptor gets `anyio.ClosedResourceError`.
        """
        if not self._closed and self._pollable:
            anyio.notify_closing(self._fd)
        self.close_now()
        await anyio.lowlevel.checkpoint()

    def close_now(self) -> None:
        """`aclose` for when no task can be waiting on the descriptor (e.g. after the event loop ended)."""
        if self._closed:
            return
        self._closed = True
        if self._pollable:
            with contextlib.suppress(OSError):
                fcntl.fcntl(self._fd, fcntl.F_SETFL, self._flags)
        if self._close_fd:
            os.close(self._fd)


class FdReceiveStream(_FdStream, anyio.abc.ByteReceiveStream):
    """Read a pipe, socket, terminal or file descriptor as an anyio byte stream, on any backend.

    The descriptor is put in non-blocking mode and awaited with `anyio.wait_readable`. EOF raises
    `anyio.EndOfStream`; a read error raises `anyio.BrokenResourceError`.

    Args:
        fd: the descriptor.
        close_fd: close it on `aclose` (else only its flags are restored).
    """

    async def receive(self, max_bytes: int = _READ_SIZE) -> bytes:
        """Return up to `max_bytes` as soon as any are available."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        data = await self._when_ready(os.read, max_bytes, anyio.wait_readable)
        if not data:
            raise anyio.EndOfStream
        # A read that never had to wait still yields once, so a busy reader cannot starve other tasks.
        await anyio.lowlevel.cancel_shielded_checkpoint()
        return data


class FdSendStream(_FdStream, anyio.abc.ByteSendStream):
    """Write to a pipe, socket, terminal or file descriptor as an anyio byte stream, on any backend.

    `send` writes everything, waiting with `anyio.wait_writable` whenever the pipe is full (partial writes
    and EAGAIN are handled). A reader that went away raises `anyio.BrokenResourceError`. A `send` cancelled
    while waiting may have written part of its bytes.

    `send` is a cancellation point, but it yields to other tasks only when the pipe is full: a write the
    kernel takes at once costs one system call and no trip through the event loop. That is what lets an
    agent stream tens of thousands of small messages a second; the sender's own loop (the connection's
    writer waits for its next line) provides the scheduling point, and a full pipe bounds any burst.

    Args:
        fd: the descriptor.
        close_fd: close it on `aclose` (else only its flags are restored).
    """

    async def send(self, item: bytes) -> None:
        """Write all of `item`."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._check()  # an empty item too finds out that the stream is closed
        view = memoryview(item)
        while view:
            written = await self._when_ready(os.write, view, anyio.wait_writable)
            view = view[written:]


@contextlib.contextmanager
def stdio_streams(*, protect_stdout: bool = True) -> Iterator[tuple[FdReceiveStream, FdSendStream]]:
    """This process's stdin and stdout as anyio byte streams, for an agent speaking ACP on them.

    The streams use duplicates of fds 0 and 1. With `protect_stdout`, fd 1 is pointed at stderr while the
    block runs, so that a ``print`` or a chatty library writes to stderr and can never corrupt the protocol;
    the stream's descriptor is then the only one this process holds on the original stdout, so closing the
    send stream closes the channel (the client sees EOF, unless a child process inherited stdout). On exit
    fd 1 gets the original stdout back, unless the send stream was closed.
    """
    stdin_fd = os.dup(0)
    stdout_fd = os.dup(1)
    try:
        receive_stream = FdReceiveStream(stdin_fd)
        send_stream = FdSendStream(stdout_fd)
    except BaseException:
        os.close(stdin_fd)
        os.close(stdout_fd)
        raise
    if protect_stdout:
        os.dup2(2, 1)
    try:
        yield receive_stream, send_stream
    finally:
        receive_stream.close_now()
        if protect_stdout and not send_stream.closed:
            os.dup2(stdout_fd, 1)
        send_stream.close_now()
