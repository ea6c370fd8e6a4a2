"""`subagent serve`: an in-process agent served over ACP.

In memory, `ServedAgent` is driven through an `AgentSideConnection` by our own `AcpClient`, so every
assertion is about what a real client receives. End to end, our `AcpProvider` spawns `python -m
subagent serve` and the served agent delegates to an in-process child, all on `ScriptedLlm` (and once
on the loopback chat-completions stub). Nothing sleeps to wait: each wait is bounded by `anyio.fail_after`.
"""

from __future__ import annotations

import contextlib
import json
import math
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
import anyio.streams.buffered
import pytest

from subagent import SubagentRequest, SubagentService
from subagent._version import __version__
from subagent.acp import RequestError, schema
from subagent.acp.agent import AgentSideConnection
from subagent.acp.client import AcpClient, TurnResult
from subagent.acp.handlers import PermissionQuestion
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import FunctionTool, Reply, ScriptedLlm, When, call
from subagent.serve import ServedAgent
from subagent.testing import MemoryByteReceiveStream, MemoryByteSendStream
from subagent.types import LINEAGE_META_KEY, Usage
from tests.leaks import assert_no_leaks

pytestmark = pytest.mark.anyio

ROOT: Final = Path(__file__).resolve().parent.parent
FIXTURE: Final = ROOT / "fixtures" / "scripts" / "delegate_to_spawn.json"
SERVE: Final = [sys.executable, "-m", "subagent", "serve"]
WAIT: Final = 10  # seconds: a bound on a whole in-memory exchange, never a sleep
PROCESS_WAIT: Final = 30  # seconds: a bound on a run with a real child process

USER_PROMPT: Final = "Ask a subagent what 6 times 7 is."
CHILD_PROMPT: Final = "What is 6 times 7? Answer with the number only."
FINAL_ANSWER: Final = "The subagent says 6 times 7 is 42."
DELEGATION_TITLE: Final = f"subagent (spawn): {CHILD_PROMPT}"
NOT_APPROVED: Final = "error: this tool call was not approved, so it did not run"
DELEGATION_TOOLS: Final = [
    "subagent",
    "subagent_list",
    "subagent_wait",
    "subagent_send",
    "subagent_cancel",
    "subagent_result",
]
"""The tools a session's agent delegates with: the subagent tool and its background companions."""


# -- wiring a client to the served agent in memory ------------------------------------------------------


@asynccontextmanager
async def served(
    llm: ScriptedLlm,
    *,
    permission: Any = "deny",
    max_line_bytes: int | None = None,
    transcript: list[bytes] | None = None,
    subagents: bool = False,
    **options: Any,
) -> AsyncIterator[tuple[ServedAgent, AcpClient]]:
    """A `ServedAgent` behind an `AgentSideConnection` (with that line limit, if given), and an
    initialized `AcpClient` talking to it (advertising ``subagents`` when asked); every message the
    client receives is also appended to ``transcript``, when given."""
    limits: dict[str, Any] = {} if max_line_bytes is None else {"max_line_bytes": max_line_bytes}
    to_agent_send, to_agent_receive = anyio.create_memory_object_stream[bytes](math.inf)
    to_client_send, to_client_receive = anyio.create_memory_object_stream[bytes](math.inf)
    to_client = MemoryByteSendStream(to_client_send, transcript)
    with to_agent_send, to_agent_receive, to_client_send, to_client_receive:
        async with (
            ServedAgent(llm, **options) as handler,
            AgentSideConnection(handler, MemoryByteReceiveStream(to_agent_receive), to_client, **limits),
            AcpClient(
                MemoryByteReceiveStream(to_client_receive),
                MemoryByteSendStream(to_agent_send),
                permission=permission,
                subagents=subagents,
            ) as client,
        ):
            with anyio.fail_after(WAIT):
                await client.initialize()
            yield handler, client


def fixture_llm() -> ScriptedLlm:
    return ScriptedLlm.from_file(FIXTURE)


def holding(arrived: anyio.Event) -> Callable[[], Awaitable[object]]:
    """A `Reply.wait` that says the model was called, then never answers."""

    async def hold() -> None:
        arrived.set()
        await anyio.sleep_forever()

    return hold


def tool_updates(updates: Iterable[schema.SessionUpdate]) -> list[schema.SessionUpdate]:
    """The updates of tool calls, but for the calls that show runs (tests/test_serve_tree.py has those)."""
    return [
        update
        for update in updates
        if isinstance(update, schema.ToolCall | schema.ToolCallProgress)
        and not update.tool_call_id.startswith("run/")
    ]


def content(text: str) -> list[schema.ToolCallContent]:
    return [schema.Content(content=schema.TextContent(text=text))]


def record_questions(
    questions: list[PermissionQuestion], answer: str
) -> Callable[[PermissionQuestion], Awaitable[str | None]]:
    async def decide(question: PermissionQuestion) -> str | None:
        questions.append(question)
        return answer

    return decide


