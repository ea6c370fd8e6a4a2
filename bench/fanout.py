"""Fan-out: many ACP children through one service at once, against the same runs one after another.

Each run is the bundled stub agent streaming a turn of ``--chunks`` ``agent_message_chunk`` updates
and then ending it (``end_turn``); the child stays alive after the turn, held open for ``resume()``,
until its run is disposed. In one process, on one ``SubagentService``, this measures:

* **concurrent**: ``--children`` runs started at once (``AcpProvider(max_concurrent=children)`` where
  the provider has that parameter, so nothing queues); every one must complete with every chunk
  delivered, or the script exits 1. Wall time from the first ``start()`` to the last run disposed.
* **memory per live child**: the parent's resident memory with all those children live and idle
  (each turn complete, each child held open), minus the baseline taken just before they started,
  divided by their number. It includes what a finished run keeps: its transcript of every update.
* **sequential**: the same runs one at a time (start, result, dispose), wall time.

Targets (issue "Scale, soak and fault tolerance of ACP children"): all children complete; under
1 MiB of parent memory per live child. The concurrent/sequential time ratio is reported, with the
CPU time the phase used, since on a 2-core machine the children's own start-up is CPU-bound.
After the fan-out every child must be gone and every descriptor closed, or the script exits 1.

    python bench/fanout.py [--children 100] [--chunks 1000] [--backend asyncio|trio]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass

import anyio
from _common import (
    MIB,
    BenchBroken,
    live_descendants,
    make_provider,
    open_fd_count,
    peak_rss_bytes,
    rss_bytes,
    stub_command,
    verdict,
    write_scenario,
)

from subagent import SubagentRequest, SubagentService
from subagent.providers.acp import AcpRun
from subagent.service import ServiceRun

MEMORY_TARGET = 1 * MIB
READY_AND_TURN_LIMIT = 300.0
"""Seconds the whole fan-out may take before it counts as broken (not as slow)."""


@dataclass(slots=True)
class Phase:
    """Wall time and CPU time (parent and reaped children) of one phase."""

    wall: float = 0.0
    parent_cpu: float = 0.0
    children_cpu: float = 0.0


class _Clock:
    """Measures a `Phase`: wall clock plus ``getrusage`` for this process and its reaped children."""

    def __init__(self) -> None:
        self._wall = time.perf_counter()
        self._self = resource.getrusage(resource.RUSAGE_SELF)
        self._children = resource.getrusage(resource.RUSAGE_CHILDREN)

    def stop(self) -> Phase:
        wall = time.perf_counter() - self._wall
        me = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return Phase(
            wall=wall,
            parent_cpu=me.ru_utime + me.ru_stime - self._self.ru_utime - self._self.ru_stime,
            children_cpu=children.ru_utime
            + children.ru_stime
            - self._children.ru_utime
            - self._children.ru_stime,
        )


def _check_complete(run: ServiceRun, stop_reason: str, chunks: int) -> None:
    provider_run = run.provider_run
    assert isinstance(provider_run, AcpRun)
    # update_count counts every update received; run.updates keeps only the last max_kept_updates.
    if stop_reason != "completed" or provider_run.update_count != chunks:
        raise BenchBroken(
            f"run {run.id} ended {stop_reason!r} with {provider_run.update_count} of {chunks} updates"
        )


async def _one_sequential(service: SubagentService, request: SubagentRequest, chunks: int) -> None:
    async with service.start("acp", request) as run:
        result = await run.result()
        _check_complete(run, result.stop_reason, chunks)


@dataclass(slots=True)
class Figures:
    """Everything the fan-out measured."""

    concurrent: Phase
    sequential: Phase
    baseline_rss: int
    live_rss: int
    peak_rss: int
    fds_before: int
    fds_live: int
    processes_live: int


async def fan_out(children: int, chunks: int, work: str) -> tuple[Figures, str]:
    scenario = write_scenario(
        work, "fanout", {"turns": [[{"step": "flood", "count": chunks, "text": "chunk {i} "}]]}
    )
    provider, note = make_provider(stub_command(scenario), max_concurrent=children, cwd=work)
    request = SubagentRequest(prompt="go", cwd=work)
    async with SubagentService() as service:
        service.register_provider(provider)
        # Warm-up: imports, the subprocess machinery and the allocator's first arenas, outside the figures.
        for _ in range(3):
            await _one_sequential(service, request, chunks)
        gc.collect()
        fds_before = open_fd_count()
        baseline_rss = rss_bytes()

        # -- concurrent ------------------------------------------------------------------------------
        clock = _Clock()
        with anyio.fail_after(READY_AND_TURN_LIMIT):
            runs = [service.start("acp", request) for _ in range(children)]
            async with anyio.create_task_group() as waiters:
                for run in runs:

                    async def wait_complete(run: ServiceRun = run) -> None:
                        result = await run.result()
                        _check_complete(run, result.stop_reason, chunks)

                    waiters.start_soon(wait_complete)
        paused = time.perf_counter()
        gc.collect()
        live_rss = rss_bytes()
        fds_live = open_fd_count()
        processes_live = len(live_descendants())
        pause = time.perf_counter() - paused
        async with anyio.create_task_group() as disposers:
            for run in runs:
                disposers.start_soon(run.dispose)
        concurrent = clock.stop()
        concurrent.wall -= pause
        peak_rss = max(peak_rss_bytes(), live_rss)  # VmHWM is synced lazily: never below a reading
        del runs

        # -- sequential ------------------------------------------------------------------------------
        clock = _Clock()
        for _ in range(children):
            await _one_sequential(service, request, chunks)
        sequential = clock.stop()

    gc.collect()
    leaked = live_descendants()
    fds_after = open_fd_count()
    if leaked or fds_after != fds_before:
        raise BenchBroken(
            f"after the fan-out: processes left {leaked}, descriptors {fds_before} -> {fds_after}"
        )
    return (
        Figures(
            concurrent=concurrent,
            sequential=sequential,
            baseline_rss=baseline_rss,
            live_rss=live_rss,
            peak_rss=peak_rss,
            fds_before=fds_before,
            fds_live=fds_live,
            processes_live=processes_live,
        ),
        note,
    )


def _phase_line(name: str, phase: Phase, children: int) -> str:
    cores = os.cpu_count() or 1
    busy = (phase.parent_cpu + phase.children_cpu) / (phase.wall * cores)
    return (
        f"  {name:<11} {phase.wall:7.2f} s  {phase.wall / children * 1000:7.1f} ms/run   CPU: parent "
        f"{phase.parent_cpu:6.2f} s, children {phase.children_cpu:6.2f} s ({busy:4.0%} of {cores} cores)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--children", type=int, default=100, help="runs at once (default 100)")
    parser.add_argument("--chunks", type=int, default=1000, help="chunks streamed per turn (default 1000)")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    args = parser.parse_args()
    children: int = args.children
    chunks: int = args.chunks

    broken: tuple[BaseException, ...] = ()
    with tempfile.TemporaryDirectory() as work:
        try:
            figures, note = anyio.run(fan_out, children, chunks, work, backend=args.backend)
        except* (BenchBroken, TimeoutError) as group:
            broken = group.exceptions
    if broken:
        for exc in broken:
            print(f"BROKEN: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1

    per_child = (figures.live_rss - figures.baseline_rss) / children
    ratio = figures.concurrent.wall / figures.sequential.wall
    print(
        f"fan-out: {children} stub-agent children through one service, a turn of {chunks:,} "
        f"chunk{'' if chunks == 1 else 's'} each "
        f"({args.backend}; cpus={os.cpu_count()})"
    )
    print(f"  {note}")
    print(f"  all {children} concurrent and {children} sequential runs completed with every chunk")
    print(_phase_line("concurrent", figures.concurrent, children))
    print(_phase_line("sequential", figures.sequential, children))
    print(
        f"  concurrent / sequential: {ratio:.2f} ({1 / ratio:.1f}x faster at once; the children's own "
        "CPU time bounds it on this many cores)"
    )
    print(
        f"  parent RSS: baseline {figures.baseline_rss / MIB:.1f} MiB, {children} children live and idle "
        f"{figures.live_rss / MIB:.1f} MiB, peak {figures.peak_rss / MIB:.1f} MiB"
    )
    print(
        f"  per live child: {per_child / 1024:.0f} KiB of parent memory, "
        f"{(figures.fds_live - figures.fds_before) / children:.1f} descriptors "
        f"({figures.processes_live} child processes were live)"
    )
    print(verdict(True, f"all {children} children complete", "yes"))
    print(
        verdict(
            per_child < MEMORY_TARGET,
            "parent memory per live child < 1 MiB",
            f"{per_child / 1024:.0f} KiB",
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
