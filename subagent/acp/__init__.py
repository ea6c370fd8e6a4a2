"""The Agent Client Protocol client, usable on its own.

Layers, each usable without the ones above it:

* :mod:`subagent.acp.schema`: the wire types, generated from the ACP JSON Schema (``_wire``: their
  codec);
* ``_errors``: every exception of this package, in one tree (all exported here);
* :mod:`subagent.acp.connection`: JSON-RPC 2.0 over any anyio byte-stream pair, knowing no ACP method;
* :mod:`subagent.acp.transports`: where an agent runs: a transport opens a channel to it (a child
  process we own, from spawn to reaped process group, by default; ``transport_from_url`` names others,
  such as ``ssh://host``);
* :mod:`subagent.acp.client`: the typed client session (:class:`AcpClient`, :func:`spawn_agent`);
  ``_turn_usage`` gathers a turn's token usage from wherever the agent put it;
* :mod:`subagent.acp.handlers`: what the client serves to the agent (fs sandbox, permission policies);
  :mod:`subagent.acp.terminals` its terminals; ``_elicitation`` the agent's questions for structured
  input (``elicitation/create``); ``_modes`` session modes, and which of an agent's modes approve tool
  calls by themselves; ``_file_router`` the same fs and terminal handling, run where the agent runs
  (on a Ray node);
* :mod:`subagent.acp.agent`: the other side, for writing an agent (``_stdio``: this process's stdin
  and stdout as anyio byte streams).

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
    "ElicitationCallback",
    "ElicitationChoice",
    "ElicitationField",
    "ElicitationQuestion",
    "ExitInfo",
    "FsSandbox",
    "InvalidResponseError",
    "LocalTransport",
    "MalformedMessageError",
    "MessageTooLargeError",
    "ModeChoice",
    "PermissionOption",
    "PermissionPolicy",
    "PermissionQuestion",
    "ProtocolError",
    "ProtocolVersionError",
    "RequestError",
    "RpcErrorCode",
    "SessionSettingError",
    "Transport",
    "TurnResult",
    "UnexpectedResponseError",
    "final_message",
    "open_agent_process",
    "spawn_agent",
    "transport_from_url",
]

if TYPE_CHECKING:
    from subagent.acp._elicitation import (
        ElicitationAnswer,
        ElicitationCallback,
        ElicitationChoice,
        ElicitationField,
        ElicitationQuestion,
    )
    from subagent.acp._errors import (
        AcpError,
        AgentCapabilityError,
        AgentError,
        AgentExitedError,
        AgentProcessError,
        AgentSpawnError,
        AuthenticationRequiredError,
        ConnectionClosedError,
        InvalidResponseError,
        MalformedMessageError,
        MessageTooLargeError,
        ProtocolError,
        ProtocolVersionError,
        RequestError,
        RpcErrorCode,
        SessionSettingError,
        UnexpectedResponseError,
    )
    from subagent.acp._modes import ModeChoice
    from subagent.acp.client import AcpClient, AcpSession, TurnResult, final_message, spawn_agent
    from subagent.acp.connection import Connection
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
            "subagent.acp._elicitation": (
                "ElicitationAnswer",
                "ElicitationCallback",
                "ElicitationChoice",
                "ElicitationField",
                "ElicitationQuestion",
            ),
            "subagent.acp._modes": ("ModeChoice",),
            "subagent.acp.client": ("AcpClient", "AcpSession", "TurnResult", "final_message", "spawn_agent"),
            "subagent.acp.connection": ("Connection",),
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
        default="subagent.acp._errors",
    )
