"""The fake provider, now public as `subagent.testing.fakes`; re-exported so the tests import it unchanged."""

from subagent.testing.fakes import (
    FakeProvider,
    FakeRun,
    ObservableFakeRun,
    QueuedFakeRun,
    ResumableFakeRun,
    SteerableFakeRun,
)

__all__ = [
    "FakeProvider",
    "FakeRun",
    "ObservableFakeRun",
    "QueuedFakeRun",
    "ResumableFakeRun",
    "SteerableFakeRun",
]
