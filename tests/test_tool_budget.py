"""Budgets through the model-facing `subagent` tool: the host's ceiling over every child started
through it, the remaining budget in its description, a call's own tighter `budget`, and a child
stopped by its budget reported to the model (foreground and background), on asyncio and trio.

The children that spend are real in-process runs (``spawn``, ``fork``) on a scripted model whose
replies report their usage, stopped by the runtime's own enforcement. Most models here do not bound
their output by the request's ``max_tokens`` (as behind an adapter that cannot pass one): a reply's
usage is then charged whole, a call may pass a cap by its output, and every amount is exact. Where
the model does bound its output, the reservations keep the children within the ceiling together.
Argument checks that start nothing run on fake providers.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup

from subagent import (
    BUDGET_FIELDS,
    Budget,
    ErrorCode,
    LimitHit,
    SubagentCapabilities,
    SubagentRequest,
    SubagentRunEndInfo,
    SubagentService,
    Usage,
)
from subagent.delegation import BackgroundOptions, Notice
from subagent.providers._inprocess import InProcessProvider, InProcessRun
from subagent.providers.fork import ForkProvider
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import (
    Agent,
    AgentRegistry,
    CompletionRequest,
    FunctionTool,
    Reply,
    ScriptedLlm,
    When,
    call,
)
from subagent.tool import SubagentTool
from tests.fakes import FakeProvider

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

WAIT = 10  # seconds; a bound on every wait, never a sleep

ENFORCES_ALL = SubagentCapabilities(budget=frozenset(BUDGET_FIELDS))
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


class UnboundedLlm(ScriptedLlm):
    """A scripted model that ignores the request's ``max_tokens``: each reply's usage is charged whole."""

    bounds_output = False


class RecordingSpawn(SpawnProvider):
    """The spawn provider, keeping each request it was asked to start (with the run's account)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.requests: list[SubagentRequest] = []

    def start(self, request: SubagentRequest, task_group: TaskGroup) -> InProcessRun:
        self.requests.append(request)
        return super().start(request, task_group)


def work_tool(ran: list[str]) -> FunctionTool:
    def work(arguments: Any) -> str:
        ran.append("work")
        return "worked"

    return FunctionTool("work", "Do a step of work.", NO_ARGUMENTS, work)


def spending(tokens: int, text: str = "partial answer", *, when: When | None = None) -> Reply:
    """A reply that reports ``tokens`` (20 of them input) and asks for a step of work: a run whose cap
    it passes is stopped there, its work not done, its text the output so far."""
    return Reply(text, tool_calls=(call("work", {}),), usage=spent_as(tokens), when=when)


def answering(tokens: int, text: str = "done", *, when: When | None = None) -> Reply:
    """A final answer that reports ``tokens`` (20 of them input)."""
    return Reply(text, usage=spent_as(tokens), when=when)


def spent_as(tokens: int) -> Usage:
    return Usage(input_tokens=20, output_tokens=tokens - 20)


class Worker(ScriptedLlm):
    """A model that asks for a step of work at every call, reporting its input as a tokenizer making a
    token of four bytes would (never more than the runtime's estimate) and ``output_tokens`` of output:
    the reservations bound its output, so only a call cut short by what is left ends its run."""

    def __init__(self, output_tokens: int) -> None:
        super().__init__(self._answer)
        self.output_tokens = output_tokens

    def _answer(self, request: CompletionRequest) -> Reply:
        return Reply("working", tool_calls=(call("work", {}),), usage=self._usage(request))

    def _usage(self, request: CompletionRequest) -> Usage:
        size = sum(
            len(m.content.encode()) + sum(len(c.arguments.encode()) for c in m.tool_calls)
            for m in request.messages
        )
        return Usage(input_tokens=math.ceil(size / 4), output_tokens=self.output_tokens)

    def reported_tokens(self) -> int:
        """What its calls reported in all (recomputed from the requests: the responder is deterministic),
        each call's output cut to the request's ``max_tokens`` as the scripted model cuts it."""
        total = 0
        for request in self.requests:
            output = (
                self.output_tokens
                if request.max_tokens is None
                else min(self.output_tokens, request.max_tokens)
            )
            total += (self._usage(request).input_tokens or 0) + output
        return total


def running_task_ids() -> set[int]:
    return {task.id for task in anyio.get_running_tasks()}


@asynccontextmanager
async def open_service(*providers: InProcessProvider | FakeProvider) -> AsyncIterator[SubagentService]:
    """An open service with ``providers``; on exit, no run is live and no task of it is left."""
    before = running_task_ids()
    async with SubagentService() as service:
        for provider in providers:
            service.register_provider(provider)
        yield service
        assert service.live_runs == ()
    assert running_task_ids() == before


def record_ends(service: SubagentService) -> list[SubagentRunEndInfo]:
    ends: list[SubagentRunEndInfo] = []
    service.events.on("subagent/end", ends.append)
    return ends


# -- the ceiling: what every child started through the tool shares -------------------------------------


async def test_a_child_that_passes_the_ceiling_is_an_error_for_the_model_with_its_spent_and_limit() -> None:
    ran: list[str] = []
    provider = RecordingSpawn(llm=UnboundedLlm([spending(1_200)]), tools=[work_tool(ran)])
    async with open_service(provider) as service:
        with SubagentTool(service, budget=Budget(max_tokens=1_000)) as tool:
            with anyio.fail_after(WAIT):
                result = await tool.execute({"prompt": "count", "provider": "spawn"})
    assert result.is_error
    assert result.stop_reason == "budget"
    # The ceiling is the host's, not a run's: no owner.
    assert result.limit == LimitHit(limit="max_tokens", allowed=1_000, spent=1_200, owner=None)
    assert result.render() == (
        "Error: the subagent stopped before finishing (stop reason: budget): it reached a cap of its "
        "budget and was stopped (max_tokens: 1,200 spent of 1,000 tokens). Spent: 1,200 of 1,000 tokens."
        "\n\nPartial output:\npartial answer"
    )
    assert result.spent is not None
    assert (result.spent.tokens, result.spent.turns, result.spent.tool_calls) == (1_200, 1, 0)
    assert result.usage == spent_as(1_200)
    assert ran == []  # the step it asked for past the cap was not run


async def test_the_description_shows_what_is_left_of_the_ceiling_as_of_each_read() -> None:
    model = ScriptedLlm([answering(300)])  # bounds its output, by what is left of the ceiling
    provider = RecordingSpawn(llm=model)
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
                result = await tool.execute({"prompt": "count", "provider": "spawn"})
            assert (result.is_error, result.output) == (False, "done")
            after = tool.definition.description
            assert after.endswith("\n\n" + note.format(left="700 tokens, 20 tool calls"))
            assert agent_tool.spec.description == after  # the in-process agent's spec re-reads it
            assert tool.version == version  # spending is no change of the registry
            assert tool.budget == Budget(max_tokens=1_000, max_tool_calls=20)
            assert tool.budget_account is not None
            assert tool.budget_account.spent().tokens == 300
    # The child's one call was allowed the output the ceiling had left after its input.
    [request] = model.requests
    assert request.max_tokens is not None
    assert 280 <= request.max_tokens < 1_000


async def test_children_started_through_the_tool_stay_under_the_ceiling_together() -> None:
    model = UnboundedLlm(
        [
            answering(600, when=When(last_user_contains="one")),
            spending(600, when=When(last_user_contains="two")),
        ]
    )
    ran: list[str] = []
    provider = RecordingSpawn(llm=model, tools=[work_tool(ran)])
    async with open_service(provider) as service:
        with SubagentTool(service, budget=Budget(max_tokens=1_000)) as tool:
            with anyio.fail_after(WAIT):
                first = await tool.execute({"prompt": "one", "provider": "spawn"})
                second = await tool.execute({"prompt": "two", "provider": "spawn"})
            assert (first.stop_reason, second.stop_reason) == ("completed", "budget")
            # The second child started under what the first left of the ceiling, and passed it.
            assert second.limit == LimitHit(limit="max_tokens", allowed=1_000, spent=1_200)
            second_account = provider.requests[1].account
            assert second_account is not None
            assert second_account.budget == Budget(max_tokens=400)
            with anyio.fail_after(WAIT):
                third = await tool.execute({"prompt": "three", "provider": "spawn"})
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
    assert len(provider.requests) == 2
    assert len(model.requests) == 2
    assert ran == []


async def test_a_calls_own_budget_caps_its_child_within_the_ceiling() -> None:
    provider = RecordingSpawn(llm=UnboundedLlm([spending(250)]), tools=[work_tool([])])
    async with open_service(provider) as service:
        with SubagentTool(service, budget=Budget(max_tokens=1_000)) as tool:
            with anyio.fail_after(WAIT):
                result = await tool.execute(
                    {"prompt": "count", "provider": "spawn", "budget": {"max_tokens": 200, "max_turns": None}}
                )
            assert tool.budget_account is not None
            assert tool.budget_account.check() is None  # the ceiling itself is not passed
    [request] = provider.requests
    assert request.budget == Budget(max_tokens=200)
    assert result.stop_reason == "budget"
    # The child's own cap stopped it, not the ceiling: the owner is the child's run.
    assert result.run_id is not None
    assert result.limit == LimitHit(limit="max_tokens", allowed=200, spent=250, owner=result.run_id)
    assert result.error == (
        "the subagent stopped before finishing (stop reason: budget): it reached a cap of its budget and "
        f"was stopped (max_tokens: 250 spent of 200 tokens (the budget of {result.run_id})). "
        "Spent: 250 of 200 tokens."
    )


async def test_a_calls_budget_looser_than_what_is_left_is_refused_and_starts_nothing() -> None:
    provider = FakeProvider(capabilities=ENFORCES_ALL)
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
    provider = FakeProvider(capabilities=ENFORCES_ALL)
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
    plain = FakeProvider(name="plain")
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
    plain = FakeProvider(name="plain")
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


# -- background children under the ceiling ------------------------------------------------------------


async def test_a_background_child_stopped_by_the_ceiling_says_so_in_its_notice() -> None:
    ran: list[str] = []
    provider = RecordingSpawn(llm=UnboundedLlm([spending(2_000)]), tools=[work_tool(ran)])
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
                {"prompt": "count in the background", "provider": "spawn", "background": True}
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
        "\n\nPartial output:\npartial answer"
    ) in notice.text
    [request] = provider.requests
    assert request.account is not None
    assert request.account.parent is tool.budget_account
    assert ran == []


