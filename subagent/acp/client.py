"""The typed ACP client: a session with an agent, over a JSON-RPC connection or a child process.

Layers: :class:`AcpClient` speaks ACP over any pair of anyio byte streams (so it is tested in
memory); :func:`spawn_agent` runs an agent command as a child process we own (or, through another
:mod:`subagent.acp.transports`, on another host) and connects a client to its stdin/stdout.
Neither knows about the seam; the ACP provider builds on them.

What the client guarantees:

* Every update of a turn reaches the caller, in order, before :meth:`AcpSession.prompt`
  returns: the connection releases a response only after the notifications that preceded it.
* What a turn keeps is bounded however long it streams: its last ``max_kept_updates`` updates
  (older ones are dropped and counted), and its final message, built as it streams in linear time
  and exact up to ``max_output_chars`` characters (past that it is cut there and marked
  ``output_truncated``; see :class:`TurnOutput`).
* A dead agent fails every waiting call at once with :class:`AgentExitedError`, whose message has
  the exit status and the tail of the agent's stderr, even when a grandchild keeps the agent's
  stdout open.
* A permission question is answered by the configured policy from a frozen snapshot, and
  answered ``cancelled`` the moment the turn is cancelled; nothing ever waits on a human who
  is not there.
* An elicitation (``elicitation/create``, form mode) is answered by the permission policy's ``elicit``
  (see :mod:`subagent.acp`), checked against the requested schema before it goes out;
  a policy without it declines, and a cancelled turn's questions are answered ``cancel``.
* The agent's file-system requests are served only inside the sandbox roots (see
  :class:`~subagent.acp.handlers.FsSandbox`); terminals only when enabled; any other method is
  answered -32601.
* With ``subagents=True`` the client advertises ACP's (unstable) subagents capability and keeps each
  child session the agent announces with ``subagent_update`` (:class:`SubagentSession`, reachable as
  :attr:`AcpSession.subagent`): its traffic is served like a session of ours (the same permission
  policy, naming the child in the question; the same sandbox), its updates are kept bounded, and
  :meth:`AcpSession.cancel` cancels it alone where the agent permits. A session id nobody announced
  gets nothing served.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import logging
import os
import re
import shlex
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Literal, Self, TypedDict, Unpack

import anyio
import anyio.abc
import msgspec

from subagent._version import __version__
from subagent.acp import schema
from subagent.acp import schema_unstable as unstable
from subagent.acp._elicitation import (
    ElicitationAnswer,
    ElicitationQuestion,
    check_content,
    question_from_request,
)
from subagent.acp._errors import (
    AgentCapabilityError,
    AgentExitedError,
    AuthenticationRequiredError,
    ConnectionClosedError,
    ProtocolError,
    ProtocolVersionError,
    RequestError,
    SessionSettingError,
)
from subagent.acp._file_router import serve_file_request
from subagent.acp._frozen import freeze_json
from subagent.acp._modes import ModeChoice, current_mode, offered_modes, select_values
from subagent.acp._subagents import MAX_SUBAGENT_SESSIONS, SubagentSession
from subagent.acp._turn_usage import TurnUsage
from subagent.acp.connection import DEFAULT_MAX_LINE_BYTES, Connection
from subagent.acp.handlers import (
    FsSandbox,
    PermissionCallback,
    PermissionOption,
    PermissionOutcome,
    PermissionPolicy,
    PermissionQuestion,
    _clip,
    permission_policy,
    policy_name,
)
from subagent.acp.transports._channel import Channel, Transport, check_command
from subagent.acp.transports._local import LocalTransport

if TYPE_CHECKING:
    from subagent.acp.terminals import TerminalHost

__all__ = [
    "CLIENT_NAME",
    "DEFAULT_IDLE_CLOSE_GRACE",
    "DEFAULT_MAX_KEPT_UPDATES",
    "DEFAULT_MAX_OUTPUT_CHARS",
    "MAX_EARLY_UPDATES",
    "MAX_EARLY_UPDATE_BYTES",
    "MAX_ERROR_QUOTE_CHARS",
    "MAX_SUBAGENT_SESSIONS",
    "AcpClient",
    "AcpSession",
    "ClientOptions",
    "SubagentListener",
    "SubagentSession",
    "TurnMessage",
    "TurnOutput",
    "TurnResult",
    "UpdateCallback",
    "describe_request_error",
    "final_message",
    "spawn_agent",
]

logger = logging.getLogger(__name__)

CLIENT_NAME = "subagent-seam"
"""The name this client gives in ``initialize`` (``clientInfo.name``) unless told another."""

EXIT_DIAGNOSIS_TIMEOUT: float = 2.0
"""How long a failed call waits for the agent's exit status once its stdout closed: long enough
for a dying process to be reaped, short enough that a child that closed stdout but lives on is
reported quickly."""

STDOUT_DRAIN_GRACE: float = 1.0
"""After the agent exits, how long we keep reading what it wrote before it died (its final
response may still be in the pipe) before giving up on a stdout held open by a grandchild."""

CANCEL_NOTIFY_TIMEOUT: float = 1.0
"""Bound on sending ``session/cancel`` when the caller of a prompt is cancelled."""

DEFAULT_MAX_KEPT_UPDATES: int = 10_000
"""How many of a turn's most recent session updates are kept readable (older ones are dropped and
counted). A streamed answer is one update per few tokens, so this holds the whole of any ordinary
turn, at about 0.4 KiB per message chunk (~4 MiB), while a flood of millions costs no more."""

DEFAULT_MAX_OUTPUT_CHARS: int = 16 * 1024 * 1024
"""How long a turn's final message may grow, in characters (16 Mi). A model's whole answer is at
most a few hundred KiB; this is room for far more, and a bound on what an agent streaming
endlessly can make us hold (at most 4 bytes a character, 64 MiB)."""

MAX_ERROR_QUOTE_CHARS: int = 2000
"""How much of an agent's error (its message and ``data``) an error message of ours quotes: the
reason an agent gives fits in far less, and a hostile agent's megabytes of ``data`` must not become
our error message."""

DEFAULT_IDLE_CLOSE_GRACE: float = 0.3
"""How long an idle agent (its turn over, nothing in flight) gets to exit after its stdin closes
before it is sent SIGTERM (still a graceful signal). Real agents that exit on EOF do so within tens
of milliseconds; both Codex adapters ignore EOF, and would otherwise cost every run the full
``stdin_close_timeout``. With this, a run against one is gone within about 0.35 s of its turn's end
(see bench/teardown.py)."""

MAX_EARLY_UPDATES: int = 256
"""How many session updates for a session not known yet are kept while a ``session/new`` (or load,
or resume) of ours is in flight. Agents announce a new session's commands, mode or usage before
answering ``session/new`` (GitHub Copilot CLI, mistral-vibe): a handful of updates, not hundreds."""

MAX_EARLY_UPDATE_BYTES: int = 4 * 1024 * 1024
"""How many bytes (as JSON) those early updates may take together: a long ``available_commands_update``
is tens of KiB, and an agent must not make us hold megabytes for a session that may never exist.
Past either bound the oldest are dropped, with one warning, and counted in
:attr:`AcpClient.early_updates_dropped`."""

UpdateCallback = Callable[[schema.SessionUpdate], object]
"""Receives each session update in order; may be sync or async (an awaitable result is awaited)."""

SubagentListener = Callable[[SubagentSession, bool], object]
"""Called (synchronously) after each ``subagent_update`` the client applied, with the child and
whether the snapshot ended one of its runs; a new child's first call is its announcement."""


def describe_request_error(
    error: RequestError, *, secrets: Iterable[str] = (), limit: int = MAX_ERROR_QUOTE_CHARS
) -> str:
    """An agent's JSON-RPC error as one line: ``error <code>: <message> (<data as JSON>)``.

    ``data`` is where agents put the reason (claude-agent-acp answers ``Internal error`` with
    ``{"details": "Claude Code process exited with code 1"}``), so it is shown. Every value in
    ``secrets`` (say, the child's environment values) found in the agent's text is replaced by
    ``[redacted]`` before the text is cut to ``limit`` characters, so no secret is cut in two.
    """
    text = f"{error.message}"
    if error.data is not None:
        try:
            data = json.dumps(error.data, ensure_ascii=False)
        except (TypeError, ValueError):  # decoded from JSON, so always encodable; but never fail here
            data = repr(error.data)
        text += f" ({data})"
    for secret in secrets:
        if secret:
            text = text.replace(secret, "[redacted]")
    if len(text) > limit:
        text = f"{text[:limit]}… ({len(text) - limit:,} more characters)"
    return f"error {error.code}: {text}"


# -- turns ----------------------------------------------------------------------------------------------


def final_message(updates: Iterable[schema.SessionUpdate]) -> str:
    """The turn's final message: the text of its last agent message.

    A message ends at a tool call (text before one is narration: "let me read the file") and
    where the agent starts another (a chunk with a different ``messageId``: Codex sends a warning,
    then the answer). Chunks without a ``messageId`` belong to the message being built. (For a
    turn as it streams, :class:`TurnOutput` builds the same text incrementally.)
    """
    output = TurnOutput(None, max_messages=0)
    for update in updates:
        output.add(update)
    return output.text


_PARTS_PER_BLOCK: Final = 4096
"""How many text chunks of a message are kept apart before they are joined into one block: joining in
blocks keeps building the message linear in its length, and the list of parts short."""

