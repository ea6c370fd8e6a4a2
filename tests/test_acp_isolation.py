"""Isolated ACP children (issue 25): each stub agent in its own git worktree of the parent's repository (or a
copy of a plain directory), its writes through the client committed on its own branch, the parent's working
tree untouched, nothing left behind, even when the parent is SIGKILLed mid-run.

The stub agent runs as a real child process (`stub_agent_argv`) where the process is the point (twenty at
once, the SIGKILL of their parent) and in process (`StubAgentTransport`) elsewhere; it writes through
``fs/write_text_file`` to a path relative to its session's cwd, which is the worktree. Every repository is a
fresh one under ``tmp_path``, and git reads no configuration of the machine's (``GIT_CONFIG_GLOBAL`` and
``GIT_CONFIG_NOSYSTEM``): the workspace layer commits under its own identity.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Final

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

import subagent.providers.acp as acp_module
from subagent import ErrorCode, SubagentError, SubagentRequest, SubagentResult, SubagentService
from subagent._isolation_core import host_id
from subagent.isolation import (
    IsolationError,
    IsolationSettings,
    Leftover,
    Workspace,
    find_leftovers,
    open_workspace,
    reap_leftovers,
)
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.testing import StubAgentTransport, dump_scenario, stub_agent_argv
from subagent.types import FileChange, WorkspaceChange
from tests.gitrepo import ORIGINAL, assert_parent_untouched, branches, git, make_repo, records_dir, worktrees
from tests.leaks import assert_no_leaks
from tests.test_supervisor import survivors_after_polling

# The cases run on both backends (marked); the rest on asyncio.
pytestmark = [pytest.mark.anyio]

WAIT: Final = 60  # seconds: a hang guard on a whole test step, never a sleep
FAST: Final = {"stdin_close_timeout": 1.0, "sigterm_timeout": 1.0, "sigkill_timeout": 2.0}
PROCS: Final = Path(__file__).resolve().parent.parent / "fixtures" / "procs"
CHILDREN: Final = 20
GONE_AFTER_PARENT_DEATH: Final = 30  # the supervisor notices within 0.25 s, SIGTERMs, then SIGKILLs


@pytest.fixture(autouse=True)
def _no_machine_git_config(no_machine_git_config: None) -> None:
    """Every test here: git reads no configuration but the repository's."""


# -- repositories ----------------------------------------------------------------------------------------


@pytest.fixture
def repo(tmp_path: Path, no_machine_git_config: None) -> Path:
    """A repository with one commit holding ``notes.txt`` (`ORIGINAL`)."""
    return make_repo(tmp_path / "repo")


def assert_nothing_left(repo: Path) -> None:
    """No worktree but the main one, no workspace directory, no record."""
    assert worktrees(repo) == [str(repo)]
    assert list(records_dir(repo).iterdir()) == []
    assert find_leftovers(str(repo)) == []


def assert_nothing_left_anywhere(repo: Path) -> None:
    """Nothing was ever made: no worktree but the main one, no branch but main, no records directory."""
    assert worktrees(repo) == [str(repo)]
    assert branches(repo) == ["main"]
    assert not records_dir(repo).exists()


# -- children --------------------------------------------------------------------------------------------


def turn(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"turns": [list(steps)]}


def write(path: str, content: str = "{prompt}\n") -> dict[str, Any]:
    return {"step": "write_file", "path": path, "content": content}


@pytest.fixture
def process_provider(tmp_path: Path) -> Callable[..., AcpProvider]:
    """A provider whose children are the stub agent as real processes, on a scenario."""
    counter = iter(range(1000))

    def make(scenario: dict[str, Any], cwd: Path, **options: Any) -> AcpProvider:
        path = tmp_path / f"scenario-{next(counter)}.json"
        path.write_text(dump_scenario(scenario))
        return AcpProvider(
            stub_agent_argv(path), cwd=cwd, permission="allow", process_options=FAST, **options
        )

    return make


def in_process_provider(scenario: dict[str, Any], cwd: Path, **options: Any) -> AcpProvider:
    """A provider whose children are the stub agent served in this process (``transport.opened`` lists
    the agents it started)."""
    transport = StubAgentTransport(scenario, stdin_close_timeout=1.0, sigterm_timeout=1.0)
    return AcpProvider(["stub-agent"], cwd=cwd, permission="allow", transport=transport, **options)


def opened(provider: AcpProvider) -> int:
    """How many agents an in-process provider has started."""
    transport = provider.transport
    assert isinstance(transport, StubAgentTransport)
    return len(transport.opened)


