"""The trace page: a recorded ``subagent run`` event stream in, one self-contained HTML page out.

:class:`TraceBuilder` reads the events of ``subagent run --events`` one at a time (``add``, each a
parsed JSON line, see :mod:`subagent.cli._views`) and keeps only what the page shows, every part of it
bounded, so recording a run of any length holds a bounded amount, and the page of any event stream,
however hostile its agent, takes at most :data:`MAX_PAGE_BYTES` (18.1 MiB):

* at most :data:`MAX_RUNS` runs, :data:`MAX_MARKS` marks per run and :data:`MAX_KEPT_MARKS` in all;
* :data:`MAX_TEXT_CHARS` characters of each prompt, output and error, and :data:`MAX_KEPT_TEXT_BYTES`
  of all of them together;
* every other string an agent chose (run ids, providers, titles, stop reasons, mark labels and
  statuses) cut short (120 characters), and :data:`MAX_KEPT_LABEL_BYTES` of them together: past that,
  a new run or mark is counted, not kept;
* usage as ACP's known counts (whole numbers up to 2**53) and a cost (a finite amount, a currency of at
  most 16 characters), whatever else the agent put there left out; a time or a duration that is not a
  number within 10**12 seconds of 0 is taken as missing.

The budgets count bytes as the page embeds them (escapes included), so :data:`MAX_PAGE_BYTES` follows
from the caps: the page's frame, each kept run and mark with every number at its widest, and the two
budgets. The page says when it shows less than there was.
:meth:`TraceBuilder.page` (or :func:`render_trace_page` on a whole stream) lays it out as a page with
its CSS, script and data inline: no network, no external URL. The CSS and the script are this package's
data files ``trace_page.css`` and ``trace_page.js``.

What the page shows: one row per run, in tree order (each child below its parent, indented by its
depth; a subtree folds away), on one time axis. The command line's own run is the root (from its
``spawn``/``start`` to its ``end``); each run of the agent's subagent tree (a ``run`` event) is a
bar from its first ``running`` to its end, coloured by how it ended. Marks on a bar: its tool calls
(a call ``OWNER/ID`` is the run ``OWNER``'s, a call a subagent session sent is its run's, one with no
known owner the root's), permission waits
(a ``permission_request`` to its ``permission``), the agent's turns (``subagent serve`` marks each,
``TURN_META_KEY``: several per prompt when background children call for more), its model calls
retried (``RETRY_META_KEY``), streamed answer text, interrupts, errors, and warnings logged.
Clicking a bar (or its label) shows its details: the prompt, the output, the usage, the stop reason,
its times and its marks. A run its budget stopped has a badge on its bar (``budget: max_tokens 10,312 of
10,000``), and its details give the limit and what it spent beside each cap: read from the ``end``
event for the root, and from a run's last update's ``_meta`` (``limit``, ``budget``, ``spent``, as
:mod:`subagent._budget_codec` writes them) for the others; a cap's name must be one the budget knows.
A child's prompt is the ``prompt`` argument of one of its parent's delegating tool calls (the first
not matched yet whose start the run's title quotes, else the first not matched yet); its output is the
excerpt its run's last update carries.
The root's prompt comes from a ``prompt`` event (``subagent run --trace`` and ``--events-file``
write one) and its output is its streamed text.

Every text of the agent's is data: it is embedded as JSON in a ``<script type="application/json">``
with ``<``, ``>`` and ``&`` escaped, and the page's script inserts it with ``textContent`` only.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from subagent._text import cut, one_line
from subagent._usage_codec import COUNT_FIELDS
from subagent.types import BUDGET_FIELDS, RETRY_META_KEY, RUN_META_KEY, TURN_META_KEY

__all__ = [
    "MAX_KEPT_LABEL_BYTES",
    "MAX_KEPT_MARKS",
    "MAX_KEPT_TEXT_BYTES",
    "MAX_MARKS",
    "MAX_PAGE_BYTES",
    "MAX_RUNS",
    "MAX_TEXT_CHARS",
    "TraceBuilder",
    "render_trace_page",
]

MAX_RUNS: Final = 5_000
"""Runs kept; later ones are counted, not shown."""
MAX_MARKS: Final = 400
"""Marks (tool calls, permission waits, text, errors) kept per run; later ones are counted."""
MAX_KEPT_MARKS: Final = 50_000
"""Marks kept of all runs together."""
MAX_TEXT_CHARS: Final = 4_000
"""Characters kept of each prompt, output and error; the page says how many there were."""
MAX_KEPT_TEXT_BYTES: Final = 4 * 1024 * 1024
"""Bytes the page's data gives all prompts, outputs and errors together (as embedded: an escaped
character counts its escape): past them a text keeps nothing more (its length still counts)."""
MAX_KEPT_LABEL_BYTES: Final = 4 * 1024 * 1024
"""Bytes the page's data gives every other string an agent chose, together: run ids, providers,
titles, stop reasons, mark labels and statuses. Past them a new run or mark is counted, not kept."""
_MAX_LABEL_CHARS: Final = 120
"""Characters kept of a run id, a provider's name, a title, a stop reason, a mark's label or status."""
_MAX_CURRENCY_CHARS: Final = 16
"""Characters kept of a cost's currency."""
_MAX_TITLE_CHARS: Final = 200
"""Characters kept of the page's own title."""
_MAX_PENDING_PROMPTS: Final = 256
"""Delegation prompts kept (of all runs together) while they wait for the run they started."""
_MAX_SECONDS: Final = 1e12
"""The furthest from 0 a time (seconds since the epoch, about 1.7e9 now) or a duration may be; one
further, or not finite, is taken as missing."""
_MAX_COUNT: Final = 2**53
"""The largest count shown (JavaScript reads no larger whole number exactly); a larger one is left out."""
_MAX_CHAR_BYTES: Final = 6
"""The most bytes one character takes in the page's data: an escape such as ``\\u003c``."""
_WIDEST_FLOAT: Final = -2.2250738585072014e-308
"""A float whose JSON is as long as any float's can be (24 characters): the widest number on the page."""

