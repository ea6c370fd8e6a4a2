"""What the command line shows while a turn runs, and how it asks for permission.

Two views of a run, both on stderr:

* :class:`HumanView`: live progress for a person. The answer as it streams, one line per tool
  call each time its status changes, the plan whenever it changes, thoughts dimmed, every
  permission decision, and a note on interrupts. Plain text, with ANSI colour only when the
  stream is a terminal and ``NO_COLOR`` is unset. Text from the agent is stripped of control
  characters, so an agent cannot drive the terminal. With ``progress=False`` it shows only what
  needs a person: permission prompts and interrupt notes.
* :class:`EventView`: one JSON object per line (``--events``), each with an ``"event"`` member:
  ``spawn``, ``start``, ``update`` (the ACP ``session/update`` params: ``sessionId`` and the update,
  camelCase as on the wire), ``permission_request``, ``permission``, ``interrupt``,
  ``start_failed``, ``end`` and ``log``.

Permission policies for the command line (both report every decision to the view):

* :class:`ReportingPolicy` wraps ``allow``/``deny`` (and the demo's automatic answer);
* :class:`AskPolicy` shows the question and reads the choice from an :class:`AnswerSource`
  (stdin or ``/dev/tty``) in a worker thread, bounded by a timeout; end of input, an invalid
  choice, no terminal and the timeout all reject. Questions are asked one at a time.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import shlex
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, TextIO

import anyio
import anyio.to_thread

from subagent.acp import schema
from subagent.acp.handlers import (
    DenyPolicy,
    PermissionDecision,
    PermissionOption,
    PermissionOutcome,
    PermissionPolicy,
    PermissionQuestion,
)
from subagent.types import SubagentResult, Usage, thaw_json

__all__ = [
    "MAX_TRACKED_TOOL_CALLS",
    "AnswerSource",
    "AskPolicy",
    "Console",
    "EventView",
    "HumanView",
    "ReportingPolicy",
    "RunView",
    "StartInfo",
    "ToolCallState",
    "ToolCalls",
    "choose",
    "is_terminal",
    "sanitize",
    "usage_json",
    "use_color",
]

_CONTROL: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_RAW_INPUT_CHARS: Final = 400
MAX_TRACKED_TOOL_CALLS: Final = 1000
"""Tool calls the command line remembers (by id, the most recently announced): enough to name
the call of any permission question, a bounded cost however many an agent announces."""
_POLL_SECONDS: Final = 0.1


def sanitize(text: str) -> str:
    """``text`` without control characters (newlines and tabs kept; ``\\r\\n`` becomes ``\\n``)."""
    return _CONTROL.sub("", text.replace("\r\n", "\n"))


def is_terminal(stream: TextIO | None) -> bool:
    """Whether ``stream`` is a terminal (False for None or a closed stream)."""
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def use_color(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """Whether to colour ``stream``: a terminal, ``NO_COLOR`` unset or empty, and ``TERM`` not dumb."""
    env = os.environ if environ is None else environ
    if env.get("NO_COLOR") or env.get("TERM") == "dumb":
        return False
    return is_terminal(stream)


def usage_json(usage: Usage | None) -> dict[str, Any] | None:
    """A :class:`~subagent.types.Usage` as ACP's camelCase object (with ``usage_update``'s context
    window and cost), what is known only."""
    if usage is None:
        return None
    fields: dict[str, Any] = {
        "inputTokens": usage.input_tokens,
        "outputTokens": usage.output_tokens,
        "totalTokens": usage.total_tokens,
        "thoughtTokens": usage.thought_tokens,
        "cachedReadTokens": usage.cached_read_tokens,
        "cachedWriteTokens": usage.cached_write_tokens,
        "contextUsed": usage.context_used,
        "contextSize": usage.context_size,
    }
    if usage.cost is not None:
        fields["cost"] = {"amount": usage.cost, "currency": usage.cost_currency}
    return {key: value for key, value in fields.items() if value is not None}


# -- tool calls ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ToolCallState:
    """What is known of one tool call, merged from its ``tool_call`` and ``tool_call_update``s."""

    tool_call_id: str
    title: str | None = None
    kind: str | None = None
    status: str = "pending"
    raw_input: Any = None


class ToolCalls:
    """The turn's tool calls by id, for progress lines and for naming a permission question: the
    ``limit`` most recently announced (older ones are forgotten; an update for one of them is
    then taken as a new announcement)."""

    def __init__(self, limit: int = MAX_TRACKED_TOOL_CALLS) -> None:
        # The connection serves a permission question only after the updates sent before it, so the
        # question's tool call is already here when the question is shown.
        self._calls: dict[str, ToolCallState] = {}
        self.limit = limit

    def get(self, tool_call_id: str) -> ToolCallState | None:
        """The state of a tool call seen so far, or None."""
        return self._calls.get(tool_call_id)

    def observe(self, update: schema.SessionUpdate) -> ToolCallState | None:
        """Merge ``update``; return the call's state when it is new or its status changed, else None."""
        if isinstance(update, schema.ToolCall):
            state = ToolCallState(
                tool_call_id=update.tool_call_id,
                title=update.title,
                kind=update.kind,
                status=update.status or "pending",
                raw_input=update.raw_input,
            )
            self._announced(state)
            return state
        if isinstance(update, schema.ToolCallProgress):
            known = self._calls.get(update.tool_call_id)
            if known is None:
                # An update for a call we never saw announced: treat it as the announcement.
                state = ToolCallState(tool_call_id=update.tool_call_id, status=update.status or "pending")
                self._announced(state)
                changed = True
            else:
                state = known
                changed = update.status is not None and update.status != state.status
            if update.title is not None:
                state.title = update.title
            if update.kind is not None:
                state.kind = update.kind
            if update.status is not None:
                state.status = update.status
            if update.raw_input is not None:
                state.raw_input = update.raw_input
            return state if changed else None
        return None

    def __len__(self) -> int:
        return len(self._calls)

    def _announced(self, state: ToolCallState) -> None:
        calls = self._calls
        calls.pop(state.tool_call_id, None)  # re-announced: now the most recent
        calls[state.tool_call_id] = state
        while len(calls) > self.limit:
            del calls[next(iter(calls))]  # the oldest announcement (dicts keep insertion order)

    def describe(self, question: PermissionQuestion) -> ToolCallState:
        """The question's tool call: what the question says, completed from what the turn showed."""
        seen = self._calls.get(question.tool_call_id)
        return ToolCallState(
            tool_call_id=question.tool_call_id,
            title=question.title or (seen.title if seen else None),
            kind=question.kind or (seen.kind if seen else None),
            status=seen.status if seen else "pending",
            raw_input=thaw_json(question.raw_input)
            if question.raw_input is not None
            else (seen.raw_input if seen else None),
        )


