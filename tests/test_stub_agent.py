"""The stub agent, driven by a raw client-role `Connection`: in process (`StubAgentTransport`) for the
scenario semantics, and as a real child process for each step whose meaning is the process's (exit, kill,
stderr, raw bytes, huge lines, closing stdout, a grandchild, the stdin-EOF and SIGTERM policies), which
also run in process to show that their in-memory meaning matches.

Each test takes a scenario (inline, or one of ``fixtures/scenarios/``), serves it with `StubAgentTransport`
or spawns ``python -m subagent.testing.stub_agent`` with `open_agent_process`, and checks exact wire
payloads, exit statuses and teardown reports, inside `assert_no_leaks`. Nothing sleeps to wait for
something: each wait is for the event itself, under `anyio.fail_after`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import msgspec
import pytest

from subagent.acp import (
    ConnectionClosedError,
    MalformedMessageError,
    ProtocolError,
    RequestError,
    UnexpectedResponseError,
)
from subagent.acp.connection import Connection
from subagent.acp.transports import AgentProcess, TeardownStep, open_agent_process
from subagent.testing import (
    DEFAULT_SCENARIO_PATH,
    InProcessChannel,
    ScenarioError,
    StubAgentTransport,
    dump_scenario,
    load_scenario,
    parse_scenario,
    stub_agent_argv,
)
from tests.leaks import assert_no_leaks, process_info, process_is_gone

pytestmark = pytest.mark.anyio

Where = Literal["process", "in_process"]
"""How the stub agent runs: as a child process, or in this process over memory streams."""
BOTH = [pytest.param("process", marks=pytest.mark.subprocess), "in_process"]
"""For a step whose meaning is the process's: the real thing, and its in-memory equivalent."""

SCENARIOS = Path(__file__).resolve().parent.parent / "fixtures" / "scenarios"
SHIPPED_SCENARIOS = DEFAULT_SCENARIO_PATH.parent
TIMEOUT = 10
# For tests whose agent outlasts a teardown grace on purpose: short, so the module stays fast.
SHORT_GRACE = 0.3
TEN_MIB = 10 * 1024 * 1024

Answer = Callable[[str, Any], Awaitable[Any]]