_LIMITS: Final = frozenset({*BUDGET_FIELDS, "timeout"})
"""What a run's ``limit`` may name: a budget's cap or the inactivity timeout (anything else is dropped)."""
_SPENT_COUNTS: Final = ("tokens", "toolCalls", "turns")
_SPENT_AMOUNTS: Final = ("cost", "seconds")
_ENDED_STATES: Final = frozenset({"completed", "failed", "cancelled"})
_ROOT_STATES: Final = {"completed": "completed", "cancelled": "cancelled", "error": "failed"}
"""The root run's state by its stop reason; any other stop reason reads ``stopped``."""
_ESCAPED: Final = re.compile('[\x00-\x1f"\\\\<>&]')
"""An ASCII character the page's data escapes (it takes more than its one byte there)."""
_SURROGATE: Final = re.compile("[\ud800-\udfff]")
"""A lone surrogate (JSON can carry one escaped; UTF-8 cannot carry it at all)."""


@dataclass(slots=True)
class _Budget:
    """What is left to keep of all runs together; strings are counted in the bytes the page embeds."""

    text: int = MAX_KEPT_TEXT_BYTES
    labels: int = MAX_KEPT_LABEL_BYTES
    marks: int = MAX_KEPT_MARKS

    def take(self, *labels: str | None) -> bool:
        """Keep ``labels`` whole if what is left holds them all (they are counted), else keep none."""
        cost = sum(_embedded_bytes(label) for label in labels if label is not None)
        if cost > self.labels:
            return False
        self.labels -= cost
        return True

    def swap(self, old: str | None, new: str | None) -> str | None:
        """``new`` kept in place of ``old`` (whose bytes come back first), cut to what is left."""
        if new == old:
            return new
        if old is not None:
            self.labels += _embedded_bytes(old)
        if new is None:
            return None
        new, cost = _fit(new, self.labels)
        self.labels -= cost
        return new