async def test_background_children_together_never_pass_the_ceiling_when_their_model_bounds_its_output() -> (
    None
):
    worker = Worker(output_tokens=150)
    ran: list[str] = []
    provider = RecordingSpawn(llm=worker, tools=[work_tool(ran)])
    heard: list[Notice] = []
    both_heard = anyio.Event()

    def hear(notice: Notice) -> None:
        heard.append(notice)
        if len(heard) == 2:
            both_heard.set()

    async with (
        open_service(provider) as service,
        SubagentTool(
            service, budget=Budget(max_tokens=2_000), background=BackgroundOptions(), on_notice=hear
        ) as tool,
    ):
        with anyio.fail_after(WAIT):
            for prompt in ("first", "second"):
                started = await tool.execute({"prompt": prompt, "provider": "spawn", "background": True})
                assert not started.is_error
            await both_heard.wait()
        ceiling = tool.budget_account
        assert ceiling is not None
        spent = ceiling.spent()
    assert [notice.result.stop_reason for notice in heard] == ["budget", "budget"]
    assert [notice.result.limit for notice in heard] == [LimitHit("max_tokens", allowed=2_000, spent=0)] * 2
    assert [request.account.parent if request.account else None for request in provider.requests] == [
        ceiling
    ] * 2
    # Every call's worst case was reserved on the ceiling first: together they stay within it.
    assert spent.tokens == worker.reported_tokens()
    assert spent.tokens <= 2_000
    assert spent.tool_calls == len(ran) >= 1
    assert spent.turns == len(worker.requests)


