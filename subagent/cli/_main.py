"""The ``subagent`` command line's front: the argument parser, and :func:`main`, which parses
``argv``, runs the command it names with logging set up, and turns every way a command can fail
into a diagnostic on stderr and an exit status (see :mod:`subagent.cli`).

Each command's module is loaded only when a parser needs it: ``subagent runs`` (a listing that must
answer at once on a journal of thousands of runs) loads its own module alone, never the agent
machinery the other commands are built on.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from subagent._version import __version__
from subagent.cli._exits import (
    EXIT_NOT_COMPLETED,
    EXIT_USAGE,
    PROG,
    Command,
    CommandError,
    ConfigError,
    Parser,
    PromptTooLarge,
    UsageError,
    add_verbose,
)

__all__ = ["main"]


def _all_commands() -> dict[str, Command]:
    """Every command, in the order ``subagent --help`` lists them (this loads every command's module)."""
    from subagent.cli._commands import AGENTS_COMMAND, DEMO_COMMAND, RUN_COMMAND
    from subagent.cli._describe import DESCRIBE_COMMAND
    from subagent.cli._recording import TRACE_COMMAND
    from subagent.cli._resume_command import RESUME_COMMAND
    from subagent.cli._runs_command import RUNS_COMMAND
    from subagent.cli._serve_command import SERVE_COMMAND
    from subagent.cli._worktrees_command import WORKTREES_COMMAND

    return {
        "run": RUN_COMMAND,
        "demo": DEMO_COMMAND,
        "agents": AGENTS_COMMAND,
        "describe": DESCRIBE_COMMAND,
        "serve": SERVE_COMMAND,
        "trace": TRACE_COMMAND,
        "worktrees": WORKTREES_COMMAND,
        "runs": RUNS_COMMAND,
        "resume": RESUME_COMMAND,
    }


def _runs_command() -> Command:
    from subagent.cli._runs_command import RUNS_COMMAND

    return RUNS_COMMAND


_LIGHT_COMMANDS: Final[dict[str, Callable[[], Command]]] = {"runs": _runs_command}
"""The commands parsed without loading the others: their parser is the only one built."""


def _main_epilog() -> str:
    from subagent.cli._options import config_keys_help

    return f"""\
config: --agent NAME reads [agents.NAME] from --config PATH, else ./subagent.toml, else
$XDG_CONFIG_HOME/subagent/config.toml (~/.config/subagent/config.toml). Example:

  journal = "~/runs.db"       # the run journal (false: none); before any table
  [agents.claude]
  command = "npx"
  args = ["-y", "@agentclientprotocol/claude-agent-acp"]
  env = {{ ANTHROPIC_LOG = "error" }}
  permission = "ask"          # allow | deny | ask
  timeout = 600               # inactivity timeout, seconds
  cwd = "~/src/project"       # relative to the config file's directory

{config_keys_help(width=96)}

run journal: every run of `run` and `demo` is recorded in a run journal: --journal PATH, else
$SUBAGENT_JOURNAL (off: none), else the config's `journal`, else $XDG_STATE_HOME/subagent/runs.db
(~/.local/state/subagent/runs.db); --no-journal records nothing. `{PROG} runs` lists it, and
`{PROG} resume ID` continues a run that did not complete, in a new agent process.

Run `{PROG} COMMAND --help` for more.
"""


def _build_parser(name: str | None) -> tuple[Parser, dict[str, Parser]]:
    """The parser; with only command ``name``'s own when it is one of :data:`_LIGHT_COMMANDS`."""
    light = _LIGHT_COMMANDS.get(name or "")
    commands_table = {name: light()} if light is not None and name is not None else _all_commands()
    parser = Parser(
        prog=PROG,
        description="Delegate work to another AI agent over the Agent Client Protocol (ACP).",
        epilog=None if light is not None else _main_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_verbose(parser)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True, parser_class=Parser)
    subparsers = {name: command.add_parser(commands, name) for name, command in commands_table.items()}
    parser.set_defaults(_commands=commands_table)
    return parser, subparsers


def _split_command(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """The arguments before the first ``--``, and the agent command after it (None without ``--``)."""
    if "--" not in argv:
        return list(argv), None
    index = list(argv).index("--")
    return list(argv[:index]), list(argv[index + 1 :])


def _command_name(before: Sequence[str]) -> str | None:
    """The command ``before`` names: its first word that is not an option (the top level's options
    take no value); None when the top level's help is asked for first."""
    for arg in before:
        if arg in ("-h", "--help"):
            return None
        if not arg.startswith("-"):
            return arg
    return None


@dataclass(slots=True)
class _Invocation:
    parser: Parser
    subparsers: dict[str, Parser] = field(default_factory=dict)
    name: str | None = None

    def usage_error(self, message: str) -> int:
        parser = self.subparsers.get(self.name or "", self.parser)
        sys.stderr.write(parser.format_usage())
        sys.stderr.write(f"{parser.prog}: error: {message}\n")
        sys.stderr.flush()
        return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``) and return its exit status."""
    before, command = _split_command(sys.argv[1:] if argv is None else argv)
    parser, subparsers = _build_parser(_command_name(before))
    invocation = _Invocation(parser, subparsers)
    invocation.name = next((arg for arg in before if arg in subparsers), None)
    try:
        args = parser.parse_args(before)
    except UsageError as exc:
        return invocation.usage_error(str(exc))
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else 0
    invocation.name = args.subcommand
    from subagent.cli._logs import configure_logging

    restore_logging = configure_logging(getattr(args, "verbose", 0))
    try:
        chosen: Command = args._commands[args.subcommand]
        return chosen.run(args, command)
    except UsageError as exc:
        return invocation.usage_error(str(exc))
    except ConfigError as exc:
        sys.stderr.write(f"{PROG}: invalid config: {exc}\n")
        return EXIT_USAGE
    except (PromptTooLarge, CommandError) as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Only outside a turn (a turn handles its own signals): e.g. while reading the prompt.
        sys.stderr.write(f"\n{PROG}: interrupted\n")
        return EXIT_NOT_COMPLETED
    finally:
        restore_logging()
