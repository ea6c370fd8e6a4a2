"""The run journal: an SQLite record of every run a service starts, kept across restarts.

``SubagentService(journal="runs.db")`` records each run in an embedded SQLite database (WAL mode): its
journal id, its parent, its provider, the request (the prompt cut to :data:`PROMPT_MAX_CHARS`), how the
provider runs its child (an ACP agent's command and transport), the child's checkpoint (an ACP child's
session id, an in-process child's message log as of its last completed turn), each state change with
its time, and the result. ``subagent runs`` lists it; ``SubagentService.resume`` continues a run from it.

Durability: a run's result is committed before its caller sees it (``result()`` returns after the
commit), so a result a caller got is in the journal; what the child did after its last checkpoint is not,
and a resumed run continues from that checkpoint, never running a completed turn again. SQLite's WAL
makes each commit atomic: a process killed in the middle of a write leaves the journal as of its last
commit. Writes happen on a writer thread of the journal's own, in batches, never on the event loop.

Owners: each live run names its owner process (the host's boot id, the pid and the process's start
time). A journal opened by a service, or listed by ``subagent runs``, marks the live runs whose owner is
gone (on this host) ``interrupted``, with what was last known of them: the service that marks a run
reports it once, as ``subagent/interrupted``. A run owned by another host's process is left as it is:
only that host can tell whether its owner lives.

Secrets: environment values are never stored, and every text stored (the prompt, the output, the error,
the checkpoint, the request's metadata) has each known secret replaced by ``[redacted]``: the values of
this process's environment variables whose names look like credentials, and what the service's
providers hold as secrets (an ACP provider's ``env`` values, an LLM adapter's API key). The database
file is made readable by its owner only.

Several services, in one process or several, may share a journal file: each writes its own runs, and
SQLite serialises their commits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import queue
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from subagent._isolation_core import owner_alive, this_owner

if TYPE_CHECKING:
    from anyio import CapacityLimiter

__all__ = [
    "JOURNAL_ENV",
    "LIVE_STATES",
    "PROMPT_MAX_CHARS",
    "SCHEMA_VERSION",
    "JournalError",
    "JournalState",
    "RunJournal",
    "RunRecord",
    "RunTransition",
    "default_journal_path",
]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""The journal's schema version. A journal of an older version is migrated forward when opened; one
of a newer version is refused (:class:`JournalError`): an older subagent-seam cannot know its meaning."""

PROMPT_MAX_CHARS = 8_000
"""The longest prompt the journal keeps of a run; a longer one is cut there (``prompt_chars`` says how
long it was). The prompt the child got is not affected."""

OUTPUT_MAX_CHARS = 64_000
"""The longest output (and error text) kept of a turn; a longer one is cut there, marked as cut."""

CHECKPOINT_MAX_BYTES = 64 * 1024 * 1024
"""The largest checkpoint kept (an in-process child's message log, as JSON). A run whose checkpoint
outgrows it keeps its previous one, and a warning says so."""

JOURNAL_ENV = "SUBAGENT_JOURNAL"
"""The environment variable the CLI reads the journal's path from (``off``: no journal)."""

JournalState = Literal["queued", "starting", "running", "ended", "failed", "disposed", "interrupted"]
"""Where a journaled run is: live (``queued``, ``starting``, ``running``: its owner process is at work
on it); ``ended`` (its last turn ended: ``stop_reason`` says how); ``failed`` (its child never became
ready); ``disposed`` (its owner tore it down before its turn ended); ``interrupted`` (its owner died
while it was live)."""

LIVE_STATES: tuple[JournalState, ...] = ("queued", "starting", "running")
"""The states of a run whose owner is at work on it."""

_CREDENTIAL_NAME = re.compile(r"key|token|secret|password|passwd|credential|auth|cookie", re.IGNORECASE)
_MIN_SECRET_CHARS = 8  # shorter values ("1", "true") would redact ordinary words
_REDACTED = "[redacted]"
_BUSY_TIMEOUT_MS = 10_000
_WRITE_BATCH = 512  # at most this many writes in one transaction


class JournalError(Exception):
    """The journal cannot be used: not a journal, a newer schema, unreadable or unwritable."""


@dataclass(frozen=True, slots=True)
class RunTransition:
    """One state change of a journaled run."""

    at: float
    """When (seconds since the epoch)."""
    state: str
    """The state entered (a :data:`JournalState`, or ``resumed``)."""
    detail: str | None = None
    """What else is known (a stop reason, why it failed, who resumed it)."""


