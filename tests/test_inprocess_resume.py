"""Durable in-process runs: a ``spawn`` or ``fork`` run's checkpoint is its child's log as of its last
completed turn, and a provider (a new one, as after a restart) reopens it in a new child that runs the
resumed prompt as its next turn, on asyncio and trio.

Every child is a real :class:`~subagent.runtime.Agent` driven by a :class:`ScriptedLlm`, so the tests
assert exactly which messages the resumed model was sent. Checkpoints go through ``json`` on their way to
the reopening provider, as they do through the service's run journal. No test sleeps to wait for
something: a model is held mid-turn with ``Reply(wait=...)`` and an event the test sets.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import (
    ErrorCode,
    Lineage,
    ResumableRun,
    ServiceRun,
    SteerableRun,
    SubagentError,
    SubagentRequest,
    SubagentService,
    ToolFilter,
)
from subagent.providers._inprocess import InProcessProvider, InProcessRun
from subagent.providers.fork import ForkProvider
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import (
    Agent,
    AgentRegistry,
    FunctionTool,
    LlmError,
    LlmErrorKind,
    LlmService,
    Message,
    Reply,
    ScriptedLlm,
    ToolCall,
    ToolInvocation,
    call,
)
from subagent.runtime._log_codec import decode_log, encode_log
from subagent.types import CheckpointedRun, ReopenableProvider, ResumePoint, freeze_json

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

WAIT = 5  # seconds; a bound on every wait, never a sleep
JOURNAL_ID = "5f3a9c1e"
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


# -- helpers ------------------------------------------------------------------------------------------


def through_json(value: Any) -> Any:
    """``value`` as the journal gives it back: written as JSON text and read again."""
    return json.loads(json.dumps(value))


def point_of(
    checkpoint: Mapping[str, Any] | None, kind: str | None = "spawn", turns_completed: int = 1
) -> ResumePoint:
    agent: dict[str, Any] = {"llm": "ScriptedLlm"} if kind is None else {"kind": kind, "llm": "ScriptedLlm"}
    return ResumePoint(
        run_id=JOURNAL_ID, checkpoint=through_json(checkpoint), agent=agent, turns_completed=turns_completed
    )


def make_tool(name: str, output: str) -> FunctionTool:
    return FunctionTool(name, f"The {name} tool.", NO_ARGUMENTS, lambda arguments: output)


class Hold:
    """A `Reply.wait` that records that the model was reached, then waits for the test's go."""

    def __init__(self) -> None:
        self.reached = anyio.Event()
        self.release = anyio.Event()

    async def __call__(self) -> None:
        self.reached.set()
        await self.release.wait()


@asynccontextmanager
async def open_service(*providers: InProcessProvider) -> AsyncIterator[SubagentService]:
    async with SubagentService() as service:
        for provider in providers:
            service.register_provider(provider)
        yield service


@asynccontextmanager
async def reopened(
    provider: InProcessProvider, request: SubagentRequest, point: ResumePoint
) -> AsyncIterator[InProcessRun]:
    """A reopened run, its first turn in a task group of its own; disposed on exit."""
    async with anyio.create_task_group() as task_group:
        run = provider.reopen(request, point, task_group)
        async with run:
            yield run


def provider_run(run: ServiceRun) -> InProcessRun:
    inner = run.provider_run
    assert isinstance(inner, InProcessRun)
    return inner


# -- the log codec ------------------------------------------------------------------------------------

READ = call("read", {"path": "a.txt"}, id="call-read")
GREP = ToolCall("call-grep", "grep", '{"pattern": "TODO"')  # invalid JSON, kept exactly as written
EVERY_KIND = (
    Message.system("You are careful."),
    Message.user("What is in a.txt?"),
    Message.assistant("Let me look.", [READ, GREP]),
    Message.tool_result(READ, "hello"),
    Message.tool_result(GREP, "error: the arguments are not valid JSON"),
    Message.assistant("It says hello."),
    Message.user(""),
)


