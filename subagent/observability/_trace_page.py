"""The trace page: a recorded ``subagent run`` event stream in, one self-contained HTML page out.

:class:`TraceBuilder` reads the events of ``subagent run --events`` one at a time (``add``, each a
parsed JSON line, see :mod:`subagent.cli._views`) and keeps only what the page shows, each part capped,
so recording a long run holds a bounded amount: at most :data:`MAX_RUNS` runs, :data:`MAX_MARKS` marks
per run (:data:`MAX_KEPT_MARKS` in all), and :data:`MAX_TEXT_CHARS` characters of each prompt, output
and error (:data:`MAX_KEPT_CHARS` in all); the page says when it shows less than there was.
:meth:`TraceBuilder.page` (or :func:`render_trace_page` on a whole stream) lays it out as a page with
its CSS, script and data inline: no network, no external URL. The CSS and the script are this package's
data files ``trace_page.css`` and ``trace_page.js``.

What the page shows: one row per run, in tree order (each child below its parent, indented by its
depth; a subtree folds away), on one time axis. The command line's own run is the root (from its
``spawn``/``start`` to its ``end``); each run of the agent's subagent tree (a ``run`` event) is a
bar from its first ``running`` to its end, coloured by how it ended. Marks on a bar: its tool calls
(a call ``OWNER/ID`` is the run ``OWNER``'s, one with no known owner the root's), permission waits
(a ``permission_request`` to its ``permission``), the agent's turns (``subagent serve`` marks each,
``TURN_META_KEY``: several per prompt when background children call for more), its model calls
retried (``RETRY_META_KEY``), streamed answer text, interrupts, errors, and warnings logged.
Clicking a bar (or its label) shows its details: the prompt, the output, the usage, the stop reason,
its times and its marks. A child's prompt is the
``prompt`` argument of one of its parent's delegating tool calls (the first not matched yet whose
start the run's title quotes, else the first not matched yet); its output is the excerpt its run's
last update carries.
The root's prompt comes from a ``prompt`` event (``subagent run --trace`` and ``--events-file``
write one) and its output is its streamed text.

Every text of the agent's is data: it is embedded as JSON in a ``<script type="application/json">``
with ``<``, ``>`` and ``&`` escaped, and the page's script inserts it with ``textContent`` only.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from subagent._text import one_line
from subagent.types import RETRY_META_KEY, RUN_META_KEY, TURN_META_KEY

__all__ = [
    "MAX_KEPT_CHARS",
    "MAX_KEPT_MARKS",
    "MAX_MARKS",
    "MAX_RUNS",
    "MAX_TEXT_CHARS",
    "TraceBuilder",
    "render_trace_page",
]

MAX_RUNS: Final = 5_000
"""Runs kept; later ones are counted, not shown."""
MAX_MARKS: Final = 400
"""Marks (tool calls, permission waits, text, errors) kept per run; later ones are counted."""
MAX_TEXT_CHARS: Final = 4_000
"""Characters kept of each prompt, output and error; the page says how many there were."""
_MAX_LABEL_CHARS: Final = 120
"""Characters kept of a title or a mark's label."""
MAX_KEPT_CHARS: Final = 4_000_000
"""Characters kept of all texts together: past them a text keeps nothing more (its length still counts)."""
MAX_KEPT_MARKS: Final = 50_000
"""Marks kept of all runs together."""
_MAX_PENDING_PROMPTS: Final = 256
"""Delegation prompts kept (of all runs together) while they wait for the run they started."""

_ENDED_STATES: Final = frozenset({"completed", "failed", "cancelled"})
_ROOT_STATES: Final = {"completed": "completed", "cancelled": "cancelled", "error": "failed"}
"""The root run's state by its stop reason; any other stop reason reads ``stopped``."""


@dataclass(slots=True)
class _Budget:
    """What is left to keep of all runs together."""

    chars: int = MAX_KEPT_CHARS
    marks: int = MAX_KEPT_MARKS


@dataclass(slots=True)
class _Text:
    """A text kept up to :data:`MAX_TEXT_CHARS` (and what is left of the budget), with its length."""

    budget: _Budget
    kept: str = ""
    total: int = 0

    def append(self, text: str) -> None:
        self.total += len(text)
        room = min(MAX_TEXT_CHARS - len(self.kept), self.budget.chars)
        if room > 0 and text:
            taken = text[:room]
            self.kept += taken
            self.budget.chars -= len(taken)

    def replace(self, text: str) -> None:
        self.budget.chars += len(self.kept)
        self.kept, self.total = "", 0
        self.append(text)


