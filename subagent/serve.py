"""``subagent serve``: an in-process agent served as an ACP agent, so any ACP client can drive it.

Zed, our own :class:`~subagent.providers.acp.AcpProvider`, or any other ACP client spawns
``subagent serve`` and speaks ACP on its stdin/stdout; :class:`ServedAgent` answers with the
in-process runtime (:class:`~subagent.runtime.Agent`):

* ``initialize`` negotiates protocol version 1 and says honestly what is supported: text prompts,
  resource links and embedded text resources (turned into prompt text), ``session/close``; with a
  run journal also ``session/load``, ``session/resume`` and ``session/list`` (*Durable sessions*
  below); no images or audio, no MCP servers.
* ``session/new`` makes one runtime agent per session, whose id is the session id. Its tools are
  the model-facing ``subagent`` tool over a :class:`~subagent.service.SubagentService` the server
  owns, with the ``spawn`` and ``fork`` providers registered (same LLM, same agent registry), so
  the served agent can delegate to in-process children, with background delegation
  (:mod:`subagent.delegation`: the tool takes ``background: true`` and comes with its companion
  tools ``subagent_list``, ``_wait``, ``_send``, ``_cancel`` and ``_result``); plus any extra
  tools given.
* ``session/prompt`` runs one turn, then, while the session's background children are live or
  their notices unseen, one more turn each time they call for it (the notices are its prompt),
  all within the one prompt request, so the client sees the children's progress while the agent
  goes on: at most ``max_model_calls`` turns (then ``max_turn_requests``); the answer is the last
  turn's, the usage all of theirs. Background children still live when the prompt ends (a turn
  failed, or it was cancelled) are disposed then. Text streams as ``agent_message_chunk``; each
  tool call shows as a ``tool_call`` (``pending`` while its permission is asked, else
  ``in_progress``) and ends with a ``tool_call_update`` (``completed`` or ``failed``, with the text
  the model read). Tool calls of the session's subagents are shown too, as calls of the session
  (ids prefixed by the subagent's id). So is every run below the session (its children, their
  children, ...), as a tool call of its own (see *The tree of runs* below). Stop reasons map as
  follows:

  ==================  =====================================================================
  runtime             ACP answer
  ==================  =====================================================================
  ``completed``       ``end_turn``
  ``cancelled``       ``cancelled``
  ``max_tokens``      ``max_tokens``
  ``max_turns``       ``max_turn_requests``
  ``refusal``         ``refusal``
  ``budget``          ``max_tokens`` for a token cap, else ``max_turn_requests``; the cap in
                      ``_meta["subagent-seam/budget"]``
  ``error``           JSON-RPC error -32603, ``data: {"stopReason", "details"}``
  ==================  =====================================================================

  ACP has no stop reason for a failed turn, and a turn that ended with ``end_turn`` plus an error
  text would read as a success: a client (ours maps it to stop reason ``error`` with the
  diagnosis; Zed shows it as an error) must learn that the turn failed. The unstable ``usage``
  of the prompt response is sent when the model reported its token counts.
* Budgets: a client that sends a budget in ``session/new``'s ``_meta`` (``BUDGET_META_KEY``:
  ``{"maxTokens", "maxCost", "maxSeconds", "maxToolCalls", "maxTurns"}``, as
  :class:`~subagent.providers.acp.AcpProvider` sends what its run has left) caps the session's whole
  tree with it: one root :class:`~subagent.budget.BudgetAccount` per session, charged by the session's
  agent and, below it, by every run it delegates. A malformed budget is logged and ignored. A turn the
  budget stopped answers with what it said so far, and since ACP has no stop reason for it, with the
  limit the client is likeliest to read right: ``max_tokens`` for a token cap (ACP's "the maximum number
  of tokens"), ``max_turn_requests`` for the rest (the agent was allowed no more work this turn). Neither
  ``cancelled`` (the client asked for nothing), ``end_turn`` (a success) nor an error (the output so far
  is an answer) would be true. The cap itself goes in the response's ``_meta["subagent-seam/budget"]``:
  ``{"limit", "allowed", "spent", "needed"?}``, which our client reads back as the stop reason ``budget``. The
  session's spending is reported as before: tokens in the prompt response's ``usage`` (no cost).
* ``session/cancel`` aborts the turn at once (its answer is ``cancelled``) and disposes every
  subagent it started, in the background too; ``session/close`` does the same and then closes the
  session's agent.
* A tool that needs approval asks the client with ``session/request_permission`` (options
  ``allow_once`` and ``reject_once``) on the frozen invocation, and runs with exactly that
  invocation, or not at all. Subagents inherit the approver, so their questions reach the client
  too, in their parent session.

Tracing (:mod:`subagent.observability`, when a tracer provider is configured in this process): each
prompt is an ``invoke_agent subagent-seam`` span of kind SERVER, whose parent is the W3C trace
context (``traceparent``, ``tracestate``) the client put at the root of the prompt's ``_meta``, else
of its ``session/new``'s (as :class:`~subagent.providers.acp.AcpProvider` does): a served agent's
spans (its model calls, tool calls, subagents) join the caller's trace across processes. A
malformed trace context is ignored.

When the connection ends (the client closed stdin), every session's agent is closed and the
service disposes every subagent still running: nothing outlives :func:`serve`. End of input
ends everything at once: a request still being served then is never answered (the connection
cancels it), so a client keeps stdin open until it has its answers, as ACP clients do.

``depth_limit``: the ``subagent`` tool has no option to force a depth limit on the runs it
starts, so the server wraps it: with ``depth_limit=N`` every run started through it gets
``depth_limit`` at most N (a larger value the model asks for is lowered, a missing one set), and
the tool's description says so. The seam counts depth along the parent chain, so the limit holds
for the whole tree below each session.

The tree of runs: each run of the service that belongs to a session (its parent is the session's
agent, or a run that belongs to the session) is shown to the session's client as a tool call with
id ``run/<run id>``, kind ``other`` (a run is delegated work, like the ``subagent`` call that
started it, not the agent's own reasoning, which ``think`` would claim), and title
``<provider> subagent: <prompt excerpt>``: ``in_progress`` when the child is ready, a
``tool_call_update`` whose content is the heartbeat's line (``child alive, last update 3 s ago``)
at each ``subagent/progress``, and ``completed`` (with an excerpt of the child's last message) or
``failed`` (with its error) at its end. Every one of these updates repeats the title and carries
``_meta["subagent-seam/run"]`` (:data:`~subagent.types.RUN_META_KEY`): ``runId``, ``parentId``
(the session's id for the session's own children), ``provider``, ``depth`` below the session,
``state`` (``running``, ``completed``, ``failed``, ``cancelled``) and, once ended with one,
``stopReason``; at the end also ``elapsedSeconds`` (wall time) and ``usage`` (ACP's camelCase
counts, when the run reported any); so a client can draw the tree and add up its cost. Runs are
shown while a turn is reported; one still open when the turn ends is shown failed, like any call
left open.

Subagent sessions: to a client that advertised ACP's (unstable) ``subagents`` capability the runs
are not tool calls but sessions of their own (ACP's subagents draft): each is announced with a
``subagent_update`` before any of its traffic, its text, tool calls and permission questions go
under its id (the run's), each of its runs ends in one ``idle`` snapshot with its stop reason and
usage, ``session/cancel`` with its id cancels it alone, and an acp child's own children are relayed
below it. :mod:`subagent._served_subagents` says how, and why. Any other request aimed at a
subagent session's id is refused with -32602, as an unknown session's is.

Durable sessions: given a run journal (:mod:`subagent.journal`; ``subagent serve --journal PATH``,
on by default on the command line), a client reconnects to a session after ``serve`` restarts,
even after a SIGKILL:

* Each session is a run of the journal, provider ``serve``, recorded from its first prompt on (a
  session never prompted has nothing to continue, and is not recorded). Its session id is
  ``session-<journal id>``, so it is the same in every process (``subagent runs show <journal id>``
  shows it). The record's prompt is the first prompt, its request the session's ``cwd``; each
  prompt is a turn of the run (``running``, committed before the model is asked, then ``ended``
  with the last turn's stop reason, output and usage) whose checkpoint is the session agent's whole
  message log as the prompt left it (:mod:`subagent.runtime._log_codec`), committed before the
  prompt is answered: an answer the client got is never lost. A prompt that goes on while its
  background children work also keeps its log after each of its turns (committed before that
  turn's end is reported). A serve killed during a prompt loses what the prompt did since then
  (its record is marked ``interrupted`` by the next process that opens the journal); the
  conversation before it is kept.
* ``session/list`` lists the journal's sessions, newest first (by creation, so that pages stay
  put while sessions are used): ``sessionId``, ``cwd``, ``title`` (the first prompt, on one line,
  cut to 80 characters) and ``updatedAt`` (ISO 8601, UTC), filtered by ``cwd``, at most
  ``list_page_size`` a page, ``nextCursor`` the way on (an opaque token; one this agent did not
  give is refused with -32602).
* ``session/resume`` makes the session's agent again from its last checkpoint, taking the
  session over in the journal (the record's owner becomes this process), and answers: the next
  ``session/prompt`` continues the conversation, the model seeing the same log as before (the
  persona included, as it was then). ``session/load`` does the same, and first replays the log as
  ``session/update`` notifications: each user message a ``user_message_chunk``, each assistant text
  an ``agent_message_chunk`` (``messageId`` ``message-<index in the log>``), each tool call a
  ``tool_call`` (``in_progress``, its arguments as ``rawInput``) and its result a
  ``tool_call_update`` (``completed``, or ``failed`` when the text is an ``error: ...``, the
  runtime's convention). The persona is not replayed, nor what the log never held (the runs'
  rows, turn markers). A session open in this process is reopened as it is (``session/load``
  replays the log of its finished turns). The new ``cwd`` is the agent's from then on; the journal
  and the list keep the first one.
* An unknown session id (or a run of the journal that is not a served session) is refused with
  -32002 (resource not found), ``data: {"sessionId", "reason"}``; one whose prompt is running in
  another live process with -32602; a checkpoint the journal cannot give back with -32603.
* The session's subagents (its spawn, fork and acp children) are runs of the same journal (parent
  id: the session id) but are not continued: a serve killed while they worked leaves them
  ``interrupted``, and the resumed session starts none of them again. With background delegation
  its agent is told of each (those the server found interrupted when it opened) as a notice in its
  log, ``failed`` with the journal run to ``subagent resume``, which its next prompt's model reads.
* Without a journal none of this is advertised, ``session/load``, ``session/resume`` and
  ``session/list`` are answered -32601 (method not found), and nothing outlives the process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import math
import os
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Final, Literal, Self

import anyio
import anyio.abc
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from subagent._acp_stop_reasons import TO_ACP
from subagent._budget_codec import budget_to_json, limit_to_json, spend_to_json
from subagent._budget_meta import budget_from_meta
from subagent._journaling import usage_json
from subagent._served_subagents import (
    MAX_SUBAGENT_SESSIONS,
    ChildSessions,
    excerpt,
    retry_update,
    run_title,
)
from subagent._text import cut
from subagent._usage_codec import prompt_response_usage, usage_to_acp
from subagent._version import __version__
from subagent.acp import schema
from subagent.acp._errors import AcpError, MessageTooLargeError, RequestError, RpcErrorCode
from subagent.acp.agent import (
    AgentHandler,
    ClientPeer,
    PromptTurn,
    negotiate_protocol_version,
    serve_stdio,
)
from subagent.budget import BudgetAccount
from subagent.delegation._background import BackgroundOptions
from subagent.delegation._subagent_tool import COMPANION_ACTIONS, DEFAULT_TOOL_NAME, SubagentTool
from subagent.events import EventHub
from subagent.journal import JournalError, JournalState, RunJournal, RunRecord
from subagent.observability import _telemetry as telemetry
from subagent.providers.fork import ForkProvider
from subagent.providers.spawn import SpawnProvider
from subagent.runtime._inprocess_agent import (
    DEFAULT_MAX_MODEL_CALLS,
    Agent,
    AgentClosedError,
    AgentEvent,
    AgentRegistry,
    ToolCallFinished,
    ToolCallStarted,
    _UsageSum,
)
from subagent.runtime._llm import LlmAdapter
from subagent.runtime._log_codec import decode_log, encode_log, json_type
from subagent.runtime._messages import Message, Retrying, TextDelta, ToolSpec
from subagent.runtime._tools import Tool, ToolError, ToolInvocation
from subagent.service import JOURNAL_COMMIT_TIMEOUT, ServiceRun, SubagentService
from subagent.types import (
    BUDGET_META_KEY,
    LINEAGE_META_KEY,
    RUN_META_KEY,
    TURN_META_KEY,
    Disposer,
    SubagentProgressInfo,
    SubagentProvider,
    SubagentResult,
    SubagentRunEndInfo,
    SubagentRunInfo,
    freeze_json,
    thaw_json,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from subagent.journal import _Write

__all__ = [
    "AGENT_NAME",
    "ALLOW_OPTION_ID",
    "REJECT_OPTION_ID",
    "ServedAgent",
    "ServedSession",
    "default_persona",
    "serve",
]

logger = logging.getLogger(__name__)

EOF_DRAIN_SECONDS: float = 600.0
"""How long prompts in flight when the client closes our stdin may still run and be answered. A client
that writes its requests and closes its end (a shell pipe) still gets its answers; one that went away
breaks our stdout, which stops everything at once, so the grace only runs for a client still reading."""

AGENT_NAME: Final = "subagent-seam"
"""The ``agentInfo.name`` the server answers ``initialize`` with."""

ALLOW_OPTION_ID: Final = "allow"
"""The ``allow_once`` option of every permission question the server asks."""
REJECT_OPTION_ID: Final = "reject"
"""The ``reject_once`` option of every permission question the server asks."""

_PERMISSION_OPTIONS: Final = (
    schema.PermissionOption(option_id=ALLOW_OPTION_ID, name="Allow", kind="allow_once"),
    schema.PermissionOption(option_id=REJECT_OPTION_ID, name="Reject", kind="reject_once"),
)

_DEFAULT_BACKGROUND: Final = BackgroundOptions()
"""Background delegation as served by default: the options' own defaults."""

