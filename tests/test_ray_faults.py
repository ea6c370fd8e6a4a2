"""Faults over the Ray transport, on the two-node cluster the suite starts itself (tests/raycluster.py), on
asyncio and trio.

First the faults only Ray has: the raylet of the node a child runs on is killed by pid while a turn
streams (the node is a throwaway third one, so the shared nodes stay whole), and the worker process of
the child's actor is killed (on the second node). Each ends the run with a typed error naming the node
and why, and leaves no process of the child.

Then the fault battery (test_faults.py, as test_ssh_faults.py ports it over SSH), every child pinned to
the second node. Each case asserts its local twin's outcome, adapted where Ray differs: the agent's pid
in a message is the one on its node (``pid N on ray node 3f2a9c1b``), and no process of this host runs
it (`AcpRun.pid` is None; the connection's log names the transport). The actor tears the agent down on
its node as the local transport does, so the exit status, the teardown signal and the teardown steps
are the local ones. "Nothing left" is `assert_no_leaks_over_ray`: the agent carries the leak tag (passed
in its environment), and the actor's worker is gone. Waits are for events, under ``anyio.fail_after`` as
hang guards only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import signal
import sys
import tracemalloc
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import (
    ErrorCode,
    ResumableRun,
    RunState,
    SubagentError,
    SubagentRequest,
    SubagentResult,
    SubagentService,
)
from subagent.acp import schema
from subagent.acp.client import AcpClient, AcpSession, spawn_agent
from subagent.acp.errors import AgentExitedError, MessageTooLargeError, ProtocolError
from subagent.acp.handlers import PermissionQuestion
from subagent.acp.process import UNKNOWN_RETURNCODE, ExitInfo, TeardownStep, supervision_available
from subagent.acp.ray import CHUNK_BYTES, STREAM_WINDOW, RayChannel, RayTransport
from subagent.acp.transport import LocalTransport, Transport
from subagent.providers.acp import AcpProvider
from subagent.testing.leaks import (
    LEAK_TAG_VARIABLE,
    process_is_gone,
)
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.raycluster import RayCluster, RayNode, assert_no_leaks_over_ray
from tests.test_faults import (
    CANCEL_PHASES,
    MIB,
    PERMISSION_PENDING,
    WIRE_FAULTS,
    Lifecycle,
    PhaseCaller,
    WireFault,
    acp_run,
    running_task_ids,
    teardown_options,
    texts,
)
from tests.test_ray_transport import NODE_LOST

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.subprocess,
    pytest.mark.skipif(not supervision_available(), reason="the supervisor needs Linux"),
]

WAIT = 60  # seconds: a hang guard on one case (an extra node starts within it), never about speed
SHORT_NODE_ID = 8
"""How many hex digits of a node id the transport's messages show."""


# -- helpers ---------------------------------------------------------------------------------------------


