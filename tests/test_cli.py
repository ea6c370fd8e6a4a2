"""The `subagent` command line, run as a subprocess against stub-agent scenarios written per test.

Every run is bounded by a subprocess timeout, runs in a new session (so it has no controlling
terminal, like CI), with its own empty user config directory, and is checked afterwards for
processes left behind (the leak tag of `tests.leaks` is inherited by everything it spawns).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from subagent.testing import dump_scenario
from tests.leaks import (
    LEAK_TAG_VARIABLE,
    ProcessInfo,
    leaked_processes,
    live_group_members,
    process_info,
    process_is_gone,
)

pytestmark = pytest.mark.subprocess

ROOT: Final = Path(__file__).resolve().parent.parent
CLI: Final = [sys.executable, "-m", "subagent"]
STUB: Final = [sys.executable, "-m", "subagent.testing.stub_agent"]
BOUND: Final = 30.0  # seconds for one CLI run, start to exit, on a loaded machine
INTEROP_AGENT: Final = (
    ROOT / ".interop" / "node_modules" / "@agentclientprotocol" / "sdk" / "dist" / "examples" / "agent.js"
)

ASKING_TURN: Final = [
    {"step": "tool_call", "toolCallId": "call-1", "title": "Edit config.json", "kind": "edit",
     "rawInput": {"path": "config.json"}},
    {"step": "permission", "branches": {
        "allow": [{"step": "message", "text": "I edited config.json."}],
        "reject": [{"step": "message", "text": "I left config.json alone."}],
    }},
]  # fmt: skip


class _JournalId:
    """Equal to any run journal id (12 hex digits): the "journalId" of `--json`, which the CLI records every
    run in by default (in the test's own state directory: see tests/conftest.py)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and re.fullmatch(r"[0-9a-f]{12}", other) is not None

    __hash__ = None  # type: ignore[assignment]  # equal to many strings: no hash could agree

    def __repr__(self) -> str:
        return "<a journal id>"


JOURNAL_ID: Final = _JournalId()


@dataclass
class Finished:
    """A finished CLI run."""

    status: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        """stdout as exactly one JSON document."""
        return json.loads(self.stdout)

    def events(self) -> list[dict[str, Any]]:
        """Every stderr line, each parsed as one JSON object, its ``time`` checked (a number of seconds
        since the epoch, never going back) and taken out so the tests compare the rest exactly."""
        events = [json.loads(line) for line in self.stderr.splitlines()]
        times = [event.pop("time") for event in events]
        assert all(isinstance(when, float | int) and when > 1e9 for when in times), times
        assert times == sorted(times)
        return events


def cli_env(tmp_path: Path, extra: Mapping[str, str] | None = None) -> tuple[dict[str, str], str]:
    """An environment for the CLI: isolated user config, no colour forced either way, a leak tag."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg"), LEAK_TAG_VARIABLE: tag, **(extra or {})}
    env.pop("NO_COLOR", None)
    return env, tag


def run_cli(
    tmp_path: Path,
    *args: str,
    stdin: str = "",
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = BOUND,
) -> Finished:
    """Run the CLI to completion and check that nothing it started outlived it."""
    full_env, tag = cli_env(tmp_path, env)
    completed = subprocess.run(
        [*CLI, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd or tmp_path,
        env=full_env,
        timeout=timeout,
        start_new_session=True,  # no controlling terminal, whoever runs the tests
        check=False,
    )
    assert leaked_processes(tag) == []
    return Finished(completed.returncode, completed.stdout, completed.stderr)


def scenario(tmp_path: Path, data: Mapping[str, Any], name: str = "scenario.json") -> list[str]:
    """The stub agent's command line for ``data``, written to a file under ``tmp_path``."""
    path = tmp_path / name
    path.write_text(dump_scenario(data))
    return [*STUB, "--scenario", str(path)]


def one_turn(*steps: Mapping[str, Any]) -> dict[str, Any]:
    return {"turns": [list(steps)]}


class LiveCli:
    """A CLI process whose stderr lines can be awaited one by one, each wait bounded."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.env, self.tag = cli_env(tmp_path)
        self.process = subprocess.Popen(
            [*CLI, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=self.env,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr_seen: list[str] = []
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for_event(self, wanted: str, *, timeout: float = BOUND, **fields: Any) -> dict[str, Any]:
        """The next ``--events`` line of kind ``wanted`` whose members include ``fields``."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line is not None, f"stderr ended before a {wanted!r} event: {self.stderr_seen}"
            self.stderr_seen.append(line)
            event = json.loads(line)
            if event["event"] == wanted and all(event.get(key) == value for key, value in fields.items()):
                return dict(event)

    def finish(self, timeout: float = BOUND) -> Finished:
        """Wait for the exit; all of stdout, and stderr from where the waits left it."""
        assert self.process.stdout is not None
        self.process.wait(timeout=timeout)  # the outputs are small: no pipe fills up meanwhile
        stdout = self.process.stdout.read()
        self._reader.join(timeout=timeout)
        rest: list[str] = []
        while (line := self.lines.get_nowait()) is not None:
            rest.append(line)
        self.process.stdout.close()
        assert self.process.stderr is not None
        self.process.stderr.close()
        assert leaked_processes(self.tag) == []
        return Finished(self.process.returncode, stdout, "".join(self.stderr_seen + rest))

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=BOUND)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[list[LiveCli]]:
    """Started `LiveCli`s, killed (group and all) if a test fails before they exit."""
    started: list[LiveCli] = []
    yield started
    for cli in started:
        cli.kill()


