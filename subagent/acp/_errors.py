"""Every exception of the ACP layer: the JSON-RPC wire error, the local typed failures, the agent's.

Every exception this package raises derives from `AcpError`. Check errors by type and by `.code`, never by
their message text::

    AcpError
    ├── RequestError                 a JSON-RPC error object: answered by the peer, or raised by our handler
    ├── ConnectionClosedError        the connection is gone; pending and later requests fail with it
    ├── ProtocolError                the peer broke the wire protocol; reported, the connection goes on
    │   ├── MessageTooLargeError     a line over the limit: discarded unread, or (outgoing) refused unsent
    │   ├── MalformedMessageError    a line that is not UTF-8, not JSON, or not a JSON-RPC 2.0 envelope
    │   ├── UnexpectedResponseError  a response for an id we are not waiting for (unknown or duplicate)
    │   └── InvalidResponseError     a response that is broken, or does not decode into the type asked for
    ├── AgentError                   the agent failed us at the ACP level (raised by the client)
    │   ├── AgentExitedError         the agent exited or closed its stdout: exit status, stderr tail
    │   ├── ProtocolVersionError     the agent speaks a protocol version we do not
    │   ├── AuthenticationRequiredError  the agent wants `authenticate` first; its offers attached
    │   ├── AgentCapabilityError     the call needs a capability the agent did not advertise
    │   └── SessionSettingError      a mode, config option or value the agent does not offer
    └── AgentProcessError            owning a child agent process failed (raised by the local transport)
        └── AgentSpawnError          the program could not be started; nothing was left behind

`RequestError` is both directions of the same thing: `Connection.request()` raises it when the peer answers
with an error object, and a request handler raises it to choose exactly the error object the peer receives.

This module imports nothing of the package (the types named only in annotations excepted), so every layer
can raise from it without an import cycle.
"""

from __future__ import annotations

import enum
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from subagent.acp.schema import AuthMethod
    from subagent.acp.transports._channel import ExitInfo

__all__ = [
    "AcpError",
    "AgentCapabilityError",
    "AgentError",
    "AgentExitedError",
    "AgentProcessError",
    "AgentSpawnError",
    "AuthenticationRequiredError",
    "ConnectionClosedError",
    "InvalidResponseError",
    "MalformedMessageError",
    "MessageTooLargeError",
    "ProtocolError",
    "ProtocolVersionError",
    "RequestError",
    "RpcErrorCode",
    "SessionSettingError",
    "UnexpectedResponseError",
]


class RpcErrorCode(enum.IntEnum):
    """The JSON-RPC 2.0 and ACP error codes with a defined meaning (any other integer is allowed too)."""

    PARSE_ERROR = -32700
    INVALID_REQUEST = -32600
    METHOD_NOT_FOUND = -32601
    INVALID_PARAMS = -32602
    INTERNAL_ERROR = -32603
    AUTH_REQUIRED = -32000
    RESOURCE_NOT_FOUND = -32002
    REQUEST_CANCELLED = -32800
    PERMISSION_DENIED = -32003
    """Ours, not ACP's (it defines none for this): a request the client's permission policy refused,
    such as an ``fs/write_text_file`` nobody allowed. In the range JSON-RPC leaves to implementations."""


class AcpError(Exception):
    """Base class of every error raised by `subagent.acp`."""


