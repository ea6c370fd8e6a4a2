"""Durable delegation under fire: a parent SIGKILLed at a random point, then restarted, on asyncio and trio.

Each test runs one parent (tests/durable_parent.py: 10 children at once, in process and ACP stub agents,
two of them in the background, some taking a second turn), kills it with SIGKILL after a random number of
the facts it reports, and then, as the restarted parent, holds the journal to what the killed one had
learned:

* nothing of the killed parent outlives it (its ACP agents, their supervisors);
* no run is lost: every child the parent saw start is in the journal, and none is left live;
* every turn whose result the parent saw is in the journal (a result is committed before its caller
  gets it), with that result when it was the run's last;
* every run that did not end is ``interrupted`` (or ``disposed``) and resumes, its new turn completing
  (an ACP child killed before its agent gave it a session starts afresh in a new one: none of its turns
  ran); none is refused;
* no completed turn runs again: the scripted model answered each completed turn's prompt once, and a
  resumed in-process child's model saw its earlier conversation.

50 kills on each backend, one per test, so the suite's workers share them out (run at once in one test,
they only contend for the same two cores).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent import SubagentError, SubagentService
from subagent.journal import LIVE_STATES, RunRecord
from subagent.testing._scenario import dump_scenario, parse_scenario
from tests.durable_parent import BACKGROUND, CHILDREN, providers
from tests.leaks import LEAK_TAG_VARIABLE, leaked_processes

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends, pytest.mark.subprocess]

KILLS = 50
WAIT = 60  # seconds: a hang guard on one step, never a statement about speed
REPO = Path(__file__).resolve().parent.parent

SCENARIO = {
    "resumeSession": {},
    "turns": [[{"step": "sleep", "seconds": 0.05}, {"step": "echo", "prefix": "answer: "}]],
}

# What the parent reports at most: open, 10 starts, 10 first turns, 4 second turns (children 0, 2, 6, 8),
# closed. The kill comes after a random number of them, the last one excluded.
FACTS = 1 + CHILDREN + CHILDREN + 4 + 1


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_and_kill(command: list[str], env: dict[str, str], after: int) -> int:
    """Run the parent; SIGKILL it once it has reported ``after`` facts. Returns how many it reported."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, env=env, cwd=REPO, text=True)
    assert process.stdout is not None
    seen = 0
    try:
        while seen < after:
            line = process.stdout.readline()
            if not line:
                break  # it ended on its own (a failure the checks below will show)
            seen += 1
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=WAIT)
        process.stdout.close()
    return seen


async def gone(tag: str) -> list[Any]:
    """Wait (bounded) until nothing tagged ``tag`` runs; what still runs then."""
    with anyio.move_on_after(WAIT):
        while leaked_processes(tag):  # noqa: ASYNC110  (no event tells of another process's death)
            await anyio.sleep(0.05)  # a poll interval: the wait is bounded above
    return leaked_processes(tag)


@pytest.mark.parametrize("seed", range(KILLS))
async def test_a_parent_killed_at_a_random_point_loses_no_run_and_reruns_no_completed_turn(
    seed: int, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, anyio_backend: str
) -> None:
    tallies: list[dict[str, Any]] = []
    await kill_and_restart(seed, tmp_path, anyio_backend, tallies)
    assert leaked_processes() == []
    # A record for people (what the kills hit), never asserted: durable-kill.jsonl in pytest's base temp.
    with (tmp_path_factory.getbasetemp() / "durable-kill.jsonl").open("a") as log:
        log.writelines(json.dumps(tally) + "\n" for tally in tallies)


