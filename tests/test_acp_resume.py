"""The ACP provider's half of resuming a journaled run (issue 26): `AcpProvider.describe_agent`,
`AcpRun.checkpoint` and `AcpProvider.reopen`, against the stub agent (served in process, and as a real child
process where the process is the point: a killed agent, a child torn down after a refusal).

A run is started as the service starts one; what the journal would keep of it (its checkpoint and the
provider's description of its agent, through JSON) makes the `ResumePoint` a new provider instance reopens.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import anyio
import pytest

from subagent import ErrorCode, SubagentError, SubagentRequest, SubagentResult, SubagentService, Usage
from subagent.acp import schema
from subagent.acp.client import spawn_agent
from subagent.acp.transports import transport_from_url
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.testing import StubAgentTransport
from subagent.types import BUDGET_META_KEY, Budget, CheckpointedRun, ReopenableProvider, ResumePoint
from tests.leaks import assert_no_leaks

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

WAIT: Final = 20  # seconds: a bound on a whole run, never a sleep
FAST: Final = {"stdin_close_timeout": 1.0, "sigterm_timeout": 1.0, "sigkill_timeout": 2.0}
JOURNAL_ID: Final = "3f2a9c1e"
SECRET: Final = "sk-secret-value-123"

ECHO_TURN: Final = [{"step": "echo", "prefix": "you said: "}]
REPLAY: Final = [
    {"sessionUpdate": "user_message_chunk", "content": {"type": "text", "text": "first prompt"}},
    {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "first answer"}},
    {"sessionUpdate": "tool_call", "toolCallId": "call-1", "title": "Read notes.txt", "status": "completed"},
    {"sessionUpdate": "usage_update", "used": 900, "size": 1000, "cost": {"amount": 5.0, "currency": "USD"}},
]


class StubCommand(list[str]):
    """argv running the stub agent on ``scenario``; `provider_for` serves it in process unless told not to."""

    def __init__(self, argv: list[str], scenario: dict[str, Any]) -> None:
        super().__init__(argv)
        self.scenario = scenario


@pytest.fixture
def stub(tmp_path: Path) -> Callable[[dict[str, Any]], StubCommand]:
    """argv running the stub agent with a scenario (written under tmp_path)."""
    counter = iter(range(1000))

    def make(scenario: dict[str, Any]) -> StubCommand:
        path = tmp_path / f"scenario-{next(counter)}.json"
        path.write_text(json.dumps(scenario))
        argv = [sys.executable, "-m", "subagent.testing.stub_agent", "--scenario", str(path)]
        return StubCommand(argv, scenario)

    return make


def provider_for(
    command: StubCommand, cwd: Path, *, real_process: bool = False, **options: Any
) -> AcpProvider:
    """A provider running ``command``: its scenario served in process, unless ``real_process``."""
    if not real_process:
        options["transport"] = StubAgentTransport(
            command.scenario, stdin_close_timeout=1.0, sigterm_timeout=1.0
        )
    else:
        options["process_options"] = FAST
    return AcpProvider(command, cwd=cwd, **options)


def journaled(value: Any) -> Any:
    """``value`` as a JSON journal gives it back."""
    return json.loads(json.dumps(value))


async def first_run(
    provider: AcpProvider, prompt: str = "first prompt"
) -> tuple[SubagentResult, ResumePoint]:
    """One completed turn through the service, and the point a journal would have kept of it."""
    async with SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt=prompt)) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
            point = ResumePoint(
                run_id=JOURNAL_ID,
                checkpoint=journaled(acp_run.checkpoint()),
                agent=journaled(provider.describe_agent()),
                turns_completed=1,
            )
    return result, point


@asynccontextmanager
async def reopened(
    provider: AcpProvider, point: ResumePoint, prompt: str = "go on", **request: Any
) -> AsyncIterator[AcpRun]:
    """The run ``provider`` reopens from ``point``, disposed on the way out."""
    async with anyio.create_task_group() as task_group:
        run = provider.reopen(SubagentRequest(prompt=prompt, **request), point, task_group)
        async with run:
            yield run


def stderr_lines() -> tuple[list[str], Callable[[str], None]]:
    """A list, and the ``on_stderr_line`` that fills it with the stub agent's reports."""
    lines: list[str] = []
    return lines, lambda line: lines.append(line) if line.startswith("stub agent:") else None


