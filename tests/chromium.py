"""A headless chromium driven over the DevTools protocol on a pipe, for tests that look at a page.

``chromium --remote-debugging-pipe`` reads protocol messages on its fd 3 and writes them on its fd 4,
each a JSON object ended by a NUL byte. :func:`open_page` starts it in its own process group with a
private profile under the test's directory, attaches to one page of the given size, and at the end
kills the whole group, and every process it started that left it (found by a tag in their
environment), and waits until each is gone (a pidfd each: no polling).
Every wait is bounded by the caller's ``anyio.fail_after``.

The tests skip when chromium is not installed, unless ``SUBAGENT_REQUIRE_CHROMIUM=1`` (CI) makes
that a failure.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import anyio
import pytest

from tests.leaks import live_group_members, process_info

__all__ = ["Page", "chromium_or_skip", "open_page"]

TAG_VARIABLE: Final = "SUBAGENT_CHROMIUM_TAG"
"""Set in chromium's environment (inherited by all it starts), so each of its processes can be found."""
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
"""The largest protocol message read (a screenshot is a few hundred KiB of base64)."""

_LAUNCHER: Final = """\
import fcntl, os, sys
# The pipes arrive on whatever fds the parent had: put them on 3 and 4, where chromium looks.
commands, replies = (fcntl.fcntl(int(fd), fcntl.F_DUPFD, 10) for fd in sys.argv[1:3])
os.dup2(commands, 3)
os.dup2(replies, 4)
for fd in {int(sys.argv[1]), int(sys.argv[2]), commands, replies} - {3, 4}:
    os.close(fd)
os.execv(sys.argv[3], sys.argv[3:])
"""


def chromium_or_skip() -> str:
    """The chromium executable; skips the test when there is none (fails it under CI's requirement)."""
    found = shutil.which("chromium")
    if found is None:
        if os.environ.get("SUBAGENT_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium is not installed, and SUBAGENT_REQUIRE_CHROMIUM=1 requires it")
        pytest.skip("chromium is not installed")
    return found


class ProtocolError(Exception):
    """Chromium answered a command with an error."""


