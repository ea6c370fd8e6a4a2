"""A parent process for the durable-delegation kill tests (tests/test_durable_kill.py).

``python -m tests.durable_parent JOURNAL ORACLE MODEL_LOG SCENARIO SEED BACKEND`` opens a service with the
run journal JOURNAL and starts 10 children at once: 6 in process (``spawn``, a scripted model) and 4 ACP
stub agents, 2 of the 10 through background delegation. Each child runs its first turn, and some a second.
Every fact the parent learns (a child started, a turn's result) is printed as a JSON line on stdout and
appended, fsynced, to ORACLE: what the test then holds the journal to. The scripted model appends each
request it answers to MODEL_LOG, so the test can tell that no completed turn ran twice. The test kills
this process with SIGKILL after a random number of those lines.
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

import anyio

from subagent import SubagentRequest, SubagentService
from subagent.delegation import BackgroundChildren
from subagent.providers.acp import AcpProvider
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import CompletionRequest, Reply, ScriptedLlm
from subagent.testing import stub_agent_argv

CHILDREN = 10
ACP_CHILDREN = 4
BACKGROUND = (4, 9)  # which children start in the background (one in process, one ACP)
BACKGROUND_PARENT = "lead"


class Oracle:
    """What the parent learned, in order: each line written and fsynced before it is printed."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115  (open for the process's life)

    def note(self, **fact: Any) -> None:
        line = json.dumps(fact, sort_keys=True)
        self._file.write(line + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        print(line, flush=True)  # noqa: T201  (the test reads the facts from stdout)


def scripted_model(model_log: str, rng: random.Random) -> ScriptedLlm:
    """A model that answers each turn ``answer: <its prompt>`` after a random pause, logging the request."""

    def answer(request: CompletionRequest) -> Reply:
        users = [message.content for message in request.messages if message.role == "user"]
        with open(model_log, "a", encoding="utf-8") as log:
            log.write(json.dumps({"users": users}) + "\n")
            log.flush()
            os.fsync(log.fileno())
        pause = rng.uniform(0.0, 0.15)
        return Reply(text=f"answer: {users[-1]}", wait=lambda: anyio.sleep(pause))

    return ScriptedLlm(answer)


def providers(model_log: str, scenario: str, rng: random.Random) -> tuple[SpawnProvider, AcpProvider]:
    """The two providers, as the parent and the test's restart both register them."""
    spawn = SpawnProvider(name="spawn", llm=scripted_model(model_log, rng))
    acp = AcpProvider(stub_agent_argv(scenario), name="acp", ready_timeout=30)
    return spawn, acp


async def child(
    service: SubagentService,
    background: BackgroundChildren,
    oracle: Oracle,
    rng: random.Random,
    seed: int,
    index: int,
) -> None:
    provider = "acp" if index >= CHILDREN - ACP_CHILDREN else "spawn"
    prompt = f"task {seed}-{index}"
    if index in BACKGROUND:
        info = await background.start(
            BACKGROUND_PARENT, provider, SubagentRequest(prompt=prompt, parent_id=BACKGROUND_PARENT)
        )
        oracle.note(event="started", child=index, provider=provider, background=True, runId=info.run_id)
        outcome = await background.wait(BACKGROUND_PARENT, [info.handle], timeout=60)
        for notice in outcome.ended:
            oracle.note(
                event="turn",
                child=index,
                turn=1,
                prompt=prompt,
                output=notice.result.output,
                stopReason=notice.result.stop_reason,
                runId=notice.child.run_id,
            )
        return
    await anyio.sleep(rng.uniform(0.0, 0.1))  # the children start at different moments
    async with service.start(provider, SubagentRequest(prompt=prompt)) as run:
        await run.started()
        oracle.note(event="started", child=index, provider=provider, journalId=run.journal_id)
        result = await run.result()
        oracle.note(
            event="turn",
            child=index,
            turn=1,
            prompt=prompt,
            journalId=run.journal_id,
            output=result.output,
            stopReason=result.stop_reason,
        )
        if index % 2 == 0:
            more = f"more {seed}-{index}"
            result = await run.resume(more)  # type: ignore[attr-defined]
            oracle.note(
                event="turn",
                child=index,
                turn=2,
                prompt=more,
                journalId=run.journal_id,
                output=result.output,
                stopReason=result.stop_reason,
            )


async def main(journal: str, oracle_path: str, model_log: str, scenario: str, seed: int) -> None:
    rng = random.Random(seed)
    oracle = Oracle(oracle_path)
    spawn, acp = providers(model_log, scenario, rng)
    async with SubagentService(journal=journal, progress_interval=0.05) as service:
        service.register_provider(spawn)
        service.register_provider(acp)
        oracle.note(event="open")
        async with BackgroundChildren(service) as background, anyio.create_task_group() as children:
            for index in range(CHILDREN):
                children.start_soon(child, service, background, oracle, rng, seed, index)
    oracle.note(event="closed")


if __name__ == "__main__":
    journal, oracle_path, model_log, scenario, seed, backend = sys.argv[1:7]
    anyio.run(main, journal, oracle_path, model_log, scenario, int(seed), backend=backend)
