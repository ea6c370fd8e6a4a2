"""Fuzzing the chat adapter's server-sent-events reading, on asyncio and trio.

Streams are generated (valid answers in every wire style servers use: LF or CRLF, ``data:`` with or
without a space, comments, other fields, a BOM, JSON over several data lines, with or without
``[DONE]``) and mutated (junk lines, flipped bytes, truncation, bad JSON, huge fields, bare CRs,
events repeated), then cut at arbitrary byte boundaries. The properties:

* the SSE decoder gives the same events and the same failure however its input is cut;
* through the loopback stub server, the adapter either completes or raises `LlmError`, never
  anything else and never hangs (a `fail_after` guard); and a stream cut anywhere gives exactly
  what it gives whole. A valid stream's completion is the answer it was made from.

Each example gets its own stub server (a few milliseconds), so that a failing example replays alone.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from subagent.runtime import (
    Completion,
    CompletionEvent,
    CompletionRequest,
    FinishReason,
    LlmError,
    LlmErrorKind,
    Message,
    ToolCall,
)
from subagent.runtime.openai import OpenAiChatAdapter, _SseDecoder
from subagent.testing import ChatCompletionsServer, RawStream, serve_chat_completions
from subagent.types import Usage

pytestmark = [pytest.mark.anyio, pytest.mark.fuzz]

WAIT = 20  # seconds; a hang guard on one example, never a sleep
EVENT_CAP = 2048  # the adapter's max_event_bytes here, so that huge fields cross it
HELLO = CompletionRequest((Message.user("Say hello."),))
FINISH_REASONS: dict[str | None, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
}


# -- generated answers and their wire forms ------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """What a stream says: text pieces, tool calls in pieces, a finish reason, usage."""

    texts: tuple[str, ...]
    calls: tuple[tuple[str, str, tuple[str, ...]], ...]  # (id, name, argument pieces)
    finish: str | None
    usage: dict[str, int] | None

    def completion(self) -> Completion:
        """The completion the adapter makes of this answer."""
        calls = [ToolCall(id, name, "".join(pieces) or "{}") for id, name, pieces in self.calls]
        reason = FINISH_REASONS.get(self.finish)
        if reason is None or (reason == "stop" and calls):
            reason = "tool_calls" if calls else "stop"
        usage = None
        if self.usage is not None:
            usage = Usage(
                input_tokens=self.usage["prompt_tokens"], output_tokens=self.usage["completion_tokens"]
            )
        return Completion(Message.assistant("".join(self.texts), calls), reason, usage)


@dataclass(frozen=True)
class Style:
    """How a server writes the stream."""

    newline: str  # "\n" or "\r\n"
    space: bool  # "data: " or "data:"
    bom: bool
    done: bool
    comments: tuple[int, ...]  # where keep-alive comments and other fields go, by chunk number
    pretty: bool  # JSON over several data lines
    ascii_only: bool  # JSON with \u escapes


texts = st.text(st.characters(codec="utf-8"), max_size=12)
names = st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=8)
answers = st.builds(
    Answer,
    texts=st.lists(texts, max_size=6).map(tuple),
    calls=st.lists(
        st.tuples(names.map(lambda name: f"call_{name}"), names, st.lists(texts, max_size=3).map(tuple)),
        max_size=3,
        unique_by=lambda call: call[0],
    ).map(tuple),
    finish=st.sampled_from(["stop", "length", "tool_calls", None]),
    usage=st.none()
    | st.fixed_dictionaries({"prompt_tokens": st.integers(0, 99), "completion_tokens": st.integers(0, 99)}),
)
styles = st.builds(
    Style,
    newline=st.sampled_from(["\n", "\r\n"]),
    space=st.booleans(),
    bom=st.booleans(),
    done=st.booleans(),
    comments=st.lists(st.integers(0, 12), max_size=4).map(tuple),
    pretty=st.booleans(),
    ascii_only=st.booleans(),
)


def chunks_of(answer: Answer) -> list[dict[str, Any]]:
    def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    chunks = [choice({"role": "assistant", "content": ""})]
    chunks += [choice({"content": text}) for text in answer.texts]
    for index, (call_id, name, pieces) in enumerate(answer.calls):
        head = {
            "index": index,
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        chunks.append(choice({"tool_calls": [head]}))
        chunks += [choice({"tool_calls": [{"index": index, "function": {"arguments": p}}]}) for p in pieces]
    # Without [DONE], the finish reason is what says the answer is whole.
    finish = answer.finish
    chunks.append(choice({}, finish))
    if answer.usage is not None:
        chunks.append({"id": "c", "choices": [], "usage": answer.usage})
    return chunks


def render(answer: Answer, style: Style) -> bytes:
    nl = style.newline
    prefix = "data: " if style.space else "data:"
    out: list[str] = ["\ufeff"] if style.bom else []
    for number, chunk in enumerate(chunks_of(answer)):
        fields = f": keep-alive{nl}event: message{nl}id: {number}{nl}retry: 1000{nl}"
        out += [fields] * style.comments.count(number)
        text = json.dumps(chunk, indent=1 if style.pretty else None, ensure_ascii=style.ascii_only)
        out.append("".join(f"{prefix}{line}{nl}" for line in text.split("\n")) + nl)
    if style.done:
        out.append(f"{prefix}[DONE]{nl}{nl}")
    return "".join(out).encode()


def valid(answer: Answer, style: Style) -> bool:
    """Whether the stream is a whole answer: it ends with [DONE], or gave a finish reason."""
    return style.done or answer.finish is not None


# Mutations: each takes the stream and a draw of random data, and returns the hostile stream.
Mutation = Callable[[bytes, st.DataObject], bytes]


def at(data: st.DataObject, body: bytes) -> int:
    return data.draw(st.integers(0, len(body)), label="position")


def insert_junk_line(body: bytes, data: st.DataObject) -> bytes:
    junk = data.draw(st.binary(max_size=40).filter(lambda raw: b"\n" not in raw), label="junk")
    position = at(data, body)
    return body[:position] + b"\n" + junk + b"\n" + body[position:]


def flip_byte(body: bytes, data: st.DataObject) -> bytes:
    if not body:
        return body
    position = data.draw(st.integers(0, len(body) - 1), label="position")
    return body[:position] + bytes([data.draw(st.integers(0, 255), label="byte")]) + body[position + 1 :]


def truncate(body: bytes, data: st.DataObject) -> bytes:
    return body[: at(data, body)]


def bad_json_event(body: bytes, data: st.DataObject) -> bytes:
    bad = data.draw(
        st.sampled_from([b"{", b'{"choices": [1]}', b"null", b'{"choices": {}}', b"\xff\xfe", b"[]"])
    )
    position = at(data, body)
    return body[:position] + b"\n\ndata: " + bad + b"\n\n" + body[position:]


def huge_field(body: bytes, data: st.DataObject) -> bytes:
    size = data.draw(st.sampled_from([EVENT_CAP - 8, EVENT_CAP + 1, 4 * EVENT_CAP]), label="size")
    kind = data.draw(st.sampled_from([b": ", b"data: ", b"event: ", b'data: {"x": "']), label="field")
    position = at(data, body)
    return body[:position] + b"\n" + kind + b"a" * size + b"\n" + body[position:]


def many_data_lines(body: bytes, data: st.DataObject) -> bytes:
    lines = data.draw(st.integers(1, 3 * EVENT_CAP // 8), label="lines")
    position = at(data, body)
    return body[:position] + b"\n" + b"data: x\n" * lines + b"\n" + body[position:]


def without_done(body: bytes, data: st.DataObject) -> bytes:
    return body.replace(b"[DONE]", b"")


def bare_cr(body: bytes, data: st.DataObject) -> bytes:
    return body.replace(b"\r\n", b"\n").replace(b"\n", b"\r")


def repeat_an_event(body: bytes, data: st.DataObject) -> bytes:
    events = body.split(b"\n\n")
    index = data.draw(st.integers(0, len(events) - 1), label="event")
    return b"\n\n".join([*events[: index + 1], events[index], *events[index + 1 :]])


MUTATIONS: list[Mutation] = [
    insert_junk_line,
    flip_byte,
    truncate,
    bad_json_event,
    huge_field,
    many_data_lines,
    without_done,
    bare_cr,
    repeat_an_event,
]


def cut(body: bytes, data: st.DataObject) -> list[bytes]:
    """``body`` cut at arbitrary boundaries (sometimes at every byte)."""
    if data.draw(st.booleans(), label="every byte") and len(body) < 600:
        return [body[i : i + 1] for i in range(len(body))]
    points = sorted(set(data.draw(st.lists(st.integers(0, len(body)), max_size=12), label="cuts")))
    edges = [0, *points, len(body)]
    return [body[a:b] for a, b in itertools.pairwise(edges) if b > a]


# -- the decoder alone ---------------------------------------------------------------------------------


def decode(pieces: list[bytes], max_bytes: int) -> tuple[list[bytes], str | None]:
    decoder = _SseDecoder(max_bytes)
    events: list[bytes] = []
    for piece in pieces:
        events += decoder.feed(piece)
        if decoder.failure is not None:
            break
    else:
        events += decoder.flush()
    return events, decoder.failure.message if decoder.failure is not None else None


sse_lines = st.lists(
    st.one_of(
        st.builds(lambda raw: b"data: " + raw, st.binary(max_size=30)),
        st.builds(lambda raw: b"data:" + raw, st.binary(max_size=30)),
        st.just(b""),
        st.just(b"\r"),
        st.just(b"data"),
        st.builds(lambda raw: b": " + raw, st.binary(max_size=10)),
        st.binary(max_size=40),
    ).map(lambda line: line.replace(b"\n", b"")),
    max_size=30,
)


@given(lines=sse_lines, ending=st.sampled_from([b"\n", b"\r\n"]), bom=st.booleans(), data=st.data())
def test_the_sse_decoder_gives_the_same_events_and_failure_however_its_input_is_cut(
    lines: list[bytes], ending: bytes, bom: bool, data: st.DataObject
) -> None:
    body = (b"\xef\xbb\xbf" if bom else b"") + b"".join(line + ending for line in lines)
    body += data.draw(st.binary(max_size=8), label="tail")  # maybe an unterminated last line
    max_bytes = data.draw(st.integers(4, 64), label="max_bytes")
    whole = decode([body], max_bytes)
    assert decode(cut(body, data), max_bytes) == whole
    assert decode([body[i : i + 1] for i in range(len(body))], max_bytes) == whole
    if whole[1] is None:
        # Without a cap crossed, every dispatched event is within the cap, and none is empty.
        assert all(0 < len(event) <= max_bytes for event in whole[0])


# -- the adapter through the stub server ---------------------------------------------------------------


@asynccontextmanager
async def loopback() -> AsyncIterator[tuple[ChatCompletionsServer, httpx.AsyncClient]]:
    """A stub server for one example, and a client for it (plain HTTP: no TLS context to load)."""
    async with serve_chat_completions() as server, httpx.AsyncClient(verify=False) as client:
        yield server, client


async def outcome(
    server: ChatCompletionsServer,
    client: httpx.AsyncClient,
    pieces: list[bytes],
    max_answer_chars: int = 1_000_000,
) -> tuple[list[CompletionEvent], Any]:
    """What the adapter makes of a 200 whose body is ``pieces``: its events, and the error's kind and
    message (None when it completed)."""
    server.script.append(RawStream(pieces))
    events: list[CompletionEvent] = []
    error: LlmError | None = None
    adapter = OpenAiChatAdapter(
        model="m",
        base_url=server.base_url,
        api_key_env=None,
        client=client,
        max_retries=0,
        timeout=10,
        max_event_bytes=EVENT_CAP,
        max_answer_chars=max_answer_chars,
    )
    with anyio.fail_after(WAIT):
        try:
            async with aclosing(adapter.stream(HELLO)) as stream:
                async for event in stream:
                    events.append(event)  # noqa: PERF401 (the events before a failure are kept)
        except LlmError as caught:
            error = caught
    if error is None:
        return events, None
    # A stream that came whole can only be malformed, too large, or say it is an error.
    assert error.kind in (LlmErrorKind.PROTOCOL, LlmErrorKind.TOO_LARGE, LlmErrorKind.SERVER)
    return events, (error.kind, str(error))


@given(answer=answers, style=styles, data=st.data())
async def test_a_valid_stream_cut_anywhere_completes_with_exactly_its_answer(
    answer: Answer, style: Style, data: st.DataObject
) -> None:
    body = render(answer, style)
    async with loopback() as (server, client):
        whole = await outcome(server, client, [body])
        assert await outcome(server, client, cut(body, data)) == whole
    events, error = whole
    if valid(answer, style):
        assert error is None
        assert events[-1] == answer.completion()
    else:
        assert error is not None
        assert error[0] == LlmErrorKind.PROTOCOL


@given(
    answer=answers,
    style=styles,
    mutations=st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3),
    data=st.data(),
)
async def test_a_mutated_stream_completes_or_fails_with_an_llm_error_the_same_however_it_is_cut(
    answer: Answer, style: Style, mutations: list[Mutation], data: st.DataObject
) -> None:
    body = render(answer, style)
    for mutate in mutations:
        body = mutate(body, data)
    # A small cap on the answer, sometimes: crossed at the same chunk however the reads fell.
    cap = data.draw(st.sampled_from([1_000_000, 40, 8]), label="max_answer_chars")
    async with loopback() as (server, client):
        whole = await outcome(server, client, [body], cap)
        assert await outcome(server, client, cut(body, data), cap) == whole
    events, error = whole
    assert error is not None or isinstance(events[-1], Completion)
