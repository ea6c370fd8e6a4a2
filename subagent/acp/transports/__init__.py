"""Where a child agent runs: a *transport* opens a *channel* to it from argv, env and cwd.

The package, one job per module:

* ``_channel``: the channel protocol every transport speaks: `Transport` (opens channels), `Channel`
  (the agent's stdin and stdout as anyio byte streams, how it ended, its stderr), `ExitInfo` and
  `TeardownReport` (how a channel ended), `check_command` (the check every transport applies to
  argv, env and cwd before it starts anything) and `BaseTransport` (which applies it);
* ``_local``: the default transport, a child process of ours (`open_agent_process`, `AgentProcess`,
  `LocalTransport`), and ``_supervisor``, the child subreaper it runs under (standard library only);
* ``_ssh``: `SshTransport`, a child on another host, through the system ``ssh`` client;
* ``_ray``: `RayTransport`, a child in an actor on a node of a Ray cluster (Ray is an extra,
  imported when a Ray transport is first used);
* ``_schemes``: `transport_from_url`, the transport a URL names (``local``, ``ssh://[user@]host[:port]``,
  ``ray://ADDRESS``), from the table `TRANSPORT_SCHEMES`.

The transports import nothing of the client's layers (connection, client, handlers, terminals): they
move bytes and own processes. The one exception runs on a Ray node only: a Ray transport that serves
the agent's files there loads the client's file handling (`subagent.acp._file_router`) in its actor.
The names below are loaded when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "SIGKILL_TIMEOUT",
    "SIGTERM_TIMEOUT",
    "STDERR_SETTLE_TIMEOUT",
    "STDERR_TAIL_BYTES",
    "STDIN_CLOSE_TIMEOUT",
    "TRANSPORT_SCHEMES",
    "UNKNOWN_RETURNCODE",
    "AgentProcess",
    "BaseTransport",
    "Channel",
    "ExitInfo",
    "Launch",
    "LocalTransport",
    "RayChannel",
    "RayTransport",
    "SshChannel",
    "SshTransport",
    "TeardownReport",
    "TeardownStep",
    "Transport",
    "check_command",
    "open_agent_process",
    "supervision_available",
    "transport_from_url",
]

if TYPE_CHECKING:
    from subagent.acp.transports._channel import (
        UNKNOWN_RETURNCODE,
        BaseTransport,
        Channel,
        ExitInfo,
        Launch,
        TeardownReport,
        TeardownStep,
        Transport,
        check_command,
    )
    from subagent.acp.transports._local import (
        SIGKILL_TIMEOUT,
        SIGTERM_TIMEOUT,
        STDERR_SETTLE_TIMEOUT,
        STDERR_TAIL_BYTES,
        STDIN_CLOSE_TIMEOUT,
        AgentProcess,
        LocalTransport,
        open_agent_process,
        supervision_available,
    )
    from subagent.acp.transports._ray import RayChannel, RayTransport
    from subagent.acp.transports._schemes import TRANSPORT_SCHEMES, transport_from_url
    from subagent.acp.transports._ssh import SshChannel, SshTransport
else:
    from subagent._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(
        __name__,
        __all__,
        {
            "subagent.acp.transports._local": (
                "SIGKILL_TIMEOUT",
                "SIGTERM_TIMEOUT",
                "STDERR_SETTLE_TIMEOUT",
                "STDERR_TAIL_BYTES",
                "STDIN_CLOSE_TIMEOUT",
                "AgentProcess",
                "LocalTransport",
                "open_agent_process",
                "supervision_available",
            ),
            "subagent.acp.transports._ray": ("RayChannel", "RayTransport"),
            "subagent.acp.transports._schemes": ("TRANSPORT_SCHEMES", "transport_from_url"),
            "subagent.acp.transports._ssh": ("SshChannel", "SshTransport"),
        },
        default="subagent.acp.transports._channel",
    )
