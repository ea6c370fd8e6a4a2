"""The run journal (``subagent.journal``) and the service's use of it, on asyncio and trio.

What is asserted: each run's record and state changes; a result committed before its caller sees it;
interrupted runs (their owner process killed) found, marked and reported once; resume's refusals with
their codes and reasons; the journal surviving a process killed while it writes, refusing a newer schema
and a file that is no journal; secrets redacted; the prompt cut to its documented size; two services
sharing one file; no thread or file descriptor left once a service closes.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup

from subagent import (
    ErrorCode,
    SubagentError,
    SubagentRequest,
    SubagentResult,
    SubagentService,
)
from subagent._journaling import DEFAULT_RESUME_PROMPT
from subagent.journal import PROMPT_MAX_CHARS, SCHEMA_VERSION, JournalError, RunJournal, RunRecord
from subagent.testing.fakes import FakeProvider, FakeRun, completes, waits_until_cancelled
from subagent.types import ResumePoint, SubagentCapabilities
from tests.leaks import open_fd_count

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

WAIT = 10  # seconds; a bound on every wait, never a sleep
SECRET = "sk-test-0123456789abcdef"


class CheckpointedFakeRun(FakeRun):
    """A fake run that says what its turns left (a ``CheckpointedRun``) and takes further turns."""

    turns = 0

    def checkpoint(self) -> Mapping[str, Any] | None:
        return {"turnsSeen": self.turns, "key": SECRET}

    async def resume(self, prompt: str) -> SubagentResult:
        self.turns += 1
        return SubagentResult(output=f"resumed: {prompt}", stop_reason="completed")


class ReopeningFakeProvider(FakeProvider):
    """A fake provider that reopens journaled runs, recording what it was given."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.env = {"AGENT_KEY": SECRET}  # what the service redacts, as it does an ACP provider's env
        self.points: list[ResumePoint] = []
        self.reopened: list[SubagentRequest] = []
        self.refuse: str | None = None

    def describe_agent(self) -> Mapping[str, Any]:
        return {"kind": "fake", "command": ["fake-agent", "--key", SECRET]}

    def reopen(self, request: SubagentRequest, point: ResumePoint, task_group: TaskGroup) -> FakeRun:
        if self.refuse is not None:
            raise SubagentError(ErrorCode.RESUME_UNSUPPORTED, self.refuse, provider=self.name)
        self.points.append(point)
        self.reopened.append(request)
        return self.start(request, task_group)


def provider(autopilot: Any = None, name: str = "fake") -> ReopeningFakeProvider:
    return ReopeningFakeProvider(
        name=name,
        run_class=CheckpointedFakeRun,
        autopilot=autopilot if autopilot is not None else completes("done"),
        capabilities=SubagentCapabilities(depth_limit=True, tool_filter=True),
    )


def journal_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("subagent journal")]


# -- records ----------------------------------------------------------------------------------------------


async def test_a_completed_run_is_recorded_with_its_request_result_checkpoint_and_state_changes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=path) as service:
            service.register_provider(provider())
            request = SubagentRequest(prompt="count the files", cwd=str(tmp_path), depth_limit=2, timeout=30)
            async with service.start("fake", request) as run:
                result = await run.result()
                assert run.journal_id is not None
                # Committed before result() returned: another reader sees it already.
                with RunJournal.open(path) as reader:
                    seen = reader.get(run.journal_id)
            record = await service.run_record(run.journal_id)
    assert result.output == "done"
    assert seen is not None
    assert seen.state == "ended"
    assert seen.stop_reason == "completed"
    assert record is not None
    assert (record.run_id, record.provider, record.state, record.parent, record.parent_id) == (
        run.id,
        "fake",
        "ended",
        None,
        None,
    )
    assert (record.prompt, record.prompt_chars, record.turn_prompt, record.turns) == (
        "count the files",
        15,
        "count the files",
        1,
    )
    assert record.request == {"cwd": str(tmp_path), "depthLimit": 2, "timeout": 30}
    assert record.agent == {"kind": "fake", "command": ["fake-agent", "--key", "[redacted]"]}
    assert record.checkpoint == {"turnsSeen": 0, "key": "[redacted]"}
    assert (record.output, record.error, record.usage) == ("done", None, None)
    assert record.owner["pid"] == os.getpid()
    assert [(item.state, item.detail) for item in record.transitions] == [
        ("starting", None),
        ("running", None),
        ("ended", "completed"),
    ]


