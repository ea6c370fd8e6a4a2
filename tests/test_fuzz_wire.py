"""Fuzzing the JSON-RPC wire: generated and mutated lines fed to a `Connection`, to the ACP client and to
`subagent serve`'s agent side, on asyncio and trio.

Messages are generated (requests, notifications, responses, with arbitrary JSON params, written compactly
or with spaces, ASCII-escaped or not), then some are mutated: bytes flipped, deleted or duplicated,
lines truncated or split, nesting thousands deep, lone surrogate escapes, invalid UTF-8, ids of the wrong
type, members dropped, batches, log lines, lines over the limit. The whole input is cut into reads at
arbitrary points. The properties, for every input:

* nothing escapes, nothing hangs (a `fail_after` guard), and the connection stays open;
* every request a reference parser (Python's `json`) can identify gets an answer with its id, exactly one
  when its id appears in no other line; every answer is a well-formed response object (or a batch's
  array of them) that carries no internal text;
* the notifications that were not mutated arrive, in order, and a request sent last is answered.

`make test` runs a fixed sample (the `default` hypothesis profile); `make fuzz` explores at length. One
test feeds a seeded corpus of mutated lines to `python -m subagent serve` over its real stdio.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
import anyio.streams.buffered
import msgspec
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from hypothesis import given
from hypothesis import strategies as st

from subagent.acp.agent import AgentSideConnection
from subagent.acp.client import AcpClient
from subagent.acp.connection import Connection
from subagent.runtime import ScriptedLlm
from subagent.serve import ServedAgent
from subagent.testing import MemoryByteReceiveStream, MemoryByteSendStream

pytestmark = [pytest.mark.anyio, pytest.mark.fuzz]

WAIT: Final = 20  # seconds: a hang guard on one example, never a pacing
LIMIT: Final = 4096  # max_line_bytes everywhere here, so that generated lines cross it
SENTINEL: Final = "sentinel"
ROOT: Final = Path(__file__).resolve().parent.parent
FIXTURE: Final = ROOT / "fixtures" / "scripts" / "delegate_to_spawn.json"

TRIED: Counter[str] = Counter()
"""Inputs and lines tried per target in this process (printed by `report_counts` with `-s`)."""


# -- generated messages -------------------------------------------------------------------------------------

json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_leaves,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)


@dataclass(frozen=True)
class Vocabulary:
    """What one target's valid messages look like: request methods with params, notification methods."""

    requests: tuple[tuple[str, Any], ...]
    notifications: tuple[tuple[str, Any], ...]


@st.composite
def message(draw: st.DrawFn, vocabulary: Vocabulary, index: int) -> dict[str, Any]:
    """One valid message; requests get the id ``q<index>`` (or ``index`` itself), unique in the input."""
    kind = draw(st.sampled_from(["request", "request", "notification", "notification", "response"]))
    params: Any
    if kind == "request":
        method, params = draw(st.sampled_from(vocabulary.requests))
        if params is None:
            params = draw(json_values)
        request_id: Any = draw(st.sampled_from([f"q{index}", index]))
        return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
    if kind == "notification":
        method, params = draw(st.sampled_from(vocabulary.notifications))
        if params is None:
            params = draw(json_values)
        return {"jsonrpc": "2.0", "method": method, "params": params}
    # A response to nothing we sent (ids well above anything the connection under test used).
    if draw(st.booleans()):
        return {"jsonrpc": "2.0", "id": 10_000 + index, "result": draw(json_values)}
    return {
        "jsonrpc": "2.0",
        "id": 10_000 + index,
        "error": {"code": -32603, "message": draw(st.text(max_size=8))},
    }


def encode(value: dict[str, Any], style: int) -> bytes:
    if style == 0:
        return json.dumps(value, separators=(",", ":")).encode()
    if style == 1:
        return json.dumps(value).encode()  # with spaces
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


Pick = Callable[[int, int], int]
"""Draws an integer in [low, high]: hypothesis in the properties, a seeded `random.Random` in the corpus."""