def descendants_of(pid: int) -> list[ProcessInfo]:
    """Live processes below ``pid`` (children, their children, ...)."""
    live = [info for entry in os.listdir("/proc") if entry.isdigit() and (info := process_info(int(entry)))]
    found: list[ProcessInfo] = []
    parents = {pid}
    while True:
        below = [info for info in live if info.ppid in parents and not info.is_zombie and info not in found]
        if not below:
            return found
        found += below
        parents = {info.pid for info in below}


def agent_of(cli_pid: int) -> int:
    """The CLI's agent process: the deepest descendant leading its own process group (the agent may
    run under a supervisor, which is then the CLI's child and leads a group of its own)."""
    leaders = [info.pid for info in descendants_of(cli_pid) if info.pgrp == info.pid]
    assert len(leaders) in (1, 2), leaders  # the agent, and perhaps its supervisor above it
    return leaders[-1]  # found level by level: the deepest comes last


# -- run: output and exit status ------------------------------------------------------------------------


def test_json_prints_exactly_one_object_and_a_completed_turn_exits_0(tmp_path: Path) -> None:
    agent = scenario(
        tmp_path,
        one_turn(
            {"step": "message", "text": "Let me check."},
            {"step": "tool_call", "toolCallId": "call-1", "title": "Read notes.txt", "status": "completed"},
            {"step": "message", "text": "The answer is 42.", "chunks": 3},
            {"step": "stop", "usage": {"inputTokens": 10, "outputTokens": 5, "totalTokens": 15}},
        ),
    )
    done = run_cli(tmp_path, "run", "--json", "-p", "What is the answer?", "--", *agent)
    assert done.status == 0, done.stderr
    assert done.stdout.count("\n") == 1
    assert done.json() == {
        "output": "The answer is 42.",
        "stopReason": "completed",
        "error": None,
        "usage": {"inputTokens": 10, "outputTokens": 5, "totalTokens": 15},
        "journalId": JOURNAL_ID,
    }
    assert done.stderr == ""


def test_plain_output_is_the_final_message_alone_and_nothing_else_is_printed(tmp_path: Path) -> None:
    agent = scenario(
        tmp_path,
        one_turn(
            {"step": "message", "text": "Reading..."},
            {"step": "tool_call", "toolCallId": "call-1", "title": "Read", "status": "completed"},
            {"step": "message", "text": "Done: all good."},
        ),
    )
    done = run_cli(tmp_path, "run", "-p", "check", "--", *agent)
    assert (done.status, done.stdout, done.stderr) == (0, "Done: all good.\n", "")


@pytest.mark.parametrize(
    ("acp_reason", "stop_reason"),
    [("refusal", "refusal"), ("max_tokens", "max_tokens"), ("max_turn_requests", "max_turns")],
)
def test_a_turn_that_does_not_complete_exits_1_with_its_stop_reason(
    tmp_path: Path, acp_reason: str, stop_reason: str
) -> None:
    agent = scenario(
        tmp_path, one_turn({"step": "message", "text": "partial"}, {"step": "stop", "reason": acp_reason})
    )
    done = run_cli(tmp_path, "run", "--json", "-p", "go", "--", *agent)
    assert done.status == 1
    assert done.json() == {
        "output": "partial",
        "stopReason": stop_reason,
        "error": None,
        "usage": None,
        "journalId": JOURNAL_ID,
    }
    assert f"stop reason {stop_reason!r}" in done.stderr


def test_an_agent_crashing_mid_turn_is_an_error_result_with_its_status_and_stderr(tmp_path: Path) -> None:
    agent = scenario(
        tmp_path,
        one_turn(
            {"step": "message", "text": "half"},
            {"step": "exit", "code": 5, "stderr": "boom: out of memory\n"},
        ),
    )
    done = run_cli(tmp_path, "run", "--json", "-p", "go", "--", *agent)
    assert done.status == 1
    result = done.json()
    assert (result["stopReason"], result["output"]) == ("error", "half")
    assert "exited with status 5" in result["error"]
    assert "boom: out of memory" in result["error"]


def test_an_inactive_agent_times_out_with_status_1(tmp_path: Path) -> None:
    agent = scenario(tmp_path, one_turn({"step": "message", "text": "thinking"}, {"step": "wait_for_cancel"}))
    done = run_cli(tmp_path, "run", "--json", "--timeout", "0.5", "-p", "go", "--", *agent)
    assert done.status == 1
    result = done.json()
    assert result["stopReason"] == "timeout"
    assert "0.5 s" in result["error"]


# -- run: failures to start, bad usage -----------------------------------------------------------------


def test_a_missing_executable_exits_2_with_a_message_naming_it(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "run", "-p", "hi", "--", "no-such-agent-4711", "--flag")
    assert done.status == 2
    assert done.stdout == ""
    assert "the agent failed to start" in done.stderr
    assert "no-such-agent-4711" in done.stderr
    assert "not found" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_crash_at_initialize_exits_2_naming_the_command_its_status_and_stderr_tail(tmp_path: Path) -> None:
    agent = scenario(
        tmp_path,
        {"initialize": {"steps": [{"step": "exit", "code": 3, "stderr": "fatal: no API key configured\n"}]}},
        name="crashes.json",
    )
    done = run_cli(tmp_path, "run", "--json", "-p", "hi", "--", *agent)
    assert done.status == 2
    assert done.json()["stopReason"] == "error"
    paragraph = done.stderr.strip()
    assert paragraph.count("\n") == 0
    assert "crashes.json" in paragraph
    assert "exited with status 3" in paragraph
    assert "fatal: no API key configured" in paragraph


