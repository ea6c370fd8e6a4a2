"""Budgets over ACP: what each known agent reports of its spending, and the charging of one run's reports.

An ACP child reports what it spends after the fact, each agent in its own place (see
:mod:`subagent.acp._turn_usage`), so the provider charges each report to the run's
:class:`~subagent.budget.BudgetAccount` as it arrives and stops the turn once a cap is passed: a cap is
passed by at most what the agent spent between two of its reports. A cap over something the agent never
reports cannot be enforced at all, so the provider offers only the caps its agent's reports cover
(:data:`KNOWN_AGENT_USAGE`): ``max_seconds`` and ``max_tool_calls`` always (the clock is ours, and every
tool call is announced), ``max_tokens`` when the agent reports tokens, ``max_cost`` when it reports cost or
tokens (priced then by the service's :class:`~subagent.budget.PriceTable` at the session's model), and never
``max_turns`` (an agent's model calls are not visible over ACP).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Literal, get_args

from subagent._usage_codec import usage_from_acp
from subagent.acp import schema
from subagent.acp._elicitation import ElicitationAnswer, ElicitationQuestion
from subagent.acp._turn_usage import TurnUsage, read_cost
from subagent.acp.handlers import (
    PermissionDecision,
    PermissionOutcome,
    PermissionPolicy,
    PermissionQuestion,
    policy_name,
)
from subagent.budget import BudgetAccount, Price, usage_tokens
from subagent.types import BudgetField, Usage

__all__ = [
    "KNOWN_AGENT_USAGE",
    "SERVE_USAGE",
    "BudgetPolicy",
    "KnownAgentUsage",
    "RunCharges",
    "UsageReport",
    "checked_usage_reports",
    "enforceable_caps",
    "known_usage_reports",
]

logger = logging.getLogger(__name__)

UsageReport = Literal["tokens", "cost"]
"""What an agent reports of its spending: its token counts, or what it cost."""

_USAGE_REPORTS: Final = frozenset(get_args(UsageReport))


@dataclass(frozen=True, slots=True)
class KnownAgentUsage:
    """What one agent reports of its spending over ACP (read from its ACP code; see
    :mod:`subagent.acp._turn_usage` for where each puts it)."""

    agent: str
    """The agent, for a person."""
    programs: frozenset[str]
    """Names of its program or npm package, one of which its command names (a path's part, or a package
    spec without its version)."""
    reports: frozenset[UsageReport]


KNOWN_AGENT_USAGE: Final[tuple[KnownAgentUsage, ...]] = (
    # Tokens in the prompt response (the turn's sum); cost in one usage_update at the turn's end (0.101.0:
    # after each model call it reports only the context's size), so either cap stops it at the turn's end.
    KnownAgentUsage(
        "claude-agent-acp", frozenset({"claude-agent-acp", "claude-code-acp"}), frozenset({"tokens", "cost"})
    ),
    # The turn's sums in the prompt response's _meta.quota.
    KnownAgentUsage("Gemini CLI", frozenset({"gemini", "gemini-cli"}), frozenset({"tokens"})),
    # Each model call's counts in an empty message chunk's _meta.usage.
    KnownAgentUsage("Qwen Code", frozenset({"qwen", "qwen-code"}), frozenset({"tokens"})),
    # Cost in usage_update, no token counts.
    KnownAgentUsage("opencode", frozenset({"opencode", "opencode-ai"}), frozenset({"cost"})),
    # usage_update with the context window only.
    KnownAgentUsage("codex-acp", frozenset({"codex-acp"}), frozenset()),
)
"""The agents whose usage reports are known, looked up by their command (``reports_usage=None``)."""

SERVE_USAGE: Final[frozenset[UsageReport]] = frozenset({"tokens"})
"""What ``subagent serve`` reports: the turn's token counts in the prompt response's ``usage``, when
its model reported them (it sends no cost). It also enforces a budget it is sent itself."""

_EXTENSIONS: Final = re.compile(r"\.(?:js|mjs|cjs|cmd|exe|py)$", re.IGNORECASE)
_VERSION: Final = re.compile(r"(?<=.)@[^/@]*$")  # `name@1.2.3` -> `name` (not a scope's leading @)


def _names(arg: str) -> set[str]:
    """The program and package names an argument may stand for: each part of a path or package spec,
    without a version or a script's extension (``@scope/name@1.2``, ``.../name/cli.js``, ``name.cmd``)."""
    parts = re.split(r"[/\\]", arg)
    return {_EXTENSIONS.sub("", _VERSION.sub("", part)).lower() for part in parts if part}


