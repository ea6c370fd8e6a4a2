"""The transport seam under the ACP client: channels, the local transport, URLs, and transports of our own."""

from __future__ import annotations

import re
import string
import sys
import types
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from subagent import ErrorCode, SubagentError, SubagentRequest, SubagentService
from subagent.acp import AgentProcess, AgentSpawnError, ExitInfo
from subagent.acp.client import spawn_agent
from subagent.acp.handlers import FsSandbox
from subagent.acp.transports import (
    TRANSPORT_SCHEMES,
    BaseTransport,
    Channel,
    Launch,
    LocalTransport,
    Transport,
    transport_from_url,
)
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.testing import IN_PROCESS_VIA, InProcessChannel, InProcessTransport
from subagent.testing.pytest_plugin import StubAgentCommand
from tests.leaks import assert_no_leaks
from tests.transports import (
    Opened,
    RelayChannel,
    RelayTransport,
    ScriptedHandler,
)

pytestmark = pytest.mark.anyio

WAIT = 20  # seconds: a hang guard, never a sleep
FAST = {"stdin_close_timeout": 1.0, "sigterm_timeout": 1.0, "sigkill_timeout": 2.0}
GRACEFUL = {**FAST, "stdin_close_timeout": 20.0}
"""For a test that asserts the graceful path: a loaded machine may take seconds to start the stub, which
must be up to read the EOF that ends it."""
EXPECTED = "expected 'local', 'ssh://…' or 'ray://…'"
ONE_TURN = {"turns": [[{"step": "message", "text": "done"}]]}


def exactly(message: str) -> str:
    """A ``pytest.raises(match=...)`` pattern matching ``message`` and nothing more."""
    return f"^{re.escape(message)}$"


# -- the protocols -------------------------------------------------------------------------------------


@pytest.mark.subprocess
async def test_an_agent_process_is_a_channel_and_the_local_transport_opens_one(
    stub_agent_command: StubAgentCommand,
) -> None:
    transport: Transport = LocalTransport(**GRACEFUL)
    assert isinstance(transport, Transport)
    assert (transport.name, transport.local_files, transport.stdin_close_timeout) == ("local", True, 20.0)
    argv = stub_agent_command(ONE_TURN)
    async with assert_no_leaks():
        with anyio.fail_after(WAIT):
            async with transport.open(argv, env={"SUBAGENT_T": "1"}) as channel:
                assert isinstance(channel, AgentProcess)
                typed: Channel = channel  # mypy checks that AgentProcess satisfies Channel
                assert isinstance(typed, Channel)
                assert channel.command == tuple(argv)
                assert channel.describe() == f"pid {channel.pid}"
                assert channel.exit_info() is None
                report = await channel.aclose()
    assert report.graceful  # the stub exits once its stdin closes
    info = channel.exit_info()
    assert info is not None
    assert (info.pid, info.returncode, info.via) == (channel.pid, 0, None)
    assert str(info).startswith(f"agent `{' '.join(argv)}` (pid {channel.pid}) exited with status 0")


def test_local_transport_options_are_the_process_options_and_argv_env_cwd_are_per_open() -> None:
    transport = LocalTransport(stdin_close_timeout=0.5, supervise=False)
    assert transport.process_options == {"stdin_close_timeout": 0.5, "supervise": False}
    assert transport.stdin_close_timeout == 0.5
    assert repr(transport) == "LocalTransport(stdin_close_timeout=0.5, supervise=False)"
    with pytest.raises(TypeError, match=r"^'cwd' is given to LocalTransport.open, not to LocalTransport$"):
        LocalTransport(cwd="/")


def test_an_exit_elsewhere_names_its_route_and_an_unknown_pid() -> None:
    info = ExitInfo(
        command=("agent", "--acp"),
        pid=None,
        returncode=3,
        stderr_tail="boom\n",
        stderr_bytes_total=5,
        via="via ssh to build-1",
    )
    assert (
        str(info)
        == "agent `agent --acp` (pid unknown via ssh to build-1) exited with status 3; last stderr: boom"
    )
    located = ExitInfo(("agent",), 42, 0, "", 0, via="via ssh to build-1")
    assert str(located) == "agent `agent` (pid 42 via ssh to build-1) exited with status 0; stderr was empty"


# -- BaseTransport ---------------------------------------------------------------------------------------


OPENED = object()
"""What `RecordingTransport.launch` returns in place of a context manager."""


class RecordingTransport(BaseTransport[Channel]):
    """Records what `launch` is given; never starts anything."""

    name = "recording"
    local_files = False
    stdin_close_timeout = 1.0

    def __init__(self) -> None:
        self.launched: list[Launch] = []

    def launch(self, launch: Launch) -> Any:
        self.launched.append(launch)
        return OPENED


