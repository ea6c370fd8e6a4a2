"""The in-process agent runtime: turns, tools, approval, messages, cancellation, and ScriptedLlm.

Every async test runs on asyncio and on trio. Models are scripted; every wait is bounded by
``anyio.fail_after``, and nothing sleeps to wait for something to happen.
"""

from __future__ import annotations

import ast
import dataclasses
import gc
import importlib.util
import json
import logging
import operator
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from subagent.runtime import (
    Agent,
    AgentClosedError,
    AgentEvent,
    AgentRegistry,
    Completion,
    CompletionEvent,
    CompletionRequest,
    FunctionTool,
    LlmAdapter,
    LlmError,
    LlmErrorKind,
    LlmService,
    Message,
    MessageDelivered,
    MessageRefused,
    MessageRefusedError,
    Reply,
    ScriptedLlm,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallFinished,
    ToolCallStarted,
    ToolContext,
    ToolError,
    ToolInvocation,
    ToolSpec,
    When,
    call,
)
from subagent.types import LimitHit, SubagentResult, Usage, thaw_json

pytestmark = pytest.mark.anyio

WAIT = 5  # seconds; a bound on every wait, never a sleep

AGENT_LOGGER = "subagent.runtime._inprocess_agent"

ADD_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}

# The output schema of the structured-output tests, and its text exactly as the model reads it.
COUNT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
}
COUNT_SCHEMA_TEXT = """{
  "type": "object",
  "properties": {
    "n": {
      "type": "integer"
    }
  },
  "required": [
    "n"
  ]
}"""


def add_tool(calls: list[Mapping[str, Any]] | None = None) -> FunctionTool:
    """Adds two integers; records the arguments of each call in ``calls``."""

    def add(arguments: Mapping[str, Any]) -> str:
        if calls is not None:
            calls.append(arguments)
        return str(arguments["a"] + arguments["b"])

    return FunctionTool("add", "Add two integers.", ADD_PARAMETERS, add)


def echo_tool(calls: list[Mapping[str, Any]] | None = None) -> FunctionTool:
    def echo(arguments: Mapping[str, Any]) -> str:
        if calls is not None:
            calls.append(arguments)
        return json.dumps(dict(arguments))

    return FunctionTool("echo", "Echo the arguments.", {"type": "object"}, echo)


def function_tool(
    name: str, function: Callable[[Mapping[str, Any]], Awaitable[str] | str], *, needs_approval: bool = False
) -> FunctionTool:
    return FunctionTool(
        name, f"The {name} tool.", {"type": "object"}, function, needs_approval=needs_approval
    )


class RecordingTool:
    """A tool that records the very invocation objects it runs with."""

    def __init__(self, name: str, output: str = "done", *, needs_approval: bool = False) -> None:
        self._spec = ToolSpec(name, f"The {name} tool.", {"type": "object"})
        self._needs_approval = needs_approval
        self.output = output
        self.invocations: list[ToolInvocation] = []

    @property
    def spec(self) -> ToolSpec:
        return self._spec

    @property
    def needs_approval(self) -> bool:
        return self._needs_approval

    async def run(self, invocation: ToolInvocation) -> str:
        self.invocations.append(invocation)
        return self.output


class Gate:
    """Holds a scripted model call (``Reply(wait=gate.wait)``) until the test releases it."""

    def __init__(self) -> None:
        self.entered = anyio.Event()
        self.release = anyio.Event()

    async def wait(self) -> None:
        self.entered.set()
        await self.release.wait()


async def hang() -> None:
    """A model call that never answers."""
    await anyio.sleep_forever()


def record_events(agent: Agent) -> list[AgentEvent]:
    events: list[AgentEvent] = []
    agent.on_event(events.append)
    return events


async def run_into(results: list[SubagentResult], agent: Agent, prompt: str) -> None:
    """Run a turn in a task of its own; its outcome lands in ``results``."""
    results.append(await agent.run_turn(prompt))


def agent_log_messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == AGENT_LOGGER and r.levelno == level]


# -- a turn ---------------------------------------------------------------------------------------------


async def test_a_turn_with_a_tool_call_logs_the_call_its_result_and_the_answer() -> None:
    seen: list[Mapping[str, Any]] = []
    llm = ScriptedLlm([Reply(tool_calls=[call("add", {"a": 2, "b": 3}, id="c1")]), Reply("It is 5.")])
    agent = Agent(llm=llm, tools=[add_tool(seen)], persona="You are terse.")
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("What is 2 + 3?")
    assert result == SubagentResult(output="It is 5.", stop_reason="completed")
    assert seen == [{"a": 2, "b": 3}]
    the_call = ToolCall("c1", "add", '{"a": 2, "b": 3}')
    assert agent.messages == (
        Message("system", "You are terse."),
        Message("user", "What is 2 + 3?"),
        Message("assistant", "", (the_call,)),
        Message("tool", "5", tool_call_id="c1", name="add"),
        Message("assistant", "It is 5."),
    )
    assert [request.messages for request in llm.requests] == [agent.messages[:2], agent.messages[:4]]
    assert [request.tools for request in llm.requests] == [(add_tool().spec,), (add_tool().spec,)]
    assert llm.requests[0].response_schema is None


async def test_the_persona_is_the_first_message_the_model_sees_and_history_follows_it() -> None:
    history = [Message.user("Earlier question."), Message.assistant("Earlier answer.")]
    llm = ScriptedLlm(["Hello."])
    agent = Agent(llm=llm, persona="You review code.", history=history)
    assert agent.completed_messages == (Message.system("You review code."), *history)
    with anyio.fail_after(WAIT):
        await agent.run_turn("Hi.")
    assert llm.requests[0].messages == (Message.system("You review code."), *history, Message.user("Hi."))


async def test_an_agent_refuses_repeated_tool_names_and_fewer_than_one_model_call() -> None:
    with pytest.raises(ValueError, match=r"^tool names must be unique; repeated: add$"):
        Agent(llm=ScriptedLlm(), tools=[add_tool(), echo_tool(), add_tool()])
    with pytest.raises(ValueError, match=r"^max_model_calls must be >= 1, got 0$"):
        Agent(llm=ScriptedLlm(), max_model_calls=0)


async def test_tool_calls_of_one_answer_run_concurrently_and_their_results_keep_call_order() -> None:
    first_started = anyio.Event()
    second_finished = anyio.Event()
    second_started = anyio.Event()

    async def first(arguments: Mapping[str, Any]) -> str:
        first_started.set()
        await second_finished.wait()  # only possible if the second runs while this one waits
        return "first result"

    async def second(arguments: Mapping[str, Any]) -> str:
        second_started.set()
        await first_started.wait()  # only possible if the first started before this one ended
        second_finished.set()
        return "second result"

    llm = ScriptedLlm(
        [Reply(tool_calls=[call("first", id="c1"), call("second", id="c2")]), Reply("Both done.")]
    )
    agent = Agent(llm=llm, tools=[function_tool("first", first), function_tool("second", second)])
    events = record_events(agent)
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Do both.")
    assert result.output == "Both done."
    assert agent.messages[2:4] == (
        Message("tool", "first result", tool_call_id="c1", name="first"),
        Message("tool", "second result", tool_call_id="c2", name="second"),
    )
    finished = [(e.call.id, e.output) for e in events if isinstance(e, ToolCallFinished)]
    assert finished == [("c1", "first result"), ("c2", "second result")]
    assert second_started.is_set()


BAD_CALLS = [
    pytest.param(
        ToolCall("c1", "nope", "{}"),
        "error: there is no tool named 'nope' (available: 'add', 'echo')",
        id="unknown-tool",
    ),
    pytest.param(
        ToolCall("c1", "add", '{"a": 1,'),
        "error: invalid arguments, nothing was run:\n- the arguments are not valid JSON: Expecting property "
        "name enclosed in double quotes: line 1 column 9 (char 8)",
        id="invalid-json",
    ),
    pytest.param(
        ToolCall("c1", "add", '{"a": "2", "b": 3}'),
        'error: invalid arguments, nothing was run:\n- a: expected an integer, got "2"',
        id="wrong-type",
    ),
    pytest.param(
        ToolCall("c1", "add", '{"a": 2}'),
        'error: invalid arguments, nothing was run:\n- missing argument "b" (an integer)',
        id="missing-property",
    ),
    pytest.param(
        ToolCall("c1", "add", '{"a": 2, "b": 3, "c": 4}'),
        'error: invalid arguments, nothing was run:\n- unknown argument "c"; the tool takes "a", "b"',
        id="extra-property",
    ),
    pytest.param(
        ToolCall("c1", "add", "[2, 3]"),
        "error: invalid arguments, nothing was run:\n- the arguments: expected an object, got an array",
        id="not-an-object",
    ),
]


