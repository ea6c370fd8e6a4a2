"""The Ray transport: a child agent in an actor on a node of a Ray cluster.

`RayTransport` starts one actor per child (`_AgentActor`, an async actor) wherever Ray places it (a
node pinned with ``node_id``, resources, ``runtime_env``, any other ``.options(...)``), and that actor
runs the agent with `subagent.acp.transports.open_agent_process` on its node: supervised, torn down with
its whole tree, its stderr drained into a bounded tail, exactly as a local child. The channel here
relays the agent's stdio over Ray.

The actor class is this module's, pickled by reference: ``subagent-seam`` must be importable on every
node that may run it (installed there, or shipped with the actor's ``runtime_env``, e.g.
``{"pip": ["subagent-seam"]}`` or ``{"py_modules": [...]}``). Ray 2.60 (the ``ray`` extra) is needed
here and there; this module imports it only when a channel is opened.

stdout, stderr and the exit: one ordered stream
    The actor's ``stream`` method is a Ray streaming generator (``num_returns="streaming"``). Each of its
    items is a list of tagged events in the order they happened on the node: stdout bytes (what was
    available, coalesced up to `CHUNK_BYTES`), stderr lines, stdout's end, the agent's exit. So the
    agent's last stderr lines arrive before its exit, and its exit after its last stdout byte read on
    the node. The generator is flow-controlled (`STREAM_WINDOW` items unread here pause it; past
    `CHUNK_BYTES` pending on the node, its stdout is not read, and the agent blocks on a full pipe), so
    neither side buffers without bound. stderr lines beyond `STDERR_RELAY_BYTES` pending are not relayed
    (the exit still carries the node's tail). Failures come back as tagged data, never as pickled
    exception objects.

stdin: sequence numbers
    ``channel.stdin.send`` appends to a bounded buffer (`STDIN_BUFFER_BYTES`; a writer past it waits); a
    sender task ships what has accumulated as one ``write(seq, data)`` call (at most `CHUNK_BYTES`),
    with at most `STDIN_WINDOW` calls in flight. One call per line would cost a round trip each (about a
    millisecond); batches decide the throughput. Calls to an async actor run concurrently, so they may
    reach the agent's pipe out of order: each carries a sequence number, and the actor writes them in
    that order, holding back any that arrive early. ``stdin.aclose()`` is one more call after the last
    batch: the actor then closes the agent's stdin.

Why the agent's tree survives its worker's death by only a moment
    When an actor ends abnormally, its worker dies: SIGKILLed (by Ray, the kernel, a user), or exiting by
    itself (its raylet gone, ``ray.kill``), when Ray would also SIGKILL the worker's child processes. The
    agent's supervisor (`subagent.acp.transports._supervisor`) leads a session of its own, so a signal to the
    worker's process group misses it; and every actor's ``runtime_env`` sets
    ``RAY_kill_child_processes_on_worker_exit=false`` (over the given ``env_vars``), so that Ray leaves
    it alone too: a SIGKILLed supervisor would leave the agent's tree, in that session, running. The
    supervisor notices its parent, the worker, is gone within a quarter of a second, sends SIGTERM to
    every descendant of the agent (those that left its group included) and SIGKILL a second later. So
    the death of the worker, of the actor or of the raylet never leaves the agent running on its node.

When the actor, its worker or its node dies
    The stream raises Ray's actor error here within seconds (about 2-4 s after a raylet is killed): the
    channel's stdout ends (`anyio.EndOfStream` for the client), `RayChannel.exit_info` reports an
    unknown status with ``via`` naming the node and why (``"on ray node 3f2a9c1b, ray actor died: its
    worker process has died"``; a killed raylet first reads ``"its worker or its node is unreachable
    (RpcError: ...)"``, as Ray knows no more then, or ``"its node has died"`` once it does), and
    `RayChannel.wait_exit` returns. A raylet killed on a live machine
    takes its workers along, and the supervisor cleans up as above (tested); a machine that is gone
    takes everything of the agent with it.

Backends
    Everything here runs on asyncio and trio alike, through one code path. A Ray ``ObjectRef`` is awaited
    through ``ref.future()`` (a `concurrent.futures.Future`): its done-callback, run in Ray's thread (or
    at once, if the future is already done), wakes the waiting task through the event loop's own
    thread-safe call. The stream's next item is taken in a worker thread, under the channel's own
    `anyio.CapacityLimiter` (anyio's shared default of 40 would cap the children at 40: each channel
    keeps one thread waiting on its stream), as are ``ray.init`` and creating the actor, which may block
    on the cluster. Iterating the stream synchronously also beats Ray's own asyncio iteration
    (measured: 5,750 vs 3,960 items/s).

Files and terminals
    ``RayTransport.local_files`` is False: the client offers the agent no ``fs/*`` or ``terminal/*``
    here. With ``fs_roots`` or ``terminals``, the actor serves them itself, on the node, confined to
    those roots there, with `subagent.acp._file_router.route_files` between the agent's pipes and the
    relay (it also adds them to the capabilities of the client's ``initialize``); the permission policy
    stays with the caller.

Isolated workspaces (``isolation="worktree"`` or ``"copy"``)
    The workspace is made on the node where the agent will run. `RayTransport.isolation_runner` gives
    the acp provider a `RayIsolationRunner`, which runs each operation of `subagent._isolation_core` there
    as a Ray task (a sync function of this module, in a worker of the transport's ``runtime_env``):
    the run's first operation is placed as the transport's actors are (its ``node_id``, resources, CPUs
    and the ``actor_options`` that choose a node), every later one is pinned to the node that first one
    ran on, reserving nothing there, and the workspace carries that node (``"node"``). The provider then
    spawns the agent with `RayTransport.for_workspace`, the same transport pinned to that node, so the
    agent's cwd is its worktree; ``fs_roots`` inside the repository are served in the worktree instead.
    The workspace is owned by this process (the node's reaper sees another host's owner, and leaves it);
    what this host's dead processes left on a node is reaped from here by name, once per process, node
    and place (a transport without ``node_id``: once per place, on the node its first run lands on).
    Each operation is bounded by ``isolation_timeout`` and cancelled on its node when given up on (Ray
    interrupts it between two git commands); a lost node or worker is reported by Ray first (``"the
    workspace's commit on ray node 3f2a9c1b failed: its worker process died"``).
    Measured: an operation on a warm worker costs 6 to 15 ms more than here (a commit 30-34 ms against
    20-28 ms), so that an isolated run costs no more than the noise of an actor's start; the first
    operation of a ``runtime_env`` about 0.9 s (Ray starts a worker for it). The core runs in the worker
    itself: as a process of its own per operation (``python -I -S``), it would cost 70 ms more each.

Costs (measured on a two-node local cluster on a loaded 2-core machine)
    An actor starts in about 0.7 s on an idle machine (Ray starts a worker process for it; the
    ``runtime_env`` above accounts for 0.28 s of it, measured against none); its worker holds about
    97 MiB resident, 56 MiB proportional, beside the agent. Each channel costs this process one thread
    and about 0.2 MiB. A request's round trip (a line to an echoing agent
    and back) takes about 2 ms (0.02 ms locally); a 100,000-chunk ACP turn about 1.5x the local time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import functools
import importlib.util
import logging
import os
import re
import signal
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread

from subagent.acp._errors import AgentSpawnError
from subagent.acp.transports._channel import (
    BaseTransport,
    ExitInfo,
    Launch,
    TeardownReport,
    TeardownStep,
    own_channel,
)
from subagent.acp.transports._local import (
    SIGKILL_TIMEOUT,
    SIGTERM_TIMEOUT,
    STDERR_SETTLE_TIMEOUT,
    STDERR_TAIL_BYTES,
    STDIN_CLOSE_TIMEOUT,
    AgentProcess,
    open_agent_process,
)

__all__ = [
    "CHUNK_BYTES",
    "ISOLATION_TIMEOUT",
    "MIN_STARTING",
    "START_TIMEOUT",
    "STDERR_RELAY_BYTES",
    "STDIN_BUFFER_BYTES",
    "STDIN_WINDOW",
    "STREAM_WINDOW",
    "RayChannel",
    "RayIsolationRunner",
    "RayTransport",
    "transport_from_url",
]

CHUNK_BYTES = 1024 * 1024
"""The most stdout bytes one stream item carries, and the most stdin bytes one write call carries; also
how much stdout the actor holds unsent before it stops reading the agent's pipe."""
STREAM_WINDOW = 4
"""Stream items the actor may have produced that this side has not taken yet; past it the actor waits."""
STDIN_WINDOW = 4
"""stdin write calls in flight at once (each up to `CHUNK_BYTES`)."""
STDIN_BUFFER_BYTES = 4 * 1024 * 1024
"""stdin bytes buffered here, not yet shipped; a writer past it waits."""
STDERR_RELAY_BYTES = 256 * 1024
"""stderr bytes the actor holds unsent; lines past it are not relayed (the exit's tail still has them)."""
START_TIMEOUT = 60.0
"""A hang guard on connecting to the cluster, placing the actor and starting the agent (about 0.15 s
for an actor on a warm local cluster)."""
MIN_STARTING = 2
"""The fewest starts `RayTransport` runs at once by default (on a one-CPU cluster too: a start also
waits on Ray's round trips, which another start's work can fill)."""
CONNECT_TIMEOUT = 10.0
"""A hang guard on reaching the cluster's GCS address (a TCP connection) before ``ray.init``."""
KILL_ANSWER_TIMEOUT = 1.0
"""How long `RayChannel.kill` waits for the actor to say it killed the tree before killing the actor."""
RAY_CALL_TIMEOUT = 5.0
"""A hang guard on the actor exiting once the agent is torn down (milliseconds); ``ray.kill`` follows."""
ISOLATION_TIMEOUT = 600.0
"""A hang guard on one workspace operation on a node (`RayTransport.isolation_runner`): placing it,
starting a worker for it and the operation's git commands (each bounded on the node by
``subagent._isolation_core.GIT_TIMEOUT``). A lost node or worker is reported by Ray sooner."""
_SHORT_NODE_ID = 8
"""How many hex digits of a node id name it in messages."""
_RESERVED_ACTOR_OPTIONS = frozenset(
    {"num_cpus", "resources", "runtime_env", "max_restarts", "max_task_retries"}
)
_RESERVED_PROCESS_OPTIONS = frozenset(
    {"argv", "env", "cwd", "on_stderr_line", "stdin_close_timeout", "stderr_tail_bytes"}
)
_PLACING_OPTIONS = frozenset(
    {
        "scheduling_strategy",
        "placement_group",
        "placement_group_bundle_index",
        "placement_group_capture_child_tasks",
        "label_selector",
        "fallback_strategy",
    }
)
"""The ``actor_options`` that choose a node: the first workspace operation is placed with them (and the
actor's resources), the agent of a workspace is then pinned to the node they chose instead."""
_TASK_PLACING_OPTIONS = _PLACING_OPTIONS | {"accelerator_type", "memory", "num_gpus"}
"""The ``actor_options`` a task also takes that narrow where it may run."""
_WORKER_ENV = {"RAY_kill_child_processes_on_worker_exit": "false"}
"""Set in every actor's ``runtime_env``: see the module docstring, "Why the agent's tree survives"."""
_isolation_logger = logging.getLogger("subagent.isolation")
_init_lock = threading.Lock()
"""Two channels opening at once must not both call ``ray.init``."""


