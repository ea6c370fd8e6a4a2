"""The fault battery (test_faults.py, and the crashes, floods and teardowns of test_client_process.py)
over a remote transport, written once: test_ssh_faults.py binds it to SSH, test_ray_faults.py to Ray.

Each case in `REMOTE_FAULT_CASES` asserts the outcome its local twin asserts. Where transports differ,
the case asks its `Remote`: how the agent's pid is named in a message (``pid N via ssh to HOST``, ``pid
N on ray node 3f2a9c1b``), what of the run is a process of this host (the ssh client; nothing for Ray),
what the connection's log is named after, how an agent that only teardown ended is reported (over ssh a
lost connection, over Ray the local escalation, run on its node), and what "nothing left" means. Waits
are for events, under ``anyio.fail_after`` as hang guards only.

Not collected by pytest itself (no ``test_`` prefix): the binding modules parametrise one test each over
`REMOTE_FAULT_CASES`, as the lifecycle contract is shared (`subagent.testing.contract.CONTRACT_CHECKS`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shlex
import signal
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import anyio
import pytest
from _pytest.mark import ParameterSet

from subagent import (
    ErrorCode,
    ResumableRun,
    RunState,
    SubagentError,
    SubagentRequest,
    SubagentResult,
    SubagentService,
)
from subagent.acp import AgentExitedError, MessageTooLargeError, ProtocolError, schema
from subagent.acp.client import AcpClient, AcpSession, spawn_agent
from subagent.acp.handlers import PermissionQuestion
from subagent.acp.transports import ExitInfo, TeardownReport, TeardownStep, Transport
from subagent.providers.acp import AcpProvider
from subagent.testing import LEAK_TAG_VARIABLE, process_is_gone
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.test_faults import (
    CANCEL_PHASES,
    MIB,
    PERMISSION_PENDING,
    WIRE_FAULTS,
    Lifecycle,
    PhaseCaller,
    WireFault,
    acp_run,
    running_task_ids,
    texts,
)

BEFORE_THE_SPAWN = "while waiting for started, before the child exists"
"""The `CANCEL_PHASES` case in which no child (nor anything of the transport) ever existed."""
FLOOD_WAIT = 60
"""Seconds: the hang guard on the stderr flood, which moves 50 MiB through the transport."""


class RemoteTransport(Transport, Protocol):
    """What the battery uses of a remote transport beyond `Transport`."""

    @property
    def stderr_tail_bytes(self) -> int: ...


class RemoteChannel(Protocol):
    """What the battery uses of a remote transport's channel."""

    remote_pid: int | None

    @property
    def pid(self) -> int | None: ...

    def stderr_tail(self) -> str: ...

    def exit_info(self) -> ExitInfo | None: ...

    async def aclose(self, *, stdin_close_timeout: float | None = None) -> TeardownReport: ...


T = TypeVar("T", bound=RemoteTransport)


