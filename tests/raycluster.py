"""A real Ray cluster of two nodes on this machine, started and stopped by the test suite, for the Ray
transport's tests.

`ray_cluster` (a session-scoped pytest fixture; tests/conftest.py registers it) starts a head node and a
second node, each a ``ray start --block`` process of its own, connects this process to the head
(``ray.init(address=...)``, once per process) and yields a `RayCluster`. Each node has everything of its
own, so that two test sessions on one machine never meet:

- ports: the GCS, node manager, object manager, agents' and metrics ports are ``0`` or left to Ray, which
  binds them with port 0 and publishes what the kernel gave (no port is guessed, so none is raced for);
  workers bind port 0 too (``--min-worker-port 0 --max-worker-port 0``); the dashboard, which only
  accepts a fixed port, gets one found free here;
- a directory of its own (short: Ray puts Unix sockets under it, and a socket path is limited to 107
  bytes) inside the cluster's directory, which holds the cluster's token file and is private (0700);
- one custom resource each (`HEAD_RESOURCE`, `SECOND_RESOURCE`), one CPU, a small object store;
- token authentication (``RAY_AUTH_MODE=token``: a second node joins only so) with a fresh token in a
  file there (``RAY_AUTH_TOKEN_PATH``), never printed and never in ``~/.ray``;
- a tag in the environment of every process of the node (`NODE_TAG_VARIABLE`; raylets pass their
  environment on to their workers), which is how `RayNode.processes` finds them: a worker renames itself
  ``ray::…``, so its command line does not say which cluster it belongs to.

The nodes are detached from this process: a node's processes must not be descendants of the test
session, or every `assert_no_leaks` in a later test would count the cluster as a leak. Each node's
``ray start`` is the child of a small keeper left to init, which reaps it and stops it if this session
dies without doing so. They are stopped by pid: SIGTERM to each node's ``ray start``
(it stops its processes; draining is turned off), then SIGKILL to whatever still carries the node's tag,
and the fixture asserts that nothing does. Never ``ray stop``: it ends every Ray process on the machine,
another session's cluster included.

`RayCluster.extra_node` starts a third node for a test that kills one (its raylet, its worker) and stops
it after, so the shared nodes stay whole.

Where ``ray`` is not installed the tests that need it are skipped, or fail when `REQUIRE_RAY_VARIABLE`
is set (CI sets it).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import anyio
import pytest

from subagent.testing import (
    LEAK_TAG_VARIABLE,
    ProcessInfo,
    leak_tag,
    leaked_processes,
    open_fds,
    process_info,
    process_is_gone,
)

__all__ = [
    "HEAD_RESOURCE",
    "NODE_TAG_VARIABLE",
    "REQUIRE_RAY_VARIABLE",
    "SECOND_RESOURCE",
    "RayCluster",
    "RayNode",
    "assert_no_leaks_over_ray",
    "files_but_sockets",
    "ray_cluster",
    "ray_or_skip",
    "tagged_processes",
    "wait_until",
]

REQUIRE_RAY_VARIABLE = "SUBAGENT_REQUIRE_RAY"
"""Set (CI sets it): a missing ``ray`` fails the Ray tests instead of skipping them."""
NODE_TAG_VARIABLE = "SUBAGENT_TEST_RAY_NODE"
"""Set in the environment of every process of a node this module starts, to a value unique to the node."""
HEAD_RESOURCE = "subagent_head"
"""The custom resource only the head node has (one unit)."""
SECOND_RESOURCE = "subagent_second"
"""The custom resource only the second node has (one unit)."""
START_TIMEOUT = 90.0
"""A hang guard on a node starting and joining (about 6 s for the head on an idle machine)."""
STOP_TIMEOUT = 30.0
"""A hang guard on a node's processes exiting after SIGTERM, and again after SIGKILL."""
OBJECT_STORE_BYTES = 100 * 1024 * 1024
"""Each node's object store: Ray's smallest allowed (75 MiB) with room; the tests move little data."""
LEAK_SETTLE_TIMEOUT = 30.0
"""How long `assert_no_leaks_over_ray` waits for what finished runs left on their nodes to be gone: an
agent's supervisor ends its tree about a second after its worker dies, and Ray ends a killed actor's
worker on its own schedule. A hang guard, never a statement about speed."""
_POLL_INTERVAL = 0.05
"""How often a bounded wait here looks again (every wait has a deadline)."""
_MAX_SOCKET_DIR = 40
"""The longest cluster directory used: Ray adds about 65 bytes of session and socket names below it."""
_LAUNCHER = """
import os, signal, subprocess, sys, time

owner, log_path, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]


def owner_alive():
    try:
        with open(f"/proc/{owner}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


read_end, write_end = os.pipe()
if os.fork():
    os.close(write_end)
    with os.fdopen(read_end) as pid:
        print(pid.read(), flush=True)
    sys.exit(0)
os.close(read_end)
os.setsid()
with open(log_path, "ab") as log:
    node = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
os.write(write_end, str(node.pid).encode())
os.close(write_end)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
while node.poll() is None:
    if not owner_alive():
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(30)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()
    time.sleep(0.5)
"""
"""Starts a node without making it our descendant (see the module docstring): it forks a keeper, which
starts ``ray start --block`` in a session of its own and hands its pid back, and exits; the keeper, left
to init, reaps the node when it ends, and stops it (SIGTERM) if the test session that started it dies
without stopping it (killed, say), so a cluster never outlives its session."""


