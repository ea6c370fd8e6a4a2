"""Isolated workspaces over the SSH transport (issue 25): the workspace is made where the agent runs, by the
workspace core run on the remote host one operation per ``ssh`` (`SshTransport.isolation_runner`).

A real ``sshd`` on loopback (tests/sshd.py; it tells git there to read no machine configuration), so the
"remote" repository is under ``tmp_path`` like the parent's would be: the tests look at it directly. The
stub agent runs over ssh as a command and writes its file itself (``write_file`` with ``direct``: a remote
agent is served no ``fs/*``), to a path relative to its cwd, which must be the worktree. The runner's own
failure modes use a fake ``ssh`` (a script) where a real one cannot misbehave on demand. asyncio and trio.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import anyio
import pytest

from subagent import ErrorCode, SubagentError, SubagentRequest, SubagentService
from subagent._isolation_core import RECOVERED, host_id, process_start_time
from subagent.acp.transports import SshTransport, supervision_available
from subagent.acp.transports._ssh import ISOLATION_REPLY_BYTES, SshCoreRunner
from subagent.isolation import IsolationError, IsolationSettings, find_leftovers
from subagent.providers.acp import AcpProvider
from subagent.testing import LEAK_TAG_VARIABLE, dump_scenario, process_is_gone, stub_agent_argv
from subagent.types import FileChange, WorkspaceChange
from tests.gitrepo import ORIGINAL, assert_parent_untouched, git, make_repo, records_dir, worktrees
from tests.sshd import SshServer, assert_no_leaks_over_ssh, running_sshd
from tests.test_cli import CLI

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.subprocess,
    pytest.mark.skipif(not supervision_available(), reason="the supervisor needs Linux"),
]

WAIT: Final = 60  # seconds: a hang guard on a whole step, never a statement about speed
WRITTEN: Final = "written where the agent runs\n"


@pytest.fixture(scope="module")
def sshd() -> Iterator[SshServer]:
    with running_sshd() as server:
        yield server


@pytest.fixture(autouse=True)
def _no_machine_git_config(no_machine_git_config: None) -> None:
    """git here reads no configuration but the repository's (over ssh, the server's SetEnv does it)."""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """The repository on the "remote" host: one commit holding ``notes.txt`` (`ORIGINAL`)."""
    return make_repo(tmp_path / "repo")


def assert_nothing_left(repo: Path) -> None:
    assert worktrees(repo) == [str(repo)]
    assert list(records_dir(repo).iterdir()) == []


def transport_to(server: SshServer, **options: Any) -> SshTransport:
    return SshTransport(server.host, config_file=server.config_file, stdin_close_timeout=1.0, **options)


def agent_writing(tmp_path: Path, path: str) -> list[str]:
    """The stub agent, as a command run over ssh, writing `WRITTEN` to ``path`` (relative: to its cwd)."""
    scenario = tmp_path / "scenario.json"
    step = {"step": "write_file", "path": path, "content": WRITTEN, "direct": True}
    scenario.write_text(dump_scenario({"turns": [[step]]}))
    return stub_agent_argv(scenario)


@asynccontextmanager
async def service_with(provider: AcpProvider) -> AsyncIterator[SubagentService]:
    async with SubagentService() as service:
        service.register_provider(provider)
        yield service


# -- a child over ssh in a worktree made there -------------------------------------------------------------


@pytest.mark.both_backends
async def test_a_child_over_ssh_writes_in_a_worktree_made_there_on_its_branch_and_nothing_is_left(
    sshd: SshServer, repo: Path, tmp_path: Path
) -> None:
    head = git(repo, "rev-parse", "HEAD")
    async with assert_no_leaks_over_ssh(sshd) as tag:
        provider = AcpProvider(
            agent_writing(tmp_path, "afar.txt"),
            cwd=repo,
            env={LEAK_TAG_VARIABLE: tag},
            transport=transport_to(sshd),
        )
        assert provider.capabilities.isolation == frozenset({"worktree", "copy"})
        async with service_with(provider) as service:
            with anyio.fail_after(WAIT):
                async with service.start(
                    provider.name, SubagentRequest(prompt="write afar", isolation="worktree")
                ) as run:
                    result = await run.result()
                    worktree = records_dir(repo) / run.id
                    # While the run lives its worktree is there, and the file in it.
                    assert (worktree / "afar.txt").read_text() == WRITTEN
    branch = f"subagent/{run.id}"
    # The agent's cwd was the worktree: it resolved "afar.txt" there.
    assert json.loads(result.output) == {"path": f"{worktree}/afar.txt", "written": len(WRITTEN)}
    assert result.workspace == WorkspaceChange(
        mode="worktree",
        path=str(worktree),
        changed=True,
        files=(FileChange("afar.txt", 1, 0),),
        branch=branch,
        base=head,
        commit=git(repo, "rev-parse", branch),
    )
    assert git(repo, "show", f"{branch}:afar.txt") == WRITTEN.strip()
    assert git(repo, "log", "--format=%s", f"{head}..{branch}") == "write afar"
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)
    assert not worktree.exists()


async def test_a_copy_over_ssh_is_made_there_and_kept_with_the_childs_change(
    sshd: SshServer, tmp_path: Path
) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text(ORIGINAL)
    copies = tmp_path / "copies"
    provider = AcpProvider(
        agent_writing(tmp_path, "afar.txt"),
        cwd=plain,
        transport=transport_to(sshd),
        isolation=IsolationSettings(root=str(copies)),
    )
    async with assert_no_leaks_over_ssh(sshd), service_with(provider) as service:
        with anyio.fail_after(WAIT):
            async with service.start(provider.name, SubagentRequest(prompt="go", isolation="copy")) as run:
                result = await run.result()
    copy = copies / run.id
    assert result.workspace == WorkspaceChange(
        mode="copy", path=str(copy), changed=True, files=(FileChange("afar.txt", 1, 0),)
    )
    assert sorted(path.name for path in plain.iterdir()) == ["notes.txt"]
    assert (copy / "afar.txt").read_text() == WRITTEN
    assert [
        (found.run_id, found.state) for found in find_leftovers(None, IsolationSettings(str(copies)))
    ] == [(run.id, "kept")]


async def test_the_command_line_isolates_an_agent_over_ssh_in_a_worktree_made_there(
    sshd: SshServer, repo: Path, tmp_path: Path
) -> None:
    head = git(repo, "rev-parse", "HEAD")
    on = ["--on", f"ssh://{sshd.host}", "--ssh-config", str(sshd.config_file), "--cwd", str(repo)]
    argv = [*CLI, "run", "-p", "Write afar", *on, "--isolation", "worktree", "--"]
    async with assert_no_leaks_over_ssh(sshd) as tag:
        env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg"), LEAK_TAG_VARIABLE: tag}
        with anyio.fail_after(WAIT):
            done = await anyio.run_process(
                [*argv, *agent_writing(tmp_path, "afar.txt")], env=env, cwd=tmp_path, check=False
            )
    assert done.returncode == 0, done.stderr
    commit = git(repo, "rev-parse", "subagent/acp-1")
    worktree = records_dir(repo) / "acp-1"
    assert json.loads(done.stdout) == {"path": f"{worktree}/afar.txt", "written": len(WRITTEN)}
    assert done.stderr.decode() == (
        f"subagent: workspace: its changes are on branch subagent/acp-1 (commit {commit[:12]}, over "
        f"{head[:12]}): 1 file(s) changed: afar.txt (+1 -0)\n"
        "subagent: take them with `git merge subagent/acp-1`, or drop them with "
        "`git branch -D subagent/acp-1`\n"
    )
    assert git(repo, "show", "subagent/acp-1:afar.txt") == WRITTEN.strip()
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)


# -- ownership and what a dead owner left ------------------------------------------------------------------


async def test_the_remote_record_names_this_host_and_process_and_a_dead_owners_workspace_is_reaped_from_here(
    sshd: SshServer, repo: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    head = git(repo, "rev-parse", "HEAD")
    runner = transport_to(sshd).isolation_runner()
    # A parent of this host that died mid-run: its workspace, made over ssh, with a change in it.
    dead = await anyio.run_process([sys.executable, "-c", "import os; print(os.getpid())"])
    dead_owner = {"host": host_id(), "pid": int(dead.stdout), "start": "1"}
    settings = IsolationSettings().as_json()
    with anyio.fail_after(WAIT):
        left = await runner("open", str(repo), "left-1", "worktree", settings, "remove", dead_owner)
    await anyio.Path(left["cwd"], "left.txt").write_text("the dead parent's child wrote this\n")
    provider = AcpProvider(agent_writing(tmp_path, "afar.txt"), cwd=repo, transport=transport_to(sshd))
    caplog.set_level(logging.WARNING, logger="subagent.isolation")
    async with assert_no_leaks_over_ssh(sshd), service_with(provider) as service:
        with anyio.fail_after(WAIT):
            async with service.start(
                provider.name, SubagentRequest(prompt="go", isolation="worktree")
            ) as run:
                await run.result()
                record = json.loads((records_dir(repo) / f"{run.id}.json").read_text())
    assert (record["host"], record["pid"], record["start"], record["state"]) == (
        host_id(),
        os.getpid(),
        process_start_time(os.getpid()),
        "ready",
    )
    # The dead owner's work was committed on its branch, its worktree removed, its record gone.
    assert git(repo, "show", "subagent/left-1:left.txt") == "the dead parent's child wrote this"
    assert not await anyio.Path(left["path"]).exists()
    assert_nothing_left(repo)
    assert_parent_untouched(repo, head)
    recovered = [r.getMessage() for r in caplog.records if r.getMessage().startswith(RECOVERED)]
    assert recovered == [
        f"{RECOVERED} left-1 (made from this host, whose owner pid {dead_owner['pid']} is gone), where its "
        "agent ran: branch"
    ]


# -- refusals and failures, before any agent ---------------------------------------------------------------


async def test_a_remote_directory_outside_git_fails_the_start_with_the_cores_reason_and_spawns_nothing(
    sshd: SshServer, tmp_path: Path
) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    marker = tmp_path / "spawned"
    argv = ["touch", str(marker)]
    provider = AcpProvider(argv, cwd=plain, transport=transport_to(sshd))
    request = SubagentRequest(prompt="go", isolation="worktree")
    async with (
        assert_no_leaks_over_ssh(sshd),
        service_with(provider) as service,
        service.start(provider.name, request) as run,
    ):
        with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
            await run.started()
    assert caught.value.code is ErrorCode.START_FAILED
    assert caught.value.message == (
        f"agent `touch {marker}` was not started: {plain} is not in a git repository, so it has no "
        "worktree to give a child: use isolation='copy'"
    )
    assert not marker.exists()
    assert list(plain.iterdir()) == []


async def test_an_unreachable_host_fails_an_isolated_start_at_once_saying_ssh_failed(
    sshd: SshServer, repo: Path, tmp_path: Path
) -> None:
    port = free_port()
    marker = tmp_path / "spawned"
    transport = SshTransport("127.0.0.1", port=port, config_file=sshd.config_file)
    provider = AcpProvider(["touch", str(marker)], cwd=repo, transport=transport)
    request = SubagentRequest(prompt="go", isolation="worktree")
    async with service_with(provider) as service, service.start(provider.name, request) as run:
        with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
            await run.started()
    assert caught.value.code is ErrorCode.START_FAILED
    assert caught.value.message == (
        f"agent `touch {marker}` was not started: ssh to 127.0.0.1 failed: ssh: connect to host 127.0.0.1 "
        f"port {port}: Connection refused"
    )
    assert not marker.exists()
    assert not records_dir(repo).exists()


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# -- the runner ----------------------------------------------------------------------------------------------


def test_the_runner_is_keyed_by_the_host_as_reached() -> None:
    plain = SshTransport("build-1", user="me", port=2222)
    assert plain.isolation_runner().key == "ssh://me@build-1:2222"
    assert plain.isolation_runner().key == plain.isolation_runner().key
    configured = SshTransport("build-1", config_file="/etc/cfg", ssh_options=["-i", "/k/id"])
    assert configured.isolation_runner().key == "ssh://build-1 -F /etc/cfg -i /k/id"


async def test_the_runner_answers_an_operation_from_the_remote_host(sshd: SshServer) -> None:
    with anyio.fail_after(WAIT):
        assert await transport_to(sshd).isolation_runner()("host") == host_id()


async def test_a_core_that_fails_there_is_an_isolation_error_quoting_its_last_stderr(sshd: SshServer) -> None:
    runner = transport_to(sshd).isolation_runner()
    with anyio.fail_after(WAIT), pytest.raises(IsolationError) as caught:
        await runner("no-such-operation")
    message = caught.value.args[0]
    # Its traceback's last lines (how a traceback looks depends on the remote Python's version).
    assert message.startswith(
        f"the workspace core on {sshd.host} gave no reply to 'no-such-operation' (exit status 1): "
    )
    assert message.endswith(" | KeyError: 'no-such-operation'")


FAKE_SSH: Final = """\
import os, subprocess, sys
log, behaviour = sys.argv[1], sys.argv[2]
with open(log, "w") as out:
    out.write(repr(sys.argv[3:]))
