"""`subagent run --add-dir` and the config's ``additional_directories``: more roots for the agent."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from subagent.cli.config import ConfigError, load_config
from tests.test_cli import one_turn, run_cli, scenario, stub_agent_toml, write_config

ADVERTISED: dict[str, Any] = {
    "initialize": {"agentCapabilities": {"sessionCapabilities": {"additionalDirectories": {}}}}
}


@pytest.mark.subprocess
def test_add_dir_lets_the_agent_write_in_that_directory_too(tmp_path: Path) -> None:
    extra = tmp_path / "extra"
    extra.mkdir()
    agent = scenario(
        tmp_path,
        {**ADVERTISED, **one_turn({"step": "write_file", "path": str(extra / "out.txt"), "content": "x"})},
    )
    done = run_cli(tmp_path, "run", "--json", "-p", "write", "--add-dir", "extra", "--", *agent)
    assert done.status == 0, done.stderr
    assert json.loads(done.json()["output"]) == {"method": "fs/write_text_file", "result": {}}
    assert (extra / "out.txt").exists()


@pytest.mark.subprocess
def test_without_add_dir_the_same_write_is_refused(tmp_path: Path) -> None:
    extra = tmp_path / "extra"
    extra.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    agent = scenario(
        tmp_path,
        {**ADVERTISED, **one_turn({"step": "write_file", "path": str(extra / "out.txt"), "content": "x"})},
    )
    done = run_cli(tmp_path, "run", "--json", "-p", "write", "--cwd", str(work), "--", *agent)
    assert done.status == 0, done.stderr
    assert json.loads(done.json()["output"])["error"]["code"] == -32602
    assert not (extra / "out.txt").exists()


@pytest.mark.subprocess
def test_add_dir_to_an_agent_that_cannot_take_it_exits_2_naming_the_capability(tmp_path: Path) -> None:
    agent = scenario(tmp_path, one_turn({"step": "message", "text": "never"}))
    done = run_cli(tmp_path, "run", "-p", "hi", "--add-dir", str(tmp_path), "--", *agent)
    assert done.status == 2
    assert "sessionCapabilities.additionalDirectories" in done.stderr
    assert done.stdout == ""


def test_add_dir_that_is_not_a_directory_is_a_usage_error_before_any_agent_starts(tmp_path: Path) -> None:
    from subagent.cli.main import main

    assert main(["run", "-p", "hi", "--add-dir", str(tmp_path / "missing"), "--", "no-such-agent"]) == 2


def test_the_configs_additional_directories_are_resolved_from_the_files_directory(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "subagent.toml"
    path.parent.mkdir()
    path.write_text(
        '[agents.a]\ncommand = "x"\nadditional_directories = ["../shared", "/abs", "~/home-rel"]\n'
    )
    agent = load_config(path).agents["a"]
    assert agent.additional_directories == (
        str(tmp_path.resolve() / "shared"),
        "/abs",
        os.path.normpath(os.path.expanduser("~/home-rel")),
    )


def test_a_remote_agents_relative_additional_directory_is_a_config_error_naming_the_key(
    tmp_path: Path,
) -> None:
    path = tmp_path / "subagent.toml"
    path.write_text(
        '[agents.r]\ncommand = "x"\ntransport = "ssh://host"\nadditional_directories = ["/ok", "rel"]\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.key == "agents.r.additional_directories[1]"


@pytest.mark.subprocess
def test_the_configs_additional_directories_come_before_add_dir_and_both_reach_the_agent(
    tmp_path: Path,
) -> None:
    for name in ("shared", "more"):
        (tmp_path / name).mkdir()
    turn = one_turn(
        {"step": "write_file", "path": str(tmp_path / "shared" / "a.txt"), "content": "x"},
        {"step": "write_file", "path": str(tmp_path / "more" / "b.txt"), "content": "x"},
    )
    agent = scenario(tmp_path, {**ADVERTISED, **turn})
    config = write_config(
        tmp_path / "conf" / "agents.toml",
        stub_agent_toml("writer", agent, 'additional_directories = ["../shared"]\n'),
    )
    done = run_cli(
        tmp_path, "run", "--config", str(config), "--agent", "writer", "-p", "w", "--add-dir", "more"
    )
    assert done.status == 0, done.stderr
    assert (tmp_path / "shared" / "a.txt").exists()
    assert (tmp_path / "more" / "b.txt").exists()