_MESSAGE_CHUNK: Final = schema.AgentMessageChunk
_TEXT: Final = schema.TextContent
_TOOL_CALL: Final = schema.ToolCall
_TOOL_CALL_UPDATE: Final = schema.ToolCallProgress
_USAGE_UPDATE: Final = schema.UsageUpdate
_UNKNOWN_UPDATE: Final = schema.UnknownSessionUpdate
_MODE_UPDATE: Final = schema.CurrentModeUpdate
_CONFIG_UPDATE: Final = schema.ConfigOptionUpdate


@dataclass(frozen=True, slots=True)
class TurnMessage:
    """One agent message of a turn: its ``messageId`` as the agent sent it (None when it sent
    none) and its text, cut at the output limit if it went past it (then ``truncated``)."""

    message_id: str | None
    text: str
    truncated: bool = False


_SESSION_CAPABILITIES: Final = schema.ClientSessionCapabilities(
    notices=schema.NoticeCapabilities(),
    compaction=schema.CompactionCapabilities(),
    config_options=schema.SessionConfigOptionsCapabilities(boolean=schema.BooleanConfigOptionCapabilities()),
)
"""The session capabilities `initialize` advertises: notices and compaction updates are understood
(an agent without them would otherwise send a compaction summary as an agent message), and so are
boolean config options (:meth:`AcpSession.configure` sets them)."""

_RUN_META_KEY: Final = "subagent-seam/run"
"""``subagent.types.RUN_META_KEY`` (spelled here: ``subagent.acp`` imports nothing of the seam): the
``_meta`` key of a tool call that reports a run below the agent rather than a call of its own."""


class TurnOutput:
    """A turn's messages as they stream, the last of them being its final message (what
    :func:`final_message` gives for the whole turn), built in linear time.

    A message ends at a tool call, or when a chunk carries a ``messageId`` other than the one of
    the message being built; chunks without one extend the current message. The current message
    is :attr:`text`; the ones before it stay readable in :attr:`messages`, the most recent of
    them: at most ``max_messages`` (None: no limit) holding at most ``limit`` characters together
    (older ones are dropped and counted in :attr:`messages_dropped`).

    Each message is exact up to ``limit`` characters (None: no limit). Text past the limit is not
    kept: the message is cut at exactly ``limit`` characters and :attr:`truncated` becomes true
    (and stays true for the turn, even when a later message starts afresh), so a caller can tell
    an answer that was cut from a whole one, and stop an agent that streams without end.
    """

    __slots__ = (
        "_blocks",
        "_cut",
        "_earlier",
        "_earlier_chars",
        "_parts",
        "_room",
        "length",
        "limit",
        "max_messages",
        "message_id",
        "messages_dropped",
        "truncated",
    )

    def __init__(
        self,
        limit: int | None = DEFAULT_MAX_OUTPUT_CHARS,
        *,
        max_messages: int | None = DEFAULT_MAX_KEPT_UPDATES,
    ) -> None:
        _check_bound("the output limit", limit)
        _check_bound("max_messages", max_messages)
        self.limit = limit
        self.max_messages = max_messages
        self.length = 0
        """Characters of the current message kept now."""
        self.truncated = False
        self.message_id: str | None = None
        """The ``messageId`` of the current message (None until a chunk of it carries one)."""
        self.messages_dropped = 0
        """Earlier messages of the turn let go, oldest first, to stay within the bounds."""
        self._room = sys.maxsize if limit is None else limit
        self._cut = False  # the current message went past the limit
        # Chunks are appended as they come (the cheapest step per update) and joined a block at a
        # time, so the text costs linear time, and memory close to its size rather than an object
        # per chunk.
        self._parts: list[str] = []
        self._blocks: list[str] = []
        self._earlier: deque[TurnMessage] = deque()
        self._earlier_chars = 0

    def __repr__(self) -> str:
        cut = ", truncated" if self.truncated else ""
        earlier = f", {len(self._earlier)} earlier messages" if self._earlier else ""
        return f"<TurnOutput {self.length} chars{earlier}{cut}>"

    def add(self, update: schema.SessionUpdate) -> None:
        """Take the turn's next update."""
        kind = type(update)
        if kind is _MESSAGE_CHUNK:
            message_id = update.message_id  # type: ignore[union-attr]
            if message_id is not None and message_id != self.message_id:
                self.start_message(message_id)
            content = update.content  # type: ignore[union-attr]
            if type(content) is _TEXT:
                self.add_text(content.text)
        elif kind is _TOOL_CALL or kind is _TOOL_CALL_UPDATE:
            meta = update.meta  # type: ignore[union-attr]
            # A run below the agent, reported as a call of its own (``subagent serve``'s tree of runs),
            # is not a step of the agent's message: its heartbeats must not cut the message in two.
            if meta is None or _RUN_META_KEY not in meta:
                self.end_message()

    def add_text(self, text: str) -> None:
        """Append text to the current message (cut at the limit)."""
        length = self.length + len(text)
        if length > self._room:
            text = text[: self._room - self.length]
            length = self._room
            self.truncated = self._cut = True
        self.length = length
        parts = self._parts
        parts.append(text)
        if len(parts) >= _PARTS_PER_BLOCK:
            self._blocks.append("".join(parts))
            parts.clear()

    def start_message(self, message_id: str) -> None:
        """A chunk of message ``message_id`` arrived: a message with another id ends here (one
        with none so far takes this id)."""
        if self.message_id is not None and self.message_id != message_id:
            self.end_message()
        self.message_id = message_id

    def end_message(self) -> None:
        """The current message is over (a tool call, or another message began): it becomes one
        of the earlier messages, and the next text starts a new one."""
        if self.length or self._cut:
            self._keep(TurnMessage(self.message_id, self.text, self._cut))
            self._parts.clear()
            self._blocks.clear()
            self.length = 0
        self.message_id = None
        self._cut = False

    clear = end_message
    """The former name of :meth:`end_message` (a tool call ends the message)."""

    def _keep(self, message: TurnMessage) -> None:
        earlier = self._earlier
        earlier.append(message)
        self._earlier_chars += len(message.text)
        count_limit = sys.maxsize if self.max_messages is None else self.max_messages
        while earlier and (len(earlier) > count_limit or self._earlier_chars > self._room):
            self._earlier_chars -= len(earlier.popleft().text)
            self.messages_dropped += 1

    @property
    def text(self) -> str:
        """The current message so far: the final message, once the turn is over."""
        if self._blocks:
            self._blocks.append("".join(self._parts))
            self._parts.clear()
            joined = "".join(self._blocks)
            self._blocks = [joined]  # asked again, it costs no second join
            return joined
        return "".join(self._parts)

    @property
    def messages(self) -> list[TurnMessage]:
        """The turn's messages in order, the current one last (when it has text): the most recent
        of the earlier ones, within the bounds (see :attr:`messages_dropped`)."""
        messages = list(self._earlier)
        if self.length or self._cut:
            messages.append(TurnMessage(self.message_id, self.text, self._cut))
        return messages


@dataclass(slots=True)
class TurnResult:
    """How one ``session/prompt`` ended.

    ``updates`` holds the turn's updates in order, the most recent ``max_kept_updates`` of them
    (see :class:`AcpClient`); ``update_count`` counts all of them, so ``update_count -
    len(updates)`` were dropped, oldest first. ``output`` is the final message (see
    :func:`final_message`), exact however many updates the turn had, up to the output limit;
    ``output_truncated`` says the message went past that limit and was cut at it. ``messages``
    are the turn's agent messages in order, the final one last (see :class:`TurnOutput` for what
    starts a message and how many are kept; ``messages_dropped`` counts those let go).

    ``usage`` is the turn's token usage in ACP's names (``inputTokens``, ``outputTokens``...),
    read from wherever the agent put it (the prompt response's ``usage`` or ``_meta``, its message
    chunks' ``_meta``), plus ``contextUsed``, ``contextSize`` and ``cost`` from its last
    ``usage_update``; None when it reported none.

    ``permissions_denied`` counts the permission questions of the turn the policy answered with a
    reject option or withdrew (not counting those answered ``cancelled`` because the turn was
    being cancelled); ``last_denied`` is the title of the last of them (its tool call id when it
    has none). An agent that offers only an aborting reject (Codex) ends its turn ``cancelled``
    after one: this says why.
    """

    stop_reason: schema.StopReason
    updates: list[schema.SessionUpdate]
    usage: dict[str, Any] | None = None
    output: str = ""
    update_count: int = 0
    output_truncated: bool = False
    messages: list[TurnMessage] = field(default_factory=list)
    messages_dropped: int = 0
    permissions_denied: int = 0
    last_denied: str | None = None
    meta: dict[str, Any] | None = None
    """The prompt response's ``_meta``, as the agent sent it (``subagent serve`` says there which
    budget cap stopped the turn)."""


@dataclass(eq=False, slots=True)
class _Turn:
    on_update: UpdateCallback | None
    updates: deque[schema.SessionUpdate]
    output: TurnOutput
    usage: TurnUsage = field(default_factory=TurnUsage)
    count: int = 0
    cancel_requested: bool = False
    permissions_denied: int = 0
    last_denied: str | None = None
    allowed_paths: set[str] = field(default_factory=set)
    """Paths that a permission allowed in this turn names (bounded by ``MAX_ALLOWED_PATHS``): the
    agent's ``fs/write_text_file`` to one of them is covered by that answer."""


