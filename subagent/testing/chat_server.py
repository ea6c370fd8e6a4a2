"""A scriptable stub of an OpenAI-compatible chat-completions server, on loopback, to test adapters against.

It runs inside the caller's own event loop (asyncio or trio, through anyio) and answers each
``POST /v1/chat/completions`` with the next reply of a script::

    script = [
        ErrorReply(429, retry_after=0.01),
        StreamedReply(text=("Hel", "lo"), usage={"prompt_tokens": 3, "completion_tokens": 2}),
    ]
    async with serve_chat_completions(script) as server:
        adapter = OpenAiChatAdapter(model="stub-model", base_url=server.base_url, api_key="sk-test")
        ...
        assert len(server.requests) == 2
        assert server.requests[1].json["stream"] is True

Replies (all frozen dataclasses):

* :class:`StreamedReply`: a server-sent-event stream of ``chat.completion.chunk`` objects: text pieces,
  tool calls in pieces, a finish reason, usage, ``data: [DONE]``; optionally cut short (``drop_after``)
  or left hanging (``stall_after``) after a number of events.
* :class:`JsonReply`: one non-streamed ``chat.completion`` JSON body (a server that ignores ``stream``).
* :class:`ErrorReply`: an HTTP error status (or a redirect) with an OpenAI-style JSON error body, an
  optional ``Retry-After`` and any other headers; it can echo request headers in its message, as
  servers that quote a rejected key do.
* :class:`DropConnection`: close the connection without answering (or right after the status line and
  headers, ``after_headers=True``).
* :class:`MalformedChunk`: a stream whose event carries raw, broken data.
* :class:`StallReply`: never answer, until the client gives up and closes the connection.
* :class:`RawStream`: a ``200`` whose body is exactly the given pieces, each one HTTP chunk (comments,
  CRLF line endings, an event split across reads, a body that is not events at all), optionally with a
  pause before each (a server that trickles its answer).

``server.requests`` records every chat-completions request with a JSON body, in arrival order, one
beyond the script too (that one is answered 500 with a body that says so, unless a ``responder`` is
given: then it answers every request beyond the script, ``responder(request)``, which suits a real agent
whose side calls, such as title generation, make the count of requests unpredictable). ``GET /v1/models``
lists the one model name and is not recorded; requests to unknown routes are answered 404 and listed in
``server.unrouted`` as ``(method, path)``.

The server is also a proxy that goes nowhere: point ``HTTPS_PROXY`` / ``HTTP_PROXY`` at it and a
client that honours them (a real agent, say) has its every ``CONNECT`` listed in ``server.tunnels``; a
tunnel to the server itself is opened (the client's requests then arrive through it, as plain HTTP),
any other target is refused with 403. An empty list of other targets shows the client tried to reach
nothing else. HTTP/1.1 is parsed by hand, minimally: a request line, headers and
a ``Content-Length`` body; every response carries ``Connection: close`` and the connection is closed
after it.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

__all__ = [
    "ChatCompletionsServer",
    "ChatReply",
    "DropConnection",
    "ErrorReply",
    "JsonReply",
    "MalformedChunk",
    "RawStream",
    "ReceivedRequest",
    "StallReply",
    "StreamedReply",
    "ToolCallReply",
    "serve_chat_completions",
]

_MAX_LINE = 64 * 1024
_MAX_HEADERS = 100
_MAX_BODY = 64 * 1024 * 1024
_CREATED = 1_700_000_000  # a fixed timestamp: scripted chunks are the same on every run

FinishReasonText = str | Literal["auto"] | None
"""A finish reason as sent: ``"auto"`` picks ``"tool_calls"`` when the reply has tool calls, else ``"stop"``;
None sends none at all (to test a client against a stream that never says why it stopped)."""


def _as_pieces(value: str | Sequence[str], chunks: int) -> tuple[str, ...]:
    """``value`` as given if it is a sequence of pieces; a string split in ``chunks`` nearly equal ones."""
    if not isinstance(value, str):
        return tuple(value)
    if not value:
        return ()
    count = max(1, min(chunks, len(value)))
    size, extra = divmod(len(value), count)
    pieces: list[str] = []
    start = 0
    for index in range(count):
        end = start + size + (1 if index < extra else 0)
        pieces.append(value[start:end])
        start = end
    return tuple(pieces)


@dataclass(frozen=True, slots=True)
class ToolCallReply:
    """One tool call of a reply. Streamed, its first piece carries ``id``, ``name`` and empty arguments;
    the arguments follow as given (a sequence of pieces), or split into ``chunks`` nearly equal pieces."""

    id: str
    name: str
    arguments: str | Sequence[str] = "{}"
    chunks: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.arguments, str):
            object.__setattr__(self, "arguments", tuple(self.arguments))
        if self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks}")

    @property
    def argument_pieces(self) -> tuple[str, ...]:
        """The arguments as they are streamed, piece by piece."""
        return _as_pieces(self.arguments, self.chunks)

    @property
    def full_arguments(self) -> str:
        """The whole arguments text."""
        return "".join(self.argument_pieces) if not isinstance(self.arguments, str) else self.arguments


@dataclass(frozen=True, slots=True)
class StreamedReply:
    """A streamed answer: ``text/event-stream``, one ``data:`` event per chunk, in this order:

    1. a role chunk (``{"role": "assistant", "content": ""}``);
    2. one chunk per text piece (``text`` as given pieces, or a string split into ``chunks``);
    3. the tool calls, each as a header piece then its argument pieces; one call after the other, or
       round-robin across calls when ``interleave`` (as some servers stream parallel calls);
    4. a chunk with an empty delta and the finish reason (unless ``finish_reason`` is None);
    5. a usage chunk with no choices, when ``usage`` is given (sent verbatim as the ``usage`` object);
    6. ``data: [DONE]``, when ``done``.

    ``drop_after=N`` sends only the first N events, then closes the connection mid-body (the chunked
    encoding is left unterminated, as a crashed server does). ``stall_after=N`` sends the first N events,
    then hangs until the client closes the connection.
    """

    text: str | Sequence[str] = ""
    chunks: int = 1
    tool_calls: Sequence[ToolCallReply] = ()
    interleave: bool = False
    finish_reason: FinishReasonText = "auto"
    usage: Mapping[str, Any] | None = None
    done: bool = True
    drop_after: int | None = None
    stall_after: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            object.__setattr__(self, "text", tuple(self.text))
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))
        if self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks}")
        if self.drop_after is not None and self.stall_after is not None:
            raise ValueError("a reply can drop or stall, not both")
        for name in ("drop_after", "stall_after"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class JsonReply:
    """A non-streamed answer: one ``application/json`` ``chat.completion`` body, whatever the request
    asked (a server that ignores ``stream``). ``text=None`` sends ``"content": null``."""

    text: str | None = ""
    tool_calls: Sequence[ToolCallReply] = ()
    finish_reason: FinishReasonText = "auto"
    usage: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An HTTP error (or a redirect): ``status`` with an OpenAI-style body ``{"error": {"message", "type",
    "code"}}``, or ``body`` verbatim when given. ``retry_after`` becomes the ``Retry-After`` header, as
    written; ``headers`` are added as given (``Location`` for a redirect). ``echo_headers`` names request
    headers whose values the message quotes, ``"<message> (authorization: Bearer sk-...)"`` (not with
    ``body``): a server that repeats a rejected credential back."""

    status: int
    message: str = "scripted error"
    retry_after: float | str | None = None
    body: str | None = None
    error_type: str = "stub_error"
    headers: Mapping[str, str] = field(default_factory=dict)
    echo_headers: Sequence[str] = ()

    def __post_init__(self) -> None:
        if not 300 <= self.status <= 599:
            raise ValueError(f"an error status is 300..599, got {self.status}")
        object.__setattr__(self, "headers", dict(self.headers))
        object.__setattr__(self, "echo_headers", tuple(name.lower() for name in self.echo_headers))
        if self.echo_headers and self.body is not None:
            raise ValueError("echo_headers goes into the message, and a verbatim body has none")

    def message_for(self, request_headers: Mapping[str, str]) -> str:
        """The message, with the echoed request headers (lower-case names) quoted."""
        if not self.echo_headers:
            return self.message
        echoed = "; ".join(f"{name}: {request_headers.get(name, '(absent)')}" for name in self.echo_headers)
        return f"{self.message} ({echoed})"