class RecordingRayTransport(RayTransport):
    """A `RayTransport` that keeps each channel it opens, so a test can reach the agent's node, pid and
    worker behind a service's run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.channels: list[RayChannel] = []

    @asynccontextmanager
    async def open(
        self,
        argv: Sequence[str],
        *,
        env: Any = None,
        cwd: str | None = None,
        on_stderr_line: Callable[[str], object] | None = None,
    ) -> AsyncIterator[RayChannel]:
        async with super().open(argv, env=env, cwd=cwd, on_stderr_line=on_stderr_line) as channel:
            self.channels.append(channel)
            yield channel


def ray_transport(cluster: RayCluster, argv: list[str], node: RayNode | None = None) -> RecordingRayTransport:
    """The transport to ``node`` (the second by default), with test_faults' teardown graces for the stub
    agent ``argv``: the actor applies them on the node as the local transport does here."""
    graces = teardown_options(argv)
    return RecordingRayTransport(
        cluster.address,
        node_id=(node or cluster.second).node_id,
        stdin_close_timeout=graces["stdin_close_timeout"],
        process_options={key: graces[key] for key in ("sigterm_timeout", "sigkill_timeout")},
    )


def ray_provider(
    transport: RayTransport, argv: list[str], tmp_path: Path, tag: str, **options: Any
) -> AcpProvider:
    return AcpProvider(argv, cwd=tmp_path, env={LEAK_TAG_VARIABLE: tag}, transport=transport, **options)


def workers_of(*transports: RecordingRayTransport) -> Callable[[], list[int | None]]:
    """The worker pids of the actors ``transports`` opened, when asked (for `assert_no_leaks_over_ray`)."""
    return lambda: [channel.worker_pid for transport in transports for channel in transport.channels]


@asynccontextmanager
async def open_ray_service(
    *transports: RecordingRayTransport,
) -> AsyncIterator[tuple[SubagentService, Lifecycle, str]]:
    """An open service recording lifecycle events, and the leak tag for its providers' agents. Once
    closed, no process (here or on a node), file descriptor or task may be left."""
    lifecycle = Lifecycle()
    async with assert_no_leaks_over_ray(workers_of(*transports)) as tag:
        before = running_task_ids()
        async with SubagentService() as service:
            service.events.on("subagent/start", lambda info: lifecycle.events.append(("start", info)))
            service.events.on("subagent/end", lambda info: lifecycle.events.append(("end", info)))
            yield service, lifecycle, tag
        assert running_task_ids() == before


@asynccontextmanager
async def ray_client(
    cluster: RayCluster, argv: list[str], **options: Any
) -> AsyncIterator[tuple[AcpClient, RecordingRayTransport]]:
    """`spawn_agent` of ``argv`` on the second node, leak-tagged, inside `assert_no_leaks_over_ray`;
    ``options`` go to `spawn_agent`."""
    transport = ray_transport(cluster, argv)
    async with (
        assert_no_leaks_over_ray(workers_of(transport)) as tag,
        spawn_agent(argv, env={LEAK_TAG_VARIABLE: tag}, transport=transport, **options) as client,
    ):
        yield client, transport


async def ready_session(client: AcpClient, cwd: Path) -> AcpSession:
    """Initialize ``client`` and open a session in ``cwd`` (under the case's hang guard)."""
    await client.initialize()
    return await client.new_session(cwd)


def channel_of(client: AcpClient) -> RayChannel:
    assert isinstance(client.process, RayChannel)
    return client.process


def only_channel(transport: RecordingRayTransport) -> RayChannel:
    (channel,) = transport.channels
    return channel


def where(info: ExitInfo, node: RayNode) -> str:
    assert info.pid is not None
    return f"pid {info.pid} on ray node {node.node_id[:SHORT_NODE_ID]}"


def killed_on_node(
    argv: list[str], info: ExitInfo, signum: signal.Signals, stderr: str, node: RayNode
) -> str:
    """A child killed by ``signum`` (not by teardown) on ``node``, as the actor reported it."""
    return (
        f"agent `{shlex.join(argv)}` ({where(info, node)}) was killed by {signum.name} "
        f"(signal {signum.value}); last stderr: {stderr}"
    )


def closed_stdout_on_node(argv: list[str], info: ExitInfo, stderr: str, node: RayNode) -> str:
    return (
        f"agent `{shlex.join(argv)}` ({where(info, node)}) closed its stdout but is still running; "
        f"last stderr: {stderr}"
    )


# -- the node or the worker dies -------------------------------------------------------------------------

STREAMING_TURN = {"turns": [[{"step": "message", "text": "working"}, {"step": "hang"}]]}
"""A turn that streams one chunk and then works on (hangs) until the child is killed."""


@pytest.mark.parametrize("victim", ["raylet", "worker"])
async def test_killing_the_raylet_or_the_actor_worker_mid_turn_ends_the_run_with_an_error_and_no_process_left(
    ray_cluster: RayCluster, stub_agent_command: StubAgentCommand, tmp_path: Path, victim: str
) -> None:
    argv = stub_agent_command(STREAMING_TURN)
    # A killed raylet takes its node down: a throwaway node of this test's own, so the shared ones stay.
    nodes = (
        ray_cluster.extra_node("doomed") if victim == "raylet" else contextlib.nullcontext(ray_cluster.second)
    )
    with nodes as node:
        transport = ray_transport(ray_cluster, argv, node)
        async with open_ray_service(transport) as (service, lifecycle, tag):
            service.register_provider(ray_provider(transport, argv, tmp_path, tag))
            async with service.start("acp", SubagentRequest(prompt="go")) as run:
                streaming = anyio.Event()
                acp_run(run).on_update(lambda update: streaming.set())
                with anyio.fail_after(WAIT):
                    await streaming.wait()
                    channel = only_channel(transport)
                    assert channel.node_id == node.node_id
                    assert channel.worker_pid in {info.pid for info in node.processes()}
                    os.kill(node.raylet_pid if victim == "raylet" else channel.worker_pid, signal.SIGKILL)
                    result = await run.result()
            info = acp_run(run).exit_info
        agent, worker = channel.remote_pid, channel.worker_pid
    assert info is not None
    assert agent is not None
    assert worker is not None
    assert result == SubagentResult(output="working", stop_reason="error", error=str(info))
    assert (info.pid, info.status_known, info.returncode) == (agent, False, UNKNOWN_RETURNCODE)
    assert info.via is not None
    why = NODE_LOST if victim == "raylet" else "its worker process has died"
    expected = f"on ray node {node.node_id[:SHORT_NODE_ID]}, ray actor died: ({why})"
    assert re.fullmatch(expected, info.via), info.via
    assert str(info) == (
        f"agent `{shlex.join(argv)}` (pid {agent} {info.via}) ended with an unknown status; stderr was empty"
    )
    assert process_is_gone(agent)
    assert process_is_gone(worker)
    assert lifecycle.names == ["start", "end"]


# -- the agent's signal state -----------------------------------------------------------------------------

SIGNAL_STATE = (
    "print(''.join(line for line in open('/proc/self/status') if line.startswith(('SigBlk', 'SigIgn'))))"
)
"""A Python agent's program that prints its blocked and ignored signal masks."""


async def signal_state(transport: Transport) -> str:
    async with transport.open([sys.executable, "-c", SIGNAL_STATE]) as channel:
        printed = b""
        with anyio.fail_after(WAIT):
            with contextlib.suppress(anyio.EndOfStream):
                while True:
                    printed += await channel.stdout.receive()
            await channel.wait_exit()
    return printed.decode()


async def test_an_agent_on_a_ray_node_starts_with_the_signal_state_of_a_local_agent(
    ray_cluster: RayCluster,
) -> None:
    local = await signal_state(LocalTransport())
    on_ray = await signal_state(RayTransport(ray_cluster.address, node_id=ray_cluster.second_node_id))

    assert "SigBlk:\t0000000000000000" in local
    assert on_ray == local


# -- killed by a signal ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "signum"),
    [
        pytest.param("initialize", signal.SIGKILL, id="before initialize answers"),
        pytest.param(
            "authenticate",
            signal.SIGINT,
            id="during authenticate",
        ),
        pytest.param("newSession", signal.SIGTERM, id="during session/new"),
    ],
)
async def test_a_child_on_a_ray_node_killed_before_it_is_ready_fails_the_start_naming_the_signal_and_stderr(
    ray_cluster: RayCluster,
    stub_agent_command: StubAgentCommand,
    tmp_path: Path,
    phase: str,
    signum: signal.Signals,
) -> None:
    steps = [{"step": "stderr", "text": "loading the model\n"}, {"step": "kill", "signal": signum.name}]
    argv = stub_agent_command({"requireAuth": "api-key", phase: {"steps": steps}})
    transport = ray_transport(ray_cluster, argv)
    async with open_ray_service(transport) as (service, lifecycle, tag):
        service.register_provider(ray_provider(transport, argv, tmp_path, tag, auth_method="api-key"))
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
        info = acp_run(run).exit_info
        assert acp_run(run).pid is None  # nothing of this host ran it
    assert info is not None
    assert caught.value.code is ErrorCode.START_FAILED
    assert caught.value.message == killed_on_node(argv, info, signum, "loading the model", ray_cluster.second)
    assert (info.killed_by, info.status_known, info.teardown_signal) == (signum, True, None)
    assert lifecycle.names == []
    assert run.state is RunState.DISPOSED