_RUN_TEXT_EXCERPT: Final = 1000
"""How much of a run's last message (or error) its tool call shows at its end: the ``subagent``
call that started it carries the whole of it already."""
_RUN_CALL_PREFIX: Final = "run/"
_UNFINISHED: Final = "the turn ended before this call finished"
_NOT_APPROVED: Final = "error: this tool call was not approved, so it did not run"

DEFAULT_LIST_PAGE_SIZE: Final = 50
"""How many sessions one ``session/list`` answer holds at most, unless the server is told otherwise."""

_JOURNAL_PROVIDER: Final = "serve"
"""The provider name of a served session's run in the journal."""
_SESSION_PREFIX: Final = "session-"
_JOURNAL_AGENT: Final = {"kind": "serve", "name": AGENT_NAME}
"""What the journal keeps of how a session runs (its ``agent``)."""
_REPLAY_MESSAGE_PREFIX: Final = "message-"
_JOURNAL_ID: Final = re.compile(r"[0-9a-f]{12}")


def default_persona(*, delegate: bool) -> str:
    """The system prompt of a session's agent when none is configured."""
    persona = "You are a helpful assistant. Work on the user's request and answer it."
    if delegate:
        persona += (
            " When a task is large or splits into independent parts, you may delegate parts of it to "
            "subagents with the `subagent` tool, then answer with what they found."
        )
    return persona


async def serve(
    llm: LlmAdapter,
    *,
    persona: str | None = None,
    max_model_calls: int = DEFAULT_MAX_MODEL_CALLS,
    delegate: bool = True,
    depth_limit: int | None = None,
    background: BackgroundOptions | None = _DEFAULT_BACKGROUND,
    providers: Sequence[SubagentProvider] = (),
    journal: str | os.PathLike[str] | RunJournal | None = None,
) -> None:
    """Serve a :class:`ServedAgent` on ``llm`` on this process's stdin/stdout until the client closes
    stdin. ``llm`` is the caller's: left open. The other arguments are :class:`ServedAgent`'s (checked
    before stdin or stdout is touched; a ``journal`` path is opened before them too); ``subagent
    serve`` builds the adapter from its flags."""
    async with ServedAgent(
        llm,
        persona=persona,
        max_model_calls=max_model_calls,
        delegate=delegate,
        depth_limit=depth_limit,
        background=background,
        providers=providers,
        journal=journal,
    ) as handler:
        await serve_stdio(handler, name="subagent-serve", drain_on_eof=EOF_DRAIN_SECONDS)


# -- sessions --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class ServedSession:
    """One ACP session: its id (also its agent's id), working directory, agent, and ``subagent``
    tool (None without delegation). ``reporter`` is internal: it turns the agents' work into updates."""

    id: str
    cwd: str
    agent: Agent
    subagent_tool: SubagentTool | None
    reporter: _Reporter = field(repr=False)
    trace_context: telemetry.Parent = field(default=None, repr=False)
    """The trace context the client sent with ``session/new`` (None: none, or nothing recorded)."""
    budget: BudgetAccount | None = field(default=None, repr=False)
    """The account of the session's whole tree, when the client sent a budget (``BUDGET_META_KEY``)."""
    journaled: _Journaled | None = field(default=None, repr=False)
    """Its run in the server's journal (None: the server keeps none)."""

    @property
    def journal_id(self) -> str | None:
        """The id of the session's run in the server's run journal (None: the server keeps none)."""
        return None if self.journaled is None else self.journaled.id


@dataclass(eq=False, slots=True)
class _Journaled:
    """A session's run in the journal, as this process has it."""

    id: str
    recorded: bool = False
    """Whether the run is in the journal (from the session's first prompt on)."""
    claimed_from: JournalState | None = None
    """Reopened here and not prompted since: the state it had, given back if it closes so."""


