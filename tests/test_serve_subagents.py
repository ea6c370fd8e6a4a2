"""`subagent serve` shows its runs as ACP subagent sessions to a client that advertised `subagents`.

The agent side of ACP's subagents draft (the unstable schema as shipped): each run below a served
session is announced with `subagent_update` on its parent's session before any of its traffic, its
own updates and questions go under its id, each of its runs ends in exactly one `idle` with its stop
reason and usage, a cancel reaches that child alone or cascades down from the parent, traffic for
ids that are no session is refused, and an acp child's own announced children are relayed one level
further down. Driven in memory through our own `AcpClient` (advertising `subagents`) on `ScriptedLlm`;
acp children are the stub agent. Every wait is bounded by `anyio.fail_after`, nothing sleeps.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import anyio
import pytest

from subagent import SubagentRequest, SubagentService
from subagent.acp import RequestError, schema
from subagent.acp.client import AcpClient, AcpSession, TurnResult
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.runtime import LlmError, LlmErrorKind, Reply, ScriptedLlm, When, call
from subagent.testing._scenario import dump_scenario
from subagent.types import Usage
from tests.test_agent_subagents import DELEGATING
from tests.test_interop import NODE, ROOT
from tests.test_serve import WAIT, note_tool, served
from tests.test_serve_tree import three_levels

pytestmark = pytest.mark.anyio

PROCESS_WAIT: Final = 30  # seconds: a bound on an exchange with a stub agent process

CHILD_USAGE: Final = Usage(input_tokens=7, output_tokens=3, total_tokens=10)
LEAF_USAGE: Final = Usage(input_tokens=4, output_tokens=1, total_tokens=5)


def notifications(transcript: Iterable[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """Every `session/update` the client received, as (its sessionId, its update object), in order."""
    found = []
    for chunk in transcript:
        for line in chunk.splitlines():
            message = json.loads(line)
            if message.get("method") == "session/update":
                found.append((message["params"]["sessionId"], message["params"]["update"]))
    return found


def requests(transcript: Iterable[bytes], method: str) -> list[dict[str, Any]]:
    """The params of every request ``method`` the client was sent."""
    return [
        message["params"]
        for chunk in transcript
        for line in chunk.splitlines()
        if (message := json.loads(line)).get("method") == method
    ]


def traffic(transcript: Iterable[bytes]) -> list[tuple[str, str, str | None]]:
    """Each update as (session, kind, what): a `subagent_update` names its child and its state, a tool
    call its id, a chunk its text; turn markers are left out."""
    shown = []
    for session_id, update in notifications(transcript):
        kind = update["sessionUpdate"]
        if kind == "subagent_update":
            state = update.get("state", {}).get("state")
            shown.append((session_id, f"subagent_update {update['sessionId']}", state))
        elif kind in ("tool_call", "tool_call_update"):
            shown.append((session_id, kind, update["toolCallId"]))
        elif kind == "agent_message_chunk":
            shown.append((session_id, kind, update["content"]["text"]))
    return shown


def snapshots(transcript: Iterable[bytes], child_id: str) -> list[dict[str, Any]]:
    """The `subagent_update` s for ``child_id``, whole."""
    return [
        update
        for _, update in notifications(transcript)
        if update["sessionUpdate"] == "subagent_update" and update["sessionId"] == child_id
    ]


def tree(client: AcpClient) -> list[tuple[str, str, int, str | None, str | None, int, str | None]]:
    """The client's subagent sessions: (id, parent, depth, title, state, runs, stop reason)."""
    return [
        (c.session_id, c.parent_session_id, c.depth, c.title, c.state_name, c.runs, c.stop_reason)
        for c in client.subagent_sessions.values()
    ]


def three_levels_with_usage() -> ScriptedLlm:
    return three_levels(leaf_usage=LEAF_USAGE, child_usage=CHILD_USAGE)


def delegating(prompt: str, task: str, id: str, provider: str = "spawn") -> Reply:
    """The reply to ``prompt`` (before any tool result): delegate ``task`` to ``provider``."""
    return Reply(
        tool_calls=[call("subagent", {"provider": provider, "prompt": task}, id=id)],
        when=When(last_user_contains=prompt, after_tool_result=False),
    )


