"""The scriptable stub ACP agent: ``python -m subagent.testing.stub_agent [--scenario FILE]``.

It speaks ACP on its stdin/stdout (an `AgentSideConnection` over `stdio_streams`, on asyncio) and does
exactly what the scenario says (see `subagent.testing._scenario` for the format): answer the handshake, or
not; stream updates; ask permission and branch on the answer; call the client's file system; misbehave on
the wire; crash; leave a grandchild behind. Without ``--scenario`` it runs the bundled default scenario, one
friendly, complete turn.

Exit status: 0 when stdin closed (or as a scenario's ``exit`` step says), 2 for a bad scenario or usage.
Kept light to start fast: it imports anyio, msgspec and the ACP modules, nothing heavier.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import msgspec

from subagent._version import __version__
from subagent.acp import schema
from subagent.acp._errors import ConnectionClosedError, RequestError
from subagent.acp._stdio import stdio_streams
from subagent.acp.agent import (
    AgentHandler,
    AgentSideConnection,
    ClientPeer,
    PromptTurn,
    negotiate_protocol_version,
)
from subagent.testing._scenario import (
    CANCELLED_BRANCH,
    DEFAULT_SCENARIO_PATH,
    CallStep,
    CloseStdoutStep,
    EchoStep,
    ElicitStep,
    ErrorStep,
    ExitStep,
    FloodStep,
    GrandchildStep,
    HangStep,
    HugeLineStep,
    KillStep,
    LoadSessionConfig,
    MessageStep,
    NotifyStep,
    PermissionStep,
    PlanStep,
    RawStep,
    ReadFileStep,
    ResumeSessionConfig,
    Scenario,
    ScenarioError,
    SleepStep,
    StderrStep,
    Step,
    StopStep,
    SubagentStep,
    ThoughtStep,
    ToolCallStep,
    ToolCallUpdateStep,
    UpdateStep,
    UsageStep,
    WaitForCancelStep,
    WriteFileStep,
    load_scenario,
)
from subagent.testing._stdio import OrderedStdout

__all__ = ["AGENT_NAME", "AgentHost", "ScenarioAgent", "main", "play_scenario", "serve_scenario"]

logger = logging.getLogger(__name__)

AGENT_NAME: Final = "subagent-stub-agent"
"""The ``agentInfo.name`` the stub agent gives in ``initialize`` when the scenario sets no ``agentInfo``."""

_INDEX_MARK: Final = "\ue000"
"""A placeholder for the chunk index in the flood template: a private-use character, so msgspec writes it
as plain UTF-8 (never escaped) and it cannot clash with anything a JSON encoder produces around it."""

_FLOOD_BATCH: Final = 1000
"""Flood chunks per write: about 100 KiB, a few pipe buffers."""

_GRANDCHILD_CODE: Final = """\
import os, signal, sys
if sys.argv[1] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.write(1, b"ready\\n")
os.close(1)
while True:
    signal.pause()