def _ray() -> Any:
    """The ``ray`` module (typed loosely: Ray's own annotations are partial); imported on first use."""
    import ray

    return ray


# -- the node side ---------------------------------------------------------------------------------------


class _Changes:
    """What a relay's tasks wait on: every task in `wait` wakes at the next `notify`, and looks again."""

    def __init__(self) -> None:
        self._changed = anyio.Event()

    def notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait(self) -> None:
        await self._changed.wait()


class _Outbox(_Changes):
    """Events for the stream, in order, bounded: stdout waits for room, stderr past its budget is dropped."""

    def __init__(self) -> None:
        super().__init__()
        self._items: collections.deque[tuple[Any, ...]] = collections.deque()
        self._stdout_bytes = 0
        self._stderr_bytes = 0
        self._closed = False

    async def wait_for_room(self) -> None:
        while self._stdout_bytes >= CHUNK_BYTES and not self._closed:
            await self.wait()

    def put_stdout(self, data: bytes) -> None:
        last = self._items[-1] if self._items else None
        if last is not None and last[0] == "o" and len(last[1]) + len(data) <= CHUNK_BYTES:
            last[1].extend(data)
        else:
            self._items.append(("o", bytearray(data)))
        self._stdout_bytes += len(data)
        self.notify()

    def put_stderr_line(self, line: str) -> None:
        if self._stderr_bytes + len(line) > STDERR_RELAY_BYTES:
            return
        self._stderr_bytes += len(line) + 1
        self.put(("e", line))

    def put(self, item: tuple[Any, ...]) -> None:
        self._items.append(item)
        self.notify()

    def close(self) -> None:
        self._closed = True
        self.notify()

    async def take(self) -> list[tuple[Any, ...]] | None:
        """Everything queued (waiting for something), or None once closed and empty."""
        while not self._items:
            if self._closed:
                return None
            await self.wait()
        items = [("o", bytes(item[1])) if item[0] == "o" else item for item in self._items]
        self._items.clear()
        self._stdout_bytes = self._stderr_bytes = 0
        self.notify()
        return items


def _route_files(
    process: AgentProcess, env: Mapping[str, str] | None, files: dict[str, Any]
) -> AbstractAsyncContextManager[tuple[anyio.abc.ByteSendStream, anyio.abc.ByteReceiveStream]]:
    """The agent's (stdin, stdout) with its fs/* and terminal/* requests served on this node, if asked;
    else the agent's own streams."""
    files = dict(files)
    workspace = files.pop("workspace", None)
    if files["fs_roots"] is None and not files["terminals"]:
        return contextlib.nullcontext((process.stdin, process.stdout))
    from subagent.acp._file_router import route_files  # 40 ms of imports: only where it is used

    if workspace is not None and files["fs_roots"] is not None:
        from subagent._isolation_core import map_path

        # Resolved here, on the node: a root given through a symlink is moved too.
        files["fs_roots"] = [map_path(root, *workspace) for root in files["fs_roots"]]
    # Terminal commands start from the agent's environment.
    terminal_env = None if env is None else {**os.environ, **env}
    return route_files(process.stdin, process.stdout, env=terminal_env, **files)


def _run_core_operation(operation: str, args: list[Any]) -> tuple[Any, ...]:
    """One operation of the workspace core on this node (run as a Ray task): ``("value", value, node id,
    log)`` or ``("error", message, node id, log)``, ``log`` being the warnings the core logged (a
    workspace it recovered); never raises (exceptions are not pickled across), but for Ray's
    cancellation, a KeyboardInterrupt raised between two of the core's git commands: the core then
    removes what it half made, as when interrupted here."""
    from subagent import _isolation_core as core

    node_id = _ray().get_runtime_context().get_node_id()
    logged = _Lines()
    logged.setLevel(logging.WARNING)
    core.logger.addHandler(logged)
    try:
        value = core.OPERATIONS[operation](*args)
    except core.IsolationError as exc:
        return ("error", str(exc), node_id, logged.lines)
    except Exception as exc:
        return ("error", f"{type(exc).__name__}: {exc}", node_id, logged.lines)
    finally:
        core.logger.removeHandler(logged)
    return ("value", value, node_id, logged.lines)


