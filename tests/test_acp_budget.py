"""Budgets enforced by the ACP provider: the caps an agent's reports allow, each report charged as it
arrives, the turn stopped once a cap is passed (here or above the run), and the budget sent on to the child.

The stub agent reports usage the way real agents do: Qwen Code's empty message chunk with ``_meta.usage``
after each model call, claude-agent-acp's ``usage_update`` with the session's cost so far and its prompt
response's ``usage``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import (
    Budget,
    ErrorCode,
    LimitHit,
    PriceTable,
    ResumableRun,
    SubagentError,
    SubagentRequest,
    SubagentResult,
    SubagentService,
    Usage,
)
from subagent.providers._acp_budget import UsageReport, known_usage_reports
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.testing import StubAgentTransport
from subagent.types import BUDGET_META_KEY
from tests.leaks import assert_no_leaks

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

WAIT = 20  # seconds: a bound on a whole run, never a sleep
FAST = {"stdin_close_timeout": 1.0, "sigterm_timeout": 1.0, "sigkill_timeout": 2.0}


def tokens(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """Qwen Code's report of one model call: an empty message chunk whose ``_meta.usage`` has its counts."""
    usage = {
        "inputTokens": input_tokens,
        "outputTokens": output_tokens,
        "totalTokens": input_tokens + output_tokens,
    }
    chunk = {
        "sessionUpdate": "agent_message_chunk",
        "content": {"type": "text", "text": ""},
        "_meta": {"usage": usage},
    }
    return {"step": "update", "update": chunk}


def cost(amount: float) -> dict[str, Any]:
    """claude-agent-acp's ``usage_update``: the context window and what the session has cost so far."""
    return {"step": "usage", "used": 1000, "size": 200_000, "cost": {"amount": amount, "currency": "USD"}}


def say(text: str) -> dict[str, Any]:
    return {"step": "message", "text": text}


def stub_provider(
    scenario: dict[str, Any],
    tmp_path: Path,
    *,
    reports: tuple[UsageReport, ...] = ("tokens", "cost"),
    **options: Any,
) -> AcpProvider:
    """A provider whose agent is the stub, played in process, reporting ``reports``."""
    transport = StubAgentTransport(
        scenario, stdin_close_timeout=FAST["stdin_close_timeout"], sigterm_timeout=FAST["sigterm_timeout"]
    )
    options.setdefault("name", "acp")
    return AcpProvider(
        ["stub-agent"],
        cwd=tmp_path,
        transport=transport,
        reports_usage=reports,
        permission="allow",
        **options,
    )


def process_provider(scenario: dict[str, Any], tmp_path: Path, **options: Any) -> AcpProvider:
    """A provider whose agent is the stub as a real child process."""
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    command = [sys.executable, "-m", "subagent.testing.stub_agent", "--scenario", str(path)]
    options.setdefault("reports_usage", ("tokens", "cost"))
    return AcpProvider(command, cwd=tmp_path, process_options=FAST, **options)


async def run_with(provider: AcpProvider, budget: Budget, *resumes: str) -> tuple[list[SubagentResult], str]:
    """Run one request under ``budget`` through a service, then ``resumes``; the results and the run's id."""
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go", budget=budget)) as run:
            with anyio.fail_after(WAIT):
                results = [await run.result()]
                assert isinstance(run, ResumableRun)
                results.extend([await run.resume(prompt) for prompt in resumes])
            return results, run.id


# -- what can be enforced ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "reports"),
    [
        (["npx", "-y", "@agentclientprotocol/claude-agent-acp@0.101.0"], {"tokens", "cost"}),
        (
            ["node", "/opt/agents/node_modules/@zed-industries/claude-code-acp/dist/index.js"],
            {"tokens", "cost"},
        ),
        (["gemini", "--experimental-acp"], {"tokens"}),
        (["node", "/opt/node_modules/@qwen-code/qwen-code/cli.js", "--acp"], {"tokens"}),
        (["qwen", "--acp"], {"tokens"}),
        (["opencode", "acp"], {"cost"}),
        (["npx", "@zed-industries/codex-acp"], set()),
        (["subagent", "serve", "--model", "m"], {"tokens"}),
        ([sys.executable, "-m", "subagent", "serve", "--script", "s.json"], {"tokens"}),
        ([sys.executable, "-m", "subagent.testing.stub_agent"], set()),
    ],
)
def test_what_an_agent_reports_is_looked_up_by_its_command(command: list[str], reports: set[str]) -> None:
    assert known_usage_reports(command) == reports