@dataclass
class Client:
    """A raw ACP client: the connection, what it received, and the agent (a process or a channel)."""

    connection: Connection
    process: AgentProcess | InProcessChannel
    notifications: list[tuple[str, Any]] = field(default_factory=list)
    requests: list[tuple[str, Any]] = field(default_factory=list)
    protocol_errors: list[ProtocolError] = field(default_factory=list)
    _changed: anyio.Event = field(default_factory=anyio.Event)

    async def record(self, method: str, params: msgspec.Raw | None) -> None:
        self.notifications.append((method, None if params is None else msgspec.json.decode(params)))
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for_notifications(self, count: int) -> None:
        while len(self.notifications) < count:
            await self._changed.wait()

    async def request(self, method: str, params: Any = None) -> Any:
        return await self.connection.request(method, params, result_type=object)

    async def handshake(self, cwd: str = "/tmp") -> str:
        """initialize + session/new; returns the session id."""
        await self.request("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
        session = await self.request("session/new", {"cwd": cwd, "mcpServers": []})
        session_id: str = session["sessionId"]
        return session_id

    async def prompt(self, session_id: str, text: str = "go") -> Any:
        return await self.request(
            "session/prompt", {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}
        )

    def texts(self, kind: str = "agent_message_chunk") -> list[str]:
        """The texts of the text chunks of one kind received so far, in order."""
        return [
            params["update"]["content"]["text"]
            for method, params in self.notifications
            if method == "session/update" and params["update"]["sessionUpdate"] == kind
        ]


@asynccontextmanager
async def stub_agent(
    scenario: dict[str, Any] | Path | None,
    tmp_path: Path,
    *,
    answer: Answer | None = None,
    where: Where = "in_process",
    **process_options: Any,
) -> AsyncIterator[Client]:
    """Run the stub agent on `scenario` (a dict, a file, or None for the default) with a raw client; the
    teardown graces in ``process_options`` apply in process too."""
    opened: contextlib.AbstractAsyncContextManager[AgentProcess | InProcessChannel]
    if where == "in_process":
        opened = StubAgentTransport(scenario, **process_options).open(["stub-agent"])
    elif isinstance(scenario, dict):
        path = tmp_path / "scenario.json"
        await anyio.Path(path).write_text(dump_scenario(scenario))
        opened = open_agent_process(stub_agent_argv(path), **process_options)
    else:
        opened = open_agent_process(stub_agent_argv(scenario), **process_options)
    async with opened as process:
        client: Client

        async def serve(method: str, params: msgspec.Raw | None) -> Any:
            decoded = None if params is None else msgspec.json.decode(params)
            client.requests.append((method, decoded))
            if answer is None:
                raise RequestError.method_not_found(method)
            return await answer(method, decoded)

        errors: list[ProtocolError] = []
        async with Connection(
            process.stdout,
            process.stdin,
            request_handler=serve,
            notification_handler=lambda method, params: client.record(method, params),
            on_protocol_error=errors.append,
            name="test-client",
        ) as connection:
            client = Client(connection, process, protocol_errors=errors)
            yield client


def chunk(session_id: str, text: str, kind: str = "agent_message_chunk") -> tuple[str, Any]:
    update = {"sessionUpdate": kind, "content": {"type": "text", "text": text}}
    return ("session/update", {"sessionId": session_id, "update": update})


def update(session_id: str, **fields: Any) -> tuple[str, Any]:
    return ("session/update", {"sessionId": session_id, "update": fields})


# -- scenario files --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    sorted([*SCENARIOS.glob("*.json"), *SHIPPED_SCENARIOS.glob("*.json")]),
    ids=lambda path: f"{path.parent.name}/{path.name}",
)
def test_every_scenario_file_decodes(path: Path) -> None:
    scenario = load_scenario(path)
    assert parse_scenario(dump_scenario(scenario)) == scenario


def test_a_scenario_with_an_unknown_step_kind_names_the_step_and_the_known_kinds() -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario({"turns": [[{"step": "message", "text": "ok"}, {"step": "explode"}]]}, source="s.json")
    message = str(caught.value)
    assert message.startswith("s.json: Invalid value 'explode' - at `$.turns[0][1].step`")
    assert "known steps: message, thought," in message


def test_a_scenario_with_an_unknown_field_names_the_step() -> None:
    with pytest.raises(ScenarioError, match=r"unknown field `txt` - at `\$\.turns\[1\]\[0\]`"):
        parse_scenario({"turns": [[], [{"step": "message", "txt": "typo"}]]})


def test_a_session_step_in_initialize_is_refused_with_its_path() -> None:
    with pytest.raises(
        ScenarioError, match=r"step 'message' cannot run in initialize .* at `\$\.initialize\.steps\[0\]`"
    ):
        parse_scenario({"initialize": {"steps": [{"step": "message", "text": "no session yet"}]}})


def test_a_permission_branch_naming_no_option_is_refused() -> None:
    with pytest.raises(ScenarioError, match=r"branches \['alow'\] name no option"):
        parse_scenario({"turns": [[{"step": "permission", "branches": {"alow": []}}]]})


def test_a_missing_scenario_file_is_a_scenario_error(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="cannot read the scenario"):
        load_scenario(tmp_path / "nope.json")


# -- handshake -------------------------------------------------------------------------------------------


