"""The agent side of ACP, in memory: an `AgentSideConnection` and a raw client-role `Connection` talking.

The client here is a bare JSON-RPC `Connection` (no ACP knowledge), so every assertion is about the exact
wire payloads the agent side produces. Nothing sleeps to wait: each test waits for the event it needs under
`anyio.fail_after`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest

from subagent.acp import RequestError, schema
from subagent.acp._stdio import FdReceiveStream, FdSendStream
from subagent.acp.agent import (
    AgentHandler,
    AgentSideConnection,
    ClientPeer,
    PromptTurn,
    negotiate_protocol_version,
)
from subagent.acp.connection import Connection
from subagent.testing import MemoryByteReceiveStream, MemoryByteSendStream

pytestmark = pytest.mark.anyio

TIMEOUT = 5


@dataclass
class Notifications:
    """The notifications the client received, decoded to plain JSON values, with a way to wait for more."""

    received: list[tuple[str, Any]] = field(default_factory=list)
    _changed: anyio.Event = field(default_factory=anyio.Event)

    async def record(self, method: str, params: msgspec.Raw | None) -> None:
        self.received.append((method, None if params is None else msgspec.json.decode(params)))
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, count: int) -> None:
        while len(self.received) < count:
            await self._changed.wait()


ClientRequestHandler = Callable[[str, Any], Awaitable[Any]]


@dataclass
class Peers:
    agent: AgentSideConnection
    client: Connection
    notifications: Notifications
    client_requests: list[tuple[str, Any]]


@asynccontextmanager
async def connected(
    handler: AgentHandler,
    *,
    answer: ClientRequestHandler | None = None,
    strict_cancel: bool = True,
    initialize: bool = True,
    require_initialize: bool = True,
) -> AsyncIterator[Peers]:
    """An agent side serving `handler` and a raw client connection, crossed over memory streams; the client
    has sent `initialize` (unless told not to)."""
    to_agent_send, to_agent_receive = anyio.create_memory_object_stream[bytes](math.inf)
    to_client_send, to_client_receive = anyio.create_memory_object_stream[bytes](math.inf)
    notifications = Notifications()
    client_requests: list[tuple[str, Any]] = []

    async def serve_client(method: str, params: msgspec.Raw | None) -> Any:
        decoded = None if params is None else msgspec.json.decode(params)
        client_requests.append((method, decoded))
        if answer is None:
            raise RequestError.method_not_found(method)
        return await answer(method, decoded)

    with to_agent_send, to_agent_receive, to_client_send, to_client_receive:
        async with (
            AgentSideConnection(
                handler,
                MemoryByteReceiveStream(to_agent_receive),
                MemoryByteSendStream(to_client_send),
                strict_cancel=strict_cancel,
                require_initialize=require_initialize,
            ) as agent,
            Connection(
                MemoryByteReceiveStream(to_client_receive),
                MemoryByteSendStream(to_agent_send),
                request_handler=serve_client,
                notification_handler=notifications.record,
                name="client",
            ) as client,
        ):
            if initialize:
                with anyio.fail_after(TIMEOUT):
                    await client.request("initialize", INITIALIZE_PARAMS)
            yield Peers(agent, client, notifications, client_requests)


INITIALIZE_PARAMS = {
    "protocolVersion": 1,
    "clientCapabilities": {"fs": {"readTextFile": True, "writeTextFile": False}, "terminal": False},
    "clientInfo": {"name": "test-client", "version": "1.0"},
}
TEXT_PROMPT = [{"type": "text", "text": "Hello"}]


def text_update(session_id: str, text: str, kind: str = "agent_message_chunk") -> tuple[str, Any]:
    """The exact `session/update` notification of one text chunk."""
    update = {"sessionUpdate": kind, "content": {"type": "text", "text": text}}
    return ("session/update", {"sessionId": session_id, "update": update})


class BaseAgent(AgentHandler):
    """A minimal agent; tests override `prompt`."""

    def __init__(self) -> None:
        self.turns: list[PromptTurn] = []

    async def initialize(
        self, params: schema.InitializeRequest, client: ClientPeer
    ) -> schema.InitializeResponse:
        return schema.InitializeResponse(
            protocol_version=negotiate_protocol_version(params.protocol_version),
            agent_capabilities=schema.AgentCapabilities(load_session=True),
            agent_info=schema.Implementation(name="memory-agent", version="0.0.1"),
        )

    async def new_session(
        self, params: schema.NewSessionRequest, client: ClientPeer
    ) -> schema.NewSessionResponse:
        return schema.NewSessionResponse(session_id=f"session-in-{params.cwd}")

    async def prompt(
        self, params: schema.PromptRequest, turn: PromptTurn
    ) -> schema.PromptResponse | msgspec.Raw:
        self.turns.append(turn)
        await turn.send_text(f"you said: {turn.prompt_text()}")
        return schema.PromptResponse(stop_reason="end_turn")


async def test_initialize_answers_protocol_version_1_and_records_the_client_capabilities() -> None:
    async with connected(BaseAgent()) as peers:
        with anyio.fail_after(TIMEOUT):
            result = await peers.client.request("initialize", INITIALIZE_PARAMS, result_type=object)
    assert result == {
        "protocolVersion": 1,
        "agentCapabilities": {"loadSession": True},
        "agentInfo": {"name": "memory-agent", "version": "0.0.1"},
    }
    client = peers.agent.client
    assert client.protocol_version == 1
    assert client.capabilities is not None
    assert client.capabilities.fs.read_text_file is True
    assert client.capabilities.fs.write_text_file is False
    assert client.client_info == schema.Implementation(name="test-client", version="1.0")


async def test_initialize_answers_our_version_when_the_client_asks_for_one_we_do_not_speak() -> None:
    async with connected(BaseAgent()) as peers:
        with anyio.fail_after(TIMEOUT):
            result = await peers.client.request("initialize", {"protocolVersion": 7}, result_type=dict)
    assert result["protocolVersion"] == 1
    assert negotiate_protocol_version(1) == 1
    assert negotiate_protocol_version(0) == 1


class CountingAgent(BaseAgent):
    """Fails its first `initialize`; counts what reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    async def initialize(
        self, params: schema.InitializeRequest, client: ClientPeer
    ) -> schema.InitializeResponse:
        self.calls.append("initialize")
        if self.calls.count("initialize") == 1:
            raise RequestError.internal_error({"details": "not ready yet"})
        return await super().initialize(params, client)

    async def new_session(
        self, params: schema.NewSessionRequest, client: ClientPeer
    ) -> schema.NewSessionResponse:
        self.calls.append("session/new")
        return await super().new_session(params, client)

    async def cancel(self, params: schema.CancelNotification, client: ClientPeer) -> None:
        self.calls.append("session/cancel")

    async def ext_method(self, method: str, params: msgspec.Raw | None, client: ClientPeer) -> Any:
        self.calls.append(method)
        return {}


