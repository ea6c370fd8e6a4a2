"""What the command line shows while a turn runs: two views of a run, both on stderr.

* :class:`HumanView`: live progress for a person. The answer as it streams, one line per tool
  call each time its status changes, the plan whenever it changes, thoughts dimmed, every
  permission decision, a note on interrupts, one line per notice from the agent (its severity,
  title and description, shortened) and one per change of a context compaction's status (its
  summary is not shown, and is never part of the answer). Plain text, with ANSI colour only when the
  stream is a terminal and ``NO_COLOR`` is unset. Text from the agent is stripped of control
  characters, so an agent cannot drive the terminal. With ``progress=False`` it shows only what
  needs a person: permission prompts and interrupt notes. A tool call that shows a run of the
  agent's subagent tree (``subagent serve`` marks them, see below) reads ``run <title>: <status>``,
  indented one step per level below the session.

  Live, on a UTF-8 terminal with colour (see :func:`~subagent.cli._console.use_color`), those runs
  are shown instead as a block kept below the rest (:class:`~subagent.cli._run_tree.RunTree`, drawn as the
  console's footer): one row per run, indented by depth, with its state and last activity, redrawn
  at each change and, while :meth:`RunView.tick` runs, each second for the ages. A run that fails
  or is cancelled also gets its ``run`` line above the block. When the turn ends the block gives
  way to one line: ``3 runs: 2 completed, 1 failed``.
* :class:`EventView`: one JSON object per line (``--events``), each with an ``"event"`` member:
  ``spawn``, ``start``, ``update`` (the ACP ``session/update`` params: ``sessionId`` and the update,
  camelCase as on the wire), ``run``, ``permission_request``, ``permission``,
  ``elicitation_request`` (the agent's form: message, title, fields), ``elicitation`` (its action,
  never what was typed), ``interrupt``,
  ``start_failed``, ``end`` (``stopReason``, ``error``, ``usage``, ``elapsed``; for a run with a
  budget also ``outputFinal``, its ``budget``, ``spent`` and the ``limit`` that stopped it, as
  :mod:`subagent._budget_codec` writes them; for an isolated run its ``workspace``, as
  :mod:`subagent._workspace_codec` writes it) and ``log``; and a ``"time"`` member: when it was
  written, in seconds since the epoch (milliseconds kept), so a recorded stream can be laid out in time
  (``subagent trace``).

  ``run`` follows each ``update`` of a tool call that shows one run of the agent's subagent tree
  (its ``_meta["subagent-seam/run"]``, see :data:`~subagent.types.RUN_META_KEY`, which
  ``subagent serve`` sends): ``runId``, ``parentId``, ``provider``, ``state`` (``running``,
  ``completed``, ``failed``, ``cancelled``), ``stopReason``, ``depth`` and the call's ``title``;
  a member the agent did not send (or sent with the wrong type) is null. A ``parentId`` equal to
  the session's id reads as this run's own ``runId`` (the one of the ``start`` event), so the
  ``run`` events form one tree rooted at the command line's run.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TextIO

import anyio

from subagent._budget_codec import budget_to_json, limit_to_json, spend_to_json
from subagent._text import one_line
from subagent._usage_codec import usage_to_acp
from subagent._workspace_codec import workspace_to_json
from subagent.acp import schema
from subagent.acp._elicitation import ElicitationField, ElicitationQuestion
from subagent.acp.handlers import PermissionDecision, PermissionOption, PermissionOutcome, PermissionQuestion
from subagent.cli._console import Console, is_terminal, sanitize
from subagent.cli._run_tree import RunTree
from subagent.cli._runs_command import interrupted_notice, prompt_line
from subagent.cli._tool_call_tracker import ToolCallState
from subagent.journal import RunRecord
from subagent.types import RUN_META_KEY, SubagentResult

__all__ = ["EventView", "HumanView", "RunView", "StartInfo", "run_meta"]

_RAW_INPUT_CHARS: Final = 400
"""How much of a tool call's input a permission question shows (as JSON)."""
_MAX_RUN_INDENT: Final = 20
"""The deepest level of the subagent tree whose lines are indented to it (an agent chooses the depth)."""
_NOTICE_TITLE_CHARS: Final = 120
"""How much of a notice's title its line shows (agent text: a notice is one line, not a page)."""
_NOTICE_DESCRIPTION_CHARS: Final = 240
"""How much of a notice's description its line shows."""
_WORD_CHARS: Final = 40
"""How much of an agent's one-word value (a notice's severity, a compaction's status) is shown."""
TICK_SECONDS: Final = 1.0
"""How often :meth:`HumanView.tick` redraws the live block (its ages are in whole seconds)."""


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
    mode: str | None = None
    """The session's mode once the caller's settings were applied (None: the agent offers none)."""
    config_options: Sequence[Any] = ()
    """The session's config options and their values, as on the wire (camelCase)."""
    journal_id: str | None = None
    """The run's id in the run journal (None: it keeps none)."""


