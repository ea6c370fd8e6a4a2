"""The workspace layer's core: git worktrees (and copies), their records, and the reaper.

Synchronous and standard library only (Python 3.9 or later), so that the same code runs where an agent
runs over ssh, with nothing of ours installed there: :mod:`subagent.isolation` runs it in worker threads
here, and the ssh transport ships this file's source to the remote ``python3`` (see :func:`main`).
Everything crosses as JSON values: settings, a workspace, a change, a leftover are plain dicts.

A workspace (dict): ``mode``, ``run``, ``source`` (the repository's top level, or the directory
copied), ``root`` and ``path`` (the worktree or copy), ``cwd`` (where the child works), ``record``
(its record's path), ``branch``, ``base``, ``cleanup``. A change (dict): the fields of
:class:`subagent.types.WorkspaceChange`, ``files`` as ``[path, added, deleted]`` lists.

Records: before anything is made, ``<name>.json`` (beside the worktrees) is claimed with an exclusive
create, naming the workspace and its owner (the host's boot id, pid and process start time), in
state ``creating``, then ``ready``; ``kept`` once its cleanup policy kept it. A record whose owner is gone
is an orphan: see :func:`reap_record`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("subagent.isolation")

GIT_TIMEOUT = 120.0
"""How long one git command may take (a checkout of a large repository included)."""

RECORDS_DIR = "subagent-worktrees"
"""Where, in a repository's git directory, the worktrees and their records live by default."""

MAX_NAME_ATTEMPTS = 100
"""How many names (``<run id>``, ``<run id>-2``, ...) a workspace tries before giving up."""

EMPTY_RECORD_GRACE = 60.0
"""Seconds after which a record claimed but never written is taken for its dead owner's, and removed."""

ADMIN_ATTEMPTS = 5
"""Tries of a git command that changes the worktree list, when another process changed it meanwhile."""

_TRANSIENT = ("failed to read", "could not lock", "unable to create", "is locked")
"""What git says when another git process was changing the worktree list at the same moment."""

_SAFE_ID = re.compile(r"[^A-Za-z0-9._-]+")

COMMIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "subagent",
    "GIT_AUTHOR_EMAIL": "subagent@localhost",
    "GIT_COMMITTER_NAME": "subagent",
    "GIT_COMMITTER_EMAIL": "subagent@localhost",
}
"""Who commits a child's work when the repository names nobody (``user.name`` and ``user.email``)."""

Json = dict[str, Any]

RECOVERED = "recovered the workspace of run"
"""How the reaper's warning of each workspace it recovered begins."""


class IsolationError(Exception):
    """A workspace could not be made (not a git repository, a copy too large, git failed), or a helper
    was refused; the message says why."""


# -- processes ---------------------------------------------------------------------------------------------


def run(command: Sequence[str], env: dict[str, str] | None = None) -> tuple[int, bytes, bytes]:
    """Run ``command`` to its end, bounded by :data:`GIT_TIMEOUT`, in a process group of its own that is
    killed whole when it overruns or we are interrupted: git runs helpers of its own (``worktree add``
    a checkout), which would go on changing the repository after the command was given up on."""
    full_env = None if env is None else {**os.environ, **env}
    try:
        process = subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            start_new_session=True,
        )
    except OSError as exc:
        raise IsolationError(f"{command[0]} cannot be run: {exc}") from exc
    try:
        out, err = process.communicate(timeout=GIT_TIMEOUT)
    except BaseException as exc:
        _kill_group(process)
        process.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise IsolationError(f"`{' '.join(command[1:4])}` took more than {GIT_TIMEOUT:g} s") from None
        raise
    return process.returncode, out, err


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


_ADMIN_LOCKS: dict[str, threading.Lock] = {}
_ADMIN_GUARD = threading.Lock()


def _admin_lock(cwd: str) -> threading.Lock:
    with _ADMIN_GUARD:
        return _ADMIN_LOCKS.setdefault(os.path.normpath(cwd), threading.Lock())


