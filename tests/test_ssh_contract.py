"""The seam's lifecycle contract (`subagent.testing.contract`) and faults from the fault battery
(test_faults.py) over the SSH transport, on asyncio and trio.

`AcpProvider` on the stub agent, each child opened by `SshTransport` through a real ``ssh`` and ``sshd``:
here a ``sshd -i`` per connection, started by the ssh client itself (``ProxyCommand``, see
`tests.sshd.INETD_HOST_ALIAS`), so that the whole run, its "remote" side included, is our descendant and
the contract's own leak check (no process, no descriptor, no task left) applies unchanged. The
listener-based tests of the transport are in test_ssh_transport.py: a separate module, since a listener
alive for the module would count as a leak here.
"""

from __future__ import annotations

import shlex
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import ErrorCode, ResumableRun, SubagentError, SubagentRequest, SubagentResult
from subagent.acp.transports import ExitInfo, SshTransport, supervision_available
from subagent.providers.acp import AcpProvider
from subagent.testing.contract import CONTRACT_CHECKS, ContractCheck, ProviderContract
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.sshd import SshServer, running_sshd
from tests.test_faults import WIRE_FAULTS, acp_run, open_service, texts
from tests.test_provider_contract import acp_contract

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.subprocess,
    pytest.mark.skipif(not supervision_available(), reason="the supervisor needs Linux"),
]


@pytest.fixture(scope="module")
def sshd() -> Iterator[SshServer]:
    """Keys and configs for ``sshd -i`` per connection; no listener."""
    with running_sshd(listen=False) as server:
        yield server


def ssh_contract(stub_agent_command: StubAgentCommand, cwd: Path, server: SshServer) -> ProviderContract:
    return acp_contract(
        stub_agent_command,
        cwd,
        SshTransport(server.inetd_host, config_file=server.config_file, stdin_close_timeout=1.0),
    )


@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
async def test_acp_over_ssh_keeps_the_lifecycle_contract(
    check: ContractCheck, sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    await check(ssh_contract(stub_agent_command, tmp_path, sshd))


# -- faults -----------------------------------------------------------------------------------------------

WAIT = 30  # seconds: a hang guard on a whole case


def ssh_provider(argv: list[str], tmp_path: Path, server: SshServer, **options: Any) -> AcpProvider:
    transport = SshTransport(server.inetd_host, config_file=server.config_file, stdin_close_timeout=1.0)
    return AcpProvider(argv, cwd=tmp_path, transport=transport, **options)


def killed_over_ssh(argv: list[str], info: ExitInfo, signum: signal.Signals, stderr: str, host: str) -> str:
    """A child killed by ``signum`` on the remote host, as its remote supervisor reported it."""
    return (
        f"agent `{shlex.join(argv)}` (pid {info.pid} via ssh to {host}) was killed by {signum.name} "
        f"(signal {signum.value}); last stderr: {stderr}"
    )


@pytest.mark.parametrize(
    ("phase", "signum"),
    [("initialize", signal.SIGKILL), ("newSession", signal.SIGTERM)],
)
async def test_a_remote_child_killed_before_it_is_ready_fails_the_start_naming_the_signal_and_stderr(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path, phase: str, signum: signal.Signals
) -> None:
    steps = [{"step": "stderr", "text": "loading the model\n"}, {"step": "kill", "signal": signum.name}]
    argv = stub_agent_command({phase: {"steps": steps}})
    async with (
        open_service(ssh_provider(argv, tmp_path, sshd)) as (service, lifecycle),
        service.start("acp", SubagentRequest(prompt="go")) as run,
    ):
        with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
            await run.started()
    info = acp_run(run).exit_info
    assert info is not None
    assert (info.killed_by, info.status_known) == (signum, True)
    assert caught.value.code is ErrorCode.START_FAILED
    assert caught.value.message == killed_over_ssh(argv, info, signum, "loading the model", sshd.inetd_host)
    assert lifecycle.names == []


async def test_a_remote_child_killed_mid_stream_ends_the_turn_with_an_error_and_keeps_the_output(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    argv = stub_agent_command(
        {
            "turns": [
                [
                    {"step": "message", "text": "The answer is", "chunks": 3},
                    {"step": "stderr", "text": "Out of memory: killed\n"},
                    {"step": "kill", "signal": "SIGKILL"},
                ]
            ]
        }
    )
    async with (
        open_service(ssh_provider(argv, tmp_path, sshd)) as (service, lifecycle),
        service.start("acp", SubagentRequest(prompt="go")) as run,
    ):
        assert isinstance(run, ResumableRun)
        with anyio.fail_after(WAIT):
            result = await run.result()
            again = await run.resume("are you still there?")  # a dead child: at once, no hang
    info = acp_run(run).exit_info
    assert info is not None
    error = killed_over_ssh(argv, info, signal.SIGKILL, "Out of memory: killed", sshd.inetd_host)
    assert result == SubagentResult(output="The answer is", stop_reason="error", error=error)
    assert again == SubagentResult(output="", stop_reason="error", error=error)
    assert texts(acp_run(run).updates) == ["The a", "nswe", "r is"]
    assert lifecycle.names == ["start", "end"]


async def test_every_wire_fault_in_one_turn_over_ssh_leaves_the_run_completed_with_the_exact_output(
    sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    faults = list(WIRE_FAULTS.values())
    steps = [step for fault in faults for step in [*fault.steps, {"step": "message", "text": "|"}]]
    argv = stub_agent_command({"turns": [[{"step": "message", "text": "before"}, *steps]]})
    async with (
        open_service(ssh_provider(argv, tmp_path, sshd)) as (service, lifecycle),
        service.start("acp", SubagentRequest(prompt="go")) as run,
    ):
        with anyio.fail_after(WAIT):
            result = await run.result()
    expected_chunks = ["before"] + [chunk for fault in faults for chunk in [*fault.chunks, "|"]]
    assert result == SubagentResult(output="".join(expected_chunks), stop_reason="completed")
    assert texts(acp_run(run).updates) == expected_chunks
    assert lifecycle.names == ["start", "end"]