async def test_a_run_that_fails_to_start_is_recorded_failed_with_why(tmp_path: Path) -> None:
    from subagent.testing.fakes import fails_to_start

    with anyio.fail_after(WAIT):
        async with SubagentService(journal=tmp_path / "runs.db") as service:
            service.register_provider(provider(fails_to_start("no such agent")))
            run = service.start("fake", SubagentRequest(prompt="hi"))
            with pytest.raises(SubagentError):
                await run.started()
            await run.dispose()
            assert run.journal_id is not None
            record = await service.run_record(run.journal_id)
    assert record is not None
    assert (record.state, record.error) == ("failed", "no such agent")
    assert [item.state for item in record.transitions] == ["starting", "failed"]


async def test_a_run_disposed_before_its_turn_ended_is_recorded_disposed(tmp_path: Path) -> None:
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=tmp_path / "runs.db") as service:
            service.register_provider(provider(waits_until_cancelled()))
            run = service.start("fake", SubagentRequest(prompt="work forever"))
            await run.started()
            await run.dispose()
            assert run.journal_id is not None
            record = await service.run_record(run.journal_id)
    assert record is not None
    assert (record.state, record.turns, record.stop_reason) == ("disposed", 0, None)


async def test_a_child_run_names_its_journaled_parent_and_is_listed_among_its_children(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=tmp_path / "runs.db") as service:
            service.register_provider(provider())
            async with service.start("fake", SubagentRequest(prompt="parent")) as parent:
                await parent.result()
                async with service.start(
                    "fake", SubagentRequest(prompt="child", parent_id=parent.id)
                ) as child:
                    await child.result()
            assert parent.journal_id is not None
            children = await service.children_of(parent.journal_id)
            listed = await service.runs(parent=parent.journal_id)
    assert [(record.id, record.parent, record.parent_id) for record in children] == [
        (child.journal_id, parent.journal_id, parent.id)
    ]
    assert [record.id for record in listed] == [child.journal_id]


async def test_runs_are_listed_newest_first_and_filtered_by_state_provider_and_time(tmp_path: Path) -> None:
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=tmp_path / "runs.db") as service:
            service.register_provider(provider(name="a"))
            service.register_provider(provider(waits_until_cancelled(), name="b"))
            ids = []
            for name in ("a", "b", "a"):
                run = service.start(name, SubagentRequest(prompt=f"on {name}"))
                await run.started()
                if name == "b":
                    await run.dispose()
                else:
                    await run.result()
                ids.append(run.journal_id)
            everything = await service.runs()
            on_a = await service.runs(provider="a")
            disposed = await service.runs(states=["disposed"])
            first_only = await service.runs(limit=1)
            future = await service.runs(since=everything[0].created_at + 3600)
    assert [record.id for record in everything] == ids[::-1]
    assert [record.id for record in on_a] == [ids[2], ids[0]]
    assert [record.id for record in disposed] == [ids[1]]
    assert [record.id for record in first_only] == [ids[2]]
    assert future == []


async def test_a_long_prompt_is_kept_cut_to_the_documented_size_with_its_length(tmp_path: Path) -> None:
    prompt = "x" * (PROMPT_MAX_CHARS + 500)
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=tmp_path / "runs.db") as service:
            service.register_provider(provider())
            async with service.start("fake", SubagentRequest(prompt=prompt)) as run:
                await run.result()
            assert run.journal_id is not None
            record = await service.run_record(run.journal_id)
    assert record is not None
    assert record.prompt_chars == PROMPT_MAX_CHARS + 500
    assert record.prompt == "x" * PROMPT_MAX_CHARS + "\n[cut: 500 more characters]"