MUTATIONS: Final = (
    "flip",
    "truncate",
    "delete",
    "duplicate",
    "split",
    "nest",
    "surrogate",
    "bad-utf8",
    "wrong-id",
    "drop-member",
    "batch",
    "log-line",
    "oversize",
)
# The kinds JSON-RPC's letter is about come up twice as often as the blind byte mutations.
WEIGHTED_MUTATIONS: Final = (*MUTATIONS, "nest", "surrogate", "bad-utf8", "wrong-id", "drop-member")


def mutate(kind: str, value: dict[str, Any], line: bytes, pick: Pick) -> bytes:
    """`line` (the encoding of `value`) broken in the way `kind` names."""
    at = pick(0, len(line))
    if kind == "flip" and line:
        at = min(at, len(line) - 1)
        return line[:at] + bytes([pick(0, 255)]) + line[at + 1 :]
    if kind == "truncate":
        return line[:at]
    if kind == "delete" and line:
        return line[:at] + line[at + 1 :]
    if kind == "duplicate":
        start = pick(0, len(line))
        return line[:at] + line[start : start + pick(1, 40)] + line[at:]
    if kind == "split":
        return line[:at] + b"\n" + line[at:]
    if kind == "nest":
        depth = [2, 999, 1_100, 1_900][pick(0, 3)]  # either side of msgspec's ~1,000 levels, within LIMIT
        closing = depth - pick(0, 2)  # sometimes left unclosed
        nested = b"[" * depth + b"]" * max(closing, 0)
        return json.dumps({**value, "params": 0}).encode().replace(b'"params": 0', b'"params": ' + nested)
    if kind == "surrogate":
        escape = [b"\\ud83d", b"\\udc00", b"\\\\ud83d", b"\\ud83d\\ude00"][pick(0, 3)]
        text = json.dumps({**value, "params": {"text": "x"}}).encode()
        return text.replace(b'"x"', b'"x' + escape + b'"')
    if kind == "bad-utf8":
        return line[:at] + [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc3\x28"][pick(0, 3)] + line[at:]
    if kind == "wrong-id":
        wrong = [1.5, True, {}, [], None, -1][pick(0, 5)]
        return json.dumps({**value, "id": wrong}).encode()
    if kind == "drop-member":
        keys = sorted(value)
        dropped = keys[pick(0, len(keys) - 1)]
        return json.dumps({key: item for key, item in value.items() if key != dropped}).encode()
    if kind == "batch":
        return b"[" + b",".join([line] * pick(0, 3)) + b"]"
    if kind == "log-line":
        return [b"Running database migrations... done", b"[INFO] ready", b"", b"   ", b"null"][pick(0, 4)]
    if kind == "oversize":
        return json.dumps({**value, "pad": "x" * (LIMIT + pick(0, 3 * LIMIT))}).encode()
    return line


@dataclass
class Input:
    """A fuzzed input: the bytes, how they are cut into reads, and what was left intact."""

    data: bytes
    cuts: list[int]
    intact_notifications: list[tuple[str, Any]] = field(default_factory=list)

    def reads(self) -> Iterator[bytes]:
        start = 0
        for cut in [*sorted(set(self.cuts)), len(self.data)]:
            if cut > start:
                yield self.data[start:cut]
                start = cut


@st.composite
def wire_input(draw: st.DrawFn, vocabulary: Vocabulary) -> Input:
    lines: list[bytes] = []
    intact: list[tuple[str, Any]] = []
    for index in range(draw(st.integers(min_value=1, max_value=8))):
        value = draw(message(vocabulary, index))
        line = encode(value, draw(st.integers(min_value=0, max_value=2)))
        if draw(st.booleans()):
            kind = draw(st.sampled_from(WEIGHTED_MUTATIONS))
            line = mutate(
                kind, value, line, lambda low, high: draw(st.integers(min_value=low, max_value=high))
            )
        elif "method" in value and "id" not in value and len(line) <= LIMIT:
            intact.append((value["method"], value["params"]))
        lines.append(line + draw(st.sampled_from([b"\n", b"\r\n"])))
    data = b"".join(lines)
    cuts = draw(st.lists(st.integers(min_value=0, max_value=len(data)), max_size=6))
    return Input(data, cuts, intact)


# -- the oracle ---------------------------------------------------------------------------------------------

_SURROGATE = re.compile("[\ud800-\udfff]")


def identifiable_requests(data: bytes) -> list[int | str]:
    """The ids of the lines a reference parser reads as requests (lone surrogates made U+FFFD, as we do)."""
    found: list[int | str] = []
    for raw in data.split(b"\n"):
        if len(raw) > LIMIT:  # the limit counts a trailing CR, as the connection does
            continue
        line = raw[:-1] if raw.endswith(b"\r") else raw
        try:
            value = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            continue
        if (
            not isinstance(value, dict)
            or value.get("jsonrpc") != "2.0"
            or not isinstance(value.get("method"), str)
        ):
            continue
        request_id = value.get("id", False)
        if isinstance(request_id, str):
            found.append(_SURROGATE.sub("\ufffd", request_id))
        elif isinstance(request_id, int) and not isinstance(request_id, bool):
            found.append(request_id)
    return found


def check_answer(answer: Any) -> None:
    """A well-formed JSON-RPC response object that says nothing about our internals."""
    assert isinstance(answer, dict), answer
    assert answer["jsonrpc"] == "2.0"
    assert "id" in answer
    assert ("result" in answer) != ("error" in answer), answer
    if "error" in answer:
        error = answer["error"]
        assert isinstance(error["code"], int)
        assert isinstance(error["message"], str)
    text = json.dumps(answer)
    assert "Traceback" not in text
    assert 'File "' not in text


def check_answers(data: bytes, answers: list[Any]) -> None:
    answered: Counter[Any] = Counter()
    for answer in answers:
        for item in answer if isinstance(answer, list) else [answer]:
            check_answer(item)
            answered[json.dumps(item["id"])] += 1
    for request_id in identifiable_requests(data):
        key = json.dumps(request_id)
        token_lines = sum(1 for line in data.split(b"\n") if key.encode() in line)
        assert answered[key] >= 1, f"request {request_id!r} was never answered"
        if token_lines == 1:
            assert answered[key] == 1, f"request {request_id!r} was answered {answered[key]} times"


# -- memory wiring ------------------------------------------------------------------------------------------


@dataclass
class Wire:
    """The fuzzer's end of the wire: it writes raw reads and reads whole lines."""

    to_target: MemoryObjectSendStream[bytes]
    from_target: MemoryObjectReceiveStream[bytes]
    pending: bytearray = field(default_factory=bytearray)

    async def every_answer(self) -> list[Any]:
        """Every answer up to the sentinel's, and those still due after it (answers are sent by separate
        tasks, in no promised order): once every task is idle, what was sent has arrived."""
        answers: list[Any] = []
        sentinel_seen = False
        while not sentinel_seen:
            self.pending += await self.from_target.receive()
            *lines, rest = self.pending.split(b"\n")
            self.pending = bytearray(rest)
            for line in lines:
                answer = json.loads(line)
                if isinstance(answer, dict) and answer.get("id") == SENTINEL:
                    sentinel_seen = True
                else:
                    answers.append(answer)
        await anyio.wait_all_tasks_blocked()
        with contextlib.suppress(anyio.WouldBlock):
            while True:
                self.pending += self.from_target.receive_nowait()
        assert self.pending.endswith(b"\n") or not self.pending
        answers.extend(json.loads(line) for line in self.pending.splitlines())
        return answers


@asynccontextmanager
async def wire() -> AsyncIterator[tuple[Wire, MemoryByteReceiveStream, MemoryByteSendStream]]:
    """A wire and the target's two ends of it."""
    to_target_send, to_target_receive = anyio.create_memory_object_stream[bytes](math.inf)
    from_target_send, from_target_receive = anyio.create_memory_object_stream[bytes](math.inf)
    with to_target_send, to_target_receive, from_target_send, from_target_receive:
        yield (
            Wire(to_target_send, from_target_receive),
            MemoryByteReceiveStream(to_target_receive),
            MemoryByteSendStream(from_target_send),
        )


async def feed(target: str, wire_end: Wire, fuzzed: Input, sentinel: dict[str, Any]) -> list[Any]:
    TRIED[f"{target} inputs"] += 1
    TRIED[f"{target} lines"] += fuzzed.data.count(b"\n")
    for read in fuzzed.reads():
        await wire_end.to_target.send(read)
    # Whatever the last line was, it ends here; then the sentinel must be answered.
    await wire_end.to_target.send(b"\n" + json.dumps(sentinel).encode() + b"\n")
    answers = await wire_end.every_answer()
    check_answers(fuzzed.data, answers)
    return answers


def in_order(expected: list[tuple[str, Any]], received: list[tuple[str, Any]]) -> bool:
    """Whether `expected` is a subsequence of `received`."""
    remaining = iter(received)
    return all(any(item == got for got in remaining) for item in expected)


# -- (a) the connection -------------------------------------------------------------------------------------


class Chunk(msgspec.Struct, frozen=True):
    text: str


CONNECTION_WORDS: Final = Vocabulary(
    requests=(
        ("echo", None),
        ("update", {"text": "a request, not a notification"}),
        ("$/cancel_request", None),
    ),
    notifications=(("update", {"text": "hello"}), ("other", None), ("update", None)),
)


@given(fuzzed=wire_input(CONNECTION_WORDS))
async def test_a_connection_survives_any_line_and_answers_every_request_it_can_identify(
    fuzzed: Input,
) -> None:
    received: list[tuple[str, Any]] = []

    def on_notification(method: str, params: Any) -> None:
        if isinstance(params, msgspec.Raw):
            params = msgspec.json.decode(params)
        received.append((method, params))

    async def echo(method: str, params: msgspec.Raw | None) -> Any:
        return {"method": method}

    async with wire() as (wire_end, receive, send):
        connection = Connection(
            receive,
            send,
            request_handler=echo,
            notification_handler=on_notification,
            max_line_bytes=LIMIT,
            typed_notifications={"update": Chunk},
            name="fuzzed",
        )
        async with connection:
            with anyio.fail_after(WAIT):
                await feed(
                    "connection", wire_end, fuzzed, {"jsonrpc": "2.0", "id": SENTINEL, "method": "echo"}
                )
                assert connection.statistics().closed is False
                assert connection.statistics().read_buffer_bytes == 0
    # The sentinel was handled only after every notification before it: all of them are in.
    expected = [as_delivered(method, params) for method, params in fuzzed.intact_notifications]
    assert in_order(expected, received), (expected, received)


def as_delivered(method: str, params: Any) -> tuple[str, Any]:
    """A notification as the handler gets it: `update` params that fit `Chunk` arrive as one."""
    if method == "update" and isinstance(params, dict) and isinstance(params.get("text"), str):
        return method, Chunk(params["text"])
    return method, params


# -- (b) the ACP client -------------------------------------------------------------------------------------

CLIENT_WORDS: Final = Vocabulary(
    requests=(
        ("session/request_permission", None),
        (
            "session/request_permission",
            {
                "sessionId": "s",
                "toolCall": {"toolCallId": "c"},
                "options": [{"optionId": "a", "name": "Allow", "kind": "allow_once"}],
            },
        ),
        ("fs/read_text_file", {"sessionId": "s", "path": "/etc/hostname"}),
        ("terminal/create", {"sessionId": "s", "command": "true"}),
        ("_ext/method", None),
        ("unknown/method", None),
    ),
    notifications=(
        (
            "session/update",
            {
                "sessionId": "s",
                "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "hi"}},
            },
        ),
        ("session/update", None),
        ("_ext/notice", None),
    ),
)


@given(fuzzed=wire_input(CLIENT_WORDS))
async def test_the_acp_client_survives_any_line_from_an_agent_and_answers_its_identifiable_requests(
    fuzzed: Input,
) -> None:
    async with wire() as (wire_end, receive, send), AcpClient(receive, send, max_line_bytes=LIMIT) as client:
        with anyio.fail_after(WAIT):
            sentinel = {"jsonrpc": "2.0", "id": SENTINEL, "method": "unknown/method"}
            await feed("acp-client", wire_end, fuzzed, sentinel)
            assert client.connection.statistics().closed is False


# -- (c) subagent serve's agent side ------------------------------------------------------------------------

SERVE_WORDS: Final = Vocabulary(
    requests=(
        ("initialize", {"protocolVersion": 1}),
        ("initialize", None),
        ("session/new", {"cwd": "/", "mcpServers": []}),
        ("session/new", None),
        ("session/prompt", {"sessionId": "session-0", "prompt": [{"type": "text", "text": "hi"}]}),
        ("session/close", {"sessionId": "session-0"}),
        ("session/load", None),
        ("_ext/method", None),
        ("unknown/method", None),
    ),
    notifications=(
        ("session/cancel", {"sessionId": "session-0"}),
        ("session/cancel", None),
        ("_ext/notice", None),
        ("$/cancel_request", {"requestId": "q0"}),
    ),
)


@given(fuzzed=wire_input(SERVE_WORDS))
async def test_subagent_serve_survives_any_line_from_a_client_and_answers_its_identifiable_requests(
    fuzzed: Input,
) -> None:
    llm = ScriptedLlm(fallback="ok")
    async with (
        wire() as (wire_end, receive, send),
        ServedAgent(llm) as handler,
        AgentSideConnection(handler, receive, send, max_line_bytes=LIMIT) as agent,
    ):
        with anyio.fail_after(WAIT):
            sentinel = {"jsonrpc": "2.0", "id": SENTINEL, "method": "unknown/method"}
            await feed("serve", wire_end, fuzzed, sentinel)
            assert agent.connection.statistics().closed is False


# -- subagent serve over its real stdio, on a seeded corpus ------------------------------------------------


def corpus(seed: int, count: int) -> bytes:
    """`count` lines of SERVE_WORDS messages, most of them mutated, from a seeded generator."""
    rng = random.Random(seed)
    lines = [
        json.dumps({"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": {"protocolVersion": 1}})
    ]
    for index in range(count):
        method, params = rng.choice(SERVE_WORDS.requests + SERVE_WORDS.notifications)
        value: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params or {}}
        if rng.random() < 0.7:
            value["id"] = f"q{index}"
        line = json.dumps(value).encode()
        if rng.random() < 0.8:
            line = mutate(rng.choice(MUTATIONS), value, line, rng.randint)
        lines.append(line.decode("utf-8", "surrogateescape"))
    return "\n".join(lines).encode("utf-8", "surrogateescape") + b"\n"


