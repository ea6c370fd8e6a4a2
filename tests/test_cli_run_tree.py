"""The live block of runs under `subagent run --progress` on a terminal.

The view is fed the updates the ACP client hands it (`ToolCall` / `ToolCallProgress` carrying
`_meta["subagent-seam/run"]`, as `subagent serve` sends them) on a fake terminal: a `StringIO` that
says it is a tty, a fixed width and a fake clock. What it wrote is asserted as exact bytes, or laid
out by `Screen` (a small model of a terminal: autowrap with the pending wrap at the right margin,
wide characters, tabs, and the cursor moves the console uses) and asserted as the rows a person
sees. One test runs the real CLI in a pseudo-terminal against `subagent serve`.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import tracemalloc
from pathlib import Path
from typing import Any, Final

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from subagent.acp import schema
from subagent.acp import schema_unstable as unstable
from subagent.acp._subagents import SubagentSession
from subagent.acp.handlers import PermissionOption, PermissionQuestion
from subagent.cli import _views as views
from subagent.cli._console import Console, advance_column, fit_width, text_width
from subagent.cli._run_tree import MAX_BLOCK_ROWS, MAX_TRACKED_RUNS, RunTree
from subagent.cli._tool_call_tracker import ToolCalls
from subagent.cli._views import HumanView
from subagent.providers._acp_subagents import SubagentRuns
from subagent.types import RUN_META_KEY, SubagentResult
from tests.leaks import leaked_processes
from tests.test_cli import BOUND, CLI, cli_env

CSI_SEQUENCE: Final = re.compile(r"\x1b\[([0-9;]*)([A-Za-z])")


class Screen:
    """What a terminal `columns` wide shows after some output: every row ever written (no height,
    so rows that scrolled away stay), the cursor, and xterm's pending wrap at the right margin."""

    def __init__(self, columns: int) -> None:
        self.columns = columns
        self.rows: list[list[str]] = [[]]
        self.row = 0
        self.col = 0
        self.pending = False

    def feed(self, data: str) -> Screen:
        at = 0
        while at < len(data):
            match = CSI_SEQUENCE.match(data, at)
            if match is not None:
                self._csi(match.group(1), match.group(2))
                at = match.end()
                continue
            char = data[at]
            at += 1
            assert char == "\n" or char == "\t" or char == "\r" or char.isprintable(), repr(char)
            if char == "\n":  # a tty's output processing makes it CR LF
                self._down()
            elif char == "\r":
                self.col, self.pending = 0, False
            elif char == "\t":
                self.col, self.pending = min((self.col // 8 + 1) * 8, self.columns - 1), False
            else:
                self._put(char)
        return self

    def lines(self) -> list[str]:
        """The rows, without the empty ones at the end."""
        lines = ["".join(row).rstrip() for row in self.rows]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    def cursor(self) -> tuple[int, int]:
        """Where the next character goes (a pending wrap is the start of the next row)."""
        return (self.row + 1, 0) if self.pending else (self.row, self.col)

    def _down(self) -> None:
        self.row += 1
        self.col, self.pending = 0, False
        while len(self.rows) <= self.row:
            self.rows.append([])

    def _put(self, char: str) -> None:
        width = text_width(char)
        if width == 0:
            return
        if self.pending or self.col + width > self.columns:
            self._down()
        row = self.rows[self.row]
        row.extend(" " * (self.col + width - len(row)))
        row[self.col] = char
        if width == 2:
            row[self.col + 1] = ""
        self.col += width
        if self.col >= self.columns:
            self.col, self.pending = self.columns - 1, True

    def _csi(self, argument: str, final: str) -> None:
        count = int(argument or "1") if final in "AG" else 0
        if final == "A":
            self.row, self.pending = max(self.row - count, 0), False
        elif final == "G":
            self.col, self.pending = min(count - 1, self.columns - 1), False
        elif final == "J":
            assert argument == "", argument
            del self.rows[self.row + 1 :]
            del self.rows[self.row][self.col :]
        else:
            assert final == "m", final  # colour: no layout


class FakeTerminal(io.StringIO):
    """A stream that says it is a terminal; :meth:`shows` is an event for some text being written."""

    encoding = "utf-8"

    def __init__(self) -> None:
        super().__init__()
        self._awaited: list[tuple[str, anyio.Event]] = []

    def isatty(self) -> bool:
        return True

    def shows(self, text: str) -> anyio.Event:
        event = anyio.Event()
        self._awaited.append((text, event))
        return event

    def write(self, text: str) -> int:
        written = super().write(text)
        for awaited, event in self._awaited:
            if awaited in text:
                event.set()
        return written


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def live_view(columns: int = 60, *, color: bool = False) -> tuple[HumanView, FakeTerminal, Clock]:
    stream = FakeTerminal()
    clock = Clock()
    console = Console(stream, color=color, columns=lambda: columns)
    return HumanView(console, progress=True, live=True, clock=clock), stream, clock


def run_meta(
    run_id: str, parent: str = "session-1", depth: int = 1, state: str = "running"
) -> dict[str, Any]:
    return {"runId": run_id, "parentId": parent, "provider": "spawn", "depth": depth, "state": state}


class Feed:
    """Hands a view the updates an agent sends, through `ToolCalls` as the client does."""

    def __init__(self, view: HumanView) -> None:
        self.view = view
        self.calls = ToolCalls()

    def send(self, update: schema.SessionUpdate) -> None:
        self.view.update(update, self.calls.observe(update))

    def text(self, text: str) -> None:
        self.send(schema.AgentMessageChunk(content=schema.TextContent(text=text)))

    def start(self, run_id: str, title: str, parent: str = "session-1", depth: int = 1) -> None:
        meta = {RUN_META_KEY: run_meta(run_id, parent, depth)}
        call = schema.ToolCall(
            tool_call_id=f"run/{run_id}", title=title, kind="other", status="in_progress", meta=meta
        )
        self.send(call)

    def heartbeat(
        self, run_id: str, title: str, line: str, parent: str = "session-1", depth: int = 1
    ) -> None:
        content: list[schema.ToolCallContent] = [schema.Content(content=schema.TextContent(text=line))]
        meta = {RUN_META_KEY: run_meta(run_id, parent, depth)}
        self.send(
            schema.ToolCallProgress(tool_call_id=f"run/{run_id}", title=title, content=content, meta=meta)
        )

    def end(
        self, run_id: str, title: str, state: str = "completed", parent: str = "session-1", depth: int = 1
    ) -> None:
        meta = {RUN_META_KEY: {**run_meta(run_id, parent, depth, state), "stopReason": state}}
        status: schema.ToolCallStatus = "completed" if state == "completed" else "failed"
        self.send(
            schema.ToolCallProgress(tool_call_id=f"run/{run_id}", title=title, status=status, meta=meta)
        )


def done(view: HumanView) -> None:
    view.ended(SubagentResult(output="", stop_reason="completed"), 2.5)


# -- the block --------------------------------------------------------------------------------------------


def test_the_block_lists_each_run_below_its_parent_with_its_state_and_last_activity() -> None:
    view, stream, clock = live_view()
    feed = Feed(view)
    feed.start("a", "spawn subagent: child task")
    clock.now += 2
    feed.start("b", "spawn subagent: grandchild task", parent="a", depth=2)
    feed.start("c", "spawn subagent: other task")
    clock.now += 3
    feed.end("b", "spawn subagent: grandchild task", parent="a", depth=2)
    assert Screen(60).feed(stream.getvalue()).lines() == [
        "runs: 2 running, 1 completed",
        "  \u25cf spawn: child task  running, 5 s ago",
        "    \u2713 spawn: grandchild task  completed, 0 s ago",
        "  \u25cf spawn: other task  running, 3 s ago",
    ]


def test_a_redraw_moves_up_over_the_block_erases_it_and_writes_the_new_one() -> None:
    view, stream, clock = live_view()
    feed = Feed(view)
    feed.start("a", "spawn subagent: child task")
    first = stream.getvalue()
    assert first == "runs: 1 running\n  \u25cf spawn: child task  running, 0 s ago"
    clock.now += 3
    feed.start("b", "spawn subagent: other task")
    assert stream.getvalue()[len(first) :] == (
        "\r\x1b[1A\x1b[J"
        "runs: 2 running\n"
        "  \u25cf spawn: child task  running, 3 s ago\n"
        "  \u25cf spawn: other task  running, 0 s ago"
    )


def test_streamed_text_and_tool_lines_scroll_above_the_block_and_text_goes_on_mid_line() -> None:
    view, stream, clock = live_view()
    feed = Feed(view)
    feed.text("Starting two ")
    feed.start("a", "spawn subagent: child task")
    feed.text("children, then ")
    feed.send(schema.ToolCall(tool_call_id="t1", title="read notes.md", kind="read", status="pending"))
    feed.text("I wait.")
    clock.now += 1
    feed.end("a", "spawn subagent: child task")
    feed.text(" Done\n")
    screen = Screen(60).feed(stream.getvalue())
    assert screen.lines() == [
        "Starting two children, then",
        "  tool read notes.md (read): pending",
        "I wait. Done",
        "runs: 1 completed",
        "  \u2713 spawn: child task  completed, 0 s ago",
    ]


TEXT_PIECES: Final = ["a", "b", " ", "\t", "\n", "\u4e2d", "\u0301", "\x1b[2;3m", "\x1b[0m"]
"""What the console writes: text (wide, combining, tabs, newlines) and colour sequences."""


@given(
    st.integers(min_value=4, max_value=30),
    st.lists(
        st.one_of(
            st.lists(st.sampled_from(TEXT_PIECES), max_size=40).map(lambda pieces: ("text", "".join(pieces))),
            st.integers(min_value=0, max_value=4).map(lambda rows: ("footer", rows)),
        ),
        max_size=12,
    ),
)
def test_text_written_around_a_footer_lays_out_as_if_the_footer_was_never_there(
    columns: int, steps: list[tuple[str, Any]]
) -> None:
    stream, plain = FakeTerminal(), FakeTerminal()
    console = Console(stream, color=False, columns=lambda: columns)
    written = Console(plain, color=False, columns=lambda: columns)
    for kind, value in steps:
        if kind == "text":
            console.write(value)
            written.write(value)
        else:
            console.set_footer([f"row {number}"[: columns - 1] for number in range(value)])
    console.clear_footer()
    shown, expected = Screen(columns).feed(stream.getvalue()), Screen(columns).feed(plain.getvalue())
    assert (shown.lines(), shown.cursor()) == (expected.lines(), expected.cursor())


def test_a_block_redrawn_under_a_row_of_text_exactly_full_never_moves_down() -> None:
    stream = FakeTerminal()
    console = Console(stream, color=False, columns=lambda: 10)
    console.write("0123456789")  # the terminal is about to wrap
    for age in range(3):
        console.set_footer(["runs: 1", f"  {age} s ago"])
    console.write("\nnext")
    assert Screen(10).feed(stream.getvalue()).lines() == ["0123456789", "next", "runs: 1", "  2 s ago"]
    console.clear_footer()
    console.write("\n")
    assert Screen(10).feed(stream.getvalue()).cursor() == (2, 0)


@pytest.mark.parametrize(
    ("column", "text", "columns", "expected"),
    [
        (0, "abcd", 4, 4),  # the row is full: the terminal wraps at the next character only
        (4, "e", 4, 1),
        (3, "\u4e2d", 4, 2),  # a wide character that does not fit goes to the next row whole
        (2, "\t", 20, 8),
        (4, "\t", 4, 3),  # a tab never goes past the last column
        (5, "x\x1b[31my\x1b[0m", 20, 7),  # colour takes no column
        (5, "ab\ncd", 20, 2),
        (0, "e\u0301", 20, 1),  # a combining accent takes none either
    ],
)
def test_the_console_follows_the_column_as_a_terminal_does(
    column: int, text: str, columns: int, expected: int
) -> None:
    assert advance_column(column, text, columns) == expected


@given(
    st.integers(min_value=0, max_value=12), st.text(st.sampled_from("ab \n"), max_size=60), st.integers(1, 12)
)
def test_the_fast_ascii_column_count_agrees_with_a_character_by_character_count(
    column: int, text: str, columns: int
) -> None:
    column = min(column, columns)
    # A trailing wide character takes the slow path through the same text.
    slow = advance_column(column, text + "\u0301", columns)
    assert advance_column(column, text, columns) == slow


def test_the_block_is_at_most_twelve_rows_running_runs_first_and_the_rest_counted() -> None:
    view, stream, clock = live_view()
    feed = Feed(view)
    for number in range(40):
        feed.start(f"r{number}", f"spawn subagent: task {number}")
        clock.now += 1
    for number in range(0, 40, 4):  # 10 ended, 30 running
        feed.end(f"r{number}", f"spawn subagent: task {number}")
    lines = Screen(60).feed(stream.getvalue()).lines()
    assert len(lines) == MAX_BLOCK_ROWS
    assert lines[0] == "runs: 30 running, 10 completed"
    assert lines[1:] == [
        f"  \u25cf spawn: task {number}  running, {40 - number} s ago"
        for number in (1, 2, 3, 5, 6, 7, 9, 10, 11, 13)
    ] + ["  \u2026 and 30 more (20 running)"]


def test_on_a_short_terminal_the_block_takes_at_most_half_its_rows() -> None:
    stream = FakeTerminal()
    console = Console(stream, color=False, columns=lambda: 60, height=lambda: 10)
    feed = Feed(HumanView(console, progress=True, live=True, clock=Clock()))
    for number in range(6):
        feed.start(f"r{number}", f"spawn subagent: task {number}")
    assert Screen(60).feed(stream.getvalue()).lines() == [
        "runs: 6 running",
        "  \u25cf spawn: task 0  running, 0 s ago",
        "  \u25cf spawn: task 1  running, 0 s ago",
        "  \u25cf spawn: task 2  running, 0 s ago",
        "  \u2026 and 3 more (3 running)",
    ]


def test_each_row_is_cut_to_the_terminal_width_keeping_its_state_and_age() -> None:
    view, stream, _ = live_view(columns=40)
    feed = Feed(view)
    feed.start("a", "spawn subagent: " + "a long task " * 10)
    feed.start("b", "spawn subagent: " + "\u4e2d" * 30)
    lines = Screen(40).feed(stream.getvalue()).lines()
    assert lines == [
        "runs: 2 running",
        "  \u25cf spawn: a long ta\u2026  running, 0 s ago",
        "  \u25cf spawn: \u4e2d\u4e2d\u4e2d\u4e2d\u2026  running, 0 s ago",
    ]
    assert all(text_width(line) <= 39 for line in lines)


def test_a_terminal_too_narrow_for_label_and_state_gets_the_row_cut_whole() -> None:
    view, stream, _ = live_view(columns=20)
    Feed(view).start("a", "spawn subagent: child task")
    assert Screen(20).feed(stream.getvalue()).lines() == ["runs: 1 running", "  \u25cf spawn: child t\u2026"]


def test_a_hostile_title_is_shown_inert_on_one_row() -> None:
    view, stream, _ = live_view(columns=120, color=True)
    feed = Feed(view)
    title = "spawn subagent: evil\x1b[2J\x1b]0;owned\x07\r\nnext\x9b31m line\ttab \u202eright-to-left\u202c"
    feed.start("a", title)
    done(view)
    output = stream.getvalue()
    sequences = {match.group(0) for match in CSI_SEQUENCE.finditer(output)}
    # Only the console's own moves and colours: nothing of the title's got through.
    assert sequences <= {"\x1b[1A", "\x1b[J", "\x1b[0m", "\x1b[1m", "\x1b[2m", "\x1b[33m", "\x1b[32m"}
    assert "\x1b]" not in output
    assert "\x07" not in output
    assert "\x9b" not in output
    assert "\u202e" not in output
    (frame,) = re.findall(r"\x1b\[1mruns: .*?\x1b\[J", output, re.DOTALL)
    assert re.sub(r"\x1b\[[0-9;]*m", "", frame) == (
        "runs: 1 running\n"
        "  \u25cf spawn: evil[2J]0;owned next31m line tab right-to-left  running, 0 s ago\r\x1b[1A\x1b[J"
    )
    assert Screen(120).feed(output).lines() == ["1 run: 1 running", "done: completed in 2.5 s"]


def test_heartbeats_set_the_last_activity_and_a_wait_on_permission_shows() -> None:
    view, stream, clock = live_view(columns=80)
    feed = Feed(view)
    feed.start("a", "spawn subagent: child task")
    feed.start("b", "spawn subagent: other task")
    clock.now += 30
    feed.heartbeat("a", "spawn subagent: child task", "child alive, last update 12.5 s ago")
    feed.heartbeat("b", "spawn subagent: other task", "waiting on a permission answer for 4.0 s")
    assert Screen(80).feed(stream.getvalue()).lines() == [
        "runs: 2 running",
        "  \u25cf spawn: child task  running, 12 s ago",
        "  \u25cf spawn: other task  waiting on a permission answer, 30 s ago",
    ]


def test_an_agents_child_that_requires_action_shows_waiting_on_a_permission_answer_until_it_runs_again() -> (
    None
):
    view, stream, clock = live_view(columns=80)
    feed = Feed(view)
    rows = SubagentRuns("acp", feed.send, None)
    child = SubagentSession("c1", "session-1", 1)

    def patch(**raw: Any) -> list[str]:
        raw |= {"sessionUpdate": "subagent_update", "sessionId": "c1"}
        rows(child, child.apply(schema.convert(raw, type=unstable.SubagentUpdate), raw))
        return Screen(80).feed(stream.getvalue()).lines()

    assert patch(title="Errand", state={"state": "running"})[1:] == ["  \u25cf acp: Errand  running, 0 s ago"]
    clock.now += 5
    assert patch(state={"state": "requires_action"})[1:] == [
        "  \u25cf acp: Errand  waiting on a permission answer, 0 s ago"
    ]
    clock.now += 5
    assert patch(state={"state": "running"})[1:] == ["  \u25cf acp: Errand  running, 0 s ago"]
    assert patch(state={"state": "idle", "stopReason": "end_turn"})[1:] == [
        "  \u2713 acp: Errand  completed, 0 s ago"
    ]


def test_when_the_turn_ends_the_block_gives_way_to_a_one_line_summary() -> None:
    view, stream, clock = live_view()
    feed = Feed(view)
    for run_id, state in (("a", "completed"), ("b", "failed"), ("c", "completed"), ("d", "cancelled")):
        feed.start(run_id, f"spawn subagent: task {run_id}")
        clock.now += 1
        feed.end(run_id, f"spawn subagent: task {run_id}", state=state)
    done(view)
    assert Screen(60).feed(stream.getvalue()).lines() == [
        "  run spawn subagent: task b: failed",
        "  run spawn subagent: task d: cancelled",
        "4 runs: 2 completed, 1 failed, 1 cancelled",
        "done: completed in 2.5 s",
    ]


def test_a_permission_question_takes_the_block_away_until_it_is_decided() -> None:
    view, stream, _ = live_view(columns=80)
    feed = Feed(view)
    feed.start("a", "spawn subagent: child task")
    options = (PermissionOption(option_id="y", name="Allow", kind="allow_once"),)
    question = PermissionQuestion(
        session_id="s", tool_call_id="t1", title="write", kind="edit", raw_input=None, options=options
    )
    call = feed.calls.describe(question)
    view.question(question, call, 30.0)
    asked = stream.getvalue()
    feed.start("b", "spawn subagent: other task")  # while the person answers: not drawn
    assert stream.getvalue() == asked
    assert Screen(80).feed(asked).lines() == [
        "permission requested: write (edit)",
        "  1) Allow  [allow_once]",
        "choose 1-1, y or n (anything else rejects; rejected after 30 s):",
    ]
    stream.write("y\n")  # the terminal echoes what the person types
    view.answered(echoed=True)
    view.decided(question, call, options[0], "answered")
    assert Screen(80).feed(stream.getvalue()).lines()[3:] == [
        "  permission: write -> allowed (answered)",
        "runs: 2 running",
        "  \u25cf spawn: child task  running, 0 s ago",
        "  \u25cf spawn: other task  running, 0 s ago",
    ]


# -- the ticker ---------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("stopped_by", ["the turn's end", "its driver"])
async def test_the_ticker_redraws_the_ages_until_the_turn_ends_or_its_driver_cancels_it(
    monkeypatch: pytest.MonkeyPatch, stopped_by: str
) -> None:
    monkeypatch.setattr(views, "TICK_SECONDS", 0.01)
    view, stream, clock = live_view()
    Feed(view).start("a", "spawn subagent: child task")
    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(view.tick)
            ticked = stream.shows("running, 7 s ago")
            clock.now += 7
            await ticked.wait()
            if stopped_by == "its driver":
                group.cancel_scope.cancel()  # as a driver does when the run is over, before ended()
            else:
                done(view)  # the ticker returns on its own: the task group can end
    if stopped_by == "its driver":
        lines = Screen(60).feed(stream.getvalue()).lines()
        assert lines == ["runs: 1 running", "  \u25cf spawn: child task  running, 7 s ago"]
        done(view)
    assert Screen(60).feed(stream.getvalue()).lines() == ["1 run: 1 running", "done: completed in 2.5 s"]


@pytest.mark.anyio
async def test_a_view_with_nothing_live_has_a_ticker_that_returns_at_once() -> None:
    with anyio.fail_after(10):
        await HumanView(Console(io.StringIO(), color=False), progress=True).tick()
        await HumanView(Console(FakeTerminal(), color=True), progress=False).tick()


# -- when not live -------------------------------------------------------------------------------------------


def ascii_terminal() -> FakeTerminal:
    terminal = FakeTerminal()
    terminal.encoding = "ascii"
    return terminal


@pytest.mark.parametrize(
    ("stream", "color"),
    [(io.StringIO(), True), (FakeTerminal(), False), (ascii_terminal(), True)],
    ids=["not a tty", "no colour", "not UTF-8"],
)
def test_without_a_utf8_colour_terminal_runs_are_lines_as_before(stream: io.StringIO, color: bool) -> None:
    view = HumanView(Console(stream, color=color), progress=True)
    assert not view.live
    feed = Feed(view)
    feed.start("a", "spawn subagent: child task")
    feed.end("a", "spawn subagent: child task")
    done(view)
    text = re.sub(r"\x1b\[[0-9;]*m", "", stream.getvalue())
    assert text == (
        "  run spawn subagent: child task: in_progress\n"
        "  run spawn subagent: child task: completed\n"
        "done: completed in 2.5 s\n"
    )


# -- what the agent sends is not trusted -------------------------------------------------------------------


def test_parent_links_that_loop_still_show_every_run_once() -> None:
    tree = RunTree()
    for run_id, parent in (("a", "b"), ("b", "a"), ("c", "c"), ("d", "a")):
        update = schema.ToolCall(tool_call_id=f"run/{run_id}", title=f"task {run_id}")
        tree.observe(run_meta(run_id, parent), update, 0.0)
    rows = tree.frame(0.0, 80, lambda text, *codes: text)
    assert rows == [
        "runs: 4 running",
        "  \u25cf spawn: task c  running, 0 s ago",
        "  \u25cf spawn: task a  running, 0 s ago",
        "    \u25cf spawn: task b  running, 0 s ago",
        "    \u25cf spawn: task d  running, 0 s ago",
    ]


def test_the_runs_remembered_are_bounded_and_forgotten_ones_still_counted() -> None:
    tree = RunTree(limit=3)
    for number in range(5):
        update = schema.ToolCall(tool_call_id=f"run/r{number}", title="t")
        tree.observe(run_meta(f"r{number}", state="completed" if number < 2 else "running"), update, 0.0)
    assert len(tree) == 3
    assert tree.summary() == "5 runs: 2 completed, 3 running"
    more = schema.ToolCall(tool_call_id="run/r9", title="t")
    assert tree.observe(run_meta("r9"), more, 0.0) is None  # full of running runs: not taken
    assert len(tree) == 3
    assert MAX_TRACKED_RUNS >= 1000


HOSTILE_TEXT: Final = st.text(
    st.one_of(st.sampled_from("\x1b[]\x07\x9b\r\n\t\u200b\u0301;m"), st.characters()), max_size=40
)
ANY_JSON: Final = st.one_of(
    st.none(), st.booleans(), st.integers(), HOSTILE_TEXT, st.lists(st.integers(), max_size=2)
)


@pytest.mark.fuzz
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c", "d"]),
            st.one_of(st.sampled_from(["a", "b", "c", "d", "session"]), ANY_JSON),
            st.one_of(st.sampled_from(["running", "completed", "failed", "cancelled"]), ANY_JSON),
            ANY_JSON,
            HOSTILE_TEXT,
            st.booleans(),
        ),
        max_size=25,
    ),
    st.integers(min_value=1, max_value=120),
    st.integers(min_value=1, max_value=40),
)
def test_whatever_the_agent_sends_each_run_is_one_inert_row_within_the_terminal(
    updates: list[tuple[str, Any, Any, Any, str, bool]], columns: int, height: int
) -> None:
    tree = RunTree()
    for run_id, parent, state, provider, title, announced in updates:
        meta = {"runId": run_id, "parentId": parent, "state": state, "provider": provider, "depth": parent}
        update: schema.ToolCall | schema.ToolCallProgress = (
            schema.ToolCall(tool_call_id=f"run/{run_id}", title=title)
            if announced
            else schema.ToolCallProgress(tool_call_id=f"run/{run_id}", title=title, status="failed")
        )
        tree.observe(meta, update, 0.0)
    rows = tree.frame(0.0, columns, lambda text, *codes: text, height=height)
    assert len(rows) <= max(min(height, MAX_BLOCK_ROWS), 3)
    for row in rows:
        assert text_width(row) <= max(columns - 1, 1)
        assert not re.search(r"[\x00-\x1f\x7f-\x9f]", row)  # no control character: no newline, no ESC
    ids = {run_id for run_id, *_ in updates}
    if rows and len(ids) + 1 <= min(height, MAX_BLOCK_ROWS):
        assert len(rows) == len(ids) + 1  # the header, then each run once, loops in its parents or not