class ServedAgent(AgentHandler):
    """An :class:`~subagent.acp.agent.AgentHandler` that runs each ACP session on an in-process agent.

    Use it as an async context manager around the connection that serves it: it owns the
    :class:`~subagent.service.SubagentService` the sessions delegate through, and leaving the
    block closes every session's agent and disposes every subagent::

        async with ServedAgent(llm) as agent:
            await serve_stdio(agent)

    Args:
        llm: the adapter of every session's agent and of their subagents.
        persona: the system prompt of every session's agent; None for :func:`default_persona`,
            ``""`` for none.
        max_model_calls: model calls one turn may make (sessions and subagents alike) before it
            ends with ``max_turn_requests``.
        delegate: give each session's agent the ``subagent`` tool (``spawn`` and ``fork``), with
            background delegation and its companion tools.
        depth_limit: the largest ``depth_limit`` a subagent gets: how many levels of subagents it
            may start below itself (0: none). None leaves it to the model.
        background: how background children run and are reported (the running cap per parent,
            spilling); None offers no background delegation (the ``subagent`` tool alone, each call
            waiting for its child).
        tools: more tools for every session's agent (subagents inherit them, narrowed by any
            tool filter). A tool that needs approval is asked about through the client.
        providers: more providers to delegate to, beside ``spawn`` and ``fork`` (say an
            :class:`~subagent.providers.acp.AcpProvider` named ``acp``); the service owns their runs.
        max_subagent_sessions: for a client that advertised ``subagents``, the most subagent
            sessions one session announces (see :mod:`subagent._served_subagents`).
        journal: a run journal (:mod:`subagent.journal`): a path, opened when the server opens
            and closed with it, or a :class:`~subagent.journal.RunJournal` the caller owns. The
            sessions and their subagents are recorded in it, and the server serves
            ``session/load``, ``session/resume`` and ``session/list`` from it (*Durable sessions* in
            the module docstring). None (default): no session outlives the server.
        list_page_size: the most sessions one ``session/list`` answer holds.

    Raises:
        ValueError: ``max_model_calls`` < 1, a negative ``depth_limit``, ``depth_limit`` without
            ``delegate``, a tool named like the ``subagent`` tool or one of its companions, or
            ``list_page_size`` < 1.
    """

    def __init__(
        self,
        llm: LlmAdapter,
        *,
        persona: str | None = None,
        max_model_calls: int = DEFAULT_MAX_MODEL_CALLS,
        delegate: bool = True,
        depth_limit: int | None = None,
        tools: Sequence[Tool] = (),
        background: BackgroundOptions | None = _DEFAULT_BACKGROUND,
        providers: Sequence[SubagentProvider] = (),
        max_subagent_sessions: int = MAX_SUBAGENT_SESSIONS,
        journal: str | os.PathLike[str] | RunJournal | None = None,
        list_page_size: int = DEFAULT_LIST_PAGE_SIZE,
    ) -> None:
        if list_page_size < 1:
            raise ValueError(f"list_page_size must be >= 1, got {list_page_size}")
        if max_model_calls < 1:
            raise ValueError(f"max_model_calls must be >= 1, got {max_model_calls}")
        if depth_limit is not None and depth_limit < 0:
            raise ValueError(f"depth_limit must be >= 0, got {depth_limit}")
        if depth_limit is not None and not delegate:
            raise ValueError("depth_limit limits delegation, so it needs delegate=True")
        delegation_tools = {
            DEFAULT_TOOL_NAME,
            *(f"{DEFAULT_TOOL_NAME}_{action}" for action in COMPANION_ACTIONS),
        }
        clash = next((tool.spec.name for tool in tools if tool.spec.name in delegation_tools), None)
        if delegate and clash is not None:
            raise ValueError(f"a tool named {clash!r} would clash with the subagent tool or its companions")
        self.llm = llm
        self.persona = default_persona(delegate=delegate) if persona is None else persona
        self.max_model_calls = max_model_calls
        self.delegate = delegate
        self.depth_limit = depth_limit
        self.background = background if delegate else None
        """The background options of every session's ``subagent`` tool; None: no background delegation."""
        self.tools: tuple[Tool, ...] = tuple(tools)
        self.agents: AgentRegistry = _FollowedRegistry(self._adopt)
        """Every live agent: the sessions' agents and their subagents."""
        self.max_subagent_sessions = max_subagent_sessions
        self.list_page_size = list_page_size
        # The service opens (and, given a path, owns) the journal: the sessions' subagents are its runs,
        # and a journal opened by it marks the runs of dead processes interrupted, the sessions' too.
        self.service = SubagentService(journal=journal)
        """The service the sessions delegate through, with the ``spawn`` and ``fork`` providers."""
        self._reopening = anyio.Lock()  # one session/load or session/resume at a time
        # Subagents inherit their parent's approver and tools (the session's), so neither is set here.
        self.service.register_provider(
            SpawnProvider(llm=llm, agents=self.agents, max_model_calls=max_model_calls)
        )
        self.service.register_provider(
            ForkProvider(llm=llm, agents=self.agents, max_model_calls=max_model_calls)
        )
        for provider in providers:
            self.service.register_provider(provider)
        self._sessions: dict[str, ServedSession] = {}
        self._state: Literal["new", "open", "closed"] = "new"

    def __repr__(self) -> str:
        return f"<ServedAgent {self._state} sessions={len(self._sessions)}>"

    @property
    def sessions(self) -> Mapping[str, ServedSession]:
        """The open sessions, by id (a read-only view)."""
        return MappingProxyType(self._sessions)

    @property
    def journal(self) -> RunJournal | None:
        """The run journal, once the server is open (None: it keeps none)."""
        return self.service.journal

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._state != "new":
            raise RuntimeError("a ServedAgent can be opened only once")
        await self.service.__aenter__()
        self._state = "open"
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self._state = "closed"
        # Shielded: a cancelled owner (the connection ended) must still leave no agent behind.
        with anyio.CancelScope(shield=True):
            for session in tuple(self._sessions.values()):
                await self._close_session(session)
        return await self.service.__aexit__(exc_type, exc, tb)

    # -- requests ----------------------------------------------------------------------------------------

    async def initialize(
        self, params: schema.InitializeRequest, client: ClientPeer
    ) -> schema.InitializeResponse:
        """Protocol version 1, and exactly the capabilities implemented (with a journal: loading,
        resuming and listing sessions)."""
        durable = self.journal is not None
        return schema.InitializeResponse(
            protocol_version=negotiate_protocol_version(params.protocol_version),
            agent_capabilities=schema.AgentCapabilities(
                load_session=durable,
                prompt_capabilities=schema.PromptCapabilities(embedded_context=True),
                session_capabilities=schema.SessionCapabilities(
                    close=schema.SessionCloseCapabilities(),
                    resume=schema.SessionResumeCapabilities() if durable else None,
                    list=schema.SessionListCapabilities() if durable else None,
                ),
            ),
            agent_info=schema.Implementation(
                name=AGENT_NAME, title="subagent-seam agent", version=__version__
            ),
        )

    async def new_session(
        self, params: schema.NewSessionRequest, client: ClientPeer
    ) -> schema.NewSessionResponse:
        """A session with its own agent, rooted at ``cwd``."""
        self._check_open(params.cwd, params.mcp_servers, "new")
        journal = self.journal
        journaled: _Journaled | None = None
        if journal is None:
            session_id = f"{_SESSION_PREFIX}{uuid.uuid4().hex[:16]}"
        else:
            # Journaled from its first prompt; the id is fixed now, so the client may keep it.
            journaled = _Journaled(journal.new_id())
            session_id = _SESSION_PREFIX + journaled.id
        self._open_session(session_id, params.cwd, params.meta, client, journaled=journaled)
        logger.info("session %s opened in %s", session_id, params.cwd)
        return schema.NewSessionResponse(session_id=session_id)

    def _check_open(self, cwd: str, mcp_servers: Sequence[schema.McpServer] | None, which: str) -> None:
        """Refuse a session request while not serving, or with a relative ``cwd``; warn of MCP servers."""
        if self._state != "open":
            raise RequestError.internal_error(
                {"details": "the agent is not serving (closed or never opened)"}
            )
        if not os.path.isabs(cwd):
            raise RequestError.invalid_params({"cwd": cwd, "reason": "cwd must be an absolute path"})
        if mcp_servers:
            # Not supported (and not advertised beyond the spec's baseline); a client like Zed sends its
            # servers anyway, so refusing the session would make the agent unusable there.
            names = ", ".join(_mcp_server_name(server) for server in mcp_servers)
            logger.warning("ignoring the MCP servers of the %s session (not supported): %s", which, names)

    def _open_session(
        self,
        session_id: str,
        cwd: str,
        meta: Mapping[str, Any] | None,
        client: ClientPeer,
        *,
        journaled: _Journaled | None = None,
        persona: str | None = None,
        history: Sequence[Message] = (),
        from_log: bool = False,
    ) -> ServedSession:
        """Make the session's agent and open the session. ``from_log``: the agent continues a log
        (``persona``, None for none, and ``history``) rather than starting with the server's persona."""
        children: Callable[[_Queue], ChildSessions] | None = None
        if client.subagents:
            # The client shows sessions as a tree: each run below this one is a subagent session.
            def children(queue: _Queue) -> ChildSessions:
                return ChildSessions(session_id, queue, self._live_run, self.max_subagent_sessions)

        reporter = _Reporter(session_id, client, DEFAULT_TOOL_NAME if self.delegate else None, children)
        subagent_tool: SubagentTool | None = None
        tools: list[Tool] = []
        budget = _inherited_depth_budget(meta)
        # The client's chain may allow no level below this session (its budget is 0): then the
        # session's agent works alone; otherwise its children get at most budget - 1 below them.
        cap = self.depth_limit
        if budget is not None and budget > 0:
            cap = budget - 1 if cap is None else min(cap, budget - 1)
        caps = budget_from_meta(meta)
        account = BudgetAccount(caps, owner=session_id) if caps is not None else None
        if self.delegate and (budget is None or budget > 0):
            # The session's runs start below the session's account: its agent and its tree share it.
            subagent_tool = SubagentTool(self.service, cwd=cwd, background=self.background, budget=account)
            delegation: Tool
            delegation, *companions = subagent_tool.agent_tools()
            if cap is not None:
                delegation = _DepthCappedTool(delegation, cap)
            tools += (delegation, *companions)
        tools.extend(self.tools)
        try:
            agent = Agent(
                llm=self.llm,
                id=session_id,
                cwd=cwd,
                persona=persona if from_log else (self.persona or None),
                history=history,
                # Wrapped per session: subagents inherit these very objects, so their calls are reported
                # to this session's client.
                tools=[_ReportedTool(tool, reporter) for tool in tools],
                approver=reporter.approve,
                max_model_calls=self.max_model_calls,
                registry=self.agents,
                # The session's agent spends from the session's account, as every run below it does.
                budget=account,
            )
        except BaseException:
            if subagent_tool is not None:
                subagent_tool.close()  # nothing was started through it: this frees it at once
            raise
        reporter.agent = agent
        agent.on_event(reporter.on_event)
        reporter.watch(self.service.events)
        session = ServedSession(
            session_id, cwd, agent, subagent_tool, reporter, telemetry.extract(meta), account, journaled
        )
        self._sessions[session_id] = session
        return session

    async def prompt(
        self, params: schema.PromptRequest, turn: PromptTurn
    ) -> schema.PromptResponse | msgspec.Raw:
        """Run one turn of the session's agent, streaming its text and tool calls."""
        session = self._session(params.session_id)
        text = _prompt_text(params.prompt)
        if session.reporter.in_turn:
            raise RequestError.invalid_request(
                {"sessionId": session.id, "reason": "a prompt is already running in this session"}
            )
        result: SubagentResult | None = None
        span = _prompt_span(session, params, text)
        started = self._journal_turn_started(session, text)
        recorded: _Write | None = None
        try:
            async with anyio.create_task_group() as task_group:
                updates = session.reporter.begin_turn(turn, task_group)
                task_group.start_soon(session.reporter.forward, updates, turn)
                try:
                    # The cancel scope is cancelled the moment session/cancel (or session/close) arrives,
                    # even before the agent's own turn scope exists; the runtime closes the turn's dangling
                    # calls and the subagent tool disposes its runs on the way out.
                    with turn.abort_on_cancel(), telemetry.current(span):
                        if started is not None:
                            # In the journal before the model is asked: a prompt cut short by the end of
                            # this process is found interrupted, never mistaken for one never sent.
                            await self._committed(started)
                        result = await self._run_turns(session, text)
                except AgentClosedError:
                    pass  # the session was closed while this prompt waited: answered cancelled below
                finally:
                    # The prompt owns the background children it leaves (its turns failed, or it was
                    # cancelled): they go now, and their ends are shown before the turn ends.
                    background = (
                        session.subagent_tool.background if session.subagent_tool is not None else None
                    )
                    if background is not None:
                        with anyio.CancelScope(shield=True):
                            await background.close_parent(session.id)
                    session.reporter.end_turn(cancelled=turn.cancel_requested)
        except BaseException as exc:
            telemetry.end_agent_span(span, exc)
            raise
        finally:
            # However the prompt ended, its turns are in the agent's log: the next prompt (here, or
            # in a process that resumes the session) continues from there.
            recorded = self._journal_turn_ended(session, None if turn.cancel_requested else result)
        if recorded is not None:
            # Committed before the client has the answer: an answer it got is never lost.
            await self._committed(recorded)
        if span is not None:
            # As answered: a prompt cancelled (or aborted) ends cancelled, whatever its turn said.
            ended = SubagentResult(output="", stop_reason="cancelled") if result is None else result
            if turn.cancel_requested:
                ended = dataclasses.replace(ended, stop_reason="cancelled")
            telemetry.end_agent_span(span, ended)
        # The task group waited for every update to go out: the answer comes after all of them.
        return _answer(result, turn)

    async def _run_turns(self, session: ServedSession, text: str) -> SubagentResult:
        """The prompt's turn, then one more each time the session's background children call for it
        (while any is live or its notice unseen), up to ``max_model_calls`` turns; the usage is theirs
        together."""
        background = session.subagent_tool.background if session.subagent_tool is not None else None
        usage = _UsageSum()
        reporter = session.reporter
        reporter.turn_began(1, woken=False)
        result = await session.agent.run_turn(text)
        await self._journal_between_turns(session, result)
        reporter.turn_ended(1, result)
        usage.add(result.usage)
        turns = 1
        while background is not None and result.stop_reason == "completed":
            prompt = await background.next_turn_prompt(session.id)
            if prompt is None:
                break
            if turns == self.max_model_calls:
                # Each turn may start more children: a model must not keep one prompt going forever.
                result = dataclasses.replace(
                    result,
                    stop_reason="max_turns",
                    error=f"the prompt ran {turns} turns, and its background subagents asked for one more",
                )
                break
            turns += 1
            reporter.turn_began(turns, woken=True)
            result = await session.agent.run_turn(prompt)
            await self._journal_between_turns(session, result)
            reporter.turn_ended(turns, result)
            usage.add(result.usage)
        return dataclasses.replace(result, usage=usage.total())

    # -- durable sessions (with a journal) ------------------------------------------------------------

    async def list_sessions(
        self, params: schema.ListSessionsRequest, client: ClientPeer
    ) -> schema.ListSessionsResponse:
        """The journal's sessions, newest first, in ``cwd`` when given, a page at a time."""
        journal = self._require_journal(schema.SESSION_LIST)
        cwd = params.cwd
        if cwd is not None and not os.path.isabs(cwd):
            raise RequestError.invalid_params({"cwd": cwd, "reason": "cwd must be an absolute path"})
        try:
            listed = await anyio.to_thread.run_sync(_journaled_sessions, journal, cwd)
        except JournalError as exc:
            raise RequestError.internal_error({"details": str(exc)}) from exc
        start = 0
        if params.cursor is not None:
            after = next((index for index, record in enumerate(listed) if record.id == params.cursor), None)
            if after is None:
                raise RequestError.invalid_params(
                    {"cursor": params.cursor, "reason": "not a cursor of this agent's session/list"}
                )
            start = after + 1
        page = listed[start : start + self.list_page_size]
        more = start + len(page) < len(listed)
        return schema.ListSessionsResponse(
            sessions=[_session_info(record) for record in page],
            next_cursor=page[-1].id if more and page else None,
        )

    async def resume_session(
        self, params: schema.ResumeSessionRequest, client: ClientPeer
    ) -> schema.ResumeSessionResponse:
        """Reopen a journaled session (or take an open one as it is) without replaying it."""
        await self._reopen(
            schema.SESSION_RESUME, params.session_id, params.cwd, params.mcp_servers, params.meta, client
        )
        return schema.ResumeSessionResponse()

    async def load_session(
        self, params: schema.LoadSessionRequest, client: ClientPeer
    ) -> schema.LoadSessionResponse:
        """Reopen a journaled session (or take an open one as it is), replaying its log first."""
        session = await self._reopen(
            schema.SESSION_LOAD, params.session_id, params.cwd, params.mcp_servers, params.meta, client
        )
        agent = session.agent
        # An idle agent's whole log (the notices of lost children included); a busy one's finished turns.
        for update in self._replay(agent.completed_messages if agent.busy else agent.messages):
            try:
                await client.session_update(session.id, update)
            except MessageTooLargeError as exc:
                # Refused before sending: the client is still there and gets the rest of the log.
                logger.warning("session %s: a replayed update was not sent: %s", session.id, exc)
        return schema.LoadSessionResponse()

    async def _reopen(
        self,
        method: str,
        session_id: str,
        cwd: str,
        mcp_servers: Sequence[schema.McpServer] | None,
        meta: Mapping[str, Any] | None,
        client: ClientPeer,
    ) -> ServedSession:
        """The session ``session_id``: open here already, else made again from its last checkpoint in
        the journal and taken over there."""
        journal = self._require_journal(method)
        self._check_open(cwd, mcp_servers, "reopened")
        async with self._reopening:  # two reopens of one session must not both take it over
            session = self._sessions.get(session_id)
            if session is not None:
                return session
            record = await self._journaled_session(journal, session_id)
            if record.live:
                try:
                    await self.service.sweep()  # its owner may be dead, and its run not marked so yet
                except JournalError as exc:
                    raise RequestError.internal_error({"sessionId": session_id, "details": str(exc)}) from exc
                record = await self._journaled_session(journal, session_id)
            if record.live:
                raise self._in_use(record)
            from_log, persona, history = _checkpointed_log(record)
            claim = journal.claim_for_resume(record.id)
            await self._committed(claim)
            if claim.error is not None:
                raise RequestError.internal_error(
                    {"sessionId": session_id, "details": f"the run journal cannot record it: {claim.error}"}
                )
            if not claim.rowcounts or claim.rowcounts[0] == 0:
                raise self._in_use(record)  # another process took it over meanwhile
            journaled = _Journaled(record.id, recorded=True, claimed_from=record.state)
            try:
                session = self._open_session(
                    session_id,
                    cwd,
                    meta,
                    client,
                    journaled=journaled,
                    persona=persona,
                    history=history,
                    from_log=from_log,
                )
            except BaseException as exc:
                journal.release_claim(
                    record.id,
                    record.state,
                    f"the session could not be reopened: {exc}",
                    stop_reason=record.stop_reason,
                    ended_at=record.ended_at,
                )
                raise
            background = session.subagent_tool.background if session.subagent_tool is not None else None
            if background is not None:
                # The children it lost with the process that served it are told to its agent now (as
                # notices, in its log): its next prompt's model reads them.
                background.bind_agent(session.agent)
        logger.info(
            "session %s reopened in %s (%s, %d turn(s) completed)",
            session_id,
            cwd,
            record.state,
            record.turns,
        )
        return session

    async def _journaled_session(self, journal: RunJournal, session_id: str) -> RunRecord:
        """The journal's record of session ``session_id``.

        Raises:
            RequestError: -32002 when the journal has no such session.
        """
        journal_id = session_id.removeprefix(_SESSION_PREFIX)
        record: RunRecord | None = None
        # Only a whole journal id (as RunJournal.new_id makes them) names a session: get() would also
        # take the start of one.
        if journal_id != session_id and _JOURNAL_ID.fullmatch(journal_id):
            try:
                record = await anyio.to_thread.run_sync(
                    functools.partial(journal.get, journal_id, exact=True)
                )
            except JournalError as exc:
                raise RequestError.internal_error({"sessionId": session_id, "details": str(exc)}) from exc
        if record is None or record.provider != _JOURNAL_PROVIDER:
            raise RequestError(
                RpcErrorCode.RESOURCE_NOT_FOUND,
                "Resource not found",
                {"sessionId": session_id, "reason": "no such session in this agent's run journal"},
            )
        return record

    def _in_use(self, record: RunRecord) -> RequestError:
        pid = record.owner.get("pid")
        return RequestError.invalid_params(
            {
                "sessionId": _SESSION_PREFIX + record.id,
                "reason": f"the session is {record.state} in process {pid}, which is alive: one process "
                "at a time serves a session",
            }
        )

    def _require_journal(self, method: str) -> RunJournal:
        """The journal; without one the method is not served (-32601), as not advertised."""
        if self._state != "open":
            raise RequestError.internal_error(
                {"details": "the agent is not serving (closed or never opened)"}
            )
        journal = self.journal
        if journal is None:
            raise RequestError.method_not_found(method)
        return journal

    def _replay(self, log: Sequence[Message]) -> list[schema.SessionUpdate]:
        """``log`` as the updates ``session/load`` replays (see *Durable sessions*)."""
        updates: list[schema.SessionUpdate] = []
        delegate_tool = DEFAULT_TOOL_NAME if self.delegate else None
        for index, message in enumerate(log):
            message_id = f"{_REPLAY_MESSAGE_PREFIX}{index}"
            if message.role == "user":
                content = schema.TextContent(text=message.content)
                updates.append(schema.UserMessageChunk(content=content, message_id=message_id))
            elif message.role == "assistant":
                if message.content:
                    content = schema.TextContent(text=message.content)
                    updates.append(schema.AgentMessageChunk(content=content, message_id=message_id))
                for call in message.tool_calls:
                    arguments = _decoded_arguments(call.arguments)
                    updates.append(
                        schema.ToolCall(
                            tool_call_id=call.id,
                            title=_tool_title(call.name, arguments, delegate_tool),
                            kind="other",
                            status="in_progress",
                            raw_input=thaw_json(arguments),
                        )
                    )
            elif message.role == "tool" and message.tool_call_id is not None:
                failed = message.content.startswith("error: ")
                updates.append(
                    schema.ToolCallProgress(
                        tool_call_id=message.tool_call_id,
                        status="failed" if failed else "completed",
                        content=_text_content(message.content),
                    )
                )
        return updates

    # -- the journal's record of a session --------------------------------------------------------------

    def _journal_turn_started(self, session: ServedSession, prompt: str) -> _Write | None:
        """A prompt begins: the session's run is recorded at its first, else a turn of it begins; the
        write to wait on is returned (None: no journal)."""
        journal, journaled = self.journal, session.journaled
        if journal is None or journaled is None:
            return None
        if journaled.recorded:
            write = journal.record_turn_started(journaled.id, prompt)
        else:
            journal.record_start(
                journaled.id,
                run_id=session.id,
                provider=_JOURNAL_PROVIDER,
                parent=None,
                parent_id=None,
                prompt=prompt,
                request={"cwd": session.cwd},
                agent=_JOURNAL_AGENT,
            )
            # Its log so far (the persona): a serve killed during this first prompt leaves a session
            # that reopens empty, rather than none.
            write = journal.record_running(
                journaled.id, session_id=session.id, checkpoint=_checkpoint(session)
            )
            journaled.recorded = True
        journaled.claimed_from = None
        return write

    async def _journal_between_turns(self, session: ServedSession, result: SubagentResult) -> None:
        """A turn of the prompt completed and its background children work on: the prompt goes on, so
        the log as it is now is kept (committed before the turn's end is reported). Otherwise the
        prompt's end records it."""
        journal, journaled = self.journal, session.journaled
        if (
            journal is None
            or journaled is None
            or not journaled.recorded
            or result.stop_reason != "completed"
        ):
            return
        background = session.subagent_tool.background if session.subagent_tool is not None else None
        if background is not None and any(child.live for child in background.children(session.id)):
            await self._committed(journal.record_checkpoint(journaled.id, _checkpoint(session)))

    def _journal_turn_ended(self, session: ServedSession, result: SubagentResult | None) -> _Write | None:
        """A prompt ended (``result`` None: cancelled): its outcome and the log it left, queued."""
        journal, journaled = self.journal, session.journaled
        if journal is None or journaled is None or not journaled.recorded:
            return None
        if result is None:
            result = SubagentResult(output="", stop_reason="cancelled")
        return journal.record_turn(
            journaled.id,
            stop_reason=result.stop_reason,
            output=result.output,
            structured=None,
            error=result.error,
            usage=usage_json(result.usage),
            checkpoint=_checkpoint(session),
        )

    async def _committed(self, write: _Write) -> None:
        """Wait (bounded) until ``write`` is committed; a failed write was logged by the journal."""
        # As long as the service waits for its runs' writes (a stalled disk holds no answer back forever).
        if not await write.committed(JOURNAL_COMMIT_TIMEOUT):
            logger.error(
                "run journal: a write was not committed within %.0f s; going on without waiting",
                JOURNAL_COMMIT_TIMEOUT,
            )

    async def close_session(
        self, params: schema.CloseSessionRequest, client: ClientPeer
    ) -> schema.CloseSessionResponse:
        """Close the session: its turn was cancelled already; close its agent."""
        session = self._session(params.session_id)
        await self._close_session(session)
        return schema.CloseSessionResponse()

    async def cancel(self, params: schema.CancelNotification, client: ClientPeer) -> None:
        """``session/cancel`` for a subagent session cancels that child's work alone (a session's own
        turn was cancelled by the connection already)."""
        if params.session_id in self._sessions:
            return
        for session in tuple(self._sessions.values()):
            children = session.reporter.children
            if children is not None and children.cancel(params.session_id):
                return
        logger.warning(
            "ignoring session/cancel for %r: no such session or subagent session", params.session_id
        )

    # -- internals ---------------------------------------------------------------------------------------

    def _session(self, session_id: str) -> ServedSession:
        session = self._sessions.get(session_id)
        if session is not None:
            return session
        for other in self._sessions.values():
            parent = other.reporter.children.parent_of(session_id) if other.reporter.children else None
            if parent is not None:
                raise RequestError.invalid_params(
                    {
                        "sessionId": session_id,
                        "reason": f"a subagent session of {parent}: its client may cancel it, nothing more",
                    }
                )
        raise RequestError.invalid_params({"sessionId": session_id, "reason": "unknown session"})

    def _live_run(self, run_id: str) -> ServiceRun | None:
        return next((run for run in self.service.live_runs if run.id == run_id), None)

    def _adopt(self, agent: Agent) -> None:
        """A new in-process agent: the session whose agents started it follows its events."""
        for session in tuple(self._sessions.values()):
            children = session.reporter.children
            if children is not None and children.adopt(agent):
                return

    async def _close_session(self, session: ServedSession) -> None:
        self._sessions.pop(session.id, None)
        journaled, journal = session.journaled, self.journal
        if journaled is not None and journal is not None and journaled.claimed_from is not None:
            # Reopened and never prompted: the session goes back as it was, for anyone to reopen.
            journal.release_claim(
                journaled.id, journaled.claimed_from, "reopened, and closed without a prompt"
            )
            journaled.claimed_from = None
        try:
            with anyio.CancelScope(shield=True):
                await session.agent.close("the session was closed")
                if session.subagent_tool is not None:
                    # Its background children, and those of the session's subagents, go with it.
                    await session.subagent_tool.aclose()
        finally:
            session.reporter.unwatch()
            if session.budget is not None:
                session.budget.close()
        logger.info("session %s closed", session.id)


