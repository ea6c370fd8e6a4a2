"""What users hit with real agents (Claude Code, Codex, Gemini, Qwen, opencode), reproduced with the stub
agent: handshake errors that say why, the final message as the output, usage where agents put it, a
quick teardown of an idle agent that ignores stdin EOF, and a switch to stop offering the client's fs."""

from __future__ import annotations

import json
import logging
import shlex
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import ErrorCode, SubagentError, SubagentRequest, SubagentResult, SubagentService, Usage
from subagent.acp import RequestError, schema
from subagent.acp.client import (
    DEFAULT_IDLE_CLOSE_GRACE,
    MAX_ERROR_QUOTE_CHARS,
    TurnMessage,
    describe_request_error,
    spawn_agent,
)
from subagent.acp.handlers import PermissionQuestion
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


# -- the output is the final message --------------------------------------------------------------------


async def test_a_warning_message_then_the_answer_gives_the_answer_as_output_and_keeps_the_warning(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    # Codex's shape: a warning message, then the answer, each with its own messageId.
    warning = "Warning: this model is deprecated; use gpt-5-codex instead."
    command = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "message", "text": warning, "messageId": "msg-warn"},
                    {"step": "message", "text": "The answer is 42.", "chunks": 3, "messageId": "msg-answer"},
                ]
            ]
        }
    )
    result, run = await run_once(AcpProvider(command, cwd=tmp_path, process_options=FAST))
    assert result == SubagentResult(output="The answer is 42.", stop_reason="completed")
    assert run.messages == [TurnMessage("msg-warn", warning), TurnMessage("msg-answer", "The answer is 42.")]


async def test_narration_before_a_tool_call_is_an_earlier_message_and_chunks_without_ids_join(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    command = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "message", "text": "Let me look.", "chunks": 2},
                    {"step": "tool_call", "toolCallId": "call-1", "title": "Read"},
                    {"step": "message", "text": "Found it: ", "chunks": 2},
                    {"step": "message", "text": "line 3."},
                ]
            ]
        }
    )
    result, run = await run_once(AcpProvider(command, cwd=tmp_path, process_options=FAST))
    assert result.output == "Found it: line 3."
    assert run.messages == [TurnMessage(None, "Let me look."), TurnMessage(None, "Found it: line 3.")]


# -- usage where agents put it --------------------------------------------------------------------------

CLAUDE_USAGE = {
    "inputTokens": 1200,
    "outputTokens": 80,
    "cachedReadTokens": 3000,
    "cachedWriteTokens": 500,
    "totalTokens": 4780,
}
CLAUDE_TURN = [
    {"step": "message", "text": "Done."},
    {"step": "usage", "used": 4780, "size": 200000, "cost": {"amount": 0.0123, "currency": "USD"}},
    {"step": "stop", "usage": CLAUDE_USAGE},
]
GEMINI_TOKENS = {"input_tokens": 812, "output_tokens": 64}
GEMINI_TURN = [
    {"step": "message", "text": "Done."},
    {
        "step": "stop",
        "meta": {
            "quota": {
                "token_count": GEMINI_TOKENS,
                "model_usage": [{"model": "gemini-2.5-pro", "token_count": GEMINI_TOKENS}],
            }
        },
    },
]


def qwen_usage_chunk(usage: dict[str, Any], duration_ms: int) -> dict[str, Any]:
    """Qwen Code's report of one model call: an empty message chunk whose _meta has the usage."""
    chunk = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": ""}}
    return {"step": "update", "update": {**chunk, "_meta": {"usage": usage, "durationMs": duration_ms}}}


QWEN_TURN = [
    {"step": "message", "text": "Reading."},
    qwen_usage_chunk({"inputTokens": 100, "outputTokens": 20, "totalTokens": 120, "thoughtTokens": 5}, 900),
    {"step": "tool_call", "toolCallId": "call-1", "title": "Read"},
    {"step": "message", "text": "Done."},
    qwen_usage_chunk(
        {
            "inputTokens": 150,
            "outputTokens": 30,
            "totalTokens": 180,
            "thoughtTokens": 0,
            "cachedReadTokens": 100,
        },
        700,
    ),
]
CODEX_TURN = [{"step": "message", "text": "Done."}, {"step": "usage", "used": 5321, "size": 272000}]
NULL_USED_TURN = [
    {"step": "message", "text": "Done."},
    {"step": "update", "update": {"sessionUpdate": "usage_update", "used": None, "size": 128000}},
]


