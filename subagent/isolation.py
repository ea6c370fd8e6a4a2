"""Isolated workspaces: each child in its own git worktree (or a copy), its changes handed back as a branch.

A request with ``isolation="worktree"`` runs its child in a git worktree of the request's ``cwd``
repository, made at the repository's ``HEAD`` on a new branch named after the run (``subagent/<run
id>``), by default inside the repository's git directory (``.git/subagent-worktrees/<run id>``, so
nothing appears in the parent's working tree). The child's cwd, and the root of its file-system
sandbox, is the worktree. At the end of each turn what the child left uncommitted is committed on its
branch (the prompt is the message), so nothing is lost, and the result's
:attr:`~subagent.types.SubagentResult.workspace` says the branch, the base commit, the commit and the
files changed. When the run is disposed, the cleanup policy applies: ``remove`` (default) removes the
worktree directory and, when the child changed nothing, its branch; ``keep`` keeps both;
``remove-always`` removes both. Outside a git repository, ``isolation="copy"`` gives the child a plain
copy of its cwd (up to :attr:`IsolationSettings.max_copy_bytes`); its changes stay in the copy, which
``remove`` keeps when the child changed something.

Nothing leaks, even through a crash: before anything is made, a record (``<run id>.json``, beside the
worktrees) names the workspace, its branch and its owner (the host's boot id, the pid and the process's
start time), in state ``creating``, then ``ready``. A later workspace in the same repository (or
``subagent worktrees --prune``) finds the records whose owner is gone: a ready workspace's changes are
committed on its branch and its directory removed (an unchanged one loses its branch too); a workspace
still being created is removed whole. What was recovered is logged and listed; ``git worktree prune``
then agrees with the repository.

The work itself is done by ``subagent._isolation_core``, synchronous and standard library only so that
it also runs where an agent runs: here in worker threads (:func:`local_runner`), elsewhere through a
transport's :data:`CoreRunner` (over ssh, one ``ssh`` per operation; over Ray, a task on the agent's
node). A workspace made elsewhere is owned by the process that asked for it; what this host's dead
processes left there is reaped from here. A start cancelled while its workspace is being made waits for
that (each git command is bounded) and then removes it.

Merging back is the parent's choice: :func:`merge`, :func:`diff` and :func:`discard` act on a result's
branch; :func:`merge` refuses a merge with conflicts and names the conflicting paths.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from subagent import _isolation_core as core
from subagent._isolation_core import IsolationError
from subagent.types import CleanupPolicy, FileChange, IsolationMode, WorkspaceChange

__all__ = [
    "DEFAULT_CHECKOUT_WORKERS",
    "DEFAULT_MAX_COPY_BYTES",
    "CoreRunner",
    "IsolationError",
    "IsolationSettings",
    "Leftover",
    "MergeConflictError",
    "Workspace",
    "diff",
    "discard",
    "find_leftovers",
    "local_runner",
    "merge",
    "open_workspace",
    "reap_leftovers",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_COPY_BYTES: Final = 512 * 1024 * 1024
"""The largest directory ``isolation="copy"`` copies: past it the run is refused (a copy is not free)."""

DEFAULT_CHECKOUT_WORKERS: Final = 8
"""Git's ``checkout.workers`` for a new worktree: measured on a 10,000-file repository (bench/worktree.py),
eight processes wrote it 4 to 10 times faster than one on a 2-core machine, more than sixteen no faster."""

_T = TypeVar("_T")

CoreRunner = Callable[..., Awaitable[Any]]
"""Runs one operation of the workspace core where the workspaces are: called with the operation's name
(a key of ``subagent._isolation_core.OPERATIONS``) and its JSON arguments, it returns the operation's
JSON value, or raises :class:`IsolationError` with the core's message. Each call must be bounded in
time. :func:`local_runner` runs them here; a transport whose agent runs elsewhere offers one that runs
them there (``transport.isolation_runner()``)."""


class MergeConflictError(IsolationError):
    """:func:`merge` found conflicts: nothing was merged. ``paths`` lists the conflicting files."""

    def __init__(self, branch: str, paths: Sequence[str]) -> None:
        super().__init__(f"merging {branch!r} conflicts in {len(paths)} file(s): {', '.join(paths)}")
        self.branch = branch
        self.paths = tuple(paths)


@dataclass(frozen=True, slots=True)
class IsolationSettings:
    """Where a service makes its children's workspaces.

    ``root``: the directory the worktrees (and copies) go in (default: a repository's own git
    directory, ``.git/subagent-worktrees``; for copies, the system's temporary directory).
    ``branch_prefix``: prepended to the run's id to name its branch. ``max_copy_bytes``: the largest
    directory ``copy`` mode copies. ``checkout_workers``: git's parallel checkout for a new worktree.
    """

    root: str | None = None
    branch_prefix: str = "subagent/"
    max_copy_bytes: int = DEFAULT_MAX_COPY_BYTES
    checkout_workers: int = DEFAULT_CHECKOUT_WORKERS
    """Processes git writes a worktree's files with (its ``checkout.workers``; 1: one, git's own
    default). Several are much faster on a large tree: see ``bench/worktree.py``."""

    def __post_init__(self) -> None:
        if (
            not self.branch_prefix
            or any(c in self.branch_prefix for c in " ~^:?*[\\")
            or ".." in self.branch_prefix
        ):
            raise ValueError(
                f"branch_prefix must be a valid start of a git branch name, got {self.branch_prefix!r}"
            )
        if self.checkout_workers < 1:
            raise ValueError(f"checkout_workers must be >= 1, got {self.checkout_workers}")
        if self.max_copy_bytes < 0:
            raise ValueError(f"max_copy_bytes must be >= 0, got {self.max_copy_bytes}")

    def as_json(self) -> dict[str, Any]:
        """The settings as the core takes them (also over ssh)."""
        return dataclasses.asdict(self)


async def _core(function: Callable[..., _T], *args: Any) -> _T:
    """``function(*args)`` of the core in a worker thread, its failure an :class:`IsolationError`.

    Shielded: the core's git commands are each bounded, and one given up half way would leave what it
    was doing (a worktree half checked out, an ``index.lock``) for no one to finish."""
    with anyio.CancelScope(shield=True):
        value = await anyio.to_thread.run_sync(lambda: function(*args))
    return value


def change_from_json(change: Mapping[str, Any]) -> WorkspaceChange:
    """A change as the core says it (a dict) as a :class:`~subagent.types.WorkspaceChange`."""
    return WorkspaceChange(
        mode=change["mode"],
        path=change["path"],
        changed=bool(change["changed"]),
        files=tuple(FileChange(path, added, deleted) for path, added, deleted in change.get("files", ())),
        branch=change.get("branch"),
        base=change.get("base"),
        commit=change.get("commit"),
        removed=bool(change.get("removed", False)),
    )


async def local_runner(operation: str, *args: Any) -> Any:
    """The :data:`CoreRunner` of this host: the core's operation in a worker thread."""
    return await _core(core.OPERATIONS[operation], *args)