def git(cwd: str, *args: str, check: bool = True, env: dict[str, str] | None = None) -> str:
    """``git -C cwd args...``'s stdout, stripped; IsolationError when it fails and ``check``.

    Git does not guard its worktree list against concurrent changes (a ``worktree add`` half done makes
    another process's ``branch -D`` fail reading it), so the commands that change it run one at a time
    per repository in this process, and one that another process's change made fail is tried again."""
    admin = args[0] == "worktree" or tuple(args[:2]) == ("branch", "-D")
    command = ["git", "-C", cwd, *args]
    if not admin:
        code, out, err = run(command, env)
    else:
        with _admin_lock(cwd):
            for attempt in range(1, ADMIN_ATTEMPTS + 1):
                code, out, err = run(command, env)
                said = err.decode(errors="replace")
                transient = any(sign in said for sign in _TRANSIENT) and "already exists" not in said
                if code == 0 or not transient or attempt == ADMIN_ATTEMPTS:
                    break
                time.sleep(0.05 * attempt)
    if check and code != 0:
        said = err.decode(errors="replace").strip()[-500:]
        raise IsolationError(f"`git {' '.join(args[:2])}` failed (exit {code}): {said}")
    return out.decode(errors="replace").strip()


def identity_env(cwd: str) -> dict[str, str]:
    """The identity to commit under: the repository's own, else a fallback (a commit must not fail)."""
    email = git(cwd, "config", "user.email", check=False)
    name = git(cwd, "config", "user.name", check=False)
    return {} if email and name else dict(COMMIT_IDENTITY)


def config_env(key: str, value: str) -> dict[str, str]:
    """``git -c key=value`` as environment (git 2.31 on; older ones ignore it), after the caller's own."""
    count = os.environ.get("GIT_CONFIG_COUNT", "0")
    index = int(count) if count.isdigit() else 0
    return {
        "GIT_CONFIG_COUNT": str(index + 1),
        f"GIT_CONFIG_KEY_{index}": key,
        f"GIT_CONFIG_VALUE_{index}": value,
    }


# -- owners ----------------------------------------------------------------------------------------------


def host_id() -> str:
    """This machine's boot id (a reboot is a new host: no process of before it lives), else its name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def process_start_time(pid: int) -> str | None:
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


def this_owner() -> Json:
    """Who owns the workspaces this process makes."""
    return {"host": host_id(), "pid": os.getpid(), "start": process_start_time(os.getpid())}


def owner_alive(record: Json, host: str | None = None) -> bool | None:
    """Whether a record's owner still runs on ``host`` (default: this one); None when it was another
    host's process, which only that host can tell."""
    if record.get("host", host_id()) != (host or host_id()):
        return None
    pid = record.get("pid")
    if not isinstance(pid, int):
        return False
    start = process_start_time(pid)
    return start is not None and (start == "?" or start == record.get("start"))


# -- records ---------------------------------------------------------------------------------------------


def read_record(path: Path) -> Json:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def write_record(path: Path, record: Json) -> None:
    # Written whole, then renamed: a crash leaves the old record or the new one, never half of one.
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record))
    os.replace(temporary, path)


def claim_record(record: Path, details: Json, owner: Json) -> bool:
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
    write_record(record, {**owner, "state": "creating", **details, "created": time.time()})
    return True


def mark_record(record: Path, state: str) -> None:
    write_record(record, {**read_record(record), "state": state})


def settle_record(record: Path, removed: bool) -> None:
    if removed:
        record.unlink(missing_ok=True)
    else:
        write_record(record, {**read_record(record), "state": "kept", "pid": None})


def records(directory: Path) -> list[tuple[Path, Json]]:
    """The records in ``directory``, by name; one claimed and never written (its owner died in between:
    nothing was made under it) is removed once it is old enough to be sure."""
    if not directory.is_dir():
        return []
    found = []
    for path in sorted(directory.glob("*.json")):
        record = read_record(path)
        if record:
            found.append((path, record))
        elif _stale(path):
            path.unlink(missing_ok=True)
    return found


def _stale(path: Path) -> bool:
    try:
        return time.time() - path.stat().st_mtime > EMPTY_RECORD_GRACE
    except OSError:
        return False


# -- making a workspace --------------------------------------------------------------------------------------


def safe_name(run_id: str) -> str:
    return _SAFE_ID.sub("-", run_id).strip("-.") or "run"


