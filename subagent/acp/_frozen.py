"""Deep copies of JSON values, read-only (`freeze_json`) and back to plain (`thaw_json`).

Here, in the ACP package, because a permission question holds the agent's raw input frozen; the seam
(`subagent.types`) re-exports both, so the ACP client needs nothing of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["freeze_json", "thaw_json"]


def freeze_json(value: Any) -> Any:
    """A deep, immutable copy of a JSON value: objects become read-only mappings, arrays tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(key): freeze_json(item) for key, item in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze_json(item) for item in value)
    return value


def thaw_json(value: Any) -> Any:
    """A plain, mutable copy of a (possibly frozen) JSON value: dicts and lists, for encoders."""
    if isinstance(value, Mapping):
        return {str(key): thaw_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [thaw_json(item) for item in value]
    return value
