"""What running a child over SSH or Ray costs against the local transport: streaming, round trips, start-up.

In one run, on the same machine, the same API (``SubagentService`` + ``AcpProvider(transport=...)`` on
the bundled stub agent) drives the child through three transports: ``local`` (the default, a child
process of ours), ``ssh`` (`subagent.acp.transports.SshTransport` to a throwaway ``sshd`` on 127.0.0.1,
started by this script with the SSH tests' own helper, ``tests/sshd.py``, and stopped at the end) and ``ray``
(`subagent.acp.transports.RayTransport` pinned to the second node of the Ray tests' two-node cluster,
``tests/raycluster.py``, which this script starts, joins as its driver and stops at the end: an actor
per child on another node, which on this machine is still loopback). Variants run round-robin, one of
each per round, so a shared machine's load weighs on all alike; figures are medians, and the SSH and
Ray ones are also given as ratios to local measured in the same run. Before the first round each
variant runs once untimed (imports; over Ray, the actor class's export to the cluster).

1. **Streaming**: one run whose turn streams ``--chunks`` ``agent_message_chunk`` updates (start,
   result, dispose). The turn is timed from the prompt leaving (``AcpSession.prompt`` called) to
   ``result()``, every chunk delivered in order; start to dispose is reported beside it.
   Target (issue 13): ssh and ray each within 3x of local.
2. **Round trip**: on one open session, ``--turns`` further turns through ``resume()``, each a
   ``session/prompt`` answered after a one-chunk message (``pong``): one request's round trip, plus
   one notification ahead of its answer, through the whole seam. Median and p90.
3. **Permission question**: the same session alternates those turns with turns that first ask
   ``session/request_permission`` (the provider's policy, a callback, allows) and then send the same
   chunk. The question's round trip (agent -> client -> policy -> agent) is the time of an asking turn
   minus that of the plain turn run just before it, in the same session; median and p90 of those
   differences, and of the asking turns themselves.
4. **Start-up**: ``start()`` to ``started()``: spawn (over SSH: connect, log in, start the remote
   supervisor; over Ray: create the actor, which needs a worker process of its own on the node, and
   start the agent there), ``initialize`` and ``session/new`` answered. Median and p90 of
   ``2 x --repeat`` runs. Beside it, SSH's own share: ``ssh`` with the transport's options running
   ``exit 0`` (connect, key exchange, log in, the login shell), as often; and Ray's: an empty actor
   created on the same node and asked one call, then killed.

Only the streaming figures have a target (PASS/MISS); the others are figures. Where OpenSSH (``sshd``,
``ssh``, ``ssh-keygen``) is not installed, the script says that SSH is skipped and measures the others
(exit 0), unless ``SUBAGENT_REQUIRE_SSH`` is set (then it exits 1); where ``ray`` cannot be imported,
the same for Ray under ``SUBAGENT_REQUIRE_RAY``. It exits 1 when a run broke (a wrong result, a chunk
missing) or when a process of the run is left behind: every agent carries a leak tag in its
environment (passed explicitly: neither an SSH nor a Ray child inherits ours), and afterwards no
process with it may run, on any node, nor any descendant of ours (sshd's sessions and remote
supervisors included, since sshd is our child). Ray's nodes are checked before they are stopped,
which would kill what was left.

    python bench/transport.py [--chunks 100000] [--repeat 5] [--turns 20] [--backend asyncio|trio]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import anyio
from _common import (
    BenchBroken,
    PromptClock,
    median_p90_max,
    settle_descendants,
    verdict,
    write_scenario,
)

from subagent.acp.handlers import PermissionQuestion
from subagent.acp.transports import RayTransport, SshTransport, Transport, supervision_available
from subagent.acp.transports._ray import START_TIMEOUT
from subagent.providers.acp import AcpProvider
from subagent.service import SubagentService
from subagent.testing import LEAK_TAG_VARIABLE, ProcessInfo, leak_tag, leaked_processes
from subagent.types import ResumableRun, SubagentRequest

T = TypeVar("T")

# tests/sshd.py starts the loopback sshd the SSH tests use, tests/raycluster.py the Ray tests' cluster; the
# repository root makes `tests` importable.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

STUB = [sys.executable, "-m", "subagent.testing.stub_agent"]
REQUIRE_SSH_VARIABLE = "SUBAGENT_REQUIRE_SSH"
"""Set: a missing OpenSSH fails the benchmark instead of skipping its SSH half (the SSH tests read it too)."""
REQUIRE_RAY_VARIABLE = "SUBAGENT_REQUIRE_RAY"
"""Set: Ray missing fails the benchmark instead of skipping its Ray half (the Ray tests read it too)."""
REMOTE_VARIANTS = ("ssh", "ray")
PONG = "pong"
STREAM_TARGET = 3.0
"""Issue 13: a 100,000-chunk turn over SSH, and over Ray, within this many times the local one."""
SETTLE_LIMIT = 30.0
"""Seconds the agents' processes may take to be gone once every run was disposed (a hang guard)."""