@pytest.mark.parametrize(
    ("reports", "caps"),
    [
        (None, {"max_tokens", "max_cost", "max_seconds", "max_tool_calls"}),  # claude-agent-acp, by its name
        ((), {"max_seconds", "max_tool_calls"}),
        # Tokens can be priced by the service's table: max_cost too.
        (("tokens",), {"max_tokens", "max_cost", "max_seconds", "max_tool_calls"}),
        (("cost",), {"max_cost", "max_seconds", "max_tool_calls"}),
    ],
)
def test_the_caps_enforced_are_the_ones_the_agents_reports_cover_and_never_max_turns(
    reports: tuple[str, ...] | None, caps: set[str]
) -> None:
    provider = AcpProvider(["npx", "@agentclientprotocol/claude-agent-acp"], reports_usage=reports)  # type: ignore[arg-type]
    assert provider.capabilities.budget == caps


def test_reports_usage_must_name_tokens_or_cost() -> None:
    with pytest.raises(ValueError, match=r"unknown usage reports \['turns'\]"):
        AcpProvider(["agent"], reports_usage=["tokens", "turns"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="not the string 'tokens'"):
        AcpProvider(["agent"], reports_usage="tokens")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("budget", "cap"),
    [(Budget(max_turns=3), "max_turns"), (Budget(max_seconds=60, max_tokens=1000), "max_tokens")],
)
async def test_a_cap_the_agent_cannot_be_held_to_is_refused_before_any_process_starts(
    tmp_path: Path, budget: Budget, cap: str
) -> None:
    marker = tmp_path / "spawned"
    # An agent that reports no tokens (codex-acp): had it been started, it would have left the marker.
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()", "codex-acp"]
    provider = AcpProvider(command, cwd=tmp_path, process_options=FAST)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        with pytest.raises(SubagentError) as caught:
            service.start("acp", SubagentRequest(prompt="go", budget=budget))
        assert service.live_runs == ()
    assert caught.value.code is ErrorCode.UNSUPPORTED_CAPABILITY
    assert caught.value.feature == cap
    assert provider.running == 0
    assert not marker.exists()


async def test_a_provider_used_without_a_service_refuses_max_turns_itself(tmp_path: Path) -> None:
    provider = stub_provider({}, tmp_path)
    async with assert_no_leaks(), anyio.create_task_group() as task_group:
        with pytest.raises(SubagentError) as caught:
            provider.start(SubagentRequest(prompt="go", budget=Budget(max_turns=1)), task_group)
    assert caught.value.code is ErrorCode.UNSUPPORTED_CAPABILITY
    assert caught.value.feature == "max_turns"
    assert "an agent's model calls are not visible over ACP" in str(caught.value)
    assert provider.running == 0


# -- each cap stops the run ----------------------------------------------------------------------------------


async def test_a_run_over_its_token_cap_ends_budget_with_its_output_and_usage_kept(tmp_path: Path) -> None:
    scenario = {
        "turns": [
            [say("Reading. "), tokens(40, 10), say("Writing. "), tokens(40, 10), {"step": "wait_for_cancel"}]
        ]
    }
    (result,), run_id = await run_with(stub_provider(scenario, tmp_path), Budget(max_tokens=80))
    assert result.stop_reason == "budget"
    assert result.limit == LimitHit("max_tokens", allowed=80, spent=100, owner=run_id)
    assert result.limit.spent == 100
    assert result.limit.spent - 80 <= 50  # the overshoot: at most the usage between two reports
    assert result.output == "Reading. Writing. "
    assert result.output_final is False
    assert result.usage == Usage(input_tokens=80, output_tokens=20, total_tokens=100)
    assert (
        result.error == f"stopped by its budget: max_tokens: 100 spent of 80 tokens (the budget of {run_id})"
    )
    assert result.budget == Budget(max_tokens=80)
    assert result.spent is not None
    assert result.spent.tokens == 100


