"""An ACP run's grandchildren: the subagent sessions its agent announces, shown as runs of its tree.

``subagent serve`` shows each run of its subagent tree as a tool call carrying
``_meta["subagent-seam/run"]`` (:data:`~subagent.types.RUN_META_KEY`); the command line's live tree,
its ``--events`` and ``--json``, the trace page and the subtree usage roll-up all read that. A real
agent's own subagents (Claude Code's ``Task``, Codex's ``spawn_agent``) reach the client as
``subagent_update`` s instead, and so does ``subagent serve``'s tree for a client that advertises
``subagents``. :class:`SubagentRuns` turns each announced child into that same tool call, so every
view shows them exactly as it shows a served tree: ``running`` while the child works, then
``completed``, ``failed`` or ``cancelled`` with its stop reason, elapsed time and usage at each idle.
A child is reusable: a later run of it shows the same row running again, and its usage is the sum
over its runs (the roll-up counts a run id once). Each run of a child is also an ``invoke_agent``
span below the run's (or below its parent child's), when spans are recorded, unless the
announcement names the child's provider in ``_meta["subagent-seam/run"]``: ``subagent serve``
does, and records its runs' spans itself, below the caller's trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Final

from subagent._acp_stop_reasons import FROM_ACP
from subagent._usage_codec import usage_from_acp, usage_to_acp
from subagent.acp import schema
from subagent.acp.client import SubagentSession
from subagent.observability import _telemetry as telemetry
from subagent.types import RUN_META_KEY, Usage, sum_usage

__all__ = ["SubagentRuns"]

OUTPUT_EXCERPT_CHARS: Final = 1000
"""The most of a child run's last message its row carries at the end (as ``subagent serve``'s rows)."""
RUN_CALL_PREFIX: Final = "run/"
"""The tool call id prefix of a run's row (as ``subagent serve`` names its runs' calls)."""

WAITING_LINE: Final = "waiting on a permission answer"
"""The heartbeat line of a run whose child reported ``requires_action`` (as ``subagent serve`` words it)."""
_ENDED_STATES: Final = {"cancelled": "cancelled", "error": "failed"}
"""ACP stop reasons of an idle child that are not ``completed`` in the tree's words."""


