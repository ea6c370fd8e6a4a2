"""Byte streams over anyio memory object streams: wire a JSON-RPC peer to a client in memory."""

from __future__ import annotations

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream


class MemoryReceive(anyio.abc.ByteReceiveStream):
    """The reading end: each receive returns one whole item that was sent; EOF once either end closed."""

    def __init__(self, stream: MemoryObjectReceiveStream[bytes]) -> None:
        self._stream = stream

    async def receive(self, max_bytes: int = 65536) -> bytes:
        try:
            return await self._stream.receive()
        except anyio.ClosedResourceError:
            raise anyio.EndOfStream from None

    async def aclose(self) -> None:
        self._stream.close()


class MemorySend(anyio.abc.ByteSendStream):
    """The writing end: every send is one item; closing it is EOF for the reader."""

    def __init__(self, stream: MemoryObjectSendStream[bytes]) -> None:
        self._stream = stream

    async def send(self, item: bytes) -> None:
        await self._stream.send(item)

    async def aclose(self) -> None:
        self._stream.close()
