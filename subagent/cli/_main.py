"""The ``subagent`` command line's front: the argument parser, and :func:`main`, which parses
``argv``, runs the command it names with logging set up, and turns every way a command can fail
into a diagnostic on stderr and an exit status (see :mod:`subagent.cli`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from subagent._version import __version__
from subagent.cli._commands import MAX_PROMPT_MIB, agents_command, demo_command, run_command
from subagent.cli._config import ConfigError
from subagent.cli._describe import DESCRIBE_COMMAND
from subagent.cli._exits import (
    EXIT_NOT_COMPLETED,
    EXIT_USAGE,
    PROG,
    Command,
    Parser,
    PromptTooLarge,
    UsageError,
    add_verbose,
)
from subagent.cli._logs import configure_logging
from subagent.cli._options import DEMO_OPTIONS, RUN_OPTIONS, add_options, config_keys_help
from subagent.cli._recording import TRACE_COMMAND
from subagent.cli._serve_command import SERVE_COMMAND
from subagent.cli._worktrees_command import WORKTREES_COMMAND
from subagent.observability._trace_page import MAX_TEXT_CHARS

__all__ = ["main"]

_RUN_DESCRIPTION: Final = """\
Run one prompt through an ACP agent and print its final answer on stdout.

The agent is COMMAND ARGS... after `--` (started with no shell, in its own process group), or a
named agent from the config with --agent NAME. The prompt is -p TEXT, or else all of stdin.
"""

_RUN_EPILOG: Final = f"""\
permission questions (--permission):
  allow   allow every tool call the agent asks about
  deny    reject every one
  ask     show the question on stderr (a permission_request event with --events) and read
          the answer from stdin when the prompt came from -p, else from /dev/tty: the
          option's number, id or name, or y/n. Anything else, end of input, no terminal,
          and no answer within --permission-timeout reject.
  The default is ask when that answer comes from a terminal and stderr is one, else deny.
  The policy holds for the agent's writes through our file system too: under deny each one
  is refused, under ask one that no answer in the turn covers is asked about. An agent that
  writes files itself, in a mode that approves by itself, is beyond any client's reach: under
  deny and ask such a session is moved to the agent's asking mode where it is known, else
  a warning names the mode (choose one with --mode).

