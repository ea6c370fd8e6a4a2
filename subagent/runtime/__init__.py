"""The in-process agent runtime behind the ``spawn`` and ``fork`` providers and ``subagent serve``.

An :class:`Agent` holds a message log, a persona, tools and an LLM adapter, and runs turns:
model call, tool calls, model call, until the model answers without tools. Adapters stream
completions (:class:`ScriptedLlm` for tests and the demo; ``subagent.runtime.openai`` for any
OpenAI-compatible chat-completions server).
"""

from __future__ import annotations

from subagent.runtime.agent import (
    DEFAULT_MAX_MODEL_CALLS,
    Agent,
    AgentClosedError,
    AgentEvent,
    AgentRegistry,
    MessageDelivered,
    MessageRefused,
    MessageRefusedError,
    PendingMessage,
    ToolCallFinished,
    ToolCallStarted,
)
from subagent.runtime.llm import LlmAdapter, LlmError, LlmErrorKind, LlmService
from subagent.runtime.messages import (
    Completion,
    CompletionEvent,
    CompletionRequest,
    FinishReason,
    Message,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
)
from subagent.runtime.scripted import Reply, ScriptedLlm, When, call
from subagent.runtime.tools import Approver, FunctionTool, Tool, ToolContext, ToolError, ToolInvocation

__all__ = [
    "DEFAULT_MAX_MODEL_CALLS",
    "Agent",
    "AgentClosedError",
    "AgentEvent",
    "AgentRegistry",
    "Approver",
    "Completion",
    "CompletionEvent",
    "CompletionRequest",
    "FinishReason",
    "FunctionTool",
    "LlmAdapter",
    "LlmError",
    "LlmErrorKind",
    "LlmService",
    "Message",
    "MessageDelivered",
    "MessageRefused",
    "MessageRefusedError",
    "PendingMessage",
    "Reply",
    "ScriptedLlm",
    "TextDelta",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallFinished",
    "ToolCallStarted",
    "ToolContext",
    "ToolError",
    "ToolInvocation",
    "ToolSpec",
    "When",
    "call",
]