async def test_a_request_before_a_successful_initialize_is_refused_and_never_reaches_its_handler() -> None:
    agent = CountingAgent()
    new_session: dict[str, Any] = {"cwd": "/home/user", "mcpServers": []}
    prompt: dict[str, Any] = {"sessionId": "s1", "prompt": TEXT_PROMPT}
    async with connected(agent, initialize=False) as peers:
        with anyio.fail_after(TIMEOUT):
            refusals = []
            for method, params in [("session/new", new_session), ("session/prompt", prompt), ("_ext/x", {})]:
                with pytest.raises(RequestError) as caught:
                    await peers.client.request(method, params)
                refusals.append(caught.value.to_wire())
            await peers.client.notify("session/cancel", {"sessionId": "s1"})
            with pytest.raises(RequestError):  # the handler's own failure: still not initialized
                await peers.client.request("initialize", INITIALIZE_PARAMS)
            with pytest.raises(RequestError) as caught:
                await peers.client.request("session/new", new_session)
            refusals.append(caught.value.to_wire())
            await peers.client.request("initialize", INITIALIZE_PARAMS)
            result = await peers.client.request("session/new", new_session, result_type=object)
    assert refusals == [
        {
            "code": -32600,
            "message": "Invalid Request",
            "data": {"details": "the client must send initialize first", "method": method},
        }
        for method in ("session/new", "session/prompt", "_ext/x", "session/new")
    ]
    assert result == {"sessionId": "session-in-/home/user"}
    assert agent.calls == ["initialize", "initialize", "session/new"]
    assert agent.turns == []


