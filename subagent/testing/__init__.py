"""Test support shipped to users: a scriptable stub ACP agent and a pytest plugin.

* `subagent.testing.scenario`: the scenario format (what the stub agent answers, streams, asks, breaks).
* ``python -m subagent.testing.stub_agent --scenario FILE``: the stub agent itself; `stub_agent_argv`
  builds that command line.
* `subagent.testing.pytest_plugin`: the ``stub_agent_command`` fixture, registered with pytest on install.
* `subagent.testing.chat_server`: `serve_chat_completions`, a scripted OpenAI-compatible chat-completions
  server on loopback, run inside the test's own event loop.
* `subagent.testing.anthropic_server` and `subagent.testing.responses_server`: `serve_anthropic_messages`
  (Anthropic Messages, what Claude Code speaks) and `serve_responses` (OpenAI Responses, what Codex
  speaks), fake model servers of the same kind that answer from the request, so that a real agent can do
  full turns offline.

This package deliberately does not import the stub agent or pytest, so importing it stays cheap.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

__all__ = [
    "DEFAULT_SCENARIO_PATH",
    "STUB_AGENT_MODULE",
    "AnthropicMessagesServer",
    "ChatCompletionsServer",
    "ChatReply",
    "DropConnection",
    "ErrorReply",
    "FunctionCall",
    "JsonReply",
    "MalformedChunk",
    "MessagesError",
    "MessagesReply",
    "MessagesRequest",
    "RawStream",
    "ReceivedRequest",
    "ResponsesReply",
    "ResponsesRequest",
    "ResponsesServer",
    "Scenario",
    "ScenarioError",
    "StallReply",
    "Step",
    "StreamedReply",
    "ToolCallReply",
    "ToolUse",
    "dump_scenario",
    "load_scenario",
    "parse_scenario",
    "serve_anthropic_messages",
    "serve_chat_completions",
    "serve_responses",
    "stub_agent_argv",
]

if TYPE_CHECKING:
    from subagent.testing.anthropic_server import (
        AnthropicMessagesServer,
        MessagesError,
        MessagesReply,
        MessagesRequest,
        ToolUse,
        serve_anthropic_messages,
    )
    from subagent.testing.chat_server import (
        ChatCompletionsServer,
        ChatReply,
        DropConnection,
        ErrorReply,
        JsonReply,
        MalformedChunk,
        RawStream,
        ReceivedRequest,
        StallReply,
        StreamedReply,
        ToolCallReply,
        serve_chat_completions,
    )
    from subagent.testing.responses_server import (
        FunctionCall,
        ResponsesReply,
        ResponsesRequest,
        ResponsesServer,
        serve_responses,
    )
    from subagent.testing.scenario import (
        DEFAULT_SCENARIO_PATH,
        Scenario,
        ScenarioError,
        Step,
        dump_scenario,
        load_scenario,
        parse_scenario,
    )
else:
    from subagent._lazy import lazy_exports

    # Loaded when first used: the stub agent, started hundreds of times by a test suite, imports this
    # package for its scenario format only, and the fake model servers (h11 and all) cost ~60 ms a start.
    __getattr__, __dir__ = lazy_exports(
        __name__,
        [name for name in __all__ if name not in ("STUB_AGENT_MODULE", "stub_agent_argv")],
        {
            "subagent.testing.anthropic_server": (
                "AnthropicMessagesServer",
                "MessagesError",
                "MessagesReply",
                "MessagesRequest",
                "ToolUse",
                "serve_anthropic_messages",
            ),
            "subagent.testing.chat_server": (
                "ChatCompletionsServer",
                "ChatReply",
                "DropConnection",
                "ErrorReply",
                "JsonReply",
                "MalformedChunk",
                "RawStream",
                "ReceivedRequest",
                "StallReply",
                "StreamedReply",
                "ToolCallReply",
                "serve_chat_completions",
            ),
            "subagent.testing.responses_server": (
                "FunctionCall",
                "ResponsesReply",
                "ResponsesRequest",
                "ResponsesServer",
                "serve_responses",
            ),
            "subagent.testing.scenario": (
                "DEFAULT_SCENARIO_PATH",
                "Scenario",
                "ScenarioError",
                "Step",
                "dump_scenario",
                "load_scenario",
                "parse_scenario",
            ),
        },
    )

STUB_AGENT_MODULE = "subagent.testing.stub_agent"
"""The module that runs the stub agent (``python -m``)."""


def stub_agent_argv(
    scenario_path: str | os.PathLike[str] | None = None, *, python: str = sys.executable
) -> list[str]:
    """The command that runs the stub agent on ``scenario_path`` (the bundled default scenario if None)."""
    argv = [python, "-m", STUB_AGENT_MODULE]
    if scenario_path is not None:
        argv += ["--scenario", os.fspath(scenario_path)]
    return argv