class Remote(ABC, Generic[T]):
    """The transport under test, and each outcome of the battery that depends on it."""

    wait: float
    """Seconds: a hang guard on one case, never a statement about speed."""
    ready_timeout: float
    """Long enough for the agent's start over this transport and its first stderr line on a loaded
    machine (it hangs in initialize: the timeout always runs out, so its length decides no outcome)."""

    @abstractmethod
    def transport(self, argv: list[str]) -> T:
        """A transport for the stub agent ``argv``, with test_faults' teardown graces for its scenario."""

    @abstractmethod
    def no_leaks(self, *transports: T) -> AbstractAsyncContextManager[str]:
        """The leak check of runs through ``transports`` (here and remote); yields the agents' leak tag."""

    channel_type: type[RemoteChannel]
    """The class of this transport's channels."""

    @property
    @abstractmethod
    def place(self) -> str:
        """Where an agent runs, as its messages say after its pid (``via ssh to HOST``)."""

    def channel(self, client: AcpClient) -> RemoteChannel:
        """``client``'s channel, of this transport's type."""
        process: object = client.process
        assert isinstance(process, self.channel_type)
        return process

    def where(self, info: ExitInfo) -> str:
        """Where the agent ``info`` describes ran, as its messages say (``pid N ...``)."""
        assert info.pid is not None
        return f"pid {info.pid} {self.place}"

    @abstractmethod
    def gone(self, local_pid: int | None, info: ExitInfo | None = None) -> None:
        """What of the run was a process of this host (``local_pid``, a run's or channel's ``pid``) is
        gone, and so, given ``info``, is the agent."""

    @abstractmethod
    def torn_down(self, info: ExitInfo | None, last_signal: signal.Signals) -> None:
        """``info`` is of an agent only teardown ended, whose local twin's last signal is ``last_signal``."""

    @abstractmethod
    def teardown_steps(self, ignore_sigterm: bool) -> list[TeardownStep]:
        """The steps of tearing down an agent that ignores stdin EOF (and SIGTERM, if ``ignore_sigterm``)."""

    @abstractmethod
    def log_name(self, local_pid: int | None, transport: T) -> int | str:
        """What the connection's log is named after (``acp:NAME``)."""

    @abstractmethod
    def measuring_memory(self) -> AbstractContextManager[list[int]]:
        """Measures this process's memory growth over the block; yields a list that gets the growth."""

    @abstractmethod
    def line_memory_bound(self, max_line_bytes: int) -> int:
        """The memory growth allowed while reading a line far longer than ``max_line_bytes``."""

    @abstractmethod
    def growth_message(self, growth: int, size: int, max_line_bytes: int) -> str:
        """Why a growth of ``growth`` bytes reading a ``size``-byte line is too much."""

    @abstractmethod
    def check_cancelled(
        self, caller: PhaseCaller, local_pid: int | None, info: ExitInfo | None, transport: T
    ) -> int | None:
        """The child of a run cancelled by ``caller`` (if one existed) is gone, torn down as expected;
        the pid its disposal may be reported under."""

    def killed(self, argv: list[str], info: ExitInfo, signum: signal.Signals, stderr: str) -> str:
        """A remote child killed by ``signum`` (not by teardown), as the remote side reported it."""
        return (
            f"agent `{shlex.join(argv)}` ({self.where(info)}) was killed by {signum.name} "
            f"(signal {signum.value}); last stderr: {stderr}"
        )

    def closed_stdout(self, argv: list[str], info: ExitInfo, stderr: str) -> str:
        return (
            f"agent `{shlex.join(argv)}` ({self.where(info)}) closed its stdout but is still running; "
            f"last stderr: {stderr}"
        )


@dataclass(frozen=True)
class Bench:
    """The fixtures a case uses besides its `Remote`."""

    stub_agent_command: StubAgentCommand
    tmp_path: Path
    caplog: pytest.LogCaptureFixture


FaultCase = Callable[[Remote[Any], Bench], Awaitable[None]]


def provider(transport: Transport, argv: list[str], cwd: Path, tag: str, **options: Any) -> AcpProvider:
    """ACP on the stub agent ``argv`` through ``transport``, its agents leak-tagged with ``tag``."""
    return AcpProvider(argv, cwd=cwd, env={LEAK_TAG_VARIABLE: tag}, transport=transport, **options)


@asynccontextmanager
async def open_service(
    remote: Remote[T], *transports: T
) -> AsyncIterator[tuple[SubagentService, Lifecycle, str]]:
    """An open service recording lifecycle events, and the leak tag for its providers' agents. Once
    closed, no process (here or remote), file descriptor or task may be left."""
    lifecycle = Lifecycle()
    async with remote.no_leaks(*transports) as tag:
        before = running_task_ids()
        async with SubagentService() as service:
            service.events.on("subagent/start", lambda info: lifecycle.events.append(("start", info)))
            service.events.on("subagent/end", lambda info: lifecycle.events.append(("end", info)))
            yield service, lifecycle, tag
        assert running_task_ids() == before


@asynccontextmanager
async def remote_client(
    remote: Remote[T], argv: list[str], **options: Any
) -> AsyncIterator[tuple[AcpClient, T]]:
    """`spawn_agent` of ``argv`` over the transport, leak-tagged, inside its leak check; ``options`` go to
    `spawn_agent`."""
    transport = remote.transport(argv)
    async with (
        remote.no_leaks(transport) as tag,
        spawn_agent(argv, env={LEAK_TAG_VARIABLE: tag}, transport=transport, **options) as client,
    ):
        yield client, transport


async def ready_session(client: AcpClient, cwd: Path) -> AcpSession:
    """Initialize ``client`` and open a session in ``cwd`` (under the case's hang guard)."""
    await client.initialize()
    return await client.new_session(cwd)


# -- killed by a signal ----------------------------------------------------------------------------------


