"""`subagent serve` with background delegation: the session's agent starts children in the background
and goes on; the prompt request lasts until their notices are read and answered, and the client sees
the children's runs progress as tool calls meanwhile.

Driven in memory through our own `AcpClient`, on a `ScriptedLlm` that answers each request by what it
holds (the children's answers are held until the test lets them go). Every wait is bounded by
`anyio.fail_after`; nothing sleeps.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Final

import anyio
import pytest

from subagent.acp import schema
from subagent.delegation import WAKE_PROMPT, BackgroundOptions
from subagent.runtime import CompletionRequest, FunctionTool, Reply, ScriptedLlm, call
from subagent.serve import ServedAgent
from subagent.types import RUN_META_KEY, TURN_META_KEY, SubagentProgressInfo, SubagentRunInfo
from tests.test_serve import DELEGATION_TOOLS, WAIT, served

pytestmark = pytest.mark.anyio

TASKS: Final = {"task A": "A done", "task B": "B done", "slow task C": "C done"}
FINAL_ANSWER: Final = "All three helpers reported: A done, B done, C done."
NOTICE: Final = "[background subagent "


def background(prompt: str, id: str) -> Any:
    return call("subagent", {"provider": "spawn", "prompt": prompt, "background": True}, id=id)


def is_parent(request: CompletionRequest) -> bool:
    """The session's agent has the default persona; a spawned child has none."""
    return bool(request.messages) and request.messages[0].role == "system"


def notices(request: CompletionRequest) -> str:
    """The background notices the request holds, wherever in the log they landed."""
    return "\n".join(message.content for message in request.messages if NOTICE in message.content)


class Helpers:
    """The model of the session and its three children. The parent starts the three in the
    background, checks on them with `subagent_list` while they run, and answers once all three
    notices are in; C's answer is held until A's and B's notices reached the parent and C sent a
    heartbeat, so the parent's work and C's progress interleave the same way on every run."""

    def __init__(self) -> None:
        self.parent_calls = 0
        self.a_and_b_seen = anyio.Event()
        self.c_heartbeat = anyio.Event()
        self.c_run: str | None = None

    def started(self, info: SubagentRunInfo) -> None:
        if info.prompt == "slow task C":
            self.c_run = info.id

    def progressed(self, info: SubagentProgressInfo) -> None:
        if info.id == self.c_run and self.a_and_b_seen.is_set():
            self.c_heartbeat.set()

    async def release_c(self) -> None:
        await self.a_and_b_seen.wait()
        await self.c_heartbeat.wait()

    def answer(self, request: CompletionRequest) -> Reply:
        if not is_parent(request):
            prompt = request.messages[-1].content
            return Reply(TASKS[prompt], wait=self.release_c if prompt == "slow task C" else None)
        self.parent_calls += 1
        if self.parent_calls == 1:
            return Reply(
                "I will start three helpers.",
                tool_calls=[
                    background("task A", "call-a"),
                    background("task B", "call-b"),
                    background("slow task C", "call-c"),
                ],
            )
        if self.parent_calls == 2:
            # C is held: this call is made while it runs.
            return Reply(
                "While they work, I check on them.", tool_calls=[call("subagent_list", {}, id="call-list")]
            )
        seen = notices(request)
        if all(answer in seen for answer in TASKS.values()):
            return Reply(FINAL_ANSWER)
        if "A done" in seen and "B done" in seen:
            self.a_and_b_seen.set()
            return Reply("A and B are back; C is still working.")
        return Reply("Waiting for the helpers.")


def client_lines(transcript: Iterable[bytes]) -> list[dict[str, Any]]:
    return [json.loads(line) for item in transcript for line in item.splitlines() if line.strip()]


