"""The file router: an agent's ``fs/*`` and ``terminal/*`` requests served between its pipes and a relay.

The agent's pipes and the relay are in-memory byte pipes; terminals run real commands on this host. A
test plays both the agent (writing its stdout, reading its stdin) and the caller (reading the yielded
stdout, writing the yielded stdin). Nothing sleeps to wait: every wait is for the event itself, under
``anyio.fail_after`` as a hang guard.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import sys
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from subagent.acp._file_router import route_files
from subagent.acp.client import AcpClient
from subagent.acp.connection import Connection
from subagent.acp.handlers import FsSandbox
from subagent.acp.terminals import TerminalHost
from tests.leaks import assert_no_leaks, process_is_gone
from tests.test_client import PERMISSION, FakeAgent, answer_initialize, answer_new_session, text_chunk
from tests.test_connection import Pipe, open_pipe

pytestmark = pytest.mark.anyio

EVENT_TIMEOUT = 30
"""A hang guard for every wait: generous, since a loaded machine starts interpreters slowly."""

OUTSIDE = "the path is outside the directories this agent may access"


def request(request_id: Any, method: str, params: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}).encode()


def notification(method: str, params: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "method": method, "params": params}).encode()


def update(text: str) -> bytes:
    chunk = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}}
    return notification("session/update", {"sessionId": "s1", "update": chunk})


@dataclass
class Routed:
    """Both ends around a router: the agent's pipes, and the streams the relay would use.

    A relay reads the yielded stdout all the time (routing happens as it reads): so does a task here,
    collecting what reaches the caller, unless the test reads the stdout itself.
    """

    agent_stdout: Pipe
    """The agent writes here (``agent_stdout.writer``)."""
    agent_stdin: Pipe
    """What reaches the agent: one item per write to its stdin."""
    stdin: anyio.abc.ByteSendStream
    stdout: anyio.abc.ByteReceiveStream
    heard: bytearray = field(default_factory=bytearray)
    """What was forwarded to the caller and not yet taken by `caller_hears`."""
    ended: bool = False
    changed: anyio.Event = field(default_factory=anyio.Event)

    async def relay(self) -> None:
        try:
            while True:
                self.heard += await self.stdout.receive()
                self.changed.set()
        except anyio.EndOfStream:
            self.ended = True
            self.changed.set()

    async def _wait_for_change(self) -> None:
        self.changed = anyio.Event()
        await self.changed.wait()

    async def agent_says(self, *lines: bytes) -> None:
        await self.agent_stdout.writer.send(b"".join(line + b"\n" for line in lines))

    async def agent_hears(self) -> bytes:
        """The next write to the agent's stdin."""
        with anyio.fail_after(EVENT_TIMEOUT):
            return await self.agent_stdin.items.receive()  # type: ignore[return-value]

    async def agent_hears_json(self) -> Any:
        line = await self.agent_hears()
        assert line.endswith(b"\n"), line
        assert line.count(b"\n") == 1, line
        return json.loads(line)

    async def caller_hears(self, count: int = 1) -> list[bytes]:
        """The next ``count`` whole lines forwarded to the caller (without their newlines)."""
        with anyio.fail_after(EVENT_TIMEOUT):
            while self.heard.count(b"\n") < count:
                assert not self.ended, bytes(self.heard)
                await self._wait_for_change()
        *lines, rest = bytes(self.heard).split(b"\n", count)
        self.heard[:] = rest
        return lines

    async def caller_hears_end(self) -> bytes:
        """Everything forwarded until the yielded stdout ended."""
        with anyio.fail_after(EVENT_TIMEOUT):
            while not self.ended:
                await self._wait_for_change()
        heard = bytes(self.heard)
        self.heard.clear()
        return heard


@asynccontextmanager
async def routed(*, relay: bool = True, **options: Any) -> AsyncIterator[Routed]:
    """A router between in-memory pipes (closed after it)."""
    async with (
        open_pipe() as agent_stdout,
        open_pipe() as agent_stdin,
        routed_over(agent_stdout, agent_stdin, relay=relay, **options) as router,
    ):
        yield router