@contextlib.asynccontextmanager
async def service_with(provider: AcpProvider) -> AsyncIterator[SubagentService]:
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        yield service


async def run_once(provider: AcpProvider, prompt: str = "go", **request: Any) -> tuple[SubagentResult, str]:
    """One isolated run, disposed before this returns: its result and its id."""
    request.setdefault("isolation", "worktree")
    async with (
        service_with(provider) as service,
        service.start(provider.name, SubagentRequest(prompt=prompt, **request)) as run,
    ):
        with anyio.fail_after(WAIT):
            result = await run.result()
    return result, run.id


def reported(result: SubagentResult) -> list[dict[str, Any]]:
    """The client's answers to the stub's requests, as its reports (JSON objects, one after the other, in
    the turn's message) give them."""
    decoder, text, answers = json.JSONDecoder(), result.output, []
    while text:
        answer, end = decoder.raw_decode(text)
        answers.append(answer)
        text = text[end:]
    return answers


# -- many children, one file -----------------------------------------------------------------------------


@pytest.mark.both_backends
async def test_twenty_children_writing_the_same_file_each_leave_their_content_on_their_own_branch(
    repo: Path, process_provider: Callable[..., AcpProvider], capsys: pytest.CaptureFixture[str]
) -> None:
    head = git(repo, "rev-parse", "HEAD")
    provider = process_provider(turn(write("notes.txt")), repo, max_concurrent=None)
    began = time.monotonic()
    async with service_with(provider) as service, contextlib.AsyncExitStack() as runs:
        handles = [
            await runs.enter_async_context(
                service.start(
                    provider.name, SubagentRequest(prompt=f"notes of child {i}", isolation="worktree")
                )
            )
            for i in range(CHILDREN)
        ]
        with anyio.fail_after(WAIT):
            results = [await handle.result() for handle in handles]
        # While they live (kept for resume), each has its own worktree.
        assert len(worktrees(repo)) == CHILDREN + 1
    elapsed = time.monotonic() - began
    with capsys.disabled():
        sys.stdout.write(f"\n{CHILDREN} isolated stub children, start to all disposed: {elapsed:.2f} s\n")

    for i, (handle, result) in enumerate(zip(handles, results, strict=True)):
        assert (result.stop_reason, result.error) == ("completed", None)
        change = result.workspace
        assert change is not None
        branch = f"subagent/{handle.id}"
        assert change == WorkspaceChange(
            mode="worktree",
            path=str(records_dir(repo) / handle.id),
            changed=True,
            files=(FileChange("notes.txt", 1, 1),),
            branch=branch,
            base=head,
            commit=git(repo, "rev-parse", branch),
        )
        assert git(repo, "show", f"{branch}:notes.txt") == f"notes of child {i}"
        assert git(repo, "rev-parse", f"{branch}^") == head
    assert len({result.workspace.branch for result in results if result.workspace}) == CHILDREN
    assert sorted(branches(repo)) == sorted(["main", *(f"subagent/{handle.id}" for handle in handles)])
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)


@pytest.mark.both_backends
async def test_a_child_that_writes_nothing_leaves_no_branch_no_worktree_and_no_record(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    provider = in_process_provider(turn({"step": "message", "text": "nothing to do"}), repo)
    result, run_id = await run_once(provider)
    assert (result.stop_reason, result.output) == ("completed", "nothing to do")
    assert result.workspace == WorkspaceChange(
        mode="worktree",
        path=str(records_dir(repo) / run_id),
        changed=False,
        branch=f"subagent/{run_id}",
        base=head,
    )
    assert branches(repo) == ["main"]
    assert not (records_dir(repo) / run_id).exists()
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)