async def test_each_run_is_announced_on_its_parents_session_before_any_of_its_traffic(tmp_path: Path) -> None:
    transcript: list[bytes] = []
    async with served(three_levels_with_usage(), transcript=transcript, subagents=True) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
    assert (turn.stop_reason, turn.output) == ("end_turn", "Done.")
    sid = session.session_id
    child, grandchild = client.subagent_sessions
    assert traffic(transcript) == [
        (sid, "tool_call", "call-1"),
        (sid, f"subagent_update {child}", "running"),
        (child, "tool_call", "call-2"),
        (child, f"subagent_update {grandchild}", "running"),
        (grandchild, "agent_message_chunk", "leaf "),
        (grandchild, "agent_message_chunk", "answer"),
        (child, f"subagent_update {grandchild}", "idle"),
        (child, "tool_call_update", "call-2"),
        (child, "agent_message_chunk", "child "),
        (child, "agent_message_chunk", "answer"),
        (sid, f"subagent_update {child}", "idle"),
        (sid, "tool_call_update", "call-1"),
        (sid, "agent_message_chunk", "Done."),
    ]
    assert snapshots(transcript, grandchild)[0] == {
        "sessionUpdate": "subagent_update",
        "sessionId": grandchild,
        "title": "spawn subagent: grandchild task",
        "description": "grandchild task",
        "capabilities": {"cancel": {}},
        "state": {"state": "running"},
        "cwd": str(tmp_path),
        "_meta": {"subagent-seam/run": {"provider": "spawn"}},
    }


async def test_each_run_of_a_child_ends_in_exactly_one_idle_with_its_stop_reason_and_usage(
    tmp_path: Path,
) -> None:
    transcript: list[bytes] = []
    async with served(three_levels_with_usage(), transcript=transcript, subagents=True) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            await session.prompt("go")
    sid = session.session_id
    child, grandchild = client.subagent_sessions
    for child_id, usage in ((child, CHILD_USAGE), (grandchild, LEAF_USAGE)):
        counts = {
            "inputTokens": usage.input_tokens,
            "outputTokens": usage.output_tokens,
            "totalTokens": usage.total_tokens,
        }
        assert snapshots(transcript, child_id)[1:] == [
            {
                "sessionUpdate": "subagent_update",
                "sessionId": child_id,
                "capabilities": {},  # no cancel once idle
                "state": {"state": "idle", "stopReason": "end_turn", "usage": counts},
                # Also in our rows' form: ACP's needs both counts (test_trace_page has a child with one).
                "_meta": {"subagent-seam/run": {"provider": "spawn", "usage": counts}},
            }
        ]
    assert tree(client) == [
        (child, sid, 1, "spawn subagent: child task", "idle", 1, "end_turn"),
        (grandchild, child, 2, "spawn subagent: grandchild task", "idle", 1, "end_turn"),
    ]
    assert client.subagent_sessions[child].usage == {"inputTokens": 7, "outputTokens": 3, "totalTokens": 10}


async def test_a_failed_child_ends_idle_with_stop_reason_error_and_why(tmp_path: Path) -> None:
    llm = ScriptedLlm(
        [
            delegating("go", "child task", "call-1"),
            Reply(
                error=LlmError(LlmErrorKind.SERVER, "the model server is down"),
                when=When(last_user_contains="child task"),
            ),
            Reply("The child failed.", when=When(last_user_contains="go", after_tool_result=True)),
        ]
    )
    transcript: list[bytes] = []
    async with served(llm, transcript=transcript, subagents=True) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
    (child,) = client.subagent_sessions
    assert turn.stop_reason == "end_turn"
    idle = snapshots(transcript, child)[-1]["state"]
    assert (idle["state"], idle["stopReason"], idle["error"]["code"]) == ("idle", "error", -32603)
    assert "the model server is down" in idle["error"]["message"]
    assert [update["state"]["state"] for update in snapshots(transcript, child)] == ["running", "idle"]


