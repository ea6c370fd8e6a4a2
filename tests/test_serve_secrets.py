"""`subagent serve` on an OpenAI-compatible server never lets the API key out: not in what it answers
over stdout (an error's ``data`` included), not in what it logs to stderr, even at ``-vv``.

A real ``python -m subagent serve`` is driven over its stdio, line by line, against the loopback stub
chat server, which echoes the ``Authorization`` header back in its error, as servers that quote a
rejected key do. Every wait is bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from subagent.testing import ErrorReply, StreamedReply, serve_chat_completions
from tests.test_openai_hostile import KEY, KEY_CORE, assert_never_shown

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

PROCESS_WAIT: Final = 30  # seconds: a hang guard on a whole exchange with a real process
KEY_ENV: Final = "SUBAGENT_SERVE_TEST_KEY"


async def drive_serve(base_url: str, key: str, cwd: Path) -> tuple[dict[str, Any], bytes, bytes]:
    """Run ``subagent serve -vv`` on ``base_url`` with ``key`` in its environment; initialize, open a
    session and prompt it once. The prompt's answer, and everything written to stdout and stderr."""
    command = [sys.executable, "-m", "subagent", "serve", "-vv"]
    command += ["--base-url", base_url, "--model", "stub-model", "--api-key-env", KEY_ENV]
    stderr = bytearray()
    stdout = bytearray()

    async def collect(stream: anyio.abc.ByteReceiveStream, into: bytearray) -> None:
        async for data in stream:
            into += data

    async def request(process: anyio.abc.Process, reader: BufferedByteReceiveStream, message: Any) -> Any:
        assert process.stdin is not None
        await process.stdin.send(json.dumps(message).encode() + b"\n")
        while True:  # notifications may come first
            line = await reader.receive_until(b"\n", 1024 * 1024)
            stdout.extend(line + b"\n")
            answer = json.loads(line)
            if answer.get("id") == message["id"]:
                return answer

    with anyio.fail_after(PROCESS_WAIT):
        async with (
            await anyio.open_process(command, env={**os.environ, KEY_ENV: key}) as process,
            anyio.create_task_group() as group,
        ):
            assert process.stdout is not None
            assert process.stderr is not None
            group.start_soon(collect, process.stderr, stderr)
            reader = BufferedByteReceiveStream(process.stdout)
            initialize = {"protocolVersion": 1}
            await request(
                process, reader, {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": initialize}
            )
            session = {"cwd": str(cwd), "mcpServers": []}
            opened = await request(
                process, reader, {"jsonrpc": "2.0", "id": 1, "method": "session/new", "params": session}
            )
            prompt = {"sessionId": opened["result"]["sessionId"], "prompt": [{"type": "text", "text": "hi"}]}
            answer = await request(
                process, reader, {"jsonrpc": "2.0", "id": 2, "method": "session/prompt", "params": prompt}
            )
            assert process.stdin is not None
            await process.stdin.aclose()  # the end of the conversation: serve exits
            stdout += reader.buffer
            await collect(process.stdout, stdout)
            assert await process.wait() == 0
    return answer, bytes(stdout), bytes(stderr)


async def test_serve_never_writes_a_key_the_server_echoes_back(tmp_path: Path) -> None:
    echo = ErrorReply(401, "Incorrect API key provided", echo_headers=["authorization"])
    async with serve_chat_completions([echo, StreamedReply(text="never")]) as server:
        answer, stdout, stderr = await drive_serve(server.base_url, KEY, tmp_path)
    assert [request.headers["authorization"] for request in server.requests] == [f"Bearer {KEY}"]
    assert answer["error"]["code"] == -32603
    assert answer["error"]["data"] == {
        "stopReason": "error",
        "details": f"the model call failed (auth): {server.base_url}/chat/completions answered HTTP 401 "
        "Unauthorized: 'Incorrect API key provided (authorization: Bearer [redacted])'",
    }
    assert b"HTTP Request: POST" in stderr  # the capture did see the HTTP stack's records
    assert_never_shown(KEY, KEY_CORE, [stdout.decode(errors="replace"), stderr.decode(errors="replace")])


async def test_serve_refuses_a_key_with_a_trailing_newline_naming_the_variable_only(tmp_path: Path) -> None:
    async with serve_chat_completions([StreamedReply(text="never")]) as server:
        answer, stdout, stderr = await drive_serve(server.base_url, KEY + "\n", tmp_path)
    assert server.requests == []
    assert answer["error"]["data"] == {
        "stopReason": "error",
        "details": f"the model call failed (auth): ${KEY_ENV} holds an unusable API key, so no request was "
        "made: it ends with a line break (a newline or carriage return), as a file read unstripped does",
    }
    assert_never_shown(
        KEY + "\n", KEY_CORE, [stdout.decode(errors="replace"), stderr.decode(errors="replace")]
    )