async def test_cleanup_keep_keeps_the_childs_worktree_and_branch_for_the_parent(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    provider = in_process_provider(turn(write("notes.txt")), repo)
    result, run_id = await run_once(provider, "kept notes", cleanup="keep")
    path = records_dir(repo) / run_id
    assert result.workspace is not None
    assert (result.workspace.changed, result.workspace.path) == (True, str(path))
    assert worktrees(repo) == [str(repo), str(path)]
    assert (path / "notes.txt").read_text() == "kept notes\n"
    assert git(path, "status", "--porcelain") == ""  # committed, and still there
    assert branches(repo) == ["main", f"subagent/{run_id}"]
    (kept,) = find_leftovers(str(repo))
    assert (kept.run_id, kept.state, kept.path, kept.branch) == (
        run_id,
        "kept",
        str(path),
        f"subagent/{run_id}",
    )
    assert_parent_untouched(repo, head)


async def test_cleanup_remove_always_removes_the_branch_of_a_child_that_changed_a_file(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    provider = in_process_provider(turn(write("notes.txt")), repo)
    result, run_id = await run_once(provider, "dropped notes", cleanup="remove-always")
    assert result.workspace is not None
    assert (result.workspace.changed, result.workspace.branch) == (True, f"subagent/{run_id}")
    assert branches(repo) == ["main"]
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)


# -- the sandbox -----------------------------------------------------------------------------------------


async def test_a_child_writing_into_the_parents_checkout_or_out_of_its_worktree_is_refused(
    repo: Path,
) -> None:
    head = git(repo, "rev-parse", "HEAD")
    parents_file = str(repo / "notes.txt")
    scenario = turn(
        write(parents_file, "overwritten by the child\n"),
        # From .git/subagent-worktrees/<run id>: up three levels is the parent's checkout.
        write("../../../notes.txt", "overwritten through ..\n"),
        write("../beside.txt", "beside the worktree\n"),
    )
    provider = in_process_provider(scenario, repo)
    result, run_id = await run_once(provider)
    worktree = records_dir(repo) / run_id
    refusals = [
        (answer["method"], answer["error"]["code"], answer["error"]["data"]) for answer in reported(result)
    ]
    reason = "the path is outside the directories this agent may access"
    assert refusals == [
        ("fs/write_text_file", -32602, {"path": parents_file, "reason": reason}),
        ("fs/write_text_file", -32602, {"path": f"{worktree}/../../../notes.txt", "reason": reason}),
        ("fs/write_text_file", -32602, {"path": f"{worktree}/../beside.txt", "reason": reason}),
    ]
    assert result.workspace is not None
    assert result.workspace.changed is False
    assert not (records_dir(repo) / "beside.txt").exists()
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)


async def test_a_subdirectory_cwd_and_an_additional_directory_are_moved_into_the_worktree(repo: Path) -> None:
    (repo / "src").mkdir()
    (repo / "src" / "main.txt").write_text("main\n")
    (repo / "docs").mkdir()
    (repo / "docs" / "guide.txt").write_text("guide\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "layout")
    head = git(repo, "rev-parse", "HEAD")
    scenario = {
        **turn(write("main.txt", "main, edited\n"), write("../docs/guide.txt", "guide, edited\n")),
        "initialize": {"agentCapabilities": {"sessionCapabilities": {"additionalDirectories": {}}}},
    }
    provider = in_process_provider(scenario, repo)
    seen: list[Any] = []

    async with (
        service_with(provider) as service,
        service.start(
            provider.name,
            SubagentRequest(
                prompt="go", cwd=str(repo / "src"), additional_directories=["../docs"], isolation="worktree"
            ),
        ) as run,
    ):
        with anyio.fail_after(WAIT):
            result = await run.result()
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        assert acp_run.workspace is not None
        seen = [acp_run.workspace.cwd, acp_run._additional_directories]
    worktree = records_dir(repo) / run.id
    assert seen == [str(worktree / "src"), [str(worktree / "docs")]]
    assert [answer.get("result") for answer in reported(result)] == [{}, {}]  # both written
    assert result.workspace is not None
    assert result.workspace.files == (FileChange("docs/guide.txt", 1, 1), FileChange("src/main.txt", 1, 1))
    branch = f"subagent/{run.id}"
    assert git(repo, "show", f"{branch}:src/main.txt") == "main, edited"
    assert git(repo, "show", f"{branch}:docs/guide.txt") == "guide, edited"
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)


# -- refusals and failed starts --------------------------------------------------------------------------