def repository(cwd: str) -> tuple[str, str]:
    """The top level and the common git directory of the repository ``cwd`` is in."""
    code, out, _err = run(["git", "-C", cwd, "rev-parse", "--show-toplevel", "--git-common-dir"])
    lines = out.decode(errors="replace").splitlines()
    if code != 0 or len(lines) < 2:
        raise IsolationError(
            f"{cwd} is not in a git repository, so it has no worktree to give a child: use isolation='copy'"
        )
    # --git-common-dir is relative to cwd when it is not absolute.
    return lines[0], os.path.normpath(os.path.join(cwd, lines[1]))


def default_copy_root() -> Path:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"subagent-copies-{uid}"


def records_dir(mode: str, common_dir: str | None, settings: Json) -> Path:
    root = settings.get("root")
    if root is not None:
        return Path(root)
    if mode == "copy" or common_dir is None:
        return default_copy_root()
    return Path(common_dir) / RECORDS_DIR


def open_workspace(
    cwd: str, run_id: str, mode: str, settings: Json, cleanup: str, owner: Json | None = None
) -> Json:
    """Make run ``run_id``'s workspace of ``cwd``; reaps what dead owners on this host left in the same
    place first (once per process and place). ``owner``: who owns it (default: this process; a
    workspace made over ssh is owned by the process that asked for it, on its own host)."""
    cwd = os.path.realpath(cwd)
    owner = owner if owner is not None else this_owner()
    if mode == "worktree":
        return _open_worktree(cwd, run_id, settings, cleanup, owner)
    return _open_copy(cwd, run_id, settings, cleanup, owner)


def _open_worktree(cwd: str, run_id: str, settings: Json, cleanup: str, owner: Json) -> Json:
    toplevel, common_dir = repository(cwd)
    base = git(toplevel, "rev-parse", "--verify", "HEAD^{commit}", check=False)
    if not base:
        raise IsolationError(
            f"the repository at {toplevel} has no commit yet: a worktree needs one to start from"
        )
    directory = records_dir("worktree", common_dir, settings)
    reap_once(directory)
    # Run ids repeat across processes (``spawn-1`` in each): the first free name is claimed, atomically.
    for attempt in range(1, MAX_NAME_ATTEMPTS + 1):
        name = safe_name(run_id) if attempt == 1 else f"{safe_name(run_id)}-{attempt}"
        path = str(directory / name)
        branch = str(settings.get("branch_prefix", "subagent/")) + name
        record = directory / f"{name}.json"
        details = {
            "mode": "worktree",
            "repo": toplevel,
            "path": path,
            "branch": branch,
            "base": base,
            "run": run_id,
        }
        if not claim_record(record, details, owner):
            continue
        try:
            taken = git(toplevel, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False)
        except BaseException:
            record.unlink(missing_ok=True)
            raise
        if not taken:
            break
        record.unlink(missing_ok=True)  # a kept branch of an earlier run
    else:
        raise IsolationError(f"no free workspace name for run {run_id!r} in {directory}")
    try:
        workers = config_env("checkout.workers", str(settings.get("checkout_workers", 8)))
        git(toplevel, "worktree", "add", "--quiet", "-b", branch, path, base, env=workers)
        mark_record(record, "ready")
    except BaseException:
        remove_half_made(toplevel, path, branch, base)
        record.unlink(missing_ok=True)
        raise
    relative = os.path.relpath(cwd, os.path.realpath(toplevel))
    child_cwd = path if relative == os.curdir else os.path.join(path, relative)
    return {
        "mode": "worktree", "run": run_id, "source": toplevel, "root": path, "path": path, "cwd": child_cwd,
        "record": str(record), "branch": branch, "base": base, "cleanup": cleanup,
    }  # fmt: skip