async def test_a_ray_child_killed_while_its_permission_question_is_pending_ends_the_turn_with_an_error(
    ray_cluster: RayCluster, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(PERMISSION_PENDING)
    clients: list[AcpClient] = []
    asked: list[str] = []
    withdrawn = anyio.Event()

    async def kill_the_child_while_deciding(question: PermissionQuestion) -> str | None:
        asked.append(question.tool_call_id)
        channel = channel_of(clients[0])
        assert channel.remote_pid is not None
        os.kill(channel.remote_pid, signal.SIGKILL)  # the node is on this machine
        try:
            await anyio.sleep_forever()  # the question stays pending while the child dies
        finally:
            withdrawn.set()
        return "allow"

    async with ray_client(ray_cluster, argv, permission=kill_the_child_while_deciding) as (client, _):
        clients.append(client)
        with anyio.fail_after(WAIT):
            session = await ready_session(client, tmp_path)
            with pytest.raises(AgentExitedError) as caught:
                await session.prompt("edit it")
    info = caught.value.exit_info
    assert info is not None
    assert str(caught.value) == killed_on_node(
        argv, info, signal.SIGKILL, "waiting for permission", ray_cluster.second
    )
    assert asked == ["c1"]
    assert withdrawn.is_set()  # the pending question was withdrawn, not left waiting


# -- stdout closed, the child alive ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scenario", "teardown_signal"),
    [
        pytest.param(
            {
                "initialize": {
                    "steps": [{"step": "stderr", "text": "closing stdout\n"}, {"step": "close_stdout"}]
                },
                "onStdinEof": "ignore",
            },
            signal.SIGTERM,
            id="during initialize",
        ),
        pytest.param(
            {
                "newSession": {
                    "steps": [{"step": "stderr", "text": "closing stdout\n"}, {"step": "close_stdout"}]
                },
                "onStdinEof": "ignore",
                "ignoreSigterm": True,
            },
            signal.SIGKILL,
            id="during session/new, SIGTERM ignored",
        ),
    ],
)
async def test_a_child_on_a_ray_node_closing_stdout_before_it_is_ready_fails_the_start_fast_and_is_torn_down(
    ray_cluster: RayCluster,
    stub_agent_command: StubAgentCommand,
    tmp_path: Path,
    scenario: dict[str, Any],
    teardown_signal: signal.Signals,
) -> None:
    # "Fast" is an outcome: the child ignores stdin EOF and lives until teardown, which begins only once
    # the start has failed; an error that waited for its exit would hang.
    argv = stub_agent_command(scenario)
    transport = ray_transport(ray_cluster, argv)
    async with open_ray_service(transport) as (service, lifecycle, tag):
        service.register_provider(ray_provider(transport, argv, tmp_path, tag))
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
            assert acp_run(run).exit_info is None  # still alive: the error did not wait for an exit
        info = acp_run(run).exit_info
    assert info is not None
    assert caught.value.code is ErrorCode.START_FAILED
    assert caught.value.message == closed_stdout_on_node(argv, info, "closing stdout", ray_cluster.second)
    # Torn down on its node as a local child is: the same escalation.
    assert (info.killed_by, info.teardown_signal) == (teardown_signal, teardown_signal)
    assert lifecycle.names == []