async def test_the_log_codec_writes_each_message_as_a_plain_object_and_reads_it_back_equal() -> None:
    encoded = encode_log(EVERY_KIND)

    assert encoded == [
        {"role": "system", "content": "You are careful."},
        {"role": "user", "content": "What is in a.txt?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "call-read", "name": "read", "arguments": '{"path": "a.txt"}'},
                {"id": "call-grep", "name": "grep", "arguments": '{"pattern": "TODO"'},
            ],
        },
        {"role": "tool", "content": "hello", "tool_call_id": "call-read", "name": "read"},
        {
            "role": "tool",
            "content": "error: the arguments are not valid JSON",
            "tool_call_id": "call-grep",
            "name": "grep",
        },
        {"role": "assistant", "content": "It says hello."},
        {"role": "user", "content": ""},
    ]
    assert decode_log(through_json(encoded)) == EVERY_KIND
    # A frozen JSON value (tuples, read-only mappings) reads the same; null optional fields are absent.
    assert decode_log(freeze_json(encoded)) == EVERY_KIND
    assert decode_log([{"role": "user", "content": "hi", "tool_call_id": None, "name": None}]) == (
        Message.user("hi"),
    )
    assert decode_log([]) == ()


@pytest.mark.parametrize(
    ("log", "why"),
    [
        pytest.param({"role": "user"}, "messages must be an array, not an object", id="not-an-array"),
        pytest.param(None, "messages must be an array, not null", id="null"),
        pytest.param(["hi"], "messages[0] must be an object, not a string", id="message-not-an-object"),
        pytest.param(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b", "time": 1, "id": "x"}],
            "messages[1] has unknown keys: 'id', 'time'",
            id="unknown-keys",
        ),
        pytest.param([{"content": "a"}], "messages[0] has no role", id="no-role"),
        pytest.param(
            [{"role": "robot", "content": "a"}],
            "messages[0].role must be one of 'system', 'user', 'assistant', 'tool', not 'robot'",
            id="unknown-role",
        ),
        pytest.param([{"role": "user"}], "messages[0] has no content", id="no-content"),
        pytest.param(
            [{"role": "user", "content": 3}],
            "messages[0].content must be a string, not a number",
            id="content-not-a-string",
        ),
        pytest.param(
            [{"role": "assistant", "content": "", "tool_calls": "read"}],
            "messages[0].tool_calls must be an array, not a string",
            id="tool-calls-not-an-array",
        ),
        pytest.param(
            [{"role": "assistant", "content": "", "tool_calls": [["call-1", "read", "{}"]]}],
            "messages[0].tool_calls[0] must be an object, not an array",
            id="tool-call-not-an-object",
        ),
        pytest.param(
            [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "name": "read"}]}],
            "messages[0].tool_calls[0] has no arguments",
            id="tool-call-without-arguments",
        ),
        pytest.param(
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": 7, "name": "read", "arguments": "{}"}],
                }
            ],
            "messages[0].tool_calls[0].id must be a string, not a number",
            id="tool-call-id-not-a-string",
        ),
        pytest.param(
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": "c", "name": "read", "arguments": {}, "type": "function"}],
                }
            ],
            "messages[0].tool_calls[0] has unknown keys: 'type'",
            id="tool-call-unknown-keys",
        ),
        pytest.param(
            [{"role": "user", "content": "", "tool_calls": [{"id": "c", "name": "read", "arguments": "{}"}]}],
            "messages[0] (user) has tool_calls, which only assistant messages have",
            id="tool-calls-on-a-user-message",
        ),
        pytest.param(
            [{"role": "tool", "content": "hello", "name": "read"}],
            "messages[0] (tool) has no tool_call_id",
            id="tool-result-without-its-call",
        ),
        pytest.param(
            [{"role": "tool", "content": "hello", "tool_call_id": True}],
            "messages[0].tool_call_id must be a string or null, not a boolean",
            id="tool-call-id-not-a-string",
        ),
        pytest.param(
            [{"role": "assistant", "content": "hi", "name": "read"}],
            "messages[0] (assistant) has a name, which only tool results have",
            id="name-on-an-assistant-message",
        ),
    ],
)
async def test_the_log_codec_refuses_a_malformed_log_saying_where_and_what(log: Any, why: str) -> None:
    with pytest.raises(ValueError, match=r"^messages") as caught:
        decode_log(log)
    assert str(caught.value) == why


