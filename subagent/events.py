"""The tiny event hub the service emits on.

Listeners observe; they cannot steer. A listener is a plain callable run synchronously in the
emitting task; one that raises is logged and neither the emitter nor the other listeners notice.
A listener that needs to do async work should hand it to a task group of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, overload

from subagent.types import (
    Disposer,
    ProviderSnapshot,
    SubagentProgressInfo,
    SubagentRunEndInfo,
    SubagentRunInfo,
)

if TYPE_CHECKING:
    from subagent.journal import RunRecord

__all__ = ["EventHub", "EventName", "Listeners"]

logger = logging.getLogger(__name__)

EventName = Literal[
    "subagent/provider-added",
    "subagent/provider-removed",
    "subagent/start",
    "subagent/progress",
    "subagent/end",
    "subagent/interrupted",
]
"""The events an :class:`EventHub` carries; each has its own payload type (see :meth:`EventHub.on`)."""


T = TypeVar("T")


class Listeners(Generic[T]):
    """Observe-only listeners of one kind of payload, called in registration order.

    Each registration is undone by its own disposer (the same callable added twice is two
    registrations). A listener that raises is logged on ``logger`` as ``failure``, with the traceback,
    and skipped: neither the emitter nor the other listeners notice.
    """

    __slots__ = ("_entries", "_failure", "_logger")

    def __init__(self, logger: logging.Logger, failure: str) -> None:
        self._entries: dict[object, Callable[[T], object]] = {}
        self._logger = logger
        self._failure = failure

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, listener: Callable[[T], object]) -> Disposer:
        """Add ``listener``; the returned disposer removes exactly this registration."""
        key = object()
        self._entries[key] = listener

        def dispose() -> None:
            self._entries.pop(key, None)

        return dispose

    def emit(self, payload: T) -> None:
        """Call every listener with ``payload``; one that raises is logged and skipped."""
        # Over a snapshot: a listener may add or remove listeners while it runs.
        for listener in tuple(self._entries.values()):
            try:
                listener(payload)
            except Exception:
                # Observe-only: one listener's bug must not touch the emitter or the other listeners.
                self._logger.exception(self._failure)


class EventHub:
    """Named events with observe-only listeners, delivered in registration order."""

    def __init__(self) -> None:
        self._listeners: dict[str, Listeners[Any]] = {}

    @overload
    def on(
        self, event: Literal["subagent/provider-added"], listener: Callable[[ProviderSnapshot], object]
    ) -> Disposer: ...
    @overload
    def on(
        self, event: Literal["subagent/provider-removed"], listener: Callable[[str], object]
    ) -> Disposer: ...
    @overload
    def on(
        self, event: Literal["subagent/start"], listener: Callable[[SubagentRunInfo], object]
    ) -> Disposer: ...
    @overload
    def on(
        self, event: Literal["subagent/progress"], listener: Callable[[SubagentProgressInfo], object]
    ) -> Disposer: ...
    @overload
    def on(
        self, event: Literal["subagent/end"], listener: Callable[[SubagentRunEndInfo], object]
    ) -> Disposer: ...
    @overload
    def on(
        self, event: Literal["subagent/interrupted"], listener: Callable[[RunRecord], object]
    ) -> Disposer: ...
    def on(self, event: EventName, listener: Callable[[Any], object]) -> Disposer:
        """Add ``listener`` for ``event``; the returned disposer removes exactly this registration."""
        listeners = self._listeners.get(event)
        if listeners is None:
            listeners = self._listeners[event] = Listeners(logger, f"listener for {event} raised; ignored")
        return listeners.add(listener)

    @overload
    def emit(self, event: Literal["subagent/provider-added"], payload: ProviderSnapshot) -> None: ...
    @overload
    def emit(self, event: Literal["subagent/provider-removed"], payload: str) -> None: ...
    @overload
    def emit(self, event: Literal["subagent/start"], payload: SubagentRunInfo) -> None: ...
    @overload
    def emit(self, event: Literal["subagent/progress"], payload: SubagentProgressInfo) -> None: ...
    @overload
    def emit(self, event: Literal["subagent/end"], payload: SubagentRunEndInfo) -> None: ...
    @overload
    def emit(self, event: Literal["subagent/interrupted"], payload: RunRecord) -> None: ...
    def emit(self, event: EventName, payload: object) -> None:
        """Call every listener of ``event``; a listener that raises is logged and skipped."""
        listeners = self._listeners.get(event)
        if listeners is not None:
            listeners.emit(payload)

    def listener_count(self, event: EventName) -> int:
        """How many listeners ``event`` has now."""
        listeners = self._listeners.get(event)
        return len(listeners) if listeners is not None else 0
