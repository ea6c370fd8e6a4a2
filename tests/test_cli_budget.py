"""Budgets on the command line: the ``--max-*`` flags and ``--reports-usage``, the config's per-agent
keys, ``[budget]`` and ``[prices]`` with their precedence, the checks of bad values, and how a run's
budget is reported (human lines, ``--json``, the ``end`` event, exit status 3 for a budget stop).

A run that really passes a cap needs an acp provider that enforces one (being added beside this): until
then the stop is reported from a result made here, and the end-to-end run is one under a cap the
provider is made to declare, which then completes within it.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

import subagent.cli._commands as commands
from subagent import Budget, LimitHit, Price, Spend, SubagentResult
from subagent.cli import main
from subagent.cli._config import ConfigError, load_config
from subagent.cli._console import Console
from subagent.cli._exits import EXIT_BUDGET
from subagent.cli._turn import TurnOutcome, TurnSpec
from subagent.cli._views import EventView

STUB = [sys.executable, "-m", "subagent.testing.stub_agent"]


@pytest.fixture
def root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty directory to run in, with no user config."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path


@pytest.fixture
def specs(monkeypatch: pytest.MonkeyPatch) -> list[TurnSpec]:
    """The specs of the turns the command line would run (none is run)."""
    kept: list[TurnSpec] = []

    def probe(spec: TurnSpec) -> int:
        if spec.answers is not None:
            spec.answers.close()
        kept.append(spec)
        return 0

    monkeypatch.setattr(commands, "_execute", probe)
    return kept


CONFIG = """\
[budget]
max_tokens = 50000
max_seconds = 600

[prices]
currency = "EUR"

[prices."model-a"]
input = 3.0
output = 15.0
cached_read = 0.3