@dataclass(slots=True)
class _Run:
    id: str
    parent: str | None
    budget: _Budget
    provider: str | None = None
    title: str = ""
    state: str = "running"
    stop_reason: str | None = None
    start: float | None = None
    end: float | None = None
    prompt: _Text = field(init=False)
    output: _Text = field(init=False)
    error: _Text = field(init=False)
    usage: dict[str, Any] | None = None
    elapsed: float | None = None
    """The run's own measure of its time, when its last update gave one."""
    marks: list[list[Any]] = field(default_factory=list)
    """Each ``[kind, start, end, label, status]``; ``end`` is None while it lasts, or for a point."""
    marks_dropped: int = 0
    open_marks: dict[str, int] = field(default_factory=dict)
    """Where an open tool call's or permission wait's mark is, by kind and tool call id."""
    text_mark: int | None = None
    """The mark of the answer text streaming now, until something else happens."""

    def __post_init__(self) -> None:
        self.prompt, self.output, self.error = _Text(self.budget), _Text(self.budget), _Text(self.budget)

    def mark(
        self, kind: str, when: float, label: str, status: str | None = None, *, lasts: bool
    ) -> int | None:
        if len(self.marks) >= MAX_MARKS or self.budget.marks <= 0:
            self.marks_dropped += 1
            return None
        self.budget.marks -= 1
        self.marks.append([kind, when, when if not lasts else None, _label(label), status])
        return len(self.marks) - 1


def _label(text: str) -> str:
    return one_line(text, _MAX_LABEL_CHARS)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _count(value: object) -> int | None:
    """An int that is no bool, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _matching_prompt(pending: list[str], title: str | None) -> int:
    """Which delegation prompt started the run titled ``title``: the first one its title quotes
    (``<provider> subagent: <excerpt>``, as ``subagent serve`` titles a run), else the first one."""
    excerpt = (title or "").partition("subagent: ")[2].removesuffix("\u2026")
    if excerpt:
        for index, prompt in enumerate(pending):
            if " ".join(prompt.split()).startswith(excerpt):
                return index
    return 0


def _content_text(content: object) -> str:
    """The text of a tool call's ``content`` list (its ``content`` blocks of type text)."""
    if not isinstance(content, list):
        return ""
    parts = []
    for item in content:
        block = item.get("content") if isinstance(item, Mapping) else None
        if isinstance(block, Mapping) and isinstance(block.get("text"), str):
            parts.append(block["text"])
    return "\n".join(parts)


