"""The ``subagent`` command line: run one prompt through an ACP agent, try the bundled stub agent,
list configured agents.

Every turn goes through :class:`~subagent.service.SubagentService` and
:class:`~subagent.providers.acp.AcpProvider`, so the command line uses the seam exactly as a
library caller would. ``subagent --help`` and ``subagent run --help`` document the behaviour;
the summary:

* exit status 0 when the turn completed, 1 for any other stop reason (Ctrl-C included), 2 for bad
  usage or an agent that failed to start (with one paragraph on stderr naming the command, its
  exit status and the tail of its stderr);
* stdout carries only the answer (or, with ``--json``, exactly one JSON object); progress,
  ``--events`` lines, permission prompts and diagnostics go to stderr;
* the first Ctrl-C cancels the turn (``session/cancel``, then the provider's grace and teardown),
  a second one SIGKILLs the agent's whole process tree at once, even mid-teardown; SIGTERM and
  SIGHUP tear it down at once too (a graceful, bounded teardown).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import logging
import math
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, NoReturn

import anyio
import anyio.abc

from subagent._version import __version__
from subagent.acp import schema
from subagent.acp.connection import DEFAULT_MAX_LINE_BYTES
from subagent.acp.handlers import (
    DEFAULT_PERMISSION_CALLBACK_TIMEOUT,
    AllowPolicy,
    DenyPolicy,
    PermissionDecision,
    PermissionOutcome,
    PermissionPolicy,
    PermissionQuestion,
)
from subagent.cli.config import AgentConfig, ConfigError, config_search_path, find_config, load_config
from subagent.cli.views import (
    AnswerSource,
    AskPolicy,
    Console,
    EventView,
    HumanView,
    ReportingPolicy,
    RunView,
    StartInfo,
    ToolCalls,
    ToolCallState,
    is_terminal,
    sanitize,
    usage_json,
    use_color,
)
from subagent.providers.acp import DEFAULT_READY_TIMEOUT, AcpProvider, AcpRun, prompt_size_error
from subagent.service import ServiceRun, SubagentService
from subagent.types import SubagentError, SubagentRequest, SubagentResult

__all__ = ["DEMO_PROMPT", "EXIT_COMPLETED", "EXIT_NOT_COMPLETED", "EXIT_USAGE", "main"]

logger = logging.getLogger(__name__)

EXIT_COMPLETED: Final = 0
"""The turn completed."""
EXIT_NOT_COMPLETED: Final = 1
"""The turn ended any other way: refused, cut short, failed, timed out, cancelled or interrupted."""
EXIT_USAGE: Final = 2
"""Bad usage, a bad config, or an agent that failed to start."""

DEMO_PROMPT: Final = "Summarise README.md and write the summary to SUMMARY.md."
"""What ``subagent demo`` asks the stub agent (which answers from its scenario regardless)."""

_MAX_PROMPT_MIB: Final = DEFAULT_MAX_LINE_BYTES // (1024 * 1024)
_REAL_AGENT_HINT: Final = "subagent run -- npx @agentclientprotocol/claude-agent-acp"
_PROG: Final = "subagent"

PermissionChoice = Literal["allow", "deny", "ask"]


# -- the turn ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _TurnSpec:
    """Everything one turn needs, after options, config and defaults were merged."""

    command: list[str]
    prompt: str
    cwd: str
    env: Mapping[str, str] | None = None
    permission: PermissionChoice | Literal["demo"] = "deny"
    permission_timeout: float = DEFAULT_PERMISSION_CALLBACK_TIMEOUT
    answers: AnswerSource | None = None
    timeout: float | None = None
    ready_timeout: float | None = None
    auth_method: str | None = None
    fs: bool = True
    json_output: bool = False
    events: bool = False
    progress: bool = False
    demo: bool = False


@dataclass(slots=True)
class _Outcome:
    result: SubagentResult
    start_error: str | None = None
    elapsed: float = 0.0


class _Interrupts:
    """Turns signals into actions on the run: the first SIGINT cancels the turn; SIGTERM/SIGHUP
    tear the agent down (dispose: a bounded, graceful teardown); a second SIGINT, or any signal
    once a teardown is under way, also SIGKILLs the agent's whole process tree at once, so a
    teardown waiting out a grace period ends now. Signals before the run exists are kept for it."""

    SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, view: RunView, task_group: anyio.abc.TaskGroup) -> None:
        self.view = view
        self.count = 0
        self._task_group = task_group
        self._run: ServiceRun | None = None
        self._pending: str | None = None
        self._cancelling = False
        self._kill = False
        self.stopped_by: str | None = None
        """What tore the agent down at once: "a second SIGINT", "SIGTERM" or "SIGHUP"."""

    async def watch(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.open_signal_receiver(*self.SIGNALS) as signals:
            task_status.started()
            async for signum in signals:
                self._on_signal(signal.Signals(signum))

    def attach(self, run: ServiceRun) -> None:
        self._run = run
        if self._pending is not None:
            self._act(self._pending)

    def _on_signal(self, signum: signal.Signals) -> None:
        self.count += 1
        if self.stopped_by is not None:
            # Insisting while a teardown runs: no grace is left to wait out.
            logger.debug("%s received (%d so far) during teardown: killing", signum.name, self.count)
            self._kill = True
            self._kill_now()
            return
        action = "cancel" if signum == signal.SIGINT and not self._cancelling else "stop"
        if action == "cancel":
            self._cancelling = True
        else:
            self.stopped_by = f"a second {signum.name}" if signum == signal.SIGINT else signum.name
            # The user pressed Ctrl-C twice: whatever grace the first one started, it is over.
            self._kill = signum == signal.SIGINT
        logger.debug("%s received (%d so far): %s", signum.name, self.count, action)
        self.view.interrupted(signum.name, self.count, action)
        if self._run is None:
            self._pending = action
        else:
            self._act(action)

    def _act(self, action: str) -> None:
        run = self._run
        assert run is not None
        if action == "stop" and self._kill:
            self._kill_now()
        self._task_group.start_soon(run.cancel if action == "cancel" else run.dispose)

    def _kill_now(self) -> None:
        """SIGKILL the agent's whole tree, if it has one yet; a teardown under way then finds it gone
        at its next look (within ~50 ms) instead of waiting out its grace. Idempotent."""
        run = self._run
        if run is None:
            return  # the start is abandoned by dispose() once the run exists (see attach)
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        acp_run.kill()


@dataclass(frozen=True, slots=True)
class _Denial:
    """A permission question the policy answered with a rejection, or withdrew."""

    call: ToolCallState
    reason: str


class _StartGate(RunView):
    """Forwards to the real view, announcing the start (once) before anything of the session.
    Remembers the last permission decision: a denial may be why the agent ended its turn."""

    def __init__(self, inner: RunView) -> None:
        self.inner = inner
        self.announce: Callable[[], None] = lambda: None
        self.last_denial: _Denial | None = None
        """The last permission decision, if it was a denial (None after an allowing one)."""

    def spawning(self, command: Sequence[str], cwd: str) -> None:
        logger.info("starting agent `%s` in %s", shlex.join(command), cwd)
        self.inner.spawning(command, cwd)

    def started(self, info: StartInfo) -> None:
        logger.info(
            "agent ready: %s %s, protocol version %s, session %s",
            info.agent_name or "(unnamed)",
            info.agent_version or "",
            info.protocol_version,
            info.session_id,
        )
        self.inner.started(info)

    def update(self, update: schema.SessionUpdate, changed_call: ToolCallState | None) -> None:
        self.announce()
        self.inner.update(update, changed_call)

    def question(self, question: PermissionQuestion, call: ToolCallState, timeout: float) -> None:
        self.announce()
        self.inner.question(question, call, timeout)

    def answered(self, *, echoed: bool) -> None:
        self.inner.answered(echoed=echoed)

    def decided(
        self, question: PermissionQuestion, call: ToolCallState, decision: PermissionDecision, reason: str
    ) -> None:
        self.announce()
        answer = "cancelled" if isinstance(decision, PermissionOutcome) else decision.option_id
        logger.info("permission for tool call %r: %s (%s)", question.tool_call_id, answer, reason)
        denied = isinstance(decision, PermissionOutcome) or decision.kind in ("reject_once", "reject_always")
        self.last_denial = _Denial(call, reason) if denied else None
        self.inner.decided(question, call, decision, reason)

    def interrupted(self, signal_name: str, count: int, action: str) -> None:
        self.inner.interrupted(signal_name, count, action)

    def start_failed(self, message: str) -> None:
        self.inner.start_failed(message)

    def ended(self, result: SubagentResult, elapsed: float) -> None:
        self.announce()
        logger.info("turn ended: %s in %.2f s", result.stop_reason, elapsed)
        self.inner.ended(result, elapsed)

    def log(self, record: logging.LogRecord, message: str) -> None:
        self.inner.log(record, message)


def _policy(spec: _TurnSpec, view: RunView, tool_calls: ToolCalls) -> PermissionPolicy:
    if spec.permission == "ask":
        return AskPolicy(view, tool_calls, spec.answers, timeout=spec.permission_timeout)
    if spec.permission == "demo":
        return ReportingPolicy(AllowPolicy(), "demo", view, tool_calls)
    inner: PermissionPolicy = AllowPolicy() if spec.permission == "allow" else DenyPolicy()
    return ReportingPolicy(inner, f"--permission {spec.permission}", view, tool_calls)


async def _drive(spec: _TurnSpec, view: RunView) -> _Outcome:
    """Run the turn through the service; never raises for a child-level failure or an interrupt."""
    gate = _StartGate(view)
    tool_calls = ToolCalls()
    try:
        provider = AcpProvider(
            spec.command,
            name="acp",
            env=spec.env,
            cwd=spec.cwd,
            permission=_policy(spec, gate, tool_calls),
            auth_method=spec.auth_method,
            fs=spec.fs,
            ready_timeout=spec.ready_timeout if spec.ready_timeout is not None else DEFAULT_READY_TIMEOUT,
        )
    except (ValueError, TypeError) as exc:
        # A command or environment no process could receive (a NUL in an argument, say).
        raise _UsageError(str(exc)) from None
    request = SubagentRequest(prompt=spec.prompt, cwd=spec.cwd, timeout=spec.timeout)
    began = time.monotonic()
    async with anyio.create_task_group() as outer:
        interrupts = _Interrupts(gate, outer)
        # The receiver stays open until the service has torn the agent down, so a Ctrl-C during
        # teardown is handled too, never raised as KeyboardInterrupt in the middle of it.
        await outer.start(interrupts.watch)
        try:
            async with SubagentService() as service:
                service.register_provider(provider)
                gate.spawning(spec.command, spec.cwd)
                run = service.start(provider.name, request)
                acp_run = run.provider_run
                assert isinstance(acp_run, AcpRun)
                announced = False

                def announce() -> None:
                    nonlocal announced
                    if not announced and acp_run.session_id is not None:
                        announced = True
                        gate.started(_start_info(acp_run, spec))

                gate.announce = announce

                def on_update(update: schema.SessionUpdate) -> None:
                    gate.update(update, tool_calls.observe(update))

                acp_run.on_update(on_update)
                interrupts.attach(run)
                async with run:
                    outcome = await _await_turn(run, acp_run, spec, gate, interrupts, announce)
        finally:
            outer.cancel_scope.cancel()
    outcome.elapsed = time.monotonic() - began
    denial = gate.last_denial
    if outcome.result.stop_reason == "cancelled" and denial is not None and not interrupts.count:
        # Nobody pressed Ctrl-C: the agent ended its own turn on our denial (Codex, for one,
        # offers only a reject option that aborts the turn). Say so, and how to allow it.
        why = _denial_explanation(denial, spec.permission)
        error = outcome.result.error
        outcome.result = dataclasses.replace(outcome.result, error=f"{error}; {why}" if error else why)
    if outcome.start_error is None:
        gate.ended(outcome.result, outcome.elapsed)
    return outcome


_MAX_TITLE_CHARS: Final = 200


def _denial_explanation(denial: _Denial, permission: str) -> str:
    title = " ".join(sanitize(denial.call.title or denial.call.tool_call_id).split())
    if len(title) > _MAX_TITLE_CHARS:
        title = title[: _MAX_TITLE_CHARS - 1] + "\u2026"
    how = (
        "answer yes when asked, or use --permission allow to allow every request"
        if permission == "ask"
        else "use --permission allow to allow every request, or --permission ask to decide each one"
    )
    return (
        f"the agent ended its turn after its permission request for {title!r} was denied "
        f"({denial.reason}); to allow it, {how}"
    )


async def _await_turn(
    run: ServiceRun,
    acp_run: AcpRun,
    spec: _TurnSpec,
    view: RunView,
    interrupts: _Interrupts,
    announce: Callable[[], None],
) -> _Outcome:
    try:
        await run.started()
    except SubagentError as exc:
        if interrupts.count:
            return _Outcome(_interrupted_result(acp_run, "interrupted before the agent was ready"))
        message = _start_failure(exc, acp_run, spec)
        view.start_failed(message)
        return _Outcome(SubagentResult(output="", stop_reason="error", error=message), start_error=message)
    announce()
    try:
        result = await run.result()
    except SubagentError as exc:
        if interrupts.stopped_by is not None:
            return _Outcome(_torn_down_result(acp_run, interrupts.stopped_by))
        logger.debug("the run's result failed", exc_info=True)
        return _Outcome(SubagentResult(output=acp_run.output, stop_reason="error", error=exc.message))
    if interrupts.stopped_by is not None and result.stop_reason == "error":
        # Torn down at once while the turn ran: the child's death is our doing, not its failure.
        return _Outcome(_torn_down_result(acp_run, interrupts.stopped_by))
    return _Outcome(result)


def _torn_down_result(acp_run: AcpRun, stopped_by: str) -> SubagentResult:
    return _interrupted_result(acp_run, f"the agent was torn down at once on {stopped_by}")


def _interrupted_result(acp_run: AcpRun, why: str) -> SubagentResult:
    return SubagentResult(output=acp_run.output, stop_reason="cancelled", error=why)


def _start_info(acp_run: AcpRun, spec: _TurnSpec) -> StartInfo:
    agent = acp_run.agent
    info = agent.agent_info if agent is not None else None
    return StartInfo(
        run_id=acp_run.id,
        session_id=acp_run.session_id,
        command=spec.command,
        cwd=spec.cwd,
        agent_name=(info.title or info.name) if info is not None else None,
        agent_version=info.version if info is not None else None,
        protocol_version=agent.protocol_version if agent is not None else None,
    )


def _start_failure(exc: SubagentError, acp_run: AcpRun, spec: _TurnSpec) -> str:
    message = exc.message
    agent = acp_run.agent
    if spec.auth_method is None and agent is not None and agent.auth_methods:
        ids = [_auth_method_id(method) for method in agent.auth_methods]
        offered = ", ".join(repr(method_id) for method_id in ids if method_id)
        message += f" (to authenticate with one of {offered}: --auth-method ID, or auth_method in the config)"
    return message


def _auth_method_id(method: schema.AuthMethod) -> str | None:
    if isinstance(method, schema.UnknownAuthMethod):
        value = method.raw.get("id")
        return value if isinstance(value, str) else None
    return method.id


def _execute(spec: _TurnSpec) -> int:
    """Run the turn, print its outcome, and return the exit status."""
    console = Console(sys.stderr, color=use_color(sys.stderr))
    view: RunView = (
        EventView(sys.stderr)
        if spec.events
        else HumanView(console, progress=spec.progress, decisions=spec.progress or spec.permission == "ask")
    )
    _LOG_HANDLER.view = view
    try:
        outcome = anyio.run(_drive, spec, view)
    finally:
        _LOG_HANDLER.view = None
        if spec.answers is not None:
            spec.answers.close()
    result = outcome.result
    if spec.json_output:
        _print_json(
            {
                "output": result.output,
                "stopReason": result.stop_reason,
                "error": result.error,
                "usage": usage_json(result.usage),
            }
        )
    elif result.output and outcome.start_error is None:
        _print_stdout(result.output if result.output.endswith("\n") else result.output + "\n")
    if outcome.start_error is not None:
        if not spec.events:
            console.line(f"{_PROG}: the agent failed to start: {outcome.start_error}")
        return EXIT_USAGE
    if not result.ok and not spec.events:
        detail = f": {result.error}" if result.error else ""
        console.line(f"{_PROG}: the turn ended with stop reason {result.stop_reason!r}{detail}")
    if spec.demo and not spec.events:
        console.line(
            f"That was the bundled stub agent (no network, no keys). To drive a real one: {_REAL_AGENT_HINT}"
        )
    return EXIT_COMPLETED if result.ok else EXIT_NOT_COMPLETED


def _print_json(value: Mapping[str, Any]) -> None:
    import json

    _print_stdout(json.dumps(value, ensure_ascii=False) + "\n")


def _print_stdout(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`| head`): nothing left to tell it. Point stdout at /dev/null so the
        # interpreter's final flush does not complain either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


# -- logging -------------------------------------------------------------------------------------------


class _ViewLogHandler(logging.Handler):
    """Sends log records to the current view (as text, or as ``log`` events), else to stderr."""

    def __init__(self) -> None:
        super().__init__()
        self.view: RunView | None = None
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            view = self.view
            if view is not None:
                view.log(record, message)
            else:
                sys.stderr.write(f"{_PROG}: {record.levelname.lower()}: {message}\n")
                sys.stderr.flush()
        except Exception:
            self.handleError(record)


_LOG_HANDLER: Final = _ViewLogHandler()


def _configure_logging(verbosity: int) -> Callable[[], None]:
    root = logging.getLogger()
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    previous_level = root.level
    root.addHandler(_LOG_HANDLER)
    root.setLevel(level)

    def restore() -> None:
        root.removeHandler(_LOG_HANDLER)
        root.setLevel(previous_level)

    return restore


# -- the commands ----------------------------------------------------------------------------------------


class _UsageError(Exception):
    """Bad usage found after argparse: reported like argparse does, exit status 2."""


class _PromptTooLarge(Exception):
    """A prompt too large to send to any agent: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


