"""The runtime's conversation vocabulary: messages, tool calls, tool specs, and completion events.

These are plain frozen records, independent of any model vendor's wire format. An adapter
translates them to and from its API (:mod:`subagent.runtime.openai` for chat completions).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from subagent.types import Usage, freeze_json

__all__ = [
    "Completion",
    "CompletionEvent",
    "CompletionRequest",
    "FinishReason",
    "Message",
    "Retrying",
    "Role",
    "TextDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolSpec",
]

Role = Literal["system", "user", "assistant", "tool"]
"""Who a message is from: the persona, the user, the model, or a tool's result."""

FinishReason = Literal["stop", "tool_calls", "length", "content_filter"]
"""Why the model stopped: it answered, it asked for tools, it hit its token limit, or it refused."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call the model asked for. ``arguments`` is the JSON text exactly as the model wrote
    it: it may be invalid, and the runtime answers that to the model rather than failing."""

    id: str
    name: str
    arguments: str = "{}"


@dataclass(frozen=True, slots=True)
class Message:
    """One entry of an agent's message log.

    ``tool_calls`` only on assistant messages; ``tool_call_id`` and ``name`` only on tool results.
    """

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        # Callers may pass any sequence; the record keeps a tuple so it stays immutable.
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))

    @classmethod
    def system(cls, text: str) -> Message:
        """A system prompt (the persona)."""
        return cls("system", text)

    @classmethod
    def user(cls, text: str) -> Message:
        """A user message: a prompt, or a message injected while the agent worked."""
        return cls("user", text)

    @classmethod
    def assistant(cls, text: str = "", tool_calls: Sequence[ToolCall] = ()) -> Message:
        """What the model answered: text, tool calls, or both."""
        return cls("assistant", text, tuple(tool_calls))

    @classmethod
    def tool_result(cls, call: ToolCall, text: str) -> Message:
        """The answer to one tool call."""
        return cls("tool", text, tool_call_id=call.id, name=call.name)


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool as the model sees it: a name, what it does, and a JSON Schema for its arguments.

    ``parameters`` is deep-frozen on construction.
    """

    name: str
    description: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def __post_init__(self) -> None:
        object.__setattr__(self, "parameters", freeze_json(self.parameters))


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """What an adapter is asked to complete.

    ``response_schema``: when set, the final answer must be JSON matching it; adapters that can
    constrain decoding (``response_format`` in chat completions) pass it on, and the runtime
    validates the answer whatever the adapter did.
    """

    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    response_schema: Mapping[str, Any] | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(self.messages))
        object.__setattr__(self, "tools", tuple(self.tools))
        if self.response_schema is not None:
            object.__setattr__(self, "response_schema", freeze_json(self.response_schema))


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of the assistant's answer text, as it streams."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a tool call as it streams: ``index`` identifies the call within the answer;
    ``id`` and ``name`` arrive once (usually first), ``arguments`` piece by piece."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class Completion:
    """The last event of every completion stream: the whole assistant message, assembled."""

    message: Message
    finish_reason: FinishReason
    usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class Retrying:
    """An attempt at the completion failed and another follows after ``delay`` seconds.

    The chat-completions adapter retries only an attempt that yielded nothing, so the deltas that
    follow are the whole answer.
    """

    attempt: int
    """The attempt that failed, from 1."""
    attempts: int
    """The most attempts there will be."""
    delay: float
    """Seconds before the next attempt."""
    reason: str
    """Short and already redacted: the failure's kind and status (``"rate_limited, HTTP 429"``),
    never a key or a response body."""


CompletionEvent = TextDelta | ToolCallDelta | Retrying | Completion
"""What an adapter's stream yields: deltas, then exactly one :class:`Completion`. An adapter MAY
yield a :class:`Retrying` before it retries a failed attempt; everyone else ignores it."""
