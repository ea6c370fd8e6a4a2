"""`subagent serve` on the command line: its flags, and the LLM adapter built from them.

The server itself (sessions, turns, approvals, its stdio) is tested in tests/test_serve.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest

from subagent.cli import main
from subagent.cli._exits import Parser
from subagent.cli._serve_command import ServeConfigError, _add_serve_arguments, _background_options, build_llm
from subagent.delegation import DEFAULT_MAX_RUNNING, DEFAULT_SPILL_BYTES, BackgroundOptions
from subagent.runtime import DEFAULT_MAX_MODEL_CALLS, ScriptedLlm

ROOT: Final = Path(__file__).resolve().parent.parent
FIXTURE: Final = ROOT / "fixtures" / "scripts" / "delegate_to_spawn.json"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "no model: give --script FILE, or --base-url URL and --model NAME"),
        (["--base-url", "http://127.0.0.1:1/v1"], "--base-url needs --model NAME"),
        (["--script", "x.json", "--model", "m"], "--model and --api-key-env go with --base-url"),
        (["--script", "x.json", "--base-url", "http://h/v1"], "argument --base-url: not allowed with"),
        (["--script", "x.json", "--no-delegate", "--depth-limit", "1"], "--depth-limit limits delegation"),
        (["--script", "x.json", "--depth-limit", "-1"], "argument --depth-limit: must be >= 0, not -1"),
        (["--script", "x.json", "--max-model-calls", "0"], "argument --max-model-calls: must be >= 1, not 0"),
        (["--base-url", "ftp://host/v1", "--model", "m"], "base_url must be an http(s) URL"),
        (
            ["--script", "x.json", "--no-background", "--max-background", "2"],
            "--max-background tunes background delegation; it has no meaning with --no-background",
        ),
        (
            ["--script", "x.json", "--no-delegate", "--spill-dir", "d"],
            "--spill-dir tunes background delegation; it has no meaning with --no-delegate",
        ),
        (["--script", "x.json", "--max-background", "0"], "argument --max-background: must be >= 1, not 0"),
        (["--script", "x.json", "--spill-bytes", "-1"], "argument --spill-bytes: must be >= 0, not -1"),
        (
            ["--script", "x.json", "--no-delegate", "--acp", "agent"],
            "--acp is a provider to delegate to; it has no meaning with --no-delegate",
        ),
        (["--script", "x.json", "--acp", " "], "--acp needs a command"),
        (["--script", "x.json", "--acp", "a 'b"], "--acp: not a command line: No closing quotation"),
    ],
)
def test_serve_refuses_bad_usage_with_exit_status_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["serve", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "subagent serve: error: " + message in captured.err


def test_serve_takes_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--script", str(FIXTURE), "--", "echo"]) == 2
    assert "serve takes no `-- COMMAND`: it is the agent" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot read the script {path!r}: No such file or directory"),
        ("{not json", "the script {path!r} is not valid: the script is not valid JSON: "),
        ('{"replies": 3}', "the script {path!r} is not valid: a script is a list of replies"),
        ('[{"txt": "typo"}]', "the script {path!r} is not valid: reply 0: unknown keys txt"),
    ],
)
def test_serve_with_an_unusable_script_exits_2_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, problem: str
) -> None:
    path = tmp_path / "script.json"
    if content is not None:
        path.write_text(content)
    assert main(["serve", "--script", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "subagent serve: error: " + problem.format(path=str(path)) in captured.err


def test_serve_help_states_the_runtimes_default_model_call_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--help"]) == 0
    assert f"(default: {DEFAULT_MAX_MODEL_CALLS})" in " ".join(capsys.readouterr().out.split())


def test_serve_help_states_the_background_defaults_of_the_library(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"more are queued (default: {DEFAULT_MAX_RUNNING})" in help_text
    assert f"(default: {DEFAULT_SPILL_BYTES}; 0: never)" in help_text


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], BackgroundOptions()),
        (["--max-background", "2"], BackgroundOptions(max_running=2)),
        (["--spill-bytes", "0"], BackgroundOptions(spill_bytes=None)),
        (["--spill-bytes", "100", "--spill-dir", "out"], BackgroundOptions(spill_bytes=100, run_dir="out")),
    ],
)
def test_the_background_flags_become_the_served_agents_options(
    flags: list[str], expected: BackgroundOptions
) -> None:
    parser = Parser(prog="subagent serve")
    _add_serve_arguments(parser)
    assert _background_options(parser.parse_args(["--script", "x.json", *flags])) == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "give either a script file or a base URL and a model name"),
        ({"script": "x.json", "base_url": "http://h/v1"}, "give either a script file or a base URL"),
        ({"base_url": "http://127.0.0.1:1/v1"}, "a base URL needs a model name"),
    ],
)
def test_build_llm_needs_exactly_one_model_source(options: dict[str, str], message: str) -> None:
    with pytest.raises(ServeConfigError, match=message):
        build_llm(**options)


def test_build_llm_reads_a_script_file_into_a_scripted_llm() -> None:
    assert isinstance(build_llm(script=FIXTURE), ScriptedLlm)