async def a_remote_child_killed_before_it_is_ready_fails_the_start_naming_the_signal_and_stderr(
    remote: Remote[Any], bench: Bench, *, phase: str, signum: signal.Signals
) -> None:
    steps = [{"step": "stderr", "text": "loading the model\n"}, {"step": "kill", "signal": signum.name}]
    argv = bench.stub_agent_command({"requireAuth": "api-key", phase: {"steps": steps}})
    transport = remote.transport(argv)
    async with open_service(remote, transport) as (service, lifecycle, tag):
        service.register_provider(provider(transport, argv, bench.tmp_path, tag, auth_method="api-key"))
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(remote.wait), pytest.raises(SubagentError) as caught:
                await run.started()
        info = acp_run(run).exit_info
        remote.gone(acp_run(run).pid, info)
    assert info is not None
    assert caught.value.code is ErrorCode.START_FAILED
    assert caught.value.message == remote.killed(argv, info, signum, "loading the model")
    assert (info.killed_by, info.status_known, info.teardown_signal) == (signum, True, None)
    assert lifecycle.names == []
    assert run.state is RunState.DISPOSED


async def a_remote_child_killed_while_its_permission_question_is_pending_ends_the_turn_with_an_error(
    remote: Remote[Any], bench: Bench
) -> None:
    argv = bench.stub_agent_command(PERMISSION_PENDING)
    clients: list[AcpClient] = []
    asked: list[str] = []
    withdrawn = anyio.Event()

    async def kill_the_remote_child_while_deciding(question: PermissionQuestion) -> str | None:
        asked.append(question.tool_call_id)
        channel = remote.channel(clients[0])
        assert channel.remote_pid is not None
        os.kill(channel.remote_pid, signal.SIGKILL)  # the "remote" host is this one
        try:
            await anyio.sleep_forever()  # the question stays pending while the child dies
        finally:
            withdrawn.set()
        return "allow"

    async with remote_client(remote, argv, permission=kill_the_remote_child_while_deciding) as (client, _):
        clients.append(client)
        with anyio.fail_after(remote.wait):
            session = await ready_session(client, bench.tmp_path)
            with pytest.raises(AgentExitedError) as caught:
                await session.prompt("edit it")
        local_pid = remote.channel(client).pid
    info = caught.value.exit_info
    remote.gone(local_pid, info)
    assert info is not None
    assert str(caught.value) == remote.killed(argv, info, signal.SIGKILL, "waiting for permission")
    assert asked == ["c1"]
    assert withdrawn.is_set()  # the pending question was withdrawn, not left waiting


# -- stdout closed, the child alive ----------------------------------------------------------------------

CLOSING_STDOUT = [{"step": "stderr", "text": "closing stdout\n"}, {"step": "close_stdout"}]
"""Steps that say so on stderr and close stdout, the agent living on."""


async def a_remote_child_closing_stdout_before_it_is_ready_fails_the_start_fast_and_is_torn_down(
    remote: Remote[Any], bench: Bench, *, scenario: dict[str, Any], last_signal: signal.Signals
) -> None:
    # "Fast" is an outcome: the child ignores stdin EOF and lives until teardown, which begins only once
    # the start has failed; an error that waited for its exit would hang.
    argv = bench.stub_agent_command(scenario)
    transport = remote.transport(argv)
    async with open_service(remote, transport) as (service, lifecycle, tag):
        service.register_provider(provider(transport, argv, bench.tmp_path, tag))
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(remote.wait), pytest.raises(SubagentError) as caught:
                await run.started()
            assert acp_run(run).exit_info is None  # still alive: the error did not wait for an exit
        info = acp_run(run).exit_info
        local_pid = acp_run(run).pid
    # Checked once the service is closed: the remote side of a dropped connection ends after it (the
    # leak check waited for that).
    remote.gone(local_pid, info)
    assert info is not None
    assert caught.value.code is ErrorCode.START_FAILED
    assert caught.value.message == remote.closed_stdout(argv, info, "closing stdout")
    remote.torn_down(info, last_signal)
    assert lifecycle.names == []


