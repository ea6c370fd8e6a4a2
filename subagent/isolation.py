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
worktrees) names the workspace, its branch and its owner (pid and process start time), in state
``creating``, then ``ready``. A later workspace in the same repository (or ``subagent worktrees
--prune``) finds the records whose owner is gone: a ready workspace's changes are committed on its
branch and its directory removed (an unchanged one loses its branch too); a workspace still being
created is removed whole. What was recovered is logged and listed; ``git worktree prune`` then
agrees with the repository.

Merging back is the parent's choice: :func:`merge`, :func:`diff` and :func:`discard` act on a result's
branch; :func:`merge` refuses a merge with conflicts and names the conflicting paths.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import anyio
import anyio.lowlevel
import anyio.to_thread

from subagent.types import CleanupPolicy, FileChange, IsolationMode, WorkspaceChange

__all__ = [
    "DEFAULT_CHECKOUT_WORKERS",
    "DEFAULT_MAX_COPY_BYTES",
    "IsolationError",
    "IsolationSettings",
    "Leftover",
    "MergeConflictError",
    "Workspace",
    "diff",
    "discard",
    "find_leftovers",
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

GIT_TIMEOUT: Final = 120.0
"""How long one git command may take (a checkout of a large repository included)."""

_RECORDS_DIR: Final = "subagent-worktrees"
"""Where, in a repository's git directory, the worktrees and their records live by default."""

_MAX_NAME_ATTEMPTS: Final = 100
"""How many names (``<run id>``, ``<run id>-2``, ...) a workspace tries before giving up."""

_EMPTY_RECORD_GRACE: Final = 60.0
"""Seconds after which a record claimed but never written is taken for its dead owner's, and removed."""

_SAFE_ID: Final = re.compile(r"[^A-Za-z0-9._-]+")

_COMMIT_IDENTITY: Final = {
    "GIT_AUTHOR_NAME": "subagent",
    "GIT_AUTHOR_EMAIL": "subagent@localhost",
    "GIT_COMMITTER_NAME": "subagent",
    "GIT_COMMITTER_EMAIL": "subagent@localhost",
}
"""Who commits a child's work when the repository names nobody (``user.name`` and ``user.email``)."""


class IsolationError(Exception):
    """A workspace could not be made (not a git repository, a copy too large, git failed), or a helper
    was refused; the message says why."""


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


# -- git ---------------------------------------------------------------------------------------------------


_ADMIN_LOCKS: dict[tuple[object, str], anyio.Lock] = {}
"""One lock per event loop and repository, held by the git commands that add or remove worktrees."""

_TRANSIENT: Final = ("failed to read", "could not lock", "unable to create", "is locked")
"""What git says when another git process was changing the worktree list at the same moment."""

_ADMIN_ATTEMPTS: Final = 5


def _admin_lock(cwd: str | Path) -> anyio.Lock:
    token = anyio.lowlevel.current_token()
    key = (token, os.path.normpath(str(cwd)))
    lock = _ADMIN_LOCKS.get(key)
    if lock is None:
        # Locks of event loops that have ended are dropped (a host runs one loop; tests many).
        for stale in [k for k in _ADMIN_LOCKS if k[0] is not token]:
            del _ADMIN_LOCKS[stale]
        lock = _ADMIN_LOCKS[key] = anyio.Lock()
    return lock


async def _git(cwd: str | Path, *args: str, check: bool = True, env: Mapping[str, str] | None = None) -> str:
    """Run ``git -C cwd args...`` and return its stdout (stripped); IsolationError when it fails.

    Git does not guard its worktree list against concurrent changes (a ``worktree add`` half done makes
    another process's ``branch -D`` fail reading it), so the commands that change it run one at a time
    per repository here, and one that another process's change made fail is tried again."""
    if not (args[0] == "worktree" or args[:2] == ("branch", "-D")):
        return await _git_once(cwd, *args, check=check, env=env)
    async with _admin_lock(cwd):
        for attempt in range(1, _ADMIN_ATTEMPTS + 1):
            try:
                return await _git_once(cwd, *args, check=check, env=env, transient=attempt < _ADMIN_ATTEMPTS)
            except _TransientGitError:
                await anyio.sleep(0.05 * attempt)
    raise AssertionError("unreachable")  # pragma: no cover


class _TransientGitError(Exception):
    pass


async def _git_once(
    cwd: str | Path,
    *args: str,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    transient: bool = False,
) -> str:
    full_env = None if env is None else {**os.environ, **env}
    try:
        with anyio.fail_after(GIT_TIMEOUT):
            done = await anyio.run_process(
                ["git", "-C", str(cwd), *args], check=False, env=full_env, stdin=subprocess.DEVNULL
            )
    except TimeoutError as exc:
        raise IsolationError(f"`git {' '.join(args[:2])}` took more than {GIT_TIMEOUT:g} s") from exc
    except OSError as exc:
        raise IsolationError(f"git cannot be run: {exc}") from exc
    if done.returncode != 0 and transient:
        said = done.stderr.decode(errors="replace")
        if any(sign in said for sign in _TRANSIENT) and "already exists" not in said:
            raise _TransientGitError(said)
    if check and done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip()[-500:]
        raise IsolationError(f"`git {' '.join(args[:2])}` failed (exit {done.returncode}): {said}")
    return done.stdout.decode(errors="replace").strip()


async def _identity_env(cwd: str | Path) -> dict[str, str]:
    """The identity to commit under: the repository's own, else a fallback (a commit must not fail)."""
    email = await _git(cwd, "config", "user.email", check=False)
    name = await _git(cwd, "config", "user.name", check=False)
    return {} if email and name else dict(_COMMIT_IDENTITY)


def _process_start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux: field 22 of /proc/PID/stat), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"  # alive, start time unknown (not Linux)
    return stat.rpartition(")")[2].split()[19]


