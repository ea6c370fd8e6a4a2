"""Every option of ``subagent run``, each declared once in :data:`RUN_OPTIONS`: its flags, its key in an
agent's config table, its type and default, its help, and how the command line's value and the config's
merge. The parser's flags (:func:`add_options`), the config's schema and the words of its errors
(:mod:`subagent.cli._config`) and the turn's :class:`~subagent.cli._turn.TurnSpec` (:func:`merge`) are
derived from it.

An option is named once: the parsed flag's attribute, its config key, and the ``TurnSpec`` field it sets
when it sets one as merged. An option may live on the command line only (no :class:`ConfigKey`) or in the
config only (no flags).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import textwrap
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

import msgspec

from subagent.acp.handlers import DEFAULT_PERMISSION_CALLBACK_TIMEOUT
from subagent.cli._exits import UsageError
from subagent.cli._permission import PermissionMode
from subagent.types import CleanupPolicy, IsolationMode

__all__ = [
    "BUDGET_OPTIONS",
    "DEMO_OPTIONS",
    "ISOLATION_OPTIONS",
    "OPTION_KEYS",
    "RUN_OPTIONS",
    "Argument",
    "ConfigKey",
    "Merge",
    "Option",
    "Program",
    "add_options",
    "config_keys_help",
    "merge",
]

# -- the values' types, as the config checks them --------------------------------------------------------

EnvName = Annotated[str, msgspec.Meta(pattern=r"\A[^=\x00]+\Z")]
"""An environment variable's name: what a process can receive (non-empty, no ``=``, no NUL)."""
Argument = Annotated[str, msgspec.Meta(pattern=r"\A[^\x00]*\Z")]
"""A string a process receives (an argument, an environment value): a C string ends at NUL."""
Program = Annotated[str, msgspec.Meta(pattern=r"\A(?=[^\x00]*\Z)\s*\S")]
"""A program or a directory: a non-blank :data:`Argument`. (The lookahead keeps the match linear: a
1 MiB value costs one pass, never a backtracking blow-up.)"""
NonBlank = Annotated[str, msgspec.Meta(pattern=r"\S")]
"""A string with something in it besides white space."""
SSH_OPTION: Final = re.compile(r"[A-Za-z][A-Za-z0-9]*[= ][^\x00\n]*")
"""One ssh ``-o`` option, ``Name=value`` (as in ssh's config file, one line): match it whole."""
SshOption = Annotated[str, msgspec.Meta(pattern=rf"\A{SSH_OPTION.pattern}\Z")]
"""A :data:`SSH_OPTION` in a config file."""
Seconds = Annotated[float, msgspec.Meta(gt=0, le=sys.float_info.max)]
"""A positive, finite number of seconds."""
Count = Annotated[int, msgspec.Meta(ge=0)]
"""A whole number >= 0 (a budget's tokens, tool calls, turns)."""
Amount = Annotated[float, msgspec.Meta(ge=0, le=sys.float_info.max)]
"""A finite number >= 0 (a budget's cost, a price)."""
UsageReport = Literal["tokens", "cost"]
"""What an agent reports of its usage, for the budget caps its provider can enforce."""
BranchPrefix = Annotated[str, msgspec.Meta(pattern=r"\A(?!.*\.\.)[^\x00-\x20~^:?*\[\\\x7f]+\Z")]
"""The start of a git branch name: no space, control character, ``~^:?*[\\`` or ``..``."""
Environment = dict[EnvName, Argument]
"""An agent's ``env`` table: variables merged over the caller's environment."""
Settings = dict[NonBlank, str | bool]
"""Session config options by id: a value id, or true or false."""

# -- the declaration -------------------------------------------------------------------------------------

Merge = Literal["override", "config_first", "command_line_first", "update"]
"""How an option's command-line value and its config value make one:

- ``override``: the command line's if given, else the config's if set, else the option's default;
- ``config_first``, ``command_line_first``: the items of both, in that order;
- ``update``: the config's table with the command line's entries set over it.
"""


