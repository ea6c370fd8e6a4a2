"""The Ray transport against a real two-node Ray cluster on this machine (tests/raycluster.py)."""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import pytest

from subagent.acp.ray import RayChannel, RayTransport
from subagent.testing.leaks import LEAK_TAG_VARIABLE, leak_tag, leaked_processes, open_fds
from tests.raycluster import RayCluster, ray_or_skip

WAIT = 30  # seconds: a hang guard on one step, never a statement about speed


def _open_files_but_sockets() -> collections.Counter[str]:
    """What this process's descriptors point at, sockets (and the scan's own descriptor) left out."""
    scan = f"/proc/{os.getpid()}/fd"
    return collections.Counter(
        target for target in open_fds().values() if not target.startswith("socket:") and target != scan
    )


@contextlib.asynccontextmanager
async def assert_no_leaks_beside_ray() -> AsyncIterator[str]:
    """`subagent.testing.leaks.assert_no_leaks` for a Ray driver: no process of ours or carrying the leak
    tag (yielded) is left, and no file descriptor but sockets. Ray's core worker opens and closes its
    gRPC connections (to workers, to raylets) on its own schedule, so sockets are not counted."""
    with leak_tag() as tag:
        before = _open_files_but_sockets()
        yield tag
    after = _open_files_but_sockets()
    assert after == before, f"descriptors opened {after - before}, closed {before - after}"
    leaked = leaked_processes(tag)
    assert not leaked, f"processes left behind: {leaked}"


class LeakTaggedRayTransport(RayTransport):
    """A `RayTransport` that hands each child this process's leak tag (`LEAK_TAG_VARIABLE`), as set when
    the child is opened (by `subagent.testing.leaks.assert_no_leaks`): the child runs on a Ray node,
    not as our descendant, and the tag is how a leak check finds what is left of it."""

    @contextlib.asynccontextmanager
    async def open(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        on_stderr_line: Callable[[str], object] | None = None,
    ) -> AsyncIterator[RayChannel]:
        tag = os.environ.get(LEAK_TAG_VARIABLE)
        if tag is not None:
            env = {**(env or {}), LEAK_TAG_VARIABLE: tag}
        async with super().open(argv, env=env, cwd=cwd, on_stderr_line=on_stderr_line) as channel:
            yield channel


@pytest.fixture(scope="session")
def ray_nodes(ray_cluster: RayCluster) -> RayCluster:
    """The session's cluster, once this process has talked to an actor on each node: the first contact
    with a node opens connections that stay (a leak check must not count them against a test)."""
    ray = ray_or_skip()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(_Probe)
    for node_id in (ray_cluster.head_node_id, ray_cluster.second_node_id):
        strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
        actor = probe.options(num_cpus=0, scheduling_strategy=strategy).remote()
        assert ray.get(actor.node.remote(), timeout=WAIT) == node_id
        with contextlib.suppress(ray.exceptions.ActorDiedError):
            ray.get(actor.__ray_terminate__.remote(), timeout=WAIT)
    return ray_cluster


class _Probe:
    def node(self) -> str:
        import ray

        node_id: str = ray.get_runtime_context().get_node_id()
        return node_id
