"""Real ACP agents, driven through `subagent run` for full turns against a fake model server on loopback.

* Claude Code, through ``claude-agent-acp`` (npm ``@agentclientprotocol/claude-agent-acp``), against the
  scripted Anthropic Messages server (`subagent.testing.anthropic_server`);
* Qwen Code (npm ``@qwen-code/qwen-code``, ``qwen --acp --auth-type openai``), against the scripted
  chat-completions server (`subagent.testing.chat_server`);
* Codex, through ``codex-acp`` (npm ``@zed-industries/codex-acp``), against the scripted Responses API
  server (`subagent.testing.responses_server`), with a ``[model_providers.stub]`` in its ``CODEX_HOME``.

`make interop` installs them, pinned, under ``.interop/``; without them (or without node) these tests are
skipped, or fail when ``SUBAGENT_REQUIRE_INTEROP`` is set (CI sets it). Each test runs the real CLI as a
subprocess, ``subagent run --json --events``, and asserts its exact outcome: the answer, a permission
question allowed and denied, and a turn cancelled by SIGINT while the model's answer is mid-stream.

Offline by construction: every model base URL points at the fake server, each run has its own empty HOME,
telemetry, update checks and side traffic are switched off, and ``HTTPS_PROXY`` / ``HTTP_PROXY`` point
at the fake server too, which tunnels only to itself: an agent that honours them and tries any other
host shows up in ``server.tunnels``, and each test asserts that nothing did.

The model's side of a turn is decided from each request, not from its position (agents make calls of
their own): a request offering no tools is a side call (a title, a summary) and gets a short text; a
request whose last message carries a tool result gets the closing text, which depends on whether the
file was really written; any other request starts the turn.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from subagent.testing.anthropic_server import (
    MessagesReply,
    MessagesRequest,
    ToolUse,
    serve_anthropic_messages,
)
from subagent.testing.chat_server import (
    ReceivedRequest,
    StreamedReply,
    ToolCallReply,
    serve_chat_completions,
)
from subagent.testing.responses_server import (
    FunctionCall,
    ResponsesReply,
    ResponsesRequest,
    serve_responses,
)
from tests.leaks import LEAK_TAG_VARIABLE, assert_no_leaks, leaked_processes

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess, pytest.mark.real_agent]

ROOT: Final = Path(__file__).resolve().parent.parent
INTEROP: Final = ROOT / ".interop"
CLAUDE_ACP: Final = INTEROP / "claude-agent-acp/node_modules" / "@agentclientprotocol" / "claude-agent-acp"
CLAUDE_ACP_SCRIPT: Final = CLAUDE_ACP / "dist" / "index.js"
CODEX_ACP: Final = INTEROP / "codex-acp/node_modules/@zed-industries/codex-acp/bin/codex-acp.js"
QWEN_CODE: Final = INTEROP / "qwen-code" / "node_modules" / "@qwen-code" / "qwen-code" / "cli.js"
NODE: Final = shutil.which("node")
RUN_BOUND: Final = 90.0  # seconds for one CLI run, start to exit: a hang guard on a loaded machine
MAX_STDERR_LINE: Final = 16 * 1024 * 1024

# What the fake model says.
ANSWER: Final = ("The answer ", "is 42.")
PREAMBLE: Final = "I will write hello.txt."
WRITTEN: Final = "hello.txt is written."
NOT_WRITTEN: Final = "hello.txt was not written."
SIDE_CALL: Final = "Stub title"
STALLED: Final = "Let me think"
CONTENT: Final = "hello from the fake model\n"


@pytest.fixture
def anyio_backend() -> str:
    """One backend: what is under test is the CLI subprocess, whose loop is its own; the fake servers run
    on both backends in their own tests."""
    return "asyncio"


@dataclass(frozen=True, slots=True)
class Turn:
    """What the fake model does when a turn starts: answer, ask to write a file, or stall mid-answer."""

    write: Path | None = None
    stall: bool = False


class Served(Protocol):
    """A running fake model server, as the tests look at it."""

    @property
    def port(self) -> int: ...

    @property
    def tunnels(self) -> list[str]: ...


Serve = Callable[["Turn", Path], AbstractAsyncContextManager[tuple[Served, dict[str, str], "ModelLog"]]]
"""Serves the fake model for one turn, given the turn and the agent's HOME: (server, env, log)."""


