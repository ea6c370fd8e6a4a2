"""Recording a run: ``subagent run --events-file FILE`` and ``--trace FILE.html``, and ``subagent trace``.

Both record the same lines ``--events`` writes (an :class:`~subagent.cli._views.EventView` each), next
to the view on stderr (:class:`FanOut`), with one more event first: ``prompt`` (``text``, the prompt's
first :data:`~subagent.observability.MAX_TEXT_CHARS` characters, and ``chars``, its length), which the
trace page shows as the root run's prompt. ``--trace`` feeds its lines to a
:class:`~subagent.observability.TraceBuilder` as they come (:class:`TraceRecorder`), which keeps a bounded
amount whatever the run's length, and the page is written when the run ends, however it ends.

``subagent trace EVENTS.jsonl -o FILE.html`` makes the page of a recorded stream, read line by line,
each line at most :data:`MAX_EVENT_LINE_BYTES`. A line that is not one JSON object stops it: longer than
that, not UTF-8, not JSON, nested deeper than Python parses, holding a number that is not finite
(``NaN``, ``Infinity``, ``1e400``), or JSON but no object: exit status 2, naming the line's number and
what is wrong with it, and no page is written (a stream with a broken line was cut, mixed with other
output or made by hand, and a page that silently left part of the run out would mislead). Blank lines
are skipped. What the page keeps of the lines is bounded (:mod:`subagent.observability`).
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import anyio

from subagent._finite_json import NotFiniteNumberError, loads_finite
from subagent.acp import schema
from subagent.acp._elicitation import ElicitationField, ElicitationQuestion
from subagent.acp.connection import DEFAULT_MAX_LINE_BYTES
from subagent.acp.handlers import PermissionDecision, PermissionQuestion
from subagent.cli._exits import EXIT_COMPLETED, PROG, Command, Parser, UsageError
from subagent.cli._tool_call_tracker import ToolCallState
from subagent.cli._views import EventView, RunView, StartInfo
from subagent.journal import RunRecord
from subagent.observability._trace_page import MAX_PAGE_BYTES, MAX_TEXT_CHARS, TraceBuilder
from subagent.types import SubagentResult

__all__ = [
    "MAX_EVENT_LINE_BYTES",
    "TRACE_COMMAND",
    "EventsFileError",
    "FanOut",
    "TraceRecorder",
    "emit_prompt",
    "parse_event",
    "read_events",
    "write_page",
]

logger = logging.getLogger(__name__)

MAX_EVENT_LINE_BYTES: Final = DEFAULT_MAX_LINE_BYTES + 1024 * 1024
"""The longest line ``subagent trace`` reads: an event line carries at most one message of the agent's
(the connection reads none longer than ``max_line_bytes``, 64 MiB by default) and a little of ours."""


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

    def subagent_update(self, session_id: str, update: schema.SessionUpdate) -> None:
        for view in self.views:
            view.subagent_update(session_id, update)

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

    def interrupted_runs(self, runs: Sequence[RunRecord], resume: str) -> None:
        for view in self.views:
            view.interrupted_runs(runs, resume)

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
                try:
                    self.builder.add(parse_event(line))
                except EventsFileError:
                    # Our own view wrote it; only nesting the view's stack could write but not this read
                    # can get here, and a recording must not stop the run: that event is left out.
                    logger.debug("an event line left out of the trace page", exc_info=True)
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
    """A recorded event line that cannot be read; the message says why (:func:`read_events` names the
    file and the line)."""


def parse_event(line: str) -> dict[str, Any]:
    """One event line as a JSON object, every number in it finite.

    Raises:
        EventsFileError: it is not JSON, is nested too deeply, holds a number that is not finite
            (``NaN``, ``Infinity``, ``1e400``), or is no object.
    """
    try:
        event = loads_finite(line)
    except NotFiniteNumberError as exc:
        raise EventsFileError(f"{exc.number} is not a finite number") from None
    except ValueError as exc:
        raise EventsFileError(f"not JSON ({exc})") from None
    except RecursionError:
        raise EventsFileError("nested too deeply") from None
    if not isinstance(event, dict):
        raise EventsFileError("not a JSON object")
    return event


def read_events(path: str, builder: TraceBuilder) -> None:
    """Feed every event of the ``--events`` file at ``path`` to ``builder``, one line at a time (none
    longer than :data:`MAX_EVENT_LINE_BYTES` is read whole).

    Raises:
        OSError: the file cannot be read.
        EventsFileError: a line is not one JSON object: the message gives the file, the line's number
            and why.
    """
    with open(path, "rb") as stream:
        number = 0
        while line := stream.readline(MAX_EVENT_LINE_BYTES + 1):
            number += 1
            where = f"{path}, line {number}"
            if len(line) > MAX_EVENT_LINE_BYTES:
                raise EventsFileError(f"{where}: longer than {MAX_EVENT_LINE_BYTES:,} bytes")
            try:
                text = line.decode()
            except UnicodeDecodeError as exc:
                raise EventsFileError(f"{where}: not UTF-8 (byte {exc.start + 1})") from None
            if not text.strip():
                continue
            try:
                event = parse_event(text.rstrip("\r\n"))
            except EventsFileError as exc:
                raise EventsFileError(f"{where}: {exc}") from None
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
    f"lines `{PROG} run --events-file FILE` writes (or --events on stderr). A line that is not one JSON "
    f"object (longer than {MAX_EVENT_LINE_BYTES // 2**20} MiB, not UTF-8, not JSON, nested too deeply, "
    "a number that is not finite) is an error naming its number and why, and no page is written; "
    f"blank lines are skipped. Whatever the events, the page is at most {MAX_PAGE_BYTES / 2**20:.1f} MiB. "
    "Exit status: 0 the page was written, 2 bad usage or an unreadable file."
)

TRACE_COMMAND: Final = Command(
    help="make the HTML trace page of a recorded run (an --events-file)",
    description=_TRACE_DESCRIPTION,
    usage=f"{PROG} trace EVENTS.jsonl -o FILE.html [--title TEXT]",
    add_arguments=_add_trace_arguments,
    run=_trace_command,
)
"""``subagent trace``: events in, a page out."""
