"""The trace page: `subagent run --trace`, `--events-file`, `subagent trace`, the page builder, and the
page as a real headless chromium renders it (tests/chromium.py; skipped without chromium unless
SUBAGENT_REQUIRE_CHROMIUM=1).

The recorded run is `subagent run` against `subagent serve` on a scripted model that delegates three
levels down: the session to alpha, alpha to beta, beta to gamma. `make trace-screenshot` runs the
screenshot test with SUBAGENT_TRACE_SCREENSHOT=docs/trace-page.png to regenerate the picture.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import tracemalloc
from pathlib import Path
from typing import Any, Final

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from subagent.cli._commands import DEMO_PROMPT
from subagent.cli._recording import FanOut
from subagent.cli._views import RunView
from subagent.observability import (
    MAX_KEPT_MARKS,
    MAX_MARKS,
    MAX_RUNS,
    MAX_TEXT_CHARS,
    TraceBuilder,
    render_trace_page,
)
from subagent.observability._trace_page import MAX_KEPT_TEXT_BYTES
from subagent.types import TURN_META_KEY
from tests.chromium import open_page
from tests.leaks import assert_no_leaks
from tests.test_cli import ASKING_TURN, LiveCli, one_turn, run_cli, scenario

HOSTILE_PROMPT: Final = "go </script><script>alert(1)</script> <!-- & <b>bold</b>"


def delegation(asked: str, prompt: str, tokens: int) -> dict[str, Any]:
    """A scripted reply to ``asked`` that delegates ``prompt`` to a spawned child."""
    return {
        "when": {"last_user_contains": asked, "after_tool_result": False},
        "tool_calls": [{"name": "subagent", "arguments": {"provider": "spawn", "prompt": prompt}}],
        "usage": {"input_tokens": tokens, "output_tokens": tokens // 4},
    }


THREE_LEVELS_DOWN: Final = [
    delegation("go", "alpha: survey the repository", 1200),
    delegation("alpha", "beta: read the tests", 800),
    delegation("beta", "gamma: count the files", 400),
    {"when": {"last_user_contains": "gamma"}, "text": "There are 3 files.", "usage": {"input_tokens": 40}},
    {"when": {"last_user_contains": "beta", "after_tool_result": True}, "text": "beta: 3 files"},
    {"when": {"last_user_contains": "alpha", "after_tool_result": True}, "text": "alpha: all read"},
    {"when": {"last_user_contains": "go", "after_tool_result": True}, "text": "Done: 3 files."},
]


def trace_data(html: str) -> dict[str, Any]:
    """The data a page embeds."""
    found = re.search(r'<script type="application/json" id="trace-data">(.*?)</script>', html, re.S)
    assert found is not None
    data: dict[str, Any] = json.loads(found.group(1))
    return data


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding `events.jsonl` and `trace.html` of one recorded three-level run."""
    where = tmp_path_factory.mktemp("recorded")
    script = where / "script.json"
    script.write_text(json.dumps(THREE_LEVELS_DOWN))
    agent = [sys.executable, "-m", "subagent", "serve", "--script", str(script)]
    done = run_cli(
        where,
        "run",
        "--events-file",
        str(where / "events.jsonl"),
        "--trace",
        str(where / "trace.html"),
        "-p",
        HOSTILE_PROMPT,
        "--",
        *agent,
    )
    assert (done.status, done.stdout) == (0, "Done: 3 files.\n")
    (where / "stderr.txt").write_text(done.stderr)
    return where


# -- the CLI ------------------------------------------------------------------------------------------------


