"""Agents served inside the caller's event loop: an in-memory transport and the in-process stub agent.

`InProcessTransport` opens an `InProcessChannel` to an ACP agent written as an `AgentHandler`
(`subagent.acp.agent`), run as a task of the test's own event loop over memory byte streams: no process,
no pipe, no interpreter start. `StubAgentTransport` serves the scriptable stub agent (`ScenarioAgent`)
the same way. Either goes wherever a `Transport` goes (``AcpProvider(argv, transport=...)``,
``spawn_agent``); the argv is then only a name for messages.

The channel keeps the `Channel` protocol exactly, and its agent ends the way a process would look to the
client: when its handler's connection ends (the client closed stdin: status 0), when it calls
`InProcessChannel.exit` (status N), when it raises (its traceback on stderr, status 1), or when it is
killed or torn down (status ``-SIGKILL`` / ``-SIGTERM``). Its stdout then reaches EOF after what it had
written, so the client reports the same errors, with the same `ExitInfo`, as for a dead process.
Teardown follows a process's: close stdin, wait, "SIGTERM" (cancel the agent, unless it ignores SIGTERM),
wait, "SIGKILL". Buffers are bounded both ways (a writer waits while its reader lags) and the agent's task
never outlives the ``open`` block.
"""

from __future__ import annotations

import os
import signal
import traceback
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Final, TypedDict, Unpack

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from subagent.acp.agent import AgentHandler, AgentSideConnection
from subagent.acp.connection import ConnectionOptions
from subagent.acp.transports import SIGKILL_TIMEOUT, SIGTERM_TIMEOUT, STDERR_TAIL_BYTES
from subagent.acp.transports._channel import (
    BaseTransport,
    ExitInfo,
    Launch,
    StderrTail,
    TeardownReport,
    TeardownStep,
    own_channel,
)
from subagent.testing._scenario import (
    DEFAULT_SCENARIO_PATH,
    GrandchildStep,
    KillStep,
    Scenario,
    ScenarioError,
    Step,
    load_scenario,
    parse_scenario,
)
from subagent.testing.stub_agent import play_scenario

__all__ = [
    "IN_PROCESS_VIA",
    "MEMORY_CHUNK_BYTES",
    "MEMORY_PIPE_CHUNKS",
    "InProcessChannel",
    "InProcessOptions",
    "InProcessTransport",
    "MemoryByteReceiveStream",
    "MemoryByteSendStream",
    "StubAgentTransport",
    "memory_byte_pipe",
]

MEMORY_CHUNK_BYTES: Final = 64 * 1024
"""The most one chunk of a memory byte stream holds: a longer send is split, like a write to a pipe."""
MEMORY_PIPE_CHUNKS: Final = 16
"""Chunks a memory pipe holds before its writer waits: with `MEMORY_CHUNK_BYTES`, at most 1 MiB in flight."""
_STOPPING_SIGNALS: Final = frozenset({signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})
"""Signals whose default action stops a process: a state an in-process agent has no equivalent of."""
_IGNORED_SIGNALS: Final = frozenset({signal.SIGCHLD, signal.SIGCONT, signal.SIGURG, signal.SIGWINCH})
"""Signals whose default action is to do nothing: the agent lives on, as a process would."""
IN_PROCESS_VIA: Final = "via memory streams"
"""`ExitInfo.via` of an in-process agent: where a process's pid would be."""


# -- memory byte streams ---------------------------------------------------------------------------------


class MemoryByteSendStream(anyio.abc.ByteSendStream):
    """The writing end of a memory byte pipe (`memory_byte_pipe`): closing it is EOF for the reader once
    the reader has taken what was sent; sending after the reader closed raises `anyio.BrokenResourceError`
    (as a pipe whose reader is gone). A send longer than `MEMORY_CHUNK_BYTES` goes in chunks, waiting while
    the pipe is full; cancelled meanwhile, it may have sent part of its bytes."""

    def __init__(self, inner: MemoryObjectSendStream[bytes], record: list[bytes] | None = None) -> None:
        self._inner = inner
        self._record = record

    async def send(self, item: bytes) -> None:
        """Send ``item``'s bytes, in order."""
        data = bytes(item)
        if self._record is not None:
            self._record.append(data)
        if not data:
            await self._inner.send(data)
            return
        for start in range(0, len(data), MEMORY_CHUNK_BYTES):
            await self._inner.send(data[start : start + MEMORY_CHUNK_BYTES])

    async def send_eof(self) -> None:
        """Close this end: the reader gets EOF."""
        await self.aclose()

    def close(self) -> None:
        """`aclose` without a checkpoint, for teardown code that must not be interrupted."""
        self._inner.close()

    async def aclose(self) -> None:
        """Close this end; idempotent."""
        await self._inner.aclose()