@dataclass(frozen=True, slots=True)
class ConfigKey:
    """How an option is written in an agent's config table (``[agents.NAME]``), under the option's name."""

    type: Any
    """The value's type, checked strictly by msgspec, constraints and all."""
    expected: str
    """What the value must be, in the words of an error (``a positive number of seconds``)."""
    item: str | None = None
    """For an array or a table: what each of its items or values must be."""
    bad_name: str | None = None
    """For a table keyed by names: what is wrong with a name its pattern refused."""
    paths: Literal["agent", "local"] | None = None
    """Paths in the value: ``agent`` directories on the agent's host (from the file's directory for a
    local agent; absolute, as written, for one elsewhere), ``local`` a file on this host (from the file's
    directory); ``~`` is expanded where they are resolved."""
    ssh_only: bool = False
    """Only for an agent on ``ssh://``."""


@dataclass(frozen=True, slots=True)
class Option:
    """One option of ``subagent run`` (see the module docstring)."""

    name: str
    """The parsed flag's attribute, the config key, and the ``TurnSpec`` field set to the merged value."""
    flags: tuple[str, ...] = ()
    """Its flags, the long one last; none: it is set in the config only."""
    help: str = ""
    """Its text in ``subagent run --help``."""
    metavar: str | None = None
    action: str | type[argparse.Action] | None = None
    """How argparse takes it: ``store_true``, ``append``, :class:`argparse.BooleanOptionalAction`."""
    parse: Callable[[str], Any] | None = None
    """Turns one word of the command line into a value (argparse's ``type``)."""
    choices: tuple[str, ...] | None = None
    default: Any = None
    """Its value when neither the command line nor the config sets it."""
    config: ConfigKey | None = None
    """Its key in an agent's config table; None: command line only."""
    merge: Merge = "override"
    convert: Callable[[Any, str], Any] | None = None
    """Checks the parsed command-line value and makes it the config's kind (``--set``'s words a table),
    given the flag to name in a :class:`~subagent.cli._exits.UsageError`."""
    demo: bool | str = False
    """Whether ``subagent demo`` takes it too; a string: its help there, where its default differs."""

    @property
    def flag(self) -> str:
        """The long flag, as messages name the option."""
        return self.flags[-1]

    def add_to(self, parser: argparse.ArgumentParser, *, demo: bool = False) -> None:
        """Add its flags to ``parser`` (``demo``: with its help for ``subagent demo``)."""
        settings: dict[str, Any] = {
            "metavar": self.metavar,
            "action": self.action,
            "type": self.parse,
            "choices": self.choices,
        }
        # Absent from the command line reads as None, so the config's value and the default can be told apart.
        parser.add_argument(
            *self.flags,
            dest=self.name,
            default=None,
            help=self.demo if demo and isinstance(self.demo, str) else self.help,
            **{name: value for name, value in settings.items() if value is not None},
        )

    def merged(self, given: Any, configured: Any) -> Any:
        """The value of the command line's ``given`` and the config's ``configured`` (None: absent)."""
        if self.merge == "override":
            return next((value for value in (given, configured) if value is not None), self.default)
        if self.merge == "update":
            return {**(configured or {}), **(given or {})}
        first, then = (configured, given) if self.merge == "config_first" else (given, configured)
        return (*(first or ()), *(then or ()))


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, not {text!r}")
    return value


def _amount(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, not {text!r}")
    return value


def _usage_reports(text: str) -> tuple[UsageReport, ...]:
    """``tokens,cost`` (or ``none``) as the kinds of usage an agent reports."""
    if text.strip() == "none":
        return ()
    words = [word.strip() for word in text.split(",")]
    known = typing.get_args(UsageReport)
    for word in words:
        if word not in known:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(known)} (or none), not {text!r}"
            )
    return tuple(dict.fromkeys(typing.cast(list[UsageReport], words)))