_OWNER: Final = {"pid": os.getpid(), "start": _process_start_time(os.getpid())}


def _owner_alive(record: Mapping[str, Any]) -> bool:
    pid = record.get("pid")
    if not isinstance(pid, int):
        return False
    start = _process_start_time(pid)
    return start is not None and (start == "?" or start == record.get("start"))


# -- workspaces --------------------------------------------------------------------------------------------


class Workspace:
    """One run's isolated workspace, made by :func:`open_workspace`.

    ``cwd`` is where the child works (the worktree, or the copy; below it when the request's cwd was
    a subdirectory of its repository). :meth:`commit` records a turn's work and says what changed;
    :meth:`close` applies the cleanup policy. Both are idempotent where it matters and never raise for
    a child's doing: a failure is logged and reported in the change.
    """

    def __init__(
        self,
        *,
        mode: IsolationMode,
        run_id: str,
        source: str,
        root: str,
        path: str,
        cwd: str,
        record: Path,
        branch: str | None,
        base: str | None,
        cleanup: CleanupPolicy,
    ) -> None:
        self.mode = mode
        self.run_id = run_id
        self.source = source
        """The repository's top level (worktree) or the directory copied (copy)."""
        self.root = root
        """The workspace's top level: the worktree, or the copy."""
        self.path = path
        self.cwd = cwd
        self.branch = branch
        self.base = base
        self.cleanup = cleanup
        self._record = record
        self._closed = False
        self._last: WorkspaceChange | None = None

    def __repr__(self) -> str:
        return f"<Workspace {self.mode} {self.root!r} branch={self.branch!r}>"

    def map_path(self, path: str) -> str:
        """``path`` (absolute, in the source) as the same place in the workspace; unchanged outside it."""
        try:
            relative = os.path.relpath(os.path.realpath(path), os.path.realpath(self.source))
        except ValueError:
            return path
        if relative == os.curdir:
            return self.root
        if relative.startswith(os.pardir):
            return path
        return os.path.join(self.root, relative)

    async def commit(self, message: str) -> WorkspaceChange:
        """Commit what the child left uncommitted on its branch (``message``: the run's prompt) and say
        what changed since the base (for a copy: against the source)."""
        if self.mode == "copy":
            change = await self._copy_change()
        else:
            change = await self._worktree_change(message)
        self._last = change
        return change

    async def close(self) -> WorkspaceChange | None:
        """Apply the cleanup policy (the last turn's work is committed first); return the final change."""
        if self._closed:
            return self._last
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                change = self._last or await self.commit(f"subagent run {self.run_id}")
                removed = await self._clean_up(change)
                await anyio.to_thread.run_sync(_settle_record, self._record, removed)
                self._last = dataclasses.replace(change, removed=removed)
            except Exception:
                logger.exception(
                    "workspace of run %s: cleaning up failed; `subagent worktrees` lists it", self.run_id
                )
        return self._last

    async def _clean_up(self, change: WorkspaceChange) -> bool:
        """Remove what the policy says; whether the workspace's directory is gone."""
        if self.mode == "copy":
            # A copy's changes live nowhere else: `remove` keeps a changed one.
            removed = self.cleanup == "remove-always" or (self.cleanup == "remove" and not change.changed)
            if removed:
                await anyio.to_thread.run_sync(shutil.rmtree, self.path, True)
            return removed
        if self.cleanup == "keep":
            return False
        await _git(self.source, "worktree", "remove", "--force", self.path, check=False)
        await anyio.to_thread.run_sync(shutil.rmtree, self.path, True)
        if self.branch is not None and (not change.changed or self.cleanup == "remove-always"):
            await _git(self.source, "branch", "-D", self.branch, check=False)
        await _git(self.source, "worktree", "prune", check=False)
        return True

    async def _worktree_change(self, message: str) -> WorkspaceChange:
        assert self.base is not None
        await _git(self.path, "add", "-A")
        if await _git(self.path, "status", "--porcelain"):
            env = await _identity_env(self.path)
            await _git(
                self.path, "commit", "-q", "--no-verify", "-m", _commit_message(message, self.run_id), env=env
            )
        head = await _git(self.path, "rev-parse", "HEAD")
        changed = head != self.base
        numstat = (
            await _git(self.path, "diff", "--no-renames", "--numstat", "-z", self.base, head)
            if changed
            else ""
        )
        return WorkspaceChange(
            mode="worktree",
            path=self.path,
            changed=changed,
            files=_numstat(numstat),
            branch=self.branch,
            base=self.base,
            commit=head if changed else None,
        )

    async def _copy_change(self) -> WorkspaceChange:
        done = await anyio.run_process(
            ["git", "diff", "--no-index", "--no-renames", "--numstat", "-z", self.source, self.root],
            check=False,
        )
        files = _numstat(done.stdout.decode(errors="replace"), strip=(self.source, self.root))
        return WorkspaceChange(mode="copy", path=self.path, changed=bool(files), files=files)


