"""Budgets enforced on in-process children (spawn, fork): each cap stops a run with ``budget``, the
output and the usage kept; reservations keep a bounded call from passing a cap at all; caps nest
along the parent chain; a provider that cannot enforce a cap refuses it before any child exists."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import anyio
import pytest

from subagent import Budget, ErrorCode, LimitHit, PriceTable, SubagentError, SubagentRequest, Usage
from subagent.budget import BudgetAccount, usage_tokens
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import CompletionRequest, FunctionTool, Reply, ScriptedLlm
from subagent.runtime._scripted import call
from subagent.service import SubagentService
from subagent.types import SubagentCapabilities
from tests.fakes import FakeProvider

pytestmark = pytest.mark.anyio

WAIT = 20.0
NO_ARGUMENTS: Mapping[str, Any] = {"type": "object", "properties": {}}


def request_bytes(request: CompletionRequest) -> int:
    return sum(
        len(m.content.encode()) + sum(len(c.arguments.encode()) for c in m.tool_calls)
        for m in request.messages
    )


class WorkingModel(ScriptedLlm):
    """A model that calls the ``work`` tool until it has made ``answer_after`` calls, then answers.

    Its tokenizer makes a token of 4 bytes or less (as every real one does), so the input it reports
    never exceeds the runtime's estimate; each reply counts ``output_tokens`` output tokens.
    """

    def __init__(
        self, *, output_tokens: int = 40, answer_after: int | None = None, bounds: bool = True
    ) -> None:
        super().__init__(self._answer)
        self.output_tokens = output_tokens
        self.answer_after = answer_after
        self.bounds_output = bounds
        self.model = "house-model"
        self.calls = 0

    def _answer(self, request: CompletionRequest) -> Reply:
        self.calls += 1
        usage = Usage(input_tokens=math.ceil(request_bytes(request) / 4), output_tokens=self.output_tokens)
        if self.answer_after is not None and self.calls >= self.answer_after:
            return Reply(text=f"answer after {self.calls} calls", usage=usage)
        return Reply(text=f"step {self.calls}", tool_calls=(call("work", {}),), usage=usage)


def work_tool(ran: list[int] | None = None) -> FunctionTool:
    def work(arguments: Any) -> str:
        if ran is not None:
            ran.append(1)
        return "worked"

    return FunctionTool("work", "Do a step of work.", NO_ARGUMENTS, work)


def reported_tokens(model: WorkingModel) -> int:
    return sum(usage_tokens(request_usage) for request_usage in model_usages(model))


def model_usages(model: WorkingModel) -> list[Usage]:
    # Recompute what each call reported from the requests it saw (the responder is deterministic).
    usages = []
    for request in model.requests:
        output = model.output_tokens
        if request.max_tokens is not None:
            output = min(output, request.max_tokens)
        usages.append(Usage(input_tokens=math.ceil(request_bytes(request) / 4), output_tokens=output))
    return usages


async def run_one(
    model: WorkingModel,
    budget: Budget,
    *,
    tools: list[FunctionTool] | None = None,
    prices: PriceTable | None = None,
) -> tuple[Any, str]:
    async with SubagentService(prices=prices) as service:
        service.register_provider(
            SpawnProvider(llm=model, tools=tools if tools is not None else [work_tool()])
        )
        with anyio.fail_after(WAIT):
            async with service.start("spawn", SubagentRequest(prompt="keep working", budget=budget)) as run:
                return await run.result(), run.id


@pytest.mark.both_backends
async def test_a_child_over_its_token_cap_ends_budget_keeping_output_and_usage_within_a_bounded_cap() -> None:
    model = WorkingModel(output_tokens=40)
    result, run_id = await run_one(model, Budget(max_tokens=400))
    assert result.stop_reason == "budget"
    assert result.limit == LimitHit("max_tokens", allowed=400, spent=0, owner=run_id)
    assert result.output_final is False
    # The last call was cut to the tokens left: its text is cut to the same share.
    assert f"step {model.calls}".startswith(result.output)
    assert result.budget == Budget(max_tokens=400)
    assert result.usage is not None
    assert usage_tokens(result.usage) == reported_tokens(model)
    assert result.spent is not None
    assert result.spent.tokens == reported_tokens(model)
    # The reservation bounds every call's output to what is left: the cap is never passed.
    assert result.spent.tokens <= 400
    assert result.spent.turns == model.calls >= 2


@pytest.mark.both_backends
async def test_without_an_output_bound_a_token_cap_is_passed_by_at_most_the_last_calls_output() -> None:
    model = WorkingModel(output_tokens=150, bounds=False)
    result, run_id = await run_one(model, Budget(max_tokens=500))
    assert result.stop_reason == "budget"
    assert result.limit is not None
    assert result.limit.limit == "max_tokens"
    assert result.limit.owner == run_id
    assert all(request.max_tokens is None for request in model.requests)
    spent = result.spent.tokens if result.spent is not None else -1
    assert spent == reported_tokens(model)
    assert spent <= 500 + model.output_tokens


@pytest.mark.both_backends
async def test_a_child_stops_at_its_turn_cap_having_made_exactly_that_many_model_calls() -> None:
    model = WorkingModel()
    result, run_id = await run_one(model, Budget(max_turns=3))
    assert result.stop_reason == "budget"
    assert result.limit == LimitHit("max_turns", allowed=3, spent=3, owner=run_id)
    assert model.calls == 3
    assert result.spent is not None
    assert result.spent.turns == 3
    assert result.output == "step 3"


@pytest.mark.both_backends
async def test_a_tool_call_past_the_cap_is_not_run_and_the_child_ends_budget() -> None:
    ran: list[int] = []
    model = WorkingModel()
    result, run_id = await run_one(model, Budget(max_tool_calls=2), tools=[work_tool(ran)])
    assert result.stop_reason == "budget"
    assert result.limit == LimitHit("max_tool_calls", allowed=2, spent=2, owner=run_id)
    assert len(ran) == 2
    assert result.spent is not None
    assert result.spent.tool_calls == 2
    assert model.calls == 3  # the third call's tool was refused: no fourth model call


@pytest.mark.both_backends
async def test_a_child_past_its_wall_time_is_stopped_with_its_output_so_far() -> None:
    never = anyio.Event()

    async def stall(arguments: Any) -> str:
        await never.wait()
        return "unreachable"

    model = WorkingModel()
    tools = [FunctionTool("work", "Do a step of work.", NO_ARGUMENTS, stall)]
    result, run_id = await run_one(model, Budget(max_seconds=0.3), tools=tools)
    assert result.stop_reason == "budget"
    assert result.limit == LimitHit("max_seconds", allowed=0.3, spent=0, owner=run_id)
    assert result.limit.spent >= 0.3
    assert result.output == "step 1"
    assert result.output_final is False


@pytest.mark.both_backends
async def test_a_cost_cap_is_enforced_from_the_hosts_price_table() -> None:
    model = WorkingModel(output_tokens=100)
    prices = PriceTable({"house": {"input": 1000.0, "output": 2000.0}}, currency="EUR")
    result, run_id = await run_one(model, Budget(max_cost=1.0), prices=prices)
    assert result.stop_reason == "budget"
    assert result.limit is not None
    assert result.limit.limit == "max_cost"
    assert result.limit.owner == run_id
    assert result.spent is not None
    assert result.spent.cost_currency == "EUR"
    expected = sum(
        ((u.input_tokens or 0) * 1000.0 + (u.output_tokens or 0) * 2000.0) / 1e6 for u in model_usages(model)
    )
    assert result.spent.cost == pytest.approx(expected)
    assert result.spent.cost <= 1.0  # the cost of each call's bounded worst case was reserved
    assert "EUR" in (result.error or "")


@pytest.mark.both_backends
async def test_a_final_answer_that_passes_the_cap_is_completed_because_the_agent_said_so() -> None:
    model = WorkingModel(output_tokens=300, answer_after=1, bounds=False)
    result, _run_id = await run_one(model, Budget(max_tokens=200))
    assert result.stop_reason == "completed"
    assert result.output == "answer after 1 calls"
    assert result.output_final is True
    assert result.limit is None
    assert result.spent is not None
    assert result.spent.tokens > 200


async def three_levels(
    worker: WorkingModel, hold: anyio.Event, service: SubagentService
) -> tuple[Any, Any, Any]:
    """A root with a 600-token budget, a child of it, and a grandchild working on ``worker``: the root
    and the child wait in a tool call until ``hold`` is set, as a parent waits on its subagents."""

    async def wait_for_children(arguments: Any) -> str:
        await hold.wait()
        return "the children are done"

    spent_15 = Usage(input_tokens=10, output_tokens=5)
    for name in ("root", "child"):
        parent_model = ScriptedLlm(
            [Reply(tool_calls=(call("wait", {}),), usage=spent_15), Reply("done", usage=spent_15)]
        )
        wait_tool = FunctionTool("wait", "Wait for the children.", NO_ARGUMENTS, wait_for_children)
        service.register_provider(SpawnProvider(llm=parent_model, name=name, tools=[wait_tool]))
    service.register_provider(SpawnProvider(llm=worker, tools=[work_tool()]))
    root = service.start("root", SubagentRequest(prompt="root", budget=Budget(max_tokens=600)))
    child = service.start("child", SubagentRequest(prompt="child", parent_id=root.id))
    grandchild = service.start(
        "spawn", SubagentRequest(prompt="work", parent_id=child.id, budget=Budget(max_tokens=10_000))
    )
    return root, child, grandchild


@pytest.mark.both_backends
async def test_a_grandchild_is_stopped_by_its_grandparents_budget_and_the_tree_finishes_within_it() -> None:
    hold = anyio.Event()
    async with SubagentService() as service:
        with anyio.fail_after(WAIT):
            root, child, grandchild = await three_levels(WorkingModel(output_tokens=50), hold, service)
            assert grandchild.request.account is not None
            assert grandchild.request.account.budget.max_tokens <= 600  # narrowed to what the root has left
            ended = await grandchild.result()
            hold.set()
            root_result, child_result = await root.result(), await child.result()
            root_account = root.request.account
            assert root_account is not None
            for run in (grandchild, child, root):
                await run.dispose()
    assert ended.stop_reason == "budget"
    assert ended.limit is not None
    assert (ended.limit.limit, ended.limit.allowed) == ("max_tokens", 600)
    assert ended.limit.owner == root.id
    # The root and the child had a little left for their answers, and the tree stays within the cap.
    assert (root_result.stop_reason, child_result.stop_reason) == ("completed", "completed")
    assert root_result.spent is not None
    assert root_result.spent.tokens <= 600
    # The root's account, once all three ended (the root's result may settle before the child's last call).
    assert ended.spent is not None
    assert root_account.spent().tokens == 15 * 4 + ended.spent.tokens


@pytest.mark.both_backends
async def test_a_grandchild_that_passes_its_grandparents_cap_stops_the_whole_tree_with_that_cap() -> None:
    hold = anyio.Event()
    async with SubagentService() as service:
        with anyio.fail_after(WAIT):
            # One call's output is more than the whole budget: the first call passes the root's cap.
            worker = WorkingModel(output_tokens=700, bounds=False)
            root, child, grandchild = await three_levels(worker, hold, service)
            results = [await run.result() for run in (grandchild, child, root)]
            for run in (grandchild, child, root):
                await run.dispose()
    assert [result.stop_reason for result in results] == ["budget"] * 3
    limits = {result.limit for result in results}
    assert limits == {LimitHit("max_tokens", allowed=600, spent=0, owner=root.id)}
    # Passed by no more than the one call's output.
    assert results[0].spent is not None
    assert 600 < results[0].spent.tokens <= 600 + 700
    assert worker.calls == 1


@pytest.mark.both_backends
async def test_siblings_under_one_budget_together_never_pass_it_with_bounded_calls() -> None:
    models = [WorkingModel(output_tokens=60) for _ in range(4)]
    async with SubagentService() as service:
        for index, model in enumerate(models):
            service.register_provider(SpawnProvider(llm=model, tools=[work_tool()], name=f"w{index}"))
        ceiling = BudgetAccount(Budget(max_tokens=2_000))
        with anyio.fail_after(WAIT):
            runs = [service.start(f"w{i}", SubagentRequest(prompt="go"), within=ceiling) for i in range(4)]
            results = [await run.result() for run in runs]
            for run in runs:
                await run.dispose()
    assert all(result.stop_reason == "budget" for result in results)
    assert ceiling.spent().tokens == sum(reported_tokens(model) for model in models)
    assert ceiling.spent().tokens <= 2_000


async def test_a_provider_that_cannot_enforce_a_cap_refuses_it_naming_the_cap_before_any_child_exists() -> (
    None
):
    provider = FakeProvider(capabilities=SubagentCapabilities(budget={"max_seconds"}))
    async with SubagentService() as service:
        service.register_provider(provider)
        with pytest.raises(SubagentError) as refused:
            service.start("fake", SubagentRequest(prompt="x", budget=Budget(max_seconds=5, max_tokens=10)))
        assert refused.value.code is ErrorCode.UNSUPPORTED_CAPABILITY
        assert refused.value.feature == "max_tokens"
        assert provider.runs == []
        accepted = service.start("fake", SubagentRequest(prompt="x", budget=Budget(max_seconds=5)))
        await accepted.dispose()


async def test_a_cap_set_above_a_run_is_refused_by_a_provider_that_cannot_enforce_it() -> None:
    hold = anyio.Event()
    fake = FakeProvider(capabilities=SubagentCapabilities(budget={"max_tokens"}))
    async with SubagentService() as service:
        service.register_provider(SpawnProvider(llm=ScriptedLlm([Reply(text="x", wait=hold.wait)])))
        service.register_provider(fake)
        parent = service.start("spawn", SubagentRequest(prompt="p", budget=Budget(max_turns=5)))
        with pytest.raises(SubagentError) as refused:
            service.start("fake", SubagentRequest(prompt="c", parent_id=parent.id))
        assert refused.value.code is ErrorCode.UNSUPPORTED_CAPABILITY
        assert refused.value.feature == "max_turns"
        assert fake.runs == []
        await parent.dispose()


def test_a_budget_refuses_caps_out_of_range_and_of_the_wrong_type_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="max_seconds must be > 0"):
        Budget(max_seconds=0)
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        Budget(max_tokens=-1)
    with pytest.raises(TypeError, match="max_tool_calls must be a whole number"):
        Budget(max_tool_calls=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_cost must be >= 0 and finite"):
        Budget(max_cost=math.inf)
    with pytest.raises(ValueError, match="unknown budget keys: max_money"):
        Budget.from_mapping({"max_money": 3})
    assert Budget.from_mapping({"max_tokens": 5}).to_mapping() == {"max_tokens": 5}
    assert Budget(max_tokens=5, max_turns=9).tighter(Budget(max_turns=3, max_cost=1.0)) == Budget(
        max_tokens=5, max_turns=3, max_cost=1.0
    )


@pytest.mark.both_backends
async def test_a_parent_waiting_in_a_tool_call_never_holds_back_its_childs_tool_calls() -> None:
    # The parent's tool call (a wait on its child, as the subagent tool does) counts one of the three
    # tool calls from its start; the child gets the other two, and its third is refused, not waited on.
    hold, waiting = anyio.Event(), anyio.Event()

    async def wait_for_child(arguments: Any) -> str:
        waiting.set()
        await hold.wait()
        return "the child is done"

    parent_model = ScriptedLlm([Reply(tool_calls=(call("wait", {}),)), Reply("done")])
    ran: list[int] = []
    # The child inherits its in-process parent's tools: `work` is among them.
    tools = [FunctionTool("wait", "Wait for the child.", NO_ARGUMENTS, wait_for_child), work_tool(ran)]
    async with SubagentService() as service:
        service.register_provider(SpawnProvider(llm=parent_model, name="parent", tools=tools))
        service.register_provider(SpawnProvider(llm=WorkingModel()))
        with anyio.fail_after(WAIT):
            parent = service.start("parent", SubagentRequest(prompt="p", budget=Budget(max_tool_calls=3)))
            await waiting.wait()
            child = service.start("spawn", SubagentRequest(prompt="c", parent_id=parent.id))
            child_result = await child.result()
            hold.set()
            parent_result = await parent.result()
            await child.dispose()
            await parent.dispose()
    assert child_result.stop_reason == "budget"
    assert child_result.limit == LimitHit("max_tool_calls", allowed=3, spent=3, owner=parent.id)
    assert len(ran) == 2
    # The parent's own tool call had started before the cap was reached: its answer comes back whole.
    assert parent_result.stop_reason == "completed"
    assert parent_result.output == "done"
