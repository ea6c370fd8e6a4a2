"""The ACP provider through the service, against the stub agent: served in process (`StubAgentTransport`),
and as a real child process where the process is the point (its exit status, signals, stderr, teardown)."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import (
    ErrorCode,
    ResumableRun,
    SteerableRun,
    SubagentError,
    SubagentRequest,
    SubagentResult,
    SubagentService,
)
from subagent.acp import schema
from subagent.acp.handlers import PermissionQuestion
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.testing import StubAgentTransport
from tests.leaks import assert_no_leaks

pytestmark = pytest.mark.anyio

WAIT = 20  # seconds: a bound on a whole run, never a sleep
FAST = {"stdin_close_timeout": 1.0, "sigterm_timeout": 1.0, "sigkill_timeout": 2.0}


class StubCommand(list[str]):
    """argv running the stub agent on ``scenario``, which `provider_for` may serve in process instead."""

    def __init__(self, argv: list[str], scenario: dict[str, Any]) -> None:
        super().__init__(argv)
        self.scenario = scenario


MakeCommand = Callable[[dict[str, Any]], StubCommand]


@pytest.fixture
def stub(tmp_path: Path) -> MakeCommand:
    """argv running the stub agent with `scenario` (written under tmp_path)."""
    counter = iter(range(1000))

    def make(scenario: dict[str, Any]) -> StubCommand:
        path = tmp_path / f"scenario-{next(counter)}.json"
        path.write_text(json.dumps(scenario))
        argv = [sys.executable, "-m", "subagent.testing.stub_agent", "--scenario", str(path)]
        return StubCommand(argv, scenario)

    return make


@asynccontextmanager
async def service_with(provider: AcpProvider) -> AsyncIterator[tuple[SubagentService, list[tuple[str, Any]]]]:
    """An open service with `provider`, recording lifecycle events; nothing may leak."""
    events: list[tuple[str, Any]] = []
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        service.events.on("subagent/start", lambda info: events.append(("start", info)))
        service.events.on("subagent/end", lambda info: events.append(("end", info)))
        yield service, events


async def first_update(run: AcpRun) -> None:
    """Return once the run has received a session update."""
    arrived = anyio.Event()
    dispose = run.on_update(lambda update: arrived.set())
    try:
        if not run.updates:
            await arrived.wait()
    finally:
        dispose()


def provider_for(
    command: list[str], tmp_path: Path, *, real_process: bool = False, **options: Any
) -> AcpProvider:
    """A provider for ``command``: a stub agent's scenario is served in process unless ``real_process``."""
    if isinstance(command, StubCommand) and not real_process:
        options["transport"] = StubAgentTransport(
            command.scenario,
            stdin_close_timeout=FAST["stdin_close_timeout"],
            sigterm_timeout=FAST["sigterm_timeout"],
        )
    else:
        options.setdefault("process_options", FAST)
    return AcpProvider(command, cwd=tmp_path, **options)


async def run_once(
    provider: AcpProvider, prompt: str = "go", **request: Any
) -> tuple[SubagentResult, AcpRun]:
    async with (
        service_with(provider) as (service, _),
        service.start(provider.name, SubagentRequest(prompt=prompt, **request)) as run,
    ):
        with anyio.fail_after(WAIT):
            await run.started()
            result = await run.result()
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
    return result, acp_run


# -- turns and stop reasons -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("acp_reason", "stop_reason"),
    [
        ("end_turn", "completed"),
        ("cancelled", "cancelled"),
        ("max_tokens", "max_tokens"),
        ("max_turn_requests", "max_turns"),
        ("refusal", "refusal"),
    ],
)
async def test_every_acp_stop_reason_maps_onto_the_seams(
    stub: MakeCommand, tmp_path: Path, acp_reason: str, stop_reason: str
) -> None:
    command = stub(
        {"turns": [[{"step": "message", "text": "partial"}, {"step": "stop", "reason": acp_reason}]]}
    )
    result, _ = await run_once(provider_for(command, tmp_path))
    assert result == SubagentResult(output="partial", stop_reason=stop_reason)  # type: ignore[arg-type]


