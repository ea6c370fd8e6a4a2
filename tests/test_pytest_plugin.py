"""The ``stub_agent_command`` and ``stub_agent_transport`` fixtures, as a user's test suite sees them (run
with pytest's own ``pytester``)."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest

from subagent.testing.contract import CONTRACT_CHECKS

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.subprocess

README = Path(__file__).resolve().parent.parent / "README.md"
TESTING_SECTION = "## Testing your code against stub agents"

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


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_transport_fixture_serves_a_turn_with_no_process(stub_agent_transport, anyio_backend):
    from subagent import SubagentRequest, SubagentService
    from subagent.providers.acp import AcpProvider

    transport = stub_agent_transport({"turns": [[{"step": "message", "text": "hi"}]]})
    async with SubagentService() as service:
        service.register_provider(AcpProvider(["stub-agent"], transport=transport))
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            result = await run.result()
    assert (result.stop_reason, result.output) == ("completed", "hi")
    [channel] = transport.channels
    assert (channel.pid, channel.exit_info().returncode) == (None, 0)


def test_the_transport_fixture_refuses_a_step_that_needs_a_process(stub_agent_transport):
    with pytest.raises(ScenarioError, match="step 'grandchild' starts a grandchild process"):
        stub_agent_transport({"turns": [[{"step": "grandchild", "pidFile": "pid"}]]})
"""


def test_the_fixtures_serve_a_users_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)


def test_the_fixtures_are_registered_under_the_plugin_entry_point(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--fixtures", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*stub_agent_command*", "*Build stub ACP agent command lines*"])
    result.stdout.fnmatch_lines(["*stub_agent_transport*", "*serve the stub agent on a scenario*"])


def readme_testing_examples() -> list[str]:
    """The ```python blocks of the README's testing section, verbatim."""
    text = README.read_text(encoding="utf-8")
    section = text.split(TESTING_SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)


def test_the_readmes_testing_examples_pass_as_written_in_a_fresh_project(pytester: pytest.Pytester) -> None:
    examples = readme_testing_examples()
    assert len(examples) == 3, "the README's testing section changed: update this test's count"
    pytester.makepyfile(**{f"test_readme_example_{n}": code for n, code in enumerate(examples)})
    # A fresh project: no conftest, no configuration; only the installed plugins (ours and anyio's, which
    # runs each test on every backend it finds: asyncio, and trio where it is installed, as here).
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "error", "-v")
    backends = anyio.get_available_backends()
    result.assert_outcomes(passed=len(backends) * len(examples))
    result.stdout.fnmatch_lines(
        [f"*test_my_code_survives_a_crash?{backend}? PASSED*" for backend in backends], consecutive=True
    )


def test_an_anyio_backend_fixture_chooses_where_the_readmes_examples_run(pytester: pytest.Pytester) -> None:
    examples = readme_testing_examples()
    pytester.makepyfile(**{f"test_readme_example_{n}": code for n, code in enumerate(examples)})
    pytester.makeconftest(
        """
import pytest


@pytest.fixture
def anyio_backend():
    return "trio"
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "error", "-v")
    result.assert_outcomes(passed=len(examples))
    result.stdout.fnmatch_lines(["*test_my_client_retries_a_429 PASSED*"])


def test_the_readmes_provider_contract_example_passes_as_written_in_a_fresh_project(
    pytester: pytest.Pytester,
) -> None:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Writing a provider of your own", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"^```python\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)
    pytester.makepyfile(test_readme_contract=example)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "error")
    result.assert_outcomes(passed=len(anyio.get_available_backends()) * len(CONTRACT_CHECKS))