# -- reopening --------------------------------------------------------------------------------------------


async def test_a_run_reopened_with_session_resume_runs_the_new_prompt_in_the_old_session_and_goes_on(
    stub: Callable[[dict[str, Any]], StubCommand], tmp_path: Path
) -> None:
    # The agent offers both: resume is chosen, as it replays nothing.
    command = stub({"resumeSession": {}, "loadSession": {"replay": REPLAY}, "turns": [ECHO_TURN]})
    first, point = await first_run(provider_for(command, tmp_path))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    lines, on_stderr_line = stderr_lines()
    provider = provider_for(command, elsewhere, on_stderr_line=on_stderr_line)  # a new instance, another cwd
    assert isinstance(provider, ReopenableProvider)
    async with assert_no_leaks(), reopened(provider, point) as run:
        assert isinstance(run, CheckpointedRun)
        with anyio.fail_after(WAIT):
            await run.started()
            result = await run.result()
            second = await run.resume("and more")
        checkpoint = run.checkpoint()
    assert first == SubagentResult(output="you said: first prompt", stop_reason="completed")
    assert point.checkpoint == {"sessionId": "session-1", "cwd": str(tmp_path)}
    # The session the checkpoint names, in its own cwd (not the new provider's).
    assert lines == [f"stub agent: session/resume session-1 {tmp_path}"]
    assert run.reopened_with == "session/resume"
    assert (run.session_id, checkpoint) == ("session-1", point.checkpoint)
    assert result == SubagentResult(output="you said: go on", stop_reason="completed")
    assert second == SubagentResult(output="you said: and more", stop_reason="completed")
    assert run.replayed == []


async def test_a_run_reopened_with_session_load_keeps_the_replayed_conversation_out_of_its_turn(
    stub: Callable[[dict[str, Any]], StubCommand], tmp_path: Path
) -> None:
    turn = [
        *ECHO_TURN,
        {"step": "usage", "used": 950, "size": 1000, "cost": {"amount": 5.5, "currency": "USD"}},
        {"step": "stop", "usage": {"totalTokens": 30, "inputTokens": 20, "outputTokens": 10}},
    ]
    command = stub({"loadSession": {"replay": REPLAY}, "turns": [turn]})
    _, point = await first_run(provider_for(command, tmp_path))
    lines, on_stderr_line = stderr_lines()
    provider = provider_for(command, tmp_path, on_stderr_line=on_stderr_line)
    async with assert_no_leaks(), reopened(provider, point) as run:
        seen: list[schema.SessionUpdate] = []
        run.on_update(seen.append)  # before its task runs: nothing of the run is missed
        with anyio.fail_after(WAIT):
            result = await run.result()
    # A new run of the same scenario: what the reopened run's turn must be, the replay aside.
    async with SubagentService() as service:
        service.register_provider(provider_for(command, tmp_path))
        async with service.start("acp", SubagentRequest(prompt="go on")) as fresh:
            with anyio.fail_after(WAIT):
                expected = await fresh.result()
    assert lines == [f"stub agent: session/load session-1 {tmp_path}"]
    assert run.reopened_with == "session/load"
    assert run.replayed == [schema.decode(json.dumps(update), type=schema.SessionUpdate) for update in REPLAY]
    assert result == expected
    assert (result.output, result.stop_reason) == ("you said: go on", "completed")
    # The turn's own reports: the replay's (900 of the window, $5.00) are not the turn's.
    assert result.usage == Usage(
        input_tokens=20,
        output_tokens=10,
        total_tokens=30,
        context_used=950,
        context_size=1000,
        cost=5.5,
        cost_currency="USD",
    )
    assert [type(update) for update in run.updates] == [schema.AgentMessageChunk, schema.UsageUpdate]
    assert (run.update_count, seen) == (2, list(run.updates))
    assert run.messages[-1].text == "you said: go on"