MAX_ALLOWED_PATHS: Final = 1024
"""The most paths one turn's allowed permissions may cover; past it a write is asked about again."""

_MAX_PATH_SCAN: Final = 256
"""How many values of a permission question's raw input are looked at for the paths it names."""

_PATH_KEYS: Final = re.compile(r"path|file", re.IGNORECASE)
"""Keys of a tool call's raw input whose relative string values are paths (``file_path``, ``path``)."""

WRITE_QUESTION_OPTIONS: Final = (
    PermissionOption("allow_once", "Allow this write", "allow_once"),
    PermissionOption("allow_always", "Allow every write in this session", "allow_always"),
    PermissionOption("reject_once", "Refuse this write", "reject_once"),
)
"""The options of the question the client asks itself about a write no permission covered."""


# -- sessions -------------------------------------------------------------------------------------------


class AcpSession:
    """One ACP session with the agent. Created by :meth:`AcpClient.new_session` and friends.

    ``last_activity`` (``time.monotonic()``) moves whenever the agent sends anything for this session;
    ``pending_permissions`` counts questions awaiting the policy. Together they let an owner run
    an inactivity timeout that does not count time spent waiting on a permission answer.
    """

    def __init__(self, client: AcpClient, session_id: str, cwd: str | None = None) -> None:
        self._client = client
        self.session_id = session_id
        self.cwd = cwd
        """The session's working directory, as sent (absolute)."""
        self.modes: schema.SessionModeState | None = None
        """The agent's modes and the current one, kept current from ``current_mode_update``."""
        self.config_options: list[schema.SessionConfigOption] | None = None
        """The agent's config options with their values, kept current from ``config_option_update``
        and from the answers to ``session/set_config_option``."""
        self._writes_allowed = False  # an allow_always answer covers every write of the session
        self.last_activity = time.monotonic()
        self.pending_permissions = 0
        self.replayed: deque[schema.SessionUpdate] = deque(maxlen=client.max_kept_updates)
        """Updates the agent sent while loading this session (its replayed history): the most
        recent ``max_kept_updates`` of them."""
        self.early_updates: list[schema.SessionUpdate] = []
        """Updates the agent sent for this session before answering the request that opened it
        (``session/new``: Copilot announces its commands that way, mistral-vibe its usage), in order, as
        many as :data:`MAX_EARLY_UPDATES` kept. They are also delivered to the session like later
        ones, right after the answer is adopted, before :meth:`AcpClient.new_session` returns."""
        self.subagent: SubagentSession | None = None
        """What the agent announced of this session when it is one of its subagent sessions (None
        for a session of ours)."""
        self._turn: _Turn | None = None
        self._permission_scopes: set[anyio.CancelScope] = set()
        self._listeners: list[UpdateCallback] = []
        self._loading = False
        self._closed = False

    def __repr__(self) -> str:
        state = "in a turn" if self._turn is not None else "idle"
        return f"<AcpSession {self.session_id!r} {state}>"

    @property
    def in_turn(self) -> bool:
        """Whether a prompt is running."""
        return self._turn is not None

    def on_update(self, callback: UpdateCallback) -> Callable[[], None]:
        """Receive every update of this session, inside turns or not; returns a disposer."""
        self._listeners.append(callback)

        def dispose() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return dispose

    async def prompt(
        self,
        prompt: str | Sequence[schema.ContentBlock],
        *,
        on_update: UpdateCallback | None = None,
        output: TurnOutput | None = None,
        updates: deque[schema.SessionUpdate] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> TurnResult:
        """Run one turn and return how it ended, with its updates (the most recent
        ``max_kept_updates``) and its final message.

        ``meta`` is sent as the request's ``_meta`` (a trace context, say: ``traceparent``).

        ``updates`` is where the turn's updates are kept as they arrive (default: a fresh deque of
        at most ``max_kept_updates``); a caller that keeps every turn's updates in one bounded
        deque passes it here, so each update is appended once. The result's ``updates`` are then
        the ones of this turn still in it.

        ``output`` receives the final message as it streams (default: a fresh
        :class:`TurnOutput` with the client's ``max_output_chars``); a caller passes its own to
        watch the message grow, or to read what there was of it when the turn fails. It is fed
        each update before ``on_update`` is called with it.

        Cancelling the caller sends ``session/cancel`` (best effort) before the cancellation
        propagates; to stop a turn and still get its result, call :meth:`cancel` instead.

        Raises:
            RuntimeError: a turn is already running in this session.
            AgentExitedError: the agent died during the turn.
            RequestError: the agent answered the prompt with a JSON-RPC error.
        """
        if self._turn is not None:
            raise RuntimeError(f"session {self.session_id!r} is already running a turn")
        blocks: list[schema.ContentBlock] = (
            [schema.TextContent(text=prompt)] if isinstance(prompt, str) else list(prompt)
        )
        turn = _Turn(
            on_update,
            updates if updates is not None else deque(maxlen=self._client.max_kept_updates),
            output
            if output is not None
            else TurnOutput(self._client.max_output_chars, max_messages=self._client.max_kept_updates),
        )
        self._turn = turn
        try:
            raw = await self._client._call(
                schema.SESSION_PROMPT,
                schema.PromptRequest(
                    session_id=self.session_id, prompt=blocks, meta=dict(meta) if meta is not None else None
                ),
                courtesy_cancel=False,  # ACP cancels a turn with session/cancel, not $/cancel_request
            )
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_NOTIFY_TIMEOUT):
                await self._send_cancel(turn)
            raise
        finally:
            self._turn = None
        response = schema.decode(raw, type=schema.PromptResponse)
        return TurnResult(
            stop_reason=response.stop_reason,
            # A caller's deque may hold earlier updates too: only this turn's, the last `count`.
            updates=list(itertools.islice(turn.updates, max(0, len(turn.updates) - turn.count), None)),
            usage=turn.usage.result(raw),
            output=turn.output.text,
            update_count=turn.count,
            output_truncated=turn.output.truncated,
            messages=turn.output.messages,
            messages_dropped=turn.output.messages_dropped,
            permissions_denied=turn.permissions_denied,
            last_denied=turn.last_denied,
            meta=response.meta,
        )

    async def cancel(self) -> None:
        """Ask the agent to stop the running turn; pending permission questions are answered
        ``cancelled``. The turn's :meth:`prompt` then returns (normally with ``cancelled``).

        For a subagent session, ask the agent to stop that child's current work alone (its parent
        and siblings go on), which the child's ``cancel`` capability must permit; the questions
        pending in it and below it are answered ``cancelled``. Its ``idle`` snapshot says when it stopped.

        Raises:
            AgentCapabilityError: a subagent session whose capabilities do not permit a cancel (nothing
                is sent).
        """
        child = self.subagent
        if child is not None:
            if not child.can_cancel:
                name = _clip_id(self.session_id)
                raise AgentCapabilityError(
                    f"the agent does not permit cancelling its subagent session {name!r} "
                    "(it grants no cancel capability)"
                )
            for session in self._client._subtree(self.session_id):
                for scope in tuple(session._permission_scopes):
                    scope.cancel()
            with contextlib.suppress(ConnectionClosedError):
                await self._client.connection.notify(
                    schema.SESSION_CANCEL, schema.CancelNotification(session_id=self.session_id)
                )
            return
        turn = self._turn
        if turn is None:
            return
        await self._send_cancel(turn)

    async def _send_cancel(self, turn: _Turn) -> None:
        turn.cancel_requested = True
        for scope in tuple(self._permission_scopes):
            scope.cancel()
        # A closed connection has nothing left to cancel. No exit diagnosis here: it would wait for
        # an exit that only the teardown after this (shielded) call can bring.
        with contextlib.suppress(ConnectionClosedError):
            await self._client.connection.notify(
                schema.SESSION_CANCEL, schema.CancelNotification(session_id=self.session_id)
            )

    def _adopt(
        self,
        response: schema.NewSessionResponse
        | schema.LoadSessionResponse
        | schema.ResumeSessionResponse
        | None,
    ) -> None:
        """Take the modes and config options the agent answered with (a null answer has none)."""
        if response is not None:
            self.modes = response.modes
            self.config_options = response.config_options

    @property
    def current_mode_id(self) -> str | None:
        """The session's current mode (its ``modes``, else a config option of category ``mode``)."""
        return current_mode(self.modes, self.config_options)

    @property
    def offered_modes(self) -> list[ModeChoice]:
        """Every mode the agent offers for this session (see :func:`~subagent.acp._modes.offered_modes`)."""
        return offered_modes(self.modes, self.config_options)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called: the client no longer knows this session."""
        return self._closed

    async def close(self) -> None:
        """Close the session: ask the agent to free it (``session/close``) when it advertises
        ``sessionCapabilities.close`` (an agent that does not is sent nothing: it would answer -32601),
        and forget it here, whatever the answer. A turn still running is cancelled by the close (the
        agent answers it ``cancelled``); its pending permission questions are answered ``cancelled``.

        Idempotent: only the first call sends anything. Bound it with a timeout of your own: the
        agent's answer is awaited.

        Raises:
            RequestError: the agent answered with an error (the session is forgotten all the same).
            AgentExitedError: the agent died first.
        """
        if self._closed:
            return
        self._closed = True
        client = self._client
        turn = self._turn
        if turn is not None:
            turn.cancel_requested = True
            for scope in tuple(self._permission_scopes):
                scope.cancel()
        try:
            if client.supports_close:
                await client._call(
                    schema.SESSION_CLOSE, schema.CloseSessionRequest(session_id=self.session_id)
                )
        finally:
            # Forgotten after the answer: the updates of a turn the close ends still reach it.
            if client._sessions.get(self.session_id) is self:
                del client._sessions[self.session_id]

    async def _receive_early(self, updates: list[schema.SessionUpdate]) -> None:
        """Take the updates the agent sent before answering the request that opened this session: kept
        in :attr:`early_updates`, applied to the session's state (mode, config options) after the answer
        was adopted (they are delivered as if they came right after it), and delivered to the listeners."""
        for update in updates:
            self.early_updates.append(update)
            pending = self._deliver(update)
            if pending is not None:
                await pending

    async def set_mode(self, mode_id: str) -> None:
        """Switch the session to another of the agent's modes (``session/set_mode``)."""
        await self._client._call(
            schema.SESSION_SET_MODE, schema.SetSessionModeRequest(session_id=self.session_id, mode_id=mode_id)
        )
        if self.modes is not None:
            self.modes = msgspec.structs.replace(self.modes, current_mode_id=mode_id)

    async def set_config_option(self, config_id: str, value: str | bool) -> list[schema.SessionConfigOption]:
        """Set one of the agent's config options (``session/set_config_option``): a select option's value
        id, or a boolean option's value. Returns the agent's full list of options and values, which
        :attr:`config_options` then holds."""
        request: schema.SetSessionConfigOptionRequest = (
            schema.SetSessionConfigOptionRequestBoolean(
                session_id=self.session_id, config_id=config_id, value=value
            )
            if isinstance(value, bool)
            else schema.SetSessionConfigOptionRequestValueId(
                session_id=self.session_id, config_id=config_id, value=value
            )
        )
        raw = await self._client._call(schema.SESSION_SET_CONFIG_OPTION, request)
        response = schema.decode(raw, type=schema.SetSessionConfigOptionResponse | None)
        if response is not None:
            self.config_options = list(response.config_options)
        return list(self.config_options or ())

    async def select_mode(self, mode_id: str) -> None:
        """Switch to ``mode_id`` whichever way the agent offers it: ``session/set_mode`` for one of its
        ``modes``, else ``session/set_config_option`` on its ``mode`` config option.

        Raises:
            SessionSettingError: the agent offers no such mode (``offered`` lists the ids it does).
        """
        offered = self.offered_modes
        choice = next((mode for mode in offered if mode.id == mode_id), None)
        if choice is None:
            ids = [mode.id for mode in offered]
            listed = ", ".join(repr(mode) for mode in ids) if ids else "none"
            raise SessionSettingError(
                f"the agent offers no mode {mode_id!r} (its modes: {listed})", setting="mode", offered=ids
            )
        if choice.config_id is None:
            await self.set_mode(mode_id)
        else:
            await self.set_config_option(choice.config_id, mode_id)

    async def configure(self, options: Mapping[str, str | bool]) -> None:
        """Set config options by id, in order: a select option takes one of its value ids, a boolean
        option ``True``/``False`` (or the strings ``true``/``false``, ``on``/``off``, ``yes``/``no``,
        ``1``/``0``, as a command line gives them).

        Raises:
            SessionSettingError: an id the agent does not offer, or a value its option does not take
                (``offered`` lists what it does take).
        """
        for config_id, wanted in options.items():
            option = next(
                (item for item in self.config_options or () if getattr(item, "id", None) == config_id), None
            )
            if isinstance(option, schema.SessionConfigSelect):
                values = [value.value for value in select_values(option)]
                if not isinstance(wanted, str) or wanted not in values:
                    listed = ", ".join(repr(value) for value in values) or "none"
                    raise SessionSettingError(
                        f"the agent's config option {config_id!r} takes no value {wanted!r} (its values: "
                        f"{listed})",
                        setting=config_id,
                        offered=values,
                    )
                await self.set_config_option(config_id, wanted)
            elif isinstance(option, schema.SessionConfigBoolean):
                flag = _boolean(wanted)
                if flag is None:
                    raise SessionSettingError(
                        f"the agent's config option {config_id!r} is true or false, not {wanted!r}",
                        setting=config_id,
                        offered=["true", "false"],
                    )
                await self.set_config_option(config_id, flag)
            else:
                ids = [str(getattr(item, "id", "?")) for item in self.config_options or ()]
                listed = ", ".join(repr(item) for item in ids) or "none"
                raise SessionSettingError(
                    f"the agent offers no config option {config_id!r} (its options: {listed})",
                    setting=config_id,
                    offered=ids,
                )

    def _apply_state(self, update: schema.SessionUpdate) -> None:
        """Keep :attr:`modes` and :attr:`config_options` current from the agent's own updates."""
        if isinstance(update, schema.CurrentModeUpdate):
            if self.modes is not None:
                self.modes = msgspec.structs.replace(self.modes, current_mode_id=update.current_mode_id)
            else:
                # A mode pushed before any was announced: known by its id alone.
                self.modes = schema.SessionModeState(
                    current_mode_id=update.current_mode_id,
                    available_modes=[
                        schema.SessionMode(id=update.current_mode_id, name=update.current_mode_id)
                    ],
                )
        elif isinstance(update, schema.ConfigOptionUpdate):
            self.config_options = list(update.config_options)

    # -- from the agent ------------------------------------------------------------------------------

    def _deliver(self, update: schema.SessionUpdate) -> Awaitable[None] | None:
        """Record ``update`` and call the listeners; an awaitable comes back only if one of them is async."""
        self.last_activity = time.monotonic()
        kind = type(update)
        if kind is _MODE_UPDATE or kind is _CONFIG_UPDATE:
            self._apply_state(update)
        turn = self._turn
        if self.subagent is not None:
            self.subagent.record(update)
            self._client._touch_ancestors(self.subagent)
        if self._loading:
            self.replayed.append(update)
        elif turn is not None:
            turn.updates.append(update)  # a bounded deque: the oldest falls out
            turn.count += 1
            # TurnOutput.add, inlined: this runs for every update of every turn.
            if kind is _MESSAGE_CHUNK:
                output = turn.output
                message_id = update.message_id  # type: ignore[union-attr]
                if message_id is not None and message_id != output.message_id:
                    output.start_message(message_id)
                content = update.content  # type: ignore[union-attr]
                if type(content) is _TEXT:
                    output.add_text(content.text)
                meta = update.meta  # type: ignore[union-attr]
                if meta is not None:
                    turn.usage.add_chunk_meta(meta)
            elif kind is _TOOL_CALL or kind is _TOOL_CALL_UPDATE:
                turn.output.end_message()
            elif kind is _USAGE_UPDATE:
                turn.usage.add_usage_update(update.used, update.size, update.cost)  # type: ignore[union-attr]
            elif kind is _UNKNOWN_UPDATE:
                raw = update.raw  # type: ignore[union-attr]
                if raw.get("sessionUpdate") == "usage_update":  # e.g. `"used": null`: read what fits
                    turn.usage.add_usage_update(raw.get("used"), raw.get("size"), raw.get("cost"))
        on_update = turn.on_update if turn is not None else None
        if not self._listeners:
            # The usual case (a provider's turn): one callback, called directly, no list built.
            if on_update is None:
                return None
            try:
                outcome = on_update(update)
            except Exception:
                logger.exception("update callback for session %r raised; ignored", self.session_id)
                return None
            if outcome is None or not inspect.isawaitable(outcome):
                return None
            return self._deliver_async(outcome, [], update)
        callbacks: list[UpdateCallback] = list(self._listeners)
        if on_update is not None:
            callbacks.append(on_update)
        for index, callback in enumerate(callbacks):
            outcome = self._call_listener(callback, update)
            if outcome is not None:
                return self._deliver_async(outcome, callbacks[index + 1 :], update)
        return None

    def _call_listener(
        self, callback: UpdateCallback, update: schema.SessionUpdate
    ) -> Awaitable[object] | None:
        try:
            outcome = callback(update)
        except Exception:
            # A display bug must not lose the rest of the turn.
            logger.exception("update callback for session %r raised; ignored", self.session_id)
            return None
        # Most listeners return None: the isawaitable check (an ABC instance check) is for the rest.
        return outcome if outcome is not None and inspect.isawaitable(outcome) else None

    async def _deliver_async(
        self, pending: Awaitable[object], rest: list[UpdateCallback], update: schema.SessionUpdate
    ) -> None:
        while True:
            try:
                await pending
            except Exception:
                logger.exception("update callback for session %r raised; ignored", self.session_id)
            while rest:
                outcome = self._call_listener(rest.pop(0), update)
                if outcome is not None:
                    pending = outcome
                    break
            else:
                return

    async def _elicit(self, question: ElicitationQuestion, policy: PermissionPolicy) -> ElicitationAnswer:
        """Ask the policy an elicitation question for this session, like a permission question: it pauses
        the inactivity clock, and a turn being cancelled answers it ``cancel``."""
        turn = self._turn
        if turn is not None and turn.cancel_requested:
            return ElicitationAnswer.cancel()
        self.pending_permissions += 1
        answer = ElicitationAnswer.cancel()
        try:
            with anyio.CancelScope() as scope:
                self._permission_scopes.add(scope)
                answer = await _elicit(question, policy)
        finally:
            self._permission_scopes.discard(scope)
            self.pending_permissions -= 1
            self.last_activity = time.monotonic()
        return ElicitationAnswer.cancel() if scope.cancelled_caught else answer

    async def _ask(self, question: PermissionQuestion, policy: PermissionPolicy) -> PermissionOption | None:
        turn = self._turn
        if turn is not None and turn.cancel_requested:
            return None  # the turn is being cancelled: every question is answered cancelled
        # A child's question holds up the sessions above it too: their clocks pause as well.
        waiting = self._client._lineage(self)
        for session in waiting:
            session.pending_permissions += 1
        decision: PermissionOption | Literal[PermissionOutcome.CANCELLED] = PermissionOutcome.CANCELLED
        try:
            with anyio.CancelScope() as scope:
                self._permission_scopes.add(scope)
                decision = await policy.decide(question)
        finally:
            self._permission_scopes.discard(scope)
            now = time.monotonic()
            for session in waiting:
                session.pending_permissions -= 1
                # The clock restarts when the answer goes out: waiting on the policy is not silence.
                session.last_activity = now
        if scope.cancelled_caught or decision is PermissionOutcome.CANCELLED:
            chosen = None
        elif decision not in question.options:
            logger.error("permission policy %r answered an option that was not offered; cancelling", policy)
            chosen = None
        else:
            chosen = decision
        refused = chosen is None or chosen.kind.startswith("reject")
        if refused and turn is not None and not turn.cancel_requested:
            # The policy said no (a turn being cancelled says no to everything: that is not it).
            turn.permissions_denied += 1
            turn.last_denied = question.title or question.tool_call_id
        return chosen

    def _cover(
        self, question: PermissionQuestion, chosen: PermissionOption | None, paths: Iterable[str]
    ) -> None:
        """Remember what an allowing answer covers: the paths its tool call names, for the rest of the
        turn; with ``allow_always`` on a tool call that edits, every write of the session."""
        if chosen is None or not chosen.kind.startswith("allow"):
            return
        if chosen.kind == "allow_always" and question.kind in ("edit", "delete", "move"):
            self._writes_allowed = True
        turn = self._turn
        if turn is None:
            return
        for path in paths:
            if len(turn.allowed_paths) >= MAX_ALLOWED_PATHS:
                break
            turn.allowed_paths.add(path)

    async def _authorize_write(self, path: str, size: int, policy: PermissionPolicy) -> None:
        """Let the agent's ``fs/write_text_file`` through only when the permission policy allows it:
        covered by a permission allowed in this turn, or asked of the policy as a question of its own
        (``allow`` allows it, ``deny`` refuses it, a callback decides).

        Raises:
            RequestError: -32003, the policy refused the write (the message names the policy).
        """
        turn = self._turn
        if self._writes_allowed or (turn is not None and _path_key(path, self.cwd) in turn.allowed_paths):
            return
        question = PermissionQuestion(
            session_id=self.session_id,
            tool_call_id=f"fs/write_text_file {path}",
            title=f"Write {path}",
            kind="edit",
            raw_input=freeze_json({"path": path, "bytes": size}),
            options=WRITE_QUESTION_OPTIONS,
            subagent=_subagent_name(self.subagent),
        )
        chosen = await self._ask(question, policy)
        if chosen is None or not chosen.kind.startswith("allow"):
            name = policy_name(policy)
            logger.warning(
                "refused the agent's write to %s: no permission in this turn covered it, and the "
                "permission policy (%s) did not allow it",
                _clip(path),
                name,
            )
            raise RequestError.permission_denied(
                f"Permission denied: the client's permission policy ({name}) refused this write",
                {"path": _clip(path), "policy": name},
            )
        if chosen.kind == "allow_always":
            self._writes_allowed = True