@pytest.mark.parametrize(("bad_call", "expected"), BAD_CALLS)
async def test_a_bad_tool_call_answers_the_model_with_the_exact_error_and_runs_nothing(
    bad_call: ToolCall, expected: str
) -> None:
    ran: list[Mapping[str, Any]] = []
    llm = ScriptedLlm([Reply(tool_calls=[bad_call]), Reply("Sorry.")])
    agent = Agent(llm=llm, tools=[add_tool(ran), echo_tool(ran)])
    events = record_events(agent)
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Add.")
    assert result.output == "Sorry."
    assert ran == []
    assert agent.messages[2] == Message.tool_result(bad_call, expected)
    assert llm.requests[1].messages[-1] == Message.tool_result(bad_call, expected)
    assert [e for e in events if isinstance(e, ToolCallStarted | ToolCallFinished)] == [
        ToolCallFinished(bad_call, expected, True)
    ]


async def test_a_tool_call_without_tools_says_none_are_available() -> None:
    llm = ScriptedLlm([Reply(tool_calls=[call("add", {}, id="c1")]), Reply("OK.")])
    agent = Agent(llm=llm)
    with anyio.fail_after(WAIT):
        await agent.run_turn("Add.")
    assert agent.messages[2].content == "error: there is no tool named 'add' (available: none)"


async def test_empty_arguments_text_is_an_empty_object() -> None:
    ran: list[Mapping[str, Any]] = []
    llm = ScriptedLlm([Reply(tool_calls=[ToolCall("c1", "echo", "  ")]), Reply("OK.")])
    agent = Agent(llm=llm, tools=[echo_tool(ran)])
    with anyio.fail_after(WAIT):
        await agent.run_turn("Echo.")
    assert ran == [{}]
    assert agent.messages[2].content == "{}"


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        pytest.param(
            {"type": "nonsense"},
            "error: the tool's own argument schema is invalid ('nonsense' is not valid under any of the "
            "given schemas); nothing was run",
            id="invalid-schema",
        ),
        pytest.param(
            {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
            "error: the tool's own argument schema cannot be applied (PointerToNowhere: '/nowhere' does not "
            "exist within {'type': 'object', 'properties': {'a': {'$ref': '#/nowhere'}}}); nothing was run",
            id="dangling-ref",
        ),
    ],
)
async def test_a_tool_whose_own_schema_is_unusable_answers_the_model_and_never_runs(
    parameters: dict[str, Any], expected: str
) -> None:
    # Caught a bug: validators do not check their schema, so the turn died with an ExceptionGroup.
    ran: list[Mapping[str, Any]] = []

    def broken(arguments: Mapping[str, Any]) -> str:
        ran.append(arguments)
        return "ran"

    tool = FunctionTool("broken", "Broken schema.", parameters, broken)
    llm = ScriptedLlm([Reply(tool_calls=[call("broken", {"a": 1}, id="c1")]), Reply("Noted.")])
    agent = Agent(llm=llm, tools=[tool])
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Use it.")
    assert result == SubagentResult(output="Noted.", stop_reason="completed")
    assert ran == []
    assert agent.messages[2] == Message("tool", expected, tool_call_id="c1", name="broken")


async def test_a_tool_error_is_shown_as_is_and_an_unexpected_exception_is_named_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def missing(arguments: Mapping[str, Any]) -> str:
        raise ToolError("no file named notes.txt")

    async def crashing(arguments: Mapping[str, Any]) -> str:
        raise RuntimeError("disk on fire")

    llm = ScriptedLlm(
        [Reply(tool_calls=[call("missing", id="c1"), call("crashing", id="c2")]), Reply("Both failed.")]
    )
    agent = Agent(
        llm=llm, id="a1", tools=[function_tool("missing", missing), function_tool("crashing", crashing)]
    )
    events = record_events(agent)
    with caplog.at_level(logging.ERROR, logger=AGENT_LOGGER), anyio.fail_after(WAIT):
        result = await agent.run_turn("Go.")
    assert result.output == "Both failed."
    assert [(m.tool_call_id, m.content) for m in agent.messages[2:4]] == [
        ("c1", "error: no file named notes.txt"),
        ("c2", "error: the tool failed (RuntimeError: disk on fire)"),
    ]
    assert [(e.call.id, e.is_error) for e in events if isinstance(e, ToolCallFinished)] == [
        ("c1", True),
        ("c2", True),
    ]
    assert agent_log_messages(caplog, logging.ERROR) == ["agent a1: tool 'crashing' raised"]
    crash_record = next(r for r in caplog.records if r.name == AGENT_LOGGER)
    assert crash_record.exc_info is not None
    assert repr(crash_record.exc_info[1]) == "RuntimeError('disk on fire')"


# -- approval -------------------------------------------------------------------------------------------


def try_mutations(invocation: ToolInvocation) -> list[str]:
    """Attempt every way of changing what will run; the name of each exception raised, in order."""
    attempts: list[Callable[[], object]] = [
        lambda: operator.setitem(invocation.arguments, "path", "/etc/passwd"),
        lambda: operator.setitem(invocation.arguments["options"], "force", True),
        lambda: invocation.arguments["lines"].append("rm -rf /"),
        lambda: setattr(invocation, "arguments", {}),
        lambda: setattr(invocation, "tool", "other"),
    ]
    outcomes = []
    for attempt in attempts:
        try:
            attempt()
        except Exception as exc:
            outcomes.append(type(exc).__name__)
        else:
            outcomes.append("mutated")
    return outcomes


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync-approver", "async-approver"])
async def test_the_approver_decides_on_a_frozen_snapshot_and_the_tool_runs_with_that_same_object(
    asynchronous: bool,
) -> None:
    seen: list[ToolInvocation] = []
    mutation_outcomes: list[list[str]] = []
    pending_during_approval: list[int] = []
    agent_box: list[Agent] = []

    def decide(invocation: ToolInvocation) -> bool:
        seen.append(invocation)
        pending_during_approval.append(agent_box[0].pending_approvals)
        mutation_outcomes.append(try_mutations(invocation))
        return True

    async def decide_later(invocation: ToolInvocation) -> bool:
        await anyio.lowlevel.checkpoint()
        return decide(invocation)

    tool = RecordingTool("write", "written", needs_approval=True)
    arguments = {"path": "notes.txt", "options": {"force": False}, "lines": ["a", "b"]}
    llm = ScriptedLlm([Reply(tool_calls=[call("write", arguments, id="c1")]), Reply("Written.")])
    agent = Agent(llm=llm, tools=[tool], approver=decide_later if asynchronous else decide)
    agent_box.append(agent)
    events = record_events(agent)
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Write the notes.")
    assert result.output == "Written."
    [approved] = seen
    assert (approved.call_id, approved.tool, approved.context) == ("c1", "write", agent.context)
    assert approved.arguments == {"path": "notes.txt", "options": {"force": False}, "lines": ("a", "b")}
    assert mutation_outcomes == [
        ["TypeError", "TypeError", "AttributeError", "FrozenInstanceError", "FrozenInstanceError"]
    ]
    assert pending_during_approval == [1]
    assert agent.pending_approvals == 0
    assert len(tool.invocations) == 1
    assert tool.invocations[0] is approved
    [started] = [e for e in events if isinstance(e, ToolCallStarted)]
    assert started.invocation is approved
    assert agent.messages[2] == Message("tool", "written", tool_call_id="c1", name="write")


REFUSED = "error: this tool call was not approved, so it did not run"


async def test_a_call_needing_approval_is_refused_when_there_is_no_approver() -> None:
    tool = RecordingTool("deploy", needs_approval=True)
    llm = ScriptedLlm([Reply(tool_calls=[call("deploy", id="c1")]), Reply("Not deployed.")])
    agent = Agent(llm=llm, tools=[tool])
    events = record_events(agent)
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Deploy.")
    assert result.output == "Not deployed."
    assert tool.invocations == []
    assert agent.messages[2] == Message("tool", REFUSED, tool_call_id="c1", name="deploy")
    assert [e for e in events if isinstance(e, ToolCallStarted)] == []


@pytest.mark.parametrize("answer", [False, 1, "yes", None], ids=["false", "one", "yes", "none"])
async def test_an_approver_answering_anything_but_true_refuses_the_call(answer: Any) -> None:
    async def approver(invocation: ToolInvocation) -> Any:
        return answer

    tool = RecordingTool("deploy", needs_approval=True)
    llm = ScriptedLlm([Reply(tool_calls=[call("deploy", id="c1")]), Reply("Not deployed.")])
    agent = Agent(llm=llm, tools=[tool], approver=approver)
    with anyio.fail_after(WAIT):
        await agent.run_turn("Deploy.")
    assert tool.invocations == []
    assert agent.messages[2].content == REFUSED


