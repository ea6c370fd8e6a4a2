"""Shared test configuration: every async test runs on asyncio and on trio; hypothesis profiles."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

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
