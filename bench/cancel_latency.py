"""Cancel latency: from ``run.cancel()`` to the run's ``cancelled`` result, through the service.

Each sample is a fresh run of the bundled stub agent on one ``SubagentService``. The turn sends one
message chunk and then waits in ``wait_for_cancel``; the clock starts once that first update reached
the parent (``run.provider_run.on_update``, never a sleep), so the turn is really under way. Then
``cancel()`` is called in a task of its own while the caller awaits ``run.result()``:

* **cooperative**: the agent answers ``session/cancel`` with ``cancelled`` at once
  (``wait_for_cancel`` then ``stop``). Target: median under 50 ms.
* **ignoring**: the agent takes note of the cancel and carries on forever (``wait_for_cancel`` then
  ``continue``, then ``hang``). The provider waits ``cancel_grace`` for the turn to end, then tears
  the child down. Target: the result within the grace plus at most 1 s, on every run (judged on
  the maximum). Also reported: when ``cancel()`` itself returned, i.e. the child was gone.

Every result must be ``cancelled``, or the script exits 1. Median, p90 and max of ``--runs`` samples.

    python bench/cancel_latency.py [--runs 30] [--grace 0.5] [--backend asyncio|trio]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from _common import (
    BenchBroken,
    live_descendants,
    make_provider,
    median_p90_max,
    stub_command,
    verdict,
    write_scenario,
)

from subagent import SubagentRequest, SubagentService
from subagent.acp import schema
from subagent.providers.acp import AcpRun

COOPERATIVE_TARGET = 0.050
IGNORING_EXTRA = 1.0
"""The ignoring child's result may come at most this long after the grace."""
SAMPLE_LIMIT = 60.0
"""Seconds one sample may take before the run counts as broken."""

COOPERATIVE: Mapping[str, Any] = {
    "turns": [[{"step": "message", "text": "working"}, {"step": "wait_for_cancel", "then": "stop"}]]
}
IGNORING: Mapping[str, Any] = {
    "turns": [
        [
            {"step": "message", "text": "working"},
            {"step": "wait_for_cancel", "then": "continue"},
            {"step": "hang"},
        ]
    ]
}


class _TeardownCounter(logging.Handler):
    """Counts the provider's "did not stop within the grace; tearing it down" warnings, and keeps them
    off the terminal: for the ignoring child they are the behaviour being measured."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.teardowns = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "tearing it down" in record.getMessage():
            self.teardowns += 1
        else:
            sys.stderr.write(self.format(record) + "\n")


@dataclass(slots=True)
class Samples:
    """Seconds from ``cancel()`` to the result, and to ``cancel()`` returning, per run."""

    to_result: list[float] = field(default_factory=list)
    to_cancel_returned: list[float] = field(default_factory=list)


async def _sample(service: SubagentService, provider: str, request: SubagentRequest, into: Samples) -> None:
    with anyio.fail_after(SAMPLE_LIMIT):
        async with service.start(provider, request) as run:
            provider_run = run.provider_run
            assert isinstance(provider_run, AcpRun)
            under_way = anyio.Event()

            def first_update(update: schema.SessionUpdate) -> None:
                under_way.set()

            # Registered before the child even exists (start() only schedules it): no update is missed.
            provider_run.on_update(first_update)
            await under_way.wait()
            started = time.perf_counter()
            cancel_returned = 0.0

            async def cancel() -> None:
                nonlocal cancel_returned
                await run.cancel()
                cancel_returned = time.perf_counter()

            async with anyio.create_task_group() as canceller:
                canceller.start_soon(cancel)
                result = await run.result()
                settled = time.perf_counter()
            if result.stop_reason != "cancelled":
                raise BenchBroken(f"run {run.id} ended {result.stop_reason!r}, not 'cancelled'")
            into.to_result.append(settled - started)
            into.to_cancel_returned.append(cancel_returned - started)


async def measure(runs: int, grace: float, work: str) -> dict[str, Samples]:
    request = SubagentRequest(prompt="go", cwd=work)
    cooperative, _ = make_provider(
        stub_command(write_scenario(work, "cooperative", COOPERATIVE)), name="cooperative", cwd=work
    )
    ignoring, _ = make_provider(
        stub_command(write_scenario(work, "ignoring", IGNORING)),
        name="ignoring",
        cwd=work,
        cancel_grace=grace,
    )
    samples = {"cooperative": Samples(), "ignoring": Samples()}
    async with SubagentService() as service:
        service.register_provider(cooperative)
        service.register_provider(ignoring)
        for name in samples:  # warm-up, outside the figures
            await _sample(service, name, request, Samples())
        for _ in range(runs):
            # Interleaved, so a burst of other load on the machine hits both alike.
            for name, into in samples.items():
                await _sample(service, name, request, into)
    leaked = live_descendants()
    if leaked:
        raise BenchBroken(f"child processes left behind: {leaked}")
    return samples


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:7.1f} ms"


def _line(label: str, values: list[float]) -> str:
    median, p90, worst = median_p90_max(values)
    return f"  {label:<37} median {_ms(median)}  p90 {_ms(p90)}  max {_ms(worst)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="samples per kind of child (default 30)")
    parser.add_argument(
        "--grace", type=float, default=0.5, help="cancel_grace of the ignoring child (default 0.5 s)"
    )
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    args = parser.parse_args()
    runs: int = args.runs
    grace: float = args.grace

    counter = _TeardownCounter()
    provider_logger = logging.getLogger("subagent.providers.acp")
    provider_logger.addHandler(counter)
    provider_logger.propagate = False
    broken: tuple[BaseException, ...] = ()
    with tempfile.TemporaryDirectory() as work:
        try:
            samples = anyio.run(measure, runs, grace, work, backend=args.backend)
        except* (BenchBroken, TimeoutError) as group:
            broken = group.exceptions
    if broken:
        for exc in broken:
            print(f"BROKEN: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1

    if counter.teardowns != runs + 1:
        print(
            f"BROKEN: the ignoring child was torn down {counter.teardowns} times in {runs + 1} runs",
            file=sys.stderr,
        )
        return 1
    cooperative, ignoring = samples["cooperative"], samples["ignoring"]
    print(
        f"cancel latency, cancel() -> cancelled result, {runs} runs each "
        f"({args.backend}; cpus={os.cpu_count()})"
    )
    print("cooperative child (answers session/cancel with cancelled)")
    print(_line("cancel() -> result", cooperative.to_result))
    print(_line("cancel() -> cancel() returned", cooperative.to_cancel_returned))
    print(f"child ignoring the cancel (cancel_grace={grace:g} s, then torn down)")
    print(_line("cancel() -> result", ignoring.to_result))
    print(_line("cancel() -> cancel() returned (gone)", ignoring.to_cancel_returned))
    print(f"  torn down after the grace: {counter.teardowns} of {runs + 1} runs (warm-up included)")
    median = median_p90_max(cooperative.to_result)[0]
    worst = median_p90_max(ignoring.to_result)[2]
    print(verdict(median < COOPERATIVE_TARGET, "cooperative: median < 50 ms", _ms(median).strip()))
    print(
        verdict(
            worst <= grace + IGNORING_EXTRA,
            f"ignoring: every result within grace + 1 s = {grace + IGNORING_EXTRA:g} s",
            f"max {_ms(worst).strip()} ({_ms(worst - grace).strip()} past the grace)",
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
