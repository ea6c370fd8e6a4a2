"""Costs on every end: usage and wall time on ``subagent/end`` and the result, and the usage of a whole
subtree of runs added up (``SubagentService.subtree_usage``, ``sum_usage``)."""

from __future__ import annotations

import anyio
import pytest

from subagent import SubagentRequest, SubagentResult, SubagentRunEndInfo, Usage
from subagent.service import ENDED_RUNS_KEPT, SubagentService
from subagent.types import sum_usage
from tests.fakes import FakeProvider, FakeRun

pytestmark = pytest.mark.anyio

WAIT = 10.0


def test_sum_usage_adds_token_counts_and_costs_in_one_currency_and_drops_the_context_snapshots() -> None:
    a = Usage(
        input_tokens=10, output_tokens=2, context_used=900, context_size=1000, cost=0.5, cost_currency="USD"
    )
    b = Usage(input_tokens=5, thought_tokens=7, cost=0.25, cost_currency="USD")
    # b counts tokens but has no total (nor input and output to make one): the sum has no total either.
    assert sum_usage([a, None, b]) == Usage(
        input_tokens=15, output_tokens=2, thought_tokens=7, cost=0.75, cost_currency="USD"
    )
    given = Usage(input_tokens=1, output_tokens=1, total_tokens=5)  # a total may count more than both
    assert sum_usage([a, given]) == Usage(
        input_tokens=11, output_tokens=3, total_tokens=17, cost=0.5, cost_currency="USD"
    )


def test_sum_usage_leaves_out_a_cost_given_in_two_currencies_and_is_none_without_any_usage() -> None:
    usd = Usage(output_tokens=1, cost=1.0, cost_currency="USD")
    eur = Usage(output_tokens=2, cost=1.0, cost_currency="EUR")
    assert sum_usage([usd, eur]) == Usage(output_tokens=3)
    assert sum_usage([None, None]) is None
    assert sum_usage([]) is None
    assert sum_usage([Usage()]) == Usage()


async def finish(run: FakeRun, usage: Usage | None) -> None:
    run.make_ready()
    run.finish(SubagentResult(output="done", stop_reason="completed", usage=usage))


async def test_the_end_carries_the_runs_usage_wall_time_and_parent_and_the_subtree_adds_up_below_a_run() -> (
    None
):
    provider = FakeProvider()
    ends: list[SubagentRunEndInfo] = []
    async with SubagentService() as service:
        service.register_provider(provider)
        service.events.on("subagent/end", ends.append)
        root = service.start("fake", SubagentRequest(prompt="root", parent_id="host"))
        child = service.start("fake", SubagentRequest(prompt="child", parent_id=root.id))
        grandchild = service.start("fake", SubagentRequest(prompt="grandchild", parent_id=child.id))
        other = service.start("fake", SubagentRequest(prompt="unrelated", parent_id="host"))
        usages = {
            root.id: Usage(input_tokens=100, output_tokens=10),
            child.id: Usage(input_tokens=20, output_tokens=2),
            grandchild.id: None,  # reported nothing: counted as nothing, not as zero tokens
            other.id: Usage(input_tokens=1000),
        }
        for fake in provider.runs:
            await finish(fake, usages[fake.id])
        with anyio.fail_after(WAIT):
            results = [await run.result() for run in (root, child, grandchild, other)]
        # Live runs have reported nothing yet: the subtree counts what ended.
        # Totals from input and output where none was given; the host's subtree has a run that counted
        # input only, so its total is unknown rather than wrong.
        assert service.subtree_usage(root.id) == Usage(input_tokens=120, output_tokens=12, total_tokens=132)
        assert service.subtree_usage(child.id) == Usage(input_tokens=20, output_tokens=2, total_tokens=22)
        assert service.subtree_usage(grandchild.id) is None
        assert service.subtree_usage("host") == Usage(input_tokens=1120, output_tokens=12)
        assert service.subtree_usage("nobody") is None
    by_id = {end.id: end for end in ends}
    assert by_id[child.id] == SubagentRunEndInfo(
        id=child.id,
        provider="fake",
        stop_reason="completed",
        last_assistant_message="done",
        error=None,
        usage=Usage(input_tokens=20, output_tokens=2),
        parent_id=root.id,
    )
    for run, result in zip((root, child, grandchild, other), results, strict=True):
        elapsed = by_id[run.id].elapsed_seconds
        assert elapsed is not None
        assert elapsed >= 0
        assert result.elapsed_seconds == elapsed


async def test_a_run_whose_result_failed_ends_with_its_wall_time_and_no_usage() -> None:
    provider = FakeProvider()
    ends: list[SubagentRunEndInfo] = []
    async with SubagentService() as service:
        service.register_provider(provider)
        service.events.on("subagent/end", ends.append)
        run = service.start("fake", SubagentRequest(prompt="p", parent_id="host"))
        (fake,) = provider.runs
        fake.make_ready()
        fake.fail_result(RuntimeError("the provider broke"))
        with anyio.fail_after(WAIT):
            with pytest.raises(RuntimeError):
                await run.result()
        assert service.subtree_usage(run.id) is None
    (end,) = ends
    assert (end.usage, end.parent_id, end.stop_reason) == (None, "host", None)
    assert end.elapsed_seconds is not None
    assert end.elapsed_seconds >= 0


async def test_the_record_of_ended_runs_is_bounded_and_keeps_the_most_recent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("subagent.service.ENDED_RUNS_KEPT", 3)
    provider = FakeProvider()
    async with SubagentService() as service:
        service.register_provider(provider)
        runs = [service.start("fake", SubagentRequest(prompt=str(i), parent_id="host")) for i in range(5)]
        for fake in provider.runs:
            await finish(fake, Usage(output_tokens=1))
        with anyio.fail_after(WAIT):
            for run in runs:
                await run.result()
        # Only the three most recent ends are remembered (which three: the order the results settled).
        assert service.subtree_usage("host") == Usage(output_tokens=3)
        counted = [run for run in runs if service.subtree_usage(run.id) is not None]
        assert len(counted) == 3
    assert ENDED_RUNS_KEPT == 10_000