def note_tool(notes: list[dict[str, Any]]) -> FunctionTool:
    """A tool that needs approval and records what it was run with."""

    def write(arguments: Mapping[str, Any]) -> str:
        notes.append(dict(arguments))
        return "note written"

    return FunctionTool(
        "write_note",
        "Write a note.",
        {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        write,
        needs_approval=True,
    )


# -- initialize and sessions ----------------------------------------------------------------------------


async def test_an_update_over_the_clients_line_limit_is_skipped_and_the_turn_goes_on(tmp_path: Path) -> None:
    def big(arguments: Mapping[str, Any]) -> str:
        return "y" * 5000

    tool = FunctionTool("big", "Print a lot.", {"type": "object"}, big)
    llm = ScriptedLlm(
        [
            Reply(tool_calls=[call("big", {}, id="call-big")]),
            Reply("Done.", when=When(after_tool_result=True)),
        ]
    )
    async with served(llm, tools=[tool], delegate=False, max_line_bytes=4096) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("print a lot")
    # The model read all of it; the client got every update but the one too long for its line.
    assert llm.requests[1].messages[-1].content == "y" * 5000
    started = schema.ToolCall(
        tool_call_id="call-big", title="big", kind="other", status="in_progress", raw_input={}
    )
    assert tool_updates(turn.updates) == [started]
    assert (turn.stop_reason, turn.output) == ("end_turn", "Done.")


async def test_initialize_negotiates_version_1_and_advertises_only_what_is_implemented() -> None:
    async with served(ScriptedLlm()) as (_, client):
        assert client.agent is not None
        assert schema.to_builtins(client.agent) == {
            "protocolVersion": 1,
            "agentCapabilities": {
                "promptCapabilities": {"embeddedContext": True},
                "sessionCapabilities": {"close": {}},
            },
            "agentInfo": {"name": "subagent-seam", "title": "subagent-seam agent", "version": __version__},
        }


async def test_each_session_gets_its_own_agent_whose_id_is_the_session_id(tmp_path: Path) -> None:
    async with served(ScriptedLlm()) as (handler, client):
        with anyio.fail_after(WAIT):
            first = await client.new_session(tmp_path)
            second = await client.new_session(tmp_path / "elsewhere")
        assert first.session_id != second.session_id
        assert handler.agents.list() == [first.session_id, second.session_id]
        assert handler.sessions[first.session_id].cwd == str(tmp_path)
        assert handler.sessions[second.session_id].cwd == str(tmp_path / "elsewhere")
        agent = handler.sessions[first.session_id].agent
        assert agent.id == first.session_id
        assert [tool.spec.name for tool in agent.tools] == DELEGATION_TOOLS


async def test_a_depth_budget_from_the_clients_chain_limits_the_sessions_delegation(tmp_path: Path) -> None:
    async with served(ScriptedLlm()) as (handler, client):
        with anyio.fail_after(WAIT):
            exhausted = await client.new_session(tmp_path, meta={LINEAGE_META_KEY: {"depthBudget": 0}})
            two_more = await client.new_session(tmp_path, meta={LINEAGE_META_KEY: {"depthBudget": 2}})
            unlimited = await client.new_session(tmp_path)
        # Budget 0: no level below this session, so its agent is not offered the tool at all.
        assert [tool.spec.name for tool in handler.sessions[exhausted.session_id].agent.tools] == []
        assert handler.sessions[exhausted.session_id].subagent_tool is None
        # Budget 2: its children may start at most 1 level below them.
        capped, *companions = handler.sessions[two_more.session_id].agent.tools
        assert [tool.spec.name for tool in (capped, *companions)] == DELEGATION_TOOLS
        assert capped.spec.description.endswith(
            "Here a subagent may start at most 1 level(s) of subagents below itself: "
            "`depth_limit` is at most 1, and 1 when left out."
        )
        free, *_ = handler.sessions[unlimited.session_id].agent.tools
        assert "Here a subagent may start" not in free.spec.description


async def test_a_malformed_depth_budget_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with served(ScriptedLlm()) as (handler, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path, meta={LINEAGE_META_KEY: {"depthBudget": -1}})
        assert [
            tool.spec.name for tool in handler.sessions[session.session_id].agent.tools
        ] == DELEGATION_TOOLS
    assert f"ignoring a malformed {LINEAGE_META_KEY} in session/new: {{'depthBudget': -1}}" in caplog.text


async def test_a_relative_cwd_is_refused_with_invalid_params() -> None:
    async with served(ScriptedLlm()) as (_, client):
        with anyio.fail_after(WAIT), pytest.raises(RequestError) as caught:
            await client.connection.request(schema.SESSION_NEW, {"cwd": "relative", "mcpServers": []})
    assert caught.value.code == -32602
    assert caught.value.data == {"cwd": "relative", "reason": "cwd must be an absolute path"}


# -- a turn ---------------------------------------------------------------------------------------------


async def test_a_prompt_streams_the_delegation_and_answers_with_the_final_text(tmp_path: Path) -> None:
    llm = fixture_llm()
    async with served(llm) as (handler, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt(USER_PROMPT)
        # The child was disposed when the tool call ended; the session's agent stays for the next turn.
        assert handler.agents.list() == [session.session_id]
        assert handler.service.live_runs == ()
    assert turn.stop_reason == "end_turn"
    assert turn.output == FINAL_ANSWER
    assert turn.usage == {"inputTokens": 60, "outputTokens": 22, "totalTokens": 82}
    narration = "".join(
        update.content.text
        for update in turn.updates[: turn.updates.index(tool_updates(turn.updates)[0])]
        if isinstance(update, schema.AgentMessageChunk) and isinstance(update.content, schema.TextContent)
    )
    assert narration == "I will ask a subagent."
    assert tool_updates(turn.updates) == [
        schema.ToolCall(
            tool_call_id="call-delegate",
            title=DELEGATION_TITLE,
            kind="other",
            status="in_progress",
            raw_input={"provider": "spawn", "prompt": CHILD_PROMPT},
        ),
        schema.ToolCallProgress(tool_call_id="call-delegate", status="completed", content=content("42")),
    ]
    # A spawned child starts fresh: it saw only its prompt (no persona, none of the parent's turn).
    child_request = llm.requests[1]
    assert [(m.role, m.content) for m in child_request.messages] == [("user", CHILD_PROMPT)]
    assert llm.remaining == 0


async def test_embedded_text_resources_and_resource_links_become_prompt_text(tmp_path: Path) -> None:
    llm = ScriptedLlm(fallback="ok")
    blocks: list[schema.ContentBlock] = [
        schema.TextContent(text="Summarise these."),
        schema.EmbeddedResource(resource=schema.TextResourceContents(uri="file:///a.txt", text="alpha")),
        schema.ResourceLink(name="b.txt", uri="file:///b.txt"),
    ]
    async with served(llm) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt(blocks)
    assert turn.stop_reason == "end_turn"
    assert llm.requests[0].messages[-1].content == (
        'Summarise these.\n\n<resource uri="file:///a.txt">\nalpha\n</resource>\n\n[resource: b.txt] file:///b.txt'
    )


async def test_an_image_prompt_is_refused_with_invalid_params_naming_its_type(tmp_path: Path) -> None:
    llm = ScriptedLlm(fallback="never used")
    async with served(llm) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            with pytest.raises(RequestError) as caught:
                await session.prompt([schema.ImageContent(data="AAAA", mime_type="image/png")])
    assert caught.value.code == -32602
    assert caught.value.data == {
        "reason": "this agent reads text, resource links and embedded text resources only",
        "unsupported": "image",
    }
    assert llm.requests == []


@pytest.mark.parametrize(
    ("reply", "options", "stop_reason"),
    [
        (Reply("partial", finish_reason="length"), {}, "max_tokens"),
        (Reply("no", finish_reason="content_filter"), {}, "refusal"),
        (Reply(tool_calls=[call("noop", {})]), {"max_model_calls": 1}, "max_turn_requests"),
    ],
)
async def test_runtime_stop_reasons_map_onto_acp_stop_reasons(
    tmp_path: Path, reply: Reply, options: dict[str, Any], stop_reason: str
) -> None:
    noop = FunctionTool("noop", "Do nothing.", {"type": "object", "properties": {}}, lambda _: "done")
    async with served(ScriptedLlm([reply]), tools=[noop], **options) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
    assert turn.stop_reason == stop_reason


async def test_a_failed_turn_answers_a_json_rpc_error_with_the_diagnosis(tmp_path: Path) -> None:
    async with served(ScriptedLlm()) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            with pytest.raises(RequestError) as caught:
                await session.prompt("hi")
    assert caught.value.code == -32603
    assert caught.value.message == "the agent's turn failed"
    assert caught.value.data == {
        "stopReason": "error",
        "details": "the model call failed (script): the script has no reply left for this request "
        "(last user message: 'hi')",
    }


async def test_a_second_prompt_while_one_runs_is_refused(tmp_path: Path) -> None:
    arrived = anyio.Event()
    llm = ScriptedLlm([Reply("never", wait=holding(arrived))])
    async with served(llm) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(session.prompt, "first")
                await arrived.wait()
                with pytest.raises(RequestError) as caught:
                    await client.connection.request(
                        schema.SESSION_PROMPT,
                        {"sessionId": session.session_id, "prompt": [{"type": "text", "text": "second"}]},
                    )
                await session.cancel()
    assert caught.value.code == -32600
    assert caught.value.data == {
        "sessionId": session.session_id,
        "reason": "a prompt is already running in this session",
    }


async def test_a_failed_delegation_is_shown_as_a_failed_tool_call(tmp_path: Path) -> None:
    # The child finds no reply in the script: its turn fails, and the subagent tool says so in text.
    llm = ScriptedLlm(
        [
            Reply(tool_calls=[call("subagent", {"provider": "spawn", "prompt": "fail"}, id="call-fail")]),
            Reply("The subagent failed.", when=When(after_tool_result=True, last_user_contains="go")),
        ]
    )
    async with served(llm) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
    assert (turn.stop_reason, turn.output) == ("end_turn", "The subagent failed.")
    assert tool_updates(turn.updates)[-1] == schema.ToolCallProgress(
        tool_call_id="call-fail",
        status="failed",
        content=content(
            "error: the subagent stopped before finishing (stop reason: error): it failed: the model call "
            "failed (script): the script has no reply left for this request (last user message: 'fail')"
            "\n\nIt produced no output."
        ),
    )


async def test_a_call_of_a_missing_tool_is_shown_once_as_failed(tmp_path: Path) -> None:
    llm = ScriptedLlm(
        [
            Reply(tool_calls=[call("nope", {"x": 1}, id="call-nope")]),
            Reply("Sorry.", when=When(after_tool_result=True)),
        ]
    )
    async with served(llm) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
    assert tool_updates(turn.updates) == [
        schema.ToolCall(
            tool_call_id="call-nope",
            title="nope",
            kind="other",
            status="failed",
            content=content(
                "error: there is no tool named 'nope' (available: "
                + ", ".join(repr(name) for name in DELEGATION_TOOLS)
                + ")"
            ),
            raw_input={"x": 1},
        )
    ]
    assert (turn.stop_reason, turn.output) == ("end_turn", "Sorry.")


# -- cancellation, close, and the end of the connection -------------------------------------------------


def hanging_delegation(arrived: anyio.Event) -> ScriptedLlm:
    """The parent delegates to a spawned child whose model never answers."""
    return ScriptedLlm(
        [
            Reply(
                tool_calls=[call("subagent", {"provider": "spawn", "prompt": "hang"}, id="call-hang")],
                when=When(last_user_contains="start"),
            ),
            Reply("never", wait=holding(arrived), when=When(last_user_contains="hang")),
        ]
    )


async def test_cancel_mid_delegation_answers_cancelled_and_disposes_the_child(tmp_path: Path) -> None:
    arrived = anyio.Event()
    async with served(hanging_delegation(arrived)) as (handler, client):
        outcome: list[TurnResult] = []
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)

            async def prompt() -> None:
                outcome.append(await session.prompt("start"))

            async with anyio.create_task_group() as task_group:
                task_group.start_soon(prompt)
                await arrived.wait()
                assert len(handler.agents) == 2  # the session's agent and its child
                await session.cancel()
        (turn,) = outcome
        assert turn.stop_reason == "cancelled"
        assert handler.agents.list() == [session.session_id]
        assert handler.service.live_runs == ()
        assert not handler.sessions[session.session_id].agent.busy
    assert tool_updates(turn.updates) == [
        schema.ToolCall(
            tool_call_id="call-hang",
            title="subagent (spawn): hang",
            kind="other",
            status="in_progress",
            raw_input={"provider": "spawn", "prompt": "hang"},
        ),
        schema.ToolCallProgress(
            tool_call_id="call-hang",
            status="failed",
            content=content("error: the turn ended before this call finished"),
        ),
    ]


async def test_a_cancelled_session_takes_its_next_turn(tmp_path: Path) -> None:
    arrived = anyio.Event()
    llm = ScriptedLlm(
        [Reply("never", wait=holding(arrived), when=When(last_user_contains="first")), Reply("second answer")]
    )
    async with served(llm) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(session.prompt, "first")
                await arrived.wait()
                await session.cancel()
            turn = await session.prompt("second")
    assert (turn.stop_reason, turn.output) == ("end_turn", "second answer")


async def test_closing_a_session_mid_turn_answers_cancelled_and_leaves_no_agent(tmp_path: Path) -> None:
    arrived = anyio.Event()
    async with served(hanging_delegation(arrived)) as (handler, client):
        outcome: list[TurnResult] = []
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)

            async def prompt() -> None:
                outcome.append(await session.prompt("start"))

            async with anyio.create_task_group() as task_group:
                task_group.start_soon(prompt)
                await arrived.wait()
                answer = await client.connection.request(
                    schema.SESSION_CLOSE, {"sessionId": session.session_id}
                )
            assert bytes(answer) == b"{}"
            assert outcome[0].stop_reason == "cancelled"
            assert handler.agents.list() == []
            assert handler.sessions == {}
            assert handler.service.live_runs == ()
            with pytest.raises(RequestError) as caught:
                await session.prompt("again")
    assert caught.value.code == -32602
    assert caught.value.data == {"sessionId": session.session_id, "reason": "unknown session"}