async def test_a_childs_question_is_asked_under_its_id_with_the_child_in_requires_action(
    tmp_path: Path,
) -> None:
    notes: list[dict[str, Any]] = []
    llm = ScriptedLlm(
        [
            delegating("go", "child task", "call-1"),
            Reply(
                tool_calls=[call("write_note", {"text": "hi"}, id="note-1")],
                when=When(last_user_contains="child task", after_tool_result=False),
            ),
            Reply("noted", when=When(last_user_contains="child task", after_tool_result=True)),
            Reply("Done.", when=When(last_user_contains="go", after_tool_result=True)),
        ]
    )
    transcript: list[bytes] = []
    async with served(
        llm, transcript=transcript, subagents=True, permission="allow", tools=[note_tool(notes)]
    ) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            await session.prompt("go")
    (child,) = client.subagent_sessions
    sid = session.session_id
    assert notes == [{"text": "hi"}]
    assert traffic(transcript)[1:7] == [
        (sid, f"subagent_update {child}", "running"),
        (sid, f"subagent_update {child}", "requires_action"),
        (child, "tool_call", "note-1"),
        (sid, f"subagent_update {child}", "running"),
        (child, "tool_call_update", "note-1"),
        (child, "tool_call_update", "note-1"),
    ]
    (question,) = requests(transcript, "session/request_permission")
    assert (question["sessionId"], question["toolCall"]["toolCallId"]) == (child, "note-1")


def holding(reached: anyio.Event, prompt: str) -> Reply:
    """A reply to ``prompt`` that never comes: its model call waits until cancelled."""

    async def hold() -> None:
        reached.set()
        await anyio.sleep_forever()

    return Reply("never", wait=hold, when=When(last_user_contains=prompt))


@pytest.mark.both_backends
async def test_a_cancel_aimed_at_one_child_stops_it_alone_and_the_parent_goes_on(tmp_path: Path) -> None:
    reached = anyio.Event()
    llm = ScriptedLlm(
        [
            delegating("go", "child task", "call-1"),
            holding(reached, "child task"),
            Reply("Went on.", when=When(last_user_contains="go", after_tool_result=True)),
        ]
    )
    turn, transcript, (child,), _ = await cancelled_while_held(tmp_path, llm, reached, 1, of_session=False)
    assert (turn.stop_reason, turn.output) == ("end_turn", "Went on.")
    assert [update["state"] for update in snapshots(transcript, child)] == [
        {"state": "running"},
        {"state": "idle", "stopReason": "cancelled"},
    ]


@pytest.mark.both_backends
async def test_a_cancel_of_the_session_cascades_down_the_whole_tree(tmp_path: Path) -> None:
    reached = anyio.Event()
    llm = ScriptedLlm(
        [
            delegating("go", "child task", "call-1"),
            delegating("child task", "grandchild task", "call-2"),
            holding(reached, "grandchild task"),
        ]
    )
    turn, transcript, (child, grandchild), client = await cancelled_while_held(
        tmp_path, llm, reached, 2, of_session=True
    )
    assert turn.stop_reason == "cancelled"
    for child_id in (child, grandchild):
        assert [update["state"] for update in snapshots(transcript, child_id)] == [
            {"state": "running"},
            {"state": "idle", "stopReason": "cancelled"},
        ]
    assert [(c.state_name, c.runs, c.stop_reason) for c in client.subagent_sessions.values()] == [
        ("idle", 1, "cancelled"),
        ("idle", 1, "cancelled"),
    ]


