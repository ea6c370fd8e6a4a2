"""A scripted stub of the OpenAI Responses API, on loopback, to run real agents (Codex) offline.

It works as `subagent.testing._anthropic_server` does: inside the caller's event loop, a *responder*
decides each answer from the request (an agent's side calls make positions unpredictable)::

    def respond(request: ResponsesRequest) -> ResponsesReply:
        if request.function_call_outputs:            # the command ran: finish the turn
            return ResponsesReply(text="Done.")
        return ResponsesReply(function_calls=[FunctionCall("call_1", "exec_command", '{"cmd": "ls"}')])

    async with serve_responses(respond) as server:
        ...  # a Codex provider with base_url = server.base_url and wire_api = "responses"

``POST /v1/responses`` gets the reply as a server-sent-event stream (``response.created``; per text
message ``response.output_item.added``, one ``response.output_text.delta`` per piece,
``response.output_item.done``; per function call ``response.output_item.done``; then
``response.completed`` with usage), optionally stalled after a number of events. Anything else is
answered 404. Every request is recorded in ``server.requests``; ``CONNECT`` is handled as the
Anthropic stub does (a tunnel to the server itself, 403 elsewhere, listed in ``server.tunnels``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from subagent.testing._chat_server import openai_error_body
from subagent.testing._http import Exchange, RecordedRequest, RecordingServer, StreamedText, serve_stub

__all__ = [
    "FunctionCall",
    "ResponsesReply",
    "ResponsesRequest",
    "ResponsesResponder",
    "ResponsesServer",
    "serve_responses",
]


@dataclass(frozen=True, slots=True)
class FunctionCall:
    """One ``function_call`` output item: the model calls tool ``name`` with ``arguments`` (JSON text);
    ``namespace``: the namespace of a tool offered inside one (``{"type": "namespace", "tools": [...]}``,
    as Codex offers its subagent tools), which the item names beside the tool."""

    call_id: str
    name: str
    arguments: str = "{}"
    namespace: str | None = None


@dataclass(frozen=True, slots=True)
class ResponsesReply(StreamedText):
    """One response: a text message (``text`` as pieces, one delta each, or a string sent whole), then
    the function calls. ``stall_after=N`` sends the first N events, then hangs until the client hangs up."""

    text: str | Sequence[str] = ""
    function_calls: Sequence[FunctionCall] = ()
    input_tokens: int = 10
    output_tokens: int = 5
    stall_after: int | None = None

    def __post_init__(self) -> None:
        self._check_text_and_stall()
        object.__setattr__(self, "function_calls", tuple(self.function_calls))


@dataclass(frozen=True, slots=True, eq=False)
class ResponsesRequest(RecordedRequest):
    """A request as received: lower-cased ``headers``, ``json`` body (None when not JSON), and
    ``disconnected``, set when the client hung up on the reply."""

    @property
    def input_items(self) -> list[Any]:
        """The request's ``input`` items (empty when there are none)."""
        items = self.json.get("input") if isinstance(self.json, dict) else None
        return list(items) if isinstance(items, list) else []

    @property
    def function_call_outputs(self) -> list[Mapping[str, Any]]:
        """The ``function_call_output`` items after the last user message: what the tools just returned."""
        outputs: list[Mapping[str, Any]] = []
        for item in self.input_items:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "message" and item.get("role") == "user":
                outputs = []
            elif item.get("type") == "function_call_output":
                outputs.append(item)
        return outputs


ResponsesResponder = Callable[[ResponsesRequest], ResponsesReply]
"""What the server calls for each ``POST /v1/responses`` to decide the answer."""


class ResponsesServer(RecordingServer[ResponsesRequest]):
    """The running stub server: where it listens, what it received (:attr:`requests`, every request in
    arrival order, whatever its route). See :func:`serve_responses`."""

    def __init__(self, responder: ResponsesResponder, *, port: int) -> None:
        super().__init__(ResponsesRequest, port=port)
        self.responder = responder

    @property
    def base_url(self) -> str:
        """The provider base URL: ``http://127.0.0.1:PORT/v1``."""
        return f"{self.origin}/v1"

    def _error_body(self, message: str, error_type: str) -> dict[str, Any]:
        return openai_error_body(message, error_type)

    async def _route(self, request: ResponsesRequest, exchange: Exchange) -> None:
        if (request.method, request.path) != ("POST", "/v1/responses"):
            message = f"no route {request.method} {request.path}"
            await exchange.send_json(404, openai_error_body(message, "invalid_request_error"))
            return
        if not isinstance(request.json, dict):
            message = "the body is not a JSON object"
            await exchange.send_json(400, openai_error_body(message, "invalid_request_error"))
            return
        reply = self.responder(request)
        events = [(event["type"], json.dumps(event)) for event in _events(reply, request.index)]
        await exchange.send_event_stream(events, stall_after=reply.stall_after)


@asynccontextmanager
async def serve_responses(responder: ResponsesResponder) -> AsyncIterator[ResponsesServer]:
    """Serve the Responses API on a free loopback port for the duration of the block, answering each
    ``POST /v1/responses`` with ``responder(request)``. Leaving the block closes every connection."""
    async with serve_stub(
        lambda port: ResponsesServer(responder, port=port), "stub Responses server"
    ) as server:
        yield server


def _events(reply: ResponsesReply, index: int) -> list[dict[str, Any]]:
    response_id = f"resp_stub_{index + 1:04d}"
    events: list[dict[str, Any]] = [{"type": "response.created", "response": {"id": response_id}}]
    position = 0
    if reply.text_pieces:
        item_id = f"msg_stub_{index + 1:04d}"
        item = {"type": "message", "id": item_id, "role": "assistant", "content": []}
        events.append({"type": "response.output_item.added", "output_index": position, "item": item})
        events += [
            {
                "type": "response.output_text.delta",
                "item_id": item_id,
                "output_index": position,
                "content_index": 0,
                "delta": piece,
            }
            for piece in reply.text_pieces
        ]
        content = [{"type": "output_text", "text": "".join(reply.text_pieces), "annotations": []}]
        done = {**item, "content": content, "status": "completed"}
        events.append({"type": "response.output_item.done", "output_index": position, "item": done})
        position += 1
    for call in reply.function_calls:
        item = {
            "type": "function_call",
            "id": f"fc_{call.call_id}",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }
        if call.namespace is not None:
            item["namespace"] = call.namespace
        events.append({"type": "response.output_item.done", "output_index": position, "item": item})
        position += 1
    usage = {
        "input_tokens": reply.input_tokens,
        "output_tokens": reply.output_tokens,
        "total_tokens": reply.input_tokens + reply.output_tokens,
    }
    events.append({"type": "response.completed", "response": {"id": response_id, "usage": usage}})
    return events