async def test_a_full_turn_gives_the_final_message_and_keeps_every_update_readable(
    stub: MakeCommand, tmp_path: Path
) -> None:
    command = stub(
        {
            "turns": [
                [
                    {"step": "message", "text": "Let me read the file first.", "chunks": 3},
                    {"step": "tool_call", "toolCallId": "c1", "title": "Read README.md", "kind": "read"},
                    {"step": "tool_call_update", "toolCallId": "c1", "status": "completed"},
                    {"step": "plan", "entries": [{"content": "summarise", "status": "in_progress"}]},
                    {"step": "message", "text": "The README describes a seam.", "chunks": 4},
                    {
                        "step": "stop",
                        "reason": "end_turn",
                        "usage": {"totalTokens": 7, "inputTokens": 5, "outputTokens": 2},
                    },
                ]
            ]
        }
    )
    provider = provider_for(command, tmp_path)
    async with (
        service_with(provider) as (service, events),
        service.start("acp", SubagentRequest(prompt="Summarise the README")) as run,
    ):
        with anyio.fail_after(WAIT):
            await run.started()
            result = await run.result()
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
    assert result.stop_reason == "completed"
    assert result.output == "The README describes a seam."
    assert result.usage is not None
    assert (result.usage.total_tokens, result.usage.input_tokens, result.usage.output_tokens) == (7, 5, 2)
    kinds = [type(update).__name__ for update in acp_run.updates]
    assert (
        kinds
        == ["AgentMessageChunk"] * 3 + ["ToolCall", "ToolCallProgress", "Plan"] + ["AgentMessageChunk"] * 4
    )
    assert [name for name, _ in events] == ["start", "end"]
    assert events[1][1].last_assistant_message == "The README describes a seam."
    assert acp_run.exit_info is not None
    assert acp_run.exit_info.returncode == 0  # it exited on stdin close: the graceful path


@pytest.mark.subprocess
async def test_an_acp_run_is_resumable_and_not_steerable(stub: MakeCommand, tmp_path: Path) -> None:
    command = stub(
        {"turns": [[{"step": "echo", "prefix": "first: "}], [{"step": "echo", "prefix": "second: "}]]}
    )
    provider = provider_for(command, tmp_path, real_process=True)
    async with (
        service_with(provider) as (service, _),
        service.start("acp", SubagentRequest(prompt="one")) as run,
    ):
        assert isinstance(run, ResumableRun)
        assert not isinstance(run, SteerableRun)
        with anyio.fail_after(WAIT):
            first = await run.result()
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
            pid = acp_run.pid
            assert pid is not None
            second = await run.resume("two")
        assert acp_run.pid == pid  # the same child
        assert acp_run.session_id == "session-1"
    assert first.output == "first: one"
    assert second == SubagentResult(output="second: two", stop_reason="completed")


@pytest.mark.subprocess
async def test_the_agents_stderr_lines_reach_the_callback_as_they_arrive(
    stub: MakeCommand, tmp_path: Path
) -> None:
    lines: list[str] = []
    command = stub(
        {"turns": [[{"step": "stderr", "text": "warming up\nready\n"}, {"step": "message", "text": "hi"}]]}
    )
    result, _ = await run_once(
        provider_for(command, tmp_path, real_process=True, on_stderr_line=lines.append)
    )
    assert result.output == "hi"
    assert lines == ["warming up", "ready"]


async def test_a_json_rpc_error_answer_is_an_error_result_with_the_agents_code(
    stub: MakeCommand, tmp_path: Path
) -> None:
    command = stub(
        {
            "turns": [
                [
                    {"step": "message", "text": "half"},
                    {"step": "error", "code": -32603, "message": "model overloaded"},
                ]
            ]
        }
    )
    result, _ = await run_once(provider_for(command, tmp_path))
    assert result.stop_reason == "error"
    assert result.output == "half"
    assert result.error is not None
    assert "answered session/prompt with error -32603: model overloaded" in result.error


@pytest.mark.subprocess
async def test_a_child_crashing_mid_turn_is_an_error_result_with_exit_status_and_stderr(
    stub: MakeCommand, tmp_path: Path
) -> None:
    command = stub(
        {
            "turns": [
                [
                    {"step": "message", "text": "working"},
                    {"step": "exit", "code": 7, "stderr": "segfault in tool"},
                ]
            ]
        }
    )
    result, run = await run_once(provider_for(command, tmp_path, real_process=True))
    assert result.stop_reason == "error"
    assert result.output == "working"
    assert result.error is not None
    assert "exited with status 7" in result.error
    assert "segfault in tool" in result.error
    assert "subagent.testing.stub_agent" in result.error  # the command is named
    assert run.exit_info is not None
    assert run.exit_info.returncode == 7


# -- readiness failures ---------------------------------------------------------------------------------