# -- checkpoints --------------------------------------------------------------------------------------


async def test_a_checkpoint_from_the_start_holds_the_persona_or_a_forks_seeded_context() -> None:
    agents = AgentRegistry()
    spawn_hold, fork_hold = Hold(), Hold()
    parent_llm = ScriptedLlm(["earlier answer", Reply("fork answer", wait=fork_hold)])
    parent = Agent(llm=parent_llm, id="lead", persona="You are the lead.", cwd="/src", registry=agents)
    spawn_llm = ScriptedLlm([Reply("spawn answer", wait=spawn_hold)])
    spawn = SpawnProvider(agents=agents, llm=spawn_llm, persona="You are a helper.")
    fork = ForkProvider(agents=agents)
    async with open_service(spawn, fork) as service:
        with anyio.fail_after(WAIT):
            await parent.run_turn("earlier question")
            spawned = service.start("spawn", SubagentRequest(prompt="spawn task", cwd="/work"))
            forked = service.start("fork", SubagentRequest(prompt="fork task", parent_id="lead"))
            await spawn_hold.reached.wait()
            await fork_hold.reached.wait()
            # Their first turns are in flight: not in the checkpoint.
            assert provider_run(spawned).checkpoint() == {
                "messages": [{"role": "system", "content": "You are a helper."}],
                "cwd": "/work",
            }
            assert provider_run(forked).checkpoint() == {
                "messages": [
                    {"role": "system", "content": "You are the lead."},
                    {"role": "user", "content": "earlier question"},
                    {"role": "assistant", "content": "earlier answer"},
                ],
                "cwd": "/src",
            }
            spawn_hold.release.set()
            fork_hold.release.set()
            assert (await spawned.result()).output == "spawn answer"
            assert (await forked.result()).output == "fork answer"
        bare = SpawnProvider(agents=agents, llm=ScriptedLlm(["bare answer"]), name="bare")
        service.register_provider(bare)
        async with service.start("bare", SubagentRequest(prompt="bare task")) as run:
            assert provider_run(run).checkpoint() == {"messages": [], "cwd": None}
            with anyio.fail_after(WAIT):
                await run.result()
        assert isinstance(provider_run(run), CheckpointedRun)
        json.dumps(provider_run(forked).checkpoint())  # JSON-able as it is


async def test_two_turns_reopened_by_a_new_provider_send_the_model_their_exact_log_and_the_new_prompt() -> (
    None
):
    read = call("read", {}, id="call-read")
    first_llm = ScriptedLlm([Reply(tool_calls=[read]), "a.txt has 3 lines.", "Counted: 3."])
    tools = [make_tool("read", "one\ntwo\nthree")]
    first = SpawnProvider(llm=first_llm, agents=AgentRegistry(), tools=tools, persona="You count lines.")
    async with open_service(first) as service:
        with anyio.fail_after(WAIT):
            run = service.start("spawn", SubagentRequest(prompt="How long is a.txt?", cwd="/repo"))
            assert (await run.result()).output == "a.txt has 3 lines."
            assert (await provider_run(run).resume("Count them again.")).output == "Counted: 3."
        checkpoint = provider_run(run).checkpoint()
        await run.dispose()
        assert provider_run(run).checkpoint() == checkpoint  # what it was at its last completed turn

    # A new provider and registry, as in a new process; the journal gave back the JSON.
    agents = AgentRegistry()
    llm = ScriptedLlm(["It had 3 lines."])
    provider = SpawnProvider(llm=llm, agents=agents, tools=tools)
    request = SubagentRequest(prompt="What did you find?", lineage=Lineage(depth=1))
    with anyio.fail_after(WAIT):
        async with reopened(provider, request, point_of(checkpoint, turns_completed=2)) as resumed:
            assert agents.get(resumed.id) is resumed.agent
            assert resumed.id != run.id  # a new run id
            result = await resumed.result()

    assert result.output == "It had 3 lines."
    (asked,) = llm.requests
    assert asked.messages == (
        Message.system("You count lines."),
        Message.user("How long is a.txt?"),
        Message.assistant("", [read]),
        Message.tool_result(read, "one\ntwo\nthree"),
        Message.assistant("a.txt has 3 lines."),
        Message.user("Count them again."),
        Message.assistant("Counted: 3."),
        Message.user("What did you find?"),
    )
    assert [spec.name for spec in asked.tools] == ["read"]
    assert resumed.agent.persona == "You count lines."  # the log's, though the new provider has none
    assert resumed.agent.cwd == "/repo"  # the checkpoint's, since the request names none
    assert len(first_llm.requests) == 3  # nothing of the first run was asked again
    assert agents.list() == []


