"""Isolated workspaces for in-process children (spawn, fork): each child works in its own git worktree
(or a copy) on a branch of its own, its changes committed there and described in its result, the
parent's working tree untouched; nothing is left behind that the cleanup policy does not keep."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import ErrorCode, SubagentError, SubagentRequest
from subagent.isolation import IsolationSettings
from subagent.providers.fork import ForkProvider
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import Agent, Reply, ScriptedLlm, ToolSpec
from subagent.runtime._scripted import call
from subagent.runtime._tools import ToolInvocation
from subagent.service import SubagentService
from subagent.types import FileChange, ResumableRun, SubagentCapabilities, SubagentRunEndInfo
from tests.fakes import FakeProvider
from tests.gitrepo import branches, git, make_repo, worktrees

pytestmark = pytest.mark.anyio

WAIT = 60.0


class WriteTool:
    """Writes a file relative to the calling agent's cwd, as a coding tool would."""

    spec = ToolSpec(
        "write",
        "Write a file.",
        {
            "type": "object",
            "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
            "required": ["path", "text"],
        },
    )
    needs_approval = False

    def __init__(self) -> None:
        self.cwds: list[str | None] = []

    async def run(self, invocation: ToolInvocation) -> str:
        cwd = invocation.context.cwd
        self.cwds.append(cwd)
        assert cwd is not None
        target = Path(cwd, invocation.arguments["path"])
        await anyio.Path(target).write_text(invocation.arguments["text"])
        return f"wrote {invocation.arguments['path']}"


def writer(path: str, text: str, answer: str = "done") -> ScriptedLlm:
    """A model that writes ``text`` to ``path`` with the ``write`` tool, then answers."""
    return ScriptedLlm([Reply(text="", tool_calls=(call("write", {"path": path, "text": text}),)), answer])


class PerPromptWriter(ScriptedLlm):
    """Each turn writes its prompt's text to notes.txt (so concurrent children write different text)."""

    def __init__(self) -> None:
        super().__init__(self._respond)

    def _respond(self, request: Any) -> Any:
        last = request.messages[-1]
        if last.role == "tool":
            return Reply(text="done")
        prompt = request.messages[-1].content
        return Reply(text="", tool_calls=(call("write", {"path": "notes.txt", "text": prompt + "\n"}),))


async def run_isolated(provider: SpawnProvider, request: SubagentRequest) -> tuple[Any, str]:
    async with SubagentService() as service:
        service.register_provider(provider)
        with anyio.fail_after(WAIT):
            async with service.start(provider.name, request) as run:
                return await run.result(), run.id


@pytest.mark.both_backends
async def test_twenty_children_editing_one_file_at_once_each_leave_their_change_on_their_own_branch(
    tmp_path: Path,
) -> None:
    repo = make_repo(tmp_path / "repo")
    head = git(repo, "rev-parse", "HEAD")
    tool = WriteTool()
    results: dict[str, Any] = {}
    async with SubagentService() as service:
        service.register_provider(SpawnProvider(llm=PerPromptWriter(), tools=[tool]))

        async def child(index: int) -> None:
            request = SubagentRequest(prompt=f"child {index} was here", cwd=str(repo), isolation="worktree")
            async with service.start("spawn", request) as run:
                results[f"child {index} was here"] = (run.id, await run.result())

        with anyio.fail_after(WAIT * 2):
            async with anyio.create_task_group() as group:
                for index in range(20):
                    group.start_soon(child, index)

    assert len(results) == 20
    seen_branches = set()
    for text, (run_id, result) in results.items():
        change = result.workspace
        assert result.stop_reason == "completed"
        assert change is not None
        assert (change.mode, change.changed) == ("worktree", True)
        assert change.branch == f"subagent/{run_id}"
        assert change.base == head
        assert change.files == (FileChange("notes.txt", 1, 1),)
        assert change.removed is False  # said at the turn's end; the run's dispose removed it after
        assert git(repo, "show", f"{change.branch}:notes.txt") == text
        assert git(repo, "log", "-1", "--format=%s", change.branch) == text
        seen_branches.add(change.branch)
    assert len(seen_branches) == 20
    # Every tool call ran in a worktree of the repository, none in the parent's tree.
    assert all(
        cwd is not None and cwd.startswith(str(repo / ".git" / "subagent-worktrees")) for cwd in tool.cwds
    )
    # The parent's working tree is untouched; only its own worktree is left; the branches stay.
    assert (repo / "notes.txt").read_text() == "the parent's notes\n"
    assert git(repo, "status", "--porcelain") == ""
    assert git(repo, "rev-parse", "HEAD") == head
    assert worktrees(repo) == [str(repo)]
    assert sorted(branches(repo)) == sorted(["main", *seen_branches])
    assert list((repo / ".git" / "subagent-worktrees").iterdir()) == []


