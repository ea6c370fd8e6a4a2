"""`subagent run` against `subagent serve`: the served agent's whole tree of runs, as `run` events
under `--events` and as indented lines under `--progress`.

The served agent is scripted: the session delegates to a spawned child, which delegates to a
grandchild. Each CLI run is a subprocess bounded by `tests.test_cli.run_cli`, which also checks that
nothing it started outlived it.
"""

from __future__ import annotations

import io
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Final

import pytest

from subagent.acp import schema
from subagent.cli._console import Console
from subagent.cli._tool_call_tracker import ToolCallState
from subagent.cli._views import EventView, HumanView, StartInfo
from subagent.types import RUN_META_KEY
from tests.test_cli import JOURNAL_ID, run_cli


def delegation(asked: str, prompt: str) -> dict[str, Any]:
    """A scripted reply to ``asked`` that delegates ``prompt`` to a spawned child."""
    arguments = {"provider": "spawn", "prompt": prompt}
    return {
        "when": {"last_user_contains": asked, "after_tool_result": False},
        "tool_calls": [{"name": "subagent", "arguments": arguments}],
    }


THREE_LEVELS: Final = [
    delegation("go", "child task"),
    delegation("child task", "grandchild task"),
    {"when": {"last_user_contains": "grandchild task"}, "text": "leaf answer"},
    {"when": {"last_user_contains": "child task", "after_tool_result": True}, "text": "child answer"},
    {"when": {"last_user_contains": "go", "after_tool_result": True}, "text": "Done."},
]


def served_agent(tmp_path: Path) -> list[str]:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(THREE_LEVELS))
    return [sys.executable, "-m", "subagent", "serve", "--script", str(script)]


@pytest.mark.subprocess
def test_events_show_the_served_agents_runs_as_one_tree_rooted_at_the_clis_run(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "run", "--events", "-p", "go", "--", *served_agent(tmp_path))
    assert (done.status, done.stdout) == (0, "Done.\n")
    events = done.events()
    (start,) = (event for event in events if event["event"] == "start")
    root, session_id = start["runId"], start["sessionId"]
    runs: list[dict[str, Any]] = []
    for before, event in itertools.pairwise(events):
        if event["event"] != "run":
            continue
        # Each `run` event follows the update it was read from.
        update = before["update"]
        assert before["event"] == "update"
        assert update["toolCallId"] == f"run/{event['runId']}"
        assert update["_meta"]["subagent-seam/run"]["parentId"] in (session_id, event["parentId"])
        heartbeat = update["sessionUpdate"] == "tool_call_update" and "status" not in update
        if not heartbeat:  # a slow machine may add one; what it says is tested with serve itself
            runs.append(event)
    child, grandchild = runs[0]["runId"], runs[1]["runId"]
    assert child != grandchild
    assert child != root
    assert runs == [
        {
            "event": "run",
            "runId": child,
            "parentId": root,
            "provider": "spawn",
            "state": "running",
            "stopReason": None,
            "depth": 1,
            "title": "spawn subagent: child task",
        },
        {
            "event": "run",
            "runId": grandchild,
            "parentId": child,
            "provider": "spawn",
            "state": "running",
            "stopReason": None,
            "depth": 2,
            "title": "spawn subagent: grandchild task",
        },
        {
            "event": "run",
            "runId": grandchild,
            "parentId": child,
            "provider": "spawn",
            "state": "completed",
            "stopReason": "completed",
            "depth": 2,
            "title": "spawn subagent: grandchild task",
        },
        {
            "event": "run",
            "runId": child,
            "parentId": root,
            "provider": "spawn",
            "state": "completed",
            "stopReason": "completed",
            "depth": 1,
            "title": "spawn subagent: child task",
        },
    ]


@pytest.mark.subprocess
def test_progress_shows_each_run_start_and_end_indented_by_its_depth(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "run", "--progress", "-p", "go", "--", *served_agent(tmp_path))
    assert (done.status, done.stdout) == (0, "Done.\n")
    assert [line for line in done.stderr.splitlines() if line.lstrip().startswith("run ")] == [
        "  run spawn subagent: child task: in_progress",
        "    run spawn subagent: grandchild task: in_progress",
        "    run spawn subagent: grandchild task: completed",
        "  run spawn subagent: child task: completed",
    ]


