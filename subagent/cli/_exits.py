"""How the command line is declared and how it ends: its commands, its exit statuses, and the errors
that end it with status 2. Light on purpose: ``subagent runs`` loads this and little else.

Each command is one :class:`Command` (its help texts, its flags, what runs it), and the parser is built
from the table of them, so every command's parser is made the same way.

:class:`UsageError` is reported like argparse reports bad usage (the usage line, then
``subagent COMMAND: error: ...``); :class:`Parser` raises it instead of exiting, so ``main``
reports every usage error the same way and returns a status instead of calling ``sys.exit``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NoReturn

__all__ = [
    "EXIT_BUDGET",
    "EXIT_COMPLETED",
    "EXIT_NOT_COMPLETED",
    "EXIT_USAGE",
    "PROG",
    "VERBOSE_HELP",
    "Command",
    "CommandError",
    "ConfigError",
    "Parser",
    "PromptTooLarge",
    "UsageError",
    "add_verbose",
]

PROG: Final = "subagent"
"""The program's name in usage lines and diagnostics."""

EXIT_COMPLETED: Final = 0
"""The turn completed."""
EXIT_NOT_COMPLETED: Final = 1
"""The turn ended any other way: refused, cut short, failed, timed out, cancelled or interrupted."""
EXIT_USAGE: Final = 2
"""Bad usage, a bad config, or an agent that failed to start."""
EXIT_BUDGET: Final = 3
"""The turn was stopped by its budget (stop reason ``budget``): a ``--max-*`` cap was passed."""


class UsageError(Exception):
    """Bad usage found after argparse: reported like argparse does, exit status 2."""


class PromptTooLarge(Exception):
    """A prompt too large to send to any agent: one line on stderr, exit status 2."""


class CommandError(Exception):
    """A command that cannot go on (a run journal that cannot be opened, a run that cannot be resumed):
    one line on stderr, ``subagent: <message>``, exit status 2."""


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and, when it applies, the key."""

    def __init__(self, path: str | os.PathLike[str], message: str, *, key: str | None = None) -> None:
        self.path = Path(path)
        self.key = key
        where = f"{self.path}: {key}" if key is not None else f"{self.path}"
        super().__init__(f"{where}: {message}")


class Parser(argparse.ArgumentParser):
    """An argument parser that raises :class:`UsageError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        """Raise ``message`` as a :class:`UsageError`."""
        raise UsageError(message)


VERBOSE_HELP: Final = "log to stderr: -v what happens, -vv debug detail (as `log` events with --events)"
"""The ``-v`` flag's help, unless a command says what its log holds."""


def add_verbose(parser: argparse.ArgumentParser, help: str = VERBOSE_HELP) -> None:
    """Add ``-v``/``--verbose`` (counted; absent from the namespace unless given) to ``parser``."""
    parser.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help=help)


@dataclass(frozen=True, slots=True)
class Command:
    """One ``subagent COMMAND``: how ``--help`` shows it, the flags it takes, and what runs it."""

    help: str
    """Its line in ``subagent --help``."""
    description: str
    """The text above its flags in ``subagent COMMAND --help``."""
    add_arguments: Callable[[Parser], None]
    """Adds its flags (all but ``-v``, which every command takes) to its parser."""
    run: Callable[[argparse.Namespace, list[str] | None], int]
    """Runs it with the parsed flags and the agent command after ``--`` (None without one)."""
    epilog: str | None = None
    """Pre-formatted text below the flags; with one, the description is shown as written too."""
    usage: str | None = None
    """The usage line, when argparse's own would not say it well."""
    verbose_help: str = VERBOSE_HELP
    """The ``-v`` flag's help."""

    def add_parser(self, commands: argparse._SubParsersAction[Parser], name: str) -> Parser:
        """Add this command to ``commands`` as ``name`` and return its parser."""
        # An epilog here is laid out by hand, and argparse then keeps the description as written too.
        formatter = argparse.HelpFormatter if self.epilog is None else argparse.RawDescriptionHelpFormatter
        parser: Parser = commands.add_parser(
            name,
            help=self.help,
            description=self.description,
            epilog=self.epilog,
            usage=self.usage,
            formatter_class=formatter,
        )
        self.add_arguments(parser)
        add_verbose(parser, self.verbose_help)
        return parser
