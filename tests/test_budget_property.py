"""A property of the budget over random trees of in-process runs with random caps and usage: no tree
spends past a cap by more than the documented bound, and no run that a cap stopped says it completed.

The documented bound (subagent/budget.py): a call whose adapter bounds its output reserves its whole
worst case, so it never passes a cap; any other call reserves its input only, so a cap is passed by at
most the output of the calls in flight when it was reached: one call per run of the tree at most, so
the sum over the tree's unbounded runs of their largest output. Tool calls and model calls (turns) are
reserved one by one: never passed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from subagent import Budget, SubagentRequest, SubagentResult, SubagentService
from subagent.budget import BudgetAccount
from subagent.providers.spawn import SpawnProvider
from tests.test_inprocess_budget import WorkingModel, work_tool

WAIT = 60.0


@dataclass(frozen=True)
class Node:
    parent: int | None  # index of the parent node (None: the root)
    output_tokens: int
    answer_after: int | None
    bounds: bool
    budget: Budget | None


@st.composite
def trees(draw: st.DrawFn) -> list[Node]:
    size = draw(st.integers(1, 7))
    caps = st.one_of(
        st.none(),
        st.builds(
            Budget,
            max_tokens=st.one_of(st.none(), st.integers(0, 3_000)),
            max_tool_calls=st.one_of(st.none(), st.integers(0, 8)),
            max_turns=st.one_of(st.none(), st.integers(0, 10)),
        ),
    )
    root_budget = st.builds(Budget, max_tokens=st.integers(0, 3_000))  # the root always has one: the tree's
    return [
        Node(
            parent=None if index == 0 else draw(st.integers(0, index - 1)),
            output_tokens=draw(st.integers(1, 400)),
            answer_after=draw(st.one_of(st.none(), st.integers(1, 6))),
            bounds=draw(st.booleans()),
            budget=draw(caps) if index else draw(root_budget),
        )
        for index in range(size)
    ]


async def run_tree(nodes: list[Node]) -> tuple[list[SubagentResult], list[BudgetAccount]]:
    async with SubagentService() as service:
        for index, node in enumerate(nodes):
            model = WorkingModel(
                output_tokens=node.output_tokens, answer_after=node.answer_after, bounds=node.bounds
            )
            service.register_provider(SpawnProvider(llm=model, tools=[work_tool()], name=f"n{index}"))
        runs: list[Any] = []
        with anyio.fail_after(WAIT):
            for index, node in enumerate(nodes):
                parent_id = None if node.parent is None else runs[node.parent].id
                request = SubagentRequest(prompt=f"node {index}", parent_id=parent_id, budget=node.budget)
                runs.append(service.start(f"n{index}", request))
            results = [await run.result() for run in runs]
            accounts = [run.request.account for run in runs]
            for run in reversed(runs):
                await run.dispose()
    return results, accounts


def subtree(nodes: list[Node], root: int) -> list[int]:
    below = [root]
    for index, node in enumerate(nodes):
        if node.parent is not None and node.parent in below:
            below.append(index)
    return below


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@given(nodes=trees())
def test_no_tree_spends_past_a_cap_by_more_than_the_bound_and_no_stopped_run_says_completed(
    backend: str, nodes: list[Node]
) -> None:
    results, accounts = anyio.run(run_tree, nodes, backend=backend)
    for index, (node, result, account) in enumerate(zip(nodes, results, accounts, strict=True)):
        assert account is not None  # under the root's budget, every run has an account
        # A stop by a cap names it; a completed run was not stopped; nothing else ends these runs.
        if result.stop_reason == "budget":
            assert result.limit is not None
            assert result.output_final is False
        else:
            assert result.stop_reason == "completed", result
            assert result.limit is None
            assert result.output_final is True
        spent = account.spent()
        below = subtree(nodes, index)
        overshoot = sum(nodes[i].output_tokens for i in below if not nodes[i].bounds)
        # Every cap on the chain above the run holds for what the run's subtree spent.
        for above in account.chain():
            cap = above.asked
            if cap.max_tokens is not None:
                assert above.spent().tokens <= cap.max_tokens + _tree_overshoot(nodes, accounts, above), (
                    index,
                    spent,
                )
            if cap.max_tool_calls is not None:
                assert above.spent().tool_calls <= cap.max_tool_calls
            if cap.max_turns is not None:
                assert above.spent().turns <= cap.max_turns
        assert (
            spent.tokens
            <= (node.budget.max_tokens if node.budget and node.budget.max_tokens is not None else math.inf)
            + overshoot
        )


def _tree_overshoot(
    nodes: list[Node], accounts: Sequence[BudgetAccount | None], account: BudgetAccount
) -> int:
    index = accounts.index(account)
    return sum(nodes[i].output_tokens for i in subtree(nodes, index) if not nodes[i].bounds)
