"""Interop: our client drives an ACP agent this project did not write.

The agent is the official TypeScript SDK's example (`@agentclientprotocol/sdk` 1.9.0,
`dist/examples/agent.js`), installed by `make interop`. Each turn it streams text, runs a tool
call, asks permission for a second one and answers according to the choice; each step waits one
second, so a turn takes about five.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import anyio
import pytest

from subagent.acp import schema
from subagent.acp.client import TurnResult, spawn_agent
from subagent.acp.handlers import PermissionQuestion
from tests.leaks import assert_no_leaks

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

ROOT = Path(__file__).resolve().parent.parent
AGENT_JS = (
    ROOT / ".interop" / "node_modules" / "@agentclientprotocol" / "sdk" / "dist" / "examples" / "agent.js"
)
NODE = shutil.which("node")
TURN_BOUND = 30  # seconds: five simulated one-second steps, with room for a loaded machine


@pytest.fixture
def example_agent() -> list[str]:
    if NODE is None or not AGENT_JS.is_file():
        reason = f"the TypeScript example agent is not installed (run `make interop`): {AGENT_JS}"
        if os.environ.get("SUBAGENT_REQUIRE_INTEROP"):
            pytest.fail(reason)
        pytest.skip(reason)
    return [NODE, str(AGENT_JS)]


def titles(result: TurnResult) -> list[tuple[str, str | None]]:
    """(kind, title or status) of every tool-call update, in order."""
    seen: list[tuple[str, str | None]] = []
    for update in result.updates:
        if isinstance(update, schema.ToolCall):
            seen.append(("tool_call", update.title))
        elif isinstance(update, schema.ToolCallProgress):
            seen.append(("tool_call_update", update.status))
    return seen


@pytest.mark.parametrize(
    ("choice", "final"),
    [
        ("allow", " Perfect! I've successfully updated the configuration. The changes have been applied."),
        ("reject", " I understand you prefer not to make that change. I'll skip the configuration update."),
    ],
)
async def test_a_scripted_turn_with_tool_calls_and_a_permission_question_completes(
    example_agent: list[str], tmp_path: Path, choice: str, final: str
) -> None:
    asked: list[PermissionQuestion] = []

    async def answer(question: PermissionQuestion) -> str | None:
        asked.append(question)
        return choice

    async with assert_no_leaks():
        async with spawn_agent(example_agent, permission=answer) as client:
            with anyio.fail_after(TURN_BOUND):
                initialized = await client.initialize()
                session = await client.new_session(tmp_path)
                result = await session.prompt("Please update the database host in config.json")
        assert client.process is not None
        report = await client.process.aclose()

    assert initialized.protocol_version == 1
    assert result.stop_reason == "end_turn"
    expected_tools = [
        ("tool_call", "Reading project files"),
        ("tool_call_update", "completed"),
        ("tool_call", "Modifying critical configuration file"),
    ]
    if choice == "allow":
        expected_tools.append(("tool_call_update", "completed"))
    assert titles(result) == expected_tools
    assert result.output == final
    (question,) = asked
    assert question.tool_call_id == "call_2"
    assert question.kind == "edit"
    assert dict(question.raw_input) == {
        "path": "/home/user/project/config.json",
        "content": '{"database": {"host": "new-host"}}',
    }
    assert [(o.option_id, o.kind) for o in question.options] == [
        ("allow", "allow_once"),
        ("reject", "reject_once"),
    ]
    # Node exits when its stdin closes: the graceful path, no signal needed.
    assert report.graceful


async def test_cancelling_a_turn_of_the_example_agent_ends_it_cancelled(
    example_agent: list[str], tmp_path: Path
) -> None:
    first_chunk = anyio.Event()

    def on_update(update: schema.SessionUpdate) -> None:
        if isinstance(update, schema.AgentMessageChunk):
            first_chunk.set()

    async with assert_no_leaks(), spawn_agent(example_agent) as client:
        with anyio.fail_after(TURN_BOUND):
            await client.initialize()
            session = await client.new_session(tmp_path)
            results: list[TurnResult] = []

            async def run() -> None:
                results.append(await session.prompt("Do the thing", on_update=on_update))

            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await first_chunk.wait()
                await session.cancel()
    assert results[0].stop_reason == "cancelled"
    assert results[0].output.startswith("I'll help you with that.")