async def test_a_ray_child_closing_stdout_mid_turn_ends_the_turn_fast_with_an_error_and_is_torn_down(
    ray_cluster: RayCluster, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "message", "text": "last words"},
                    {"step": "stderr", "text": "closing stdout\n"},
                    {"step": "close_stdout"},
                ]
            ],
            "onStdinEof": "ignore",
            "ignoreSigterm": True,
        }
    )
    transport = ray_transport(ray_cluster, argv)
    async with open_ray_service(transport) as (service, lifecycle, tag):
        service.register_provider(ray_provider(transport, argv, tmp_path, tag))
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            assert isinstance(run, ResumableRun)
            with anyio.fail_after(WAIT):
                result = await run.result()
                alive_when_it_ended = acp_run(run).exit_info is None
                again = await run.resume("hello?")
        info = acp_run(run).exit_info
    assert info is not None
    error = closed_stdout_on_node(argv, info, "closing stdout", ray_cluster.second)
    assert result == SubagentResult(output="last words", stop_reason="error", error=error)
    assert again == SubagentResult(output="", stop_reason="error", error=error)
    assert alive_when_it_ended
    assert (info.killed_by, info.teardown_signal) == (signal.SIGKILL, signal.SIGKILL)
    assert lifecycle.names == ["start", "end"]