async def test_the_end_of_the_connection_closes_every_agent_and_the_service(tmp_path: Path) -> None:
    arrived = anyio.Event()
    connection_done = anyio.Event()
    to_agent_send, to_agent_receive = anyio.create_memory_object_stream[bytes](math.inf)
    to_client_send, to_client_receive = anyio.create_memory_object_stream[bytes](math.inf)
    with anyio.fail_after(WAIT), to_agent_send, to_agent_receive, to_client_send, to_client_receive:
        async with ServedAgent(hanging_delegation(arrived)) as handler:
            connection = AgentSideConnection(
                handler, MemoryByteReceiveStream(to_agent_receive), MemoryByteSendStream(to_client_send)
            )

            async def serve() -> None:
                await connection.run()
                connection_done.set()

            async with anyio.create_task_group() as task_group:
                task_group.start_soon(serve)
                async with AcpClient(
                    MemoryByteReceiveStream(to_client_receive), MemoryByteSendStream(to_agent_send)
                ) as client:
                    await client.initialize()
                    session = await client.new_session(tmp_path)
                    task_group.start_soon(session.prompt, "start")
                    await arrived.wait()
                    assert len(handler.agents) == 2
                    to_agent_send.close()  # the client closed the agent's stdin
                    await connection_done.wait()
                    # The turn was cut short with the connection, and the tool disposed its child.
                    assert handler.agents.list() == [session.session_id]
                    task_group.cancel_scope.cancel()  # the client's prompt will never be answered
        assert handler.agents.list() == []
        assert handler.sessions == {}
        assert handler.service.live_runs == ()


