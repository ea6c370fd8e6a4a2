"""The workspace layer (subagent.isolation): names claimed once, leftovers of a dead owner recovered
onto their branch (a SIGKILLed parent loses nothing and leaks nothing), and the parent's helpers,
merge, diff and discard, which refuse a conflict naming its paths."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from subagent._isolation_core import map_path
from subagent.isolation import (
    IsolationError,
    IsolationSettings,
    Leftover,
    MergeConflictError,
    diff,
    discard,
    find_leftovers,
    merge,
    open_workspace,
    reap_leftovers,
)
from subagent.types import FileChange, WorkspaceChange
from tests.gitrepo import branches, git, make_repo, records_dir, worktrees

pytestmark = pytest.mark.anyio

WAIT = 60.0


def dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


async def changed_workspace(repo: Path, run_id: str, name: str, text: str) -> tuple[str, str]:
    """A child's work: a workspace of ``repo`` with ``name`` written and committed; (branch, commit)."""
    workspace = await open_workspace(str(repo), run_id, "worktree")
    await anyio.Path(workspace.cwd, name).write_text(text)
    change = await workspace.close()
    assert change is not None
    assert change.branch is not None
    assert change.commit is not None
    return change.branch, change.commit


# -- names ---------------------------------------------------------------------------------------------------


