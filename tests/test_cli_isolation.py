"""Isolated workspaces on the command line: ``subagent run --isolation worktree|copy`` with ``--cleanup``,
``--worktree-root`` and ``--branch-prefix`` (an agent's keys of those names, and ``[isolation]``), what a run
says of its workspace (stderr, ``--json``, the ``end`` event), and ``subagent worktrees`` listing what was
recorded for a repository and recovering what a killed run left behind.

The end-to-end runs are the CLI as a subprocess (its run is ``acp-1``) driving the stub agent through the
real acp provider, in a git repository under ``tmp_path``; the options and the reports are checked in this
process, with the turn replaced by a probe or a result made here.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Final

import pytest

import subagent.cli._commands as commands
from subagent import FileChange, SubagentResult, WorkspaceChange
from subagent.acp.transports import TRANSPORT_SCHEMES
from subagent.cli import main
from subagent.cli._config import ConfigError, load_config
from subagent.cli._console import Console
from subagent.cli._turn import TurnOutcome, TurnSpec
from subagent.cli._views import EventView
from subagent.testing import StubAgentTransport
from tests.gitrepo import branches, git, make_repo, worktrees
from tests.leaks import leaked_processes
from tests.sshd import sshd_or_skip
from tests.test_cli import BOUND, LiveCli, live, run_cli, scenario
from tests.test_cli_budget import root, specs

__all__ = ["live", "root", "specs"]  # the fixtures, used by name

STUB = [sys.executable, "-m", "subagent.testing.stub_agent"]
BASE = "0" * 40
TIP = "1" * 40


# -- options and config ----------------------------------------------------------------------------------


CONFIG = """\
[isolation]
isolation = "copy"
cleanup = "keep"
worktree_root = "trees"
branch_prefix = "team/"

[agents.a]
command = "configured-agent"
isolation = "worktree"