@dataclass(frozen=True, slots=True)
class DropConnection:
    """Close the connection without a response; with ``after_headers``, right after a ``200`` status line
    and stream headers, before any byte of the body."""

    after_headers: bool = False


@dataclass(frozen=True, slots=True)
class MalformedChunk:
    """A stream that breaks the wire format: a role chunk, one chunk per piece of ``text_before``, then
    ``data: <data>`` verbatim, then ``data: [DONE]``."""

    data: str = '{"choices": [{"index": 0, "delta": {"content": "tru'
    text_before: Sequence[str] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "text_before", tuple(self.text_before))


@dataclass(frozen=True, slots=True)
class StallReply:
    """Never answer: hang until the client closes the connection. With ``after_headers``, a ``200``
    status line and stream headers are sent first."""

    after_headers: bool = False


@dataclass(frozen=True, slots=True)
class RawStream:
    """A ``200`` answer whose body is ``pieces`` verbatim (str is sent as UTF-8), each piece one HTTP
    chunk: for wire details the other replies do not produce. With ``pause``, the server waits that
    many seconds before each piece (one byte a piece and a pause: a server trickling its answer); it
    stops when the client hangs up."""

    pieces: Sequence[bytes | str]
    content_type: str = "text/event-stream"
    pause: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "pieces", tuple(self.pieces))
        if not self.pause >= 0:
            raise ValueError(f"pause must be >= 0 seconds, got {self.pause}")


