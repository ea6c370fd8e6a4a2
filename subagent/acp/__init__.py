"""The Agent Client Protocol client, usable on its own.

Layers, each usable without the ones above it:

* :mod:`subagent.acp.schema`: the wire types, generated from the ACP JSON Schema;
* :mod:`subagent.acp.errors`: every exception of this package, in one tree;
* :mod:`subagent.acp.connection`: JSON-RPC 2.0 over any anyio byte-stream pair, knowing no ACP method;
* :mod:`subagent.acp.transports`: where an agent runs: a transport opens a channel to it (a child
  process we own, from spawn to reaped process group, by default; ``transport_from_url`` names others,
  such as ``ssh://host``);
* :mod:`subagent.acp.client`: the typed client session (:class:`AcpClient`, :func:`spawn_agent`);
* :mod:`subagent.acp.handlers`: what the client serves to the agent (fs sandbox, permission policies);
* :mod:`subagent.acp.elicitation`: the agent's questions for structured input (``elicitation/create``);
* :mod:`subagent.acp.modes`: session modes, and which of an agent's modes approve tool calls by themselves;
* :mod:`subagent.acp.agent`: the other side, for writing an agent;
* :mod:`subagent.acp.stdio`: file descriptors (this process's stdin/stdout) as anyio byte streams.

Nothing here imports the seam (`subagent.service`, `subagent.types`...). The names below are loaded
when first used, so ``import subagent.acp`` costs next to nothing until then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "AcpClient",
    "AcpError",
    "AcpSession",
    "AgentCapabilityError",
    "AgentError",
    "AgentExitedError",
    "AgentProcess",
    "AgentProcessError",
    "AgentSpawnError",
    "AllowPolicy",
    "AuthenticationRequiredError",
    "CallbackPolicy",
    "Channel",
    "Connection",
    "ConnectionClosedError",
    "DenyPolicy",
    "ElicitationAnswer",
    "ElicitationQuestion",
    "ExitInfo",
    "FsSandbox",
    "LocalTransport",
    "PermissionOption",
    "PermissionPolicy",
    "PermissionQuestion",
    "ProtocolError",
    "ProtocolVersionError",
    "RequestError",
    "SessionSettingError",
    "Transport",
    "TurnResult",
    "final_message",
    "open_agent_process",
    "spawn_agent",
    "transport_from_url",
]

if TYPE_CHECKING:
    from subagent.acp.client import AcpClient, AcpSession, TurnResult, final_message, spawn_agent
    from subagent.acp.connection import Connection
    from subagent.acp.elicitation import ElicitationAnswer, ElicitationQuestion
    from subagent.acp.errors import (
        AcpError,
        AgentCapabilityError,
        AgentError,
        AgentExitedError,
        AgentProcessError,
        AgentSpawnError,
        AuthenticationRequiredError,
        ConnectionClosedError,
        ProtocolError,
        ProtocolVersionError,
        RequestError,
        SessionSettingError,
    )
    from subagent.acp.handlers import (
        AllowPolicy,
        CallbackPolicy,
        DenyPolicy,
        FsSandbox,
        PermissionOption,
        PermissionPolicy,
        PermissionQuestion,
    )
    from subagent.acp.transports._channel import Channel, ExitInfo, Transport
    from subagent.acp.transports._local import AgentProcess, LocalTransport, open_agent_process
    from subagent.acp.transports._schemes import transport_from_url
else:
    from subagent._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(
        __name__,
        __all__,
        {
            "subagent.acp.client": ("AcpClient", "AcpSession", "TurnResult", "final_message", "spawn_agent"),
            "subagent.acp.connection": ("Connection",),
            "subagent.acp.elicitation": ("ElicitationAnswer", "ElicitationQuestion"),
            "subagent.acp.handlers": (
                "AllowPolicy",
                "CallbackPolicy",
                "DenyPolicy",
                "FsSandbox",
                "PermissionOption",
                "PermissionPolicy",
                "PermissionQuestion",
            ),
            "subagent.acp.transports._channel": ("Channel", "ExitInfo", "Transport"),
            "subagent.acp.transports._local": ("AgentProcess", "LocalTransport", "open_agent_process"),
            "subagent.acp.transports._schemes": ("transport_from_url",),
        },
        default="subagent.acp.errors",
    )
