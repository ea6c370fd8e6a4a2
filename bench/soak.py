"""Soak: many short ACP runs one after another through one service, and nothing left behind.

Each run starts the bundled stub agent, has it answer one short turn (one message chunk, then
``end_turn``), and is disposed (``async with service.start(...)``), all on one ``SubagentService``.
After ``--warmup`` runs (imports, the subprocess machinery and the allocator's first arenas settle),
the baseline is taken; then ``--runs`` runs follow. Measured, from ``/proc``, at the start, after
every run (between runs) and in the middle of every run (its child live), and at the end:

* open file descriptors of this process,
* live child processes (running descendants of this process, and unreaped children),
* this process's resident memory (RSS), with ``gc.collect()`` before the start and end readings.

Targets (issue "Scale, soak and fault tolerance of ACP children"): descriptors and processes at the
end exactly equal to the start (otherwise the script exits 1: that is a leak); RSS at the end
within ``--rss-noise`` MiB (default 4) of the start. Why 4 MiB is noise and not a leak: RSS moves
in whole allocator units, not in objects. CPython's small-object allocator takes memory in 1 MiB
arenas and returns one only when every object in it is freed, so a few long-lived objects created
late (a cached regex, a grown dict, a logging record) can pin a few arenas; glibc's malloc trims
its heap lazily. A leak instead grows with the number of runs, so the script also reports the RSS
trend over the second half of the soak (KiB per 100 runs) and the change in the number of Python
objects the garbage collector tracks, which a per-run leak of even one object would show as ~runs.

    python bench/soak.py [--runs 1000] [--warmup 20] [--backend asyncio|trio]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import anyio
from _common import (
    MIB,
    BenchBroken,
    Snapshot,
    make_provider,
    snapshot,
    stub_command,
    verdict,
    write_scenario,
)

from subagent import SubagentRequest, SubagentService

RUN_LIMIT = 60.0
"""Seconds one run may take before the soak counts as broken."""


@dataclass(slots=True)
class Soak:
    """The readings of one soak. Kept as plain numbers, so that they add no object the collector tracks."""

    start: Snapshot
    end: Snapshot
    objects: list[int]
    """Objects the garbage collector tracks, after a collection: at the start, half-way, at the end."""
    max_fds: int = 0
    max_processes: int = 0
    max_rss: int = 0
    between_rss: list[int] = field(default_factory=list)
    seconds_per_run: list[float] = field(default_factory=list)

    def record(self, reading: Snapshot) -> None:
        self.max_fds = max(self.max_fds, reading.fds)
        self.max_processes = max(self.max_processes, reading.processes)
        self.max_rss = max(self.max_rss, reading.rss)


async def _one_run(service: SubagentService, request: SubagentRequest) -> Snapshot:
    """One run, start to disposed; returns the reading taken while its child was live."""
    with anyio.fail_after(RUN_LIMIT):
        async with service.start("acp", request) as run:
            result = await run.result()
            if result.stop_reason != "completed" or result.output != "ok":
                raise BenchBroken(f"run {run.id} ended {result.stop_reason!r} with {result.output!r}")
            return snapshot()


def _tracked_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


async def soak(runs: int, warmup: int, work: str) -> Soak:
    scenario = write_scenario(work, "short", {"turns": [[{"step": "message", "text": "ok"}]]})
    provider, _ = make_provider(stub_command(scenario), cwd=work)
    request = SubagentRequest(prompt="go", cwd=work)
    async with SubagentService() as service:
        service.register_provider(provider)
        for _ in range(warmup):
            await _one_run(service, request)
        objects = [_tracked_objects()]
        figures = Soak(start=snapshot(), end=snapshot(), objects=objects)
        figures.record(figures.start)
        for index in range(runs):
            if index == runs // 2:
                objects.append(_tracked_objects())
            began = time.perf_counter()
            figures.record(await _one_run(service, request))
            figures.seconds_per_run.append(time.perf_counter() - began)
            between = snapshot()
            figures.record(between)
            figures.between_rss.append(between.rss)
        if service.live_runs:
            raise BenchBroken(f"the service still lists runs: {service.live_runs}")
        objects.append(_tracked_objects())
        figures.end = snapshot()
        figures.record(figures.end)
    return figures


def _trend_kib_per_100_runs(rss: list[int]) -> float:
    """Least-squares slope of RSS over the second half of the soak, in KiB per 100 runs."""
    half = rss[len(rss) // 2 :]
    if len(half) < 2:
        return 0.0
    slope = statistics.linear_regression(range(len(half)), half).slope
    return slope * 100 / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000, help="runs measured (default 1000)")
    parser.add_argument("--warmup", type=int, default=20, help="runs before the baseline (default 20)")
    parser.add_argument(
        "--rss-noise", type=float, default=4.0, help="RSS change counted as noise, MiB (default 4)"
    )
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    args = parser.parse_args()
    runs: int = args.runs
    noise: float = args.rss_noise

    broken: tuple[BaseException, ...] = ()
    with tempfile.TemporaryDirectory() as work:
        try:
            figures = anyio.run(soak, runs, args.warmup, work, backend=args.backend)
        except* (BenchBroken, TimeoutError) as group:
            broken = group.exceptions
    if broken:
        for exc in broken:
            print(f"BROKEN: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1

    start, end = figures.start, figures.end
    median_run = statistics.median(figures.seconds_per_run)
    print(
        f"soak: {runs:,} short runs one after another through one service, after {args.warmup} "
        f"warm-up runs ({args.backend}; cpus={os.cpu_count()}; median {median_run * 1000:.0f} ms/run)"
    )
    print(f"  {'':<22}{'start':>10}{'end':>10}{'delta':>10}{'max':>10}")
    print(
        f"  {'open descriptors':<22}{start.fds:>10}{end.fds:>10}{end.fds - start.fds:>+10}"
        f"{figures.max_fds:>10}"
    )
    print(
        f"  {'live child processes':<22}{start.processes:>10}{end.processes:>10}"
        f"{end.processes - start.processes:>+10}{figures.max_processes:>10}"
    )
    rss_delta = (end.rss - start.rss) / MIB
    print(
        f"  {'RSS (MiB)':<22}{start.rss / MIB:>10.1f}{end.rss / MIB:>10.1f}{rss_delta:>+10.1f}"
        f"{figures.max_rss / MIB:>10.1f}"
    )
    first, middle, last = figures.objects
    print(
        f"  {'gc-tracked objects':<22}{first:>10}{last:>10}{last - first:>+10}"
        f"   ({last - middle:+} over the second half)"
    )
    between_rss = figures.between_rss
    print(
        f"  RSS between runs: spread {(max(between_rss) - min(between_rss)) / MIB:.1f} MiB; trend over "
        f"the second half {_trend_kib_per_100_runs(between_rss):+.1f} KiB per 100 runs"
    )
    fds_equal = end.fds == start.fds
    processes_equal = end.processes == start.processes
    print(verdict(fds_equal, "open descriptors: end == start", f"{start.fds} -> {end.fds}"))
    print(
        verdict(
            processes_equal, "live child processes: end == start", f"{start.processes} -> {end.processes}"
        )
    )
    print(verdict(abs(rss_delta) <= noise, f"RSS: |end - start| <= {noise:g} MiB", f"{rss_delta:+.1f} MiB"))
    if not (fds_equal and processes_equal):
        print("BROKEN: descriptors or processes leaked", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