@pytest.mark.both_backends
async def test_a_provider_whose_agents_do_not_see_our_files_refuses_isolation_before_any_agent_starts(
    repo: Path,
) -> None:
    transport = StubAgentTransport(turn(write("notes.txt")), local_files=False)
    provider = AcpProvider(["stub-agent"], cwd=repo, transport=transport)
    assert provider.capabilities.isolation == frozenset()
    for mode in ("worktree", "copy"):
        async with service_with(provider) as service:
            with pytest.raises(SubagentError) as caught:
                service.start(provider.name, SubagentRequest(prompt="go", isolation=mode))
        assert (caught.value.code, caught.value.feature) == (ErrorCode.UNSUPPORTED_CAPABILITY, "isolation")
        assert str(caught.value) == "provider 'acp' does not support 'isolation'"
        # Used without a service, the provider refuses it itself.
        async with anyio.create_task_group() as group:
            with pytest.raises(SubagentError) as direct:
                provider.start(SubagentRequest(prompt="go", isolation=mode), group)
        assert (direct.value.code, direct.value.feature) == (ErrorCode.UNSUPPORTED_CAPABILITY, "isolation")
        assert str(direct.value) == (
            f"provider 'acp' cannot give a child isolation={mode!r}: "
            "its transport (stub-agent) runs the agent where this host's files are not, and makes no "
            "workspace there"
        )
    assert transport.opened == []
    assert_nothing_left_anywhere(repo)


async def test_a_worktree_outside_a_git_repository_fails_the_start_saying_to_use_copy_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # whatever holds tmp_path is no repository
    provider = in_process_provider(turn(write("notes.txt")), plain)
    async with (
        service_with(provider) as service,
        service.start(provider.name, SubagentRequest(prompt="go", isolation="worktree")) as run,
    ):
        with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
            await run.started()
    assert caught.value.code == ErrorCode.START_FAILED
    assert str(caught.value) == (
        "agent `stub-agent` was not started: "
        f"{plain} is not in a git repository, so it has no worktree to give a child: use isolation='copy'"
    )
    assert opened(provider) == 0
    assert list(plain.iterdir()) == []


async def test_copy_isolation_outside_git_gives_the_child_a_copy_that_keeps_its_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text(ORIGINAL)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    copies = tmp_path / "copies"
    provider = in_process_provider(
        turn(write("notes.txt"), write("new.txt", "new\n")),
        plain,
        isolation=IsolationSettings(root=str(copies)),
    )
    result, run_id = await run_once(provider, "copied notes", isolation="copy")
    copy = copies / run_id
    assert result.workspace == WorkspaceChange(
        mode="copy",
        path=str(copy),
        changed=True,
        files=(FileChange("new.txt", 1, 0), FileChange("notes.txt", 1, 1)),
    )
    # The changes live only in the copy, which `remove` therefore keeps; the original is untouched.
    assert ((copy / "notes.txt").read_text(), (copy / "new.txt").read_text()) == ("copied notes\n", "new\n")
    assert sorted(os.listdir(plain)) == ["notes.txt"]
    assert (plain / "notes.txt").read_text() == ORIGINAL
    (kept,) = find_leftovers(None, IsolationSettings(root=str(copies)))
    assert (kept.run_id, kept.mode, kept.state, kept.path) == (run_id, "copy", "kept", str(copy))


@pytest.mark.both_backends
async def test_a_start_disposed_while_its_worktree_is_made_leaves_nothing_and_starts_no_agent(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    head = git(repo, "rev-parse", "HEAD")
    made, proceed = anyio.Event(), anyio.Event()

    async def slow_open(*args: Any, **kwargs: Any) -> Workspace:
        workspace = await open_workspace(*args, **kwargs)
        made.set()
        await proceed.wait()  # the dispose arrives while the workspace is being made
        return workspace

    monkeypatch.setattr(acp_module, "open_workspace", slow_open)
    provider = in_process_provider(turn(write("notes.txt")), repo)
    async with service_with(provider) as service:
        run = service.start(provider.name, SubagentRequest(prompt="go", isolation="worktree"))
        with anyio.fail_after(WAIT):
            await made.wait()
            assert len(worktrees(repo)) == 2
            async with anyio.create_task_group() as group:
                group.start_soon(run.dispose)
                await anyio.wait_all_tasks_blocked()
                proceed.set()
            with pytest.raises(SubagentError) as caught:
                await run.started()
    assert caught.value.code == ErrorCode.DISPOSED
    assert str(caught.value) == f"run {run.id!r} was disposed before its agent was spawned"
    assert opened(provider) == 0
    assert branches(repo) == ["main"]
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)


# -- more turns ------------------------------------------------------------------------------------------