def test_an_agent_demanding_authentication_fails_to_start_until_an_auth_method_is_given(
    tmp_path: Path,
) -> None:
    agent = scenario(
        tmp_path,
        {"requireAuth": "api-key", "turns": [[{"step": "message", "text": "Authenticated."}]]},
    )
    refused = run_cli(tmp_path, "run", "-p", "hi", "--", *agent)
    assert refused.status == 2
    assert "authentication" in refused.stderr
    assert "'api-key'" in refused.stderr
    assert "--auth-method" in refused.stderr

    accepted = run_cli(tmp_path, "run", "--auth-method", "api-key", "-p", "hi", "--", *agent)
    assert (accepted.status, accepted.stdout) == (0, "Authenticated.\n")


@pytest.mark.parametrize("prompt_args", [["-p", "  \n"], []], ids=["blank -p", "empty stdin"])
def test_an_empty_prompt_is_a_usage_error(tmp_path: Path, prompt_args: list[str]) -> None:
    done = run_cli(tmp_path, "run", *prompt_args, "--", *STUB)
    assert (done.status, done.stdout) == (2, "")
    assert "the prompt is empty" in done.stderr
    assert done.stderr.startswith("usage: subagent run")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "-p", "hi"], "no agent to run"),
        (["run", "-p", "hi", "--agent", "stub", "--", *STUB], "not both"),
        (["run", "-p", "hi", "--agent", "stub"], "no config file found"),
        (["run", "-p", "hi", "--cwd", "/no/such/dir", "--", *STUB], "is not a directory"),
        (["run", "-p", "hi", "--timeout", "-1", "--", *STUB], "positive number of seconds"),
        (["run", "-p", "hi", "--json", "--progress", "--", *STUB], "cannot be combined"),
        (["run", "-p", "hi", "extra", "--", *STUB], "unrecognized arguments: extra"),
        (["demo", "--", *STUB], "takes no"),
        ([], "required"),
    ],
    ids=[
        "no command",
        "agent and command",
        "no config",
        "bad cwd",
        "bad timeout",
        "progress+json",
        "stray",
        "demo",
        "none",
    ],
)
def test_bad_usage_exits_2_with_usage_and_no_traceback(tmp_path: Path, args: list[str], message: str) -> None:
    done = run_cli(tmp_path, *args)
    assert (done.status, done.stdout) == (2, "")
    assert message in done.stderr
    assert "usage: subagent" in done.stderr
    assert "Traceback" not in done.stderr


def test_help_describes_the_commands_and_the_run_options(tmp_path: Path) -> None:
    top = run_cli(tmp_path, "--help")
    assert top.status == 0
    for word in ("run", "demo", "agents", "[agents.claude]"):
        assert word in top.stdout
    run = run_cli(tmp_path, "run", "--help")
    assert run.status == 0
    for word in (
        "--prompt",
        "--permission",
        "--timeout",
        "--json",
        "--events",
        "--agent",
        "--config",
        "exit status",
    ):
        assert word in run.stdout


# -- run: prompt, permission, events ---------------------------------------------------------------------


def test_the_prompt_is_read_from_stdin_when_no_prompt_option_is_given(tmp_path: Path) -> None:
    agent = scenario(tmp_path, one_turn({"step": "echo", "prefix": "you said: "}))
    done = run_cli(tmp_path, "run", "--", *agent, stdin="hello from a pipe")
    assert (done.status, done.stdout) == (0, "you said: hello from a pipe\n")


@pytest.mark.parametrize(
    ("permission", "answer"), [("deny", "I left config.json alone."), ("allow", "I edited config.json.")]
)
def test_a_permission_policy_answers_the_agents_question(
    tmp_path: Path, permission: str, answer: str
) -> None:
    agent = scenario(tmp_path, one_turn(*ASKING_TURN))
    done = run_cli(tmp_path, "run", "--json", "--permission", permission, "-p", "edit it", "--", *agent)
    assert done.status == 0
    assert done.json()["output"] == answer


def test_without_a_terminal_the_default_permission_is_deny(tmp_path: Path) -> None:
    agent = scenario(tmp_path, one_turn(*ASKING_TURN))
    done = run_cli(tmp_path, "run", "-p", "edit it", "--", *agent, stdin="1\n")
    assert (done.status, done.stdout) == (0, "I left config.json alone.\n")
    assert "permission requested" not in done.stderr


@pytest.mark.parametrize(
    ("typed", "answer", "reason"),
    [
        ("1\n", "I edited config.json.", "allowed (your choice)"),
        ("y\n", "I edited config.json.", "allowed (your choice)"),
        ("reject\n", "I left config.json alone.", "rejected (your choice)"),
        ("maybe\n", "I left config.json alone.", "rejected (not a choice: 'maybe')"),
        ("", "I left config.json alone.", "rejected (end of input on stdin)"),
    ],
    ids=["number", "yes", "option id", "invalid", "eof"],
)
def test_ask_shows_the_question_and_reads_the_choice_from_stdin_after_a_prompt_option(
    tmp_path: Path, typed: str, answer: str, reason: str
) -> None:
    agent = scenario(tmp_path, one_turn(*ASKING_TURN))
    done = run_cli(tmp_path, "run", "--permission", "ask", "-p", "edit it", "--", *agent, stdin=typed)
    assert (done.status, done.stdout) == (0, answer + "\n")
    assert "permission requested: Edit config.json (edit)" in done.stderr
    assert 'input: {"path": "config.json"}' in done.stderr
    assert "1) Allow  [allow_once]" in done.stderr
    assert "2) Reject  [reject_once]" in done.stderr
    assert f"permission: Edit config.json -> {reason}" in done.stderr


def test_ask_with_the_prompt_on_stdin_and_no_terminal_rejects_at_once(tmp_path: Path) -> None:
    agent = scenario(tmp_path, one_turn(*ASKING_TURN))
    done = run_cli(tmp_path, "run", "--permission", "ask", "--", *agent, stdin="edit it")
    assert (done.status, done.stdout) == (0, "I left config.json alone.\n")
    assert "permission: Edit config.json -> rejected (no terminal to ask on)" in done.stderr