async def test_a_reopened_session_is_set_to_the_providers_mode_and_config_options_as_a_new_one_is(
    stub: Callable[[dict[str, Any]], StubCommand], tmp_path: Path
) -> None:
    modes = {
        "currentModeId": "ask",
        "availableModes": [{"id": "ask", "name": "Ask"}, {"id": "code", "name": "Code"}],
    }
    options = [
        {
            "id": "model",
            "name": "Model",
            "category": "model",
            "type": "select",
            "currentValue": "small",
            "options": [{"value": "small", "name": "Small"}, {"value": "big", "name": "Big"}],
        }
    ]
    reopening = {"modes": modes, "configOptions": options}
    command = stub({"newSession": reopening, "resumeSession": reopening, "turns": [ECHO_TURN]})
    _, point = await first_run(provider_for(command, tmp_path))
    provider = provider_for(command, tmp_path, mode="code", config_options={"model": "big"})
    async with assert_no_leaks(), reopened(provider, point) as run:
        with anyio.fail_after(WAIT):
            result = await run.result()
    assert result == SubagentResult(output="you said: go on", stop_reason="completed")
    assert run.current_mode == "code"
    assert [(option.id, option.current_value) for option in run.config_options] == [("model", "big")]  # type: ignore[union-attr]


async def test_a_reopened_session_is_sent_the_runs_budget_and_additional_directories_as_a_new_one_is(
    stub: Callable[[dict[str, Any]], StubCommand], tmp_path: Path
) -> None:
    extra = tmp_path / "extra"
    extra.mkdir()
    capabilities: dict[str, Any] = {"sessionCapabilities": {"additionalDirectories": {}}}
    command = stub(
        {"initialize": {"agentCapabilities": capabilities}, "resumeSession": {}, "turns": [ECHO_TURN]}
    )
    _, point = await first_run(provider_for(command, tmp_path))
    transport = StubAgentTransport(command.scenario, record_sent=True)
    provider = AcpProvider(command, cwd=tmp_path, transport=transport)
    budget = Budget(max_tool_calls=5)
    async with (
        assert_no_leaks(),
        reopened(provider, point, budget=budget, additional_directories=[str(extra)]) as run,
    ):
        with anyio.fail_after(WAIT):
            result = await run.result()
    (resume,) = [
        message for message in transport.sent_messages() if message.get("method") == "session/resume"
    ]
    assert resume["params"] == {
        "sessionId": "session-1",
        "cwd": str(tmp_path),
        "additionalDirectories": [str(extra)],
        "mcpServers": [],
        "_meta": {BUDGET_META_KEY: {"maxToolCalls": 5}},
    }
    assert result.stop_reason == "completed"


async def test_a_run_whose_agent_was_killed_is_reopened_by_a_new_agent_process_and_nothing_is_left(
    stub: Callable[[dict[str, Any]], StubCommand], tmp_path: Path
) -> None:
    command = stub({"loadSession": {"replay": REPLAY}, "turns": [ECHO_TURN]})
    provider = provider_for(command, tmp_path, real_process=True)
    lines, on_stderr_line = stderr_lines()
    async with assert_no_leaks():
        async with SubagentService() as service:
            service.register_provider(provider)
            async with service.start(provider.name, SubagentRequest(prompt="first prompt")) as run:
                acp_run = run.provider_run
                assert isinstance(acp_run, AcpRun)
                with anyio.fail_after(WAIT):
                    await run.result()
                    checkpoint = acp_run.checkpoint()
                    acp_run.kill()  # the whole process group, at once: as the parent's death leaves it
                    await acp_run.wait_child_exited()
        point = ResumePoint(JOURNAL_ID, journaled(checkpoint), journaled(provider.describe_agent()), 1)
        again = provider_for(command, tmp_path, real_process=True, on_stderr_line=on_stderr_line)
        async with reopened(again, point) as resumed:
            with anyio.fail_after(WAIT):
                result = await resumed.result()
            pid = resumed.pid
    assert acp_run.exit_info is not None
    assert acp_run.exit_info.returncode == -9
    assert pid not in (None, acp_run.exit_info.pid)
    assert lines == [f"stub agent: session/load session-1 {tmp_path}"]
    assert result == SubagentResult(output="you said: go on", stop_reason="completed")
    assert [update.content.text for update in resumed.replayed[:2]] == ["first prompt", "first answer"]  # type: ignore[union-attr]


