"""What one call of the ``subagent`` tool came to: the record, how a run's outcome maps onto it, and
how an output too large for the parent's context is shown (:class:`Spill`).

Shared by the tool (:mod:`subagent.tool`) and its background side (:mod:`subagent.delegation`), which
maps the result of a child that ended long after the call that started it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from subagent.types import (
    ErrorCode,
    LimitHit,
    Spend,
    StopReason,
    SubagentError,
    SubagentRequest,
    SubagentResult,
    Usage,
    WorkspaceChange,
)

__all__ = ["Spill", "SubagentToolResult", "map_result", "seam_failure"]

_STOP_EXPLANATIONS: dict[StopReason, str] = {
    "cancelled": "it was cancelled.",
    "error": "it failed.",
    "timeout": "it was silent for longer than the inactivity timeout and was stopped.",
    "max_tokens": "it reached its output token limit.",
    "max_turns": "it reached its limit on turns.",
    "refusal": "it refused the task.",
    "budget": "it reached a cap of its budget and was stopped.",
}


@dataclass(frozen=True, slots=True)
class Spill:
    """A child's output that was too large to hand the model whole: it is in the file at ``path``
    (UTF-8, ``size`` bytes); the model is shown its first characters (``head``) and its last
    (``tail``) with the path and the size, and can read the rest with its own tools."""

    path: str
    size: int
    head: str
    tail: str

    def render(self) -> str:
        """The head, a line saying what was left out and where it is, and the tail."""
        return (
            f"{self.head}\n\n[... the output is {self.size} bytes, too long to show whole; only its "
            f"start and end are shown here. The whole output is in the file {self.path} ...]\n\n"
            f"{self.tail}"
        )


@dataclass(frozen=True, slots=True)
class SubagentToolResult:
    """What one call of the tool came to, for the model (:meth:`render`) and for the host (the fields).

    ``is_error`` is False only for a run that completed (and for a companion call that did what it
    was asked). ``output`` is the child's final message, partial when it stopped early, empty when no
    child ran. ``stop_reason`` is the child's, None when no child got as far as a result. ``error``
    says what went wrong, phrased for the model. ``error_code`` is the seam's code when the seam
    refused or failed the call (``NO_PROVIDER``, ``UNSUPPORTED_CAPABILITY``, ``START_FAILED``,
    ``DISPOSED``); it is None for invalid arguments and for a child that stopped early.
    ``structured`` is the validated JSON value when the call asked for ``output_schema``. ``run_id``
    and ``provider`` name the run when one was started; ``handle`` names a background child.
    ``spill`` is set when ``output`` was too large to show whole: :meth:`render` then shows its head
    and tail with the file that holds it (``output`` itself stays whole, for the host).
    ``limit`` is the cap (or the timeout) that stopped the child, and ``spent`` what it had spent
    against its budget, when it ran under one. ``workspace`` is where an isolated child worked and what
    it changed (its branch, commit and files), as of the end of its turn: :meth:`render` ends with it.
    ``workspace_discarded`` says that its cleanup policy (``remove-always``) removes the workspace, branch
    and all, when the child is disposed.
    """

    is_error: bool
    output: str = ""
    error: str | None = None
    stop_reason: StopReason | None = None
    structured: Any = None
    error_code: ErrorCode | None = None
    run_id: str | None = None
    provider: str | None = None
    usage: Usage | None = None
    handle: str | None = None
    spill: Spill | None = None
    limit: LimitHit | None = None
    spent: Spend | None = field(default=None, compare=False)  # holds wall time: no two runs alike
    workspace: WorkspaceChange | None = None
    workspace_discarded: bool = False

    @property
    def text(self) -> str:
        """The model-facing text; the same as :meth:`render`."""
        return self.render()

    def render(self) -> str:
        """The text to send to the model as the tool's result.

        Success: the structured value as JSON when one was asked for, else the child's output (its
        head and tail when it was spilled). Error: ``Error: `` and the explanation, then, when a child
        ran, its partial output. The ``Error:`` prefix carries the outcome in formats that have no
        error flag (OpenAI's tool messages). An isolated child's workspace is said last (where its
        changes are: a branch and commit, with the files changed).
        """
        return self._outcome() + self._workspace_note()

    def _outcome(self) -> str:
        output = self.output if self.spill is None else self.spill.render()
        if not self.is_error:
            if self.structured is not None:
                try:
                    return json.dumps(self.structured, ensure_ascii=False)
                except (TypeError, ValueError):
                    pass  # a provider handed back a non-JSON value: its text output still says it
            return output or "(the subagent finished without output)"
        text = f"Error: {self.error}"
        if self.stop_reason is not None:
            text += f"\n\nPartial output:\n{output}" if output else "\n\nIt produced no output."
        return text

    def _workspace_note(self) -> str:
        """Where an isolated child's changes are, as the last paragraph (empty for a child that was not)."""
        change = self.workspace
        if change is None:
            return ""
        if not self.workspace_discarded:
            return f"\n\nThe subagent worked in a workspace of its own: {change.describe()}."
        # Without the branch or copy that is no more.
        return (
            "\n\nThe subagent worked in a scratch workspace, removed with its changes when it ended: "
            f"{change.describe_files()}."
        )

    def to_openai(self, tool_call_id: str) -> dict[str, Any]:
        """An OpenAI chat-completions tool message answering ``tool_call_id``."""
        return {"role": "tool", "tool_call_id": tool_call_id, "content": self.render()}

    def to_anthropic(self, tool_use_id: str) -> dict[str, Any]:
        """An Anthropic ``tool_result`` content block answering ``tool_use_id``."""
        return {
            "type": "tool_result",
            "tool_use_id": tool_use_id,
            "content": self.render(),
            "is_error": self.is_error,
        }


def seam_failure(
    error: SubagentError, *, lead: str, provider: str, run_id: str | None = None, handle: str | None = None
) -> SubagentToolResult:
    """An error result for a ``SubagentError``, with its code."""
    return SubagentToolResult(
        is_error=True,
        error=f"{lead} ({error.code.value}): {error.message}",
        error_code=error.code,
        run_id=run_id,
        provider=provider,
        handle=handle,
    )


def map_result(
    result: SubagentResult,
    request: SubagentRequest,
    *,
    provider: str,
    run_id: str,
    handle: str | None = None,
    spill: Spill | None = None,
) -> SubagentToolResult:
    """A run's result as the tool's: ``completed`` is a success, any other stop reason an error
    result with the partial output and an explanation."""
    structured = result.structured if request.output_schema is not None else None
    discarded = result.workspace is not None and request.cleanup == "remove-always"
    if result.stop_reason == "completed":
        return SubagentToolResult(
            is_error=False,
            output=result.output,
            stop_reason="completed",
            structured=structured,
            run_id=run_id,
            provider=provider,
            usage=result.usage,
            handle=handle,
            spill=spill,
            spent=result.spent,
            workspace=result.workspace,
            workspace_discarded=discarded,
        )
    explanation = _STOP_EXPLANATIONS.get(result.stop_reason, "it stopped early.")
    if result.stop_reason == "error" and result.error:
        explanation = f"it failed: {result.error}"
    elif result.stop_reason == "timeout" and request.timeout is not None:
        explanation = (
            f"it was silent for longer than the inactivity timeout ({request.timeout:g} s) and was stopped."
        )
    elif result.stop_reason == "budget":
        explanation = _budget_explanation(result)
    return SubagentToolResult(
        is_error=True,
        output=result.output,
        error=f"the subagent stopped before finishing (stop reason: {result.stop_reason}): {explanation}",
        stop_reason=result.stop_reason,
        run_id=run_id,
        provider=provider,
        usage=result.usage,
        handle=handle,
        spill=spill,
        limit=result.limit,
        spent=result.spent,
        workspace=result.workspace,
        workspace_discarded=discarded,
    )


def _budget_explanation(result: SubagentResult) -> str:
    """Which cap stopped the run, and what it spent against each of its caps, for the model."""
    currency = result.spent.cost_currency if result.spent is not None else None
    if result.limit is None:
        explanation = _STOP_EXPLANATIONS["budget"]
    else:
        explanation = f"it reached a cap of its budget and was stopped ({result.limit.describe(currency)})."
    if result.spent is not None and result.budget is not None and result.budget.fields():
        explanation += f" Spent: {result.spent.describe(result.budget)}."
    return explanation
