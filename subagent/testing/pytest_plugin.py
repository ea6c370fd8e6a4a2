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

from subagent.testing import stub_agent_argv
from subagent.testing._scenario import Scenario, dump_scenario

__all__ = ["StubAgentCommand", "stub_agent_command"]


class StubAgentCommand(Protocol):
    """The type of the ``stub_agent_command`` fixture, for annotating tests."""

    def __call__(
        self, scenario: Mapping[str, Any] | Scenario | str | os.PathLike[str] | None = None
    ) -> list[str]:
        """The argv of a stub agent playing `scenario` (see the module docstring)."""
        ...


@pytest.fixture
def stub_agent_command(tmp_path: Path) -> StubAgentCommand:
    """Build stub ACP agent command lines from scenarios; each scenario is written under ``tmp_path``."""
    counter = itertools.count(1)

    def command(scenario: Mapping[str, Any] | Scenario | str | os.PathLike[str] | None = None) -> list[str]:
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