def _call_name(call: ToolCallState) -> str:
    return call.title or call.tool_call_id


def _decision_word(decision: PermissionDecision) -> str:
    if decision is PermissionOutcome.CANCELLED:
        return "cancelled"
    return {
        "allow_once": "allowed",
        "allow_always": "allowed always",
        "reject_once": "rejected",
        "reject_always": "rejected always",
    }.get(decision.kind, f"answered {decision.name!r}")


# -- views -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartInfo:
    """What is known once the agent is ready."""

    run_id: str
    session_id: str | None
    command: Sequence[str]
    cwd: str
    agent_name: str | None
    agent_version: str | None
    protocol_version: int | None


class RunView:
    """What a run reports as it goes; this base class shows nothing."""

    def spawning(self, command: Sequence[str], cwd: str) -> None:
        """The agent command is about to start."""

    def started(self, info: StartInfo) -> None:
        """The agent answered initialize and session/new."""

    def update(self, update: schema.SessionUpdate, changed_call: ToolCallState | None) -> None:
        """A session update arrived; ``changed_call`` is set when a tool call is new or changed status."""

    def question(self, question: PermissionQuestion, call: ToolCallState, timeout: float) -> None:
        """A permission question waits for a person (``--permission ask``)."""

    def answered(self, *, echoed: bool) -> None:
        """The person's answer was read; ``echoed`` when the terminal echoed it (and its newline)."""

    def decided(
        self, question: PermissionQuestion, call: ToolCallState, decision: PermissionDecision, reason: str
    ) -> None:
        """A permission question was answered (``reason`` says by what)."""

    def interrupted(self, signal_name: str, count: int, action: str) -> None:
        """A signal arrived; ``action`` is ``"cancel"`` (the turn) or ``"stop"`` (the agent, at once)."""

    def start_failed(self, message: str) -> None:
        """The agent never became ready."""

    def ended(self, result: SubagentResult, elapsed: float) -> None:
        """The turn ended."""

    def log(self, record: logging.LogRecord, message: str) -> None:
        """A log record (``message`` is formatted) for the user."""