def known_usage_reports(command: Sequence[str]) -> frozenset[UsageReport]:
    """What the agent ``command`` runs reports, by :data:`KNOWN_AGENT_USAGE` (and ``subagent serve``'s
    :data:`SERVE_USAGE`); nothing for an agent the table does not know."""
    names = [_names(os.fspath(arg)) for arg in command]
    for index, found in enumerate(names[:-1]):
        if "subagent" in found and command[index + 1] == "serve":
            return SERVE_USAGE
    for known in KNOWN_AGENT_USAGE:
        if any(known.programs & found for found in names):
            return known.reports
    return frozenset()


def checked_usage_reports(reports: Iterable[UsageReport]) -> frozenset[UsageReport]:
    """``reports`` as a set, each checked.

    Raises:
        TypeError: a string rather than a collection of them.
        ValueError: an unknown report.
    """
    if isinstance(reports, str):
        raise TypeError(f"reports_usage is a collection of 'tokens' and 'cost', not the string {reports!r}")
    checked = frozenset(reports)
    unknown = sorted(str(report) for report in checked - _USAGE_REPORTS)
    if unknown:
        raise ValueError(f"unknown usage reports {unknown}: an agent reports 'tokens', 'cost', or both")
    return checked


def enforceable_caps(reports: frozenset[UsageReport]) -> frozenset[BudgetField]:
    """The caps an ACP child that reports ``reports`` can be held to (see the module docstring)."""
    caps: set[BudgetField] = {"max_seconds", "max_tool_calls"}
    if "tokens" in reports:
        # Tokens are also priced by the service's price table, for an agent that reports no cost.
        caps |= {"max_tokens", "max_cost"}
    if "cost" in reports:
        caps.add("max_cost")
    return frozenset(caps)


