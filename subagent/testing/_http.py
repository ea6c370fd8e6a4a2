"""What the stub model servers (chat completions, Anthropic Messages, Responses) share: HTTP/1.1, over h11.

A server subclasses :class:`StubServer` (or :class:`RecordingServer`, which records every request
first) and writes only its routes: it gets each request parsed (method, target, lower-cased headers,
body) and answers through an :class:`Exchange`, which writes a whole body, or a stream of HTTP chunks
and server-sent events, and can wait for the client to hang up. This module does the rest once for all:

* reading a request with h11, bounded: a head past :data:`MAX_HEAD_BYTES` is answered 431, a body past
  :data:`MAX_BODY_BYTES` 413, anything malformed 400, each with the server's own error body, and the
  rest of what the client sends drained before the close (no reset to lose the answer); the server
  goes on serving others. A chunked body is read whole, ``Expect: 100-continue`` is answered, a
  ``HEAD`` gets the head of its answer alone;
* ``CONNECT``, through :meth:`StubServer._connect`: a tunnel to the server itself is opened and the
  requests that come through it are served as plain HTTP; any other target is refused with 403;
* one request per connection: every response says ``Connection: close`` and the connection is closed
  after it (a tunnel's ``CONNECT`` aside), which lets a test read an answer until the end of stream;
* serving on a free loopback port for the duration of a block, :func:`serve_stub`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Generic, Self, TypeVar

import anyio
import anyio.abc
import h11

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_HEAD_BYTES",
    "ClientGone",
    "Exchange",
    "HttpRequest",
    "RecordedRequest",
    "RecordingServer",
    "StreamedText",
    "StubServer",
    "serve_stub",
]

MAX_HEAD_BYTES = 64 * 1024
"""The most a request line and its headers may take together; past it the client gets a 431."""

MAX_BODY_BYTES = 64 * 1024 * 1024
"""The most a request body may take; past it the client gets a 413 (before any of it is read when the
``Content-Length`` says so, else as soon as the chunks received pass it)."""

EVENT_STREAM = "text/event-stream; charset=utf-8"
"""The content type of a server-sent-event stream, as the real APIs send it."""

_READ_SIZE = 64 * 1024
"""The most one read from the socket asks for."""

_LINGER_SECONDS = 2.0
"""How long a connection refused mid-request still takes in what the client sends: closing it with unread
bytes would reset it, and the client could lose the error answer."""

_QUOTED_INPUT = 200
"""How many characters of the client's own bytes an error message quotes at the most."""


class ClientGone(Exception):
    """The client closed the connection while we were still answering."""


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """One request as read: ``headers`` has lower-cased names, a repeated header's values joined by
    ``", "``; ``body`` is whole (a chunked one decoded)."""

    method: str
    target: str
    headers: Mapping[str, str]
    body: bytes

    @property
    def path(self) -> str:
        """The target without its query."""
        return self.target.split("?", 1)[0]

    def json_or_none(self) -> Any:
        """The body parsed as JSON; None when it is empty or not JSON."""
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None


@dataclass(frozen=True, slots=True, eq=False)
class RecordedRequest:
    """A request as a server that records every request keeps it: ``json`` is the parsed body, None when
    it is not JSON; ``disconnected`` is set when the client hung up on the answer."""

    index: int
    method: str
    path: str
    headers: Mapping[str, str]
    json: Any
    disconnected: anyio.Event = field(repr=False)

    @property
    def tool_names(self) -> list[str]:
        """The names of the tools the request offers the model (tools without a name are left out)."""
        tools = self.json.get("tools") if isinstance(self.json, dict) else None
        if not isinstance(tools, list):
            return []
        return [str(tool["name"]) for tool in tools if isinstance(tool, dict) and "name" in tool]

    @classmethod
    def received(cls, request: HttpRequest, *, index: int, exchange: Exchange) -> Self:
        """The record of ``request``, the ``index``-th received, answered through ``exchange``."""
        return cls(
            index,
            request.method,
            request.path,
            request.headers,
            request.json_or_none(),
            exchange.disconnected,
        )