@asynccontextmanager
async def routed_over(
    agent_stdout: Pipe, agent_stdin: Pipe, *, relay: bool, **options: Any
) -> AsyncIterator[Routed]:
    """A router between the given pipes, with a task reading its stdout as a relay would (``relay``)."""
    async with route_files(agent_stdin.writer, agent_stdout.reader, **options) as (stdin, stdout):
        router = Routed(agent_stdout, agent_stdin, stdin, stdout)
        async with anyio.create_task_group() as task_group:
            if relay:
                task_group.start_soon(router.relay)
            yield router
            task_group.cancel_scope.cancel()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "notes.txt").write_text("line one\nline two\n")
    return tmp_path / "root"


# -- files ------------------------------------------------------------------------------------------------


async def test_a_read_inside_the_root_is_answered_with_the_exact_content_and_not_forwarded(
    root: Path,
) -> None:
    path = str(root / "notes.txt")
    async with routed(fs_roots=[root]) as router:
        await router.agent_says(request(7, "fs/read_text_file", {"sessionId": "s1", "path": path}))
        assert await router.agent_hears() == (
            b'{"jsonrpc":"2.0","id":7,"result":{"content":"line one\\nline two\\n"}}\n'
        )
        await router.agent_says(update("after"))
        assert await router.caller_hears() == [update("after")]  # the read itself never reached the caller


async def test_a_path_outside_the_root_is_refused_with_invalid_params_and_the_clients_reason(
    root: Path,
) -> None:
    async with routed(fs_roots=[root]) as router:
        await router.agent_says(
            request("r-1", "fs/read_text_file", {"sessionId": "s1", "path": "/etc/hostname"})
        )
        assert await router.agent_hears_json() == {
            "jsonrpc": "2.0",
            "id": "r-1",
            "error": {
                "code": -32602,
                "message": "Invalid params",
                "data": {"path": "/etc/hostname", "reason": OUTSIDE},
            },
        }


async def test_a_written_file_reads_back_and_lies_on_this_host(root: Path) -> None:
    path = str(root / "new" / "..") + "/written.txt"
    async with routed(fs_roots=[root]) as router:
        await router.agent_says(
            request(1, "fs/write_text_file", {"sessionId": "s1", "path": path, "content": "é\n"})
        )
        assert await router.agent_hears() == b'{"jsonrpc":"2.0","id":1,"result":{}}\n'
        await router.agent_says(request(2, "fs/read_text_file", {"sessionId": "s1", "path": path}))
        assert await router.agent_hears() == '{"jsonrpc":"2.0","id":2,"result":{"content":"é\\n"}}\n'.encode()
    assert (root / "written.txt").read_text() == "é\n"


async def test_without_terminals_a_terminal_request_is_forwarded_to_the_caller(root: Path) -> None:
    create = request(3, "terminal/create", {"sessionId": "s1", "command": "true"})
    async with routed(fs_roots=[root]) as router:
        await router.agent_says(create)
        assert await router.caller_hears() == [create]


LOCAL_CASES = [
    request(1, "fs/read_text_file", {"sessionId": "s1", "path": "/etc/hostname"}),
    request(2, "fs/read_text_file", {"sessionId": "s1", "path": "relative.txt"}),
    request(3, "fs/read_text_file", {"sessionId": "s1"}),
    request(4, "fs/read_text_file", {"sessionId": "s1", "path": "ROOT/missing.txt"}),
    request(5, "fs/read_text_file", {"sessionId": "s1", "path": "ROOT", "line": 0}),
    request(6, "fs/write_text_file", {"sessionId": "s1", "path": "ROOT", "content": "x"}),
    request(7, "fs/list_directory", {"sessionId": "s1", "path": "ROOT"}),
    request(8, "terminal/output", {"sessionId": "s1", "terminalId": "nope"}),
    request(9, "terminal/create", {"sessionId": "s1", "command": "true", "cwd": "/"}),
    request(10, "terminal/create", {"sessionId": "s1", "command": "no-such-program-here"}),
    request(11, "terminal/wait_for_exit", [1, 2]),
    request(1.5, "fs/read_text_file", {"sessionId": "s1", "path": "ROOT/notes.txt"}),
    request(True, "terminal/output", {"sessionId": "s1", "terminalId": "t"}),
    b'{"jsonrpc":"1.0","id":12,"method":"fs/read_text_file","params":{}}',
    b'{"jsonrpc":"2.0","id":13,"method":"fs/read_text_file","params":{"sessionId":"s1","path":"\\ud800"}}',
]