@dataclass(frozen=True, slots=True)
class RunRecord:
    """What the journal holds of one run."""

    id: str
    """The journal's id of the run (12 hex digits): unique in the journal, unlike the provider's run id."""
    run_id: str
    """The id the provider gave the run's (latest) child, e.g. ``acp-1``."""
    provider: str
    """The registered name of the provider that runs it."""
    state: JournalState
    parent: str | None
    """The journal id of the parent run, when the parent is a journaled run of the same service."""
    parent_id: str | None
    """The request's ``parent_id``, as given."""
    prompt: str
    """The first turn's prompt, cut to :data:`PROMPT_MAX_CHARS`."""
    prompt_chars: int
    """How long the prompt was."""
    turn_prompt: str
    """The prompt of the latest turn given by the caller (cut the same way): the one a resume continues."""
    request: Mapping[str, Any]
    """The request's other options (cwd, persona, timeout, budget...), as JSON."""
    agent: Mapping[str, Any] | None
    """How the provider runs the child (an ACP agent's command and transport), when it says."""
    session_id: str | None
    """The ACP session id of the child, once it had one."""
    turns: int
    """How many of the run's turns completed."""
    stop_reason: str | None
    output: str | None
    structured: Any
    error: str | None
    usage: Mapping[str, Any] | None
    spent: Mapping[str, Any] | None
    """What the run (with its subtree) had spent in its budget's units at its last turn's end, when it ran
    under a budget: ``tokens``, ``cost``, ``seconds``, ``toolCalls``, ``turns``. A resume carries it over."""
    progress: Mapping[str, Any] | None
    """What was last known of a live run (updates, idle and elapsed seconds), from its heartbeats."""
    created_at: float
    updated_at: float
    ended_at: float | None
    owner: Mapping[str, Any]
    """The process that runs (or ran) it: ``host`` (boot id), ``pid``, ``start``."""
    resumes: int
    """How many times it was resumed."""
    checkpoint: Mapping[str, Any] | None = field(default=None, repr=False)
    """The child's last checkpoint (loaded by :meth:`RunJournal.get` only)."""
    transitions: tuple[RunTransition, ...] = ()
    """Its state changes, oldest first (loaded by :meth:`RunJournal.get` only)."""

    @property
    def live(self) -> bool:
        """Whether its owner is (as far as the journal knows) at work on it."""
        return self.state in LIVE_STATES

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object (camelCase keys), as ``subagent runs --json`` prints it."""
        value: dict[str, Any] = {
            "id": self.id,
            "runId": self.run_id,
            "provider": self.provider,
            "state": self.state,
            "parent": self.parent,
            "parentId": self.parent_id,
            "prompt": self.prompt,
            "promptChars": self.prompt_chars,
            "turnPrompt": self.turn_prompt,
            "request": dict(self.request),
            "agent": None if self.agent is None else dict(self.agent),
            "sessionId": self.session_id,
            "turns": self.turns,
            "stopReason": self.stop_reason,
            "output": self.output,
            "structured": self.structured,
            "error": self.error,
            "usage": None if self.usage is None else dict(self.usage),
            "spent": None if self.spent is None else dict(self.spent),
            "progress": None if self.progress is None else dict(self.progress),
            "createdAt": self.created_at,
            "updatedAt": self.updated_at,
            "endedAt": self.ended_at,
            "owner": dict(self.owner),
            "resumes": self.resumes,
        }
        if self.transitions:
            value["transitions"] = [
                {"at": item.at, "state": item.state, "detail": item.detail} for item in self.transitions
            ]
        return value


def default_journal_path() -> Path:
    """Where the CLI keeps its journal: ``$XDG_STATE_HOME/subagent/runs.db`` (default
    ``~/.local/state/subagent/runs.db``)."""
    state_home = os.environ.get("XDG_STATE_HOME")
    base = Path(state_home) if state_home and os.path.isabs(state_home) else Path.home() / ".local" / "state"
    return base / "subagent" / "runs.db"


# -- the schema -------------------------------------------------------------------------------------------

_SCHEMA_V1 = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE runs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        run_id TEXT NOT NULL,
        provider TEXT NOT NULL,
        state TEXT NOT NULL,
        parent TEXT,
        parent_id TEXT,
        prompt TEXT NOT NULL,
        prompt_chars INTEGER NOT NULL,
        turn_prompt TEXT NOT NULL,
        request TEXT NOT NULL,
        agent TEXT,
        session_id TEXT,
        checkpoint TEXT,
        turns INTEGER NOT NULL DEFAULT 0,
        stop_reason TEXT,
        output TEXT,
        structured TEXT,
        error TEXT,
        usage TEXT,
        spent TEXT,
        progress TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        ended_at REAL,
        owner_host TEXT NOT NULL,
        owner_pid INTEGER NOT NULL,
        owner_start TEXT,
        resumes INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX runs_state ON runs (state, seq)",
    "CREATE INDEX runs_provider ON runs (provider, seq)",
    "CREATE INDEX runs_parent ON runs (parent)",
    "CREATE INDEX runs_created ON runs (created_at)",
    """CREATE TABLE transitions (
        run TEXT NOT NULL,
        at REAL NOT NULL,
        state TEXT NOT NULL,
        detail TEXT
    )""",
    "CREATE INDEX transitions_run ON transitions (run, at)",
)

# _MIGRATIONS[n] takes a journal of version n to n + 1, inside the opening transaction.
_MIGRATIONS: dict[int, Sequence[str]] = {}

_LIST_COLUMNS = (
    "id, run_id, provider, state, parent, parent_id, prompt, prompt_chars, turn_prompt, request, agent, "
    "session_id, turns, stop_reason, output, structured, error, usage, spent, progress, created_at, "
    "updated_at, "
    "ended_at, owner_host, owner_pid, owner_start, resumes"
)


# -- the journal ------------------------------------------------------------------------------------------


class _Write:
    """A batch of statements committed together; ``done`` is set once they are (or failed)."""

    __slots__ = ("done", "error", "rowcounts", "statements")

    def __init__(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> None:
        self.statements = statements
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.rowcounts: list[int] = []

    async def committed(self, timeout: float, limiter: CapacityLimiter | None = None) -> bool:
        """Wait, off the event loop and at most ``timeout`` seconds, until the batch is committed (or
        failed: ``error`` says why); False when the time ran out first."""
        if self.done.is_set():
            return True
        import anyio  # here: `subagent runs` reads the journal without loading an event loop library

        return await anyio.to_thread.run_sync(
            self.done.wait, timeout, abandon_on_cancel=True, limiter=limiter
        )


_STOP = object()


class _Skip(Exception):
    """A statement's value cannot be made (:class:`_Later`): the statement is left out."""


