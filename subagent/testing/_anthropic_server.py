"""A scripted stub of the Anthropic Messages API, on loopback, to run real agents (Claude Code) offline.

It runs inside the caller's own event loop (asyncio or trio, through anyio). Unlike the chat-completions
stub, which answers requests in order from a script, this one asks a *responder* for each answer: an agent
makes calls of its own beside the turn (titles, summaries, quota probes), so the answer has to follow
from the request, not from its position::

    def respond(request: MessagesRequest) -> MessagesReply:
        if request.tool_results:                      # the tool ran: finish the turn
            return MessagesReply(text="Done.")
        return MessagesReply(tool_uses=[ToolUse("toolu_1", "Write", {"file_path": ..., "content": ...})])

    async with serve_anthropic_messages(respond) as server:
        env = {"ANTHROPIC_BASE_URL": server.base_url, "ANTHROPIC_API_KEY": "sk-ant-test", ...}
        ...

Routes:

* ``POST /v1/messages``: the responder's `MessagesReply` (or `MessagesError`), as a server-sent-event
  stream when the request asks ``"stream": true`` (``message_start``, ``content_block_start`` /
  ``content_block_delta`` / ``content_block_stop`` per block, ``message_delta``, ``message_stop``),
  else as one JSON ``message``. A reply can stall after a number of events (``stall_after``) and hang
  until the client hangs up.
* ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, N a rough count of the request's text.
* anything else: ``404`` with an Anthropic-style error body.

``server.requests`` records every request with its method, path, headers and JSON body (None when the
body is not JSON), in arrival order, unknown routes included: what an agent asks at startup is there to
read.

The server is also a proxy that goes nowhere: point ``HTTPS_PROXY`` / ``HTTP_PROXY`` at it and every
``CONNECT`` of a client that honours them is listed in ``server.tunnels``; a tunnel to the server
itself is opened (requests then arrive through it, as plain HTTP), any other target is refused with
403. No other target in that list shows the client tried to reach nothing else.

HTTP/1.1 is read and written with h11, as in `subagent.testing._chat_server` (bounded head and body, a 400
for a malformed request); every response closes its connection.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from subagent.testing._http import Exchange, RecordedRequest, RecordingServer, StreamedText, serve_stub

__all__ = [
    "AnthropicMessagesServer",
    "MessagesError",
    "MessagesReply",
    "MessagesRequest",
    "MessagesResponder",
    "ToolUse",
    "serve_anthropic_messages",
]


@dataclass(frozen=True, slots=True)
class ToolUse:
    """One ``tool_use`` block: the model calls tool ``name`` with ``input``. Streamed, its input arrives
    as ``input_json_delta`` pieces of about ``piece_size`` characters."""

    id: str
    name: str
    input: Mapping[str, Any] = field(default_factory=dict)
    piece_size: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "input", dict(self.input))
        if self.piece_size < 1:
            raise ValueError(f"piece_size must be >= 1, got {self.piece_size}")


@dataclass(frozen=True, slots=True)
class MessagesReply(StreamedText):
    """One assistant message: a text block (``text`` given as pieces, one ``text_delta`` each, or a
    string sent as one), then the tool uses. ``stop_reason`` defaults to ``"tool_use"`` when there are
    tool uses, else ``"end_turn"``. ``stall_after=N`` (streamed only) sends the first N events, then
    hangs until the client closes the connection."""

    text: str | Sequence[str] = ""
    tool_uses: Sequence[ToolUse] = ()
    stop_reason: str | None = None
    input_tokens: int = 10
    output_tokens: int = 5
    stall_after: int | None = None

    def __post_init__(self) -> None:
        self._check_text_and_stall()
        object.__setattr__(self, "tool_uses", tuple(self.tool_uses))

    @property
    def effective_stop_reason(self) -> str:
        """The stop reason sent: the given one, else ``tool_use`` or ``end_turn``."""
        if self.stop_reason is not None:
            return self.stop_reason
        return "tool_use" if self.tool_uses else "end_turn"


@dataclass(frozen=True, slots=True)
class MessagesError:
    """An HTTP error with an Anthropic-style body ``{"type": "error", "error": {"type", "message"}}``."""

    status: int
    message: str = "scripted error"
    error_type: str = "api_error"

    def __post_init__(self) -> None:
        if not 400 <= self.status <= 599:
            raise ValueError(f"an error status is 400..599, got {self.status}")


@dataclass(frozen=True, slots=True, eq=False)
class MessagesRequest(RecordedRequest):
    """A request as the server received it. ``headers`` has lower-cased names; ``json`` is the parsed
    body, or None when it is not JSON. ``disconnected`` is set when the client hung up on a reply."""

    @property
    def messages(self) -> list[Any]:
        """The request's ``messages`` list (empty when there is none)."""
        if isinstance(self.json, dict) and isinstance(self.json.get("messages"), list):
            return list(self.json["messages"])
        return []

    @property
    def tool_results(self) -> list[Mapping[str, Any]]:
        """The ``tool_result`` blocks of the last message, when it is the user's: what the tools returned."""
        messages = self.messages
        if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "user":
            return []
        content = messages[-1].get("content")
        if not isinstance(content, list):
            return []
        return [block for block in content if isinstance(block, dict) and block.get("type") == "tool_result"]

    def text(self) -> str:
        """Every text of the request (system prompt and messages) joined: for a responder's ``in`` tests."""
        return json.dumps(self.json) if self.json is not None else ""