# -- the client -----------------------------------------------------------------------------------------


class ClientOptions(TypedDict, total=False):
    """What an :class:`AcpClient` offers the agent and how much it keeps, as keyword arguments: what
    :func:`spawn_agent` passes on to the client it makes. Each is described, with its default, at
    :class:`AcpClient`."""

    permission: Literal["allow", "deny"] | PermissionPolicy | PermissionCallback
    fs: FsSandbox | None
    terminals: TerminalHost | None
    client_info: schema.Implementation | None
    max_line_bytes: int
    max_kept_updates: int | None
    max_output_chars: int | None
    on_protocol_error: Callable[[ProtocolError], None] | None
    subagents: bool


class AcpClient:
    """An ACP client over a byte-stream pair. Use as an async context manager.

    Args:
        receive_stream: the agent's output (its stdout).
        send_stream: the agent's input (its stdin).
        permission: ``"allow"``, ``"deny"``, a :class:`PermissionPolicy` or an async callback.
        fs: serve ``fs/*`` inside this sandbox; None (default) advertises no file-system access.
        terminals: serve ``terminal/*`` with this host; None (default) advertises none.
        client_info: the name and version sent in ``initialize``.
        max_line_bytes: the longest line accepted from the agent.
        max_kept_updates: how many of a turn's updates (and of a loaded session's replay) are
            kept, the most recent; None keeps all.
        max_output_chars: the longest final message a turn keeps (see :class:`TurnOutput`);
            None: no limit.
        on_protocol_error: told about every malformed line the agent sends (they are skipped).
        subagents: advertise ACP's (unstable) ``subagents`` capability and keep the child sessions the
            agent announces (see the module docstring); off by default here.
        exit_diagnosis: builds the error for a closed connection (a child-process owner passes one
            that adds the exit status and stderr tail).
    """

    def __init__(
        self,
        receive_stream: anyio.abc.ByteReceiveStream,
        send_stream: anyio.abc.ByteSendStream,
        *,
        permission: Literal["allow", "deny"] | PermissionPolicy | PermissionCallback = "deny",
        fs: FsSandbox | None = None,
        terminals: TerminalHost | None = None,
        client_info: schema.Implementation | None = None,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_kept_updates: int | None = DEFAULT_MAX_KEPT_UPDATES,
        max_output_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS,
        on_protocol_error: Callable[[ProtocolError], None] | None = None,
        exit_diagnosis: Callable[[ConnectionClosedError], Awaitable[AgentExitedError]] | None = None,
        name: str = "acp-client",
        subagents: bool = False,
    ) -> None:
        _check_bound("max_kept_updates", max_kept_updates)
        _check_bound("max_output_chars", max_output_chars)
        self.max_kept_updates = max_kept_updates
        self.max_output_chars = max_output_chars
        self.permission = permission_policy(permission)
        self.fs = fs
        self.terminals = terminals
        self.client_info = client_info or schema.Implementation(name=CLIENT_NAME, version=__version__)
        self.agent: schema.InitializeResponse | None = None
        """The agent's ``initialize`` answer, once :meth:`initialize` returned."""
        self.connection = Connection(
            receive_stream,
            send_stream,
            request_handler=self._serve_request,
            notification_handler=self._serve_notification,
            on_protocol_error=on_protocol_error,
            max_line_bytes=max_line_bytes,
            name=name,
            value_encoder=schema.encode,
            typed_notifications={schema.SESSION_UPDATE: schema.SessionNotification},
        )
        self._exit_diagnosis = exit_diagnosis
        self._sessions: dict[str, AcpSession] = {}
        self.subagents = subagents
        """Whether the client advertises ``subagents`` and keeps the child sessions announced to it."""
        self.subagent_sessions: dict[str, SubagentSession] = {}
        """Every subagent session the agent announced, by id, in announcement order (at most
        :data:`~subagent.acp._subagents.MAX_SUBAGENT_SESSIONS`)."""
        self._subagent_listeners: list[SubagentListener] = []
        self.subagents_refused = 0
        """Announcements not taken: past the limit, on a session nobody opened or announced, or naming
        a session that already has another parent (ownership never changes)."""
        # Updates for sessions not known yet, kept while a request that opens one is in flight.
        self._opening = 0
        self._early: deque[tuple[str, schema.SessionUpdate, int]] = deque()
        self._early_bytes = 0
        self._early_warned = False
        self.early_updates_dropped = 0
        """Updates for a session not known yet that were let go: past :data:`MAX_EARLY_UPDATES` or
        :data:`MAX_EARLY_UPDATE_BYTES` (the oldest first), or for a session id that no request of ours
        opened."""
        self._requests_in_flight = 0
        self._abandoned_requests = False
        self.process: Channel | None = None
        """The running agent, when :func:`spawn_agent` started it: its channel (locally, the
        :class:`~subagent.acp.transports.AgentProcess`)."""

    async def __aenter__(self) -> Self:
        await self.connection.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return await self.connection.__aexit__(exc_type, exc, tb)

    def session(self, session_id: str) -> AcpSession | None:
        """A session this client created or loaded, or a subagent session the agent announced, by id."""
        return self._sessions.get(session_id)

    def on_subagent(self, listener: SubagentListener) -> Callable[[], None]:
        """Call ``listener`` after each ``subagent_update`` applied (see :data:`SubagentListener`);
        returns a disposer."""
        self._subagent_listeners.append(listener)

        def dispose() -> None:
            if listener in self._subagent_listeners:
                self._subagent_listeners.remove(listener)

        return dispose

    # -- subagent sessions ---------------------------------------------------------------------------

    def _on_subagent_update(self, parent: AcpSession, raw: dict[str, Any]) -> None:
        """Apply a ``subagent_update`` the agent sent on ``parent``: announce a new child, or patch one
        of ``parent``'s children. Anything else is refused (logged, counted), never applied."""
        try:
            update = schema.convert(raw, type=unstable.SubagentUpdate)
        except msgspec.ValidationError as exc:
            logger.warning("ignoring a malformed subagent_update: %s", exc)
            self.subagents_refused += 1
            return
        child_id = update.session_id
        child = self.subagent_sessions.get(child_id)
        if child is None:
            refusal = self._announcement_refusal(parent, child_id)
            if refusal is not None:
                logger.warning("refusing the agent's subagent session %r: %s", _clip_id(child_id), refusal)
                self.subagents_refused += 1
                return
            depth = parent.subagent.depth + 1 if parent.subagent is not None else 1
            child = SubagentSession(
                child_id, parent.session_id, depth, updates=deque(maxlen=self.max_kept_updates)
            )
            session = AcpSession(self, child_id, parent.cwd)
            session.subagent = child
            self.subagent_sessions[child_id] = child
            self._sessions[child_id] = session
        elif child.parent_session_id != parent.session_id:
            logger.warning(
                "ignoring a subagent_update for %r on %r: it was announced on %r, and a child's parent "
                "never changes",
                _clip_id(child_id),
                _clip_id(parent.session_id),
                _clip_id(child.parent_session_id),
            )
            self.subagents_refused += 1
            return
        ended = child.apply(update, raw)
        own = self._sessions.get(child_id)
        if own is not None:
            # A child with no cwd of its own works in its parent's (the RFD's inheritance).
            own.cwd = child.cwd if child.cwd is not None else parent.cwd
        self._touch_ancestors(child)
        for listener in tuple(self._subagent_listeners):
            try:
                listener(child, ended)
            except Exception:
                logger.exception("subagent listener raised; ignored")

    def _announcement_refusal(self, parent: AcpSession, child_id: str) -> str | None:
        """Why announcing ``child_id`` on ``parent`` is refused, or None when it is taken."""
        if child_id in self._sessions:
            return "it is a session of ours, not a child the agent created"
        if len(self.subagent_sessions) >= MAX_SUBAGENT_SESSIONS:
            return f"the client keeps at most {MAX_SUBAGENT_SESSIONS} subagent sessions"
        return None

    def _lineage(self, session: AcpSession) -> list[AcpSession]:
        """``session`` and the sessions above it, nearest first."""
        found = [session]
        child = session.subagent
        while child is not None:
            parent = self._sessions.get(child.parent_session_id)
            if parent is None or parent in found:
                break
            found.append(parent)
            child = parent.subagent
        return found

    def _subtree(self, session_id: str) -> list[AcpSession]:
        """The session ``session_id`` and every subagent session below it."""
        wanted = {session_id}
        for child in self.subagent_sessions.values():  # announcement order: parents come first
            if child.parent_session_id in wanted:
                wanted.add(child.session_id)
        return [session for sid in wanted if (session := self._sessions.get(sid)) is not None]

    def _touch_ancestors(self, child: SubagentSession) -> None:
        """A child's traffic is a sign of life of every session above it: a parent that waits for its
        child is not silent."""
        now = time.monotonic()
        parent = self._sessions.get(child.parent_session_id)
        for session in self._lineage(parent) if parent is not None else ():
            session.last_activity = now

    @property
    def supports_close(self) -> bool:
        """Whether the agent advertised ``sessionCapabilities.close`` (False before :meth:`initialize`)."""
        agent = self.agent
        return agent is not None and agent.agent_capabilities.session_capabilities.close is not None

    # -- client -> agent ---------------------------------------------------------------------------

    async def initialize(self) -> schema.InitializeResponse:
        """Negotiate protocol version 1 and exchange capabilities.

        Besides fs and terminal (as configured), the client always advertises session notices and
        context compaction: it decodes both kinds of update and delivers them as they come, and a
        compaction's summary never becomes part of the turn's output.

        Raises:
            ProtocolVersionError: the agent answered another version (the caller should close).
        """
        fs_access = self.fs is not None
        # The unstable schema's request: its capabilities hold `subagents`, left out when off.
        request = unstable.InitializeRequest(
            protocol_version=schema.PROTOCOL_VERSION,
            client_capabilities=unstable.ClientCapabilities(
                fs=schema.FileSystemCapabilities(read_text_file=fs_access, write_text_file=fs_access),
                terminal=self.terminals is not None,
                session=_SESSION_CAPABILITIES,
                # Form mode only: every question goes to the permission policy, which may decline.
                elicitation=schema.ElicitationCapabilities(form=schema.ElicitationFormCapabilities()),
                subagents=unstable.SubagentCapabilities() if self.subagents else None,
            ),
            client_info=self.client_info,
        )
        raw = await self._call(schema.INITIALIZE, request)
        response = schema.decode(raw, type=schema.InitializeResponse)
        if response.protocol_version != schema.PROTOCOL_VERSION:
            raise ProtocolVersionError(response.protocol_version, schema.PROTOCOL_VERSION)
        self.agent = response
        return response

    async def authenticate(self, method_id: str) -> None:
        """Authenticate with one of the agent's advertised methods."""
        await self._call(schema.AUTHENTICATE, schema.AuthenticateRequest(method_id=method_id))

    async def new_session(
        self,
        cwd: str | os.PathLike[str],
        *,
        mcp_servers: Sequence[schema.McpServer] = (),
        meta: Mapping[str, Any] | None = None,
        additional_directories: Sequence[str | os.PathLike[str]] = (),
    ) -> AcpSession:
        """Open a new session rooted at ``cwd`` (made absolute). ``meta`` goes out as the request's
        ``_meta`` (ACP's extension point: agents ignore keys they do not know).
        ``additional_directories`` (made absolute) are more workspace roots for the session.

        Raises:
            AuthenticationRequiredError: the agent wants ``authenticate`` first.
            AgentCapabilityError: ``additional_directories`` were given and the agent does not advertise
                ``sessionCapabilities.additionalDirectories`` (nothing is sent: it would ignore them).
        """
        request = schema.NewSessionRequest(
            cwd=_absolute(cwd),
            additional_directories=self._additional_directories(additional_directories),
            mcp_servers=list(mcp_servers),
            meta=None if meta is None else dict(meta),
        )
        self._opening += 1
        try:
            raw = await self._call_authenticated(schema.SESSION_NEW, request)
            response = schema.decode(raw, type=schema.NewSessionResponse)
            session = self._sessions.setdefault(
                response.session_id, AcpSession(self, response.session_id, request.cwd)
            )
            session._adopt(response)
            early = self._take_early(response.session_id)
        finally:
            self._opened()
        if early:
            await session._receive_early(early)
        return session

    async def load_session(
        self,
        session_id: str,
        cwd: str | os.PathLike[str],
        *,
        mcp_servers: Sequence[schema.McpServer] = (),
        meta: Mapping[str, Any] | None = None,
        additional_directories: Sequence[str | os.PathLike[str]] = (),
    ) -> AcpSession:
        """Load a past session; the history the agent replays is in ``session.replayed``. ``meta`` and
        ``additional_directories`` are sent as :meth:`new_session` sends them.

        Raises:
            AgentCapabilityError: the agent does not advertise ``loadSession``, or additional directories
                were given and it does not advertise them (nothing is sent).
        """
        agent = self._require_initialized()
        if not agent.agent_capabilities.load_session:
            raise AgentCapabilityError("the agent does not support session/load (loadSession)")
        return await self._reopen_session(
            schema.SESSION_LOAD, session_id, cwd, mcp_servers, meta, additional_directories
        )

    async def resume_session(
        self,
        session_id: str,
        cwd: str | os.PathLike[str],
        *,
        mcp_servers: Sequence[schema.McpServer] = (),
        meta: Mapping[str, Any] | None = None,
        additional_directories: Sequence[str | os.PathLike[str]] = (),
    ) -> AcpSession:
        """Resume a past session without a replay of its history. ``meta`` and ``additional_directories``
        are sent as :meth:`new_session` sends them.

        Raises:
            AgentCapabilityError: the agent does not advertise ``sessionCapabilities.resume``, or additional
                directories were given and it does not advertise them (nothing is sent).
        """
        agent = self._require_initialized()
        if agent.agent_capabilities.session_capabilities.resume is None:
            raise AgentCapabilityError("the agent does not support session/resume")
        return await self._reopen_session(
            schema.SESSION_RESUME, session_id, cwd, mcp_servers, meta, additional_directories
        )

    async def _reopen_session(
        self,
        method: Literal["session/load", "session/resume"],
        session_id: str,
        cwd: str | os.PathLike[str],
        mcp_servers: Sequence[schema.McpServer],
        meta: Mapping[str, Any] | None = None,
        additional_directories: Sequence[str | os.PathLike[str]] = (),
    ) -> AcpSession:
        """Open a past session with `session/load` (which replays its history) or `session/resume`.

        The session is known before the request goes out: a load's replayed history, and any question the
        agent asks about the session meanwhile, arrive before the answer. A failed request forgets it.
        """
        wire_types = schema.AGENT_METHODS[method]
        request = wire_types.params(
            session_id=session_id,
            cwd=_absolute(cwd),
            mcp_servers=list(mcp_servers),
            additional_directories=self._additional_directories(additional_directories),
            meta=None if meta is None else dict(meta),
        )
        session = self._sessions.setdefault(session_id, AcpSession(self, session_id, request.cwd))
        session._loading = method == schema.SESSION_LOAD
        self._opening += 1  # the session is known already; an agent may still announce others meanwhile
        try:
            raw = await self._call_authenticated(method, request)
        except BaseException:
            self._sessions.pop(session_id, None)
            raise
        finally:
            session._loading = False
            self._opened()
        session._adopt(schema.decode(raw, type=wire_types.result | None))
        return session

    def _additional_directories(self, directories: Sequence[str | os.PathLike[str]]) -> list[str] | None:
        """``directories`` made absolute for a request that opens a session (None when there are none).

        Raises:
            AgentCapabilityError: the agent does not advertise ``sessionCapabilities.additionalDirectories``
                (it would ignore them).
        """
        if not directories:
            return None
        agent = self._require_initialized()
        if agent.agent_capabilities.session_capabilities.additional_directories is None:
            raise AgentCapabilityError(
                "the agent does not support additional directories "
                "(it does not advertise sessionCapabilities.additionalDirectories)"
            )
        return [_absolute(directory) for directory in directories]

    # -- updates that arrive before the session they are for ------------------------------------------

    def _keep_early(self, session_id: str, update: schema.SessionUpdate) -> None:
        """Keep an update for a session not known yet, while a request that may open it is in flight."""
        size = len(schema.encode(update))  # only updates that come early pay for this
        early = self._early
        early.append((session_id, update, size))
        self._early_bytes += size
        dropped = 0
        while early and (len(early) > MAX_EARLY_UPDATES or self._early_bytes > MAX_EARLY_UPDATE_BYTES):
            self._early_bytes -= early.popleft()[2]
            dropped += 1
        if dropped:
            self.early_updates_dropped += dropped
            if not self._early_warned:
                self._early_warned = True
                logger.warning(
                    "the agent sent more updates for sessions not opened yet than are kept (%d, %d bytes): "
                    "dropping the oldest",
                    MAX_EARLY_UPDATES,
                    MAX_EARLY_UPDATE_BYTES,
                )

    def _take_early(self, session_id: str) -> list[schema.SessionUpdate]:
        """The updates kept for ``session_id``, in order; they are no longer kept."""
        if not self._early:
            return []
        taken: list[schema.SessionUpdate] = []
        rest: deque[tuple[str, schema.SessionUpdate, int]] = deque()
        for entry in self._early:
            if entry[0] == session_id:
                taken.append(entry[1])
                self._early_bytes -= entry[2]
            else:
                rest.append(entry)
        self._early = rest
        return taken

    def _opened(self) -> None:
        """A request that opens a session is over: with none left in flight, updates kept for a session
        that none of them opened are let go."""
        self._opening -= 1
        if self._opening == 0 and self._early:
            ids = sorted({entry[0] for entry in self._early})
            logger.warning(
                "dropping %d update(s) the agent sent for session(s) it did not open: %s",
                len(self._early),
                ", ".join(repr(_clip_id(session_id)) for session_id in ids[:5]),
            )
            self.early_updates_dropped += len(self._early)
            self._early.clear()
            self._early_bytes = 0

    def _require_initialized(self) -> schema.InitializeResponse:
        if self.agent is None:
            raise RuntimeError("call initialize() first")
        return self.agent

    async def _call_authenticated(self, method: str, params: Any) -> msgspec.Raw:
        try:
            return await self._call(method, params)
        except RequestError as exc:
            if exc.code != schema.AUTHENTICATION_REQUIRED:
                raise
            methods = self.agent.auth_methods if self.agent is not None else []
            offered = ", ".join(_describe_auth_method(m) for m in methods) or "none advertised"
            raise AuthenticationRequiredError(
                f"the agent requires authentication before {method} (auth methods: {offered})", methods
            ) from exc

    @property
    def idle(self) -> bool:
        """Whether the agent has nothing of ours to work on: no request of ours awaits its answer, and
        none was given up on before it answered (a prompt whose caller was cancelled, a handshake
        past its deadline: the agent may still be at it). An idle agent can be told to go quickly."""
        return self._requests_in_flight == 0 and not self._abandoned_requests

    async def _call(self, method: str, params: Any, *, courtesy_cancel: bool = True) -> msgspec.Raw:
        self._requests_in_flight += 1
        try:
            return await self.connection.request(method, params, courtesy_cancel=courtesy_cancel)
        except ConnectionClosedError as exc:
            raise await self._diagnose(exc) from exc
        except anyio.get_cancelled_exc_class():
            self._abandoned_requests = True
            raise
        finally:
            self._requests_in_flight -= 1

    async def _diagnose(self, closed: ConnectionClosedError) -> AgentExitedError:
        if isinstance(closed.cause, AgentExitedError):
            return closed.cause
        if self._exit_diagnosis is not None:
            return await self._exit_diagnosis(closed)
        return AgentExitedError(f"the connection to the agent closed: {closed}")

    # -- agent -> client ---------------------------------------------------------------------------

    def _session_for(self, session_id: str) -> AcpSession:
        session = self._sessions.get(session_id)
        if session is None:
            raise RequestError.invalid_params({"sessionId": session_id, "reason": "unknown session"})
        return session

    async def _serve_request(self, method: str, params: msgspec.Raw | None) -> Any:
        if method == schema.SESSION_REQUEST_PERMISSION:
            data = params if params is not None else b"null"
            return await self._on_permission(schema.decode(data, type=schema.RequestPermissionRequest))
        if method == schema.ELICITATION_CREATE:
            data = params if params is not None else b"null"
            return await self._on_elicitation(schema.decode(data, type=schema.CreateElicitationRequest))
        if method == schema.FS_WRITE_TEXT_FILE and self.fs is not None:
            # The policy holds for writes too, whether the agent asked first or not: an agent in a mode
            # that approves by itself writes without ever asking.
            write = schema.decode(params if params is not None else b"null", type=schema.WriteTextFileRequest)
            session = self._session_for(write.session_id)
            # A path the sandbox refuses anyway is refused as such, never put to the policy first.
            await anyio.to_thread.run_sync(self.fs.resolve, write.path)
            await session._authorize_write(write.path, len(write.content), self.permission)
        return await serve_file_request(
            method, params, fs=self.fs, terminals=self.terminals, on_session=self._touch
        )

    def _touch(self, session_id: str) -> None:
        self._session_for(session_id).last_activity = time.monotonic()

    async def _on_permission(
        self, request: schema.RequestPermissionRequest
    ) -> schema.RequestPermissionResponse:
        session = self._session_for(request.session_id)
        session.last_activity = time.monotonic()
        tool_call = request.tool_call
        question = PermissionQuestion(
            session_id=request.session_id,
            tool_call_id=tool_call.tool_call_id,
            title=tool_call.title,
            kind=tool_call.kind,
            raw_input=freeze_json(tool_call.raw_input),
            options=tuple(PermissionOption(o.option_id, o.name, o.kind) for o in request.options),
            subagent=_subagent_name(session.subagent),
        )
        chosen = await session._ask(question, self.permission)
        session._cover(question, chosen, _named_paths(tool_call, session.cwd))
        outcome: schema.RequestPermissionOutcome = (
            schema.CancelledPermissionOutcome()
            if chosen is None
            else schema.SelectedPermissionOutcome(option_id=chosen.option_id)
        )
        return schema.RequestPermissionResponse(outcome=outcome)

    async def _on_elicitation(
        self, request: schema.CreateElicitationRequest
    ) -> schema.CreateElicitationResponse:
        if not isinstance(request, schema.ElicitationFormMode):
            # Only form mode is advertised: a URL (or unknown) mode is not ours to open.
            raw = request.raw if isinstance(request, schema.UnknownVariant) else {}
            reason = (
                "a form-mode elicitation needs a message and a requestedSchema object"
                if raw.get("mode") == "form"
                else "this client supports form-mode elicitation only"
            )
            raise RequestError.invalid_params({"reason": reason})
        question = question_from_request(request)  # -32602 for a form it cannot show or check
        if request.session_id is not None:
            session = self._session_for(request.session_id)
            answer = await session._elicit(question, self.permission)
        else:
            answer = await _elicit(question, self.permission)
        return answer.to_wire()

    def _serve_notification(
        self, method: str, params: schema.SessionNotification | msgspec.Raw | None
    ) -> Awaitable[None] | None:
        # A plain function on purpose: the connection awaits only what comes back, so a turn's stream
        # of updates costs no coroutine per update unless a listener is async.
        if isinstance(params, schema.SessionNotification):
            notification = params  # decoded in one pass by the connection: the hot path
        elif method != schema.SESSION_UPDATE or params is None:
            logger.debug("ignoring notification %s from the agent", method)
            return None
        else:
            try:  # the tolerant path: unknown update kinds and content types become Unknown* values
                notification = schema.decode(params, type=schema.SessionNotification)
            except msgspec.ValidationError:
                logger.warning("skipping a malformed session/update from the agent", exc_info=True)
                return None
        session = self._sessions.get(notification.session_id)
        if session is None:
            if self._opening:
                # The agent may be announcing the session it is about to answer with (Copilot, vibe).
                self._keep_early(notification.session_id, notification.update)
                return None
            logger.warning("ignoring an update for unknown session %r", _clip_id(notification.session_id))
            return None
        update = notification.update
        if self.subagents and type(update) is _UNKNOWN_UPDATE:
            raw = update.raw
            if raw.get("sessionUpdate") == "subagent_update":
                self._on_subagent_update(session, raw)
        return session._deliver(update)