@pytest.mark.subprocess
def test_events_show_background_children_and_their_own_children_in_the_tree(tmp_path: Path) -> None:
    started = delegation("go", "child task")
    started["tool_calls"] = [
        {"name": "subagent", "arguments": {"provider": "spawn", "prompt": prompt, "background": True}}
        for prompt in ("child task", "other task")
    ]
    script = {
        "replies": [
            started,
            delegation("child task", "grandchild task"),
            {"when": {"last_user_contains": "grandchild task"}, "text": "leaf answer"},
            {"when": {"last_user_contains": "child task", "after_tool_result": True}, "text": "child answer"},
            {"when": {"last_user_contains": "other task"}, "text": "other answer"},
            {"when": {"last_user_contains": "go", "after_tool_result": True}, "text": "Started."},
        ],
        # However the notices fall into the parent's turns, it answers this once they are all in.
        "fallback": "All done.",
    }
    path = tmp_path / "background.json"
    path.write_text(json.dumps(script))
    agent = [sys.executable, "-m", "subagent", "serve", "--script", str(path)]
    done = run_cli(tmp_path, "run", "--events", "-p", "go", "--", *agent)
    assert (done.status, done.stdout) == (0, "All done.\n")
    events = done.events()
    (start,) = (event for event in events if event["event"] == "start")
    states: dict[str, list[str]] = {}
    links: dict[str, tuple[str, int, str]] = {}
    for event in events:
        if event["event"] == "run":
            states.setdefault(event["runId"], []).append(event["state"])
            links[event["runId"]] = (event["parentId"], event["depth"], event["title"])
    by_title = {title: run for run, (_, _, title) in links.items()}
    child = by_title["spawn subagent: child task"]
    other = by_title["spawn subagent: other task"]
    grandchild = by_title["spawn subagent: grandchild task"]
    assert links == {
        child: (start["runId"], 1, "spawn subagent: child task"),
        other: (start["runId"], 1, "spawn subagent: other task"),
        grandchild: (child, 2, "spawn subagent: grandchild task"),
    }
    # Each run shows running (more than once if a heartbeat came), then completed, once.
    for run_states in states.values():
        assert run_states[-1] == "completed"
        assert set(run_states[:-1]) == {"running"}


# -- what an agent sends is checked, not trusted ---------------------------------------------------------


def run_update(run: Any) -> schema.ToolCallProgress:
    meta = {RUN_META_KEY: run}
    return schema.ToolCallProgress(tool_call_id="run/x", title="a run", status="completed", meta=meta)


def test_a_run_event_takes_only_well_typed_members_from_the_agent() -> None:
    stream = io.StringIO()
    view = EventView(stream)
    view.started(StartInfo("cli-run", "session-1", ["agent"], "/", None, None, 1))
    view.update(run_update({"runId": "r1", "parentId": "session-1", "depth": 1, "state": "completed"}), None)
    mistyped = {"runId": "r2", "parentId": 7, "depth": True, "state": ["x"], "provider": None}
    view.update(run_update(mistyped), None)
    view.update(run_update({"runId": 3}), None)  # no string id: not a run
    view.update(run_update("not a mapping"), None)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert all(isinstance(line.pop("time"), float | int) for line in lines)
    runs = [event for event in lines if event["event"] == "run"]
    assert runs == [
        {
            "event": "run",
            "runId": "r1",
            "parentId": "cli-run",
            "provider": None,
            "state": "completed",
            "stopReason": None,
            "depth": 1,
            "title": "a run",
        },
        {
            "event": "run",
            "runId": "r2",
            "parentId": None,
            "provider": None,
            "state": None,
            "stopReason": None,
            "depth": None,
            "title": "a run",
        },
    ]


@pytest.mark.parametrize(("depth", "indent"), [(1, 2), (3, 6), (10**9, 2), ("deep", 2), (-4, 2)])
def test_a_progress_line_is_indented_by_a_sane_depth_only(depth: Any, indent: int) -> None:
    stream = io.StringIO()
    view = HumanView(Console(stream, color=False), progress=True)
    update = run_update({"runId": "r1", "depth": depth})
    view.update(update, ToolCallState("run/r1", title="a run", status="completed"))
    assert stream.getvalue() == " " * indent + "run a run: completed\n"


@pytest.mark.subprocess
def test_json_output_gives_the_whole_trees_usage_beside_the_agents_own(tmp_path: Path) -> None:
    def costing(reply: dict[str, Any], input_tokens: int, output_tokens: int) -> dict[str, Any]:
        return {**reply, "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}

    script = tmp_path / "script.json"
    leaf, child, done = THREE_LEVELS[2:]
    script.write_text(
        json.dumps([*THREE_LEVELS[:2], costing(leaf, 100, 10), costing(child, 20, 2), costing(done, 3, 1)])
    )
    served = [sys.executable, "-m", "subagent", "serve", "--script", str(script)]
    finished = run_cli(tmp_path, "run", "--json", "-p", "go", "--", *served)
    assert finished.status == 0
    report = finished.json()
    # Each run of the tree, as last reported: the child below the session, the grandchild below it.
    runs = report.pop("runs")
    shown = [(run["provider"], run["depth"], run["state"], run["stopReason"], run["usage"]) for run in runs]
    assert shown == [
        # As ACP usage (the idle snapshots of subagent sessions): with its totalTokens, like the agent's own.
        ("spawn", 1, "completed", "completed", {"inputTokens": 20, "outputTokens": 2, "totalTokens": 22}),
        ("spawn", 2, "completed", "completed", {"inputTokens": 100, "outputTokens": 10, "totalTokens": 110}),
    ]
    assert runs[1]["parentId"] == runs[0]["runId"]
    # The agent's own turn is the last reply (3 + 1); the tree adds the child's and the grandchild's.
    assert report == {
        "output": "Done.",
        "stopReason": "completed",
        "error": None,
        "usage": {"inputTokens": 3, "outputTokens": 1, "totalTokens": 4},
        "subtreeUsage": {"inputTokens": 123, "outputTokens": 13, "totalTokens": 136},
        "journalId": JOURNAL_ID,
    }
