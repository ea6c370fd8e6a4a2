"""The command line's two streams: stderr for people (:class:`Console`), stdout for the answer.

Text from an agent is shown only through :func:`sanitize`, so an agent cannot drive the terminal;
colour is used only on a terminal with ``NO_COLOR`` unset (:func:`use_color`). Neither stream ever
fails the run: a closed stderr silences the console, and a reader that went away from stdout
(``| head``) gets nothing more.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from collections.abc import Mapping
from typing import Any, Final, TextIO

__all__ = ["Console", "is_terminal", "print_json", "print_stdout", "sanitize", "use_color"]

_CONTROL: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""Control characters (C0 but newline and tab, DEL, C1): what an agent could steer a terminal with."""


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


def print_json(value: Mapping[str, Any]) -> None:
    """Print ``value`` on stdout as one line of JSON."""
    print_stdout(json.dumps(value, ensure_ascii=False) + "\n")


def print_stdout(text: str) -> None:
    """Write ``text`` on stdout and flush; a reader that went away gets nothing more."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`| head`): nothing left to tell it. Point stdout at /dev/null so the
        # interpreter's final flush does not complain either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
