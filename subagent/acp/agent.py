"""The agent side of ACP: serve a client's requests with a typed handler, and talk back to the client.

The client spawns the agent and sends it `initialize`, `session/new`, `session/prompt`...; the agent answers,
streams `session/update` notifications while a prompt runs, and may itself ask the client things
(`session/request_permission`, `fs/*`, `terminal/*`). `AgentSideConnection` does the protocol part over
the same JSON-RPC `Connection` the client uses; an `AgentHandler` does the agent's part::

    class EchoAgent(AgentHandler):
        async def initialize(self, params, client):
            version = negotiate_protocol_version(params.protocol_version)
            return schema.InitializeResponse(protocol_version=version)

        async def new_session(self, params, client):
            return schema.NewSessionResponse(session_id="session-1")

        async def prompt(self, params, turn):
            with turn.abort_on_cancel():
                await turn.send_text("you said: " + turn.prompt_text())
            return schema.PromptResponse(stop_reason="cancelled" if turn.cancel_requested else "end_turn")

    anyio.run(serve_stdio, EchoAgent())      # an agent process speaking ACP on its stdin/stdout

Dispatch
    Each client request is decoded with `schema.decode` into its wire type (a mismatch answers -32602) and
    passed to the handler method of the same meaning. A handler that lacks an optional method (or inherits
    the default from `AgentHandler`) answers -32601. Methods whose name starts with `_` (ACP extensions) go
    to `ext_method` / `ext_notification`; other unknown requests get -32601 and unknown notifications are
    ignored. A handler raises `RequestError` to choose the error object; any other exception is logged and
    answered as a bare -32603 that says nothing about its cause.

Initialization first
    Until `initialize` has been answered with a result, every other request (`session/new`,
    `session/prompt`, extensions...) is refused with -32600 "Invalid Request", ``data: {"details": ...,
    "method": ...}``, and the handler never sees it: the spec has the client initialize first, and an
    agent that served a session before negotiating the protocol version and capabilities would be
    guessing both. -32600 because the request is invalid in this state (JSON-RPC has no "not
    initialized" code; ACP's -32000 would send the client off to authenticate, and -32002 means
    "resource not found"). A request that arrives while an `initialize` is being served (a client that
    does not wait for its answer) waits for it, and is served if it succeeded. Notifications before it
    are ignored. ``require_initialize=False`` turns this off.

Results
    A handler returns the method's schema response type, encoded with `schema.encode`. To send exactly
    some JSON instead (e.g. a field newer than this schema, like the unstable `usage` of a prompt response),
    return `msgspec.Raw`.

Cancellation
    `session/cancel` marks every prompt turn in flight for that session as cancelled: `PromptTurn`'s event
    fires, scopes opened with `PromptTurn.abort_on_cancel` are cancelled, and the handler's optional
    `cancel` hook runs. The spec says the prompt must then answer `stopReason: "cancelled"` (never an
    error); with ``strict_cancel`` (the default) this class enforces it, replacing another stop reason or an
    exception raised after the cancel. `session/close` cancels the session's turns the same way first.

Stdio
    `serve_stdio` serves a handler on this process's stdin/stdout, opened by
    `subagent.acp._stdio.stdio_streams` (which keeps a stray ``print`` off the protocol channel).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Final, Protocol, TypeAlias, TypeVar, Unpack

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec

from subagent.acp import schema, schema_unstable
from subagent.acp._errors import ConnectionClosedError, InvalidResponseError, RequestError
from subagent.acp._stdio import stdio_streams
from subagent.acp.connection import Connection, ConnectionOptions

__all__ = [
    "SUPPORTED_PROTOCOL_VERSIONS",
    "AgentHandler",
    "AgentSideConnection",
    "ClientPeer",
    "PromptTurn",
    "negotiate_protocol_version",
    "serve_stdio",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

SUPPORTED_PROTOCOL_VERSIONS: Final = (schema.PROTOCOL_VERSION,)
"""The ACP protocol versions this implementation speaks."""

_NULL: Final = b"null"


def negotiate_protocol_version(requested: int) -> int:
    """The version an agent answers `initialize` with: the client's if supported, else our latest (spec)."""
    return requested if requested in SUPPORTED_PROTOCOL_VERSIONS else max(SUPPORTED_PROTOCOL_VERSIONS)