@dataclass(slots=True)
class _Text:
    """A text kept up to :data:`MAX_TEXT_CHARS` (and what is left of the budget), with its length."""

    budget: _Budget
    kept: str = ""
    total: int = 0
    kept_bytes: int = 0

    def append(self, text: str) -> None:
        self.total += len(text)
        room = MAX_TEXT_CHARS - len(self.kept)
        if room <= 0 or not text or self.budget.text <= 0:
            return
        taken, cost = _fit(text[:room], self.budget.text)
        self.kept += taken
        self.kept_bytes += cost
        self.budget.text -= cost

    def replace(self, text: str) -> None:
        self.budget.text += self.kept_bytes
        self.kept, self.total, self.kept_bytes = "", 0, 0
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
    limit: dict[str, Any] | None = None
    """The cap (or timeout) that stopped it, as :mod:`subagent._budget_codec` writes it, checked."""
    caps: dict[str, float] | None = None
    """The caps of its budget, by name."""
    spent: dict[str, Any] | None = None
    """What it spent against them."""
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
        label, status = _label(label), None if status is None else _label(status)
        if len(self.marks) >= MAX_MARKS or self.budget.marks <= 0 or not self.budget.take(label, status):
            self.marks_dropped += 1
            return None
        self.budget.marks -= 1
        self.marks.append([kind, when, when if not lasts else None, label, status])
        return len(self.marks) - 1

    def set_status(self, index: int, status: str | None) -> None:
        """The status of mark ``index`` is ``status`` now."""
        mark = self.marks[index]
        mark[4] = self.budget.swap(mark[4], None if status is None else _label(status))

    def relabel(self, *, title: str | None = None, provider: str | None = None) -> None:
        """A new title or provider's name (each given one kept, cut to the budget)."""
        if title is not None:
            self.title = self.budget.swap(self.title, _label(title)) or ""
        if provider is not None:
            self.provider = self.budget.swap(self.provider, _label(provider))


def _label(text: str) -> str:
    return one_line(text, _MAX_LABEL_CHARS)


def _id(value: object) -> str | None:
    """A run's or a tool call's id, cut short (ids are compared cut, so one cut alike is the same)."""
    return cut(value, _MAX_LABEL_CHARS) if isinstance(value, str) else None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _count(value: object) -> int | None:
    """A whole number from 0 to 2**53 that is no bool, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT:
        return value
    return None


def _number(value: object, limit: float = _MAX_SECONDS) -> float | None:
    """A number (no bool) within ``limit`` of 0, as a float (so finite, and never an int too large for
    one), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and -limit <= value <= limit:
        return float(value)
    return None


def _usage(value: object) -> dict[str, Any] | None:
    """What the page shows of a usage object: ACP's known counts and a cost with a finite amount and a
    short currency; whatever else an agent put there is left out. None when nothing is left."""
    if not isinstance(value, Mapping):
        return None
    usage: dict[str, Any] = {
        key: count for key, _ in COUNT_FIELDS if (count := _count(value.get(key))) is not None
    }
    cost = value.get("cost")
    if isinstance(cost, Mapping):
        amount, currency = _number(cost.get("amount"), sys.float_info.max), _text(cost.get("currency"))
        if amount is not None and currency is not None:
            usage["cost"] = {"amount": amount, "currency": cut(currency, _MAX_CURRENCY_CHARS)}
    return usage or None


def _limit(value: object, budget: _Budget) -> dict[str, Any] | None:
    """What the page shows of a run's ``limit``: a known cap's name, its value and the spent (numbers),
    whose budget (an id, when the labels' budget holds it) and the need; None when it is not one."""
    if not isinstance(value, Mapping):
        return None
    name = value.get("limit")
    allowed = _number(value.get("allowed"), sys.float_info.max)
    spent = _number(value.get("spent"), sys.float_info.max)
    if name not in _LIMITS or allowed is None or spent is None:
        return None
    owner = _id(value.get("owner"))
    if owner is not None and not budget.take(owner):
        owner = None
    return {
        "limit": name,
        "allowed": allowed,
        "spent": spent,
        "owner": owner,
        "needed": _number(value.get("needed"), sys.float_info.max),
    }