async def a_remote_child_closing_stdout_mid_turn_ends_the_turn_fast_with_an_error_and_is_torn_down(
    remote: Remote[Any], bench: Bench
) -> None:
    argv = bench.stub_agent_command(
        {
            "turns": [[{"step": "message", "text": "last words"}, *CLOSING_STDOUT]],
            "onStdinEof": "ignore",
            "ignoreSigterm": True,
        }
    )
    transport = remote.transport(argv)
    async with open_service(remote, transport) as (service, lifecycle, tag):
        service.register_provider(provider(transport, argv, bench.tmp_path, tag))
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            assert isinstance(run, ResumableRun)
            with anyio.fail_after(remote.wait):
                result = await run.result()
                alive_when_it_ended = acp_run(run).exit_info is None
                again = await run.resume("hello?")
        info = acp_run(run).exit_info
        local_pid = acp_run(run).pid
    remote.gone(local_pid, info)  # once the service is closed, as above
    assert info is not None
    error = remote.closed_stdout(argv, info, "closing stdout")
    assert result == SubagentResult(output="last words", stop_reason="error", error=error)
    assert again == SubagentResult(output="", stop_reason="error", error=error)
    assert alive_when_it_ended
    remote.torn_down(info, signal.SIGKILL)
    assert lifecycle.names == ["start", "end"]


# -- a broken wire, a turn that goes on ------------------------------------------------------------------


async def a_wire_fault_mid_turn_is_skipped_or_answered_and_reported_and_the_turn_completes(
    remote: Remote[Any], bench: Bench, *, fault: WireFault
) -> None:
    argv = bench.stub_agent_command(fault.scenario())
    reported: list[ProtocolError] = []
    bench.caplog.set_level(logging.WARNING)
    async with remote_client(remote, argv, on_protocol_error=reported.append) as (client, transport):
        with anyio.fail_after(remote.wait):
            result = await (await ready_session(client, bench.tmp_path)).prompt("go")
        name = remote.log_name(remote.channel(client).pid, transport)
    fault.check_turn(result, reported, bench.caplog, name)  # type: ignore[arg-type]  # a name, not a pid


async def a_100_mib_line_is_discarded_with_memory_bounded_by_the_line_limit(
    remote: Remote[Any], bench: Bench
) -> None:
    size, max_line_bytes = 100 * MIB, 8 * MIB
    argv = bench.stub_agent_command(
        {
            "turns": [
                [
                    {"step": "message", "text": "before "},
                    {"step": "huge_line", "bytes": size},
                    {"step": "message", "text": "after"},
                ]
            ]
        }
    )
    bench.caplog.set_level(logging.WARNING)
    transport = remote.transport(argv)
    async with open_service(remote, transport) as (service, _, tag):
        options = {"max_line_bytes": max_line_bytes}
        service.register_provider(provider(transport, argv, bench.tmp_path, tag, **options))
        with remote.measuring_memory() as growth:
            async with service.start("acp", SubagentRequest(prompt="go")) as run:
                with anyio.fail_after(remote.wait):
                    result = await run.result()
        name = remote.log_name(acp_run(run).pid, transport)
    assert result == SubagentResult(output="before after", stop_reason="completed")
    assert texts(acp_run(run).updates) == ["before ", "after"]
    reports = [
        record.getMessage() for record in bench.caplog.records if record.name == "subagent.acp.connection"
    ]
    assert reports == [
        f"acp:{name}: discarding a line longer than {max_line_bytes} bytes",
        f"acp:{name}: {MessageTooLargeError(size, max_line_bytes)}",
    ]
    (grown,) = growth
    assert grown < remote.line_memory_bound(max_line_bytes), remote.growth_message(
        grown, size, max_line_bytes
    )


async def a_50_mib_stderr_flood_deadlocks_nothing_and_leaves_a_bounded_tail(
    remote: Remote[Any], bench: Bench
) -> None:
    flood = 50 * MIB
    argv = bench.stub_agent_command(
        {"turns": [[{"step": "stderr", "bytes": flood}, {"step": "message", "text": "after the flood"}]]}
    )
    async with remote_client(remote, argv) as (client, transport):
        with anyio.fail_after(max(remote.wait, FLOOD_WAIT)):
            result = await (await ready_session(client, bench.tmp_path)).prompt("go")
        tail = remote.channel(client).stderr_tail()
    info = remote.channel(client).exit_info()
    assert result.output == "after the flood"
    assert 0 < len(tail.encode()) <= transport.stderr_tail_bytes
    assert info is not None
    assert info.stderr_bytes_total >= flood


# -- the caller cancelled --------------------------------------------------------------------------------


