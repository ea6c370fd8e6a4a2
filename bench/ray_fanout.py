"""Fan-out over Ray: many ACP children on a two-node Ray cluster at once, against the same fan-out here.

The script starts the test suite's two-node cluster on this machine (``tests/raycluster.py``: a head
and a second node, each one CPU, token auth, stopped by pid at the end) and becomes its driver. On one
``SubagentService``, ``--children`` runs of the bundled stub agent, each streaming a turn of
``--chunks`` chunks, are started at once through ``AcpProvider(transport=RayTransport())`` (an actor
per child, wherever Ray places it: it reserves no CPU), then the same fan-out through the local
transport, in the same run. Reported for each:

* **all complete**: every run ends ``completed`` with every chunk delivered, or the script exits 1;
* **wall time** from the first ``start()`` to the last result;
* **driver memory per live child**: this process's resident memory with every child live and idle
  (its turn done, held open for ``resume()``), minus the baseline just before, over their number: the
  fan-in cost on the caller's side, Ray's client-side state per actor included;
* **driver threads per live child**: threads of this process with every child live, over their number
  (a channel takes its stream's items in a thread of its own);
* **node memory per child** (Ray only): the cluster's processes' proportional set size (PSS) with the
  children live, minus the idle cluster's, over their number: an actor's worker, the supervisor and the
  agent on the node, and the raylets' and GCS's bookkeeping for it; beside it, the growth of the head's
  GCS and of the raylets alone (their resident size) per child: what grows on the head with the fleet.

Afterwards no process of any child may be left, on any node (each agent carries a leak tag in its
environment; ``/proc`` is scanned), or the script exits 1. Figures are for this machine (2 cores):
``docs/scale.md`` reads them for a thousand children across nodes.

    python bench/ray_fanout.py [--children 100] [--chunks 1000] [--backend asyncio|trio]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from _common import MIB, BenchBroken, rss_bytes, stub_command, write_scenario

# tests/raycluster.py starts the cluster the Ray tests use; the repository root makes `tests` importable.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from subagent import SubagentRequest, SubagentService
from subagent.acp.transports import LocalTransport, Transport
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.service import ServiceRun
from subagent.testing import LEAK_TAG_VARIABLE

FAN_OUT_LIMIT = 600.0
"""Seconds one fan-out may take before it counts as broken (not as slow)."""
SETTLE_LIMIT = 30.0
"""Seconds the children's processes may take to be gone after their runs were disposed."""


@dataclass(slots=True)
class FanOut:
    """What one fan-out measured."""

    transport: str
    wall: float
    driver_per_child: float
    threads_per_child: float
    node_per_child: float | None
    gcs_per_child: float | None
    raylets_per_child: float | None
    nodes_used: int


async def _fan_out(
    transport: Transport, children: int, chunks: int, work: str, tag: str, cluster: Any | None
) -> FanOut:
    scenario = write_scenario(
        work, "fanout", {"turns": [[{"step": "flood", "count": chunks, "text": "chunk {i} "}]]}
    )
    provider = AcpProvider(
        stub_command(scenario),
        transport=transport,
        max_concurrent=children,
        env={LEAK_TAG_VARIABLE: tag},
        cwd=work,
        ready_timeout=FAN_OUT_LIMIT,
    )
    request = SubagentRequest(prompt="go", cwd=work)
    async with SubagentService() as service:
        service.register_provider(provider)
        # Warm-up: imports, the first actor's worker, the allocator's first arenas, outside the figures.
        async with service.start("acp", request) as run:
            await run.result()
        gc.collect()
        baseline = rss_bytes()
        node_baseline = cluster.memory()[1] if cluster is not None else 0
        threads_baseline = _thread_count()
        control_baseline = _control_plane_rss(cluster) if cluster is not None else (0, 0)
        began = time.perf_counter()
        with anyio.fail_after(FAN_OUT_LIMIT):
            runs = [service.start("acp", request) for _ in range(children)]
            async with anyio.create_task_group() as waiters:
                for run in runs:
                    waiters.start_soon(_wait_complete, run, chunks)
        wall = time.perf_counter() - began
        gc.collect()
        driver_per_child = (rss_bytes() - baseline) / children
        threads_per_child = (_thread_count() - threads_baseline) / children
        node_per_child = gcs_per_child = raylets_per_child = None
        if cluster is not None:
            node_per_child = (cluster.memory()[1] - node_baseline) / children
            gcs, raylets = _control_plane_rss(cluster)
            gcs_per_child = (gcs - control_baseline[0]) / children
            raylets_per_child = (raylets - control_baseline[1]) / children
        nodes_used = _nodes_holding(cluster, tag) if cluster is not None else 1
        async with anyio.create_task_group() as disposers:
            for run in runs:
                disposers.start_soon(run.dispose)
    return FanOut(
        transport.name,
        wall,
        driver_per_child,
        threads_per_child,
        node_per_child,
        gcs_per_child,
        raylets_per_child,
        nodes_used,
    )


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _control_plane_rss(cluster: Any) -> tuple[int, int]:
    """The resident sizes of the head's GCS and of every raylet, in bytes."""
    from tests.raycluster import rss_bytes as rss_of

    gcs = cluster.head.gcs_pid
    return (rss_of(gcs) if gcs else 0), sum(rss_of(node.raylet_pid) for node in cluster.nodes)


