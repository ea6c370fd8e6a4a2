"""An adapter for OpenAI-compatible chat-completions servers: OpenAI, DeepSeek, vLLM, Ollama, llama.cpp.

:class:`OpenAiChatAdapter` posts a :class:`~subagent.runtime.CompletionRequest` to
``{base_url}/chat/completions`` with ``stream: true`` and turns the server-sent events into completion
events. It retries what is worth retrying (429, 5xx, a connection that failed before any byte of the
answer arrived) with exponential backoff and jitter, and never once output has reached the consumer.
Every failure is a :class:`~subagent.runtime.LlmError`; none of them, and no log record, carries
the API key.

A server is not trusted to behave: one event, one response and one answer each have a size cap, past
which reading stops (``TOO_LARGE``); a whole call has a deadline besides the gap allowed between two
reads (``DEADLINE``); a key that could not be sent as it is (a line break, a non-ASCII character) is
refused before any request (``AUTH``), and what a server echoes of it is redacted from every error.
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import json
import logging
import math
import os
import random
import re
import time
import urllib.parse
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Any, Self

import anyio
import httpx
import msgspec

from subagent._outcome import CloseOnExit
from subagent.runtime._llm import LlmError, LlmErrorKind
from subagent.runtime._messages import (
    Completion,
    CompletionEvent,
    CompletionRequest,
    FinishReason,
    Message,
    Retrying,
    TextDelta,
    ToolCall,
    ToolCallDelta,
)
from subagent.types import Usage, thaw_json

__all__ = [
    "DEFAULT_DEADLINE",
    "DEFAULT_MAX_ANSWER_CHARS",
    "DEFAULT_MAX_CONCURRENT_REQUESTS",
    "DEFAULT_MAX_EVENT_BYTES",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "OpenAiChatAdapter",
]

logger = logging.getLogger(__name__)

_EXCERPT_CHARS = 200
"""How much of a server's text an error message quotes."""
_HEAD_BYTES = 4096
"""How much of a body's start is kept to quote: past the excerpt by more than a key's length, so that
a key echoed near its end is redacted whole before the excerpt is cut."""
_ERROR_BODY_LIMIT = 16 * 1024
"""How much of an error response's body is read: enough for any error object, bounded against a flood."""
_MAX_TOOL_CALLS = 1024
"""Distinct tool calls in one answer: each costs memory however short, and no model makes this many."""
_DRAIN_LIMIT = 64 * 1024
"""After ``[DONE]``, how much we read on to end the body, so the connection can be reused."""
_DRAIN_SECONDS = 0.25
"""After ``[DONE]``, how long we read on to end the body."""
_CLOSE_GRACE = 1.0
"""How long closing a response may spend running httpx's read generators to their end."""

_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "length": "length",
    "content_filter": "content_filter",
}


# The wire format, as far as we read it. Unknown fields are ignored; a field of the wrong type is a
# protocol error that names its JSON path.
class _Wire(msgspec.Struct, gc=False):
    """A decoded piece of a chunk. Decoded JSON is a tree, so the cyclic GC need not track these:
    not tracking them halves the cost of decoding a chunk."""


class _Function(_Wire):
    name: str | None = None
    arguments: str | None = None


class _ToolCallPiece(_Wire):
    index: int | None = None
    id: str | None = None
    function: _Function | None = None


class _Delta(_Wire):
    content: str | None = None
    tool_calls: list[_ToolCallPiece] | None = None


class _Choice(_Wire):
    index: int = 0
    delta: _Delta | None = None
    message: _Delta | None = None
    finish_reason: str | None = None


class _PromptDetails(_Wire):
    cached_tokens: int | None = None


class _CompletionDetails(_Wire):
    reasoning_tokens: int | None = None


class _Usage(_Wire):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None
    completion_tokens_details: _CompletionDetails | None = None
    prompt_cache_hit_tokens: int | None = None  # DeepSeek's name for cached prompt tokens


class _Chunk(_Wire):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_CHUNK_DECODER = msgspec.json.Decoder(_Chunk)


DEFAULT_MAX_CONCURRENT_REQUESTS = 32
"""Completions in flight at once through one adapter, unless told otherwise."""
DEFAULT_DEADLINE = 900.0
"""Seconds one model call may take in all, unless told otherwise: far past any answer a hosted model
streams, and room for a slow local model's long one."""
DEFAULT_MAX_EVENT_BYTES = 4 * 1024 * 1024
"""The longest line of a stream, and the most data one server-sent event may carry: a chunk carries one
delta, a few hundred bytes; a server that sends a whole answer as one chunk still fits."""
DEFAULT_MAX_RESPONSE_BYTES = 16 * 1024 * 1024
"""The largest non-streamed (JSON) completion body."""
DEFAULT_MAX_ANSWER_CHARS = 4 * 1024 * 1024
"""The most characters of text and tool-call ids, names and arguments one answer may add up to: about
a million tokens, several times any model's output limit."""

_CREDENTIAL_HEADER = re.compile(r"auth|key|token|secret|cookie|password|signature|session", re.IGNORECASE)
"""Extra request headers whose values are redacted from errors like the API key (Azure's ``api-key``)."""