if behaviour == "hang":
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(log + ".pid", "w") as out:
        out.write(str(grandchild.pid))
    sys.stderr.write("hanging\\n")
    sys.stderr.flush()
    grandchild.wait()
elif behaviour == "flood":
    chunk = b"x" * 65536
    while True:
        os.write(1, chunk)
else:  # as the remote host would: the login shell prints first, then runs the remote command
    os.write(1, b"a login banner on stdout\\n")
    os.execvp("sh", ["sh", "-c", sys.argv[-1]])
"""


def fake_ssh(tmp_path: Path, behaviour: str) -> tuple[str, Path]:
    """An executable playing ssh (``behaviour``: ``hang``, ``flood``, or run the command here), and the file
    it writes its argv to."""
    script = tmp_path / "fake_ssh.py"
    script.write_text(FAKE_SSH)
    program = tmp_path / f"ssh-{behaviour}"
    log = tmp_path / f"ssh-{behaviour}.argv"
    program.write_text(f'#!/bin/sh\nexec {sys.executable} {script} {log} {behaviour} "$@"\n')
    program.chmod(0o755)
    return str(program), log


async def test_the_request_travels_on_stdin_and_what_the_login_prints_first_is_dropped(
    repo: Path, tmp_path: Path
) -> None:
    program, log = fake_ssh(tmp_path, "run")
    transport = SshTransport("build-1", ssh=program)
    with anyio.fail_after(WAIT):
        found = await transport.isolation_runner()("records_for", str(repo), "worktree", {"root": None})
    assert found == {"directory": str(records_dir(repo)), "records": []}
    # The command line is the transport's constant one: no path, operation or argument of the request.
    assert log.read_text() == repr(transport.ssh_argv()[1:])
    assert str(repo) not in log.read_text()


@pytest.mark.both_backends
async def test_a_hung_ssh_is_killed_with_its_process_group_once_the_call_is_overdue(tmp_path: Path) -> None:
    program, log = fake_ssh(tmp_path, "hang")
    runner = SshTransport("build-1", ssh=program, isolation_timeout=1.0).isolation_runner()
    with anyio.fail_after(WAIT), pytest.raises(IsolationError) as caught:
        await runner("host")
    assert caught.value.args[0] == (
        "the workspace core on build-1 did not answer 'host' within 1s: ssh was killed (last stderr: hanging)"
    )
    grandchild = int(await anyio.Path(f"{log}.pid").read_text())
    with anyio.fail_after(WAIT):  # SIGKILLed with ssh's group: it ends at once
        while True:
            if process_is_gone(grandchild):
                break
            await anyio.sleep(0.01)  # a poll interval: the wait is bounded above


async def test_a_reply_over_the_limit_is_refused_and_its_ssh_killed(tmp_path: Path) -> None:
    program, _log = fake_ssh(tmp_path, "flood")
    runner = SshTransport("build-1", ssh=program).isolation_runner()
    assert isinstance(runner, SshCoreRunner)
    with anyio.fail_after(WAIT), pytest.raises(IsolationError) as caught:
        await runner("host")
    limit = f"{ISOLATION_REPLY_BYTES:,}"
    assert caught.value.args[0] == (
        f"the workspace core on build-1 replied to 'host' with more than {limit} bytes: refused"
    )


async def test_an_ssh_that_cannot_be_run_is_an_isolation_error(tmp_path: Path) -> None:
    runner = SshTransport("build-1", ssh=str(tmp_path / "no-ssh")).isolation_runner()
    with anyio.fail_after(WAIT), pytest.raises(IsolationError) as caught:
        await runner("host")
    assert caught.value.args[0] == "cannot run ssh: No such file or directory"