def _branch_prefix(text: str) -> str:
    try:
        return msgspec.convert(text, BranchPrefix)
    except msgspec.ValidationError:
        raise argparse.ArgumentTypeError(f"{_BRANCH_PREFIX}, not {text!r}") from None


def _non_blank(text: str) -> str:
    # An empty name or path names nothing (an empty --trace, the current directory's parent): refused, as
    # the config refuses a blank value for the same keys.
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _settings(given: list[str], flag: str) -> dict[str, str]:
    """``--set ID=VALUE`` words as a table; a later one for the same id wins."""
    settings: dict[str, str] = {}
    for item in given:
        config_id, equals, value = item.partition("=")
        if not equals or not config_id.strip() or not value:
            raise UsageError(f"{flag}: expected ID=VALUE, e.g. model=fast, not {item!r}")
        settings[config_id.strip()] = value
    return settings


def _ssh_options(given: list[str], flag: str) -> tuple[str, ...]:
    for option in given:
        if not SSH_OPTION.fullmatch(option):
            raise UsageError(f"{flag}: expected NAME=VALUE, e.g. ConnectTimeout=20, not {option!r}")
    return tuple(given)


def _writable_file(path: str, flag: str) -> str:
    # Checked before the agent starts: a run is not worth losing to a typo in a path.
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise UsageError(f"{flag}: the directory of {path!r} does not exist")
    return path


_STRING: Final = "a string"
_BRANCH_PREFIX: Final = (
    "must be the start of a git branch name (no space, control character, ~ ^ : ? * [ \\ or ..)"
)
_SECONDS: Final = "a positive number of seconds"

