"""Isolated workspaces over Ray (issue 25): the worktree made on the node where the agent runs.

`RayTransport.isolation_runner` runs the workspace core on a node as Ray tasks; the first operation of a
run decides the node, the workspace carries it, and `RayTransport.for_workspace` pins the agent's actor
there. The cluster is the session's two nodes on this machine (tests/raycluster.py), so a test reads the
repository directly. git on the nodes reads no configuration of the machine's: the transport's
``runtime_env`` hands the workers the same variables as this process (`git_env`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import anyio
import pytest

from subagent import ErrorCode, SubagentError, SubagentRequest, SubagentService
from subagent._isolation_core import host_id
from subagent.acp.transports import RayChannel, RayTransport, supervision_available
from subagent.acp.transports._ray import RayIsolationRunner
from subagent.isolation import IsolationError, Workspace, find_leftovers, open_workspace
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.testing.pytest_plugin import StubAgentCommand
from subagent.types import FileChange, WorkspaceChange
from tests.gitrepo import assert_parent_untouched, git, make_repo, records_dir
from tests.raycluster import RayCluster, assert_no_leaks_over_ray, ray_or_skip
from tests.test_ray_transport import LeakTaggedRayTransport
from tests.test_ssh_transport import wait_gone

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.subprocess,
    pytest.mark.skipif(not supervision_available(), reason="the supervisor needs Linux"),
]

WAIT: Final = 60  # seconds: a hang guard on a whole test step, never a statement about speed
SHORT_TIMEOUT: Final = 3.0  # seconds: an isolation_timeout that a hanging git runs past


@pytest.fixture
def git_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """git reads no configuration but the repository's, here and on the nodes, and finds no repository
    above ``tmp_path``."""
    empty = tmp_path / "gitconfig"
    empty.write_text("")
    env = {
        "GIT_CONFIG_GLOBAL": str(empty),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CEILING_DIRECTORIES": str(tmp_path),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def repo(tmp_path: Path, git_env: dict[str, str]) -> Path:
    """A repository with one commit holding ``notes.txt`` (`ORIGINAL`)."""
    return make_repo(tmp_path / "repo")


def assert_nothing_left(repo: Path) -> None:
    """No worktree but the main one, no workspace directory, no record."""
    listing = git(repo, "worktree", "list", "--porcelain").splitlines()
    assert [line.removeprefix("worktree ") for line in listing if line.startswith("worktree ")] == [str(repo)]
    assert list(records_dir(repo).iterdir()) == []
    assert find_leftovers(str(repo)) == []


class RecordingRayTransport(LeakTaggedRayTransport):
    """Records, for every agent it (or a transport `for_workspace` made of it) opens: its cwd, the node
    the transport was pinned to, and the node its actor ran on."""

    launched: list[tuple[str | None, str | None, str | None]]

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.launched = []  # shared with the pinned copies `for_workspace` makes

    @contextlib.asynccontextmanager
    async def open(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        on_stderr_line: Callable[[str], object] | None = None,
    ) -> AsyncIterator[RayChannel]:
        async with super().open(argv, env=env, cwd=cwd, on_stderr_line=on_stderr_line) as channel:
            self.launched.append((cwd, self.node_id, channel.node_id))
            yield channel


def scenario(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"turns": [list(steps)]}


def write(path: str, content: str = "{prompt}\n") -> dict[str, Any]:
    return {"step": "write_file", "path": path, "content": content}


def reported(output: str) -> list[dict[str, Any]]:
    """The stub's reports of its requests' outcomes: JSON objects, one after the other, in its message."""
    decoder, answers = json.JSONDecoder(), []
    while output:
        answer, end = decoder.raw_decode(output)
        answers.append(answer)
        output = output[end:]
    return answers


# -- a run ---------------------------------------------------------------------------------------------------


@pytest.mark.both_backends  # the runner's tasks awaited through Ray's futures, its submission in a thread
async def test_an_isolated_run_over_ray_works_in_a_worktree_made_on_the_node_its_agent_runs_on(
    ray_cluster: RayCluster, repo: Path, git_env: dict[str, str], stub_agent_command: StubAgentCommand
) -> None:
    head = git(repo, "rev-parse", "HEAD")
    argv = stub_agent_command(
        scenario(
            write("made-on-the-node.txt", "written by the agent through its node\n"),
            {**write(str(repo / "notes.txt"), "into the parent's checkout\n"), "report": True},
        )
    )
    # SPREAD places each actor and task on another node in turn: only the pin puts the agent where its
    # workspace was made. The agent's files are served on its node, inside fs_roots (the repository).
    transport = RecordingRayTransport(
        actor_options={"scheduling_strategy": "SPREAD"},
        runtime_env={"env_vars": git_env},
        fs_roots=[repo],
        stdin_close_timeout=1.0,
    )
    provider = AcpProvider(argv, cwd=repo, permission="allow", transport=transport)
    assert provider.capabilities.isolation == frozenset({"worktree", "copy"})
    async with assert_no_leaks_over_ray(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go", isolation="worktree")) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
            assert isinstance(run.provider_run, AcpRun)
            workspace = run.provider_run.workspace
            assert workspace is not None
            made_on = workspace.data["node"]
            worktree = str(records_dir(repo) / run.id)
            # Before dispose: the worktree is there, on its branch.
            assert git(Path(worktree), "rev-parse", "--abbrev-ref", "HEAD") == f"subagent/{run.id}"
    assert made_on in (ray_cluster.head_node_id, ray_cluster.second_node_id)
    assert transport.launched == [(worktree, made_on, made_on)]
    assert workspace.cwd == worktree
    written, refused = reported(result.output)
    assert written == {"method": "fs/write_text_file", "result": {}}
    assert (refused["method"], refused["error"]["code"]) == ("fs/write_text_file", -32602)
    assert result.workspace is not None
    assert result.workspace == WorkspaceChange(
        mode="worktree",
        path=worktree,
        changed=True,
        files=(FileChange("made-on-the-node.txt", 1, 0),),
        branch=f"subagent/{run.id}",
        base=head,
        commit=result.workspace.commit,
    )
    assert result.workspace.commit == git(repo, "rev-parse", f"subagent/{run.id}")
    assert (
        git(repo, "show", f"subagent/{run.id}:made-on-the-node.txt")
        == "written by the agent through its node"
    )
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)


async def test_a_worktree_outside_a_git_repository_over_ray_fails_the_start_with_the_cores_message_no_actor(
    ray_cluster: RayCluster, tmp_path: Path, git_env: dict[str, str], stub_agent_command: StubAgentCommand
) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    transport = RecordingRayTransport(node_id=ray_cluster.second_node_id, runtime_env={"env_vars": git_env})
    provider = AcpProvider(stub_agent_command(scenario(write("x.txt"))), cwd=plain, transport=transport)
    async with assert_no_leaks_over_ray(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go", isolation="worktree")) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
    assert caught.value.code == ErrorCode.START_FAILED
    assert str(caught.value) == (
        f"agent `{shlex.join(provider.command)}` was not started: "
        f"{plain} is not in a git repository, so it has no worktree to give a child: use isolation='copy'"
    )
    assert transport.launched == []
    assert list(plain.iterdir()) == []


# -- the runner ----------------------------------------------------------------------------------------------


async def test_a_workspace_whose_node_is_gone_fails_its_next_operation_with_an_isolation_error_naming_it(
    ray_cluster: RayCluster, repo: Path, git_env: dict[str, str]
) -> None:
    head = git(repo, "rev-parse", "HEAD")
    with ray_cluster.extra_node("workspace") as node:
        runner = RayTransport(node_id=node.node_id, runtime_env={"env_vars": git_env}).isolation_runner()
        with anyio.fail_after(WAIT):
            workspace = await open_workspace(str(repo), "afar-1", "worktree", runner=runner)
        assert (workspace.data["node"], runner.node_id, runner.key) == (
            node.node_id,
            node.node_id,
            ("ray://auto", node.node_id),
        )
    with anyio.fail_after(WAIT), pytest.raises(IsolationError) as caught:
        await workspace.commit("after its node stopped")
    # Ray has marked the node dead once its processes are gone, which stop() waited for; were it not
    # known yet, the task would be refused by Ray itself.
    assert re.fullmatch(
        rf"the workspace's commit on ray node {node.node_id[:8]} failed: "
        rf"(ray node {node.node_id} is not a live node of the cluster|it cannot be placed: The task is not "
        r"schedulable: The node specified via NodeAffinitySchedulingStrategy doesn't exist any more .*)",
        str(caught.value),
    ), str(caught.value)
    # The node was this machine: close it from here.
    await Workspace(workspace.data).close()
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)


HANGING_GIT: Final = """#!/bin/sh
echo "$$ $PPID" > "$SUBAGENT_TEST_FIFO"
exec sleep 60
"""
"""A ``git`` that tells its pid and its parent's (the Ray worker running the core) and hangs."""