class StreamedText:
    """What a streamed reply of the Anthropic and Responses stubs shares: ``text``, given as pieces (one
    delta event each) or as one string, and ``stall_after``. A mixin for their frozen dataclasses, which
    call :meth:`_check_text_and_stall` in ``__post_init__``."""

    __slots__ = ()
    text: str | Sequence[str]
    stall_after: int | None

    def _check_text_and_stall(self) -> None:
        if not isinstance(self.text, str):
            object.__setattr__(self, "text", tuple(self.text))
        if self.stall_after is not None and self.stall_after < 0:
            raise ValueError(f"stall_after must be >= 0, got {self.stall_after}")

    @property
    def text_pieces(self) -> tuple[str, ...]:
        """The text as streamed, one piece per delta event (none for an empty string)."""
        if isinstance(self.text, str):
            return (self.text,) if self.text else ()
        return tuple(self.text)


class _TooLarge(Exception):
    """The request body is larger than :data:`MAX_BODY_BYTES`."""


class Exchange:
    """One request and its answer on a connection: reads the request, writes the response through h11.
    Every write raises :class:`ClientGone` when the client has hung up."""

    def __init__(self, stream: anyio.abc.ByteStream, *, received: bytes, tunnelled: bool) -> None:
        self._stream = stream
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        if received:  # an empty receive_data would mean the end of stream to h11
            self._h11.receive_data(received)
        self._head_only = False  # the answer to a HEAD is its head alone: h11 refuses any byte of body
        self.tunnelled = tunnelled
        """Whether this request came through a tunnel this server opened."""
        self.disconnected = anyio.Event()
        """Set when the client hung up before the answer was complete."""

    async def send_body(
        self, status: int, body: bytes, content_type: str, headers: Mapping[str, str] | None = None
    ) -> None:
        """A whole response: ``status``, ``body`` with its length, ``headers`` added as given."""
        head = {"Content-Type": content_type, "Content-Length": str(len(body)), **(headers or {})}
        await self._send(self._response(status, head), h11.Data(data=body), h11.EndOfMessage())

    async def send_json(self, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
        """A whole ``application/json`` response."""
        await self.send_body(status, json.dumps(payload).encode(), "application/json", headers)

    async def start_stream(self, content_type: str = EVENT_STREAM) -> None:
        """A ``200`` whose body follows in HTTP chunks (:meth:`send_chunk`, :meth:`send_event`)."""
        await self._send(self._response(200, {"Content-Type": content_type, "Cache-Control": "no-cache"}))

    async def send_chunk(self, data: bytes) -> None:
        """One HTTP chunk of a stream (an empty one would end the body, so it is not sent)."""
        await self._send(h11.Data(data=data))

    async def send_event(self, data: str, name: str | None = None) -> None:
        """One server-sent event, as one HTTP chunk: ``event: <name>`` when named, then ``data: <data>``."""
        named = f"event: {name}\n" if name is not None else ""
        await self.send_chunk(f"{named}data: {data}\n\n".encode())

    async def send_event_stream(
        self,
        events: Sequence[tuple[str | None, str]],
        *,
        stall_after: int | None = None,
        drop_after: int | None = None,
    ) -> None:
        """A ``200`` server-sent-event stream of ``(name, data)`` events (see :meth:`send_event`), then its
        end. ``stall_after=N`` sends the first N events and hangs until the client hangs up;
        ``drop_after=N`` sends the first N and returns with the body unterminated (closing the connection
        then cuts it short, as a crashed server does)."""
        await self.start_stream()
        cut = drop_after if drop_after is not None else stall_after
        for name, data in events[:cut]:
            await self.send_event(data, name)
        if stall_after is not None:
            await self.wait_for_disconnect()
        if drop_after is None:
            await self.end_stream()

    async def end_stream(self) -> None:
        """The last (empty) chunk of a stream. Returning without it leaves the body cut short."""
        await self._send(h11.EndOfMessage())

    async def wait_for_disconnect(self) -> None:
        """Hang until the client closes its end, discarding anything it still sends; then raise
        :class:`ClientGone`."""
        try:
            while True:
                await self._stream.receive(_READ_SIZE)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise ClientGone from exc

    async def pause_unless_gone(self, seconds: float) -> None:
        """Wait ``seconds``; raise :class:`ClientGone` if the client hangs up meanwhile."""
        with anyio.move_on_after(seconds):
            await self.wait_for_disconnect()

    async def linger(self) -> None:
        """After an answer sent before the request was read whole: say so (end of our side), then read and
        discard what the client still sends, until it closes or :data:`_LINGER_SECONDS` pass."""
        with anyio.move_on_after(_LINGER_SECONDS), contextlib.suppress(ClientGone, anyio.BrokenResourceError):
            await self._stream.send_eof()
            await self.wait_for_disconnect()

    @property
    def switched(self) -> bool:
        """Whether the answer opened a tunnel: what follows on the connection is no longer this exchange's."""
        return self._h11.our_state is h11.SWITCHED_PROTOCOL

    @property
    def unread(self) -> bytes:
        """What the client sent past this request: after a tunnel opened, what went into it so far."""
        return self._h11.trailing_data[0]

    async def open_tunnel(self) -> None:
        """Answer a ``CONNECT`` with ``200 Connection established``: the connection becomes a tunnel."""
        await self._send(h11.Response(status_code=200, reason=b"Connection established", headers=[]))

    async def read_request(self) -> HttpRequest | None:
        """The request, read whole; None when the client closed the connection before sending one.
        Raises h11.RemoteProtocolError when it is malformed (or its head too long), _TooLarge when its
        body is."""
        head = await self._next_event()
        if not isinstance(head, h11.Request):
            return None
        self._head_only = head.method == b"HEAD"
        headers: dict[str, str] = {}
        for raw_name, raw_value in head.headers:
            name, value = raw_name.decode("ascii"), raw_value.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        declared = headers.get("content-length")
        if declared is not None and int(declared) > MAX_BODY_BYTES:  # h11 checked it is digits
            raise _TooLarge
        if self._h11.they_are_waiting_for_100_continue:
            await self._send(h11.InformationalResponse(status_code=100, reason=b"Continue", headers=[]))
        body = bytearray()
        while isinstance(event := await self._next_event(), h11.Data):
            body += event.data
            if len(body) > MAX_BODY_BYTES:
                raise _TooLarge
        if not isinstance(event, h11.EndOfMessage):  # h11 raises first on a cut body: a guard only
            raise h11.RemoteProtocolError("the request ended before its body", 400)
        return HttpRequest(head.method.decode("ascii"), head.target.decode("ascii"), headers, bytes(body))

    async def _next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        """The next event h11 reads, reading from the socket until there is one (never NEED_DATA)."""
        while (event := self._h11.next_event()) is h11.NEED_DATA:
            try:
                data = await self._stream.receive(_READ_SIZE)
            except anyio.EndOfStream:
                data = b""  # h11's sign of the end of stream
            self._h11.receive_data(data)
        return event

    def _response(self, status: int, headers: Mapping[str, str]) -> h11.Response:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
        head = [*headers.items(), ("Connection", "close")]
        return h11.Response(status_code=status, reason=reason.encode("ascii"), headers=head)

    async def _send(
        self, *events: h11.Response | h11.InformationalResponse | h11.Data | h11.EndOfMessage
    ) -> None:
        data = b"".join(
            self._h11.send(event) for event in events if not (self._head_only and isinstance(event, h11.Data))
        )
        if not data:
            return
        try:
            await self._stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise ClientGone from exc


class StubServer:
    """What the three stub servers share: the port, the tunnels asked for, and the connection handler."""

    def __init__(self, *, port: int) -> None:
        self.port = port
        self.tunnels: list[str] = []
        """The target (``host:port``) of every ``CONNECT``: see :meth:`_connect`."""

    @property
    def origin(self) -> str:
        """``http://127.0.0.1:PORT``: where the server listens."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The base URL a client of the API is given: the origin, unless the API says otherwise."""
        return self.origin

    async def _answer(self, request: HttpRequest, exchange: Exchange) -> None:
        """Answer one request: the server's routes."""
        raise NotImplementedError

    def _error_body(self, message: str, error_type: str) -> Any:
        """The body of an error this module answers, in the server's API's own shape; ``error_type`` is
        one of ``bad_request``, ``forbidden``, ``request_too_large``."""
        raise NotImplementedError

    async def _connect(self, request: HttpRequest, exchange: Exchange) -> None:
        """Answer a ``CONNECT`` (listed in :attr:`tunnels`): open the tunnel when the target is this
        server itself, refuse any other with 403, and one inside a tunnel with 400."""
        self.tunnels.append(request.target)
        host, _, port = request.target.rpartition(":")
        if exchange.tunnelled:
            await exchange.send_json(400, self._error_body("no CONNECT inside a tunnel", "bad_request"))
        elif host in ("127.0.0.1", "localhost") and port == str(self.port):
            await exchange.open_tunnel()
        else:
            message = f"this stub server tunnels to nowhere but itself, not to {request.target}"
            await exchange.send_json(403, self._error_body(message, "forbidden"))

    async def _handle(self, stream: anyio.abc.ByteStream) -> None:
        """Serve one accepted connection, then close it."""
        async with stream:
            # The client going away mid-request or mid-response leaves nothing to answer.
            with contextlib.suppress(ClientGone, anyio.BrokenResourceError, anyio.ClosedResourceError):
                await self._serve(stream, received=b"", tunnelled=False)

    async def _serve(self, stream: anyio.abc.ByteStream, *, received: bytes, tunnelled: bool) -> None:
        exchange = Exchange(stream, received=received, tunnelled=tunnelled)
        try:
            request = await exchange.read_request()
        except h11.RemoteProtocolError as exc:
            message = f"bad request: {str(exc)[:_QUOTED_INPUT]}"
            error_type = "request_too_large" if exc.error_status_hint == 431 else "bad_request"
            await exchange.send_json(exc.error_status_hint, self._error_body(message, error_type))
            await exchange.linger()
            return
        except _TooLarge:
            message = f"the body is larger than {MAX_BODY_BYTES} bytes"
            await exchange.send_json(413, self._error_body(message, "request_too_large"))
            await exchange.linger()
            return
        if request is None:
            return
        try:
            await self._answer(request, exchange)
        except ClientGone:
            exchange.disconnected.set()
            return
        if exchange.switched:
            await self._serve(stream, received=exchange.unread, tunnelled=True)


_Request = TypeVar("_Request", bound=RecordedRequest)


class RecordingServer(StubServer, Generic[_Request]):
    """A stub server that records every request it reads, whatever its route, before answering it."""

    def __init__(self, request_type: type[_Request], *, port: int) -> None:
        super().__init__(port=port)
        self._request_type = request_type
        self.requests: list[_Request] = []
        """Every request received, in arrival order, whatever its route (a ``CONNECT`` too)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r}, requests={len(self.requests)})"

    async def _route(self, request: _Request, exchange: Exchange) -> None:
        """Answer one request, recorded already (a ``CONNECT`` is answered before this)."""
        raise NotImplementedError

    async def _answer(self, request: HttpRequest, exchange: Exchange) -> None:
        recorded = self._request_type.received(request, index=len(self.requests), exchange=exchange)
        self.requests.append(recorded)
        if request.method == "CONNECT":
            await self._connect(request, exchange)
        else:
            await self._route(recorded, exchange)


_Server = TypeVar("_Server", bound=StubServer)


@asynccontextmanager
async def serve_stub(make: Callable[[int], _Server], name: str) -> AsyncIterator[_Server]:
    """Serve the server ``make(port)`` on a free loopback port for the duration of the block.

    Leaving the block stops the server and closes every connection still open (a stalled one included).
    """
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    server = make(listener.extra(anyio.abc.SocketAttribute.local_port))
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, server._handle, tg, name=name)
        try:
            yield server
        finally:
            tg.cancel_scope.cancel()
