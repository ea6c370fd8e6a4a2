"""Public entry points raise plain exceptions, never an anyio task group's ExceptionGroup.

`pytest.raises(SubagentError)` does not match an exception group, so every test here fails if the
error comes out wrapped; each also checks that the exception is exactly the one raised (type and
code), on asyncio and on trio.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup

from subagent import ErrorCode, SubagentError, SubagentRequest, SubagentService
from subagent._outcome import raise_sole_error
from subagent.providers.acp import AcpProvider
from subagent.providers.fork import ForkProvider
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import AgentRegistry, Reply, ScriptedLlm
from subagent.tool import SubagentTool
from tests.fakes import FakeProvider, FakeRun
from tests.leaks import assert_no_leaks

pytestmark = pytest.mark.anyio

WAIT = 20  # seconds: a hang guard on a whole run, never a sleep
FAST = {"stdin_close_timeout": 1.0, "sigterm_timeout": 1.0, "sigkill_timeout": 2.0}

# An agent that cannot start: a command that does not exist, and one that exits at once.
UNSTARTABLE: dict[str, Callable[[], list[str]]] = {
    "missing": lambda: ["subagent-test-no-such-agent-command"],
    "exits-at-once": lambda: [sys.executable, "-c", "pass"],
}


class CallerBug(Exception):
    """The caller's own exception, raised inside the service's block."""


def unstartable(kind: str) -> AcpProvider:
    return AcpProvider(UNSTARTABLE[kind](), permission="allow", process_options=FAST)


# -- the README's Python example, with an agent that cannot start ----------------------------------------


async def readme_example(agent: AcpProvider) -> None:
    """The body of the README's Python example, with ``agent`` as its provider."""
    async with SubagentService() as subagents:  # closing it tears down every live child
        subagents.register_provider(agent)
        request = SubagentRequest(prompt="Summarise README.md", cwd=".", timeout=600)
        async with subagents.start("acp", request) as run:  # leaving it tears the child down
            result = await run.result()  # stop_reason, output, error, usage
            print(result.stop_reason, result.output)  # noqa: T201 - the README's line


@pytest.mark.subprocess
@pytest.mark.parametrize("kind", sorted(UNSTARTABLE))
async def test_the_readme_example_raises_a_plain_start_failed_out_of_the_service(kind: str) -> None:
    async with assert_no_leaks():
        with anyio.fail_after(WAIT), pytest.raises(SubagentError) as raised:
            await readme_example(unstartable(kind))
    assert type(raised.value) is SubagentError
    assert raised.value.code is ErrorCode.START_FAILED
    assert "agent" in str(raised.value)
    # Its own context, not the task group it was carried out in.
    assert not isinstance(raised.value.__context__, BaseExceptionGroup)


@pytest.mark.subprocess
@pytest.mark.parametrize("kind", sorted(UNSTARTABLE))
@pytest.mark.parametrize("awaited", ["started", "result"])
async def test_a_failed_start_leaves_the_run_block_as_a_plain_start_failed(kind: str, awaited: str) -> None:
    async with assert_no_leaks(), SubagentService() as subagents:
        subagents.register_provider(unstartable(kind))
        with anyio.fail_after(WAIT), pytest.raises(SubagentError) as raised:
            async with subagents.start("acp", SubagentRequest(prompt="go")) as run:
                await (run.started() if awaited == "started" else run.result())
        assert type(raised.value) is SubagentError
        assert raised.value.code is ErrorCode.START_FAILED
        # The service is still usable after the failure: it was not torn down by it.
        assert subagents.list() == ["acp"]


@pytest.mark.subprocess
@pytest.mark.parametrize("kind", sorted(UNSTARTABLE))
async def test_the_tool_reports_a_failed_start_as_an_error_result_not_an_exception(kind: str) -> None:
    async with assert_no_leaks(), SubagentService() as subagents:
        subagents.register_provider(unstartable(kind))
        tool = SubagentTool(subagents)
        with anyio.fail_after(WAIT):
            outcome = await tool.execute({"prompt": "go", "provider": "acp"})
        assert outcome.is_error
        assert outcome.error_code is ErrorCode.START_FAILED
        assert outcome.error is not None
        assert outcome.error.startswith("the subagent could not be started (START_FAILED): ")


# -- the caller's own exceptions come out as themselves --------------------------------------------------


async def test_the_callers_own_exception_leaves_the_service_as_itself_with_runs_live() -> None:
    provider = FakeProvider()
    bug = CallerBug("caller bug")

    async def fail_with_a_run_live() -> None:
        async with SubagentService() as subagents:
            subagents.register_provider(provider)
            subagents.start("fake", SubagentRequest(prompt="p"))
            provider.runs[0].make_ready()
            raise bug

    with anyio.fail_after(WAIT), pytest.raises(CallerBug) as raised:
        await fail_with_a_run_live()
    assert raised.value is bug
    assert raised.value.__context__ is None
    assert provider.runs[0].dispose_calls == 1
    assert not provider.runs[0].child_running()