@pytest.mark.subprocess
def test_trace_and_events_file_record_the_run_while_stderr_keeps_its_human_view(recorded: Path) -> None:
    events = [json.loads(line) for line in (recorded / "events.jsonl").read_text().splitlines()]
    assert [event["event"] for event in events[:3]] == ["prompt", "spawn", "start"]
    assert events[0]["text"] == HOSTILE_PROMPT
    assert events[0]["chars"] == len(HOSTILE_PROMPT)
    assert events[-1]["event"] == "end"
    assert [
        event["title"] for event in events if event["event"] == "run" and event["state"] == "completed"
    ] == [
        "spawn subagent: gamma: count the files",
        "spawn subagent: beta: read the tests",
        "spawn subagent: alpha: survey the repository",
    ]
    # Not a terminal and no --events: stderr shows nothing, as without --events-file and --trace.
    assert (recorded / "stderr.txt").read_text() == ""
    # The page from the run and the page from its events file show the same (their clocks were read apart).
    untimed = ("id", "parent", "depth", "title", "state", "prompt", "output", "usage")
    from_run = trace_data((recorded / "trace.html").read_text())["runs"]
    from_file = trace_data(render_trace_page(events))["runs"]
    assert [[run[key] for key in untimed] for run in from_run] == [
        [run[key] for key in untimed] for run in from_file
    ]
    assert [[mark[3] for mark in run["marks"]] for run in from_run] == [
        [mark[3] for mark in run["marks"]] for run in from_file
    ]


@pytest.mark.subprocess
def test_the_trace_shows_the_run_tree_in_order_with_prompts_outputs_and_usage(recorded: Path) -> None:
    html = (recorded / "trace.html").read_text()
    assert (
        "<title>subagent trace: go &lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt; &lt;!-- &amp; "
        in html
    )
    data = trace_data(html)
    runs = data["runs"]
    assert [
        (run["depth"], run["provider"], run["title"], run["state"], run["stopReason"]) for run in runs
    ] == [
        (0, "acp", "subagent-seam agent 0.1.0", "completed", "completed"),
        (1, "spawn", "spawn subagent: alpha: survey the repository", "completed", "completed"),
        (2, "spawn", "spawn subagent: beta: read the tests", "completed", "completed"),
        (3, "spawn", "spawn subagent: gamma: count the files", "completed", "completed"),
    ]
    assert [run["parent"] for run in runs[1:]] == [run["id"] for run in runs[:-1]]
    assert [run["prompt"] for run in runs] == [
        HOSTILE_PROMPT,
        "alpha: survey the repository",
        "beta: read the tests",
        "gamma: count the files",
    ]
    assert [run["output"] for run in runs] == [
        "Done: 3 files.",
        "alpha: all read",
        "beta: 3 files",
        "There are 3 files.",
    ]
    assert runs[3]["usage"] == {"inputTokens": 40}
    assert runs[0]["usage"]["inputTokens"] >= 1200
    for run in runs:
        assert 0 <= run["start"] <= run["end"] <= data["duration"]
    # Each delegating run shows its own delegating tool call, ended.
    for run in runs[:3]:
        assert [(kind, status) for kind, _, _, _, status in run["marks"] if kind == "tool"] == [
            ("tool", "completed")
        ]


@pytest.mark.subprocess
def test_events_file_holds_the_prompt_then_the_lines_events_writes_on_stderr(tmp_path: Path) -> None:
    agent = scenario(tmp_path, one_turn(*ASKING_TURN))
    events_file = tmp_path / "events.jsonl"
    done = run_cli(tmp_path, "run", "--events", "--events-file", str(events_file), "--permission", "allow",
                   "-p", "edit it", "--", *agent)  # fmt: skip
    assert (done.status, done.stdout) == (0, "I edited config.json.\n")
    recorded = [json.loads(line) for line in events_file.read_text().splitlines()]
    for line in recorded:
        line.pop("time")
    assert recorded == [{"event": "prompt", "text": "edit it", "chars": 7}, *done.events()]


@pytest.mark.subprocess
def test_the_demos_trace_shows_its_tool_calls_and_the_permission_it_answered(tmp_path: Path) -> None:
    page = tmp_path / "demo.html"
    done = run_cli(tmp_path, "demo", "--only", "acp", "--no-progress", "--trace", str(page))
    assert done.status == 0
    (root,) = trace_data(page.read_text())["runs"]
    assert (root["title"], root["state"], root["prompt"]) == ("Stub agent 0.1.0", "completed", DEMO_PROMPT)
    assert [(kind, label, status) for kind, _, _, label, status in root["marks"]] == [
        ("text", "answer text", None),
        ("tool", "Read README.md", "completed"),
        ("tool", "Write SUMMARY.md", "completed"),
        ("permission", "permission: Write SUMMARY.md", "allow_once (demo)"),
        ("text", "answer text", None),
    ]


