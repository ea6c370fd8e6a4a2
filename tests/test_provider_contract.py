"""The seam's lifecycle contract (`subagent.testing.contract`) over every provider, on asyncio and trio.

Each provider is one parameter: the fake, spawn and fork on a `ScriptedLlm`, and ACP on the stub agent, as
a child process and in process (`StubAgentTransport`), also through a relay written in the tests
(`tests.transports`, which hands the client nothing but the `Channel` protocol), and on a handler of the
tests' own served in process (`InProcessTransport`). A new provider or transport gets the whole contract
by adding one `ProviderContract` here.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup

from subagent import SubagentProvider, SubagentRequest, SubagentResult, SubagentRun
from subagent.acp.transports import Transport
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.providers.fork import ForkProvider
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import Agent, AgentRegistry, Reply, ScriptedLlm
from subagent.testing import InProcessChannel, InProcessTransport, StubAgentTransport
from subagent.testing.contract import CONTRACT_CHECKS, ContractCheck, ProviderContract
from subagent.testing.fakes import FakeProvider, FakeRun, completes, fails_to_start, waits_until_cancelled
from subagent.testing.pytest_plugin import StubAgentCommand
from subagent.types import SubagentCapabilities, WorkspaceChange
from tests.transports import RelayTransport, ScriptedHandler

pytestmark = pytest.mark.anyio

OUTPUT = "The contract holds."
FAST = {"stdin_close_timeout": 1.0, "sigterm_timeout": 1.0, "sigkill_timeout": 2.0}


def fake_contract() -> ProviderContract:
    return ProviderContract(
        completing=lambda: FakeProvider(autopilot=completes(OUTPUT)),
        working=lambda: FakeProvider(autopilot=waits_until_cancelled()),
        failing_start=lambda: FakeProvider(autopilot=fails_to_start()),
        output=OUTPUT,
    )


async def _never() -> None:
    await anyio.sleep_forever()


def spawn_contract() -> ProviderContract:
    def with_reply(reply: Reply | None) -> Callable[[], SubagentProvider]:
        def make() -> SubagentProvider:
            llm = ScriptedLlm([reply]) if reply is not None else None
            return SpawnProvider(llm=llm, agents=AgentRegistry())

        return make

    return ProviderContract(
        completing=with_reply(Reply(OUTPUT)),
        working=with_reply(Reply(wait=_never)),
        failing_start=with_reply(None),  # no LLM adapter: start raises START_FAILED
        output=OUTPUT,
        steerable=True,
        resumable=True,
    )


PARENT = "contract-parent"


class ForkOfIdleParent(ForkProvider):
    """A fork provider whose registry holds one idle parent agent (kept here: the registry holds agents
    weakly), whose LLM the forks use; with no reply, no parent is live."""

    def __init__(self, reply: Reply | None) -> None:
        super().__init__(agents=AgentRegistry())
        self.parent = (
            Agent(llm=ScriptedLlm([reply]), id=PARENT, registry=self.agents) if reply is not None else None
        )


def fork_contract() -> ProviderContract:
    def with_reply(reply: Reply | None) -> Callable[[], SubagentProvider]:
        return lambda: ForkOfIdleParent(reply)

    return ProviderContract(
        completing=with_reply(Reply(OUTPUT)),
        working=with_reply(Reply(wait=_never)),
        failing_start=with_reply(None),  # no live parent: start raises START_FAILED
        output=OUTPUT,
        steerable=True,
        resumable=True,
        parent_id=PARENT,
    )


async def first_update(run: SubagentRun) -> None:
    """Return once the ACP child sent a session update: its turn is under way."""
    assert isinstance(run, AcpRun)
    arrived = anyio.Event()
    stop_listening = run.on_update(lambda update: arrived.set())
    try:
        if not run.updates:
            await arrived.wait()
    finally:
        stop_listening()


def acp_contract(
    stub_agent_command: StubAgentCommand, cwd: Path, transport: Transport | None = None
) -> ProviderContract:
    """ACP on the stub agent as a child process, through ``transport`` (None: a local child with fast
    teardown)."""

    def agent(scenario: dict[str, object]) -> Callable[[], SubagentProvider]:
        if transport is None:
            return lambda: AcpProvider(stub_agent_command(scenario), cwd=cwd, process_options=FAST)
        return lambda: AcpProvider(stub_agent_command(scenario), cwd=cwd, transport=transport)

    return stub_agent_contract(agent)


def in_process_stub_contract(cwd: Path, *, relayed: bool = False) -> ProviderContract:
    """ACP on the stub agent served in process (`StubAgentTransport`), behind a relay if ``relayed``."""

    def agent(scenario: dict[str, object]) -> Callable[[], SubagentProvider]:
        def provider() -> SubagentProvider:
            stub = StubAgentTransport(scenario, stdin_close_timeout=1.0, sigterm_timeout=1.0)
            return AcpProvider(["stub-agent"], cwd=cwd, transport=RelayTransport(stub) if relayed else stub)

        return provider

    return stub_agent_contract(agent)


def stub_agent_contract(
    agent: Callable[[dict[str, object]], Callable[[], SubagentProvider]],
) -> ProviderContract:
    """The contract's scenarios for the stub agent, each made a provider factory by ``agent``."""
    return ProviderContract(
        completing=agent({"turns": [[{"step": "message", "text": OUTPUT}]]}),
        working=agent({"turns": [[{"step": "message", "text": "working"}, {"step": "wait_for_cancel"}]]}),
        failing_start=agent({"initialize": {"steps": [{"step": "exit", "code": 3}]}}),
        output=OUTPUT,
        resumable=True,  # an ACP session takes further prompts; steering mid-turn it cannot
        turn_under_way=first_update,
    )


