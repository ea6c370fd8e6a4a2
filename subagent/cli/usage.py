"""How the command line ends: its exit statuses, and the errors that end it with status 2.

:class:`UsageError` is reported like argparse reports bad usage (the usage line, then
``subagent COMMAND: error: ...``); :class:`Parser` raises it instead of exiting, so ``main``
reports every usage error the same way and returns a status instead of calling ``sys.exit``.
"""

from __future__ import annotations

import argparse
from typing import Final, NoReturn

__all__ = [
    "EXIT_COMPLETED",
    "EXIT_NOT_COMPLETED",
    "EXIT_USAGE",
    "PROG",
    "Parser",
    "PromptTooLarge",
    "UsageError",
]

PROG: Final = "subagent"
"""The program's name in usage lines and diagnostics."""

EXIT_COMPLETED: Final = 0
"""The turn completed."""
EXIT_NOT_COMPLETED: Final = 1
"""The turn ended any other way: refused, cut short, failed, timed out, cancelled or interrupted."""
EXIT_USAGE: Final = 2
"""Bad usage, a bad config, or an agent that failed to start."""


class UsageError(Exception):
    """Bad usage found after argparse: reported like argparse does, exit status 2."""


class PromptTooLarge(Exception):
    """A prompt too large to send to any agent: one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser that raises :class:`UsageError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        """Raise ``message`` as a :class:`UsageError`."""
        raise UsageError(message)