async def test_a_turn_cancelled_mid_way_is_not_in_the_checkpoint_until_a_later_turn_completes() -> None:
    hold = Hold()
    llm = ScriptedLlm(["first answer", Reply("never sent", wait=hold), "third answer"])
    after_first = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "first answer"},
    ]
    async with open_service(SpawnProvider(llm=llm, agents=AgentRegistry())) as service:
        with anyio.fail_after(WAIT):
            run = service.start("spawn", SubagentRequest(prompt="first"))
            await run.result()
            inner = provider_run(run)
            cancelled = None
            async with anyio.create_task_group() as task_group:

                async def second() -> None:
                    nonlocal cancelled
                    cancelled = await inner.resume("second")

                task_group.start_soon(second)
                await hold.reached.wait()
                await inner.send_message("a note sent mid-turn")
                assert inner.checkpoint() == {"messages": after_first, "cwd": None}
                await inner.cancel()
            assert cancelled is not None
            assert cancelled.stop_reason == "cancelled"
            assert inner.checkpoint() == {"messages": after_first, "cwd": None}
            # The cancelled turn stays in the child's log: the next turn completes with it seen.
            assert (await inner.resume("third")).output == "third answer"
            assert inner.checkpoint() == {
                "messages": [
                    *after_first,
                    {"role": "user", "content": "second"},
                    {"role": "user", "content": "a note sent mid-turn"},
                    {"role": "user", "content": "third"},
                    {"role": "assistant", "content": "third answer"},
                ],
                "cwd": None,
            }
            await run.dispose()


@pytest.mark.parametrize(
    ("second", "stop_reason"),
    [
        pytest.param(Reply(error=LlmError(LlmErrorKind.SERVER, "HTTP 503")), "error", id="error"),
        pytest.param(Reply(tool_calls=[call("read", {}, id="call-read")]), "max_turns", id="max-turns"),
        pytest.param(Reply("cut", finish_reason="length"), "max_tokens", id="max-tokens"),
    ],
)
async def test_a_turn_that_ends_other_than_completed_leaves_the_checkpoint_as_it_was(
    second: Reply, stop_reason: str
) -> None:
    llm = ScriptedLlm(["first answer", second])
    tools = [make_tool("read", "x")]
    provider = SpawnProvider(llm=llm, agents=AgentRegistry(), tools=tools, max_model_calls=1)
    async with open_service(provider) as service:
        with anyio.fail_after(WAIT):
            async with service.start("spawn", SubagentRequest(prompt="first")) as run:
                await run.result()
                before = provider_run(run).checkpoint()
                assert (await provider_run(run).resume("second")).stop_reason == stop_reason
                assert provider_run(run).checkpoint() == before
                assert before == {
                    "messages": [
                        {"role": "user", "content": "first"},
                        {"role": "assistant", "content": "first answer"},
                    ],
                    "cwd": None,
                }