# -- talking back to the client --------------------------------------------------------------------------


class ClientPeer:
    """The client, as the agent sees it: send it session updates and ask it things.

    Every method is a thin typed wrapper over `request`/`notify`: params are encoded with `schema.encode`
    and results decoded with the tolerant `schema.decode`. Nothing here checks the client's capabilities
    first (a real agent should look at `capabilities` before calling `fs/*` or `terminal/*`; a test agent
    may want to call them regardless).

    Raises (every request method):
        RequestError: the client answered with an error object.
        ConnectionClosedError: the connection closed first.
        InvalidResponseError: the result does not fit the method's response type.
        MessageTooLargeError: the message is over the client's line limit (`outgoing`: nothing was sent),
            or the client's answer was over ours. `notify` and `session_update` raise the first too.
    """

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self.capabilities: schema.ClientCapabilities | None = None
        """What the client advertised in `initialize` (None before it)."""
        self.client_info: schema.Implementation | None = None
        """The client's name and version from `initialize`, if it sent them."""
        self.protocol_version: int | None = None
        """The protocol version the agent answered `initialize` with (None before it)."""
        self.subagents = False
        """Whether the client advertised ACP's (unstable) ``subagents`` capability in `initialize`: only
        then may the agent announce child sessions with ``subagent_update``."""

    async def request(self, method: str, params: Any = None, *, result_type: type[T]) -> T:
        """Send any request; `params` is a schema struct, plain JSON data, `msgspec.Raw`, or None.

        A `null` result reads as ``result_type()`` when that type has no required field (the spec lets
        clients answer `fs/write_text_file` with `null`). Pass ``result_type=msgspec.Raw`` for the raw JSON.
        """
        raw = await self._connection.request(method, params)
        if result_type is msgspec.Raw:
            return raw  # type: ignore[return-value]  # checked just above: T is msgspec.Raw
        try:
            return schema.decode(memoryview(raw), type=result_type)
        except msgspec.ValidationError as exc:
            if bytes(raw) == _NULL and issubclass(result_type, msgspec.Struct):
                with contextlib.suppress(TypeError):
                    return result_type()
            raise InvalidResponseError(method, str(exc)) from exc
        except msgspec.DecodeError as exc:
            raise InvalidResponseError(method, str(exc)) from exc

    async def notify(self, method: str, params: Any = None) -> None:
        """Send any notification; `params` as for `request`."""
        await self._connection.notify(method, params)

    async def session_update(
        self, session_id: str, update: schema.SessionUpdate, *, meta: dict[str, Any] | None = None
    ) -> None:
        """Send one `session/update` notification for `session_id`."""
        await self.notify(
            schema.SESSION_UPDATE, schema.SessionNotification(session_id=session_id, update=update, meta=meta)
        )

    async def request_permission(
        self, request: schema.RequestPermissionRequest
    ) -> schema.RequestPermissionResponse:
        """Ask `session/request_permission`; the outcome is `selected` (with an option id) or `cancelled`."""
        return await self.request(
            schema.SESSION_REQUEST_PERMISSION, request, result_type=schema.RequestPermissionResponse
        )

    async def read_text_file(self, request: schema.ReadTextFileRequest) -> schema.ReadTextFileResponse:
        """`fs/read_text_file` (a missing file is usually answered -32002)."""
        return await self.request(schema.FS_READ_TEXT_FILE, request, result_type=schema.ReadTextFileResponse)

    async def write_text_file(self, request: schema.WriteTextFileRequest) -> schema.WriteTextFileResponse:
        """`fs/write_text_file`."""
        return await self.request(
            schema.FS_WRITE_TEXT_FILE, request, result_type=schema.WriteTextFileResponse
        )

    async def create_terminal(self, request: schema.CreateTerminalRequest) -> schema.CreateTerminalResponse:
        """`terminal/create`: the command starts in the background; the answer holds its terminal id."""
        return await self.request(schema.TERMINAL_CREATE, request, result_type=schema.CreateTerminalResponse)

    async def terminal_output(self, request: schema.TerminalOutputRequest) -> schema.TerminalOutputResponse:
        """`terminal/output`: the output so far, and the exit status once it exited."""
        return await self.request(schema.TERMINAL_OUTPUT, request, result_type=schema.TerminalOutputResponse)

    async def wait_for_terminal_exit(
        self, request: schema.WaitForTerminalExitRequest
    ) -> schema.WaitForTerminalExitResponse:
        """`terminal/wait_for_exit`."""
        return await self.request(
            schema.TERMINAL_WAIT_FOR_EXIT, request, result_type=schema.WaitForTerminalExitResponse
        )

    async def kill_terminal(self, request: schema.KillTerminalRequest) -> schema.KillTerminalResponse:
        """`terminal/kill` (the terminal stays valid until released)."""
        return await self.request(schema.TERMINAL_KILL, request, result_type=schema.KillTerminalResponse)

    async def release_terminal(
        self, request: schema.ReleaseTerminalRequest
    ) -> schema.ReleaseTerminalResponse:
        """`terminal/release`: kill if still running and free it; an agent must release what it creates."""
        return await self.request(
            schema.TERMINAL_RELEASE, request, result_type=schema.ReleaseTerminalResponse
        )