@pytest.mark.subprocess
def test_trace_command_writes_the_page_of_an_events_file(recorded: Path, tmp_path: Path) -> None:
    page = tmp_path / "page.html"
    done = run_cli(
        tmp_path, "trace", str(recorded / "events.jsonl"), "-o", str(page), "--title", "three levels"
    )
    assert (done.status, done.stdout, done.stderr) == (0, "", "")
    html = page.read_text()
    assert "<title>three levels</title>" in html
    assert len(trace_data(html)["runs"]) == 4
    assert [path.name for path in tmp_path.iterdir() if path.name.endswith(".tmp")] == []


@pytest.mark.subprocess
def test_trace_command_refuses_a_malformed_line_naming_its_number_and_writes_nothing(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text('{"event": "spawn", "time": 1}\n\n{"event": "end", "ti\n')
    page = tmp_path / "page.html"
    done = run_cli(tmp_path, "trace", str(events), "-o", str(page))
    assert done.status == 2
    assert f"subagent trace: error: {events}, line 3: not JSON" in done.stderr
    assert not page.exists()
    events.write_text('{"event": "spawn", "time": 1}\n[1, 2]\n')
    done = run_cli(tmp_path, "trace", str(events), "-o", str(page))
    assert done.status == 2
    assert done.stderr.endswith(f"subagent trace: error: {events}, line 2: not a JSON object\n")


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["trace", "missing.jsonl", "-o", "page.html"],
            "cannot read missing.jsonl: No such file or directory",
        ),
        (["trace", "events.jsonl"], "the following arguments are required: -o/--output"),
        (["trace", "events.jsonl", "-o", "no/such/dir/page.html"], "-o: cannot write no/such/dir/page.html"),
        (["run", "--trace", "no/such/dir/t.html", "-p", "hi", "--", "agent"], "--trace: the directory of"),
        (
            ["run", "--events-file", "no/dir/e.jsonl", "-p", "hi", "--", "agent"],
            "--events-file: the directory",
        ),
    ],
)
def test_bad_trace_paths_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "events.jsonl").write_text('{"event": "spawn", "time": 1}\n')
    done = run_cli(tmp_path, *args)
    assert done.status == 2
    assert message in done.stderr


@pytest.mark.subprocess
def test_a_trace_page_that_cannot_be_written_ends_the_run_with_status_2_after_its_answer(
    tmp_path: Path,
) -> None:
    agent = scenario(tmp_path, one_turn({"step": "message", "text": "hello"}))
    taken = tmp_path / "taken"
    taken.mkdir()  # a directory where the page should go: found only when it is written
    done = run_cli(tmp_path, "run", "--trace", str(taken), "-p", "hi", "--", *agent)
    assert (done.status, done.stdout) == (2, "hello\n")
    assert done.stderr.startswith(f"subagent: --trace: cannot write {taken}: ")
    assert list(tmp_path.glob(".taken.*")) == []  # the half-written file is gone


@pytest.mark.subprocess
def test_help_names_the_trace_command_and_the_run_options_that_record(tmp_path: Path) -> None:
    top = run_cli(tmp_path, "--help")
    assert "    trace        make the HTML trace page of a recorded run" in top.stdout
    run = run_cli(tmp_path, "run", "--help")
    for flag in ("--events-file FILE", "--trace FILE.html"):
        assert flag in run.stdout
    trace = run_cli(tmp_path, "trace", "--help")
    assert trace.stdout.startswith("usage: subagent trace EVENTS.jsonl -o FILE.html [--title TEXT]\n")