async def test_a_message_delivered_inside_a_completed_turn_is_in_that_turns_checkpoint() -> None:
    hold = Hold()
    llm = ScriptedLlm([Reply("working on it", wait=hold), "answered the note too"])
    async with open_service(SpawnProvider(llm=llm, agents=AgentRegistry())) as service:
        with anyio.fail_after(WAIT):
            async with service.start("spawn", SubagentRequest(prompt="task")) as run:
                await hold.reached.wait()
                await provider_run(run).send_message("also check b.txt")
                hold.release.set()
                assert (await run.result()).output == "answered the note too"
                assert provider_run(run).checkpoint() == {
                    "messages": [
                        {"role": "user", "content": "task"},
                        {"role": "assistant", "content": "working on it"},
                        {"role": "user", "content": "also check b.txt"},
                        {"role": "assistant", "content": "answered the note too"},
                    ],
                    "cwd": None,
                }


# -- reopen ----------------------------------------------------------------------------------------------


async def test_a_resumed_fork_keeps_its_seeded_context_and_is_not_forked_again_from_a_live_parent() -> None:
    agents = AgentRegistry()
    parent_llm = ScriptedLlm(["earlier answer", "a later answer", "resumed fork answer"])
    parent = Agent(llm=parent_llm, id="lead", persona="You are the lead.", registry=agents)
    fork_llm = ScriptedLlm(["fork answer"])
    async with open_service(ForkProvider(agents=agents, llm=fork_llm)) as service:
        with anyio.fail_after(WAIT):
            await parent.run_turn("earlier question")
            async with service.start("fork", SubagentRequest(prompt="fork task", parent_id="lead")) as run:
                await run.result()
                checkpoint = provider_run(run).checkpoint()
            # The parent moves on: a fork made now would see this turn too.
            await parent.run_turn("a later question")

    # A new fork provider without a model of its own: it borrows the live parent's, not its log.
    provider = ForkProvider(agents=agents)
    request = SubagentRequest(prompt="go on", parent_id="lead", lineage=Lineage(depth=1, ancestors=("lead",)))
    with anyio.fail_after(WAIT):
        async with reopened(provider, request, point_of(checkpoint, kind="fork")) as resumed:
            result = await resumed.result()

    assert result.output == "resumed fork answer"
    assert parent_llm.requests[-1].messages == (
        Message.system("You are the lead."),
        Message.user("earlier question"),
        Message.assistant("earlier answer"),
        Message.user("fork task"),
        Message.assistant("fork answer"),
        Message.user("go on"),
    )
    assert resumed.agent.parent_id == "lead"


async def test_a_resumed_fork_needs_no_live_parent_when_its_provider_has_a_model() -> None:
    agents = AgentRegistry()
    parent = Agent(
        llm=ScriptedLlm(["earlier answer"]), id="lead", persona="You are the lead.", registry=agents
    )
    fork_llm = ScriptedLlm(["fork answer"])
    async with open_service(ForkProvider(agents=agents, llm=fork_llm)) as service:
        with anyio.fail_after(WAIT):
            await parent.run_turn("earlier question")
            async with service.start("fork", SubagentRequest(prompt="fork task", parent_id="lead")) as run:
                await run.result()
                checkpoint = provider_run(run).checkpoint()
    await parent.close()
    assert agents.list() == []

    llm = ScriptedLlm(["resumed fork answer"])
    provider = ForkProvider(agents=AgentRegistry(), llm=llm, persona="A persona the log overrides.")
    request = SubagentRequest(prompt="go on", parent_id="lead", lineage=Lineage(depth=1, ancestors=("lead",)))
    with anyio.fail_after(WAIT):
        async with reopened(provider, request, point_of(checkpoint, kind="fork")) as resumed:
            assert (await resumed.result()).output == "resumed fork answer"
    assert llm.requests[0].messages == (
        Message.system("You are the lead."),
        Message.user("earlier question"),
        Message.assistant("earlier answer"),
        Message.user("fork task"),
        Message.assistant("fork answer"),
        Message.user("go on"),
    )