class RequestError(AcpError):
    """A JSON-RPC error object: `{"code": int, "message": str, "data"?: any}`.

    `data` is any JSON-encodable value; `None` means the member is left out on the wire (a peer's explicit
    `"data": null` also reads back as `None`).
    """

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(code, message, data)
        self.code = code
        self.message = message
        self.data = data

    def __str__(self) -> str:
        return f"{self.message} ({self.code})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r}, data={self.data!r})"

    def to_wire(self) -> dict[str, Any]:
        """Return the error object as sent on the wire (`data` omitted when it is `None`)."""
        wire: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            wire["data"] = self.data
        return wire

    @classmethod
    def parse_error(cls, data: Any = None) -> RequestError:
        """-32700: the message was not valid JSON."""
        return cls(RpcErrorCode.PARSE_ERROR, "Parse error", data)

    @classmethod
    def invalid_request(cls, data: Any = None) -> RequestError:
        """-32600: the message was JSON but not a valid JSON-RPC request."""
        return cls(RpcErrorCode.INVALID_REQUEST, "Invalid Request", data)

    @classmethod
    def method_not_found(cls, method: str) -> RequestError:
        """-32601: nothing handles `method` (named in `data`)."""
        return cls(RpcErrorCode.METHOD_NOT_FOUND, "Method not found", {"method": method})

    @classmethod
    def invalid_params(cls, data: Any = None) -> RequestError:
        """-32602: the params did not match what the method expects."""
        return cls(RpcErrorCode.INVALID_PARAMS, "Invalid params", data)

    @classmethod
    def internal_error(cls, data: Any = None) -> RequestError:
        """-32603: the handler failed; say nothing about why unless `data` is safe to share."""
        return cls(RpcErrorCode.INTERNAL_ERROR, "Internal error", data)

    @classmethod
    def auth_required(cls, data: Any = None) -> RequestError:
        """-32000 (ACP): the agent needs `authenticate` before this request."""
        return cls(RpcErrorCode.AUTH_REQUIRED, "Authentication required", data)

    @classmethod
    def resource_not_found(cls, uri: str | None = None) -> RequestError:
        """-32002 (ACP): e.g. `fs/read_text_file` on a missing file (named in `data` when given)."""
        return cls(
            RpcErrorCode.RESOURCE_NOT_FOUND, "Resource not found", None if uri is None else {"uri": uri}
        )

    @classmethod
    def permission_denied(cls, message: str, data: Any = None) -> RequestError:
        """-32003 (ours): the client's permission policy refused the request; ``message`` says which."""
        return cls(RpcErrorCode.PERMISSION_DENIED, message, data)

    @classmethod
    def request_cancelled(cls, data: Any = None) -> RequestError:
        """-32800 (ACP): the request was aborted after a `$/cancel_request`."""
        return cls(RpcErrorCode.REQUEST_CANCELLED, "Request cancelled", data)