class RunView:
    """What a run reports as it goes; this base class shows nothing."""

    def spawning(self, command: Sequence[str], cwd: str) -> None:
        """The agent command is about to start."""

    def started(self, info: StartInfo) -> None:
        """The agent answered initialize and session/new."""

    def update(self, update: schema.SessionUpdate, changed_call: ToolCallState | None) -> None:
        """A session update arrived; ``changed_call`` is set when a tool call is new or changed status."""

    def subagent_update(self, session_id: str, update: schema.SessionUpdate) -> None:
        """An update of one of the agent's subagent sessions (``session_id``: the run of its tree that it
        is), such as the child's own tool calls."""

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

    def elicitation(self, question: ElicitationQuestion, timeout: float) -> None:
        """The agent asks a person to fill in a form (``--permission ask``); its fields follow."""

    def elicitation_field(self, field: ElicitationField, problem: str | None) -> None:
        """The form asks for ``field`` (again, when the last answer was not valid: ``problem``)."""

    def elicited(self, question: ElicitationQuestion, action: str, reason: str) -> None:
        """The agent's form was answered: ``accept``, ``decline`` or ``cancel`` (``reason`` says by what)."""

    def interrupted_runs(self, runs: Sequence[RunRecord], resume: str) -> None:
        """The run journal, as it was opened, held runs whose process had died: they are now marked
        ``interrupted`` (``resume``: the command that continues one, ``ID`` standing for its id)."""

    def start_failed(self, message: str) -> None:
        """The agent never became ready."""

    def ended(self, result: SubagentResult, elapsed: float) -> None:
        """The turn ended."""

    def log(self, record: logging.LogRecord, message: str) -> None:
        """A log record (``message`` is formatted) for the user."""

    async def tick(self) -> None:
        """Keep what the view shows live current until cancelled (the ages of a live block).

        Whoever drives the run starts it in a task group when the run starts and cancels it
        before calling :meth:`ended`; it never returns on its own while there is something to keep
        current. This base view has nothing live: it returns at once.
        """


_TOOL_CALL_UPDATES: Final = (schema.ToolCall, schema.ToolCallProgress)
_STATUS_COLOR: Final = {"pending": "33", "in_progress": "33", "completed": "32", "failed": "31"}
_PLAN_MARK: Final = {"pending": "[ ]", "in_progress": "[>]", "completed": "[x]"}
_SEVERITY_COLOR: Final = {"info": "36", "warning": "33", "error": "31"}


