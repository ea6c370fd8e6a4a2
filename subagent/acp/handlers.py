"""The client side of ACP: what a child agent may ask of us, and how we answer.

* :class:`FsSandbox` serves ``fs/read_text_file`` and ``fs/write_text_file`` inside configured
  roots only. A path is refused (JSON-RPC -32602) when it is relative, contains NUL, is longer
  than the system allows, or resolves outside every root, whether by ``..``, by being absolute
  elsewhere, or through a symlink. The check is repeated on the file descriptor actually opened,
  so swapping a path component for a symlink between the check and the open does not let a read
  or write escape. Writes are atomic: a temporary file beside the target (its name independent of
  the target's, so a name of the full 255 bytes can be written), ``fsync``, then ``rename``.
* Reads stream the file in fixed chunks, so neither skipping to a far ``line`` nor a multi-GiB
  file without a newline costs more memory than the answer cap
  (:data:`DEFAULT_MAX_READ_BYTES`). An answer that would exceed the cap is refused, never
  silently cut: the error names the cap and how many lines from ``line`` would fit, so the agent
  can ask again with ``limit``. Only regular files holding UTF-8 text are answered; a directory,
  a sandbox root, a FIFO, a device or a socket is refused before it is opened, and so is a
  ``line``/``limit`` that is not a whole number from 1 to 2**32-1 (the protocol's uint32).
* Permission policies answer ``session/request_permission`` from a frozen snapshot of the question
  (:class:`PermissionQuestion`), never by waiting on a human who is not there: ``allow`` and
  ``deny`` answer at once, and a callback is bounded by a timeout after which it denies. An
  option id the agent gave to options of opposite kinds is never chosen by ``allow`` or ``deny``
  (see :meth:`PermissionQuestion.first_option`): an answer must mean one thing.

Every error a peer can provoke is a :class:`~subagent.acp.RequestError` whose ``data``
echoes what the agent sent only clipped to a few hundred characters.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import io
import logging
import os
import secrets
import stat
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import anyio

from subagent.acp._elicitation import ElicitationAnswer, ElicitationCallback, ElicitationQuestion
from subagent.acp._errors import RequestError

__all__ = [
    "DEFAULT_MAX_READ_BYTES",
    "DEFAULT_PERMISSION_CALLBACK_TIMEOUT",
    "MAX_LINE_ARGUMENT",
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
    "allows_everything",
    "permission_policy",
    "policy_name",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_READ_BYTES = 4 * 1024 * 1024
"""The most file bytes ``fs/read_text_file`` returns in one answer. The answer must fit in one
JSON-RPC line: JSON escaping grows text at most six-fold (a control character becomes
``\\u00XX``), so 4 MiB stays far below a 64 MiB line limit
(:data:`subagent.acp.connection.DEFAULT_MAX_LINE_BYTES`), and it is all the memory a read costs."""

MAX_LINE_ARGUMENT = 2**32 - 1
"""The largest ``line`` or ``limit`` accepted: the protocol types both as uint32."""

DEFAULT_PERMISSION_CALLBACK_TIMEOUT = 300.0
"""How long a permission callback may take before the question is denied: long enough for a
person at a terminal, short enough that a headless run never parks forever."""

_READ_CHUNK = 256 * 1024
"""One read's worth: large enough that skipping a multi-GiB file takes few system calls, small enough to be
noise next to the answer cap."""
_MAX_PATH_BYTES = 4096
"""Linux's PATH_MAX, counted in bytes: a longer path fails in the kernel anyway, and refusing it first keeps
realpath() from walking thousands of components."""
_DEFAULT_NAME_MAX = 255
"""NAME_MAX when the file system does not say."""
_ECHO_CHARS = 256
"""How much of an agent-supplied value an error or log line repeats."""


# -- the file system ---------------------------------------------------------------------------------


def _clip(value: str, limit: int = _ECHO_CHARS) -> str:
    """``value`` as an error or a log line may repeat it: an agent must not make us echo megabytes."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}... ({len(value)} characters)"


