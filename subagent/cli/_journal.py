"""Which run journal (:mod:`subagent.journal`) a command keeps, and opening it.

Every command that runs agents records them in a run journal, and ``subagent runs`` and ``subagent resume``
read it. Which one, first match wins:

1. ``--journal PATH``, or ``--no-journal`` for none;
2. the ``SUBAGENT_JOURNAL`` environment variable: a path, or ``off`` for none (empty: unset);
3. the config file's top-level ``journal`` key (a path from the file's directory, or ``false``), in the
   file ``--config`` names, else the first found (``./subagent.toml``, the user's config);
4. ``$XDG_STATE_HOME/subagent/runs.db`` (``~/.local/state/subagent/runs.db``).

A journal that cannot be opened (not a journal, written by a newer release, unwritable) ends the command
with exit status 2 and the journal's message, before any agent is started.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from subagent.cli._config_file import find_config, journal_key, read_config_data
from subagent.cli._exits import PROG, CommandError, UsageError
from subagent.journal import JOURNAL_ENV, JournalError, RunJournal, default_journal_path

__all__ = ["JOURNAL_OFF", "JournalChoice", "choose_journal", "journal_exists", "open_journal"]

JOURNAL_OFF: Final = "off"
"""What ``SUBAGENT_JOURNAL`` says for no journal."""

JournalSource = Literal["--journal", "--no-journal", "SUBAGENT_JOURNAL", "config", "default"]


@dataclass(frozen=True, slots=True)
class JournalChoice:
    """The run journal a command keeps, and what chose it."""

    path: str | None
    """Its path, absolute (None: no journal)."""
    source: JournalSource
    """What chose it: a flag, the environment variable, the config file, or the default."""

    def resume_command(self, journal_id: str) -> str:
        """The command that resumes run ``journal_id`` of this journal; it names the journal when the
        command line or a config file (which another directory may not find) chose it."""
        command = f"{PROG} resume {journal_id}"
        if self.path is not None and self.source in ("--journal", "config"):
            command += f" --journal {shlex.quote(self.path)}"
        return command


def choose_journal(
    flag: str | None,
    off: bool,
    *,
    explicit_config: str | None = None,
    configured: str | Literal[False] | None = None,
    config_read: bool = False,
) -> JournalChoice:
    """The journal a command keeps: ``flag`` (``--journal``), ``off`` (``--no-journal``), the environment,
    the config's ``journal`` key, else the default. ``config_read``: ``configured`` is the config's key as
    the command already read it (``run --agent``); otherwise the config file (``explicit_config``, else the
    first found) is read for it, only when neither the flags nor the environment decided.

    Raises:
        UsageError: both ``--journal`` and ``--no-journal``.
        ConfigError: the config file cannot be read, or its ``journal`` key is not a path or a boolean.
    """
    if flag is not None and off:
        raise UsageError("give either --journal PATH or --no-journal, not both")
    if off:
        return JournalChoice(None, "--no-journal")
    if flag is not None:
        return JournalChoice(_absolute(flag), "--journal")
    variable = os.environ.get(JOURNAL_ENV, "")
    if variable.strip():
        if variable.strip().lower() == JOURNAL_OFF:
            return JournalChoice(None, "SUBAGENT_JOURNAL")
        return JournalChoice(_absolute(variable), "SUBAGENT_JOURNAL")
    if not config_read:
        location = find_config(explicit_config)
        if location is not None:
            configured = journal_key(read_config_data(location).get("journal"), location)
    if configured is False:
        return JournalChoice(None, "config")
    if configured is not None:
        return JournalChoice(configured, "config")
    return JournalChoice(str(default_journal_path()), "default")


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def open_journal(choice: JournalChoice) -> RunJournal | None:
    """The chosen journal, opened (created when absent); None for no journal. Blocking.

    Raises:
        CommandError: it cannot be opened (the journal's own message: not a journal, a newer schema,
            unreadable or unwritable).
    """
    if choice.path is None:
        return None
    try:
        return RunJournal.open(choice.path)
    except JournalError as exc:
        raise CommandError(str(exc)) from None


def journal_exists(choice: JournalChoice) -> bool:
    """Whether the chosen journal's file exists (a command that only reads it creates none)."""
    return choice.path is not None and Path(choice.path).exists()
