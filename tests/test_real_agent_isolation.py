"""A real agent in an isolated workspace: Claude Code, through ``claude-agent-acp``, run by the ACP provider
with ``isolation="worktree"``, offline against the scripted Anthropic Messages server (see
`tests.test_real_agents` for the agent's environment and the skip rules).

The fake model writes ``hello.txt`` with Claude Code's ``Write`` tool in the directory Claude Code tells it
it works in (its system prompt's ``Primary working directory``): that is the run's worktree, so the write
lands there, is committed on the run's branch at the end of the turn, and the parent's working tree never
sees it. Claude Code writes files itself (not through the client's file system), so only the cwd the
session was given keeps it in the worktree: the tests show that it is given the worktree.

Where the worktree is matters to Claude Code (``claude-agent-acp`` 0.101.0, as observed here): the default
place, inside the repository's git directory (``.git/subagent-worktrees/<run id>``), is a protected path
to it. At its asking mode it asks before such a write, as before any (the provider's policy answers); at
its start mode, ``auto``, which writes in its working directory without asking, it puts each write there
to its security classifier first (an extra model call, ``claude-sonnet-5``, "a security monitor for
autonomous AI coding agents"), and blocks the write when the classifier gives no verdict, as the fake
model's does not. A worktree outside the git directory (``IsolationSettings(root=...)``) is written at
``auto`` without that call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import pytest

from subagent import SubagentRequest, SubagentResult, SubagentService
from subagent.acp.handlers import PermissionQuestion
from subagent.isolation import IsolationSettings
from subagent.providers.acp import AcpProvider
from subagent.testing import MessagesReply, MessagesRequest, ToolUse, serve_anthropic_messages
from subagent.types import FileChange, WorkspaceChange
from tests.gitrepo import ORIGINAL, git, make_repo
from tests.leaks import LEAK_TAG_VARIABLE, assert_no_leaks
from tests.test_real_agents import (
    CLAUDE_ACP_SCRIPT,
    CONTENT,
    NOT_WRITTEN,
    PREAMBLE,
    SIDE_CALL,
    WRITTEN,
    claude_env,
    require,
)

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess, pytest.mark.real_agent]

TURN_BOUND: Final = 90.0  # seconds for the agent's start and turn: a hang guard on a loaded machine
WORKING_DIRECTORY: Final = re.compile(r"Primary working directory: (/[^\n\"\\]+)")
CLASSIFIER: Final = "You are a security monitor for autonomous AI coding agents."
"""How Claude Code's security classifier's system prompt begins (its auto mode's check of an action)."""
BLOCKED: Final = "Auto mode could not evaluate this action and is blocking it for safety"


@pytest.fixture
def anyio_backend() -> str:
    """One backend: what is under test is the agent's process and the workspace; both backends are covered
    with the stub agent (`tests.test_acp_isolation`)."""
    return "asyncio"


@pytest.fixture
def repo(tmp_path: Path, no_machine_git_config: None) -> Path:
    """A repository with one commit holding ``notes.txt`` (`ORIGINAL`)."""
    return make_repo(tmp_path / "repo")


@dataclass
class WriteLog:
    """What the fake model saw: the working directories it was told at the turn's start, the tool results,
    and how many of Claude Code's security classifier's calls it answered."""

    working_directories: list[list[str]] = field(default_factory=list)
    tool_results: list[Any] = field(default_factory=list)
    classifier_calls: int = 0


def after_the_turn(request: MessagesRequest) -> bool:
    """Whether the model's closing answer is in ``request``: a call of Claude Code's own after the turn (a
    prompt suggestion), with tools, which must not start the turn again."""
    return any(
        isinstance(message, dict)
        and message.get("role") == "assistant"
        and any(text in str(message.get("content")) for text in (WRITTEN, NOT_WRITTEN))
        for message in request.messages
    )


async def run_claude(
    repo: Path, home: Path, log: WriteLog, **provider_options: Any
) -> tuple[SubagentResult, str]:
    """One isolated turn of Claude Code whose model writes ``hello.txt`` in the directory it was told it
    works in; the result and the run's id, once the run is disposed."""
    command = require(CLAUDE_ACP_SCRIPT)
    written_in: list[Path] = []

    def respond(request: MessagesRequest) -> MessagesReply:
        if CLASSIFIER in request.text():
            log.classifier_calls += 1
            return MessagesReply(text=SIDE_CALL)  # no verdict
        if not request.tool_names or after_the_turn(request):
            return MessagesReply(text=SIDE_CALL)
        if results := request.tool_results:
            log.tool_results += [result.get("content") for result in results]
            return MessagesReply(text=WRITTEN if (written_in[0] / "hello.txt").exists() else NOT_WRITTEN)
        told = sorted(set(WORKING_DIRECTORY.findall(request.text())))
        log.working_directories.append(told)
        written_in.append(Path(told[0]))
        write = {"file_path": f"{told[0]}/hello.txt", "content": CONTENT}
        return MessagesReply(text=PREAMBLE, tool_uses=[ToolUse("toolu_stub_1", "Write", write)])

    async with (
        assert_no_leaks() as tag,
        serve_anthropic_messages(respond) as server,
        SubagentService() as service,
    ):
        env = {**claude_env(home, server.base_url), LEAK_TAG_VARIABLE: tag}
        provider = AcpProvider(command, env=env, cwd=repo, **provider_options)
        service.register_provider(provider)
        request = SubagentRequest(prompt="Write hello.txt.", isolation="worktree")
        async with service.start(provider.name, request) as run:
            with anyio.fail_after(TURN_BOUND):
                result = await run.result()
    assert set(server.tunnels) <= {f"127.0.0.1:{server.port}"}, server.tunnels
    return result, run.id


def assert_parent_untouched(repo: Path, head: str) -> None:
    """The parent's tree never saw the write, and the worktree is gone (its work stays on the branch)."""
    assert git(repo, "status", "--porcelain") == ""
    assert sorted(path.name for path in repo.iterdir()) == [".git", "notes.txt"]
    assert (repo / "notes.txt").read_text() == ORIGINAL
    assert git(repo, "rev-parse", "HEAD") == head
    listing = git(repo, "worktree", "list", "--porcelain").splitlines()
    assert [line for line in listing if line.startswith("worktree ")] == [f"worktree {repo}"]


def assert_written_on_branch(
    repo: Path, result: SubagentResult, worktree: Path, branch: str, head: str
) -> None:
    assert (result.stop_reason, result.error, result.output) == ("completed", None, WRITTEN)
    assert result.workspace == WorkspaceChange(
        mode="worktree",
        path=str(worktree),
        changed=True,
        files=(FileChange("hello.txt", 1, 0),),
        branch=branch,
        base=head,
        commit=git(repo, "rev-parse", branch),
    )
    assert result.workspace.describe().startswith(f"its changes are on branch {branch} ")
    assert git(repo, "show", f"{branch}:hello.txt") == CONTENT.rstrip("\n")
    assert git(repo, "rev-parse", f"{branch}^") == head


async def test_claude_agent_acp_writes_in_its_worktree_and_the_result_names_the_branch_and_the_file(
    repo: Path, tmp_path: Path
) -> None:
    head = git(repo, "rev-parse", "HEAD")
    questions: list[PermissionQuestion] = []

    async def allow(question: PermissionQuestion) -> str | None:
        questions.append(question)
        option = question.first_option("allow_once")
        return None if option is None else option.option_id

    log = WriteLog()
    # Its asking mode: the write inside the repository's git directory is put to our policy, which allows.
    result, run_id = await run_claude(repo, tmp_path / "home", log, permission=allow, mode="default")

    worktree = repo / ".git" / "subagent-worktrees" / run_id
    assert log.working_directories == [[str(worktree)]]  # Claude Code was told it works in the worktree
    assert [(question.kind, question.raw_input["file_path"]) for question in questions] == [
        ("edit", str(worktree / "hello.txt"))
    ]
    assert log.classifier_calls == 0
    assert_written_on_branch(repo, result, worktree, f"subagent/{run_id}", head)
    assert_parent_untouched(repo, head)


@pytest.mark.parametrize("inside_git_dir", [True, False], ids=["default-root-in-.git", "root-outside-.git"])
async def test_at_auto_mode_claude_code_puts_a_write_in_a_worktree_inside_dot_git_to_its_classifier(
    repo: Path, tmp_path: Path, inside_git_dir: bool
) -> None:
    head = git(repo, "rev-parse", "HEAD")
    root = repo / ".git" / "subagent-worktrees" if inside_git_dir else tmp_path / "worktrees"
    settings = None if inside_git_dir else IsolationSettings(root=str(tmp_path / "worktrees"))
    log = WriteLog()
    result, run_id = await run_claude(repo, tmp_path / "home", log, permission="allow", isolation=settings)

    worktree, branch = root / run_id, f"subagent/{run_id}"
    assert log.working_directories == [[str(worktree)]]
    if inside_git_dir:
        # Blocked: its classifier was asked (more than once) and gave no verdict; nothing changed.
        assert log.classifier_calls >= 1
        (told_model,) = log.tool_results
        assert told_model.startswith(BLOCKED)
        assert (result.stop_reason, result.output) == ("completed", NOT_WRITTEN)
        assert result.workspace == WorkspaceChange(
            mode="worktree", path=str(worktree), changed=False, branch=branch, base=head
        )
        assert git(repo, "branch", "--format=%(refname:short)") == "main"
    else:
        assert log.classifier_calls == 0
        assert_written_on_branch(repo, result, worktree, branch, head)
    assert not worktree.exists()
    assert_parent_untouched(repo, head)
