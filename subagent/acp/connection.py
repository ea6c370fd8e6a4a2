"""A bidirectional JSON-RPC 2.0 connection over a pair of anyio byte streams. It knows no ACP method.

Wire format: one JSON message per line, UTF-8, terminated by `\\n` (a trailing `\\r` and blank lines are
tolerated). Both peers send requests. Our outgoing ids are integers counting from 0; the peer's requests
live in a separate id space (real agents also count from 0), so the two never collide. Method names are
strings and params/results stay opaque: the envelope is decoded with `msgspec.Raw` for params, result and
error data, and each caller decides what type to decode into.

Tasks inside `Connection.run()`:

* the **reader** reads chunks, splits lines, resolves responses, queues notifications and starts one task
  per incoming request. It never awaits user code, so a slow handler cannot stall it (it only pauses for
  a notifier that is far behind, see Limits). A line longer than `max_line_bytes` is skipped up to the
  next newline, buffering at most `max_line_bytes` of it; a line that is not a valid message is skipped
  (see Broken lines). Both are logged and reported to `on_protocol_error`, and the connection goes on.
* the **writer** is the only task that touches the send stream: each message is handed over as a whole
  line and written with one `send`, so concurrent senders never interleave bytes, and a caller cancelled
  mid-write can never leave half a line on the wire.
* the **notifier** runs the notification handler on one notification at a time, in arrival order.
* one task per **incoming request**; `$/cancel_request` {requestId} cancels it and it answers -32800.

Ordering guarantee: `request()` returns only after every notification that arrived before its response
has been handled (so a `session/prompt` result never overtakes the `session/update` chunks sent before
it). A notification handler that itself awaits a `request()` is exempt, or it would wait for itself.

Broken lines: no line can break the connection, and none leaves a caller waiting.

* A string with a lone UTF-16 surrogate escape (``"\\ud83d"``: valid JSON, which `JSON.stringify` emits and
  msgspec refuses) is taken with U+FFFD in its place; only after a failed decode, so the hot path pays
  nothing. An escaped backslash before ``u`` is left alone, and valid surrogate pairs survive.
* JSON nested deeper than msgspec goes (it counts against the recursion limit, about 1,000 levels) is a
  -32600 "nested too deeply"; msgspec's RecursionError never escapes the reader.
* A broken response (it has `result` or `error` and no `method`) fails the request of ours it answers
  at once with `InvalidResponseError` (also a response with neither result nor error), and is never
  answered itself, so two peers can never bounce errors at each other.
* Any other broken line that tries to be JSON-RPC (it starts with ``{``, or ``[`` then ``{`` or ``]``) is
  answered as JSON-RPC 2.0 says: -32700 when it is not JSON (or not UTF-8), -32600 when it is JSON but no
  valid message (a wrong ``jsonrpc``, an id that is a float, boolean, object or array, a request without
  `method`), with its id when the id can be read, else id null. The id is read from the line's top-level
  members by a small scanner that needs no valid JSON, so a truncated or too deep request still gets its
  answer. A line that is not UTF-8 is answered only when it is a request.
* A line that does not try to be JSON-RPC is only reported, never answered: agents print log lines on
  stdout ("Running migrations...", "[INFO] ready"), and an error reply to each would only send junk to a
  peer that may not read it. A JSON scalar is treated the same.
* Batches (JSON arrays) are not supported: each request in one that shows its id is answered -32600 (in
  one array, as a batch is answered); a batch with none (empty, notifications, junk) gets one -32600 with
  id null.
* An over-long line is answered from its head (the first bytes buffered before it was discarded): a
  request that shows its id gets -32600 naming the limit; a response to a request of ours fails it with
  `MessageTooLargeError` at once.

Limits: every buffer the peer can fill is bounded.

* A line: `max_line_bytes` (the reader's buffer). What we send: `max_send_bytes` (the peer's limit; ours
  by default): `request()`/`notify()` raise `MessageTooLargeError` before sending, and a handler's answer
  that long goes out as -32603 naming the limit, so neither side waits for a message that cannot arrive.
* The peer's requests in flight: `max_incoming_requests`; one more is refused at once with -32603 naming
  the limit (refused, not paused: pausing the reader would hold back the answers to our own requests).
* Notifications received but not yet handled: `max_queued_notification_bytes` (bytes of the reads they
  came in). Above it the reader stops reading, so the peer's writes block, until the notifier has caught
  up to half of it. Exempt: while the notification handler itself waits for the peer (a `request()`,
  whose answer only the reader can read, or a send) the reader keeps reading, or it would deadlock. A
  handler must not wait for other tasks that wait for the peer.
* Error replies sent by the reader (to broken lines and refused requests): at most 64 (and 1 MiB) in
  flight; beyond that, from a peer flooding garbage without reading its answers, they are dropped.

Closing: EOF, a broken stream, or `close()` fail every pending request at once with a
`ConnectionClosedError`, and every later `request()`/`notify()` fails with it immediately. Incoming
request handlers are cancelled. On EOF the notifications already received are still delivered (the
peer's last words); `close()` stops everything. With `drain_on_eof`, EOF means only "the peer sends
no more": pending and later requests of ours fail at once (no answer can come), but the peer's
requests already in flight may finish, for up to that many seconds, and their answers (and any
notifications their handlers send) still go out before the connection closes.
The connection never closes the streams: their owner does (for a child process, closing its stdin is
the first step of teardown).
`ConnectionClosedError.cause` carries the reason; the process layer adds exit status and stderr tail.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias, TypedDict, TypeVar, Union, overload

import anyio
import anyio.abc
import msgspec

from subagent.acp._errors import (
    ConnectionClosedError,
    InvalidResponseError,
    MalformedMessageError,
    MessageTooLargeError,
    ProtocolError,
    RequestError,
    RpcErrorCode,
    UnexpectedResponseError,
)

if TYPE_CHECKING:
    from types import TracebackType

    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = [
    "CANCEL_REQUEST_METHOD",
    "COURTESY_CANCEL_TIMEOUT",
    "DEFAULT_MAX_INCOMING_REQUESTS",
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_MAX_QUEUED_NOTIFICATION_BYTES",
    "Connection",
    "ConnectionOptions",
    "ConnectionStatistics",
    "NotificationHandler",
    "Params",
    "ProtocolErrorCallback",
    "RequestHandler",
    "RequestId",
    "decode_params",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

RequestId: TypeAlias = "int | str | None"
"""An incoming request's id as the peer chose it (ours are always `int`)."""

Params: TypeAlias = "msgspec.Struct | dict[str, Any] | list[Any] | msgspec.Raw | None"
"""Outgoing params: a msgspec Struct, a dict, a list, pre-encoded `msgspec.Raw`, or None to omit `params`."""

RequestHandler: TypeAlias = "Callable[[str, msgspec.Raw | None], Awaitable[Any]]"
"""`await handler(method, params)` returns the result (anything msgspec encodes) or raises `RequestError`."""

NotificationHandler: TypeAlias = "Callable[[str, msgspec.Raw | None], Awaitable[None] | None]"
"""`await handler(method, params)`, called one notification at a time in arrival order."""

ProtocolErrorCallback: TypeAlias = "Callable[[ProtocolError], None]"
"""Called synchronously by the reader for every protocol error it skips; it must not raise or block."""

CANCEL_REQUEST_METHOD: Final = "$/cancel_request"

