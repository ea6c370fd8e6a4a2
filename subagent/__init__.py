"""subagent-seam: one AI agent delegates work to another.

The service keeps a registry of named providers (ways to run a child agent) and owns every run it
starts. The vocabulary below is the whole contract between callers, the service and providers.
"""

from __future__ import annotations

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