"""
"""The grandchild a ``grandchild`` step spawns: says ready, closes stdout, and sleeps (SIGTERM ignored
when its argument is ``1``)."""

_STDERR_FILLER: Final = b"stub agent stderr filler line to make the pipe work hard .................\n"
"""One line of the filler a ``stderr`` step writes when given a byte count."""

_grandchildren: list[Any] = []
"""Keeps grandchild Popen objects alive: they must outlive the step (and never be reaped by us)."""

_STDERR_INLINE_BYTES: Final = 64 * 1024
"""A longer stderr write goes through a worker thread (stderr stays blocking: it may be a terminal)."""

_Reopening = TypeVar("_Reopening", LoadSessionConfig, ResumeSessionConfig)
"""The configuration of ``session/load`` or of ``session/resume``."""


@dataclass(slots=True)
class _Stop:
    """A step answered the prompt."""

    reason: str
    usage: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None


@dataclass(slots=True)
class _Session:
    turns_started: int = 0
    last_tool_call_id: str | None = None
    mode: str | None = None
    """The session's current mode: the scenario's ``currentModeId``, then what the client set."""
    config_options: list[dict[str, Any]] = field(default_factory=list)
    """The session's config options with their current values (a copy of the scenario's)."""
    cwd: str | None = None
    """The session's cwd, as the client gave it (``session/new``, ``/load``, ``/resume``): what a relative
    file path is resolved against."""
    modes: dict[str, Any] | None = None
    """The modes a reopened session answered with (None: ``newSession``'s)."""


@dataclass(slots=True)
class _Child:
    """A subagent session a ``subagent`` step announced: whether it may be cancelled, and its cancel."""

    cancellable: bool
    cancelled: anyio.Event = field(default_factory=anyio.Event)
    scope: anyio.CancelScope | None = None


@dataclass(slots=True)
class _Context:
    """Where steps run: the client, the session (None in the handshake), and the prompt turn if any."""

    client: ClientPeer
    session_id: str | None = None
    turn: PromptTurn | None = None
    state: _Session = field(default_factory=_Session)


class AgentHost(Protocol):
    """Where a scenario's process-level steps act (stderr, exit, kill, grandchild): this process when the
    stub agent runs as a command, or an in-process channel (`subagent.testing.StubAgentTransport`)."""

    async def write_stderr(self, data: bytes) -> None:
        """Write ``data`` to the agent's stderr."""
        ...

    async def exit(self, code: int) -> None:
        """End the agent at once with status ``code``; does not return."""
        ...

    async def kill(self, signum: signal.Signals, *, ignore_sigterm: bool) -> None:
        """Send the agent ``signum`` with its default action (SIGTERM ignored under ``ignore_sigterm``);
        returns only if the agent survives it."""
        ...

    async def spawn_grandchild(self, pid_file: str, *, ignore_sigterm: bool) -> int:
        """Start a grandchild in the agent's process group; its pid, also written to ``pid_file``."""
        ...


class _ThisProcess:
    """The `AgentHost` of the stub agent run as a command: the process itself."""

    async def write_stderr(self, data: bytes) -> None:
        if len(data) <= _STDERR_INLINE_BYTES:
            _write_stderr(data)
        else:
            await anyio.to_thread.run_sync(_write_stderr, data)

    async def exit(self, code: int) -> None:
        os._exit(code)

    async def kill(self, signum: signal.Signals, *, ignore_sigterm: bool) -> None:
        catchable = signum not in (signal.SIGKILL, signal.SIGSTOP)
        if catchable and not (signum == signal.SIGTERM and ignore_sigterm):
            # Python installs handlers for some signals (SIGINT raises KeyboardInterrupt): restore the default
            # action so the process really dies by this signal.
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        # Only a signal that is ignored, or whose default action is not to terminate, comes back here.
        await anyio.lowlevel.checkpoint()

    async def spawn_grandchild(self, pid_file: str, *, ignore_sigterm: bool) -> int:
        return await anyio.to_thread.run_sync(_spawn_grandchild, pid_file, ignore_sigterm)


StepRunner = Callable[[Any, _Context], Coroutine[Any, Any, "_Stop | None"]]
"""Runs one kind of step; a `_Stop` when the step answered the prompt."""


class ScenarioAgent(AgentHandler):
    """An `AgentHandler` that plays a `Scenario`. ``stdout`` splices raw output into the protocol stream;
    ``host`` is where the process-level steps act (this process by default)."""

    def __init__(self, scenario: Scenario, stdout: OrderedStdout, host: AgentHost | None = None) -> None:
        self._scenario = scenario
        self._stdout = stdout
        self._host: AgentHost = _ThisProcess() if host is None else host
        self._authenticated = scenario.require_auth is None
        self._sessions: dict[str, _Session] = {}
        self._sessions_created = 0
        self._runners: dict[type[Any], StepRunner] = {
            MessageStep: self._message,
            ThoughtStep: self._thought,
            ToolCallStep: self._tool_call,
            ToolCallUpdateStep: self._tool_call_update,
            PlanStep: self._plan,
            UsageStep: self._usage,
            UpdateStep: self._update,
            EchoStep: self._echo,
            FloodStep: self._flood,
            PermissionStep: self._permission,
            ElicitStep: self._elicit,
            ReadFileStep: self._read_file,
            WriteFileStep: self._write_file,
            CallStep: self._call,
            NotifyStep: self._notify,
            SleepStep: self._sleep,
            WaitForCancelStep: self._wait_for_cancel,
            StopStep: self._stop,
            ErrorStep: self._error,
            HangStep: self._hang,
            RawStep: self._raw,
            HugeLineStep: self._huge_line,
            CloseStdoutStep: self._close_stdout,
            StderrStep: self._stderr,
            ExitStep: self._exit,
            KillStep: self._kill,
            GrandchildStep: self._grandchild,
            SubagentStep: self._subagent,
        }
        self._children: dict[str, _Child] = {}  # the subagent sessions announced, by id

    # -- requests ----------------------------------------------------------------------------------------

    async def initialize(self, params: schema.InitializeRequest, client: ClientPeer) -> msgspec.Raw:
        """Run the initialize steps, then answer with the scenario's capabilities and auth methods."""
        config = self._scenario.initialize
        await self._run(config.steps, _Context(client))
        capabilities = dict(config.agent_capabilities)
        if self._scenario.load_session is not None:
            capabilities.setdefault("loadSession", True)
        for configured, name in (
            (self._scenario.resume_session, "resume"),
            (self._scenario.close_session, "close"),
        ):
            if configured is not None:
                session_capabilities = dict(capabilities.get("sessionCapabilities") or {})
                session_capabilities.setdefault(name, {})
                capabilities["sessionCapabilities"] = session_capabilities
        auth_methods = config.auth_methods
        if not auth_methods and self._scenario.require_auth is not None:
            auth_methods = [{"id": self._scenario.require_auth, "name": self._scenario.require_auth}]
        version = config.protocol_version
        if version is None:
            version = negotiate_protocol_version(params.protocol_version)
        client.protocol_version = version
        return _raw(
            {
                "protocolVersion": version,
                "agentCapabilities": capabilities,
                "authMethods": auth_methods,
                "agentInfo": config.agent_info
                or {"name": AGENT_NAME, "title": "Stub agent", "version": __version__},
            }
        )

    async def authenticate(self, params: schema.AuthenticateRequest, client: ClientPeer) -> msgspec.Raw:
        """Accept the required method id (or any advertised one when none is required)."""
        await self._run(self._scenario.authenticate.steps, _Context(client))
        required = self._scenario.require_auth
        advertised = [method.get("id") for method in self._scenario.initialize.auth_methods]
        if params.method_id != required and (required is not None or params.method_id not in advertised):
            raise RequestError.invalid_params({"methodId": params.method_id, "reason": "unknown auth method"})
        self._authenticated = True
        return _raw({})

    async def new_session(self, params: schema.NewSessionRequest, client: ClientPeer) -> msgspec.Raw:
        """A new session (after the auth gate and the steps)."""
        self._check_authenticated()
        config = self._scenario.new_session
        self._sessions_created += 1
        session_id = config.session_id
        if self._sessions_created > 1:
            session_id = f"{session_id}-{self._sessions_created}"
        state = self._sessions[session_id] = _Session(
            mode=config.modes.get("currentModeId") if config.modes is not None else None,
            config_options=copy.deepcopy(config.config_options or []),
            cwd=params.cwd,
        )
        if state.mode is None:
            modes = (option for option in state.config_options if option.get("category") == "mode")
            state.mode = next((option.get("currentValue") for option in modes), None)
        await self._run(config.steps, _Context(client, session_id, state=state))
        answer: dict[str, Any] = {"sessionId": session_id}
        if config.modes is not None:
            answer["modes"] = config.modes
        if config.config_options is not None:
            answer["configOptions"] = config.config_options
        return _raw(answer)

    async def load_session(self, params: schema.LoadSessionRequest, client: ClientPeer) -> msgspec.Raw:
        """Replay the configured updates for the loaded session, then answer."""
        config = await self._reopen(
            self._scenario.load_session, schema.SESSION_LOAD, params.session_id, params.cwd, client
        )
        for update in config.replay:
            await client.notify(schema.SESSION_UPDATE, {"sessionId": params.session_id, "update": update})
        return _reopened(config)

    async def resume_session(self, params: schema.ResumeSessionRequest, client: ClientPeer) -> msgspec.Raw:
        """Resume the session, without replay."""
        config = self._scenario.resume_session
        config = await self._reopen(config, schema.SESSION_RESUME, params.session_id, params.cwd, client)
        return _reopened(config)

    async def _reopen(
        self, config: _Reopening | None, method: str, session_id: str, cwd: str, client: ClientPeer
    ) -> _Reopening:
        """What loading and resuming share: refuse the method the scenario does not configure, pass the
        auth gate, report the request on stderr, take the configured modes and options, run the configured
        steps for the session (known or not); the configuration."""
        if config is None:
            raise RequestError.method_not_found(method)
        self._check_authenticated()
        await self._host.write_stderr(f"stub agent: {method} {session_id} {cwd}\n".encode())
        state = self._sessions.setdefault(session_id, _Session())
        state.cwd = cwd
        if config.modes is not None:
            state.modes = config.modes
            state.mode = config.modes.get("currentModeId")
        if config.config_options is not None:
            state.config_options = copy.deepcopy(config.config_options)
            if config.modes is None:
                modes = (option for option in state.config_options if option.get("category") == "mode")
                state.mode = next((option.get("currentValue") for option in modes), state.mode)
        await self._run(config.steps, _Context(client, session_id, state=state))
        return config

    async def close_session(self, params: schema.CloseSessionRequest, client: ClientPeer) -> msgspec.Raw:
        """Run the close steps, report the close on stderr, forget the session, and answer."""
        config = self._scenario.close_session
        if config is None:
            raise RequestError.method_not_found(schema.SESSION_CLOSE)
        state = self._sessions.get(params.session_id, _Session())
        await self._run(config.steps, _Context(client, params.session_id, state=state))
        await self._host.write_stderr(f"stub agent: session/close {params.session_id}\n".encode())
        self._sessions.pop(params.session_id, None)
        return _raw({})

    async def set_session_mode(self, params: schema.SetSessionModeRequest, client: ClientPeer) -> msgspec.Raw:
        """Accept a mode the scenario offers."""
        state = self._sessions.get(params.session_id)
        modes = (
            state.modes if state is not None and state.modes is not None else self._scenario.new_session.modes
        )
        if modes is None:
            raise RequestError.method_not_found(schema.SESSION_SET_MODE)
        offered = [mode.get("id") for mode in modes.get("availableModes", ()) if isinstance(mode, dict)]
        if params.mode_id not in offered:
            raise RequestError.invalid_params({"modeId": params.mode_id, "reason": "unknown mode"})
        state = self._sessions.get(params.session_id)
        if state is None:
            raise RequestError.invalid_params({"sessionId": params.session_id, "reason": "unknown session"})
        state.mode = params.mode_id
        # As real agents do: the change is announced too.
        await client.notify(
            schema.SESSION_UPDATE,
            {
                "sessionId": params.session_id,
                "update": {"sessionUpdate": "current_mode_update", "currentModeId": params.mode_id},
            },
        )
        return _raw({})

    async def set_session_config_option(
        self, params: schema.SetSessionConfigOptionRequest, client: ClientPeer
    ) -> msgspec.Raw:
        """Set one of the session's config options to a value it offers; answer every option."""
        state = self._sessions.get(params.session_id)
        if state is None:
            raise RequestError.invalid_params({"sessionId": params.session_id, "reason": "unknown session"})
        option = next((item for item in state.config_options if item.get("id") == params.config_id), None)
        if option is None:
            unknown = {"configId": params.config_id, "reason": "unknown config option"}
            raise RequestError.invalid_params(unknown)
        is_boolean = isinstance(params, schema.SetSessionConfigOptionRequestBoolean)
        if (option.get("type") == "boolean") != is_boolean:
            raise RequestError.invalid_params({"configId": params.config_id, "reason": "wrong value type"})
        if not is_boolean:
            values = [
                item.get("value")
                for entry in option.get("options", ())
                for item in (entry.get("options", ()) if "group" in entry else (entry,))
            ]
            if params.value not in values:
                raise RequestError.invalid_params({"value": params.value, "reason": "unknown value"})
            if option.get("category") == "mode":
                state.mode = str(params.value)
        option["currentValue"] = params.value
        return _raw({"configOptions": state.config_options})

    async def prompt(self, params: schema.PromptRequest, turn: PromptTurn) -> msgspec.Raw:
        """Run the session's next turn."""
        state = self._sessions.get(params.session_id)
        if state is None:
            raise RequestError.invalid_params({"sessionId": params.session_id, "reason": "unknown session"})
        turns = self._scenario.turns
        index = state.turns_started
        state.turns_started += 1
        if index < len(turns):
            steps = turns[index]
        elif not turns:
            steps = []
        elif self._scenario.after_last_turn == "repeat":
            steps = turns[-1]
        else:
            raise RequestError.internal_error(
                {"details": f"the scenario has {len(turns)} turn(s); this is prompt {index + 1}"}
            )
        stop = await self._run(steps, _Context(turn.client, params.session_id, turn, state))
        if stop is None:
            stop = _Stop("end_turn")
        answer: dict[str, Any] = {"stopReason": stop.reason}
        if stop.usage is not None:
            answer["usage"] = stop.usage
        if stop.meta is not None:
            answer["_meta"] = stop.meta
        return _raw(answer)

    def _check_authenticated(self) -> None:
        if not self._authenticated:
            raise RequestError.auth_required()

    # -- steps -------------------------------------------------------------------------------------------

    async def _run(self, steps: Sequence[Step], context: _Context) -> _Stop | None:
        for step in steps:
            stop = await self._runners[type(step)](step, context)
            if stop is not None:
                return stop
        return None

    async def _send_update(
        self, context: _Context, update: dict[str, Any], session_id: str | None = None
    ) -> None:
        target = session_id or context.session_id
        assert target is not None, "the scenario validator keeps session-bound steps out of the handshake"
        await context.client.notify(schema.SESSION_UPDATE, {"sessionId": target, "update": update})

    async def _chunks(
        self, context: _Context, kind: str, text: str, chunks: int, message_id: str | None
    ) -> None:
        size, extra = divmod(len(text), chunks)
        start = 0
        for index in range(chunks):
            end = start + size + (1 if index < extra else 0)
            update: dict[str, Any] = {
                "sessionUpdate": kind,
                "content": {"type": "text", "text": text[start:end]},
            }
            if message_id is not None:
                update["messageId"] = message_id
            await self._send_update(context, update)
            start = end

    async def _message(self, step: MessageStep, context: _Context) -> None:
        await self._chunks(context, "agent_message_chunk", step.text, step.chunks, step.message_id)

    async def _thought(self, step: ThoughtStep, context: _Context) -> None:
        await self._chunks(context, "agent_thought_chunk", step.text, step.chunks, None)

    async def _tool_call(self, step: ToolCallStep | ToolCallUpdateStep, context: _Context) -> None:
        kind = "tool_call" if isinstance(step, ToolCallStep) else "tool_call_update"
        optional = {
            "title": step.title,
            "kind": step.kind,
            "status": step.status,
            "content": step.content,
            "locations": step.locations,
        }
        update: dict[str, Any] = {
            "sessionUpdate": kind,
            "toolCallId": step.tool_call_id,
            **{name: value for name, value in optional.items() if value is not None},
        }
        if step.raw_input is not msgspec.UNSET:
            update["rawInput"] = step.raw_input
        if step.raw_output is not msgspec.UNSET:
            update["rawOutput"] = step.raw_output
        context.state.last_tool_call_id = step.tool_call_id
        await self._send_update(context, update)

    async def _tool_call_update(self, step: ToolCallUpdateStep, context: _Context) -> None:
        await self._tool_call(step, context)

    async def _plan(self, step: PlanStep, context: _Context) -> None:
        entries = [msgspec.to_builtins(entry) for entry in step.entries]
        # Priority and status are required on the wire, even where the scenario left the defaults.
        for entry, source in zip(entries, step.entries, strict=True):
            entry["priority"] = source.priority
            entry["status"] = source.status
        await self._send_update(context, {"sessionUpdate": "plan", "entries": entries})

    async def _usage(self, step: UsageStep, context: _Context) -> None:
        update: dict[str, Any] = {"sessionUpdate": "usage_update", "used": step.used, "size": step.size}
        if step.cost is not None:
            update["cost"] = step.cost
        await self._send_update(context, update)

    async def _update(self, step: UpdateStep, context: _Context) -> None:
        await self._send_update(context, step.update, step.session_id)

    async def _echo(self, step: EchoStep, context: _Context) -> None:
        assert context.turn is not None
        await self._message(MessageStep(text=step.prefix + context.turn.prompt_text()), context)

    async def _flood(self, step: FloodStep, context: _Context) -> None:
        assert context.session_id is not None
        # Whole lines encoded once and written in batches, in order with everything else: the flood costs
        # what the pipe costs, so a benchmark measures the client reading it, not this agent.
        template = schema.encode(
            {
                "jsonrpc": "2.0",
                "method": schema.SESSION_UPDATE,
                "params": {
                    "sessionId": context.session_id,
                    "update": {
                        "sessionUpdate": "agent_message_chunk",
                        "content": {"type": "text", "text": step.text.replace("{i}", _INDEX_MARK)},
                    },
                },
            }
        )
        parts = template.split(_INDEX_MARK.encode())
        for start in range(0, step.count, _FLOOD_BATCH):
            lines = [
                str(index).encode().join(parts)
                for index in range(start, min(start + _FLOOD_BATCH, step.count))
            ]
            lines.append(b"")
            await self._stdout.write(context.client, b"\n".join(lines))

    async def _permission(self, step: PermissionStep, context: _Context) -> _Stop | None:
        assert context.session_id is not None
        if context.state.mode is not None and context.state.mode in step.skip_in_modes:
            # A mode that approves by itself: no question, the first allowing option's branch runs.
            allows = (option.get("optionId") for option in step.options if option.get("kind") == "allow_once")
            allowing = next(allows, None)
            branch = step.branches.get(allowing) if isinstance(allowing, str) else None
            return None if branch is None else await self._run(branch, context)
        tool_call = step.tool_call
        if tool_call is None:
            tool_call = {"toolCallId": context.state.last_tool_call_id or "call-1"}
        params = {"sessionId": context.session_id, "toolCall": tool_call, "options": step.options}
        method = schema.SESSION_REQUEST_PERMISSION
        raw = await context.client.request(method, params, result_type=msgspec.Raw)
        if step.report:
            await self._report(context, {"method": method, "result": raw})
        answer = schema.decode(memoryview(raw), type=schema.RequestPermissionResponse)
        outcome = answer.outcome
        if isinstance(outcome, schema.SelectedPermissionOutcome):
            branch = step.branches.get(outcome.option_id)
        elif isinstance(outcome, schema.CancelledPermissionOutcome):
            branch = step.branches.get(CANCELLED_BRANCH)
        else:
            branch = None
        return None if branch is None else await self._run(branch, context)

    async def _elicit(self, step: ElicitStep, context: _Context) -> _Stop | None:
        assert context.session_id is not None
        params = {
            "mode": "form",
            "sessionId": context.session_id,
            "message": step.message,
            "requestedSchema": step.requested_schema,
        }
        method = schema.ELICITATION_CREATE
        try:
            raw = await context.client.request(method, params, result_type=msgspec.Raw)
        except RequestError as exc:
            if step.report:
                await self._report(context, {"method": method, "error": exc.to_wire()})
            return None
        if step.report:
            await self._report(context, {"method": method, "result": raw})
        answer = msgspec.json.decode(raw)
        action = answer.get("action") if isinstance(answer, dict) else None
        branch = step.branches.get(action) if isinstance(action, str) else None
        return None if branch is None else await self._run(branch, context)

    async def _request_and_report(self, context: _Context, method: str, params: Any, *, report: bool) -> None:
        try:
            result = await context.client.request(method, params, result_type=msgspec.Raw)
        except RequestError as exc:
            outcome: dict[str, Any] = {"method": method, "error": exc.to_wire()}
        else:
            outcome = {"method": method, "result": result}
        if report:
            await self._report(context, outcome)

    async def _report(self, context: _Context, outcome: dict[str, Any]) -> None:
        text = msgspec.json.encode(outcome).decode()
        if context.session_id is None:
            await self._host.write_stderr(f"stub agent: {text}\n".encode())
            return
        await self._send_update(
            context, {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}}
        )

    async def _read_file(self, step: ReadFileStep, context: _Context) -> None:
        params: dict[str, Any] = {"sessionId": context.session_id, "path": _in_cwd(step.path, context)}
        if step.line is not None:
            params["line"] = step.line
        if step.limit is not None:
            params["limit"] = step.limit
        await self._request_and_report(context, schema.FS_READ_TEXT_FILE, params, report=step.report)

    async def _write_file(self, step: WriteFileStep, context: _Context) -> None:
        content = step.content
        if context.turn is not None:
            content = content.replace("{prompt}", context.turn.prompt_text())
        path = _in_cwd(step.path, context)
        if step.direct:
            try:
                await anyio.Path(path).write_text(content)
            except OSError as exc:
                outcome: dict[str, Any] = {"path": path, "error": exc.strerror or str(exc)}
            else:
                outcome = {"path": path, "written": len(content)}
            if step.report:
                await self._report(context, outcome)
            return
        params = {"sessionId": context.session_id, "path": path, "content": content}
        await self._request_and_report(context, schema.FS_WRITE_TEXT_FILE, params, report=step.report)

    async def _call(self, step: CallStep, context: _Context) -> None:
        params = None if step.params is msgspec.UNSET else step.params
        await self._request_and_report(context, step.method, params, report=step.report)

    async def _notify(self, step: NotifyStep, context: _Context) -> None:
        await context.client.notify(step.method, None if step.params is msgspec.UNSET else step.params)

    async def _sleep(self, step: SleepStep, context: _Context) -> None:
        await anyio.sleep(step.seconds)

    async def _wait_for_cancel(self, step: WaitForCancelStep, context: _Context) -> _Stop | None:
        assert context.turn is not None
        child = self._children.get(context.session_id or "")
        cancelled = child.cancelled if child is not None else None
        with anyio.move_on_after(step.timeout if step.timeout is not None else float("inf")):
            await (cancelled.wait() if cancelled is not None else context.turn.wait_cancelled())
        requested = cancelled.is_set() if cancelled is not None else context.turn.cancel_requested
        if requested and step.then == "stop":
            return _Stop("cancelled")
        return None

    async def _subagent(self, step: SubagentStep, context: _Context) -> None:
        """Announce a child session, run its steps as it, and end its run with one ``idle`` snapshot."""
        if not context.client.subagents:
            _write_stderr(
                f"stub agent: the client does not support subagents; skipping {step.session_id}\n".encode()
            )
            return
        child = self._children[step.session_id] = _Child(step.cancel)
        labels = (("title", step.title), ("description", step.description), ("cwd", step.cwd))
        announcement: dict[str, Any] = {
            "sessionUpdate": "subagent_update",
            "sessionId": step.session_id,
            **{key: value for key, value in labels if value is not None},
        }
        announcement["capabilities"] = {"cancel": {}} if step.cancel else {}
        announcement["state"] = {"state": "running"}
        await self._send_update(context, announcement)
        inner = _Context(context.client, step.session_id, context.turn, _Session())
        stop: _Stop | None = None
        with anyio.CancelScope() as scope:
            child.scope = scope
            stop = await self._run(step.steps, inner)
        idle: dict[str, Any] = {"state": "idle"}
        if scope.cancelled_caught or child.cancelled.is_set():
            idle["stopReason"] = "cancelled"
        elif stop is not None:
            idle["stopReason"] = stop.reason
            if stop.usage is not None:
                idle["usage"] = stop.usage
        else:
            idle["stopReason"] = step.stop_reason
            if step.usage is not None:
                idle["usage"] = step.usage
            if step.stop_reason == "error" and step.error is not None:
                idle["error"] = step.error
        await self._send_update(
            context, {"sessionUpdate": "subagent_update", "sessionId": step.session_id, "state": idle}
        )

    async def cancel(self, params: schema.CancelNotification, client: ClientPeer) -> None:
        """A ``session/cancel`` for a child that granted ``cancel`` stops its steps; others are ignored."""
        child = self._children.get(params.session_id)
        if child is None or not child.cancellable:
            return
        child.cancelled.set()
        if child.scope is not None:
            child.scope.cancel()

    async def _stop(self, step: StopStep, context: _Context) -> _Stop:
        return _Stop(step.reason, step.usage, step.meta)

    async def _error(self, step: ErrorStep, context: _Context) -> None:
        raise RequestError(step.code, step.message, None if step.data is msgspec.UNSET else step.data)

    async def _hang(self, step: HangStep, context: _Context) -> None:
        await anyio.sleep_forever()

    async def _raw(self, step: RawStep, context: _Context) -> None:
        await self._stdout.write(context.client, step.data())

    async def _huge_line(self, step: HugeLineStep, context: _Context) -> None:
        if not step.json:
            await self._stdout.write(context.client, b"x" * step.bytes + b"\n")
            return
        session_id = context.session_id or "no-session"
        envelope = schema.encode(
            {
                "jsonrpc": "2.0",
                "method": schema.SESSION_UPDATE,
                "params": {
                    "sessionId": session_id,
                    "update": {
                        "sessionUpdate": "agent_message_chunk",
                        "content": {"type": "text", "text": ""},
                    },
                },
            }
        )
        padding = step.bytes - len(envelope)
        if padding < 0:
            raise RequestError.internal_error(
                {"details": f"a JSON line needs at least {len(envelope)} bytes"}
            )
        head, _, tail = envelope.partition(b'"text":""')
        await self._stdout.write(context.client, head + b'"text":"' + b"x" * padding + b'"' + tail + b"\n")

    async def _close_stdout(self, step: CloseStdoutStep, context: _Context) -> None:
        await self._stdout.close(context.client)
        await anyio.sleep_forever()

    async def _stderr(self, step: StderrStep, context: _Context) -> None:
        if step.text is not None:
            await self._host.write_stderr(step.text.encode())
            return
        assert step.bytes is not None
        whole, rest = divmod(step.bytes, len(_STDERR_FILLER))
        data = _STDERR_FILLER * whole + _STDERR_FILLER[:rest]
        await self._host.write_stderr(data)

    async def _exit(self, step: ExitStep, context: _Context) -> None:
        await self._flush(context)
        if step.stderr is not None:
            await self._host.write_stderr(step.stderr.encode())
        await self._host.exit(step.code)

    async def _kill(self, step: KillStep, context: _Context) -> None:
        await self._flush(context)
        await self._host.kill(step.signum(), ignore_sigterm=self._scenario.ignore_sigterm)

    async def _grandchild(self, step: GrandchildStep, context: _Context) -> None:
        pid = await self._host.spawn_grandchild(step.pid_file, ignore_sigterm=step.ignore_sigterm)
        if step.report:
            await self._report(context, {"grandchild": pid})

    async def _flush(self, context: _Context) -> None:
        """Make sure everything sent before is on the wire (before exiting or dying)."""
        with contextlib.suppress(ConnectionClosedError):  # Nothing more can be written anyway.
            await self._stdout.flush(context.client)


