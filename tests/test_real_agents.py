"""Real ACP agents, driven through `subagent run` for full turns against a fake model server on loopback.

* Claude Code, through ``claude-agent-acp`` (npm ``@agentclientprotocol/claude-agent-acp``), against the
  scripted Anthropic Messages server (`subagent.testing._anthropic_server`);
* Qwen Code (npm ``@qwen-code/qwen-code``, ``qwen --acp --auth-type openai``), against the scripted
  chat-completions server (`subagent.testing._chat_server`);
* Codex through two adapters, ``codex-acp`` of npm ``@zed-industries/codex-acp`` and of npm
  ``@agentclientprotocol/codex-acp`` (which runs ``codex app-server`` of npm ``@openai/codex``), against the
  scripted Responses API server (`subagent.testing._responses_server`), with a ``[model_providers.stub]`` in
  its ``CODEX_HOME``;
* GitHub Copilot CLI (npm ``@github/copilot``, ``copilot --acp``), against the chat-completions server (its
  ``COPILOT_PROVIDER_*`` settings; its wire API defaults to chat completions);
* Mistral Vibe (PyPI ``mistral-vibe``, ``vibe-acp``, in a virtual environment of its own: it needs Python
  3.12 or newer), against the chat-completions server (a ``generic`` provider in its ``config.toml``).

`make interop` installs them, pinned, under ``.interop/``; without them (or without node, or for Vibe
without a Python 3.12) these tests are skipped, or fail when ``SUBAGENT_REQUIRE_INTEROP`` is set (CI sets
it). Each test runs the real CLI as a subprocess, ``subagent run --json --events``, and asserts its exact
outcome: the answer, a file write allowed (at the agent's own start mode) and a permission question allowed
and denied (at its asking mode), and a turn cancelled by SIGINT, or torn down by SIGTERM, while the model's
answer is mid-stream.

Each agent starts in its own mode: Claude Code (``auto``), Qwen Code (``auto``), the ACP project's Codex
adapter (``agent``) and Vibe (``accept-edits``) write without asking; Copilot (``...#agent``) asks; the Zed
Codex adapter has no modes and asks here because its config says ``approval_policy = "untrusted"``. Under
``--permission allow`` they stay there; under ``deny`` the CLI moves the first four to their asking mode and
says so (see `subagent.acp._modes`). A test that needs the question chooses the asking mode with ``--mode``
(``Turn.asking``; for the ACP Codex adapter, whose ``read-only`` mode asks only before a command leaves its
sandbox, the fake model asks for that, as a model whose write the sandbox refused does).

Offline by construction: every model base URL points at the fake server, each run has its own empty HOME,
telemetry, update checks and side traffic are switched off, and ``HTTPS_PROXY`` / ``HTTP_PROXY`` point
at the fake server too, which tunnels only to itself: an agent that honours them and tries any other
host shows up in ``server.tunnels``, and each test asserts that nothing did.

The model's side of a turn is decided from each request, not from its position (agents make calls of
their own): a request offering no tools is a side call (a title, a summary) and gets a short text; a
request whose last message carries a tool result gets the closing text, which depends on whether the
file was really written; any other request starts the turn.

Each SIGTERM test appends how long ``subagent run`` took from SIGTERM to its exit to
``real-agent-timings.jsonl`` in pytest's base temporary directory (and prints it, shown with ``-s``): a
record for people, never asserted (the machine may be loaded).
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
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from subagent.testing import (
    FunctionCall,
    MessagesReply,
    MessagesRequest,
    ReceivedRequest,
    ResponsesReply,
    ResponsesRequest,
    StreamedReply,
    ToolCallReply,
    ToolUse,
    serve_anthropic_messages,
    serve_chat_completions,
    serve_responses,
)
from tests.leaks import LEAK_TAG_VARIABLE, assert_no_leaks, leaked_processes

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess, pytest.mark.real_agent]

ROOT: Final = Path(__file__).resolve().parent.parent
INTEROP: Final = ROOT / ".interop"
CLAUDE_ACP: Final = INTEROP / "claude-agent-acp/node_modules" / "@agentclientprotocol" / "claude-agent-acp"
CLAUDE_ACP_SCRIPT: Final = CLAUDE_ACP / "dist" / "index.js"
CODEX_ZED: Final = INTEROP / "codex-acp/node_modules/@zed-industries/codex-acp/bin/codex-acp.js"
CODEX_ACP: Final = INTEROP / "codex-acp-2/node_modules/@agentclientprotocol/codex-acp/dist/index.js"
QWEN_CODE: Final = INTEROP / "qwen-code" / "node_modules" / "@qwen-code" / "qwen-code" / "cli.js"
COPILOT: Final = INTEROP / "copilot/node_modules/@github/copilot/npm-loader.js"
COPILOT_CACHE: Final = INTEROP / "copilot" / "cache"  # unpacked by `make interop` (see the Makefile)
VIBE_ACP: Final = INTEROP / "vibe" / "bin" / "vibe-acp"  # a console script of its own virtual environment
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
    """What the fake model does when a turn starts: answer, ask to write a file, or stall mid-answer;
    ``asking``: the agent runs at its asking mode (see the module's docstring)."""

    write: Path | None = None
    stall: bool = False
    asking: bool = False


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
    """A real agent: how to start it, and how to serve its model and set its environment for one turn.
    ``asks``: whether it asks before a write at the mode it starts in; ``asking_mode``: its mode that asks
    (None: it has no modes); ``other_mode``: a mode it offers that is neither its start mode nor its
    asking mode; ``moved``: the mode it starts in, when the CLI moves it to its asking mode under ``deny``;
    ``one_process``: environment that keeps the agent to one process, for a test that is about the turn
    rather than the agent's process tree (the signal tests keep the tree it has when users run it)."""

    name: str
    command: list[str]
    serve: Serve
    asks: bool
    asking_mode: str | None
    other_mode: str | None
    moved: str | None = None
    one_process: Mapping[str, str] = field(default_factory=dict)


@dataclass
class ModelLog:
    """What the fake model saw: the tool results it was sent, and the stalled request, once one hangs."""

    tool_results: list[str] = field(default_factory=list)
    stalled: list[anyio.Event] = field(default_factory=list)
    started: int = 0


def require(script: Path, *, node: bool = True) -> list[str]:
    """The agent's command line, or skip (fail under SUBAGENT_REQUIRE_INTEROP) when it is not installed.
    ``node``: the script is run by node; else it is an executable of its own."""
    interpreter = [NODE] if node and NODE is not None else []
    if (node and not interpreter) or not script.is_file():
        reason = f"the real agent is not installed (run `make interop`): {script.relative_to(ROOT)}"
        if os.environ.get("SUBAGENT_REQUIRE_INTEROP"):
            pytest.fail(reason)
        pytest.skip(reason)
    return [*interpreter, str(script)]


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


def claude_env(home: Path, base_url: str) -> dict[str, str]:
    """Claude Code's environment for a run against the fake Messages server at ``base_url``: no telemetry,
    no update check, no side traffic."""
    env = base_env(home, base_url)
    # At its start mode, "auto", with a base URL of its own, Claude Code tells the user (in an
    # agent_message_chunk of its own, once a day until acknowledged) that its classifier billing
    # changes: acknowledged now, so that the turn's messages are the model's.
    acknowledged = {"autoModeClassifierBillingNoticeAcknowledgedAt": int(time.time() * 1000)}
    (home / ".claude.json").write_text(json.dumps(acknowledged))
    env |= {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "sk-ant-stub-not-a-key",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    if os.geteuid() == 0:
        env["IS_SANDBOX"] = "1"  # Claude Code refuses to run as root outside a declared sandbox
    return env


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
        env = claude_env(home, server.base_url)
        yield server, env, log


# -- agents on a chat-completions model ------------------------------------------------------------------


def chat_responder(
    turn: Turn, log: ModelLog, tool: str, arguments: Callable[[Path], dict[str, str]]
) -> Callable[[ReceivedRequest], StreamedReply]:
    """The fake chat-completions model of an agent whose file-writing tool is ``tool``, called with
    ``arguments(path)`` (see the module docstring for how each request is answered)."""

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
            call = ToolCallReply("call_stub_1", tool, json.dumps(arguments(turn.write)))
            return StreamedReply(text=PREAMBLE, tool_calls=[call])
        return StreamedReply(text=ANSWER)

    return respond


# -- Qwen Code -------------------------------------------------------------------------------------------


@asynccontextmanager
async def serve_qwen(turn: Turn, home: Path) -> AsyncIterator[tuple[Served, dict[str, str], ModelLog]]:
    log = ModelLog()
    respond = chat_responder(
        turn, log, "write_file", lambda path: {"file_path": str(path), "content": CONTENT}
    )
    async with serve_chat_completions(responder=respond) as server:
        # Qwen Code's usage statistics go to a host of their own unless switched off in its settings. Its
        # memory extraction and follow-up suggestions are model calls of its own, with tools, after the
        # turn: off, so that every request with tools is the turn's.
        settings = {
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            "general": {"enableAutoUpdate": False},
            "memory": {"enableManagedAutoMemory": False},
            "ui": {"enableFollowupSuggestions": False},
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


def codex_config(adapter: str, base_url: str) -> str:
    """The adapter's ``config.toml``: the stub provider, and no analytics or update check.

    The Zed adapter (0.16.0) has no modes: every command is asked about ("untrusted"), with no sandbox,
    which a container may not support. The ACP project's adapter (2.6.0) takes its approval policy and
    sandbox from its mode (``approval_policy = "untrusted"`` is now an error); its model is one whose
    metadata it knows (else its first message warns about it), and the features that fetch plugins,
    apps and model lists from other hosts are off.
    """
    if adapter == "codex-zed":
        settings = """
model = "gpt-5.4-mini"
approval_policy = "untrusted"
sandbox_mode = "danger-full-access"
"""
        features = ""
    else:
        settings = """
model = "gpt-5.5"
"""
        features = """
[features]
plugins = false
remote_plugin = false
plugin_discovery_prefetch = false
apps = false
in_app_updates = false
api_key_model_discovery = false
"""
    return f"""{settings}
model_provider = "stub"
check_for_update_on_startup = false

[model_providers.stub]
name = "Stub"
base_url = "{base_url}"
env_key = "STUB_API_KEY"
wire_api = "responses"

[analytics]
enabled = false
{features}"""


def serve_codex(adapter: str) -> Serve:
    """Serves the Responses API for one of the two Codex adapters (``codex-zed``, ``codex-acp``)."""

    @asynccontextmanager
    async def serve(turn: Turn, home: Path) -> AsyncIterator[tuple[Served, dict[str, str], ModelLog]]:
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
                arguments: dict[str, str] = {"cmd": command}
                if turn.asking and adapter == "codex-acp":
                    # Read-only mode runs commands in a read-only sandbox and asks only to leave it.
                    arguments |= {"sandbox_permissions": "require_escalated", "justification": PREAMBLE}
                call = FunctionCall("call_stub_1", "exec_command", json.dumps(arguments))
                return ResponsesReply(text=PREAMBLE, function_calls=[call])
            return ResponsesReply(text=ANSWER)

        async with serve_responses(respond) as server:
            codex_home = home / ".codex"
            codex_home.mkdir(parents=True)
            (codex_home / "config.toml").write_text(codex_config(adapter, server.base_url))
            env = base_env(home, server.base_url.removesuffix("/v1"))
            env |= {"CODEX_HOME": str(codex_home), "STUB_API_KEY": "sk-stub-not-a-key"}
            yield server, env, log

    return serve


# -- GitHub Copilot CLI ----------------------------------------------------------------------------------


@asynccontextmanager
async def serve_copilot(turn: Turn, home: Path) -> AsyncIterator[tuple[Served, dict[str, str], ModelLog]]:
    log = ModelLog()
    respond = chat_responder(turn, log, "create", lambda path: {"path": str(path), "file_text": CONTENT})
    async with serve_chat_completions(responder=respond) as server:
        env = base_env(home, server.base_url.removesuffix("/v1"))
        env |= {
            "COPILOT_PROVIDER_BASE_URL": server.base_url,
            "COPILOT_PROVIDER_API_KEY": "sk-stub-not-a-key",
            "COPILOT_PROVIDER_MODEL_ID": "stub-model",
            "COPILOT_PROVIDER_WIRE_MODEL": "stub-model",
            "COPILOT_OFFLINE": "1",
            "COPILOT_DISABLE_TELEMETRY": "1",
            "COPILOT_AUTO_UPDATE": "false",
            # Its files, unpacked once by `make interop`: not again into every test's HOME.
            "COPILOT_PKG_CACHE_HOME": str(COPILOT_CACHE),
        }
        yield server, env, log


# -- Mistral Vibe ----------------------------------------------------------------------------------------


NULL_KEYRING: Final = "keyring.backends.null.Keyring"


def vibe_config(base_url: str) -> str:
    """Vibe's ``config.toml``: the fake server as a ``generic`` (OpenAI-style) provider and its only model,
    no telemetry, no update check, and no session titles (a model call of its own after each turn).

    Its other traffic (experiments, connectors, the model catalog, telemetry's endpoint) is tied to a
    Mistral provider, which this config does not use.
    """
    return f"""active_model = "stub"
enable_telemetry = false
enable_update_checks = false

[session_logging]
generate_titles = false

[[providers]]
name = "stub"
api_base = "{base_url}"
api_key_env_var = "STUB_API_KEY"
backend = "generic"

[[models]]
name = "stub-model"
provider = "stub"
alias = "stub"
"""


@asynccontextmanager
async def serve_vibe(turn: Turn, home: Path) -> AsyncIterator[tuple[Served, dict[str, str], ModelLog]]:
    log = ModelLog()
    respond = chat_responder(turn, log, "write_file", lambda path: {"path": str(path), "content": CONTENT})
    async with serve_chat_completions(responder=respond) as server:
        (home / ".vibe").mkdir(parents=True)
        (home / ".vibe" / "config.toml").write_text(vibe_config(server.base_url))
        env = base_env(home, server.base_url.removesuffix("/v1"))
        # No keyring of whoever runs the tests (Vibe looks its key up there too); the null backend also
        # spares the probe of every keyring backend, which runs gcc to look for macOS libraries.
        env |= {"STUB_API_KEY": "sk-stub-not-a-key", "PYTHON_KEYRING_BACKEND": NULL_KEYRING}
        yield server, env, log


def _text_of(content: Any) -> str:
    """A tool result's text: a string, or the texts of a list of content parts, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return repr(content)


AGENTS: Final = ("claude", "qwen", "codex-zed", "codex-acp", "copilot", "vibe")


COPILOT_MODE: Final = "https://agentclientprotocol.com/protocol/session-modes#"
"""Copilot's modes are URLs: this, then the mode's name."""


def make_agent(name: str) -> Agent:
    """The agent called ``name``, or skip (fail under SUBAGENT_REQUIRE_INTEROP) when it is not installed."""
    if name == "claude":
        return Agent(name, require(CLAUDE_ACP_SCRIPT), serve_claude, False, "default", "plan", "auto")
    if name == "qwen":
        command = [*require(QWEN_CODE), "--acp", "--auth-type", "openai"]
        # Qwen Code relaunches itself as a child node with a bigger heap (a second start of its bundle, about
        # a second of CPU) unless told it already has.
        quick = {"QWEN_CODE_NO_RELAUNCH": "true"}
        return Agent(name, command, serve_qwen, False, "default", "plan", "auto", one_process=quick)
    if name == "codex-zed":
        return Agent(name, require(CODEX_ZED), serve_codex(name), True, None, None)
    if name == "codex-acp":
        return Agent(
            name, require(CODEX_ACP), serve_codex(name), False, "read-only", "workspace-write", "agent"
        )
    if name == "vibe":
        command = require(VIBE_ACP, node=False)
        return Agent(name, command, serve_vibe, False, "ask", "auto-approve", "accept-edits")
    command = [*require(COPILOT), "--acp"]
    return Agent(name, command, serve_copilot, True, COPILOT_MODE + "agent", COPILOT_MODE + "plan")


@pytest.fixture(params=AGENTS)
def agent(request: pytest.FixtureRequest) -> Agent:
    return make_agent(request.param)


# -- running the CLI -------------------------------------------------------------------------------------


@dataclass
class Finished:
    """A finished `subagent run --json --events`; ``signal_to_exit``: seconds from the signal the test
    sent to the CLI's exit, when it sent one."""

    status: int
    result: dict[str, Any]
    events: list[dict[str, Any]]
    signal_to_exit: float | None = None

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["event"] == kind]


@dataclass
class Interrupt:
    """A signal the test sends the CLI once, at the first event ``when`` accepts."""

    when: Callable[[dict[str, Any]], bool]
    signum: signal.Signals = signal.SIGINT
    sent_at: float | None = None


async def run_cli(
    agent: Agent,
    turn: Turn,
    tmp_path: Path,
    *,
    permission: str,
    interrupt: Interrupt | None = None,
    options: tuple[str, ...] = (),
) -> tuple[Finished, Served, ModelLog]:
    """Serve the model, run one turn of ``agent`` through the CLI, and check nothing outlived it."""
    home = tmp_path / "home"
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    if turn.asking and agent.asking_mode is not None:
        options = ("--mode", agent.asking_mode, *options)
    async with assert_no_leaks() as tag, agent.serve(turn, home) as (server, env, log):
        argv = [sys.executable, "-m", "subagent", "run", "--json", "--events", "--permission", permission]
        argv += [
            *options,
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
            env={**env, **(agent.one_process if interrupt is None else {}), LEAK_TAG_VARIABLE: tag},
            cwd=workdir,
            start_new_session=True,  # no controlling terminal, like CI
        )
        async with process:
            try:
                with anyio.fail_after(RUN_BOUND):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(_read_all, process, stdout)
                        await _read_events(process, events, interrupt)
                    status = await process.wait()
                    exited_at = time.monotonic()
                    # Every agent process is gone by now, so a model call left hanging has been hung up on.
                    for hung_up in log.stalled:
                        await hung_up.wait()
            except BaseException:
                await _kill_leftovers(process, tag)
                raise
    assert not [event for event in events if event["event"] == "not-json"], events
    sent_at = None if interrupt is None else interrupt.sent_at
    signal_to_exit = None if sent_at is None else exited_at - sent_at
    finished = Finished(status, json.loads(stdout), events, signal_to_exit)
    # The agent went nowhere but to the fake model (at most a tunnel to it, for an agent that proxies it).
    assert set(server.tunnels) <= {f"127.0.0.1:{server.port}"}, server.tunnels
    return finished, server, log


async def _read_all(process: anyio.abc.Process, into: bytearray) -> None:
    assert process.stdout is not None
    async for chunk in process.stdout:
        into += chunk


async def _read_events(
    process: anyio.abc.Process, events: list[dict[str, Any]], interrupt: Interrupt | None
) -> None:
    assert process.stderr is not None
    lines = BufferedByteReceiveStream(process.stderr)
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
        if interrupt is not None and interrupt.sent_at is None and interrupt.when(event):
            interrupt.sent_at = time.monotonic()
            process.send_signal(interrupt.signum)


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


def started_in(finished: Finished) -> str | None:
    """The session's mode as the run started its turn (after the CLI applied or chose one)."""
    (start,) = finished.of("start")
    mode = start["mode"]
    assert mode is None or isinstance(mode, str), start
    return mode


def warnings(finished: Finished) -> list[str]:
    """The turn's warnings, but a teardown's SIGKILL escalation: how long a real agent takes to exit on
    SIGTERM depends on the machine's load (Claude Code outlasted the 2 s grace beside a CPU-heavy job)."""
    return [
        event["message"]
        for event in finished.of("log")
        if event["level"] == "warning" and "survived SIGTERM" not in event["message"]
    ]


def moved_to_asking_mode(agent: Agent) -> list[str]:
    """The warning the CLI gives when it moves ``agent``'s session to its asking mode under deny, if it
    does."""
    if agent.moved is None:
        return []
    return [
        f"agent `{shlex.join(agent.command)}` started its session in mode {agent.moved!r}, which approves "
        f"tool calls by itself; switched it to {agent.asking_mode!r}, which asks, so that the permission "
        "policy (--permission deny) decides (choose a mode with --mode ID, or AcpProvider(mode=...))"
    ]


def first_text(event: dict[str, Any]) -> bool:
    """Whether ``event`` is the turn's first agent_message_chunk with text: the model is mid-answer."""
    update = event.get("update", {})
    return bool(update.get("sessionUpdate") == "agent_message_chunk" and update["content"].get("text"))


@pytest.fixture
def target(tmp_path: Path) -> Path:
    return tmp_path / "work" / "hello.txt"


@pytest.fixture
def timings(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the SIGTERM tests record their timings (see the module's docstring)."""
    return tmp_path_factory.getbasetemp() / "real-agent-timings.jsonl"


# -- the tests -------------------------------------------------------------------------------------------


async def test_a_real_agent_switched_to_a_mode_it_offers_answers_with_exactly_the_models_text(
    agent: Agent, tmp_path: Path
) -> None:
    # One run for two facts: `--mode` switches an agent that offers modes to another one before the turn
    # (an explicit mode, so `deny` moves nothing), and the turn's answer arrives exactly as the model said it.
    options = () if agent.other_mode is None else ("--mode", agent.other_mode)
    finished, _, log = await run_cli(agent, Turn(), tmp_path, permission="deny", options=options)
    assert started_in(finished) == agent.other_mode  # None: the Zed Codex adapter offers no modes
    assert warnings(finished) == []
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
    if agent == "copilot":
        return re.escape(f"Created file {path} with {len(CONTENT)} characters")
    if agent == "vibe":
        written = {"bytes_written": len(CONTENT), "file_existed": False, "path": str(path)}
        return re.escape(json.dumps(written, separators=(",", ":")))
    # Codex reports the command's run: an id and a wall time that change every run, then its exit status.
    return (
        r"Chunk ID: \w+\nWall time: [\d.]+ seconds\nProcess exited with code 0\n"
        r"Original token count: 0\nOutput:\n"
    )


def assert_written(agent: Agent, finished: Finished, log: ModelLog, target: Path) -> None:
    assert finished.status == 0
    assert (finished.result["stopReason"], finished.result["error"]) == ("completed", None)
    assert finished.result["output"] == WRITTEN  # the text after the tool call: the final answer
    assert target.read_text() == CONTENT
    (told_model,) = log.tool_results
    assert re.fullmatch(tool_result_written(agent.name, target), told_model), told_model


async def test_a_real_agent_at_its_start_mode_writes_the_file_under_permission_allow(
    agent: Agent, tmp_path: Path, target: Path
) -> None:
    finished, _, log = await run_cli(agent, Turn(write=target), tmp_path, permission="allow")
    assert_written(agent, finished, log, target)
    # Asked only by the agents whose start mode asks; the others write without a question, but a write
    # through our file system (Qwen Code's) is put to the policy as a question of the client's own.
    if agent.asks:
        assert permission_choices(finished) == [("allow_once", "--permission allow")]
    elif agent.name == "qwen":
        (question,) = finished.of("permission")
        assert question["toolCallId"] == f"fs/write_text_file {target}"
        assert permission_choices(finished) == [("allow_once", "--permission allow")]
    else:
        assert finished.of("permission") == []


@pytest.fixture(params=[name for name in AGENTS if name not in ("codex-zed", "copilot")])
def unasking_agent(request: pytest.FixtureRequest) -> Agent:
    """An agent whose start mode writes without asking (the others ask at their start mode already)."""
    return make_agent(request.param)


async def test_a_real_agent_at_its_asking_mode_writes_the_file_when_its_question_is_allowed(
    unasking_agent: Agent, tmp_path: Path, target: Path
) -> None:
    agent = unasking_agent
    finished, _, log = await run_cli(agent, Turn(write=target, asking=True), tmp_path, permission="allow")
    assert started_in(finished) == agent.asking_mode  # --mode took effect
    assert_written(agent, finished, log, target)
    assert permission_choices(finished) == [("allow_once", "--permission allow")]


VIBE_DENIED: Final = (
    '{"result":{"type":"error","error":{"name":"tool_denied",'
    '"message":"Tool execution denied by approval callback","details":null}}}'
)
"""What Vibe tells the model when its question about a write is refused."""

# What each agent at its asking mode tells the model when the write is refused, and how the turn ends:
# (what the model is told, exit status, output, stop reason).
DENIED: Final = {
    # Claude Code reports the tool call failed; the answer is the text after it.
    "claude": (["User refused permission to run tool"], 0, NOT_WRITTEN, "completed"),
    # Qwen Code ends the turn at once, the model told nothing: no text came after the tool call.
    "qwen": ([], 0, "", "completed"),
    # Both Codex adapters end their turn as cancelled at once (the refusal aborts it), the model told
    # nothing: the Zed one sends no tool_call update before its question (the answer runs on from the
    # preamble), the ACP one does (no text came after it).
    "codex-zed": ([], 1, PREAMBLE, "cancelled"),
    "codex-acp": ([], 1, "", "cancelled"),
    # Copilot ends the turn at once, the model told nothing; it tells the user in a message of its own.
    "copilot": ([], 0, "Info: Operation cancelled by user", "completed"),
    # Vibe reports the tool call failed; the answer is the text after it.
    "vibe": ([VIBE_DENIED], 0, NOT_WRITTEN, "completed"),
}


async def test_a_real_agent_at_its_asking_mode_leaves_the_file_unwritten_when_its_question_is_denied(
    agent: Agent, tmp_path: Path, target: Path
) -> None:
    finished, _, log = await run_cli(agent, Turn(write=target, asking=True), tmp_path, permission="deny")
    told_model, status, output, stop_reason = DENIED[agent.name]
    assert started_in(finished) == agent.asking_mode
    assert warnings(finished) == []  # the mode was chosen: nothing to step in for
    assert not await anyio.Path(target).exists()
    assert permission_choices(finished) == [("reject_once", "--permission deny")]
    assert log.tool_results == told_model
    assert finished.status == status
    assert (finished.result["output"], finished.result["stopReason"]) == (output, stop_reason)
    if stop_reason == "completed":
        assert finished.result["error"] is None
    else:  # the CLI explains that the refusal ended the turn
        assert "--permission deny" in finished.result["error"]


async def test_a_real_agent_at_its_default_settings_writes_nothing_under_deny_and_is_told_why_if_moved(
    agent: Agent, tmp_path: Path, target: Path
) -> None:
    finished, _, log = await run_cli(agent, Turn(write=target), tmp_path, permission="deny")
    assert not await anyio.Path(target).exists()
    # Where the agent starts in a mode that approves by itself, the CLI moved it to its asking mode,
    # and said so; the others start asking.
    assert started_in(finished) == agent.asking_mode
    assert warnings(finished) == moved_to_asking_mode(agent)
    if agent.name == "codex-acp":
        # Its asking mode runs the command in a read-only sandbox, which refuses the write unasked; the
        # model is told, and says so.
        assert permission_choices(finished) == []
        (refusal,) = log.tool_results
        assert "Read-only file system" in refusal, refusal
        assert finished.status == 0
        assert (finished.result["output"], finished.result["stopReason"]) == (NOT_WRITTEN, "completed")
        return
    # The others ask, and are refused: the turn ends as at the asking mode.
    assert permission_choices(finished) == [("reject_once", "--permission deny")]
    told_model, status, output, stop_reason = DENIED[agent.name]
    assert log.tool_results == told_model
    assert finished.status == status
    assert (finished.result["output"], finished.result["stopReason"]) == (output, stop_reason)


async def test_mode_fails_the_start_of_a_real_agent_that_offers_no_modes_with_exit_2(tmp_path: Path) -> None:
    agent = make_agent("codex-zed")
    options = ("--mode", "read-only")
    finished, _, log = await run_cli(agent, Turn(), tmp_path, permission="allow", options=options)
    assert finished.status == 2
    assert finished.result["stopReason"] == "error"
    assert (
        f"agent `{shlex.join(agent.command)}`: the agent offers no mode 'read-only' (its modes: none)"
        in (finished.result["error"])
    )
    assert log.started == 0  # no prompt was sent


async def test_under_deny_qwen_codes_write_through_the_client_at_a_mode_that_does_not_ask_is_refused(
    tmp_path: Path, target: Path
) -> None:
    agent = make_agent("qwen")
    options = ("--mode", "auto")  # chosen: the CLI leaves it there, and the policy holds for our fs
    finished, _, log = await run_cli(agent, Turn(write=target), tmp_path, permission="deny", options=options)
    assert started_in(finished) == "auto"
    assert not await anyio.Path(target).exists()
    # It did not ask: its write was put to the policy as a question of the client's own, and refused.
    (question,) = finished.of("permission")
    assert (question["toolCallId"], question["title"]) == (f"fs/write_text_file {target}", f"Write {target}")
    assert (question["option"]["kind"], question["reason"]) == ("reject_once", "--permission deny")
    (refused,) = [message for message in warnings(finished) if "refused the agent's write" in message]
    assert str(target) in refused
    assert "--permission deny" in refused
    (told_model,) = log.tool_results
    assert "--permission deny" in told_model, told_model
    assert finished.status == 0
    assert (finished.result["output"], finished.result["stopReason"]) == (NOT_WRITTEN, "completed")


async def test_sigint_cancels_a_real_agents_turn_while_the_model_stalls_mid_answer(
    agent: Agent, tmp_path: Path
) -> None:
    finished, _, log = await run_cli(
        agent, Turn(stall=True), tmp_path, permission="deny", interrupt=Interrupt(first_text)
    )
    assert finished.status == 1
    assert (finished.result["output"], finished.result["stopReason"]) == (STALLED, "cancelled")
    assert finished.result["error"] is None
    assert {"event": "interrupt", "signal": "SIGINT", "count": 1, "action": "cancel"} in finished.events
    assert finished.events[-1]["event"] == "end"
    assert finished.events[-1]["stopReason"] == "cancelled"
    assert log.started == 1  # one model call, the stalled one, which the agent then hung up on


async def test_sigterm_tears_a_real_agent_down_at_once_while_the_model_stalls_mid_answer(
    agent: Agent, tmp_path: Path, timings: Path
) -> None:
    interrupt = Interrupt(first_text, signal.SIGTERM)
    # -v: the teardown's info logs too, where a graceful teardown says which signal it had to send.
    finished, _, log = await run_cli(
        agent, Turn(stall=True), tmp_path, permission="deny", interrupt=interrupt, options=("-v",)
    )
    record_timing(timings, agent.name, "sigterm_to_exit_s", finished.signal_to_exit)
    # run_cli checked that no process of the agent's outlived the CLI.
    assert finished.status == 1
    assert finished.result["output"] == STALLED
    assert finished.result["stopReason"] == "cancelled"
    assert finished.result["error"] == "the agent was torn down at once on SIGTERM"
    assert {"event": "interrupt", "signal": "SIGTERM", "count": 1, "action": "stop"} in finished.events
    assert finished.events[-1]["event"] == "end"
    # No grace was waited out: a graceful teardown would log the signal it had to send.
    graces = [e["message"] for e in finished.of("log") if "sending SIG" in e["message"]]
    assert graces == []
    assert log.started == 1


def record_timing(timings: Path, agent: str, what: str, seconds: float | None) -> None:
    """Append one timing to the results file, and show it (with ``pytest -s``): never asserted."""
    record = {"agent": agent, what: None if seconds is None else round(seconds, 3)}
    with timings.open("a") as file:
        file.write(json.dumps(record) + "\n")
    sys.stdout.write(f"\n{json.dumps(record)}\n")