@dataclass
class Agent:
    """A real agent: how to start it, and how to serve its model and set its environment for one turn."""

    name: str
    command: list[str]
    serve: Serve


@dataclass
class ModelLog:
    """What the fake model saw: the tool results it was sent, and the stalled request, once one hangs."""

    tool_results: list[str] = field(default_factory=list)
    stalled: list[anyio.Event] = field(default_factory=list)
    started: int = 0


def require(script: Path) -> list[str]:
    """The agent's command line, or skip (fail under SUBAGENT_REQUIRE_INTEROP) when it is not installed."""
    if NODE is None or not script.is_file():
        reason = f"the real agent is not installed (run `make interop`): {script.relative_to(ROOT)}"
        if os.environ.get("SUBAGENT_REQUIRE_INTEROP"):
            pytest.fail(reason)
        pytest.skip(reason)
    return [NODE, str(script)]


def base_env(home: Path, server_url: str) -> dict[str, str]:
    """A clean environment (no key or config of whoever runs the tests), proxied to the fake server."""
    for name in (".config", ".cache", ".local/share", ".local/state", "tmp"):
        (home / name).mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TMPDIR": str(home / "tmp"),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_STATE_HOME": str(home / ".local/state"),
        "HTTPS_PROXY": server_url,
        "HTTP_PROXY": server_url,
        "https_proxy": server_url,
        "http_proxy": server_url,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


# -- Claude Code -----------------------------------------------------------------------------------------


