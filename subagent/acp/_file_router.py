"""Serve an agent's ``fs/*`` and ``terminal/*`` requests where it runs, between its pipes and a relay.

A transport whose child runs on another node (Ray) relays the agent's stdin and stdout bytes to the
caller, whose `~subagent.acp.client.AcpClient` speaks JSON-RPC over them. That client offers the agent
no files or terminals (the transport's ``local_files`` is False: the caller's paths mean nothing
there). `route_files` sits on the node, between the agent's pipes and the relay, and serves those
requests right there, confined to the node's sandbox roots; the permission policy stays with the
caller, since ``session/request_permission`` is not routed.

Agent -> caller (its stdout)
    As the relay reads the yielded stdout, every complete line is peeked at with one msgspec decode
    into a two-field struct (``method``, ``id``; about 0.33 us a line). A *request* (it has an
    ``id``, whatever its type) whose method starts with ``fs/`` (when there are sandbox roots) or
    ``terminal/`` (when terminals are on) is served here and never reaches the caller; every other
    line (responses, notifications, malformed lines, log lines) is forwarded byte for byte, in order.
    ``$/cancel_request`` is forwarded *and* given to the local server: each side cancels the request
    if it is one of its own and ignores the id otherwise (the agent's ids are unique among its
    requests in flight), so no bookkeeping of routed ids is needed.
    A line longer than ``max_line_bytes`` is forwarded in pieces as it arrives, never parsed nor held
    whole, so the caller's connection reports it (and answers it -32600) as it would without us.

Serving
    Routed lines go to a private `~subagent.acp.connection.Connection` whose request handler is
    `serve_file_request`, the very dispatch `AcpClient` uses, so every answer and every error (codes,
    messages, ``data``) is what the agent would get from a local client: -32602 for bad params or a
    path outside the roots, -32600 for an id that is not a string or integer, -32601 for an unknown
    ``fs/*`` method, -32800 after ``$/cancel_request``, -32603 past ``max_requests`` in flight. Those
    are served concurrently, one task each (a slow ``terminal/wait_for_exit`` holds nothing up);
    one more than ``max_requests`` is refused at once, as `AcpClient` refuses it: a queue would
    either grow without bound or stall the stream. Unlike `AcpClient`, the router does not know the
    agent's sessions (they are between the agent and the caller), so it serves a request of any
    ``sessionId``, and the caller's session sees no activity for it.

Caller -> agent (its stdin)
    Bytes pass unchanged, except the first ``initialize`` request: its ``params.clientCapabilities``
    gets ``fs: {readTextFile: true, writeTextFile: true}`` and/or ``terminal: true`` for what the
    router serves (other members and their order are kept; the line is re-encoded compactly). Until
    that line went by, an incomplete line from the caller is held (up to `MAX_HELD_CALLER_BYTES`) so
    an ``initialize`` split across writes is still seen whole; afterwards nothing is held.
    The router's answers and the caller's lines share the agent's stdin under one lock, and an
    answer waits while the caller is in the middle of a line: they interleave only at line
    boundaries.

Ending
    When the agent's stdout ends, the local requests still in flight are cancelled (nobody waits for
    them: the agent is going away) and the yielded stdout ends once everything before the end was
    forwarded. Closing the yielded stdin closes the agent's stdin at once (after a held partial line
    of the caller's, bounded by `STDIN_CLOSE_FLUSH_TIMEOUT`); answers still being computed are then
    dropped: an agent whose stdin closed cannot read them. Leaving the block cancels every local
    request and kills every terminal (`~subagent.acp.terminals.TerminalHost.aclose`): no task or
    process outlives it. The yielded streams are valid only inside the block.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Final

import anyio
import anyio.abc
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream

from subagent.acp import schema
from subagent.acp._errors import RequestError
from subagent.acp.connection import (
    CANCEL_REQUEST_METHOD,
    DEFAULT_MAX_INCOMING_REQUESTS,
    DEFAULT_MAX_LINE_BYTES,
    Connection,
    _replace_lone_surrogates,
)
from subagent.acp.handlers import FsSandbox
from subagent.acp.terminals import TerminalHost

__all__ = [
    "MAX_HELD_CALLER_BYTES",
    "MAX_QUEUED_ROUTED_BYTES",
    "STDIN_CLOSE_FLUSH_TIMEOUT",
    "route_files",
    "serve_file_request",
]

logger = logging.getLogger(__name__)

MAX_HELD_CALLER_BYTES: Final = 64 * 1024
"""The longest incomplete line of the caller's held back until its newline, before the ``initialize``
request went by (an ``initialize`` is well under 1 KiB); a longer one is passed on as it comes."""

MAX_QUEUED_ROUTED_BYTES: Final = 1024 * 1024
"""How many bytes of routed requests may wait for the local server before the router stops reading the
agent's stdout. The server's reader takes each line at once, so this is reached only by a flood."""

STDIN_CLOSE_FLUSH_TIMEOUT: Final = 1.0
"""When the caller closes stdin, how long its held partial line may take to reach the agent (whose stdin
may be full) before the agent's stdin is closed anyway."""