class Workspace:
    """One run's isolated workspace, made by :func:`open_workspace`.

    ``cwd`` is where the child works (the worktree, or the copy; below it when the request's cwd was
    a subdirectory of its repository). :meth:`commit` records a turn's work and says what changed;
    :meth:`close` applies the cleanup policy. Both are idempotent where it matters and never raise for
    a child's doing: a failure is logged and reported in the change.
    """

    def __init__(self, data: Mapping[str, Any], runner: CoreRunner | None = None) -> None:
        self._data = dict(data)
        self._runner = runner or local_runner
        self.local = runner is None or runner is local_runner
        """Whether the workspace is on this host (else where its runner runs the core)."""
        self.mode: IsolationMode = data["mode"]
        self.run_id: str = data["run"]
        self.source: str = data["source"]
        """The repository's top level (worktree) or the directory copied (copy)."""
        self.root: str = data["root"]
        """The workspace's top level: the worktree, or the copy."""
        self.path: str = data["path"]
        self.cwd: str = data["cwd"]
        self.branch: str | None = data["branch"]
        self.base: str | None = data["base"]
        self.cleanup: CleanupPolicy = data["cleanup"]
        self._closed = False
        self._last: WorkspaceChange | None = None

    def __repr__(self) -> str:
        return f"<Workspace {self.mode} {self.root!r} branch={self.branch!r}>"

    @property
    def data(self) -> dict[str, Any]:
        """The workspace as the core says it (a JSON object), for a transport that must place the agent
        where it is."""
        return dict(self._data)

    def map_path(self, path: str) -> str:
        """``path`` (absolute, in the source) as the same place in the workspace; unchanged outside it."""
        # A path of another host: only its text is known here.
        return core.map_path(path, self.source, self.root, resolve=self.local)

    async def commit(self, message: str) -> WorkspaceChange:
        """Commit what the child left uncommitted on its branch (``message``: the run's prompt) and say
        what changed since the base (for a copy: against the source). Shielded from cancellation (git
        stopped mid-commit would leave the worktree's index locked); each core call is bounded."""
        self._last = change_from_json(await self._call("commit", self._data, message))
        return self._last

    async def _call(self, operation: str, *args: Any) -> Any:
        with anyio.CancelScope(shield=True):  # see _core: the runner bounds each call
            return await self._runner(operation, *args)

    async def close(self) -> WorkspaceChange | None:
        """Commit what the child did since its last commit (a turn cut short, a job it left running), apply
        the cleanup policy and return the final change."""
        if self._closed:
            return self._last
        self._closed = True
        try:
            self._last = change_from_json(await self._call("close", self._data))
        except Exception:
            logger.exception(
                "workspace of run %s: cleaning up failed; `subagent worktrees` lists it", self.run_id
            )
        return self._last


