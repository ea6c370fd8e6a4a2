"""JSON-RPC 2.0 by the letter: no line breaks the connection, no caller is left waiting, buffers are bounded.

Each bad line is sent between two good notifications and followed by a request the test is waiting for,
so the assertions cover the reply to the bad line (exact), the messages around it (exact, in order) and
that the connection goes on. Replies go out from separate tasks, whose order trio may shuffle: replies are
compared as sorted lists, never by arrival order.
"""

from __future__ import annotations

import json
import logging
import tracemalloc
from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

from subagent.acp import InvalidResponseError, MalformedMessageError, MessageTooLargeError, RequestError
from subagent.acp.connection import Connection
from tests.test_connection import (
    RawPeer,
    Recorder,
    notification,
    open_pipe,
    peer_and_connection,
    request,
    result,
)

pytestmark = pytest.mark.anyio

WAIT = 10  # seconds: a hang guard, never a pacing

SENTINEL_ID = "sentinel"
DEEP = 10_000


def line_of(message: Any) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def error(request_id: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    wire: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        wire["data"] = data
    return {"jsonrpc": "2.0", "id": request_id, "error": wire}


def parse_error(request_id: Any, details: str) -> dict[str, Any]:
    return error(request_id, -32700, "Parse error", {"details": details})


def invalid_request(request_id: Any, details: str) -> dict[str, Any]:
    return error(request_id, -32600, "Invalid Request", {"details": details})


async def echo(method: str, params: msgspec.Raw | None) -> Any:
    return {"method": method, "params": None if params is None else msgspec.json.decode(params)}


async def replies_until_sentinel(peer: RawPeer) -> list[Any]:
    """Every message the connection sent before answering the sentinel request (sent by the caller)."""
    replies: list[Any] = []
    while True:
        message = json.loads(await peer.receive_line())
        if isinstance(message, dict) and message.get("id") == SENTINEL_ID:
            assert message == result(SENTINEL_ID, {"method": "sentinel", "params": None})
            return replies
        replies.append(message)


def by_text(messages: list[Any]) -> list[Any]:
    return sorted(messages, key=lambda message: json.dumps(message, sort_keys=True))


async def exchange(bad: bytes, *, wanted: int = 2, **options: Any) -> tuple[list[Any], Recorder]:
    """Send a notification, the bad line, a notification and the sentinel; return the replies before the
    sentinel's answer and what the recorder saw."""
    recorder = Recorder(wanted=wanted)
    async with peer_and_connection(request_handler=echo, recorder=recorder, **options) as (connection, peer):
        with anyio.fail_after(WAIT):
            await peer.send(notification("before", {"n": 1}))
            await peer.send_raw(bad)
            await peer.send(notification("after", {"n": 2}))
            await peer.send(request(SENTINEL_ID, "sentinel"))
            replies = await replies_until_sentinel(peer)
            await recorder.enough.wait()
            assert not connection.statistics().closed
    return replies, recorder


AROUND = [("before", {"n": 1}), ("after", {"n": 2})]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# -- lines that are answered ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "replies"),
    [
        pytest.param(
            b'{"jsonrpc":"2.0","id":3,"method":"x"\n',
            [parse_error(3, "not JSON: Input data was truncated")],
            id="truncated-request-with-a-readable-id",
        ),
        pytest.param(
            b'{"jsonrpc":"2.0","id":3,"method":"x",}\n',
            [parse_error(3, "not JSON: JSON is malformed: trailing comma in object (byte 37)")],
            id="trailing-comma",
        ),
        pytest.param(
            b"{oops\n",
            [parse_error(None, "not JSON: JSON is malformed: object keys must be strings (byte 1)")],
            id="garbage-object",
        ),
        pytest.param(
            b'[{"jsonrpc":"2.0","id":4,"meth\n',
            [parse_error(None, "not JSON: Input data was truncated")],
            id="broken-batch",
        ),
        pytest.param(
            b'{"jsonrpc":"2.0","id":5,"method":"m","params":{"s":"\xff"}}\n',
            [parse_error(5, "not UTF-8")],
            id="invalid-utf8-request",
        ),
        pytest.param(
            b'{"jsonrpc":"2.0","id":"\xff","method":"m"}\n',
            [parse_error(None, "not UTF-8")],
            id="invalid-utf8-in-the-id",
        ),
        pytest.param(
            b'{"jsonrpc":"2.0","id":1.5,"method":"m"}\n',
            [
                invalid_request(
                    None, "not a JSON-RPC message: Expected `int | str | null`, got `float` - at `$.id`"
                )
            ],
            id="float-id",
        ),
        pytest.param(
            b'{"jsonrpc":"2.0","id":true,"method":"m"}\n',
            [
                invalid_request(
                    None, "not a JSON-RPC message: Expected `int | str | null`, got `bool` - at `$.id`"
                )
            ],
            id="bool-id",
        ),
        pytest.param(
            b'{"jsonrpc":"2.0","id":{},"method":"m"}\n',
            [
                invalid_request(
                    None, "not a JSON-RPC message: Expected `int | str | null`, got `object` - at `$.id`"
                )
            ],
            id="object-id",
        ),
        pytest.param(
            b'{"jsonrpc":"2.0","id":[],"method":"m"}\n',
            [
                invalid_request(
                    None, "not a JSON-RPC message: Expected `int | str | null`, got `array` - at `$.id`"
                )
            ],
            id="array-id",
        ),
        pytest.param(
            b'{"jsonrpc":"2.0","id":6,"params":{"a":1}}\n',
            [invalid_request(6, 'a request without a "method"')],
            id="request-without-method",
        ),
        pytest.param(
            b'{"jsonrpc":"2.0","id":7}\n',
            [invalid_request(7, "a response with neither result nor error")],
            id="bare-id-of-no-request-of-ours",
        ),
        pytest.param(
            b'{"jsonrpc":"2.0","method":7}\n',
            [invalid_request(None, "not a JSON-RPC message: Expected `str`, got `int` - at `$.method`")],
            id="method-not-a-string",
        ),
        pytest.param(
            b'{"hello":"world"}\n',
            [invalid_request(None, 'the "jsonrpc" member is not "2.0"')],
            id="no-envelope",
        ),
        pytest.param(
            b'{"jsonrpc":"2.0"}\n',
            [invalid_request(None, "neither a request, a notification nor a response")],
            id="empty-envelope",
        ),
        pytest.param(
            ('{"jsonrpc":"2.0","id":8,"method":"m","params":' + nested(DEEP) + "}\n").encode(),
            [invalid_request(8, "nested too deeply")],
            id="deep-params-id-first",
        ),
        pytest.param(
            ('{"jsonrpc":"2.0","method":"m","params":' + nested(DEEP) + ',"id":"late"}\n').encode(),
            [invalid_request("late", "nested too deeply")],
            id="deep-params-id-last",
        ),
        pytest.param(
            ('{"jsonrpc":"2.0","method":"m","params":' + nested(DEEP) + "}\n").encode(),
            [invalid_request(None, "nested too deeply")],
            id="deep-notification",
        ),
        pytest.param(
            b"[]\n", [invalid_request(None, "a JSON array: batches are not supported")], id="empty-batch"
        ),
        pytest.param(
            b"[1, 2]\n",
            [invalid_request(None, "a JSON array: batches are not supported")],
            id="batch-of-junk",
        ),
        pytest.param(
            b'[{"jsonrpc":"2.0","method":"n"}]\n',
            [invalid_request(None, "a JSON array: batches are not supported")],
            id="batch-of-a-notification",
        ),
        pytest.param(
            b'[{"jsonrpc":"2.0","id":1,"method":"a"},{"jsonrpc":"2.0","method":"n"},{"jsonrpc":"2.0","id":"b","method":"b"},7]\n',
            [
                [
                    invalid_request(1, "a JSON array: batches are not supported"),
                    invalid_request("b", "a JSON array: batches are not supported"),
                ]
            ],
            id="batch-of-requests",
        ),
    ],
)
async def test_a_line_that_tries_to_be_json_rpc_and_is_not_valid_gets_the_error_json_rpc_prescribes(
    bad: bytes, replies: list[Any]
) -> None:
    got, recorder = await exchange(bad)
    assert by_text(got) == by_text(replies)
    assert recorder.notifications == AROUND
    [reported] = recorder.protocol_errors
    assert isinstance(reported, MalformedMessageError)
    assert reported.excerpt == bad.rstrip(b"\n")[:120]