class Page:
    """One page of the browser: commands go to it; its events are kept until awaited."""

    def __init__(self, commands: int, replies: int) -> None:
        self._commands = commands
        self._replies = replies
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        self.session_id: str | None = None
        self.dialogs: list[dict[str, Any]] = []
        """Every ``Page.javascriptDialogOpening`` seen (an ``alert()`` the page ran)."""

    async def _read_message(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            await anyio.wait_readable(self._replies)
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                raise EOFError("chromium closed its end of the pipe")
            self._buffer += chunk
            if len(self._buffer) > MAX_MESSAGE_BYTES:
                raise ProtocolError("a message from chromium over the size limit")
        message, _, self._buffer = self._buffer.partition(b"\0")
        decoded: dict[str, Any] = json.loads(message)
        if decoded.get("method") == "Page.javascriptDialogOpening":
            self.dialogs.append(decoded)
        return decoded

    async def send(self, method: str, params: dict[str, Any] | None = None, *, browser: bool = False) -> Any:
        """Send a command (to the page, or with ``browser`` to the browser) and return its result."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if not browser and self.session_id is not None:
            message["sessionId"] = self.session_id
        data = json.dumps(message).encode() + b"\0"
        while data:
            await anyio.wait_writable(self._commands)
            data = data[os.write(self._commands, data) :]
        while True:
            reply = await self._read_message()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise ProtocolError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self._events.append(reply)

    async def event(self, method: str) -> dict[str, Any]:
        """The first event ``method`` not awaited yet (read from the pipe until it comes)."""
        while True:
            for index, seen in enumerate(self._events):
                if seen["method"] == method:
                    return self._events.pop(index)
            reply = await self._read_message()
            if "method" in reply:
                self._events.append(reply)

    async def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (awaited when it is a promise); a thrown error fails."""
        result = await self.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}
        )
        if "exceptionDetails" in result:
            raise ProtocolError(f"the page threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def open(self, url: str) -> None:
        """Load ``url`` and wait for its load event."""
        await self.send("Page.navigate", {"url": url})
        await self.event("Page.loadEventFired")

    async def wait_for_ready(self) -> None:
        """Wait until the page marks itself ready (``data-ready`` on its root element)."""
        await self.evaluate(
            """new Promise((resolve) => {
                const root = document.documentElement;
                if (root.dataset.ready) return resolve(true);
                new MutationObserver(() => root.dataset.ready && resolve(true))
                    .observe(root, {attributes: true});
            })"""
        )

    async def click(self, selector: str) -> None:
        """A real mouse click (press and release) at the middle of the element ``selector`` finds."""
        box = await self.evaluate(
            f"""(() => {{
                const node = document.querySelector({json.dumps(selector)});
                if (!node) return null;
                node.scrollIntoView({{block: "nearest", inline: "nearest"}});
                const r = node.getBoundingClientRect();
                return {{x: r.left + r.width / 2, y: r.top + r.height / 2}};
            }})()"""
        )
        if box is None:
            raise ProtocolError(f"nothing on the page matches {selector!r}")
        for kind in ("mousePressed", "mouseReleased"):
            await self.send(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": box["x"], "y": box["y"], "button": "left", "clickCount": 1},
            )

    async def screenshot(self) -> bytes:
        """The viewport as PNG."""
        result = await self.send("Page.captureScreenshot", {"format": "png"})
        return base64.b64decode(result["data"])


@contextlib.asynccontextmanager
async def open_page(work_dir: Path, *, width: int = 1200, height: int = 700) -> AsyncIterator[Page]:
    """A fresh headless chromium with one page ``width`` x ``height``; everything it started ends after."""
    chromium = chromium_or_skip()
    profile = work_dir / "chromium-profile"
    profile.mkdir()
    commands_read, commands_write = os.pipe()
    replies_read, replies_write = os.pipe()
    flags = [
        "--headless",
        "--remote-debugging-pipe",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
        "--disable-gpu",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--mute-audio",
        "about:blank",
    ]
    if os.geteuid() == 0:
        flags.insert(0, "--no-sandbox")  # chromium refuses to run its sandbox as root
    launcher = [sys.executable, "-c", _LAUNCHER, str(commands_read), str(replies_write), chromium, *flags]
    tag = uuid.uuid4().hex
    try:
        with open(work_dir / "chromium.log", "wb") as log:  # noqa: ASYNC230 (a local file, opened once)
            process = await anyio.open_process(
                launcher,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(commands_read, replies_write),
                start_new_session=True,
                env={**os.environ, TAG_VARIABLE: tag},
            )
    except BaseException:
        os.close(commands_write)
        os.close(replies_read)
        raise
    finally:
        os.close(commands_read)  # chromium's ends: it has them now (or never will)
        os.close(replies_write)
    for fd in (commands_write, replies_read):
        os.set_blocking(fd, False)
        fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
    page = Page(commands_write, replies_read)
    try:
        targets = await page.send("Target.getTargets", browser=True)
        target = next(info for info in targets["targetInfos"] if info["type"] == "page")
        attached = await page.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, browser=True
        )
        page.session_id = attached["sessionId"]
        await page.send("Page.enable")
        await page.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        yield page
    finally:
        with anyio.CancelScope(shield=True):
            await _kill_all(process, tag)
            os.close(commands_write)
            os.close(replies_read)


def _tagged(tag: str) -> list[int]:
    """The running processes whose environment carries ``TAG_VARIABLE=tag``."""
    marker = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as environ:
                if marker not in environ.read().split(b"\0"):
                    continue
        except OSError:
            continue  # gone, or not ours to read
        info = process_info(int(entry.name))
        if info is not None and not info.is_zombie:
            found.append(info.pid)
    return found


async def _kill_all(process: anyio.abc.Process, tag: str) -> None:
    """SIGKILL chromium's process group and every process it started (found by ``tag``: its crash
    handler leaves the group), then wait for each to be gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    await process.wait()
    with anyio.fail_after(30):
        # A process exiting may no longer show its environment, but is still in the group until it is gone.
        while pids := {*_tagged(tag), *(member.pid for member in live_group_members(process.pid))}:
            for pid in pids:
                try:
                    pidfd = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue  # gone already
                try:
                    os.kill(pid, signal.SIGKILL)
                    # A pidfd reads ready when its process has exited: no polling.
                    await anyio.wait_readable(pidfd)
                finally:
                    os.close(pidfd)
    assert live_group_members(process.pid) == []