@pytest.mark.both_backends
async def test_a_child_that_changes_nothing_leaves_no_worktree_no_branch_and_no_record(
    tmp_path: Path,
) -> None:
    repo = make_repo(tmp_path / "repo")
    provider = SpawnProvider(llm=ScriptedLlm(["nothing to do"]), tools=[WriteTool()])
    result, run_id = await run_isolated(
        provider, SubagentRequest(prompt="look only", cwd=str(repo), isolation="worktree")
    )
    assert result.output == "nothing to do"
    assert result.workspace is not None
    assert result.workspace.changed is False
    assert result.workspace.files == ()
    assert result.workspace.commit is None
    assert result.workspace.branch == f"subagent/{run_id}"
    assert result.workspace.describe() == "it changed no file"
    assert branches(repo) == ["main"]
    assert worktrees(repo) == [str(repo)]
    assert list((repo / ".git" / "subagent-worktrees").iterdir()) == []


async def test_the_end_event_names_the_change_as_the_result_does(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    ends: list[SubagentRunEndInfo] = []
    async with SubagentService() as service:
        service.events.on("subagent/end", ends.append)
        service.register_provider(SpawnProvider(llm=writer("e.txt", "e\n"), tools=[WriteTool()]))
        with anyio.fail_after(WAIT):
            async with service.start(
                "spawn", SubagentRequest(prompt="e", cwd=str(repo), isolation="worktree")
            ) as run:
                result = await run.result()
    assert [end.workspace for end in ends] == [result.workspace]
    assert result.workspace is not None
    assert result.workspace.files == (FileChange("e.txt", 1, 0),)


async def test_uncommitted_parent_changes_stay_out_of_the_child_and_untouched(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    (repo / "notes.txt").write_text("the parent's unsaved edit\n")
    provider = SpawnProvider(llm=writer("other.txt", "child\n"), tools=[WriteTool()])
    result, _run_id = await run_isolated(
        provider, SubagentRequest(prompt="add other", cwd=str(repo), isolation="worktree")
    )
    change = result.workspace
    assert change is not None
    assert change.files == (FileChange("other.txt", 1, 0),)
    assert git(repo, "show", f"{change.branch}:notes.txt") == "the parent's notes"
    assert (repo / "notes.txt").read_text() == "the parent's unsaved edit\n"
    assert not (repo / "other.txt").exists()


async def test_keep_leaves_the_worktree_and_remove_always_drops_the_branch_too(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    kept, _ = await run_isolated(
        SpawnProvider(llm=writer("a.txt", "a\n"), tools=[WriteTool()]),
        SubagentRequest(prompt="write a", cwd=str(repo), isolation="worktree", cleanup="keep"),
    )
    assert kept.workspace is not None
    assert worktrees(repo) == [str(repo), kept.workspace.path]
    assert await anyio.Path(kept.workspace.path, "a.txt").read_text() == "a\n"
    assert kept.workspace.branch in branches(repo)

    gone, _ = await run_isolated(
        SpawnProvider(llm=writer("b.txt", "b\n"), tools=[WriteTool()]),
        SubagentRequest(prompt="write b", cwd=str(repo), isolation="worktree", cleanup="remove-always"),
    )
    assert gone.workspace is not None
    assert gone.workspace.changed
    assert gone.workspace.branch not in branches(repo)
    assert worktrees(repo) == [str(repo), kept.workspace.path]


async def test_a_child_sent_to_a_subdirectory_works_in_the_same_subdirectory_of_its_worktree(
    tmp_path: Path,
) -> None:
    repo = make_repo(tmp_path / "repo", {"src/app.py": "print('hi')\n"})
    tool = WriteTool()
    result, run_id = await run_isolated(
        SpawnProvider(llm=writer("app.py", "print('bye')\n"), tools=[tool]),
        SubagentRequest(prompt="edit app", cwd=str(repo / "src"), isolation="worktree"),
    )
    assert tool.cwds == [str(repo / ".git" / "subagent-worktrees" / run_id / "src")]
    assert result.workspace is not None
    assert result.workspace.files == (FileChange("src/app.py", 1, 1),)


async def test_each_resumed_turn_commits_its_own_work_on_the_same_branch(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    llm = ScriptedLlm(
        [
            Reply(text="", tool_calls=(call("write", {"path": "one.txt", "text": "1\n"}),)),
            "first done",
            Reply(text="", tool_calls=(call("write", {"path": "two.txt", "text": "2\n"}),)),
            "second done",
        ]
    )
    async with SubagentService() as service:
        service.register_provider(SpawnProvider(llm=llm, tools=[WriteTool()]))
        with anyio.fail_after(WAIT):
            async with service.start(
                "spawn", SubagentRequest(prompt="write one", cwd=str(repo), isolation="worktree")
            ) as run:
                assert isinstance(run, ResumableRun)
                first = await run.result()
                second = await run.resume("now write two")
    assert first.workspace is not None
    assert second.workspace is not None
    assert first.workspace.branch == second.workspace.branch
    assert first.workspace.files == (FileChange("one.txt", 1, 0),)
    assert second.workspace.files == (FileChange("one.txt", 1, 0), FileChange("two.txt", 1, 0))
    branch = second.workspace.branch
    assert branch is not None
    assert git(repo, "log", "--format=%s", f"main..{branch}").splitlines() == ["now write two", "write one"]


async def test_a_forked_child_is_isolated_in_the_same_way(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    parent = Agent(llm=writer("forked.txt", "f\n"), id="parent-of-fork", cwd=str(repo), tools=[WriteTool()])
    provider = ForkProvider()
    dispose = provider.agents.register(parent)
    try:
        result, run_id = await run_isolated(
            provider,  # type: ignore[arg-type]
            SubagentRequest(prompt="fork and write", parent_id="parent-of-fork", isolation="worktree"),
        )
    finally:
        dispose()
    assert result.workspace is not None
    assert result.workspace.branch == f"subagent/{run_id}"
    assert git(repo, "show", f"subagent/{run_id}:forked.txt") == "f"
    assert not (repo / "forked.txt").exists()


@pytest.mark.both_backends
async def test_worktree_isolation_outside_a_repository_fails_the_start_and_says_to_use_copy(
    tmp_path: Path,
) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    async with SubagentService() as service:
        service.register_provider(SpawnProvider(llm=writer("x.txt", "x\n"), tools=[WriteTool()]))
        with anyio.fail_after(WAIT):
            async with service.start(
                "spawn", SubagentRequest(prompt="write", cwd=str(plain), isolation="worktree")
            ) as run:
                with pytest.raises(SubagentError) as caught:
                    await run.started()
    assert caught.value.code is ErrorCode.START_FAILED
    assert "is not in a git repository" in str(caught.value)
    assert "isolation='copy'" in str(caught.value)
    assert list(plain.iterdir()) == []


async def test_copy_isolation_outside_a_repository_keeps_a_changed_copy_and_leaves_the_source_alone(
    tmp_path: Path,
) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("source\n")
    copies = tmp_path / "copies"
    provider = SpawnProvider(
        llm=writer("notes.txt", "changed\n"),
        tools=[WriteTool()],
        isolation=IsolationSettings(root=str(copies)),
    )
    result, run_id = await run_isolated(
        provider, SubagentRequest(prompt="edit", cwd=str(plain), isolation="copy")
    )
    change = result.workspace
    assert change is not None
    assert (change.mode, change.changed, change.branch) == ("copy", True, None)
    assert change.path == str(copies / run_id)
    assert change.files == (FileChange("notes.txt", 1, 1),)
    assert (plain / "notes.txt").read_text() == "source\n"
    # A copy's changes live nowhere else: `remove` keeps a changed one.
    assert (copies / run_id / "notes.txt").read_text() == "changed\n"
    assert (
        change.describe()
        == f"its changes are in the copy at {copies / run_id}: 1 file(s) changed: notes.txt (+1 -1)"
    )


async def test_a_copy_larger_than_the_limit_is_refused_before_the_child_works(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "big.bin").write_bytes(b"x" * 2048)
    model = writer("x.txt", "x\n")
    provider = SpawnProvider(
        llm=model,
        tools=[WriteTool()],
        isolation=IsolationSettings(root=str(tmp_path / "c"), max_copy_bytes=1024),
    )
    async with SubagentService() as service:
        service.register_provider(provider)
        with anyio.fail_after(WAIT):
            async with service.start(
                "spawn", SubagentRequest(prompt="w", cwd=str(plain), isolation="copy")
            ) as run:
                with pytest.raises(SubagentError) as caught:
                    await run.result()
    assert caught.value.code is ErrorCode.START_FAILED
    assert "more than 1,024 bytes" in str(caught.value)
    assert model.requests == []
    assert not (tmp_path / "c" / run.id).exists()


async def test_a_provider_that_cannot_isolate_refuses_before_any_child_exists() -> None:
    provider = FakeProvider(capabilities=SubagentCapabilities(isolation=frozenset({"copy"})))
    async with SubagentService() as service:
        service.register_provider(provider)
        with pytest.raises(SubagentError) as caught:
            service.start(provider.name, SubagentRequest(prompt="x", isolation="worktree"))
        service.register_provider(FakeProvider(name="plain"))
        with pytest.raises(SubagentError) as none_at_all:
            service.start("plain", SubagentRequest(prompt="x", isolation="copy"))
    assert caught.value.code is ErrorCode.UNSUPPORTED_CAPABILITY
    assert caught.value.feature == "isolation"
    assert str(caught.value) == (
        f"provider {provider.name!r} cannot give a child isolation='worktree' (it offers: copy)"
    )
    assert none_at_all.value.feature == "isolation"
    assert str(none_at_all.value) == "provider 'plain' does not support 'isolation'"
    assert provider.start_calls == 0
