"""``subagent resume ID [-p TEXT]``: continue a journaled run that did not complete, in a new agent process.

The run journal (:mod:`subagent.journal`) keeps how the run's agent was run (its command, transport and
cwd, as :meth:`~subagent.providers.acp.AcpProvider.describe_agent` said) and, for a run of ``subagent
run``, how the command line ran it (:data:`~subagent.cli._turn.CLI_META_KEY`: the configured agent it came
from, whose environment the config gives again, and the provider's settings). From these the command
rebuilds the same provider, registers it under the journaled provider name, and has the service
resume the run (:meth:`~subagent.service.SubagentService.resume`): the agent is started again, its
session reopened (``session/resume``, else ``session/load``), and the prompt sent as a new turn of the
same run. The turn is then driven and printed exactly as ``subagent run`` does: the same output, ``--json``
object and exit statuses.

A run that cannot be resumed ends the command with exit status 2 and the reason, before any agent is
started when it can be known then: no such run, a run still live in a process that lives, a run of an
in-process child (its provider lives in the program that ran it), a session of ``subagent serve`` (its
client reopens it), a run in an isolated workspace (closed with it); or once its agent has answered, when
it can reopen no session.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any, Final

from subagent.acp.transports._schemes import transport_from_url
from subagent.cli._commands import (
    check_output_options,
    config_and_agent,
    execute_turn,
    progress_wanted,
    turn_spec,
    with_ssh_options,
)
from subagent.cli._console import is_terminal
from subagent.cli._exits import PROG, Command, CommandError, Parser, PromptTooLarge, UsageError
from subagent.cli._journal import JournalChoice, choose_journal, journal_exists, open_journal
from subagent.cli._options import RUN_OPTIONS, add_options, merge
from subagent.cli._permission import PermissionMode, answer_source, default_permission
from subagent.cli._turn import CLI_META_KEY, ResumeTarget
from subagent.journal import JournalError, RunRecord
from subagent.providers.acp import prompt_size_error

__all__ = ["RESUME_COMMAND", "RESUME_OPTIONS"]

RESUME_OPTIONS: Final = tuple(
    option
    for option in RUN_OPTIONS
    if option.name
    in (
        "permission",
        "permission_timeout",
        "timeout",
        "max_tokens",
        "max_cost",
        "max_seconds",
        "max_tool_calls",
        "max_turns",
        "reports_usage",
        "json",
        "events",
        "events_file",
        "trace",
        "progress",
        "journal",
    )
)
"""The options of ``subagent run`` that ``subagent resume`` takes too: how the resumed turn is answered,
bounded and shown. What the agent is and where it works are the journaled run's."""

_PERMISSIONS: Final = ("allow", "deny", "ask")

_DESCRIPTION: Final = """\
Continue a run of the run journal that did not complete (interrupted, timed out, cancelled,
stopped by its budget...), or give a completed one another turn: its agent is started again,
as the journal says it ran (its command, transport and cwd; with --agent NAME, the config's
environment for it), its session is reopened (session/resume, else session/load), and the
prompt is sent as a new turn of the same run. Its completed turns are not run again. Output,
--json and exit statuses are as for `subagent run`; a run that cannot be resumed (no such
run, still running elsewhere, an in-process child, an isolated workspace, an agent that cannot
reopen its session) exits 2 with the reason. `subagent runs` lists the runs.
"""

_EPILOG: Final = """\
the prompt:
  -p TEXT is the resumed turn's prompt. Without it, a run whose last turn did not complete is
  sent a prompt that says it stopped before it finished, repeats what it was asked, and asks
  it to check what is already done before it finishes the task; a run whose last turn
  completed needs -p.

options:
  --permission, --timeout and the caps (--max-*) hold for the resumed turn: a flag given here
  wins; otherwise the run's own permission policy (as given to `subagent run`), timeout and
  caps hold (a cap given here holds over the run's own).
"""


def _add_arguments(parser: Parser) -> None:
    parser.add_argument(
        "id", metavar="ID", help="the run's id in the run journal (or at least 4 of its first characters)"
    )
    parser.add_argument(
        "-p",
        "--prompt",
        metavar="TEXT",
        help="the prompt of the resumed turn (default: continue where it stopped; see below)",
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="the config file of the agent the run was started with (--agent NAME), for its environment, "
        "and whose top-level `journal` key to read (default: the file the agent was read from, else the "
        "first found)",
    )
    add_options(parser, RESUME_OPTIONS)


