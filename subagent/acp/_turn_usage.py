"""A turn's token usage, read from wherever the agent put it, into one mapping.

ACP's own place is the ``usage`` of the ``session/prompt`` response (unstable in the spec), with
the ``Usage`` names ``inputTokens``, ``outputTokens``, ``totalTokens``, ``thoughtTokens``,
``cachedReadTokens``, ``cachedWriteTokens``; and the ``usage_update`` session update says how full
the context window is (``used`` of ``size`` tokens) and what the session has cost so far. Real
agents spread it wider. Where each puts it (read from their ACP code):

* claude-agent-acp: the prompt response's ``usage`` (``inputTokens``, ``outputTokens``,
  ``cachedReadTokens``, ``cachedWriteTokens``, ``totalTokens``, summed over the turn's model
  calls), ``usage_update`` {``used``, ``size``} after each model call, and one with ``cost``:
  {``amount``, ``currency``} (the session's total) at the turn's end, just before the response
  (0.101.0; also when the turn is cancelled).
* Gemini CLI (``--experimental-acp``): only the prompt response's ``_meta``:
  ``{"quota": {"token_count": {"input_tokens", "output_tokens"}, "model_usage": [{"model",
  "token_count": {...}}]}}``, the turn's sums (a slash command answers zeros).
* Qwen Code: an ``agent_message_chunk`` with empty text after each model call, whose ``_meta``
  is ``{"usage": {"inputTokens", "outputTokens", "totalTokens", "thoughtTokens"?,
  "cachedReadTokens"?}, "durationMs"?}`` (one call's counts: a turn's usage is their sum).
* codex-acp: ``usage_update`` {``used``, ``size``} only (no token counts for the turn).
* opencode: ``usage_update`` {``used``, ``size``, ``cost``}.
* Some agents send ``usage_update`` with ``used: null`` (or no ``size``), which does not fit the
  schema and arrives as an unknown update: what it has is read all the same.

The token counts come from one source, the first of: the response's ``usage``; the response's
``_meta.usage`` or ``_meta.quota.token_count``; the sum of the turn's message chunks'
``_meta.usage``. (Never mixed: a second source repeats the first, and adding them would count
twice.) The last ``usage_update`` of the turn adds ``contextUsed``, ``contextSize`` and ``cost``.
Only whole numbers >= 0 are taken as counts; anything else an agent puts there is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import msgspec

from subagent.acp import schema

TOKEN_KEYS: Final = (
    "inputTokens",
    "outputTokens",
    "totalTokens",
    "thoughtTokens",
    "cachedReadTokens",
    "cachedWriteTokens",
)
"""ACP's ``Usage`` names: the keys of token counts in the mapping a turn reports."""

_TOKEN_COUNT_NAMES: Final = {
    "input_tokens": "inputTokens",
    "output_tokens": "outputTokens",
    "total_tokens": "totalTokens",
    **{key: key for key in TOKEN_KEYS},
}
"""``_meta.quota.token_count`` names (Gemini CLI's snake_case) onto ACP's; ACP's own are taken there too."""

_ACP_NAMES: Final = {key: key for key in TOKEN_KEYS}
"""ACP's names onto themselves: where an agent uses ACP's own names."""


class _ResponseProbe(msgspec.Struct):
    """What a ``session/prompt`` response may carry about usage, beside its stop reason."""

    usage: Any = None
    meta: Any = msgspec.field(default=None, name="_meta")


_RESPONSE_DECODER: Final = msgspec.json.Decoder(_ResponseProbe)


def read_count(value: object) -> int | None:
    """``value`` if it is a whole number >= 0 (a count an agent may report), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def read_cost(value: object) -> tuple[float, str] | None:
    """``(amount, currency)`` from a cost object with a numeric amount and a currency string, else None."""
    if isinstance(value, schema.Cost):
        return value.amount, value.currency
    if isinstance(value, Mapping):
        amount, currency = value.get("amount"), value.get("currency")
        if isinstance(amount, int | float) and not isinstance(amount, bool) and isinstance(currency, str):
            return float(amount), currency
    return None


def _counts(source: object, names: Mapping[str, str]) -> dict[str, int]:
    """The token counts in ``source`` (a JSON object), under ACP's names."""
    if not isinstance(source, dict):
        return {}
    counts: dict[str, int] = {}
    for name, key in names.items():
        value = read_count(source.get(name))
        if value is not None and key not in counts:
            counts[key] = value
    return counts


class TurnUsage:
    """Collects a turn's usage as its updates arrive; :meth:`result` adds the prompt response."""

    __slots__ = ("_chunk_counts", "_context")

    def __init__(self) -> None:
        self._chunk_counts: dict[str, int] | None = None
        self._context: dict[str, Any] | None = None

    def add_chunk_meta(self, meta: Mapping[str, Any]) -> None:
        """A message chunk's ``_meta``: Qwen Code reports each model call's usage there."""
        counts = _counts(meta.get("usage"), _ACP_NAMES)
        if not counts:
            return
        total = self._chunk_counts
        if total is None:
            self._chunk_counts = counts
        else:
            for key, value in counts.items():
                total[key] = total.get(key, 0) + value

    def add_usage_update(self, used: object, size: object, cost: object) -> None:
        """A ``usage_update`` (typed, or as an unknown update's raw fields): the last one wins."""
        context: dict[str, Any] = {}
        if (value := read_count(used)) is not None:
            context["contextUsed"] = value
        if (value := read_count(size)) is not None:
            context["contextSize"] = value
        if (amount_currency := read_cost(cost)) is not None:
            amount, currency = amount_currency
            context["cost"] = {"amount": amount, "currency": currency[:16]}
        self._context = context or self._context

    def result(self, response: bytes) -> dict[str, Any] | None:
        """The turn's usage given the raw ``session/prompt`` response, or None if nothing said any."""
        try:
            probe = _RESPONSE_DECODER.decode(response)
        except msgspec.DecodeError:
            probe = _ResponseProbe()
        counts: dict[str, Any] = _counts(probe.usage, _ACP_NAMES)
        if counts:
            counts = dict(probe.usage)  # as the agent sent it, keys of its own included
        elif isinstance(probe.meta, dict):
            counts = _counts(probe.meta.get("usage"), _ACP_NAMES)
            quota = probe.meta.get("quota")
            if not counts and isinstance(quota, dict):
                counts = _counts(quota.get("token_count"), _TOKEN_COUNT_NAMES)
        if not counts and self._chunk_counts:
            counts = dict(self._chunk_counts)
        usage: dict[str, Any] = dict(counts)
        if self._context:
            usage.update(self._context)
        return usage or None
