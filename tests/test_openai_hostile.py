"""The OpenAI-compatible adapter against a hostile server: size caps, the deadline of a call, and
credentials that never leave, on asyncio and trio.

Every wait is bounded by ``anyio.fail_after``; caps and deadlines are configured small so that the
outcome, never the time taken, is what is asserted. Memory is measured with tracemalloc where bounded
memory is the point. The fuzzing of the stream itself is in ``test_openai_sse_fuzz.py``.
"""

from __future__ import annotations

import json
import logging
import tracemalloc
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest

from subagent.runtime import (
    Completion,
    CompletionEvent,
    CompletionRequest,
    LlmError,
    LlmErrorKind,
    Message,
    TextDelta,
    ToolCall,
)
from subagent.runtime.openai import (
    DEFAULT_DEADLINE,
    DEFAULT_MAX_ANSWER_CHARS,
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    OpenAiChatAdapter,
)
from subagent.testing import (
    ChatCompletionsServer,
    ChatReply,
    ErrorReply,
    MalformedChunk,
    RawStream,
    StallReply,
    StreamedReply,
    serve_chat_completions,
)

pytestmark = pytest.mark.anyio

WAIT = 20  # seconds; a hang guard on every wait, never a sleep
HELLO = CompletionRequest((Message.user("Say hello."),))
KEY_ENV = "SUBAGENT_HOSTILE_TEST_KEY"
# Quotes, a backslash, a slash and a plus: its escaped and percent-encoded forms differ from it.
KEY = 'sk-live/Zq+7"x\\y-8c1f0a9d2e7b4c63-end'
KEY_CORE = "8c1f0a9d2e7b4c63"  # any quote of the key long enough to matter shows this


@asynccontextmanager
async def serve(*script: ChatReply) -> AsyncIterator[ChatCompletionsServer]:
    async with serve_chat_completions(script) as server:
        yield server


def adapter_for(server: ChatCompletionsServer, **overrides: Any) -> OpenAiChatAdapter:
    options: dict[str, Any] = {
        "model": "stub-model",
        "base_url": server.base_url,
        "api_key": KEY,
        "api_key_env": None,
        "timeout": 5.0,
        "max_retries": 2,
        "backoff": 0.001,
        "max_backoff": 0.01,
    }
    options.update(overrides)
    return OpenAiChatAdapter(**options)


async def consume(adapter: OpenAiChatAdapter, events: list[CompletionEvent]) -> None:
    with anyio.fail_after(WAIT):
        async with aclosing(adapter.stream(HELLO)) as stream:
            async for event in stream:
                events.append(event)  # noqa: PERF401 (the events before a failure are kept)


async def complete(adapter: OpenAiChatAdapter) -> list[CompletionEvent]:
    events: list[CompletionEvent] = []
    await consume(adapter, events)
    return events


async def fail(adapter: OpenAiChatAdapter) -> tuple[list[CompletionEvent], LlmError]:
    events: list[CompletionEvent] = []
    with pytest.raises(LlmError) as caught:
        await consume(adapter, events)
    return events, caught.value


def chunk(content: str | None = None, *, finish: str | None = None, **delta: Any) -> str:
    """One ``chat.completion.chunk`` as JSON."""
    if content is not None:
        delta["content"] = content
    return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def event(data: str) -> str:
    return f"data: {data}\n\n"


FINISH = event(chunk(finish="stop"))
DONE = "data: [DONE]\n\n"


def url(server: ChatCompletionsServer) -> str:
    return f"{server.base_url}/chat/completions"


