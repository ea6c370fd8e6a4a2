"""The client side of ACP's subagents draft, in memory: a scripted agent announces child sessions.

Each MUST of the draft and the schema that binds the client has a test here: a child exists only once
announced (traffic for an id nobody announced is refused), a child's parent never changes, each run
of a child ends in one ``idle`` as the client counts it, a cancel reaches only the child it names and
only where the agent permits it, and a child's questions and file requests meet the same policy and
sandbox as the session's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent.acp import AgentCapabilityError, RequestError
from subagent.acp import schema_unstable as unstable
from subagent.acp._subagents import SubagentSession
from subagent.acp.client import AcpClient
from subagent.acp.handlers import FsSandbox, PermissionQuestion
from subagent.acp.schema import Error
from tests.test_client import FakeAgent, connected, ready_session, text_chunk

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

UNKNOWN_SESSION = {
    "code": -32602,
    "message": "Invalid params",
    "data": {"sessionId": "c9", "reason": "unknown session"},
}


def announce(child: str = "c1", **fields: Any) -> dict[str, Any]:
    return {"sessionUpdate": "subagent_update", "sessionId": child, **fields}


def idle(stop_reason: str = "end_turn", **fields: Any) -> dict[str, Any]:
    return {"state": {"state": "idle", "stopReason": stop_reason, **fields}}


async def turn(client: AcpClient) -> None:
    """Run one prompt in session s1 (its agent side is the test's script)."""
    with anyio.fail_after(10):
        await (await ready_session(client)).prompt("go")


def scripted(script: Any) -> FakeAgent:
    async def prompt(agent: FakeAgent, params: Any) -> Any:
        await script(agent)
        return {"stopReason": "end_turn"}

    return FakeAgent(handlers={"session/prompt": prompt})


async def test_the_client_advertises_subagents_only_when_asked_to() -> None:
    for enabled, expected in ((True, {}), (False, None)):
        agent = FakeAgent()
        async with connected(agent, subagents=enabled) as client:
            with anyio.fail_after(5):
                await client.initialize()
        assert agent.received[0][1]["clientCapabilities"].get("subagents") == expected


async def test_an_announced_child_is_kept_with_its_metadata_and_its_own_updates() -> None:
    async def script(agent: FakeAgent) -> None:
        await agent.update(
            "s1",
            announce(
                title="Explore",
                description="reads the code",
                cwd="/work/sub",
                capabilities={"cancel": {}},
                state={"state": "running"},
            ),
        )
        await agent.update("c1", text_chunk("child says"))
        await agent.update("s1", text_chunk("parent says"))

    async with connected(scripted(script), subagents=True) as client:
        with anyio.fail_after(10):
            result = await (await ready_session(client)).prompt("go")
        child = client.subagent_sessions["c1"]
        session = client.session("c1")
    assert (child.parent_session_id, child.depth, child.title, child.description, child.cwd) == (
        "s1",
        1,
        "Explore",
        "reads the code",
        "/work/sub",
    )
    assert (child.state_name, child.can_cancel, child.runs) == ("running", True, 0)
    assert [type(update).__name__ for update in child.updates] == ["AgentMessageChunk"]
    assert child.update_count == 1
    assert session is not None
    assert session.subagent is child
    assert session.cwd == "/work/sub"
    # The parent's turn has its own message, and the announcement as an update of its own.
    assert result.output == "parent says"
    assert [update.raw["sessionUpdate"] for update in result.updates if hasattr(update, "raw")] == [
        "subagent_update"
    ]


async def test_a_later_update_patches_only_what_it_carries_and_null_clears() -> None:
    async def script(agent: FakeAgent) -> None:
        await agent.update(
            "s1", announce(title="Explore", description="d", cwd="/w", capabilities={"cancel": {}})
        )
        await agent.update("s1", announce(title=None, capabilities={"cancel": None}))

    async with connected(scripted(script), subagents=True) as client:
        await turn(client)
        child = client.subagent_sessions["c1"]
        session = client.session("c1")
    assert (child.title, child.description, child.cwd, child.can_cancel) == (None, "d", "/w", False)
    assert session is not None
    assert session.cwd == "/w"


async def test_traffic_for_a_session_nobody_announced_is_refused_and_served_once_announced(
    tmp_path: Path,
) -> None:
    (tmp_path / "a.txt").write_text("text")
    replies: dict[str, Any] = {}
    options = [{"optionId": "ok", "name": "Allow", "kind": "allow_once"}]

    async def script(agent: FakeAgent) -> None:
        permission = {"sessionId": "c9", "toolCall": {"toolCallId": "t1", "title": "Run"}, "options": options}
        read = {"sessionId": "c9", "path": str(tmp_path / "a.txt")}
        for name, method, params in (
            ("permission", "session/request_permission", permission),
            ("read", "fs/read_text_file", read),
        ):
            try:
                await agent.ask(method, params)
            except RequestError as exc:
                replies[name] = exc.to_wire()
        await agent.update("c9", text_chunk("before its announcement"))
        await agent.update("s1", announce("c9"))
        replies["after"] = await agent.ask("fs/read_text_file", read)

    async with connected(
        scripted(script), subagents=True, fs=FsSandbox([tmp_path]), permission="allow"
    ) as client:
        await turn(client)
        child = client.subagent_sessions["c9"]
    assert replies["permission"] == UNKNOWN_SESSION
    assert replies["read"] == UNKNOWN_SESSION
    assert replies["after"] == {"content": "text"}
    assert child.update_count == 0  # the update sent before the announcement reached no one


async def test_without_the_capability_an_announcement_makes_no_session() -> None:
    replies: dict[str, Any] = {}

    async def script(agent: FakeAgent) -> None:
        await agent.update("s1", announce("c9"))
        try:
            await agent.ask("fs/read_text_file", {"sessionId": "c9", "path": "/x"})
        except RequestError as exc:
            replies["read"] = exc.to_wire()

    async with connected(scripted(script), fs=FsSandbox(["/"])) as client:
        await turn(client)
    assert client.subagent_sessions == {}
    assert replies["read"] == UNKNOWN_SESSION


async def test_a_child_never_changes_parent_and_a_session_of_ours_is_never_made_a_child() -> None:
    async def script(agent: FakeAgent) -> None:
        await agent.update("s1", announce("c1", title="first"))
        await agent.update("s1", announce("c2"))
        await agent.update("c2", announce("c1", title="stolen"))  # c1 belongs to s1
        await agent.update("c1", announce("s1"))  # our own session

    async with connected(scripted(script), subagents=True) as client:
        await turn(client)
    assert client.subagent_sessions["c1"].title == "first"
    assert client.subagent_sessions["c1"].parent_session_id == "s1"
    assert "s1" not in client.subagent_sessions
    assert client.subagents_refused == 2


async def test_a_child_announced_on_a_child_is_one_level_deeper() -> None:
    async def script(agent: FakeAgent) -> None:
        await agent.update("s1", announce("c1", cwd="/w"))
        await agent.update("c1", announce("g1", title="grandchild"))

    async with connected(scripted(script), subagents=True) as client:
        await turn(client)
        grandchild = client.subagent_sessions["g1"]
        session = client.session("g1")
    assert (grandchild.parent_session_id, grandchild.depth) == ("c1", 2)
    assert session is not None
    assert session.cwd == "/w"


async def test_each_run_of_a_reused_child_ends_once_however_often_idle_is_repeated() -> None:
    ends: list[tuple[str, int, str | None, dict[str, Any] | None]] = []
    usage = {"totalTokens": 30, "inputTokens": 10, "outputTokens": 20}

    async def script(agent: FakeAgent) -> None:
        await agent.update("s1", announce(state={"state": "running"}))
        await agent.update("s1", announce(**idle(usage=usage)))
        await agent.update("s1", announce(**idle()))  # a repeat: no run ended here
        await agent.update("s1", announce(state={"state": "requires_action"}))
        await agent.update("s1", announce(**idle("error", error={"code": -32603, "message": "failed"})))

    def listener(child: SubagentSession, ended: bool) -> None:
        if ended:
            ends.append((child.session_id, child.runs, child.stop_reason, child.usage))

    async with connected(scripted(script), subagents=True) as client:
        client.on_subagent(listener)
        await turn(client)
        child = client.subagent_sessions["c1"]
    assert ends == [("c1", 1, "end_turn", usage), ("c1", 2, "error", None)]
    assert child.error == Error(code=-32603, message="failed")
    assert child.state == unstable.IdleStateUpdate(
        stop_reason="error", error=Error(code=-32603, message="failed")
    )


async def test_unknown_keeps_a_run_under_way_and_starts_none_for_an_idle_child() -> None:
    seen: list[tuple[str, str | None, bool, int]] = []

    async def script(agent: FakeAgent) -> None:
        for child in ("busy", "done"):
            await agent.update("s1", announce(child, state={"state": "running"}))
        await agent.update("s1", announce("done", **idle()))
        # Codex reports its idle children unknown once its runtime is retired; Claude Code a busy one
        # it can no longer observe.
        for child in ("busy", "done"):
            await agent.update("s1", announce(child, state={"state": "unknown"}))

    def listener(child: SubagentSession, ended: bool) -> None:
        seen.append((child.session_id, child.state_name, child.working, child.runs))

    async with connected(scripted(script), subagents=True) as client:
        client.on_subagent(listener)
        await turn(client)
    assert seen == [
        ("busy", "running", True, 0),
        ("done", "running", True, 0),
        ("done", "idle", False, 1),
        ("busy", "unknown", True, 0),
        ("done", "unknown", False, 1),
    ]


async def test_a_runs_usage_comes_from_its_updates_when_idle_reports_none() -> None:
    async def script(agent: FakeAgent) -> None:
        await agent.update("s1", announce(state={"state": "running"}))
        chunk = {**text_chunk("x"), "_meta": {"usage": {"inputTokens": 4, "outputTokens": 5}}}
        await agent.update("c1", chunk)
        await agent.update("c1", {"sessionUpdate": "usage_update", "used": 9, "size": 100})
        await agent.update("s1", announce(state={"state": "idle"}))

    async with connected(scripted(script), subagents=True) as client:
        await turn(client)
        child = client.subagent_sessions["c1"]
    assert (child.runs, child.stop_reason) == (1, None)
    assert child.usage == {"inputTokens": 4, "outputTokens": 5, "contextUsed": 9, "contextSize": 100}


async def test_a_cancel_reaches_only_the_child_it_names_and_withdraws_only_its_questions() -> None:
    decided: dict[str, Any] = {}
    asked: list[PermissionQuestion] = []
    both_asked = anyio.Event()
    options = [{"optionId": "ok", "name": "Allow", "kind": "allow_once"}]

    async def policy(question: PermissionQuestion) -> str | None:
        asked.append(question)
        if len(asked) == 2:
            both_asked.set()
        if question.session_id == "c1":
            await anyio.sleep_forever()  # answered only by the cancel
        await release.wait()
        return "ok"

    release = anyio.Event()

    async def ask(agent: FakeAgent, child: str) -> None:
        params = {
            "sessionId": child,
            "toolCall": {"toolCallId": f"t-{child}", "title": "Run"},
            "options": options,
        }
        decided[child] = await agent.ask("session/request_permission", params)

    async def script(agent: FakeAgent) -> None:
        await agent.update(
            "s1", announce("c1", title="one", capabilities={"cancel": {}}, state={"state": "running"})
        )
        await agent.update(
            "s1", announce("c2", title="two", capabilities={"cancel": {}}, state={"state": "running"})
        )
        async with anyio.create_task_group() as group:
            group.start_soon(ask, agent, "c1")
            group.start_soon(ask, agent, "c2")
            await both_asked.wait()
            await client.session("c1").cancel()  # type: ignore[union-attr]
            await agent.cancelled.wait()
            assert "c2" not in decided
            release.set()

    agent = scripted(script)
    async with connected(agent, subagents=True, permission=policy) as client:
        await turn(client)
    cancels = [params for method, params in agent.received if method == "session/cancel"]
    assert cancels == [{"sessionId": "c1"}]
    assert decided == {
        "c1": {"outcome": {"outcome": "cancelled"}},
        "c2": {"outcome": {"outcome": "selected", "optionId": "ok"}},
    }
    assert sorted((question.session_id, question.subagent) for question in asked) == [
        ("c1", "one"),
        ("c2", "two"),
    ]


async def test_a_child_without_the_cancel_capability_is_not_sent_a_cancel() -> None:
    async def script(agent: FakeAgent) -> None:
        await agent.update("s1", announce("c1", capabilities={}, state={"state": "running"}))

    agent = scripted(script)
    async with connected(agent, subagents=True) as client:
        await turn(client)
        session = client.session("c1")
        assert session is not None
        with pytest.raises(AgentCapabilityError) as caught:
            await session.cancel()
    assert (
        str(caught.value)
        == "the agent does not permit cancelling its subagent session 'c1' (it grants no cancel capability)"
    )
    assert [method for method, _params in agent.received if method == "session/cancel"] == []


async def test_a_childs_question_goes_to_the_same_policy_naming_the_child() -> None:
    asked: list[PermissionQuestion] = []
    replies: list[Any] = []

    async def policy(question: PermissionQuestion) -> str | None:
        asked.append(question)
        return None

    async def script(agent: FakeAgent) -> None:
        await agent.update("s1", announce("c1", title="Explore"))
        params = {
            "sessionId": "c1",
            "toolCall": {"toolCallId": "t1", "title": "Run ls", "kind": "execute"},
            "options": [{"optionId": "ok", "name": "Allow", "kind": "allow_once"}],
        }
        replies.append(await agent.ask("session/request_permission", params))

    async with connected(scripted(script), subagents=True, permission=policy) as client:
        await turn(client)
    assert [(q.session_id, q.subagent, q.title, q.kind) for q in asked] == [
        ("c1", "Explore", "Run ls", "execute")
    ]
    assert replies == [{"outcome": {"outcome": "cancelled"}}]


async def test_a_childs_file_requests_stay_inside_the_sandbox_whatever_cwd_it_reports(tmp_path: Path) -> None:
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "a.txt").write_text("in")
    (tmp_path / "secret.txt").write_text("out")
    replies: dict[str, Any] = {}

    async def script(agent: FakeAgent) -> None:
        await agent.update("s1", announce("c1", cwd=str(tmp_path)))  # a cwd outside the sandbox
        replies["inside"] = await agent.ask(
            "fs/read_text_file", {"sessionId": "c1", "path": str(inside / "a.txt")}
        )
        try:
            await agent.ask("fs/read_text_file", {"sessionId": "c1", "path": str(tmp_path / "secret.txt")})
        except RequestError as exc:
            replies["outside"] = exc.to_wire()
        try:
            await agent.ask(
                "fs/write_text_file", {"sessionId": "c1", "path": str(inside / "b.txt"), "content": "x"}
            )
        except RequestError as exc:
            replies["write"] = exc.to_wire()

    async with connected(
        scripted(script), subagents=True, fs=FsSandbox([inside]), permission="deny"
    ) as client:
        await turn(client)
    assert replies["inside"] == {"content": "in"}
    assert replies["outside"]["code"] == -32602
    assert replies["outside"]["data"]["path"] == str(tmp_path / "secret.txt")
    # The deny policy refuses the child's write as it would the session's own.
    assert replies["write"]["code"] == -32003
    assert not (inside / "b.txt").exists()