def test_events_are_json_lines_in_order_and_stdout_keeps_only_the_json_result(tmp_path: Path) -> None:
    agent = scenario(
        tmp_path,
        one_turn(
            {"step": "message", "text": "Planning."},
            {"step": "plan", "entries": [{"content": "Edit the config", "status": "in_progress"}]},
            *ASKING_TURN,
            {"step": "tool_call_update", "toolCallId": "call-1", "status": "completed"},
            {"step": "update", "update": {"sessionUpdate": "something_new", "detail": 1}},
            {"step": "message", "text": "All set."},
            {"step": "stop", "reason": "end_turn"},
        ),
    )
    done = run_cli(tmp_path, "run", "--json", "--events", "--permission", "allow", "-p", "go", "--", *agent)
    assert done.status == 0
    assert done.json()["output"] == "All set."
    events = done.events()
    kinds = [event["event"] for event in events]
    assert kinds == ["spawn", "start", *["update"] * 3, "permission", *["update"] * 4, "end"]
    assert events[0]["command"] == agent
    assert events[1]["sessionId"] == "session-1"
    assert events[1]["protocolVersion"] == 1
    updates = [event["update"] for event in events if event["event"] == "update"]
    assert all(event["sessionId"] == "session-1" for event in events if event["event"] == "update")
    assert [update["sessionUpdate"] for update in updates] == [
        "agent_message_chunk",
        "plan",
        "tool_call",
        "agent_message_chunk",
        "tool_call_update",
        "something_new",
        "agent_message_chunk",
    ]
    assert updates[2] == {
        "sessionUpdate": "tool_call",
        "toolCallId": "call-1",
        "title": "Edit config.json",
        "kind": "edit",
        "rawInput": {"path": "config.json"},
    }
    assert updates[5] == {"sessionUpdate": "something_new", "detail": 1}
    permission = events[5]
    assert permission["outcome"] == "selected"
    assert permission["option"] == {"optionId": "allow", "name": "Allow", "kind": "allow_once"}
    assert (permission["title"], permission["reason"]) == ("Edit config.json", "--permission allow")
    assert events[-1]["stopReason"] == "completed"


NOTICE_AND_COMPACTION_TURN: Final = one_turn(
    {"step": "message", "text": "Half "},
    {"step": "update", "update": {"sessionUpdate": "notice", "severity": "warning", "title": "Rate limited",
                                  "description": "Retrying\nin \u001b[1m30 s."}},
    {"step": "update", "update": {"sessionUpdate": "compaction_update", "compactionId": "k1",
                                  "status": "in_progress"}},
    {"step": "update", "update": {"sessionUpdate": "compaction_summary_chunk", "compactionId": "k1",
                                  "content": {"type": "text", "text": "SUMMARY"}}},
    {"step": "update", "update": {"sessionUpdate": "compaction_update", "compactionId": "k1",
                                  "status": "completed"}},
    {"step": "message", "text": "done."},
)  # fmt: skip


def test_a_notice_is_one_progress_line_and_a_compaction_summary_is_not_part_of_the_answer(
    tmp_path: Path,
) -> None:
    agent = scenario(tmp_path, NOTICE_AND_COMPACTION_TURN)
    done = run_cli(tmp_path, "run", "--progress", "-p", "go", "--", *agent)
    assert (done.status, done.stdout) == (0, "Half done.\n")
    lines = done.stderr.splitlines()
    assert "  notice (warning): Rate limited - Retrying in [1m30 s." in lines
    assert [line for line in lines if "compaction" in line] == [
        "  context compaction: in_progress",
        "  context compaction: completed",
    ]
    assert "SUMMARY" not in done.stderr


def test_events_carry_a_notice_and_a_compaction_as_update_lines(tmp_path: Path) -> None:
    agent = scenario(tmp_path, NOTICE_AND_COMPACTION_TURN)
    done = run_cli(tmp_path, "run", "--json", "--events", "-p", "go", "--", *agent)
    assert done.status == 0
    assert done.json()["output"] == "Half done."
    updates = [event["update"] for event in done.events() if event["event"] == "update"]
    assert updates[1:5] == [step["update"] for step in NOTICE_AND_COMPACTION_TURN["turns"][0][1:5]]


def test_verbose_logs_to_stderr_as_text_or_as_log_events(tmp_path: Path) -> None:
    agent = scenario(tmp_path, one_turn({"step": "message", "text": "ok"}))
    text = run_cli(tmp_path, "run", "-v", "-p", "hi", "--", *agent)
    assert (text.status, text.stdout) == (0, "ok\n")
    assert "subagent: info: subagent.cli._turn: turn ended: completed in " in text.stderr
    events = run_cli(tmp_path, "-v", "run", "--events", "-p", "hi", "--", *agent).events()
    logs = [event for event in events if event["event"] == "log"]
    assert logs
    assert logs[-1]["level"] == "info"
    assert logs[-1]["logger"] == "subagent.cli._turn"
    assert logs[-1]["message"].startswith("turn ended: completed in ")


def test_progress_can_be_forced_off_a_terminal_and_then_has_no_colour(tmp_path: Path) -> None:
    agent = scenario(
        tmp_path,
        one_turn(
            {"step": "message", "text": "Hello."},
            {"step": "thought", "text": "hmm"},
            *ASKING_TURN,
            {"step": "tool_call_update", "toolCallId": "call-1", "status": "completed"},
            {"step": "message", "text": "\x1b[31mred?\x1b[0m"},
        ),
    )
    done = run_cli(tmp_path, "run", "--progress", "--permission", "deny", "-p", "go", "--", *agent)
    assert done.status == 0
    assert "\x1b" not in done.stderr
    lines = done.stderr.splitlines()
    assert "Hello." in lines
    assert "  thinking: hmm" in lines
    assert "  tool Edit config.json (edit): pending" in lines
    assert "  permission: Edit config.json -> rejected (--permission deny)" in lines
    assert "  tool Edit config.json (edit): completed" in lines
    assert "[31mred?[0m" in lines
    assert lines[-1].startswith("done: completed in ")
    assert done.stdout == "\x1b[31mred?\x1b[0m\n"  # stdout is the agent's answer, untouched


