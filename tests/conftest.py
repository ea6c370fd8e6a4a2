"""Shared test configuration: every async test runs on asyncio and on trio; hypothesis profiles."""

from __future__ import annotations

import gc
import os

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


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run each `pytest.mark.anyio` test once per backend."""
    backend: str = request.param
    return backend


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests that drive Ray last, in their own order.

    Once this process joins the Ray cluster as a driver, Ray's threads open and close sockets of their
    own at any time, which an exact count of our descriptors (`assert_no_leaks`, in hundreds of tests)
    would see as a leak. The Ray tests count descriptors but sockets; every other test runs before Ray
    is ever connected.
    """
    drives_ray = [item for item in items if _drives_ray(item)]
    if drives_ray:
        items[:] = [item for item in items if not _drives_ray(item)] + drives_ray


def _drives_ray(item: pytest.Item) -> bool:
    return "ray_cluster" in getattr(item, "fixturenames", ()) or item.path.name.startswith("test_ray_")