async def test_the_default_scenario_runs_a_friendly_turn_with_a_permission_question(tmp_path: Path) -> None:
    async def answer(method: str, params: Any) -> Any:
        return {"outcome": {"outcome": "selected", "optionId": "allow"}}

    async with assert_no_leaks(), stub_agent(None, tmp_path, answer=answer) as client:
        with anyio.fail_after(TIMEOUT):
            initialized = await client.request("initialize", {"protocolVersion": 1})
            session = await client.request("session/new", {"cwd": str(tmp_path), "mcpServers": []})
            result = await client.prompt(session["sessionId"])
    assert initialized["protocolVersion"] == 1
    assert initialized["agentInfo"]["name"] == "subagent-stub-agent"
    assert result == {"stopReason": "end_turn"}
    assert [method for method, _ in client.requests] == ["session/request_permission"]
    assert "Permission granted: I wrote the summary to SUMMARY.md." in client.texts()


async def test_auth_is_required_until_authenticate_with_the_configured_method(tmp_path: Path) -> None:
    async with assert_no_leaks(), stub_agent(SCENARIOS / "auth_required.json", tmp_path) as client:
        with anyio.fail_after(TIMEOUT):
            initialized = await client.request("initialize", {"protocolVersion": 1})
            with pytest.raises(RequestError) as refused:
                await client.request("session/new", {"cwd": "/tmp", "mcpServers": []})
            with pytest.raises(RequestError) as wrong_method:
                await client.request("authenticate", {"methodId": "oauth"})
            with pytest.raises(RequestError) as still_refused:
                await client.request("session/new", {"cwd": "/tmp", "mcpServers": []})
            authenticated = await client.request("authenticate", {"methodId": "api-key"})
            session = await client.request("session/new", {"cwd": "/tmp", "mcpServers": []})
    assert initialized["authMethods"] == [
        {"id": "api-key", "name": "API key", "description": "Reads STUB_API_KEY"},
        {"id": "oauth", "name": "Log in"},
    ]
    assert refused.value.to_wire() == {"code": -32000, "message": "Authentication required"}
    assert wrong_method.value.to_wire() == {
        "code": -32602,
        "message": "Invalid params",
        "data": {"methodId": "oauth", "reason": "unknown auth method"},
    }
    assert still_refused.value.code == -32000
    assert authenticated == {}
    assert session == {"sessionId": "session-1"}


async def test_an_initialize_that_is_never_answered_is_bounded_by_the_caller(tmp_path: Path) -> None:
    async with assert_no_leaks(), stub_agent(SCENARIOS / "initialize_never_answers.json", tmp_path) as client:
        with anyio.fail_after(TIMEOUT):
            with anyio.move_on_after(0.5) as waiting:
                await client.request("initialize", {"protocolVersion": 1})
            assert waiting.cancelled_caught
            assert client.process.exit_info() is None
    # The agent was only slow, not deaf: closing stdin was enough.
    report = client.process.teardown_report
    assert report is not None
    assert report.graceful


@pytest.mark.parametrize("where", BOTH)
async def test_a_crash_at_initialize_reports_its_exit_status_and_stderr(tmp_path: Path, where: Where) -> None:
    async with (
        assert_no_leaks(),
        stub_agent(SCENARIOS / "crash_at_initialize.json", tmp_path, where=where) as client,
    ):
        with anyio.fail_after(TIMEOUT):
            with pytest.raises(ConnectionClosedError):
                await client.request("initialize", {"protocolVersion": 1})
            info = await client.process.wait_exit()
    assert info.returncode == 3
    assert info.killed_by is None
    assert info.stderr_tail == "stub agent: fatal: no API key configured\n"


@pytest.mark.parametrize("where", BOTH)
async def test_a_kill_at_session_new_dies_by_that_signal(tmp_path: Path, where: Where) -> None:
    async with (
        assert_no_leaks(),
        stub_agent(SCENARIOS / "killed_at_session_new.json", tmp_path, where=where) as client,
    ):
        with anyio.fail_after(TIMEOUT):
            await client.request("initialize", {"protocolVersion": 1})
            with pytest.raises(ConnectionClosedError):
                await client.request("session/new", {"cwd": "/tmp", "mcpServers": []})
            info = await client.process.wait_exit()
    assert info.killed_by is signal.SIGKILL