class ConnectionClosedError(AcpError):
    """The connection is closed: by the peer (EOF), by a broken stream, or locally.

    Every request pending at that moment fails with this error at once, and so does every later
    `request()` or `notify()`. `cause` is the underlying reason when there is one (the stream error, or
    whatever the layer that closed the connection passed to `Connection.close(cause=...)`, e.g. the child's
    exit status); it is also set as `__cause__`, so tracebacks chain it. A layer that learns more later
    (exit status, stderr tail) translates: `except ConnectionClosedError as exc: raise AgentExited(...) from
    exc`.
    """

    def __init__(
        self,
        message: str = "connection closed",
        *,
        cause: BaseException | None = None,
        end_of_stream: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.cause = cause
        self.__cause__ = cause
        self.end_of_stream = end_of_stream
        """Whether the peer closed its end cleanly (EOF), rather than the stream breaking or a local close."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, cause={self.cause!r})"

    def copy(self) -> ConnectionClosedError:
        """Return a fresh instance with the same message and cause, so that each waiter raises its own."""
        return type(self)(self.message, cause=self.cause, end_of_stream=self.end_of_stream)


class ProtocolError(AcpError):
    """The peer sent something that breaks JSON-RPC 2.0 framing or semantics.

    The connection reports these (log + `on_protocol_error`) and keeps going; only `InvalidResponseError`
    is raised to a caller, from the `request()` whose result it concerns.
    """


class MessageTooLargeError(ProtocolError):
    """A message longer than `limit` bytes; `size` is its length in bytes (without the newline).

    Incoming (`outgoing` False): the peer's line was skipped without being buffered; it is reported,
    and a `request()` whose response it was fails with it. Outgoing (`outgoing` True): raised at once by
    `request()`/`notify()` for a message the peer would discard (its line limit is `limit`), so nothing
    was sent and nobody waits for it.
    """

    def __init__(self, size: int, limit: int, *, outgoing: bool = False) -> None:
        if outgoing:
            message = f"refused to send a {size}-byte message: longer than the peer's {limit}-byte line limit"
        else:
            message = f"discarded a {size}-byte line: longer than the {limit}-byte limit"
        super().__init__(message)
        self.size = size
        self.limit = limit
        self.outgoing = outgoing


class MalformedMessageError(ProtocolError):
    """A line that is not UTF-8, not JSON, a batch, or not a JSON-RPC 2.0 envelope.

    `reason` says which; `excerpt` holds the line's first bytes for diagnosis (e.g. an agent that logs to
    stdout).
    """

    def __init__(self, reason: str, excerpt: bytes) -> None:
        super().__init__(f"skipped a malformed line ({reason}): {excerpt!r}")
        self.reason = reason
        self.excerpt = excerpt


class UnexpectedResponseError(ProtocolError):
    """A response whose id matches no pending request (never sent, already answered), or with a null id.

    `error` holds the error object when the response carried one (a null-id error is the peer saying it could
    not read something we sent).
    """

    def __init__(self, request_id: int | str | None, error: RequestError | None = None) -> None:
        detail = "" if error is None else f" carrying {error!r}"
        super().__init__(f"dropped a response to id {request_id!r}{detail}: no request is waiting for it")
        self.request_id = request_id
        self.error = error


class InvalidResponseError(ProtocolError):
    """The peer's answer to `method` is broken (not JSON, no result nor error, a malformed error object...)
    or could not be decoded as the caller asked; `detail` says which."""

    def __init__(self, method: str, detail: str) -> None:
        super().__init__(f"invalid response to {method!r}: {detail}")
        self.method = method
        self.detail = detail


class AgentError(AcpError):
    """A failure of the agent at the ACP level, as seen by the client."""


class AgentExitedError(AgentError):
    """The agent's connection closed: it exited, crashed, or closed its stdout.

    ``exit_info`` holds the exit status and the stderr tail when the agent is a child process we
    run and it exited; it is None when the connection closed but the process lives on (or there
    is no process).
    """

    def __init__(self, message: str, *, exit_info: ExitInfo | None = None) -> None:
        super().__init__(message)
        self.exit_info = exit_info


class ProtocolVersionError(AgentError):
    """The agent answered ``initialize`` with a protocol ``version`` other than the one this client
    speaks (``supported``)."""

    def __init__(self, version: int, supported: int) -> None:
        super().__init__(f"the agent speaks ACP protocol version {version}; this client speaks {supported}")
        self.version = version
        self.supported = supported


class AuthenticationRequiredError(AgentError):
    """The agent refused with -32000 "Authentication required"; ``auth_methods`` lists its offers."""

    def __init__(self, message: str, auth_methods: Sequence[AuthMethod]) -> None:
        super().__init__(message)
        self.auth_methods = tuple(auth_methods)


class AgentCapabilityError(AgentError):
    """The call needs an agent capability the agent did not advertise (e.g. ``loadSession``)."""


class SessionSettingError(AgentError):
    """A session mode, config option or option value that the agent does not offer.

    ``setting`` is what was asked for (``"mode"``, or a config option's id); ``offered`` lists what the
    agent offers instead (mode ids, config option ids, or the option's values), so a person can choose.
    """

    def __init__(self, message: str, *, setting: str, offered: Sequence[str]) -> None:
        super().__init__(message)
        self.setting = setting
        self.offered = tuple(offered)


class AgentProcessError(AcpError):
    """Base class for errors raised while owning a child agent process."""


class AgentSpawnError(AgentProcessError):
    """The agent could not be started: missing or non-executable program, bad cwd, a failed exec, or an
    argument, cwd or environment entry exec cannot carry.

    Raised before any background task starts; no process and no file descriptor is left behind.
    """

    def __init__(self, command: Sequence[str], reason: str) -> None:
        self.command: tuple[str, ...] = tuple(command)
        self.reason = reason
        super().__init__(f"cannot start agent `{shlex.join(self.command)}`: {reason}")
