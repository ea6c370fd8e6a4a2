"""Fake models that make a real agent delegate to a subagent of its own, offline (no test functions here).

Claude Code (through ``claude-agent-acp``) delegates with its ``Agent`` tool; Codex (through the ACP
project's ``codex-acp``, which runs ``codex app-server``) with ``spawn_agent``. The fake model scripts a
call of that tool, answers the child's own model calls, and closes the parent's turn once the child's
result is back. Each serve function here has the shape of `tests.test_real_agents.Serve`, so a test can run
a delegating turn through ``subagent run --json`` with that module's ``run_cli``::

    agent = dataclasses.replace(make_agent("claude"), serve=serve_claude_delegation(Delegation()))
    finished, server, log = await run_cli(agent, Turn(), tmp_path, permission="allow",
                                          options=("--mode", CLAUDE_DELEGATING_MODE))

or at the ACP level (`tests.test_real_agent_subagents`).

How each agent is made to delegate (read from the pinned agents' own code and requests):

* **Claude Code** offers ``Agent`` (``description``, ``prompt``, ``subagent_type``, ``run_in_background``:
  false here, as it runs children in the background by default). Its child's model calls carry the
  child's prompt as a user message of their own, which is how they are told apart from the parent's.
  Its start mode, ``auto``, first asks a classifier model (a call without tools) whether the ``Agent``
  call is safe, and blocks it when the answer does not parse: a delegating turn runs at
  `CLAUDE_DELEGATING_MODE`. After a turn it asks for a prompt suggestion (a call with tools that starts
  with an assistant message): answered with `SIDE_TEXT`, as any call not of the turn.
* **Codex** 0.166 offers its subagent tools only under the ``multi_agent_v2`` feature (the stub model,
  ``gpt-5.5``, has no multi-agent version of its own in Codex's catalog), inside a tool *namespace*
  ``collaboration``: ``spawn_agent`` (``task_name``, ``message``, ``fork_turns``), ``wait_agent``,
  ``interrupt_agent``... A call names the namespace beside the tool (`FunctionCall.namespace`). The
  parent spawns, then waits (``wait_agent``), then closes. Each model call names its agent in the
  ``x-codex-turn-metadata`` header (``agent_name``: ``/root``, the child ``/root/<task_name>``).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import anyio

from subagent.testing import (
    FunctionCall,
    MessagesReply,
    MessagesRequest,
    ResponsesReply,
    ResponsesRequest,
    ToolUse,
    serve_anthropic_messages,
    serve_responses,
)
from tests.test_real_agents import ModelLog, Serve, Served, Turn, base_env, claude_env, codex_config

USER_PROMPT: Final = "Delegate the errand to a subagent, then report."
CHILD_PROMPT: Final = "Child errand: reply with the child's answer."
CHILD_TITLE: Final = "Child errand"
"""Claude Code's ``description`` of the task, the child's title in its announcement."""
CHILD_TYPE: Final = "general-purpose"
"""Claude Code's ``subagent_type``, the child's description in its announcement."""
CODEX_TASK: Final = "errand"
"""Codex's ``task_name``: the child is agent ``/root/errand``, titled ``Errand``."""
PREAMBLE: Final = "I delegate the errand."
CHILD_ANSWER: Final = ("The child's ", "answer.")
CHILD_WROTE: Final = "The child wrote its file."
CHILD_DID_NOT_WRITE: Final = "The child could not write its file."
STALLED: Final = "The child starts"
CLOSING: Final = "The parent reports the child's answer."
SIDE_TEXT: Final = "Stub title"
CHILD_CONTENT: Final = "written by the child\n"

CHILD_USAGE: Final = (111, 22)
"""(input, output) tokens of each of the child's model calls: apart from the parent's (10, 5)."""

CLAUDE_DELEGATING_MODE: Final = "default"
"""The mode a delegating Claude Code turn runs at (see the module docstring: not ``auto``)."""

CLAUDE_AGENT_CALL: Final = "toolu_delegate_1"
CLAUDE_WRITE_CALL: Final = "toolu_child_write_1"
CODEX_SPAWN_CALL: Final = "call_spawn_1"
CODEX_WAIT_CALL: Final = "call_wait_1"
CODEX_CHILD_CALL: Final = "call_child_exec_1"
CODEX_NAMESPACE: Final = "collaboration"
CODEX_WAIT_MS: Final = 90_000
"""How long the parent's ``wait_agent`` waits for its child: longer than any test's turn may last."""
CODEX_STALLED_WAIT_MS: Final = 20_000
"""...and for a child that stalls, to be cancelled: a cancelled child never answers, so the wait lasts
all of it (Codex's least is 10 s)."""

CODEX_DELEGATION_FEATURES: Final = "multi_agent_v2 = true\n"
"""Appended to `tests.test_real_agents.codex_config`, whose last table is ``[features]``."""