def updates_of(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The session updates; a run's wall time at its end is checked and taken out (it varies)."""
    updates = [line["params"]["update"] for line in lines if line.get("method") == "session/update"]
    for update in updates:
        run = update.get("_meta", {}).get(RUN_META_KEY, {})
        if "elapsedSeconds" in run:
            elapsed = run.pop("elapsedSeconds")
            assert isinstance(elapsed, float | int)
            assert elapsed >= 0
    return updates


def position(updates: list[dict[str, Any]], found: Callable[[dict[str, Any]], bool]) -> int:
    return next(index for index, update in enumerate(updates) if found(update))


async def test_background_children_progress_while_the_parent_goes_on_and_it_answers_with_their_results(
    tmp_path: Path,
) -> None:
    helpers = Helpers()
    transcript: list[bytes] = []
    async with served(ScriptedLlm(helpers.answer), transcript=transcript) as (handler, client):
        handler.service.progress_interval = 0.05  # read when a run starts
        handler.service.events.on("subagent/start", helpers.started)
        handler.service.events.on("subagent/progress", helpers.progressed)
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("Ask three helpers.")
        assert handler.service.live_runs == ()
        background_children = handler.sessions[session.session_id].subagent_tool
        assert background_children is not None
        assert background_children.background is not None
        assert background_children.background.live_count(session.session_id) == 0
    assert (turn.stop_reason, turn.output) == ("end_turn", FINAL_ANSWER)
    updates = updates_of(client_lines(transcript))
    runs = {
        update["_meta"][RUN_META_KEY]["runId"]: update["title"]
        for update in updates
        if update["sessionUpdate"] == "tool_call" and RUN_META_KEY in update.get("_meta", {})
    }
    assert sorted(runs.values()) == [f"spawn subagent: {task}" for task in sorted(TASKS)]
    # Each turn of the session's agent is marked: the prompt's own, then the one C's notice called for.
    turns = [
        update["_meta"][TURN_META_KEY]
        for update in updates
        if update["sessionUpdate"] == "session_info_update"
    ]
    assert turns == [
        {"turn": 1, "state": "started"},
        {"turn": 1, "state": "ended", "stopReason": "completed"},
        {"turn": 2, "state": "started", "woken": True},
        {"turn": 2, "state": "ended", "stopReason": "completed"},
    ]
    c_run = next(run for run, title in runs.items() if title.endswith("slow task C"))

    def of_c(status: str | None) -> Callable[[dict[str, Any]], bool]:
        return lambda update: update.get("toolCallId") == f"run/{c_run}" and update.get("status") == status

    # C showed as running, sent heartbeats, and ended: all while the parent's own calls went on.
    c_started = position(updates, of_c("in_progress"))
    # The last heartbeat: C is held until one comes after A's and B's notices reached the parent.
    c_beat = len(updates) - 1 - position(updates[::-1], of_c(None))
    c_ended = position(updates, of_c("completed"))
    list_ended = position(
        updates,
        lambda update: update.get("toolCallId") == "call-list" and update.get("status") == "completed",
    )
    assert c_started < list_ended < c_beat < c_ended
    # The second turn began once C had ended: its notice called for it.
    second_turn = position(
        updates, lambda update: update.get("_meta", {}).get(TURN_META_KEY, {}).get("turn") == 2
    )
    assert c_ended < second_turn
    assert updates[c_ended]["_meta"][RUN_META_KEY] == {
        "runId": c_run,
        "parentId": session.session_id,
        "provider": "spawn",
        "depth": 1,
        "state": "completed",
        "stopReason": "completed",
    }
    assert updates[c_ended]["content"] == [{"type": "content", "content": {"type": "text", "text": "C done"}}]
    # The parent answered after C's end, in the same prompt request.
    final_text = position(
        updates,
        lambda update: (
            update["sessionUpdate"] == "agent_message_chunk" and update["content"]["text"] == "All "
        ),
    )
    assert c_ended < final_text


async def test_cancelling_the_prompt_disposes_its_background_children(tmp_path: Path) -> None:
    held = anyio.Event()

    async def hold() -> None:
        held.set()
        await anyio.sleep_forever()

    def answer(request: CompletionRequest) -> Reply:
        if not is_parent(request):
            return Reply("never", wait=hold)
        if request.messages[-1].role == "tool":
            return Reply("Started.")
        return Reply(tool_calls=[background("hang", "call-hang")])

    async with served(ScriptedLlm(answer)) as (handler, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turns: list[Any] = []

            async def prompt() -> None:
                turns.append(await session.prompt("go"))

            async with anyio.create_task_group() as task_group:
                task_group.start_soon(prompt)
                await held.wait()
                await session.cancel()
        assert handler.service.live_runs == ()
        assert handler.agents.list() == [session.session_id]
    (turn,) = turns
    assert turn.stop_reason == "cancelled"
    ends = [
        update
        for update in turn.updates
        if isinstance(update, schema.ToolCallProgress) and update.tool_call_id.startswith("run/")
    ]
    # Disposed with the prompt, and shown so before the prompt's answer.
    (end,) = ends
    run_id = end.tool_call_id.removeprefix("run/")
    assert end.meta is not None
    assert end.meta[RUN_META_KEY].pop("elapsedSeconds") >= 0  # the wall time, checked apart: it varies
    assert end == schema.ToolCallProgress(
        tool_call_id=f"run/{run_id}",
        title="spawn subagent: hang",
        status="failed",
        content=[
            schema.Content(
                content=schema.TextContent(text=f"error: run '{run_id}' was disposed before its turn ended")
            )
        ],
        meta={
            RUN_META_KEY: {
                "runId": run_id,
                "parentId": session.session_id,
                "provider": "spawn",
                "depth": 1,
                "state": "failed",
            }
        },
    )


def test_a_tool_named_like_a_companion_of_the_subagent_tool_is_refused() -> None:
    clash = FunctionTool("subagent_wait", "Wait.", {"type": "object"}, lambda _: "ok")
    with pytest.raises(ValueError, match="a tool named 'subagent_wait' would clash with the subagent tool"):
        ServedAgent(ScriptedLlm(), tools=[clash])


async def test_a_prompt_whose_every_turn_starts_another_child_ends_at_max_turn_requests(
    tmp_path: Path,
) -> None:
    prompts: list[str] = []
    turn_done = anyio.Event()

    async def after_the_parents_turn() -> None:
        await turn_done.wait()

    def answer(request: CompletionRequest) -> Reply:
        nonlocal turn_done
        if not is_parent(request):
            # Each child answers once its parent's turn made its last model call: its notice calls for
            # another turn.
            return Reply("found nothing", wait=after_the_parents_turn)
        if request.messages[-1].role == "tool":
            turn_done.set()
            return Reply("Started another.")
        prompts.append(request.messages[-1].content)
        turn_done = anyio.Event()
        return Reply(tool_calls=[background(f"look again {len(prompts)}", f"call-{len(prompts)}")])

    # Each turn makes two model calls (within the limit); the turns of one prompt are limited too.
    async with served(ScriptedLlm(answer), max_model_calls=2) as (handler, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("Keep looking.")
        assert handler.service.live_runs == ()
    assert turn.stop_reason == "max_turn_requests"
    # The prompt's turn, then one for the first child's notice; the second child's is one too many.
    assert prompts == ["Keep looking.", WAKE_PROMPT]


async def test_a_served_agent_without_background_options_offers_the_subagent_tool_alone(
    tmp_path: Path,
) -> None:
    llm = ScriptedLlm(["Alone."])
    async with served(llm, background=None) as (handler, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            turn = await session.prompt("go")
        served_session = handler.sessions[session.session_id]
        assert served_session.subagent_tool is not None
        assert served_session.subagent_tool.background is None
    assert turn.output == "Alone."
    (request,) = llm.requests
    assert [tool.name for tool in request.tools] == ["subagent"]
    assert "background" not in request.tools[0].parameters["properties"]


async def test_a_served_agent_takes_its_background_options(tmp_path: Path) -> None:
    options = BackgroundOptions(max_running=1, spill_bytes=None)
    llm = ScriptedLlm(["Fine."])
    async with served(llm, background=options) as (handler, client):
        with anyio.fail_after(WAIT):
            session = await client.new_session(tmp_path)
            await session.prompt("go")
        tool = handler.sessions[session.session_id].subagent_tool
        assert tool is not None
        assert tool.background is not None
        assert tool.background.options is options
    (request,) = llm.requests
    assert [tool.name for tool in request.tools] == DELEGATION_TOOLS
    assert "At most 1 of yours run at once" in request.tools[0].description
