"""Each `subagent run` option is declared once, in `subagent.cli._options.RUN_OPTIONS`, and the parser, the
config's schema and the turn's spec are derived from it. These tests walk that table, so that an option
cannot be half-declared: its flags are in `subagent run --help` (and `subagent demo --help` where the demo
takes it), its config key is in the schema with the words of its errors, and its value, set by its flag
and by its config key, reaches the turn's `TurnSpec`.

Run in this process with the turn itself replaced by a probe that keeps the spec: no agent is started.
"""

from __future__ import annotations

import argparse
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from subagent.acp.transports import SshTransport, Transport
from subagent.cli import _commands as commands
from subagent.cli import _config as config
from subagent.cli._config import AGENT_KEYS, ConfigError, load_config
from subagent.cli._main import main
from subagent.cli._options import RUN_OPTIONS, Option
from subagent.cli._turn import TurnSpec


@dataclass(frozen=True)
class Sample:
    """How a test sets one option, and where the turn's spec shows it."""

    flag: list[str] | None
    """Command-line words that set it (None: it has no flag)."""
    key: str | None
    """Lines of an agent's config table that set it (None: it has no config key)."""
    read: Callable[[TurnSpec], Any]
    value: Any
    """What ``read`` finds in the spec when it is set so."""
    needs: tuple[list[str], str] = ([], "")
    """The flags and the config lines without which it does not apply (an agent on ssh://)."""


def transport(spec: TurnSpec) -> Transport:
    assert spec.transport is not None
    return spec.transport


def ssh(spec: TurnSpec) -> SshTransport:
    assert isinstance(spec.transport, SshTransport)
    return spec.transport


def samples(root: Path) -> dict[str, Sample]:
    """One sample for every option of the table; a new option needs one here."""
    work, conf, other = str(root / "work"), str(root / "ssh.conf"), str(root / "other.toml")
    on_ssh = (["--on", "ssh://build-1"], 'transport = "ssh://build-1"')
    isolated = (["--isolation", "copy"], 'isolation = "copy"')
    return {
        "prompt": Sample(["-p", "the prompt"], None, lambda spec: spec.prompt, "the prompt"),
        "agent": Sample(["--agent", "a"], None, lambda spec: spec.command, ["configured-agent"]),
        "config": Sample(
            ["--agent", "b", "--config", other], None, lambda spec: spec.command, ["other-agent"]
        ),
        "env": Sample(None, 'env = { KEY = "value" }', lambda spec: spec.env, {"KEY": "value"}),
        "cwd": Sample(["--cwd", work], f'cwd = "{work}"', lambda spec: spec.cwd, work),
        "additional_directories": Sample(
            ["--add-dir", work],
            f'additional_directories = ["{work}"]',
            lambda spec: spec.additional_directories,
            (work,),
        ),
        "permission": Sample(
            ["--permission", "allow"], 'permission = "allow"', lambda spec: spec.permission, "allow"
        ),
        "permission_timeout": Sample(
            ["--permission-timeout", "7"], None, lambda spec: spec.permission_timeout, 7.0
        ),
        "timeout": Sample(["--timeout", "9"], "timeout = 9", lambda spec: spec.timeout, 9.0),
        "ready_timeout": Sample(None, "ready_timeout = 3", lambda spec: spec.ready_timeout, 3.0),
        "max_tokens": Sample(
            ["--max-tokens", "1000"], "max_tokens = 1000", lambda spec: spec.max_tokens, 1000
        ),
        "max_cost": Sample(["--max-cost", "0.5"], "max_cost = 0.5", lambda spec: spec.max_cost, 0.5),
        "max_seconds": Sample(
            ["--max-seconds", "60"], "max_seconds = 60", lambda spec: spec.max_seconds, 60.0
        ),
        "max_tool_calls": Sample(
            ["--max-tool-calls", "7"], "max_tool_calls = 7", lambda spec: spec.max_tool_calls, 7
        ),
        "max_turns": Sample(["--max-turns", "4"], "max_turns = 4", lambda spec: spec.max_turns, 4),
        "reports_usage": Sample(
            ["--reports-usage", "tokens"],
            'reports_usage = ["tokens"]',
            lambda spec: tuple(spec.reports_usage or ()),
            ("tokens",),
        ),
        "isolation": Sample(
            ["--isolation", "worktree"], 'isolation = "worktree"', lambda spec: spec.isolation, "worktree"
        ),
        "cleanup": Sample(
            ["--cleanup", "keep"], 'cleanup = "keep"', lambda spec: spec.cleanup, "keep", needs=isolated
        ),
        "worktree_root": Sample(
            ["--worktree-root", "trees"],
            'worktree_root = "trees"',
            lambda spec: spec.worktree_root,
            str(root / "trees"),
            needs=isolated,
        ),
        "branch_prefix": Sample(
            ["--branch-prefix", "agent/"],
            'branch_prefix = "agent/"',
            lambda spec: spec.branch_prefix,
            "agent/",
            needs=isolated,
        ),
        "auth_method": Sample(
            ["--auth-method", "login"], 'auth_method = "login"', lambda spec: spec.auth_method, "login"
        ),
        "fs": Sample(["--no-fs"], "fs = false", lambda spec: spec.fs, False),
        "subagents": Sample(["--no-subagents"], "subagents = false", lambda spec: spec.subagents, False),
        "mode": Sample(["--mode", "plan"], 'mode = "plan"', lambda spec: spec.mode, "plan"),
        "config_options": Sample(
            ["--set", "model=fast"],
            'config_options = { model = "fast" }',
            lambda spec: spec.config_options,
            {"model": "fast"},
        ),
        "transport": Sample(
            ["--on", "ssh://build-1"], on_ssh[1], lambda spec: transport(spec).name, "ssh://build-1"
        ),
        "ssh_config": Sample(
            ["--ssh-config", conf],
            f'ssh_config = "{conf}"',
            lambda spec: ssh(spec).config_file,
            conf,
            needs=on_ssh,
        ),
        "ssh_options": Sample(
            ["--ssh-option", "ConnectTimeout=5"],
            'ssh_options = ["ConnectTimeout=5"]',
            lambda spec: ssh(spec).ssh_options[-2:],
            ("-o", "ConnectTimeout=5"),
            needs=on_ssh,
        ),
        "json": Sample(["--json"], None, lambda spec: spec.json, True),
        "events": Sample(["--events"], None, lambda spec: spec.events, True),
        "events_file": Sample(
            ["--events-file", str(root / "run.jsonl")],
            None,
            lambda spec: spec.events_file,
            str(root / "run.jsonl"),
        ),
        "trace": Sample(
            ["--trace", str(root / "run.html")], None, lambda spec: spec.trace, str(root / "run.html")
        ),
        "progress": Sample(["--progress"], None, lambda spec: spec.progress, True),
        "journal": Sample(
            ["--journal", str(root / "runs.db")], None, lambda spec: journal_path(spec), str(root / "runs.db")
        ),
        "no_journal": Sample(["--no-journal"], None, lambda spec: journal_path(spec), None),
    }


