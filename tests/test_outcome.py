"""The settle-once outcome every run class keeps its readiness and result in."""

from __future__ import annotations

import traceback

import anyio
import pytest

from subagent._outcome import DisposeOnExit, Outcome

pytestmark = pytest.mark.anyio

WAIT = 10.0


async def test_every_waiter_before_and_after_settling_gets_the_one_value() -> None:
    outcome: Outcome[list[str]] = Outcome()
    value = ["the", "value"]
    got: list[list[str]] = []

    async def waiter() -> None:
        got.append(await outcome.wait())

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as group:
            for _ in range(3):
                group.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert got == []
            assert outcome.settle(value) is True
        got.append(await outcome.wait())
    assert len(got) == 4
    assert all(each is value for each in got)
    assert outcome.get() is value
    assert outcome.error is None


async def test_the_first_settle_wins_and_later_ones_change_nothing() -> None:
    outcome: Outcome[str] = Outcome()
    error = LookupError("first")
    assert outcome.is_set() is False
    assert outcome.fail(error) is True
    assert outcome.settle("late") is False
    assert outcome.fail(ValueError("late")) is False
    assert outcome.is_set() is True
    assert outcome.error is error
    with anyio.fail_after(WAIT), pytest.raises(LookupError) as raised:
        await outcome.wait()
    assert raised.value is error


async def test_a_failed_outcome_raises_one_error_object_every_time_its_traceback_never_growing() -> None:
    outcome: Outcome[None] = Outcome()
    try:
        raise KeyError("settled")
    except KeyError as exc:
        outcome.fail(exc)
    depths: list[int] = []
    with anyio.fail_after(WAIT):
        for _ in range(50):
            with pytest.raises(KeyError) as raised:
                await outcome.wait()
            depths.append(len(traceback.extract_tb(raised.value.__traceback__)))
    # The same frames each time: where it was raised first, then the path through wait() to here.
    assert len(set(depths)) == 1, depths


def test_reading_an_unsettled_outcome_is_refused() -> None:
    outcome: Outcome[int] = Outcome()
    with pytest.raises(RuntimeError, match="not settled"):
        outcome.get()
    assert outcome.settle(0) is True
    assert outcome.get() == 0


async def test_leaving_the_block_of_a_dispose_on_exit_run_disposes_it_also_on_an_error() -> None:
    class Run(DisposeOnExit):
        disposed = 0

        async def dispose(self) -> None:
            self.disposed += 1

    run = Run()
    async with run as entered:
        assert entered is run
    assert run.disposed == 1
    with pytest.raises(ValueError, match="inside"):
        async with run:
            raise ValueError("inside")
    assert run.disposed == 2
