"""What the OpenTelemetry instrumentation costs when no tracer provider is configured.

One run through the whole provider path (``SubagentService`` + ``AcpProvider``: start, spawn,
handshake, a turn of N ``agent_message_chunk`` updates from the stub agent, result, dispose),
timed from ``start()`` to ``result()``, in three variants measured in the same rounds:

* **instrumented**: the library as shipped, with the OpenTelemetry API imported and its default
  provider (nothing configured): each instrumentation point asks whether a provider is configured;
* **stubbed**: the same code with :mod:`subagent.observability`'s entry points replaced by no-ops
  (the floor: what the library would cost with no instrumentation at all);
* **recording**: an SDK ``TracerProvider`` configured, its spans kept in memory (a figure only:
  what tracing costs when it is on).

Two clocks: wall time, and the CPU time of this process (the parent: where the instrumentation
runs; the stub agent's work is the child's). The variants alternate within each round (their order
swaps from one round to the next), and each round's variants are compared with each other: the
figures are the medians over ``--repeat`` rounds of those paired ratios, so a shared machine's load,
which drifts over seconds, weighs on both sides of each ratio alike. The target is checked on the
CPU time, which another process's load cannot inflate; the wall-time ratio is printed beside it.

Target (issue 15): instrumented <= 1.02x stubbed on the 100,000-chunk stream, on each backend.

    python bench/telemetry.py [--chunks 100000] [--repeat 9] [--backend asyncio|trio|both]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
from _common import BenchBroken, stub_command, verdict, write_scenario
from opentelemetry import trace  # imported on purpose: the instrumented path then does its checks
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from subagent.observability import _telemetry as telemetry
from subagent.providers.acp import AcpProvider
from subagent.service import SubagentService
from subagent.types import SubagentRequest

TARGET = 1.02
"""The instrumented path's time over the stubbed one's, at most."""


async def provider_run(argv: list[str], cwd: str, chunks: int) -> tuple[float, float]:
    """One run through the service, ``start()`` to ``result()``: wall and this process's CPU
    seconds. Disposed after the clocks stop."""
    provider = AcpProvider(argv, name="stub", cwd=cwd)
    async with SubagentService(progress_interval=None) as service:
        service.register_provider(provider)
        began, began_cpu = time.perf_counter(), time.process_time()
        run = service.start("stub", SubagentRequest(prompt="go"))
        result = await run.result()
        elapsed = (time.perf_counter() - began, time.process_time() - began_cpu)
        await run.dispose()
    updates = getattr(run.provider_run, "update_count", None)
    if result.stop_reason != "completed" or updates != chunks:
        raise BenchBroken(f"the run did not stream every chunk: {result.stop_reason}, {result.error}")
    return elapsed


@contextlib.contextmanager
def stubbed() -> Iterator[None]:
    """:mod:`subagent.observability`'s entry points as no-ops, for as long as the block runs."""
    not_recording = contextlib.nullcontext()
    no_ops: dict[str, Callable[..., Any]] = {
        "enabled": lambda: False,  # the same keys as ENTRY_POINTS
        "start_span": lambda *args, **kwargs: None,
        "end_agent_span": lambda *args, **kwargs: None,
        "current": lambda span: not_recording,
        "current_context": lambda: None,
        "inject": lambda meta: meta,
        "extract": lambda meta: None,
    }
    originals = {name: getattr(telemetry, name) for name in no_ops}
    for name, stub in no_ops.items():
        setattr(telemetry, name, stub)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(telemetry, name, original)


ENTRY_POINTS = (
    "enabled",
    "start_span",
    "end_agent_span",
    "current",
    "current_context",
    "inject",
    "extract",
)
"""What the library calls in :mod:`subagent.observability` (the stubbed variant replaces exactly these)."""


def direct_cost(argv: list[str], cwd: str, chunks: int, backend: str) -> tuple[dict[str, int], float]:
    """How often one instrumented run calls each entry point, and what those calls cost in all
    (seconds), each replayed alone with the arguments it was first given: the instrumentation's
    cost without the noise of a whole run."""
    calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {name: [] for name in ENTRY_POINTS}
    originals = {name: getattr(telemetry, name) for name in ENTRY_POINTS}

    def counting(name: str) -> Callable[..., Any]:
        original = originals[name]

        def count(*args: Any, **kwargs: Any) -> Any:
            calls[name].append((args, kwargs))
            return original(*args, **kwargs)

        return count

    for name in ENTRY_POINTS:
        setattr(telemetry, name, counting(name))
    try:
        anyio.run(provider_run, argv, cwd, chunks, backend=backend)
    finally:
        for name, original in originals.items():
            setattr(telemetry, name, original)
    total = 0.0
    for name, made in calls.items():
        if not made:
            continue
        function, (args, kwargs) = originals[name], made[0]
        replay = 20_000
        began = time.perf_counter()
        for _ in range(replay):
            outcome = function(*args, **kwargs)
            if name == "current":
                with outcome:  # a context manager: entering and leaving it is part of the cost
                    pass
        total += (time.perf_counter() - began) / replay * len(made)
    return {name: len(made) for name, made in calls.items() if made}, total