# -- lines that are only reported -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(b"Running database migrations... done\n", id="log-line"),
        pytest.param(b"[INFO] server ready on port 8080\n", id="log-line-in-brackets"),
        pytest.param(b'"just a string"\n', id="json-scalar"),
        pytest.param(b"\xef\xbb\xbf{not json\n", id="bom-and-garbage"),
        pytest.param(
            b'{"jsonrpc":"2.0","method":"n","params":{"s":"\xff"}}\n', id="invalid-utf8-notification"
        ),
        pytest.param(b'{"jsonrpc":"2.0","id":41,"result":"\xff"}\n', id="invalid-utf8-response"),
        pytest.param(b'{"jsonrpc":"2.0","id":true,"result":{}}\n', id="response-with-a-bool-id"),
        pytest.param(b'{"jsonrpc":"1.0","id":42,"result":1}\n', id="response-of-another-version"),
    ],
)
async def test_a_log_line_or_a_broken_response_is_reported_and_never_answered(bad: bytes) -> None:
    got, recorder = await exchange(bad)
    assert got == []
    assert recorder.notifications == AROUND
    assert [type(reported) for reported in recorder.protocol_errors] == [MalformedMessageError]


# -- what is delivered ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "delivered"),
    [
        pytest.param(r"\ud83d", "\ufffd", id="lone-high"),
        pytest.param(r"a\ude00b", "a\ufffdb", id="lone-low"),
        pytest.param(r"\ude00\ud83d", "\ufffd\ufffd", id="reversed-pair"),
        pytest.param(r"\ud83d\ude00", "\U0001f600", id="valid-pair"),
        pytest.param(r"\\ud83d", "\\ud83d", id="escaped-backslash"),
        pytest.param(r"\\\ud83d", "\\\ufffd", id="escaped-backslash-then-a-lone-surrogate"),
        pytest.param(r"\ud83d\ud83d\ude00", "\ufffd\U0001f600", id="lone-then-pair"),
    ],
)
async def test_a_notification_with_a_lone_surrogate_is_delivered_with_the_replacement_character(
    text: str, delivered: str
) -> None:
    bad = b'{"jsonrpc":"2.0","method":"update","params":{"text":"' + text.encode() + b'"}}\n'
    got, recorder = await exchange(bad, wanted=3)
    assert got == []
    assert recorder.notifications == [AROUND[0], ("update", {"text": delivered}), AROUND[1]]
    assert recorder.protocol_errors == []


