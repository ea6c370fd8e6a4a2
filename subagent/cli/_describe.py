"""``subagent describe``: what an agent offers, without running a turn.

It starts the agent as ``run`` would (``-- COMMAND`` or ``--agent NAME``), answers ``initialize``,
opens a session in the cwd, and prints the agent's name and version, its capabilities, its auth
methods, the session's modes (the current one marked, and which approve tool calls by themselves,
with the mode a ``deny`` or ``ask`` run would move the session to) and its config options with their
values. No prompt is sent. Agent text is shown inert, cut to a line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, Final

import anyio

from subagent._text import one_line
from subagent.acp import schema
from subagent.acp._errors import AcpError
from subagent.acp._modes import ModeChoice, known_agent_modes, mode_advice, reads_as_approving, select_values
from subagent.acp.client import AcpSession, spawn_agent
from subagent.acp.handlers import FsSandbox
from subagent.cli._commands import configured_agent
from subagent.cli._console import print_json, print_stdout, sanitize
from subagent.cli._exits import EXIT_USAGE, PROG, Command, Parser, UsageError
from subagent.providers.acp import DEFAULT_READY_TIMEOUT

__all__ = ["DESCRIBE_COMMAND", "describe_agent"]

_MAX_SHOWN_CHARS: Final = 120
"""The longest agent-given text (a name, a description) one line of the listing shows."""


def _add_arguments(parser: Parser) -> None:
    parser.add_argument("--agent", metavar="NAME", help="describe the agent named NAME in the config")
    parser.add_argument("--config", metavar="PATH", help="the config file for --agent")
    parser.add_argument("--cwd", metavar="DIR", help="the session's directory (default: the current one)")
    parser.add_argument(
        "--auth-method", metavar="ID", help="the auth method to use if the agent demands authentication"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _describe_command(args: argparse.Namespace, command: list[str] | None) -> int:
    if args.agent is not None and command is not None:
        raise UsageError("give either --agent NAME or `-- COMMAND [ARGS...]`, not both")
    agent = configured_agent(args.agent, args.config) if args.agent is not None else None
    if agent is not None:
        if agent.transport not in (None, "local"):
            raise UsageError(
                f"--agent {agent.name}: describe runs agents here only, not on {agent.transport}"
            )
        command = list(agent.command)
    if not command:
        raise UsageError("no agent to describe: put its command after `--` or name one with --agent NAME")
    cwd = os.path.abspath(args.cwd or (agent.cwd if agent and agent.cwd else None) or os.getcwd())
    if not os.path.isdir(cwd):
        raise UsageError(f"--cwd: {cwd!r} is not a directory")
    ready = agent.ready_timeout if agent and agent.ready_timeout else DEFAULT_READY_TIMEOUT
    auth = args.auth_method or (agent.auth_method if agent else None)
    try:
        described = anyio.run(describe_agent, command, cwd, agent.env if agent else None, auth, ready)
    except (AcpError, TimeoutError, OSError) as exc:
        why = f"not ready within {ready:g} s" if isinstance(exc, TimeoutError) else str(exc)
        sys.stderr.write(f"{PROG}: could not describe the agent: {one_line(sanitize(why), 2000)}\n")
        return EXIT_USAGE
    if args.json:
        print_json(described)
    else:
        print_stdout(_text(described))
    return 0


async def describe_agent(
    command: Sequence[str],
    cwd: str,
    env: dict[str, str] | None = None,
    auth_method: str | None = None,
    ready_timeout: float = DEFAULT_READY_TIMEOUT,
) -> dict[str, Any]:
    """Start the agent, open a session in ``cwd``, and return what it offers (as ``--json`` prints it).

    Raises:
        AcpError: the agent could not be started, or refused the handshake.
        TimeoutError: it was not ready within ``ready_timeout`` seconds.
    """
    async with spawn_agent(command, env=env, cwd=cwd, fs=FsSandbox([cwd]), permission="deny") as client:
        with anyio.fail_after(ready_timeout):
            agent = await client.initialize()
            try:
                session = await client.new_session(cwd)
            except AcpError:
                if auth_method is None:
                    raise
                await client.authenticate(auth_method)
                session = await client.new_session(cwd)
        return _described(agent, session)


def _described(agent: schema.InitializeResponse, session: AcpSession) -> dict[str, Any]:
    info = agent.agent_info
    name = info.name if info is not None else None
    offered = session.offered_modes
    advice = mode_advice(name, offered, session.current_mode_id)
    known = known_agent_modes(name)
    capabilities = schema.to_builtins(agent.agent_capabilities)
    return {
        "agent": None if info is None else {"name": info.name, "title": info.title, "version": info.version},
        "protocolVersion": agent.protocol_version,
        "agentCapabilities": capabilities,
        "authMethods": [schema.to_builtins(method) for method in agent.auth_methods],
        "sessionId": session.session_id,
        "currentMode": session.current_mode_id,
        "modes": [
            {
                "id": mode.id,
                "name": mode.name,
                "description": mode.description,
                "configOption": mode.config_id,
                "approvesByItself": _approves(mode, known),
            }
            for mode in offered
        ],
        "askingMode": known.asking
        if known is not None and any(m.id == known.asking for m in offered)
        else None,
        "switchesTo": advice.switch_to.id if advice is not None and advice.switch_to is not None else None,
        "configOptions": [schema.to_builtins(option) for option in session.config_options or ()],
    }


def _approves(mode: ModeChoice, known: Any) -> bool | None:
    """True or False from the table for a known agent; for others True when the name says so, else
    None (unknown)."""
    if known is not None:
        return mode.id in known.approving
    return True if reads_as_approving(mode) else None


def _shown(text: object) -> str:
    return one_line(sanitize(str(text)), _MAX_SHOWN_CHARS)


def _text(described: dict[str, Any]) -> str:
    agent = described["agent"] or {}
    title = agent.get("title") or agent.get("name") or "(unnamed agent)"
    lines = [
        f"{_shown(title)} {_shown(agent.get('version') or '')} (agentInfo.name {_shown(agent.get('name'))}), "
        f"protocol version {described['protocolVersion']}"
    ]
    caps = described["agentCapabilities"]
    session_caps = sorted(
        key for key, value in (caps.get("sessionCapabilities") or {}).items() if value is not None
    )
    prompt_caps = sorted(
        key for key, value in (caps.get("promptCapabilities") or {}).items() if value is True
    )
    lines.append(f"  loadSession: {'yes' if caps.get('loadSession') else 'no'}")
    lines.append(f"  session capabilities: {', '.join(_shown(k) for k in session_caps) or 'none'}")
    lines.append(f"  prompt capabilities: {', '.join(_shown(k) for k in prompt_caps) or 'text only'}")
    methods = [_shown(method.get("id")) for method in described["authMethods"]]
    lines.append(f"  auth methods: {', '.join(methods) or 'none'}")
    modes = described["modes"]
    if modes:
        lines.append(f"modes (current: {_shown(described['currentMode'])}; switch with --mode ID):")
        width = min(max(len(_shown(mode["id"])) for mode in modes), 40)
        for mode in modes:
            mark = "*" if mode["id"] == described["currentMode"] else " "
            note = "  [approves tool calls by itself]" if mode["approvesByItself"] else ""
            if mode["id"] == described["askingMode"]:
                note += "  [asks first]"
            name = _shown(mode["name"])
            if mode["description"]:
                name += f": {_shown(mode['description'])}"
            lines.append(f"  {mark} {_shown(mode['id']):<{width}}  {name}{note}")
        if described["switchesTo"] is not None:
            target = _shown(described["switchesTo"])
            lines.append(f"  under --permission deny or ask, a run moves this session to {target!r}")
    else:
        lines.append("modes: none offered")
    options = described["configOptions"]
    if options:
        lines.append("config options (set with --set ID=VALUE):")
        lines.extend("  " + _option_line(option) for option in options)
    else:
        lines.append("config options: none offered")
    return "\n".join(lines) + "\n"


def _option_line(option: dict[str, Any]) -> str:
    category = f" [{_shown(option['category'])}]" if option.get("category") else ""
    value = option.get("currentValue")
    shown = ("true" if value else "false") if isinstance(value, bool) else _shown(value)
    head = f"{_shown(option.get('id'))}{category} = {shown}"
    if option.get("type") == "boolean":
        return f"{head}  (true or false)"
    if option.get("type") == "select":
        decoded = schema.convert(option, type=schema.SessionConfigSelect)
        values = [_shown(value.value) for value in select_values(decoded)]
        return f"{head}  (values: {', '.join(values)})"
    return f"{head}  ({_shown(option.get('type'))})"


DESCRIBE_COMMAND: Final = Command(
    help="show what an agent offers (modes, config options, capabilities) without running a turn",
    description="Start the agent (-- COMMAND, or --agent NAME from the config), open a session and print "
    "what it offers: name and version, capabilities, auth methods, session modes (the current one marked "
    "with *, and which approve tool calls by themselves) and config options with their values; then stop "
    "it. No "
    "prompt is sent. Exit status: 0, or 2 for bad usage or an agent that could not be started.",
    usage=f"{PROG} describe [OPTIONS] (-- COMMAND [ARGS...] | --agent NAME)",
    add_arguments=_add_arguments,
    run=_describe_command,
)
"""``subagent describe``."""