# -- run --agent and the config ----------------------------------------------------------------------------


def write_config(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def stub_agent_toml(name: str, agent: list[str], extra: str = "") -> str:
    return f"[agents.{name}]\ncommand = {json.dumps(agent[0])}\nargs = {json.dumps(agent[1:])}\n{extra}"


def test_agent_takes_command_and_defaults_from_subagent_toml_and_options_override(tmp_path: Path) -> None:
    agent = scenario(tmp_path, one_turn(*ASKING_TURN))
    write_config(tmp_path / "subagent.toml", stub_agent_toml("stub", agent, 'permission = "allow"\n'))
    configured = run_cli(tmp_path, "run", "--agent", "stub", "-p", "edit it")
    assert (configured.status, configured.stdout) == (0, "I edited config.json.\n")
    overridden = run_cli(tmp_path, "run", "--agent", "stub", "--permission", "deny", "-p", "edit it")
    assert (overridden.status, overridden.stdout) == (0, "I left config.json alone.\n")


def test_agent_env_and_cwd_come_from_the_config(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("from the configured cwd")
    scenario(tmp_path, one_turn({"step": "read_file", "path": str(tmp_path / "work" / "notes.txt")}))
    # The scenario's path reaches the agent only through the configured environment.
    launcher = ["sh", "-c", 'exec "$0" -m subagent.testing.stub_agent --scenario "$SCENARIO"', sys.executable]
    extra = f'cwd = "../work"\nenv = {{ SCENARIO = {json.dumps(str(tmp_path / "scenario.json"))} }}\n'
    config = write_config(tmp_path / "elsewhere" / "agents.toml", stub_agent_toml("reader", launcher, extra))
    done = run_cli(tmp_path, "run", "--config", str(config), "--agent", "reader", "--json", "-p", "read")
    assert done.status == 0, done.stderr
    report = json.loads(done.json()["output"])
    assert report["result"]["content"] == "from the configured cwd"  # inside the cwd, the only fs root


def test_agent_is_found_in_the_user_config_directory(tmp_path: Path) -> None:
    agent = scenario(tmp_path, one_turn({"step": "message", "text": "from the user config"}))
    write_config(tmp_path / "xdg" / "subagent" / "config.toml", stub_agent_toml("mine", agent))
    done = run_cli(tmp_path, "run", "--agent", "mine", "-p", "hi")
    assert (done.status, done.stdout) == (0, "from the user config\n")


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('[agents.broken]\ncommand = "x"\nargs = "not a list"\n', "agents.broken.args"),
        ('[agents.broken]\ncomand = "x"\n', "agents.broken.comand"),
        ('[agents.broken]\nargs = ["x"]\n', "agents.broken.command"),
        ('[agents.broken]\ncommand = "x"\nargs = ["ok", 3]\n', "agents.broken.args[1]"),
        ('[agents.broken]\ncommand = "x"\npermission = "maybe"\n', "agents.broken.permission"),
        ('[agents.broken]\ncommand = "x"\ntimeout = 0\n', "agents.broken.timeout"),
        ('[agents.broken]\ncommand = "x"\nenv = { A = 1 }\n', "agents.broken.env.A"),
        ("[agent.typo]\n", "agent"),
        ("[agents.broken\n", "not valid TOML"),
    ],
)
def test_an_invalid_config_exits_2_naming_the_file_and_the_key(tmp_path: Path, toml: str, key: str) -> None:
    config = write_config(tmp_path / "subagent.toml", toml)
    done = run_cli(tmp_path, "run", "--agent", "broken", "-p", "hi")
    assert (done.status, done.stdout) == (2, "")
    assert f"{config}: {key}" in done.stderr or (key in done.stderr and str(config) in done.stderr)
    assert "Traceback" not in done.stderr


# What no process could receive: TOML writes a NUL as "\u0000" (the test's TOML text holds the escape).
UNEXECUTABLE_AGENTS: Final = [
    ('command = "ag\\u0000ent"\n', "agents.broken.command: contains a NUL character"),
    ('command = "x"\nargs = ["ok", "a\\u0000b"]\n', "agents.broken.args[1]: contains a NUL character"),
    (
        'command = "x"\nenv = { TOKEN = "se\\u0000cret" }\n',
        "agents.broken.env.TOKEN: contains a NUL character",
    ),
    (
        'command = "x"\nenv = { "A=B" = "1" }\n',
        'agents.broken.env."A=B": an environment name must be non-empty',
    ),
    ('command = "x"\nenv = { "" = "1" }\n', 'agents.broken.env."": an environment name must be non-empty'),
    ('command = "x"\nenv = { "A\\u0000" = "1" }\n', r'agents.broken.env."A\u0000": an environment name'),
    ('command = "x"\ncwd = "/tmp/a\\u0000b"\n', "agents.broken.cwd: contains a NUL character"),
]


@pytest.mark.parametrize(("agent", "message"), UNEXECUTABLE_AGENTS)
def test_config_that_cannot_be_executed_is_a_config_error_with_exit_2(
    tmp_path: Path, agent: str, message: str
) -> None:
    config = write_config(tmp_path / "subagent.toml", f"[agents.broken]\n{agent}")
    done = run_cli(tmp_path, "run", "--agent", "broken", "-p", "hi")
    assert (done.status, done.stdout) == (2, "")
    assert done.stderr.startswith(f"subagent: invalid config: {config}: {message}")
    assert "Traceback" not in done.stderr
    assert "cret" not in done.stderr  # a value is never repeated: it may be a secret


