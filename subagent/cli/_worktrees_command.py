"""``subagent worktrees``: the isolated workspaces recorded for a repository, and the reaping of orphans.

Every workspace ``subagent run --isolation`` (or any host of :mod:`subagent.isolation`) makes is
recorded beside it, with its owner's pid. This lists them (:func:`~subagent.isolation.find_leftovers`):
``live`` (its owner runs), ``kept`` (its cleanup policy kept it: the user's to merge or drop, with git)
and ``orphaned`` (its owner is gone: killed mid-run). ``--prune`` recovers the orphans
(:func:`~subagent.isolation.reap_leftovers`): a worktree's work is committed on its branch and its
directory removed (an unchanged one loses its branch too), and says what became of each. Kept
workspaces are never pruned: the output says how to drop one.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
from collections.abc import Sequence
from typing import Any, Final

import anyio

from subagent import _isolation_core as isolation_core
from subagent._isolation_core import RECOVERED
from subagent.cli._config import find_config, load_config
from subagent.cli._console import print_json, print_stdout
from subagent.cli._exits import PROG, Command, Parser, UsageError
from subagent.isolation import IsolationError, IsolationSettings, Leftover, find_leftovers, reap_leftovers

__all__ = ["WORKTREES_COMMAND"]

_DESCRIPTION: Final = """\
List the isolated workspaces (`subagent run --isolation`) recorded for a repository: each one's run,
mode, state, branch, owner pid and path. A workspace is live while its owner runs, kept when its
cleanup policy kept it (--cleanup keep, or a changed copy), orphaned when its owner is gone (killed
mid-run). --prune recovers the orphans: a worktree's work is committed on its branch (nothing is lost)
and its directory removed; one that changed nothing loses its branch too. Kept workspaces are yours to
merge or drop with git: they are never pruned.
"""


def _add_arguments(parser: Parser) -> None:
    parser.add_argument(
        "--repo", metavar="PATH", help="the repository (or a directory in it; default: the current directory)"
    )
    parser.add_argument(
        "--worktree-root",
        metavar="DIR",
        help="where the workspaces were made, when not the default (default: the config's "
        "[isolation] worktree_root, else the repository's .git/subagent-worktrees)",
    )
    parser.add_argument(
        "--copies",
        action="store_true",
        help="list the copies --isolation copy made (of any directory, in the system's temporary directory) "
        "instead of a repository's worktrees",
    )
    parser.add_argument("--config", metavar="PATH", help="the config file whose [isolation] table to read")
    parser.add_argument(
        "--prune", action="store_true", help="recover the orphaned workspaces, and say what became of each"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _worktrees_command(args: argparse.Namespace, command: list[str] | None) -> int:
    if command is not None:
        raise UsageError("worktrees takes no `-- COMMAND`")
    if args.copies and args.repo is not None:
        raise UsageError("--copies lists the copies of every directory: give it no --repo")
    root = _root(args)
    top: str | None = None
    if not args.copies:
        repo = os.path.abspath(args.repo if args.repo is not None else os.getcwd())
        if not os.path.isdir(repo):
            raise UsageError(f"--repo: {args.repo!r} is not a directory")
        top = _toplevel(repo)
        if top is None and root is None:
            where = f"--repo {args.repo}" if args.repo is not None else "the current directory"
            raise UsageError(
                f"{where}: {repo} is not in a git repository "
                "(--copies lists the copies --isolation copy made)"
            )
    settings = IsolationSettings(root=root)
    try:
        recovered = _prune(top, settings) if args.prune else None
        workspaces = find_leftovers(top, settings)
    except IsolationError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print_json(
            {
                "repo": top,
                "workspaces": [_leftover_json(leftover) for leftover in workspaces],
                "recovered": None if recovered is None else [_leftover_json(one) for one in recovered],
            }
        )
        return 0
    where = (
        f"recorded for {top}"
        if top is not None
        else f"recorded in {root}"
        if root is not None
        else "made by --isolation copy"
    )
    print_stdout("".join(line + "\n" for line in _listing(where, workspaces, recovered)))
    return 0


def _prune(top: str | None, settings: IsolationSettings) -> list[Leftover]:
    """Reap the orphans; each is said on stdout, so the layer's own warning of it is not repeated."""
    isolation_log = logging.getLogger(reap_leftovers.__module__)
    said_below = _SaidBelow()
    isolation_log.addFilter(said_below)
    try:
        return anyio.run(reap_leftovers, top, settings)
    finally:
        isolation_log.removeFilter(said_below)