async def test_every_refusal_is_byte_for_byte_what_the_acp_client_answers_locally(root: Path) -> None:
    lines = [line.replace(b"ROOT", str(root).encode()) for line in LOCAL_CASES]
    sandbox = FsSandbox([root])
    local: list[bytes] = []
    async with (
        open_pipe() as to_client,
        open_pipe() as to_agent,
        TerminalHost(sandbox=sandbox) as host,
        # The node's router serves files inside its roots without the caller's permission policy (see
        # AcpProvider's warning): what is compared here is the sandbox's answers, so the client allows.
        AcpClient(
            to_client.reader, to_agent.writer, fs=sandbox, terminals=host, permission="allow"
        ) as client,
    ):
        async with anyio.create_task_group() as task_group:  # a session "s1", for the client's own check
            task_group.start_soon(client.new_session, str(root))
            with anyio.fail_after(EVENT_TIMEOUT):
                new_session = json.loads(await to_agent.items.receive())  # type: ignore[arg-type]
            await to_client.writer.send(
                b'{"jsonrpc":"2.0","id":%d,"result":{"sessionId":"s1"}}\n' % new_session["id"]
            )
        for line in lines:
            await to_client.writer.send(line + b"\n")
            with anyio.fail_after(EVENT_TIMEOUT):
                local.append(await to_agent.items.receive())  # type: ignore[arg-type]
    async with routed(fs_roots=[root], terminals=True) as router:
        for line, expected in zip(lines, local, strict=True):
            await router.agent_says(line)
            assert await router.agent_hears() == expected, line


# -- terminals --------------------------------------------------------------------------------------------


PAUSE = "import signal; signal.pause()"
"""A command that runs until a signal ends it."""


async def create_terminal(router: Routed, code: str) -> dict[str, str]:
    """Start ``code`` with this interpreter in a terminal (request id 1); its handle for other requests."""
    create = {"sessionId": "s1", "command": sys.executable, "args": ["-c", code]}
    await router.agent_says(request(1, "terminal/create", create))
    created = await router.agent_hears_json()
    return {"sessionId": "s1", "terminalId": created["result"]["terminalId"]}


async def test_a_terminal_runs_a_real_command_here_and_reports_its_output_and_exit(root: Path) -> None:
    code = "print('hello from the node')"
    create = {"sessionId": "s1", "command": sys.executable, "args": ["-c", code]}
    async with assert_no_leaks(), routed(fs_roots=[root], terminals=True) as router:
        await router.agent_says(request(1, "terminal/create", create))
        created = await router.agent_hears_json()
        terminal_id = created["result"]["terminalId"]
        assert created == {"jsonrpc": "2.0", "id": 1, "result": {"terminalId": terminal_id}}
        handle = {"sessionId": "s1", "terminalId": terminal_id}
        await router.agent_says(request(2, "terminal/wait_for_exit", handle))
        assert await router.agent_hears_json() == {"jsonrpc": "2.0", "id": 2, "result": {"exitCode": 0}}
        await router.agent_says(request(3, "terminal/output", handle))
        assert await router.agent_hears_json() == {
            "jsonrpc": "2.0",
            "id": 3,
            "result": {"output": "hello from the node\n", "truncated": False, "exitStatus": {"exitCode": 0}},
        }
        await router.agent_says(request(4, "terminal/release", handle))
        assert await router.agent_hears_json() == {"jsonrpc": "2.0", "id": 4, "result": {}}