def journal_path(spec: TurnSpec) -> str | None:
    assert spec.journal is not None
    return spec.journal.path


OPTIONS = pytest.mark.parametrize("option", RUN_OPTIONS, ids=lambda option: option.name)


@pytest.fixture
def root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty directory to run in, with no user config, a directory ``work``, and ``other.toml``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    (tmp_path / "work").mkdir()
    (tmp_path / "other.toml").write_text('[agents.b]\ncommand = "other-agent"\n')
    return tmp_path


@pytest.fixture
def specs(monkeypatch: pytest.MonkeyPatch) -> list[TurnSpec]:
    """The specs of the turns the command line would run; each turn reports it completed."""
    kept: list[TurnSpec] = []

    def probe(spec: TurnSpec) -> int:
        if spec.answers is not None:
            spec.answers.close()
        kept.append(spec)
        return 0

    monkeypatch.setattr(commands, "_execute", probe)
    return kept


def spec_of(specs: list[TurnSpec], *argv: str, config: str | None = None) -> TurnSpec:
    """The spec of ``subagent run -p hi ARGV`` (``-- agent-command`` unless it names an ``--agent``), with
    ``[agents.a]`` of ./subagent.toml holding ``config`` besides its command."""
    Path("subagent.toml").write_text(f'[agents.a]\ncommand = "configured-agent"\n{config or ""}\n')
    command = [] if "--agent" in argv else ["--", "agent-command"]
    assert main(["run", "-p", "hi", *argv, *command]) == 0
    return specs.pop()


def help_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main([*argv, "--help"]) == 0
    return capsys.readouterr().out


