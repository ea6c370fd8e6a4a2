"""The client-side handlers: the fs sandbox and the permission policies, on asyncio and trio."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent.acp import RequestError
from subagent.acp.handlers import (
    AllowPolicy,
    CallbackPolicy,
    DenyPolicy,
    FsSandbox,
    PermissionOption,
    PermissionOutcome,
    PermissionQuestion,
    permission_policy,
)
from subagent.types import freeze_json

pytestmark = pytest.mark.anyio

INVALID_PARAMS = -32602
RESOURCE_NOT_FOUND = -32002


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """A sandbox root beside an outside directory holding a secret, with escape hatches inside."""
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    (root / "src").mkdir(parents=True)
    outside.mkdir()
    (root / "src" / "lines.txt").write_text("one\ntwo\nthree\nfour\n")
    (outside / "secret.txt").write_text("top secret\n")
    (root / "link-to-secret").symlink_to(outside / "secret.txt")
    (root / "link-to-outside").symlink_to(outside, target_is_directory=True)
    (root / "inner-link").symlink_to(root / "src" / "lines.txt")
    return {"root": root, "outside": outside, "secret": outside / "secret.txt"}


def snapshot_tree(path: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under `path` with its mode and content: proof that nothing there was touched."""
    entries: dict[str, tuple[int, bytes | None]] = {}
    for entry in sorted(path.rglob("*")):
        info = entry.lstat()
        content = entry.read_bytes() if stat.S_ISREG(info.st_mode) else None
        entries[str(entry.relative_to(path))] = (info.st_mode, content)
    return entries


async def refused(coro: Any) -> RequestError:
    with anyio.fail_after(5), pytest.raises(RequestError) as caught:
        await coro
    return caught.value


# -- reading -----------------------------------------------------------------------------------------


async def test_a_read_inside_the_root_returns_the_text(layout: dict[str, Path]) -> None:
    sandbox = FsSandbox([layout["root"]])
    with anyio.fail_after(5):
        text = await sandbox.read_text(str(layout["root"] / "src" / "lines.txt"))
    assert text == "one\ntwo\nthree\nfour\n"


@pytest.mark.parametrize(
    ("line", "limit", "expected"),
    [
        (2, None, "two\nthree\nfour\n"),
        (2, 2, "two\nthree\n"),
        (None, 1, "one\n"),
        (4, 10, "four\n"),
        (9, 1, ""),
    ],
)
async def test_a_read_honours_line_and_limit(
    layout: dict[str, Path], line: int | None, limit: int | None, expected: str
) -> None:
    sandbox = FsSandbox([layout["root"]])
    with anyio.fail_after(5):
        text = await sandbox.read_text(str(layout["root"] / "src" / "lines.txt"), line=line, limit=limit)
    assert text == expected


async def test_a_symlink_that_stays_inside_the_root_is_followed(layout: dict[str, Path]) -> None:
    sandbox = FsSandbox([layout["root"]])
    with anyio.fail_after(5):
        assert await sandbox.read_text(str(layout["root"] / "inner-link"), limit=1) == "one\n"


async def test_reading_a_missing_file_is_resource_not_found(layout: dict[str, Path]) -> None:
    sandbox = FsSandbox([layout["root"]])
    missing = str(layout["root"] / "nope.txt")
    error = await refused(sandbox.read_text(missing))
    assert error.to_wire() == {
        "code": RESOURCE_NOT_FOUND,
        "message": "Resource not found",
        "data": {"uri": missing},
    }


@pytest.mark.parametrize(
    ("make_path", "reason"),
    [
        (lambda d: str(d["root"] / "src" / ".." / ".." / "outside" / "secret.txt"), "outside"),
        (lambda d: str(d["secret"]), "outside"),
        (lambda d: str(d["root"] / "link-to-secret"), "outside"),
        (lambda d: str(d["root"] / "link-to-outside" / "secret.txt"), "outside"),
        (lambda d: "src/lines.txt", "absolute"),
        (lambda d: str(d["root"] / "src") + "/\0lines.txt", "NUL"),
        (lambda d: "", "empty"),
    ],
    ids=["dotdot", "absolute-outside", "file-symlink", "dir-symlink", "relative", "nul", "empty"],
)
async def test_a_read_that_leaves_the_root_is_refused_with_invalid_params(
    layout: dict[str, Path], make_path: Any, reason: str
) -> None:
    sandbox = FsSandbox([layout["root"]])
    path = make_path(layout)
    error = await refused(sandbox.read_text(path))
    assert error.code == INVALID_PARAMS
    assert error.data["path"] == path
    assert reason in error.data["reason"]
    assert "top secret" not in repr(error.to_wire())