_MIN_READ: Final = 4096
"""The least the router asks of the agent's stdout in one read."""
_FS_PREFIX: Final = "fs/"
_TERMINAL_PREFIX: Final = "terminal/"
_INITIALIZE_MARK: Final = b'"initialize"'


async def serve_file_request(
    method: str,
    params: msgspec.Raw | None,
    *,
    fs: FsSandbox | None,
    terminals: TerminalHost | None,
    on_session: Callable[[str], object] | None = None,
) -> msgspec.Struct:
    """Answer one of the agent's ``fs/*`` or ``terminal/*`` requests: what `AcpClient` serves itself.

    ``on_session`` (a callable taking the request's ``sessionId``) is called before a file is touched;
    `AcpClient` passes one that refuses an unknown session (-32602) and marks the session active.

    Raises:
        RequestError: as `FsSandbox` and `TerminalHost` refuse; -32601 for any other method, and for
            ``fs/*`` without ``fs`` or ``terminal/*`` without ``terminals``.
        msgspec.ValidationError: the params do not fit the method (a connection answers -32602).
    """
    data = params if params is not None else b"null"
    if method == schema.FS_READ_TEXT_FILE and fs is not None:
        read = schema.decode(data, type=schema.ReadTextFileRequest)
        if on_session is not None:
            on_session(read.session_id)
        content = await fs.read_text(read.path, line=read.line, limit=read.limit)
        return schema.ReadTextFileResponse(content=content)
    if method == schema.FS_WRITE_TEXT_FILE and fs is not None:
        write = schema.decode(data, type=schema.WriteTextFileRequest)
        if on_session is not None:
            on_session(write.session_id)
        await fs.write_text(write.path, write.content)
        return schema.WriteTextFileResponse()
    if method.startswith(_TERMINAL_PREFIX) and terminals is not None:
        return await terminals.serve(method, data)
    raise RequestError.method_not_found(method)


class _Peek(msgspec.Struct):
    """What the router reads of each line of the agent's: the rest is skipped by msgspec, unparsed."""

    method: str | msgspec.UnsetType = msgspec.UNSET
    id: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


_PEEK: Final = msgspec.json.Decoder(_Peek)
_ANY_JSON: Final = msgspec.json.Decoder()
_ENCODER: Final = msgspec.json.Encoder()


def _peek(line: bytes) -> _Peek | None:
    """The method and id of a line, or None when it is no JSON object (or ``method`` is no string)."""
    try:
        return _PEEK.decode(line)
    except msgspec.ValidationError:
        return None
    except msgspec.DecodeError:
        # JSON with a lone surrogate escape (msgspec refuses it, a Connection repairs it): peek at the
        # repaired line, so a request written that way is routed as the Connection would read it.
        repaired = _replace_lone_surrogates(line)
        if repaired == line:
            return None
        try:
            return _PEEK.decode(repaired)
        except (msgspec.DecodeError, RecursionError):
            return None
    except RecursionError:
        return None


