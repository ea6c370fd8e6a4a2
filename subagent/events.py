"""The tiny event hub the service emits on.

Listeners observe; they cannot steer. A listener is a plain callable run synchronously in the
emitting task; one that raises is logged and neither the emitter nor the other listeners notice.
A listener that needs to do async work should hand it to a task group of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal, overload

from subagent.types import (
    Disposer,
    ProviderSnapshot,
    SubagentProgressInfo,
    SubagentRunEndInfo,
    SubagentRunInfo,
)

__all__ = ["EventHub", "EventName"]

logger = logging.getLogger(__name__)

EventName = Literal[
    "subagent/provider-added",
    "subagent/provider-removed",
    "subagent/start",
    "subagent/progress",
    "subagent/end",
]
"""The events an :class:`EventHub` carries; each has its own payload type (see :meth:`EventHub.on`)."""


class EventHub:
    """Named events with observe-only listeners, delivered in registration order."""

    def __init__(self) -> None:
        self._listeners: dict[str, list[Callable[[Any], object]]] = {}

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
    def on(self, event: EventName, listener: Callable[[Any], object]) -> Disposer:
        """Add ``listener`` for ``event``; the returned disposer removes exactly this registration."""
        # A fresh wrapper per registration, so the same callable added twice is removed once per disposer.
        entry: Callable[[Any], object] = lambda payload: listener(payload)  # noqa: E731
        self._listeners.setdefault(event, []).append(entry)

        def dispose() -> None:
            listeners = self._listeners.get(event, [])
            if entry in listeners:
                listeners.remove(entry)

        return dispose

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
    def emit(self, event: EventName, payload: object) -> None:
        """Call every listener of ``event``; a listener that raises is logged and skipped."""
        # Iterate over a copy: a listener may add or remove listeners while it runs.
        for listener in tuple(self._listeners.get(event, ())):
            try:
                listener(payload)
            except Exception:
                # Observe-only: one listener's bug must not touch the run or the other listeners.
                logger.exception("listener for %s raised; ignored", event)

    def listener_count(self, event: EventName) -> int:
        """How many listeners ``event`` has now."""
        return len(self._listeners.get(event, ()))