# -- a broken wire, a turn that goes on ------------------------------------------------------------------


@pytest.mark.parametrize("fault", list(WIRE_FAULTS.values()), ids=list(WIRE_FAULTS))
async def test_a_wire_fault_mid_turn_over_ray_is_skipped_or_answered_and_reported_and_the_turn_completes(
    ray_cluster: RayCluster,
    stub_agent_command: StubAgentCommand,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    fault: WireFault,
) -> None:
    argv = stub_agent_command(fault.scenario())
    reported: list[ProtocolError] = []
    caplog.set_level(logging.WARNING)
    async with ray_client(ray_cluster, argv, on_protocol_error=reported.append) as (client, transport):
        with anyio.fail_after(WAIT):
            result = await (await ready_session(client, tmp_path)).prompt("go")
    # No process of this host runs the agent: the connection's log names the transport instead.
    fault.check_turn(result, reported, caplog, transport.name)  # type: ignore[arg-type]


async def test_a_100_mib_line_over_ray_is_discarded_with_memory_bounded_by_the_line_limit(
    ray_cluster: RayCluster,
    stub_agent_command: StubAgentCommand,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    size, max_line_bytes = 100 * MIB, 8 * MIB
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "message", "text": "before "},
                    {"step": "huge_line", "bytes": size},
                    {"step": "message", "text": "after"},
                ]
            ]
        }
    )
    caplog.set_level(logging.WARNING)
    transport = ray_transport(ray_cluster, argv)
    async with open_ray_service(transport) as (service, _, tag):
        service.register_provider(ray_provider(transport, argv, tmp_path, tag, max_line_bytes=max_line_bytes))
        # Python's own allocations, not RSS: the stream's items reach this process through Ray's object
        # store, shared memory it maps, whose pages count in RSS though they are the store's, not ours.
        tracemalloc.start()
        try:
            baseline = tracemalloc.get_traced_memory()[0]
            async with service.start("acp", SubagentRequest(prompt="go")) as run:
                with anyio.fail_after(WAIT):
                    result = await run.result()
            growth = tracemalloc.get_traced_memory()[1] - baseline
        finally:
            tracemalloc.stop()
    assert result == SubagentResult(output="before after", stop_reason="completed")
    assert texts(acp_run(run).updates) == ["before ", "after"]
    reports = [record.getMessage() for record in caplog.records if record.name == "subagent.acp.connection"]
    assert reports == [
        f"acp:{transport.name}: discarding a line longer than {max_line_bytes} bytes",
        f"acp:{transport.name}: {MessageTooLargeError(size, max_line_bytes)}",
    ]
    # The line limit bounds it as locally, plus the stream's items in flight (each may be copied once
    # on its way in): measured about 17 MiB, far from the line's 100.
    in_flight = 2 * STREAM_WINDOW * CHUNK_BYTES
    assert growth < max_line_bytes + in_flight + 8 * MIB, (
        f"allocations peaked {growth / MIB:.1f} MiB above the start reading a {size // MIB} MiB line "
        f"over ray with a {max_line_bytes // MIB} MiB limit"
    )