class MemoryByteReceiveStream(anyio.abc.ByteReceiveStream):
    """The reading end of a memory byte pipe: bytes come out in the chunks they were sent in, split only to
    honour ``max_bytes``; `anyio.EndOfStream` once the writer closed and everything was read."""

    def __init__(self, inner: MemoryObjectReceiveStream[bytes]) -> None:
        self._inner = inner
        self._pending = b""

    async def receive(self, max_bytes: int = MEMORY_CHUNK_BYTES) -> bytes:
        """Up to ``max_bytes`` bytes, as soon as there are any."""
        if not self._pending:
            self._pending = await self._inner.receive()
        chunk, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
        return chunk

    def close(self) -> None:
        """`aclose` without a checkpoint, for teardown code that must not be interrupted."""
        self._inner.close()

    async def aclose(self) -> None:
        """Close this end; the writer's next send raises `anyio.BrokenResourceError`. Idempotent."""
        await self._inner.aclose()


def memory_byte_pipe(
    max_chunks: int = MEMORY_PIPE_CHUNKS, *, record: list[bytes] | None = None
) -> tuple[MemoryByteSendStream, MemoryByteReceiveStream]:
    """A one-way byte pipe in memory holding at most ``max_chunks`` chunks (0: every send waits for its
    reader); ``record``, when given, gets a copy of every send, in order."""
    send, receive = anyio.create_memory_object_stream[bytes](max_chunks)
    return MemoryByteSendStream(send, record), MemoryByteReceiveStream(receive)


# -- the channel -----------------------------------------------------------------------------------------

AgentMain = Callable[["InProcessChannel"], Awaitable[None]]
"""What an in-process agent runs: its whole life, on the channel's agent end; returning is exiting 0."""


