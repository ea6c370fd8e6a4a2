"""`subagent serve` shows the whole tree of runs below a session to its client.

Each run of the service that belongs to a session is a tool call `run/<run id>` of that session,
whose `_meta["subagent-seam/run"]` links it to its parent: the session for the session's own
children, a run for theirs. Driven in memory through our own `AcpClient`, on `ScriptedLlm`; every
wait is bounded by `anyio.fail_after`, nothing sleeps.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import anyio
import pytest

from subagent import SubagentRequest
from subagent.acp import schema
from subagent.events import EventName
from subagent.runtime import FunctionTool, LlmError, LlmErrorKind, Reply, ScriptedLlm, When, call
from subagent.serve import ServedAgent
from subagent.types import RUN_META_KEY, SubagentProgressInfo, Usage
from tests.test_serve import WAIT, content, served

pytestmark = pytest.mark.anyio

RUN_EVENTS: Final[tuple[EventName, ...]] = ("subagent/start", "subagent/progress", "subagent/end")
HEARTBEAT: Final = re.compile(r"child alive, (no update yet after|last update) [0-9.]+ s( ago)?")


def run_updates(updates: Iterable[schema.SessionUpdate]) -> list[schema.ToolCall | schema.ToolCallProgress]:
    """The updates of the tool calls that show runs; a run's wall time at its end (``elapsedSeconds``,
    never the same twice) is checked to be a number of seconds and taken out, so the rest compares exactly."""
    shown = [
        update
        for update in updates
        if isinstance(update, schema.ToolCall | schema.ToolCallProgress)
        and update.tool_call_id.startswith("run/")
    ]
    for update in shown:
        run = (update.meta or {}).get(RUN_META_KEY, {})
        if "elapsedSeconds" in run:
            elapsed = run.pop("elapsedSeconds")
            assert isinstance(elapsed, float | int)
            assert elapsed >= 0
    return shown


def call_updates(updates: Iterable[schema.SessionUpdate]) -> list[tuple[str, str | None]]:
    """Every tool call update as (tool call id, status): the order the client saw them in."""
    return [
        (update.tool_call_id, update.status)
        for update in updates
        if isinstance(update, schema.ToolCall | schema.ToolCallProgress)
    ]


def run_meta(run_id: str, parent_id: str, depth: int, state: str, **extra: str) -> dict[str, Any]:
    return {
        RUN_META_KEY: {
            "runId": run_id,
            "parentId": parent_id,
            "provider": "spawn",
            "depth": depth,
            "state": state,
            **extra,
        }
    }


def started(run_id: str, parent_id: str, depth: int, prompt: str) -> schema.ToolCall:
    return schema.ToolCall(
        tool_call_id=f"run/{run_id}",
        title=f"spawn subagent: {prompt}",
        kind="other",
        status="in_progress",
        meta=run_meta(run_id, parent_id, depth, "running"),
    )


def ended(
    run_id: str, parent_id: str, depth: int, prompt: str, text: str, state: str, stop_reason: str | None
) -> schema.ToolCallProgress:
    extra = {} if stop_reason is None else {"stopReason": stop_reason}
    return schema.ToolCallProgress(
        tool_call_id=f"run/{run_id}",
        title=f"spawn subagent: {prompt}",
        status="completed" if state == "completed" else "failed",
        content=content(text),
        meta=run_meta(run_id, parent_id, depth, state, **extra),
    )


def delegate(prompt: str, id: str) -> Reply:
    return Reply(tool_calls=[call("subagent", {"provider": "spawn", "prompt": prompt}, id=id)])


def three_levels(
    *more: Reply, leaf_usage: Usage | None = None, child_usage: Usage | None = None
) -> ScriptedLlm:
    """The session delegates to a child, which delegates to a grandchild (then ``more`` replies); the
    grandchild's and the child's answers report those usages."""
    return ScriptedLlm(
        [
            Reply(
                tool_calls=[call("subagent", {"provider": "spawn", "prompt": "child task"}, id="call-1")],
                when=When(last_user_contains="go", after_tool_result=False),
            ),
            Reply(
                tool_calls=[
                    call("subagent", {"provider": "spawn", "prompt": "grandchild task"}, id="call-2")
                ],
                when=When(last_user_contains="child task", after_tool_result=False),
            ),
            Reply("leaf answer", usage=leaf_usage, when=When(last_user_contains="grandchild task")),
            Reply(
                "child answer",
                usage=child_usage,
                when=When(last_user_contains="child task", after_tool_result=True),
            ),
            Reply("Done.", when=When(last_user_contains="go", after_tool_result=True)),
            *more,
        ]
    )


async def test_each_run_below_a_session_is_a_tool_call_linked_to_its_parent(tmp_path: Path) -> None:
    async with served(three_levels()) as (handler, client):
        counts = [handler.service.events.listener_count(event) for event in RUN_EVENTS]
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
            assert [handler.service.events.listener_count(event) for event in RUN_EVENTS] == [
                count + 1 for count in counts
            ]
            await client.connection.request(schema.SESSION_CLOSE, {"sessionId": session.session_id})
        # The closed session follows runs no more.
        assert [handler.service.events.listener_count(event) for event in RUN_EVENTS] == counts
    assert (turn.stop_reason, turn.output) == ("end_turn", "Done.")
    sid = session.session_id
    child, grandchild = (update.tool_call_id.removeprefix("run/") for update in run_updates(turn.updates)[:2])
    assert run_updates(turn.updates) == [
        started(child, sid, 1, "child task"),
        started(grandchild, child, 2, "grandchild task"),
        ended(grandchild, child, 2, "grandchild task", "leaf answer", "completed", "completed"),
        ended(child, sid, 1, "child task", "child answer", "completed", "completed"),
    ]
    # A run shows as soon as its child is ready, and ends before the call that started it.
    assert call_updates(turn.updates) == [
        ("call-1", "in_progress"),
        (f"run/{child}", "in_progress"),
        (f"{child}/call-2", "in_progress"),
        (f"run/{grandchild}", "in_progress"),
        (f"run/{grandchild}", "completed"),
        (f"{child}/call-2", "completed"),
        (f"run/{child}", "completed"),
        ("call-1", "completed"),
    ]


async def test_a_runs_end_carries_the_usage_its_child_reported(tmp_path: Path) -> None:
    llm = ScriptedLlm(
        [
            Reply(
                tool_calls=[call("subagent", {"provider": "spawn", "prompt": "count"}, id="call-1")],
                when=When(last_user_contains="go", after_tool_result=False),
            ),
            Reply(
                "counted",
                usage=Usage(input_tokens=40, output_tokens=4),
                when=When(last_user_contains="count"),
            ),
            Reply("Done.", when=When(last_user_contains="go", after_tool_result=True)),
        ]
    )
    async with served(llm) as (_handler, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
    *_, end = run_updates(turn.updates)
    child = end.tool_call_id.removeprefix("run/")
    expected = ended(child, session.session_id, 1, "count", "counted", "completed", "completed")
    assert expected.meta is not None
    expected.meta[RUN_META_KEY]["usage"] = {"inputTokens": 40, "outputTokens": 4}
    assert end == expected


async def test_a_failed_child_is_shown_failed_with_its_error(tmp_path: Path) -> None:
    refused = LlmError(LlmErrorKind.AUTH, "the model refused the key")
    llm = ScriptedLlm(
        [
            Reply(
                tool_calls=[call("subagent", {"provider": "spawn", "prompt": "fail"}, id="call-fail")],
                when=When(last_user_contains="go", after_tool_result=False),
            ),
            Reply(error=refused, when=When(last_user_contains="fail")),
            Reply("It failed.", when=When(last_user_contains="go", after_tool_result=True)),
        ]
    )
    async with served(llm) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
    assert (turn.stop_reason, turn.output) == ("end_turn", "It failed.")
    (start, end) = run_updates(turn.updates)
    child = start.tool_call_id.removeprefix("run/")
    error = "error: the model call failed (auth): the model refused the key"
    assert end == ended(child, session.session_id, 1, "fail", error, "failed", "error")


async def test_each_heartbeat_of_a_run_is_one_update_with_its_line(tmp_path: Path) -> None:
    heartbeats: list[SubagentProgressInfo] = []
    beaten = anyio.Event()

    async def until_a_heartbeat() -> None:
        await beaten.wait()

    llm = ScriptedLlm(
        [
            delegate("slow task", "call-slow"),
            Reply("slow answer", wait=until_a_heartbeat, when=When(last_user_contains="slow task")),
            Reply("Done.", when=When(after_tool_result=True)),
        ]
    )

    def heard(info: SubagentProgressInfo) -> None:
        heartbeats.append(info)
        beaten.set()

    async with served(llm) as (handler, client):
        handler.service.progress_interval = 0.05  # read when a run starts
        handler.service.events.on("subagent/progress", heard)
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
    start, *beats, end = run_updates(turn.updates)
    child = start.tool_call_id.removeprefix("run/")
    sid = session.session_id
    assert start == started(child, sid, 1, "slow task")
    assert end == ended(child, sid, 1, "slow task", "slow answer", "completed", "completed")
    # One update per heartbeat, each with the heartbeat's own line; the status is left as it was.
    assert len(beats) == len(heartbeats) >= 1
    for beat, info in zip(beats, heartbeats, strict=True):
        assert isinstance(beat, schema.ToolCallProgress)
        assert beat == schema.ToolCallProgress(
            tool_call_id=f"run/{child}",
            title="spawn subagent: slow task",
            content=content(info.describe()),
            meta=run_meta(child, sid, 1, "running"),
        )
        assert HEARTBEAT.fullmatch(info.describe())


async def test_a_run_disposed_by_a_cancelled_turn_is_shown_failed_with_why(tmp_path: Path) -> None:
    arrived = anyio.Event()

    async def hold() -> None:
        arrived.set()
        await anyio.sleep_forever()

    llm = ScriptedLlm(
        [delegate("hang", "call-hang"), Reply("never", wait=hold, when=When(last_user_contains="hang"))]
    )
    async with served(llm) as (_, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            async with anyio.create_task_group() as task_group:

                async def prompt() -> None:
                    turns.append(await session.prompt("start"))

                turns: list[Any] = []
                task_group.start_soon(prompt)
                await arrived.wait()
                await session.cancel()
    (turn,) = turns
    assert turn.stop_reason == "cancelled"
    start, end = run_updates(turn.updates)
    child = start.tool_call_id.removeprefix("run/")
    # Disposed, its turn never ended: no stop reason, and the service's error says so.
    disposed = f"error: run '{child}' was disposed before its turn ended"
    assert end == ended(child, session.session_id, 1, "hang", disposed, "failed", None)


async def test_a_run_still_open_when_the_turn_ends_is_shown_failed(tmp_path: Path) -> None:
    """A tool of the session's starts a run and leaves it running: the turn ends before the run."""
    arrived = anyio.Event()
    handlers: list[ServedAgent] = []
    sessions: list[str] = []

    async def hold() -> None:
        arrived.set()
        await anyio.sleep_forever()

    async def launch(arguments: Mapping[str, Any]) -> str:
        request = SubagentRequest(prompt="left running", parent_id=sessions[0], cwd=str(tmp_path))
        run = handlers[0].service.start("spawn", request)  # not awaited: the service disposes it
        await run.started()
        await arrived.wait()
        return "launched"

    llm = ScriptedLlm(
        [
            Reply(tool_calls=[call("launch", {}, id="call-launch")], when=When(last_user_contains="go")),
            Reply("never", wait=hold, when=When(last_user_contains="left running")),
            Reply("Launched.", when=When(after_tool_result=True)),
        ]
    )
    tool = FunctionTool("launch", "Launch a run.", {"type": "object"}, launch)
    async with served(llm, tools=[tool]) as (handler, client):
        handlers.append(handler)
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            sessions.append(session.session_id)
            turn = await session.prompt("go")
            (run,) = handler.service.live_runs
    # The run's failure came after the final text, which a client takes as the end of that message.
    assert turn.stop_reason == "end_turn"
    assert [message.text for message in turn.messages] == ["Launched."]
    assert run_updates(turn.updates) == [
        started(run.id, session.session_id, 1, "left running"),
        schema.ToolCallProgress(
            tool_call_id=f"run/{run.id}",
            title="spawn subagent: left running",
            status="failed",
            content=content("error: the turn ended before this call finished"),
            meta=run_meta(run.id, session.session_id, 1, "failed"),
        ),
    ]


async def test_runs_of_another_session_are_not_shown_to_it(tmp_path: Path) -> None:
    busy_done = anyio.Event()

    async def until_busy_is_done() -> None:
        await busy_done.wait()

    llm = three_levels(Reply("Quiet here.", wait=until_busy_is_done, when=When(last_user_contains="hello")))
    async with served(llm) as (_, client):
        with anyio.fail_after(WAIT):
            busy = await client.new_session(tmp_path)
            idle = await client.new_session(tmp_path)
            quiet: list[Any] = []
            async with anyio.create_task_group() as task_group:

                async def prompt_idle() -> None:
                    quiet.append(await idle.prompt("hello"))

                # The idle session's turn is being reported all the while the busy one's runs come and go.
                task_group.start_soon(prompt_idle)
                turn = await busy.prompt("go")
                busy_done.set()
    assert len(run_updates(turn.updates)) == 4
    assert quiet[0].output == "Quiet here."
    assert run_updates(quiet[0].updates) == []