def _caps(value: object) -> dict[str, float] | None:
    """A budget's caps that are numbers >= 0, by their known names; None when none is."""
    if not isinstance(value, Mapping):
        return None
    caps: dict[str, float] = {
        name: cap
        for name in BUDGET_FIELDS
        if (cap := _number(value.get(name), sys.float_info.max)) is not None and cap >= 0
    }
    return caps or None


def _spent(value: object) -> dict[str, Any] | None:
    """What a run spent: its known counts and amounts, and a short currency; None when nothing is."""
    if not isinstance(value, Mapping):
        return None
    spent: dict[str, Any] = {
        key: count for key in _SPENT_COUNTS if (count := _count(value.get(key))) is not None
    }
    for key in _SPENT_AMOUNTS:
        amount = _number(value.get(key), sys.float_info.max)
        if amount is not None and amount >= 0:
            spent[key] = amount
    currency = _text(value.get("costCurrency"))
    if currency:
        spent["costCurrency"] = cut(currency, _MAX_CURRENCY_CHARS)
    return spent or None


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
        self._root = _Run("run", None, self._budget)
        self._budget.take(self._root.id)
        self._root.relabel(title="subagent run", provider="acp")
        self._runs[self._root.id] = self._root
        self._pending_prompts: dict[str, list[str]] = {}
        self._pending_count = 0
        self._run_update: tuple[str | None, Mapping[str, Any]] | None = None
        self._first: float | None = None
        self._last: float | None = None
        self.runs_dropped = 0
        """Runs that ended but were not kept, :data:`MAX_RUNS` (or the labels' budget) being spent."""
        self.events = 0
        """Events read."""

    def add(self, event: Mapping[str, Any]) -> None:
        """Take one event (a parsed ``--events`` line); members of the wrong type are ignored."""
        self.events += 1
        when = _number(event.get("time"))
        if when is None:
            when = self._last if self._last is not None else 0.0
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
            program = _text(command[0]) if isinstance(command, list) and command else None
            if program is not None:
                # The program's name only, until the agent names itself: an argument may be a secret.
                root.relabel(title=program.rsplit("/", 1)[-1])
        elif kind == "start":
            self._started(event)
        elif kind == "prompt":
            text = _text(event.get("text"))
            if text is not None:
                root.prompt.replace(text)
                total = _count(event.get("chars"))
                if total is not None and total > root.prompt.total:
                    root.prompt.total = total
        elif kind == "update":
            update = event.get("update")
            if isinstance(update, Mapping):
                self._update(update, when, self._session_run(event.get("sessionId")))
        elif kind == "run":
            self._run(event, when)
        elif kind == "permission_request":
            self._permission_asked(event, when)
        elif kind == "permission":
            self._permission_decided(event, when)
        elif kind == "interrupt":
            label = f"{_text(event.get('signal')) or 'a signal'}: {_text(event.get('action')) or '?'}"
            root.mark("interrupt", when, label, lasts=False)
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
            root.usage = _usage(event.get("usage"))
            self._budgeted(root, event)
            # A turn cut short (refusal, max_tokens, timeout...) is no failure of the agent: its own colour.
            state = _ROOT_STATES.get(stop or "", "stopped")
            self._ended(root, when, state, stop)
        elif kind == "log":
            level = _text(event.get("level"))
            if level in ("warning", "error", "critical"):
                root.mark("log", when, _text(event.get("message")) or "", level, lasts=False)

    def _started(self, event: Mapping[str, Any]) -> None:
        run_id = _id(event.get("runId"))
        root = self._root
        if (
            run_id is not None
            and run_id != root.id
            and run_id not in self._runs
            and self._budget.take(run_id)
        ):
            self._budget.swap(root.id, None)
            del self._runs[root.id]
            self._pending_prompts.pop(root.id, None)
            root.id = run_id
            self._runs[run_id] = root
        agent = event.get("agent")
        name = _text(agent.get("name")) if isinstance(agent, Mapping) else None
        if name is not None:
            version = _text(agent.get("version")) if isinstance(agent, Mapping) else None
            root.relabel(title=name + (f" {version}" if version else ""))

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
                root.set_status(index, _text(turn.get("stopReason")))

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
        delay = _number(retry.get("delay"))
        if delay is not None:
            label += f", next in {delay:.2f} s"
        self._root.text_mark = None  # the retried call's answer text is a mark of its own
        self._root.mark("retry", when, label, lasts=False)

    def _owner(self, tool_call_id: str) -> _Run:
        """The run a tool call belongs to: ``OWNER/ID`` is the run ``OWNER``'s, anything else the root's."""
        owner, slash, _ = tool_call_id.partition("/")
        return self._runs.get(_id(owner) or "", self._root) if slash else self._root

    def _session_run(self, session_id: object) -> _Run | None:
        """The run of the tree whose session sent an update: a subagent session the agent announced is
        its run (same id); None for the agent's own session."""
        run_id = _id(session_id)
        return None if run_id is None or run_id == self._root.id else self._runs.get(run_id)

    def _update(self, update: Mapping[str, Any], when: float, session_run: _Run | None = None) -> None:
        kind = update.get("sessionUpdate")
        root = self._root
        if session_run is not None:
            # A subagent session's own traffic: its tool calls are its run's (its text reaches the page
            # as its run's output, at its end); nothing of it is the agent's own answer.
            raw_id = _text(update.get("toolCallId"))
            if kind in ("tool_call", "tool_call_update") and raw_id is not None:
                self._tool_call(update, kind, raw_id, when, session_run)
            return
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
        raw_id = _text(update.get("toolCallId"))
        if raw_id is None:
            return
        if raw_id.startswith("run/"):
            self._run_update = (_id(raw_id[4:]), update)  # read with the `run` event that follows
            return
        root.text_mark = None
        self._tool_call(update, kind, raw_id, when, self._owner(raw_id))

    def _tool_call(self, update: Mapping[str, Any], kind: str, raw_id: str, when: float, owner: _Run) -> None:
        """The tool call ``raw_id`` of ``owner`` (new, or a change of it): its mark, and the prompt it
        delegates."""
        call_id = _id(raw_id) or ""
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
            owner.set_status(index, status)
        if status in ("completed", "failed"):
            mark[2] = when
            del owner.open_marks[key]
            if status == "failed":
                owner.mark("error", when, f"tool call failed: {mark[3]}", lasts=False)

    def _run(self, event: Mapping[str, Any], when: float) -> None:
        run_id = _id(event.get("runId"))
        if run_id is None:
            return
        run = self._runs.get(run_id)
        state = _text(event.get("state"))
        if run is None:
            parent = _id(event.get("parentId"))
            if len(self._runs) >= MAX_RUNS or not self._budget.take(run_id, parent):
                # Counted at their end, which comes once (a run sends many `running` events).
                self.runs_dropped += state in _ENDED_STATES
                return
            run = _Run(run_id, parent, self._budget, start=when)
            self._runs[run_id] = run
            pending = self._pending_prompts.get(parent or self._root.id)
            if pending:
                run.prompt.replace(pending.pop(_matching_prompt(pending, _text(event.get("title")))))
                self._pending_count -= 1
        run.relabel(
            title=_text(event.get("title")) or (None if run.title else run_id),
            provider=_text(event.get("provider")),
        )
        update, self._run_update = self._run_update, None
        if state in _ENDED_STATES and run.end is None:
            if update is not None and update[0] == run_id:
                self._run_result(run, update[1], failed=state == "failed")
            self._ended(run, when, state, _text(event.get("stopReason")))

    def _run_result(self, run: _Run, update: Mapping[str, Any], *, failed: bool) -> None:
        """What a run's last update says: its last message's excerpt (or its error), usage, elapsed."""
        text = _content_text(update.get("content"))
        (run.error if failed else run.output).replace(text)
        meta = update.get("_meta")
        details = meta.get(RUN_META_KEY) if isinstance(meta, Mapping) else None
        if not isinstance(details, Mapping):
            return
        run.usage = _usage(details.get("usage")) or run.usage
        run.elapsed = _number(details.get("elapsedSeconds"))
        self._budgeted(run, details)

    def _budgeted(self, run: _Run, source: Mapping[str, Any]) -> None:
        """A run's budget, what it spent, and the cap that stopped it, where its end says them."""
        run.caps = _caps(source.get("budget")) or run.caps
        run.spent = _spent(source.get("spent")) or run.spent
        run.limit = _limit(source.get("limit"), self._budget) or run.limit

    def _ended(self, run: _Run, when: float, state: str, stop_reason: str | None) -> None:
        run.state = state
        run.stop_reason = self._budget.swap(
            run.stop_reason, None if stop_reason is None else _label(stop_reason)
        )
        run.end = when
        run.text_mark = None
        for index in run.open_marks.values():
            run.marks[index][2] = when
        run.open_marks.clear()

    def _permission_asked(self, event: Mapping[str, Any], when: float) -> None:
        raw_id = _text(event.get("toolCallId")) or ""
        owner = self._owner(raw_id)
        owner.text_mark = None
        call_id = _id(raw_id) or ""
        title = _text(event.get("title")) or call_id
        index = owner.mark("permission", when, f"permission asked: {title}", "waiting", lasts=True)
        if index is not None:
            owner.open_marks[f"permission:{call_id}"] = index

    def _permission_decided(self, event: Mapping[str, Any], when: float) -> None:
        raw_id = _text(event.get("toolCallId")) or ""
        owner = self._owner(raw_id)
        call_id = _id(raw_id) or ""
        option = event.get("option")
        answer = _text(option.get("kind")) if isinstance(option, Mapping) else None
        answer = answer or _text(event.get("outcome")) or "answered"
        reason = _text(event.get("reason"))
        index = owner.open_marks.pop(f"permission:{call_id}", None)
        if index is None:
            title = _text(event.get("title")) or call_id
            index = owner.mark("permission", when, f"permission: {title}", lasts=False)
        if index is not None:
            owner.marks[index][2] = when
            owner.set_status(index, answer + (f" ({reason})" if reason else ""))

    def data(self) -> dict[str, Any]:
        """What the page embeds: the runs in tree order, times in seconds from the first event."""
        origin = self._first or 0.0
        finish = self._last or origin

        def at(value: float | None) -> float | None:
            return None if value is None else round(value - origin, 3)

        return _data(
            [_row(run, depth, at) for run, depth in self._tree_order()],
            duration=round(finish - origin, 3),
            origin=origin,
            runs_dropped=self.runs_dropped,
            events=self.events,
        )

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
        """The trace page: one HTML document, everything inline (``title`` cut to 200 characters)."""
        return _page(self.data(), title)


