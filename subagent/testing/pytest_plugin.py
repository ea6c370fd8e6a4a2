"""A pytest plugin for testing ACP clients against the stub agent; loaded by pytest once installed.

The ``stub_agent_command`` fixture turns a scenario into the command line of a stub agent that plays it::

    @pytest.mark.anyio  # or your async plugin's marker: the fixture itself is synchronous
    async def test_my_client_survives_a_crash(stub_agent_command):
        argv = stub_agent_command({"initialize": {"steps": [{"step": "exit", "code": 3}]}})
        ...  # spawn `argv` with your ACP client; initialize fails with exit status 3

The scenario may be a dict (validated at once: a mistake fails the test with the JSON path of the offending
value), a `Scenario`, a path to an existing scenario file, or None for the bundled default scenario. Each call
writes a new file under the test's ``tmp_path`` and returns
``[sys.executable, "-m", "subagent.testing.stub_agent", "--scenario", <file>]``. See
`subagent.testing._scenario` for the format.

The ``stub_agent_transport`` fixture serves the same scenarios in the test's own event loop instead, with no
process to start (`subagent.testing.StubAgentTransport`): pass what it returns as an ACP provider's
transport; the command is then only a name::

    @pytest.mark.anyio
    async def test_my_client_reads_a_whole_turn(stub_agent_transport):
        transport = stub_agent_transport({"turns": [[{"step": "message", "text": "hi"}]]})
        provider = AcpProvider(["stub-agent"], transport=transport)
        ...  # a run of `provider` completes with the output "hi"

It takes the same scenarios (a dict, a `Scenario`, a file, or None). Steps that need a real process (a
``grandchild``, a ``kill`` with a stopping signal) are refused with a `ScenarioError`: use
``stub_agent_command`` for those.

If plugin autoloading is disabled (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), enable it with
``pytest_plugins = ["subagent.testing.pytest_plugin"]`` in a ``conftest.py``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import pytest

from subagent.testing import StubAgentTransport, stub_agent_argv
from subagent.testing._scenario import Scenario, dump_scenario

__all__ = ["StubAgentCommand", "StubAgentTransports", "stub_agent_command", "stub_agent_transport"]

ScenarioSource = Mapping[str, Any] | Scenario | str | os.PathLike[str] | None
"""What the fixtures take: a scenario dict, a `Scenario`, a scenario file, or None for the default."""


class StubAgentCommand(Protocol):
    """The type of the ``stub_agent_command`` fixture, for annotating tests."""

    def __call__(self, scenario: ScenarioSource = None) -> list[str]:
        """The argv of a stub agent playing `scenario` (see the module docstring)."""
        ...


class StubAgentTransports(Protocol):
    """The type of the ``stub_agent_transport`` fixture, for annotating tests."""

    def __call__(self, scenario: ScenarioSource = None, **options: Any) -> StubAgentTransport:
        """A transport serving the stub agent on `scenario` in process; ``options`` go to
        `StubAgentTransport` (``stdin_close_timeout``, ``record_sent``...)."""
        ...


@pytest.fixture
def stub_agent_command(tmp_path: Path) -> StubAgentCommand:
    """Build stub ACP agent command lines from scenarios; each scenario is written under ``tmp_path``."""
    counter = itertools.count(1)

    def command(scenario: ScenarioSource = None) -> list[str]:
        if scenario is None:
            return stub_agent_argv()
        if isinstance(scenario, str | os.PathLike):
            path = Path(scenario)
            if not path.is_file():
                raise FileNotFoundError(f"no scenario file at {os.fspath(path)!r}")
            return stub_agent_argv(path.resolve())
        path = tmp_path / f"stub-agent-scenario-{next(counter)}.json"
        path.write_text(dump_scenario(scenario), encoding="utf-8")
        return stub_agent_argv(path)

    return command


@pytest.fixture
def stub_agent_transport() -> StubAgentTransports:
    """Build transports that serve the stub agent on a scenario in the test's own event loop (no process)."""

    def transport(scenario: ScenarioSource = None, **options: Any) -> StubAgentTransport:
        if isinstance(scenario, str | os.PathLike) and not Path(scenario).is_file():
            raise FileNotFoundError(f"no scenario file at {os.fspath(scenario)!r}")
        return StubAgentTransport(scenario, **options)

    return transport