@asynccontextmanager
async def peak_memory() -> AsyncIterator[list[int]]:
    """The peak of memory allocated (bytes) while the block ran, appended to the yielded list."""
    tracemalloc.start()
    try:
        yield (peak := [])
        peak.append(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


# -- size caps -------------------------------------------------------------------------------------------


def test_the_caps_and_the_deadline_are_on_by_default_and_refuse_nonsense() -> None:
    adapter = OpenAiChatAdapter(model="m", api_key_env=None)
    assert (adapter.deadline, adapter.max_event_bytes) == (DEFAULT_DEADLINE, DEFAULT_MAX_EVENT_BYTES)
    assert (adapter.max_response_bytes, adapter.max_answer_chars) == (
        DEFAULT_MAX_RESPONSE_BYTES,
        DEFAULT_MAX_ANSWER_CHARS,
    )
    assert OpenAiChatAdapter(model="m", api_key_env=None, deadline=None).deadline is None
    for option, value, message in [
        ("deadline", 0, "deadline must be > 0 seconds or None, got 0"),
        ("max_event_bytes", 0, "max_event_bytes must be >= 1, got 0"),
        ("max_response_bytes", -1, "max_response_bytes must be >= 1, got -1"),
        ("max_answer_chars", 0, "max_answer_chars must be >= 1, got 0"),
    ]:
        options: dict[str, Any] = {option: value}
        with pytest.raises(ValueError, match="must be") as caught:
            OpenAiChatAdapter(model="m", api_key_env=None, **options)
        assert str(caught.value) == message


async def test_a_line_longer_than_max_event_bytes_fails_too_large_after_the_events_before_it() -> None:
    long_line = event(chunk("x" * 2000))
    raw = RawStream([event(chunk("Hel")), long_line, FINISH, DONE])
    async with serve(raw) as server, adapter_for(server, max_event_bytes=1024) as adapter:
        events, error = await fail(adapter)
    assert events == [TextDelta("Hel")]
    assert (error.kind, error.status, error.attempts) == (LlmErrorKind.TOO_LARGE, None, 1)
    assert str(error) == "the stream sent a line longer than 1024 bytes; reading stopped there"
    assert len(server.requests) == 1  # not retried


async def test_an_event_of_many_data_lines_is_capped_on_its_data_exactly_at_max_event_bytes() -> None:
    # JSON may span lines: the event's data is its lines joined by newlines.
    def spread(padding: int) -> str:
        lines = [
            '{"choices": [{"index": 0,',
            ' "delta": {"content": "ok"},' + " " * padding,
            ' "finish_reason": "stop"}]}',
        ]
        return "".join(f"data: {line}\n" for line in lines) + "\n"

    joined = len("\n".join(line.removeprefix("data: ") for line in spread(0).split("\n")[:3]))
    at_cap, past_cap = spread(1024 - joined), spread(1025 - joined)
    async with (
        serve(RawStream([at_cap, DONE]), RawStream([past_cap, DONE])) as server,
        adapter_for(server, max_event_bytes=1024) as adapter,
    ):
        assert await complete(adapter) == [TextDelta("ok"), Completion(Message.assistant("ok"), "stop", None)]
        events, error = await fail(adapter)
    assert events == []
    assert (error.kind, error.attempts) == (LlmErrorKind.TOO_LARGE, 1)
    assert str(error) == "an event of the stream carries more than 1024 bytes of data; reading stopped there"


async def test_an_endless_line_stops_the_reading_at_the_cap_in_bounded_memory() -> None:
    # 256 MiB offered without a newline, in 64 KiB pieces of one shared buffer (the server costs nothing).
    piece = b"data: " + b"x" * (64 * 1024 - 6)
    raw = RawStream([piece] * 4096)
    async with serve(raw) as server, adapter_for(server, max_event_bytes=1024 * 1024) as adapter:
        async with peak_memory() as peak:
            _, error = await fail(adapter)
        with anyio.fail_after(WAIT):
            await server.requests[0].disconnected.wait()  # it hung up on the rest
    assert (error.kind, str(error)) == (
        LlmErrorKind.TOO_LARGE,
        "the stream sent a line longer than 1048576 bytes; reading stopped there",
    )
    # Measured: 1.6 to 1.8 MiB (the pending line, grown in place, and a read's worth).
    assert peak[0] < 8 * 1024 * 1024


async def test_a_non_streamed_body_larger_than_max_response_bytes_stops_the_reading() -> None:
    body = [b'{"choices": [{"index": 0, "message": {"content": "', *([b"y" * 65536] * 1024), b'"}}]}']
    raw = RawStream(body, content_type="application/json")
    async with serve(raw) as server, adapter_for(server, max_response_bytes=1024 * 1024) as adapter:
        async with peak_memory() as peak:
            _, error = await fail(adapter)
        with anyio.fail_after(WAIT):
            await server.requests[0].disconnected.wait()
    assert (error.kind, error.attempts) == (LlmErrorKind.TOO_LARGE, 1)
    assert str(error) == "the JSON completion is larger than 1048576 bytes; reading stopped there"
    assert peak[0] < 8 * 1024 * 1024  # measured: 1.3 to 1.4 MiB


async def test_a_huge_error_body_is_read_no_further_than_16_kib() -> None:
    flood = ErrorReply(500, body="E" * (8 * 1024 * 1024))
    async with serve(flood) as server, adapter_for(server, max_retries=0) as adapter:
        _, error = await fail(adapter)
    assert (error.kind, error.status) == (LlmErrorKind.SERVER, 500)
    assert str(error) == (
        f"{url(server)} answered HTTP 500 Internal Server Error: {'E' * 200!r} (truncated, 16384 characters)"
    )


async def test_an_answer_past_max_answer_chars_fails_at_the_chunk_that_crosses_it() -> None:
    pieces = [event(chunk("a" * 400)) for _ in range(3)]
    async with (
        serve(RawStream([*pieces, FINISH, DONE]), RawStream([*pieces[:2], FINISH, DONE])) as server,
        adapter_for(server, max_answer_chars=1000) as adapter,
    ):
        events, error = await fail(adapter)
        within = await complete(adapter)
    assert events == [TextDelta("a" * 400)] * 2
    assert (error.kind, error.attempts) == (LlmErrorKind.TOO_LARGE, 1)
    assert str(error) == (
        "the answer is longer than 1000 characters (text and tool calls); reading stopped there"
    )
    assert within[-1] == Completion(Message.assistant("a" * 800), "stop", None)


async def test_tool_call_ids_names_and_arguments_count_toward_the_answer_cap() -> None:
    call = {"index": 0, "id": "call_1", "function": {"name": "write", "arguments": "{}"}}
    args = {"index": 0, "function": {"arguments": "x" * 90}}
    stream = [event(chunk(tool_calls=[call])), event(chunk(tool_calls=[args])), FINISH, DONE]
    # "call_1" + "write" + "{}" + 90 characters: 103.
    async with serve(RawStream(stream), RawStream(stream)) as server:
        async with adapter_for(server, max_answer_chars=103) as adapter:
            completed = await complete(adapter)
        async with adapter_for(server, max_answer_chars=102) as adapter:
            _, error = await fail(adapter)
    assert completed[-1] == Completion(
        Message.assistant("", [ToolCall("call_1", "write", "{}" + "x" * 90)]), "tool_calls", None
    )
    assert error.kind == LlmErrorKind.TOO_LARGE


async def test_a_non_streamed_answer_past_max_answer_chars_is_too_large() -> None:
    body = json.dumps({"choices": [{"index": 0, "message": {"content": "z" * 500}, "finish_reason": "stop"}]})
    async with (
        serve(RawStream([body], content_type="application/json")) as server,
        adapter_for(server, max_answer_chars=499) as adapter,
    ):
        _, error = await fail(adapter)
    assert error.kind == LlmErrorKind.TOO_LARGE


async def test_more_than_1024_tool_calls_in_one_answer_are_too_large() -> None:
    calls = [{"index": n, "id": f"c{n}", "function": {"name": "f"}} for n in range(1025)]
    async with (
        serve(RawStream([event(chunk(tool_calls=calls)), DONE])) as server,
        adapter_for(server) as adapter,
    ):
        _, error = await fail(adapter)
    assert (error.kind, str(error)) == (LlmErrorKind.TOO_LARGE, "the answer has more than 1024 tool calls")


async def test_a_flood_of_tiny_deltas_is_held_in_memory_proportional_to_its_text() -> None:
    count = 100_000
    body = "".join(event(chunk("ab")) for _ in range(count)) + FINISH + DONE
    raw = RawStream([body[i : i + 65536] for i in range(0, len(body), 65536)])
    async with serve(raw) as server, adapter_for(server) as adapter:
        final: list[Completion] = []
        async with peak_memory() as peak:
            with anyio.fail_after(WAIT):
                async with aclosing(adapter.stream(HELLO)) as stream:
                    async for item in stream:
                        if isinstance(item, Completion):
                            final.append(item)  # noqa: PERF401
    assert final == [Completion(Message.assistant("ab" * count), "stop", None)]
    # 200 KB of text. Measured: 0.9 to 1.1 MiB; keeping one object per delta went past this bound.
    assert peak[0] < 3 * 1024 * 1024


# -- the deadline of a call ------------------------------------------------------------------------------


async def test_a_server_trickling_one_byte_at_a_time_fails_at_the_deadline_without_retry() -> None:
    answer = event(chunk("Hello")) + FINISH + DONE
    trickle = RawStream([answer[i : i + 1] for i in range(len(answer))], pause=0.05)
    async with (
        serve(trickle, StreamedReply(text="never")) as server,
        # The gap between reads (timeout) is never reached: only the deadline can end this.
        adapter_for(server, timeout=10.0, deadline=0.5) as adapter,
    ):
        _, error = await fail(adapter)
        with anyio.fail_after(WAIT):
            await server.requests[0].disconnected.wait()
    assert (error.kind, error.status, error.attempts) == (LlmErrorKind.DEADLINE, None, 1)
    assert str(error).startswith(
        f"{url(server)} did not finish its answer within the 0.5 s deadline of a model call ("
    )
    assert len(server.requests) == 1


async def test_a_server_that_never_answers_meets_the_deadline_before_the_timeout() -> None:
    async with (
        serve(StallReply(), StreamedReply(text="never")) as server,
        adapter_for(server, timeout=10.0, deadline=0.2) as adapter,
    ):
        _, error = await fail(adapter)
    assert (error.kind, error.attempts) == (LlmErrorKind.DEADLINE, 1)
    assert str(error) == (
        f"{url(server)} did not finish its answer within the 0.2 s deadline of a model call "
        "(0 bytes of this attempt's body had arrived)"
    )
    assert len(server.requests) == 1


async def test_a_retry_that_would_start_past_the_deadline_is_not_made() -> None:
    # The server asks for a minute's wait; the deadline leaves ten seconds: give up now, not in a minute.
    async with (
        serve(ErrorReply(503, "Overloaded", retry_after=60), StreamedReply(text="never")) as server,
        adapter_for(server, deadline=10.0, max_backoff=60.0) as adapter,
    ):
        _, error = await fail(adapter)
    assert (error.kind, error.status, error.attempts, error.retry_after) == (LlmErrorKind.SERVER, 503, 1, 60)
    assert str(error) == (
        f"{url(server)} answered HTTP 503 Service Unavailable: 'Overloaded' "
        "(gave up after 1 attempt: another would start past the call's 10 s deadline)"
    )
    assert len(server.requests) == 1


async def test_retries_within_the_deadline_are_made() -> None:
    async with (
        serve(ErrorReply(503), ErrorReply(429, retry_after=0), StreamedReply(text="ok")) as server,
        adapter_for(server, deadline=10.0) as adapter,
    ):
        events = await complete(adapter)
    assert events[-1] == Completion(Message.assistant("ok"), "stop", None)
    assert len(server.requests) == 3


async def test_the_deadline_counts_from_the_calls_turn_not_from_its_wait_for_one() -> None:
    first_in_flight, release = anyio.Event(), anyio.Event()
    served: list[str] = []

    async def body(text: str, hold: bool) -> AsyncIterator[bytes]:
        if hold:
            first_in_flight.set()
            await release.wait()
        yield event(chunk(text, finish="stop")).encode()

    def answer(request: httpx.Request) -> httpx.Response:
        served.append(text := f"answer {len(served) + 1}")
        stream = body(text, hold=len(served) == 1)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream)

    outcomes: list[CompletionEvent] = []

    async def call(adapter: OpenAiChatAdapter) -> None:
        outcomes.append((await complete(adapter))[-1])

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client,
        OpenAiChatAdapter(
            model="m",
            base_url="http://stub.invalid/v1",
            api_key_env=None,
            client=client,
            max_concurrent_requests=1,
            deadline=None,  # the first call holds the one turn as long as the test wants
        ) as adapter,
    ):
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                group.start_soon(call, adapter)
                await first_in_flight.wait()
                adapter.deadline = 0.2
                group.start_soon(call, adapter)  # waits for the one turn
                await anyio.sleep(0.3)  # the time under test: the second call waits past its deadline
                release.set()
    assert outcomes == [
        Completion(Message.assistant("answer 1"), "stop", None),
        Completion(Message.assistant("answer 2"), "stop", None),
    ]