class SlowInitAgent(CountingAgent):
    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail
        self.release = anyio.Event()

    async def initialize(
        self, params: schema.InitializeRequest, client: ClientPeer
    ) -> schema.InitializeResponse:
        await self.release.wait()
        if self.fail:
            raise RequestError.internal_error({"details": "cannot start"})
        return await BaseAgent.initialize(self, params, client)


@pytest.mark.parametrize("fail", [False, True], ids=["initialized", "initialize-failed"])
async def test_a_request_sent_right_behind_initialize_waits_for_its_outcome(fail: bool) -> None:
    agent = SlowInitAgent(fail)
    to_agent_send, to_agent_receive = anyio.create_memory_object_stream[bytes](math.inf)
    to_client_send, to_client_receive = anyio.create_memory_object_stream[bytes](math.inf)
    pipelined = (
        json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": INITIALIZE_PARAMS})
        + "\n"
        + json.dumps(
            {"jsonrpc": "2.0", "id": 1, "method": "session/new", "params": {"cwd": "/w", "mcpServers": []}}
        )
        + "\n"
    ).encode()
    with to_agent_send, to_agent_receive, to_client_send, to_client_receive:
        async with AgentSideConnection(
            agent, MemoryByteReceiveStream(to_agent_receive), MemoryByteSendStream(to_client_send)
        ):
            with anyio.fail_after(TIMEOUT):
                await to_agent_send.send(pipelined)  # one read: no answer in between
                await anyio.wait_all_tasks_blocked()
                assert agent.calls == []  # session/new waits for initialize, which waits for release
                agent.release.set()
                answers = [json.loads(await to_client_receive.receive()) for _ in range(2)]
    answers.sort(key=lambda answer: answer["id"])
    if fail:
        assert [answer["error"]["code"] for answer in answers] == [-32603, -32600]
        assert agent.calls == []
    else:
        assert answers[1] == {"jsonrpc": "2.0", "id": 1, "result": {"sessionId": "session-in-/w"}}
        assert agent.calls == ["session/new"]


async def test_without_require_initialize_a_lax_client_is_served_at_once() -> None:
    async with connected(BaseAgent(), initialize=False, require_initialize=False) as peers:
        with anyio.fail_after(TIMEOUT):
            result = await peers.client.request(
                "session/new", {"cwd": "/home/user", "mcpServers": []}, result_type=object
            )
    assert result == {"sessionId": "session-in-/home/user"}


async def test_session_new_answers_the_handlers_session() -> None:
    async with connected(BaseAgent()) as peers:
        with anyio.fail_after(TIMEOUT):
            result = await peers.client.request(
                "session/new", {"cwd": "/home/user", "mcpServers": []}, result_type=object
            )
    assert result == {"sessionId": "session-in-/home/user"}


class StreamingAgent(BaseAgent):
    async def prompt(self, params: schema.PromptRequest, turn: PromptTurn) -> schema.PromptResponse:
        await turn.send_update(schema.AgentThoughtChunk(content=schema.TextContent(text="thinking")))
        for text in ("one ", "two ", "three"):
            await turn.send_text(text)
        await turn.send_update(
            schema.ToolCall(tool_call_id="call-1", title="Read file", kind="read", status="pending")
        )
        await turn.send_update(
            schema.Plan(entries=[schema.PlanEntry(content="Read", priority="high", status="completed")])
        )
        return schema.PromptResponse(stop_reason="max_tokens")


