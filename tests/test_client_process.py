"""The typed client against the stub agent as a real child process: turns, crashes, floods, teardown."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent.acp import AgentExitedError, MalformedMessageError, MessageTooLargeError, ProtocolError, schema
from subagent.acp.client import AcpClient, AcpSession, TurnResult, spawn_agent
from subagent.acp.handlers import FsSandbox, PermissionQuestion
from subagent.acp.transports import AgentProcess, TeardownStep
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.leaks import assert_no_leaks, process_is_gone

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

WAIT = 15  # seconds: bounds a whole exchange; a hang fails the test instead of the suite
FAST = {"stdin_close_timeout": 0.5, "sigterm_timeout": 0.5, "sigkill_timeout": 2.0}
# For a child that ignores stdin EOF but honours SIGTERM: a short first step it always waits out, and a
# generous SIGTERM step that ends as soon as the child is gone, so a loaded machine slow to run the child's
# exit cannot make teardown take the SIGKILL step.
SIGTERM_HONOURED = {"stdin_close_timeout": 0.5, "sigterm_timeout": 30.0, "sigkill_timeout": 2.0}


@asynccontextmanager
async def agent(argv: list[str], **options: Any) -> AsyncIterator[AcpClient]:
    """A spawned stub agent inside a leak check, with short teardown graces."""
    options.setdefault("process_options", FAST)
    async with assert_no_leaks(), spawn_agent(argv, **options) as client:
        yield client


async def session_of(client: AcpClient, cwd: Path) -> AcpSession:
    await client.initialize()
    return await client.new_session(cwd)


def texts(result: TurnResult) -> list[str]:
    return [
        u.content.text
        for u in result.updates
        if isinstance(u, schema.AgentMessageChunk) and isinstance(u.content, schema.TextContent)
    ]


async def test_a_full_turn_streams_chunks_tool_calls_a_permission_question_and_the_stop_reason(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "message", "text": "Reading the config.", "chunks": 3},
                    {
                        "step": "tool_call",
                        "toolCallId": "c1",
                        "title": "Read config",
                        "kind": "read",
                        "status": "pending",
                    },
                    {"step": "tool_call_update", "toolCallId": "c1", "status": "completed"},
                    {"step": "tool_call", "toolCallId": "c2", "title": "Edit config", "kind": "edit"},
                    {
                        "step": "permission",
                        "branches": {
                            "allow": [
                                {"step": "tool_call_update", "toolCallId": "c2", "status": "completed"}
                            ],
                            "reject": [{"step": "tool_call_update", "toolCallId": "c2", "status": "failed"}],
                        },
                    },
                    {"step": "message", "text": "Done: the host is updated.", "chunks": 2},
                    {"step": "stop", "reason": "end_turn"},
                ]
            ]
        }
    )
    asked: list[PermissionQuestion] = []

    async def allow(question: PermissionQuestion) -> str | None:
        asked.append(question)
        return "allow"

    async with agent(argv, permission=allow) as client:
        with anyio.fail_after(WAIT):
            result = await (await session_of(client, tmp_path)).prompt("update the host")
    assert result.stop_reason == "end_turn"
    kinds = [type(u).__name__ for u in result.updates]
    assert (
        kinds
        == ["AgentMessageChunk"] * 3
        + ["ToolCall", "ToolCallProgress", "ToolCall", "ToolCallProgress"]
        + ["AgentMessageChunk"] * 2
    )
    assert "".join(texts(result)[:3]) == "Reading the config."
    assert result.output == "Done: the host is updated."
    assert [(q.tool_call_id, [o.option_id for o in q.options]) for q in asked] == [
        ("c2", ["allow", "reject"])
    ]
    final_update = result.updates[-3]
    assert isinstance(final_update, schema.ToolCallProgress)
    assert final_update.status == "completed"


# -- crashes: fast, typed, with exit status and stderr -----------------------------------------------------


async def test_a_child_crashing_during_initialize_is_a_typed_error_with_status_and_stderr(
    stub_agent_command: StubAgentCommand,
) -> None:
    argv = stub_agent_command(
        {"initialize": {"steps": [{"step": "exit", "code": 3, "stderr": "no credentials found"}]}}
    )
    async with agent(argv) as client:
        with anyio.fail_after(WAIT), pytest.raises(AgentExitedError) as caught:
            await client.initialize()
    info = caught.value.exit_info
    assert info is not None
    assert info.returncode == 3
    assert "no credentials found" in info.stderr_tail
    assert "exited with status 3" in str(caught.value)


async def test_a_child_crashing_during_a_prompt_is_a_typed_error_with_status_and_stderr(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {"turns": [[{"step": "message", "text": "half done"}, {"step": "exit", "code": 9, "stderr": "OOM"}]]}
    )
    async with agent(argv) as client:
        with anyio.fail_after(WAIT):
            session = await session_of(client, tmp_path)
            with pytest.raises(AgentExitedError) as caught:
                await session.prompt("go")
    assert caught.value.exit_info is not None
    assert caught.value.exit_info.returncode == 9
    assert "OOM" in str(caught.value)


async def test_a_child_dying_after_half_a_line_is_a_typed_error_and_the_fragment_a_protocol_error(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    errors: list[ProtocolError] = []
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "raw", "text": '{"jsonrpc":"2.0","method":"session/upd'},
                    {"step": "exit", "code": 1, "stderr": "crashed mid-message"},
                ]
            ]
        }
    )
    async with agent(argv, on_protocol_error=errors.append) as client:
        with anyio.fail_after(WAIT):
            session = await session_of(client, tmp_path)
            with pytest.raises(AgentExitedError) as caught:
                await session.prompt("go")
    assert caught.value.exit_info is not None
    assert caught.value.exit_info.returncode == 1
    assert "crashed mid-message" in str(caught.value)
    assert [type(e) for e in errors] == [MalformedMessageError]


async def test_a_child_closing_stdout_but_staying_alive_fails_calls_at_once_and_is_torn_down(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command({"turns": [[{"step": "close_stdout"}]], "onStdinEof": "ignore"})
    async with agent(argv, process_options=SIGTERM_HONOURED) as client:
        with anyio.fail_after(WAIT):
            session = await session_of(client, tmp_path)
            with pytest.raises(AgentExitedError) as caught:
                await session.prompt("go")
        assert client.process is not None
        report = await client.process.aclose()
    assert "closed its stdout but is still running" in str(caught.value)
    assert caught.value.exit_info is None
    assert report.steps == (TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM)


# -- big, broken and noisy output -------------------------------------------------------------------------


async def test_a_10_mib_line_is_received_whole(stub_agent_command: StubAgentCommand, tmp_path: Path) -> None:
    size = 10 * 1024 * 1024
    argv = stub_agent_command(
        {"turns": [[{"step": "huge_line", "bytes": size}, {"step": "message", "text": "after"}]]}
    )
    async with agent(argv) as client:
        with anyio.fail_after(WAIT):
            result = await (await session_of(client, tmp_path)).prompt("go")
    big, after = texts(result)
    assert len(big) > size - 1024  # the chunk's text is the line minus its JSON envelope
    assert after == "after"


async def test_a_line_over_the_limit_is_skipped_and_reported_without_losing_the_turn(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    errors: list[ProtocolError] = []
    argv = stub_agent_command(
        {"turns": [[{"step": "huge_line", "bytes": 3_000_000}, {"step": "message", "text": "ok"}]]}
    )
    async with agent(argv, max_line_bytes=1_000_000, on_protocol_error=errors.append) as client:
        with anyio.fail_after(WAIT):
            result = await (await session_of(client, tmp_path)).prompt("go")
    assert result.output == "ok"
    assert [type(e) for e in errors] == [MessageTooLargeError]


async def test_non_json_lines_on_stdout_are_skipped_and_logged(
    stub_agent_command: StubAgentCommand, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    errors: list[ProtocolError] = []
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "raw", "text": "Running database migrations...\n"},
                    {"step": "raw", "text": "[1, 2, 3]\n"},
                    {"step": "message", "text": "still fine"},
                ]
            ]
        }
    )
    caplog.set_level(logging.WARNING)
    async with agent(argv, on_protocol_error=errors.append) as client:
        with anyio.fail_after(WAIT):
            result = await (await session_of(client, tmp_path)).prompt("go")
    assert result.output == "still fine"
    assert len(errors) == 2
    assert all(isinstance(e, MalformedMessageError) for e in errors)
    assert sum("Running database migrations" in r.getMessage() for r in caplog.records) == 1


async def test_a_50_mib_stderr_flood_deadlocks_nothing_and_leaves_a_bounded_tail(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "stderr", "bytes": 50 * 1024 * 1024},
                    {"step": "message", "text": "after the flood"},
                ]
            ]
        }
    )
    async with agent(argv) as client:
        with anyio.fail_after(60):
            result = await (await session_of(client, tmp_path)).prompt("go")
        assert isinstance(client.process, AgentProcess)  # a local child: its raw tail and byte count
        tail = client.process.stderr_tail_raw()
        total = client.process.stderr_bytes_total
    assert result.output == "after the flood"
    assert total >= 50 * 1024 * 1024
    assert len(tail) == 64 * 1024


# -- cancel and teardown ----------------------------------------------------------------------------------


async def test_cancel_honoured_ends_the_turn_cancelled(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {"turns": [[{"step": "message", "text": "working"}, {"step": "wait_for_cancel"}]]}
    )
    async with agent(argv) as client:
        with anyio.fail_after(WAIT):
            session = await session_of(client, tmp_path)
            first = anyio.Event()
            results: list[TurnResult] = []

            async def run() -> None:
                results.append(await session.prompt("go", on_update=lambda update: first.set()))

            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await first.wait()
                await session.cancel()
    assert results[0].stop_reason == "cancelled"
    assert results[0].output == "working"


async def test_cancel_ignored_still_ends_with_teardown(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "message", "text": "la la la"},
                    {"step": "wait_for_cancel", "then": "continue"},
                    {"step": "hang"},
                ]
            ]
        }
    )
    async with agent(argv) as client:
        with anyio.fail_after(WAIT):
            session = await session_of(client, tmp_path)
            first = anyio.Event()
            with anyio.move_on_after(0.5) as grace:  # the grace a caller gives a cancelled turn
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: session.prompt("go", on_update=lambda update: first.set()))
                    await first.wait()
                    await session.cancel()
        assert grace.cancelled_caught  # the agent never answered
        assert client.process is not None
        report = await client.process.aclose()
    assert report.group_gone


async def test_an_agent_ignoring_stdin_eof_is_still_torn_down(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command({"onStdinEof": "ignore"})
    async with agent(argv, process_options=SIGTERM_HONOURED) as client:
        with anyio.fail_after(WAIT):
            await session_of(client, tmp_path)
        assert client.process is not None
        report = await client.process.aclose()
    assert report.steps == (TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM)
    assert report.group_gone


async def test_a_grandchild_that_ignores_sigterm_is_gone_after_teardown(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    pid_file = tmp_path / "grandchild.pid"
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "grandchild", "pidFile": str(pid_file), "ignoreSigterm": True},
                    {"step": "message", "text": "spawned"},
                ]
            ]
        }
    )
    async with agent(argv) as client:
        with anyio.fail_after(WAIT):
            result = await (await session_of(client, tmp_path)).prompt("go")
        grandchild = int(pid_file.read_text())
        assert not process_is_gone(grandchild)
    assert texts(result) == [json.dumps({"grandchild": grandchild}, separators=(",", ":")), "spawned"]
    assert process_is_gone(grandchild)


# -- file system ------------------------------------------------------------------------------------------


async def test_fs_requests_work_inside_the_root_and_every_escape_is_refused_touching_nothing_outside(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    (root / "src").mkdir(parents=True)
    outside.mkdir()
    (root / "src" / "a.txt").write_text("1\n2\n3\n")
    (outside / "secret.txt").write_text("secret")
    (root / "escape").symlink_to(outside, target_is_directory=True)
    steps = [
        {"step": "read_file", "path": str(root / "src" / "a.txt"), "line": 2, "limit": 1},
        {"step": "write_file", "path": str(root / "src" / "b.txt"), "content": "new file"},
        {"step": "read_file", "path": str(root / "src" / ".." / ".." / "outside" / "secret.txt")},
        {"step": "write_file", "path": str(root / ".." / "outside" / "planted.txt"), "content": "x"},
        {"step": "read_file", "path": str(outside / "secret.txt")},
        {"step": "write_file", "path": str(outside / "secret.txt"), "content": "overwritten"},
        {"step": "read_file", "path": str(root / "escape" / "secret.txt")},
        {"step": "write_file", "path": str(root / "escape" / "planted.txt"), "content": "x"},
    ]
    argv = stub_agent_command({"turns": [steps]})
    before = sorted((p.name, p.read_bytes()) for p in outside.iterdir())
    async with agent(argv, fs=FsSandbox([root]), permission="allow") as client:
        with anyio.fail_after(WAIT):
            result = await (await session_of(client, root)).prompt("go")
    reports = [json.loads(text) for text in texts(result)]
    assert reports[0] == {"method": "fs/read_text_file", "result": {"content": "2\n"}}
    assert reports[1] == {"method": "fs/write_text_file", "result": {}}
    for report in reports[2:]:
        assert report["error"]["code"] == -32602, report
    assert (root / "src" / "b.txt").read_text() == "new file"
    assert sorted((p.name, p.read_bytes()) for p in outside.iterdir()) == before
    assert os.readlink(root / "escape") == str(outside)
