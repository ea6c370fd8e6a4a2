"""In-memory fake providers whose runs the test drives step by step.

A `FakeRun` simulates a child with a task in the service's task group that lives until the run is
disposed, so tests can check that nothing outlives `dispose()`. Readiness and the result are
settled by the test (`make_ready`, `fail_ready`, `finish`, `fail_result`), or by `cancel()` and
`dispose()` the way a real provider settles them. `ObservableFakeRun` adds liveness the test sets
(`last_activity`, `pending_permissions`, `update_count`), and `QueuedFakeRun` starts out queued
until the test calls `admit()`.

An *autopilot* drives a run without the test: `FakeProvider(autopilot=completes("done"))` gives runs
that become ready and finish on their own, `waits_until_cancelled()` runs that work until cancelled,
and `fails_to_start(...)` runs whose readiness fails. The autopilot runs as the first step of the
simulated child's task, so a run disposed right after `start` is disposed before it is ready.

Public test support (`subagent.testing.fakes`) for code that consumes the seam, and the reference
fake that `subagent.testing.contract` checks alongside the real providers.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup

from subagent import (
    ErrorCode,
    SubagentCapabilities,
    SubagentError,
    SubagentRequest,
    SubagentResult,
)
from subagent._outcome import DisposeOnExit, Outcome

__all__ = [
    "Autopilot",
    "FakeProvider",
    "FakeRun",
    "ObservableFakeRun",
    "QueuedFakeRun",
    "ResumableFakeRun",
    "SteerableFakeRun",
    "completes",
    "fails_to_start",
    "waits_until_cancelled",
]

_ids = itertools.count(1)


Autopilot = Callable[["FakeRun"], None]
"""Drives a fake run from its child task; it must not block or raise."""


def completes(output: str) -> Autopilot:
    """Runs that become ready and finish ``completed`` with ``output``."""

    def drive(run: FakeRun) -> None:
        run.make_ready()
        run.finish(SubagentResult(output=output, stop_reason="completed"))

    return drive


def waits_until_cancelled() -> Autopilot:
    """Runs that become ready and work until cancelled or disposed."""

    def drive(run: FakeRun) -> None:
        run.make_ready()

    return drive


def fails_to_start(message: str = "the fake child could not start") -> Autopilot:
    """Runs whose readiness fails with ``START_FAILED``."""

    def drive(run: FakeRun) -> None:
        run.fail_ready(SubagentError(ErrorCode.START_FAILED, message))

    return drive


class FakeRun(DisposeOnExit):
    """A provider run driven by the test."""

    def __init__(self, request: SubagentRequest, task_group: TaskGroup) -> None:
        self.id = f"fake-{next(_ids)}"
        self.request = request
        self._ready: Outcome[None] = Outcome()
        self._result: Outcome[SubagentResult] = Outcome()
        self._stop_child = anyio.Event()
        self._child_running = False
        self.child_exited = anyio.Event()
        self.cancel_calls = 0
        self.dispose_calls = 0
        self.messages: list[str] = []
        self.autopilot: Autopilot | None = None
        """Run by the child task as its first step (set before the task first runs)."""
        task_group.start_soon(self._child)

    async def _child(self) -> None:
        self._child_running = True
        try:
            if self.autopilot is not None and not self._stop_child.is_set():
                self.autopilot(self)
            await self._stop_child.wait()
        finally:
            self._child_running = False
            self.child_exited.set()

    def child_running(self) -> bool:
        """Whether the simulated child task is still alive."""
        return self._child_running

    # -- driven by the test ---------------------------------------------------------------------

    def make_ready(self) -> None:
        """Report the child ready: `started()` returns (no-op once readiness settled)."""
        self._ready.settle(None)

    def fail_ready(self, error: BaseException) -> None:
        """Fail readiness with ``error`` (no-op once readiness settled)."""
        self._ready.fail(error)

    def finish(self, result: SubagentResult) -> None:
        """Settle the result (no-op once it settled)."""
        self._result.settle(result)

    def fail_result(self, error: BaseException) -> None:
        """Make `result()` raise ``error``, an infrastructure failure (no-op once it settled)."""
        self._result.fail(error)

    # -- the SubagentRun protocol ---------------------------------------------------------------

    async def started(self) -> None:
        """Wait for `make_ready` or `fail_ready`."""
        await self._ready.wait()

    async def result(self) -> SubagentResult:
        """Wait for `finish` or `fail_result`."""
        return await self._result.wait()

    async def cancel(self) -> None:
        """Settle the result as ``cancelled`` with output ``"partial"``."""
        self.cancel_calls += 1
        self.finish(SubagentResult(output="partial", stop_reason="cancelled"))

    async def dispose(self) -> None:
        """Fail readiness and result with ``DISPOSED`` if unsettled, and end the child task."""
        self.dispose_calls += 1
        disposed = SubagentError(ErrorCode.DISPOSED, f"{self.id} disposed")
        self.fail_ready(disposed)
        self.fail_result(disposed)
        self._stop_child.set()
        await self.child_exited.wait()


class SteerableFakeRun(FakeRun):
    """A fake that accepts messages (a `SteerableRun`); they are kept in ``messages``."""

    async def send_message(self, text: str) -> None:
        """Record ``text``."""
        self.messages.append(text)


class ResumableFakeRun(FakeRun):
    """A fake that takes further turns (a `ResumableRun`)."""

    async def resume(self, prompt: str) -> SubagentResult:
        """Answer ``resumed: <prompt>`` at once."""
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
        """Give the run its slot."""
        self.queued = False


@dataclass
class FakeProvider:
    """A provider whose `start` records every run it creates (in ``runs``).

    ``run_class`` picks the runtime capabilities the runs offer; ``autopilot``, if given, drives each
    run (see `completes`, `waits_until_cancelled`, `fails_to_start`), else the test drives them.
    """

    name: str = "fake"
    capabilities: SubagentCapabilities = field(default_factory=SubagentCapabilities)
    inherits_parent_context: bool = False
    run_class: type[FakeRun] = FakeRun
    runs: list[FakeRun] = field(default_factory=list)
    start_calls: int = 0
    autopilot: Autopilot | None = None

    def start(self, request: SubagentRequest, task_group: TaskGroup) -> FakeRun:
        self.start_calls += 1
        run = self.run_class(request, task_group)
        run.autopilot = self.autopilot
        self.runs.append(run)
        return run
