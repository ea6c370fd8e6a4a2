"""Faults over the Ray transport, on the two-node cluster the suite starts itself (tests/raycluster.py), on
asyncio and trio.

First the faults only Ray has: the raylet of the node a child runs on is killed by pid while a turn
streams (the node is a throwaway third one, so the shared nodes stay whole), and the worker process of
the child's actor is killed (on the second node). Each ends the run with a typed error naming the node
and why, and leaves no process of the child.

Then the fault battery (tests/remote_faults.py, as test_ssh_faults.py binds it to SSH), every child pinned
to the second node. Where Ray differs from a local child: the agent's pid in a message is the one on its
node (``pid N on ray node 3f2a9c1b``), and no process of this host runs it (`AcpRun.pid` is None; the
connection's log names the transport). The actor tears the agent down on its node as the local transport
does, so the exit status, the teardown signal and the teardown steps are the local ones. "Nothing left"
is `assert_no_leaks_over_ray`: the agent carries the leak tag (passed in its environment), and the
actor's worker is gone. Waits are for events, under ``anyio.fail_after`` as hang guards only.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import sys
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import SubagentRequest, SubagentResult
from subagent.acp.transports import (
    UNKNOWN_RETURNCODE,
    ExitInfo,
    LocalTransport,
    RayChannel,
    RayTransport,
    TeardownStep,
    Transport,
    supervision_available,
)
from subagent.acp.transports._ray import CHUNK_BYTES, STREAM_WINDOW
from subagent.testing import process_is_gone
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.raycluster import RayCluster, RayNode, assert_no_leaks_over_ray
from tests.remote_faults import (
    BEFORE_THE_SPAWN,
    REMOTE_FAULT_CASES,
    Bench,
    FaultCase,
    Remote,
    open_service,
    provider,
)
from tests.test_faults import MIB, PhaseCaller, acp_run, teardown_options
from tests.test_ray_transport import NODE_LOST

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.subprocess,
    pytest.mark.skipif(not supervision_available(), reason="the supervisor needs Linux"),
]

SHORT_NODE_ID = 8
"""How many hex digits of a node id the transport's messages show."""


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


def only_channel(transport: RecordingRayTransport) -> RayChannel:
    (channel,) = transport.channels
    return channel


class OverRay(Remote[RecordingRayTransport]):
    """The battery over Ray, each agent on ``node`` (the cluster's second by default)."""

    wait = 60  # an extra node starts within it
    ready_timeout = 5.0  # the actor's placement too
    channel_type = RayChannel

    def __init__(self, cluster: RayCluster, node: RayNode | None = None) -> None:
        self.cluster = cluster
        self.node = node or cluster.second

    def transport(self, argv: list[str]) -> RecordingRayTransport:
        # The actor applies test_faults' teardown graces on the node as the local transport does here.
        graces = teardown_options(argv)
        return RecordingRayTransport(
            self.cluster.address,
            node_id=self.node.node_id,
            stdin_close_timeout=graces["stdin_close_timeout"],
            process_options={key: graces[key] for key in ("sigterm_timeout", "sigkill_timeout")},
        )

    def no_leaks(self, *transports: RecordingRayTransport) -> AbstractAsyncContextManager[str]:
        # The worker pids of the actors the transports opened, asked for once they are closed.
        return assert_no_leaks_over_ray(
            lambda: [channel.worker_pid for transport in transports for channel in transport.channels]
        )

    @property
    def place(self) -> str:
        return f"on ray node {self.node.node_id[:SHORT_NODE_ID]}"

    def gone(self, local_pid: int | None, info: ExitInfo | None = None) -> None:
        assert local_pid is None  # nothing of this host ran it; the leak check covers the node

    def torn_down(self, info: ExitInfo | None, last_signal: signal.Signals) -> None:
        # Torn down on its node as a local child is: the same escalation, and the agent's real status.
        assert info is not None
        assert (info.status_known, info.killed_by, info.teardown_signal) == (True, last_signal, last_signal)

    def teardown_steps(self, ignore_sigterm: bool) -> list[TeardownStep]:
        steps = [TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM]
        return steps + ([TeardownStep.SIGKILL] if ignore_sigterm else [])

    def log_name(self, local_pid: int | None, transport: RecordingRayTransport) -> str:
        return transport.name  # no process of this host runs the agent

    @contextlib.contextmanager
    def measuring_memory(self) -> Iterator[list[int]]:
        # Python's own allocations, not RSS: the stream's items reach this process through Ray's object
        # store, shared memory it maps, whose pages count in RSS though they are the store's, not ours.
        growth: list[int] = []
        tracemalloc.start()
        try:
            baseline = tracemalloc.get_traced_memory()[0]
            yield growth
            growth.append(tracemalloc.get_traced_memory()[1] - baseline)
        finally:
            tracemalloc.stop()

    def line_memory_bound(self, max_line_bytes: int) -> int:
        # The line limit bounds it as locally, plus the stream's items in flight (each may be copied once
        # on its way in): measured about 17 MiB, far from the line's 100.
        in_flight = 2 * STREAM_WINDOW * CHUNK_BYTES
        return max_line_bytes + in_flight + 8 * MIB

    def growth_message(self, growth: int, size: int, max_line_bytes: int) -> str:
        return (
            f"allocations peaked {growth / MIB:.1f} MiB above the start reading a {size // MIB} MiB line "
            f"over ray with a {max_line_bytes // MIB} MiB limit"
        )

    def check_cancelled(
        self,
        caller: PhaseCaller,
        local_pid: int | None,
        info: ExitInfo | None,
        transport: RecordingRayTransport,
    ) -> int | None:
        if caller.phase == BEFORE_THE_SPAWN:
            assert transport.channels == []  # disposed before the spawn: no actor, no child ever existed
            return None
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
        return remote_pid


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
        remote = OverRay(ray_cluster, node)
        transport = remote.transport(argv)
        async with open_service(remote, transport) as (service, lifecycle, tag):
            service.register_provider(provider(transport, argv, tmp_path, tag))
            async with service.start("acp", SubagentRequest(prompt="go")) as run:
                streaming = anyio.Event()
                acp_run(run).on_update(lambda update: streaming.set())
                with anyio.fail_after(remote.wait):
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
        with anyio.fail_after(OverRay.wait):
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


# -- the battery -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", REMOTE_FAULT_CASES)
async def test_the_fault_battery_holds_over_ray(
    case: FaultCase,
    ray_cluster: RayCluster,
    stub_agent_command: StubAgentCommand,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await case(OverRay(ray_cluster), Bench(stub_agent_command, tmp_path, caplog))