async def test_a_run_id_whose_branch_an_earlier_run_kept_gets_the_next_free_name(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    await changed_workspace(repo, "spawn-1", "a.txt", "a\n")  # another process's spawn-1, its branch kept
    workspace = await open_workspace(str(repo), "spawn-1", "worktree")
    try:
        assert workspace.branch == "subagent/spawn-1-2"
        assert workspace.path == str(records_dir(repo) / "spawn-1-2")
    finally:
        await workspace.close()


@pytest.mark.both_backends
async def test_two_workspaces_opened_at_once_for_one_run_id_get_distinct_names(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    opened = []

    async def open_one() -> None:
        opened.append(await open_workspace(str(repo), "same", "worktree"))

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as group:
            for _ in range(3):
                group.start_soon(open_one)
        assert sorted(w.branch or "" for w in opened) == [
            "subagent/same",
            "subagent/same-2",
            "subagent/same-3",
        ]
        for workspace in opened:
            await workspace.close()
    assert branches(repo) == ["main"]
    assert worktrees(repo) == [str(repo)]


async def test_a_hostile_run_id_cannot_name_a_path_outside_the_workspaces_directory(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    workspace = await open_workspace(str(repo), "../../../etc/passwd", "worktree")
    try:
        assert Path(workspace.path).parent == records_dir(repo)
        assert workspace.branch == "subagent/etc-passwd"
    finally:
        await workspace.close()


# -- leftovers -----------------------------------------------------------------------------------------------

PARENT = textwrap.dedent(
    """
    import sys, anyio
    from pathlib import Path
    from subagent import SubagentRequest, SubagentService
    from subagent.providers.spawn import SpawnProvider
    from subagent.runtime import Reply, ScriptedLlm, ToolSpec
    from subagent.runtime._scripted import call

    class Write:
        spec = ToolSpec("write", "Write a file, then work on.", {"type": "object", "properties": {}})
        needs_approval = False

        async def run(self, invocation):
            Path(invocation.context.cwd, "child.txt").write_text("the child's unsaved work\\n")
            print("wrote", invocation.context.cwd, flush=True)
            await anyio.sleep_forever()

    async def main():
        model = ScriptedLlm([Reply(text="", tool_calls=(call("write", {}),))])
        async with SubagentService() as service:
            service.register_provider(SpawnProvider(llm=model, tools=[Write()]))
            request = SubagentRequest(prompt="write", cwd=sys.argv[1], isolation="worktree")
            run = service.start("spawn", request)
            await run.result()

    anyio.run(main)
    """
)


async def test_a_sigkilled_parents_worktree_is_recovered_onto_its_branch_at_the_next_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    repo = make_repo(tmp_path / "repo")
    with anyio.fail_after(WAIT):
        async with await anyio.open_process(
            [sys.executable, "-c", PARENT, str(repo)], stderr=subprocess.DEVNULL
        ) as parent:
            assert parent.stdout is not None
            said = b""
            async for chunk in parent.stdout:
                said += chunk
                if said.endswith(b"\n"):
                    break
            assert said.startswith(b"wrote ")
            parent.send_signal(signal.SIGKILL)
            await parent.wait()
    worktree = said.decode().split(" ", 1)[1].strip()
    # Its leftover is listed for what it is, before anything is done to it.
    (found,) = find_leftovers(str(repo))
    assert found == Leftover(
        run_id="spawn-1", mode="worktree", path=worktree, branch="subagent/spawn-1", state="orphaned",
        owner_pid=parent.pid,
    )  # fmt: skip

    # The next start in the repository reaps it: the work is committed on its branch, nothing leaks.
    caplog.set_level(logging.WARNING, logger="subagent.isolation")
    workspace = await open_workspace(str(repo), "next-run", "worktree")
    await workspace.close()
    assert git(repo, "show", "subagent/spawn-1:child.txt") == "the child's unsaved work"
    assert "recovered after its owner" in git(repo, "log", "-1", "--format=%s", "subagent/spawn-1")
    assert not await anyio.Path(worktree).exists()
    assert worktrees(repo) == [str(repo)]
    assert git(repo, "worktree", "prune", "--dry-run", "--verbose") == ""
    assert branches(repo) == ["main", "subagent/spawn-1"]
    assert list(records_dir(repo).iterdir()) == []
    assert git(repo, "status", "--porcelain") == ""
    assert any(
        "recovered the workspace of run spawn-1" in record.getMessage()
        and "its work is on branch subagent/spawn-1" in record.getMessage()
        for record in caplog.records
    )


async def test_reap_leftovers_says_what_it_recovered_and_spares_live_and_kept_workspaces(
    tmp_path: Path,
) -> None:
    repo = make_repo(tmp_path / "repo")
    live = await open_workspace(str(repo), "live", "worktree")
    kept = await open_workspace(str(repo), "kept", "worktree", cleanup="keep")
    await anyio.Path(kept.cwd, "k.txt").write_text("k\n")
    await kept.close()
    orphan = await open_workspace(str(repo), "orphan", "worktree")
    await anyio.Path(orphan.cwd, "o.txt").write_text("o\n")
    record = records_dir(repo) / "orphan.json"
    pid = dead_pid()
    record.write_text(json.dumps({**json.loads(record.read_text()), "pid": pid}))
    unchanged = await open_workspace(str(repo), "unchanged", "worktree")
    record = records_dir(repo) / "unchanged.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "pid": pid}))

    assert {(f.run_id, f.state) for f in find_leftovers(str(repo))} == {
        ("live", "live"), ("kept", "kept"), ("orphan", "orphaned"), ("unchanged", "orphaned"),
    }  # fmt: skip
    with anyio.fail_after(WAIT):
        reaped = await reap_leftovers(str(repo))
    commit = git(repo, "rev-parse", "subagent/orphan")
    assert reaped == [
        Leftover("orphan", "worktree", orphan.path, "subagent/orphan", "orphaned", pid, "branch", commit),
        Leftover("unchanged", "worktree", unchanged.path, "subagent/unchanged", "orphaned", pid, "removed"),
    ]
    assert git(repo, "show", "subagent/orphan:o.txt") == "o"
    assert sorted(branches(repo)) == ["main", "subagent/kept", "subagent/live", "subagent/orphan"]
    assert worktrees(repo) == [str(repo), kept.path, live.path]
    assert {(f.run_id, f.state) for f in find_leftovers(str(repo))} == {("live", "live"), ("kept", "kept")}
    await live.close()


async def test_a_workspace_its_owner_died_making_is_removed_whole(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    base = git(repo, "rev-parse", "HEAD")
    path = records_dir(repo) / "half"
    git(repo, "worktree", "add", "--quiet", "-b", "subagent/half", str(path), base)
    (records_dir(repo) / "half.json").write_text(
        json.dumps(
            {
                "pid": dead_pid(), "start": "1", "state": "creating", "mode": "worktree", "repo": str(repo),
                "path": str(path), "branch": "subagent/half", "base": base, "run": "half",
            }
        )
    )  # fmt: skip
    # Claimed, never written: its owner died between the two.
    empty = records_dir(repo) / "empty.json"
    empty.write_text("")
    old = time.time() - 3600
    os.utime(empty, (old, old))

    reaped = await reap_leftovers(str(repo))
    assert [(f.run_id, f.recovered) for f in reaped] == [("half", "removed")]
    assert branches(repo) == ["main"]
    assert worktrees(repo) == [str(repo)]
    assert list(records_dir(repo).iterdir()) == []


async def test_find_leftovers_outside_a_repository_says_so(tmp_path: Path) -> None:
    with pytest.raises(IsolationError, match="is not in a git repository"):
        find_leftovers(str(tmp_path))


async def test_a_host_chosen_root_holds_the_worktrees_and_the_branch_prefix_names_the_branch(
    tmp_path: Path,
) -> None:
    repo = make_repo(tmp_path / "repo")
    settings = IsolationSettings(root=str(tmp_path / "trees"), branch_prefix="agents/")
    workspace = await open_workspace(str(repo), "r1", "worktree", settings=settings)
    await anyio.Path(workspace.cwd, "x.txt").write_text("x\n")
    change = await workspace.close()
    assert change is not None
    assert (change.path, change.branch) == (str(tmp_path / "trees" / "r1"), "agents/r1")
    assert [f.run_id for f in find_leftovers(str(repo), settings)] == []
    assert git(repo, "show", "agents/r1:x.txt") == "x"


def test_a_branch_prefix_git_would_refuse_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="branch_prefix"):
        IsolationSettings(branch_prefix="bad prefix/")


# -- merging back --------------------------------------------------------------------------------------------


async def test_merge_brings_a_childs_branch_into_the_parents_branch(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    workspace = await open_workspace(str(repo), "c1", "worktree")
    await anyio.Path(workspace.cwd, "notes.txt").write_text("the child's notes\n")
    change = await workspace.close()
    assert change is not None
    text = await diff(str(repo), change)
    assert "-the parent's notes\n+the child's notes" in text
    head = await merge(str(repo), change)
    assert head == change.commit  # a fast-forward
    assert (repo / "notes.txt").read_text() == "the child's notes\n"


async def test_merge_refuses_a_conflict_naming_the_paths_and_leaves_the_repository_as_it_was(
    tmp_path: Path,
) -> None:
    repo = make_repo(tmp_path / "repo", {"notes.txt": "n\n", "other.txt": "o\n", "same.txt": "s\n"})
    first = await open_workspace(str(repo), "first", "worktree")
    second = await open_workspace(str(repo), "second", "worktree")
    for workspace, text in ((first, "first\n"), (second, "second\n")):
        await anyio.Path(workspace.cwd, "notes.txt").write_text(text)
        await anyio.Path(workspace.cwd, "other.txt").write_text(text)
    await anyio.Path(second.cwd, "new.txt").write_text("new\n")
    one, two = await first.close(), await second.close()
    assert one is not None
    assert two is not None
    assert two.files == (
        FileChange("new.txt", 1, 0),
        FileChange("notes.txt", 1, 1),
        FileChange("other.txt", 1, 1),
    )
    await merge(str(repo), one)
    head = git(repo, "rev-parse", "HEAD")
    with pytest.raises(MergeConflictError) as caught:
        await merge(str(repo), two)
    assert caught.value.paths == ("notes.txt", "other.txt")
    assert caught.value.branch == "subagent/second"
    assert str(caught.value) == "merging 'subagent/second' conflicts in 2 file(s): notes.txt, other.txt"
    assert git(repo, "rev-parse", "HEAD") == head
    assert git(repo, "status", "--porcelain") == ""
    assert not (repo / ".git" / "MERGE_HEAD").exists()


async def test_merge_refuses_a_working_tree_with_uncommitted_changes(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    branch, _commit = await changed_workspace(repo, "c", "c.txt", "c\n")
    (repo / "notes.txt").write_text("unsaved\n")
    workspace_change = await _change_of(repo, branch)
    with pytest.raises(IsolationError, match="has uncommitted changes: commit or stash them"):
        await merge(str(repo), workspace_change)
    assert (repo / "notes.txt").read_text() == "unsaved\n"


async def test_discard_deletes_the_branch_and_a_kept_worktree(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    workspace = await open_workspace(str(repo), "k", "worktree", cleanup="keep")
    await anyio.Path(workspace.cwd, "k.txt").write_text("k\n")
    change = await workspace.close()
    assert change is not None
    assert worktrees(repo) == [str(repo), change.path]
    await discard(str(repo), change)
    assert branches(repo) == ["main"]
    assert worktrees(repo) == [str(repo)]


async def _change_of(repo: Path, branch: str) -> WorkspaceChange:
    base = git(repo, "merge-base", "main", branch)
    return WorkspaceChange(
        mode="worktree",
        path="",
        changed=True,
        branch=branch,
        base=base,
        commit=git(repo, "rev-parse", branch),
    )


async def test_close_commits_what_the_child_did_after_its_last_turns_commit(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    workspace = await open_workspace(str(repo), "late", "worktree")
    await anyio.Path(workspace.cwd, "turn.txt").write_text("in the turn\n")
    first = await workspace.commit("the turn")
    await anyio.Path(workspace.cwd, "late.txt").write_text("a job it left running wrote this\n")
    final = await workspace.close()
    assert first.files == (FileChange("turn.txt", 1, 0),)
    assert final is not None
    assert final.files == (FileChange("late.txt", 1, 0), FileChange("turn.txt", 1, 0))
    assert final.commit == git(repo, "rev-parse", "subagent/late")
    assert git(repo, "log", "--format=%s", "main..subagent/late").splitlines() == [
        "subagent run late: the work it left at its end",
        "the turn",
    ]


async def test_a_start_cancelled_while_its_worktree_is_made_leaves_nothing(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    for delay in (0.0, 0.01, 0.02, 0.05, 0.1):
        with anyio.move_on_after(delay):
            workspace = await open_workspace(str(repo), f"cut-{delay}", "worktree")
            await workspace.close()
        assert branches(repo) == ["main"]
        assert worktrees(repo) == [str(repo)]
        assert not records_dir(repo).exists() or list(records_dir(repo).iterdir()) == []


# -- the core, as it runs where an agent runs over ssh ------------------------------------------------------

CORE = Path(__file__).resolve().parent.parent / "subagent" / "_isolation_core.py"


def call_core(op: str, *args: object) -> object:
    """One operation of the core in a fresh ``python3 -I -S``: nothing of ours importable, as on a
    remote host."""
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(CORE)],
        input=json.dumps({"op": op, "args": list(args)}),
        capture_output=True,
        text=True,
        check=True,
    )
    reply = json.loads(done.stdout)
    return reply.get("value", reply)


def test_the_core_alone_makes_commits_and_closes_a_worktree_owned_by_the_process_that_asked(
    tmp_path: Path,
) -> None:
    repo = make_repo(tmp_path / "repo")
    owner = {"host": "another-host", "pid": 4242, "start": "1"}
    settings = IsolationSettings().as_json()
    workspace = call_core("open", str(repo), "remote-1", "worktree", settings, "remove", owner)
    assert isinstance(workspace, dict)
    assert workspace["branch"] == "subagent/remote-1"
    Path(workspace["cwd"], "r.txt").write_text("remote\n")
    record = json.loads(Path(workspace["record"]).read_text())
    assert (record["host"], record["pid"], record["state"]) == ("another-host", 4242, "ready")
    # Another host's process: this host cannot tell it is gone, so it is listed live and not reaped...
    (found,) = find_leftovers(str(repo))
    assert (found.run_id, found.state) == ("remote-1", "live")
    assert call_core("reap", str(records_dir(repo))) == []
    # ...until the host that owns it says so, by name.
    reaped = call_core("reap", str(records_dir(repo)), ["remote-1"])
    assert isinstance(reaped, list)
    assert [(found["run_id"], found["recovered"]) for found in reaped] == [("remote-1", "branch")]
    assert git(repo, "show", "subagent/remote-1:r.txt") == "remote"
    assert worktrees(repo) == [str(repo)]


def test_the_core_says_a_failure_as_an_error_reply() -> None:
    assert call_core("open", "/nonexistent-dir", "r", "worktree", {}, "remove") == {
        "error": "/nonexistent-dir is not in a git repository, so it has no worktree to give a child: "
        "use isolation='copy'"
    }


def test_a_path_inside_the_source_maps_into_the_workspace_through_symlinks_and_one_outside_stays(
    tmp_path: Path,
) -> None:
    source = tmp_path / "repo"
    (source / "sub").mkdir(parents=True)
    (tmp_path / "repo-sibling").mkdir()
    link = tmp_path / "link"
    link.symlink_to(source)
    root = str(source / ".git" / "w" / "1")
    assert map_path(str(source), str(source), root) == root
    assert map_path(str(link / "sub"), str(source), root) == os.path.join(root, "sub")
    assert map_path(str(tmp_path), str(source), root) == str(tmp_path)
    assert map_path(str(tmp_path / "repo-sibling"), str(source), root) == str(tmp_path / "repo-sibling")
    # A name that merely starts with ".." is inside.
    (source / "..notes").mkdir()
    assert map_path(str(source / "..notes"), str(source), root) == os.path.join(root, "..notes")