async def cancelling_the_caller_at_any_phase_disposes_the_remote_run_and_leaves_nothing_anywhere(
    remote: Remote[Any], bench: Bench, *, phase: str
) -> None:
    caller = PhaseCaller(phase)
    argv = bench.stub_agent_command(caller.spec.scenario)
    transport = remote.transport(argv)
    async with open_service(remote, transport) as (service, lifecycle, tag):
        options = {"on_stderr_line": caller.on_stderr_line, "permission": caller.permission}
        service.register_provider(provider(transport, argv, bench.tmp_path, tag, **options))
        tasks_before = running_task_ids()
        run, child = await caller.drive(service, remote.wait)
        assert running_task_ids() == tasks_before
        local_pid = child.pid
        info = child.exit_info
        with pytest.raises(SubagentError) as result_error:
            await run.result()
    # Checked once the service is closed: the remote side of a dropped connection ends after it.
    reported_pid = remote.check_cancelled(caller, local_pid, info, transport)
    caller.check_disposed(result_error.value, reported_pid, lifecycle)


async def a_cancel_the_remote_agent_honours_ends_the_turn_cancelled(
    remote: Remote[Any], bench: Bench
) -> None:
    argv = bench.stub_agent_command(
        {"turns": [[{"step": "message", "text": "working"}, {"step": "wait_for_cancel"}]]}
    )
    async with remote_client(remote, argv) as (client, _):
        with anyio.fail_after(remote.wait):
            session = await ready_session(client, bench.tmp_path)
            first = anyio.Event()
            results: list[Any] = []

            async def run() -> None:
                results.append(await session.prompt("go", on_update=lambda update: first.set()))

            async with anyio.create_task_group() as task_group:
                task_group.start_soon(run)
                await first.wait()
                await session.cancel()
    assert (results[0].stop_reason, results[0].output) == ("cancelled", "working")


# -- hangs, ended by timeouts ----------------------------------------------------------------------------

SILENCE_TIMEOUT = 1.0
"""The turn's inactivity timeout: the agent, already running, sends its first chunk well within it."""


async def a_remote_child_that_never_answers_initialize_fails_the_start_after_the_ready_timeout(
    remote: Remote[Any], bench: Bench
) -> None:
    argv = bench.stub_agent_command(
        {"initialize": {"steps": [{"step": "stderr", "text": "loading model...\n"}, {"step": "hang"}]}}
    )
    transport = remote.transport(argv)
    async with open_service(remote, transport) as (service, lifecycle, tag):
        options = {"ready_timeout": remote.ready_timeout}
        service.register_provider(provider(transport, argv, bench.tmp_path, tag, **options))
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(remote.wait), pytest.raises(SubagentError) as caught:
                await run.started()
        remote.gone(acp_run(run).pid)
    assert caught.value.code is ErrorCode.START_FAILED
    assert caught.value.message == (
        f"agent `{shlex.join(argv)}` was not ready within {remote.ready_timeout:g} s; "
        "last stderr: loading model..."
    )
    assert lifecycle.names == []


async def silence_past_the_timeout_ends_a_remote_turn_with_timeout_and_keeps_the_output(
    remote: Remote[Any], bench: Bench
) -> None:
    argv = bench.stub_agent_command(
        {"turns": [[{"step": "message", "text": "thinking"}, {"step": "wait_for_cancel"}]]}
    )
    transport = remote.transport(argv)
    async with open_service(remote, transport) as (service, lifecycle, tag):
        service.register_provider(provider(transport, argv, bench.tmp_path, tag))
        async with service.start("acp", SubagentRequest(prompt="go", timeout=SILENCE_TIMEOUT)) as run:
            with anyio.fail_after(remote.wait):
                result = await run.result()
    assert result == SubagentResult(
        output="thinking", stop_reason="timeout", error=f"inactive for more than {SILENCE_TIMEOUT:g} s"
    )
    assert lifecycle.names == ["start", "end"]


# -- teardown of what will not go ------------------------------------------------------------------------


async def a_remote_agent_ignoring_stdin_eof_is_torn_down_by_escalation_and_its_tree_is_gone(
    remote: Remote[Any], bench: Bench, *, ignore_sigterm: bool
) -> None:
    argv = bench.stub_agent_command({"onStdinEof": "ignore", "ignoreSigterm": ignore_sigterm})
    async with remote_client(remote, argv) as (client, _):
        with anyio.fail_after(remote.wait):
            await ready_session(client, bench.tmp_path)
        report = await remote.channel(client).aclose()
        info = remote.channel(client).exit_info()
    assert list(report.steps) == remote.teardown_steps(ignore_sigterm)
    assert report.group_gone
    remote.torn_down(info, signal.SIGKILL if ignore_sigterm else signal.SIGTERM)
    assert info is not None
    assert info.pid is not None
    assert process_is_gone(info.pid)