def _commit_message(prompt: str, run_id: str) -> str:
    first = " ".join(prompt.split())[:72] or f"subagent run {run_id}"
    return f"{first}\n\nThe work of subagent run {run_id}, on the prompt:\n\n{prompt[:4000]}"


def _numstat(text: str, strip: tuple[str, ...] = ()) -> tuple[FileChange, ...]:
    """``git diff --numstat -z`` as file changes, by path. An entry is ``added\tdeleted\tpath\0``, or
    (``--no-index``) ``added\tdeleted\t\0old\0new\0``, whose path is the new one (the old one for a
    deletion); ``strip`` takes the directories compared off the front of a path."""
    parts = text.split("\0")
    files: dict[str, FileChange] = {}
    index = 0
    while index < len(parts):
        entry = parts[index]
        index += 1
        if not entry.strip():
            continue
        added, deleted, path = [*entry.split("\t", 2), "", ""][:3]
        if not path:
            old, new = [*parts[index : index + 2], "", ""][:2]
            index += 2
            path = old if new == "/dev/null" else new
        for prefix in strip:
            head = prefix.rstrip("/") + "/"
            if path.startswith(head):
                path = path[len(head) :]
                break
        files[path] = FileChange(
            path=path,
            added=int(added) if added.isdigit() else None,
            deleted=int(deleted) if deleted.isdigit() else None,
        )
    return tuple(files[path] for path in sorted(files))


def _settle_record(record: Path, removed: bool) -> None:
    if removed:
        record.unlink(missing_ok=True)
    else:
        _write_record(record, {**_read_record(record), "state": "kept", "pid": None})