@pytest.mark.subprocess
def test_a_trace_is_written_when_the_agent_fails_to_start(tmp_path: Path) -> None:
    page = tmp_path / "trace.html"
    agent = [sys.executable, "-c", "import sys; sys.stderr.write('no key\\n'); sys.exit(3)"]
    done = run_cli(tmp_path, "run", "--trace", str(page), "-p", "hi", "--", *agent)
    assert done.status == 2
    (root,) = trace_data(page.read_text())["runs"]
    assert (root["state"], root["stopReason"], root["prompt"]) == ("failed", "error", "hi")
    assert root["title"] == os.path.basename(sys.executable)  # no argument: any may be a secret
    assert "no key" in root["error"]
    assert [mark[0] for mark in root["marks"]] == ["error"]


@pytest.mark.subprocess
def test_a_trace_is_written_when_the_run_is_interrupted(tmp_path: Path) -> None:
    page = tmp_path / "trace.html"
    agent = scenario(
        tmp_path, {"turns": [[{"step": "message", "text": "working..."}, {"step": "wait_for_cancel"}]]}
    )
    cli = LiveCli(tmp_path, "run", "--events", "--trace", str(page), "-p", "work", "--", *agent)
    cli.wait_for_event("update")
    cli.process.send_signal(2)  # SIGINT: cancel the turn
    done = cli.finish()
    assert done.status == 1
    (root,) = trace_data(page.read_text())["runs"]
    assert (root["state"], root["stopReason"], root["output"]) == ("cancelled", "cancelled", "working...")
    assert [(mark[0], mark[3]) for mark in root["marks"]] == [
        ("text", "answer text"),
        ("interrupt", "SIGINT: cancel"),
    ]


# -- the builder, without a browser -------------------------------------------------------------------------


def event(kind: str, when: float, **fields: Any) -> dict[str, Any]:
    return {"event": kind, "time": when, **fields}


def tool_call(when: float, call_id: str, **fields: Any) -> dict[str, Any]:
    update = {"sessionUpdate": "tool_call", "toolCallId": call_id, **fields}
    return event("update", when, sessionId="s", update=update)


def tool_update(when: float, call_id: str, **fields: Any) -> dict[str, Any]:
    update = {"sessionUpdate": "tool_call_update", "toolCallId": call_id, **fields}
    return event("update", when, sessionId="s", update=update)


def run_event(when: float, run_id: str, parent: str, state: str, stop: str | None = None) -> dict[str, Any]:
    return event("run", when, runId=run_id, parentId=parent, provider="spawn", state=state, stopReason=stop,
                 depth=1, title=f"spawn subagent: {run_id}")  # fmt: skip


def test_marks_show_tool_calls_permission_waits_errors_interrupts_and_warnings_on_their_run() -> None:
    builder = TraceBuilder()
    for item in [
        event("spawn", 100.0, command=["agent"], cwd="/"),
        event("start", 100.5, runId="cli", sessionId="s", agent={"name": "Agent", "version": "2"}),
        tool_call(101.0, "c1", title="Edit a.txt", status="pending"),
        event("permission_request", 101.0, toolCallId="c1", title="Edit a.txt"),
        event("permission", 103.0, toolCallId="c1", outcome="selected",
              option={"optionId": "no", "name": "No", "kind": "reject_once"}, reason="answered"),
        tool_update(103.5, "c1", status="failed"),
        run_event(104.0, "k1", "cli", "running"),
        tool_call(104.5, "k1/c2", title="Read b.txt", status="in_progress"),
        event("permission", 104.6, toolCallId="k1/c2", title="Read b.txt", outcome="selected",
              option={"optionId": "ok", "name": "Ok", "kind": "allow_once"}, reason="--permission allow"),
        event("log", 105.0, level="warning", logger="x", message="retrying the model call"),
        event("log", 105.1, level="info", logger="x", message="not shown"),
        event("interrupt", 106.0, signal="SIGINT", count=1, action="cancel"),
        event("end", 107.0, stopReason="cancelled", error=None, usage=None, elapsed=7.0),
    ]:  # fmt: skip
        builder.add(item)
    root, child = builder.data()["runs"]
    assert (root["title"], root["state"], root["start"], root["end"]) == ("Agent 2", "cancelled", 0.0, 7.0)
    assert root["marks"] == [
        ["tool", 1.0, 3.5, "Edit a.txt", "failed"],
        ["permission", 1.0, 3.0, "permission asked: Edit a.txt", "reject_once (answered)"],
        ["error", 3.5, 3.5, "tool call failed: Edit a.txt", None],
        ["log", 5.0, 5.0, "retrying the model call", "warning"],
        ["interrupt", 6.0, 6.0, "SIGINT: cancel", None],
    ]
    # The child never ended: its bar is open, and its open tool call is still open.
    assert (child["id"], child["parent"], child["state"], child["end"]) == ("k1", "cli", "running", None)
    assert child["marks"] == [
        ["tool", 4.5, None, "Read b.txt", "in_progress"],
        ["permission", 4.6, 4.6, "permission: Read b.txt", "allow_once (--permission allow)"],
    ]