output:
  stdout gets only the final answer (the agent's text after its last tool call), or with
  --json exactly one object: {{"output", "stopReason", "error", "usage"}} (an agent that
  fails to start gets one too, with stopReason "error"; bad usage gets none), and
  "subtreeUsage" too when the agent's subagents reported what they spent (subagent serve's
  do; Codex says only its subagents' context window, Claude Code nothing of theirs): what
  the whole tree used, the agent's own usage included; and "runs", each run of that tree
  as last reported ({{"runId", "parentId", "provider", "depth", "state", "title"}}, and
  once ended "stopReason", "elapsedSeconds" and "usage" where the agent said any).
  Live progress goes to stderr when stderr is a terminal: the answer as it streams, tool
  calls as their status changes, the plan, thoughts dimmed, permission decisions; never
  with --json or --events. Colour only on a terminal and without NO_COLOR.
  --events writes one JSON object per line on stderr instead: spawn, start, update (the ACP
  session/update params, camelCase as on the wire), run, permission_request, permission,
  interrupt, start_failed, end, and log.
  --events-file FILE writes those lines to FILE (after a `prompt` line: the prompt's first
  {MAX_TEXT_CHARS:,} characters and its length) while stderr shows what it would without it.
  --trace FILE.html records them and writes the trace page when the run ends, however it
  ends: one self-contained HTML file (no network) with the run and its subagent tree on a
  timeline; `{PROG} trace EVENTS.jsonl -o FILE.html` makes it from an --events-file.

exit status:
  0 the turn completed; 1 it ended any other way (refusal, max_tokens, max_turns, timeout,
  error, cancelled); 2 bad usage, a bad config, a prompt too large to send (over {MAX_PROMPT_MIB} MiB as
  one JSON message; no agent is started), the agent failed to start (the message names
  the command, its exit status and the tail of its stderr), a --max-* cap the agent cannot
  be held to (it does not report what the cap counts), or the --trace page could not be
  written; 3 the turn was stopped by its budget (stop reason "budget": a --max-* cap was
  passed; the message names the cap, what was spent and whose budget it was).

budget:
  --max-tokens, --max-cost, --max-seconds, --max-tool-calls and --max-turns cap what the run
  and its subagents spend together (the agent's keys of those names in the config, else
  the config's [budget] table, when not given). At the end stderr says what was spent beside
  each cap ("subagent: budget: 1,234 of 10,000 tokens"); --json adds "outputFinal",
  "budget" (the caps, by name), "spent" ({{"tokens", "cost", "costCurrency", "seconds",
  "toolCalls", "turns"}}) and "limit" (the cap that stopped it: {{"limit", "allowed",
  "spent", "owner", "needed"}}, else null), and so does the end event of --events.

isolation:
  --isolation worktree runs the agent in a git worktree of the cwd's repository, made at HEAD on a
  new branch (subagent/<run id>; --branch-prefix) inside .git/subagent-worktrees (--worktree-root),
  so the working tree you are in is never touched; --isolation copy gives it a copy of the cwd
  instead (a directory outside git). At the end what the agent left uncommitted is committed on its
  branch, and stderr says where the changes are and which files changed ("subagent: workspace: its
  changes are on branch subagent/acp-1 (commit ..., over ...): 1 file(s) changed: a.py (+3 -1)"),
  then how to take or drop them; --json adds "workspace" ({{"mode", "path", "changed", "branch",
  "base", "commit", "removed", "files": [{{"path", "added", "deleted"}}]}}), and so does the end
  event of --events. Merging is yours to do. --cleanup remove (the default) removes the worktree and
  keeps the branch when it holds changes; keep keeps both; remove-always removes both. The exit
  status is as without isolation. A workspace whose owner was killed is recovered by the next run in
  the same repository, or by `{PROG} worktrees --prune`; `{PROG} worktrees` lists them all. An
  agent --on ssh://HOST is isolated on that host: the repository is the one at --cwd there, and
  its workspace and branch are made there (with the host's python3) before the agent starts.

interrupts:
  Ctrl-C once cancels the turn (session/cancel; an agent that ignores it is torn down after
  a grace of a few seconds) and exits 1 with stop reason "cancelled". Ctrl-C again kills
  the agent and every process it started at once (SIGKILL, no grace; exit 1), even while
  a teardown is waiting for it; an agent --on another host gets SIGTERM, then SIGKILL
  a second later, from its supervisor there. SIGTERM and SIGHUP do the same as a second
  Ctrl-C (SIGKILL, no grace; exit 1 with stop reason "cancelled", the error naming the signal).

examples:
  {PROG} run -p "Summarise README.md" -- npx @agentclientprotocol/claude-agent-acp
  git diff | {PROG} run --agent claude --json --permission deny
"""

_MAIN_EPILOG: Final = f"""\
config: --agent NAME reads [agents.NAME] from --config PATH, else ./subagent.toml, else
$XDG_CONFIG_HOME/subagent/config.toml (~/.config/subagent/config.toml). Example:

  [agents.claude]
  command = "npx"
  args = ["-y", "@agentclientprotocol/claude-agent-acp"]
  env = {{ ANTHROPIC_LOG = "error" }}
  permission = "ask"          # allow | deny | ask
  timeout = 600               # inactivity timeout, seconds
  cwd = "~/src/project"       # relative to the config file's directory

{config_keys_help(width=96)}
Run `{PROG} COMMAND --help` for more.
"""


def _add_run_arguments(run: Parser) -> None:
    add_options(run, RUN_OPTIONS)


def _add_demo_arguments(demo: Parser) -> None:
    demo.add_argument(
        "--scenario",
        metavar="FILE",
        help="give the stub agent this scenario file instead of its default "
        "(the format: python -m pydoc subagent.testing._scenario)",
    )
    demo.add_argument(
        "--only",
        choices=("acp", "delegation"),
        help="run one part: the stub ACP agent's turn, or an in-process agent delegating to fork, spawn "
        "and acp at once (default: both, in that order)",
    )
    add_options(demo, DEMO_OPTIONS, demo=True)


def _add_agents_arguments(agents: Parser) -> None:
    agents.add_argument("--config", metavar="PATH", help="read this config file instead of looking for one")
    agents.add_argument("--json", action="store_true", help="print the list as one JSON object")


_COMMANDS: Final[dict[str, Command]] = {
    "run": Command(
        help="run one prompt through an ACP agent and print its answer",
        description=_RUN_DESCRIPTION,
        epilog=_RUN_EPILOG,
        usage=f"{PROG} run [OPTIONS] (-- COMMAND [ARGS...] | --agent NAME)",
        add_arguments=_add_run_arguments,
        run=run_command,
    ),
    "demo": Command(
        help="a full turn against the bundled stub agent: no network, no keys",
        description="Run a full turn against the bundled stub ACP agent, through the same code as `run`, "
        "with live progress on stderr and the final answer on stdout. The agent's permission question is "
        "allowed automatically, shown as '(demo)', unless --permission is given. No network, no keys; "
        "exit status as for `run`.",
        add_arguments=_add_demo_arguments,
        run=demo_command,
    ),
    "agents": Command(
        help="list the agents named in the config",
        description="List the agents configured for `run --agent NAME`: name, command line and source file. "
        "See `subagent --help` for the config format.",
        add_arguments=_add_agents_arguments,
        run=agents_command,
    ),
    "describe": DESCRIBE_COMMAND,
    "serve": SERVE_COMMAND,
    "trace": TRACE_COMMAND,
    "worktrees": WORKTREES_COMMAND,
}
"""Every command, in the order ``subagent --help`` lists them."""


def _build_parser() -> tuple[Parser, dict[str, Parser]]:
    parser = Parser(
        prog=PROG,
        description="Delegate work to another AI agent over the Agent Client Protocol (ACP).",
        epilog=_MAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_verbose(parser)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True, parser_class=Parser)

    subparsers = {name: command.add_parser(commands, name) for name, command in _COMMANDS.items()}
    return parser, subparsers


def _split_command(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """The arguments before the first ``--``, and the agent command after it (None without ``--``)."""
    if "--" not in argv:
        return list(argv), None
    index = list(argv).index("--")
    return list(argv[:index]), list(argv[index + 1 :])


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
    parser, subparsers = _build_parser()
    invocation = _Invocation(parser, subparsers)
    invocation.name = next((arg for arg in before if arg in subparsers), None)
    try:
        args = parser.parse_args(before)
    except UsageError as exc:
        return invocation.usage_error(str(exc))
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else 0
    invocation.name = args.subcommand
    restore_logging = configure_logging(getattr(args, "verbose", 0))
    try:
        return _COMMANDS[args.subcommand].run(args, command)
    except UsageError as exc:
        return invocation.usage_error(str(exc))
    except ConfigError as exc:
        sys.stderr.write(f"{PROG}: invalid config: {exc}\n")
        return EXIT_USAGE
    except PromptTooLarge as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Only outside a turn (a turn handles its own signals): e.g. while reading the prompt.
        sys.stderr.write(f"\n{PROG}: interrupted\n")
        return EXIT_NOT_COMPLETED
    finally:
        restore_logging()