async def test_a_prompt_streams_its_updates_in_order_before_its_stop_reason() -> None:
    async with connected(StreamingAgent()) as peers:
        with anyio.fail_after(TIMEOUT):
            result = await peers.client.request(
                "session/prompt", {"sessionId": "s1", "prompt": TEXT_PROMPT}, result_type=object
            )
    assert result == {"stopReason": "max_tokens"}
    tool_call = {
        "sessionUpdate": "tool_call",
        "toolCallId": "call-1",
        "title": "Read file",
        "kind": "read",
        "status": "pending",
    }
    plan = {
        "sessionUpdate": "plan",
        "entries": [{"content": "Read", "priority": "high", "status": "completed"}],
    }
    assert peers.notifications.received == [
        text_update("s1", "thinking", "agent_thought_chunk"),
        text_update("s1", "one "),
        text_update("s1", "two "),
        text_update("s1", "three"),
        ("session/update", {"sessionId": "s1", "update": tool_call}),
        ("session/update", {"sessionId": "s1", "update": plan}),
    ]


class CancellableAgent(BaseAgent):
    """Streams one chunk, then works until cancelled (aborting its work), and answers honestly."""

    def __init__(self) -> None:
        super().__init__()
        self.cancel_hook_calls: list[str] = []

    async def prompt(self, params: schema.PromptRequest, turn: PromptTurn) -> schema.PromptResponse:
        self.turns.append(turn)
        await turn.send_text("working")
        with turn.abort_on_cancel():
            await anyio.sleep_forever()
        await turn.send_text("stopped")
        return schema.PromptResponse(stop_reason="cancelled" if turn.cancel_requested else "end_turn")

    async def cancel(self, params: schema.CancelNotification, client: ClientPeer) -> None:
        self.cancel_hook_calls.append(params.session_id)


async def test_session_cancel_aborts_the_turn_and_the_prompt_answers_cancelled() -> None:
    agent = CancellableAgent()
    async with connected(agent) as peers, anyio.create_task_group() as task_group:
        results: list[Any] = []

        async def prompt() -> None:
            params = {"sessionId": "s1", "prompt": TEXT_PROMPT}
            results.append(await peers.client.request("session/prompt", params, result_type=object))

        with anyio.fail_after(TIMEOUT):
            task_group.start_soon(prompt)
            await peers.notifications.wait_for(1)
            assert peers.agent.active_turns("s1") == agent.turns
            await peers.client.notify("session/cancel", {"sessionId": "s1"})
            await peers.notifications.wait_for(2)
    assert results == [{"stopReason": "cancelled"}]
    assert peers.notifications.received == [text_update("s1", "working"), text_update("s1", "stopped")]
    assert agent.cancel_hook_calls == ["s1"]
    assert peers.agent.active_turns("s1") == []


async def test_session_close_cancels_the_sessions_turn_before_the_handler_runs() -> None:
    class ClosingAgent(CancellableAgent):
        async def close_session(
            self, params: schema.CloseSessionRequest, client: ClientPeer
        ) -> schema.CloseSessionResponse:
            return schema.CloseSessionResponse()

    async with connected(ClosingAgent()) as peers, anyio.create_task_group() as task_group:
        results: list[Any] = []

        async def prompt() -> None:
            params = {"sessionId": "s1", "prompt": TEXT_PROMPT}
            results.append(await peers.client.request("session/prompt", params, result_type=object))

        with anyio.fail_after(TIMEOUT):
            task_group.start_soon(prompt)
            await peers.notifications.wait_for(1)
            closed = await peers.client.request("session/close", {"sessionId": "s1"}, result_type=object)
            await peers.notifications.wait_for(2)
    assert closed == {}
    assert results == [{"stopReason": "cancelled"}]


