"""What the client keeps of the subagent sessions an agent announces (ACP's subagents draft).

An agent whose client advertised ``clientCapabilities.subagents`` announces each child session it
creates with a ``subagent_update`` on the child's immediate parent session, before any traffic of
the child; later ``subagent_update`` s patch the child's metadata (an omitted field is unchanged,
``null`` clears it). The child's updates, permission questions and file requests then arrive under
its own session id, on the same connection. :class:`SubagentSession` is one such child as the client
holds it; :meth:`SubagentSession.apply` applies one patch.

A child is reusable: ``idle`` ends one run of it, not the child. A run begins at a ``running`` or
``requires_action`` snapshot and is counted as ended once, at the first ``idle`` after it; a second
``idle`` in a row is a repeat, not another run. ``unknown`` (the agent can no longer confirm the
state) changes neither: a run under way stays under way, and a child that was idle starts none
(Codex reports its idle children ``unknown`` once its session's runtime is retired).

Where the draft RFD and the schema shipped in @agentclientprotocol/sdk 2.4.0 differ, this follows
the schema and the two agents that implement it (claude-agent-acp 0.101.0, codex-acp 2.6.0):
``idle`` carries ``usage`` and, for ``stopReason: "error"``, an ``error`` beside it; Codex announces
a child with ``capabilities: {}`` and grants ``cancel`` later (and takes it back with ``cancel:
null``). Neither agent puts ``usage`` in its ``idle`` snapshot, so a run's usage also comes from the
child's own ``usage_update`` s and message chunks, as a turn's does: Codex sends a ``usage_update``
under the child's id (``used``: the tokens of its last model call, its context; ``size``: its window),
which is the run's ``contextUsed`` and ``contextSize`` with no token counts; Claude Code sends nothing
of a child's usage (its prompt response's ``_meta.quota.model_usage`` counts the whole turn by model,
children and its own side calls together), so such a run's usage is None: unknown, not zero.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from subagent.acp import schema
from subagent.acp import schema_unstable as unstable
from subagent.acp._turn_usage import TurnUsage

__all__ = ["MAX_SUBAGENT_SESSIONS", "SubagentSession", "state_name"]

MAX_SUBAGENT_SESSIONS: Final = 1000
"""The most subagent sessions one client keeps: an agent announcing more is refused past it (their
traffic is then refused as any unknown session's is). Real trees have a handful."""

_WORKING: Final = frozenset({"running", "requires_action"})
"""States that say a run is under way."""

_PATCHED: Final = (
    ("title", "title"),
    ("description", "description"),
    ("capabilities", "capabilities"),
    ("state", "state"),
    ("cwd", "cwd"),
    ("additionalDirectories", "additional_directories"),
    ("_meta", "meta"),
)
"""(wire name, attribute) of the fields a ``subagent_update`` patches when it carries them."""


def state_name(state: unstable.StateUpdate | None) -> str | None:
    """``running``, ``idle``, ``requires_action``, ``unknown``, an agent's own state (``_paused``), or
    None when no state is set."""
    if state is None:
        return None
    if isinstance(state, unstable.OtherStateUpdate):
        value = state.raw.get("state")
        return value if isinstance(value, str) else None
    tag = type(state).__struct_config__.tag
    return tag if isinstance(tag, str) else None


@dataclass(eq=False, slots=True)
class SubagentSession:
    """A child session the agent announced: where it sits in the tree, what the parent says it is,
    its current state, its runs, and its updates (the most recent ``max_kept_updates``)."""

    session_id: str
    parent_session_id: str
    """The session it was announced on: a session of ours, or another subagent session."""
    depth: int
    """1 for a child of a session we opened, 2 for its children, and so on."""
    title: str | None = None
    description: str | None = None
    capabilities: unstable.SubagentSessionCapabilities | None = None
    """What the agent lets the client do to the child (``cancel``); None: nothing."""
    state: unstable.StateUpdate | None = None
    """The last state snapshot (None: not reported, or cleared)."""
    cwd: str | None = None
    """The child's working directory as the agent reported it (None: its parent's)."""
    additional_directories: list[str] | None = None
    meta: dict[str, Any] | None = None
    """The ``_meta`` of the agent's last ``subagent_update`` that carried one (``subagent serve`` names
    the run's provider there: see :data:`~subagent.types.RUN_META_KEY`)."""
    updates: deque[schema.SessionUpdate] = field(default_factory=deque)
    """The child's updates, the most recent ones (the client gives it its ``max_kept_updates`` bound)."""
    update_count: int = 0
    """Every update the child sent, counting those no longer kept."""
    runs: int = 0
    """Runs that ended: ``idle`` snapshots that followed work."""
    stop_reason: str | None = None
    """The stop reason of the last ended run (None: the agent did not say)."""
    error: schema.Error | None = None
    """The failure of the last ended run, when it ended with ``error`` and the agent said why."""
    usage: dict[str, Any] | None = None
    """The last ended run's usage in ACP's names (``inputTokens``...), as a turn's is; None: none said."""
    started_at: float = field(default_factory=time.monotonic)
    """When the current (or last) run began, ``time.monotonic()``: the announcement, or the last
    return to work after ``idle``."""
    run_seconds: float | None = None
    """How long the last ended run took."""
    _run_usage: TurnUsage = field(default_factory=TurnUsage)
    _working: bool = False

    @property
    def state_name(self) -> str | None:
        """The state as one word (see :func:`state_name`)."""
        return state_name(self.state)

    @property
    def working(self) -> bool:
        """Whether a run of the child is under way: it began and has not ended ``idle`` yet."""
        return self._working

    @property
    def can_cancel(self) -> bool:
        """Whether the agent permits cancelling the child's current work (its ``cancel`` capability)."""
        return self.capabilities is not None and self.capabilities.cancel is not None

    def apply(self, update: unstable.SubagentUpdate, raw: Mapping[str, Any]) -> bool:
        """Apply one ``subagent_update`` (``raw`` is its JSON object: a field it leaves out is unchanged,
        one it sends as ``null`` is cleared); True when this snapshot ends a run."""
        for wire, attribute in _PATCHED:
            if wire in raw:
                setattr(self, attribute, getattr(update, attribute))
        if "state" not in raw:
            return False
        name = self.state_name
        if name == "idle":
            if not self._working:
                return False  # a repeated idle, or a child first seen idle: no run ended here
            self._end_run(update.state)
            return True
        if name in _WORKING and not self._working:
            self._working = True
            self.started_at = time.monotonic()
            self._run_usage = TurnUsage()
        return False

    def record(self, update: schema.SessionUpdate) -> None:
        """Keep one update of the child (``updates`` is bounded by the client's ``max_kept_updates``),
        and what it says of usage."""
        self.updates.append(update)  # a bounded deque: the oldest falls out
        self.update_count += 1
        if isinstance(update, schema.AgentMessageChunk) and update.meta is not None:
            self._run_usage.add_chunk_meta(update.meta)
        elif isinstance(update, schema.UsageUpdate):
            self._run_usage.add_usage_update(update.used, update.size, update.cost)

    def _end_run(self, idle: unstable.StateUpdate | None) -> None:
        assert isinstance(idle, unstable.IdleStateUpdate)
        self._working = False
        self.runs += 1
        self.run_seconds = time.monotonic() - self.started_at
        self.stop_reason = idle.stop_reason
        self.error = idle.error if idle.stop_reason == "error" else None
        # The snapshot's usage first, as a prompt response's; else what the run's updates said.
        self.usage = self._run_usage.result(schema.encode({"usage": idle.usage}))