def _refuse(path: str, reason: str, **data: Any) -> RequestError:
    return RequestError.invalid_params({"path": _clip(path), "reason": reason, **data})


def _line_argument(path: str, name: str, value: object, advice: str) -> int | None:
    """Check a ``line``/``limit`` argument: None, or a whole number from 1 to MAX_LINE_ARGUMENT."""
    if value is None:
        return None
    # bool is an int subclass: True must not read as line 1.
    if isinstance(value, int) and not isinstance(value, bool):
        if 1 <= value <= MAX_LINE_ARGUMENT:
            return value
        # Echoed only when small, like every value the agent sent.
        echo = {name: value} if abs(value) <= MAX_LINE_ARGUMENT else {}
        if value > MAX_LINE_ARGUMENT:
            raise _refuse(path, f"{name} must be at most {MAX_LINE_ARGUMENT}")
        raise _refuse(path, f"{name} must be at least 1 ({advice})", **echo)
    raise _refuse(path, f"{name} must be a whole number, not {type(value).__name__} ({advice})")


def _describe_kind(mode: int) -> str | None:
    """Why a file of this mode cannot be read as text, or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "the path is a directory, not a regular file"
    if stat.S_ISFIFO(mode):
        return "the path is a named pipe (FIFO), not a regular file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "the path is a device, not a regular file"
    if stat.S_ISSOCK(mode):
        return "the path is a socket, not a regular file"
    return "the path is not a regular file"


def _nth_line_end(buffer: bytearray, start: int, end: int, lines: int) -> int:
    """The offset just past the ``lines``-th newline in ``buffer[start:end]``, which holds that many."""
    position = start
    for _ in range(lines):
        position = buffer.index(b"\n", position, end) + 1
    return position


def _fd_path(fd: int) -> Path | None:
    """The path the kernel has for an open descriptor, where the platform tells (Linux's /proc)."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


class FsSandbox:
    """File access for a child agent, confined to ``roots``.

    The roots are resolved once (a root that is itself a symlink is followed at construction) and
    must exist. Blocking file work (resolving symlinks included) runs in a worker thread; a read
    notices the caller's cancellation between chunks.

    Args:
        roots: the directories the agent may read and write below.
        max_read_bytes: the most file bytes one ``fs/read_text_file`` answer may hold (see
            :data:`DEFAULT_MAX_READ_BYTES`); a larger answer is refused with -32602.
    """

    def __init__(
        self, roots: Sequence[str | os.PathLike[str]], *, max_read_bytes: int = DEFAULT_MAX_READ_BYTES
    ) -> None:
        if not roots:
            raise ValueError("an FsSandbox needs at least one root")
        if max_read_bytes < 1:
            raise ValueError(f"max_read_bytes must be at least 1, not {max_read_bytes}")
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

        Touches the file system (``realpath``): call it from a worker thread in async code.

        Raises:
            RequestError: -32602 with ``data = {"path", "reason"}`` when the path is refused.
        """
        self._check_path_text(path)
        real = Path(os.path.realpath(path))
        if not self.contains(real):
            raise _refuse(path, "the path is outside the directories this agent may access")
        return real

    @staticmethod
    def _check_path_text(path: str) -> None:
        """The checks that need no file system: cheap enough to run before any thread is used."""
        if not path:
            raise _refuse(path, "the path must not be empty")
        if "\0" in path:
            raise _refuse(path, "the path contains a NUL character")
        try:
            encoded = os.fsencode(path)
        except UnicodeError:
            raise _refuse(path, "the path cannot be encoded for the file system") from None
        if len(encoded) >= _MAX_PATH_BYTES:
            raise _refuse(
                path, f"the path is {len(encoded)} bytes long; the system allows {_MAX_PATH_BYTES - 1}"
            )
        if not os.path.isabs(path):
            raise _refuse(path, "the path must be absolute")

    @classmethod
    def _check_file_path_text(cls, path: str) -> None:
        cls._check_path_text(path)
        # realpath() would drop the separator and let "file.txt/" name the file.
        if path.endswith(os.sep):
            raise _refuse(path, "the path ends with a separator, so it names a directory, not a file")

    async def read_text(self, path: str, *, line: int | None = None, limit: int | None = None) -> str:
        """The file's text from 1-based ``line`` (default 1), at most ``limit`` lines (default: to
        the end). A line ends after its newline, which the text keeps; a ``line`` past the end of
        the file reads as ``""``.

        Raises:
            RequestError: -32602 (``data`` = ``{"path", "reason", ...}``) for a refused path, a
                ``line``/``limit`` that is not a whole number from 1 to :data:`MAX_LINE_ARGUMENT`,
                a path that is not a regular file (a directory, a sandbox root, a FIFO, a device),
                content that is not UTF-8, or an answer larger than ``max_read_bytes`` (then
                ``data`` also has ``maxBytes``, ``line`` and ``fittingLines``: how many lines from
                ``line`` fit, 0 when that line alone is too long); -32002 when the file does not exist.
        """
        first = _line_argument(path, "line", line, "the first line is 1") or 1
        count = _line_argument(path, "limit", limit, "omit it to read to the end")
        self._check_file_path_text(path)
        return await anyio.to_thread.run_sync(self._read_blocking, path, first, count)

    def _read_blocking(self, path: str, first: int, count: int | None) -> str:
        real = self.resolve(path)
        if real in self.roots:
            raise _refuse(path, "the path is a sandbox root, a directory, not a regular file")
        dir_fd = self._open_parent(path, real, create=False)
        try:
            try:
                # Looked at before opening: opening a device can have effects of its own (a tape
                # rewinds, a terminal becomes ours), so none is ever opened.
                info = os.stat(real.name, dir_fd=dir_fd, follow_symlinks=False)
                refusal = _describe_kind(info.st_mode)
                if refusal is not None:
                    raise _refuse(path, refusal)
                # O_NONBLOCK: a FIFO swapped in since the stat must not hang the open; O_NOFOLLOW:
                # nor may a symlink; O_NOCTTY: nor may a terminal become our controlling one.
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
                fd = os.open(real.name, flags, dir_fd=dir_fd)
            except FileNotFoundError:
                raise RequestError.resource_not_found(_clip(path)) from None
            except OSError as exc:
                raise self._os_refusal(path, exc) from None
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "rb", buffering=0) as file:
            self._check_opened(path, fd, want_dir=False)
            os.set_blocking(fd, True)
            taken, start_offset = self._take_lines(path, file, first, count)
        try:
            return taken.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _refuse(
                path,
                f"the file is not UTF-8 text (an invalid byte at offset {start_offset + exc.start})",
            ) from None

    def _take_lines(self, path: str, file: io.FileIO, first: int, count: int | None) -> tuple[bytearray, int]:
        """Stream the file through one fixed buffer: the bytes of lines ``first`` onwards (at most
        ``count`` of them), and the file offset where they start. Memory: the buffer, plus at most
        ``max_read_bytes`` taken."""
        cap = self.max_read_bytes
        buffer = bytearray(_READ_CHUNK)
        view = memoryview(buffer)
        taken = bytearray()
        taken_lines = 0
        line_number = 1  # of the line the read position is in
        offset = 0  # of buffer[0] in the file
        start_offset = -1
        try:
            while True:
                # A skip through gigabytes ends when the agent cancels its request.
                anyio.from_thread.check_cancelled()
                size = file.readinto(buffer)
                if not size:
                    break
                start = 0
                if line_number < first:
                    newlines = buffer.count(b"\n", 0, size)
                    if line_number + newlines < first:
                        line_number += newlines
                        offset += size
                        continue
                    start = _nth_line_end(buffer, 0, size, first - line_number)
                    line_number = first
                if start_offset < 0:
                    start_offset = offset + start
                end = size
                newlines = buffer.count(b"\n", start, size)
                if count is not None and taken_lines + newlines >= count:
                    end = _nth_line_end(buffer, start, size, count - taken_lines)
                    newlines = count - taken_lines
                room = cap - len(taken)
                if end - start > room:
                    fitting = taken_lines + buffer.count(b"\n", start, start + room)
                    # The traceback keeps this frame alive (a worker thread may hold it until its
                    # next job): it must not keep the bytes too.
                    taken.clear()
                    raise _refuse(
                        path,
                        f"the answer would exceed {cap} bytes, the most one read returns; "
                        + (
                            f"ask for at most {fitting} lines from line {first} with limit"
                            if fitting
                            else f"line {first} alone is longer than that, so it cannot be read"
                        ),
                        maxBytes=cap,
                        line=first,
                        fittingLines=fitting,
                    )
                taken += view[start:end]
                taken_lines += newlines
                if end < size or (count is not None and taken_lines >= count):
                    break
                offset += size
        finally:
            view.release()
        return taken, max(start_offset, 0)

    async def write_text(self, path: str, content: str) -> None:
        """Replace (or create) the file with ``content``, atomically; missing parent directories
        inside the root are created.

        Raises:
            RequestError: -32602 for a refused path, a target that is not a regular file, a file
                name longer than the file system allows (255 bytes on most), content that is not
                valid Unicode (a lone surrogate), or a failed write (``reason`` says why).
        """
        self._check_file_path_text(path)
        try:
            data = content.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _refuse(
                path, f"the content is not valid Unicode: a lone surrogate at character {exc.start}"
            ) from None
        await anyio.to_thread.run_sync(self._write_blocking, path, data)

    def _write_blocking(self, path: str, data: bytes) -> None:
        real = self.resolve(path)
        if real in self.roots:
            raise _refuse(path, "the path is a sandbox root, not a file")
        dir_fd = self._open_parent(path, real, create=True)
        try:
            name_bytes = len(os.fsencode(real.name))
            name_max = _name_max(dir_fd)
            if name_bytes > name_max:
                raise _refuse(
                    path, f"the file name is {name_bytes} bytes long; this file system allows {name_max}"
                )
            mode = 0o666  # narrowed by the umask, as for any new file
            try:
                existing = os.stat(real.name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                if not stat.S_ISREG(existing.st_mode):
                    raise _refuse(path, "the target exists and is not a regular file")
                mode = stat.S_IMODE(existing.st_mode)
            # Not derived from the target's name, which may already use all of NAME_MAX.
            temp = f".subagent-write-{secrets.token_hex(8)}.tmp"
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
            raise RequestError.resource_not_found(_clip(path)) from None
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
        refusal = None if want_dir else _describe_kind(info.st_mode)
        if refusal is not None:
            raise _refuse(path, refusal)
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
        if exc.errno == errno.ENAMETOOLONG:
            return _refuse(path, "a name in the path is longer than the file system allows")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return _refuse(path, "no space left on the file system (or the quota is used up)")
        return _refuse(path, os.strerror(exc.errno) if exc.errno else "the file could not be opened")


def _name_max(dir_fd: int) -> int:
    """The longest file name, in bytes, the file system holding ``dir_fd`` allows."""
    try:
        return os.fpathconf(dir_fd, "PC_NAME_MAX")
    except (OSError, ValueError):
        return _DEFAULT_NAME_MAX


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
    subagent: str | None = None
    """The subagent session that asks, by its title (else its id), when the question comes from a
    child session the agent announced rather than from the session itself."""

    def first_option(self, *kinds: str) -> PermissionOption | None:
        """The first offered option whose kind is in ``kinds``, trying the kinds in order, among
        the options whose id is unambiguous for them.

        The answer on the wire is an option id alone, so an id the agent also gave to an option of
        another kind (``[{id: "x", kind: "allow_once"}, {id: "x", kind: "reject_once"}]``) could
        be read either way: such an option is skipped, whichever side asks. A deny therefore never
        answers an id that also labels an allowing option, and an allow never one that also labels
        a rejecting (or unknown) option; with nothing unambiguous left the policies withdraw the
        question. Linear in the number of options.
        """
        wanted = set(kinds)
        ambiguous = {option.option_id for option in self.options if option.kind not in wanted}
        for kind in kinds:
            for option in self.options:
                if option.kind == kind and option.option_id not in ambiguous:
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
    """Allows once when offered (else always); with no allowing option whose id is unambiguous
    (see :meth:`PermissionQuestion.first_option`), withdraws the question."""

    name = "allow"

    async def decide(self, question: PermissionQuestion) -> PermissionDecision:
        option = question.first_option("allow_once", "allow_always")
        return PermissionOutcome.CANCELLED if option is None else option


class DenyPolicy:
    """Rejects once when offered (else always); with no rejecting option whose id labels nothing
    else (see :meth:`PermissionQuestion.first_option`), withdraws the question: a deny never
    answers an id that an allowing option also carries."""

    name = "deny"

    async def decide(self, question: PermissionQuestion) -> PermissionDecision:
        option = question.first_option("reject_once", "reject_always")
        return PermissionOutcome.CANCELLED if option is None else option


PermissionCallback = Callable[[PermissionQuestion], Awaitable[str | None]]
"""Returns the chosen ``option_id``, or None to withdraw the question."""


class CallbackPolicy:
    """Asks an async callback, bounded by ``timeout``; an answer naming no offered option, a
    callback that raises, and one that times out all fall back to ``fallback`` (deny by default).

    ``elicitation``, if given, answers the agent's elicitation questions (``elicitation/create``), bounded
    by the same timeout: past it, or if it raises, the question is answered ``cancel``. Without it they
    are declined."""

    name = "callback"

    def __init__(
        self,
        callback: PermissionCallback,
        *,
        timeout: float = DEFAULT_PERMISSION_CALLBACK_TIMEOUT,
        fallback: PermissionPolicy | None = None,
        elicitation: ElicitationCallback | None = None,
    ) -> None:
        self.callback = callback
        self.timeout = timeout
        self.fallback: PermissionPolicy = fallback if fallback is not None else DenyPolicy()
        self.elicitation = elicitation

    async def elicit(self, question: ElicitationQuestion) -> ElicitationAnswer:
        """Ask the ``elicitation`` callback (decline without one; cancel past the timeout or if it raises)."""
        if self.elicitation is None:
            return ElicitationAnswer.decline()
        with anyio.move_on_after(self.timeout):
            try:
                return await self.elicitation(question)
            except Exception:
                logger.exception("elicitation callback raised; answering cancel")
                return ElicitationAnswer.cancel()
        logger.warning("elicitation callback gave no answer within %.1f s; answering cancel", self.timeout)
        return ElicitationAnswer.cancel()

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
                _clip(question.tool_call_id),
            )
            return await self.fallback.decide(question)
        if chosen is None:
            return PermissionOutcome.CANCELLED
        for option in question.options:
            if option.option_id == chosen:
                return option
        logger.warning(
            "permission callback chose %r, which the agent did not offer; falling back", _clip(chosen)
        )
        return await self.fallback.decide(question)


def policy_name(policy: PermissionPolicy) -> str:
    """How a refusal names the policy that refused: its ``name`` attribute (``"deny"``, ``"allow"``,
    ``"callback"``, or a wrapper's own), else its class name."""
    name = getattr(policy, "name", None)
    return name if isinstance(name, str) and name else type(policy).__name__


def allows_everything(policy: object) -> bool:
    """Whether ``policy`` answers every question with an allow: an :class:`AllowPolicy`, also behind
    wrappers that decide with an ``inner`` policy (reporting, tracing), or the string ``"allow"``."""
    seen = 0
    while seen < 16:  # wrappers nest a few deep at most; a cycle must not loop forever
        if policy == "allow" or isinstance(policy, AllowPolicy):
            return True
        inner = getattr(policy, "inner", None)
        if inner is None:
            return False
        policy = inner
        seen += 1
    return False


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