# -- an in-process parent whose own budget caps the children it starts through the tool ---------------


async def test_an_in_process_parent_reads_the_exact_error_of_a_child_its_call_budget_stopped() -> None:
    agents = AgentRegistry()
    model = UnboundedLlm(
        [
            Reply(
                tool_calls=(
                    call(
                        "subagent",
                        {"provider": "spawn", "prompt": "beta task", "budget": {"max_tokens": 10_000}},
                    ),
                ),
                usage=spent_as(100),
                when=When(last_user_contains="alpha", after_tool_result=False),
            ),
            spending(12_000, when=When(last_user_contains="beta")),
            answering(
                100, "beta ran out of budget", when=When(last_user_contains="alpha", after_tool_result=True)
            ),
        ]
    )
    async with open_service() as service:
        ends = record_ends(service)
        with SubagentTool(service) as tool:
            provider = RecordingSpawn(llm=model, agents=agents, tools=[tool.for_agents()])
            service.register_provider(provider)
            with anyio.fail_after(WAIT):
                async with service.start(
                    "spawn", SubagentRequest(prompt="alpha task", budget=Budget(max_tokens=50_000))
                ) as root:
                    result = await root.result()
    [child_end, root_end] = ends
    assert child_end.parent_id == root.id
    assert child_end.stop_reason == "budget"
    assert child_end.limit == LimitHit("max_tokens", allowed=10_000, spent=12_000, owner=child_end.id)
    # What the parent's model read for its call: the child's cap, whose it was, and its partial output.
    assert model.requests[-1].messages[-1].role == "tool"
    assert model.requests[-1].messages[-1].content == (
        "error: the subagent stopped before finishing (stop reason: budget): it reached a cap of its budget "
        f"and was stopped (max_tokens: 12,000 spent of 10,000 tokens (the budget of {child_end.id})). "
        "Spent: 12,000 of 10,000 tokens.\n\nPartial output:\npartial answer"
    )
    assert (result.stop_reason, result.output) == ("completed", "beta ran out of budget")
    assert result.spent is not None
    assert result.spent.tokens == 100 + 12_000 + 100  # the root's spending includes its child's
    assert root_end.limit is None
    assert agents.list() == []