DEFAULT_MAX_LINE_BYTES: Final = 64 * 1024 * 1024
"""The longest message (one line) read or sent, in bytes: file contents and tool outputs travel inline;
64 MiB fits any real message yet bounds a runaway line."""

DEFAULT_MAX_INCOMING_REQUESTS: Final = 256
"""How many of the peer's requests are served at once (one task each): a real peer has a handful in
flight, a runaway one is refused."""

DEFAULT_MAX_QUEUED_NOTIFICATION_BYTES: Final = 16 * 1024 * 1024
"""How far the reader may run ahead of a slow notification handler before it stops reading (and the peer's
writes block): far more than any burst of updates, far less than memory."""


class ConnectionOptions(TypedDict, total=False):
    """A `Connection`'s limits, reporting and name, as keyword arguments: what a protocol side built on
    a connection (the ACP agent side) passes on to it. Each is described, with its default, at
    `Connection`."""

    on_protocol_error: ProtocolErrorCallback | None
    max_line_bytes: int
    max_send_bytes: int | None
    max_incoming_requests: int
    max_queued_notification_bytes: int
    drain_on_eof: float
    name: str


COURTESY_CANCEL_TIMEOUT: Final = 1.0
"""The `$/cancel_request` sent for an abandoned request is best effort; a peer that has stopped reading must
not delay the caller's cancellation by more than this (seconds)."""

_ABANDONED_IDS_REMEMBERED: Final = 1024
"""How many ids of abandoned requests are remembered, so that a late answer to one is dropped quietly
rather than reported, in bounded memory."""

_EXCERPT_BYTES: Final = 120
"""Enough of a malformed line to recognise it (e.g. an agent logging to stdout), short enough for a log."""

_IDENTIFY_BYTES: Final = 64 * 1024
"""How much of a broken or over-long line is searched for its "id" and "method"; they come first in practice,
and the search is Python-level work on a line that already failed."""

_MAX_ERROR_REPLIES: Final = 64
"""How many error replies (to broken lines and refused requests) may be in flight at once; beyond this or
`_MAX_ERROR_REPLY_BYTES` (a flood of garbage from a peer that does not read its answers) they are dropped,
not queued without limit."""
_MAX_ERROR_REPLY_BYTES: Final = 1024 * 1024
"""How many bytes the error replies in flight may hold together (see `_MAX_ERROR_REPLIES`)."""

_MAX_BATCH_ERRORS: Final = 1024
"""The most requests of a batch that the error reply to it names (batches are not supported)."""

_JSONRPC: Final = "2.0"

_in_notification_handler: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "_in_notification_handler", default=False
)


class _Envelope(msgspec.Struct):
    """Any incoming message; which members are present decides what it is."""

    jsonrpc: str | msgspec.UnsetType = msgspec.UNSET
    id: int | str | msgspec.UnsetType | None = msgspec.UNSET
    method: str | msgspec.UnsetType = msgspec.UNSET
    params: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    result: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    error: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class _WireError(msgspec.Struct):
    code: int
    message: str
    data: Any = msgspec.UNSET


class _CancelParams(msgspec.Struct):
    requestId: int | str | None


class _OutRequest(msgspec.Struct):
    jsonrpc: str
    id: int
    method: str
    params: Any = msgspec.UNSET


class _OutNotification(msgspec.Struct):
    jsonrpc: str
    method: str
    params: Any = msgspec.UNSET


class _OutResult(msgspec.Struct):
    jsonrpc: str
    id: int | str | None
    result: Any


class _OutError(msgspec.Struct):
    jsonrpc: str
    id: int | str | None
    error: _WireError


_NotificationBatch: TypeAlias = "list[tuple[str, Any]]"
"""Notifications parsed from one read, handed to the notifier together."""

_QueuedBatch: TypeAlias = "tuple[_NotificationBatch, int]"
"""A batch and the bytes of the read it came from (what it keeps in memory, at most)."""

_ENVELOPE_DECODER: Final = msgspec.json.Decoder(_Envelope)
_BATCH_DECODER: Final = msgspec.json.Decoder(list[msgspec.Raw])
_WIRE_ERROR_DECODER: Final = msgspec.json.Decoder(_WireError)
_CANCEL_PARAMS_DECODER: Final = msgspec.json.Decoder(_CancelParams)
_NULL_RESULT: Final = msgspec.Raw(b"null")


@dataclass(frozen=True, slots=True)
class ConnectionStatistics:
    """A snapshot of a connection's state, for tests, debugging and metrics."""

    pending_requests: int
    """Our requests still waiting for a response."""
    incoming_requests: int
    """The peer's requests whose handlers are still running."""
    queued_notifications: int
    """Notifications received but not yet handled."""
    queued_notification_bytes: int
    """Bytes of the reads whose notifications are not yet all handled (the reader pauses above its bound)."""
    read_buffer_bytes: int
    """Bytes of an incomplete line held by the reader (never much more than `max_line_bytes`)."""
    protocol_errors: int
    """Protocol errors reported so far (malformed, oversized and unexpected messages)."""
    closed: bool


@dataclass(slots=True, eq=False)
class _Pending:
    """One outgoing request waiting for its response."""

    method: str
    done: anyio.Event = field(default_factory=anyio.Event)
    result: msgspec.Raw = field(default_factory=lambda: _NULL_RESULT)  # Raw is unhashable: no plain default
    error: RequestError | ConnectionClosedError | InvalidResponseError | MessageTooLargeError | None = None
    notifications_before: int = 0
    """How many notifications had arrived when the response did: the caller waits until these are handled."""


def decode_params(params: msgspec.Raw | None, params_type: type[T]) -> T:
    """Decode a request handler's `params` (None reads as JSON `null`) into `params_type`.

    Raises:
        RequestError: -32602 `Invalid params`, with msgspec's validation message as `data.details`.
    """
    try:
        return msgspec.json.decode(b"null" if params is None else params, type=params_type)
    except msgspec.ValidationError as exc:
        raise RequestError.invalid_params({"details": str(exc)}) from exc
    except RecursionError as exc:
        raise RequestError.invalid_params({"details": "nested too deeply"}) from exc


@functools.lru_cache(maxsize=16)
def _typed_notification_decoder(
    types: tuple[tuple[str, type[msgspec.Struct]], ...],
) -> tuple[msgspec.json.Decoder[Any] | None, msgspec.json.Decoder[Any] | None, dict[type, str]]:
    """Decoders for whole notification lines of the given methods (one line, and a JSON array of
    lines), as a union tagged by `method`, and the method of each member type (msgspec does not
    keep the tag as an attribute). Cached: every connection of a client shares one set, rather than
    making new classes per connection (measured by the soak benchmark: ~1.5 MiB pinned by typing's
    caches, ~31 us per spawn)."""
    if not types:
        return None, None, {}
    members = tuple(
        msgspec.defstruct(
            f"_Typed{index}",
            [
                ("jsonrpc", Literal["2.0"]),
                ("params", params_type),
                ("id", Any, msgspec.UNSET),
            ],
            tag_field="method",
            tag=method,
            gc=False,  # like the params it wraps: a tree, never part of a cycle
        )
        for index, (method, params_type) in enumerate(types)
    )
    methods = dict(zip(members, (method for method, _ in types), strict=True))
    union: Any = Union.__getitem__(members)  # a runtime union of types made above
    return msgspec.json.Decoder(union), msgspec.json.Decoder(list.__class_getitem__(union)), methods


def _is_utf8(line: bytes) -> bool:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -- reading what a broken line still shows ----------------------------------------------------------------
# These run only after a line failed to decode (or was too long), never on the hot path. Possessive
# quantifiers keep every pattern linear: no backtracking on a long or hostile line.