def _open_copy(cwd: str, run_id: str, settings: Json, cleanup: str, owner: Json) -> Json:
    limit = int(settings.get("max_copy_bytes", 512 * 1024 * 1024))
    size = tree_size(cwd, limit)
    if size is None:
        raise IsolationError(f"{cwd} is not a directory to copy")
    if size > limit:
        raise IsolationError(
            f"{cwd} holds more than {limit:,} bytes: too large to copy for a child "
            "(IsolationSettings.max_copy_bytes)"
        )
    directory = records_dir("copy", None, settings)
    reap_once(directory)
    for attempt in range(1, MAX_NAME_ATTEMPTS + 1):
        name = safe_name(run_id) if attempt == 1 else f"{safe_name(run_id)}-{attempt}"
        path = str(directory / name)
        record = directory / f"{name}.json"
        if claim_record(record, {"mode": "copy", "repo": cwd, "path": path, "run": run_id}, owner):
            break
    else:
        raise IsolationError(f"no free workspace name for run {run_id!r} in {directory}")
    try:
        copy_tree(cwd, path)
        mark_record(record, "ready")
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        record.unlink(missing_ok=True)
        raise
    return {
        "mode": "copy", "run": run_id, "source": cwd, "root": path, "path": path, "cwd": path,
        "record": str(record), "branch": None, "base": None, "cleanup": cleanup,
    }  # fmt: skip


def copy_tree(source: str, target: str) -> None:
    try:
        shutil.copytree(source, target, symlinks=True)
    except shutil.Error as exc:
        raise IsolationError(f"copying {source} failed for {len(exc.args[0])} file(s)") from exc
    except OSError as exc:
        raise IsolationError(f"copying {source} failed: {exc}") from exc


def tree_size(top: str, stop_after: int) -> int | None:
    """The bytes of the regular files below ``top``, counted until past ``stop_after``; None when
    ``top`` is not a directory."""
    if not os.path.isdir(top):
        return None
    total = 0
    for directory, _dirs, names in os.walk(top):
        for name in names:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                continue
            if total > stop_after:
                return total
    return total


def remove_half_made(repo: str, path: str, branch: str | None, base: str | None) -> None:
    """Remove a workspace that was never ready: its directory, and its branch while it is at the base."""
    # A `worktree add` stopped half way leaves its entry locked ("initializing"), which prune spares.
    git(repo, "worktree", "unlock", path, check=False)
    git(repo, "worktree", "remove", "--force", path, check=False)
    shutil.rmtree(path, ignore_errors=True)
    git(repo, "worktree", "prune", check=False)
    if branch is not None:
        tip = git(repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False)
        if tip and tip == base:
            git(repo, "branch", "-D", branch, check=False)


def map_path(path: str, source: str, root: str, *, resolve: bool = True) -> str:
    """``path``, inside ``source``, as the same place in the workspace ``root`` made of it; any other
    path unchanged. ``resolve``: symbolic links resolved first (on the host the paths are on); else only
    the text of the paths is compared (a host's paths read from another)."""
    try:
        if resolve:
            relative = os.path.relpath(os.path.realpath(path), os.path.realpath(source))
        else:
            relative = os.path.relpath(os.path.normpath(path), os.path.normpath(source))
    except ValueError:
        return path
    if relative == os.curdir:
        return root
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        return path
    return os.path.join(root, relative)


def discard_unused(workspace: Json) -> None:
    """Remove a workspace just made that its run will never use (its start was cancelled meanwhile)."""
    if workspace["mode"] == "copy":
        shutil.rmtree(workspace["path"], ignore_errors=True)
    else:
        remove_half_made(workspace["source"], workspace["path"], workspace["branch"], workspace["base"])
    Path(workspace["record"]).unlink(missing_ok=True)


# -- a workspace's work --------------------------------------------------------------------------------------


def commit(workspace: Json, message: str) -> Json:
    """Commit what the child left uncommitted on its branch (``message``: the run's prompt) and say what
    changed since the base (for a copy: against the source)."""
    path = workspace["path"]
    if workspace["mode"] == "copy":
        source, root = workspace["source"], workspace["root"]
        _code, out, _err = run(["git", "diff", "--no-index", "--no-renames", "--numstat", "-z", source, root])
        files = numstat(out.decode(errors="replace"), strip=(source, root))
        return {"mode": "copy", "path": path, "changed": bool(files), "files": files}
    base = workspace["base"]
    git(path, "add", "-A")
    if git(path, "status", "--porcelain"):
        env = identity_env(path)
        git(path, "commit", "-q", "--no-verify", "-m", commit_message(message, workspace["run"]), env=env)
    head = git(path, "rev-parse", "HEAD")
    changed = head != base
    text = git(path, "diff", "--no-renames", "--numstat", "-z", base, head) if changed else ""
    return {
        "mode": "worktree", "path": path, "changed": changed, "files": numstat(text),
        "branch": workspace["branch"], "base": base, "commit": head if changed else None,
    }  # fmt: skip