ChatReply = StreamedReply | JsonReply | ErrorReply | DropConnection | MalformedChunk | StallReply | RawStream
"""One scripted answer to one chat-completions request."""


@dataclass(frozen=True, slots=True, eq=False)
class ReceivedRequest:
    """A chat-completions request as the server received it. ``headers`` has lower-cased names.
    ``disconnected`` is set when the client closed the connection before the response was complete."""

    index: int
    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes
    json: Any
    disconnected: anyio.Event = field(repr=False)


class _ClientGone(Exception):
    """The client closed the connection while we were still answering."""


class ChatCompletionsServer:
    """The running stub server: where it listens and what it received. See :func:`serve_chat_completions`."""

    def __init__(
        self,
        script: Iterable[ChatReply],
        *,
        model: str,
        port: int,
        responder: Callable[[ReceivedRequest], ChatReply] | None = None,
    ) -> None:
        self.script: list[ChatReply] = list(script)
        """The replies, in order; append to it to script more while the server runs."""
        self.model = model
        self.port = port
        self.responder = responder
        """Answers each request beyond the script, when given."""
        self.requests: list[ReceivedRequest] = []
        """Every chat-completions request received, in arrival order (one per script entry used)."""
        self.unrouted: list[tuple[str, str]] = []
        """``(method, path)`` of every request to a route the server does not know (answered 404)."""
        self.tunnels: list[str] = []
        """The target (``host:port``) of every ``CONNECT``: see :func:`serve_chat_completions` on proxies."""

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL: ``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"

    def __repr__(self) -> str:
        served, scripted = len(self.requests), len(self.script)
        return f"ChatCompletionsServer({self.base_url!r}, served={served}, scripted={scripted})"

    async def _handle(self, stream: anyio.abc.ByteStream) -> None:
        await _serve_connection(stream, self._serve_one)

    async def _serve_one(
        self, stream: anyio.abc.ByteStream, reader: BufferedByteReceiveStream, *, tunnelled: bool = False
    ) -> None:
        try:
            method, target, headers = await _read_head_lines(reader)
        except (anyio.DelimiterNotFound, ValueError) as exc:
            await _send_json(
                stream, 400, {"error": {"message": f"bad request: {exc}", "type": "bad_request"}}
            )
            return
        if "chunked" in headers.get("transfer-encoding", "").lower():
            await _send_json(stream, 411, _error_body("send the body with Content-Length", "length_required"))
            return
        try:
            length = int(headers.get("content-length", "0"))
            if not 0 <= length <= _MAX_BODY:
                raise ValueError(length)
        except ValueError:
            await _send_json(stream, 400, _error_body("bad Content-Length", "bad_request"))
            return
        body = await reader.receive_exactly(length) if length else b""
        path = target.split("?", 1)[0]

        if method == "CONNECT":
            self.tunnels.append(target)
            if tunnelled:
                await _send_json(stream, 400, _error_body("no CONNECT inside a tunnel", "bad_request"))
            elif await _open_tunnel(stream, target, self.port):
                await self._serve_one(stream, reader, tunnelled=True)
            return
        if method == "GET" and path == "/v1/models":
            listing = {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "stub"}]}
            await _send_json(stream, 200, listing)
            return
        if path != "/v1/chat/completions":
            self.unrouted.append((method, path))
            await _send_json(stream, 404, _error_body(f"no route {method} {path}", "not_found"))
            return
        if method != "POST":
            await _send_json(
                stream, 405, _error_body(f"{method} is not allowed here; use POST", "bad_request")
            )
            return
        try:
            payload = json.loads(body)
        except ValueError as exc:
            await _send_json(
                stream, 400, _error_body(f"the body is not JSON: {exc}", "invalid_request_error")
            )
            return

        request = ReceivedRequest(
            index=len(self.requests),
            method=method,
            path=path,
            headers=headers,
            body=body,
            json=payload,
            disconnected=anyio.Event(),
        )
        self.requests.append(request)
        if request.index < len(self.script):
            reply = self.script[request.index]
        elif self.responder is not None:
            reply = self.responder(request)
        else:
            message = (
                f"stub chat server: request #{request.index + 1} is beyond the script "
                f"({len(self.script)} replies scripted)"
            )
            await _send_json(stream, 500, _error_body(message, "script_exhausted"))
            return
        model = payload.get("model", self.model) if isinstance(payload, dict) else self.model
        try:
            await _answer(stream, reader, reply, request.index, str(model), request.headers)
        except _ClientGone:
            request.disconnected.set()


