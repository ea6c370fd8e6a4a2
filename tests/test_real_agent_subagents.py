"""Real agents' own subagents over ACP: Claude Code (``claude-agent-acp``) and Codex (the ACP project's
``codex-acp``) delegating offline, against the fake models of `tests.realagent_delegation`.

End to end, as users see them: one delegating turn through ``subagent run --json --events --trace`` in
which the child asks before it writes a file shows the child as a two-level tree in ``--json`` (with
what each agent says of its usage: Codex its child's context window, Claude Code nothing), in the run
events (waiting on its question while it asks; the question naming the child and the child's own tool
call), and on the trace page, checked in headless Chromium; a child cancelled alone through the ACP
provider (`AcpRun.cancel_subagent`) ends ``cancelled`` while the parent's turn goes on; and under
``--no-subagents`` Claude Code's child is one ``Agent`` tool call of the parent's, as before.

At the wire, what the end-to-end tests cannot see: each agent's exact ``subagent_update`` s (validated
against the unstable schema, sdk 2.4.0, ``schema/acp/v1/schema.unstable.json``), the announcement before
any of the child's traffic, the child's text under its own session id, and no usage in ``idle``. Those
tests drive the agent with the library's lower layers only (a `LocalTransport` child and a JSON-RPC
`Connection`, raw dict messages) and record every message of the turn (`Traffic`).

Set ``SUBAGENT_AGENT_TRAFFIC_DIR`` to write each agent's trace of one delegating turn (ids, paths and
timings normalised) to ``<dir>/H3-traffic-<agent>.jsonl``: a record for people, never read by a test.
"""

from __future__ import annotations

import dataclasses
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

from subagent import SubagentRequest, SubagentService
from subagent.acp import schema
from subagent.acp.connection import Connection
from subagent.acp.transports import LocalTransport
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.types import RUN_META_KEY
from tests.chromium import open_page
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
from tests.test_real_agents import ROOT, Agent, Finished, Serve, Turn, make_agent, run_cli
from tests.test_trace_page import ROWS, trace_data

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess, pytest.mark.real_agent]

TURN_BOUND: Final = 90.0  # seconds for one agent, start to end of its turn: a hang guard on a loaded machine
UNSTABLE_SCHEMA: Final = ROOT / "schema" / "acp" / "v1" / "schema.unstable.json"
TRAFFIC_DIR_VARIABLE: Final = "SUBAGENT_AGENT_TRAFFIC_DIR"
WAITING_LINE: Final = "waiting on a permission answer"


@pytest.fixture
def anyio_backend() -> str:
    """One backend: what is under test is the agent subprocess; the connection runs on both elsewhere."""
    return "asyncio"


AGENT_SERVES: Final[dict[str, Callable[[Delegation], Serve]]] = {
    "claude": serve_claude_delegation,
    "codex-acp": serve_codex_delegation,
}

ASKING_MODE: Final = {"claude": CLAUDE_DELEGATING_MODE, "codex-acp": "read-only"}
"""The mode at which each agent's child asks before it writes (Codex's asks for a command that leaves its
read-only sandbox); Claude Code delegates at it too (see `tests.realagent_delegation`)."""

CHILD_TITLES: Final = {"claude": CHILD_TITLE, "codex-acp": "Errand"}


def delegating(name: str, delegation: Delegation) -> Agent:
    """Agent ``name`` with a fake model that makes it delegate as ``delegation`` says."""
    return dataclasses.replace(make_agent(name), serve=AGENT_SERVES[name](delegation))


# -- end to end ------------------------------------------------------------------------------------------


def run_updates(finished: Finished, run_id: str) -> list[dict[str, Any]]:
    """The updates of the tool call that shows run ``run_id``, in order."""
    return [
        event["update"]
        for event in finished.of("update")
        if event["update"].get("toolCallId") == f"run/{run_id}"
    ]


def child_question_title(name: str, target: Path) -> str:
    """How the child's tool call that writes ``target`` is named: Claude Code's ``Write``, or Codex's
    command line."""
    if name == "claude":
        return f"Write {target.name}"
    return f"printf %s 'written by the child\n' > {target}"


CHILD_USAGE_IN_JSON: Final[dict[str, dict[str, int] | None]] = {
    # Claude Code says nothing of a child's usage once it shows the child as a session (its prompt
    # response's _meta.quota.model_usage counts the whole turn, children and side calls together).
    "claude": None,
    # Codex says its child's context window: the tokens of its last model call, of a window that size.
    "codex-acp": {"contextUsed": sum(CHILD_USAGE), "contextSize": 258400},
}


