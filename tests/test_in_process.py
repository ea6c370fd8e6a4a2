"""`subagent.testing`'s in-memory transport: its byte pipe, and how an agent served in process ends.

The pipe is bounded (a writer waits for its reader) and ends as a pipe does (EOF after what was written,
`BrokenResourceError` for a writer whose reader is gone). An agent served by `InProcessTransport` ends the
way a process's end looks to the client: a crash is status 1 with its traceback on stderr, teardown takes
the close-stdin, SIGTERM, SIGKILL steps, and cancelling the block leaves no task behind.
"""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest

from subagent import SubagentError, SubagentRequest, SubagentService
from subagent.acp import AgentExitedError
from subagent.acp.agent import AgentHandler
from subagent.acp.client import spawn_agent
from subagent.acp.transports import TeardownStep
from subagent.providers.acp import AcpProvider
from subagent.testing import (
    MEMORY_CHUNK_BYTES,
    MEMORY_PIPE_CHUNKS,
    InProcessChannel,
    InProcessTransport,
    memory_byte_pipe,
)
from tests.leaks import assert_no_leaks
from tests.transports import ScriptedHandler

# The channel is streams, tasks and cancellation: trio adds something here (see tests/conftest.py).
pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

WAIT = 10  # seconds: a hang guard, never a sleep


# -- the byte pipe ---------------------------------------------------------------------------------------


async def test_a_pipe_holds_a_bounded_number_of_chunks_and_then_makes_the_writer_wait() -> None:
    send, receive = memory_byte_pipe()
    big = bytes(range(256)) * (MEMORY_CHUNK_BYTES * (MEMORY_PIPE_CHUNKS + 2) // 256)
    sent = anyio.Event()

    async def write() -> None:
        await send.send(big)
        sent.set()

    async with send, receive, anyio.create_task_group() as task_group:
        task_group.start_soon(write)
        with anyio.fail_after(WAIT):
            first = await receive.receive(MEMORY_CHUNK_BYTES)
            # Two chunks over the bound: the writer still waits with one chunk unsent.
            assert not sent.is_set()
            rest = [first]
            while sum(map(len, rest)) < len(big):
                rest.append(await receive.receive())
            await sent.wait()
    assert b"".join(rest) == big
    assert max(map(len, rest)) == MEMORY_CHUNK_BYTES


async def test_a_pipe_splits_a_chunk_only_to_honour_max_bytes_and_ends_with_eof_after_the_data() -> None:
    send, receive = memory_byte_pipe()
    async with receive:
        await send.send(b"hello world")
        await send.aclose()
        with anyio.fail_after(WAIT):
            assert await receive.receive(5) == b"hello"
            assert await receive.receive() == b" world"
            with pytest.raises(anyio.EndOfStream):
                await receive.receive()


async def test_writing_to_a_pipe_whose_reader_closed_is_a_broken_resource() -> None:
    send, receive = memory_byte_pipe()
    await receive.aclose()
    async with send:
        with pytest.raises(anyio.BrokenResourceError):
            await send.send(b"anyone?")


async def test_a_pipe_records_every_send_whole_when_asked() -> None:
    record: list[bytes] = []
    send, receive = memory_byte_pipe(record=record)
    async with send, receive:
        await send.send(b"one\n")
        await send.send(b"two\n")
    assert record == [b"one\n", b"two\n"]


# -- how an in-process agent ends ------------------------------------------------------------------------


def crashing(channel: InProcessChannel) -> AgentHandler:
    """Making the agent fails: its main raises before it serves anything, as a bug in an agent would."""
    raise RuntimeError("the agent's own bug")


async def test_an_agent_whose_main_raises_exits_1_with_its_traceback_on_stderr(tmp_path: Path) -> None:
    transport = InProcessTransport(crashing)
    provider = AcpProvider(["crashing-agent"], transport=transport)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go", cwd=str(tmp_path))) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
    [channel] = transport.channels
    info = channel.exit_info()
    assert info is not None
    assert (info.returncode, info.pid, info.status) == (1, None, "exited with status 1")
    assert info.stderr_tail.startswith("Traceback (most recent call last):")
    assert info.stderr_tail.endswith("RuntimeError: the agent's own bug\n")
    assert "(pid unknown via memory streams) exited with status 1; last stderr: Traceback" in str(
        caught.value
    )


async def test_teardown_of_an_agent_that_exits_on_stdin_eof_is_graceful() -> None:
    transport = InProcessTransport(lambda channel: ScriptedHandler(channel, text="hi"))
    async with assert_no_leaks(), spawn_agent(["agent"], transport=transport) as client:
        with anyio.fail_after(WAIT):
            await client.initialize()
    [channel] = transport.channels
    report = channel.teardown_report
    assert report is not None
    assert (report.steps, report.exited_before_teardown, report.group_gone) == (
        (TeardownStep.CLOSE_STDIN,),
        False,
        True,
    )
    info = channel.exit_info()
    assert info is not None
    assert (info.returncode, info.teardown_signal) == (0, None)


async def test_cancelling_the_open_block_ends_the_agent_task_and_leaves_nothing_behind() -> None:
    transport = InProcessTransport(lambda channel: ScriptedHandler(channel, text="working", work=True))
    async with assert_no_leaks():
        with anyio.CancelScope() as scope:
            async with spawn_agent(["busy-agent"], transport=transport) as client:
                with anyio.fail_after(WAIT):
                    await client.initialize()
                    scope.cancel()
                    await anyio.sleep_forever()
    [channel] = transport.channels
    assert channel.exit_info() is not None
    assert channel.teardown_report is not None


async def test_a_killed_agent_looks_to_the_client_like_a_dead_process() -> None:
    transport = InProcessTransport(lambda channel: ScriptedHandler(channel, text="working", work=True))
    async with assert_no_leaks(), spawn_agent(["busy-agent"], transport=transport) as client:
        with anyio.fail_after(WAIT):
            await client.initialize()
            [channel] = transport.channels
            channel.kill()
            with pytest.raises(AgentExitedError) as caught:
                await client.new_session("/")
    assert caught.value.exit_info is not None
    assert caught.value.exit_info.killed_by is signal.SIGKILL
