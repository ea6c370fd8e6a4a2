"""The client side of ACP: what a child agent may ask of us, and how we answer.

* :class:`FsSandbox` serves ``fs/read_text_file`` and ``fs/write_text_file`` inside configured
  roots only. A path is refused (JSON-RPC -32602) when it is relative, contains NUL, or resolves
  outside every root, whether by ``..``, by being absolute elsewhere, or through a symlink. The
  check is repeated on the file descriptor actually opened, so swapping a path component for a
  symlink between the check and the open does not let a read or write escape. Writes are atomic:
  a temporary file beside the target, then ``rename``.
* Permission policies answer ``session/request_permission`` from a frozen snapshot of the question
  (:class:`PermissionQuestion`), never by waiting on a human who is not there: ``allow`` and
  ``deny`` answer at once, and a callback is bounded by a timeout after which it denies.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import itertools
import logging
import os
import secrets
import stat
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import anyio

from subagent.acp.errors import RequestError
from subagent.types import freeze_json

__all__ = [
    "DEFAULT_MAX_READ_BYTES",
    "DEFAULT_PERMISSION_CALLBACK_TIMEOUT",
    "AllowPolicy",
    "CallbackPolicy",
    "DenyPolicy",
    "FsSandbox",
    "PermissionCallback",
    "PermissionDecision",
    "PermissionOption",
    "PermissionOptionKind",
    "PermissionOutcome",
    "PermissionPolicy",
    "PermissionQuestion",
    "freeze_json",
    "permission_policy",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_READ_BYTES = 32 * 1024 * 1024
"""The most ``fs/read_text_file`` returns in one answer: the answer must fit in one JSON-RPC line,
and a hostile agent must not make us load a multi-gigabyte file into memory."""

DEFAULT_PERMISSION_CALLBACK_TIMEOUT = 300.0
"""How long a permission callback may take before the question is denied: long enough for a
person at a terminal, short enough that a headless run never parks forever."""

_READ_CHUNK = 64 * 1024


# -- the file system ---------------------------------------------------------------------------------


def _refuse(path: str, reason: str) -> RequestError:
    return RequestError.invalid_params({"path": path, "reason": reason})


def _fd_path(fd: int) -> Path | None:
    """The path the kernel has for an open descriptor, where the platform tells (Linux's /proc)."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


class FsSandbox:
    """File access for a child agent, confined to ``roots``.

    The roots are resolved once (a root that is itself a symlink is followed at construction) and
    must exist. Blocking file work runs in a worker thread.
    """

    def __init__(
        self, roots: Sequence[str | os.PathLike[str]], *, max_read_bytes: int = DEFAULT_MAX_READ_BYTES
    ) -> None:
        if not roots:
            raise ValueError("an FsSandbox needs at least one root")
        resolved: list[Path] = []
        for root in roots:
            real = Path(os.path.realpath(root))
            if not real.is_dir():
                raise ValueError(f"sandbox root {os.fspath(root)!r} is not an existing directory")
            resolved.append(real)
        self.roots: tuple[Path, ...] = tuple(resolved)
        self.max_read_bytes = max_read_bytes

    def __repr__(self) -> str:
        return f"FsSandbox({[str(root) for root in self.roots]!r})"

    def contains(self, real: Path) -> bool:
        """Whether a resolved path lies inside one of the roots (a root itself included)."""
        return any(real == root or root in real.parents for root in self.roots)

    def resolve(self, path: str) -> Path:
        """Resolve ``path`` (symlinks and ``..`` included) and check it lies inside a root.

        Raises:
            RequestError: -32602 with ``data = {"path", "reason"}`` when the path is refused.
        """
        if not path:
            raise _refuse(path, "the path must not be empty")
        if "\0" in path:
            raise _refuse(path, "the path contains a NUL character")
        if not os.path.isabs(path):
            raise _refuse(path, "the path must be absolute")
        real = Path(os.path.realpath(path))
        if not self.contains(real):
            raise _refuse(path, "the path is outside the directories this agent may access")
        return real

    async def read_text(self, path: str, *, line: int | None = None, limit: int | None = None) -> str:
        """The file's text from 1-based ``line`` (default 1), at most ``limit`` lines.

        Raises:
            RequestError: -32602 for a refused path or bad ``line``/``limit``, or a file too large
                to answer; -32002 when the file does not exist.
        """
        if line is not None and line < 1:
            raise RequestError.invalid_params({"path": path, "reason": "line is 1-based", "line": line})
        if limit is not None and limit < 0:
            raise RequestError.invalid_params({"path": path, "reason": "limit must be >= 0", "limit": limit})
        real = self.resolve(path)
        return await anyio.to_thread.run_sync(self._read_blocking, path, real, line or 1, limit)

    def _read_blocking(self, path: str, real: Path, line: int, limit: int | None) -> str:
        dir_fd = self._open_parent(path, real, create=False)
        try:
            # O_NONBLOCK: opening a FIFO must not hang us; O_NOFOLLOW: the resolved name cannot
            # have become a symlink since we checked it.
            fd = os.open(real.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            raise RequestError.resource_not_found(path) from None
        except OSError as exc:
            raise self._os_refusal(path, exc) from None
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "rb") as file:
            self._check_opened(path, fd, want_dir=False)
            os.set_blocking(fd, True)
            lines = itertools.islice(file, line - 1, None if limit is None else line - 1 + limit)
            taken = bytearray()
            for chunk in lines:
                taken += chunk
                if len(taken) > self.max_read_bytes:
                    raise _refuse(
                        path, f"the answer would exceed {self.max_read_bytes} bytes; ask for fewer lines"
                    )
        return taken.decode("utf-8", errors="replace")

    async def write_text(self, path: str, content: str) -> None:
        """Replace (or create) the file with ``content``, atomically; missing parent directories
        inside the root are created.

        Raises:
            RequestError: -32602 for a refused path or a target that is not a regular file.
        """
        real = self.resolve(path)
        if real in self.roots:
            raise _refuse(path, "the path is a sandbox root, not a file")
        await anyio.to_thread.run_sync(self._write_blocking, path, real, content.encode("utf-8"))

    def _write_blocking(self, path: str, real: Path, data: bytes) -> None:
        dir_fd = self._open_parent(path, real, create=True)
        try:
            mode = 0o666  # narrowed by the umask, as for any new file
            try:
                existing = os.stat(real.name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                if not stat.S_ISREG(existing.st_mode):
                    raise _refuse(path, "the target exists and is not a regular file")
                mode = stat.S_IMODE(existing.st_mode)
            temp = f".{real.name}.{secrets.token_hex(6)}.tmp"
            fd = os.open(
                temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd
            )
            try:
                with os.fdopen(fd, "wb") as file:
                    file.write(data)
                    file.flush()
                    os.fsync(file.fileno())
                os.chmod(temp, mode, dir_fd=dir_fd)  # the umask must not narrow an existing file's mode
                os.rename(temp, real.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp, dir_fd=dir_fd)
                raise
        except OSError as exc:
            raise self._os_refusal(path, exc) from None
        finally:
            os.close(dir_fd)

    def _open_parent(self, path: str, real: Path, *, create: bool) -> int:
        """Open the directory holding ``real`` by walking down from its root one component at a
        time without following any symlink (creating missing directories when ``create``).

        ``real`` is resolved, so a legitimate path has no symlink below its root; one found now was
        swapped in after the check, and the walk refuses it instead of following it out.
        """
        root = next(root for root in self.roots if root in real.parents)
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in real.parent.relative_to(root).parts:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=dir_fd)
                next_fd = os.open(
                    part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
                )
                os.close(dir_fd)
                dir_fd = next_fd
        except FileNotFoundError:
            os.close(dir_fd)
            raise RequestError.resource_not_found(path) from None
        except OSError as exc:
            os.close(dir_fd)
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _refuse(path, "a parent of the path is a symlink or not a directory") from None
            raise self._os_refusal(path, exc) from None
        try:
            self._check_opened(path, dir_fd, want_dir=True)
        except BaseException:
            os.close(dir_fd)
            raise
        return dir_fd

    def _check_opened(self, path: str, fd: int, *, want_dir: bool) -> None:
        info = os.fstat(fd)
        if want_dir and not stat.S_ISDIR(info.st_mode):
            raise _refuse(path, "a parent of the path is not a directory")
        if not want_dir and not stat.S_ISREG(info.st_mode):
            raise _refuse(path, "the path is not a regular file")
        opened = _fd_path(fd)
        # Re-check where the descriptor really points: a component swapped for a symlink after
        # resolve() shows up here.
        if opened is not None and not self.contains(opened):
            raise _refuse(path, "the path is outside the directories this agent may access")

    @staticmethod
    def _os_refusal(path: str, exc: OSError) -> RequestError:
        if exc.errno == errno.ELOOP:
            return _refuse(path, "the path changed into a symlink while being opened")
        if exc.errno in (errno.EACCES, errno.EPERM):
            return _refuse(path, "permission denied")
        if exc.errno == errno.EISDIR:
            return _refuse(path, "the path is a directory")
        if exc.errno == errno.ENOTDIR:
            return _refuse(path, "a parent of the path is not a directory")
        return _refuse(path, os.strerror(exc.errno) if exc.errno else "the file could not be opened")


# -- permission ----------------------------------------------------------------------------------------

PermissionOptionKind = Literal["allow_once", "allow_always", "reject_once", "reject_always"]


@dataclass(frozen=True, slots=True)
class PermissionOption:
    """One answer the agent offers."""

    option_id: str
    name: str
    kind: str  # one of PermissionOptionKind on the wire; kept open for kinds added later


@dataclass(frozen=True, slots=True)
class PermissionQuestion:
    """A frozen snapshot of ``session/request_permission``: what a policy decides on.

    Nothing the agent or another listener does after the question arrived changes it.
    """

    session_id: str
    tool_call_id: str
    title: str | None
    kind: str | None
    raw_input: Any  # frozen with freeze_json
    options: tuple[PermissionOption, ...]

    def first_option(self, *kinds: str) -> PermissionOption | None:
        """The first offered option whose kind is in ``kinds``, trying the kinds in order."""
        for kind in kinds:
            for option in self.options:
                if option.kind == kind:
                    return option
        return None


class PermissionOutcome(enum.Enum):
    """The one answer that is not an option: the question is withdrawn."""

    CANCELLED = "cancelled"


PermissionDecision = PermissionOption | Literal[PermissionOutcome.CANCELLED]
"""An offered option, or the question withdrawn."""


@runtime_checkable
class PermissionPolicy(Protocol):
    """Decides a permission question; must always return, and soon."""

    async def decide(self, question: PermissionQuestion) -> PermissionDecision:
        """Return one of ``question.options``, or ``PermissionOutcome.CANCELLED``."""
        ...


class AllowPolicy:
    """Allows once when offered (else always); with no allowing option, withdraws the question."""

    async def decide(self, question: PermissionQuestion) -> PermissionDecision:
        option = question.first_option("allow_once", "allow_always")
        return PermissionOutcome.CANCELLED if option is None else option


class DenyPolicy:
    """Rejects once when offered (else always); with no rejecting option, withdraws the question."""

    async def decide(self, question: PermissionQuestion) -> PermissionDecision:
        option = question.first_option("reject_once", "reject_always")
        return PermissionOutcome.CANCELLED if option is None else option


PermissionCallback = Callable[[PermissionQuestion], Awaitable[str | None]]
"""Returns the chosen ``option_id``, or None to withdraw the question."""


class CallbackPolicy:
    """Asks an async callback, bounded by ``timeout``; an answer naming no offered option, a
    callback that raises, and one that times out all fall back to ``fallback`` (deny by default)."""

    def __init__(
        self,
        callback: PermissionCallback,
        *,
        timeout: float = DEFAULT_PERMISSION_CALLBACK_TIMEOUT,
        fallback: PermissionPolicy | None = None,
    ) -> None:
        self.callback = callback
        self.timeout = timeout
        self.fallback: PermissionPolicy = fallback if fallback is not None else DenyPolicy()

    async def decide(self, question: PermissionQuestion) -> PermissionDecision:
        chosen: str | None = None
        with anyio.move_on_after(self.timeout) as scope:
            try:
                chosen = await self.callback(question)
            except Exception:
                logger.exception("permission callback raised; falling back to %r", self.fallback)
                return await self.fallback.decide(question)
        if scope.cancelled_caught:
            logger.warning(
                "permission callback gave no answer within %.1f s for tool call %r; falling back",
                self.timeout,
                question.tool_call_id,
            )
            return await self.fallback.decide(question)
        if chosen is None:
            return PermissionOutcome.CANCELLED
        for option in question.options:
            if option.option_id == chosen:
                return option
        logger.warning("permission callback chose %r, which the agent did not offer; falling back", chosen)
        return await self.fallback.decide(question)


def permission_policy(
    spec: Literal["allow", "deny"] | PermissionPolicy | PermissionCallback,
) -> PermissionPolicy:
    """A policy from ``"allow"``, ``"deny"``, a policy object, or an async callback."""
    if spec == "allow":
        return AllowPolicy()
    if spec == "deny":
        return DenyPolicy()
    if isinstance(spec, str):
        raise ValueError(f"unknown permission policy {spec!r}: use 'allow', 'deny', a policy or a callback")
    if isinstance(spec, PermissionPolicy):
        return spec
    return CallbackPolicy(spec)