@pytest.mark.parametrize("name", ["claude", "codex-acp"])
async def test_a_real_agents_child_shows_as_a_two_level_tree_in_json_events_and_the_trace_page(
    name: str, tmp_path: Path
) -> None:
    target = tmp_path / "work" / "child.txt"
    agent = delegating(name, Delegation(child="write", write=target))
    page = tmp_path / "trace.html"
    options = ("--mode", ASKING_MODE[name], "--trace", str(page))
    finished, _, log = await run_cli(agent, Turn(), tmp_path, permission="allow", options=options)
    assert finished.status == 0
    assert (finished.result["output"], finished.result["stopReason"]) == (CLOSING, "completed")
    assert target.read_text() == CHILD_CONTENT
    assert isinstance(log, DelegationLog)
    assert log.child_started == 1

    # --json: the child below the agent's session, ended, with what its agent said of its usage.
    (start,) = finished.of("start")
    (child,) = finished.result["runs"]
    elapsed = child.pop("elapsedSeconds")
    assert isinstance(elapsed, float)
    assert elapsed >= 0
    usage = CHILD_USAGE_IN_JSON[name]
    assert child == {
        "runId": child["runId"],
        "parentId": start["sessionId"],
        "provider": "acp",
        "depth": 1,
        "state": "completed",
        "stopReason": "completed",
        "title": CHILD_TITLES[name],
        **({"usage": usage} if usage is not None else {}),
    }
    # No subtree total: no run of the tree said what it spent in tokens, and none is counted as zero.
    assert "subtreeUsage" not in finished.result
    if name == "codex-acp":
        assert child["runId"].startswith(f"{start['sessionId']}:subagent:")

    # The events: the run below the CLI's run, waiting on its question while it asks; the question
    # names the child and the child's own tool call.
    runs = [(e["runId"], e["parentId"], e["depth"], e["state"]) for e in finished.of("run")]
    assert set(runs) == {
        (child["runId"], start["runId"], 1, "running"),
        (child["runId"], start["runId"], 1, "completed"),
    }
    assert (runs[0][3], runs[-1][3]) == ("running", "completed")
    (asked,) = finished.of("permission")
    assert (asked["subagent"], asked["title"], asked["option"]["kind"]) == (
        CHILD_TITLES[name],
        child_question_title(name, target),
        "allow_once",
    )
    row = run_updates(finished, child["runId"])
    # A heartbeat (content, no status): the next update with a status ends the wait.
    (waited,) = [index for index, update in enumerate(row) if "content" in update and "status" not in update]
    assert row[waited]["content"] == [{"type": "content", "content": {"type": "text", "text": WAITING_LINE}}]
    assert row[waited + 1]["status"] == "in_progress"
    waiting_at = next(i for i, e in enumerate(finished.events) if e.get("update") == row[waited])
    assert waiting_at < finished.events.index(asked)

    # The trace page: the agent's run and its child one level below, in a real browser too.
    data = trace_data(page.read_text())
    root, shown = data["runs"]
    assert (shown["parent"], shown["depth"], shown["title"]) == (root["id"], 1, CHILD_TITLES[name])
    assert (shown["state"], shown["stopReason"], shown["usage"]) == ("completed", "completed", usage)
    assert shown["output"] == CHILD_WROTE  # the child's last message, which its ended row carries
    with anyio.fail_after(60):
        async with open_page(tmp_path) as browser:
            await browser.open(page.as_uri())
            await browser.wait_for_ready()
            rows = await browser.evaluate(ROWS)
    assert [(row["provider"], row["title"], row["bar"]) for row in rows[1:]] == [
        ("acp", CHILD_TITLES[name], "bar state-completed")
    ]
    assert rows[0]["indent"] < rows[1]["indent"]
    assert not any(row["hidden"] for row in rows)


TOLD_PARENT_AFTER_CANCEL: Final = {
    # Claude Code's Agent tool reports the interruption; Codex's wait_agent gets no answer from a
    # cancelled child, and waits out its timeout.
    "claude": ["[Request interrupted by user for tool use]"],
    "codex-acp": ['{"task_name":"/root/errand"}', '{"message":"Wait timed out.","timed_out":true}'],
}