@asynccontextmanager
async def serve_chat_completions(
    script: Iterable[ChatReply] = (),
    *,
    model: str = "stub-model",
    responder: Callable[[ReceivedRequest], ChatReply] | None = None,
) -> AsyncIterator[ChatCompletionsServer]:
    """Serve ``script`` on a free loopback port for the duration of the block; ``responder``, when
    given, answers every request beyond the script.

    Leaving the block stops the server and closes every connection still open (a stalled one included).
    """
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    server = ChatCompletionsServer(script, model=model, port=port, responder=responder)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, server._handle, tg, name="stub chat server")
        try:
            yield server
        finally:
            tg.cancel_scope.cancel()


async def _serve_connection(
    stream: anyio.abc.ByteStream,
    serve_one: Callable[[anyio.abc.ByteStream, BufferedByteReceiveStream], Awaitable[None]],
) -> None:
    """Serve one accepted connection with ``serve_one``, then close it (every stub server's handler)."""
    async with stream:
        reader = BufferedByteReceiveStream(stream)
        # The client going away mid-request or mid-response leaves nothing to answer.
        with contextlib.suppress(
            _ClientGone,
            anyio.EndOfStream,
            anyio.IncompleteRead,
            anyio.BrokenResourceError,
            anyio.ClosedResourceError,
        ):
            await serve_one(stream, reader)


async def _read_head_lines(reader: BufferedByteReceiveStream) -> tuple[str, str, dict[str, str]]:
    """An HTTP/1.x request line and headers: (method, target, lower-cased headers, repeats joined).
    ValueError when malformed (anyio.DelimiterNotFound for an overlong line)."""
    method, target, version = (await _read_line(reader)).split(" ")
    if not version.startswith("HTTP/1."):
        raise ValueError(f"unsupported protocol {version!r}")
    headers: dict[str, str] = {}
    for _ in range(_MAX_HEADERS):
        line = await _read_line(reader)
        if not line:
            break
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ValueError(f"malformed header line {line[:80]!r}")
        key = name.lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    else:
        raise ValueError(f"more than {_MAX_HEADERS} headers")
    return method, target, headers