class _Router:
    """The state shared by the two yielded streams and the local server."""

    def __init__(
        self,
        agent_stdin: anyio.abc.ByteSendStream,
        agent_stdout: anyio.abc.ByteReceiveStream,
        *,
        fs: FsSandbox | None,
        terminals: TerminalHost | None,
        max_line_bytes: int,
        max_requests: int,
    ) -> None:
        self.agent_stdin = agent_stdin
        self.fs = fs
        self.terminals = terminals
        self.lock = anyio.Lock()
        """Held for each write to the agent's stdin."""
        self.caller_mid_line = False
        """The caller's last write to the agent's stdin ended inside a line: no answer may go now."""
        self.line_ended = anyio.Event()
        """Set when the caller ends the line it is in the middle of (or closes stdin)."""
        self.stdin_closed = False
        self.answer_held = anyio.Event()
        """Set when an answer first had to wait for the caller's line to end (for tests and debugging)."""
        self.feed_send, feed_receive = anyio.create_memory_object_stream[bytes](math.inf)
        self.feed = _Feed(feed_receive)
        self.server = Connection(
            self.feed,
            _AnswerStream(self),
            request_handler=self.serve,
            max_line_bytes=max_line_bytes,
            max_incoming_requests=max_requests,
            name="file-router",
            value_encoder=schema.encode,
        )
        self.stdin = _CallerStdin(self, fs=fs is not None, terminals=terminals is not None)
        self.stdout = _AgentStdout(self, agent_stdout, max_line_bytes)

    async def serve(self, method: str, params: msgspec.Raw | None) -> msgspec.Struct:
        return await serve_file_request(method, params, fs=self.fs, terminals=self.terminals)

    def routes(self, method: str) -> bool:
        if method.startswith(_FS_PREFIX):
            return self.fs is not None
        return method.startswith(_TERMINAL_PREFIX) and self.terminals is not None

    def route(self, line: bytes) -> None:
        """Hand one whole line (with its newline) to the local server; dropped once it has stopped."""
        try:
            self.feed_send.send_nowait(line)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            logger.debug("file router: the local server has stopped; a routed line was dropped")
            return
        self.feed.queued += len(line)

    async def write_answer(self, line: bytes) -> None:
        """Write one of the server's answers to the agent's stdin, at a line boundary of the caller's."""
        while True:
            async with self.lock:
                if self.stdin_closed:
                    raise anyio.ClosedResourceError
                if not self.caller_mid_line:
                    await self.agent_stdin.send(line)
                    return
                line_ended = self.line_ended
            self.answer_held.set()
            await line_ended.wait()

    async def run_server(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            await self.server.run(task_status=task_status)
        finally:
            # Routing after this drops the line rather than queueing it for nobody.
            self.feed.close()


class _Feed(anyio.abc.ByteReceiveStream):
    """The routed lines, one whole line per receive, as the local server's receive stream."""

    def __init__(self, lines: MemoryObjectReceiveStream[bytes]) -> None:
        self._lines = lines
        self.queued = 0
        """Bytes routed and not yet taken by the server."""
        self._taken = anyio.Event()

    async def receive(self, max_bytes: int = 65536) -> bytes:
        line = await self._lines.receive()
        self.queued -= len(line)
        self._taken.set()
        return line

    async def wait_taken(self, below: int) -> None:
        """Wait until fewer than ``below`` routed bytes wait for the server (or it stopped)."""
        while self.queued >= below:
            self._taken = anyio.Event()
            await self._taken.wait()

    def close(self) -> None:
        self._lines.close()
        self.queued = 0
        self._taken.set()

    async def aclose(self) -> None:
        self.close()


class _AnswerStream(anyio.abc.ByteSendStream):
    """The local server's send stream: its answers, written to the agent's stdin under the lock."""

    def __init__(self, router: _Router) -> None:
        self._router = router

    async def send(self, item: bytes) -> None:
        await self._router.write_answer(item)

    async def aclose(self) -> None:
        pass  # the agent's stdin belongs to the caller's side: closing it is _CallerStdin's


class _AgentStdout(anyio.abc.ByteReceiveStream):
    """The agent's stdout without the routed requests: what the relay reads.

    Cancellation-safe: a chunk read from the agent is taken apart without awaiting anything, and what
    it leaves to forward stays here until a later `receive` returns it.
    """

    def __init__(self, router: _Router, agent_stdout: anyio.abc.ByteReceiveStream, limit: int) -> None:
        self._router = router
        self._agent = agent_stdout
        self._limit = limit
        self._partial = bytearray()
        """The start of the agent's current line, while it is within the limit."""
        self._passing = False
        """The current line went past the limit: its bytes are forwarded as they come, to its newline."""
        self._ready: deque[bytes] = deque()
        """Bytes to forward, in order; the first of them from `_offset` on."""
        self._offset = 0
        self._ended = False

    async def receive(self, max_bytes: int = 65536) -> bytes:
        feed = self._router.feed
        while not self._ready:
            if self._ended:
                raise anyio.EndOfStream
            if feed.queued >= MAX_QUEUED_ROUTED_BYTES:
                await feed.wait_taken(MAX_QUEUED_ROUTED_BYTES)
            # Room for the start of a line held from the last read: the chunk then goes out whole, in
            # one receive of the relay's, rather than in a full piece and a sliver.
            room = max(max_bytes - len(self._partial), _MIN_READ)
            try:
                chunk = await self._agent.receive(room)
            except anyio.EndOfStream:
                self._end()
            else:
                self._take(chunk)
        # One piece a call, never joined: a piece as long as the line limit is returned a slice at a
        # time, each copied once.
        piece, start = self._ready[0], self._offset
        if len(piece) - start <= max_bytes:
            self._ready.popleft()
            self._offset = 0
            return piece[start:] if start else piece
        self._offset = start + max_bytes
        return piece[start : start + max_bytes]

    def _end(self) -> None:
        if self._partial:  # a last line without its newline: forwarded, as the caller would take it
            self._ready.append(bytes(self._partial))
            self._partial.clear()
        self._ended = True
        # Nobody can use the answers to the local requests still in flight: the server cancels them.
        self._router.feed_send.close()

    def _take(self, chunk: bytes) -> None:
        if self._passing:
            newline = chunk.find(b"\n")
            if newline < 0:
                self._ready.append(chunk)
                return
            self._ready.append(chunk[: newline + 1])
            chunk = chunk[newline + 1 :]
            self._passing = False
        partial = self._partial
        if partial:
            if b"\n" not in chunk:
                partial += chunk
                self._check_partial()
                return
            # One copy of the chunk, so that it is forwarded as one piece: the relay (and the caller's
            # connection) then takes it in one read, not two.
            chunk = bytes(partial) + chunk
            partial.clear()
        end = chunk.rfind(b"\n") + 1
        if end == len(chunk):
            if chunk:
                self._take_lines(chunk)
            return
        if end:
            self._take_lines(chunk[:end])
        partial += chunk[end:]
        self._check_partial()

    def _check_partial(self) -> None:
        partial = self._partial
        if len(partial) > self._limit:
            # Too long to be routed: forward what there is and the rest as it comes, holding none of it.
            self._ready.append(bytes(partial))
            partial.clear()
            self._passing = True

    def _take_lines(self, block: bytes) -> None:
        """Take whole lines (``block`` ends with a newline): route the served requests, forward the rest."""
        router = self._router
        limit = self._limit
        decode = _PEEK.decode
        unset = msgspec.UNSET
        lines = block.split(b"\n")
        lines.pop()  # the empty string after the last newline
        served: list[int] | None = None  # indices of the lines served here, once there is one
        # The hot loop: one C-level decode a line, most lines being notifications (no id).
        for index, line in enumerate(lines):
            if len(line) > limit:
                continue  # not parsed: the caller's connection reports it, as without us
            try:
                message = decode(line)
            except (msgspec.DecodeError, RecursionError):  # ValidationError included
                peeked = _peek(line)
                if peeked is None:
                    continue
                message = peeked
            if message.id is unset:
                if message.method == CANCEL_REQUEST_METHOD:
                    router.route(line + b"\n")  # and forwarded too: see the module docstring
                continue
            method = message.method
            if method is not unset and router.routes(method):
                router.route(line + b"\n")
                if served is None:
                    served = []
                served.append(index)
        if served is None:
            self._ready.append(block)
            return
        for index in reversed(served):
            del lines[index]
        if lines:
            lines.append(b"")
            self._ready.append(b"\n".join(lines))

    async def aclose(self) -> None:
        self._ended = True
        self._router.feed_send.close()
        await self._agent.aclose()


class _CallerStdin(anyio.abc.ByteSendStream):
    """The agent's stdin as the relay writes to it: the ``initialize`` request amended, the rest as is."""

    def __init__(self, router: _Router, *, fs: bool, terminals: bool) -> None:
        self._router = router
        self._fs = fs
        self._terminals = terminals
        self._watching = True
        """No ``initialize`` request was amended yet."""
        self._held = b""
        """An incomplete line of the caller's, held while watching (see `MAX_HELD_CALLER_BYTES`)."""

    async def send(self, item: bytes) -> None:
        if not item:
            return
        router = self._router
        async with router.lock:
            if router.stdin_closed:
                raise anyio.ClosedResourceError
            if self._watching:
                item = self._amend(item)
                if not item:
                    return
            # Marked before the write: a write cut short by cancellation may still have begun a line.
            mid_line = item[-1:] != b"\n"
            if mid_line and not router.caller_mid_line:
                router.line_ended = anyio.Event()
            elif not mid_line and router.caller_mid_line:
                router.line_ended.set()
            router.caller_mid_line = mid_line
            await router.agent_stdin.send(item)

    def _amend(self, item: bytes) -> bytes:
        """What to write now of ``item``: the whole lines (an ``initialize`` amended), and an
        incomplete tail only when it is too long to hold."""
        head = b""
        if self._router.caller_mid_line:  # inside an over-long line: it goes on as it is
            newline = item.find(b"\n")
            if newline < 0:
                return item
            head, item = item[: newline + 1], item[newline + 1 :]
        data = self._held + item if self._held else item
        self._held = b""
        end = data.rfind(b"\n") + 1
        whole, tail = data[:end], data[end:]
        if _INITIALIZE_MARK in whole:
            whole = self._amend_lines(whole)
        if tail and self._watching and len(tail) <= MAX_HELD_CALLER_BYTES:
            self._held, tail = tail, b""
        return head + whole + tail

    def _amend_lines(self, block: bytes) -> bytes:
        lines = block.split(b"\n")
        for index, line in enumerate(lines):
            if _INITIALIZE_MARK in line:
                amended = self._amend_initialize(line)
                if amended is not None:
                    lines[index] = amended
                    self._watching = False
                    break
        return b"\n".join(lines)

    def _amend_initialize(self, line: bytes) -> bytes | None:
        """``line`` with the capabilities the router serves offered, if it is an ``initialize`` request
        whose params are an object; else None (it goes unchanged)."""
        peeked = _peek(line)
        if peeked is None or peeked.method != schema.INITIALIZE or peeked.id is msgspec.UNSET:
            return None
        try:
            message = _ANY_JSON.decode(line)
        except (msgspec.DecodeError, RecursionError):
            return None
        params = message.get("params")
        if not isinstance(params, dict):
            return None
        capabilities = params.setdefault("clientCapabilities", {})
        if not isinstance(capabilities, dict):
            return None
        if self._fs:
            fs = capabilities.get("fs")
            if not isinstance(fs, dict):
                fs = capabilities["fs"] = {}
            fs["readTextFile"] = True
            fs["writeTextFile"] = True
        if self._terminals:
            capabilities["terminal"] = True
        carriage_return = b"\r" if line.endswith(b"\r") else b""
        return _ENCODER.encode(message) + carriage_return

    async def aclose(self) -> None:
        router = self._router
        with anyio.CancelScope(shield=True):
            if self._held and not router.stdin_closed:
                held, self._held = self._held, b""
                with anyio.move_on_after(STDIN_CLOSE_FLUSH_TIMEOUT):
                    async with router.lock:
                        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                            await router.agent_stdin.send(held)
            router.stdin_closed = True
            router.line_ended.set()
            await router.agent_stdin.aclose()


@contextlib.asynccontextmanager
async def route_files(
    agent_stdin: anyio.abc.ByteSendStream,
    agent_stdout: anyio.abc.ByteReceiveStream,
    *,
    fs_roots: Sequence[str | os.PathLike[str]] | None = None,
    terminals: bool = False,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_requests: int = DEFAULT_MAX_INCOMING_REQUESTS,
) -> AsyncIterator[tuple[anyio.abc.ByteSendStream, anyio.abc.ByteReceiveStream]]:
    """Serve the agent's ``fs/*`` (inside ``fs_roots``) and ``terminal/*`` (when ``terminals``) requests
    here, and yield the ``(stdin, stdout)`` the relay uses instead of the agent's (see the module
    docstring for what passes and what is served).

    With neither, the agent's own streams are yielded unchanged. ``cwd`` is where a terminal created
    without one runs (default: the first root, else this process's working directory); with roots, it
    must lie inside them. ``env`` is the environment terminal commands start from (default: this
    process's, read at each create), the request's entries merged over it. ``max_line_bytes`` should
    be the caller's line limit: a longer line is forwarded for the caller to refuse. ``max_requests``:
    local requests served at once; one more is refused with -32603.

    Requests are found as the yielded stdout is read, so the relay keeps reading it (as it must anyway
    for the caller to see anything): while it pauses, so does serving. It may be read in one task while
    another writes the yielded stdin. Leaving the block cancels the local requests and kills every
    terminal. The agent's streams stay the caller's to close (closing a yielded one closes the agent's).

    Raises:
        ValueError: a root is not an existing directory, ``cwd`` is not one or lies outside the roots,
            or ``env`` holds a malformed name.
    """
    sandbox = None if fs_roots is None else FsSandbox(fs_roots)
    if sandbox is None and not terminals:
        yield agent_stdin, agent_stdout
        return
    async with contextlib.AsyncExitStack() as stack:
        host = None
        if terminals:
            host = await stack.enter_async_context(TerminalHost(sandbox=sandbox, cwd=cwd, env=env))
        router = _Router(
            agent_stdin,
            agent_stdout,
            fs=sandbox,
            terminals=host,
            max_line_bytes=max_line_bytes,
            max_requests=max_requests,
        )
        body_error: BaseException | None = None
        async with anyio.create_task_group() as task_group:
            await task_group.start(router.run_server)
            try:
                yield router.stdin, router.stdout
            except BaseException as exc:
                # Re-raised after the task group exits, so the caller sees its own exception, unwrapped.
                body_error = exc
            finally:
                router.server.close()
                router.feed_send.close()
                router.feed.close()
                task_group.cancel_scope.cancel()
        # The terminal host exits next (the stack): every terminal is killed and reaped.
    if body_error is not None:
        raise body_error