class _Lines(logging.Handler):
    """Keeps the messages logged to it."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _exit_to_wire(info: ExitInfo) -> dict[str, Any]:
    return {
        "pid": info.pid,
        "returncode": info.returncode,
        "stderr_tail": info.stderr_tail,
        "stderr_bytes_total": info.stderr_bytes_total,
        "teardown_signal": None if info.teardown_signal is None else int(info.teardown_signal),
        "status_known": info.status_known,
        "via": info.via,
    }


class _AgentActor:
    """The node side of one channel (run as a Ray async actor): the agent under `open_agent_process`.

    Every method returns tagged data (a tuple whose first item says what it is), never raises to the
    caller: exceptions are not pickled across.
    """

    def __init__(self) -> None:
        self._outbox = _Outbox()
        self._process: AgentProcess | None = None
        self._stdin: anyio.abc.ByteSendStream | None = None
        self._started = anyio.Event()
        self._start_failure: str | None = None
        self._leave = anyio.Event()
        self._finished = anyio.Event()
        self._grace: float | None = None
        self._report: TeardownReport | None = None
        self._final_exit: ExitInfo | None = None
        self._stdin_pending: dict[int, bytes | None] = {}
        self._stdin_next = 0
        self._stdin_lock = anyio.Lock()
        self._stdin_broken = False
        self._owner: asyncio.Task[None] | None = None

    async def start(
        self, argv: list[str], env: dict[str, str] | None, cwd: str | None, options: dict[str, Any]
    ) -> tuple[Any, ...]:
        """Start the agent: ``("started", agent pid, node id, worker pid)`` or ``("failed", reason)``."""
        ray = _ray()
        node_id = ray.get_runtime_context().get_node_id()
        # A task of the actor's loop, so the agent outlives this call: it owns the process until teardown.
        self._owner = asyncio.get_running_loop().create_task(self._own(argv, env, cwd, options))
        await self._started.wait()
        if self._process is None:
            return ("failed", self._start_failure or "the actor could not start it", node_id)
        return ("started", self._process.pid, node_id, os.getpid())

    async def _own(
        self, argv: list[str], env: dict[str, str] | None, cwd: str | None, options: dict[str, Any]
    ) -> None:
        files = options.pop("files")
        try:
            async with (
                open_agent_process(
                    argv, env=env, cwd=cwd, on_stderr_line=self._outbox.put_stderr_line, **options
                ) as process,
                _route_files(process, env, files) as (stdin, stdout),
            ):
                self._process, self._stdin = process, stdin
                self._started.set()
                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(self._pump_stdout, stdout)
                    task_group.start_soon(self._report_exit, process)
                    await self._leave.wait()
                    self._report = await process.aclose(stdin_close_timeout=self._grace)
                    task_group.cancel_scope.cancel()
            self._final_exit = process.exit_info()
            if self._final_exit is not None:
                self._outbox.put(("x", _exit_to_wire(self._final_exit)))
        except AgentSpawnError as exc:
            self._start_failure = exc.reason
        except Exception as exc:  # Reported as data: the caller's side cannot unpickle everything.
            self._start_failure = f"{type(exc).__name__}: {exc}"
            if self._process is None and isinstance(exc, ValueError):
                self._start_failure = str(exc)  # The file options do not fit this node.
        finally:
            self._started.set()
            self._outbox.close()
            self._finished.set()

    async def _pump_stdout(self, stdout: anyio.abc.ByteReceiveStream) -> None:
        try:
            while True:
                await self._outbox.wait_for_room()
                self._outbox.put_stdout(await stdout.receive(CHUNK_BYTES))
        except anyio.EndOfStream:
            self._outbox.put(("eof",))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # Torn down: the stream ends with the outbox.

    async def _report_exit(self, process: AgentProcess) -> None:
        self._outbox.put(("x", _exit_to_wire(await process.wait_exit())))

    async def stream(self) -> AsyncIterator[list[tuple[Any, ...]]]:
        """The agent's events, in order, a list per item, until it is torn down (a streaming generator)."""
        while (items := await self._outbox.take()) is not None:
            yield items

    async def write(self, seq: int, data: bytes | None) -> str:
        """Write batch ``seq`` (None: close stdin) once every earlier one is written: ``"ok"`` or
        ``"broken"`` (the agent's stdin is closed)."""
        self._stdin_pending[seq] = data
        async with self._stdin_lock:
            while self._stdin_next in self._stdin_pending:
                chunk = self._stdin_pending.pop(self._stdin_next)
                self._stdin_next += 1
                if self._stdin_broken or self._stdin is None:
                    self._stdin_broken = True
                    continue
                try:
                    if chunk is None:
                        await self._stdin.aclose()
                    else:
                        await self._stdin.send(chunk)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    self._stdin_broken = True
        return "broken" if self._stdin_broken else "ok"

    def kill_tree(self) -> str:
        """SIGKILL the agent's whole tree now (its supervisor sweeps it)."""
        if self._process is not None:
            self._process.kill()
        return "ok"

    async def teardown(self, stdin_close_timeout: float | None) -> tuple[Any, ...]:
        """Tear the agent down as locally; ``("torn-down", steps, exited before, group gone, exit)``."""
        self._grace = stdin_close_timeout
        self._leave.set()
        await self._finished.wait()
        report, final = self._report, self._final_exit
        if report is None or final is None:
            return ("failed", self._start_failure or "the agent was not running")
        steps = tuple(step.name for step in report.steps)
        return ("torn-down", steps, report.exited_before_teardown, report.group_gone, _exit_to_wire(final))


@functools.cache
def _remote_actor_class() -> Any:
    """`_AgentActor` as a Ray actor class: made once, so its definition is exported to the cluster once."""
    return _ray().remote(_AgentActor)


@functools.cache
def _remote_core_operation() -> Any:
    """`_run_core_operation` as a Ray remote function (exported to the cluster once)."""
    return _ray().remote(_run_core_operation)


# -- this side ---------------------------------------------------------------------------------------------


def _thread_safe_caller() -> Callable[[Callable[[], object]], None]:
    """A function that, from any thread, has the current event loop call ``fn`` soon, without waiting."""
    native = anyio.lowlevel.current_token().native_token
    schedule: Callable[[Callable[[], object]], object]
    if isinstance(native, asyncio.AbstractEventLoop):
        schedule = native.call_soon_threadsafe
    else:
        schedule = native.run_sync_soon  # type: ignore[attr-defined]  # a trio.lowlevel.TrioToken

    def call_soon(fn: Callable[[], object]) -> None:
        # The loop may be over by the time a late Ray callback runs: nobody waits then.
        with contextlib.suppress(Exception):
            schedule(fn)

    return call_soon


async def _resolve(ref: Any) -> Any:
    """Await a Ray ``ObjectRef`` on any backend; Ray's exceptions are raised as Ray raises them."""
    future = ref.future()
    if not future.done():
        done = anyio.Event()
        call_soon = _thread_safe_caller()
        # Runs at once if the future finished meanwhile; else in Ray's thread when it does.
        future.add_done_callback(lambda _: call_soon(done.set))
        await done.wait()
    return future.result()


def _short(node_id: str) -> str:
    return node_id[:_SHORT_NODE_ID]


_BECAUSE = re.compile(r"[Tt]he actor (?:is dead|died) because (?:of )?(.+?)\.(?:\s|$)")
_UNAVAILABLE = re.compile(r"is unavailable: (?:The actor is temporarily unavailable: )?(.+?)\. The task may")


