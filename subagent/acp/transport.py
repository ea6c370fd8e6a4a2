"""Where a child agent runs: a *transport* opens a *channel* to it from argv, env and cwd.

The ACP client never spawns anything itself: `subagent.acp.client.spawn_agent` asks a `Transport` to
open a `Channel` (the agent's stdin and stdout as anyio byte streams, plus how it ended and what it
last wrote to stderr) and speaks JSON-RPC over the channel's streams. The transport owns the child
until its ``open`` block exits, and tears it down then, on every exit path.

`LocalTransport`, the default, is a child process of ours (`subagent.acp.process.open_agent_process`:
supervised, its whole tree torn down), and `subagent.acp.process.AgentProcess` is its channel. Other
transports put the child on another host; `transport_from_url` builds one from a URL (``local``,
``ssh://[user@]host[:port]``, ``ray://ADDRESS``), as the CLI's ``--on`` and the TOML config's
``transport`` give it.

Every transport's ``open`` first applies `check_command` (from `subagent.acp.process`, re-exported
here) to ``argv``, ``env`` and ``cwd``, so a command is refused the same way wherever it would run:
`BaseTransport` does it once for the transports here, which implement its ``launch``.

Files and terminals
    The client serves the agent's ``fs/*`` and ``terminal/*`` requests on *this* host. A transport whose
    `Transport.local_files` is False runs the child where our paths mean nothing, so the client then
    offers the agent neither: it reads and writes files itself, where it runs.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import anyio.abc

from subagent.acp.process import (
    STDIN_CLOSE_TIMEOUT,
    ExitInfo,
    TeardownReport,
    check_command,
    open_agent_process,
)

__all__ = [
    "TRANSPORT_SCHEMES",
    "BaseTransport",
    "Channel",
    "Launch",
    "LocalTransport",
    "Transport",
    "check_command",
    "transport_from_url",
]


@runtime_checkable
class Channel(Protocol):
    """A running child agent as the ACP client sees it, wherever it runs.

    `subagent.acp.process.AgentProcess` is the local one. A channel is only valid inside the ``open``
    block of the transport that opened it; after the block it still answers `exit_info` and
    `stderr_tail`.
    """

    @property
    def stdin(self) -> anyio.abc.ByteSendStream:
        """The agent's stdin (the client writes JSON-RPC lines to it); closing it is the agent's cue
        to finish."""
        ...

    @property
    def stdout(self) -> anyio.abc.ByteReceiveStream:
        """The agent's stdout (the client reads JSON-RPC lines from it); ends with `anyio.EndOfStream`."""
        ...

    @property
    def command(self) -> tuple[str, ...]:
        """The argv the agent was started with (as the transport was given it, not a wrapper's)."""
        ...

    @property
    def pid(self) -> int | None:
        """The pid of the local process we spawned for this agent (the agent itself locally, the
        ``ssh`` client over SSH), or None if there is none on this host."""
        ...

    def describe(self) -> str:
        """Where the agent runs, for messages: ``"pid 123"``, ``"pid 456 via ssh to build-1"``."""
        ...

    def exit_info(self) -> ExitInfo | None:
        """How the agent ended, or None while it runs (or while its end is not known here yet)."""
        ...

    async def wait_exit(self) -> ExitInfo:
        """Wait until the agent itself exits (not its descendants), let stderr settle (bounded), and
        describe the exit; a lost connection to a remote agent is an exit too."""
        ...

    def stderr_tail(self) -> str:
        """The last of the agent's stderr received so far, decoded as UTF-8 with replacement."""
        ...

    def kill(self) -> None:
        """Kill the agent's whole tree now, without waiting: synchronous, idempotent, never raises.
        ``aclose`` still reaps and closes."""
        ...

    async def aclose(self, *, stdin_close_timeout: float | None = None) -> TeardownReport:
        """Tear the agent's tree down (close stdin, wait, SIGTERM, wait, SIGKILL) and close the
        streams; idempotent, shielded from cancellation, bounded in time. ``stdin_close_timeout``
        overrides the grace after stdin closes, for this teardown."""
        ...


@runtime_checkable
class Transport(Protocol):
    """Opens channels to child agents: a place where they run, and how they get there."""

    @property
    def name(self) -> str:
        """What to call it in messages and listings: ``"local"``, ``"ssh://build-1"``."""
        ...

    @property
    def local_files(self) -> bool:
        """Whether the child sees this host's files, so the client may serve its ``fs/*`` and
        ``terminal/*`` requests here. False: the agent is offered neither."""
        ...

    @property
    def stdin_close_timeout(self) -> float:
        """The grace teardown gives the agent after its stdin closes (its channel's ``aclose``
        default); an idle agent is given at most this."""
        ...

    def open(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        on_stderr_line: Callable[[str], object] | None = None,
    ) -> AbstractAsyncContextManager[Channel]:
        """Start ``argv`` and own it until the block exits; then tear its whole tree down.

        Args:
            argv: The program and its arguments, as the host it runs on resolves them. No shell.
            env: Variables for the child, over the environment it would get there anyway (locally:
                this process's).
            cwd: The child's working directory, a path on the host it runs on.
            on_stderr_line: Called with each stderr line (decoded, without its newline) as it arrives;
                it must not block or raise.

        Raises:
            TypeError: ``argv`` is a single string (`check_command`).
            ValueError: ``argv`` is empty (`check_command`).
            AgentSpawnError: The agent could not be started (``__aenter__``), or `check_command`
                refused an argument, ``cwd`` or ``env`` entry; the reason never quotes an environment
                value.

        An exception from the block propagates unchanged after teardown.
        """
        ...


