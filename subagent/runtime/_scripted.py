"""``ScriptedLlm``: a deterministic adapter for tests, the demo, and ``subagent serve --script``.

A script is a list of replies, each used once, in order. A reply may carry a ``when`` condition;
the adapter then answers with the first unused reply whose condition matches the request, which
keeps a script shared by a parent and its children deterministic even when they run at once.
A callable instead of a list answers every request itself.

```python
llm = ScriptedLlm([
    Reply(tool_calls=[call("subagent", {"provider": "spawn", "prompt": "count the files"})]),
    Reply("There are 3 files.", when=When(last_user_contains="count the files")),
    Reply("Done: the child counted 3 files."),
])
```
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast, get_args

import anyio
import msgspec

from subagent.runtime._llm import LlmError, LlmErrorKind
from subagent.runtime._messages import (
    Completion,
    CompletionEvent,
    CompletionRequest,
    FinishReason,
    Message,
    TextDelta,
    ToolCall,
    ToolCallDelta,
)
from subagent.types import Usage

__all__ = ["Reply", "ScriptedLlm", "When", "call"]

_PIECES = re.compile(r"\S+\s*|\s+")


def call(name: str, arguments: Mapping[str, Any] | str | None = None, *, id: str | None = None) -> ToolCall:
    """A scripted tool call; ``arguments`` is encoded to JSON unless it is already text."""
    text = arguments if isinstance(arguments, str) else json.dumps(dict(arguments or {}))
    return ToolCall(id or f"call_{uuid.uuid4().hex[:12]}", name, text)


@dataclass(frozen=True, slots=True)
class When:
    """A condition on the request a reply answers. Every field given must hold.

    ``last_user_contains``: the last user message contains this text. ``system_contains``: the
    system prompt (persona) contains it. ``has_tool``: the request offers a tool of that name.
    ``after_tool_result``: the last message is a tool result (the model is reading tool output).
    """

    last_user_contains: str | None = None
    system_contains: str | None = None
    has_tool: str | None = None
    after_tool_result: bool | None = None

    def matches(self, request: CompletionRequest) -> bool:
        """Whether ``request`` meets every condition given."""
        messages = request.messages
        if self.last_user_contains is not None:
            last_user = next((m.content for m in reversed(messages) if m.role == "user"), "")
            if self.last_user_contains not in last_user:
                return False
        if self.system_contains is not None:
            system = next((m.content for m in messages if m.role == "system"), "")
            if self.system_contains not in system:
                return False
        if self.has_tool is not None and all(tool.name != self.has_tool for tool in request.tools):
            return False
        if self.after_tool_result is not None:
            after = bool(messages) and messages[-1].role == "tool"
            if after != self.after_tool_result:
                return False
        return True


@dataclass(frozen=True, slots=True)
class Reply:
    """One scripted model answer.

    ``text`` streams in word-sized deltas (``chunk`` characters each when given); ``tool_calls``
    stream after it, each as its id and name, then its arguments in two pieces. ``finish_reason``
    defaults to ``tool_calls`` when there are calls, else ``stop``. ``error`` makes the call fail
    instead (after ``text`` streamed, when there is text). ``wait`` is awaited before answering,
    so a test can hold the model mid-turn. ``when`` restricts which requests the reply answers.
    """

    text: str = ""
    tool_calls: Sequence[ToolCall] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: LlmError | None = None
    chunk: int | None = None
    wait: Callable[[], Awaitable[object]] | None = field(default=None, compare=False)
    when: When | None = None


Answer = Reply | str | Mapping[str, Any]
"""A scripted answer: a :class:`Reply`, plain text, or a reply in the JSON script's object form."""

Responder = Callable[[CompletionRequest], "Answer | Awaitable[Answer]"]
"""A script as a function: it answers each request itself, at once or awaited."""