def ray_or_skip() -> ModuleType:
    """The ``ray`` module, or skip (fail under `REQUIRE_RAY_VARIABLE`) where it is not installed."""
    try:
        import ray
    except ImportError as error:
        reason = f"ray is not installed ({error}): pip install 'subagent-seam[test]'"
        if os.environ.get(REQUIRE_RAY_VARIABLE):
            pytest.fail(reason)
        pytest.skip(reason)
    return ray


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _environ(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ_file:
            return environ_file.read().split(b"\0")
    except OSError:
        return []  # Gone, or another user's process.


def tagged_processes(variable: str, value: str) -> list[ProcessInfo]:
    """The running processes (zombies excluded) whose environment sets ``variable`` to ``value``."""
    entry = f"{variable}={value}".encode()
    with os.scandir("/proc") as entries:
        pids = [int(entry.name) for entry in entries if entry.name.isdigit()]
    found = []
    for pid in pids:
        info = process_info(pid)
        if info is not None and not info.is_zombie and pid != os.getpid() and entry in _environ(pid):
            found.append(info)
    return sorted(found, key=lambda info: info.pid)


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Return once ``condition()`` holds; past ``timeout`` seconds raise `TimeoutError` with ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} within {timeout:g}s")
        time.sleep(_POLL_INTERVAL)  # A poll interval: the wait is bounded by the deadline.


