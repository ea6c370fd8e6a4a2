"""The Agent Client Protocol client, usable on its own.

Layers, each usable without the ones above it:

* :mod:`subagent.acp.schema`: the wire types, generated from the ACP JSON Schema;
* :mod:`subagent.acp.connection`: JSON-RPC 2.0 over any anyio byte-stream pair, knowing no ACP method;
* :mod:`subagent.acp.process`: a child agent process we own, from spawn to reaped process group;
* :mod:`subagent.acp.client`: the typed client session (:class:`AcpClient`, :func:`spawn_agent`);
* :mod:`subagent.acp.handlers`: what the client serves to the agent (fs sandbox, permission policies).
"""

from __future__ import annotations

from subagent.acp.client import (
    AcpClient,
    AgentCapabilityError,
    AgentError,
    AgentExitedError,
    AuthenticationRequiredError,
    ClientSession,
    ProtocolVersionError,
    TurnResult,
    final_message,
    spawn_agent,
)
from subagent.acp.connection import Connection
from subagent.acp.errors import AcpError, ConnectionClosedError, ProtocolError, RequestError
from subagent.acp.handlers import (
    AllowPolicy,
    CallbackPolicy,
    DenyPolicy,
    FsSandbox,
    PermissionOption,
    PermissionPolicy,
    PermissionQuestion,
)
from subagent.acp.process import AgentProcess, AgentSpawnError, ExitInfo, open_agent_process

__all__ = [
    "AcpClient",
    "AcpError",
    "AgentCapabilityError",
    "AgentError",
    "AgentExitedError",
    "AgentProcess",
    "AgentSpawnError",
    "AllowPolicy",
    "AuthenticationRequiredError",
    "CallbackPolicy",
    "ClientSession",
    "Connection",
    "ConnectionClosedError",
    "DenyPolicy",
    "ExitInfo",
    "FsSandbox",
    "PermissionOption",
    "PermissionPolicy",
    "PermissionQuestion",
    "ProtocolError",
    "ProtocolVersionError",
    "RequestError",
    "TurnResult",
    "final_message",
    "open_agent_process",
    "spawn_agent",
]