# -- turns -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("choice", "final_status", "final_text"),
    [
        ("allow", "completed", "Done: main.py is edited."),
        ("reject", "failed", "Not allowed: nothing changed."),
    ],
)
async def test_a_full_turn_streams_in_order_and_branches_on_the_permission_answer(
    tmp_path: Path, choice: str, final_status: str, final_text: str
) -> None:
    async def answer(method: str, params: Any) -> Any:
        return {"outcome": {"outcome": "selected", "optionId": choice}}

    async with assert_no_leaks(), stub_agent(SCENARIOS / "full_turn.json", tmp_path, answer=answer) as client:
        with anyio.fail_after(TIMEOUT):
            session_id = await client.handshake()
            result = await client.prompt(session_id)
    assert result == {"stopReason": "end_turn"}
    assert client.requests == [
        (
            "session/request_permission",
            {
                "sessionId": "session-1",
                "toolCall": {"toolCallId": "call-1"},
                "options": [
                    {"optionId": "allow", "name": "Allow", "kind": "allow_once"},
                    {"optionId": "reject", "name": "Reject", "kind": "reject_once"},
                ],
            },
        )
    ]
    tool_call_update: dict[str, Any] = {"toolCallId": "call-1", "status": final_status}
    if choice == "allow":
        tool_call_update["rawOutput"] = {"ok": True}
    assert client.notifications == [
        chunk("session-1", "Looking at"),
        chunk("session-1", " the code."),
        update(
            "session-1",
            sessionUpdate="tool_call",
            toolCallId="call-1",
            title="Edit main.py",
            kind="edit",
            status="pending",
            rawInput={"path": "main.py"},
        ),
        update(
            "session-1",
            sessionUpdate="plan",
            entries=[{"content": "Edit main.py", "priority": "high", "status": "in_progress"}],
        ),
        update("session-1", sessionUpdate="tool_call_update", **tool_call_update),
        chunk("session-1", final_text),
    ]


async def test_a_cancel_while_waiting_answers_cancelled(tmp_path: Path) -> None:
    async with assert_no_leaks(), stub_agent(SCENARIOS / "cancel_honoured.json", tmp_path) as client:
        with anyio.fail_after(TIMEOUT):
            session_id = await client.handshake()
            async with anyio.create_task_group() as task_group:
                results: list[Any] = []

                async def prompt() -> None:
                    results.append(await client.prompt(session_id))

                task_group.start_soon(prompt)
                await client.wait_for_notifications(1)
                await client.connection.notify("session/cancel", {"sessionId": session_id})
    assert results == [{"stopReason": "cancelled"}]
    assert client.texts() == ["working..."]


async def test_client_calls_report_their_results_and_error_codes(tmp_path: Path) -> None:
    async def answer(method: str, params: Any) -> Any:
        if method == "fs/read_text_file":
            return {"content": "file text\n"}
        if method == "fs/write_text_file":
            raise RequestError.resource_not_found(params["path"])
        raise RequestError.method_not_found(method)

    async with (
        assert_no_leaks(),
        stub_agent(SCENARIOS / "client_calls.json", tmp_path, answer=answer) as client,
    ):
        with anyio.fail_after(TIMEOUT):
            session_id = await client.handshake()
            result = await client.prompt(session_id)
    assert result == {"stopReason": "end_turn"}
    assert client.requests == [
        ("fs/read_text_file", {"sessionId": "session-1", "path": "/tmp/subagent-stub/input.txt"}),
        (
            "fs/write_text_file",
            {
                "sessionId": "session-1",
                "path": "/tmp/subagent-stub/output.txt",
                "content": "written by the stub\n",
            },
        ),
        ("_stub/unknown", {"x": 1}),
    ]
    assert [json.loads(text) for text in client.texts()] == [
        {"method": "fs/read_text_file", "result": {"content": "file text\n"}},
        {
            "method": "fs/write_text_file",
            "error": {
                "code": -32002,
                "message": "Resource not found",
                "data": {"uri": "/tmp/subagent-stub/output.txt"},
            },
        },
        {
            "method": "_stub/unknown",
            "error": {"code": -32601, "message": "Method not found", "data": {"method": "_stub/unknown"}},
        },
    ]


