"""The command line's run journal: every run of `run` and `demo` recorded (which journal: --journal,
--no-journal, SUBAGENT_JOURNAL, the config's `journal`, the default under XDG_STATE_HOME), `subagent runs`
and `runs show` listing it, interrupted runs reported once, and `subagent resume` continuing a run whose
CLI was SIGKILLed mid-turn.

The CLI runs as a subprocess against stub-agent scenarios (`tests.test_cli`); journals with runs of known
times are made with the journal's own API, their times then set in the file. The autouse fixture of
`tests/conftest.py` gives every test a state directory of its own, which the CLI inherits.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import pytest

from subagent._journaling import DEFAULT_RESUME_PROMPT
from subagent.cli._config import load_config
from subagent.cli._turn import CLI_META_KEY
from subagent.journal import SCHEMA_VERSION, RunJournal, default_journal_path
from tests.leaks import leaked_processes
from tests.test_cli import BOUND, LiveCli, cli_env, live, one_turn, run_cli, scenario

__all__ = ["live"]  # the fixture, used by name

pytestmark = pytest.mark.subprocess

T0: Final = datetime.datetime(2025, 1, 31, 14, 0, 0).timestamp()
"""14:00 local time, 2025-01-31: when the first run of a made journal started."""
DAY: Final = "2025-01-31"
MIGRATE: Final = "Migrate the database to version 2"
HEADER: Final = "ID        STATE        STOP       PROVIDER  STARTED              DURATION  TURNS  PROMPT"
ACP_AGENT: Final = {"command": ["acp-agent", "--flag"], "transport": "local", "cwd": "/work"}
RECORD_KEYS: Final = {
    "id", "runId", "provider", "state", "parent", "parentId", "prompt", "promptChars", "turnPrompt",
    "request", "agent", "sessionId", "turns", "stopReason", "output", "structured", "error", "usage",
    "spent", "progress", "createdAt", "updatedAt", "endedAt", "owner", "resumes",
}  # fmt: skip
NO_CLI_SETTINGS: Final[dict[str, Any]] = {
    "agent": None, "config": None, "permission": None, "fs": True, "subagents": True, "mode": None,
    "configOptions": {}, "authMethod": None, "readyTimeout": None, "reportsUsage": None, "sshConfig": None,
    "sshOptions": [],
}  # fmt: skip
"""What a run of `subagent run -- COMMAND` with no options keeps of how the CLI ran it."""


def default_journal() -> Path:
    """The journal the CLI keeps by default: under this test's own XDG_STATE_HOME."""
    return Path(os.environ["XDG_STATE_HOME"]) / "subagent" / "runs.db"