def _why_actor_died(exc: BaseException) -> str:
    """A short phrase for Ray's actor error: ``"its worker process has died"``, ``"it was killed by
    `ray.kill`"``, ``"its node has died"``, or the error an actor's creation raised
    (``"ModuleNotFoundError: ..."``)."""
    text = str(exc)
    if type(exc).__name__ == "ActorUnavailableError":
        # What a killed raylet first looks like from here: the worker's connection dropped, and Ray does
        # not know yet (nor say) whether the node died; its supervisor ends the agent either way.
        unavailable = _UNAVAILABLE.search(text)
        cause = unavailable.group(1) if unavailable else "no answer"
        return f"its worker or its node is unreachable ({cause})"
    errors = [line.strip() for line in text.splitlines() if re.match(r"\s*\w+(Error|Exception):", line)]
    match = _BECAUSE.search(text)
    if match and not (errors and "error" in match.group(1)):
        return match.group(1).strip()
    if errors:
        return errors[-1]
    return type(exc).__name__


class _StdinRelay(_Changes, anyio.abc.ByteSendStream):
    """The agent's stdin here: a bounded buffer that the channel's sender ships in numbered batches."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer = bytearray()
        self.closed = False
        """``aclose`` was called: the sender sends stdin's end after the last batch."""
        self.broken = False
        """The agent's stdin is gone (it exited, or its actor died): writes fail."""

    def is_broken(self) -> bool:
        return self.broken

    async def send(self, item: bytes) -> None:
        """Buffer ``item`` (waiting while the buffer is full); `anyio.BrokenResourceError` once the agent's
        stdin is gone."""
        await anyio.lowlevel.checkpoint()
        view = memoryview(item)
        while True:
            if self.closed:
                raise anyio.ClosedResourceError
            if self.broken:
                raise anyio.BrokenResourceError
            if not view:
                return
            room = STDIN_BUFFER_BYTES - len(self.buffer)
            if room <= 0:
                await self.wait()
                continue
            self.buffer += view[:room]
            view = view[room:]
            self.notify()

    async def aclose(self) -> None:
        """Close stdin after what was sent: the agent's cue to finish."""
        self.closed = True
        self.notify()
        await anyio.lowlevel.checkpoint()


class _StdoutRelay(anyio.abc.ByteReceiveStream):
    """The agent's stdout here, fed by the channel's stream reader."""

    def __init__(self) -> None:
        self._send, self._receive = anyio.create_memory_object_stream[bytes](2)
        self._pending = b""

    async def feed(self, data: bytes) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self._send.send(data)  # A reader that closed its end drops what follows.

    def end(self) -> None:
        self._send.close()

    def close(self) -> None:
        self._send.close()
        self._receive.close()

    async def receive(self, max_bytes: int = 65536) -> bytes:
        """Up to ``max_bytes`` of the agent's stdout; `anyio.EndOfStream` once it ended."""
        if not self._pending:
            self._pending = await self._receive.receive()
        chunk, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
        return chunk

    async def aclose(self) -> None:
        """Stop reading; what the agent writes next is discarded."""
        self._receive.close()
        await anyio.lowlevel.checkpoint()