async def test_a_grandchild_started_through_the_tool_is_stopped_by_the_roots_budget_with_the_whole_tree() -> (
    None
):
    agents = AgentRegistry()

    def delegating(prompt: str, to: str) -> Reply:
        return Reply(
            tool_calls=(call("subagent", {"provider": "spawn", "prompt": to}),),
            usage=spent_as(100),
            when=When(last_user_contains=prompt, after_tool_result=False),
        )

    model = UnboundedLlm(
        [
            delegating("alpha", "beta task"),
            delegating("beta", "gamma task"),
            # Past the root's cap in one call: the great-grandchild it asks for is never started.
            Reply(
                "gamma partial",
                tool_calls=(call("subagent", {"provider": "spawn", "prompt": "delta task"}),),
                usage=spent_as(30_000),
                when=When(last_user_contains="gamma"),
            ),
        ]
    )
    async with open_service() as service:
        ends = record_ends(service)
        with SubagentTool(service) as tool:
            provider = RecordingSpawn(llm=model, agents=agents, tools=[tool.for_agents()])
            service.register_provider(provider)
            with anyio.fail_after(WAIT):
                async with service.start(
                    "spawn", SubagentRequest(prompt="alpha task", budget=Budget(max_tokens=20_000))
                ) as root:
                    result = await root.result()
    root_cap = LimitHit("max_tokens", allowed=20_000, spent=30_200, owner=root.id)
    assert [request.prompt for request in provider.requests] == ["alpha task", "beta task", "gamma task"]
    child, grandchild = provider.requests[1], provider.requests[2]
    assert (child.budget, grandchild.budget) == (None, None)  # no cap of their own: the root's holds
    assert grandchild.account is not None
    # The grandchild started under what the root had left after its and the child's calls.
    assert grandchild.account.budget == Budget(max_tokens=20_000 - 200)
    [grandchild_end, child_end, root_end] = ends
    assert (grandchild_end.parent_id, child_end.parent_id, root_end.id) == (child_end.id, root.id, root.id)
    assert (grandchild_end.stop_reason, grandchild_end.limit) == ("budget", root_cap)
    assert grandchild_end.limit is not None
    assert grandchild_end.limit.spent == 30_200
    # The root's cap, once passed, stopped every run of its tree, each waiting on its child. The root's
    # call of the tool, stopped at the same moment as the child's turn, disposes the child: the child
    # still says its budget stopped it, not that it was disposed.
    stopped = "stopped by its budget: max_tokens: 30,200 spent of 20,000 tokens (the budget of {})"
    assert grandchild_end.error == stopped.format(root.id)
    assert (child_end.stop_reason, child_end.error, child_end.limit) == (
        "budget",
        stopped.format(root.id),
        root_cap,
    )
    assert (result.stop_reason, result.limit, result.output_final) == ("budget", root_cap, False)
    assert (root_end.stop_reason, root_end.limit) == ("budget", root_cap)
    assert result.spent is not None
    assert result.spent.tokens == 100 + 100 + 30_000
    assert len(model.requests) == 3  # nobody read a tool result after the cap was passed
    assert agents.list() == []