def listed(tmp_path: Path, *args: str, env: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """`subagent runs --json ARGS`: the records, checked to be what a listing prints and nothing more."""
    done = run_cli(tmp_path, "runs", "--json", *args, env=env)
    assert (done.status, done.stderr) == (0, ""), done.stderr
    records: list[dict[str, Any]] = done.json()
    return records


def local(when: float, *, fraction: bool = False) -> str:
    text = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
    return f"{text}.{int(when % 1 * 1000):03d}" if fraction else text


@contextlib.contextmanager
def raw(path: Path) -> Any:
    """A plain SQLite connection to a journal, for a test to set what the journal's API does not (times)."""
    with contextlib.closing(sqlite3.connect(path)) as connection:
        yield connection
        connection.commit()


def add_run(
    journal: RunJournal,
    id: str,
    prompt: str,
    *,
    provider: str = "acp",
    parent: str | None = None,
    state: str = "ended",
    stop: str | None = "completed",
    started: float = T0,
    seconds: float = 3.5,
    agent: Mapping[str, Any] | None = ACP_AGENT,
    request: Mapping[str, Any] | None = None,
) -> None:
    """Record a run whose last turn ended (or failed) with the journal's API, then set its times."""
    journal.record_start(
        id,
        run_id=f"{provider}-1",
        provider=provider,
        parent=parent,
        parent_id=parent,
        prompt=prompt,
        request=request or {"cwd": "/work"},
        agent=agent,
    )
    journal.record_running(id, session_id="session-1", checkpoint={"sessionId": "session-1", "cwd": "/work"})
    journal.record_turn(
        id,
        stop_reason=stop,
        output="done" if stop else None,
        structured=None,
        error=None if stop else "it broke",
        usage=None,
        checkpoint=None,
        state="failed" if state == "failed" else "ended",
    )
    assert journal.flush(BOUND)
    with raw(journal.path) as connection:
        connection.execute(
            "UPDATE runs SET state = ?, created_at = ?, updated_at = ?, ended_at = ? WHERE id = ?",
            (state, started, started + seconds, None if state == "interrupted" else started + seconds, id),
        )


@pytest.fixture(autouse=True)
def _no_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """No width from the environment (xdist's workers set COLUMNS=80): a listing piped is not cut."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture
def made(tmp_path: Path) -> Path:
    """A journal at the default path with five runs of known times: a parent with two children, a failed
    run and an interrupted one, one hour apart from 14:00 local time, 2025-01-31."""
    path = default_journal()
    with RunJournal.open(path) as journal:
        add_run(journal, "a0000001", "Summarise the README\nin three lines")
        add_run(
            journal, "a0000002", "Count the TODOs", provider="spawn", parent="a0000001", started=T0 + 3600
        )
        add_run(journal, "a0000003", "Review the plan", provider="fork", parent="a0000001", started=T0 + 7200)
        add_run(
            journal, "b0000004", "Fix the build", state="failed", stop=None, started=T0 + 10800, seconds=0.2
        )
        add_run(
            journal,
            "b0000005",
            MIGRATE,
            state="interrupted",
            stop=None,
            started=T0 + 14400,
            seconds=300,
        )
    return path


# -- subagent runs: the listing -------------------------------------------------------------------------


def test_runs_lists_every_run_newest_first_one_line_each_with_its_fields(tmp_path: Path, made: Path) -> None:
    done = run_cli(tmp_path, "runs")
    assert (done.status, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        HEADER,
        f"b0000005  interrupted  -          acp       {DAY} 18:00:00  5m00s     0      {MIGRATE}",
        f"b0000004  failed       -          acp       {DAY} 17:00:00  0.2s      0      Fix the build",
        f"a0000003  ended        completed  fork      {DAY} 16:00:00  3.5s      1      Review the plan",
        f"a0000002  ended        completed  spawn     {DAY} 15:00:00  3.5s      1      Count the TODOs",
        f"a0000001  ended        completed  acp       {DAY} 14:00:00  3.5s      1      Summarise the README",
    ]


def test_a_prompt_is_cut_to_the_width_of_columns_and_whole_when_nothing_says_a_width(
    tmp_path: Path, made: Path
) -> None:
    narrow = run_cli(tmp_path, "runs", "--limit", "1", env={"COLUMNS": "100"})
    assert narrow.stdout.splitlines()[1] == (
        f"b0000005  interrupted  -     acp       {DAY} 18:00:00  5m00s     0      {MIGRATE[:22]}\u2026"
    )
    assert all(len(line) <= 100 for line in narrow.stdout.splitlines())
    whole = run_cli(tmp_path, "runs", "--limit", "1")
    assert whole.stdout.splitlines()[1].endswith(f"  {MIGRATE}")


@pytest.mark.parametrize(
    ("args", "ids"),
    [
        (["--state", "failed"], ["b0000004"]),
        (["--state", "failed", "--state", "interrupted"], ["b0000005", "b0000004"]),
        (["--provider", "spawn"], ["a0000002"]),
        (["--parent", "a0000001"], ["a0000003", "a0000002"]),
        (["--since", "2025-01-31T16:00"], ["b0000005", "b0000004", "a0000003"]),
        (["--until", "2025-01-31 15:00:00"], ["a0000001"]),
        (["--since", "2025-01-31T15:00", "--until", "2025-01-31T17:00"], ["a0000003", "a0000002"]),
        (["--limit", "2"], ["b0000005", "b0000004"]),
        (["--all"], ["b0000005", "b0000004", "a0000003", "a0000002", "a0000001"]),
        (["--since", "1h"], []),
        (["--since", "3650d"], ["b0000005", "b0000004", "a0000003", "a0000002", "a0000001"]),
    ],
)
def test_runs_filters_by_state_provider_parent_and_time_and_limits_the_count(
    tmp_path: Path, made: Path, args: list[str], ids: list[str]
) -> None:
    assert [record["id"] for record in listed(tmp_path, *args)] == ids


def test_a_listing_that_matches_nothing_says_so_naming_the_journal(tmp_path: Path, made: Path) -> None:
    done = run_cli(tmp_path, "runs", "--provider", "codex")
    assert (done.status, done.stderr) == (0, "")
    assert done.stdout == f"no runs match in the run journal {made}\n"


def test_runs_on_a_journal_that_does_not_exist_says_so_and_creates_none(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "runs")
    assert (done.status, done.stderr) == (0, "")
    assert done.stdout == f"no runs recorded in the run journal {default_journal()} (it does not exist yet)\n"
    assert not default_journal().parent.exists()
    assert listed(tmp_path) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--since", "yesterday"], "argument --since: expected an ISO date or time (2025-01-31, "
         "2025-01-31T14:00) or a time ago (30m, 2h, 7d), not 'yesterday'"),
        (["--limit", "0"], "argument --limit: must be at least 1, not '0'"),
        (["--limit", "3", "--all"], "argument --all: not allowed with argument --limit"),
        (["--state", "done"], "argument --state: invalid choice: 'done' (choose from 'queued', 'starting', "
         "'running', 'ended', 'failed', 'disposed', 'interrupted')"),
    ],
)  # fmt: skip
def test_a_bad_filter_is_bad_usage_with_exit_status_2(tmp_path: Path, args: list[str], message: str) -> None:
    done = run_cli(tmp_path, "runs", *args)
    assert (done.status, done.stdout) == (2, "")
    assert done.stderr.endswith(f"subagent runs: error: {message}\n")


# -- subagent runs show ---------------------------------------------------------------------------------


def test_runs_show_prints_every_field_its_state_changes_and_its_children(tmp_path: Path, made: Path) -> None:
    with RunJournal.open(made) as journal:
        record = journal.get("a0000001")
    assert record is not None
    done = run_cli(tmp_path, "runs", "show", "a0000001", env={"COLUMNS": "200"})
    assert (done.status, done.stderr) == (0, "")
    changes = [f"  {local(change.at, fraction=True)}  {change.state}" for change in record.transitions]
    assert [change.state for change in record.transitions] == ["starting", "running", "ended"]
    assert done.stdout == "\n".join(
        [
            "run a0000001",
            "  state:      ended (completed)",
            "  provider:   acp (its run acp-1)",
            "  parent:     -",
            "  parent id:  -",
            "  started:    2025-01-31 14:00:00",
            "  updated:    2025-01-31 14:00:03",
            "  ended:      2025-01-31 14:00:03",
            "  duration:   3.5s",
            "  turns:      1 completed",
            "  resumes:    0",
            "  session:    session-1",
            "  agent:      acp-agent --flag (on local, in /work)",
            f"  owner:      pid {os.getpid()} on host {record.owner['host'][:8]}",
            '  request:    {"cwd": "/work"}',
            "  usage:      -",
            "  spent:      -",
            "  progress:   -",
            '  checkpoint: {"cwd": "/work", "sessionId": "session-1"}',
            "prompt (35 characters):",
            "  Summarise the README",
            "  in three lines",
            "output:",
            "  done",
            "state changes:",
            *[line + ("  completed" if line.endswith("ended") else "") for line in changes],
            "children (2):",
            "  ID        STATE  STOP       PROVIDER  STARTED              DURATION  TURNS  PROMPT",
            f"  a0000002  ended  completed  spawn     {DAY} 15:00:00  3.5s      1      Count the TODOs",
            f"  a0000003  ended  completed  fork      {DAY} 16:00:00  3.5s      1      Review the plan",
            "",
        ]
    )


def test_runs_show_json_is_the_record_with_its_transitions_checkpoint_and_children(
    tmp_path: Path, made: Path
) -> None:
    done = run_cli(tmp_path, "runs", "show", "b0000004", "--json")
    assert (done.status, done.stderr) == (0, "")
    shown = done.json()
    assert set(shown) == RECORD_KEYS | {"transitions", "checkpoint", "children"}
    assert (shown["state"], shown["stopReason"], shown["error"], shown["children"]) == (
        "failed",
        None,
        "it broke",
        [],
    )
    assert shown["checkpoint"] == {"sessionId": "session-1", "cwd": "/work"}
    assert [change["state"] for change in shown["transitions"]] == ["starting", "running", "failed"]
    assert shown["transitions"][-1]["detail"] == "it broke"
    parent = run_cli(tmp_path, "runs", "show", "a0000001", "--json").json()
    assert [child["id"] for child in parent["children"]] == ["a0000002", "a0000003"]
    assert set(parent["children"][0]) == RECORD_KEYS  # a listing's record: no transitions


@pytest.mark.parametrize(
    ("wanted", "message"),
    [
        ("ffffffff", "no run 'ffffffff' in the run journal {path}"),
        ("abc", "no run 'abc' in the run journal {path} (give at least 4 characters of its id)"),
        ("a000", "'a000' is the start of more than one run's id: give more of it"),
    ],
)
def test_runs_show_of_an_unknown_or_ambiguous_id_exits_2_saying_so(
    tmp_path: Path, made: Path, wanted: str, message: str
) -> None:
    done = run_cli(tmp_path, "runs", "show", wanted)
    assert (done.status, done.stdout) == (2, "")
    assert done.stderr == f"subagent: {message.format(path=made)}\n"


def test_runs_loads_no_event_loop_library_and_none_of_the_agent_machinery(tmp_path: Path, made: Path) -> None:
    heavy = ["anyio", "msgspec", "subagent.acp.client", "subagent.providers.acp", "subagent.service"]
    code = (
        "import sys\nfrom subagent.cli import main\nstatus = main(['runs', '--limit', '1'])\n"
        f"print(status, [name for name in {heavy!r} if name in sys.modules])\n"
    )
    env, _ = cli_env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=BOUND, check=False
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines()[-1] == "0 []"


def test_runs_lists_a_journal_of_10000_runs_correctly(tmp_path: Path) -> None:
    with RunJournal.open(default_journal()) as journal:
        for index in range(10_000):
            add_run_quickly(journal, index)
        assert journal.flush(BOUND)
    everything = listed(tmp_path, "--all")
    assert [record["id"] for record in everything] == [f"{index:08x}" for index in reversed(range(10_000))]
    assert {record["state"] for record in everything} == {"ended", "failed"}
    failed = listed(tmp_path, "--all", "--state", "failed")
    assert [record["id"] for record in failed] == [f"{index:08x}" for index in reversed(range(0, 10_000, 7))]
    page = run_cli(tmp_path, "runs").stdout.splitlines()
    assert len(page) == 51
    assert [line[:8] for line in page[1:]] == [f"{index:08x}" for index in range(9_999, 9_949, -1)]


def add_run_quickly(journal: RunJournal, index: int) -> None:
    """Run ``index`` of a big journal: every seventh failed, the others completed; not waited for."""
    id = f"{index:08x}"
    journal.record_start(
        id, run_id=f"acp-{index}", provider="acp", parent=None, parent_id=None, prompt=f"task {index}",
        request={}, agent=ACP_AGENT,
    )  # fmt: skip
    failed = index % 7 == 0
    journal.record_turn(
        id, stop_reason=None if failed else "completed", output=None, structured=None, error=None, usage=None,
        checkpoint=None, state="failed" if failed else "ended",
    )  # fmt: skip


# -- which journal: flags, environment, config, default -------------------------------------------------

COMPLETING: Final = one_turn({"step": "message", "text": "Done."})


@pytest.mark.parametrize(
    ("args", "env", "config", "chosen"),
    [
        ([], {}, None, "default"),
        ([], {}, 'journal = "from-config.db"\n', "from-config.db"),
        ([], {"SUBAGENT_JOURNAL": "env.db"}, 'journal = "from-config.db"\n', "env.db"),
        (["--journal", "flag.db"], {"SUBAGENT_JOURNAL": "env.db"}, 'journal = "from-config.db"\n', "flag.db"),
        (["--no-journal"], {"SUBAGENT_JOURNAL": "env.db"}, 'journal = "from-config.db"\n', None),
        ([], {"SUBAGENT_JOURNAL": "off"}, 'journal = "from-config.db"\n', None),
        ([], {}, "journal = false\n", None),
        ([], {"SUBAGENT_JOURNAL": ""}, "journal = true\n", "default"),
    ],
    ids=["default", "config", "env-over-config", "flag-over-env", "no-journal", "env-off", "config-false",
         "empty-env-and-true"],
)  # fmt: skip
def test_the_journal_is_the_flags_else_the_environments_else_the_configs_else_the_default(
    tmp_path: Path, args: list[str], env: dict[str, str], config: str | None, chosen: str | None
) -> None:
    if config is not None:
        (tmp_path / "subagent.toml").write_text(config)
    candidates = {
        "default": default_journal(),
        **{name: tmp_path / name for name in ("from-config.db", "env.db", "flag.db")},
    }
    done = run_cli(
        tmp_path, "run", "--json", "-p", "hi", *args, "--", *scenario(tmp_path, COMPLETING), env=env
    )
    assert done.status == 0, done.stderr
    report = done.json()
    assert [name for name, path in candidates.items() if path.exists()] == ([chosen] if chosen else [])
    if chosen is None:
        assert "journalId" not in report
        return
    assert report["journalId"] == listed(tmp_path, "--journal", str(candidates[chosen]))[0]["id"]
    # `subagent runs` reads the journal the same way.
    assert [record["id"] for record in listed(tmp_path, *args, env=env)] == [report["journalId"]]


def test_runs_with_the_journal_turned_off_exits_2_naming_what_turned_it_off(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "runs", env={"SUBAGENT_JOURNAL": "off"})
    assert (done.status, done.stdout) == (2, "")
    assert done.stderr == (
        "subagent: no run journal is kept (SUBAGENT_JOURNAL=off turned it off): name one with --journal "
        "PATH\n"
    )


def test_the_default_journal_is_under_xdg_state_home_and_the_configs_path_is_from_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert default_journal_path() == tmp_path / "state" / "subagent" / "runs.db"
    (tmp_path / "conf").mkdir()
    config = tmp_path / "conf" / "subagent.toml"
    config.write_text('journal = "../journals/runs.db"\n')
    assert load_config(config).journal == str(tmp_path / "journals" / "runs.db")
    config.write_text("journal = false\n")
    assert load_config(config).journal is False


def test_no_journal_writes_nothing_anywhere(tmp_path: Path) -> None:
    state = Path(os.environ["XDG_STATE_HOME"])
    done = run_cli(tmp_path, "run", "--no-journal", "-p", "hi", "--", *scenario(tmp_path, COMPLETING))
    assert (done.status, done.stdout, done.stderr) == (0, "Done.\n", "")
    assert list(state.iterdir()) == []
    assert sorted(path.name for path in tmp_path.iterdir()) == ["scenario.json"]


def test_both_journal_flags_are_bad_usage(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "run", "--journal", "x.db", "--no-journal", "-p", "hi", "--", "agent")
    assert (done.status, done.stdout) == (2, "")
    assert done.stderr.endswith("subagent run: error: give either --journal PATH or --no-journal, not both\n")


def test_a_journal_of_a_newer_schema_exits_2_with_its_message_before_any_agent_starts(tmp_path: Path) -> None:
    path = default_journal()
    RunJournal.open(path).close()
    with raw(path) as connection:
        connection.execute(
            "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),)
        )
    marker = tmp_path / "started"
    message = (
        f"subagent: the run journal {str(path)!r} has schema version {SCHEMA_VERSION + 1}, newer than this "
        f"subagent-seam knows ({SCHEMA_VERSION}): it was written by a newer release. Upgrade subagent-seam, "
        "or use another journal file (--journal, or SUBAGENT_JOURNAL)\n"
    )
    done = run_cli(tmp_path, "run", "--json", "-p", "hi", "--", "sh", "-c", f"touch {marker}")
    assert (done.status, done.stdout, done.stderr) == (2, "", message)
    assert not marker.exists()
    listing = run_cli(tmp_path, "runs")
    assert (listing.status, listing.stdout, listing.stderr) == (2, "", message)


def test_a_file_that_is_no_journal_exits_2_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("my notes, not a database\n" * 100)
    done = run_cli(tmp_path, "run", "--journal", str(path), "-p", "hi", "--", *scenario(tmp_path, COMPLETING))
    assert (done.status, done.stdout) == (2, "")
    assert done.stderr.startswith(f"subagent: {str(path)!r} is not a usable run journal (")
    assert path.read_text() == "my notes, not a database\n" * 100


# -- what a run records, and what it says -----------------------------------------------------------------


def test_a_run_is_recorded_with_its_request_agent_session_and_result_and_json_names_its_id(
    tmp_path: Path,
) -> None:
    agent = scenario(tmp_path, one_turn({"step": "message", "text": "All done."}))
    done = run_cli(tmp_path, "run", "--json", "--timeout", "60", "-p", "Tidy up\nthe repo", "--", *agent)
    assert done.status == 0, done.stderr
    report = done.json()
    assert set(report) == {"output", "stopReason", "error", "usage", "journalId"}
    [record] = listed(tmp_path)
    assert set(record) == RECORD_KEYS
    assert record["id"] == report["journalId"]
    assert {
        key: record[key] for key in RECORD_KEYS - {"id", "createdAt", "updatedAt", "endedAt", "owner"}
    } == {
        "runId": "acp-1",
        "provider": "acp",
        "state": "ended",
        "parent": None,
        "parentId": None,
        "prompt": "Tidy up\nthe repo",
        "promptChars": 16,
        "turnPrompt": "Tidy up\nthe repo",
        "request": {"cwd": str(tmp_path), "timeout": 60.0, "metadata": {CLI_META_KEY: NO_CLI_SETTINGS}},
        "agent": {"command": agent, "transport": "local", "cwd": str(tmp_path)},
        "sessionId": "session-1",
        "turns": 1,
        "stopReason": "completed",
        "output": "All done.",
        "structured": None,
        "error": None,
        "usage": None,
        "spent": None,
        "progress": None,
        "resumes": 0,
    }
    assert record["createdAt"] <= record["updatedAt"] == record["endedAt"]
    assert set(record["owner"]) == {"host", "pid", "start"}
    line = run_cli(tmp_path, "runs").stdout.splitlines()[1]
    assert line.startswith(f"{record['id']}  ended  completed  acp       {local(record['createdAt'])}  ")
    assert line.endswith("  1      Tidy up")


def test_a_run_of_a_configured_agent_keeps_its_name_and_settings_and_never_its_environment(
    tmp_path: Path,
) -> None:
    agent = scenario(tmp_path, COMPLETING)
    config = tmp_path / "subagent.toml"
    config.write_text(
        f"[agents.stub]\ncommand = {json.dumps(agent[0])}\nargs = {json.dumps(agent[1:])}\n"
        'env = { STUB_TOKEN = "s3cr3t-value-123" }\npermission = "allow"\nready_timeout = 20\n'
        "subagents = false\n"
    )
    done = run_cli(tmp_path, "run", "--agent", "stub", "--no-fs", "-p", "hi")
    assert done.status == 0, done.stderr
    [record] = listed(tmp_path)
    assert record["request"]["metadata"][CLI_META_KEY] == {
        **NO_CLI_SETTINGS,
        "agent": "stub",
        "config": str(config),
        "permission": "allow",
        "fs": False,
        "subagents": False,
        "readyTimeout": 20.0,
    }
    files = default_journal().parent.iterdir()  # the database, and its write-ahead log if one is left
    assert [path.name for path in files if b"s3cr3t-value-123" in path.read_bytes()] == []


def test_the_demo_records_its_turn_and_the_children_its_agent_delegated(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "demo", "--json")
    assert done.status == 0, done.stderr
    records = listed(tmp_path)
    assert sorted((record["provider"], str(record["parentId"]), record["state"]) for record in records) == [
        ("acp", "None", "ended"),
        ("acp", "root", "ended"),
        ("fork", "root", "ended"),
        ("spawn", "root", "ended"),
    ]
    assert {record["stopReason"] for record in records} == {"completed"}
    assert records[-1]["provider"] == "acp"  # the first half's turn, recorded first


RESUMABLE_REFUSAL: Final = {
    "resumeSession": {"steps": []},
    "turns": [[{"step": "message", "text": "I will not."}, {"step": "stop", "reason": "refusal"}]],
}


def test_a_turn_that_did_not_complete_ends_saying_how_to_resume_it_when_its_agent_can_reopen_it(
    tmp_path: Path,
) -> None:
    done = run_cli(tmp_path, "run", "-p", "hi", "--", *scenario(tmp_path, RESUMABLE_REFUSAL))
    [record] = listed(tmp_path)
    assert (done.status, done.stdout) == (1, "I will not.\n")
    assert done.stderr == (
        "subagent: the turn ended with stop reason 'refusal'\n"
        f"subagent: run {record['id']} is in the run journal: continue it with "
        f"`subagent resume {record['id']}` (-p TEXT to say what next)\n"
    )
    journal = tmp_path / "my runs.db"
    named = run_cli(
        tmp_path, "run", "--journal", str(journal), "-p", "hi", "--", *scenario(tmp_path, RESUMABLE_REFUSAL)
    )
    [record] = listed(tmp_path, "--journal", str(journal))
    assert named.stderr.endswith(
        f"continue it with `subagent resume {record['id']} --journal {shlex.quote(str(journal))}` "
        "(-p TEXT to say what next)\n"
    )


def test_a_turn_whose_agent_cannot_reopen_its_session_ends_without_a_resume_hint(tmp_path: Path) -> None:
    refusal = {"turns": RESUMABLE_REFUSAL["turns"]}
    done = run_cli(tmp_path, "run", "-p", "hi", "--", *scenario(tmp_path, refusal))
    assert (done.status, done.stderr) == (1, "subagent: the turn ended with stop reason 'refusal'\n")


# -- interrupted runs, and subagent resume ----------------------------------------------------------------

LONG_TASK: Final = "Do the long task\nstep by step"
WAITING: Final = {
    "resumeSession": {"steps": []},
    "turns": [[{"step": "message", "text": "Working."}, {"step": "hang"}]],
}
ECHOING: Final = {"resumeSession": {"steps": []}, "turns": [[{"step": "echo", "prefix": "resumed: "}]]}


def killed_mid_turn(tmp_path: Path, live: list[LiveCli], agent: list[str], *args: str) -> str:
    """Start `subagent run ARGS` on ``agent`` (a turn that waits; none: ARGS name a configured agent),
    SIGKILL the CLI alone once the turn is under way, wait until nothing of it is left (its agent's
    supervisor sees it go), and return the run's id."""
    command = ["--", *agent] if agent else []
    cli = LiveCli(tmp_path, "run", "--events", "--permission", "allow", "-p", LONG_TASK, *args, *command)
    live.append(cli)
    journal_id: str = cli.wait_for_event("start")["journalId"]
    cli.wait_for_event("update")  # the turn is under way: its first message arrived
    os.kill(cli.process.pid, signal.SIGKILL)
    assert cli.process.wait(timeout=BOUND) == -signal.SIGKILL
    deadline = time.monotonic() + BOUND
    while leaked_processes(cli.tag) and time.monotonic() < deadline:
        time.sleep(0.05)  # polled: no event tells of the death of a process that is not our child
    assert cli.finish().status == -signal.SIGKILL  # its pipes closed, and nothing of it left
    return journal_id


@pytest.mark.parametrize("prompt", ["finish it", None], ids=["with-prompt", "default-prompt"])
def test_a_run_whose_cli_was_killed_is_listed_interrupted_once_and_resume_completes_it(
    tmp_path: Path, live: list[LiveCli], prompt: str | None
) -> None:
    agent = scenario(tmp_path, WAITING)
    run_id = killed_mid_turn(tmp_path, live, agent)

    first = run_cli(tmp_path, "runs")
    assert first.status == 0
    assert first.stderr == (
        f"subagent: newly interrupted (the process that ran them is gone): {run_id}; continue one with "
        "`subagent resume ID`\n"
    )
    assert first.stdout.splitlines()[1].startswith(f"{run_id}  interrupted  -     acp       ")
    assert first.stdout.splitlines()[1].endswith("  0      Do the long task")
    again = run_cli(tmp_path, "runs")
    assert (again.stderr, again.stdout) == ("", first.stdout)  # reported once: by the listing that marked it
    assert run_cli(tmp_path, "runs", "show", run_id[:4], "--json").json()["state"] == "interrupted"

    scenario(tmp_path, ECHOING)  # the same command line, whose agent now answers the resumed turn
    args = ["-p", prompt] if prompt is not None else []
    done = run_cli(tmp_path, "resume", run_id, *args, "--json")
    assert done.status == 0, done.stderr
    expected = prompt or DEFAULT_RESUME_PROMPT.format(why="the process that ran it stopped", prompt=LONG_TASK)
    assert done.json() == {
        "output": f"resumed: {expected}",
        "stopReason": "completed",
        "error": None,
        "usage": None,
        "journalId": run_id,
    }
    assert done.stderr == ""
    shown = run_cli(tmp_path, "runs", "show", run_id, "--json").json()
    assert (shown["state"], shown["stopReason"], shown["turns"], shown["resumes"]) == (
        "ended",
        "completed",
        1,
        1,
    )
    assert shown["turnPrompt"] == (prompt or LONG_TASK)
    assert [change["state"] for change in shown["transitions"]] == [
        "starting", "running", "interrupted", "resumed", "running", "ended",
    ]  # fmt: skip
    assert shown["output"] == f"resumed: {expected}"


def test_the_next_run_reports_the_runs_found_interrupted_once_with_how_to_resume_them(
    tmp_path: Path, live: list[LiveCli]
) -> None:
    run_id = killed_mid_turn(tmp_path, live, scenario(tmp_path, WAITING))
    completing = scenario(tmp_path, COMPLETING, "completing.json")
    done = run_cli(tmp_path, "run", "-p", "hi", "--", *completing)
    assert (done.status, done.stdout) == (0, "Done.\n")
    assert done.stderr == (
        "subagent: 1 run found interrupted (the process that ran it is gone):\n"
        f"  {run_id}  acp  Do the long task\n"
        "subagent: continue one with `subagent resume ID`; `subagent runs --state interrupted` lists them\n"
    )
    again = run_cli(tmp_path, "run", "-p", "hi", "--", *completing)
    assert (again.status, again.stderr) == (0, "")
    listing = run_cli(tmp_path, "runs", "--state", "interrupted")
    assert listing.stderr == ""  # already reported, by the run that found it
    assert [line.split()[0] for line in listing.stdout.splitlines()[1:]] == [run_id]
    events = run_cli(tmp_path, "run", "--events", "-p", "hi", "--", *completing)
    assert "interrupted_runs" not in events.stderr


def test_resume_with_events_announces_the_same_journal_id_and_the_reopened_session(
    tmp_path: Path, live: list[LiveCli]
) -> None:
    run_id = killed_mid_turn(tmp_path, live, scenario(tmp_path, WAITING))
    scenario(tmp_path, ECHOING)
    done = run_cli(tmp_path, "resume", run_id[:5], "-p", "go on", "--events")
    assert (done.status, done.stdout) == (0, "resumed: go on\n")
    events = done.events()
    assert [event["event"] for event in events] == ["spawn", "start", "update", "end"]
    assert (events[1]["journalId"], events[1]["sessionId"]) == (run_id, "session-1")


@pytest.mark.parametrize(
    ("record", "args", "message"),
    [
        (None, ["ffffffff"], "no run 'ffffffff' in the run journal {path}"),
        (
            {"provider": "spawn", "agent": {"kind": "spawn", "llm": None}},
            ["b0000001", "-p", "go on"],
            "run b0000001 cannot be resumed here: it was an in-process spawn child (provider 'spawn'), run "
            "by the program that started it; that program can resume it (SubagentService.resume)",
        ),
        (
            {"provider": "serve", "agent": {"kind": "serve", "name": "subagent-serve"}},
            ["b0000001", "-p", "go on"],
            "run b0000001 is a session of `subagent serve`: start `subagent serve` again on this journal, "
            "and its client reopens the session (session/resume or session/load)",
        ),
        (
            {"agent": None},
            ["b0000001", "-p", "go on"],
            "run b0000001 cannot be resumed: the run journal does not say how its agent was run (its "
            "provider 'acp' said nothing of it)",
        ),
        (
            {"request": {"cwd": "/work", "isolation": "worktree", "cleanup": "remove"}},
            ["b0000001", "-p", "go on"],
            "run b0000001 cannot be resumed: it ran in an isolated workspace (--isolation worktree), closed "
            "with its agent: a resumed session would not find the files it worked on",
        ),
        (
            {},
            ["b0000001"],
            "run b0000001 cannot be resumed: its last turn completed: give the prompt of its next turn",
        ),
    ],
    ids=["no-run", "in-process", "serve-session", "no-agent", "isolated", "completed-without-prompt"],
)
def test_a_run_that_cannot_be_resumed_exits_2_with_the_reason_and_starts_no_agent(
    tmp_path: Path, record: dict[str, Any] | None, args: list[str], message: str
) -> None:
    marker = tmp_path / "started"
    agent = {"command": ["sh", "-c", f"touch {marker}"], "transport": "local", "cwd": str(tmp_path)}
    with RunJournal.open(default_journal()) as journal:
        add_run(journal, "a0000001", "another run")
        if record is not None:
            add_run(journal, "b0000001", "the task", **{"agent": agent, **record})
    done = run_cli(tmp_path, "resume", *args, "--json")
    assert (done.status, done.stdout) == (2, "")
    assert done.stderr == f"subagent: {message.format(path=default_journal())}\n"
    assert not marker.exists()


def test_resuming_a_run_whose_agent_cannot_reopen_its_session_exits_2_saying_so(
    tmp_path: Path, live: list[LiveCli]
) -> None:
    agent = scenario(tmp_path, WAITING)
    run_id = killed_mid_turn(tmp_path, live, agent)
    scenario(tmp_path, {"turns": ECHOING["turns"]})  # no resumeSession, no loadSession
    done = run_cli(tmp_path, "resume", run_id, "-p", "go on")
    assert (done.status, done.stdout) == (2, "")
    assert done.stderr == (
        f"subagent: run {run_id} cannot be resumed: agent `{shlex.join(agent)}` offers neither "
        "session/resume nor session/load\n"
    )
    [record] = listed(tmp_path)
    assert record["state"] == "failed"  # resumable again once its agent can


@pytest.mark.parametrize(
    "check",
    ['test -n "$STUB_TOKEN"', 'test "$STUB_TOKEN" = s3cr3t-value-123'],
    ids=["token-set", "token-in-the-command-line"],
)
def test_resume_gives_a_configured_agent_its_environment_from_the_config_again(
    tmp_path: Path, live: list[LiveCli], check: str
) -> None:
    stub = scenario(tmp_path, WAITING)
    # The agent starts only with its token: the journal never holds it (nor its command line where the token
    # is in it: redacted there), and the config gives both again.
    guard = f'{check} || exit 7; exec "$0" "$@"'
    (tmp_path / "subagent.toml").write_text(
        f'[agents.stub]\ncommand = "sh"\nargs = {json.dumps(["-c", guard, *stub])}\n'
        'env = { STUB_TOKEN = "s3cr3t-value-123" }\n'
    )
    run_id = killed_mid_turn(tmp_path, live, [], "--agent", "stub")
    scenario(tmp_path, ECHOING)
    done = run_cli(tmp_path, "resume", run_id, "-p", "go on")
    assert (done.status, done.stdout, done.stderr) == (0, "resumed: go on\n", "")
    files = default_journal().parent.iterdir()
    assert [path.name for path in files if b"s3cr3t-value-123" in path.read_bytes()] == []


def test_resume_holds_the_resumed_turn_to_the_timeout_given_there(
    tmp_path: Path, live: list[LiveCli]
) -> None:
    run_id = killed_mid_turn(tmp_path, live, scenario(tmp_path, WAITING))  # no timeout of its own
    done = run_cli(tmp_path, "resume", run_id, "-p", "go on", "--timeout", "0.5", "--json")
    assert done.status == 1
    report = done.json()
    assert (report["stopReason"], report["journalId"]) == ("timeout", run_id)
    assert done.stderr.splitlines()[-1] == (
        f"subagent: run {run_id} is in the run journal: continue it with `subagent resume {run_id}` "
        "(-p TEXT to say what next)"
    )


def test_resume_refuses_a_cap_the_agent_cannot_be_held_to_before_starting_it(
    tmp_path: Path, live: list[LiveCli]
) -> None:
    run_id = killed_mid_turn(tmp_path, live, scenario(tmp_path, WAITING))
    done = run_cli(tmp_path, "resume", run_id, "-p", "go on", "--max-tokens", "100")
    assert (done.status, done.stdout) == (2, "")
    assert "subagent resume: error: --max-tokens: the agent cannot be held to it" in done.stderr
    [record] = run_cli(tmp_path, "runs", "--json").json()
    assert (record["state"], record["resumes"]) == ("interrupted", 0)  # untouched: no service was opened