class RayTransport(BaseTransport["RayChannel"]):
    """Child agents in Ray actors, one per child, on the cluster at ``address`` (see the module docstring).

    Constructing it is cheap: nothing connects until a channel is opened, and then only if Ray is not
    initialized in this process yet (``ray.init(address=...)``, in a worker thread); a ``ray.init`` of
    your own is used as it is.

    Args:
        address: The cluster's GCS address, ``"HOST:PORT"`` (this process joins the cluster as a driver),
            or None or ``"auto"``: the cluster Ray finds (``RAY_ADDRESS``, else one started on this host).
            Never starts a cluster.
        node_id: Run every child on this node (hex id; ``NodeAffinitySchedulingStrategy``, not soft).
        resources: Custom resources each actor needs (``{"repo-x": 1}``).
        num_cpus: CPUs each actor reserves. 0 by default: an agent mostly waits on its model, and a
            reservation would cap the children per node at its CPU count.
        runtime_env: The actor's ``runtime_env`` (how ``subagent-seam`` reaches a node that lacks it,
            the agent's own dependencies, environment variables).
        actor_options: Any other keyword of ``.options(...)`` (``scheduling_strategy``, ``memory``,
            ``num_gpus``, ``name``...). The actor is never restarted (it would have no agent).
        fs_roots: Serve the agent's ``fs/*`` requests on its node, confined to these directories there.
        terminals: Serve the agent's ``terminal/*`` requests on its node.
        stdin_close_timeout: Teardown's grace after stdin closes, before SIGTERM.
        stderr_tail_bytes: How much of the agent's stderr is kept for diagnosis (on the node, and here).
        start_timeout: A hang guard on connecting, placing the actor and starting the agent; a start
            waiting for its turn (``max_starting``) does not count against it.
        process_options: More keyword options of `open_agent_process` on the node (``sigterm_timeout``,
            ``sigkill_timeout``, ``inherit_env``, ``supervise``...).
        isolation_timeout: A hang guard on each workspace operation on a node (`isolation_runner`).
        max_starting: How many of this transport's starts (placing an actor, starting its worker
            process, spawning the agent) may be under way at once, per event loop; more wait their turn.
            None: the cluster's CPU count when first connected, at least `MIN_STARTING`. A start is
            mostly CPU work (Ray starts a Python worker process, which imports Ray; the agent starts):
            a hundred at once share the CPUs, so each takes about as long as all of them, past its
            start timeout, although none is stuck; in turns each takes its usual time, and the whole
            takes no longer (measured: 100 children on two one-CPU nodes all started and done in 74 s
            in turns; at once, 102 s, and only with the start timeout raised).

    Raises:
        ValueError: Ray is not installed, or an option is out of range.
        TypeError: ``actor_options`` or ``process_options`` holds what another argument sets.
    """

    local_files = False

    def __init__(
        self,
        address: str | None = None,
        *,
        node_id: str | None = None,
        resources: Mapping[str, float] | None = None,
        num_cpus: float = 0,
        runtime_env: Mapping[str, Any] | None = None,
        actor_options: Mapping[str, Any] | None = None,
        fs_roots: Sequence[str | os.PathLike[str]] | None = None,
        terminals: bool = False,
        stdin_close_timeout: float = STDIN_CLOSE_TIMEOUT,
        stderr_tail_bytes: int = STDERR_TAIL_BYTES,
        start_timeout: float = START_TIMEOUT,
        process_options: Mapping[str, Any] | None = None,
        max_starting: int | None = None,
        isolation_timeout: float = ISOLATION_TIMEOUT,
    ) -> None:
        if importlib.util.find_spec("ray") is None:
            raise ValueError("the ray transport needs Ray: pip install 'subagent-seam[ray]'")
        if address is not None and not address:
            raise ValueError("a ray address is HOST:PORT or 'auto'")
        if node_id is not None and not re.fullmatch(r"[0-9a-fA-F]+", node_id):
            raise ValueError("a ray node id is hexadecimal")
        if num_cpus < 0:
            raise ValueError("num_cpus must not be negative")
        if stderr_tail_bytes < 0:
            raise ValueError("stderr_tail_bytes must not be negative")
        if max_starting is not None and max_starting < 1:
            raise ValueError("max_starting must be at least 1")
        if isolation_timeout <= 0:
            raise ValueError("isolation_timeout must be positive")
        for name, given, reserved in (
            ("actor_options", actor_options, _RESERVED_ACTOR_OPTIONS),
            ("process_options", process_options, _RESERVED_PROCESS_OPTIONS),
        ):
            clash = sorted(set(given or {}) & reserved)
            if clash:
                raise TypeError(f"{clash[0]!r} is not given in {name}: it has an argument of its own")
        if node_id is not None and "scheduling_strategy" in (actor_options or {}):
            raise TypeError("node_id and a scheduling_strategy in actor_options cannot both place the actor")
        self.address = None if address in (None, "auto") else address
        """The GCS address, or None: the cluster Ray finds."""
        self.node_id = node_id
        self.resources: Mapping[str, float] = dict(resources or {})
        self.num_cpus = num_cpus
        self.runtime_env: Mapping[str, Any] | None = None if runtime_env is None else dict(runtime_env)
        self.actor_options: Mapping[str, Any] = dict(actor_options or {})
        self.fs_roots = None if fs_roots is None else tuple(os.fspath(root) for root in fs_roots)
        self.terminals = terminals
        self._stdin_close_timeout = stdin_close_timeout
        self.stderr_tail_bytes = stderr_tail_bytes
        self.start_timeout = start_timeout
        self.process_options: Mapping[str, Any] = dict(process_options or {})
        self.max_starting = max_starting
        """How many starts may be under way at once, as given (None: the cluster's CPU count)."""
        self._starting_limit = max_starting
        self._start_turns = anyio.lowlevel.RunVar[anyio.Semaphore](f"ray starts of {id(self):x}")
        self.isolation_timeout = isolation_timeout
        self._workspace: tuple[str, str] | None = None
        """The (source, workspace) of `for_workspace`: ``fs_roots`` inside the source are moved there."""

    def __repr__(self) -> str:
        where = "" if self.node_id is None else f", node_id={self.node_id!r}"
        return f"RayTransport({self.name!r}{where})"

    @property
    def name(self) -> str:
        """``ray://HOST:PORT``, or ``ray://auto``."""
        return f"ray://{self.address or 'auto'}"

    @property
    def stdin_close_timeout(self) -> float:
        """Teardown's grace after stdin closes, before the agent's tree is signalled on its node."""
        return self._stdin_close_timeout

    def _teardown_bound(self, grace: float) -> float:
        """How long the actor's teardown may take (its steps' timeouts), plus a margin for Ray."""
        options = self.process_options
        sigterm = float(options.get("sigterm_timeout", SIGTERM_TIMEOUT))
        sigkill = float(options.get("sigkill_timeout", SIGKILL_TIMEOUT))
        settle = float(options.get("stderr_settle_timeout", STDERR_SETTLE_TIMEOUT))
        return grace + sigterm + 2 * sigkill + settle + 5.0

    def _actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "num_cpus": self.num_cpus,
            "max_restarts": 0,
            "max_task_retries": 0,
            **self.actor_options,
        }
        if self.resources:
            options["resources"] = dict(self.resources)
        runtime_env = dict(self.runtime_env or {})
        # A worker that exits on its own (its raylet gone, ray.kill) would SIGKILL its children: the
        # supervisor, whose agent tree, in a session of its own, would then live on. Left alive, the
        # supervisor sees the worker gone and ends the tree.
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **_WORKER_ENV}
        options["runtime_env"] = runtime_env
        if self.node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.node_id, soft=False)
        return options

    def _process_options(self) -> dict[str, Any]:
        return {
            **self.process_options,
            "stdin_close_timeout": self._stdin_close_timeout,
            "stderr_tail_bytes": self.stderr_tail_bytes,
            "files": {"fs_roots": self.fs_roots, "terminals": self.terminals, "workspace": self._workspace},
        }

    def _connect(self) -> None:
        """``ray.init`` unless Ray is initialized in this process, and learn how many starts may run at
        once (blocking: run in a worker thread)."""
        self._init_ray()
        if self._starting_limit is None:
            cpus = int(_ray().cluster_resources().get("CPU", 0))
            self._starting_limit = max(MIN_STARTING, cpus)

    def _init_ray(self) -> None:
        ray = _ray()
        with _init_lock:
            if ray.is_initialized():
                return
            if self.address is not None:
                # Ray retries an unreachable GCS for a minute, in a thread that then holds up our exit;
                # a plain connection says at once whether anything listens there.
                host, _, port = self.address.rpartition(":")
                with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT):
                    pass
            # The agent's stderr comes on the stream; Ray's workers' own output stays in the node's logs.
            # Ray's own lines ("Connecting to existing Ray cluster", a warning that a worker thread sets
            # no SIGTERM handler) would land on the caller's stderr, a CLI's included: errors only.
            ray.init(address=self.address or "auto", log_to_driver=False, logging_level=logging.ERROR)

    def _start_turn(self) -> anyio.Semaphore:
        """This event loop's turns for this transport's starts (`max_starting` of them): a semaphore per
        loop, as an anyio primitive serves only the loop that first used it. Needs `_connect` first."""
        turns = self._start_turns.get(None)
        if turns is None:
            limit = self._starting_limit
            assert limit is not None, "connected first"
            turns = anyio.Semaphore(limit)
            self._start_turns.set(turns)
        return turns

    def _placement_problem(self) -> str | None:
        """Why no live node can take the actor, if that is certain now (blocking)."""
        if "scheduling_strategy" in self.actor_options or "placement_group" in self.actor_options:
            return None  # Ray's placement decides; the start timeout bounds the wait.
        nodes = [node for node in _ray().nodes() if node.get("Alive")]
        if self.node_id is not None:
            nodes = [node for node in nodes if node.get("NodeID") == self.node_id]
            if not nodes:
                return f"ray node {self.node_id} is not a live node of the cluster"
        needed = dict(self.resources)
        if self.num_cpus:
            needed["CPU"] = self.num_cpus
        for option, resource in (("num_gpus", "GPU"), ("memory", "memory")):
            if self.actor_options.get(option):
                needed[resource] = float(self.actor_options[option])
        if any(
            all(node["Resources"].get(key, 0) >= value for key, value in needed.items()) for node in nodes
        ):
            return None
        shown = ", ".join(f"{key}={value:g}" for key, value in sorted(needed.items()))
        where = "the ray node" if self.node_id is not None else "any live ray node"
        return f"it asks for more than {where} has ({shown})"

    # -- isolated workspaces ---------------------------------------------------------------------------

    def isolation_runner(self) -> RayIsolationRunner:
        """A runner of workspace operations on the node where this transport's next agent will run (a
        `subagent.isolation.CoreRunner`, one per run): see `RayIsolationRunner`."""
        return RayIsolationRunner(self)

    def for_workspace(self, data: Mapping[str, Any]) -> RayTransport:
        """This transport, pinned to the node where the workspace ``data`` was made (its ``"node"``, set by
        `RayIsolationRunner`), so that its agent works where its worktree is: ``node_id`` set, and the
        ``actor_options`` that chose a node (``scheduling_strategy``, a placement group, a label selector)
        left out, since they chose that node already. ``fs_roots`` inside the workspace's source are
        served in the workspace instead (moved on the node), as a local sandbox's roots are. Data without
        a node: this transport as it is."""
        node = data.get("node")
        if not isinstance(node, str):
            return self
        pinned = copy.copy(self)
        pinned.node_id = node
        pinned.actor_options = {
            key: value for key, value in self.actor_options.items() if key not in _PLACING_OPTIONS
        }
        pinned._workspace = (str(data["source"]), str(data["root"]))
        return pinned

    def _task_options(self, node_id: str | None) -> dict[str, Any]:
        """Ray options of a workspace operation: on ``node_id`` (nothing reserved there: its agent may hold
        the resources), or, with None, placed as this transport's actors are (its ``node_id`` included)."""
        options: dict[str, Any] = {"max_retries": 0, "retry_exceptions": False}
        actor = self._actor_options()
        options["runtime_env"] = actor["runtime_env"]  # how the package reaches the node, the environment
        if node_id is None:
            options["num_cpus"] = self.num_cpus
            options.update((key, actor[key]) for key in ("resources", *_TASK_PLACING_OPTIONS) if key in actor)
        else:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["num_cpus"] = 0
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return options

    @contextlib.asynccontextmanager
    async def launch(self, launch: Launch) -> AsyncIterator[RayChannel]:
        """Start ``argv`` in an actor on a node of the cluster and own it until the block exits; then tear
        its whole tree down there and end the actor.

        ``env`` is set over the environment of the actor's worker on its node (``inherit_env=False`` in
        ``process_options``: exactly ``env``); ``cwd`` and the program are resolved on that node.

        Raises:
            AgentSpawnError: Ray is not reachable, no node can take the actor (no such live node, not
                enough resources), the actor died or did not start in time, or the program or ``cwd`` is
                missing on its node (the reason names the node). No environment value is ever quoted.
        """
        channel = RayChannel(self, launch.argv, launch.on_stderr_line)
        await channel._start(launch.env, launch.cwd)
        async with own_channel(channel, channel._start_relays, channel._stop_relays):
            yield channel


