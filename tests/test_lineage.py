"""How the service counts a child's place in its parent chain: depth, ancestors, depth budget, and the
tool filter every ancestor imposes. Against in-memory fake providers, on asyncio and trio."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from subagent import (
    ErrorCode,
    Lineage,
    ServiceRun,
    SubagentCapabilities,
    SubagentError,
    SubagentRequest,
    SubagentService,
    ToolFilter,
)
from tests.fakes import FakeProvider

pytestmark = pytest.mark.anyio

EVERYTHING = SubagentCapabilities(output_schema=True, depth_limit=True, tool_filter=True)


def running_task_ids() -> set[int]:
    return {task.id for task in anyio.get_running_tasks()}


@asynccontextmanager
async def open_service(*providers: FakeProvider) -> AsyncIterator[SubagentService]:
    """An open service with `providers` registered; on exit, asserts no task was left running."""
    before = running_task_ids()
    async with SubagentService(progress_interval=None) as service:
        for provider in providers:
            service.register_provider(provider)
        yield service
    assert running_task_ids() == before


def lineage_of(provider: FakeProvider, run: ServiceRun) -> Lineage:
    """The lineage the provider was handed for `run` (the service fills it in)."""
    (seen,) = [fake.request for fake in provider.runs if fake.id == run.id]
    assert seen.lineage is not None
    return seen.lineage


# -- ToolFilter.narrowed_by ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outer", "inner", "expected"),
    [
        pytest.param(
            ToolFilter(allow={"read", "grep", "shell"}),
            ToolFilter(allow={"grep", "shell", "web"}),
            ToolFilter(allow={"grep", "shell"}),
            id="allow-intersects-allow",
        ),
        pytest.param(
            ToolFilter(allow=None, deny={"shell"}),
            ToolFilter(allow={"read", "shell"}),
            ToolFilter(allow={"read", "shell"}, deny={"shell"}),
            id="outer-allows-everything",
        ),
        pytest.param(
            ToolFilter(allow={"read"}),
            ToolFilter(allow=None, deny={"web"}),
            ToolFilter(allow={"read"}, deny={"web"}),
            id="inner-allows-everything",
        ),
        pytest.param(
            ToolFilter(deny={"shell"}),
            ToolFilter(deny={"web"}),
            ToolFilter(allow=None, deny={"shell", "web"}),
            id="denies-unite",
        ),
        pytest.param(
            ToolFilter(allow={"read"}, deny={"shell"}),
            None,
            ToolFilter(allow={"read"}, deny={"shell"}),
            id="no-inner-filter",
        ),
        pytest.param(
            ToolFilter(allow={"read"}),
            ToolFilter(allow={"shell"}),
            ToolFilter(allow=frozenset()),
            id="disjoint-allows-permit-nothing",
        ),
    ],
)
def test_narrowing_a_filter_permits_exactly_what_both_filters_permit(
    outer: ToolFilter, inner: ToolFilter | None, expected: ToolFilter
) -> None:
    narrowed = outer.narrowed_by(inner)

    assert narrowed == expected
    for tool in ("read", "grep", "shell", "web", "other"):
        both = outer.permits(tool) and (inner is None or inner.permits(tool))
        assert narrowed.permits(tool) is both, tool


def test_a_narrowed_filter_never_permits_a_tool_either_side_denied() -> None:
    parent = ToolFilter(deny={"shell"})
    child = ToolFilter(allow={"shell", "read"})

    assert not parent.narrowed_by(child).permits("shell")
    assert not child.narrowed_by(parent).permits("shell")
    assert parent.narrowed_by(child).permits("read")


# -- depth and ancestors --------------------------------------------------------------------------------


async def test_depth_and_ancestors_are_counted_through_every_level_of_the_chain() -> None:
    provider = FakeProvider(name="spawn", capabilities=EVERYTHING)
    async with open_service(provider) as service:
        child = service.start("spawn", SubagentRequest(prompt="1", parent_id="root"))
        grandchild = service.start("spawn", SubagentRequest(prompt="2", parent_id=child.id))
        great = service.start("spawn", SubagentRequest(prompt="3", parent_id=grandchild.id))
        great_great = service.start("spawn", SubagentRequest(prompt="4", parent_id=great.id))

        assert lineage_of(provider, child) == Lineage(depth=1, ancestors=("root",))
        assert lineage_of(provider, grandchild) == Lineage(depth=2, ancestors=(child.id, "root"))
        assert lineage_of(provider, great) == Lineage(depth=3, ancestors=(grandchild.id, child.id, "root"))
        assert lineage_of(provider, great_great) == Lineage(
            depth=4, ancestors=(great.id, grandchild.id, child.id, "root")
        )
        assert lineage_of(provider, great_great).parent_id == great.id


async def test_a_request_without_a_parent_is_a_child_of_an_anonymous_root() -> None:
    provider = FakeProvider(name="spawn", capabilities=EVERYTHING)
    async with open_service(provider) as service:
        run = service.start("spawn", SubagentRequest(prompt="p"))

        assert lineage_of(provider, run) == Lineage(
            depth=1, ancestors=(), depth_budget=None, tool_filter=None
        )
        assert lineage_of(provider, run).parent_id is None


async def test_an_unknown_parent_id_is_a_root_at_depth_zero_whatever_it_is_called() -> None:
    provider = FakeProvider(name="spawn", capabilities=EVERYTHING)
    async with open_service(provider) as service:
        run = service.start("spawn", SubagentRequest(prompt="p", parent_id="spawn-not-a-run"))

        assert lineage_of(provider, run) == Lineage(depth=1, ancestors=("spawn-not-a-run",))


async def test_a_callers_own_lineage_is_replaced_by_the_one_the_service_counted() -> None:
    provider = FakeProvider(name="spawn", capabilities=EVERYTHING)
    forged = Lineage(depth=0, ancestors=("nobody",), depth_budget=99, tool_filter=ToolFilter(allow={"shell"}))
    async with open_service(provider) as service:
        parent = service.start("spawn", SubagentRequest(prompt="p", depth_limit=1, tool_filter=ToolFilter()))
        child = service.start("spawn", SubagentRequest(prompt="c", parent_id=parent.id, lineage=forged))

        assert lineage_of(provider, child) == Lineage(
            depth=2, ancestors=(parent.id,), depth_budget=0, tool_filter=ToolFilter()
        )


async def test_lineage_follows_the_chain_across_providers() -> None:
    spawn = FakeProvider(name="spawn", capabilities=EVERYTHING)
    fork = FakeProvider(name="fork", capabilities=EVERYTHING, inherits_parent_context=True)
    async with open_service(spawn, fork) as service:
        child = service.start("spawn", SubagentRequest(prompt="1", parent_id="root", depth_limit=2))
        grandchild = service.start("fork", SubagentRequest(prompt="2", parent_id=child.id))

        assert lineage_of(fork, grandchild) == Lineage(depth=2, ancestors=(child.id, "root"), depth_budget=1)


# -- the depth budget -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parent_limit", "child_limit", "expected_child_budget"),
    [
        pytest.param(3, None, 2, id="inherited-budget-is-one-less"),
        pytest.param(3, 5, 2, id="a-larger-request-cannot-raise-it"),
        pytest.param(3, 1, 1, id="a-smaller-request-lowers-it"),
        pytest.param(3, 2, 2, id="equal-to-what-is-left"),
        pytest.param(None, 4, 4, id="no-limit-above"),
        pytest.param(None, None, None, id="no-limit-anywhere"),
        pytest.param(1, 0, 0, id="zero-requested"),
    ],
)
async def test_a_childs_depth_budget_is_the_smallest_of_its_request_and_its_parents_budget_less_one(
    parent_limit: int | None, child_limit: int | None, expected_child_budget: int | None
) -> None:
    provider = FakeProvider(name="spawn", capabilities=EVERYTHING)
    async with open_service(provider) as service:
        parent = service.start(
            "spawn", SubagentRequest(prompt="p", parent_id="root", depth_limit=parent_limit)
        )
        child = service.start(
            "spawn", SubagentRequest(prompt="c", parent_id=parent.id, depth_limit=child_limit)
        )

        assert lineage_of(provider, parent).depth_budget == parent_limit
        assert lineage_of(provider, child).depth_budget == expected_child_budget


async def test_an_exhausted_budget_refuses_the_next_level_before_the_provider_is_called() -> None:
    provider = FakeProvider(name="spawn", capabilities=EVERYTHING)
    async with open_service(provider) as service:
        starts: list[object] = []
        service.events.on("subagent/start", starts.append)
        child = service.start("spawn", SubagentRequest(prompt="1", parent_id="root", depth_limit=2))
        grandchild = service.start("spawn", SubagentRequest(prompt="2", parent_id=child.id))
        great = service.start("spawn", SubagentRequest(prompt="3", parent_id=grandchild.id, depth_limit=7))
        assert [lineage_of(provider, run).depth_budget for run in (child, grandchild, great)] == [2, 1, 0]

        with pytest.raises(SubagentError) as caught:
            service.start("spawn", SubagentRequest(prompt="4", parent_id=great.id, depth_limit=7))

        assert caught.value.code == ErrorCode.UNSUPPORTED_CAPABILITY
        assert caught.value.feature == "depth_limit"
        assert caught.value.provider == "spawn"
        assert great.id in caught.value.message
        assert provider.start_calls == 3
        assert service.live_runs == (child, grandchild, great)
        assert starts == []


async def test_a_parent_with_depth_limit_zero_cannot_start_a_child_on_any_provider() -> None:
    spawn = FakeProvider(name="spawn", capabilities=EVERYTHING)
    plain = FakeProvider(name="acp")  # no start-time feature at all
    async with open_service(spawn, plain) as service:
        parent = service.start("spawn", SubagentRequest(prompt="p", parent_id="root", depth_limit=0))

        for name in ("spawn", "acp"):
            with pytest.raises(SubagentError) as caught:
                service.start(name, SubagentRequest(prompt="c", parent_id=parent.id))
            assert caught.value.code == ErrorCode.UNSUPPORTED_CAPABILITY
            assert caught.value.feature == "depth_limit"

        assert (spawn.start_calls, plain.start_calls) == (1, 0)


# -- the tool filter ----------------------------------------------------------------------------------


async def test_each_childs_filter_is_its_request_narrowed_by_every_ancestors() -> None:
    provider = FakeProvider(name="spawn", capabilities=EVERYTHING)
    async with open_service(provider) as service:
        child = service.start(
            "spawn", SubagentRequest(prompt="1", parent_id="root", tool_filter=ToolFilter(deny={"shell"}))
        )
        grandchild = service.start(
            "spawn",
            SubagentRequest(prompt="2", parent_id=child.id, tool_filter=ToolFilter(allow={"shell", "read"})),
        )
        great = service.start("spawn", SubagentRequest(prompt="3", parent_id=grandchild.id))
        greater = service.start(
            "spawn", SubagentRequest(prompt="4", parent_id=great.id, tool_filter=ToolFilter(deny={"read"}))
        )

        assert lineage_of(provider, child).tool_filter == ToolFilter(deny={"shell"})
        assert lineage_of(provider, grandchild).tool_filter == ToolFilter(
            allow={"shell", "read"}, deny={"shell"}
        )
        assert lineage_of(provider, great).tool_filter == ToolFilter(allow={"shell", "read"}, deny={"shell"})
        assert lineage_of(provider, greater).tool_filter == ToolFilter(
            allow={"shell", "read"}, deny={"shell", "read"}
        )
        for run, permitted in [
            (child, {"read", "web"}),
            (grandchild, {"read"}),
            (great, {"read"}),
            (greater, set()),
        ]:
            effective = lineage_of(provider, run).tool_filter
            assert effective is not None
            assert {tool for tool in ("shell", "read", "web") if effective.permits(tool)} == permitted


async def test_a_provider_that_cannot_filter_tools_is_refused_under_an_inherited_filter() -> None:
    spawn = FakeProvider(name="spawn", capabilities=EVERYTHING)
    acp = FakeProvider(name="acp")  # like the ACP provider: no tool_filter capability
    async with open_service(spawn, acp) as service:
        filtered = service.start(
            "spawn", SubagentRequest(prompt="p", parent_id="root", tool_filter=ToolFilter(deny={"shell"}))
        )
        unfiltered = service.start("spawn", SubagentRequest(prompt="p", parent_id="root"))

        with pytest.raises(SubagentError) as caught:
            service.start("acp", SubagentRequest(prompt="c", parent_id=filtered.id))
        assert caught.value.code == ErrorCode.UNSUPPORTED_CAPABILITY
        assert caught.value.feature == "tool_filter"
        assert caught.value.provider == "acp"
        assert filtered.id in caught.value.message
        assert acp.start_calls == 0

        # Without a filter up the chain the same provider is fine.
        accepted = service.start("acp", SubagentRequest(prompt="c", parent_id=unfiltered.id))
        assert lineage_of(acp, accepted) == Lineage(depth=2, ancestors=(unfiltered.id, "root"))
        assert acp.start_calls == 1


async def test_the_depth_refusal_comes_before_the_tool_filter_refusal() -> None:
    spawn = FakeProvider(name="spawn", capabilities=EVERYTHING)
    acp = FakeProvider(name="acp")
    async with open_service(spawn, acp) as service:
        parent = service.start(
            "spawn",
            SubagentRequest(prompt="p", parent_id="root", depth_limit=0, tool_filter=ToolFilter(deny={"x"})),
        )
        with pytest.raises(SubagentError) as caught:
            service.start("acp", SubagentRequest(prompt="c", parent_id=parent.id))

        assert caught.value.feature == "depth_limit"