class _Later:
    """A statement's value made by the writer thread when it runs the statement (a large encoding kept
    off the event loop)."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make


class RunJournal:
    """An open run journal: writes through a writer thread, reads from any thread.

    Open it with :meth:`open`; close it with :meth:`close` (which commits what is queued first). A
    service opens and closes its own when given a path.
    """

    def __init__(self, path: Path, *, redact: Iterable[str] = ()) -> None:
        """Use :meth:`open`."""
        self.path = path
        self._secrets: list[str] = []
        self.add_secrets(_environment_secrets())
        self.add_secrets(redact)
        self._queue: queue.SimpleQueue[_Write | object] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._write_connection: sqlite3.Connection | None = None
        self._closed = False
        self._failed: str | None = None
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self.owner: dict[str, Any] = this_owner()
        """This process, as the owner of the runs it journals (as the workspaces it makes name it)."""

    # -- opening ---------------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, redact: Iterable[str] = ()) -> RunJournal:
        """Open (creating it when absent) the journal at ``path``, migrating an older schema forward.
        Blocking: call it off the event loop (``anyio.to_thread.run_sync``).

        Raises:
            JournalError: the file is not a run journal, has a newer schema version, or cannot be read
                or written (the message names the path and the cause).
        """
        journal = cls(Path(os.fspath(path)), redact=redact)
        journal._open()
        return journal

    def _open(self) -> None:
        path = self.path
        if str(path) != ":memory:":
            try:
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                if not path.exists():
                    # Created by us, readable by its owner only: it holds prompts and outputs.
                    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
            except OSError as exc:
                raise JournalError(
                    f"cannot create the run journal {str(path)!r}: {exc.strerror or exc}"
                ) from exc
        try:
            connection = self._connect()
        except sqlite3.Error as exc:
            raise self._error("cannot open", exc) from exc
        try:
            self._prepare(connection)
        except BaseException:
            connection.close()
            raise
        self._write_connection = connection
        self._writer = threading.Thread(
            target=self._write_loop, name=f"subagent journal {path.name}", daemon=True
        )
        self._writer.start()

    def _connect(self) -> sqlite3.Connection:
        connection = sqlite3.connect(
            self.path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
        )
        try:
            connection.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        except sqlite3.Error:
            connection.close()
            raise
        return connection

    def _error(self, doing: str, exc: sqlite3.Error) -> JournalError:
        text = str(exc)
        if isinstance(exc, sqlite3.DatabaseError) and (
            "not a database" in text or "malformed" in text or "file is encrypted" in text
        ):
            return JournalError(
                f"{str(self.path)!r} is not a usable run journal ({text}): move it away, or choose another "
                "path (--journal, or SUBAGENT_JOURNAL)"
            )
        return JournalError(f"{doing} the run journal {str(self.path)!r}: {text}")

    def _prepare(self, connection: sqlite3.Connection) -> None:
        try:
            mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()
            if str(self.path) != ":memory:" and (mode is None or str(mode[0]).lower() != "wal"):
                logger.warning("run journal %s: SQLite refused WAL mode (%s)", self.path, mode)
            # WAL with NORMAL: a commit survives this process being killed (not a power cut, which
            # may lose the last commits but never tears one).
            connection.execute("PRAGMA synchronous = NORMAL")
            with _immediate(connection):
                version = self._schema_version(connection)
                if version is None:
                    for statement in _SCHEMA_V1:
                        connection.execute(statement)
                    connection.execute(
                        "INSERT INTO meta (key, value) VALUES ('schema_version', ?), ('created_by', ?)",
                        (str(SCHEMA_VERSION), "subagent-seam"),
                    )
                elif version > SCHEMA_VERSION:
                    raise JournalError(
                        f"the run journal {str(self.path)!r} has schema version {version}, newer than this "
                        f"subagent-seam knows ({SCHEMA_VERSION}): it was written by a newer release. Upgrade "
                        "subagent-seam, or use another journal file (--journal, or SUBAGENT_JOURNAL)"
                    )
                else:
                    while version < SCHEMA_VERSION:
                        for statement in _MIGRATIONS[version]:
                            connection.execute(statement)
                        version += 1
                        connection.execute(
                            "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),)
                        )
        except sqlite3.Error as exc:
            raise self._error("cannot open", exc) from exc

    def _schema_version(self, connection: sqlite3.Connection) -> int | None:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return None
        if "meta" not in tables or "runs" not in tables:
            raise JournalError(
                f"{str(self.path)!r} is an SQLite database but not a run journal (it has no runs table): "
                "choose another path (--journal, or SUBAGENT_JOURNAL)"
            )
        row = connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        try:
            return int(row[0])
        except (TypeError, ValueError):
            raise JournalError(
                f"the run journal {str(self.path)!r} has no readable schema version ({row!r})"
            ) from None

    # -- secrets ---------------------------------------------------------------------------------------

    def add_secrets(self, values: Iterable[str]) -> None:
        """Redact ``values`` (each at least 8 characters long) from everything stored from now on."""
        known = set(self._secrets)
        for value in values:
            # Callers pass what they found: anything but a long enough string is not a secret we can match.
            if isinstance(value, str) and len(value) >= _MIN_SECRET_CHARS:  # type: ignore[redundant-expr]
                known.add(value)
        # Longest first: a secret containing a shorter one is redacted whole.
        self._secrets = sorted(known, key=len, reverse=True)

    def redact(self, text: str) -> str:
        """``text`` with each known secret replaced by ``[redacted]``."""
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, _REDACTED)
        return text

    def _json(self, value: Any) -> str | None:
        if value is None:
            return None
        return self.redact(json.dumps(value, ensure_ascii=False, default=_json_default, allow_nan=False))

    def _cut(self, text: str | None, limit: int) -> str | None:
        if text is None:
            return None
        text = self.redact(text)
        return text if len(text) <= limit else text[:limit] + f"\n[cut: {len(text) - limit} more characters]"

    # -- writing ---------------------------------------------------------------------------------------

    @property
    def failed(self) -> str | None:
        """Why the journal stopped recording (a write failed: disk full, file removed), or None."""
        return self._failed

    def submit(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> _Write:
        """Queue ``statements`` to be committed together by the writer thread; never blocks."""
        write = _Write(statements)
        if self._closed or self._writer is None:
            write.error = JournalError(f"the run journal {str(self.path)!r} is closed")
            write.done.set()
        else:
            self._queue.put(write)
        return write

    def _write_loop(self) -> None:
        connection = self._write_connection
        assert connection is not None
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch: list[_Write] = [first]  # type: ignore[list-item]
            stop = False
            while len(batch) < _WRITE_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                batch.append(item)  # type: ignore[arg-type]
            self._commit(connection, batch)
            if stop:
                return

    def _commit(self, connection: sqlite3.Connection, batch: list[_Write]) -> None:
        try:
            with _immediate(connection):
                for write in batch:
                    # Each write in a savepoint of its own: one that fails (a constraint) is undone
                    # alone, never the others of its batch.
                    connection.execute("SAVEPOINT write")
                    try:
                        for sql, parameters in write.statements:
                            try:
                                values = [p.make() if isinstance(p, _Later) else p for p in parameters]
                            except _Skip:
                                write.rowcounts.append(0)
                                continue
                            write.rowcounts.append(connection.execute(sql, values).rowcount)
                    except sqlite3.IntegrityError as exc:
                        connection.execute("ROLLBACK TO write")
                        write.error = self._error("cannot write to", exc)
                        logger.error("run journal %s: a write was refused: %s", self.path, exc)
                    connection.execute("RELEASE write")
        except Exception as exc:
            error = self._error("cannot write to", exc) if isinstance(exc, sqlite3.Error) else exc
            if self._failed is None:
                logger.error("run journal %s: %s; runs go on, unrecorded", self.path, error)
            self._failed = str(error)
            for write in batch:
                write.error = write.error or error
        finally:
            for write in batch:
                write.done.set()

    def flush(self, timeout: float | None = None) -> bool:
        """Block until everything queued so far is committed; False when ``timeout`` passed first."""
        return self.submit(()).done.wait(timeout)

    def close(self) -> None:
        """Commit what is queued, stop the writer and close the connections. Idempotent; blocking."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._queue.put(_STOP)
            self._writer.join()
        if self._write_connection is not None:
            self._write_connection.close()
        with self._readers_lock:
            readers, self._readers = self._readers, []
        for reader in readers:
            with contextlib.suppress(sqlite3.Error):
                reader.close()

    def __enter__(self) -> RunJournal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- what the service writes -----------------------------------------------------------------------

    def new_id(self) -> str:
        """A fresh journal id: 12 random hex digits (48 bits: two of a million runs share one with a
        chance of about 2 in a thousand million; such a run's insert fails alone, logged)."""
        return secrets.token_hex(6)

    def record_start(
        self,
        id: str,
        *,
        run_id: str,
        provider: str,
        parent: str | None,
        parent_id: str | None,
        prompt: str,
        request: Mapping[str, Any],
        agent: Mapping[str, Any] | None,
    ) -> _Write:
        """Queue a new run, ``starting``."""
        now = time.time()
        cut = self._cut(prompt, PROMPT_MAX_CHARS) or ""
        return self.submit(
            [
                (
                    "INSERT INTO runs (id, run_id, provider, state, parent, parent_id, prompt, "
                    "prompt_chars, turn_prompt, request, agent, created_at, updated_at, owner_host, "
                    "owner_pid, owner_start) "
                    "VALUES (?, ?, ?, 'starting', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        id,
                        run_id,
                        provider,
                        parent,
                        self.redact(parent_id) if parent_id is not None else None,
                        cut,
                        len(prompt),
                        cut,
                        self._json(dict(request)),
                        self._json(None if agent is None else dict(agent)),
                        now,
                        now,
                        self.owner["host"],
                        self.owner["pid"],
                        self.owner["start"],
                    ),
                ),
                _transition(id, now, "starting"),
            ]
        )

    def record_running(
        self, id: str, *, session_id: str | None, checkpoint: Mapping[str, Any] | None
    ) -> _Write:
        """Queue: the run's child is ready."""
        now = time.time()
        statements = [
            (
                "UPDATE runs SET state = 'running', session_id = coalesce(?, session_id), updated_at = ? "
                "WHERE id = ?",
                (session_id, now, id),
            ),
            _transition(id, now, "running"),
        ]
        statements.extend(self._checkpoint_statements(id, checkpoint))
        return self.submit(statements)

    def record_turn(
        self,
        id: str,
        *,
        stop_reason: str | None,
        output: str | None,
        structured: Any,
        error: str | None,
        usage: Mapping[str, Any] | None,
        checkpoint: Mapping[str, Any] | None,
        state: JournalState = "ended",
        spent: Mapping[str, Any] | None = None,
    ) -> _Write:
        """Queue how a turn of the run ended (``state`` ``ended``, or ``disposed``/``failed``)."""
        now = time.time()
        completed = 1 if stop_reason == "completed" else 0
        statements: list[tuple[str, Sequence[Any]]] = [
            (
                "UPDATE runs SET state = ?, stop_reason = ?, output = ?, structured = ?, error = ?, "
                "usage = ?, spent = coalesce(?, spent), turns = turns + ?, updated_at = ?, ended_at = ?, "
                "progress = NULL WHERE id = ?",
                (
                    state,
                    stop_reason,
                    self._cut(output, OUTPUT_MAX_CHARS),
                    self._json(structured),
                    self._cut(error, OUTPUT_MAX_CHARS),
                    self._json(None if usage is None else dict(usage)),
                    self._json(None if spent is None else dict(spent)),
                    completed,
                    now,
                    now,
                    id,
                ),
            ),
            _transition(id, now, state, stop_reason if state == "ended" else self._cut(error, 500)),
        ]
        statements.extend(self._checkpoint_statements(id, checkpoint))
        return self.submit(statements)

    def record_turn_started(self, id: str, prompt: str | None) -> _Write:
        """Queue: another turn of the run began (``prompt``: the caller's, None for the default one)."""
        now = time.time()
        statements: list[tuple[str, Sequence[Any]]] = [
            (
                "UPDATE runs SET state = 'running', stop_reason = NULL, ended_at = NULL, updated_at = ?, "
                "turn_prompt = coalesce(?, turn_prompt) WHERE id = ?",
                (now, self._cut(prompt, PROMPT_MAX_CHARS), id),
            ),
            _transition(id, now, "running", "another turn"),
        ]
        return self.submit(statements)

    def record_progress(self, id: str, progress: Mapping[str, Any]) -> _Write:
        """Queue what is known of a live run now (its heartbeat)."""
        now = time.time()
        return self.submit(
            [
                (
                    "UPDATE runs SET progress = ?, updated_at = ? WHERE id = ? AND state = 'running'",
                    (self._json(dict(progress)), now, id),
                )
            ]
        )

    def record_checkpoint(self, id: str, checkpoint: Mapping[str, Any] | None) -> _Write:
        """Queue the run's latest checkpoint."""
        return self.submit(self._checkpoint_statements(id, checkpoint))

    def _checkpoint_statements(
        self, id: str, checkpoint: Mapping[str, Any] | None
    ) -> list[tuple[str, Sequence[Any]]]:
        if checkpoint is None:
            return []
        session_id = checkpoint.get("sessionId")
        # Encoded by the writer thread, not here: an in-process child's log may be large.
        later = _Later(lambda: self._checkpoint_text(id, checkpoint))
        return [
            (
                "UPDATE runs SET checkpoint = ?, session_id = coalesce(?, session_id) WHERE id = ?",
                (later, session_id if isinstance(session_id, str) else None, id),
            )
        ]

    def _checkpoint_text(self, id: str, checkpoint: Mapping[str, Any]) -> str:
        """The checkpoint as stored; raises :class:`_Skip` (the previous one is kept) when it cannot be."""
        try:
            text = self._json(dict(checkpoint))
        except (TypeError, ValueError) as exc:
            logger.warning(
                "run journal: run %s's checkpoint is not JSON (%s); the previous one is kept", id, exc
            )
            raise _Skip from exc
        assert text is not None
        if len(text) > CHECKPOINT_MAX_BYTES:
            logger.warning(
                "run journal: run %s's checkpoint is %d bytes, past %d; the previous one is kept",
                id,
                len(text),
                CHECKPOINT_MAX_BYTES,
            )
            raise _Skip
        return text

    def claim_for_resume(self, id: str) -> _Write:
        """Queue taking run ``id`` over for a resume: it becomes ``starting``, owned by this process,
        unless it is live (``rowcounts[0]`` is then 0: somebody else owns it)."""
        now = time.time()
        live = ", ".join(f"'{state}'" for state in LIVE_STATES)
        return self.submit(
            [
                (
                    f"UPDATE runs SET state = 'starting', owner_host = ?, owner_pid = ?, owner_start = ?, "
                    f"resumes = resumes + 1, stop_reason = NULL, ended_at = NULL, updated_at = ?, "
                    f"progress = NULL WHERE id = ? AND state NOT IN ({live})",
                    (self.owner["host"], self.owner["pid"], self.owner["start"], now, id),
                ),
                (
                    "INSERT INTO transitions (run, at, state, detail) SELECT ?, ?, 'resumed', ? "
                    "WHERE changes() > 0",
                    (id, now, f"by pid {self.owner['pid']}"),
                ),
            ]
        )

    def record_resumed(self, id: str, run_id: str, prompt: str | None) -> _Write:
        """Queue: claimed run ``id`` goes on in provider run ``run_id``, with ``prompt`` as the caller's
        prompt of its next turn (None: the default one, which keeps the interrupted turn's)."""
        return self.submit(
            [
                (
                    "UPDATE runs SET run_id = ?, turn_prompt = coalesce(?, turn_prompt) WHERE id = ?",
                    (run_id, self._cut(prompt, PROMPT_MAX_CHARS), id),
                )
            ]
        )

    def release_claim(
        self,
        id: str,
        state: JournalState,
        error: str,
        *,
        stop_reason: str | None = None,
        ended_at: float | None = None,
    ) -> _Write:
        """Queue giving back a claimed run whose resume failed before its child existed, as it was
        (``state``, ``stop_reason``, ``ended_at``: the claimed record's)."""
        now = time.time()
        return self.submit(
            [
                (
                    "UPDATE runs SET state = ?, stop_reason = ?, ended_at = ?, resumes = resumes - 1, "
                    "updated_at = ? WHERE id = ? AND state = 'starting'",
                    (state, stop_reason, ended_at, now, id),
                ),
                _transition(id, now, state, self._cut(error, 500)),
            ]
        )

    # -- interrupted runs ------------------------------------------------------------------------------

    def mark_interrupted(self) -> list[RunRecord]:
        """Mark ``interrupted`` every live run whose owner is gone (on this host) and return them, as
        marked: each run is returned by exactly one call, in whichever process makes it. Blocking."""
        connection = self._reader()
        host = self.owner["host"]
        live = ", ".join(f"'{state}'" for state in LIVE_STATES)
        owners = connection.execute(
            f"SELECT DISTINCT owner_pid, owner_start FROM runs WHERE state IN ({live}) AND owner_host = ?",
            (host,),
        ).fetchall()
        dead = [
            (pid, start)
            for pid, start in owners
            if not owner_alive({"host": host, "pid": pid, "start": start})
        ]
        if not dead:
            return []
        write_connection = self._connect()
        try:
            with _immediate(write_connection):
                now = time.time()
                marked: list[str] = []
                for pid, start in dead:
                    rows = write_connection.execute(
                        f"SELECT id FROM runs WHERE state IN ({live}) AND owner_host = ? AND owner_pid = ? "
                        "AND owner_start IS ?",
                        (host, pid, start),
                    ).fetchall()
                    for (run,) in rows:
                        write_connection.execute(
                            "UPDATE runs SET state = 'interrupted', updated_at = ? WHERE id = ?", (now, run)
                        )
                        write_connection.execute(
                            "INSERT INTO transitions (run, at, state, detail) "
                            "VALUES (?, ?, 'interrupted', ?)",
                            (run, now, f"its owner (pid {pid}) is gone"),
                        )
                        marked.append(run)
        except sqlite3.Error as exc:
            raise self._error("cannot write to", exc) from exc
        finally:
            write_connection.close()
        return [record for record in (self.get(run, details=False) for run in marked) if record is not None]

    # -- reading ---------------------------------------------------------------------------------------

    def _reader(self) -> sqlite3.Connection:
        """This thread's read connection (sqlite3 connections are not shared between threads here)."""
        connection: sqlite3.Connection | None = getattr(self._local, "connection", None)
        if connection is None:
            if self._closed:
                raise JournalError(f"the run journal {str(self.path)!r} is closed")
            try:
                connection = self._connect()
            except sqlite3.Error as exc:
                raise self._error("cannot read", exc) from exc
            self._local.connection = connection
            with self._readers_lock:
                self._readers.append(connection)
        return connection

    def runs(
        self,
        *,
        states: Iterable[str] | None = None,
        provider: str | None = None,
        parent: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = 50,
    ) -> list[RunRecord]:
        """Runs, newest first: filtered by state, provider, parent (a journal id or a request's
        ``parent_id``) and creation time (``since`` <= created < ``until``, seconds since the epoch);
        at most ``limit`` (None: all). Blocking."""
        where: list[str] = []
        parameters: list[Any] = []
        if states is not None:
            wanted = list(states)
            where.append(f"state IN ({', '.join('?' for _ in wanted)})")
            parameters.extend(wanted)
        if provider is not None:
            where.append("provider = ?")
            parameters.append(provider)
        if parent is not None:
            where.append("(parent = ? OR parent_id = ?)")
            parameters.extend((parent, parent))
        if since is not None:
            where.append("created_at >= ?")
            parameters.append(since)
        if until is not None:
            where.append("created_at < ?")
            parameters.append(until)
        sql = f"SELECT {_LIST_COLUMNS} FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq DESC"
        if limit is not None:
            sql += " LIMIT ?"
            parameters.append(max(0, limit))
        try:
            rows = self._reader().execute(sql, parameters).fetchall()
        except sqlite3.Error as exc:
            raise self._error("cannot read", exc) from exc
        return [_record(row) for row in rows]

    def count(self) -> int:
        """How many runs the journal holds. Blocking."""
        try:
            return int(self._reader().execute("SELECT count(*) FROM runs").fetchone()[0])
        except sqlite3.Error as exc:
            raise self._error("cannot read", exc) from exc

    def get(self, id: str, *, details: bool = True, exact: bool = False) -> RunRecord | None:
        """Run ``id`` (a journal id, or unless ``exact`` a unique prefix of one of at least 4 characters),
        with its checkpoint and transitions when ``details``; None when there is none. Blocking.

        Raises:
            JournalError: the prefix names more than one run.
        """
        connection = self._reader()
        try:
            row = connection.execute(f"SELECT {_LIST_COLUMNS} FROM runs WHERE id = ?", (id,)).fetchone()
            if row is None and not exact and 4 <= len(id) < 12 and re.fullmatch(r"[0-9a-f]+", id):
                rows = connection.execute(
                    f"SELECT {_LIST_COLUMNS} FROM runs WHERE id >= ? AND id < ? LIMIT 2", (id, id + "g")
                ).fetchall()
                if len(rows) > 1:
                    raise JournalError(f"{id!r} is the start of more than one run's id: give more of it")
                row = rows[0] if rows else None
            if row is None:
                return None
            record = _record(row)
            if not details:
                return record
            checkpoint = connection.execute(
                "SELECT checkpoint FROM runs WHERE id = ?", (record.id,)
            ).fetchone()
            transitions = connection.execute(
                "SELECT at, state, detail FROM transitions WHERE run = ? ORDER BY at, rowid", (record.id,)
            ).fetchall()
        except sqlite3.Error as exc:
            raise self._error("cannot read", exc) from exc
        return _replace(
            record,
            checkpoint=_loads(checkpoint[0]) if checkpoint is not None else None,
            transitions=tuple(RunTransition(at, state, detail) for at, state, detail in transitions),
        )

    def children(self, id: str) -> list[RunRecord]:
        """The runs whose parent is run ``id``, oldest first: started below it in the same service, or
        naming it (its journal id, or its ACP session id: a served session's children) as their parent.
        Blocking."""
        try:
            rows = (
                self._reader()
                .execute(
                    f"SELECT {_LIST_COLUMNS} FROM runs WHERE parent = ? OR (parent IS NULL AND "
                    "(parent_id = ? OR parent_id = (SELECT session_id FROM runs WHERE id = ?))) ORDER BY seq",
                    (id, id, id),
                )
                .fetchall()
            )
        except sqlite3.Error as exc:
            raise self._error("cannot read", exc) from exc
        return [_record(row) for row in rows]