async def test_a_terminal_starts_in_the_routers_cwd_from_its_environment(root: Path) -> None:
    code = "import os; print(os.getcwd(), *map(os.environ.get, ['NODE', 'EXTRA', 'HOME']))"
    create = {
        "sessionId": "s1",
        "command": sys.executable,
        "args": ["-c", code],
        "env": [{"name": "EXTRA", "value": "from the agent"}],
    }
    async with assert_no_leaks(), routed(terminals=True, cwd=root, env={"NODE": "node-2"}) as router:
        await router.agent_says(request(1, "terminal/create", create))
        handle = {"sessionId": "s1", "terminalId": (await router.agent_hears_json())["result"]["terminalId"]}
        await router.agent_says(request(2, "terminal/wait_for_exit", handle))
        assert (await router.agent_hears_json())["result"] == {"exitCode": 0}
        await router.agent_says(request(3, "terminal/output", handle))
        output = (await router.agent_hears_json())["result"]["output"]
    assert output == f"{root} node-2 from the agent None\n"


@asynccontextmanager
async def pid_reporting_terminal(router: Routed, tmp_path: Path) -> AsyncIterator[tuple[dict[str, str], int]]:
    """A terminal whose command reports its pid through a FIFO (read without polling), then waits for a
    signal: its handle and that pid."""
    fifo = tmp_path / "pid.fifo"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # opened first, so the writer's open never blocks
    code = (
        f"import os, signal; fd = os.open({str(fifo)!r}, os.O_WRONLY); "
        "os.write(fd, str(os.getpid()).encode()); signal.pause()"
    )
    try:
        handle = await create_terminal(router, code)
        with anyio.fail_after(EVENT_TIMEOUT):
            await anyio.wait_readable(fd)
        pid = int(os.read(fd, 64))
        assert not process_is_gone(pid)
        yield handle, pid
    finally:
        os.close(fd)


async def test_a_release_kills_the_running_command(root: Path, tmp_path: Path) -> None:
    async with (
        assert_no_leaks(),
        routed(fs_roots=[root], terminals=True) as router,
        pid_reporting_terminal(router, tmp_path) as (handle, pid),
    ):
        await router.agent_says(request(2, "terminal/release", handle))
        assert await router.agent_hears_json() == {"jsonrpc": "2.0", "id": 2, "result": {}}
        assert process_is_gone(pid)


async def test_leaving_the_block_kills_a_running_terminal(root: Path, tmp_path: Path) -> None:
    async with assert_no_leaks():
        async with (
            routed(terminals=True, cwd=root) as router,
            pid_reporting_terminal(router, tmp_path) as (_, pid),
        ):
            pass
        assert process_is_gone(pid)


async def test_a_slow_wait_for_exit_holds_up_neither_the_stream_nor_other_requests(
    root: Path, tmp_path: Path
) -> None:
    async with (
        assert_no_leaks(),
        routed(fs_roots=[root], terminals=True) as router,
        pid_reporting_terminal(router, tmp_path) as (handle, pid),
    ):
        await router.agent_says(request(2, "terminal/wait_for_exit", handle))
        await router.agent_says(update("meanwhile"))
        assert await router.caller_hears() == [update("meanwhile")]
        path = str(root / "notes.txt")
        await router.agent_says(request(3, "fs/read_text_file", {"sessionId": "s1", "path": path}))
        assert (await router.agent_hears_json())["id"] == 3
        os.kill(pid, signal.SIGTERM)
        assert await router.agent_hears_json() == {
            "jsonrpc": "2.0",
            "id": 2,
            "result": {"signal": "SIGTERM"},
        }


async def test_a_cancel_request_cancels_a_local_wait_and_is_forwarded_too(root: Path) -> None:
    cancel = notification("$/cancel_request", {"requestId": 2})
    async with assert_no_leaks(), routed(terminals=True, cwd=root) as router:
        handle = await create_terminal(router, PAUSE)
        await router.agent_says(request(2, "terminal/wait_for_exit", handle), cancel)
        assert await router.agent_hears_json() == {
            "jsonrpc": "2.0",
            "id": 2,
            "error": {"code": -32800, "message": "Request cancelled"},
        }
        assert await router.caller_hears() == [cancel]