# -- approvals ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "ran", "tool_result", "final_status"),
    [
        ("allow", [{"text": "hello"}], "note written", "completed"),
        ("reject", [], NOT_APPROVED, "failed"),
    ],
)
async def test_a_tool_that_needs_approval_is_asked_about_through_the_client(
    tmp_path: Path,
    answer: str,
    ran: list[dict[str, Any]],
    tool_result: str,
    final_status: schema.ToolCallStatus,
) -> None:
    notes: list[dict[str, Any]] = []
    questions: list[PermissionQuestion] = []
    llm = ScriptedLlm(
        [
            Reply(tool_calls=[call("write_note", {"text": "hello"}, id="call-note")]),
            Reply("Noted.", when=When(after_tool_result=True)),
        ]
    )
    permission = record_questions(questions, answer)
    async with served(llm, permission=permission, tools=[note_tool(notes)], delegate=False) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("write a note")
    assert notes == ran
    (question,) = questions
    assert (question.tool_call_id, question.title, question.kind) == ("call-note", "write_note", "other")
    assert question.raw_input == {"text": "hello"}
    assert [(option.option_id, option.kind) for option in question.options] == [
        ("allow", "allow_once"),
        ("reject", "reject_once"),
    ]
    # The model read the tool's result, or the refusal.
    assert llm.requests[1].messages[-1].content == tool_result
    pending = schema.ToolCall(
        tool_call_id="call-note",
        title="write_note",
        kind="other",
        status="pending",
        raw_input={"text": "hello"},
    )
    finished = schema.ToolCallProgress(
        tool_call_id="call-note", status=final_status, content=content(tool_result)
    )
    expected = [pending, finished]
    if answer == "allow":
        expected.insert(1, schema.ToolCallProgress(tool_call_id="call-note", status="in_progress"))
    assert tool_updates(turn.updates) == expected
    assert (turn.stop_reason, turn.output) == ("end_turn", "Noted.")