def test_twenty_thousand_runs_with_long_titles_cost_the_tree_a_bounded_memory() -> None:
    tree = RunTree()
    tracemalloc.start()
    try:
        for number in range(20_000):
            meta = run_meta(f"run-{number}-" + "i" * 200, state="completed")
            update = schema.ToolCall(tool_call_id=f"run/{number}", title="spawn subagent: " + "t" * 5000)
            tree.observe(meta, update, float(number))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 0.8 MB measured for the 1000 kept; all 20,000 would take over 12 MB.
    assert peak < 4_000_000
    assert len(tree) == MAX_TRACKED_RUNS
    assert tree.summary() == "20000 runs: 20000 completed"


def test_a_long_title_is_kept_short_and_a_cut_ends_with_an_ellipsis() -> None:
    tree = RunTree()
    tree.observe(run_meta("a"), schema.ToolCall(tool_call_id="run/a", title="x" * 100_000), 0.0)
    (_, row) = tree.frame(0.0, 10_000, lambda text, *codes: text)
    assert len(row) < 400
    assert fit_width("abcdef", 4) == "abc\u2026"
    assert fit_width("\u4e2d\u4e2d\u4e2d", 5) == "\u4e2d\u4e2d\u2026"


# -- end to end -------------------------------------------------------------------------------------------