class InProcessChannel:
    """A `Channel` to an agent running in this process, with the agent's end of it.

    The client's end is the `Channel` protocol (``stdin``, ``stdout``, `exit_info`...). The agent's end:
    ``agent_stdin`` and ``agent_stdout`` (its protocol streams), `write_stderr`, `exit`, and
    ``ignore_sigterm``. Made by `InProcessTransport` and `StubAgentTransport`, not directly.
    """

    def __init__(
        self,
        command: tuple[str, ...],
        *,
        on_stderr_line: Callable[[str], object] | None = None,
        stderr_tail_bytes: int = STDERR_TAIL_BYTES,
        stdin_close_timeout: float = 1.0,
        sigterm_timeout: float = SIGTERM_TIMEOUT,
        record_sent: list[bytes] | None = None,
    ) -> None:
        self.command = command
        """The argv the channel was opened with (a name only: nothing is executed)."""
        self.pid: int | None = None
        """Always None: no process is spawned for the agent."""
        self.stdin, self.agent_stdin = memory_byte_pipe(record=record_sent)
        self.agent_stdout, self.stdout = memory_byte_pipe()
        self.ignore_sigterm = False
        """Whether the agent survives teardown's SIGTERM step (it is then ended by the SIGKILL step)."""
        self._stderr = StderrTail(stderr_tail_bytes, on_stderr_line)
        self._stdin_close_timeout = stdin_close_timeout
        self._sigterm_timeout = sigterm_timeout
        self._returncode: int | None = None
        self._exited = anyio.Event()
        self._scope = anyio.CancelScope()
        self._teardown_signal: signal.Signals | None = None
        self._teardown_lock = anyio.Lock()
        self._report: TeardownReport | None = None

    # -- the agent's end --

    def write_stderr(self, data: bytes) -> None:
        """The agent writes to its stderr: kept in the bounded tail, lines forwarded to ``on_stderr_line``."""
        if not self._exited.is_set():
            self._stderr.absorb(data)

    def exit(self, returncode: int, stderr: str = "") -> None:
        """End the agent now with this status, as a process exits (``-N``: killed by signal N): its task is
        cancelled and its stdout reaches EOF after what it wrote. The first status given wins."""
        if stderr:
            self.write_stderr(stderr.encode())
        if self._returncode is None and not self._exited.is_set():
            self._returncode = returncode
        self._scope.cancel()

    def deliver(self, signum: signal.Signals) -> None:
        """A signal for the agent: SIGTERM is ignored under ``ignore_sigterm``; any other ends it killed."""
        if not (signum == signal.SIGTERM and self.ignore_sigterm):
            self.exit(-signum)

    async def run_agent(self, main: AgentMain) -> None:
        """Run ``main`` as the agent's life, then end it: the status `exit` gave, else 0 when ``main``
        returned, 1 (with its traceback on stderr) when it raised, ``-SIGKILL`` when it was cancelled."""
        returned = False
        try:
            with self._scope:
                await main(self)
            returned = True
        except Exception as exc:  # A crash, as an uncaught exception ends a process: traceback, status 1.
            self.write_stderr("".join(traceback.format_exception(exc)).encode())
            self.exit(1)
        finally:
            if self._returncode is None:
                self._returncode = 0 if returned else -signal.SIGKILL
            self.agent_stdout.close()
            self.agent_stdin.close()
            self._stderr.finish()
            self._exited.set()

    # -- the client's end (the Channel protocol) --

    def describe(self) -> str:
        """``"in process"``: where the agent runs, for messages."""
        return "in process"

    def exit_info(self) -> ExitInfo | None:
        """How the agent ended, or None while it runs."""
        if self._returncode is None or not self._exited.is_set():
            return None
        return ExitInfo(
            command=self.command,
            pid=None,
            returncode=self._returncode,
            stderr_tail=self._stderr.text(),
            stderr_bytes_total=self._stderr.bytes_total,
            teardown_signal=self._teardown_signal,
            via=IN_PROCESS_VIA,
        )

    async def wait_exit(self) -> ExitInfo:
        """Wait until the agent ended, and describe how."""
        await self._exited.wait()
        info = self.exit_info()
        assert info is not None, "the status is set before the exit event"
        return info

    def stderr_tail(self) -> str:
        """The last of what the agent wrote to stderr."""
        return self._stderr.text()

    @property
    def stderr_bytes_total(self) -> int:
        """How many bytes the agent has written to stderr so far."""
        return self._stderr.bytes_total

    @property
    def teardown_report(self) -> TeardownReport | None:
        """What teardown did, once it has run."""
        return self._report

    def kill(self) -> None:
        """End the agent now, as SIGKILL would: synchronous, idempotent, never raises."""
        self.deliver(signal.SIGKILL)

    async def aclose(self, *, stdin_close_timeout: float | None = None) -> TeardownReport:
        """Tear the agent down as a process is (close stdin, wait, SIGTERM, wait, SIGKILL) and close the
        streams; idempotent, shielded from cancellation, bounded in time."""
        with anyio.CancelScope(shield=True):
            async with self._teardown_lock:
                if self._report is None:
                    grace = self._stdin_close_timeout if stdin_close_timeout is None else stdin_close_timeout
                    self._report = await self._tear_down(grace)
                report = self._report
        return report

    async def _tear_down(self, grace: float) -> TeardownReport:
        exited_before = self._exited.is_set()
        steps = [TeardownStep.CLOSE_STDIN]
        await self.stdin.aclose()
        with anyio.move_on_after(grace):
            await self._exited.wait()
        for step, signum, timeout in (
            (TeardownStep.SIGTERM, signal.SIGTERM, self._sigterm_timeout),
            (TeardownStep.SIGKILL, signal.SIGKILL, SIGKILL_TIMEOUT),
        ):
            if self._exited.is_set():
                break
            steps.append(step)
            self._teardown_signal = signum
            self.deliver(signum)
            # A cancelled task ends at its next checkpoint; only an agent shielding itself takes longer.
            with anyio.move_on_after(timeout):
                await self._exited.wait()
        await self.stdout.aclose()
        gone = self._exited.is_set()
        return TeardownReport(tuple(steps), exited_before_teardown=exited_before, group_gone=gone)


# -- the transports --------------------------------------------------------------------------------------


