"""Transports written in tests, to show that the seam under the ACP client is really pluggable.

- `RelayTransport` wraps another transport, records what it was asked to open, and hands the client a
  `RelayChannel` that forwards exactly the members of `Channel`, nothing else: a client or provider that
  reached past the protocol (into `AgentProcess`) would fail with `AttributeError`.
- `ScriptedHandler` is an agent for `subagent.testing.InProcessTransport`, which serves it in this process.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.abc

from subagent.acp import RequestError, schema
from subagent.acp.agent import (
    AgentHandler,
    ClientPeer,
    PromptTurn,
    negotiate_protocol_version,
)
from subagent.acp.transports import Channel, ExitInfo, TeardownReport, Transport
from subagent.testing import InProcessChannel

# -- relaying: a transport around another one ---------------------------------------------------------


@dataclass(frozen=True)
class Opened:
    """One ``open`` call as the transport received it."""

    argv: tuple[str, ...]
    env: Mapping[str, str] | None
    cwd: str | None


class RelayChannel:
    """Forwards the `Channel` members, and only those, to the channel it wraps."""

    def __init__(self, inner: Channel) -> None:
        self._inner = inner

    @property
    def stdin(self) -> anyio.abc.ByteSendStream:
        return self._inner.stdin

    @property
    def stdout(self) -> anyio.abc.ByteReceiveStream:
        return self._inner.stdout

    @property
    def command(self) -> tuple[str, ...]:
        return self._inner.command

    @property
    def pid(self) -> int | None:
        return self._inner.pid

    def describe(self) -> str:
        return f"{self._inner.describe()} via relay"

    def exit_info(self) -> ExitInfo | None:
        return self._inner.exit_info()

    async def wait_exit(self) -> ExitInfo:
        return await self._inner.wait_exit()

    def stderr_tail(self) -> str:
        return self._inner.stderr_tail()

    def kill(self) -> None:
        self._inner.kill()

    async def aclose(self, *, stdin_close_timeout: float | None = None) -> TeardownReport:
        return await self._inner.aclose(stdin_close_timeout=stdin_close_timeout)


@dataclass
class RelayTransport:
    """Opens channels through ``inner``; remembers each ``open`` call and each channel it handed out."""

    inner: Transport
    local_files: bool = True
    opened: list[Opened] = field(default_factory=list)
    channels: list[RelayChannel] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"relay+{self.inner.name}"

    @property
    def stdin_close_timeout(self) -> float:
        return self.inner.stdin_close_timeout

    @contextlib.asynccontextmanager
    async def open(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        on_stderr_line: Callable[[str], object] | None = None,
    ) -> AsyncIterator[Channel]:
        self.opened.append(Opened(tuple(argv), None if env is None else dict(env), cwd))
        async with self.inner.open(argv, env=env, cwd=cwd, on_stderr_line=on_stderr_line) as channel:
            relay = RelayChannel(channel)
            self.channels.append(relay)
            yield relay


# -- in process: an agent handler over memory streams -------------------------------------------------


class ScriptedHandler(AgentHandler):
    """An in-process agent: each prompt sends ``text`` and ends the turn, or (``work``) sends it and
    works until cancelled; ``exit_at_initialize`` exits with that status instead of answering."""

    def __init__(
        self,
        channel: InProcessChannel,
        *,
        text: str,
        work: bool = False,
        exit_at_initialize: int | None = None,
        read_file: str | None = None,
    ) -> None:
        self.channel = channel
        self.text = text
        self.work = work
        self.exit_at_initialize = exit_at_initialize
        self.read_file = read_file
        self.read_error: RequestError | None = None
        """The client's answer to ``fs/read_text_file`` of ``read_file``, when it was an error."""

    async def initialize(
        self, params: schema.InitializeRequest, client: ClientPeer
    ) -> schema.InitializeResponse:
        if self.exit_at_initialize is not None:
            self.channel.exit(self.exit_at_initialize, "in-process agent: giving up\n")
            await anyio.sleep_forever()
        return schema.InitializeResponse(protocol_version=negotiate_protocol_version(params.protocol_version))

    async def new_session(
        self, params: schema.NewSessionRequest, client: ClientPeer
    ) -> schema.NewSessionResponse:
        return schema.NewSessionResponse(session_id="in-process-session")

    async def prompt(self, params: schema.PromptRequest, turn: PromptTurn) -> schema.PromptResponse:
        if self.read_file is not None:
            request = schema.ReadTextFileRequest(session_id=turn.session_id, path=self.read_file)
            try:
                await turn.client.read_text_file(request)
            except RequestError as exc:
                self.read_error = exc
        await turn.send_text(self.text)
        if self.work:
            await turn.wait_cancelled()
        return schema.PromptResponse(stop_reason="cancelled" if turn.cancel_requested else "end_turn")