class Chunk(msgspec.Struct, frozen=True):
    text: str


async def test_a_typed_update_with_a_lone_surrogate_arrives_typed_and_in_order() -> None:
    received: list[tuple[str, Any]] = []
    all_received = anyio.Event()

    def on_notification(method: str, params: Any) -> None:
        received.append((method, params))
        if len(received) == 4:
            all_received.set()

    lines = [
        line_of(notification("update", {"text": "one"})),
        b'{"jsonrpc":"2.0","method":"update","params":{"text":"smile \\ud83d"}}\n',
        line_of(notification("update", {"text": "three"})),
    ]
    async with open_pipe() as to_connection, open_pipe() as from_connection:
        connection = Connection(
            to_connection.reader,
            from_connection.writer,
            notification_handler=on_notification,
            typed_notifications={"update": Chunk},
        )
        peer = RawPeer(to_connection, from_connection)
        async with connection:
            with anyio.fail_after(WAIT):
                await peer.send_raw(b"".join(lines))  # one read: the fast path first meets it
                await peer.send_raw(lines[1])  # alone in its read
                await all_received.wait()
    assert received == [
        ("update", Chunk("one")),
        ("update", Chunk("smile \ufffd")),
        ("update", Chunk("three")),
        ("update", Chunk("smile \ufffd")),
    ]


async def test_a_request_and_a_result_with_a_lone_surrogate_are_served_and_resolved_repaired() -> None:
    async with peer_and_connection(request_handler=echo, recorder=Recorder()) as (connection, peer):
        with anyio.fail_after(WAIT):
            await peer.send_raw(b'{"jsonrpc":"2.0","id":"\\ud83d","method":"m","params":["\\udfff"]}\n')
            assert await peer.receive() == result("\ufffd", {"method": "m", "params": ["\ufffd"]})
            async with anyio.create_task_group() as tg:

                async def call() -> None:
                    assert await connection.request("read", result_type=str) == "x\ufffd"

                tg.start_soon(call)
                assert (await peer.receive())["id"] == 0
                await peer.send_raw(b'{"jsonrpc":"2.0","id":0,"result":"x\\ud800"}\n')