# -- the handshake ----------------------------------------------------------------------------------------


INITIALIZE = (
    b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":1,"clientCapabilities":'
    b'{"fs":{"readTextFile":false,"writeTextFile":false},"terminal":false},"clientInfo":'
    b'{"name":"subagent-seam","version":"1"}}}\n'
)


@pytest.mark.parametrize(
    ("options", "capabilities"),
    [
        ({"fs_roots": True}, b'{"fs":{"readTextFile":true,"writeTextFile":true},"terminal":false}'),
        ({"terminals": True}, b'{"fs":{"readTextFile":false,"writeTextFile":false},"terminal":true}'),
        (
            {"fs_roots": True, "terminals": True},
            b'{"fs":{"readTextFile":true,"writeTextFile":true},"terminal":true}',
        ),
    ],
)
async def test_the_initialize_request_offers_what_the_router_serves_and_nothing_else_changes(
    root: Path, options: dict[str, Any], capabilities: bytes
) -> None:
    if options.get("fs_roots"):
        options["fs_roots"] = [root]
    before = b'{"jsonrpc":"2.0","id":9,"method":"x","params":{"note":"initialize"}}\n'
    after = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"clientCapabilities":{}}}\n'
    async with routed(cwd=root, **options) as router:
        await router.stdin.send(before)
        assert await router.agent_hears() == before
        # Split across writes (a relay may cut anywhere): held until whole, then amended.
        await router.stdin.send(INITIALIZE[:50])
        await router.stdin.send(INITIALIZE[50:] + after)
        assert await router.agent_hears() == (
            INITIALIZE.replace(
                b'{"fs":{"readTextFile":false,"writeTextFile":false},"terminal":false}', capabilities
            )
            + after
        )


async def test_an_initialize_without_capabilities_gets_them(root: Path) -> None:
    async with routed(fs_roots=[root]) as router:
        await router.stdin.send(
            b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":1}}\n'
        )
        assert await router.agent_hears() == (
            b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":1,'
            b'"clientCapabilities":{"fs":{"readTextFile":true,"writeTextFile":true}}}}\n'
        )


async def test_an_answer_waits_for_the_callers_line_to_end(root: Path) -> None:
    path = str(root / "notes.txt")
    async with routed(fs_roots=[root]) as router:
        await router.stdin.send(INITIALIZE)
        await router.agent_hears()
        await router.stdin.send(b'{"jsonrpc":"2.0","id":1,')  # the caller is mid-line
        assert await router.agent_hears() == b'{"jsonrpc":"2.0","id":1,'
        await router.agent_says(request(5, "fs/read_text_file", {"sessionId": "s1", "path": path}))
        with anyio.fail_after(EVENT_TIMEOUT):
            await router.stdin._router.answer_held.wait()  # type: ignore[attr-defined]
        await router.stdin.send(b'"result":null}\n')
        assert await router.agent_hears() == b'"result":null}\n'
        assert (await router.agent_hears_json())["id"] == 5


# -- end to end ---------------------------------------------------------------------------------------------