async def test_reading_a_fifo_is_refused_without_hanging(layout: dict[str, Path]) -> None:
    fifo = layout["root"] / "pipe"
    os.mkfifo(fifo)
    sandbox = FsSandbox([layout["root"]])
    error = await refused(sandbox.read_text(str(fifo)))
    assert error.code == INVALID_PARAMS
    assert error.data["reason"] == "the path is a named pipe (FIFO), not a regular file"


async def test_a_read_larger_than_the_cap_is_refused(layout: dict[str, Path]) -> None:
    big = layout["root"] / "big.txt"
    big.write_text("x" * 99 + "\n" + "y" * 99 + "\n")
    sandbox = FsSandbox([layout["root"]], max_read_bytes=150)
    error = await refused(sandbox.read_text(str(big)))
    assert error.code == INVALID_PARAMS
    with anyio.fail_after(5):
        assert await sandbox.read_text(str(big), limit=1) == "x" * 99 + "\n"


async def test_a_path_swapped_for_a_symlink_after_the_check_is_caught_on_the_opened_descriptor(
    layout: dict[str, Path],
) -> None:
    class RacingSandbox(FsSandbox):
        """Its check passes (as if the path were swapped right after it ran)."""

        def resolve(self, path: str) -> Path:
            return Path(path)

    sandbox = RacingSandbox([layout["root"]])
    (layout["outside"] / "sub").mkdir()
    (layout["outside"] / "sub" / "secret.txt").write_text("deeper secret")
    before = snapshot_tree(layout["outside"])
    swapped = layout["root"] / "link-to-outside"
    for path in [swapped / "secret.txt", swapped / "sub" / "secret.txt"]:
        error = await refused(sandbox.read_text(str(path)))
        assert error.to_wire()["data"] == {
            "path": str(path),
            "reason": "a parent of the path is a symlink or not a directory",
        }
    for path in [swapped / "new.txt", swapped / "sub" / "new.txt", swapped / "fresh" / "dir" / "new.txt"]:
        error = await refused(sandbox.write_text(str(path), "x"))
        assert error.to_wire()["data"] == {
            "path": str(path),
            "reason": "a parent of the path is a symlink or not a directory",
        }
    assert snapshot_tree(layout["outside"]) == before


# -- writing -----------------------------------------------------------------------------------------


async def test_a_write_creates_the_file_and_missing_parents_inside_the_root(layout: dict[str, Path]) -> None:
    sandbox = FsSandbox([layout["root"]])
    target = layout["root"] / "new" / "deeper" / "file.txt"
    with anyio.fail_after(5):
        await sandbox.write_text(str(target), "héllo\n")
    assert target.read_bytes() == "héllo\n".encode()
    assert sorted(p.name for p in target.parent.iterdir()) == ["file.txt"]  # no temp file left


async def test_a_write_replaces_atomically_and_keeps_the_files_mode(layout: dict[str, Path]) -> None:
    sandbox = FsSandbox([layout["root"]])
    target = layout["root"] / "src" / "lines.txt"
    target.chmod(0o640)
    inode_before = target.stat().st_ino
    with anyio.fail_after(5):
        await sandbox.write_text(str(target), "replaced")
    assert target.read_text() == "replaced"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert target.stat().st_ino != inode_before  # a new file renamed into place, not rewritten in place
    assert sorted(p.name for p in target.parent.iterdir()) == ["lines.txt"]


@pytest.mark.parametrize(
    "make_path",
    [
        lambda d: str(d["root"] / ".." / "outside" / "secret.txt"),
        lambda d: str(d["secret"]),
        lambda d: str(d["root"] / "link-to-secret"),
        lambda d: str(d["root"] / "link-to-outside" / "planted.txt"),
        lambda d: str(d["outside"] / "planted.txt"),
    ],
    ids=["dotdot", "absolute-outside", "file-symlink", "dir-symlink", "new-file-outside"],
)
async def test_a_write_that_leaves_the_root_is_refused_and_touches_nothing_outside(
    layout: dict[str, Path], make_path: Any
) -> None:
    sandbox = FsSandbox([layout["root"]])
    before = snapshot_tree(layout["outside"])
    link_before = os.readlink(layout["root"] / "link-to-secret")
    error = await refused(sandbox.write_text(make_path(layout), "pwned"))
    assert error.code == INVALID_PARAMS
    assert snapshot_tree(layout["outside"]) == before
    assert os.readlink(layout["root"] / "link-to-secret") == link_before


@pytest.mark.parametrize("target", ["root", "dir"])
async def test_writing_over_a_directory_or_the_root_is_refused(layout: dict[str, Path], target: str) -> None:
    sandbox = FsSandbox([layout["root"]])
    path = layout["root"] if target == "root" else layout["root"] / "src"
    error = await refused(sandbox.write_text(str(path), "x"))
    assert error.code == INVALID_PARAMS
    assert (layout["root"] / "src" / "lines.txt").read_text() == "one\ntwo\nthree\nfour\n"


def test_a_sandbox_root_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not an existing directory"):
        FsSandbox([tmp_path / "missing"])


