"""Background delegation by in-process parent agents: a scripted parent starts children of mixed
providers (spawn, fork, and a stub ACP agent) with ``background: true``, keeps taking model calls,
reads their notices at its idle points, and owns them: they die with it, with its cancelled turn, with
the tool and with the service. Wake and ``next_turn_prompt`` are the host's two ways to go on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import SubagentService
from subagent.delegation import WAKE_PROMPT, BackgroundOptions, Notice, WakeTurn
from subagent.providers.fork import ForkProvider
from subagent.runtime import (
    Agent,
    AgentRegistry,
    CompletionRequest,
    FunctionTool,
    LlmError,
    LlmErrorKind,
    Message,
    Reply,
    ScriptedLlm,
    ToolCallStarted,
    call,
)
from subagent.service import RunState
from subagent.testing.pytest_plugin import StubAgentCommand
from subagent.types import SubagentResult, SubagentRunEndInfo
from tests.leaks import process_is_gone
from tests.test_background import (
    NOTHING_TO_WAIT_FOR,
    WAIT,
    HeldModel,
    Host,
    Recorder,
    acp_pid,
    held_acp,
    never_ready_acp,
    normalised,
    open_host,
    running_line,
)

pytestmark = pytest.mark.anyio

Step = Callable[[CompletionRequest], Reply | str]
"""One model call of a scripted parent: it may look at the request and act (release a child) first."""


class ParentModel:
    """A parent's model that answers its n-th request with ``steps[n]``; past the end, ``done``."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.llm = ScriptedLlm(self._respond)

    def _respond(self, request: CompletionRequest) -> Reply | str:
        index = len(self.llm.requests) - 1
        return self.steps[index](request) if index < len(self.steps) else "done"


@dataclass
class Family(Host):
    """A `Host` whose ``spawn`` and ``fork`` children run on its `HeldModel`, and a parent agent using
    its tool on `ParentModel`."""

    agents: AgentRegistry = field(default_factory=AgentRegistry)
    parent_model: ParentModel = field(default_factory=ParentModel)
    agent: Agent | None = None

    @property
    def parent(self) -> Agent:
        assert self.agent is not None
        return self.agent

    def new_agent(self, model: ParentModel) -> Agent:
        return Agent(llm=model.llm, tools=self.tool.agent_tools(), registry=self.agents)

    async def sole_notice(self) -> Notice:
        """The one notice that went out (waiting for it), which must be the parent agent's."""
        await self.notices_count(1)
        [notice] = self.notices
        assert notice.parent_id == self.parent.id
        return notice

    def wake_turns(self) -> Recorder[WakeTurn]:
        """The turns notices wake the parent for, from now on."""
        woken: Recorder[WakeTurn] = Recorder()
        self.background.on_wake(woken)
        return woken

    def handles(self) -> dict[str, str]:
        """The parent's children: task name -> handle."""
        return {
            info.prompt.removeprefix("task "): info.handle
            for info in self.background.children(self.parent.id)
        }


@asynccontextmanager
async def open_family(
    options: BackgroundOptions | None = None, *extra: Any, tools: tuple[FunctionTool, ...] = ()
) -> AsyncIterator[Family]:
    """An open `Family`, its parent agent with ``tools`` besides the tool's; once it closed, no run, task,
    process or file descriptor is left."""
    model = HeldModel()
    agents = AgentRegistry()
    fork = ForkProvider(llm=model.llm, agents=agents)
    async with open_host(options, fork, *extra, model=model, agents=agents) as host:
        family = Family(host.service, host.tool, host.model, host.starts, host.heard, host.spawn, agents)
        family.agent = Agent(
            llm=family.parent_model.llm, tools=(*host.tool.agent_tools(), *tools), registry=agents
        )
        try:
            yield family
        finally:
            await family.parent.close()


def delegate(name: str, provider: str) -> Any:
    return call("subagent", {"prompt": f"task {name}", "provider": provider, "background": True})


def noticing_tool(family_ref: list[Family]) -> FunctionTool:
    """``pause``: returns once ``count`` notices went out, so the next model call follows an idle point
    at which the notice was delivered."""

    async def pause(arguments: Any) -> str:
        await family_ref[0].notices_count(arguments["count"])
        return "paused"

    schema = {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}
    return FunctionTool("pause", "Wait for a notice.", schema, pause)


