"""The client-side handlers against a hostile agent: huge and malformed reads, long names, ambiguous
permission options. Memory is measured with tracemalloc; the log must never carry a traceback."""

from __future__ import annotations

import functools
import logging
import os
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from subagent.acp import RequestError
from subagent.acp.handlers import (
    DEFAULT_MAX_READ_BYTES,
    MAX_LINE_ARGUMENT,
    AllowPolicy,
    CallbackPolicy,
    DenyPolicy,
    FsSandbox,
    PermissionOption,
    PermissionOutcome,
    PermissionPolicy,
    PermissionQuestion,
)
from tests.test_client import FakeAgent, connected, ready_session

pytestmark = pytest.mark.anyio

INVALID_PARAMS = -32602
MiB = 1024 * 1024
GiB = 1024 * MiB
# Sparse: the size costs no disk and no time to create.
HUGE_FILE_SIZE = 3 * GiB


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    return root


@pytest.fixture
def quiet_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Captures everything; on the way out, asserts no record carries a traceback or is an error."""
    caplog.set_level(logging.DEBUG)
    yield caplog
    loud = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert loud == []


def sparse_file(path: Path, size: int, tail: bytes = b"") -> Path:
    """``size`` NUL bytes (a hole: no newline in them), then ``tail``."""
    with path.open("wb") as file:
        file.truncate(size)
        file.seek(size)
        file.write(tail)
    return path


def clipped(value: str) -> str:
    """What an error echoes of a long value the agent sent."""
    return value if len(value) <= 256 else f"{value[:256]}... ({len(value)} characters)"


async def refused(coro: Any) -> RequestError:
    with anyio.fail_after(30), pytest.raises(RequestError) as caught:
        await coro
    return caught.value


class PeakMemory:
    """The peak of Python allocations (tracemalloc) above what was allocated on entry."""

    def __init__(self) -> None:
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        tracemalloc.start()
        tracemalloc.reset_peak()
        self._base = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = tracemalloc.get_traced_memory()[1] - self._base
        tracemalloc.stop()


# -- reading huge files --------------------------------------------------------------------------------


async def test_a_multi_gib_file_without_a_newline_is_refused_holding_no_more_than_the_cap(
    root: Path, quiet_log: pytest.LogCaptureFixture
) -> None:
    huge = sparse_file(root / "huge.bin", HUGE_FILE_SIZE)
    sandbox = FsSandbox([root])

    with PeakMemory() as memory:
        error = await refused(sandbox.read_text(str(huge)))

    assert error.to_wire() == {
        "code": INVALID_PARAMS,
        "message": "Invalid params",
        "data": {
            "path": str(huge),
            "reason": f"the answer would exceed {DEFAULT_MAX_READ_BYTES} bytes, the most one read returns; "
            "line 1 alone is longer than that, so it cannot be read",
            "maxBytes": DEFAULT_MAX_READ_BYTES,
            "line": 1,
            "fittingLines": 0,
        },
    }
    # Measured: about 4.6 MiB (the 4 MiB cap plus one 256 KiB read buffer).
    assert memory.peak < DEFAULT_MAX_READ_BYTES + 2 * MiB


async def test_skipping_to_a_line_past_a_newline_free_stretch_128_times_the_cap_streams_it(
    root: Path, quiet_log: pytest.LogCaptureFixture
) -> None:
    # 512 MiB, not gigabytes: the point is a stretch far past the read cap, and each read below scans all
    # of it (on a loaded machine, several GiB of scanning outlasted the hang guard).
    huge = sparse_file(root / "huge.log", 128 * DEFAULT_MAX_READ_BYTES, tail=b"\nthe last line\n")
    sandbox = FsSandbox([root])

    with PeakMemory() as memory:
        with anyio.fail_after(60):
            last = await sandbox.read_text(str(huge), line=2)
            past_the_end = await sandbox.read_text(str(huge), line=3, limit=5)

    assert last == "the last line\n"
    assert past_the_end == ""
    # Measured: about 0.4 MiB, whatever the file's size.
    assert memory.peak < 2 * MiB


async def test_a_read_over_the_cap_says_how_many_lines_fit_and_that_many_can_be_read(root: Path) -> None:
    text = "".join(f"{n:09d}\n" for n in range(1, 101))  # 100 lines of 10 bytes
    (root / "lines.txt").write_text(text)
    sandbox = FsSandbox([root], max_read_bytes=255)

    error = await refused(sandbox.read_text(str(root / "lines.txt"), line=11))

    assert error.code == INVALID_PARAMS
    assert error.data == {
        "path": str(root / "lines.txt"),
        "reason": "the answer would exceed 255 bytes, the most one read returns; "
        "ask for at most 25 lines from line 11 with limit",
        "maxBytes": 255,
        "line": 11,
        "fittingLines": 25,
    }
    with anyio.fail_after(10):
        assert await sandbox.read_text(str(root / "lines.txt"), line=11, limit=25) == text[100:350]
        assert await sandbox.read_text(str(root / "lines.txt"), line=76) == text[750:]


@pytest.mark.parametrize("chunks", [1, 3])
async def test_line_and_limit_are_found_across_read_chunk_boundaries(
    root: Path, chunks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("subagent.acp.handlers._READ_CHUNK", chunks)
    (root / "f.txt").write_text("ab\n\ncd\nef")
    sandbox = FsSandbox([root])
    expectations = {
        (None, None): "ab\n\ncd\nef",
        (2, None): "\ncd\nef",
        (2, 1): "\n",
        (3, 2): "cd\nef",
        (4, 1): "ef",
        (5, None): "",
    }
    with anyio.fail_after(10):
        for (line, limit), expected in expectations.items():
            assert await sandbox.read_text(str(root / "f.txt"), line=line, limit=limit) == expected


async def test_a_cancelled_read_stops_skipping_through_a_huge_file(root: Path) -> None:
    huge = sparse_file(root / "huge.bin", 64 * GiB)  # a full scan would take far longer than the guard
    started = threading.Event()
    read_bytes: list[int] = []

    class CountingSandbox(FsSandbox):
        def _take_lines(self, path: str, file: Any, first: int, count: int | None) -> Any:
            original = file.readinto

            def readinto(buffer: bytearray) -> int:
                size: int = original(buffer)
                read_bytes.append(size)
                started.set()
                return size

            file.readinto = readinto
            return super()._take_lines(path, file, first, count)

    sandbox = CountingSandbox([root])
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(functools.partial(sandbox.read_text, str(huge), line=2))
            assert await anyio.to_thread.run_sync(started.wait, 30)
            tasks.cancel_scope.cancel()
    assert 0 < sum(read_bytes) < 64 * GiB


# -- reading what is not a regular UTF-8 file ---------------------------------------------------------


async def test_a_file_that_is_not_utf8_is_refused_naming_the_offset_of_the_bad_byte(
    root: Path, quiet_log: pytest.LogCaptureFixture
) -> None:
    (root / "latin1.txt").write_bytes(b"fine\ncaf\xe9\n")
    sandbox = FsSandbox([root])

    whole = await refused(sandbox.read_text(str(root / "latin1.txt")))
    second = await refused(sandbox.read_text(str(root / "latin1.txt"), line=2))
    with anyio.fail_after(10):
        first = await sandbox.read_text(str(root / "latin1.txt"), limit=1)

    reason = "the file is not UTF-8 text (an invalid byte at offset 8)"
    assert whole.data == second.data == {"path": str(root / "latin1.txt"), "reason": reason}
    assert whole.code == INVALID_PARAMS
    assert first == "fine\n"


@pytest.mark.parametrize(
    ("argument", "value", "reason"),
    [
        ("line", 0, "line must be at least 1 (the first line is 1)"),
        ("line", -5, "line must be at least 1 (the first line is 1)"),
        ("line", True, "line must be a whole number, not bool (the first line is 1)"),
        ("line", 2.5, "line must be a whole number, not float (the first line is 1)"),
        ("line", "3", "line must be a whole number, not str (the first line is 1)"),
        ("line", MAX_LINE_ARGUMENT + 1, f"line must be at most {MAX_LINE_ARGUMENT}"),
        ("line", 10**400, f"line must be at most {MAX_LINE_ARGUMENT}"),
        ("limit", 0, "limit must be at least 1 (omit it to read to the end)"),
        ("limit", -1, "limit must be at least 1 (omit it to read to the end)"),
        ("limit", False, "limit must be a whole number, not bool (omit it to read to the end)"),
        ("limit", 1.0, "limit must be a whole number, not float (omit it to read to the end)"),
        ("limit", 2**64, f"limit must be at most {MAX_LINE_ARGUMENT}"),
    ],
)
async def test_a_bad_line_or_limit_is_invalid_params_with_a_clear_reason(
    root: Path, argument: str, value: Any, reason: str, quiet_log: pytest.LogCaptureFixture
) -> None:
    (root / "f.txt").write_text("x\n")
    sandbox = FsSandbox([root])

    error = await refused(sandbox.read_text(str(root / "f.txt"), **{argument: value}))

    assert error.code == INVALID_PARAMS
    assert error.data["reason"] == reason
    assert error.data["path"] == str(root / "f.txt")


async def test_the_largest_line_and_limit_are_accepted(root: Path) -> None:
    (root / "f.txt").write_text("x\n")
    sandbox = FsSandbox([root])
    with anyio.fail_after(10):
        assert await sandbox.read_text(str(root / "f.txt"), limit=MAX_LINE_ARGUMENT) == "x\n"
        assert await sandbox.read_text(str(root / "f.txt"), line=MAX_LINE_ARGUMENT) == ""


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda r: str(r), "the path is a sandbox root, a directory, not a regular file"),
        (lambda r: str(r / "sub"), "the path is a directory, not a regular file"),
        (
            lambda r: str(r / "sub") + "/",
            "the path ends with a separator, so it names a directory, not a file",
        ),
        (
            lambda r: str(r / "f.txt") + "/",
            "the path ends with a separator, so it names a directory, not a file",
        ),
        (lambda r: str(r / "pipe"), "the path is a named pipe (FIFO), not a regular file"),
        (lambda r: str(r / "f\0.txt"), "the path contains a NUL character"),
        (lambda r: str(r / "bad\udcff\ud800.txt"), "the path cannot be encoded for the file system"),
    ],
    ids=["root", "directory", "directory-slash", "file-slash", "fifo", "nul", "surrogate"],
)
async def test_what_is_not_a_readable_file_is_refused_with_invalid_params(
    root: Path, make: Any, reason: str, quiet_log: pytest.LogCaptureFixture
) -> None:
    (root / "sub").mkdir()
    (root / "f.txt").write_text("x\n")
    os.mkfifo(root / "pipe")  # nobody ever writes it: opening it for reading would block
    sandbox = FsSandbox([root])
    path = make(root)

    error = await refused(sandbox.read_text(path))

    assert error.to_wire() == {
        "code": INVALID_PARAMS,
        "message": "Invalid params",
        "data": {"path": path, "reason": reason},
    }


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
async def test_a_device_is_refused_without_being_read(quiet_log: pytest.LogCaptureFixture) -> None:
    sandbox = FsSandbox(["/dev"])
    error = await refused(sandbox.read_text("/dev/zero"))
    assert error.data == {"path": "/dev/zero", "reason": "the path is a device, not a regular file"}


async def test_an_overlong_path_is_refused_and_echoed_only_clipped(
    root: Path, quiet_log: pytest.LogCaptureFixture
) -> None:
    path = str(root) + "/a" * 100_000
    sandbox = FsSandbox([root])

    read = await refused(sandbox.read_text(path))
    write = await refused(sandbox.write_text(path, "x"))

    for error in (read, write):
        assert error.code == INVALID_PARAMS
        assert error.data["reason"] == f"the path is {len(path)} bytes long; the system allows 4095"
        assert error.data["path"] == clipped(path)


# -- writing -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["a" * 255, "日" * 85, "é" * 127 + "z", "x" * 254 + ".", "🙂" * 63 + "abc"],
    ids=["ascii", "three-byte", "two-byte", "dot-end", "four-byte"],
)
async def test_a_file_name_of_255_bytes_can_be_written(root: Path, name: str) -> None:
    assert len(name.encode()) == 255
    sandbox = FsSandbox([root])
    target = root / "dir" / name
    with anyio.fail_after(10):
        await sandbox.write_text(str(target), "first")
        await sandbox.write_text(str(target), "second")  # replacing needs the temp file too
    assert target.read_text() == "second"
    assert os.listdir(root / "dir") == [name]  # no temp file left


@pytest.mark.parametrize("name", ["a" * 256, "日" * 85 + "a"], ids=["ascii", "multi-byte"])
async def test_a_file_name_of_256_bytes_is_refused_clearly(
    root: Path, name: str, quiet_log: pytest.LogCaptureFixture
) -> None:
    sandbox = FsSandbox([root])
    error = await refused(sandbox.write_text(str(root / name), "x"))
    assert error.to_wire() == {
        "code": INVALID_PARAMS,
        "message": "Invalid params",
        "data": {
            "path": clipped(str(root / name)),
            "reason": "the file name is 256 bytes long; this file system allows 255",
        },
    }
    assert os.listdir(root) == []


async def test_a_directory_name_of_256_bytes_is_refused_clearly(
    root: Path, quiet_log: pytest.LogCaptureFixture
) -> None:
    sandbox = FsSandbox([root])
    error = await refused(sandbox.write_text(str(root / ("d" * 256) / "f.txt"), "x"))
    assert error.code == INVALID_PARAMS
    assert error.data["reason"] == "a name in the path is longer than the file system allows"
    assert os.listdir(root) == []


@pytest.mark.parametrize(
    ("make", "content", "reason"),
    [
        (
            lambda r: str(r / "f.txt"),
            "bad \ud800 half",
            "the content is not valid Unicode: a lone surrogate at character 4",
        ),
        (
            lambda r: str(r / "new") + "/",
            "x",
            "the path ends with a separator, so it names a directory, not a file",
        ),
        (lambda r: str(r), "x", "the path is a sandbox root, not a file"),
    ],
    ids=["surrogate", "trailing-slash", "root"],
)
async def test_a_write_of_what_cannot_be_a_text_file_is_invalid_params(
    root: Path, make: Any, content: str, reason: str, quiet_log: pytest.LogCaptureFixture
) -> None:
    sandbox = FsSandbox([root])
    path = make(root)
    error = await refused(sandbox.write_text(path, content))
    assert error.data == {"path": path, "reason": reason}
    assert os.listdir(root) == []


# -- over the wire -------------------------------------------------------------------------------------


async def test_hostile_fs_requests_over_the_wire_cost_the_agent_an_error_and_log_no_traceback(
    tmp_path: Path, quiet_log: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "f.txt").write_text("one\ntwo\n")
    os.mkfifo(tmp_path / "pipe")
    hostile: list[dict[str, Any]] = [
        {"path": str(tmp_path)},
        {"path": str(tmp_path / "sub")},
        {"path": str(tmp_path / "pipe")},
        {"path": str(tmp_path / "f.txt"), "line": -1},
        {"path": str(tmp_path / "f.txt"), "limit": 0},
        {"path": str(tmp_path / "f.txt"), "line": 10**30},
        {"path": str(tmp_path / "f.txt"), "line": 2**64 - 1},
    ]
    replies: list[Any] = []

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        for request in hostile:
            try:
                replies.append(await agent.ask("fs/read_text_file", {"sessionId": "s1", **request}))
            except RequestError as exc:
                replies.append(exc.to_wire())
        # A mistyped line/limit is invalid params too (the schema no longer lets a receiver
        # default them), and the error names the field.
        try:
            await agent.ask(
                "fs/read_text_file",
                {"sessionId": "s1", "path": str(tmp_path / "f.txt"), "line": 1.5, "limit": True},
            )
        except RequestError as exc:
            replies.append(exc.to_wire())
        return {"stopReason": "end_turn"}

    async with connected(FakeAgent(handlers={"session/prompt": prompt}), fs=FsSandbox([tmp_path])) as client:
        with anyio.fail_after(10):
            await (await ready_session(client)).prompt("go")

    assert [reply.get("code") for reply in replies[:-1]] == [INVALID_PARAMS] * len(hostile)
    assert [reply["data"]["reason"] for reply in replies[:-1]] == [
        "the path is a sandbox root, a directory, not a regular file",
        "the path is a directory, not a regular file",
        "the path is a named pipe (FIFO), not a regular file",
        "line must be at least 1 (the first line is 1)",
        "limit must be at least 1 (omit it to read to the end)",
        f"line must be at most {MAX_LINE_ARGUMENT}",
        f"line must be at most {MAX_LINE_ARGUMENT}",
    ]
    assert replies[-1] == {
        "code": INVALID_PARAMS,
        "message": "Invalid params",
        "data": {"details": "Expected `int | null`, got `float` - at `$.line`"},
    }


# -- permission: ambiguous and oversized option lists --------------------------------------------------


def question(*options: tuple[str, str]) -> PermissionQuestion:
    return PermissionQuestion(
        session_id="s1",
        tool_call_id="call_1",
        title="Run rm -rf",
        kind="execute",
        raw_input=None,
        options=tuple(
            PermissionOption(option_id, f"{kind} {option_id}", kind) for option_id, kind in options
        ),
    )


@pytest.mark.parametrize(
    ("options", "deny_answer", "allow_answer"),
    [
        ([("x", "allow_once"), ("x", "reject_once")], None, None),
        ([("x", "reject_once"), ("x", "allow_always")], None, None),
        ([("x", "allow_once"), ("x", "reject_once"), ("n", "reject_always")], "n", None),
        ([("x", "allow_once"), ("x", "reject_once"), ("y", "allow_always")], None, "y"),
        (
            [("a", "allow_once"), ("a", "allow_always"), ("r", "reject_once"), ("r", "reject_always")],
            "r",
            "a",
        ),
        ([("x", "reject_once"), ("x", "ask_me_later")], None, None),
        ([("x", "allow_once"), ("x", "ask_me_later"), ("r", "reject_once")], "r", None),
        ([("", "reject_once"), ("", "allow_once")], None, None),
        ([("", "reject_once"), ("ok", "allow_once")], "", "ok"),
    ],
    ids=[
        "shared-only",
        "shared-always",
        "deny-takes-the-clean-reject",
        "allow-takes-the-clean-allow",
        "same-side-sharing-is-fine",
        "shared-with-an-unknown-kind",
        "allow-shared-with-an-unknown-kind",
        "empty-shared",
        "empty-ids-are-ids",
    ],
)
async def test_a_policy_never_answers_an_id_that_also_labels_an_option_of_another_kind(
    options: list[tuple[str, str]], deny_answer: str | None, allow_answer: str | None
) -> None:
    asked = question(*options)
    with anyio.fail_after(10):
        denied = await DenyPolicy().decide(asked)
        allowed = await AllowPolicy().decide(asked)
    answers = [
        None if decision is PermissionOutcome.CANCELLED else decision.option_id
        for decision in (denied, allowed)
    ]
    assert answers == [deny_answer, allow_answer]


async def test_a_callback_that_fails_falls_back_to_a_deny_that_skips_a_shared_id() -> None:
    async def broken(q: PermissionQuestion) -> str | None:
        raise RuntimeError("ui crashed")

    asked = question(("x", "allow_once"), ("x", "reject_once"))
    with anyio.fail_after(10):
        assert await CallbackPolicy(broken).decide(asked) is PermissionOutcome.CANCELLED


async def test_a_huge_option_list_with_huge_ids_gets_a_clear_answer(caplog: pytest.LogCaptureFixture) -> None:
    huge_id = "i" * 1_000_000
    options = [(f"allow-{n}", "allow_once") for n in range(100_000)]
    options += [(huge_id, "reject_always"), ("allow-7", "reject_once")]
    asked = question(*options)

    async def confused(q: PermissionQuestion) -> str | None:
        return huge_id + "?"

    with anyio.fail_after(30):
        denied = await DenyPolicy().decide(asked)
        allowed = await AllowPolicy().decide(asked)
        fallback = await CallbackPolicy(confused).decide(asked)

    assert denied == fallback == PermissionOption(huge_id, f"reject_always {huge_id}", "reject_always")
    assert allowed == PermissionOption("allow-0", "allow_once allow-0", "allow_once")
    assert max(len(record.getMessage()) for record in caplog.records) < 1000  # the id is not echoed whole


option_kinds = st.sampled_from(["allow_once", "allow_always", "reject_once", "reject_always", "other"])
option_lists = st.lists(st.tuples(st.sampled_from(["a", "b", "c", ""]), option_kinds), max_size=8)


@pytest.mark.fuzz
@given(options=option_lists)
async def test_deny_and_allow_answer_only_ids_no_option_of_the_other_side_carries(
    options: list[tuple[str, str]],
) -> None:
    asked = question(*options)
    kinds_of: dict[str, set[str]] = {}
    for option_id, kind in options:
        kinds_of.setdefault(option_id, set()).add(kind)
    sides: list[tuple[PermissionPolicy, set[str]]] = [
        (DenyPolicy(), {"reject_once", "reject_always"}),
        (AllowPolicy(), {"allow_once", "allow_always"}),
    ]
    for policy, side in sides:
        decision = await policy.decide(asked)
        if decision is PermissionOutcome.CANCELLED:
            # Withdrawn only when no id of this side is free of the other kinds.
            assert not any(kind in side and kinds_of[option_id] <= side for option_id, kind in options)
        else:
            assert kinds_of[decision.option_id] <= side


@pytest.mark.parametrize(
    ("permission", "options", "outcome"),
    [
        ("deny", [("x", "allow_once"), ("x", "reject_once")], {"outcome": "cancelled"}),
        ("allow", [("x", "allow_once"), ("x", "reject_once")], {"outcome": "cancelled"}),
        (
            "deny",
            [("x", "allow_once"), ("x", "reject_once"), ("no", "reject_always")],
            {"outcome": "selected", "optionId": "no"},
        ),
        (
            "allow",
            [("x", "allow_always"), ("x", "allow_once"), ("r", "reject_once")],
            {"outcome": "selected", "optionId": "x"},
        ),
    ],
    ids=["deny-shared", "allow-shared", "deny-clean", "allow-same-side"],
)
async def test_a_permission_request_with_shared_ids_is_answered_conservatively_over_the_wire(
    permission: str, options: list[tuple[str, str]], outcome: dict[str, str]
) -> None:
    answers: list[Any] = []
    request = {
        "sessionId": "s1",
        "toolCall": {"toolCallId": "c1", "title": "rm -rf /", "kind": "execute"},
        "options": [{"optionId": option_id, "name": kind, "kind": kind} for option_id, kind in options],
    }

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        answers.append(await agent.ask("session/request_permission", request))
        return {"stopReason": "end_turn"}

    async with connected(FakeAgent(handlers={"session/prompt": prompt}), permission=permission) as client:
        with anyio.fail_after(10):
            await (await ready_session(client)).prompt("go")
    assert answers == [{"outcome": outcome}]