def in_process_acp_contract(cwd: Path) -> ProviderContract:
    """ACP on an agent served in this process over memory streams: no process, no pipe."""

    def agent(**behaviour: Any) -> Callable[[], SubagentProvider]:
        def handler(channel: InProcessChannel) -> ScriptedHandler:
            return ScriptedHandler(channel, **behaviour)

        return lambda: AcpProvider(["in-process-agent"], cwd=cwd, transport=InProcessTransport(handler))

    return ProviderContract(
        completing=agent(text=OUTPUT),
        working=agent(text="working", work=True),
        failing_start=agent(text="", exit_at_initialize=3),
        output=OUTPUT,
        resumable=True,
        turn_under_way=first_update,
    )


PROVIDERS = [
    "fake",
    "spawn",
    "fork",
    pytest.param("acp", marks=pytest.mark.subprocess),
    "acp-stub-in-process",
    "acp-relayed",
    "acp-in-process",
]


@pytest.fixture(params=PROVIDERS)
def contract(
    request: pytest.FixtureRequest, stub_agent_command: StubAgentCommand, tmp_path: Path
) -> ProviderContract:
    name: str = request.param
    if name == "fake":
        return fake_contract()
    if name == "spawn":
        return spawn_contract()
    if name == "fork":
        return fork_contract()
    if name == "acp-stub-in-process":
        return in_process_stub_contract(tmp_path)
    if name == "acp-relayed":
        return in_process_stub_contract(tmp_path, relayed=True)
    if name == "acp-in-process":
        return in_process_acp_contract(tmp_path)
    return acp_contract(stub_agent_command, tmp_path)


@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
async def test_every_provider_keeps_the_lifecycle_contract(
    check: ContractCheck, contract: ProviderContract
) -> None:
    await check(contract)


# -- the suite can fail: providers that break the contract are caught ------------------------------------


def check_named(name: str) -> ContractCheck:
    return {check.__name__: check for check in CONTRACT_CHECKS}[f"check_{name}"]


def fake_contract_of(run_class: type[FakeRun], **fields: Any) -> ProviderContract:
    return ProviderContract(
        completing=lambda: FakeProvider(run_class=run_class, autopilot=completes(OUTPUT)),
        working=lambda: FakeProvider(run_class=run_class, autopilot=waits_until_cancelled()),
        failing_start=lambda: FakeProvider(run_class=run_class, autopilot=fails_to_start()),
        output=OUTPUT,
        **fields,
    )


async def test_the_contract_catches_a_provider_claiming_a_capability_its_runs_lack() -> None:
    with pytest.raises(AssertionError, match="the provider's run is not a SteerableRun"):
        await check_named("runtime_capabilities_are_present_exactly_when_offered")(
            fake_contract_of(FakeRun, steerable=True)
        )


class CompletesWhenCancelled(FakeRun):
    async def cancel(self) -> None:
        self.finish(SubagentResult(output="ignored the cancel", stop_reason="completed"))


async def test_the_contract_catches_a_cancel_that_does_not_end_the_turn_cancelled() -> None:
    with pytest.raises(AssertionError, match="stop_reason='completed'"):
        await check_named("cancel_ends_a_working_turn_cancelled")(fake_contract_of(CompletesWhenCancelled))


class LeaksAPipe(FakeRun):
    def __init__(self, request: SubagentRequest, task_group: TaskGroup) -> None:
        super().__init__(request, task_group)
        self.pipe = os.pipe()  # never closed: a leak

    def close_pipe(self) -> None:
        for fd in self.pipe:
            os.close(fd)


async def test_the_contract_catches_a_run_that_leaves_a_file_descriptor_open() -> None:
    provider = FakeProvider(run_class=LeaksAPipe, autopilot=completes(OUTPUT))
    contract = ProviderContract(
        completing=lambda: provider, working=lambda: provider, failing_start=lambda: provider, output=OUTPUT
    )
    try:
        with pytest.raises(AssertionError, match="file descriptors opened"):
            await check_named("dispose_after_the_result_keeps_the_result_and_is_idempotent")(contract)
    finally:
        for run in provider.runs:
            assert isinstance(run, LeaksAPipe)
            run.close_pipe()


def claims_worktrees(autopilot: Any) -> ProviderContract:
    def make() -> FakeProvider:
        return FakeProvider(
            capabilities=SubagentCapabilities(isolation=frozenset({"worktree"})), autopilot=autopilot
        )

    return ProviderContract(completing=make, working=make, failing_start=make, output=OUTPUT)


async def test_the_contract_catches_a_provider_claiming_isolation_it_does_not_report() -> None:
    with pytest.raises(AssertionError, match="an isolated run's result has no workspace"):
        await check_named("isolation_is_honoured_as_declared_or_refused_before_any_child")(
            claims_worktrees(completes(OUTPUT))
        )


async def test_the_contract_catches_a_provider_whose_isolated_child_writes_in_the_parents_tree() -> None:
    def writes_in_place(run: FakeRun) -> None:
        assert run.request.cwd is not None
        Path(run.request.cwd, "leaked.txt").write_text("written in the parent's tree\n")
        run.make_ready()
        head = subprocess.run(
            ["git", "-C", run.request.cwd, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        change = WorkspaceChange(mode="worktree", path=run.request.cwd, changed=False, branch="b", base=head)
        run.finish(SubagentResult(output=OUTPUT, stop_reason="completed", workspace=change))

    with pytest.raises(AssertionError, match="the parent's repository changed"):
        await check_named("isolation_is_honoured_as_declared_or_refused_before_any_child")(
            claims_worktrees(writes_in_place)
        )
