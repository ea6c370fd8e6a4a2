"""The stub chat-completions server itself, through plain httpx and a raw socket, on asyncio and trio."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest

from subagent.testing import (
    ErrorReply,
    JsonReply,
    RawStream,
    StreamedReply,
    ToolCallReply,
    serve_chat_completions,
)

pytestmark = pytest.mark.anyio

WAIT = 5  # seconds; a bound on every wait, never a sleep
BODY = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def sse_data(body: str) -> list[Any]:
    """The ``data`` of every event of an SSE body: JSON decoded, ``[DONE]`` kept as the string."""
    events = [line.removeprefix("data: ") for line in body.split("\n\n") if line]
    return [event if event == "[DONE]" else json.loads(event) for event in events]


def deltas(events: list[Any]) -> list[Any]:
    """Each event's delta; ``{"usage": ...}`` for the usage chunk (no choices); ``[DONE]`` as is."""
    return [
        event
        if event == "[DONE]"
        else event["choices"][0]["delta"]
        if event["choices"]
        else {"usage": event["usage"]}
        for event in events
    ]


async def test_a_request_beyond_the_script_gets_a_500_that_says_so() -> None:
    with anyio.fail_after(WAIT):
        async with (
            serve_chat_completions([ErrorReply(418, "teapot")]) as server,
            httpx.AsyncClient() as client,
        ):
            first = await client.post(f"{server.base_url}/chat/completions", json=BODY)
            second = await client.post(f"{server.base_url}/chat/completions", json=BODY)
    assert first.status_code == 418
    assert second.status_code == 500
    assert second.json() == {
        "error": {
            "message": "stub chat server: request #2 is beyond the script (1 replies scripted)",
            "type": "script_exhausted",
            "code": None,
        }
    }
    assert [request.index for request in server.requests] == [0, 1]


async def test_a_streamed_reply_sends_role_text_tool_calls_finish_usage_and_done_in_order() -> None:
    reply = StreamedReply(
        text="Hello",
        chunks=2,
        tool_calls=[ToolCallReply("call_1", "f", '{"a": 1}', chunks=2)],
        usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    )
    with anyio.fail_after(WAIT):
        async with serve_chat_completions([reply]) as server, httpx.AsyncClient() as client:
            response = await client.post(f"{server.base_url}/chat/completions", json=BODY)
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_data(response.text)
    assert deltas(events) == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
        {"content": "lo"},
        {
            "tool_calls": [
                {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
        {},
        {"usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
        "[DONE]",
    ]
    assert events[6]["choices"][0]["finish_reason"] == "tool_calls"
    assert events[7]["choices"] == []
    assert {event["model"] for event in events[:-1]} == {"stub-model"}


async def test_a_json_reply_is_one_chat_completion_body() -> None:
    reply = JsonReply(text=None, tool_calls=[ToolCallReply("call_1", "f", ('{"a"', ": 1}"))])
    with anyio.fail_after(WAIT):
        async with serve_chat_completions([reply]) as server, httpx.AsyncClient() as client:
            response = await client.post(f"{server.base_url}/chat/completions", json=BODY)
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                ],
            },
            "finish_reason": "tool_calls",
        }
    ]


async def test_an_error_reply_carries_retry_after_as_written() -> None:
    with anyio.fail_after(WAIT):
        async with (
            serve_chat_completions([ErrorReply(429, "slow down", retry_after=1.5)]) as server,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(f"{server.base_url}/chat/completions", json=BODY)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1.5"
    assert response.json()["error"]["message"] == "slow down"


async def test_models_lists_the_one_model_and_consumes_no_reply() -> None:
    with anyio.fail_after(WAIT):
        async with serve_chat_completions(model="local-llama") as server, httpx.AsyncClient() as client:
            response = await client.get(f"{server.base_url}/models")
    assert response.json() == {
        "object": "list",
        "data": [{"id": "local-llama", "object": "model", "owned_by": "stub"}],
    }
    assert server.requests == []


async def test_an_unknown_path_is_a_404_and_a_body_that_is_not_json_is_a_400() -> None:
    with anyio.fail_after(WAIT):
        async with serve_chat_completions() as server, httpx.AsyncClient() as client:
            missing = await client.post(f"{server.base_url}/completions", json=BODY)
            not_json = await client.post(f"{server.base_url}/chat/completions", content=b"{nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "no route POST /v1/completions"
    assert not_json.status_code == 400
    assert server.requests == []


async def test_a_malformed_request_line_gets_a_400_over_a_raw_socket() -> None:
    with anyio.fail_after(WAIT):
        async with (
            serve_chat_completions() as server,
            await anyio.connect_tcp("127.0.0.1", server.port) as stream,
        ):
            await stream.send(b"NONSENSE\r\n\r\n")
            answer = b""
            try:
                while True:
                    answer += await stream.receive()
            except anyio.EndOfStream:
                pass
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")


def test_a_reply_cannot_both_drop_and_stall() -> None:
    with pytest.raises(ValueError, match="drop or stall"):
        StreamedReply(text="x", drop_after=1, stall_after=1)


async def test_an_error_reply_quotes_the_request_headers_it_is_told_to_echo() -> None:
    echo = ErrorReply(401, "Incorrect API key", echo_headers=["Authorization", "X-Missing"])
    with anyio.fail_after(WAIT):
        async with serve_chat_completions([echo]) as server, httpx.AsyncClient() as client:
            response = await client.post(
                f"{server.base_url}/chat/completions", json=BODY, headers={"Authorization": "Bearer sk-1"}
            )
    assert response.status_code == 401
    assert response.json()["error"]["message"] == (
        "Incorrect API key (authorization: Bearer sk-1; x-missing: (absent))"
    )


async def test_a_paused_raw_stream_trickles_its_pieces_and_stops_when_the_client_hangs_up() -> None:
    trickle = RawStream(["a", "b", "c", "d"], pause=0.01)
    body = json.dumps(BODY).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    received = b""
    with anyio.fail_after(WAIT):
        async with serve_chat_completions([trickle]) as server:
            async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
                await stream.send(head.encode() + body)
                while b"1\r\nb\r\n" not in received:  # the second piece, as its own HTTP chunk
                    received += await stream.receive()
            await server.requests[0].disconnected.wait()
    assert received.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\n\r\n1\r\na\r\n1\r\nb\r\n" in received  # each piece its own HTTP chunk


def test_a_raw_streams_pause_and_an_echo_beside_a_verbatim_body_are_refused() -> None:
    with pytest.raises(ValueError, match="pause must be >= 0 seconds, got -1"):
        RawStream(["x"], pause=-1)
    with pytest.raises(ValueError, match="echo_headers goes into the message"):
        ErrorReply(401, body="{}", echo_headers=["authorization"])