class RunCharges:
    """Charges one ACP run's reports to its account, as they arrive, over every turn of its session.

    Tokens: a turn's running count (the sum of its message chunks' ``_meta.usage``), then its prompt
    response's, of which only what was not charged yet is charged. Cost: ``usage_update`` says what the
    session has cost so far, so each increase over the last value seen (in any turn) is charged. Tool
    calls: one for each ``toolCallId`` the session's ``tool_call`` updates (or its permission questions)
    name for the first time.
    """

    def __init__(self, account: BudgetAccount) -> None:
        self.account = account
        self.price: Price | None = None
        """The price of the agent's tokens, when it reports no cost of its own (set once the session's
        model is known): each charge of tokens is then charged as cost too."""
        self.currency: str | None = None
        self._turn_priced = 0.0  # the cost of the running turn's tokens, charged so far
        self._tool_calls: set[str] = set()
        self._session_cost: float | None = None  # the cumulative cost last reported
        self._turn_usage = TurnUsage()
        self._turn_tokens = 0  # charged for the turn running now

    def begin_turn(self) -> None:
        """A new turn: its token count starts from nothing (the session's cost does not)."""
        self._turn_usage = TurnUsage()
        self._turn_tokens = 0
        self._turn_priced = 0.0

    def turn_usage(self) -> Usage | None:
        """The usage the running (or last) turn reported through its updates (not its prompt
        response): what is left to say of a turn whose agent was torn down before it answered."""
        return usage_from_acp(self._turn_usage.result(b"{}"))

    def take(self, update: schema.SessionUpdate) -> None:
        """Charge what ``update`` reports, if anything. Runs on the connection's task, for every update."""
        kind = type(update)
        if kind is schema.AgentMessageChunk:
            meta = update.meta  # type: ignore[union-attr]
            if meta is not None and "usage" in meta:
                self._turn_usage.add_chunk_meta(meta)
                self._charge_tokens(self.turn_usage())
        elif kind is schema.ToolCall:
            self.tool_call(update.tool_call_id)  # type: ignore[union-attr]
        elif kind is schema.UsageUpdate:
            self._take_usage_update(update.used, update.size, update.cost)  # type: ignore[union-attr]
        elif kind is schema.UnknownSessionUpdate:
            raw = update.raw  # type: ignore[union-attr]
            if raw.get("sessionUpdate") == "usage_update":  # e.g. `"used": null`: what fits is read
                self._take_usage_update(raw.get("used"), raw.get("size"), raw.get("cost"))

    def end_turn(self, usage: Usage | None) -> None:
        """The turn's prompt response said ``usage``: charge the tokens its updates had not."""
        self._charge_tokens(usage)

    def tool_call(self, tool_call_id: str) -> None:
        """Charge a tool call the first time its id is seen."""
        if tool_call_id not in self._tool_calls:
            self._tool_calls.add(tool_call_id)
            self.account.charge(tool_calls=1)

    def _charge_tokens(self, turn: Usage | None) -> None:
        """Charge what ``turn`` (the turn's usage so far) counts beyond what was charged: its tokens, and
        with a price, their cost."""
        if turn is None:
            return
        total = usage_tokens(turn)
        more = max(0, total - self._turn_tokens)
        self._turn_tokens = max(total, self._turn_tokens)
        cost = 0.0
        if self.price is not None:
            priced = self.price.cost(
                input_tokens=turn.input_tokens or 0,
                output_tokens=turn.output_tokens or 0,
                cached_read=turn.cached_read_tokens or 0,
                cached_write=turn.cached_write_tokens or 0,
            )
            cost, self._turn_priced = max(0.0, priced - self._turn_priced), max(priced, self._turn_priced)
        if more or cost:
            self.account.charge(tokens=more, cost=cost, currency=self.currency)

    def _take_usage_update(self, used: object, size: object, cost: object) -> None:
        self._turn_usage.add_usage_update(used, size, cost)
        amount_currency = read_cost(cost)
        if amount_currency is None:
            return
        amount, currency = amount_currency
        previous, self._session_cost = self._session_cost, amount
        if amount > (previous or 0.0):
            self.account.charge(cost=amount - (previous or 0.0), currency=currency)


class BudgetPolicy:
    """A permission policy that refuses, before the run's own policy is asked, a tool call past the
    budget: one whose call passes ``max_tool_calls``, or any once the run's account is exhausted (its own
    cap, an ancestor's, or its deadline). The agent is told no, as by a deny, while the turn is stopped."""

    def __init__(self, inner: PermissionPolicy, charges: RunCharges) -> None:
        self.inner = inner
        self.name = policy_name(inner)
        self._charges = charges

    async def elicit(self, question: ElicitationQuestion) -> ElicitationAnswer:
        """The inner policy's answer (a policy that cannot answer elicitations declines them)."""
        elicit = getattr(self.inner, "elicit", None)
        return ElicitationAnswer.decline() if elicit is None else await elicit(question)

    async def decide(self, question: PermissionQuestion) -> PermissionDecision:
        if question.subagent is None:
            # The agent asks before a tool call it may not have announced yet: it counts from here.
            self._charges.tool_call(question.tool_call_id)
        if self._charges.account.check() is None:
            return await self.inner.decide(question)
        option = question.first_option("reject_once", "reject_always")
        return PermissionOutcome.CANCELLED if option is None else option