def _signal(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def rss_bytes(pid: int) -> int:
    """The resident set size of ``pid`` (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def pss_bytes(pid: int) -> int:
    """The proportional set size of ``pid`` (shared pages split among their users; 0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def files_but_sockets() -> Counter[str]:
    """What this process's file descriptors point at, sockets and the scan's own descriptor left out: Ray's
    driver opens and closes its gRPC connections (to raylets, to workers) on its own schedule."""
    scan = f"/proc/{os.getpid()}/fd"
    return Counter(
        target for target in open_fds().values() if not target.startswith("socket:") and target != scan
    )


def _left_behind(tag: str, workers: Iterable[int | None]) -> list[ProcessInfo | int]:
    left: list[ProcessInfo | int] = list(leaked_processes(tag))
    return left + [pid for pid in workers if pid is not None and not process_is_gone(pid)]


@contextlib.asynccontextmanager
async def assert_no_leaks_over_ray(
    workers: Callable[[], Iterable[int | None]] = tuple,
) -> AsyncIterator[str]:
    """`subagent.testing.assert_no_leaks` for runs over Ray; yields the leak tag.

    Pass ``{LEAK_TAG_VARIABLE: tag}`` in the agent's environment (an actor's worker has its node's
    environment, not ours). On exit it waits (bounded by `LEAK_SETTLE_TIMEOUT`) until no process carries
    the tag or descends from this one, and none of the pids ``workers()`` then gives (the actors' worker
    processes) runs; then it checks that this process has the same file descriptors as on entry, sockets
    aside (see `files_but_sockets`).
    """
    with leak_tag() as tag:
        files_before = files_but_sockets()
        yield tag
    pids = list(workers())
    with anyio.move_on_after(LEAK_SETTLE_TIMEOUT):
        while True:
            if not _left_behind(tag, pids):
                break
            await anyio.sleep(_POLL_INTERVAL)  # The wait is bounded above.
    left = _left_behind(tag, pids)
    assert not left, f"processes left behind: {left}"
    files_after = files_but_sockets()
    assert files_after == files_before, (
        f"descriptors opened {files_after - files_before}, closed {files_before - files_after}"
    )


@dataclass
class RayNode:
    """One node this module started: its ``ray start --block`` process and what Ray told about it."""

    name: str
    directory: Path
    """The node's Ray temp dir (``--temp-dir``): sessions, logs, sockets."""
    tag: str
    """The value of `NODE_TAG_VARIABLE` in the environment of each of the node's processes."""
    resource: str
    """The custom resource only this node has (one unit)."""
    launcher_pid: int
    """The pid of the node's ``ray start --block`` (not our descendant: see the module docstring)."""
    node_id: str = ""
    """Ray's node id (hex), known once the node has joined."""
    address: str = ""
    """The GCS address (``host:port``) the node wrote once started."""

    @property
    def log_file(self) -> Path:
        """What ``ray start`` printed."""
        return self.directory.parent / f"{self.name}.log"

    def log(self) -> str:
        """What ``ray start`` printed so far."""
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def processes(self) -> list[ProcessInfo]:
        """The running processes of this node: ``ray start``, GCS, raylet, agents, workers."""
        return tagged_processes(NODE_TAG_VARIABLE, self.tag)

    def pids_named(self, comm: str) -> list[int]:
        """The pids of this node's running processes whose name (``/proc/PID/comm``) is ``comm``."""
        return [info.pid for info in self.processes() if info.comm == comm]

    @property
    def raylet_pid(self) -> int:
        """The pid of the node's raylet."""
        (pid,) = self.pids_named("raylet")
        return pid

    @property
    def gcs_pid(self) -> int | None:
        """The pid of the GCS server, on the head node; None on another node."""
        pids = self.pids_named("gcs_server")
        return pids[0] if pids else None

    def memory(self) -> tuple[int, int]:
        """The summed RSS and PSS (bytes) of the node's processes right now."""
        pids = [info.pid for info in self.processes()]
        return sum(map(rss_bytes, pids)), sum(map(pss_bytes, pids))

    def stop(self) -> None:
        """Stop the node: SIGTERM to ``ray start``, then SIGKILL to whatever is left; assert nothing is."""
        _signal(self.launcher_pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not self.processes(), STOP_TIMEOUT, f"node {self.name} did not stop")
        for info in self.processes():
            _signal(info.pid, signal.SIGKILL)
        wait_until(lambda: not self.processes(), STOP_TIMEOUT, f"node {self.name} was not gone after SIGKILL")
        wait_until(lambda: process_is_gone(self.launcher_pid), STOP_TIMEOUT, "ray start did not exit")


@dataclass
class RayCluster:
    """A running Ray cluster of this module's making, this process connected to it as a driver."""

    directory: Path
    """The cluster's private directory: the token file, each node's directory and log."""
    head: RayNode
    second: RayNode
    environment: dict[str, str]
    """The environment every node gets on top of ours (auth mode, token file, no draining)."""
    started_in: float
    """Seconds from starting the head to both nodes alive and this process connected."""
    extra_nodes: list[RayNode] = field(default_factory=list)
    _serial: Iterator[int] = field(default_factory=lambda: itertools.count(1), repr=False)

    @property
    def address(self) -> str:
        """The GCS address (``host:port``) that ``ray.init(address=...)`` and ``ray start`` take."""
        return self.head.address

    @property
    def head_node_id(self) -> str:
        return self.head.node_id

    @property
    def second_node_id(self) -> str:
        return self.second.node_id

    @property
    def nodes(self) -> list[RayNode]:
        return [self.head, self.second, *self.extra_nodes]

    def processes(self) -> list[ProcessInfo]:
        """The running processes of every node of the cluster."""
        return sorted((info for node in self.nodes for info in node.processes()), key=lambda info: info.pid)

    def memory(self) -> tuple[int, int]:
        """The summed RSS and PSS (bytes) of all the cluster's processes right now."""
        rss, pss = zip(*(node.memory() for node in self.nodes), strict=True)
        return sum(rss), sum(pss)

    @contextlib.contextmanager
    def extra_node(self, name: str = "extra") -> Iterator[RayNode]:
        """A node of its own for one test (one that kills it, say), joined; stopped on exit, and nothing
        of it left. Its name is ``name`` and a serial number (``extra1``), its resource ``subagent_`` and
        that name."""
        ray = ray_or_skip()
        name = f"{name}{next(self._serial)}"
        node = _start_node(self.directory, self.environment, name, f"subagent_{name}", address=self.address)
        self.extra_nodes.append(node)
        try:
            _wait_joined(ray, [node])
            yield node
        finally:
            # Not waited for: the GCS's view of the node. Once its raylet was killed, the GCS marks it dead
            # only after missed health checks (seconds), and nothing here depends on it.
            self.extra_nodes.remove(node)
            node.stop()


def _start_node(
    root: Path, environment: Mapping[str, str], name: str, resource: str, *, address: str | None
) -> RayNode:
    """Start a node in ``root/name``: the head if ``address`` is None, else one joining ``address``."""
    directory = root / name
    directory.mkdir()
    node = RayNode(
        name=name, directory=directory, tag=f"{uuid.uuid4().hex}-{name}", resource=resource, launcher_pid=0
    )
    ray_program = Path(sys.executable).with_name("ray")
    argv = [
        str(ray_program) if ray_program.exists() else "ray",
        "start",
        "--block",
        "--disable-usage-stats",
        "--num-cpus=1",
        f"--resources={json.dumps({resource: 1})}",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
        f"--temp-dir={directory}",
        "--min-worker-port=0",
        "--max-worker-port=0",
        # The log monitor forwards workers' output to drivers; these tests connect with log_to_driver off.
        "--include-log-monitor=false",
    ]
    if address is None:
        argv += [
            "--head",
            "--port=0",
            "--include-dashboard=false",
            # The headless API server still wants a fixed port (8265 by default, so shared): one of ours.
            f"--dashboard-port={_free_port()}",
            # The autoscaler's monitor has nothing to scale here (hidden flag; saves a ~90 MB process).
            "--no-monitor",
        ]
    else:
        argv += [f"--address={address}"]
    environ = {key: value for key, value in os.environ.items() if key != LEAK_TAG_VARIABLE}
    environ.update(environment)
    environ[NODE_TAG_VARIABLE] = node.tag
    launcher = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, str(os.getpid()), str(node.log_file), *argv],
        env=environ,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        check=True,
        timeout=START_TIMEOUT,
    )
    node.launcher_pid = int(launcher.stdout)
    try:
        address_file = directory / "ray_current_cluster"

        def started() -> bool:
            if process_is_gone(node.launcher_pid):
                raise RuntimeError(f"ray start of node {name} exited: {node.log().strip()[-4000:]}")
            # Written once the node's processes are all up (the head's GCS address, for every node).
            address = address_file.read_text().strip() if address_file.exists() else ""
            host, _, port = address.rpartition(":")
            if host and port.isdigit():
                node.address = address
                return True
            return False

        wait_until(started, START_TIMEOUT, f"node {name} did not start")
    except BaseException:
        node.stop()
        raise
    return node