async def kill_and_restart(seed: int, directory: Path, backend: str, tallies: list[dict[str, Any]]) -> None:
    """One parent killed after a random number of facts, then its journal checked and its runs resumed."""
    directory.mkdir(exist_ok=True)  # noqa: ASYNC240  (a test's own directory, before anything runs)
    journal = directory / "runs.db"
    oracle_path = directory / "oracle.jsonl"
    model_log = directory / "model.jsonl"
    scenario = directory / "scenario.json"
    scenario.write_text(dump_scenario(parse_scenario(SCENARIO)))
    tag = f"durable-kill-{os.getpid()}-{seed}-{backend}"
    env = {**os.environ, LEAK_TAG_VARIABLE: tag, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "tests.durable_parent",
        str(journal),
        str(oracle_path),
        str(model_log),
        str(scenario),
        str(seed),
        backend,
    ]
    after = random.Random(seed).randrange(FACTS - 1)
    seen = await anyio.to_thread.run_sync(run_and_kill, command, env, after)
    assert seen == after, f"the parent ended after {seen} facts, before its kill at {after}"

    # The supervisor's guarantee: nothing of the killed parent is left.
    assert await gone(tag) == []

    facts = read_lines(oracle_path)
    spawn, acp = providers(str(model_log), str(scenario), random.Random(seed + 1))
    resumed: dict[str, str] = {}
    refused: dict[str, str] = {}
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=journal) as service:
            service.register_provider(spawn)
            service.register_provider(acp)
            records = {record.prompt: record for record in await service.runs(limit=None)}
            check_journal_against_facts(records, facts, seed)
            for record in records.values():
                if record.state in ("ended", "failed") and not (
                    record.state == "ended" and record.stop_reason != "completed"
                ):
                    continue
                try:
                    run = await service.resume(record.id)
                except SubagentError as exc:
                    refused[record.id] = f"{exc.code.value}: {exc.message}"
                    continue
                async with run:
                    result = await run.result()
                assert result.stop_reason == "completed", (record, result)
                resumed[record.id] = result.output
            after_resume = {record.id: record for record in await service.runs(limit=None)}
    check_resumed(records, after_resume, resumed, refused)
    check_no_completed_turn_ran_twice(records, after_resume, read_lines(model_log))
    tallies.append(
        {
            "seed": seed,
            "backend": backend,
            "killedAfterFacts": after,
            "states": dict(Counter(record.state for record in records.values())),
            "turnsKept": sum(record.turns for record in records.values()),
            "resumed": len(resumed),
            "refused": len(refused),
        }
    )


def check_journal_against_facts(
    records: dict[str, RunRecord], facts: list[dict[str, Any]], seed: int
) -> None:
    """Every child the parent saw start is journaled, none is live, and every turn result it saw is kept."""
    assert all(record.state not in LIVE_STATES for record in records.values()), records
    for fact in facts:
        if fact["event"] not in ("started", "turn"):
            continue
        record = records.get(f"task {seed}-{fact['child']}")
        assert record is not None, f"lost: {fact}"
        if fact["event"] == "started" and "journalId" in fact:
            assert record.id == fact["journalId"]
        if fact["event"] == "turn":
            assert record.turns >= fact["turn"], (fact, record)
            if record.turns == fact["turn"] and record.state == "ended":
                assert record.output == fact["output"], (fact, record)
    started = {fact["child"] for fact in facts if fact["event"] == "started"}
    assert {f"task {seed}-{child}" for child in started} <= set(records)
    assert all(index in range(CHILDREN) for index in started)
    assert set(BACKGROUND) <= set(range(CHILDREN))


def check_resumed(
    before: dict[str, RunRecord],
    after: dict[str, RunRecord],
    resumed: dict[str, str],
    refused: dict[str, str],
) -> None:
    """A resumed run ended completed with one more completed turn; none was refused."""
    for record in before.values():
        if record.id in resumed:
            later = after[record.id]
            assert (later.state, later.stop_reason, later.resumes) == ("ended", "completed", 1)
            assert later.turns == record.turns + 1
            assert later.output == resumed[record.id]
        else:
            # Every run that did not end resumes: an ACP child whose agent never gave it a session (none
            # of its turns ran) starts afresh in a new one.
            assert record.id not in refused, (record, refused[record.id])


def check_no_completed_turn_ran_twice(
    before: dict[str, RunRecord], after: dict[str, RunRecord], model_log: list[dict[str, Any]]
) -> None:
    """The in-process children's model answered each turn's prompt once; a resumed one saw its past."""
    answered = Counter(request["users"][-1] for request in model_log)
    repeated = {prompt: count for prompt, count in answered.items() if count > 1}
    assert repeated == {}
    for record in before.values():
        if record.provider != "spawn" or record.id not in after or after[record.id].resumes == 0:
            continue
        # The resumed turn's request: the completed turns' prompts (each once), then the resume prompt.
        requests = [request["users"] for request in model_log if request["users"][0] == record.prompt]
        if record.turns == 0:
            continue  # nothing completed: the resumed child starts from an empty log
        last = requests[-1]
        assert last[: record.turns] == [record.prompt, *([] if record.turns == 1 else [last[1]])]
        assert len(last) == record.turns + 1
