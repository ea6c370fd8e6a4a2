"""The one mapping of Usage to and from ACP's usage object (subagent._usage_codec)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from subagent._usage_codec import prompt_response_usage, usage_from_acp, usage_to_acp
from subagent.types import Usage

counts = st.none() | st.integers(min_value=0, max_value=2**53)
usages = st.builds(
    Usage,
    input_tokens=counts,
    output_tokens=counts,
    total_tokens=counts,
    thought_tokens=counts,
    cached_read_tokens=counts,
    cached_write_tokens=counts,
    context_used=counts,
    context_size=counts,
    cost=st.none() | st.floats(min_value=0, max_value=1e9, allow_nan=False),
).map(lambda usage: usage if usage.cost is None else dataclasses.replace(usage, cost_currency="USD"))


@pytest.mark.fuzz
@given(usages)
def test_a_usage_comes_back_from_its_acp_mapping_unchanged(usage: Usage) -> None:
    back = usage_from_acp(usage_to_acp(usage))
    assert back == (None if usage == Usage() else usage)


def test_a_full_usage_maps_to_acps_camel_case_names_with_context_and_cost() -> None:
    usage = Usage(
        input_tokens=10,
        output_tokens=5,
        total_tokens=15,
        thought_tokens=2,
        cached_read_tokens=3,
        cached_write_tokens=1,
        context_used=900,
        context_size=200_000,
        cost=0.25,
        cost_currency="USD",
    )
    assert usage_to_acp(usage) == {
        "inputTokens": 10,
        "outputTokens": 5,
        "totalTokens": 15,
        "thoughtTokens": 2,
        "cachedReadTokens": 3,
        "cachedWriteTokens": 1,
        "contextUsed": 900,
        "contextSize": 200_000,
        "cost": {"amount": 0.25, "currency": "USD"},
    }


def test_only_whole_non_negative_counts_and_a_well_formed_cost_are_read() -> None:
    raw = {
        "inputTokens": 7,
        "outputTokens": -1,
        "totalTokens": True,
        "thoughtTokens": 1.5,
        "cachedReadTokens": "3",
        "contextSize": 100,
        "cost": {"amount": "0.1", "currency": "USD"},
    }
    assert usage_from_acp(raw) == Usage(input_tokens=7, context_size=100)
    assert usage_from_acp({"cost": {"amount": 2, "currency": "EUR"}}) == Usage(cost=2.0, cost_currency="EUR")
    assert usage_from_acp({"outputTokens": None, "cost": {"amount": True, "currency": "USD"}}) is None
    assert usage_from_acp({}) is None
    assert usage_from_acp(None) is None


def test_a_prompt_response_usage_needs_input_and_output_and_fills_in_their_total() -> None:
    assert prompt_response_usage(
        Usage(input_tokens=3, output_tokens=4, thought_tokens=1, context_size=9)
    ) == {
        "inputTokens": 3,
        "outputTokens": 4,
        "totalTokens": 7,
        "thoughtTokens": 1,
    }
    assert prompt_response_usage(Usage(input_tokens=3, output_tokens=4, total_tokens=10)) == {
        "inputTokens": 3,
        "outputTokens": 4,
        "totalTokens": 10,
    }
    assert prompt_response_usage(Usage(input_tokens=3, context_used=5)) is None
    assert prompt_response_usage(None) is None
    assert list(
        prompt_response_usage(Usage(cached_read_tokens=1, input_tokens=1, output_tokens=1)) or {}
    ) == [
        "inputTokens",
        "outputTokens",
        "totalTokens",
        "cachedReadTokens",
    ]