def test_a_base_transport_launches_the_checked_command_with_a_copy_of_env() -> None:
    transport = RecordingTransport()
    env = {"KEY": "value"}
    on_line = print
    assert isinstance(transport, Transport)
    opened: object = transport.open(["/bin/agent", "--acp"], env=env, cwd="/srv", on_stderr_line=on_line)
    assert opened is OPENED
    env["KEY"] = "changed later"
    assert transport.launched == [Launch(("/bin/agent", "--acp"), {"KEY": "value"}, "/srv", on_line)]


@pytest.mark.parametrize(
    ("argv", "env", "error", "message"),
    [
        (
            "agent --acp",
            None,
            TypeError,
            "argv must be a sequence of arguments, not a string: no shell is used",
        ),
        ([], None, ValueError, "argv must name a program"),
        (
            ["agent", "a\0b"],
            None,
            AgentSpawnError,
            "cannot start agent `agent 'a\x00b'`: argument 1 contains a NUL character",
        ),
        (
            ["agent"],
            {"TOKEN": "hunter\0 22"},
            AgentSpawnError,
            "cannot start agent `agent`: the value of environment variable 'TOKEN' contains a NUL character",
        ),
    ],
)
def test_a_base_transport_refuses_what_exec_cannot_carry_before_launching_anything(
    argv: Any, env: dict[str, str] | None, error: type[Exception], message: str
) -> None:
    transport = RecordingTransport()
    with pytest.raises(error) as caught:
        transport.open(argv, env=env)
    assert str(caught.value) == message
    assert transport.launched == []


# -- transport_from_url ------------------------------------------------------------------------------


@pytest.mark.parametrize("url", [None, "local"])
def test_no_url_or_local_is_a_local_transport_with_default_options(url: str | None) -> None:
    transport = transport_from_url(url)
    assert isinstance(transport, LocalTransport)
    assert transport.process_options == {}


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("", f"not a transport URL: {EXPECTED}"),
        ("build-1", f"not a transport URL: {EXPECTED}"),
        ("LOCAL", f"not a transport URL: {EXPECTED}"),
        ("://build-1", f"not a transport URL: {EXPECTED}"),
        ("s sh://build-1", f"not a transport URL: {EXPECTED}"),
        ("1ssh://build-1", f"not a transport URL: {EXPECTED}"),
        ("local://", f"unknown transport scheme 'local': {EXPECTED}"),
        ("http://build-1", f"unknown transport scheme 'http': {EXPECTED}"),
        ("https://me:hunter22@host", f"unknown transport scheme 'https': {EXPECTED}"),
        (
            "ray://me:hunter22@head:6379",
            "a ray transport URL takes no user or password: ray://HOST:PORT or ray://auto",
        ),
        ("RAY://head", "a ray transport URL names the cluster's GCS address: ray://HOST:PORT or ray://auto"),
    ],
)
def test_a_url_naming_no_available_transport_is_refused_without_quoting_it(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=exactly(message)):
        transport_from_url(url)
    assert "hunter22" not in message


def test_a_scheme_whose_module_is_not_installed_is_refused_as_not_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(TRANSPORT_SCHEMES, "k8s", "subagent.acp.no_such_transport:transport_from_url")
    with pytest.raises(ValueError, match=exactly("the k8s:// transport is not available yet")):
        transport_from_url("k8s://me:hunter22@cluster")


def test_a_transport_url_must_be_a_string() -> None:
    with pytest.raises(TypeError, match=r"^a transport URL is a string, not bytes$"):
        transport_from_url(b"ssh://host")  # type: ignore[arg-type]


def test_each_remote_scheme_is_one_line_naming_its_factory() -> None:
    assert TRANSPORT_SCHEMES == {
        "ssh": "subagent.acp.transports._ssh:transport_from_url",
        "ray": "subagent.acp.transports._ray:transport_from_url",
    }