class Console:
    """A text stream (stderr) that knows whether its cursor is at the start of a line.

    Writes are flushed at once, serialized by a lock (logging may write from worker threads), and
    never raise: a closed stderr silences the console instead of failing the run.
    """

    def __init__(self, stream: TextIO, *, color: bool) -> None:
        self.stream = stream
        self.color = color
        self.at_line_start = True
        self._lock = threading.Lock()
        self._broken = False

    def paint(self, text: str, *codes: str) -> str:
        """``text`` in the given SGR codes (``"2"`` dim, ``"1"`` bold, ``"32"`` green...) when colouring."""
        if not self.color or not codes or not text:
            return text
        return f"\x1b[{';'.join(codes)}m{text}\x1b[0m"

    def write(self, text: str) -> None:
        """Write ``text`` as is (it may end mid-line)."""
        if not text:
            return
        with self._lock:
            self._emit(text)

    def line(self, text: str) -> None:
        """Write ``text`` as whole lines, starting a new line first if the cursor is mid-line."""
        with self._lock:
            self._emit(("" if self.at_line_start else "\n") + text + "\n")

    def finish_line(self) -> None:
        """End the current line if the cursor is mid-line."""
        with self._lock:
            if not self.at_line_start:
                self._emit("\n")

    def _emit(self, text: str) -> None:
        if self._broken:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self._broken = True
            return
        self.at_line_start = text.endswith("\n")


_STATUS_COLOR: Final = {"pending": "33", "in_progress": "33", "completed": "32", "failed": "31"}
_PLAN_MARK: Final = {"pending": "[ ]", "in_progress": "[>]", "completed": "[x]"}