async def test_a_relative_file_path_is_joined_to_the_session_cwd_and_prompt_fills_written_content(
    tmp_path: Path,
) -> None:
    steps = [
        {"step": "read_file", "path": "notes.txt", "report": False},
        {"step": "write_file", "path": "../out.txt", "content": "asked: {prompt}", "report": False},
        {"step": "write_file", "path": "/abs/out.txt", "content": "as is", "report": False},
    ]

    async def answer(method: str, params: Any) -> Any:
        return {"content": ""} if method == "fs/read_text_file" else {}

    async with assert_no_leaks(), stub_agent({"turns": [steps]}, tmp_path, answer=answer) as client:
        with anyio.fail_after(TIMEOUT):
            session_id = await client.handshake(cwd="/srv/tree")
            await client.prompt(session_id, "child 7")
    assert client.requests == [
        ("fs/read_text_file", {"sessionId": session_id, "path": "/srv/tree/notes.txt"}),
        (
            "fs/write_text_file",
            {"sessionId": session_id, "path": "/srv/tree/../out.txt", "content": "asked: child 7"},
        ),
        ("fs/write_text_file", {"sessionId": session_id, "path": "/abs/out.txt", "content": "as is"}),
    ]


async def test_a_direct_write_goes_to_disk_relative_to_the_session_cwd_asking_the_client_nothing(
    tmp_path: Path,
) -> None:
    steps = [
        {"step": "write_file", "path": "out.txt", "content": "asked: {prompt}\n", "direct": True},
        {"step": "write_file", "path": "missing/out.txt", "content": "x", "direct": True},
    ]
    async with assert_no_leaks(), stub_agent({"turns": [steps]}, tmp_path) as client:
        with anyio.fail_after(TIMEOUT):
            session_id = await client.handshake(cwd=str(tmp_path))
            await client.prompt(session_id, "child 7")
    assert client.requests == []
    assert (tmp_path / "out.txt").read_text() == "asked: child 7\n"
    assert [json.loads(text) for text in client.texts()] == [
        {"path": f"{tmp_path}/out.txt", "written": 15},
        {"path": f"{tmp_path}/missing/out.txt", "error": "No such file or directory"},
    ]


async def test_session_lifecycle_modes_load_resume_and_the_turn_limit(tmp_path: Path) -> None:
    async with assert_no_leaks(), stub_agent(SCENARIOS / "session_lifecycle.json", tmp_path) as client:
        with anyio.fail_after(TIMEOUT):
            initialized = await client.request("initialize", {"protocolVersion": 1})
            session = await client.request("session/new", {"cwd": "/tmp", "mcpServers": []})
            assert await client.request("session/set_mode", {"sessionId": "sess", "modeId": "code"}) == {}
            with pytest.raises(RequestError) as bad_mode:
                await client.request("session/set_mode", {"sessionId": "sess", "modeId": "yolo"})
            loaded = await client.request(
                "session/load", {"sessionId": "old", "cwd": "/tmp", "mcpServers": []}
            )
            replayed = list(client.notifications)
            resumed = await client.request("session/resume", {"sessionId": "older", "cwd": "/tmp"})
            first = await client.prompt("sess")
            second = await client.prompt("sess")
            with pytest.raises(RequestError) as third:
                await client.prompt("sess")
    assert initialized["agentCapabilities"] == {"loadSession": True, "sessionCapabilities": {"resume": {}}}
    assert session["modes"]["currentModeId"] == "ask"
    assert bad_mode.value.code == -32602
    assert loaded == {}
    assert replayed == [
        update("sess", sessionUpdate="current_mode_update", currentModeId="code"),  # announced, as agents do
        chunk("old", "earlier question", "user_message_chunk"),
        chunk("old", "earlier answer"),
    ]
    assert resumed == {}
    assert first == {"stopReason": "end_turn"}
    assert second == {
        "stopReason": "max_tokens",
        "usage": {"totalTokens": 10, "inputTokens": 6, "outputTokens": 4},
    }
    assert third.value.to_wire() == {
        "code": -32603,
        "message": "Internal error",
        "data": {"details": "the scenario has 2 turn(s); this is prompt 3"},
    }
    assert client.notifications[3:] == [
        chunk("sess", "turn one"),
        chunk("someone-else", "not yours"),
        update("sess", sessionUpdate="brand_new_kind", payload=1),
        update("sess", sessionUpdate="usage_update", used=10, size=100),
    ]


