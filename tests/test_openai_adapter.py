"""The OpenAI-compatible chat adapter against the loopback stub server, on asyncio and trio.

Every wait is bounded by ``anyio.fail_after``; retry delays are kept tiny through the adapter's own
``backoff``/``max_backoff``, and timeouts through its ``timeout``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest

from subagent.runtime import (
    Completion,
    CompletionEvent,
    CompletionRequest,
    LlmAdapter,
    LlmError,
    LlmErrorKind,
    Message,
    Retrying,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
)
from subagent.runtime.openai import OpenAiChatAdapter
from subagent.testing import (
    ChatCompletionsServer,
    ChatReply,
    DropConnection,
    ErrorReply,
    JsonReply,
    MalformedChunk,
    RawStream,
    StallReply,
    StreamedReply,
    ToolCallReply,
    serve_chat_completions,
)
from subagent.types import Usage

pytestmark = pytest.mark.anyio

WAIT = 5  # seconds; a bound on every wait, never a sleep
KEY = "sk-test-9f8e7d6c5b4a"
HELLO = CompletionRequest((Message.user("Say hello."),))


def running_task_ids() -> set[int]:
    return {task.id for task in anyio.get_running_tasks()}


@asynccontextmanager
async def serve(*script: ChatReply) -> AsyncIterator[ChatCompletionsServer]:
    """The stub server on ``script``; on exit, asserts that no task was left running."""
    before = running_task_ids()
    async with serve_chat_completions(script) as server:
        yield server
    assert running_task_ids() == before


def adapter_for(server: ChatCompletionsServer, **overrides: Any) -> OpenAiChatAdapter:
    options: dict[str, Any] = {
        "model": "stub-model",
        "base_url": server.base_url,
        "api_key": KEY,
        "api_key_env": None,
        "timeout": 2.0,
        "max_retries": 2,
        "backoff": 0.001,
        "max_backoff": 0.01,
    }
    options.update(overrides)
    return OpenAiChatAdapter(**options)


async def consume(
    adapter: OpenAiChatAdapter, events: list[CompletionEvent], request: CompletionRequest = HELLO
) -> None:
    """Append every event of one completion to ``events``, closing the stream however it ends."""
    with anyio.fail_after(WAIT):
        async with aclosing(adapter.stream(request)) as stream:
            async for event in stream:
                # One by one, not a comprehension: the events before a failure are kept.
                events.append(event)  # noqa: PERF401


async def complete(adapter: OpenAiChatAdapter, request: CompletionRequest = HELLO) -> list[CompletionEvent]:
    events: list[CompletionEvent] = []
    await consume(adapter, events, request)
    return events


async def fail(
    adapter: OpenAiChatAdapter, request: CompletionRequest = HELLO
) -> tuple[list[CompletionEvent], LlmError]:
    """The events yielded before the completion failed, and the error."""
    events: list[CompletionEvent] = []
    with pytest.raises(LlmError) as caught:
        await consume(adapter, events, request)
    return events, caught.value


def completion_url(server: ChatCompletionsServer) -> str:
    return f"{server.base_url}/chat/completions"


# Streaming


async def test_streamed_text_arrives_as_exact_deltas_then_the_assembled_message() -> None:
    async with serve(StreamedReply(text=("Hel", "lo, ", "world."))) as server, adapter_for(server) as adapter:
        as_protocol: LlmAdapter = adapter  # the type checker verifies the protocol is met
        assert isinstance(as_protocol, LlmAdapter)
        events = await complete(adapter)
    assert events == [
        TextDelta("Hel"),
        TextDelta("lo, "),
        TextDelta("world."),
        Completion(Message.assistant("Hello, world."), "stop", None),
    ]


async def test_two_parallel_tool_calls_streamed_in_interleaved_pieces_are_assembled_exactly() -> None:
    reply = StreamedReply(
        text="Checking.",
        tool_calls=[
            ToolCallReply("call_weather", "get_weather", ('{"city":', ' "Paris"}')),
            ToolCallReply("call_time", "get_time", ('{"tz":', ' "CET"', "}")),
        ],
        interleave=True,
    )
    async with serve(reply) as server, adapter_for(server) as adapter:
        events = await complete(adapter)
    assert events == [
        TextDelta("Checking."),
        ToolCallDelta(0, "call_weather", "get_weather", ""),
        ToolCallDelta(1, "call_time", "get_time", ""),
        ToolCallDelta(0, None, None, '{"city":'),
        ToolCallDelta(1, None, None, '{"tz":'),
        ToolCallDelta(0, None, None, ' "Paris"}'),
        ToolCallDelta(1, None, None, ' "CET"'),
        ToolCallDelta(1, None, None, "}"),
        Completion(
            Message.assistant(
                "Checking.",
                [
                    ToolCall("call_weather", "get_weather", '{"city": "Paris"}'),
                    ToolCall("call_time", "get_time", '{"tz": "CET"}'),
                ],
            ),
            "tool_calls",
            None,
        ),
    ]


async def test_a_tool_call_split_into_many_chunks_keeps_its_arguments_verbatim() -> None:
    arguments = '{"path": "docs/README.md", "lines": [1, 20]}'
    reply = StreamedReply(tool_calls=[ToolCallReply("call_1", "read_file", arguments, chunks=7)])
    async with serve(reply) as server, adapter_for(server) as adapter:
        events = await complete(adapter)
    pieces = [event for event in events if isinstance(event, ToolCallDelta)]
    assert len(pieces) == 8  # the header piece, then seven argument pieces
    assert "".join(piece.arguments for piece in pieces) == arguments
    assert events[-1] == Completion(
        Message.assistant("", [ToolCall("call_1", "read_file", arguments)]), "tool_calls", None
    )


async def test_the_request_body_carries_messages_with_a_tool_round_trip_tools_and_response_format() -> None:
    call = ToolCall("call_1", "read_file", '{"path": "README.md"}')
    request = CompletionRequest(
        messages=(
            Message.system("You are terse."),
            Message.user("What is in README.md?"),
            Message.assistant("", [call]),
            Message.tool_result(call, "# Hello"),
        ),
        tools=(
            ToolSpec(
                "read_file",
                "Read a file.",
                {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
            ),
        ),
        response_schema={"type": "object", "properties": {"answer": {"type": "string"}}},
        max_tokens=256,
    )
    async with (
        serve(StreamedReply(text='{"answer": "Hello"}')) as server,
        adapter_for(server, extra_body={"temperature": 0}) as adapter,
    ):
        await complete(adapter, request)
    assert [received.json for received in server.requests] == [
        {
            "model": "stub-model",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is in README.md?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "read_file", "arguments": '{"path": "README.md"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "# Hello"},
            ],
            "stream": True,
            "stream_options": {"include_usage": True},
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "read_file",
                        "description": "Read a file.",
                        "parameters": {
                            "type": "object",
                            "properties": {"path": {"type": "string"}},
                            "required": ["path"],
                        },
                    },
                }
            ],
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "output",
                    "schema": {"type": "object", "properties": {"answer": {"type": "string"}}},
                    "strict": False,
                },
            },
            "max_tokens": 256,
            "temperature": 0,
        }
    ]
    received = server.requests[0]
    assert (received.method, received.path) == ("POST", "/v1/chat/completions")
    assert received.headers["authorization"] == f"Bearer {KEY}"
    assert received.headers["content-type"] == "application/json"
    assert received.headers["accept"] == "text/event-stream"


async def test_a_plain_request_sends_no_tools_response_format_or_max_tokens() -> None:
    async with serve(StreamedReply(text="Hi")) as server, adapter_for(server) as adapter:
        await complete(adapter)
    assert server.requests[0].json == {
        "model": "stub-model",
        "messages": [{"role": "user", "content": "Say hello."}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        pytest.param(
            {
                "prompt_tokens": 12,
                "completion_tokens": 5,
                "total_tokens": 17,
                "prompt_tokens_details": {"cached_tokens": 8},
                "completion_tokens_details": {"reasoning_tokens": 3},
            },
            Usage(input_tokens=12, output_tokens=5, total_tokens=17, thought_tokens=3, cached_read_tokens=8),
            id="openai",
        ),
        pytest.param(
            {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42, "prompt_cache_hit_tokens": 32},
            Usage(input_tokens=40, output_tokens=2, total_tokens=42, cached_read_tokens=32),
            id="deepseek",
        ),
        pytest.param(
            {"prompt_tokens": 7, "completion_tokens": 1},
            Usage(input_tokens=7, output_tokens=1),
            id="minimal",
        ),
    ],
)
async def test_usage_is_mapped_from_the_usage_chunk(usage: dict[str, Any], expected: Usage) -> None:
    async with serve(StreamedReply(text="ok", usage=usage)) as server, adapter_for(server) as adapter:
        events = await complete(adapter)
    assert events[-1] == Completion(Message.assistant("ok"), "stop", expected)


@pytest.mark.parametrize(
    ("sent", "has_tool_call", "expected"),
    [
        ("stop", False, "stop"),
        ("length", False, "length"),
        ("content_filter", False, "content_filter"),
        ("tool_calls", True, "tool_calls"),
        ("function_call", True, "tool_calls"),
        ("stop", True, "tool_calls"),
        (None, False, "stop"),
        (None, True, "tool_calls"),
    ],
)
async def test_the_finish_reason_is_mapped(sent: str | None, has_tool_call: bool, expected: str) -> None:
    calls = [ToolCallReply("call_1", "noop", "{}")] if has_tool_call else []
    async with (
        serve(StreamedReply(text="x", tool_calls=calls, finish_reason=sent)) as server,
        adapter_for(server) as adapter,
    ):
        events = await complete(adapter)
    final = events[-1]
    assert isinstance(final, Completion)
    assert final.finish_reason == expected


async def test_a_stream_without_done_that_gave_a_finish_reason_completes() -> None:
    async with serve(StreamedReply(text="Hi", done=False)) as server, adapter_for(server) as adapter:
        events = await complete(adapter)
    assert events == [TextDelta("Hi"), Completion(Message.assistant("Hi"), "stop", None)]


async def test_a_non_streamed_json_reply_is_parsed_whole() -> None:
    reply = JsonReply(
        text="Reading it.",
        tool_calls=[ToolCallReply("call_7", "read_file", '{"path": "a.txt"}')],
        usage={"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
    )
    async with serve(reply) as server, adapter_for(server) as adapter:
        events = await complete(adapter)
    assert events == [
        TextDelta("Reading it."),
        ToolCallDelta(0, "call_7", "read_file", '{"path": "a.txt"}'),
        Completion(
            Message.assistant("Reading it.", [ToolCall("call_7", "read_file", '{"path": "a.txt"}')]),
            "tool_calls",
            Usage(input_tokens=9, output_tokens=4, total_tokens=13),
        ),
    ]


# Retries


async def test_a_429_is_retried_after_the_retry_after_delay(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="subagent.runtime.openai")
    # The backoff alone would wait 5 s or more: finishing within the bound proves Retry-After was used.
    async with (
        serve(ErrorReply(429, "Rate limit reached", retry_after=0.05), StreamedReply(text="ok")) as server,
        adapter_for(server, backoff=10.0, max_backoff=10.0) as adapter,
    ):
        started = anyio.current_time()
        with anyio.fail_after(2):
            events = await complete(adapter)
        elapsed = anyio.current_time() - started
    assert events == [
        Retrying(attempt=1, attempts=3, delay=0.05, reason="rate_limited, HTTP 429"),
        TextDelta("ok"),
        Completion(Message.assistant("ok"), "stop", None),
    ]
    assert len(server.requests) == 2
    assert 0.045 <= elapsed < 2  # a timer may fire a hair early
    assert [record.getMessage() for record in caplog.records if record.name == "subagent.runtime.openai"] == [
        f"chat completion attempt 1 of 3 failed (HTTP 429), retrying in 0.05 s: {completion_url(server)} "
        "answered HTTP 429 Too Many Requests: 'Rate limit reached'"
    ]


async def test_a_retry_after_longer_than_max_backoff_waits_only_max_backoff() -> None:
    async with (
        serve(ErrorReply(429, retry_after=3600), StreamedReply(text="ok")) as server,
        adapter_for(server, max_backoff=0.01) as adapter,
    ):
        started = anyio.current_time()
        events = await complete(adapter)
        elapsed = anyio.current_time() - started
    assert events[-1] == Completion(Message.assistant("ok"), "stop", None)
    assert len(server.requests) == 2
    assert elapsed < 1


async def test_a_429_still_there_after_the_retries_is_rate_limited() -> None:
    async with (
        serve(*[ErrorReply(429, "Slow down", retry_after=0)] * 2, ErrorReply(429, retry_after=7)) as server,
        adapter_for(server) as adapter,
    ):
        _, error = await fail(adapter)
    assert (error.kind, error.status, error.attempts) == (LlmErrorKind.RATE_LIMITED, 429, 3)
    assert error.retry_after == 7  # what the server asked for last, for a caller that retries later
    assert len(server.requests) == 3


async def test_repeated_5xx_give_a_server_error_after_max_retries_plus_one_attempts() -> None:
    async with (
        serve(*[ErrorReply(503, "The engine is overloaded")] * 4) as server,
        adapter_for(server, max_retries=3) as adapter,
    ):
        events, error = await fail(adapter)
    # A Retrying before each retry, none after the last attempt; the delays are jittered backoff.
    retries = [event for event in events if isinstance(event, Retrying)]
    assert len(events) == len(retries) == 3
    assert [(retry.attempt, retry.attempts, retry.reason) for retry in retries] == [
        (1, 4, "server, HTTP 503"),
        (2, 4, "server, HTTP 503"),
        (3, 4, "server, HTTP 503"),
    ]
    assert (error.kind, error.status, error.attempts) == (LlmErrorKind.SERVER, 503, 4)
    assert str(error) == (
        f"{completion_url(server)} answered HTTP 503 Service Unavailable: 'The engine is overloaded' "
        "(gave up after 4 attempts)"
    )
    assert len(server.requests) == 4


async def test_a_long_error_body_is_quoted_truncated() -> None:
    async with (
        serve(ErrorReply(500, body="<html>" + "x" * 5000 + "</html>")) as server,
        adapter_for(server, max_retries=0) as adapter,
    ):
        _, error = await fail(adapter)
    assert str(error) == (
        f"{completion_url(server)} answered HTTP 500 Internal Server Error: "
        f"{'<html>' + 'x' * 194!r} (truncated, 5013 characters)"
    )


async def test_a_401_is_an_auth_error_without_retry() -> None:
    async with (
        serve(ErrorReply(401, "Invalid authentication"), StreamedReply(text="never")) as server,
        adapter_for(server) as adapter,
    ):
        _, error = await fail(adapter)
    assert (error.kind, error.status, error.attempts) == (LlmErrorKind.AUTH, 401, 1)
    assert str(error) == f"{completion_url(server)} answered HTTP 401 Unauthorized: 'Invalid authentication'"
    assert len(server.requests) == 1


async def test_a_403_without_a_configured_key_says_that_none_was_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SUBAGENT_TEST_KEY", raising=False)
    async with (
        serve(ErrorReply(403, "Forbidden")) as server,
        adapter_for(server, api_key=None, api_key_env="SUBAGENT_TEST_KEY") as adapter,
    ):
        _, error = await fail(adapter)
    assert (error.kind, error.status, error.attempts) == (LlmErrorKind.AUTH, 403, 1)
    assert str(error) == (
        f"{completion_url(server)} answered HTTP 403 Forbidden: 'Forbidden' "
        "(no API key was sent: $SUBAGENT_TEST_KEY is not set)"
    )


async def test_another_4xx_is_a_bad_request_without_retry() -> None:
    async with (
        serve(ErrorReply(404, "The model `gpt-9` does not exist"), StreamedReply(text="never")) as server,
        adapter_for(server) as adapter,
    ):
        _, error = await fail(adapter)
    assert (error.kind, error.status, error.attempts) == (LlmErrorKind.BAD_REQUEST, 404, 1)
    assert str(error) == (
        f"{completion_url(server)} answered HTTP 404 Not Found: 'The model `gpt-9` does not exist'"
    )
    assert len(server.requests) == 1


@pytest.mark.parametrize("after_headers", [False, True], ids=["before-the-status-line", "after-the-headers"])
async def test_a_connection_dropped_before_any_byte_of_the_body_is_retried_and_succeeds(
    after_headers: bool,
) -> None:
    async with (
        serve(DropConnection(after_headers=after_headers), StreamedReply(text=("o", "k"))) as server,
        adapter_for(server) as adapter,
    ):
        events = await complete(adapter)
    retrying, *answer = events
    # The first backoff of 0.001 s with equal jitter: between half of it and all of it.
    assert isinstance(retrying, Retrying)
    assert 0.0005 <= retrying.delay <= 0.001
    assert (retrying.attempt, retrying.attempts, retrying.reason) == (1, 3, "connection")
    assert answer == [TextDelta("o"), TextDelta("k"), Completion(Message.assistant("ok"), "stop", None)]
    assert len(server.requests) == 2


async def test_drops_before_any_byte_on_every_attempt_are_a_connection_error() -> None:
    async with serve(*[DropConnection()] * 3) as server, adapter_for(server) as adapter:
        _, error = await fail(adapter)
    assert (error.kind, error.status, error.attempts) == (LlmErrorKind.CONNECTION, None, 3)
    assert str(error) == (
        f"the connection to {completion_url(server)} failed before any answer: "
        "Server disconnected without sending a response. (gave up after 3 attempts)"
    )


async def test_a_drop_mid_stream_is_a_connection_error_without_retry() -> None:
    async with (
        # Events: the role chunk, "Hel", "lo", then the connection is cut.
        serve(
            StreamedReply(text=("Hel", "lo", " world"), drop_after=3), StreamedReply(text="again")
        ) as server,
        adapter_for(server) as adapter,
    ):
        events, error = await fail(adapter)
    assert events == [TextDelta("Hel"), TextDelta("lo")]
    assert (error.kind, error.status, error.attempts) == (LlmErrorKind.CONNECTION, None, 1)
    assert str(error) == (
        f"the connection to {completion_url(server)} dropped mid-stream: "
        "peer closed connection without sending complete message body (incomplete chunked read)"
    )
    assert len(server.requests) == 1


async def test_a_connection_refused_is_a_connection_error_after_the_retries() -> None:
    async with serve() as server:
        base_url = server.base_url
    # The server is gone: its port refuses connections.
    async with OpenAiChatAdapter(
        model="m", base_url=base_url, api_key_env=None, max_retries=1, backoff=0.001, max_backoff=0.01
    ) as adapter:
        _, error = await fail(adapter)
    assert (error.kind, error.attempts) == (LlmErrorKind.CONNECTION, 2)
    assert str(error).startswith(f"the connection to {base_url}/chat/completions failed before any answer: ")


# The wire format


@pytest.mark.parametrize(
    ("reply", "expected_events", "message"),
    [
        pytest.param(
            MalformedChunk(data='{"choices": [{"index": 0, "delta": {"content": "tru', text_before=("Hel",)),
            [TextDelta("Hel")],
            "chunk #3 of the stream is not valid JSON (Input data was truncated): "
            '\'{"choices": [{"index": 0, "delta": {"content": "tru\'',
            id="invalid-json",
        ),
        pytest.param(
            MalformedChunk(data="[1, 2]"),
            [],
            "chunk #2 of the stream is not a chat-completion chunk (Expected `object`, got `array`): "
            "'[1, 2]'",
            id="not-an-object",
        ),
        pytest.param(
            MalformedChunk(data='{"id": "chatcmpl-1"}'),
            [],
            'chunk #2 of the stream has no choices: \'{"id": "chatcmpl-1"}\'',
            id="no-choices",
        ),
        pytest.param(
            MalformedChunk(data='{"choices": [{"index": 0, "delta": {"content": 3}}]}'),
            [],
            "chunk #2 of the stream is not a chat-completion chunk (Expected `str | null`, got `int` - at "
            '`$.choices[0].delta.content`): \'{"choices": [{"index": 0, "delta": {"content": 3}}]}\'',
            id="wrong-type",
        ),
    ],
)
async def test_a_malformed_chunk_is_a_protocol_error_naming_the_problem(
    reply: MalformedChunk, expected_events: list[CompletionEvent], message: str
) -> None:
    async with serve(reply, StreamedReply(text="again")) as server, adapter_for(server) as adapter:
        events, error = await fail(adapter)
    assert events == expected_events
    assert (error.kind, error.status, error.attempts) == (LlmErrorKind.PROTOCOL, None, 1)
    assert str(error) == message
    assert len(server.requests) == 1


async def test_events_split_across_reads_with_crlf_endings_and_comments_are_parsed() -> None:
    raw = RawStream(
        [
            ": keep-alive\r\n\r\n",
            'data: {"choices": [{"index": 0, "delta": {"content": "Hel',
            'lo"}}]}\r\n',
            "\r\nevent: message\r\ndata: ",
            '{"choices": [{"index": 0, "delta": {"content": " w\u00f6rld"}}]}\r\n\r\n',
            'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\r\n\r\n',
            "data: [DONE]\r\n\r\n",
        ]
    )
    async with serve(raw) as server, adapter_for(server) as adapter:
        events = await complete(adapter)
    assert events == [
        TextDelta("Hello"),
        TextDelta(" wörld"),
        Completion(Message.assistant("Hello wörld"), "stop", None),
    ]


async def test_tool_call_pieces_without_index_or_id_are_told_apart_and_given_ids() -> None:
    def piece(call: dict[str, Any]) -> str:
        return "data: " + json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}) + "\n\n"

    raw = RawStream(
        [
            piece({"function": {"name": "first", "arguments": "{}"}}),
            piece({"index": 1, "function": {"name": "second", "arguments": '{"n"'}}),
            piece({"function": {"arguments": ": 2}"}}),
            'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}\n\n',
        ]
    )
    async with serve(raw) as server, adapter_for(server) as adapter:
        events = await complete(adapter)
    assert events[-1] == Completion(
        Message.assistant("", [ToolCall("call_0", "first", "{}"), ToolCall("call_1", "second", '{"n": 2}')]),
        "tool_calls",
        None,
    )


async def test_a_body_that_is_not_events_is_a_protocol_error_quoting_it() -> None:
    page = "<html><body>Please log in</body></html>"
    async with serve(RawStream([page], content_type="text/html")) as server, adapter_for(server) as adapter:
        _, error = await fail(adapter)
    assert (error.kind, error.attempts) == (LlmErrorKind.PROTOCOL, 1)
    assert str(error) == (
        f"the stream from {completion_url(server)} ended early: no data event in 39 bytes of text/html body: "
        f"{page!r}"
    )


async def test_an_error_object_mid_stream_is_a_server_error() -> None:
    reply = MalformedChunk(data='{"error": {"message": "model crashed", "code": 500}}', text_before=("Hi",))
    async with serve(reply) as server, adapter_for(server) as adapter:
        events, error = await fail(adapter)
    assert events == [TextDelta("Hi")]
    assert (error.kind, error.attempts) == (LlmErrorKind.SERVER, 1)
    assert str(error) == "the server reported an error mid-stream: 'model crashed'"


async def test_a_stream_that_ends_without_done_or_a_finish_reason_is_a_protocol_error() -> None:
    async with (
        serve(StreamedReply(text=("Hel", "lo"), finish_reason=None, done=False)) as server,
        adapter_for(server) as adapter,
    ):
        events, error = await fail(adapter)
    assert events == [TextDelta("Hel"), TextDelta("lo")]
    assert (error.kind, error.attempts) == (LlmErrorKind.PROTOCOL, 1)
    assert str(error) == (
        f"the stream from {completion_url(server)} ended early: after 3 chunks, "
        "with neither a finish_reason nor [DONE]"
    )


# Timeouts and cancellation


async def test_a_stall_before_any_answer_is_a_timeout_within_the_configured_timeout() -> None:
    async with serve(StallReply()) as server, adapter_for(server, timeout=0.1, max_retries=0) as adapter:
        started = anyio.current_time()
        with anyio.fail_after(2):
            _, error = await fail(adapter)
        elapsed = anyio.current_time() - started
    assert (error.kind, error.status, error.attempts) == (LlmErrorKind.TIMEOUT, None, 1)
    assert str(error) == f"no progress from {completion_url(server)} within 0.1 s waiting for the answer"
    assert 0.1 <= elapsed < 1


async def test_a_stall_before_any_answer_is_retried() -> None:
    async with (
        serve(StallReply(after_headers=True), StreamedReply(text="ok")) as server,
        adapter_for(server, timeout=0.1) as adapter,
    ):
        events = await complete(adapter)
        # The abandoned first attempt was hung up on, not left open.
        with anyio.fail_after(WAIT):
            await server.requests[0].disconnected.wait()
    assert events[-1] == Completion(Message.assistant("ok"), "stop", None)
    assert len(server.requests) == 2


async def test_a_stall_mid_stream_is_a_timeout_without_retry() -> None:
    async with (
        serve(StreamedReply(text=("Hel", "lo"), stall_after=2), StreamedReply(text="again")) as server,
        adapter_for(server, timeout=0.1) as adapter,
    ):
        events, error = await fail(adapter)
    assert events == [TextDelta("Hel")]
    assert (error.kind, error.attempts) == (LlmErrorKind.TIMEOUT, 1)
    assert str(error) == f"no progress from {completion_url(server)} within 0.1 s mid-stream"
    assert len(server.requests) == 1


async def test_closing_the_stream_early_closes_the_connection_at_once() -> None:
    async with (
        serve(StreamedReply(text=("one", "two", "three"), stall_after=2)) as server,
        adapter_for(server) as adapter,
    ):
        received: list[CompletionEvent] = []
        with anyio.fail_after(WAIT):
            async with aclosing(adapter.stream(HELLO)) as stream:
                async for event in stream:
                    received.append(event)
                    break
            await server.requests[0].disconnected.wait()
    assert received == [TextDelta("one")]


async def test_cancelling_the_consumer_closes_the_connection_at_once() -> None:
    async with (
        serve(StreamedReply(text=("one", "two", "three"), stall_after=2)) as server,
        adapter_for(server) as adapter,
    ):
        first = anyio.Event()
        received: list[CompletionEvent] = []

        async def consumer() -> None:
            async with aclosing(adapter.stream(HELLO)) as stream:
                async for event in stream:
                    received.append(event)
                    first.set()

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consumer)
                await first.wait()
                tg.cancel_scope.cancel()
            await server.requests[0].disconnected.wait()
    assert received == [TextDelta("one")]


async def test_cancelling_during_a_retry_delay_stops_at_once() -> None:
    async with (
        serve(ErrorReply(503), StreamedReply(text="never")) as server,
        adapter_for(server, backoff=60.0, max_backoff=60.0) as adapter,
    ):
        # The cancel must land in the 60 s retry delay, after the first request was answered: 0.1 s was too
        # soon for that on a loaded machine (the request itself was cancelled, and none had been served).
        with anyio.move_on_after(2) as scope:
            await complete(adapter)
    assert scope.cancelled_caught
    assert len(server.requests) == 1


# Credentials


async def test_the_api_key_appears_in_no_log_record_repr_or_error(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore", "subagent"):
        caplog.set_level(logging.DEBUG, logger=name)
    script = (
        ErrorReply(429, f"Rate limited for key {KEY}", retry_after=0),
        StreamedReply(text="ok"),
        ErrorReply(401, f"Incorrect API key provided: {KEY}"),
        ErrorReply(503, body=f"upstream said {KEY}"),
        ErrorReply(503, body=f"upstream said {KEY}"),
    )
    async with serve(*script) as server, adapter_for(server, max_retries=1) as adapter:
        answered = await complete(adapter)
        _, auth_error = await fail(adapter)
        server_events, server_error = await fail(adapter)
    assert len(server.requests) == 5
    # The Retrying events name the failure's kind and status only, never its body.
    assert answered[0] == Retrying(1, 2, 0, "rate_limited, HTTP 429")
    assert [(event.attempt, event.reason) for event in server_events if isinstance(event, Retrying)] == [
        (1, "server, HTTP 503")
    ]
    assert all(received.headers["authorization"] == f"Bearer {KEY}" for received in server.requests)
    # The capture did see the HTTP stack's debug records and our retry record.
    assert {record.name.split(".")[0] for record in caplog.records} >= {"httpx", "httpcore", "subagent"}
    for record in caplog.records:
        assert KEY not in record.getMessage()
        assert KEY not in repr(record.args)
    assert KEY not in caplog.text
    assert KEY not in repr(adapter)
    assert repr(adapter) == f"OpenAiChatAdapter(model='stub-model', base_url={server.base_url!r})"
    for error in (auth_error, server_error):
        assert KEY not in str(error)
        assert KEY not in repr(error)
    assert str(auth_error) == (
        f"{completion_url(server)} answered HTTP 401 Unauthorized: 'Incorrect API key provided: [redacted]'"
    )
    assert str(server_error) == (
        f"{completion_url(server)} answered HTTP 503 Service Unavailable: 'upstream said [redacted]' "
        "(gave up after 2 attempts)"
    )


async def test_no_authorization_header_is_sent_when_no_key_is_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    async with (
        serve(StreamedReply(text="ok")) as server,
        OpenAiChatAdapter(model="llama3", base_url=server.base_url) as adapter,
    ):
        await complete(adapter)
    assert "authorization" not in server.requests[0].headers


async def test_the_key_is_read_from_the_environment_variable_at_call_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SUBAGENT_TEST_KEY", "sk-first")
    async with (
        serve(StreamedReply(text="1"), StreamedReply(text="2")) as server,
        adapter_for(server, api_key=None, api_key_env="SUBAGENT_TEST_KEY") as adapter,
    ):
        await complete(adapter)
        monkeypatch.setenv("SUBAGENT_TEST_KEY", "sk-rotated")
        await complete(adapter)
    assert [received.headers["authorization"] for received in server.requests] == [
        "Bearer sk-first",
        "Bearer sk-rotated",
    ]


async def test_an_explicit_key_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    async with (
        serve(StreamedReply(text="ok")) as server,
        OpenAiChatAdapter(model="m", base_url=server.base_url, api_key="sk-explicit") as adapter,
    ):
        await complete(adapter)
    assert server.requests[0].headers["authorization"] == "Bearer sk-explicit"


# The HTTP client's lifetime


async def test_an_adapter_given_a_client_leaves_it_open() -> None:
    async with serve(StreamedReply(text="ok")) as server, httpx.AsyncClient() as client:
        async with adapter_for(server, client=client) as adapter:
            events = await complete(adapter)
        assert not client.is_closed
    assert events[-1] == Completion(Message.assistant("ok"), "stop", None)


async def test_an_adapter_used_without_async_with_works_until_aclose() -> None:
    async with serve(StreamedReply(text="ok")) as server:
        adapter = adapter_for(server)
        try:
            events = await complete(adapter)
        finally:
            await adapter.aclose()
        await adapter.aclose()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            await complete(adapter)
    assert events[-1] == Completion(Message.assistant("ok"), "stop", None)


def test_a_base_url_that_is_not_http_is_refused() -> None:
    with pytest.raises(ValueError, match="http"):
        OpenAiChatAdapter(model="m", base_url="ftp://example.com/v1")


async def test_many_sequential_completions_leave_no_task_behind() -> None:
    replies: Sequence[ChatReply] = [StreamedReply(text=f"reply {n}", chunks=3) for n in range(10)]
    async with serve(*replies) as server, adapter_for(server) as adapter:
        texts = []
        for _ in replies:
            final = (await complete(adapter))[-1]
            assert isinstance(final, Completion)
            texts.append(final.message.content)
    assert texts == [f"reply {n}" for n in range(10)]


async def test_a_redirect_is_not_followed_but_is_a_bad_request_naming_its_target() -> None:
    moved = ErrorReply(308, "moved", headers={"Location": "https://elsewhere.example/v1/chat/completions"})
    async with serve(moved, StreamedReply(text="never")) as server, adapter_for(server) as adapter:
        _, error = await fail(adapter)
    assert (error.kind, error.status, error.attempts) == (LlmErrorKind.BAD_REQUEST, 308, 1)
    assert str(error) == (
        f"{completion_url(server)} answered HTTP 308 Permanent Redirect, a redirect to "
        "'https://elsewhere.example/v1/chat/completions': set base_url to where the API is"
    )
    assert len(server.requests) == 1


# Concurrency


async def test_no_more_than_max_concurrent_requests_are_in_flight_and_the_rest_wait_their_turn() -> None:
    release = anyio.Event()
    limit_reached = anyio.Event()
    in_flight = 0
    peak = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if in_flight == 2:
            limit_reached.set()
        try:
            await release.wait()
            yield b'data: {"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}]}\n\n'
            yield b"data: [DONE]\n\n"
        finally:
            in_flight -= 1

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    outcomes: list[CompletionEvent] = []

    async def one(adapter: OpenAiChatAdapter) -> None:
        outcomes.append((await complete(adapter))[-1])

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client,
        OpenAiChatAdapter(
            model="m",
            base_url="http://stub.invalid/v1",
            api_key_env=None,
            client=client,
            max_concurrent_requests=2,
        ) as adapter,
    ):
        with anyio.fail_after(5):
            async with anyio.create_task_group() as task_group:
                for _ in range(5):
                    task_group.start_soon(one, adapter)
                await limit_reached.wait()
                for _ in range(20):  # every waiting completion gets the chance to start, and must not
                    await anyio.lowlevel.checkpoint()
                assert in_flight == 2
                release.set()
    assert peak == 2
    assert outcomes == [Completion(Message.assistant("ok"), "stop", None)] * 5


def test_max_concurrent_requests_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_concurrent_requests must be >= 1 or None, got 0"):
        OpenAiChatAdapter(model="m", max_concurrent_requests=0)