async def test_secrets_of_the_environment_and_of_providers_never_reach_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOME_SERVICE_API_TOKEN", "tok-environment-secret-42")
    path = tmp_path / "runs.db"
    secret_provider = provider(completes(f"I saw {SECRET} and tok-environment-secret-42"))
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=path) as service:
            service.register_provider(secret_provider)
            request = SubagentRequest(prompt=f"use {SECRET}", metadata={"token": "tok-environment-secret-42"})
            async with service.start("fake", request) as run:
                await run.result()
    raw = b"".join(item.read_bytes() for item in tmp_path.iterdir() if item.is_file())  # noqa: ASYNC240
    assert SECRET.encode() not in raw
    assert b"tok-environment-secret-42" not in raw
    with RunJournal.open(path) as journal:
        record = journal.get(run.journal_id or "")
    assert record is not None
    assert (record.prompt, record.output) == ("use [redacted]", "I saw [redacted] and [redacted]")
    assert record.request == {"metadata": {"token": "[redacted]"}}
    assert oct(path.stat().st_mode & 0o777) == "0o600"


# -- interrupted runs -------------------------------------------------------------------------------------

OWNER_SCRIPT = textwrap.dedent(
    """
    import sys, anyio
    from subagent import SubagentService, SubagentRequest
    from subagent.testing.fakes import FakeProvider, waits_until_cancelled

    async def main():
        async with SubagentService(journal=sys.argv[1]) as service:
            service.register_provider(FakeProvider(name="fake", autopilot=waits_until_cancelled()))
            parent_id = sys.argv[3] if len(sys.argv) > 3 else None
            for index in range(int(sys.argv[2])):
                run = service.start("fake", SubagentRequest(prompt=f"task {index}", parent_id=parent_id))
                await run.started()
            service.journal.flush()
            print("ready", flush=True)
            await anyio.sleep_forever()

    anyio.run(main)
    """
)


def killed_owner(path: Path, runs: int, parent_id: str | None = None) -> int:
    """Run a process that starts ``runs`` runs (children of ``parent_id``) in a service journaling to
    ``path``; SIGKILL it once they are recorded running. Returns its pid."""
    command = [sys.executable, "-c", OWNER_SCRIPT, str(path), str(runs), *([parent_id] if parent_id else [])]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n"
    finally:
        process.kill()
        process.wait(timeout=WAIT)
        if process.stdout is not None:
            process.stdout.close()
    return process.pid


