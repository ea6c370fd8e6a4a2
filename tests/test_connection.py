"""The JSON-RPC connection, driven entirely in memory: two connections talking, or one and a scripted peer."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from subagent.acp import (
    AcpError,
    ConnectionClosedError,
    InvalidResponseError,
    MalformedMessageError,
    MessageTooLargeError,
    ProtocolError,
    RequestError,
    RpcErrorCode,
    UnexpectedResponseError,
)
from subagent.acp.connection import (
    Connection,
    NotificationHandler,
    RequestHandler,
    decode_params,
)

pytestmark = pytest.mark.anyio

PIPE_CHUNK = 65536  # the most bytes one receive() hands out, like a real pipe read

Item = bytes | BaseException  # what travels through an in-memory pipe; an exception breaks the reader


class PipeReader(anyio.abc.ByteReceiveStream):
    """The reading end of an in-memory byte pipe: at most `max_bytes` per receive, EOF once closed."""

    def __init__(self, items: MemoryObjectReceiveStream[Item]) -> None:
        self._items = items
        self._data = b""
        self._offset = 0
        self.on_receive: Callable[[], None] | None = None
        """Called at each receive(), i.e. whenever the reader has finished with the previous chunk."""

    async def receive(self, max_bytes: int = PIPE_CHUNK) -> bytes:
        if self.on_receive is not None:
            self.on_receive()
        while self._offset >= len(self._data):
            item = await self._items.receive()
            if isinstance(item, BaseException):
                raise item
            self._data, self._offset = item, 0
        chunk = self._data[self._offset : self._offset + max_bytes]
        self._offset += len(chunk)
        return chunk

    async def aclose(self) -> None:
        self._items.close()


class PipeWriter(anyio.abc.ByteSendStream):
    """The writing end of an in-memory byte pipe; each send() is one item, and every item is recorded."""

    def __init__(self, items: MemoryObjectSendStream[Item]) -> None:
        self._items = items
        self.sent: list[bytes] = []

    async def send(self, item: bytes) -> None:
        self.sent.append(item)
        await self._items.send(item)

    async def break_reader(self, error: BaseException) -> None:
        """Make the reading end raise `error`, as a real stream raises when it breaks."""
        await self._items.send(error)

    async def aclose(self) -> None:
        self._items.close()


@dataclass
class Pipe:
    writer: PipeWriter
    reader: PipeReader
    items: MemoryObjectReceiveStream[Item]


@asynccontextmanager
async def open_pipe() -> AsyncIterator[Pipe]:
    send, receive = anyio.create_memory_object_stream[Item](math.inf)
    with send, receive:
        yield Pipe(PipeWriter(send), PipeReader(receive), receive)


class RawPeer:
    """The far end of a connection, scripted by the test: it writes raw bytes and reads whole sent items."""

    def __init__(self, to_connection: Pipe, from_connection: Pipe) -> None:
        self.to_connection = to_connection
        self.from_connection = from_connection

    async def send_raw(self, data: bytes) -> None:
        await self.to_connection.writer.send(data)

    async def send(self, message: dict[str, Any]) -> None:
        await self.send_raw(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    async def break_stream(self, error: BaseException) -> None:
        await self.to_connection.writer.break_reader(error)

    async def close(self) -> None:
        """End of stream, as when the agent closes its stdout."""
        await self.to_connection.writer.aclose()

    async def receive_line(self) -> bytes:
        item = await self.from_connection.items.receive()
        assert isinstance(item, bytes)
        return item

    async def receive(self) -> dict[str, Any]:
        line = await self.receive_line()
        assert line.endswith(b"\n")
        assert line.count(b"\n") == 1, "each send must carry exactly one whole line"
        message: dict[str, Any] = json.loads(line)
        return message


@dataclass
class Recorder:
    """Collects what a connection hands to its notification handler and `on_protocol_error`."""

    notifications: list[tuple[str, Any]] = field(default_factory=list)
    protocol_errors: list[ProtocolError] = field(default_factory=list)
    wanted: int = 1
    enough: anyio.Event = field(default_factory=anyio.Event)
    error_seen: anyio.Event = field(default_factory=anyio.Event)

    async def on_notification(self, method: str, params: msgspec.Raw | None) -> None:
        self.notifications.append((method, None if params is None else msgspec.json.decode(params)))
        if len(self.notifications) >= self.wanted:
            self.enough.set()

    def on_protocol_error(self, error: ProtocolError) -> None:
        self.protocol_errors.append(error)
        self.error_seen.set()


@asynccontextmanager
async def peer_and_connection(
    *,
    request_handler: RequestHandler | None = None,
    notification_handler: NotificationHandler | None = None,
    recorder: Recorder | None = None,
    max_line_bytes: int | None = None,
    value_encoder: Callable[[Any], bytes] | None = None,
    **options: Any,
) -> AsyncIterator[tuple[Connection, RawPeer]]:
    """A running connection whose peer is scripted by the test; `options` go to `Connection`."""
    async with open_pipe() as to_connection, open_pipe() as from_connection:
        extra: dict[str, Any] = {} if max_line_bytes is None else {"max_line_bytes": max_line_bytes}
        extra.update(options)
        if value_encoder is not None:
            extra["value_encoder"] = value_encoder
        if recorder is not None:
            notification_handler = notification_handler or recorder.on_notification
            extra["on_protocol_error"] = recorder.on_protocol_error
        connection = Connection(
            to_connection.reader,
            from_connection.writer,
            request_handler=request_handler,
            notification_handler=notification_handler,
            name="under-test",
            **extra,
        )
        async with connection:
            yield connection, RawPeer(to_connection, from_connection)


@asynccontextmanager
async def connection_pair(
    *,
    a_requests: RequestHandler | None = None,
    a_notifications: NotificationHandler | None = None,
    b_requests: RequestHandler | None = None,
    b_notifications: NotificationHandler | None = None,
) -> AsyncIterator[tuple[Connection, Connection, Pipe, Pipe]]:
    """Two running connections wired to each other; also yields the a-to-b and b-to-a pipes."""
    async with open_pipe() as a_to_b, open_pipe() as b_to_a:
        a = Connection(
            b_to_a.reader,
            a_to_b.writer,
            request_handler=a_requests,
            notification_handler=a_notifications,
            name="a",
        )
        b = Connection(
            a_to_b.reader,
            b_to_a.writer,
            request_handler=b_requests,
            notification_handler=b_notifications,
            name="b",
        )
        async with a, b:
            yield a, b, a_to_b, b_to_a


def request(request_id: int | str | None, method: str, params: Any = None) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params is not None:
        message["params"] = params
    return message


def notification(method: str, params: Any = None) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message["params"] = params
    return message


def result(request_id: int | str | None, value: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "result": value}


class GreetParams(msgspec.Struct):
    name: str


class Greeting(msgspec.Struct):
    text: str
    count: int


class ReadParams(msgspec.Struct):
    path: str
    line: int | None = None


# -- requests and results ---------------------------------------------------------------------------------


async def test_a_request_returns_the_peers_result_raw_or_decoded_into_the_requested_type() -> None:
    async def serve(method: str, params: msgspec.Raw | None) -> Greeting:
        assert method == "greet"
        return Greeting(text=f"hello {decode_params(params, GreetParams).name}", count=2)

    async with connection_pair(b_requests=serve) as (a, _b, _, _):
        with anyio.fail_after(5):
            typed = await a.request("greet", {"name": "ada"}, result_type=Greeting)
            raw = await a.request("greet", GreetParams(name="bob"))
            plain = await a.request("greet", {"name": "cy"}, result_type=object)

    assert typed == Greeting(text="hello ada", count=2)
    assert bytes(raw) == b'{"text":"hello bob","count":2}'
    assert plain == {"text": "hello cy", "count": 2}


async def test_outgoing_messages_are_single_exact_lines_with_params_omitted_when_none() -> None:
    async with peer_and_connection() as (connection, peer):
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(connection.request, "no/params")
                assert await peer.receive_line() == b'{"jsonrpc":"2.0","id":0,"method":"no/params"}\n'
                tg.start_soon(partial(connection.request, "struct/params", GreetParams(name="ada")))
                assert (
                    await peer.receive_line()
                    == b'{"jsonrpc":"2.0","id":1,"method":"struct/params","params":{"name":"ada"}}\n'
                )
                await connection.notify("note", {"k": [1, "é\n"]})
                assert (
                    await peer.receive_line()
                    == '{"jsonrpc":"2.0","method":"note","params":{"k":[1,"é\\n"]}}\n'.encode()
                )
                await connection.notify("bare")
                assert await peer.receive_line() == b'{"jsonrpc":"2.0","method":"bare"}\n'
                await peer.send(result(0, None))
                await peer.send(result(1, {}))


async def test_a_value_encoder_encodes_params_and_handler_results_but_leaves_raw_json_and_null_alone() -> (
    None
):
    def shout(value: Any) -> bytes:
        return msgspec.json.encode(value).upper()

    async def handler(method: str, params: msgspec.Raw | None) -> Any:
        return {"echo": method} if method == "dict" else msgspec.Raw(b'{"raw":"kept"}')

    async with peer_and_connection(request_handler=handler, value_encoder=shout) as (connection, peer):
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(connection.request, "encoded", GreetParams(name="ada")))
                assert await peer.receive() == request(0, "encoded", {"NAME": "ADA"})
                tg.start_soon(partial(connection.request, "raw", msgspec.Raw(b'{"as":"is"}')))
                assert await peer.receive() == request(1, "raw", {"as": "is"})
                await peer.send(result(0, None))
                await peer.send(result(1, None))
            await peer.send(request(7, "dict"))
            assert await peer.receive() == result(7, {"ECHO": "DICT"})
            await peer.send(request(8, "raw"))
            assert await peer.receive() == result(8, {"raw": "kept"})


async def test_an_error_response_is_raised_as_a_request_error_with_its_code_message_and_data() -> None:
    async def serve(method: str, params: msgspec.Raw | None) -> None:
        raise RequestError.auth_required({"authMethods": ["oauth"]})

    async with connection_pair(b_requests=serve) as (a, _b, _, _):
        with anyio.fail_after(5), pytest.raises(RequestError) as caught:
            await a.request("session/new", {"cwd": "/"})

    assert caught.value.code == RpcErrorCode.AUTH_REQUIRED
    assert caught.value.message == "Authentication required"
    assert caught.value.data == {"authMethods": ["oauth"]}


async def test_a_result_that_does_not_match_the_result_type_raises_invalid_response() -> None:
    async def serve(method: str, params: msgspec.Raw | None) -> dict[str, Any]:
        return {"text": "hi", "count": "two"}

    async with connection_pair(b_requests=serve) as (a, _b, _, _):
        with anyio.fail_after(5), pytest.raises(InvalidResponseError) as caught:
            await a.request("greet", result_type=Greeting)

    assert caught.value.method == "greet"
    assert caught.value.detail == "Expected `int`, got `str` - at `$.count`"


async def test_both_peers_sending_request_id_0_at_the_same_time_each_get_their_own_answer() -> None:
    both_arrived = anyio.Event()
    arrived: list[str] = []

    def answering_as(name: str) -> RequestHandler:
        async def serve(method: str, params: msgspec.Raw | None) -> dict[str, Any]:
            arrived.append(name)
            if len(arrived) == 2:
                both_arrived.set()
            await both_arrived.wait()  # both requests are in flight before either is answered
            return {"answered_by": name, "echo": msgspec.json.decode(params) if params else None}

        return serve

    results: dict[str, Any] = {}
    async with connection_pair(a_requests=answering_as("a"), b_requests=answering_as("b")) as (
        a,
        b,
        a_to_b,
        b_to_a,
    ):

        async def call(connection: Connection, key: str) -> None:
            results[key] = await connection.request("ping", {"from": key}, result_type=object)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, a, "a")
                tg.start_soon(call, b, "b")

    assert results == {
        "a": {"answered_by": "b", "echo": {"from": "a"}},
        "b": {"answered_by": "a", "echo": {"from": "b"}},
    }
    assert json.loads(a_to_b.writer.sent[0]) == request(0, "ping", {"from": "a"})
    assert json.loads(b_to_a.writer.sent[0]) == request(0, "ping", {"from": "b"})


async def test_a_slow_request_handler_does_not_hold_up_other_requests() -> None:
    release = anyio.Event()

    async def serve(method: str, params: msgspec.Raw | None) -> str:
        if method == "slow":
            await release.wait()
        return method

    async with peer_and_connection(request_handler=serve) as (_connection, peer):
        with anyio.fail_after(5):
            await peer.send(request(1, "slow"))
            await peer.send(request(2, "fast"))
            assert await peer.receive() == result(2, "fast")
            release.set()
            assert await peer.receive() == result(1, "slow")


# -- the peer's requests: error objects ---------------------------------------------------------------------


async def test_a_request_nobody_handles_is_answered_with_method_not_found() -> None:
    async with peer_and_connection() as (_connection, peer):
        with anyio.fail_after(5):
            await peer.send(request(1, "x/unknown", {"a": 1}))
            assert await peer.receive() == {
                "jsonrpc": "2.0",
                "id": 1,
                "error": {"code": -32601, "message": "Method not found", "data": {"method": "x/unknown"}},
            }


async def test_a_request_error_raised_by_a_handler_reaches_the_peer_exactly() -> None:
    async def serve(method: str, params: msgspec.Raw | None) -> None:
        if method == "fs/read_text_file":
            raise RequestError.resource_not_found("file:///missing.txt")
        raise RequestError(-31999, "Custom failure", ["detail", 1])

    async with peer_and_connection(request_handler=serve) as (_connection, peer):
        with anyio.fail_after(5):
            await peer.send(request("abc", "fs/read_text_file", {"path": "/missing.txt"}))
            assert await peer.receive() == {
                "jsonrpc": "2.0",
                "id": "abc",
                "error": {
                    "code": -32002,
                    "message": "Resource not found",
                    "data": {"uri": "file:///missing.txt"},
                },
            }
            await peer.send(request(None, "custom"))
            assert await peer.receive() == {
                "jsonrpc": "2.0",
                "id": None,
                "error": {"code": -31999, "message": "Custom failure", "data": ["detail", 1]},
            }


async def test_params_failing_validation_are_answered_with_invalid_params_and_the_message() -> None:
    async def serve(method: str, params: msgspec.Raw | None) -> str:
        if method == "direct":
            # A handler decoding by hand: a bare msgspec.ValidationError maps to -32602 as well.
            return msgspec.json.decode(b"null" if params is None else params, type=ReadParams).path
        return decode_params(params, ReadParams).path

    async with peer_and_connection(request_handler=serve) as (_connection, peer):
        with anyio.fail_after(5):
            await peer.send(request(1, "fs/read_text_file", {"path": 5}))
            assert await peer.receive() == {
                "jsonrpc": "2.0",
                "id": 1,
                "error": {
                    "code": -32602,
                    "message": "Invalid params",
                    "data": {"details": "Expected `str`, got `int` - at `$.path`"},
                },
            }
            await peer.send(request(2, "fs/read_text_file"))
            assert (await peer.receive())["error"] == {
                "code": -32602,
                "message": "Invalid params",
                "data": {"details": "Expected `object`, got `null`"},
            }
            await peer.send(request(3, "direct", {"line": 1}))
            assert (await peer.receive())["error"] == {
                "code": -32602,
                "message": "Invalid params",
                "data": {"details": "Object missing required field `path`"},
            }
            await peer.send(request(4, "direct", {"path": "/ok"}))
            assert await peer.receive() == result(4, "/ok")


async def test_an_unexpected_handler_failure_is_answered_with_a_bare_internal_error_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def serve(method: str, params: msgspec.Raw | None) -> object:
        if method == "explode":
            raise ValueError("secret sk-12345 in /home/me/.config")
        return object()  # a result msgspec cannot encode

    async with peer_and_connection(request_handler=serve) as (_connection, peer):
        with anyio.fail_after(5):
            await peer.send(request(3, "explode"))
            line = await peer.receive_line()
            await peer.send(request(4, "unencodable"))
            unencodable = await peer.receive()

    assert json.loads(line) == {
        "jsonrpc": "2.0",
        "id": 3,
        "error": {"code": -32603, "message": "Internal error"},
    }
    assert b"sk-12345" not in line
    assert b"ValueError" not in line
    assert unencodable == {"jsonrpc": "2.0", "id": 4, "error": {"code": -32603, "message": "Internal error"}}
    failures = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert [record.exc_info[0] if record.exc_info else None for record in failures] == [ValueError, TypeError]
    assert failures[0].name == "subagent.acp.connection"


async def test_a_cancel_request_from_the_peer_cancels_the_handler_which_answers_request_cancelled() -> None:
    started = anyio.Event()
    handler_cancelled = anyio.Event()

    async def serve(method: str, params: msgspec.Raw | None) -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            handler_cancelled.set()

    async with peer_and_connection(request_handler=serve) as (connection, peer):
        with anyio.fail_after(5):
            await peer.send(request(7, "session/request_permission", {"sessionId": "s"}))
            await started.wait()
            assert connection.statistics().incoming_requests == 1
            await peer.send(notification("$/cancel_request", {"requestId": 7}))
            assert await peer.receive() == {
                "jsonrpc": "2.0",
                "id": 7,
                "error": {"code": -32800, "message": "Request cancelled"},
            }
            await handler_cancelled.wait()
            assert connection.statistics().incoming_requests == 0


async def test_a_malformed_request_that_still_shows_its_id_is_answered_with_invalid_request() -> None:
    recorder = Recorder()
    async with peer_and_connection(recorder=recorder) as (_connection, peer):
        with anyio.fail_after(5):
            await peer.send({"jsonrpc": "2.0", "id": 5, "method": 7})
            assert await peer.receive() == {
                "jsonrpc": "2.0",
                "id": 5,
                "error": {
                    "code": -32600,
                    "message": "Invalid Request",
                    "data": {"details": "not a JSON-RPC message: Expected `str`, got `int` - at `$.method`"},
                },
            }
            await peer.send({"jsonrpc": "1.0", "id": 6, "method": "m"})
            assert (await peer.receive())["error"] == {
                "code": -32600,
                "message": "Invalid Request",
                "data": {"details": 'the "jsonrpc" member is not "2.0"'},
            }
    assert [type(error) for error in recorder.protocol_errors] == [
        MalformedMessageError,
        MalformedMessageError,
    ]


# -- notifications ------------------------------------------------------------------------------------------


async def test_notifications_are_delivered_in_order_while_a_slow_request_handler_runs() -> None:
    slow_started = anyio.Event()
    release = anyio.Event()
    recorder = Recorder(wanted=200)

    async def slow(method: str, params: msgspec.Raw | None) -> str:
        slow_started.set()
        await release.wait()
        return "done"

    outcome: list[object] = []
    async with connection_pair(b_requests=slow, b_notifications=recorder.on_notification) as (a, b, _, _):

        async def call() -> None:
            outcome.append(await a.request("session/request_permission", result_type=object))

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await slow_started.wait()
                for n in range(200):
                    await a.notify("session/update", {"n": n})
                await recorder.enough.wait()
                assert b.statistics().incoming_requests == 1  # still blocked, yet nothing was held up
                release.set()

    assert recorder.notifications == [("session/update", {"n": n}) for n in range(200)]
    assert outcome == ["done"]


@pytest.mark.parametrize("answer", ["result", "error"])
async def test_a_response_is_returned_only_after_the_notifications_that_preceded_it_were_handled(
    answer: str,
) -> None:
    first_started = anyio.Event()
    release = anyio.Event()
    handled: list[int] = []
    reader_got_past_the_response = anyio.Event()

    async def on_update(method: str, params: msgspec.Raw | None) -> None:
        if not handled:
            first_started.set()
            await release.wait()
        handled.append(msgspec.json.decode(b"null" if params is None else params)["n"])

    def on_protocol_error(error: ProtocolError) -> None:
        reader_got_past_the_response.set()

    outcome: dict[str, Any] = {}
    async with open_pipe() as to_connection, open_pipe() as from_connection:
        connection = Connection(
            to_connection.reader,
            from_connection.writer,
            notification_handler=on_update,
            on_protocol_error=on_protocol_error,
        )
        peer = RawPeer(to_connection, from_connection)
        async with connection:

            async def prompt() -> None:
                try:
                    outcome["result"] = await connection.request("session/prompt", result_type=object)
                except RequestError as exc:
                    outcome["error"] = exc.to_wire()
                outcome["handled_by_then"] = list(handled)

            with anyio.fail_after(5):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(prompt)
                    assert (await peer.receive())["method"] == "session/prompt"
                    await peer.send(notification("session/update", {"n": 1}))
                    await peer.send(notification("session/update", {"n": 2}))
                    if answer == "result":
                        await peer.send(result(0, {"stopReason": "end_turn"}))
                    else:
                        await peer.send(
                            {"jsonrpc": "2.0", "id": 0, "error": {"code": -32603, "message": "boom"}}
                        )
                    await peer.send_raw(b"a marker line: the reader reports it after handling the response\n")
                    await reader_got_past_the_response.wait()
                    await first_started.wait()
                    assert connection.statistics().pending_requests == 0  # the response has arrived...
                    assert outcome == {}  # ...but is held back behind the notifications before it
                    release.set()

    answered = (
        {"result": {"stopReason": "end_turn"}}
        if answer == "result"
        else {"error": {"code": -32603, "message": "boom"}}
    )
    assert outcome == {**answered, "handled_by_then": [1, 2]}


async def test_a_notification_handler_may_itself_await_a_request_without_deadlocking() -> None:
    answers: list[object] = []
    done = anyio.Event()
    holder: list[Connection] = []

    async def on_kick(method: str, params: msgspec.Raw | None) -> None:
        answers.append(await holder[0].request("inner", result_type=object))
        done.set()

    async def serve(method: str, params: msgspec.Raw | None) -> dict[str, str]:
        return {"served": method}

    async with connection_pair(a_requests=serve, b_notifications=on_kick) as (a, b, _, _):
        holder.append(b)
        with anyio.fail_after(5):
            await a.notify("kick")
            await done.wait()

    assert answers == [{"served": "inner"}]


async def test_an_exception_in_the_notification_handler_is_logged_and_later_notifications_still_arrive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder = Recorder(wanted=2)

    async def on_notification(method: str, params: msgspec.Raw | None) -> None:
        await recorder.on_notification(method, params)
        if method == "bad":
            raise KeyError("boom")

    async with peer_and_connection(notification_handler=on_notification) as (connection, peer):
        with anyio.fail_after(5):
            await peer.send(notification("bad"))
            await peer.send(notification("good", {"x": 1}))
            await recorder.enough.wait()
            assert not connection.statistics().closed

    assert recorder.notifications == [("bad", None), ("good", {"x": 1})]
    failures = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert len(failures) == 1
    assert failures[0].exc_info is not None
    assert failures[0].exc_info[0] is KeyError


# -- framing and robustness ---------------------------------------------------------------------------------


async def test_a_10_mib_line_is_received_whole() -> None:
    recorder = Recorder()
    blob = "x" * (10 * 1024 * 1024)
    async with peer_and_connection(recorder=recorder) as (connection, peer):
        with anyio.fail_after(5):
            await peer.send(notification("big", {"blob": blob}))
            await recorder.enough.wait()
            assert connection.statistics().read_buffer_bytes == 0
            async with anyio.create_task_group() as tg:

                async def call() -> None:
                    assert await connection.request("read", result_type=str) == blob

                tg.start_soon(call)
                await peer.receive()
                await peer.send(result(0, blob))

    assert recorder.notifications == [("big", {"blob": blob})]
    assert recorder.protocol_errors == []


async def test_an_over_limit_line_is_discarded_unbuffered_and_the_next_message_is_processed() -> None:
    limit = 1024
    recorder = Recorder(wanted=2)
    huge = json.dumps(notification("huge", {"x": "y" * (200 * 1024)})).encode()
    long = json.dumps(notification("long", {"x": "y" * 2000})).encode()
    buffered: list[int] = []
    async with peer_and_connection(recorder=recorder, max_line_bytes=limit) as (connection, peer):
        peer.to_connection.reader.on_receive = lambda: buffered.append(
            connection.statistics().read_buffer_bytes
        )
        with anyio.fail_after(5):
            for start in range(0, len(huge), 4096):  # arrives in many small chunks
                await peer.send_raw(huge[start : start + 4096])
            await peer.send_raw(b"\n" + json.dumps(notification("after-huge")).encode() + b"\n")
            await peer.send_raw(long + b"\n" + json.dumps(notification("after-long")).encode() + b"\n")
            await recorder.enough.wait()

    assert recorder.notifications == [("after-huge", None), ("after-long", None)]
    assert all(isinstance(error, MessageTooLargeError) for error in recorder.protocol_errors)
    too_large = [error for error in recorder.protocol_errors if isinstance(error, MessageTooLargeError)]
    assert [(error.size, error.limit) for error in too_large] == [(len(huge), limit), (len(long), limit)]
    assert max(buffered) <= limit + 4096  # never more than the limit plus one chunk


async def test_a_non_json_line_is_skipped_and_reported_and_the_connection_keeps_working() -> None:
    recorder = Recorder()
    async with peer_and_connection(recorder=recorder) as (connection, peer):
        with anyio.fail_after(5):
            await peer.send_raw(b"Running database migrations... done\n")
            await peer.send(notification("session/update", {"n": 1}))
            await recorder.enough.wait()
            assert connection.statistics().protocol_errors == 1

    assert recorder.notifications == [("session/update", {"n": 1})]
    [error] = recorder.protocol_errors
    assert isinstance(error, MalformedMessageError)
    assert error.reason.startswith("not JSON: ")
    assert error.excerpt == b"Running database migrations... done"


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        pytest.param(
            b'[{"jsonrpc":"2.0","method":"n"}]', "a JSON array: batches are not supported", id="batch"
        ),
        pytest.param(b'{"hello":"world"}', 'the "jsonrpc" member is not "2.0"', id="not-an-envelope"),
        pytest.param(
            b'{"jsonrpc":"1.0","method":"n"}', 'the "jsonrpc" member is not "2.0"', id="wrong-version"
        ),
        pytest.param(b'{"jsonrpc":"2.0","method":"n","params":{"s":"\xff"}}', "not UTF-8", id="invalid-utf8"),
        pytest.param(
            b'{"jsonrpc":"2.0","id":1.5,"result":{}}',
            "not a JSON-RPC message: Expected `int | str | null`, got `float` - at `$.id`",
            id="float-id",
        ),
        pytest.param(b'"just a string"', "not a JSON-RPC message: Expected `object`, got `str`", id="scalar"),
        pytest.param(b'{"jsonrpc":"2.0"}', "neither a request, a notification nor a response", id="empty"),
    ],
)
async def test_a_malformed_line_is_skipped_and_reported_and_the_connection_keeps_working(
    line: bytes, reason: str
) -> None:
    recorder = Recorder()
    async with peer_and_connection(recorder=recorder) as (connection, peer):
        with anyio.fail_after(5):
            await peer.send_raw(line + b"\n")
            await peer.send(notification("next"))
            await recorder.enough.wait()
            assert connection.statistics().protocol_errors == 1

    assert recorder.notifications == [("next", None)]
    [error] = recorder.protocol_errors
    assert isinstance(error, MalformedMessageError)
    assert error.reason == reason
    assert error.excerpt == line


async def test_crlf_line_endings_and_blank_lines_are_tolerated() -> None:
    recorder = Recorder(wanted=2)
    async with peer_and_connection(recorder=recorder) as (connection, peer):
        with anyio.fail_after(5):
            await peer.send_raw(b"\r\n\n   \n")
            await peer.send_raw(json.dumps(notification("one")).encode() + b"\r\n\r\n")
            await peer.send_raw(json.dumps(notification("two", [1])).encode() + b"\r\n")
            await recorder.enough.wait()
            assert connection.statistics().protocol_errors == 0

    assert recorder.notifications == [("one", None), ("two", [1])]


async def test_a_last_line_without_a_newline_is_still_read_at_end_of_stream() -> None:
    recorder = Recorder()
    async with peer_and_connection(recorder=recorder) as (connection, peer):
        with anyio.fail_after(5):
            await peer.send_raw(json.dumps(notification("last words")).encode())
            await peer.close()
            await recorder.enough.wait()
            assert connection.statistics().closed

    assert recorder.notifications == [("last words", None)]


async def test_a_response_to_an_unknown_or_answered_id_is_dropped_and_the_connection_keeps_working() -> None:
    recorder = Recorder()
    async with peer_and_connection(recorder=recorder) as (connection, peer):
        answers: list[object] = []

        async def call(n: int) -> None:
            answers.append(await connection.request("m", {"n": n}, result_type=object))

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, 0)
                assert (await peer.receive())["id"] == 0
                await peer.send(result(0, "first"))
            await peer.send(result(0, "duplicate"))
            await peer.send(result(41, "unknown"))
            await peer.send(result("0", "a string id is not ours"))
            await peer.send(
                {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error"}}
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, 1)
                assert (await peer.receive())["id"] == 1
                await peer.send(result(1, "second"))

    assert answers == ["first", "second"]
    assert all(isinstance(error, UnexpectedResponseError) for error in recorder.protocol_errors)
    unexpected = [error for error in recorder.protocol_errors if isinstance(error, UnexpectedResponseError)]
    assert [error.request_id for error in unexpected] == [0, 41, "0", None]
    assert unexpected[3].error is not None
    assert unexpected[3].error.code == RpcErrorCode.PARSE_ERROR


async def test_a_malformed_response_to_a_pending_request_fails_it_instead_of_leaving_it_waiting() -> None:
    async with peer_and_connection(recorder=Recorder()) as (connection, peer):
        outcomes: list[InvalidResponseError] = []

        async def call(method: str) -> None:
            with pytest.raises(InvalidResponseError) as caught:
                await connection.request(method)
            outcomes.append(caught.value)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "bad/error")
                assert (await peer.receive())["id"] == 0
                await peer.send({"jsonrpc": "2.0", "id": 0, "error": {"code": "oops"}})
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "bad/version")
                assert (await peer.receive())["id"] == 1
                await peer.send({"jsonrpc": "1.0", "id": 1, "result": 1})
            assert connection.statistics().pending_requests == 0

    assert [error.method for error in outcomes] == ["bad/error", "bad/version"]


async def test_many_concurrent_writers_never_interleave_bytes_on_the_wire() -> None:
    async def echo(method: str, params: msgspec.Raw | None) -> object:
        return msgspec.json.decode(b"null" if params is None else params)

    async with peer_and_connection(request_handler=echo) as (connection, peer):
        answers: dict[int, object] = {}

        async def call(n: int) -> None:
            answers[n] = await connection.request("echo", {"n": n, "pad": "p" * (n * 97)}, result_type=object)

        lines: list[dict[str, Any]] = []
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                for n in range(50):  # the peer's requests: our responses race our own requests
                    await peer.send(request(f"peer-{n}", "echo", {"peer": n}))
                for n in range(200):
                    tg.start_soon(call, n)
                while len(lines) < 250:
                    message = await peer.receive()  # asserts one whole line per send
                    lines.append(message)
                    if "method" in message:
                        await peer.send(result(message["id"], message["params"]))

    assert answers == {n: {"n": n, "pad": "p" * (n * 97)} for n in range(200)}
    responses = {message["id"]: message["result"] for message in lines if "result" in message}
    assert responses == {f"peer-{n}": {"peer": n} for n in range(50)}
    assert sorted(message["id"] for message in lines if "method" in message) == list(range(200))


# -- closing ------------------------------------------------------------------------------------------------


async def test_end_of_stream_fails_every_pending_request_at_once_and_later_calls_immediately() -> None:
    async with peer_and_connection() as (connection, peer):
        failures: list[ConnectionClosedError] = []

        async def call(n: int) -> None:
            with pytest.raises(ConnectionClosedError) as caught:
                await connection.request("session/prompt", {"n": n})
            failures.append(caught.value)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                for n in range(3):
                    tg.start_soon(call, n)
                for _ in range(3):
                    await peer.receive()
                assert connection.statistics().pending_requests == 3
                await peer.close()
            with pytest.raises(ConnectionClosedError):
                await connection.request("after")
            with pytest.raises(ConnectionClosedError):
                await connection.notify("after")

        assert len(failures) == 3
        assert len({id(failure) for failure in failures}) == 3  # each waiter raises its own instance
        assert all(failure.cause is None for failure in failures)
        assert connection.closed_error is not None
        assert connection.statistics().pending_requests == 0
        assert connection.statistics().closed


async def test_a_broken_stream_fails_pending_requests_with_connection_closed_carrying_the_cause() -> None:
    async with peer_and_connection() as (connection, peer):
        broken = anyio.BrokenResourceError("pipe broke")
        failures: list[ConnectionClosedError] = []

        async def call() -> None:
            with pytest.raises(ConnectionClosedError) as caught:
                await connection.request("initialize")
            failures.append(caught.value)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await peer.receive()
                await peer.break_stream(broken)

    [failure] = failures
    assert failure.cause is broken
    assert failure.__cause__ is broken
    assert isinstance(failure, AcpError)


async def test_a_failed_write_closes_the_connection_and_fails_the_request_with_the_cause() -> None:
    async with peer_and_connection() as (connection, peer):
        peer.from_connection.items.close()  # the agent's stdin is gone
        with anyio.fail_after(5), pytest.raises(ConnectionClosedError) as caught:
            await connection.request("initialize")

    assert isinstance(caught.value.cause, anyio.BrokenResourceError)
    assert connection.statistics().closed


async def test_cancelling_a_request_forgets_it_sends_a_courtesy_cancel_and_drops_the_late_response() -> None:
    recorder = Recorder()
    async with peer_and_connection(recorder=recorder) as (connection, peer):
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                scope = anyio.CancelScope()

                async def call() -> None:
                    with scope:
                        await connection.request("fs/slow")

                tg.start_soon(call)
                assert await peer.receive() == request(0, "fs/slow")
                assert connection.statistics().pending_requests == 1
                scope.cancel()
            assert await peer.receive() == notification("$/cancel_request", {"requestId": 0})
            assert connection.statistics().pending_requests == 0
            await peer.send(result(0, "too late"))
            await peer.send(notification("probe"))  # read after the late response, so it has been handled
            await recorder.enough.wait()

    assert recorder.protocol_errors == []
    assert recorder.notifications == [("probe", None)]


async def test_the_courtesy_cancel_can_be_turned_off_for_methods_cancelled_another_way() -> None:
    async with peer_and_connection() as (connection, peer):
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                scope = anyio.CancelScope()

                async def call() -> None:
                    with scope:
                        await connection.request("session/prompt", courtesy_cancel=False)

                tg.start_soon(call)
                assert await peer.receive() == request(0, "session/prompt")
                scope.cancel()
            await connection.notify("session/cancel", {"sessionId": "s"})
            # The next line on the wire is the layer above's own cancel: no `$/cancel_request` came first.
            assert await peer.receive() == notification("session/cancel", {"sessionId": "s"})
            assert connection.statistics().pending_requests == 0


async def test_leaving_the_context_fails_pending_requests_and_cancels_in_flight_handlers() -> None:
    handler_started = anyio.Event()
    handler_cancelled = anyio.Event()

    async def serve(method: str, params: msgspec.Raw | None) -> None:
        handler_started.set()
        try:
            await anyio.sleep_forever()
        finally:
            handler_cancelled.set()

    failures: list[ConnectionClosedError] = []
    with anyio.fail_after(5):
        async with (
            anyio.create_task_group() as tg,
            peer_and_connection(request_handler=serve) as (connection, peer),
        ):

            async def call() -> None:
                with pytest.raises(ConnectionClosedError) as caught:
                    await connection.request("session/prompt")
                failures.append(caught.value)

            tg.start_soon(call)
            assert (await peer.receive())["method"] == "session/prompt"
            await peer.send(request(0, "session/request_permission"))
            await handler_started.wait()

    assert handler_cancelled.is_set()
    assert len(failures) == 1
    assert connection.statistics() == type(connection.statistics())(
        pending_requests=0,
        incoming_requests=0,
        queued_notifications=0,
        queued_notification_bytes=0,
        read_buffer_bytes=0,
        protocol_errors=0,
        closed=True,
    )


async def test_run_can_be_started_in_a_task_group_and_close_passes_its_cause_to_pending_requests() -> None:
    exit_status = RuntimeError("agent exited with status 3")
    failures: list[ConnectionClosedError] = []
    async with open_pipe() as to_connection, open_pipe() as from_connection:
        connection = Connection(to_connection.reader, from_connection.writer)
        peer = RawPeer(to_connection, from_connection)

        async def call() -> None:
            with pytest.raises(ConnectionClosedError) as caught:
                await connection.request("initialize")
            failures.append(caught.value)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                await tg.start(connection.run)
                tg.start_soon(call)
                assert await peer.receive() == request(0, "initialize")
                connection.close(cause=exit_status)
            # The task group exited, so run() has returned; a connection runs only once.
            with pytest.raises(RuntimeError):
                await connection.run()

    [failure] = failures
    assert failure.cause is exit_status
    assert connection.closed_error is not None
    assert connection.closed_error.cause is exit_status


async def test_a_connection_that_was_never_started_refuses_to_send() -> None:
    async with open_pipe() as to_connection, open_pipe() as from_connection:
        connection = Connection(to_connection.reader, from_connection.writer)
        with pytest.raises(RuntimeError):
            await connection.request("initialize")
        with pytest.raises(RuntimeError):
            await connection.notify("x")


# -- the error module -------------------------------------------------------------------------------------


async def test_request_error_constructors_carry_the_standard_codes_and_messages() -> None:
    errors = [
        (RequestError.parse_error(), -32700, "Parse error"),
        (RequestError.invalid_request(), -32600, "Invalid Request"),
        (RequestError.method_not_found("m"), -32601, "Method not found"),
        (RequestError.invalid_params(), -32602, "Invalid params"),
        (RequestError.internal_error(), -32603, "Internal error"),
        (RequestError.auth_required(), -32000, "Authentication required"),
        (RequestError.resource_not_found(), -32002, "Resource not found"),
        (RequestError.request_cancelled(), -32800, "Request cancelled"),
    ]
    assert [(error.code, error.message) for error, _, _ in errors] == [(code, msg) for _, code, msg in errors]
    assert RequestError.internal_error().to_wire() == {"code": -32603, "message": "Internal error"}
    assert RequestError.method_not_found("x").to_wire() == {
        "code": -32601,
        "message": "Method not found",
        "data": {"method": "x"},
    }
    assert issubclass(MessageTooLargeError, ProtocolError)
    assert issubclass(ProtocolError, AcpError)
    assert issubclass(ConnectionClosedError, AcpError)


# -- typed notifications ----------------------------------------------------------------------------------


class Update(msgspec.Struct, frozen=True):
    n: int


async def test_typed_notifications_arrive_decoded_and_anything_else_takes_the_generic_path() -> None:
    received: list[tuple[str, Any]] = []
    asked: list[tuple[str, Any]] = []
    got_all = anyio.Event()

    def on_notification(method: str, params: Any) -> None:
        received.append((method, params))
        if len(received) == 3:
            got_all.set()

    async def on_request(method: str, params: msgspec.Raw | None) -> Any:
        asked.append((method, None if params is None else msgspec.json.decode(params)))
        return "answered"

    async with open_pipe() as to_connection, open_pipe() as from_connection:
        connection = Connection(
            to_connection.reader,
            from_connection.writer,
            notification_handler=on_notification,
            request_handler=on_request,
            typed_notifications={"update": Update},
        )
        peer = RawPeer(to_connection, from_connection)
        async with connection:
            with anyio.fail_after(5):
                await peer.send(notification("update", {"n": 1}))
                await peer.send(notification("update", {"n": "not a number"}))  # the type rejects it
                await peer.send(request(4, "update", {"n": 2}))  # an id makes it a request
                assert await peer.receive() == result(4, "answered")
                await peer.send(notification("other", {"n": 3}))
                await got_all.wait()

    assert received[0] == ("update", Update(n=1))
    method, raw = received[1]
    assert method == "update"
    assert isinstance(raw, msgspec.Raw)
    assert msgspec.json.decode(raw) == {"n": "not a number"}
    assert received[2][0] == "other"
    assert isinstance(received[2][1], msgspec.Raw)
    assert asked == [("update", {"n": 2})]


async def test_a_request_is_handled_only_after_the_notifications_sent_before_it() -> None:
    release = anyio.Event()
    notification_started = anyio.Event()
    handled: list[str] = []
    seen_by_request: list[list[str]] = []

    async def on_notification(method: str, params: msgspec.Raw | None) -> None:
        notification_started.set()
        await release.wait()
        handled.append(method)

    async def on_request(method: str, params: msgspec.Raw | None) -> Any:
        seen_by_request.append(list(handled))
        return "ok"

    async with peer_and_connection(request_handler=on_request, notification_handler=on_notification) as (
        connection,
        peer,
    ):
        with anyio.fail_after(5):
            await peer.send(notification("session/update", {"toolCallId": "c1"}))
            await peer.send(request(0, "session/request_permission", {"toolCallId": "c1"}))
            await notification_started.wait()
            await anyio.wait_all_tasks_blocked()
            assert seen_by_request == []  # held back behind the slow notification
            assert connection.statistics().incoming_requests == 1
            release.set()
            assert await peer.receive() == result(0, "ok")
    assert seen_by_request == [["session/update"]]


@pytest.mark.parametrize("surprise", [None, "request", "blank", "malformed", "other"])
async def test_a_read_of_many_typed_notifications_is_taken_whole_and_any_surprise_keeps_order(
    surprise: str | None,
) -> None:
    received: list[tuple[str, Any]] = []
    asked: list[str] = []
    wanted = 4 if surprise == "other" else 3
    all_received = anyio.Event()

    def on_notification(method: str, params: Any) -> None:
        received.append((method, params))
        if len(received) == wanted:
            all_received.set()

    async def on_request(method: str, params: msgspec.Raw | None) -> Any:
        asked.append(method)
        return None

    def line(message: dict[str, Any]) -> bytes:
        return json.dumps(message, separators=(",", ":")).encode() + b"\n"

    lines = [line(notification("update", {"n": n})) for n in range(3)]
    extra = {
        None: b"",
        "request": line(request(9, "update", {"n": 99})),
        "blank": b"   \r\n",
        "malformed": b'{"jsonrpc":"2.0","method":"upd\n',
        "other": line(notification("other", {"n": 99})),
    }[surprise]
    lines.insert(2, extra)
    expected: list[tuple[str, Any]] = [
        ("update", Update(n=0)),
        ("update", Update(n=1)),
        ("update", Update(n=2)),
    ]
    if surprise == "other":
        expected.insert(2, ("other", {"n": 99}))

    recorder = Recorder()
    async with open_pipe() as to_connection, open_pipe() as from_connection:
        connection = Connection(
            to_connection.reader,
            from_connection.writer,
            notification_handler=on_notification,
            request_handler=on_request,
            on_protocol_error=recorder.on_protocol_error,
            typed_notifications={"update": Update},
        )
        peer = RawPeer(to_connection, from_connection)
        async with connection:
            with anyio.fail_after(5):
                await peer.send_raw(b"".join(lines))  # one read holding every line
                if surprise == "request":
                    assert await peer.receive() == result(9, None)
                await all_received.wait()

    decoded = [(m, p if isinstance(p, Update) else msgspec.json.decode(p)) for m, p in received]
    assert decoded == expected
    assert asked == (["update"] if surprise == "request" else [])
    assert len(recorder.protocol_errors) == (1 if surprise == "malformed" else 0)