# -- refusals ---------------------------------------------------------------------------------------------


Refusal = tuple[dict[str, Any] | None, dict[str, Any], dict[str, Any], str]
"""A journaled checkpoint, a change to its agent's description, the request's options, and the refusal."""

REFUSALS: Final[dict[str, Refusal]] = {
    "no checkpoint": (None, {}, {}, f"run {JOURNAL_ID} never got a session from its agent"),
    "no session id": ({"cwd": "/srv"}, {}, {}, f"run {JOURNAL_ID} never got a session from its agent"),
    "another command": (
        {"sessionId": "session-1"},
        {"command": ["npx", "other-agent", "--acp"]},
        {},
        f"run {JOURNAL_ID} ran `npx other-agent --acp`, this provider runs `{{command}}`: its session "
        "belongs to that agent",
    ),
    "another transport": (
        {"sessionId": "session-1"},
        {"transport": "ssh://me@build-1:2222"},
        {},
        f"run {JOURNAL_ID} ran its agent on ssh://me@build-1:2222, this provider runs it on stub-agent: its "
        "session is kept where its agent ran",
    ),
    "isolation": (
        {"sessionId": "session-1"},
        {},
        {"isolation": "worktree"},
        f"run {JOURNAL_ID} ran in an isolated workspace (isolation='worktree'), which was closed with its "
        "child: a resumed session would not find the files it worked on",
    ),
}


async def test_a_run_whose_agent_never_gave_it_a_session_starts_afresh_in_a_new_one(
    stub: Callable[[dict[str, Any]], StubCommand], tmp_path: Path
) -> None:
    # Its agent died before answering session/new: none of its turns ran, so a new session loses nothing.
    command = stub({"resumeSession": {}, "turns": [ECHO_TURN]})
    lines, on_stderr_line = stderr_lines()
    provider = provider_for(command, tmp_path, on_stderr_line=on_stderr_line)
    point = ResumePoint(JOURNAL_ID, None, journaled(provider.describe_agent()), 0)
    async with assert_no_leaks(), reopened(provider, point, "the task, again") as run:
        with anyio.fail_after(WAIT):
            result = await run.result()
    assert run.reopened_with is None
    assert lines == []  # neither session/resume nor session/load
    assert run.checkpoint() == {"sessionId": "session-1", "cwd": str(tmp_path)}
    assert result == SubagentResult(output="you said: the task, again", stop_reason="completed")


