"""JSON read with every number finite: what a peer writes (a model's tool arguments, a recorded event
line) must not smuggle in ``NaN`` or ``Infinity``, which JSON lacks but Python's reader accepts, nor a
number too large for a float (``1e400``), which Python's reader turns into ``inf``."""

from __future__ import annotations

import json
import math
from typing import Any, Final

from subagent._text import cut

__all__ = ["NotFiniteNumberError", "loads_finite"]


_SHOWN_CHARS: Final = 40
"""The most characters of a number an error quotes (a peer may write one a megabyte long)."""


class NotFiniteNumberError(ValueError):
    """A number in the JSON text that is not finite; the message says so in the words of JSON (``constant``:
    one of the names Python's reader accepts, ``NaN``, ``Infinity``, ``-Infinity``; else one too large)."""

    def __init__(self, written: str, *, constant: bool) -> None:
        self.number = cut(written, _SHOWN_CHARS)
        """The number as written (``NaN``, ``-Infinity``, ``1e400``), shortened for a message."""
        super().__init__(
            f"{self.number} is not a JSON number" if constant else f"the number {self.number} is too large"
        )


def _refuse_constant(name: str) -> Any:
    raise NotFiniteNumberError(name, constant=True)


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise NotFiniteNumberError(text, constant=False)
    return number


def loads_finite(text: str | bytes) -> Any:
    """`json.loads`, refusing a number that is not finite.

    Raises:
        NotFiniteNumberError: a number is ``NaN``, ``Infinity``, ``-Infinity`` or too large for a float.
        ValueError: ``text`` is not JSON (`json.JSONDecodeError`, bad UTF-8, an over-long integer).
        RecursionError: it is nested too deeply.
    """
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
