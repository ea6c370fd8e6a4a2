"""What every run class needs and none should write again: an outcome settled once and awaited any
number of times, ``async with run:`` disposing the run (and ``async with owner:`` closing an owner of
runs or connections), and the re-raising of a task group's one real error as itself.

A run's readiness and its result are each such an outcome: a value or an error, settled once by
whoever knows first (the first settle wins, later ones are no-ops), then handed, unchanged, to every
caller that awaits it, before or after it settled.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Generic, Self, TypeVar, cast

import anyio

__all__ = ["CloseOnExit", "DisposeOnExit", "Outcome", "raise_sole_error"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Outcome(Generic[T]):
    """A value or an error, settled once, awaited any number of times with the same outcome.

    Every :meth:`wait` (and :meth:`get` once settled) returns the same value or raises the same
    exception object, so ``pytest.raises(...).value is error`` holds for every caller. Each raise
    starts again from the traceback the error had when it was settled: awaiting a failed outcome a
    thousand times does not grow it a thousand times.
    """

    __slots__ = ("_error", "_event", "_traceback", "_value")

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._traceback: TracebackType | None = None

    def __repr__(self) -> str:
        if not self._event.is_set():
            return "<Outcome pending>"
        if self._error is not None:
            return f"<Outcome failed: {self._error!r}>"
        return f"<Outcome {self._value!r}>"

    def is_set(self) -> bool:
        """Whether the outcome is settled (with a value or an error)."""
        return self._event.is_set()

    @property
    def error(self) -> BaseException | None:
        """The error it was settled with; None while unsettled or when settled with a value."""
        return self._error

    def settle(self, value: T) -> bool:
        """Settle with ``value`` unless already settled; return whether this call settled it."""
        if self._event.is_set():
            return False
        self._value = value
        self._event.set()
        return True

    def fail(self, error: BaseException) -> bool:
        """Settle with ``error`` unless already settled; return whether this call settled it."""
        if self._event.is_set():
            return False
        self._error = error
        self._traceback = error.__traceback__
        self._event.set()
        return True

    def get(self) -> T:
        """The value now, or raise the error.

        Raises:
            RuntimeError: the outcome is not settled yet.
        """
        error = self._error
        if error is not None:
            try:
                raise error.with_traceback(self._traceback)
            finally:
                del error  # no reference cycle through this frame
        if not self._event.is_set():
            raise RuntimeError("the outcome is not settled yet")
        return cast(T, self._value)  # settled with a value (None is one when T allows it)

    async def wait(self) -> T:
        """Wait until settled; return the value or raise the error (the same one every time)."""
        await self._event.wait()
        return self.get()

    async def wait_settled(self) -> None:
        """Wait until settled, without raising its error."""
        await self._event.wait()


class DisposeOnExit:
    """A run used as an async context manager: leaving the block disposes it, on every exit path."""

    async def dispose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.dispose()


class CloseOnExit:
    """An owner (of children, of a connection) used as an async context manager: leaving the block
    awaits its ``aclose``, on every exit path."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def raise_sole_error(
    group: BaseExceptionGroup[BaseException], *, preferred: BaseException | None = None
) -> None:
    """Raise the one real error inside a task group's exception ``group`` as itself; return if none.

    The group's leaves are its exceptions once nested groups are flattened. Cancellations are left
    to the group (a cancel scope takes them out of it), so with no other leaf this returns and the
    caller re-raises the group. ``preferred`` (the exception that left the task group's own block)
    wins over leaves raised by its tasks, which are logged; several task errors and no preferred
    one: the first is raised, the others logged and named in its notes.

    Use it in the handler of the task group::

        try:
            async with anyio.create_task_group() as task_group:
                ...
        except BaseExceptionGroup as group:
            raise_sole_error(group)
            raise
    """
    cancelled = anyio.get_cancelled_exc_class()
    errors = [leaf for leaf in _leaves(group) if not isinstance(leaf, cancelled)]
    if not errors:
        return
    chosen = preferred if preferred is not None and any(e is preferred for e in errors) else errors[0]
    for other in errors:
        if other is not chosen:
            logger.error("a task failed while %r was raised", chosen, exc_info=other)
            chosen.add_note(f"also failed meanwhile: {type(other).__name__}: {other}")
    context = chosen.__context__
    try:
        raise chosen
    finally:
        # Raised from inside the handler, it would show the group as its context: restore its own.
        chosen.__context__ = context
        del chosen, context


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for member in group.exceptions:
        if isinstance(member, BaseExceptionGroup):
            leaves += _leaves(member)
        else:
            leaves.append(member)
    return leaves
