"""What users hit with real agents (Claude Code, Codex, Gemini, Qwen, opencode), reproduced with the stub
agent: handshake errors that say why, the final message as the output, usage where agents put it, a
quick teardown of an idle agent that ignores stdin EOF, and a switch to stop offering the client's fs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import SubagentRequest, SubagentResult, SubagentService
from subagent.acp import schema
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
