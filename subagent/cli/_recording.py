"""Recording a run: ``subagent run --events-file FILE`` and ``--trace FILE.html``, and ``subagent trace``.

Both record the same lines ``--events`` writes (an :class:`~subagent.cli._views.EventView` each), next
to the view on stderr (:class:`FanOut`), with one more event first: ``prompt`` (``text``, the prompt's
first :data:`~subagent.observability.MAX_TEXT_CHARS` characters, and ``chars``, its length), which the
trace page shows as the root run's prompt. ``--trace`` feeds its lines to a
:class:`~subagent.observability.TraceBuilder` as they come (:class:`TraceRecorder`), which keeps a bounded
amount whatever the run's length, and the page is written when the run ends, however it ends.

``subagent trace EVENTS.jsonl -o FILE.html`` makes the page of a recorded stream, read line by line.
A line that is not a JSON object stops it: exit status 2, naming the line's number, and no page is
written (a stream with a broken line was cut or mixed with other output, and a page that silently
left part of the run out would mislead). Blank lines are skipped.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import anyio

from subagent.acp import schema
from subagent.acp._elicitation import ElicitationField, ElicitationQuestion
from subagent.acp.handlers import PermissionDecision, PermissionQuestion
from subagent.cli._exits import EXIT_COMPLETED, PROG, Command, Parser, UsageError
from subagent.cli._tool_call_tracker import ToolCallState
from subagent.cli._views import EventView, RunView, StartInfo
from subagent.observability._trace_page import MAX_TEXT_CHARS, TraceBuilder
from subagent.types import SubagentResult

__all__ = ["TRACE_COMMAND", "FanOut", "TraceRecorder", "emit_prompt", "read_events", "write_page"]


class FanOut(RunView):
    """Shows a run on several views at once, in order."""

    def __init__(self, views: Sequence[RunView]) -> None:
        self.views = list(views)

    def spawning(self, command: Sequence[str], cwd: str) -> None:
        for view in self.views:
            view.spawning(command, cwd)

    def started(self, info: StartInfo) -> None:
        for view in self.views:
            view.started(info)

    def update(self, update: schema.SessionUpdate, changed_call: ToolCallState | None) -> None:
        for view in self.views:
            view.update(update, changed_call)

    def question(self, question: PermissionQuestion, call: ToolCallState, timeout: float) -> None:
        for view in self.views:
            view.question(question, call, timeout)

    def answered(self, *, echoed: bool) -> None:
        for view in self.views:
            view.answered(echoed=echoed)

    def decided(
        self, question: PermissionQuestion, call: ToolCallState, decision: PermissionDecision, reason: str
    ) -> None:
        for view in self.views:
            view.decided(question, call, decision, reason)

    def interrupted(self, signal_name: str, count: int, action: str) -> None:
        for view in self.views:
            view.interrupted(signal_name, count, action)

    def elicitation(self, question: ElicitationQuestion, timeout: float) -> None:
        for view in self.views:
            view.elicitation(question, timeout)

    def elicitation_field(self, field: ElicitationField, problem: str | None) -> None:
        for view in self.views:
            view.elicitation_field(field, problem)

    def elicited(self, question: ElicitationQuestion, action: str, reason: str) -> None:
        for view in self.views:
            view.elicited(question, action, reason)

    def start_failed(self, message: str) -> None:
        for view in self.views:
            view.start_failed(message)

    def ended(self, result: SubagentResult, elapsed: float) -> None:
        for view in self.views:
            view.ended(result, elapsed)

    def log(self, record: logging.LogRecord, message: str) -> None:
        for view in self.views:
            view.log(record, message)

    async def tick(self) -> None:
        # Every view's clock-driven parts, the live one among them, kept current side by side.
        async with anyio.create_task_group() as task_group:
            for view in self.views:
                task_group.start_soon(view.tick)


class _LineSink(io.StringIO):
    """A text stream that hands each whole line written to a builder, parsed, and keeps none of them."""

    def __init__(self, builder: TraceBuilder) -> None:
        super().__init__()
        self.builder = builder
        self._partial = ""

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if line.strip():
                self.builder.add(json.loads(line))
        return len(text)


class TraceRecorder(EventView):
    """The events of a run, recorded into a :class:`~subagent.observability.TraceBuilder` (bounded)."""

    def __init__(self) -> None:
        self.builder = TraceBuilder()
        super().__init__(_LineSink(self.builder))


def emit_prompt(view: EventView, prompt: str) -> None:
    """Record the ``prompt`` event (the prompt, cut to what a page shows, and its length) on ``view``."""
    view.emit("prompt", text=prompt[:MAX_TEXT_CHARS], chars=len(prompt))


def write_page(path: str, html: str) -> None:
    """Write ``html`` to ``path`` whole or not at all (a new file beside it, renamed over it)."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    # Created as open() would create the page itself (mode 0o666 less the umask), never over a file.
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(html)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


class EventsFileError(Exception):
    """A recorded event stream that cannot be read: its message names the line."""


def read_events(path: str, builder: TraceBuilder) -> None:
    """Feed every event of the ``--events`` file at ``path`` to ``builder``, one line at a time.

    Raises:
        OSError: the file cannot be read.
        EventsFileError: a line is not a JSON object (the message gives its number).
    """
    with open(path, encoding="utf-8", errors="replace") as stream:
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError as exc:
                raise EventsFileError(f"{path}, line {number}: not JSON ({exc})") from None
            if not isinstance(event, dict):
                raise EventsFileError(f"{path}, line {number}: not a JSON object")
            builder.add(event)


def _trace_command(args: argparse.Namespace, command: list[str] | None) -> int:
    if command is not None:
        raise UsageError("trace takes no `-- COMMAND`")
    builder = TraceBuilder()
    try:
        read_events(args.events, builder)
    except EventsFileError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot read {args.events}: {exc.strerror or exc}") from None
    title = args.title or f"subagent trace: {os.path.basename(args.events)}"
    try:
        write_page(args.output, builder.page(title))
    except OSError as exc:
        raise UsageError(f"-o: cannot write {args.output}: {exc.strerror or exc}") from None
    return EXIT_COMPLETED


def _add_trace_arguments(parser: Parser) -> None:
    parser.add_argument(
        "events", metavar="EVENTS.jsonl", help="the event lines of a run (`run --events-file`)"
    )
    parser.add_argument("-o", "--output", metavar="FILE.html", required=True, help="where to write the page")
    parser.add_argument("--title", metavar="TEXT", help="the page's title (default: from the file's name)")


_TRACE_DESCRIPTION: Final = (
    "Make the trace page of a recorded run: one self-contained HTML file (no network) showing the run "
    "and its whole tree of subagent runs on one timeline, each a bar with its tool calls, permission "
    "waits and errors; click a bar for its prompt, output, usage and stop reason. The events are the "
    f"lines `{PROG} run --events-file FILE` writes (or --events on stderr). A line that is not a JSON "
    "object is an error naming its number, and no page is written; blank lines are skipped. Exit "
    "status: 0 the page was written, 2 bad usage or an unreadable file."
)

TRACE_COMMAND: Final = Command(
    help="make the HTML trace page of a recorded run (an --events-file)",
    description=_TRACE_DESCRIPTION,
    usage=f"{PROG} trace EVENTS.jsonl -o FILE.html [--title TEXT]",
    add_arguments=_add_trace_arguments,
    run=_trace_command,
)
"""``subagent trace``: events in, a page out."""