# -- responses that cannot resolve a request of ours --------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "detail"),
    [
        pytest.param(b'{"jsonrpc":"2.0","id":0}', "a response with neither result nor error", id="bare"),
        pytest.param(
            ('{"jsonrpc":"2.0","id":0,"result":' + nested(DEEP) + "}").encode(),
            "nested too deeply",
            id="too-deep",
        ),
        pytest.param(b'{"jsonrpc":"2.0","id":0,"result":"\xff"}', "not UTF-8", id="not-utf8"),
        pytest.param(
            b'{"jsonrpc":"2.0","id":0,"result":{"a":', "not JSON: Input data was truncated", id="truncated"
        ),
        pytest.param(
            b'[{"jsonrpc":"2.0","id":0,"result":1}]',
            "a JSON array: batches are not supported",
            id="in-a-batch",
        ),
    ],
)
async def test_a_response_that_cannot_be_read_fails_the_request_at_once_and_is_never_answered(
    answer: bytes, detail: str
) -> None:
    recorder = Recorder()
    async with peer_and_connection(request_handler=echo, recorder=recorder) as (connection, peer):
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:

                async def call() -> None:
                    with pytest.raises(InvalidResponseError) as caught:
                        await connection.request("ask")
                    assert (caught.value.method, caught.value.detail) == ("ask", detail)

                tg.start_soon(call)
                assert (await peer.receive())["id"] == 0
                await peer.send_raw(answer + b"\n")
            await peer.send(request(SENTINEL_ID, "sentinel"))
            replies = await replies_until_sentinel(peer)
            if detail.startswith("a JSON array"):  # a batch with no request in it is answered once
                assert replies == [invalid_request(None, detail)]
            else:
                assert replies == []
            assert connection.statistics().pending_requests == 0


# -- over-long lines ----------------------------------------------------------------------------------------

LIMIT = 1024


def padded(message: dict[str, Any], size: int) -> bytes:
    """`message` with a `pad` member last, making its line exactly `size` bytes (without the newline)."""
    base = json.dumps({**message, "pad": ""}, separators=(",", ":")).encode()
    return base[:-2] + b"x" * (size - len(base)) + b'"}'


@pytest.mark.parametrize("chunked", [False, True], ids=["one-read", "many-reads"])
async def test_an_over_long_request_is_answered_with_the_limit_and_an_over_long_notification_skipped(
    chunked: bool,
) -> None:
    size = 5000
    long_request = padded(request(9, "fs/write_text_file", {"path": "/a"}), size)
    long_notification = padded(notification("session/update", {"n": 0}), size)
    recorder = Recorder(wanted=2)
    async with peer_and_connection(request_handler=echo, recorder=recorder, max_line_bytes=LIMIT) as (
        connection,
        peer,
    ):
        with anyio.fail_after(WAIT):
            data = b"".join(
                [line_of(notification("before")), long_request, b"\n", long_notification, b"\n"]
            ) + line_of(notification("after"))
            if chunked:
                for start in range(0, len(data), 700):
                    await peer.send_raw(data[start : start + 700])
            else:
                await peer.send_raw(data)
            await peer.send(request(SENTINEL_ID, "sentinel"))
            replies = await replies_until_sentinel(peer)
            await recorder.enough.wait()
            assert connection.statistics().read_buffer_bytes == 0
    details = f"the message is {size} bytes, longer than the {LIMIT}-byte line limit"
    assert replies == [
        error(9, -32600, "Invalid Request", {"details": details, "size": size, "limit": LIMIT}),
    ]
    assert recorder.notifications == [("before", None), ("after", None)]
    assert [(type(e), getattr(e, "size", None)) for e in recorder.protocol_errors] == [
        (MessageTooLargeError, size),
        (MessageTooLargeError, size),
    ]