BACKGROUND_SCRIPT: Final = {
    "replies": [
        {
            "when": {"last_user_contains": "go", "after_tool_result": False},
            "tool_calls": [
                {"name": "subagent", "arguments": {"provider": "spawn", "prompt": prompt, "background": True}}
                for prompt in ("child task", "other task")
            ],
        },
        {"when": {"last_user_contains": "child task"}, "text": "child answer"},
        {"when": {"last_user_contains": "other task"}, "text": "other answer"},
        {"when": {"last_user_contains": "go", "after_tool_result": True}, "text": "Started."},
    ],
    "fallback": "All done.",
}


def read_all(fd: int, into: list[bytes]) -> None:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: every writer of the terminal closed it
            return
        if not chunk:
            return
        into.append(chunk)


@pytest.mark.subprocess
def test_progress_on_a_terminal_shows_the_background_children_live_and_ends_with_the_summary(
    tmp_path: Path,
) -> None:
    script = tmp_path / "background.json"
    script.write_text(json.dumps(BACKGROUND_SCRIPT))
    agent = [sys.executable, "-m", "subagent", "serve", "--script", str(script)]
    env, tag = cli_env(tmp_path, {"TERM": "xterm"})
    main, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    output: list[bytes] = []
    reader = threading.Thread(target=read_all, args=(main, output), daemon=True)
    try:
        process = subprocess.Popen(
            [*CLI, "run", "--progress", "-p", "go", "--", *agent],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=terminal,
            cwd=tmp_path,
            env=env,
            start_new_session=True,
        )
        os.close(terminal)
        terminal = -1
        reader.start()
        try:
            stdout, _ = process.communicate(timeout=BOUND)
        finally:
            if process.poll() is None:  # it hung: the test fails, but leaves nothing behind
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        reader.join(BOUND)
        assert not reader.is_alive()
    finally:
        if terminal >= 0:
            os.close(terminal)
        os.close(main)
    assert leaked_processes(tag) == []
    assert (process.returncode, stdout) == (0, b"All done.\n")
    shown = b"".join(output).decode().replace("\r\n", "\n")
    assert "\x1b[J" in shown  # the block was redrawn in place
    uncoloured = re.sub(r"\x1b\[[0-9;]*m", "", shown)
    # The block (each frame is written whole, ending where the next erase starts) listed both
    # children at once: running or, once ended, still there; in the order they became ready.
    row = re.compile(r"  [\u25cf\u2713] spawn: (child task|other task)  (?:running|completed), \d+ s ago")
    blocks = []
    for segment in uncoloured.split("\x1b[J"):
        rows = segment.partition("\r")[0].split("\n")  # what scrolled above, then the block
        heads = [number for number, line in enumerate(rows) if line.startswith("runs: ")]
        if heads:
            blocks.append(rows[heads[-1] :])
    assert blocks, uncoloured
    children = [[row.fullmatch(line) for line in block[1:]] for block in blocks]
    both = [[match.group(1) for match in matches if match] for matches in children if len(matches) == 2]
    assert {"child task", "other task"} in [set(names) for names in both], blocks
    assert blocks[-1][0] == "runs: 2 completed"
    lines = Screen(100).feed(shown).lines()
    ready = next(number for number, line in enumerate(lines) if line.startswith("subagent-seam agent"))
    # What the terminal is left with: no block but its summary, then the end of the turn.
    tool_lines, (text, summary, end) = lines[ready + 1 : ready + 5], lines[ready + 5 :]
    assert sorted(tool_lines) == [
        "  tool subagent (spawn): child task (other): completed",
        "  tool subagent (spawn): child task (other): in_progress",
        "  tool subagent (spawn): other task (other): completed",
        "  tool subagent (spawn): other task (other): in_progress",
    ]
    # However the children's notices fall into the parent's turns, each of those ends "All done.". A notice
    # that reaches the parent before its model reads the tool results (a loaded machine, children faster
    # than the parent's journal write) is the last message then, and the script's "Started." rule (the
    # tool results last) no longer matches: that turn ends "All done." too.
    assert re.fullmatch(r"(Started\.)?(All done\.)+", text), text
    assert summary == "2 runs: 2 completed"
    assert re.fullmatch(r"done: completed in \d+\.\d s", end)