# -- credentials never leave -----------------------------------------------------------------------------


def leaked_forms(secret: str) -> list[str]:
    """Every form in which ``secret`` could show in a text: raw, escaped once or twice, percent-encoded."""
    once = {
        secret,
        repr(secret)[1:-1],
        json.dumps(secret)[1:-1],
        repr(secret.encode("utf-8", errors="surrogateescape"))[2:-1],
        urllib.parse.quote(secret, safe=""),
        urllib.parse.quote(secret),
        urllib.parse.quote_plus(secret),
    }
    return sorted(once | {repr(form)[1:-1] for form in once} | {json.dumps(form)[1:-1] for form in once})


def exception_texts(error: BaseException) -> Iterator[str]:
    """The texts of every exception reachable from ``error``: causes, contexts, group members, with
    their str, repr, args and notes, and the formatted traceback of the whole chain."""
    import traceback

    yield "".join(traceback.format_exception(error))
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield from (str(current), repr(current), repr(current.args), repr(getattr(current, "__notes__", [])))
        yield repr(vars(current)) if hasattr(current, "__dict__") else ""
        pending += [linked for linked in (current.__cause__, current.__context__) if linked is not None]
        if isinstance(current, BaseExceptionGroup):
            pending += current.exceptions


def assert_never_shown(secret: str, core: str, texts: list[str]) -> None:
    forms = leaked_forms(secret)
    for text in texts:
        assert core not in text
        for form in forms:
            assert form not in text


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore", "subagent"):
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


