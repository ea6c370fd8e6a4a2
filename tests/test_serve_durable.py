"""`subagent serve` with a run journal: a client reopens a served session after `serve` restarts.

End to end, `subagent serve --journal PATH` runs as a real child process on a loopback chat-completions
stub (so every request the model gets is recorded, exactly), is killed with SIGKILL after a turn, and a
new `serve` on the same journal is asked for the session with `session/resume` or `session/load`: the
model's request for the next turn holds the whole earlier conversation. In memory, `ServedAgent` is
driven by our own `AcpClient` for the rest: listing, paging, refusals, and a journal's records. Both
backends; every wait bounded by `anyio.fail_after`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import anyio
import pytest

from subagent import SubagentRequest, SubagentService
from subagent.acp import AgentExitedError, RequestError, schema
from subagent.acp.agent import AgentSideConnection
from subagent.acp.client import AcpClient, AcpSession, spawn_agent
from subagent.cli import main
from subagent.cli._serve_command import journal_path
from subagent.journal import JOURNAL_ENV, RunJournal, default_journal_path
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.runtime import Reply, ScriptedLlm, call
from subagent.serve import ServedAgent, default_persona
from subagent.testing import MemoryByteReceiveStream, MemoryByteSendStream
from subagent.testing._chat_server import (
    ReceivedRequest,
    StreamedReply,
    ToolCallReply,
    serve_chat_completions,
)
from subagent.types import TURN_META_KEY
from tests.leaks import assert_no_leaks

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

SERVE: Final = [sys.executable, "-m", "subagent", "serve"]
WAIT: Final = 10  # seconds: a bound on a whole in-memory exchange, never a sleep
PROCESS_WAIT: Final = 30  # seconds: a bound on an exchange with real child processes

PERSONA: Final = default_persona(delegate=True)
FIRST_PROMPT: Final = "List your background subagents, then say hello."
SECOND_PROMPT: Final = "What did you find?"
LISTED: Final = "You have no background subagents."
NO_SUCH_SESSION: Final = "no such session in this agent's run journal"


# -- end to end: serve killed, serve again on the same journal -----------------------------------------


def model_script() -> list[StreamedReply]:
    """The first prompt: a tool call, then an answer; the second prompt: an answer."""
    return [
        StreamedReply(tool_calls=[ToolCallReply(id="call-1", name="subagent_list", arguments="{}")]),
        StreamedReply(text="Hello: none are running."),
        StreamedReply(text="Nothing more: no subagents ran."),
    ]


FIRST_TURN_MESSAGES: Final = [
    {"role": "system", "content": PERSONA},
    {"role": "user", "content": FIRST_PROMPT},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "subagent_list", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "call-1", "content": LISTED},
    {"role": "assistant", "content": "Hello: none are running."},
]
"""The conversation after the first prompt, as the model is sent it."""


def serve_command(base_url: str, journal: Path) -> list[str]:
    return [*SERVE, "--base-url", base_url, "--model", "stub-model", "--journal", str(journal)]


async def kill(client: AcpClient) -> None:
    """SIGKILL the agent's process (no chance to close anything), and wait for its end."""
    process = client.process
    assert process is not None
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    await process.wait_exit()


async def first_life(command: list[str], cwd: Path) -> str:
    """Serve, open a session, run the first prompt, then SIGKILL the server: the session's id."""
    async with spawn_agent(command) as client:
        with anyio.fail_after(PROCESS_WAIT):
            await client.initialize()
            session = await client.new_session(cwd)
            result = await session.prompt(FIRST_PROMPT)
            assert (result.stop_reason, result.output) == ("end_turn", "Hello: none are running.")
            await kill(client)
    return session.session_id


async def list_sessions(client: AcpClient, **params: Any) -> Any:
    with anyio.fail_after(PROCESS_WAIT):
        return json.loads(bytes(await client.connection.request(schema.SESSION_LIST, params)))