async def test_a_client_that_offers_no_files_runs_a_turn_whose_agent_reads_and_asks_through_the_router(
    root: Path,
) -> None:
    """The caller's AcpClient (no fs) and an agent, with the router between: the agent is offered files,
    reads one on the router's side, and its permission question is still answered by the caller."""
    path = str(root / "notes.txt")
    answers: list[Any] = []

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        read = await agent.ask("fs/read_text_file", {"sessionId": "s1", "path": path})
        answers.append(await agent.ask("session/request_permission", PERMISSION))
        await agent.update("s1", text_chunk(read["content"]))
        return {"stopReason": "end_turn"}

    agent = FakeAgent(handlers={"initialize": answer_initialize, "session/new": answer_new_session})
    agent.handlers["session/prompt"] = prompt
    async with open_pipe() as agent_stdout, open_pipe() as agent_stdin:
        agent.connection = Connection(
            agent_stdin.reader,
            agent_stdout.writer,
            request_handler=agent.serve_request,
            notification_handler=agent.serve_notification,
            name="agent",
        )
        async with (
            agent.connection,
            route_files(agent_stdin.writer, agent_stdout.reader, fs_roots=[root]) as (stdin, stdout),
            AcpClient(stdout, stdin, permission="allow") as client,
        ):
            with anyio.fail_after(EVENT_TIMEOUT):
                await client.initialize()
                session = await client.new_session(str(root))
                result = await session.prompt("read the notes")
    assert agent.received[0][1]["clientCapabilities"] == {
        "fs": {"readTextFile": True, "writeTextFile": True},
        "elicitation": {"form": {}},
        "session": {"notices": {}, "compaction": {}, "configOptions": {"boolean": {}}},
    }
    assert answers == [{"outcome": {"outcome": "selected", "optionId": "allow"}}]
    assert (result.stop_reason, result.output) == ("end_turn", "line one\nline two\n")


# -- what passes through ----------------------------------------------------------------------------------


async def test_forwarded_lines_keep_their_order_around_served_requests(root: Path) -> None:
    path = str(root / "notes.txt")
    read = request(1, "fs/read_text_file", {"sessionId": "s1", "path": path})
    lines = [
        update("one"),
        read,
        b'{"jsonrpc":"2.0","id":0,"result":{"protocolVersion":1}}',
        b"[INFO] a log line on stdout",
        read.replace(b'"id": 1', b'"id": 2'),
        b'{"broken json',
        notification("fs/read_text_file", {"sessionId": "s1", "path": path}),  # a notification: not served
        b"",
        update("two") + b"\r",
    ]
    async with routed(fs_roots=[root]) as router:
        await router.agent_says(*lines)
        forwarded = [line for line in lines if line not in (read, read.replace(b'"id": 1', b'"id": 2'))]
        assert await router.caller_hears(len(forwarded)) == forwarded
        assert sorted([(await router.agent_hears_json())["id"], (await router.agent_hears_json())["id"]]) == [
            1,
            2,
        ]


async def test_a_line_split_across_reads_is_routed_whole(root: Path) -> None:
    read = request(1, "fs/read_text_file", {"sessionId": "s1", "path": str(root / "notes.txt")}) + b"\n"
    async with routed(fs_roots=[root]) as router:
        for index in range(0, len(read), 7):
            await router.agent_stdout.writer.send(read[index : index + 7])
        assert (await router.agent_hears_json())["result"] == {"content": "line one\nline two\n"}