_RUN_DESCRIPTION: Final = """\
Run one prompt through an ACP agent and print its final answer on stdout.

The agent is COMMAND ARGS... after `--` (started with no shell, in its own process group), or a
named agent from the config with --agent NAME. The prompt is -p TEXT, or else all of stdin.
"""

_RUN_EPILOG: Final = f"""\
permission questions (--permission):
  allow   allow every tool call the agent asks about
  deny    reject every one
  ask     show the question on stderr (a permission_request event with --events) and read
          the answer from stdin when the prompt came from -p, else from /dev/tty: the
          option's number, id or name, or y/n. Anything else, end of input, no terminal,
          and no answer within --permission-timeout reject.
  The default is ask when that answer comes from a terminal and stderr is one, else deny.

output:
  stdout gets only the final answer (the agent's text after its last tool call), or with
  --json exactly one object: {{"output", "stopReason", "error", "usage"}} (an agent that
  fails to start gets one too, with stopReason "error"; bad usage gets none).
  Live progress goes to stderr when stderr is a terminal: the answer as it streams, tool
  calls as their status changes, the plan, thoughts dimmed, permission decisions; never
  with --json or --events. Colour only on a terminal and without NO_COLOR.
  --events writes one JSON object per line on stderr instead: spawn, start, update (the ACP
  session/update params, camelCase as on the wire), permission_request, permission,
  interrupt, start_failed, end, and log.

exit status:
  0 the turn completed; 1 it ended any other way (refusal, max_tokens, max_turns, timeout,
  error, cancelled); 2 bad usage, a bad config, a prompt too large to send (over {_MAX_PROMPT_MIB} MiB as
  one JSON message; no agent is started), or the agent failed to start (the message names
  the command, its exit status and the tail of its stderr).

interrupts:
  Ctrl-C once cancels the turn (session/cancel; an agent that ignores it is torn down after
  a grace of a few seconds) and exits 1 with stop reason "cancelled". Ctrl-C again kills
  the agent and every process it started at once (SIGKILL, no grace; exit 1), even while
  a teardown is waiting for it. SIGTERM and SIGHUP tear it down at once too.

examples:
  {_PROG} run -p "Summarise README.md" -- npx @agentclientprotocol/claude-agent-acp
  git diff | {_PROG} run --agent claude --json --permission deny
"""