@pytest.mark.parametrize("chunked", [False, True], ids=["one-read", "many-reads"])
async def test_an_over_long_response_fails_its_request_at_once_with_the_size_and_the_limit(
    chunked: bool,
) -> None:
    size = 3000
    async with peer_and_connection(recorder=Recorder(), max_line_bytes=LIMIT) as (connection, peer):
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:

                async def call() -> None:
                    with pytest.raises(MessageTooLargeError) as caught:
                        await connection.request("read")
                    assert (caught.value.size, caught.value.limit, caught.value.outgoing) == (
                        size,
                        LIMIT,
                        False,
                    )
                    assert f"{LIMIT}-byte limit" in str(caught.value)

                tg.start_soon(call)
                assert (await peer.receive())["id"] == 0
                answer = padded(result(0, {"content": ""}), size)
                if chunked:
                    for start in range(0, len(answer), 500):
                        await peer.send_raw(answer[start : start + 500])
                    # The line has not ended yet, but is already known to be too long: the caller is
                    # failed when it ends, and nothing of it stays buffered meanwhile.
                    await peer.send_raw(b"\n")
                else:
                    await peer.send_raw(answer + b"\n")
            assert connection.statistics().pending_requests == 0


# -- what we send -------------------------------------------------------------------------------------------


async def test_a_request_or_notification_over_the_peers_limit_is_refused_before_anything_is_sent() -> None:
    async with peer_and_connection(request_handler=echo, max_line_bytes=LIMIT) as (connection, peer):
        with anyio.fail_after(WAIT):
            with pytest.raises(MessageTooLargeError) as caught:
                await connection.request("fs/write_text_file", {"content": "x" * 2000})
            assert caught.value.outgoing
            assert caught.value.limit == LIMIT
            assert caught.value.size > LIMIT
            size = caught.value.size
            assert str(caught.value) == (
                f"refused to send a {size}-byte message: longer than the peer's {LIMIT}-byte line limit"
            )
            with pytest.raises(MessageTooLargeError):
                await connection.notify("session/update", ["x" * 2000])
            assert connection.statistics().pending_requests == 0
            # Nothing went out: the next thing the peer reads is the next request, with the first id.
            async with anyio.create_task_group() as tg:
                tg.start_soon(connection.notify, "small")
                assert await peer.receive() == notification("small")


async def test_the_send_limit_can_differ_from_the_receive_limit() -> None:
    async with peer_and_connection(request_handler=echo, max_send_bytes=100) as (connection, _):
        with anyio.fail_after(WAIT):
            with pytest.raises(MessageTooLargeError) as caught:
                await connection.notify("n", ["x" * 100])
            assert caught.value.limit == 100


@pytest.mark.parametrize("kind", ["result", "error-data"])
async def test_an_answer_over_the_peers_limit_goes_out_as_internal_error_naming_the_limit(kind: str) -> None:
    async def serve(method: str, params: msgspec.Raw | None) -> Any:
        if kind == "result":
            return "x" * 5000
        raise RequestError(-32000, "too much", {"blob": "x" * 5000})

    async with peer_and_connection(request_handler=serve, max_line_bytes=LIMIT) as (_, peer):
        with anyio.fail_after(WAIT):
            await peer.send(request(1, "m"))
            answer = await peer.receive()
    size = len(line_of(result(1, "x" * 5000))) - 1 if kind == "result" else answer["error"]["data"]["size"]
    assert answer == error(
        1,
        -32603,
        "Internal error",
        {
            "details": f"the answer is {size} bytes, longer than the {LIMIT}-byte line limit",
            "size": size,
            "limit": LIMIT,
        },
    )


# -- bounds -------------------------------------------------------------------------------------------------


async def test_requests_beyond_the_in_flight_limit_are_refused_at_once_and_the_rest_served() -> None:
    release = anyio.Event()
    started: list[int] = []

    async def slow(method: str, params: msgspec.Raw | None) -> Any:
        started.append(msgspec.json.decode(params or b"null"))
        await release.wait()
        return "done"

    async with peer_and_connection(request_handler=slow, max_incoming_requests=3) as (connection, peer):
        with anyio.fail_after(WAIT):
            for n in range(5):
                await peer.send(request(n, "m", n))
            refused = [await peer.receive(), await peer.receive()]
            limit_data = {"details": "too many requests in flight (the limit is 3)", "limit": 3}
            assert by_text(refused) == by_text(
                [error(n, -32603, "Internal error", limit_data) for n in (3, 4)]
            )
            assert connection.statistics().incoming_requests == 3
            release.set()
            served = [await peer.receive() for _ in range(3)]
            assert by_text(served) == by_text([result(n, "done") for n in range(3)])
            await peer.send(request(5, "m", 5))
            assert await peer.receive() == result(5, "done")
    assert sorted(started) == [0, 1, 2, 5]


