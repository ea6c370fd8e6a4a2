"""A real agent stopped by its budget: Claude Code, through ``claude-agent-acp``, under ``subagent run
--max-cost``, offline against the scripted Anthropic Messages server (see `tests.test_real_agents`).

What ``claude-agent-acp`` (0.101.0, pinned by ``make interop``) reports of its spending, as observed here
and read from its ``acp-agent.js``: during a turn, after each model call, a ``usage_update`` with the
context window only (``used``, ``size``); the session's cost, ``cost: {amount, currency: "USD"}``, once a
turn, in the ``usage_update`` it sends at the Claude Agent SDK's ``result`` message, i.e. at the turn's
end, just before the prompt response (which carries the turn's token counts). Claude Code prices the
model it asks for (``claude-opus-5-5`` by default, which the fake server names in its replies) at
$4 per million input tokens and $20 per million output tokens (measured: a turn of one call of 1,000
input tokens and none out costs $0.004 more than one of a call of neither, and 1,000 output tokens
$0.020 more). Its side call at the turn's start (a call without tools: a session title) counts in the
turn's cost but not in its token counts; its call after the turn's answer (a prompt suggestion) is in
neither, as it comes after the report.

So a cost cap over this agent is checked once a turn: a turn of several model calls whose first call
already passes the cap runs to its end, and the cap is passed by the whole turn's cost (issue 24's bound
for an ACP child, "at most the usage between two reports", with one report a turn), not by one model
call's. The provider then ends the run ``budget`` all the same (the report came before the prompt
response, and a cap passed during the turn stops it whatever the agent answers): exit status 3.

For contrast, a cap over what it does report during a turn: under ``--max-tool-calls`` the turn is
cancelled at the tool call that passes the cap, mid-call, and Claude Code reports its cost at the cancel.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest

from subagent import Price
from subagent.testing import MessagesReply, MessagesRequest, ToolUse, serve_anthropic_messages
from tests.test_real_agents import (
    Finished,
    ModelLog,
    Serve,
    Served,
    Turn,
    claude_env,
    make_agent,
    run_cli,
    text_chunks,
)

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess, pytest.mark.real_agent]

CLAUDE_MODEL: Final = "claude-opus-5-5"
"""The model Claude Code asks for by default (the fake server answers in its name)."""
CLAUDE_PRICE: Final = Price(input=4.0, output=20.0)
"""What Claude Code charges for `CLAUDE_MODEL`, per million tokens (measured: see the module docstring)."""

STEPS: Final = 3
"""The turn's model calls that each call a tool, before the one that closes it."""
CALL_USAGE: Final = (1_000, 100)
"""(input, output) tokens of each of the turn's model calls: $0.006 each at `CLAUDE_PRICE`."""
SIDE_USAGE: Final = (10, 5)
"""(input, output) tokens of a side call (a session title)."""
MAX_COST: Final = 0.005
"""The cap, in USD: below one model call's cost, so the first call of the turn passes it."""
CLOSING: Final = "Done."
STALL_AFTER: Final = 5
"""message_start, the text block's start, its one delta and its stop, the tool_use block's start: then a
stalled call hangs, its tool call announced and its input never complete."""
SIDE_TEXT: Final = "Stub title"


@pytest.fixture
def anyio_backend() -> str:
    """One backend: what is under test is the CLI subprocess, whose loop is its own."""
    return "asyncio"


def step_text(step: int) -> str:
    return f"Step {step}. "


@dataclass(frozen=True, slots=True)
class Call:
    """One model call the fake server answered: the model asked for, its usage, and whether it came after
    the turn's closing answer (Claude Code's prompt suggestion, made once the turn's cost is reported)."""

    model: str
    input_tokens: int
    output_tokens: int
    after_turn: bool

    def cost(self) -> float:
        """What the call cost at `CLAUDE_PRICE`, in USD."""
        return (self.input_tokens * CLAUDE_PRICE.input + self.output_tokens * CLAUDE_PRICE.output) / 1e6


@dataclass
class CostLog(ModelLog):
    """`ModelLog`, and every model call the fake server answered."""

    calls: list[Call] = field(default_factory=list)

    def turn_calls(self) -> list[Call]:
        """The calls up to the turn's closing answer: what the turn's cost report covers."""
        return [call for call in self.calls if not call.after_turn]


def _closed(messages: list[Any]) -> bool:
    """Whether ``messages`` hold the model's closing answer: the call comes after the turn."""
    return any(
        isinstance(message, dict)
        and message.get("role") == "assistant"
        and CLOSING in str(message.get("content"))
        for message in messages
    )