async def test_a_spawn_without_a_checkpoint_that_completed_no_turn_starts_afresh_with_its_persona() -> None:
    request = SubagentRequest(prompt="continue", persona="You are terse.", cwd="/work")
    # No checkpoint at all, or one without a log: the same fresh child.
    for point in (point_of(None, turns_completed=0), point_of({"cwd": "/elsewhere"}, turns_completed=0)):
        llm = ScriptedLlm(["fresh answer"])
        provider = SpawnProvider(llm=llm, agents=AgentRegistry(), persona="You are a helper.")
        with anyio.fail_after(WAIT):
            async with reopened(provider, request, point) as resumed:
                assert (await resumed.result()).output == "fresh answer"
        assert llm.requests[0].messages == (Message.system("You are terse."), Message.user("continue"))
        assert resumed.agent.cwd == "/work"


async def test_a_resumed_child_is_made_as_start_makes_one_depth_narrowed_tools_approver_schema() -> None:
    asked: list[str] = []

    def approve(invocation: ToolInvocation) -> bool:
        asked.append(invocation.tool)
        return True

    write = FunctionTool("write", "Write.", NO_ARGUMENTS, lambda arguments: "written", needs_approval=True)
    tools = [make_tool("read", "r"), make_tool("shell", "s"), write]
    write_call = call("write", {}, id="call-write")
    llm = ScriptedLlm([Reply(tool_calls=[write_call]), '{"files": 2}'])
    provider = SpawnProvider(llm=llm, agents=AgentRegistry(), tools=tools, approver=approve)
    lineage = Lineage(depth=3, ancestors=("b", "a"), tool_filter=ToolFilter(deny={"shell"}))
    schema = {"type": "object", "properties": {"files": {"type": "integer"}}, "required": ["files"]}
    request = SubagentRequest(prompt="how many?", parent_id="b", lineage=lineage, output_schema=schema)
    checkpoint = {"messages": encode_log([Message.user("hi"), Message.assistant("hello")]), "cwd": None}
    with anyio.fail_after(WAIT):
        async with reopened(provider, request, point_of(checkpoint)) as resumed:
            result = await resumed.result()

    assert (result.stop_reason, result.structured) == ("completed", {"files": 2})
    assert (resumed.agent.depth, resumed.agent.parent_id) == (3, "b")
    assert [spec.name for spec in llm.requests[0].tools] == ["read", "write"]
    assert asked == ["write"]
    assert llm.requests[0].messages[:2] == (Message.user("hi"), Message.assistant("hello"))


async def test_a_resumed_run_offers_resume_send_message_and_its_own_checkpoint_like_any_run() -> None:
    hold = Hold()
    llm = ScriptedLlm(["resumed answer", Reply("next answer", wait=hold), "answered the note"])
    provider = SpawnProvider(llm=llm, agents=AgentRegistry())
    checkpoint = {"messages": encode_log([Message.user("old"), Message.assistant("old answer")]), "cwd": None}
    with anyio.fail_after(WAIT):
        async with reopened(provider, SubagentRequest(prompt="new"), point_of(checkpoint)) as resumed:
            assert isinstance(resumed, SteerableRun)
            assert isinstance(resumed, ResumableRun)
            assert isinstance(resumed, CheckpointedRun)
            assert resumed.checkpoint() == checkpoint  # from the start: the log it continues
            await resumed.result()
            async with anyio.create_task_group() as task_group:
                outcome = []

                async def next_turn() -> None:
                    outcome.append(await resumed.resume("next"))

                task_group.start_soon(next_turn)
                await hold.reached.wait()
                await resumed.send_message("a note")
                hold.release.set()
            assert [result.output for result in outcome] == ["answered the note"]
            assert resumed.checkpoint() == {
                "messages": [
                    {"role": "user", "content": "old"},
                    {"role": "assistant", "content": "old answer"},
                    {"role": "user", "content": "new"},
                    {"role": "assistant", "content": "resumed answer"},
                    {"role": "user", "content": "next"},
                    {"role": "assistant", "content": "next answer"},
                    {"role": "user", "content": "a note"},
                    {"role": "assistant", "content": "answered the note"},
                ],
                "cwd": None,
            }
    with pytest.raises(SubagentError) as caught:
        await resumed.send_message("too late")
    assert caught.value.code == ErrorCode.DISPOSED


