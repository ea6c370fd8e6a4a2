"""In-memory throughput of `subagent.acp.connection.Connection`, on asyncio and on trio.

Two connections talk over in-memory byte pipes (no process, no OS pipe), so the figures measure the JSON-RPC
engine itself: framing, envelope decoding, id bookkeeping, the writer task and the ordered notifier.
Run: `.venv/bin/python bench/jsonrpc_roundtrip.py`. Prints numbers only; nothing is asserted.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from subagent.acp.connection import Connection, NotificationHandler, RequestHandler

SEQUENTIAL_ROUND_TRIPS = 20_000
CONCURRENT_ROUND_TRIPS = 50_000
IN_FLIGHT = 100
NOTIFICATIONS = 100_000
BIG_LINE_BYTES = 10 * 1024 * 1024
PIPE_CHUNK = 65536


class _Reader(anyio.abc.ByteReceiveStream):
    def __init__(self, items: MemoryObjectReceiveStream[bytes]) -> None:
        self._items = items
        self._data = b""
        self._offset = 0

    async def receive(self, max_bytes: int = PIPE_CHUNK) -> bytes:
        while self._offset >= len(self._data):
            self._data, self._offset = await self._items.receive(), 0
        chunk = self._data[self._offset : self._offset + max_bytes]
        self._offset += len(chunk)
        return chunk

    async def aclose(self) -> None:
        self._items.close()


class _Writer(anyio.abc.ByteSendStream):
    def __init__(self, items: MemoryObjectSendStream[bytes]) -> None:
        self._items = items

    async def send(self, item: bytes) -> None:
        await self._items.send(item)

    async def aclose(self) -> None:
        self._items.close()


@asynccontextmanager
async def _pair(
    requests: RequestHandler | None = None, notifications: NotificationHandler | None = None
) -> AsyncIterator[tuple[Connection, Connection]]:
    a_send, b_receive = anyio.create_memory_object_stream[bytes](math.inf)
    b_send, a_receive = anyio.create_memory_object_stream[bytes](math.inf)
    with a_send, b_receive, b_send, a_receive:
        async with (
            Connection(_Reader(a_receive), _Writer(a_send), name="client") as client,
            Connection(
                _Reader(b_receive),
                _Writer(b_send),
                request_handler=requests,
                notification_handler=notifications,
                name="agent",
            ) as agent,
        ):
            yield client, agent


async def _echo(method: str, params: msgspec.Raw | None) -> Any:
    return params


async def _sequential() -> float:
    async with _pair(_echo) as (client, _):
        start = time.perf_counter()
        for n in range(SEQUENTIAL_ROUND_TRIPS):
            await client.request("echo", {"n": n})
        return SEQUENTIAL_ROUND_TRIPS / (time.perf_counter() - start)


async def _concurrent() -> float:
    async with _pair(_echo) as (client, _):
        per_worker = CONCURRENT_ROUND_TRIPS // IN_FLIGHT

        async def worker() -> None:
            for n in range(per_worker):
                await client.request("echo", {"n": n})

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(IN_FLIGHT):
                tg.start_soon(worker)
        return per_worker * IN_FLIGHT / (time.perf_counter() - start)


async def _notifications() -> float:
    received = 0
    all_received = anyio.Event()

    async def on_update(method: str, params: msgspec.Raw | None) -> None:
        nonlocal received
        received += 1
        if received == NOTIFICATIONS:
            all_received.set()

    async with _pair(notifications=on_update) as (client, _):
        start = time.perf_counter()
        for n in range(NOTIFICATIONS):
            await client.notify("session/update", {"n": n, "text": "chunk"})
        await all_received.wait()
        return NOTIFICATIONS / (time.perf_counter() - start)


async def _big_line() -> float:
    blob = "x" * BIG_LINE_BYTES

    async def serve(method: str, params: msgspec.Raw | None) -> str:
        return blob

    async with _pair(serve) as (client, _):
        start = time.perf_counter()
        answer = await client.request("read", result_type=str)
        elapsed = time.perf_counter() - start
        assert len(answer) == BIG_LINE_BYTES
        return elapsed


async def _main() -> None:
    print(f"  sequential round trips   {await _sequential():>10,.0f} /s")
    print(f"  concurrent round trips   {await _concurrent():>10,.0f} /s  ({IN_FLIGHT} in flight)")
    print(f"  notifications handled    {await _notifications():>10,.0f} /s  (in order)")
    print(f"  one 10 MiB result        {await _big_line() * 1000:>10.1f} ms  (encode, 64 KiB chunks, decode)")


if __name__ == "__main__":
    for backend in ("asyncio", "trio"):
        print(f"{backend}:")
        anyio.run(_main, backend=backend)
    print("no targets: figures only")