# -- the runs ------------------------------------------------------------------------------------------------


def provider(command: list[str], cwd: str, transport: Transport | None, **options: Any) -> AcpProvider:
    # The leak tag travels explicitly: an agent over SSH or in a Ray actor does not inherit our environment.
    env = {LEAK_TAG_VARIABLE: os.environ[LEAK_TAG_VARIABLE]}
    return AcpProvider(command, name="stub", cwd=cwd, transport=transport, env=env, **options)


async def flood_run(
    command: list[str], cwd: str, transport: Transport | None, chunks: int
) -> tuple[float, float]:
    """One run streaming ``chunks`` updates: (prompt -> result, start -> dispose)."""
    async with SubagentService(progress_interval=None) as service:
        service.register_provider(provider(command, cwd, transport))
        with PromptClock() as clock:
            began = time.perf_counter()
            run = service.start("stub", SubagentRequest(prompt="go"))
            await run.started()
            result = await run.result()
            finished = time.perf_counter()
            await run.dispose()
            span = time.perf_counter() - began
    if result.stop_reason != "completed" or clock.sent_at is None:
        raise BenchBroken(f"the streaming run did not complete: {result}")
    if result.output != "".join(f"chunk {index} " for index in range(chunks)):
        raise BenchBroken(f"the streaming run's output is wrong ({len(result.output)} characters)")
    return finished - clock.sent_at, span


async def startup_run(command: list[str], cwd: str, transport: Transport | None) -> float:
    """``start()`` -> ``started()`` of a run with a one-chunk turn (then finished and disposed, untimed)."""
    async with SubagentService(progress_interval=None) as service:
        service.register_provider(provider(command, cwd, transport))
        began = time.perf_counter()
        run = service.start("stub", SubagentRequest(prompt="go"))
        await run.started()
        ready = time.perf_counter() - began
        result = await run.result()
        await run.dispose()
    if result.stop_reason != "completed" or result.output != PONG:
        raise BenchBroken(f"the start-up run did not complete: {result}")
    return ready


async def login_run(transport: SshTransport) -> float:
    """The floor of start-up over SSH: ssh as the transport runs it (same options), whose remote command
    only exits: connect, key exchange, log in, the login shell, close."""
    began = time.perf_counter()
    await anyio.run_process([*transport.ssh_argv()[:-1], "exit 0"], check=True)
    return time.perf_counter() - began


