"""The turn's tool calls as the command line knows them: merged from ``tool_call`` and
``tool_call_update`` session updates, for progress lines and for naming a permission question.
The calls of the agent's subagent sessions are kept apart from the session's own (a child's call
ids are its own), so a child's question is named from the child's calls.

At most :data:`MAX_TRACKED_TOOL_CALLS` are remembered (the most recently announced), so an agent
announcing calls without end costs a bounded amount of memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from subagent.acp import schema
from subagent.acp.handlers import PermissionQuestion
from subagent.types import thaw_json

__all__ = ["MAX_TRACKED_TOOL_CALLS", "ToolCallState", "ToolCalls"]

MAX_TRACKED_TOOL_CALLS: Final = 1000
"""Tool calls the command line remembers (by id, the most recently announced): enough to name
the call of any permission question, a bounded cost however many an agent announces."""


@dataclass(slots=True)
class ToolCallState:
    """What is known of one tool call, merged from its ``tool_call`` and ``tool_call_update``s."""

    tool_call_id: str
    title: str | None = None
    kind: str | None = None
    status: str = "pending"
    raw_input: Any = None


class ToolCalls:
    """The turn's tool calls by id, for progress lines and for naming a permission question: the
    ``limit`` most recently announced (older ones are forgotten; an update for one of them is
    then taken as a new announcement)."""

    def __init__(self, limit: int = MAX_TRACKED_TOOL_CALLS) -> None:
        # The connection serves a permission question only after the updates sent before it, so the
        # question's tool call is already here when the question is shown.
        self._calls: dict[tuple[str | None, str], ToolCallState] = {}
        self.limit = limit

    def get(self, tool_call_id: str, subagent_session: str | None = None) -> ToolCallState | None:
        """The state of a tool call seen so far (of the subagent session ``subagent_session``, else of
        the session itself), or None."""
        return self._calls.get((subagent_session, tool_call_id))

    def observe(
        self, update: schema.SessionUpdate, subagent_session: str | None = None
    ) -> ToolCallState | None:
        """Merge ``update`` (sent by the subagent session ``subagent_session``, else by the session
        itself); return the call's state when it is new or its status changed, else None."""
        if isinstance(update, schema.ToolCall):
            state = ToolCallState(
                tool_call_id=update.tool_call_id,
                title=update.title,
                kind=update.kind,
                status=update.status or "pending",
                raw_input=update.raw_input,
            )
            self._announced(subagent_session, state)
            return state
        if isinstance(update, schema.ToolCallProgress):
            known = self._calls.get((subagent_session, update.tool_call_id))
            if known is None:
                # An update for a call we never saw announced: treat it as the announcement.
                state = ToolCallState(tool_call_id=update.tool_call_id, status=update.status or "pending")
                self._announced(subagent_session, state)
                changed = True
            else:
                state = known
                changed = update.status is not None and update.status != state.status
            if update.title is not None:
                state.title = update.title
            if update.kind is not None:
                state.kind = update.kind
            if update.status is not None:
                state.status = update.status
            if update.raw_input is not None:
                state.raw_input = update.raw_input
            return state if changed else None
        return None

    def __len__(self) -> int:
        return len(self._calls)

    def _announced(self, subagent_session: str | None, state: ToolCallState) -> None:
        calls = self._calls
        key = (subagent_session, state.tool_call_id)
        calls.pop(key, None)  # re-announced: now the most recent
        calls[key] = state
        while len(calls) > self.limit:
            del calls[next(iter(calls))]  # the oldest announcement (dicts keep insertion order)

    def describe(self, question: PermissionQuestion) -> ToolCallState:
        """The question's tool call: what the question says, completed from what the turn (or, for a
        subagent session's question, that child) showed."""
        asker = question.session_id if question.subagent is not None else None
        seen = self._calls.get((asker, question.tool_call_id))
        return ToolCallState(
            tool_call_id=question.tool_call_id,
            title=question.title or (seen.title if seen else None),
            kind=question.kind or (seen.kind if seen else None),
            status=seen.status if seen else "pending",
            raw_input=thaw_json(question.raw_input)
            if question.raw_input is not None
            else (seen.raw_input if seen else None),
        )
