"""The typed ACP client in memory: the agent is a scripted agent-role Connection, no process."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest

from subagent.acp import (
    AgentCapabilityError,
    AgentExitedError,
    AuthenticationRequiredError,
    ProtocolVersionError,
    RequestError,
    schema,
)
from subagent.acp.client import AcpClient, AcpSession, TurnResult, final_message
from subagent.acp.connection import Connection
from subagent.acp.handlers import FsSandbox, PermissionQuestion
from subagent.acp.terminals import TerminalHost
from subagent.testing import MemoryByteReceiveStream, MemoryByteSendStream
from tests.leaks import assert_no_leaks

pytestmark = pytest.mark.anyio

RELATIVE_DIR_ABSOLUTE = str(Path("relative/dir").absolute())


Handler = Callable[["FakeAgent", Any], Awaitable[Any]]


@dataclass
class FakeAgent:
    """An agent scripted by the test: a handler per method, and a record of what it was sent."""

    handlers: dict[str, Handler] = field(default_factory=dict)
    received: list[tuple[str, Any]] = field(default_factory=list)
    cancelled: anyio.Event = field(default_factory=anyio.Event)
    connection: Connection | None = None
    agent_to_client: MemoryByteSendStream | None = None

    async def serve_request(self, method: str, params: msgspec.Raw | None) -> Any:
        decoded = None if params is None else msgspec.json.decode(params)
        self.received.append((method, decoded))
        handler = self.handlers.get(method)
        if handler is None:
            raise RequestError.method_not_found(method)
        return await handler(self, decoded)

    async def serve_notification(self, method: str, params: msgspec.Raw | None) -> None:
        self.received.append((method, None if params is None else msgspec.json.decode(params)))
        if method == "session/cancel":
            self.cancelled.set()

    async def update(self, session_id: str, update: dict[str, Any]) -> None:
        assert self.connection is not None
        await self.connection.notify("session/update", {"sessionId": session_id, "update": update})

    async def ask(self, method: str, params: dict[str, Any]) -> Any:
        assert self.connection is not None
        return msgspec.json.decode(await self.connection.request(method, params))


def text_chunk(text: str) -> dict[str, Any]:
    return {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}}


async def answer_initialize(agent: FakeAgent, params: Any) -> Any:
    return {"protocolVersion": 1, "agentCapabilities": {"loadSession": True}}


async def answer_new_session(agent: FakeAgent, params: Any) -> Any:
    return {
        "sessionId": "s1",
        "modes": {"currentModeId": "ask", "availableModes": [{"id": "ask", "name": "Ask"}]},
    }


@asynccontextmanager
async def connected(agent: FakeAgent, **client_options: Any) -> AsyncIterator[AcpClient]:
    agent.handlers.setdefault("initialize", answer_initialize)
    agent.handlers.setdefault("session/new", answer_new_session)
    to_agent_send, to_agent_receive = anyio.create_memory_object_stream[bytes](100)
    to_client_send, to_client_receive = anyio.create_memory_object_stream[bytes](100)
    agent.agent_to_client = MemoryByteSendStream(to_client_send)
    agent.connection = Connection(
        MemoryByteReceiveStream(to_agent_receive),
        agent.agent_to_client,
        request_handler=agent.serve_request,
        notification_handler=agent.serve_notification,
        name="fake-agent",
    )
    with (
        to_agent_send,
        to_agent_receive,
        to_client_send,
        to_client_receive,
    ):  # the connections never close streams
        async with (
            agent.connection,
            AcpClient(
                MemoryByteReceiveStream(to_client_receive),
                MemoryByteSendStream(to_agent_send),
                **client_options,
            ) as client,
        ):
            yield client


async def ready_session(client: AcpClient) -> AcpSession:
    await client.initialize()
    return await client.new_session("/home/user")


# -- handshake ------------------------------------------------------------------------------------------


async def test_initialize_sends_version_1_with_capabilities_that_match_the_configuration(
    tmp_path: Path,
) -> None:
    agent = FakeAgent()
    async with connected(agent, fs=FsSandbox([tmp_path])) as client:
        with anyio.fail_after(5):
            response = await client.initialize()
    method, params = agent.received[0]
    assert method == "initialize"
    assert params["protocolVersion"] == 1
    # Terminals are off (false is the default, left out); elicitation (form), notices, compaction and
    # boolean config options are always on.
    assert params["clientCapabilities"] == {
        "fs": {"readTextFile": True, "writeTextFile": True},
        "elicitation": {"form": {}},
        "session": {"compaction": {}, "configOptions": {"boolean": {}}, "notices": {}},
    }
    assert params["clientInfo"]["name"] == "subagent-seam"
    assert response.agent_capabilities.load_session is True
    assert client.agent is response


async def test_without_a_sandbox_the_client_advertises_no_file_system_access() -> None:
    agent = FakeAgent()
    async with connected(agent) as client:
        with anyio.fail_after(5):
            await client.initialize()
    assert agent.received[0][1]["clientCapabilities"].get("fs", {}) in (
        {},
        {"readTextFile": False, "writeTextFile": False},
    )


async def test_an_agent_answering_another_protocol_version_is_a_clear_error() -> None:
    async def version_2(agent: FakeAgent, params: Any) -> Any:
        return {"protocolVersion": 2}

    async with connected(FakeAgent(handlers={"initialize": version_2})) as client:
        with anyio.fail_after(5), pytest.raises(ProtocolVersionError) as caught:
            await client.initialize()
    assert caught.value.version == 2
    assert client.agent is None


async def test_new_session_sends_an_absolute_cwd_and_records_the_modes() -> None:
    agent = FakeAgent()
    async with connected(agent) as client:
        with anyio.fail_after(5):
            await client.initialize()
            session = await client.new_session("relative/dir")
    assert agent.received[1] == (
        "session/new",
        {"cwd": RELATIVE_DIR_ABSOLUTE, "mcpServers": []},
    )
    assert session.session_id == "s1"
    assert session.modes is not None
    assert session.modes.current_mode_id == "ask"
    assert client.session("s1") is session


async def test_a_session_refused_for_authentication_lists_the_agents_auth_methods() -> None:
    async def initialize(agent: FakeAgent, params: Any) -> Any:
        return {
            "protocolVersion": 1,
            "authMethods": [
                {"id": "oauth", "name": "Log in"},
                {"type": "env_var", "id": "key", "name": "API key"},
            ],
        }

    async def refuse(agent: FakeAgent, params: Any) -> Any:
        raise RequestError.auth_required()

    agent = FakeAgent(handlers={"initialize": initialize, "session/new": refuse})
    async with connected(agent) as client:
        with anyio.fail_after(5):
            await client.initialize()
            with pytest.raises(AuthenticationRequiredError) as caught:
                await client.new_session("/home/user")
            await_auth = client.authenticate("oauth")
            with pytest.raises(RequestError):  # the fake has no authenticate handler
                await await_auth
    assert "'oauth' (Log in)" in str(caught.value)
    assert "'key' (env_var)" in str(caught.value)
    assert [getattr(m, "id", None) for m in caught.value.auth_methods] == ["oauth", None]
    assert agent.received[-1] == ("authenticate", {"methodId": "oauth"})


async def test_resume_needs_the_advertised_capability_and_load_records_the_replay() -> None:
    async def load(agent: FakeAgent, params: Any) -> Any:
        await agent.update(
            "old", {"sessionUpdate": "user_message_chunk", "content": {"type": "text", "text": "hi"}}
        )
        await agent.update("old", text_chunk("hello"))
        return None

    agent = FakeAgent(handlers={"session/load": load})
    async with connected(agent) as client:
        with anyio.fail_after(5):
            await client.initialize()
            with pytest.raises(AgentCapabilityError):
                await client.resume_session("old", "/home/user")
            session = await client.load_session("old", "/home/user")
    assert [type(u).__name__ for u in session.replayed] == ["UserMessageChunk", "AgentMessageChunk"]
    assert final_message(session.replayed) == "hello"


# -- a turn ---------------------------------------------------------------------------------------------


async def test_a_turn_delivers_every_update_in_order_before_prompt_returns() -> None:
    async def prompt(agent: FakeAgent, params: Any) -> Any:
        await agent.update("s1", text_chunk("Let me look. "))
        await agent.update(
            "s1", {"sessionUpdate": "tool_call", "toolCallId": "c1", "title": "Read", "kind": "read"}
        )
        await agent.update(
            "s1", {"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "completed"}
        )
        await agent.update("s1", {"sessionUpdate": "plan", "entries": []})
        for i in range(50):
            await agent.update("s1", text_chunk(f"{i},"))
        await agent.update("s1", {"sessionUpdate": "a_kind_from_the_future", "x": 1})
        return {"stopReason": "end_turn", "usage": {"totalTokens": 42, "inputTokens": 30, "outputTokens": 12}}

    seen_sync: list[str] = []
    seen_async: list[str] = []

    async def on_update(update: schema.SessionUpdate) -> None:
        await anyio.lowlevel.checkpoint()
        seen_async.append(type(update).__name__)

    agent = FakeAgent(handlers={"session/prompt": prompt})
    async with connected(agent) as client:
        with anyio.fail_after(5):
            session = await ready_session(client)
            session.on_update(lambda update: seen_sync.append(type(update).__name__))
            result = await session.prompt("Summarise", on_update=on_update)
    assert isinstance(result, TurnResult)
    assert result.stop_reason == "end_turn"
    kinds = [type(u).__name__ for u in result.updates]
    assert kinds == ["AgentMessageChunk", "ToolCall", "ToolCallProgress", "Plan"] + [
        "AgentMessageChunk"
    ] * 50 + ["UnknownSessionUpdate"]
    assert result.output == "".join(f"{i}," for i in range(50))
    assert result.usage == {"totalTokens": 42, "inputTokens": 30, "outputTokens": 12}
    assert seen_sync == kinds
    assert seen_async == kinds
    assert agent.received[-1] == (
        "session/prompt",
        {"sessionId": "s1", "prompt": [{"type": "text", "text": "Summarise"}]},
    )


async def test_an_update_callback_that_raises_loses_nothing(caplog: pytest.LogCaptureFixture) -> None:
    async def prompt(agent: FakeAgent, params: Any) -> Any:
        for text in ["a", "b", "c"]:
            await agent.update("s1", text_chunk(text))
        return {"stopReason": "end_turn"}

    async with connected(FakeAgent(handlers={"session/prompt": prompt})) as client:
        with anyio.fail_after(5):
            session = await ready_session(client)
            result = await session.prompt("go", on_update=lambda update: 1 / 0)
    assert result.output == "abc"
    assert sum("update callback" in r.getMessage() for r in caplog.records) == 3


async def test_updates_for_an_unknown_session_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    async def prompt(agent: FakeAgent, params: Any) -> Any:
        await agent.update("someone-else", text_chunk("not yours"))
        await agent.update("s1", text_chunk("yours"))
        return {"stopReason": "end_turn"}

    async with connected(FakeAgent(handlers={"session/prompt": prompt})) as client:
        with anyio.fail_after(5):
            result = await (await ready_session(client)).prompt("go")
    assert result.output == "yours"
    assert any("unknown session 'someone-else'" in r.getMessage() for r in caplog.records)


async def test_a_second_prompt_while_a_turn_runs_is_refused() -> None:
    release = anyio.Event()

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        await release.wait()
        return {"stopReason": "end_turn"}

    async with connected(FakeAgent(handlers={"session/prompt": prompt})) as client:
        with anyio.fail_after(5):
            session = await ready_session(client)
            async with anyio.create_task_group() as tg:
                tg.start_soon(session.prompt, "first")
                await anyio.wait_all_tasks_blocked()
                assert session.in_turn
                with pytest.raises(RuntimeError, match="already running a turn"):
                    await session.prompt("second")
                release.set()


# -- permission -----------------------------------------------------------------------------------------

PERMISSION = {
    "sessionId": "s1",
    "toolCall": {
        "toolCallId": "c2",
        "title": "Edit config",
        "kind": "edit",
        "rawInput": {"path": "/w/c.json"},
    },
    "options": [
        {"optionId": "allow", "name": "Allow", "kind": "allow_once"},
        {"optionId": "reject", "name": "Skip", "kind": "reject_once"},
    ],
}


def asks_permission(answers: list[Any]) -> Handler:
    async def prompt(agent: FakeAgent, params: Any) -> Any:
        answers.append(await agent.ask("session/request_permission", PERMISSION))
        return {"stopReason": "end_turn"}

    return prompt


@pytest.mark.parametrize(
    ("permission", "expected"),
    [
        ("allow", {"outcome": {"outcome": "selected", "optionId": "allow"}}),
        ("deny", {"outcome": {"outcome": "selected", "optionId": "reject"}}),
    ],
)
async def test_a_permission_question_is_answered_by_the_policy(permission: str, expected: Any) -> None:
    answers: list[Any] = []
    async with connected(
        FakeAgent(handlers={"session/prompt": asks_permission(answers)}), permission=permission
    ) as c:
        with anyio.fail_after(5):
            await (await ready_session(c)).prompt("go")
    assert answers == [expected]


async def test_a_permission_callback_sees_a_frozen_snapshot_of_the_question() -> None:
    asked: list[PermissionQuestion] = []

    async def callback(question: PermissionQuestion) -> str | None:
        asked.append(question)
        return "reject"

    answers: list[Any] = []
    agent = FakeAgent(handlers={"session/prompt": asks_permission(answers)})
    async with connected(agent, permission=callback) as client:
        with anyio.fail_after(5):
            await (await ready_session(client)).prompt("go")
    assert answers == [{"outcome": {"outcome": "selected", "optionId": "reject"}}]
    (question,) = asked
    assert (question.session_id, question.tool_call_id, question.title, question.kind) == (
        "s1",
        "c2",
        "Edit config",
        "edit",
    )
    assert dict(question.raw_input) == {"path": "/w/c.json"}
    assert [o.option_id for o in question.options] == ["allow", "reject"]


async def test_cancel_answers_a_pending_permission_question_cancelled_and_ends_the_turn_cancelled() -> None:
    answers: list[Any] = []
    asked = anyio.Event()
    never = anyio.Event()

    async def absent_human(question: PermissionQuestion) -> str | None:
        asked.set()
        await never.wait()
        return "allow"

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        answers.append(await agent.ask("session/request_permission", PERMISSION))
        await agent.cancelled.wait()
        return {"stopReason": "cancelled"}

    agent = FakeAgent(handlers={"session/prompt": prompt})
    async with connected(agent, permission=absent_human) as client:
        with anyio.fail_after(5):
            session = await ready_session(client)
            async with anyio.create_task_group() as tg:
                results: list[TurnResult] = []

                async def run() -> None:
                    results.append(await session.prompt("go"))

                tg.start_soon(run)
                await asked.wait()
                assert session.pending_permissions == 1
                await session.cancel()
    assert answers == [{"outcome": {"outcome": "cancelled"}}]
    assert results[0].stop_reason == "cancelled"
    assert session.pending_permissions == 0
    assert ("session/cancel", {"sessionId": "s1"}) in agent.received


async def test_a_cancelled_caller_of_prompt_sends_session_cancel() -> None:
    async def prompt(agent: FakeAgent, params: Any) -> Any:
        await agent.cancelled.wait()
        return {"stopReason": "cancelled"}

    agent = FakeAgent(handlers={"session/prompt": prompt})
    async with connected(agent) as client:
        with anyio.fail_after(5):
            session = await ready_session(client)
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(session.prompt, "go")
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()
            await agent.cancelled.wait()
    assert not session.in_turn
    assert client.connection.statistics().pending_requests == 0


# -- file system and other agent requests ---------------------------------------------------------------


async def test_file_requests_are_served_inside_the_sandbox_and_refused_outside(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    replies: dict[str, Any] = {}

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        replies["read"] = await agent.ask(
            "fs/read_text_file", {"sessionId": "s1", "path": str(tmp_path / "a.txt"), "line": 2}
        )
        replies["write"] = await agent.ask(
            "fs/write_text_file", {"sessionId": "s1", "path": str(tmp_path / "b.txt"), "content": "new"}
        )
        try:
            await agent.ask("fs/read_text_file", {"sessionId": "s1", "path": "/etc/passwd"})
        except RequestError as exc:
            replies["outside"] = exc.to_wire()
        try:
            await agent.ask("fs/read_text_file", {"sessionId": "nope", "path": str(tmp_path / "a.txt")})
        except RequestError as exc:
            replies["unknown session"] = exc.to_wire()
        return {"stopReason": "end_turn"}

    agent = FakeAgent(handlers={"session/prompt": prompt})
    async with connected(agent, fs=FsSandbox([tmp_path]), permission="allow") as client:
        with anyio.fail_after(5):
            await (await ready_session(client)).prompt("go")
    assert replies["read"] == {"content": "two\n"}
    assert replies["write"] == {}
    assert (tmp_path / "b.txt").read_text() == "new"
    assert replies["outside"]["code"] == -32602
    assert replies["outside"]["data"]["path"] == "/etc/passwd"
    assert replies["unknown session"] == {
        "code": -32602,
        "message": "Invalid params",
        "data": {"sessionId": "nope", "reason": "unknown session"},
    }


@pytest.mark.parametrize("method", ["fs/read_text_file", "terminal/create", "_vendor/extension"])
async def test_a_request_the_client_did_not_advertise_is_method_not_found(method: str) -> None:
    replies: list[Any] = []

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        try:
            await agent.ask(method, {"sessionId": "s1", "path": "/x", "command": "ls"})
        except RequestError as exc:
            replies.append(exc.to_wire())
        return {"stopReason": "end_turn"}

    async with connected(FakeAgent(handlers={"session/prompt": prompt})) as client:
        with anyio.fail_after(5):
            await (await ready_session(client)).prompt("go")
    assert replies == [{"code": -32601, "message": "Method not found", "data": {"method": method}}]


# -- the agent going away -------------------------------------------------------------------------------


async def test_the_agent_closing_its_output_mid_turn_fails_the_prompt_at_once() -> None:
    async def prompt(agent: FakeAgent, params: Any) -> Any:
        await agent.update("s1", text_chunk("partial"))
        assert agent.agent_to_client is not None
        await agent.agent_to_client.aclose()
        await anyio.sleep_forever()

    async with connected(FakeAgent(handlers={"session/prompt": prompt})) as client:
        with anyio.fail_after(5):
            session = await ready_session(client)
            with pytest.raises(AgentExitedError) as caught:
                await session.prompt("go")
    assert "connection to the agent closed" in str(caught.value)
    assert caught.value.exit_info is None


async def test_notices_and_compactions_reach_the_listener_and_a_summary_never_joins_the_output() -> None:
    notice = {"sessionUpdate": "notice", "severity": "warning", "title": "Rate limited"}
    compaction: list[dict[str, Any]] = [
        {"sessionUpdate": "compaction_update", "compactionId": "k1", "status": "in_progress"},
        {
            "sessionUpdate": "compaction_summary_chunk",
            "compactionId": "k1",
            "content": {"type": "text", "text": "SUMMARY OF EARLIER WORK"},
        },
        {"sessionUpdate": "compaction_update", "compactionId": "k1", "status": "completed"},
    ]

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        await agent.update("s1", text_chunk("The answer "))
        await agent.update("s1", notice)
        for update in compaction:
            await agent.update("s1", update)
        await agent.update("s1", text_chunk("is 42."))
        return {"stopReason": "end_turn"}

    seen: list[schema.SessionUpdate] = []
    async with connected(FakeAgent(handlers={"session/prompt": prompt})) as client:
        with anyio.fail_after(5):
            session = await ready_session(client)
            result = await session.prompt("go", on_update=seen.append)
    assert result.output == "The answer is 42."
    assert seen == list(result.updates)
    assert seen[1:5] == [
        schema.Notice(severity="warning", title="Rate limited"),
        schema.CompactionUpdate(compaction_id="k1", status="in_progress"),
        schema.CompactionSummaryChunk(
            compaction_id="k1", content=schema.TextContent(text="SUMMARY OF EARLIER WORK")
        ),
        schema.CompactionUpdate(compaction_id="k1", status="completed"),
    ]


def test_final_message_is_the_text_after_the_last_tool_call() -> None:
    updates = [
        schema.decode(json.dumps(u), type=schema.SessionUpdate)
        for u in [
            text_chunk("narration "),
            {"sessionUpdate": "tool_call", "toolCallId": "c", "title": "t"},
            text_chunk("after one "),
            {"sessionUpdate": "tool_call_update", "toolCallId": "c", "status": "completed"},
            {"sessionUpdate": "agent_thought_chunk", "content": {"type": "text", "text": "thinking"}},
            text_chunk("the "),
            text_chunk("answer"),
        ]
    ]
    assert final_message(updates) == "the answer"
    assert final_message(updates[:2]) == ""


async def test_terminal_requests_are_served_by_the_terminal_host_when_enabled(tmp_path: Path) -> None:
    replies: dict[str, Any] = {}

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        created = await agent.ask(
            "terminal/create",
            {"sessionId": "s1", "command": sys.executable, "args": ["-c", "print('from the terminal')"]},
        )
        terminal = {"sessionId": "s1", "terminalId": created["terminalId"]}
        replies["exit"] = await agent.ask("terminal/wait_for_exit", terminal)
        replies["output"] = await agent.ask("terminal/output", terminal)
        replies["release"] = await agent.ask("terminal/release", terminal)
        return {"stopReason": "end_turn"}

    async with assert_no_leaks(), TerminalHost(sandbox=FsSandbox([tmp_path]), cwd=tmp_path) as host:
        agent = FakeAgent(handlers={"session/prompt": prompt})
        async with connected(agent, terminals=host, fs=FsSandbox([tmp_path])) as client:
            with anyio.fail_after(10):
                await (await ready_session(client)).prompt("go")
    assert agent.received[0][1]["clientCapabilities"]["terminal"] is True
    assert replies["exit"] == {"exitCode": 0}
    assert replies["output"] == {
        "output": "from the terminal\n",
        "truncated": False,
        "exitStatus": {"exitCode": 0},
    }
    assert replies["release"] == {}


async def test_set_mode_switches_the_session_mode_on_the_agent() -> None:
    async def set_mode(agent: FakeAgent, params: Any) -> Any:
        return {}

    agent = FakeAgent(handlers={"session/set_mode": set_mode})
    async with connected(agent) as client:
        with anyio.fail_after(5):
            session = await ready_session(client)
            await session.set_mode("ask")
    assert agent.received[-1] == ("session/set_mode", {"sessionId": "s1", "modeId": "ask"})


# -- idleness: whether the agent may still be working on something of ours -------------------------------


async def test_the_client_is_idle_between_turns_and_busy_after_a_prompt_it_gave_up_on() -> None:
    started = anyio.Event()

    async def answer_prompt_never(agent: FakeAgent, params: Any) -> Any:
        started.set()
        await anyio.sleep_forever()

    agent = FakeAgent(handlers={"session/prompt": answer_prompt_never})
    async with connected(agent) as client:
        with anyio.fail_after(10):
            assert client.idle  # nothing asked yet
            session = await ready_session(client)
            assert client.idle  # the handshake was answered
            with anyio.CancelScope() as scope:

                async def give_up() -> None:
                    await started.wait()
                    assert not client.idle  # the prompt awaits its answer
                    scope.cancel()

                async with anyio.create_task_group() as group:
                    group.start_soon(give_up)
                    await session.prompt("go")
            assert scope.cancelled_caught
        assert not client.idle  # given up on: the agent may still be at it


async def test_a_turn_the_agent_answered_leaves_the_client_idle() -> None:
    async def answer_prompt(agent: FakeAgent, params: Any) -> Any:
        return {"stopReason": "cancelled"}

    agent = FakeAgent(handlers={"session/prompt": answer_prompt})
    async with connected(agent) as client:
        with anyio.fail_after(10):
            session = await ready_session(client)
            result = await session.prompt("go")
        assert (result.stop_reason, client.idle) == ("cancelled", True)