def _checkpoint(session: ServedSession) -> dict[str, Any]:
    """What the journal keeps of a session to make it again: its agent's whole log, as it is now."""
    return {"sessionId": session.id, "cwd": session.cwd, "messages": encode_log(session.agent.messages)}


def _checkpointed_log(record: RunRecord) -> tuple[bool, str | None, tuple[Message, ...]]:
    """From a session's checkpoint: whether there is a log, its persona (its leading system message)
    and the rest of it.

    Raises:
        RequestError: -32603 when the checkpoint is malformed (not what this server writes).
    """
    checkpoint = record.checkpoint
    if checkpoint is None:
        return False, None, ()  # never checkpointed: it starts as a new session would
    try:
        if not isinstance(checkpoint, Mapping):
            raise ValueError(f"it must be an object, not {json_type(checkpoint)}")
        if "messages" not in checkpoint:
            raise ValueError("it has no messages")
        log = decode_log(checkpoint["messages"])
    except ValueError as exc:
        raise RequestError.internal_error(
            {
                "sessionId": _SESSION_PREFIX + record.id,
                "details": f"its checkpoint in the run journal is malformed: {exc}",
            }
        ) from exc
    if log and log[0].role == "system":
        # The agent puts its persona first: kept as the persona, so the model sees the same log.
        return True, log[0].content or None, log[1:]
    return True, None, log


