"""`subagent run` with its agent on ``ssh://``, end to end: the command line, run as a subprocess, against
the loopback ``sshd`` (tests/sshd.py), whose client config the run is given (``--ssh-config``, or the
agent's ``ssh_config`` in a config file). Nothing may be left on either side afterwards."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from subagent.acp.transports import supervision_available
from subagent.testing import LEAK_TAG_VARIABLE, stub_agent_argv
from tests.sshd import SshServer, assert_no_leaks_over_ssh, running_sshd
from tests.test_cli import JOURNAL_ID

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.subprocess,
    pytest.mark.skipif(not supervision_available(), reason="the supervisor needs Linux"),
]

CLI = [sys.executable, "-m", "subagent"]
WAIT = 30  # seconds: a hang guard on one CLI run, never a statement about speed
REPLY = "hello from the remote host"


@pytest.fixture(scope="module")
def sshd() -> Iterator[SshServer]:
    with running_sshd() as server:
        yield server


def replying_agent(tmp_path: Path) -> list[str]:
    """The stub agent (run on the remote host: here, over loopback) answering one turn with `REPLY`."""
    scenario = tmp_path / "scenario.json"
    scenario.write_text(json.dumps({"turns": [[{"step": "message", "text": REPLY}]]}))
    return stub_agent_argv(scenario)


async def run_cli(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """``subagent ARGS`` from ``tmp_path``, with no user config; (status, stdout, stderr)."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    with anyio.fail_after(WAIT):
        done = await anyio.run_process([*CLI, *args], cwd=tmp_path, env=env, check=False)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def test_run_on_an_ssh_url_with_an_ssh_config_file_runs_the_turn_on_that_host(
    sshd: SshServer, tmp_path: Path
) -> None:
    url = f"ssh://{sshd.host}"
    async with assert_no_leaks_over_ssh(sshd):
        status, out, err = await run_cli(
            tmp_path, "run", "--on", url, "--ssh-config", str(sshd.config_file), "--json", "-p", "go", "--",
            *replying_agent(tmp_path),
        )  # fmt: skip
    assert (status, err) == (0, "")
    assert json.loads(out) == {
        "output": REPLY,
        "stopReason": "completed",
        "error": None,
        "usage": None,
        "journalId": JOURNAL_ID,
    }


def remote_agent_config(server: SshServer, argv: list[str], cwd: Path, tag: str) -> str:
    """A config file (in ``cwd``) with one agent, ``remote``, running ``argv`` on ``server``."""
    command, *args = argv
    return (
        "[agents.remote]\n"
        f"command = {json.dumps(command)}\n"
        f"args = {json.dumps(args)}\n"
        f'transport = "ssh://{server.host}"\n'
        # Relative to the config file's directory, as a local cwd is.
        f"ssh_config = {json.dumps(os.path.relpath(server.config_file, cwd))}\n"
        'ssh_options = ["ConnectTimeout=20"]\n'
        f"env = {{ {LEAK_TAG_VARIABLE} = {json.dumps(tag)} }}\n"
        f"cwd = {json.dumps(str(cwd))}\n"
    )


async def test_a_configured_agent_on_ssh_reads_its_ssh_config_and_options_from_the_config_file(
    sshd: SshServer, tmp_path: Path
) -> None:
    async with assert_no_leaks_over_ssh(sshd) as tag:
        config = remote_agent_config(sshd, replying_agent(tmp_path), tmp_path, tag)
        (tmp_path / "subagent.toml").write_text(config)
        status, out, err = await run_cli(tmp_path, "run", "--agent", "remote", "-p", "go")
    assert (status, out, err) == (0, f"{REPLY}\n", "")


async def test_ssh_options_for_an_agent_that_does_not_run_over_ssh_are_a_usage_error(tmp_path: Path) -> None:
    status, out, err = await run_cli(
        tmp_path, "run", "--ssh-option", "ConnectTimeout=5", "-p", "go", "--", *replying_agent(tmp_path)
    )
    assert (status, out) == (2, "")
    assert "--ssh-config, --ssh-option: for an agent on ssh://HOST, not local" in err


async def test_an_ssh_option_that_is_not_name_equals_value_is_a_usage_error(tmp_path: Path) -> None:
    malformed = "--ssh-option=-oProxyCommand=x"  # as one word: argparse takes a lone "-o..." for an option
    status, out, err = await run_cli(
        tmp_path, "run", "--on", "ssh://build-1", malformed, "-p", "go", "--", "agent"
    )
    assert (status, out) == (2, "")
    assert "--ssh-option: expected NAME=VALUE, e.g. ConnectTimeout=20, not '-oProxyCommand=x'" in err
