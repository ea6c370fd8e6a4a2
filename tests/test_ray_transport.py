"""The Ray transport against a real two-node Ray cluster on this machine (tests/raycluster.py).

Each test runs real processes (on asyncio; those marked `both_backends` on trio too): the actor's worker
on a node (the second, unless a test says otherwise), the supervisor and the agent under it. "Nothing
left" is asserted by `assert_no_leaks_over_ray` (the agent carries the leak tag, passed by
`LeakTaggedRayTransport`: it is no descendant of ours) and, where the point is teardown, on the reported
pids themselves. Waits are for events, under ``anyio.fail_after`` as hang guards only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from subagent import SubagentRequest, SubagentResult, SubagentService
from subagent.acp import AgentExitedError, AgentSpawnError, schema
from subagent.acp.client import spawn_agent
from subagent.acp.transports import (
    UNKNOWN_RETURNCODE,
    Channel,
    RayChannel,
    RayTransport,
    TeardownReport,
    TeardownStep,
    Transport,
    supervision_available,
)
from subagent.acp.transports import transport_from_url as any_transport_from_url
from subagent.acp.transports._ray import CHUNK_BYTES, STDIN_BUFFER_BYTES, STDIN_WINDOW, transport_from_url
from subagent.providers.acp import AcpProvider
from subagent.testing import LEAK_TAG_VARIABLE, process_info, stub_agent_argv
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.raycluster import (
    SECOND_RESOURCE,
    RayCluster,
    RayNode,
    assert_no_leaks_over_ray,
    ray_or_skip,
    tagged_processes,
)
from tests.test_faults import texts
from tests.test_ssh_transport import SCENARIOS, fixture_argv, read_line, wait_gone

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.subprocess,
    pytest.mark.skipif(not supervision_available(), reason="the supervisor needs Linux"),
]

WAIT = 30  # seconds: a hang guard on one step, never a statement about speed


class LeakTaggedRayTransport(RayTransport):
    """A `RayTransport` that hands each child this process's leak tag (`LEAK_TAG_VARIABLE`), as set when
    the child is opened (by `subagent.testing.assert_no_leaks`): the child runs on a Ray node,
    not as our descendant, and the tag is how a leak check finds what is left of it."""

    @contextlib.asynccontextmanager
    async def open(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        on_stderr_line: Callable[[str], object] | None = None,
    ) -> AsyncIterator[RayChannel]:
        tag = os.environ.get(LEAK_TAG_VARIABLE)
        if tag is not None:
            env = {**(env or {}), LEAK_TAG_VARIABLE: tag}
        async with super().open(argv, env=env, cwd=cwd, on_stderr_line=on_stderr_line) as channel:
            yield channel


SHORT_GRACE = 0.5  # for a teardown step the agent ignores: it always runs out, and decides nothing


def short(node_id: str) -> str:
    return node_id[:8]


@pytest.fixture
def ray_installed() -> None:
    """Skip a test that needs Ray but no cluster where it is not installed (fail under CI's variable)."""
    ray_or_skip()


@pytest.fixture
def transport(ray_cluster: RayCluster) -> LeakTaggedRayTransport:
    """Children on the second node, given the leak tag."""
    return LeakTaggedRayTransport(node_id=ray_cluster.second_node_id, stdin_close_timeout=SHORT_GRACE)


STUBBORN_TREE = fixture_argv("escaping_descendants.py", "ignore-sigterm", "ignore-sigterm")
"""An agent and three helpers that left its group, all ignoring SIGTERM and stdin EOF: only SIGKILL from
its supervisor ends them. It prints the four pids."""


async def read_tree(channel: Channel) -> list[int]:
    """The pids `STUBBORN_TREE` reports (the agent's first), then its supervisor's."""
    pids = [int(pid) for pid in (await read_line(channel)).split()]
    agent = process_info(pids[0])
    assert agent is not None
    return [*pids, agent.ppid]


async def read_to_end(stream: anyio.abc.ByteReceiveStream) -> bytes:
    received = bytearray()
    with contextlib.suppress(anyio.EndOfStream):
        while True:
            received += await stream.receive(1 << 20)
    return bytes(received)


NODE_LOST = (
    r"its worker or its node is unreachable \(RpcError: RPC error: Socket closed rpc_code: 14\)"
    r"|its node has died|its worker process has died"
)
"""How the loss of an actor whose raylet was killed reads (a regular expression): first, Ray's
connection to the worker drops, before Ray knows the node died; or Ray has said why by then."""


async def wait_lost(channel: RayChannel, node_id: str, why: str) -> None:
    """Wait for the end of an agent whose actor was lost: its stdout ends, its status is unknown, and
    ``via`` names the node and ``why`` (a regular expression)."""
    with anyio.fail_after(WAIT):
        info = await channel.wait_exit()
        assert await read_to_end(channel.stdout) == b""
    assert (info.status_known, info.returncode, info.pid) == (False, UNKNOWN_RETURNCODE, channel.remote_pid)
    assert info.via is not None
    assert re.fullmatch(f"on ray node {short(node_id)}, ray actor died: {why}", info.via), info.via


# -- whole turns ------------------------------------------------------------------------------------------


@pytest.mark.both_backends  # the actor's stdio relay through threads and portals
async def test_a_stub_agent_turn_on_the_second_node_streams_the_reply_and_asks_the_local_permission_policy(
    ray_cluster: RayCluster, transport: RayTransport, tmp_path: Path
) -> None:
    async with (
        assert_no_leaks_over_ray(),
        spawn_agent(
            stub_agent_argv(SCENARIOS / "full_turn.json"), transport=transport, permission="allow"
        ) as client,
    ):
        channel = client.process
        assert isinstance(channel, RayChannel)
        assert isinstance(channel, Channel)
        assert (channel.node_id, channel.pid) == (ray_cluster.second_node_id, None)
        assert (
            channel.describe() == f"pid {channel.remote_pid} on ray node {short(ray_cluster.second_node_id)}"
        )
        with anyio.fail_after(WAIT):
            await client.initialize()
            session = await client.new_session(tmp_path)
            result = await session.prompt("edit main.py")
    assert result.stop_reason == "end_turn"
    assert "".join(texts(result.updates)) == "Looking at the code.Done: main.py is edited."
    assert result.output == "Done: main.py is edited."


async def test_an_acp_provider_over_ray_completes_a_run_with_the_agents_output(
    transport: RayTransport, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command({"turns": [[{"step": "message", "text": "done on ray", "chunks": 4}]]})
    async with assert_no_leaks_over_ray(), SubagentService() as service:
        service.register_provider(AcpProvider(argv, cwd=tmp_path, transport=transport))
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
    assert result == SubagentResult(output="done on ray", stop_reason="completed")


async def test_a_turn_of_thousands_of_chunks_arrives_complete_and_in_order(
    transport: RayTransport, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command({"turns": [[{"step": "flood", "count": 5000, "text": "<{i}>"}]]})
    async with assert_no_leaks_over_ray(), spawn_agent(argv, transport=transport) as client:
        with anyio.fail_after(WAIT):
            await client.initialize()
            session = await client.new_session(tmp_path)
            result = await session.prompt("go")
    assert texts(result.updates) == [f"<{index}>" for index in range(5000)]


# -- stdio ------------------------------------------------------------------------------------------------


async def test_stdout_written_in_many_small_pieces_arrives_exactly_and_stderr_lines_in_order(
    transport: RayTransport,
) -> None:
    script = (
        "import sys\n"
        "for i in range(20000):\n"
        "    sys.stdout.write(f'{i},'); sys.stdout.flush()\n"
        "    if i % 1000 == 0: sys.stderr.write(f'at {i}\\n'); sys.stderr.flush()\n"
    )
    seen: list[str] = []
    async with (
        assert_no_leaks_over_ray(),
        transport.open([sys.executable, "-c", script], on_stderr_line=seen.append) as channel,
    ):
        with anyio.fail_after(WAIT):
            output = await read_to_end(channel.stdout)
            info = await channel.wait_exit()
    assert output == "".join(f"{index}," for index in range(20000)).encode()
    assert seen == [f"at {index}" for index in range(0, 20000, 1000)]
    assert (info.returncode, info.status_known) == (0, True)


async def test_a_message_of_several_mebibytes_on_stdin_arrives_intact_and_in_order(
    transport: RayTransport,
) -> None:
    message = b"".join(b"%09d\n" % index for index in range(800_000))  # 8 MB: batches of 1 MiB
    async with (
        assert_no_leaks_over_ray(),
        transport.open(fixture_argv("echo_lines.py")) as channel,
        anyio.create_task_group() as task_group,
    ):

        async def write() -> None:
            await channel.stdin.send(message)
            await channel.stdin.aclose()

        task_group.start_soon(write)
        with anyio.fail_after(WAIT):
            echoed = await read_to_end(channel.stdout)
            info = await channel.wait_exit()
    assert len(echoed) == len(message)
    assert echoed == message
    assert (info.returncode, info.status_known) == (0, True)


@pytest.mark.both_backends  # the actor's stdio relay through threads and portals
async def test_a_writer_to_an_agent_that_reads_nothing_is_held_once_the_bounded_buffers_are_full(
    transport: RayTransport,
) -> None:
    piece = b"x" * 65536
    sent = 0
    async with (
        assert_no_leaks_over_ray(),
        transport.open([sys.executable, "-c", "import time; time.sleep(600)"]) as channel,
        anyio.create_task_group() as task_group,
    ):
        assert isinstance(channel, RayChannel)

        async def write_forever() -> None:
            nonlocal sent
            while True:
                await channel.stdin.send(piece)
                sent += len(piece)

        task_group.start_soon(write_forever)
        # Full: the buffer here, and the window of writes in flight, none of which the actor can finish
        # (the first waits on the agent's full pipe, the others on the first). Nothing moves after that.
        with anyio.fail_after(WAIT):
            while True:
                if len(channel._stdin.buffer) == STDIN_BUFFER_BYTES and channel._in_flight == STDIN_WINDOW:
                    break
                await anyio.sleep(0.01)  # A poll interval: the wait is bounded above.
        await anyio.wait_all_tasks_blocked()
        # Buffered here, in flight (at most a window of batches), and what went before into the agent's
        # pipe and the writer's buffer on the node (64 KiB each).
        assert STDIN_BUFFER_BYTES < sent <= STDIN_BUFFER_BYTES + STDIN_WINDOW * CHUNK_BYTES + CHUNK_BYTES
        task_group.cancel_scope.cancel()


async def test_the_exit_status_and_stderr_tail_come_from_the_node(
    ray_cluster: RayCluster, transport: RayTransport
) -> None:
    seen: list[str] = []
    async with (
        assert_no_leaks_over_ray(),
        transport.open(
            fixture_argv("exit_with_status.py", "3", "loading", "", "boom"), on_stderr_line=seen.append
        ) as channel,
    ):
        with anyio.fail_after(WAIT):
            info = await channel.wait_exit()
            assert await read_to_end(channel.stdout) == b""
    node = short(ray_cluster.second_node_id)
    assert (info.returncode, info.status_known, info.pid) == (3, True, channel.remote_pid)
    assert (info.via, info.stderr_tail) == (f"on ray node {node}", "loading\n\nboom\n")
    assert seen == ["loading", "", "boom"]
    assert channel.stderr_tail() == "loading\n\nboom\n"
    assert str(info).endswith(
        f"(pid {channel.remote_pid} on ray node {node}) exited with status 3; last stderr: loading | boom"
    )


async def test_env_and_cwd_reach_the_agent_on_its_node(transport: RayTransport, tmp_path: Path) -> None:
    async with (
        assert_no_leaks_over_ray(),
        transport.open(
            fixture_argv("prints_env_and_cwd.py", "AGENT_TOKEN", "UNSET"),
            env={"AGENT_TOKEN": "s3cret value"},
            cwd=str(tmp_path),
        ) as channel,
    ):
        report = json.loads(await read_line(channel))
    assert report == {"cwd": str(tmp_path), "env": {"AGENT_TOKEN": "s3cret value", "UNSET": None}}


async def test_children_run_at_once_each_relaying_its_own_stdio(transport: RayTransport) -> None:
    count = 4
    echoed: dict[int, tuple[bytes, str]] = {}

    async def run_one(index: int) -> None:
        async with transport.open(fixture_argv("echo_lines.py")) as channel:
            await channel.stdin.send(b"child %d\n" % index)
            echoed[index] = (await read_line(channel), channel.describe())

    async with assert_no_leaks_over_ray():
        # A node starts one worker at a time (Ray's startup concurrency is its CPU count: 1 here).
        with anyio.fail_after(WAIT * count):
            async with anyio.create_task_group() as task_group:
                for index in range(count):
                    task_group.start_soon(run_one, index)
    assert [echoed[index][0] for index in range(count)] == [b"child %d" % index for index in range(count)]
    assert len({where for _, where in echoed.values()}) == count


# -- failures to start: typed, with the reason --------------------------------------------------------------


async def test_a_missing_program_or_directory_on_the_node_is_a_spawn_error_naming_the_node(
    ray_cluster: RayCluster, transport: RayTransport, tmp_path: Path
) -> None:
    node = short(ray_cluster.second_node_id)
    async with assert_no_leaks_over_ray():
        with anyio.fail_after(WAIT), pytest.raises(AgentSpawnError) as missing_program:
            async with transport.open([str(tmp_path / "no-such-agent")]):
                pytest.fail("the agent started")
        with anyio.fail_after(WAIT), pytest.raises(AgentSpawnError) as missing_directory:
            async with transport.open(["true"], cwd=str(tmp_path / "no-such-dir")):
                pytest.fail("the agent started")
    assert (
        missing_program.value.reason
        == f"{str(tmp_path / 'no-such-agent')!r} does not exist (on ray node {node})"
    )
    assert missing_directory.value.reason == (
        f"working directory {str(tmp_path / 'no-such-dir')!r} does not exist or is not a directory "
        f"(on ray node {node})"
    )


async def test_a_node_that_is_not_there_or_resources_no_node_has_are_spawn_errors(
    ray_cluster: RayCluster,
) -> None:
    gone = "ab" * 28
    async with assert_no_leaks_over_ray():
        with anyio.fail_after(WAIT), pytest.raises(AgentSpawnError) as no_node:
            async with RayTransport(node_id=gone).open(["true"]):
                pytest.fail("the agent started")
        with anyio.fail_after(WAIT), pytest.raises(AgentSpawnError) as too_much:
            async with RayTransport(resources={SECOND_RESOURCE: 2}).open(["true"]):
                pytest.fail("the agent started")
        on_the_head = RayTransport(node_id=ray_cluster.head_node_id, resources={SECOND_RESOURCE: 1})
        with anyio.fail_after(WAIT), pytest.raises(AgentSpawnError) as elsewhere:
            async with on_the_head.open(["true"]):
                pytest.fail("the agent started")
    assert no_node.value.reason == f"ray node {gone} is not a live node of the cluster"
    assert too_much.value.reason == f"it asks for more than any live ray node has ({SECOND_RESOURCE}=2)"
    assert elsewhere.value.reason == f"it asks for more than the ray node has ({SECOND_RESOURCE}=1)"


async def test_an_actor_that_cannot_be_placed_in_time_fails_the_start_after_the_start_timeout(
    transport: RayTransport,
) -> None:
    # The second node's one unit of its resource is held by a first child; a second one waits for it.
    holding = RayTransport(resources={SECOND_RESOURCE: 1})
    waiting = RayTransport(resources={SECOND_RESOURCE: 1}, start_timeout=1.0)
    async with assert_no_leaks_over_ray(), holding.open(fixture_argv("echo_lines.py")):
        with anyio.fail_after(WAIT), pytest.raises(AgentSpawnError) as caught:
            async with waiting.open(["true"]):
                pytest.fail("the agent started")
    assert caught.value.reason == "its ray actor was not placed and started within 1s"


def actor_workers(node: RayNode) -> list[int]:
    """The pids of the node's worker processes running our actor (Ray names a worker after its actor)."""
    return [info.pid for info in node.processes() if info.comm.startswith("ray::_AgentAct")]


@pytest.mark.both_backends  # the actor's stdio relay through threads and portals
async def test_a_start_cancelled_at_any_moment_leaves_no_actor_and_no_agent(
    ray_cluster: RayCluster, transport: RayTransport
) -> None:
    async with assert_no_leaks_over_ray() as tag:
        async with transport.open(fixture_argv("echo_lines.py")) as channel:
            assert channel.worker_pid in actor_workers(ray_cluster.second)
        for delay in (0.0, 0.05, 0.2, 0.5, 1.0, 2.0):
            with anyio.move_on_after(delay):
                async with transport.open(fixture_argv("echo_lines.py")):
                    await anyio.sleep_forever()
        # A start given up after the agent started leaves its end to the supervisor, once ray.kill
        # ended the worker: wait for that.
        with anyio.fail_after(WAIT):
            while True:
                if not actor_workers(ray_cluster.second) and not tagged_processes(LEAK_TAG_VARIABLE, tag):
                    break
                await anyio.sleep(0.05)  # A poll interval: the wait is bounded above.


class GatedStarts:
    """Records, in order, when each start of a channel takes its turn (``("begin", n)``) and ends
    (``("end", n)``), the n-th start to take its turn numbered from 0; the first start waits at its
    beginning until `release` is set (its start timeout does not run yet)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, int]] = []
        self.release = anyio.Event()
        self.first_began = anyio.Event()
        place_and_start = RayChannel._place_and_start

        async def recorded(channel: RayChannel, env: Mapping[str, str] | None, cwd: str | None) -> None:
            number = sum(1 for event, _ in self.log if event == "begin")
            self.log.append(("begin", number))
            if number == 0:
                self.first_began.set()
                await self.release.wait()
            try:
                await place_and_start(channel, env, cwd)
            finally:
                self.log.append(("end", number))

        monkeypatch.setattr(RayChannel, "_place_and_start", recorded)


async def wait_for_waiting_starts(transport: RayTransport, count: int) -> None:
    """Until ``count`` starts wait for their turn (bounded by the caller's fail_after)."""
    while True:
        if transport._start_turn().statistics().tasks_waiting >= count:
            break
        await anyio.sleep(0.01)  # A poll interval: the semaphore has no event to wait on.


class Opened:
    """The channels opened by `open_and_hold`, in order, a way to wait for them, and `done`: set, they
    are closed."""

    def __init__(self) -> None:
        self.channels: list[RayChannel] = []
        self.done = anyio.Event()
        self._changed = anyio.Event()

    def add(self, channel: RayChannel) -> None:
        self.channels.append(channel)
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, count: int) -> None:
        while len(self.channels) < count:
            await self._changed.wait()


async def open_and_hold(
    transport: RayTransport, opened: Opened, task_status: anyio.abc.TaskStatus[None]
) -> None:
    """Open an echoing agent, note its channel in ``opened``, and hold it open until ``opened.done``."""
    task_status.started()
    async with transport.open(fixture_argv("echo_lines.py")) as channel:
        opened.add(channel)
        await opened.done.wait()


@contextlib.asynccontextmanager
async def first_start_held(
    ray_cluster: RayCluster, monkeypatch: pytest.MonkeyPatch, **options: Any
) -> AsyncIterator[tuple[RayTransport, GatedStarts, Opened, anyio.abc.TaskGroup]]:
    """A transport with ``max_starting=1`` (and ``options``) whose first start, of an echoing agent held
    open, is held back at its beginning; yields it, its starts, its opened channels and the task group
    to open more in. On exit every agent opened is closed, and nothing of them may be left."""
    transport = LeakTaggedRayTransport(node_id=ray_cluster.second_node_id, max_starting=1, **options)
    starts = GatedStarts(monkeypatch)
    opened = Opened()
    async with assert_no_leaks_over_ray(), anyio.create_task_group() as task_group:
        with anyio.fail_after(WAIT):
            await task_group.start(open_and_hold, transport, opened)
            await starts.first_began.wait()
        yield transport, starts, opened, task_group
        opened.done.set()


async def test_with_max_starting_one_a_second_start_begins_only_after_the_first_ended(
    ray_cluster: RayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with first_start_held(ray_cluster, monkeypatch) as (transport, starts, opened, task_group):
        with anyio.fail_after(WAIT):
            await task_group.start(open_and_hold, transport, opened)
            await wait_for_waiting_starts(transport, 1)
            assert starts.log == [("begin", 0)]
            starts.release.set()
            await opened.wait_for(2)
    assert starts.log == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1)]
    assert len({channel.worker_pid for channel in opened.channels}) == 2


async def test_a_start_cancelled_while_waiting_for_its_turn_leaves_no_actor(
    ray_cluster: RayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The workers of an earlier test's actors may still be on their way out (Ray ends them in its own time):
    # only workers new to this test count.
    earlier = set(actor_workers(ray_cluster.second))
    async with first_start_held(ray_cluster, monkeypatch) as (transport, starts, opened, _):
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as waiting:
                await waiting.start(open_and_hold, transport, opened)
                await wait_for_waiting_starts(transport, 1)
                waiting.cancel_scope.cancel()
            starts.release.set()
            await opened.wait_for(1)
            assert set(actor_workers(ray_cluster.second)) - earlier == {opened.channels[0].worker_pid}
    assert starts.log == [("begin", 0), ("end", 0)]
    assert len(opened.channels) == 1


async def test_waiting_for_a_turn_does_not_count_against_the_start_timeout(
    ray_cluster: RayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The two later starts wait longer than the start timeout for their turns (the first is held back
    # that long), then each has its whole timeout for itself: all three start.
    # Long enough for an actor to start on a loaded machine (5 s was not, beside a CPU-heavy job).
    start_timeout = 15.0
    held = first_start_held(ray_cluster, monkeypatch, start_timeout=start_timeout)
    async with held as (transport, starts, opened, task_group):
        with anyio.fail_after(WAIT + start_timeout):
            for _ in range(2):
                await task_group.start(open_and_hold, transport, opened)
            await wait_for_waiting_starts(transport, 2)
            await anyio.sleep(start_timeout + 0.5)  # The scenario: time passes while they wait.
            starts.release.set()
            await opened.wait_for(3)
    assert [event for event, _ in starts.log] == ["begin", "end"] * 3


def test_max_starting_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_starting") as caught:
        RayTransport(max_starting=0)
    assert str(caught.value) == "max_starting must be at least 1"


@pytest.mark.usefixtures("ray_installed")
def test_an_unreachable_cluster_is_a_spawn_error_at_once_in_a_process_of_its_own(tmp_path: Path) -> None:
    # This process is connected to the session's cluster already; a fresh one connects for itself.
    script = (
        "import anyio, sys\n"
        "from subagent.acp._errors import AgentSpawnError\n"
        "from subagent.acp.transports import RayTransport\n"
        "async def main():\n"
        "    try:\n"
        "        async with RayTransport('127.0.0.1:1').open(['true']):\n"
        "            pass\n"
        "    except AgentSpawnError as exc:\n"
        "        print(exc.reason)\n"
        "anyio.run(main)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT, cwd=tmp_path, check=True
    )
    assert done.stdout == "cannot connect to the ray cluster at 127.0.0.1:1: Connection refused\n"


@pytest.mark.usefixtures("ray_installed")
async def test_what_exec_cannot_carry_is_refused_before_anything_starts_without_quoting_it() -> None:
    with pytest.raises(AgentSpawnError) as caught:
        async with RayTransport("127.0.0.1:1").open(["agent"], env={"TOKEN": "secret\0value"}):
            pytest.fail("the agent started")
    assert caught.value.reason == "the value of environment variable 'TOKEN' contains a NUL character"
    assert "secret" not in str(caught.value)


# -- the actor, its worker, teardown -------------------------------------------------------------------------


async def test_sigkill_of_the_actors_worker_ends_the_run_with_an_error_and_leaves_no_process_of_the_child(
    ray_cluster: RayCluster, transport: RayTransport
) -> None:
    async with assert_no_leaks_over_ray() as tag:
        async with transport.open(STUBBORN_TREE) as channel:
            tree = await read_tree(channel)
            assert tree[0] == channel.remote_pid
            assert {info.pid for info in tagged_processes(LEAK_TAG_VARIABLE, tag)} == set(tree)
            assert channel.worker_pid is not None
            os.kill(channel.worker_pid, signal.SIGKILL)
            await wait_lost(channel, ray_cluster.second_node_id, "its worker process has died")
            with pytest.raises(anyio.BrokenResourceError):
                await channel.stdin.send(b"anyone there?\n")
            # The supervisor saw its parent, the worker, gone: it ended the tree, then itself.
            assert await wait_gone(tree) == []
        assert channel.teardown_report == TeardownReport((TeardownStep.CLOSE_STDIN,), True, group_gone=False)


async def test_a_turn_whose_actor_dies_ends_with_an_agent_exited_error_naming_the_node(
    ray_cluster: RayCluster, transport: RayTransport, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command({"turns": [[{"step": "message", "text": "working"}, {"step": "hang"}]]})
    async with assert_no_leaks_over_ray():
        async with spawn_agent(argv, transport=transport) as client:
            channel = client.process
            assert isinstance(channel, RayChannel)
            assert channel.remote_pid is not None
            agent = process_info(channel.remote_pid)
            assert agent is not None
            with anyio.fail_after(WAIT):
                await client.initialize()
                session = await client.new_session(tmp_path)

                def kill_the_worker(update: schema.SessionUpdate) -> None:
                    assert channel.worker_pid is not None
                    dispose()  # once, at the first update
                    os.kill(channel.worker_pid, signal.SIGKILL)

                dispose = session.on_update(kill_the_worker)
                with pytest.raises(AgentExitedError) as caught:
                    await session.prompt("go")
        # The agent's supervisor saw its parent, the worker, gone: it ended the agent, then itself.
        assert await wait_gone([agent.pid, agent.ppid]) == []
    node = short(ray_cluster.second_node_id)
    where = f"(pid {channel.remote_pid} on ray node {node}, ray actor died: its worker process has died)"
    assert where in str(caught.value)


@pytest.fixture
def doomed_node(ray_cluster: RayCluster) -> Iterator[RayNode]:
    """A third node for one test that kills it (the shared nodes stay whole); stopped after."""
    with ray_cluster.extra_node("doomed") as node:
        yield node


async def test_a_dead_node_ends_the_run_with_an_error_naming_it_and_leaves_no_process_of_the_child(
    doomed_node: RayNode,
) -> None:
    transport = LeakTaggedRayTransport(node_id=doomed_node.node_id)
    async with assert_no_leaks_over_ray(), transport.open(STUBBORN_TREE) as channel:
        tree = await read_tree(channel)
        os.kill(doomed_node.raylet_pid, signal.SIGKILL)
        await wait_lost(channel, doomed_node.node_id, NODE_LOST)
        # The worker died with its raylet; its supervisor saw that and ended the tree, then itself.
        assert await wait_gone(tree) == []


async def test_ray_kill_of_the_actor_ends_the_run_and_the_supervisor_ends_the_tree(
    ray_cluster: RayCluster, transport: RayTransport
) -> None:
    ray = ray_or_skip()
    async with assert_no_leaks_over_ray(), transport.open(STUBBORN_TREE) as channel:
        tree = await read_tree(channel)
        assert isinstance(channel, RayChannel)
        ray.kill(channel.actor)  # The worker exits by itself: Ray must leave its children alone.
        await wait_lost(channel, ray_cluster.second_node_id, "it was killed by `ray.kill`")
        assert await wait_gone(tree) == []


@pytest.mark.both_backends  # the actor's stdio relay through threads and portals
async def test_kill_ends_the_whole_tree_at_once_and_the_exit_says_sigkill(transport: RayTransport) -> None:
    async with assert_no_leaks_over_ray():
        async with transport.open(STUBBORN_TREE) as channel:
            tree = await read_tree(channel)
            channel.kill()
            channel.kill()  # idempotent
            with anyio.fail_after(WAIT):
                info = await channel.wait_exit()
            assert (info.killed_by, info.teardown_signal, info.status_known) == (
                signal.SIGKILL,
                signal.SIGKILL,
                True,
            )
            assert await wait_gone(tree) == []
        worker = channel.worker_pid
        assert worker is not None
    assert await wait_gone([worker]) == []  # the actor ended with the channel


async def test_teardown_of_an_agent_that_ignores_stdin_eof_and_sigterm_takes_every_step_and_ends_its_tree(
    transport: RayTransport,
) -> None:
    async with assert_no_leaks_over_ray():
        async with transport.open(
            fixture_argv("escaping_descendants.py", "ignore-sigterm", "obey-sigterm")
        ) as channel:
            pids = [int(pid) for pid in (await read_line(channel)).split()]
        report = await channel.aclose()
        assert report.steps == (TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM, TeardownStep.SIGKILL)
        assert report.group_gone
        assert await wait_gone(pids) == []
    info = channel.exit_info()
    assert info is not None
    assert (info.killed_by, info.teardown_signal) == (signal.SIGKILL, signal.SIGKILL)


async def test_an_agent_that_exits_at_stdin_eof_is_torn_down_gracefully(transport: RayTransport) -> None:
    async with assert_no_leaks_over_ray(), transport.open(fixture_argv("echo_lines.py")) as channel:
        await channel.stdin.send(b"hello over ray\n")
        assert await read_line(channel) == b"hello over ray"
        report = await channel.aclose(stdin_close_timeout=WAIT)
    assert report.graceful
    info = channel.exit_info()
    assert info is not None
    assert (info.returncode, info.status_known) == (0, True)
    with pytest.raises(anyio.ClosedResourceError):
        await channel.stdin.send(b"late\n")


# -- files and terminals on the node ------------------------------------------------------------------------


async def test_the_agents_file_and_terminal_requests_are_served_on_its_node_inside_the_roots(
    ray_cluster: RayCluster, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "input.txt").write_text("read on the node\n")
    terminal = {"sessionId": "any", "command": "true", "cwd": str(root)}
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "read_file", "path": str(root / "input.txt")},
                    {"step": "read_file", "path": str(tmp_path / "outside.txt")},
                    {"step": "call", "method": "terminal/create", "params": terminal},
                ]
            ]
        }
    )
    transport = LeakTaggedRayTransport(node_id=ray_cluster.second_node_id, fs_roots=[root], terminals=True)
    async with assert_no_leaks_over_ray(), spawn_agent(argv, transport=transport) as client:
        with anyio.fail_after(WAIT):
            await client.initialize()
            session = await client.new_session(tmp_path)
            result = await session.prompt("go")
    inside, outside, created = (json.loads(text) for text in texts(result.updates))
    assert inside == {"method": "fs/read_text_file", "result": {"content": "read on the node\n"}}
    assert outside["error"]["code"] == -32602
    assert created["method"] == "terminal/create"
    assert set(created["result"]) == {"terminalId"}


# -- naming and options --------------------------------------------------------------------------------------


@pytest.mark.usefixtures("ray_installed")
def test_a_ray_url_names_the_gcs_address_and_the_registry_builds_it() -> None:
    transport = transport_from_url("ray://10.0.0.5:6379")
    assert (transport.address, transport.name, transport.local_files) == (
        "10.0.0.5:6379",
        "ray://10.0.0.5:6379",
        False,
    )
    assert transport_from_url("ray://[::1]:6379").address == "[::1]:6379"
    auto = any_transport_from_url("ray://auto")
    assert isinstance(auto, RayTransport)
    assert isinstance(auto, Transport)
    assert (auto.address, auto.name) == (None, "ray://auto")
    assert RayTransport().name == "ray://auto"


@pytest.mark.usefixtures("ray_installed")
@pytest.mark.parametrize(
    "url",
    [
        "ray://:6379",
        "ray://host",
        "ray://u:hunter2@host:6379",
        "ray://host:6379/path",
        "ray://host:99999",
        "ray://h:1?x=1",
    ],
)
def test_a_malformed_ray_url_is_refused_without_quoting_it(url: str) -> None:
    with pytest.raises(ValueError, match="ray") as caught:
        transport_from_url(url)
    assert url not in str(caught.value)
    assert "hunter2" not in str(caught.value)


@pytest.mark.usefixtures("ray_installed")
def test_options_that_another_argument_sets_are_refused() -> None:
    with pytest.raises(TypeError, match="'num_cpus' is not given in actor_options"):
        RayTransport(actor_options={"num_cpus": 1})
    with pytest.raises(TypeError, match="'max_restarts' is not given in actor_options"):
        RayTransport(actor_options={"max_restarts": 3})
    with pytest.raises(TypeError, match="'env' is not given in process_options"):
        RayTransport(process_options={"env": {}})
    with pytest.raises(TypeError, match="node_id and a scheduling_strategy"):
        RayTransport(node_id="ab", actor_options={"scheduling_strategy": "SPREAD"})


def test_without_ray_the_transport_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install 'subagent-seam\[ray\]'"):
        RayTransport()
