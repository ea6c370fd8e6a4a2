"""The in-process providers (``spawn`` and ``fork``) through the service and through agents that
delegate with the ``subagent`` tool, on asyncio and trio.

Every child here is a real :class:`~subagent.runtime.Agent` driven by a :class:`ScriptedLlm`, so the
tests assert exactly what each model was asked (``ScriptedLlm.requests``). A model is held mid-turn
with ``Reply(wait=...)`` and an event the test sets; no test sleeps to wait for something.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup

from subagent import (
    ErrorCode,
    Lineage,
    ObservableRun,
    ResumableRun,
    ServiceRun,
    SteerableRun,
    SubagentError,
    SubagentProgressInfo,
    SubagentRequest,
    SubagentResult,
    SubagentRunEndInfo,
    SubagentRunInfo,
    SubagentService,
    ToolFilter,
)
from subagent.providers._inprocess import DISPOSED_REASON, InProcessProvider, InProcessRun
from subagent.providers.fork import ForkProvider
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import (
    Agent,
    AgentEvent,
    AgentRegistry,
    CompletionRequest,
    FunctionTool,
    LlmService,
    Message,
    MessageDelivered,
    MessageRefused,
    MessageRefusedError,
    Reply,
    ScriptedLlm,
    Tool,
    ToolCallFinished,
    ToolInvocation,
    When,
    call,
)
from subagent.tool import SubagentTool
from subagent.types import thaw_json
from tests.fakes import FakeProvider

pytestmark = pytest.mark.anyio

WAIT = 5  # seconds; a bound on every wait, never a sleep
BEAT = 0.02  # seconds between progress heartbeats where a test watches them

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"files": {"type": "integer"}},
    "required": ["files"],
    "additionalProperties": False,
}


# -- helpers ------------------------------------------------------------------------------------------


def running_task_ids() -> set[int]:
    return {task.id for task in anyio.get_running_tasks()}


def tasks_of(run_id: str) -> list[str]:
    """The names of running tasks that belong to the run (its first turn, its observer)."""
    return [str(task.name) for task in anyio.get_running_tasks() if str(task.name).endswith(f" {run_id}")]


@contextmanager
def bounded() -> Iterator[None]:
    with anyio.fail_after(WAIT):
        yield


@asynccontextmanager
async def open_service(
    *providers: InProcessProvider | FakeProvider,
    service: SubagentService | None = None,
    progress_interval: float | None = None,
) -> AsyncIterator[SubagentService]:
    """An open service with `providers` registered; on exit, asserts no task was left running."""
    before = running_task_ids()
    opened = service if service is not None else SubagentService(progress_interval=progress_interval)
    async with opened:
        for provider in providers:
            opened.register_provider(provider)
        yield opened
    assert running_task_ids() == before


class Hold:
    """A `Reply.wait` that records that the model was reached, then waits for the test's go."""

    def __init__(self) -> None:
        self.reached = anyio.Event()
        self.release = anyio.Event()

    async def __call__(self) -> None:
        self.reached.set()
        await self.release.wait()