@pytest.mark.parametrize(
    "nested",
    ["[" * 1000 + "]" * 1000, "{ a = " * 1000 + "1" + " }" * 1000],
    ids=["arrays", "inline-tables"],
)
def test_a_config_nested_hundreds_of_levels_deep_is_a_config_error_not_a_traceback(
    tmp_path: Path, nested: str
) -> None:
    config = write_config(tmp_path / "subagent.toml", f'[agents.deep]\ncommand = "x"\nargs = {nested}\n')
    for args in (["run", "--agent", "deep", "-p", "hi"], ["agents"]):
        done = run_cli(tmp_path, *args)
        assert (done.status, done.stdout) == (2, "")
        assert done.stderr == (
            f"subagent: invalid config: {config}: not valid TOML: arrays or tables nested too deeply\n"
        )


def test_a_config_file_over_1_mib_is_a_config_error(tmp_path: Path) -> None:
    config = write_config(tmp_path / "subagent.toml", "# padding\n" * 110_000)
    done = run_cli(tmp_path, "run", "--agent", "any", "-p", "hi")
    assert (done.status, done.stdout) == (2, "")
    assert done.stderr == f"subagent: invalid config: {config}: the config file is larger than 1 MiB\n"


SERVE_SCRIPT: Final = ["Nothing to see."]


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        # Read no further than the limit: a byte of input is at least a byte of the message.
        (
            "x" * (65 * 1024 * 1024),
            "the prompt on stdin is more than 67,108,864 bytes, over the 67,108,864-byte (64 MiB) "
            "limit on one message to the agent (max_line_bytes)",
        ),
        # Under the limit as read, over it as JSON: a quote is sent as two bytes.
        (
            '"' * (33 * 1024 * 1024),
            f"the prompt is {66 * 1024 * 1024 + 113:,} bytes as a session/prompt message, over the "
            "67,108,864-byte (64 MiB) limit on one message to the agent (max_line_bytes)",
        ),
    ],
    ids=["as-read", "as-json"],
)
def test_a_prompt_over_the_message_limit_exits_2_naming_it_before_any_agent_starts(
    tmp_path: Path, prompt: str, message: str
) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SERVE_SCRIPT))
    started = tmp_path / "started"
    # The agent is `subagent serve` behind a shell that leaves a mark if it is ever started.
    agent = [
        "sh",
        "-c",
        f'touch "{started}"; exec "$0" -m subagent serve --script "$1"',
        sys.executable,
        str(script),
    ]
    done = run_cli(tmp_path, "run", "--", *agent, stdin=prompt)  # no --timeout: nothing may wait
    assert (done.status, done.stdout, done.stderr) == (2, "", f"subagent: {message}\n")
    assert not started.exists()
    # The same agent takes a prompt under the limit.
    ok = run_cli(tmp_path, "run", "--", *agent, stdin="hello")
    assert (ok.status, ok.stdout) == (0, "Nothing to see.\n")
    assert started.exists()


def test_an_unknown_agent_exits_2_listing_the_configured_ones(tmp_path: Path) -> None:
    write_config(tmp_path / "subagent.toml", stub_agent_toml("alpha", STUB) + stub_agent_toml("beta", STUB))
    done = run_cli(tmp_path, "run", "--agent", "gamma", "-p", "hi")
    assert done.status == 2
    assert "no agent named 'gamma'" in done.stderr
    assert "configured: alpha, beta" in done.stderr


def test_agents_lists_name_command_line_and_source(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "subagent.toml",
        stub_agent_toml(
            "stub", ["python3", "-m", "subagent.testing.stub_agent"], 'description = "The stub"\n'
        )
        + stub_agent_toml("claude", ["npx", "-y", "@agentclientprotocol/claude-agent-acp"]),
    )
    listed = run_cli(tmp_path, "agents")
    assert listed.status == 0
    assert listed.stdout.splitlines() == [
        f"agents in {config}:",
        "  stub    python3 -m subagent.testing.stub_agent",
        "          The stub",
        "  claude  npx -y @agentclientprotocol/claude-agent-acp",
    ]
    as_json = run_cli(tmp_path, "agents", "--json").json()
    assert as_json["config"] == str(config)
    assert as_json["agents"] == [
        {
            "name": "stub",
            "command": ["python3", "-m", "subagent.testing.stub_agent"],
            "description": "The stub",
            "fs": True,
            "transport": "local",
            "source": str(config),
        },
        {
            "name": "claude",
            "command": ["npx", "-y", "@agentclientprotocol/claude-agent-acp"],
            "description": None,
            "fs": True,
            "transport": "local",
            "source": str(config),
        },
    ]


def test_agents_with_none_configured_says_where_it_looked(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "agents")
    assert done.status == 0
    assert "no agents configured" in done.stdout
    assert str(tmp_path / "subagent.toml") in done.stdout
    assert str(tmp_path / "xdg" / "subagent" / "config.toml") in done.stdout
    as_json = run_cli(tmp_path, "agents", "--json").json()
    assert as_json == {
        "config": None,
        "searched": [str(tmp_path / "subagent.toml"), str(tmp_path / "xdg" / "subagent" / "config.toml")],
        "agents": [],
    }


# -- demo ------------------------------------------------------------------------------------------------


_STUB_ANSWER = (
    "Permission granted: I wrote the summary to SUMMARY.md. Summary: a project that does useful things."
)
_DELEGATION_REPORT = (
    "Report:\n"
    "- fork: Review (fork, plan seen): biggest risk: the suite runs only two days before the tag.\n"
    '- spawn: {"todos": 3}\n'
    f"- acp: {_STUB_ANSWER}"
)