async def test_a_50_mib_stderr_flood_over_ray_deadlocks_nothing_and_leaves_a_bounded_tail(
    ray_cluster: RayCluster, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    flood = 50 * MIB
    argv = stub_agent_command(
        {"turns": [[{"step": "stderr", "bytes": flood}, {"step": "message", "text": "after the flood"}]]}
    )
    async with ray_client(ray_cluster, argv) as (client, transport):
        with anyio.fail_after(WAIT):
            result = await (await ready_session(client, tmp_path)).prompt("go")
        tail = channel_of(client).stderr_tail()
    info = channel_of(client).exit_info()
    assert result.output == "after the flood"
    assert 0 < len(tail.encode()) <= transport.stderr_tail_bytes
    assert info is not None
    assert info.stderr_bytes_total >= flood


# -- the caller cancelled --------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", CANCEL_PHASES)
async def test_cancelling_the_caller_at_any_phase_disposes_the_ray_run_and_leaves_nothing_anywhere(
    ray_cluster: RayCluster, stub_agent_command: StubAgentCommand, tmp_path: Path, phase: str
) -> None:
    caller = PhaseCaller(phase)
    argv = stub_agent_command(caller.spec.scenario)
    transport = ray_transport(ray_cluster, argv)
    async with open_ray_service(transport) as (service, lifecycle, tag):
        provider = ray_provider(
            transport, argv, tmp_path, tag, on_stderr_line=caller.on_stderr_line, permission=caller.permission
        )
        service.register_provider(provider)
        tasks_before = running_task_ids()
        run, child = await caller.drive(service, WAIT)
        assert running_task_ids() == tasks_before
        info = child.exit_info
        with pytest.raises(SubagentError) as result_error:
            await run.result()
    if phase == "while waiting for started, before the child exists":
        assert transport.channels == []  # disposed before the spawn: no actor, no child ever existed
        remote_pid = None
    else:
        channel = only_channel(transport)
        remote_pid = channel.remote_pid
        assert remote_pid is not None
        assert process_is_gone(remote_pid)
        assert info is not None
        assert (info.pid, info.returncode, info.status_known) == (remote_pid, caller.spec.returncode, True)
        # Torn down on its node as locally, whenever the caller was cancelled: stdin closed first, and the
        # agent exited at that (or, ignoring it, at SIGTERM).
        gracefully = caller.spec.returncode == 0
        assert channel.teardown_report is not None
        assert list(channel.teardown_report.steps) == (
            [TeardownStep.CLOSE_STDIN] if gracefully else [TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM]
        )
        assert info.teardown_signal == (None if gracefully else signal.SIGTERM)
    caller.check_disposed(result_error.value, remote_pid, lifecycle)


async def test_a_cancel_the_agent_on_a_ray_node_honours_ends_the_turn_cancelled(
    ray_cluster: RayCluster, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {"turns": [[{"step": "message", "text": "working"}, {"step": "wait_for_cancel"}]]}
    )
    async with ray_client(ray_cluster, argv) as (client, _):
        with anyio.fail_after(WAIT):
            session = await ready_session(client, tmp_path)
            first = anyio.Event()
            results: list[Any] = []

            async def run() -> None:
                results.append(await session.prompt("go", on_update=lambda update: first.set()))

            async with anyio.create_task_group() as task_group:
                task_group.start_soon(run)
                await first.wait()
                await session.cancel()
    assert (results[0].stop_reason, results[0].output) == ("cancelled", "working")


# -- hangs, ended by timeouts ----------------------------------------------------------------------------

READY_TIMEOUT = 5.0
"""Long enough for the actor's placement, the stub agent's start-up and its first stderr line on a
loaded machine (it hangs in initialize: the timeout always runs out, so its length decides no outcome)."""
SILENCE_TIMEOUT = 1.0
"""The turn's inactivity timeout: the agent, already running, sends its first chunk well within it."""


async def test_a_child_on_a_ray_node_that_never_answers_initialize_fails_the_start_after_the_ready_timeout(
    ray_cluster: RayCluster, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {"initialize": {"steps": [{"step": "stderr", "text": "loading model...\n"}, {"step": "hang"}]}}
    )
    transport = ray_transport(ray_cluster, argv)
    async with open_ray_service(transport) as (service, lifecycle, tag):
        service.register_provider(ray_provider(transport, argv, tmp_path, tag, ready_timeout=READY_TIMEOUT))
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
    assert caught.value.code is ErrorCode.START_FAILED
    assert caught.value.message == (
        f"agent `{shlex.join(argv)}` was not ready within {READY_TIMEOUT:g} s; last stderr: loading model..."
    )
    assert lifecycle.names == []


async def test_silence_past_the_timeout_ends_a_turn_over_ray_with_timeout_and_keeps_the_output(
    ray_cluster: RayCluster, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {"turns": [[{"step": "message", "text": "thinking"}, {"step": "wait_for_cancel"}]]}
    )
    transport = ray_transport(ray_cluster, argv)
    async with open_ray_service(transport) as (service, lifecycle, tag):
        service.register_provider(ray_provider(transport, argv, tmp_path, tag))
        async with service.start("acp", SubagentRequest(prompt="go", timeout=SILENCE_TIMEOUT)) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
    assert result == SubagentResult(
        output="thinking", stop_reason="timeout", error=f"inactive for more than {SILENCE_TIMEOUT:g} s"
    )
    assert lifecycle.names == ["start", "end"]


# -- teardown of what will not go ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ignore_sigterm", "last_signal"),
    [
        pytest.param(False, signal.SIGTERM, id="SIGTERM honoured"),
        pytest.param(True, signal.SIGKILL, id="SIGTERM ignored"),
    ],
)
async def test_a_ray_agent_ignoring_stdin_eof_is_torn_down_on_its_node_by_escalation_and_its_tree_is_gone(
    ray_cluster: RayCluster,
    stub_agent_command: StubAgentCommand,
    tmp_path: Path,
    ignore_sigterm: bool,
    last_signal: signal.Signals,
) -> None:
    argv = stub_agent_command({"onStdinEof": "ignore", "ignoreSigterm": ignore_sigterm})
    async with ray_client(ray_cluster, argv) as (client, _):
        with anyio.fail_after(WAIT):
            await ready_session(client, tmp_path)
        report = await channel_of(client).aclose()
        info = channel_of(client).exit_info()
    # The actor ran the local teardown on the node: its steps, and the agent's real status.
    steps = [TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM]
    assert list(report.steps) == steps + ([TeardownStep.SIGKILL] if ignore_sigterm else [])
    assert report.group_gone
    assert info is not None
    assert info.pid is not None
    assert (info.status_known, info.killed_by, info.teardown_signal) == (True, last_signal, last_signal)
    assert process_is_gone(info.pid)


@pytest.mark.parametrize("ignore_sigterm", [False, True], ids=["SIGTERM honoured", "SIGTERM ignored"])
async def test_a_grandchild_on_a_ray_node_is_gone_after_teardown(
    ray_cluster: RayCluster, stub_agent_command: StubAgentCommand, tmp_path: Path, ignore_sigterm: bool
) -> None:
    pid_file = tmp_path / "grandchild.pid"
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "grandchild", "pidFile": str(pid_file), "ignoreSigterm": ignore_sigterm},
                    {"step": "message", "text": "spawned"},
                ]
            ]
        }
    )
    async with ray_client(ray_cluster, argv) as (client, _):
        with anyio.fail_after(WAIT):
            result = await (await ready_session(client, tmp_path)).prompt("go")
        grandchild = int(pid_file.read_text())
        assert not process_is_gone(grandchild)
    assert process_is_gone(grandchild)
    report = json.dumps({"grandchild": grandchild}, separators=(",", ":"))
    assert [
        update.content.text
        for update in result.updates
        if isinstance(update, schema.AgentMessageChunk) and isinstance(update.content, schema.TextContent)
    ] == [report, "spawned"]