class StubbornAgent(BaseAgent):
    """Notices the cancel but answers end_turn anyway, or fails after it."""

    def __init__(self, *, fail: bool) -> None:
        super().__init__()
        self.fail = fail

    async def prompt(self, params: schema.PromptRequest, turn: PromptTurn) -> schema.PromptResponse:
        await turn.send_text("working")
        await turn.wait_cancelled()
        if self.fail:
            raise RuntimeError("the tool was aborted")
        return schema.PromptResponse(stop_reason="end_turn")


@pytest.mark.parametrize("fail", [False, True], ids=["end_turn", "raises"])
async def test_strict_cancel_answers_cancelled_whatever_the_handler_did_after_the_cancel(fail: bool) -> None:
    async with connected(StubbornAgent(fail=fail)) as peers, anyio.create_task_group() as task_group:
        results: list[Any] = []

        async def prompt() -> None:
            params = {"sessionId": "s1", "prompt": TEXT_PROMPT}
            results.append(await peers.client.request("session/prompt", params, result_type=object))

        with anyio.fail_after(TIMEOUT):
            task_group.start_soon(prompt)
            await peers.notifications.wait_for(1)
            await peers.client.notify("session/cancel", {"sessionId": "s1"})
    assert results == [{"stopReason": "cancelled"}]


async def test_without_strict_cancel_the_handlers_stop_reason_goes_out_unchanged() -> None:
    async with (
        connected(StubbornAgent(fail=False), strict_cancel=False) as peers,
        anyio.create_task_group() as task_group,
    ):
        results: list[Any] = []

        async def prompt() -> None:
            params = {"sessionId": "s1", "prompt": TEXT_PROMPT}
            results.append(await peers.client.request("session/prompt", params, result_type=object))

        with anyio.fail_after(TIMEOUT):
            task_group.start_soon(prompt)
            await peers.notifications.wait_for(1)
            await peers.client.notify("session/cancel", {"sessionId": "s1"})
    assert results == [{"stopReason": "end_turn"}]


async def test_a_cancel_for_another_session_leaves_the_turn_running() -> None:
    agent = CancellableAgent()
    async with connected(agent) as peers, anyio.create_task_group() as task_group:
        results: list[Any] = []

        async def prompt() -> None:
            params = {"sessionId": "s1", "prompt": TEXT_PROMPT}
            results.append(await peers.client.request("session/prompt", params, result_type=object))

        with anyio.fail_after(TIMEOUT):
            task_group.start_soon(prompt)
            await peers.notifications.wait_for(1)
            await peers.client.notify("session/cancel", {"sessionId": "s2"})
            # Notifications are handled in order: once this one is, the s2 cancel was handled too.
            await peers.client.notify("session/cancel", {"sessionId": "s1"})
            await peers.notifications.wait_for(2)
    assert agent.cancel_hook_calls == ["s2", "s1"]
    assert results == [{"stopReason": "cancelled"}]


class AskingAgent(BaseAgent):
    async def prompt(self, params: schema.PromptRequest, turn: PromptTurn) -> schema.PromptResponse:
        answer = await turn.client.request_permission(
            schema.RequestPermissionRequest(
                session_id=turn.session_id,
                tool_call=schema.ToolCallUpdate(tool_call_id="call-1", title="rm -rf build"),
                options=[
                    schema.PermissionOption(option_id="yes", name="Allow", kind="allow_once"),
                    schema.PermissionOption(option_id="no", name="Reject", kind="reject_once"),
                ],
            )
        )
        outcome = answer.outcome
        chosen = outcome.option_id if isinstance(outcome, schema.SelectedPermissionOutcome) else "cancelled"
        await turn.send_text(f"outcome: {chosen}")
        return schema.PromptResponse(stop_reason="end_turn")


