"""Isolation through the model-facing `subagent` tool: a host that sets ``isolation`` on the tool has every
child it starts work in its own git worktree (or copy); the description tells the model so, only the
providers that can isolate are offered, and each result ends with where the child's changes are (its
branch, commit and files), in the exact words the model reads, on asyncio and trio.

The children are real in-process runs (``spawn``) on a scripted model whose tool writes a file relative to
its cwd, as a coding tool would; the repositories are git repositories under ``tmp_path``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import ErrorCode, FileChange, SubagentCapabilities, SubagentService, WorkspaceChange
from subagent.delegation import BackgroundOptions, Notice
from subagent.isolation import IsolationSettings
from subagent.providers._inprocess import InProcessProvider
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import Agent, Reply, ScriptedLlm, call
from subagent.tool import SubagentTool
from tests.fakes import FakeProvider
from tests.gitrepo import branches, git, make_repo, worktrees
from tests.test_inprocess_isolation import WriteTool
from tests.test_inprocess_isolation import writer as writes

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

WAIT = 60  # seconds; a bound on every wait (git on a loaded machine), never a sleep


WORKTREE_NOTE = (
    "Workspaces: each subagent works in its own git worktree, on a new branch, never in your working tree. "
    "Its changes come back on that branch (the result names it, its commit and the files changed), which "
    "your host merges or not: until then they are not in your files."
)


def writer(text: str = "the child's notes\n") -> ScriptedLlm:
    """A model that rewrites notes.txt with the ``write`` tool, then answers "done"."""
    return writes("notes.txt", text)


def spawn(llm: ScriptedLlm, **kwargs: Any) -> SpawnProvider:
    return SpawnProvider(llm=llm, tools=[WriteTool()], **kwargs)


@asynccontextmanager
async def open_service(*providers: InProcessProvider | FakeProvider) -> AsyncIterator[SubagentService]:
    """An open service with ``providers``; on exit, no run is live."""
    async with SubagentService() as service:
        for provider in providers:
            service.register_provider(provider)
        yield service
        assert service.live_runs == ()


async def execute(tool: SubagentTool, arguments: Mapping[str, Any]) -> Any:
    with anyio.fail_after(WAIT):
        return await tool.execute(arguments)


async def test_a_child_of_an_isolating_tool_works_in_its_own_worktree_and_the_result_names_its_branch(
    tmp_path: Path,
) -> None:
    repo = make_repo(tmp_path / "repo")
    base = git(repo, "rev-parse", "HEAD")
    async with open_service(spawn(writer())) as service:
        with SubagentTool(service, cwd=str(repo), isolation="worktree") as tool:
            result = await execute(tool, {"provider": "spawn", "prompt": "Rewrite the notes"})
    branch = f"subagent/{result.run_id}"
    commit = git(repo, "rev-parse", branch)
    assert result.render() == (
        f"done\n\nThe subagent worked in a workspace of its own: its changes are on branch {branch} "
        f"(commit {commit[:12]}, over {base[:12]}): 1 file(s) changed: notes.txt (+1 -1)."
    )
    assert result.workspace == WorkspaceChange(
        mode="worktree",
        path=str(repo / ".git" / "subagent-worktrees" / result.run_id),
        changed=True,
        files=(FileChange("notes.txt", 1, 1),),
        branch=branch,
        base=base,
        commit=commit,
    )
    assert not result.is_error
    # The parent's working tree is untouched; the work is on the branch, its worktree removed.
    assert (repo / "notes.txt").read_text() == "the parent's notes\n"
    assert git(repo, "status", "--porcelain") == ""
    assert git(repo, "show", f"{branch}:notes.txt") == "the child's notes"
    assert git(repo, "log", "-1", "--format=%s", branch) == "Rewrite the notes"
    assert worktrees(repo) == [str(repo)]
    assert branches(repo) == ["main", branch]


async def test_an_isolated_child_that_changes_nothing_leaves_no_branch_and_its_result_says_so(
    tmp_path: Path,
) -> None:
    repo = make_repo(tmp_path / "repo")
    async with open_service(spawn(ScriptedLlm(["nothing to change"]))) as service:
        with SubagentTool(service, cwd=str(repo), isolation="worktree") as tool:
            result = await execute(tool, {"provider": "spawn", "prompt": "Look at the notes"})
    assert result.render() == (
        "nothing to change\n\nThe subagent worked in a workspace of its own: it changed no file."
    )
    assert result.workspace is not None
    assert (result.workspace.changed, result.workspace.commit) == (False, None)
    assert branches(repo) == ["main"]
    assert worktrees(repo) == [str(repo)]


async def test_an_isolating_tool_says_where_changes_come_back_and_offers_only_the_providers_that_isolate(
    tmp_path: Path,
) -> None:
    plain = FakeProvider(name="plain")  # isolates nothing
    async with open_service(spawn(writer()), plain) as service:
        with SubagentTool(service, cwd=str(tmp_path), isolation="worktree") as tool:
            definition = tool.definition
            isolated = (tool.isolation, tool.cleanup)
        with SubagentTool(service, cwd=str(tmp_path)) as unisolated:
            plain_definition = unisolated.definition
    assert isolated == ("worktree", "remove")
    assert definition.input_schema["properties"]["provider"]["enum"] == ["spawn"]
    assert '- "plain"' not in definition.description
    assert f"\n\n{WORKTREE_NOTE}" in definition.description
    assert "isolation" not in definition.input_schema["properties"]  # the host's policy, not the model's
    # Without isolation, the tool is as it always was.
    assert plain_definition.input_schema["properties"]["provider"]["enum"] == ["spawn", "plain"]
    assert "Workspaces:" not in plain_definition.description


async def test_an_isolating_tool_whose_providers_cannot_isolate_refuses_every_call_saying_why(
    tmp_path: Path,
) -> None:
    plain = FakeProvider(name="plain", capabilities=SubagentCapabilities(isolation=frozenset({"copy"})))
    async with open_service(plain) as service:
        with SubagentTool(service, cwd=str(tmp_path), isolation="worktree") as tool:
            definition = tool.definition
            available = tool.available
            result = await execute(tool, {"provider": "plain", "prompt": "Rewrite the notes"})
    assert not available
    assert definition.description.endswith(
        "No subagent provider registered now can give a subagent its own git worktree, as every subagent of "
        "this tool gets, so this tool cannot start a subagent; a call returns an error."
    )
    assert result.is_error
    assert result.error_code is ErrorCode.UNSUPPORTED_CAPABILITY
    assert result.render() == (
        "Error: no subagent provider registered now can give a subagent its own git worktree, as every "
        "subagent of this tool gets, so no subagent can be started."
    )
    assert plain.start_calls == 0


async def test_an_in_process_parent_reads_where_its_childs_changes_are_in_the_tool_result(
    tmp_path: Path,
) -> None:
    repo = make_repo(tmp_path / "repo")
    base = git(repo, "rev-parse", "HEAD")
    parent_model = ScriptedLlm(
        [
            Reply(
                text="", tool_calls=(call("subagent", {"provider": "spawn", "prompt": "Rewrite the notes"}),)
            ),
            "I will merge it",
        ]
    )
    async with open_service(spawn(writer())) as service:
        with SubagentTool(service, cwd=str(repo), isolation="worktree") as tool:
            # A spawned child of an agent gets that agent's tools: the parent has the write tool too.
            parent = Agent(llm=parent_model, id="parent", tools=[tool.for_agents(), WriteTool()])
            with anyio.fail_after(WAIT):
                outcome = await parent.run_turn("Have the notes rewritten")
            await parent.close()
    assert (outcome.stop_reason, outcome.output) == ("completed", "I will merge it")
    [branch] = [name for name in branches(repo) if name != "main"]
    commit = git(repo, "rev-parse", branch)
    _, after = parent_model.requests
    assert after.messages[-1].role == "tool"
    assert after.messages[-1].content == (
        f"done\n\nThe subagent worked in a workspace of its own: its changes are on branch {branch} "
        f"(commit {commit[:12]}, over {base[:12]}): 1 file(s) changed: notes.txt (+1 -1)."
    )
    [spec, _] = after.tools
    assert WORKTREE_NOTE in spec.description
    assert (repo / "notes.txt").read_text() == "the parent's notes\n"


async def test_a_scratch_tool_removes_each_childs_worktree_and_branch_and_says_its_changes_are_gone(
    tmp_path: Path,
) -> None:
    repo = make_repo(tmp_path / "repo")
    async with open_service(spawn(writer())) as service:
        with SubagentTool(service, cwd=str(repo), isolation="worktree", cleanup="remove-always") as tool:
            description = tool.definition.description
            result = await execute(tool, {"provider": "spawn", "prompt": "Try a rewrite"})
    assert (
        "Workspaces: each subagent works in a scratch git worktree, never in your files, deleted with "
        "everything it changed when it ends: what you need from it must be in its answer."
    ) in description
    assert result.render() == (
        "done\n\nThe subagent worked in a scratch workspace, removed with its changes when it ended: "
        "1 file(s) changed: notes.txt (+1 -1)."
    )
    assert branches(repo) == ["main"]
    assert worktrees(repo) == [str(repo)]


async def test_a_child_of_a_copying_tool_works_in_a_copy_its_result_naming_the_copy(tmp_path: Path) -> None:
    directory = tmp_path / "plain"
    directory.mkdir()
    (directory / "notes.txt").write_text("the parent's notes\n")
    copies = tmp_path / "copies"
    provider = spawn(writer(), isolation=IsolationSettings(root=str(copies)))
    async with open_service(provider) as service:
        with SubagentTool(service, cwd=str(directory), isolation="copy") as tool:
            result = await execute(tool, {"provider": "spawn", "prompt": "Rewrite the notes"})
    copy = copies / result.run_id
    assert result.render() == (
        f"done\n\nThe subagent worked in a workspace of its own: its changes are in the copy at {copy}: "
        "1 file(s) changed: notes.txt (+1 -1)."
    )
    assert (directory / "notes.txt").read_text() == "the parent's notes\n"
    # A changed copy is kept by `remove`: its changes live nowhere else.
    assert (copy / "notes.txt").read_text() == "the child's notes\n"


async def test_a_background_childs_notice_ends_with_where_its_changes_are(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    base = git(repo, "rev-parse", "HEAD")
    heard: list[Notice] = []
    got_one = anyio.Event()

    def hear(notice: Notice) -> None:
        heard.append(notice)
        got_one.set()

    async with (
        open_service(spawn(writer())) as service,
        SubagentTool(
            service, cwd=str(repo), isolation="worktree", background=BackgroundOptions(), on_notice=hear
        ) as tool,
    ):
        started = await execute(
            tool, {"provider": "spawn", "prompt": "Rewrite the notes", "background": True}
        )
        with anyio.fail_after(WAIT):
            await got_one.wait()
    assert not started.is_error
    [notice] = heard
    branch = f"subagent/{notice.result.run_id}"
    commit = git(repo, "rev-parse", branch)
    assert notice.result.render() == (
        f"done\n\nThe subagent worked in a workspace of its own: its changes are on branch {branch} "
        f"(commit {commit[:12]}, over {base[:12]}): 1 file(s) changed: notes.txt (+1 -1)."
    )
    assert notice.text == (
        f"[background subagent {notice.child.handle} (spawn) completed]\nTask: Rewrite the notes\n\n"
        f"{notice.result.render()}\n[end of background subagent {notice.child.handle}]"
    )