def _resume_command(args: argparse.Namespace, command: list[str] | None) -> int:
    if command is not None:
        raise UsageError("resume takes no `-- COMMAND`: the run's own agent is started again")
    check_output_options(args)
    values = merge(RESUME_OPTIONS, args, {})
    prompt: str | None = args.prompt
    if prompt is not None:
        if not prompt.strip():
            raise UsageError(
                "the prompt is empty: give the resumed turn's prompt with -p TEXT, or leave -p out"
            )
        too_large = prompt_size_error(prompt)
        if too_large is not None:
            raise PromptTooLarge(too_large)
    choice = choose_journal(values["journal"], False, explicit_config=args.config)
    record = _record(choice, args.id)
    agent = _acp_agent(record)
    cli = _cli_settings(record)
    try:
        transport = transport_from_url(_text(agent.get("transport")) or "local")
    except ValueError as exc:
        raise CommandError(f"run {record.id} cannot be resumed: its agent's transport: {exc}") from None
    ssh_options = cli.get("sshOptions")
    transport = with_ssh_options(
        transport,
        _text(cli.get("sshConfig")),
        [option for option in ssh_options if isinstance(option, str)]
        if isinstance(ssh_options, list)
        else [],
    )
    command_line = list(agent["command"])
    env: Mapping[str, str] | None = None
    prices = None
    configured = _text(cli.get("agent"))
    if configured is not None:
        # Its environment is never journaled: the config gives it again, and its command whole (the journal's
        # has any environment value in it redacted; the provider refuses a command that is not the run's).
        config, agent_config = config_and_agent(configured, args.config or _text(cli.get("config")))
        env, prices, command_line = agent_config.env, config.prices, list(agent_config.command)
    answers = answer_source(prompt_from_stdin=False)
    given = values["permission"] or cli.get("permission")
    permission: PermissionMode = given if given in _PERMISSIONS else default_permission(answers)
    if permission != "ask" and answers is not None:
        answers.close()
        answers = None
    cwd = _text(agent.get("cwd")) or _text(record.request.get("cwd")) or os.getcwd()
    spec = turn_spec(
        values,
        command=command_line,
        prompt=prompt if prompt is not None else record.turn_prompt,
        cwd=cwd,
        env=env,
        permission=permission,
        answers=answers,
        transport=transport,
        progress=progress_wanted(values, default=is_terminal(sys.stderr)),
        prices=prices,
        journal=choice,
        resume=ResumeTarget(record.id, record.provider, prompt),
        reports_usage=values["reports_usage"]
        if values["reports_usage"] is not None
        else cli.get("reportsUsage"),
        **_provider_settings(cli),
    )
    return execute_turn(spec)


def _record(choice: JournalChoice, run: str) -> RunRecord:
    """Run ``run`` of the chosen journal; CommandError when there is none."""
    if choice.path is None:
        raise CommandError(f"no run journal to resume run {run!r} from ({choice.source} turned it off)")
    if not journal_exists(choice):
        raise CommandError(f"no run {run!r}: the run journal {choice.path} does not exist")
    journal = open_journal(choice)
    assert journal is not None
    try:
        record = journal.get(run, details=False)
    except JournalError as exc:
        raise CommandError(str(exc)) from None
    finally:
        journal.close()
    if record is None:
        short = " (give at least 4 characters of its id)" if len(run) < 4 else ""
        raise CommandError(f"no run {run!r} in the run journal {choice.path}{short}")
    return record


def _acp_agent(record: RunRecord) -> Mapping[str, Any]:
    """How the run's ACP agent was run, as journaled; CommandError for a run the CLI cannot rebuild."""
    agent = record.agent
    if not isinstance(agent, Mapping):
        raise CommandError(
            f"run {record.id} cannot be resumed: the run journal does not say how its agent was run "
            f"(its provider {record.provider!r} said nothing of it)"
        )
    command = agent.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(part, str) for part in command):
        kind = agent.get("kind")
        if kind == "serve":
            raise CommandError(
                f"run {record.id} is a session of `{PROG} serve`: start `{PROG} serve` again on this "
                "journal, and its client reopens the session (session/resume or session/load)"
            )
        what = f"it was an in-process {kind} child" if isinstance(kind, str) else "its agent was no ACP agent"
        raise CommandError(
            f"run {record.id} cannot be resumed here: {what} (provider {record.provider!r}), run by the "
            "program that started it; that program can resume it (SubagentService.resume)"
        )
    isolation = record.request.get("isolation")
    if isolation is not None:
        raise CommandError(
            f"run {record.id} cannot be resumed: it ran in an isolated workspace (--isolation {isolation}), "
            "closed with its agent: a resumed session would not find the files it worked on"
        )
    return agent


def _cli_settings(record: RunRecord) -> Mapping[str, Any]:
    """How ``subagent run`` ran the run (empty for a run some other program started)."""
    metadata = record.request.get("metadata")
    settings = metadata.get(CLI_META_KEY) if isinstance(metadata, Mapping) else None
    return settings if isinstance(settings, Mapping) else {}


def _provider_settings(cli: Mapping[str, Any]) -> dict[str, Any]:
    """The provider's settings the run had (its agent's mode, config options...), as the turn's spec
    takes them; what the journal does not say stays as a new run's default."""
    settings: dict[str, Any] = {}
    for key, field in (("fs", "fs"), ("subagents", "subagents")):
        if isinstance(cli.get(key), bool):
            settings[field] = cli[key]
    for key, field in (("mode", "mode"), ("authMethod", "auth_method")):
        if _text(cli.get(key)) is not None:
            settings[field] = cli[key]
    options = cli.get("configOptions")
    if isinstance(options, Mapping):
        settings["config_options"] = {
            str(name): value for name, value in options.items() if isinstance(value, str | bool)
        }
    ready = cli.get("readyTimeout")
    if isinstance(ready, int | float) and not isinstance(ready, bool) and ready > 0:
        settings["ready_timeout"] = float(ready)
    return settings


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


RESUME_COMMAND: Final = Command(
    help="continue a run of the run journal in a new agent process (its session reopened)",
    description=_DESCRIPTION,
    epilog=_EPILOG,
    add_arguments=_add_arguments,
    run=_resume_command,
    usage=f"{PROG} resume ID [-p TEXT] [OPTIONS]",
)
