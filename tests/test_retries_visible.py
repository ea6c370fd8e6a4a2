"""A retried model call travels up the run tree: the adapter yields a `Retrying`, the agent passes it
to its listeners, `subagent serve` sends it as a `session_info_update` (``RETRY_META_KEY``), and the
trace page shows it as a retry mark on the root. On asyncio and trio; every wait bounded, no sleeps.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any, Final

import anyio
import pytest

from subagent.observability import TraceBuilder
from subagent.runtime import (
    Agent,
    AgentEvent,
    CompletionEvent,
    CompletionRequest,
    Retrying,
    ScriptedLlm,
    TextDelta,
)
from subagent.runtime.openai import OpenAiChatAdapter
from subagent.testing import ErrorReply, StreamedReply, serve_chat_completions
from subagent.types import RETRY_META_KEY, TURN_META_KEY, SubagentResult
from tests.test_serve import WAIT, served
from tests.test_serve_background import client_lines, updates_of

pytestmark = pytest.mark.anyio

RETRY: Final = Retrying(attempt=1, attempts=3, delay=0.25, reason="rate_limited, HTTP 429")


class RetriedOnce(ScriptedLlm):
    """A `ScriptedLlm` whose first model call is retried once: a `Retrying` comes before its answer
    (a scripted model cannot fail and retry by itself)."""

    def __init__(self, *script: str) -> None:
        super().__init__(script)
        self.retried_at: float | None = None
        """``time.monotonic()`` just before the `Retrying` went out."""

    async def stream(self, request: CompletionRequest) -> AsyncIterator[CompletionEvent]:
        if self.retried_at is None:
            self.retried_at = time.monotonic()
            yield RETRY
        # Closed with the outer stream: the agent stops reading at the completion.
        async with aclosing(super().stream(request)) as events:  # type: ignore[type-var]
            async for event in events:
                yield event


async def one_turn(agent: Agent) -> tuple[SubagentResult, list[tuple[AgentEvent, float | None]]]:
    """The result of one turn of ``agent`` (closed after it), and each event its listener received
    with the agent's last sign of life at that moment."""
    seen: list[tuple[AgentEvent, float | None]] = []
    agent.on_event(lambda event: seen.append((event, agent.last_activity)))
    try:
        with anyio.fail_after(WAIT):
            result = await agent.run_turn("Say ok.")
    finally:
        await agent.close()
    return result, seen


async def test_an_agents_listener_receives_the_adapters_retry_before_the_answer() -> None:
    script = (ErrorReply(429, "Rate limit reached", retry_after=0.01), StreamedReply(text=("o", "k")))
    async with (
        serve_chat_completions(script) as server,
        OpenAiChatAdapter(
            model="stub-model", base_url=server.base_url, api_key="sk-test", api_key_env=None, max_retries=2
        ) as adapter,
    ):
        agent = Agent(llm=adapter)
        result, seen = await one_turn(agent)
    assert result.output == "ok"
    assert [event for event, _ in seen] == [
        Retrying(attempt=1, attempts=3, delay=0.01, reason="rate_limited, HTTP 429"),
        TextDelta("o"),
        TextDelta("k"),
    ]
    # A retry is no delta: the update count is the answer's two.
    assert agent.update_count == 2
    assert len(server.requests) == 2


async def test_a_retry_is_a_sign_of_life_of_the_agent() -> None:
    llm = RetriedOnce("ok")
    result, seen = await one_turn(Agent(llm=llm))
    assert result.output == "ok"
    assert [event for event, _ in seen] == [RETRY, TextDelta("ok")]
    _, activity = seen[0]
    assert llm.retried_at is not None
    assert activity is not None
    assert activity >= llm.retried_at  # touched when the retry came, not only at the turn's start


async def test_a_served_sessions_retry_is_a_session_info_update_inside_its_turn(tmp_path: Path) -> None:
    transcript: list[bytes] = []
    async with served(RetriedOnce("ok"), transcript=transcript) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("Say ok.")
    assert (turn.stop_reason, turn.output) == ("end_turn", "ok")
    updates: list[dict[str, Any]] = updates_of(client_lines(transcript))
    assert updates == [
        {"sessionUpdate": "session_info_update", "_meta": {TURN_META_KEY: {"turn": 1, "state": "started"}}},
        {
            "sessionUpdate": "session_info_update",
            "_meta": {
                RETRY_META_KEY: {
                    "attempt": 1,
                    "attempts": 3,
                    "delay": 0.25,
                    "reason": "rate_limited, HTTP 429",
                }
            },
        },
        {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "ok"}},
        {
            "sessionUpdate": "session_info_update",
            "_meta": {TURN_META_KEY: {"turn": 1, "state": "ended", "stopReason": "completed"}},
        },
    ]


def retry_update(when: float, retry: object) -> dict[str, Any]:
    update = {"sessionUpdate": "session_info_update", "_meta": {RETRY_META_KEY: retry}}
    return {"event": "update", "time": when, "sessionId": "s", "update": update}


def test_the_trace_page_shows_a_retry_as_a_point_mark_on_the_root_hostile_parts_left_out() -> None:
    builder = TraceBuilder()
    builder.add({"event": "start", "time": 100.0, "runId": "cli", "sessionId": "s", "agent": None})
    good = {"attempt": 1, "attempts": 3, "delay": 0.25, "reason": "rate_limited, HTTP 429"}
    builder.add(retry_update(100.5, good))
    builder.add(retry_update(101.0, {"attempt": True, "attempts": "3", "delay": "soon", "reason": 7}))
    builder.add(retry_update(101.5, "not a mapping"))
    builder.add({"event": "end", "time": 102.0, "stopReason": "end_turn", "error": None, "usage": None})
    (root,) = builder.data()["runs"]
    assert root["marks"] == [
        [
            "retry",
            0.5,
            0.5,
            "model call retried (attempt 1 of 3, rate_limited, HTTP 429), next in 0.25 s",
            None,
        ],
        ["retry", 1.0, 1.0, "model call retried", None],
    ]
    page = builder.page("t")
    assert '<span class="key mark-retry">retry</span>' in page
    assert ".mark-retry{--c:" in page