@pytest.mark.subprocess
async def test_serve_over_real_stdio_survives_a_mutated_corpus_and_answers_what_it_can() -> None:
    data = corpus(seed=20261201, count=300)
    sentinel = json.dumps({"jsonrpc": "2.0", "id": SENTINEL, "method": "unknown/method"}).encode() + b"\n"
    command = [sys.executable, "-m", "subagent", "serve", "--script", str(FIXTURE)]
    async with await anyio.open_process(command) as process:
        assert process.stdin is not None
        assert process.stdout is not None
        assert process.stderr is not None
        stdout = anyio.streams.buffered.BufferedByteReceiveStream(process.stdout)
        answers: list[Any] = []
        stderr = bytearray()

        async def drain_stderr() -> None:
            assert process.stderr is not None
            with contextlib.suppress(anyio.EndOfStream):
                while True:
                    stderr.extend(await process.stderr.receive())

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(drain_stderr)
                await process.stdin.send(data + b"\n" + sentinel)
                # End of input: serve drains what is in flight, answers it, and exits.
                await process.stdin.aclose()
                with contextlib.suppress(anyio.IncompleteRead):
                    while True:
                        answers.append(json.loads(await stdout.receive_until(b"\n", 1 << 26)))
                assert await process.wait() == 0
    TRIED["serve-stdio lines"] += data.count(b"\n")
    assert [answer for answer in answers if isinstance(answer, dict) and answer.get("id") == SENTINEL]
    check_answers(data, answers)
    assert b"Traceback" not in stderr


@pytest.fixture(scope="module", autouse=True)
def report_counts(pytestconfig: pytest.Config) -> Iterator[None]:
    """Say how many inputs were tried (for the record of a `make fuzz` run)."""
    yield
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if TRIED and reporter is not None and capture is not None:
        counts = ", ".join(f"{count} {what}" for what, count in sorted(TRIED.items()))
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\nfuzzed: {counts}")
