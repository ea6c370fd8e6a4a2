"""`subagent run --add-dir` and the config's ``additional_directories``: more roots for the agent."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from subagent.cli._config import ConfigError, load_config
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
    done = run_cli(
        tmp_path, "run", "--json", "--permission", "allow", "-p", "write", "--add-dir", "extra", "--", *agent
    )
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
    from subagent.cli._main import main

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
        stub_agent_toml("writer", agent, 'additional_directories = ["../shared"]\npermission = "allow"\n'),
    )
    done = run_cli(
        tmp_path, "run", "--config", str(config), "--agent", "writer", "-p", "w", "--add-dir", "more"
    )
    assert done.status == 0, done.stderr
    assert (tmp_path / "shared" / "a.txt").exists()
    assert (tmp_path / "more" / "b.txt").exists()


# -- elicitation: the terminal form ---------------------------------------------------------------------

FORM: dict[str, Any] = {
    "type": "object",
    "properties": {
        "target": {"type": "string", "title": "Target", "oneOf": [
            {"const": "prod", "title": "Production"}, {"const": "staging", "title": "Staging"}]},
        "replicas": {"type": "integer", "minimum": 1, "maximum": 5, "default": 2},
        "confirm": {"type": "boolean", "description": "Really deploy?"},
        "owner": {"type": "string", "format": "email"},
    },
    "required": ["target", "confirm"],
}  # fmt: skip


def eliciting_agent(tmp_path: Path, message: str = "Where to deploy?") -> list[str]:
    return scenario(tmp_path, one_turn({"step": "elicit", "message": message, "requestedSchema": FORM}))


def reported(done: Any) -> Any:
    return json.loads(done.stdout)["result"]


@pytest.mark.subprocess
def test_ask_shows_the_form_and_sends_the_checked_answers_asking_again_after_a_bad_value(
    tmp_path: Path,
) -> None:
    typed = "2\n\ny\nnot an email\nme@example.org\n"
    done = run_cli(
        tmp_path, "run", "--permission", "ask", "-p", "go", "--", *eliciting_agent(tmp_path), stdin=typed
    )
    assert done.status == 0, done.stderr
    assert reported(done) == {
        "action": "accept",
        "content": {"target": "staging", "replicas": 2, "confirm": True, "owner": "me@example.org"},
    }
    assert "input requested: Where to deploy?" in done.stderr
    assert "    2) Staging" in done.stderr
    assert "    Really deploy?" in done.stderr
    assert "not valid: must be a valid email; try again" in done.stderr
    assert "input: Where to deploy? -> answered (your answers)" in done.stderr


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("typed", "action", "reason"),
    [("1\n", "cancel", "end of input on stdin"), ("\n", "decline", "no answer for 'Target'")],
    ids=["eof", "empty-required"],
)
def test_end_of_input_cancels_the_form_and_an_empty_required_answer_declines_it(
    tmp_path: Path, typed: str, action: str, reason: str
) -> None:
    done = run_cli(
        tmp_path, "run", "--permission", "ask", "-p", "go", "--", *eliciting_agent(tmp_path), stdin=typed
    )
    assert done.status == 0, done.stderr
    assert reported(done) == {"action": action}
    assert f"-> {'cancelled' if action == 'cancel' else 'declined'} ({reason})" in done.stderr


@pytest.mark.subprocess
def test_deny_declines_the_form_without_asking_and_the_progress_says_so(tmp_path: Path) -> None:
    done = run_cli(
        tmp_path, "run", "--progress", "--permission", "deny", "-p", "go", "--", *eliciting_agent(tmp_path)
    )
    assert reported(done) == {"action": "decline"}
    assert "input requested" not in done.stderr
    assert "input: Where to deploy? -> declined (--permission deny)" in done.stderr


@pytest.mark.subprocess
def test_the_agents_text_in_the_form_cannot_drive_the_terminal(tmp_path: Path) -> None:
    agent = eliciting_agent(tmp_path, message="Deploy \x1b[2J\x1b]0;pwned\x07now?")
    done = run_cli(tmp_path, "run", "--permission", "ask", "-p", "go", "--", *agent, stdin="1\n\ny\n\n")
    assert reported(done)["action"] == "accept"
    assert "\x1b" not in done.stderr
    assert "\x07" not in done.stderr


@pytest.mark.subprocess
def test_events_report_the_form_and_its_action_but_not_what_was_typed(tmp_path: Path) -> None:
    done = run_cli(
        tmp_path,
        "run", "--events", "--json", "--permission", "ask", "-p", "go", "--", *eliciting_agent(tmp_path),
        stdin="1\n\ny\nsecret@example.org\n",
    )  # fmt: skip
    assert done.status == 0, done.stderr
    events = [event for event in done.events() if event["event"].startswith("elicitation")]
    assert [event["event"] for event in events] == ["elicitation_request", "elicitation"]
    assert [field["name"] for field in events[0]["fields"]] == ["target", "replicas", "confirm", "owner"]
    assert events[0]["fields"][0]["choices"] == ["prod", "staging"]
    assert events[1] == {"event": "elicitation", "action": "accept", "reason": "your answers"}
    assert "secret@example.org" not in json.dumps(events)


# -- updates before the session/new answer --------------------------------------------------------------


@pytest.mark.subprocess
def test_events_show_the_updates_sent_before_the_session_new_answer_after_the_start(tmp_path: Path) -> None:
    commands = {
        "sessionUpdate": "available_commands_update",
        "availableCommands": [{"name": "compact", "description": "Compact"}],
    }
    agent = scenario(
        tmp_path,
        {
            "newSession": {"steps": [{"step": "update", "update": commands}]},
            **one_turn({"step": "message", "text": "hi"}),
        },
    )
    done = run_cli(tmp_path, "run", "--events", "--json", "-p", "go", "--", *agent)
    assert done.status == 0, done.stderr
    events = done.events()
    kinds = [event["event"] for event in events]
    assert kinds[:2] == ["spawn", "start"]
    updates = [event["update"]["sessionUpdate"] for event in events if event["event"] == "update"]
    assert updates == ["available_commands_update", "agent_message_chunk"]