class InProcessOptions(TypedDict, total=False):
    """The options of both in-process transports (`InProcessTransport`, `StubAgentTransport`).

    ``name``: what to call the transport in messages. ``local_files``: whether the client may serve the
    agent's files and terminals here (default True: it runs here). ``stdin_close_timeout`` and
    ``sigterm_timeout``: teardown's graces after closing the agent's stdin (1 s) and after its SIGTERM step.
    ``stderr_tail_bytes``: how much of an agent's stderr a channel keeps. ``record_sent``: keep every chunk
    clients write (``sent``, ``sent_messages``), for tests of the client.
    """

    name: str
    local_files: bool
    stdin_close_timeout: float
    sigterm_timeout: float
    stderr_tail_bytes: int
    record_sent: bool


class _InProcessTransportBase(BaseTransport[InProcessChannel]):
    """What both in-process transports share: `Transport`'s members, the record of what was opened, and
    ``launch``, which runs `_agent_main` on a fresh channel for the block (`InProcessOptions` says the
    options)."""

    def __init__(
        self,
        *,
        name: str = "in-process",
        local_files: bool = True,
        stdin_close_timeout: float = 1.0,
        sigterm_timeout: float = SIGTERM_TIMEOUT,
        stderr_tail_bytes: int = STDERR_TAIL_BYTES,
        record_sent: bool = False,
    ) -> None:
        self.name = name
        """What the transport is called in messages."""
        self.local_files = local_files
        """Whether the client may serve the agent's ``fs/*`` and ``terminal/*`` here (True: it runs here)."""
        self.stdin_close_timeout = stdin_close_timeout
        """The grace teardown gives the agent after its stdin closes."""
        self.sigterm_timeout = sigterm_timeout
        """How long teardown waits for an agent after its SIGTERM step (only one that ignores SIGTERM, or
        shields itself from cancellation, lasts it out)."""
        self.stderr_tail_bytes = stderr_tail_bytes
        """How much of an agent's stderr a channel keeps."""
        self.opened: list[Launch] = []
        """Every ``open`` this transport served, in order (argv, env and cwd as given)."""
        self.sent: list[bytes] | None = [] if record_sent else None
        """With ``record_sent``: every chunk a client wrote to its agents, in order (else None)."""
        self.channels: list[InProcessChannel] = []
        """Every channel opened, in order (an ended one still answers `InProcessChannel.exit_info`)."""

    def launch(self, launch: Launch) -> AbstractAsyncContextManager[InProcessChannel]:
        """Serve an agent for the block (`Transport.open` says the rest)."""
        self.opened.append(launch)
        channel = InProcessChannel(
            launch.argv,
            on_stderr_line=launch.on_stderr_line,
            stderr_tail_bytes=self.stderr_tail_bytes,
            stdin_close_timeout=self.stdin_close_timeout,
            sigterm_timeout=self.sigterm_timeout,
            record_sent=self.sent,
        )
        self.channels.append(channel)

        def start(task_group: anyio.abc.TaskGroup) -> None:
            task_group.start_soon(channel.run_agent, self._agent_main, name=f"in-process agent {self.name}")

        return own_channel(channel, start, lambda: None)

    async def _agent_main(self, channel: InProcessChannel) -> None:
        raise NotImplementedError

    def sent_messages(self) -> list[Any]:
        """Every JSON-RPC message a client sent, decoded, in order (needs ``record_sent``)."""
        import msgspec  # Only this test aid needs it here.

        if self.sent is None:
            raise RuntimeError(f"{self.name}: nothing is recorded without record_sent=True")
        lines = b"".join(self.sent).splitlines()
        return [msgspec.json.decode(line) for line in lines if line.strip()]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}, {len(self.opened)} opened>"


class InProcessTransport(_InProcessTransportBase):
    """A `Transport` that serves ``make_handler(channel)``, an ACP agent written as an `AgentHandler`, in
    this process for each ``open``, as `serve_stdio` would serve it in a process of its own.

    Args:
        make_handler: Makes the agent for one channel (it may keep the channel, to `InProcessChannel.exit`
            or `InProcessChannel.write_stderr`).
        strict_cancel: The agent connection's (`AgentSideConnection`).
        connection_options: For the agent's `Connection` (``max_line_bytes``...; ``name`` is ``name``).
    """

    def __init__(
        self,
        make_handler: Callable[[InProcessChannel], AgentHandler],
        *,
        strict_cancel: bool = True,
        connection_options: ConnectionOptions | None = None,
        **options: Unpack[InProcessOptions],
    ) -> None:
        super().__init__(**options)
        self._make_handler = make_handler
        self._strict_cancel = strict_cancel
        self._connection_options: ConnectionOptions = {"name": self.name, **(connection_options or {})}

    async def _agent_main(self, channel: InProcessChannel) -> None:
        connection = AgentSideConnection(
            self._make_handler(channel),
            channel.agent_stdin,
            channel.agent_stdout,
            strict_cancel=self._strict_cancel,
            **self._connection_options,
        )
        await connection.run()