async def read_request_head(reader: BufferedByteReceiveStream) -> tuple[str, str, dict[str, str], int]:
    """An HTTP/1.1 request head: (method, target, lower-cased headers, Content-Length). ValueError (or
    anyio.DelimiterNotFound, for an overlong line) when it is malformed or the body is chunked."""
    method, target, headers = await _read_head_lines(reader)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise ValueError("send the body with Content-Length")
    length = int(headers.get("content-length", "0"))
    if not 0 <= length <= _MAX_BODY:
        raise ValueError(f"bad Content-Length {length}")
    return method, target, headers, length


async def _read_line(reader: BufferedByteReceiveStream) -> str:
    raw = await reader.receive_until(b"\n", _MAX_LINE)
    return raw.rstrip(b"\r").decode("latin-1")


async def _open_tunnel(stream: anyio.abc.ByteStream, target: str, own_port: int) -> bool:
    """Answer a ``CONNECT``: open the tunnel when ``target`` is this server itself (True), else refuse it."""
    host, _, port = target.rpartition(":")
    if host in ("127.0.0.1", "localhost") and port == str(own_port):
        await _send(stream, b"HTTP/1.1 200 Connection established\r\n\r\n")
        return True
    message = f"this stub server tunnels to nowhere but itself, not to {target}"
    await _send_json(stream, 403, _error_body(message, "forbidden"))
    return False


def _error_body(message: str, error_type: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "code": None}}


def _status_line(status: int) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    return f"HTTP/1.1 {status} {reason}\r\n".encode("ascii")


async def _send(stream: anyio.abc.ByteStream, data: bytes) -> None:
    try:
        await stream.send(data)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
        raise _ClientGone from exc


async def _send_json(
    stream: anyio.abc.ByteStream, status: int, payload: Any, extra_headers: Mapping[str, str] | None = None
) -> None:
    await _send_body(stream, status, json.dumps(payload).encode(), "application/json", extra_headers)


async def _send_body(
    stream: anyio.abc.ByteStream,
    status: int,
    body: bytes,
    content_type: str,
    extra_headers: Mapping[str, str] | None = None,
) -> None:
    head = [f"Content-Type: {content_type}", f"Content-Length: {len(body)}", "Connection: close"]
    head += [f"{name}: {value}" for name, value in (extra_headers or {}).items()]
    await _send(
        stream, _status_line(status) + "".join(f"{line}\r\n" for line in head).encode() + b"\r\n" + body
    )


async def _send_stream_head(
    stream: anyio.abc.ByteStream, content_type: str = "text/event-stream; charset=utf-8"
) -> None:
    head = (
        f"Content-Type: {content_type}\r\n"
        "Cache-Control: no-cache\r\n"
        "Transfer-Encoding: chunked\r\n"
        "Connection: close\r\n\r\n"
    )
    await _send(stream, _status_line(200) + head.encode())


async def _send_chunk(stream: anyio.abc.ByteStream, payload: bytes) -> None:
    """One HTTP chunk (an empty payload would end the body, so it is not sent)."""
    if payload:
        await _send(stream, f"{len(payload):x}\r\n".encode() + payload + b"\r\n")


async def _send_event(stream: anyio.abc.ByteStream, data: str) -> None:
    """One server-sent event, as one HTTP chunk."""
    await _send_chunk(stream, f"data: {data}\n\n".encode())


async def _wait_for_disconnect(reader: BufferedByteReceiveStream) -> None:
    """Hang until the client closes its end, discarding anything it still sends; then report it gone."""
    try:
        while True:
            await reader.receive()
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
        raise _ClientGone from exc


async def _pause_unless_gone(reader: BufferedByteReceiveStream, seconds: float) -> None:
    """Wait ``seconds``; report the client gone if it hangs up meanwhile (a trickle to nobody ends)."""
    with anyio.move_on_after(seconds):
        await _wait_for_disconnect(reader)


def _finish_reason(reason: FinishReasonText, tool_calls: Sequence[ToolCallReply]) -> str | None:
    if reason == "auto":
        return "tool_calls" if tool_calls else "stop"
    return reason


def _chunk(index: int, model: str, delta: Mapping[str, Any] | None, finish: str | None = None) -> str:
    choices = [] if delta is None else [{"index": 0, "delta": dict(delta), "finish_reason": finish}]
    return json.dumps(
        {
            "id": f"chatcmpl-stub-{index + 1}",
            "object": "chat.completion.chunk",
            "created": _CREATED,
            "model": model,
            "choices": choices,
        }
    )


