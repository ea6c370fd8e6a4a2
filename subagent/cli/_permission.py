"""How the command line answers an agent's permission questions.

* :class:`ReportingPolicy` wraps ``allow``/``deny`` (and the demo's automatic answer); it declines
  elicitations (nothing can invent an answer to an agent's form);
* :class:`AskPolicy` shows the question and reads the choice from an :class:`AnswerSource`
  (stdin or ``/dev/tty``) in a worker thread, bounded by a timeout; end of input, an invalid
  choice, no terminal and the timeout all reject. Questions are asked one at a time. It also shows
  an agent's elicitation (a form) and reads each field's value, checked, bounded by the same timeout.

Both report every decision to the run's view. :func:`permission_policy` picks one for a
:data:`PermissionMode`.
"""

from __future__ import annotations

import os
import select
import sys
import threading
from functools import partial
from typing import Final, Literal

import anyio
import anyio.to_thread

from subagent.acp._elicitation import ElicitationAnswer, ElicitationQuestion, FieldValue, parse_value
from subagent.acp.handlers import (
    AllowPolicy,
    DenyPolicy,
    PermissionDecision,
    PermissionOption,
    PermissionOutcome,
    PermissionPolicy,
    PermissionQuestion,
)
from subagent.cli._console import is_terminal
from subagent.cli._tool_call_tracker import ToolCalls, ToolCallState
from subagent.cli._views import RunView

__all__ = [
    "AnswerSource",
    "AskPolicy",
    "PermissionMode",
    "ReportingPolicy",
    "answer_source",
    "choose",
    "default_permission",
    "permission_policy",
]

PermissionMode = Literal["allow", "deny", "ask"]
"""How the command line answers an agent's permission questions (``--permission``, ``permission``
in the config)."""

_POLL_SECONDS: Final = 0.1
"""How often a read of an answer looks whether it was called off."""


def permission_policy(
    mode: PermissionMode | Literal["demo"],
    view: RunView,
    tool_calls: ToolCalls,
    answers: AnswerSource | None,
    *,
    timeout: float,
) -> PermissionPolicy:
    """The policy for ``mode`` (``"demo"``: allow, reported as the demo's answer); ``answers`` and
    ``timeout`` are for ``"ask"``."""
    if mode == "ask":
        return AskPolicy(view, tool_calls, answers, timeout=timeout)
    if mode == "demo":
        return ReportingPolicy(AllowPolicy(), "demo", view, tool_calls)
    inner: PermissionPolicy = AllowPolicy() if mode == "allow" else DenyPolicy()
    return ReportingPolicy(inner, f"--permission {mode}", view, tool_calls)


def answer_source(*, prompt_from_stdin: bool) -> AnswerSource | None:
    """Where a person's answers come from: the terminal when stdin carries the prompt, else stdin."""
    return AnswerSource.terminal() if prompt_from_stdin else AnswerSource.stdin()


def default_permission(answers: AnswerSource | None) -> PermissionMode:
    """``ask`` when a person can answer on a terminal and see the question on one, else ``deny``."""
    return "ask" if answers is not None and answers.isatty() and is_terminal(sys.stderr) else "deny"


class ReportingPolicy:
    """Decides with ``inner`` (an allow or deny policy) and reports each decision with ``reason``."""

    def __init__(self, inner: PermissionPolicy, reason: str, view: RunView, tool_calls: ToolCalls) -> None:
        self.inner = inner
        self.reason = reason
        self.name = reason
        """How a refusal names this policy: ``--permission deny``, say."""
        self.view = view
        self.tool_calls = tool_calls

    async def decide(self, question: PermissionQuestion) -> PermissionDecision:
        """Decide with the inner policy and report the decision."""
        decision = await self.inner.decide(question)
        self.view.decided(question, self.tool_calls.describe(question), decision, self.reason)
        return decision

    async def elicit(self, question: ElicitationQuestion) -> ElicitationAnswer:
        """Decline (nobody is asked, and nothing can invent an answer), and report it."""
        self.view.elicited(question, "decline", self.reason)
        return ElicitationAnswer.decline()


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
        self.name = "--permission ask"
        """How a refusal names this policy."""
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

    async def elicit(self, question: ElicitationQuestion) -> ElicitationAnswer:
        """Show the agent's form and read a value for each field, checked against the requested schema
        (a value that is not valid is asked for again). End of input cancels; an empty answer takes the
        field's default, skips an optional field, and declines the form at a required one. The whole
        form is bounded by the timeout (then cancelled); no terminal declines."""
        async with self._lock:
            if self.source is None:
                return self._elicited(question, ElicitationAnswer.decline(), "no terminal to ask on")
            self.view.elicitation(question, self.timeout)
            outcome: ElicitationAnswer | None = None
            reason = ""
            try:
                with anyio.move_on_after(self.timeout) as scope:
                    outcome, reason = await self._fill(question, self.source)
            except anyio.get_cancelled_exc_class():
                self.view.elicited(question, "cancel", "the turn was cancelled")
                raise
            if scope.cancelled_caught or outcome is None:
                self.view.answered(echoed=False)
                return self._elicited(
                    question, ElicitationAnswer.cancel(), f"no answer within {self.timeout:g} s"
                )
            return self._elicited(question, outcome, reason)

    async def _fill(
        self, question: ElicitationQuestion, source: AnswerSource
    ) -> tuple[ElicitationAnswer, str]:
        content: dict[str, FieldValue] = {}
        for field in question.fields:
            problem: str | None = None
            while True:
                self.view.elicitation_field(field, problem)
                stop = threading.Event()
                try:
                    typed = await anyio.to_thread.run_sync(
                        partial(source.read_line, stop), abandon_on_cancel=True
                    )
                finally:
                    stop.set()
                self.view.answered(echoed=typed is not None and source.isatty())
                if typed is None:
                    return ElicitationAnswer.cancel(), f"end of input on {source.name}"
                if not typed.strip():
                    if field.default is not None:
                        content[field.name] = field.default
                    elif field.required:
                        return ElicitationAnswer.decline(), f"no answer for {field.label!r}"
                    break
                try:
                    content[field.name] = parse_value(field, typed)
                except ValueError as exc:
                    problem = str(exc)
                    continue
                break
        return ElicitationAnswer.accept(content), "your answers"

    def _elicited(
        self, question: ElicitationQuestion, answer: ElicitationAnswer, reason: str
    ) -> ElicitationAnswer:
        self.view.elicited(question, answer.action, reason)
        return answer

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
