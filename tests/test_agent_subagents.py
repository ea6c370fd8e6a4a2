"""An agent's own subagents, end to end: the stub agent's ``subagent`` step, the ACP provider's run, the CLI.

The stub agent plays a child session as a real agent (claude-agent-acp, codex-acp) does: announced with
``subagent_update`` before its traffic, its updates and questions under its own session id, one ``idle``
snapshot per run. The provider shows each child as a run of its tree (the tool call with
``_meta["subagent-seam/run"]`` that ``subagent serve`` sends), so every view shows it unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import SubagentRequest
from subagent.acp import AgentCapabilityError, schema
from subagent.acp.handlers import PermissionQuestion
from subagent.providers.acp import AcpRun
from subagent.testing._scenario import ScenarioError, parse_scenario
from subagent.types import RUN_META_KEY
from tests.test_acp_provider import WAIT, MakeCommand, provider_for, service_with, stub
from tests.test_cli import JOURNAL_ID, run_cli, scenario
from tests.test_trace_page import trace_data

__all__ = ["stub"]  # the fixture, used by name

USAGE = {"totalTokens": 12, "inputTokens": 10, "outputTokens": 2}

DELEGATING: dict[str, Any] = {
    "turns": [
        [
            {"step": "message", "text": "Delegating."},
            {
                "step": "subagent",
                "sessionId": "child-1",
                "title": "Explore",
                "description": "reads the code",
                "steps": [
                    {"step": "message", "text": "child at work"},
                    {"step": "tool_call", "toolCallId": "c-1", "title": "Run ls", "kind": "execute"},
                    {"step": "permission", "report": True},
                    {"step": "subagent", "sessionId": "grandchild-1", "title": "Deeper", "usage": USAGE},
                ],
                "usage": USAGE,
            },
            {"step": "message", "text": "Done."},
        ]
    ]
}


def rows(updates: list[schema.SessionUpdate]) -> list[tuple[str, str, int, str, str | None]]:
    """(run id, parent id, depth, state, stop reason) of each run row among ``updates``."""
    found = []
    for update in updates:
        meta = getattr(update, "meta", None) or {}
        run = meta.get(RUN_META_KEY)
        if run is not None:
            found.append((run["runId"], run["parentId"], run["depth"], run["state"], run.get("stopReason")))
    return found


def test_a_subagent_steps_own_steps_are_checked_where_they_run() -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(
            json.dumps(
                {
                    "newSession": {
                        "steps": [{"step": "subagent", "sessionId": "c", "steps": [{"step": "echo"}]}]
                    }
                }
            )
        )
    assert "at `$.newSession.steps[0].steps[0]`" in str(caught.value)


@pytest.mark.anyio
@pytest.mark.both_backends
async def test_an_agents_children_show_as_runs_of_its_tree_with_their_usage_and_named_questions(
    stub: MakeCommand, tmp_path: Path
) -> None:
    asked: list[PermissionQuestion] = []

    async def policy(question: PermissionQuestion) -> str | None:
        asked.append(question)
        return "allow"

    provider = provider_for(stub(DELEGATING), tmp_path, permission=policy)
    seen: list[schema.SessionUpdate] = []
    async with (
        service_with(provider) as (service, _events),
        service.start(provider.name, SubagentRequest(prompt="go")) as run,
    ):
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        acp_run.on_update(seen.append)
        of_children: list[tuple[str, str]] = []
        acp_run.on_subagent_update(
            lambda child, update: of_children.append((child.session_id, type(update).__name__))
        )
        with anyio.fail_after(WAIT):
            result = await run.result()
        children = {child.session_id: child for child in acp_run.subagents}
    # The child's traffic is not the parent's: the parent's two messages are one, as nothing came between.
    assert result.output == "Delegating.Done."
    session_id = acp_run.session_id
    assert rows(seen) == [
        ("child-1", session_id, 1, "running", None),
        ("grandchild-1", "child-1", 2, "running", None),
        ("grandchild-1", "child-1", 2, "completed", "completed"),
        ("child-1", session_id, 1, "completed", "completed"),
    ]
    metas = [getattr(update, "meta", None) or {} for update in seen]
    ended = [meta[RUN_META_KEY] for meta in metas if meta.get(RUN_META_KEY, {}).get("state") == "completed"]
    assert [run["usage"] for run in ended] == [USAGE, USAGE]
    assert (children["child-1"].runs, children["child-1"].title, children["child-1"].usage) == (
        1,
        "Explore",
        USAGE,
    )
    assert children["grandchild-1"].parent_session_id == "child-1"
    assert [(q.session_id, q.subagent, q.title) for q in asked] == [("child-1", "Explore", None)]
    # The child's updates are kept on the child, not on the parent's turn, and reach the run's
    # subagent update listeners named by their child.
    assert of_children == [
        ("child-1", "AgentMessageChunk"),
        ("child-1", "ToolCall"),
        ("child-1", "AgentMessageChunk"),  # the permission step's report
        # The grandchild's announcement and idle, sent on its parent's session.
        ("child-1", "UnknownSessionUpdate"),
        ("child-1", "UnknownSessionUpdate"),
    ]
    first = next(u for u in children["child-1"].updates if isinstance(u, schema.AgentMessageChunk))
    assert first.content == schema.TextContent(text="child at work")


@pytest.mark.anyio
async def test_a_run_cancels_one_child_and_the_turn_goes_on(stub: MakeCommand, tmp_path: Path) -> None:
    scenario_data = {
        "turns": [
            [
                {
                    "step": "subagent",
                    "sessionId": "slow",
                    "steps": [
                        {"step": "message", "text": "waiting"},
                        {"step": "wait_for_cancel", "timeout": 30},
                    ],
                },
                {"step": "subagent", "sessionId": "stubborn", "cancel": False, "steps": []},
                {"step": "message", "text": "parent went on"},
            ]
        ]
    }
    provider = provider_for(stub(scenario_data), tmp_path)
    async with (
        service_with(provider) as (service, _events),
        service.start(provider.name, SubagentRequest(prompt="go")) as run,
    ):
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        waiting = anyio.Event()
        acp_run.on_update(lambda update: waiting.set() if rows([update]) else None)
        with anyio.fail_after(WAIT):
            await waiting.wait()
            await acp_run.cancel_subagent("slow")
            result = await run.result()
        with pytest.raises(LookupError):
            await acp_run.cancel_subagent("nobody")
        with pytest.raises(AgentCapabilityError):
            await acp_run.cancel_subagent("stubborn")
        children = {child.session_id: child for child in acp_run.subagents}
    assert (result.stop_reason, result.output) == ("completed", "parent went on")
    assert (children["slow"].runs, children["slow"].stop_reason) == (1, "cancelled")


def test_json_lists_the_agents_children_with_their_usage(tmp_path: Path) -> None:
    command = scenario(tmp_path, DELEGATING)
    finished = run_cli(tmp_path, "run", "--json", "--permission", "allow", "-p", "go", "--", *command)
    assert finished.status == 0, finished.stderr
    report = finished.json()
    runs = report["runs"]
    assert [(run["runId"], run["depth"], run["title"], run["state"], run["usage"]) for run in runs] == [
        ("child-1", 1, "Explore", "completed", USAGE),
        ("grandchild-1", 2, "Deeper", "completed", USAGE),
    ]
    assert report["subtreeUsage"] == {"inputTokens": 20, "outputTokens": 4, "totalTokens": 24}


def test_json_shows_a_child_that_told_only_its_context_window_with_it_and_no_subtree_total(
    tmp_path: Path,
) -> None:
    # As Codex tells of its subagents: a usage_update under the child's id, nothing in its idle.
    context = {"sessionUpdate": "usage_update", "used": 133, "size": 258400}
    child = {
        "step": "subagent",
        "sessionId": "c",
        "title": "Errand",
        "steps": [{"step": "update", "update": context}],
    }
    parent_usage = {"inputTokens": 30, "outputTokens": 15, "totalTokens": 45}
    turn = [child, {"step": "stop", "usage": parent_usage}]
    command = scenario(tmp_path, {"turns": [turn]})
    finished = run_cli(tmp_path, "run", "--json", "--permission", "allow", "-p", "go", "--", *command)
    assert finished.status == 0, finished.stderr
    report = finished.json()
    assert [(run["runId"], run["usage"]) for run in report["runs"]] == [
        ("c", {"contextUsed": 133, "contextSize": 258400})
    ]
    # What the child spent is unknown: the agent's own usage is not passed off as the tree's.
    assert (report["usage"], "subtreeUsage" in report) == (parent_usage, False)


def test_no_subagents_tells_the_agent_nothing_and_lists_no_runs(tmp_path: Path) -> None:
    command = scenario(tmp_path, DELEGATING)
    finished = run_cli(
        tmp_path, "run", "--json", "--no-subagents", "--permission", "allow", "-p", "go", "--", *command
    )
    assert finished.status == 0, finished.stderr
    # Not told, the stub agent plays no child (as the RFD requires), so nothing of one reaches the report.
    assert finished.json() == {
        "output": "Delegating.Done.",
        "stopReason": "completed",
        "error": None,
        "usage": None,
        "journalId": JOURNAL_ID,
    }


@pytest.mark.subprocess
def test_events_and_progress_show_the_agents_children_as_the_tree_below_the_clis_run(tmp_path: Path) -> None:
    command = scenario(tmp_path, DELEGATING)
    done = run_cli(tmp_path, "run", "--events", "--permission", "allow", "-p", "go", "--", *command)
    assert done.status == 0, done.stderr
    events = done.events()
    (start,) = (event for event in events if event["event"] == "start")
    runs = [
        (event["runId"], event["parentId"], event["depth"], event["state"], event["title"])
        for event in events
        if event["event"] == "run"
    ]
    assert runs == [
        ("child-1", start["runId"], 1, "running", "Explore"),
        ("grandchild-1", "child-1", 2, "running", "Deeper"),
        ("grandchild-1", "child-1", 2, "completed", "Deeper"),
        ("child-1", start["runId"], 1, "completed", "Explore"),
    ]
    (asked,) = (event for event in events if event["event"] == "permission")
    progress = run_cli(tmp_path, "run", "--progress", "--permission", "allow", "-p", "go", "--", *command)
    assert [line for line in progress.stderr.splitlines() if line.lstrip().startswith("run ")] == [
        "  run Explore: in_progress",
        "    run Deeper: in_progress",
        "    run Deeper: completed",
        "  run Explore: completed",
    ]
    # Named by the child's own tool call: the question carries only its id.
    assert (asked["toolCallId"], asked["subagent"], asked["title"], asked["outcome"]) == (
        "c-1",
        "Explore",
        "Run ls",
        "selected",
    )


@pytest.mark.subprocess
def test_the_trace_page_shows_the_agents_children_below_its_run_with_their_usage(tmp_path: Path) -> None:
    command = scenario(tmp_path, DELEGATING)
    page = tmp_path / "trace.html"
    done = run_cli(tmp_path, "run", "--trace", str(page), "--permission", "allow", "-p", "go", "--", *command)
    assert done.status == 0, done.stderr
    runs = trace_data(page.read_text())["runs"]
    assert [
        (run["depth"], run["title"], run["state"], run["stopReason"], run["usage"]) for run in runs[1:]
    ] == [
        (1, "Explore", "completed", "completed", USAGE),
        (2, "Deeper", "completed", "completed", USAGE),
    ]
    assert [run["parent"] for run in runs[1:]] == [runs[0]["id"], runs[1]["id"]]


@pytest.mark.anyio
async def test_a_childs_ended_row_carries_its_last_message_after_its_last_tool_call(
    stub: MakeCommand, tmp_path: Path
) -> None:
    steps = [
        {"step": "message", "text": "looking"},
        {"step": "tool_call", "toolCallId": "c-1", "title": "Run ls", "kind": "execute"},
        {"step": "message", "text": "Three "},
        {"step": "message", "text": "files."},
    ]
    child = {"step": "subagent", "sessionId": "child-1", "title": "Count", "steps": steps}
    provider = provider_for(stub({"turns": [[child, {"step": "message", "text": "Done."}]]}), tmp_path)
    seen: list[schema.SessionUpdate] = []
    async with (
        service_with(provider) as (service, _events),
        service.start(provider.name, SubagentRequest(prompt="go")) as run,
    ):
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        acp_run.on_update(seen.append)
        with anyio.fail_after(WAIT):
            result = await run.result()
    assert result.output == "Done."
    (ended,) = [u for u in seen if isinstance(u, schema.ToolCallProgress) and u.status == "completed"]
    assert ended.content == [schema.Content(content=schema.TextContent(text="Three files."))]
    assert ended.meta is not None
    assert ended.meta[RUN_META_KEY]["provider"] == provider.name  # no provider named by the agent: the run's