def _row(run: _Run, depth: int, at: Callable[[float | None], float | None]) -> dict[str, Any]:
    """One run as the page embeds it."""
    return {
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
        "limit": run.limit,
        "budget": run.caps,
        "spent": run.spent,
        "marks": [[kind, at(start), at(end), label, status] for kind, start, end, label, status in run.marks],
        "marksDropped": run.marks_dropped,
    }


def _data(
    rows: list[dict[str, Any]], *, duration: float, origin: float, runs_dropped: int, events: int
) -> dict[str, Any]:
    """The page's whole data."""
    return {
        "duration": duration,
        "origin": origin,
        "runs": rows,
        "runsDropped": runs_dropped,
        "events": events,
    }


def render_trace_page(events: Iterable[Mapping[str, Any]], title: str = "subagent trace") -> str:
    """The trace page of a whole recorded event stream (see :class:`TraceBuilder`)."""
    builder = TraceBuilder()
    for event in events:
        builder.add(event)
    return builder.page(title)


def _script_json(data: object) -> str:
    """``data`` as JSON that cannot end the ``<script>`` element it sits in, nor open a comment in it,
    and that UTF-8 can carry (a lone surrogate is escaped). Every number in it is finite."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return _SURROGATE.sub(
        lambda found: f"\\u{ord(found.group()):04x}",
        text.replace("&", "\\u0026")
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029"),
    )


def _embedded_bytes(text: str) -> int:
    """The bytes ``text`` takes in the page's data (:func:`_script_json`), its quotes left out."""
    if text.isascii() and _ESCAPED.search(text) is None:
        return len(text)  # the common case, found without encoding it
    return len(_script_json(text).encode()) - 2