def _in_cwd(path: str, context: _Context) -> str:
    """A step's file ``path``, a relative one joined to the session's cwd (as an agent resolves the path its
    model gave), unnormalised: the client sees any ``..`` in it."""
    cwd = context.state.cwd
    return path if os.path.isabs(path) or cwd is None else os.path.join(cwd, path)


def _raw(value: Any) -> msgspec.Raw:
    return msgspec.Raw(schema.encode(value))


def _reopened(config: LoadSessionConfig | ResumeSessionConfig) -> msgspec.Raw:
    """The answer to ``session/load`` or ``session/resume``: the configured modes and options, if any."""
    answer: dict[str, Any] = {}
    if config.modes is not None:
        answer["modes"] = config.modes
    if config.config_options is not None:
        answer["configOptions"] = config.config_options
    return _raw(answer)


def _spawn_grandchild(pid_file: str, ignore_sigterm: bool) -> int:
    """Start the grandchild, wait until it is ready, write its pid to `pid_file`; runs in a worker thread."""
    import subprocess  # Only this step needs it: imported here to keep startup lean.

    process = subprocess.Popen(
        [sys.executable, "-c", _GRANDCHILD_CODE, "1" if ignore_sigterm else "0"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    _grandchildren.append(process)
    assert process.stdout is not None
    # Its "ready" line comes after its SIGTERM disposition is set: only then is the pid worth reporting.
    process.stdout.readline()
    process.stdout.close()
    temporary = f"{pid_file}.tmp"
    with open(temporary, "w") as file:
        file.write(f"{process.pid}\n")
    os.replace(temporary, pid_file)  # atomic: a reader never sees a half-written pid
    return process.pid


def _write_stderr(data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(2, view) :]


async def _drain_until_eof(stdin: anyio.abc.ByteReceiveStream) -> None:
    """Read and discard stdin until the client closes it (after the connection stopped reading)."""
    try:
        while True:
            await stdin.receive()
    except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
        return


async def play_scenario(
    scenario: Scenario,
    stdin: anyio.abc.ByteReceiveStream,
    stdout: anyio.abc.ByteSendStream,
    host: AgentHost | None = None,
) -> None:
    """Play `scenario` as an agent reading ``stdin`` and writing ``stdout`` until stdin closes (or forever,
    per ``onStdinEof``), its process-level steps acting on ``host`` (this process by default)."""
    host = _ThisProcess() if host is None else host
    ordered = OrderedStdout(stdout)
    agent = AgentSideConnection(
        ScenarioAgent(scenario, ordered, host),
        stdin,
        ordered,
        # Scenarios decide for themselves how to answer a cancelled turn (compliance is what is tested).
        strict_cancel=False,
        name="stub-agent",
    )
    await agent.run()
    # The connection also stops when stdout is closed under it; the agent lives on until stdin closes.
    await _drain_until_eof(stdin)
    if scenario.close_session is not None:
        await host.write_stderr(b"stub agent: stdin closed\n")
    if scenario.on_stdin_eof == "ignore":
        await anyio.sleep_forever()


async def serve_scenario(scenario: Scenario) -> None:
    """Play `scenario` on this process's stdin/stdout until stdin closes (or forever, per ``onStdinEof``)."""
    with stdio_streams() as (stdin, stdout):
        await play_scenario(scenario, stdin, stdout)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    import argparse  # Only the command line needs it.

    parser = argparse.ArgumentParser(
        prog="python -m subagent.testing.stub_agent", description="A scriptable stub ACP agent on stdio."
    )
    parser.add_argument("--scenario", metavar="FILE", help="the scenario file (default: a friendly turn)")
    parser.add_argument("--log-level", default="WARNING", help="log level on stderr (default: WARNING)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="stub agent: %(levelname)s %(name)s %(message)s")
    try:
        scenario = load_scenario(args.scenario or DEFAULT_SCENARIO_PATH)
    except ScenarioError as exc:
        print(f"stub agent: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    if scenario.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    anyio.run(serve_scenario, scenario)
    return 0


if __name__ == "__main__":
    sys.exit(main())