def test_demo_completes_unattended_and_prints_the_stub_agents_answer_then_the_delegation_report(
    tmp_path: Path,
) -> None:
    done = run_cli(tmp_path, "demo")
    assert done.status == 0, done.stderr
    assert done.stdout == f"{_STUB_ANSWER}\n{_DELEGATION_REPORT}\n"
    assert "subagent demo: an in-process agent delegates to fork, spawn and acp at once" in done.stderr


def test_the_acp_part_of_the_demo_alone_prints_the_stub_agents_final_answer(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "demo", "--only", "acp")
    assert done.status == 0, done.stderr
    assert done.stdout == f"{_STUB_ANSWER}\n"
    assert "  permission: Write SUMMARY.md -> allowed (demo)" in done.stderr.splitlines()
    assert "  tool Read README.md (read): completed" in done.stderr.splitlines()
    assert "subagent run -- npx @agentclientprotocol/claude-agent-acp" in done.stderr
    assert "delegates" not in done.stderr


def test_the_delegation_demo_runs_fork_spawn_and_acp_children_at_once_and_reports_each(
    tmp_path: Path,
) -> None:
    done = run_cli(tmp_path, "demo", "--only", "delegation")
    assert done.status == 0, done.stderr
    assert done.stdout == f"{_DELEGATION_REPORT}\n"
    lines = done.stderr.splitlines()
    # The fork inherits the root's tools and sees its plan; the spawned child has only what its filter
    # allowed; the ACP child is a process.
    assert "  fork-" in next(
        line for line in lines if "(fork; in-process, depth 1, tools: subagent, read_notes)" in line
    )
    assert any("(spawn; in-process, depth 1, tools: read_notes)" in line for line in lines)
    assert any("(acp; child process): Summarise README.md." in line for line in lines)
    assert sum(" completed: " in line for line in lines) == 3


def test_the_delegation_demo_prints_one_json_object_with_json(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "demo", "--only", "delegation", "--json")
    assert done.status == 0, done.stderr
    assert json.loads(done.stdout) == {
        "output": _DELEGATION_REPORT,
        "stopReason": "completed",
        "error": None,
        "usage": None,
    }


# -- interrupts ------------------------------------------------------------------------------------------


def test_sigint_cancels_the_turn_exits_1_and_leaves_no_agent_process(
    tmp_path: Path, live: list[LiveCli]
) -> None:
    pid_file = tmp_path / "grandchild.pid"
    agent = scenario(
        tmp_path,
        one_turn(
            {"step": "grandchild", "pidFile": str(pid_file), "ignoreSigterm": False, "report": False},
            {"step": "message", "text": "working..."},
            {"step": "wait_for_cancel"},
        ),
    )
    cli = LiveCli(tmp_path, "run", "--json", "--events", "-p", "work", "--", *agent)
    live.append(cli)
    cli.wait_for_event("update")  # the turn is under way
    grandchild = int(pid_file.read_text())
    info = process_info(grandchild)
    assert info is not None
    agent_pid = info.pgrp  # the agent leads its own process group
    assert agent_of(cli.process.pid) == agent_pid

    cli.process.send_signal(signal.SIGINT)
    done = cli.finish()

    assert done.status == 1
    assert done.json() == {
        "output": "working...",
        "stopReason": "cancelled",
        "error": None,
        "usage": None,
        "journalId": JOURNAL_ID,
    }
    events = done.events()
    assert {"event": "interrupt", "signal": "SIGINT", "count": 1, "action": "cancel"} in events
    assert events[-1]["event"] == "end"
    assert events[-1]["stopReason"] == "cancelled"
    assert process_is_gone(agent_pid)
    assert process_is_gone(grandchild)
    assert live_group_members(agent_pid) == []


def stubborn_agent(tmp_path: Path, pid_file: Path) -> list[str]:
    """A stub agent that ignores session/cancel, stdin EOF and SIGTERM, with a grandchild that ignores
    SIGTERM too: only SIGKILL ends it, so every grace of a graceful teardown runs out in full."""
    return scenario(
        tmp_path,
        {
            "onStdinEof": "ignore",
            "ignoreSigterm": True,
            "turns": [
                [
                    {"step": "grandchild", "pidFile": str(pid_file), "report": False},
                    {"step": "message", "text": "working..."},
                    {"step": "wait_for_cancel", "then": "continue"},
                    {"step": "message", "text": " still working"},
                    {"step": "hang"},
                ]
            ],
        },
    )


def cancelled_stubborn_run(tmp_path: Path, live: list[LiveCli]) -> tuple[LiveCli, list[int]]:
    """`subagent run` on `stubborn_agent`, its first chunk seen and a first SIGINT's cancel sent; the CLI and
    the agent's pids (the agent's and its grandchild's)."""
    pid_file = tmp_path / "grandchild.pid"
    cli = LiveCli(
        tmp_path, "run", "--json", "--events", "-p", "work", "--", *stubborn_agent(tmp_path, pid_file)
    )
    live.append(cli)
    cli.wait_for_event("update")
    pids = [agent_of(cli.process.pid), int(pid_file.read_text())]
    cli.process.send_signal(signal.SIGINT)
    cli.wait_for_event("interrupt", count=1, action="cancel")
    return cli, pids


def assert_killed_at_once(
    done: Finished,
    pids: list[int],
    error: str = "the agent was torn down at once on a second SIGINT",
) -> None:
    """The CLI exited 1 after a second SIGINT, with every agent process gone as it exited, and the
    teardown never waited out its graces (it would log that it had to send SIGKILL)."""
    assert done.status == 1
    result = done.json()
    assert (result["stopReason"], result["error"]) == ("cancelled", error)
    events = done.events()
    assert {"event": "interrupt", "signal": "SIGINT", "count": 2, "action": "stop"} in events
    assert [pid for pid in pids if not process_is_gone(pid)] == []
    assert [pid for pid in pids if live_group_members(pid)] == []
    graces = [e["message"] for e in events if e["event"] == "log" and "sending SIG" in e["message"]]
    assert graces == []
    assert "Traceback" not in done.stderr