def close(workspace: Json, message: str | None = None) -> Json:
    """Commit what the child did since its last commit (``message``: the commit's, default a generic
    one), apply the cleanup policy, settle the record; the final change, with ``removed``."""
    if message is None:
        message = f"subagent run {workspace['run']}: the work it left at its end"
    change = commit(workspace, message)
    removed = clean_up(workspace, bool(change["changed"]))
    settle_record(Path(workspace["record"]), removed)
    return {**change, "removed": removed}


def clean_up(workspace: Json, changed: bool) -> bool:
    """Remove what the policy says; whether the workspace's directory is gone."""
    cleanup, path = workspace["cleanup"], workspace["path"]
    if workspace["mode"] == "copy":
        # A copy's changes live nowhere else: `remove` keeps a changed one.
        removed = cleanup == "remove-always" or (cleanup == "remove" and not changed)
        if removed:
            shutil.rmtree(path, ignore_errors=True)
        return removed
    if cleanup == "keep":
        return False
    source = workspace["source"]
    git(source, "worktree", "remove", "--force", path, check=False)
    shutil.rmtree(path, ignore_errors=True)
    if workspace["branch"] is not None and (not changed or cleanup == "remove-always"):
        git(source, "branch", "-D", workspace["branch"], check=False)
    git(source, "worktree", "prune", check=False)
    return True


def commit_message(prompt: str, run_id: str) -> str:
    first = " ".join(prompt.split())[:72] or f"subagent run {run_id}"
    return f"{first}\n\nThe work of subagent run {run_id}, on the prompt:\n\n{prompt[:4000]}"


def numstat(text: str, strip: tuple[str, ...] = ()) -> list[list[Any]]:
    """``git diff --numstat -z`` as ``[path, added, deleted]`` by path (None counts: a binary file). An
    entry is ``added\\tdeleted\\tpath\\0``, or (``--no-index``) ``added\\tdeleted\\t\\0old\\0new\\0``, whose
    path is the new one (the old one for a deletion); ``strip`` takes the directories compared off the
    front of a path."""
    parts = text.split("\0")
    files: dict[str, list[Any]] = {}
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
        files[path] = [
            path,
            int(added) if added.isdigit() else None,
            int(deleted) if deleted.isdigit() else None,
        ]
    return [files[path] for path in sorted(files)]


# -- leftovers ---------------------------------------------------------------------------------------------


def leftover(path: Path, record: Json, alive: bool | None) -> Json:
    """A record as a leftover: ``state`` ``kept``, ``live`` (its owner runs, or is another host's) or
    ``orphaned``."""
    if record.get("state") == "kept":
        state = "kept"
    elif alive is None or alive:
        state = "live"
    else:
        state = "orphaned"
    branch, pid = record.get("branch"), record.get("pid")
    return {
        "run_id": str(record.get("run", path.stem)),
        "mode": "copy" if record.get("mode") == "copy" else "worktree",
        "path": str(record.get("path", "")),
        "branch": branch if isinstance(branch, str) else None,
        "state": state,
        "owner_pid": pid if isinstance(pid, int) else None,
        "recovered": None,
        "commit": None,
    }


def list_leftovers(directory: str, host: str | None = None) -> list[Json]:
    """The workspaces recorded in ``directory``, each with whether its owner (on ``host``) runs."""
    return [leftover(path, record, owner_alive(record, host)) for path, record in records(Path(directory))]