# -- misbehaviour ----------------------------------------------------------------------------------------


async def test_garbage_lines_are_skipped_and_the_next_valid_message_arrives(tmp_path: Path) -> None:
    async with assert_no_leaks(), stub_agent(SCENARIOS / "garbage_then_valid.json", tmp_path) as client:
        with anyio.fail_after(TIMEOUT):
            session_id = await client.handshake()
            result = await client.prompt(session_id)
    assert result == {"stopReason": "end_turn"}
    assert client.notifications == [chunk("session-1", "still here")]
    errors = client.protocol_errors
    assert [type(error) for error in errors] == [
        MalformedMessageError,
        UnexpectedResponseError,
        MalformedMessageError,
    ]
    assert isinstance(errors[0], MalformedMessageError)
    assert errors[0].excerpt == b"this is not json"
    assert isinstance(errors[1], UnexpectedResponseError)
    assert errors[1].request_id == 999
    assert isinstance(errors[2], MalformedMessageError)
    assert errors[2].reason == "not UTF-8"


@pytest.mark.parametrize("where", BOTH)
async def test_half_a_line_then_a_crash_arrives_in_order_before_the_exit(
    tmp_path: Path, where: Where
) -> None:
    async with (
        assert_no_leaks(),
        stub_agent(SCENARIOS / "half_line_then_crash.json", tmp_path, where=where) as client,
    ):
        with anyio.fail_after(TIMEOUT):
            session_id = await client.handshake()
            with pytest.raises(ConnectionClosedError):
                await client.prompt(session_id)
            info = await client.process.wait_exit()
    assert info.returncode == 1
    assert info.stderr_tail == "stub agent: crashed mid-message\n"
    [error] = client.protocol_errors
    assert isinstance(error, MalformedMessageError)
    assert error.excerpt == b'{"jsonrpc":"2.0","method":"session/upd'


async def test_a_duplicate_response_is_reported_as_unexpected(tmp_path: Path) -> None:
    async with assert_no_leaks(), stub_agent(SCENARIOS / "duplicate_response.json", tmp_path) as client:
        with anyio.fail_after(TIMEOUT):
            await client.handshake()
    [error] = client.protocol_errors
    assert isinstance(error, UnexpectedResponseError)
    assert error.request_id == 0


@pytest.mark.parametrize("where", BOTH)
async def test_a_stderr_flood_does_not_stop_the_agent_answering(tmp_path: Path, where: Where) -> None:
    async with (
        assert_no_leaks(),
        stub_agent(SCENARIOS / "stderr_flood.json", tmp_path, where=where) as client,
    ):
        with anyio.fail_after(TIMEOUT):
            initialized = await client.request("initialize", {"protocolVersion": 1})
    assert initialized["protocolVersion"] == 1
    assert client.process.stderr_bytes_total == 4 * 1024 * 1024