async def test_a_subagents_tool_call_is_asked_about_and_shown_in_its_parent_session(tmp_path: Path) -> None:
    notes: list[dict[str, Any]] = []
    questions: list[PermissionQuestion] = []
    llm = ScriptedLlm(
        [
            Reply(
                tool_calls=[
                    call("subagent", {"provider": "spawn", "prompt": "take a note"}, id="call-parent")
                ],
                when=When(last_user_contains="delegate", after_tool_result=False),
            ),
            Reply(
                tool_calls=[call("write_note", {"text": "from the child"}, id="call-child")],
                when=When(last_user_contains="take a note", after_tool_result=False),
            ),
            Reply("Child done.", when=When(last_user_contains="take a note", after_tool_result=True)),
            Reply("Parent done.", when=When(last_user_contains="delegate", after_tool_result=True)),
        ]
    )
    permission = record_questions(questions, "allow")
    async with served(llm, permission=permission, tools=[note_tool(notes)]) as (handler, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("delegate")
        assert handler.agents.list() == [session.session_id]
    assert notes == [{"text": "from the child"}]
    (question,) = questions
    child_id, _, call_id = question.tool_call_id.partition("/")
    assert child_id.startswith("spawn-")
    assert call_id == "call-child"
    assert question.title == f"{child_id}: write_note"
    assert question.session_id == session.session_id
    child_key = question.tool_call_id
    assert tool_updates(turn.updates) == [
        schema.ToolCall(
            tool_call_id="call-parent",
            title="subagent (spawn): take a note",
            kind="other",
            status="in_progress",
            raw_input={"provider": "spawn", "prompt": "take a note"},
        ),
        schema.ToolCall(
            tool_call_id=child_key,
            title=f"{child_id}: write_note",
            kind="other",
            status="pending",
            raw_input={"text": "from the child"},
        ),
        schema.ToolCallProgress(tool_call_id=child_key, status="in_progress"),
        schema.ToolCallProgress(tool_call_id=child_key, status="completed", content=content("note written")),
        schema.ToolCallProgress(
            tool_call_id="call-parent", status="completed", content=content("Child done.")
        ),
    ]
    assert (turn.stop_reason, turn.output) == ("end_turn", "Parent done.")


# -- depth ----------------------------------------------------------------------------------------------


async def test_depth_limit_zero_keeps_children_from_delegating(tmp_path: Path) -> None:
    llm = ScriptedLlm(
        [
            Reply(
                tool_calls=[call("subagent", {"provider": "spawn", "prompt": "delegate again"})],
                when=When(last_user_contains="go", after_tool_result=False),
            ),
            Reply(
                tool_calls=[call("subagent", {"provider": "spawn", "prompt": "grandchild task"})],
                when=When(last_user_contains="delegate again", after_tool_result=False),
            ),
            Reply(
                "I could not delegate.",
                when=When(last_user_contains="delegate again", after_tool_result=True),
            ),
            Reply("Done.", when=When(last_user_contains="go", after_tool_result=True)),
        ]
    )
    async with served(llm, depth_limit=0) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
    assert (turn.stop_reason, turn.output) == ("end_turn", "Done.")
    assert (
        llm.requests[0]
        .tools[0]
        .description.endswith(
            "Here subagents may not start subagents of their own (`depth_limit` is always 0)."
        )
    )
    # The child's call was refused by the seam before a grandchild existed.
    refusal = llm.requests[2].messages[-1].content
    assert refusal.startswith(
        "error: the subagent could not be started (UNSUPPORTED_CAPABILITY): depth limit"
    )
    assert all(request.messages[-1].content != "grandchild task" for request in llm.requests)
    assert len(llm.requests) == 4


@pytest.mark.parametrize(("cap", "asked", "given"), [(1, 5, 1), (3, 2, 2), (2, None, 2)])
async def test_depth_limit_caps_what_the_model_asks_for(
    tmp_path: Path, cap: int, asked: int | None, given: int
) -> None:
    arguments: dict[str, Any] = {"provider": "spawn", "prompt": "child task"}
    if asked is not None:
        arguments["depth_limit"] = asked
    llm = ScriptedLlm(
        [
            Reply(
                tool_calls=[call("subagent", arguments)],
                when=When(after_tool_result=False, last_user_contains="go"),
            ),
            Reply("child answer", when=When(last_user_contains="child task")),
            Reply("Done.", when=When(after_tool_result=True)),
        ]
    )
    limits: list[int | None] = []
    async with served(llm, depth_limit=cap) as (handler, client):
        service = handler.service
        service.events.on(
            "subagent/start",
            lambda info: limits.extend(
                run.request.depth_limit for run in service.live_runs if run.id == info.id
            ),
        )
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
    assert turn.output == "Done."
    assert limits == [given]


# -- over its real stdio --------------------------------------------------------------------------------


@pytest.mark.subprocess
def test_serve_exits_0_when_the_client_closes_stdin() -> None:
    finished = subprocess.run(
        [*SERVE, "--script", str(FIXTURE)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=PROCESS_WAIT,
        check=False,
    )
    assert (finished.returncode, finished.stdout, finished.stderr) == (0, b"", b"")


@pytest.mark.subprocess
def test_a_client_that_writes_its_requests_and_closes_stdin_still_gets_every_answer(tmp_path: Path) -> None:
    # A shell pipe: everything is written, stdin closed, then the answers are read. The requests in
    # flight at the end of stdin are drained, not dropped.
    requests = [
        {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"protocolVersion": 1}},
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "session/new",
            "params": {"cwd": str(tmp_path), "mcpServers": ()},
        },
    ]
    finished = subprocess.run(
        [*SERVE, "--script", str(FIXTURE)],
        input=b"".join(json.dumps(request).encode() + b"\n" for request in requests),
        capture_output=True,
        timeout=PROCESS_WAIT,
        check=False,
    )
    assert (finished.returncode, finished.stderr) == (0, b"")
    answers = [json.loads(line) for line in finished.stdout.splitlines()]
    assert [answer["id"] for answer in answers] == [0, 1]
    assert answers[0]["result"]["protocolVersion"] == 1
    assert answers[1]["result"]["sessionId"].startswith("session-")