@asynccontextmanager
async def serve_claude(turn: Turn, home: Path) -> AsyncIterator[tuple[Served, dict[str, str], ModelLog]]:
    log = ModelLog()

    def respond(request: MessagesRequest) -> MessagesReply:
        if not request.tool_names:
            return MessagesReply(text=SIDE_CALL)
        if results := request.tool_results:
            log.tool_results += [_text_of(result.get("content")) for result in results]
            return MessagesReply(text=WRITTEN if turn.write and turn.write.exists() else NOT_WRITTEN)
        log.started += 1
        if turn.stall:
            log.stalled.append(request.disconnected)
            # message_start, content_block_start, the first text_delta: then nothing more.
            return MessagesReply(text=(STALLED, " some more"), stall_after=3)
        if turn.write is not None:
            use = ToolUse("toolu_stub_1", "Write", {"file_path": str(turn.write), "content": CONTENT})
            return MessagesReply(text=PREAMBLE, tool_uses=[use])
        return MessagesReply(text=ANSWER)

    async with serve_anthropic_messages(respond) as server:
        env = base_env(home, server.base_url)
        env |= {
            "ANTHROPIC_BASE_URL": server.base_url,
            "ANTHROPIC_API_KEY": "sk-ant-stub-not-a-key",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        if os.geteuid() == 0:
            env["IS_SANDBOX"] = "1"  # Claude Code refuses to run as root outside a declared sandbox
        yield server, env, log


# -- Qwen Code -------------------------------------------------------------------------------------------


@asynccontextmanager
async def serve_qwen(turn: Turn, home: Path) -> AsyncIterator[tuple[Served, dict[str, str], ModelLog]]:
    log = ModelLog()

    def respond(request: ReceivedRequest) -> StreamedReply:
        body = request.json
        messages = body.get("messages") or [{}]
        if not body.get("tools"):
            return StreamedReply(text=SIDE_CALL)
        if messages[-1].get("role") == "tool":
            log.tool_results.append(_text_of(messages[-1].get("content")))
            return StreamedReply(text=WRITTEN if turn.write and turn.write.exists() else NOT_WRITTEN)
        log.started += 1
        if turn.stall:
            log.stalled.append(request.disconnected)
            return StreamedReply(text=(STALLED, " some more"), stall_after=2)  # the role chunk, one text
        if turn.write is not None:
            arguments = json.dumps({"file_path": str(turn.write), "content": CONTENT})
            return StreamedReply(
                text=PREAMBLE, tool_calls=[ToolCallReply("call_stub_1", "write_file", arguments)]
            )
        return StreamedReply(text=ANSWER)

    async with serve_chat_completions(responder=respond) as server:
        # Qwen Code's usage statistics go to a host of their own unless switched off in its settings.
        settings = {
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            "general": {"enableAutoUpdate": False},
        }
        (home / ".qwen").mkdir(parents=True)
        (home / ".qwen" / "settings.json").write_text(json.dumps(settings))
        env = base_env(home, server.base_url.removesuffix("/v1"))
        env |= {
            "OPENAI_BASE_URL": server.base_url,
            "OPENAI_API_KEY": "sk-stub-not-a-key",
            "OPENAI_MODEL": "stub-model",
            "QWEN_CODE_DISABLE_PRECONNECT": "1",
        }
        yield server, env, log


# -- Codex -----------------------------------------------------------------------------------------------


@asynccontextmanager
async def serve_codex(turn: Turn, home: Path) -> AsyncIterator[tuple[Served, dict[str, str], ModelLog]]:
    log = ModelLog()

    def respond(request: ResponsesRequest) -> ResponsesReply:
        if not request.tool_names:
            return ResponsesReply(text=SIDE_CALL)
        if outputs := request.function_call_outputs:
            log.tool_results += [_text_of(output.get("output")) for output in outputs]
            return ResponsesReply(text=WRITTEN if turn.write and turn.write.exists() else NOT_WRITTEN)
        log.started += 1
        if turn.stall:
            log.stalled.append(request.disconnected)
            # response.created, the message item, its first text delta: then nothing more.
            return ResponsesReply(text=(STALLED, " some more"), stall_after=3)
        if turn.write is not None:
            command = f"printf {shlex.quote(CONTENT)} > {shlex.quote(str(turn.write))}"
            call = FunctionCall("call_stub_1", "exec_command", json.dumps({"cmd": command}))
            return ResponsesReply(text=PREAMBLE, function_calls=[call])
        return ResponsesReply(text=ANSWER)

    async with serve_responses(respond) as server:
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True)
        # A model Codex knows (else its first message warns about missing metadata); every command is asked
        # about ("untrusted"); no sandbox, which a container may not support; no analytics, no update check.
        (codex_home / "config.toml").write_text(
            f"""
model = "gpt-5.4-mini"
model_provider = "stub"
approval_policy = "untrusted"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[model_providers.stub]
name = "Stub"
base_url = "{server.base_url}"
env_key = "STUB_API_KEY"
wire_api = "responses"

[analytics]
enabled = false
"""
        )
        env = base_env(home, server.base_url.removesuffix("/v1"))
        env |= {"CODEX_HOME": str(codex_home), "STUB_API_KEY": "sk-stub-not-a-key"}
        yield server, env, log