RUN_OPTIONS: Final[tuple[Option, ...]] = (
    Option("prompt", ("-p", "--prompt"), "the prompt (default: read all of stdin)", metavar="TEXT"),
    Option(
        "agent",
        ("--agent",),
        "run the agent named NAME in the config instead of a COMMAND",
        metavar="NAME",
    ),
    Option(
        "config",
        ("--config",),
        "the config file for --agent (default: ./subagent.toml, else $XDG_CONFIG_HOME/subagent/config.toml)",
        metavar="PATH",
    ),
    Option(
        "env",
        config=ConfigKey(
            Environment,
            'a table of strings, e.g. env = { KEY = "value" }',
            item=_STRING,
            bad_name="an environment name must be non-empty, with no '=' and no NUL character",
        ),
    ),
    Option(
        "cwd",
        ("--cwd",),
        "the session's working directory, the only place the agent may read and write through us "
        "(default: the agent's configured cwd, else the current directory)",
        metavar="DIR",
        parse=_non_blank,
        config=ConfigKey(Program, _STRING, paths="agent"),
    ),
    Option(
        "additional_directories",
        ("--add-dir",),
        "one more directory the agent may work in besides the cwd, sent as ACP "
        "additionalDirectories and added to where it may read and write through us (repeatable; after "
        "the agent's `additional_directories` in the config). An agent that does not support them fails "
        "to start (exit 2) rather than run without them",
        metavar="DIR",
        action="append",
        config=ConfigKey(
            list[Program], 'an array of directories, e.g. ["../shared"]', item=_STRING, paths="agent"
        ),
        merge="config_first",
    ),
    Option(
        "permission",
        ("--permission",),
        "how to answer the agent's permission questions "
        "(default: ask when a person can answer on a terminal, else deny; see below)",
        choices=typing.get_args(PermissionMode),
        config=ConfigKey(PermissionMode, "one of 'allow', 'deny', 'ask'"),
        demo="how to answer the agent's permission questions "
        "(default: allow, shown as '(demo)'; ask reads the answer from stdin)",
    ),
    Option(
        "permission_timeout",
        ("--permission-timeout",),
        "with --permission ask, reject a question nobody answered within this time "
        f"(default: {DEFAULT_PERMISSION_CALLBACK_TIMEOUT:g})",
        metavar="SECONDS",
        parse=_seconds,
        default=DEFAULT_PERMISSION_CALLBACK_TIMEOUT,
        demo=True,
    ),
    Option(
        "timeout",
        ("--timeout",),
        "end the turn with stop reason 'timeout' after this long without a word from the agent "
        "(paused while a permission question waits; default: no limit)",
        metavar="SECONDS",
        parse=_seconds,
        config=ConfigKey(Seconds, _SECONDS),
    ),
    Option("ready_timeout", config=ConfigKey(Seconds, _SECONDS)),
    Option(
        "max_tokens",
        ("--max-tokens",),
        "stop the run with stop reason 'budget' (exit 3) once it and its subagents have used more than N "
        "tokens, input plus output (default: the agent's `max_tokens` in the config, else [budget]'s, "
        "else no cap)",
        metavar="N",
        parse=_count,
        config=ConfigKey(Count, "a whole number >= 0"),
    ),
    Option(
        "max_cost",
        ("--max-cost",),
        "likewise once they cost more than X, in the currency the agent reports or the config's "
        "[prices] price it in",
        metavar="X",
        parse=_amount,
        config=ConfigKey(Amount, "a number >= 0"),
    ),
    Option(
        "max_seconds",
        ("--max-seconds",),
        "likewise after S seconds of wall time from the start (unlike --timeout, which counts silence)",
        metavar="S",
        parse=_seconds,
        config=ConfigKey(Seconds, _SECONDS),
    ),
    Option(
        "max_tool_calls",
        ("--max-tool-calls",),
        "likewise once they have made more than N tool calls",
        metavar="N",
        parse=_count,
        config=ConfigKey(Count, "a whole number >= 0"),
    ),
    Option(
        "max_turns",
        ("--max-turns",),
        "likewise once they have made more than N model calls",
        metavar="N",
        parse=_count,
        config=ConfigKey(Count, "a whole number >= 0"),
    ),
    Option(
        "reports_usage",
        ("--reports-usage",),
        "what the agent reports of its usage as it works, tokens, cost or both (comma-separated; none: "
        "nothing), so which caps can be enforced on it; an agent that reports neither cannot run under a "
        "cap (exit 2) (default: the agent's `reports_usage` in the config, else what is known of the agent)",
        metavar="tokens,cost",
        parse=_usage_reports,
        config=ConfigKey(
            list[UsageReport], 'an array of "tokens" and "cost", e.g. ["tokens"]', item='"tokens" or "cost"'
        ),
    ),
    Option(
        "isolation",
        ("--isolation",),
        "run the agent in a workspace of its own, the current working tree untouched: worktree (a git "
        "worktree of the cwd's repository at HEAD, on a new branch subagent/<run id>; what the agent changed "
        "is committed there and the branch printed at the end) or copy (a copy of the cwd, for a directory "
        "outside git) (default: the agent's `isolation` in the config, else [isolation]'s, else none)",
        choices=typing.get_args(IsolationMode),
        config=ConfigKey(IsolationMode, "one of 'worktree', 'copy'"),
    ),
    Option(
        "cleanup",
        ("--cleanup",),
        "with --isolation, what becomes of the workspace at the end: remove (the worktree is removed, its "
        "branch kept if it holds changes; a changed copy is kept), keep (both kept), remove-always (both "
        "removed, changes and all) (default: remove)",
        choices=typing.get_args(CleanupPolicy),
        default="remove",
        config=ConfigKey(CleanupPolicy, "one of 'remove', 'keep', 'remove-always'"),
    ),
    Option(
        "worktree_root",
        ("--worktree-root",),
        "with --isolation, the directory the workspaces are made in (default: the repository's "
        ".git/subagent-worktrees; for copies, the system's temporary directory)",
        metavar="DIR",
        parse=_non_blank,
        config=ConfigKey(Program, _STRING, paths="agent"),
    ),
    Option(
        "branch_prefix",
        ("--branch-prefix",),
        "with --isolation worktree, what the branch's name starts with, before the run id (default: "
        "subagent/)",
        metavar="PREFIX",
        parse=_branch_prefix,
        config=ConfigKey(BranchPrefix, 'the start of a git branch name, e.g. "agent/"'),
    ),
    Option(
        "auth_method",
        ("--auth-method",),
        "the auth method to use if the agent demands authentication",
        metavar="ID",
        parse=_non_blank,
        config=ConfigKey(NonBlank, _STRING),
    ),
    Option(
        "fs",
        ("--fs",),
        "offer the agent our file system (fs/read_text_file, fs/write_text_file, confined to the "
        "cwd). --no-fs offers none, so the agent reads and writes files itself: a workaround for agents "
        "whose use of it is broken, such as Gemini CLI 0.61.0, which cannot create a new file through a "
        "client that offers it (default: the agent's `fs` in the config, else on)",
        action=argparse.BooleanOptionalAction,
        default=True,
        config=ConfigKey(bool, "true or false"),
    ),
    Option(
        "subagents",
        ("--subagents",),
        "advertise ACP's subagents capability, so the agent's own subagents (Claude Code's Task, "
        "Codex's spawn_agent) show in the tree, --events, --json and the trace page with their usage. "
        "--no-subagents: the agent is not told, and shows them its own way (default: the agent's "
        "`subagents` in the config, else on)",
        action=argparse.BooleanOptionalAction,
        default=True,
        config=ConfigKey(bool, "true or false"),
    ),
    Option(
        "mode",
        ("--mode",),
        "switch the session to the agent's mode ID before the prompt (`subagent describe` lists "
        "them); a mode it does not offer fails the start. Without it, under --permission deny or ask, a "
        "session that starts in a mode that approves tool calls by itself is moved to the agent's "
        "asking mode where known, else warned about (default: the agent's `mode` in the config)",
        metavar="ID",
        parse=_non_blank,
        config=ConfigKey(NonBlank, "a mode id (a string)"),
    ),
    Option(
        "config_options",
        ("--set",),
        "set the agent's session config option ID to VALUE before the prompt (a value id, or "
        "true/false for a boolean option); repeatable, over the config's `config_options`",
        metavar="ID=VALUE",
        action="append",
        config=ConfigKey(
            Settings,
            'a table of option ids to values, e.g. { model = "fast", thinking = true }',
            item="a value id (a string) or true or false",
            bad_name="a config option id must not be blank",
        ),
        merge="update",
        convert=_settings,
    ),
    Option(
        "transport",
        ("--on",),
        "where the agent runs: local (default), ssh://[USER@]HOST[:PORT] or ray://ADDRESS; "
        "COMMAND and --cwd are then a program and an absolute directory there, and a remote agent is "
        "offered no fs (default: the agent's `transport` in the config, else local)",
        metavar="URL",
        config=ConfigKey(NonBlank, 'a transport URL, e.g. "ssh://host"'),
    ),
    Option(
        "ssh_config",
        ("--ssh-config",),
        "for an agent on ssh://: the ssh client's config file, read instead of ~/.ssh/config "
        "(ssh -F; default: the agent's `ssh_config` in the config)",
        metavar="FILE",
        parse=_non_blank,
        config=ConfigKey(Program, _STRING, paths="local", ssh_only=True),
    ),
    Option(
        "ssh_options",
        ("--ssh-option",),
        "for an agent on ssh://: one more ssh -o option, e.g. ConnectTimeout=20 (repeatable; "
        "before the config's `ssh_options`, so it wins)",
        metavar="NAME=VALUE",
        action="append",
        config=ConfigKey(
            list[SshOption],
            'an array of ssh options, e.g. ["ConnectTimeout=20"]',
            item='an ssh option, Name=value (e.g. "ConnectTimeout=20")',
            ssh_only=True,
        ),
        merge="command_line_first",
        convert=_ssh_options,
    ),
    Option(
        "json",
        ("--json",),
        "print exactly one JSON object on stdout: output, stopReason, error, usage",
        action="store_true",
        default=False,
        demo=True,
    ),
    Option(
        "events",
        ("--events",),
        "write every session update and lifecycle event as one JSON object per line on stderr",
        action="store_true",
        default=False,
        demo=True,
    ),
    Option(
        "events_file",
        ("--events-file",),
        "also write the --events lines (and the prompt first) to FILE; stderr shows what it would",
        metavar="FILE",
        parse=_non_blank,
        convert=_writable_file,
        demo=True,
    ),
    Option(
        "trace",
        ("--trace",),
        "write the run's trace page (a timeline of its runs, one self-contained HTML file) to "
        "FILE.html when it ends",
        metavar="FILE.html",
        parse=_non_blank,
        convert=_writable_file,
        demo=True,
    ),
    Option(
        "progress",
        ("--progress",),
        "live progress on stderr (default: on when stderr is a terminal; never with --json or --events)",
        action=argparse.BooleanOptionalAction,
        demo="live progress on stderr (default: on; never with --json or --events)",
    ),
    Option(
        "journal",
        ("--journal",),
        "record the run in this run journal, which `subagent runs` lists and `subagent resume` resumes from "
        "(default: $SUBAGENT_JOURNAL, else the config's top-level `journal` key, else "
        "$XDG_STATE_HOME/subagent/runs.db)",
        metavar="PATH",
        parse=_non_blank,
        demo=True,
    ),
    Option(
        "no_journal",
        ("--no-journal",),
        "record nothing in any run journal (as SUBAGENT_JOURNAL=off, or journal = false in the config)",
        action="store_true",
        default=False,
        demo=True,
    ),
)
"""The options of ``subagent run``, in the order ``--help`` lists them and the config documents its keys."""