async def test_an_agent_forking_through_the_tool_reads_its_forks_budget_error_and_the_spent_ceiling() -> None:
    agents = AgentRegistry()
    model = UnboundedLlm(
        [
            Reply(
                tool_calls=(call("subagent", {"provider": "fork", "prompt": "beta task"}),),
                usage=spent_as(100),
                when=When(last_user_contains="alpha", after_tool_result=False),
            ),
            spending(60_000, when=When(last_user_contains="beta")),
            answering(100, "the fork ran out", when=When(last_user_contains="alpha", after_tool_result=True)),
        ]
    )
    async with open_service(ForkProvider(agents=agents)) as service:
        with SubagentTool(service, budget=Budget(max_tokens=50_000)) as tool:
            # The root is no run of the service (its own calls are not charged): only its fork is.
            root = Agent(llm=model, id="root", tools=[tool.for_agents()], registry=agents)
            with anyio.fail_after(WAIT):
                result = await root.run_turn("alpha task")
            await root.close()
            ceiling = tool.budget_account
            assert ceiling is not None
            assert ceiling.spent().tokens == 60_000
    assert (result.stop_reason, result.output) == ("completed", "the fork ran out")
    first, fork_call, after = model.requests
    assert (fork_call.messages[-1].role, fork_call.messages[-1].content) == ("user", "beta task")
    assert after.messages[-1].role == "tool"
    assert after.messages[-1].content == (
        "error: the subagent stopped before finishing (stop reason: budget): it reached a cap of its budget "
        "and was stopped (max_tokens: 60,000 spent of 50,000 tokens). Spent: 60,000 of 50,000 tokens."
        "\n\nPartial output:\npartial answer"
    )
    # The root's model read the ceiling as it was at each call: whole, then spent.
    [before_spec] = first.tools
    [after_spec] = after.tools
    assert "Left now: 50,000 tokens." in before_spec.description
    assert after_spec.description.endswith(
        "It is spent (max_tokens: 60,000 spent of 50,000 tokens): no subagent can be started. "
        "A subagent that passes a cap is stopped, and its result is an error with its partial output."
    )
    assert agents.list() == []