def _text_of(content: Any) -> str:
    """A tool result's text: a string, or the texts of a list of content parts, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return repr(content)


@pytest.fixture(params=["claude", "qwen", "codex"])
def agent(request: pytest.FixtureRequest) -> Agent:
    if request.param == "claude":
        return Agent("claude", require(CLAUDE_ACP_SCRIPT), serve_claude)
    if request.param == "codex":
        return Agent("codex", require(CODEX_ACP), serve_codex)
    return Agent("qwen", [*require(QWEN_CODE), "--acp", "--auth-type", "openai"], serve_qwen)


# -- running the CLI -------------------------------------------------------------------------------------


@dataclass
class Finished:
    """A finished `subagent run --json --events`."""

    status: int
    result: dict[str, Any]
    events: list[dict[str, Any]]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["event"] == kind]


async def run_cli(
    agent: Agent,
    turn: Turn,
    tmp_path: Path,
    *,
    permission: str,
    interrupt_when: Callable[[dict[str, Any]], bool] | None = None,
) -> tuple[Finished, Served, ModelLog]:
    """Serve the model, run one turn of ``agent`` through the CLI, and check nothing outlived it."""
    home = tmp_path / "home"
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    async with assert_no_leaks() as tag, agent.serve(turn, home) as (server, env, log):
        argv = [sys.executable, "-m", "subagent", "run", "--json", "--events", "--permission", permission]
        argv += [
            "--cwd",
            str(workdir),
            "-p",
            "Write hello.txt, then tell me the answer.",
            "--",
            *agent.command,
        ]
        events: list[dict[str, Any]] = []
        stdout = bytearray()
        process = await anyio.open_process(
            argv,
            stdin=subprocess.DEVNULL,
            env={**env, LEAK_TAG_VARIABLE: tag},
            cwd=workdir,
            start_new_session=True,  # no controlling terminal, like CI
        )
        async with process:
            try:
                with anyio.fail_after(RUN_BOUND):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(_read_all, process, stdout)
                        await _read_events(process, events, interrupt_when)
                    status = await process.wait()
                    # Every agent process is gone by now, so a model call left hanging has been hung up on.
                    for hung_up in log.stalled:
                        await hung_up.wait()
            except BaseException:
                await _kill_leftovers(process, tag)
                raise
    assert not [event for event in events if event["event"] == "not-json"], events
    finished = Finished(status, json.loads(stdout), events)
    # The agent went nowhere but to the fake model (at most a tunnel to it, for an agent that proxies it).
    assert set(server.tunnels) <= {f"127.0.0.1:{server.port}"}, server.tunnels
    return finished, server, log


async def _read_all(process: anyio.abc.Process, into: bytearray) -> None:
    assert process.stdout is not None
    async for chunk in process.stdout:
        into += chunk


async def _read_events(
    process: anyio.abc.Process,
    events: list[dict[str, Any]],
    interrupt_when: Callable[[dict[str, Any]], bool] | None,
) -> None:
    assert process.stderr is not None
    lines = BufferedByteReceiveStream(process.stderr)
    interrupted = False
    while True:
        try:
            line = await lines.receive_until(b"\n", MAX_STDERR_LINE)
        except (anyio.EndOfStream, anyio.IncompleteRead):
            return
        try:
            event = json.loads(line)
        except ValueError:  # a traceback, say: kept for the failure message
            event = {"event": "not-json", "line": line.decode(errors="replace")}
        else:
            # When it was written: checked to be there and taken out, so the tests compare the rest exactly.
            assert isinstance(event.pop("time"), float | int), event
        events.append(event)
        if interrupt_when is not None and not interrupted and interrupt_when(event):
            process.send_signal(signal.SIGINT)
            interrupted = True


async def _kill_leftovers(process: anyio.abc.Process, tag: str) -> None:
    """After a failure (only: a clean run's leftovers are the leak check's to report), kill what still
    runs, the CLI's group and then anything tagged, so that a failed run does not linger."""
    with anyio.CancelScope(shield=True):
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with anyio.move_on_after(RUN_BOUND):
                await process.wait()
        for info in leaked_processes(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(info.pid, signal.SIGKILL)


def text_chunks(finished: Finished) -> list[str]:
    """The text of every agent_message_chunk, in order, empty ones left out."""
    texts = []
    for event in finished.of("update"):
        update = event["update"]
        if update["sessionUpdate"] == "agent_message_chunk" and update["content"].get("text"):
            texts.append(update["content"]["text"])
    return texts


def permission_choices(finished: Finished) -> list[tuple[str, str]]:
    return [(event["option"]["kind"], event["reason"]) for event in finished.of("permission")]


@pytest.fixture
def target(tmp_path: Path) -> Path:
    return tmp_path / "work" / "hello.txt"


# -- the tests -------------------------------------------------------------------------------------------


async def test_a_real_agent_answers_with_exactly_the_models_text_and_completes(
    agent: Agent, tmp_path: Path
) -> None:
    finished, _, log = await run_cli(agent, Turn(), tmp_path, permission="deny")
    assert finished.status == 0
    assert finished.result["output"] == "".join(ANSWER)
    assert (finished.result["stopReason"], finished.result["error"]) == ("completed", None)
    assert text_chunks(finished) == list(ANSWER)
    assert log.started == 1
    assert finished.of("permission") == []


def tool_result_written(agent: str, path: Path) -> str:
    """A pattern of what ``agent`` tells the model once it has written ``path``."""
    if agent == "claude":
        return re.escape(
            f"File created successfully at: {path}"
            " (file state is current in your context — no need to Read it back)"
        )
    if agent == "qwen":
        return re.escape(f"Successfully created and wrote to new file: {path}.")
    # Codex reports the command's run: an id and a wall time that change every run, then its exit status.
    return (
        r"Chunk ID: \w+\nWall time: [\d.]+ seconds\nProcess exited with code 0\n"
        r"Original token count: 0\nOutput:\n"
    )


async def test_a_real_agent_writes_the_file_when_its_permission_question_is_allowed(
    agent: Agent, tmp_path: Path, target: Path
) -> None:
    finished, _, log = await run_cli(agent, Turn(write=target), tmp_path, permission="allow")
    assert finished.status == 0
    assert (finished.result["stopReason"], finished.result["error"]) == ("completed", None)
    assert finished.result["output"] == WRITTEN  # the text after the tool call: the final answer
    assert await anyio.Path(target).read_text() == CONTENT
    assert permission_choices(finished) == [("allow_once", "--permission allow")]
    (told_model,) = log.tool_results
    assert re.fullmatch(tool_result_written(agent.name, target), told_model), told_model


# What each agent tells the model when the write is refused, and how the turn ends: (what the model is
# told, exit status, output, stop reason).
DENIED: Final = {
    # Claude Code reports the tool call failed; the answer is the text after it.
    "claude": (["User refused permission to run tool"], 0, NOT_WRITTEN, "completed"),
    # Qwen Code sends no tool-call update for a refused call, so the answer runs on from the preamble.
    "qwen": (['Tool "write_file" was canceled by the user.'], 0, PREAMBLE + NOT_WRITTEN, "completed"),
    # Codex ends its turn as cancelled at once (its refusal option is "abort"), the model told nothing.
    "codex": ([], 1, PREAMBLE, "cancelled"),
}


async def test_a_real_agent_leaves_the_file_unwritten_when_its_permission_question_is_denied(
    agent: Agent, tmp_path: Path, target: Path
) -> None:
    finished, _, log = await run_cli(agent, Turn(write=target), tmp_path, permission="deny")
    told_model, status, output, stop_reason = DENIED[agent.name]
    assert not await anyio.Path(target).exists()
    assert permission_choices(finished) == [("reject_once", "--permission deny")]
    assert log.tool_results == told_model
    assert finished.status == status
    assert (finished.result["output"], finished.result["stopReason"]) == (output, stop_reason)
    if stop_reason == "completed":
        assert finished.result["error"] is None
    else:  # the CLI explains that the refusal ended the turn
        assert "--permission deny" in finished.result["error"]


async def test_sigint_cancels_a_real_agents_turn_while_the_model_stalls_mid_answer(
    agent: Agent, tmp_path: Path
) -> None:
    def first_text(event: dict[str, Any]) -> bool:
        update = event.get("update", {})
        return bool(update.get("sessionUpdate") == "agent_message_chunk" and update["content"].get("text"))

    finished, _, log = await run_cli(
        agent, Turn(stall=True), tmp_path, permission="deny", interrupt_when=first_text
    )
    assert finished.status == 1
    assert (finished.result["output"], finished.result["stopReason"]) == (STALLED, "cancelled")
    assert finished.result["error"] is None
    assert {"event": "interrupt", "signal": "SIGINT", "count": 1, "action": "cancel"} in finished.events
    assert finished.events[-1]["event"] == "end"
    assert finished.events[-1]["stopReason"] == "cancelled"
    assert log.started == 1  # one model call, the stalled one, which the agent then hung up on