def _subagent_name(child: SubagentSession | None) -> str | None:
    """How a question names the subagent session that asks it: its title, else its id."""
    if child is None:
        return None
    return child.title or child.session_id


def _path_key(path: str, cwd: str | None) -> str:
    """A path as coverage compares it: absolute (against the session's cwd) and normalised."""
    if not os.path.isabs(path) and cwd is not None:
        path = os.path.join(cwd, path)
    return os.path.normpath(path)


def _named_paths(tool_call: schema.ToolCallUpdate, cwd: str | None) -> list[str]:
    """The paths a permission question's tool call names: its ``locations``, the absolute paths among
    its raw input's values and keys, and the relative ones under keys that say path or file (a
    bounded look: at most ``_MAX_PATH_SCAN`` values)."""
    found = [_path_key(location.path, cwd) for location in tool_call.locations or ()]
    pending: list[tuple[str | None, Any]] = [(None, tool_call.raw_input)]
    scanned = 0
    while pending and scanned < _MAX_PATH_SCAN:
        key, value = pending.pop()
        scanned += 1
        if isinstance(value, str):
            named = os.path.isabs(value) or (key is not None and _PATH_KEYS.search(key) is not None)
            if named and 0 < len(value) <= 4096 and "\0" not in value:
                found.append(_path_key(value, cwd))
        elif isinstance(value, Mapping):
            for name, item in value.items():
                if isinstance(name, str) and os.path.isabs(name) and len(name) <= 4096:
                    found.append(_path_key(name, cwd))
                pending.append((str(name), item))
        elif isinstance(value, list | tuple):
            pending.extend((key, item) for item in value)
    return found