class StuckWriter(anyio.abc.ByteSendStream):
    """A peer that never reads: the first send blocks forever."""

    def __init__(self) -> None:
        self.sends = 0

    async def send(self, item: bytes) -> None:
        self.sends += 1
        await anyio.sleep_forever()

    async def aclose(self) -> None:
        pass


async def test_a_flood_of_garbage_from_a_peer_that_never_reads_queues_a_bounded_number_of_error_replies(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="subagent.acp.connection")
    writer = StuckWriter()
    recorder = Recorder()
    async with open_pipe() as to_connection:
        connection = Connection(
            to_connection.reader, writer, notification_handler=recorder.on_notification, name="flooded"
        )
        peer_writer = to_connection.writer
        async with connection:
            with anyio.fail_after(WAIT):
                await peer_writer.send(b"{garbage}\n" * 1000)  # one read: every reply is due at once
                await peer_writer.send(line_of(notification("still-reading")))
                await recorder.enough.wait()
                await anyio.wait_all_tasks_blocked()
                connection.close()
    dropped = [record for record in caplog.records if "dropped one" in record.getMessage()]
    assert len(dropped) == 1000 - 64  # 64 replies in flight at most; the rest dropped, not queued
    assert writer.sends == 1
    assert recorder.notifications == [("still-reading", None)]


async def test_a_slow_notification_handler_stops_the_reader_at_the_bound_and_loses_nothing() -> None:
    bound = 4096
    release = anyio.Event()
    first = anyio.Event()
    handled: list[int] = []
    reads: list[int] = []

    async def on_notification(method: str, params: msgspec.Raw | None) -> None:
        first.set()
        await release.wait()
        handled.append(msgspec.json.decode(params or b"null"))

    async with open_pipe() as to_connection, open_pipe() as from_connection:
        connection = Connection(
            to_connection.reader,
            from_connection.writer,
            notification_handler=on_notification,
            max_queued_notification_bytes=bound,
        )
        peer = RawPeer(to_connection, from_connection)
        async with connection:
            to_connection.reader.on_receive = lambda: reads.append(
                connection.statistics().queued_notification_bytes
            )
            with anyio.fail_after(WAIT):
                lines = [padded(notification("n", n), 500) + b"\n" for n in range(100)]
                for one in lines:  # each its own read
                    await peer.send_raw(one)
                await first.wait()
                await anyio.wait_all_tasks_blocked()
                # The reader stopped just past the bound: the rest waits in the pipe, not in our memory.
                queued = connection.statistics().queued_notification_bytes
                assert bound < queued <= bound + 501
                assert len(reads) < 20
                release.set()
                while len(handled) < 100:
                    await anyio.wait_all_tasks_blocked()
    assert handled == list(range(100))
    assert max(reads) <= bound + 501


async def test_a_notification_handler_awaiting_a_request_past_the_bound_does_not_deadlock() -> None:
    bound = 2048
    handled: list[Any] = []
    answered = anyio.Event()
    holder: list[Connection] = []

    async def on_notification(method: str, params: msgspec.Raw | None) -> None:
        if method == "kick":
            # The answer arrives behind many notifications: only the reader can reach it.
            handled.append(await holder[0].request("inner", result_type=object))
            answered.set()
        else:
            handled.append(msgspec.json.decode(params or b"null"))

    async with open_pipe() as to_connection, open_pipe() as from_connection:
        connection = Connection(
            to_connection.reader,
            from_connection.writer,
            notification_handler=on_notification,
            max_queued_notification_bytes=bound,
        )
        holder.append(connection)
        peer = RawPeer(to_connection, from_connection)
        async with connection:
            with anyio.fail_after(WAIT):
                await peer.send(notification("kick"))
                inner = await peer.receive()
                for n in range(50):
                    await peer.send_raw(padded(notification("n", n), 300) + b"\n")
                await peer.send(result(inner["id"], "inner answer"))
                await answered.wait()
                while len(handled) < 51:
                    await anyio.wait_all_tasks_blocked()
    assert handled == ["inner answer", *range(50)]


