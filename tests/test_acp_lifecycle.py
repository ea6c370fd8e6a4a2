"""A run's session life through the ACP provider, with the stub agent as a real child process: updates the
agent sends before answering session/new, and session/close before the agent's stdin closes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import SubagentRequest, SubagentService
from subagent.acp import schema
from subagent.acp.client import AcpSession
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.leaks import assert_no_leaks

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

WAIT = 20  # seconds: a bound on a whole run, never a sleep
FAST = {"stdin_close_timeout": 1.0, "sigterm_timeout": 1.0, "sigkill_timeout": 2.0}
CLOSED = "stub agent: session/close session-1"
EOF = "stub agent: stdin closed"


async def run_and_dispose(provider: AcpProvider, prompt: str = "go", resume: str | None = None) -> AcpRun:
    """Run one turn (and a resumed one), dispose the run; nothing may leak."""
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt=prompt)) as run:
            with anyio.fail_after(WAIT):
                await run.started()
                result = await run.result()
                assert result.stop_reason == "completed", result
                acp_run = run.provider_run
                assert isinstance(acp_run, AcpRun)
                if resume is not None:
                    assert (await acp_run.resume(resume)).stop_reason == "completed"
    return acp_run


def provider_for(command: list[str], tmp_path: Path, lines: list[str]) -> AcpProvider:
    # The tests assert that the stub saw its stdin close and exited: the process options' grace, not an
    # idle agent's 0.3 s, which a loaded machine can overrun (a SIGTERM before the EOF was read).
    return AcpProvider(
        command, cwd=tmp_path, process_options=FAST, on_stderr_line=lines.append, idle_close_grace=None
    )


def stub_lines(lines: list[str]) -> list[str]:
    return [line.strip() for line in lines if line.startswith("stub agent: ")]


# -- session/close --------------------------------------------------------------------------------------


async def test_an_agent_that_advertises_session_close_is_closed_once_before_its_stdin_closes(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    lines: list[str] = []
    command = stub_agent_command({"closeSession": {}, "turns": [[{"step": "message", "text": "done"}]]})
    await run_and_dispose(provider_for(command, tmp_path, lines), resume="again")
    assert stub_lines(lines) == [CLOSED, EOF]


async def test_an_agent_that_does_not_advertise_session_close_is_sent_none(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    # It would serve the close (and report it), but says it does not: the client must believe it.
    lines: list[str] = []
    command = stub_agent_command(
        {"initialize": {"agentCapabilities": {"sessionCapabilities": {"close": None}}}, "closeSession": {}}
    )
    run = await run_and_dispose(provider_for(command, tmp_path, lines))
    assert run.agent is not None
    assert run.agent.agent_capabilities.session_capabilities.close is None
    assert stub_lines(lines) == [EOF]


async def test_an_error_answer_to_session_close_is_ignored_and_the_teardown_goes_on(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    lines: list[str] = []
    command = stub_agent_command(
        {"closeSession": {"steps": [{"step": "error", "code": -32603, "message": "cannot close"}]}}
    )
    run = await run_and_dispose(provider_for(command, tmp_path, lines))
    assert stub_lines(lines) == [EOF]  # the error answered before the close was reported
    assert run.exit_info is not None
    assert run.exit_info.returncode == 0  # it exited on its stdin's close: the graceful path


async def test_an_agent_that_never_answers_session_close_is_torn_down_after_the_bound(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    lines: list[str] = []
    command = stub_agent_command({"closeSession": {"steps": [{"step": "hang"}]}})
    run = await run_and_dispose(provider_for(command, tmp_path, lines))
    assert run.exit_info is not None
    assert EOF in stub_lines(lines)


async def test_a_run_disposed_mid_turn_has_its_turn_cancelled_and_its_session_closed(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    lines: list[str] = []
    command = stub_agent_command(
        {
            "closeSession": {},
            "turns": [[{"step": "message", "text": "busy"}, {"step": "wait_for_cancel", "then": "stop"}]],
        }
    )
    provider = provider_for(command, tmp_path, lines)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        run = service.start(provider.name, SubagentRequest(prompt="go"))
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        arrived = anyio.Event()
        acp_run.on_update(lambda update: arrived.set())
        with anyio.fail_after(WAIT):
            await run.started()
            await arrived.wait()
            await run.dispose()
    assert stub_lines(lines) == [CLOSED, EOF]


# -- updates before the session/new answer --------------------------------------------------------------

COMMANDS: dict[str, Any] = {
    "sessionUpdate": "available_commands_update",
    "availableCommands": [{"name": "compact", "description": "Compact the conversation"}],
}


async def test_updates_the_agent_sends_before_answering_session_new_are_the_runs_first_updates(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    command = stub_agent_command(
        {
            "newSession": {
                "steps": [{"step": "update", "update": COMMANDS}, {"step": "usage", "used": 10, "size": 1000}]
            },
            "turns": [[{"step": "message", "text": "answer"}]],
        }
    )
    seen: list[str] = []
    provider = AcpProvider(command, cwd=tmp_path, process_options=FAST)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go")) as run:
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
            acp_run.on_update(lambda update: seen.append(type(update).__name__))
            with anyio.fail_after(WAIT):
                await run.started()
                result = await run.result()
    assert result.output == "answer"
    assert seen == ["AvailableCommandsUpdate", "UsageUpdate", "AgentMessageChunk"]
    assert [type(update).__name__ for update in acp_run.updates] == seen
    assert acp_run.update_count == 3
    first = acp_run.updates[0]
    assert isinstance(first, schema.AvailableCommandsUpdate)
    assert first.available_commands[0].name == "compact"


async def test_a_killed_run_is_sent_no_session_close(
    stub_agent_command: StubAgentCommand, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The killed agent cannot report anything: what the client tried to send is recorded instead.
    closes: list[str] = []
    original = AcpSession.close

    async def close(session: AcpSession) -> None:
        closes.append(session.session_id)
        await original(session)

    monkeypatch.setattr(AcpSession, "close", close)
    command = stub_agent_command({"closeSession": {}, "onStdinEof": "ignore"})
    provider = provider_for(command, tmp_path, [])
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go")) as run:
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
            with anyio.fail_after(WAIT):
                await run.result()
                acp_run.kill()
                await run.dispose()
        async with service.start(provider.name, SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT):
                await run.result()  # the same agent, not killed: its session is closed
    assert closes == ["session-1"]
    assert acp_run.exit_info is not None
    assert acp_run.exit_info.killed_by is not None
