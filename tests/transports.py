"""Transports written in tests, to show that the seam under the ACP client is really pluggable.

- `RelayTransport` wraps another transport, records what it was asked to open, and hands the client a
  `RelayChannel` that forwards exactly the members of `Channel`, nothing else: a client or provider that
  reached past the protocol (into `AgentProcess`) would fail with `AttributeError`.
- `InProcessTransport` runs an `AgentHandler` in this process over memory streams: no process, no pipe,
  and (``local_files=False`` by default) no claim to share this host's files.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.abc
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from subagent.acp import RequestError, schema
from subagent.acp.agent import (
    AgentHandler,
    AgentSideConnection,
    ClientPeer,
    PromptTurn,
    negotiate_protocol_version,
)
from subagent.acp.transports import Channel, ExitInfo, TeardownReport, TeardownStep, Transport

STREAM_BUFFER = 64
"""Chunks a memory stream holds before its sender waits: small, so back-pressure is exercised."""
IN_PROCESS_VIA = "via memory streams"
"""How an in-process agent's exit is described (`ExitInfo.via`)."""


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


class MemoryByteSendStream(anyio.abc.ByteSendStream):
    """A byte stream over a memory object stream; every chunk written is also kept in ``written``."""

    def __init__(self, inner: MemoryObjectSendStream[bytes], written: list[bytes] | None = None) -> None:
        self._inner = inner
        self.written = written

    async def send(self, item: bytes) -> None:
        if self.written is not None:
            self.written.append(bytes(item))
        await self._inner.send(bytes(item))

    async def send_eof(self) -> None:
        await self._inner.aclose()

    async def aclose(self) -> None:
        await self._inner.aclose()


class MemoryByteReceiveStream(anyio.abc.ByteReceiveStream):
    """The receiving end: chunks come out as sent, split only to honour ``max_bytes``."""

    def __init__(self, inner: MemoryObjectReceiveStream[bytes]) -> None:
        self._inner = inner
        self._pending = b""

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if not self._pending:
            self._pending = await self._inner.receive()  # EndOfStream once every sender closed
        chunk, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
        return chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def byte_pipe(written: list[bytes] | None = None) -> tuple[MemoryByteSendStream, MemoryByteReceiveStream]:
    send, receive = anyio.create_memory_object_stream[bytes](STREAM_BUFFER)
    return MemoryByteSendStream(send, written), MemoryByteReceiveStream(receive)


class InProcessChannel:
    """A `Channel` to an agent handler served in this process. The agent "exits" when its connection
    ends (stdin closed), when it calls `exit`, or when it is killed."""

    def __init__(self, argv: Sequence[str], sent: list[bytes]) -> None:
        self.command = tuple(argv)
        self.pid: int | None = None
        self.stdin, self._agent_stdin = byte_pipe(sent)
        self._agent_stdout, self.stdout = byte_pipe()
        self._returncode: int | None = None
        self._exited = anyio.Event()
        self._scope = anyio.CancelScope()
        self._report: TeardownReport | None = None
        self._teardown_lock = anyio.Lock()
        self._stderr = ""

    def describe(self) -> str:
        return "in process"

    def exit(self, returncode: int, stderr: str = "") -> None:
        """End the agent now with this status (as a process exits): its stdout reaches EOF."""
        if self._returncode is None:
            self._returncode = returncode
            self._stderr += stderr
        self._scope.cancel()

    async def serve(self, handler: AgentHandler) -> None:
        """Serve ``handler`` until the client closes stdin or the agent exits; then close its stdout."""
        with self._scope:
            await AgentSideConnection(handler, self._agent_stdin, self._agent_stdout, name="in-process").run()
        if self._returncode is None:
            self._returncode = 0
        await self._agent_stdout.aclose()
        await self._agent_stdin.aclose()
        self._exited.set()

    def exit_info(self) -> ExitInfo | None:
        if self._returncode is None or not self._exited.is_set():
            return None
        return ExitInfo(
            command=self.command,
            pid=None,
            returncode=self._returncode,
            stderr_tail=self._stderr,
            stderr_bytes_total=len(self._stderr.encode()),
            via=IN_PROCESS_VIA,
        )

    async def wait_exit(self) -> ExitInfo:
        await self._exited.wait()
        info = self.exit_info()
        assert info is not None
        return info

    def stderr_tail(self) -> str:
        return self._stderr

    def kill(self) -> None:
        self.exit(-9)

    async def aclose(self, *, stdin_close_timeout: float | None = None) -> TeardownReport:
        with anyio.CancelScope(shield=True):
            async with self._teardown_lock:
                if self._report is None:
                    self._report = await self._tear_down(stdin_close_timeout)
                report = self._report
        return report

    async def _tear_down(self, stdin_close_timeout: float | None) -> TeardownReport:
        exited_before = self._exited.is_set()
        steps = [TeardownStep.CLOSE_STDIN]
        await self.stdin.aclose()
        with anyio.move_on_after(1.0 if stdin_close_timeout is None else stdin_close_timeout):
            await self._exited.wait()
        if not self._exited.is_set():
            steps.append(TeardownStep.SIGKILL)
            self.kill()
            await self._exited.wait()
        await self.stdout.aclose()
        return TeardownReport(tuple(steps), exited_before_teardown=exited_before, group_gone=True)


@dataclass
class InProcessTransport:
    """Serves ``make_handler(channel)`` in this process for each ``open``; ``sent`` keeps every chunk
    the client wrote to an agent, in order."""

    make_handler: Callable[[InProcessChannel], AgentHandler]
    local_files: bool = False
    name: str = "in-process"
    stdin_close_timeout: float = 1.0
    sent: list[bytes] = field(default_factory=list)
    opened: list[Opened] = field(default_factory=list)

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
        channel = InProcessChannel(argv, self.sent)
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(channel.serve, self.make_handler(channel))
            try:
                yield channel
            finally:
                await channel.aclose()

    def sent_messages(self) -> list[dict[str, object]]:
        """Every JSON-RPC message the client sent, decoded, in order."""
        lines = b"".join(self.sent).splitlines()
        return [msgspec.json.decode(line) for line in lines if line.strip()]


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
