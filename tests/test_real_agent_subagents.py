"""Real agents' own subagents over ACP: what Claude Code (``claude-agent-acp``) and Codex (the ACP project's
``codex-acp``) send when their client advertises the unstable ``subagents`` capability, and when it does not.

Each test drives one delegating turn at the ACP level, offline, with the library's lower layers only: a
`LocalTransport` child and a JSON-RPC `Connection`, with raw dict messages (the typed client does not know
the unstable subagent types yet). The fake models of `tests.realagent_delegation` make the agent call its
subagent tool; the child's own model calls are answered too. Every message of the turn is recorded
(`Traffic`), and each test asserts exactly what arrives: the child's announcement (``subagent_update``)
before any of its traffic, the child's text under its own session id, its state snapshots (``running``,
``requires_action``, ``idle`` with its stop reason), the parent's turn completing, and a cancel aimed at
the child alone. What the agents send is compared with the unstable schema (sdk 2.4.0,
``schema/acp/v1/schema.unstable.json``): each ``subagent_update`` is validated against its definition.

Set ``SUBAGENT_AGENT_TRAFFIC_DIR`` to write each agent's trace of one delegating turn (ids, paths and
timings normalised) to ``<dir>/H3-traffic-<agent>.jsonl``: a record for people, never read by a test.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import jsonschema
import msgspec
import pytest

from subagent.acp.connection import Connection
from subagent.acp.transports import LocalTransport
from tests.leaks import LEAK_TAG_VARIABLE, assert_no_leaks
from tests.realagent_delegation import (
    CHILD_ANSWER,
    CHILD_CONTENT,
    CHILD_PROMPT,
    CHILD_TITLE,
    CHILD_TYPE,
    CHILD_USAGE,
    CHILD_WROTE,
    CLAUDE_AGENT_CALL,
    CLAUDE_DELEGATING_MODE,
    CLOSING,
    PREAMBLE,
    STALLED,
    USER_PROMPT,
    Delegation,
    DelegationLog,
    serve_claude_delegation,
    serve_codex_delegation,
)
from tests.test_real_agents import ROOT, Serve, Turn, make_agent

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess, pytest.mark.real_agent]

TURN_BOUND: Final = 90.0  # seconds for one agent, start to end of its turn: a hang guard on a loaded machine
UNSTABLE_SCHEMA: Final = ROOT / "schema" / "acp" / "v1" / "schema.unstable.json"
TRAFFIC_DIR_VARIABLE: Final = "SUBAGENT_AGENT_TRAFFIC_DIR"
SUBAGENT_CAPABILITY: Final[dict[str, Any]] = {"subagents": {}}


@pytest.fixture
def anyio_backend() -> str:
    """One backend: what is under test is the agent subprocess; the connection runs on both elsewhere."""
    return "asyncio"


@dataclass
class Traffic:
    """Every message of one run, in order: ``direction`` (``out``: ours, ``in``: the agent's) and the
    message as a dict (JSON-RPC envelope fields only: ``method``, ``params``, ``result``, ``error``)."""

    messages: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    times: list[float] = field(default_factory=list)

    def add(self, direction: str, message: dict[str, Any]) -> None:
        self.messages.append((direction, message))
        self.times.append(time.monotonic() - self.started)

    def updates(self) -> list[tuple[str, dict[str, Any]]]:
        """(session id, update) of every ``session/update`` the agent sent, in order."""
        return [
            (message["params"]["sessionId"], message["params"]["update"])
            for direction, message in self.messages
            if direction == "in" and message.get("method") == "session/update"
        ]

    def subagent_updates(self) -> list[tuple[str, dict[str, Any]]]:
        return [
            (session, update)
            for session, update in self.updates()
            if update["sessionUpdate"] == "subagent_update"
        ]

    def permission_requests(self) -> list[dict[str, Any]]:
        return [
            message["params"]
            for direction, message in self.messages
            if direction == "in" and message.get("method") == "session/request_permission"
        ]


@dataclass
class Run:
    """One driven turn: its traffic, the model's log, the parent's session id and the prompt's result."""

    traffic: Traffic
    log: DelegationLog
    parent: str
    result: dict[str, Any]
    cwd: Path

    def children(self) -> list[str]:
        """The announced child session ids, in announcement order."""
        seen: list[str] = []
        for _, update in self.traffic.subagent_updates():
            if update["sessionId"] not in seen:
                seen.append(update["sessionId"])
        return seen

    def of(self, session: str) -> list[dict[str, Any]]:
        """The updates sent under ``session``, in order."""
        return [update for sent_under, update in self.traffic.updates() if sent_under == session]

    def states(self, child: str) -> list[dict[str, Any]]:
        """The child's state snapshots, in order."""
        return [
            update["state"]
            for _, update in self.traffic.subagent_updates()
            if update["sessionId"] == child and "state" in update
        ]

    def texts(self, session: str) -> list[str]:
        return [
            update["content"]["text"]
            for update in self.of(session)
            if update["sessionUpdate"] == "agent_message_chunk" and update["content"].get("text")
        ]


AGENT_SERVES: Final[dict[str, Callable[[Delegation], Serve]]] = {
    "claude": serve_claude_delegation,
    "codex-acp": serve_codex_delegation,
}


async def drive(
    name: str,
    delegation: Delegation,
    tmp_path: Path,
    *,
    subagents: bool,
    mode: str | None = None,
    cancel_child: bool = False,
) -> Run:
    """Start agent ``name``, advertise the subagents capability if asked, run one delegating turn at
    ``mode`` (None: the agent's start mode), allow every permission question, and, with ``cancel_child``,
    cancel the announced child once its model call stalls. Checks that nothing outlived the run and that
    nothing went anywhere but the fake model."""
    agent = make_agent(name)
    home = tmp_path / "home"
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    traffic = Traffic()
    cancellable = anyio.Event()
    children: list[str] = []

    async def on_request(method: str, params: msgspec.Raw | None) -> Any:
        decoded: dict[str, Any] = {} if params is None else msgspec.json.decode(params)
        traffic.add("in", {"method": method, "params": decoded})
        if method != "session/request_permission":
            raise NotImplementedError(method)  # fs and terminal are not advertised
        (option,) = [option for option in decoded["options"] if option["kind"] == "allow_once"]
        answer = {"outcome": {"outcome": "selected", "optionId": option["optionId"]}}
        traffic.add("out", {"result": answer})
        return answer

    def on_notification(method: str, params: msgspec.Raw | None) -> None:
        decoded: dict[str, Any] = {} if params is None else msgspec.json.decode(params)
        traffic.add("in", {"method": method, "params": decoded})
        update = decoded.get("update", {}) if method == "session/update" else {}
        if update.get("sessionUpdate") == "subagent_update":
            if update["sessionId"] not in children:
                children.append(update["sessionId"])
            if (update.get("capabilities") or {}).get("cancel") is not None:
                cancellable.set()

    async def request(conn: Connection, method: str, params: dict[str, Any]) -> Any:
        traffic.add("out", {"method": method, "params": params})
        result = await conn.request(method, params, result_type=object)
        traffic.add("in", {"result": result})
        return result

    async def cancel_when_stalled(conn: Connection, log: DelegationLog) -> None:
        await log.child_stalled.wait()
        await cancellable.wait()
        cancel = {"sessionId": children[0]}
        traffic.add("out", {"method": "session/cancel", "params": cancel})
        await conn.notify("session/cancel", cancel)

    serve = AGENT_SERVES[name](delegation)
    capabilities: dict[str, Any] = {"fs": {"readTextFile": False, "writeTextFile": False}, "terminal": False}
    if subagents:
        capabilities |= SUBAGENT_CAPABILITY
    async with assert_no_leaks() as tag, serve(Turn(), home) as (server, env, model_log):
        assert isinstance(model_log, DelegationLog)
        transport = LocalTransport(inherit_env=False)
        async with (
            transport.open(agent.command, env={**env, LEAK_TAG_VARIABLE: tag}, cwd=str(workdir)) as channel,
            Connection(
                channel.stdout,
                channel.stdin,
                request_handler=on_request,
                notification_handler=on_notification,
            ) as conn,
        ):
            with anyio.fail_after(TURN_BOUND):
                initialize = {
                    "protocolVersion": 1,
                    "clientCapabilities": capabilities,
                    "clientInfo": {"name": "subagent-tests", "version": "0"},
                }
                await request(conn, "initialize", initialize)
                session = await request(conn, "session/new", {"cwd": str(workdir), "mcpServers": []})
                parent = session["sessionId"]
                if mode is not None:
                    await request(conn, "session/set_mode", {"sessionId": parent, "modeId": mode})
                prompt = {"sessionId": parent, "prompt": [{"type": "text", "text": USER_PROMPT}]}
                async with anyio.create_task_group() as tg:
                    if cancel_child:
                        tg.start_soon(cancel_when_stalled, conn, model_log)
                    result = await request(conn, "session/prompt", prompt)
                # Every hung model call was hung up on by the end of the turn.
                for hung_up in model_log.stalled:
                    await hung_up.wait()
    # The agent went nowhere but to the fake model.
    assert set(server.tunnels) <= {f"127.0.0.1:{server.port}"}, server.tunnels
    run = Run(traffic, model_log, parent, result, workdir)
    _check_against_schema(run)
    return run


def _check_against_schema(run: Run) -> None:
    """Every ``subagent_update`` is valid against the unstable schema's ``SessionNotification``."""
    schema = json.loads(UNSTABLE_SCHEMA.read_text())
    notification = {"$ref": "#/$defs/SessionNotification", "$defs": schema["$defs"]}
    for direction, message in run.traffic.messages:
        update = (message.get("params") or {}).get("update", {}) if direction == "in" else {}
        if update.get("sessionUpdate") == "subagent_update":
            jsonschema.validate(message["params"], notification)


def first_index(run: Run, accept: Callable[[str, dict[str, Any]], bool]) -> int:
    """Where in the run's updates the first one ``accept`` takes is (session id, update)."""
    return next(
        index for index, (session, update) in enumerate(run.traffic.updates()) if accept(session, update)
    )


# -- what each agent sends ------------------------------------------------------------------------------


CLAUDE_ANNOUNCEMENT: Final = {
    "sessionUpdate": "subagent_update",
    "title": CHILD_TITLE,
    "description": CHILD_TYPE,
    "capabilities": {"cancel": {}},
    "state": {"state": "running"},
}
"""Claude Code announces its child whole: labels, its ``cancel`` capability and ``running``, at once."""

CODEX_ANNOUNCEMENT: Final = {"sessionUpdate": "subagent_update", "capabilities": {}, "title": "Errand"}
"""Codex announces its child with its title (its task name, capitalised) and no capability or state; the
``running`` snapshot, the ``cancel`` capability and its ``cwd`` follow in updates of their own."""


async def test_claude_code_announces_its_child_before_the_childs_traffic_and_ends_it_idle_without_usage(
    tmp_path: Path,
) -> None:
    run = await drive("claude", Delegation(), tmp_path, subagents=True, mode=CLAUDE_DELEGATING_MODE)
    assert run.result["stopReason"] == "end_turn"
    (child,) = run.children()
    announcement = run.traffic.subagent_updates()[0]
    assert announcement == (run.parent, {**CLAUDE_ANNOUNCEMENT, "sessionId": child})
    # Nothing under the child's id, and no message naming it, comes before its announcement.
    announced_at = first_index(run, lambda _, update: update["sessionUpdate"] == "subagent_update")
    assert announced_at < first_index(run, lambda session, _: session == child)
    assert announced_at < first_index(
        run, lambda _, update: child in json.dumps(update) and update["sessionUpdate"] != "subagent_update"
    )
    # The Agent tool call is not shown: the parent's session messages replace it, the errand sent to the
    # child (under both sessions) and the child's reply.
    parent_updates = run.of(run.parent)
    assert [u for u in parent_updates if u["sessionUpdate"] in ("tool_call", "tool_call_update")] == []
    messages = [
        (session, u) for session, u in run.traffic.updates() if u["sessionUpdate"] == "session_message"
    ]
    assert [
        (session, u["senderSessionId"], u["recipientSessionId"], u["content"]) for session, u in messages
    ] == [
        (run.parent, run.parent, child, [{"type": "text", "text": CHILD_PROMPT}]),
        (child, run.parent, child, [{"type": "text", "text": CHILD_PROMPT}]),
        (run.parent, child, run.parent, [{"type": "text", "text": "".join(CHILD_ANSWER)}]),
    ]
    # The child's text arrives under its own id; the parent's own text under the parent's.
    assert run.texts(child) == ["".join(CHILD_ANSWER)]
    assert run.texts(run.parent) == [PREAMBLE, CLOSING]
    # One run of the child: running, then exactly one idle, with its stop reason and no usage.
    assert run.states(child) == [{"state": "running"}, {"state": "idle", "stopReason": "end_turn"}]
    assert (run.log.started, run.log.child_started, run.log.closings) == (1, 1, 1)
    # The prompt's usage is the parent's own three calls (two here: start and close); the child's tokens
    # show only in the quota's per-model total.
    assert run.result["usage"] == {
        "inputTokens": 20,
        "outputTokens": 10,
        "cachedReadTokens": 0,
        "cachedWriteTokens": 0,
        "totalTokens": 30,
    }
    write_traffic("claude", run)


async def test_codex_announces_its_child_bare_then_reports_running_twice_and_ends_it_idle_without_usage(
    tmp_path: Path,
) -> None:
    run = await drive("codex-acp", Delegation(), tmp_path, subagents=True)
    assert run.result["stopReason"] == "end_turn"
    (child,) = run.children()
    assert child.startswith(f"{run.parent}:subagent:")  # the parent's id, then the child's thread id
    subagent_updates = [update for _, update in run.traffic.subagent_updates()]
    assert all(session == run.parent for session, _ in run.traffic.subagent_updates())
    assert subagent_updates == [
        {**CODEX_ANNOUNCEMENT, "sessionId": child},
        {"sessionUpdate": "subagent_update", "sessionId": child, "state": {"state": "running"}},
        {"sessionUpdate": "subagent_update", "sessionId": child, "state": {"state": "running"}},
        {"sessionUpdate": "subagent_update", "sessionId": child, "capabilities": {"cancel": {}}},
        {"sessionUpdate": "subagent_update", "sessionId": child, "cwd": str(run.cwd)},
        {
            "sessionUpdate": "subagent_update",
            "sessionId": child,
            "state": {"state": "idle", "stopReason": "end_turn"},
        },
        # Once idle, the child can no longer be cancelled.
        {"sessionUpdate": "subagent_update", "sessionId": child, "capabilities": {"cancel": None}},
    ]
    announced_at = first_index(run, lambda _, update: update["sessionUpdate"] == "subagent_update")
    assert announced_at < first_index(run, lambda session, _: session == child)
    # spawn_agent is not shown; wait_agent is, as a tool call of the parent's.
    calls = [u["toolCallId"] for u in run.of(run.parent) if u["sessionUpdate"] == "tool_call"]
    assert calls == ["call_wait_1"]
    assert [u["sessionUpdate"] for u in run.of(run.parent)].count("session_message") == 0
    # The child's text, streamed under its own id; its context size as a usage_update of its own.
    assert run.texts(child) == list(CHILD_ANSWER)
    assert run.texts(run.parent) == [PREAMBLE, CLOSING]
    child_usage = [u for u in run.of(child) if u["sessionUpdate"] == "usage_update"]
    assert [u["used"] for u in child_usage] == [sum(CHILD_USAGE)]
    assert run.states(child) == [
        {"state": "running"},
        {"state": "running"},
        {"state": "idle", "stopReason": "end_turn"},
    ]
    assert run.log.tool_results == [
        '{"task_name":"/root/errand"}',
        '{"message":"Wait completed.","timed_out":false}',
    ]
    # The prompt's usage is the parent's three calls only (spawn, wait, close).
    assert (run.result["usage"]["inputTokens"], run.result["usage"]["outputTokens"]) == (30, 15)
    write_traffic("codex-acp", run)


async def test_without_the_capability_claude_codes_child_is_one_agent_tool_call_of_the_parent(
    tmp_path: Path,
) -> None:
    run = await drive("claude", Delegation(), tmp_path, subagents=False, mode=CLAUDE_DELEGATING_MODE)
    assert run.result["stopReason"] == "end_turn"
    assert run.children() == []
    assert {session for session, _ in run.traffic.updates()} == {run.parent}  # the child's text is not sent
    assert run.texts(run.parent) == [PREAMBLE, CLOSING]
    calls = [u for u in run.of(run.parent) if u.get("toolCallId") == CLAUDE_AGENT_CALL]
    assert (calls[0]["sessionUpdate"], calls[0]["name"], calls[-1]["status"]) == (
        "tool_call",
        "Agent",
        "completed",
    )
    # Its usage rides in the tool call's _meta, as Claude Code's own tool response.
    (response,) = [
        u["_meta"]["claudeCode"]["toolResponse"] for u in calls if "toolResponse" in u["_meta"]["claudeCode"]
    ]
    assert (response["status"], response["content"]) == (
        "completed",
        [{"type": "text", "text": "".join(CHILD_ANSWER)}],
    )
    assert (response["usage"]["input_tokens"], response["usage"]["output_tokens"]) == CHILD_USAGE


async def test_without_the_capability_codexs_child_is_a_start_and_a_completion_tool_call_of_the_parent(
    tmp_path: Path,
) -> None:
    run = await drive("codex-acp", Delegation(), tmp_path, subagents=False)
    assert run.result["stopReason"] == "end_turn"
    assert run.children() == []
    assert {session for session, _ in run.traffic.updates()} == {run.parent}
    assert run.texts(run.parent) == [PREAMBLE, CLOSING]
    started = [u for u in run.of(run.parent) if u["sessionUpdate"] == "tool_call"]
    assert [
        (u["title"], u["rawInput"].get("agentPath"), u["rawInput"].get("activityKind")) for u in started
    ] == [
        ("Start subagent errand", "/root/errand", "started"),
        ("wait", None, None),
        ("Complete subagent errand", "/root/errand", "completed"),
    ]


TOLD_PARENT_AFTER_CANCEL: Final = {
    # Claude Code's Agent tool reports the interruption; Codex's wait_agent gets no answer from a
    # cancelled child, and waits out its timeout.
    "claude": ["[Request interrupted by user for tool use]"],
    "codex-acp": ['{"task_name":"/root/errand"}', '{"message":"Wait timed out.","timed_out":true}'],
}


@pytest.mark.parametrize("name", ["claude", "codex-acp"])
async def test_cancelling_a_real_agents_child_alone_ends_it_idle_cancelled_and_the_parents_turn_goes_on(
    name: str, tmp_path: Path
) -> None:
    mode = CLAUDE_DELEGATING_MODE if name == "claude" else None
    run = await drive(name, Delegation(child="stall"), tmp_path, subagents=True, mode=mode, cancel_child=True)
    (child,) = run.children()
    cancels = [
        m
        for direction, m in run.traffic.messages
        if direction == "out" and m.get("method") == "session/cancel"
    ]
    assert cancels == [{"method": "session/cancel", "params": {"sessionId": child}}]
    assert run.states(child)[-1] == {"state": "idle", "stopReason": "cancelled"}
    assert [state["state"] for state in run.states(child)].count("idle") == 1
    # The parent was not cancelled: it was told, and closed its turn.
    assert run.result["stopReason"] == "end_turn"
    assert run.texts(run.parent) == [PREAMBLE, CLOSING]
    assert run.log.tool_results == TOLD_PARENT_AFTER_CANCEL[name]
    assert run.log.closings == 1
    # Codex streams the child's partial text; Claude Code sends a child's text only once its message ends.
    assert run.texts(child) == ([STALLED] if name == "codex-acp" else [])


CHILD_STATES_WHEN_ASKING: Final = {
    "claude": ["running", "requires_action", "running", "idle"],
    "codex-acp": ["running", "running", "requires_action", "running", "idle"],
}


@pytest.mark.parametrize("name", ["claude", "codex-acp"])
async def test_a_real_agents_child_asks_under_its_own_session_id_and_requires_action_while_it_waits(
    name: str, tmp_path: Path
) -> None:
    target = tmp_path / "work" / "child.txt"
    # Claude Code asks at its "default" mode; Codex at "read-only", for a command that leaves its sandbox.
    mode = CLAUDE_DELEGATING_MODE if name == "claude" else "read-only"
    run = await drive(name, Delegation(child="write", write=target), tmp_path, subagents=True, mode=mode)
    (child,) = run.children()
    (question,) = run.traffic.permission_requests()
    assert question["sessionId"] == child
    assert [state["state"] for state in run.states(child)] == CHILD_STATES_WHEN_ASKING[name]
    # requires_action is reported before the question, running again once it is answered.
    order = [m.get("method") or "answer" for _, m in run.traffic.messages]
    asked_at = order.index("session/request_permission")
    before = run.traffic.messages[asked_at - 1][1]["params"]["update"]
    assert (before["sessionUpdate"], before.get("state")) == ("subagent_update", {"state": "requires_action"})
    assert target.read_text() == CHILD_CONTENT
    assert run.texts(child) == [CHILD_WROTE]
    assert run.states(child)[-1] == {"state": "idle", "stopReason": "end_turn"}
    assert run.result["stopReason"] == "end_turn"


# -- the trace for people --------------------------------------------------------------------------------

_UUID: Final = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|\b[0-9a-f]{17}\b")


def normalised(run: Run, cwd: Path) -> Iterator[dict[str, Any]]:
    """The run's messages with session ids named (``<parent>``, ``<child-1>``), other ids and paths
    replaced, and times as tenths of a second since the start."""
    names = {run.parent: "<parent>"} | {child: f"<child-{n}>" for n, child in enumerate(run.children(), 1)}
    others: dict[str, str] = {}

    def rename(match: re.Match[str]) -> str:
        return others.setdefault(match[0], f"<id-{len(others) + 1}>")

    for (direction, message), at in zip(run.traffic.messages, run.traffic.times, strict=True):
        text = json.dumps(message)
        for session, name in sorted(names.items(), key=lambda item: -len(item[0])):
            text = text.replace(session, name)
        text = _UUID.sub(rename, text.replace(str(cwd), "<cwd>"))
        yield {"dir": direction, "t": round(at, 1), **json.loads(text)}


def write_traffic(agent: str, run: Run) -> None:
    """Write the run's trace where ``SUBAGENT_AGENT_TRAFFIC_DIR`` says (see the module docstring)."""
    directory = os.environ.get(TRAFFIC_DIR_VARIABLE)
    if not directory:
        return
    lines = [json.dumps(message) for message in normalised(run, run.cwd)]
    (Path(directory) / f"H3-traffic-{agent}.jsonl").write_text("\n".join(lines) + "\n")