@contextlib.asynccontextmanager
async def hanging_git(
    tmp_path: Path, git_env: Mapping[str, str]
) -> AsyncIterator[tuple[dict[str, str], Callable[[], Coroutine[Any, Any, tuple[int, int]]]]]:
    """The environment of a node's worker whose ``git`` is `HANGING_GIT`, and an awaitable function that
    returns (git's pid, its worker's) once it runs; on exit, the hanging git is killed if it runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "git").write_text(HANGING_GIT)
    (bin_dir / "git").chmod(0o755)
    fifo = tmp_path / "told"
    os.mkfifo(fifo)
    env = {**git_env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SUBAGENT_TEST_FIFO": str(fifo)}
    told: list[int] = []

    async def git_runs() -> tuple[int, int]:
        # Returns once git has written its line (opening a FIFO waits for its writer).
        line = await anyio.to_thread.run_sync(fifo.read_text, abandon_on_cancel=True)
        git_pid, worker_pid = (int(pid) for pid in line.split())
        told.append(git_pid)
        return git_pid, worker_pid

    try:
        yield env, git_runs
    finally:
        for pid in told:  # in a session of its own: neither its worker's death nor a cancel ends it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert await wait_gone(told) == []
        with contextlib.suppress(OSError):  # a reader still waiting for a writer reads nothing, and ends
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


async def test_a_workspace_operation_whose_worker_dies_fails_with_an_isolation_error_saying_so(
    ray_cluster: RayCluster, repo: Path, git_env: dict[str, str], tmp_path: Path
) -> None:
    async with hanging_git(tmp_path, git_env) as (env, git_runs):
        transport = RayTransport(node_id=ray_cluster.second_node_id, runtime_env={"env_vars": env})
        runner = transport.isolation_runner()

        async def kill_the_worker_once_git_runs() -> None:
            _git_pid, worker_pid = await git_runs()
            os.kill(worker_pid, signal.SIGKILL)

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                group.start_soon(kill_the_worker_once_git_runs)
                with pytest.raises(IsolationError) as caught:
                    await runner("records_for", str(repo), "worktree", {})
    assert str(caught.value) == (
        f"the workspace's records_for on ray node {ray_cluster.second_node_id[:8]} failed: "
        "its worker process died"
    )
    assert not records_dir(repo).exists()


async def test_a_workspace_operation_past_its_timeout_fails_saying_so_while_its_git_hangs(
    ray_cluster: RayCluster, repo: Path, git_env: dict[str, str], tmp_path: Path
) -> None:
    async with hanging_git(tmp_path, git_env) as (env, git_runs):
        transport = RayTransport(node_id=ray_cluster.second_node_id, runtime_env={"env_vars": env})
        runner = transport.isolation_runner()
        with anyio.fail_after(WAIT):
            assert await runner("host") == host_id()  # a worker of this runtime_env is started, and warm
        transport.isolation_timeout = SHORT_TIMEOUT
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                group.start_soon(git_runs)
                with pytest.raises(IsolationError) as caught:
                    await runner("records_for", str(repo), "worktree", {})
    assert str(caught.value) == (
        f"the workspace's records_for on ray node {ray_cluster.second_node_id[:8]} "
        f"did not finish within {SHORT_TIMEOUT:g}s"
    )


@pytest.mark.usefixtures("ray_installed")
def test_for_workspace_pins_the_agent_to_the_workspaces_node_in_place_of_the_options_that_chose_it() -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    transport = RayTransport(
        resources={"repo-x": 1},
        actor_options={"scheduling_strategy": "SPREAD", "memory": 1024, "label_selector": {"zone": "a"}},
        fs_roots=["/srv/repo"],
    )
    node = "ab" * 28
    runner = transport.isolation_runner()
    assert isinstance(runner, RayIsolationRunner)
    # Reaping from here is keyed by the node, when it is known before the first operation.
    assert (runner.node_id, runner.key) == (None, ("ray://auto", None))
    assert RayTransport(node_id=node).isolation_runner().key == ("ray://auto", node)
    assert transport.for_workspace({"mode": "worktree"}) is transport  # made here: no node
    pinned = transport.for_workspace({"node": node, "source": "/srv/repo", "root": "/srv/repo/.git/w/1"})
    assert (pinned.node_id, pinned.resources, pinned.actor_options) == (node, {"repo-x": 1}, {"memory": 1024})
    assert (transport.node_id, transport.actor_options["scheduling_strategy"]) == (None, "SPREAD")
    strategy = pinned._actor_options()["scheduling_strategy"]
    assert isinstance(strategy, NodeAffinitySchedulingStrategy)
    assert (strategy.node_id, strategy.soft) == (node, False)
    files = pinned._process_options()["files"]
    assert files == {
        "fs_roots": ("/srv/repo",),
        "terminals": False,
        "workspace": ("/srv/repo", "/srv/repo/.git/w/1"),
    }


@pytest.fixture
def ray_installed() -> None:
    ray_or_skip()