class RayChannel:
    """One agent in a Ray actor, as `RayTransport.open` yields it (a `subagent.acp.transports.Channel`).

    `pid` is None (no local process is ours); `remote_pid` is the agent's pid on its node, `node_id`
    that node, `worker_pid` the actor's worker process there.
    """

    def __init__(
        self,
        transport: RayTransport,
        command: tuple[str, ...],
        on_stderr_line: Callable[[str], object] | None,
    ) -> None:
        self._transport = transport
        self.command = command
        """The argv the agent was started with on its node."""
        self._on_stderr_line = on_stderr_line
        self.pid: int | None = None
        """Always None: no process of this host runs the agent."""
        self.remote_pid: int | None = None
        """The agent's pid on its node."""
        self.node_id: str | None = None
        """The hex id of the node the actor runs on."""
        self.worker_pid: int | None = None
        """The pid of the actor's worker process on its node."""
        self._actor: Any = None
        self._actor_lock = threading.Lock()
        self._start_abandoned = False
        self._stream: Any = None
        self._in_flight = 0
        """stdin writes sent to the actor and not answered yet."""
        # One thread at a time: the actor's creation, then the stream reader.
        self._limiter = anyio.CapacityLimiter(1)
        self._stdin = _StdinRelay()
        self._stdout = _StdoutRelay()
        self._tail = bytearray()
        self._stderr_bytes_total = 0
        self._exit: dict[str, Any] | None = None
        self._lost: str | None = None
        self._exited = anyio.Event()
        self._stream_done = anyio.Event()
        self._teardown_lock = anyio.Lock()
        self._teardown_report: TeardownReport | None = None
        self._killed = False
        self._relay_scopes: list[anyio.CancelScope] = []

    def __repr__(self) -> str:
        return f"<RayChannel {self.describe()} command={self.command!r}>"

    @property
    def stdin(self) -> anyio.abc.ByteSendStream:
        """The agent's stdin, relayed in ordered batches; closing it closes the agent's stdin after them."""
        return self._stdin

    @property
    def stdout(self) -> anyio.abc.ByteReceiveStream:
        """The agent's stdout, relayed; ends when the agent's does, or when its actor is lost. Keep
        reading it (as the ACP client does): the agent's stderr and exit arrive behind its output."""
        return self._stdout

    @property
    def actor(self) -> Any:
        """The Ray actor handle (for Ray's own tools: ``ray.kill``, the state API), or None once ended."""
        return self._actor

    @property
    def via(self) -> str:
        """``"on ray node 3f2a9c1b"``."""
        return f"on ray node {_short(self.node_id or '?')}"

    def describe(self) -> str:
        """``"pid 123 on ray node 3f2a9c1b"``: the agent's pid on its node."""
        return f"pid {self.remote_pid} {self.via}"

    # -- starting --------------------------------------------------------------------------------------------

    async def _thread(self, function: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(function, *args, limiter=self._limiter, abandon_on_cancel=True)

    def _connect(self) -> str | None:
        """Connect to the cluster unless connected (blocking): None, or why not."""
        return _connect_problem(self._transport)

    def _create_actor(self) -> Any:
        """Check placement, create the actor (blocking): the actor handle, or a reason."""
        transport = self._transport
        problem = transport._placement_problem()
        if problem is not None:
            return problem
        actor = _remote_actor_class().options(**transport._actor_options()).remote()
        with self._actor_lock:
            self._actor = actor
            abandoned = self._start_abandoned
        if abandoned:  # The start gave up (timeout, cancellation) while this thread created it.
            self._kill_actor()
        return actor

    async def _start(self, env: Mapping[str, str] | None, cwd: str | None) -> None:
        timeout = self._transport.start_timeout
        try:
            with anyio.move_on_after(timeout) as scope:
                reason = await self._thread(self._connect)
            if scope.cancelled_caught:
                where = self._transport.address or "auto"
                reason = f"the ray cluster ({where}) did not answer within {timeout:g}s"
            if reason is None:
                # Past max_starting, a start waits for its turn here, before its start timeout runs:
                # it waits for the cluster's CPUs, not for Ray.
                turns = self._transport._start_turn()
                await turns.acquire()
        except BaseException:  # Cancelled, connecting or waiting for its turn: nothing was created.
            self._abandon_start()
            raise
        if reason is not None:
            self._abandon_start()
            raise AgentSpawnError(self.command, reason)
        try:
            await self._place_and_start(env, cwd)
        finally:
            turns.release()

    async def _place_and_start(self, env: Mapping[str, str] | None, cwd: str | None) -> None:
        """Create the actor, have Ray place it and start its worker, start the agent there, open the
        stream; or give up (killing the actor) within the start timeout."""
        timeout = self._transport.start_timeout
        reason: str | None = None
        result: Any = None
        try:
            with anyio.move_on_after(timeout) as scope:
                created = await self._thread(self._create_actor)
                if isinstance(created, str):
                    reason = created
                else:
                    call = created.start.remote(
                        list(self.command),
                        None if env is None else dict(env),
                        cwd,
                        self._transport._process_options(),
                    )
                    result = await _resolve(call)
            if scope.cancelled_caught:
                reason = f"its ray actor was not placed and started within {timeout:g}s"
        except Exception as exc:
            if type(exc).__name__ == "ActorUnschedulableError":
                reason = f"its ray actor cannot be placed: {_first_line(exc)}"
            else:
                reason = f"its ray actor died before starting it: {_why_actor_died(exc)}"
        except BaseException:  # Cancelled: no actor may outlive the start.
            self._abandon_start()
            raise
        if reason is None and result[0] == "failed":
            self.node_id = result[2]
            reason = f"{result[1]} ({self.via})"
        if reason is not None:
            self._abandon_start()
            raise AgentSpawnError(self.command, reason)
        _, self.remote_pid, self.node_id, self.worker_pid = result
        self._stream = self._actor.stream.options(
            num_returns="streaming", _generator_backpressure_num_objects=STREAM_WINDOW
        ).remote()

    def _start_relays(self, task_group: anyio.abc.TaskGroup) -> None:
        task_group.start_soon(
            self._shielded, self._read_stream, name=f"ray stream of agent {self.describe()}"
        )
        task_group.start_soon(self._shielded, self._ship_stdin, name=f"ray stdin of agent {self.describe()}")

    async def _shielded(self, relay: Callable[[], Awaitable[None]]) -> None:
        # Shielded, so that a caller cancelled mid-run (before the agent is ready, too) still has its
        # teardown go through the relays: what was written reaches the agent before its stdin closes,
        # and the agent's exit and last stderr arrive. `_stop_relays` ends them once teardown is over.
        with anyio.CancelScope(shield=True) as scope:
            self._relay_scopes.append(scope)
            await relay()

    def _stop_relays(self) -> None:
        for scope in self._relay_scopes:
            scope.cancel()

    # -- the stream ------------------------------------------------------------------------------------------

    def _next_items(self) -> tuple[Any, ...]:
        """The stream's next item (blocking): ``("items", list)``, ``("end",)`` or ``("lost", why)``."""
        ray = _ray()
        try:
            return ("items", ray.get(next(self._stream)))
        except StopIteration:
            return ("end",)
        except Exception as exc:
            return ("lost", _why_actor_died(exc))

    async def _read_stream(self) -> None:
        try:
            while True:
                outcome = await self._thread(self._next_items)
                if outcome[0] != "items":
                    if outcome[0] == "lost" and self._exit is None:
                        self._lost = outcome[1]
                    break
                for item in outcome[1]:
                    await self._take(item)
        finally:
            self._stdout.end()
            self._stdin.broken = True
            self._stdin.notify()
            self._stream_done.set()
            self._exited.set()

    async def _take(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "o":
            await self._stdout.feed(item[1])
        elif kind == "e":
            self._keep_stderr_line(item[1])
        elif kind == "eof":
            self._stdout.end()
        elif kind == "x":
            self._exit = item[1]
            self._exited.set()

    def _keep_stderr_line(self, line: str) -> None:
        data = line.encode(errors="replace") + b"\n"
        self._stderr_bytes_total += len(data)
        self._tail += data
        del self._tail[: max(0, len(self._tail) - self._transport.stderr_tail_bytes)]
        if self._on_stderr_line is not None:
            self._on_stderr_line(line)

    # -- stdin -----------------------------------------------------------------------------------------------

    async def _ship_stdin(self) -> None:
        relay, actor = self._stdin, self._actor
        window = anyio.Semaphore(STDIN_WINDOW)
        seq = 0
        async with anyio.create_task_group() as acks:
            while not relay.broken:
                if not (relay.buffer or relay.closed):
                    await relay.wait()
                    continue
                await window.acquire()  # Every write in flight is settled by a task of its own.
                if relay.is_broken():  # While waiting: an answer said so, or teardown began.
                    break
                data = None if not relay.buffer else bytes(relay.buffer[:CHUNK_BYTES])
                del relay.buffer[:CHUNK_BYTES]
                self._in_flight += 1
                acks.start_soon(self._settle, actor.write.remote(seq, data), window)
                relay.notify()
                if data is None:  # stdin's end: nothing follows.
                    break
                seq += 1

    async def _settle(self, ref: Any, window: anyio.Semaphore) -> None:
        """Wait for one write to be done (a failed one breaks stdin), and free its place in the window."""
        try:
            answer = await _resolve(ref)
        except Exception:
            answer = "broken"  # The actor is gone; the stream says how.
        self._in_flight -= 1
        window.release()
        if answer != "ok":
            self._stdin.broken = True
            self._stdin.buffer.clear()
        self._stdin.notify()

    # -- the end ---------------------------------------------------------------------------------------------

    def exit_info(self) -> ExitInfo | None:
        """How the agent ended, as its node reported it; or, if its actor was lost first, an unknown
        status with ``via`` saying why; None while it runs."""
        if self._exit is not None:
            wire = self._exit
            teardown_signal = wire["teardown_signal"]
            via = self.via if wire["via"] is None else f"{self.via}, {wire['via']}"
            return ExitInfo(
                command=self.command,
                pid=wire["pid"],
                returncode=wire["returncode"],
                stderr_tail=wire["stderr_tail"],
                stderr_bytes_total=wire["stderr_bytes_total"],
                teardown_signal=None if teardown_signal is None else signal.Signals(teardown_signal),
                status_known=wire["status_known"],
                via=via,
            )
        if self._lost is None:
            return None
        lost_because = f"{self.via}, ray actor died: {self._lost}"
        return ExitInfo.lost(
            self.command, self.remote_pid, self.stderr_tail(), self._stderr_bytes_total, lost_because
        )

    async def wait_exit(self) -> ExitInfo:
        """Wait until the agent exits on its node (its stderr before it has arrived), or its actor is
        lost, and describe it."""
        await self._exited.wait()
        info = self.exit_info()
        if info is None:  # The stream ended without an exit: a teardown that could not report one.
            self._lost = self._lost or "it ended without reporting the agent's exit"
            info = self.exit_info()
        assert info is not None
        return info

    def stderr_tail(self) -> str:
        """The agent's last stderr: the node's tail once the exit is known, else the lines relayed."""
        if self._exit is not None:
            tail: str = self._exit["stderr_tail"]
            return tail
        return bytes(self._tail).decode("utf-8", errors="replace")

    def _abandon_start(self) -> None:
        with self._actor_lock:
            self._start_abandoned = True
        self._kill_actor()
        self._stdout.close()

    def _kill_actor(self) -> None:
        with self._actor_lock:
            actor, self._actor = self._actor, None
        if actor is not None:
            _kill_quietly(actor)

    def kill(self) -> None:
        """Kill the agent's whole tree now: the actor has its supervisor SIGKILL every descendant; if the
        actor has not answered within `KILL_ANSWER_TIMEOUT`, it is killed itself (its supervisor then ends
        the tree, as for a dead worker). Synchronous, idempotent, never raises."""
        actor = self._actor
        if self._killed or actor is None:
            return
        self._killed = True
        try:
            answer = actor.kill_tree.remote().future()
        except Exception:
            answer = None

        def kill_an_unanswering_actor() -> None:
            if answer is None or not answer.done() or answer.exception() is not None:
                _kill_quietly(actor)

        timer = threading.Timer(KILL_ANSWER_TIMEOUT, kill_an_unanswering_actor)
        timer.daemon = True
        timer.start()

    async def aclose(self, *, stdin_close_timeout: float | None = None) -> TeardownReport:
        """Tear the agent's tree down on its node, as locally (close stdin, wait, SIGTERM, wait,
        SIGKILL), then end the actor; the report is the node's. Idempotent, shielded, bounded.

        If the actor was lost, the report is `TeardownStep.CLOSE_STDIN` alone with ``group_gone``
        False: nothing here can confirm it; the agent's supervisor ends the tree on its node."""
        with anyio.CancelScope(shield=True):
            async with self._teardown_lock:
                if self._teardown_report is None:
                    self._teardown_report = await self._tear_down(stdin_close_timeout)
                report = self._teardown_report
        return report

    async def _tear_down(self, stdin_close_timeout: float | None) -> TeardownReport:
        grace = self._transport.stdin_close_timeout if stdin_close_timeout is None else stdin_close_timeout
        exited_before = self._exited.is_set()
        report = TeardownReport((TeardownStep.CLOSE_STDIN,), exited_before, group_gone=False)
        # What was written reaches the agent before its stdin closes (bounded by the grace).
        with anyio.move_on_after(grace):
            while (self._stdin.buffer or self._in_flight) and not self._stdin.broken:
                await self._stdin.wait()
        self._stdin.closed = True
        self._stdin.broken = True
        self._stdin.notify()
        if self._actor is not None and not self._stream_done.is_set():
            with anyio.move_on_after(self._transport._teardown_bound(grace)):
                with contextlib.suppress(Exception):
                    answer = await _resolve(self._actor.teardown.remote(stdin_close_timeout))
                    if answer[0] == "torn-down":
                        _, steps, exited, gone, self._exit = answer
                        report = TeardownReport(tuple(TeardownStep[step] for step in steps), exited, gone)
            with anyio.move_on_after(SIGKILL_TIMEOUT):
                await self._stream_done.wait()
        if self._actor is not None:
            # The actor exits by itself first (its work is done): Ray then drops its connection to the
            # worker at once, which a ray.kill alone leaves to later. ray.kill still makes sure.
            with anyio.move_on_after(RAY_CALL_TIMEOUT), contextlib.suppress(Exception):
                await _resolve(self._actor.__ray_terminate__.remote())
        self._kill_actor()
        self._stdout.close()
        self._exited.set()
        return report

    @property
    def teardown_report(self) -> TeardownReport | None:
        """What teardown did, once it has run."""
        return self._teardown_report


class _Submission:
    """A workspace operation's task, as the thread that submits it and the task that waits for it share it:
    given up on (a timeout, a cancellation) before or after it was submitted, it is cancelled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ref: Any = None
        self._abandoned = False

    def submitted(self, ref: Any) -> None:
        with self._lock:
            self._ref = ref
            abandoned = self._abandoned
        if abandoned:
            _cancel_quietly(ref)

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            ref = self._ref
        if ref is not None:
            _cancel_quietly(ref)


def _cancel_quietly(ref: Any) -> None:
    # Not forced: Ray raises KeyboardInterrupt in the task once the core's git command under way is done
    # (each is bounded), and the core removes what it half made. Forced, the worker would die, leaving it.
    with contextlib.suppress(Exception):
        _ray().cancel(ref)


class RayIsolationRunner:
    """Runs operations of the workspace core (`subagent._isolation_core`) on a node of a Ray cluster, one
    Ray task each (a `subagent.isolation.CoreRunner`; `RayTransport.isolation_runner` makes one per run).

    The first call decides the node: on the transport's ``node_id`` if it has one, else wherever Ray
    places a task with the transport's own placement (its resources, CPUs, ``runtime_env`` and the
    placing ``actor_options``), so it lands on a node that could run the agent. Every later call runs on
    that node (a workspace's own ``"node"`` first, for the operations given one), reserving nothing
    there (its agent may hold the resources), and ``open`` adds ``"node"`` to the workspace it returns:
    `RayTransport.for_workspace` pins the agent there.

    Each call is bounded by the transport's ``isolation_timeout`` (placing the task and starting a worker
    for it included); an operation given up on is cancelled on its node: Ray interrupts it once its git
    command under way is done (each is bounded by ``GIT_TIMEOUT``), and the core removes what it half
    made. A failure comes back as an `~subagent.isolation.IsolationError`: the core's own
    message, or what Ray says of the node or worker (``"the workspace's commit on ray node 3f2a9c1b
    failed: ray node 3f2a9c1b... is not a live node of the cluster"``).
    """

    def __init__(self, transport: RayTransport) -> None:
        self._transport = transport
        self.node_id: str | None = None
        """The node the workspaces are made on, once the first call ran there."""
        self._limiter = anyio.CapacityLimiter(1)

    def __repr__(self) -> str:
        return f"<RayIsolationRunner {self._transport.name} node={self.node_id}>"

    @property
    def key(self) -> tuple[str, str | None]:
        """What `subagent.isolation` reaps from here once per process by (with the place): the cluster and
        the node, which has records directories of its own. It is read before the first call: an unpinned
        transport's runner does not know its node yet, and is keyed by the cluster alone (what this host's
        dead processes left is then reaped on the node its first isolated run from a place lands on)."""
        return (self._transport.name, self.node_id or self._transport.node_id)

    async def __call__(self, operation: str, *args: Any) -> Any:
        from subagent.isolation import IsolationError

        given = args[0].get("node") if args and isinstance(args[0], Mapping) else None
        # None: placed as the transport places its actors (the first call); else pinned there.
        node = given if isinstance(given, str) else self.node_id
        transport = self._transport
        known = node or transport.node_id
        where = (
            f"on ray node {_short(known)}" if known else f"on the ray cluster ({transport.address or 'auto'})"
        )
        timeout = transport.isolation_timeout
        submission = _Submission()
        outcome: Any = None
        try:
            with anyio.move_on_after(timeout) as scope:
                submitted = await anyio.to_thread.run_sync(
                    self._submit,
                    operation,
                    args,
                    node,
                    submission,
                    limiter=self._limiter,
                    abandon_on_cancel=True,
                )
                outcome = submitted if isinstance(submitted, str) else await _resolve(submitted)
        except Exception as exc:
            outcome = _why_task_failed(exc)
        except BaseException:  # Cancelled: the operation is given up on there too.
            submission.abandon()
            raise
        if scope.cancelled_caught:
            submission.abandon()
            raise IsolationError(f"the workspace's {operation} {where} did not finish within {timeout:g}s")
        if isinstance(outcome, str):
            raise IsolationError(f"the workspace's {operation} {where} failed: {outcome}")
        tag, value, ran_on, logged = outcome
        if self.node_id is None:
            self.node_id = ran_on
        for line in logged:  # what the core logged there (a workspace it recovered)
            _isolation_logger.warning("%s (on ray node %s)", line, _short(ran_on))
        if tag == "error":
            raise IsolationError(value)
        if operation == "open":
            value = {**value, "node": ran_on}
        return value

    def _submit(
        self, operation: str, args: tuple[Any, ...], node: str | None, submission: _Submission
    ) -> Any:
        """Connect, check the node can be had, submit the task (blocking): its ``ObjectRef``, or why not."""
        transport = self._transport
        problem = _connect_problem(transport)
        if problem is None:
            if node is None:
                problem = transport._placement_problem()
            elif not any(entry.get("NodeID") == node and entry.get("Alive") for entry in _ray().nodes()):
                problem = f"ray node {node} is not a live node of the cluster"
        if problem is not None:
            return problem
        options = transport._task_options(node)
        ref = _remote_core_operation().options(**options).remote(operation, list(args))
        submission.submitted(ref)
        return ref


def _why_task_failed(exc: BaseException) -> str:
    """A short phrase for Ray's error about a task: its worker or node lost, it could not be placed."""
    name = type(exc).__name__
    if name == "WorkerCrashedError":
        return "its worker process died"
    if name == "NodeDiedError":
        return "its node died"
    if name == "TaskUnschedulableError":
        return f"it cannot be placed: {_first_line(exc)}"
    if name in ("TaskCancelledError", "RayTaskError") or name.startswith("RayTaskError("):
        return _why_actor_died(exc)
    return f"{name}: {_first_line(exc)}"


def _connect_problem(transport: RayTransport) -> str | None:
    """Connect ``transport`` to its cluster unless connected (blocking): None, or why not."""
    try:
        transport._connect()
    except OSError as exc:
        return f"cannot connect to the ray cluster at {transport.address}: {exc.strerror or exc}"
    except Exception as exc:
        where = transport.address or "auto"
        return f"cannot connect to the ray cluster ({where}): {_first_line(exc)}"
    return None


def _kill_quietly(actor: Any) -> None:
    with contextlib.suppress(Exception):
        _ray().kill(actor, no_restart=True)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def transport_from_url(url: str) -> RayTransport:
    """``ray://HOST:PORT`` (the cluster's GCS address) or ``ray://auto`` -> `RayTransport`."""
    # Messages never quote the URL: a mistaken one may hold a secret.
    parts = urlsplit(url)
    if parts.scheme.lower() != "ray" or not parts.netloc:
        raise ValueError("not a ray transport URL: expected ray://HOST:PORT or ray://auto")
    if parts.username is not None or parts.password is not None:
        raise ValueError("a ray transport URL takes no user or password: ray://HOST:PORT or ray://auto")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(
            "a ray transport URL is ray://HOST:PORT or ray://auto, with no path, query or fragment"
        )
    if parts.netloc.lower() == "auto":
        return RayTransport("auto")
    try:
        port = parts.port
    except ValueError:
        raise ValueError("the port of the ray transport URL is not a number from 1 to 65535") from None
    if port is None or not parts.hostname:
        raise ValueError("a ray transport URL names the cluster's GCS address: ray://HOST:PORT or ray://auto")
    host = parts.hostname
    return RayTransport(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
