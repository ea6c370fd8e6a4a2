"""`subagent runs` on a run journal of 10,000 runs: how long a person waits for the listing.

A journal of ``--runs`` runs (default 10,000) is made with the journal's own API
(:class:`subagent.journal.RunJournal`), as services record them: most completed, every tenth a parent
of the nine after it, every 25th ended with a refusal, every 50th failed to start; then
``--interrupted`` more (default 100) are recorded live by a child process that exits without ending
them, so that their owner is gone, as after a parent's SIGKILL. The first ``subagent runs`` marks those
``interrupted`` (it must say so on stderr, once: checked, untimed).

Then, ``--repeat`` rounds after one warm-up round, each command run as a person runs it (a new
process, the journal named by ``SUBAGENT_JOURNAL``), interleaved so a burst of load hits all alike:

* ``subagent --version``: the command line's own start-up (Python, the package, every command's
  parser), the baseline;
* ``subagent runs``: the 50 newest runs, marking interrupted runs first;
* ``subagent runs --state interrupted``: a filter over the whole journal;
* ``subagent runs show ID``: one run whole, with its state changes and its nine children.

Target: each answers in under a second (judged on the maximum: the issue asks for "under a second").
The ratios to ``subagent --version`` (medians, the same run) are figures. Every answer is checked (exit
status 0, the rows expected); the script exits 1 if one is wrong or a process is left behind. The
journal lives in a temporary directory (``XDG_STATE_HOME`` too), removed at the end.

    python bench/journal_runs.py [--runs 10000] [--interrupted 100] [--repeat 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _common import BenchBroken, live_descendants, median_p90_max, verdict

from subagent.journal import RunJournal

TARGET_SECONDS = 1.0
CLI = [sys.executable, "-m", "subagent"]
AGENT = {
    "command": ["npx", "-y", "@agentclientprotocol/claude-agent-acp"],
    "transport": "local",
    "cwd": "/work",
}
PROMPT = "Summarise the changes of release {index} and list what the notes leave out\nin detail"

# A child process that records live runs and exits without ending them: their owner is gone.
ORPHANS = textwrap.dedent(
    """
    import os, sys
    from subagent.journal import RunJournal
    journal = RunJournal.open(sys.argv[1])
    for index in range(int(sys.argv[2])):
        id = f"dead{index:04x}"
        journal.record_start(id, run_id=f"acp-{index}", provider="acp", parent=None, parent_id=None,
                             prompt=f"An interrupted task {index}", request={"cwd": "/work"}, agent={})
        journal.record_running(id, session_id=f"s-{index}", checkpoint={"sessionId": f"s-{index}"})
    journal.flush(60)
    os._exit(0)  # no close, no end recorded: as if killed
    """
)


def make_journal(path: Path, runs: int, interrupted: int) -> str:
    """Record the runs; return the id of a parent run (with nine children) to show."""
    with RunJournal.open(path) as journal:
        parent = ""
        for index in range(runs):
            id = f"{index:08x}"
            if index % 10 == 0:
                parent = id
            journal.record_start(
                id,
                run_id=f"acp-{index}",
                provider="acp" if index % 3 else "spawn",
                parent=None if index % 10 == 0 else parent,
                parent_id=None if index % 10 == 0 else parent,
                prompt=PROMPT.format(index=index),
                request={"cwd": "/work", "timeout": 600},
                agent=AGENT,
            )
            if index % 50 == 0:
                journal.record_turn(
                    id, stop_reason=None, output=None, structured=None, error="the agent exited, status 1",
                    usage=None, checkpoint=None, state="failed",
                )  # fmt: skip
                continue
            journal.record_running(
                id, session_id=f"session-{index}", checkpoint={"sessionId": f"session-{index}"}
            )
            stop = "completed" if index % 25 else "refusal"
            journal.record_turn(
                id, stop_reason=stop, output=f"The answer to task {index}.", structured=None, error=None,
                usage={"inputTokens": 1200, "outputTokens": 300, "totalTokens": 1500}, checkpoint=None,
            )  # fmt: skip
        if not journal.flush(60):
            raise BenchBroken("the journal did not commit the runs within 60 s")
    subprocess.run([sys.executable, "-c", ORPHANS, str(path), str(interrupted)], check=True, timeout=60)
    return f"{(runs - 1) // 10 * 10:08x}"


def run(args: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    begun = time.perf_counter()
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=60, check=False)
    return time.perf_counter() - begun, done


def check(name: str, done: subprocess.CompletedProcess[str], rows: int | None = None) -> None:
    if done.returncode != 0 or done.stderr:
        raise BenchBroken(f"`{name}` exited {done.returncode}: {done.stderr.strip()}")
    if rows is not None and len(done.stdout.splitlines()) != rows + 1:
        raise BenchBroken(f"`{name}` listed {len(done.stdout.splitlines()) - 1} runs, not {rows}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--interrupted", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=10)
    options = parser.parse_args()
    before = set(live_descendants())
    with tempfile.TemporaryDirectory(prefix="bench-journal-") as top:
        path = Path(top) / "runs.db"
        env = {**os.environ, "XDG_STATE_HOME": top, "SUBAGENT_JOURNAL": str(path)}
        env.pop("COLUMNS", None)
        begun = time.perf_counter()
        shown = make_journal(path, options.runs, options.interrupted)
        total = options.runs + options.interrupted
        print(
            f"a journal of {total:,} runs ({options.interrupted} left live by a process that exited) made in "
            f"{time.perf_counter() - begun:.1f} s: {path.stat().st_size / 1024 / 1024:.1f} MiB"
        )
        _, first = run(["runs"], env)
        if first.returncode != 0 or "newly interrupted" not in first.stderr:
            raise BenchBroken(
                f"the first listing did not report the interrupted runs: {first.stderr.strip()}"
            )
        _, everything = run(["runs", "--all", "--json"], env)
        if len(json.loads(everything.stdout)) != total:
            raise BenchBroken("`subagent runs --all --json` did not list every run")
        commands = {
            "subagent --version": (["--version"], None),
            "subagent runs": (["runs"], 50),
            "subagent runs --state interrupted": (
                ["runs", "--state", "interrupted"],
                min(50, options.interrupted),
            ),
            f"subagent runs show {shown}": (["runs", "show", shown], None),
        }
        samples: dict[str, list[float]] = {name: [] for name in commands}
        for round_ in range(options.repeat + 1):
            for name, (args, rows) in commands.items():
                seconds, done = run(args, env)
                check(name, done, rows)
                if round_:  # the first round warms the caches up
                    samples[name].append(seconds)
        load = os.getloadavg()[0]
    base = median_p90_max(samples["subagent --version"])[0]
    print(
        f"{options.repeat} rounds, each command a new process; load average {load:.1f}; median / p90 / max:"
    )
    for name, values in samples.items():
        median, p90, most = median_p90_max(values)
        figures = " / ".join(f"{value * 1000:7.1f}" for value in (median, p90, most))
        print(f"  {name:<36} {figures} ms  {median / base:.2f}x")
    left = [pid for pid in live_descendants() if pid not in before]
    if left:
        raise BenchBroken(f"processes left behind: {left}")
    for name, values in samples.items():
        if name != "subagent --version":
            print(
                verdict(
                    max(values) < TARGET_SECONDS,
                    f"`{name}` on {total:,} runs within {TARGET_SECONDS:g} s",
                    f"max {max(values) * 1000:.0f} ms, median {median_p90_max(values)[0] / base:.2f}x "
                    "`subagent --version`'s",
                )
            )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchBroken as exc:
        print(f"BROKEN: {exc}", file=sys.stderr)
        sys.exit(1)