def _read_record(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _write_record(path: Path, record: Mapping[str, Any]) -> None:
    # Written whole, then renamed: a crash leaves the old record or the new one, never half of one.
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record))
    os.replace(temporary, path)


async def open_workspace(
    cwd: str,
    run_id: str,
    mode: IsolationMode,
    *,
    settings: IsolationSettings | None = None,
    cleanup: CleanupPolicy = "remove",
) -> Workspace:
    """Make run ``run_id``'s workspace of ``cwd`` (see the module docstring): a worktree of its
    repository at ``HEAD`` on a new branch, or a copy. Reaps what dead owners left in the same place first.

    Raises:
        IsolationError: ``cwd`` is not in a git repository (worktree), is too large to copy (copy), or
            git failed.
    """
    settings = settings or IsolationSettings()
    safe_id = _SAFE_ID.sub("-", run_id).strip("-.") or "run"
    if mode == "worktree":
        return await _open_worktree(cwd, run_id, safe_id, settings, cleanup)
    return await _open_copy(cwd, run_id, safe_id, settings, cleanup)


async def _repository(cwd: str) -> tuple[str, str]:
    """The top level and the common git directory of the repository ``cwd`` is in."""
    probe = await anyio.run_process(
        ["git", "-C", cwd, "rev-parse", "--show-toplevel", "--git-common-dir"],
        check=False,
        stdin=subprocess.DEVNULL,
    )
    lines = probe.stdout.decode(errors="replace").splitlines()
    if probe.returncode != 0 or len(lines) < 2:
        raise IsolationError(
            f"{cwd} is not in a git repository, so it has no worktree to give a child: use isolation='copy'"
        )
    toplevel, common = lines[:2]
    # --git-common-dir is relative to cwd when it is not absolute.
    return toplevel, os.path.normpath(os.path.join(cwd, common))  # noqa: ASYNC240 (no file system)


async def _open_worktree(
    cwd: str, run_id: str, safe_id: str, settings: IsolationSettings, cleanup: CleanupPolicy
) -> Workspace:
    cwd = await anyio.to_thread.run_sync(os.path.realpath, cwd)
    toplevel, common_dir = await _repository(cwd)
    base = await _git(toplevel, "rev-parse", "--verify", "HEAD^{commit}", check=False)
    if not base:
        raise IsolationError(
            f"the repository at {toplevel} has no commit yet: a worktree needs one to start from"
        )
    records = Path(settings.root) if settings.root is not None else Path(common_dir) / _RECORDS_DIR
    await _reap_once(records, toplevel)
    # Run ids repeat across processes (``spawn-1`` in each): the first free name is claimed, atomically.
    for attempt in range(1, _MAX_NAME_ATTEMPTS + 1):
        name = safe_id if attempt == 1 else f"{safe_id}-{attempt}"
        path = str(records / name)
        branch = settings.branch_prefix + name
        record = records / f"{name}.json"
        details = {
            "mode": "worktree", "repo": toplevel, "path": path, "branch": branch, "base": base, "run": run_id,
        }  # fmt: skip
        if not await anyio.to_thread.run_sync(_claim_record, record, details):
            continue
        try:
            taken = await _git(
                toplevel, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_drop_record, record)
            raise
        if not taken:
            break
        await anyio.to_thread.run_sync(_drop_record, record)  # a kept branch of an earlier run
    else:
        raise IsolationError(f"no free workspace name for run {run_id!r} in {records}")
    try:
        workers = _config_env("checkout.workers", str(settings.checkout_workers))
        await _git(toplevel, "worktree", "add", "--quiet", "-b", branch, path, base, env=workers)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _remove_half_made(toplevel, path, branch, base)
            await anyio.to_thread.run_sync(_drop_record, record)
        raise
    await anyio.to_thread.run_sync(_mark_record, record, "ready")
    real_top = await anyio.to_thread.run_sync(os.path.realpath, toplevel)
    relative = os.path.relpath(cwd, real_top)  # noqa: ASYNC240 (no file system)
    child_cwd = path if relative == os.curdir else os.path.join(path, relative)
    return Workspace(
        mode="worktree", run_id=run_id, source=toplevel, root=path, path=path, cwd=child_cwd, record=record,
        branch=branch, base=base, cleanup=cleanup,
    )  # fmt: skip