def test_limits_must_be_positive() -> None:
    for option in ("max_send_bytes", "max_incoming_requests", "max_queued_notification_bytes"):
        with pytest.raises(ValueError, match=option):
            Connection(None, None, **{option: 0})  # type: ignore[arg-type]


class PipeEnd(anyio.abc.ByteReceiveStream):
    """The reading end of a pipe with no buffer: the writer blocks until we read, as on a full pipe."""

    def __init__(self, items: MemoryObjectReceiveStream[bytes]) -> None:
        self._items = items

    async def receive(self, max_bytes: int = 65536) -> bytes:
        try:
            return await self._items.receive()
        except anyio.EndOfStream:
            raise anyio.EndOfStream from None

    async def aclose(self) -> None:
        self._items.close()


async def test_a_flood_of_notifications_into_a_stuck_handler_holds_memory_near_the_bound() -> None:
    bound = 1024 * 1024
    count = 2000
    line = padded(notification("n", 0), 10_000) + b"\n"  # 20 MB in all
    release = anyio.Event()
    stuck = anyio.Event()
    handled = 0
    sent = 0

    async def on_notification(method: str, params: msgspec.Raw | None) -> None:
        nonlocal handled
        stuck.set()
        await release.wait()
        handled += 1

    to_connection, from_peer = anyio.create_memory_object_stream[bytes](0)
    async with open_pipe() as from_connection:
        from_peer_end = PipeEnd(from_peer)
        connection = Connection(
            from_peer_end,
            from_connection.writer,
            notification_handler=on_notification,
            max_queued_notification_bytes=bound,
        )

        async def flood() -> None:
            nonlocal sent
            with to_connection:
                for _ in range(count):
                    await to_connection.send(line)
                    sent += 1

        tracemalloc.start()
        try:
            async with connection, anyio.create_task_group() as tg:
                with anyio.fail_after(30):
                    tg.start_soon(flood)
                    await stuck.wait()
                    await anyio.wait_all_tasks_blocked()
                    held, _ = tracemalloc.get_traced_memory()
                    assert sent < count // 10  # the peer is blocked: we stopped reading
                    release.set()
                    while handled < count:
                        await anyio.wait_all_tasks_blocked()
                    _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await from_peer_end.aclose()
    # Measured: 1.07 MiB held when the reader stopped, 1.07 MiB at the peak (20.7 MB with no bound).
    assert held < 3 * bound
    assert peak < 4 * bound


async def test_a_notification_handler_sending_to_a_peer_that_is_still_writing_does_not_deadlock() -> None:
    # A single-threaded peer: it writes all its notifications, and reads our echoes only afterwards.
    bound = 2048
    count = 50
    to_connection, from_peer = anyio.create_memory_object_stream[bytes](0)
    to_peer, from_connection = anyio.create_memory_object_stream[bytes](0)
    holder: list[Connection] = []

    async def on_notification(method: str, params: msgspec.Raw | None) -> None:
        await holder[0].notify("echo", params)  # blocks: the peer is not reading yet

    class PeerReader(anyio.abc.ByteSendStream):
        async def send(self, item: bytes) -> None:
            await to_peer.send(item)

        async def aclose(self) -> None:
            to_peer.close()

    echoes: list[Any] = []
    with from_connection, to_peer:
        from_peer_end = PipeEnd(from_peer)
        connection = Connection(
            from_peer_end,
            PeerReader(),
            notification_handler=on_notification,
            max_queued_notification_bytes=bound,
        )
        holder.append(connection)
        try:
            async with connection:
                with anyio.fail_after(WAIT), to_connection:  # no end of stream before the echoes
                    for n in range(count):
                        await to_connection.send(padded(notification("n", n), 300) + b"\n")
                    while len(echoes) < count:
                        echoes.append(json.loads(await from_connection.receive())["params"])
        finally:
            await from_peer_end.aclose()
    assert echoes == list(range(count))