DEMO_OPTIONS: Final = tuple(option for option in RUN_OPTIONS if option.demo)
"""The options ``subagent demo`` takes too."""

BUDGET_OPTIONS: Final = tuple(option.name for option in RUN_OPTIONS if option.name.startswith("max_"))
"""The options that set a cap of the run's :class:`~subagent.types.Budget`, named like its fields."""

ISOLATION_OPTIONS: Final = ("isolation", "cleanup", "worktree_root", "branch_prefix")
"""The options that say how the run's workspace is isolated (:mod:`subagent.isolation`)."""

OPTION_KEYS: Final = {option.name: option.config for option in RUN_OPTIONS if option.config is not None}
"""The config keys that set options, in documented order."""


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option], *, demo: bool = False) -> None:
    """Add the flags of ``options`` (those with any) to ``parser``."""
    for option in options:
        if option.flags:
            option.add_to(parser, demo=demo)


def merge(
    options: Iterable[Option], given: argparse.Namespace, configured: Mapping[str, Any]
) -> dict[str, Any]:
    """Each option's value by name, from the parsed command line ``given`` and the config's keys
    ``configured`` (those the agent's table sets), as the option merges them.

    Raises:
        UsageError: a command-line value its option refuses.
    """
    values: dict[str, Any] = {}
    for option in options:
        value = getattr(given, option.name, None) if option.flags else None
        if value is not None and option.convert is not None:
            value = option.convert(value, option.flag)
        values[option.name] = option.merged(value, configured.get(option.name))
    return values


def config_keys_help(width: int) -> str:
    """What the keys of an agent's table that set options are, each with its flags, for ``--help``
    (wrapped at ``width`` columns)."""
    keys = [
        f"{option.name} ({'/'.join(_shown_flags(option))})" if option.flags else option.name
        for option in RUN_OPTIONS
        if option.config is not None
    ]
    adding = [option.flag for option in RUN_OPTIONS if option.config and option.merge != "override"]
    text = (
        "Besides command, args and description (shown by `subagent agents`), a key sets the run option "
        f"of its name; its flag, given, wins ({', '.join(adding)} add to it): {', '.join(keys)}. "
        "A relative path is from the file's directory."
    )
    return textwrap.fill(text, width)


def _shown_flags(option: Option) -> list[str]:
    if option.action is argparse.BooleanOptionalAction:
        return [option.flag, "--no-" + option.flag.removeprefix("--")]
    return [option.flag]