_STRING: Final = rb'"(?:[^"\\]++|\\.)*+"'
_KEY_PATTERN: Final = re.compile(rb"[ \t\r\n]*(" + _STRING + rb")[ \t\r\n]*:[ \t\r\n]*", re.DOTALL)
_SCALAR_PATTERN: Final = re.compile(_STRING + rb'|[^ \t\r\n,:{}\[\]"]++', re.DOTALL)
_SEPARATOR_PATTERN: Final = re.compile(rb"[ \t\r\n]*([,}])")
_OBJECT_START: Final = re.compile(rb"[ \t\r\n]*\{")
_FLAT_PATTERN: Final = re.compile(rb'(?:[^"{}\[\]]++|' + _STRING + rb")*+", re.DOTALL)
_OPENING_RUN: Final = re.compile(rb"[\[{]++")
_CLOSING_RUN: Final = re.compile(rb"[\]}]++")
_JSON_RPC_LOOKING: Final = re.compile(rb"[ \t\r\n]*(?:\{|\[[ \t\r\n]*[{\]])")
_SURROGATE_ESCAPES: Final = re.compile(
    rb"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[dD][89a-fA-F][0-9a-fA-F]{2}"
)
"""An escaped backslash, a valid surrogate pair, or a lone surrogate escape: matched left to right, so the `u`
after an escaped backslash (``\\\\ud83d``, a literal backslash) is never read as an escape."""
_REPLACEMENT_ESCAPE: Final = rb"\ufffd"
_OPEN_BRACKETS: Final = frozenset(b"[{")
_ID_DECODER: Final = msgspec.json.Decoder(Union[int, str, None])  # noqa: UP007  # a runtime type


def _replace_lone_surrogates(line: bytes) -> bytes:
    """`line` with every lone UTF-16 surrogate escape (valid JSON, which msgspec refuses) made U+FFFD."""

    def replace(match: re.Match[bytes]) -> bytes:
        escape = match[0]
        return _REPLACEMENT_ESCAPE if len(escape) == 6 else escape

    return _SURROGATE_ESCAPES.sub(replace, line)


def _looks_like_json_rpc(line: bytes) -> bool:
    """Whether `line` tries to be a JSON-RPC message: an object, or an array of objects (a batch).

    A log line an agent printed on stdout ("[INFO] ready", "Listening on 8080") does not: those are
    reported and skipped, never answered.
    """
    return _JSON_RPC_LOOKING.match(line) is not None


def _skip_nested(data: bytes, pos: int) -> int:
    """The index just past the array or object opening at `pos`, or -1 when `data` ends inside it."""
    depth = 0
    end = len(data)
    while True:
        found = _FLAT_PATTERN.match(data, pos)
        assert found is not None  # it matches the empty string
        pos = found.end()
        if pos >= end or data[pos] == 0x22:  # the end, or an unterminated string
            return -1
        if data[pos] in _OPEN_BRACKETS:
            run = _OPENING_RUN.match(data, pos)
            assert run is not None
            depth += run.end() - pos
        else:
            run = _CLOSING_RUN.match(data, pos)
            assert run is not None
            if run.end() - pos >= depth:
                return pos + depth
            depth -= run.end() - pos
        pos = run.end()


@dataclass(slots=True)
class _Identity:
    """What the top-level members of a broken line say about it."""

    has_id: bool = False
    request_id: RequestId = None
    """The id when `id_valid` (an integer, a string or null)."""
    id_valid: bool = False
    has_method: bool = False
    has_params: bool = False
    has_outcome: bool = False
    """A `result` or `error` member: the line is a response."""

    @property
    def is_response(self) -> bool:
        return self.has_outcome and not self.has_method


def _identify(data: bytes) -> _Identity:
    """Read the top-level members of a JSON object from `data`, which may be broken, truncated, too deep
    for msgspec, or not UTF-8. Nested values are skipped, not decoded; the search stops at the first
    thing it cannot read, and the members before it stand."""
    identity = _Identity()
    start = _OBJECT_START.match(data)
    if start is None:
        return identity
    pos = start.end()
    while True:
        key = _KEY_PATTERN.match(data, pos)
        if key is None:
            return identity
        name = key[1][1:-1]
        pos = key.end()
        value: bytes | None = None  # a scalar's text; None for an array or object
        if pos < len(data) and data[pos] in _OPEN_BRACKETS:
            end = _skip_nested(data, pos)
        else:
            scalar = _SCALAR_PATTERN.match(data, pos)
            end = -1 if scalar is None else scalar.end()
            value = None if scalar is None else scalar[0]
        separator = _SEPARATOR_PATTERN.match(data, end) if end >= 0 else None
        # A member is taken once its key is read; an id only once its value has visibly ended.
        if name == b"id":
            identity.has_id = True
            if value is not None and separator is not None:
                try:
                    identity.request_id = _ID_DECODER.decode(_replace_lone_surrogates(value))
                    identity.id_valid = True
                except msgspec.DecodeError:
                    identity.request_id, identity.id_valid = None, False
            else:
                identity.request_id, identity.id_valid = None, False
        elif name == b"method":
            identity.has_method = True
        elif name == b"params":
            identity.has_params = True
        elif name in (b"result", b"error"):
            identity.has_outcome = True
        if separator is None or separator[1] == b"}":
            return identity
        pos = separator.end()


