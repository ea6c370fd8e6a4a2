"""The tree of runs below the command line's agent, as the live view on a terminal draws it.

``subagent serve`` shows each run of its subagent tree as a tool call carrying
``_meta["subagent-seam/run"]`` (:data:`~subagent.types.RUN_META_KEY`); :class:`RunTree` gathers
those updates into one row per run (its parent, provider, title, state and last activity) and
draws them as a block of rows (:meth:`RunTree.frame`): indented by depth below a header, ended runs
greyed, at most :data:`MAX_BLOCK_ROWS` rows (running runs kept first, the rest counted on a last
row), each cut to the terminal's width. :meth:`RunTree.summary` is the one line left when the turn
ends.

Everything shown comes from the agent, so none of it is trusted: text is stripped of control
characters and folded to one line, a malformed member is ignored, parent links that loop are
broken, and at most :data:`MAX_TRACKED_RUNS` runs are remembered.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from subagent.acp import schema
from subagent.cli._console import fit_width, sanitize, text_width

__all__ = ["MAX_BLOCK_ROWS", "MAX_TRACKED_RUNS", "RunRow", "RunTree"]

MAX_BLOCK_ROWS: Final = 12
"""The most rows the block takes on the terminal, its header and its "… and N more" row included."""
MAX_TRACKED_RUNS: Final = 1000
"""Runs remembered: past it the oldest ended run is forgotten (still counted in the summary), and
a new run is not shown while all those remembered still run."""
MAX_LABEL_CHARS: Final = 300
"""The most characters of a run's title kept (a row is cut to the terminal's width anyway)."""
_MAX_INDENT_LEVELS: Final = 10
"""The deepest level indented to its depth (deeper rows stay there, so a row keeps room for text)."""
_MAX_IDLE_SECONDS: Final = 86_400.0
"""The longest idle time a heartbeat is believed for."""
_STATES: Final = ("running", "completed", "failed", "cancelled")
_ENDED: Final = frozenset(_STATES[1:])
_STATE_COLOR: Final = {"running": "33", "completed": "32", "failed": "31", "cancelled": "33"}
_GLYPHS: Final = {"running": "\u25cf", "completed": "\u2713", "failed": "\u2717", "cancelled": "\u2298"}
_IDLE: Final = re.compile(r"last update (\d{1,9}(?:\.\d{1,3})?) s ago")
"""The idle time in a heartbeat's line (``child alive, last update 3.2 s ago``, see ``subagent serve``)."""
_WAITING_PREFIX: Final = "waiting on a permission answer"

Paint = Callable[..., str]
""":meth:`~subagent.cli._console.Console.paint`: text and SGR codes in, text (maybe coloured) out."""


@dataclass(slots=True)
class RunRow:
    """One run as the block shows it."""

    run_id: str
    parent_id: str | None
    label: str
    """``provider: title``, sanitized, one line."""
    state: str = "running"
    last_activity: float = 0.0
    """When the run was last heard of (``time.monotonic``), or when it ended."""
    waiting: bool = False
    """The last heartbeat said the run waits on a permission answer."""