async def test_a_run_over_its_cost_cap_ends_budget_charged_by_the_increase_of_the_sessions_cost(
    tmp_path: Path,
) -> None:
    # The session's cost is cumulative: 0.2 after the first turn, 0.45 then 0.6 in the second.
    scenario = {
        "turns": [
            [say("One."), cost(0.1), cost(0.2), {"step": "stop", "reason": "end_turn"}],
            [say("Two. "), cost(0.45), say("More. "), cost(0.6), {"step": "wait_for_cancel"}],
        ]
    }
    (first, second), run_id = await run_with(stub_provider(scenario, tmp_path), Budget(max_cost=0.5), "again")
    assert first.stop_reason == "completed"
    assert first.output == "One."
    assert first.spent is not None
    assert first.spent.cost == pytest.approx(0.2)
    assert second.stop_reason == "budget"
    assert second.limit == LimitHit("max_cost", allowed=0.5, spent=0.6, owner=run_id)
    assert second.limit.spent == pytest.approx(0.6)  # 0.6, not 0.2 + 0.45 + 0.6: the increases only
    assert second.output == "Two. More. "
    assert second.output_final is False
    assert second.usage == Usage(context_used=1000, context_size=200_000, cost=0.6, cost_currency="USD")
    assert second.spent is not None
    assert second.spent.cost_currency == "USD"


async def test_a_run_over_its_tool_call_cap_ends_budget_and_the_question_past_the_cap_is_denied(
    tmp_path: Path,
) -> None:
    permission = {
        "step": "permission",
        "toolCall": {"toolCallId": "call-3", "title": "rm -rf build"},
        "branches": {"allow": [say("allowed. ")], "reject": [say("refused. ")]},
    }
    scenario = {
        "turns": [
            [
                {"step": "tool_call", "toolCallId": "call-1", "title": "ls"},
                {"step": "tool_call_update", "toolCallId": "call-1", "status": "completed"},
                {"step": "tool_call", "toolCallId": "call-2", "title": "cat"},
                say("Cleaning: "),
                permission,
                {"step": "wait_for_cancel"},
            ]
        ]
    }
    (result,), run_id = await run_with(stub_provider(scenario, tmp_path), Budget(max_tool_calls=2))
    assert result.stop_reason == "budget"
    assert result.limit == LimitHit("max_tool_calls", allowed=2, spent=3, owner=run_id)
    assert result.output == "Cleaning: refused. "  # the policy is allow: the budget said no
    assert result.spent is not None
    assert result.spent.tool_calls == 3


async def test_a_run_past_its_deadline_ends_budget_with_what_it_said_so_far(tmp_path: Path) -> None:
    scenario = {"turns": [[say("Thinking hard..."), {"step": "wait_for_cancel"}]]}
    (result,), run_id = await run_with(stub_provider(scenario, tmp_path), Budget(max_seconds=0.3))
    assert result.stop_reason == "budget"
    assert result.limit == LimitHit("max_seconds", allowed=0.3, spent=0.3, owner=run_id)
    assert result.limit.spent >= 0.3
    assert result.output == "Thinking hard..."
    assert result.output_final is False