def _fit(text: str, room: int) -> tuple[str, int]:
    """The longest start of ``text`` that takes at most ``room`` bytes in the page's data, and its bytes."""
    cost = _embedded_bytes(text)
    if cost <= room:
        return text, cost
    # Each character takes 1 to 6 bytes: the answer has from room // 6 to room characters.
    fits, too_long = room // _MAX_CHAR_BYTES, min(len(text), room + 1)
    while too_long - fits > 1:
        middle = (fits + too_long) // 2
        if _embedded_bytes(text[:middle]) <= room:
            fits = middle
        else:
            too_long = middle
    return text[:fits], _embedded_bytes(text[:fits])


def _html_text(text: str) -> str:
    text = _SURROGATE.sub("\ufffd", text)
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


@functools.cache
def _asset(name: str) -> str:
    """A file of the page (its style, its script), read once from this package's data files."""
    return importlib.resources.files("subagent.observability").joinpath(name).read_text(encoding="utf-8")


def _page(data: Mapping[str, Any], title: str) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_html_text(one_line(title, _MAX_TITLE_CHARS))}</title>\n"
        f"<style>\n{_asset('trace_page.css')}</style>\n</head>\n<body>\n{_BODY}\n"
        f'<script type="application/json" id="trace-data">{_script_json(data)}</script>\n'
        f"<script>\n{_asset('trace_page.js')}</script>\n</body>\n</html>\n"
    )