class _SaidBelow(logging.Filter):
    """Drops the reaper's warning of each workspace it recovered (the listing says it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and record.getMessage().startswith(RECOVERED))


def _root(args: argparse.Namespace) -> str | None:
    """The workspaces' directory: ``--worktree-root``, else the config's ``[isolation]`` one, else None."""
    given: str | None = args.worktree_root
    if given is not None:
        return os.path.abspath(os.path.expanduser(given))
    path = find_config(args.config)
    if path is None:
        return None
    root: str | None = load_config(path).isolation.get("worktree_root")
    return root


def _toplevel(directory: str) -> str | None:
    """The top level of the repository ``directory`` is in, as the workspace layer finds it (None: none)."""
    try:
        return isolation_core.repository(directory)[0]
    except IsolationError:
        return None


def _leftover_json(leftover: Leftover) -> dict[str, Any]:
    return {
        "runId": leftover.run_id,
        "mode": leftover.mode,
        "state": leftover.state,
        "branch": leftover.branch,
        "path": leftover.path,
        "ownerPid": leftover.owner_pid,
        "recovered": leftover.recovered,
        "commit": leftover.commit,
    }


def _listing(where: str, workspaces: Sequence[Leftover], recovered: Sequence[Leftover] | None) -> list[str]:
    lines = [
        f"recovered {leftover.run_id} (its owner, pid {leftover.owner_pid}, is gone): {_fate(leftover)}"
        for leftover in recovered or ()
    ]
    if recovered == []:
        lines.append("no orphaned workspace to recover")
    if not workspaces:
        lines.append(f"no workspaces {where}")
        return lines
    rows = [("RUN", "MODE", "STATE", "BRANCH", "OWNER", "PATH")] + [
        (
            leftover.run_id,
            leftover.mode,
            leftover.state,
            leftover.branch or "-",
            str(leftover.owner_pid) if leftover.owner_pid is not None else "-",
            leftover.path,
        )
        for leftover in workspaces
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(5)]
    lines.append(f"workspaces {where}:")
    lines += [
        "  "
        + "  ".join(cell.ljust(width) for cell, width in zip(row[:5], widths, strict=True))
        + "  "
        + row[5]
        for row in rows
    ]
    orphans = sum(leftover.state == "orphaned" for leftover in workspaces)
    if orphans:
        lines.append(
            f"{orphans} orphaned (their owner is gone): `{PROG} worktrees --prune` commits a worktree's work "
            "on its branch and removes it"
        )
    kept = [leftover for leftover in workspaces if leftover.state == "kept"]
    if any(leftover.mode == "worktree" for leftover in kept):
        lines.append(
            "kept worktrees are yours: take one's work with `git merge BRANCH`, drop it with "
            "`git worktree remove --force PATH && git branch -D BRANCH`"
        )
    if any(leftover.mode == "copy" for leftover in kept):
        lines.append("kept copies are yours: drop one with `rm -r PATH`")
    return lines


def _fate(leftover: Leftover) -> str:
    if leftover.recovered == "branch":
        return f"its work is on branch {leftover.branch} (commit {(leftover.commit or '?')[:12]})"
    if leftover.recovered == "removed":
        return "nothing to keep: removed" + (
            f", with its branch {leftover.branch}" if leftover.branch else ""
        )
    return f"a copy, kept at {shlex.quote(leftover.path)}"


WORKTREES_COMMAND: Final = Command(
    help="list the isolated workspaces recorded for a repository; --prune recovers orphaned ones",
    description=_DESCRIPTION,
    add_arguments=_add_arguments,
    run=_worktrees_command,
    usage=f"{PROG} worktrees [--repo PATH | --copies] [--worktree-root DIR] [--prune] [--json]",
)