@dataclass(frozen=True, slots=True)
class Delegation:
    """What the child does with its errand: ``answer`` (`CHILD_ANSWER`, then idle), ``stall`` (its model
    call hangs mid-answer until hung up on: a child to cancel), or ``write`` (it calls a tool that writes
    ``write``, which its agent asks about first, then reports whether the file exists)."""

    child: Literal["answer", "stall", "write"] = "answer"
    write: Path | None = None

    def __post_init__(self) -> None:
        if (self.child == "write") != (self.write is not None):
            raise ValueError("a child that writes needs the path it writes, and only it")


@dataclass
class DelegationLog(ModelLog):
    """`ModelLog` (``started`` counts the parent's turn starts, ``tool_results`` what the parent was told,
    ``stalled`` the child's hung calls) and the child's side: its turn starts, what its tools told it, and
    an event set once its call stalls."""

    child_started: int = 0
    child_tool_results: list[str] = field(default_factory=list)
    closings: int = 0
    child_stalled: anyio.Event = field(default_factory=anyio.Event)


def _texts_of(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        ]
    return []


def _text_of(content: Any) -> str:
    return "".join(_texts_of(content))


def _user_texts(messages: list[Any]) -> list[str]:
    return [
        text
        for message in messages
        if isinstance(message, dict) and message.get("role") == "user"
        for text in _texts_of(message.get("content"))
    ]


def _claude_tool_results(messages: list[Any]) -> dict[str, Mapping[str, Any]]:
    """The ``tool_result`` blocks after the last assistant message, by tool use id: what the tools just
    returned. Claude Code may put a system message after the one that carries them, so
    `MessagesRequest.tool_results` (the last message's) can miss them."""
    assistant = [
        index
        for index, message in enumerate(messages)
        if isinstance(message, dict) and message.get("role") == "assistant"
    ]
    since = assistant[-1] + 1 if assistant else 0
    return {
        str(block.get("tool_use_id")): block
        for message in messages[since:]
        if isinstance(message, dict)
        and message.get("role") == "user"
        and isinstance(message.get("content"), list)
        for block in message["content"]
        if isinstance(block, dict) and block.get("type") == "tool_result"
    }


def claude_responder(
    delegation: Delegation, log: DelegationLog
) -> Callable[[MessagesRequest], MessagesReply]:
    """The fake Messages model of a delegating Claude Code turn (see the module docstring)."""

    def respond(request: MessagesRequest) -> MessagesReply:
        if not request.tool_names:
            return MessagesReply(text=SIDE_TEXT)
        messages = request.messages
        results = _claude_tool_results(messages)
        if any(CHILD_PROMPT in text for text in _user_texts(messages)):
            return _claude_child(delegation, log, request, results)
        if CLAUDE_AGENT_CALL in results:
            log.tool_results.append(_text_of(results[CLAUDE_AGENT_CALL].get("content")))
            log.closings += 1
            return MessagesReply(text=CLOSING)
        # Whatever the user asked (``run_cli`` asks its own prompt): a call with tools and no answer yet.
        starts_turn = not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)
        if starts_turn:
            log.started += 1
            task = {
                "description": CHILD_TITLE,
                "prompt": CHILD_PROMPT,
                "subagent_type": CHILD_TYPE,
                "run_in_background": False,
            }
            return MessagesReply(text=PREAMBLE, tool_uses=[ToolUse(CLAUDE_AGENT_CALL, "Agent", task)])
        return MessagesReply(text=SIDE_TEXT)  # a prompt suggestion after the turn, say

    return respond


@dataclass(frozen=True, slots=True)
class _ChildStep:
    """What the child's model says next, whichever API it speaks: its text (pieces), whether the call
    stalls after its first ``stall_after`` events, and whether it calls its tool that writes."""

    text: str | tuple[str, ...] = ""
    stall_after: int | None = None
    writes: bool = False


def _child_step(
    delegation: Delegation, log: DelegationLog, told: str | None, disconnected: anyio.Event
) -> _ChildStep:
    """The child's next step, noted in ``log``: its report once its tool has told it ``told``, else the
    start of its errand."""
    if told is not None:
        log.child_tool_results.append(told)
        wrote = delegation.write is not None and delegation.write.exists()
        return _ChildStep(CHILD_WROTE if wrote else CHILD_DID_NOT_WRITE)
    log.child_started += 1
    if delegation.child == "stall":
        log.stalled.append(disconnected)
        log.child_stalled.set()
        # Both APIs' third event is the first text delta: the call hangs mid-answer.
        return _ChildStep((STALLED, " some more"), stall_after=3)
    return _ChildStep(writes=True) if delegation.write is not None else _ChildStep(CHILD_ANSWER)


def _claude_child(
    delegation: Delegation, log: DelegationLog, request: MessagesRequest, results: Mapping[str, Any]
) -> MessagesReply:
    result = results.get(CLAUDE_WRITE_CALL)
    told = None if result is None else _text_of(result.get("content"))
    step = _child_step(delegation, log, told, request.disconnected)
    uses = []
    if step.writes and delegation.write is not None:
        write = {"file_path": str(delegation.write), "content": CHILD_CONTENT}
        uses.append(ToolUse(CLAUDE_WRITE_CALL, "Write", write))
    input_tokens, output_tokens = CHILD_USAGE
    return MessagesReply(
        text=step.text,
        tool_uses=uses,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        stall_after=step.stall_after,
    )