@pytest.mark.subprocess
async def test_runs_whose_owner_was_killed_are_marked_interrupted_and_reported_once(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    pid = await anyio.to_thread.run_sync(killed_owner, path, 3)
    reported: list[RunRecord] = []
    with anyio.fail_after(WAIT):
        first = SubagentService(journal=path)
        first.events.on("subagent/interrupted", reported.append)
        async with first:
            listed = await first.runs(states=["interrupted"])
        second_reported: list[RunRecord] = []
        second = SubagentService(journal=path)
        second.events.on("subagent/interrupted", second_reported.append)
        async with second:
            assert second.interrupted == ()
    assert sorted(record.prompt for record in reported) == ["task 0", "task 1", "task 2"]
    assert tuple(reported) == first.interrupted
    assert {record.state for record in reported} == {"interrupted"}
    assert {record.owner["pid"] for record in reported} == {pid}
    assert sorted(record.id for record in listed) == sorted(record.id for record in reported)
    assert second_reported == []
    with RunJournal.open(path) as journal:
        record = journal.get(reported[0].id)
    assert record is not None
    assert [item.state for item in record.transitions] == ["starting", "running", "interrupted"]
    assert record.transitions[-1].detail == f"its owner (pid {pid}) is gone"


async def test_runs_of_a_live_owner_are_not_marked_interrupted(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=path) as owner:
            owner.register_provider(provider(waits_until_cancelled()))
            run = owner.start("fake", SubagentRequest(prompt="still at it"))
            await run.started()
            async with SubagentService(journal=path) as other:
                assert other.interrupted == ()
                assert run.journal_id is not None
                other.register_provider(provider(waits_until_cancelled()))
                with pytest.raises(SubagentError) as refused:
                    await other.resume(run.journal_id)
    assert refused.value.code is ErrorCode.RESUME_UNSUPPORTED
    assert refused.value.message == (
        f"run {run.journal_id} cannot be resumed: it is still running in process {os.getpid()}, "
        "which is alive"
    )


@pytest.mark.subprocess
async def test_a_background_parent_is_told_once_of_each_child_it_lost_when_its_process_died(
    tmp_path: Path,
) -> None:
    from subagent.delegation import BackgroundChildren, Notice
    from subagent.runtime import Agent, ScriptedLlm

    path = tmp_path / "runs.db"
    await anyio.to_thread.run_sync(killed_owner, path, 2, "lead")
    notices: list[Notice] = []
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=path) as service:
            lost = {record.id: record for record in service.interrupted}
            background = BackgroundChildren(service)
            background.on_notice(notices.append)
            lead = Agent(llm=ScriptedLlm(), id="lead")
            background.bind_agent(lead)
            other = Agent(llm=ScriptedLlm(), id="someone-else")
            background.bind_agent(other)
            again = BackgroundChildren(service)
            again.bind_agent(lead)  # a second binding hears nothing more: each loss is told once
            await background.aclose()
            await again.aclose()
    assert sorted(notice.child.handle for notice in notices) == sorted(f"run-{id}" for id in lost)
    first = min(notices, key=lambda notice: notice.child.prompt)
    run = first.child.handle.removeprefix("run-")
    assert first.text == (
        f"[background subagent run-{run} (fake) failed]\nTask: task 0\n\n"
        f"{first.result.render()}\n[end of background subagent run-{run}]"
    )
    assert first.result.error == (
        f"interrupted: the process that ran this subagent stopped before it finished (journal run {run}). "
        f"Resume it with `subagent resume {run}`, or start it again."
    )
    assert sorted(message.content for message in lead.messages if message.role == "user") == sorted(
        notice.text for notice in notices
    )
    assert [message.content for message in other.messages if message.role == "user"] == []


# -- resume -----------------------------------------------------------------------------------------------


@pytest.mark.subprocess
async def test_an_interrupted_run_resumes_with_the_default_prompt_naming_the_interrupted_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    await anyio.to_thread.run_sync(killed_owner, path, 1)
    reopening = provider()
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=path) as service:
            service.register_provider(reopening)
            (interrupted,) = service.interrupted
            run = await service.resume(interrupted.id)
            result = await run.result()
            await run.dispose()
            record = await service.run_record(interrupted.id)
    assert result.output == "done"
    assert run.journal_id == interrupted.id
    expected = DEFAULT_RESUME_PROMPT.format(why="the process that ran it stopped", prompt="task 0")
    assert reopening.reopened[0].prompt == expected
    assert reopening.points == [
        ResumePoint(run_id=interrupted.id, checkpoint=None, agent={}, turns_completed=0)
    ]
    assert record is not None
    assert (record.state, record.turns, record.resumes, record.run_id, record.turn_prompt) == (
        "ended",
        1,
        1,
        run.id,
        "task 0",
    )
    assert [item.state for item in record.transitions] == [
        "starting",
        "running",
        "interrupted",
        "resumed",
        "running",
        "ended",
    ]


async def test_a_resumed_run_gets_its_checkpoint_and_request_and_counts_every_completed_turn(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    reopening = provider()
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=path) as service:
            service.register_provider(reopening)
            request = SubagentRequest(prompt="first", cwd=str(tmp_path), persona="terse", timeout=9)
            async with service.start("fake", request) as run:
                await run.result()
                await run.resume("second")  # type: ignore[attr-defined]
        async with SubagentService(journal=path) as later:
            later.register_provider(reopening)
            assert run.journal_id is not None
            again = await later.resume(run.journal_id, "third")
            assert (await again.result()).output == "done"
            await again.dispose()
            record = await later.run_record(run.journal_id)
    (point,) = reopening.points
    assert point == ResumePoint(
        run_id=run.journal_id,
        checkpoint={"turnsSeen": 1, "key": "[redacted]"},
        agent={"kind": "fake", "command": ["fake-agent", "--key", "[redacted]"]},
        turns_completed=2,
    )
    (reopened,) = reopening.reopened
    assert (reopened.prompt, reopened.cwd, reopened.persona, reopened.timeout) == (
        "third",
        str(tmp_path),
        "terse",
        9,
    )
    assert record is not None
    assert (record.turns, record.turn_prompt, record.resumes) == (3, "third", 1)


