"""The command line's two streams: stderr for people (:class:`Console`), stdout for the answer.

Text from an agent is shown only through :func:`sanitize`, so an agent cannot drive the terminal;
colour is used only on a terminal with ``NO_COLOR`` unset (:func:`use_color`). Neither stream ever
fails the run: a closed stderr silences the console, and a reader that went away from stdout
(``| head``) gets nothing more.

On a terminal a console can keep a *footer* (:meth:`Console.set_footer`): rows always shown below
the rest, redrawn in place. Every write then erases the footer (cursor up, erase to the end of the
screen), puts the cursor back at the end of the text above it, writes, and draws the footer again;
so what scrolls stays in the terminal's history and the footer stays at the bottom. The column
where the text above ends is followed as the terminal would (:func:`advance_column`: wide
characters, tabs and the wrap at the right margin), so streamed text that ends mid-line goes on
where it stopped.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TextIO

__all__ = [
    "Console",
    "advance_column",
    "fit_width",
    "is_terminal",
    "print_json",
    "print_stdout",
    "sanitize",
    "terminal_size",
    "text_width",
    "use_color",
]

_CONTROL: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""Control characters (C0 but newline and tab, DEL, C1): what an agent could steer a terminal with."""


def sanitize(text: str) -> str:
    """``text`` without control characters (newlines and tabs kept; ``\\r\\n`` becomes ``\\n``)."""
    return _CONTROL.sub("", text.replace("\r\n", "\n"))


DEFAULT_COLUMNS: Final = 80
"""The width assumed for a stream whose terminal size cannot be read."""
DEFAULT_HEIGHT: Final = 24
"""The height (rows) assumed for a stream whose terminal size cannot be read."""
_SGR: Final = re.compile(r"\x1b\[[0-9;]*m")
"""A colour sequence (what :meth:`Console.paint` adds): it takes no column."""
_TAB_STOP: Final = 8


def _char_width(char: str) -> int:
    """Columns a terminal gives ``char``: 0 for combining marks and format characters, 2 for wide ones."""
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def _first_spacing(text: str) -> int:
    """Where the first character of ``text`` that is not a colour sequence or of no width is."""
    at = 0
    while at < len(text):
        colour = _SGR.match(text, at)
        if colour is not None:
            at = colour.end()
        elif not text[at].isascii() and _char_width(text[at]) == 0:
            at += 1
        else:
            break
    return at


def text_width(text: str) -> int:
    """Columns ``text`` (one line, no control characters) takes on a terminal."""
    if text.isascii():
        return len(text)
    return sum(_char_width(char) for char in text)


def fit_width(text: str, width: int) -> str:
    """``text`` (one line, no control characters) cut to ``width`` columns, ending with ``…`` when cut."""
    if width <= 0:
        return ""
    if text_width(text) <= width:
        return text
    kept: list[str] = []
    used = 0
    for char in text:
        char_width = _char_width(char)
        if used + char_width > width - 1:
            break
        kept.append(char)
        used += char_width
    return "".join(kept) + "\u2026"


