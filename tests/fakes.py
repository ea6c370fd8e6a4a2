"""In-memory fake providers whose runs the test drives step by step.

A `FakeRun` simulates a child with a task in the service's task group that lives until the run is
disposed, so tests can check that nothing outlives `dispose()`. Readiness and the result are
settled by the test (`make_ready`, `fail_ready`, `finish`, `fail_result`), or by `cancel()` and
`dispose()` the way a real provider settles them. `ObservableFakeRun` adds liveness the test sets
(`last_activity`, `pending_permissions`, `update_count`), and `QueuedFakeRun` starts out queued
until the test calls `admit()`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

import anyio
from anyio.abc import TaskGroup

from subagent import (
    ErrorCode,
    SubagentCapabilities,
    SubagentError,
    SubagentRequest,
    SubagentResult,
)

_ids = itertools.count(1)


class FakeRun:
    """A provider run driven by the test."""

    def __init__(self, request: SubagentRequest, task_group: TaskGroup) -> None:
        self.id = f"fake-{next(_ids)}"
        self.request = request
        self._ready = anyio.Event()
        self._ready_error: BaseException | None = None
        self._settled = anyio.Event()
        self._outcome: SubagentResult | BaseException | None = None
        self._stop_child = anyio.Event()
        self._child_running = False
        self.child_exited = anyio.Event()
        self.cancel_calls = 0
        self.dispose_calls = 0
        self.messages: list[str] = []
        task_group.start_soon(self._child)

    async def _child(self) -> None:
        self._child_running = True
        try:
            await self._stop_child.wait()
        finally:
            self._child_running = False
            self.child_exited.set()

    def child_running(self) -> bool:
        """Whether the simulated child task is still alive."""
        return self._child_running

    # -- driven by the test ---------------------------------------------------------------------

    def make_ready(self) -> None:
        self._ready.set()

    def fail_ready(self, error: BaseException) -> None:
        if not self._ready.is_set():
            self._ready_error = error
            self._ready.set()

    def finish(self, result: SubagentResult) -> None:
        if not self._settled.is_set():
            self._outcome = result
            self._settled.set()

    def fail_result(self, error: BaseException) -> None:
        if not self._settled.is_set():
            self._outcome = error
            self._settled.set()

    # -- the SubagentRun protocol ---------------------------------------------------------------

    async def started(self) -> None:
        await self._ready.wait()
        if self._ready_error is not None:
            raise self._ready_error

    async def result(self) -> SubagentResult:
        await self._settled.wait()
        outcome = self._outcome
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return outcome

    async def cancel(self) -> None:
        self.cancel_calls += 1
        self.finish(SubagentResult(output="partial", stop_reason="cancelled"))

    async def dispose(self) -> None:
        self.dispose_calls += 1
        disposed = SubagentError(ErrorCode.DISPOSED, f"{self.id} disposed")
        self.fail_ready(disposed)
        self.fail_result(disposed)
        self._stop_child.set()
        await self.child_exited.wait()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.dispose()


class SteerableFakeRun(FakeRun):
    async def send_message(self, text: str) -> None:
        self.messages.append(text)


class ResumableFakeRun(FakeRun):
    async def resume(self, prompt: str) -> SubagentResult:
        return SubagentResult(output=f"resumed: {prompt}", stop_reason="completed")


class ObservableFakeRun(FakeRun):
    """A fake whose child's liveness is whatever the test sets (an `ObservableRun`)."""

    def __init__(self, request: SubagentRequest, task_group: TaskGroup) -> None:
        super().__init__(request, task_group)
        self.last_activity: float | None = time.monotonic()
        self.pending_permissions = 0
        self.update_count = 0

    def update(self) -> None:
        """Simulate the child sending an update now."""
        self.update_count += 1
        self.last_activity = time.monotonic()


class QueuedFakeRun(FakeRun):
    """A fake that waits for a concurrency slot until the test calls `admit()` (a `QueueableRun`)."""

    def __init__(self, request: SubagentRequest, task_group: TaskGroup) -> None:
        super().__init__(request, task_group)
        self.queued = True

    def admit(self) -> None:
        self.queued = False


@dataclass
class FakeProvider:
    """A provider whose `start` records every run it creates."""

    name: str = "fake"
    capabilities: SubagentCapabilities = field(default_factory=SubagentCapabilities)
    inherits_parent_context: bool = False
    run_class: type[FakeRun] = FakeRun
    runs: list[FakeRun] = field(default_factory=list)
    start_calls: int = 0

    def start(self, request: SubagentRequest, task_group: TaskGroup) -> FakeRun:
        self.start_calls += 1
        run = self.run_class(request, task_group)
        self.runs.append(run)
        return run
