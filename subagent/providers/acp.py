"""The ACP provider: each run is a child agent process driven over the Agent Client Protocol.

Readiness means a real, ready child session: the agent answered ``initialize`` (protocol version
1), ``authenticate`` when it demanded it, and ``session/new``. Until then nothing is announced; if
the child exits, fails or times out first, ``started()`` raises ``START_FAILED`` with the agent
command, its exit status and the tail of its stderr, and the process is already gone.

The run's result is the first turn (``session/prompt``) mapped onto the seam's stop reasons:

=========================  ==============================================================
ACP                        result
=========================  ==============================================================
``end_turn``               ``completed``
``cancelled``              ``cancelled``
``max_tokens``             ``max_tokens``
``max_turn_requests``      ``max_turns``
``refusal``                ``refusal``
child death                ``error``, with exit status and stderr tail
JSON-RPC error answer      ``error``, with the agent's error code and message
silence past ``timeout``   ``timeout`` (the clock pauses while a permission question waits)
=========================  ==============================================================

``output`` is the agent's final message: its last message of the turn (a message ends at a tool
call, or where the agent starts one with another ``messageId``; the earlier ones, such as a
warning or narration before a tool call, stay readable as ``run.messages``), built as the turn
streams and exact however many updates it has, up to ``max_output_chars`` characters
(default 16 Mi): an agent whose message goes past that has its turn cancelled like ``cancel()``
does, and the result is ``error``, saying so, with the message cut at the limit as ``output``.
Every update of every turn stays readable as ``run.updates``, up to ``max_kept_updates`` (default
10,000, about 4 MiB of message chunks): past that the oldest are dropped, and
``run.updates_dropped`` says how many (``run.update_count`` counts them all), so a flood of
updates costs the parent bounded memory. A prompt too large for one message to the agent
(``max_line_bytes`` once JSON-encoded) fails the start before a child is spawned, or, on
``resume()``, is an ``error`` result; it is never sent. The child stays alive after the first turn so
that ``resume()`` can run more turns in the same session, until the run is disposed, or until the
child is lost (it exited, or a turn found its connection gone): a lost child is torn down at once,
and ``resume()`` then answers an ``error`` result saying why.

Concurrency: a provider lets at most ``max_concurrent`` children work at once (default
:data:`DEFAULT_MAX_CONCURRENT`): starting up, or in a turn. A run past the limit is not refused: it
waits in a first-come, first-served queue (``run.queued``; ``provider.running`` /
``provider.waiting`` count both sides), and ``started()`` covers the wait. The slot is taken before
the child is spawned and given back when its first turn ends (or its process is reaped, whatever
ended it: a crash, a failed start, a cancel, a dispose). A child idle between turns holds no slot,
so code that awaits every result before disposing any run cannot wait on itself; ``resume()``
queues for a slot again before its turn. A run cancelled or disposed while it waits never spawns a
child. ``ready_timeout`` starts at the spawn, so time spent queued never counts against it.

Budgets (``request.budget``, or a cap of an ancestor's account): the run is held to the caps its agent's
reports can enforce (``capabilities.budget``, from ``reports_usage``; see
:mod:`subagent.providers._acp_budget`), and a request capping anything else is refused before any
child exists. Each report is charged to the run's account as it arrives (tokens, the session's cost,
each new tool call), on every turn, resumed ones too; a permission question for a tool call past the
budget is answered with a reject; the deadline of ``max_seconds`` is kept by a timer. Once a cap is
passed, here or anywhere above the run in its tree, the turn is cancelled as ``cancel()`` does (torn
down past ``cancel_grace``) and ends ``budget``, with the cap in ``limit``, the output so far
(``output_final`` False, or True when the agent answers ``end_turn`` all the same: its output is then its
final message) and the usage reported. A turn the agent
completed itself, whose last report (the prompt response's usage) passed a cap, stays ``completed``: the
agent said so and its answer is whole; ``spent`` shows the overshoot, and the next turn is not sent.
What the run has left is sent in ``session/new``'s ``_meta`` (:data:`~subagent.types.BUDGET_META_KEY`),
for an agent that enforces it itself (``subagent serve``).

Where children run: the provider's ``transport`` (:mod:`subagent.acp.transports`; a local child
process by default) opens each one; its exit diagnosis, ``run.pid`` and ``run.kill()`` go through
the transport's channel. A transport whose children do not see this host's files
(``local_files`` False) gets no fs and no terminals offered to its agents.

Isolation (``request.isolation``, ``capabilities.isolation``: ``worktree`` and ``copy`` where the
transport's children see this host's files, or where the transport makes workspaces itself, over SSH and
Ray (``transport.isolation_runner()``, and ``for_workspace()`` to place the agent beside its workspace);
refused before any child exists over any other): before the child is spawned the run makes its workspace
where the agent runs (:func:`~subagent.isolation.open_workspace`: a git worktree of its cwd's repository
on branch ``subagent/<run id>``, or a copy of its cwd), and a failure fails the start (``START_FAILED``,
saying why) with no child spawned. The child's cwd (its process's and ``session/new``'s) is the
workspace, and so are the roots of its file-system sandbox and its terminals' cwd: ``fs_roots`` and the
request's additional directories inside the repository are moved to the same places in the workspace, so
a write through the client anywhere in the parent's checkout is refused. At the end of every turn, the
first and each ``resume()``, what the child left is committed on its branch (the turn's prompt is the
message) and the result's ``workspace`` says what it changed. Once the child is gone (dispose, or a
failed start), the request's ``cleanup`` policy applies; a start cancelled or disposed while its
workspace was being made leaves nothing. See :mod:`subagent.isolation` for what a killed parent leaves,
and how the next start recovers it.

Resuming (issue 26: ``SubagentService.resume`` with a run journal): the provider is a
:class:`~subagent.types.ReopenableProvider`, and each run a :class:`~subagent.types.CheckpointedRun`.
:meth:`AcpProvider.describe_agent` says the command, transport and cwd (no secret), and
:meth:`AcpRun.checkpoint` the session's id and cwd once it exists. :meth:`AcpProvider.reopen` starts a new
child of the same command on the same transport and reopens that session, with ``session/resume`` where
the agent offers it, else ``session/load`` (whose replay of the earlier conversation is kept apart, in
:attr:`AcpRun.replayed`), before the resumed run's first turn. The agent keeps the conversation (Claude Code
writes it under ``CLAUDE_CONFIG_DIR``, by default ``~/.claude``, as each message goes): a child killed with
its parent loses only the turn it was in. A run that cannot be reopened is refused with
``RESUME_UNSUPPORTED`` saying why: before any child exists (no session, another agent or transport, an
isolated workspace, which was closed with its child), or once its agent is asked (it offers neither method,
or does not know the session).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import shlex
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeGuard

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec

from subagent import _structured
from subagent._acp_stop_reasons import FROM_ACP
from subagent._budget_meta import budget_to_meta
from subagent._outcome import DisposeOnExit, Outcome
from subagent._usage_codec import usage_from_acp
from subagent.acp import schema
from subagent.acp._elicitation import ElicitationAnswer, ElicitationQuestion
from subagent.acp._errors import (
    AcpError,
    AgentExitedError,
    AgentSpawnError,
    AuthenticationRequiredError,
    MessageTooLargeError,
    ProtocolError,
    RequestError,
    SessionSettingError,
)
from subagent.acp._modes import ModeChoice, mode_advice
from subagent.acp.client import (
    DEFAULT_IDLE_CLOSE_GRACE,
    DEFAULT_MAX_KEPT_UPDATES,
    DEFAULT_MAX_OUTPUT_CHARS,
    AcpClient,
    AcpSession,
    SubagentSession,
    TurnMessage,
    TurnOutput,
    TurnResult,
    describe_request_error,
    spawn_agent,
)
from subagent.acp.connection import DEFAULT_MAX_LINE_BYTES
from subagent.acp.handlers import (
    FsSandbox,
    PermissionCallback,
    PermissionDecision,
    PermissionOutcome,
    PermissionPolicy,
    PermissionQuestion,
    allows_everything,
    permission_policy,
    policy_name,
)
from subagent.acp.transports._channel import ExitInfo, Transport
from subagent.acp.transports._local import LocalTransport
from subagent.acp.transports._schemes import transport_from_url
from subagent.budget import BudgetAccount, account_for, budget_result
from subagent.isolation import CoreRunner, IsolationError, IsolationSettings, Workspace, open_workspace
from subagent.observability import _telemetry as telemetry
from subagent.providers._acp_budget import (
    BudgetPolicy,
    RunCharges,
    UsageReport,
    checked_usage_reports,
    enforceable_caps,
    known_usage_reports,
)
from subagent.providers._acp_subagents import SubagentRuns
from subagent.types import (
    BUDGET_FIELDS,
    BUDGET_META_KEY,
    LINEAGE_META_KEY,
    ErrorCode,
    LimitHit,
    ResumePoint,
    StopReason,
    SubagentCapabilities,
    SubagentError,
    SubagentRequest,
    SubagentResult,
    Usage,
    WorkspaceChange,
)

if TYPE_CHECKING:
    from subagent.acp.terminals import TerminalHost

__all__ = [
    "DEFAULT_CANCEL_GRACE",
    "DEFAULT_MAX_CONCURRENT",
    "DEFAULT_MAX_KEPT_UPDATES",
    "DEFAULT_MAX_OUTPUT_CHARS",
    "DEFAULT_READY_TIMEOUT",
    "SESSION_CLOSE_TIMEOUT",
    "AcpProvider",
    "AcpRun",
    "prompt_size_error",
]

logger = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT: float = 60.0
"""Spawn to a ready session. Generous: ``npx`` may install the agent on first use."""

DEFAULT_CANCEL_GRACE: float = 5.0
"""How long a cancelled turn may take to answer ``cancelled`` before the child is torn down."""

DEFAULT_MAX_CONCURRENT: int = 8
"""Children alive at once per provider. Each is a whole agent process (often node plus a model
client, hundreds of MB) with its own rate-limited API traffic: 8 keeps a laptop or a 2-4 core CI
runner responsive, and a fan-out of 100 queues instead of thrashing or failing."""

SESSION_CLOSE_TIMEOUT: float = 2.0
"""How long disposing a run waits for the agent's answer to ``session/close`` before closing its stdin
anyway. An agent frees a session in milliseconds; one that does not answer (busy, or stuck) must not
hold the teardown up longer than the grace its stdin close gets anyway."""

_IDLE_POLL_WHILE_ASKING: float = 0.5
"""While a permission question waits, how often the inactivity watchdog looks again (the clock is
paused then, so this only bounds how late it notices the answer)."""

_run_ids = itertools.count(1)

_MIN_SECRET_CHARS = 8
"""The shortest environment value redacted from the agent's error text. Shorter ones are flags
("1", "true"), not credentials, and would blank out ordinary words."""

_PROMPT_LINE_OVERHEAD: int = len(
    b'{"jsonrpc":"2.0","id":0,"method":"session/prompt","params":'
    b'{"sessionId":"","prompt":[{"type":"text","text":}]}}'
)
"""The session/prompt request around a text prompt, with an empty session id and the shortest
request id (the line limit does not count the newline): a prompt whose JSON string is longer than
the limit minus this cannot be sent."""

_MAX_JSON_BYTES_PER_CHAR = 6
"""The most bytes one character takes as a JSON string: six for an escape such as ``\\u001f``
(UTF-8 takes at most four)."""


def prompt_size_error(prompt: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> str | None:
    """Why ``prompt`` cannot be sent in one message of at most ``max_line_bytes`` bytes (the
    agent connection's line limit), or None when it may fit.

    The check counts the prompt as JSON (escapes included) plus the smallest ``session/prompt``
    envelope, so a prompt it passes can still be refused by a few bytes (the session id is the
    agent's choice); the connection then refuses to send it.
    """
    if len(prompt) * _MAX_JSON_BYTES_PER_CHAR + _PROMPT_LINE_OVERHEAD <= max_line_bytes:
        return None  # certainly fits: no need to encode it
    size = len(msgspec.json.encode(prompt)) + _PROMPT_LINE_OVERHEAD
    if size <= max_line_bytes:
        return None
    return (
        f"the prompt is {size:,} bytes as a session/prompt message, over the {_bytes(max_line_bytes)} "
        "limit on one message to the agent (max_line_bytes)"
    )


def _bytes(count: int) -> str:
    if count >= 1024 * 1024 and count % (1024 * 1024) == 0:
        return f"{count:,}-byte ({count // (1024 * 1024)} MiB)"
    return f"{count:,}-byte"


class AcpProvider:
    """Runs each child as an ACP agent process (``command``), one session per run.

    Args:
        command: the agent's argv, e.g. ``["npx", "@agentclientprotocol/claude-agent-acp"]``.
        name: the registry name.
        env: variables merged over this process's environment for the child.
        cwd: the session's working directory when the request gives none (default: ours).
        permission: ``"allow"``, ``"deny"`` (default), a policy, or an async callback.
        fs_roots: where the agent may read and write through the client (default: the session cwd).
        fs: advertise and serve ``fs/read_text_file`` and ``fs/write_text_file`` (default). False
            advertises no file-system capability and answers every ``fs/*`` request -32601
            (method not found): a workaround for an agent whose use of the client's fs is broken,
            which then reads and writes files itself.
        terminal: serve ``terminal/*`` (off by default); commands run confined to the same roots.
        auth_method: the auth method id to use when the agent demands authentication.
        subagents: advertise ACP's (unstable) ``subagents`` capability (default): the agent's own
            child sessions (Claude Code's ``Task``, Codex's ``spawn_agent``) are kept on the run
            (:attr:`AcpRun.subagents`, :meth:`AcpRun.cancel_subagent`) and reported to the run's update
            listeners as runs of its tree, the way ``subagent serve`` reports its own (a tool call
            with ``_meta["subagent-seam/run"]``). Their questions and file requests meet the same
            permission policy and sandbox. False: the agent is told nothing of the capability.
        model: the model name to price the agent's tokens by, for a ``max_cost`` cap over an agent that
            reports tokens but no cost: looked up in the service's :class:`~subagent.budget.PriceTable`.
            Default: the current value of the agent's config option of category ``model``. Such a cap
            is refused before any child exists when the service has no price table, and fails the start
            when the table has no price for the model.
        ready_timeout: spawn to a ready session, in seconds. It starts at the spawn, after the run
            got its concurrency slot: time spent queued behind other runs never counts.
        idle_timeout: default inactivity timeout of a turn (a request's ``timeout`` overrides it).
        structured_output: offer ``output_schema`` (the answer is parsed and validated as JSON).
        cancel_grace: how long a cancelled turn may take before the child is torn down.
        on_stderr_line: called with each line the agent writes to stderr, as it arrives (the last
            64 KiB are kept for error messages either way).
        process_options: teardown timings and other options of
            :func:`~subagent.acp.transports.open_agent_process`, for the local transport only.
        transport: where each child runs: a :class:`~subagent.acp.transports.Transport`, or a URL
            for :func:`~subagent.acp.transports.transport_from_url` (``"local"``,
            ``"ssh://[user@]host[:port]"``...). Default: a local child process. ``cwd`` (default:
            ours) is a path on the host the child runs on. A transport whose ``local_files`` is
            False runs the child where this host's files are not: its agent is offered no fs and
            no terminals (``fs``, ``fs_roots`` and ``terminal`` are ignored) and reads and writes
            files itself, where it runs.
        idle_close_grace: how long a child whose turn is over gets to exit after its stdin closes,
            before SIGTERM (default :data:`~subagent.acp.client.DEFAULT_IDLE_CLOSE_GRACE`, 0.3 s):
            agents that exit on EOF are gone well within it, and one that ignores EOF (both Codex
            adapters) costs no more. A child disposed mid-turn gets the full
            ``stdin_close_timeout`` of the transport (2 s by default). None: always the full one.
        max_concurrent: how many children may exist at once (None: no limit). Runs past it wait
            for a slot, first come first served; see the module docstring.
        max_line_bytes: the longest message (one JSON line) sent to or accepted from the agent.
        max_kept_updates: how many session updates a run keeps readable as ``run.updates``, the
            most recent (None: all); older ones are dropped and counted in ``run.updates_dropped``.
        max_output_chars: the longest final message a turn may have (None: no limit); past it
            the turn is cancelled and its result is ``error`` (see the module docstring).
        mode: the session mode to switch to once the session exists, before the first prompt
            (``session/set_mode``, or the agent's ``mode`` config option). A mode the agent does not
            offer fails the start (``START_FAILED``, listing the modes it does offer). None (default):
            the agent's own, except that a session that starts in a mode which approves tool calls by
            itself, under any policy but ``allow``, is moved to the agent's asking mode where
            :data:`~subagent.acp._modes.KNOWN_AGENT_MODES` knows it, and warned about otherwise.
        config_options: config options to set, by id, after the mode and before the first prompt
            (``session/set_config_option``): a select option's value id, or a boolean. An id or a
            value the agent does not offer fails the start, listing what it offers.
        reports_usage: what the agent reports of its spending: ``"tokens"``, ``"cost"``, both, or
            neither (empty). It decides the budget caps the provider enforces (``capabilities.budget``:
            ``max_seconds`` and ``max_tool_calls`` always, ``max_tokens`` with tokens, ``max_cost``
            with cost, ``max_turns`` never). None (default): looked up by the command in
            :data:`~subagent.providers._acp_budget.KNOWN_AGENT_USAGE` (``subagent serve`` reports
            tokens); an agent it does not know reports nothing.
        isolation: where the workspaces of requests with ``isolation`` are made (branch prefix, root, copy
            limit; None: :class:`~subagent.isolation.IsolationSettings` defaults, worktrees in the
            repository's own git directory). Offered where the transport's children see this host's files,
            or the transport makes workspaces where they run; see the module docstring. Some agents treat a
            path inside a git directory as protected (Claude Code asks, or in ``auto`` mode consults its
            classifier, before each write there): a ``root`` outside the repository spares them that.

    Raises:
        ValueError: ``command`` is empty or a string, or an argument, the cwd or an environment
            value contains a NUL character, or an environment name is empty or contains ``=`` or
            NUL (none of them could reach the child intact); a limit is out of range; the
            transport URL is malformed or names no available transport; ``process_options`` are
            given with a transport other than the local one; ``reports_usage`` names something other
            than tokens and cost.
        TypeError: an argument, environment name or value is not a string; ``transport`` is
            neither a URL nor a transport; ``reports_usage`` is a string.
    """

    inherits_parent_context = False

    def __init__(
        self,
        command: Sequence[str | os.PathLike[str]],
        *,
        name: str = "acp",
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        permission: Literal["allow", "deny"] | PermissionPolicy | PermissionCallback = "deny",
        fs_roots: Sequence[str | os.PathLike[str]] | None = None,
        fs: bool = True,
        terminal: bool = False,
        auth_method: str | None = None,
        ready_timeout: float = DEFAULT_READY_TIMEOUT,
        idle_timeout: float | None = None,
        structured_output: bool = False,
        cancel_grace: float = DEFAULT_CANCEL_GRACE,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        on_stderr_line: Callable[[str], object] | None = None,
        process_options: Mapping[str, Any] | None = None,
        idle_close_grace: float | None = DEFAULT_IDLE_CLOSE_GRACE,
        max_concurrent: int | None = DEFAULT_MAX_CONCURRENT,
        max_kept_updates: int | None = DEFAULT_MAX_KEPT_UPDATES,
        max_output_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS,
        transport: Transport | str | None = None,
        mode: str | None = None,
        config_options: Mapping[str, str | bool] | None = None,
        subagents: bool = True,
        reports_usage: Iterable[UsageReport] | None = None,
        model: str | None = None,
        isolation: IsolationSettings | None = None,
    ) -> None:
        if isinstance(command, str) or not command:
            raise ValueError("command must be a non-empty argv list, e.g. ['npx', 'some-acp-agent']")
        _check_limit("max_concurrent", max_concurrent, minimum=1)
        _check_limit("max_kept_updates", max_kept_updates, minimum=0)
        _check_limit("max_output_chars", max_output_chars, minimum=0)
        _check_limit("max_line_bytes", max_line_bytes, minimum=1, optional=False)
        self.command = [_path_text(part, f"command[{index}]") for index, part in enumerate(command)]
        self.name = name
        self.env = _checked_env(env) if env is not None else None
        # Values the agent's error text must never show us back verbatim (see _MIN_SECRET_CHARS).
        self._secrets = sorted(
            {value for value in (self.env or {}).values() if len(value) >= _MIN_SECRET_CHARS},
            key=len,
            reverse=True,  # a longer value containing a shorter one is redacted whole
        )
        self.cwd = _path_text(cwd, "cwd") if cwd is not None else None
        self.permission = permission
        self.fs_roots = (
            [_path_text(root, f"fs_roots[{index}]") for index, root in enumerate(fs_roots)]
            if fs_roots is not None
            else None
        )
        self.fs = fs
        self.terminal = terminal
        self.auth_method = auth_method
        self.ready_timeout = ready_timeout
        self.idle_timeout = idle_timeout
        self.cancel_grace = cancel_grace
        self.max_line_bytes = max_line_bytes
        self.max_kept_updates = max_kept_updates
        self.max_output_chars = max_output_chars
        self.on_stderr_line = on_stderr_line
        self.process_options = dict(process_options or {})
        self.transport = _resolve_transport(transport, self.process_options)
        """Where each child runs (see :mod:`subagent.acp.transports`)."""
        self.idle_close_grace = idle_close_grace
        self.mode = mode
        self.model = model
        """The model the agent's tokens are priced as (by the service's price table) when it reports no
        cost (None: its config option of category ``model``, as it stands once the session exists)."""
        self.subagents = subagents
        """Whether the client advertises ACP's ``subagents`` capability and shows the child sessions the
        agent announces as runs of the run's tree (see :attr:`AcpRun.subagents`)."""
        self.config_options: dict[str, str | bool] = dict(config_options or {})
        for value in self.config_options.values():
            if not isinstance(value, str | bool):
                raise TypeError(f"config_options maps option ids to str or bool values, not {value!r}")
        self.reports_usage: frozenset[UsageReport] = (
            known_usage_reports(self.command)
            if reports_usage is None
            else checked_usage_reports(reports_usage)
        )
        """What the agent reports of its spending, which decides the budget caps enforced."""
        self.isolation = isolation if isolation is not None else IsolationSettings()
        """Where the children's workspaces are made, for requests with ``isolation``."""
        self.capabilities = SubagentCapabilities(
            output_schema=structured_output,
            additional_directories=True,
            budget=enforceable_caps(self.reports_usage),
            # The workspace is made where the agent runs: here, or by the transport's own runner there.
            isolation=frozenset({"worktree", "copy"})
            if self.transport.local_files or callable(getattr(self.transport, "isolation_runner", None))
            else frozenset(),
        )
        if getattr(self.transport, "fs_roots", None) is not None and not allows_everything(permission):
            # The transport serves fs/* where the agent runs (RayTransport(fs_roots=...)): the permission
            # policy stays here, so those writes are confined to the roots but not put to it.
            logger.warning(
                "provider %r: %s serves the agent's file writes on its node, inside its fs_roots, without "
                "asking the permission policy (%s); only the agent's own permission questions reach it",
                name,
                self.transport.name,
                policy_name(permission_policy(permission)),
            )
        self._max_concurrent = max_concurrent
        self._running = 0  # runs holding a slot: their child is being spawned, or alive
        self._queue: deque[AcpRun] = deque()  # runs waiting for a slot, in arrival order

    def __repr__(self) -> str:
        where = "" if isinstance(self.transport, LocalTransport) else f", transport={self.transport.name!r}"
        return f"AcpProvider(name={self.name!r}, command={shlex.join(self.command)!r}{where})"

    @property
    def max_concurrent(self) -> int | None:
        """How many children may exist at once (None: no limit). Fixed at construction."""
        return self._max_concurrent

    @property
    def running(self) -> int:
        """Runs holding a slot now: their child is being spawned, is starting, or is in a turn (an
        idle child between turns holds none). Never more than :attr:`max_concurrent`."""
        return self._running

    @property
    def waiting(self) -> int:
        """Runs queued for a slot now; none of them has a child yet."""
        return len(self._queue)

    def start(self, request: SubagentRequest, task_group: anyio.abc.TaskGroup) -> AcpRun:
        """Create the run and start its child in ``task_group``; readiness comes later.

        Past :attr:`max_concurrent` the run is queued instead (``run.queued``); it spawns its child
        when a slot frees, in the order runs were started.
        """
        self._check_request(request)
        return self._launch(AcpRun(self, request), task_group)

    def describe_agent(self) -> dict[str, Any]:
        """How this provider runs its children, for a run journal: ``{"command": [argv], "transport":
        <the transport's name: a URL such as "local" or "ssh://user@host:22" that
        :func:`~subagent.acp.transports.transport_from_url` takes, or the name of one that has none>,
        "cwd": <the provider's cwd, or None>}``. JSON-able, and never a secret: environment values are not
        in it, and one that appears in an argument or the cwd is replaced by ``[redacted]``."""
        return {
            "command": [self._redacted(part) for part in self.command],
            "transport": self.transport.name,
            "cwd": None if self.cwd is None else self._redacted(self.cwd),
        }

    def reopen(self, request: SubagentRequest, point: ResumePoint, task_group: anyio.abc.TaskGroup) -> AcpRun:
        """Start a new child that reopens the ACP session of the run ``point`` describes and runs
        ``request.prompt`` as its next turn, the run's first; the run then goes on as any other.

        The handshake reopens the checkpoint's session (``point.checkpoint["sessionId"]``, in its
        ``cwd``) instead of opening a new one: with ``session/resume`` when the agent offers it, else with
        ``session/load``, whose replay of the earlier conversation is kept apart (:attr:`AcpRun.replayed`):
        it is never part of the run's :attr:`~AcpRun.updates`, output or usage. The session is then
        configured (mode, config options) as :meth:`start` configures a new one.

        A run whose agent died before it gave the run a session (none of its turns ran) starts afresh: a
        new session, as :meth:`start` makes one.

        Raises:
            SubagentError: ``RESUME_UNSUPPORTED``, before any child exists, when the run completed turns
                but has no session, ran another command or on another transport (its session is that agent's),
                or asks for ``isolation`` (its workspace was closed with its child); the checks of
                :meth:`start` otherwise. A child whose agent offers neither ``session/resume`` nor
                ``session/load``, or answers them with an error (an unknown session), fails its readiness
                with ``RESUME_UNSUPPORTED`` (the agent's answer quoted) and is torn down.
        """
        reopening = self._reopening(request, point)
        self._check_request(request)
        return self._launch(AcpRun(self, request, reopening), task_group)

    def _reopening(self, request: SubagentRequest, point: ResumePoint) -> _Reopening | None:
        """What reopening ``point`` takes (None: a new session, for a run whose agent never gave it one), or
        the RESUME_UNSUPPORTED saying why it cannot be done here."""

        def refuse(why: str) -> SubagentError:
            return SubagentError(ErrorCode.RESUME_UNSUPPORTED, why, provider=self.name)

        run = point.run_id
        checkpoint = point.checkpoint
        session_id = checkpoint.get("sessionId") if checkpoint is not None else None
        mine = self.describe_agent()
        theirs = point.agent.get("command")
        if theirs != mine["command"]:
            ran = (
                f"`{shlex.join(theirs)}`"
                if isinstance(theirs, list) and all(isinstance(part, str) for part in theirs)
                else "an agent its journal does not name"
            )
            raise refuse(
                f"run {run} ran {ran}, this provider runs `{shlex.join(mine['command'])}`: its session "
                "belongs to that agent"
            )
        where = point.agent.get("transport")
        if where != mine["transport"]:
            ran_on = where if isinstance(where, str) else "a transport its journal does not name"
            raise refuse(
                f"run {run} ran its agent on {ran_on}, this provider runs it on {mine['transport']}: its "
                "session is kept where its agent ran"
            )
        if not isinstance(session_id, str) or not session_id:
            if point.turns_completed == 0:
                # Its agent died before it gave the run a session: no turn of it ran, so a new session
                # (a new run's start) loses nothing and runs nothing twice.
                return None
            raise refuse(f"run {run} never got a session from its agent")
        if request.isolation is not None:
            raise refuse(
                f"run {run} ran in an isolated workspace (isolation={request.isolation!r}), which was closed "
                "with its child: a resumed session would not find the files it worked on"
            )
        assert checkpoint is not None
        cwd = checkpoint.get("cwd")
        return _Reopening(run, session_id, cwd if isinstance(cwd, str) and cwd else None)

    def _redacted(self, text: str) -> str:
        """``text`` with each of the child's environment values (see ``_secrets``) in it replaced."""
        for secret in self._secrets:
            text = text.replace(secret, "[redacted]")
        return text

    def _check_request(self, request: SubagentRequest) -> None:
        """Refuse what this provider cannot do for ``request``, before any child exists."""
        if request.output_schema is not None:
            _structured.check_schema(request.output_schema)
        if request.budget is not None:
            # The service refuses these before calling us; a provider used on its own does it here.
            for cap in request.budget.fields():
                if not self.capabilities.supports(cap):
                    raise SubagentError(
                        ErrorCode.UNSUPPORTED_CAPABILITY,
                        f"provider {self.name!r} cannot enforce {cap!r}: {_why_not(cap, self.reports_usage)}",
                        provider=self.name,
                        feature=cap,
                    )
        if request.isolation is not None and request.isolation not in self.capabilities.isolation:
            # The service refuses it before calling us; a provider used on its own does it here.
            raise SubagentError(
                ErrorCode.UNSUPPORTED_CAPABILITY,
                f"provider {self.name!r} cannot give a child isolation={request.isolation!r}: its transport "
                f"({self.transport.name}) runs the agent where this host's files are not, and makes no "
                "workspace there",
                provider=self.name,
                feature="isolation",
            )
        self._check_pricing(request)

    def _launch(self, run: AcpRun, task_group: anyio.abc.TaskGroup) -> AcpRun:
        """Admit ``run`` (or queue it for a slot) and start its life in ``task_group``."""
        # Admitted here, synchronously, rather than in the run's task: tasks may first run in any
        # order (trio shuffles them), and slots must go out in the order runs were started.
        self._admit(run)
        try:
            task_group.start_soon(run._main, name=f"acp run {run.id}")
        except BaseException:
            self._leave(run)
            raise
        return run

    # -- slots: a FIFO admission queue, driven synchronously by the runs --------------------------

    def _check_pricing(self, request: SubagentRequest) -> None:
        """Refuse a ``max_cost`` cap over an agent reporting no cost when nothing could price its tokens."""
        if "cost" in self.reports_usage:
            return
        account = request.account
        chain = list(account.chain()) if account is not None else []
        capped = (request.budget is not None and request.budget.max_cost is not None) or any(
            a.asked.max_cost is not None for a in chain
        )
        if not capped:
            return
        prices = account.prices if account is not None else None
        why = None
        if prices is None:
            why = "and the service has no price table to price its tokens by (SubagentService(prices=...))"
        elif self.model is not None and prices.price(self.model) is None:
            why = f"and the service's price table has no price for its model {self.model!r}"
        if why is not None:
            raise SubagentError(
                ErrorCode.UNSUPPORTED_CAPABILITY,
                f"provider {self.name!r} cannot enforce 'max_cost': its agent reports no cost, {why}",
                provider=self.name,
                feature="max_cost",
            )

    def _admit(self, run: AcpRun) -> None:
        limit = self._max_concurrent
        if limit is None or (self._running < limit and not self._queue):
            self._running += 1
            run._grant_slot()
        else:
            run._queued = True
            self._queue.append(run)

    def _leave(self, run: AcpRun) -> None:
        """Give back ``run``'s slot (handing it to the first waiting run), or its place in the queue.
        Idempotent."""
        if run._holds_slot:
            run._holds_slot = False
            if self._queue:
                # Handed over directly, never put back in the pool: a run started later cannot
                # take it before the one that has waited longest.
                self._queue.popleft()._grant_slot()
            else:
                self._running -= 1
        elif run._queued:
            run._queued = False
            self._queue.remove(run)


@dataclasses.dataclass(frozen=True, slots=True)
class _Reopening:
    """The session a run reopens (:meth:`AcpProvider.reopen`): whose it was, its id, and its cwd (None: the
    checkpoint had none, and the run's cwd is found as a new run's is)."""

    run_id: str
    session_id: str
    cwd: str | None


class AcpRun(DisposeOnExit):
    """One ACP child: its process, its session, its turns. Offers ``resume`` (no ``send_message``:
    ACP has no way to inject a message into a running turn)."""

    def __init__(
        self, provider: AcpProvider, request: SubagentRequest, reopening: _Reopening | None = None
    ) -> None:
        self.id = f"{provider.name}-{next(_run_ids)}"
        self.provider = provider
        self.request = request
        self._reopening = reopening  # the journaled run whose session this run reopens, if it does
        self.reopened_with: Literal["session/resume", "session/load"] | None = None
        """How the run's session was reopened (:meth:`AcpProvider.reopen`), once it was: ``session/resume``
        or ``session/load``; None for a run that opened a new session."""
        self.command_line = shlex.join(provider.command)
        self.updates: deque[schema.SessionUpdate] = deque(maxlen=provider.max_kept_updates)
        """The session updates of every turn, in order: the most recent ``max_kept_updates`` of
        them (all, up to that many); :attr:`updates_dropped` counts the older ones let go."""
        self._update_count = 0
        self.permissions_denied = 0
        """How many of the agent's permission questions the policy refused in the last turn that
        ended (see :attr:`~subagent.acp.client.TurnResult.permissions_denied`). A turn that ends
        ``cancelled`` although nobody cancelled it, with this above 0, is an agent that gave up
        after a refusal: Codex offers only a reject option that aborts the turn."""
        self.last_denied: str | None = None
        """The title (or tool call id) of the last permission question refused in that turn."""
        self._output: TurnOutput | None = None  # the final message of the current (or last) turn
        self.agent: schema.InitializeResponse | None = None
        """The agent's ``initialize`` answer, once it arrived."""
        self.session_id: str | None = None
        self.exit_info: ExitInfo | None = None
        """How the child process ended, once it did."""
        self.authentication_failed = False
        """Whether the start failed because the agent demanded authentication (none configured, or
        the configured method was refused)."""
        self._client: AcpClient | None = None
        self._session: AcpSession | None = None
        self._ready: Outcome[None] = Outcome()
        self._result: Outcome[SubagentResult] = Outcome()  # the first turn's
        self._stop = anyio.Event()
        self._done = anyio.Event()
        self._main_scope = anyio.CancelScope()
        self._turn_lock = anyio.Lock()
        self._turn_scope: anyio.CancelScope | None = None
        self._turn_done: anyio.Event | None = None
        self._cancelling = False
        self._disposing = False
        self._child_lost: str | None = None  # why the child can take no more turns, once it cannot
        self._child_lost_event = anyio.Event()
        self._child_exited = anyio.Event()
        self._additional_directories: list[str] = []  # the request's, made absolute against the cwd
        self._killed = False
        self._listeners: list[Callable[[schema.SessionUpdate], object]] = []
        self._subagent_listeners: list[Callable[[SubagentSession, schema.SessionUpdate], object]] = []
        self._watched: set[str] = set()  # the subagent sessions whose updates reach those listeners
        # Slot bookkeeping, driven by the provider (see AcpProvider._admit / _leave).
        self._queued = False
        self._holds_slot = False
        self._slot_granted = anyio.Event()
        account = account_for(request)
        self._charges = RunCharges(account) if account is not None else None
        self.workspace: Workspace | None = None
        """The run's isolated workspace (``request.isolation``), once it is made, just before the child is
        spawned: ``workspace.cwd`` is the child's cwd. Closed (its cleanup policy applied) once the child
        is gone."""
        # The prompt of the last turn whose work is not committed yet (cut short, or git failed): the
        # message of the commit the workspace's close makes of it.
        self._turn_prompt: str | None = None
        self._workspace_closed = False

    def __repr__(self) -> str:
        state = (
            ("disposed" if self._stop.is_set() else "done")
            if self._done.is_set()
            else "settled"
            if self._result.is_set()
            else "queued"
            if self._queued
            else "running"
        )
        return f"<AcpRun {self.id!r} {self.command_line!r} session={self.session_id!r} {state}>"

    def _grant_slot(self) -> None:
        self._queued = False
        self._holds_slot = True
        self._slot_granted.set()

    @property
    def queued(self) -> bool:
        """Whether the run waits for a concurrency slot: to spawn its child, or for a resumed turn."""
        return self._queued

    def on_update(self, listener: Callable[[schema.SessionUpdate], object]) -> Callable[[], None]:
        """Call ``listener`` with each session update as it arrives (for live progress); returns a
        disposer. Listeners run in order on the connection's task; one that raises is logged."""
        self._listeners.append(listener)

        def dispose() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return dispose

    def on_subagent_update(
        self, listener: Callable[[SubagentSession, schema.SessionUpdate], object]
    ) -> Callable[[], None]:
        """Call ``listener`` with each update of the agent's subagent sessions (the child, and its
        update: its own tool calls and messages, which are not the run's); returns a disposer.
        Listeners run in order on the connection's task; one that raises is logged."""
        self._subagent_listeners.append(listener)

        def dispose() -> None:
            if listener in self._subagent_listeners:
                self._subagent_listeners.remove(listener)

        return dispose

    async def wait_child_exited(self) -> None:
        """Return once this run's child process is gone and reaped (a crash, a lost connection, a
        cancel that needed teardown, or dispose), or at once if it never had one."""
        await self._child_exited.wait()

    @property
    def pid(self) -> int | None:
        """The pid of the local process running the agent, once it was spawned: the agent's own
        (also its process group id) with the local transport; what the transport spawned here
        otherwise (the ``ssh`` client), or None where it spawned nothing here."""
        client = self._client
        return None if client is None or client.process is None else client.process.pid

    def kill(self) -> None:
        """Kill the agent's whole process tree at once (see `Channel.kill`), if it has one yet.

        An emergency stop: `cancel()` and `dispose()` stay the way to end a run; a `dispose()` already
        waiting out its grace returns as soon as it sees the tree gone.
        """
        self._killed = True  # nothing more is said to it (no session/close)
        client = self._client
        if client is not None and client.process is not None:
            client.process.kill()

    @property
    def last_activity(self) -> float | None:
        """When the agent last sent anything for this run's session (``time.monotonic()``), if it has one."""
        return None if self._session is None else self._session.last_activity

    @property
    def pending_permissions(self) -> int:
        """How many of the agent's permission questions wait for the policy's answer now."""
        return 0 if self._session is None else self._session.pending_permissions

    @property
    def update_count(self) -> int:
        """How many session updates the agent has sent for this run so far, dropped ones included."""
        return self._update_count

    @property
    def updates_dropped(self) -> int:
        """How many of the oldest updates are no longer in :attr:`updates` (past ``max_kept_updates``)."""
        return self._update_count - len(self.updates)

    @property
    def modes(self) -> list[ModeChoice]:
        """The modes the agent offers for the session (empty before it is ready, or when it offers none)."""
        return self._session.offered_modes if self._session is not None else []

    @property
    def current_mode(self) -> str | None:
        """The session's current mode, kept current from the agent's ``current_mode_update``."""
        return self._session.current_mode_id if self._session is not None else None

    @property
    def config_options(self) -> list[schema.SessionConfigOption]:
        """The agent's config options and their current values, kept current from its
        ``config_option_update`` (empty before the session is ready, or when it offers none)."""
        return list(self._session.config_options or ()) if self._session is not None else []

    @property
    def output(self) -> str:
        """The final message of the turn running now, so far, or of the last turn: what its result's
        ``output`` is or will be (exact however many updates it had, up to ``max_output_chars``)."""
        return "" if self._output is None else self._output.text

    @property
    def replayed(self) -> list[schema.SessionUpdate]:
        """The earlier conversation the agent replayed when ``session/load`` reopened the run's session
        (the most recent ``max_kept_updates`` updates of it): never part of :attr:`updates`, of a turn's
        output or of its usage. Empty for any other run."""
        session = self._session
        return list(session.replayed) if session is not None else []

    def checkpoint(self) -> dict[str, Any] | None:
        """What a new child needs to continue this run (:meth:`AcpProvider.reopen`): ``{"sessionId": ...,
        "cwd": <the session's cwd, as sent to the agent>}``, or None before the session exists. The agent
        keeps the conversation itself, so this is the same after every turn."""
        session = self._session
        if session is None:
            return None
        return {"sessionId": session.session_id, "cwd": session.cwd}

    @property
    def messages(self) -> list[TurnMessage]:
        """The agent messages of the turn running now, or of the last turn, in order: the final
        message (the result's ``output``) last, the ones before it (a warning, narration before a
        tool call) readable here. At most ``max_kept_updates`` of the earlier ones are kept, the
        most recent, holding at most ``max_output_chars`` characters together."""
        return [] if self._output is None else self._output.messages

    # -- the SubagentRun protocol ------------------------------------------------------------------

    async def started(self) -> None:
        """Return once the child answered initialize and session/new.

        Raises:
            SubagentError: ``START_FAILED`` (with exit status and stderr tail) or ``DISPOSED``.
        """
        await self._ready.wait()

    async def result(self) -> SubagentResult:
        """The first turn's outcome; child-level failures are ``error`` results, not exceptions."""
        return await self._result.wait()

    async def cancel(self) -> None:
        """Ask the agent to stop the running turn (``session/cancel``; pending permission questions
        are answered ``cancelled``) and wait up to the grace for it; tear the child down if it does
        not comply. Before readiness, abandons the start instead (a queued run never spawns):
        ``started()`` then raises ``START_FAILED`` and the result is ``cancelled``."""
        if self._done.is_set():
            return
        if not self._ready.is_set():
            self._cancelling = True
            self._main_scope.cancel()
            await self._done.wait()
            return
        session, turn_done = self._session, self._turn_done
        if session is None or turn_done is None or turn_done.is_set():
            return  # no turn is running
        self._cancelling = True
        await session.cancel()
        with anyio.move_on_after(self.provider.cancel_grace):
            await turn_done.wait()
            return
        logger.warning(
            "agent `%s` did not stop within %.1f s of session/cancel; tearing it down",
            self.command_line,
            self.provider.cancel_grace,
        )
        self._lose_child("the agent ignored session/cancel and was torn down")
        if self._turn_scope is not None:
            self._turn_scope.cancel()
        self._stop.set()
        await self._done.wait()

    @property
    def subagents(self) -> list[SubagentSession]:
        """The child sessions the agent announced (its own subagents, at any depth), in the order it
        announced them; empty when ``subagents`` is off or the agent has none."""
        client = self._client
        return list(client.subagent_sessions.values()) if client is not None else []

    async def cancel_subagent(self, session_id: str) -> None:
        """Ask the agent to stop the current work of its subagent session ``session_id`` alone
        (``session/cancel`` for that child); its ``idle`` snapshot then reports the stop.

        Raises:
            AgentCapabilityError: the agent does not permit cancelling that child (it did not grant it
                the ``cancel`` capability); nothing is sent.
            LookupError: the agent announced no such subagent session on this run.
        """
        client = self._client
        session = client.session(session_id) if client is not None else None
        if session is None or session.subagent is None:
            raise LookupError(f"run {self.id!r} has no subagent session {session_id!r}")
        await session.cancel()

    def _watch_subagent(self, client: AcpClient, child: SubagentSession, _ended: bool) -> None:
        """A ``SubagentListener``: pass the updates of a child announced just now to the listeners of
        :meth:`on_subagent_update` (its announcement comes before any of its traffic: none is missed)."""
        session = client.session(child.session_id)
        if session is None or child.session_id in self._watched:
            return
        self._watched.add(child.session_id)

        def tell(update: schema.SessionUpdate) -> None:
            for listener in tuple(self._subagent_listeners):
                try:
                    listener(child, update)
                except Exception:
                    logger.exception("subagent update listener of run %r raised; ignored", self.id)

        session.on_update(tell)

    def _tell_listeners(self, update: schema.SessionUpdate) -> None:
        """Give the run's update listeners an update the run made itself (a subagent's run row)."""
        for listener in tuple(self._listeners):  # a snapshot: a listener may dispose itself
            try:
                listener(update)
            except Exception:
                logger.exception("update listener of run %r raised; ignored", self.id)

    async def dispose(self) -> None:
        """Tear the child down (close stdin, wait, SIGTERM the group, wait, SIGKILL, reap) and
        return once nothing of the run is left. Idempotent."""
        self._stop.set()
        self._disposing = True
        if self._ready.is_set() and self._queued:
            # A resume() queued for a slot: leave the queue and wake it (it then raises DISPOSED).
            self.provider._leave(self)
            self._slot_granted.set()
        if not self._ready.is_set():
            self._main_scope.cancel()  # do not wait for a slot or a handshake to finish first
        elif not self._result.is_set() and self._turn_scope is not None:
            # The first turn runs in _main. Stopping only the turn keeps the connection up, so the
            # agent is told (session/cancel) and its stdin closed at once; cancelling the whole
            # connection would leave that notice stuck on a cancelled writer until its timeout.
            self._turn_scope.cancel()
        with anyio.CancelScope(shield=True):
            await self._done.wait()

    async def resume(self, prompt: str) -> SubagentResult:
        """Run another turn in the same session and return how it ended.

        Raises:
            SubagentError: ``DISPOSED`` once the run is disposed; ``START_FAILED`` if it never started.
        """
        await self.started()
        await self._result.wait_settled()
        disposed = SubagentError(
            ErrorCode.DISPOSED, f"run {self.id!r} is disposed", provider=self.provider.name
        )
        if self._stop.is_set():
            raise disposed
        if self._child_lost is not None:
            # The child died (and was let go): another turn cannot run, and the death is the answer.
            return SubagentResult(output="", stop_reason="error", error=self._child_lost)
        if self._done.is_set():
            raise disposed
        session = self._session
        assert session is not None
        await self._take_slot_for_turn()
        try:
            if self._stop.is_set():
                raise disposed  # disposed while queued for a slot
            return await self._run_turn(session, prompt, structured=False)
        finally:
            self.provider._leave(self)

    async def _take_slot_for_turn(self) -> None:
        """Queue for a slot (first come, first served) before another turn; dispose() wakes us."""
        self._slot_granted = anyio.Event()
        self.provider._admit(self)
        try:
            await self._slot_granted.wait()
        except BaseException:
            self.provider._leave(self)  # a cancelled caller gives up its place or its slot
            raise

    # -- the child's life, in the service's task group ---------------------------------------------

    async def _main(self) -> None:
        try:
            with self._main_scope:
                # A queued run waits here; cancel() and dispose() cancel the wait, so it never spawns.
                await self._slot_granted.wait()
                await self._live()
        except AgentSpawnError as exc:
            self._fail_start(f"{exc}")
        except Exception as exc:
            # This task runs in the service's task group: a bug here must fail this run, not the service.
            logger.exception("run %r of agent `%s` failed unexpectedly", self.id, self.command_line)
            message = f"internal error in the ACP provider: {type(exc).__name__}: {exc}"
            self._fail_start(message)
            self._result.settle(SubagentResult(output=self.output, stop_reason="error", error=message))
        finally:
            if self._queued:
                when = "while it waited for a concurrency slot"
            elif self._client is None:
                when = "before its agent was spawned"
            else:
                when = "before the agent was ready"
            # The child (if any) is reaped by now: its slot goes to the next waiting run.
            self.provider._leave(self)
            if not self._ready.is_set() and self._cancelling and not self._stop.is_set():
                # cancel() before readiness abandons the start: no child, and a cancelled result.
                self._result.settle(SubagentResult(output="", stop_reason="cancelled"))
                self._fail_start(f"the start was cancelled {when}")
            elif not self._ready.is_set():
                self._fail_start(f"run {self.id!r} was disposed {when}", code=ErrorCode.DISPOSED)
            if not self._result.is_set():
                self._result.fail(
                    SubagentError.disposed(self.id, "before its turn ended", provider=self.provider.name)
                )
            self._child_exited.set()  # also when no child was ever spawned
            if self.workspace is not None:
                with anyio.CancelScope(shield=True):
                    await self._close_workspace(self.workspace)
            self._done.set()

    async def _live(self) -> None:
        provider = self.provider
        too_large = prompt_size_error(self.request.prompt, provider.max_line_bytes)
        if too_large is not None:
            # Known before any child exists: spawning one could only end in this same error.
            self._fail_start(f"agent `{self.command_line}` was not started: {too_large}")
            return
        reopening = self._reopening
        if reopening is not None and reopening.cwd is not None:
            cwd = reopening.cwd  # the session's own: the agent may keep its sessions by directory
        else:
            cwd = self.request.cwd or provider.cwd or os.getcwd()
        if "\0" in cwd:
            # No process can be given that directory: fail as a spawn would, before trying one.
            self._fail_start(
                f"agent `{self.command_line}` was not started: its cwd {cwd!r} has a NUL character"
            )
            return
        asked = cwd  # the cwd the run asked for; its child's is in its workspace when isolated
        if self.request.isolation is not None:
            try:
                # Shielded: a workspace made is a workspace closed (by _main), even when the start is
                # cancelled or disposed while git makes it.
                with anyio.CancelScope(shield=True):
                    self.workspace = await open_workspace(
                        cwd,
                        self.id,
                        self.request.isolation,
                        settings=provider.isolation,
                        cleanup=self.request.cleanup,
                        runner=None
                        if provider.transport.local_files
                        else _isolation_runner(provider.transport),
                    )
            except IsolationError as exc:
                self._fail_start(f"agent `{self.command_line}` was not started: {exc}")
                return
            await anyio.lowlevel.checkpoint_if_cancelled()  # disposed meanwhile: no child is spawned
        workspace = self.workspace
        if workspace is not None:
            # The child works in the workspace; the sandbox's roots inside the source are moved there.
            cwd = workspace.cwd
        extra, missing = _additional_directories(
            asked,
            self.request.additional_directories,
            check=provider.transport.local_files,
            workspace=workspace,
        )
        if missing is not None:
            # The sandbox could not have it as a root, and the agent would be told of a place that is not.
            self._fail_start(
                f"agent `{self.command_line}` was not started: additional directory {missing!r} "
                "is not an existing directory"
            )
            return
        self._additional_directories = extra
        roots = provider.fs_roots or [asked]
        if workspace is not None:
            roots = [workspace.map_path(root) for root in roots]
        try:
            # A child that does not see this host's files is served neither files nor terminals here.
            sandbox = FsSandbox([*roots, *extra]) if provider.transport.local_files else None
        except ValueError as exc:  # a root that is no directory (in a workspace: one git does not track)
            self._fail_start(f"agent `{self.command_line}` was not started: {exc}")
            return
        terminals: TerminalHost | None = None
        if provider.terminal and sandbox is not None:
            from subagent.acp.terminals import TerminalHost

            terminals = TerminalHost(sandbox=sandbox, cwd=cwd)
            await terminals.__aenter__()
        subagent_runs: SubagentRuns | None = None
        try:
            async with (
                spawn_agent(
                    provider.command,
                    env=provider.env,
                    cwd=cwd,
                    permission=_traced(
                        provider.permission
                        if self._charges is None
                        else BudgetPolicy(permission_policy(provider.permission), self._charges)
                    ),
                    fs=sandbox if provider.fs else None,
                    terminals=terminals,
                    max_line_bytes=provider.max_line_bytes,
                    max_kept_updates=provider.max_kept_updates,
                    max_output_chars=provider.max_output_chars,
                    on_stderr_line=provider.on_stderr_line,
                    transport=_transport_for(provider.transport, self.workspace),
                    idle_close_grace=provider.idle_close_grace,
                    subagents=provider.subagents,
                ) as client,
                self._session_closed_on_exit(client),
            ):
                self._client = client
                subagent_runs = SubagentRuns(provider.name, self._tell_listeners, telemetry.current_context())
                client.on_subagent(subagent_runs)
                client.on_subagent(functools.partial(self._watch_subagent, client))
                session = await self._handshake(client, cwd)
                if session is None:
                    return
                self._session = session
                self._take_early_updates(session)
                keep = self.request.on_checkpoint
                if keep is not None and self._reopening is None:
                    # The new session is kept (journaled) before the prompt is sent: a parent killed
                    # during this turn leaves a session to reopen, not a run to start afresh.
                    checkpoint = self.checkpoint()
                    if checkpoint is not None:
                        await keep(checkpoint)
                self._ready.settle(None)
                first = await self._run_turn(session, self.request.prompt, structured=True)
                # The turn is over: an idle child works no more, so its slot goes to the next run.
                self.provider._leave(self)
                if self._disposing:
                    return  # disposed during the turn: the result is DISPOSED (settled by _main)
                self._result.settle(first)
                await self._keep_for_resume(client)
        finally:
            if subagent_runs is not None:
                subagent_runs.close()
            if self._client is not None:
                self._record_exit(self._client)
            self._child_exited.set()  # spawn_agent has returned: the process group is reaped
            if terminals is not None:
                # Not handed our exception: its task group would wrap it in an exception group.
                await terminals.__aexit__(None, None, None)

    @contextlib.asynccontextmanager
    async def _session_closed_on_exit(self, client: AcpClient) -> AsyncIterator[None]:
        """On the way out, before the agent's stdin closes: ``session/close`` the run's session."""
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):  # bounded: see SESSION_CLOSE_TIMEOUT
                await self._close_session(client)

    async def _close_session(self, client: AcpClient) -> None:
        """Tell an agent that advertises ``session/close`` that the session is over, so that one that keeps
        sessions in memory (a long-lived agent, or a remote one) frees it now rather than when its process
        dies. Sent once, only while the agent lives, bounded by :data:`SESSION_CLOSE_TIMEOUT`; an error
        answer or silence is logged and ignored: the teardown goes on either way."""
        session = self._session
        process = client.process
        if (
            session is None
            or session.closed
            or self._killed
            or not client.supports_close
            or self._child_lost is not None
            or client.connection.closed_error is not None
            or (process is not None and process.exit_info() is not None)
        ):
            return
        with anyio.move_on_after(SESSION_CLOSE_TIMEOUT) as scope:
            try:
                if session.in_turn:
                    await session.cancel()  # a turn still running is cancelled first, as without close
                await session.close()
            except RequestError as exc:
                logger.info("agent `%s` answered session/close with %s", self.command_line, self._quote(exc))
            except AcpError as exc:
                logger.info("session/close to agent `%s` failed: %s", self.command_line, exc)
        if scope.cancelled_caught:
            logger.info(
                "agent `%s` did not answer session/close within %.1f s; closing its stdin",
                self.command_line,
                SESSION_CLOSE_TIMEOUT,
            )

    def _take_early_updates(self, session: AcpSession) -> None:
        """The updates the agent sent before answering ``session/new`` (its commands, mode, usage) are the
        run's first updates: kept in :attr:`updates` and given to the listeners, like a turn's."""
        for update in session.early_updates:
            self.updates.append(update)
            self._update_count += 1
            for listener in tuple(self._listeners):
                try:
                    listener(update)
                except Exception:
                    logger.exception("update listener of run %r raised; ignored", self.id)

    async def _keep_for_resume(self, client: AcpClient) -> None:
        """Keep the child for ``resume()`` until the run is disposed or the child is lost: it
        exited, or a turn found its connection gone.

        A lost child is let go at once rather than when someone disposes the run: it can take no
        more turns, and it holds a concurrency slot that a waiting run can use. ``resume()`` then
        answers with why it was lost.
        """
        async with anyio.create_task_group() as watchers:

            async def let_go_on(event: anyio.Event) -> None:
                await event.wait()
                watchers.cancel_scope.cancel()

            watchers.start_soon(let_go_on, self._stop)
            watchers.start_soon(let_go_on, self._child_lost_event)
            if client.process is not None:
                exit_info = await client.process.wait_exit()
                self._lose_child(str(exit_info))
            await anyio.sleep_forever()
        if not self._stop.is_set():
            # A resume() turn in flight learns of the death from its own connection first, with
            # the full diagnosis, before leaving here closes that connection.
            async with self._turn_lock:
                pass

    def _session_meta(self) -> dict[str, Any] | None:
        """The child's place in the chain and the budget it has left, for an agent that can honour them
        (``subagent serve``), and the run's trace context (W3C ``traceparent``) when spans are recorded."""
        meta: dict[str, Any] = {}
        lineage = self.request.lineage
        if lineage is not None and lineage.depth_budget is not None:
            meta[LINEAGE_META_KEY] = {"depth": lineage.depth, "depthBudget": lineage.depth_budget}
        account = self._charges.account if self._charges is not None else None
        if account is not None and account.capped:
            meta[BUDGET_META_KEY] = budget_to_meta(account.remaining())
        return telemetry.inject(meta or None)

    async def _handshake(self, client: AcpClient, cwd: str) -> AcpSession | None:
        """initialize, then session/new, or session/resume or session/load for a reopened run
        (authenticating once when demanded); None after a failure."""
        provider = self.provider
        step = schema.INITIALIZE  # the request in flight, to name the one the agent refused
        try:
            with anyio.fail_after(provider.ready_timeout):
                self.agent = await client.initialize()
                opening = self._opening_method(self.agent)
                if opening is None:
                    self._fail_start(
                        f"agent `{self.command_line}` offers neither session/resume nor session/load",
                        code=ErrorCode.RESUME_UNSUPPORTED,
                    )
                    return None
                step = opening
                try:
                    session = await self._open_session(client, opening, cwd)
                except AuthenticationRequiredError as exc:
                    if provider.auth_method is None:
                        raise
                    logger.info(
                        "agent `%s` asks for authentication: using %r",
                        self.command_line,
                        provider.auth_method,
                    )
                    step = schema.AUTHENTICATE
                    await client.authenticate(provider.auth_method)
                    step = opening
                    session = await self._open_session(client, opening, cwd)
                    del exc
                step = "the session's settings"
                await self._configure(session)
        except TimeoutError:
            self._fail_start(
                f"agent `{self.command_line}` was not ready within {provider.ready_timeout:g} s"
                f"{_stderr_suffix(client)}"
            )
            return None
        except AuthenticationRequiredError as exc:
            self.authentication_failed = True
            advice = (
                "configure auth_method with one of them" if provider.auth_method is None else "it was refused"
            )
            said = ""
            if isinstance(exc.__cause__, RequestError) and exc.__cause__.data is not None:
                said = f" (the agent answered {self._quote(exc.__cause__)})"
            self._fail_start(f"agent `{self.command_line}`: {exc}{said}; {advice}{_stderr_suffix(client)}")
            return None
        except AgentExitedError as exc:
            self._fail_start(str(exc))
            return None
        except SessionSettingError as exc:
            self._fail_start(f"agent `{self.command_line}`: {exc}")
            return None
        except RequestError as exc:
            reopening = self._reopening
            if reopening is not None and step in (schema.SESSION_RESUME, schema.SESSION_LOAD):
                # The agent's own word that it cannot continue that session (it does not know it, say).
                self._fail_start(
                    f"agent `{self.command_line}` could not reopen session {reopening.session_id!r} of run "
                    f"{reopening.run_id}: it answered {step} with {self._quote(exc)}{_stderr_suffix(client)}",
                    code=ErrorCode.RESUME_UNSUPPORTED,
                )
                return None
            self._fail_start(
                f"agent `{self.command_line}` failed its handshake: it answered {step} with "
                f"{self._quote(exc)}{_stderr_suffix(client)}"
            )
            return None
        except AcpError as exc:
            self._fail_start(
                f"agent `{self.command_line}` failed its handshake at {step}: {exc}{_stderr_suffix(client)}"
            )
            return None
        if not self._price_tokens(session):
            return None
        self.session_id = session.session_id
        if self._reopening is not None:
            logger.info(
                "run %r reopened session %r of run %s with %s (%d update(s) replayed)",
                self.id,
                session.session_id,
                self._reopening.run_id,
                opening,
                len(session.replayed),
            )
        return session

    def _opening_method(self, agent: schema.InitializeResponse) -> str | None:
        """The request that opens the run's session: ``session/new``; for a reopened run ``session/resume``
        (no replay) where the agent offers it, else ``session/load``; None when it offers neither."""
        if self._reopening is None:
            return schema.SESSION_NEW
        capabilities = agent.agent_capabilities
        if capabilities.session_capabilities.resume is not None:
            return schema.SESSION_RESUME
        if capabilities.load_session:
            return schema.SESSION_LOAD
        return None

    async def _open_session(self, client: AcpClient, method: str, cwd: str) -> AcpSession:
        """Send ``method`` (see :meth:`_opening_method`) for the run's session, with its ``_meta`` and
        additional directories."""
        meta = self._session_meta()
        extra = self._additional_directories
        reopening = self._reopening
        if reopening is None or method == schema.SESSION_NEW:
            return await client.new_session(cwd, meta=meta, additional_directories=extra)
        if method == schema.SESSION_RESUME:
            session = await client.resume_session(
                reopening.session_id, cwd, meta=meta, additional_directories=extra
            )
            self.reopened_with = "session/resume"
        else:
            session = await client.load_session(
                reopening.session_id, cwd, meta=meta, additional_directories=extra
            )
            self.reopened_with = "session/load"
        return session

    def _price_tokens(self, session: AcpSession) -> bool:
        """For an agent that reports no cost, price its tokens by the service's table (its model: the
        provider's ``model``, else its config option of category ``model``). False, the start failed,
        when a ``max_cost`` cap needs the price and the table has none for the model."""
        charges = self._charges
        if charges is None or "cost" in self.provider.reports_usage or charges.account.prices is None:
            return True
        model = self.provider.model
        if model is None:
            options = session.config_options or ()
            chosen = [
                o.current_value
                for o in options
                if isinstance(o, schema.SessionConfigSelect) and o.category == "model"
            ]
            model = chosen[0] if chosen else None
        prices = charges.account.prices
        charges.price, charges.currency = prices.price(model), prices.currency
        capped = any(a.asked.max_cost is not None for a in charges.account.chain())
        if charges.price is None and capped:
            known = (
                "it names no model (no config option of category model)"
                if model is None
                else (f"the service's price table has no price for its model {model!r}")
            )
            self._fail_start(
                f"agent `{self.command_line}` cannot be held to max_cost: it reports no cost, and {known}"
            )
            return False
        return True

    async def _configure(self, session: AcpSession) -> None:
        """Apply the provider's mode and config options; then, when the policy is not ``allow`` and
        nobody chose a mode, keep the agent from approving its own tool calls (see ``mode``).

        Raises:
            SessionSettingError: a mode, option or value the agent does not offer.
            RequestError: the agent refused a setting it offers.
        """
        provider = self.provider
        if provider.mode is not None:
            await session.select_mode(provider.mode)
        if provider.config_options:
            await session.configure(provider.config_options)
        if provider.mode is not None or allows_everything(provider.permission):
            return
        mode_options = {choice.config_id for choice in session.offered_modes if choice.config_id is not None}
        if mode_options & provider.config_options.keys():
            return  # the mode was chosen as a config option: that choice wins too
        agent_info = self.agent.agent_info if self.agent is not None else None
        advice = mode_advice(
            agent_info.name if agent_info is not None else None,
            session.offered_modes,
            session.current_mode_id,
        )
        if advice is None:
            return
        policy = policy_name(permission_policy(provider.permission))
        current = advice.current.id
        if advice.switch_to is not None:
            await session.select_mode(advice.switch_to.id)
            logger.warning(
                "agent `%s` started its session in mode %r, which approves tool calls by itself; switched "
                "it to %r, which asks, so that the permission policy (%s) decides (choose a mode with "
                "--mode ID, or AcpProvider(mode=...))",
                self.command_line,
                current,
                advice.switch_to.id,
                policy,
            )
            return
        logger.warning(
            "agent `%s` runs its session in mode %r, which may approve tool calls by itself without "
            "asking: the permission policy (%s) cannot hold for what it does unasked (its writes through "
            "the client are still refused); choose a mode that asks with --mode ID (modes: %s)",
            self.command_line,
            current,
            policy,
            ", ".join(choice.id for choice in session.offered_modes),
        )

    def _quote(self, error: RequestError) -> str:
        """The agent's error for one of our messages: bounded, and with the child's environment values
        (API keys, typically) redacted should the agent echo them."""
        return describe_request_error(error, secrets=self.provider._secrets)

    async def _run_turn(self, session: AcpSession, prompt: str, *, structured: bool) -> SubagentResult:
        async with self._turn_lock:
            self._turn_prompt = prompt
            result = await self._answer(session, prompt, structured=structured)
            if self.workspace is None or self._workspace_closed:
                return result
            # Every turn's work is committed at its end, whatever ended it (shielded in Workspace.commit).
            change = await self._commit(self.workspace, prompt)
            if change is None:
                return result
            self._turn_prompt = None
            return dataclasses.replace(result, workspace=change)

    async def _commit(self, workspace: Workspace, prompt: str) -> WorkspaceChange | None:
        """Commit the turn's work on the workspace's branch and say what the child changed (None, logged,
        when git failed: the work stays in the workspace, and its close tries again)."""
        try:
            change = await workspace.commit(prompt)
        except IsolationError:
            logger.exception("run %r: committing the turn's work in %s failed", self.id, workspace.path)
            return None
        return change

    async def _close_workspace(self, workspace: Workspace) -> None:
        """Once the child is gone: commit what it left since the last commit (a turn cut short, a terminal's
        background job), then apply the cleanup policy."""
        try:
            # A resume() turn in flight ends with its child gone, and commits its work, first.
            async with self._turn_lock:
                self._workspace_closed = True
                if self._turn_prompt is not None:
                    await self._commit(workspace, self._turn_prompt)
                await workspace.close()
        except Exception:  # the run must end whatever git did; close() logs its own failures
            logger.exception("run %r: closing its workspace %s failed", self.id, workspace.path)

    async def _answer(self, session: AcpSession, prompt: str, *, structured: bool) -> SubagentResult:
        """One turn, and its structured output's repairs when ``structured``."""
        schema_wanted = self.request.output_schema if structured else None
        text = prompt if schema_wanted is None else _structured.ask_for_json(prompt, schema_wanted)
        result = await self._one_turn(session, text)
        if schema_wanted is None or result.stop_reason != "completed":
            return result
        return await _structured.accept_or_repair(
            result,
            schema_wanted,
            lambda repair: self._one_turn(session, repair),
            who=f"agent `{self.command_line}`",
        )

    async def _one_turn(self, session: AcpSession, text: str) -> SubagentResult:
        if self._disposing:
            # Disposed between turns (before a structured-output repair, or while a resume() waited
            # for the turn lock): start no new turn. No checkpoint from here to the turn's scope.
            return SubagentResult(output="", stop_reason="cancelled", error=f"run {self.id!r} is disposed")
        too_large = prompt_size_error(text, self.provider.max_line_bytes)
        if too_large is not None:
            return SubagentResult(output="", stop_reason="error", error=f"not sent: {too_large}")
        charges = self._charges
        if charges is None:
            return await self._turn(session, text, None)
        account = charges.account
        spent_already = account.check()
        if spent_already is not None:
            # Spent before this turn (a resume after a stop, or by the tree meanwhile): nothing is sent.
            self._output = TurnOutput(self.provider.max_output_chars)
            return self._budget_stopped(SubagentResult(output="", stop_reason="cancelled"), spent_already)
        charges.begin_turn()
        stopped: list[LimitHit] = []  # the cap that stopped the turn while it ran
        exhausted = anyio.Event()

        def on_exhausted(hit: LimitHit) -> None:
            # Called on whichever task charged (the connection's, a sibling's): the turn is stopped
            # from a watcher of its own.
            if not stopped:
                stopped.append(hit)
                exhausted.set()

        stop_listening = account.on_exhausted(on_exhausted)
        try:
            result = await self._turn(session, text, charges, exhausted)
        finally:
            stop_listening()
        if result.stop_reason == "error" and self._output is not None and self._output.truncated:
            return budget_result(result, account)  # the output limit stopped it first
        if result.usage is not None:
            # The prompt response's counts: what the turn's updates had not reported yet.
            charges.end_turn(result.usage)
        if stopped:
            # The agent may still answer end_turn (it finished as the cancel went out, or ignored it):
            # the budget stopped the run all the same, and the output is then its final message.
            final = result.stop_reason == "completed"
            return self._budget_stopped(result, stopped[0], usage=charges.turn_usage(), final=final)
        if result.stop_reason == "budget" and result.limit is not None:
            # The agent enforced the budget sent to it: ours, as it was left to this run.
            hit = account.exhausted or dataclasses.replace(result.limit, owner=account.owner)
            return self._budget_stopped(result, hit)
        if account.exhausted is not None and result.stop_reason != "completed":
            return self._budget_stopped(result, account.exhausted)
        # Completed is the agent's word: an answer whose last report passed a cap stands whole (the spent
        # shows by how much), as an in-process child's final answer does; the next turn is not sent.
        return budget_result(result, account)

    def _budget_stopped(
        self, result: SubagentResult, hit: LimitHit, *, usage: Usage | None = None, final: bool = False
    ) -> SubagentResult:
        """``result`` as a turn stopped by the budget: ``budget``, the cap, the output and usage kept."""
        charges = self._charges
        assert charges is not None
        currency = charges.account.spent().cost_currency
        stopped = SubagentResult(
            output=result.output,
            stop_reason="budget",
            error=f"stopped by its budget: {hit.describe(currency)}",
            usage=result.usage if result.usage is not None else usage,
            limit=hit,
            output_final=final,
        )
        return budget_result(stopped, charges.account)

    async def _turn(
        self,
        session: AcpSession,
        text: str,
        charges: RunCharges | None,
        exhausted: anyio.Event | None = None,
    ) -> SubagentResult:
        """One prompt, watched: the inactivity timeout, the output limit, and with ``charges`` the run's
        budget (each update charged; ``exhausted`` set cancels the turn; the deadline exhausts it)."""
        self._output = output = TurnOutput(
            self.provider.max_output_chars, max_messages=self.provider.max_kept_updates
        )
        overflowed = anyio.Event()
        listeners = self._listeners

        def record(update: schema.SessionUpdate) -> None:
            # Runs for every update of the turn, so it does only what the client cannot: the client
            # already appended the update to `self.updates` (bounded: the oldest falls out) and fed
            # `output`, whose length is therefore known here.
            self._update_count += 1
            if charges is not None:
                charges.take(update)
            if output.truncated and not overflowed.is_set():
                overflowed.set()
            if listeners:
                self._tell_listeners(update)

        timeout = self.request.timeout if self.request.timeout is not None else self.provider.idle_timeout
        timed_out = False
        failure: AgentExitedError | RequestError | ProtocolError | msgspec.MsgspecError | None = None
        turn: TurnResult | None = None
        self._cancelling = False
        self._turn_done = turn_done = anyio.Event()
        async with anyio.create_task_group() as watchers:
            if timeout is not None:

                async def on_timeout() -> None:
                    nonlocal timed_out
                    timed_out = True
                    await self.cancel()

                watchers.start_soon(_watch_idle, session, timeout, on_timeout)

            async def on_overflow() -> None:
                # Not from `record`: that runs on the connection's task, which must go on reading
                # for the turn to end.
                await overflowed.wait()
                await self.cancel()

            watchers.start_soon(on_overflow)
            if charges is not None and exhausted is not None:

                async def on_budget() -> None:
                    await exhausted.wait()
                    await self.cancel()

                watchers.start_soon(on_budget)
                if charges.account.deadline is not None:
                    watchers.start_soon(_expire_at_deadline, charges.account)
            with anyio.CancelScope() as self._turn_scope:
                try:
                    turn = await session.prompt(
                        # The turn's trace context, so the agent's spans for it join the caller's trace.
                        text,
                        on_update=record,
                        output=output,
                        updates=self.updates,
                        meta=telemetry.inject(None),
                    )
                except (AgentExitedError, RequestError, ProtocolError, msgspec.MsgspecError) as exc:
                    # Caught here, inside the task group, so it is not wrapped in an exception group.
                    failure = exc
                finally:
                    turn_done.set()
                    watchers.cancel_scope.cancel()
        if output.truncated:
            # Whatever else then happened, this is why the turn ended.
            if isinstance(failure, AgentExitedError):
                self._lose_child(str(failure))
            limit = self.provider.max_output_chars
            return SubagentResult(
                output=output.text,
                stop_reason="error",
                error=f"the agent's message went past the output limit of {limit:,} characters "
                f"(max_output_chars), so the turn was cancelled; the output is cut at the limit",
            )
        if isinstance(failure, AgentExitedError):
            self._lose_child(str(failure))
            return SubagentResult(output=output.text, stop_reason="error", error=str(failure))
        if isinstance(failure, RequestError):
            return SubagentResult(
                output=output.text,
                stop_reason="error",
                error=f"agent `{self.command_line}` answered session/prompt with {self._quote(failure)}",
            )
        if isinstance(failure, MessageTooLargeError) and failure.outgoing:
            # Refused before a byte was sent (the check above counts no session id): nobody waits.
            return SubagentResult(
                output=output.text,
                stop_reason="error",
                error=f"not sent: the prompt is {failure.size:,} bytes as a session/prompt message, over "
                f"the {_bytes(failure.limit)} limit on one message to the agent (max_line_bytes)",
            )
        if failure is not None:
            # The answer to the prompt was too long to read, or was not a prompt response.
            return SubagentResult(
                output=output.text,
                stop_reason="error",
                error=f"agent `{self.command_line}`: session/prompt failed: {failure}",
            )
        if turn is None:
            # The agent ignored session/cancel and was torn down.
            reason: StopReason = "timeout" if timed_out else "cancelled"
            return SubagentResult(output=output.text, stop_reason=reason, error=self._child_lost)
        self.permissions_denied = turn.permissions_denied
        self.last_denied = turn.last_denied
        stop = FROM_ACP.get(turn.stop_reason, "error")
        error: str | None = None
        if timed_out and stop == "cancelled":
            stop = "timeout"
            error = f"inactive for more than {timeout:g} s" if timeout is not None else None
        usage = usage_from_acp(turn.usage)
        served_hit = _served_budget_hit(turn.meta)
        if served_hit is not None and stop != "completed":
            # An agent that enforces the budget it was sent (`subagent serve`) says which cap stopped it.
            return SubagentResult(
                output=turn.output,
                stop_reason="budget",
                error=f"stopped by its budget: {served_hit.describe()}",
                usage=usage,
                limit=served_hit,
                output_final=False,
            )
        return SubagentResult(output=turn.output, stop_reason=stop, error=error, usage=usage)

    # -- bookkeeping ---------------------------------------------------------------------------------

    def _fail_start(self, message: str, *, code: ErrorCode = ErrorCode.START_FAILED) -> None:
        if self._ready.is_set():
            return
        error = SubagentError(code, message, provider=self.provider.name)
        self._ready.fail(error)
        # A run that never started has no turn: its result fails the same way.
        self._result.fail(error)

    def _lose_child(self, why: str) -> None:
        """Record that the child can take no more turns (the first reason stays)."""
        if self._child_lost is None:
            self._child_lost = why
            self._child_lost_event.set()

    def _record_exit(self, client: AcpClient) -> None:
        if client.process is not None and self.exit_info is None:
            self.exit_info = client.process.exit_info()


def _traced(
    permission: Literal["allow", "deny"] | PermissionPolicy | PermissionCallback,
) -> Literal["allow", "deny"] | PermissionPolicy | PermissionCallback:
    """The permission policy, recording each question as a span when spans are recorded."""
    parent = telemetry.current_context()
    if parent is None:
        return permission
    return _TracedPolicy(permission_policy(permission), parent)


class _TracedPolicy:
    """A policy that records each question the agent asks as a ``permission_wait`` span, from the
    question to the answer, below the run's span (questions arrive on the connection's task)."""

    def __init__(self, inner: PermissionPolicy, parent: telemetry.Parent) -> None:
        self.inner = inner
        self.name = policy_name(inner)
        self._parent = parent

    async def elicit(self, question: ElicitationQuestion) -> ElicitationAnswer:
        """The inner policy's answer (a policy that cannot answer elicitations declines them)."""
        elicit = getattr(self.inner, "elicit", None)
        return ElicitationAnswer.decline() if elicit is None else await elicit(question)

    async def decide(self, question: PermissionQuestion) -> PermissionDecision:
        span = telemetry.start_span(
            "permission_wait",
            "internal",
            {
                "gen_ai.tool.call.id": telemetry.clip_id(question.tool_call_id),
                "subagent.permission.kind": telemetry.clip_id(question.kind),
            },
            self._parent,
        )
        outcome, failure = "cancelled", None
        try:
            decision = await self.inner.decide(question)
            if decision is not PermissionOutcome.CANCELLED:
                outcome = "denied" if decision.kind.startswith("reject") else "allowed"
            return decision
        except BaseException as exc:
            failure = telemetry.error_type(exc)
            raise
        finally:
            telemetry.set_attributes(span, {"subagent.permission.outcome": outcome})
            telemetry.end_span(span, failure)


async def _expire_at_deadline(account: BudgetAccount) -> None:
    """Exhaust ``account`` once its chain's deadline has passed (its listeners then stop the turn)."""
    while account.expire() is None:
        left = account.remaining().max_seconds
        if left is None:
            return
        await anyio.sleep(left)


async def _watch_idle(session: AcpSession, timeout: float, on_timeout: Any) -> None:
    """Call ``on_timeout`` after ``timeout`` seconds of silence; waiting on a permission answer is
    not silence."""
    while True:
        if session.pending_permissions:
            await anyio.sleep(min(timeout, _IDLE_POLL_WHILE_ASKING))
            continue
        remaining = session.last_activity + timeout - time.monotonic()
        if remaining <= 0:
            await on_timeout()
            return
        await anyio.sleep(remaining)


def _served_budget_hit(meta: Mapping[str, Any] | None) -> LimitHit | None:
    """The cap a prompt response's ``_meta`` says stopped the turn (``subagent serve``'s answer to a
    turn its budget stopped), if it says one in the expected shape."""
    raw = meta.get(BUDGET_META_KEY) if meta is not None else None
    if not isinstance(raw, Mapping):
        return None
    limit, allowed, spent, needed = (raw.get(key) for key in ("limit", "allowed", "spent", "needed"))
    if limit not in BUDGET_FIELDS or not _is_number(allowed) or not _is_number(spent):
        return None
    return LimitHit(
        limit=limit,
        allowed=float(allowed),
        spent=float(spent),
        needed=float(needed) if _is_number(needed) else None,
    )


def _is_number(value: object) -> TypeGuard[float]:
    """Whether ``value`` is a JSON number (a bool is not one)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _why_not(cap: str, reports: frozenset[UsageReport]) -> str:
    """Why an ACP child cannot be held to ``cap``, for the refusal."""
    if cap == "max_turns":
        return "an agent's model calls are not visible over ACP"
    said = " and ".join(sorted(reports)) if reports else "nothing"
    return f"its agent reports {said} of what it spends (reports_usage)"


def _isolation_runner(transport: Transport) -> CoreRunner | None:
    """A new runner of a transport whose agent runs elsewhere, to make one run's workspace there
    (``transport.isolation_runner()``, see :data:`~subagent.isolation.CoreRunner`); None when it cannot."""
    make = getattr(transport, "isolation_runner", None)
    runner: CoreRunner | None = make() if callable(make) else None
    return runner


def _transport_for(transport: Transport, workspace: Workspace | None) -> Transport:
    """The transport that runs the agent where its workspace is: a transport that places agents (Ray)
    offers ``for_workspace(workspace.data)``; the others run it there anyway."""
    place = getattr(transport, "for_workspace", None)
    if workspace is None or not callable(place):
        return transport
    placed: Transport = place(workspace.data)
    return placed


def _additional_directories(
    cwd: str, paths: Sequence[str], *, check: bool, workspace: Workspace | None = None
) -> tuple[list[str], str | None]:
    """A request's additional directories made absolute against the session's ``cwd`` (those inside an
    isolated run's source moved into its ``workspace``), and the first of them that is not an existing
    directory here (checked only when ``check``: a remote child's paths are on its own host)."""
    extra = [os.path.abspath(os.path.join(cwd, path)) for path in paths]
    if workspace is not None:
        extra = [workspace.map_path(path) for path in extra]
    if check:
        for path in extra:
            if not os.path.isdir(path):
                return extra, path
    return extra, None


def _resolve_transport(transport: Transport | str | None, process_options: Mapping[str, Any]) -> Transport:
    """The provider's transport: ``process_options`` configure the local one (the default)."""
    if transport is None or transport == "local":
        return LocalTransport(**process_options)
    resolved = transport_from_url(transport) if isinstance(transport, str) else transport
    if not isinstance(resolved, Transport):
        raise TypeError(f"transport must be a URL or a Transport, not {type(transport).__name__}")
    if process_options:
        raise ValueError(f"process_options configure the local transport; configure {resolved.name} itself")
    return resolved


def _check_limit(name: str, value: object, *, minimum: int, optional: bool = True) -> None:
    """A count limit is an int >= ``minimum`` (or None when ``optional``), checked as passed, typed or not."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        allowed = f"an int >= {minimum}" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _path_text(value: object, what: str) -> str:
    """``value`` (a str or path) as a str that can reach a child process: no NUL in it."""
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{what} must be a string or a path, not {type(value).__name__}")
    text = os.fspath(value)
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a text path, not {type(text).__name__}")
    if "\0" in text:
        raise ValueError(f"{what} contains a NUL character, which no program can receive: {text!r}")
    return text


def _checked_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as a dict whose every entry can reach the child as ``NAME=value``."""
    checked: dict[str, str] = {}
    for name, value in env.items():
        if not isinstance(name, str):
            raise TypeError(f"environment names must be strings, not {type(name).__name__}: {name!r}")
        if not isinstance(value, str):
            raise TypeError(
                f"environment variable {name!r} must have a string value, not {type(value).__name__}"
            )
        if not name or "=" in name or "\0" in name:
            raise ValueError(
                f"environment name {name!r} cannot be passed to a program: "
                "a name must be non-empty, with no '=' and no NUL character"
            )
        if "\0" in value:
            raise ValueError(f"environment variable {name!r} has a NUL character in its value")
        checked[name] = value
    return checked


def _stderr_suffix(client: AcpClient) -> str:
    process = client.process
    if process is None:
        return ""
    status = process.exit_info()
    if status is not None:
        return f" ({status})"
    tail = process.stderr_tail().strip()
    return f"; last stderr: {tail[-2000:]}" if tail else ""
