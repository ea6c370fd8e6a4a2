"""In-process children: what the seam costs per ``spawn`` run, and what an idle child weighs.

On a scripted model (``ScriptedLlm``, one streamed reply per turn), in one process:

* **overhead**: ``--runs`` runs one after another through ``SubagentService`` and ``SpawnProvider``
  (start, result, dispose: the observer task, the lifecycle events, the lineage, the registry),
  against the floor: the same turn on a bare ``Agent`` made and closed by hand. Reported as time per
  run and as the ratio of the two, measured in the same process one after the other.
* **journal**: the same runs through a service keeping a run journal (``SubagentService(journal=...)``:
  each run's start and result committed by the journal's writer thread before its caller hears of them),
  one after another and ``--children`` at once; reported per run and as the ratio to the unjournaled path.
* **fan-out**: ``--children`` runs started at once, each turn complete and each child kept idle for
  ``resume()``; the parent's resident memory with all of them live, minus the baseline before,
  per child. Then every run is disposed: the registry must be empty and no task of theirs left.

Targets: the seam path at most 3x the bare agent's turn; under 64 KiB of parent memory per idle
in-process child; nothing left after disposal (else the script exits 1).

    python bench/inprocess.py [--runs 2000] [--children 1000] [--backend asyncio|trio]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

import anyio
from _common import MIB, BenchBroken, rss_bytes, verdict

from subagent import SubagentRequest, SubagentService
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import Agent, AgentRegistry, Reply, ScriptedLlm
from subagent.service import ServiceRun

ANSWER = "A short answer, streamed in a few word-sized pieces like a model's."


def scripted() -> ScriptedLlm:
    return ScriptedLlm(lambda _request: Reply(ANSWER))


async def bare_turns(runs: int) -> float:
    """Seconds per turn on a bare agent, made and closed by hand: the floor."""
    llm = scripted()
    agents = AgentRegistry()
    started = time.perf_counter()
    for index in range(runs):
        agent = Agent(llm=llm, id=f"bare-{index}", registry=agents)
        result = await agent.run_turn("go")
        if result.output != ANSWER:
            raise BenchBroken(f"bare turn {index}: {result}")
        await agent.close()
    return (time.perf_counter() - started) / runs


async def service_runs(runs: int, journal: str | None = None) -> float:
    """Seconds per run through the service and the spawn provider (start, result, dispose)."""
    provider = SpawnProvider(llm=scripted())
    async with SubagentService(progress_interval=None, journal=journal) as subagents:
        subagents.register_provider(provider)
        started = time.perf_counter()
        for index in range(runs):
            async with subagents.start("spawn", SubagentRequest(prompt="go")) as run:
                result = await run.result()
            if result.output != ANSWER:
                raise BenchBroken(f"run {index}: {result}")
        elapsed = time.perf_counter() - started
    if len(provider.agents):
        raise BenchBroken(f"{len(provider.agents)} agents left in the registry")
    return elapsed / runs


async def journaled_fan_out(children: int, journal: str | None) -> float:
    """Seconds per run for ``children`` runs started at once (their journal writes share transactions)."""
    provider = SpawnProvider(llm=scripted())
    async with SubagentService(progress_interval=None, journal=journal) as subagents:
        subagents.register_provider(provider)
        started = time.perf_counter()
        runs = [subagents.start("spawn", SubagentRequest(prompt="go")) for _ in range(children)]
        for run in runs:
            if (await run.result()).output != ANSWER:
                raise BenchBroken(f"{run.id}: not the answer")
        async with anyio.create_task_group() as disposers:
            for run in runs:
                disposers.start_soon(run.dispose)
        elapsed = time.perf_counter() - started
        if journal is not None and len(await subagents.runs(limit=None)) < children:
            raise BenchBroken("runs missing from the journal")
    return elapsed / children


async def fan_out(children: int) -> tuple[float, int, int]:
    """Bytes of parent memory per idle child, and the task counts before and after."""
    provider = SpawnProvider(llm=scripted())
    tasks_before = len(anyio.get_running_tasks())
    async with SubagentService(progress_interval=None) as subagents:
        subagents.register_provider(provider)
        gc.collect()
        baseline = rss_bytes()
        runs: list[ServiceRun] = [
            subagents.start("spawn", SubagentRequest(prompt="go")) for _ in range(children)
        ]
        for run in runs:
            result = await run.result()
            if result.output != ANSWER:
                raise BenchBroken(f"{run.id}: {result}")
        gc.collect()
        loaded = rss_bytes()
        if len(provider.agents) != children:
            raise BenchBroken(f"{len(provider.agents)} idle agents live, expected {children}")
        async with anyio.create_task_group() as disposers:
            for run in runs:
                disposers.start_soon(run.dispose)
        if len(provider.agents):
            raise BenchBroken(f"{len(provider.agents)} agents left after disposal")
        del runs
    tasks_after = len(anyio.get_running_tasks())
    return (loaded - baseline) / children, tasks_before, tasks_after


async def main(args: argparse.Namespace) -> int:
    await service_runs(50)  # warm-up: imports, decoder and validator caches
    await bare_turns(50)
    seam, bare = [], []
    for _ in range(args.repeat):
        bare.append(await bare_turns(args.runs))
        seam.append(await service_runs(args.runs))
    seam_s, bare_s = statistics.median(seam), statistics.median(bare)
    ratio = seam_s / bare_s
    with tempfile.TemporaryDirectory() as directory:
        journaled, at_once, at_once_journaled = [], [], []
        for index in range(args.repeat):
            path = os.path.join(directory, f"runs-{index}.db")
            journaled.append(await service_runs(args.runs, path))
            at_once.append(await journaled_fan_out(args.children, None))
            at_once_journaled.append(await journaled_fan_out(args.children, path))
    journaled_s = statistics.median(journaled)
    at_once_s, at_once_journaled_s = statistics.median(at_once), statistics.median(at_once_journaled)
    per_child, tasks_before, tasks_after = await fan_out(args.children)

    print(f"backend {args.backend}; medians of {args.repeat} rounds of {args.runs} runs")
    print(f"bare agent turn:        {bare_s * 1e6:8.1f} us per turn (the floor)")
    print(f"spawn through the seam: {seam_s * 1e6:8.1f} us per run (start, result, dispose)")
    print(
        f"  with a run journal:   {journaled_s * 1e6:8.1f} us per run, one after another "
        f"({journaled_s / seam_s:.2f}x without)"
    )
    print(
        f"  {args.children} at once:         {at_once_s * 1e6:8.1f} us per run without a journal, "
        f"{at_once_journaled_s * 1e6:.1f} with one ({at_once_journaled_s / at_once_s:.2f}x)"
    )
    checks = [
        (ratio <= 3.0, "seam / bare <= 3x", f"{ratio:.2f}x"),
        (per_child < 64 * 1024, "parent memory per idle child < 64 KiB", f"{per_child / 1024:.1f} KiB"),
        (tasks_after == tasks_before, "tasks after disposal == before", f"{tasks_before} -> {tasks_after}"),
    ]
    print(f"{args.children} idle children live, then disposed")
    for met, target, figure in checks:
        print(verdict(met, target, figure))
    print(f"parent RSS now {rss_bytes() / MIB:.1f} MiB")
    return 0 if all(met for met, _, _ in checks) else 1


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", type=int, default=2000, help="runs per round for the overhead (default 2000)"
    )
    parser.add_argument("--repeat", type=int, default=5, help="rounds; medians are reported (default 5)")
    parser.add_argument("--children", type=int, default=1000, help="idle children for the memory figure")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    args = parser.parse_args()
    try:
        return anyio.run(main, args, backend=args.backend)
    except BenchBroken as exc:
        print(f"BROKEN: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