class CountingSpawn(SpawnProvider):
    """A spawn provider that counts calls of its `start`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start_calls = 0

    def start(self, request: SubagentRequest, task_group: TaskGroup) -> InProcessRun:
        self.start_calls += 1
        return super().start(request, task_group)


def make_tool(name: str, output: str | None = None, ran: list[str] | None = None) -> FunctionTool:
    def function(arguments: Any) -> str:
        if ran is not None:
            ran.append(name)
        return output if output is not None else f"{name} ran"

    return FunctionTool(name, f"The {name} tool.", NO_ARGUMENTS, function)


def tool_names(request: CompletionRequest) -> list[str]:
    return [spec.name for spec in request.tools]


def last_user(request: CompletionRequest) -> str:
    return next((m.content for m in reversed(request.messages) if m.role == "user"), "")


def child_agent(agents: AgentRegistry, run: ServiceRun) -> Agent:
    agent = agents.get(run.id)
    assert agent is not None, f"{run.id} is not a live agent"
    return agent


def provider_run(run: ServiceRun) -> InProcessRun:
    inner = run.provider_run
    assert isinstance(inner, InProcessRun)
    return inner


def record_starts(
    service: SubagentService, agents: AgentRegistry
) -> list[tuple[SubagentRunInfo, Agent | None, Lineage | None]]:
    """Each `subagent/start`, with the child agent the listener resolved and the lineage it got."""
    seen: list[tuple[SubagentRunInfo, Agent | None, Lineage | None]] = []

    def on_start(info: SubagentRunInfo) -> None:
        runs = {run.id: run for run in service.live_runs}
        seen.append((info, agents.get(info.id), runs[info.id].request.lineage))

    service.events.on("subagent/start", on_start)
    return seen


def record_ends(service: SubagentService) -> list[SubagentRunEndInfo]:
    ends: list[SubagentRunEndInfo] = []
    service.events.on("subagent/end", ends.append)
    return ends


def delegate(prompt: str, provider: str = "spawn", **features: Any) -> Reply:
    """A model answer that calls the subagent tool."""
    return Reply(tool_calls=[call("subagent", {"provider": provider, "prompt": prompt, **features})])


# -- fork: the parent's completed turns, never the turn in flight ----------------------------------------


async def test_a_fork_made_mid_turn_sees_exactly_the_parents_completed_turns_not_the_turn_in_flight() -> None:
    agents = AgentRegistry()
    read_call = call("read", {}, id="call-read")
    fork_call = call("subagent", {"provider": "fork", "prompt": "Summarise what we found."}, id="call-fork")
    parent_llm = ScriptedLlm(
        [
            Reply(tool_calls=[read_call]),
            Reply("Two files: a.txt and b.txt."),
            Reply("Let me hand this to a fork.", tool_calls=[fork_call]),
            Reply("The fork summarised it."),
        ]
    )
    fork_llm = ScriptedLlm(["Summary: two text files."])
    async with open_service(ForkProvider(agents=agents, llm=fork_llm)) as service:
        parent = Agent(
            llm=parent_llm,
            id="lead",
            persona="You are the lead.",
            tools=[make_tool("read", "a.txt b.txt"), SubagentTool(service).for_agents()],
            registry=agents,
        )
        with bounded():
            first = await parent.run_turn("What files are there?")
            second = await parent.run_turn("Now summarise them with a fork.")

    assert (first.output, second.output) == ("Two files: a.txt and b.txt.", "The fork summarised it.")
    (fork_request,) = fork_llm.requests
    assert fork_request.messages == (
        Message.system("You are the lead."),
        Message.user("What files are there?"),
        Message.assistant("", [read_call]),
        Message.tool_result(read_call, "a.txt b.txt"),
        Message.assistant("Two files: a.txt and b.txt."),
        Message.user("Summarise what we found."),
    )
    # The turn in flight (its prompt and the message that called the fork) stays the parent's own.
    assert Message.user("Now summarise them with a fork.") not in fork_request.messages
    assert all(fork_call not in message.tool_calls for message in fork_request.messages)
    assert tool_names(fork_request) == ["read", "subagent"]
    # The parent's turn went on with the fork's answer as the tool result.
    assert parent.messages[-2:] == (
        Message.tool_result(fork_call, "Summary: two text files."),
        Message.assistant("The fork summarised it."),
    )


@pytest.mark.parametrize(
    ("provider_persona", "persona", "expected_system"),
    [
        pytest.param(None, None, "You are the lead.", id="no-persona-keeps-the-parents"),
        pytest.param(None, "You review code.", "You review code.", id="persona-replaces-the-parents"),
        pytest.param("You fork.", None, "You fork.", id="provider-default-replaces-the-parents"),
        pytest.param("You fork.", "You review code.", "You review code.", id="request-over-provider-default"),
    ],
)
async def test_a_forks_system_message_is_its_requested_persona_or_else_the_parents(
    provider_persona: str | None, persona: str | None, expected_system: str
) -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm(["earlier answer", "fork answer"])  # the fork uses its parent's model
    parent = Agent(llm=llm, id="lead", persona="You are the lead.", registry=agents)
    async with open_service(ForkProvider(agents=agents, persona=provider_persona)) as service:
        with bounded():
            await parent.run_turn("earlier question")
            async with service.start(
                "fork", SubagentRequest(prompt="fork task", parent_id="lead", persona=persona)
            ) as run:
                assert child_agent(agents, run).persona == expected_system
                result = await run.result()

    assert result.output == "fork answer"
    assert llm.requests[1].messages == (
        Message.system(expected_system),
        Message.user("earlier question"),
        Message.assistant("earlier answer"),
        Message.user("fork task"),
    )


@pytest.mark.parametrize(
    ("provider_persona", "request_persona", "expected"),
    [
        pytest.param(
            "You are a helper.", "You are terse.", (Message.system("You are terse."),), id="request"
        ),
        pytest.param(
            "You are a helper.", None, (Message.system("You are a helper."),), id="provider-default"
        ),
        pytest.param(None, None, (), id="none"),
    ],
)
async def test_a_spawned_childs_system_message_is_its_requested_persona_and_it_sees_no_parent_context(
    provider_persona: str | None, request_persona: str | None, expected: tuple[Message, ...]
) -> None:
    agents = AgentRegistry()
    parent_llm = ScriptedLlm(["the parent's earlier answer"])
    parent = Agent(llm=parent_llm, id="lead", persona="You are the lead.", registry=agents)
    child_llm = ScriptedLlm(["child answer"])
    provider = SpawnProvider(llm=child_llm, agents=agents, persona=provider_persona)
    async with open_service(provider) as service:
        with bounded():
            await parent.run_turn("earlier question")
            async with service.start(
                "spawn", SubagentRequest(prompt="child task", parent_id="lead", persona=request_persona)
            ) as run:
                result = await run.result()

    assert result.output == "child answer"
    assert child_llm.requests[0].messages == (*expected, Message.user("child task"))


async def test_a_fork_without_a_live_in_process_parent_fails_to_start_and_says_why() -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm(fallback="never asked")
    gone = Agent(llm=llm, id="gone", registry=agents)
    await gone.close()
    provider = ForkProvider(agents=agents, llm=llm)
    async with open_service(provider) as service:
        starts = record_starts(service, agents)
        for parent_id in (None, "ghost", "gone"):
            with pytest.raises(SubagentError) as caught:
                service.start("fork", SubagentRequest(prompt="p", parent_id=parent_id))
            assert caught.value.code == ErrorCode.START_FAILED
            assert caught.value.provider == "fork"
            assert "a fork needs a live in-process parent agent" in caught.value.message
            assert repr(parent_id) in caught.value.message
        assert service.live_runs == ()
        assert len(agents) == 0
        assert starts == []
    assert llm.requests == []


async def test_a_spawn_without_a_model_fails_to_start_unless_its_parent_is_a_live_agent() -> None:
    agents = AgentRegistry()
    parent_llm = ScriptedLlm(["the child borrowed my model"])
    parent = Agent(llm=parent_llm, id="lead", registry=agents)
    provider = SpawnProvider(agents=agents)  # no llm of its own
    async with open_service(provider) as service:
        for parent_id in (None, "not-an-agent"):
            with pytest.raises(SubagentError) as caught:
                service.start("spawn", SubagentRequest(prompt="p", parent_id=parent_id))
            assert caught.value.code == ErrorCode.START_FAILED
            assert "no LLM adapter" in caught.value.message
        assert agents.list() == ["lead"]
        assert service.live_runs == ()

        with bounded():
            async with service.start("spawn", SubagentRequest(prompt="p", parent_id=parent.id)) as run:
                result = await run.result()
    assert result.output == "the child borrowed my model"


async def test_a_spawn_looks_its_model_up_by_name_at_each_start_and_an_unknown_name_fails_the_start() -> None:
    llms = LlmService()
    provider = SpawnProvider(llm="small", llm_service=llms)
    async with open_service(provider) as service:
        with pytest.raises(SubagentError) as caught:
            service.start("spawn", SubagentRequest(prompt="p"))
        assert caught.value.code == ErrorCode.START_FAILED
        assert "no LLM adapter named 'small'" in caught.value.message
        assert service.live_runs == ()

        unregister = llms.register_adapter("small", ScriptedLlm(["from the named model"]))
        with bounded():
            async with service.start("spawn", SubagentRequest(prompt="p")) as run:
                result = await run.result()
        unregister()
    assert result.output == "from the named model"
    with pytest.raises(ValueError, match="llm_service"):
        SpawnProvider(llm="small")


# -- depth limit ----------------------------------------------------------------------------------------


async def test_depth_limit_one_allows_a_grandchild_and_refuses_a_great_grandchild_before_it_exists() -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm(fallback="done")
    provider = CountingSpawn(llm=llm, agents=agents)
    async with open_service(provider) as service:
        starts = record_starts(service, agents)
        with bounded():
            child = service.start("spawn", SubagentRequest(prompt="c", parent_id="root", depth_limit=1))
            await child.result()
            grandchild = service.start("spawn", SubagentRequest(prompt="g", parent_id=child.id))
            await grandchild.result()
        assert [info.id for info, _, _ in starts] == [child.id, grandchild.id]
        live_agents, requests = agents.list(), len(llm.requests)

        with pytest.raises(SubagentError) as caught:
            service.start("spawn", SubagentRequest(prompt="gg", parent_id=grandchild.id))

        assert caught.value.code == ErrorCode.UNSUPPORTED_CAPABILITY
        assert caught.value.feature == "depth_limit"
        assert provider.start_calls == 2
        assert agents.list() == live_agents == [child.id, grandchild.id]
        assert len(llm.requests) == requests
        assert [info.id for info, _, _ in starts] == [child.id, grandchild.id]
        assert service.live_runs == (child, grandchild)
        # Each child agent's depth is its lineage's.
        assert [(agent.depth if agent else None, lineage) for _, agent, lineage in starts] == [
            (1, Lineage(depth=1, ancestors=("root",), depth_budget=1)),
            (2, Lineage(depth=2, ancestors=(child.id, "root"), depth_budget=0)),
        ]
        assert child_agent(agents, grandchild).parent_id == child.id


async def test_depth_limit_zero_refuses_the_childs_own_delegation_and_its_model_reads_the_code() -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm(
        [
            delegate("beta task"),
            Reply("I may not delegate.", when=When(after_tool_result=True)),
        ]
    )
    service = SubagentService(progress_interval=None)
    provider = CountingSpawn(llm=llm, agents=agents, tools=[SubagentTool(service).for_agents()])
    async with open_service(provider, service=service):
        starts = record_starts(service, agents)
        finished: list[ToolCallFinished] = []
        with bounded():
            async with service.start(
                "spawn", SubagentRequest(prompt="alpha task", parent_id="root", depth_limit=0)
            ) as run:
                child_agent(agents, run).on_event(
                    lambda event: finished.append(event) if isinstance(event, ToolCallFinished) else None
                )
                result = await run.result()

                with pytest.raises(SubagentError) as caught:
                    service.start("spawn", SubagentRequest(prompt="direct", parent_id=run.id))

    assert caught.value.code == ErrorCode.UNSUPPORTED_CAPABILITY
    assert caught.value.feature == "depth_limit"
    assert result.output == "I may not delegate."
    assert provider.start_calls == 1
    assert [info.prompt for info, _, _ in starts] == ["alpha task"]
    (refusal,) = finished
    assert refusal.output.startswith(
        "error: the subagent could not be started (UNSUPPORTED_CAPABILITY): depth limit reached"
    )
    assert llm.requests[1].messages[-1] == Message.tool_result(refusal.call, refusal.output)
    assert all(last_user(request) != "beta task" for request in llm.requests)


async def test_agents_delegating_in_a_chain_stop_at_the_depth_limit_and_the_deepest_model_reads_why() -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm(
        [
            Reply(
                tool_calls=[
                    call("subagent", {"provider": "spawn", "prompt": "beta task", "depth_limit": 1}),
                ],
                when=When(last_user_contains="alpha", after_tool_result=False),
            ),
            Reply(
                tool_calls=[call("subagent", {"provider": "spawn", "prompt": "gamma task"})],
                when=When(last_user_contains="beta", after_tool_result=False),
            ),
            Reply(
                tool_calls=[call("subagent", {"provider": "spawn", "prompt": "delta task"})],
                when=When(last_user_contains="gamma", after_tool_result=False),
            ),
            Reply("gamma was refused", when=When(last_user_contains="gamma", after_tool_result=True)),
            Reply("beta done", when=When(last_user_contains="beta", after_tool_result=True)),
            Reply("alpha done", when=When(last_user_contains="alpha", after_tool_result=True)),
        ]
    )
    async with open_service(CountingSpawn(agents=agents)) as service:  # children use their parent's model
        starts = record_starts(service, agents)
        root = Agent(llm=llm, id="root", tools=[SubagentTool(service).for_agents()], registry=agents)
        with bounded():
            result = await root.run_turn("alpha task")

    assert result.output == "alpha done"
    assert [(info.prompt, info.parent_id) for info, _, _ in starts] == [
        ("beta task", "root"),
        ("gamma task", starts[0][0].id),
    ]
    assert [agent.depth if agent else None for _, agent, _ in starts] == [1, 2]
    gamma_requests = [request for request in llm.requests if last_user(request) == "gamma task"]
    assert len(gamma_requests) == 2
    refusal = gamma_requests[1].messages[-1]
    assert refusal.role == "tool"
    assert refusal.content.startswith("error: the subagent could not be started (UNSUPPORTED_CAPABILITY):")
    assert "depth limit" in refusal.content
    assert all(last_user(request) != "delta task" for request in llm.requests)
    assert agents.list() == ["root"]


async def test_a_refused_delegation_is_an_error_tool_call_for_the_agents_listeners() -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm([delegate("beta task"), Reply("ok", when=When(after_tool_result=True))])
    service = SubagentService(progress_interval=None)
    provider = SpawnProvider(llm=llm, agents=agents, tools=[SubagentTool(service).for_agents()])
    async with open_service(provider, service=service):
        finished: list[ToolCallFinished] = []
        with bounded():
            async with service.start(
                "spawn", SubagentRequest(prompt="alpha task", parent_id="root", depth_limit=0)
            ) as run:
                child_agent(agents, run).on_event(
                    lambda event: finished.append(event) if isinstance(event, ToolCallFinished) else None
                )
                await run.result()

    (refusal,) = finished
    assert "UNSUPPORTED_CAPABILITY" in refusal.output
    assert refusal.is_error is True


# -- tool filter ----------------------------------------------------------------------------------------


async def test_a_tool_denied_to_a_parent_is_absent_from_every_descendant_whatever_their_filter() -> None:
    agents = AgentRegistry()
    ran: list[str] = []
    llm = ScriptedLlm(
        [
            Reply(
                tool_calls=[
                    call(
                        "subagent",
                        {
                            "provider": "spawn",
                            "prompt": "beta task",
                            "tool_filter": {"allow": ["shell", "read"]},
                        },
                    )
                ],
                when=When(last_user_contains="alpha", after_tool_result=False),
            ),
            # The grandchild's model tries the shell anyway.
            Reply(
                tool_calls=[call("shell", {})], when=When(last_user_contains="beta", after_tool_result=False)
            ),
            Reply(
                "beta could not use the shell", when=When(last_user_contains="beta", after_tool_result=True)
            ),
            Reply("alpha done", when=When(last_user_contains="alpha", after_tool_result=True)),
        ]
    )
    service = SubagentService(progress_interval=None)
    root_tools: list[Tool] = [make_tool("shell", ran=ran), make_tool("read", ran=ran)]
    root_tools.append(SubagentTool(service).for_agents())
    provider = SpawnProvider(llm=llm, agents=agents, tools=root_tools)
    async with open_service(provider, service=service):
        starts = record_starts(service, agents)
        with bounded():
            async with service.start(
                "spawn",
                SubagentRequest(
                    prompt="alpha task", parent_id="root", tool_filter=ToolFilter(deny={"shell"})
                ),
            ) as run:
                result = await run.result()

    assert result.output == "alpha done"
    (_, child, _), (_, grandchild, grandchild_lineage) = starts
    assert child is not None
    assert grandchild is not None
    assert [tool.spec.name for tool in child.tools] == ["read", "subagent"]
    assert [tool.spec.name for tool in grandchild.tools] == ["read"]
    assert grandchild_lineage == Lineage(
        depth=2, ancestors=(child.id, "root"), tool_filter=ToolFilter(allow={"shell", "read"}, deny={"shell"})
    )
    beta_requests = [request for request in llm.requests if last_user(request) == "beta task"]
    assert [tool_names(request) for request in beta_requests] == [["read"], ["read"]]
    assert all("shell" not in tool_names(request) for request in llm.requests)
    assert beta_requests[1].messages[-1].content.startswith("error: there is no tool named 'shell'")
    assert ran == []


@pytest.mark.parametrize(
    "grandchild_filter",
    [
        pytest.param(None, id="no-filter"),
        pytest.param(ToolFilter(deny={"grep"}), id="deny-only"),
        pytest.param(ToolFilter(allow={"read", "shell", "grep"}), id="allow-more"),
    ],
)
async def test_a_grandchilds_filter_never_widens_what_its_parent_was_allowed(
    grandchild_filter: ToolFilter | None,
) -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm(fallback="done")
    tools = [make_tool("read"), make_tool("shell"), make_tool("grep")]
    async with open_service(SpawnProvider(llm=llm, agents=agents, tools=tools)) as service:
        with bounded():
            child = service.start(
                "spawn", SubagentRequest(prompt="c", parent_id="root", tool_filter=ToolFilter(allow={"read"}))
            )
            grandchild = service.start(
                "spawn", SubagentRequest(prompt="g", parent_id=child.id, tool_filter=grandchild_filter)
            )
            await grandchild.result()

        assert [tool.spec.name for tool in child_agent(agents, child).tools] == ["read"]
        assert [tool.spec.name for tool in child_agent(agents, grandchild).tools] == ["read"]
        assert tool_names(llm.requests[-1]) == ["read"]


async def test_a_provider_without_tool_filtering_is_refused_below_a_filtered_in_process_parent() -> None:
    agents = AgentRegistry()
    acp = FakeProvider(name="acp")  # ACP-like: no start-time feature at all
    spawn = SpawnProvider(llm=ScriptedLlm(fallback="done"), agents=agents, tools=[make_tool("shell")])
    async with open_service(spawn, acp) as service:
        filtered = service.start(
            "spawn", SubagentRequest(prompt="p", parent_id="root", tool_filter=ToolFilter(deny={"shell"}))
        )
        unfiltered = service.start("spawn", SubagentRequest(prompt="p", parent_id="root"))

        with pytest.raises(SubagentError) as caught:
            service.start("acp", SubagentRequest(prompt="c", parent_id=filtered.id))

        assert caught.value.code == ErrorCode.UNSUPPORTED_CAPABILITY
        assert caught.value.feature == "tool_filter"
        assert acp.start_calls == 0
        service.start("acp", SubagentRequest(prompt="c", parent_id=unfiltered.id))
        assert acp.start_calls == 1


# -- structured output ------------------------------------------------------------------------------------


async def test_a_valid_structured_answer_is_validated_and_returned_as_the_structured_value() -> None:
    llm = ScriptedLlm(['{"files": 3}'])
    async with open_service(SpawnProvider(llm=llm)) as service:
        with bounded():
            async with service.start(
                "spawn", SubagentRequest(prompt="count the files", output_schema=SCHEMA)
            ) as run:
                result = await run.result()

    assert (result.stop_reason, result.output, result.structured) == (
        "completed",
        '{"files": 3}',
        {"files": 3},
    )
    (request,) = llm.requests
    assert thaw_json(request.response_schema) == SCHEMA
    assert last_user(request).startswith("count the files\n\nAnswer with a single JSON value")


async def test_an_invalid_structured_answer_is_repaired_once() -> None:
    llm = ScriptedLlm(["There are three files.", '{"files": 3}'])
    async with open_service(SpawnProvider(llm=llm)) as service:
        with bounded():
            async with service.start(
                "spawn", SubagentRequest(prompt="count the files", output_schema=SCHEMA)
            ) as run:
                result = await run.result()

    assert (result.stop_reason, result.structured) == ("completed", {"files": 3})
    assert len(llm.requests) == 2
    assert llm.requests[1].messages[-2] == Message.assistant("There are three files.")
    assert last_user(llm.requests[1]).startswith("Your previous answer cannot be used: it is not valid JSON")


async def test_a_structured_answer_still_invalid_after_the_repair_is_an_error_result() -> None:
    llm = ScriptedLlm(["three", '{"files": "three"}'])
    service = SubagentService(progress_interval=None)
    async with open_service(SpawnProvider(llm=llm), service=service):
        with SubagentTool(service) as tool, bounded():
            outcome = await tool.execute(
                {"provider": "spawn", "prompt": "count the files", "output_schema": SCHEMA}, parent_id="root"
            )

    assert len(llm.requests) == 2
    assert outcome.is_error
    assert outcome.stop_reason == "error"
    assert outcome.structured is None
    assert outcome.output == '{"files": "three"}'
    assert outcome.error is not None
    assert "does not match the output schema after one repair turn" in outcome.error
    assert outcome.render().startswith("Error: the subagent stopped before finishing (stop reason: error)")


async def test_an_invalid_output_schema_fails_the_start_before_any_child_exists() -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm(fallback="never asked")
    provider = CountingSpawn(llm=llm, agents=agents)
    async with open_service(provider) as service:
        starts = record_starts(service, agents)
        with pytest.raises(SubagentError) as caught:
            service.start("spawn", SubagentRequest(prompt="p", output_schema={"type": "no-such-type"}))

        assert caught.value.code == ErrorCode.START_FAILED
        assert "the output schema is not a valid JSON Schema" in caught.value.message
        assert len(agents) == 0
        assert service.live_runs == ()
        assert starts == []
    assert llm.requests == []


# -- steering and resuming ------------------------------------------------------------------------------


async def test_a_message_sent_mid_turn_is_delivered_at_the_next_idle_point() -> None:
    agents = AgentRegistry()
    hold = Hold()
    llm = ScriptedLlm([Reply("first draft", wait=hold), "revised: tests first"])
    async with open_service(SpawnProvider(llm=llm, agents=agents)) as service:
        with bounded():
            async with service.start(
                "spawn", SubagentRequest(prompt="write a plan", parent_id="root")
            ) as run:
                assert isinstance(run, SteerableRun)
                agent = child_agent(agents, run)
                events: list[AgentEvent] = []
                agent.on_event(events.append)
                await hold.reached.wait()

                await run.send_message("Put tests first.")

                # Still queued: the model is mid-call.
                assert [pending.text for pending in agent.pending_messages] == ["Put tests first."]
                assert Message.user("Put tests first.") not in agent.messages
                hold.release.set()
                result = await run.result()

    assert result.output == "revised: tests first"
    assert llm.requests[1].messages == (
        Message.user("write a plan"),
        Message.assistant("first draft"),
        Message.user("Put tests first."),
    )
    assert [event for event in events if isinstance(event, MessageDelivered)] == [
        MessageDelivered("Put tests first.")
    ]


async def test_messages_pending_at_disposal_are_refused_with_the_reason_and_never_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="subagent.runtime._inprocess_agent")
    agents = AgentRegistry()
    hold = Hold()
    llm = ScriptedLlm([Reply("never finished", wait=hold)])
    async with open_service(SpawnProvider(llm=llm, agents=agents)) as service:
        with bounded():
            run = service.start("spawn", SubagentRequest(prompt="work", parent_id="root"))
            assert isinstance(run, SteerableRun)
            agent = child_agent(agents, run)
            events: list[AgentEvent] = []
            agent.on_event(events.append)
            await hold.reached.wait()
            await run.send_message("also check the docs")
            (pending,) = agent.pending_messages

            await run.dispose()

            with pytest.raises(MessageRefusedError) as refused:
                await pending.wait()
            with pytest.raises(SubagentError) as after:
                await run.send_message("too late")
            with pytest.raises(SubagentError) as after_inner:
                await provider_run(run).send_message("too late")

    assert (pending.status, pending.reason, refused.value.reason) == (
        "refused",
        DISPOSED_REASON,
        DISPOSED_REASON,
    )
    assert [event for event in events if isinstance(event, MessageRefused | MessageDelivered)] == [
        MessageRefused("also check the docs", DISPOSED_REASON)
    ]
    warnings = [r.getMessage() for r in caplog.records if "also check the docs" in r.getMessage()]
    assert len(warnings) == 1
    assert DISPOSED_REASON in warnings[0]
    assert after.value.code == ErrorCode.DISPOSED
    assert after_inner.value.code == ErrorCode.DISPOSED
    assert Message.user("also check the docs") not in agent.messages


async def test_a_message_sent_to_an_idle_child_enters_its_log_at_once_and_the_next_turn_sees_it() -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm(["first", "second"])
    async with open_service(SpawnProvider(llm=llm, agents=agents)) as service:
        with bounded():
            async with service.start("spawn", SubagentRequest(prompt="one", parent_id="root")) as run:
                assert isinstance(run, SteerableRun)
                assert isinstance(run, ResumableRun)
                await run.result()
                await run.send_message("a note")
                assert child_agent(agents, run).messages[-1] == Message.user("a note")
                await run.resume("two")

    assert llm.requests[1].messages == (
        Message.user("one"),
        Message.assistant("first"),
        Message.user("a note"),
        Message.user("two"),
    )


async def test_resume_continues_the_same_child_whose_log_holds_both_turns() -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm(["first answer", "second answer"])
    async with open_service(SpawnProvider(llm=llm, agents=agents, persona="You are brief.")) as service:
        with bounded():
            async with service.start("spawn", SubagentRequest(prompt="part one", parent_id="root")) as run:
                assert isinstance(run, ResumableRun)
                agent = child_agent(agents, run)
                first = await run.result()
                second = await run.resume("part two")
                assert child_agent(agents, run) is agent
            with pytest.raises(SubagentError) as after:
                await run.resume("part three")

    assert (first.output, second.output, second.stop_reason) == ("first answer", "second answer", "completed")
    assert agent.id == run.id
    assert agent.messages == (
        Message.system("You are brief."),
        Message.user("part one"),
        Message.assistant("first answer"),
        Message.user("part two"),
        Message.assistant("second answer"),
    )
    assert llm.requests[1].messages == agent.messages[:-1]
    assert after.value.code == ErrorCode.DISPOSED
    assert run.id not in agents


async def test_cancel_stops_a_resumed_turn_in_flight() -> None:
    agents = AgentRegistry()
    hold = Hold()
    llm = ScriptedLlm(["first answer", Reply("never", wait=hold)])
    async with open_service(SpawnProvider(llm=llm, agents=agents)) as service:
        with bounded():
            async with service.start("spawn", SubagentRequest(prompt="one", parent_id="root")) as run:
                assert isinstance(run, ResumableRun)
                first = await run.result()
                resumed: list[SubagentResult] = []

                async def resume() -> None:
                    resumed.append(await run.resume("two"))

                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(resume)
                    await hold.reached.wait()
                    await run.cancel()

                assert await run.result() is first

    assert first.stop_reason == "completed"
    assert [result.stop_reason for result in resumed] == ["cancelled"]


async def test_disposing_during_a_resumed_turn_makes_resume_raise_disposed() -> None:
    agents = AgentRegistry()
    hold = Hold()
    llm = ScriptedLlm(["first answer", Reply("never", wait=hold)])
    async with open_service(SpawnProvider(llm=llm, agents=agents)) as service:
        with bounded():
            run = service.start("spawn", SubagentRequest(prompt="one", parent_id="root"))
            assert isinstance(run, ResumableRun)
            await run.result()
            errors: list[SubagentError] = []

            async def resume() -> None:
                try:
                    await run.resume("two")
                except SubagentError as exc:
                    errors.append(exc)

            async with anyio.create_task_group() as task_group:
                task_group.start_soon(resume)
                await hold.reached.wait()
                await run.dispose()

    assert [error.code for error in errors] == [ErrorCode.DISPOSED]


# -- cancel and dispose -----------------------------------------------------------------------------------


async def test_cancel_mid_turn_ends_it_cancelled_and_leaves_no_task_and_dispose_removes_the_agent() -> None:
    agents = AgentRegistry()
    hold = Hold()
    llm = ScriptedLlm([Reply("never", wait=hold)])
    async with open_service(SpawnProvider(llm=llm, agents=agents)) as service:
        ends = record_ends(service)
        before = running_task_ids()
        with bounded():
            run = service.start("spawn", SubagentRequest(prompt="work", parent_id="root"))
            await hold.reached.wait()
            assert sorted(tasks_of(run.id)) == [f"spawn run {run.id}", f"subagent observer {run.id}"]

            await run.cancel()
            result = await run.result()

            assert (result.stop_reason, result.output) == ("cancelled", "")
            assert f"spawn run {run.id}" not in tasks_of(run.id)  # the turn's task ended
            assert child_agent(agents, run).busy is False  # kept for resume until disposed
            await run.dispose()

        assert run.id not in agents
        assert running_task_ids() == before
        assert ends == [
            SubagentRunEndInfo(
                id=run.id,
                provider="spawn",
                stop_reason="cancelled",
                last_assistant_message="",
                error=None,
                parent_id="root",
            )
        ]


async def test_cancel_before_the_turn_begins_ends_it_cancelled_without_calling_the_model() -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm(fallback="never asked")
    async with open_service(SpawnProvider(llm=llm, agents=agents)) as service:
        with bounded():
            run = service.start("spawn", SubagentRequest(prompt="work", parent_id="root"))
            await run.cancel()
            result = await run.result()
            agent = child_agent(agents, run)
            await run.dispose()

    assert result.stop_reason == "cancelled"
    assert llm.requests == []
    assert agent.messages == ()


@pytest.mark.parametrize("steps", range(10))
async def test_cancel_at_any_moment_while_the_first_turn_begins_ends_it_cancelled(steps: int) -> None:
    hold = Hold()  # never released: only cancel() can end the turn
    llm = ScriptedLlm(fallback=Reply("never", wait=hold))
    async with open_service(SpawnProvider(llm=llm)) as service:
        with bounded():
            async with service.start("spawn", SubagentRequest(prompt="work")) as run:
                for _ in range(steps):
                    await anyio.lowlevel.checkpoint()
                await run.cancel()
                result = await run.result()

    assert result.stop_reason == "cancelled"
    assert len(llm.requests) <= 1


async def test_dispose_mid_turn_makes_result_raise_disposed_and_end_carries_the_error() -> None:
    agents = AgentRegistry()
    hold = Hold()
    llm = ScriptedLlm([Reply("never", wait=hold)])
    async with open_service(SpawnProvider(llm=llm, agents=agents)) as service:
        ends = record_ends(service)
        before = running_task_ids()
        with bounded():
            run = service.start("spawn", SubagentRequest(prompt="work", parent_id="root"))
            await run.started()
            await hold.reached.wait()

            await run.dispose()

            with pytest.raises(SubagentError) as caught:
                await run.result()
            with pytest.raises(SubagentError) as caught_inner:
                await provider_run(run).result()

        assert caught.value.code == ErrorCode.DISPOSED
        assert caught_inner.value.code == ErrorCode.DISPOSED
        assert run.id not in agents
        assert tasks_of(run.id) == []
        assert running_task_ids() == before
        (end,) = ends
        assert (end.id, end.provider, end.stop_reason, end.last_assistant_message) == (
            run.id,
            "spawn",
            None,
            None,
        )
        assert end.error == str(caught_inner.value)
        assert "disposed" in end.error


async def test_closing_the_service_disposes_a_child_mid_turn_and_leaves_no_task() -> None:
    agents = AgentRegistry()
    hold = Hold()
    llm = ScriptedLlm([Reply("never", wait=hold)])
    async with open_service(SpawnProvider(llm=llm, agents=agents)) as service:
        with bounded():
            run = service.start("spawn", SubagentRequest(prompt="work", parent_id="root"))
            await hold.reached.wait()
    # open_service asserted that no task is left.
    assert len(agents) == 0
    with pytest.raises(SubagentError) as caught:
        await provider_run(run).result()
    assert caught.value.code == ErrorCode.DISPOSED


async def test_a_start_listener_resolves_the_child_agent_by_the_run_id() -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm(["done"])
    async with open_service(SpawnProvider(llm=llm, agents=agents, persona="You count.")) as service:
        starts = record_starts(service, agents)
        with bounded():
            async with service.start("spawn", SubagentRequest(prompt="count", parent_id="root")) as run:
                await run.result()
                inner = provider_run(run)

    ((info, agent, _),) = starts
    assert info == SubagentRunInfo(id=run.id, provider="spawn", parent_id="root", prompt="count")
    assert agent is inner.agent
    assert (agent.id, agent.parent_id, agent.depth, agent.persona) == (run.id, "root", 1, "You count.")


# -- run capabilities and liveness --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["spawn", "fork"])
async def test_in_process_runs_are_steerable_resumable_and_observable(name: str) -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm(fallback="done")
    parent = Agent(llm=llm, id="lead", registry=agents)
    providers = (SpawnProvider(agents=agents), ForkProvider(agents=agents))
    async with open_service(*providers) as service:
        with bounded():
            async with service.start(name, SubagentRequest(prompt="p", parent_id=parent.id)) as run:
                await run.result()
                inner = run.provider_run

                assert isinstance(run, SteerableRun)
                assert isinstance(run, ResumableRun)
                assert isinstance(run, ObservableRun)
                assert isinstance(inner, ObservableRun)
                assert isinstance(inner, InProcessRun)
                assert inner.last_activity is not None
                assert inner.update_count >= 1
                assert inner.pending_permissions == 0
                snapshot = service.get_provider(name)
                assert snapshot is not None
                assert snapshot.inherits_parent_context is (name == "fork")


async def test_the_heartbeat_reports_waiting_on_permission_while_an_approval_is_pending() -> None:
    asked = anyio.Event()
    decide = anyio.Event()
    approved: list[ToolInvocation] = []

    async def approver(invocation: ToolInvocation) -> bool:
        approved.append(invocation)
        asked.set()
        await decide.wait()
        return True

    shell = FunctionTool(
        "shell",
        "Run a command.",
        {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        lambda arguments: f"ran {arguments['cmd']}",
        needs_approval=True,
    )
    shell_call = call("shell", {"cmd": "ls"}, id="call-shell")
    llm = ScriptedLlm([Reply(tool_calls=[shell_call]), "listed"])
    provider = SpawnProvider(llm=llm, tools=[shell], approver=approver)
    async with open_service(provider, progress_interval=BEAT) as service:
        beats: list[SubagentProgressInfo] = []
        waiting = anyio.Event()

        def on_progress(info: SubagentProgressInfo) -> None:
            beats.append(info)
            if info.waiting_on_permission:
                waiting.set()

        service.events.on("subagent/progress", on_progress)
        with bounded():
            async with service.start("spawn", SubagentRequest(prompt="list")) as run:
                await asked.wait()
                await waiting.wait()
                assert provider_run(run).pending_permissions == 1
                now = run.progress()
                assert now is not None
                assert (now.id, now.waiting_on_permission) == (run.id, True)
                decide.set()
                result = await run.result()
                beats_at_end = len(beats)
                assert provider_run(run).pending_permissions == 0

    assert result.output == "listed"
    assert {(info.id, info.provider) for info in beats} == {(run.id, "spawn")}
    assert len(beats) == beats_at_end  # none after the end
    (invocation,) = approved
    assert (invocation.tool, thaw_json(invocation.arguments)) == ("shell", {"cmd": "ls"})
    assert llm.requests[1].messages[-1] == Message.tool_result(shell_call, "ran ls")


# -- the tool over in-process providers -------------------------------------------------------------------


async def test_the_subagent_tool_starts_a_spawned_child_as_the_calling_agents_child() -> None:
    agents = AgentRegistry()
    llm = ScriptedLlm(
        [
            delegate("count the files", output_schema=SCHEMA, persona="You count."),
            Reply('{"files": 2}', when=When(system_contains="You count.")),
            Reply("There are 2 files.", when=When(after_tool_result=True)),
        ]
    )
    async with open_service(SpawnProvider(agents=agents)) as service:
        starts = record_starts(service, agents)
        ends = record_ends(service)
        root = Agent(llm=llm, id="root", tools=[SubagentTool(service).for_agents()], registry=agents)
        with bounded():
            result = await root.run_turn("How many files?")

    assert result.output == "There are 2 files."
    ((info, child, lineage),) = starts
    assert info.parent_id == "root"
    assert child is not None
    assert (child.parent_id, child.depth, child.persona) == ("root", 1, "You count.")
    assert lineage == Lineage(depth=1, ancestors=("root",))
    assert root.messages[-2].role == "tool"
    assert root.messages[-2].content == '{"files": 2}'
    assert [(end.id, end.stop_reason) for end in ends] == [(info.id, "completed")]
    assert agents.list() == ["root"]  # the tool disposed the child


# -- a parent's inactivity clock while its child works ------------------------------------------------------


def _ticking_child_model(ticks: int) -> ScriptedLlm:
    """The child calls `tick` `ticks` times, one call per answer, then says "done"; the parent
    delegates first and then reports what its child said."""

    def answer(request: CompletionRequest) -> Reply:
        last_user = next(m.content for m in reversed(request.messages) if m.role == "user")
        if last_user == "work slowly":
            done = sum(1 for m in request.messages if m.role == "tool")
            return Reply(tool_calls=[call("tick")]) if done < ticks else Reply("done")
        if request.messages[-1].role == "tool":
            return Reply(f"child said: {request.messages[-1].content}")
        return Reply(tool_calls=[call("subagent", {"provider": "spawn", "prompt": "work slowly"})])

    return ScriptedLlm(answer)


async def _tick(_arguments: Any) -> str:
    await anyio.sleep(0.05)  # the work being simulated, not a wait for an event
    return "tick"


async def test_a_parent_waiting_on_a_busy_child_does_not_time_out_while_the_child_works() -> None:
    agents = AgentRegistry()
    llm = _ticking_child_model(ticks=30)  # 1.5 s of work, a sign of life every 0.05 s
    tick = FunctionTool("tick", "Do a little work.", NO_ARGUMENTS, _tick)
    ticked: list[str] = []
    async with open_service(SpawnProvider(llm=llm, agents=agents)) as service:
        with SubagentTool(service) as tool:
            # The child inherits its parent's tools, `tick` among them.
            parent = Agent(llm=llm, id="root", tools=[tool.for_agents(), tick], registry=agents)

            def watch_child(info: SubagentRunInfo) -> None:
                child = agents.get(info.id)
                assert child is not None
                child.on_event(
                    lambda event: ticked.append(event.output) if isinstance(event, ToolCallFinished) else None
                )

            service.events.on("subagent/start", watch_child)
            with bounded():
                result = await parent.run_turn("delegate", idle_timeout=1.0)
            await parent.close()
    assert (result.stop_reason, result.output) == ("completed", "child said: done")
    assert ticked == ["tick"] * 30


async def test_a_parent_whose_child_falls_silent_times_out_and_the_child_is_disposed() -> None:
    agents = AgentRegistry()
    hold = Hold()
    child_model = ScriptedLlm([Reply("never sent", wait=hold)])
    parent_model = ScriptedLlm(
        [Reply(tool_calls=[call("subagent", {"provider": "spawn", "prompt": "hang"})])]
    )
    async with open_service(SpawnProvider(llm=child_model, agents=agents)) as service:
        with SubagentTool(service) as tool:
            parent = Agent(llm=parent_model, id="root", tools=[tool.for_agents()], registry=agents)
            with bounded():
                result = await parent.run_turn("delegate", idle_timeout=0.3)
            await parent.close()
        assert agents.list() == []  # the silent child was disposed with the parent's turn
    assert hold.reached.is_set()
    assert result.stop_reason == "timeout"
    assert result.error == "no sign of life from the model or a tool for 0.3 s"


# -- no wiring: the process-wide registry -----------------------------------------------------------------


async def test_with_no_registry_anywhere_a_fork_finds_its_parent_and_listeners_find_the_child() -> None:
    llm = ScriptedLlm(
        [
            Reply("Earlier answer.", when=When(last_user_contains="earlier")),
            Reply(
                tool_calls=[call("subagent", {"provider": "fork", "prompt": "fork task"})],
                when=When(last_user_contains="now"),
            ),
            Reply("forked answer", when=When(last_user_contains="fork task")),
            Reply("Parent done.", when=When(after_tool_result=True)),
        ]
    )
    found: list[Agent | None] = []
    async with open_service(SpawnProvider(llm=llm), ForkProvider()) as service:
        service.events.on("subagent/start", lambda info: found.append(AgentRegistry.default().get(info.id)))
        with SubagentTool(service) as tool:
            parent = Agent(llm=llm, tools=[tool.for_agents()])  # no registry given
            with bounded():
                await parent.run_turn("earlier")
                result = await parent.run_turn("now")
            await parent.close()
    assert result.output == "Parent done."
    [child] = found
    assert child is not None
    assert child.parent_id == parent.id
    assert child.completed_messages[:2] == (Message.user("earlier"), Message.assistant("Earlier answer."))
    assert AgentRegistry.default().get(child.id) is None  # disposed with its run
    assert AgentRegistry.default().get(parent.id) is None  # closed


def test_an_agent_nobody_keeps_leaves_its_registry_even_unclosed() -> None:
    registry = AgentRegistry()
    Agent(llm=ScriptedLlm(), id="forgotten", registry=registry)
    gc.collect()
    assert registry.list() == []


def test_an_own_registry_refuses_a_second_live_agent_of_the_same_id_and_the_default_lets_it_in() -> None:
    mine = AgentRegistry()
    first = Agent(llm=ScriptedLlm(), id="twin", registry=mine)
    with pytest.raises(ValueError, match="an agent with id 'twin' is already live"):
        Agent(llm=ScriptedLlm(), id="twin", registry=mine)
    assert mine.get("twin") is first
    older = Agent(llm=ScriptedLlm(), id="twin-default")
    newer = Agent(llm=ScriptedLlm(), id="twin-default")
    assert AgentRegistry.default().get("twin-default") is newer
    assert older is not newer


async def test_register_adds_an_agent_to_another_registry_until_it_closes_or_the_disposer_runs() -> None:
    first, second = AgentRegistry(), AgentRegistry()
    agent = Agent(llm=ScriptedLlm(), id="shared", registry=first)
    undo = second.register(agent)
    assert (first.get("shared"), second.get("shared")) == (agent, agent)
    undo()
    assert (first.get("shared"), second.get("shared")) == (agent, None)
    second.register(agent)
    await agent.close()
    assert (first.list(), second.list()) == ([], [])


async def test_the_agents_subagent_tool_spec_follows_the_registry_and_is_reused_until_it_changes() -> None:
    async with open_service(SpawnProvider(llm=ScriptedLlm())) as service:
        with SubagentTool(service) as tool:
            agent_tool = tool.for_agents()
            first = agent_tool.spec
            assert agent_tool.spec is first  # read at every model call: not rebuilt each time
            assert first.parameters["properties"]["provider"]["enum"] == ("spawn",)
            service.register_provider(ForkProvider())
            changed = agent_tool.spec
    assert changed is not first
    assert changed.parameters["properties"]["provider"]["enum"] == ("spawn", "fork")


async def test_a_child_works_in_the_requests_directory_else_in_its_parents() -> None:
    seen: list[str | None] = []
    agents = AgentRegistry()
    llm = ScriptedLlm(lambda request: Reply("done"))
    parent = Agent(llm=llm, id="root", cwd="/home/user/project", registry=agents)
    async with open_service(SpawnProvider(llm=llm, agents=agents)) as service:
        with bounded():
            async with service.start("spawn", SubagentRequest(prompt="a", parent_id="root")) as inherited:
                await inherited.result()
                child = agents.get(inherited.id)
                assert child is not None
                seen.append(child.cwd)
            request = SubagentRequest(prompt="b", parent_id="root", cwd="/home/user/project/docs")
            async with service.start("spawn", request) as sent:
                await sent.result()
                child = agents.get(sent.id)
                assert child is not None
                seen.append(child.cwd)
    await parent.close()
    # Tools read it as `invocation.context.cwd`.
    assert seen == ["/home/user/project", "/home/user/project/docs"]