def turn_marker(when: float, **turn: Any) -> dict[str, Any]:
    update = {"sessionUpdate": "session_info_update", "_meta": {TURN_META_KEY: turn}}
    return event("update", when, sessionId="s", update=update)


def test_the_agents_turns_are_marks_on_the_root_a_woken_one_says_so() -> None:
    builder = TraceBuilder()
    for item in [
        event("start", 100.0, runId="cli", sessionId="s", agent=None),
        turn_marker(100.1, turn=1, state="started"),
        turn_marker(101.0, turn=1, state="ended", stopReason="completed"),
        turn_marker(102.0, turn=2, state="started", woken=True),
        turn_marker(103.0, turn=2, state="ended", stopReason="max_tokens"),
        turn_marker(103.5, turn="x", state="started"),  # a hostile number is not shown
        event("update", 103.6, sessionId="s", update={"sessionUpdate": "session_info_update", "title": "t"}),
        event("end", 104.0, stopReason="max_tokens", error=None, usage=None, elapsed=4.0),
    ]:
        builder.add(item)
    (root,) = builder.data()["runs"]
    assert root["marks"] == [
        ["turn", 0.1, 1.0, "turn 1", "completed"],
        ["turn", 2.0, 3.0, "turn 2 (its background children's notices)", "max_tokens"],
        ["turn", 3.5, 4.0, "turn", None],
    ]


def test_a_childs_prompt_is_the_delegation_its_title_quotes_whatever_order_they_started_in() -> None:
    builder = TraceBuilder()
    builder.add(event("start", 0.0, runId="cli", sessionId="s"))
    long_prompt = "first:  " + "word " * 40
    for index, prompt in enumerate([long_prompt, "second task", "third task"]):
        arguments = {"provider": "spawn", "prompt": prompt}
        builder.add(tool_call(1.0, f"c{index}", title="subagent", rawInput=arguments))
    # The second starts first; the first's title quotes its start only, whitespace folded.
    titles = {"k2": "spawn subagent: second task", "k1": f"spawn subagent: first: {'word ' * 14}wo\u2026"}
    for run_id, title in [*titles.items(), ("k3", "a title quoting nothing")]:
        builder.add(event("run", 2.0, runId=run_id, parentId="cli", state="running", title=title))
    runs = builder.data()["runs"]
    assert [(run["id"], run["prompt"]) for run in runs[1:]] == [
        ("k2", "second task"),
        ("k1", long_prompt),
        ("k3", "third task"),
    ]


def test_a_root_cut_short_reads_stopped_and_an_error_reads_failed() -> None:
    for stop, state in [("max_tokens", "stopped"), ("refusal", "stopped"), ("error", "failed")]:
        builder = TraceBuilder()
        builder.add(event("end", 1.0, stopReason=stop, error="why" if stop == "error" else None))
        (root,) = builder.data()["runs"]
        assert (root["state"], root["stopReason"]) == (state, stop)


def test_runs_whose_parents_are_unknown_or_circular_hang_below_the_root_once_each() -> None:
    builder = TraceBuilder()
    builder.add(event("start", 1.0, runId="cli", sessionId="s"))
    for run_id, parent in [("a", "b"), ("b", "a"), ("c", "nowhere"), ("d", "d")]:
        builder.add(run_event(2.0, run_id, parent, "running"))
    runs = builder.data()["runs"]
    assert sorted((run["id"], run["depth"]) for run in runs) == [
        ("a", 1),
        ("b", 1),
        ("c", 1),
        ("cli", 0),
        ("d", 1),
    ]
    assert runs[0]["id"] == "cli"