async def test_requests_for_a_child_or_an_unknown_session_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with served(three_levels(), subagents=True) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            await session.prompt("go")
            child, _ = client.subagent_sessions
            refusals = []
            for target in (child, "no-such-session"):
                with pytest.raises(RequestError) as refused:
                    await client.connection.request(
                        schema.SESSION_PROMPT,
                        {"sessionId": target, "prompt": [{"type": "text", "text": "hi"}]},
                    )
                refusals.append((refused.value.code, refused.value.data))
            with caplog.at_level(logging.WARNING, logger="subagent.serve"):
                await client.connection.notify(schema.SESSION_CANCEL, {"sessionId": "no-such-session"})
                # Answered only after the notification before it was handled.
                await client.connection.request(schema.SESSION_CLOSE, {"sessionId": session.session_id})
    assert refusals == [
        (
            -32602,
            {
                "sessionId": child,
                "reason": f"a subagent session of {session.session_id}: "
                "its client may cancel it, nothing more",
            },
        ),
        (-32602, {"sessionId": "no-such-session", "reason": "unknown session"}),
    ]
    ignored = "ignoring session/cancel for 'no-such-session': no such session or subagent session"
    assert ignored in caplog.messages


async def test_nothing_is_announced_to_a_client_without_the_capability(tmp_path: Path) -> None:
    transcript: list[bytes] = []
    async with served(three_levels(), transcript=transcript) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            await session.prompt("go")
    updates = notifications(transcript)
    assert {session_id for session_id, _ in updates} == {session.session_id}
    assert "subagent_update" not in {update["sessionUpdate"] for _, update in updates}
    # The runs are tool calls of the session, as ever.
    runs = [update["toolCallId"] for _, update in updates if update["sessionUpdate"] == "tool_call"]
    assert [call_id.startswith("run/") for call_id in runs] == [False, True, False, True]
    assert client.subagent_sessions == {}


async def test_a_delegation_past_the_sessions_limit_of_subagent_sessions_is_refused(tmp_path: Path) -> None:
    llm = ScriptedLlm(
        [
            delegating("go", "first task", "call-1"),
            Reply("first answer", when=When(last_user_contains="first task")),
            Reply(
                tool_calls=[call("subagent", {"provider": "spawn", "prompt": "second task"}, id="call-2")],
                when=When(last_user_contains="go", after_tool_result=True),
            ),
            Reply("Done.", when=When(last_user_contains="go", after_tool_result=True)),
        ]
    )
    transcript: list[bytes] = []
    async with served(llm, transcript=transcript, subagents=True, max_subagent_sessions=1) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
    assert turn.output == "Done."
    assert len(client.subagent_sessions) == 1
    (refusal,) = [
        update
        for _, update in notifications(transcript)
        if update.get("toolCallId") == "call-2" and update["sessionUpdate"] == "tool_call_update"
    ]
    assert refusal["status"] == "failed"
    assert refusal["content"][0]["content"]["text"] == (
        "error: this session has shown its client 1 subagent sessions, the most it may: no more "
        "subagents can be started in it"
    )


# -- acp children ---------------------------------------------------------------------------------------


def stub_provider(tmp_path: Path, scenario: dict[str, Any]) -> AcpProvider:
    path = tmp_path / "child-scenario.json"
    path.write_text(dump_scenario(scenario))
    return AcpProvider(
        [sys.executable, "-m", "subagent.testing.stub_agent", "--scenario", str(path)],
        cwd=tmp_path,
        permission="allow",
    )


def delegating_to_acp() -> ScriptedLlm:
    return ScriptedLlm(
        [
            delegating("go", "explore", "call-1", provider="acp"),
            Reply("Done.", when=When(last_user_contains="go", after_tool_result=True)),
        ]
    )