async def test_each_provider_describes_its_children_without_secrets() -> None:
    llms = LlmService()
    spawn = SpawnProvider(llm=ScriptedLlm(), agents=AgentRegistry())
    named = SpawnProvider(llm="small", llm_service=llms, agents=AgentRegistry())
    fork = ForkProvider(agents=AgentRegistry())

    assert [spawn.describe_agent(), named.describe_agent(), fork.describe_agent()] == [
        {"kind": "spawn", "llm": "ScriptedLlm"},
        {"kind": "spawn", "llm": "small"},
        {"kind": "fork", "llm": None},
    ]
    assert all(isinstance(provider, ReopenableProvider) for provider in (spawn, named, fork))


# -- refusals --------------------------------------------------------------------------------------------

GOOD = {"messages": [{"role": "user", "content": "hi"}], "cwd": None}


@pytest.mark.parametrize(
    ("kind", "request_", "point", "why"),
    [
        pytest.param(
            "spawn",
            SubagentRequest(prompt="p"),
            point_of(GOOD, kind="fork"),
            f"run {JOURNAL_ID} was a 'fork' child, and this provider makes 'spawn' ones",
            id="another-kind",
        ),
        pytest.param(
            "fork",
            SubagentRequest(prompt="p"),
            point_of(GOOD, kind="spawn"),
            f"run {JOURNAL_ID} was a 'spawn' child, and this provider makes 'fork' ones",
            id="another-kind-fork",
        ),
        pytest.param(
            "spawn",
            SubagentRequest(prompt="p"),
            point_of(GOOD, kind=None),
            f"the journal does not say what kind of child run {JOURNAL_ID} was",
            id="no-kind",
        ),
        pytest.param(
            "spawn",
            SubagentRequest(prompt="p", isolation="worktree"),
            point_of(GOOD),
            f"run {JOURNAL_ID} worked in an isolated workspace (worktree), which was closed with its child",
            id="isolated",
        ),
        pytest.param(
            "fork",
            SubagentRequest(prompt="p"),
            point_of(None, kind="fork", turns_completed=0),
            f"run {JOURNAL_ID} has no checkpoint, so the context the fork was seeded with is lost "
            "(a resumed fork is not forked again)",
            id="fork-without-checkpoint",
        ),
        pytest.param(
            "spawn",
            SubagentRequest(prompt="p"),
            point_of(None, turns_completed=2),
            f"run {JOURNAL_ID} completed 2 turn(s) but has no checkpoint, so starting it afresh would "
            "lose them",
            id="spawn-without-checkpoint-after-turns",
        ),
        pytest.param(
            "spawn",
            SubagentRequest(prompt="p"),
            point_of({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}),
            f"run {JOURNAL_ID}'s checkpoint is malformed: messages[1].role must be one of 'system', "
            "'user', 'assistant', 'tool', not 'robot'",
            id="malformed-log",
        ),
        pytest.param(
            "spawn",
            SubagentRequest(prompt="p"),
            point_of({"messages": [], "cwd": 7}),
            f"run {JOURNAL_ID}'s checkpoint is malformed: cwd must be a string or null, not a number",
            id="malformed-cwd",
        ),
        pytest.param(
            "spawn",
            SubagentRequest(prompt="p"),
            ResumePoint(JOURNAL_ID, ["hi"], {"kind": "spawn"}, 1),  # type: ignore[arg-type]
            f"run {JOURNAL_ID}'s checkpoint is malformed: it must be an object, not an array",
            id="checkpoint-not-an-object",
        ),
        pytest.param(
            "fork",
            SubagentRequest(prompt="p", parent_id="gone"),
            point_of(GOOD, kind="fork"),
            "no LLM adapter: the provider has none and the parent is not an in-process agent",
            id="no-model",
        ),
    ],
)
async def test_a_run_that_cannot_be_reopened_is_refused_with_the_reason_before_any_child_exists(
    kind: str, request_: SubagentRequest, point: ResumePoint, why: str
) -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm(fallback="never asked")
    provider: InProcessProvider = (
        SpawnProvider(agents=agents, llm=llm) if kind == "spawn" else ForkProvider(agents=agents)
    )
    async with anyio.create_task_group() as task_group:
        with pytest.raises(SubagentError) as caught:
            provider.reopen(request_, point, task_group)
    assert (caught.value.code, caught.value.provider) == (ErrorCode.RESUME_UNSUPPORTED, kind)
    assert caught.value.message == f"provider {kind!r}: {why}"
    assert agents.list() == []
    assert llm.requests == []


