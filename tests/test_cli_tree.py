"""`subagent run` against `subagent serve`: the served agent's whole tree of runs, as `run` events
under `--events` and as indented lines under `--progress`.

The served agent is scripted: the session delegates to a spawned child, which delegates to a
grandchild. Each CLI run is a subprocess bounded by `tests.test_cli.run_cli`, which also checks that
nothing it started outlived it.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any, Final

import pytest

from tests.test_cli import run_cli

pytestmark = pytest.mark.subprocess


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


def test_progress_shows_each_run_start_and_end_indented_by_its_depth(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "run", "--progress", "-p", "go", "--", *served_agent(tmp_path))
    assert (done.status, done.stdout) == (0, "Done.\n")
    assert [line for line in done.stderr.splitlines() if line.lstrip().startswith("run ")] == [
        "  run spawn subagent: child task: in_progress",
        "    run spawn subagent: grandchild task: in_progress",
        "    run spawn subagent: grandchild task: completed",
        "  run spawn subagent: child task: completed",
    ]


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
