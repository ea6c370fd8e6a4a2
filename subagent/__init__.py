"""subagent-seam: one AI agent delegates work to another.

The service keeps a registry of named providers (ways to run a child agent) and owns every run it
starts. The vocabulary below is the whole contract between callers, the service and providers.

The names are loaded when first used: ``import subagent.acp`` (the ACP client alone) loads none of
the seam.
"""

# ruff: noqa: F403, F405 (type checkers take the vocabulary by star import below: see the comment there)
from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "BUDGET_FIELDS",
    "DEFAULT_PROGRESS_INTERVAL",
    "START_TIME_FEATURES",
    "Budget",
    "BudgetAccount",
    "BudgetField",
    "CheckpointedRun",
    "CleanupPolicy",
    "Disposer",
    "ErrorCode",
    "EventHub",
    "EventName",
    "FileChange",
    "IsolationMode",
    "IsolationSettings",
    "LimitHit",
    "Lineage",
    "ObservableRun",
    "Price",
    "PriceTable",
    "ProviderSnapshot",
    "QueueableRun",
    "ReopenableProvider",
    "ResumableRun",
    "ResumePoint",
    "RunJournal",
    "RunRecord",
    "RunState",
    "ServiceRun",
    "Spend",
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
    "WorkspaceChange",
]

if TYPE_CHECKING:
    # Type checkers see every export eagerly, each name written once: a star import takes its module's
    # own __all__. What the package exports is its __all__ above (types.py's also has a few helpers).
    from subagent.budget import BudgetAccount, Price, PriceTable
    from subagent.events import EventHub, EventName
    from subagent.isolation import IsolationSettings
    from subagent.journal import RunJournal, RunRecord
    from subagent.service import *
    from subagent.types import *
else:
    from subagent._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(
        __name__,
        __all__,
        {
            "subagent.budget": ("BudgetAccount", "Price", "PriceTable"),
            "subagent.events": ("EventHub", "EventName"),
            "subagent.isolation": ("IsolationSettings",),
            "subagent.journal": ("RunJournal", "RunRecord"),
            "subagent.service": ("DEFAULT_PROGRESS_INTERVAL", "RunState", "ServiceRun", "SubagentService"),
        },
        default="subagent.types",
    )