class TraceBuilder:
    """Reads run events one by one (:meth:`add`) and keeps, bounded, what the trace page shows."""

    def __init__(self) -> None:
        self._runs: dict[str, _Run] = {}
        self._budget = _Budget()
        self._root = _Run("run", None, self._budget, provider="acp", title="subagent run")
        self._runs[self._root.id] = self._root
        self._pending_prompts: dict[str, list[str]] = {}
        self._pending_count = 0
        self._run_update: tuple[str, Mapping[str, Any]] | None = None
        self._first: float | None = None
        self._last: float | None = None
        self.runs_dropped = 0
        """Runs that ended but were not kept, :data:`MAX_RUNS` being kept already."""
        self.events = 0
        """Events read."""

    def add(self, event: Mapping[str, Any]) -> None:
        """Take one event (a parsed ``--events`` line); members of the wrong type are ignored."""
        self.events += 1
        when = event.get("time")
        if not isinstance(when, int | float) or isinstance(when, bool):
            when = self._last if self._last is not None else 0.0
        when = float(when)
        if self._first is None or when < self._first:
            self._first = when
        if self._last is None or when > self._last:
            self._last = when
        root = self._root
        if root.start is None:
            root.start = when
        kind = event.get("event")
        if kind == "spawn":
            command = event.get("command")
            if isinstance(command, list) and command:
                # The program's name only, until the agent names itself: an argument may be a secret.
                root.title = _label(str(command[0]).rsplit("/", 1)[-1])
        elif kind == "start":
            self._started(event)
        elif kind == "prompt":
            text = _text(event.get("text"))
            if text is not None:
                root.prompt.replace(text)
                total = event.get("chars")
                if isinstance(total, int) and total > root.prompt.total:
                    root.prompt.total = total
        elif kind == "update":
            update = event.get("update")
            if isinstance(update, Mapping):
                self._update(update, when)
        elif kind == "run":
            self._run(event, when)
        elif kind == "permission_request":
            self._permission_asked(event, when)
        elif kind == "permission":
            self._permission_decided(event, when)
        elif kind == "interrupt":
            root.mark("interrupt", when, f"{event.get('signal')}: {event.get('action')}", lasts=False)
            root.text_mark = None
        elif kind == "start_failed":
            root.error.replace(_text(event.get("error")) or "the agent failed to start")
            root.mark("error", when, "the agent failed to start", lasts=False)
            self._ended(root, when, "failed", "error")
        elif kind == "end":
            error = _text(event.get("error"))
            stop = _text(event.get("stopReason"))
            if error:
                root.error.replace(error)
                root.mark("error", when, error, lasts=False)
            usage = event.get("usage")
            if isinstance(usage, Mapping):
                root.usage = dict(usage)
            # A turn cut short (refusal, max_tokens, timeout...) is no failure of the agent: its own colour.
            state = _ROOT_STATES.get(stop or "", "stopped")
            self._ended(root, when, state, stop)
        elif kind == "log":
            level = _text(event.get("level"))
            if level in ("warning", "error", "critical"):
                root.mark("log", when, _text(event.get("message")) or "", level, lasts=False)

    def _started(self, event: Mapping[str, Any]) -> None:
        run_id = _text(event.get("runId"))
        root = self._root
        if run_id is not None and run_id != root.id and run_id not in self._runs:
            del self._runs[root.id]
            self._pending_prompts.pop(root.id, None)
            root.id = run_id
            self._runs[run_id] = root
        agent = event.get("agent")
        if isinstance(agent, Mapping) and isinstance(agent.get("name"), str):
            version = _text(agent.get("version"))
            root.title = _label(agent["name"] + (f" {version}" if version else ""))

    def _turn(self, update: Mapping[str, Any], when: float) -> None:
        """A turn of the agent beginning or ending (``subagent serve`` says so: ``TURN_META_KEY``)."""
        meta = update.get("_meta")
        turn = meta.get(TURN_META_KEY) if isinstance(meta, Mapping) else None
        if not isinstance(turn, Mapping):
            return
        number = _count(turn.get("turn"))
        label = "turn" if number is None else f"turn {number}"
        root = self._root
        root.text_mark = None
        state = turn.get("state")
        if state == "started":
            if turn.get("woken") is True:
                label += " (its background children's notices)"
            index = root.mark("turn", when, label, lasts=True)
            if index is not None:
                root.open_marks["turn"] = index
        elif state == "ended":
            index = root.open_marks.pop("turn", None)
            if index is not None:
                root.marks[index][2] = when
                root.marks[index][4] = _text(turn.get("stopReason"))

    def _retry(self, update: Mapping[str, Any], when: float) -> None:
        """A model call of the agent failed and is retried (``subagent serve`` says so:
        ``RETRY_META_KEY``): a point mark, each part of its label shown only when well typed."""
        meta = update.get("_meta")
        retry = meta.get(RETRY_META_KEY) if isinstance(meta, Mapping) else None
        if not isinstance(retry, Mapping):
            return
        attempt, attempts = _count(retry.get("attempt")), _count(retry.get("attempts"))
        details = [] if attempt is None or attempts is None else [f"attempt {attempt} of {attempts}"]
        reason = _text(retry.get("reason"))
        if reason:
            details.append(reason)
        label = "model call retried" + (f" ({', '.join(details)})" if details else "")
        delay = retry.get("delay")
        if isinstance(delay, int | float) and not isinstance(delay, bool):
            label += f", next in {delay:.2f} s"
        self._root.text_mark = None  # the retried call's answer text is a mark of its own
        self._root.mark("retry", when, label, lasts=False)

    def _owner(self, tool_call_id: str) -> _Run:
        """The run a tool call belongs to: ``OWNER/ID`` is the run ``OWNER``'s, anything else the root's."""
        owner, slash, _ = tool_call_id.partition("/")
        return self._runs.get(owner, self._root) if slash else self._root

    def _update(self, update: Mapping[str, Any], when: float) -> None:
        kind = update.get("sessionUpdate")
        root = self._root
        if kind == "agent_message_chunk":
            content = update.get("content")
            text = content.get("text") if isinstance(content, Mapping) else None
            if isinstance(text, str):
                root.output.append(text)
                if root.text_mark is None:
                    root.text_mark = root.mark("text", when, "answer text", lasts=True)
                if root.text_mark is not None:
                    root.marks[root.text_mark][2] = when
            return
        if kind == "session_info_update":
            self._turn(update, when)
            self._retry(update, when)
            return
        if kind not in ("tool_call", "tool_call_update"):
            return
        call_id = _text(update.get("toolCallId"))
        if call_id is None:
            return
        if call_id.startswith("run/"):
            self._run_update = (call_id[4:], update)  # read with the `run` event that follows
            return
        owner = self._owner(call_id)
        root.text_mark = None
        key = f"tool:{call_id}"
        status = _text(update.get("status"))
        index = owner.open_marks.get(key)
        if index is None and kind == "tool_call":
            title = _text(update.get("title")) or call_id
            index = owner.mark("tool", when, title, status, lasts=True)
            if index is not None:
                owner.open_marks[key] = index
            raw = update.get("rawInput")
            prompt = raw.get("prompt") if isinstance(raw, Mapping) else None
            if isinstance(prompt, str) and self._pending_count < _MAX_PENDING_PROMPTS:
                self._pending_prompts.setdefault(owner.id, []).append(prompt[:MAX_TEXT_CHARS])
                self._pending_count += 1
        if index is None:
            return
        mark = owner.marks[index]
        if status is not None:
            mark[4] = status
        if status in ("completed", "failed"):
            mark[2] = when
            del owner.open_marks[key]
            if status == "failed":
                owner.mark("error", when, f"tool call failed: {mark[3]}", lasts=False)

    def _run(self, event: Mapping[str, Any], when: float) -> None:
        run_id = _text(event.get("runId"))
        if run_id is None:
            return
        run = self._runs.get(run_id)
        if run is None:
            if len(self._runs) >= MAX_RUNS:
                # Counted at their end, which comes once (a run sends many `running` events).
                self.runs_dropped += _text(event.get("state")) in _ENDED_STATES
                return
            parent = _text(event.get("parentId"))
            run = _Run(run_id, parent, self._budget, start=when)
            self._runs[run_id] = run
            pending = self._pending_prompts.get(parent or self._root.id)
            if pending:
                run.prompt.replace(pending.pop(_matching_prompt(pending, _text(event.get("title")))))
                self._pending_count -= 1
        run.provider = _text(event.get("provider")) or run.provider
        run.title = _label(_text(event.get("title")) or run.title or run_id)
        state = _text(event.get("state"))
        update, self._run_update = self._run_update, None
        if state in _ENDED_STATES and run.end is None:
            if update is not None and update[0] == run_id:
                self._run_result(run, update[1], failed=state == "failed")
            self._ended(run, when, state, _text(event.get("stopReason")))

    @staticmethod
    def _run_result(run: _Run, update: Mapping[str, Any], *, failed: bool) -> None:
        """What a run's last update says: its last message's excerpt (or its error), usage, elapsed."""
        text = _content_text(update.get("content"))
        (run.error if failed else run.output).replace(text)
        meta = update.get("_meta")
        details = meta.get(RUN_META_KEY) if isinstance(meta, Mapping) else None
        if not isinstance(details, Mapping):
            return
        usage = details.get("usage")
        if isinstance(usage, Mapping):
            run.usage = dict(usage)
        elapsed = details.get("elapsedSeconds")
        if isinstance(elapsed, int | float) and not isinstance(elapsed, bool):
            run.elapsed = float(elapsed)

    def _ended(self, run: _Run, when: float, state: str, stop_reason: str | None) -> None:
        run.state = state
        run.stop_reason = stop_reason
        run.end = when
        run.text_mark = None
        for index in run.open_marks.values():
            run.marks[index][2] = when
        run.open_marks.clear()

    def _permission_asked(self, event: Mapping[str, Any], when: float) -> None:
        call_id = _text(event.get("toolCallId")) or ""
        owner = self._owner(call_id)
        owner.text_mark = None
        title = _text(event.get("title")) or call_id
        index = owner.mark("permission", when, f"permission asked: {title}", "waiting", lasts=True)
        if index is not None:
            owner.open_marks[f"permission:{call_id}"] = index

    def _permission_decided(self, event: Mapping[str, Any], when: float) -> None:
        call_id = _text(event.get("toolCallId")) or ""
        owner = self._owner(call_id)
        option = event.get("option")
        answer = _text(option.get("kind")) if isinstance(option, Mapping) else None
        answer = answer or _text(event.get("outcome")) or "answered"
        reason = _text(event.get("reason"))
        index = owner.open_marks.pop(f"permission:{call_id}", None)
        if index is None:
            title = _text(event.get("title")) or call_id
            index = owner.mark("permission", when, f"permission: {title}", lasts=False)
        if index is not None:
            mark = owner.marks[index]
            mark[2] = when
            mark[4] = answer + (f" ({reason})" if reason else "")

    def data(self) -> dict[str, Any]:
        """What the page embeds: the runs in tree order, times in seconds from the first event."""
        origin = self._first or 0.0
        finish = self._last or origin

        def at(value: float | None) -> float | None:
            return None if value is None else round(value - origin, 3)

        rows = []
        for run, depth in self._tree_order():
            rows.append(
                {
                    "id": run.id,
                    "parent": run.parent,
                    "depth": depth,
                    "provider": run.provider,
                    "title": run.title,
                    "state": run.state,
                    "stopReason": run.stop_reason,
                    "start": at(run.start),
                    "end": at(run.end),
                    "prompt": run.prompt.kept,
                    "promptChars": run.prompt.total,
                    "output": run.output.kept,
                    "outputChars": run.output.total,
                    "error": run.error.kept or None,
                    "usage": run.usage,
                    "elapsed": run.elapsed,
                    "marks": [
                        [kind, at(start), at(end), label, status]
                        for kind, start, end, label, status in run.marks
                    ],
                    "marksDropped": run.marks_dropped,
                }
            )
        return {
            "duration": round(finish - origin, 3),
            "origin": origin,
            "runs": rows,
            "runsDropped": self.runs_dropped,
            "events": self.events,
        }

    def _tree_order(self) -> list[tuple[_Run, int]]:
        """Every run once, each after its parent; a run whose parent is unknown hangs below the root."""
        children: dict[str, list[_Run]] = {}
        root = self._root
        for run in self._runs.values():
            if run is root:
                continue
            parent = run.parent if run.parent in self._runs and run.parent != run.id else root.id
            children.setdefault(parent, []).append(run)
        ordered: list[tuple[_Run, int]] = []
        seen: set[str] = set()
        stack = [(root, 0)]
        while stack:
            run, depth = stack.pop()
            if run.id in seen:
                continue
            seen.add(run.id)
            ordered.append((run, depth))
            stack.extend((child, depth + 1) for child in reversed(children.get(run.id, [])))
        # A cycle of parents never reaches the root: those runs go last, below it.
        ordered.extend((run, 1) for run in self._runs.values() if run.id not in seen)
        return ordered

    def page(self, title: str = "subagent trace") -> str:
        """The trace page: one HTML document, everything inline."""
        return _page(self.data(), title)


