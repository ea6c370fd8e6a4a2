"""Test support shipped to users: a scriptable stub ACP agent, fake model servers, leak checks, and
a pytest plugin.

* ``python -m subagent.testing.stub_agent --scenario FILE``: the stub agent itself; `stub_agent_argv`
  builds that command line. The scenario format (what it answers, streams, asks, breaks) is `Scenario`,
  documented in ``_scenario``.
* `StubAgentTransport` (``_in_process``): the same stub agent served inside the test's own event loop, over
  memory streams: a `Transport` to pass to ``AcpProvider(..., transport=...)``, with no process to start.
  `InProcessTransport` serves any `AgentHandler` that way; `memory_byte_pipe` is the byte stream under it.
* `subagent.testing.pytest_plugin`: the ``stub_agent_command`` and ``stub_agent_transport`` fixtures,
  registered with pytest on install.
* `serve_chat_completions` (``_chat_server``): a scripted OpenAI-compatible chat-completions server on
  loopback, run inside the test's own event loop.
* `serve_anthropic_messages` (``_anthropic_server``, Anthropic Messages, what Claude Code speaks) and
  `serve_responses` (``_responses_server``, OpenAI Responses, what Codex speaks): fake model servers of
  the same kind that answer from the request, so that a real agent can do full turns offline.
* `assert_no_leaks` (``_leaks``): a block leaves no child process, task or file descriptor behind.
* `subagent.testing.fakes` (providers the test drives step by step) and `subagent.testing.contract`
  (the seam's lifecycle contract, to check any provider against).

This package deliberately does not import the stub agent or pytest, so importing it stays cheap.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

__all__ = [
    "DEFAULT_SCENARIO_PATH",
    "IN_PROCESS_VIA",
    "LEAK_TAG_VARIABLE",
    "MEMORY_CHUNK_BYTES",
    "MEMORY_PIPE_CHUNKS",
    "STUB_AGENT_MODULE",
    "AnthropicMessagesServer",
    "ChatCompletionsServer",
    "ChatReply",
    "DropConnection",
    "ErrorReply",
    "FunctionCall",
    "InProcessChannel",
    "InProcessOptions",
    "InProcessTransport",
    "JsonReply",
    "MalformedChunk",
    "MemoryByteReceiveStream",
    "MemoryByteSendStream",
    "MessagesError",
    "MessagesReply",
    "MessagesRequest",
    "ProcessInfo",
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
    "StubAgentTransport",
    "ToolCallReply",
    "ToolUse",
    "assert_no_leaks",
    "assert_same_fds",
    "dump_scenario",
    "leak_tag",
    "leaked_processes",
    "live_group_members",
    "load_scenario",
    "memory_byte_pipe",
    "open_fd_count",
    "open_fds",
    "parse_scenario",
    "process_info",
    "process_is_gone",
    "serve_anthropic_messages",
    "serve_chat_completions",
    "serve_responses",
    "stub_agent_argv",
]

if TYPE_CHECKING:
    from subagent.testing._anthropic_server import (
        AnthropicMessagesServer,
        MessagesError,
        MessagesReply,
        MessagesRequest,
        ToolUse,
        serve_anthropic_messages,
    )
    from subagent.testing._chat_server import (
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
    from subagent.testing._in_process import (
        IN_PROCESS_VIA,
        MEMORY_CHUNK_BYTES,
        MEMORY_PIPE_CHUNKS,
        InProcessChannel,
        InProcessOptions,
        InProcessTransport,
        MemoryByteReceiveStream,
        MemoryByteSendStream,
        StubAgentTransport,
        memory_byte_pipe,
    )
    from subagent.testing._leaks import (
        LEAK_TAG_VARIABLE,
        ProcessInfo,
        assert_no_leaks,
        assert_same_fds,
        leak_tag,
        leaked_processes,
        live_group_members,
        open_fd_count,
        open_fds,
        process_info,
        process_is_gone,
    )
    from subagent.testing._responses_server import (
        FunctionCall,
        ResponsesReply,
        ResponsesRequest,
        ResponsesServer,
        serve_responses,
    )
    from subagent.testing._scenario import (
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
            "subagent.testing._anthropic_server": (
                "AnthropicMessagesServer",
                "MessagesError",
                "MessagesReply",
                "MessagesRequest",
                "ToolUse",
                "serve_anthropic_messages",
            ),
            "subagent.testing._in_process": (
                "IN_PROCESS_VIA",
                "MEMORY_CHUNK_BYTES",
                "MEMORY_PIPE_CHUNKS",
                "InProcessChannel",
                "InProcessOptions",
                "InProcessTransport",
                "MemoryByteReceiveStream",
                "MemoryByteSendStream",
                "StubAgentTransport",
                "memory_byte_pipe",
            ),
            "subagent.testing._leaks": (
                "LEAK_TAG_VARIABLE",
                "ProcessInfo",
                "assert_no_leaks",
                "assert_same_fds",
                "leak_tag",
                "leaked_processes",
                "live_group_members",
                "open_fd_count",
                "open_fds",
                "process_info",
                "process_is_gone",
            ),
            "subagent.testing._responses_server": (
                "FunctionCall",
                "ResponsesReply",
                "ResponsesRequest",
                "ResponsesServer",
                "serve_responses",
            ),
            "subagent.testing._scenario": (
                "DEFAULT_SCENARIO_PATH",
                "Scenario",
                "ScenarioError",
                "Step",
                "dump_scenario",
                "load_scenario",
                "parse_scenario",
            ),
        },
        default="subagent.testing._chat_server",
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