def _journaled_sessions(journal: RunJournal, cwd: str | None) -> list[RunRecord]:
    """The journal's sessions, newest first, in ``cwd`` when given. Blocking."""
    wanted = None if cwd is None else os.path.normpath(cwd)
    return [
        record
        for record in journal.runs(provider=_JOURNAL_PROVIDER, limit=None)
        if isinstance(record.request.get("cwd"), str)
        and (wanted is None or os.path.normpath(record.request["cwd"]) == wanted)
    ]


def _session_info(record: RunRecord) -> schema.SessionInfo:
    """A journaled session as ``session/list`` shows it."""
    updated = datetime.datetime.fromtimestamp(record.updated_at, tz=datetime.UTC)
    return schema.SessionInfo(
        session_id=_SESSION_PREFIX + record.id,
        cwd=record.request["cwd"],
        title=excerpt(record.prompt) or None,
        updated_at=updated.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
    )


def _prompt_span(session: ServedSession, params: schema.PromptRequest, text: str) -> Span | None:
    """The prompt's ``invoke_agent`` span, begun below the client's trace context, if it sent one."""
    if not telemetry.enabled():
        return None
    parent = telemetry.extract(params.meta) or session.trace_context
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": telemetry.PROVIDER_NAME,
        "gen_ai.agent.name": AGENT_NAME,
        "gen_ai.agent.id": session.id,
        "gen_ai.conversation.id": session.id,
    }
    if telemetry.capture_content():
        attributes["gen_ai.input.messages"] = telemetry.messages_json("user", text)
    return telemetry.start_span(f"invoke_agent {AGENT_NAME}", "server", attributes, parent)