@pytest.mark.subprocess
async def test_serve_refuses_session_new_before_initialize_and_keeps_serving_after_every_bad_line(
    tmp_path: Path,
) -> None:
    def line(message: Any) -> bytes:
        return json.dumps(message).encode() + b"\n"

    deep = "[" * 10_000 + "]" * 10_000
    new_session = {"cwd": str(tmp_path), "mcpServers": []}
    burst = [
        # A real initialize whose client name holds a lone surrogate (as JSON.stringify writes it).
        b'{"jsonrpc":"2.0","id":"init","method":"initialize",'
        b'"params":{"protocolVersion":1,"clientInfo":{"name":"x\\ud83d","version":"1"}}}\n',
        b"Running database migrations... done\n",
        b"{oops\n",
        f'{{"jsonrpc":"2.0","id":"deep","method":"session/new","params":{deep}}}\n'.encode(),
        b'{"jsonrpc":"2.0","id":"utf8","method":"session/new","params":{"cwd":"/\xff","mcpServers":[]}}\n',
        b'{"jsonrpc":"2.0","id":1.5,"method":"session/new"}\n',
        b'{"jsonrpc":"2.0","id":"no-method","params":{}}\n',
        b'[{"jsonrpc":"2.0","id":"batched","method":"initialize"}]\n',
        b"[]\n",
        line({"jsonrpc": "2.0", "id": "new", "method": "session/new", "params": new_session}),
    ]
    async with assert_no_leaks():
        process = await anyio.open_process([*SERVE, "--script", str(FIXTURE)])
        async with process:
            assert process.stdin is not None
            assert process.stdout is not None
            stdout = anyio.streams.buffered.BufferedByteReceiveStream(process.stdout)
            with anyio.fail_after(PROCESS_WAIT):
                await process.stdin.send(
                    line({"jsonrpc": "2.0", "id": "early", "method": "session/new", "params": new_session})
                )
                early = json.loads(await stdout.receive_until(b"\n", 1 << 20))
                await process.stdin.send(b"".join(burst))
                await process.stdin.aclose()  # the answers still come: serve drains at end of input
                answers = []
                with contextlib.suppress(anyio.IncompleteRead):
                    while True:
                        answers.append(json.loads(await stdout.receive_until(b"\n", 1 << 20)))
                assert await process.wait() == 0
                assert process.stderr is not None
                stderr = b""
                with contextlib.suppress(anyio.EndOfStream):
                    while True:
                        stderr += await process.stderr.receive()
    assert early == {
        "jsonrpc": "2.0",
        "id": "early",
        "error": {
            "code": -32600,
            "message": "Invalid Request",
            "data": {"details": "the client must send initialize first", "method": "session/new"},
        },
    }
    [batch] = [answer for answer in answers if isinstance(answer, list)]
    assert [(item["id"], item["error"]["code"]) for item in batch] == [("batched", -32600)]
    identified = {answer["id"]: answer for answer in answers if isinstance(answer, dict) and answer["id"]}
    assert identified["init"]["result"]["agentInfo"]["name"] == "subagent-seam"
    assert identified["new"]["result"]["sessionId"].startswith("session-")
    codes = {key: answer["error"]["code"] for key, answer in identified.items() if "error" in answer}
    assert codes == {"deep": -32600, "utf8": -32700, "no-method": -32600}
    unidentified = [
        answer["error"]["code"] for answer in answers if isinstance(answer, dict) and answer["id"] is None
    ]
    assert sorted(unidentified) == [-32700, -32600, -32600]  # {oops, the float id, the empty batch}
    assert len(answers) == 1 + len(identified) + len(unidentified)  # one answer each, no more
    assert b"Traceback" not in stderr