async def ping_run(
    command: list[str], cwd: str, transport: Transport | None, turns: int
) -> tuple[list[float], list[float]]:
    """One session: a first turn, then ``turns`` pairs of a plain turn and an asking turn, each timed
    from ``resume()`` to its result: (plain turns, asking turns)."""
    asked = 0

    async def allow(question: PermissionQuestion) -> str:
        nonlocal asked
        asked += 1
        return "allow"

    plain: list[float] = []
    asking: list[float] = []
    async with SubagentService(progress_interval=None) as service:
        service.register_provider(provider(command, cwd, transport, permission=allow))
        run = service.start("stub", SubagentRequest(prompt="go"))
        await run.started()
        first = await run.result()
        if not isinstance(run, ResumableRun):
            raise BenchBroken("an AcpProvider run is not resumable")
        if first.stop_reason != "completed":
            raise BenchBroken(f"the round-trip session's first turn did not complete: {first}")
        for _ in range(turns):
            for samples in (plain, asking):
                began = time.perf_counter()
                result = await run.resume("ping")
                samples.append(time.perf_counter() - began)
                if result.stop_reason != "completed" or result.output != PONG:
                    raise BenchBroken(f"a round-trip turn did not answer {PONG!r}: {result}")
        await run.dispose()
    if asked != turns:
        raise BenchBroken(f"the policy was asked {asked} times, not {turns}")
    return plain, asking


# -- SSH, when it is there ---------------------------------------------------------------------------------


def ssh_missing() -> str | None:
    """Why SSH cannot be measured here, or None if it can."""
    try:
        from tests.sshd import find_program
    except ImportError as exc:  # tests/sshd.py needs pytest (the dev extra)
        return f"the loopback sshd helper (tests/sshd.py) cannot be imported: {exc}"
    missing = [name for name in ("sshd", "ssh", "ssh-keygen") if find_program(name) is None]
    if missing:
        return f"OpenSSH is not installed (no {', '.join(missing)}): apt-get install openssh-server"
    if not supervision_available():
        return "the remote supervisor needs Linux"
    return None


@contextlib.contextmanager
def ssh_variant() -> Iterator[SshTransport | None]:
    """The SSH transport to a loopback sshd started here, or None (SSH skipped); on a normal exit, fails
    if a process of the SSH runs is left (the listener itself excepted, stopped afterwards)."""
    reason = ssh_missing()
    if reason is not None:
        yield None
        return
    from tests.sshd import running_sshd

    with running_sshd() as server:
        yield SshTransport(server.host, config_file=server.config_file)
        # Every run was disposed; the far side of each connection ends on its own right after (sshd's
        # session, the remote supervisor): wait for it while the listener still reaps its sessions.
        left = settle_descendants({server.pid} if server.pid is not None else set())
        if left:
            raise BenchBroken(f"processes left behind by the SSH runs: {left}")


# -- Ray, when it is there ---------------------------------------------------------------------------------


def ray_missing() -> str | None:
    """Why Ray cannot be measured here, or None if it can."""
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed: pip install 'subagent-seam[ray]'"
    try:
        import tests.raycluster  # noqa: F401
    except ImportError as exc:  # tests/raycluster.py needs pytest (the dev extra)
        return f"the test cluster helper (tests/raycluster.py) cannot be imported: {exc}"
    if not supervision_available():
        return "the agent's supervisor on the node needs Linux"
    return None


@contextlib.contextmanager
def ray_variant(tag: str) -> Iterator[tuple[RayTransport, str] | None]:
    """The Ray transport pinned to the second node of a two-node cluster started here, with that node's id,
    or None (Ray skipped); on a normal exit, fails if a process of an agent (``tag``) is left on any node,
    checked before the nodes are stopped (stopping them would kill it)."""
    if ray_missing() is not None:
        yield None
        return
    from tests.raycluster import running_ray_cluster

    try:
        with running_ray_cluster() as cluster:
            yield RayTransport(node_id=cluster.second_node_id), cluster.second_node_id
            left = left_behind(tag)
            if left:
                raise BenchBroken(f"processes left behind by the Ray runs: {left}")
    except AssertionError as exc:  # the cluster's own check: a process of a node outlived its stop
        raise BenchBroken(str(exc)) from exc


