"""`subagent serve` and budgets: the budget a client sends in ``session/new`` caps the session's whole
tree, and a turn it stopped is answered so that any client reads a limit, and ours reads the stop reason
``budget``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import Budget, LimitHit, SubagentRequest, SubagentResult, SubagentService, Usage
from subagent._budget_meta import budget_from_meta, budget_to_meta
from subagent.acp import schema
from subagent.providers._acp_budget import SERVE_USAGE, known_usage_reports
from subagent.providers.acp import AcpProvider
from subagent.runtime import Reply, ScriptedLlm, When
from subagent.runtime._inprocess_agent import Agent
from subagent.runtime._scripted import call
from subagent.testing import StubAgentTransport
from subagent.types import BUDGET_META_KEY, RUN_META_KEY
from tests.leaks import assert_no_leaks
from tests.test_serve import WAIT, served

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]


# -- the budget on the wire ---------------------------------------------------------------------------------


def test_a_budget_goes_on_the_wire_in_camel_case_and_comes_back_unchanged() -> None:
    budget = Budget(max_tokens=700, max_cost=0.25, max_seconds=12.5, max_tool_calls=3, max_turns=4)
    wire = budget_to_meta(budget)
    assert wire == {"maxTokens": 700, "maxCost": 0.25, "maxSeconds": 12.5, "maxToolCalls": 3, "maxTurns": 4}
    assert budget_from_meta({BUDGET_META_KEY: wire}) == budget
    assert budget_from_meta({BUDGET_META_KEY: {}}) is None
    assert budget_from_meta({"other": 1}) is None
    assert budget_from_meta(None) is None


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ([1000], "not an object"),
        ({"maxTokens": 10, "maxWidgets": 2}, "unknown keys ['maxWidgets']"),
        ({"maxTokens": -1}, "max_tokens must be >= 0 and finite, got -1"),
        ({"maxToolCalls": "3"}, "max_tool_calls must be a whole number, not '3'"),
    ],
)
def test_a_malformed_budget_is_ignored_whole_and_said_so(
    raw: Any, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert budget_from_meta({BUDGET_META_KEY: raw}) is None
    assert f"ignoring a malformed {BUDGET_META_KEY} in session/new ({why})" in caplog.text


async def test_a_session_sent_a_malformed_budget_is_served_without_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with served(ScriptedLlm(["Fine."])) as (handler, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path, meta={BUDGET_META_KEY: {"maxTokens": "lots"}})
            turn = await session.prompt("hello")
        assert handler.sessions[session.session_id].budget is None
    assert turn.stop_reason == "end_turn"
    assert turn.output == "Fine."
    assert "ignoring a malformed subagent-seam/budget in session/new" in caplog.text


# -- what serve reports, and how it answers a turn its budget stopped ----------------------------------


def test_serve_is_known_to_report_tokens_only() -> None:
    assert {"tokens"} == SERVE_USAGE
    assert known_usage_reports(["subagent", "serve", "--model", "m"]) == SERVE_USAGE
    # Its tokens are priced by the client's price table, for a cost cap.
    assert AcpProvider(["subagent", "serve"]).capabilities.budget == {
        "max_tokens",
        "max_cost",
        "max_seconds",
        "max_tool_calls",
    }


async def test_serve_reports_the_tokens_it_is_known_for_and_no_cost(tmp_path: Path) -> None:
    llm = ScriptedLlm([Reply(text="Done.", usage=Usage(input_tokens=12, output_tokens=3))])
    async with served(llm) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("hello")
    assert turn.usage == {"inputTokens": 12, "outputTokens": 3, "totalTokens": 15}


@pytest.mark.parametrize(
    ("hit", "stop_reason"),
    [
        (LimitHit("max_tokens", allowed=50, spent=80), "max_tokens"),
        (LimitHit("max_cost", allowed=0.5, spent=0.75), "max_turn_requests"),
        (LimitHit("max_seconds", allowed=10, spent=10.5), "max_turn_requests"),
        (LimitHit("max_tool_calls", allowed=2, spent=3), "max_turn_requests"),
    ],
)
async def test_a_turn_its_budget_stopped_is_answered_with_a_limit_and_the_cap_in_meta(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hit: LimitHit, stop_reason: str
) -> None:
    stopped = SubagentResult(
        output="Half an answer",
        stop_reason="budget",
        usage=Usage(input_tokens=70, output_tokens=10),
        limit=hit,
        output_final=False,
    )

    async def run_turn(self: Agent, prompt: str, **_: Any) -> SubagentResult:
        return stopped

    monkeypatch.setattr(Agent, "run_turn", run_turn)
    async with served(ScriptedLlm()) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
    assert turn.stop_reason == stop_reason
    assert turn.usage == {"inputTokens": 70, "outputTokens": 10, "totalTokens": 80}
    assert turn.meta == {BUDGET_META_KEY: {"limit": hit.limit, "allowed": hit.allowed, "spent": hit.spent}}


async def test_our_client_reads_a_served_budget_stop_back_as_budget_with_the_limit(tmp_path: Path) -> None:
    served_hit = {"limit": "max_tool_calls", "allowed": 2, "spent": 3}
    stop = {"step": "stop", "reason": "max_turn_requests", "meta": {BUDGET_META_KEY: served_hit}}
    transport = StubAgentTransport({"turns": [[{"step": "message", "text": "So far."}, stop]]})
    provider = AcpProvider(["subagent", "serve"], cwd=tmp_path, transport=transport)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        request = SubagentRequest(prompt="go", budget=Budget(max_tool_calls=2))
        async with service.start("acp", request) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
    assert result.stop_reason == "budget"
    assert result.limit == LimitHit("max_tool_calls", allowed=2, spent=3, owner=run.id)
    assert result.output == "So far."
    assert result.output_final is False
    assert (
        result.error
        == f"stopped by its budget: max_tool_calls: 3 spent of 2 tool calls (the budget of {run.id})"
    )


async def test_a_served_budget_stop_reads_as_budget_without_a_budget_of_our_own(tmp_path: Path) -> None:
    # Stopped before a model call that could not fit: nothing spent yet, and what the call needed.
    served_hit = {"limit": "max_tokens", "allowed": 50, "spent": 0, "needed": 120}
    stop = {"step": "stop", "reason": "max_tokens", "meta": {BUDGET_META_KEY: served_hit}}
    transport = StubAgentTransport({"turns": [[stop]]})
    provider = AcpProvider(["subagent", "serve"], cwd=tmp_path, transport=transport)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
    assert result.stop_reason == "budget"
    assert result.limit == LimitHit("max_tokens", allowed=50, spent=0, owner=None)
    assert (result.limit.spent, result.limit.needed) == (0, 120)
    assert (
        result.error
        == "stopped by its budget: max_tokens: 0 spent of 50 tokens; the next step needed 120 tokens more"
    )


# -- serve enforcing the budget it was sent ----------------------------------------------------------------


async def test_serve_stops_a_session_over_the_token_budget_it_was_sent(tmp_path: Path) -> None:
    llm = ScriptedLlm(
        [Reply(text="A long answer", usage=Usage(input_tokens=90, output_tokens=30))],
        fallback=Reply(text="never"),
    )
    async with served(llm) as (handler, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path, meta={BUDGET_META_KEY: {"maxTokens": 50}})
            account = handler.sessions[session.session_id].budget
            assert account is not None
            assert account.budget == Budget(max_tokens=50)
            turn = await session.prompt("go")
    assert turn.stop_reason == "max_tokens"
    assert turn.meta is not None
    sent = turn.meta[BUDGET_META_KEY]
    # Stopped before the call: its input alone (the prompt and the tools' definitions) could not fit.
    assert (sent["limit"], sent["allowed"], sent["spent"]) == ("max_tokens", 50, 0)
    assert sent["needed"] > 50
    assert llm.requests == []


async def test_a_served_sessions_subagents_are_started_below_its_budget(tmp_path: Path) -> None:
    async with served(ScriptedLlm(fallback="ok")) as (handler, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path, meta={BUDGET_META_KEY: {"maxToolCalls": 5}})
        account = handler.sessions[session.session_id].budget
        assert account is not None
        tool = handler.sessions[session.session_id].subagent_tool
        assert tool is not None
        async with handler.service.start(
            "spawn", SubagentRequest(prompt="help", parent_id=session.session_id)
        ) as direct:
            # Not through the session's tool: a run started on the service itself is not capped.
            assert direct.request.account is None
        # The session's tool has the session's account as its ceiling: what it starts is charged to it.
        assert tool.budget_account is account
        request = SubagentRequest(prompt="help", parent_id=session.session_id)
        run = handler.service.start("spawn", request, within=tool.budget_account)
        async with run:
            assert run.request.account is not None
            assert run.request.account.parent is account
            assert run.request.account.budget == Budget(max_tool_calls=5)


async def test_a_served_run_stopped_by_the_sessions_budget_ends_with_the_cap_in_its_row(
    tmp_path: Path,
) -> None:
    llm = ScriptedLlm(
        [
            Reply(
                tool_calls=[call("subagent", {"provider": "spawn", "prompt": "count"}, id="call-1")],
                usage=Usage(input_tokens=10, output_tokens=5),
                when=When(last_user_contains="go", after_tool_result=False),
            ),
            # Far more output than the session has left: the call is bounded to what is left, and cut.
            Reply(
                "1, 2, 3, " * 50,
                usage=Usage(input_tokens=10, output_tokens=1_000_000),
                when=When(last_user_contains="count"),
            ),
        ],
        fallback=Reply("Done.", usage=Usage(input_tokens=10, output_tokens=5)),
    )
    async with served(llm) as (_handler, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path, meta={BUDGET_META_KEY: {"maxTokens": 50_000}})
            turn = await session.prompt("go")
    ends = [
        update
        for update in turn.updates
        if isinstance(update, schema.ToolCallProgress)
        and update.tool_call_id.startswith("run/")
        and update.status
    ]
    assert len(ends) == 1
    row = (ends[0].meta or {})[RUN_META_KEY]
    assert (row["state"], row["stopReason"]) == ("failed", "budget")
    assert row["limit"] == {
        "limit": "max_tokens",
        "allowed": 50_000,
        "spent": row["limit"]["spent"],
        "owner": session.session_id,
        "needed": None,
    }
    assert row["limit"]["spent"] <= 50_000  # bounded to what was left: not passed
    assert row["budget"]["max_tokens"] <= 50_000
    assert row["spent"]["tokens"] == row["limit"]["spent"] - 15  # the session's own first call is above it