class ScriptedLlm:
    """A deterministic :class:`~subagent.runtime.LlmAdapter`.

    Args:
        script: replies used once each (a ``str`` is a plain text reply, a mapping a reply in the
            JSON script's form: see :meth:`from_json`), or a function that answers each request.
        fallback: the answer once no scripted reply matches; without one, that request fails
            with ``LlmError(SCRIPT)`` naming what was asked.

    ``requests`` records every request received, in order: tests assert exactly what a child saw.

    It bounds a call's output as a real model does (``bounds_output``): a reply whose ``usage``
    counts more output tokens than the request's ``max_tokens`` is cut to them (its text to the same
    share, its tool calls dropped) and finishes with ``length``.
    """

    bounds_output = True
    """The request's ``max_tokens`` bounds each reply's output tokens (see above)."""

    def __init__(
        self,
        script: Iterable[Answer] | Responder = (),
        *,
        fallback: Answer | None = None,
    ) -> None:
        self._responder: Responder | None = None
        self._replies: list[Reply] = []
        if callable(script):
            self._responder = script
        else:
            self._replies = [_as_reply(item, f"reply {index}") for index, item in enumerate(script)]
        self._used = [False] * len(self._replies)
        self._fallback = None if fallback is None else _as_reply(fallback, "fallback")
        self.requests: list[CompletionRequest] = []

    def __repr__(self) -> str:
        return f"<ScriptedLlm {self.remaining} of {len(self._replies)} replies left>"

    @property
    def remaining(self) -> int:
        """Scripted replies not used yet."""
        return self._used.count(False)

    @classmethod
    def from_json(cls, data: bytes | str | Sequence[Any] | Mapping[str, Any]) -> ScriptedLlm:
        """A script from JSON: a list of replies, each a string or an object with ``text``,
        ``tool_calls`` (``[{"name", "arguments", "id"?}]``), ``finish_reason``, ``usage``
        (``input_tokens``...), ``error`` (a message: the call fails), ``when``
        (``{"last_user_contains", "system_contains", "has_tool", "after_tool_result"}``); or an
        object ``{"replies": [...], "fallback": reply}``.

        Raises:
            ValueError: the script is not valid, with what is wrong and where.
        """
        try:
            raw = msgspec.json.decode(data) if isinstance(data, bytes | str) else data
        except msgspec.DecodeError as exc:
            raise ValueError(f"the script is not valid JSON: {exc}") from exc
        fallback = None
        if isinstance(raw, Mapping):
            unknown = set(raw) - {"replies", "fallback"}
            if unknown:
                raise ValueError(f"unknown script keys: {', '.join(sorted(unknown))}")
            if raw.get("fallback") is not None:
                fallback = _reply_from_json(raw["fallback"], "fallback")
            raw = raw.get("replies", [])
        if not isinstance(raw, list | tuple):
            raise ValueError("a script is a list of replies, or an object with `replies`")
        replies = [_reply_from_json(item, f"reply {index}") for index, item in enumerate(raw)]
        return cls(replies, fallback=fallback)

    @classmethod
    def from_file(cls, path: str | Path) -> ScriptedLlm:
        """:meth:`from_json` on a file's content."""
        return cls.from_json(Path(path).read_bytes())

    async def stream(self, request: CompletionRequest) -> AsyncIterator[CompletionEvent]:
        """Answer ``request`` with the next matching reply, streamed."""
        self.requests.append(request)
        reply = _bounded(await self._pick(request), request.max_tokens)
        if reply.wait is not None:
            await reply.wait()
        for piece in _pieces(reply.text, reply.chunk):
            yield TextDelta(piece)
            await anyio.lowlevel.checkpoint()
        if reply.error is not None:
            raise reply.error
        for index, tool_call in enumerate(reply.tool_calls):
            yield ToolCallDelta(index, id=tool_call.id, name=tool_call.name)
            half = len(tool_call.arguments) // 2
            yield ToolCallDelta(index, arguments=tool_call.arguments[:half])
            yield ToolCallDelta(index, arguments=tool_call.arguments[half:])
        finish: FinishReason = reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")
        yield Completion(Message.assistant(reply.text, reply.tool_calls), finish, reply.usage)

    async def _pick(self, request: CompletionRequest) -> Reply:
        if self._responder is not None:
            answer = self._responder(request)
            if inspect.isawaitable(answer):
                answer = await answer
            return _as_reply(answer)
        for index, reply in enumerate(self._replies):
            if not self._used[index] and (reply.when is None or reply.when.matches(request)):
                self._used[index] = True
                return reply
        if self._fallback is not None:
            return self._fallback
        last_user = next((m.content for m in reversed(request.messages) if m.role == "user"), "")
        raise LlmError(
            LlmErrorKind.SCRIPT,
            f"the script has no reply left for this request (last user message: {last_user[:200]!r})",
        )


def _bounded(reply: Reply, max_tokens: int | None) -> Reply:
    """``reply`` cut to ``max_tokens`` output tokens, when its usage counts more."""
    usage = reply.usage
    if (
        max_tokens is None
        or usage is None
        or usage.output_tokens is None
        or usage.output_tokens <= max_tokens
    ):
        return reply
    share = max_tokens / usage.output_tokens if usage.output_tokens else 0.0
    cut = dataclasses.replace(
        usage,
        output_tokens=max_tokens,
        total_tokens=None
        if usage.total_tokens is None
        else usage.total_tokens - usage.output_tokens + max_tokens,
    )
    text = reply.text[: int(len(reply.text) * share)]
    return dataclasses.replace(reply, text=text, tool_calls=(), finish_reason="length", usage=cut)


