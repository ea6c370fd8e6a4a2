"""Session notices and context compactions in the CLI's views, fed in memory.

`HumanView` gets a console on a `StringIO` (colour on or off) and the decoded updates the ACP client
hands it; `EventView` writes JSON lines to a `StringIO`. The real CLI against the stub agent is in
`tests/test_cli.py`.
"""

from __future__ import annotations

import io
import json
from typing import Any

from subagent.acp import schema
from subagent.cli._console import Console
from subagent.cli._views import EventView, HumanView, StartInfo


def human(*updates: schema.SessionUpdate, color: bool = False, progress: bool = True) -> str:
    """What a `HumanView` writes for ``updates``."""
    stream = io.StringIO()
    view = HumanView(Console(stream, color=color), progress=progress, live=False)
    for update in updates:
        view.update(update, None)
    return stream.getvalue()


def events(*updates: schema.SessionUpdate) -> list[dict[str, Any]]:
    """The event lines an `EventView` writes for ``updates`` after a start, `time` taken out."""
    stream = io.StringIO()
    view = EventView(stream)
    view.started(StartInfo("cli-run", "session-1", ["agent"], "/", None, None, 1))
    for update in updates:
        view.update(update, None)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert all(isinstance(line.pop("time"), float | int) for line in lines)
    return lines[1:]


def test_a_notice_is_one_line_with_its_severity_title_and_description() -> None:
    notice = schema.Notice(severity="warning", title="Rate limited", description="Retrying in 30 s.")
    assert human(notice) == "  notice (warning): Rate limited - Retrying in 30 s.\n"
    assert human(schema.Notice(severity="info", title="Indexed 120 files")) == (
        "  notice (info): Indexed 120 files\n"
    )


def test_a_notice_s_severity_is_coloured_on_a_colour_console() -> None:
    error = human(schema.Notice(severity="error", title="Model unavailable"), color=True)
    assert error == "  \x1b[36mnotice\x1b[0m (\x1b[31merror\x1b[0m): Model unavailable\n"
    custom = human(schema.Notice(severity="_vendor", title="Hi"), color=True)
    assert custom == "  \x1b[36mnotice\x1b[0m (\x1b[0m_vendor\x1b[0m): Hi\n"


def test_a_notice_s_agent_text_cannot_drive_the_terminal_or_spill_over_lines() -> None:
    hostile = schema.Notice(
        severity="warn\x1b[2Jing\n",
        title="\x1b]0;owned\x07Title\non two lines",
        description="a\rb\x1b[31m red" + " word" * 200,
    )
    line = human(hostile)
    assert [char for char in line if not char.isprintable()] == ["\n"]
    assert line.count("\n") == 1
    title_and_rest = "  notice (warn[2Jing): ]0;ownedTitle on two lines - ab[31m red"
    assert line.startswith(title_and_rest)
    description = line.split(" - ", 1)[1].rstrip("\n")
    assert len(description) == 240
    assert description.endswith(" word wor\u2026")


def test_a_long_title_is_cut_to_one_sane_line() -> None:
    line = human(schema.Notice(severity="info", title="t" * 5000))
    assert line == "  notice (info): " + "t" * 119 + "\u2026\n"


def test_notices_are_progress_and_stay_out_of_a_view_without_it() -> None:
    assert human(schema.Notice(severity="error", title="Model unavailable"), progress=False) == ""


def test_a_compaction_is_one_line_per_status_and_its_summary_is_not_shown() -> None:
    summary = schema.TextContent(text="SUMMARY")
    text = human(
        schema.CompactionUpdate(compaction_id="k1", status="in_progress"),
        schema.CompactionSummaryChunk(compaction_id="k1", content=summary),
        schema.CompactionUpdate(compaction_id="k1", status="in_progress", summary=[summary]),
        schema.CompactionUpdate(compaction_id="k1", status="completed", summary=[summary]),
        schema.CompactionUpdate(compaction_id="k2", status="failed", error="context\nstill too large"),
    )
    assert text == (
        "  context compaction: in_progress\n"
        "  context compaction: completed\n"
        "  context compaction: failed (context still too large)\n"
    )


def test_a_compaction_line_does_not_break_the_streamed_answer_s_line() -> None:
    chunk = schema.AgentMessageChunk(content=schema.TextContent(text="Working on it"))
    compaction = schema.CompactionUpdate(compaction_id="k1", status="completed")
    after = schema.AgentMessageChunk(content=schema.TextContent(text="Done."))
    assert human(chunk, compaction, after) == "Working on it\n  context compaction: completed\nDone."


def test_events_carry_notices_and_compactions_as_they_are_on_the_wire() -> None:
    notice = schema.Notice(severity="warning", title="Rate limited", meta={"retryIn": 30})
    chunk = schema.CompactionSummaryChunk(compaction_id="k1", content=schema.TextContent(text="so far"))
    update = schema.CompactionUpdate(compaction_id="k1", status="completed", error=None)
    assert events(notice, chunk, update) == [
        {
            "event": "update",
            "sessionId": "session-1",
            "update": {
                "sessionUpdate": "notice",
                "severity": "warning",
                "title": "Rate limited",
                "_meta": {"retryIn": 30},
            },
        },
        {
            "event": "update",
            "sessionId": "session-1",
            "update": {
                "sessionUpdate": "compaction_summary_chunk",
                "compactionId": "k1",
                "content": {"type": "text", "text": "so far"},
            },
        },
        {
            "event": "update",
            "sessionId": "session-1",
            "update": {"sessionUpdate": "compaction_update", "compactionId": "k1", "status": "completed"},
        },
    ]