def _serving(
    server_for: Callable[[DelegationLog], AbstractAsyncContextManager[Any]],
    env_for: Callable[[Path, str], dict[str, str]],
) -> Serve:
    """A `Serve` that runs ``server_for(log)`` (whose ``base_url`` the agent's ``env_for(home, base_url)``
    points at) for the block, and yields it with that environment and a fresh `DelegationLog`."""

    @asynccontextmanager
    async def serve(turn: Turn, home: Path) -> AsyncIterator[tuple[Served, dict[str, str], ModelLog]]:
        log = DelegationLog()
        async with server_for(log) as server:
            yield server, env_for(home, server.base_url), log

    return serve


def serve_claude_delegation(delegation: Delegation) -> Serve:
    """Serves the Messages API for a Claude Code turn that delegates (the `Turn` is not read)."""
    return _serving(lambda log: serve_anthropic_messages(claude_responder(delegation, log)), claude_env)


def _codex_agent(request: ResponsesRequest) -> str | None:
    """The agent a Codex model call is for (``/root``, ``/root/errand``), from its turn metadata."""
    try:
        metadata = json.loads(request.headers.get("x-codex-turn-metadata", ""))
    except ValueError:
        return None
    agent = metadata.get("agent_name") if isinstance(metadata, dict) else None
    return agent if isinstance(agent, str) else None


def codex_responder(
    delegation: Delegation, log: DelegationLog
) -> Callable[[ResponsesRequest], ResponsesReply]:
    """The fake Responses model of a delegating Codex turn (see the module docstring)."""

    def respond(request: ResponsesRequest) -> ResponsesReply:
        if not request.tool_names:
            return ResponsesReply(text=SIDE_TEXT)
        outputs = {str(output.get("call_id")): output for output in request.function_call_outputs}
        if _codex_agent(request) == f"/root/{CODEX_TASK}":
            return _codex_child(delegation, log, request, outputs)
        if CODEX_WAIT_CALL in outputs:
            log.tool_results.append(_text_of(outputs[CODEX_WAIT_CALL].get("output")))
            log.closings += 1
            return ResponsesReply(text=CLOSING)
        if CODEX_SPAWN_CALL in outputs:
            log.tool_results.append(_text_of(outputs[CODEX_SPAWN_CALL].get("output")))
            # A cancelled child sends no answer: the wait then lasts its whole timeout.
            timeout = CODEX_STALLED_WAIT_MS if delegation.child == "stall" else CODEX_WAIT_MS
            wait = FunctionCall(
                CODEX_WAIT_CALL, "wait_agent", json.dumps({"timeout_ms": timeout}), CODEX_NAMESPACE
            )
            return ResponsesReply(function_calls=[wait])
        log.started += 1
        task = {"task_name": CODEX_TASK, "message": CHILD_PROMPT, "fork_turns": "none"}
        spawn = FunctionCall(CODEX_SPAWN_CALL, "spawn_agent", json.dumps(task), CODEX_NAMESPACE)
        return ResponsesReply(text=PREAMBLE, function_calls=[spawn])

    return respond


def _codex_child(
    delegation: Delegation, log: DelegationLog, request: ResponsesRequest, outputs: Mapping[str, Any]
) -> ResponsesReply:
    output = outputs.get(CODEX_CHILD_CALL)
    told = None if output is None else _text_of(output.get("output"))
    step = _child_step(delegation, log, told, request.disconnected)
    calls = []
    if step.writes and delegation.write is not None:
        # At the read-only mode, a command that asks to leave the sandbox is asked about.
        arguments = {
            "cmd": f"printf %s {shlex.quote(CHILD_CONTENT)} > {shlex.quote(str(delegation.write))}",
            "sandbox_permissions": "require_escalated",
            "justification": "The errand writes a file.",
        }
        calls.append(FunctionCall(CODEX_CHILD_CALL, "exec_command", json.dumps(arguments)))
    input_tokens, output_tokens = CHILD_USAGE
    return ResponsesReply(
        text=step.text,
        function_calls=calls,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        stall_after=step.stall_after,
    )


def codex_delegation_config(base_url: str) -> str:
    """The ACP Codex adapter's ``config.toml`` (`tests.test_real_agents.codex_config`) with its subagent
    tools on."""
    config = codex_config("codex-acp", base_url)
    tables = [line for line in config.splitlines() if line.startswith("[")]
    assert tables[-1] == "[features]", tables  # what is appended lands in that table
    return config + CODEX_DELEGATION_FEATURES


def codex_env(home: Path, base_url: str) -> dict[str, str]:
    """The ACP Codex adapter's environment for a delegating run against the fake server at ``base_url``."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text(codex_delegation_config(base_url))
    env = base_env(home, base_url.removesuffix("/v1"))
    return env | {"CODEX_HOME": str(codex_home), "STUB_API_KEY": "sk-stub-not-a-key"}


def serve_codex_delegation(delegation: Delegation) -> Serve:
    """Serves the Responses API for an ACP Codex adapter turn that delegates (the `Turn` is not read)."""
    return _serving(lambda log: serve_responses(codex_responder(delegation, log)), codex_env)