async def open_workspace(
    cwd: str,
    run_id: str,
    mode: IsolationMode,
    *,
    settings: IsolationSettings | None = None,
    cleanup: CleanupPolicy = "remove",
    runner: CoreRunner | None = None,
) -> Workspace:
    """Make run ``run_id``'s workspace of ``cwd`` (see the module docstring): a worktree of its
    repository at ``HEAD`` on a new branch, or a copy. Reaps what dead owners left in the same place first.

    ``runner``: where (default: here, :func:`local_runner`); a workspace made elsewhere is owned by this
    process all the same, and what this host's dead processes left there is reaped from here.

    Raises:
        IsolationError: ``cwd`` is not in a git repository (worktree), is too large to copy (copy), or
            git failed.
    """
    settings = settings or IsolationSettings()
    call = runner or local_runner
    with anyio.CancelScope(shield=True):  # each call is bounded; what it makes is removed if cancelled
        if call is not local_runner:
            await _reap_from_afar(call, cwd, mode, settings)
        data = await call("open", cwd, run_id, mode, settings.as_json(), cleanup, core.this_owner())
    try:
        await anyio.lowlevel.checkpoint_if_cancelled()
    except BaseException:
        # Cancelled while it was being made: no one would close it.
        with anyio.CancelScope(shield=True):
            await call("discard_unused", data)
        raise
    return Workspace(data, runner)


_REAPED_FROM_AFAR: set[tuple[object, str]] = set()
"""The (runner, records directory) pairs reaped from here already: once per process is enough."""


async def _reap_from_afar(
    runner: CoreRunner, cwd: str, mode: IsolationMode, settings: IsolationSettings
) -> None:
    """Reap what this host's dead processes left where ``runner`` makes workspaces: only this host can
    tell that they are gone, so it names them."""
    # Once per place and process (its own runs there are live): asked by cwd first, which saves a
    # round trip to the host on every later start from the same directory.
    asked = (getattr(runner, "key", runner), f"{mode}:{settings.root}:{cwd}")
    if asked in _REAPED_FROM_AFAR:
        return
    found = await runner("records_for", cwd, mode, settings.as_json())
    _REAPED_FROM_AFAR.add(asked)
    key = (asked[0], str(found["directory"]))
    if key in _REAPED_FROM_AFAR:
        return
    _REAPED_FROM_AFAR.add(key)
    names = [
        record["name"]
        for record in found["records"]
        if record.get("state") != "kept" and core.owner_alive(record) is False
    ]
    if names:
        for leftover in await runner("reap", found["directory"], names):
            logger.warning(
                "%s %s (made from this host, whose owner pid %s is gone), where its agent ran: %s",
                core.RECOVERED,
                leftover["run_id"],
                leftover["owner_pid"],
                leftover["recovered"] or "kept",
            )


# -- leftovers -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Leftover:
    """A workspace found by :func:`find_leftovers`: whose it was, and what became of it.

    ``state``: ``live`` (its owner runs, or is a process of another host), ``kept`` (kept by its
    cleanup policy), ``orphaned`` (its owner is gone: :func:`reap_leftovers` recovers it). After a reap,
    ``recovered`` says what was done: ``branch`` (its work committed on ``branch``, its directory
    removed), ``removed`` (nothing to keep).
    """

    run_id: str
    mode: IsolationMode
    path: str
    branch: str | None
    state: Literal["live", "kept", "orphaned"]
    owner_pid: int | None
    recovered: Literal["branch", "removed"] | None = None
    commit: str | None = None

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Leftover:
        """A leftover as the core says it (a dict)."""
        return cls(
            run_id=value["run_id"],
            mode=value["mode"],
            path=value["path"],
            branch=value.get("branch"),
            state=value["state"],
            owner_pid=value.get("owner_pid"),
            recovered=value.get("recovered"),
            commit=value.get("commit"),
        )


