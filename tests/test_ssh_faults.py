"""The fault battery (tests/remote_faults.py) over the SSH transport, against a real ``sshd`` on loopback,
on asyncio and trio.

Where SSH differs from a local child: the agent's pid in a message is the remote one (``pid N via ssh to
HOST``), the run's `AcpRun.pid` is the local ssh client's (and the connection's log is named after it),
and an agent that only teardown ends is reported as a lost connection (its status never comes back:
teardown ended ssh, and the remote supervisor then ended the agent). "Nothing left" is
`assert_no_leaks_over_ssh` (the remote agent carries the leak tag, passed in its environment: ours is not
forwarded) and no task left.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path

import pytest

from subagent.acp.transports import (
    UNKNOWN_RETURNCODE,
    ExitInfo,
    SshChannel,
    SshTransport,
    TeardownStep,
    supervision_available,
)
from subagent.testing import process_is_gone
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.remote_faults import BEFORE_THE_SPAWN, REMOTE_FAULT_CASES, Bench, FaultCase, Remote
from tests.sshd import SshServer, assert_no_leaks_over_ssh, running_sshd
from tests.test_faults import (
    MIB,
    PhaseCaller,
    peak_rss_bytes,
    pin_malloc_mmap_threshold,
    reset_peak_rss,
    teardown_options,
)

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.subprocess,
    pytest.mark.skipif(not supervision_available(), reason="the supervisor needs Linux"),
]


@pytest.fixture(scope="module")
def sshd() -> Iterator[SshServer]:
    """One loopback sshd for the module."""
    with running_sshd() as server:
        yield server


class OverSsh(Remote[SshTransport]):
    """The battery over ssh to ``server``, an sshd on loopback."""

    wait = 30
    ready_timeout = 3.0
    channel_type = SshChannel

    def __init__(self, server: SshServer) -> None:
        self.server = server

    def transport(self, argv: list[str]) -> SshTransport:
        # test_faults' grace after stdin closes (short if the scenario ignores stdin EOF): ssh itself
        # always honours SIGTERM.
        grace = teardown_options(argv)["stdin_close_timeout"]
        return SshTransport(self.server.host, config_file=self.server.config_file, stdin_close_timeout=grace)

    def no_leaks(self, *transports: SshTransport) -> AbstractAsyncContextManager[str]:
        return assert_no_leaks_over_ssh(self.server)

    @property
    def place(self) -> str:
        return f"via ssh to {self.server.host}"

    def gone(self, local_pid: int | None, info: ExitInfo | None = None) -> None:
        # The ssh client, and (given its exit) the remote agent: loopback, so both are this host's.
        assert local_pid is not None
        assert process_is_gone(local_pid)
        if info is not None:
            assert info.pid is not None
            assert process_is_gone(info.pid)

    def torn_down(self, info: ExitInfo | None, last_signal: signal.Signals) -> None:
        # Teardown signalled ssh, so the agent's status never came back.
        assert info is not None
        assert (info.status_known, info.returncode, info.status) == (
            False,
            UNKNOWN_RETURNCODE,
            "ended with an unknown status",
        )
        # ssh ends on SIGTERM with its own status for a lost connection.
        assert info.via == f"via ssh to {self.server.host}, connection lost: ssh exited with status 255"

    def teardown_steps(self, ignore_sigterm: bool) -> list[TeardownStep]:
        # ssh honours SIGTERM whatever the agent does; the remote supervisor then ends the agent's tree.
        return [TeardownStep.CLOSE_STDIN, TeardownStep.SIGTERM]

    def log_name(self, local_pid: int | None, transport: SshTransport) -> int:
        assert local_pid is not None  # the ssh client's
        return local_pid

    @contextmanager
    def measuring_memory(self) -> Iterator[list[int]]:
        pin_malloc_mmap_threshold()
        reset_peak_rss()
        baseline = peak_rss_bytes()
        growth: list[int] = []
        yield growth
        growth.append(peak_rss_bytes() - baseline)

    def line_memory_bound(self, max_line_bytes: int) -> int:
        return max_line_bytes + 8 * MIB

    def growth_message(self, growth: int, size: int, max_line_bytes: int) -> str:
        return (
            f"peak RSS grew by {growth / MIB:.1f} MiB reading a {size // MIB} MiB line over ssh "
            f"with a {max_line_bytes // MIB} MiB limit"
        )

    def check_cancelled(
        self, caller: PhaseCaller, local_pid: int | None, info: ExitInfo | None, transport: SshTransport
    ) -> int | None:
        if caller.phase == BEFORE_THE_SPAWN:
            assert local_pid is None  # disposed before the spawn: no ssh, no remote child ever existed
            return None
        self.gone(local_pid, info)
        assert info is not None
        if caller.spec.returncode == 0:  # it exited on stdin EOF, and its remote supervisor said so
            assert (info.returncode, info.status_known) == (0, True)
        else:  # it needed SIGTERM: to ssh, so its status never came back
            self.torn_down(info, signal.SIGTERM)
        return local_pid


@pytest.mark.parametrize("case", REMOTE_FAULT_CASES)
async def test_the_fault_battery_holds_over_ssh(
    case: FaultCase,
    sshd: SshServer,
    stub_agent_command: StubAgentCommand,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await case(OverSsh(sshd), Bench(stub_agent_command, tmp_path, caplog))