def _answer(result: SubagentResult | None, turn: PromptTurn) -> schema.PromptResponse | msgspec.Raw:
    """The prompt's answer for how the turn ended (None: it was aborted)."""
    if result is None or turn.cancel_requested:
        return schema.PromptResponse(stop_reason="cancelled")
    if result.stop_reason == "budget":
        return _budget_answer(result)
    stop_reason = TO_ACP.get(result.stop_reason)
    if stop_reason is None:
        # error (and timeout, which this server never sets): ACP has no stop reason for a failed turn.
        raise RequestError(
            RpcErrorCode.INTERNAL_ERROR,
            "the agent's turn failed",
            {"stopReason": result.stop_reason, "details": result.error or "no diagnosis"},
        )
    usage = prompt_response_usage(result.usage)
    if usage is None:
        return schema.PromptResponse(stop_reason=stop_reason)
    # `usage` is unstable in ACP, so the schema's PromptResponse has no field for it.
    return msgspec.Raw(schema.encode({"stopReason": stop_reason, "usage": usage}))


def _budget_answer(result: SubagentResult) -> msgspec.Raw:
    """The answer to a turn the budget stopped (see the module docstring for the stop reason chosen)."""
    hit = result.limit
    answer: dict[str, Any] = {
        "stopReason": "max_tokens" if hit and hit.limit == "max_tokens" else "max_turn_requests"
    }
    usage = prompt_response_usage(result.usage)
    if usage is not None:
        answer["usage"] = usage
    if hit is not None:
        said: dict[str, Any] = {"limit": hit.limit, "allowed": hit.allowed, "spent": hit.spent}
        if hit.needed is not None:
            said["needed"] = hit.needed
        answer["_meta"] = {BUDGET_META_KEY: said}
    return msgspec.Raw(schema.encode(answer))


def _prompt_text(blocks: Sequence[schema.ContentBlock]) -> str:
    """The prompt as text: text blocks as they are, resource links and embedded text resources described.

    Raises:
        RequestError: -32602 for a block the agent did not advertise (image, audio, binary resource).
    """
    parts: list[str] = []
    for block in blocks:
        if isinstance(block, schema.TextContent):
            parts.append(block.text)
        elif isinstance(block, schema.ResourceLink):
            parts.append(f"[resource: {block.title or block.name}] {block.uri}")
        elif isinstance(block, schema.EmbeddedResource) and isinstance(
            block.resource, schema.TextResourceContents
        ):
            resource = block.resource
            parts.append(f'<resource uri="{resource.uri}">\n{resource.text}\n</resource>')
        else:
            raise RequestError.invalid_params(
                {
                    "reason": "this agent reads text, resource links and embedded text resources only",
                    "unsupported": _block_type(block),
                }
            )
    return "\n\n".join(parts)


def _block_type(block: schema.ContentBlock) -> str:
    """The block's ``type`` as on the wire (a binary embedded resource is told apart)."""
    if isinstance(block, schema.UnknownContentBlock):
        return block.tag or "(no type)"
    if isinstance(block, schema.EmbeddedResource):
        return "resource (blob)"
    tag = block.__struct_config__.tag
    return tag if isinstance(tag, str) else type(block).__name__


def _mcp_server_name(server: schema.McpServer) -> str:
    if isinstance(server, schema.UnknownMcpServer):
        name = server.raw.get("name")
        return name if isinstance(name, str) else "(unnamed)"
    return server.name


# -- reporting a session's tool calls --------------------------------------------------------------------