MessagesResponder = Callable[[MessagesRequest], "MessagesReply | MessagesError"]
"""What the server calls for each ``POST /v1/messages`` to decide the answer."""


class AnthropicMessagesServer(RecordingServer[MessagesRequest]):
    """The running stub server: where it listens, what it received (:attr:`requests`, every request in
    arrival order, whatever its route). See :func:`serve_anthropic_messages`."""

    def __init__(self, responder: MessagesResponder, *, model: str, port: int) -> None:
        super().__init__(MessagesRequest, port=port)
        self.responder = responder
        self.model = model

    @property
    def base_url(self) -> str:
        """The value for ``ANTHROPIC_BASE_URL``: ``http://127.0.0.1:PORT`` (the client adds ``/v1/...``)."""
        return self.origin

    @property
    def message_requests(self) -> list[MessagesRequest]:
        """The ``POST /v1/messages`` requests only."""
        return [r for r in self.requests if r.method == "POST" and r.path == "/v1/messages"]

    def _error_body(self, message: str, error_type: str) -> dict[str, Any]:
        return _error_body(_ERROR_TYPES.get(error_type, error_type), message)

    async def _route(self, request: MessagesRequest, exchange: Exchange) -> None:
        route = (request.method, request.path)
        if route == ("POST", "/v1/messages/count_tokens"):
            await exchange.send_json(200, {"input_tokens": max(1, len(request.text()) // 4)})
            return
        if route != ("POST", "/v1/messages"):
            message = f"no route {request.method} {request.path}"
            await exchange.send_json(404, _error_body("not_found_error", message))
            return
        payload = request.json
        if not isinstance(payload, dict):
            await exchange.send_json(
                400, _error_body("invalid_request_error", "the body is not a JSON object")
            )
            return
        reply = self.responder(request)
        model = str(payload.get("model", self.model))
        if isinstance(reply, MessagesError):
            await exchange.send_json(reply.status, _error_body(reply.error_type, reply.message))
        elif payload.get("stream") is True:
            events = [(name, json.dumps(data)) for name, data in _stream_events(reply, request.index, model)]
            await exchange.send_event_stream(events, stall_after=reply.stall_after)
        else:
            await exchange.send_json(200, _message_body(reply, request.index, model))


@asynccontextmanager
async def serve_anthropic_messages(
    responder: MessagesResponder, *, model: str = "claude-stub"
) -> AsyncIterator[AnthropicMessagesServer]:
    """Serve the Messages API on a free loopback port for the duration of the block, answering each
    ``POST /v1/messages`` with ``responder(request)``.

    Leaving the block stops the server and closes every connection still open (a stalled one included).
    """

    def make(port: int) -> AnthropicMessagesServer:
        return AnthropicMessagesServer(responder, model=model, port=port)

    async with serve_stub(make, "stub Anthropic server") as server:
        yield server


_ERROR_TYPES = {"bad_request": "invalid_request_error", "forbidden": "permission_error"}
"""The Anthropic name of each error type the shared HTTP layer answers with (the others are the same)."""


def _error_body(error_type: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type, "message": message}}


def _message_id(index: int) -> str:
    return f"msg_stub_{index + 1:04d}"


def _usage(reply: MessagesReply) -> dict[str, int]:
    return {
        "input_tokens": reply.input_tokens,
        "output_tokens": reply.output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _message_body(reply: MessagesReply, index: int, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if reply.text_pieces:
        content.append({"type": "text", "text": "".join(reply.text_pieces)})
    content += [
        {"type": "tool_use", "id": u.id, "name": u.name, "input": dict(u.input)} for u in reply.tool_uses
    ]
    return {
        "id": _message_id(index),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reply.effective_stop_reason,
        "stop_sequence": None,
        "usage": _usage(reply),
    }


def _stream_events(reply: MessagesReply, index: int, model: str) -> list[tuple[str, dict[str, Any]]]:
    start = _message_body(reply, index, model)
    start.update(content=[], stop_reason=None, usage={**_usage(reply), "output_tokens": 1})
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": start})
    ]
    block = 0
    if reply.text_pieces:
        events.append(
            (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": block,
                    "content_block": {"type": "text", "text": ""},
                },
            )
        )
        events += [
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": block,
                    "delta": {"type": "text_delta", "text": piece},
                },
            )
            for piece in reply.text_pieces
        ]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": block}))
        block += 1
    for use in reply.tool_uses:
        header = {"type": "tool_use", "id": use.id, "name": use.name, "input": {}}
        events.append(
            ("content_block_start", {"type": "content_block_start", "index": block, "content_block": header})
        )
        arguments = json.dumps(dict(use.input))
        for offset in range(0, len(arguments), use.piece_size):
            piece = {"type": "input_json_delta", "partial_json": arguments[offset : offset + use.piece_size]}
            events.append(
                ("content_block_delta", {"type": "content_block_delta", "index": block, "delta": piece})
            )
        events.append(("content_block_stop", {"type": "content_block_stop", "index": block}))
        block += 1
    end = {"stop_reason": reply.effective_stop_reason, "stop_sequence": None}
    events.append(("message_delta", {"type": "message_delta", "delta": end, "usage": _usage(reply)}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events
