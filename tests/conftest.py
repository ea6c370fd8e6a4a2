"""Shared test configuration: a test's backends, how xdist spreads the suite, hypothesis profiles."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.gitrepo import no_machine_git_config  # noqa: F401  (git reading no machine configuration)
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
        "test_inprocess_isolation",  # git worktrees made and removed concurrently
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
        "test_inprocess_budget",  # budgets: deadlines, reservations waited on, cancellation
    }
)


@pytest.fixture(autouse=True)
def _run_journal_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point the command line's default run journal ($XDG_STATE_HOME/subagent/runs.db) at a directory of
    the test's own, and drop any SUBAGENT_JOURNAL of the caller's: no test writes to this machine's state
    directory. Set in this process's environment, so a CLI a test runs as a subprocess inherits it."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
    monkeypatch.delenv("SUBAGENT_JOURNAL", raising=False)


_STATE_HOME = tempfile.mkdtemp(prefix="subagent-tests-state-")
"""The run journal's default home for the whole session (a fixture of any scope, a module's run of the CLI
included, runs with it), below each test's own (``_run_journal_in_tmp``): never this machine's."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "both_backends: run this async test on trio as well as asyncio (see tests/conftest.py)"
    )
    os.environ["XDG_STATE_HOME"] = _STATE_HOME
    os.environ.pop("SUBAGENT_JOURNAL", None)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_STATE_HOME, ignore_errors=True)


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


RAY_MODULE_PREFIX = "test_ray_"  # the modules whose tests drive Ray, and only they


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests that drive Ray last, in their own order.

    Once this process joins the Ray cluster as a driver, Ray's threads open and close sockets of their
    own at any time, which an exact count of our descriptors (`assert_no_leaks`, in hundreds of tests)
    would see as a leak. The Ray tests count descriptors but sockets; every other test runs before Ray
    is ever connected, or, under xdist, in another worker (see `pytest_xdist_make_scheduler`).
    """
    items.sort(key=lambda item: item.path.name.startswith(RAY_MODULE_PREFIX))  # stable: order kept otherwise


def ray_unit(module: str) -> str | None:
    """The unit of work of a Ray module under xdist: its fault battery alone, the other Ray tests together.

    Two units, each with a cluster of its own on a worker of its own, halve the longest path through the
    suite (the Ray tests, sequential, are about a third of its wall time).
    """
    if not module.startswith(RAY_MODULE_PREFIX):
        return None
    return "ray:faults" if module == "test_ray_faults.py" else "ray:rest"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's scheduling for `make test`: each Ray unit gets a worker of its own, first.

    A unit of work is one test, except that the tests of a Ray unit (`ray_unit`) are one unit: its
    cluster then starts once per unit, and as the longest units they start at once, beside every other
    test. Their workers, Ray drivers from then on, take no test that counts descriptors. (xdist's own
    `xdist_group` marks cannot say this, and under pytest 9 xdist 3.8 no longer applies them.)
    """
    from xdist.scheduler import LoadScopeScheduling

    class RayWorkersScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist is untyped
        def __init__(self, config: pytest.Config, log: Any) -> None:
            super().__init__(config, log)
            self.ray_nodes: set[Any] = set()

        def _split_scope(self, nodeid: str) -> str:
            return ray_unit(nodeid.partition("::")[0].rpartition("/")[2]) or nodeid

        def _assign_work_unit(self, node: Any) -> None:
            ray_units = [scope for scope in self.workqueue if ray_unit_scope(scope)]
            only_ray_left = len(ray_units) == len(self.workqueue)
            # A worker of its own while one is left for the other tests; else a Ray unit waits until
            # nothing else is left, and the worker that takes it takes nothing after it.
            if ray_units and (len(self.nodes) - len(self.ray_nodes) > 1 or only_ray_left):
                self.workqueue.move_to_end(ray_units[0], last=False)
                self.ray_nodes.add(node)
            else:
                for scope in ray_units:
                    self.workqueue.move_to_end(scope)
            super()._assign_work_unit(node)

        def _reschedule(self, node: Any) -> None:
            if node not in self.ray_nodes:
                super()._reschedule(node)
            elif not node.shutting_down and self._pending_of(self.assigned_work[node]) == 0:
                node.shutdown()

    return RayWorkersScheduling(config, log)


def ray_unit_scope(scope: str) -> bool:
    return scope.startswith("ray:")
