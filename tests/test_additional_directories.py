"""``SubagentRequest.additional_directories``: more roots for a child, refused where they cannot be kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import ErrorCode, SubagentCapabilities, SubagentError, SubagentRequest, SubagentService
from subagent.acp import AgentCapabilityError, schema
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.testing import StubAgentTransport
from subagent.testing.fakes import FakeProvider, completes
from tests.leaks import assert_no_leaks
from tests.test_client import FakeAgent, connected

pytestmark = pytest.mark.anyio

WAIT = 20  # seconds: a bound on a whole run, never a sleep
STUB = ["stub-agent"]
"""The command of a stub agent served in process: a name only."""
ADVERTISED: dict[str, Any] = {
    "initialize": {"agentCapabilities": {"sessionCapabilities": {"additionalDirectories": {}}}}
}


# -- the request ----------------------------------------------------------------------------------------


def test_a_request_keeps_its_additional_directories_as_a_tuple_and_lists_the_feature_last() -> None:
    request = SubagentRequest(prompt="go", depth_limit=1, additional_directories=["/srv/data", "rel"])
    assert request.additional_directories == ("/srv/data", "rel")
    assert request.requested_features() == ("depth_limit", "additional_directories")
    assert SubagentRequest(prompt="go").requested_features() == ()


@pytest.mark.parametrize(
    ("value", "error"),
    [("/one/string", TypeError), ([""], ValueError), (["/a\0b"], ValueError), ([3], TypeError)],
)
def test_a_request_refuses_additional_directories_no_process_could_be_given(value: Any, error: type) -> None:
    with pytest.raises(error):
        SubagentRequest(prompt="go", additional_directories=value)


async def test_the_service_refuses_additional_directories_to_a_provider_without_the_capability() -> None:
    provider = FakeProvider(name="inproc", autopilot=completes("done"))
    async with SubagentService() as service:
        service.register_provider(provider)
        with pytest.raises(SubagentError) as caught:
            service.start("inproc", SubagentRequest(prompt="go", additional_directories=["/srv"]))
    assert caught.value.code == ErrorCode.UNSUPPORTED_CAPABILITY
    assert caught.value.feature == "additional_directories"
    assert provider.start_calls == 0


async def test_the_service_passes_additional_directories_to_a_provider_that_declares_the_capability() -> None:
    provider = FakeProvider(
        name="roots",
        capabilities=SubagentCapabilities(additional_directories=True),
        autopilot=completes("ok"),
    )
    async with SubagentService() as service:
        service.register_provider(provider)
        assert service.get_provider("roots").capabilities.additional_directories  # type: ignore[union-attr]
        async with service.start(
            "roots", SubagentRequest(prompt="go", additional_directories=["/srv"])
        ) as run:
            with anyio.fail_after(5):
                assert (await run.result()).output == "ok"
    assert provider.runs[0].request.additional_directories == ("/srv",)


def test_only_the_acp_provider_declares_additional_directories() -> None:
    from subagent.providers.spawn import SpawnProvider
    from subagent.runtime import AgentRegistry

    assert AcpProvider(["agent"]).capabilities.additional_directories
    assert not SpawnProvider(agents=AgentRegistry()).capabilities.additional_directories


# -- the client -----------------------------------------------------------------------------------------


async def test_session_new_carries_the_additional_directories_made_absolute_when_advertised() -> None:
    async def initialize(agent: FakeAgent, params: Any) -> Any:
        return {
            "protocolVersion": 1,
            "agentCapabilities": {"sessionCapabilities": {"additionalDirectories": {}}},
        }

    agent = FakeAgent(handlers={"initialize": initialize})
    async with connected(agent) as client:
        with anyio.fail_after(5):
            await client.initialize()
            await client.new_session("/home/user", additional_directories=["/srv/data", "/tmp/../opt"])
            await client.new_session("/home/user")
    sent = [params for method, params in agent.received if method == "session/new"]
    assert sent[0]["additionalDirectories"] == ["/srv/data", "/opt"]
    assert "additionalDirectories" not in sent[1]


async def test_session_new_with_additional_directories_to_an_agent_without_them_sends_nothing() -> None:
    agent = FakeAgent()
    async with connected(agent) as client:
        with anyio.fail_after(5):
            await client.initialize()
            with pytest.raises(AgentCapabilityError, match="additionalDirectories"):
                await client.new_session("/home/user", additional_directories=["/srv"])
    assert [method for method, _ in agent.received] == ["initialize"]


# -- the provider, with the stub agent served in process --------------------------------------------------


async def test_the_agent_may_write_in_an_additional_directory_it_was_given(tmp_path: Path) -> None:
    work, extra, elsewhere = (tmp_path / name for name in ("work", "extra", "elsewhere"))
    for directory in (work, extra, elsewhere):
        directory.mkdir()
    turn = [
        {"step": "write_file", "path": str(extra / "out.txt"), "content": "written"},
        {"step": "write_file", "path": str(elsewhere / "out.txt"), "content": "refused"},
    ]
    transport = StubAgentTransport({**ADVERTISED, "turns": [turn]})
    provider = AcpProvider(STUB, cwd=work, permission="allow", transport=transport)
    request = SubagentRequest(prompt="go", additional_directories=["../extra"])
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start("acp", request) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
    reports = [
        json.loads(update.content.text)
        for update in acp_run.updates
        if isinstance(update, schema.AgentMessageChunk) and isinstance(update.content, schema.TextContent)
    ]
    assert result.stop_reason == "completed"
    assert reports[0] == {"method": "fs/write_text_file", "result": {}}
    assert reports[1]["error"]["code"] == -32602
    assert (extra / "out.txt").read_text() == "written"
    assert not (elsewhere / "out.txt").exists()


async def test_additional_directories_to_an_agent_that_cannot_take_them_fail_the_start_naming_the_capability(
    tmp_path: Path,
) -> None:
    provider = AcpProvider(STUB, cwd=tmp_path, transport=StubAgentTransport({}))
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(
            "acp", SubagentRequest(prompt="go", additional_directories=[str(tmp_path)])
        ) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
    assert caught.value.code == ErrorCode.START_FAILED
    assert "sessionCapabilities.additionalDirectories" in caught.value.message


async def test_an_additional_directory_that_does_not_exist_fails_the_start_before_a_child_is_spawned(
    tmp_path: Path,
) -> None:
    transport = StubAgentTransport(ADVERTISED)
    provider = AcpProvider(STUB, cwd=tmp_path, transport=transport)
    request = SubagentRequest(prompt="go", additional_directories=["missing"])
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start("acp", request) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
    assert caught.value.code == ErrorCode.START_FAILED
    assert str(tmp_path / "missing") in caught.value.message
    assert transport.opened == []  # no child was started
