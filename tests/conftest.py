"""Shared test configuration: a test's backends, how xdist spreads the suite, hypothesis profiles."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.raycluster import ray_cluster  # noqa: F401  (the session's two-node Ray cluster, for any module)

# `make test` runs a bounded, reproducible sample of every property (the same inputs on every run, so a
# failure in CI reproduces locally); `make fuzz` (HYPOTHESIS_PROFILE=fuzz) explores far more, at random,
# and keeps what it finds in .hypothesis/ to replay first next time.
settings.register_profile(
    "default",
    max_examples=60,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "fuzz",
    max_examples=3000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# Where trio adds something: the modules that drive backend-specific code (child processes, descriptors and
# sockets as streams, threads, cancellation and timeouts). Their async tests run on asyncio and on trio.
# Everywhere else the code under test reaches the backend only through those same layers, so running it twice
# would test them again at the price of a second run: those tests run on asyncio, except the ones marked
# `both_backends` (a representative few of a heavy suite whose lower layers are tested on both here).
BOTH_BACKENDS_MODULES = frozenset(
    {
        "test_acp_concurrency",  # queued and cancelled starts
        "test_acp_lifecycle",  # teardown of a live agent on cancel and close
        "test_chat_server",  # sockets, the fake model server
        "test_client_process",  # the ACP client over a real child process
        "test_connection",  # JSON-RPC over streams: cancellation of requests and handlers
        "test_connection_drain",
        "test_fake_model_servers",
        "test_faults",  # the fault battery on local child processes
        "test_jsonrpc_letter",
        "test_liveness",  # timeouts and silence
        "test_openai_adapter",  # httpx streaming
        "test_outcome",  # settle-once outcomes and cancellation
        "test_process",  # spawn, stderr drain, teardown of the tree
        "test_service",  # the service's task group and disposal
        "test_ssh_transport",  # ssh child processes and their streams
        "test_supervisor",
        "test_terminals",  # terminal processes and their output
        "test_transport",  # the channel protocol
    }
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "both_backends: run this async test on trio as well as asyncio (see tests/conftest.py)"
    )


@pytest.hookimpl(tryfirst=True)  # before pytest parametrizes anyio's fixture with every backend
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Give each async test its backends: asyncio, and trio where it adds something."""
    if "anyio_backend" not in metafunc.fixturenames or _parametrizes(metafunc, "anyio_backend"):
        return
    both = metafunc.module.__name__.rpartition(".")[2] in BOTH_BACKENDS_MODULES or (
        metafunc.definition.get_closest_marker("both_backends") is not None
    )
    metafunc.parametrize("anyio_backend", ["asyncio", "trio"] if both else ["asyncio"])


def _parametrizes(metafunc: pytest.Metafunc, name: str) -> bool:
    return any(name in mark.args[0] for mark in metafunc.definition.iter_markers("parametrize"))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Collect garbage right after a hypothesis test.

    When hypothesis stops an example inside an async test, the runner's task dies with an exception
    nobody retrieves; if the cycle collector frees it later in the middle of `compile()` (pytest
    rewriting a module the next test imports), CPython 3.11's "never retrieved" logging there can
    raise `SystemError: AST constructor recursion depth mismatch`. Collecting here frees it at a
    harmless moment; only hypothesis tests pay for it.
    """
    if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
        gc.collect()


RAY_GROUP = "ray"  # the xdist group of the tests that drive Ray


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests that drive Ray last, in their own order, and as one xdist group.

    Once this process joins the Ray cluster as a driver, Ray's threads open and close sockets of their
    own at any time, which an exact count of our descriptors (`assert_no_leaks`, in hundreds of tests)
    would see as a leak. The Ray tests count descriptors but sockets; every other test runs before Ray
    is ever connected, or, under xdist, in another worker (see `pytest_xdist_make_scheduler`).
    """
    drives_ray = [item for item in items if _drives_ray(item)]
    for item in drives_ray:
        item.add_marker(pytest.mark.xdist_group(RAY_GROUP))
    if drives_ray:
        items[:] = [item for item in items if not _drives_ray(item)] + drives_ray


def _drives_ray(item: pytest.Item) -> bool:
    return "ray_cluster" in getattr(item, "fixturenames", ()) or item.path.name.startswith("test_ray_")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under `--dist loadgroup`, the Ray tests get a worker of their own (`_scheduler_with_a_ray_worker`)."""
    if config.getoption("dist") != "loadgroup":
        return None
    return _scheduler_with_a_ray_worker(config, log)


def _scheduler_with_a_ray_worker(config: pytest.Config, log: object) -> object:
    """xdist's loadgroup scheduling, except that the Ray group goes first, to a worker that gets nothing else.

    The group starts the two-node cluster once and is the longest unit of work, so it starts at once, beside
    every other test; its worker, a Ray driver from then on, takes no test that counts descriptors.
    """
    from xdist.scheduler import LoadGroupScheduling

    class RayWorkerScheduling(LoadGroupScheduling):  # type: ignore[misc]  # xdist is untyped
        ray_node: Any = None

        def _assign_work_unit(self, node: Any) -> None:
            if self.ray_node is None and RAY_GROUP in self.workqueue and len(self.nodes) > 1:
                self.workqueue.move_to_end(RAY_GROUP, last=False)
                self.ray_node = node
            super()._assign_work_unit(node)

        def _reschedule(self, node: Any) -> None:
            if node is not self.ray_node:
                super()._reschedule(node)
            elif not node.shutting_down and self._pending_of(self.assigned_work[node]) == 0:
                node.shutdown()

    return RayWorkerScheduling(config, log)
