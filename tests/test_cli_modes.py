"""The command line's session modes and config options: ``--mode``, ``--set``, the config's ``mode`` and
``config_options``, ``subagent describe``, and what a user is told when the client steps in for the policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.test_cli import run_cli, scenario, stub_agent_toml, write_config
from tests.test_modes_and_policy import CONFIG_OPTIONS

pytestmark = pytest.mark.subprocess

MODES: dict[str, Any] = {
    "currentModeId": "auto",
    "availableModes": [
        {"id": "default", "name": "Default", "description": "Asks before edits"},
        {"id": "auto", "name": "Auto"},
    ],
}


def qwen_like(tmp_path: Path) -> list[str]:
    """A stub agent named like Qwen Code: starts in ``auto`` and then writes ``out.txt`` without asking."""
    return scenario(
        tmp_path,
        {
            "initialize": {"agentInfo": {"name": "qwen-code", "title": "Qwen Code", "version": "0.24.4"}},
            "newSession": {"modes": MODES, "configOptions": CONFIG_OPTIONS},
            "turns": [
                [
                    {
                        "step": "permission",
                        "skipInModes": ["auto"],
                        "toolCall": {
                            "toolCallId": "w",
                            "title": "Write out.txt",
                            "kind": "edit",
                            "locations": [{"path": str(tmp_path / "out.txt")}],
                        },
                        "branches": {
                            "allow": [
                                {"step": "write_file", "path": str(tmp_path / "out.txt"), "content": "x"}
                            ]
                        },
                    },
                    {"step": "message", "text": "done"},
                ]
            ],
        },
    )


def test_under_deny_the_session_is_moved_to_the_asking_mode_and_the_user_is_told(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "run", "--permission", "deny", "-p", "write", "--", *qwen_like(tmp_path))
    assert (done.status, done.stdout) == (0, "done\n")
    assert not (tmp_path / "out.txt").exists()
    assert (
        "started its session in mode 'auto', which approves tool calls by itself; switched it to 'default'"
        in (done.stderr)
    )


def test_mode_wins_over_the_move_and_the_write_it_makes_unasked_is_still_refused_under_deny(
    tmp_path: Path,
) -> None:
    done = run_cli(
        tmp_path,
        "run",
        "--json",
        "--permission",
        "deny",
        "--mode",
        "auto",
        "-p",
        "w",
        "--",
        *qwen_like(tmp_path),
    )
    report = json.loads(done.stdout)
    assert (done.status, report["stopReason"]) == (0, "completed")
    assert json.loads(report["output"].removesuffix("done"))["error"]["code"] == -32003
    assert not (tmp_path / "out.txt").exists()
    assert f"refused the agent's write to {tmp_path / 'out.txt'}" in done.stderr


def test_a_mode_or_value_the_agent_does_not_offer_fails_the_start_with_exit_2_listing_what_it_offers(
    tmp_path: Path,
) -> None:
    mode = run_cli(tmp_path, "run", "--mode", "plan", "-p", "w", "--", *qwen_like(tmp_path))
    assert mode.status == 2
    assert "the agent offers no mode 'plan' (its modes: 'default', 'auto')" in mode.stderr
    value = run_cli(tmp_path, "run", "--set", "model=huge", "-p", "w", "--", *qwen_like(tmp_path))
    assert value.status == 2
    assert (
        "the agent's config option 'model' takes no value 'huge' (its values: 'small', 'big')" in value.stderr
    )
    malformed = run_cli(tmp_path, "run", "--set", "model", "-p", "w", "--", *qwen_like(tmp_path))
    assert malformed.status == 2
    assert "--set: expected ID=VALUE, e.g. model=fast, not 'model'" in malformed.stderr


def test_the_configs_mode_and_config_options_apply_and_set_overrides_one_of_them(tmp_path: Path) -> None:
    extra = 'mode = "default"\npermission = "allow"\nconfig_options = { model = "big", thinking = true }\n'
    write_config(tmp_path / "subagent.toml", stub_agent_toml("qwen", qwen_like(tmp_path), extra))
    done = run_cli(tmp_path, "run", "--agent", "qwen", "--set", "thinking=false", "--events", "-p", "w")
    assert done.status == 0
    assert (tmp_path / "out.txt").read_text() == "x"  # asked in mode default, and allowed
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    start = next(event for event in events if event["event"] == "start")
    assert start["mode"] == "default"
    assert [(option["id"], option["currentValue"]) for option in start["configOptions"]] == [
        ("model", "big"),
        ("thinking", False),
    ]
    # The write was covered by the answer to the question that named its path: asked once.
    assert [event["event"] for event in events].count("permission") == 1


def test_describe_lists_the_modes_marks_the_current_and_approving_ones_and_the_config_options(
    tmp_path: Path,
) -> None:
    done = run_cli(tmp_path, "describe", "--", *qwen_like(tmp_path))
    assert done.status == 0
    lines = done.stdout.splitlines()
    assert lines[0] == "Qwen Code 0.24.4 (agentInfo.name qwen-code), protocol version 1"
    assert "modes (current: auto; switch with --mode ID):" in lines
    assert "    default  Default: Asks before edits  [asks first]" in lines
    assert "  * auto     Auto  [approves tool calls by itself]" in lines
    assert "  under --permission deny or ask, a run moves this session to 'default'" in lines
    assert "  model [model] = small  (values: small, big)" in lines
    assert "  thinking = false  (true or false)" in lines
    described = json.loads(run_cli(tmp_path, "describe", "--json", "--", *qwen_like(tmp_path)).stdout)
    assert (described["currentMode"], described["askingMode"], described["switchesTo"]) == (
        "auto",
        "default",
        "default",
    )
    assert [(m["id"], m["approvesByItself"]) for m in described["modes"]] == [
        ("default", False),
        ("auto", True),
    ]
    assert not (tmp_path / "out.txt").exists()  # no prompt was sent


def test_describe_of_an_agent_that_cannot_start_exits_2_naming_why(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "describe", "--", str(tmp_path / "no-such-agent"))
    assert done.status == 2
    assert "could not describe the agent" in done.stderr
    assert "does not exist" in done.stderr


def test_a_mode_error_of_an_agent_with_auth_methods_gives_no_authentication_advice(tmp_path: Path) -> None:
    agent = scenario(
        tmp_path,
        {
            "initialize": {"authMethods": [{"id": "api-key", "name": "API key"}]},
            "newSession": {"modes": MODES},
        },
        name="with-auth.json",
    )
    done = run_cli(tmp_path, "run", "--mode", "plan", "-p", "w", "--", *agent)
    assert done.status == 2
    assert "the agent offers no mode 'plan' (its modes: 'default', 'auto')" in done.stderr
    assert "--auth-method" not in done.stderr