@pytest.mark.subprocess
async def test_a_session_resumed_after_serve_was_killed_goes_on_with_the_whole_conversation(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "runs.db"
    async with assert_no_leaks(), serve_chat_completions(model_script(), model="stub-model") as server:
        command = serve_command(server.base_url, journal)
        session_id = await first_life(command, tmp_path)
        async with spawn_agent(command) as client:
            with anyio.fail_after(PROCESS_WAIT):
                agent = await client.initialize()
                listed = await list_sessions(client)
                session = await client.resume_session(session_id, tmp_path)
                result = await session.prompt(SECOND_PROMPT)
    assert agent.agent_capabilities.load_session is True
    assert agent.agent_capabilities.session_capabilities.resume is not None
    assert agent.agent_capabilities.session_capabilities.list is not None
    [info] = listed["sessions"]
    assert info.keys() == {"sessionId", "cwd", "title", "updatedAt"}
    assert (info["sessionId"], info["cwd"], info["title"]) == (session_id, str(tmp_path), FIRST_PROMPT)
    assert info["updatedAt"].endswith("Z")
    assert "nextCursor" not in listed
    assert list(session.replayed) == []  # resumed, not loaded: nothing replayed
    assert (result.stop_reason, result.output) == ("end_turn", "Nothing more: no subagents ran.")
    assert len(server.requests) == 3
    assert server.requests[2].json["messages"] == [
        *FIRST_TURN_MESSAGES,
        {"role": "user", "content": SECOND_PROMPT},
    ]
    with RunJournal.open(journal) as runs:
        record = runs.get(session_id.removeprefix("session-"))
    assert record is not None
    assert (record.provider, record.state, record.stop_reason, record.turns, record.resumes) == (
        "serve",
        "ended",
        "completed",
        2,
        1,
    )
    assert (record.prompt, record.turn_prompt, record.output) == (
        FIRST_PROMPT,
        SECOND_PROMPT,
        "Nothing more: no subagents ran.",
    )
    assert [item.state for item in record.transitions] == [
        "starting",
        "running",
        "ended",
        "resumed",
        "running",
        "ended",
    ]


@pytest.mark.subprocess
async def test_a_session_loaded_after_serve_was_killed_is_replayed_then_goes_on(tmp_path: Path) -> None:
    journal = tmp_path / "runs.db"
    async with assert_no_leaks(), serve_chat_completions(model_script(), model="stub-model") as server:
        command = serve_command(server.base_url, journal)
        session_id = await first_life(command, tmp_path)
        async with spawn_agent(command) as client:
            with anyio.fail_after(PROCESS_WAIT):
                await client.initialize()
                session = await client.load_session(session_id, tmp_path)
                result = await session.prompt(SECOND_PROMPT)
    assert [schema.encode(update) for update in session.replayed] == [
        schema.encode(update)
        for update in [
            schema.UserMessageChunk(content=schema.TextContent(text=FIRST_PROMPT), message_id="message-1"),
            schema.ToolCall(
                tool_call_id="call-1", title="subagent_list", kind="other", status="in_progress", raw_input={}
            ),
            schema.ToolCallProgress(
                tool_call_id="call-1",
                status="completed",
                content=[schema.Content(content=schema.TextContent(text=LISTED))],
            ),
            schema.AgentMessageChunk(
                content=schema.TextContent(text="Hello: none are running."), message_id="message-4"
            ),
        ]
    ]
    assert (result.stop_reason, result.output) == ("end_turn", "Nothing more: no subagents ran.")
    assert server.requests[2].json["messages"] == [
        *FIRST_TURN_MESSAGES,
        {"role": "user", "content": SECOND_PROMPT},
    ]


@pytest.mark.subprocess
async def test_a_serve_killed_during_a_prompt_leaves_the_session_interrupted_and_resumable_from_before_it(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "runs.db"
    script = [
        StreamedReply(text="First answer."),
        # Its role chunk and first text, then the model hangs: serve is killed meanwhile.
        StreamedReply(text="Never finished.", stall_after=2),
        StreamedReply(text="Third answer."),
    ]
    async with assert_no_leaks(), serve_chat_completions(script, model="stub-model") as server:
        command = serve_command(server.base_url, journal)
        answering = anyio.Event()
        cut_short: list[BaseException] = []

        async def prompt_cut_short(session: AcpSession) -> None:
            try:
                await session.prompt("two, which is cut short")
            except AgentExitedError as exc:
                cut_short.append(exc)

        async with spawn_agent(command) as client:
            with anyio.fail_after(PROCESS_WAIT):
                await client.initialize()
                session = await client.new_session(tmp_path)
                await session.prompt("one")
                session.on_update(
                    lambda update: answering.set() if isinstance(update, schema.AgentMessageChunk) else None
                )
                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(prompt_cut_short, session)
                    await answering.wait()  # the second prompt is in the model's hands
                    await kill(client)
        async with spawn_agent(command) as client:
            with anyio.fail_after(PROCESS_WAIT):
                await client.initialize()
                resumed = await client.resume_session(session.session_id, tmp_path)
                result = await resumed.prompt("three")
    assert [type(exc) for exc in cut_short] == [AgentExitedError]
    assert result.output == "Third answer."
    # The prompt that was cut short is not in the conversation; the one answered before it is.
    assert server.requests[2].json["messages"] == [
        {"role": "system", "content": PERSONA},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "three"},
    ]
    with RunJournal.open(journal) as runs:
        record = runs.get(session.session_id.removeprefix("session-"))
    assert record is not None
    states = [item.state for item in record.transitions]
    assert states == ["starting", "running", "ended", "running", "interrupted", "resumed", "running", "ended"]
    assert (record.state, record.turns, record.turn_prompt) == ("ended", 2, "three")


@pytest.mark.subprocess
async def test_a_session_resumed_after_serve_was_killed_while_its_child_worked_is_told_the_child_was_lost(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "runs.db"
    delegation = json.dumps({"provider": "spawn", "prompt": "Count to three.", "background": True})
    child_asked = anyio.Event()

    def model(request: ReceivedRequest) -> StreamedReply:
        # By what is asked, not in arrival order: the child and its parent call the model concurrently.
        messages = request.json["messages"]
        if messages[0] == {"role": "user", "content": "Count to three."}:
            child_asked.set()
            return StreamedReply(text="One,", stall_after=2)  # the child works on until serve is killed
        last = messages[-1]
        if last == {"role": "user", "content": "Start a child."}:
            return StreamedReply(
                tool_calls=[ToolCallReply(id="call-1", name="subagent", arguments=delegation)]
            )
        if last["role"] == "tool":
            return StreamedReply(text="Started it.")
        return StreamedReply(text="It was lost; I will count myself.")

    async with assert_no_leaks(), serve_chat_completions(model="stub-model", responder=model) as server:
        command = serve_command(server.base_url, journal)
        first_turn_ended = anyio.Event()

        def on_update(update: schema.SessionUpdate) -> None:
            marker = (
                (update.meta or {}).get(TURN_META_KEY)
                if isinstance(update, schema.SessionInfoUpdate)
                else None
            )
            if marker == {"turn": 1, "state": "ended", "stopReason": "completed"}:
                first_turn_ended.set()

        async def prompt_cut_short(session: AcpSession) -> None:
            with contextlib.suppress(AgentExitedError):
                await session.prompt("Start a child.")

        async with spawn_agent(command) as client:
            with anyio.fail_after(PROCESS_WAIT):
                await client.initialize()
                session = await client.new_session(tmp_path)
                session.on_update(on_update)
                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(prompt_cut_short, session)
                    # The prompt waits for its child: its first turn is kept, the child works on.
                    await first_turn_ended.wait()
                    await child_asked.wait()
                    await kill(client)
        async with spawn_agent(command) as client:
            with anyio.fail_after(PROCESS_WAIT):
                await client.initialize()
                resumed = await client.resume_session(session.session_id, tmp_path)
                result = await resumed.prompt("And now?")
    assert result.output == "It was lost; I will count myself."
    with RunJournal.open(journal) as runs:
        [child] = runs.runs(provider="spawn")
    assert (child.state, child.parent_id, child.prompt) == (
        "interrupted",
        session.session_id,
        "Count to three.",
    )
    [started] = [message for message in server.requests[-1].json["messages"] if message["role"] == "tool"]
    handle = started["content"].split()[3]  # "Started background subagent <handle> (spawn); ..."
    assert server.requests[-1].json["messages"] == [
        {"role": "system", "content": PERSONA},
        {"role": "user", "content": "Start a child."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "subagent", "arguments": delegation},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call-1",
            "content": f"Started background subagent {handle} (spawn); it is running. Its result will reach "
            "you as a notice when it ends; meanwhile, go on with other work. `subagent_wait` waits for it, "
            "`subagent_send` sends it a message, `subagent_cancel` stops it.",
        },
        {"role": "assistant", "content": "Started it."},
        {
            "role": "user",
            "content": f"[background subagent run-{child.id} (spawn) failed]\nTask: Count to three.\n\n"
            "Error: interrupted: the process that ran this subagent stopped before it finished (journal run "
            f"{child.id}). Resume it with `subagent resume {child.id}`, or start it again.\n"
            f"[end of background subagent run-{child.id}]",
        },
        {"role": "user", "content": "And now?"},
    ]


@pytest.mark.subprocess
async def test_the_acp_provider_resumes_a_run_of_subagent_serve_whose_session_goes_on(tmp_path: Path) -> None:
    # Durable at both ends: the parent's service journals its acp run, serve journals the session; a
    # resume of the run starts serve again, which reopens the session with the whole conversation.
    script = [StreamedReply(text="Noted: the colour is teal."), StreamedReply(text="It was teal.")]
    async with assert_no_leaks(), serve_chat_completions(script, model="stub-model") as server:
        provider = AcpProvider(serve_command(server.base_url, tmp_path / "served.db"), cwd=tmp_path)
        async with SubagentService(journal=tmp_path / "parent.db") as service:
            service.register_provider(provider)
            with anyio.fail_after(PROCESS_WAIT):
                async with service.start(provider.name, SubagentRequest(prompt="Remember: teal.")) as run:
                    first = await run.result()
                assert run.journal_id is not None
                async with await service.resume(run.journal_id, "Which colour?") as resumed:
                    second = await resumed.result()
                    reopened = resumed.provider_run
                    assert isinstance(reopened, AcpRun)
    assert (first.output, second.output) == ("Noted: the colour is teal.", "It was teal.")
    assert reopened.replayed == []  # serve offers session/resume: nothing replayed
    assert server.requests[1].json["messages"] == [
        {"role": "system", "content": PERSONA},
        {"role": "user", "content": "Remember: teal."},
        {"role": "assistant", "content": "Noted: the colour is teal."},
        {"role": "user", "content": "Which colour?"},
    ]


@pytest.mark.subprocess
async def test_a_session_whose_prompt_runs_in_another_live_serve_is_refused_with_invalid_params(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "runs.db"
    script = [StreamedReply(text="Working on it.", stall_after=2)]  # holds the prompt until it is cancelled
    async with assert_no_leaks(), serve_chat_completions(script, model="stub-model") as server:
        command = serve_command(server.base_url, journal)
        answering = anyio.Event()
        async with spawn_agent(command) as first, spawn_agent(command) as second:
            with anyio.fail_after(PROCESS_WAIT):
                await first.initialize()
                await second.initialize()
                session = await first.new_session(tmp_path)
                session.on_update(
                    lambda update: answering.set() if isinstance(update, schema.AgentMessageChunk) else None
                )
                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(session.prompt, "a long task")
                    await answering.wait()
                    with pytest.raises(RequestError) as caught:
                        await second.resume_session(session.session_id, tmp_path)
                    await session.cancel()
                assert first.process is not None
                owner = first.process.pid
    assert caught.value.to_wire() == {
        "code": -32602,
        "message": "Invalid params",
        "data": {
            "sessionId": session.session_id,
            "reason": f"the session is running in process {owner}, which is alive: one process at a time "
            "serves a session",
        },
    }


# -- in memory -----------------------------------------------------------------------------------------


@asynccontextmanager
async def served(llm: ScriptedLlm, **options: Any) -> AsyncIterator[tuple[ServedAgent, AcpClient]]:
    """A `ServedAgent` behind an `AgentSideConnection`, and an initialized `AcpClient` talking to it."""
    to_agent_send, to_agent_receive = anyio.create_memory_object_stream[bytes](math.inf)
    to_client_send, to_client_receive = anyio.create_memory_object_stream[bytes](math.inf)
    with to_agent_send, to_agent_receive, to_client_send, to_client_receive:
        async with (
            ServedAgent(llm, **options) as handler,
            AgentSideConnection(
                handler, MemoryByteReceiveStream(to_agent_receive), MemoryByteSendStream(to_client_send)
            ),
            AcpClient(
                MemoryByteReceiveStream(to_client_receive), MemoryByteSendStream(to_agent_send)
            ) as client,
        ):
            with anyio.fail_after(WAIT):
                await client.initialize()
            yield handler, client


async def request_error(client: AcpClient, method: str, params: dict[str, Any]) -> dict[str, Any]:
    """The error object the agent answers ``method`` with (the request must fail)."""
    with pytest.raises(RequestError) as caught, anyio.fail_after(WAIT):
        await client.connection.request(method, params)
    return caught.value.to_wire()


async def test_without_a_journal_serve_offers_no_load_resume_or_list_and_answers_them_method_not_found(
    tmp_path: Path,
) -> None:
    async with served(ScriptedLlm(["hi"])) as (handler, client):
        assert client.agent is not None
        capabilities = client.agent.agent_capabilities
        assert capabilities.load_session is False
        assert (capabilities.session_capabilities.resume, capabilities.session_capabilities.list) == (
            None,
            None,
        )
        assert capabilities.session_capabilities.close is not None
        reopen = {"sessionId": "session-0000abcd", "cwd": str(tmp_path), "mcpServers": []}
        errors = [
            await request_error(client, schema.SESSION_LOAD, reopen),
            await request_error(client, schema.SESSION_RESUME, reopen),
            await request_error(client, schema.SESSION_LIST, {}),
        ]
    assert handler.journal is None
    assert errors == [
        {"code": -32601, "message": "Method not found", "data": {"method": method}}
        for method in (schema.SESSION_LOAD, schema.SESSION_RESUME, schema.SESSION_LIST)
    ]


async def test_session_list_pages_the_journaled_sessions_newest_first_and_filters_by_cwd(
    tmp_path: Path,
) -> None:
    here, there = tmp_path / "here", tmp_path / "there"
    prompts = ["first here", "then there", "again here\nwith a second line", "last here"]
    async with served(ScriptedLlm(["ok"] * 5), journal=tmp_path / "runs.db", list_page_size=2) as (_, client):
        with anyio.fail_after(WAIT):
            ids = []
            for prompt in prompts:
                session = await client.new_session(there if prompt == "then there" else here)
                await session.prompt(prompt)
                ids.append(session.session_id)
            await client.new_session(here)  # never prompted: nothing to reopen, so not listed
            first = await client.connection.request(schema.SESSION_LIST, {"cwd": str(here)})
            first_page = json.loads(bytes(first))
            second = await client.connection.request(
                schema.SESSION_LIST, {"cwd": str(here), "cursor": first_page["nextCursor"]}
            )
            everything = await client.connection.request(schema.SESSION_LIST, {})
    second_page = json.loads(bytes(second))

    def shown(page: dict[str, Any]) -> list[tuple[str, str, str]]:
        return [(item["sessionId"], item["cwd"], item["title"]) for item in page["sessions"]]

    assert shown(first_page) == [
        (ids[3], str(here), "last here"),
        (ids[2], str(here), "again here with a second line"),
    ]
    assert first_page["nextCursor"] == ids[2].removeprefix("session-")
    assert shown(second_page) == [(ids[0], str(here), "first here")]
    assert "nextCursor" not in second_page
    assert [item["sessionId"] for item in json.loads(bytes(everything))["sessions"]] == [ids[3], ids[2]]


async def test_session_list_refuses_a_cursor_it_did_not_give_and_a_relative_cwd(tmp_path: Path) -> None:
    async with served(ScriptedLlm([]), journal=tmp_path / "runs.db") as (_, client):
        cursor = await request_error(client, schema.SESSION_LIST, {"cursor": "nope"})
        relative = await request_error(client, schema.SESSION_LIST, {"cwd": "relative/dir"})
    assert cursor == {
        "code": -32602,
        "message": "Invalid params",
        "data": {"cursor": "nope", "reason": "not a cursor of this agent's session/list"},
    }
    assert relative == {
        "code": -32602,
        "message": "Invalid params",
        "data": {"cwd": "relative/dir", "reason": "cwd must be an absolute path"},
    }


async def test_an_unknown_session_is_refused_with_resource_not_found_by_load_and_resume(
    tmp_path: Path,
) -> None:
    journal_file = tmp_path / "runs.db"
    with RunJournal.open(journal_file) as journal:
        # A run of the journal that is not a served session (a `subagent run` child, say).
        journal.record_start(
            "abcd1234",
            run_id="acp-1",
            provider="acp",
            parent=None,
            parent_id=None,
            prompt="not a session",
            request={"cwd": str(tmp_path)},
            agent=None,
        )
    async with served(ScriptedLlm(["ok"]), journal=journal_file) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            await session.prompt("a real session")
        prefix = session.session_id[: len("session-") + 4]  # a prefix of a real one names nothing
        errors = {
            (method, session_id): await request_error(
                client, method, {"sessionId": session_id, "cwd": str(tmp_path), "mcpServers": []}
            )
            for method in (schema.SESSION_LOAD, schema.SESSION_RESUME)
            for session_id in ("session-deadbeef", "session-abcd1234", "abcd1234", prefix)
        }
    assert errors == {
        key: {
            "code": -32002,
            "message": "Resource not found",
            "data": {"sessionId": key[1], "reason": NO_SUCH_SESSION},
        }
        for key in errors
    }


async def test_a_session_open_in_this_server_is_resumed_as_it_is_and_loaded_with_its_replay(
    tmp_path: Path,
) -> None:
    llm = ScriptedLlm([Reply(tool_calls=[call("nowhere", {"x": 1}, id="c1")]), "done", "again"])
    async with served(llm, journal=tmp_path / "runs.db") as (handler, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            await session.prompt("go")
            agent = handler.sessions[session.session_id].agent
            await client.resume_session(session.session_id, tmp_path)
            loaded = await client.load_session(session.session_id, tmp_path)
            result = await loaded.prompt("more")
    assert handler.sessions == {}
    assert result.output == "again"
    assert llm.requests[-1].messages[1:] == agent.messages[1:-1]  # the same agent went on
    assert [schema.encode(update) for update in loaded.replayed] == [
        schema.encode(update)
        for update in [
            schema.UserMessageChunk(content=schema.TextContent(text="go"), message_id="message-1"),
            schema.ToolCall(
                tool_call_id="c1", title="nowhere", kind="other", status="in_progress", raw_input={"x": 1}
            ),
            schema.ToolCallProgress(
                tool_call_id="c1",
                status="failed",
                content=[schema.Content(content=schema.TextContent(text=agent.messages[3].content))],
            ),
            schema.AgentMessageChunk(content=schema.TextContent(text="done"), message_id="message-4"),
        ]
    ]
    assert agent.messages[3].content.startswith("error: there is no tool named 'nowhere'")


async def test_a_session_reopened_and_closed_without_a_prompt_is_given_back_as_it_was(tmp_path: Path) -> None:
    journal_file = tmp_path / "runs.db"
    async with served(ScriptedLlm(["one"]), journal=journal_file) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            await session.prompt("go")
    async with served(ScriptedLlm([]), journal=journal_file) as (handler, client):
        with anyio.fail_after(WAIT):
            await client.resume_session(session.session_id, tmp_path)
            journal = handler.journal
            assert journal is not None
            claimed = journal.get(session.session_id.removeprefix("session-"))
    with RunJournal.open(journal_file) as runs:
        record = runs.get(session.session_id.removeprefix("session-"))
    assert claimed is not None
    assert claimed.state == "starting"  # taken over while open here
    assert record is not None
    # Not counted as a resume. (The claim cleared its stop reason; release_claim gives back the state.)
    assert (record.state, record.output, record.turns, record.resumes) == ("ended", "one", 1, 0)
    assert [(item.state, item.detail) for item in record.transitions][-2:] == [
        ("resumed", f"by pid {os.getpid()}"),
        ("ended", "reopened, and closed without a prompt"),
    ]


async def test_a_journaled_session_records_each_prompt_with_the_log_it_left(tmp_path: Path) -> None:
    journal_file = tmp_path / "runs.db"
    async with served(ScriptedLlm(["one", "two"]), journal=journal_file, persona="Be brief.") as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            await session.prompt("first")
            await session.prompt("second")
    with RunJournal.open(journal_file) as runs:
        record = runs.get(session.session_id.removeprefix("session-"))
    assert record is not None
    assert (record.run_id, record.session_id, record.parent, record.parent_id) == (
        session.session_id,
        session.session_id,
        None,
        None,
    )
    assert (record.request, record.agent) == (
        {"cwd": str(tmp_path)},
        {"kind": "serve", "name": "subagent-seam"},
    )
    assert record.checkpoint == {
        "sessionId": session.session_id,
        "cwd": str(tmp_path),
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "one"},
            {"role": "user", "content": "second"},
            {"role": "assistant", "content": "two"},
        ],
    }


async def test_a_malformed_checkpoint_is_refused_with_an_internal_error_saying_where(tmp_path: Path) -> None:
    journal_file = tmp_path / "runs.db"
    async with served(ScriptedLlm(["one"]), journal=journal_file) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            await session.prompt("go")
    journal_id = session.session_id.removeprefix("session-")
    with sqlite3.connect(journal_file) as database:
        database.execute(
            "UPDATE runs SET checkpoint = ? WHERE id = ?",
            (json.dumps({"messages": [{"role": "x"}]}), journal_id),
        )
    database.close()
    async with served(ScriptedLlm([]), journal=journal_file) as (_, client):
        error = await request_error(
            client, schema.SESSION_RESUME, {"sessionId": session.session_id, "cwd": str(tmp_path)}
        )
    assert error == {
        "code": -32603,
        "message": "Internal error",
        "data": {
            "sessionId": session.session_id,
            "details": "its checkpoint in the run journal is malformed: messages[0].role must be one of "
            "'system', 'user', 'assistant', 'tool', not 'x'",
        },
    }


# -- the command line -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "off", "environment", "expected"),
    [
        ("/j/runs.db", False, "/elsewhere.db", Path("/j/runs.db")),
        ("runs.db", False, None, Path.cwd() / "runs.db"),
        (None, True, "/elsewhere.db", None),
        (None, False, "/from/env.db", Path("/from/env.db")),
        (None, False, " OFF ", None),
        (None, False, None, "default"),
        (None, False, "", "default"),
    ],
)
def test_serve_takes_its_journal_from_the_flags_then_the_environment_then_the_default(
    monkeypatch: pytest.MonkeyPatch,
    option: str | None,
    off: bool,
    environment: str | None,
    expected: Path | str | None,
) -> None:
    if environment is None:
        monkeypatch.delenv(JOURNAL_ENV, raising=False)
    else:
        monkeypatch.setenv(JOURNAL_ENV, environment)
    assert journal_path(option, off=off) == (default_journal_path() if expected == "default" else expected)