@pytest.mark.parametrize("where", BOTH)
async def test_a_10_mib_line_arrives_whole(tmp_path: Path, where: Where) -> None:
    async with (
        assert_no_leaks(),
        stub_agent(SCENARIOS / "huge_line_10mib.json", tmp_path, where=where) as client,
    ):
        with anyio.fail_after(TIMEOUT):
            session_id = await client.handshake()
            result = await client.prompt(session_id)
    assert result == {"stopReason": "end_turn"}
    assert client.protocol_errors == []
    [text] = client.texts()
    envelope = {"jsonrpc": "2.0", "method": "session/update", "params": chunk(session_id, "")[1]}
    overhead = len(json.dumps(envelope, separators=(",", ":")))
    assert len(text) == TEN_MIB - overhead
    assert text == "x" * len(text)


async def test_a_flood_of_10000_chunks_arrives_complete_and_in_order(tmp_path: Path) -> None:
    scenario = {"turns": [[{"step": "flood", "count": 10_000, "text": "chunk {i};"}]]}
    async with assert_no_leaks(), stub_agent(scenario, tmp_path) as client:
        with anyio.fail_after(TIMEOUT):
            session_id = await client.handshake()
            result = await client.prompt(session_id)
    assert result == {"stopReason": "end_turn"}
    assert client.texts() == [f"chunk {index};" for index in range(10_000)]


@pytest.mark.parametrize("where", BOTH)
async def test_closing_stdout_ends_the_stream_while_the_agent_lives_on(tmp_path: Path, where: Where) -> None:
    async with (
        assert_no_leaks(),
        stub_agent(SCENARIOS / "close_stdout.json", tmp_path, where=where) as client,
    ):
        with anyio.fail_after(TIMEOUT):
            session_id = await client.handshake()
            with pytest.raises(ConnectionClosedError):
                await client.prompt(session_id)
            assert client.process.exit_info() is None
    assert client.texts() == ["last words"]
    report = client.process.teardown_report
    assert report is not None
    assert report.graceful