def _boolean(value: str | bool) -> bool | None:
    """A boolean option's value as a caller may give it; None for anything else."""
    if isinstance(value, bool):
        return value
    folded = value.strip().casefold()
    if folded in ("true", "on", "yes", "1"):
        return True
    if folded in ("false", "off", "no", "0"):
        return False
    return None


async def _elicit(question: ElicitationQuestion, policy: PermissionPolicy) -> ElicitationAnswer:
    """The policy's answer to ``question``, checked: a policy without ``elicit`` declines, and an accepted
    content that does not match the requested schema (or a policy that raises) is sent as decline."""
    elicit = getattr(policy, "elicit", None)
    if elicit is None:
        return ElicitationAnswer.decline()
    try:
        answer = await elicit(question)
    except Exception:
        logger.exception("permission policy %r failed to answer an elicitation; declining", policy)
        return ElicitationAnswer.decline()
    if not isinstance(answer, ElicitationAnswer):
        logger.error("permission policy %r answered an elicitation with %r; declining", policy, type(answer))
        return ElicitationAnswer.decline()
    if answer.action == "accept":
        problem = check_content(question, answer.content)
        if problem is not None:
            logger.error(
                "permission policy %r answered an elicitation with invalid content (%s); declining",
                policy,
                problem,
            )
            return ElicitationAnswer.decline()
    return answer


