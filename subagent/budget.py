"""The budget ledger: one account per run, chained to its parent's, that enforces a tree's caps.

A run's spending (tokens, cost, tool calls, model calls) is charged to its account and to every
account above it, so a parent's spending includes its subtree's. A cap is checked along the whole
chain: a run may spend only what every ancestor still has. Wall time is a deadline, the earliest of
the chain's.

Two ways to spend, for two kinds of child:

* **Reserve, then settle** (in-process children, whose every model call and tool call passes here
  first): :meth:`BudgetAccount.reserve` sets the worst case of the next step aside along the chain,
  or says which cap it would pass. While other runs' reservations hold the room a step needs, it
  waits for them to settle rather than fail: only spent money stops a run. With an adapter that bounds
  a call's output (``max_tokens``), the reservation is the call's whole worst case and no cap is ever
  passed; otherwise a cap is passed by at most the output of the calls in flight when it was reached.
* **Charge after the fact** (ACP children, which report usage as they go): :meth:`BudgetAccount.charge`
  adds what was reported and returns the cap it passed, if any; the run is then stopped. A cap is
  passed by at most what the child spent between two reports.

When a charge passes the cap of an account, that account and every account below it are
*exhausted*: their listeners (:meth:`BudgetAccount.on_exhausted`, the providers' runs) are told once,
and stop their runs with the stop reason ``budget``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from subagent.types import (
    BUDGET_FIELDS,
    Budget,
    BudgetField,
    Disposer,
    LimitHit,
    Spend,
    SubagentRequest,
    SubagentResult,
    Usage,
)

__all__ = [
    "BudgetAccount",
    "Price",
    "PriceTable",
    "Reservation",
    "account_for",
    "budget_result",
    "usage_tokens",
]

logger = logging.getLogger(__name__)

WHOLE_NUMBER_CAPS: frozenset[BudgetField] = frozenset({"max_tokens", "max_tool_calls", "max_turns"})
"""The caps counted in whole units: what is left of them is a whole number too."""

_COUNTED: dict[BudgetField, str] = {
    "max_tokens": "tokens",
    "max_cost": "cost",
    "max_tool_calls": "tool_calls",
    "max_turns": "turns",
}
"""The caps that count something spent (``max_seconds`` is a deadline), and the counter each reads."""


def usage_tokens(usage: Usage | None) -> int:
    """The tokens a usage counts against ``max_tokens``: input plus output (its total when it gives
    neither). Cached and thought tokens are left to the agent's own input and output counts."""
    if usage is None:
        return 0
    if usage.input_tokens is not None or usage.output_tokens is not None:
        return (usage.input_tokens or 0) + (usage.output_tokens or 0)
    return usage.total_tokens or 0


@dataclass(frozen=True, slots=True)
class Price:
    """A model's prices per million tokens. Cached reads and writes cost what input costs unless given."""

    input: float
    output: float
    cached_read: float | None = None
    cached_write: float | None = None

    def __post_init__(self) -> None:
        for name in ("input", "output", "cached_read", "cached_write"):
            value = getattr(self, name)
            if value is None and name.startswith("cached"):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"price {name} must be a number, not {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"price {name} must be >= 0 and finite, got {value!r}")

    def cost(
        self, *, input_tokens: int = 0, output_tokens: int = 0, cached_read: int = 0, cached_write: int = 0
    ) -> float:
        """What those tokens cost."""
        read = self.input if self.cached_read is None else self.cached_read
        write = self.input if self.cached_write is None else self.cached_write
        total = (
            input_tokens * self.input
            + output_tokens * self.output
            + cached_read * read
            + cached_write * write
        )
        return total / 1_000_000