async def assert_start_fails(provider: AcpProvider) -> SubagentError:
    async with (
        service_with(provider) as (service, events),
        service.start(provider.name, SubagentRequest(prompt="go")) as run,
    ):
        with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
            await run.started()
        with anyio.fail_after(WAIT), pytest.raises(SubagentError):
            await run.result()
    assert events == []  # a run that never became ready announces nothing
    assert caught.value.code == ErrorCode.START_FAILED
    return caught.value


@pytest.mark.subprocess
async def test_a_child_crashing_during_initialize_fails_the_start_with_status_and_stderr(
    stub: MakeCommand, tmp_path: Path
) -> None:
    command = stub({"initialize": {"steps": [{"step": "exit", "code": 3, "stderr": "missing API key"}]}})
    error = await assert_start_fails(provider_for(command, tmp_path, real_process=True))
    assert "exited with status 3" in error.message
    assert "missing API key" in error.message


@pytest.mark.subprocess
async def test_a_child_killed_during_session_new_fails_the_start_naming_the_signal(
    stub: MakeCommand, tmp_path: Path
) -> None:
    command = stub({"newSession": {"steps": [{"step": "kill", "signal": "SIGKILL"}]}})
    error = await assert_start_fails(provider_for(command, tmp_path, real_process=True))
    assert "SIGKILL" in error.message


@pytest.mark.subprocess
async def test_a_child_that_never_answers_initialize_fails_the_start_after_the_ready_timeout(
    tmp_path: Path,
) -> None:
    # A shell, not the stub agent: it writes its line within the half second even on a loaded machine,
    # where starting a Python interpreter can take longer than that.
    command = ["sh", "-c", "echo 'loading model...' >&2; exec sleep 60"]
    error = await assert_start_fails(provider_for(command, tmp_path, ready_timeout=0.5))
    assert "was not ready within 0.5 s" in error.message
    assert "loading model..." in error.message


@pytest.mark.subprocess
async def test_a_missing_executable_fails_the_start_with_a_clear_message(tmp_path: Path) -> None:
    error = await assert_start_fails(provider_for(["definitely-not-an-acp-agent-xyz"], tmp_path))
    assert "definitely-not-an-acp-agent-xyz" in error.message


async def test_authentication_demanded_without_a_configured_method_fails_listing_the_methods(
    stub: MakeCommand, tmp_path: Path
) -> None:
    command = stub(
        {"requireAuth": "api-key", "initialize": {"authMethods": [{"id": "api-key", "name": "API key"}]}}
    )
    error = await assert_start_fails(provider_for(command, tmp_path))
    assert "'api-key' (API key)" in error.message
    assert "auth_method" in error.message


async def test_authentication_demanded_with_a_configured_method_authenticates_and_retries_once(
    stub: MakeCommand, tmp_path: Path
) -> None:
    command = stub({"requireAuth": "api-key", "turns": [[{"step": "message", "text": "in"}]]})
    result, run = await run_once(provider_for(command, tmp_path, auth_method="api-key"))
    assert result == SubagentResult(output="in", stop_reason="completed")
    assert run.session_id == "session-1"


async def test_a_wrong_configured_auth_method_fails_the_start(stub: MakeCommand, tmp_path: Path) -> None:
    command = stub({"requireAuth": "api-key"})
    error = await assert_start_fails(provider_for(command, tmp_path, auth_method="oauth"))
    assert "handshake" in error.message or "authentication" in error.message


# -- cancel, timeout, permission ------------------------------------------------------------------------


async def test_cancel_during_a_turn_ends_it_cancelled_with_partial_output(
    stub: MakeCommand, tmp_path: Path
) -> None:
    command = stub({"turns": [[{"step": "message", "text": "partial"}, {"step": "wait_for_cancel"}]]})
    provider = provider_for(command, tmp_path)
    async with (
        service_with(provider) as (service, _),
        service.start("acp", SubagentRequest(prompt="go")) as run,
    ):
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        with anyio.fail_after(WAIT):
            await run.started()
            await first_update(acp_run)  # the turn is under way
            await run.cancel()
            result = await run.result()
    assert result == SubagentResult(output="partial", stop_reason="cancelled")


