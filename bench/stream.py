"""Streaming throughput and start-up cost of our ACP client and provider path, against the SDK and the floor.

The stub agent streams N ``agent_message_chunk`` updates in one turn (written in batches at pipe
speed, so the agent is not the bottleneck). In one run, on the same machine, this measures:

* the turn's wall time (``session/prompt`` sent -> answer, every update delivered) through
  - our typed client (``subagent.acp.spawn_agent``, on asyncio and on trio),
  - the official Python SDK (``agent-client-protocol``, a bench-only dependency: ``pip install
    -e '.[bench]'``),
  - the floor: a bare asyncio parent that only splits the agent's stdout into lines;
* spawn to a ready session (initialize + session/new answered) through our client, against a bare
  handshake written with no framework (raw pipes, hand-written JSON).

Figures are medians of ``--repeat`` runs and are reported as ratios measured in the same run.
It also measures the whole provider path: one run through ``SubagentService`` + ``AcpProvider``
(start, result, dispose), its turn timed like the client's (ready session -> result), and its
start-to-dispose span reported beside it.

Targets (issue "The ACP client"): ours at least 8x faster than the SDK and within 3x of the floor;
spawn-to-ready within 1.1x of the bare handshake; the provider path within 1.2x of the client path
(issue 12: the seam costs nothing you can measure).

    python bench/stream.py [--chunks 100000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import anyio
from _common import PromptClock, verdict

from subagent.acp.client import spawn_agent
from subagent.providers.acp import AcpProvider
from subagent.service import SubagentService
from subagent.types import SubagentRequest

STUB = [sys.executable, "-m", "subagent.testing.stub_agent"]
INIT = b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":1}}\n'


def session_new(cwd: str) -> bytes:
    return (
        json.dumps(
            {"jsonrpc": "2.0", "id": 1, "method": "session/new", "params": {"cwd": cwd, "mcpServers": []}}
        ).encode()
        + b"\n"
    )


PROMPT = (
    b'{"jsonrpc":"2.0","id":2,"method":"session/prompt",'
    b'"params":{"sessionId":"session-1","prompt":[{"type":"text","text":"go"}]}}\n'
)


# -- ours ---------------------------------------------------------------------------------------------------


async def ours_turn(argv: list[str], cwd: str, chunks: int) -> float:
    async with spawn_agent(argv) as client:
        await client.initialize()
        session = await client.new_session(cwd)
        started = time.perf_counter()
        result = await session.prompt("go")
        elapsed = time.perf_counter() - started
    assert result.update_count == chunks, result.update_count
    return elapsed


async def ours_ready(argv: list[str], cwd: str) -> float:
    started = time.perf_counter()
    async with spawn_agent(argv) as client:
        await client.initialize()
        await client.new_session(cwd)
        elapsed = time.perf_counter() - started
    return elapsed


# -- the whole provider path: SubagentService + AcpProvider --------------------------------------------------


async def provider_turn(argv: list[str], cwd: str, chunks: int, spans: list[float]) -> float:
    """One run through the service: the turn is timed from the prompt to ``result()``, as the
    client path's is; start -> dispose goes into ``spans``."""
    provider = AcpProvider(argv, name="stub", cwd=cwd)
    async with SubagentService(progress_interval=None) as service:
        service.register_provider(provider)
        with PromptClock() as clock:
            began = time.perf_counter()
            run = service.start("stub", SubagentRequest(prompt="go"))
            await run.started()
            result = await run.result()
            finished = time.perf_counter()
            await run.dispose()
            spans.append(time.perf_counter() - began)
    assert clock.sent_at is not None
    elapsed = finished - clock.sent_at
    assert result.stop_reason == "completed", result
    # Every chunk arrived, in order, into the output.
    assert result.output == "".join(f"chunk {index} " for index in range(chunks)), len(result.output)
    return elapsed


# -- the floor and the bare handshake ---------------------------------------------------------------------


async def _read_until_id(stdout: asyncio.StreamReader, request_id: int) -> int:
    """Split stdout into lines until the response to ``request_id``; return how many lines came before."""
    marker = b'"id":%d' % request_id
    buffer = b""
    lines = 0
    while True:
        data = await stdout.read(1 << 16)
        if not data:
            raise RuntimeError("the agent closed stdout early")
        buffer += data
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            if marker in line[:40]:
                return lines
            lines += 1


async def floor_turn(argv: list[str], cwd: str, chunks: int) -> float:
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert process.stdin is not None
    assert process.stdout is not None
    try:
        process.stdin.write(INIT + session_new(cwd))
        await _read_until_id(process.stdout, 1)
        started = time.perf_counter()
        process.stdin.write(PROMPT)
        lines = await _read_until_id(process.stdout, 2)
        elapsed = time.perf_counter() - started
        assert lines == chunks, lines
        return elapsed
    finally:
        process.stdin.close()
        await process.wait()


async def bare_ready(argv: list[str], cwd: str) -> float:
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert process.stdin is not None
    assert process.stdout is not None
    try:
        process.stdin.write(INIT + session_new(cwd))
        await _read_until_id(process.stdout, 1)
        return time.perf_counter() - started
    finally:
        process.stdin.close()
        await process.wait()