class HumanView(RunView):
    """Progress for a person on ``console`` (see the module docstring). ``progress=False`` keeps only
    permission prompts, interrupt notes and, when ``decisions`` is true, permission decisions."""

    def __init__(self, console: Console, *, progress: bool, decisions: bool | None = None) -> None:
        self.console = console
        self.progress = progress
        self.decisions = progress if decisions is None else decisions
        self._streaming: str | None = None  # "message" or "thought" while text is flowing
        self._last_plan: list[tuple[str, str]] | None = None

    def spawning(self, command: Sequence[str], cwd: str) -> None:
        if self.progress:
            self._note(f"starting agent: {_shell_join(command)}")

    def started(self, info: StartInfo) -> None:
        if not self.progress:
            return
        agent = info.agent_name or "the agent"
        if info.agent_version:
            agent += f" {info.agent_version}"
        self._note(f"{agent} is ready (session {info.session_id})")

    def update(self, update: schema.SessionUpdate, changed_call: ToolCallState | None) -> None:
        if not self.progress:
            return
        console = self.console
        if isinstance(update, schema.AgentMessageChunk):
            if self._streaming != "message":
                console.finish_line()
            self._streaming = "message"
            console.write(sanitize(_content_text(update.content)))
        elif isinstance(update, schema.AgentThoughtChunk):
            text = sanitize(_content_text(update.content))
            if self._streaming != "thought":
                console.finish_line()
                console.write(console.paint("  thinking: ", "2"))
            self._streaming = "thought"
            console.write(console.paint(text, "2", "3"))
        elif changed_call is not None:
            self._block()
            kind = f" ({changed_call.kind})" if changed_call.kind else ""
            status = console.paint(changed_call.status, _STATUS_COLOR.get(changed_call.status, "0"))
            console.line(
                f"  {console.paint('tool', '36')} {sanitize(_call_name(changed_call))}{kind}: {status}"
            )
        elif isinstance(update, schema.Plan):
            entries: list[tuple[str, str]] = [(entry.status, entry.content) for entry in update.entries]
            if entries == self._last_plan:
                return
            self._last_plan = entries
            self._block()
            lines = [f"  {console.paint('plan', '36')}:"]
            lines += [
                f"    {_PLAN_MARK.get(status, '[?]')} {sanitize(content)}" for status, content in entries
            ]
            console.line("\n".join(lines))
        elif isinstance(update, schema.UsageUpdate):
            self._block()
            self._note(f"  context: {update.used:,} of {update.size:,} tokens")
        elif isinstance(update, schema.CurrentModeUpdate):
            self._block()
            self._note(f"  mode: {sanitize(update.current_mode_id)}")

    def question(self, question: PermissionQuestion, call: ToolCallState, timeout: float) -> None:
        console = self.console
        self._block()
        kind = f" ({call.kind})" if call.kind else ""
        lines = [console.paint(f"permission requested: {sanitize(_call_name(call))}{kind}", "1", "35")]
        if call.raw_input is not None:
            lines.append(f"  input: {sanitize(_short_json(call.raw_input))}")
        for number, option in enumerate(question.options, 1):
            lines.append(f"  {number}) {sanitize(option.name)}  [{sanitize(option.kind)}]")
        console.line("\n".join(lines))
        console.write(
            f"choose 1-{len(question.options)}, y or n (anything else rejects; "
            f"rejected after {timeout:g} s): "
        )

    def answered(self, *, echoed: bool) -> None:
        if echoed:
            self.console.at_line_start = True  # the terminal echoed the newline typed after the answer
        else:
            self.console.finish_line()

    def decided(
        self, question: PermissionQuestion, call: ToolCallState, decision: PermissionDecision, reason: str
    ) -> None:
        if not self.decisions:
            return
        console = self.console
        self._block()
        word = _decision_word(decision)
        color = "32" if word.startswith("allowed") else "31" if word.startswith("rejected") else "33"
        console.line(
            f"  {console.paint('permission', '35')}: {sanitize(_call_name(call))} -> "
            f"{console.paint(word, color)} ({reason})"
        )

    def interrupted(self, signal_name: str, count: int, action: str) -> None:
        self._block()
        if action == "cancel":
            text = "interrupted: cancelling the turn (press Ctrl-C again to stop the agent at once)"
        else:
            text = f"{signal_name}: stopping the agent now"
        self.console.line(self.console.paint(f"subagent: {text}", "33"))

    def ended(self, result: SubagentResult, elapsed: float) -> None:
        if not self.progress:
            return
        self._block()
        color = "32" if result.ok else "31"
        self.console.line(self.console.paint(f"done: {result.stop_reason} in {elapsed:.1f} s", color))

    def log(self, record: logging.LogRecord, message: str) -> None:
        self._block()
        color = (
            "31" if record.levelno >= logging.ERROR else "33" if record.levelno >= logging.WARNING else "2"
        )
        self.console.line(self.console.paint(f"subagent: {record.levelname.lower()}: {message}", color))

    def _block(self) -> None:
        """Something other than streamed text follows: end the streamed line."""
        self._streaming = None
        self.console.finish_line()

    def _note(self, text: str) -> None:
        self._streaming = None
        self.console.line(self.console.paint(text, "2"))