async def _open_copy(
    cwd: str, run_id: str, safe_id: str, settings: IsolationSettings, cleanup: CleanupPolicy
) -> Workspace:
    cwd = await anyio.to_thread.run_sync(os.path.realpath, cwd)
    size = await anyio.to_thread.run_sync(_tree_size, cwd, settings.max_copy_bytes)
    if size is None:
        raise IsolationError(f"{cwd} is not a directory to copy")
    if size > settings.max_copy_bytes:
        raise IsolationError(
            f"{cwd} holds more than {settings.max_copy_bytes:,} bytes: too large to copy for a child "
            "(IsolationSettings.max_copy_bytes)"
        )
    records = Path(settings.root) if settings.root is not None else _default_copy_root()
    await _reap_once(records, None)
    for attempt in range(1, _MAX_NAME_ATTEMPTS + 1):
        name = safe_id if attempt == 1 else f"{safe_id}-{attempt}"
        path = str(records / name)
        record = records / f"{name}.json"
        details = {"mode": "copy", "repo": cwd, "path": path, "run": run_id}
        if await anyio.to_thread.run_sync(_claim_record, record, details):
            break
    else:
        raise IsolationError(f"no free workspace name for run {run_id!r} in {records}")
    try:
        await anyio.to_thread.run_sync(_copy_tree, cwd, path)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(shutil.rmtree, path, True)
            await anyio.to_thread.run_sync(_drop_record, record)
        raise
    await anyio.to_thread.run_sync(_mark_record, record, "ready")
    return Workspace(
        mode="copy", run_id=run_id, source=cwd, root=path, path=path, cwd=path, record=record, branch=None,
        base=None, cleanup=cleanup,
    )  # fmt: skip


def _config_env(key: str, value: str) -> dict[str, str]:
    """``git -c key=value`` as environment (git 2.31 on; older ones ignore it), after the caller's own."""
    count = os.environ.get("GIT_CONFIG_COUNT", "0")
    index = int(count) if count.isdigit() else 0
    return {
        "GIT_CONFIG_COUNT": str(index + 1),
        f"GIT_CONFIG_KEY_{index}": key,
        f"GIT_CONFIG_VALUE_{index}": value,
    }


def _claim_record(record: Path, details: Mapping[str, Any]) -> bool:
    """Create ``record`` (state ``creating``) unless it exists or its workspace's directory does; whether
    it was created. Exclusive creation makes the claim atomic between processes."""
    record.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(str(details["path"])):
        return False
    try:
        descriptor = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    os.close(descriptor)
    _write_record(record, {**_OWNER, "state": "creating", **details, "created": time.time()})
    return True


def _mark_record(record: Path, state: str) -> None:
    _write_record(record, {**_read_record(record), "state": state})


def _is_dir(path: str) -> bool:
    return os.path.isdir(path)


def _drop_record(record: Path) -> None:
    record.unlink(missing_ok=True)


def _copy_tree(source: str, target: str) -> None:
    try:
        shutil.copytree(source, target, symlinks=True)
    except shutil.Error as exc:
        raise IsolationError(f"copying {source} failed for {len(exc.args[0])} file(s)") from exc
    except OSError as exc:
        raise IsolationError(f"copying {source} failed: {exc}") from exc


def _default_copy_root() -> Path:
    import tempfile

    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"subagent-copies-{uid}"


def _tree_size(top: str, stop_after: int) -> int | None:
    """The bytes of the regular files below ``top``, counted until past ``stop_after``; None when
    ``top`` is not a directory."""
    if not os.path.isdir(top):
        return None
    total = 0
    for directory, _dirs, names in os.walk(top):
        for name in names:
            try:
                stat = os.lstat(os.path.join(directory, name))
            except OSError:
                continue
            total += stat.st_size
            if total > stop_after:
                return total
    return total


async def _remove_half_made(repo: str, path: str, branch: str | None, base: str | None) -> None:
    """Remove a workspace that was never ready: its directory, and its branch while it is at the base."""
    await _git(repo, "worktree", "remove", "--force", path, check=False)
    await anyio.to_thread.run_sync(shutil.rmtree, path, True)
    await _git(repo, "worktree", "prune", check=False)
    if branch is not None:
        tip = await _git(repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False)
        if tip and tip == base:
            await _git(repo, "branch", "-D", branch, check=False)