async def test_a_seam_error_raised_in_the_service_block_is_a_plain_subagent_error() -> None:
    with pytest.raises(SubagentError) as raised:
        async with SubagentService() as subagents:
            subagents.start("nobody", SubagentRequest(prompt="p"))
    assert type(raised.value) is SubagentError
    assert raised.value.code is ErrorCode.NO_PROVIDER


async def test_a_fork_that_cannot_be_made_is_a_plain_start_failed_out_of_the_service() -> None:
    fork = ForkProvider(llm=ScriptedLlm([Reply(text="hi")]), agents=AgentRegistry())

    async def fork_without_a_parent() -> None:
        async with SubagentService() as subagents:
            subagents.register_provider(fork)
            subagents.start(fork.name, SubagentRequest(prompt="p", parent_id="no-such-parent"))

    with pytest.raises(SubagentError) as raised:
        await fork_without_a_parent()
    assert type(raised.value) is SubagentError
    assert raised.value.code is ErrorCode.START_FAILED


async def test_the_callers_exception_leaves_a_service_with_a_live_in_process_child_as_itself() -> None:
    spawn = SpawnProvider(llm=ScriptedLlm([Reply(text="hi")]), agents=AgentRegistry())
    outputs: list[str] = []

    async def fail_after_a_result() -> None:
        async with SubagentService() as subagents:
            subagents.register_provider(spawn)
            async with subagents.start(spawn.name, SubagentRequest(prompt="p")) as run:
                outputs.append((await run.result()).output)
                raise CallerBug("after the result")

    with anyio.fail_after(WAIT), pytest.raises(CallerBug, match="after the result"):
        await fail_after_a_result()
    assert outputs == ["hi"]


async def test_cancelling_the_owner_of_a_service_is_still_caught_by_its_scope() -> None:
    provider = FakeProvider()
    with anyio.fail_after(WAIT), anyio.CancelScope() as scope:
        async with SubagentService() as subagents:
            subagents.register_provider(provider)
            subagents.start("fake", SubagentRequest(prompt="p"))
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert provider.runs[0].dispose_calls == 1


# -- a provider task that fails in the service's task group ----------------------------------------------


class CrashingRun(FakeRun):
    """A run whose provider task crashes in the service's task group (a provider bug)."""

    def __init__(self, request: SubagentRequest, task_group: TaskGroup) -> None:
        super().__init__(request, task_group)
        task_group.start_soon(self._crash)

    async def _crash(self) -> None:
        raise LookupError("provider bug")


async def test_a_provider_task_that_crashes_leaves_the_service_as_itself() -> None:
    provider = FakeProvider(run_class=CrashingRun)

    async def wait_for_the_crash() -> None:
        async with SubagentService() as subagents:
            subagents.register_provider(provider)
            subagents.start("fake", SubagentRequest(prompt="p"))
            await anyio.sleep_forever()  # cancelled by the crash

    with anyio.fail_after(WAIT), pytest.raises(LookupError, match="provider bug") as raised:
        await wait_for_the_crash()
    assert type(raised.value) is LookupError


# -- the helper ------------------------------------------------------------------------------------------


def raised_by(group: BaseExceptionGroup[Any], preferred: BaseException | None = None) -> BaseException | None:
    try:
        raise_sole_error(group, preferred=preferred)
    except BaseException as exc:
        return exc
    return None


async def test_the_sole_error_of_a_nested_group_is_raised_as_itself_and_cancellations_left_alone() -> None:
    error = ValueError("the one")
    cancelled = anyio.get_cancelled_exc_class()
    with anyio.CancelScope() as scope:
        scope.cancel()
        try:
            await anyio.sleep_forever()
        except cancelled as exc:
            cancellation: BaseException = exc
            raise
    assert raised_by(BaseExceptionGroup("outer", [ExceptionGroup("inner", [error])])) is error
    assert raised_by(BaseExceptionGroup("g", [cancellation, error])) is error
    assert raised_by(BaseExceptionGroup("g", [cancellation])) is None


async def test_the_blocks_own_exception_wins_over_task_errors_which_are_noted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mine, theirs = CallerBug("mine"), ValueError("theirs")
    raised = raised_by(ExceptionGroup("g", [theirs, mine]), preferred=mine)
    assert raised is mine
    assert getattr(mine, "__notes__", []) == ["also failed meanwhile: ValueError: theirs"]
    assert [record.exc_info[1] for record in caplog.records if record.exc_info] == [theirs]


async def test_without_a_preferred_error_the_first_task_error_is_raised() -> None:
    first, second = ValueError("first"), KeyError("second")
    assert raised_by(ExceptionGroup("g", [first, second])) is first
