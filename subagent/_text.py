"""Text shortened for a reader: a title, a label, an excerpt of a prompt or an answer."""

from __future__ import annotations

__all__ = ["cut", "one_line"]

ELLIPSIS = "\u2026"


def cut(text: str, limit: int) -> str:
    """``text`` whole when it has at most ``limit`` characters, else its first ``limit - 1`` and "…"."""
    return text if len(text) <= limit else text[: limit - 1] + ELLIPSIS


def one_line(text: str, limit: int) -> str:
    """``text`` on one line (every run of whitespace, newlines included, made one space) and `cut`."""
    return cut(" ".join(text.split()), limit)