async def test_a_journaled_runs_new_session_is_kept_before_its_first_prompt_is_sent(
    stub: Callable[[dict[str, Any]], StubCommand], tmp_path: Path
) -> None:
    from subagent.journal import RunJournal

    # The turn says one thing and hangs: by then the prompt was sent, so the session must be journaled.
    command = stub(
        {"resumeSession": {}, "turns": [[{"step": "message", "text": "Working."}, {"step": "hang"}]]}
    )
    path = tmp_path / "runs.db"
    journal = RunJournal.open(path)
    # The service's own note that the child is ready comes whenever its observer runs: here, never with
    # the session. What the journal holds of the session comes from the provider, before the prompt.
    ready = journal.record_running
    journal.record_running = lambda id, **_: ready(id, session_id=None, checkpoint=None)  # type: ignore[method-assign]
    async with SubagentService(journal=journal) as service:
        service.register_provider(provider_for(command, tmp_path))
        run = service.start("acp", SubagentRequest(prompt="a long task"))
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        said = anyio.Event()
        acp_run.on_update(lambda _update: said.set())
        with anyio.fail_after(WAIT):
            await said.wait()
        with RunJournal.open(path) as reader:  # another process's view: what is committed
            record = reader.get(run.journal_id or "")
        await run.dispose()
    journal.close()
    assert record is not None
    assert (record.session_id, record.checkpoint) == (
        "session-1",
        {"sessionId": "session-1", "cwd": str(tmp_path)},
    )


@pytest.mark.parametrize("case", REFUSALS)
async def test_reopen_refuses_a_run_it_cannot_continue_before_any_child_exists(
    stub: Callable[[dict[str, Any]], StubCommand], tmp_path: Path, case: str
) -> None:
    checkpoint, agent_change, request, message = REFUSALS[case]
    command = stub({"resumeSession": {}})
    provider = provider_for(command, tmp_path)
    point = ResumePoint(JOURNAL_ID, checkpoint, {**provider.describe_agent(), **agent_change}, 1)
    async with assert_no_leaks(), anyio.create_task_group() as task_group:
        with pytest.raises(SubagentError) as refused:
            provider.reopen(SubagentRequest(prompt="go on", **request), point, task_group)
    assert refused.value.code is ErrorCode.RESUME_UNSUPPORTED
    assert refused.value.message == message.format(command=shlex.join(command))
    assert refused.value.provider == "acp"
    transport = provider.transport
    assert isinstance(transport, StubAgentTransport)
    assert (transport.opened, provider.running, provider.waiting) == ([], 0, 0)


async def test_an_agent_offering_neither_resume_nor_load_fails_the_readiness_and_is_torn_down(
    stub: Callable[[dict[str, Any]], StubCommand], tmp_path: Path
) -> None:
    command = stub({"turns": [ECHO_TURN]})
    provider = provider_for(command, tmp_path, real_process=True)
    point = ResumePoint(
        JOURNAL_ID, {"sessionId": "session-1", "cwd": str(tmp_path)}, provider.describe_agent(), 1
    )
    async with assert_no_leaks(), reopened(provider, point) as run:
        with anyio.fail_after(WAIT):
            with pytest.raises(SubagentError) as failed:
                await run.started()
            with pytest.raises(SubagentError) as result_failed:
                await run.result()
            await run.wait_child_exited()
    assert failed.value.code is ErrorCode.RESUME_UNSUPPORTED
    assert (
        failed.value.message
        == f"agent `{shlex.join(command)}` offers neither session/resume nor session/load"
    )
    assert result_failed.value is failed.value
    assert run.exit_info is not None  # spawned, asked, and reaped
    assert (run.checkpoint(), run.reopened_with, provider.running) == (None, None, 0)


async def test_an_agent_that_does_not_know_the_session_fails_the_readiness_quoting_its_answer_redacted(
    stub: Callable[[dict[str, Any]], StubCommand], tmp_path: Path
) -> None:
    unknown = {"step": "error", "code": -32002, "message": "Resource not found", "data": {"key": SECRET}}
    command = stub({"resumeSession": {"steps": [unknown]}})
    provider = provider_for(command, tmp_path, env={"API_KEY": SECRET})
    point = ResumePoint(
        JOURNAL_ID, {"sessionId": "gone-7", "cwd": str(tmp_path)}, provider.describe_agent(), 1
    )
    async with assert_no_leaks(), reopened(provider, point) as run:
        with anyio.fail_after(WAIT), pytest.raises(SubagentError) as failed:
            await run.started()
    assert failed.value.code is ErrorCode.RESUME_UNSUPPORTED
    assert failed.value.message == (
        f"agent `{shlex.join(command)}` could not reopen session 'gone-7' of run {JOURNAL_ID}: it answered "
        'session/resume with error -32002: Resource not found ({"key": "[redacted]"}); last stderr: '
        f"stub agent: session/resume gone-7 {tmp_path}"
    )
    assert run.checkpoint() is None