def _check_bound(label: str, value: object) -> None:
    """A size limit is a whole number >= 0, or None (checked as the caller may pass it, typed or not)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{label} must be an int >= 0 or None, not {value!r}")


def _clip_id(value: str, limit: int = 64) -> str:
    """A session id as a log line repeats it: an agent must not make us log megabytes."""
    return value if len(value) <= limit else f"{value[:limit]}…"


def _absolute(path: str | os.PathLike[str]) -> str:
    # ACP requires absolute session paths; this touches no file.
    return os.path.abspath(path)


def _describe_auth_method(method: schema.AuthMethod) -> str:
    if isinstance(method, schema.UnknownVariant):
        described = f"{method.raw.get('id')!r} ({method.raw.get('type')})"
        return described
    return f"{method.id!r} ({method.name})"


# -- a child-process agent ------------------------------------------------------------------------------


@asynccontextmanager
async def spawn_agent(
    argv: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    on_stderr_line: Callable[[str], object] | None = None,
    process_options: Mapping[str, Any] | None = None,
    idle_close_grace: float | None = DEFAULT_IDLE_CLOSE_GRACE,
    transport: Transport | None = None,
    **client_options: Unpack[ClientOptions],
) -> AsyncIterator[AcpClient]:
    """Run ``argv`` as an ACP agent we own and yield a connected (not yet initialized) client.

    ``client_options`` (:class:`ClientOptions`: ``permission``, ``fs``, ``terminals``, the limits...)
    go to the :class:`AcpClient`, with its defaults.

    ``transport`` says where the agent runs (:mod:`subagent.acp.transports`); by default a local
    child process, :class:`~subagent.acp.transports.LocalTransport` with ``process_options`` (the
    options of :func:`~subagent.acp.transports.open_agent_process`), which only that default takes.
    The client's ``process`` attribute is the transport's channel (locally, the
    :class:`~subagent.acp.transports.AgentProcess`). ``fs`` and ``terminals`` serve the agent on this
    host, so a transport whose ``local_files`` is False takes neither.
    Leaving the block closes the connection and tears the agent's tree down (close stdin, wait,
    SIGTERM, wait, SIGKILL, reap), whatever the exit path. The wait after stdin closes is
    ``idle_close_grace`` when the agent is :attr:`~AcpClient.idle` (its turn is over: an agent that
    exits on EOF does so in milliseconds, and one that ignores EOF is not waited on for long), and
    the transport's ``stdin_close_timeout`` otherwise (mid-turn, the agent may need time to stop);
    never more than that. None: always the latter.

    Raises:
        AgentSpawnError: the command cannot be started (missing, not executable, bad cwd), or
            holds what exec cannot carry (:func:`~subagent.acp.transports.check_command`).
        TypeError: ``argv`` is a single string.
        ValueError: ``argv`` is empty, ``process_options`` with a ``transport``, or
            ``fs``/``terminals`` with a transport whose children do not see this host's files.
    """
    if transport is None:
        transport = LocalTransport(**dict(process_options or {}))
    elif process_options:
        raise ValueError(
            f"process_options configure the default local transport; configure {transport.name} itself"
        )
    if not transport.local_files and (
        client_options.get("fs") is not None or client_options.get("terminals") is not None
    ):
        raise ValueError(
            f"the agent runs on {transport.name}, where this host's files are not: it can be offered "
            "no fs sandbox or terminals here"
        )
    transport_cwd = None if cwd is None else os.fspath(cwd)
    async with transport.open(
        check_command(argv, env, transport_cwd),
        env=env,
        cwd=transport_cwd,
        on_stderr_line=on_stderr_line,
    ) as process:
        client = AcpClient(
            process.stdout,
            process.stdin,
            **client_options,
            exit_diagnosis=lambda closed: _diagnose_exit(process, closed),
            name=f"acp:{transport.name if process.pid is None else process.pid}",
        )
        client.process = process
        full_grace = transport.stdin_close_timeout
        body_error: BaseException | None = None
        async with anyio.create_task_group() as task_group:
            connection_done = anyio.Event()

            async def run_connection(*, task_status: anyio.abc.TaskStatus[None]) -> None:
                try:
                    await client.connection.run(task_status=task_status)
                finally:
                    connection_done.set()

            await task_group.start(run_connection)
            task_group.start_soon(_close_on_exit, process, client.connection, connection_done)
            try:
                yield client
            except BaseException as exc:
                # Re-raised after the task group exits, so the caller sees its own exception rather
                # than an exception group wrapping it.
                body_error = exc
            finally:
                client.connection.close()
                task_group.cancel_scope.cancel()
        if idle_close_grace is not None and client.idle:
            # Torn down here, before the transport does it with the full grace (it then returns
            # this teardown's report).
            await process.aclose(stdin_close_timeout=min(idle_close_grace, full_grace))
        if body_error is not None:
            raise body_error


async def _close_on_exit(process: Channel, connection: Connection, connection_done: anyio.Event) -> None:
    """Fail pending calls as soon as the agent exits, even if a grandchild holds its stdout open."""
    info = await process.wait_exit()
    with anyio.move_on_after(STDOUT_DRAIN_GRACE):
        await connection_done.wait()  # EOF normally follows the exit: let the reader finish first
    connection.close(cause=AgentExitedError(str(info), exit_info=info))


async def _diagnose_exit(process: Channel, closed: ConnectionClosedError) -> AgentExitedError:
    with anyio.move_on_after(EXIT_DIAGNOSIS_TIMEOUT):
        info = await process.wait_exit()
        return AgentExitedError(str(info), exit_info=info)
    command = shlex.join(process.command)
    tail = process.stderr_tail().strip()
    message = f"agent `{command}` ({process.describe()}) closed its stdout but is still running"
    if closed.cause is not None:
        message += f" ({closed.cause})"
    if tail:
        message += f"; last stderr: {tail[-2000:]}"
    return AgentExitedError(message)