async def test_tokens_reported_only_at_the_end_of_a_turn_are_charged_once_and_the_next_turn_is_not_sent(
    tmp_path: Path,
) -> None:
    # As claude-agent-acp and Gemini CLI report tokens: once, in the prompt response. Qwen's chunk
    # counts come first here, and the response repeats them plus the last call: only the rest is charged.
    response_usage = {"inputTokens": 90, "outputTokens": 30, "totalTokens": 120}
    scenario = {
        "turns": [
            [
                say("Done: 42."),
                tokens(40, 10),
                {"step": "stop", "reason": "end_turn", "usage": response_usage},
            ],
            [say("never")],
        ]
    }
    (first, second), run_id = await run_with(
        stub_provider(scenario, tmp_path), Budget(max_tokens=100), "more"
    )
    # The agent completed the turn itself: its answer is whole, and the spent shows the overshoot.
    assert first.stop_reason == "completed"
    assert first.limit is None
    assert first.output == "Done: 42."
    assert first.output_final is True
    assert first.spent is not None
    assert first.spent.tokens == 120
    assert first.usage == Usage(input_tokens=90, output_tokens=30, total_tokens=120)
    # A resumed turn of a spent run is not sent at all.
    assert second.stop_reason == "budget"
    assert second.limit == LimitHit("max_tokens", allowed=100, spent=120, owner=run_id)
    assert second.output == ""
    assert second.usage is None


async def test_a_resumed_turn_is_charged_and_stopped_too(tmp_path: Path) -> None:
    scenario = {
        "turns": [
            [say("First."), tokens(30, 10), {"step": "stop", "reason": "end_turn"}],
            [say("Second. "), tokens(30, 10), {"step": "wait_for_cancel"}],
        ]
    }
    (first, second), run_id = await run_with(
        stub_provider(scenario, tmp_path), Budget(max_tokens=60), "again"
    )
    assert first.stop_reason == "completed"
    assert first.spent is not None
    assert first.spent.tokens == 40
    assert second.stop_reason == "budget"
    assert second.limit == LimitHit("max_tokens", allowed=60, spent=80, owner=run_id)
    assert second.output == "Second. "
    assert second.usage == Usage(input_tokens=30, output_tokens=10, total_tokens=40)


# -- agents that do not stop -------------------------------------------------------------------------------


async def test_an_agent_ignoring_the_budget_cancel_is_torn_down_and_still_ends_budget(tmp_path: Path) -> None:
    scenario = {"turns": [[say("Partial answer"), tokens(100, 50), {"step": "hang"}]]}
    provider = process_provider(scenario, tmp_path, cancel_grace=0.5)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        request = SubagentRequest(prompt="go", budget=Budget(max_tokens=100))
        async with service.start("acp", request) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
                acp_run = run.provider_run
                assert isinstance(acp_run, AcpRun)
                await acp_run.wait_child_exited()
            assert result.stop_reason == "budget"
            assert result.limit == LimitHit("max_tokens", allowed=100, spent=150, owner=run.id)
            assert result.output == "Partial answer"
            assert result.output_final is False
            assert result.usage == Usage(input_tokens=100, output_tokens=50, total_tokens=150)
            assert acp_run.exit_info is not None  # torn down, not waited for


async def test_an_agent_answering_end_turn_after_the_budget_cancel_still_ends_budget(tmp_path: Path) -> None:
    scenario = {
        "turns": [
            [
                say("Half "),
                tokens(60, 0),
                {"step": "wait_for_cancel", "then": "continue"},
                say("and the rest."),
                {"step": "stop", "reason": "end_turn"},
            ]
        ]
    }
    (result,), run_id = await run_with(stub_provider(scenario, tmp_path), Budget(max_tokens=50))
    assert result.stop_reason == "budget"
    assert result.limit == LimitHit("max_tokens", allowed=50, spent=60, owner=run_id)
    assert result.output == "Half and the rest."
    assert result.output_final is True  # the agent said its turn ended: its output is its final message


# -- across the tree and the process boundary -------------------------------------------------------------