def reap_record(record_path: Path, record: Json) -> Json:
    """Recover one orphan: a ready worktree's work committed on its branch (never lost), its directory
    removed, its branch deleted only when it holds nothing new; a ready copy kept (its changes live
    nowhere else); a workspace still being made removed whole."""
    path, repo = str(record.get("path", "")), str(record.get("repo", ""))
    branch = record.get("branch") if isinstance(record.get("branch"), str) else None
    base = record.get("base") if isinstance(record.get("base"), str) else None
    run_id = str(record.get("run", record_path.stem))
    found = leftover(record_path, record, False)
    ready = record.get("state") == "ready" and os.path.isdir(path)
    if found["mode"] == "copy":
        if not ready:
            shutil.rmtree(path, ignore_errors=True)
            record_path.unlink(missing_ok=True)
            return {**found, "recovered": "removed"}
        settle_record(record_path, False)
        return {**found, "state": "kept"}
    if not ready:
        remove_half_made(repo, path, branch, base)
        record_path.unlink(missing_ok=True)
        return {**found, "recovered": "removed"}
    workspace = {
        "mode": "worktree", "run": run_id, "source": repo, "root": path, "path": path, "cwd": path,
        "record": str(record_path), "branch": branch, "base": base, "cleanup": "remove",
    }  # fmt: skip
    change = close(
        workspace,
        f"subagent: the work of run {run_id}, recovered after its owner (pid {found['owner_pid']}) was gone",
    )
    return {
        **found,
        "recovered": "branch" if change["changed"] else "removed",
        "commit": change.get("commit"),
    }


def reap_directory(directory: str, names: Sequence[str] | None = None, host: str | None = None) -> list[Json]:
    """Recover the orphans recorded in ``directory`` (see :func:`reap_record`): those whose owner on
    ``host`` (default: this one) is gone, or, given ``names``, those records (their owner is known
    gone by the caller: a process of another host). Logs what it did."""
    reaped: list[Json] = []
    repos = set()
    for record_path, record in records(Path(directory)):
        if record.get("state") == "kept":
            continue
        if names is not None:
            if record_path.stem not in names:
                continue
        elif owner_alive(record, host) is not False:
            continue
        found = reap_record(record_path, record)
        reaped.append(found)
        if found["mode"] == "worktree" and record.get("repo"):
            repos.add(str(record["repo"]))
    for repo in sorted(repos):
        git(repo, "worktree", "prune", check=False)
    for found in reaped:
        outcome = {
            "branch": f"its work is on branch {found['branch']} ({found['commit']})",
            "removed": "nothing to keep, removed",
            None: f"kept at {found['path']}",
        }[found["recovered"]]
        logger.warning(
            "%s %s, whose owner (pid %s) is gone: %s",
            RECOVERED,
            found["run_id"],
            found["owner_pid"],
            outcome,
        )
    return reaped


_REAPED: set[str] = set()
"""The record directories this process has reaped already: once is enough (its own runs are live)."""
_REAP_GUARD = threading.Lock()


def reap_once(directory: Path) -> None:
    with _REAP_GUARD:
        first = str(directory) not in _REAPED
        _REAPED.add(str(directory))
    if first:
        reap_directory(str(directory))


def records_for(cwd: str, mode: str, settings: Json) -> Json:
    """Where the workspaces of ``cwd`` are recorded, and the records there (each with its ``name``): for
    a host that made workspaces here from afar, to tell which of its own dead processes left some."""
    common_dir = repository(os.path.realpath(cwd))[1] if mode == "worktree" else None
    directory = records_dir(mode, common_dir, settings)
    found = [{**record, "name": path.stem} for path, record in records(directory)]
    return {"directory": str(directory), "records": found}


# -- remote use ----------------------------------------------------------------------------------------------

OPERATIONS: dict[str, Callable[..., Any]] = {
    "open": open_workspace,
    "commit": commit,
    "close": close,
    "discard_unused": discard_unused,
    "list": list_leftovers,
    "reap": reap_directory,
    "repository": repository,
    "records_for": records_for,
    "host": host_id,
}
"""What :func:`main` runs, by name."""


def main() -> None:
    """Run one operation where the agent runs: a JSON request ``{"op": NAME, "args": [...]}`` on stdin,
    a JSON reply on stdout: ``{"value": ...}``, or ``{"error": MESSAGE}`` (a :class:`IsolationError`)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    request = json.loads(sys.stdin.read())
    try:
        value = OPERATIONS[request["op"]](*request.get("args", ()))
    except IsolationError as exc:
        json.dump({"error": str(exc)}, sys.stdout)
    else:
        json.dump({"value": value}, sys.stdout)


if __name__ == "__main__":
    main()
