"""The trace page marks a run its budget stopped: the page's data keeps the run's limit, budget and
spent (from the command line's ``end`` event, and from a run's ``_meta`` where its end carries them),
checked and escaped like the rest, and a headless chromium shows the badge on the bar and the limit and
the spent beside each cap in the details (tests/chromium.py; skipped without chromium).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Final

import anyio
import pytest

from subagent.observability import TraceBuilder, render_trace_page
from subagent.types import RUN_META_KEY
from tests.chromium import open_page

LIMIT: Final = {"limit": "max_tokens", "allowed": 10_000, "spent": 10_312, "owner": "run-1", "needed": None}
BUDGET: Final = {"max_tokens": 10_000, "max_cost": 0.5}
SPENT: Final = {
    "tokens": 10_312,
    "cost": 0.0412,
    "costCurrency": "USD",
    "seconds": 3.25,
    "toolCalls": 2,
    "turns": 4,
}


def event(kind: str, when: float, **fields: Any) -> dict[str, Any]:
    return {"event": kind, "time": when, **fields}


def child_ended_by_budget(when: float, limit: Any = LIMIT) -> list[dict[str, Any]]:
    """A child run ``child`` of the root, started then ended ``budget``, its end's ``_meta`` carrying its
    budget (as ``subagent serve`` relays a run's end)."""
    meta = {"runId": "child", "parentId": "run-1", "provider": "spawn", "depth": 1, "state": "failed",
            "stopReason": "budget", "limit": limit, "budget": {"max_tool_calls": 3},
            "spent": {"toolCalls": 4, "tokens": 99}}  # fmt: skip
    update = {"sessionUpdate": "tool_call_update", "toolCallId": "run/child", "status": "failed",
              "content": [{"type": "content", "content": {"type": "text", "text": "the run stopped"}}],
              "_meta": {RUN_META_KEY: meta}}  # fmt: skip
    return [
        event(
            "run",
            when,
            runId="child",
            parentId="run-1",
            provider="spawn",
            state="running",
            title="spawn subagent: count",
        ),
        event("update", when + 1, sessionId="s", update=update),
        event(
            "run",
            when + 1,
            runId="child",
            parentId="run-1",
            provider="spawn",
            state="failed",
            stopReason="budget",
            title="spawn subagent: count",
        ),
    ]


def budget_run() -> list[dict[str, Any]]:
    return [
        event("start", 100.0, runId="run-1", sessionId="s"),
        *child_ended_by_budget(100.5),
        event(
            "end",
            104.0,
            stopReason="budget",
            error=None,
            usage=None,
            elapsed=4.0,
            outputFinal=False,
            limit=LIMIT,
            budget=BUDGET,
            spent=SPENT,
        ),
    ]


def rows_of(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    builder = TraceBuilder()
    for item in events:
        builder.add(item)
    return {row["id"]: row for row in builder.data()["runs"]}


def test_the_roots_end_gives_the_page_its_limit_budget_and_spent() -> None:
    root = rows_of(budget_run())["run-1"]
    assert (root["state"], root["stopReason"]) == ("stopped", "budget")
    assert root["limit"] == {**LIMIT, "allowed": 10_000.0, "spent": 10_312.0}
    assert root["budget"] == {"max_tokens": 10_000.0, "max_cost": 0.5}
    assert root["spent"] == SPENT


def test_a_childs_end_meta_gives_the_page_its_limit_budget_and_spent() -> None:
    child = rows_of(budget_run())["child"]
    assert child["stopReason"] == "budget"
    assert child["limit"]["limit"] == "max_tokens"
    assert child["budget"] == {"max_tool_calls": 3.0}
    assert child["spent"] == {"toolCalls": 4, "tokens": 99}


def test_a_run_without_a_budget_has_none_on_the_page() -> None:
    rows = rows_of([event("start", 1.0, runId="r"), event("end", 2.0, stopReason="completed")])
    assert (rows["r"]["limit"], rows["r"]["budget"], rows["r"]["spent"]) == (None, None, None)


@pytest.mark.parametrize(
    "limit",
    [
        {"limit": "max_money", "allowed": 1, "spent": 2},
        {"limit": "max_tokens", "allowed": "ten", "spent": 2},
        {"limit": "max_tokens", "allowed": 1, "spent": float("inf")},
        {"limit": "max_tokens", "allowed": True, "spent": 2},
        "max_tokens",
        None,
    ],
)
def test_a_limit_that_is_not_one_is_left_off_the_page(limit: Any) -> None:
    rows = rows_of([event("start", 1.0, runId="r"), *child_ended_by_budget(1.5, limit)])
    assert rows["child"]["limit"] is None


def test_hostile_budget_values_are_dropped_cut_or_escaped_never_markup() -> None:
    hostile = "</script><script>alert(1)</script>"
    page = render_trace_page(
        [
            event("start", 1.0, runId="r"),
            event(
                "end",
                2.0,
                stopReason="budget",
                limit={"limit": "max_turns", "allowed": 3, "spent": 4, "owner": hostile, "needed": "x"},
                budget={"max_turns": 3, "max_tokens": -5, "evil": hostile},
                spent={"turns": 4, "tokens": -1, "costCurrency": hostile * 3, "seconds": "1"},
            ),
        ]
    )
    assert hostile not in page
    data = json.loads(re.search(r'id="trace-data">(.*?)</script>', page, re.S).group(1))  # type: ignore[union-attr]
    [root] = data["runs"]
    assert root["limit"] == {
        "limit": "max_turns",
        "allowed": 3.0,
        "spent": 4.0,
        "owner": hostile,
        "needed": None,
    }
    assert root["budget"] == {"max_turns": 3.0}
    assert root["spent"] == {"turns": 4, "costCurrency": hostile[:15] + "\u2026"}


ROW_BADGES: Final = """[...document.querySelectorAll("#rows .row")].map((row) => ({
    badge: row.querySelector(".bar .badge")?.textContent ?? null,
    capped: row.querySelector(".bar").classList.contains("capped"),
    hover: row.querySelector(".bar").title,
}))"""

BUDGET_DETAILS: Final = """(() => {
    const pairs = (selector) => Object.fromEntries([...document.querySelectorAll(selector + " dt")].map(
        (dt) => [dt.textContent, dt.nextElementSibling.textContent]));
    return {fields: pairs("#details dl:first-of-type"), budget: pairs("#detail-budget")};
})()"""


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_chromium_marks_a_run_its_budget_stopped_with_a_badge_and_the_limit_in_its_details(
    tmp_path: Path,
) -> None:
    page_file = tmp_path / "trace.html"
    page_file.write_text(render_trace_page(budget_run(), "budget"))
    with anyio.fail_after(60):
        async with open_page(tmp_path) as page:
            await page.open(page_file.as_uri())
            await page.wait_for_ready()
            rows = await page.evaluate(ROW_BADGES)
            assert [(row["badge"], row["capped"]) for row in rows] == [
                ("budget: max_tokens 10,312 of 10,000", True),
                ("budget: max_tokens 10,312 of 10,000", True),
            ]
            assert "stopped by its budget: max_tokens 10,312 of 10,000" in rows[0]["hover"].splitlines()
            await page.click('#rows .row[data-index="0"] .label')
            details = await page.evaluate(BUDGET_DETAILS)
            assert details["fields"]["limit"] == "max_tokens 10,312 of 10,000 (the budget of run-1)"
            assert details["budget"] == {"max_tokens": "10,312 of 10,000", "max_cost": "0.0412 of 0.5 USD"}
            await page.click('#rows .row[data-index="1"] .label')
            details = await page.evaluate(BUDGET_DETAILS)
            assert details["budget"] == {"max_tool_calls": "4 of 3"}
            assert page.dialogs == []