class SubagentRuns:
    """Turns the client's subagent changes into run updates for ``deliver`` (see the module docstring).

    ``provider`` names the rows (``acp: Explore``); ``parent`` is the span the children's spans go
    below (the run's, when spans are recorded).
    """

    def __init__(
        self, provider: str, deliver: Callable[[schema.SessionUpdate], None], parent: telemetry.Parent
    ) -> None:
        self.provider = provider
        self._deliver = deliver
        self._parent = parent
        self._shown: set[str] = set()
        self._usage: dict[str, Usage] = {}
        self._spans: dict[str, Any] = {}

    def __call__(self, child: SubagentSession, ended: bool) -> None:
        """A ``SubagentListener``: show the child's change (a client calls it after each patch)."""
        if ended:
            self._end(child)
            state = self._state(child)
        elif child.working or child.state is None:
            # Working, or just announced with no state yet (Codex sends the state after).
            self._begin(child)
            state = "running"
        else:
            # Idle without a run seen (a child first shown idle), or ``unknown`` after its run ended.
            state = self._state(child)
        first = child.session_id not in self._shown
        self._shown.add(child.session_id)
        call = self._call(child, state, first=first)
        self._deliver(call)
        if state == "running" and child.state_name == "requires_action":
            # As ``subagent serve`` reports a run whose child waits on a permission answer: a
            # heartbeat (no status) whose line says so; the next update with a status ends the wait.
            self._deliver(
                schema.ToolCallProgress(
                    tool_call_id=call.tool_call_id,
                    title=call.title,
                    content=[schema.Content(content=schema.TextContent(text=WAITING_LINE))],
                    meta=call.meta,
                )
            )

    def _state(self, child: SubagentSession) -> str:
        return _ENDED_STATES.get(child.stop_reason or "", "completed")

    def _provider_of(self, child: SubagentSession) -> str:
        """The provider the agent names for ``child`` (``subagent serve`` does), else the run's own."""
        provider = _served_row(child).get("provider")
        return provider if isinstance(provider, str) else self.provider

    def _begin(self, child: SubagentSession) -> None:
        if child.session_id in self._spans or _served_row(child):
            return  # traced already, or by the agent itself (subagent serve: see the module docstring)
        parent = self._spans.get(child.parent_session_id, self._parent)
        self._spans[child.session_id] = telemetry.start_span(
            f"invoke_agent {child.title or child.session_id}",
            "internal",
            {
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.provider.name": "subagent-seam",
                "gen_ai.agent.id": telemetry.clip_id(child.session_id),
                "gen_ai.agent.name": telemetry.clip_id(child.title),
                "subagent.provider": self._provider_of(child),
                "subagent.parent.id": telemetry.clip_id(child.parent_session_id),
                "subagent.run.depth": child.depth,
            },
            parent,
        )

    def _end(self, child: SubagentSession) -> None:
        served = _served_row(child).get("usage")  # subagent serve's own figure, as its rows give it
        usage = usage_from_acp(served if isinstance(served, dict) else child.usage)
        if usage is not None:
            total = sum_usage([self._usage.get(child.session_id), usage])
            if total is not None:
                # Token counts add up over the child's runs; its context window is a snapshot, which
                # a sum leaves out: the last run's is the child's.
                self._usage[child.session_id] = dataclasses.replace(
                    total, context_used=usage.context_used, context_size=usage.context_size
                )
        state = self._state(child)
        span = self._spans.pop(child.session_id, None)
        telemetry.set_usage(span, usage)
        telemetry.set_attributes(span, {"subagent.stop_reason": child.stop_reason})
        telemetry.end_span(span, None if state == "completed" else child.stop_reason)

    def close(self) -> None:
        """End the spans of children still working (the run is over: nobody will see them end)."""
        for span in self._spans.values():
            telemetry.end_span(span, "unknown")
        self._spans.clear()

    def _call(
        self, child: SubagentSession, state: str, *, first: bool
    ) -> schema.ToolCall | schema.ToolCallProgress:
        meta: dict[str, Any] = {
            "runId": child.session_id,
            "parentId": child.parent_session_id,
            "provider": self._provider_of(child),
            "depth": child.depth,
            "state": state,
        }
        status: schema.ToolCallStatus = "in_progress"
        if state != "running":
            status = "completed" if state == "completed" else "failed"
            seam_reason = FROM_ACP.get(child.stop_reason or "end_turn", "error")
            meta["stopReason"] = seam_reason
            if child.run_seconds is not None:
                meta["elapsedSeconds"] = round(child.run_seconds, 3)
            total = usage_to_acp(self._usage.get(child.session_id))
            if total is not None:
                meta["usage"] = total
        title = child.title or child.description or child.session_id
        call_id = RUN_CALL_PREFIX + child.session_id
        # An ended run's row carries the excerpt of its last message, as serve's rows do (the trace
        # page shows it as the run's output).
        content = _text_content(last_message(child)) if state != "running" else None
        row = schema.ToolCall if first else schema.ToolCallProgress  # the first update opens the row
        return row(
            tool_call_id=call_id,
            title=title,
            kind="other",
            status=status,
            content=content,
            meta={RUN_META_KEY: meta},
        )


def _served_row(child: SubagentSession) -> dict[str, Any]:
    """What the announcement's ``_meta["subagent-seam/run"]`` says of the child (empty: nothing)."""
    row = child.meta.get(RUN_META_KEY) if child.meta is not None else None
    return row if isinstance(row, dict) else {}


def last_message(child: SubagentSession) -> str:
    """The start of the child's last message among its kept updates: its text chunks after its last
    tool call (or since the last change of ``messageId``), cut at :data:`OUTPUT_EXCERPT_CHARS`."""
    parts: list[str] = []
    message_id: str | None = None
    for update in reversed(child.updates):
        if isinstance(update, schema.ToolCall | schema.ToolCallProgress):
            break
        if not isinstance(update, schema.AgentMessageChunk):
            continue
        if update.message_id is not None:
            if message_id is not None and update.message_id != message_id:
                break
            message_id = update.message_id
        if isinstance(update.content, schema.TextContent):
            parts.append(update.content.text)
    return "".join(reversed(parts))[:OUTPUT_EXCERPT_CHARS]


def _text_content(text: str) -> list[schema.ToolCallContent] | None:
    return [schema.Content(content=schema.TextContent(text=text))] if text else None