@contextlib.contextmanager
def recording(provider: TracerProvider) -> Iterator[None]:
    """Spans recorded with ``provider`` for as long as the block runs."""
    telemetry.set_tracer_provider(provider)
    try:
        yield
    finally:
        telemetry.set_tracer_provider(None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=100_000, help="updates in the turn (default 100,000)")
    parser.add_argument("--repeat", type=int, default=9, help="rounds; each figure is a median (default 9)")
    parser.add_argument("--backend", choices=["asyncio", "trio", "both"], default="both")
    args = parser.parse_args()
    chunks: int = args.chunks
    repeat: int = args.repeat
    backends = ["asyncio", "trio"] if args.backend == "both" else [args.backend]
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider) or telemetry.enabled():
        raise BenchBroken("a tracer provider is configured in this environment: nothing to compare against")

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    variants: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
        "instrumented": contextlib.nullcontext,
        "stubbed": stubbed,
        "recording": lambda: recording(provider),
    }
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {
        (backend, name): [] for backend in backends for name in variants
    }
    with tempfile.TemporaryDirectory() as work:
        flood = {"turns": [[{"step": "flood", "count": chunks, "text": "chunk {i} "}]]}
        argv = stub_command(write_scenario(work, "flood", flood))
        for backend in backends:
            for name in variants:  # warm-up: imports and caches of each path, before the clock
                with variants[name]():
                    anyio.run(provider_run, argv, work, chunks, backend=backend)
        for round_index in range(repeat):
            order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
            for backend in backends:
                for name in order:
                    with variants[name]():
                        clocks = anyio.run(provider_run, argv, work, chunks, backend=backend)
                    samples[backend, name].append(clocks)
        counts, direct = direct_cost(argv, work, chunks, backends[0])
    spans_per_run = len(exporter.get_finished_spans()) / ((repeat + 1) * len(backends))
    if spans_per_run != 1:
        raise BenchBroken(f"the recording variant recorded {spans_per_run} spans per run, not 1")

    print(
        f"one run of {chunks:,} chunks through SubagentService + AcpProvider, start() to result() "
        f"(medians of {repeat} rounds; cpus={os.cpu_count()}; load average {os.getloadavg()[0]:.1f})"
    )
    floor_cpu = statistics.median(c for _, c in samples[backends[0], "stubbed"])
    made = ", ".join(f"{name} x{count}" for name, count in counts.items())
    print(
        f"  the instrumentation alone ({backends[0]}): {made} per run, {direct * 1e6:.1f} us in all, "
        f"{direct / floor_cpu:.4%} of the stubbed run's CPU time"
    )
    cpu_ratios: dict[str, float] = {}
    for backend in backends:
        print(f"  {backend:<8} {'variant':<13} {'wall':>8}  {'x stubbed':>9}  {'CPU':>8}  {'x stubbed':>9}")
        floor = samples[backend, "stubbed"]
        for name in variants:
            runs = samples[backend, name]
            wall = statistics.median(w for w, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            wall_ratio = statistics.median(w / f for (w, _), (f, _) in zip(runs, floor, strict=True))
            cpu_ratio = statistics.median(c / f for (_, c), (_, f) in zip(runs, floor, strict=True))
            print(f"  {'':<8} {name:<13} {wall:7.3f}s  {wall_ratio:8.3f}x  {cpu:7.3f}s  {cpu_ratio:8.3f}x")
            if name == "instrumented":
                cpu_ratios[backend] = cpu_ratio
    print("  (recording: a figure, no target)")
    print(
        verdict(
            direct / floor_cpu <= TARGET - 1,
            f"the calls alone <= {TARGET - 1:.0%} of a run",
            f"{direct / floor_cpu:.4%}",
        )
    )
    for backend, ratio in cpu_ratios.items():
        target = f"instrumented, no provider ({backend}) <= {TARGET}x stubbed (CPU time)"
        print(verdict(ratio <= TARGET, target, f"{ratio:.3f}x"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchBroken as exc:
        print(f"broken: {exc}", file=sys.stderr)
        sys.exit(1)