# -- what the journal keeps -------------------------------------------------------------------------------


def test_describe_agent_says_the_command_transport_and_cwd_with_secrets_redacted(tmp_path: Path) -> None:
    command = ["agent", f"--token={SECRET}", "--short", "1"]
    env = {"TOKEN": SECRET, "FLAG": "1"}  # too short to be a secret: "1" stays
    local = AcpProvider(command, env=env, cwd=tmp_path)
    remote = AcpProvider(command, env=env, transport="ssh://me@build-1:2222")
    assert local.describe_agent() == {
        "command": ["agent", "--token=[redacted]", "--short", "1"],
        "transport": "local",
        "cwd": str(tmp_path),
    }
    assert remote.describe_agent() == {
        "command": ["agent", "--token=[redacted]", "--short", "1"],
        "transport": "ssh://me@build-1:2222",
        "cwd": None,
    }
    for provider in (local, remote):
        described = json.dumps(provider.describe_agent())
        assert SECRET not in described
        assert transport_from_url(provider.describe_agent()["transport"]).name == provider.transport.name


async def test_the_checkpoint_is_none_until_the_session_exists_and_names_it_from_then_on(
    stub: Callable[[dict[str, Any]], StubCommand], tmp_path: Path
) -> None:
    command = stub({"turns": [ECHO_TURN]})
    provider = provider_for(command, tmp_path)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go")) as run:
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
            before = acp_run.checkpoint()  # its task has not run yet: no child, no session
            with anyio.fail_after(WAIT):
                await run.started()
                ready = acp_run.checkpoint()
                await run.result()
            after = acp_run.checkpoint()
    assert before is None
    assert ready == after == {"sessionId": "session-1", "cwd": str(tmp_path)}


# -- a real agent -----------------------------------------------------------------------------------------

FIRST_PROMPT: Final = "Remember the word tangerine."
FIRST_ANSWER: Final = "I will remember tangerine."
SECOND_PROMPT: Final = "Which word did I ask you to remember?"
SECOND_ANSWER: Final = "You asked me to remember tangerine."