def thousand_runs() -> list[dict[str, Any]]:
    """1,000 runs: ten below the root, each with 99 descendants in chains four levels deep, every run
    with one tool call."""
    events = [event("start", 0.0, runId="cli", sessionId="s")]
    for index in range(1000):
        offset = index % 100
        parent = "cli" if offset == 0 else f"r{index - offset}" if offset % 4 == 1 else f"r{index - 1}"
        run_id = f"r{index}"
        start = index * 0.01
        events.append(run_event(start, run_id, parent, "running"))
        events.append(
            tool_call(start + 0.001, f"{run_id}/t", title=f"read file {index}", status="in_progress")
        )
        events.append(tool_update(start + 0.002, f"{run_id}/t", status="completed"))
    events.extend(
        run_event(10 + (999 - index) * 0.001, f"r{index}", "", "completed", "completed")
        for index in reversed(range(1000))
    )
    events.append(event("end", 12.0, stopReason="completed", error=None, usage=None, elapsed=12.0))
    return events


def test_a_thousand_runs_make_a_page_of_a_thousand_and_one_rows_under_a_megabyte() -> None:
    html = render_trace_page(thousand_runs())
    runs = trace_data(html)["runs"]
    assert len(runs) == 1001
    assert len({run["id"] for run in runs}) == 1001
    assert all(run["state"] == "completed" and len(run["marks"]) == 1 for run in runs[1:])
    assert len(html.encode()) < 1_000_000  # 0.35 MB measured


