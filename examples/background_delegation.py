"""Background delegation: a parent agent starts three subagents, keeps working, and collects their answers.

No network and no keys: the parent and its children run on scripted models (``ScriptedLlm``), the
children in this process (two ``spawn`` children, one ``fork``). Run it with
``python examples/background_delegation.py [asyncio|trio]``; it prints a short transcript.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Any

import anyio

from subagent import SubagentService
from subagent.delegation import BackgroundOptions, Notice
from subagent.providers.fork import ForkProvider
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import (
    Agent,
    AgentRegistry,
    CompletionRequest,
    FunctionTool,
    Reply,
    ScriptedLlm,
    When,
    call,
)
from subagent.tool import SubagentTool

REVIEWS = {"api.py": "spawn", "db.py": "spawn", "web.py": "fork"}
"""The file each child reviews, and the provider it runs on."""

FINDING = re.compile(r"^\w+\.py: .+$", re.MULTILINE)
"""A child's answer as it reads in a notice: ``<file>: <finding>``."""

HANDLE = re.compile(r"(?<=background subagent )[a-z2-9]{6}\b")
"""A background child's handle in a tool result: random, so the transcript shows ``<handle>``."""


def parent_model(request: CompletionRequest) -> Reply:
    """The parent's model: delegate in the background, keep working, wait for every answer, sum up."""
    step = sum(1 for message in request.messages if message.role == "assistant")
    if step == 0:
        return Reply(
            tool_calls=[
                call(
                    "subagent",
                    {"provider": provider, "prompt": f"Review {name} for unsafe calls.", "background": True},
                )
                for name, provider in REVIEWS.items()
            ]
        )
    if step == 1:  # its own work while the children run
        return Reply(tool_calls=[call("outline", {"title": "Security review"})])
    if step == 2:  # every child's result, however many have ended by now
        return Reply(tool_calls=[call("subagent_wait", {"mode": "all", "timeout": 60})])
    collected = next(message.content for message in reversed(request.messages) if message.role == "tool")
    return Reply("Security review: " + " ".join(sorted(FINDING.findall(collected))))


children_model = ScriptedLlm(
    [
        Reply("api.py: eval() of request data on line 12.", when=When(last_user_contains="api.py")),
        Reply("db.py: no unsafe calls.", when=When(last_user_contains="db.py")),
        Reply("web.py: pickle.loads() of a cookie on line 40.", when=When(last_user_contains="web.py")),
    ]
)


def write_outline(arguments: Mapping[str, Any]) -> str:
    return f"Outline of {arguments['title']!r}: 1. findings, 2. fixes."


outline = FunctionTool(
    "outline",
    "Write the outline of the report.",
    {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]},
    write_outline,
)


async def main() -> None:
    agents = AgentRegistry()
    heard: list[Notice] = []
    async with SubagentService() as subagents:
        subagents.register_provider(SpawnProvider(llm=children_model, agents=agents))
        subagents.register_provider(ForkProvider(llm=children_model, agents=agents))
        # Closing the tool (the end of this block) cancels and disposes any child still running.
        async with SubagentTool(subagents, background=BackgroundOptions(), on_notice=heard.append) as tool:
            parent = Agent(
                llm=ScriptedLlm(parent_model), tools=[*tool.agent_tools(), outline], registry=agents
            )
            result = await parent.run_turn("Review api.py, db.py and web.py for unsafe calls.")
            show_transcript(parent)
            show(f"parent: {result.output} ({result.stop_reason})")
            # The host hears of every child too, in the order they ended; sorted here, as that order varies.
            for notice in sorted(heard, key=lambda notice: notice.child.prompt):
                show(f"host heard: {notice.child.state} ({notice.child.provider}): {notice.child.prompt}")
            await parent.close()
        show(f"runs left after the tool closed: {len(subagents.live_runs)}")


def show(line: str) -> None:
    """Print one line of the transcript."""
    print(line)


def show_transcript(parent: Agent) -> None:
    """The parent's log: its prompt, its tool calls and what they returned. Notices that reached the
    log before the wait are left out: how many did depends on how fast the children were."""
    prompt = next(message.content for message in parent.messages if message.role == "user")
    show(f"user: {prompt}")
    for message in parent.messages:
        for tool_call in message.tool_calls:
            show(f"parent calls {tool_call.name} {tool_call.arguments}")
        if message.role != "tool":
            continue
        if message.name == "subagent_wait":
            for finding in sorted(FINDING.findall(message.content)):
                show(f"  -> {finding}")
        else:
            show(f"  -> {HANDLE.sub('<handle>', message.content.split(' Its result', 1)[0])}")


if __name__ == "__main__":
    anyio.run(main, backend=sys.argv[1] if len(sys.argv) > 1 else "asyncio")
