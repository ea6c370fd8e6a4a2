"""The model-facing ``subagent`` tool, at the path DESIGN.md gives it: the tool's names from
:mod:`subagent.delegation`, where it lives with background delegation and tool results."""

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

__all__ = [
    "COMPANION_ACTIONS",
    "DEFAULT_TOOL_NAME",
    "HOST_PARENT",
    "AgentCompanionTool",
    "AgentSubagentTool",
    "Spill",
    "SubagentTool",
    "SubagentToolResult",
    "ToolDefinition",
]