def serve_steps(workdir: Path, *, stall_at: int | None = None) -> Serve:
    """A `tests.test_real_agents.Serve` whose model writes ``step<N>.txt`` in ``workdir`` for each of
    `STEPS` calls (one tool call each), then closes the turn with `CLOSING`; every call reports usage.
    ``stall_at``: the call of that step hangs once its tool call has started (`STALL_AFTER` events), until
    the agent hangs up."""

    @asynccontextmanager
    async def serve(turn: Turn, home: Path) -> AsyncIterator[tuple[Served, dict[str, str], ModelLog]]:
        log = CostLog()

        def respond(request: MessagesRequest) -> MessagesReply:
            model = str((request.json or {}).get("model"))
            messages = request.messages
            if not request.tool_names or _closed(messages):
                log.calls.append(Call(model, *SIDE_USAGE, after_turn=_closed(messages)))
                return MessagesReply(text=SIDE_TEXT, input_tokens=SIDE_USAGE[0], output_tokens=SIDE_USAGE[1])
            # The turn's step is how many answers of the model's it has been sent back.
            step = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
            if step == 0:
                log.started += 1
            log.calls.append(Call(model, *CALL_USAGE, after_turn=False))
            inputs, outputs = CALL_USAGE
            if step < STEPS:
                write = {"file_path": str(workdir / f"step{step}.txt"), "content": f"{step}\n"}
                use = ToolUse(f"toolu_step_{step}", "Write", write)
                stall = STALL_AFTER if step == stall_at else None
                if stall is not None:
                    log.stalled.append(request.disconnected)
                return MessagesReply(
                    text=step_text(step),
                    tool_uses=[use],
                    input_tokens=inputs,
                    output_tokens=outputs,
                    stall_after=stall,
                )
            return MessagesReply(text=CLOSING, input_tokens=inputs, output_tokens=outputs)

        async with serve_anthropic_messages(respond) as server:
            yield server, claude_env(home, server.base_url), log

    return serve


def usage_updates(finished: Finished) -> list[dict[str, Any]]:
    return [
        event["update"]
        for event in finished.of("update")
        if event["update"]["sessionUpdate"] == "usage_update"
    ]


async def test_claude_agent_acp_past_its_cost_cap_ends_budget_with_exit_3_at_its_turns_one_cost_report(
    tmp_path: Path,
) -> None:
    workdir = tmp_path / "work"
    agent = dataclasses.replace(make_agent("claude"), serve=serve_steps(workdir))
    # run_cli also checks that no process of the agent's outlived the CLI (the leak tag in its environment).
    finished, _, log = await run_cli(
        agent, Turn(), tmp_path, permission="allow", options=("--max-cost", str(MAX_COST))
    )
    assert isinstance(log, CostLog)
    assert {call.model for call in log.calls} == {CLAUDE_MODEL}  # the model whose price is known

    # What claude-agent-acp reported: the cost once, at the turn's end, after every model call.
    costs = [update["cost"] for update in usage_updates(finished) if "cost" in update]
    assert len(costs) == 1, usage_updates(finished)
    (reported,) = costs
    assert reported["currency"] == "USD"
    assert reported["amount"] == pytest.approx(sum(call.cost() for call in log.turn_calls()), rel=1e-9)
    updates = [event["update"] for event in finished.of("update")]
    closing = [u for u in updates if u["sessionUpdate"] == "agent_message_chunk"][-1]
    assert closing["content"]["text"] == CLOSING
    (report,) = [u for u in updates if "cost" in u]
    assert updates.index(report) > updates.index(
        closing
    )  # after the closing answer's text (a title may follow)
    # So the cap, passed by the first call already, was seen passed only at the turn's end: every step ran.
    assert log.started == 1
    turn_calls = STEPS + 1  # the steps and the closing call
    side = Call(CLAUDE_MODEL, *SIDE_USAGE, after_turn=False)  # a call without tools: a session title
    step = Call(CLAUDE_MODEL, *CALL_USAGE, after_turn=False)
    assert Counter(log.turn_calls()) == Counter({side: 1, step: turn_calls})
    assert sorted(path.name for path in workdir.glob("step*.txt")) == [f"step{n}.txt" for n in range(STEPS)]
    assert text_chunks(finished) == [*map(step_text, range(STEPS)), CLOSING]

    result = finished.result
    assert finished.status == 3
    assert result["stopReason"] == "budget"
    spent = result["spent"]
    assert spent["costCurrency"] == "USD"
    # The bound asserted is the ACP one, "at most the usage between two reports": spent is exactly the one
    # report's amount (the session cost nothing before it), so the cap is passed by less than what was spent
    # since the report before (none). With one report a turn, that is the whole turn's cost (its four calls
    # and the title), more than one model call's past the cap: the gap, asserted so that an agent that
    # reports its cost after each call shows up here.
    assert spent["cost"] == reported["amount"] > MAX_COST
    one_call = (CALL_USAGE[0] * CLAUDE_PRICE.input + CALL_USAGE[1] * CLAUDE_PRICE.output) / 1e6
    assert spent["cost"] - MAX_COST > one_call
    assert result["limit"] == {
        "limit": "max_cost",
        "allowed": MAX_COST,
        "spent": spent["cost"],
        "owner": "acp-1",
        "needed": None,
    }
    assert result["budget"] == {"max_cost": MAX_COST}
    assert (
        result["error"] == "stopped by its budget: max_cost: 0.02414 spent of 0.005 USD (the budget of acp-1)"
    )
    # The output is kept (the agent's closing text: it answered end_turn, so it is its final message); the
    # usage too.
    assert (result["output"], result["outputFinal"]) == (CLOSING, True)
    # The title is in the turn's cost, not in its token counts.
    turn_tokens = turn_calls * sum(CALL_USAGE)
    assert (result["usage"]["inputTokens"], result["usage"]["outputTokens"]) == (
        turn_calls * CALL_USAGE[0],
        turn_calls * CALL_USAGE[1],
    )
    assert result["usage"]["cost"] == reported
    assert spent["tokens"] == turn_tokens
    assert spent["toolCalls"] == STEPS
    end = finished.events[-1]
    assert end["event"] == "end"
    assert (end["stopReason"], end["limit"], end["spent"]["cost"]) == (
        "budget",
        result["limit"],
        spent["cost"],
    )