class HumanView(RunView):
    """Progress for a person on ``console`` (see the module docstring). ``progress=False`` keeps only
    permission prompts, interrupt notes and, when ``decisions`` is true, permission decisions.

    ``live`` shows the runs of the agent's subagent tree as a block redrawn in place; by default
    when there is progress to show and the console colours a terminal that takes UTF-8 (elsewhere
    text would be escaped, and its width unknown). ``clock`` gives the time the block's ages count
    in (``time.monotonic``).
    """

    def __init__(
        self,
        console: Console,
        *,
        progress: bool,
        decisions: bool | None = None,
        live: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console
        self.progress = progress
        self.decisions = progress if decisions is None else decisions
        self.live = progress and (_can_draw(console) if live is None else live)
        self._clock = clock
        self._streaming: str | None = None  # "message" or "thought" while text is flowing
        self._last_plan: list[tuple[str, str]] | None = None
        # The compaction (id, status) shown last: a patch that leaves the status as it was shows nothing.
        self._last_compaction: tuple[str, str] | None = None
        self._runs = RunTree()
        self._held = False  # the block is off while a permission question waits for its answer
        self._over = False  # the turn ended: the block gave way to its summary

    def spawning(self, command: Sequence[str], cwd: str) -> None:
        if self.progress:
            self._note(f"starting agent: {_shell_join(command)}")

    def started(self, info: StartInfo) -> None:
        if not self.progress:
            return
        agent = info.agent_name or "the agent"
        if info.agent_version:
            agent += f" {info.agent_version}"
        mode = f", mode {one_line(sanitize(info.mode), 80)}" if info.mode else ""
        self._note(f"{agent} is ready (session {info.session_id}{mode})")

    def update(self, update: schema.SessionUpdate, changed_call: ToolCallState | None) -> None:
        if not self.progress:
            return
        console = self.console
        if self.live and isinstance(update, _TOOL_CALL_UPDATES):
            run = run_meta(update)
            if run is not None:
                self._observe_run(run, update, changed_call)
                return
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
            run = run_meta(update) if isinstance(update, _TOOL_CALL_UPDATES) else None
            if run is not None:
                self._run_line(run, changed_call)
                return
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
        elif isinstance(update, schema.Notice):
            self._block()
            console.line(self._notice_line(update))
        elif isinstance(update, schema.CompactionUpdate):
            shown = (update.compaction_id, update.status)
            if shown == self._last_compaction:
                return
            self._last_compaction = shown
            self._block()
            text = f"  context compaction: {_agent_text(update.status, _WORD_CHARS)}"
            if update.error:
                text += f" ({_agent_text(update.error, _NOTICE_DESCRIPTION_CHARS)})"
            self._note(text)

    def question(self, question: PermissionQuestion, call: ToolCallState, timeout: float) -> None:
        console = self.console
        if self.live:
            self._held = True
            console.clear_footer()  # the person answers on the prompt's line, nothing drawn below
        self._block()
        kind = f" ({call.kind})" if call.kind else ""
        # A question from one of the agent's own subagents says which: the answer is for that child.
        asker = f" by subagent {_agent_text(question.subagent, 80)}" if question.subagent else ""
        lines = [console.paint(f"permission requested{asker}: {sanitize(_call_name(call))}{kind}", "1", "35")]
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
            self.console.typed_newline()  # the terminal echoed the newline typed after the answer
        else:
            self.console.finish_line()
        self._held = False
        self._redraw()

    def _end_held_prompt(self) -> None:
        """A question's prompt line still waits for an answer that will not come (a timeout, a withdrawn
        question): end it, and redraw what it held back."""
        if self._held:
            self._held = False
            self._block()
            self._redraw()

    def decided(
        self, question: PermissionQuestion, call: ToolCallState, decision: PermissionDecision, reason: str
    ) -> None:
        self._end_held_prompt()
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

    def interrupted_runs(self, runs: Sequence[RunRecord], resume: str) -> None:
        # Shown whatever the progress setting: a run lost silently is what the journal is there to prevent.
        self._block()
        for line in interrupted_notice(runs, resume):
            self.console.line(self.console.paint(line, "33"))

    def interrupted(self, signal_name: str, count: int, action: str) -> None:
        self._block()
        if action == "cancel":
            text = "interrupted: cancelling the turn (press Ctrl-C again to stop the agent at once)"
        else:
            text = f"{signal_name}: stopping the agent now"
        self.console.line(self.console.paint(f"subagent: {text}", "33"))

    def elicitation(self, question: ElicitationQuestion, timeout: float) -> None:
        console = self.console
        if self.live:
            self._held = True
            console.clear_footer()  # the person answers on the prompt's lines, nothing drawn below
        self._block()
        lines = [console.paint(f"input requested: {sanitize(question.message)}", "1", "35")]
        if question.title:
            lines.append(f"  {sanitize(question.title)}")
        lines.append(
            f"  ({len(question.fields)} field(s); Ctrl-D cancels, an empty answer to a required field "
            f"declines; cancelled after {timeout:g} s)"
        )
        console.line("\n".join(lines))

    def elicitation_field(self, field: ElicitationField, problem: str | None) -> None:
        console = self.console
        if self.live:
            self._held = True  # each answer redraws the block: take it away again for the next field
            console.clear_footer()
        if problem is not None:
            console.line(console.paint(f"  not valid: {sanitize(problem)}; try again", "31"))
        lines = [f"  {sanitize(field.label)}{' (required)' if field.required else ''}"]
        if field.description:
            lines.append(f"    {sanitize(field.description)}")
        for number, choice in enumerate(field.choices, 1):
            lines.append(f"    {number}) {sanitize(choice.title)}")
        console.line("\n".join(lines))
        if field.default is not None:
            empty = f", Enter for {sanitize(_field_value(field.default))}"
        else:
            empty = "" if field.required else ", Enter to skip"
        console.write(f"  {_field_hint(field)}{empty}: ")

    def elicited(self, question: ElicitationQuestion, action: str, reason: str) -> None:
        self._end_held_prompt()
        if not self.decisions:
            return
        console = self.console
        self._block()
        word = {"accept": "answered", "decline": "declined", "cancel": "cancelled"}.get(action, action)
        color = "32" if action == "accept" else "31" if action == "decline" else "33"
        message = sanitize(" ".join(question.message.split()))[:80] or "(no message)"
        console.line(
            f"  {console.paint('input', '35')}: {message} -> {console.paint(word, color)} ({reason})"
        )

    def start_failed(self, message: str) -> None:
        self._end_block()

    def ended(self, result: SubagentResult, elapsed: float) -> None:
        if not self.progress:
            return
        self._end_block()
        self._block()
        color = "32" if result.ok else "31"
        self.console.line(self.console.paint(f"done: {result.stop_reason} in {elapsed:.1f} s", color))

    def log(self, record: logging.LogRecord, message: str) -> None:
        self._block()
        color = (
            "31" if record.levelno >= logging.ERROR else "33" if record.levelno >= logging.WARNING else "2"
        )
        self.console.line(self.console.paint(f"subagent: {record.levelname.lower()}: {message}", color))

    async def tick(self) -> None:
        if not self.live:
            return
        while not self._over:
            await anyio.sleep(TICK_SECONDS)
            self._redraw()  # the console writes only if a row changed (an age ticked over)

    def _observe_run(
        self,
        run: Mapping[str, Any],
        update: schema.ToolCall | schema.ToolCallProgress,
        call: ToolCallState | None,
    ) -> None:
        """Live: an update of a run of the agent's subagent tree goes into the block."""
        row = self._runs.observe(run, update, self._clock())
        if row is not None and row.state in ("failed", "cancelled") and call is not None:
            self._block()
            self._run_line(run, call, row.state)  # a failure stays readable once the block is gone
        self._redraw()

    def _redraw(self) -> None:
        if not self.live or self._held or self._over:
            return
        console = self.console
        # At most half the terminal's rows: a block taller than the screen could not be moved over.
        rows = self._runs.frame(self._clock(), console.columns(), console.paint, height=console.height() // 2)
        console.set_footer(rows)

    def _end_block(self) -> None:
        """The turn is over: the block gives way to its one-line summary."""
        if not self.live or self._over:
            return
        self._over = True
        self.console.clear_footer()
        summary = self._runs.summary()
        if summary is not None:
            self._block()
            self.console.line(self.console.paint(summary, "1"))

    def _run_line(self, run: Mapping[str, Any], call: ToolCallState, state: str | None = None) -> None:
        """A run of the agent's subagent tree started or ended: one line, indented by its depth,
        with the call's status (or ``state``)."""
        console = self.console
        depth = run.get("depth")
        indent = "  " * (depth if isinstance(depth, int) and 0 < depth <= _MAX_RUN_INDENT else 1)
        status = state or call.status
        status = console.paint(status, _STATUS_COLOR.get(call.status, "0"))
        console.line(f"{indent}{console.paint('run', '36')} {sanitize(_call_name(call))}: {status}")

    def _notice_line(self, notice: schema.Notice) -> str:
        """``  notice (warning): <title> - <description>``, on one line, the severity coloured."""
        console = self.console
        severity = _agent_text(notice.severity, _WORD_CHARS)
        painted = console.paint(severity, _SEVERITY_COLOR.get(severity, "0"))
        text = f"  {console.paint('notice', '36')} ({painted}): "
        text += _agent_text(notice.title, _NOTICE_TITLE_CHARS)
        if notice.description:
            text += f" - {_agent_text(notice.description, _NOTICE_DESCRIPTION_CHARS)}"
        return text

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
        # Through a console: each line written whole under its lock, and a closed stream silences
        # the events instead of failing the run.
        self.console = Console(stream, color=False)
        self._session_id: str | None = None
        self._run_id: str | None = None

    def emit(self, event: str, **fields: Any) -> None:
        """Write one event line (``fields`` are already JSON-ready and camelCase)."""
        line = {"event": event, "time": round(time.time(), 3), **fields}
        self.console.write(json.dumps(line, ensure_ascii=False) + "\n")

    def spawning(self, command: Sequence[str], cwd: str) -> None:
        self.emit("spawn", command=list(command), cwd=cwd)

    def started(self, info: StartInfo) -> None:
        self._session_id = info.session_id
        self._run_id = info.run_id
        agent = None if info.agent_name is None else {"name": info.agent_name, "version": info.agent_version}
        self.emit(
            "start",
            runId=info.run_id,
            **({} if info.journal_id is None else {"journalId": info.journal_id}),
            sessionId=info.session_id,
            command=list(info.command),
            cwd=info.cwd,
            agent=agent,
            protocolVersion=info.protocol_version,
            mode=info.mode,
            configOptions=list(info.config_options),
        )

    def subagent_update(self, session_id: str, update: schema.SessionUpdate) -> None:
        self.emit("update", sessionId=session_id, update=schema.to_builtins(update))

    def update(self, update: schema.SessionUpdate, changed_call: ToolCallState | None) -> None:
        self.emit("update", sessionId=self._session_id, update=schema.to_builtins(update))
        if not isinstance(update, _TOOL_CALL_UPDATES):
            return
        run = run_meta(update)
        if run is not None:
            parent_id = _text_or_none(run.get("parentId"))
            if parent_id is not None and parent_id == self._session_id:
                parent_id = self._run_id  # the session's own children hang below this run
            depth = run.get("depth")
            self.emit(
                "run",
                runId=run["runId"],
                parentId=parent_id,
                provider=_text_or_none(run.get("provider")),
                state=_text_or_none(run.get("state")),
                stopReason=_text_or_none(run.get("stopReason")),
                depth=depth if isinstance(depth, int) and not isinstance(depth, bool) else None,
                title=update.title,
            )

    def question(self, question: PermissionQuestion, call: ToolCallState, timeout: float) -> None:
        self.emit(
            "permission_request",
            toolCallId=question.tool_call_id,
            **_asker(question),
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
            **_asker(question),
            title=call.title,
            outcome="cancelled" if chosen is None else "selected",
            option=chosen,
            reason=reason,
        )

    def interrupted(self, signal_name: str, count: int, action: str) -> None:
        self.emit("interrupt", signal=signal_name, count=count, action=action)

    def interrupted_runs(self, runs: Sequence[RunRecord], resume: str) -> None:
        self.emit(
            "interrupted_runs",
            runs=[
                {
                    "id": run.id,
                    "provider": run.provider,
                    "parent": run.parent,
                    "prompt": prompt_line(run.prompt, 200),
                }
                for run in runs
            ],
            resume=resume,
        )

    def elicitation(self, question: ElicitationQuestion, timeout: float) -> None:
        self.emit(
            "elicitation_request",
            message=question.message,
            title=question.title,
            fields=[
                {
                    "name": field.name,
                    "type": field.type,
                    "title": field.title,
                    "required": field.required,
                    "choices": [choice.value for choice in field.choices] or None,
                }
                for field in question.fields
            ],
            timeout=timeout,
        )

    def elicited(self, question: ElicitationQuestion, action: str, reason: str) -> None:
        # What a person typed is not repeated here: it was theirs to give the agent, not to a log.
        self.emit("elicitation", action=action, reason=reason)

    def start_failed(self, message: str) -> None:
        self.emit("start_failed", error=message)

    def ended(self, result: SubagentResult, elapsed: float) -> None:
        extra: dict[str, Any] = {}
        if result.budget is not None or result.stop_reason == "budget":
            extra = {
                "outputFinal": result.output_final,
                "limit": limit_to_json(result.limit),
                "budget": budget_to_json(result.budget),
                "spent": spend_to_json(result.spent),
            }
        if result.workspace is not None:
            extra["workspace"] = workspace_to_json(result.workspace)
        self.emit(
            "end",
            stopReason=result.stop_reason,
            error=result.error,
            usage=usage_to_acp(result.usage),
            elapsed=round(elapsed, 3),
            **extra,
        )

    def log(self, record: logging.LogRecord, message: str) -> None:
        self.emit("log", level=record.levelname.lower(), logger=record.name, message=record.getMessage())


def _field_value(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _field_hint(field: ElicitationField) -> str:
    """What a form's prompt for ``field`` asks for."""
    if field.choices:
        return f"choose 1-{len(field.choices)}"
    if field.type == "boolean":
        return "y or n"
    bounds = ""
    if field.minimum is not None or field.maximum is not None:
        low = "" if field.minimum is None else f"{field.minimum:g}"
        high = "" if field.maximum is None else f"{field.maximum:g}"
        bounds = f" {low}..{high}"
    if field.type in ("number", "integer"):
        return f"{'a whole number' if field.type == 'integer' else 'a number'}{bounds}"
    return f"{field.format}" if field.format else "text"


def _can_draw(console: Console) -> bool:
    """Whether ``console`` can show a live block: a colour terminal taking UTF-8."""
    encoding = getattr(console.stream, "encoding", None)
    unicode = isinstance(encoding, str) and encoding.lower().replace("-", "").replace("_", "") == "utf8"
    return console.color and unicode and is_terminal(console.stream)


def run_meta(update: schema.ToolCall | schema.ToolCallProgress) -> Mapping[str, Any] | None:
    """The run a tool call update shows (its ``RUN_META_KEY`` entry, with a string ``runId``), else None."""
    if update.meta is None:
        return None
    run = update.meta.get(RUN_META_KEY)
    if not isinstance(run, Mapping) or not isinstance(run.get("runId"), str):
        return None
    return run


def _asker(question: PermissionQuestion) -> dict[str, str]:
    """The ``subagent`` member of a question's event: the child that asks, when one of the agent's
    subagent sessions does (left out for the session's own questions)."""
    return {"subagent": question.subagent} if question.subagent is not None else {}


def _agent_text(text: str, limit: int) -> str:
    """Agent text for one line of the view: no control characters, on one line, at most ``limit``
    characters."""
    return one_line(sanitize(text), limit)


def _text_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


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