async def test_a_permission_request_round_trips_through_the_client() -> None:
    async def answer(method: str, params: Any) -> Any:
        return {"outcome": {"outcome": "selected", "optionId": "no"}}

    async with connected(AskingAgent(), answer=answer) as peers:
        with anyio.fail_after(TIMEOUT):
            result = await peers.client.request(
                "session/prompt", {"sessionId": "s1", "prompt": TEXT_PROMPT}, result_type=object
            )
    assert result == {"stopReason": "end_turn"}
    assert peers.client_requests == [
        (
            "session/request_permission",
            {
                "sessionId": "s1",
                "toolCall": {"toolCallId": "call-1", "title": "rm -rf build"},
                "options": [
                    {"optionId": "yes", "name": "Allow", "kind": "allow_once"},
                    {"optionId": "no", "name": "Reject", "kind": "reject_once"},
                ],
            },
        )
    ]
    assert peers.notifications.received == [text_update("s1", "outcome: no")]


class FileWritingAgent(BaseAgent):
    async def prompt(self, params: schema.PromptRequest, turn: PromptTurn) -> schema.PromptResponse:
        written = await turn.client.write_text_file(
            schema.WriteTextFileRequest(session_id=turn.session_id, path="/home/user/a.txt", content="hi")
        )
        assert written == schema.WriteTextFileResponse()
        try:
            await turn.client.read_text_file(
                schema.ReadTextFileRequest(session_id=turn.session_id, path="/nope")
            )
        except RequestError as exc:
            await turn.send_text(f"read failed: {exc.code}")
        return schema.PromptResponse(stop_reason="end_turn")


async def test_fs_requests_accept_a_null_write_result_and_raise_the_clients_error() -> None:
    async def answer(method: str, params: Any) -> Any:
        if method == "fs/write_text_file":
            return None  # The spec allows `null` here.
        raise RequestError.resource_not_found(params["path"])

    async with connected(FileWritingAgent(), answer=answer) as peers:
        with anyio.fail_after(TIMEOUT):
            result = await peers.client.request(
                "session/prompt", {"sessionId": "s1", "prompt": TEXT_PROMPT}, result_type=object
            )
    assert result == {"stopReason": "end_turn"}
    assert [method for method, _ in peers.client_requests] == ["fs/write_text_file", "fs/read_text_file"]
    assert peers.notifications.received == [text_update("s1", "read failed: -32002")]


@pytest.mark.parametrize("method", ["session/load", "session/list", "logout", "no/such_method", "_ext/thing"])
async def test_a_method_the_handler_does_not_implement_answers_method_not_found(method: str) -> None:
    async with connected(BaseAgent()) as peers:
        with anyio.fail_after(TIMEOUT), pytest.raises(RequestError) as caught:
            await peers.client.request(method, {"sessionId": "s1", "cwd": "/", "mcpServers": []})
    assert caught.value.to_wire() == {
        "code": -32601,
        "message": "Method not found",
        "data": {"method": method},
    }


@pytest.mark.parametrize("method", ["session/load", "session/close", "authenticate"])
async def test_a_method_the_handler_does_not_implement_answers_method_not_found_whatever_its_params(
    method: str,
) -> None:
    async with connected(BaseAgent()) as peers:
        with anyio.fail_after(TIMEOUT), pytest.raises(RequestError) as caught:
            await peers.client.request(method, {"sessionId": 7, "methodId": None})
    assert caught.value.to_wire() == {
        "code": -32601,
        "message": "Method not found",
        "data": {"method": method},
    }


class ExtensionAgent(BaseAgent):
    def __init__(self) -> None:
        super().__init__()
        self.ext_notifications: list[tuple[str, Any]] = []

    async def ext_method(self, method: str, params: msgspec.Raw | None, client: ClientPeer) -> Any:
        return {"method": method, "echo": None if params is None else msgspec.json.decode(params)}

    async def ext_notification(self, method: str, params: msgspec.Raw | None, client: ClientPeer) -> None:
        self.ext_notifications.append((method, None if params is None else msgspec.json.decode(params)))