def _stream_events(reply: StreamedReply, index: int, model: str) -> list[str]:
    events = [_chunk(index, model, {"role": "assistant", "content": ""})]
    events += [_chunk(index, model, {"content": piece}) for piece in _as_pieces(reply.text, reply.chunks)]
    per_call: list[list[dict[str, Any]]] = []
    for position, call in enumerate(reply.tool_calls):
        header = {
            "index": position,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        pieces = [{"index": position, "function": {"arguments": piece}} for piece in call.argument_pieces]
        per_call.append([header, *pieces])
    if reply.interleave:
        ordered = [
            pieces[step]
            for step in range(max(map(len, per_call), default=0))
            for pieces in per_call
            if step < len(pieces)
        ]
    else:
        ordered = [piece for pieces in per_call for piece in pieces]
    events += [_chunk(index, model, {"tool_calls": [piece]}) for piece in ordered]
    finish = _finish_reason(reply.finish_reason, reply.tool_calls)
    if finish is not None:
        events.append(_chunk(index, model, {}, finish))
    if reply.usage is not None:
        usage_chunk = json.loads(_chunk(index, model, None))
        usage_chunk["usage"] = dict(reply.usage)
        events.append(json.dumps(usage_chunk))
    if reply.done:
        events.append("[DONE]")
    return events


def _completion_body(reply: JsonReply, index: int, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.full_arguments},
            }
            for call in reply.tool_calls
        ]
    body: dict[str, Any] = {
        "id": f"chatcmpl-stub-{index + 1}",
        "object": "chat.completion",
        "created": _CREATED,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": _finish_reason(reply.finish_reason, reply.tool_calls),
            }
        ],
    }
    if reply.usage is not None:
        body["usage"] = dict(reply.usage)
    return body


async def _answer(
    stream: anyio.abc.ByteStream,
    reader: BufferedByteReceiveStream,
    reply: ChatReply,
    index: int,
    model: str,
    request_headers: Mapping[str, str],
) -> None:
    if isinstance(reply, ErrorReply):
        headers = dict(reply.headers)
        if reply.retry_after is not None:
            retry_after = reply.retry_after
            headers["Retry-After"] = (
                str(retry_after)
                if isinstance(retry_after, str) or not math.isfinite(retry_after)
                else f"{retry_after:g}"
            )
        body = (
            reply.body.encode()
            if reply.body is not None
            else json.dumps(_error_body(reply.message_for(request_headers), reply.error_type)).encode()
        )
        await _send_body(stream, reply.status, body, "application/json", headers)
    elif isinstance(reply, JsonReply):
        await _send_json(stream, 200, _completion_body(reply, index, model))
    elif isinstance(reply, DropConnection):
        if reply.after_headers:
            await _send_stream_head(stream)
        # Returning closes the connection: the client gets no (more) response.
    elif isinstance(reply, StallReply):
        if reply.after_headers:
            await _send_stream_head(stream)
        await _wait_for_disconnect(reader)
    elif isinstance(reply, RawStream):
        await _send_stream_head(stream, reply.content_type)
        for piece in reply.pieces:
            if reply.pause:
                await _pause_unless_gone(reader, reply.pause)
            await _send_chunk(stream, piece.encode() if isinstance(piece, str) else piece)
        await _send(stream, b"0\r\n\r\n")
    elif isinstance(reply, MalformedChunk):
        await _send_stream_head(stream)
        await _send_event(stream, _chunk(index, model, {"role": "assistant", "content": ""}))
        for piece in reply.text_before:
            await _send_event(stream, _chunk(index, model, {"content": piece}))
        await _send_event(stream, reply.data)
        await _send_event(stream, "[DONE]")
        await _send(stream, b"0\r\n\r\n")
    else:
        await _send_stream_head(stream)
        events = _stream_events(reply, index, model)
        cut = reply.drop_after if reply.drop_after is not None else reply.stall_after
        for event in events[:cut]:
            await _send_event(stream, event)
        if reply.stall_after is not None:
            await _wait_for_disconnect(reader)
        elif reply.drop_after is None:
            await _send(stream, b"0\r\n\r\n")
        # With drop_after, returning closes the connection with the chunked body unterminated.
