"""The stub chat-completions server itself, through plain httpx and a raw socket, on asyncio and trio."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

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


# -- HTTP/1.1 as h11 reads it: bounded, strict, and one bad request costs only its own connection ----------


async def _send_raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection and read the answer until the server closes it: an orderly
    close, not a reset (which could have cost the answer)."""
    answer = b""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(data)
        with contextlib.suppress(anyio.EndOfStream):
            while True:
                answer += await stream.receive()
    return answer


@pytest.mark.parametrize(
    "head",
    [
        b"NONSENSE\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\na header line without a colon\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"GET /v1/models HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
    ],
    ids=["request-line", "header-line", "negative-length", "conflicting-lengths", "no-host"],
)
async def test_a_malformed_request_gets_a_400_with_an_error_body_and_the_server_serves_the_next(
    head: bytes,
) -> None:
    with anyio.fail_after(WAIT):
        async with serve_chat_completions([JsonReply(text="ok")]) as server, httpx.AsyncClient() as client:
            answer = await _send_raw(server.port, head)
            after = await client.post(f"{server.base_url}/chat/completions", json=BODY)
    status_and_head, _, body = answer.partition(b"\r\n\r\n")
    assert status_and_head.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"\r\nConnection: close" in status_and_head
    error = json.loads(body)["error"]
    assert error["type"] == "bad_request"
    assert error["message"].startswith("bad request: ")
    assert after.json()["choices"][0]["message"]["content"] == "ok"
    assert len(server.requests) == 1  # the malformed one was not recorded


async def test_a_request_head_past_64_kib_gets_a_431_before_it_ends() -> None:
    # The head never ends: the server answers on its size alone, not at a blank line. Four times the
    # limit: the server drains what it had not read when it answered, and the close is orderly, not a reset.
    endless = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * (256 * 1024)
    with anyio.fail_after(WAIT):
        async with serve_chat_completions() as server, httpx.AsyncClient() as client:
            answer = await _send_raw(server.port, endless)
            after = await client.get(f"{server.base_url}/models")
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["type"] == "request_too_large"
    assert after.status_code == 200


async def test_a_body_declared_past_64_mib_gets_a_413_without_being_read() -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 67108865\r\n\r\n"
    with anyio.fail_after(WAIT):
        async with serve_chat_completions() as server:
            answer = await _send_raw(server.port, head)  # not one byte of the body is sent
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"] == {
        "message": "the body is larger than 67108864 bytes",
        "type": "request_too_large",
        "code": None,
    }
    assert server.requests == []


async def test_a_chunked_request_body_is_read_whole() -> None:
    async def pieces() -> AsyncIterator[bytes]:
        encoded = json.dumps(BODY).encode()
        for start in range(0, len(encoded), 7):
            yield encoded[start : start + 7]

    with anyio.fail_after(WAIT):
        async with serve_chat_completions([JsonReply(text="ok")]) as server, httpx.AsyncClient() as client:
            response = await client.post(f"{server.base_url}/chat/completions", content=pieces())
    assert response.status_code == 200
    (request,) = server.requests
    assert request.headers["transfer-encoding"] == "chunked"
    assert request.json == BODY


async def test_a_client_that_expects_100_continue_gets_it_before_sending_the_body() -> None:
    body = json.dumps(BODY).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with anyio.fail_after(WAIT):
        async with (
            serve_chat_completions([JsonReply(text="ok")]) as server,
            await anyio.connect_tcp("127.0.0.1", server.port) as stream,
        ):
            await stream.send(head)
            interim = b""
            while not interim.endswith(b"\r\n\r\n"):
                interim += await stream.receive()
            await stream.send(body)
            answer = b""
            with contextlib.suppress(anyio.EndOfStream):
                while True:
                    answer += await stream.receive()
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert server.requests[0].json == BODY


async def test_a_head_request_is_answered_with_the_head_alone_and_the_server_serves_the_next() -> None:
    with anyio.fail_after(WAIT):
        async with serve_chat_completions([JsonReply(text="ok")]) as server, httpx.AsyncClient() as client:
            head = await _send_raw(server.port, b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            after = await client.post(f"{server.base_url}/chat/completions", json=BODY)
    # Only GET lists the models: a HEAD is an unknown route, answered 404 without the body.
    assert head.startswith(b"HTTP/1.1 404 Not Found\r\n")
    assert head.endswith(b"\r\n\r\n")
    assert b"\r\nContent-Length: 0\r\n" not in head  # the length the body would have had
    assert after.json()["choices"][0]["message"]["content"] == "ok"
    assert server.unrouted == [("HEAD", "/v1/models")]


FRAGMENTS = st.sampled_from(
    [
        b"GET /v1/models HTTP/1.1\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\n",
        b"CONNECT api.example.com:443 HTTP/1.1\r\n",
        b"HEAD / HTTP/1.0\r\n",
        b"Host: x\r\n",
        b"Content-Length: 5\r\n",
        b"Content-Length: 99999999999\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"Expect: 100-continue\r\n",
        b"\r\n",
        b"5\r\nhello\r\n0\r\n\r\n",
        json.dumps(BODY).encode(),
        b" ",
        b":",
        b"\x00",
        b"\xff",
    ]
)
"""Pieces of requests, well formed or not, for the fuzz test to put together."""


@pytest.mark.fuzz
@given(sent=st.lists(st.one_of(FRAGMENTS, st.binary(max_size=40)), max_size=12).map(b"".join))
async def test_whatever_a_client_sends_costs_it_at_most_its_connection_and_the_server_serves_the_next(
    sent: bytes,
) -> None:
    answer = b""
    with anyio.fail_after(WAIT):
        async with (
            serve_chat_completions(responder=lambda _: JsonReply(text="ok")) as server,
            httpx.AsyncClient() as client,
        ):
            async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
                await stream.send(sent)
                await stream.send_eof()  # a request still waiting for bytes ends here
                # A reset is allowed: a server may close on bytes it did not read after answering.
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                    while True:
                        answer += await stream.receive()
            after = await client.get(f"{server.base_url}/models")
    assert answer == b"" or re.match(rb"HTTP/1\.1 [1-5]\d\d ", answer), answer[:200]
    assert after.status_code == 200