def started_then(*later: Step) -> list[Step]:
    """A parent's script: a turn that starts ``task s`` (spawn) in the background and answers
    ``started``, then ``later``."""
    return [lambda request: Reply(tool_calls=[delegate("s", "spawn")]), lambda request: "started", *later]


def releasing(family: Family, name: str, tool_call: Any) -> Step:
    """A step that releases the spawn or fork child ``task <name>`` and calls ``tool_call``."""

    def step(request: CompletionRequest) -> Reply:
        family.model.release(name)
        return Reply(tool_calls=[tool_call])

    return step


def notice_text(handle: str, provider: str, name: str, output: str) -> str:
    return (
        f"[background subagent {handle} ({provider}) completed]\nTask: task {name}\n\n{output}\n"
        f"[end of background subagent {handle}]"
    )


def tool_results(request: CompletionRequest) -> list[str]:
    return [m.content for m in request.messages if m.role == "tool"]


# -- mixed providers at once, and notices at idle points ------------------------------------------------


async def test_children_of_three_providers_run_at_once_while_the_parent_works_and_report_in_end_order(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    provider, gates = held_acp(stub_agent_command, tmp_path)
    ref: list[Family] = []
    async with open_family(None, provider, tools=(noticing_tool(ref),)) as family:
        ref.append(family)
        seen_running: list[list[str]] = []

        def listed(request: CompletionRequest) -> Reply:
            # The second model call: every child started, none ended.
            seen_running.append([info.state for info in family.background.children(family.parent.id)])
            return Reply(tool_calls=[call("subagent_list")])

        def release(name: str, count: int) -> Step:
            def step(request: CompletionRequest) -> Reply:
                if name == "a":
                    gates.release()
                else:
                    family.model.release(name)
                return Reply(tool_calls=[call("pause", {"count": count})])

            return step

        family.parent_model.steps = [
            lambda request: Reply(
                tool_calls=[delegate("s", "spawn"), delegate("f", "fork"), delegate("a", "acp")]
            ),
            listed,
            release("f", 1),
            release("a", 2),
            release("s", 3),
        ]

        with anyio.fail_after(WAIT):
            result = await family.parent.run_turn("go")
        assert (result.stop_reason, result.output) == ("completed", "done")
        handles = family.handles()
        s, f, a = handles["s"], handles["f"], handles["a"]

        # The parent took its second and third model calls with all three children running.
        assert seen_running == [["running", "running", "running"]]
        requests = family.parent_model.llm.requests
        listing = tool_results(requests[2])[-1]
        # (The three calls ran at once: the children started in any order.)
        assert sorted(normalised(listing).splitlines()) == sorted(
            f"- {handles[name]} ({provider}): running, last activity T s ago: task {name}"
            for name, provider in (("s", "spawn"), ("f", "fork"), ("a", "acp"))
        )

        # Notices in the order the children ended, each delivered at the idle point before a call.
        expected = [
            notice_text(f, "fork", "f", "answer f"),
            notice_text(a, "acp", "a", "acp answer"),
            notice_text(s, "spawn", "s", "answer s"),
        ]
        assert [n.text for n in family.notices] == expected
        for index, text in zip((3, 4, 5), expected, strict=True):
            assert requests[index].messages[-1] == Message.user(text)
            assert requests[index].messages[-2].role == "tool"
            assert Message.user(text) not in requests[index - 1].messages
        log = list(family.parent.messages)
        positions = [log.index(Message.user(text)) for text in expected]
        assert positions == sorted(positions)
        for position in positions:
            assert (log[position - 1].role, log[position + 1].role) == ("tool", "assistant")
        assert family.service.live_runs == ()


# -- one parent cannot reach another's children -----------------------------------------------------------


async def test_a_parent_agent_sees_none_of_another_parents_children() -> None:
    async with open_family() as family:
        family.parent_model.steps = [lambda request: Reply(tool_calls=[delegate("s", "spawn")])]
        with anyio.fail_after(WAIT):
            await family.parent.run_turn("go")
        mine = family.handles()["s"]
        made_up = "zzzzzz" if mine != "zzzzzz" else "yyyyyy"
        other_model = ParentModel()
        other_model.steps = [
            lambda request: Reply(
                tool_calls=[
                    call("subagent_list"),
                    call("subagent_result", {"handle": mine}),
                    call("subagent_result", {"handle": made_up}),
                    call("subagent_cancel", {"handle": mine}),
                    call("subagent_send", {"handle": mine, "message": "stop"}),
                    call("subagent_wait", {"handles": [mine], "timeout": 0}),
                ]
            )
        ]
        other = family.new_agent(other_model)
        try:
            with anyio.fail_after(WAIT):
                await other.run_turn("snoop")
        finally:
            await other.close()
        unknown = "error: no background subagent of yours has the handle {!r}"
        assert tool_results(other_model.llm.requests[1]) == [
            "You have no background subagents.",
            unknown.format(mine),
            unknown.format(made_up),
            unknown.format(mine),
            unknown.format(mine),
            unknown.format(mine),
        ]
        assert family.background.children(other.id) == []
        [info] = family.background.children(family.parent.id)
        assert (info.handle, info.state) == (mine, "running")
        family.model.release("s")
        await family.notices_count(1)
        assert family.notices[0].result.output == "answer s"  # "stop" never reached it


# -- the parent owns its children ------------------------------------------------------------------------


@asynccontextmanager
async def turn_in_flight(agent: Agent, prompt: str) -> AsyncIterator[list[SubagentResult]]:
    """Run a turn of ``agent`` beside the block; leaving the block waits for it, whose result is then
    the yielded list's one item."""
    outcome: list[SubagentResult] = []
    async with anyio.create_task_group() as task_group:

        async def turn() -> None:
            outcome.append(await agent.run_turn(prompt))

        task_group.start_soon(turn)
        yield outcome


@asynccontextmanager
async def runs_ending(service: SubagentService, count: int) -> AsyncIterator[None]:
    """Return from the block once ``count`` runs of ``service`` ended (``subagent/end``)."""
    ended: list[SubagentRunEndInfo] = []
    all_ended = anyio.Event()

    def end(info: SubagentRunEndInfo) -> None:
        ended.append(info)
        if len(ended) == count:
            all_ended.set()

    dispose = service.events.on("subagent/end", end)
    try:
        yield
        with anyio.fail_after(WAIT):
            await all_ended.wait()
    finally:
        dispose()


@asynccontextmanager
async def parent_with_two_children(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> AsyncIterator[tuple[Family, int]]:
    """An open `Family` whose parent started a spawn and an acp child in the background in a turn that
    ended; both are held. Yields it and the ACP child's process id."""
    provider, gates = held_acp(stub_agent_command, tmp_path)
    async with open_family(None, provider) as family:
        family.parent_model.steps = [
            lambda request: Reply(tool_calls=[delegate("s", "spawn"), delegate("a", "acp")]),
            lambda request: "started two",
        ]
        with anyio.fail_after(WAIT):
            assert (await family.parent.run_turn("go")).output == "started two"
            await family.model.held("s")
            await gates.asked.wait()
        yield family, acp_pid(family.service)


async def assert_all_gone(family: Family, pid: int) -> None:
    """Every run the service had is disposed (joined here: its disposal began already) and the ACP
    child's process is gone; the parent has no children left and heard no notice."""
    runs = family.service.live_runs
    assert all(run.state in (RunState.ENDED, RunState.DISPOSED) for run in runs)
    with anyio.fail_after(WAIT):
        for run in runs:
            await run.dispose()
    assert family.service.live_runs == ()
    assert process_is_gone(pid)
    assert family.background.children(family.parent.id) == []
    assert family.notices == []


async def test_closing_the_parent_agent_disposes_its_children(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    async with parent_with_two_children(stub_agent_command, tmp_path) as (family, pid):
        async with runs_ending(family.service, 2):
            await family.parent.close()
        await assert_all_gone(family, pid)


async def test_cancelling_the_parents_turn_while_it_waits_disposes_its_children(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    provider, gates = held_acp(stub_agent_command, tmp_path)
    async with open_family(None, provider) as family:
        family.parent_model.steps = [
            lambda request: Reply(tool_calls=[delegate("s", "spawn"), delegate("a", "acp")]),
            lambda request: Reply(tool_calls=[call("subagent_wait", {"mode": "all", "timeout": 600})]),
            lambda request: "after the cancel",
        ]
        waiting = anyio.Event()
        family.parent.on_event(
            lambda event: (
                waiting.set()
                if isinstance(event, ToolCallStarted) and event.invocation.tool == "subagent_wait"
                else None
            )
        )
        async with turn_in_flight(family.parent, "go") as outcome:
            with anyio.fail_after(WAIT):
                await waiting.wait()
                await family.model.held("s")
                await gates.asked.wait()
            pid = acp_pid(family.service)
            async with runs_ending(family.service, 2):
                family.parent.cancel()
        assert outcome[0].stop_reason == "cancelled"
        await assert_all_gone(family, pid)
        # The agent stays usable, background delegation included.
        family.parent_model.steps.append(lambda request: Reply(tool_calls=[delegate("t", "spawn")]))
        family.parent_model.steps.append(lambda request: "started again")
        family.model.release("t")
        with anyio.fail_after(WAIT):
            assert (await family.parent.run_turn("again")).output == "after the cancel"
            assert (await family.parent.run_turn("once more")).output == "started again"
        notice = await family.sole_notice()
        assert (notice.child.prompt, notice.child.state) == ("task t", "completed")
        assert family.parent.messages[-1] == Message.user(notice.text)


# -- after the turn: wake, or the host's next turn -------------------------------------------------------


async def test_with_wake_a_notice_that_finds_the_parent_idle_starts_a_turn_of_it() -> None:
    async with open_family(BackgroundOptions(wake=True)) as family:
        family.parent_model.steps = started_then(lambda request: "read the notice")
        woken = family.wake_turns()
        with anyio.fail_after(WAIT):
            assert (await family.parent.run_turn("go")).output == "started"
        handle = family.handles()["s"]
        family.model.release("s")
        with anyio.fail_after(WAIT):
            await woken.count(1)
        text = notice_text(handle, "spawn", "s", "answer s")
        [turn] = woken.items
        assert (turn.parent_id, turn.prompt, turn.result.output) == (
            family.parent.id,
            text,
            "read the notice",
        )
        assert turn.result.stop_reason == "completed"
        requests = family.parent_model.llm.requests
        assert len(requests) == 3
        assert requests[2].messages[-1] == Message.user(text)
        assert [m for m in family.parent.messages if m.role == "user"] == [
            Message.user("go"),
            Message.user(text),
        ]
        assert await family.background.next_turn_prompt(family.parent.id, timeout=0) is None


async def test_without_wake_the_notice_waits_in_the_log_and_next_turn_prompt_says_so() -> None:
    async with open_family(BackgroundOptions(wake=False)) as family:
        family.parent_model.steps = started_then(lambda request: "read the notice")
        with anyio.fail_after(WAIT):
            assert (await family.parent.run_turn("go")).output == "started"
        handle = family.handles()["s"]
        next_prompt: list[str | None] = []
        async with anyio.create_task_group() as task_group:

            async def host() -> None:  # waits for the notice while the child runs
                next_prompt.append(await family.background.next_turn_prompt(family.parent.id, timeout=WAIT))

            task_group.start_soon(host)
            family.model.release("s")
        text = notice_text(handle, "spawn", "s", "answer s")
        assert next_prompt == [WAKE_PROMPT]
        assert family.parent.messages[-1] == Message.user(text)  # in the idle agent's log at once
        assert not family.parent.busy
        assert len(family.parent_model.llm.requests) == 2  # no turn started by itself
        assert await family.background.next_turn_prompt(family.parent.id) is None  # seen, none live
        with anyio.fail_after(WAIT):
            assert (await family.parent.run_turn(WAKE_PROMPT)).output == "read the notice"
        assert family.parent_model.llm.requests[2].messages[-2:] == (
            Message.user(text),
            Message.user(WAKE_PROMPT),
        )


async def test_for_a_host_parent_next_turn_prompt_is_the_notices_it_has_not_seen() -> None:
    async with open_family() as family:
        handles = []
        for name in ("a", "b"):
            result = await family.tool.execute(
                {"prompt": f"task {name}", "provider": "spawn", "background": True}
            )
            assert result.handle is not None
            handles.append(result.handle)
        family.model.release("b")
        await family.notices_count(1)
        family.model.release("a")
        await family.notices_count(2)
        with anyio.fail_after(WAIT):
            prompt = await family.background.next_turn_prompt("host")
        assert prompt == (
            f"{notice_text(handles[1], 'spawn', 'b', 'answer b')}\n\n"
            f"{notice_text(handles[0], 'spawn', 'a', 'answer a')}"
        )
        assert await family.background.next_turn_prompt("host") is None


async def test_a_result_the_parent_collected_by_waiting_is_not_also_delivered_as_a_notice() -> None:
    async with open_family() as family:
        family.parent_model.steps = [
            lambda request: Reply(tool_calls=[delegate("s", "spawn")]),
            releasing(family, "s", call("subagent_wait", {"timeout": WAIT})),
            lambda request: "done",
        ]
        with anyio.fail_after(WAIT):
            assert (await family.parent.run_turn("go")).output == "done"
        handle = family.handles()["s"]
        text = notice_text(handle, "spawn", "s", "answer s")
        requests = family.parent_model.llm.requests
        assert tool_results(requests[2])[-1] == text
        assert [m for m in requests[2].messages if m.role == "user"] == [Message.user("go")]
        assert [m.content for m in family.parent.messages].count(text) == 1
        assert [n.text for n in family.notices] == [text]  # the host's listener still hears it
        assert await family.background.next_turn_prompt(family.parent.id, timeout=0) is None


async def test_closing_the_tool_after_the_parent_agent_returns_once_its_children_are_gone(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    async with parent_with_two_children(stub_agent_command, tmp_path) as (family, pid):
        await family.parent.close()
        with anyio.fail_after(WAIT):
            await family.tool.aclose()
        assert family.service.live_runs == ()
        assert process_is_gone(pid)


async def test_with_wake_a_notice_the_parent_read_in_its_turn_wakes_no_further_turn() -> None:
    ref: list[Family] = []
    async with open_family(BackgroundOptions(wake=True), tools=(noticing_tool(ref),)) as family:
        ref.append(family)
        family.parent_model.steps = [
            lambda request: Reply(tool_calls=[delegate("s", "spawn")]),
            releasing(family, "s", call("pause", {"count": 1})),
            lambda request: "read it",
        ]
        woken = family.wake_turns()
        with anyio.fail_after(WAIT):
            assert (await family.parent.run_turn("go")).output == "read it"
        handle = family.handles()["s"]
        text = notice_text(handle, "spawn", "s", "answer s")
        assert family.parent_model.llm.requests[2].messages[-1] == Message.user(text)
        assert await family.background.next_turn_prompt(family.parent.id, timeout=0) is None
        assert (woken.items, len(family.parent_model.llm.requests), family.parent.busy) == ([], 3, False)


def answering_after_notices(family: Family, count: int, reply: Reply) -> Step:
    """A step that releases ``task s`` and answers ``reply`` only once ``count`` notices went out: the
    notice comes while the model call is in flight."""

    async def notices_out() -> None:
        await family.notices_count(count)

    def step(request: CompletionRequest) -> Reply:
        family.model.release("s")
        return Reply(reply.text, error=reply.error, wait=notices_out)

    return step


async def test_a_notice_that_arrives_during_the_parents_last_model_call_is_answered_in_that_turn() -> None:
    async with open_family(BackgroundOptions(wake=True)) as family:
        family.parent_model.steps = [
            lambda request: Reply(tool_calls=[delegate("s", "spawn")]),
            answering_after_notices(family, 1, Reply("first answer")),
            lambda request: "second answer",
        ]
        woken = family.wake_turns()
        with anyio.fail_after(WAIT):
            assert (await family.parent.run_turn("go")).output == "second answer"
        text = notice_text(family.handles()["s"], "spawn", "s", "answer s")
        requests = family.parent_model.llm.requests
        assert requests[2].messages[-2:] == (Message.assistant("first answer"), Message.user(text))
        assert await family.background.next_turn_prompt(family.parent.id, timeout=0) is None
        assert (woken.items, len(requests)) == ([], 3)


async def test_with_wake_a_notice_delivered_as_a_failed_turn_ends_wakes_the_parent_with_wake_prompt() -> None:
    async with open_family(BackgroundOptions(wake=True)) as family:
        failure = LlmError(LlmErrorKind.SERVER, "the model server failed")
        family.parent_model.steps = [
            lambda request: Reply(tool_calls=[delegate("s", "spawn")]),
            answering_after_notices(family, 1, Reply(error=failure)),
            lambda request: "woken",
        ]
        woken = family.wake_turns()
        with anyio.fail_after(WAIT):
            assert (await family.parent.run_turn("go")).stop_reason == "error"
            await woken.count(1)
        text = notice_text(family.handles()["s"], "spawn", "s", "answer s")
        [turn] = woken.items
        assert (turn.prompt, turn.result.output) == (WAKE_PROMPT, "woken")
        requests = family.parent_model.llm.requests
        assert requests[2].messages[-2:] == (Message.user(text), Message.user(WAKE_PROMPT))
        assert [m.content for m in family.parent.messages].count(text) == 1


async def test_cancelling_the_parents_turn_while_a_background_child_starts_leaves_nothing(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    provider, initializing = never_ready_acp(stub_agent_command, tmp_path)
    async with open_family(None, provider) as family:
        family.parent_model.steps = [lambda request: Reply(tool_calls=[delegate("a", "acp")])]
        async with turn_in_flight(family.parent, "go") as outcome:
            with anyio.fail_after(WAIT):
                await initializing.wait()
            pid = acp_pid(family.service)
            [starting] = family.service.live_runs
            family.parent.cancel()
        assert outcome[0].stop_reason == "cancelled"
        with anyio.fail_after(WAIT):
            await starting.dispose()  # joins the disposal the cancel began
        assert family.service.live_runs == ()
        assert process_is_gone(pid)
        assert family.background.children(family.parent.id) == []
        assert family.notices == []


async def test_a_notice_the_parent_read_in_its_log_is_not_handed_out_again_by_a_wait() -> None:
    ref: list[Family] = []
    async with open_family(None, tools=(noticing_tool(ref),)) as family:
        ref.append(family)
        family.parent_model.steps = [
            lambda request: Reply(tool_calls=[delegate("s", "spawn")]),
            releasing(family, "s", call("pause", {"count": 1})),
            lambda request: Reply(tool_calls=[call("subagent_wait", {"timeout": 0})]),
            lambda request: "done",
        ]
        with anyio.fail_after(WAIT):
            assert (await family.parent.run_turn("go")).output == "done"
        requests = family.parent_model.llm.requests
        text = notice_text(family.handles()["s"], "spawn", "s", "answer s")
        assert requests[2].messages[-1] == Message.user(text)
        assert tool_results(requests[3])[-1] == NOTHING_TO_WAIT_FOR


async def test_a_notice_that_woke_the_parent_is_not_handed_out_again_by_a_wait() -> None:
    async with open_family(BackgroundOptions(wake=True)) as family:
        family.parent_model.steps = started_then(
            lambda request: Reply(tool_calls=[call("subagent_wait", {"timeout": 0})]),
            lambda request: "woken",
        )
        woken = family.wake_turns()
        with anyio.fail_after(WAIT):
            assert (await family.parent.run_turn("go")).output == "started"
        text = notice_text(family.handles()["s"], "spawn", "s", "answer s")
        family.model.release("s")
        await woken.count(1)
        assert woken.items[0].prompt == text
        assert tool_results(family.parent_model.llm.requests[3])[-1] == NOTHING_TO_WAIT_FOR


async def test_closing_one_parent_agent_leaves_another_parents_children_running() -> None:
    async with open_family() as family:
        family.parent_model.steps = [lambda request: Reply(tool_calls=[delegate("s", "spawn")])]
        other_model = ParentModel()
        other_model.steps = [lambda request: Reply(tool_calls=[delegate("o", "spawn")])]
        other = family.new_agent(other_model)
        with anyio.fail_after(WAIT):
            await family.parent.run_turn("go")
            await other.run_turn("go too")
            await family.model.held("s", "o")
        mine, theirs = sorted(family.service.live_runs, key=lambda run: run.request.prompt != "task s")
        async with runs_ending(family.service, 1):
            await other.close()
        with anyio.fail_after(WAIT):
            await theirs.dispose()  # joins the disposal the close began
        assert family.background.children(other.id) == []
        assert family.service.live_runs == (mine,)
        assert mine.request.prompt == "task s"
        family.model.release("s")
        await family.notices_count(1)
        assert (family.notices[0].parent_id, family.notices[0].child.prompt) == (family.parent.id, "task s")
        assert family.parent.messages[-1] == Message.user(family.notices[0].text)


async def test_a_background_childs_own_background_children_die_when_it_ends() -> None:
    async with open_family() as family:
        family.parent_model.steps = started_then()
        family.model.answers["s"] = Reply(tool_calls=[delegate("g", "spawn")])  # s delegates g, then answers
        with anyio.fail_after(WAIT):
            await family.parent.run_turn("go")
        async with runs_ending(family.service, 2):
            family.model.release("s")  # g stays held: only its parent's end can stop it
            await family.model.held("g")
            [grandchild] = [run for run in family.service.live_runs if run.request.prompt == "task g"]
        with anyio.fail_after(WAIT):
            await grandchild.dispose()  # joins the disposal s's end began
        assert family.service.live_runs == ()
        notice = await family.sole_notice()
        assert (notice.child.prompt, notice.result.output) == ("task s", "after the tool")
        assert grandchild.request.parent_id == notice.child.run_id


async def test_a_wake_turn_whose_model_adapter_raises_leaves_the_service_and_other_children_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def adapter_bug(request: CompletionRequest) -> Reply:
        raise RuntimeError("adapter bug")

    async with open_family(BackgroundOptions(wake=True)) as family:
        family.parent_model.steps = started_then(adapter_bug)
        with anyio.fail_after(WAIT):
            await family.parent.run_turn("go")
        other = await family.tool.execute({"prompt": "task o", "provider": "spawn", "background": True})
        family.model.release("s")  # its notice wakes the parent, whose model raises
        await family.notices_count(1)
        family.model.release("o")
        await family.notices_count(2)
        assert [(n.child.handle, n.child.state) for n in family.notices] == [
            (family.handles()["s"], "completed"),
            (other.handle, "completed"),
        ]
    assert "adapter bug" in caplog.text


async def test_a_parent_waiting_on_its_children_is_not_silent_to_its_own_idle_timeout() -> None:
    async with open_family() as family:
        family.parent_model.steps = [
            lambda request: Reply(tool_calls=[delegate("s", "spawn")]),
            lambda request: Reply(tool_calls=[call("subagent_wait", {"timeout": 2})]),
            lambda request: "waited",
        ]
        with anyio.fail_after(WAIT):
            result = await family.parent.run_turn("go", idle_timeout=1)  # half the wait
        assert (result.stop_reason, result.output) == ("completed", "waited")
        waited = tool_results(family.parent_model.llm.requests[2])[-1]
        handle = family.handles()["s"]
        assert (
            normalised(waited) == f"The wait timed out. Still running or queued:\n{running_line(handle, 's')}"
        )


@pytest.mark.parametrize("action", ["result", "cancel"])
async def test_a_result_the_parent_read_while_its_notice_waited_is_not_also_delivered(action: str) -> None:
    ref: list[Family] = []

    async def read_after_notice(arguments: Any) -> str:
        family = ref[0]
        await family.notices_count(1)  # the notice waits in the busy parent's queue now
        handle = family.handles()["s"]
        read = await family.tool.execute_companion(action, {"handle": handle}, parent_id=family.parent.id)
        return read.render()

    reader = FunctionTool("read", "Read s's result.", {"type": "object", "properties": {}}, read_after_notice)
    async with open_family(None, tools=(reader,)) as family:
        ref.append(family)
        family.parent_model.steps = [
            lambda request: Reply(tool_calls=[delegate("s", "spawn")]),
            releasing(family, "s", call("read")),
            lambda request: "done",
        ]
        with anyio.fail_after(WAIT):
            assert (await family.parent.run_turn("go")).output == "done"
        text = notice_text(family.handles()["s"], "spawn", "s", "answer s")
        requests = family.parent_model.llm.requests
        assert tool_results(requests[2])[-1] == text
        assert [m.content for m in family.parent.messages].count(text) == 1