def _widest_page_bytes() -> int:
    """The most bytes a page takes: its frame with the widest title, each run and mark the caps allow
    with every number at its widest and every string empty, and the budgets the strings draw on."""
    widest = _WIDEST_FLOAT
    run = _Run("", None, _Budget(), state="cancelled", start=widest, end=widest, elapsed=widest)
    run.prompt.total = run.output.total = run.marks_dropped = _MAX_COUNT
    run.usage = {key: _MAX_COUNT for key, _ in COUNT_FIELDS}
    run.usage["cost"] = {"amount": widest, "currency": "<" * _MAX_CURRENCY_CHARS}
    # The longest cap's name; the owner's id is drawn from the labels' budget, as every other id.
    run.limit = {"limit": "max_tool_calls", "allowed": widest, "spent": widest, "owner": "", "needed": widest}
    run.caps = dict.fromkeys(BUDGET_FIELDS, widest)
    run.spent = {
        **dict.fromkeys(_SPENT_COUNTS, _MAX_COUNT),
        **dict.fromkeys(_SPENT_AMOUNTS, widest),
        "costCurrency": "<" * _MAX_CURRENCY_CHARS,
    }
    row = len(_script_json(_row(run, MAX_RUNS, lambda value: value)).encode()) + 1  # and a comma
    mark = len(_script_json(["permission", widest, widest, "", None]).encode()) + 1
    frame = _page(
        _data([], duration=widest, origin=widest, runs_dropped=_MAX_COUNT, events=_MAX_COUNT),
        '"' * _MAX_TITLE_CHARS,
    )
    return (
        len(frame.encode())
        + MAX_RUNS * row
        + MAX_KEPT_MARKS * mark
        + MAX_KEPT_TEXT_BYTES
        + MAX_KEPT_LABEL_BYTES
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

MAX_PAGE_BYTES: Final = _widest_page_bytes()
"""The most bytes a trace page takes, whatever its event stream: derived from the caps above (the
module docstring says how); computed here, below the page's frame it measures."""