# -- end to end: our ACP provider drives `subagent serve` -----------------------------------------------


async def run_served(
    command: list[str], tmp_path: Path, prompt: str, **provider_options: Any
) -> tuple[Any, AcpRun]:
    provider = AcpProvider(command, cwd=tmp_path, **provider_options)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt=prompt)) as run:
            with anyio.fail_after(PROCESS_WAIT):
                await run.started()
                result = await run.result()
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
    return result, acp_run


@pytest.mark.subprocess
async def test_the_acp_provider_drives_subagent_serve_which_delegates_to_a_spawned_child(
    tmp_path: Path,
) -> None:
    result, acp_run = await run_served([*SERVE, "--script", str(FIXTURE)], tmp_path, USER_PROMPT)
    assert (result.stop_reason, result.output, result.error) == ("completed", FINAL_ANSWER, None)
    assert result.usage == Usage(input_tokens=60, output_tokens=22, total_tokens=82)
    assert acp_run.agent is not None
    assert acp_run.agent.agent_info == schema.Implementation(
        name="subagent-seam", title="subagent-seam agent", version=__version__
    )
    assert tool_updates(acp_run.updates) == [
        schema.ToolCall(
            tool_call_id="call-delegate",
            title=DELEGATION_TITLE,
            kind="other",
            status="in_progress",
            raw_input={"provider": "spawn", "prompt": CHILD_PROMPT},
        ),
        schema.ToolCallProgress(tool_call_id="call-delegate", status="completed", content=content("42")),
    ]


