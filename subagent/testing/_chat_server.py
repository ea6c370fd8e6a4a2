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
nothing else.

HTTP/1.1 is read and written with h11 (`subagent.testing._http`, shared by the three stub servers): a
request head is bounded (431 past it), so is a body (413), a malformed request gets a 400; every
response carries ``Connection: close`` and the connection is closed after it.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from subagent.testing._http import Exchange, HttpRequest, StubServer, serve_stub

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

_CREATED = 1_700_000_000
"""The ``created`` timestamp of every completion: fixed, so scripted chunks are the same on every run."""

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


class ChatCompletionsServer(StubServer):
    """The running stub server: where it listens and what it received. See :func:`serve_chat_completions`."""

    def __init__(
        self,
        script: Iterable[ChatReply],
        *,
        model: str,
        port: int,
        responder: Callable[[ReceivedRequest], ChatReply] | None = None,
    ) -> None:
        super().__init__(port=port)
        self.script: list[ChatReply] = list(script)
        """The replies, in order; append to it to script more while the server runs."""
        self.model = model
        self.responder = responder
        """Answers each request beyond the script, when given."""
        self.requests: list[ReceivedRequest] = []
        """Every chat-completions request received, in arrival order (one per script entry used)."""
        self.unrouted: list[tuple[str, str]] = []
        """``(method, path)`` of every request to a route the server does not know (answered 404)."""

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL: ``http://127.0.0.1:PORT/v1``."""
        return f"{self.origin}/v1"

    def __repr__(self) -> str:
        served, scripted = len(self.requests), len(self.script)
        return f"ChatCompletionsServer({self.base_url!r}, served={served}, scripted={scripted})"

    def _error_body(self, message: str, error_type: str) -> dict[str, Any]:
        return openai_error_body(message, error_type)

    async def _answer(self, request: HttpRequest, exchange: Exchange) -> None:
        method, path = request.method, request.path
        if method == "CONNECT":
            await self._connect(request, exchange)
            return
        if method == "GET" and path == "/v1/models":
            listing = {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "stub"}]}
            await exchange.send_json(200, listing)
            return
        if path != "/v1/chat/completions":
            self.unrouted.append((method, path))
            await exchange.send_json(404, openai_error_body(f"no route {method} {path}", "not_found"))
            return
        if method != "POST":
            message = f"{method} is not allowed here; use POST"
            await exchange.send_json(405, openai_error_body(message, "bad_request"))
            return
        try:
            payload = json.loads(request.body)
        except ValueError as exc:
            message = f"the body is not JSON: {exc}"
            await exchange.send_json(400, openai_error_body(message, "invalid_request_error"))
            return

        received = ReceivedRequest(
            index=len(self.requests),
            method=method,
            path=path,
            headers=request.headers,
            body=request.body,
            json=payload,
            disconnected=exchange.disconnected,
        )
        self.requests.append(received)
        if received.index < len(self.script):
            reply = self.script[received.index]
        elif self.responder is not None:
            reply = self.responder(received)
        else:
            message = (
                f"stub chat server: request #{received.index + 1} is beyond the script "
                f"({len(self.script)} replies scripted)"
            )
            await exchange.send_json(500, openai_error_body(message, "script_exhausted"))
            return
        model = payload.get("model", self.model) if isinstance(payload, dict) else self.model
        await _send_reply(exchange, reply, received.index, str(model), received.headers)


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

    def make(port: int) -> ChatCompletionsServer:
        return ChatCompletionsServer(script, model=model, port=port, responder=responder)

    async with serve_stub(make, "stub chat server") as server:
        yield server


def openai_error_body(message: str, error_type: str) -> dict[str, Any]:
    """An OpenAI-style error body: ``{"error": {"message", "type", "code": null}}``."""
    return {"error": {"message": message, "type": error_type, "code": None}}


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


async def _send_reply(
    exchange: Exchange, reply: ChatReply, index: int, model: str, request_headers: Mapping[str, str]
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
            else json.dumps(openai_error_body(reply.message_for(request_headers), reply.error_type)).encode()
        )
        await exchange.send_body(reply.status, body, "application/json", headers)
    elif isinstance(reply, JsonReply):
        await exchange.send_json(200, _completion_body(reply, index, model))
    elif isinstance(reply, DropConnection):
        if reply.after_headers:
            await exchange.start_stream()
        # Returning closes the connection: the client gets no (more) response.
    elif isinstance(reply, StallReply):
        if reply.after_headers:
            await exchange.start_stream()
        await exchange.wait_for_disconnect()
    elif isinstance(reply, RawStream):
        await exchange.start_stream(reply.content_type)
        for piece in reply.pieces:
            if reply.pause:
                await exchange.pause_unless_gone(reply.pause)
            await exchange.send_chunk(piece.encode() if isinstance(piece, str) else piece)
        await exchange.end_stream()
    elif isinstance(reply, MalformedChunk):
        role = _chunk(index, model, {"role": "assistant", "content": ""})
        texts = [_chunk(index, model, {"content": piece}) for piece in reply.text_before]
        await exchange.send_event_stream([(None, data) for data in (role, *texts, reply.data, "[DONE]")])
    else:
        events = [(None, data) for data in _stream_events(reply, index, model)]
        await exchange.send_event_stream(events, stall_after=reply.stall_after, drop_after=reply.drop_after)
