"""The fake model servers that real agents run against: the Anthropic Messages and Responses API stubs,
and what the chat-completions stub gained for real agents (a responder, a proxy that tunnels only to
itself).
Through plain httpx and raw sockets, on asyncio and trio."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import anyio
import anyio.abc
import httpx
import pytest

from subagent.testing import (
    AnthropicMessagesServer,
    ErrorReply,
    FunctionCall,
    MessagesError,
    MessagesReply,
    MessagesRequest,
    ReceivedRequest,
    ResponsesReply,
    ResponsesRequest,
    ResponsesServer,
    StreamedReply,
    ToolUse,
    serve_anthropic_messages,
    serve_chat_completions,
    serve_responses,
)

pytestmark = pytest.mark.anyio

WAIT = 5  # seconds; a bound on every wait, never a sleep
MESSAGES = [{"role": "user", "content": "hi"}]
ANTHROPIC_HEADERS = {"x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01"}


def anthropic_events(body: str) -> list[tuple[str, Any]]:
    """(event name, decoded data) of every event of an SSE body."""
    events = []
    for block in body.split("\n\n"):
        if not block:
            continue
        name_line, data_line = block.split("\n")
        events.append((name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))))
    return events


def block_start(index: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


def block_delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


async def test_a_streamed_message_sends_text_then_tool_use_events_in_the_messages_api_order() -> None:
    reply = MessagesReply(
        text=("Hel", "lo"),
        tool_uses=[ToolUse("toolu_1", "Write", {"file_path": "/x", "content": "y"}, piece_size=10)],
        input_tokens=7,
        output_tokens=3,
    )
    with anyio.fail_after(WAIT):
        async with serve_anthropic_messages(lambda _: reply) as server, httpx.AsyncClient() as client:
            response = await client.post(
                f"{server.base_url}/v1/messages",
                json={"model": "claude-x", "max_tokens": 10, "messages": MESSAGES, "stream": True},
                headers=ANTHROPIC_HEADERS,
            )
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = anthropic_events(response.text)
    assert events[0] == (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": "msg_stub_0001",
                "type": "message",
                "role": "assistant",
                "model": "claude-x",
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage(7, 1),
            },
        },
    )
    arguments = json.dumps({"file_path": "/x", "content": "y"})
    tool_use = {"type": "tool_use", "id": "toolu_1", "name": "Write", "input": {}}
    assert events[1:] == [
        ("content_block_start", block_start(0, {"type": "text", "text": ""})),
        ("content_block_delta", block_delta(0, {"type": "text_delta", "text": "Hel"})),
        ("content_block_delta", block_delta(0, {"type": "text_delta", "text": "lo"})),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("content_block_start", block_start(1, tool_use)),
        *[
            ("content_block_delta", block_delta(1, {"type": "input_json_delta", "partial_json": piece}))
            for piece in (arguments[i : i + 10] for i in range(0, len(arguments), 10))
        ],
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ("message_delta", {"type": "message_delta", "usage": usage(7, 3),
                           "delta": {"stop_reason": "tool_use", "stop_sequence": None}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    (request,) = server.requests
    assert (request.method, request.path, request.headers["x-api-key"]) == (
        "POST",
        "/v1/messages",
        "sk-ant-test",
    )


async def test_a_message_not_asked_to_stream_comes_as_one_json_body() -> None:
    reply = MessagesReply(text="Hello", tool_uses=[ToolUse("toolu_1", "Bash", {"command": "ls"})])
    with anyio.fail_after(WAIT):
        async with serve_anthropic_messages(lambda _: reply) as server, httpx.AsyncClient() as client:
            response = await client.post(
                f"{server.base_url}/v1/messages", json={"model": "claude-x", "messages": MESSAGES}
            )
    assert response.json() == {
        "id": "msg_stub_0001",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [
            {"type": "text", "text": "Hello"},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 10,
            "output_tokens": 5,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


async def test_the_responder_sees_the_tool_results_and_tools_of_each_request() -> None:
    seen: list[tuple[list[str], list[Any]]] = []

    def respond(request: MessagesRequest) -> MessagesReply:
        seen.append((request.tool_names, [dict(result) for result in request.tool_results]))
        return MessagesReply(text="done" if request.tool_results else "calling")

    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}
    bodies = [
        {"messages": MESSAGES, "tools": [{"name": "Write"}, {"name": "Bash"}]},
        {"messages": [*MESSAGES, {"role": "user", "content": [{"type": "text", "text": "x"}, result]}]},
        {"messages": [*MESSAGES, {"role": "assistant", "content": [result]}]},  # not the user's: no results
    ]
    with anyio.fail_after(WAIT):
        async with serve_anthropic_messages(respond) as server, httpx.AsyncClient() as client:
            texts = [
                (await client.post(f"{server.base_url}/v1/messages", json=body)).json()["content"][0]["text"]
                for body in bodies
            ]
    assert texts == ["calling", "done", "calling"]
    assert seen == [(["Write", "Bash"], []), ([], [result]), ([], [])]


async def test_count_tokens_is_answered_and_unknown_routes_get_a_404_yet_are_recorded() -> None:
    with anyio.fail_after(WAIT):
        async with (
            serve_anthropic_messages(lambda _: MessagesReply(text="x")) as server,
            httpx.AsyncClient() as client,
        ):
            counted = await client.post(
                f"{server.base_url}/v1/messages/count_tokens", json={"messages": MESSAGES}
            )
            unknown = await client.get(f"{server.base_url}/v1/models?limit=5")
    assert counted.status_code == 200
    assert counted.json()["input_tokens"] >= 1
    assert unknown.status_code == 404
    assert unknown.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "no route GET /v1/models"},
    }
    assert [(r.method, r.path) for r in server.requests] == [
        ("POST", "/v1/messages/count_tokens"),
        ("GET", "/v1/models"),
    ]
    assert server.message_requests == []


async def test_a_messages_error_is_answered_with_its_status_and_an_anthropic_error_body() -> None:
    error = MessagesError(529, "overloaded", "overloaded_error")
    with anyio.fail_after(WAIT):
        async with serve_anthropic_messages(lambda _: error) as server, httpx.AsyncClient() as client:
            response = await client.post(f"{server.base_url}/v1/messages", json={"messages": MESSAGES})
    assert response.status_code == 529
    assert response.json() == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "overloaded"},
    }


async def read_events_then_hang_up(
    server: AnthropicMessagesServer | ResponsesServer, path: str, payload: dict[str, Any], events: int
) -> bytes:
    """POST ``payload`` as a streamed request over a raw connection, read until ``events`` SSE events came,
    hang up, and return once the server saw the hang-up; what was read (the head included)."""
    body = json.dumps({**payload, "stream": True}).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    stream = await anyio.connect_tcp("127.0.0.1", server.port)
    async with stream:
        await stream.send(head + body)
        received = b""
        while received.count(b"\n\n") < events:
            received += await stream.receive()
    (request,) = server.requests
    await request.disconnected.wait()
    return received


async def test_a_stalled_message_sends_its_first_events_then_waits_until_the_client_hangs_up() -> None:
    reply = MessagesReply(text=("first", "never"), stall_after=3)
    with anyio.fail_after(WAIT):
        async with serve_anthropic_messages(lambda _: reply) as server:
            received = await read_events_then_hang_up(server, "/v1/messages", {"messages": MESSAGES}, 3)
    chunks = received.split(b"\r\n\r\n", 1)[1]
    assert chunks.count(b"event: ") == 3
    assert [line for line in chunks.split(b"\n") if line.startswith(b"event: ")] == [
        b"event: message_start",
        b"event: content_block_start",
        b"event: content_block_delta",
    ]
    assert b'"text": "first"' in chunks
    assert b"never" not in chunks


def test_replies_refuse_a_success_status_as_an_error_a_negative_stall_and_an_empty_piece() -> None:
    with pytest.raises(ValueError, match=r"an error status is 400\.\.599, got 200"):
        MessagesError(200)
    with pytest.raises(ValueError, match="stall_after must be >= 0, got -1"):
        MessagesReply(stall_after=-1)
    with pytest.raises(ValueError, match="piece_size must be >= 1, got 0"):
        ToolUse("t", "Write", piece_size=0)


async def test_a_malformed_request_line_gets_a_400_from_the_anthropic_stub() -> None:
    with anyio.fail_after(WAIT):
        async with serve_anthropic_messages(lambda _: MessagesReply()) as server:
            stream = await anyio.connect_tcp("127.0.0.1", server.port)
            async with stream:
                await stream.send(b"NONSENSE\r\n\r\n")
                answer = await _read_until_closed(stream)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert server.requests == []


# -- the chat-completions stub: a responder ----------------------------------------------------------------


async def test_the_chat_stub_answers_the_script_first_then_asks_the_responder() -> None:
    asked: list[int] = []

    def respond(request: ReceivedRequest) -> StreamedReply:
        asked.append(request.index)
        return StreamedReply(text=f"reply {request.index}")

    body = {"model": "stub-model", "messages": MESSAGES, "stream": True}
    with anyio.fail_after(WAIT):
        async with (
            serve_chat_completions([ErrorReply(418, "teapot")], responder=respond) as server,
            httpx.AsyncClient() as client,
        ):
            statuses = [
                (await client.post(f"{server.base_url}/chat/completions", json=body)).status_code
                for _ in range(3)
            ]
            unknown = await client.post(f"{server.base_url}/responses", json=body)
    assert statuses == [418, 200, 200]
    assert asked == [1, 2]
    assert unknown.status_code == 404
    assert server.unrouted == [("POST", "/v1/responses")]


# -- the Responses API stub -------------------------------------------------------------------------------


async def test_a_response_streams_its_message_then_its_function_calls_then_completes() -> None:
    reply = ResponsesReply(
        text=("Hel", "lo"), function_calls=[FunctionCall("call_1", "exec_command", '{"cmd": "ls"}')]
    )
    with anyio.fail_after(WAIT):
        async with serve_responses(lambda _: reply) as server, httpx.AsyncClient() as client:
            response = await client.post(
                f"{server.base_url}/responses", json={"model": "m", "input": [], "stream": True}
            )
    events = anthropic_events(response.text)  # the same `event:` / `data:` framing
    assert all(name == data["type"] for name, data in events)
    message = {"type": "message", "id": "msg_stub_0001", "role": "assistant", "content": []}
    text = {"type": "output_text", "text": "Hello", "annotations": []}
    call = {
        "type": "function_call",
        "id": "fc_call_1",
        "call_id": "call_1",
        "name": "exec_command",
        "arguments": '{"cmd": "ls"}',
        "status": "completed",
    }
    delta = {
        "type": "response.output_text.delta",
        "item_id": "msg_stub_0001",
        "output_index": 0,
        "content_index": 0,
    }
    assert [data for _, data in events] == [
        {"type": "response.created", "response": {"id": "resp_stub_0001"}},
        {"type": "response.output_item.added", "output_index": 0, "item": message},
        {**delta, "delta": "Hel"},
        {**delta, "delta": "lo"},
        {"type": "response.output_item.done", "output_index": 0,
         "item": {**message, "content": [text], "status": "completed"}},
        {"type": "response.output_item.done", "output_index": 1, "item": call},
        {"type": "response.completed", "response": {"id": "resp_stub_0001",
         "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}}},
    ]  # fmt: skip


async def test_a_function_call_of_a_namespaced_tool_names_its_namespace_beside_the_tool() -> None:
    spawn = FunctionCall("call_1", "spawn_agent", '{"task_name": "t"}', namespace="collaboration")
    with anyio.fail_after(WAIT):
        reply = ResponsesReply(function_calls=[spawn])
        async with serve_responses(lambda _: reply) as server, httpx.AsyncClient() as client:
            response = await client.post(f"{server.base_url}/responses", json={"input": [], "stream": True})
    (item,) = [data["item"] for _, data in anthropic_events(response.text) if "item" in data]
    assert item == {
        "type": "function_call",
        "id": "fc_call_1",
        "call_id": "call_1",
        "name": "spawn_agent",
        "arguments": '{"task_name": "t"}',
        "status": "completed",
        "namespace": "collaboration",
    }


async def test_the_responses_responder_sees_only_the_outputs_since_the_last_user_message() -> None:
    seen: list[tuple[list[str], list[Any]]] = []

    def respond(request: ResponsesRequest) -> ResponsesReply:
        seen.append((request.tool_names, [dict(output) for output in request.function_call_outputs]))
        return ResponsesReply(text="ok")

    old = {"type": "function_call_output", "call_id": "call_0", "output": "old"}
    new = {"type": "function_call_output", "call_id": "call_1", "output": "new"}
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    bodies = [
        {"input": [user], "tools": [{"type": "function", "name": "exec_command"}, {"type": "web_search"}]},
        {"input": [user, old, user, new]},
        {"input": [user, old, user]},
    ]
    with anyio.fail_after(WAIT):
        async with serve_responses(respond) as server, httpx.AsyncClient() as client:
            for body in bodies:
                assert (await client.post(f"{server.base_url}/responses", json=body)).status_code == 200
            unknown = await client.get(f"{server.base_url}/models")
    assert seen == [(["exec_command"], []), ([], [new]), ([], [])]
    assert unknown.status_code == 404
    assert [(r.method, r.path) for r in server.requests][-1] == ("GET", "/v1/models")


async def test_a_stalled_response_stops_after_its_first_events_until_the_client_hangs_up() -> None:
    reply = ResponsesReply(text=("first", "never"), stall_after=3)
    with anyio.fail_after(WAIT):
        async with serve_responses(lambda _: reply) as server:
            received = await read_events_then_hang_up(server, "/v1/responses", {"input": []}, 3)
    assert b'"delta": "first"' in received
    assert b"never" not in received


# -- all three stubs: a proxy that tunnels only to itself ---------------------------------------------


class _Served(Protocol):
    @property
    def port(self) -> int: ...

    @property
    def tunnels(self) -> list[str]: ...


ServeStub = Callable[[], AbstractAsyncContextManager[_Served]]


def _anthropic() -> AbstractAsyncContextManager[_Served]:
    return serve_anthropic_messages(lambda _: MessagesReply(text="through the tunnel"))


def _chat() -> AbstractAsyncContextManager[_Served]:
    return serve_chat_completions(responder=lambda _: StreamedReply(text="through the tunnel"))


def _responses() -> AbstractAsyncContextManager[_Served]:
    return serve_responses(lambda _: ResponsesReply(text="through the tunnel"))


STUBS = pytest.mark.parametrize(
    ("serve", "path"),
    [(_anthropic, "/v1/messages"), (_chat, "/v1/chat/completions"), (_responses, "/v1/responses")],
)


async def _read_until_closed(stream: anyio.abc.ByteStream) -> bytes:
    received = b""
    while True:
        try:
            received += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return received


async def _read_head(stream: anyio.abc.ByteStream) -> bytes:
    received = b""
    while b"\r\n\r\n" not in received:
        received += await stream.receive()
    return received


@STUBS
async def test_a_connect_to_the_stub_itself_opens_a_tunnel_its_requests_come_through(
    serve: ServeStub, path: str
) -> None:
    body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True}).encode()
    with anyio.fail_after(WAIT):
        async with serve() as server:
            target = f"127.0.0.1:{server.port}"
            stream = await anyio.connect_tcp("127.0.0.1", server.port)
            async with stream:
                await stream.send(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
                head = await _read_head(stream)
                request = f"POST {path} HTTP/1.1\r\nHost: {target}\r\nContent-Length: {len(body)}\r\n\r\n"
                await stream.send(request.encode() + body)
                answer = await _read_until_closed(stream)
    assert head == b"HTTP/1.1 200 Connection established\r\n\r\n"
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"through the tunnel" in answer
    assert server.tunnels == [target]


@STUBS
async def test_a_connect_anywhere_else_is_refused_with_403_and_listed(serve: ServeStub, path: str) -> None:
    with anyio.fail_after(WAIT):
        async with serve() as server:
            stream = await anyio.connect_tcp("127.0.0.1", server.port)
            async with stream:
                await stream.send(
                    b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com:443\r\n\r\n"
                )
                answer = await _read_until_closed(stream)
    assert answer.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert b"tunnels to nowhere but itself, not to api.example.com:443" in answer
    assert server.tunnels == ["api.example.com:443"]


@STUBS
async def test_a_connect_inside_a_tunnel_is_refused_with_400(serve: ServeStub, path: str) -> None:
    with anyio.fail_after(WAIT):
        async with serve() as server:
            target = f"127.0.0.1:{server.port}"
            connect = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()
            stream = await anyio.connect_tcp("127.0.0.1", server.port)
            async with stream:
                await stream.send(connect)
                await _read_head(stream)
                await stream.send(connect)
                answer = await _read_until_closed(stream)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"no CONNECT inside a tunnel" in answer
    assert server.tunnels == [target, target]