async def test_a_resumed_turns_change_is_committed_on_the_branch_and_reported(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    scenario = {"turns": [[write("notes.txt")], [write("more.txt")]]}
    provider = in_process_provider(scenario, repo)
    async with (
        service_with(provider) as service,
        service.start(provider.name, SubagentRequest(prompt="first turn", isolation="worktree")) as run,
    ):
        with anyio.fail_after(WAIT):
            first = await run.result()
            second = await run.resume("second turn")  # type: ignore[attr-defined]
    branch = f"subagent/{run.id}"
    assert first.workspace is not None
    assert second.workspace is not None
    assert first.workspace.files == (FileChange("notes.txt", 1, 1),)
    assert second.workspace.files == (FileChange("more.txt", 1, 0), FileChange("notes.txt", 1, 1))
    assert second.workspace.commit == git(repo, "rev-parse", branch)
    assert git(repo, "rev-parse", f"{branch}^") == first.workspace.commit
    assert git(repo, "log", "--format=%s", f"{head}..{branch}").splitlines() == ["second turn", "first turn"]
    assert git(repo, "show", f"{branch}:more.txt") == "second turn"
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)


async def test_a_first_turn_cut_short_by_dispose_has_its_work_committed_on_the_branch(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    provider = in_process_provider(turn(write("notes.txt"), {"step": "hang"}), repo)
    async with (
        service_with(provider) as service,
        service.start(provider.name, SubagentRequest(prompt="cut short", isolation="worktree")) as run,
    ):
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        written = anyio.Event()
        acp_run.on_update(lambda update: written.set() if "fs/write_text_file" in str(update) else None)
        with anyio.fail_after(WAIT):
            await written.wait()  # notes.txt is written, and the turn hangs
            await run.dispose()
    branch = f"subagent/{run.id}"
    assert git(repo, "log", "--format=%s", f"{head}..{branch}").splitlines() == ["cut short"]
    assert git(repo, "show", f"{branch}:notes.txt") == "cut short"
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)


async def test_a_resumed_turn_cut_short_by_dispose_has_its_work_committed_on_the_branch(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    scenario = {"turns": [[write("notes.txt")], [write("more.txt"), {"step": "hang"}]]}
    provider = in_process_provider(scenario, repo)
    resumed: list[SubagentResult] = []
    async with (
        service_with(provider) as service,
        service.start(provider.name, SubagentRequest(prompt="first turn", isolation="worktree")) as run,
    ):
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        with anyio.fail_after(WAIT):
            await run.result()
            written = anyio.Event()
            acp_run.on_update(lambda update: written.set() if "fs/write_text_file" in str(update) else None)
            async with anyio.create_task_group() as group:

                async def resume() -> None:
                    resumed.append(await run.resume("second turn"))  # type: ignore[attr-defined]

                group.start_soon(resume)
                await written.wait()  # more.txt is written, and the turn hangs
                await run.dispose()
    branch = f"subagent/{run.id}"
    # The turn ends with its child gone (an error), its work committed and reported before the cleanup.
    (cut_short,) = resumed
    assert cut_short.stop_reason == "error"
    assert cut_short.workspace is not None
    assert cut_short.workspace.files == (FileChange("more.txt", 1, 0), FileChange("notes.txt", 1, 1))
    assert cut_short.workspace.commit == git(repo, "rev-parse", branch)
    assert git(repo, "log", "--format=%s", f"{head}..{branch}").splitlines() == ["second turn", "first turn"]
    assert git(repo, "show", f"{branch}:more.txt") == "second turn"
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)


# -- the parent SIGKILLed --------------------------------------------------------------------------------


@pytest.mark.both_backends
async def test_when_the_parent_is_sigkilled_mid_run_its_agent_dies_and_the_next_reap_recovers_the_write(
    repo: Path, tmp_path: Path, anyio_backend_name: str
) -> None:
    head = git(repo, "rev-parse", "HEAD")
    scenario = tmp_path / "write-then-hang.json"
    scenario.write_text(
        dump_scenario(turn(write("found.txt", "written before the kill\n"), {"step": "hang"}))
    )
    script = [
        sys.executable,
        str(PROCS / "isolated_run_then_wait.py"),
        anyio_backend_name,
        str(repo),
        str(scenario),
    ]
    async with assert_no_leaks():
        parent = await anyio.open_process(script, stdin=None, stderr=None)
        async with parent:
            assert parent.stdout is not None
            with anyio.fail_after(WAIT):
                line = await BufferedByteReceiveStream(parent.stdout).receive_until(b"\n", 4096)
            agent_pid, run_id, worktree = line.decode().split(" ", 2)
            assert (Path(worktree) / "found.txt").read_text() == "written before the kill\n"
            parent.kill()
            with anyio.fail_after(WAIT):
                assert await parent.wait() == -signal.SIGKILL
        assert await survivors_after_polling([int(agent_pid)], GONE_AFTER_PARENT_DEATH) == []
        branch = f"subagent/{run_id}"
        (listed,) = find_leftovers(str(repo))
        assert (listed.run_id, listed.state, listed.branch) == (run_id, "orphaned", branch)

        leftovers = await reap_leftovers(str(repo))

    commit = git(repo, "rev-parse", branch)
    assert leftovers == [
        Leftover(
            run_id, "worktree", worktree, branch, "orphaned", parent.pid, recovered="branch", commit=commit
        )
    ]
    assert git(repo, "show", f"{branch}:found.txt") == "written before the kill"
    assert git(repo, "rev-parse", f"{branch}^") == head
    assert not await anyio.Path(worktree).exists()
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)


