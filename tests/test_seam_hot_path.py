"""The per-update path through the seam does each thing once, and keeps every guarantee.

* A caller's deque given to ``AcpSession.prompt`` keeps every turn's updates in one bounded record
  (appended once per update), while each turn's result still lists only its own updates.
* A turn's only callback is called directly: sync or async, it sees every update in order.
* An ACP run keeps its most recent ``max_kept_updates`` updates across turns, counts them all, and
  its listeners (even one added mid-run) see each update once, in order.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any, Final

import anyio
import pytest

from subagent import SubagentRequest, SubagentService
from subagent.acp import schema
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.test_client import FakeAgent, connected, ready_session, text_chunk

pytestmark = pytest.mark.anyio

WAIT: Final = 30  # seconds: a hang guard, never a sleep
FAST: Final = {"stdin_close_timeout": 1.0, "sigterm_timeout": 1.0, "sigkill_timeout": 2.0}


def texts(updates: Any) -> list[str]:
    return [update.content.text for update in updates]


async def test_a_deque_given_to_prompt_keeps_every_turns_updates_bounded_and_each_result_its_own() -> None:
    turns = iter([["a", "b", "c"], ["d", "e"]])

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        for text in next(turns):
            await agent.update("s1", text_chunk(text))
        return {"stopReason": "end_turn"}

    kept: deque[schema.SessionUpdate] = deque(maxlen=4)
    async with connected(FakeAgent(handlers={"session/prompt": prompt})) as client:
        with anyio.fail_after(WAIT):
            session = await ready_session(client)
            first = await session.prompt("one", updates=kept)
            second = await session.prompt("two", updates=kept)
    assert texts(first.updates) == ["a", "b", "c"]
    assert texts(second.updates) == ["d", "e"]
    assert (first.update_count, second.update_count) == (3, 2)
    assert texts(kept) == ["b", "c", "d", "e"]  # the oldest fell out
    assert (first.output, second.output) == ("abc", "de")


async def test_a_turn_whose_updates_outgrow_the_given_deque_lists_only_what_it_kept() -> None:
    async def prompt(agent: FakeAgent, params: Any) -> Any:
        for text in "abcde":
            await agent.update("s1", text_chunk(text))
        return {"stopReason": "end_turn"}

    kept: deque[schema.SessionUpdate] = deque(maxlen=2)
    async with connected(FakeAgent(handlers={"session/prompt": prompt})) as client:
        with anyio.fail_after(WAIT):
            result = await (await ready_session(client)).prompt("go", updates=kept)
    assert texts(result.updates) == ["d", "e"]
    assert (result.update_count, result.output) == (5, "abcde")


@pytest.mark.parametrize("kind", ["sync", "sync returning a value", "async"])
async def test_the_only_callback_of_a_turn_sees_every_update_in_order(kind: str) -> None:
    async def prompt(agent: FakeAgent, params: Any) -> Any:
        for index in range(30):
            await agent.update("s1", text_chunk(f"{index},"))
        return {"stopReason": "end_turn"}

    seen: list[str] = []

    def sync_callback(update: schema.SessionUpdate) -> Any:
        seen.append(texts([update])[0])
        return None if kind == "sync" else 42  # not awaitable: ignored

    async def async_callback(update: schema.SessionUpdate) -> None:
        await anyio.lowlevel.checkpoint()
        seen.append(texts([update])[0])

    callback = async_callback if kind == "async" else sync_callback
    async with connected(FakeAgent(handlers={"session/prompt": prompt})) as client:
        with anyio.fail_after(WAIT):
            result = await (await ready_session(client)).prompt("go", on_update=callback)
    assert seen == [f"{index}," for index in range(30)]
    assert result.output == "".join(seen)


async def test_an_acp_run_keeps_its_latest_updates_across_turns_and_its_listeners_see_each_once_in_order(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    command = stub_agent_command(
        {
            "turns": [
                [{"step": "flood", "count": 20, "text": "a{i} "}],
                [{"step": "flood", "count": 3, "text": "b{i} "}],
            ]
        }
    )
    provider = AcpProvider(command, cwd=tmp_path, max_kept_updates=5, process_options=FAST)
    from_start: list[str] = []
    from_second_turn: list[str] = []
    async with SubagentService(progress_interval=None) as service:
        service.register_provider(provider)
        async with service.start("acp", SubagentRequest("go")) as run:
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
            acp_run.on_update(lambda update: from_start.append(texts([update])[0]))
            with anyio.fail_after(WAIT):
                first = await run.result()
                acp_run.on_update(lambda update: from_second_turn.append(texts([update])[0]))
                second = await acp_run.resume("more")
            kept = texts(acp_run.updates)
            counts = (acp_run.update_count, acp_run.updates_dropped)
    assert first.output == "".join(f"a{index} " for index in range(20))
    assert second.output == "b0 b1 b2 "
    assert from_start == [f"a{index} " for index in range(20)] + ["b0 ", "b1 ", "b2 "]
    assert from_second_turn == ["b0 ", "b1 ", "b2 "]
    assert kept == ["a18 ", "a19 ", "b0 ", "b1 ", "b2 "]
    assert counts == (23, 18)