async def test_cancel_during_a_pending_permission_question_answers_it_cancelled(
    stub: MakeCommand, tmp_path: Path
) -> None:
    asked = anyio.Event()
    never = anyio.Event()

    async def absent_human(question: PermissionQuestion) -> str | None:
        asked.set()
        await never.wait()
        return "allow"

    command = stub(
        {
            "turns": [
                [
                    {"step": "tool_call", "toolCallId": "c1", "title": "rm -rf build", "kind": "execute"},
                    {
                        "step": "permission",
                        "branches": {
                            "allow": [{"step": "message", "text": "deleted"}],
                            "cancelled": [
                                {"step": "message", "text": "not deleted"},
                                {"step": "stop", "reason": "cancelled"},
                            ],
                        },
                    },
                ]
            ]
        }
    )
    provider = provider_for(command, tmp_path, permission=absent_human)
    async with (
        service_with(provider) as (service, _),
        service.start("acp", SubagentRequest(prompt="clean up")) as run,
    ):
        with anyio.fail_after(WAIT):
            await asked.wait()
            await run.cancel()
            result = await run.result()
    assert result == SubagentResult(output="not deleted", stop_reason="cancelled")


@pytest.mark.subprocess
async def test_a_child_ignoring_cancel_is_torn_down_after_the_grace(
    stub: MakeCommand, tmp_path: Path
) -> None:
    command = stub(
        {"turns": [[{"step": "message", "text": "stubborn"}, {"step": "hang"}]], "ignoreSigterm": True}
    )
    provider = provider_for(command, tmp_path, real_process=True, cancel_grace=0.3)
    async with (
        service_with(provider) as (service, _),
        service.start("acp", SubagentRequest(prompt="go")) as run,
    ):
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        with anyio.fail_after(WAIT):
            await run.started()
            await first_update(acp_run)
            await run.cancel()
            result = await run.result()
            assert acp_run.exit_info is not None  # torn down by cancel() itself
    assert result.stop_reason == "cancelled"
    assert result.output == "stubborn"
    assert result.error == "the agent ignored session/cancel and was torn down"


async def test_silence_past_the_timeout_ends_the_turn_with_timeout(stub: MakeCommand, tmp_path: Path) -> None:
    command = stub({"turns": [[{"step": "message", "text": "thinking"}, {"step": "wait_for_cancel"}]]})
    result, _ = await run_once(provider_for(command, tmp_path), timeout=0.3)
    assert result.stop_reason == "timeout"
    assert result.output == "thinking"
    assert result.error == "inactive for more than 0.3 s"


async def test_time_spent_waiting_on_a_permission_answer_is_not_silence(
    stub: MakeCommand, tmp_path: Path
) -> None:
    async def slow_human(question: PermissionQuestion) -> str | None:
        await anyio.sleep(0.8)  # a person taking longer than the inactivity timeout to answer
        return "allow"

    command = stub(
        {
            "turns": [
                [
                    {"step": "tool_call", "toolCallId": "c1", "title": "edit", "kind": "edit"},
                    {"step": "permission", "branches": {"allow": [{"step": "message", "text": "edited"}]}},
                ]
            ]
        }
    )
    result, _ = await run_once(provider_for(command, tmp_path, permission=slow_human), timeout=0.4)
    assert result == SubagentResult(output="edited", stop_reason="completed")


@pytest.mark.parametrize(("permission", "outcome"), [("allow", "allowed"), ("deny", "denied")])
async def test_the_permission_policy_answers_a_headless_child(
    stub: MakeCommand, tmp_path: Path, permission: str, outcome: str
) -> None:
    command = stub(
        {
            "turns": [
                [
                    {"step": "tool_call", "toolCallId": "c1", "title": "edit", "kind": "edit"},
                    {
                        "step": "permission",
                        "branches": {
                            "allow": [{"step": "message", "text": "allowed"}],
                            "reject": [{"step": "message", "text": "denied"}],
                        },
                    },
                ]
            ]
        }
    )
    result, _ = await run_once(provider_for(command, tmp_path, permission=permission))
    assert result.output == outcome


@pytest.mark.subprocess
async def test_disposing_mid_turn_leaves_no_process(stub: MakeCommand, tmp_path: Path) -> None:
    command = stub(
        {"turns": [[{"step": "message", "text": "busy"}, {"step": "hang"}]], "onStdinEof": "ignore"}
    )
    provider = provider_for(command, tmp_path, real_process=True)
    async with service_with(provider) as (service, events):
        run = service.start("acp", SubagentRequest(prompt="go"))
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        with anyio.fail_after(WAIT):
            await run.started()
            await first_update(acp_run)
            await run.dispose()
            with pytest.raises(SubagentError) as caught:
                await run.result()
    assert caught.value.code == ErrorCode.DISPOSED
    assert [name for name, _ in events] == ["start", "end"]
    assert acp_run.exit_info is not None
    assert acp_run.exit_info.killed_by is not None


