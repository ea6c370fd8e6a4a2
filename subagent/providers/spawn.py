"""The ``spawn`` provider: a fresh in-process child agent that does not see the parent's conversation."""

from __future__ import annotations

from subagent.providers._inprocess import InProcessProvider, InProcessRun

__all__ = ["InProcessRun", "SpawnProvider"]


class SpawnProvider(InProcessProvider):
    """Runs each request in a fresh in-process :class:`~subagent.runtime.Agent`.

    Args:
        llm: the child's adapter, or the name of one in ``llm_service``; None uses the parent
            agent's (when the parent is an in-process agent in ``agents``).
        llm_service: where an adapter name is looked up, at each start.
        agents: the registry of live in-process agents, shared with the parents that delegate
            (a child whose ``parent_id`` is a live agent here inherits its tools and approver);
            default: the process-wide :meth:`~subagent.runtime.AgentRegistry.default`.
        tools: the tools of a child whose parent is not an in-process agent here.
        persona: the system prompt of a child whose request gives none.
        approver: decides on the child's calls of tools that need approval; None inherits the
            parent's (and without any, such calls are refused).
        max_model_calls: model calls one turn may make before it ends with ``max_turns``.
        isolation: where the workspaces of requests with ``isolation`` are made
            (:class:`~subagent.isolation.IsolationSettings`; None: its defaults).
        name: the name it registers under (default ``"spawn"``).

    Every start-time feature is supported: ``output_schema`` (asked for, validated, repaired once),
    ``depth_limit`` (counted by the service), ``tool_filter``, ``persona``, every budget cap and
    ``isolation`` (``worktree`` and ``copy``: the child's cwd, which its tools read, is its workspace).
    Its runs are durable under a service's run journal: a run's checkpoint is its child's log as of its
    last completed turn, and :meth:`reopen` continues it in a new child (not a run that was isolated).
    """

    inherits_parent_context = False
    default_name = "spawn"
