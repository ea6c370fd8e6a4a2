"""The in-process half of ``subagent demo``: one agent delegates to ``spawn``, ``fork`` and ``acp`` at once.

A root :class:`~subagent.runtime.Agent` runs on a scripted model (no network, no keys) with the
``subagent`` tool. Its first turn drafts a plan; its second delegates three tasks in one answer, so
the three children run concurrently: a fork that reviews the plan (it sees the first turn, because
a fork inherits the completed turns), a spawned child that counts TODOs with structured output and
no tools of its own, and the bundled stub ACP agent in a child process. The scripted model answers
from what each request really contains, so what is printed is what flowed through the seam.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Final

import anyio

from subagent.cli._console import Console, sanitize
from subagent.cli._runs_command import interrupted_notice
from subagent.delegation._subagent_tool import SubagentTool
from subagent.journal import RunJournal
from subagent.providers.acp import AcpProvider
from subagent.providers.fork import ForkProvider
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import (
    Agent,
    AgentEvent,
    AgentRegistry,
    CompletionRequest,
    FunctionTool,
    Reply,
    ScriptedLlm,
    ToolCallFinished,
    ToolCallStarted,
    call,
)
from subagent.service import SubagentService
from subagent.types import SubagentResult, SubagentRunEndInfo, SubagentRunInfo

__all__ = ["DEMO_DELEGATION_PROMPT", "DEMO_PLAN_PROMPT", "run_delegation_demo"]

DEMO_PLAN_PROMPT: Final = "We ship version 2.0 on Friday. Draft a three-step release plan."
DEMO_DELEGATION_PROMPT: Final = (
    "Get the plan reviewed, count the open TODOs in the release notes, and have the ACP agent "
    "summarise the README; then report."
)
_PLAN: Final = "1. freeze the branch on Wednesday; 2. run the full test suite; 3. tag v2.0 on Friday."
_NOTES: Final = (
    "Release notes for 2.0\n- TODO: changelog\n- TODO: upgrade guide\n- done: new CLI\n- TODO: docs"
)
_REVIEW_TASK: Final = "Review the release plan you drafted earlier: what is its biggest risk?"
_COUNT_TASK: Final = "Count the TODO markers in the release notes (read them with the notes tool)."
_ACP_TASK: Final = "Summarise README.md."
_TODO_SCHEMA: Final = {
    "type": "object",
    "properties": {"todos": {"type": "integer", "minimum": 0}},
    "required": ["todos"],
    "additionalProperties": False,
}


def _last_user(request: CompletionRequest) -> str:
    return next((m.content for m in reversed(request.messages) if m.role == "user"), "")


def _demo_model(request: CompletionRequest) -> Reply:
    """A scripted model that reads its requests: each answer is derived from what the agent sent."""
    messages = request.messages
    last_user = _last_user(request)
    if messages[-1].role == "tool":
        if any(m.name == "read_notes" for m in messages if m.role == "tool"):
            notes = next(m.content for m in messages if m.role == "tool" and m.name == "read_notes")
            return Reply(json.dumps({"todos": notes.count("TODO")}))
        # The root reads its children's answers (the results of its last tool calls) and reports them.
        asked = next(m for m in reversed(messages) if m.role == "assistant" and m.tool_calls)
        answers = {m.tool_call_id: m.content for m in messages if m.role == "tool"}
        lines = [
            f"- {json.loads(c.arguments).get('provider')}: {answers.get(c.id, '(no answer)')}"
            for c in asked.tool_calls
        ]
        return Reply("Report:\n" + "\n".join(lines))
    if last_user.startswith(DEMO_PLAN_PROMPT):
        return Reply(f"Plan: {_PLAN}")
    if last_user.startswith(_REVIEW_TASK):
        # A fork sees the parent's completed turns: the plan is in its context.
        saw_plan = any(_PLAN in m.content for m in messages if m.role == "assistant")
        verdict = "the suite runs only two days before the tag" if saw_plan else "I cannot see any plan"
        return Reply(f"Review (fork, plan {'seen' if saw_plan else 'not seen'}): biggest risk: {verdict}.")
    if last_user.startswith(_COUNT_TASK):
        return Reply(tool_calls=[call("read_notes", {})])
    if last_user.startswith(DEMO_DELEGATION_PROMPT):
        return Reply(
            tool_calls=[
                call("subagent", {"provider": "fork", "prompt": _REVIEW_TASK}),
                call(
                    "subagent",
                    {
                        "provider": "spawn",
                        "prompt": _COUNT_TASK,
                        "output_schema": _TODO_SCHEMA,
                        "tool_filter": {"allow": ["read_notes"]},
                        "depth_limit": 0,
                    },
                ),
                call("subagent", {"provider": "acp", "prompt": _ACP_TASK}),
            ]
        )
    return Reply(f"(the demo model has no scripted answer for {last_user[:80]!r})")


async def run_delegation_demo(console: Console, journal: RunJournal | None = None, resume: str = "") -> str:
    """Run the delegation demo, narrating on ``console`` and recording the children in ``journal`` (when
    given: ``resume`` is the command that continues an interrupted run of it); return the root agent's
    final report."""
    agents = AgentRegistry()
    llm = ScriptedLlm(_demo_model)
    notes_tool = FunctionTool(
        "read_notes", "Read the release notes.", {"type": "object", "properties": {}}, lambda _args: _NOTES
    )
    async with SubagentService(progress_interval=None, journal=journal) as subagents:
        if subagents.interrupted:
            for line in interrupted_notice(subagents.interrupted, resume):
                console.line(line)
        subagents.register_provider(ForkProvider(agents=agents))
        subagents.register_provider(SpawnProvider(agents=agents, llm=llm))
        subagents.register_provider(
            AcpProvider([sys.executable, "-m", "subagent.testing.stub_agent"], permission="allow")
        )
        subagents.events.on("subagent/start", _narrate_start(console, agents))
        subagents.events.on("subagent/end", _narrate_end(console))
        with SubagentTool(subagents) as tool:
            root = Agent(
                llm=llm,
                id="root",
                persona="You coordinate the release of version 2.0.",
                tools=[tool.for_agents(), notes_tool],
                registry=agents,
            )
            root.on_event(_narrate_root(console))
            try:
                console.line(console.paint(f"> {DEMO_PLAN_PROMPT}", "2"))
                first = await root.run_turn(DEMO_PLAN_PROMPT)
                console.line(f"root: {sanitize(first.output)}")
                console.line(console.paint(f"> {DEMO_DELEGATION_PROMPT}", "2"))
                second: SubagentResult = await root.run_turn(DEMO_DELEGATION_PROMPT)
            finally:
                await root.close()
    if second.stop_reason != "completed":
        raise RuntimeError(f"the demo's root agent stopped with {second.stop_reason}: {second.error}")
    return second.output


def _narrate_start(console: Console, agents: AgentRegistry) -> Callable[[SubagentRunInfo], None]:
    def narrate(info: SubagentRunInfo) -> None:
        child = agents.get(info.id)
        where = f"in-process, depth {child.depth}, tools: {_tool_names(child)}" if child else "child process"
        console.line(f"  {info.id} started ({info.provider}; {where}): {sanitize(info.prompt)}")

    return narrate


def _tool_names(agent: Agent) -> str:
    return ", ".join(tool.spec.name for tool in agent.tools) or "none"


def _narrate_end(console: Console) -> Callable[[SubagentRunEndInfo], None]:
    def narrate(info: SubagentRunEndInfo) -> None:
        said = sanitize(info.last_assistant_message or info.error or "").replace("\n", " ")
        console.line(f"  {info.id} {info.stop_reason or 'failed'}: {said}")

    return narrate


def _narrate_root(console: Console) -> Callable[[AgentEvent], None]:
    def narrate(event: AgentEvent) -> None:
        if isinstance(event, ToolCallStarted) and event.invocation.tool == "subagent":
            arguments = event.invocation.arguments
            console.line(
                f"  root delegates to {arguments.get('provider')}: {sanitize(str(arguments['prompt']))}"
            )
        elif isinstance(event, ToolCallFinished) and event.is_error:
            console.line(f"  root's call {event.call.name} failed: {sanitize(event.output)}")

    return narrate


if __name__ == "__main__":  # pragma: no cover - a quick look without the CLI
    print(anyio.run(run_delegation_demo, Console(sys.stderr, color=False)))  # noqa: T201