@pytest.mark.parametrize("name", ["claude", "codex-acp"])
async def test_a_run_cancels_a_real_agents_child_alone_and_the_parents_turn_goes_on(
    name: str, tmp_path: Path
) -> None:
    agent = delegating(name, Delegation(child="stall"))
    workdir = tmp_path / "work"
    workdir.mkdir()
    mode = CLAUDE_DELEGATING_MODE if name == "claude" else None
    async with (
        assert_no_leaks() as tag,
        agent.serve(Turn(), tmp_path / "home") as (server, env, log),
        SubagentService() as service,
    ):
        assert isinstance(log, DelegationLog)
        provider = AcpProvider(
            agent.command, env={**env, LEAK_TAG_VARIABLE: tag}, cwd=workdir, permission="allow", mode=mode
        )
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt=USER_PROMPT)) as run:
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
            seen: list[schema.SessionUpdate] = []
            acp_run.on_update(seen.append)
            # Codex streams the child's text: the test cancels once its partial text is here (the model
            # stalling after it does not mean Codex has passed it on yet).
            child_spoke = anyio.Event()
            acp_run.on_subagent_update(
                lambda _, update: child_spoke.set() if isinstance(update, schema.AgentMessageChunk) else None
            )
            with anyio.fail_after(TURN_BOUND):
                await log.child_stalled.wait()
                if name == "codex-acp":
                    await child_spoke.wait()
                # Codex grants the cancel only once its child runs: wait for it, as a client would.
                cancellable = anyio.Event()
                acp_run.on_update(lambda _: cancellable.set() if _can_cancel(acp_run) else None)
                if not _can_cancel(acp_run):
                    await cancellable.wait()
                (child,) = acp_run.subagents
                await acp_run.cancel_subagent(child.session_id)
                result = await run.result()
                for hung_up in log.stalled:
                    await hung_up.wait()
    assert set(server.tunnels) <= {f"127.0.0.1:{server.port}"}, server.tunnels
    assert (child.runs, child.stop_reason, child.working) == (1, "cancelled", False)
    # The parent was not cancelled: it was told, and closed its turn.
    assert (result.stop_reason, result.output) == ("completed", CLOSING)
    assert log.tool_results == TOLD_PARENT_AFTER_CANCEL[name]
    assert log.closings == 1
    # Codex streams the child's partial text; Claude Code sends a child's text only once its message ends.
    texts = [u.content.text for u in child.updates if isinstance(u, schema.AgentMessageChunk)]  # type: ignore[union-attr]
    assert texts == ([STALLED] if name == "codex-acp" else [])
    # Its row went from running to cancelled, and stayed there (Codex patches the child after its idle).
    rows = [meta for update in seen if (meta := (getattr(update, "meta", None) or {}).get(RUN_META_KEY))]
    states = [(meta["runId"], meta["state"], meta.get("stopReason")) for meta in rows]
    ended_at = states.index((child.session_id, "cancelled", "cancelled"))
    assert set(states[:ended_at]) == {(child.session_id, "running", None)}
    assert set(states[ended_at:]) == {(child.session_id, "cancelled", "cancelled")}


def _can_cancel(run: AcpRun) -> bool:
    return any(child.can_cancel for child in run.subagents)


async def test_without_subagents_claude_codes_child_is_one_agent_tool_call_with_its_usage_in_meta(
    tmp_path: Path,
) -> None:
    agent = delegating("claude", Delegation())
    options = ("--mode", CLAUDE_DELEGATING_MODE, "--no-subagents")
    finished, _, _ = await run_cli(agent, Turn(), tmp_path, permission="allow", options=options)
    assert finished.status == 0
    assert (finished.result["output"], "runs" in finished.result) == (CLOSING, False)
    assert finished.of("run") == []
    calls = [
        event["update"]
        for event in finished.of("update")
        if event["update"].get("toolCallId") == CLAUDE_AGENT_CALL
    ]
    assert (calls[0]["sessionUpdate"], calls[-1]["status"]) == ("tool_call", "completed")
    # The child's usage rides in the call's _meta, as Claude Code's own tool response: the one place
    # Claude Code tells a child's tokens, and only without the capability.
    (response,) = [
        u["_meta"]["claudeCode"]["toolResponse"] for u in calls if "toolResponse" in u["_meta"]["claudeCode"]
    ]
    assert (response["usage"]["input_tokens"], response["usage"]["output_tokens"]) == CHILD_USAGE


# -- at the wire -----------------------------------------------------------------------------------------


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


