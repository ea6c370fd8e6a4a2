"""`subagent run` with its agent on ``ray://``, end to end: the command line, run as a subprocess that
joins the session's two-node cluster as a driver of its own (tests/raycluster.py), given by ``--on`` or
by a config file's ``transport``. Nothing of the child may be left on any node afterwards."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
import pytest

from subagent.acp.transports import supervision_available
from subagent.testing import LEAK_TAG_VARIABLE, stub_agent_argv
from tests.raycluster import RayCluster, assert_no_leaks_over_ray
from tests.test_cli import JOURNAL_ID

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.subprocess,
    pytest.mark.skipif(not supervision_available(), reason="the supervisor needs Linux"),
]

CLI = [sys.executable, "-m", "subagent"]
WAIT = 120  # seconds: a hang guard on one CLI run (a new driver joins the cluster), never about speed
REPLY = "hello from a ray node"


def replying_agent(tmp_path: Path) -> list[str]:
    """The stub agent (run in an actor on a node: here, on this machine) answering one turn with `REPLY`."""
    scenario = tmp_path / "scenario.json"
    scenario.write_text(json.dumps({"turns": [[{"step": "message", "text": REPLY}]]}))
    return stub_agent_argv(scenario)


def agent_config(argv: list[str], transport: str, cwd: Path, tag: str) -> str:
    """A config file with one agent, ``far``, running ``argv`` through ``transport`` with the leak tag."""
    command, *args = argv
    return (
        "[agents.far]\n"
        f"command = {json.dumps(command)}\n"
        f"args = {json.dumps(args)}\n"
        f"transport = {json.dumps(transport)}\n"
        f"env = {{ {LEAK_TAG_VARIABLE} = {json.dumps(tag)} }}\n"
        f"cwd = {json.dumps(str(cwd))}\n"
    )


async def run_cli(cluster: RayCluster, tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """``subagent ARGS`` from ``tmp_path`` with the cluster's credentials and no user config."""
    env = {**os.environ, **cluster.environment, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    with anyio.fail_after(WAIT):
        done = await anyio.run_process([*CLI, *args], cwd=tmp_path, env=env, check=False)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def test_run_on_a_ray_url_runs_the_turn_in_an_actor_of_that_cluster(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    async with assert_no_leaks_over_ray() as tag:
        config = agent_config(replying_agent(tmp_path), "local", tmp_path, tag)
        (tmp_path / "subagent.toml").write_text(config)
        url = f"ray://{ray_cluster.address}"
        status, out, err = await run_cli(
            ray_cluster, tmp_path, "run", "--agent", "far", "--on", url, "--cwd", str(tmp_path), "--json",
            "-p", "go",
        )  # fmt: skip
    assert (status, err) == (0, "")
    assert json.loads(out) == {
        "output": REPLY,
        "stopReason": "completed",
        "error": None,
        "usage": None,
        "journalId": JOURNAL_ID,
    }


async def test_a_configured_agent_on_ray_runs_there_and_is_listed_with_its_transport(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    url = f"ray://{ray_cluster.address}"
    async with assert_no_leaks_over_ray() as tag:
        (tmp_path / "subagent.toml").write_text(agent_config(replying_agent(tmp_path), url, tmp_path, tag))
        status, out, err = await run_cli(ray_cluster, tmp_path, "run", "--agent", "far", "-p", "go")
    assert (status, out, err) == (0, f"{REPLY}\n", "")
    status, out, err = await run_cli(ray_cluster, tmp_path, "agents")
    assert status == 0
    assert f"(on {url})" in out


async def test_fs_for_an_agent_on_ray_is_a_usage_error_naming_the_transport(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    url = f"ray://{ray_cluster.address}"
    status, out, err = await run_cli(
        ray_cluster, tmp_path, "run", "--on", url, "--fs", "-p", "go", "--", *replying_agent(tmp_path)
    )
    assert (status, out) == (2, "")
    assert f"--fs: an agent on {url} cannot be offered this host's files" in err