def _wait_joined(ray: ModuleType, nodes: list[RayNode]) -> None:
    """Wait until each of ``nodes`` is alive in ``ray.nodes()``; record its node id."""

    def joined() -> bool:
        alive = {
            resource: entry["NodeID"]
            for entry in ray.nodes()
            if entry["Alive"]
            for resource in entry["Resources"]
        }
        for node in nodes:
            node.node_id = alive.get(node.resource, "")
        return all(node.node_id for node in nodes)

    wait_until(joined, START_TIMEOUT, f"nodes {[node.name for node in nodes]} did not join")


def _cluster_directory() -> Path:
    directory = Path(tempfile.mkdtemp(prefix="sa-ray-"))
    if len(str(directory)) > _MAX_SOCKET_DIR:
        directory.rmdir()
        directory = Path(tempfile.mkdtemp(prefix="sa-ray-", dir="/tmp"))
    return directory


@contextlib.contextmanager
def _environment(changes: Mapping[str, str]) -> Iterator[None]:
    previous = {key: os.environ.get(key) for key in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def running_ray_cluster() -> Iterator[RayCluster]:
    """Start the two nodes, connect this process; on exit disconnect, stop them and remove their files."""
    ray = ray_or_skip()
    if ray.is_initialized():
        raise RuntimeError("this process is already connected to a Ray cluster: one driver per process")
    directory = _cluster_directory()
    token_file = directory / "auth_token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
    environment = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token_file),
        # SIGTERM stops a node at once; Ray's default waits up to 30 s for its work to drain.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    started: list[RayNode] = []
    try:
        with _environment(environment):
            begun = time.monotonic()
            head = _start_node(directory, environment, "head", HEAD_RESOURCE, address=None)
            started.append(head)
            second = _start_node(directory, environment, "second", SECOND_RESOURCE, address=head.address)
            started.append(second)
            # Ray read its configuration, auth mode included, when it was imported: read it again.
            ray._raylet.Config.initialize("")
            ray.init(address=head.address, log_to_driver=False, logging_level="WARNING")
            try:
                _wait_joined(ray, [head, second])
                yield RayCluster(directory, head, second, environment, time.monotonic() - begun)
            finally:
                ray.shutdown()
        ray._raylet.Config.initialize("")
    finally:
        for node in reversed(started):
            node.stop()
        shutil.rmtree(directory, ignore_errors=True)
    left = [info for node in started for info in node.processes()]
    assert not left, f"processes of the Ray cluster left behind: {left}"


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """A two-node Ray cluster for the session (see `running_ray_cluster`); this process is its driver."""
    with running_ray_cluster() as cluster:
        yield cluster