_MAIN_EPILOG: Final = f"""\
config: --agent NAME reads [agents.NAME] from --config PATH, else ./subagent.toml, else
$XDG_CONFIG_HOME/subagent/config.toml (~/.config/subagent/config.toml). Example:

  [agents.claude]
  command = "npx"
  args = ["-y", "@agentclientprotocol/claude-agent-acp"]
  env = {{ ANTHROPIC_LOG = "error" }}
  permission = "ask"          # allow | deny | ask
  timeout = 600               # inactivity timeout, seconds
  cwd = "~/src/project"       # relative to the config file's directory

Other keys: description, ready_timeout, auth_method, fs (false: --no-fs).
Run `{_PROG} COMMAND --help` for more.
"""


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text!r}")
    return value


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="log to stderr: -v what happens, -vv debug detail (as `log` events with --events)",
    )


def _add_turn_options(parser: argparse.ArgumentParser, *, demo: bool) -> None:
    default = (
        "default: allow, shown as '(demo)'; ask reads the answer from stdin"
        if demo
        else "default: ask when a person can answer on a terminal, else deny; see below"
    )
    parser.add_argument(
        "--permission",
        choices=("allow", "deny", "ask"),
        help=f"how to answer the agent's permission questions ({default})",
    )
    parser.add_argument(
        "--permission-timeout",
        type=_seconds,
        metavar="SECONDS",
        default=DEFAULT_PERMISSION_CALLBACK_TIMEOUT,
        help="with --permission ask, reject a question nobody answered within this time "
        "(default: %(default)g)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print exactly one JSON object on stdout: output, stopReason, error, usage",
    )
    parser.add_argument(
        "--events",
        action="store_true",
        help="write every session update and lifecycle event as one JSON object per line on stderr",
    )
    progress_default = "on" if demo else "on when stderr is a terminal"
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"live progress on stderr (default: {progress_default}; never with --json or --events)",
    )


