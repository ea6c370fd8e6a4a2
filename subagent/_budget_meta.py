"""A budget on the wire: the ``_meta[BUDGET_META_KEY]`` of ``session/new``, written by the ACP provider
(what its run has left) and read by ``subagent serve`` (the budget of the session's whole tree)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from subagent.types import BUDGET_META_KEY, Budget, BudgetField

__all__ = ["budget_from_meta", "budget_to_meta"]

logger = logging.getLogger(__name__)

_WIRE_NAMES: Final[dict[BudgetField, str]] = {
    "max_tokens": "maxTokens",
    "max_cost": "maxCost",
    "max_seconds": "maxSeconds",
    "max_tool_calls": "maxToolCalls",
    "max_turns": "maxTurns",
}
"""Each cap's camelCase name on the wire (ACP's own style)."""


def budget_to_meta(budget: Budget) -> dict[str, int | float]:
    """The caps of ``budget`` that are set, under their wire names, in check order."""
    return {_WIRE_NAMES[name]: getattr(budget, name) for name in budget.fields()}


def budget_from_meta(meta: Mapping[str, Any] | None) -> Budget | None:
    """The budget a client sent under ``BUDGET_META_KEY`` (None: it sent none, or one with no cap).

    A malformed budget (not an object, an unknown key, a cap of the wrong type or out of range) is
    logged and ignored as a whole: a client that means to cap a session says so in the documented shape,
    and half of a budget read from a broken one could cap the wrong thing.
    """
    raw = meta.get(BUDGET_META_KEY) if meta is not None else None
    if raw is None:
        return None
    names = {wire: name for name, wire in _WIRE_NAMES.items()}
    try:
        if not isinstance(raw, Mapping):
            raise TypeError("not an object")
        unknown = sorted(str(key) for key in raw if key not in names)
        if unknown:
            raise ValueError(f"unknown keys {unknown}")
        budget = Budget(**{names[key]: value for key, value in raw.items()})
    except (TypeError, ValueError) as exc:
        logger.warning("ignoring a malformed %s in session/new (%s): %r", BUDGET_META_KEY, exc, raw)
        return None
    return budget if budget.fields() else None