def test_a_registered_scheme_builds_its_transport_from_the_whole_url(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []

    def factory(url: str) -> Transport:
        built.append(url)
        return RelayTransport(LocalTransport())

    module = types.ModuleType("subagent_test_fake_transport")
    module.from_url = factory  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(TRANSPORT_SCHEMES, "fake", f"{module.__name__}:from_url")
    transport = transport_from_url("fake://user@host:2222/x")
    assert built == ["fake://user@host:2222/x"]
    assert transport.name == "relay+local"
    expected = "unknown transport scheme 'nope': expected 'local', 'ssh://…', 'ray://…' or 'fake://…'"
    with pytest.raises(ValueError, match=exactly(expected)):
        transport_from_url("nope://x")


def test_a_transport_module_that_fails_to_import_for_another_reason_is_not_hidden(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "subagent_test_broken_transport.py").write_text("import subagent_test_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(TRANSPORT_SCHEMES, "broken", "subagent_test_broken_transport:from_url")
    with pytest.raises(ModuleNotFoundError, match="subagent_test_missing_dependency"):
        transport_from_url("broken://x")


# -- spawn_agent and AcpProvider choose the transport --------------------------------------------------


async def test_spawn_agent_refuses_process_options_for_another_transport() -> None:
    transport = InProcessTransport(lambda channel: ScriptedHandler(channel, text="hi"), local_files=False)
    expected = "process_options configure the default local transport; configure in-process itself"
    with pytest.raises(ValueError, match=exactly(expected)):
        async with spawn_agent(["agent"], transport=transport, process_options=FAST):
            pass
    assert transport.opened == []


async def test_spawn_agent_offers_no_local_files_to_an_agent_that_cannot_see_them(tmp_path: Path) -> None:
    transport = InProcessTransport(lambda channel: ScriptedHandler(channel, text="hi"), local_files=False)
    expected = (
        "the agent runs on in-process, where this host's files are not: it can be offered no fs sandbox "
        "or terminals here"
    )
    with pytest.raises(ValueError, match=exactly(expected)):
        async with spawn_agent(["agent"], transport=transport, fs=FsSandbox([tmp_path])):
            pass
    assert transport.opened == []


def test_the_provider_takes_a_transport_or_a_url_and_checks_it_at_construction() -> None:
    assert isinstance(AcpProvider(["agent"]).transport, LocalTransport)
    local = AcpProvider(["agent"], transport="local", process_options=FAST).transport
    assert isinstance(local, LocalTransport)
    assert local.process_options == FAST
    relay = RelayTransport(LocalTransport())
    provider = AcpProvider(["agent"], name="relayed", transport=relay)
    assert provider.transport is relay
    assert repr(provider) == "AcpProvider(name='relayed', command='agent', transport='relay+local')"
    with pytest.raises(ValueError, match=exactly(f"unknown transport scheme 'ftp': {EXPECTED}")):
        AcpProvider(["agent"], transport="ftp://host")
    refused = "process_options configure the local transport; configure relay+local itself"
    with pytest.raises(ValueError, match=exactly(refused)):
        AcpProvider(["agent"], transport=relay, process_options=FAST)
    with pytest.raises(TypeError, match=r"^transport must be a URL or a Transport, not int$"):
        AcpProvider(["agent"], transport=3)  # type: ignore[arg-type]


async def run_one(provider: AcpProvider, cwd: Path) -> tuple[Any, AcpRun]:
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go", cwd=str(cwd))) as run:
            with anyio.fail_after(WAIT):
                result = await run.result()
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
    return result, acp_run


@pytest.mark.subprocess
async def test_the_provider_opens_each_child_through_its_transport_with_argv_env_and_cwd(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    relay = RelayTransport(LocalTransport(**GRACEFUL))  # it asserts the exit on stdin close: status 0
    argv = stub_agent_command(ONE_TURN)
    # The transport's whole grace, not an idle agent's 0.3 s: a loaded machine's stub may take longer to
    # read its EOF, and be SIGTERMed (status -15) where the test asserts the graceful exit.
    provider = AcpProvider(argv, env={"SUBAGENT_T": "relayed"}, transport=relay, idle_close_grace=None)
    result, run = await run_one(provider, tmp_path)
    assert (result.stop_reason, result.output) == ("completed", "done")
    assert relay.opened == [Opened(tuple(argv), {"SUBAGENT_T": "relayed"}, str(tmp_path))]
    [channel] = relay.channels
    assert isinstance(channel, RelayChannel)
    assert run.pid == channel.pid is not None  # the pid of the local process, through the channel
    assert run.exit_info is not None
    assert run.exit_info.returncode == 0


@pytest.mark.subprocess
async def test_a_child_death_is_diagnosed_through_the_channel(
    stub_agent_command: StubAgentCommand, tmp_path: Path
) -> None:
    relay = RelayTransport(LocalTransport(**FAST))
    scenario = {
        "initialize": {"steps": [{"step": "stderr", "text": "no key\n"}, {"step": "exit", "code": 3}]}
    }
    provider = AcpProvider(stub_agent_command(scenario), transport=relay)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go", cwd=str(tmp_path))) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
    assert caught.value.code == ErrorCode.START_FAILED
    assert "exited with status 3; last stderr: no key" in str(caught.value)


async def test_an_agent_that_cannot_see_our_files_is_offered_neither_fs_nor_terminals(tmp_path: Path) -> None:
    handlers: list[ScriptedHandler] = []

    def make(channel: InProcessChannel) -> ScriptedHandler:
        handlers.append(ScriptedHandler(channel, text="read nothing", read_file=str(tmp_path / "x.txt")))
        return handlers[-1]

    (tmp_path / "x.txt").write_text("secret")
    transport = InProcessTransport(make, local_files=False, record_sent=True)
    provider = AcpProvider(["remote-agent"], fs=True, terminal=True, transport=transport)
    result, run = await run_one(provider, tmp_path)
    assert (result.stop_reason, result.output) == ("completed", "read nothing")
    initialize = transport.sent_messages()[0]
    assert initialize["method"] == "initialize"
    params = initialize["params"]
    assert isinstance(params, dict)
    # Every fs/terminal capability false, so the wire omits them; elicitation, notices and compaction stay.
    assert params["clientCapabilities"] == {
        "fs": {},
        "elicitation": {"form": {}},
        "session": {"notices": {}, "compaction": {}, "configOptions": {"boolean": {}}},
        "subagents": {},  # the ACP provider's default
    }
    [handler] = handlers
    assert handler.read_error is not None
    assert handler.read_error.code == -32601  # method not found
    assert run.pid is None  # nothing was spawned on this host
    assert run.exit_info is not None
    assert (
        str(run.exit_info)
        == f"agent `remote-agent` (pid unknown {IN_PROCESS_VIA}) exited with status 0; stderr was empty"
    )


async def test_an_agent_that_sees_our_files_is_offered_them_through_any_transport(tmp_path: Path) -> None:
    transport = InProcessTransport(lambda channel: ScriptedHandler(channel, text="ok"), record_sent=True)
    provider = AcpProvider(["agent"], fs=True, terminal=True, transport=transport)
    result, _ = await run_one(provider, tmp_path)
    assert result.stop_reason == "completed"
    params = transport.sent_messages()[0]["params"]
    assert isinstance(params, dict)
    assert params["clientCapabilities"] == {
        "fs": {"readTextFile": True, "writeTextFile": True},
        "terminal": True,
        "elicitation": {"form": {}},
        "session": {"notices": {}, "compaction": {}, "configOptions": {"boolean": {}}},
        "subagents": {},  # the ACP provider's default
    }


async def test_an_in_process_agent_that_exits_at_initialize_fails_the_start_with_its_status(
    tmp_path: Path,
) -> None:
    transport = InProcessTransport(lambda channel: ScriptedHandler(channel, text="", exit_at_initialize=3))
    provider = AcpProvider(["remote-agent"], transport=transport)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go", cwd=str(tmp_path))) as run:
            with anyio.fail_after(WAIT), pytest.raises(SubagentError) as caught:
                await run.started()
    assert caught.value.code == ErrorCode.START_FAILED
    assert (
        f"agent `remote-agent` (pid unknown {IN_PROCESS_VIA}) exited with status 3; "
        "last stderr: in-process agent: giving up"
    ) in str(caught.value)


async def test_kill_goes_through_the_channel(tmp_path: Path) -> None:
    transport = InProcessTransport(lambda channel: ScriptedHandler(channel, text="working", work=True))
    provider = AcpProvider(["remote-agent"], transport=transport)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go", cwd=str(tmp_path))) as run:
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
            with anyio.fail_after(WAIT):
                await run.started()
                acp_run.kill()
                result = await run.result()
                await acp_run.wait_child_exited()
    assert result.stop_reason == "error"
    assert acp_run.exit_info is not None
    assert acp_run.exit_info.returncode == -9


# -- any text as a URL --------------------------------------------------------------------------------

_SECRET = st.text(alphabet=string.ascii_letters + string.digits, min_size=12, max_size=24)


@pytest.mark.fuzz
@given(
    scheme=st.sampled_from(["ssh", "SSH", "ray", "http", "local", "s+sh", "", "1x"]),
    user=st.text(max_size=8),
    secret=_SECRET,
    rest=st.text(max_size=40),
)
def test_any_text_is_a_transport_or_a_value_error_that_does_not_repeat_a_password(
    scheme: str, user: str, secret: str, rest: str
) -> None:
    url = f"{scheme}://{user}:{secret}@{rest}"
    refusal = ""
    try:
        transport = transport_from_url(url)
    except ValueError as exc:
        refusal = str(exc)
    else:
        assert isinstance(transport, Transport)
        assert secret not in transport.name
    assert secret not in refusal


@pytest.mark.fuzz
@given(url=st.text(max_size=80))
def test_any_text_at_all_is_a_transport_or_a_value_error(url: str) -> None:
    try:
        transport = transport_from_url(url)
    except ValueError:
        return
    assert isinstance(transport, Transport)
