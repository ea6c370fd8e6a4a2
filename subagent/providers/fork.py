"""The ``fork`` provider: an in-process child seeded with the parent's completed turns."""

from __future__ import annotations

from collections.abc import Sequence

import anyio.abc

from subagent.providers._inprocess import InProcessProvider, InProcessRun
from subagent.runtime._inprocess_agent import Agent
from subagent.runtime._messages import Message
from subagent.types import SubagentRequest

__all__ = ["ForkProvider", "InProcessRun"]


class ForkProvider(InProcessProvider):
    """Runs each request in an in-process :class:`~subagent.runtime.Agent` that starts from its
    parent's conversation: every turn the parent has completed, never the turn in flight (the one
    that is delegating right now). The parent must be a live agent in ``agents``.

    Args:
        agents: the registry of live in-process agents the parents are found in (default: the
            process-wide :meth:`~subagent.runtime.AgentRegistry.default`, where every agent made
            without a registry of its own lives).
        llm: the child's adapter, or a name in ``llm_service``; None (the default) uses the parent's.
        persona: the child's system prompt when its request gives none; None keeps the parent's.
        approver: None inherits the parent's.
        tools: a fork has its parent's tools, narrowed; these are only for a fork continued by
            :meth:`reopen` once its parent is gone (after a restart), narrowed the same way.
        name: the name it registers under (default ``"fork"``); ``llm_service`` and
            ``max_model_calls`` are as for :class:`~subagent.providers.spawn.SpawnProvider`.

    Every start-time feature is supported, as for :class:`~subagent.providers.spawn.SpawnProvider`.
    A journaled fork continues from its checkpoint (:meth:`reopen`), which holds what it was seeded
    with: it is not forked again, and its parent need not be live. Without ``llm``, that needs a live
    parent to borrow the model from.
    """

    inherits_parent_context = True
    default_name = "fork"

    def start(self, request: SubagentRequest, task_group: anyio.abc.TaskGroup) -> InProcessRun:
        """Fork the parent named by ``request.parent_id``.

        Raises:
            SubagentError: ``START_FAILED`` when the parent is not a live in-process agent here.
        """
        if request.parent_id is None or self.agents.get(request.parent_id) is None:
            raise self._cannot_start(
                f"a fork needs a live in-process parent agent, and {request.parent_id!r} is none "
                f"(live agents: {', '.join(self.agents.list()) or 'none'})"
            )
        return super().start(request, task_group)

    def _history_for(self, request: SubagentRequest, parent: Agent | None) -> Sequence[Message]:
        assert parent is not None
        # The parent's system prompt is replaced by the child's own persona (see _persona_for).
        return tuple(message for message in parent.completed_messages if message.role != "system")

    def _persona_for(self, request: SubagentRequest, parent: Agent | None) -> str | None:
        if request.persona is not None:
            return request.persona
        if self.persona is not None:
            return self.persona
        return parent.persona if parent is not None else None
