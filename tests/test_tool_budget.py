"""Budgets through the model-facing `subagent` tool: the host's ceiling over every child started
through it, the remaining budget in its description, a call's own tighter `budget`, and a child
stopped by its budget reported to the model (foreground and background), on asyncio and trio.

The children are fake runs whose autopilot charges the run's budget account and ends ``budget`` when
a cap is passed: what an enforcing provider does (the in-process providers will, once they enforce).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from subagent import (
    BUDGET_FIELDS,
    Budget,
    ErrorCode,
    LimitHit,
    SubagentCapabilities,
    SubagentResult,
    SubagentService,
    Usage,
)
from subagent.delegation import BackgroundOptions, Notice
from subagent.testing.fakes import Autopilot, FakeRun
from subagent.tool import SubagentTool
from tests.fakes import FakeProvider

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

WAIT = 5  # seconds; a bound on every wait, never a sleep

ENFORCES_ALL = SubagentCapabilities(budget=frozenset(BUDGET_FIELDS))


def spends(tokens: int, output: str = "partial answer") -> Autopilot:
    """Runs that charge ``tokens`` to their budget account, then end ``budget`` if that passed a cap,
    else ``completed`` with ``output``."""

    def drive(run: FakeRun) -> None:
        run.make_ready()
        account = run.request.account
        assert account is not None, "a run under a ceiling has an account"
        hit = account.charge(tokens=tokens)
        run.finish(
            SubagentResult(
                output=output,
                stop_reason="completed" if hit is None else "budget",
                usage=Usage(input_tokens=tokens, output_tokens=0),
            )
        )

    return drive


@asynccontextmanager
async def open_service(*providers: FakeProvider) -> AsyncIterator[SubagentService]:
    async with SubagentService() as service:
        for provider in providers:
            service.register_provider(provider)
        yield service
        assert service.live_runs == ()


async def test_a_child_that_passes_the_ceiling_is_an_error_for_the_model_with_its_spent_and_limit() -> None:
    provider = FakeProvider(capabilities=ENFORCES_ALL, autopilot=spends(1_200))
    async with open_service(provider) as service:
        with SubagentTool(service, budget=Budget(max_tokens=1_000)) as tool:
            with anyio.fail_after(WAIT):
                result = await tool.execute({"prompt": "count", "provider": "fake"})
    assert result.is_error
    assert result.stop_reason == "budget"
    assert result.limit == LimitHit(limit="max_tokens", allowed=1_000, spent=1_200, owner=None)
    assert result.render() == (
        "Error: the subagent stopped before finishing (stop reason: budget): it reached a cap of its "
        "budget and was stopped (max_tokens: 1,200 spent of 1,000 tokens). Spent: 1,200 of 1,000 tokens."
        "\n\nPartial output:\npartial answer"
    )
    assert result.spent is not None
    assert result.spent.tokens == 1_200


async def test_the_description_shows_what_is_left_of_the_ceiling_as_of_each_read() -> None:
    provider = FakeProvider(capabilities=ENFORCES_ALL, autopilot=spends(300, "done"))
    async with open_service(provider) as service:
        with SubagentTool(service, budget=Budget(max_tokens=1_000, max_tool_calls=20)) as tool:
            agent_tool = tool.for_agents()
            note = (
                "Budget: every subagent you start, with every subagent it starts, shares one budget of "
                "1,000 tokens, 20 tool calls. Left now: {left}. A subagent that passes a cap is stopped, "
                "and its result is an error with its partial output."
            )
            before = tool.definition.description
            assert before.endswith("\n\n" + note.format(left="1,000 tokens, 20 tool calls"))
            assert agent_tool.spec.description == before
            version = tool.version
            with anyio.fail_after(WAIT):
                result = await tool.execute({"prompt": "count", "provider": "fake"})
            assert not result.is_error
            after = tool.definition.description
            assert after.endswith("\n\n" + note.format(left="700 tokens, 20 tool calls"))
            assert agent_tool.spec.description == after  # the in-process agent's spec re-reads it
            assert tool.version == version  # spending is no change of the registry
            assert tool.budget == Budget(max_tokens=1_000, max_tool_calls=20)
            assert tool.budget_account is not None
            assert tool.budget_account.spent().tokens == 300


async def test_children_started_through_the_tool_stay_under_the_ceiling_together() -> None:
    provider = FakeProvider(capabilities=ENFORCES_ALL, autopilot=spends(600, "done"))
    async with open_service(provider) as service:
        with SubagentTool(service, budget=Budget(max_tokens=1_000)) as tool:
            with anyio.fail_after(WAIT):
                first = await tool.execute({"prompt": "one", "provider": "fake"})
                second = await tool.execute({"prompt": "two", "provider": "fake"})
            assert (first.stop_reason, second.stop_reason) == ("completed", "budget")
            # The second child started under what the first left of the ceiling.
            assert second.limit == LimitHit(limit="max_tokens", allowed=1_000, spent=1_200)
            second_account = provider.runs[1].request.account
            assert second_account is not None
            assert second_account.budget == Budget(max_tokens=400)
            with anyio.fail_after(WAIT):
                third = await tool.execute({"prompt": "three", "provider": "fake"})
            assert tool.definition.description.endswith(
                "It is spent (max_tokens: 1,200 spent of 1,000 tokens): no subagent can be started. "
                "A subagent that passes a cap is stopped, and its result is an error with its partial output."
            )
    assert third.is_error
    assert third.stop_reason is None
    assert third.error_code is None
    assert third.error == (
        "no subagent was started: your budget for subagents is spent "
        "(max_tokens: 1,200 spent of 1,000 tokens)."
    )
    assert provider.start_calls == 2


async def test_a_calls_own_budget_caps_its_child_within_the_ceiling() -> None:
    provider = FakeProvider(capabilities=ENFORCES_ALL, autopilot=spends(250))
    async with open_service(provider) as service:
        with SubagentTool(service, budget=Budget(max_tokens=1_000)) as tool:
            with anyio.fail_after(WAIT):
                result = await tool.execute(
                    {"prompt": "count", "provider": "fake", "budget": {"max_tokens": 200, "max_turns": None}}
                )
    request = provider.runs[0].request
    assert request.budget == Budget(max_tokens=200)
    assert result.stop_reason == "budget"
    # The child's own cap stopped it, not the ceiling: the owner is the child's run.
    assert result.limit == LimitHit(limit="max_tokens", allowed=200, spent=250, owner=provider.runs[0].id)
    assert result.error == (
        "the subagent stopped before finishing (stop reason: budget): it reached a cap of its budget and "
        f"was stopped (max_tokens: 250 spent of 200 tokens (the budget of {provider.runs[0].id})). "
        "Spent: 250 of 200 tokens."
    )


async def test_a_calls_budget_looser_than_what_is_left_is_refused_and_starts_nothing() -> None:
    provider = FakeProvider(capabilities=ENFORCES_ALL, autopilot=spends(1))
    async with open_service(provider) as service:
        with SubagentTool(service, budget=Budget(max_tokens=1_000, max_turns=3)) as tool:
            with anyio.fail_after(WAIT):
                result = await tool.execute(
                    {
                        "prompt": "count",
                        "provider": "fake",
                        "budget": {"max_tokens": 5_000, "max_turns": 4, "max_seconds": 99.0},
                    }
                )
    assert result.is_error
    assert result.error_code is None
    assert result.error == (
        "a subagent's budget may only be tighter than what is left of yours, no subagent was started:\n"
        "- `budget.max_tokens` is 5,000 tokens, more than the 1,000 tokens left of your budget.\n"
        "- `budget.max_turns` is 4 turns, more than the 3 turns left of your budget."
    )
    assert provider.start_calls == 0


@pytest.mark.parametrize(
    ("budget", "problem"),
    [
        ({"max_tokens": -1}, "budget.max_tokens: expected an integer >= 0 or null, got -1"),
        ({"max_tokens": 1.5}, "budget.max_tokens: expected an integer >= 0 or null, got 1.5"),
        ({"max_seconds": 0}, "budget.max_seconds: expected a number > 0 or null, got 0"),
        (
            {"max_money": 1},
            'budget: unknown key "max_money"; it takes "max_tokens", "max_cost", "max_seconds", '
            '"max_tool_calls", "max_turns"',
        ),
    ],
)
async def test_a_budget_argument_that_breaks_the_schema_is_refused_in_its_words(
    budget: dict[str, object], problem: str
) -> None:
    provider = FakeProvider(capabilities=ENFORCES_ALL, autopilot=spends(1))
    async with open_service(provider) as service:
        with SubagentTool(service) as tool:
            with anyio.fail_after(WAIT):
                result = await tool.execute({"prompt": "x", "provider": "fake", "budget": budget})
    assert result.is_error
    assert result.error_code is None
    assert result.stop_reason is None
    assert result.error == f"invalid arguments, nothing was run:\n- {problem}"
    assert provider.start_calls == 0


async def test_the_schema_offers_the_caps_some_provider_enforces_and_names_who() -> None:
    tokens_only = FakeProvider(
        name="tokens", capabilities=SubagentCapabilities(budget=frozenset({"max_tokens"}))
    )
    none = FakeProvider(name="plain")
    async with open_service(none) as service:
        with SubagentTool(service) as tool:
            assert "budget" not in tool.definition.input_schema["properties"]
            assert "`budget`" not in tool.definition.description
            service.register_provider(tokens_only)
            properties = tool.definition.input_schema["properties"]
            description = tool.definition.description
    assert properties["budget"] == {
        "type": ["object", "null"],
        "description": (
            "Caps on what the subagent, with every subagent it starts, may spend; it is stopped when it "
            "passes one, and the result is an error with its partial output. A cap may only be tighter "
            "than what is left of your own budget (the tool description says what is). Leave a cap out or "
            "null for none of its own."
        ),
        "properties": {
            "max_tokens": {
                "type": ["integer", "null"],
                "minimum": 0,
                "description": (
                    'Input plus output tokens, over all its model calls. Supported only by "tokens".'
                ),
            }
        },
        "additionalProperties": False,
    }
    assert "Optional parameters: `budget` (with `max_tokens`)." in description
    assert '- "plain": starts fresh' in description
    assert "Optional parameters: none." in description


async def test_a_call_budget_a_provider_cannot_enforce_is_refused_naming_who_can() -> None:
    tokens_only = FakeProvider(
        name="tokens", capabilities=SubagentCapabilities(budget=frozenset({"max_tokens"}))
    )
    plain = FakeProvider(name="plain", autopilot=spends(1))
    async with open_service(tokens_only, plain) as service:
        with SubagentTool(service) as tool:
            with anyio.fail_after(WAIT):
                result = await tool.execute(
                    {"prompt": "x", "provider": "plain", "budget": {"max_tokens": 10}}
                )
    assert result.error_code is ErrorCode.UNSUPPORTED_CAPABILITY
    assert result.error == (
        'unsupported parameters for provider "plain", no subagent was started:\n'
        '- `max_tokens` is not supported by "plain"; providers that support it: "tokens".'
    )
    assert plain.start_calls == 0


async def test_a_ceiling_on_a_provider_that_cannot_enforce_it_refuses_the_start() -> None:
    plain = FakeProvider(name="plain", autopilot=spends(1))
    async with open_service(plain) as service:
        with SubagentTool(service, budget=Budget(max_cost=0.5)) as tool:
            with anyio.fail_after(WAIT):
                result = await tool.execute({"prompt": "x", "provider": "plain"})
    assert result.is_error
    assert result.error_code is ErrorCode.UNSUPPORTED_CAPABILITY
    assert result.error == (
        "the subagent could not be started (UNSUPPORTED_CAPABILITY): provider 'plain' cannot enforce "
        "'max_cost', and the budget of 'the root' above this run caps it"
    )
    assert plain.start_calls == 0


async def test_a_background_child_stopped_by_the_ceiling_says_so_in_its_notice() -> None:
    provider = FakeProvider(capabilities=ENFORCES_ALL, autopilot=spends(2_000))
    heard: list[Notice] = []
    got_one = anyio.Event()

    def hear(notice: Notice) -> None:
        heard.append(notice)
        got_one.set()

    async with (
        open_service(provider) as service,
        SubagentTool(
            service, budget=Budget(max_tokens=1_500), background=BackgroundOptions(), on_notice=hear
        ) as tool,
    ):
        with anyio.fail_after(WAIT):
            started = await tool.execute(
                {"prompt": "count in the background", "provider": "fake", "background": True}
            )
            await got_one.wait()
    assert not started.is_error
    [notice] = heard
    assert notice.child.state == "failed"
    assert notice.result.stop_reason == "budget"
    assert notice.result.limit == LimitHit(limit="max_tokens", allowed=1_500, spent=2_000)
    assert (
        "Error: the subagent stopped before finishing (stop reason: budget): it reached a cap of its "
        "budget and was stopped (max_tokens: 2,000 spent of 1,500 tokens). Spent: 2,000 of 1,500 tokens."
    ) in notice.text
    assert provider.runs[0].request.account is not None
    assert provider.runs[0].request.account.parent is tool.budget_account
