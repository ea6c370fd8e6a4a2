"""Claude Code (claude-agent-acp) resumed after its parent, the ``subagent`` command, was SIGKILLed mid-turn.

The whole path a person takes, each step a new ``subagent`` process on one run journal, against the fake
Anthropic Messages server on loopback: ``subagent run`` completes a first turn; ``subagent resume ID -p``
starts a second one, whose model call stalls mid-answer, and that ``subagent`` is killed with SIGKILL (its
supervisor then takes the agent down); ``subagent runs`` lists the run ``interrupted``; ``subagent resume
ID`` (the default prompt) reopens the agent's session in a new agent process, and the model's request for
that turn holds the earlier conversation: the first prompt, its answer, and the prompt of the turn cut
short. Nothing outlives any step.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from subagent._journaling import DEFAULT_RESUME_PROMPT
from subagent.testing import MessagesReply, MessagesRequest, serve_anthropic_messages
from tests.leaks import LEAK_TAG_VARIABLE, assert_no_leaks, leaked_processes
from tests.test_real_agents import SIDE_CALL, claude_env, make_agent

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess, pytest.mark.real_agent]

BOUND = 90.0  # seconds for one CLI step: a hang guard on a loaded machine
FIRST = "Remember the word pelican, then say ok."
FIRST_ANSWER = "ok, pelican it is."
SECOND = "Now count the files in this directory."
THIRD_ANSWER = "The word was pelican; I am counting again."


@pytest.fixture
def anyio_backend() -> str:
    """One backend: what is under test is the CLI processes; the journal has its own tests on both."""
    return "asyncio"


def texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    return [block.get("text", "") for block in content or () if isinstance(block, dict)]


def conversation(request: MessagesRequest) -> list[tuple[str, str]]:
    """The request's messages as (role, text) pairs, each text block its own pair, system reminders out."""
    return [
        (message["role"], text.strip())  # kept as Claude Code stored it: at times with a newline after
        for message in request.messages
        if message.get("role") in ("user", "assistant")  # not the environment notes it adds as messages
        for text in texts(message.get("content"))
        if text.strip() and not text.lstrip().startswith("<system-reminder>")
    ]


async def cli(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    with anyio.fail_after(BOUND):
        done = await anyio.run_process(
            [sys.executable, "-m", "subagent", *argv], env=env, cwd=cwd, check=False, stdin=subprocess.DEVNULL
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def test_claude_code_resumed_after_the_subagent_command_was_sigkilled_sees_the_earlier_conversation(
    tmp_path: Path,
) -> None:
    command = make_agent("claude").command
    stalled = anyio.Event()
    requests: list[MessagesRequest] = []

    def respond(request: MessagesRequest) -> MessagesReply:
        users = [message for message in request.messages if message.get("role") == "user"]
        last = texts(users[-1].get("content")) if users else []
        if not request.tool_names:
            return MessagesReply(text=SIDE_CALL)  # Claude Code's own calls: a title, a suggestion
        requests.append(request)
        if any(text.strip() == FIRST for text in last):
            return MessagesReply(text=FIRST_ANSWER)
        if any(text.strip() == SECOND for text in last):  # the default prompt quotes it: not that one
            stalled.set()
            return MessagesReply(text=("Counting", " the files"), stall_after=3)
        return MessagesReply(text=THIRD_ANSWER)

    home = tmp_path / "home"
    workdir = tmp_path / "work"
    workdir.mkdir()
    journal = tmp_path / "runs.db"
    transcript: list[str] = []
    async with assert_no_leaks() as tag, serve_anthropic_messages(respond) as server:
        env = {
            **claude_env(home, server.base_url),
            "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "SUBAGENT_JOURNAL": str(journal),
            LEAK_TAG_VARIABLE: tag,
        }
        status, out, err = await cli(
            ["run", "--json", "--permission", "allow", "--cwd", str(workdir), "-p", FIRST, "--", *command],
            env,
            workdir,
        )
        assert status == 0, err
        first = json.loads(out)
        journal_id = first["journalId"]
        transcript.append(f"$ subagent run -p {FIRST!r} -- claude-agent-acp\n{first['output']}")

        # The second turn stalls; its `subagent` is killed outright once the model is asked.
        process = await anyio.open_process(
            [sys.executable, "-m", "subagent", "resume", journal_id, "--permission", "allow", "-p", SECOND],
            env=env,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        async with process:
            with anyio.fail_after(BOUND):
                await stalled.wait()
            process.send_signal(signal.SIGKILL)
            assert await process.wait() == -signal.SIGKILL
        transcript.append(f"$ subagent resume {journal_id} -p {SECOND!r}   # SIGKILLed mid-answer")
        with anyio.fail_after(BOUND):
            while leaked_processes(tag):  # noqa: ASYNC110  (no event tells of another process's death)
                await anyio.sleep(0.05)  # a poll interval: the wait is bounded above

        status, listed, err = await cli(["runs", "--json"], env, workdir)
        assert status == 0, err
        (record,) = json.loads(listed)
        status, table, _ = await cli(["runs"], env, workdir)
        transcript.append(f"$ subagent runs\n{table.rstrip()}")

        status, out, err = await cli(["resume", journal_id, "--permission", "allow", "--json"], env, workdir)
        assert status == 0, err
        third = json.loads(out)
        transcript.append(f"$ subagent resume {journal_id}\n{third['output']}")
    assert set(server.tunnels) <= {f"127.0.0.1:{server.port}"}, server.tunnels
    assert (record["id"], record["state"], record["turns"], record["turnPrompt"]) == (
        journal_id,
        "interrupted",
        1,
        SECOND,
    )
    assert (third["journalId"], third["stopReason"], third["output"]) == (
        journal_id,
        "completed",
        THIRD_ANSWER,
    )
    # The resumed turn's request: the earlier conversation, the prompt of the turn cut short included (what
    # Claude Code kept of its partial answer depends on when the kill came), then the default prompt naming
    # that turn.
    default = DEFAULT_RESUME_PROMPT.format(why="the process that ran it stopped", prompt=SECOND)
    (said,) = [
        conversation(request) for request in requests if conversation(request)[-1] == ("user", default)
    ]
    assert said[:3] == [("user", FIRST), ("assistant", FIRST_ANSWER), ("user", SECOND)]
    assert said[-1] == ("user", default)
    print("\n\n".join(transcript))  # noqa: T201  (the transcript, with -s)
