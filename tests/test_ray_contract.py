"""The seam's lifecycle contract (`subagent.testing.contract`) over the Ray transport, on asyncio and trio.

`AcpProvider` on the stub agent, each child in a Ray actor pinned to the second node of the session's
two-node cluster (tests/raycluster.py). The contract's leak check is `assert_no_leaks_beside_ray`: the
same, but for the sockets of Ray's own connections, which come and go on Ray's schedule. The child runs
on this machine, and `LeakTaggedRayTransport` hands it the check's leak tag, so a process of it left on
the node is found by the tag, although it is no descendant of ours.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from subagent import SubagentProvider
from subagent.providers.acp import AcpProvider
from subagent.testing.contract import CONTRACT_CHECKS, ContractCheck, ProviderContract
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.raycluster import RayCluster
from tests.test_provider_contract import OUTPUT, first_update
from tests.test_ray_transport import LeakTaggedRayTransport, assert_no_leaks_beside_ray

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]


@pytest.fixture(autouse=True)
def leak_check_beside_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("subagent.testing.contract.assert_no_leaks", assert_no_leaks_beside_ray)


def ray_contract(stub_agent_command: StubAgentCommand, cwd: Path, cluster: RayCluster) -> ProviderContract:
    transport = LeakTaggedRayTransport(node_id=cluster.second_node_id, stdin_close_timeout=1.0)

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
async def test_acp_over_ray_keeps_the_lifecycle_contract(
    check: ContractCheck, ray_cluster: RayCluster, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    await check(ray_contract(stub_agent_command, tmp_path, ray_cluster))