class EventView(RunView):
    """One JSON object per line on ``stream`` (``--events``); see the module docstring."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._lock = threading.Lock()
        self._session_id: str | None = None
        self._broken = False

    def emit(self, event: str, **fields: Any) -> None:
        """Write one event line (``fields`` are already JSON-ready and camelCase)."""
        line = json.dumps({"event": event, **fields}, ensure_ascii=False) + "\n"
        with self._lock:
            if self._broken:
                return
            try:
                self.stream.write(line)
                self.stream.flush()
            except (OSError, ValueError):
                self._broken = True

    def spawning(self, command: Sequence[str], cwd: str) -> None:
        self.emit("spawn", command=list(command), cwd=cwd)

    def started(self, info: StartInfo) -> None:
        self._session_id = info.session_id
        agent = None if info.agent_name is None else {"name": info.agent_name, "version": info.agent_version}
        self.emit(
            "start",
            runId=info.run_id,
            sessionId=info.session_id,
            command=list(info.command),
            cwd=info.cwd,
            agent=agent,
            protocolVersion=info.protocol_version,
        )

    def update(self, update: schema.SessionUpdate, changed_call: ToolCallState | None) -> None:
        self.emit("update", sessionId=self._session_id, update=schema.to_builtins(update))

    def question(self, question: PermissionQuestion, call: ToolCallState, timeout: float) -> None:
        self.emit(
            "permission_request",
            toolCallId=question.tool_call_id,
            title=call.title,
            kind=call.kind,
            rawInput=call.raw_input,
            options=[_option_json(option) for option in question.options],
            timeout=timeout,
        )

    def decided(
        self, question: PermissionQuestion, call: ToolCallState, decision: PermissionDecision, reason: str
    ) -> None:
        chosen = None if decision is PermissionOutcome.CANCELLED else _option_json(decision)
        self.emit(
            "permission",
            toolCallId=question.tool_call_id,
            title=call.title,
            outcome="cancelled" if chosen is None else "selected",
            option=chosen,
            reason=reason,
        )

    def interrupted(self, signal_name: str, count: int, action: str) -> None:
        self.emit("interrupt", signal=signal_name, count=count, action=action)

    def start_failed(self, message: str) -> None:
        self.emit("start_failed", error=message)

    def ended(self, result: SubagentResult, elapsed: float) -> None:
        self.emit(
            "end",
            stopReason=result.stop_reason,
            error=result.error,
            usage=usage_json(result.usage),
            elapsed=round(elapsed, 3),
        )

    def log(self, record: logging.LogRecord, message: str) -> None:
        self.emit("log", level=record.levelname.lower(), logger=record.name, message=record.getMessage())


def _option_json(option: PermissionOption) -> dict[str, str]:
    return {"optionId": option.option_id, "name": option.name, "kind": option.kind}


def _content_text(block: schema.ContentBlock) -> str:
    if isinstance(block, schema.TextContent):
        return block.text
    if isinstance(block, schema.ResourceLink):
        return f"[{block.name}: {block.uri}]"
    if isinstance(block, schema.UnknownContentBlock):
        return f"[{block.tag or 'content'}]"
    return f"[{block.__struct_config__.tag}]"


def _short_json(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _RAW_INPUT_CHARS else text[: _RAW_INPUT_CHARS - 3] + "..."


def _shell_join(command: Sequence[str]) -> str:
    return shlex.join(command)


# -- permission ------------------------------------------------------------------------------------------


class ReportingPolicy:
    """Decides with ``inner`` (an allow or deny policy) and reports each decision with ``reason``."""

    def __init__(self, inner: PermissionPolicy, reason: str, view: RunView, tool_calls: ToolCalls) -> None:
        self.inner = inner
        self.reason = reason
        self.view = view
        self.tool_calls = tool_calls

    async def decide(self, question: PermissionQuestion) -> PermissionDecision:
        """Decide with the inner policy and report the decision."""
        decision = await self.inner.decide(question)
        self.view.decided(question, self.tool_calls.describe(question), decision, self.reason)
        return decision


class AnswerSource:
    """Lines typed by a person, read from a file descriptor without ever blocking for long.

    :meth:`read_line` runs in a worker thread and polls every 0.1 s for a stop request, so a
    question that timed out or was cancelled leaves no thread stuck on a read. Bytes read past a
    line are kept for the next question.
    """

    def __init__(self, fd: int, *, name: str, owned: bool = False) -> None:
        self.fd = fd
        self.name = name
        self._owned = owned
        self._buffer = bytearray()
        self._eof = False
        self._lock = threading.Lock()

    @classmethod
    def stdin(cls) -> AnswerSource | None:
        """Standard input, or None when there is none."""
        try:
            os.fstat(0)
        except OSError:
            return None
        return cls(0, name="stdin")

    @classmethod
    def terminal(cls) -> AnswerSource | None:
        """The controlling terminal (``/dev/tty``), or None when this process has none."""
        try:
            fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            return None
        return cls(fd, name="/dev/tty", owned=True)

    def isatty(self) -> bool:
        """Whether a person can type here."""
        try:
            return os.isatty(self.fd)
        except OSError:
            return False

    def read_line(self, stop: threading.Event) -> str | None:
        """The next line without its newline; None at end of input or once ``stop`` is set."""
        with self._lock:
            while True:
                newline = self._buffer.find(b"\n")
                if newline >= 0:
                    line = bytes(self._buffer[:newline])
                    del self._buffer[: newline + 1]
                    return line.decode("utf-8", errors="replace")
                if self._eof:
                    if self._buffer:
                        rest = bytes(self._buffer)
                        self._buffer.clear()
                        return rest.decode("utf-8", errors="replace")
                    return None
                if stop.is_set():
                    return None
                try:
                    readable, _, _ = select.select([self.fd], [], [], _POLL_SECONDS)
                    if not readable:
                        continue
                    chunk = os.read(self.fd, 4096)
                except InterruptedError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    self._buffer += chunk
                else:
                    self._eof = True

    def close(self) -> None:
        """Close the descriptor if this source opened it."""
        if self._owned:
            self._owned = False
            os.close(self.fd)


class AskPolicy:
    """Asks a person: shows the question through ``view`` and reads the choice from ``source``.

    The answer is a number from the list, an option id or name, ``y``/``yes`` (the first allowing
    option) or ``n``/``no`` (the first rejecting one). Anything else, end of input, no source at
    all, and no answer within ``timeout`` seconds all reject. A question withdrawn because the turn
    was cancelled is reported as cancelled. One question is asked at a time.
    """

    def __init__(
        self, view: RunView, tool_calls: ToolCalls, source: AnswerSource | None, *, timeout: float
    ) -> None:
        self.view = view
        self.tool_calls = tool_calls
        self.source = source
        self.timeout = timeout
        self._lock = anyio.Lock()
        self._deny = DenyPolicy()

    async def decide(self, question: PermissionQuestion) -> PermissionDecision:
        """Ask, and return the chosen option (or a rejection)."""
        async with self._lock:
            call = self.tool_calls.describe(question)
            if self.source is None:
                return await self._reject(question, call, "no terminal to ask on")
            self.view.question(question, call, self.timeout)
            stop = threading.Event()
            answer: str | None = None
            try:
                with anyio.move_on_after(self.timeout) as scope:
                    answer = await anyio.to_thread.run_sync(
                        partial(self.source.read_line, stop), abandon_on_cancel=True
                    )
            except anyio.get_cancelled_exc_class():
                self.view.decided(question, call, PermissionOutcome.CANCELLED, "the turn was cancelled")
                raise
            finally:
                stop.set()
            self.view.answered(echoed=answer is not None and self.source.isatty())
            if scope.cancelled_caught:
                return await self._reject(question, call, f"no answer within {self.timeout:g} s")
            if answer is None:
                return await self._reject(question, call, f"end of input on {self.source.name}")
            chosen = choose(question, answer)
            if chosen is None:
                shown = answer.strip()[:40]
                return await self._reject(
                    question, call, f"not a choice: {shown!r}" if shown else "no choice"
                )
            self.view.decided(question, call, chosen, "your choice")
            return chosen

    async def _reject(
        self, question: PermissionQuestion, call: ToolCallState, reason: str
    ) -> PermissionDecision:
        decision = await self._deny.decide(question)
        self.view.decided(question, call, decision, reason)
        return decision


def choose(question: PermissionQuestion, answer: str) -> PermissionOption | None:
    """The option a typed ``answer`` names, or None (see :class:`AskPolicy`)."""
    text = answer.strip()
    if not text:
        return None
    if text.isdigit():
        index = int(text) - 1
        return question.options[index] if 0 <= index < len(question.options) else None
    for option in question.options:
        if text == option.option_id:
            return option
    folded = text.casefold()
    for option in question.options:
        if folded == option.name.casefold():
            return option
    if folded in ("y", "yes"):
        return question.first_option("allow_once", "allow_always")
    if folded in ("n", "no"):
        return question.first_option("reject_once", "reject_always")
    return None