async def test_an_acp_childs_own_children_are_relayed_one_level_further_down(tmp_path: Path) -> None:
    transcript: list[bytes] = []
    provider = stub_provider(tmp_path, DELEGATING)
    async with served(delegating_to_acp(), transcript=transcript, subagents=True, providers=[provider]) as (
        _,
        client,
    ):
        with anyio.fail_after(PROCESS_WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
    assert (turn.stop_reason, turn.output) == ("end_turn", "Done.")
    sid = session.session_id
    run = next(iter(client.subagent_sessions))
    assert tree(client) == [
        (run, sid, 1, "acp subagent: explore", "idle", 1, "end_turn"),
        (f"{run}/child-1", run, 2, "Explore", "idle", 1, "end_turn"),
        (f"{run}/grandchild-1", f"{run}/child-1", 3, "Deeper", "idle", 1, "end_turn"),
    ]
    usage = {"inputTokens": 10, "outputTokens": 2, "totalTokens": 12}
    assert client.subagent_sessions[f"{run}/grandchild-1"].usage == usage
    assert ((run, "agent_message_chunk", "Delegating.")) in traffic(transcript)
    # The acp child's own child's traffic goes out under the id it is relayed as, after its announcement.
    relayed = f"{run}/child-1"
    shown = traffic(transcript)
    announced = shown.index((run, f"subagent_update {relayed}", "running"))
    assert shown.index((relayed, "agent_message_chunk", "child at work")) > announced
    assert (relayed, "tool_call", "c-1") in shown


async def test_an_acp_child_lost_with_its_process_ends_idle_with_stop_reason_error(tmp_path: Path) -> None:
    scenario = {
        "turns": [
            [
                {
                    "step": "subagent",
                    "sessionId": "helper",
                    "steps": [{"step": "message", "text": "working"}],
                },
                {"step": "subagent", "sessionId": "doomed", "steps": [{"step": "exit", "code": 3}]},
            ]
        ]
    }
    transcript: list[bytes] = []
    async with served(
        delegating_to_acp(),
        transcript=transcript,
        subagents=True,
        providers=[stub_provider(tmp_path, scenario)],
    ) as (_, client):
        with anyio.fail_after(PROCESS_WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
    assert turn.output == "Done."
    run = next(iter(client.subagent_sessions))
    doomed = f"{run}/doomed"
    assert [(c.session_id, c.state_name, c.stop_reason) for c in client.subagent_sessions.values()] == [
        (run, "idle", "error"),
        (f"{run}/helper", "idle", "end_turn"),
        (doomed, "idle", "error"),
    ]
    lost = snapshots(transcript, doomed)[-1]["state"]
    assert lost["error"] == {
        "code": -32603,
        "message": f"lost: the agent of {run} ended before it reported this subagent's end",
    }
    assert "exit" in snapshots(transcript, run)[-1]["state"]["error"]["message"]


async def cancelled_while_held(
    tmp_path: Path, llm: ScriptedLlm, reached: anyio.Event, count: int, *, of_session: bool
) -> tuple[TurnResult, list[bytes], list[str], AcpClient]:
    """Prompt "go", and once the model call is held and ``count`` children are announced, cancel the
    session (``of_session``) or the last of them; the turn, the transcript, the children, the client."""
    transcript: list[bytes] = []
    turns: list[TurnResult] = []
    async with served(llm, transcript=transcript, subagents=True) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(lambda: _prompt(session, turns))
                await reached.wait()
                children = await _announced(client, count)
                target = session.session_id if of_session else children[-1]
                await client.connection.notify(schema.SESSION_CANCEL, {"sessionId": target})
    return turns[0], transcript, children, client


async def _prompt(session: AcpSession, turns: list[TurnResult]) -> None:
    turns.append(await session.prompt("go"))


async def _announced(client: AcpClient, count: int) -> list[str]:
    """The ids of the first ``count`` subagent sessions, once the client was told of them all."""
    enough = anyio.Event()

    def check(*_: object) -> None:
        if len(client.subagent_sessions) >= count:
            enough.set()

    dispose = client.on_subagent(check)
    try:
        check()
        await enough.wait()
    finally:
        dispose()
    return list(client.subagent_sessions)[:count]


# -- interop: our own client, through processes ------------------------------------------------------------


def serve_script(provider: str, task: str, *replies: dict[str, Any]) -> list[dict[str, Any]]:
    """A `subagent serve --script` that delegates ``task`` to ``provider`` on "go" (``replies`` answer
    the children), then answers "Done."."""
    delegation = {"name": "subagent", "arguments": {"provider": provider, "prompt": task}, "id": "call-1"}
    return [
        {"tool_calls": [delegation], "when": {"last_user_contains": "go", "after_tool_result": False}},
        *replies,
        {"text": "Done.", "when": {"last_user_contains": "go", "after_tool_result": True}},
    ]


@pytest.mark.subprocess
async def test_our_client_sees_a_three_level_tree_through_subagent_serve_and_its_acp_child(
    tmp_path: Path,
) -> None:
    child_scenario = tmp_path / "child.json"
    child_scenario.write_text(dump_scenario(DELEGATING))
    script = tmp_path / "serve.json"
    script.write_text(json.dumps(serve_script("acp", "explore")))
    stub = [sys.executable, "-m", "subagent.testing.stub_agent", "--scenario", str(child_scenario)]
    serve = [sys.executable, "-m", "subagent", "serve", "--script", str(script), "--acp", shlex.join(stub)]
    provider = AcpProvider(serve, cwd=tmp_path, permission="allow")
    async with SubagentService() as service:
        service.register_provider(provider)
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(PROCESS_WAIT):
                result = await run.result()
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
            served_session = acp_run.session_id
            children = acp_run.subagents
    assert (result.stop_reason, result.output) == ("completed", "Done.")
    usage = {"inputTokens": 10, "outputTokens": 2, "totalTokens": 12}
    assert [
        (c.session_id, c.parent_session_id, c.depth, c.title, c.state_name, c.runs, c.stop_reason, c.usage)
        for c in children
    ] == [
        ("acp-1", served_session, 1, "acp subagent: explore", "idle", 1, "end_turn", None),
        ("acp-1/child-1", "acp-1", 2, "Explore", "idle", 1, "end_turn", usage),
        ("acp-1/grandchild-1", "acp-1/child-1", 3, "Deeper", "idle", 1, "end_turn", usage),
    ]


# -- interop: the TypeScript SDK's client ----------------------------------------------------------------

SDK_ENTRY: Final = ROOT / ".interop" / "node_modules" / "@agentclientprotocol" / "sdk" / "dist" / "acp.js"
SDK_CLIENT: Final = ROOT / "fixtures" / "interop" / "sdk_subagents_client.mjs"


@pytest.mark.subprocess
async def test_the_typescript_sdks_client_sees_the_children_subagent_serve_announces(tmp_path: Path) -> None:
    if NODE is None or not SDK_ENTRY.is_file():
        reason = f"the TypeScript SDK is not installed (run `make interop`): {SDK_ENTRY}"
        if os.environ.get("SUBAGENT_REQUIRE_INTEROP"):
            pytest.fail(reason)
        pytest.skip(reason)
    script = tmp_path / "serve.json"
    child = {
        "text": "child answer",
        "usage": {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10},
        "when": {"last_user_contains": "child task"},
    }
    script.write_text(json.dumps(serve_script("spawn", "child task", child)))
    serve = [sys.executable, "-m", "subagent", "serve", "--script", str(script)]
    with anyio.fail_after(PROCESS_WAIT):
        done = await anyio.run_process(
            [NODE, str(SDK_CLIENT), str(SDK_ENTRY), str(tmp_path), "go", "--", *serve], check=False
        )
    assert done.returncode == 0, done.stderr.decode()
    seen = json.loads(done.stdout)
    sid = seen["sessionId"]
    assert seen["stopReason"] == "end_turn"
    updates = [(item["sessionId"], item["update"]) for item in seen["updates"]]
    announced = [update for _, update in updates if update["sessionUpdate"] == "subagent_update"]
    (child_id,) = {update["sessionId"] for update in announced}
    # The SDK parsed each one as the schema's SubagentUpdate (its zod schema drops what it does not know).
    assert [
        (session_id, update["sessionUpdate"], update.get("state", update.get("content")))
        for session_id, update in updates
        if session_id == child_id or update["sessionUpdate"] == "subagent_update"
    ] == [
        (sid, "subagent_update", {"state": "running"}),
        (child_id, "agent_message_chunk", {"type": "text", "text": "child "}),
        (child_id, "agent_message_chunk", {"type": "text", "text": "answer"}),
        (
            sid,
            "subagent_update",
            {
                "state": "idle",
                "stopReason": "end_turn",
                "usage": {"inputTokens": 7, "outputTokens": 3, "totalTokens": 10},
            },
        ),
    ]
    assert (announced[0]["title"], announced[0]["capabilities"]) == (
        "spawn subagent: child task",
        {"cancel": {}},
    )