# -- the stub agent, in process --------------------------------------------------------------------------


class _ChannelHost:
    """The `subagent.testing.stub_agent.AgentHost` of an in-process stub agent: its channel."""

    def __init__(self, channel: InProcessChannel) -> None:
        self._channel = channel

    async def write_stderr(self, data: bytes) -> None:
        self._channel.write_stderr(data)
        await anyio.lowlevel.checkpoint()

    async def exit(self, code: int) -> None:
        self._channel.exit(code)
        await anyio.sleep_forever()  # cancelled at once: the agent is over

    async def kill(self, signum: signal.Signals, *, ignore_sigterm: bool) -> None:
        if signum not in _IGNORED_SIGNALS:
            self._channel.deliver(signum)
        await anyio.lowlevel.checkpoint()  # where a fatal signal's cancellation lands

    async def spawn_grandchild(self, pid_file: str, *, ignore_sigterm: bool) -> int:
        raise AssertionError("StubAgentTransport refuses a scenario with a grandchild step")


def _process_only(step: Step) -> str | None:
    """Why ``step`` cannot run in process, or None: a grandchild needs a process group, and a stopped
    process has no in-memory equivalent. Every other step has a faithful in-memory meaning."""
    if isinstance(step, GrandchildStep):
        return "starts a grandchild process"
    if isinstance(step, KillStep) and (signum := step.signum()) in _STOPPING_SIGNALS:
        return f"stops the agent's process with {signum.name}"
    return None


class StubAgentTransport(_InProcessTransportBase):
    """A `Transport` serving the stub agent (`subagent.testing.stub_agent.ScenarioAgent`) in this process:
    `scenario` played over memory streams for each ``open``, without starting a Python process.

    Process-level steps keep their meaning: ``stderr`` goes to the channel's stderr tail (and
    ``on_stderr_line``); ``exit`` ends the channel with that status and ``kill`` with ``-signal`` (a signal
    that does nothing by default does nothing; SIGTERM under ``ignoreSigterm`` neither); ``raw``,
    ``huge_line`` and ``close_stdout`` act on the stdout stream; ``onStdinEof: "ignore"`` keeps the agent
    running after stdin closes, until teardown's SIGTERM (or SIGKILL, under ``ignoreSigterm``). A
    ``grandchild`` step, or a ``kill`` with a signal that stops a process, is refused at construction.

    Args:
        scenario: A `Scenario`, its dict (validated now), a scenario file, or None for the default one.
        options: `InProcessOptions` (``name`` is ``"stub-agent"`` unless given).

    Raises:
        ScenarioError: the scenario is invalid, or has a step that needs a real process (the message names
            the step and its JSON path; run the stub agent as a command for those, `stub_agent_argv`).
    """

    def __init__(
        self,
        scenario: Scenario | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        **options: Unpack[InProcessOptions],
    ) -> None:
        options.setdefault("name", "stub-agent")
        super().__init__(**options)
        if scenario is None or isinstance(scenario, str | os.PathLike):
            scenario = load_scenario(DEFAULT_SCENARIO_PATH if scenario is None else scenario)
        self.scenario = parse_scenario(scenario)
        """The scenario every agent of this transport plays."""
        for path, step, _ in self.scenario._placed_steps():
            if (reason := _process_only(step)) is not None:
                raise ScenarioError(
                    f"scenario: step {step.__struct_config__.tag!r} {reason}, which needs the stub agent "
                    f"as a process (stub_agent_argv) - at `{path}`"
                )

    async def _agent_main(self, channel: InProcessChannel) -> None:
        channel.ignore_sigterm = self.scenario.ignore_sigterm
        await play_scenario(self.scenario, channel.agent_stdin, channel.agent_stdout, _ChannelHost(channel))