async def drive(name: str, tmp_path: Path, *, mode: str | None = None) -> Run:
    """Start agent ``name``, advertise the subagents capability, run one delegating turn at ``mode``
    (None: the agent's start mode). Checks that nothing outlived the run and that nothing went anywhere
    but the fake model."""
    agent = make_agent(name)
    home = tmp_path / "home"
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    traffic = Traffic()

    async def on_request(method: str, params: msgspec.Raw | None) -> Any:
        traffic.add(
            "in", {"method": method, "params": None if params is None else msgspec.json.decode(params)}
        )
        raise NotImplementedError(method)  # the child asks nothing here; fs and terminal are not advertised

    def on_notification(method: str, params: msgspec.Raw | None) -> None:
        traffic.add(
            "in", {"method": method, "params": None if params is None else msgspec.json.decode(params)}
        )

    async def request(conn: Connection, method: str, params: dict[str, Any]) -> Any:
        traffic.add("out", {"method": method, "params": params})
        result = await conn.request(method, params, result_type=object)
        traffic.add("in", {"result": result})
        return result

    serve = AGENT_SERVES[name](Delegation())
    capabilities = {"fs": {"readTextFile": False, "writeTextFile": False}, "terminal": False, "subagents": {}}
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
                result = await request(conn, "session/prompt", prompt)
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
    run = await drive("claude", tmp_path, mode=CLAUDE_DELEGATING_MODE)
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
    # One run of the child: running, then exactly one idle, with its stop reason and no usage; nothing
    # under its id says its usage either.
    assert run.states(child) == [{"state": "running"}, {"state": "idle", "stopReason": "end_turn"}]
    assert [u for u in run.of(child) if u["sessionUpdate"] == "usage_update" or "usage" in u] == []
    assert (run.log.started, run.log.child_started, run.log.closings) == (1, 1, 1)
    # The prompt's usage is the parent's own calls (two here: start and close); the child's tokens show
    # only in the quota's per-model total of the whole turn (with the agent's own side calls).
    assert run.result["usage"] == {
        "inputTokens": 20,
        "outputTokens": 10,
        "cachedReadTokens": 0,
        "cachedWriteTokens": 0,
        "totalTokens": 30,
    }
    (per_model,) = run.result["_meta"]["quota"]["model_usage"]
    assert per_model["token_count"]["inputTokens"] > 20 + CHILD_USAGE[0]
    write_traffic("claude", run)


def canonical(update: object) -> str:
    return json.dumps(update, sort_keys=True)


async def test_codex_announces_its_child_bare_then_reports_running_twice_and_ends_it_idle_without_usage(
    tmp_path: Path,
) -> None:
    run = await drive("codex-acp", tmp_path)
    assert run.result["stopReason"] == "end_turn"
    (child,) = run.children()
    assert child.startswith(f"{run.parent}:subagent:")  # the parent's id, then the child's thread id
    subagent_updates = [update for _, update in run.traffic.subagent_updates()]
    assert all(session == run.parent for session, _ in run.traffic.subagent_updates())
    assert subagent_updates[0] == {**CODEX_ANNOUNCEMENT, "sessionId": child}
    # While it starts, codex reports its state, its cancel capability and its cwd in an order of its
    # threads' choosing (the cwd came first in about one run of ten): the same updates, in any order.
    assert sorted(subagent_updates[1:5], key=canonical) == sorted(
        [
            {"sessionUpdate": "subagent_update", "sessionId": child, "state": {"state": "running"}},
            {"sessionUpdate": "subagent_update", "sessionId": child, "state": {"state": "running"}},
            {"sessionUpdate": "subagent_update", "sessionId": child, "capabilities": {"cancel": {}}},
            {"sessionUpdate": "subagent_update", "sessionId": child, "cwd": str(run.cwd)},
        ],
        key=canonical,
    )
    assert subagent_updates[5:] == [
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
    # The child's text, streamed under its own id; its context as a usage_update of its own: its last
    # model call's tokens (input and output together), no token counts of its run.
    assert run.texts(child) == list(CHILD_ANSWER)
    assert run.texts(run.parent) == [PREAMBLE, CLOSING]
    child_usage = [u for u in run.of(child) if u["sessionUpdate"] == "usage_update"]
    assert [(u["used"], set(u)) for u in child_usage] == [
        (sum(CHILD_USAGE), {"sessionUpdate", "used", "size"})
    ]
    assert run.states(child) == [
        {"state": "running"},
        {"state": "running"},
        {"state": "idle", "stopReason": "end_turn"},
    ]
    assert run.log.tool_results == [
        '{"task_name":"/root/errand"}',
        '{"message":"Wait completed.","timed_out":false}',
    ]
    # The prompt's usage, and its quota's per-model rows, are the parent's three calls only.
    assert (run.result["usage"]["inputTokens"], run.result["usage"]["outputTokens"]) == (30, 15)
    (per_model,) = run.result["_meta"]["quota"]["model_usage"]
    assert per_model["token_count"]["totalTokens"] == 45
    write_traffic("codex-acp", run)


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
