"""Throwaway git repositories for the isolation tests: made, read and asserted on with the same helpers."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import pytest

ORIGINAL: Final = "the parent's notes\n"
"""What ``notes.txt`` holds in a repository `make_repo` made."""


@pytest.fixture
def no_machine_git_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """git (the tests' and the workspace layer's) reads no configuration but the repository's: the
    machine's own identity or hooks change nothing."""
    empty = tmp_path / "gitconfig"
    empty.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(empty))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def git(repo: Path, *args: str) -> str:
    """``git -C repo args...``'s stdout, stripped, committing as a test identity."""
    done = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=Test", "-c", "user.email=test@example.com", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def make_repo(path: Path, files: Mapping[str, str] | None = None) -> Path:
    """A repository at ``path`` with one commit holding ``files`` (default: ``notes.txt``, `ORIGINAL`)."""
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    for name, text in (files or {"notes.txt": ORIGINAL}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "initial")
    return path


def branches(repo: Path) -> list[str]:
    """The repository's branches, by name."""
    return git(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/").splitlines()


def worktrees(repo: Path) -> list[str]:
    """The worktrees git knows of (``git worktree list``), by path."""
    listing = git(repo, "worktree", "list", "--porcelain").splitlines()
    return [line.removeprefix("worktree ") for line in listing if line.startswith("worktree ")]


def records_dir(repo: Path) -> Path:
    """Where the workspace layer keeps a repository's worktrees and their records by default."""
    return repo / ".git" / "subagent-worktrees"


def assert_parent_untouched(repo: Path, head: str) -> None:
    """The parent's checkout is as `make_repo` left it: a clean status, ``notes.txt`` as it was, ``head``."""
    assert git(repo, "status", "--porcelain") == ""
    assert (repo / "notes.txt").read_text() == ORIGINAL
    assert git(repo, "rev-parse", "HEAD") == head