def render_trace_page(events: Iterable[Mapping[str, Any]], title: str = "subagent trace") -> str:
    """The trace page of a whole recorded event stream (see :class:`TraceBuilder`)."""
    builder = TraceBuilder()
    for event in events:
        builder.add(event)
    return builder.page(title)


def _script_json(data: object) -> str:
    """``data`` as JSON that cannot end the ``<script>`` element it sits in, nor open a comment in it."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (
        text.replace("&", "\\u0026")
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _html_text(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


@functools.cache
def _asset(name: str) -> str:
    """A file of the page (its style, its script), read once from this package's data files."""
    # Imported here, as only a page being written needs it: it costs the command line's start ~25 ms.
    import importlib.resources

    return importlib.resources.files("subagent.observability").joinpath(name).read_text(encoding="utf-8")


def _page(data: Mapping[str, Any], title: str) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_html_text(title)}</title>\n"
        f"<style>\n{_asset('trace_page.css')}</style>\n</head>\n<body>\n{_BODY}\n"
        f'<script type="application/json" id="trace-data">{_script_json(data)}</script>\n'
        f"<script>\n{_asset('trace_page.js')}</script>\n</body>\n</html>\n"
    )


_BODY: Final = """\
<header>
  <h1 id="heading">subagent trace</h1>
  <span id="summary"></span>
  <button type="button" id="zoom-out" hidden>show the whole run</button>
  <span class="legend">
    <span class="key state-completed">completed</span><span class="key state-failed">failed</span>
    <span class="key state-stopped">stopped</span><span class="key state-cancelled">cancelled</span>
    <span class="key state-running">not ended</span><span class="key mark-tool">tool call</span>
    <span class="key mark-permission">permission wait</span><span class="key mark-text">answer text</span>
    <span class="key mark-turn">turn</span><span class="key mark-retry">retry</span>
    <span class="key mark-error">error</span>
  </span>
</header>
<main>
  <section id="timeline">
    <div class="row axis"><div class="label">run</div><div class="lane" id="ticks"></div></div>
    <div id="rows"></div>
  </section>
  <aside id="details"><p class="hint">Click a bar to see its run: prompt, output, usage, times.</p></aside>
</main>"""