@dataclass(frozen=True, slots=True)
class Launch:
    """What `Transport.open` was asked to start, once `check_command` accepted it."""

    argv: tuple[str, ...]
    """The program and its arguments, as strings."""
    env: Mapping[str, str] | None
    cwd: str | None
    on_stderr_line: Callable[[str], object] | None


ChannelT = TypeVar("ChannelT", bound=Channel, covariant=True)
"""The kind of channel a `BaseTransport` opens."""


class BaseTransport(abc.ABC, Generic[ChannelT]):
    """The part of every transport that is the same: `open` applies `check_command` and hands the checked
    command to `launch`, which a transport implements (with `Transport`'s ``name``, ``local_files`` and
    ``stdin_close_timeout``). Subclassing it is optional: any object with `Transport`'s members is one."""

    def open(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        on_stderr_line: Callable[[str], object] | None = None,
    ) -> AbstractAsyncContextManager[ChannelT]:
        """`Transport.open`: `check_command` (raising at once), then `launch`."""
        argv = check_command(argv, env, cwd)
        return self.launch(Launch(argv, None if env is None else dict(env), cwd, on_stderr_line))

    @abc.abstractmethod
    def launch(self, launch: Launch) -> AbstractAsyncContextManager[ChannelT]:
        """Start a checked command and own it until the block exits (`Transport.open` says the rest)."""


class LocalTransport(BaseTransport[Channel]):
    """A child process of ours, supervised, torn down with its whole tree: the default transport.

    ``process_options`` are the keyword options of `subagent.acp.process.open_agent_process` (teardown
    timings, ``inherit_env``, ``stderr_tail_bytes``, ``supervise``...); they are checked when a
    channel is opened, as ``open_agent_process`` checks them.
    """

    name = "local"
    local_files = True

    def __init__(self, **process_options: Any) -> None:
        for reserved in ("argv", "env", "cwd", "on_stderr_line"):
            if reserved in process_options:
                raise TypeError(f"{reserved!r} is given to LocalTransport.open, not to LocalTransport")
        self.process_options: Mapping[str, Any] = dict(process_options)
        """The options given to every `open_agent_process` call."""

    def __repr__(self) -> str:
        options = ", ".join(f"{key}={value!r}" for key, value in self.process_options.items())
        return f"LocalTransport({options})"

    @property
    def stdin_close_timeout(self) -> float:
        """The ``stdin_close_timeout`` process option (`STDIN_CLOSE_TIMEOUT` by default)."""
        return float(self.process_options.get("stdin_close_timeout", STDIN_CLOSE_TIMEOUT))

    @contextlib.asynccontextmanager
    async def launch(self, launch: Launch) -> AsyncIterator[Channel]:
        """`open_agent_process` with this transport's options; the channel is its `AgentProcess`."""
        async with open_agent_process(
            launch.argv,
            env=launch.env,
            cwd=launch.cwd,
            on_stderr_line=launch.on_stderr_line,
            **self.process_options,
        ) as process:
            yield process


_SCHEME = re.compile(r"\A[A-Za-z][A-Za-z0-9+.-]{0,31}\Z")
"""A URL scheme (RFC 3986), of a sane length: anything else before ``://`` is not a scheme."""

TRANSPORT_SCHEMES: dict[str, str] = {
    "ssh": "subagent.acp.ssh:transport_from_url",
    "ray": "subagent.acp.ray:transport_from_url",
}
"""URL scheme -> ``"module:function"`` building that transport from the whole URL string (raising
`ValueError` for a malformed one). The module is imported only when its scheme is used; a scheme whose
module does not exist yet is reported as not available. ``local`` is not listed: it takes no URL."""


def transport_from_url(url: str | None) -> Transport:
    """The transport a URL names: ``None`` or ``"local"`` -> `LocalTransport` (default options);
    ``ssh://[user@]host[:port]`` -> the SSH transport; ``ray://ADDRESS`` -> the Ray transport.

    Error messages never quote the URL (it may carry a password): only its scheme.

    Raises:
        ValueError: The URL is malformed, its scheme is unknown, or its transport is not available
            in this installation.
    """
    if url is None or url == "local":
        return LocalTransport()
    if not isinstance(url, str):
        raise TypeError(f"a transport URL is a string, not {type(url).__name__}")
    forms = ["'local'", *(f"'{scheme}://…'" for scheme in TRANSPORT_SCHEMES)]
    expected = f"expected {', '.join(forms[:-1])} or {forms[-1]}"
    scheme, separator, _ = url.partition("://")
    if not separator or not _SCHEME.match(scheme):
        raise ValueError(f"not a transport URL: {expected}")
    target = TRANSPORT_SCHEMES.get(scheme.lower())
    if target is None:
        raise ValueError(f"unknown transport scheme {scheme!r}: {expected}")
    module_name, _, function_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise ValueError(f"the {scheme.lower()}:// transport is not available yet") from None
    factory: Callable[[str], Transport] = getattr(module, function_name)
    return factory(url)