class Connection:
    """A JSON-RPC 2.0 peer over `receive_stream`/`send_stream`: send requests and notifications, serve the
    peer's.

    Drive it with `async with Connection(...) as conn:` (it runs itself in a task group and closes on
    exit), or start `await task_group.start(conn.run)` and stop it with `conn.close()`.

    Args:
        receive_stream: where the peer's lines come from (e.g. the child's stdout).
        send_stream: where our lines go (e.g. the child's stdin).
        request_handler: serves the peer's requests; without one every request gets -32601. It raises
            `RequestError` to choose the error object, `msgspec.ValidationError` (or uses `decode_params`)
            for -32602; anything else becomes a bare -32603 and is logged here.
        notification_handler: receives the peer's notifications in order, one at a time; without one they
            are dropped. It may be a plain function (then it is not awaited) or return an awaitable (awaited
            before the next notification). Its exceptions are logged and never close the connection.
        on_protocol_error: told (synchronously, from the reader) about every line skipped as a protocol error.
        max_line_bytes: longer lines are discarded; memory for a line stays within this bound.
        max_send_bytes: the peer's line limit: a message of ours longer than this is refused before it is
            sent (`MessageTooLargeError`), and a handler's result that long is answered -32603 instead.
            Default: `max_line_bytes` (we assume the peer's limit equals ours).
        max_incoming_requests: how many of the peer's requests may be in flight (handled, or their answer
            being sent); one more is answered -32603 at once, naming the limit, and never runs.
        on_request_received: told (synchronously, from the reader) the method of each of the peer's
            requests as it arrives, in arrival order, before its handler task starts (tasks may start in
            another order: trio shuffles them). It may return a function, called once that request is
            over (answered, refused by its handler, cancelled, or the connection closed). Neither may
            raise or block.
        max_queued_notification_bytes: how far the reader may run ahead of the notification handler
            (bytes of the reads whose notifications wait); above it, the reader stops reading until the
            handler has caught up to half of it, so the peer's writes block. Not while the handler
            itself waits for the peer (see the module docstring).
        name: names this connection in log messages.
        typed_notifications: method -> params type for hot notifications (ACP: ``session/update``): such a
            line is decoded in one pass and the handler gets the typed params instead of `msgspec.Raw`.
            A line that does not fit (another message, or params the type rejects) takes the generic path,
            so the handler must accept raw params for these methods too.
        value_encoder: turns params and handler results (other than `msgspec.Raw` and None) into JSON
            bytes; a protocol layer passes its own encoder here (ACP: `schema.encode`). Without one,
            msgspec encodes them as they are.
        drain_on_eof: seconds the peer's requests in flight at EOF may take to finish and be answered
            (0: cancelled at once). For a server whose client writes its requests and then closes its
            end (a pipe): without it, those requests would never be answered.
    """

    def __init__(
        self,
        receive_stream: anyio.abc.ByteReceiveStream,
        send_stream: anyio.abc.ByteSendStream,
        *,
        request_handler: RequestHandler | None = None,
        notification_handler: NotificationHandler | None = None,
        on_protocol_error: ProtocolErrorCallback | None = None,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        name: str = "jsonrpc",
        value_encoder: Callable[[Any], bytes] | None = None,
        typed_notifications: Mapping[str, type[msgspec.Struct]] | None = None,
        drain_on_eof: float = 0.0,
        max_send_bytes: int | None = None,
        max_incoming_requests: int = DEFAULT_MAX_INCOMING_REQUESTS,
        max_queued_notification_bytes: int = DEFAULT_MAX_QUEUED_NOTIFICATION_BYTES,
        on_request_received: Callable[[str], Callable[[], None] | None] | None = None,
    ) -> None:
        if max_send_bytes is None:
            max_send_bytes = max_line_bytes
        for option, value in (
            ("max_line_bytes", max_line_bytes),
            ("max_send_bytes", max_send_bytes),
            ("max_incoming_requests", max_incoming_requests),
            ("max_queued_notification_bytes", max_queued_notification_bytes),
        ):
            if value < 1:
                raise ValueError(f"{option} must be positive, not {value}")
        self._max_send_bytes = max_send_bytes
        self._max_incoming_requests = max_incoming_requests
        self._max_queued_bytes = max_queued_notification_bytes
        self._on_request_received = on_request_received
        if not drain_on_eof >= 0:  # `not >=` also refuses NaN
            raise ValueError(f"drain_on_eof must be >= 0 seconds, not {drain_on_eof}")
        self._drain_on_eof = drain_on_eof
        self._receive_stream = receive_stream
        self._send_stream = send_stream
        self._request_handler = request_handler
        self._notification_handler = notification_handler
        self._on_protocol_error = on_protocol_error
        self._max_line_bytes = max_line_bytes
        self._name = name
        self._encoder = msgspec.json.Encoder()
        self._value_encoder = value_encoder
        self._typed_decoder, self._typed_list_decoder, self._typed_methods = _typed_notification_decoder(
            tuple((typed_notifications or {}).items())
        )

        self._started = False
        self._closed: ConnectionClosedError | None = None
        self._run_scope: anyio.CancelScope | None = None
        self._reader_scope: anyio.CancelScope | None = None
        self._handlers: anyio.abc.TaskGroup | None = None
        self._owned_task_group: anyio.abc.TaskGroup | None = None
        self._outgoing: MemoryObjectSendStream[bytes] | None = None
        self._outgoing_receive: MemoryObjectReceiveStream[bytes] | None = None
        self._notifications: MemoryObjectSendStream[_QueuedBatch] | None = None
        self._notification_batch: _NotificationBatch = []
        self._queued_bytes = 0  # bytes of the reads whose notifications wait for the notifier
        self._reader_resume: anyio.Event | None = None  # set to let a paused reader go on
        self._notifier_waiting_on_peer = 0  # the notification handler's own sends and requests in flight
        self._error_replies = 0  # error replies sent by the reader's tasks, in flight...
        self._error_reply_bytes = 0  # ...and their bytes

        self._next_id = 0
        self._pending: dict[int, _Pending] = {}
        self._abandoned: dict[int, None] = {}  # insertion-ordered set of recently abandoned ids
        self._incoming: dict[RequestId, anyio.CancelScope] = {}
        self._serving = 0  # the peer's requests not yet answered (handled, or their answer being sent)
        self._served_all: anyio.Event | None = None  # set when _serving drops to 0, while draining
        self._input_ended: ConnectionClosedError | None = None  # EOF seen; draining before the close
        self._read_buffer = bytearray()
        self._notifications_received = 0
        self._notifications_handled = 0
        self._notifier_finished = False
        self._barrier_waiters: dict[anyio.Event, int] = {}
        self._protocol_errors = 0

    def __repr__(self) -> str:
        state = "closed" if self._closed is not None else "running" if self._started else "new"
        counts = f"pending={len(self._pending)} incoming={len(self._incoming)}"
        return f"<Connection {self._name!r} {state} {counts}>"

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def __aenter__(self) -> Connection:
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        try:
            await task_group.start(self.run)
        except BaseException as exc:
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._owned_task_group = task_group
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        self.close()
        task_group, self._owned_task_group = self._owned_task_group, None
        assert task_group is not None, "__aexit__ without __aenter__"
        return await task_group.__aexit__(exc_type, exc, traceback)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve the connection until EOF, a broken stream, or `close()`; start it with `task_group.start`.

        Returns once everything it started has finished. A connection runs once.

        Raises:
            RuntimeError: if it was already started.
        """
        if self._started:
            raise RuntimeError(f"{self!r} was already started; a connection runs once")
        self._started = True
        if self._closed is not None:  # closed before it ever ran
            task_status.started()
            return
        self._outgoing, outgoing_receive = anyio.create_memory_object_stream[bytes](0)
        self._outgoing_receive = outgoing_receive
        # Unbounded in items: the reader bounds it in bytes by pausing (`_wait_for_notifier`), which it
        # must not do while the handler waits for the peer; a bound here would block it then.
        self._notifications, notifications_receive = anyio.create_memory_object_stream[_QueuedBatch](math.inf)
        try:
            with anyio.CancelScope() as self._run_scope:
                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(self._write_loop, outgoing_receive)
                    task_group.start_soon(self._notify_loop, notifications_receive)
                    async with anyio.create_task_group() as self._handlers:
                        task_status.started()
                        ended: ConnectionClosedError | None = None
                        with anyio.CancelScope() as self._reader_scope:
                            ended = await self._read_loop()
                        # None: the reader was stopped because the connection closed another way.
                        if ended is not None:
                            if ended.end_of_stream and self._drain_on_eof > 0:
                                await self._drain(ended)
                            self._close(ended)
        finally:
            self._close(ConnectionClosedError("the connection stopped"))
            outgoing_receive.close()
            notifications_receive.close()
            self._release_barrier_waiters()

    async def _drain(self, ended: ConnectionClosedError) -> None:
        """After EOF: let the peer's requests in flight finish and be answered, within the grace."""
        self._input_ended = ended
        self._fail_pending(ended)  # nothing more comes from the peer, so no answer to ours either
        if self._serving == 0:
            return
        logger.debug("%s: end of stream; draining %d request(s) in flight", self._name, self._serving)
        self._served_all = anyio.Event()
        with anyio.move_on_after(self._drain_on_eof):
            await self._served_all.wait()
            return
        logger.warning(
            "%s: %d request(s) still unanswered %.1f s after the end of stream; cancelling them",
            self._name,
            self._serving,
            self._drain_on_eof,
        )

    def _fail_pending(self, error: ConnectionClosedError) -> None:
        pending, self._pending = self._pending, {}
        for waiter in pending.values():
            waiter.error = error.copy()
            waiter.done.set()

    def close(self, cause: BaseException | None = None) -> None:
        """Close now: fail pending requests with `ConnectionClosedError(cause=cause)` and stop `run()`.

        Idempotent; a connection already closed (e.g. by EOF) keeps its first error. `cause` lets the
        owner say why, e.g. the child process's exit.
        """
        self._close(ConnectionClosedError("the connection was closed locally", cause=cause))
        if self._run_scope is not None:
            self._run_scope.cancel()

    @property
    def closed_error(self) -> ConnectionClosedError | None:
        """The error the connection closed with, or None while it is open."""
        return self._closed

    def statistics(self) -> ConnectionStatistics:
        """Return a snapshot of the connection's counters."""
        return ConnectionStatistics(
            pending_requests=len(self._pending),
            incoming_requests=len(self._incoming),
            queued_notifications=self._notifications_received - self._notifications_handled,
            queued_notification_bytes=self._queued_bytes,
            read_buffer_bytes=len(self._read_buffer),
            protocol_errors=self._protocol_errors,
            closed=self._closed is not None,
        )

    def _close(self, error: ConnectionClosedError) -> None:
        if self._closed is not None:
            return
        self._closed = error
        logger.debug("%s: closing: %s", self._name, error)
        self._fail_pending(error)
        if self._handlers is not None:
            self._handlers.cancel_scope.cancel()
        if self._reader_scope is not None:
            self._reader_scope.cancel()
        # Closing the writer's receive side wakes every task waiting to hand it a line.
        for stream in (self._outgoing, self._outgoing_receive, self._notifications):
            if stream is not None:
                stream.close()

    # -- sending -----------------------------------------------------------------------------------------

    @overload
    async def request(
        self, method: str, params: Params = None, *, courtesy_cancel: bool = True
    ) -> msgspec.Raw: ...

    @overload
    async def request(
        self, method: str, params: Params = None, *, result_type: type[T], courtesy_cancel: bool = True
    ) -> T: ...

    async def request(
        self,
        method: str,
        params: Params = None,
        *,
        result_type: type[Any] = msgspec.Raw,
        courtesy_cancel: bool = True,
    ) -> Any:
        """Send a request and wait for its result, decoded as `result_type` (default: the raw JSON).

        Pass `result_type=object` for plain Python objects. If the caller is cancelled, the request is
        forgotten (a late response is dropped) and, with `courtesy_cancel`, the peer is sent
        `$/cancel_request` {requestId} (best effort, bounded by `COURTESY_CANCEL_TIMEOUT`). Turn it off for
        methods cancelled another way (ACP's `session/prompt` is cancelled by `session/cancel`).

        Raises:
            RequestError: the peer answered with an error object.
            ConnectionClosedError: the connection closed before the response arrived, or was already closed.
            InvalidResponseError: the response could not be decoded as `result_type`, or had neither a
                result nor an error.
            MessageTooLargeError: the request is longer than `max_send_bytes` (`outgoing`; nothing was
                sent), or the peer's response was longer than `max_line_bytes` (discarded unread).
            TypeError, msgspec.EncodeError: `params` cannot be encoded (nothing was sent).
            RuntimeError: the connection was never started.
        """
        self._check_open()
        if self._input_ended is not None:
            raise self._input_ended.copy()  # draining after EOF: the peer can no longer answer
        request_id = self._next_id
        line = self._encode_outgoing(_OutRequest(_JSONRPC, request_id, method, self._wire_params(params)))
        self._next_id += 1
        pending = _Pending(method)
        self._pending[request_id] = pending
        # A notification handler waiting for the peer: the reader must not pause for the notifier now.
        from_notifier = _in_notification_handler.get()
        if from_notifier:
            self._notifier_waits_on_peer(1)
        try:
            await self._send_line(line)
            await pending.done.wait()
        except anyio.get_cancelled_exc_class():
            if self._pending.pop(request_id, None) is not None:
                self._remember_abandoned(request_id)
                if courtesy_cancel:
                    await self._send_courtesy_cancel(request_id)
            raise
        finally:
            self._pending.pop(request_id, None)
            if from_notifier:
                self._notifier_waits_on_peer(-1)

        # Whatever the peer answered (result or error object), the notifications it sent before the
        # answer are handled first; only a closed connection fails at once.
        if not isinstance(pending.error, ConnectionClosedError) and (
            pending.notifications_before > self._notifications_handled and not _in_notification_handler.get()
        ):
            await self._wait_notifications_handled(pending.notifications_before)
        if pending.error is not None:
            raise pending.error
        if result_type is msgspec.Raw:
            return pending.result
        try:
            return msgspec.json.decode(pending.result, type=result_type)
        except msgspec.DecodeError as exc:
            raise InvalidResponseError(method, str(exc)) from exc

    async def notify(self, method: str, params: Params = None) -> None:
        """Send a notification; returns once the writer has taken it.

        Raises:
            ConnectionClosedError: the connection is closed.
            MessageTooLargeError: the notification is longer than `max_send_bytes` (nothing was sent).
            TypeError, msgspec.EncodeError: `params` cannot be encoded (nothing was sent).
            RuntimeError: the connection was never started.
        """
        self._check_open()
        line = self._encode_outgoing(_OutNotification(_JSONRPC, method, self._wire_params(params)))
        if _in_notification_handler.get():
            self._notifier_waits_on_peer(1)
            try:
                await self._send_line(line)
            finally:
                self._notifier_waits_on_peer(-1)
        else:
            await self._send_line(line)

    def _check_open(self) -> None:
        if self._closed is not None:
            raise self._closed.copy()
        if self._outgoing is None:
            raise RuntimeError(f"{self!r} is not running: use `async with` or start `run()` first")

    def _wire_params(self, params: Params) -> Any:
        return msgspec.UNSET if params is None else self._wire_value(params)

    def _wire_value(self, value: Any) -> Any:
        # A protocol layer may need its own encoding (e.g. tagged unions with internal tags); raw
        # JSON and null pass through untouched.
        if self._value_encoder is None or value is None or isinstance(value, msgspec.Raw):
            return value
        return msgspec.Raw(self._value_encoder(value))

    def _encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message) + b"\n"

    def _encode_outgoing(self, message: msgspec.Struct) -> bytes:
        """Encode a request or notification of ours, refusing one the peer would discard."""
        line = self._encoder.encode(message) + b"\n"
        if len(line) > self._max_send_bytes + 1:  # the peer's limit counts the line without its newline
            raise MessageTooLargeError(len(line) - 1, self._max_send_bytes, outgoing=True)
        return line

    def _notifier_waits_on_peer(self, delta: int) -> None:
        self._notifier_waiting_on_peer += delta
        if delta > 0 and self._reader_resume is not None:
            self._reader_resume.set()

    async def _send_line(self, line: bytes) -> None:
        """Hand one whole line to the writer task.

        Raises:
            ConnectionClosedError: the connection is closed.
        """
        assert self._outgoing is not None
        try:
            await self._outgoing.send(line)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise (self._closed or ConnectionClosedError()).copy() from None

    async def _send_courtesy_cancel(self, request_id: int) -> None:
        line = self._encode(_OutNotification(_JSONRPC, CANCEL_REQUEST_METHOD, {"requestId": request_id}))
        with anyio.CancelScope(shield=True), anyio.move_on_after(COURTESY_CANCEL_TIMEOUT):
            try:
                await self._send_line(line)
            except ConnectionClosedError:
                logger.debug("%s: no courtesy cancel for request %d: closed", self._name, request_id)

    def _remember_abandoned(self, request_id: int) -> None:
        self._abandoned[request_id] = None
        if len(self._abandoned) > _ABANDONED_IDS_REMEMBERED:
            del self._abandoned[next(iter(self._abandoned))]

    async def _write_loop(self, lines: MemoryObjectReceiveStream[bytes]) -> None:
        while True:
            try:
                line = await lines.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return
            try:
                await self._send_stream.send(line)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
                self._close(ConnectionClosedError("writing to the peer failed", cause=exc))
                return

    # -- receiving ---------------------------------------------------------------------------------------

    async def _read_loop(self) -> ConnectionClosedError:
        """Read lines until the stream ends; return the error to close the connection with."""
        buffer = self._read_buffer  # an incomplete line: never holds a newline
        limit = self._max_line_bytes
        skipped = 0  # > 0 while discarding the rest of an over-long line
        head = b""  # the start of the line being discarded, to tell whose it was
        while True:
            try:
                chunk = await self._receive_stream.receive()
            except anyio.EndOfStream:
                break
            except anyio.ClosedResourceError as exc:
                return ConnectionClosedError("the receive stream was closed locally", cause=exc)
            except anyio.BrokenResourceError as exc:
                return ConnectionClosedError("the receive stream broke", cause=exc)
            read = len(chunk)
            if skipped:
                newline = chunk.find(b"\n")
                if newline < 0:
                    skipped += len(chunk)
                    continue
                self._on_oversized(head, skipped + newline)
                skipped, head = 0, b""
                chunk = chunk[newline + 1 :]
            # Only the new bytes are searched, so a long line costs linear time; a chunk holding lines
            # is split in one C-level pass, the fast path for a stream of small updates.
            if b"\n" not in chunk:
                buffer += chunk
            else:
                if buffer:
                    read += len(buffer)
                    buffer += chunk
                    lines = bytes(buffer).split(b"\n")
                    buffer.clear()
                else:
                    lines = chunk.split(b"\n")
                buffer += lines.pop()
                self._take_lines(lines)
                self._flush_notifications(read)
                if self._queued_bytes > self._max_queued_bytes:
                    await self._wait_for_notifier()
            if len(buffer) > limit:
                logger.warning("%s: discarding a line longer than %d bytes", self._name, limit)
                skipped = len(buffer)
                head = bytes(buffer[:_IDENTIFY_BYTES])
                buffer.clear()
        if skipped:
            self._on_oversized(head, skipped)
        elif buffer:
            read = len(buffer)
            self._take_lines([bytes(buffer)])
            buffer.clear()
            self._flush_notifications(read)
        return ConnectionClosedError("the peer closed the connection (end of stream)", end_of_stream=True)

    async def _wait_for_notifier(self) -> None:
        """Stop reading while the notifier is far behind: the peer's writes block, memory stays bounded.

        Not while the notification handler waits for the peer itself (a `request()` whose answer only
        this reader can read, or a send the peer may be too blocked to take): that would deadlock.
        """
        resume_below = self._max_queued_bytes // 2
        while (
            self._queued_bytes > resume_below
            and self._notifier_waiting_on_peer == 0
            and not self._notifier_finished
        ):
            self._reader_resume = anyio.Event()
            try:
                await self._reader_resume.wait()
            finally:
                self._reader_resume = None

    def _take_lines(self, lines: list[bytes]) -> None:
        limit = self._max_line_bytes
        decode = _ENVELOPE_DECODER.decode
        batch = self._notification_batch  # not swapped until the reader flushes, after this returns
        handled_here = self._notification_handler is not None
        typed = self._typed_decoder.decode if self._typed_decoder is not None and handled_here else None
        typed_methods = self._typed_methods
        if typed is not None and len(lines) > 1 and self._closed is None and self._take_typed_run(lines):
            return
        for line in lines:
            if self._closed is not None:
                return
            if len(line) > limit:
                self._on_oversized(line[:_IDENTIFY_BYTES], len(line))
                continue
            if line[-1:] == b"\r":
                line = line[:-1]  # CRLF framing is tolerated
            if not line or line.isspace():
                continue
            # msgspec does not validate the UTF-8 of Raw members (params, result): check here, cheaply
            # for the common ASCII line.
            if not line.isascii() and not _is_utf8(line):
                self._take_broken(line, "not UTF-8", RpcErrorCode.PARSE_ERROR)
                continue
            if typed is not None:
                try:
                    notification = typed(line)
                except (msgspec.DecodeError, RecursionError):
                    pass  # not one of them, params the type rejects, or not JSON: the generic path decides
                else:
                    if notification.id is msgspec.UNSET:  # with an id it is a request: generic path
                        self._notifications_received += 1
                        batch.append((typed_methods[type(notification)], notification.params))
                        continue
            try:
                message = decode(line)
            except msgspec.ValidationError as exc:
                if line.lstrip()[:1] == b"[":
                    self._take_batch(line)
                else:
                    self._take_broken(line, f"not a JSON-RPC message: {exc}", RpcErrorCode.INVALID_REQUEST)
                continue
            except msgspec.DecodeError as exc:
                self._take_unparsed(line, str(exc))
                continue
            except RecursionError:
                # msgspec counts nesting against the interpreter's recursion limit (~1,000 levels).
                self._take_broken(line, "nested too deeply", RpcErrorCode.INVALID_REQUEST)
                continue
            method = message.method
            if message.jsonrpc != _JSONRPC:
                self._take_broken(line, 'the "jsonrpc" member is not "2.0"', RpcErrorCode.INVALID_REQUEST)
            elif isinstance(method, str):
                params = None if message.params is msgspec.UNSET else message.params
                if message.id is msgspec.UNSET:
                    if handled_here and method != CANCEL_REQUEST_METHOD:
                        self._notifications_received += 1  # the hot path of _on_notification, inlined
                        batch.append((method, params))
                    else:
                        self._on_notification(method, params)
                else:
                    self._on_request(message.id, method, params)
            elif message.id is not msgspec.UNSET:
                self._on_response(message.id, message, line)
            else:
                self._take_broken(
                    line, "neither a request, a notification nor a response", RpcErrorCode.INVALID_REQUEST
                )

    def _take_typed_run(self, lines: list[bytes]) -> bool:
        """Take ``lines`` in one decode when every one is a typed notification; else take nothing.

        A fast agent's read is hundreds of updates: one msgspec call for all of them saves the
        per-line work. Anything unusual (another message, an id, a blank, malformed or over-long
        line) returns False and the lines go through the per-line path, which handles it.
        """
        assert self._typed_list_decoder is not None
        joined = b"[" + b",".join(lines) + b"]"
        if len(joined) > self._max_line_bytes:
            return False
        try:
            decoded = self._typed_list_decoder.decode(joined)
        except (msgspec.DecodeError, RecursionError):
            return False
        # One element per line, or a line held two messages; and an id makes it a request.
        if len(decoded) != len(lines) or any(item.id is not msgspec.UNSET for item in decoded):
            return False
        methods = self._typed_methods
        self._notifications_received += len(decoded)
        self._notification_batch.extend([(methods[type(item)], item.params) for item in decoded])
        return True

    # -- lines that are not what they should be (never the hot path) ---------------------------------------

    def _take_unparsed(self, line: bytes, reason: str) -> None:
        """A line msgspec could not parse: valid JSON with a lone surrogate escape is repaired and taken
        (JSON allows them and `JSON.stringify` emits them; msgspec refuses them); the rest is broken."""
        repaired = _replace_lone_surrogates(line)
        if repaired != line:
            logger.debug("%s: replaced lone surrogate escapes with U+FFFD", self._name)
            self._take_lines([repaired])  # the repaired line cannot be repaired again: no loop
        else:
            self._take_broken(line, f"not JSON: {reason}", RpcErrorCode.PARSE_ERROR)

    def _take_broken(self, line: bytes, reason: str, code: int) -> None:
        """Report a line that is no valid message, and make sure that nobody waits for it forever.

        A response (it has `result` or `error`, no `method`) fails the request of ours it answers, and is
        never answered itself. Anything else that tries to be JSON-RPC is answered with `code` (-32700
        or -32600) and its id when the id is readable, else id null; except a line that is not UTF-8,
        answered only when it is a request. A line that does not look like JSON-RPC at all (a log line
        on stdout) is only reported.
        """
        self._report(MalformedMessageError(reason, bytes(line[:_EXCERPT_BYTES])))
        identity = _identify(line[:_IDENTIFY_BYTES])
        invalid = functools.partial(InvalidResponseError, detail=reason)
        if identity.is_response:
            self._fail_pending_response(identity, invalid)
            return
        if not _looks_like_json_rpc(line):
            return
        if reason == "not UTF-8" and not (identity.has_method and identity.has_id):
            return  # a notification that is not UTF-8: reported, skipped
        bare = identity.has_id and not identity.has_method and not identity.has_params
        # A bare {"id": ...}: the answer to a request of ours, with neither result nor error.
        if bare and self._fail_pending_response(identity, invalid):
            return
        request_id = identity.request_id if identity.id_valid else None
        message = "Parse error" if code == RpcErrorCode.PARSE_ERROR else "Invalid Request"
        self._reply_error(request_id, RequestError(code, message, {"details": reason}))

    def _take_batch(self, line: bytes) -> None:
        """A JSON array: batches are not supported. Each request in it that shows its id is answered with
        -32600 (in one array, as JSON-RPC answers a batch); without any, one -32600 with id null goes out.
        A response in it fails the request of ours it answers."""
        try:
            items = _BATCH_DECODER.decode(line)
        except msgspec.DecodeError as exc:  # not JSON after all (msgspec looked at the first byte only)
            self._take_unparsed(line, str(exc))
            return
        except RecursionError:
            self._take_broken(line, "nested too deeply", RpcErrorCode.INVALID_REQUEST)
            return
        reason = "a JSON array: batches are not supported"
        self._report(MalformedMessageError(reason, bytes(line[:_EXCERPT_BYTES])))
        errors: list[_OutError] = []
        wire = _WireError(RpcErrorCode.INVALID_REQUEST, "Invalid Request", {"details": reason})
        for item in items:
            identity = _identify(bytes(item)[:_IDENTIFY_BYTES])
            if identity.is_response:
                self._fail_pending_response(identity, lambda method: InvalidResponseError(method, reason))
            elif identity.has_method and identity.has_id and len(errors) < _MAX_BATCH_ERRORS:
                request_id = identity.request_id if identity.id_valid else None
                errors.append(_OutError(_JSONRPC, request_id, wire))
        if errors:
            self._queue_error_reply(self._encoder.encode(errors) + b"\n")
        else:
            self._reply_error(None, RequestError.invalid_request({"details": reason}))

    def _on_oversized(self, head: bytes, size: int) -> None:
        """A line over `max_line_bytes` was discarded: if its head shows a request, answer it -32600; if
        it shows the response to a request of ours, fail that request with the same error."""
        error = MessageTooLargeError(size, self._max_line_bytes)
        self._report(error)
        identity = _identify(head)
        if identity.is_response:
            self._fail_pending_response(identity, lambda method: error)
        elif identity.id_valid and (identity.has_method or identity.has_params):
            details = f"the message is {size} bytes, longer than the {self._max_line_bytes}-byte line limit"
            data = {"details": details, "size": size, "limit": self._max_line_bytes}
            self._reply_error(identity.request_id, RequestError.invalid_request(data))

    def _fail_pending_response(
        self,
        identity: _Identity,
        make_error: Callable[[str], InvalidResponseError | MessageTooLargeError],
    ) -> bool:
        """Fail the request of ours that a broken response answers; whether there was one."""
        request_id = identity.request_id
        if not identity.id_valid or not isinstance(request_id, int):
            return False
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return False
        pending.error = make_error(pending.method)
        pending.notifications_before = self._notifications_received
        pending.done.set()
        return True

    def _reply_error(self, request_id: RequestId, error: RequestError) -> None:
        self._queue_error_reply(self._encode_error(request_id, error))

    def _queue_error_reply(self, line: bytes) -> None:
        """Send an error reply from the reader, within the bounds; beyond them it is dropped."""
        if self._closed is not None or self._handlers is None:
            return
        if len(line) > self._max_send_bytes + 1:  # only an id that long can make it so
            logger.warning("%s: an error reply is longer than the peer's line limit; dropped", self._name)
            return
        crowded = self._error_replies > 0 and self._error_reply_bytes + len(line) > _MAX_ERROR_REPLY_BYTES
        if self._error_replies >= _MAX_ERROR_REPLIES or crowded:
            logger.warning("%s: too many error replies in flight; dropped one", self._name)
            return
        self._error_replies += 1
        self._error_reply_bytes += len(line)
        self._handlers.start_soon(self._send_error_reply, line)

    async def _send_error_reply(self, line: bytes) -> None:
        try:
            await self._send_quietly(line)
        finally:
            self._error_replies -= 1
            self._error_reply_bytes -= len(line)

    def _report(self, error: ProtocolError) -> None:
        self._protocol_errors += 1
        logger.warning("%s: %s", self._name, error)
        if self._on_protocol_error is not None:
            self._on_protocol_error(error)

    # -- messages --------------------------------------------------------------------------------------------

    def _on_response(self, request_id: RequestId, message: _Envelope, line: bytes) -> None:
        error: RequestError | None = None
        malformed: str | None = None
        if message.error is not msgspec.UNSET:
            try:
                wire = _WIRE_ERROR_DECODER.decode(message.error)
            except msgspec.DecodeError as exc:
                malformed = f"malformed error object: {exc}"
            else:
                data = None if wire.data is msgspec.UNSET else wire.data
                error = RequestError(wire.code, wire.message, data)
        elif message.result is msgspec.UNSET:
            # Neither result nor error: with params, a request without its method; else no valid response.
            if message.params is not msgspec.UNSET:
                self._take_broken(line, 'a request without a "method"', RpcErrorCode.INVALID_REQUEST)
            elif isinstance(request_id, int) and request_id in self._abandoned:
                del self._abandoned[request_id]
            else:
                self._take_broken(
                    line, "a response with neither result nor error", RpcErrorCode.INVALID_REQUEST
                )
            return
        pending = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
        if pending is None:
            if isinstance(request_id, int) and request_id in self._abandoned:
                del self._abandoned[request_id]
                logger.debug("%s: dropped the late response to abandoned request %d", self._name, request_id)
            else:
                self._report(UnexpectedResponseError(request_id, error))
            return
        if malformed is not None:
            pending.error = InvalidResponseError(pending.method, malformed)
        elif error is not None:
            pending.error = error
        else:
            pending.result = message.result  # type: ignore[assignment]  # not UNSET: checked above
        pending.notifications_before = self._notifications_received
        pending.done.set()

    def _on_notification(self, method: str, params: msgspec.Raw | None) -> None:
        if method == CANCEL_REQUEST_METHOD:
            self._on_cancel_request(params)
        elif self._notification_handler is None:
            logger.debug("%s: no notification handler; dropped %r", self._name, method)
        else:
            self._notifications_received += 1
            self._notification_batch.append((method, params))

    def _flush_notifications(self, read: int) -> None:
        # One queue item per chunk read, not per message: a hand-off costs the notifier a trip through
        # the event loop, and a fast agent sends hundreds of small updates per read. The read's size is
        # what the batch may keep in memory (a generous count: its other lines are counted too).
        if self._notification_batch and self._notifications is not None:
            batch, self._notification_batch = self._notification_batch, []
            self._queued_bytes += read
            self._notifications.send_nowait((batch, read))

    def _on_cancel_request(self, params: msgspec.Raw | None) -> None:
        try:
            request_id = _CANCEL_PARAMS_DECODER.decode(b"null" if params is None else params).requestId
        except (msgspec.DecodeError, RecursionError) as exc:
            self._report(MalformedMessageError(f"bad {CANCEL_REQUEST_METHOD} params: {exc}", b""))
            return
        scope = self._incoming.get(request_id)
        if scope is None:
            logger.debug("%s: cancel for request %r, which is not in flight", self._name, request_id)
        else:
            scope.cancel()

    def _on_request(self, request_id: RequestId, method: str, params: msgspec.Raw | None) -> None:
        if request_id in self._incoming:
            reason = f"request id {request_id!r} reused while still in flight"
            self._report(MalformedMessageError(reason, method.encode()))
            return
        if self._serving >= self._max_incoming_requests:
            # Refused, not paused: pausing the reader would also hold back the answers to our requests.
            limit = self._max_incoming_requests
            logger.warning("%s: refused request %r (%s): %d in flight", self._name, request_id, method, limit)
            data = {"details": f"too many requests in flight (the limit is {limit})", "limit": limit}
            self._reply_error(request_id, RequestError.internal_error(data))
            return
        done = None if self._on_request_received is None else self._on_request_received(method)
        # Registered before the task starts, so a `$/cancel_request` right behind it finds it.
        scope = self._incoming[request_id] = anyio.CancelScope()
        self._serving += 1
        assert self._handlers is not None
        # Like a response, a request is handled only after the notifications sent before it: an agent's
        # permission question must not overtake the tool call update it is about.
        before = self._notifications_received
        self._handlers.start_soon(self._serve_request, request_id, method, params, scope, before, done)

    # -- serving the peer's requests ---------------------------------------------------------------------

    async def _serve_request(
        self,
        request_id: RequestId,
        method: str,
        params: msgspec.Raw | None,
        scope: anyio.CancelScope,
        notifications_before: int,
        done: Callable[[], None] | None,
    ) -> None:
        try:
            try:
                with scope:
                    if notifications_before > self._notifications_handled:
                        await self._wait_notifications_handled(notifications_before)
                    line = await self._answer(request_id, method, params)
                if scope.cancelled_caught:
                    logger.debug("%s: request %r (%s) cancelled by the peer", self._name, request_id, method)
                    line = self._encode_error(request_id, RequestError.request_cancelled())
            finally:
                self._incoming.pop(request_id, None)
            try:
                await self._send_quietly(line)
            finally:
                self._serving -= 1
                if self._serving == 0 and self._served_all is not None:
                    self._served_all.set()
        finally:
            if done is not None:
                done()

    async def _answer(self, request_id: RequestId, method: str, params: msgspec.Raw | None) -> bytes:
        """Run the request handler and encode its outcome: the single exception-to-wire boundary."""
        error: RequestError
        try:
            if self._request_handler is None:
                raise RequestError.method_not_found(method)
            result = await self._request_handler(method, params)
            line = self._encode(_OutResult(_JSONRPC, request_id, self._wire_value(result)))
            if len(line) <= self._max_send_bytes + 1:
                return line
            logger.warning(
                "%s: the result of request %r (%s) is %d bytes, over the peer's %d-byte limit; "
                "answering -32603",
                self._name,
                request_id,
                method,
                len(line) - 1,
                self._max_send_bytes,
            )
            error = self._too_large_to_send(len(line) - 1)
        except RequestError as exc:
            error = exc
        except msgspec.ValidationError as exc:
            error = RequestError.invalid_params({"details": str(exc)})
        except Exception:
            # Never leak internals to the peer: log here, answer a bare -32603.
            logger.exception("%s: the handler of request %r (%s) failed", self._name, request_id, method)
            error = RequestError.internal_error()
        return self._encode_error(request_id, error)

    def _encode_error(self, request_id: RequestId, error: RequestError) -> bytes:
        data = msgspec.UNSET if error.data is None else error.data
        try:
            line = self._encode(_OutError(_JSONRPC, request_id, _WireError(error.code, error.message, data)))
        except (TypeError, msgspec.EncodeError):
            logger.exception("%s: cannot encode the data of %r; answering -32603", self._name, error)
            error = RequestError.internal_error()
        else:
            if len(line) <= self._max_send_bytes + 1:
                return line
            error = self._too_large_to_send(len(line) - 1)
        # The bare -32603 grows only with the id, which came in a line within the peer's own limit.
        wire = _WireError(error.code, error.message, msgspec.UNSET if error.data is None else error.data)
        return self._encode(_OutError(_JSONRPC, request_id, wire))

    def _too_large_to_send(self, size: int) -> RequestError:
        limit = self._max_send_bytes
        details = f"the answer is {size} bytes, longer than the {limit}-byte line limit"
        return RequestError.internal_error({"details": details, "size": size, "limit": limit})

    async def _send_quietly(self, line: bytes) -> None:
        try:
            await self._send_line(line)
        except ConnectionClosedError:
            logger.debug("%s: connection closed; a response was not sent", self._name)

    # -- notifications, in order -------------------------------------------------------------------------

    async def _notify_loop(self, notifications: MemoryObjectReceiveStream[_QueuedBatch]) -> None:
        _in_notification_handler.set(True)
        handler = self._notification_handler
        try:
            async for batch, read in notifications:
                assert handler is not None
                for method, params in batch:
                    try:
                        # A plain function is called without an await: the common, fast path for
                        # handlers that only record what arrived.
                        outcome = handler(method, params)
                        if outcome is not None:
                            await outcome
                    except Exception:
                        logger.exception("%s: the notification handler failed on %r", self._name, method)
                    self._notifications_handled += 1
                    if self._barrier_waiters:
                        for event, wanted in list(self._barrier_waiters.items()):
                            if wanted <= self._notifications_handled:
                                event.set()
                self._queued_bytes -= read
                if self._reader_resume is not None and self._queued_bytes <= self._max_queued_bytes // 2:
                    self._reader_resume.set()
        finally:
            self._notifier_finished = True
            self._release_barrier_waiters()
            if self._reader_resume is not None:
                self._reader_resume.set()

    async def _wait_notifications_handled(self, count: int) -> None:
        if self._notifier_finished:
            return
        event = anyio.Event()
        self._barrier_waiters[event] = count
        try:
            await event.wait()
        finally:
            del self._barrier_waiters[event]

    def _release_barrier_waiters(self) -> None:
        for event in self._barrier_waiters:
            event.set()