@pytest.mark.subprocess
@pytest.mark.real_agent
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the agent is the subject: its loop is its own
async def test_claude_code_resumed_after_its_parent_died_sends_the_model_the_earlier_conversation(
    tmp_path: Path,
) -> None:
    from subagent.testing import MessagesReply, MessagesRequest, serve_anthropic_messages
    from tests.leaks import LEAK_TAG_VARIABLE
    from tests.test_real_agents import SIDE_CALL, claude_env, make_agent

    command = make_agent("claude").command
    turns: dict[str, list[MessagesRequest]] = {FIRST_PROMPT: [], SECOND_PROMPT: []}
    answers = {FIRST_PROMPT: FIRST_ANSWER, SECOND_PROMPT: SECOND_ANSWER}

    def respond(request: MessagesRequest) -> MessagesReply:
        # A turn's call ends with the user's prompt; any other (a title, a prompt suggestion after the turn)
        # is Claude Code's own, and is answered with a short text.
        users = [message for message in request.messages if message.get("role") == "user"]
        prompt = (
            next((text for text in _texts(users[-1]["content"]) if text in turns), None) if users else None
        )
        if not request.tool_names or prompt is None:
            return MessagesReply(text=SIDE_CALL)
        turns[prompt].append(request)
        return MessagesReply(text=answers[prompt])

    home = tmp_path / "home"
    config_dir = home / ".claude"  # where Claude Code keeps its sessions: never the machine's own
    workdir = tmp_path / "work"
    workdir.mkdir()
    async with assert_no_leaks() as tag, serve_anthropic_messages(respond) as server:
        env = claude_env(home, server.base_url) | {
            "CLAUDE_CONFIG_DIR": str(config_dir),
            LEAK_TAG_VARIABLE: tag,
        }
        provider = AcpProvider(command, env=env, cwd=workdir)
        async with SubagentService() as service:
            service.register_provider(provider)
            async with service.start(provider.name, SubagentRequest(prompt=FIRST_PROMPT)) as run:
                acp_run = run.provider_run
                assert isinstance(acp_run, AcpRun)
                with anyio.fail_after(REAL_AGENT_BOUND):
                    first = await run.result()
                checkpoint = journaled(acp_run.checkpoint())
                described = journaled(provider.describe_agent())
                # The parent's death: its child's whole process group is killed, and nothing is said to it.
                acp_run.kill()
                with anyio.fail_after(WAIT):
                    await acp_run.wait_child_exited()
        assert acp_run.exit_info is not None
        assert acp_run.exit_info.returncode == -9
        transcripts = sorted(path.name for path in (config_dir / "projects").rglob("*.jsonl"))
        # A new provider, as a restarted parent makes from its configuration, reopens the session.
        again = AcpProvider(command, env=env, cwd=workdir)
        point = ResumePoint(JOURNAL_ID, checkpoint, described, 1)
        async with reopened(again, point, SECOND_PROMPT) as resumed:
            with anyio.fail_after(REAL_AGENT_BOUND):
                second = await resumed.result()
        # session/load, which it offers too, replays the whole conversation: both turns.
        async with spawn_agent(command, env=env, cwd=workdir) as client:
            with anyio.fail_after(REAL_AGENT_BOUND):
                await client.initialize()
                loaded = await client.load_session(checkpoint["sessionId"], checkpoint["cwd"])
    assert set(server.tunnels) <= {f"127.0.0.1:{server.port}"}, server.tunnels
    assert (first.output, first.stop_reason) == (FIRST_ANSWER, "completed")
    assert (second.output, second.stop_reason) == (SECOND_ANSWER, "completed")
    assert checkpoint == {"sessionId": acp_run.session_id, "cwd": str(workdir)}
    assert transcripts == [f"{acp_run.session_id}.jsonl"]
    assert resumed.reopened_with == "session/resume"  # it offers both: resume replays nothing
    assert (resumed.session_id, resumed.replayed) == (acp_run.session_id, [])
    # The model saw the earlier conversation in the resumed turn's request: the first prompt and its answer.
    assert [len(requests) for requests in turns.values()] == [1, 1]
    replayed = [
        (type(update).__name__, update.content.text)  # type: ignore[union-attr]
        for update in loaded.replayed
        if isinstance(update, schema.UserMessageChunk | schema.AgentMessageChunk)
    ]
    assert replayed == [
        ("UserMessageChunk", FIRST_PROMPT),
        ("AgentMessageChunk", FIRST_ANSWER),
        ("UserMessageChunk", SECOND_PROMPT),
        ("AgentMessageChunk", SECOND_ANSWER),
    ]
    (resumed_turn,) = turns[SECOND_PROMPT]
    conversation = [(message["role"], _texts(message["content"])) for message in resumed_turn.messages]
    assert [(role, text) for role, texts in conversation for text in texts if text in MARKERS] == [
        ("user", FIRST_PROMPT),
        ("assistant", FIRST_ANSWER),
        ("user", SECOND_PROMPT),
    ]


REAL_AGENT_BOUND: Final = 90.0  # seconds for one turn of a real agent, start to end: a hang guard
MARKERS: Final = {FIRST_PROMPT, FIRST_ANSWER, SECOND_PROMPT}


def _texts(content: Any) -> list[str]:
    """The texts of a Messages API message's content (a string, or a list of blocks)."""
    if isinstance(content, str):
        return [content]
    return [
        block.get("text", "") for block in content if isinstance(block, dict) and block.get("type") == "text"
    ]