async def _wait_complete(run: ServiceRun, chunks: int) -> None:
    result = await run.result()
    provider_run = run.provider_run
    assert isinstance(provider_run, AcpRun)
    if result.stop_reason != "completed" or provider_run.update_count != chunks:
        raise BenchBroken(
            f"run {run.id} ended {result.stop_reason!r} ({result.error}) with "
            f"{provider_run.update_count} of {chunks} updates"
        )


def _nodes_holding(cluster: Any, tag: str) -> int:
    """On how many of the cluster's nodes a child with ``tag`` runs (a node's processes carry its tag)."""
    from tests.raycluster import NODE_TAG_VARIABLE, tagged_processes

    children = {info.pid for info in tagged_processes(LEAK_TAG_VARIABLE, tag)}
    return sum(
        1
        for node in cluster.nodes
        if children & {info.pid for info in tagged_processes(NODE_TAG_VARIABLE, node.tag)}
    )


def _left_behind(tag: str) -> list[Any]:
    from tests.raycluster import tagged_processes, wait_until

    try:
        wait_until(lambda: not tagged_processes(LEAK_TAG_VARIABLE, tag), SETTLE_LIMIT, "the children to go")
    except TimeoutError:
        return tagged_processes(LEAK_TAG_VARIABLE, tag)
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--children", type=int, default=100, help="runs at once (default 100)")
    parser.add_argument("--chunks", type=int, default=1000, help="chunks streamed per turn (default 1000)")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    args = parser.parse_args()
    try:
        from tests.raycluster import running_ray_cluster
    except ImportError as exc:  # tests/raycluster.py needs pytest (the dev extra)
        print(f"ray_fanout: skipped: the test cluster helper cannot be imported: {exc}")
        return 0
    try:
        import ray  # noqa: F401
    except ImportError:
        print("ray_fanout: skipped: ray is not installed (pip install 'subagent-seam[ray]')")
        return 0
    from subagent.acp.transports import RayTransport

    print(f"== fan-out of {args.children} children, {args.chunks} chunks each, on {args.backend}")
    with tempfile.TemporaryDirectory() as work, running_ray_cluster() as cluster:
        print(f"  two-node cluster up in {cluster.started_in:.1f} s")
        figures: list[FanOut] = []
        for transport, on_cluster in ((RayTransport(), cluster), (LocalTransport(), None)):
            tag = f"ray-fanout-{transport.name}-{time.monotonic_ns()}"
            fan_out = partial(_fan_out, transport, args.children, args.chunks, work, tag, on_cluster)
            figures.append(anyio.run(fan_out, backend=args.backend))
            left = _left_behind(tag)
            if left:
                raise BenchBroken(f"processes of the {transport.name} children left behind: {left}")
    ray_figures, local_figures = figures
    for figure in figures:
        print(
            f"  {figure.transport:<10} all {args.children} complete in {figure.wall:6.2f} s "
            f"({figure.nodes_used} node(s)); driver {figure.driver_per_child / MIB:5.2f} MiB and "
            f"{figure.threads_per_child:.2f} threads per child"
        )
        if figure.node_per_child is not None and figure.gcs_per_child and figure.raylets_per_child:
            gcs_kib, raylets_kib = figure.gcs_per_child / 1024, figure.raylets_per_child / 1024
            print(
                f"  {'':<10} nodes {figure.node_per_child / MIB:6.1f} MiB PSS per child; of which GCS "
                f"{gcs_kib:.0f} KiB, raylets {raylets_kib:.0f} KiB per child"
            )
    print(
        f"  ray / local: wall {ray_figures.wall / local_figures.wall:.2f}x, driver memory per child "
        f"{ray_figures.driver_per_child / max(local_figures.driver_per_child, 1):.2f}x"
    )
    print("  nothing of any child left on any node")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchBroken as exc:
        print(f"ray_fanout: BROKEN: {exc}")
        sys.exit(1)