@pytest.mark.subprocess
async def test_a_grandchild_is_reported_and_gone_after_teardown(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    scenario = {"turns": [[{"step": "grandchild", "pidFile": str(pid_file)}]]}
    async with assert_no_leaks():
        async with stub_agent(
            scenario, tmp_path, where="process", stdin_close_timeout=SHORT_GRACE, sigterm_timeout=SHORT_GRACE
        ) as client:
            with anyio.fail_after(TIMEOUT):
                session_id = await client.handshake()
                await client.prompt(session_id)
            [report_text] = client.texts()
            pid = json.loads(report_text)["grandchild"]
            assert pid_file.read_text() == f"{pid}\n"
            grandchild = process_info(pid)
            assert grandchild is not None
            assert isinstance(client.process, AgentProcess)
            assert grandchild.pgrp == client.process.pgid
        assert process_is_gone(pid)
    report = client.process.teardown_report
    assert report is not None
    # The stub exits when stdin closes, its grandchild ignores SIGTERM: only SIGKILL clears the group.
    assert report.steps == (TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM, TeardownStep.SIGKILL)
    assert report.group_gone


@pytest.mark.parametrize("where", BOTH)
async def test_an_agent_ignoring_stdin_eof_is_torn_down_by_sigterm(tmp_path: Path, where: Where) -> None:
    async with (
        assert_no_leaks(),
        # SIGTERM is honoured: a generous grace ends when the agent is gone, so load cannot force SIGKILL.
        stub_agent(
            SCENARIOS / "ignore_stdin_eof.json",
            tmp_path,
            where=where,
            stdin_close_timeout=SHORT_GRACE,
            sigterm_timeout=30.0,
        ) as client,
    ):
        with anyio.fail_after(TIMEOUT):
            await client.handshake()
    report = client.process.teardown_report
    assert report is not None
    assert report.steps == (TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM)
    assert report.group_gone
    info = client.process.exit_info()
    assert info is not None
    assert info.killed_by is signal.SIGTERM


@pytest.mark.parametrize("where", BOTH)
async def test_an_agent_ignoring_sigterm_and_stdin_eof_takes_sigkill(tmp_path: Path, where: Where) -> None:
    async with (
        assert_no_leaks(),
        stub_agent(
            SCENARIOS / "ignore_sigterm_and_stdin_eof.json",
            tmp_path,
            where=where,
            stdin_close_timeout=SHORT_GRACE,
            sigterm_timeout=SHORT_GRACE,
        ) as client,
    ):
        with anyio.fail_after(TIMEOUT):
            await client.handshake()
    report = client.process.teardown_report
    assert report is not None
    assert report.steps == (TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM, TeardownStep.SIGKILL)
    info = client.process.exit_info()
    assert info is not None
    assert info.killed_by is signal.SIGKILL


def test_stub_agent_argv_runs_this_python() -> None:
    assert stub_agent_argv("/x/s.json", python="/usr/bin/python3") == [
        "/usr/bin/python3",
        "-m",
        "subagent.testing.stub_agent",
        "--scenario",
        "/x/s.json",
    ]
    assert stub_agent_argv()[1:] == ["-m", "subagent.testing.stub_agent"]
    assert os.path.isfile(DEFAULT_SCENARIO_PATH)


# -- in process: what has no in-memory meaning is refused up front ---------------------------------------


@pytest.mark.parametrize(
    ("step", "reason", "path"),
    [
        (
            {"step": "grandchild", "pidFile": "/nowhere"},
            "'grandchild' starts a grandchild process",
            "$.turns[0][1]",
        ),
        (
            {"step": "kill", "signal": "SIGSTOP"},
            "'kill' stops the agent's process with SIGSTOP",
            "$.turns[0][1]",
        ),
    ],
)
def test_in_process_a_step_that_needs_a_process_is_refused_naming_it_and_its_path(
    step: dict[str, Any], reason: str, path: str
) -> None:
    scenario = {"turns": [[{"step": "message", "text": "hi"}, step]]}
    with pytest.raises(ScenarioError) as caught:
        StubAgentTransport(scenario)
    assert str(caught.value) == (
        f"scenario: step {reason}, which needs the stub agent as a process (stub_agent_argv) - at `{path}`"
    )


@pytest.mark.parametrize("where", BOTH)
async def test_a_signal_whose_default_is_to_do_nothing_leaves_the_agent_answering(
    tmp_path: Path, where: Where
) -> None:
    scenario = {"turns": [[{"step": "kill", "signal": "SIGCHLD"}, {"step": "message", "text": "still here"}]]}
    async with assert_no_leaks(), stub_agent(scenario, tmp_path, where=where) as client:
        with anyio.fail_after(TIMEOUT):
            session_id = await client.handshake()
            result = await client.prompt(session_id)
    assert result == {"stopReason": "end_turn"}
    assert client.texts() == ["still here"]
    report = client.process.teardown_report
    assert report is not None
    assert report.graceful


async def test_in_process_stderr_lines_reach_on_stderr_line_and_the_tail_stays_bounded() -> None:
    scenario = {
        "initialize": {"steps": [{"step": "stderr", "text": "one\ntwo\n"}, {"step": "stderr", "bytes": 5000}]}
    }
    lines: list[str] = []
    transport = StubAgentTransport(scenario, stderr_tail_bytes=100)
    async with (
        assert_no_leaks(),
        transport.open(["stub-agent"], on_stderr_line=lines.append) as channel,
        Connection(channel.stdout, channel.stdin, name="test-client") as connection,
    ):
        with anyio.fail_after(TIMEOUT):
            await connection.request("initialize", {"protocolVersion": 1}, result_type=object)
        assert channel.stderr_bytes_total == 8 + 5000
        assert len(channel.stderr_tail().encode()) == 100
    assert lines[:2] == ["one", "two"]
    assert len(lines) == 2 + 5000 // 75 + 1  # the filler's 75-byte lines, the last one cut short