def shown(flag: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_every_option_of_the_table_has_a_sample_that_sets_it_each_way_it_is_declared(root: Path) -> None:
    table = samples(root)
    assert list(table) == [option.name for option in RUN_OPTIONS]
    for option in RUN_OPTIONS:
        sample = table[option.name]
        assert (sample.flag is not None, sample.key is not None) == (
            bool(option.flags),
            option.config is not None,
        )
        assert option.flags or option.config is not None, f"{option.name} is set neither way"


@OPTIONS
def test_an_options_flags_are_in_run_help_and_in_demo_help_where_the_demo_takes_it(
    option: Option, capsys: pytest.CaptureFixture[str]
) -> None:
    run, demo = help_of(capsys, "run"), help_of(capsys, "demo")
    negated = [f"--no-{flag[2:]}" for flag in option.flags if option.action is argparse.BooleanOptionalAction]
    for flag in [*option.flags, *negated]:
        assert shown(flag, run)
        assert shown(flag, demo) == bool(option.demo)
    # Its help, by its first words (argparse wraps the rest).
    assert option.help[:40] in " ".join(run.split())
    if option.demo:
        assert (option.demo if isinstance(option.demo, str) else option.help)[:40] in " ".join(demo.split())


@OPTIONS
def test_an_options_config_key_is_in_the_schema_and_its_documentation_with_the_words_of_its_errors(
    option: Option, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = option.config
    if key is None:
        assert option.name not in AGENT_KEYS
        return
    assert option.name in AGENT_KEYS
    assert f"\n    {option.name} = " in (config.__doc__ or "")
    assert shown(option.name, " ".join(help_of(capsys).split()))
    path = tmp_path / "subagent.toml"

    def error_of(line: str) -> str:
        path.write_text(f'[agents.b]\ncommand = "x"\n{line}\n')
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        return str(caught.value).removeprefix(f"{path}: ")

    # A date is of no option's type: the message gives the option's own words for what it must be.
    assert (
        error_of(f"{option.name} = 2024-01-01")
        == f"agents.b.{option.name}: must be {key.expected}, not a date"
    )
    if key.item is not None:
        array = typing.get_origin(key.type) is list
        line, where = ("[2024-01-01]", "[0]") if array else ("{ x = 2024-01-01 }", ".x")
        assert error_of(f"{option.name} = {line}") == (
            f"agents.b.{option.name}{where}: must be {key.item}, not a date"
        )


@OPTIONS
@pytest.mark.parametrize("way", ["flag", "config key"])
def test_an_option_set_by_its_flag_or_by_its_config_key_reaches_the_turns_spec(
    option: Option, way: str, root: Path, specs: list[TurnSpec]
) -> None:
    sample = samples(root)[option.name]
    flags, lines = sample.needs
    if way == "flag" and sample.flag is not None:
        given, bare = spec_of(specs, *flags, *sample.flag), spec_of(specs, *flags)
    elif way == "config key" and sample.key is not None:
        given = spec_of(specs, "--agent", "a", config=f"{lines}\n{sample.key}")
        bare = spec_of(specs, "--agent", "a", config=lines)
    else:
        return  # not declared to be set this way (the first test checks the samples say so too)
    assert sample.read(given) == sample.value
    # Without it the spec holds something else: it is the option that set it.
    assert sample.read(bare) != sample.value


def test_a_flag_wins_over_its_config_key_and_lists_and_tables_merge_as_declared(
    root: Path, specs: list[TurnSpec]
) -> None:
    work, other = root / "work", root / "other"
    other.mkdir()
    spec = spec_of(
        specs,
        *("--agent", "a", "--timeout", "9", "--add-dir", str(other), "--set", "model=fast"),
        *("--ssh-option", "ConnectTimeout=20"),
        config=f'timeout = 5\nadditional_directories = ["{work}"]\n'
        'config_options = { model = "big", thinking = true }\n'
        'transport = "ssh://build-1"\nssh_options = ["ConnectTimeout=5"]',
    )
    assert spec.timeout == 9.0  # override: the flag's
    assert spec.additional_directories == (str(work), str(other))  # config_first
    assert spec.config_options == {"model": "fast", "thinking": True}  # update
    # command_line_first: ssh takes the first value of an option it is given.
    assert ssh(spec).ssh_options[-4:] == ("-o", "ConnectTimeout=20", "-o", "ConnectTimeout=5")


def test_the_demo_takes_the_turn_options_the_table_gives_it(root: Path, specs: list[TurnSpec]) -> None:
    assert main(["demo", "--only", "acp", "--json", "--permission-timeout", "7", "--trace", "t.html"]) == 0
    spec = specs.pop()
    assert (spec.json, spec.permission_timeout, spec.trace, spec.permission, spec.demo) == (
        True,
        7.0,
        "t.html",
        "demo",
        True,
    )


@pytest.mark.parametrize(
    "flag", ["--cwd", "--auth-method", "--mode", "--ssh-config", "--events-file", "--trace"]
)
def test_an_empty_value_for_a_flag_that_names_something_is_bad_usage(
    flag: str, root: Path, specs: list[TurnSpec], capsys: pytest.CaptureFixture[str]
) -> None:
    # It was taken as no value (the config's, or the default) or, for --trace, failed after the run.
    assert main(["run", "-p", "hi", flag, "", "--", "agent-command"]) == 2
    assert f"subagent run: error: argument {flag}: must not be empty\n" in capsys.readouterr().err
    assert specs == []


def test_a_bad_command_line_value_is_refused_naming_its_flag_before_the_prompt_is_read(
    root: Path, specs: list[TurnSpec], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(commands, "_read_prompt_from_stdin", lambda: pytest.fail("the prompt was read"))
    assert main(["run", "--set", "model", "--", "agent-command"]) == 2
    assert (
        "subagent run: error: --set: expected ID=VALUE, e.g. model=fast, not 'model'\n"
        in capsys.readouterr().err
    )
    assert main(["run", "--trace", str(root / "missing" / "t.html"), "--", "agent-command"]) == 2
    assert (
        f"--trace: the directory of {str(root / 'missing' / 't.html')!r} does not exist"
        in capsys.readouterr().err
    )