def test_recording_keeps_a_bounded_amount_of_a_run_of_any_length() -> None:
    """Texts, marks and runs are capped, each and all together; what was left out is counted."""
    chunk = "x" * 100_000
    title = "t" * 1_000
    tracemalloc.start()
    try:
        builder = TraceBuilder()
        builder.add(event("prompt", 0.0, text=chunk, chars=10**7))
        for index in range(300):  # 30 MB of answer text, 300 delegations of 100 KB prompts
            text = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": chunk}}
            builder.add(event("update", 1.0, update=text))
            builder.add(tool_call(1.0 + index, f"call-{index}", title=title, rawInput={"prompt": chunk}))
        content = [{"type": "content", "content": {"type": "text", "text": chunk}}]
        for index in range(MAX_RUNS + 50):  # each with 30 tool calls and a 100 KB answer
            builder.add(run_event(2.0, f"run-{index}", "cli", "running"))
            for call in range(30):
                builder.add(tool_call(3.0, f"run-{index}/{call}", title=f"read file {call}"))
            builder.add(tool_update(4.0, f"run/run-{index}", status="completed", content=content))
            builder.add(run_event(4.0, f"run-{index}", "cli", "completed", "completed"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 60_000_000  # 29 MB measured; the stream carried over 600 MB of text
    data = builder.data()
    runs = data["runs"]
    root = runs[0]
    assert (len(root["output"]), root["outputChars"]) == (MAX_TEXT_CHARS, 30_000_000)
    assert (len(root["prompt"]), root["promptChars"]) == (MAX_TEXT_CHARS, 10**7)
    assert len(root["marks"]) == MAX_MARKS
    # 300 tool calls and 300 streaks of text between them; and the calls of the 51 runs not kept (whose
    # owner is unknown, so the root's)
    assert root["marksDropped"] == 600 - MAX_MARKS + 51 * 30
    assert len(runs) == MAX_RUNS
    assert data["runsDropped"] == 51
    assert sum(len(run["marks"]) for run in runs) == MAX_KEPT_MARKS
    # The texts are ASCII without escapes: a byte each.
    assert sum(len(run["prompt"]) + len(run["output"]) for run in runs) == MAX_KEPT_TEXT_BYTES
    assert all(run["outputChars"] == len(chunk) for run in runs[1:])


def test_the_page_loads_nothing_from_anywhere() -> None:
    html = render_trace_page(thousand_runs()[:50])
    assert re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I) is None
    assert re.search(r"https?://", html) is None
    assert re.search(r"@import|url\(", html) is None
    assert html.count("<script") == 2


JSON_VALUES: Final = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@given(
    st.lists(
        st.dictionaries(
            st.sampled_from(["event", "time", "runId", "parentId", "state", "text", "update", "toolCallId",
                             "stopReason", "usage", "error", "title", "command", "agent", "option"]),
            JSON_VALUES,
        ),
        max_size=20,
    )
)  # fmt: skip
@pytest.mark.fuzz
def test_any_stream_of_json_objects_makes_a_page_whose_data_cannot_end_its_script(
    events: list[dict[str, Any]],
) -> None:
    kinds = ["spawn", "start", "prompt", "update", "run", "permission_request", "permission", "interrupt",
             "start_failed", "end", "log"]  # fmt: skip
    for index, item in enumerate(events):
        if isinstance(item.get("event"), int):
            item["event"] = kinds[item["event"] % len(kinds)]
        item.setdefault("event", kinds[index % len(kinds)])
    html = render_trace_page(events, title="</title><script>")
    assert html.count("</script>") == 2
    assert html.count("<script") == 2
    trace_data(html)


# -- in a real browser --------------------------------------------------------------------------------------

ROWS: Final = """[...document.querySelectorAll("#rows .row")].map((row) => ({
    provider: row.querySelector(".provider").textContent,
    title: row.querySelector(".title").textContent,
    indent: parseFloat(row.querySelector(".label").style.paddingLeft),
    bar: row.querySelector(".bar").className,
    hidden: row.classList.contains("hidden"),
    barWidth: row.querySelector(".bar").getBoundingClientRect().width,
}))"""

DETAILS: Final = """(() => {
    const details = document.getElementById("details");
    const pairs = [...details.querySelectorAll("dl:first-of-type dt")].map((dt) => [dt.textContent,
        dt.nextElementSibling.textContent]);
    return {
        heading: details.querySelector("h2").textContent,
        fields: Object.fromEntries(pairs),
        prompt: document.querySelector("#detail-prompt pre").textContent,
        output: document.querySelector("#detail-output pre").textContent,
        usage: document.getElementById("detail-usage")?.textContent ?? null,
        notes: [...details.querySelectorAll(".note")].map((note) => note.textContent),
    };
})()"""


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_chromium_shows_one_labelled_bar_per_run_and_a_runs_details_on_click(
    recorded: Path, tmp_path: Path
) -> None:
    with anyio.fail_after(60):
        async with open_page(tmp_path) as page:
            await page.open((recorded / "trace.html").as_uri())
            await page.wait_for_ready()
            rows = await page.evaluate(ROWS)
            assert [(row["provider"], row["title"]) for row in rows] == [
                ("acp", "subagent-seam agent 0.1.0"),
                ("spawn", "alpha: survey the repository"),
                ("spawn", "beta: read the tests"),
                ("spawn", "gamma: count the files"),
            ]
            indents = [row["indent"] for row in rows]
            assert indents == sorted(indents)
            assert len(set(indents)) == 4
            assert all(row["bar"] == "bar state-completed" and row["barWidth"] >= 3 for row in rows)

            # Hovering a bar shows what it did in short.
            hover = await page.evaluate("document.querySelector('#rows .row[data-index=\"3\"] .bar').title")
            assert hover.splitlines()[4:] == [
                "prompt: gamma: count the files",
                "output: There are 3 files.",
                'usage: {"inputTokens":40}',
                "(click for the details)",
            ]

            await page.click('#rows .row[data-index="3"] .bar')
            details = await page.evaluate(DETAILS)
            assert details["heading"] == "spawn: spawn subagent: gamma: count the files"
            assert details["fields"]["state"] == "completed"
            assert details["fields"]["stop reason"] == "completed"
            assert details["fields"]["depth"] == "3"
            assert (details["prompt"], details["output"]) == ("gamma: count the files", "There are 3 files.")
            assert details["usage"] == "inputTokens40"

            # The root's prompt is shown as text: its markup never ran.
            await page.click('#rows .row[data-index="0"] .label')
            details = await page.evaluate(DETAILS)
            assert details["prompt"] == HOSTILE_PROMPT
            assert await page.evaluate("document.scripts.length") == 2
            assert await page.evaluate("document.querySelectorAll('b').length") == 0
            assert page.dialogs == []

            # Folding alpha hides beta and gamma; unfolding shows them again.
            await page.click('#rows .row[data-index="1"] .toggle')
            assert [row["hidden"] for row in await page.evaluate(ROWS)] == [False, False, True, True]
            await page.click('#rows .row[data-index="1"] .toggle')
            assert [row["hidden"] for row in await page.evaluate(ROWS)] == [False] * 4


ALPHA_IN_LANE: Final = """(() => {
    const bar = document.querySelector('#rows .row[data-index="1"] .bar').getBoundingClientRect();
    const lane = document.querySelector('#rows .row[data-index="1"] .lane').getBoundingClientRect();
    return {left: bar.left - lane.left, right: bar.right - lane.left, lane: lane.width};
})()"""


def png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    return width, height


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_chromium_screenshot_of_the_three_level_run_zoomed_in_on_its_children(
    recorded: Path, tmp_path: Path
) -> None:
    """Also `make trace-screenshot`: SUBAGENT_TRACE_SCREENSHOT names where the picture goes."""
    events = [json.loads(line) for line in (recorded / "events.jsonl").read_text().splitlines()]
    page_file = tmp_path / "three-levels.html"
    page_file.write_text(render_trace_page(events, title="subagent trace: three levels of subagents"))
    with anyio.fail_after(60):
        async with open_page(tmp_path, width=1200, height=700) as page:
            await page.open(page_file.as_uri())
            await page.wait_for_ready()
            ticks = "[...document.querySelectorAll('#ticks .tick')].map((tick) => tick.textContent)"
            whole = await page.evaluate(ticks)
            assert await page.evaluate("document.getElementById('zoom-out').hidden") is True
            await page.click('#rows .row[data-index="1"] .bar')
            await page.click("#zoom-in")
            # The axis shows alpha's time now (however short it was), and a way back to the whole run.
            assert await page.evaluate(ticks) != whole
            assert await page.evaluate("document.getElementById('zoom-out').hidden") is False
            alpha = await page.evaluate(ALPHA_IN_LANE)
            assert 0 <= alpha["left"] <= alpha["right"] <= alpha["lane"]
            await page.click('#rows .row[data-index="3"] .bar')
            png = await page.screenshot()
    assert png_size(png) == (1200, 700)
    target = os.environ.get("SUBAGENT_TRACE_SCREENSHOT")
    if target:
        await anyio.Path(target).write_bytes(png)


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_chromium_renders_a_thousand_runs(tmp_path: Path) -> None:
    page_file = tmp_path / "thousand.html"
    page_file.write_text(render_trace_page(thousand_runs()))
    with anyio.fail_after(60):
        # Chromium and every process it started are gone after, and no descriptor of ours is left open.
        async with assert_no_leaks(), open_page(tmp_path) as page:
            await page.open(page_file.as_uri())
            await page.wait_for_ready()
            assert await page.evaluate("document.querySelectorAll('#rows .row').length") == 1001
            await page.click('#rows .row[data-index="0"] .toggle')
            visible = "document.querySelectorAll('#rows .row:not(.hidden)').length"
            assert await page.evaluate(visible) == 1


@pytest.mark.anyio
async def test_a_fan_out_keeps_every_views_tick_running_until_it_is_cancelled() -> None:
    class Ticking(RunView):
        def __init__(self) -> None:
            self.running = anyio.Event()
            self.stopped = False

        async def tick(self) -> None:
            self.running.set()
            try:
                await anyio.sleep_forever()
            finally:
                self.stopped = True

    live, other = Ticking(), Ticking()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(FanOut([live, RunView(), other]).tick)
            await live.running.wait()
            await other.running.wait()
            task_group.cancel_scope.cancel()
    assert (live.stopped, other.stopped) == (True, True)
