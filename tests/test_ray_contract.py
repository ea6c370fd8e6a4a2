"""The seam's lifecycle contract (`subagent.testing.contract`) over the Ray transport, on asyncio and trio.

`AcpProvider` on the stub agent, each child in a Ray actor pinned to the second node of the session's
two-node cluster (tests/raycluster.py). The contract's leak check is `assert_no_leaks_over_ray`: the
same, but for the sockets of Ray's own connections, which come and go on Ray's schedule. The child runs
on this machine, and `LeakTaggedRayTransport` hands it the check's leak tag, so a process of it left on
the node is found by the tag, although it is no descendant of ours.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from subagent.testing.contract import CONTRACT_CHECKS, ContractCheck, ProviderContract
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.raycluster import RayCluster, assert_no_leaks_over_ray
from tests.test_provider_contract import acp_contract
from tests.test_ray_transport import LeakTaggedRayTransport

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]


@pytest.fixture(autouse=True)
def leak_check_beside_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("subagent.testing.contract.assert_no_leaks", assert_no_leaks_over_ray)


def ray_contract(stub_agent_command: StubAgentCommand, cwd: Path, cluster: RayCluster) -> ProviderContract:
    return acp_contract(
        stub_agent_command,
        cwd,
        LeakTaggedRayTransport(node_id=cluster.second_node_id, stdin_close_timeout=1.0),
    )


@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
async def test_acp_over_ray_keeps_the_lifecycle_contract(
    check: ContractCheck, ray_cluster: RayCluster, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    await check(ray_contract(stub_agent_command, tmp_path, ray_cluster))