[agents.a]
command = "configured-agent"
max_tokens = 20000
max_tool_calls = 30
reports_usage = ["tokens", "cost"]
"""


def test_a_flag_wins_over_the_agents_key_which_wins_over_the_budget_table(
    root: Path, specs: list[TurnSpec]
) -> None:
    (root / "subagent.toml").write_text(CONFIG)
    assert main(["run", "-p", "hi", "--agent", "a", "--max-tool-calls", "5", "--max-cost", "1.5"]) == 0
    [spec] = specs
    assert spec.budget == Budget(max_tokens=20_000, max_cost=1.5, max_seconds=600.0, max_tool_calls=5)
    assert tuple(spec.reports_usage or ()) == ("tokens", "cost")
    assert spec.prices is not None
    assert spec.prices.currency == "EUR"
    assert spec.prices.price("model-a-2025") == Price(input=3.0, output=15.0, cached_read=0.3)


def test_a_run_without_an_agent_or_caps_has_no_budget_and_no_prices(
    root: Path, specs: list[TurnSpec]
) -> None:
    (root / "subagent.toml").write_text(CONFIG)  # for --agent only: a command runs without it
    assert main(["run", "-p", "hi", "--", "agent-command"]) == 0
    [spec] = specs
    assert (spec.budget, spec.prices, spec.reports_usage) == (None, None, None)


def test_reports_usage_takes_a_comma_separated_list_or_none(root: Path, specs: list[TurnSpec]) -> None:
    assert main(["run", "-p", "hi", "--reports-usage", "cost, tokens,cost", "--", "a"]) == 0
    assert main(["run", "-p", "hi", "--reports-usage", "none", "--", "a"]) == 0
    assert [tuple(spec.reports_usage or ()) for spec in specs] == [("cost", "tokens"), ()]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-tokens", "-5"], "argument --max-tokens: must be a whole number >= 0, not '-5'"),
        (["--max-tokens", "lots"], "argument --max-tokens: not a whole number: 'lots'"),
        (["--max-cost", "nan"], "argument --max-cost: must be a number >= 0, not 'nan'"),
        (["--max-cost", "-0.1"], "argument --max-cost: must be a number >= 0, not '-0.1'"),
        (["--max-seconds", "0"], "argument --max-seconds: must be a positive number of seconds, not '0'"),
        (["--max-turns", "1.5"], "argument --max-turns: not a whole number: '1.5'"),
        (
            ["--reports-usage", "tokens,money"],
            "argument --reports-usage: expected a comma-separated list of tokens, cost (or none), "
            "not 'tokens,money'",
        ),
    ],
)
def test_a_bad_budget_flag_is_a_usage_error_with_exit_status_2(
    root: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["run", "-p", "hi", *argv, "--", "agent-command"]) == 2
    assert f"subagent run: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[budget]\nmax_money = 1\n", "budget.max_money: unknown key (known keys: max_tokens, max_cost, "
         "max_seconds, max_tool_calls, max_turns)"),
        ("[budget]\nmax_tokens = -1\n", "budget.max_tokens: must be a whole number >= 0, not -1"),
        ("[budget]\nmax_tokens = 1.5\n", "budget.max_tokens: must be a whole number >= 0, not 1.5"),
        ("[budget]\nmax_seconds = 0\n", "budget.max_seconds: must be a positive number of seconds, not 0"),
        ('[budget]\nmax_cost = "1"\n', "budget.max_cost: must be a number >= 0, not a string ('1')"),
        ("budget = 3\n",
         "budget: must be a table of caps, e.g. [budget] max_tokens = 100000, not a number (3)"),
        ('[prices."m"]\ninput = 1.0\n',
         "prices.m.output: missing: the price per million tokens, e.g. input = 3.0"),
        ('[prices."m"]\ninput = -1\noutput = 1\n',
         "prices.m.input: must be a price per million tokens, a number >= 0, not -1"),
        ('[prices."m"]\ninput = 1\noutput = 1\ncached = 1\n',
         "prices.m.cached: unknown key (known keys: input, output, cached_read, cached_write)"),
        ('[prices]\ncurrency = ""\n',
         "prices.currency: must be a currency's name of 1 to 16 characters, e.g. \"USD\", "
         "not a string ('')"),
        ('[agents.a]\ncommand = "x"\nmax_turns = -2\n',
         "agents.a.max_turns: must be a whole number >= 0, not -2"),
        ('[agents.a]\ncommand = "x"\nreports_usage = ["money"]\n',
         "agents.a.reports_usage[0]: must be \"tokens\" or \"cost\", not 'money'"),
    ],
)  # fmt: skip
def test_a_bad_budget_or_price_in_the_config_is_refused_naming_its_key(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "subagent.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(raised.value) == f"{path}: {message}"


def test_a_cap_the_agent_cannot_be_held_to_is_refused_before_any_agent_starts(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = root / "started"
    agent = ["sh", "-c", f"touch {marker}"]
    assert main(["run", "-p", "hi", "--max-tokens", "100", "--max-turns", "3", "--", *agent]) == 2
    err = capsys.readouterr().err
    assert (
        "--max-tokens, --max-turns: the agent cannot be held to them: it does not report what they count "
        "as it works (the caps it can be held to: --max-seconds, --max-tool-calls). If it does report its "
        "usage, say what with "
        "--reports-usage tokens,cost"
    ) in " ".join(err.split())
    assert not marker.exists()


def test_a_run_under_caps_reports_what_it_spent_beside_each_in_json_and_on_stderr(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    caps = ["--max-tokens", "1000", "--max-tool-calls", "3", "--reports-usage", "tokens"]
    status = main(["run", "-p", "hi", "--json", *caps, "--", *STUB])
    captured = capsys.readouterr()
    assert status == 0
    report = json.loads(captured.out)
    assert report["stopReason"] == "completed"
    assert report["budget"] == {"max_tokens": 1000, "max_tool_calls": 3}
    assert report["limit"] is None
    assert report["outputFinal"] is True
    spent = report["spent"]
    assert isinstance(spent.pop("seconds"), float)
    # The stub agent's turn makes two tool calls and reports no tokens.
    assert spent == {"tokens": 0, "cost": 0.0, "costCurrency": None, "toolCalls": 2, "turns": 0}
    assert "subagent: budget: 0 of 1,000 tokens, 2 of 3 tool calls\n" in captured.err


def test_a_run_past_its_tool_call_cap_is_stopped_exits_3_and_says_which_cap(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["run", "-p", "hi", "--json", "--max-tool-calls", "1", "--", *STUB])
    captured = capsys.readouterr()
    assert status == 3
    report = json.loads(captured.out)
    assert report["stopReason"] == "budget"
    assert report["outputFinal"] is False
    limit = report["limit"]
    assert limit.pop("owner").startswith("acp-")  # the run's own budget
    assert limit == {"limit": "max_tool_calls", "allowed": 1, "spent": 2, "needed": None}
    assert report["spent"]["toolCalls"] == 2
    assert "subagent: the turn was stopped by its budget: max_tool_calls: 2 spent of 1 tool call (the" in (
        captured.err
    )


def stopped_by_budget() -> TurnOutcome:
    return TurnOutcome(
        SubagentResult(
            output="half an ans",
            stop_reason="budget",
            limit=LimitHit(limit="max_tokens", allowed=10_000, spent=10_312, owner="acp-1"),
            spent=Spend(tokens=10_312, cost=0.04, cost_currency="USD", seconds=12.5, tool_calls=2, turns=3),
            budget=Budget(max_tokens=10_000, max_cost=1.0),
        )
    )


def report(spec: TurnSpec, outcome: TurnOutcome) -> tuple[int, str]:
    stream = io.StringIO()
    status = commands._report(spec, outcome, Console(stream, color=False))
    return status, stream.getvalue()


def test_a_run_stopped_by_its_budget_exits_3_naming_the_cap_and_the_spent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, err = report(
        TurnSpec(command=["a"], prompt="p", cwd=".", permission_timeout=1), stopped_by_budget()
    )
    assert status == EXIT_BUDGET == 3
    assert capsys.readouterr().out == "half an ans\n"
    assert err == (
        "subagent: the turn was stopped by its budget: max_tokens: 10,312 spent of 10,000 tokens "
        "(the budget of acp-1)\n"
        "subagent: budget: 10,312 of 10,000 tokens, 0.04 of 1 USD\n"
    )


def test_json_of_a_run_stopped_by_its_budget_has_the_limit_the_budget_and_the_spent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = TurnSpec(command=["a"], prompt="p", cwd=".", permission_timeout=1, json=True)
    status, _ = report(spec, stopped_by_budget())
    assert status == 3
    assert json.loads(capsys.readouterr().out) == {
        "output": "half an ans",
        "stopReason": "budget",
        "error": None,
        "usage": None,
        "outputFinal": False,
        "limit": {
            "limit": "max_tokens",
            "allowed": 10_000,
            "spent": 10_312,
            "owner": "acp-1",
            "needed": None,
        },
        "budget": {"max_tokens": 10_000, "max_cost": 1.0},
        "spent": {
            "tokens": 10_312,
            "cost": 0.04,
            "costCurrency": "USD",
            "seconds": 12.5,
            "toolCalls": 2,
            "turns": 3,
        },
    }


def test_the_end_event_of_a_run_stopped_by_its_budget_carries_the_limit_the_budget_and_the_spent() -> None:
    stream = io.StringIO()
    EventView(stream).ended(stopped_by_budget().result, 12.5)
    event = json.loads(stream.getvalue())
    del event["time"]
    assert event == {
        "event": "end",
        "stopReason": "budget",
        "error": None,
        "usage": None,
        "elapsed": 12.5,
        "outputFinal": False,
        "limit": {
            "limit": "max_tokens",
            "allowed": 10_000,
            "spent": 10_312,
            "owner": "acp-1",
            "needed": None,
        },
        "budget": {"max_tokens": 10_000, "max_cost": 1.0},
        "spent": {
            "tokens": 10_312,
            "cost": 0.04,
            "costCurrency": "USD",
            "seconds": 12.5,
            "toolCalls": 2,
            "turns": 3,
        },
    }


def test_the_end_event_of_a_run_without_a_budget_is_as_it_always_was() -> None:
    stream = io.StringIO()
    EventView(stream).ended(SubagentResult(output="x", stop_reason="completed"), 1.0)
    event = json.loads(stream.getvalue())
    assert set(event) == {"event", "time", "stopReason", "error", "usage", "elapsed"}


def test_run_help_lists_the_budget_flags_and_exit_status_3(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--max-tokens N", "--max-cost X", "--max-seconds S", "--max-tool-calls N", "--max-turns N"):
        assert flag in text
    assert "--reports-usage tokens,cost" in text
    assert "3 the turn was stopped by its budget" in text