# -- helpers ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _immediate(connection: sqlite3.Connection) -> Iterator[None]:
    """A write transaction, taken at once (two writers never deadlock upgrading a read lock): committed
    when the block ends, rolled back when it raises."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


def _transition(id: str, at: float, state: str, detail: str | None = None) -> tuple[str, Sequence[Any]]:
    return ("INSERT INTO transitions (run, at, state, detail) VALUES (?, ?, ?, ?)", (id, at, state, detail))


def _environment_secrets() -> Iterator[str]:
    for name, value in os.environ.items():
        if _CREDENTIAL_NAME.search(name):
            yield value


def _json_default(value: Any) -> Any:
    if isinstance(value, frozenset | set | tuple):
        return list(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _loads(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _record(row: Sequence[Any]) -> RunRecord:
    (
        id,
        run_id,
        provider,
        state,
        parent,
        parent_id,
        prompt,
        prompt_chars,
        turn_prompt,
        request,
        agent,
        session_id,
        turns,
        stop_reason,
        output,
        structured,
        error,
        usage,
        spent,
        progress,
        created_at,
        updated_at,
        ended_at,
        owner_host,
        owner_pid,
        owner_start,
        resumes,
    ) = row
    request_value = _loads(request)
    return RunRecord(
        id=id,
        run_id=run_id,
        provider=provider,
        state=state,
        parent=parent,
        parent_id=parent_id,
        prompt=prompt,
        prompt_chars=prompt_chars,
        turn_prompt=turn_prompt,
        request=request_value if isinstance(request_value, dict) else {},
        agent=_loads(agent),
        session_id=session_id,
        turns=turns,
        stop_reason=stop_reason,
        output=output,
        structured=_loads(structured),
        error=error,
        usage=_loads(usage),
        spent=_loads(spent),
        progress=_loads(progress),
        created_at=created_at,
        updated_at=updated_at,
        ended_at=_number(ended_at),
        owner={"host": owner_host, "pid": owner_pid, "start": owner_start},
        resumes=resumes,
    )


def _replace(record: RunRecord, **changes: Any) -> RunRecord:
    return dataclasses.replace(record, **changes)