def _records_dirs(repo: str | None, settings: IsolationSettings) -> list[Path]:
    if settings.root is not None:
        return [Path(settings.root)]
    if repo is None:
        return [core.default_copy_root()]
    try:
        _toplevel, common_dir = core.repository(os.path.realpath(repo))
    except IsolationError as exc:
        raise IsolationError(f"{repo} is not in a git repository") from exc
    return [core.records_dir("worktree", common_dir, settings.as_json())]


def find_leftovers(repo: str | None = None, settings: IsolationSettings | None = None) -> list[Leftover]:
    """The workspaces recorded for ``repo`` (its git directory's; None: the copies' directory), each with
    whether its owner still runs. Synchronous: it only reads the records.

    Raises:
        IsolationError: ``repo`` is not in a git repository.
    """
    return [
        Leftover.from_json(found)
        for directory in _records_dirs(repo, settings or IsolationSettings())
        for found in core.list_leftovers(str(directory))
    ]


async def reap_leftovers(
    repo: str | None = None, settings: IsolationSettings | None = None
) -> list[Leftover]:
    """Recover the workspaces whose owner is gone (see the module docstring) and return what was done.

    A ready worktree's uncommitted work is committed on its branch (never lost), its directory removed,
    and its branch deleted only when it holds nothing new; a ready copy is kept (its changes live
    nowhere else) and listed as ``kept``; a workspace that was still being made is removed whole.

    Raises:
        IsolationError: ``repo`` is not in a git repository.
    """
    settings = settings or IsolationSettings()
    directories = await anyio.to_thread.run_sync(_records_dirs, repo, settings)
    reaped: list[Leftover] = []
    for directory in directories:
        found = await _core(core.reap_directory, str(directory))
        reaped += [Leftover.from_json(value) for value in found]
    return reaped


# -- merging back: the parent's choice -----------------------------------------------------------------------


async def diff(repo: str, change: WorkspaceChange) -> str:
    """The child's work as a unified diff against its base commit."""
    _require_branch(change)
    return await _core(core.git, repo, "diff", f"{change.base}..{change.branch}")


async def merge(repo: str, change: WorkspaceChange, *, message: str | None = None) -> str:
    """Merge the child's branch into ``repo``'s current branch (a merge commit, or a fast-forward) and
    return the new ``HEAD``. Refuses, merging nothing, when the working tree has uncommitted changes or
    the merge conflicts.

    Raises:
        MergeConflictError: the merge conflicts (``paths`` names the files); ``repo`` is left as it was.
        IsolationError: no branch to merge, or the working tree is not clean.
    """
    _require_branch(change)
    assert change.branch is not None
    conflicted = await _core(_merge, repo, change.branch, message)
    if conflicted:
        raise MergeConflictError(change.branch, conflicted)
    return await _core(core.git, repo, "rev-parse", "HEAD")


def _merge(repo: str, branch: str, message: str | None) -> list[str]:
    """Merge ``branch`` into ``repo``; the conflicting paths (the merge aborted), else nothing."""
    if core.git(repo, "status", "--porcelain", "--untracked-files=no"):
        raise IsolationError(
            f"{repo} has uncommitted changes: commit or stash them before merging {branch!r}"
        )
    args = ["merge", "--no-edit", "--no-verify", "-q", branch]
    if message is not None:
        args[1:1] = ["-m", message]
    code, out, err = core.run(["git", "-C", repo, *args], core.identity_env(repo))
    if code == 0:
        return []
    conflicted = core.git(repo, "diff", "--name-only", "--diff-filter=U", check=False).splitlines()
    core.git(repo, "merge", "--abort", check=False)
    if conflicted:
        return conflicted
    said = (err or out).decode(errors="replace").strip()[-500:]
    raise IsolationError(f"merging {branch!r} failed: {said}")


async def discard(repo: str, change: WorkspaceChange) -> None:
    """Delete the child's branch (and its worktree, if it was kept): its work is dropped."""
    _require_branch(change)
    assert change.branch is not None
    await _core(_discard, repo, change.path, change.branch)


def _discard(repo: str, path: str, branch: str) -> None:
    if path and os.path.isdir(path):
        core.git(repo, "worktree", "remove", "--force", path, check=False)
    core.git(repo, "branch", "-D", branch)
    core.git(repo, "worktree", "prune", check=False)


def _require_branch(change: WorkspaceChange) -> None:
    if change.mode != "worktree" or change.branch is None or change.base is None:
        raise IsolationError("this change is not on a branch (a copy's changes stay in its directory)")