class RunTree:
    """The runs seen so far (see the module docstring); ``limit`` bounds the runs remembered."""

    def __init__(self, limit: int = MAX_TRACKED_RUNS) -> None:
        self._rows: dict[str, RunRow] = {}
        self._forgotten: dict[str, int] = {}  # ended runs forgotten past the limit, by state
        self.limit = limit

    def __len__(self) -> int:
        return len(self._rows)

    def observe(
        self, run: Mapping[str, Any], update: schema.ToolCall | schema.ToolCallProgress, now: float
    ) -> RunRow | None:
        """Take one update of the tool call showing ``run`` (its ``RUN_META_KEY`` entry, with a string
        ``runId``) received at ``now``; return its row when the run is new or changed state."""
        run_id: str = run["runId"]
        row = self._rows.get(run_id)
        state = _state(run, update)
        new = row is None
        if row is None:
            if not self._make_room():
                return None
            parent_id = run.get("parentId")
            label = _label(run.get("provider"), update.title or run_id)
            row = RunRow(run_id, parent_id if isinstance(parent_id, str) else None, label)
            self._rows[run_id] = row
        elif update.title is not None:
            row.label = _label(run.get("provider"), update.title)
        changed = new or state != row.state
        row.state = state
        row.last_activity, row.waiting = _activity(update, now, row)
        return row if changed else None

    def frame(self, now: float, columns: int, paint: Paint, *, height: int = MAX_BLOCK_ROWS) -> list[str]:
        """The block's rows at ``now``: at most ``height`` (and :data:`MAX_BLOCK_ROWS`), each cut to
        ``columns - 1`` (so a terminal never wraps one)."""
        if not self._rows:
            return []
        width = max(columns - 1, 1)
        ordered = self._tree_order()
        counts = self._counts()
        header = "runs: " + ", ".join(f"{count} {state}" for state, count in counts.items())
        budget = max(min(height, MAX_BLOCK_ROWS), 3) - 1
        shown = ordered
        hidden: list[tuple[int, RunRow]] = []
        if len(ordered) > budget:
            # Running runs first (the first started), then the last ended; shown in tree order.
            budget -= 1

            def interest(index: int) -> tuple[bool, float, int]:
                row = ordered[index][1]
                ended = row.state in _ENDED
                return ended, -row.last_activity if ended else 0.0, index

            by_interest = sorted(range(len(ordered)), key=interest)
            kept = set(by_interest[:budget])
            shown = [entry for i, entry in enumerate(ordered) if i in kept]
            hidden = [entry for i, entry in enumerate(ordered) if i not in kept]
        rows = [paint(fit_width(header, width), "1")]
        rows += [_row_text(depth, row, now, width, paint, _GLYPHS[row.state]) for depth, row in shown]
        if hidden:
            running = sum(row.state == "running" for _, row in hidden)
            more = f"\u2026 and {len(hidden)} more ({running} running)"
            rows.append(paint(fit_width("  " + more, width), "2"))
        return rows

    def summary(self) -> str | None:
        """One line for the end of the turn (``3 runs: 2 completed, 1 failed``); None if no run was seen."""
        counts = self._counts()
        total = sum(counts.values())
        if not total:
            return None
        order = ("completed", "failed", "cancelled", "running")
        parts = ", ".join(f"{counts[state]} {state}" for state in order if counts.get(state))
        return f"{total} run{'' if total == 1 else 's'}: {parts}"

    def _counts(self) -> dict[str, int]:
        counts = dict.fromkeys(_STATES, 0)
        for row in self._rows.values():
            counts[row.state] += 1
        for state, count in self._forgotten.items():
            counts[state] += count
        return {state: count for state, count in counts.items() if count}

    def _make_room(self) -> bool:
        """Forget the oldest ended run if the tree is full; False if it is full of running runs."""
        if len(self._rows) < self.limit:
            return True
        oldest = next((row for row in self._rows.values() if row.state in _ENDED), None)
        if oldest is None:
            return False
        del self._rows[oldest.run_id]
        self._forgotten[oldest.state] = self._forgotten.get(oldest.state, 0) + 1
        return True

    def _tree_order(self) -> list[tuple[int, RunRow]]:
        """(depth, row) for every row, parents before their children, each level in arrival order."""
        rows = self._rows
        children: dict[str, list[str]] = {}
        roots: list[str] = []
        for run_id, row in rows.items():
            if row.parent_id in rows and row.parent_id != run_id:
                children.setdefault(row.parent_id, []).append(run_id)
            else:
                roots.append(run_id)
        seen: set[str] = set()
        ordered: list[tuple[int, RunRow]] = []
        # Roots first: runs whose parent is not a run here. Runs only reachable through a loop of
        # parent links (a malformed tree) then become roots too, so every run is shown once.
        for start in [*roots, *rows]:
            if start in seen:
                continue
            stack = [(1, start)]
            while stack:
                depth, run_id = stack.pop()
                if run_id in seen:
                    continue
                seen.add(run_id)
                row = rows[run_id]
                ordered.append((depth, row))
                stack.extend((depth + 1, child) for child in reversed(children.get(run_id, ())))
        return ordered


def _state(run: Mapping[str, Any], update: schema.ToolCall | schema.ToolCallProgress) -> str:
    state = run.get("state")
    if isinstance(state, str) and state in _STATES:
        return state
    return {"completed": "completed", "failed": "failed"}.get(update.status or "", "running")


def _label(provider: object, title: str) -> str:
    """``provider: title`` on one line; the ``<provider> subagent: `` that serve starts a title with
    is not repeated."""
    title = _one_line(title)
    if not isinstance(provider, str) or not provider:
        return title
    provider = _one_line(provider)
    prefix = f"{provider} subagent: "
    return f"{provider}: {title.removeprefix(prefix)}"


def _one_line(text: str) -> str:
    """``text`` folded to one line, without control or format characters (no bidi overrides that
    would reorder the row around it)."""
    text = sanitize(text[: MAX_LABEL_CHARS * 2])
    if not text.isascii():
        text = "".join(char for char in text if char.isascii() or unicodedata.category(char) != "Cf")
    return " ".join(text.split())[:MAX_LABEL_CHARS]


def _activity(
    update: schema.ToolCall | schema.ToolCallProgress, now: float, row: RunRow
) -> tuple[float, bool]:
    """When the run was last active and whether it waits on a permission answer, after ``update``."""
    if isinstance(update, schema.ToolCall) or update.status is not None or not update.content:
        return now, False
    # A heartbeat: its line says how long the child has been quiet.
    first = update.content[0]
    block = first.content if isinstance(first, schema.Content) else None
    text = block.text[:200] if isinstance(block, schema.TextContent) else ""
    if text.startswith(_WAITING_PREFIX):
        return row.last_activity, True
    idle = _IDLE.search(text)
    if idle is None:
        return row.last_activity, False
    return now - min(float(idle.group(1)), _MAX_IDLE_SECONDS), False


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{int(seconds)} s ago"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    return f"{int(seconds // 3600)} h ago"


def _row_text(depth: int, row: RunRow, now: float, width: int, paint: Paint, glyph: str) -> str:
    indent = "  " * min(depth, _MAX_INDENT_LEVELS)
    state = "waiting on a permission answer" if row.waiting and row.state == "running" else row.state
    status = f"{state}, {_ago(now - row.last_activity)}"
    room = width - text_width(indent) - 2 - 2 - text_width(status)
    ended = row.state in _ENDED
    label_color = ("2",) if ended else ()
    if room < 8:
        # Too narrow for both: the label first, cut with the rest.
        text = fit_width(f"{indent}{glyph} {row.label}  {status}", width)
        return paint(text, "2") if ended else text
    label = fit_width(row.label, room)
    return (
        f"{indent}{paint(glyph, _STATE_COLOR[row.state])} {paint(label, *label_color)}  {paint(status, '2')}"
    )
