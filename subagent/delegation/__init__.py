"""Delegation as a model sees it: the ``subagent`` tool, background children, and what a call came to.

The package, one job per module:

* ``_subagent_tool``: `SubagentTool`, the model-facing tool over a service (its definition derived
  from the registry, its execution disposing the run on every path), `AgentSubagentTool` (the same
  tool for an in-process agent) and `AgentCompanionTool` (the companion tools of background runs);
* ``_background``: `BackgroundChildren`, the children a parent started in the background, and how
  the parent hears back (`Notice`, `BackgroundOptions`);
* ``_results``: `SubagentToolResult`, what one call came to, and `Spill`, an output too large for the
  parent's context kept in a file.

``subagent.tool`` re-exports the tool's names (DESIGN.md's path for it). The names below are loaded
when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "COMPANION_ACTIONS",
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_SPILL_BYTES",
    "DEFAULT_TOOL_NAME",
    "HOST_PARENT",
    "WAKE_PROMPT",
    "AgentCompanionTool",
    "AgentSubagentTool",
    "BackgroundChildren",
    "BackgroundError",
    "BackgroundErrorKind",
    "BackgroundOptions",
    "ChildInfo",
    "ChildState",
    "Notice",
    "Spill",
    "SubagentTool",
    "SubagentToolResult",
    "ToolDefinition",
    "WaitOutcome",
    "WakeTurn",
]

if TYPE_CHECKING:
    from subagent.delegation._background import (
        DEFAULT_MAX_RUNNING,
        DEFAULT_SPILL_BYTES,
        WAKE_PROMPT,
        BackgroundChildren,
        BackgroundError,
        BackgroundErrorKind,
        BackgroundOptions,
        ChildInfo,
        ChildState,
        Notice,
        WaitOutcome,
        WakeTurn,
    )
    from subagent.delegation._results import Spill, SubagentToolResult
    from subagent.delegation._subagent_tool import (
        COMPANION_ACTIONS,
        DEFAULT_TOOL_NAME,
        HOST_PARENT,
        AgentCompanionTool,
        AgentSubagentTool,
        SubagentTool,
        ToolDefinition,
    )
else:
    from subagent._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(
        __name__,
        __all__,
        {
            "subagent.delegation._results": ("Spill", "SubagentToolResult"),
            "subagent.delegation._subagent_tool": (
                "COMPANION_ACTIONS",
                "DEFAULT_TOOL_NAME",
                "HOST_PARENT",
                "AgentCompanionTool",
                "AgentSubagentTool",
                "SubagentTool",
                "ToolDefinition",
            ),
        },
        default="subagent.delegation._background",
    )