async def test_a_child_acp_run_is_stopped_by_its_parents_cap(tmp_path: Path) -> None:
    parent_scenario = {"turns": [[say("Delegating."), tokens(30, 0), {"step": "wait_for_cancel"}]]}
    child_scenario = {
        "turns": [[say("Child at work. "), tokens(50, 0), tokens(50, 0), {"step": "wait_for_cancel"}]]
    }
    parent_provider = stub_provider(parent_scenario, tmp_path, name="parent")
    child_provider = stub_provider(child_scenario, tmp_path, name="child")
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(parent_provider)
        service.register_provider(child_provider)
        parent_request = SubagentRequest(prompt="lead", budget=Budget(max_tokens=100))
        async with service.start("parent", parent_request) as parent:
            with anyio.fail_after(WAIT):
                await parent.started()
                async with service.start(
                    "child", SubagentRequest(prompt="help", parent_id=parent.id)
                ) as child:
                    child_result = await child.result()
                parent_result = await parent.result()
    hit = LimitHit("max_tokens", allowed=100, spent=130, owner=parent.id)
    assert child_result.stop_reason == "budget"
    assert child_result.limit == hit
    assert child_result.output == "Child at work. "
    assert child_result.budget is not None
    assert child_result.budget.max_tokens is not None
    assert child_result.spent is not None
    assert child_result.spent.tokens == 100
    assert parent_result.stop_reason == "budget"
    assert parent_result.limit == hit
    assert parent_result.output == "Delegating."
    assert parent_result.spent is not None
    assert parent_result.spent.tokens == 130


def session_new_meta(transport: StubAgentTransport) -> dict[str, Any]:
    (new,) = [message for message in transport.sent_messages() if message.get("method") == "session/new"]
    meta: dict[str, Any] = new["params"]["_meta"]
    return meta


async def test_the_budget_left_is_sent_in_session_new(tmp_path: Path) -> None:
    parent_scenario = {"turns": [[tokens(300, 0), {"step": "wait_for_cancel"}]]}
    parent_transport = StubAgentTransport(parent_scenario, record_sent=True)
    child_transport = StubAgentTransport({"turns": [[say("ok")]]}, record_sent=True)
    parent_provider = AcpProvider(
        ["stub"], name="parent", cwd=tmp_path, transport=parent_transport, reports_usage=["tokens", "cost"]
    )
    child_provider = AcpProvider(
        ["stub"], name="child", cwd=tmp_path, transport=child_transport, reports_usage=["tokens", "cost"]
    )
    budget = Budget(max_tokens=1000, max_cost=0.5, max_tool_calls=3)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(parent_provider)
        service.register_provider(child_provider)
        async with service.start("parent", SubagentRequest(prompt="lead", budget=budget)) as parent:
            with anyio.fail_after(WAIT):
                await parent.started()
                acp_parent = parent.provider_run
                assert isinstance(acp_parent, AcpRun)
                reported = anyio.Event()
                acp_parent.on_update(lambda update: reported.set())
                await reported.wait()
                child_request = SubagentRequest(
                    prompt="help", parent_id=parent.id, budget=Budget(max_tool_calls=2)
                )
                async with service.start("child", child_request) as child:
                    assert (await child.result()).output == "ok"
                await parent.cancel()
    assert session_new_meta(parent_transport)[BUDGET_META_KEY] == {
        "maxTokens": 1000,
        "maxCost": 0.5,
        "maxToolCalls": 3,
    }
    # What the parent had left once it spent 300 tokens, with the child's own tighter cap.
    assert session_new_meta(child_transport) == {
        BUDGET_META_KEY: {"maxTokens": 700, "maxCost": 0.5, "maxToolCalls": 2}
    }


async def test_a_run_with_a_deadline_is_sent_the_seconds_it_has_left(tmp_path: Path) -> None:
    transport = StubAgentTransport({"turns": [[say("ok")]]}, record_sent=True)
    provider = AcpProvider(["stub"], cwd=tmp_path, transport=transport, reports_usage=())
    (result,), _ = await run_with(provider, Budget(max_seconds=30))
    assert result.stop_reason == "completed"
    (key, left), *rest = session_new_meta(transport)[BUDGET_META_KEY].items()
    assert (key, rest) == ("maxSeconds", [])
    assert 0 < left <= 30


async def test_a_run_without_a_budget_is_sent_no_budget(tmp_path: Path) -> None:
    transport = StubAgentTransport({"turns": [[say("ok")]]}, record_sent=True)
    provider = AcpProvider(["stub"], cwd=tmp_path, transport=transport)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
    assert result.stop_reason == "completed"
    assert result.budget is None
    (new,) = [message for message in transport.sent_messages() if message.get("method") == "session/new"]
    assert BUDGET_META_KEY not in (new["params"].get("_meta") or {})