async def test_a_model_named_but_not_registered_or_an_invalid_schema_refuses_the_reopen_saying_so() -> None:
    agents = AgentRegistry()
    named = SpawnProvider(llm="small", llm_service=LlmService(), agents=agents)
    schema = SpawnProvider(llm=ScriptedLlm(), agents=agents)
    invalid = SubagentRequest(prompt="p", output_schema={"type": 3})
    async with anyio.create_task_group() as task_group:
        with pytest.raises(SubagentError) as unnamed:
            named.reopen(SubagentRequest(prompt="p"), point_of(GOOD), task_group)
        with pytest.raises(SubagentError) as unschemed:
            schema.reopen(invalid, point_of(GOOD), task_group)
    assert (unnamed.value.code, unschemed.value.code) == (ErrorCode.RESUME_UNSUPPORTED,) * 2
    assert unnamed.value.message == "provider 'spawn': no LLM adapter named 'small' (registered: none)"
    assert unschemed.value.message.startswith(
        "provider 'spawn': the output schema is not a valid JSON Schema: 3 is not valid under any of the "
        "given schemas\n"
    )
    assert agents.list() == []


# -- through the service's run journal ---------------------------------------------------------------------


async def test_a_spawn_disposed_mid_turn_resumes_through_the_journal_from_its_last_completed_turn(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    hold = Hold()
    first_llm = ScriptedLlm(["first answer", Reply("never sent", wait=hold)])
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=path) as service:
            service.register_provider(
                SpawnProvider(llm=first_llm, agents=AgentRegistry(), persona="Be brief.")
            )
            run = service.start("spawn", SubagentRequest(prompt="first"))
            assert (await run.result()).output == "first answer"
            refused: list[ErrorCode] = []

            async def second() -> None:
                with pytest.raises(SubagentError) as caught:
                    await run.resume("second")  # type: ignore[attr-defined]
                refused.append(caught.value.code)

            async with anyio.create_task_group() as task_group:
                task_group.start_soon(second)
                await hold.reached.wait()
                await run.dispose()
            assert refused == [ErrorCode.DISPOSED]

        # A new service and provider on the same journal, as after a restart.
        llm = ScriptedLlm(["picked up"])
        async with SubagentService(journal=path) as later:
            later.register_provider(SpawnProvider(llm=llm, agents=AgentRegistry()))
            assert run.journal_id is not None
            again = await later.resume(run.journal_id)
            assert (await again.result()).output == "picked up"
            assert again.journal_id == run.journal_id
            await again.dispose()

    (asked,) = llm.requests
    # The default prompt names the turn that never completed; that turn's own messages are not sent.
    assert "second" in again.request.prompt
    assert asked.messages == (
        Message.system("Be brief."),
        Message.user("first"),
        Message.assistant("first answer"),
        Message.user(again.request.prompt),
    )
    assert len(first_llm.requests) == 2