async def test_claude_agent_acp_past_its_tool_call_cap_is_stopped_mid_turn_and_reports_its_cost_at_the_cancel(
    tmp_path: Path,
) -> None:
    # What a cap over something claude-agent-acp reports during a turn does: each tool call is announced as
    # the model starts it, so the second one passes the cap while the model is still mid-call (it stalls
    # there, so nothing else can end the turn) and the turn is cancelled then and there.
    workdir = tmp_path / "work"
    agent = dataclasses.replace(make_agent("claude"), serve=serve_steps(workdir, stall_at=1))
    # run_cli also waits for the stalled call to be hung up on, and checks no process outlived the CLI.
    finished, _, log = await run_cli(
        agent, Turn(), tmp_path, permission="allow", options=("--max-tool-calls", "1")
    )
    assert isinstance(log, CostLog)
    result = finished.result
    assert finished.status == 3
    assert result["stopReason"] == "budget"
    limit = {"limit": "max_tool_calls", "allowed": 1, "spent": 2, "owner": "acp-1", "needed": None}
    assert result["limit"] == limit
    assert result["budget"] == {"max_tool_calls": 1}
    assert (
        result["error"]
        == "stopped by its budget: max_tool_calls: 2 spent of 1 tool call (the budget of acp-1)"
    )
    assert (result["output"], result["outputFinal"]) == ("", False)  # no text after the last tool call
    # The first step ran; the second never did (Claude Code says so of it), and no call came after it.
    assert (workdir / "step0.txt").read_text() == "0\n"
    assert not (workdir / "step1.txt").exists()
    (stopped,) = [
        update
        for event in finished.of("update")
        if (update := event["update"])["sessionUpdate"] == "tool_call_update"
        and update["toolCallId"] == "toolu_step_1"
    ]
    assert stopped["status"] == "failed"
    side = Call(CLAUDE_MODEL, *SIDE_USAGE, after_turn=False)
    step = Call(CLAUDE_MODEL, *CALL_USAGE, after_turn=False)
    assert Counter(log.turn_calls()) == Counter({side: 1, step: 2})
    # Claude Code reports its cost at the cancel too: the title and the first step's call, the stalled call
    # (whose usage never completed) not priced. The turn's token counts are the first step's.
    (reported,) = [update["cost"] for update in usage_updates(finished) if "cost" in update]
    assert reported["currency"] == "USD"
    assert reported["amount"] == pytest.approx(side.cost() + step.cost(), rel=1e-9)
    assert (result["usage"]["inputTokens"], result["usage"]["outputTokens"]) == CALL_USAGE
    spent = result["spent"]
    assert (spent["toolCalls"], spent["tokens"], spent["cost"], spent["costCurrency"]) == (
        2,
        sum(CALL_USAGE),
        reported["amount"],
        "USD",
    )
    end = finished.events[-1]
    assert (end["event"], end["stopReason"], end["limit"]) == ("end", "budget", limit)