async def test_a_provider_used_without_a_service_fills_in_the_budget_and_the_spent(tmp_path: Path) -> None:
    scenario = {"turns": [[say("Short "), tokens(20, 5), tokens(20, 5), {"step": "wait_for_cancel"}]]}
    provider = stub_provider(scenario, tmp_path)
    async with assert_no_leaks(), anyio.create_task_group() as task_group:
        run = provider.start(SubagentRequest(prompt="go", budget=Budget(max_tokens=40)), task_group)
        async with run:
            with anyio.fail_after(WAIT):
                result = await run.result()
    assert result.stop_reason == "budget"
    assert result.limit == LimitHit("max_tokens", allowed=40, spent=50, owner=None)
    assert result.budget == Budget(max_tokens=40)
    assert result.spent is not None
    assert result.spent.tokens == 50
    assert result.output == "Short "


# -- a cost cap over an agent that reports tokens only: priced by the service's table ------------------------

MODEL_OPTION = {
    "type": "select",
    "id": "model",
    "name": "Model",
    "category": "model",
    "currentValue": "house-model-2",
    "options": [{"value": "house-model-2", "name": "House"}],
}
HOUSE_PRICES = PriceTable({"house-model": {"input": 1_000.0, "output": 4_000.0}}, currency="EUR")


async def test_an_agent_reporting_tokens_only_is_held_to_a_cost_cap_by_the_price_of_its_sessions_model(
    tmp_path: Path,
) -> None:
    scenario = {
        "newSession": {"configOptions": [MODEL_OPTION]},
        "turns": [[say("One."), tokens(100, 50), say("Two."), tokens(100, 50), {"step": "wait_for_cancel"}]],
    }
    provider = stub_provider(scenario, tmp_path, reports=("tokens",))
    async with assert_no_leaks(), SubagentService(prices=HOUSE_PRICES) as service:
        service.register_provider(provider)
        async with service.start("acp", SubagentRequest(prompt="go", budget=Budget(max_cost=0.5))) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
    # Each report costs 100 x 1,000 + 50 x 4,000 per million: 0.3 EUR; the second passes the cap.
    assert result.stop_reason == "budget"
    assert result.limit == LimitHit("max_cost", allowed=0.5, spent=0.6, owner=run.id)
    assert result.limit.spent == pytest.approx(0.6)
    assert result.spent is not None
    assert (result.spent.cost_currency, result.spent.tokens) == ("EUR", 300)
    assert result.output == "One.Two."


async def test_a_cost_cap_over_an_agent_reporting_no_cost_is_refused_without_a_price_table(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "spawned"
    provider = AcpProvider(["sh", "-c", f"touch {marker}"], cwd=tmp_path, reports_usage=("tokens",))
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        with pytest.raises(SubagentError) as refused:
            service.start("acp", SubagentRequest(prompt="go", budget=Budget(max_cost=1.0)))
    assert refused.value.code is ErrorCode.UNSUPPORTED_CAPABILITY
    assert refused.value.feature == "max_cost"
    assert "reports no cost, and the service has no price table" in refused.value.message
    assert not marker.exists()


async def test_a_cost_cap_fails_the_start_when_the_table_has_no_price_for_the_sessions_model(
    tmp_path: Path,
) -> None:
    scenario = {
        "newSession": {"configOptions": [{**MODEL_OPTION, "currentValue": "unpriced"}]},
        "turns": [[say("x")]],
    }
    provider = stub_provider(scenario, tmp_path, reports=("tokens",))
    async with assert_no_leaks(), SubagentService(prices=HOUSE_PRICES) as service:
        service.register_provider(provider)
        async with service.start("acp", SubagentRequest(prompt="go", budget=Budget(max_cost=1.0))) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as failed:
                await run.started()
    assert failed.value.code is ErrorCode.START_FAILED
    assert (
        "cannot be held to max_cost: it reports no cost, and the service's price table has no price for "
        "its model 'unpriced'" in failed.value.message
    )
