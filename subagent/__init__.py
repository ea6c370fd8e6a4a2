"""subagent-seam: one AI agent delegates work to another.

The service keeps a registry of named providers (ways to run a child agent) and owns every run it
starts. The vocabulary below is the whole contract between callers, the service and providers.

The names are loaded when first used: ``import subagent.acp`` (the ACP client alone) loads none of
the seam.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "DEFAULT_PROGRESS_INTERVAL",
    "START_TIME_FEATURES",
    "Disposer",
    "ErrorCode",
    "EventHub",
    "EventName",
    "Lineage",
    "ObservableRun",
    "ProviderSnapshot",
    "QueueableRun",
    "ResumableRun",
    "RunState",
    "ServiceRun",
    "StartTimeFeature",
    "SteerableRun",
    "StopReason",
    "SubagentCapabilities",
    "SubagentError",
    "SubagentProgressInfo",
    "SubagentProvider",
    "SubagentRequest",
    "SubagentResult",
    "SubagentRun",
    "SubagentRunEndInfo",
    "SubagentRunInfo",
    "SubagentService",
    "ToolFilter",
    "Usage",
]

if TYPE_CHECKING:
    from subagent.events import EventHub, EventName
    from subagent.service import DEFAULT_PROGRESS_INTERVAL, RunState, ServiceRun, SubagentService
    from subagent.types import (
        START_TIME_FEATURES,
        Disposer,
        ErrorCode,
        Lineage,
        ObservableRun,
        ProviderSnapshot,
        QueueableRun,
        ResumableRun,
        StartTimeFeature,
        SteerableRun,
        StopReason,
        SubagentCapabilities,
        SubagentError,
        SubagentProgressInfo,
        SubagentProvider,
        SubagentRequest,
        SubagentResult,
        SubagentRun,
        SubagentRunEndInfo,
        SubagentRunInfo,
        ToolFilter,
        Usage,
    )
else:
    from subagent._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(
        __name__,
        __all__,
        {
            "subagent.events": ("EventHub", "EventName"),
            "subagent.service": ("DEFAULT_PROGRESS_INTERVAL", "RunState", "ServiceRun", "SubagentService"),
        },
        default="subagent.types",
    )
