"""The seam's lifecycle contract (`subagent.testing.contract`) over the SSH transport, on asyncio and trio.

`AcpProvider` on the stub agent, each child opened by `SshTransport` through a real ``ssh`` and ``sshd``:
here a ``sshd -i`` per connection, started by the ssh client itself (``ProxyCommand``, see
`tests.sshd.INETD_HOST_ALIAS`), so that the whole run, its "remote" side included, is our descendant and
the contract's own leak check (no process, no descriptor, no task left) applies unchanged. The
listener-based tests of the transport are in test_ssh_transport.py: a separate module, since a listener
alive for the module would count as a leak here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from subagent import SubagentProvider
from subagent.acp.process import supervision_available
from subagent.acp.ssh import SshTransport
from subagent.providers.acp import AcpProvider
from subagent.testing.contract import CONTRACT_CHECKS, ContractCheck, ProviderContract
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.sshd import SshServer, running_sshd
from tests.test_provider_contract import OUTPUT, first_update

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
    transport = SshTransport(server.inetd_host, config_file=server.config_file, stdin_close_timeout=1.0)

    def agent(scenario: dict[str, object]) -> Callable[[], SubagentProvider]:
        return lambda: AcpProvider(stub_agent_command(scenario), cwd=cwd, transport=transport)

    return ProviderContract(
        completing=agent({"turns": [[{"step": "message", "text": OUTPUT}]]}),
        working=agent({"turns": [[{"step": "message", "text": "working"}, {"step": "wait_for_cancel"}]]}),
        failing_start=agent({"initialize": {"steps": [{"step": "exit", "code": 3}]}}),
        output=OUTPUT,
        resumable=True,
        turn_under_way=first_update,
    )


@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
async def test_acp_over_ssh_keeps_the_lifecycle_contract(
    check: ContractCheck, sshd: SshServer, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    await check(ssh_contract(stub_agent_command, tmp_path, sshd))