async def a_remote_grandchild_is_gone_after_teardown(
    remote: Remote[Any], bench: Bench, *, ignore_sigterm: bool
) -> None:
    pid_file = bench.tmp_path / "grandchild.pid"
    argv = bench.stub_agent_command(
        {
            "turns": [
                [
                    {"step": "grandchild", "pidFile": str(pid_file), "ignoreSigterm": ignore_sigterm},
                    {"step": "message", "text": "spawned"},
                ]
            ]
        }
    )
    async with remote_client(remote, argv) as (client, _):
        with anyio.fail_after(remote.wait):
            result = await (await ready_session(client, bench.tmp_path)).prompt("go")
        grandchild = int(pid_file.read_text())
        assert not process_is_gone(grandchild)
    # The leak check waited for the remote tree to end (the grandchild holds the leak tag).
    assert process_is_gone(grandchild)
    report = json.dumps({"grandchild": grandchild}, separators=(",", ":"))
    assert [
        update.content.text
        for update in result.updates
        if isinstance(update, schema.AgentMessageChunk) and isinstance(update.content, schema.TextContent)
    ] == [report, "spawned"]


# -- the battery -----------------------------------------------------------------------------------------


def case(function: Callable[..., Awaitable[None]], variant: str | None = None, **params: Any) -> ParameterSet:
    """``function`` with ``params``, as one parameter of a battery test, its id the case's sentence."""
    name = function.__name__.replace("_", " ")
    bound: FaultCase = functools.partial(function, **params)
    return pytest.param(bound, id=name if variant is None else f"{name}: {variant}")


def _cases() -> Iterator[ParameterSet]:
    for phase, signum, variant in [
        ("initialize", signal.SIGKILL, "before initialize answers"),
        ("authenticate", signal.SIGINT, "during authenticate"),
        ("newSession", signal.SIGTERM, "during session/new"),
    ]:
        yield case(
            a_remote_child_killed_before_it_is_ready_fails_the_start_naming_the_signal_and_stderr,
            variant,
            phase=phase,
            signum=signum,
        )
    yield case(a_remote_child_killed_while_its_permission_question_is_pending_ends_the_turn_with_an_error)
    for scenario, last_signal, variant in [
        (
            {"initialize": {"steps": CLOSING_STDOUT}, "onStdinEof": "ignore"},
            signal.SIGTERM,
            "during initialize",
        ),
        (
            {"newSession": {"steps": CLOSING_STDOUT}, "onStdinEof": "ignore", "ignoreSigterm": True},
            signal.SIGKILL,
            "during session/new, SIGTERM ignored",
        ),
    ]:
        yield case(
            a_remote_child_closing_stdout_before_it_is_ready_fails_the_start_fast_and_is_torn_down,
            variant,
            scenario=scenario,
            last_signal=last_signal,
        )
    yield case(a_remote_child_closing_stdout_mid_turn_ends_the_turn_fast_with_an_error_and_is_torn_down)
    for name, fault in WIRE_FAULTS.items():
        yield case(
            a_wire_fault_mid_turn_is_skipped_or_answered_and_reported_and_the_turn_completes,
            name,
            fault=fault,
        )
    yield case(a_100_mib_line_is_discarded_with_memory_bounded_by_the_line_limit)
    yield case(a_50_mib_stderr_flood_deadlocks_nothing_and_leaves_a_bounded_tail)
    for phase in CANCEL_PHASES:
        yield case(
            cancelling_the_caller_at_any_phase_disposes_the_remote_run_and_leaves_nothing_anywhere,
            phase,
            phase=phase,
        )
    yield case(a_cancel_the_remote_agent_honours_ends_the_turn_cancelled)
    yield case(a_remote_child_that_never_answers_initialize_fails_the_start_after_the_ready_timeout)
    yield case(silence_past_the_timeout_ends_a_remote_turn_with_timeout_and_keeps_the_output)
    for ignore_sigterm, variant in [(False, "SIGTERM honoured"), (True, "SIGTERM ignored")]:
        yield case(
            a_remote_agent_ignoring_stdin_eof_is_torn_down_by_escalation_and_its_tree_is_gone,
            variant,
            ignore_sigterm=ignore_sigterm,
        )
        yield case(a_remote_grandchild_is_gone_after_teardown, variant, ignore_sigterm=ignore_sigterm)


REMOTE_FAULT_CASES = list(_cases())
"""Every case of the battery: parametrise a test over them, and call each with the transport's `Remote`
and the test's `Bench`."""
