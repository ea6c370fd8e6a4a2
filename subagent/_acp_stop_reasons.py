"""ACP's stop reasons and the seam's, one table read both ways: the ACP provider reads an agent's stop
reason as the seam's, and ``subagent serve`` answers a turn with ACP's for the seam's."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from subagent.acp import schema
from subagent.types import StopReason

__all__ = ["FROM_ACP", "TO_ACP"]

_PAIRS: Final[tuple[tuple[schema.StopReason, StopReason], ...]] = (
    ("end_turn", "completed"),
    ("cancelled", "cancelled"),
    ("max_tokens", "max_tokens"),
    ("max_turn_requests", "max_turns"),
    ("refusal", "refusal"),
)

FROM_ACP: Final[Mapping[str, StopReason]] = MappingProxyType(dict[str, StopReason](_PAIRS))
"""ACP's stop reasons as the seam's; one not listed (a newer protocol's) ends the turn ``error``."""

TO_ACP: Final[Mapping[str, schema.StopReason]] = MappingProxyType({seam: acp for acp, seam in _PAIRS})
"""The seam's stop reasons as ACP's; ACP has none for ``error`` and ``timeout`` (a failed turn)."""
