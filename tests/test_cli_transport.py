"""`subagent run --on URL`, the config's ``transport`` key and `subagent agents`, run in this process with
a transport scheme of the test's own: an agent served here by `subagent.testing.InProcessTransport`."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from subagent.acp.transports import TRANSPORT_SCHEMES, Transport
from subagent.cli._main import main
from subagent.testing import InProcessChannel, InProcessTransport
from tests.transports import ScriptedHandler

EXPECTED = "expected 'local', 'ssh://…', 'ray://…' or 'inproc://…'"


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[InProcessTransport]:
    """Registers the ``inproc://`` scheme (an in-process agent that answers "hello from NAME"), keeps
    the transports it built, and runs the CLI from an empty directory with no user config."""
    built: list[InProcessTransport] = []

    def from_url(url: str) -> Transport:
        def handler(channel: InProcessChannel) -> ScriptedHandler:
            return ScriptedHandler(channel, text=f"hello from {url}")

        # Like a remote host's, the agent's files are not ours to serve.
        built.append(InProcessTransport(handler, name=url, local_files=False, record_sent=True))
        return built[-1]

    module = types.ModuleType("subagent_test_inproc_transport")
    module.from_url = from_url  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(TRANSPORT_SCHEMES, "inproc", f"{module.__name__}:from_url")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return built


def test_run_on_a_url_runs_the_agent_through_that_transport(
    opened: list[InProcessTransport], capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["run", "--on", "inproc://box", "--json", "-p", "hi", "--", "remote-agent", "--acp"])
    out = capsys.readouterr().out
    assert status == 0
    assert json.loads(out)["output"] == "hello from inproc://box"
    [transport] = [built for built in opened if built.opened]
    [call] = transport.opened
    assert call.argv == ("remote-agent", "--acp")
    assert call.cwd == str(Path.cwd())
    initialize = transport.sent_messages()[0]["params"]
    assert isinstance(initialize, dict)
    # A remote agent is offered no fs, no terminal.
    assert initialize["clientCapabilities"] == {
        "fs": {},
        "elicitation": {"form": {}},
        "session": {"notices": {}, "compaction": {}, "configOptions": {"boolean": {}}},
        "subagents": {},  # the ACP provider's default
    }


def test_run_on_a_bad_url_is_a_usage_error_naming_the_option(
    opened: list[InProcessTransport], capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["run", "--on", "ftp://me:hunter22@box", "-p", "hi", "--", "agent"])
    err = capsys.readouterr().err
    assert status == 2
    assert f"--on: unknown transport scheme 'ftp': {EXPECTED}" in err
    assert "hunter22" not in err


def test_run_on_a_remote_host_refuses_fs_and_a_relative_cwd(
    opened: list[InProcessTransport], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--on", "inproc://box", "--fs", "-p", "hi", "--", "agent"]) == 2
    assert "--fs: an agent on inproc://box cannot be offered this host's files" in capsys.readouterr().err
    assert main(["run", "--on", "inproc://box", "--cwd", "src", "-p", "hi", "--", "agent"]) == 2
    assert "--cwd: 'src' must be an absolute path on inproc://box" in capsys.readouterr().err


def test_a_remote_cwd_is_not_looked_for_here(
    opened: list[InProcessTransport], capsys: pytest.CaptureFixture[str]
) -> None:
    remote_cwd = "/srv/../srv/elsewhere"
    status = main(["run", "--on", "inproc://box", "--cwd", remote_cwd, "-p", "hi", "--", "agent"])
    assert (status, capsys.readouterr().out) == (0, "hello from inproc://box\n")
    [transport] = [built for built in opened if built.opened]
    assert transport.opened[0].cwd == "/srv/../srv/elsewhere"  # as written: its symlinks are there


def test_the_config_names_an_agents_transport_and_on_overrides_it(
    opened: list[InProcessTransport], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "subagent.toml").write_text(
        '[agents.far]\ncommand = "remote-agent"\ntransport = "inproc://far"\n'
        '[agents.near]\ncommand = "agent"\n'
    )
    assert main(["run", "--agent", "far", "-p", "hi"]) == 0
    assert capsys.readouterr().out == "hello from inproc://far\n"
    assert main(["run", "--agent", "far", "--on", "inproc://other", "-p", "hi"]) == 0
    assert capsys.readouterr().out == "hello from inproc://other\n"
    assert main(["agents"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"agents in {tmp_path / 'subagent.toml'}:",
        "  far   remote-agent  (on inproc://far)",
        "  near  agent",
    ]
    assert main(["agents", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["agents"]
    assert [(agent["name"], agent["transport"]) for agent in listed] == [
        ("far", "inproc://far"),
        ("near", "local"),
    ]


def test_a_config_transport_naming_no_transport_is_an_error_naming_file_agent_and_key(
    opened: list[InProcessTransport], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "subagent.toml"
    config.write_text('[agents.far]\ncommand = "remote-agent"\ntransport = "sftp://far"\n')
    assert main(["agents"]) == 2
    assert (
        f"{config}: agents.far.transport: unknown transport scheme 'sftp': {EXPECTED}"
        in capsys.readouterr().err
    )