async def test_an_approver_that_raises_refuses_the_call_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def approver(invocation: ToolInvocation) -> bool:
        raise LookupError("no such user")

    tool = RecordingTool("deploy", needs_approval=True)
    llm = ScriptedLlm([Reply(tool_calls=[call("deploy", id="c1")]), Reply("Not deployed.")])
    agent = Agent(llm=llm, id="a1", tools=[tool], approver=approver)
    with caplog.at_level(logging.ERROR, logger=AGENT_LOGGER), anyio.fail_after(WAIT):
        result = await agent.run_turn("Deploy.")
    assert result == SubagentResult(output="Not deployed.", stop_reason="completed")
    assert tool.invocations == []
    assert agent.messages[2].content == REFUSED
    assert agent.pending_approvals == 0
    assert agent_log_messages(caplog, logging.ERROR) == ["agent a1: the approver raised; the call is refused"]


# -- what a tool sees -----------------------------------------------------------------------------------


async def test_a_tool_sees_the_agents_id_and_cwd_through_a_context_that_cannot_drive_the_agent() -> None:
    tool = RecordingTool("look")
    calls = [call("look", {}, id="c1"), call("look", {}, id="c2")]
    llm = ScriptedLlm([Reply(tool_calls=calls), Reply("Seen.")])
    agent = Agent(llm=llm, id="looker", cwd="/home/user/project", tools=[tool], registry=AgentRegistry())
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Look around.")
    assert result.output == "Seen."
    first, second = (invocation.context for invocation in tool.invocations)
    # One context per agent, so a wrapper tool can tell the agent's calls from others' by identity.
    assert first is second is agent.context
    assert isinstance(first, ToolContext)
    assert (first.id, first.cwd) == ("looker", "/home/user/project")
    assert repr(first) == "<ToolContext of agent 'looker'>"
    unreachable = ("close", "run_turn", "send_message", "cancel", "on_event", "tools", "messages", "llm")
    assert [member for member in unreachable if hasattr(first, member)] == []
    public = [name for name in dir(first) if not name.startswith("_")]
    assert public == ["cwd", "id", "touch"]
    assert all(getattr(first, name) is not agent for name in public)
    await agent.close()


async def test_touching_the_context_is_a_sign_of_life_of_the_agent() -> None:
    agent = Agent(llm=ScriptedLlm([]), registry=AgentRegistry())
    untouched = agent.last_activity
    before = time.monotonic()
    agent.context.touch()
    assert untouched is None
    assert agent.last_activity is not None
    assert agent.last_activity >= before
    await agent.close()


async def test_a_kept_context_does_not_keep_its_agent_alive() -> None:
    agents = AgentRegistry()
    agent = Agent(llm=ScriptedLlm([]), id="gone", cwd="/tmp/work", registry=agents)
    context = agent.context
    del agent
    gc.collect()
    assert "gone" not in agents
    # What is left answers without the agent: its id stays, the rest is empty and touching is harmless.
    context.touch()
    assert (context.id, context.cwd) == ("gone", None)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent is a module, not a package
        return False