class _AttemptFailed(LlmError):
    """One attempt failed, and whether another may help: the retry loop tries again or raises a new
    `LlmError` from it, with the message redacted (this one's is not yet) and the attempts counted."""

    def __init__(
        self,
        kind: LlmErrorKind,
        message: str,
        *,
        status: int | None = None,
        retryable: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(kind, message, status=status, retry_after=retry_after)
        self.retryable = retryable


class _Redactor:
    """Quotes a server's text with every form of our credentials replaced by ``[redacted]``: raw,
    ``repr``- and JSON-escaped (once and twice: an exception's repr escapes its message again),
    percent-encoded. A server may echo a key back, and a transport error may quote a header."""

    def __init__(self, secrets: list[str]) -> None:
        self._secrets = secrets

    @functools.cached_property
    def forms(self) -> list[str]:
        """Every form to redact, worked out at the first failure (a call that succeeds needs none)."""
        forms: set[str] = set()
        for secret in self._secrets:
            once = {escape(form) for form in {secret, secret.strip()} for escape in _ESCAPES}
            forms |= once | {escape(form) for form in once for escape in _ESCAPES[:3]}
        # Longest first: a form inside a longer one must not break the longer one's match.
        return sorted((form for form in forms if form.strip()), key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for form in self.forms:
            if form in text:
                text = text.replace(form, "[redacted]")
        return text

    def found_in(self, text: str) -> bool:
        return any(form in text for form in self.forms)

    def quote(self, raw: bytes | str) -> str:
        """An excerpt of ``raw`` for a message: redacted first, then cut, so no key is cut in two."""
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
        text = self(text).strip()
        if len(text) > _EXCERPT_CHARS:
            return repr(text[:_EXCERPT_CHARS]) + f" (truncated, {len(text)} characters)"
        return repr(text)

    def error_detail(self, raw: bytes) -> str:
        """The readable part of an error body: OpenAI's ``error.message`` when there is one, else an
        excerpt."""
        if not raw.strip():
            return "(empty body)"
        try:
            decoded = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return self.quote(raw)
        error = decoded.get("error") if isinstance(decoded, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return self.quote(error["message"])
        if isinstance(error, str):
            return self.quote(error)
        return self.quote(raw)


_ESCAPES: tuple[Callable[[str], str], ...] = (
    lambda text: text,
    lambda text: repr(text)[1:-1],
    lambda text: json.dumps(text)[1:-1],
    lambda text: repr(text.encode("utf-8", errors="surrogateescape"))[2:-1],
    lambda text: urllib.parse.quote(text, safe=""),
    lambda text: urllib.parse.quote(text),  # "/" kept, as in a URL's path or query
    lambda text: urllib.parse.quote_plus(text),
)


def _exception_texts(error: BaseException) -> list[str]:
    """What a traceback or a log of ``error`` could show: every exception of its chain (causes,
    contexts, groups' members), each as str, repr, args and notes."""
    texts: list[str] = []
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        texts += [str(current), repr(current), repr(current.args), repr(getattr(current, "__notes__", ""))]
        pending += [linked for linked in (current.__cause__, current.__context__) if linked is not None]
        if isinstance(current, BaseExceptionGroup):
            pending += current.exceptions
    return texts


def _key_problem(key: str) -> str | None:
    """Why ``key`` cannot go into a header as it is, in words that never quote it; None if it can."""
    if key.endswith(("\n", "\r")):
        return "it ends with a line break (a newline or carriage return), as a file read unstripped does"
    if not key.isascii():
        return "it has a non-ASCII character"
    if not key.isprintable():
        return "it has a control character (a line break, a tab, a NUL)"
    if key != key.strip():
        return "it starts or ends with whitespace"
    return None


def _retry_after(headers: httpx.Headers) -> float | None:
    """The server's requested delay in seconds: ``retry-after-ms`` (OpenAI), else ``Retry-After`` as
    seconds or as an HTTP date. None when absent or unreadable."""
    milliseconds = headers.get("retry-after-ms")
    if milliseconds is not None:
        try:
            return max(0.0, float(milliseconds) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        return max(0.0, when.timestamp() - time.time())
    return max(0.0, seconds) if seconds == seconds else None  # NaN is unreadable


def _usage(usage: _Usage) -> Usage:
    cached = usage.prompt_cache_hit_tokens
    if usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None:
        cached = usage.prompt_tokens_details.cached_tokens
    details = usage.completion_tokens_details
    return Usage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        thought_tokens=details.reasoning_tokens if details is not None else None,
        cached_read_tokens=cached,
    )


def _message_json(position: int, message: Message) -> dict[str, Any]:
    if message.role == "tool":
        if message.tool_call_id is None:
            raise LlmError(
                LlmErrorKind.BAD_REQUEST, f"message #{position} is a tool result without a tool_call_id"
            )
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    if message.role == "assistant" and message.tool_calls:
        return {
            "role": "assistant",
            # The documented form of a tool-calls-only answer is a null content.
            "content": message.content or None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in message.tool_calls
            ],
        }
    return {"role": message.role, "content": message.content}


def _compact(pieces: list[str], mark: int) -> int:
    """Join the pieces past ``mark`` into one and return the new mark: a flood of tiny deltas then
    costs one string per read, not one object per delta."""
    if len(pieces) - mark > 1:
        pieces[mark:] = ["".join(pieces[mark:])]
    return len(pieces)


class _CallParts:
    __slots__ = ("arguments", "id", "mark", "name")

    def __init__(self) -> None:
        self.id: str | None = None
        self.name: str | None = None
        self.arguments: list[str] = []
        self.mark = 0


class _Assembly:
    """Assembles the answer from chunks, and says what each chunk added as events. Past
    ``max_chars`` characters of text and tool-call ids, names and arguments, it fails.

    The text is counted only once :meth:`count` is called: the caller does so once more bytes have
    arrived than ``max_chars`` (every character of the answer took at least one byte), so that an
    answer of ordinary size costs its hot path nothing, and a long one fails at the very chunk that
    crossed the cap, however the reads fell.
    """

    def __init__(self, max_chars: int) -> None:
        self.text: list[str] = []
        self.calls: dict[int, _CallParts] = {}
        self.last_index: int | None = None
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.max_chars = max_chars
        self.call_chars = 0  # tool calls are few: always counted
        self.text_chars = 0  # counted from `count()` on
        self.feed: Callable[[_Chunk], list[CompletionEvent]] = self._feed
        self._text_mark = 0

    def count(self) -> None:
        """Count the answer's size from now on, chunk by chunk, and fail past the cap."""
        if self.feed != self._feed_counted:
            self.text_chars = sum(map(len, self.text))
            self.feed = self._feed_counted
            self._check()

    def _feed(self, chunk: _Chunk) -> list[CompletionEvent]:
        if chunk.usage is not None:
            self.usage = _usage(chunk.usage)
        events: list[CompletionEvent] = []
        for choice in chunk.choices or ():
            if choice.index != 0:
                continue  # we never ask for n > 1; a server that sends more is ignored past the first
            delta = choice.delta if choice.delta is not None else choice.message
            if delta is not None:
                content = delta.content
                if content:
                    self.text.append(content)
                    events.append(TextDelta(content))
                pieces = delta.tool_calls
                if pieces:
                    events.extend(self._tool_piece(piece) for piece in pieces)
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        return events

    def _feed_counted(self, chunk: _Chunk) -> list[CompletionEvent]:
        text = self.text
        known = len(text)  # compaction happens between reads, never inside a feed
        events = self._feed(chunk)
        self.text_chars += sum(map(len, text[known:]))
        self._check()
        return events

    def _check(self) -> None:
        if self.text_chars + self.call_chars > self.max_chars:
            raise _AttemptFailed(
                LlmErrorKind.TOO_LARGE,
                f"the answer is longer than {self.max_chars} characters (text and tool calls); "
                "reading stopped there",
            )

    def compact(self) -> None:
        """Join what the last read added (called once per read)."""
        self._text_mark = _compact(self.text, self._text_mark)
        for parts in self.calls.values():
            parts.mark = _compact(parts.arguments, parts.mark)

    def _tool_piece(self, piece: _ToolCallPiece) -> ToolCallDelta:
        index = piece.index
        if index is None:
            # Some servers omit the index: a new id starts a new call, anything else continues the last.
            last = self.calls.get(self.last_index) if self.last_index is not None else None
            if last is None:
                index = 0
            elif piece.id and last.id is not None and piece.id != last.id:
                index = max(self.calls) + 1
            else:
                index = self.last_index if self.last_index is not None else 0
        parts = self.calls.get(index)
        if parts is None:
            if len(self.calls) >= _MAX_TOOL_CALLS:
                raise _AttemptFailed(
                    LlmErrorKind.TOO_LARGE, f"the answer has more than {_MAX_TOOL_CALLS} tool calls"
                )
            parts = self.calls[index] = _CallParts()
        self.last_index = index
        name = piece.function.name if piece.function is not None else None
        arguments = piece.function.arguments if piece.function is not None else None
        if piece.id and parts.id is None:
            parts.id = piece.id
            self.call_chars += len(piece.id)
        if name and parts.name is None:
            parts.name = name
            self.call_chars += len(name)
        if arguments:
            parts.arguments.append(arguments)
            self.call_chars += len(arguments)
        return ToolCallDelta(index=index, id=piece.id or None, name=name or None, arguments=arguments or "")

    def completion(self) -> Completion:
        calls: list[ToolCall] = []
        for index in sorted(self.calls):
            parts = self.calls[index]
            if not parts.name:
                raise _AttemptFailed(
                    LlmErrorKind.PROTOCOL, f"tool call #{index} of the answer arrived without a function name"
                )
            calls.append(
                ToolCall(
                    id=parts.id or f"call_{index}",
                    name=parts.name,
                    # No arguments at all is a call without parameters, the same as "{}".
                    arguments="".join(parts.arguments) or "{}",
                )
            )
        reason = _FINISH_REASONS.get(self.finish_reason or "")
        if reason is None or (reason == "stop" and calls):
            # Missing or unknown, or "stop" next to tool calls (Ollama): the calls say what the model wants.
            reason = "tool_calls" if calls else "stop"
        return Completion(Message.assistant("".join(self.text), calls), reason, self.usage)


_BOM = b"\xef\xbb\xbf"


class _SseDecoder:
    """Server-sent events from bytes: the ``data`` of each event; comments and other fields are skipped.
    Lines end in LF or CRLF (a bare CR, which the SSE spec also allows, is sent by no known server).

    A line longer than ``max_bytes`` (its ``\\r`` counted, not its ``\\n``), or an event whose data
    (its lines joined) is longer, sets ``failure`` and ends decoding; the events before it are still
    returned. Whatever the reads' boundaries, the same stream gives the same events and the same
    failure, and no more than about ``max_bytes`` of a pending line or event is ever held.
    """

    def __init__(self, max_bytes: int) -> None:
        self._buffer = bytearray()
        self._data: list[bytes] = []
        self._max = max_bytes
        self._at_start = True
        self.failure: _AttemptFailed | None = None

    def feed(self, chunk: bytes) -> list[bytes]:
        if self.failure is not None:
            return []
        if self._at_start:
            # As the SSE spec says, a byte-order mark opening the stream is skipped (split or not).
            chunk = bytes(self._buffer) + chunk
            self._buffer.clear()
            if len(chunk) < len(_BOM) and _BOM.startswith(chunk):
                self._buffer += chunk
                return []
            self._at_start = False
            chunk = chunk.removeprefix(_BOM)
        if self._buffer:
            if b"\n" not in chunk:
                # Still the same line: grown in place, not copied whole at every read.
                self._buffer += chunk
                if len(self._buffer) > self._max:
                    self.failure = self._line_too_long()
                    self._buffer.clear()
                return []
            chunk = bytes(self._buffer) + chunk
            self._buffer.clear()
        # One C-level split per read: a server sends hundreds of small events per read.
        lines = chunk.split(b"\n")
        rest = lines.pop()
        limit = self._max
        if len(chunk) > limit:  # only then can a whole line of it be too long
            for position, line in enumerate(lines):
                if len(line) > limit:
                    self.failure = self._line_too_long()
                    del lines[position:]
                    break
        if len(rest) > limit:
            # A line that long is not server-sent events: fail rather than buffer without end.
            self.failure = self.failure or self._line_too_long()
        elif self.failure is None:
            self._buffer += rest
        events: list[bytes] = []
        data = self._data
        for line in lines:
            # Inline, the common shapes first: `data: {...}` then a blank line, per event. The blank
            # line's dispatch repeats `_line`'s on purpose: calling it per event took bench/chat_stream.py
            # from 2.5x to 3.3x the floor.
            if line.startswith(b"data: "):
                data.append(line[6:].rstrip(b"\r"))
            elif line == b"" or line == b"\r":
                if data:
                    if len(data) == 1:
                        event = data[0]  # no longer than its line, so within the limit
                    else:
                        event = b"\n".join(data)
                        if len(event) > limit:
                            self._event_too_large()
                            return events
                    data.clear()
                    if event:
                        events.append(event)
            elif not self._line(line[:-1] if line.endswith(b"\r") else line, events):
                return events
        if len(data) > 1:
            # An event of many lines, still open: held as one piece, so its size is known and bounded.
            data[:] = [b"\n".join(data)]
            if len(data[0]) > limit:
                self._event_too_large()
        return events

    def flush(self) -> list[bytes]:
        """The events left when the body ended without a final blank line."""
        events: list[bytes] = []
        if self.failure is not None:
            return events
        if self._buffer:
            line = bytes(self._buffer)
            self._buffer.clear()
            if not self._line(line.rstrip(b"\r"), events):
                return events
        self._line(b"", events)
        return events

    def _line(self, line: bytes, events: list[bytes]) -> bool:
        """Take one line; False when it failed the decoding."""
        if line.startswith(b"data:"):
            self._data.append(line[6:] if line.startswith(b"data: ") else line[5:])
        elif not line:
            if self._data:  # as the SSE spec says, an event with empty data is not dispatched
                data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
                self._data.clear()
                if len(data) > self._max:
                    self._event_too_large()
                    return False
                if data:
                    events.append(data)
        elif line == b"data":
            self._data.append(b"")
        # Anything else is a comment (keep-alives, "OPENROUTER PROCESSING") or a field we do not use.
        return True

    def _line_too_long(self) -> _AttemptFailed:
        return _AttemptFailed(
            LlmErrorKind.TOO_LARGE,
            f"the stream sent a line longer than {self._max} bytes; reading stopped there",
        )

    def _event_too_large(self) -> None:
        self._buffer.clear()
        self._data.clear()
        self.failure = _AttemptFailed(
            LlmErrorKind.TOO_LARGE,
            f"an event of the stream carries more than {self._max} bytes of data; reading stopped there",
        )


class _Body:
    """The body of one response, read chunk by chunk, knowing whether any byte of it arrived. No read
    goes on past the call's deadline."""

    def __init__(self, response: httpx.Response, adapter: OpenAiChatAdapter, deadline: float) -> None:
        self.response = response
        self._adapter = adapter
        self._chunks = response.aiter_bytes()
        self._deadline = deadline
        self.started = False
        self.finished = False
        self.received = 0
        self.head = b""

    async def next(self) -> bytes | None:
        """The next piece of the body, None at its end. Transport failures become `_AttemptFailed`,
        retryable only while no byte of the body has arrived."""
        while True:
            try:
                with anyio.CancelScope(deadline=self._deadline) as scope:
                    chunk = await anext(self._chunks)
            except StopAsyncIteration:
                self.finished = True
                return None
            except httpx.TimeoutException as exc:
                self.finished = True
                raise self._adapter._timeout_failure(exc, body_started=self.started) from exc
            except httpx.DecodingError as exc:
                self.finished = True
                raise _AttemptFailed(
                    LlmErrorKind.PROTOCOL, f"the response body could not be decoded: {exc}"
                ) from exc
            except httpx.TransportError as exc:
                self.finished = True
                raise self._adapter._connection_failure(exc, body_started=self.started) from exc
            except BaseException:
                self.finished = True
                raise
            if scope.cancelled_caught:
                self.finished = True
                raise self._adapter._deadline_failure(self.received)
            if chunk:
                self.started = True
                self.received += len(chunk)
                if len(self.head) < _HEAD_BYTES:
                    self.head += chunk[: _HEAD_BYTES - len(self.head)]
                return chunk

    async def read(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of what is left of the body (never more is read); a failure mid-way
        keeps what arrived."""
        parts: list[bytes] = []
        size = 0
        try:
            while size < limit and (chunk := await self.next()) is not None:
                parts.append(chunk)
                size += len(chunk)
        except _AttemptFailed:
            pass
        return b"".join(parts)[:limit]

    async def close(self) -> None:
        """Close the response at once, whatever state it is in.

        Why the extra reads: httpx reads a body through a chain of nested async generators, and one
        abandoned mid-body is left to the garbage collector (which, on trio, warns and spawns a task to
        finalise it). Once the response is closed the next read fails at once, and that failure runs
        every generator of the chain to its end.
        """
        with anyio.CancelScope(shield=True):
            await self.response.aclose()
            if self.finished:
                return
            self.finished = True
            # Bounded, should a transport ever block on a closed connection instead of failing.
            with anyio.move_on_after(_CLOSE_GRACE):
                try:
                    while True:
                        await anext(self._chunks)
                except Exception:  # the expected read error, or the end of the body
                    pass


class OpenAiChatAdapter(CloseOnExit):
    """Streams completions from an OpenAI-compatible ``/chat/completions`` endpoint over httpx.

    Use it as an async context manager (``async with OpenAiChatAdapter(...) as llm:``), or without one:
    then it creates its HTTP client on first use and ``await aclose()`` must be called when done. An
    adapter closes the client it created, never one it was given (``client=``).

    Args:
        model: the ``model`` of every request.
        base_url: the API root, up to and including the version (``http://localhost:11434/v1``).
        api_key_env: the environment variable read for the key at each request, so a rotated or
            monkeypatched key is picked up; None to read none. A key there that cannot be sent as it
            is (a trailing newline or carriage return, a control or non-ASCII character) fails the
            call with an ``AUTH`` :class:`LlmError` naming the variable, before any request.
        api_key: the key itself; it takes precedence over ``api_key_env``. With no key at all, no
            ``Authorization`` header is sent (local servers need none).
        timeout: seconds allowed to connect, and between any two reads or writes (not the whole answer).
        deadline: seconds one call of :meth:`stream` may take in all, retries and their delays
            included, counted from when it first holds its turn among ``max_concurrent_requests``
            (:data:`DEFAULT_DEADLINE`; None: no deadline). Past it the call fails with a ``DEADLINE``
            :class:`LlmError`: a server that trickles its answer never goes silent for ``timeout``,
            and this is what stops it. A retry that would start past it is not made.
        max_retries: how many times a retryable failure is retried (so ``max_retries + 1`` attempts).
        backoff: the base delay in seconds; attempt ``n`` waits about ``backoff * 2**(n-1)``, with jitter.
        max_backoff: the cap on any delay, the server's ``Retry-After`` included.
        extra_body: fields merged into every request body last, so they win (``temperature``, ``seed``,
            ``max_completion_tokens``...).
        headers: extra request headers; they win over the adapter's own, ``Authorization`` included.
            The values of those named like a credential (``api-key``, ``X-Auth-Token``, ``Cookie``...)
            are redacted from errors as the key is.
        client: an ``httpx.AsyncClient`` to use (a proxy, a custom transport); the adapter's ``timeout``
            still applies to each request, and its own connection limits to the pool.
        max_concurrent_requests: completions in flight at once through this adapter (None: no limit);
            more wait their turn, for as long as it takes, rather than fail. A hundred subagents on
            one adapter would otherwise open a hundred streams: past the HTTP pool's size they time
            out waiting for a connection, and a server's concurrency limit answers 429 meanwhile.
        max_event_bytes: the longest line of a stream, and the most data one server-sent event may
            carry (:data:`DEFAULT_MAX_EVENT_BYTES`).
        max_response_bytes: the largest non-streamed (JSON) completion body
            (:data:`DEFAULT_MAX_RESPONSE_BYTES`); of an error body, at most 16 KiB is read.
        max_answer_chars: the most characters of text and tool-call ids, names and arguments one
            answer may add up to, streamed or not (:data:`DEFAULT_MAX_ANSWER_CHARS`).

        Past a size cap the call fails with a ``TOO_LARGE`` :class:`LlmError`, without retry, and
        reading stops there: what is held for one call stays within a small multiple of the caps.

    Raises:
        ValueError: an argument is out of range, or a header value has a line break, a control or a
            non-ASCII character (the message names the header, never its value).
        LlmError: ``api_key`` cannot be sent as it is (``AUTH``; the message never quotes it).
    """

    bounds_output = True
    """A request's ``max_tokens`` is sent as the call's limit: the server never returns more output."""

    def __init__(
        self,
        *,
        model: str,
        base_url: str = "https://api.openai.com/v1",
        api_key_env: str | None = "OPENAI_API_KEY",
        api_key: str | None = None,
        timeout: float = 60.0,
        deadline: float | None = DEFAULT_DEADLINE,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 20.0,
        extra_body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        client: httpx.AsyncClient | None = None,
        max_concurrent_requests: int | None = DEFAULT_MAX_CONCURRENT_REQUESTS,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        max_answer_chars: int = DEFAULT_MAX_ANSWER_CHARS,
    ) -> None:
        if not model:
            raise ValueError("model must be a non-empty str")
        url = httpx.URL(base_url.rstrip("/") + "/chat/completions")
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if deadline is not None and not deadline > 0:
            raise ValueError(f"deadline must be > 0 seconds or None, got {deadline}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if backoff < 0 or max_backoff < 0:
            raise ValueError(f"backoff and max_backoff must be >= 0, got {backoff} and {max_backoff}")
        if max_concurrent_requests is not None and max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1 or None, got {max_concurrent_requests}")
        for name, cap in (
            ("max_event_bytes", max_event_bytes),
            ("max_response_bytes", max_response_bytes),
            ("max_answer_chars", max_answer_chars),
        ):
            if cap < 1:
                raise ValueError(f"{name} must be >= 1, got {cap}")
        for name, value in (headers or {}).items():
            # httpx would refuse it too, with a message that quotes the value: it may be a key.
            if not (value.isascii() and value.isprintable()):
                raise ValueError(
                    f"the value of header {name!r} cannot be sent: it has a line break, "
                    "a control or a non-ASCII character"
                )
        if api_key is not None and (problem := _key_problem(api_key)) is not None:
            raise LlmError(LlmErrorKind.AUTH, f"api_key holds an unusable API key: {problem}", attempts=0)
        self.max_concurrent_requests = max_concurrent_requests
        self._limiter: anyio.CapacityLimiter | None = None  # made on first use, inside an event loop
        self.model = model
        self._url = url
        # What messages and logs show: never credentials in the URL, nor a query that might hold one.
        self._display_url = str(url.copy_with(username=None, password=None, query=None))
        self._base_url = self._display_url.removesuffix("/chat/completions")
        self._api_key_env = api_key_env
        self._api_key = api_key
        # No pool timeout: the limiter below admits no more streams than the pool has connections, so
        # a request never waits for one (and waiting for our own turn is not the server's silence).
        self._timeout = httpx.Timeout(timeout, pool=None)
        self._timeout_seconds = timeout
        self.deadline = deadline
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_event_bytes = max_event_bytes
        self.max_response_bytes = max_response_bytes
        self.max_answer_chars = max_answer_chars
        self._extra_body = thaw_json(extra_body) if extra_body is not None else {}
        self._headers = dict(headers or {})
        self._client = client
        self._owns_client = client is None
        self._closed = False

    def __repr__(self) -> str:
        return f"OpenAiChatAdapter(model={self.model!r}, base_url={self._base_url!r})"

    async def __aenter__(self) -> Self:
        self._ensure_client()
        return self

    async def aclose(self) -> None:
        """Close the HTTP client if the adapter created it. Idempotent; the adapter is unusable after."""
        self._closed = True
        client, self._client = self._client, None
        if client is not None and self._owns_client:
            await client.aclose()

    def _ensure_client(self) -> httpx.AsyncClient:
        if self._closed:
            raise RuntimeError("this OpenAiChatAdapter is closed")
        if self._client is None:
            limit = self.max_concurrent_requests
            limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=limits)
        return self._client

    def _slot(self) -> AbstractAsyncContextManager[object]:
        """A turn among the completions in flight (none needed without a limit)."""
        if self.max_concurrent_requests is None:
            return contextlib.nullcontext()
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.max_concurrent_requests)
        return self._limiter

    def _key(self) -> str | None:
        if self._api_key:
            return self._api_key
        if self._api_key_env:
            return os.environ.get(self._api_key_env) or None
        return None

    def _redactor(self, key: str | None) -> _Redactor:
        """Redacts ``key`` and the credential headers: a server may echo them back in an error body,
        and such a body is quoted in our messages."""
        secrets = [key] if key else []
        for name, value in self._headers.items():
            if _CREDENTIAL_HEADER.search(name):
                secrets.append(value)
                scheme, _, credential = value.strip().partition(" ")
                if credential and scheme.isalpha():  # "Bearer <token>": the token may be echoed alone
                    secrets.append(credential)
        return _Redactor(secrets)

    def _usable_key(self) -> str | None:
        """The key to send, or None.

        Raises:
            LlmError: it cannot go into a header as it is; the message names where it came from.
        """
        key = self._key()
        if key is None:
            return None
        problem = _key_problem(key)
        if problem is not None:
            source = "api_key" if self._api_key else f"${self._api_key_env}"
            raise LlmError(
                LlmErrorKind.AUTH,
                f"{source} holds an unusable API key, so no request was made: {problem}",
                attempts=0,
            )
        return key

    def request_body(self, request: CompletionRequest) -> dict[str, Any]:
        """The JSON body posted for ``request``: a plain dict, ``extra_body`` merged in last."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [
                _message_json(position, message) for position, message in enumerate(request.messages)
            ],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": thaw_json(tool.parameters),
                    },
                }
                for tool in request.tools
            ]
        if request.response_schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                # Not strict: strict mode refuses many schemas (optional fields...); the runtime validates.
                "json_schema": {
                    "name": "output",
                    "schema": thaw_json(request.response_schema),
                    "strict": False,
                },
            }
        if request.max_tokens is not None:
            body["max_tokens"] = request.max_tokens
        body.update(thaw_json(self._extra_body))
        return body

    def _request_headers(self, key: str | None) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        headers.update(self._headers)
        return headers

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_backoff)
        ceiling = min(self.max_backoff, self.backoff * 2.0 ** (attempt - 1))
        # Equal jitter: at least half the exponential delay, so that clients that failed together spread out.
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    async def stream(self, request: CompletionRequest) -> AsyncGenerator[CompletionEvent, None]:
        """Yield text and tool-call deltas as they arrive, then one :class:`Completion`.

        Close the iterator (``contextlib.aclosing``) to abandon the completion: the HTTP response is
        closed at once.

        Raises:
            LlmError: the completion failed, after the retries when the failure was retryable. No
                exception reachable from it (its cause, its context) carries the key.
            RuntimeError: the adapter is closed.
        """
        client = self._ensure_client()
        key = self._usable_key()
        redact = self._redactor(key)
        payload = msgspec.json.encode(self.request_body(request))
        headers = self._request_headers(key)
        attempts = self.max_retries + 1
        attempt = 0
        deadline = math.inf
        while True:
            attempt += 1
            failed: _AttemptFailed | None = None
            try:
                # The slot is held for one attempt, not across the backoff before the next.
                async with self._slot():
                    if attempt == 1 and self.deadline is not None:
                        deadline = anyio.current_time() + self.deadline
                    async with aclosing(self._attempt(client, payload, headers, deadline, redact)) as batches:
                        async for batch in batches:
                            for event in batch:
                                yield event
                return
            except _AttemptFailed as exc:
                failed = exc
            # Out of the except block, so that the error raised below has no `__context__`: the
            # attempt's own message is not redacted yet.
            gave_up = ""
            if failed.retryable and attempt < attempts:
                delay = self._delay(attempt, failed.retry_after)
                if anyio.current_time() + delay < deadline:
                    logger.info(
                        "chat completion attempt %d of %d failed (%s), retrying in %.2f s: %s",
                        attempt,
                        attempts,
                        f"HTTP {failed.status}" if failed.status is not None else failed.kind.value,
                        delay,
                        redact(failed.message),
                    )
                    reason = failed.kind.value
                    if failed.status is not None:
                        reason += f", HTTP {failed.status}"
                    yield Retrying(attempt, attempts, delay, reason)
                    await anyio.sleep(delay)
                    continue
                gave_up = f": another would start past the call's {self.deadline:g} s deadline"
            message = failed.message
            if attempt > 1 or gave_up:
                message += f" (gave up after {attempt} attempt{'s' if attempt > 1 else ''}{gave_up})"
            cause = failed.__cause__
            if cause is not None and any(map(redact.found_in, _exception_texts(cause))):
                cause = None  # a transport error that quotes a header: its text must not travel
            raise LlmError(
                failed.kind,
                redact(message),
                status=failed.status,
                attempts=attempt,
                retry_after=failed.retry_after,
            ) from cause

    async def _attempt(
        self,
        client: httpx.AsyncClient,
        payload: bytes,
        headers: dict[str, str],
        deadline: float,
        redact: _Redactor,
    ) -> AsyncGenerator[list[CompletionEvent], None]:
        """One request: its events, a read's worth at a time, or `_AttemptFailed` saying whether
        another attempt may follow."""
        http_request = client.build_request(
            "POST", self._url, content=payload, headers=headers, timeout=self._timeout
        )
        try:
            with anyio.CancelScope(deadline=deadline) as scope:
                response = await client.send(http_request, stream=True)
        except httpx.TimeoutException as exc:
            raise self._timeout_failure(exc, body_started=False) from exc
        except httpx.TransportError as exc:
            raise self._connection_failure(exc, body_started=False) from exc
        if scope.cancelled_caught:
            raise self._deadline_failure(0)
        body = _Body(response, self, deadline)
        try:
            if response.status_code >= 300:
                raise await self._status_failure(response, body, redact)
            content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
            if content_type == "application/json":
                yield await self._whole_completion(body, redact)
                return
            assembly = _Assembly(self.max_answer_chars)
            decoder = _SseDecoder(self.max_event_bytes)
            chunks = 0
            done = False
            counting = False
            while not done:
                data = await body.next()
                if not counting and body.received > self.max_answer_chars:
                    assembly.count()
                    counting = True
                pending = decoder.flush() if data is None else decoder.feed(data)
                # The events of one read go out together: one hand-over per read, not per delta.
                batch: list[CompletionEvent] = []
                try:
                    for event_data in pending:
                        if event_data == b"[DONE]" or event_data.strip() == b"[DONE]":
                            done = True
                            break
                        chunks += 1
                        batch += assembly.feed(self._decode_chunk(event_data, chunks, redact))
                except _AttemptFailed:
                    if batch:
                        yield batch  # what arrived before the bad chunk is not lost
                    raise
                assembly.compact()
                if batch:
                    yield batch
                if decoder.failure is not None and not done:
                    raise decoder.failure
                if data is None:
                    break
            if not done and assembly.finish_reason is None:
                if chunks == 0:
                    what = f"no data event in {body.received} bytes of {content_type or 'untyped'} body"
                    raise _AttemptFailed(
                        LlmErrorKind.PROTOCOL,
                        f"the stream from {self._display_url} ended early: {what}: {redact.quote(body.head)}",
                    )
                raise _AttemptFailed(
                    LlmErrorKind.PROTOCOL,
                    f"the stream from {self._display_url} ended early: after {chunks} chunks, "
                    "with neither a finish_reason nor [DONE]",
                )
            completion = assembly.completion()
            if done:
                # Read on to the end of the body (the terminating chunk follows [DONE] at once), so that
                # the connection goes back to the pool: consumers stop at the Completion and close us.
                with anyio.move_on_after(_DRAIN_SECONDS):
                    await body.read(_DRAIN_LIMIT)
            yield [completion]
        finally:
            await body.close()

    async def _whole_completion(self, body: _Body, redact: _Redactor) -> list[CompletionEvent]:
        """A server that ignored ``stream`` answered one JSON completion: its events, all at once."""
        raw = await self._read_all(body)
        try:
            chunk = _CHUNK_DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            raise _AttemptFailed(
                LlmErrorKind.PROTOCOL, f"the JSON completion is malformed ({exc}): {redact.quote(raw)}"
            ) from exc
        if chunk.error is not None:
            raise _AttemptFailed(
                LlmErrorKind.SERVER, f"the server answered an error: {redact.error_detail(raw)}", status=200
            )
        if not chunk.choices:
            raise _AttemptFailed(
                LlmErrorKind.PROTOCOL, f"the JSON completion has no choices: {redact.quote(raw)}"
            )
        assembly = _Assembly(self.max_answer_chars)
        assembly.count()
        events = assembly.feed(chunk)
        return [*events, assembly.completion()]

    async def _read_all(self, body: _Body) -> bytes:
        parts: list[bytes] = []
        size = 0
        while (chunk := await body.next()) is not None:
            parts.append(chunk)
            size += len(chunk)
            if size > self.max_response_bytes:
                raise _AttemptFailed(
                    LlmErrorKind.TOO_LARGE,
                    f"the JSON completion is larger than {self.max_response_bytes} bytes; "
                    "reading stopped there",
                )
        return b"".join(parts)

    def _decode_chunk(self, data: bytes, number: int, redact: _Redactor) -> _Chunk:
        try:
            chunk = _CHUNK_DECODER.decode(data)
        except msgspec.ValidationError as exc:
            raise _AttemptFailed(
                LlmErrorKind.PROTOCOL,
                f"chunk #{number} of the stream is not a chat-completion chunk ({exc}): {redact.quote(data)}",
            ) from exc
        except msgspec.DecodeError as exc:
            raise _AttemptFailed(
                LlmErrorKind.PROTOCOL,
                f"chunk #{number} of the stream is not valid JSON ({exc}): {redact.quote(data)}",
            ) from exc
        if chunk.error is not None:
            raise _AttemptFailed(
                LlmErrorKind.SERVER, f"the server reported an error mid-stream: {redact.error_detail(data)}"
            )
        if chunk.choices is None and chunk.usage is None:
            raise _AttemptFailed(
                LlmErrorKind.PROTOCOL, f"chunk #{number} of the stream has no choices: {redact.quote(data)}"
            )
        return chunk

    async def _status_failure(
        self, response: httpx.Response, body: _Body, redact: _Redactor
    ) -> _AttemptFailed:
        status = response.status_code
        detail = redact.error_detail(await body.read(min(_ERROR_BODY_LIMIT, self.max_response_bytes)))
        what = f"{self._display_url} answered HTTP {status} {response.reason_phrase}: {detail}"
        if status < 400:
            # Redirects are not followed: a POST must not be replayed somewhere else without being told.
            location = response.headers.get("location", "nowhere")
            return _AttemptFailed(
                LlmErrorKind.BAD_REQUEST,
                f"{self._display_url} answered HTTP {status} {response.reason_phrase}, a redirect to "
                f"{redact.quote(location)}: set base_url to where the API is",
                status=status,
            )
        if status == 429 or status >= 500:
            return _AttemptFailed(
                LlmErrorKind.RATE_LIMITED if status == 429 else LlmErrorKind.SERVER,
                what,
                status=status,
                retryable=True,
                retry_after=_retry_after(response.headers),
            )
        if status in (401, 403):
            if self._key() is None and not any(map(_CREDENTIAL_HEADER.search, self._headers)):
                source = f"${self._api_key_env} is not set" if self._api_key_env else "none was configured"
                what += f" (no API key was sent: {source})"
            return _AttemptFailed(LlmErrorKind.AUTH, what, status=status)
        return _AttemptFailed(LlmErrorKind.BAD_REQUEST, what, status=status)

    def _deadline_failure(self, received: int) -> _AttemptFailed:
        return _AttemptFailed(
            LlmErrorKind.DEADLINE,
            f"{self._display_url} did not finish its answer within the {self.deadline:g} s deadline of a "
            f"model call ({received} bytes of this attempt's body had arrived)",
        )

    def _timeout_failure(self, exc: httpx.TimeoutException, *, body_started: bool) -> _AttemptFailed:
        when = "mid-stream" if body_started else "waiting for the answer"
        if isinstance(exc, httpx.ConnectTimeout):
            when = "connecting"
        elif isinstance(exc, httpx.PoolTimeout):
            when = "waiting for a free connection"
        return _AttemptFailed(
            LlmErrorKind.TIMEOUT,
            f"no progress from {self._display_url} within {self._timeout_seconds:g} s {when}",
            retryable=not body_started,
        )

    def _connection_failure(self, exc: httpx.TransportError, *, body_started: bool) -> _AttemptFailed:
        reason = str(exc) or type(exc).__name__
        if body_started:
            message = f"the connection to {self._display_url} dropped mid-stream: {reason}"
        else:
            message = f"the connection to {self._display_url} failed before any answer: {reason}"
        return _AttemptFailed(LlmErrorKind.CONNECTION, message, retryable=not body_started)