async def test_an_over_long_line_is_forwarded_in_pieces_in_bounded_memory(root: Path) -> None:
    limit = 64 * 1024
    size = 16 * 1024 * 1024
    piece = b"x" * (64 * 1024)
    head = b'{"jsonrpc":"2.0","id":1,"method":"fs/write_text_file","params":{"content":"'
    async with routed(fs_roots=[root], max_line_bytes=limit, relay=False) as router:

        async def agent() -> None:
            await router.agent_stdout.writer.send(head)
            for _ in range(size // len(piece)):
                await router.agent_stdout.writer.send(piece)
            await router.agent_stdout.writer.send(b'"}}\n' + update("next") + b"\n")

        tracemalloc.start()
        try:
            forwarded = 0
            tail = b""
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(agent)
                with anyio.fail_after(EVENT_TIMEOUT * 4):
                    while not tail.endswith(b"\n" + update("next") + b"\n"):
                        data = await router.stdout.receive()
                        forwarded += len(data)
                        tail = (tail + data)[-200:]
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert forwarded == len(head) + size + 4 + len(update("next")) + 1
    # The line is 16 MiB, the limit 64 KiB: measured peak about 0.15 MiB.
    assert peak < 2 * 1024 * 1024, peak


async def test_a_read_of_the_stdout_never_returns_more_than_asked(root: Path) -> None:
    lines = [update("one"), b"[log] " + b"x" * 100, update("two")]
    async with routed(fs_roots=[root], relay=False) as router:
        await router.agent_stdout.writer.send(lines[0][:20])  # held: the rest comes in the next read
        await router.agent_says(lines[0][20:], *lines[1:])
        await router.agent_stdout.writer.aclose()
        pieces: list[bytes] = []
        with anyio.fail_after(EVENT_TIMEOUT):
            with contextlib.suppress(anyio.EndOfStream):
                while True:
                    pieces.append(await router.stdout.receive(7))
            with pytest.raises(anyio.EndOfStream):  # the end stays the end
                await router.stdout.receive(7)
    assert max(map(len, pieces)) == 7
    assert b"".join(pieces) == b"".join(line + b"\n" for line in lines)


async def test_the_stdout_ends_after_everything_before_the_end_and_cancels_local_requests(
    root: Path,
) -> None:
    async with assert_no_leaks(), open_pipe() as agent_stdout, open_pipe() as agent_stdin:
        async with routed_over(agent_stdout, agent_stdin, relay=True, terminals=True, cwd=root) as router:
            handle = await create_terminal(router, PAUSE)
            await router.agent_says(request(2, "terminal/wait_for_exit", handle), update("last"))
            await router.agent_stdout.writer.send(b"no newline")
            await router.agent_stdout.writer.aclose()
            assert await router.caller_hears_end() == update("last") + b"\nno newline"
        # The wait was cancelled when the stdout ended: it was never answered, not even when leaving
        # the block killed its terminal.
        with pytest.raises(anyio.WouldBlock):
            agent_stdin.items.receive_nowait()


async def test_closing_the_yielded_stdin_closes_the_agents_stdin(root: Path) -> None:
    async with routed(fs_roots=[root]) as router:
        await router.stdin.send(INITIALIZE[:40])  # held: no newline yet, and no initialize seen
        await router.stdin.aclose()
        assert await router.agent_hears() == INITIALIZE[:40]
        with anyio.fail_after(EVENT_TIMEOUT), pytest.raises(anyio.EndOfStream):
            await router.agent_stdin.items.receive()
        with pytest.raises(anyio.ClosedResourceError):
            await router.stdin.send(b"{}\n")


async def test_with_nothing_to_route_the_agents_own_streams_are_yielded() -> None:
    async with (
        open_pipe() as agent_stdout,
        open_pipe() as agent_stdin,
        route_files(agent_stdin.writer, agent_stdout.reader) as (stdin, stdout),
    ):
        assert stdin is agent_stdin.writer
        assert stdout is agent_stdout.reader


async def test_requests_past_the_limit_are_refused_as_the_client_refuses_them(root: Path) -> None:
    async with assert_no_leaks(), routed(terminals=True, cwd=root, max_requests=2) as router:
        handle = await create_terminal(router, PAUSE)
        await router.agent_says(*(request(index, "terminal/wait_for_exit", handle) for index in (2, 3, 4)))
        assert await router.agent_hears_json() == {
            "jsonrpc": "2.0",
            "id": 4,
            "error": {
                "code": -32603,
                "message": "Internal error",
                "data": {"details": "too many requests in flight (the limit is 2)", "limit": 2},
            },
        }


# -- fuzz -------------------------------------------------------------------------------------------------

_JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=8))
_METHODS = st.sampled_from(
    [
        "session/update",
        "session/request_permission",
        "fs/read_text_file",
        "terminal/create",
        "x",
        "$/cancel_request",
    ]
)


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at the given positions (taken modulo its length): at most ``len(cuts) + 1`` pieces."""
    positions = sorted({cut % len(data) for cut in cuts} | {0, len(data)}) if data else [0]
    return [data[start:end] for start, end in itertools.pairwise(positions)]


_CUTS = st.lists(st.integers(0, 100_000), max_size=20)
"""Where a stream is cut between writes: anywhere, in a bounded number of pieces (a piece per write)."""


# Built once: building a strategy (a recursive one above all) inside the composite costs more than the
# example itself, thousands of times over under `make fuzz`.
_JSON_VALUES = st.recursive(_JSON_LEAVES, lambda inner: st.lists(inner, max_size=3))
_PARAMS = st.dictionaries(st.text(max_size=5), _JSON_LEAVES, max_size=3)
_SEPARATORS = st.sampled_from([(",", ":"), (", ", ": ")])
_KINDS = st.sampled_from(["message", "message", "junk", "json"])
_METHOD_OR_NONE = st.one_of(st.none(), _METHODS)
_JUNK = st.binary(max_size=40)


@st.composite
def _soups(draw: st.DrawFn) -> list[tuple[bytes, bool]]:
    """Lines of the agent's, each with whether the router serves it (an ``fs/*`` request). Requests get
    distinct ids, as an agent's requests in flight have."""
    soup: list[tuple[bytes, bool]] = []
    for index in range(draw(st.integers(0, 20))):
        kind = draw(_KINDS)
        if kind == "junk":
            soup.append((draw(_JUNK).replace(b"\n", b" "), False))
            continue
        if kind == "json":
            soup.append((json.dumps(draw(_JSON_VALUES)).encode(), False))
            continue
        message: dict[str, Any] = {"jsonrpc": "2.0"}
        method = draw(_METHOD_OR_NONE)
        if method is not None:
            message["method"] = method
        has_id = draw(st.booleans())
        if has_id:
            message["id"] = f"id-{index}" if draw(st.booleans()) else index
        if draw(st.booleans()):
            message["params"] = draw(_PARAMS)
        line = json.dumps(message, separators=draw(_SEPARATORS)).encode()
        soup.append((line, has_id and method is not None and method.startswith("fs/")))
    return soup