def _subagent_modules_imported_by(module: str) -> set[str]:
    """The ``subagent`` modules a module's source names in its imports (under TYPE_CHECKING too):
    ``from package import submodule`` counts as the submodule, ``from package import name`` as the
    package (whose ``__init__`` then runs its own imports)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None
    assert spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if _is_module(submodule) else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] == "subagent"}


def test_the_tools_module_does_not_import_the_agent_module_even_indirectly() -> None:
    # Importing any runtime module runs the package __init__, which imports both; so this follows
    # the imports tools.py names, and those of every subagent module they name, instead.
    seen: set[str] = set()
    pending = ["subagent.runtime._tools"]
    while pending:
        module = pending.pop()
        if module not in seen:
            seen.add(module)
            pending.extend(_subagent_modules_imported_by(module))
    assert {"subagent.runtime._tools", "subagent.runtime._messages", "subagent.types"} <= seen
    assert "subagent.runtime._inprocess_agent" not in seen


# -- how a turn ends ------------------------------------------------------------------------------------


async def test_a_model_that_keeps_calling_tools_stops_with_max_turns() -> None:
    llm = ScriptedLlm(
        [
            Reply("First try.", tool_calls=[call("echo", id="c1")]),
            Reply("Second try.", tool_calls=[call("echo", id="c2")]),
            Reply("Third try.", tool_calls=[call("echo", id="c3")]),
        ]
    )
    agent = Agent(llm=llm, tools=[echo_tool()], max_model_calls=2)
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Loop.")
    assert result == SubagentResult(
        output="Second try.",
        stop_reason="max_turns",
        error="the model asked for tools 2 times in one turn without answering",
    )
    assert len(llm.requests) == 2
    assert llm.remaining == 1
    assert agent.messages[-1] == Message("tool", "{}", tool_call_id="c2", name="echo")


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (Reply("The answer is", finish_reason="length"), SubagentResult("The answer is", "max_tokens")),
        (Reply("", finish_reason="content_filter"), SubagentResult("", "refusal")),
    ],
    ids=["length", "content_filter"],
)
async def test_a_truncated_answer_ends_with_max_tokens_and_a_filtered_one_with_refusal(
    reply: Reply, expected: SubagentResult
) -> None:
    llm = ScriptedLlm([reply])
    agent = Agent(llm=llm)
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Answer.")
    assert result == expected
    assert agent.messages == (Message.user("Answer."), Message.assistant(reply.text))


async def test_tool_calls_of_a_truncated_answer_never_run_and_each_gets_a_closing_result() -> None:
    ran: list[Mapping[str, Any]] = []
    llm = ScriptedLlm(
        [Reply("Adding", tool_calls=[call("add", {"a": 1, "b": 2}, id="c1")], finish_reason="length")]
    )
    agent = Agent(llm=llm, tools=[add_tool(ran)])
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Add.")
    assert result == SubagentResult("Adding", "max_tokens")
    assert ran == []
    assert agent.messages[-1] == Message(
        "tool", "error: the turn ended before this call finished", tool_call_id="c1", name="add"
    )


async def test_a_failing_model_call_ends_with_error_naming_the_kind_and_keeps_partial_output() -> None:
    llm = ScriptedLlm(
        [
            Reply("Checking.", tool_calls=[call("echo", id="c1")]),
            Reply(error=LlmError(LlmErrorKind.RATE_LIMITED, "429: slow down", status=429)),
        ]
    )
    agent = Agent(llm=llm, tools=[echo_tool()])
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Check.")
    assert result == SubagentResult(
        output="Checking.", stop_reason="error", error="the model call failed (rate_limited): 429: slow down"
    )
    assert agent.messages[-1] == Message("tool", "{}", tool_call_id="c1", name="echo")


class NoCompletion:
    """An adapter whose stream ends without its Completion."""

    async def stream(self, request: CompletionRequest) -> AsyncIterator[CompletionEvent]:
        yield TextDelta("half an answer")


async def test_a_stream_ending_without_a_completion_is_a_protocol_error() -> None:
    agent = Agent(llm=NoCompletion())
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Answer.")
    assert result == SubagentResult(
        output="half an answer",  # streamed to listeners already: the partial output says it too
        stop_reason="error",
        error="the model call failed (protocol): the adapter's stream ended without a completion",
    )


async def test_text_streamed_before_a_failed_model_call_is_the_partial_output_but_not_in_the_log() -> None:
    llm = ScriptedLlm([Reply("Half of the answer", error=LlmError(LlmErrorKind.CONNECTION, "dropped"))])
    agent = Agent(llm=llm)
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Answer.")
    assert result == SubagentResult(
        output="Half of the answer",
        stop_reason="error",
        error="the model call failed (connection): dropped",
    )
    # The log stays one a chat API accepts: no assistant message was completed.
    assert agent.messages == (Message.user("Answer."),)


class ClosingAdapter:
    """Yields its Completion first and counts how often its stream was closed."""

    def __init__(self) -> None:
        self.closed = 0
        self.calls = 0

    async def stream(self, request: CompletionRequest) -> AsyncIterator[CompletionEvent]:
        self.calls += 1
        try:
            if self.calls == 1:
                yield Completion(Message.assistant("", [ToolCall("c1", "peek")]), "tool_calls")
            else:
                yield Completion(Message.assistant("Done."), "stop")
            yield TextDelta("never read")
        finally:
            self.closed += 1


async def test_the_adapters_stream_is_closed_as_soon_as_its_completion_arrives() -> None:
    adapter = ClosingAdapter()
    closed_while_tool_ran: list[int] = []

    def peek(arguments: Mapping[str, Any]) -> str:
        closed_while_tool_ran.append(adapter.closed)
        return "peeked"

    agent = Agent(llm=adapter, tools=[function_tool("peek", peek)])
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Peek.")
    assert result.output == "Done."
    assert closed_while_tool_ran == [1]
    assert adapter.closed == 2


async def test_an_unexpected_adapter_exception_propagates_unwrapped_and_the_agent_stays_usable() -> None:
    # Caught a bug: run_turn raised an ExceptionGroup wrapping the adapter's exception.
    def responder(request: CompletionRequest) -> str:
        if len(llm.requests) == 1:
            raise RuntimeError("adapter bug")
        return "Fine now."

    llm = ScriptedLlm(responder)
    agent = Agent(llm=llm)
    with anyio.fail_after(WAIT):
        with pytest.raises(RuntimeError, match=r"^adapter bug$"):
            await agent.run_turn("First.")
        assert not agent.busy
        assert agent.completed_messages == (Message.user("First."),)
        result = await agent.run_turn("Second.")
    assert result == SubagentResult("Fine now.", "completed")


# -- structured output ----------------------------------------------------------------------------------

ASK_TEXT = (
    "How many files?\n\nAnswer with a single JSON value that matches this JSON Schema, and nothing else: "
    "no prose, no code fences.\n\n" + COUNT_SCHEMA_TEXT
)


def repair_text(problem: str) -> str:
    return (
        f"Your previous answer cannot be used: {problem}\n\nReply again with only the corrected JSON value "
        f"matching this JSON Schema, and nothing else:\n\n{COUNT_SCHEMA_TEXT}"
    )


async def test_a_valid_structured_answer_is_accepted_on_the_first_try() -> None:
    llm = ScriptedLlm(['```json\n{"n": 3}\n```'])
    agent = Agent(llm=llm)
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("How many files?", output_schema=COUNT_SCHEMA)
    assert result == SubagentResult(
        output='```json\n{"n": 3}\n```', stop_reason="completed", structured={"n": 3}
    )
    [request] = llm.requests
    assert request.messages == (Message.user(ASK_TEXT),)
    assert thaw_json(request.response_schema) == COUNT_SCHEMA


async def test_an_invalid_structured_answer_is_repaired_once_with_the_exact_repair_prompt() -> None:
    llm = ScriptedLlm(
        [Reply("three", usage=Usage(input_tokens=10)), Reply('{"n": 3}', usage=Usage(input_tokens=20))]
    )
    agent = Agent(llm=llm)
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("How many files?", output_schema=COUNT_SCHEMA)
    assert result == SubagentResult(
        output='{"n": 3}', stop_reason="completed", structured={"n": 3}, usage=Usage(input_tokens=30)
    )
    assert llm.requests[1].messages == (
        Message.user(ASK_TEXT),
        Message.assistant("three"),
        Message.user(repair_text("it is not valid JSON (Expecting value: line 1 column 1 (char 0))")),
    )
    assert thaw_json(llm.requests[1].response_schema) == COUNT_SCHEMA


async def test_a_structured_answer_still_invalid_after_one_repair_ends_with_error() -> None:
    llm = ScriptedLlm(['{"n": "3"}', '{"m": 1}', '{"n": 3}'])
    agent = Agent(llm=llm)
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("How many files?", output_schema=COUNT_SCHEMA)
    assert result == SubagentResult(
        output='{"m": 1}',
        stop_reason="error",
        error="the answer does not match the output schema after one repair turn: "
        "at the top level: 'n' is a required property",
    )
    assert len(llm.requests) == 2
    assert llm.requests[1].messages[-1] == Message.user(repair_text("at n: '3' is not of type 'integer'"))


async def test_a_structured_turn_that_does_not_complete_is_not_repaired() -> None:
    llm = ScriptedLlm([Reply('{"n"', finish_reason="length"), '{"n": 3}'])
    agent = Agent(llm=llm)
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("How many files?", output_schema=COUNT_SCHEMA)
    assert result == SubagentResult(output='{"n"', stop_reason="max_tokens")
    assert len(llm.requests) == 1


# -- messages sent to the agent -------------------------------------------------------------------------


async def test_a_message_sent_while_idle_enters_the_log_at_once_and_the_next_turn_sees_it() -> None:
    llm = ScriptedLlm(["Noted."])
    agent = Agent(llm=llm)
    events = record_events(agent)
    pending = agent.send_message("The deadline moved to Friday.")
    assert pending.status == "delivered"
    assert agent.pending_messages == ()
    assert agent.messages == (Message.user("The deadline moved to Friday."),)
    assert events == [MessageDelivered("The deadline moved to Friday.")]
    with anyio.fail_after(WAIT):
        await pending.wait()
        await agent.run_turn("Plan the week.")
    assert llm.requests[0].messages == (
        Message.user("The deadline moved to Friday."),
        Message.user("Plan the week."),
    )


async def test_a_message_sent_during_a_model_call_is_delivered_at_the_next_idle_point() -> None:
    gate = Gate()
    llm = ScriptedLlm(
        [Reply(tool_calls=[call("add", {"a": 2, "b": 3}, id="c1")], wait=gate.wait), Reply("5; tests pass.")]
    )
    agent = Agent(llm=llm, tools=[add_tool()])
    results: list[SubagentResult] = []
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(run_into, results, agent, "Add 2 and 3.")
            await gate.entered.wait()
            pending = agent.send_message("Also run the tests.")
            assert pending.status == "queued"
            assert agent.pending_messages == (pending,)
            assert Message.user("Also run the tests.") not in agent.messages
            gate.release.set()
        await pending.wait()
    assert results == [SubagentResult("5; tests pass.", "completed")]
    assert pending.status == "delivered"
    assert llm.requests[0].messages == (Message.user("Add 2 and 3."),)
    assert llm.requests[1].messages == (
        Message.user("Add 2 and 3."),
        Message.assistant("", [ToolCall("c1", "add", '{"a": 2, "b": 3}')]),
        Message("tool", "5", tool_call_id="c1", name="add"),
        Message.user("Also run the tests."),
    )


async def test_a_message_arriving_during_a_final_answer_is_answered_before_the_turn_ends() -> None:
    gate = Gate()
    llm = ScriptedLlm([Reply("First answer.", wait=gate.wait), Reply("Answer covering the note.")])
    agent = Agent(llm=llm)
    results: list[SubagentResult] = []
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(run_into, results, agent, "Summarize.")
            await gate.entered.wait()
            pending = agent.send_message("Keep it short.")
            gate.release.set()
    assert results == [SubagentResult("Answer covering the note.", "completed")]
    assert pending.status == "delivered"
    assert Message.user("Keep it short.") not in llm.requests[0].messages
    assert llm.requests[1].messages == (
        Message.user("Summarize."),
        Message.assistant("First answer."),
        Message.user("Keep it short."),
    )
    assert agent.completed_messages == (
        *llm.requests[1].messages,
        Message.assistant("Answer covering the note."),
    )


async def test_a_message_arriving_during_the_last_allowed_answer_waits_for_the_next_turn() -> None:
    gate = Gate()
    llm = ScriptedLlm([Reply("The only answer allowed.", wait=gate.wait)])
    agent = Agent(llm=llm, max_model_calls=1)
    results: list[SubagentResult] = []
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(run_into, results, agent, "Summarize.")
            await gate.entered.wait()
            pending = agent.send_message("Keep it short.")
            gate.release.set()
    # The model answered: that is the turn's outcome, not "max_turns"; the note is in the log for the
    # next turn, after the turn it arrived in.
    assert results == [SubagentResult("The only answer allowed.", "completed")]
    assert len(llm.requests) == 1
    assert pending.status == "delivered"
    assert agent.messages == (
        Message.user("Summarize."),
        Message.assistant("The only answer allowed."),
        Message.user("Keep it short."),
    )


async def test_a_second_turn_waits_for_the_first_to_end() -> None:
    gate = Gate()
    llm = ScriptedLlm([Reply("One.", wait=gate.wait), Reply("Two.")])
    agent = Agent(llm=llm)
    results: list[SubagentResult] = []
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(run_into, results, agent, "First.")
            await gate.entered.wait()
            task_group.start_soon(run_into, results, agent, "Second.")
            await anyio.wait_all_tasks_blocked()
            assert len(llm.requests) == 1
            gate.release.set()
    assert [r.output for r in results] == ["One.", "Two."]
    assert llm.requests[1].messages == (
        Message.user("First."),
        Message.assistant("One."),
        Message.user("Second."),
    )


# -- cancel and close -----------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5])
async def test_cancel_reaches_a_turn_that_is_just_beginning(steps: int) -> None:
    # Whatever the scheduler did so far, a turn that had begun (its task is in run_turn, taking the
    # turn lock or past it) when cancel() came ends cancelled, and the next turn is not affected.
    llm = ScriptedLlm(lambda request: Reply("answered"))
    agent = Agent(llm=llm)
    results: list[SubagentResult] = []
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(run_into, results, agent, "Go.")
            for _ in range(steps):
                await anyio.lowlevel.checkpoint()
            begun = agent.busy or agent._turn_lock.locked()
            agent.cancel()
        after = await agent.run_turn("Again.")
    if begun:
        [result] = results
        assert result.stop_reason == "cancelled"
        assert result.output in ("", "answered")  # what had streamed before the cancel landed
    else:
        assert results == [SubagentResult("answered", "completed")]
    assert after == SubagentResult("answered", "completed")


async def test_cancel_ends_the_turn_keeping_partial_output_and_delivering_queued_messages() -> None:
    tool_started = anyio.Event()

    async def slow(arguments: Mapping[str, Any]) -> str:
        tool_started.set()
        await anyio.sleep_forever()
        return "never"

    llm = ScriptedLlm([Reply("Looking into it.", tool_calls=[call("slow", id="c1")]), Reply("All checked.")])
    agent = Agent(llm=llm, tools=[function_tool("slow", slow)])
    events = record_events(agent)
    results: list[SubagentResult] = []
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(run_into, results, agent, "Check the logs.")
            await tool_started.wait()
            pending = agent.send_message("Also check the config.")
            agent.cancel()
        await pending.wait()
    assert results == [SubagentResult("Looking into it.", "cancelled")]
    unfinished = Message(
        "tool", "error: the turn ended before this call finished", tool_call_id="c1", name="slow"
    )
    expected_log = (
        Message.user("Check the logs."),
        Message.assistant("Looking into it.", [ToolCall("c1", "slow", "{}")]),
        unfinished,
        Message.user("Also check the config."),
    )
    assert agent.messages == expected_log
    assert events[-2:] == [
        ToolCallFinished(
            ToolCall("c1", "slow", "{}"), "error: the turn ended before this call finished", True
        ),
        MessageDelivered("Also check the config."),
    ]
    assert not agent.busy
    with anyio.fail_after(WAIT):
        again = await agent.run_turn("Go on.")
    assert again == SubagentResult("All checked.", "completed")
    assert llm.requests[1].messages == (*expected_log, Message.user("Go on."))


async def test_a_cancelled_turn_keeps_the_results_of_parallel_calls_that_finished() -> None:
    # Caught a bug: the finished call's result was thrown away and replaced by "the turn ended before
    # this call finished", so the model would redo work that was done.
    fast_done = anyio.Event()
    slow_started = anyio.Event()

    def fast(arguments: Mapping[str, Any]) -> str:
        fast_done.set()
        return "fast result"

    async def slow(arguments: Mapping[str, Any]) -> str:
        slow_started.set()
        await anyio.sleep_forever()
        return "never"

    llm = ScriptedLlm([Reply(tool_calls=[call("slow", id="c1"), call("fast", id="c2")])])
    agent = Agent(llm=llm, tools=[function_tool("slow", slow), function_tool("fast", fast)])
    events = record_events(agent)
    results: list[SubagentResult] = []
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(run_into, results, agent, "Both.")
            await slow_started.wait()
            await fast_done.wait()
            agent.cancel()
    assert results == [SubagentResult("", "cancelled")]
    assert agent.messages[2:] == (
        Message("tool", "error: the turn ended before this call finished", tool_call_id="c1", name="slow"),
        Message("tool", "fast result", tool_call_id="c2", name="fast"),
    )
    assert [(e.call.id, e.output, e.is_error) for e in events if isinstance(e, ToolCallFinished)] == [
        ("c1", "error: the turn ended before this call finished", True),
        ("c2", "fast result", False),
    ]


async def test_cancel_without_a_turn_in_flight_changes_nothing() -> None:
    llm = ScriptedLlm(["Hello."])
    agent = Agent(llm=llm)
    agent.cancel()
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Hi.")
    assert result == SubagentResult("Hello.", "completed")


async def test_close_refuses_queued_messages_with_the_reason_and_returns_once_no_turn_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = Gate()
    registry = AgentRegistry()
    llm = ScriptedLlm([Reply("Never.", wait=gate.wait)])
    agent = Agent(llm=llm, id="a1", registry=registry)
    events = record_events(agent)
    results: list[SubagentResult] = []
    turn_task: list[int] = []

    async def turn() -> None:
        turn_task.append(anyio.get_current_task().id)
        results.append(await agent.run_turn("Work."))

    with caplog.at_level(logging.WARNING, logger=AGENT_LOGGER), anyio.fail_after(WAIT):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(turn)
            await gate.entered.wait()
            first = agent.send_message("First note.")
            second = agent.send_message("Second note.")
            await agent.close("the parent went away")
            # close() returned: the turn is over and its task has finished.
            assert results == [SubagentResult("", "cancelled")]
            assert turn_task[0] not in {task.id for task in anyio.get_running_tasks()}
        for pending in (first, second):
            with pytest.raises(MessageRefusedError, match=r"^the parent went away$") as refused:
                await pending.wait()
            assert refused.value.reason == "the parent went away"
            assert (pending.status, pending.reason) == ("refused", "the parent went away")
    assert events == [
        MessageRefused("First note.", "the parent went away"),
        MessageRefused("Second note.", "the parent went away"),
    ]
    assert agent_log_messages(caplog, logging.WARNING) == [
        "agent a1: message refused (the parent went away): 'First note.'",
        "agent a1: message refused (the parent went away): 'Second note.'",
    ]
    assert agent.messages == (Message.user("Work."),)
    assert agent.pending_messages == ()
    assert registry.get("a1") is None
    assert "a1" not in registry


async def test_close_is_idempotent_and_a_closed_agent_takes_no_turns_and_no_messages() -> None:
    registry = AgentRegistry()
    agent = Agent(llm=ScriptedLlm(["Unused."]), id="a1", registry=registry)
    events = record_events(agent)
    with anyio.fail_after(WAIT):
        await agent.close("done")
        await agent.close("again")
        assert agent.closed
        with pytest.raises(AgentClosedError, match=r"^agent 'a1' is closed$"):
            await agent.run_turn("More?")
    with pytest.raises(AgentClosedError, match=r"^agent 'a1' is closed$"):
        agent.send_message("Hello?")
    assert events == []
    assert registry.list() == []
    assert repr(agent) == "<Agent 'a1' depth=0 closed>"


async def test_a_turn_waiting_for_the_lock_when_the_agent_closes_raises_agent_closed() -> None:
    gate = Gate()
    agent = Agent(llm=ScriptedLlm([Reply("One.", wait=gate.wait)]), id="a1")
    results: list[SubagentResult] = []
    refusals: list[str] = []

    async def second_turn() -> None:
        try:
            results.append(await agent.run_turn("Second."))
        except AgentClosedError as exc:
            refusals.append(str(exc))

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(run_into, results, agent, "First.")
            await gate.entered.wait()
            task_group.start_soon(second_turn)
            await anyio.wait_all_tasks_blocked()
            await agent.close()
            assert (results, refusals) == ([SubagentResult("", "cancelled")], ["agent 'a1' is closed"])


@pytest.mark.parametrize("parallel", [False, True], ids=["single-call", "parallel-calls"])
async def test_an_agent_closed_from_inside_its_own_tool_ends_its_turn_as_cancelled(parallel: bool) -> None:
    # Caught bugs: close() waited for the turn that was waiting for close(). From a lone call that
    # failed the tool ("Attempted to acquire an already held Lock"); from one of parallel calls it
    # hung, shielded, where nothing could cancel it. And the cancelled turn still started one more
    # model call before it noticed.
    registry = AgentRegistry()
    agent_box: list[Agent] = []

    async def quit_tool(arguments: Mapping[str, Any]) -> str:
        await agent_box[0].close("the agent quit")
        return "quitting"

    calls = [call("quit", id="c1"), call("echo", id="c2")] if parallel else [call("quit", id="c1")]
    llm = ScriptedLlm([Reply("Bye.", tool_calls=calls), Reply("Never.")])
    agent = Agent(llm=llm, id="a1", tools=[function_tool("quit", quit_tool), echo_tool()], registry=registry)
    agent_box.append(agent)
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Stop.")
    assert result == SubagentResult("Bye.", "cancelled")
    assert agent.closed
    assert registry.list() == []
    assert agent.messages[2] == Message("tool", "quitting", tool_call_id="c1", name="quit")
    # The other call got a result, real or closing (backends differ on whether it started at all).
    assert [m.tool_call_id for m in agent.messages[2:]] == (["c1", "c2"] if parallel else ["c1"])
    assert len(llm.requests) == 1


# -- idle timeout ---------------------------------------------------------------------------------------


async def test_a_silent_model_ends_the_turn_with_timeout() -> None:
    agent = Agent(llm=ScriptedLlm([Reply("Never.", wait=hang)]))
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Answer.", idle_timeout=0.05)
    assert result == SubagentResult(
        output="",
        stop_reason="timeout",
        error="no sign of life from the model or a tool for 0.05 s",
        limit=LimitHit("timeout", allowed=0.05, spent=0.05),
    )
    assert not agent.busy


async def test_a_silent_tool_ends_the_turn_with_timeout_and_its_call_gets_a_closing_result() -> None:
    async def silent(arguments: Mapping[str, Any]) -> str:
        await anyio.sleep_forever()
        return "never"

    llm = ScriptedLlm([Reply("Working.", tool_calls=[call("silent", id="c1")])])
    agent = Agent(llm=llm, tools=[function_tool("silent", silent)])
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Work.", idle_timeout=0.05)
    assert result == SubagentResult(
        output="Working.",
        stop_reason="timeout",
        error="no sign of life from the model or a tool for 0.05 s",
        limit=LimitHit("timeout", allowed=0.05, spent=0.05),
    )
    assert agent.messages[-1] == Message(
        "tool", "error: the turn ended before this call finished", tool_call_id="c1", name="silent"
    )


async def test_time_spent_waiting_for_approval_does_not_count_toward_the_idle_timeout() -> None:
    async def slow_person(invocation: ToolInvocation) -> bool:
        await anyio.sleep(0.3)  # the person takes six idle timeouts to decide: the time under test
        return True

    tool = RecordingTool("deploy", "deployed", needs_approval=True)
    llm = ScriptedLlm([Reply(tool_calls=[call("deploy", id="c1")]), Reply("Deployed.")])
    agent = Agent(llm=llm, tools=[tool], approver=slow_person)
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Deploy.", idle_timeout=0.05)
    assert result == SubagentResult("Deployed.", "completed")
    assert len(tool.invocations) == 1


async def test_the_idle_clock_stands_still_during_an_approval_and_restarts_when_it_ends() -> None:
    # Caught a bug: the watcher restarted the clock itself after each look during an approval, so a
    # tool silent after the approval got up to one look's interval more than the idle timeout.
    timeout = 0.05
    clock: list[tuple[float | None, float | None]] = []
    agent_box: list[Agent] = []

    async def person(invocation: ToolInvocation) -> bool:
        before = agent_box[0].last_activity
        await anyio.sleep(timeout * 4)  # the person takes a while: the watcher looks several times
        clock.append((before, agent_box[0].last_activity))
        return True

    async def silent(arguments: Mapping[str, Any]) -> str:
        clock.append((None, agent_box[0].last_activity))
        await anyio.sleep_forever()
        return "never"

    llm = ScriptedLlm([Reply(tool_calls=[call("silent", id="c1")])])
    agent = Agent(llm=llm, tools=[function_tool("silent", silent, needs_approval=True)], approver=person)
    agent_box.append(agent)
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Work.", idle_timeout=timeout)
    assert result.stop_reason == "timeout"
    [(asked_at, still_at), (_, approved_at)] = clock
    assert asked_at is not None
    assert approved_at is not None
    assert still_at == asked_at  # nothing moved the clock while the person decided
    assert approved_at > asked_at  # the answer itself is a sign of life: the clock restarts there


# -- what can be observed -------------------------------------------------------------------------------


async def test_completed_messages_never_include_the_turn_in_flight() -> None:
    observed: list[tuple[tuple[Message, ...], tuple[Message, ...], bool]] = []
    agent_box: list[Agent] = []

    def peek(arguments: Mapping[str, Any]) -> str:
        agent = agent_box[0]
        observed.append((agent.completed_messages, agent.messages, agent.busy))
        return "peeked"

    llm = ScriptedLlm(["Hello.", Reply(tool_calls=[call("peek", id="c1")]), "Done."])
    agent = Agent(llm=llm, tools=[function_tool("peek", peek)])
    agent_box.append(agent)
    with anyio.fail_after(WAIT):
        await agent.run_turn("Hi.")
        await agent.run_turn("Peek.")
    first_turn = (Message.user("Hi."), Message.assistant("Hello."))
    in_flight = (Message.user("Peek."), Message.assistant("", [ToolCall("c1", "peek", "{}")]))
    assert observed == [(first_turn, first_turn + in_flight, True)]
    assert agent.completed_messages == agent.messages
    assert agent.messages[len(first_turn) :] == (
        *in_flight,
        Message("tool", "peeked", tool_call_id="c1", name="peek"),
        Message.assistant("Done."),
    )


async def test_usage_is_summed_over_the_model_calls_of_a_turn() -> None:
    llm = ScriptedLlm(
        [
            Reply(tool_calls=[call("echo", id="c1")], usage=Usage(input_tokens=10, output_tokens=4)),
            Reply("Done.", usage=Usage(input_tokens=20, output_tokens=6, total_tokens=26)),
            Reply("No usage reported."),
        ]
    )
    agent = Agent(llm=llm, tools=[echo_tool()])
    with anyio.fail_after(WAIT):
        first = await agent.run_turn("Go.")
        second = await agent.run_turn("Again.")
    assert first.usage == Usage(input_tokens=30, output_tokens=10, total_tokens=26)
    assert second.usage is None


async def test_events_arrive_in_order_deltas_then_tool_call_then_delivered_message() -> None:
    agent_box: list[Agent] = []

    def add(arguments: Mapping[str, Any]) -> str:
        agent_box[0].send_message("Thanks.")
        return str(arguments["a"] + arguments["b"])

    tool = FunctionTool("add", "Add two integers.", ADD_PARAMETERS, add)
    llm = ScriptedLlm(
        [Reply("Let me add.", tool_calls=[call("add", {"a": 2, "b": 3}, id="c1")]), Reply("5.")]
    )
    agent = Agent(llm=llm, tools=[tool])
    agent_box.append(agent)
    events = record_events(agent)
    with anyio.fail_after(WAIT):
        await agent.run_turn("2 + 3?")
    the_call = ToolCall("c1", "add", '{"a": 2, "b": 3}')
    assert events == [
        TextDelta("Let "),
        TextDelta("me "),
        TextDelta("add."),
        ToolCallDelta(0, id="c1", name="add"),
        ToolCallDelta(0, arguments='{"a": 2,'),
        ToolCallDelta(0, arguments=' "b": 3}'),
        ToolCallStarted(ToolInvocation("c1", "add", {"a": 2, "b": 3}, agent.context)),
        ToolCallFinished(the_call, "5", False),
        MessageDelivered("Thanks."),
        TextDelta("5."),
    ]


async def test_a_listener_that_raises_is_logged_and_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    def broken(event: AgentEvent) -> None:
        raise ValueError("listener bug")

    def script() -> ScriptedLlm:
        return ScriptedLlm(
            [Reply("Adding.", tool_calls=[call("add", {"a": 1, "b": 1}, id="c1")]), Reply("2.")]
        )

    quiet = Agent(llm=script(), id="a1", tools=[add_tool()])
    quiet_events = record_events(quiet)
    noisy = Agent(llm=script(), id="a1", tools=[add_tool()])
    dispose = noisy.on_event(broken)
    noisy_events = record_events(noisy)
    with caplog.at_level(logging.ERROR, logger=AGENT_LOGGER), anyio.fail_after(WAIT):
        quiet_result = await quiet.run_turn("1 + 1?")
        noisy_result = await noisy.run_turn("1 + 1?")
    assert noisy_result == quiet_result == SubagentResult("2.", "completed")
    assert noisy.messages == quiet.messages
    assert noisy_events == quiet_events
    assert agent_log_messages(caplog, logging.ERROR) == ["agent a1: an event listener raised"] * len(
        noisy_events
    )
    dispose()
    dispose()  # idempotent
    caplog.clear()
    noisy.send_message("Thanks.")
    assert noisy_events[-1] == MessageDelivered("Thanks.")
    assert agent_log_messages(caplog, logging.ERROR) == []


async def test_liveness_properties_follow_the_turn() -> None:
    observed: list[tuple[bool, int]] = []
    agent_box: list[Agent] = []

    def peek(arguments: Mapping[str, Any]) -> str:
        observed.append((agent_box[0].busy, agent_box[0].update_count))
        return "peeked"

    llm = ScriptedLlm([Reply("one two", tool_calls=[call("peek", id="c1")]), Reply("three")])
    agent = Agent(llm=llm, id="a1", depth=2, parent_id="root", tools=[function_tool("peek", peek)])
    agent_box.append(agent)
    assert (agent.last_activity, agent.busy, agent.update_count, agent.pending_approvals) == (
        None,
        False,
        0,
        0,
    )
    assert repr(agent) == "<Agent 'a1' depth=2 idle>"
    before = time.monotonic()
    with anyio.fail_after(WAIT):
        await agent.run_turn("Go.")
    # two text deltas and three tool-call deltas, then the call itself; then one more text delta
    assert observed == [(True, 6)]
    assert agent.update_count == 7
    assert agent.last_activity is not None
    assert before <= agent.last_activity <= time.monotonic()
    assert (agent.busy, agent.parent_id, agent.depth) == (False, "root", 2)
    assert agent.tool("peek") is agent.tools[0]
    assert agent.tool("nope") is None


# -- the registries -------------------------------------------------------------------------------------


async def test_the_registry_lists_live_agents_and_refuses_a_duplicate_id() -> None:
    registry = AgentRegistry()
    first = Agent(llm=ScriptedLlm(), id="a1", registry=registry)
    second = Agent(llm=ScriptedLlm(), id="a2", registry=registry)
    assert registry.list() == ["a1", "a2"]
    assert registry.get("a1") is first
    assert registry.get("a3") is None
    assert ("a2" in registry, len(registry)) == (True, 2)
    with pytest.raises(ValueError, match=r"^an agent with id 'a1' is already live$"):
        Agent(llm=ScriptedLlm(), id="a1", registry=registry)
    assert registry.get("a1") is first
    with anyio.fail_after(WAIT):
        await first.close()
    assert registry.list() == ["a2"]
    successor = Agent(llm=ScriptedLlm(), id="a1", registry=registry)
    assert registry.list() == ["a2", "a1"]
    with anyio.fail_after(WAIT):
        await first.close()  # closing the old agent again does not remove its successor
    assert registry.get("a1") is successor
    assert registry.get("a2") is second


def test_the_llm_service_registers_disposes_by_identity_and_requires_by_name() -> None:
    service = LlmService()
    first, second, other = ScriptedLlm(), ScriptedLlm(), ScriptedLlm()
    dispose_first = service.register_adapter("main", first)
    service.register_adapter("cheap", other)
    assert service.list() == ["main", "cheap"]
    assert service.get("main") is first
    assert service.require("cheap") is other
    assert service.get("missing") is None
    with pytest.raises(ValueError, match=r"^an adapter named 'main' is already registered$"):
        service.register_adapter("main", second)
    assert service.get("main") is first
    with pytest.raises(ValueError, match=r"^an adapter's name must be a non-empty str$"):
        service.register_adapter("", second)
    with pytest.raises(KeyError) as missing:
        service.require("missing")
    assert missing.value.args == ("no LLM adapter named 'missing' (registered: 'main', 'cheap')",)
    dispose_first()
    assert service.list() == ["cheap"]
    service.register_adapter("main", second)
    dispose_first()  # the name now belongs to another adapter: not ours to remove
    assert service.get("main") is second
    assert isinstance(second, LlmAdapter)
    with pytest.raises(KeyError) as none:
        LlmService().require("main")
    assert none.value.args == ("no LLM adapter named 'main' (registered: none)",)


# -- ScriptedLlm ----------------------------------------------------------------------------------------


async def collect(llm: LlmAdapter, request: CompletionRequest) -> list[CompletionEvent]:
    with anyio.fail_after(WAIT):
        return [event async for event in llm.stream(request)]


def request_with(*messages: Message, tools: tuple[ToolSpec, ...] = ()) -> CompletionRequest:
    return CompletionRequest(messages=messages, tools=tools)


LS = ToolCall("c1", "ls")
A_REQUEST = request_with(
    Message.system("You review code."),
    Message.user("count the files"),
    Message.assistant("", [LS]),
    Message.tool_result(LS, "a b c"),
    tools=(ToolSpec("ls", "List files."),),
)


@pytest.mark.parametrize(
    ("when", "request_", "matches"),
    [
        (When(), request_with(), True),
        (When(last_user_contains="count"), A_REQUEST, True),
        (When(last_user_contains="delete"), A_REQUEST, False),
        (When(last_user_contains="count"), request_with(Message.system("count")), False),
        (When(system_contains="review"), A_REQUEST, True),
        (When(system_contains="write"), A_REQUEST, False),
        (When(has_tool="ls"), A_REQUEST, True),
        (When(has_tool="rm"), A_REQUEST, False),
        (When(after_tool_result=True), A_REQUEST, True),
        (When(after_tool_result=False), A_REQUEST, False),
        (When(after_tool_result=False), request_with(Message.user("hi")), True),
        (When(after_tool_result=True), request_with(), False),
        (When(last_user_contains="count", has_tool="ls", after_tool_result=True), A_REQUEST, True),
        (When(last_user_contains="count", has_tool="rm"), A_REQUEST, False),
    ],
)
def test_each_when_condition_must_hold_for_a_reply_to_answer(
    when: When, request_: CompletionRequest, matches: bool
) -> None:
    assert when.matches(request_) is matches


async def test_a_script_answers_each_request_with_the_first_unused_reply_that_matches() -> None:
    llm = ScriptedLlm(
        [
            Reply("For the reviewer.", when=When(system_contains="review")),
            Reply("For the writer.", when=When(system_contains="write")),
            Reply("For anyone."),
        ]
    )
    writer = Agent(llm=llm, persona="You write docs.")
    reviewer = Agent(llm=llm, persona="You review code.")
    with anyio.fail_after(WAIT):
        assert (await writer.run_turn("Write.")).output == "For the writer."
        assert (await writer.run_turn("Write more.")).output == "For anyone."
        assert (await reviewer.run_turn("Review.")).output == "For the reviewer."
    assert llm.remaining == 0
    assert repr(llm) == "<ScriptedLlm 0 of 3 replies left>"


async def test_the_fallback_answers_every_request_once_the_script_is_used_up() -> None:
    llm = ScriptedLlm(["Scripted."], fallback="Fallback.")
    agent = Agent(llm=llm)
    with anyio.fail_after(WAIT):
        outputs = [(await agent.run_turn(prompt)).output for prompt in ("One.", "Two.", "Three.")]
    assert outputs == ["Scripted.", "Fallback.", "Fallback."]


async def test_an_exhausted_script_fails_with_a_script_error_naming_the_last_user_message() -> None:
    llm = ScriptedLlm(["Only one."])
    assert await collect(llm, request_with(Message.user("first"))) == [
        TextDelta("Only "),
        TextDelta("one."),
        Completion(Message.assistant("Only one."), "stop"),
    ]
    with pytest.raises(LlmError) as exhausted:
        await collect(llm, request_with(Message.user("second"), Message.assistant("x")))
    assert exhausted.value.kind is LlmErrorKind.SCRIPT
    assert (
        exhausted.value.message
        == "the script has no reply left for this request (last user message: 'second')"
    )
    agent = Agent(llm=ScriptedLlm())
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Hello?")
    assert result == SubagentResult(
        output="",
        stop_reason="error",
        error="the model call failed (script): the script has no reply left for this request "
        "(last user message: 'Hello?')",
    )


async def test_replies_stream_as_exact_deltas() -> None:
    request = request_with(Message.user("go"))
    llm = ScriptedLlm(
        [
            Reply("hello world", chunk=4),
            Reply("  two  words\n"),
            Reply("Adding.", tool_calls=[ToolCall("c1", "add", '{"a": 1}'), ToolCall("c2", "ls", "")]),
            Reply(usage=Usage(output_tokens=0), finish_reason="length"),
        ]
    )
    assert await collect(llm, request) == [
        TextDelta("hell"),
        TextDelta("o wo"),
        TextDelta("rld"),
        Completion(Message.assistant("hello world"), "stop"),
    ]
    assert await collect(llm, request) == [
        TextDelta("  "),
        TextDelta("two  "),
        TextDelta("words\n"),
        Completion(Message.assistant("  two  words\n"), "stop"),
    ]
    calls = (ToolCall("c1", "add", '{"a": 1}'), ToolCall("c2", "ls", ""))
    assert await collect(llm, request) == [
        TextDelta("Adding."),
        ToolCallDelta(0, id="c1", name="add"),
        ToolCallDelta(0, arguments='{"a"'),
        ToolCallDelta(0, arguments=": 1}"),
        ToolCallDelta(1, id="c2", name="ls"),
        ToolCallDelta(1, arguments=""),
        ToolCallDelta(1, arguments=""),
        Completion(Message.assistant("Adding.", calls), "tool_calls"),
    ]
    assert await collect(llm, request) == [Completion(Message.assistant(), "length", Usage(output_tokens=0))]
    assert llm.requests == [request] * 4


async def test_a_reply_with_an_error_streams_its_text_then_fails_with_that_error() -> None:
    error = LlmError(LlmErrorKind.SERVER, "502 from upstream", status=502)
    llm = ScriptedLlm([Reply("Partial answer", error=error)])
    stream = llm.stream(request_with(Message.user("go")))
    with anyio.fail_after(WAIT):
        assert await anext(stream) == TextDelta("Partial ")
        assert await anext(stream) == TextDelta("answer")
        with pytest.raises(LlmError) as raised:
            await anext(stream)
    assert raised.value is error
    assert repr(error) == "LlmError(server, '502 from upstream')"


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync-responder", "async-responder"])
async def test_a_callable_responder_answers_every_request(asynchronous: bool) -> None:
    def answer(request: CompletionRequest) -> Reply | str:
        last = request.messages[-1].content
        if last == "Use a tool.":
            return Reply(tool_calls=[call("echo", {"x": 1}, id="c1")])
        return f"You said: {last}"

    async def answer_later(request: CompletionRequest) -> Reply | str:
        await anyio.lowlevel.checkpoint()
        return answer(request)

    llm = ScriptedLlm(answer_later if asynchronous else answer)
    agent = Agent(llm=llm, tools=[echo_tool()])
    with anyio.fail_after(WAIT):
        first = await agent.run_turn("Hello.")
        second = await agent.run_turn("Use a tool.")
    assert first.output == "You said: Hello."
    assert second.output == 'You said: {"x": 1}'
    assert len(llm.requests) == 3
    assert llm.remaining == 0


async def test_from_json_builds_every_documented_field() -> None:
    script = {
        "replies": [
            "Plain text.",
            {
                "text": "Calling.",
                "tool_calls": [
                    {"name": "add", "arguments": {"a": 1, "b": 2}, "id": "c1"},
                    {"name": "echo", "arguments": '{"raw": true}'},
                ],
                "usage": {"input_tokens": 5, "output_tokens": 2},
            },
            {"text": "Cut off", "finish_reason": "length", "chunk": 3},
            {"text": "Only after a tool result.", "when": {"after_tool_result": True}},
            {"text": "Partial", "error": "the model is down"},
        ],
        "fallback": {"text": "Nothing left."},
    }
    plain = request_with(Message.user("go"))
    after_tool = request_with(Message.user("go"), Message.assistant("", [LS]), Message.tool_result(LS, "x"))
    for data in (json.dumps(script), json.dumps(script).encode(), script):
        llm = ScriptedLlm.from_json(data)
        assert llm.remaining == 5
        assert await collect(llm, plain) == [
            TextDelta("Plain "),
            TextDelta("text."),
            Completion(Message.assistant("Plain text."), "stop"),
        ]
        calling = await collect(llm, plain)
        completion = calling[-1]
        assert isinstance(completion, Completion)
        first_call, second_call = completion.message.tool_calls
        assert first_call == ToolCall("c1", "add", '{"a": 1, "b": 2}')
        assert (second_call.name, second_call.arguments) == ("echo", '{"raw": true}')
        assert re.fullmatch(r"call_[0-9a-f]{12}", second_call.id)
        assert (completion.finish_reason, completion.usage) == (
            "tool_calls",
            Usage(input_tokens=5, output_tokens=2),
        )
        assert await collect(llm, plain) == [
            TextDelta("Cut"),
            TextDelta(" of"),
            TextDelta("f"),
            Completion(Message.assistant("Cut off"), "length"),
        ]
        # The next plain request skips the reply waiting for a tool result.
        with pytest.raises(LlmError) as failed:
            await collect(llm, plain)
        assert (failed.value.kind, failed.value.message) == (LlmErrorKind.SCRIPT, "the model is down")
        assert (await collect(llm, after_tool))[-1] == Completion(
            Message.assistant("Only after a tool result."), "stop"
        )
        assert (await collect(llm, plain))[-1] == Completion(Message.assistant("Nothing left."), "stop")


async def test_from_json_accepts_a_python_sequence_of_replies_and_from_file_reads_a_file(
    tmp_path: Path,
) -> None:
    # Caught a bug: a tuple of replies, a Sequence as the signature promises, was refused.
    llm = ScriptedLlm.from_json(("One.", {"text": "Two."}))
    request = request_with(Message.user("go"))
    assert [(await collect(llm, request))[-1] for _ in range(2)] == [
        Completion(Message.assistant("One."), "stop"),
        Completion(Message.assistant("Two."), "stop"),
    ]
    path = tmp_path / "script.json"
    path.write_text('["From a file."]', encoding="utf-8")
    assert (await collect(ScriptedLlm.from_file(path), request))[-1] == Completion(
        Message.assistant("From a file."), "stop"
    )


FINISH_REASONS_ERROR = "reply 0: `finish_reason` must be one of content_filter, length, stop, tool_calls"


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("[1, 2", "the script is not valid JSON: "),
        ('"just text"', "a script is a list of replies, or an object with `replies`"),
        ('{"replies": {"text": "x"}}', "a script is a list of replies, or an object with `replies`"),
        ('{"replies": [], "extra": 1}', "unknown script keys: extra"),
        ('{"fallback": 3}', "fallback: a reply is a string or an object"),
        ('{"fallback": {"txt": "x"}}', "fallback: unknown keys txt"),
        ("[1]", "reply 0: a reply is a string or an object"),
        ('["ok", {"txt": "x", "wait": 1}]', "reply 1: unknown keys txt, wait"),
        ('[{"text": 3}]', "reply 0: `text` must be a string"),
        ('[{"tool_calls": [{"arguments": {}}]}]', "reply 0: tool call 0 needs a string `name`"),
        ('[{"tool_calls": ["add"]}]', "reply 0: tool call 0 needs a string `name`"),
        (
            '[{"tool_calls": [{"name": "a"}, {"name": "b", "arguments": [1]}]}]',
            "reply 0: tool call 1: `arguments` must be an object or a string",
        ),
        ('[{"tool_calls": {"name": "a"}}]', "reply 0: `tool_calls` must be a list"),
        ('[{"tool_calls": "add"}]', "reply 0: `tool_calls` must be a list"),
        ('[{"tool_calls": {}}]', "reply 0: `tool_calls` must be a list"),
        ('[{"finish_reason": "done"}]', FINISH_REASONS_ERROR),
        ('[{"usage": [1]}]', "reply 0: bad `usage`: it must be an object"),
        ('[{"usage": {"tokens": 1}}]', "reply 0: bad `usage`: unknown keys tokens"),
        ('[{"when": "always"}]', "reply 0: bad `when`: it must be an object"),
        ('[{"when": {"last_user": "x"}}]', "reply 0: bad `when`: unknown keys last_user"),
        ('[{"chunk": 0}]', "reply 0: `chunk` must be a whole number >= 1"),
        ('[{"chunk": 2.5}]', "reply 0: `chunk` must be a whole number >= 1"),
        # These caught bugs: each was accepted (and failed later, or never), or raised a TypeError.
        ('[{"tool_calls": [{"name": "a", "id": 7}]}]', "reply 0: tool call 0: `id` must be a string"),
        ('[{"finish_reason": ["stop"]}]', FINISH_REASONS_ERROR),
        ('[{"usage": {"input_tokens": "5"}}]', "reply 0: bad `usage`: `input_tokens` must be a whole number"),
        (
            '[{"usage": {"output_tokens": true}}]',
            "reply 0: bad `usage`: `output_tokens` must be a whole number",
        ),
        ('[{"error": {"code": 500}}]', "reply 0: `error` must be a string (the failure's message)"),
        ('[{"when": {"has_tool": 1}}]', "reply 0: bad `when`: `has_tool` must be a string"),
        (
            '[{"when": {"after_tool_result": "yes"}}]',
            "reply 0: bad `when`: `after_tool_result` must be true or false",
        ),
        ('[{"chunk": true}]', "reply 0: `chunk` must be a whole number >= 1"),
    ],
)
def test_from_json_refuses_each_invalid_shape_with_a_value_error_naming_the_reply(
    script: str, expected: str
) -> None:
    whole = "" if expected.endswith(": ") else "$"  # a decoder's message only starts as expected
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}{whole}"):
        ScriptedLlm.from_json(script)


def test_call_encodes_mapping_arguments_passes_text_through_and_makes_fresh_ids() -> None:
    encoded = call("add", {"a": 1, "b": [2]})
    assert (encoded.name, encoded.arguments) == ("add", '{"a": 1, "b": [2]}')
    assert re.fullmatch(r"call_[0-9a-f]{12}", encoded.id)
    assert call("raw", '{"x": tru', id="c9") == ToolCall("c9", "raw", '{"x": tru')
    assert call("bare", id="c1") == ToolCall("c1", "bare", "{}")
    assert call("x").id != call("x").id


def test_messages_and_requests_are_immutable_records() -> None:
    message = Message("assistant", "hi", [ToolCall("c1", "ls")])  # type: ignore[arg-type]
    assert message.tool_calls == (ToolCall("c1", "ls"),)
    request = CompletionRequest(messages=[message], response_schema={"type": "object"})  # type: ignore[arg-type]
    assert request.messages == (message,)
    with pytest.raises(TypeError):
        request.response_schema["type"] = "array"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.content = "changed"  # type: ignore[misc]


async def test_scripted_replies_may_be_given_in_the_json_scripts_object_form() -> None:
    llm = ScriptedLlm(
        [{"text": "calling", "tool_calls": [{"name": "echo", "arguments": {"x": 1}, "id": "c1"}]}, "plain"],
        fallback={"text": "fallback", "finish_reason": "length"},
    )
    agent = Agent(llm=llm, tools=[echo_tool()])
    with anyio.fail_after(WAIT):
        first = await agent.run_turn("Go.")
        second = await agent.run_turn("Again.")
    assert first == SubagentResult("plain", "completed")
    assert agent.messages[1] == Message.assistant("calling", [ToolCall("c1", "echo", '{"x": 1}')])
    assert second == SubagentResult("fallback", "max_tokens")


def test_a_scripted_reply_of_the_wrong_shape_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="reply 1: unknown keys txt"):
        ScriptedLlm(["fine", {"txt": "typo"}])
