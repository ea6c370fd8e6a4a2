"""The one JSON form of a run's budget, its spending and the cap that stopped it, for machines.

``subagent run --json`` and ``--events`` (its ``end`` event) write it, and the trace page reads it from
an ``end`` event and from a run's ``_meta`` (:data:`~subagent.types.RUN_META_KEY`) where an agent sends
one: ``budget`` is the caps that were set, keyed by cap name as :class:`~subagent.types.LimitHit`
names them (``{"max_tokens": 10000}``); ``spent`` is ``{"tokens", "cost", "costCurrency", "seconds",
"toolCalls", "turns"}``; ``limit`` is ``{"limit", "allowed", "spent", "owner", "needed"}`` (``limit`` a
cap name or ``timeout``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from subagent.types import Budget, LimitHit, Spend

__all__ = ["budget_to_json", "limit_to_json", "spend_from_json", "spend_to_json"]


def budget_to_json(budget: Budget | None) -> dict[str, int | float] | None:
    """The caps that are set, by name (None: no budget, or one that caps nothing)."""
    if budget is None or not budget.fields():
        return None
    return budget.to_mapping()


def spend_to_json(spent: Spend | None) -> dict[str, Any] | None:
    """What a run spent, in its budget's units (seconds rounded to the millisecond)."""
    if spent is None:
        return None
    return {
        "tokens": spent.tokens,
        "cost": spent.cost,
        "costCurrency": spent.cost_currency,
        "seconds": round(spent.seconds, 3),
        "toolCalls": spent.tool_calls,
        "turns": spent.turns,
    }


def spend_from_json(value: Mapping[str, Any]) -> Spend:
    """What :func:`spend_to_json` wrote (a run journal's ``spent``); what is missing or no number is 0."""

    def number(key: str) -> float:
        amount = value.get(key)
        return amount if isinstance(amount, int | float) and not isinstance(amount, bool) else 0

    currency = value.get("costCurrency")
    return Spend(
        tokens=int(number("tokens")),
        cost=float(number("cost")),
        cost_currency=currency if isinstance(currency, str) else None,
        seconds=float(number("seconds")),
        tool_calls=int(number("toolCalls")),
        turns=int(number("turns")),
    )


def limit_to_json(limit: LimitHit | None) -> dict[str, Any] | None:
    """The cap (or timeout) that stopped a run: its name, its value, the spent, whose, and the need."""
    if limit is None:
        return None
    return {
        "limit": limit.limit,
        "allowed": limit.allowed,
        "spent": limit.spent,
        "owner": limit.owner,
        "needed": limit.needed,
    }