async def test_resume_refuses_with_a_reason_for_each_case(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=path) as service:
            service.register_provider(provider())
            async with service.start("fake", SubagentRequest(prompt="done already")) as run:
                await run.result()
                assert run.journal_id is not None
                open_here = await refusal(service.resume(run.journal_id, "more"))
            completed = await refusal(service.resume(run.journal_id))
            unknown = await refusal(service.resume("ffffffff"))
        async with SubagentService(journal=path) as without_provider:
            no_provider = await refusal(without_provider.resume(run.journal_id, "more"))
        async with SubagentService(journal=path) as plain:
            plain.register_provider(FakeProvider(name="fake"))
            cannot = await refusal(plain.resume(run.journal_id, "more"))
        async with SubagentService(journal=path) as refusing:
            refuser = provider()
            refuser.refuse = "its agent is gone"
            refusing.register_provider(refuser)
            refused = await refusal(refusing.resume(run.journal_id, "more"))
            record = await refusing.run_record(run.journal_id)
        async with SubagentService() as no_journal:
            nowhere = await refusal(no_journal.resume(run.journal_id))
    prefix = f"run {run.journal_id} cannot be resumed: "
    assert open_here == (
        ErrorCode.RESUME_UNSUPPORTED,
        prefix + "it is open in this service: call resume() on its run instead",
    )
    assert completed == (
        ErrorCode.RESUME_UNSUPPORTED,
        prefix + "its last turn completed: give the prompt of its next turn",
    )
    assert unknown == (ErrorCode.NO_RUN, f"no run 'ffffffff' in the run journal {str(path)!r}")
    assert no_provider == (ErrorCode.RESUME_UNSUPPORTED, prefix + "no provider named 'fake' is registered")
    assert cannot == (ErrorCode.RESUME_UNSUPPORTED, prefix + "provider 'fake' cannot reopen a run")
    assert refused == (ErrorCode.RESUME_UNSUPPORTED, "its agent is gone")
    assert nowhere == (
        ErrorCode.NO_RUN,
        "this service keeps no run journal: open it with SubagentService(journal=...)",
    )
    # A refused resume gives the run back as it was.
    assert record is not None
    assert (record.state, record.resumes) == ("ended", 0)
    assert [item.state for item in record.transitions][-2:] == ["resumed", "ended"]


async def refusal(attempt: Any) -> tuple[ErrorCode, str]:
    with pytest.raises(SubagentError) as caught:
        await attempt
    return caught.value.code, caught.value.message


async def test_a_journal_id_prefix_finds_the_run_and_an_ambiguous_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    with RunJournal.open(path) as journal:
        for id in ("abcd11111111", "abcd22222222", "beef00000000"):
            journal.record_start(
                id,
                run_id="x-1",
                provider="fake",
                parent=None,
                parent_id=None,
                prompt="p",
                request={},
                agent=None,
            )
        journal.flush()
        found = journal.get("beef")
        with pytest.raises(JournalError) as ambiguous:
            journal.get("abcd")
        too_short = journal.get("bee")
    assert found is not None
    assert found.id == "beef00000000"
    assert str(ambiguous.value) == "'abcd' is the start of more than one run's id: give more of it"
    assert too_short is None


# -- the file ---------------------------------------------------------------------------------------------