# -- a transport whose agent runs elsewhere, with a runner of its own ---------------------------------------

CORE = Path(acp_module.__file__).resolve().parent.parent / "_isolation_core.py"


class Afar:
    """A runner that runs the core as a host without this package would: ``python3 -I -S`` on its
    source, one process per operation; records every operation."""

    def __init__(self) -> None:
        self.operations: list[str] = []

    async def __call__(self, operation: str, *args: Any) -> Any:
        self.operations.append(operation)
        done = await anyio.run_process(
            [sys.executable, "-I", "-S", str(CORE)],
            input=json.dumps({"op": operation, "args": list(args)}).encode(),
        )
        reply = json.loads(done.stdout)
        if "error" in reply:
            raise IsolationError(reply["error"])
        return reply["value"]


class AfarTransport(StubAgentTransport):
    """The stub agent where this host's files are not, whose transport makes workspaces there."""

    def __init__(self, scenario: dict[str, Any], runner: Afar) -> None:
        super().__init__(scenario, local_files=False)
        self.runner = runner

    def isolation_runner(self) -> Afar:
        return self.runner


@pytest.mark.both_backends
async def test_a_transport_with_a_runner_of_its_own_gets_a_worktree_made_where_its_agent_runs(
    repo: Path,
) -> None:
    head = git(repo, "rev-parse", "HEAD")
    runner = Afar()
    transport = AfarTransport(turn(), runner)
    provider = AcpProvider(["stub-agent"], cwd=repo, transport=transport)
    assert provider.capabilities.isolation == frozenset({"worktree", "copy"})
    async with service_with(provider) as service:
        with anyio.fail_after(WAIT):
            async with service.start(
                provider.name, SubagentRequest(prompt="first", isolation="worktree")
            ) as run:
                first = await run.result()
                (launch,) = transport.opened
                # The agent writes with its own tools there: here, the test does it for it.
                assert launch.cwd is not None
                await anyio.Path(launch.cwd, "afar.txt").write_text("written where the agent runs\n")
                assert isinstance(run.provider_run, AcpRun)
                second = await run.provider_run.resume("second")
    worktree = str(records_dir(repo) / run.id)
    assert launch.cwd == worktree
    assert first.workspace == WorkspaceChange(
        mode="worktree", path=worktree, changed=False, branch=f"subagent/{run.id}", base=head
    )
    assert second.workspace is not None
    assert second.workspace.files == (FileChange("afar.txt", 1, 0),)
    assert git(repo, "show", f"subagent/{run.id}:afar.txt") == "written where the agent runs"
    # Made, each turn committed once at its end, closed: all of it over there, one call each.
    assert runner.operations == ["records_for", "open", "commit", "commit", "close"]
    assert_parent_untouched(repo, head)
    assert_nothing_left(repo)


async def test_what_a_dead_process_of_this_host_left_afar_is_reaped_from_here_at_the_next_start(
    repo: Path,
) -> None:
    runner = Afar()
    settings = IsolationSettings().as_json()
    dead = await anyio.run_process([sys.executable, "-c", "import os; print(os.getpid())"])
    owner = {"host": host_id(), "pid": int(dead.stdout), "start": "1"}
    left = await runner("open", str(repo), "left-1", "worktree", settings, "remove", owner)
    await anyio.Path(left["cwd"], "left.txt").write_text("the dead parent's child wrote this\n")
    provider = AcpProvider(["stub-agent"], cwd=repo, transport=AfarTransport(turn(), runner))
    result, _run_id = await run_once(provider, isolation="worktree")
    assert result.stop_reason == "completed"
    assert git(repo, "show", "subagent/left-1:left.txt") == "the dead parent's child wrote this"
    assert runner.operations[:4] == ["open", "records_for", "reap", "open"]
    assert_nothing_left(repo)