class PriceTable:
    """Prices per model, for a cost cap over children whose agent reports tokens but no cost.

    A model is found by its exact name, else by the longest name in the table it starts with
    (``claude-sonnet-4-5`` prices ``claude-sonnet-4-5-20250929``).

    Args:
        prices: model name to :class:`Price` (or a mapping of its fields, as a config file gives).
        currency: the currency of every price (and so of every cost computed).
    """

    def __init__(self, prices: Mapping[str, Price | Mapping[str, float]], *, currency: str = "USD") -> None:
        if not currency:
            raise ValueError("a price table needs a currency")
        self.currency = currency
        self._prices = {
            str(model): price if isinstance(price, Price) else Price(**price)
            for model, price in prices.items()
        }

    def __repr__(self) -> str:
        return f"<PriceTable {len(self._prices)} models, {self.currency}>"

    def price(self, model: str | None) -> Price | None:
        """The price of ``model``, or None when the table does not know it."""
        if not model:
            return None
        exact = self._prices.get(model)
        if exact is not None:
            return exact
        prefixes = [name for name in self._prices if model.startswith(name)]
        return self._prices[max(prefixes, key=len)] if prefixes else None

    def cost(self, model: str | None, usage: Usage | None) -> float | None:
        """What ``usage`` cost on ``model`` (None: the model is not in the table)."""
        price = self.price(model)
        if price is None or usage is None:
            return None
        return price.cost(
            input_tokens=usage.input_tokens or 0,
            output_tokens=usage.output_tokens or 0,
            cached_read=usage.cached_read_tokens or 0,
            cached_write=usage.cached_write_tokens or 0,
        )


