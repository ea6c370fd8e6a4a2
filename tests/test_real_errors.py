"""What users hit with real agents (Claude Code, Codex, Gemini, Qwen, opencode), reproduced with the stub
agent: handshake errors that say why, the final message as the output, usage where agents put it, a
quick teardown of an idle agent that ignores stdin EOF, and a switch to stop offering the client's fs."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import ErrorCode, SubagentError, SubagentRequest, SubagentResult, SubagentService
from subagent.acp import schema
from subagent.acp.client import MAX_ERROR_QUOTE_CHARS, describe_request_error
from subagent.acp.errors import RequestError
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.leaks import assert_no_leaks

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

WAIT = 20  # seconds: a bound on a whole run, never a sleep
FAST = {"stdin_close_timeout": 1.0, "sigterm_timeout": 1.0, "sigkill_timeout": 2.0}


async def run_once(provider: AcpProvider, prompt: str = "go") -> tuple[SubagentResult, AcpRun]:
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt=prompt)) as run:
            with anyio.fail_after(WAIT):
                await run.started()
                result = await run.result()
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
    return result, acp_run


def reports(run: AcpRun) -> list[Any]:
    """The JSON reports the stub's request steps sent back as message chunks."""
    return [
        json.loads(update.content.text)
        for update in run.updates
        if isinstance(update, schema.AgentMessageChunk) and isinstance(update.content, schema.TextContent)
    ]


# -- fs = False -----------------------------------------------------------------------------------------


async def test_with_fs_off_the_agents_file_requests_are_answered_method_not_found(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    (tmp_path / "notes.txt").write_text("alpha\n")
    command = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "read_file", "path": str(tmp_path / "notes.txt")},
                    {"step": "write_file", "path": str(tmp_path / "out.txt"), "content": "x"},
                ]
            ]
        }
    )
    provider = AcpProvider(command, cwd=tmp_path, fs=False, process_options=FAST)
    result, run = await run_once(provider)
    read, write = reports(run)
    assert read["method"] == "fs/read_text_file"
    assert read["error"]["code"] == -32601
    assert write["method"] == "fs/write_text_file"
    assert write["error"]["code"] == -32601
    assert not (tmp_path / "out.txt").exists()
    assert result.stop_reason == "completed"


# -- handshake errors say why ---------------------------------------------------------------------------

CLAUDE_DETAILS = {"details": "Claude Code process exited with code 1"}


async def start_failure(provider: AcpProvider) -> SubagentError:
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
    assert caught.value.code == ErrorCode.START_FAILED
    return caught.value


@pytest.mark.parametrize(
    ("scenario", "method"),
    [
        ({"initialize": {"steps": []}}, "initialize"),
        ({"newSession": {"steps": []}}, "session/new"),
        ({"requireAuth": "api-key", "authenticate": {"steps": []}}, "authenticate"),
    ],
)
async def test_a_handshake_step_refused_with_error_data_fails_the_start_showing_the_data(
    stub_agent_command: StubAgentCommand, tmp_path: Path, scenario: dict[str, Any], method: str
) -> None:
    refusal = {"step": "error", "code": -32603, "message": "Internal error", "data": CLAUDE_DETAILS}
    scenario = {
        key: {"steps": [refusal]} if isinstance(value, dict) else value for key, value in scenario.items()
    }
    command = stub_agent_command(scenario)
    error = await start_failure(
        AcpProvider(command, cwd=tmp_path, auth_method="api-key", process_options=FAST)
    )
    assert error.message == (
        f"agent `{shlex.join(command)}` failed its handshake: it answered {method} with error -32603: "
        'Internal error ({"details": "Claude Code process exited with code 1"})'
    )


async def test_a_handshake_error_without_data_names_the_step_code_and_message(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    command = stub_agent_command(
        {"newSession": {"steps": [{"step": "error", "code": -32602, "message": "cwd is not a directory"}]}}
    )
    error = await start_failure(AcpProvider(command, cwd=tmp_path, process_options=FAST))
    assert error.message == (
        f"agent `{shlex.join(command)}` failed its handshake: it answered session/new with error -32602: "
        "cwd is not a directory"
    )


async def test_huge_error_data_is_quoted_cut_and_an_echoed_env_value_is_redacted(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    key = "sk-test-0123456789abcdef"
    data = {"details": f"bad key {key}", "dump": "x" * 100_000}
    command = stub_agent_command(
        {
            "initialize": {
                "steps": [{"step": "error", "code": -32603, "message": "Internal error", "data": data}]
            }
        }
    )
    provider = AcpProvider(command, cwd=tmp_path, env={"ANTHROPIC_API_KEY": key}, process_options=FAST)
    error = await start_failure(provider)
    quoted = describe_request_error(RequestError(-32603, "Internal error", data))  # unredacted
    assert key not in error.message
    prefix = f"agent `{shlex.join(command)}` failed its handshake: it answered initialize with error -32603: "
    shown = 'Internal error ({"details": "bad key [redacted]", "dump": "' + "x" * 100_000 + '"})'
    rest = len(shown) - MAX_ERROR_QUOTE_CHARS
    assert error.message == f"{prefix}{shown[:MAX_ERROR_QUOTE_CHARS]}… ({rest:,} more characters)"
    assert key in quoted  # redaction is the provider's: it knows the child's environment


async def test_a_prompt_answered_with_error_data_shows_it_the_same_way(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    command = stub_agent_command(
        {"turns": [[{"step": "error", "code": -32603, "message": "Internal error", "data": CLAUDE_DETAILS}]]}
    )
    result, _ = await run_once(AcpProvider(command, cwd=tmp_path, process_options=FAST))
    assert result.stop_reason == "error"
    assert result.error == (
        f"agent `{shlex.join(command)}` answered session/prompt with error -32603: "
        'Internal error ({"details": "Claude Code process exited with code 1"})'
    )