def actor_floor(node_id: str) -> float:
    """The floor of start-up over Ray: an empty actor created on ``node_id`` (a worker process started
    for it there) and asked one call, as `RayTransport` places its actors; then killed."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    placement = NodeAffinitySchedulingStrategy(node_id, soft=False)
    began = time.perf_counter()
    actor = _empty_actor_class().options(num_cpus=0, scheduling_strategy=placement).remote()
    ray.get(actor.ready.remote(), timeout=START_TIMEOUT)
    elapsed = time.perf_counter() - began
    ray.kill(actor)
    return elapsed


class _Empty:
    def ready(self) -> int:
        return os.getpid()


@functools.cache
def _empty_actor_class() -> Any:
    import ray

    return ray.remote(_Empty)


# -- running ------------------------------------------------------------------------------------------------


def left_behind(tag: str) -> list[ProcessInfo]:
    """Processes of the agents (carrying ``tag``, on any node) or descendants of ours still running once
    they had `SETTLE_LIMIT` to end: a child's own children end just after it."""
    deadline = time.monotonic() + SETTLE_LIMIT
    while (left := leaked_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)  # A poll interval: the wait is bounded by the deadline.
    return left


def ms(seconds: float) -> str:
    # Round trips are fractions of a millisecond: two decimals there, one above.
    return f"{seconds * 1000:.2f} ms" if seconds < 0.01 else f"{seconds * 1000:.1f} ms"


def spread(samples: list[float]) -> str:
    median, p90, _ = median_p90_max(samples)
    return f"median {ms(median):>9}  p90 {ms(p90):>9}  ({len(samples)} samples)"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1].rsplit("\n\n", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--chunks", type=int, default=100_000, help="updates in the streaming turn (default 100,000)"
    )
    parser.add_argument("--repeat", type=int, default=5, help="rounds; figures are medians (default 5)")
    parser.add_argument(
        "--turns", type=int, default=20, help="plain/asking turn pairs per round-trip session (default 20)"
    )
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio", help="(default asyncio)")
    args = parser.parse_args()
    chunks: int = args.chunks
    repeat: int = args.repeat
    turns: int = args.turns
    backend: str = args.backend
    if min(chunks, repeat, turns) < 1:
        parser.error("--chunks, --repeat and --turns must be at least 1")

    try:
        return measure(chunks, repeat, turns, backend)
    except BenchBroken as broken:
        print(f"BROKEN  {broken}")
        return 1