def test_a_journal_with_a_newer_schema_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    RunJournal.open(path).close()
    with sqlite3.connect(path) as connection:
        connection.execute(
            "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),)
        )
    connection.close()
    with pytest.raises(JournalError) as refused:
        RunJournal.open(path)
    assert str(refused.value) == (
        f"the run journal {str(path)!r} has schema version {SCHEMA_VERSION + 1}, newer than this "
        f"subagent-seam knows ({SCHEMA_VERSION}): it was written by a newer release. Upgrade subagent-seam, "
        "or use another journal file (--journal, or SUBAGENT_JOURNAL)"
    )


async def test_a_service_whose_journal_is_newer_fails_to_open_with_start_failed(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    RunJournal.open(path).close()
    with sqlite3.connect(path) as connection:
        connection.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    connection.close()
    with pytest.raises(SubagentError) as refused:
        async with SubagentService(journal=path):
            pass
    assert refused.value.code is ErrorCode.START_FAILED
    assert "has schema version 99, newer than this subagent-seam knows" in refused.value.message


def test_a_file_that_is_no_journal_is_refused_and_left_untouched(tmp_path: Path) -> None:
    garbage = tmp_path / "notes.txt"
    garbage.write_bytes(b"these are my notes, not a database\n" * 100)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as connection:
        connection.execute("CREATE TABLE songs (title TEXT)")
    connection.close()
    with pytest.raises(JournalError) as not_sqlite:
        RunJournal.open(garbage)
    with pytest.raises(JournalError) as not_journal:
        RunJournal.open(other)
    assert str(not_sqlite.value) == (
        f"{str(garbage)!r} is not a usable run journal (file is not a database): move it away, or choose "
        "another path (--journal, or SUBAGENT_JOURNAL)"
    )
    assert str(not_journal.value) == (
        f"{str(other)!r} is an SQLite database but not a run journal (it has no runs table): choose another "
        "path (--journal, or SUBAGENT_JOURNAL)"
    )
    assert garbage.read_bytes() == b"these are my notes, not a database\n" * 100


WRITER_SCRIPT = textwrap.dedent(
    """
    import sys
    from subagent.journal import RunJournal

    journal = RunJournal.open(sys.argv[1])
    index = 0
    while True:
        writes = [
            journal.record_start(
                f"{index:04x}{n:04x}", run_id=f"w-{index}-{n}", provider="w", parent=None, parent_id=None,
                prompt="p" * 2000, request={"n": n}, agent=None,
            )
            for n in range(50)
        ]
        for write in writes:
            write.done.wait()
        print(index, flush=True)  # batch index committed
        index += 1
    """
)


@pytest.mark.subprocess
def test_the_journal_survives_its_writer_killed_mid_write_with_every_commit_kept(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER_SCRIPT, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    committed = -1
    try:
        for line in process.stdout:
            committed = int(line)
            if committed >= 20:
                break
    finally:
        process.kill()  # while it writes the next batches
        process.wait(timeout=WAIT)
        process.stdout.close()
    with RunJournal.open(path) as journal:
        count = journal.count()
        newest = journal.runs(limit=1)
    with sqlite3.connect(path) as connection:
        (integrity,) = connection.execute("PRAGMA integrity_check").fetchone()
    connection.close()
    assert integrity == "ok"
    assert committed == 20
    assert count >= 21 * 50
    assert count % 50 == 0
    assert newest[0].prompt == "p" * 2000


def test_a_torn_tail_of_the_write_ahead_log_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    journal = RunJournal.open(path)
    journal.record_start(
        "00000001",
        run_id="a-1",
        provider="a",
        parent=None,
        parent_id=None,
        prompt="kept",
        request={},
        agent=None,
    )
    journal.flush()
    wal = Path(f"{path}-wal")
    kept = wal.stat().st_size
    journal.record_start(
        "00000002",
        run_id="a-2",
        provider="a",
        parent=None,
        parent_id=None,
        prompt="torn",
        request={},
        agent=None,
    )
    journal.flush()
    # Copy the files as a crash would leave them: the last commit's frames half written.
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "runs.db").write_bytes(path.read_bytes())
    whole = wal.read_bytes()
    (crashed / "runs.db-wal").write_bytes(whole[: kept + (len(whole) - kept) // 2])
    journal.close()
    with RunJournal.open(crashed / "runs.db") as recovered:
        prompts = [record.prompt for record in recovered.runs()]
    assert prompts == ["kept"]


async def test_two_services_share_one_journal_file(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=path) as one, SubagentService(journal=path) as two:
            one.register_provider(provider())
            two.register_provider(provider())
            runs = [
                service.start("fake", SubagentRequest(prompt=f"{n}"))
                for n in range(10)
                for service in (one, two)
            ]
            for run in runs:
                await run.result()
            for run in runs:
                await run.dispose()
            listed = await one.runs(limit=None)
    assert sorted(record.id for record in listed) == sorted(run.journal_id or "" for run in runs)
    assert {record.state for record in listed} == {"ended"}


async def test_a_closed_service_leaves_no_journal_thread_or_descriptor(tmp_path: Path) -> None:
    fds = open_fd_count()
    threads = len(journal_threads())
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=tmp_path / "runs.db") as service:
            service.register_provider(provider())
            async with service.start("fake", SubagentRequest(prompt="hi")) as run:
                await run.result()
            await service.runs()
            assert len(journal_threads()) == threads + 1
    assert len(journal_threads()) == threads
    assert open_fd_count() == fds


async def test_a_service_without_a_journal_records_nothing(tmp_path: Path) -> None:
    with anyio.fail_after(WAIT):
        async with SubagentService() as service:
            service.register_provider(provider())
            async with service.start("fake", SubagentRequest(prompt="hi")) as run:
                await run.result()
            with pytest.raises(SubagentError) as refused:
                await service.runs()
    assert run.journal_id is None
    assert service.journal is None
    assert refused.value.code is ErrorCode.NO_RUN
    assert list(tmp_path.iterdir()) == []  # noqa: ASYNC240


async def test_a_live_run_s_heartbeats_keep_what_was_last_known_of_it(tmp_path: Path) -> None:
    from subagent import Budget, SubagentProgressInfo
    from subagent.testing.fakes import ObservableFakeRun

    class Talking(ObservableFakeRun):
        output = "half of the answer"

    observed = ReopeningFakeProvider(
        name="fake",
        run_class=Talking,
        autopilot=waits_until_cancelled(),
        capabilities=SubagentCapabilities(budget=frozenset({"max_turns"})),
    )
    beats: list[SubagentProgressInfo] = []
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=tmp_path / "runs.db", progress_interval=0.01) as service:
            service.register_provider(observed)
            beat = anyio.Event()

            def on_progress(info: SubagentProgressInfo) -> None:
                beats.append(info)
                if info.updates:
                    beat.set()

            service.events.on("subagent/progress", on_progress)
            run = service.start("fake", SubagentRequest(prompt="think", budget=Budget(max_turns=5)))
            await run.started()
            cast_run = observed.runs[0]
            assert isinstance(cast_run, Talking)
            cast_run.update()
            await beat.wait()
            assert service.journal is not None
            await anyio.to_thread.run_sync(service.journal.flush)
            assert run.journal_id is not None
            record = await service.run_record(run.journal_id)
            await run.dispose()
    assert record is not None
    assert record.progress is not None
    assert record.progress["output"] == "half of the answer"
    assert record.progress["updates"] == 1
    assert record.progress["waitingOnPermission"] is False
    assert record.progress["spent"]["turns"] == 0


def test_an_older_journal_is_migrated_forward_in_place_keeping_its_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from subagent import journal as journal_module

    path = tmp_path / "runs.db"
    with RunJournal.open(path) as old:
        old.record_start(
            "0000aaaa",
            run_id="a-1",
            provider="a",
            parent=None,
            parent_id=None,
            prompt="old",
            request={},
            agent=None,
        )
    # The next release: version SCHEMA_VERSION + 1 adds a column, and says how to get there.
    monkeypatch.setattr(journal_module, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    monkeypatch.setitem(
        journal_module._MIGRATIONS, SCHEMA_VERSION, ("ALTER TABLE runs ADD COLUMN labels TEXT",)
    )
    with RunJournal.open(path) as migrated:
        record = migrated.get("0000aaaa")
    with sqlite3.connect(path) as connection:
        version = connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
        columns = [row[1] for row in connection.execute("PRAGMA table_info(runs)")]
    connection.close()
    assert record is not None
    assert record.prompt == "old"
    assert version == str(SCHEMA_VERSION + 1)
    assert columns[-1] == "labels"


async def test_a_resumed_run_gets_only_what_its_budget_had_left_and_one_that_spent_it_is_refused(
    tmp_path: Path,
) -> None:
    from subagent import Budget

    path = tmp_path / "runs.db"
    capped = provider(waits_until_cancelled())
    capped.capabilities = SubagentCapabilities(budget=frozenset({"max_tool_calls", "max_turns"}))
    with anyio.fail_after(WAIT):
        async with SubagentService(journal=path) as service:
            service.register_provider(capped)
            ids = []
            for used in (2, 5):
                run = service.start(
                    "fake", SubagentRequest(prompt="x", budget=Budget(max_tool_calls=5, max_turns=9))
                )
                await run.started()
                assert run.request.account is not None
                assert run.request.account.take(tool_calls=used) is None
                capped.runs[-1].finish(SubagentResult(output="", stop_reason="error", error="stopped"))
                await run.result()
                await run.dispose()
                ids.append(run.journal_id or "")
        async with SubagentService(journal=path) as later:
            later.register_provider(capped)
            resumed = await later.resume(ids[0], "go on")
            await resumed.dispose()
            spent_out = await refusal(later.resume(ids[1], "go on"))
            record = await later.run_record(ids[0])
    assert capped.reopened[0].budget == Budget(max_tool_calls=3, max_turns=9)
    assert record is not None
    assert record.spent is not None
    assert record.spent["toolCalls"] == 2
    assert spent_out == (
        ErrorCode.RESUME_UNSUPPORTED,
        f"run {ids[1]} cannot be resumed: its budget is spent: max_tool_calls 5, of which 5 was used before",
    )


def test_a_write_the_database_refuses_fails_alone_and_its_batch_is_kept(tmp_path: Path) -> None:
    with RunJournal.open(tmp_path / "runs.db") as journal:
        start: dict[str, Any] = {
            "run_id": "a-1",
            "provider": "a",
            "parent": None,
            "parent_id": None,
            "request": {},
            "agent": None,
        }
        first = journal.record_start("aaaaaaaaaaaa", prompt="first", **start)
        twin = journal.record_start("aaaaaaaaaaaa", prompt="same id", **start)
        other = journal.record_start("bbbbbbbbbbbb", prompt="other", **start)
        journal.flush()
        prompts = sorted(record.prompt for record in journal.runs())
    assert (first.error, other.error) == (None, None)
    assert isinstance(twin.error, JournalError)
    assert "UNIQUE constraint failed: runs.id" in str(twin.error)
    assert prompts == ["first", "other"]
    assert journal.failed is None


def test_a_checkpoint_that_is_not_json_keeps_the_previous_one_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with RunJournal.open(tmp_path / "runs.db") as journal:
        journal.record_start(
            "cccccccccccc",
            run_id="c-1",
            provider="c",
            parent=None,
            parent_id=None,
            prompt="p",
            request={},
            agent=None,
        )
        journal.record_checkpoint("cccccccccccc", {"sessionId": "s-1", "turn": 1})
        bad = journal.record_checkpoint("cccccccccccc", {"sessionId": "s-2", "turn": object()})
        journal.flush()
        record = journal.get("cccccccccccc")
    assert record is not None
    assert (record.checkpoint, record.session_id) == ({"sessionId": "s-1", "turn": 1}, "s-1")
    assert (bad.error, bad.rowcounts) == (None, [0])
    assert (
        "run cccccccccccc's checkpoint is not JSON (object is not JSON); the previous one is kept"
        in caplog.text
    )
