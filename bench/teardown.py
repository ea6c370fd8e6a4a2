"""Teardown after the turn: from a run's result to ``dispose()`` returning, through the service.

Each sample is a fresh run of the bundled stub agent on one ``SubagentService``: one short turn,
then, the moment ``result()`` returns (the turn is over), ``dispose()``; the clock stops when it
returns, the child's whole process tree reaped. Two kinds of child:

* **ignores EOF** (``onStdinEof: ignore``, as both Codex adapters behave): closing its stdin does
  nothing, so teardown waits out the idle grace (``idle_close_grace``), then sends SIGTERM.
  Target: every dispose within 0.5 s of the turn's end (judged on the maximum).
* **exits on EOF** (as claude-agent-acp, Gemini CLI and the stub by default do): it must still exit
  on its own, with no signal, however short the grace. Target: no signal in any run.

Every result must be ``completed`` and every child gone the way its kind says, or the script exits 1.
Median, p90 and max of ``--runs`` samples, on asyncio and on trio.

    python bench/teardown.py [--runs 20] [--idle-close-grace 0.25] [--backend asyncio|trio|both]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import anyio
from _common import BenchBroken, live_descendants, median_p90_max, stub_command, verdict, write_scenario

from subagent import SubagentRequest, SubagentService
from subagent.acp.client import DEFAULT_IDLE_CLOSE_GRACE
from subagent.providers.acp import AcpProvider, AcpRun

TARGET = 0.5
"""Seconds from the turn's end to dispose() returning, for a child that ignores stdin EOF."""
SAMPLE_LIMIT = 60.0
"""Seconds one sample may take before the run counts as broken."""

TURN: list[Mapping[str, Any]] = [{"step": "message", "text": "done"}]
KINDS: Mapping[str, Mapping[str, Any]] = {
    "ignores EOF": {"turns": [TURN], "onStdinEof": "ignore"},
    "exits on EOF": {"turns": [TURN]},
}


async def _sample(service: SubagentService, provider: str, request: SubagentRequest) -> tuple[float, AcpRun]:
    with anyio.fail_after(SAMPLE_LIMIT):
        async with service.start(provider, request) as run:
            result = await run.result()
            turn_over = time.perf_counter()
            await run.dispose()
            gone = time.perf_counter()
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
    if result.stop_reason != "completed":
        raise BenchBroken(f"run {run.id} ended {result.stop_reason!r}, not 'completed'")
    return gone - turn_over, acp_run


async def measure(runs: int, grace: float | None, work: str) -> dict[str, list[float]]:
    request = SubagentRequest(prompt="go", cwd=work)
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    async with SubagentService() as service:
        for kind, scenario in KINDS.items():
            command = stub_command(write_scenario(work, kind.replace(" ", "-"), scenario))
            service.register_provider(AcpProvider(command, name=kind, cwd=work, idle_close_grace=grace))
        for kind in KINDS:  # warm-up, outside the figures
            await _sample(service, kind, request)
        for _ in range(runs):
            for kind, into in samples.items():  # interleaved: a burst of load hits both alike
                seconds, run = await _sample(service, kind, request)
                _check_ending(kind, run)
                into.append(seconds)
    leaked = live_descendants()
    if leaked:
        raise BenchBroken(f"child processes left behind: {leaked}")
    return samples


def _check_ending(kind: str, run: AcpRun) -> None:
    info = run.exit_info
    if info is None:
        raise BenchBroken(f"run {run.id}: no exit status after dispose()")
    if kind == "exits on EOF" and (info.teardown_signal is not None or info.returncode != 0):
        raise BenchBroken(f"run {run.id}: the child that exits on EOF did not exit cleanly: {info}")
    if kind == "ignores EOF" and info.killed_by is not signal.SIGTERM:
        raise BenchBroken(f"run {run.id}: the child that ignores EOF did not end by SIGTERM: {info}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:7.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="samples per kind of child (default 20)")
    parser.add_argument(
        "--idle-close-grace",
        type=float,
        default=DEFAULT_IDLE_CLOSE_GRACE,
        help=f"AcpProvider(idle_close_grace=...) (default {DEFAULT_IDLE_CLOSE_GRACE:g} s); "
        "a negative value means None: the full stdin_close_timeout, as before",
    )
    parser.add_argument("--backend", choices=("asyncio", "trio", "both"), default="both")
    args = parser.parse_args()
    grace: float | None = None if args.idle_close_grace < 0 else args.idle_close_grace
    backends = ("asyncio", "trio") if args.backend == "both" else (args.backend,)
    shown = "None (the full stdin_close_timeout)" if grace is None else f"{grace:g} s"
    print(
        f"teardown after the turn: result() -> dispose() returned, {args.runs} runs each "
        f"(idle_close_grace={shown}; cpus={os.cpu_count()})"
    )
    worst = 0.0
    for backend in backends:
        broken: tuple[BaseException, ...] = ()
        try:
            with tempfile.TemporaryDirectory() as work:
                samples = anyio.run(measure, args.runs, grace, work, backend=backend)
        except* (BenchBroken, TimeoutError) as group:
            broken = group.exceptions
        if broken:
            for exc in broken:
                print(f"BROKEN: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        print(f"{backend}")
        for kind, values in samples.items():
            median, p90, maximum = median_p90_max(values)
            print(f"  child that {kind:<13} median {_ms(median)}  p90 {_ms(p90)}  max {_ms(maximum)}")
        worst = max(worst, max(samples["ignores EOF"]))
    target = f"a child ignoring EOF is gone within {TARGET:g} s of its turn"
    print(verdict(worst <= TARGET, target, _ms(worst)))
    print(verdict(True, "a child exiting on EOF gets no signal", "none in any run (checked)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
