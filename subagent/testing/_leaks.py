"""Assert that a test left no child process and no file descriptor behind (Linux only: reads ``/proc``).

Public test support for anyone who writes a provider or spawns agents: the same checker the project's
own tests and `subagent.testing.contract` use.

Use ``async with assert_no_leaks():`` around the code that spawns. On exit it checks that

- this process has as many open file descriptors as on entry,
- no descendant of this process is alive, and no child of ours is an unreaped zombie,
- no live process carries the environment tag set while the block ran. A grandchild orphaned by its parent
  is re-parented to init and is no longer our descendant; it still inherits the tag, which finds it.

A zombie whose parent is not us is dead: reaping it is its parent's job (often init, which in some containers
never reaps), so `process_is_gone` and the checks here count it as gone, never as a leak.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio

__all__ = [
    "LEAK_TAG_VARIABLE",
    "ProcessInfo",
    "assert_no_leaks",
    "assert_same_fds",
    "leak_tag",
    "leaked_processes",
    "live_group_members",
    "open_fd_count",
    "open_fds",
    "process_info",
    "process_is_gone",
]

LEAK_TAG_VARIABLE = "SUBAGENT_TEST_LEAK_TAG"
"""Environment variable that `assert_no_leaks` sets; every process spawned inside the block inherits it."""


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """One line of ``/proc/<pid>/stat``, the fields that matter here."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int

    @property
    def is_zombie(self) -> bool:
        """Exited but not yet reaped by its parent."""
        return self.state in ("Z", "X")


def open_fds() -> dict[int, str]:
    """This process's open file descriptors, each with its target: ``pipe:[…]``, a path, ``anon_inode:…``."""
    fds = {}
    with os.scandir("/proc/self/fd") as entries:
        for entry in entries:
            # The descriptor scandir itself reads the directory with is closed by now: readlink fails on it.
            with contextlib.suppress(FileNotFoundError):
                fds[int(entry.name)] = os.readlink(entry.path)
    return fds


def open_fd_count() -> int:
    """How many file descriptors this process has open."""
    return len(open_fds())


def process_info(pid: int) -> ProcessInfo | None:
    """The process ``pid`` as ``/proc`` shows it, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces or parentheses, so split around the last ")".
    head, _, rest = stat.rpartition(")")
    fields = rest.split()
    return ProcessInfo(
        pid=pid, comm=head.partition("(")[2], state=fields[0], ppid=int(fields[1]), pgrp=int(fields[2])
    )


def _all_processes() -> list[ProcessInfo]:
    with os.scandir("/proc") as entries:
        pids = [int(entry.name) for entry in entries if entry.name.isdigit()]
    return [info for pid in pids if (info := process_info(pid)) is not None]


def _carries_tag(pid: int, tag: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ_file:
            environ = environ_file.read()
    except OSError:
        return False  # Gone, or another user's process.
    return f"{LEAK_TAG_VARIABLE}={tag}".encode() in environ.split(b"\0")


def process_is_gone(pid: int) -> bool:
    """Whether ``pid`` is no longer running: no such process, or a zombie that is not ours to reap."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    info = process_info(pid)
    return info is None or (info.is_zombie and info.ppid != os.getpid())


def live_group_members(pgid: int) -> list[ProcessInfo]:
    """The processes in process group ``pgid`` that are still running (zombies excluded)."""
    return [info for info in _all_processes() if info.pgrp == pgid and not info.is_zombie]


def leaked_processes(tag: str | None = None) -> list[ProcessInfo]:
    """Running descendants of this process, our unreaped zombie children, and running processes tagged."""
    me = os.getpid()
    processes = _all_processes()
    children: dict[int, list[ProcessInfo]] = {}
    for info in processes:
        children.setdefault(info.ppid, []).append(info)
    leaked: dict[int, ProcessInfo] = {}
    pending = list(children.get(me, []))
    while pending:
        info = pending.pop()
        # A zombie child of ours was never reaped: a leak. A zombie grandchild is its parent's business.
        if not info.is_zombie or info.ppid == me:
            leaked[info.pid] = info
        pending.extend(children.get(info.pid, []))
    if tag is not None:
        for info in processes:
            if not info.is_zombie and info.pid != me and _carries_tag(info.pid, tag):
                leaked[info.pid] = info
    return sorted(leaked.values(), key=lambda info: info.pid)


async def _warm_up_subprocess_machinery() -> None:
    # Backends may open file descriptors lazily the first time a subprocess is spawned (none do today on
    # Linux with Python 3.11: asyncio's threaded child watcher and trio's spawn thread hold no descriptor, and
    # trio's per-child pidfd is closed when the child is reaped). Spawning one short-lived process before
    # measuring keeps any such one-off descriptor out of the count, so the check stays exact, not tolerant.
    program = shutil.which("true")
    await anyio.run_process([program] if program else [sys.executable, "-c", ""])


@contextlib.contextmanager
def leak_tag() -> Iterator[str]:
    """A fresh leak tag, set as `LEAK_TAG_VARIABLE` in ``os.environ`` for the block (restored after), so
    processes spawned with the inherited (or merged) environment carry it, orphaned or not."""
    tag = uuid.uuid4().hex
    previous = os.environ.get(LEAK_TAG_VARIABLE)
    os.environ[LEAK_TAG_VARIABLE] = tag
    try:
        yield tag
    finally:
        if previous is None:
            del os.environ[LEAK_TAG_VARIABLE]
        else:
            os.environ[LEAK_TAG_VARIABLE] = previous


def assert_same_fds(before: dict[int, str]) -> None:
    """Assert this process has as many open file descriptors as `open_fds` gave ``before``."""
    after = open_fds()
    opened = {fd: target for fd, target in after.items() if before.get(fd) != target}
    closed = {fd: target for fd, target in before.items() if after.get(fd) != target}
    assert len(after) == len(before), f"file descriptors opened {opened}, closed {closed}"


@asynccontextmanager
async def assert_no_leaks() -> AsyncIterator[str]:
    """Check that the block leaves no file descriptor open and no process running; yields the leak tag.

    Sets `LEAK_TAG_VARIABLE` in ``os.environ`` for the block, so processes spawned with the inherited (or
    merged) environment are found even after they are orphaned. A process given an exact environment is only
    found while it is our descendant.
    """
    await _warm_up_subprocess_machinery()
    with leak_tag() as tag:
        fds_before = open_fds()
        yield tag
    assert_same_fds(fds_before)
    leaked = leaked_processes(tag)
    assert not leaked, f"processes left behind: {leaked}"
