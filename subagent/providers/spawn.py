"""The ``spawn`` provider: a fresh in-process child agent that does not see the parent's conversation."""

from __future__ import annotations

from collections.abc import Sequence

from subagent.providers._inprocess import InProcessProvider, InProcessRun
from subagent.runtime.agent import DEFAULT_MAX_MODEL_CALLS, AgentRegistry
from subagent.runtime.llm import LlmAdapter, LlmService
from subagent.runtime.tools import Approver, Tool

__all__ = ["InProcessRun", "SpawnProvider"]


class SpawnProvider(InProcessProvider):
    """Runs each request in a fresh in-process :class:`~subagent.runtime.Agent`.

    Args:
        llm: the child's adapter, or the name of one in ``llm_service``; None uses the parent
            agent's (when the parent is an in-process agent in ``agents``).
        llm_service: where an adapter name is looked up, at each start.
        agents: the registry of live in-process agents, shared with the parents that delegate
            (a child whose ``parent_id`` is a live agent here inherits its tools and approver).
        tools: the tools of a child whose parent is not an in-process agent here.
        persona: the system prompt of a child whose request gives none.
        approver: decides on the child's calls of tools that need approval; None inherits the
            parent's (and without any, such calls are refused).
        max_model_calls: model calls one turn may make before it ends with ``max_turns``.

    Every start-time feature is supported: ``output_schema`` (asked for, validated, repaired once),
    ``depth_limit`` (counted by the service), ``tool_filter`` and ``persona``.
    """

    inherits_parent_context = False

    def __init__(
        self,
        *,
        llm: LlmAdapter | str | None = None,
        llm_service: LlmService | None = None,
        agents: AgentRegistry | None = None,
        tools: Sequence[Tool] = (),
        persona: str | None = None,
        approver: Approver | None = None,
        max_model_calls: int = DEFAULT_MAX_MODEL_CALLS,
        name: str = "spawn",
    ) -> None:
        super().__init__(
            name=name,
            llm=llm,
            llm_service=llm_service,
            agents=agents,
            tools=tools,
            persona=persona,
            approver=approver,
            max_model_calls=max_model_calls,
        )