# -- file system ---------------------------------------------------------------------------------------


@pytest.mark.subprocess
async def test_the_child_reads_and_writes_inside_its_cwd_and_is_refused_outside(
    stub: MakeCommand, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("alpha\nbeta\n")
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    command = stub(
        {
            "turns": [
                [
                    {"step": "read_file", "path": str(work / "notes.txt"), "line": 2},
                    {"step": "write_file", "path": str(work / "out.txt"), "content": "written"},
                    {"step": "read_file", "path": str(outside)},
                    {"step": "write_file", "path": str(work / ".." / "planted.txt"), "content": "x"},
                ]
            ]
        }
    )
    provider = AcpProvider(command, cwd=work, permission="allow", process_options=FAST)
    result, run = await run_once(provider)
    reports = [
        json.loads(update.content.text)
        for update in run.updates
        if isinstance(update, schema.AgentMessageChunk) and isinstance(update.content, schema.TextContent)
    ]
    assert reports[0] == {"method": "fs/read_text_file", "result": {"content": "beta\n"}}
    assert reports[1] == {"method": "fs/write_text_file", "result": {}}
    assert reports[2]["error"]["code"] == -32602
    assert reports[3]["error"]["code"] == -32602
    assert (work / "out.txt").read_text() == "written"
    assert not (tmp_path / "planted.txt").exists()
    assert outside.read_text() == "secret"
    assert result.stop_reason == "completed"


# -- structured output ----------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}


async def test_structured_output_is_parsed_and_validated(stub: MakeCommand, tmp_path: Path) -> None:
    command = stub({"turns": [[{"step": "message", "text": '```json\n{"count": 3}\n```'}]]})
    result, _ = await run_once(provider_for(command, tmp_path, structured_output=True), output_schema=SCHEMA)
    assert result.stop_reason == "completed"
    assert result.structured == {"count": 3}


async def test_structured_output_gets_one_repair_turn(stub: MakeCommand, tmp_path: Path) -> None:
    command = stub(
        {
            "turns": [
                [{"step": "message", "text": '{"count": "three"}'}],
                [{"step": "message", "text": '{"count": 3}'}],
            ]
        }
    )
    result, _run = await run_once(
        provider_for(command, tmp_path, structured_output=True), output_schema=SCHEMA
    )
    assert result.structured == {"count": 3}
    assert result.output == '{"count": 3}'


async def test_structured_output_failing_after_the_repair_is_an_error_naming_the_problem(
    stub: MakeCommand, tmp_path: Path
) -> None:
    command = stub(
        {
            "turns": [
                [{"step": "message", "text": "I think it is three."}],
                [{"step": "message", "text": "{}"}],
            ]
        }
    )
    result, _ = await run_once(provider_for(command, tmp_path, structured_output=True), output_schema=SCHEMA)
    assert result.stop_reason == "error"
    assert result.error == (
        "the answer does not match the output schema after one repair turn: "
        "at the top level: 'count' is a required property"
    )


async def test_without_structured_output_the_service_refuses_a_schema_before_spawning(
    stub: MakeCommand, tmp_path: Path
) -> None:
    provider = provider_for(stub({}), tmp_path)
    async with service_with(provider) as (service, _):
        with pytest.raises(SubagentError) as caught:
            service.start("acp", SubagentRequest(prompt="go", output_schema=SCHEMA))
    assert caught.value.code == ErrorCode.UNSUPPORTED_CAPABILITY
    assert caught.value.feature == "output_schema"


async def test_an_internal_error_in_a_run_fails_that_run_and_not_the_service(
    stub: MakeCommand, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken_turn(self: AcpRun, *args: Any, **kwargs: Any) -> SubagentResult:
        raise ZeroDivisionError("provider bug")

    monkeypatch.setattr(AcpRun, "_run_turn", broken_turn)
    result, _ = await run_once(provider_for(stub({}), tmp_path))
    assert result == SubagentResult(
        output="",
        stop_reason="error",
        error="internal error in the ACP provider: ZeroDivisionError: provider bug",
    )
    assert any("failed unexpectedly" in record.getMessage() for record in caplog.records)


def test_a_command_given_as_a_string_is_refused() -> None:
    with pytest.raises(ValueError, match="argv list"):
        AcpProvider("npx some-agent")


def test_the_provider_is_not_context_inheriting() -> None:
    assert AcpProvider(["agent"]).inherits_parent_context is False