@pytest.mark.fuzz
@given(soup=_soups(), cuts=_CUTS)
async def test_every_line_not_served_comes_out_unchanged_and_in_order(
    soup: list[tuple[bytes, bool]], cuts: list[int], root: Path
) -> None:
    end = update("end")
    data = b"".join(line + b"\n" for line, _ in soup) + end + b"\n"
    expected = [line for line, served in soup if not served] + [end]
    served = sum(1 for _, is_served in soup if is_served)
    async with routed(fs_roots=[root], max_line_bytes=4096) as router:
        for piece in pieces(data, cuts):
            await router.agent_stdout.writer.send(piece)
        assert await router.caller_hears(len(expected)) == expected
        for _ in range(served):  # each served request is answered once, with an error (no such params)
            assert "error" in msgspec.json.decode(await router.agent_hears())
    assert router.agent_stdin.items.statistics().current_buffer_used == 0


_CALLER_LINES = st.one_of(
    st.just(INITIALIZE.rstrip(b"\n")),
    st.sampled_from(
        [
            b'{"jsonrpc":"2.0","id":3,"result":"initialize"}',
            b'{"jsonrpc":"2.0","method":"initialize"}',
            b'{"jsonrpc":"2.0","id":4,"method":"initialize","params":[1]}',
            b'{"jsonrpc":"2.0","id":5,"method":"session/prompt","params":{"sessionId":"s1","prompt":[]}}',
            b"",
        ]
    ),
    st.binary(max_size=30).map(lambda junk: junk.replace(b"\n", b" ")),
)


@pytest.mark.fuzz
@given(lines=st.lists(_CALLER_LINES, max_size=12), cuts=_CUTS)
async def test_the_callers_bytes_reach_the_agent_unchanged_however_cut_but_the_first_initialize(
    lines: list[bytes], cuts: list[int], root: Path
) -> None:
    data = b"".join(line + b"\n" for line in lines)
    amended = INITIALIZE.replace(
        b'"readTextFile":false,"writeTextFile":false', b'"readTextFile":true,"writeTextFile":true'
    )
    expected = data.replace(INITIALIZE, amended, 1)
    received = b""
    async with routed(fs_roots=[root]) as router:
        for piece in pieces(data, cuts):
            await router.stdin.send(piece)
        await router.stdin.aclose()
        with anyio.fail_after(EVENT_TIMEOUT):
            async for item in router.agent_stdin.items:
                received += item  # type: ignore[operator]
    assert received == expected