class BudgetAccount:
    """One run's account in its tree's ledger (see the module docstring).

    Args:
        budget: the run's own caps (None: none of its own; its ancestors' still hold).
        parent: the account of the run (or the host) above it, charged with everything this one is.
        owner: the id of the run the account belongs to, named in the :class:`~subagent.types.LimitHit`
            of a cap of its own.
        prices: the price table that turns tokens into cost (default: the parent's).
        clock: the clock of the deadline (``time.monotonic``).
    """

    def __init__(
        self,
        budget: Budget | None = None,
        *,
        parent: BudgetAccount | None = None,
        owner: str | None = None,
        prices: PriceTable | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.parent = parent
        self.owner = owner
        self.asked = budget if budget is not None else Budget()
        """The caps this account was opened with, before its ancestors narrowed them."""
        self.prices: PriceTable | None = prices if prices is not None else (parent.prices if parent else None)
        self._clock = clock
        self.started_at = clock()
        self._spent: dict[str, float] = {"tokens": 0, "cost": 0.0, "tool_calls": 0, "turns": 0}
        self._reserved: dict[str, float] = {"tokens": 0, "cost": 0.0, "tool_calls": 0, "turns": 0}
        self._currency: str | None = None
        self._hit: LimitHit | None = None
        self._listeners: list[Callable[[LimitHit], object]] = []
        self._children: dict[BudgetAccount, None] = {}
        self._released: anyio.Event | None = None  # set when a reservation on this account settles
        self._closed = False
        if parent is not None:
            parent._children[self] = None
        self.budget = self._effective()
        """The caps the run starts under: its own, each narrowed to what the chain had left then."""

    def __repr__(self) -> str:
        return f"<BudgetAccount {self.owner!r} {self.spent().describe(self.budget)}>"

    # -- reading --------------------------------------------------------------------------------------

    def chain(self) -> Iterator[BudgetAccount]:
        """This account, then each one above it."""
        account: BudgetAccount | None = self
        while account is not None:
            yield account
            account = account.parent

    @property
    def deadline(self) -> float | None:
        """When the chain's earliest ``max_seconds`` runs out (the clock's time), if any caps time."""
        ends = [a.started_at + a.asked.max_seconds for a in self.chain() if a.asked.max_seconds is not None]
        return min(ends) if ends else None

    @property
    def capped(self) -> bool:
        """Whether any account of the chain caps anything."""
        return any(a.asked.fields() for a in self.chain())

    @property
    def exhausted(self) -> LimitHit | None:
        """The cap that stopped this account (its own or an ancestor's), once one did."""
        return self._hit

    def spent(self) -> Spend:
        """What this account's run, with its subtree, has spent."""
        return Spend(
            tokens=int(self._spent["tokens"]),
            cost=self._spent["cost"],
            cost_currency=self._currency,
            seconds=max(0.0, self._clock() - self.started_at),
            tool_calls=int(self._spent["tool_calls"]),
            turns=int(self._spent["turns"]),
        )

    def remaining(self, *, reserved: bool = True) -> Budget:
        """What may still be spent here now: for each cap along the chain, the least left (reservations
        counted as spent, unless ``reserved`` is False). A cap nobody on the chain sets stays None."""
        left: dict[str, Any] = {}
        for name in BUDGET_FIELDS:
            values = [a._left(name, reserved=reserved) for a in self.chain() if a.asked.cap(name) is not None]
            if values:
                value = max(0.0, min(values))
                left[name] = int(value) if name in WHOLE_NUMBER_CAPS else value
        if "max_seconds" in left and left["max_seconds"] <= 0:
            left["max_seconds"] = 1e-9  # a Budget's time is > 0; the deadline has passed all the same
        return Budget(**left)

    def check(self) -> LimitHit | None:
        """The cap that stops this run now, if one does: an exhaustion already noticed, a cap of the
        chain spent past, or the deadline passed."""
        if self._hit is not None:
            return self._hit
        for account in self.chain():
            for name in _COUNTED:
                cap = account.asked.cap(name)
                if cap is not None and account._spent[_COUNTED[name]] > cap:
                    return account._limit(name)
        return self.deadline_hit()

    def deadline_hit(self) -> LimitHit | None:
        """The ``max_seconds`` hit of the chain's earliest deadline, once it has passed."""
        owner = self._deadline_owner()
        return owner._limit("max_seconds") if owner is not None else None

    def _deadline_owner(self) -> BudgetAccount | None:
        timed = [a for a in self.chain() if a.asked.max_seconds is not None]
        if not timed:
            return None
        first = min(timed, key=lambda a: a.started_at + (a.asked.max_seconds or 0.0))
        return first if self._clock() >= first.started_at + (first.asked.max_seconds or 0.0) else None

    def spent_limit(self, name: BudgetField, *, needed: float | None = None) -> LimitHit:
        """The hit of cap ``name`` for a step that cannot fit (needing ``needed``, when known), or that was
        cut to what was left: named after the account of the chain with the least of it left."""
        capped = [a for a in self.chain() if a.asked.cap(name) is not None]
        if not capped:
            raise ValueError(f"nothing on the chain caps {name}")
        return min(capped, key=lambda a: a._left(name))._limit(name, needed=needed)

    # -- spending -------------------------------------------------------------------------------------

    def cost_of(self, model: str | None, usage: Usage | None) -> tuple[float, str] | None:
        """``(cost, currency)`` of ``usage`` on ``model`` by the price table, when it knows the model."""
        if self.prices is None:
            return None
        cost = self.prices.cost(model, usage)
        return None if cost is None else (cost, self.prices.currency)

    def charge(
        self,
        *,
        tokens: int = 0,
        cost: float = 0.0,
        currency: str | None = None,
        tool_calls: int = 0,
        turns: int = 0,
    ) -> LimitHit | None:
        """Add what the run spent to this account and every one above it; return the cap that stops
        the run, if one does now. Passing an account's cap exhausts it and everything below it."""
        amounts = {
            "tokens": tokens,
            "cost": self._cost(cost, currency),
            "tool_calls": tool_calls,
            "turns": turns,
        }
        for account in self.chain():
            for key, amount in amounts.items():
                account._spent[key] += amount
            if currency and account._currency is None and amounts["cost"]:
                account._currency = currency
        for account in self.chain():
            for name, key in _COUNTED.items():
                cap = account.asked.cap(name)
                if cap is not None and account._spent[key] > cap:
                    account._exhaust(account._limit(name))
                    break
        return self.check()

    async def reserve(
        self, *, tokens: int = 0, cost: float = 0.0, tool_calls: int = 0, turns: int = 0
    ) -> Reservation | LimitHit:
        """Set the worst case of the next step aside along the chain, or return the cap it cannot fit.

        When it does not fit only because other runs' reservations hold the room, waits for them to
        settle and tries again: a reservation is refused only by what was spent.
        """
        while True:
            reserved = self.try_reserve(tokens=tokens, cost=cost, tool_calls=tool_calls, turns=turns)
            if reserved is not None:
                return reserved
            await self.wait_released()

    def try_reserve(
        self, *, tokens: int = 0, cost: float = 0.0, tool_calls: int = 0, turns: int = 0
    ) -> Reservation | LimitHit | None:
        """:meth:`reserve` without waiting: None when only other reservations hold the room it needs
        (:meth:`wait_released`, then try again)."""
        hit = self.check()
        if hit is not None:
            return hit
        amounts = {"tokens": tokens, "cost": cost, "tool_calls": tool_calls, "turns": turns}
        blocked = False
        for account in self.chain():
            for name, key in _COUNTED.items():
                cap = account.asked.cap(name)
                if cap is None or not amounts[key]:
                    continue
                if account._spent[key] + amounts[key] > cap:
                    return account._limit(name, needed=amounts[key])
                if account._spent[key] + account._reserved[key] + amounts[key] > cap:
                    blocked = True
        if blocked:
            return None
        for account in self.chain():
            for key, amount in amounts.items():
                account._reserved[key] += amount
        return Reservation(self, amounts)

    async def wait_released(self) -> None:
        """Return once a reservation along the chain settles, or the account is exhausted."""
        if self._hit is not None:
            return
        if self._released is None:
            self._released = anyio.Event()
        await self._released.wait()

    def take(self, *, tool_calls: int = 0, turns: int = 0) -> LimitHit | None:
        """Charge a step whose cost is known exactly when it starts (a tool call) if it fits along the
        chain (what others reserved counted as spent), or return the cap it would pass, charging nothing.

        Never waits, unlike :meth:`reserve`: a tool call may wait on a subagent whose own steps need the
        room, so holding a reservation through it could wait forever."""
        hit = self.check()
        if hit is not None:
            return hit
        steps: tuple[tuple[BudgetField, str, int], ...] = (
            ("max_tool_calls", "tool_calls", tool_calls),
            ("max_turns", "turns", turns),
        )
        for account in self.chain():
            for name, key, amount in steps:
                cap = account.asked.cap(name)
                if cap is not None and amount and account._spent[key] + account._reserved[key] + amount > cap:
                    return account._limit(name, needed=amount)
        return self.charge(tool_calls=tool_calls, turns=turns)

    def on_exhausted(self, listener: Callable[[LimitHit], object]) -> Disposer:
        """Call ``listener`` once with the cap, when this account (or one above it) is exhausted: the run
        must stop. Called at once when it already is."""
        if self._hit is not None:
            listener(self._hit)
            return lambda: None
        self._listeners.append(listener)

        def dispose() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return dispose

    def expire(self) -> LimitHit | None:
        """Exhaust the account whose deadline has passed, with everything below it (the run's timer
        calls this at its deadline); return its hit, if it has passed."""
        owner = self._deadline_owner()
        if owner is None:
            return None
        hit = owner._limit("max_seconds")
        owner._exhaust(hit)
        return hit

    def close(self) -> None:
        """Detach from the parent: the run is over. What it spent stays counted above it."""
        self._closed = True
        self._listeners.clear()
        if self.parent is not None:
            self.parent._children.pop(self, None)

    # -- internals --------------------------------------------------------------------------------------

    def _effective(self) -> Budget:
        left = self.parent.remaining() if self.parent is not None else None
        return self.asked.tighter(left)

    def _left(self, name: BudgetField, *, reserved: bool = True) -> float:
        cap = self.asked.cap(name)
        assert cap is not None
        if name == "max_seconds":
            return self.started_at + cap - self._clock()
        key = _COUNTED[name]
        return cap - self._spent[key] - (self._reserved[key] if reserved else 0)

    def _limit(self, name: BudgetField, *, needed: float | None = None) -> LimitHit:
        cap = self.asked.cap(name)
        assert cap is not None
        spent = self.spent().of(name)
        currency = self._currency if name == "max_cost" else None
        return LimitHit(
            limit=name, allowed=cap, spent=spent, owner=self.owner, needed=needed, currency=currency
        )

    def _cost(self, cost: float, currency: str | None) -> float:
        if not cost:
            return 0.0
        known = next((a._currency for a in self.chain() if a._currency is not None), None)
        if currency and known and currency != known:
            logger.warning("a cost in %s cannot be added to a budget kept in %s: left out", currency, known)
            return 0.0
        return float(cost)

    def _exhaust(self, hit: LimitHit) -> None:
        pending = [self]
        while pending:
            account = pending.pop()
            if account._hit is None:
                account._hit = hit
                listeners, account._listeners = account._listeners, []
                for listener in listeners:
                    try:
                        listener(hit)
                    except Exception:
                        logger.exception("a budget listener raised")
            pending.extend(account._children)
        self._wake()

    def _wake(self) -> None:
        # Any account of the tree may wait on room this one held: wake them all (a tree is small).
        root = self
        while root.parent is not None:
            root = root.parent
        pending = [root]
        while pending:
            account = pending.pop()
            if account._released is not None:
                account._released.set()
                account._released = None
            pending.extend(account._children)


class Reservation:
    """A step's worst case, set aside by :meth:`BudgetAccount.reserve` until :meth:`settle`."""

    def __init__(self, account: BudgetAccount, amounts: Mapping[str, float]) -> None:
        self.account = account
        self.amounts = dict(amounts)
        self._settled = False

    @property
    def tokens(self) -> int:
        """The tokens set aside."""
        return int(self.amounts["tokens"])

    def settle(
        self,
        *,
        tokens: int = 0,
        cost: float = 0.0,
        currency: str | None = None,
        tool_calls: int | None = None,
        turns: int | None = None,
    ) -> LimitHit | None:
        """Give the reservation back and charge what the step really spent (tool calls and turns: what
        was reserved, unless given); return the cap that stops the run, if one does now. Idempotent."""
        if self._settled:
            return self.account.check()
        self._settled = True
        for account in self.account.chain():
            for key, amount in self.amounts.items():
                account._reserved[key] -= amount
        self.account._wake()
        return self.account.charge(
            tokens=tokens,
            cost=cost,
            currency=currency,
            tool_calls=int(self.amounts["tool_calls"]) if tool_calls is None else tool_calls,
            turns=int(self.amounts["turns"]) if turns is None else turns,
        )

    def release(self) -> None:
        """Give the reservation back charging nothing (the step never happened). Idempotent."""
        if not self._settled:
            self._settled = True
            for account in self.account.chain():
                for key, amount in self.amounts.items():
                    account._reserved[key] -= amount
            self.account._wake()


def account_for(request: SubagentRequest) -> BudgetAccount | None:
    """The request's account: the service's, else (a provider used without a service) a root account
    of its own budget; None when nothing caps the run."""
    if request.account is not None:
        return request.account
    return BudgetAccount(request.budget) if request.budget is not None and request.budget.fields() else None


def budget_result(result: SubagentResult, account: BudgetAccount) -> SubagentResult:
    """``result`` with the caps its run ran under and what it spent; with the cap that stopped it when
    it ended ``budget`` and does not name one yet."""
    limit = result.limit
    if result.stop_reason == "budget" and limit is None:
        limit = account.check()
    return dataclasses.replace(
        result, budget=account.budget if account.capped else None, spent=account.spent(), limit=limit
    )