def _build_parser() -> tuple[_Parser, dict[str, _Parser]]:
    parser = _Parser(
        prog=_PROG,
        description="Delegate work to another AI agent over the Agent Client Protocol (ACP).",
        epilog=_MAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_verbose(parser)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(
        dest="subcommand", metavar="COMMAND", required=True, parser_class=_Parser
    )

    run = commands.add_parser(
        "run",
        help="run one prompt through an ACP agent and print its answer",
        description=_RUN_DESCRIPTION,
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{_PROG} run [OPTIONS] (-- COMMAND [ARGS...] | --agent NAME)",
    )
    run.add_argument("-p", "--prompt", metavar="TEXT", help="the prompt (default: read all of stdin)")
    run.add_argument(
        "--agent", metavar="NAME", help="run the agent named NAME in the config instead of a COMMAND"
    )
    run.add_argument(
        "--config",
        metavar="PATH",
        help="the config file for --agent "
        "(default: ./subagent.toml, else $XDG_CONFIG_HOME/subagent/config.toml)",
    )
    run.add_argument(
        "--cwd",
        metavar="DIR",
        help="the session's working directory, the only place the agent may read and write through us "
        "(default: the agent's configured cwd, else the current directory)",
    )
    run.add_argument(
        "--timeout",
        type=_seconds,
        metavar="SECONDS",
        help="end the turn with stop reason 'timeout' after this long without a word from the agent "
        "(paused while a permission question waits; default: no limit)",
    )
    run.add_argument(
        "--auth-method", metavar="ID", help="the auth method to use if the agent demands authentication"
    )
    run.add_argument(
        "--fs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="offer the agent our file system (fs/read_text_file, fs/write_text_file, confined to the "
        "cwd). --no-fs offers none, so the agent reads and writes files itself: a workaround for agents "
        "whose use of it is broken, such as Gemini CLI 0.61.0, which cannot create a new file through a "
        "client that offers it (default: the agent's `fs` in the config, else on)",
    )
    _add_turn_options(run, demo=False)
    _add_verbose(run)

    demo = commands.add_parser(
        "demo",
        help="a full turn against the bundled stub agent: no network, no keys",
        description="Run a full turn against the bundled stub ACP agent, through the same code as `run`, "
        "with live progress on stderr and the final answer on stdout. The agent's permission question is "
        "allowed automatically, shown as '(demo)', unless --permission is given. No network, no keys; "
        "exit status as for `run`.",
    )
    demo.add_argument(
        "--scenario",
        metavar="FILE",
        help="give the stub agent this scenario file instead of its default "
        "(the format: python -m pydoc subagent.testing.scenario)",
    )
    demo.add_argument(
        "--only",
        choices=("acp", "delegation"),
        help="run one part: the stub ACP agent's turn, or an in-process agent delegating to fork, spawn "
        "and acp at once (default: both, in that order)",
    )
    _add_turn_options(demo, demo=True)
    _add_verbose(demo)

    agents = commands.add_parser(
        "agents",
        help="list the agents named in the config",
        description="List the agents configured for `run --agent NAME`: name, command line and source file. "
        "See `subagent --help` for the config format.",
    )
    agents.add_argument("--config", metavar="PATH", help="read this config file instead of looking for one")
    agents.add_argument("--json", action="store_true", help="print the list as one JSON object")
    _add_verbose(agents)

    serve = _add_serve_parser(commands)
    return parser, {"run": run, "demo": demo, "agents": agents, "serve": serve}


def _split_command(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """The arguments before the first ``--``, and the agent command after it (None without ``--``)."""
    if "--" not in argv:
        return list(argv), None
    index = list(argv).index("--")
    return list(argv[:index]), list(argv[index + 1 :])


def _default_permission(answers: AnswerSource | None) -> PermissionChoice:
    return "ask" if answers is not None and answers.isatty() and is_terminal(sys.stderr) else "deny"


def _answer_source(prompt_from_stdin: bool) -> AnswerSource | None:
    return AnswerSource.terminal() if prompt_from_stdin else AnswerSource.stdin()


def _check_output_options(args: argparse.Namespace) -> None:
    if args.progress and (args.json or args.events):
        raise _UsageError("--progress cannot be combined with --json or --events")


def _read_prompt_from_stdin() -> str:
    stream = sys.stdin
    if stream is None:
        return ""
    if stream.isatty():
        sys.stderr.write(f"{_PROG}: reading the prompt from the terminal; finish it with Ctrl-D\n")
        sys.stderr.flush()
    limit = DEFAULT_MAX_LINE_BYTES
    data = stream.buffer.read(limit + 1)
    if len(data) > limit:
        # Each byte read is at least a byte of the message: the rest need not be read, nor held.
        raise _PromptTooLarge(
            f"the prompt on stdin is more than {limit:,} bytes, over the {limit:,}-byte "
            f"({_MAX_PROMPT_MIB} MiB) limit on one message to the agent (max_line_bytes)"
        )
    return data.decode("utf-8", errors="replace")


def _cmd_run(args: argparse.Namespace, command: list[str] | None) -> int:
    _check_output_options(args)
    agent: AgentConfig | None = None
    if args.agent is not None and command is not None:
        raise _UsageError("give either --agent NAME or `-- COMMAND [ARGS...]`, not both")
    if args.agent is None and not command:
        raise _UsageError(
            "no agent to run: put its command after `--` (e.g. `subagent run -- npx "
            "@agentclientprotocol/claude-agent-acp`) or name a configured one with --agent NAME"
        )
    if args.agent is not None:
        agent = _configured_agent(args.agent, args.config)
        command = list(agent.command)
    assert command
    cwd = args.cwd or (agent.cwd if agent else None)
    if cwd is not None and not os.path.isdir(cwd):
        where = f"the cwd of agent {agent.name!r} in {agent.source}" if agent and not args.cwd else "--cwd"
        raise _UsageError(f"{where}: {cwd!r} is not a directory")
    prompt = args.prompt if args.prompt is not None else _read_prompt_from_stdin()
    if not prompt.strip():
        raise _UsageError("the prompt is empty: pass -p TEXT or pipe the prompt on stdin")
    too_large = prompt_size_error(prompt)
    if too_large is not None:
        # Refused before an agent is spawned: it could not be sent to one.
        raise _PromptTooLarge(too_large)
    answers = _answer_source(prompt_from_stdin=args.prompt is None)
    permission: PermissionChoice = (
        args.permission
        or (agent.permission if agent and agent.permission else None)
        or (_default_permission(answers))
    )
    if permission != "ask" and answers is not None:
        answers.close()
        answers = None
    spec = _TurnSpec(
        command=command,
        prompt=prompt,
        cwd=os.path.abspath(cwd or os.getcwd()),
        env=dict(agent.env) if agent and agent.env else None,
        permission=permission,
        permission_timeout=args.permission_timeout,
        answers=answers,
        timeout=args.timeout if args.timeout is not None else (agent.timeout if agent else None),
        ready_timeout=agent.ready_timeout if agent else None,
        auth_method=args.auth_method or (agent.auth_method if agent else None),
        fs=args.fs if args.fs is not None else (agent.fs if agent else True),
        json_output=args.json,
        events=args.events,
        progress=_progress_wanted(args, default=is_terminal(sys.stderr)),
    )
    return _execute(spec)


def _progress_wanted(args: argparse.Namespace, *, default: bool) -> bool:
    if args.json or args.events:
        return False
    return default if args.progress is None else bool(args.progress)


def _cmd_demo(args: argparse.Namespace, command: list[str] | None) -> int:
    _check_output_options(args)
    if command is not None:
        raise _UsageError(
            "demo runs the bundled stub agent and takes no `-- COMMAND`; use `subagent run` for that"
        )
    stub = [sys.executable, "-m", "subagent.testing.stub_agent"]
    if args.scenario is not None:
        if not os.path.isfile(args.scenario):
            raise _UsageError(f"--scenario: {args.scenario!r} is not a file")
        stub += ["--scenario", os.path.abspath(args.scenario)]
    answers: AnswerSource | None = None
    permission: PermissionChoice | Literal["demo"] = args.permission or "demo"
    if permission == "ask":
        answers = AnswerSource.stdin()
    spec = _TurnSpec(
        command=stub,
        prompt=DEMO_PROMPT,
        cwd=os.getcwd(),
        permission=permission,
        permission_timeout=args.permission_timeout,
        answers=answers,
        json_output=args.json,
        events=args.events,
        progress=_progress_wanted(args, default=True),
        demo=True,
    )
    status = EXIT_COMPLETED
    if args.only in (None, "acp"):
        if spec.progress:
            console = Console(sys.stderr, color=use_color(sys.stderr))
            console.line(console.paint(f"{_PROG} demo: one turn against the bundled stub ACP agent", "1"))
            console.line(console.paint(f"> {DEMO_PROMPT}", "2"))
        status = _execute(spec)
    if args.only in (None, "delegation") and status != EXIT_USAGE:
        status = max(status, _delegation_demo(args, narrate=spec.progress and not spec.events))
    return status


def _delegation_demo(args: argparse.Namespace, *, narrate: bool) -> int:
    """The in-process half of the demo: an agent delegates to fork, spawn and acp at once."""
    from subagent.cli.demo import run_delegation_demo

    # Not narrating (--events, --quiet): the narration goes nowhere.
    console = Console(sys.stderr if narrate else io.StringIO(), color=narrate and use_color(sys.stderr))
    if narrate:
        console.line(
            console.paint(f"{_PROG} demo: an in-process agent delegates to fork, spawn and acp at once", "1")
        )
    try:
        report = anyio.run(run_delegation_demo, console)
    except Exception as exc:
        logger.debug("the delegation demo failed", exc_info=True)
        Console(sys.stderr, color=False).line(f"{_PROG}: the delegation demo failed: {exc}")
        return EXIT_NOT_COMPLETED
    if args.json:
        _print_json({"output": report, "stopReason": "completed", "error": None, "usage": None})
    else:
        _print_stdout(report + "\n")
    if narrate:
        console.line(
            "That was the in-process runtime on a scripted model. "
            "Serve it to any ACP client: subagent serve --script FILE"
        )
    return EXIT_COMPLETED


def _configured_agent(name: str, explicit_config: str | None) -> AgentConfig:
    path = find_config(explicit_config)
    if path is None:
        looked = ", ".join(str(candidate) for candidate in config_search_path())
        raise _UsageError(f"--agent {name}: no config file found (looked for {looked})")
    config = load_config(path)
    agent = config.agents.get(name)
    if agent is None:
        known = ", ".join(config.agents) or "none"
        raise _UsageError(f"--agent {name}: no agent named {name!r} in {path} (configured: {known})")
    return agent


def _cmd_agents(args: argparse.Namespace, command: list[str] | None) -> int:
    if command is not None:
        raise _UsageError("agents takes no `-- COMMAND`")
    searched = [Path(args.config)] if args.config is not None else config_search_path()
    path = find_config(args.config)
    agents = list(load_config(path).agents.values()) if path is not None else []
    if args.json:
        _print_json(
            {
                "config": None if path is None else str(path),
                "searched": [str(candidate) for candidate in searched],
                "agents": [
                    {
                        "name": agent.name,
                        "command": list(agent.command),
                        "description": agent.description,
                        "fs": agent.fs,
                        "source": str(agent.source),
                    }
                    for agent in agents
                ],
            }
        )
        return 0
    if path is None:
        looked = "\n".join(f"  {candidate}" for candidate in searched)
        _print_stdout(f"no agents configured; looked for a config file at:\n{looked}\n")
        _print_stdout(f"see `{_PROG} --help` for the format\n")
        return 0
    if not agents:
        _print_stdout(f"no agents configured in {path}\n")
        return 0
    width = max(len(agent.name) for agent in agents)
    lines = [f"agents in {path}:"]
    for agent in agents:
        no_fs = "  (fs off: no fs/* offered)" if not agent.fs else ""
        lines.append(f"  {agent.name:<{width}}  {shlex.join(agent.command)}{no_fs}")
        if agent.description:
            lines.append(f"  {'':<{width}}  {agent.description}")
    _print_stdout("\n".join(lines) + "\n")
    return 0


# -- serve ----------------------------------------------------------------------------------------------

_SERVE_DESCRIPTION: Final = """\
Serve an in-process agent as an ACP agent on stdin/stdout, for an ACP client to spawn: Zed,
`subagent run -- subagent serve ...`, or any other. Each session gets its own agent, which can
delegate to in-process subagents (providers `spawn` and `fork`) with the `subagent` tool; a tool
call that needs approval is asked about with session/request_permission.

The model is a deterministic script (--script FILE: no network, no keys) or an OpenAI-compatible
chat-completions server (--base-url URL --model NAME: OpenAI, DeepSeek, vLLM, Ollama, llama.cpp).
"""

_SERVE_EPILOG: Final = f"""\
the API key:
  read from the environment variable --api-key-env names (default: OPENAI_API_KEY), never
  from the command line; without one no Authorization header is sent (local servers).

scripts (--script):
  a JSON list of replies, or {{"replies": [...], "fallback": reply}}; a reply is a string or
  {{"text", "tool_calls": [{{"name", "arguments", "id"?}}], "finish_reason", "usage", "error",
  "when": {{"last_user_contains", "system_contains", "has_tool", "after_tool_result"}}}}.
  Each reply is used once, the first unused one whose `when` matches; the session's agent
  and its subagents share the script. Details: python -m pydoc subagent.runtime.scripted

output:
  stdout carries only the protocol; logs go to stderr (-v, -vv for more).

exit status:
  0 when the client closes stdin, once the requests still in flight then are answered (a
  pipe gets every answer); 2 for bad usage or a script that cannot be read.

examples:
  {_PROG} serve --script fixtures/scripts/delegate_to_spawn.json
  {_PROG} run -p "Ask a subagent what 6 times 7 is" -- {_PROG} serve --script delegate.json
  OPENAI_API_KEY=... {_PROG} serve --base-url https://api.openai.com/v1 --model gpt-4.1-mini
"""


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, not {value}")
        return value

    return parse


def _add_serve_parser(commands: argparse._SubParsersAction[_Parser]) -> _Parser:
    serve: _Parser = commands.add_parser(
        "serve",
        help="serve an in-process agent as an ACP agent on stdin/stdout",
        description=_SERVE_DESCRIPTION,
        epilog=_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{_PROG} serve (--script FILE | --base-url URL --model NAME [--api-key-env VAR]) [OPTIONS]",
    )
    model = serve.add_mutually_exclusive_group()
    model.add_argument("--script", metavar="FILE", help="answer with this ScriptedLlm JSON script")
    model.add_argument("--base-url", metavar="URL", help="an OpenAI-compatible API root, e.g. .../v1")
    serve.add_argument("--model", metavar="NAME", help="the model name to ask for (with --base-url)")
    serve.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="the environment variable holding the API key (with --base-url; default: OPENAI_API_KEY)",
    )
    serve.add_argument(
        "--persona",
        metavar="TEXT",
        help="the system prompt of every session's agent (default: a short generic one; '' for none)",
    )
    serve.add_argument(
        "--max-model-calls",
        type=_count(1),
        metavar="N",
        # The runtime's default (not imported here: building the parser must stay cheap for every command).
        help="model calls one turn may make before it stops with max_turn_requests (default: 32)",
    )
    serve.add_argument("--no-delegate", action="store_true", help="no subagent tool: the agent works alone")
    serve.add_argument(
        "--depth-limit",
        type=_count(0),
        metavar="N",
        help="each subagent may start at most N levels of subagents below itself (0: none); a larger "
        "depth_limit the model asks for is lowered to N (default: the model decides)",
    )
    serve.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="log to stderr: -v sessions opened and closed, -vv protocol detail",
    )
    return serve


def _cmd_serve(args: argparse.Namespace, command: list[str] | None) -> int:
    # Imported here: the other commands do not need the in-process runtime.
    from subagent.runtime.agent import DEFAULT_MAX_MODEL_CALLS
    from subagent.serve import DEFAULT_API_KEY_ENV, ServeConfigError, serve

    if command is not None:
        raise _UsageError("serve takes no `-- COMMAND`: it is the agent")
    if args.script is None and args.base_url is None:
        raise _UsageError("no model: give --script FILE, or --base-url URL and --model NAME")
    if args.base_url is not None and not args.model:
        raise _UsageError("--base-url needs --model NAME")
    if args.base_url is None and (args.model is not None or args.api_key_env is not None):
        raise _UsageError("--model and --api-key-env go with --base-url (a script needs neither)")
    if args.no_delegate and args.depth_limit is not None:
        raise _UsageError("--depth-limit limits delegation; it has no meaning with --no-delegate")
    api_key_env = args.api_key_env or DEFAULT_API_KEY_ENV
    if args.base_url is not None and api_key_env not in os.environ:
        logger.info("%s is not set: requests go without an API key", api_key_env)
    if sys.stdin is not None and sys.stdin.isatty():
        sys.stderr.write(
            f"{_PROG} serve: speaking ACP on stdin/stdout, for an ACP client to drive; Ctrl-D ends\n"
        )
        sys.stderr.flush()
    try:
        anyio.run(
            functools.partial(
                serve,
                script=args.script,
                base_url=args.base_url,
                model=args.model,
                api_key_env=api_key_env,
                persona=args.persona,
                max_model_calls=args.max_model_calls or DEFAULT_MAX_MODEL_CALLS,
                delegate=not args.no_delegate,
                depth_limit=args.depth_limit,
            )
        )
    except ServeConfigError as exc:
        raise _UsageError(str(exc)) from exc
    return 0


_COMMANDS: Final[dict[str, Callable[[argparse.Namespace, list[str] | None], int]]] = {
    "run": _cmd_run,
    "demo": _cmd_demo,
    "agents": _cmd_agents,
    "serve": _cmd_serve,
}


@dataclass(slots=True)
class _Invocation:
    parser: _Parser
    subparsers: dict[str, _Parser] = field(default_factory=dict)
    name: str | None = None

    def usage_error(self, message: str) -> int:
        parser = self.subparsers.get(self.name or "", self.parser)
        sys.stderr.write(parser.format_usage())
        sys.stderr.write(f"{parser.prog}: error: {message}\n")
        sys.stderr.flush()
        return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``) and return its exit status."""
    before, command = _split_command(sys.argv[1:] if argv is None else argv)
    parser, subparsers = _build_parser()
    invocation = _Invocation(parser, subparsers)
    invocation.name = next((arg for arg in before if arg in subparsers), None)
    try:
        args = parser.parse_args(before)
    except _UsageError as exc:
        return invocation.usage_error(str(exc))
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else 0
    invocation.name = args.subcommand
    restore_logging = _configure_logging(getattr(args, "verbose", 0))
    try:
        return _COMMANDS[args.subcommand](args, command)
    except _UsageError as exc:
        return invocation.usage_error(str(exc))
    except ConfigError as exc:
        sys.stderr.write(f"{_PROG}: invalid config: {exc}\n")
        return EXIT_USAGE
    except _PromptTooLarge as exc:
        sys.stderr.write(f"{_PROG}: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Only outside a turn (a turn handles its own signals): e.g. while reading the prompt.
        sys.stderr.write(f"\n{_PROG}: interrupted\n")
        return EXIT_NOT_COMPLETED
    finally:
        restore_logging()


if __name__ == "__main__":
    sys.exit(main())