def advance_column(column: int, text: str, columns: int) -> int:
    """The cursor's column after a terminal ``columns`` wide, its cursor at ``column``, shows ``text``.

    ``text`` holds no control characters but newlines and tabs (it may hold colour sequences).
    ``columns`` is returned when the last row is exactly full: the terminal wraps only at the next
    character.
    """
    columns = max(columns, 1)
    line_start = text.rfind("\n")  # only the last line counts (and a colour sequence holds no newline)
    if line_start >= 0:
        column, text = 0, text[line_start + 1 :]
    text = _SGR.sub("", text)
    if text.isascii() and "\t" not in text:
        end = column + len(text)
        return end if end <= columns else (end - columns - 1) % columns + 1
    for char in text:
        if char == "\t":
            # To the next tab stop, never past the last column (a pending wrap is dropped).
            column = min((min(column, columns - 1) // _TAB_STOP + 1) * _TAB_STOP, columns - 1)
            continue
        char_width = 1 if char.isascii() else _char_width(char)
        if char_width:
            column = char_width if column + char_width > columns else column + char_width
    return column


def terminal_size(stream: TextIO) -> tuple[int, int]:
    """Columns and rows of the terminal ``stream`` shows on (the defaults for what is unknown)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):
        return DEFAULT_COLUMNS, DEFAULT_HEIGHT
    return (
        size.columns if size.columns > 0 else DEFAULT_COLUMNS,
        size.lines if size.lines > 0 else DEFAULT_HEIGHT,
    )


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
    never raise: a closed stderr silences the console instead of failing the run. ``columns`` and
    ``height`` give the terminal's size (default: :func:`terminal_size` of ``stream``).
    """

    def __init__(
        self,
        stream: TextIO,
        *,
        color: bool,
        columns: Callable[[], int] | None = None,
        height: Callable[[], int] | None = None,
    ) -> None:
        self.stream = stream
        self.color = color
        self.at_line_start = True
        self._columns = columns
        self._height = height
        self._lock = threading.Lock()
        self._broken = False
        self._footer: tuple[str, ...] = ()
        self._column = 0  # the column where the text written ends (see advance_column)
        self._below_full_row = False
        """The text written ends with a full row but the cursor is at the start of the next one."""
        self._width = self.columns() if is_terminal(stream) else DEFAULT_COLUMNS
        """The terminal's width as of the last write (the one ``_column`` is counted in)."""

    def columns(self) -> int:
        """The terminal's width in columns."""
        return self._columns() if self._columns is not None else terminal_size(self.stream)[0]

    def height(self) -> int:
        """The terminal's height in rows."""
        return self._height() if self._height is not None else terminal_size(self.stream)[1]

    def set_footer(self, rows: Sequence[str]) -> None:
        """Show ``rows`` below everything else, in place of the footer shown before (see the module
        docstring); no rows clears it. Each row must fit in one terminal row (cut it with
        :func:`fit_width` to ``columns() - 1``) and hold no control characters. For a terminal only:
        this moves the cursor."""
        rows = tuple(rows)
        with self._lock:
            if rows == self._footer:
                return
            out = self._erase_footer() if self._footer else ""
            self._footer = rows
            if rows:
                self._width = self.columns()
                out += self._footer_text()
            self._raw(out)

    def clear_footer(self) -> None:
        """Erase the footer, leaving the cursor where the text above it ends."""
        self.set_footer(())

    def typed_newline(self) -> None:
        """The terminal echoed a newline a person typed: the cursor is at the start of a line."""
        with self._lock:
            self.at_line_start, self._column, self._below_full_row = True, 0, False

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
        out = ""
        if self._footer:
            out = self._erase_footer()
            self._width = self.columns()
        if self._below_full_row:
            # The text above ends with a full row, the terminal about to wrap, but the cursor already
            # sits at the start of the row below. A newline would leave a blank row: it is already
            # done. A tab would not wrap: it goes from the end of the full row.
            at = _first_spacing(text)
            first = text[at : at + 1]
            if first == "\n":
                out, text = out + text[:at], text[at + 1 :]
                self._column, self.at_line_start = 0, True
            elif first == "\t":
                out += f"\x1b[A\x1b[{self._width}G"
            self._below_full_row = not first
        self._column = advance_column(self._column, text, self._width)
        if text:
            self.at_line_start = text.endswith("\n")
        self._raw(out + text + self._footer_text())

    def _erase_footer(self) -> str:
        """Erase the footer (the cursor is at the end of its last row) and go back to where the text
        above it ends."""
        up = len(self._footer) - 1
        out = "\r" + (f"\x1b[{up}A" if up else "") + "\x1b[J"
        if not self.at_line_start:
            if self._column < self._width:
                out += f"\x1b[A\x1b[{self._column + 1}G"  # up to the row the text ends on
            else:
                self._below_full_row = True  # the footer began where the full row's text goes on
        return out

    def _footer_text(self) -> str:
        if not self._footer:
            return ""
        # After a full row the terminal wraps by itself at the footer's first character.
        own_row = self.at_line_start or self._column >= self._width
        return ("" if own_row else "\n") + "\n".join(self._footer)

    def _raw(self, text: str) -> None:
        if self._broken or not text:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self._broken = True


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
