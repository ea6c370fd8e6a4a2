"""The two-node Ray cluster the suite starts itself (tests/raycluster.py): each node is where a task
pinned to it runs, its processes are found by their tag and are not descendants of the test process, an
extra node joins and leaves whole, and what the cluster costs (start-up time, memory) is measured."""

from __future__ import annotations

import os
from typing import Any

import pytest

from subagent.testing import leaked_processes, process_info, process_is_gone
from tests.raycluster import (
    HEAD_RESOURCE,
    NODE_TAG_VARIABLE,
    SECOND_RESOURCE,
    STOP_TIMEOUT,
    RayCluster,
    ray_or_skip,
    wait_until,
)

pytestmark = pytest.mark.subprocess

GET_TIMEOUT = 60.0
"""A hang guard on one pinned task's result (it takes milliseconds once a worker is up)."""
MIB = 1024 * 1024


def where_am_i() -> dict[str, Any]:
    """Run on a worker: which node, which process, which node tag."""
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "tag": os.environ.get(NODE_TAG_VARIABLE),
    }


def run_pinned(node_id: str) -> dict[str, Any]:
    """`where_am_i` as a task that may run only on ``node_id`` (hard node affinity), and its answer."""
    ray = ray_or_skip()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(where_am_i).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    )
    answer: dict[str, Any] = ray.get(task.remote(), timeout=GET_TIMEOUT)
    return answer


def test_a_task_pinned_to_the_second_node_runs_there_and_not_on_the_head(ray_cluster: RayCluster) -> None:
    on_head = run_pinned(ray_cluster.head_node_id)
    on_second = run_pinned(ray_cluster.second_node_id)

    assert ray_cluster.head_node_id != ray_cluster.second_node_id
    assert on_head["node_id"] == ray_cluster.head_node_id
    assert on_second["node_id"] == ray_cluster.second_node_id
    # The workers carry their node's tag: that is how the tests find every process of a node.
    assert on_head["tag"] == ray_cluster.head.tag
    assert on_second["tag"] == ray_cluster.second.tag
    assert on_second["pid"] in {info.pid for info in ray_cluster.second.processes()}


def test_each_node_has_a_raylet_of_its_own_and_only_the_head_a_gcs(ray_cluster: RayCluster) -> None:
    ray = ray_or_skip()
    head_raylet, second_raylet = ray_cluster.head.raylet_pid, ray_cluster.second.raylet_pid

    assert head_raylet != second_raylet
    for pid in (head_raylet, second_raylet):
        info = process_info(pid)
        assert info is not None
        assert info.comm == "raylet"
        assert not info.is_zombie
    assert ray_cluster.head.gcs_pid is not None
    assert ray_cluster.second.gcs_pid is None
    resources = {entry["NodeID"]: entry["Resources"] for entry in ray.nodes() if entry["Alive"]}
    assert resources[ray_cluster.head_node_id][HEAD_RESOURCE] == 1
    assert SECOND_RESOURCE not in resources[ray_cluster.head_node_id]
    assert resources[ray_cluster.second_node_id][SECOND_RESOURCE] == 1


def test_no_process_of_the_cluster_is_a_descendant_of_the_test_process(ray_cluster: RayCluster) -> None:
    # Were they, every assert_no_leaks of a later test in the session would count the cluster as a leak.
    cluster_pids = {info.pid for info in ray_cluster.processes()}

    assert {ray_cluster.head.raylet_pid, ray_cluster.second.raylet_pid} <= cluster_pids
    assert not cluster_pids & {info.pid for info in leaked_processes()}


def test_an_extra_node_joins_runs_its_pinned_task_and_leaves_nothing_behind(ray_cluster: RayCluster) -> None:
    ray = ray_or_skip()
    with ray_cluster.extra_node("probe") as node:
        assert node.node_id not in (ray_cluster.head_node_id, ray_cluster.second_node_id)
        answer = run_pinned(node.node_id)
        assert answer["node_id"] == node.node_id
        assert answer["tag"] == node.tag
        worker = answer["pid"]

    assert node.processes() == []
    assert process_is_gone(worker)
    wait_until(
        lambda: not any(entry["NodeID"] == node.node_id and entry["Alive"] for entry in ray.nodes()),
        STOP_TIMEOUT,
        "the GCS did not see the stopped node go",
    )
    # The shared nodes are untouched.
    assert run_pinned(ray_cluster.second_node_id)["node_id"] == ray_cluster.second_node_id


def test_the_cluster_costs_are_measured(ray_cluster: RayCluster, pytestconfig: pytest.Config) -> None:
    rss, pss = ray_cluster.memory()
    head_rss, head_pss = ray_cluster.head.memory()
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(
                f"\nRay cluster: started in {ray_cluster.started_in:.1f} s,"
                f" {len(ray_cluster.processes())} processes,"
                f" RSS {rss / MIB:.0f} MiB (head {head_rss / MIB:.0f}),"
                f" PSS {pss / MIB:.0f} MiB (head {head_pss / MIB:.0f})"
            )

    # Wide bounds: measured about 0.75 GiB RSS and 0.45 GiB PSS for the two idle nodes.
    assert 0 < pss <= rss < 3 * 1024 * MIB
