"""Session modes: what an agent offers, and which of its modes approve tool calls by themselves.

An agent offers modes in two ways, and some agents in both: the ``modes`` of its ``session/new``
answer (switched with ``session/set_mode``), and a config option of category ``mode`` (switched
with ``session/set_config_option``). :func:`offered_modes` reads both as one list.

Many agents start a session in a mode that approves its own tool calls (Claude's and Qwen Code's
``auto``, mistral-vibe's ``accept-edits``, Codex's ``agent``, which lets its own reviewer decide): in such
a mode the agent edits files and runs commands without asking ``session/request_permission``, so a client's
``deny`` or ``ask`` policy never hears of it. :func:`mode_advice` tells a client when that is the case
and, for the agents in :data:`KNOWN_AGENT_MODES`, which mode of the agent asks first, so it can move
the session there. For other agents a mode whose id or name reads like approval (``yolo``,
``bypassPermissions``, ``auto-edit``, ``full-access``...) is reported as approving by its name alone:
good enough to warn about, never to act on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from subagent.acp import schema

__all__ = [
    "KNOWN_AGENT_MODES",
    "KnownAgentModes",
    "ModeAdvice",
    "ModeChoice",
    "current_mode",
    "known_agent_modes",
    "mode_advice",
    "offered_modes",
    "reads_as_approving",
]


@dataclass(frozen=True, slots=True)
class ModeChoice:
    """One mode the agent offers."""

    id: str
    name: str
    description: str | None = None
    config_id: str | None = None
    """The config option (category ``mode``) that offers it, when it is offered that way only;
    None for a mode of the session's ``modes`` (switched with ``session/set_mode``)."""


@dataclass(frozen=True, slots=True)
class KnownAgentModes:
    """What one agent's modes do, checked against the agent in the real-agent tests."""

    agent: str
    """The agent's ``agentInfo.name`` in its ``initialize`` answer."""
    versions: str
    """The releases this was checked against (documentation only)."""
    asking: str
    """The mode in which the agent asks before it edits a file or runs a command."""
    approving: frozenset[str]
    """Modes in which it does either without asking (an agent may start in one of them)."""


KNOWN_AGENT_MODES: Final[tuple[KnownAgentModes, ...]] = (
    KnownAgentModes(
        agent="@agentclientprotocol/claude-agent-acp",
        versions="claude-agent-acp 0.101.0",
        # Starts in `auto` (its classifier decides) and writes files itself, never through the client.
        asking="default",
        approving=frozenset({"auto", "acceptEdits", "bypassPermissions"}),
    ),
    KnownAgentModes(
        agent="qwen-code",
        versions="Qwen Code 0.24.4",
        # Starts in `auto` and writes through fs/write_text_file without asking.
        asking="default",
        approving=frozenset({"auto", "auto-edit", "yolo"}),
    ),
    KnownAgentModes(
        agent="@agentclientprotocol/codex-acp",
        versions="@agentclientprotocol/codex-acp 2.6.0",
        # Starts in `agent` (its own reviewer decides); `read-only` asks for every escalation, and a
        # plain write there fails in its sandbox.
        asking="read-only",
        approving=frozenset({"agent", "agent-full-access", "workspace-write"}),
    ),
    KnownAgentModes(
        agent="Copilot",
        versions="GitHub Copilot CLI 1.0.102",
        # Starts in its asking mode; autopilot allows everything.
        asking="https://agentclientprotocol.com/protocol/session-modes#agent",
        approving=frozenset({"https://agentclientprotocol.com/protocol/session-modes#autopilot"}),
    ),
    KnownAgentModes(
        agent="@mistralai/mistral-vibe",
        versions="mistral-vibe 3.0.2",
        # Starts in `accept-edits` and writes files itself without asking (asks for other tools);
        # `auto-approve` asks for nothing.
        asking="ask",
        approving=frozenset({"accept-edits", "auto-approve"}),
    ),
)
"""The agents whose asking mode is known. A client holding a ``deny`` or ``ask`` policy moves a session
that starts in one of ``approving`` to ``asking``; the README lists this table."""

_APPROVING_WORDS: Final = re.compile(
    r"yolo|bypass|auto|accept|full[\s_-]*access|danger|never[\s_-]*ask|don'?t[\s_-]*ask|allow[\s_-]*all",
    re.IGNORECASE,
)
"""Words in a mode's id or name that say it approves by itself, for agents not in the table."""


def known_agent_modes(agent_name: str | None) -> KnownAgentModes | None:
    """The table's entry for the agent named ``agent_name`` (its ``agentInfo.name``), if any."""
    if agent_name is None:
        return None
    return next((known for known in KNOWN_AGENT_MODES if known.agent == agent_name), None)


def offered_modes(
    modes: schema.SessionModeState | None, config_options: Sequence[schema.SessionConfigOption] | None
) -> list[ModeChoice]:
    """Every mode the agent offers: its ``modes``, then the values of a ``mode`` config option that
    ``modes`` does not already list."""
    choices = [
        ModeChoice(mode.id, mode.name, mode.description)
        for mode in (modes.available_modes if modes is not None else ())
    ]
    seen = {choice.id for choice in choices}
    for option in config_options or ():
        if isinstance(option, schema.SessionConfigSelect) and option.category == "mode":
            for value in select_values(option):
                if value.value not in seen:
                    seen.add(value.value)
                    choices.append(ModeChoice(value.value, value.name, value.description, option.id))
    return choices


def current_mode(
    modes: schema.SessionModeState | None, config_options: Sequence[schema.SessionConfigOption] | None
) -> str | None:
    """The session's current mode: its ``modes``' current id, else a ``mode`` config option's value."""
    if modes is not None:
        return modes.current_mode_id
    for option in config_options or ():
        if isinstance(option, schema.SessionConfigSelect) and option.category == "mode":
            return option.current_value
    return None


def select_values(option: schema.SessionConfigSelect) -> list[schema.SessionConfigSelectOption]:
    """A select option's values, groups flattened, in order."""
    values: list[schema.SessionConfigSelectOption] = []
    for item in option.options:
        if isinstance(item, schema.SessionConfigSelectGroup):
            values.extend(item.options)
        else:
            values.append(item)
    return values


def reads_as_approving(mode: ModeChoice) -> bool:
    """Whether the mode's id or name reads like one that approves tool calls by itself."""
    return bool(_APPROVING_WORDS.search(mode.id) or _APPROVING_WORDS.search(mode.name))


@dataclass(frozen=True, slots=True)
class ModeAdvice:
    """The session's mode approves tool calls by itself; what a client holding a stricter policy can do."""

    current: ModeChoice
    switch_to: ModeChoice | None
    """The agent's asking mode (known from :data:`KNOWN_AGENT_MODES` and offered), or None: then all a
    client can do is warn."""
    known: bool
    """Whether the table says so (else the mode's name alone does)."""


def mode_advice(
    agent_name: str | None, offered: Sequence[ModeChoice], current: str | None
) -> ModeAdvice | None:
    """Advice when the session's ``current`` mode approves by itself; None when it does not (or
    nothing says it does)."""
    mode = next((choice for choice in offered if choice.id == current), None)
    if mode is None:
        return None
    known = known_agent_modes(agent_name)
    if known is not None and mode.id != known.asking:
        if mode.id not in known.approving:
            return None
        asking = next((choice for choice in offered if choice.id == known.asking), None)
        return ModeAdvice(current=mode, switch_to=asking, known=True)
    if known is None and reads_as_approving(mode):
        return ModeAdvice(current=mode, switch_to=None, known=False)
    return None