async def test_extension_methods_and_notifications_reach_the_ext_hooks() -> None:
    agent = ExtensionAgent()
    async with connected(agent) as peers:
        with anyio.fail_after(TIMEOUT):
            await peers.client.notify("_zed.dev/ping", {"n": 1})
            result = await peers.client.request("_zed.dev/echo", {"x": [1, 2]}, result_type=object)
    assert result == {"method": "_zed.dev/echo", "echo": {"x": [1, 2]}}
    assert agent.ext_notifications == [("_zed.dev/ping", {"n": 1})]


class FailingAgent(BaseAgent):
    async def prompt(self, params: schema.PromptRequest, turn: PromptTurn) -> schema.PromptResponse:
        raise RuntimeError("secret: the API key sk-123 was rejected")


async def test_a_failing_handler_answers_internal_error_without_leaking_its_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR)
    async with connected(FailingAgent()) as peers:
        with anyio.fail_after(TIMEOUT), pytest.raises(RequestError) as caught:
            await peers.client.request("session/prompt", {"sessionId": "s1", "prompt": TEXT_PROMPT})
    assert caught.value.to_wire() == {"code": -32603, "message": "Internal error"}
    assert "sk-123" in caplog.text  # logged on our side, for the agent's author


async def test_a_handlers_request_error_goes_out_as_is() -> None:
    class GatedAgent(BaseAgent):
        async def new_session(
            self, params: schema.NewSessionRequest, client: ClientPeer
        ) -> schema.NewSessionResponse:
            raise RequestError.auth_required()

    async with connected(GatedAgent()) as peers:
        with anyio.fail_after(TIMEOUT), pytest.raises(RequestError) as caught:
            await peers.client.request("session/new", {"cwd": "/", "mcpServers": []})
    assert caught.value.to_wire() == {"code": -32000, "message": "Authentication required"}


async def test_params_that_do_not_fit_the_method_answer_invalid_params() -> None:
    async with connected(BaseAgent()) as peers:
        with anyio.fail_after(TIMEOUT), pytest.raises(RequestError) as caught:
            await peers.client.request("session/prompt", {"prompt": TEXT_PROMPT})
    assert caught.value.code == -32602
    assert caught.value.message == "Invalid params"
    assert "sessionId" in caught.value.data["details"]


async def test_a_raw_result_is_sent_exactly() -> None:
    class RawAgent(BaseAgent):
        async def prompt(self, params: schema.PromptRequest, turn: PromptTurn) -> msgspec.Raw:
            return msgspec.Raw(b'{"stopReason":"end_turn","usage":{"totalTokens":3}}')

    async with connected(RawAgent()) as peers:
        with anyio.fail_after(TIMEOUT):
            result = await peers.client.request(
                "session/prompt", {"sessionId": "s1", "prompt": TEXT_PROMPT}, result_type=object
            )
    assert result == {"stopReason": "end_turn", "usage": {"totalTokens": 3}}


async def test_fd_streams_carry_a_large_payload_through_a_small_pipe_and_end_with_eof() -> None:
    read_fd, write_fd = os.pipe()
    payload = bytes(range(256)) * 8192  # 2 MiB: many times the pipe's buffer, so writes are partial
    received = bytearray()
    async with FdReceiveStream(read_fd) as receive_stream, anyio.create_task_group() as task_group:

        async def write_all() -> None:
            async with FdSendStream(write_fd) as send_stream:
                await send_stream.send(payload)

        task_group.start_soon(write_all)
        with anyio.fail_after(TIMEOUT):
            while True:
                try:
                    received += await receive_stream.receive()
                except anyio.EndOfStream:
                    break
    assert bytes(received) == payload


async def test_fd_send_stream_to_a_closed_reader_is_a_broken_resource() -> None:
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    async with FdSendStream(write_fd) as send_stream:
        with pytest.raises(anyio.BrokenResourceError):
            await send_stream.send(b"nobody listens\n")