# -- the official SDK ---------------------------------------------------------------------------------------


async def sdk_turn(argv: list[str], cwd: str, chunks: int) -> float:
    import acp  # the official SDK: a bench-only dependency
    from acp import schema as sdk_schema

    received = 0

    class Collector:
        async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
            nonlocal received
            received += 1

        async def request_permission(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    async with acp.spawn_agent_process(lambda agent: cast(Any, Collector()), argv[0], *argv[1:]) as (
        connection,
        _process,
    ):
        await connection.initialize(protocol_version=1)
        session = await connection.new_session(cwd=cwd, mcp_servers=[])
        started = time.perf_counter()
        await connection.prompt(
            session_id=session.session_id, prompt=[sdk_schema.TextContentBlock(type="text", text="go")]
        )
        elapsed = time.perf_counter() - started
    assert received == chunks, received
    return elapsed


# -- running ------------------------------------------------------------------------------------------------


def median_of(repeat: int, run: Callable[[], Awaitable[float]], backend: str = "asyncio") -> float:
    samples = [anyio.run(run, backend=backend) for _ in range(repeat)]
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=100_000, help="updates in the turn (default 100,000)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; each figure is the median (default 5)")
    parser.add_argument(
        "--no-sdk", action="store_true", help="skip the official SDK (if it is not installed)"
    )
    args = parser.parse_args()
    chunks: int = args.chunks
    repeat: int = args.repeat

    with tempfile.TemporaryDirectory() as work:
        scenario = Path(work) / "flood.json"
        scenario.write_text(
            json.dumps({"turns": [[{"step": "flood", "count": chunks, "text": "chunk {i} "}]]})
        )
        argv = [*STUB, "--scenario", str(scenario)]
        ready_argv = [*STUB, "--scenario", str(Path(work) / "ready.json")]
        (Path(work) / "ready.json").write_text("{}")

        spans: dict[str, list[float]] = {"asyncio": [], "trio": []}
        turns: dict[str, tuple[str, Callable[[], Awaitable[float]]]] = {
            "floor": ("asyncio", lambda: floor_turn(argv, work, chunks)),
            "ours (asyncio)": ("asyncio", lambda: ours_turn(argv, work, chunks)),
            "ours (trio)": ("trio", lambda: ours_turn(argv, work, chunks)),
            "provider (asyncio)": ("asyncio", lambda: provider_turn(argv, work, chunks, spans["asyncio"])),
            "provider (trio)": ("trio", lambda: provider_turn(argv, work, chunks, spans["trio"])),
        }
        # Round-robin, one of each per round: a shared machine's load then weighs on every path
        # alike, and the ratios between them hold better than with each path's runs back to back.
        samples: dict[str, list[float]] = {name: [] for name in turns}
        for _ in range(repeat):
            for name, (backend, turn) in turns.items():
                samples[name].append(anyio.run(turn, backend=backend))
        results: dict[str, float] = {name: statistics.median(times) for name, times in samples.items()}
        if not args.no_sdk:
            results["official SDK"] = median_of(max(1, repeat // 2), lambda: sdk_turn(argv, work, chunks))
        bare = median_of(repeat * 2, lambda: bare_ready(ready_argv, work))
        ready = median_of(repeat * 2, lambda: ours_ready(ready_argv, work))

    print(
        f"streaming {chunks:,} agent_message_chunk updates in one turn "
        f"(median of {repeat}; cpus={os.cpu_count()})"
    )
    ours = results["ours (asyncio)"]
    for name, seconds in results.items():
        print(
            f"  {name:<18} {seconds:8.3f} s  {chunks / seconds:12,.0f} chunks/s  "
            f"{seconds / results['floor']:6.2f}x floor"
        )
    for backend in ("asyncio", "trio"):
        print(
            f"  {f'provider ({backend})':<18} {statistics.median(spans[backend]):8.3f} s  "
            "start to dispose: spawn, handshake, the turn, teardown"
        )
    print("spawn to a ready session (initialize + session/new)")
    print(f"  bare handshake   {bare * 1000:8.1f} ms")
    print(f"  ours             {ready * 1000:8.1f} ms  {ready / bare:.2f}x bare")
    if "official SDK" in results:
        speedup = results["official SDK"] / ours
        print(verdict(speedup >= 8, "ours >= 8x faster than the official SDK", f"{speedup:.1f}x"))
    else:
        print("SKIP  ours >= 8x faster than the official SDK: not measured (--no-sdk)")
    floor_ratio = ours / results["floor"]
    print(verdict(floor_ratio <= 3, "ours (asyncio) <= 3x the floor", f"{floor_ratio:.2f}x"))
    trio_ratio = results["ours (trio)"] / results["floor"]
    print(verdict(trio_ratio <= 3, "ours (trio) <= 3x the floor", f"{trio_ratio:.2f}x"))
    for backend in ("asyncio", "trio"):
        seam = results[f"provider ({backend})"] / results[f"ours ({backend})"]
        print(verdict(seam <= 1.2, f"provider path ({backend}) <= 1.2x the client path", f"{seam:.2f}x"))
    print(verdict(ready / bare <= 1.1, "spawn-to-ready <= 1.1x the bare handshake", f"{ready / bare:.2f}x"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