@pytest.mark.parametrize(
    ("turn", "usage"),
    [
        pytest.param(
            CLAUDE_TURN,
            Usage(1200, 80, 4780, None, 3000, 500, 4780, 200000, 0.0123, "USD"),
            id="claude-agent-acp",
        ),
        pytest.param(GEMINI_TURN, Usage(input_tokens=812, output_tokens=64), id="gemini-cli"),
        pytest.param(QWEN_TURN, Usage(250, 50, 300, 5, 100), id="qwen-code"),
        pytest.param(CODEX_TURN, Usage(context_used=5321, context_size=272000), id="codex-acp"),
        pytest.param(NULL_USED_TURN, Usage(context_size=128000), id="used-null"),
    ],
)
async def test_the_result_has_the_usage_wherever_the_agent_reported_it(
    stub_agent_command: StubAgentCommand, tmp_path: Path, turn: list[Any], usage: Usage | None
) -> None:
    command = stub_agent_command({"turns": [turn]})
    result, _ = await run_once(AcpProvider(command, cwd=tmp_path, process_options=FAST))
    assert result == SubagentResult(output="Done.", stop_reason="completed", usage=usage)


@pytest.mark.parametrize(
    ("turn", "usage"),
    [
        pytest.param(
            CLAUDE_TURN,
            {
                **CLAUDE_USAGE,
                "contextUsed": 4780,
                "contextSize": 200000,
                "cost": {"amount": 0.0123, "currency": "USD"},
            },
            id="claude-agent-acp",
        ),
        pytest.param(GEMINI_TURN, {"inputTokens": 812, "outputTokens": 64}, id="gemini-cli"),
        pytest.param(
            QWEN_TURN,
            {
                "inputTokens": 250,
                "outputTokens": 50,
                "totalTokens": 300,
                "thoughtTokens": 5,
                "cachedReadTokens": 100,
            },
            id="qwen-code",
        ),
        pytest.param(CODEX_TURN, {"contextUsed": 5321, "contextSize": 272000}, id="codex-acp"),
        pytest.param(NULL_USED_TURN, {"contextSize": 128000}, id="used-null"),
        pytest.param([{"step": "message", "text": "Done."}], None, id="none"),
    ],
)
async def test_the_turns_usage_mapping_gathers_every_place_the_agent_reported_it(
    stub_agent_command: StubAgentCommand, tmp_path: Path, turn: list[Any], usage: dict[str, Any] | None
) -> None:
    command = stub_agent_command({"turns": [turn]})
    async with assert_no_leaks(), spawn_agent(command, cwd=tmp_path, process_options=FAST) as client:
        with anyio.fail_after(WAIT):
            await client.initialize()
            session = await client.new_session(tmp_path)
            result = await session.prompt("go")
    assert (result.output, result.usage) == ("Done.", usage)


