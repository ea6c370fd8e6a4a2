"""A session's life on the client, in memory: updates that come before the session does, and session/close."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest

from subagent.acp import RequestError
from subagent.acp.client import MAX_EARLY_UPDATE_BYTES, MAX_EARLY_UPDATES, final_message
from tests.test_client import FakeAgent, connected, text_chunk

pytestmark = pytest.mark.anyio

MODES = {
    "currentModeId": "ask",
    "availableModes": [{"id": "ask", "name": "Ask"}, {"id": "code", "name": "Code"}],
}
COMMANDS = {
    "sessionUpdate": "available_commands_update",
    "availableCommands": [{"name": "compact", "description": "Compact the conversation"}],
}
CONFIG = {
    "sessionUpdate": "config_option_update",
    "configOptions": [
        {
            "type": "select",
            "id": "model",
            "name": "Model",
            "currentValue": "fast",
            "options": [{"value": "fast", "name": "Fast"}, {"value": "smart", "name": "Smart"}],
        }
    ],
}


def announcing(*updates: dict[str, Any], session_id: str = "s1", modes: Any = MODES) -> Any:
    """A session/new handler that sends ``updates`` for the new session before answering it."""

    async def new_session(agent: FakeAgent, params: Any) -> Any:
        for update in updates:
            await agent.update(session_id, update)
        answer: dict[str, Any] = {"sessionId": session_id}
        if modes is not None:
            answer["modes"] = modes
        return answer

    return new_session


# -- early updates ----------------------------------------------------------------------------------------


async def test_updates_sent_before_the_session_new_answer_are_kept_on_the_session_in_order() -> None:
    agent = FakeAgent(
        handlers={"session/new": announcing(COMMANDS, text_chunk("hello"), {"sessionUpdate": "x_new_kind"})}
    )
    async with connected(agent) as client:
        with anyio.fail_after(5):
            await client.initialize()
            session = await client.new_session("/home/user")
    kinds = [type(update).__name__ for update in session.early_updates]
    assert kinds == ["AvailableCommandsUpdate", "AgentMessageChunk", "UnknownSessionUpdate"]
    assert session.early_updates[0].available_commands[0].name == "compact"  # type: ignore[union-attr]
    assert final_message(session.early_updates) == "hello"
    assert client.early_updates_dropped == 0


async def test_a_mode_and_config_announced_before_the_answer_are_applied_to_the_session() -> None:
    mode = {"sessionUpdate": "current_mode_update", "currentModeId": "code"}
    agent = FakeAgent(handlers={"session/new": announcing(mode, CONFIG)})
    async with connected(agent) as client:
        with anyio.fail_after(5):
            await client.initialize()
            session = await client.new_session("/home/user")
    assert session.modes is not None
    assert session.modes.current_mode_id == "code"
    assert [mode.id for mode in session.modes.available_modes] == ["ask", "code"]
    assert session.config_options is not None
    assert [(option.id, option.current_value) for option in session.config_options] == [  # type: ignore[union-attr]
        ("model", "fast")
    ]


async def test_updates_for_a_session_that_session_new_did_not_return_are_dropped_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def new_session(agent: FakeAgent, params: Any) -> Any:
        await agent.update("someone-else", text_chunk("not yours"))
        await agent.update("s1", text_chunk("yours"))
        return {"sessionId": "s1"}

    async with connected(FakeAgent(handlers={"session/new": new_session})) as client:
        with anyio.fail_after(5):
            await client.initialize()
            session = await client.new_session("/home/user")
    assert final_message(session.early_updates) == "yours"
    assert client.session("someone-else") is None
    assert client.early_updates_dropped == 1
    assert client._early == type(client._early)()
    assert any("did not open: 'someone-else'" in record.getMessage() for record in caplog.records)


async def test_an_update_for_an_unknown_session_with_no_session_request_in_flight_is_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def prompt(agent: FakeAgent, params: Any) -> Any:
        await agent.update("s2", text_chunk("nobody asked"))
        return {"stopReason": "end_turn"}

    agent = FakeAgent(handlers={"session/prompt": prompt})
    async with connected(agent) as client:
        with anyio.fail_after(5):
            await client.initialize()
            session = await client.new_session("/home/user")
            await session.prompt("go")
    assert any("unknown session 's2'" in record.getMessage() for record in caplog.records)
    assert client.early_updates_dropped == 0
    assert len(client._early) == 0


async def test_past_the_count_bound_the_oldest_early_updates_are_dropped_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    extra = 7
    chunks = [text_chunk(f"{index};") for index in range(MAX_EARLY_UPDATES + extra)]
    agent = FakeAgent(handlers={"session/new": announcing(*chunks)})
    with caplog.at_level(logging.WARNING, logger="subagent.acp.client"):
        async with connected(agent) as client:
            with anyio.fail_after(10):
                await client.initialize()
                session = await client.new_session("/home/user")
    assert len(session.early_updates) == MAX_EARLY_UPDATES
    assert final_message(session.early_updates) == "".join(
        f"{i};" for i in range(extra, MAX_EARLY_UPDATES + extra)
    )
    assert client.early_updates_dropped == extra
    warnings = [
        record for record in caplog.records if "updates for sessions not opened yet" in record.getMessage()
    ]
    assert len(warnings) == 1


async def test_past_the_byte_bound_the_oldest_early_updates_are_dropped() -> None:
    big = MAX_EARLY_UPDATE_BYTES // 3  # three of them, with their JSON around, do not fit
    chunks = [text_chunk(letter * big) for letter in "abc"]
    agent = FakeAgent(handlers={"session/new": announcing(*chunks)})
    async with connected(agent) as client:
        with anyio.fail_after(10):
            await client.initialize()
            session = await client.new_session("/home/user")
    assert [update.content.text[0] for update in session.early_updates] == ["b", "c"]  # type: ignore[union-attr]
    assert client.early_updates_dropped == 1
    assert client._early_bytes == 0


async def test_a_failed_session_new_keeps_none_of_the_updates_sent_before_it() -> None:
    async def new_session(agent: FakeAgent, params: Any) -> Any:
        await agent.update("s1", text_chunk("doomed"))
        raise RequestError.internal_error({"details": "no"})

    async with connected(FakeAgent(handlers={"session/new": new_session})) as client:
        with anyio.fail_after(5):
            await client.initialize()
            with pytest.raises(RequestError):
                await client.new_session("/home/user")
    assert client.early_updates_dropped == 1
    assert len(client._early) == 0
    assert client._early_bytes == 0


async def test_while_a_session_loads_its_replay_is_delivered_and_updates_for_others_are_dropped_after() -> (
    None
):
    async def load(agent: FakeAgent, params: Any) -> Any:
        await agent.update("other", text_chunk("not opened"))
        await agent.update("old", text_chunk("replayed"))
        return {}

    async with connected(FakeAgent(handlers={"session/load": load})) as client:
        with anyio.fail_after(5):
            await client.initialize()
            loaded = await client.load_session("old", "/home/user")
    assert final_message(loaded.replayed) == "replayed"
    assert loaded.early_updates == []
    assert client.early_updates_dropped == 1
    assert client.session("other") is None


# -- session/close ----------------------------------------------------------------------------------------


async def closing_agent(agent: FakeAgent, params: Any) -> Any:
    return {"protocolVersion": 1, "agentCapabilities": {"sessionCapabilities": {"close": {}}}}


async def test_close_sends_session_close_once_and_forgets_the_session() -> None:
    async def close(agent: FakeAgent, params: Any) -> Any:
        return {}

    agent = FakeAgent(handlers={"initialize": closing_agent, "session/close": close})
    async with connected(agent) as client:
        with anyio.fail_after(5):
            await client.initialize()
            session = await client.new_session("/home/user")
            assert client.supports_close
            await session.close()
            await session.close()
    assert [entry for entry in agent.received if entry[0] == "session/close"] == [
        ("session/close", {"sessionId": "s1"})
    ]
    assert session.closed
    assert client.session("s1") is None


async def test_close_sends_nothing_to_an_agent_that_does_not_advertise_it_and_forgets_the_session() -> None:
    agent = FakeAgent()
    async with connected(agent) as client:
        with anyio.fail_after(5):
            await client.initialize()
            session = await client.new_session("/home/user")
            assert not client.supports_close
            await session.close()
    assert [method for method, _ in agent.received] == ["initialize", "session/new"]
    assert client.session("s1") is None


async def test_an_error_answer_to_close_is_raised_and_the_session_is_forgotten_all_the_same() -> None:
    async def close(agent: FakeAgent, params: Any) -> Any:
        raise RequestError.internal_error({"details": "busy"})

    agent = FakeAgent(handlers={"initialize": closing_agent, "session/close": close})
    async with connected(agent) as client:
        with anyio.fail_after(5):
            await client.initialize()
            session = await client.new_session("/home/user")
            with pytest.raises(RequestError) as caught:
                await session.close()
            await session.close()  # already closed: nothing more is sent or raised
    assert caught.value.code == -32603
    assert client.session("s1") is None
    assert sum(method == "session/close" for method, _ in agent.received) == 1


async def test_closing_a_session_mid_turn_answers_its_pending_permission_question_cancelled() -> None:
    answers: list[Any] = []

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        answers.append(
            await agent.ask(
                "session/request_permission",
                {
                    "sessionId": "s1",
                    "toolCall": {"toolCallId": "t1"},
                    "options": [{"optionId": "ok", "name": "OK", "kind": "allow_once"}],
                },
            )
        )
        return {"stopReason": "cancelled"}

    async def close(agent: FakeAgent, params: Any) -> Any:
        return {}

    deciding = anyio.Event()

    async def never(question: Any) -> str | None:
        deciding.set()
        await anyio.sleep_forever()
        return None

    agent = FakeAgent(
        handlers={"initialize": closing_agent, "session/close": close, "session/prompt": prompt}
    )
    async with connected(agent, permission=never) as client:
        with anyio.fail_after(5):
            await client.initialize()
            session = await client.new_session("/home/user")
            async with anyio.create_task_group() as group:
                results: list[Any] = []

                async def turn() -> None:
                    results.append(await session.prompt("go"))

                group.start_soon(turn)
                await deciding.wait()
                await session.close()
    assert answers == [{"outcome": {"outcome": "cancelled"}}]
    assert results[0].stop_reason == "cancelled"
