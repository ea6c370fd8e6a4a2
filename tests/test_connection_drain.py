"""`drain_on_eof`: at the peer's end of stream, its requests in flight still finish and are answered.

For a server whose client writes its requests and closes its end (a shell pipe into an agent).
"""

from __future__ import annotations

import logging

import anyio
import msgspec
import pytest

from subagent.acp import ConnectionClosedError
from subagent.acp.connection import Connection
from tests.test_connection import open_pipe

pytestmark = pytest.mark.anyio


async def test_a_request_in_flight_at_end_of_stream_is_answered_with_its_notifications_first() -> None:
    handling = anyio.Event()
    release = anyio.Event()
    ours_failed: list[ConnectionClosedError] = []

    async def handler(method: str, params: msgspec.Raw | None) -> object:
        handling.set()
        await release.wait()
        await connection.notify("session/update", {"text": "last words"})
        return {"stopReason": "end_turn"}

    async def ours_pending_at_eof() -> None:
        try:
            await connection.request("fs/read_text_file", {})
        except ConnectionClosedError as exc:
            ours_failed.append(exc)
            release.set()  # the end of stream was seen: only now may the handler answer

    async with open_pipe() as to_connection, open_pipe() as from_connection:
        connection = Connection(
            to_connection.reader, from_connection.writer, request_handler=handler, drain_on_eof=5
        )
        with anyio.fail_after(5):
            async with anyio.create_task_group() as task_group:
                await task_group.start(connection.run)
                task_group.start_soon(ours_pending_at_eof)
                await to_connection.writer.send(b'{"jsonrpc":"2.0","id":7,"method":"session/prompt"}\n')
                await handling.wait()
                await to_connection.writer.aclose()  # the client is done writing, and still reads
            # run() returned on its own once the request in flight was answered.
    sent = [msgspec.json.decode(line) for line in from_connection.writer.sent]
    assert sent == [
        {"jsonrpc": "2.0", "id": 0, "method": "fs/read_text_file", "params": {}},
        {"jsonrpc": "2.0", "method": "session/update", "params": {"text": "last words"}},
        {"jsonrpc": "2.0", "id": 7, "result": {"stopReason": "end_turn"}},
    ]
    assert [error.end_of_stream for error in ours_failed] == [True]
    assert connection.closed_error is not None
    assert connection.closed_error.end_of_stream is True


async def test_while_draining_a_new_request_of_ours_fails_at_once_for_no_answer_can_come() -> None:
    handling = anyio.Event()
    release = anyio.Event()
    outcome: list[ConnectionClosedError] = []

    async def handler(method: str, params: msgspec.Raw | None) -> object:
        handling.set()
        await release.wait()
        try:
            await connection.request("session/request_permission", {})
        except ConnectionClosedError as exc:
            outcome.append(exc)
        return "answered anyway"

    async def ours_pending_at_eof() -> None:
        with pytest.raises(ConnectionClosedError):
            await connection.request("fs/read_text_file", {})
        release.set()

    async with open_pipe() as to_connection, open_pipe() as from_connection:
        connection = Connection(
            to_connection.reader, from_connection.writer, request_handler=handler, drain_on_eof=5
        )
        with anyio.fail_after(5):
            async with anyio.create_task_group() as task_group:
                await task_group.start(connection.run)
                task_group.start_soon(ours_pending_at_eof)
                await to_connection.writer.send(b'{"jsonrpc":"2.0","id":"r1","method":"ping"}\n')
                await handling.wait()
                await to_connection.writer.aclose()
    sent = [msgspec.json.decode(line) for line in from_connection.writer.sent]
    # The permission question was never sent: it failed before reaching the wire.
    assert sent == [
        {"jsonrpc": "2.0", "id": 0, "method": "fs/read_text_file", "params": {}},
        {"jsonrpc": "2.0", "id": "r1", "result": "answered anyway"},
    ]
    assert [(error.end_of_stream, error.message) for error in outcome] == [
        (True, "the peer closed the connection (end of stream)")
    ]


async def test_a_request_still_running_after_the_grace_is_cancelled_and_the_connection_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started = anyio.Event()
    cancelled = anyio.Event()

    async def handler(method: str, params: msgspec.Raw | None) -> object:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()
        return None  # never reached

    caplog.set_level(logging.WARNING, logger="subagent.acp.connection")
    async with open_pipe() as to_connection, open_pipe() as from_connection:
        connection = Connection(
            to_connection.reader, from_connection.writer, request_handler=handler, drain_on_eof=0.05
        )
        with anyio.fail_after(5):
            async with anyio.create_task_group() as task_group:
                await task_group.start(connection.run)
                await to_connection.writer.send(b'{"jsonrpc":"2.0","id":1,"method":"slow"}\n')
                await started.wait()
                await to_connection.writer.aclose()
            # run() returned on its own: the grace ran out and the handler was cancelled.
    assert cancelled.is_set()
    assert connection.closed_error is not None
    assert [record.getMessage() for record in caplog.records] == [
        "jsonrpc: 1 request(s) still unanswered 0.1 s after the end of stream; cancelling them"
    ]


async def test_without_drain_a_request_in_flight_at_end_of_stream_is_cancelled_unanswered() -> None:
    started = anyio.Event()
    cancelled = anyio.Event()

    async def handler(method: str, params: msgspec.Raw | None) -> object:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()
        return None  # never reached

    async with open_pipe() as to_connection, open_pipe() as from_connection:
        connection = Connection(to_connection.reader, from_connection.writer, request_handler=handler)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as task_group:
                await task_group.start(connection.run)
                await to_connection.writer.send(b'{"jsonrpc":"2.0","id":1,"method":"slow"}\n')
                await started.wait()
                await to_connection.writer.aclose()
    assert cancelled.is_set()
    assert from_connection.writer.sent == []


def test_a_negative_or_nan_drain_is_refused() -> None:
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="drain_on_eof must be >= 0 seconds"):
            Connection(None, None, drain_on_eof=bad)  # type: ignore[arg-type]