async def test_usage_that_is_not_a_count_is_ignored(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    bogus = {"inputTokens": -5, "outputTokens": "12", "totalTokens": True, "thoughtTokens": 1.5}
    command = stub_agent_command(
        {
            "turns": [
                [
                    qwen_usage_chunk(bogus, 1),
                    {
                        "step": "update",
                        "update": {
                            "sessionUpdate": "usage_update",
                            "used": -1,
                            "size": "big",
                            "cost": {"amount": "free", "currency": "USD"},
                        },
                    },
                    {"step": "stop", "meta": {"usage": bogus, "quota": {"token_count": "lots"}}},
                ]
            ]
        }
    )
    result, _ = await run_once(AcpProvider(command, cwd=tmp_path, process_options=FAST))
    assert result.usage is None


# -- a deny policy and an agent that aborts on a reject -------------------------------------------------

# codex-acp's question before applying a patch: its only reject aborts the turn.
CODEX_OPTIONS = [
    {"optionId": "approved", "name": "Yes", "kind": "allow_once"},
    {"optionId": "abort", "name": "No, provide feedback", "kind": "reject_once"},
]
CODEX_PATCH_TURN = [
    {"step": "tool_call", "toolCallId": "call-1", "title": "Edit src/app.py", "kind": "edit"},
    {
        "step": "permission",
        "toolCall": {"toolCallId": "call-1", "title": "Edit src/app.py", "kind": "edit"},
        "options": CODEX_OPTIONS,
        "branches": {
            "abort": [{"step": "stop", "reason": "cancelled"}],
            "cancelled": [{"step": "stop", "reason": "cancelled"}],
            "approved": [{"step": "message", "text": "Patched."}],
        },
    },
]


async def test_a_turn_the_agent_ends_cancelled_after_a_denied_tool_call_counts_the_denial_on_the_run(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    command = stub_agent_command({"turns": [CODEX_PATCH_TURN]})
    result, run = await run_once(AcpProvider(command, cwd=tmp_path, permission="deny", process_options=FAST))
    assert result == SubagentResult(output="", stop_reason="cancelled")
    assert (run.permissions_denied, run.last_denied) == (1, "Edit src/app.py")


async def test_an_allowed_tool_call_denies_nothing(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    command = stub_agent_command({"turns": [CODEX_PATCH_TURN]})
    result, run = await run_once(AcpProvider(command, cwd=tmp_path, permission="allow", process_options=FAST))
    assert result == SubagentResult(output="Patched.", stop_reason="completed")
    assert (run.permissions_denied, run.last_denied) == (0, None)


async def test_a_turn_we_cancel_during_a_permission_question_is_not_blamed_on_the_policy(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    asked = anyio.Event()

    async def never_answers(question: PermissionQuestion) -> str | None:
        asked.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    command = stub_agent_command({"turns": [CODEX_PATCH_TURN]})
    provider = AcpProvider(command, cwd=tmp_path, permission=never_answers, process_options=FAST)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go")) as run:
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
            with anyio.fail_after(WAIT):
                await asked.wait()
                await run.cancel()
                result = await run.result()
    # The question was withdrawn because we cancelled the turn: no refusal of the policy's.
    assert result == SubagentResult(output="", stop_reason="cancelled")
    assert acp_run.permissions_denied == 0


# -- a quick teardown once the turn is over -------------------------------------------------------------

LONG = {"stdin_close_timeout": 60.0, "sigterm_timeout": 5.0, "sigkill_timeout": 5.0}
"""A full grace no test could wait out: a run that ends within its bounds used the idle one."""


def graces_waited(caplog: pytest.LogCaptureFixture) -> list[float]:
    """The stdin-close graces teardown waited out before sending SIGTERM, from its log records."""
    return [
        record.args[1]
        for record in caplog.records
        if record.name == "subagent.acp.transports._local"
        and record.msg.startswith("agent pid %d still running")
        and isinstance(record.args, tuple)
        and isinstance(record.args[1], float)
    ]


async def test_an_idle_agent_ignoring_stdin_eof_gets_sigterm_after_the_short_idle_grace(
    stub_agent_command: StubAgentCommand, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="subagent.acp.transports._local")
    command = stub_agent_command({"turns": [[{"step": "message", "text": "done"}]], "onStdinEof": "ignore"})
    provider = AcpProvider(command, cwd=tmp_path, process_options=LONG)
    result, run = await run_once(provider)
    assert result == SubagentResult(output="done", stop_reason="completed")
    assert graces_waited(caplog) == [DEFAULT_IDLE_CLOSE_GRACE]
    assert run.exit_info is not None
    assert run.exit_info.killed_by is signal.SIGTERM
    assert run.exit_info.teardown_signal is signal.SIGTERM


async def test_an_idle_agent_that_exits_on_stdin_eof_is_not_signalled(
    stub_agent_command: StubAgentCommand, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="subagent.acp.transports._local")
    command = stub_agent_command({"turns": [[{"step": "message", "text": "done"}]]})
    # A grace no loaded machine runs out of: what is checked is that nothing more than EOF is sent.
    provider = AcpProvider(command, cwd=tmp_path, idle_close_grace=10.0, process_options=LONG)
    _, run = await run_once(provider)
    assert graces_waited(caplog) == []
    assert run.exit_info is not None
    assert (run.exit_info.returncode, run.exit_info.teardown_signal) == (0, None)


async def test_an_agent_disposed_mid_turn_gets_the_full_stdin_close_grace(
    stub_agent_command: StubAgentCommand, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="subagent.acp.transports._local")
    command = stub_agent_command(
        {"turns": [[{"step": "message", "text": "working"}, {"step": "hang"}]], "onStdinEof": "ignore"}
    )
    provider = AcpProvider(command, cwd=tmp_path, process_options=FAST)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go")) as run:
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
            with anyio.fail_after(WAIT):
                await first_update(acp_run)  # the turn is under way
                await run.dispose()
    assert graces_waited(caplog) == [FAST["stdin_close_timeout"]]
    assert acp_run.exit_info is not None
    assert acp_run.exit_info.killed_by is signal.SIGTERM


async def first_update(run: AcpRun) -> None:
    arrived = anyio.Event()
    dispose = run.on_update(lambda update: arrived.set())
    try:
        if not run.updates:
            await arrived.wait()
    finally:
        dispose()