def _as_reply(item: Answer, where: str = "the responder's answer") -> Reply:
    if isinstance(item, Reply):
        return item
    return _reply_from_json(item, where)


def _pieces(text: str, chunk: int | None) -> list[str]:
    if not text:
        return []
    if chunk is not None and chunk > 0:
        return [text[i : i + chunk] for i in range(0, len(text), chunk)]
    return _PIECES.findall(text)


_REPLY_KEYS = {"text", "tool_calls", "finish_reason", "usage", "error", "when", "chunk"}
_FINISH_REASONS = frozenset(get_args(FinishReason))


def _reply_from_json(item: Any, where: str) -> Reply:
    if isinstance(item, str):
        return Reply(item)
    if not isinstance(item, Mapping):
        raise ValueError(f"{where}: a reply is a string or an object")
    unknown = set(item) - _REPLY_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
    text = item.get("text", "")
    if not isinstance(text, str):
        raise ValueError(f"{where}: `text` must be a string")
    raw_calls = item.get("tool_calls")
    if raw_calls is None:
        raw_calls = []
    if not isinstance(raw_calls, list | tuple):
        raise ValueError(f"{where}: `tool_calls` must be a list")
    calls = []
    for position, raw_call in enumerate(raw_calls):
        if not isinstance(raw_call, Mapping) or not isinstance(raw_call.get("name"), str):
            raise ValueError(f"{where}: tool call {position} needs a string `name`")
        arguments = raw_call.get("arguments", {})
        if not isinstance(arguments, Mapping | str):
            raise ValueError(f"{where}: tool call {position}: `arguments` must be an object or a string")
        call_id = raw_call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise ValueError(f"{where}: tool call {position}: `id` must be a string")
        calls.append(call(raw_call["name"], arguments, id=call_id))
    finish = item.get("finish_reason")
    if finish is not None and (not isinstance(finish, str) or finish not in _FINISH_REASONS):
        raise ValueError(f"{where}: `finish_reason` must be one of {', '.join(sorted(_FINISH_REASONS))}")
    usage = None
    if item.get("usage") is not None:
        usage = _usage_from_json(item["usage"], where)
    error = None
    if item.get("error") is not None:
        if not isinstance(item["error"], str):
            raise ValueError(f"{where}: `error` must be a string (the failure's message)")
        error = LlmError(LlmErrorKind.SCRIPT, item["error"])
    when = None
    if item.get("when") is not None:
        when = _when_from_json(item["when"], where)
    chunk = item.get("chunk")
    if chunk is not None and (not _is_whole_number(chunk) or chunk < 1):
        raise ValueError(f"{where}: `chunk` must be a whole number >= 1")
    return Reply(text, tuple(calls), cast(FinishReason | None, finish), usage, error, chunk, None, when)


def _is_whole_number(value: Any) -> bool:
    # JSON true and false decode to bool, a subclass of int: not a count.
    return isinstance(value, int) and not isinstance(value, bool)


_USAGE_KEYS = tuple(field.name for field in dataclasses.fields(Usage))
_WHEN_TEXT_KEYS = ("last_user_contains", "system_contains", "has_tool")


def _usage_from_json(raw: Any, where: str) -> Usage:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: bad `usage`: it must be an object")
    unknown = set(raw) - set(_USAGE_KEYS)
    if unknown:
        raise ValueError(f"{where}: bad `usage`: unknown keys {', '.join(sorted(unknown))}")
    for key, value in raw.items():
        if value is not None and not _is_whole_number(value):
            raise ValueError(f"{where}: bad `usage`: `{key}` must be a whole number")
    return Usage(**raw)


def _when_from_json(raw: Any, where: str) -> When:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: bad `when`: it must be an object")
    unknown = set(raw) - {*_WHEN_TEXT_KEYS, "after_tool_result"}
    if unknown:
        raise ValueError(f"{where}: bad `when`: unknown keys {', '.join(sorted(unknown))}")
    for key in _WHEN_TEXT_KEYS:
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise ValueError(f"{where}: bad `when`: `{key}` must be a string")
    if raw.get("after_tool_result") is not None and not isinstance(raw["after_tool_result"], bool):
        raise ValueError(f"{where}: bad `when`: `after_tool_result` must be true or false")
    return When(**raw)
