"""The commands ``run``, ``demo`` and ``agents``: from parsed options to a turn, a report, or a list.

``run`` and the first half of ``demo`` merge options, config and defaults into a
:class:`~subagent.cli._turn.TurnSpec`, drive the turn on the view the options ask for, and print its
outcome: the answer (or one JSON object) on stdout, diagnostics on stderr, and an exit status.
``serve`` lives in :mod:`subagent.cli._serve_command`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import anyio

from subagent._usage_codec import usage_to_acp
from subagent.acp.connection import DEFAULT_MAX_LINE_BYTES
from subagent.acp.transports._channel import Transport
from subagent.acp.transports._schemes import transport_from_url
from subagent.acp.transports._ssh import SshTransport
from subagent.cli._config import SSH_OPTION, AgentConfig, config_search_path, find_config, load_config
from subagent.cli._console import Console, is_terminal, print_json, print_stdout, use_color
from subagent.cli._exits import (
    EXIT_COMPLETED,
    EXIT_NOT_COMPLETED,
    EXIT_USAGE,
    PROG,
    PromptTooLarge,
    UsageError,
)
from subagent.cli._logs import LOG_HANDLER
from subagent.cli._permission import AnswerSource, PermissionMode, answer_source, default_permission
from subagent.cli._recording import FanOut, TraceRecorder, emit_prompt, write_page
from subagent.cli._turn import TurnOutcome, TurnSpec, drive
from subagent.cli._views import EventView, HumanView, RunView
from subagent.providers.acp import prompt_size_error

__all__ = [
    "DEMO_PROMPT",
    "MAX_PROMPT_MIB",
    "agents_command",
    "configured_agent",
    "demo_command",
    "run_command",
]

logger = logging.getLogger(__name__)

DEMO_PROMPT: Final = "Summarise README.md and write the summary to SUMMARY.md."
"""What ``subagent demo`` asks the stub agent (which answers from its scenario regardless)."""

MAX_PROMPT_MIB: Final = DEFAULT_MAX_LINE_BYTES // (1024 * 1024)
"""The largest prompt, in MiB, as one ``session/prompt`` message (the connection's line limit)."""

_REAL_AGENT_HINT: Final = "subagent run -- npx @agentclientprotocol/claude-agent-acp"
"""Where the demo points a user next."""


def _check_output_options(args: argparse.Namespace) -> None:
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
    _check_output_options(args)
    agent: AgentConfig | None = None
    if args.agent is not None and command is not None:
        raise UsageError("give either --agent NAME or `-- COMMAND [ARGS...]`, not both")
    if args.agent is None and not command:
        raise UsageError(
            "no agent to run: put its command after `--` (e.g. `subagent run -- npx "
            "@agentclientprotocol/claude-agent-acp`) or name a configured one with --agent NAME"
        )
    if args.agent is not None:
        agent = configured_agent(args.agent, args.config)
        command = list(agent.command)
    assert command
    transport = _with_ssh_options(_transport(args.on, agent), args, agent)
    cwd = args.cwd or (agent.cwd if agent else None)
    if cwd is not None:
        where = f"the cwd of agent {agent.name!r} in {agent.source}" if agent and not args.cwd else "--cwd"
        if not transport.local_files:
            # A directory on the agent's host: it cannot be checked, nor resolved, from here.
            if not os.path.isabs(cwd):
                raise UsageError(f"{where}: {cwd!r} must be an absolute path on {transport.name}")
        elif not os.path.isdir(cwd):
            raise UsageError(f"{where}: {cwd!r} is not a directory")
    if args.fs and not transport.local_files:
        raise UsageError(f"--fs: an agent on {transport.name} cannot be offered this host's files")
    additional_directories = _additional_directories(args, agent, transport)
    prompt = args.prompt if args.prompt is not None else _read_prompt_from_stdin()
    if not prompt.strip():
        raise UsageError("the prompt is empty: pass -p TEXT or pipe the prompt on stdin")
    too_large = prompt_size_error(prompt)
    if too_large is not None:
        # Refused before an agent is spawned: it could not be sent to one.
        raise PromptTooLarge(too_large)
    answers = answer_source(prompt_from_stdin=args.prompt is None)
    permission: PermissionMode = (
        args.permission
        or (agent.permission if agent and agent.permission else None)
        or (default_permission(answers))
    )
    if permission != "ask" and answers is not None:
        answers.close()
        answers = None
    spec = TurnSpec(
        command=command,
        prompt=prompt,
        mode=args.mode or (agent.mode if agent else None),
        config_options={**(agent.config_options if agent else {}), **_settings(args.config_options)},
        # A directory elsewhere is taken as written: its symlinks are there, not here.
        cwd=cwd if cwd and not transport.local_files else os.path.abspath(cwd or os.getcwd()),
        additional_directories=additional_directories,
        env=dict(agent.env) if agent and agent.env else None,
        permission=permission,
        permission_timeout=args.permission_timeout,
        answers=answers,
        timeout=args.timeout if args.timeout is not None else (agent.timeout if agent else None),
        ready_timeout=agent.ready_timeout if agent else None,
        auth_method=args.auth_method or (agent.auth_method if agent else None),
        fs=args.fs if args.fs is not None else (agent.fs if agent else True),
        transport=transport,
        json_output=args.json,
        events=args.events,
        progress=_progress_wanted(args, default=is_terminal(sys.stderr)),
    )
    return _execute(spec, _Recording.from_args(args))


def _settings(given: list[str] | None) -> dict[str, str]:
    """``--set ID=VALUE`` options as a table; a later one for the same id wins."""
    settings: dict[str, str] = {}
    for item in given or ():
        config_id, equals, value = item.partition("=")
        if not equals or not config_id.strip() or not value:
            raise UsageError(f"--set: expected ID=VALUE, e.g. model=fast, not {item!r}")
        settings[config_id.strip()] = value
    return settings


def _additional_directories(
    args: argparse.Namespace, agent: AgentConfig | None, transport: Transport
) -> tuple[str, ...]:
    """The agent's configured ``additional_directories`` then ``--add-dir``'s, each an existing directory
    made absolute (relative ones from the current directory); on another host, absolute and as written."""
    configured: list[tuple[str, str]] = []
    if agent is not None:
        where = f"additional_directories of agent {agent.name!r} in {agent.source}"
        configured = [(path, where) for path in agent.additional_directories]
    given = [(path, "--add-dir") for path in args.add_dir or ()]
    directories: list[str] = []
    for path, where in [*configured, *given]:
        if not transport.local_files:
            # A directory on the agent's host: it cannot be checked, nor resolved, from here.
            if not os.path.isabs(path):
                raise UsageError(f"{where}: {path!r} must be an absolute path on {transport.name}")
            directories.append(path)
        elif not os.path.isdir(path):
            raise UsageError(f"{where}: {path!r} is not a directory")
        else:
            directories.append(os.path.abspath(path))
    return tuple(directories)


def _transport(on: str | None, agent: AgentConfig | None) -> Transport:
    """Where the agent runs: ``--on URL``, else the configured agent's ``transport``, else here."""
    url = on if on is not None else (agent.transport if agent else None)
    try:
        return transport_from_url(url)
    except ValueError as exc:
        # A configured URL was checked when the config was read: this is --on's.
        raise UsageError(f"--on: {exc}") from None


def _with_ssh_options(transport: Transport, args: argparse.Namespace, agent: AgentConfig | None) -> Transport:
    """The transport with ``--ssh-config``/``--ssh-option`` (over the agent's ``ssh_config`` and
    ``ssh_options``) applied, when it is SSH; a usage error when it is not and they were given."""
    options = [*(args.ssh_option or ()), *(agent.ssh_options if agent else ())]
    config_file = args.ssh_config or (agent.ssh_config if agent else None)
    if not options and config_file is None:
        return transport
    if not isinstance(transport, SshTransport):
        raise UsageError(f"--ssh-config, --ssh-option: for an agent on ssh://HOST, not {transport.name}")
    for option in options:
        if not SSH_OPTION.fullmatch(option):
            raise UsageError(f"--ssh-option: expected NAME=VALUE, e.g. ConnectTimeout=20, not {option!r}")
    # A URL gives host, user and port only: the rest is the transport's defaults.
    return SshTransport(
        transport.host,
        user=transport.user,
        port=transport.port,
        ssh_options=[*transport.ssh_options, *(arg for option in options for arg in ("-o", option))],
        config_file=config_file if config_file is not None else transport.config_file,
    )


def _progress_wanted(args: argparse.Namespace, *, default: bool) -> bool:
    if args.json or args.events:
        return False
    return default if args.progress is None else bool(args.progress)


def demo_command(args: argparse.Namespace, command: list[str] | None) -> int:
    """``subagent demo``: a turn against the bundled stub agent, then the in-process delegation demo."""
    _check_output_options(args)
    if command is not None:
        raise UsageError(
            "demo runs the bundled stub agent and takes no `-- COMMAND`; use `subagent run` for that"
        )
    stub = [sys.executable, "-m", "subagent.testing.stub_agent"]
    if args.scenario is not None:
        if not os.path.isfile(args.scenario):
            raise UsageError(f"--scenario: {args.scenario!r} is not a file")
        stub += ["--scenario", os.path.abspath(args.scenario)]
    answers: AnswerSource | None = None
    permission: PermissionMode | Literal["demo"] = args.permission or "demo"
    if permission == "ask":
        answers = AnswerSource.stdin()
    spec = TurnSpec(
        command=stub,
        prompt=DEMO_PROMPT,
        cwd=os.getcwd(),
        permission=permission,
        permission_timeout=args.permission_timeout,
        answers=answers,
        json_output=args.json,
        events=args.events,
        progress=_progress_wanted(args, default=True),
        demo=True,
    )
    status = EXIT_COMPLETED
    if args.only in (None, "acp"):
        if spec.progress:
            console = Console(sys.stderr, color=use_color(sys.stderr))
            console.line(console.paint(f"{PROG} demo: one turn against the bundled stub ACP agent", "1"))
            console.line(console.paint(f"> {DEMO_PROMPT}", "2"))
        status = _execute(spec, _Recording.from_args(args))
    if args.only in (None, "delegation") and status != EXIT_USAGE:
        status = max(status, _delegation_demo(args, narrate=spec.progress and not spec.events))
    return status


def _delegation_demo(args: argparse.Namespace, *, narrate: bool) -> int:
    """The in-process half of the demo: an agent delegates to fork, spawn and acp at once."""
    # Imported here: the rest of the command line does not need the in-process runtime.
    from subagent.cli._demo import run_delegation_demo

    # Not narrating (--events, --quiet): the narration goes nowhere.
    console = Console(sys.stderr if narrate else io.StringIO(), color=narrate and use_color(sys.stderr))
    if narrate:
        console.line(
            console.paint(f"{PROG} demo: an in-process agent delegates to fork, spawn and acp at once", "1")
        )
    try:
        report = anyio.run(run_delegation_demo, console)
    except Exception as exc:
        logger.debug("the delegation demo failed", exc_info=True)
        Console(sys.stderr, color=False).line(f"{PROG}: the delegation demo failed: {exc}")
        return EXIT_NOT_COMPLETED
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
    path = find_config(explicit_config)
    if path is None:
        looked = ", ".join(str(candidate) for candidate in config_search_path())
        raise UsageError(f"--agent {name}: no config file found (looked for {looked})")
    config = load_config(path)
    agent = config.agents.get(name)
    if agent is None:
        known = ", ".join(config.agents) or "none"
        raise UsageError(f"--agent {name}: no agent named {name!r} in {path} (configured: {known})")
    return agent


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


@dataclass(frozen=True, slots=True)
class _Recording:
    """Where a run is recorded besides what stderr shows: ``--events-file`` and ``--trace``."""

    events_file: str | None = None
    trace: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> _Recording:
        for flag, path in (("--events-file", args.events_file), ("--trace", args.trace)):
            # Checked before the agent starts: a run is not worth losing to a typo in a path.
            if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise UsageError(f"{flag}: the directory of {path!r} does not exist")
        return cls(args.events_file, args.trace)


def _execute(spec: TurnSpec, recording: _Recording | None = None) -> int:
    """Run the turn, print its outcome, and return the exit status."""
    recording = recording or _Recording()
    console = Console(sys.stderr, color=use_color(sys.stderr))
    views: list[RunView] = [
        EventView(sys.stderr)
        if spec.events
        else HumanView(console, progress=spec.progress, decisions=spec.progress or spec.permission == "ask")
    ]
    with contextlib.ExitStack() as stack:
        if recording.events_file is not None:
            try:
                stream = stack.enter_context(open(recording.events_file, "w", encoding="utf-8"))
            except OSError as exc:
                raise UsageError(
                    f"--events-file: cannot write {recording.events_file}: {exc.strerror}"
                ) from None
            views.append(EventView(stream))
        recorder = TraceRecorder() if recording.trace is not None else None
        if recorder is not None:
            views.append(recorder)
        for view in views[1:]:
            assert isinstance(view, EventView)
            emit_prompt(view, spec.prompt)
        view = views[0] if len(views) == 1 else FanOut(views)
        LOG_HANDLER.view = view
        try:
            outcome = anyio.run(drive, spec, view)
        finally:
            LOG_HANDLER.view = None
            if spec.answers is not None:
                spec.answers.close()
            # Written however the run ended (a failure, an interrupt): that is when a trace is wanted most.
            trace_failed = recorder is not None and not _write_trace(recording, recorder, spec)
    status = _report(spec, outcome, console)
    return EXIT_USAGE if trace_failed else status


def _write_trace(recording: _Recording, recorder: TraceRecorder, spec: TurnSpec) -> bool:
    """Write the trace page; False (said on stderr) if it could not be written."""
    assert recording.trace is not None
    # Named by what it was asked (the command line may hold a secret; the prompt is on the page anyway).
    asked = " ".join(spec.prompt.split())
    title = f"{PROG} trace: {asked if len(asked) <= 80 else asked[:79] + chr(0x2026)}"
    try:
        write_page(recording.trace, recorder.builder.page(title))
    except OSError as exc:
        Console(sys.stderr, color=False).line(
            f"{PROG}: --trace: cannot write {recording.trace}: {exc.strerror}"
        )
        return False
    return True


def _report(spec: TurnSpec, outcome: TurnOutcome, console: Console) -> int:
    """Print the turn's outcome and return the exit status."""
    result = outcome.result
    if spec.json_output:
        report: dict[str, Any] = {
            "output": result.output,
            "stopReason": result.stop_reason,
            "error": result.error,
            "usage": usage_to_acp(result.usage),
        }
        if outcome.run_costs:
            # The agent's subagent tree reported what its runs used: the whole tree's total beside its own.
            report["subtreeUsage"] = usage_to_acp(outcome.subtree_usage)
        print_json(report)
    elif result.output and outcome.start_error is None:
        print_stdout(result.output if result.output.endswith("\n") else result.output + "\n")
    if outcome.start_error is not None:
        if not spec.events:
            console.line(f"{PROG}: the agent failed to start: {outcome.start_error}")
        return EXIT_USAGE
    if not result.ok and not spec.events:
        detail = f": {result.error}" if result.error else ""
        console.line(f"{PROG}: the turn ended with stop reason {result.stop_reason!r}{detail}")
    if spec.demo and not spec.events:
        console.line(
            f"That was the bundled stub agent (no network, no keys). To drive a real one: {_REAL_AGENT_HINT}"
        )
    return EXIT_COMPLETED if result.ok else EXIT_NOT_COMPLETED