# -- one prompt turn -------------------------------------------------------------------------------------


class PromptTurn:
    """One `session/prompt` in progress, handed to `AgentHandler.prompt`.

    Cancellation is cooperative: `cancel_requested` / `wait_cancelled` let the handler notice a
    `session/cancel`, and `abort_on_cancel` gives it a scope that is cancelled at that moment.
    """

    def __init__(self, request: schema.PromptRequest, client: ClientPeer) -> None:
        self.request = request
        """The prompt request as received."""
        self.client = client
        """Talk back to the client (see `ClientPeer`)."""
        self._cancelled = anyio.Event()
        self._scopes: list[anyio.CancelScope] = []

    @property
    def session_id(self) -> str:
        """The session this turn runs in."""
        return self.request.session_id

    @property
    def cancel_requested(self) -> bool:
        """Whether the client sent `session/cancel` (or `session/close`) for this session during the turn."""
        return self._cancelled.is_set()

    async def wait_cancelled(self) -> None:
        """Return once the client has cancelled this turn (at once if it already has)."""
        await self._cancelled.wait()

    @contextlib.contextmanager
    def abort_on_cancel(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope that the client's cancel cancels: the block is aborted, execution goes on after it.

        Check `cancel_requested` after the block to tell an aborted block from a finished one. A cancel that
        already arrived aborts the block at its first checkpoint.
        """
        with anyio.CancelScope() as scope:
            if self.cancel_requested:
                scope.cancel()
            self._scopes.append(scope)
            try:
                yield scope
            finally:
                self._scopes.remove(scope)

    def prompt_text(self) -> str:
        """The text of the prompt's text blocks, joined by blank lines (other block types are left out)."""
        return "\n\n".join(
            block.text for block in self.request.prompt if isinstance(block, schema.TextContent)
        )

    async def send_update(self, update: schema.SessionUpdate) -> None:
        """Send one `session/update` for this turn's session."""
        await self.client.session_update(self.session_id, update)

    async def send_text(self, text: str, *, message_id: str | None = None) -> None:
        """Send one `agent_message_chunk` with a text block."""
        await self.send_update(
            schema.AgentMessageChunk(content=schema.TextContent(text=text), message_id=message_id)
        )

    def _request_cancel(self) -> None:
        self._cancelled.set()
        for scope in self._scopes:
            scope.cancel()


# -- the handler -----------------------------------------------------------------------------------------


_Params = TypeVar("_Params")
_Result = TypeVar("_Result")

_Serves: TypeAlias = Callable[[_Params, ClientPeer], Awaitable[_Result | msgspec.Raw]]
"""An optional request method of `AgentHandler`: ``await method(params, client)`` answers the result."""


class AgentHandler(Protocol):
    """What an agent implements. Subclass it to inherit the optional members, which are None here.

    `initialize`, `new_session` and `prompt` are required. Every other member is optional: None here (or a
    missing attribute on an object that does not subclass this) is a request answered -32601 `Method not
    found`, or a notification ignored. Every method may instead return `msgspec.Raw` to send exactly that
    JSON as the result.
    """

    async def initialize(
        self, params: schema.InitializeRequest, client: ClientPeer
    ) -> schema.InitializeResponse | msgspec.Raw:
        """Answer `initialize`; use `negotiate_protocol_version(params.protocol_version)` for the version."""
        ...

    async def new_session(
        self, params: schema.NewSessionRequest, client: ClientPeer
    ) -> schema.NewSessionResponse | msgspec.Raw:
        """Create a session (gate it with `RequestError.auth_required()` until authenticated, if needed)."""
        ...

    async def prompt(
        self, params: schema.PromptRequest, turn: PromptTurn
    ) -> schema.PromptResponse | msgspec.Raw:
        """Run one turn: stream updates with `turn.send_update`, then answer the stop reason."""
        ...

    # The optional members: None here means not served (answered -32601 `Method not found`). A subclass
    # serves one by defining it as a method with the signature its type gives (params, client).

    authenticate: _Serves[schema.AuthenticateRequest, schema.AuthenticateResponse] | None = None
    """`authenticate` with one of the advertised auth methods."""
    load_session: _Serves[schema.LoadSessionRequest, schema.LoadSessionResponse] | None = None
    """`session/load`: replay the conversation as `session/update` notifications, then answer."""
    resume_session: _Serves[schema.ResumeSessionRequest, schema.ResumeSessionResponse] | None = None
    """`session/resume`: like load, without replay."""
    set_session_mode: _Serves[schema.SetSessionModeRequest, schema.SetSessionModeResponse] | None = None
    """`session/set_mode`."""
    set_session_config_option: (
        _Serves[schema.SetSessionConfigOptionRequest, schema.SetSessionConfigOptionResponse] | None
    ) = None
    """`session/set_config_option`."""
    list_sessions: _Serves[schema.ListSessionsRequest, schema.ListSessionsResponse] | None = None
    """`session/list`."""
    close_session: _Serves[schema.CloseSessionRequest, schema.CloseSessionResponse] | None = None
    """`session/close` (the session's turns in flight are already marked cancelled)."""
    delete_session: _Serves[schema.DeleteSessionRequest, schema.DeleteSessionResponse] | None = None
    """`session/delete`."""
    logout: _Serves[schema.LogoutRequest, schema.LogoutResponse] | None = None
    """`logout`."""
    cancel: Callable[[schema.CancelNotification, ClientPeer], Awaitable[None]] | None = None
    """Told about `session/cancel` after the session's turns were marked; runs in notification order."""
    ext_method: Callable[[str, msgspec.Raw | None, ClientPeer], Awaitable[Any]] | None = None
    """An extension request (name starting with `_`): `(method, params, client)`; returns any
    JSON-encodable result."""
    ext_notification: Callable[[str, msgspec.Raw | None, ClientPeer], Awaitable[None]] | None = None
    """An extension notification (name starting with `_`): `(method, params, client)`."""


_REQUESTS: Final[dict[str, tuple[str, Any]]] = {
    schema.INITIALIZE: ("initialize", schema.InitializeRequest),
    schema.AUTHENTICATE: ("authenticate", schema.AuthenticateRequest),
    schema.SESSION_NEW: ("new_session", schema.NewSessionRequest),
    schema.SESSION_LOAD: ("load_session", schema.LoadSessionRequest),
    schema.SESSION_RESUME: ("resume_session", schema.ResumeSessionRequest),
    schema.SESSION_SET_MODE: ("set_session_mode", schema.SetSessionModeRequest),
    schema.SESSION_SET_CONFIG_OPTION: ("set_session_config_option", schema.SetSessionConfigOptionRequest),
    schema.SESSION_LIST: ("list_sessions", schema.ListSessionsRequest),
    schema.SESSION_CLOSE: ("close_session", schema.CloseSessionRequest),
    schema.SESSION_DELETE: ("delete_session", schema.DeleteSessionRequest),
    schema.LOGOUT: ("logout", schema.LogoutRequest),
}
"""For each request served by plain dispatch: the handler attribute that serves it, and its params type."""


def _decode(params: msgspec.Raw | None, params_type: Any) -> Any:
    """Decode params tolerantly; a mismatch raises `msgspec.ValidationError`, which answers -32602."""
    return schema.decode(_NULL if params is None else memoryview(params), type=params_type)


class AgentSideConnection:
    """Serve an `AgentHandler` to the ACP client at the other end of a pair of byte streams.

    Drive it with ``async with AgentSideConnection(...) as agent:`` (served in the background until the
    block exits) or ``await agent.run()`` (returns when the client closes the stream, or on `close`).
    End of stream stops everything at once by default: the connection cancels the requests still being
    served, and they go unanswered. With ``drain_on_eof`` they may finish first (for a client that writes
    its requests, closes the agent's stdin and reads the answers: a shell pipe).

    Args:
        handler: the agent.
        receive_stream: the client's messages (the agent process's stdin).
        send_stream: where ours go (the agent process's stdout).
        strict_cancel: answer `cancelled` to a prompt whose turn was cancelled, whatever the handler returned
            or raised after the cancel (the spec's MUST). Turn it off only to emulate a non-compliant agent.
        require_initialize: refuse every request before `initialize` succeeded (-32600), as the module
            docstring says. Turn it off only to emulate a lax agent.
        connection_options: passed to the `Connection` (`ConnectionOptions`: ``max_line_bytes``,
            ``max_send_bytes``, the client's line limit, which is ``max_line_bytes`` unless given,
            ``on_protocol_error``, ``drain_on_eof``...); ``name``, which names it in log messages, is
            "acp-agent" unless given.
    """

    def __init__(
        self,
        handler: AgentHandler,
        receive_stream: anyio.abc.ByteReceiveStream,
        send_stream: anyio.abc.ByteSendStream,
        *,
        strict_cancel: bool = True,
        require_initialize: bool = True,
        **connection_options: Unpack[ConnectionOptions],
    ) -> None:
        self._handler = handler
        self._name = connection_options.setdefault("name", "acp-agent")
        self._strict_cancel = strict_cancel
        self._initialized = not require_initialize
        self._initializing = 0  # initialize requests received and not yet answered
        self._initialize_settled = anyio.Event()  # replaced each time one is answered
        self._connection = Connection(
            receive_stream,
            send_stream,
            request_handler=self._on_request,
            notification_handler=self._on_notification,
            value_encoder=schema.encode,
            on_request_received=self._on_request_received,
            **connection_options,
        )
        self._client = ClientPeer(self._connection)
        self._turns: dict[str, list[PromptTurn]] = {}

    @property
    def client(self) -> ClientPeer:
        """Talk to the client outside a handler (e.g. push updates between turns)."""
        return self._client

    @property
    def connection(self) -> Connection:
        """The underlying JSON-RPC connection (statistics, `closed_error`)."""
        return self._connection

    def active_turns(self, session_id: str) -> list[PromptTurn]:
        """The prompt turns of `session_id` still in flight."""
        return list(self._turns.get(session_id, ()))

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until the client closes the stream (EOF), the stream breaks, or `close()`."""
        await self._connection.run(task_status=task_status)

    def close(self) -> None:
        """Stop serving: requests in flight are cancelled, and `run()` returns."""
        self._connection.close()

    async def __aenter__(self) -> AgentSideConnection:
        await self._connection.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._connection.__aexit__(*exc_info)

    # -- requests ----------------------------------------------------------------------------------------

    async def _on_request(self, method: str, params: msgspec.Raw | None) -> Any:
        try:
            return await self._dispatch_request(method, params)
        except ConnectionClosedError as exc:
            # The client went away while the handler worked (e.g. it closed stdin mid-turn): no answer can
            # reach it. An error answer is dropped quietly; any other exception would be logged as a bug.
            logger.debug("%s: the connection closed while serving %s: %s", self._name, method, exc)
            raise RequestError.internal_error() from exc

    def _on_request_received(self, method: str) -> Callable[[], None] | None:
        # Counted on arrival, not when its task starts: a request right behind it must find it.
        if method != schema.INITIALIZE:
            return None
        self._initializing += 1
        return self._initialize_over

    def _initialize_over(self) -> None:
        self._initializing -= 1
        self._initialize_settled.set()
        self._initialize_settled = anyio.Event()

    async def _dispatch_request(self, method: str, params: msgspec.Raw | None) -> Any:
        if method == schema.INITIALIZE:
            return await self._serve_initialize(params)
        while not self._initialized and self._initializing:
            await self._initialize_settled.wait()
        if not self._initialized:
            raise RequestError.invalid_request(
                {"details": "the client must send initialize first", "method": method}
            )
        if method == schema.SESSION_PROMPT:
            return await self._serve_prompt(params)
        entry = _REQUESTS.get(method)
        if entry is None:
            if method.startswith("_"):
                extension = getattr(self._handler, "ext_method", None)
                if extension is not None:
                    return await extension(method, params, self._client)
            raise RequestError.method_not_found(method)
        attribute, params_type = entry
        serve: Callable[[Any, ClientPeer], Awaitable[Any]] | None = getattr(self._handler, attribute, None)
        if serve is None:
            raise RequestError.method_not_found(method)
        request = _decode(params, params_type)
        if method == schema.SESSION_CLOSE:
            self._cancel_turns(request.session_id)
        return await serve(request, self._client)

    async def _serve_initialize(self, params: msgspec.Raw | None) -> Any:
        request = _decode(params, schema.InitializeRequest)
        self._client.capabilities = request.client_capabilities
        self._client.client_info = request.client_info
        # The stable capabilities have no `subagents`: the unstable request's do (read once a connection).
        unstable_request = _decode(params, schema_unstable.InitializeRequest)
        self._client.subagents = unstable_request.client_capabilities.subagents is not None
        result = await self._handler.initialize(request, self._client)
        self._initialized = True
        if isinstance(result, schema.InitializeResponse):
            self._client.protocol_version = result.protocol_version
        return result

    async def _serve_prompt(self, params: msgspec.Raw | None) -> Any:
        request = _decode(params, schema.PromptRequest)
        turn = PromptTurn(request, self._client)
        turns = self._turns.setdefault(request.session_id, [])
        turns.append(turn)
        try:
            result = await self._handler.prompt(request, turn)
        except Exception:
            # The boundary the spec draws: after a cancel, whatever the handler's work raised (an aborted
            # tool, a permission request answered with an error) is the cancellation, not a failure.
            if not (self._strict_cancel and turn.cancel_requested):
                raise
            logger.debug("prompt in session %s failed after its cancel; answering cancelled", turn.session_id)
            return schema.PromptResponse(stop_reason="cancelled")
        finally:
            turns.remove(turn)
            if not turns:
                del self._turns[request.session_id]
        if (
            self._strict_cancel
            and turn.cancel_requested
            and isinstance(result, schema.PromptResponse)
            and result.stop_reason != "cancelled"
        ):
            logger.info(
                "prompt in session %s answered %r after its cancel; answering cancelled",
                turn.session_id,
                result.stop_reason,
            )
            return schema.PromptResponse(stop_reason="cancelled", meta=result.meta)
        return result

    # -- notifications -----------------------------------------------------------------------------------

    async def _on_notification(self, method: str, params: msgspec.Raw | None) -> None:
        if not self._initialized:
            logger.debug("ignoring the notification %r: the client has not initialized", method)
            return
        if method == schema.SESSION_CANCEL:
            try:
                cancel = _decode(params, schema.CancelNotification)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                logger.warning("ignoring a malformed session/cancel: %s", exc)
                return
            self._cancel_turns(cancel.session_id)
            hook = getattr(self._handler, "cancel", None)
            if hook is not None:
                await hook(cancel, self._client)
        elif method.startswith("_"):
            hook = getattr(self._handler, "ext_notification", None)
            if hook is not None:
                await hook(method, params, self._client)
        else:
            logger.debug("ignoring the notification %r", method)

    def _cancel_turns(self, session_id: str) -> None:
        turns = self._turns.get(session_id, ())
        if not turns:
            logger.debug("cancel for session %s, which has no turn in flight", session_id)
        for turn in turns:
            turn._request_cancel()


async def serve_stdio(handler: AgentHandler, **options: Any) -> None:
    """Serve `handler` on this process's stdin/stdout until the client closes stdin.

    `options` are passed to `AgentSideConnection` (e.g. ``strict_cancel``, ``name``).
    """
    with stdio_streams() as (receive_stream, send_stream):
        await AgentSideConnection(handler, receive_stream, send_stream, **options).run()