def test_a_second_sigint_kills_an_agent_that_ignores_cancel_eof_and_sigterm_at_once(
    tmp_path: Path, live: list[LiveCli]
) -> None:
    cli, pids = cancelled_stubborn_run(tmp_path, live)
    cli.wait_for_event("update")  # the agent went on after session/cancel: the cancel grace runs
    cli.process.send_signal(signal.SIGINT)
    done = cli.finish()

    assert done.json()["output"] == "working... still working"
    assert_killed_at_once(done, pids)


def test_a_second_sigint_kills_the_agent_at_once_while_its_teardown_waits_out_a_grace(
    tmp_path: Path, live: list[LiveCli]
) -> None:
    cli, pids = cancelled_stubborn_run(tmp_path, live)
    # The cancel grace ran out: the graceful teardown has begun (stdin closed, its grace running).
    teardown = cli.wait_for_event("log", level="warning")
    assert "tearing it down" in teardown["message"]
    cli.process.send_signal(signal.SIGINT)
    done = cli.finish()

    assert_killed_at_once(done, pids, error="the agent ignored session/cancel and was torn down")


def test_sigterm_tears_the_agent_down_and_exits_1(tmp_path: Path, live: list[LiveCli]) -> None:
    agent = scenario(tmp_path, one_turn({"step": "message", "text": "working..."}, {"step": "hang"}))
    cli = LiveCli(tmp_path, "run", "--json", "--events", "-p", "work", "--", *agent)
    live.append(cli)
    cli.wait_for_event("update")
    agent_pid = agent_of(cli.process.pid)
    cli.process.send_signal(signal.SIGTERM)
    done = cli.finish()
    assert done.status == 1
    assert done.json() == {
        "output": "working...",
        "stopReason": "cancelled",
        "error": "the agent was torn down at once on SIGTERM",
        "usage": None,
        "journalId": JOURNAL_ID,
    }
    assert {"event": "interrupt", "signal": "SIGTERM", "count": 1, "action": "stop"} in done.events()
    assert process_is_gone(agent_pid)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_or_sighup_kills_an_agent_that_ignores_eof_and_sigterm_and_its_grandchild_at_once(
    tmp_path: Path, live: list[LiveCli], signum: signal.Signals
) -> None:
    pid_file = tmp_path / "grandchild.pid"
    argv = ["run", "--json", "--events", "-p", "work", "--", *stubborn_agent(tmp_path, pid_file)]
    cli = LiveCli(tmp_path, *argv)
    live.append(cli)
    cli.wait_for_event("update")
    pids = [agent_of(cli.process.pid), int(pid_file.read_text())]
    cli.process.send_signal(signum)
    done = cli.finish()

    assert done.status == 1
    assert done.json() == {
        "output": "working...",
        "stopReason": "cancelled",
        "error": f"the agent was torn down at once on {signum.name}",
        "usage": None,
        "journalId": JOURNAL_ID,
    }
    events = done.events()
    assert {"event": "interrupt", "signal": signum.name, "count": 1, "action": "stop"} in events
    assert events[-1]["event"] == "end"
    # Everything of the agent was gone when the CLI exited: the agent, its grandchild, their group.
    assert [pid for pid in pids if not process_is_gone(pid)] == []
    assert [pid for pid in pids if live_group_members(pid)] == []
    # No grace was waited out: a graceful teardown of this agent would log that it had to send SIGKILL.
    graces = [e["message"] for e in events if e["event"] == "log" and "sending SIG" in e["message"]]
    assert graces == []
    assert "Traceback" not in done.stderr


def test_sigint_before_the_agent_is_ready_abandons_the_start_and_exits_1(
    tmp_path: Path, live: list[LiveCli]
) -> None:
    agent = scenario(tmp_path, {"initialize": {"steps": [{"step": "sleep", "seconds": 60}]}})
    cli = LiveCli(tmp_path, "run", "--json", "--events", "-p", "work", "--", *agent)
    live.append(cli)
    cli.wait_for_event("spawn")
    cli.process.send_signal(signal.SIGINT)
    done = cli.finish()
    assert done.status == 1
    assert done.json() == {
        "output": "",
        "stopReason": "cancelled",
        "error": "interrupted before the agent was ready",
        "usage": None,
        "journalId": JOURNAL_ID,
    }
    assert [event["event"] for event in done.events()] == ["spawn", "interrupt", "end"]


# -- interop ---------------------------------------------------------------------------------------------


def test_run_drives_the_typescript_sdks_example_agent_to_completed(tmp_path: Path) -> None:
    node = subprocess.run(["which", "node"], capture_output=True, text=True, check=False).stdout.strip()
    if not node or not INTEROP_AGENT.is_file():
        reason = f"the TypeScript example agent is not installed (run `make interop`): {INTEROP_AGENT}"
        if os.environ.get("SUBAGENT_REQUIRE_INTEROP"):
            pytest.fail(reason)
        pytest.skip(reason)
    done = run_cli(
        tmp_path,
        "run",
        "--json",
        "--permission",
        "allow",
        "-p",
        "Please update the database host in config.json",
        "--",
        node,
        str(INTEROP_AGENT),
    )
    assert done.status == 0, done.stderr
    result = done.json()
    assert result["stopReason"] == "completed"
    assert result["output"] == (
        " Perfect! I've successfully updated the configuration. The changes have been applied."
    )
