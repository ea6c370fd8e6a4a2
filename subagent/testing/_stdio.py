"""The stub agent's stdout (a pipe, or an in-process channel's memory stream): protocol lines from the
connection, with raw output spliced in exactly in order.

Misbehaviour steps (a garbage line, half a line, closing stdout, exiting) must happen *after* every message
the scenario sent before them has been written. `Connection.notify` returns once its writer task has taken
a line, not once the line is on the wire, and only that writer may touch stdout. So an out-of-band action
travels through the writer too: `OrderedStdout.run_in_order` sends a marker notification whose method
name holds a per-process secret, and when the writer hands that line to `OrderedStdout.send` the action
runs in its place (the marker itself never reaches the wire).
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Awaitable, Callable
from typing import Final

import anyio
import anyio.abc

from subagent.acp.agent import ClientPeer

__all__ = ["OrderedStdout"]

_MARKER_MAX_BYTES: Final = 200
"""The longest a marker line can be: a longer line is no marker, so big messages cost no search."""

Action = Callable[[anyio.abc.ByteSendStream], Awaitable[None]]
"""What a marker line stands for: run on stdout when the line's turn to be written comes."""


class OrderedStdout(anyio.abc.ByteSendStream):
    """A send stream over the agent's stdout that runs injected actions in the order its lines flow."""

    def __init__(self, inner: anyio.abc.ByteSendStream) -> None:
        self._inner = inner
        self._secret = secrets.token_hex(16)
        self._prefix = f"_subagent.stub/{self._secret}/"
        self._secret_bytes = self._secret.encode()
        self._ids = itertools.count()
        self._actions: dict[str, tuple[Action, anyio.Event]] = {}
        self.closed = False
        """Whether stdout was closed by an action (`close`)."""

    async def send(self, item: bytes) -> None:
        """Write a line, or run the action a marker line stands for."""
        if len(item) <= _MARKER_MAX_BYTES and self._secret_bytes in item:
            for key in list(self._actions):
                if key.encode() in item:
                    action, done = self._actions.pop(key)
                    try:
                        await action(self._inner)
                    finally:
                        done.set()
                    return
        await self._inner.send(item)

    async def aclose(self) -> None:
        """Close stdout."""
        self.closed = True
        await self._inner.aclose()

    async def run_in_order(self, client: ClientPeer, action: Action) -> None:
        """Run `action` on stdout once everything sent before this call has been written, and wait for it.

        Raises:
            ConnectionClosedError: the connection closed first (the action never runs).
        """
        key = f"{self._prefix}{next(self._ids)}"
        done = anyio.Event()
        self._actions[key] = (action, done)
        try:
            await client.notify(key)
            await done.wait()
        finally:
            self._actions.pop(key, None)

    async def write(self, client: ClientPeer, data: bytes) -> None:
        """Write raw bytes, in order."""

        async def write(stdout: anyio.abc.ByteSendStream) -> None:
            await stdout.send(data)

        await self.run_in_order(client, write)

    async def flush(self, client: ClientPeer) -> None:
        """Return once everything sent so far is written."""

        async def nothing(stdout: anyio.abc.ByteSendStream) -> None:
            pass

        await self.run_in_order(client, nothing)

    async def close(self, client: ClientPeer) -> None:
        """Close stdout, in order: the client reads everything sent before, then EOF."""

        async def close(stdout: anyio.abc.ByteSendStream) -> None:
            self.closed = True
            await stdout.aclose()

        await self.run_in_order(client, close)
