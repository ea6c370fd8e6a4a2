"""Language-model adapters: the protocol, the registry of named adapters, typed errors.

An adapter turns a :class:`~subagent.runtime.CompletionRequest` into a stream of
completion events: text and tool-call deltas as they arrive, then exactly one
:class:`~subagent.runtime.Completion`. It raises :class:`LlmError` for anything that
keeps it from finishing (after whatever retries it does itself). Consumers close the stream (its
``aclose()``, when it has one: async generators do) so that an abandoned completion releases its
connection at once.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from subagent.runtime._messages import CompletionEvent, CompletionRequest
from subagent.types import Disposer

__all__ = ["LlmAdapter", "LlmError", "LlmErrorKind", "LlmService"]


class LlmErrorKind(enum.StrEnum):
    """What kept a completion from finishing. Compare kinds, never message text."""

    RATE_LIMITED = "rate_limited"
    """HTTP 429, still after the adapter's retries."""
    SERVER = "server"
    """HTTP 5xx, still after the adapter's retries."""
    CONNECTION = "connection"
    """The connection failed or dropped, still after the adapter's retries."""
    TIMEOUT = "timeout"
    """No byte from the server within the adapter's timeout (the gap between two reads)."""
    DEADLINE = "deadline"
    """The whole model call, retries and their delays included, went past the adapter's deadline
    (a server trickling its answer, say, never silent long enough for a ``TIMEOUT``)."""
    AUTH = "auth"
    """The server refused the credentials (401, 403), or the configured key is unusable (a line
    break, a non-ASCII character) and was not sent."""
    BAD_REQUEST = "bad_request"
    """The server refused the request itself (another 4xx): retrying will not help."""
    PROTOCOL = "protocol"
    """The server's answer broke the wire format (a malformed chunk, a stream cut short)."""
    TOO_LARGE = "too_large"
    """The server's answer went past one of the adapter's size caps (one event, one response, the
    whole answer): reading stopped there."""
    SCRIPT = "script"
    """A scripted adapter ran out of replies or was told to fail."""


class LlmError(Exception):
    """A completion failed. ``kind`` says how; ``status`` is the HTTP status when there was one;
    ``attempts`` counts the tries made; ``retry_after`` is the delay in seconds the server asked for
    last (``Retry-After``), for a caller that schedules its own retry. The message never contains a
    credential."""

    def __init__(
        self,
        kind: LlmErrorKind,
        message: str,
        *,
        status: int | None = None,
        attempts: int = 1,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status = status
        self.attempts = attempts
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"LlmError({self.kind.value}, {self.message!r})"


@runtime_checkable
class LlmAdapter(Protocol):
    """Streams a completion. Implementations: :class:`~subagent.runtime.ScriptedLlm`,
    :class:`~subagent.runtime.openai.OpenAiChatAdapter`."""

    def stream(self, request: CompletionRequest) -> AsyncIterator[CompletionEvent]:
        """Yield deltas as they arrive, then one ``Completion``; raise :class:`LlmError` on failure."""
        ...


class LlmService:
    """A registry of named adapters, so that configuration can say which model a child uses."""

    def __init__(self) -> None:
        self._adapters: dict[str, LlmAdapter] = {}

    def register_adapter(self, name: str, adapter: LlmAdapter) -> Disposer:
        """Register ``adapter`` under ``name`` and return the disposer.

        Raises:
            ValueError: the name is empty or already taken (the first registration stays).
        """
        if not name:
            raise ValueError("an adapter's name must be a non-empty str")
        if name in self._adapters:
            raise ValueError(f"an adapter named {name!r} is already registered")
        self._adapters[name] = adapter

        def dispose() -> None:
            # Identity: a later registration under the same name is not ours to remove.
            if self._adapters.get(name) is adapter:
                del self._adapters[name]

        return dispose

    def get(self, name: str) -> LlmAdapter | None:
        """The adapter registered under ``name``, or None."""
        return self._adapters.get(name)

    def require(self, name: str) -> LlmAdapter:
        """The adapter registered under ``name``.

        Raises:
            KeyError: none is, with the registered names in the message.
        """
        adapter = self._adapters.get(name)
        if adapter is None:
            known = ", ".join(repr(known) for known in self._adapters) or "none"
            raise KeyError(f"no LLM adapter named {name!r} (registered: {known})")
        return adapter

    def list(self) -> list[str]:
        """The registered adapter names, in registration order."""
        return list(self._adapters)
