"""The ``stub_agent_command`` fixture, as a user's test suite sees it (run with pytest's own ``pytester``)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.subprocess

# The user's tests talk to the stub agent with nothing but subprocess and json: one request, its answer, then
# stdin is closed and the agent exits.
USER_TESTS = """
import json
import subprocess
from pathlib import Path

import pytest

from subagent.testing import Scenario, ScenarioError, parse_scenario

INITIALIZE = b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":1}}\\n'


def initialize(argv):
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as agent:
        agent.stdin.write(INITIALIZE)
        agent.stdin.flush()
        response = json.loads(agent.stdout.readline())
        agent.stdin.close()  # the agent's cue to exit
        assert agent.wait(timeout=60) == 0
    return response


def test_a_dict_scenario_becomes_a_stub_agent_command(stub_agent_command, tmp_path):
    agent_info = {"name": "mine", "version": "9"}
    argv = stub_agent_command({"initialize": {"protocolVersion": 2, "agentInfo": agent_info}})
    assert argv[1:4] == ["-m", "subagent.testing.stub_agent", "--scenario"]
    assert Path(argv[4]).parent == tmp_path
    assert initialize(argv) == {
        "jsonrpc": "2.0",
        "id": 0,
        "result": {"protocolVersion": 2, "agentCapabilities": {}, "authMethods": [], "agentInfo": agent_info},
    }


def test_a_scenario_object_and_a_file_work_too(stub_agent_command, tmp_path):
    scenario = parse_scenario({"initialize": {"protocolVersion": 5}})
    assert isinstance(scenario, Scenario)
    first = stub_agent_command(scenario)
    second = stub_agent_command(first[-1])
    assert first[-1] != stub_agent_command(scenario)[-1]  # every call writes its own file
    assert initialize(second)["result"]["protocolVersion"] == 5


def test_no_scenario_runs_the_default_one(stub_agent_command):
    argv = stub_agent_command()
    assert "--scenario" not in argv
    assert initialize(argv)["result"]["agentInfo"]["name"] == "subagent-stub-agent"


def test_a_broken_scenario_fails_the_test_with_its_path(stub_agent_command):
    with pytest.raises(ScenarioError, match=r"unknown field `chunk` - at `\\$\\.turns\\[0\\]\\[0\\]`"):
        stub_agent_command({"turns": [[{"step": "message", "text": "hi", "chunk": 2}]]})
"""


def test_the_fixture_serves_a_users_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)


def test_the_fixture_is_registered_under_the_plugin_entry_point(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--fixtures", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*stub_agent_command*", "*Build stub ACP agent command lines*"])
