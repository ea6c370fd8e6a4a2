"""Providers: the ways of running a child agent that the service can register.

* `AcpProvider` (:mod:`subagent.providers.acp`): a child agent process spoken to over ACP;
* `SpawnProvider` (:mod:`subagent.providers.spawn`): a fresh in-process agent;
* `ForkProvider` (:mod:`subagent.providers.fork`): an in-process agent that starts from its parent's
  conversation.

Each is loaded when first used: ``import subagent.providers.spawn`` does not load the ACP client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["AcpProvider", "ForkProvider", "SpawnProvider"]

if TYPE_CHECKING:
    from subagent.providers.acp import AcpProvider
    from subagent.providers.fork import ForkProvider
    from subagent.providers.spawn import SpawnProvider
else:
    from subagent._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(
        __name__,
        __all__,
        {
            "subagent.providers.acp": ("AcpProvider",),
            "subagent.providers.fork": ("ForkProvider",),
            "subagent.providers.spawn": ("SpawnProvider",),
        },
    )