# -- leftovers ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Leftover:
    """A workspace found by :func:`find_leftovers`: whose it was, and what became of it.

    ``state``: ``live`` (its owner runs), ``kept`` (kept by its cleanup policy), ``orphaned`` (its owner
    is gone: :func:`reap_leftovers` recovers it). After a reap, ``recovered`` says what was done:
    ``branch`` (its work committed on ``branch``, its directory removed), ``removed`` (nothing to keep).
    """

    run_id: str
    mode: IsolationMode
    path: str
    branch: str | None
    state: Literal["live", "kept", "orphaned"]
    owner_pid: int | None
    recovered: Literal["branch", "removed"] | None = None
    commit: str | None = None


def _records_dirs(repo: str | None, settings: IsolationSettings) -> list[Path]:
    if settings.root is not None:
        return [Path(settings.root)]
    if repo is None:
        return [_default_copy_root()]
    done = subprocess.run(
        ["git", "-C", repo, "rev-parse", "--git-common-dir"],
        capture_output=True,
        text=True,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise IsolationError(f"{repo} is not in a git repository")
    return [Path(os.path.normpath(os.path.join(repo, done.stdout.strip()))) / _RECORDS_DIR]


def _records(directory: Path) -> list[tuple[Path, dict[str, Any]]]:
    if not directory.is_dir():
        return []
    found = []
    for path in sorted(directory.glob("*.json")):
        record = _read_record(path)
        if record:
            found.append((path, record))
        elif _stale(path):
            # Claimed and never written (its owner died in between): nothing was made under it.
            path.unlink(missing_ok=True)
    return found


def _stale(path: Path) -> bool:
    try:
        return time.time() - path.stat().st_mtime > _EMPTY_RECORD_GRACE
    except OSError:
        return False


def _leftover(path: Path, record: Mapping[str, Any]) -> Leftover:
    state: Literal["live", "kept", "orphaned"]
    if record.get("state") == "kept":
        state = "kept"
    elif _owner_alive(record):
        state = "live"
    else:
        state = "orphaned"
    branch = record.get("branch")
    pid = record.get("pid")
    return Leftover(
        run_id=str(record.get("run", path.stem)),
        mode="copy" if record.get("mode") == "copy" else "worktree",
        path=str(record.get("path", "")),
        branch=branch if isinstance(branch, str) else None,
        state=state,
        owner_pid=pid if isinstance(pid, int) else None,
    )


def find_leftovers(repo: str | None = None, settings: IsolationSettings | None = None) -> list[Leftover]:
    """The workspaces recorded for ``repo`` (its git directory's; None: the copies' directory), each with
    whether its owner still runs. Synchronous: it only reads the records.

    Raises:
        IsolationError: ``repo`` is not in a git repository.
    """
    return [
        _leftover(path, record)
        for directory in _records_dirs(repo, settings or IsolationSettings())
        for path, record in _records(directory)
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
        reaped += await _reap_directory(directory)
    return reaped


_REAPED: set[Path] = set()
"""The record directories this process has reaped already: once is enough (its own runs are live)."""
_REAP_LOCK = threading.Lock()


async def _reap_once(directory: Path, repo: str | None) -> None:
    with _REAP_LOCK:
        first = directory not in _REAPED
        _REAPED.add(directory)
    if first:
        await _reap_directory(directory)


async def _reap_directory(directory: Path) -> list[Leftover]:
    reaped: list[Leftover] = []
    repos: set[str] = set()
    for record_path, record in await anyio.to_thread.run_sync(_records, directory):
        if record.get("state") == "kept" or _owner_alive(record):
            continue
        leftover = await _reap(record_path, record)
        reaped.append(leftover)
        if leftover.mode == "worktree":
            repos.add(str(record.get("repo", "")))
    for repo in sorted(repos):
        await _git(repo, "worktree", "prune", check=False)
    for leftover in reaped:
        logger.warning(
            "recovered the workspace of run %s, whose owner (pid %s) is gone: %s",
            leftover.run_id,
            leftover.owner_pid,
            {
                "branch": f"its work is on branch {leftover.branch} ({leftover.commit})",
                "removed": "nothing to keep, removed",
                None: f"kept at {leftover.path}",
            }[leftover.recovered],
        )
    return reaped


async def _reap(record_path: Path, record: Mapping[str, Any]) -> Leftover:
    path = str(record.get("path", ""))
    repo = str(record.get("repo", ""))
    branch = record.get("branch") if isinstance(record.get("branch"), str) else None
    base = record.get("base") if isinstance(record.get("base"), str) else None
    run_id = str(record.get("run", record_path.stem))
    pid = record.get("pid") if isinstance(record.get("pid"), int) else None
    mode: IsolationMode = "copy" if record.get("mode") == "copy" else "worktree"
    ready = record.get("state") == "ready" and await anyio.to_thread.run_sync(_is_dir, path)
    if mode == "copy":
        # A copy's changes live nowhere else: it is kept, and listed, unless it was never ready.
        if not ready:
            await anyio.to_thread.run_sync(shutil.rmtree, path, True)
            await anyio.to_thread.run_sync(_drop_record, record_path)
            return Leftover(run_id, mode, path, None, "orphaned", pid, recovered="removed")
        await anyio.to_thread.run_sync(_settle_record, record_path, False)
        return Leftover(run_id, mode, path, None, "kept", pid)
    if not ready:
        await _remove_half_made(repo, path, branch, base)
        await anyio.to_thread.run_sync(_drop_record, record_path)
        return Leftover(run_id, mode, path, branch, "orphaned", pid, recovered="removed")
    workspace = Workspace(
        mode="worktree", run_id=run_id, source=repo, root=path, path=path, cwd=path, record=record_path,
        branch=branch, base=base, cleanup="remove",
    )  # fmt: skip
    change = await workspace.commit(
        f"subagent: the work of run {run_id}, recovered after its owner (pid {pid}) was gone"
    )
    await workspace.close()
    return Leftover(
        run_id, mode, path, branch, "orphaned", pid,
        recovered="branch" if change.changed else "removed", commit=change.commit,
    )  # fmt: skip


# -- merging back: the parent's choice ---------------------------------------------------------------------


async def diff(repo: str, change: WorkspaceChange) -> str:
    """The child's work as a unified diff against its base commit."""
    _require_branch(change)
    return await _git(repo, "diff", f"{change.base}..{change.branch}")


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
    if (await _git(repo, "status", "--porcelain", "--untracked-files=no")).strip():
        raise IsolationError(
            f"{repo} has uncommitted changes: commit or stash them before merging {change.branch!r}"
        )
    env = await _identity_env(repo)
    args = ["merge", "--no-edit", "--no-verify", "-q", change.branch]
    if message is not None:
        args[1:1] = ["-m", message]
    done = await anyio.run_process(
        ["git", "-C", repo, *args], check=False, env={**os.environ, **env}, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        conflicted = (await _git(repo, "diff", "--name-only", "--diff-filter=U", check=False)).splitlines()
        await _git(repo, "merge", "--abort", check=False)
        if conflicted:
            raise MergeConflictError(change.branch, conflicted)
        said = (done.stderr or done.stdout).decode(errors="replace").strip()[-500:]
        raise IsolationError(f"merging {change.branch!r} failed: {said}")
    return await _git(repo, "rev-parse", "HEAD")


async def discard(repo: str, change: WorkspaceChange) -> None:
    """Delete the child's branch (and its worktree, if it was kept): its work is dropped."""
    _require_branch(change)
    assert change.branch is not None
    kept: bool = await anyio.to_thread.run_sync(_is_dir, change.path) if change.path else False
    if kept:
        await _git(repo, "worktree", "remove", "--force", change.path, check=False)
    await _git(repo, "branch", "-D", change.branch)
    await _git(repo, "worktree", "prune", check=False)


def _require_branch(change: WorkspaceChange) -> None:
    if change.mode != "worktree" or change.branch is None or change.base is None:
        raise IsolationError("this change is not on a branch (a copy's changes stay in its directory)")
