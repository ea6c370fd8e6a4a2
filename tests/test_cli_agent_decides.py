"""Clear words where the agent decides, through the real `subagent` command line: a turn the agent
ends because its permission request was denied says so (and how to allow it), and `--no-fs` /
`fs = false` stop offering the client's file system to an agent whose use of it is broken."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any, Final

import pytest

from tests.test_cli import JOURNAL_ID, LiveCli, live, run_cli, scenario, stub_agent_toml, write_config

pytestmark = pytest.mark.subprocess

__all__ = ["live"]  # the fixture, imported for the tests below

# Codex's question: its only rejecting option aborts the turn, which then ends `cancelled`.
ABORT_ONLY: Final = [
    {"step": "tool_call", "toolCallId": "call-1", "title": "Run rm -rf build", "kind": "execute"},
    {
        "step": "permission",
        "options": [
            {"optionId": "approved", "name": "Yes", "kind": "allow_once"},
            {"optionId": "abort", "name": "No, and tell Codex what to do differently", "kind": "reject_once"},
        ],
        "branches": {
            "approved": [{"step": "message", "text": "Removed build/."}],
            "abort": [{"step": "stop", "reason": "cancelled"}],
        },
    },
]

DENIED_BY_DENY: Final = (
    "the agent ended its turn after its permission request for 'Run rm -rf build' was denied "
    "(--permission deny); to allow it, use --permission allow to allow every request, or "
    "--permission ask to decide each one"
)


def test_a_turn_the_agent_ends_on_a_denied_request_says_so_and_how_to_allow_it(tmp_path: Path) -> None:
    agent = scenario(tmp_path, {"turns": [ABORT_ONLY]})
    done = run_cli(tmp_path, "run", "--json", "--permission", "deny", "-p", "clean up", "--", *agent)
    assert done.status == 1
    assert done.json() == {
        "output": "",
        "stopReason": "cancelled",
        "error": DENIED_BY_DENY,
        "usage": None,
        "journalId": JOURNAL_ID,
    }

    plain = run_cli(tmp_path, "run", "--permission", "deny", "-p", "clean up", "--", *agent)
    assert (plain.status, plain.stdout) == (1, "")
    assert f"subagent: the turn ended with stop reason 'cancelled': {DENIED_BY_DENY}\n" in plain.stderr


def test_the_same_turn_allowed_completes(tmp_path: Path) -> None:
    agent = scenario(tmp_path, {"turns": [ABORT_ONLY]})
    done = run_cli(tmp_path, "run", "--json", "--permission", "allow", "-p", "clean up", "--", *agent)
    assert done.status == 0
    assert done.json()["output"] == "Removed build/."


def test_a_person_who_rejected_is_told_to_answer_yes_or_allow_every_request(tmp_path: Path) -> None:
    agent = scenario(tmp_path, {"turns": [ABORT_ONLY]})
    done = run_cli(
        tmp_path, "run", "--json", "--permission", "ask", "-p", "clean up", "--", *agent, stdin="n\n"
    )
    assert done.status == 1
    assert done.json()["error"] == (
        "the agent ended its turn after its permission request for 'Run rm -rf build' was denied "
        "(your choice); to allow it, answer yes when asked, or use --permission allow to allow every request"
    )


def test_a_withdrawn_question_counts_as_denied_and_a_hostile_title_is_cleaned_and_cut(tmp_path: Path) -> None:
    title = "\x1b[31mDelete\n everything" + "!" * 1000
    agent = scenario(
        tmp_path,
        {
            "turns": [
                [
                    {"step": "tool_call", "toolCallId": "call-9", "title": title},
                    {
                        "step": "permission",
                        # Nothing to reject with: a deny policy withdraws the question (`cancelled`).
                        "options": [{"optionId": "ok", "name": "OK", "kind": "allow_once"}],
                        "branches": {"cancelled": [{"step": "stop", "reason": "cancelled"}]},
                    },
                ]
            ]
        },
    )
    done = run_cli(tmp_path, "run", "--json", "--permission", "deny", "-p", "go", "--", *agent)
    assert done.status == 1
    error = done.json()["error"]
    shown = "[31mDelete everything" + "!" * (200 - len("[31mDelete everything") - 1) + "\u2026"
    assert error.startswith(f"the agent ended its turn after its permission request for {shown!r} was denied")
    assert "\x1b" not in error
    assert "\n" not in error


def test_a_turn_cancelled_by_ctrl_c_after_a_denial_is_not_blamed_on_the_denial(
    tmp_path: Path, live: list[LiveCli]
) -> None:
    agent = scenario(
        tmp_path,
        {
            "turns": [
                [
                    {"step": "tool_call", "toolCallId": "call-1", "title": "Run rm -rf build"},
                    {
                        "step": "permission",
                        "branches": {"reject": [{"step": "message", "text": "Waiting."}]},
                    },
                    {"step": "wait_for_cancel"},
                ]
            ]
        },
    )
    cli = LiveCli(tmp_path, "run", "--json", "--events", "--permission", "deny", "-p", "go", "--", *agent)
    live.append(cli)
    cli.wait_for_event("permission")
    cli.wait_for_event("update")  # "Waiting.": the agent goes on after the rejection
    cli.process.send_signal(signal.SIGINT)
    done = cli.finish()
    assert done.status == 1
    assert done.json() == {
        "output": "Waiting.",
        "stopReason": "cancelled",
        "error": None,
        "usage": None,
        "journalId": JOURNAL_ID,
    }


# -- --no-fs and fs = false ------------------------------------------------------------------------------


def writing_agent(tmp_path: Path) -> list[str]:
    """A stub agent that writes a new file through the client and reports how that went."""
    return scenario(
        tmp_path,
        {"turns": [[{"step": "write_file", "path": str(tmp_path / "new.txt"), "content": "hello"}]]},
        name="writer.json",
    )


def write_report(stdout: str) -> Any:
    return json.loads(json.loads(stdout)["output"])


def test_no_fs_offers_no_file_system_so_the_agents_write_is_method_not_found(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "run", "--json", "--no-fs", "-p", "write", "--", *writing_agent(tmp_path))
    assert done.status == 0
    report = write_report(done.stdout)
    assert report["method"] == "fs/write_text_file"
    assert report["error"]["code"] == -32601
    assert not (tmp_path / "new.txt").exists()


def test_by_default_the_file_system_is_offered_and_an_allowed_write_lands(tmp_path: Path) -> None:
    done = run_cli(
        tmp_path, "run", "--json", "--permission", "allow", "-p", "write", "--", *writing_agent(tmp_path)
    )
    assert done.status == 0
    assert write_report(done.stdout) == {"method": "fs/write_text_file", "result": {}}
    assert (tmp_path / "new.txt").read_text() == "hello"


def test_fs_false_in_the_config_offers_none_and_fs_on_the_command_line_overrides_it(tmp_path: Path) -> None:
    write_config(
        tmp_path / "subagent.toml", stub_agent_toml("gemini", writing_agent(tmp_path), "fs = false\n")
    )
    configured = run_cli(tmp_path, "run", "--json", "--agent", "gemini", "-p", "write")
    assert write_report(configured.stdout)["error"]["code"] == -32601
    assert not (tmp_path / "new.txt").exists()

    overridden = run_cli(
        tmp_path, "run", "--json", "--agent", "gemini", "--fs", "--permission", "allow", "-p", "write"
    )
    assert write_report(overridden.stdout) == {"method": "fs/write_text_file", "result": {}}
    assert (tmp_path / "new.txt").read_text() == "hello"


def test_agents_shows_which_agents_are_offered_no_file_system(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "subagent.toml",
        stub_agent_toml("gemini", ["gemini", "--experimental-acp"], "fs = false\n")
        + stub_agent_toml("claude", ["claude-agent-acp"], "fs = true\n"),
    )
    listed = run_cli(tmp_path, "agents")
    assert listed.stdout.splitlines() == [
        f"agents in {config}:",
        "  gemini  gemini --experimental-acp  (fs off: no fs/* offered)",
        "  claude  claude-agent-acp",
    ]
    agents = run_cli(tmp_path, "agents", "--json").json()["agents"]
    assert [(agent["name"], agent["fs"]) for agent in agents] == [("gemini", False), ("claude", True)]


@pytest.mark.parametrize("value", ['"no"', "0", "[]"])
def test_an_fs_that_is_not_a_boolean_is_a_config_error_naming_the_key(tmp_path: Path, value: str) -> None:
    config = write_config(tmp_path / "subagent.toml", f'[agents.broken]\ncommand = "x"\nfs = {value}\n')
    done = run_cli(tmp_path, "run", "--agent", "broken", "-p", "hi")
    assert (done.status, done.stdout) == (2, "")
    assert f"{config}: agents.broken.fs: must be true or false, not " in done.stderr
