"""What an ACP run keeps is bounded however much an agent sends, and what cannot be sent is refused.

* A flood of session updates, in a normal turn or right after ``session/cancel``, leaves the parent's
  peak memory bounded, while the result's output stays exactly the text streamed.
* The history a run keeps (``run.updates``) is its most recent ``max_kept_updates`` updates, the
  dropped ones counted; the final message is capped at ``max_output_chars``, past which the turn is
  cancelled and the result is an error saying so.
* A prompt too large for one message to the agent is never sent and never leaves anyone waiting.
* A command, environment or cwd that no process could receive is refused when the provider is built.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from subagent import ErrorCode, SubagentError, SubagentRequest, SubagentResult, SubagentService
from subagent.acp import schema
from subagent.acp.client import TurnOutput, final_message, spawn_agent
from subagent.cli._tool_call_tracker import ToolCalls
from subagent.providers.acp import AcpProvider, AcpRun, prompt_size_error
from subagent.testing.pytest_plugin import StubAgentCommand
from subagent.types import RUN_META_KEY, SubagentRunEndInfo
from tests.leaks import assert_no_leaks

WAIT: Final = 30  # seconds: a hang guard on a whole run, never a sleep
FAST: Final = {"stdin_close_timeout": 1.0, "sigterm_timeout": 1.0, "sigkill_timeout": 2.0}
FLOOD: Final = 300_000
# The parent's growth over a 300,000-chunk flood (see tests/memory_probe.py), measured on 2 cores,
# with the default bounds / when every update is kept (max_kept_updates=None):
# * small objects alive at once: ~35,000 / ~912,000 (growing with the flood);
# * C heap in use: ~2 MiB / ~7 MiB (the output's text, and the connection's reads, bounded at 16 MiB);
# * peak RSS: ~7 MiB / ~56 MiB.
# Each bound sits well above the bounded figure, and the first and last well below the unbounded one.
FLOOD_BLOCKS_BOUND: Final = 300_000
FLOOD_HEAP_BOUND_MIB: Final = 64
FLOOD_RSS_BOUND_MIB: Final = 40


@pytest.fixture
def stub(stub_agent_command: StubAgentCommand) -> StubAgentCommand:
    """argv running the stub agent with `scenario` (the plugin's fixture, as users get it)."""
    return stub_agent_command


@asynccontextmanager
async def service_with(
    provider: AcpProvider,
) -> AsyncIterator[tuple[SubagentService, list[SubagentRunEndInfo]]]:
    """An open service with `provider`, recording end events; nothing may leak."""
    ends: list[SubagentRunEndInfo] = []
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        service.events.on("subagent/end", ends.append)
        yield service, ends


def provider_for(command: list[str], tmp_path: Path, **options: Any) -> AcpProvider:
    options.setdefault("process_options", FAST)
    return AcpProvider(command, cwd=tmp_path, **options)


def numbered(count: int, start: int = 0) -> str:
    """What a flood step with text "{i} " streams."""
    return "".join(f"{i} " for i in range(start, count))


# -- a flood, measured in a parent process of its own -------------------------------------------------------


@pytest.mark.subprocess
@pytest.mark.skipif(sys.platform != "linux", reason="the probe reads its resident size from /proc")
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("after_cancel", [False, True], ids=["in-a-turn", "after-session-cancel"])
def test_a_flood_of_300000_chunks_leaves_the_parents_memory_bounded_and_the_output_exact(
    tmp_path: Path, backend: str, after_cancel: bool
) -> None:
    config = {"work": str(tmp_path), "count": FLOOD, "afterCancel": after_cancel, "backend": backend}
    completed = subprocess.run(
        [sys.executable, "-m", "tests.memory_probe", json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=240,  # a hang guard: the flood takes a few seconds
        cwd=Path(__file__).resolve().parent.parent,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    figures = json.loads(completed.stdout)
    # The output is exact: every chunk, in order, though 290,000 of the updates were let go.
    expected = ("started " if after_cancel else "") + numbered(FLOOD)
    chunks = FLOOD + (1 if after_cancel else 0)
    assert figures["stopReason"] == ("cancelled" if after_cancel else "completed")
    assert figures["error"] is None
    assert (figures["outputLength"], figures["outputSha256"]) == (
        len(expected),
        hashlib.sha256(expected.encode()).hexdigest(),
    )
    assert (figures["updateCount"], figures["kept"], figures["dropped"]) == (chunks, 10_000, chunks - 10_000)
    assert figures["blocksGrowth"] < FLOOD_BLOCKS_BOUND, figures
    assert figures["heapGrowthKib"] < FLOOD_HEAP_BOUND_MIB * 1024, figures
    assert figures["rssGrowthKib"] < FLOOD_RSS_BOUND_MIB * 1024, figures


# -- the kept history and the output ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_past_max_kept_updates_the_oldest_are_dropped_and_counted_and_the_output_stays_exact(
    stub: StubAgentCommand, tmp_path: Path
) -> None:
    command = stub(
        {
            "turns": [
                [
                    {"step": "message", "text": "Let me look."},
                    {"step": "tool_call", "toolCallId": "c1", "title": "Look"},
                    {"step": "flood", "count": 50, "text": "{i} "},
                ]
            ]
        }
    )
    provider = provider_for(command, tmp_path, max_kept_updates=5)
    async with service_with(provider) as (service, ends), service.start("acp", SubagentRequest("go")) as run:
        with anyio.fail_after(WAIT):
            result = await run.result()
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        # The tool call fell out of the history long ago; the answer after it is whole all the same.
        assert result == SubagentResult(output=numbered(50), stop_reason="completed")
        assert acp_run.output == numbered(50)
        assert [update.content for update in acp_run.updates] == [  # type: ignore[union-attr]
            schema.TextContent(text=f"{i} ") for i in range(45, 50)
        ]
        assert (acp_run.update_count, acp_run.updates_dropped) == (52, 47)
    assert [end.last_assistant_message for end in ends] == [numbered(50)]


@pytest.mark.anyio
async def test_a_message_past_max_output_chars_cancels_the_turn_and_is_an_error_cut_at_the_limit(
    stub: StubAgentCommand, tmp_path: Path
) -> None:
    # The agent answers only once it is cancelled: the overflow must have sent session/cancel.
    command = stub(
        {"turns": [[{"step": "flood", "count": 1000, "text": "{i} "}, {"step": "wait_for_cancel"}]]}
    )
    provider = provider_for(command, tmp_path, max_output_chars=100)
    async with service_with(provider) as (service, _), service.start("acp", SubagentRequest("go")) as run:
        with anyio.fail_after(WAIT):
            result = await run.result()
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        assert acp_run.update_count == 1000  # what came after the cut was read, and not kept
    assert result.stop_reason == "error"
    assert result.output == numbered(1000)[:100]
    assert result.error == (
        "the agent's message went past the output limit of 100 characters (max_output_chars), "
        "so the turn was cancelled; the output is cut at the limit"
    )


@pytest.mark.anyio
async def test_an_agent_that_ignores_the_cancel_after_an_overflow_is_torn_down_and_the_result_says_why(
    stub: StubAgentCommand, tmp_path: Path
) -> None:
    command = stub({"turns": [[{"step": "flood", "count": 100, "text": "{i} "}, {"step": "hang"}]]})
    provider = provider_for(command, tmp_path, max_output_chars=50, cancel_grace=0.5)
    async with service_with(provider) as (service, _), service.start("acp", SubagentRequest("go")) as run:
        with anyio.fail_after(WAIT):
            result = await run.result()
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
            await acp_run.wait_child_exited()
    assert (result.stop_reason, result.output) == ("error", numbered(100)[:50])
    assert result.error is not None
    assert "max_output_chars" in result.error


def test_the_turn_output_is_exact_up_to_its_limit_cut_there_and_marked_for_the_rest_of_the_turn() -> None:
    def chunk(text: str) -> schema.AgentMessageChunk:
        return schema.AgentMessageChunk(content=schema.TextContent(text=text))

    output = TurnOutput(limit=10)
    output.add(chunk("narration that is long"))
    assert (output.text, output.truncated) == ("narration ", True)
    output.add(schema.ToolCall(tool_call_id="c1", title="Look"))
    output.add(chunk("ab"))
    output.add(schema.AgentThoughtChunk(content=schema.TextContent(text="not the answer")))
    output.add(chunk("é€😀"))  # characters, not bytes
    assert (output.text, output.length, output.truncated) == ("abé€😀", 5, True)
    unlimited = TurnOutput(limit=None)
    for index in range(20_000):  # past the chunks joined into one block at a time
        unlimited.add(chunk(f"{index},"))
        if index == 5000:
            unlimited.add(schema.ToolCallProgress(tool_call_id="c1", status="completed"))
    expected = "".join(f"{i}," for i in range(5001, 20_000))
    assert (unlimited.text, unlimited.text, unlimited.truncated) == (expected, expected, False)
    unlimited.add(chunk("end"))
    assert (unlimited.text, unlimited.length) == (expected + "end", len(expected) + 3)


def test_a_run_reported_below_the_agent_does_not_cut_its_message_in_two_but_its_own_tool_calls_do() -> None:
    def chunk(text: str) -> schema.AgentMessageChunk:
        return schema.AgentMessageChunk(content=schema.TextContent(text=text))

    run_meta = {RUN_META_KEY: {"runId": "spawn-1", "parentId": "S", "state": "running"}}
    output = TurnOutput(limit=None)
    output.add(chunk("While they work, "))
    output.add(schema.ToolCall(tool_call_id="run/spawn-1", title="spawn subagent: A", meta=run_meta))
    output.add(schema.ToolCallProgress(tool_call_id="run/spawn-1", status="completed", meta=run_meta))
    output.add(chunk("I check on them."))
    assert [message.text for message in output.messages] == ["While they work, I check on them."]
    output.add(schema.ToolCall(tool_call_id="c1", title="Look", meta={"other": 1}))
    output.add(chunk("Done."))
    assert [message.text for message in output.messages] == ["While they work, I check on them.", "Done."]


# -- prompts too large to send ------------------------------------------------------------------------------

SMALL_LIMIT: Final = 64 * 1024


@pytest.mark.anyio
async def test_a_prompt_too_large_to_send_fails_the_start_before_any_child_is_spawned(
    stub: StubAgentCommand, tmp_path: Path
) -> None:
    provider = provider_for(stub({}), tmp_path, max_line_bytes=SMALL_LIMIT)
    prompt = "x" * SMALL_LIMIT
    async with (
        service_with(provider) as (service, ends),
        service.start("acp", SubagentRequest(prompt)) as run,
    ):
        with anyio.fail_after(WAIT), pytest.raises(SubagentError) as failed:
            await run.started()
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        assert acp_run.pid is None  # never spawned
    assert failed.value.code == ErrorCode.START_FAILED
    assert failed.value.message == (
        f"agent `{acp_run.command_line}` was not started: the prompt is {SMALL_LIMIT + 113:,} bytes as a "
        "session/prompt message, over the 65,536-byte limit on one message to the agent (max_line_bytes)"
    )
    assert ends == []


@pytest.mark.anyio
async def test_a_resumed_prompt_too_large_to_send_is_an_error_result_and_the_session_goes_on(
    stub: StubAgentCommand, tmp_path: Path
) -> None:
    command = stub({"turns": [[{"step": "echo", "prefix": "got: "}]]})
    provider = provider_for(command, tmp_path, max_line_bytes=SMALL_LIMIT)
    # Passes the check made before sending (which counts an empty session id), and is refused by the
    # connection by the length of the stub's session id: either way, it is never sent.
    fits_only_without_session_id = "y" * (SMALL_LIMIT - 111 - 2)
    assert prompt_size_error(fits_only_without_session_id, SMALL_LIMIT) is None
    async with service_with(provider) as (service, _), service.start("acp", SubagentRequest("hi")) as run:
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        with anyio.fail_after(WAIT):
            assert (await run.result()).output == "got: hi"
            too_large = await acp_run.resume("z" * SMALL_LIMIT)
            refused_on_send = await acp_run.resume(fits_only_without_session_id)
            after = await acp_run.resume("again")
    assert (too_large.stop_reason, too_large.output) == ("error", "")
    assert too_large.error is not None
    assert too_large.error.startswith(
        f"not sent: the prompt is {SMALL_LIMIT + 113:,} bytes as a session/prompt"
    )
    assert (refused_on_send.stop_reason, refused_on_send.error) == (
        "error",
        f"not sent: the prompt is {SMALL_LIMIT + len('session-1'):,} bytes as a session/prompt message, "
        "over the 65,536-byte limit on one message to the agent (max_line_bytes)",
    )
    assert after == SubagentResult(output="got: again", stop_reason="completed")


def test_the_prompt_size_check_counts_json_escapes_and_names_the_limit() -> None:
    limit = 1024 * 1024
    assert prompt_size_error("a" * (limit - 113), limit) is None
    assert prompt_size_error("a" * (limit - 112), limit) == (
        f"the prompt is {limit + 1:,} bytes as a session/prompt message, over the 1,048,576-byte (1 MiB) "
        "limit on one message to the agent (max_line_bytes)"
    )
    # A control character is 6 bytes as JSON ("\u0001"), a quote 2 ("\""): both count as sent.
    assert prompt_size_error("\x01" * (limit // 6), limit) is not None
    assert prompt_size_error('"' * (limit // 2), limit) is not None
    assert prompt_size_error("é" * (limit // 2 - 100), limit) is None  # 2 bytes of UTF-8, unescaped


# -- what no process could receive --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"command": ["agent", "a\0b"]}, ValueError, "command[1] contains a NUL character"),
        ({"command": ["agent\0"]}, ValueError, "command[0] contains a NUL character"),
        ({"command": ["agent", 3]}, TypeError, "command[1] must be a string or a path, not int"),
        ({"env": {"A=B": "x"}}, ValueError, "environment name 'A=B' cannot be passed to a program"),
        ({"env": {"": "x"}}, ValueError, "environment name '' cannot be passed to a program"),
        ({"env": {"A\0": "x"}}, ValueError, "environment name 'A\\x00' cannot be passed to a program"),
        ({"env": {"TOKEN": "se\0cret"}}, ValueError, "environment variable 'TOKEN' has a NUL character"),
        ({"env": {"N": 1}}, TypeError, "environment variable 'N' must have a string value, not int"),
        ({"env": {1: "x"}}, TypeError, "environment names must be strings, not int"),
        ({"cwd": "/tmp/a\0b"}, ValueError, "cwd contains a NUL character"),
        ({"fs_roots": ["/ok", "/a\0"]}, ValueError, "fs_roots[1] contains a NUL character"),
        ({"max_kept_updates": -1}, ValueError, "max_kept_updates must be an int >= 0 or None"),
        ({"max_output_chars": 1.5}, ValueError, "max_output_chars must be an int >= 0 or None"),
        ({"max_line_bytes": 0}, ValueError, "max_line_bytes must be an int >= 1, got 0"),
    ],
)
def test_a_provider_that_could_not_start_its_agent_intact_is_refused_at_construction(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    command = options.pop("command", ["agent"])
    with pytest.raises(error) as refused:
        AcpProvider(command, **options)
    assert message in str(refused.value)
    assert "se\0cret" not in str(refused.value)  # a value is never repeated: it may be a secret


@pytest.mark.anyio
async def test_a_request_cwd_with_a_nul_fails_the_start_before_any_child_is_spawned(
    stub: StubAgentCommand, tmp_path: Path
) -> None:
    provider = provider_for(stub({}), tmp_path)
    request = SubagentRequest("hi", cwd=f"{tmp_path}/a\0b")
    async with service_with(provider) as (service, _), service.start("acp", request) as run:
        with anyio.fail_after(WAIT), pytest.raises(SubagentError) as failed:
            await run.started()
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        assert acp_run.pid is None
    assert failed.value.code == ErrorCode.START_FAILED
    assert failed.value.message == (
        f"agent `{acp_run.command_line}` was not started: its cwd {request.cwd!r} has a NUL character"
    )


def test_the_command_line_remembers_a_bounded_number_of_tool_calls_the_most_recent() -> None:
    calls = ToolCalls(limit=100)
    for index in range(5000):
        calls.observe(schema.ToolCall(tool_call_id=f"call-{index}", title=f"Step {index}"))
    calls.observe(schema.ToolCall(tool_call_id="call-4900", title="Step 4900 again"))  # now the most recent
    calls.observe(schema.ToolCall(tool_call_id="call-5000", title="Step 5000"))
    assert len(calls) == 100
    assert calls.get("call-4899") is None
    assert calls.get("call-4901") is None  # the oldest once call-4900 was announced again
    assert calls.get("call-4902") is not None
    state = calls.get("call-4900")
    assert state is not None
    assert state.title == "Step 4900 again"


@pytest.mark.anyio
async def test_a_loaded_sessions_replay_keeps_its_most_recent_updates(
    stub: StubAgentCommand, tmp_path: Path
) -> None:
    chunk = {"sessionUpdate": "agent_message_chunk"}
    replay = [{**chunk, "content": {"type": "text", "text": f"{i} "}} for i in range(50)]
    command = stub({"loadSession": {"replay": replay}})
    async with assert_no_leaks(), spawn_agent(command, cwd=tmp_path, max_kept_updates=5) as client:
        with anyio.fail_after(WAIT):
            await client.initialize()
            session = await client.load_session("old-session", tmp_path)
    assert [update.content for update in session.replayed] == [  # type: ignore[union-attr]
        schema.TextContent(text=f"{i} ") for i in range(45, 50)
    ]


_PIECES = st.one_of(
    st.text(max_size=8).map(lambda text: schema.AgentMessageChunk(content=schema.TextContent(text=text))),
    st.text(max_size=8).map(lambda text: schema.AgentThoughtChunk(content=schema.TextContent(text=text))),
    st.just(schema.ToolCall(tool_call_id="c", title="Call")),
    st.just(schema.ToolCallProgress(tool_call_id="c", status="completed")),
    st.just(schema.AgentMessageChunk(content=schema.ResourceLink(name="n", uri="file:///n"))),
)


@given(updates=st.lists(_PIECES, max_size=60), limit=st.one_of(st.none(), st.integers(0, 40)))
def test_the_turn_output_is_the_final_message_cut_at_its_limit(
    updates: list[schema.SessionUpdate], limit: int | None
) -> None:
    output = TurnOutput(limit)
    for update in updates:
        output.add(update)
    whole = final_message(updates)
    assert output.text == (whole if limit is None else whole[:limit])
    assert output.length == len(output.text)
    # Marked once any message (the text between two tool calls) went past the limit.
    segments = [0]
    for update in updates:
        if isinstance(update, schema.ToolCall | schema.ToolCallProgress):
            segments.append(0)
        elif isinstance(update, schema.AgentMessageChunk) and isinstance(update.content, schema.TextContent):
            segments[-1] += len(update.content.text)
    assert output.truncated == (limit is not None and max(segments) > limit)


# -- a turn's messages --------------------------------------------------------------------------------------

_CHUNKS_WITH_IDS = st.one_of(
    st.tuples(st.text(max_size=8), st.sampled_from([None, "m1", "m2", "m3"])).map(
        lambda pair: schema.AgentMessageChunk(content=schema.TextContent(text=pair[0]), message_id=pair[1])
    ),
    st.just(schema.ToolCall(tool_call_id="c", title="Call")),
    st.just(schema.AgentThoughtChunk(content=schema.TextContent(text="thinking"), message_id="t")),
    st.just(
        schema.AgentMessageChunk(content=schema.ResourceLink(name="n", uri="file:///n"), message_id="m9")
    ),
)


def reference_messages(
    updates: list[schema.SessionUpdate],
) -> tuple[list[tuple[str | None, str]], tuple[str | None, str]]:
    """The spec, with no bounds: the finished messages and the open one (id, text). A message ends at a
    tool call or at a chunk whose messageId differs from the open message's; a chunk without one joins
    the open message (which takes the first id it sees); a message with no text is not kept."""
    finished: list[tuple[str | None, str]] = []
    current_id: str | None = None
    text = ""
    for update in updates:
        ends = isinstance(update, schema.ToolCall) or (
            isinstance(update, schema.AgentMessageChunk)
            and update.message_id is not None
            and current_id is not None
            and update.message_id != current_id
        )
        if ends:
            if text:
                finished.append((current_id, text))
            current_id, text = None, ""
        if isinstance(update, schema.AgentMessageChunk):
            current_id = update.message_id if update.message_id is not None else current_id
            if isinstance(update.content, schema.TextContent):
                text += update.content.text
    return finished, (current_id, text)


@given(
    updates=st.lists(_CHUNKS_WITH_IDS, max_size=60),
    limit=st.one_of(st.none(), st.integers(0, 40)),
    max_messages=st.one_of(st.none(), st.integers(0, 5)),
)
def test_the_turn_messages_split_at_tool_calls_and_new_message_ids_within_their_bounds(
    updates: list[schema.SessionUpdate], limit: int | None, max_messages: int | None
) -> None:
    output = TurnOutput(limit, max_messages=max_messages)
    for update in updates:
        output.add(update)
    finished, (open_id, open_text) = reference_messages(updates)

    def cut(text: str) -> str:
        return text if limit is None else text[:limit]

    assert final_message(updates) == open_text
    assert (output.text, output.message_id) == (cut(open_text), open_id)
    # The earlier messages kept: the longest run of the most recent that fits both bounds.
    kept: list[tuple[str | None, str]] = []
    for message_id, text in reversed(finished):
        too_many = max_messages is not None and len(kept) >= max_messages
        too_long = limit is not None and sum(len(cut(t)) for _, t in kept) + len(cut(text)) > limit
        if too_many or too_long:
            break
        kept.insert(0, (message_id, text))
    expected = kept + ([(open_id, open_text)] if open_text else [])
    assert [(m.message_id, m.text, m.truncated) for m in output.messages] == [
        (message_id, cut(text), cut(text) != text) for message_id, text in expected
    ]
    assert output.messages_dropped == len(finished) - len(kept)
