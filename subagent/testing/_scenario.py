"""The scenario format of the stub ACP agent: what it answers, streams, asks and breaks, step by step.

A scenario is a JSON object, usually a file passed as ``python -m subagent.testing.stub_agent --scenario
FILE`` (or written for you by the ``stub_agent_command`` pytest fixture). Field names are camelCase like ACP's
own; every object is strict: an unknown field or step kind is an error whose message names the JSON path
(``$.turns[0][2]`` is the third step of the first turn; indexes count from 0). A short example::

    {
      "initialize": {"agentCapabilities": {"promptCapabilities": {"image": true}}},
      "requireAuth": "api-key",
      "turns": [
        [
          {"step": "message", "text": "Reading the file...", "chunks": 2},
          {"step": "tool_call", "toolCallId": "call-1", "title": "Read README.md", "kind": "read"},
          {"step": "permission", "branches": {
            "allow": [{"step": "message", "text": "Allowed."}],
            "cancelled": [{"step": "stop", "reason": "cancelled"}]
          }},
          {"step": "stop", "reason": "end_turn"}
        ]
      ]
    }

Top level (all optional)
    ``initialize``: ``{"steps", "protocolVersion", "agentCapabilities", "authMethods", "agentInfo"}``.
    The response is ``protocolVersion`` if given (to test a client against a version it does not speak),
    else the negotiated one (1). ``agentCapabilities``, ``authMethods`` and ``agentInfo`` are sent
    verbatim, except that ``loadSession`` / ``sessionCapabilities.resume`` are added when ``loadSession`` /
    ``resumeSession`` are configured and the capabilities do not mention them.
    ``requireAuth``: an auth method id. ``session/new``, ``session/load`` and ``session/resume`` fail with
    -32000 ``Authentication required`` until ``authenticate`` succeeds with exactly that id; any other id
    is answered -32602. With no ``authMethods``, ``[{"id": <it>, "name": <it>}]`` is advertised.
    ``authenticate``: ``{"steps"}``, run before answering ``authenticate``.
    ``newSession``: ``{"steps", "sessionId", "modes", "configOptions"}``. The first session is
    ``sessionId`` (default ``"session-1"``), later ones get ``-2``, ``-3``... ``modes`` (a
    ``SessionModeState``) and ``configOptions`` are sent verbatim; with ``modes``, ``session/set_mode``
    accepts the listed mode ids (others: -32602) and announces the change with a ``current_mode_update``.
    Without, ``session/set_mode`` is -32601. ``session/set_config_option`` sets an option of
    ``configOptions`` to one of its values (a ``mode`` option's value is the session's mode too) and answers
    every option; an unknown id or value is -32602.
    ``loadSession``: ``{"steps", "replay", "modes", "configOptions"}``: ``session/load`` sends each
    ``replay`` item (a raw ``SessionUpdate`` object) as a ``session/update`` for the loaded session, then
    answers. Absent: -32601. ``resumeSession``: ``{"steps", "modes", "configOptions"}``:
    ``session/resume`` answers without replay. Absent: -32601. Both report the request on stderr as
    ``stub agent: session/load <sessionId> <cwd>`` (or ``session/resume``) before their steps, and answer
    with ``modes`` and ``configOptions`` when given, which the reopened session then has as a new one
    has ``newSession``'s (``session/set_mode`` and ``session/set_config_option`` accept their values).
    ``closeSession``: ``{"steps"}``: advertise ``sessionCapabilities.close`` (added when the capabilities do
    not mention it) and answer ``session/close`` after the steps, reporting each close on stderr as
    ``stub agent: session/close <sessionId>`` and, later, the end of stdin as ``stub agent: stdin closed``
    (so a test can tell that the close came once, and before the EOF). Absent: -32601.
    ``turns``: a list of turns; each turn is the list of steps run for one ``session/prompt`` (counted per
    session). ``afterLastTurn``: what a prompt beyond the last turn does: ``"repeat"`` (default) runs the
    last turn again, ``"error"`` answers -32603. With no turns at all, every prompt answers ``end_turn``.
    ``onStdinEof``: ``"exit"`` (default) or ``"ignore"``: keep running after stdin closes, until signalled.
    Either way, requests still being served when stdin closes are abandoned, unanswered.
    ``ignoreSigterm``: ignore SIGTERM from the start.

Steps (``{"step": <kind>, ...}``)
    Every request's ``steps`` run in order before the normal answer; a step that answers (``stop``,
    ``error``) ends them, and one that never returns (``hang``, ``exit``, ``kill``) means no answer.
    ``initialize`` and ``authenticate`` have no session: steps that need one are refused there, and reports
    go to stderr. ``stop``, ``echo`` and ``wait_for_cancel`` belong to prompt turns only.

    Session updates: ``message`` {text, chunks=1, messageId?} and ``thought`` {text, chunks=1} split
    ``text`` into ``chunks`` nearly equal ``agent_message_chunk``/``agent_thought_chunk`` updates;
    ``tool_call`` {toolCallId, title, kind?, status?, content?, locations?, rawInput?, rawOutput?};
    ``tool_call_update`` {toolCallId, and any of those fields}; ``plan`` {entries: [{content,
    priority="medium", status="pending"}]}; ``usage`` {used, size, cost?} (a ``usage_update``);
    ``update`` {update, sessionId?}: any raw update object, unknown kinds included, optionally for another
    session id (Qwen Code's report of a model call's usage is one: an ``agent_message_chunk`` with empty
    text and ``"_meta": {"usage": {"inputTokens", "outputTokens", "totalTokens"}}``; claude-agent-acp's is
    a ``usage`` step whose ``cost`` {amount, currency} is what the session has cost so far, then its
    prompt response's ``usage``, a ``stop`` step's); ``echo`` {prefix=""}: the prompt's text back as a
    message; ``flood`` {count, text="{i}"}: ``count`` message chunks as fast as possible, ``{i}``
    replaced by the chunk's index (from 0).

    Asking the client: ``permission`` {toolCall?, options?, branches={}, report=false} asks
    ``session/request_permission`` (``toolCall`` defaults to ``{"toolCallId": <the session's last tool
    call id>}``, ``options`` to ``allow`` (allow_once) and ``reject`` (reject_once)); the steps of the branch
    named by the outcome (the selected option id, or ``"cancelled"``) run next, then the steps after it
    (an error from the client answers the prompt with that same error). With ``skipInModes`` [mode ids],
    a session in one of those modes is not asked: the branch of the first ``allow_once`` option runs, as
    an agent whose mode approves by itself would.
    ``elicit`` {message, requestedSchema={"type": "object", "properties": {}}, branches={}, report=true} asks
    ``elicitation/create`` in form mode for the session, reports the answer (or the client's error) like a
    request below, then runs the branch named by the answer's action (``accept``, ``decline``, ``cancel``).
    ``read_file`` {path, line?, limit?}, ``write_file`` {path, content}, ``call`` {method, params?} and
    ``notify`` {method, params?} send ``fs/read_text_file``, ``fs/write_text_file``, any request, any
    notification. A relative ``path`` of ``read_file`` and ``write_file`` is joined to the session's cwd
    (the one the client gave it, as an agent resolves a path its model gave), without normalising it:
    ``../x`` reaches the client as ``<cwd>/../x``. ``{prompt}`` in a ``write_file``'s ``content`` is
    replaced by the text of the prompt the turn answers. Requests report their outcome (``report=true`` by
    default) as one message chunk whose text is JSON: ``{"method": m, "result": <result>}`` or
    ``{"method": m, "error": {"code", "message", "data"?}}``. A ``write_file`` with ``direct=true`` asks
    the client nothing: the agent writes the file itself, as an agent with file tools of its own does (a
    remote one, whose client serves no ``fs/*``), and reports ``{"path": p, "written": <characters>}`` or
    ``{"path": p, "error": <reason>}``.

    Subagents (ACP's unstable draft): ``subagent`` {sessionId, title?, description?, cwd?, cancel=true,
    steps=[], stopReason="end_turn", usage?, error?} plays a child session of the session it runs in
    (a ``subagent`` step among its ``steps`` makes a grandchild). It announces the child with a
    ``subagent_update`` on that session (its title, description, cwd, ``capabilities`` with ``cancel``
    when granted, and ``state: running``), runs ``steps`` as the child (their updates, questions and file
    requests carry the child's session id), then reports one ``idle`` snapshot with ``stopReason``, the
    ``usage`` object and, for ``"error"``, the JSON-RPC ``error`` object. A ``stop`` step among them ends
    the child's run with its reason and usage (the prompt goes on), and ``wait_for_cancel`` waits for a
    cancel of the child. A ``session/cancel`` for the child, when ``cancel`` is granted, stops its steps
    and ends the run ``cancelled``; without it the cancel is ignored. A client that did not advertise
    ``clientCapabilities.subagents`` is sent nothing of the child (reported on stderr as ``stub agent:
    the client does not support subagents; skipping <sessionId>``). Other states (``requires_action``,
    ``unknown``, a patch of the title) are ``update`` steps with a raw ``subagent_update``.

    Time and answers: ``sleep`` {seconds}; ``wait_for_cancel`` {then="stop", timeout?} waits for
    ``session/cancel``, then answers ``cancelled`` (``"stop"``) or goes on (``"continue"``); after
    ``timeout`` seconds without a cancel it goes on. Every other step ignores cancellation. ``stop``
    {reason="end_turn", usage?, meta?} answers the prompt (``usage`` is the unstable
    ``PromptResponse.usage`` object, ``meta`` its ``_meta``, where some agents report usage);
    running out of steps answers ``end_turn``. ``error`` {code, message, data?} answers with a
    JSON-RPC error. ``hang`` never answers.

    Misbehaviour: ``raw`` {text | base64} writes exactly those bytes to stdout (a garbage line, half a line,
    invalid UTF-8, a response with a wrong or duplicate id: the client's request ids are predictable,
    ours count from 0); ``huge_line`` {bytes, json=true} writes one line of exactly ``bytes`` bytes plus
    its newline: an ``agent_message_chunk`` padded to that size, or garbage; ``close_stdout`` closes
    stdout and hangs (the process lives on until stdin closes, per ``onStdinEof``); ``stderr``
    {text | bytes} writes text, or a flood of ``bytes`` bytes, to stderr; ``exit`` {code=1, stderr?}
    exits at once; ``kill`` {signal="SIGKILL"} sends the process a signal (its default action restored,
    except SIGTERM under ``ignoreSigterm``); ``grandchild`` {pidFile, ignoreSigterm=true} starts a process
    in the agent's process group, writes its pid to ``pidFile`` once it is ready, and reports
    ``{"grandchild": pid}``. Output steps are written in order with everything sent before them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from signal import Signals
from typing import Any, ClassVar, Final, Literal, TypeAlias

import msgspec

__all__ = [
    "CANCELLED_BRANCH",
    "DEFAULT_SCENARIO_PATH",
    "ELICITATION_ACTIONS",
    "STEP_KINDS",
    "AuthenticateConfig",
    "CallStep",
    "CloseSessionConfig",
    "CloseStdoutStep",
    "EchoStep",
    "ElicitStep",
    "ErrorStep",
    "ExitStep",
    "FloodStep",
    "GrandchildStep",
    "HangStep",
    "HugeLineStep",
    "InitializeConfig",
    "KillStep",
    "LoadSessionConfig",
    "MessageStep",
    "NewSessionConfig",
    "NotifyStep",
    "PermissionStep",
    "PlanEntry",
    "PlanStep",
    "RawStep",
    "ReadFileStep",
    "ResumeSessionConfig",
    "Scenario",
    "ScenarioError",
    "SleepStep",
    "StderrStep",
    "Step",
    "StopStep",
    "SubagentStep",
    "ThoughtStep",
    "ToolCallStep",
    "ToolCallUpdateStep",
    "UpdateStep",
    "UsageStep",
    "WaitForCancelStep",
    "WriteFileStep",
    "dump_scenario",
    "load_scenario",
    "parse_scenario",
]

DEFAULT_SCENARIO_PATH: Final = Path(__file__).resolve().parent / "scenarios" / "default.json"
"""The scenario the stub agent runs without ``--scenario``: one friendly, complete turn."""

StopReason: TypeAlias = Literal["end_turn", "max_tokens", "max_turn_requests", "refusal", "cancelled"]
"""A stop reason a ``stop`` step can answer a prompt with (ACP's)."""

_TURN: Final = "turn"
"""Where a step may run: a prompt turn (``session/prompt``)."""
_SESSION: Final = "session"
"""Where a step may run: a session request (``session/new``, ``session/load``, ``session/resume``)."""
_HANDSHAKE: Final = "handshake"
"""Where a step may run: a request with no session at all (``initialize``, ``authenticate``)."""
_ANYWHERE: Final = frozenset({_TURN, _SESSION, _HANDSHAKE})
"""The ``where`` of a step that runs in any request."""
_WITH_SESSION: Final = frozenset({_TURN, _SESSION})
"""The ``where`` of a step that needs a session."""
_TURN_ONLY: Final = frozenset({_TURN})
"""The ``where`` of a step that belongs to a prompt turn (it answers it, or waits on it)."""


class ScenarioError(ValueError):
    """A scenario that cannot be read: bad JSON, an unknown field or step, a value of the wrong type."""


class _Object(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, rename="camel"):
    """Base of every scenario object: strict, camelCase, keyword-only."""


class _Step(_Object, tag_field="step", omit_defaults=True):
    """Base of the steps; `where` says in which requests a step may run."""

    where: ClassVar[frozenset[str]] = _ANYWHERE


# -- session updates -------------------------------------------------------------------------------------


class MessageStep(_Step, tag="message"):
    """``text`` as ``chunks`` consecutive ``agent_message_chunk`` updates."""

    where: ClassVar[frozenset[str]] = _WITH_SESSION
    text: str
    chunks: int = 1
    message_id: str | None = None

    def __post_init__(self) -> None:
        _check_at_least("chunks", self.chunks, 1)


class ThoughtStep(_Step, tag="thought"):
    """``text`` as ``chunks`` consecutive ``agent_thought_chunk`` updates."""

    where: ClassVar[frozenset[str]] = _WITH_SESSION
    text: str
    chunks: int = 1

    def __post_init__(self) -> None:
        _check_at_least("chunks", self.chunks, 1)


class ToolCallStep(_Step, tag="tool_call"):
    """A ``tool_call`` update; fields left out are left out on the wire."""

    where: ClassVar[frozenset[str]] = _WITH_SESSION
    tool_call_id: str
    title: str
    kind: str | None = None
    status: str | None = None
    content: list[Any] | None = None
    locations: list[Any] | None = None
    raw_input: Any = msgspec.UNSET
    raw_output: Any = msgspec.UNSET


class ToolCallUpdateStep(_Step, tag="tool_call_update"):
    """A ``tool_call_update``: only the fields given are sent (``content``/``locations`` replace)."""

    where: ClassVar[frozenset[str]] = _WITH_SESSION
    tool_call_id: str
    title: str | None = None
    kind: str | None = None
    status: str | None = None
    content: list[Any] | None = None
    locations: list[Any] | None = None
    raw_input: Any = msgspec.UNSET
    raw_output: Any = msgspec.UNSET


class PlanEntry(_Object, omit_defaults=True):
    """One entry of a ``plan`` step."""

    content: str
    priority: Literal["high", "medium", "low"] = "medium"
    status: Literal["pending", "in_progress", "completed"] = "pending"


class PlanStep(_Step, tag="plan"):
    """A ``plan`` update (the full list of entries)."""

    where: ClassVar[frozenset[str]] = _WITH_SESSION
    entries: list[PlanEntry]


class UsageStep(_Step, tag="usage"):
    """A ``usage_update``: tokens ``used`` of a context window of ``size``, and an optional ``cost``."""

    where: ClassVar[frozenset[str]] = _WITH_SESSION
    used: int
    size: int
    cost: dict[str, Any] | None = None


class UpdateStep(_Step, tag="update"):
    """Any raw ``session/update`` payload, for this session or for ``sessionId``."""

    update: dict[str, Any]
    session_id: str | None = None


class EchoStep(_Step, tag="echo"):
    """The prompt's text back as one message chunk, after ``prefix``."""

    where: ClassVar[frozenset[str]] = _TURN_ONLY
    prefix: str = ""


class FloodStep(_Step, tag="flood"):
    """``count`` message chunks as fast as the pipe takes them; ``{i}`` in ``text`` is the chunk's index."""

    where: ClassVar[frozenset[str]] = _WITH_SESSION
    count: int
    text: str = "{i}"

    def __post_init__(self) -> None:
        _check_at_least("count", self.count, 0)


# -- asking the client -----------------------------------------------------------------------------------

_DEFAULT_OPTIONS: Final = (
    {"optionId": "allow", "name": "Allow", "kind": "allow_once"},
    {"optionId": "reject", "name": "Reject", "kind": "reject_once"},
)
"""The options of a ``permission`` step that gives none."""

CANCELLED_BRANCH: Final = "cancelled"
"""The branch a ``permission`` step runs when the client answers the request ``cancelled``."""


class PermissionStep(_Step, tag="permission"):
    """Ask ``session/request_permission``, then run the branch named by the outcome."""

    where: ClassVar[frozenset[str]] = _WITH_SESSION
    tool_call: dict[str, Any] | None = None
    options: list[dict[str, Any]] = msgspec.field(default_factory=lambda: [dict(o) for o in _DEFAULT_OPTIONS])
    branches: dict[str, list[Step]] = msgspec.field(default_factory=dict)
    report: bool = False
    skip_in_modes: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        ids = [option.get("optionId") for option in self.options]
        unknown = sorted(set(self.branches) - {*ids, CANCELLED_BRANCH})
        if unknown:
            raise ValueError(
                f"branches {unknown} name no option (option ids: {ids}, or {CANCELLED_BRANCH!r})"
            )


ELICITATION_ACTIONS: Final = ("accept", "decline", "cancel")
"""The branches an ``elicit`` step may name: the client's answer's ``action``."""


class ElicitStep(_Step, tag="elicit"):
    """Ask ``elicitation/create`` (form mode) for this session, report the answer, then run the branch named
    by its action."""

    where: ClassVar[frozenset[str]] = _WITH_SESSION
    message: str
    requested_schema: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    branches: dict[str, list[Step]] = msgspec.field(default_factory=dict)
    report: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(set(self.branches) - set(ELICITATION_ACTIONS))
        if unknown:
            raise ValueError(f"branches {unknown} name no action (actions: {list(ELICITATION_ACTIONS)})")


class ReadFileStep(_Step, tag="read_file"):
    """``fs/read_text_file``, reported as a message chunk."""

    where: ClassVar[frozenset[str]] = _WITH_SESSION
    path: str
    line: int | None = None
    limit: int | None = None
    report: bool = True


class WriteFileStep(_Step, tag="write_file"):
    """``fs/write_text_file``, reported as a message chunk; with ``direct``, written to disk by the agent
    itself."""

    where: ClassVar[frozenset[str]] = _WITH_SESSION
    path: str
    content: str
    report: bool = True
    direct: bool = False


class CallStep(_Step, tag="call"):
    """Any request to the client (an unknown method, too), reported as a message chunk."""

    method: str
    params: Any = msgspec.UNSET
    report: bool = True


class NotifyStep(_Step, tag="notify"):
    """Any notification to the client."""

    method: str
    params: Any = msgspec.UNSET


class SubagentStep(_Step, tag="subagent"):
    """A child session (ACP's subagents draft): announced, its ``steps`` run as it, then ``idle``."""

    where: ClassVar[frozenset[str]] = _WITH_SESSION
    session_id: str
    title: str | None = None
    description: str | None = None
    cwd: str | None = None
    cancel: bool = True
    steps: list[Step] = msgspec.field(default_factory=list)
    stop_reason: str = "end_turn"
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


# -- time and answers ------------------------------------------------------------------------------------


class SleepStep(_Step, tag="sleep"):
    """Wait ``seconds`` (cancellation does not cut it short)."""

    seconds: float

    def __post_init__(self) -> None:
        _check_at_least("seconds", self.seconds, 0)


class WaitForCancelStep(_Step, tag="wait_for_cancel"):
    """Wait for ``session/cancel``; then answer ``cancelled`` (``stop``) or go on (``continue``)."""

    where: ClassVar[frozenset[str]] = _TURN_ONLY
    then: Literal["stop", "continue"] = "stop"
    timeout: float | None = None


class StopStep(_Step, tag="stop"):
    """Answer the prompt with ``reason`` (and the unstable ``usage`` object and a ``_meta``, if given)."""

    where: ClassVar[frozenset[str]] = _TURN_ONLY
    reason: StopReason = "end_turn"
    usage: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None


class ErrorStep(_Step, tag="error"):
    """Answer the request with a JSON-RPC error object."""

    code: int
    message: str
    data: Any = msgspec.UNSET


class HangStep(_Step, tag="hang"):
    """Never answer (and ignore cancellation)."""


# -- misbehaviour ----------------------------------------------------------------------------------------


class RawStep(_Step, tag="raw"):
    """Write exactly these bytes to stdout: ``text`` as UTF-8, or ``base64`` for any bytes."""

    text: str | None = None
    base64: str | None = None

    def __post_init__(self) -> None:
        _check_exactly_one(self, "text", "base64")
        if self.base64 is not None:
            import binascii  # Rarely needed: imported here to keep the stub agent's startup lean.

            try:
                binascii.a2b_base64(self.base64, strict_mode=True)
            except binascii.Error as exc:
                raise ValueError(f"`base64` is not valid base64: {exc}") from None

    def data(self) -> bytes:
        """The bytes to write."""
        if self.text is not None:
            return self.text.encode()
        import binascii

        assert self.base64 is not None
        return binascii.a2b_base64(self.base64)


class HugeLineStep(_Step, tag="huge_line"):
    """One line of exactly ``bytes`` bytes (plus newline): a padded message chunk, or garbage."""

    bytes: int
    json: bool = True

    def __post_init__(self) -> None:
        _check_at_least("bytes", self.bytes, 1)


class CloseStdoutStep(_Step, tag="close_stdout"):
    """Close stdout after everything before it was written, then hang."""


class StderrStep(_Step, tag="stderr"):
    """Write ``text``, or ``bytes`` bytes of filler lines, to stderr."""

    text: str | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        _check_exactly_one(self, "text", "bytes")
        if self.bytes is not None:
            _check_at_least("bytes", self.bytes, 0)


class ExitStep(_Step, tag="exit"):
    """Exit at once with ``code``, after writing ``stderr`` (if given) and everything sent before."""

    code: int = 1
    stderr: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.code <= 255:
            raise ValueError("`code` must be an exit status from 0 to 255")


class KillStep(_Step, tag="kill"):
    """Send this process ``signal`` (a name like ``"SIGKILL"``/``"KILL"``, or a number)."""

    signal: str | int = "SIGKILL"

    def __post_init__(self) -> None:
        self.signum()

    def signum(self) -> Signals:
        """The signal to send."""
        try:
            if isinstance(self.signal, int):
                return Signals(self.signal)
            name = self.signal.upper()
            return Signals[name if name.startswith("SIG") else f"SIG{name}"]
        except (KeyError, ValueError):
            raise ValueError(f"unknown signal {self.signal!r}") from None


class GrandchildStep(_Step, tag="grandchild"):
    """Start a process in our process group (ignoring SIGTERM by default); its pid goes to ``pidFile``."""

    pid_file: str
    ignore_sigterm: bool = True
    report: bool = True


Step: TypeAlias = (
    MessageStep
    | ThoughtStep
    | ToolCallStep
    | ToolCallUpdateStep
    | PlanStep
    | UsageStep
    | UpdateStep
    | EchoStep
    | FloodStep
    | PermissionStep
    | ElicitStep
    | ReadFileStep
    | WriteFileStep
    | CallStep
    | NotifyStep
    | SleepStep
    | WaitForCancelStep
    | StopStep
    | ErrorStep
    | HangStep
    | RawStep
    | HugeLineStep
    | CloseStdoutStep
    | StderrStep
    | ExitStep
    | KillStep
    | GrandchildStep
    | SubagentStep
)
"""One step of a scenario, told apart by its ``"step"`` member."""

STEP_KINDS: Final = tuple(str(cls.__struct_config__.tag) for cls in Step.__args__)
"""Every ``"step"`` value, in the order of the `Step` union."""


def _check_at_least(name: str, value: float, least: int) -> None:
    """Refuse a field ``name`` whose ``value`` is below ``least``."""
    if value < least:
        raise ValueError(
            f"`{name}` must not be negative" if least == 0 else f"`{name}` must be at least {least}"
        )


def _check_exactly_one(step: _Step, first: str, second: str) -> None:
    """Refuse a step that gives both, or neither, of two fields that stand for each other."""
    if (getattr(step, first) is None) == (getattr(step, second) is None):
        raise ValueError(f"give exactly one of `{first}` and `{second}`")


# -- the request configurations --------------------------------------------------------------------------


class InitializeConfig(_Object, omit_defaults=True):
    """How ``initialize`` is answered."""

    steps: list[Step] = msgspec.field(default_factory=list)
    protocol_version: int | None = None
    agent_capabilities: dict[str, Any] = msgspec.field(default_factory=dict)
    auth_methods: list[dict[str, Any]] = msgspec.field(default_factory=list)
    agent_info: dict[str, Any] | None = None


class AuthenticateConfig(_Object, omit_defaults=True):
    """Steps run before ``authenticate`` is answered."""

    steps: list[Step] = msgspec.field(default_factory=list)


class NewSessionConfig(_Object, omit_defaults=True):
    """How ``session/new`` is answered."""

    steps: list[Step] = msgspec.field(default_factory=list)
    session_id: str = "session-1"
    modes: dict[str, Any] | None = None
    config_options: list[dict[str, Any]] | None = None


class LoadSessionConfig(_Object, omit_defaults=True):
    """How ``session/load`` is answered: the updates it replays first, and the session's modes and config
    options (as ``session/new`` answers them)."""

    steps: list[Step] = msgspec.field(default_factory=list)
    replay: list[dict[str, Any]] = msgspec.field(default_factory=list)
    modes: dict[str, Any] | None = None
    config_options: list[dict[str, Any]] | None = None


class ResumeSessionConfig(_Object, omit_defaults=True):
    """How ``session/resume`` is answered, with the session's modes and config options."""

    steps: list[Step] = msgspec.field(default_factory=list)
    modes: dict[str, Any] | None = None
    config_options: list[dict[str, Any]] | None = None


class CloseSessionConfig(_Object, omit_defaults=True):
    """How ``session/close`` is answered (its presence advertises ``sessionCapabilities.close``)."""

    steps: list[Step] = msgspec.field(default_factory=list)


class Scenario(_Object, omit_defaults=True):
    """A whole stub-agent scenario (see the module docstring for the format)."""

    initialize: InitializeConfig = msgspec.field(default_factory=InitializeConfig)
    require_auth: str | None = None
    authenticate: AuthenticateConfig = msgspec.field(default_factory=AuthenticateConfig)
    new_session: NewSessionConfig = msgspec.field(default_factory=NewSessionConfig)
    load_session: LoadSessionConfig | None = None
    resume_session: ResumeSessionConfig | None = None
    close_session: CloseSessionConfig | None = None
    turns: list[list[Step]] = msgspec.field(default_factory=list)
    after_last_turn: Literal["repeat", "error"] = "repeat"
    on_stdin_eof: Literal["exit", "ignore"] = "exit"
    ignore_sigterm: bool = False
    description: str | None = None
    """Free text for the reader of the file; ignored by the agent."""

    def __post_init__(self) -> None:
        for path, step, context in self._placed_steps():
            if context not in step.where:
                raise ValueError(f"{_describe(step)} cannot run in {_CONTEXT_NAMES[context]} - at `{path}`")
        if self.require_auth is not None and self.initialize.auth_methods:
            advertised = [method.get("id") for method in self.initialize.auth_methods]
            if self.require_auth not in advertised:
                raise ValueError(
                    f"requireAuth {self.require_auth!r} is not among the advertised auth methods {advertised}"
                    " - at `$.requireAuth`"
                )

    def _placed_steps(self) -> Iterator[tuple[str, Step, str]]:
        yield from _walk("$.initialize.steps", self.initialize.steps, _HANDSHAKE)
        yield from _walk("$.authenticate.steps", self.authenticate.steps, _HANDSHAKE)
        yield from _walk("$.newSession.steps", self.new_session.steps, _SESSION)
        if self.load_session is not None:
            yield from _walk("$.loadSession.steps", self.load_session.steps, _SESSION)
        if self.resume_session is not None:
            yield from _walk("$.resumeSession.steps", self.resume_session.steps, _SESSION)
        if self.close_session is not None:
            yield from _walk("$.closeSession.steps", self.close_session.steps, _SESSION)
        for index, turn in enumerate(self.turns):
            yield from _walk(f"$.turns[{index}]", turn, _TURN)


_CONTEXT_NAMES: Final = {
    _TURN: "a prompt turn",
    _SESSION: "a session request",
    _HANDSHAKE: "initialize or authenticate (there is no session yet)",
}
"""How an error message names each place a step may run."""


def _describe(step: Step) -> str:
    return f"step {step.__struct_config__.tag!r}"


def _walk(path: str, steps: Sequence[Step], context: str) -> Iterator[tuple[str, Step, str]]:
    for index, step in enumerate(steps):
        step_path = f"{path}[{index}]"
        if isinstance(step, UpdateStep) and step.session_id is None and context == _HANDSHAKE:
            raise ValueError(f"an `update` step needs a `sessionId` here - at `{step_path}`")
        yield step_path, step, context
        if isinstance(step, PermissionStep | ElicitStep):
            for name, branch in step.branches.items():
                yield from _walk(f"{step_path}.branches.{name}", branch, context)
        elif isinstance(step, SubagentStep):
            yield from _walk(f"{step_path}.steps", step.steps, context)


# -- reading and writing ---------------------------------------------------------------------------------

_DECODER: Final = msgspec.json.Decoder(Scenario)
"""Reads a scenario from JSON, strictly (built once: it is not free)."""

_BAD_TAG: Final = re.compile(r"Invalid value '[^']*' - at `[^`]*\.step`$")
"""msgspec's message for an unknown step kind, which the error then completes with the known kinds."""


def _error(source: str, exc: msgspec.ValidationError) -> ScenarioError:
    message = str(exc)
    if _BAD_TAG.search(message):
        message += f" (known steps: {', '.join(STEP_KINDS)})"
    return ScenarioError(f"{source}: {message}")


def parse_scenario(data: bytes | str | Mapping[str, Any] | Scenario, *, source: str = "scenario") -> Scenario:
    """Read a scenario from JSON text or bytes, from the equivalent dict, or pass a `Scenario` through.

    Raises:
        ScenarioError: the JSON is malformed or does not describe a valid scenario; the message starts with
            ``source`` and names the JSON path of the offending value.
    """
    if isinstance(data, Scenario):
        return data
    try:
        if isinstance(data, Mapping):
            return msgspec.convert(data, Scenario)
        return _DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise _error(source, exc) from None
    except msgspec.DecodeError as exc:
        raise ScenarioError(f"{source}: not valid JSON: {exc}") from None


def load_scenario(path: str | os.PathLike[str]) -> Scenario:
    """Read a scenario file.

    Raises:
        ScenarioError: the file is missing, unreadable, or not a valid scenario (the message names the file).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ScenarioError(f"{os.fspath(path)}: cannot read the scenario: {exc.strerror}") from None
    return parse_scenario(data, source=os.fspath(path))


def dump_scenario(scenario: Scenario | Mapping[str, Any], *, indent: int = 2) -> str:
    """The scenario as JSON text (a dict is validated first), ready to be written to a file."""
    checked = parse_scenario(scenario)
    return msgspec.json.format(msgspec.json.encode(checked), indent=indent).decode() + "\n"