# -- permission ----------------------------------------------------------------------------------------

ALLOW_ONCE = PermissionOption("a1", "Allow once", "allow_once")
ALLOW_ALWAYS = PermissionOption("a2", "Always allow", "allow_always")
REJECT_ONCE = PermissionOption("r1", "Reject", "reject_once")
REJECT_ALWAYS = PermissionOption("r2", "Never", "reject_always")


def question(*options: PermissionOption, raw_input: Any = None) -> PermissionQuestion:
    return PermissionQuestion(
        session_id="s1",
        tool_call_id="call_2",
        title="Edit config.json",
        kind="edit",
        raw_input=freeze_json(raw_input),
        options=options,
    )


@pytest.mark.parametrize(
    ("policy", "options", "expected"),
    [
        (AllowPolicy(), (REJECT_ONCE, ALLOW_ALWAYS, ALLOW_ONCE), ALLOW_ONCE),
        (AllowPolicy(), (REJECT_ONCE, ALLOW_ALWAYS), ALLOW_ALWAYS),
        (AllowPolicy(), (REJECT_ONCE,), PermissionOutcome.CANCELLED),
        (DenyPolicy(), (ALLOW_ONCE, REJECT_ALWAYS, REJECT_ONCE), REJECT_ONCE),
        (DenyPolicy(), (ALLOW_ONCE, REJECT_ALWAYS), REJECT_ALWAYS),
        (DenyPolicy(), (ALLOW_ONCE,), PermissionOutcome.CANCELLED),
    ],
)
async def test_allow_and_deny_answer_at_once_with_an_offered_option(
    policy: AllowPolicy | DenyPolicy, options: tuple[PermissionOption, ...], expected: object
) -> None:
    with anyio.fail_after(5):
        assert await policy.decide(question(*options)) == expected


async def test_a_callback_policy_returns_the_option_the_callback_names() -> None:
    async def choose(q: PermissionQuestion) -> str | None:
        return "a2"

    with anyio.fail_after(5):
        assert (
            await CallbackPolicy(choose).decide(question(ALLOW_ONCE, ALLOW_ALWAYS, REJECT_ONCE))
            == ALLOW_ALWAYS
        )


async def test_a_callback_returning_none_withdraws_the_question() -> None:
    async def withdraw(q: PermissionQuestion) -> str | None:
        return None

    with anyio.fail_after(5):
        assert await CallbackPolicy(withdraw).decide(question(ALLOW_ONCE)) is PermissionOutcome.CANCELLED


async def test_a_callback_that_never_answers_is_denied_after_its_timeout() -> None:
    never = anyio.Event()

    async def absent_human(q: PermissionQuestion) -> str | None:
        await never.wait()
        return "a1"

    with anyio.fail_after(5):
        decision = await CallbackPolicy(absent_human, timeout=0.05).decide(question(ALLOW_ONCE, REJECT_ONCE))
    assert decision == REJECT_ONCE


async def test_a_callback_that_raises_or_names_an_unoffered_option_falls_back_to_deny(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken(q: PermissionQuestion) -> str | None:
        raise RuntimeError("ui crashed")

    async def confused(q: PermissionQuestion) -> str | None:
        return "not-offered"

    with anyio.fail_after(5):
        assert await CallbackPolicy(broken).decide(question(ALLOW_ONCE, REJECT_ONCE)) == REJECT_ONCE
        assert await CallbackPolicy(confused).decide(question(ALLOW_ONCE, REJECT_ONCE)) == REJECT_ONCE
    messages = [record.getMessage() for record in caplog.records]
    assert any("permission callback raised" in m for m in messages)
    assert any("'not-offered', which the agent did not offer" in m for m in messages)


async def test_a_question_is_a_frozen_snapshot_of_its_raw_input() -> None:
    raw: dict[str, Any] = {"path": "/p/config.json", "edits": [{"line": 1}]}
    q = question(ALLOW_ONCE, raw_input=raw)
    raw["path"] = "/etc/passwd"
    raw["edits"][0]["line"] = 99
    assert q.raw_input["path"] == "/p/config.json"
    assert q.raw_input["edits"][0]["line"] == 1
    with pytest.raises(TypeError):
        q.raw_input["path"] = "/etc/shadow"


def test_permission_policy_builds_from_names_policies_and_callbacks() -> None:
    async def callback(q: PermissionQuestion) -> str | None:
        return None

    deny = DenyPolicy()
    assert isinstance(permission_policy("allow"), AllowPolicy)
    assert isinstance(permission_policy("deny"), DenyPolicy)
    assert permission_policy(deny) is deny
    built = permission_policy(callback)
    assert isinstance(built, CallbackPolicy)
    assert built.callback is callback
    with pytest.raises(ValueError, match="unknown permission policy"):
        permission_policy("ask")  # type: ignore[arg-type]