def log_texts(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [caplog.text] + [
        f"{record.getMessage()} {record.args!r} {record.exc_text}" for record in caplog.records
    ]


@pytest.mark.parametrize(
    ("bad_key", "problem"),
    [
        pytest.param(
            KEY + "\n",
            "it ends with a line break (a newline or carriage return), as a file read unstripped does",
            id="trailing-newline",
        ),
        pytest.param(
            KEY + "\r",
            "it ends with a line break (a newline or carriage return), as a file read unstripped does",
            id="trailing-cr",
        ),
        pytest.param(
            KEY + "\r\n",
            "it ends with a line break (a newline or carriage return), as a file read unstripped does",
            id="trailing-crlf",
        ),
        pytest.param(KEY.replace("Zq", "Zé"), "it has a non-ASCII character", id="non-ascii"),
        pytest.param(
            KEY.replace("Zq", "Z\nq"),
            "it has a control character (a line break, a tab, a NUL)",
            id="inner-newline",
        ),
        pytest.param(
            KEY.replace("Zq", "Z\tq"), "it has a control character (a line break, a tab, a NUL)", id="nul"
        ),
        pytest.param(" " + KEY, "it starts or ends with whitespace", id="leading-space"),
    ],
)
async def test_an_unusable_key_in_the_environment_is_refused_before_any_request_naming_the_variable(
    bad_key: str, problem: str, monkeypatch: pytest.MonkeyPatch, debug_logs: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(KEY_ENV, bad_key)
    async with (
        serve(StreamedReply(text="never")) as server,
        adapter_for(server, api_key=None, api_key_env=KEY_ENV) as adapter,
    ):
        _, error = await fail(adapter)
    assert (error.kind, error.status, error.attempts) == (LlmErrorKind.AUTH, None, 0)
    assert str(error) == f"${KEY_ENV} holds an unusable API key, so no request was made: {problem}"
    assert server.requests == []
    assert_never_shown(bad_key, KEY_CORE, [*exception_texts(error), *log_texts(debug_logs)])


async def test_an_unusable_explicit_key_is_refused_when_the_adapter_is_made() -> None:
    with pytest.raises(LlmError) as caught:
        OpenAiChatAdapter(model="m", api_key=KEY + "\n")
    assert (caught.value.kind, str(caught.value)) == (
        LlmErrorKind.AUTH,
        "api_key holds an unusable API key: it ends with a line break (a newline or carriage return), "
        "as a file read unstripped does",
    )
    assert_never_shown(KEY + "\n", KEY_CORE, list(exception_texts(caught.value)))


async def test_a_header_value_that_cannot_be_sent_is_refused_naming_the_header_not_the_value() -> None:
    with pytest.raises(ValueError, match="cannot be sent") as caught:
        OpenAiChatAdapter(model="m", api_key_env=None, headers={"api-key": KEY + "\r\n"})
    assert str(caught.value) == (
        "the value of header 'api-key' cannot be sent: it has a line break, a control or a non-ASCII "
        "character"
    )
    assert_never_shown(KEY + "\r\n", KEY_CORE, list(exception_texts(caught.value)))


def echoes(secret: str) -> list[str]:
    """Texts a server might send back that quote ``secret``, in the forms servers and proxies use."""
    return [
        f"Incorrect API key provided: {secret}",
        f"Incorrect API key provided: {json.dumps(secret)}",
        f"bad header {urllib.parse.quote(secret, safe='')} or {urllib.parse.quote_plus(secret)}",
        f"rejected {secret!r}",
        # Right at the edge of the quoted excerpt: cut before redaction, a prefix of it would show.
        "x" * 190 + secret,
    ]


@pytest.mark.parametrize("echo", range(len(echoes(KEY))))
async def test_a_key_the_server_echoes_back_is_redacted_from_every_error_and_log(
    echo: int, debug_logs: pytest.LogCaptureFixture
) -> None:
    text = echoes(KEY)[echo]
    body = json.dumps({"error": {"message": text}})
    script = (
        ErrorReply(401, text),
        ErrorReply(400, body=body),
        ErrorReply(503, body=text),  # retried: the retry's log record quotes it too
        ErrorReply(503, body=text),
        MalformedChunk(data=json.dumps({"error": {"message": text}})),
        MalformedChunk(data=f'{{"broken": "{text}'),
        RawStream([text], content_type="text/html"),
    )
    async with serve(*script) as server, adapter_for(server, max_retries=1) as adapter:
        errors = [(await fail(adapter))[1] for _ in range(len(script) - 1)]  # a 503 is retried once
    assert [error.kind for error in errors] == [
        LlmErrorKind.AUTH,
        LlmErrorKind.BAD_REQUEST,
        LlmErrorKind.SERVER,
        LlmErrorKind.SERVER,
        LlmErrorKind.PROTOCOL,
        LlmErrorKind.PROTOCOL,
    ]
    assert "[redacted]" in str(errors[0])  # quoted, but not the key
    assert "sk-live" not in " ".join(map(str, errors))  # no prefix of it either
    texts = [text for error in errors for text in exception_texts(error)]
    assert_never_shown(KEY, KEY_CORE, texts + log_texts(debug_logs) + [repr(adapter)])


async def test_a_redirect_to_a_url_quoting_the_key_is_reported_redacted() -> None:
    # Not checked in the logs: httpcore's own DEBUG trace shows a response's headers as received.
    location = f"https://elsewhere.example/?key={urllib.parse.quote(KEY)}"
    async with (
        serve(ErrorReply(308, headers={"Location": location})) as server,
        adapter_for(server) as adapter,
    ):
        _, error = await fail(adapter)
    assert str(error) == (
        f"{url(server)} answered HTTP 308 Permanent Redirect, a redirect to "
        "'https://elsewhere.example/?key=[redacted]': set base_url to where the API is"
    )
    assert_never_shown(KEY, KEY_CORE, list(exception_texts(error)))


async def test_credential_headers_given_as_headers_are_redacted_like_the_key(
    debug_logs: pytest.LogCaptureFixture,
) -> None:
    azure_key = "az-3f9b27c1d8e6a4f0b5c2"
    token = "tok-5d1e8a7c9b3f2e60"
    script = (
        ErrorReply(401, "Access denied", echo_headers=["api-key"]),
        ErrorReply(401, f"Unknown token {token}"),
        ErrorReply(400, "Unsupported", echo_headers=["x-trace"]),
    )
    headers = {"api-key": azure_key, "Authorization": f"Bearer {token}", "X-Trace": "trace-1"}
    async with serve(*script) as server, adapter_for(server, api_key=None, headers=headers) as adapter:
        errors = [(await fail(adapter))[1] for _ in script]
    assert [str(error) for error in errors] == [
        f"{url(server)} answered HTTP 401 Unauthorized: 'Access denied (api-key: [redacted])'",
        f"{url(server)} answered HTTP 401 Unauthorized: 'Unknown token [redacted]'",
        # An ordinary header is no secret: quoted as sent.
        f"{url(server)} answered HTTP 400 Bad Request: 'Unsupported (x-trace: trace-1)'",
    ]
    assert server.requests[0].headers["api-key"] == azure_key
    texts = [text for error in errors for text in exception_texts(error)] + log_texts(debug_logs)
    assert_never_shown(azure_key, azure_key, texts)
    assert_never_shown(token, token, texts)


async def test_a_transport_error_that_quotes_the_key_is_not_chained_to_the_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        # A proxy or transport that quotes the request's headers in its error (as httpx does for a
        # header value it cannot send).
        raise httpx.ConnectError(f"refused: {request.headers['authorization']!r}", request=request)

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client,
        OpenAiChatAdapter(
            model="m", base_url="http://stub.invalid/v1", api_key=KEY, client=client, max_retries=0
        ) as adapter,
    ):
        _, error = await fail(adapter)
    assert (error.kind, error.attempts) == (LlmErrorKind.CONNECTION, 1)
    assert str(error) == (
        "the connection to http://stub.invalid/v1/chat/completions failed before any answer: "
        "refused: 'Bearer [redacted]'"
    )
    assert error.__cause__ is None
    assert_never_shown(KEY, KEY_CORE, list(exception_texts(error)))


async def test_a_transport_error_without_the_key_stays_chained_for_diagnosis() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client,
        OpenAiChatAdapter(
            model="m", base_url="http://stub.invalid/v1", api_key=KEY, client=client, max_retries=0
        ) as adapter,
    ):
        _, error = await fail(adapter)
    assert isinstance(error.__cause__, httpx.ConnectError)
    assert (
        error.__context__ is None
        or not isinstance(error.__context__, Exception)
        or (KEY_CORE not in repr(error.__context__))
    )