def test_serve_refuses_both_journal_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--script", "x.json", "--journal", "j.db", "--no-journal"]) == 2
    assert (
        "subagent serve: error: give either --journal PATH or --no-journal, not both"
        in capsys.readouterr().err
    )


@pytest.mark.subprocess
async def test_serve_keeps_its_sessions_in_the_journal_the_environment_names_and_none_with_no_journal(
    tmp_path: Path,
) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(["Hello."]))
    journal = tmp_path / "from-env.db"
    async with assert_no_leaks():
        async with spawn_agent([*SERVE, "--script", str(script)], env={JOURNAL_ENV: str(journal)}) as client:
            with anyio.fail_after(PROCESS_WAIT):
                durable = await client.initialize()
                session = await client.new_session(tmp_path)
                await session.prompt("Hi.")
        async with spawn_agent(
            [*SERVE, "--script", str(script), "--no-journal"], env={JOURNAL_ENV: str(journal)}
        ) as client:
            with anyio.fail_after(PROCESS_WAIT):
                plain = await client.initialize()
    assert (durable.agent_capabilities.load_session, plain.agent_capabilities.load_session) == (True, False)
    assert plain.agent_capabilities.session_capabilities.resume is None
    with RunJournal.open(journal) as runs:
        [record] = runs.runs()
    assert (record.id, record.provider, record.prompt, record.output) == (
        session.session_id.removeprefix("session-"),
        "serve",
        "Hi.",
        "Hello.",
    )


def test_serve_refuses_a_file_that_is_not_a_journal_with_exit_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_a_journal = tmp_path / "notes.txt"
    not_a_journal.write_text("just some notes, long enough to be read as a database header\n" * 20)
    script = tmp_path / "script.json"
    script.write_text("[]")
    assert main(["serve", "--script", str(script), "--journal", str(not_a_journal)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"subagent serve: error: {str(not_a_journal)!r} is not a usable run journal" in captured.err
