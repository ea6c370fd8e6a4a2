"""The one mapping of :class:`~subagent.types.Usage` to and from ACP's camelCase usage object.

ACP reports a turn's token counts in the ``usage`` of the ``session/prompt`` response
(``inputTokens``, ``outputTokens``, ``totalTokens``, ``thoughtTokens``, ``cachedReadTokens``,
``cachedWriteTokens``) and how full the context window is, and what the session cost, in a
``usage_update`` (``used``, ``size``, ``cost: {amount, currency}``). The ACP client gathers both
into one mapping (:class:`subagent.acp._turn_usage.TurnUsage`), whose context keys are ``contextUsed``
and ``contextSize``. This module turns that mapping into a :class:`Usage` (the ACP provider), a
:class:`Usage` back into it (``subagent run --json``), and a :class:`Usage` into the prompt
response's ``usage`` (``subagent serve``), from one table of names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from subagent.acp._turn_usage import read_cost, read_count
from subagent.types import Usage

__all__ = ["prompt_response_usage", "usage_from_acp", "usage_to_acp"]

TOKEN_FIELDS: Final = (
    ("inputTokens", "input_tokens"),
    ("outputTokens", "output_tokens"),
    ("totalTokens", "total_tokens"),
    ("thoughtTokens", "thought_tokens"),
    ("cachedReadTokens", "cached_read_tokens"),
    ("cachedWriteTokens", "cached_write_tokens"),
)
"""ACP's name and :class:`Usage`'s name of each token count: the counts that add up across calls."""

COUNT_FIELDS: Final = (
    *TOKEN_FIELDS,
    ("contextUsed", "context_used"),
    ("contextSize", "context_size"),
)
"""Every whole-number field: the token counts, then the context window's snapshot."""


def usage_from_acp(raw: Mapping[str, Any] | None) -> Usage | None:
    """The :class:`Usage` an ACP usage mapping says, or None when it says nothing we can read.

    Only whole numbers >= 0 are taken as counts, and a cost only with a numeric amount and a
    currency string: whatever else an agent puts there is ignored, never trusted.
    """
    if not raw:
        return None
    fields: dict[str, Any] = {name: read_count(raw.get(key)) for key, name in COUNT_FIELDS}
    if (cost := read_cost(raw.get("cost"))) is not None:
        fields["cost"], fields["cost_currency"] = cost
    usage = Usage(**fields)
    return None if usage == Usage() else usage


def usage_to_acp(usage: Usage | None) -> dict[str, Any] | None:
    """``usage`` as ACP's camelCase mapping (with the context window and cost), what is known only."""
    if usage is None:
        return None
    wire: dict[str, Any] = {
        key: value for key, name in COUNT_FIELDS if (value := getattr(usage, name)) is not None
    }
    if usage.cost is not None:
        wire["cost"] = {"amount": usage.cost, "currency": usage.cost_currency}
    return wire


def prompt_response_usage(usage: Usage | None) -> dict[str, int] | None:
    """The ``usage`` of a ``session/prompt`` response: ACP's ``Usage`` requires the input, output
    and total counts, so None unless input and output are known (the total is their sum if unsaid).
    The context window and cost belong to ``usage_update``, not here."""
    if usage is None or usage.input_tokens is None or usage.output_tokens is None:
        return None
    total = usage.input_tokens + usage.output_tokens if usage.total_tokens is None else usage.total_tokens
    counts = {name: getattr(usage, name) for _, name in TOKEN_FIELDS} | {"total_tokens": total}
    return {key: counts[name] for key, name in TOKEN_FIELDS if counts[name] is not None}
