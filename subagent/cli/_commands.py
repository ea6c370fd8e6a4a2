"""The commands ``run``, ``demo`` and ``agents``: from parsed options to a turn, a report, or a list.

``run`` and the first half of ``demo`` merge options, config and defaults into a
:class:`~subagent.cli._turn.TurnSpec` (as :data:`~subagent.cli._options.RUN_OPTIONS` declares), drive the
turn on the view the options ask for, and print its outcome: the answer (or one JSON object) on stdout,
diagnostics on stderr, and an exit status. ``serve`` lives in :mod:`subagent.cli._serve_command`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import logging
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import anyio

from subagent._budget_codec import budget_to_json, limit_to_json, spend_to_json
from subagent._usage_codec import usage_to_acp
from subagent._workspace_codec import workspace_to_json
from subagent.acp.connection import DEFAULT_MAX_LINE_BYTES
from subagent.acp.transports._channel import Transport
from subagent.acp.transports._schemes import transport_from_url
from subagent.acp.transports._ssh import SshTransport
from subagent.cli._config import AgentConfig, Config, config_search_path, find_config, load_config
from subagent.cli._console import Console, is_terminal, print_json, print_stdout, use_color
from subagent.cli._exits import (
    EXIT_BUDGET,
    EXIT_COMPLETED,
    EXIT_NOT_COMPLETED,
    EXIT_USAGE,
    PROG,
    Command,
    Parser,
    PromptTooLarge,
    UsageError,
)
from subagent.cli._journal import JournalChoice, choose_journal, open_journal
from subagent.cli._logs import LOG_HANDLER
from subagent.cli._options import DEMO_OPTIONS, RUN_OPTIONS, add_options, merge
from subagent.cli._permission import AnswerSource, PermissionMode, answer_source, default_permission
from subagent.cli._recording import FanOut, TraceRecorder, emit_prompt, write_page
from subagent.cli._turn import CLI_META_KEY, TurnOutcome, TurnSpec, drive
from subagent.cli._views import EventView, HumanView, RunView
from subagent.journal import RunJournal
from subagent.observability._trace_page import MAX_TEXT_CHARS
from subagent.providers.acp import prompt_size_error
from subagent.types import CleanupPolicy, WorkspaceChange

__all__ = [
    "AGENTS_COMMAND",
    "DEMO_COMMAND",
    "DEMO_PROMPT",
    "MAX_PROMPT_MIB",
    "RUN_COMMAND",
    "agents_command",
    "check_output_options",
    "config_and_agent",
    "configured_agent",
    "demo_command",
    "execute_turn",
    "progress_wanted",
    "run_command",
    "transport_named",
    "turn_spec",
    "with_ssh_options",
    "workspace_lines",
]

logger = logging.getLogger(__name__)

DEMO_PROMPT: Final = "Summarise README.md and write the summary to SUMMARY.md."
"""What ``subagent demo`` asks the stub agent (which answers from its scenario regardless)."""

MAX_PROMPT_MIB: Final = DEFAULT_MAX_LINE_BYTES // (1024 * 1024)
"""The largest prompt, in MiB, as one ``session/prompt`` message (the connection's line limit)."""

_REAL_AGENT_HINT: Final = "subagent run -- npx @agentclientprotocol/claude-agent-acp"
"""Where the demo points a user next."""


def check_output_options(args: argparse.Namespace) -> None:
    if args.progress and (args.json or args.events):
        raise UsageError("--progress cannot be combined with --json or --events")


def _read_prompt_from_stdin() -> str:
    stream = sys.stdin
    if stream is None:
        return ""
    if stream.isatty():
        sys.stderr.write(f"{PROG}: reading the prompt from the terminal; finish it with Ctrl-D\n")
        sys.stderr.flush()
    limit = DEFAULT_MAX_LINE_BYTES
    data = stream.buffer.read(limit + 1)
    if len(data) > limit:
        # Each byte read is at least a byte of the message: the rest need not be read, nor held.
        raise PromptTooLarge(
            f"the prompt on stdin is more than {limit:,} bytes, over the {limit:,}-byte "
            f"({MAX_PROMPT_MIB} MiB) limit on one message to the agent (max_line_bytes)"
        )
    return data.decode("utf-8", errors="replace")


def run_command(args: argparse.Namespace, command: list[str] | None) -> int:
    """``subagent run``: one prompt through the agent ``command`` (or ``--agent NAME``); its exit status."""
    check_output_options(args)
    agent: AgentConfig | None = None
    if args.agent is not None and command is not None:
        raise UsageError("give either --agent NAME or `-- COMMAND [ARGS...]`, not both")
    if args.agent is None and not command:
        raise UsageError(
            "no agent to run: put its command after `--` (e.g. `subagent run -- npx "
            "@agentclientprotocol/claude-agent-acp`) or name a configured one with --agent NAME"
        )
    config: Config | None = None
    if args.agent is not None:
        config, agent = config_and_agent(args.agent, args.config)
        command = list(agent.command)
    assert command
    # The file's [budget] caps and [isolation] settings hold for every agent of it, under the agent's own
    # keys of those names.
    settings = (
        {**config.budget, **config.isolation, **agent.options}
        if config is not None and agent is not None
        else {}
    )
    values = merge(RUN_OPTIONS, args, settings)
    journal = choose_journal(
        values["journal"],
        values["no_journal"],
        explicit_config=args.config,
        configured=config.journal if config is not None else None,
        config_read=config is not None,
    )
    transport = with_ssh_options(
        transport_named(values["transport"]), values["ssh_config"], values["ssh_options"]
    )
    cwd = values["cwd"]
    if cwd is not None:
        cwd = _agent_directory(cwd, "--cwd" if args.cwd is not None else _configured("cwd", agent), transport)
    if args.fs and not transport.local_files:
        raise UsageError(f"--fs: an agent on {transport.name} cannot be offered this host's files")
    worktree_root = _isolation_values(args, values, transport)
    # The config's directories come first (the option's merge): the rest are --add-dir's.
    configured = len(agent.options.get("additional_directories", ())) if agent else 0
    additional_directories = tuple(
        _agent_directory(
            path,
            _configured("additional_directories", agent) if index < configured else "--add-dir",
            transport,
        )
        for index, path in enumerate(values["additional_directories"])
    )
    prompt = values["prompt"] if values["prompt"] is not None else _read_prompt_from_stdin()
    if not prompt.strip():
        raise UsageError("the prompt is empty: pass -p TEXT or pipe the prompt on stdin")
    too_large = prompt_size_error(prompt)
    if too_large is not None:
        # Refused before an agent is spawned: it could not be sent to one.
        raise PromptTooLarge(too_large)
    answers = answer_source(prompt_from_stdin=values["prompt"] is None)
    permission: PermissionMode = values["permission"] or default_permission(answers)
    if permission != "ask" and answers is not None:
        answers.close()
        answers = None
    spec = turn_spec(
        values,
        command=command,
        prompt=prompt,
        cwd=cwd or os.getcwd(),
        additional_directories=additional_directories,
        permission=permission,
        answers=answers,
        transport=transport,
        progress=progress_wanted(values, default=is_terminal(sys.stderr)),
        prices=config.prices if config is not None else None,
        worktree_root=worktree_root,
        journal=journal,
        metadata={CLI_META_KEY: _cli_metadata(values, agent)},
    )
    return _execute(spec)


def _cli_metadata(values: Mapping[str, Any], agent: AgentConfig | None) -> dict[str, Any]:
    """What ``subagent resume`` needs to run the agent again as this command does, beside what the
    journal keeps of it (its command, transport and cwd): the configured agent it came from (whose
    environment, never journaled, the config gives again), and the provider's settings."""
    reports_usage = values["reports_usage"]
    return {
        "agent": agent.name if agent is not None else None,
        "config": str(agent.source.resolve()) if agent is not None else None,
        "permission": values["permission"],  # as given: a default is chosen again where it resumes
        "fs": values["fs"],
        "subagents": values["subagents"],
        "mode": values["mode"],
        "configOptions": dict(values["config_options"]),
        "authMethod": values["auth_method"],
        "readyTimeout": values["ready_timeout"],
        "reportsUsage": None if reports_usage is None else list(reports_usage),
        "sshConfig": values["ssh_config"],
        "sshOptions": list(values["ssh_options"]),
    }


def _isolation_values(
    args: argparse.Namespace, values: Mapping[str, Any], transport: Transport
) -> str | None:
    """Check the isolation flags (those of the workspace need ``--isolation``) and return the workspaces'
    directory: ``--worktree-root`` made absolute here, as the config's is from its file's directory."""
    if values["isolation"] is None:
        given = [
            flag
            for flag, value in (
                ("--cleanup", args.cleanup),
                ("--worktree-root", args.worktree_root),
                ("--branch-prefix", args.branch_prefix),
            )
            if value is not None
        ]
        if given:
            raise UsageError(f"{', '.join(given)}: only with --isolation worktree or copy")
        return None
    root: str | None = values["worktree_root"]
    if root is None or args.worktree_root is None:
        return root
    if not transport.local_files:
        if not os.path.isabs(root):
            raise UsageError(f"--worktree-root: {root!r} must be an absolute path on {transport.name}")
        return root
    return os.path.abspath(os.path.expanduser(root))


_SPEC_FIELDS: Final = frozenset(field.name for field in dataclasses.fields(TurnSpec))


def turn_spec(values: Mapping[str, Any], **computed: Any) -> TurnSpec:
    """The turn's spec: each option's merged value where a field is named after it, but for the fields
    the command made of them (a checked cwd, a transport) or of nothing of the command line's."""
    return TurnSpec(**{name: value for name, value in values.items() if name in _SPEC_FIELDS} | computed)


def _configured(key: str, agent: AgentConfig | None) -> str:
    """How an error names the config key ``key`` of ``agent``."""
    assert agent is not None
    return f"{key} of agent {agent.name!r} in {agent.source}"


def _agent_directory(path: str, where: str, transport: Transport) -> str:
    """``path``, a directory the agent works in: here, an existing one made absolute (relative to the
    current directory); on another host, absolute and as written. ``where`` names it in a usage error."""
    if not transport.local_files:
        # A directory on the agent's host: it cannot be checked, nor resolved, from here.
        if not os.path.isabs(path):
            raise UsageError(f"{where}: {path!r} must be an absolute path on {transport.name}")
        return path
    if not os.path.isdir(path):
        raise UsageError(f"{where}: {path!r} is not a directory")
    return os.path.abspath(path)


def transport_named(url: str | None) -> Transport:
    """Where the agent runs: ``--on URL``, else the configured agent's ``transport``, else here."""
    try:
        return transport_from_url(url)
    except ValueError as exc:
        # A configured URL was checked when the config was read: this is --on's.
        raise UsageError(f"--on: {exc}") from None


def with_ssh_options(transport: Transport, config_file: str | None, options: Sequence[str]) -> Transport:
    """The transport with ``--ssh-config``/``--ssh-option`` (over the agent's ``ssh_config`` and
    ``ssh_options``) applied, when it is SSH; a usage error when it is not and they were given."""
    if not options and config_file is None:
        return transport
    if not isinstance(transport, SshTransport):
        raise UsageError(f"--ssh-config, --ssh-option: for an agent on ssh://HOST, not {transport.name}")
    # A URL gives host, user and port only: the rest is the transport's defaults.
    return SshTransport(
        transport.host,
        user=transport.user,
        port=transport.port,
        ssh_options=[*transport.ssh_options, *(arg for option in options for arg in ("-o", option))],
        config_file=config_file if config_file is not None else transport.config_file,
    )


def progress_wanted(values: Mapping[str, Any], *, default: bool) -> bool:
    if values["json"] or values["events"]:
        return False
    return default if values["progress"] is None else bool(values["progress"])


def demo_command(args: argparse.Namespace, command: list[str] | None) -> int:
    """``subagent demo``: a turn against the bundled stub agent, then the in-process delegation demo."""
    check_output_options(args)
    if command is not None:
        raise UsageError(
            "demo runs the bundled stub agent and takes no `-- COMMAND`; use `subagent run` for that"
        )
    stub = [sys.executable, "-m", "subagent.testing.stub_agent"]
    if args.scenario is not None:
        if not os.path.isfile(args.scenario):
            raise UsageError(f"--scenario: {args.scenario!r} is not a file")
        stub += ["--scenario", os.path.abspath(args.scenario)]
    values = merge(DEMO_OPTIONS, args, {})
    journal = choose_journal(values["journal"], values["no_journal"])
    answers: AnswerSource | None = None
    permission: PermissionMode | Literal["demo"] = values["permission"] or "demo"
    if permission == "ask":
        answers = AnswerSource.stdin()
    spec = turn_spec(
        values,
        command=stub,
        prompt=DEMO_PROMPT,
        cwd=os.getcwd(),
        permission=permission,
        answers=answers,
        progress=progress_wanted(values, default=True),
        demo=True,
        journal=journal,
    )
    status = EXIT_COMPLETED
    if args.only in (None, "acp"):
        if spec.progress:
            console = Console(sys.stderr, color=use_color(sys.stderr))
            console.line(console.paint(f"{PROG} demo: one turn against the bundled stub ACP agent", "1"))
            console.line(console.paint(f"> {DEMO_PROMPT}", "2"))
        status = _execute(spec)
    if args.only in (None, "delegation") and status != EXIT_USAGE:
        status = max(status, _delegation_demo(args, journal, narrate=spec.progress and not spec.events))
    return status


def _delegation_demo(args: argparse.Namespace, choice: JournalChoice, *, narrate: bool) -> int:
    """The in-process half of the demo: an agent delegates to fork, spawn and acp at once."""
    # Imported here: the rest of the command line does not need the in-process runtime.
    from subagent.cli._demo import run_delegation_demo

    # Not narrating (--events, --quiet): the narration goes nowhere.
    console = Console(sys.stderr if narrate else io.StringIO(), color=narrate and use_color(sys.stderr))
    if narrate:
        console.line(
            console.paint(f"{PROG} demo: an in-process agent delegates to fork, spawn and acp at once", "1")
        )
    journal = open_journal(choice)
    try:
        report = anyio.run(run_delegation_demo, console, journal, choice.resume_command("ID"))
    except Exception as exc:
        logger.debug("the delegation demo failed", exc_info=True)
        Console(sys.stderr, color=False).line(f"{PROG}: the delegation demo failed: {exc}")
        return EXIT_NOT_COMPLETED
    finally:
        if journal is not None:
            journal.close()
    if args.json:
        print_json({"output": report, "stopReason": "completed", "error": None, "usage": None})
    else:
        print_stdout(report + "\n")
    if narrate:
        console.line(
            "That was the in-process runtime on a scripted model. "
            "Serve it to any ACP client: subagent serve --script FILE"
        )
    return EXIT_COMPLETED


def configured_agent(name: str, explicit_config: str | None) -> AgentConfig:
    """The agent ``name`` of the config (``--config``, else the first found); a usage error if none."""
    return config_and_agent(name, explicit_config)[1]


def config_and_agent(name: str, explicit_config: str | None) -> tuple[Config, AgentConfig]:
    """The config (``--config``, else the first found) and its agent ``name``; a usage error if none."""
    path = find_config(explicit_config)
    if path is None:
        looked = ", ".join(str(candidate) for candidate in config_search_path())
        raise UsageError(f"--agent {name}: no config file found (looked for {looked})")
    config = load_config(path)
    agent = config.agents.get(name)
    if agent is None:
        known = ", ".join(config.agents) or "none"
        raise UsageError(f"--agent {name}: no agent named {name!r} in {path} (configured: {known})")
    return config, agent


def agents_command(args: argparse.Namespace, command: list[str] | None) -> int:
    """``subagent agents``: list the configured agents (as text, or one JSON object)."""
    if command is not None:
        raise UsageError("agents takes no `-- COMMAND`")
    searched = [Path(args.config)] if args.config is not None else config_search_path()
    path = find_config(args.config)
    agents = list(load_config(path).agents.values()) if path is not None else []
    if args.json:
        print_json(
            {
                "config": None if path is None else str(path),
                "searched": [str(candidate) for candidate in searched],
                "agents": [
                    {
                        "name": agent.name,
                        "command": list(agent.command),
                        "description": agent.description,
                        "fs": agent.fs,
                        "transport": agent.transport or "local",
                        "source": str(agent.source),
                    }
                    for agent in agents
                ],
            }
        )
        return 0
    if path is None:
        looked = "\n".join(f"  {candidate}" for candidate in searched)
        print_stdout(f"no agents configured; looked for a config file at:\n{looked}\n")
        print_stdout(f"see `{PROG} --help` for the format\n")
        return 0
    if not agents:
        print_stdout(f"no agents configured in {path}\n")
        return 0
    width = max(len(agent.name) for agent in agents)
    lines = [f"agents in {path}:"]
    for agent in agents:
        no_fs = "  (fs off: no fs/* offered)" if not agent.fs else ""
        where = f"  (on {agent.transport})" if agent.transport not in (None, "local") else ""
        lines.append(f"  {agent.name:<{width}}  {shlex.join(agent.command)}{where}{no_fs}")
        if agent.description:
            lines.append(f"  {'':<{width}}  {agent.description}")
    print_stdout("\n".join(lines) + "\n")
    return 0


def execute_turn(spec: TurnSpec) -> int:
    """Run the turn, print its outcome, and return the exit status (as ``subagent run`` does)."""
    return _execute(spec)


def _execute(spec: TurnSpec) -> int:
    """Run the turn, print its outcome, and return the exit status."""
    # Opened first: a journal that cannot be opened ends the command before anything else is done.
    journal = open_journal(spec.journal) if spec.journal is not None else None
    try:
        return _execute_with(spec, journal)
    finally:
        if journal is not None:
            journal.close()


def _execute_with(spec: TurnSpec, journal: RunJournal | None) -> int:
    console = Console(sys.stderr, color=use_color(sys.stderr))
    views: list[RunView] = [
        EventView(sys.stderr)
        if spec.events
        else HumanView(console, progress=spec.progress, decisions=spec.progress or spec.permission == "ask")
    ]
    with contextlib.ExitStack() as stack:
        if spec.events_file is not None:
            try:
                stream = stack.enter_context(open(spec.events_file, "w", encoding="utf-8"))
            except OSError as exc:
                raise UsageError(f"--events-file: cannot write {spec.events_file}: {exc.strerror}") from None
            views.append(EventView(stream))
        recorder = TraceRecorder() if spec.trace is not None else None
        if recorder is not None:
            views.append(recorder)
        for view in views[1:]:
            assert isinstance(view, EventView)
            emit_prompt(view, spec.prompt)
        view = views[0] if len(views) == 1 else FanOut(views)
        LOG_HANDLER.view = view
        try:
            outcome = anyio.run(drive, spec, view, journal)
        finally:
            LOG_HANDLER.view = None
            if spec.answers is not None:
                spec.answers.close()
            # Written however the run ended (a failure, an interrupt): that is when a trace is wanted most.
            trace_failed = recorder is not None and not _write_trace(recorder, spec)
    status = _report(spec, outcome, console)
    return EXIT_USAGE if trace_failed else status


def _write_trace(recorder: TraceRecorder, spec: TurnSpec) -> bool:
    """Write the trace page; False (said on stderr) if it could not be written."""
    assert spec.trace is not None
    # Named by what it was asked (the command line may hold a secret; the prompt is on the page anyway).
    asked = " ".join(spec.prompt.split())
    title = f"{PROG} trace: {asked if len(asked) <= 80 else asked[:79] + chr(0x2026)}"
    try:
        write_page(spec.trace, recorder.builder.page(title))
    except OSError as exc:
        Console(sys.stderr, color=False).line(f"{PROG}: --trace: cannot write {spec.trace}: {exc.strerror}")
        return False
    return True


def _report(spec: TurnSpec, outcome: TurnOutcome, console: Console) -> int:
    """Print the turn's outcome and return the exit status."""
    result = outcome.result
    if outcome.refused is not None and outcome.start_error is None:
        # Refused before any agent was started (no such run, one that cannot be resumed): bad usage.
        console.line(f"{PROG}: {outcome.refused}")
        return EXIT_USAGE
    if spec.json:
        report: dict[str, Any] = {
            "output": result.output,
            "stopReason": result.stop_reason,
            "error": result.error,
            "usage": usage_to_acp(result.usage),
        }
        if outcome.journal_id is not None:
            report["journalId"] = outcome.journal_id
        if outcome.run_costs:
            # The agent's subagent tree reported what its runs used: the whole tree's total beside its own.
            report["subtreeUsage"] = usage_to_acp(outcome.subtree_usage)
        if outcome.runs:
            report["runs"] = list(outcome.runs.values())
        if result.budget is not None or result.stop_reason == "budget":
            # Only a run with a budget: the object of one without stays as it always was.
            report |= {
                "outputFinal": result.output_final,
                "limit": limit_to_json(result.limit),
                "budget": budget_to_json(result.budget),
                "spent": spend_to_json(result.spent),
            }
        if spec.isolation is not None:
            report["workspace"] = workspace_to_json(result.workspace)
        print_json(report)
    elif result.output and outcome.start_error is None:
        print_stdout(result.output if result.output.endswith("\n") else result.output + "\n")
    if outcome.start_error is not None:
        if outcome.refused is not None:
            console.line(f"{PROG}: {outcome.refused}")
        elif not spec.events:
            console.line(f"{PROG}: the agent failed to start: {outcome.start_error}")
        return EXIT_USAGE
    currency = result.spent.cost_currency if result.spent is not None else None
    if result.stop_reason == "budget" and not spec.events:
        cap = result.limit.describe(currency) if result.limit is not None else "a cap was passed"
        console.line(f"{PROG}: the turn was stopped by its budget: {cap}")
    elif not result.ok and not spec.events:
        detail = f": {result.error}" if result.error else ""
        console.line(f"{PROG}: the turn ended with stop reason {result.stop_reason!r}{detail}")
    if result.budget is not None and result.spent is not None and not spec.events:
        console.line(f"{PROG}: budget: {result.spent.describe(result.budget)}")
    if result.workspace is not None and not spec.events:
        for line in workspace_lines(result.workspace, spec.cleanup):
            console.line(f"{PROG}: {line}")
    if outcome.resumable and outcome.journal_id is not None and spec.journal is not None and not spec.events:
        console.line(
            f"{PROG}: run {outcome.journal_id} is in the run journal: continue it with "
            f"`{spec.journal.resume_command(outcome.journal_id)}` (-p TEXT to say what next)"
        )
    if spec.demo and not spec.events:
        console.line(
            f"That was the bundled stub agent (no network, no keys). To drive a real one: {_REAL_AGENT_HINT}"
        )
    if result.stop_reason == "budget":
        return EXIT_BUDGET
    return EXIT_COMPLETED if result.ok else EXIT_NOT_COMPLETED


def workspace_lines(change: WorkspaceChange, cleanup: CleanupPolicy) -> list[str]:
    """What a person is told of the run's workspace at the end: where its changes are, what the cleanup
    policy left of it, and how to take or drop the changes."""
    where = f"workspace: {change.describe()}"
    if change.mode == "copy":
        if change.removed:
            return [f"{where}; the copy was removed"]
        return [where if change.changed else f"{where}; the copy is kept at {change.path}"]
    branch = shlex.quote(change.branch or "")
    path = shlex.quote(change.path)
    if not change.changed:
        if change.removed:
            return [f"{where}; its worktree and branch were removed"]
        return [f"{where}; its worktree is kept at {change.path} on branch {change.branch}"]
    if change.removed and cleanup == "remove-always":
        return [f"{where}; removed, branch and all (--cleanup remove-always)"]
    lines = [where]
    if not change.removed:
        lines.append(f"its worktree is kept at {change.path} (`git worktree remove {path}` when done)")
    lines.append(f"take them with `git merge {branch}`, or drop them with `git branch -D {branch}`")
    return lines


# -- the commands' rows ------------------------------------------------------------------------------------

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
  "journalId" (the run's id in the run journal, unless --no-journal), and "subtreeUsage" too
  when the agent's subagents reported what they spent (subagent serve's
  do; Codex says only its subagents' context window, Claude Code nothing of theirs): what
  the whole tree used, the agent's own usage included; and "runs", each run of that tree
  as last reported ({{"runId", "parentId", "provider", "depth", "state", "title"}}, and
  once ended "stopReason", "elapsedSeconds" and "usage" where the agent said any).
  Live progress goes to stderr when stderr is a terminal: the answer as it streams, tool
  calls as their status changes, the plan, thoughts dimmed, permission decisions; never
  with --json or --events. Colour only on a terminal and without NO_COLOR.
  --events writes one JSON object per line on stderr instead: spawn, start, update (the ACP
  session/update params, camelCase as on the wire), run, permission_request, permission,
  interrupt, interrupted_runs (the runs the run journal was found to hold interrupted),
  start_failed, end, and log; start carries the run's "journalId".
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

run journal:
  Every run is recorded in a run journal (SQLite): --journal PATH, else $SUBAGENT_JOURNAL (off:
  none), else the config's top-level `journal` key, else $XDG_STATE_HOME/subagent/runs.db;
  --no-journal records nothing. A journal that cannot be opened (not a journal, written by a
  newer release) exits 2 with its message before any agent starts. `{PROG} runs` lists the
  runs; a run found interrupted (the process that ran it was killed) is reported once, on stderr,
  by the next command that opens the journal. A turn that did not complete, whose agent can
  reopen its session (session/resume or session/load), ends with the command that continues
  it: `{PROG} resume ID [-p TEXT]`, which starts the agent again and sends the prompt as a new turn.

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


RUN_COMMAND: Final = Command(
    help="run one prompt through an ACP agent and print its answer",
    description=_RUN_DESCRIPTION,
    epilog=_RUN_EPILOG,
    usage=f"{PROG} run [OPTIONS] (-- COMMAND [ARGS...] | --agent NAME)",
    add_arguments=_add_run_arguments,
    run=run_command,
)

DEMO_COMMAND: Final = Command(
    help="a full turn against the bundled stub agent: no network, no keys",
    description="Run a full turn against the bundled stub ACP agent, through the same code as `run`, "
    "with live progress on stderr and the final answer on stdout. The agent's permission question is "
    "allowed automatically, shown as '(demo)', unless --permission is given. No network, no keys; "
    "exit status as for `run`.",
    add_arguments=_add_demo_arguments,
    run=demo_command,
)

AGENTS_COMMAND: Final = Command(
    help="list the agents named in the config",
    description="List the agents configured for `run --agent NAME`: name, command line and source file. "
    "See `subagent --help` for the config format.",
    add_arguments=_add_agents_arguments,
    run=agents_command,
)