@pytest.mark.subprocess
async def test_a_depth_limit_holds_across_the_process_boundary_into_subagent_serve(tmp_path: Path) -> None:
    # The served agent's parent run may start one level below itself and no more: the served agent
    # may start no subagent, so the tool its scripted model calls is not there, and no child is
    # spawned in the served process.
    provider = AcpProvider([*SERVE, "--script", str(FIXTURE)], cwd=tmp_path)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        service.register_provider(SpawnProvider(llm=ScriptedLlm(["parent done"])))
        parent = service.start("spawn", SubagentRequest(prompt="parent", depth_limit=1))
        request = SubagentRequest(prompt=USER_PROMPT, parent_id=parent.id)
        async with parent, service.start(provider.name, request) as run:
            assert run.request.lineage is not None
            assert (run.request.lineage.depth, run.request.lineage.depth_budget) == (2, 0)
            with anyio.fail_after(PROCESS_WAIT):
                result = await run.result()
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
    assert result.stop_reason == "completed"
    assert tool_updates(acp_run.updates) == [
        schema.ToolCall(
            tool_call_id="call-delegate",
            title=DELEGATION_TITLE,
            kind="other",
            status="failed",
            content=content("error: there is no tool named 'subagent' (available: none)"),
            raw_input={"provider": "spawn", "prompt": CHILD_PROMPT},
        )
    ]


@pytest.mark.subprocess
async def test_a_failed_served_turn_reaches_the_acp_provider_as_an_error_with_the_diagnosis(
    tmp_path: Path,
) -> None:
    script = tmp_path / "empty.json"
    script.write_text("[]")
    command = [*SERVE, "--script", str(script)]
    result, _ = await run_served(command, tmp_path, "hi")
    details = {
        "stopReason": "error",
        "details": "the model call failed (script): the script has no reply left for this request "
        "(last user message: 'hi')",
    }
    assert result.stop_reason == "error"
    assert result.error == (
        f"agent `{shlex.join(command)}` answered session/prompt with error -32603: "
        f"the agent's turn failed ({json.dumps(details)})"
    )


@pytest.mark.subprocess
async def test_subagent_serve_on_an_openai_compatible_server_delegates_over_loopback(tmp_path: Path) -> None:
    pytest.importorskip("subagent.runtime.openai", reason="the OpenAI-compatible adapter is not there yet")
    chat_server = pytest.importorskip(
        "subagent.testing._chat_server", reason="the loopback chat-completions stub is not there yet"
    )
    arguments = json.dumps({"provider": "spawn", "prompt": CHILD_PROMPT})
    script = [
        chat_server.StreamedReply(
            text="Asking.",
            tool_calls=[chat_server.ToolCallReply(id="call-1", name="subagent", arguments=arguments)],
        ),
        chat_server.StreamedReply(text="42"),
        chat_server.StreamedReply(
            text=FINAL_ANSWER, usage={"prompt_tokens": 50, "completion_tokens": 9, "total_tokens": 59}
        ),
    ]
    # The server's sockets are closed on leaving its block, before the leak check counts descriptors.
    async with assert_no_leaks(), chat_server.serve_chat_completions(script, model="stub-model") as server:
        command = [
            *SERVE,
            "--base-url",
            server.base_url,
            "--model",
            "stub-model",
            "--api-key-env",
            "SUBAGENT_TEST_KEY",
        ]
        provider = AcpProvider(command, cwd=tmp_path, env={"SUBAGENT_TEST_KEY": "sk-test-123"})
        async with SubagentService() as service:
            service.register_provider(provider)
            async with service.start(provider.name, SubagentRequest(prompt=USER_PROMPT)) as run:
                with anyio.fail_after(PROCESS_WAIT):
                    result = await run.result()
    assert (result.stop_reason, result.output) == ("completed", FINAL_ANSWER)
    assert result.usage == Usage(input_tokens=50, output_tokens=9, total_tokens=59)
    assert len(server.requests) == 3
    assert all(request.headers["authorization"] == "Bearer sk-test-123" for request in server.requests)
    assert [request.json["model"] for request in server.requests] == ["stub-model"] * 3
    # The parent, then its fresh child (only the delegated prompt), then the parent reading the result.
    assert server.requests[1].json["messages"] == [{"role": "user", "content": CHILD_PROMPT}]
    parent_messages = server.requests[2].json["messages"]
    assert parent_messages[-1]["role"] == "tool"
    assert parent_messages[-1]["content"] == "42"