class _Reporter:
    """Turns what a session's agents do into ACP session updates, in order, and asks for approvals.

    Updates are queued synchronously (agent events are delivered by plain callbacks) and sent by one
    forwarding task per turn, so they reach the client in the order they happened. Tool-call state
    (which calls the client has been shown and not yet seen finish) changes only when an update is
    queued, so it always matches what the client will have received.
    """

    def __init__(
        self,
        session_id: str,
        client: ClientPeer,
        delegate_tool: str | None,
        children: Callable[[_Queue], ChildSessions] | None = None,
    ) -> None:
        self.session_id = session_id
        self.client = client
        self.agent: Agent | None = None
        """The session's own agent (set once it exists)."""
        self.delegate_tool = delegate_tool
        """The name of the tool that starts subagents (None: the session does not delegate)."""
        self._outbox: MemoryObjectSendStream[_Outgoing] | None = None
        self.children = children(self._queue_to) if children is not None else None
        """The session's runs as subagent sessions, when its client advertised ``subagents``; None:
        they are shown as tool calls of the session (*The tree of runs*)."""
        # Shown to the client and not finished, in order; the value is the run a run's call shows.
        self._open_calls: dict[str, _Run | None] = {}
        # Where a subagent's open call was shown, when not as the session's: (session id, call id).
        self._routes: dict[str, tuple[str, str]] = {}
        self._runs: dict[str, _Run] = {}  # the session's runs that have not ended, by id
        self._unwatch: tuple[Disposer, ...] = ()
        self._message_id: str | None = None

    @property
    def in_turn(self) -> bool:
        """Whether a turn is being reported now."""
        return self._outbox is not None

    # -- the turn ----------------------------------------------------------------------------------------

    def begin_turn(
        self, turn: PromptTurn, task_group: anyio.abc.TaskGroup
    ) -> MemoryObjectReceiveStream[_Outgoing]:
        """Start queueing updates for ``turn``; the returned stream is for :meth:`forward`.
        ``task_group`` is the turn's (where a cancel of one subagent session runs)."""
        # Unbounded, but every update of a peer (an acp child's) is bounded per child by ChildSessions.
        send, receive = anyio.create_memory_object_stream[_Outgoing](math.inf)
        self._outbox = send
        if self.children is not None:
            self.children.begin_turn(task_group, lambda: turn.cancel_requested)
        return receive

    def end_turn(self, *, cancelled: bool = False) -> None:
        """Fail the calls left open (the turn was cut short), end the subagent sessions still working
        (``cancelled``: the turn was), then stop queueing."""
        for key, run in tuple(self._open_calls.items()):
            if run is None:
                self._finish(key, f"error: {_UNFINISHED}", failed=True)
            else:
                self._finish_run(run, f"error: {_UNFINISHED}", "failed")
        if self.children is not None:
            self.children.end_turn(cancelled=cancelled)
        outbox, self._outbox = self._outbox, None
        if outbox is not None:
            outbox.close()

    async def forward(self, updates: MemoryObjectReceiveStream[_Outgoing], turn: PromptTurn) -> None:
        """Send the queued updates until the turn ends; flush markers are released as they are reached."""
        gone = False
        try:
            async for item in updates:
                if isinstance(item, anyio.Event):
                    item.set()
                    continue
                target, update = item
                if self.children is not None:
                    self.children.sent(target)
                if not gone:
                    try:
                        await turn.client.session_update(target, update)
                    except MessageTooLargeError as exc:
                        # Refused before sending (over the client's line limit): the client is still
                        # there, and the updates after this one still go out.
                        logger.warning("session %s: an update was not sent: %s", self.session_id, exc)
                    except AcpError as exc:
                        # The client is gone: nothing more can reach it. Keep draining, so that no flush
                        # waits forever; the turn itself ends with the connection.
                        logger.debug("session %s: updates can no longer be sent: %s", self.session_id, exc)
                        gone = True
        finally:
            # Cut short (the connection ended): release whoever waits on a flush.
            with contextlib.suppress(anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                while True:
                    item = updates.receive_nowait()
                    if isinstance(item, anyio.Event):
                        item.set()
            updates.close()

    def _put(self, item: _Outgoing) -> bool:
        """Queue ``item`` for the turn's forwarder; False when no turn is being reported."""
        if self._outbox is None:
            return False
        try:
            self._outbox.send_nowait(item)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False  # the forwarder was cut short (the connection ended)
        return True

    def _queue(self, update: schema.SessionUpdate, target: str | None = None) -> None:
        self._queue_to(self.session_id if target is None else target, update)

    def _queue_to(self, target: str, update: schema.SessionUpdate) -> bool:
        """Queue ``update`` to go out under the session id ``target`` (this session, or one of its
        subagent sessions); False when no turn is being reported."""
        if self._put((target, update)):
            return True
        # Agents act only inside a turn (subagents inside their session's turn): nothing to tell.
        logger.debug("session %s: no turn to report %s in", self.session_id, type(update).__name__)
        return False

    def turn_began(self, number: int, *, woken: bool) -> None:
        """A turn of the session's agent begins (``woken``: its background children called for it)."""
        marker: dict[str, Any] = {"turn": number, "state": "started"}
        if woken:
            marker["woken"] = True
        self._queue(schema.SessionInfoUpdate(meta={TURN_META_KEY: marker}))
        if self.children is not None:
            # With subagent sessions no run rows (tool calls) come between the agent's turns to end its
            # message: each turn's text is a message of its own, so the last one is the answer.
            self._message_id = f"turn-{number}"

    def turn_ended(self, number: int, result: SubagentResult) -> None:
        """A turn of the session's agent ended, with how."""
        marker = {"turn": number, "state": "ended", "stopReason": result.stop_reason}
        self._queue(schema.SessionInfoUpdate(meta={TURN_META_KEY: marker}))

    async def _flush(self) -> None:
        """Return once every update queued so far was sent (or could not be)."""
        sent = anyio.Event()
        if self._put(sent):
            await sent.wait()

    # -- what the agents do ------------------------------------------------------------------------------

    def on_event(self, event: AgentEvent) -> None:
        """The session agent's events (its subagents' calls come through :class:`_ReportedTool`; their
        model retries do not reach here)."""
        if isinstance(event, TextDelta):
            if event.text:
                text = schema.TextContent(text=event.text)
                self._queue(schema.AgentMessageChunk(content=text, message_id=self._message_id))
        elif isinstance(event, Retrying):
            self._queue(retry_update(event))
        elif isinstance(event, ToolCallStarted):
            self.started(event.invocation)
        elif isinstance(event, ToolCallFinished):
            key = event.call.id
            failed = event.is_error
            if key in self._open_calls:
                self._finish(key, event.output, failed=failed)
                return
            # Never started (bad arguments, no such tool): shown once, already finished.
            arguments = _decoded_arguments(event.call.arguments)
            self._queue(
                schema.ToolCall(
                    tool_call_id=key,
                    title=self._call_title(event.call.name, arguments, None),
                    kind="other",
                    status="failed" if failed else "completed",
                    content=_text_content(event.output),
                    raw_input=thaw_json(arguments),
                )
            )

    def started(self, invocation: ToolInvocation) -> None:
        """A call is about to run: shown as in progress."""
        key = self._key(invocation)
        if key in self._open_calls:  # shown already, while its permission was asked
            target, call_id = self._routes.get(key, (self.session_id, key))
            self._queue(schema.ToolCallProgress(tool_call_id=call_id, status="in_progress"), target)
            return
        route = self._route(invocation)
        self._show(key, self._title(invocation, route), invocation.arguments, "in_progress", route)

    def finished(self, invocation: ToolInvocation, output: str, *, failed: bool) -> None:
        """A call of a subagent ended (the session agent's own calls end through its events)."""
        key = self._key(invocation)
        if key in self._open_calls:
            self._finish(key, output, failed=failed)

    async def approve(self, invocation: ToolInvocation) -> bool:
        """The approver of the session's agents: ask the client about this frozen invocation (a
        subagent session's question under its own id, the session in ``requires_action`` meanwhile)."""
        key = self._key(invocation)
        owner = self._owner(invocation)
        route = self._route(invocation)
        title = self._title(invocation, route)
        target, call_id = route if route is not None else (self.session_id, key)
        if route is not None and self.children is not None:
            self.children.asking(target, True)
        self._show(key, title, invocation.arguments, "pending", route)
        # The client hears of the call before it is asked about it.
        await self._flush()
        request = schema.RequestPermissionRequest(
            session_id=target,
            tool_call=schema.ToolCallUpdate(
                tool_call_id=call_id,
                title=title,
                kind="other",
                status="pending",
                raw_input=thaw_json(invocation.arguments),
            ),
            options=list(_PERMISSION_OPTIONS),
        )
        try:
            response = await self.client.request_permission(request)
        except AcpError as exc:
            # No answer is no approval: a client that cannot ask refuses, it never hangs the turn.
            logger.warning(
                "session %s: asking permission for %s failed (%s); refused", self.session_id, key, exc
            )
            allowed = False
        else:
            outcome = response.outcome
            allowed = (
                isinstance(outcome, schema.SelectedPermissionOutcome) and outcome.option_id == ALLOW_OPTION_ID
            )
        finally:
            if route is not None and self.children is not None:
                self.children.asking(target, False)
        if not allowed and owner is not None:
            # A subagent's refused call never runs, so no tool wrapper finishes it; the session agent's own
            # refused call is finished by its ToolCallFinished event.
            self._finish(key, _NOT_APPROVED, failed=True)
        return allowed

    # -- the tree of runs --------------------------------------------------------------------------------

    def watch(self, events: EventHub) -> None:
        """Follow the session's runs on the service's ``events`` until :meth:`unwatch`."""
        self._unwatch = (
            events.on("subagent/start", self.run_started),
            events.on("subagent/progress", self.run_progress),
            events.on("subagent/end", self.run_ended),
        )

    def unwatch(self) -> None:
        """Stop following runs (the session closed): no listener stays behind."""
        for dispose in self._unwatch:
            dispose()
        self._unwatch = ()

    def run_started(self, info: SubagentRunInfo) -> None:
        """A run of the service is ready: shown as a call of its own (or a subagent session) if it
        belongs to this session."""
        if self.children is not None:
            self.children.run_started(info)
            return
        parent_id = info.parent_id
        if parent_id == self.session_id:
            depth = 1
        else:
            parent = self._runs.get(parent_id) if parent_id is not None else None
            if parent_id is None or parent is None:
                return  # another session's run
            depth = parent.depth + 1
        run = _Run(info.id, parent_id, info.provider, depth, run_title(info))
        self._runs[info.id] = run
        if not self.in_turn:
            return  # followed for its descendants' sake, but there is no turn to show it in
        self._open_calls[run.call_id] = run
        self._queue(
            schema.ToolCall(
                tool_call_id=run.call_id,
                title=run.title,
                kind="other",
                status="in_progress",
                meta={RUN_META_KEY: run.meta("running")},
            )
        )

    def run_progress(self, info: SubagentProgressInfo) -> None:
        """A heartbeat of a run shown: its line becomes the call's content."""
        run = self._runs.get(info.id)
        if run is None or run.call_id not in self._open_calls:
            return
        self._queue(
            schema.ToolCallProgress(
                tool_call_id=run.call_id,
                title=run.title,
                content=_text_content(info.describe()),
                meta={RUN_META_KEY: run.meta("running")},
            )
        )

    def run_ended(self, info: SubagentRunEndInfo) -> None:
        """A run ended: its call finishes with its last message, or its error (a subagent session's
        run ends ``idle``)."""
        if self.children is not None:
            self.children.run_ended(info)
            return
        run = self._runs.pop(info.id, None)
        if run is None or run.call_id not in self._open_calls:
            return
        stop_reason = info.stop_reason
        if stop_reason == "completed":
            state: _RunState = "completed"
            text = info.last_assistant_message or ""
        else:
            state = "cancelled" if stop_reason == "cancelled" else "failed"
            text = f"error: {info.error}" if info.error else f"the run stopped ({stop_reason})"
        meta = run.meta(state, stop_reason)
        # What the run cost, so a client can add up a tree (``subagent run`` gives the subtree total).
        usage = usage_to_acp(info.usage)
        if usage is not None:
            meta["usage"] = usage
        if info.elapsed_seconds is not None:
            meta["elapsedSeconds"] = round(info.elapsed_seconds, 3)
        if info.budget is not None or info.limit is not None:
            # Which cap stopped it and what it spent beside each: the trace page marks it.
            meta.update(budget=budget_to_json(info.budget), spent=spend_to_json(info.spent))
            meta["limit"] = limit_to_json(info.limit)
        self._finish_run(run, cut(text, _RUN_TEXT_EXCERPT), state, stop_reason, meta=meta)

    def _finish_run(
        self,
        run: _Run,
        text: str,
        state: _RunState,
        stop_reason: str | None = None,
        *,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self._open_calls.pop(run.call_id, None)
        self._queue(
            schema.ToolCallProgress(
                tool_call_id=run.call_id,
                title=run.title,
                status="completed" if state == "completed" else "failed",
                content=_text_content(text),
                meta={RUN_META_KEY: meta if meta is not None else run.meta(state, stop_reason)},
            )
        )

    # -- helpers -----------------------------------------------------------------------------------------

    def _show(
        self,
        key: str,
        title: str,
        arguments: Any,
        status: schema.ToolCallStatus,
        route: tuple[str, str] | None = None,
    ) -> None:
        self._open_calls[key] = None
        target, call_id = (self.session_id, key) if route is None else route
        if route is not None:
            self._routes[key] = route
        self._queue(
            schema.ToolCall(
                tool_call_id=call_id, title=title, kind="other", status=status, raw_input=thaw_json(arguments)
            ),
            target,
        )

    def _finish(self, key: str, output: str, *, failed: bool) -> None:
        self._open_calls.pop(key, None)
        target, call_id = self._routes.pop(key, (self.session_id, key))
        self._queue(
            schema.ToolCallProgress(
                tool_call_id=call_id,
                status="failed" if failed else "completed",
                content=_text_content(output),
            ),
            target,
        )

    def _owner(self, invocation: ToolInvocation) -> str | None:
        """The id of the subagent making the call; None for the session's own agent."""
        own = self.agent is not None and invocation.context is self.agent.context
        return None if own else invocation.context.id

    def _route(self, invocation: ToolInvocation) -> tuple[str, str] | None:
        """(its session id, the call's id) for a subagent's call shown in its own subagent session;
        None for a call shown as the session's."""
        owner = self._owner(invocation)
        if owner is None or self.children is None or not self.children.announce(owner):
            return None
        return owner, invocation.call_id

    def _key(self, invocation: ToolInvocation) -> str:
        # Call ids are unique per model answer, not across agents: a subagent's are prefixed.
        owner = self._owner(invocation)
        return invocation.call_id if owner is None else f"{owner}/{invocation.call_id}"

    def _title(self, invocation: ToolInvocation, route: tuple[str, str] | None) -> str:
        # In its own subagent session a subagent's call needs no name of who made it.
        owner = None if route is not None else self._owner(invocation)
        return self._call_title(invocation.tool, invocation.arguments, owner)

    def _call_title(self, tool: str, arguments: Any, owner: str | None) -> str:
        title = _tool_title(tool, arguments, self.delegate_tool)
        return title if owner is None else f"{owner}: {title}"


_RunState = Literal["running", "completed", "failed", "cancelled"]

_Outgoing = tuple[str, schema.SessionUpdate] | anyio.Event
"""What a turn's forwarder sends: an update and the session id it goes under, or a flush marker."""
_Queue = Callable[[str, schema.SessionUpdate], bool]


class _FollowedRegistry(AgentRegistry):
    """The served agents' registry, which tells ``on_register`` of each agent made: in-process
    subagents are made there, and a session that shows them as subagent sessions follows their events
    from their first (their text before their start is theirs too)."""

    def __init__(self, on_register: Callable[[Agent], None]) -> None:
        super().__init__()
        self._on_register = on_register

    def register(self, agent: Agent) -> Disposer:
        """Register ``agent`` (see :meth:`AgentRegistry.register`), then tell ``on_register``."""
        disposer = super().register(agent)
        self._on_register(agent)
        return disposer


@dataclass(frozen=True, slots=True)
class _Run:
    """A run below a session, as its client is shown it."""

    id: str
    parent_id: str
    provider: str
    depth: int  # levels below the session: 1 for the session's own children
    title: str

    @property
    def call_id(self) -> str:
        """The id of the tool call that shows the run."""
        return _RUN_CALL_PREFIX + self.id

    def meta(self, state: _RunState, stop_reason: str | None = None) -> dict[str, Any]:
        """The run's ``_meta`` entry (:data:`~subagent.types.RUN_META_KEY`) in one of its updates."""
        meta: dict[str, Any] = {
            "runId": self.id,
            "parentId": self.parent_id,
            "provider": self.provider,
            "depth": self.depth,
            "state": state,
        }
        if stop_reason is not None:
            meta["stopReason"] = stop_reason
        return meta


def _inherited_depth_budget(meta: Mapping[str, Any] | None) -> int | None:
    """The depth budget the client's chain left this session (``LINEAGE_META_KEY``), if it sent one."""
    lineage = meta.get(LINEAGE_META_KEY) if meta is not None else None
    budget = lineage.get("depthBudget") if isinstance(lineage, Mapping) else None
    if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0:
        return budget
    if lineage is not None:
        logger.warning("ignoring a malformed %s in session/new: %r", LINEAGE_META_KEY, lineage)
    return None


def _tool_title(tool: str, arguments: Any, delegate_tool: str | None) -> str:
    """A tool call's title: the tool's name; a delegation's also names its provider and prompt."""
    if tool == delegate_tool and isinstance(arguments, Mapping):
        provider, prompt = arguments.get("provider"), arguments.get("prompt")
        if isinstance(provider, str) and isinstance(prompt, str):
            return f"{tool} ({provider}): {excerpt(prompt)}"
    return tool


def _text_content(text: str) -> list[schema.ToolCallContent]:
    return [schema.Content(content=schema.TextContent(text=text))]


def _decoded_arguments(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError:
        return text


class _ReportedTool:
    """A tool as one session's agents have it: calls by the session's subagents (which inherit these
    very objects) are reported to the session's client; the session agent's own calls pass straight
    through (its events report them)."""

    def __init__(self, inner: Tool, reporter: _Reporter) -> None:
        self._inner = inner
        self._reporter = reporter

    def __repr__(self) -> str:
        return f"<_ReportedTool {self._inner!r}>"

    @property
    def spec(self) -> ToolSpec:
        """The inner tool's spec, read each time (the subagent tool's follows the registry)."""
        return self._inner.spec

    @property
    def needs_approval(self) -> bool:
        """Whether the inner tool needs approval."""
        return self._inner.needs_approval

    async def run(self, invocation: ToolInvocation) -> str:
        """Run the inner tool; report the call when a subagent makes it."""
        children = self._reporter.children
        if children is not None and self._inner.spec.name == self._reporter.delegate_tool:
            children.check_room()
        own = self._reporter.agent
        if own is not None and invocation.context is own.context:
            return await self._inner.run(invocation)
        self._reporter.started(invocation)
        try:
            output = await self._inner.run(invocation)
        except ToolError as exc:
            self._reporter.finished(invocation, f"error: {exc}", failed=True)
            raise
        except Exception as exc:
            self._reporter.finished(invocation, f"error: the tool failed ({type(exc).__name__})", failed=True)
            raise
        self._reporter.finished(invocation, output, failed=False)
        return output


class _DepthCappedTool:
    """The subagent tool with a ceiling on the ``depth_limit`` of every run it starts."""

    needs_approval = False

    def __init__(self, inner: Tool, cap: int) -> None:
        self._inner = inner
        self._cap = cap
        self._spec: tuple[ToolSpec, ToolSpec] | None = None  # (the inner spec, ours)

    def __repr__(self) -> str:
        return f"<_DepthCappedTool {self._inner!r} cap={self._cap}>"

    @property
    def spec(self) -> ToolSpec:
        """The inner spec, with the ceiling stated in the description (the model is told the truth)."""
        spec = self._inner.spec
        if self._spec is not None and self._spec[0] is spec:
            return self._spec[1]  # read at every model call: rebuilt only when the inner one changed
        if self._cap == 0:
            note = "Here subagents may not start subagents of their own (`depth_limit` is always 0)."
        else:
            note = (
                f"Here a subagent may start at most {self._cap} level(s) of subagents below itself: "
                f"`depth_limit` is at most {self._cap}, and {self._cap} when left out."
            )
        capped = ToolSpec(spec.name, f"{spec.description}\n\n{note}", spec.parameters)
        self._spec = (spec, capped)
        return capped

    async def run(self, invocation: ToolInvocation) -> str:
        """Run the inner tool with ``depth_limit`` lowered to the ceiling (or set to it when absent)."""
        arguments = thaw_json(invocation.arguments)
        if isinstance(arguments, dict):
            requested = arguments.get("depth_limit")
            # Only a missing or a valid, larger value changes: anything else is left for the subagent
            # tool to refuse with its own explanation.
            too_deep = (
                isinstance(requested, int) and not isinstance(requested, bool) and requested > self._cap
            )
            if requested is None or too_deep:
                arguments["depth_limit"] = self._cap
        capped = ToolInvocation(
            invocation.call_id, invocation.tool, freeze_json(arguments), invocation.context
        )
        return await self._inner.run(capped)