def measure(chunks: int, repeat: int, turns: int, backend: str) -> int:
    load = os.getloadavg()
    with (
        leak_tag() as tag,
        tempfile.TemporaryDirectory() as work,
        ray_variant(tag) as ray,
        ssh_variant() as ssh,
    ):
        flood = [*STUB, "--scenario", str(write_scenario(work, "flood", flood_scenario(chunks)))]
        pong = [*STUB, "--scenario", str(write_scenario(work, "pong", {"turns": [[message(PONG)]]}))]
        pings = [*STUB, "--scenario", str(write_scenario(work, "pings", ping_scenario(turns)))]
        variants: dict[str, Transport | None] = {"local": None}
        remotes: tuple[tuple[str, Transport | None, Callable[[], str | None], str], ...] = (
            ("ssh", ssh, ssh_missing, REQUIRE_SSH_VARIABLE),
            ("ray", None if ray is None else ray[0], ray_missing, REQUIRE_RAY_VARIABLE),
        )
        for name, remote, missing, require in remotes:
            if remote is None:
                reason = missing()
                if os.environ.get(require):
                    raise BenchBroken(f"{require} is set, and {name} cannot be measured: {reason}")
                print(f"SKIP  {name}: {reason}")
            else:
                variants[name] = remote

        def run(job: Callable[[], Awaitable[T]]) -> T:
            return anyio.run(job, backend=backend)

        # Untimed: imports, the first spawn; over Ray, the actor class exported to the cluster.
        for transport in variants.values():
            run(partial(startup_run, pong, work, transport))
        turn: dict[str, list[float]] = {name: [] for name in variants}
        span: dict[str, list[float]] = {name: [] for name in variants}
        ready: dict[str, list[float]] = {name: [] for name in variants}
        plain: dict[str, list[float]] = {name: [] for name in variants}
        asking: dict[str, list[float]] = {name: [] for name in variants}
        question: dict[str, list[float]] = {name: [] for name in variants}
        login: list[float] = []
        actor: list[float] = []
        for _ in range(repeat):
            for name, transport in variants.items():
                turn_s, span_s = run(partial(flood_run, flood, work, transport, chunks))
                turn[name].append(turn_s)
                span[name].append(span_s)
            for name, transport in variants.items():
                plain_s, asking_s = run(partial(ping_run, pings, work, transport, turns))
                plain[name] += plain_s
                asking[name] += asking_s
                question[name] += [ask - before for before, ask in zip(plain_s, asking_s, strict=True)]
            for _ in range(2):
                for name, transport in variants.items():
                    ready[name].append(run(partial(startup_run, pong, work, transport)))
                if ssh is not None:
                    login.append(run(partial(login_run, ssh)))
                if ray is not None:
                    actor.append(actor_floor(ray[1]))
    left = left_behind(tag)
    if left:
        raise BenchBroken(f"processes left behind: {left}")

    end_load = os.getloadavg()
    where = {"ssh": "ssh to 127.0.0.1", "ray": "ray on the second node of a local two-node cluster"}
    print(
        f"{', '.join(where.get(name, name) for name in variants)} through "
        f"SubagentService + AcpProvider(transport=...), {backend}; {repeat} rounds, round-robin; "
        f"cpus={os.cpu_count()}, load average {load[0]:.2f} -> {end_load[0]:.2f}"
    )
    print(f"1. one turn streaming {chunks:,} chunks (prompt -> result; start -> dispose beside it)")
    for name in variants:
        seconds = statistics.median(turn[name])
        print(
            f"  {name:<6} {ms(seconds):>10}  {chunks / seconds:12,.0f} chunks/s   "
            f"start to dispose {ms(statistics.median(span[name])):>10}"
        )
    print(f"2. one request's round trip: a resume() turn answered after one chunk, {turns} per session")
    for name in variants:
        print(f"  {name:<6} {spread(plain[name])}")
    print("3. a permission question's round trip: an asking turn minus the plain turn before it")
    for name in variants:
        asking_median = ms(statistics.median(asking[name]))
        print(f"  {name:<6} {spread(question[name])}   asking turn: median {asking_median}")
    print("4. start-up: start() -> started() (spawn, initialize, session/new)")
    for name in variants:
        print(f"  {name:<6} {spread(ready[name])}")
    if login:
        print(f"  ssh login alone (ssh HOST 'exit 0'): {spread(login)}")
    if actor:
        print(f"  ray actor alone (an empty actor on the node, one call): {spread(actor)}")
    for name in REMOTE_VARIANTS:
        target = f"a {chunks:,}-chunk turn over {name} <= {STREAM_TARGET:g}x local"
        if name not in variants:
            print(f"SKIP  {target}: {name} not measured")
            continue
        ratios = {
            label: statistics.median(figures[name]) / statistics.median(figures["local"])
            for label, figures in (
                ("streaming turn", turn),
                ("start to dispose", span),
                ("round trip", plain),
                ("permission round trip", question),
                ("start-up", ready),
            )
        }
        print(f"{name} / local: " + ", ".join(f"{label} {ratio:.2f}x" for label, ratio in ratios.items()))
        streaming = ratios["streaming turn"]
        print(verdict(streaming <= STREAM_TARGET, target, f"{streaming:.2f}x"))
    return 0


# -- scenarios -----------------------------------------------------------------------------------------------


def message(text: str) -> dict[str, Any]:
    return {"step": "message", "text": text}


def flood_scenario(chunks: int) -> dict[str, Any]:
    return {"turns": [[{"step": "flood", "count": chunks, "text": "chunk {i} "}]]}


def ping_scenario(turns: int) -> dict[str, Any]:
    """A first turn, then ``turns`` pairs: a plain turn (one chunk), an asking turn (a permission question,
    then the same chunk)."""
    ask = {
        "step": "permission",
        "toolCall": {"toolCallId": "call-1", "title": "probe"},
        "branches": {"allow": [message(PONG)]},
    }
    return {"turns": [[message(PONG)]] + [[message(PONG)], [ask]] * turns, "afterLastTurn": "error"}


if __name__ == "__main__":
    sys.exit(main())