[agents.b]
command = "other-agent"
"""


def test_a_flag_wins_over_the_agents_key_which_wins_over_the_isolation_table(
    root: Path, specs: list[TurnSpec]
) -> None:
    (root / "subagent.toml").write_text(CONFIG)
    assert main(["run", "-p", "hi", "--agent", "a", "--cleanup", "remove-always"]) == 0
    assert (
        main(["run", "-p", "hi", "--agent", "b", "--branch-prefix", "mine/", "--worktree-root", "elsewhere"])
        == 0
    )
    a, b = specs
    assert (a.isolation, a.cleanup, a.worktree_root, a.branch_prefix) == (
        "worktree",
        "remove-always",
        str(root / "trees"),
        "team/",
    )
    assert (b.isolation, b.cleanup, b.worktree_root, b.branch_prefix) == (
        "copy",
        "keep",
        str(root / "elsewhere"),
        "mine/",
    )


def test_a_run_without_isolation_gets_none_and_removes_by_default(root: Path, specs: list[TurnSpec]) -> None:
    assert main(["run", "-p", "hi", "--", "agent-command"]) == 0
    assert main(["run", "-p", "hi", "--isolation", "copy", "--", "agent-command"]) == 0
    plain, copied = specs
    assert (plain.isolation, plain.cleanup, plain.worktree_root, plain.branch_prefix) == (
        None,
        "remove",
        None,
        None,
    )
    assert (copied.isolation, copied.cleanup) == ("copy", "remove")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cleanup", "keep"], "--cleanup: only with --isolation worktree or copy"),
        (
            ["--worktree-root", "trees", "--branch-prefix", "x/"],
            "--worktree-root, --branch-prefix: only with --isolation worktree or copy",
        ),
        (
            ["--isolation", "tree"],
            "argument --isolation: invalid choice: 'tree' (choose from",
        ),
        (
            ["--isolation", "worktree", "--branch-prefix", "my branch/"],
            "argument --branch-prefix: must be the start of a git branch name (no space, control character, "
            "~ ^ : ? * [ \\ or ..), not 'my branch/'",
        ),
        (["--isolation", "worktree", "--worktree-root", ""], "argument --worktree-root: must not be empty"),
    ],
)
def test_a_bad_isolation_flag_is_a_usage_error_with_exit_status_2(
    root: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["run", "-p", "hi", *argv, "--", "agent-command"]) == 2
    assert f"subagent run: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[isolation]\nisolation = "tree"\n',
         "isolation.isolation: must be one of 'worktree', 'copy', not a string ('tree')"),
        ("[isolation]\nmax_tokens = 1\n",
         "isolation.max_tokens: unknown key (known keys: isolation, cleanup, worktree_root, branch_prefix)"),
        ('[isolation]\ncleanup = "never"\n',
         "isolation.cleanup: must be one of 'remove', 'keep', 'remove-always', not a string ('never')"),
        ('[isolation]\nworktree_root = " "\n', "isolation.worktree_root: must not be empty"),
        ("isolation = true\n",
         'isolation: must be a table, e.g. [isolation] isolation = "worktree", not a boolean'),
        ('[agents.a]\ncommand = "x"\nbranch_prefix = "a..b"\n',
         'agents.a.branch_prefix: must be the start of a git branch name, e.g. "agent/"'),
        ('[agents.a]\ncommand = "x"\nisolation = "copies"\n',
         "agents.a.isolation: must be one of 'worktree', 'copy', not 'copies'"),
    ],
)  # fmt: skip
def test_a_bad_isolation_key_in_the_config_is_refused_naming_it(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "subagent.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(raised.value) == f"{path}: {message}"


def test_run_help_documents_the_isolation_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--isolation {worktree,copy}",
        "--cleanup {remove,keep,remove-always}",
        "--worktree-root DIR",
        "--branch-prefix PREFIX",
    ):
        assert flag in text
    assert "The exit status is as without isolation." in text


# -- what a run says of its workspace ----------------------------------------------------------------------


WORKTREE = "/repo/.git/subagent-worktrees/acp-1"
COPY = "/tmp/copies/acp-1"
NOTES = (FileChange("notes.txt", 1, 1),)


def change(**fields: Any) -> WorkspaceChange:
    values: dict[str, Any] = {
        "mode": "worktree",
        "path": WORKTREE,
        "changed": True,
        "files": (FileChange("notes.txt", 1, 1), FileChange("logo.png", None, None)),
        "branch": "subagent/acp-1",
        "base": BASE,
        "commit": TIP,
        "removed": True,
    }
    return WorkspaceChange(**(values | fields))


def report(result: SubagentResult, **spec: Any) -> tuple[int, str]:
    stream = io.StringIO()
    turn = TurnSpec(command=["a"], prompt="p", cwd=".", permission_timeout=1, isolation="worktree", **spec)
    status = commands._report(turn, TurnOutcome(result), Console(stream, color=False))
    return status, stream.getvalue()


CHANGED = (
    "subagent: workspace: its changes are on branch subagent/acp-1 (commit 111111111111, over 000000000000): "
    "2 file(s) changed: notes.txt (+1 -1), logo.png (binary)\n"
)


@pytest.mark.parametrize(
    ("workspace", "cleanup", "said"),
    [
        (change(), "remove",
         CHANGED + "subagent: take them with `git merge subagent/acp-1`, or drop them with `git branch -D "
         "subagent/acp-1`\n"),
        (change(removed=False), "keep",
         CHANGED + f"subagent: its worktree is kept at {WORKTREE} (`git worktree remove {WORKTREE}` when "
         "done)\n"
         "subagent: take them with `git merge subagent/acp-1`, or drop them with `git branch -D "
         "subagent/acp-1`\n"),
        (change(), "remove-always",
         CHANGED.removesuffix("\n") + "; removed, branch and all (--cleanup remove-always)\n"),
        (change(changed=False, files=(), commit=None), "remove",
         "subagent: workspace: it changed no file; its worktree and branch were removed\n"),
        (change(changed=False, files=(), commit=None, removed=False), "keep",
         f"subagent: workspace: it changed no file; its worktree is kept at {WORKTREE} on branch "
         "subagent/acp-1\n"),
        (change(mode="copy", path=COPY, branch=None, base=None, commit=None, removed=False, files=NOTES),
         "remove",
         f"subagent: workspace: its changes are in the copy at {COPY}: 1 file(s) changed: notes.txt "
         "(+1 -1)\n"),
        (change(mode="copy", path=COPY, branch=None, base=None, commit=None, files=NOTES), "remove-always",
         f"subagent: workspace: its changes are in the copy at {COPY}: 1 file(s) changed: notes.txt (+1 -1); "
         "the copy was removed\n"),
    ],
    ids=["removed", "kept", "remove-always", "unchanged", "unchanged-kept", "copy", "copy-removed"],
)  # fmt: skip
def test_the_end_of_an_isolated_run_says_where_its_changes_are_and_how_to_take_them(
    capsys: pytest.CaptureFixture[str], workspace: WorkspaceChange, cleanup: str, said: str
) -> None:
    status, err = report(
        SubagentResult(output="done", stop_reason="completed", workspace=workspace), cleanup=cleanup
    )
    assert status == 0
    assert capsys.readouterr().out == "done\n"
    assert err == said


def test_isolation_leaves_the_exit_status_as_it_was(capsys: pytest.CaptureFixture[str]) -> None:
    status, err = report(SubagentResult(output="", stop_reason="refusal", workspace=change()))
    assert status == 1
    assert err.startswith("subagent: the turn ended with stop reason 'refusal'\n" + CHANGED)


WORKSPACE_JSON = {
    "mode": "worktree",
    "path": "/repo/.git/subagent-worktrees/acp-1",
    "changed": True,
    "branch": "subagent/acp-1",
    "base": BASE,
    "commit": TIP,
    "removed": True,
    "files": [
        {"path": "notes.txt", "added": 1, "deleted": 1},
        {"path": "logo.png", "added": None, "deleted": None},
    ],
}


def test_json_of_an_isolated_run_has_its_workspace_and_of_one_that_never_started_null(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report(SubagentResult(output="done", stop_reason="completed", workspace=change()), json=True)
    assert json.loads(capsys.readouterr().out) == {
        "output": "done",
        "stopReason": "completed",
        "error": None,
        "usage": None,
        "workspace": WORKSPACE_JSON,
    }
    stream = io.StringIO()
    spec = TurnSpec(command=["a"], prompt="p", cwd=".", permission_timeout=1, isolation="copy", json=True)
    failed = TurnOutcome(SubagentResult(output="", stop_reason="error", error="no"), start_error="no")
    assert commands._report(spec, failed, Console(stream, color=False)) == 2
    assert json.loads(capsys.readouterr().out)["workspace"] is None


def test_the_end_event_of_an_isolated_run_carries_its_workspace() -> None:
    stream = io.StringIO()
    EventView(stream).ended(SubagentResult(output="done", stop_reason="completed", workspace=change()), 2.5)
    event = json.loads(stream.getvalue())
    del event["time"]
    assert event == {
        "event": "end",
        "stopReason": "completed",
        "error": None,
        "usage": None,
        "elapsed": 2.5,
        "workspace": WORKSPACE_JSON,
    }


# -- end to end: the stub agent through the acp provider ----------------------------------------------------

REWRITE: Final = {
    "turns": [
        [
            {"step": "write_file", "path": "notes.txt", "content": "the agent's notes\n", "report": False},
            {"step": "message", "text": "I rewrote the notes."},
        ]
    ]
}
"""A turn that rewrites notes.txt (a path relative to the session's cwd: the worktree), then answers."""


def isolated_run(tmp_path: Path, repo: Path, *flags: str) -> Any:
    agent = scenario(tmp_path, REWRITE)
    argv = ["run", "-p", "Rewrite the notes", "--permission", "allow", "--isolation", "worktree", *flags]
    return run_cli(tmp_path, *argv, "--", *agent, cwd=repo)


@pytest.mark.subprocess
def test_an_isolated_run_names_the_branch_and_file_its_changes_are_on_and_leaves_the_tree_untouched(
    tmp_path: Path,
) -> None:
    repo = make_repo(tmp_path / "repo")
    base = git(repo, "rev-parse", "HEAD")
    done = isolated_run(tmp_path, repo)
    assert done.status == 0, done.stderr
    commit = git(repo, "rev-parse", "subagent/acp-1")
    assert done.stdout == "I rewrote the notes.\n"
    assert done.stderr == (
        f"subagent: workspace: its changes are on branch subagent/acp-1 (commit {commit[:12]}, over "
        f"{base[:12]}): 1 file(s) changed: notes.txt (+1 -1)\n"
        "subagent: take them with `git merge subagent/acp-1`, or drop them with "
        "`git branch -D subagent/acp-1`\n"
    )
    assert (repo / "notes.txt").read_text() == "the parent's notes\n"
    assert git(repo, "status", "--porcelain") == ""
    assert git(repo, "show", "subagent/acp-1:notes.txt") == "the agent's notes"
    assert git(repo, "log", "-1", "--format=%s", "subagent/acp-1") == "Rewrite the notes"
    assert worktrees(repo) == [str(repo)]
    assert branches(repo) == ["main", "subagent/acp-1"]


@pytest.mark.subprocess
def test_json_of_an_isolated_run_holds_its_workspace_exactly(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    base = git(repo, "rev-parse", "HEAD")
    done = isolated_run(tmp_path, repo, "--json", "--branch-prefix", "agent/")
    assert done.status == 0, done.stderr
    report = done.json()
    assert (report["output"], report["stopReason"]) == ("I rewrote the notes.", "completed")
    assert report["workspace"] == {
        "mode": "worktree",
        "path": f"{repo}/.git/subagent-worktrees/acp-1",
        "changed": True,
        "branch": "agent/acp-1",
        "base": base,
        "commit": git(repo, "rev-parse", "agent/acp-1"),
        "removed": True,
        "files": [{"path": "notes.txt", "added": 1, "deleted": 1}],
    }


@pytest.mark.subprocess
def test_the_end_event_of_an_isolated_run_carries_its_workspace_and_a_kept_one_is_listed(
    tmp_path: Path,
) -> None:
    repo = make_repo(tmp_path / "repo")
    done = isolated_run(tmp_path, repo, "--events", "--cleanup", "keep")
    assert done.status == 0
    end = done.events()[-1]
    path = f"{repo}/.git/subagent-worktrees/acp-1"
    assert (end["event"], end["workspace"]["removed"], end["workspace"]["path"]) == ("end", False, path)
    assert (Path(path) / "notes.txt").read_text() == "the agent's notes\n"
    listed = run_cli(tmp_path, "worktrees", "--repo", str(repo))
    assert (listed.status, listed.stderr) == (0, "")
    assert listed.stdout == (
        f"workspaces recorded for {repo}:\n"
        "  RUN    MODE      STATE  BRANCH          OWNER  PATH\n"
        f"  acp-1  worktree  kept   subagent/acp-1  -      {path}\n"
        "kept worktrees are yours: take one's work with `git merge BRANCH`, drop it with "
        "`git worktree remove --force PATH && git branch -D BRANCH`\n"
    )
    pruned = run_cli(tmp_path, "worktrees", "--repo", str(repo), "--prune", "--json")
    assert json.loads(pruned.stdout) == {
        "repo": str(repo),
        "workspaces": [
            {
                "runId": "acp-1",
                "mode": "worktree",
                "state": "kept",
                "branch": "subagent/acp-1",
                "path": path,
                "ownerPid": None,
                "recovered": None,
                "commit": None,
            }
        ],
        "recovered": [],  # a kept workspace is the user's: never pruned
    }


@pytest.mark.subprocess
def test_a_run_killed_mid_turn_leaves_an_orphan_that_worktrees_lists_and_prune_recovers_onto_its_branch(
    tmp_path: Path, live: list[LiveCli]
) -> None:
    repo = make_repo(tmp_path / "repo")
    base = git(repo, "rev-parse", "HEAD")
    agent = scenario(
        tmp_path,
        {"turns": [[{"step": "write_file", "path": "found.txt", "content": "written before the kill\n"},
                    {"step": "hang"}]]},
    )  # fmt: skip
    argv = [
        "run",
        "-p",
        "write",
        "--permission",
        "allow",
        "--isolation",
        "worktree",
        "--events",
        "--cwd",
        str(repo),
    ]
    cli = LiveCli(tmp_path, *argv, "--", *agent)
    live.append(cli)
    while "fs/write_text_file" not in json.dumps(cli.wait_for_event("update")):
        pass  # each wait bounded: the write's report is the turn's first update with it
    path = Path(f"{repo}/.git/subagent-worktrees/acp-1")
    assert (path / "found.txt").read_text() == "written before the kill\n"
    os.kill(cli.process.pid, signal.SIGKILL)  # the CLI alone: its agent's supervisor sees it go
    assert cli.process.wait(timeout=BOUND) == -signal.SIGKILL
    deadline = time.monotonic() + BOUND
    while leaked_processes(cli.tag) and time.monotonic() < deadline:
        time.sleep(0.05)  # polled: no event tells of the death of a process that is not our child
    assert cli.finish().status == -signal.SIGKILL  # its pipes closed, and nothing of it left
    pid = cli.process.pid
    width = max(len("OWNER"), len(str(pid)))

    listed = run_cli(tmp_path, "worktrees", "--repo", str(repo))
    assert (listed.status, listed.stderr) == (0, "")
    assert listed.stdout == (
        f"workspaces recorded for {repo}:\n"
        f"  RUN    MODE      STATE     BRANCH          {'OWNER'.ljust(width)}  PATH\n"
        f"  acp-1  worktree  orphaned  subagent/acp-1  {str(pid).ljust(width)}  {path}\n"
        "1 orphaned (their owner is gone): `subagent worktrees --prune` commits a worktree's work on its "
        "branch and removes it\n"
    )
    pruned = run_cli(tmp_path, "worktrees", "--repo", str(repo), "--prune")
    commit = git(repo, "rev-parse", "subagent/acp-1")
    assert (pruned.status, pruned.stderr) == (0, "")
    assert pruned.stdout == (
        f"recovered acp-1 (its owner, pid {pid}, is gone): its work is on branch subagent/acp-1 (commit "
        f"{commit[:12]})\n"
        f"no workspaces recorded for {repo}\n"
    )
    assert git(repo, "show", "subagent/acp-1:found.txt") == "written before the kill"
    assert git(repo, "rev-parse", "subagent/acp-1^") == base
    assert not path.exists()
    assert worktrees(repo) == [str(repo)]
    assert (repo / "notes.txt").read_text() == "the parent's notes\n"
    assert git(repo, "status", "--porcelain") == ""


@pytest.mark.subprocess
def test_worktrees_outside_a_repository_is_a_usage_error_with_exit_status_2(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "worktrees", "--repo", str(tmp_path))
    assert (done.status, done.stdout) == (2, "")
    assert done.stderr == (
        "usage: subagent worktrees [--repo PATH | --copies] [--worktree-root DIR] [--prune] [--json]\n"
        f"subagent worktrees: error: --repo {tmp_path}: {tmp_path} is not in a git repository "
        "(--copies lists the copies --isolation copy made)\n"
    )


@pytest.mark.subprocess
def test_isolating_a_directory_outside_git_in_a_worktree_is_refused_before_any_agent_starts(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "started"
    done = run_cli(
        tmp_path, "run", "-p", "hi", "--isolation", "worktree", "--", "sh", "-c", f"touch {marker}"
    )
    assert (done.status, done.stdout) == (2, "")
    assert done.stderr.endswith(
        f"subagent run: error: --isolation worktree: {tmp_path} is not in a git repository, so it has no "
        "worktree to give the agent (--isolation copy gives it a copy of the directory)\n"
    )
    assert not marker.exists()


@pytest.mark.subprocess
def test_a_changed_copy_of_a_plain_directory_is_kept_and_listed_from_where_it_was_made(
    tmp_path: Path,
) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("the parent's notes\n")
    copies = tmp_path / "copies"
    agent = scenario(tmp_path, REWRITE)
    argv = ["run", "-p", "Rewrite the notes", "--permission", "allow", "--isolation", "copy"]
    done = run_cli(tmp_path, *argv, "--worktree-root", str(copies), "--", *agent, cwd=plain)
    assert (done.status, done.stdout) == (0, "I rewrote the notes.\n")
    assert done.stderr == (
        f"subagent: workspace: its changes are in the copy at {copies}/acp-1: 1 file(s) changed: notes.txt "
        "(+1 -1)\n"
    )
    assert (plain / "notes.txt").read_text() == "the parent's notes\n"
    assert (copies / "acp-1" / "notes.txt").read_text() == "the agent's notes\n"
    listed = run_cli(tmp_path, "worktrees", "--worktree-root", str(copies))
    assert (listed.status, listed.stderr) == (0, "")
    assert listed.stdout == (
        f"workspaces recorded in {copies}:\n"
        "  RUN    MODE  STATE  BRANCH  OWNER  PATH\n"
        f"  acp-1  copy  kept   -       -      {copies}/acp-1\n"
        "kept copies are yours: drop one with `rm -r PATH`\n"
    )


def far_transport(url: str) -> StubAgentTransport:
    """A transport (``far://``) whose agent runs where this host's files are not, with no way to make a
    workspace there."""
    return StubAgentTransport(name=url, local_files=False)


def test_isolating_an_agent_whose_transport_makes_no_workspace_where_it_runs_is_refused_before_it_starts(
    root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(TRANSPORT_SCHEMES, "far", f"{__name__}:far_transport")
    argv = ["run", "-p", "hi", "--on", "far://build-1", "--cwd", "/srv/repo", "--isolation", "worktree"]
    assert main([*argv, "--", "agent-command"]) == 2
    assert capsys.readouterr().err.endswith(
        "subagent run: error: --isolation worktree: an agent on far://build-1 cannot be isolated: its "
        "transport makes no workspace where the agent runs, and this host's files are not there\n"
    )


@pytest.mark.subprocess
def test_an_agent_over_ssh_is_isolated_where_it_runs_so_an_unreachable_host_fails_its_start_there(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sshd_or_skip()  # the ssh client (a missing one fails under SUBAGENT_REQUIRE_SSH)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    on = f"ssh://127.0.0.1:{port}"
    argv = ["run", "-p", "hi", "--on", on, "--cwd", "/srv/repo", "--isolation", "worktree"]
    assert main([*argv, "--", "agent-command"]) == 2
    # Accepted (the workspace is made over ssh, before the agent): the start failed on ssh itself.
    assert capsys.readouterr().err == (
        "subagent: the agent failed to start: agent `agent-command` was not started: ssh to 127.0.0.1 "
        f"failed: ssh: connect to host 127.0.0.1 port {port}: Connection refused\n"
    )


def test_isolating_a_repository_without_a_commit_is_refused_before_any_agent_starts(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    git(root, "init", "-q", "-b", "main")
    marker = root / "started"
    assert main(["run", "-p", "hi", "--isolation", "worktree", "--", "sh", "-c", f"touch {marker}"]) == 2
    assert capsys.readouterr().err.endswith(
        f"subagent run: error: --isolation worktree: the repository at {root} has no commit yet: a worktree "
        "needs one to start from\n"
    )
    assert not marker.exists()
