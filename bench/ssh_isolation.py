"""Isolated workspaces over SSH: what the workspace core costs when it runs on the agent's host.

A throwaway ``sshd`` on 127.0.0.1 (the SSH tests' helper, ``tests/sshd.py``), a small repository, the stub
agent run over ssh as a command. ``--runs`` times each, interleaved so a burst of load hits all alike:

* **ssh floor**: ``ssh`` with the transport's options running ``exit 0`` there: a connection and a login;
* **one core operation**: `SshTransport.isolation_runner` running ``host`` (the core shipped, run with
  the remote ``python3 -I -S``, its JSON reply read): the cost of every step below;
* **plain run** and **isolated run**: `AcpProvider` over `SshTransport`, one turn of the stub agent, the
  time to ``started()`` (the agent ready) and to the run disposed; the isolated run makes its worktree
  there first (two operations: ``records_for``, ``open``), commits the turn and closes it (two more).

Figures only, no target: on loopback, a core operation costs about one and a half ssh floors, and an
isolated run about four of them more than a plain one. Nothing may be left: the repository must list only
its own worktree and branch afterwards, or the script exits 1. Without OpenSSH it skips (and exits 1 under
``SUBAGENT_REQUIRE_SSH``).

    python bench/ssh_isolation.py [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from subagent import SubagentRequest, SubagentService  # noqa: E402
from subagent.acp.transports import SshTransport  # noqa: E402
from subagent.providers.acp import AcpProvider  # noqa: E402
from subagent.testing import dump_scenario, stub_agent_argv  # noqa: E402
from subagent.types import IsolationMode  # noqa: E402
from tests.sshd import REQUIRE_SSH_VARIABLE, find_program, running_sshd  # noqa: E402

GIT_ENV = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=Bench", "-c", "user.email=bench@example.com", *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **GIT_ENV},
    )
    return done.stdout.strip()


async def timed(action: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    await action()
    return time.perf_counter() - started


async def one_run(provider: AcpProvider, isolation: IsolationMode | None) -> tuple[float, float]:
    """One turn: seconds to started(), and to the run disposed."""
    began = time.perf_counter()
    async with SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go", isolation=isolation)) as run:
            await run.started()
            ready = time.perf_counter() - began
            result = await run.result()
            if result.stop_reason != "completed":
                raise SystemExit(f"a run did not complete: {result}")
    return ready, time.perf_counter() - began


def line(name: str, values: list[float]) -> str:
    ms = sorted(value * 1000 for value in values)
    return f"  {name:<34} median {statistics.median(ms):7.0f} ms   min {ms[0]:7.0f}   max {ms[-1]:7.0f}"


def ssh_missing() -> str | None:
    """Why the loopback sshd cannot run here, or None."""
    missing = [name for name in ("sshd", "ssh", "ssh-keygen") if find_program(name) is None]
    return f"OpenSSH is not installed (no {', '.join(missing)})" if missing else None


async def main(runs: int) -> int:
    missing = ssh_missing()
    if missing is not None:
        print(f"SKIP  everything: {missing}")
        return 1 if os.environ.get(REQUIRE_SSH_VARIABLE) else 0
    with tempfile.TemporaryDirectory(prefix="bench-ssh-isolation-") as top, running_sshd() as server:
        repo = Path(top) / "repo"
        repo.mkdir()
        git(repo, "init", "-q", "-b", "main")
        (repo / "notes.txt").write_text("notes\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", "notes")
        scenario = Path(top) / "scenario.json"
        scenario.write_text(dump_scenario({"turns": [[{"step": "message", "text": "done"}]]}))
        transport = SshTransport(server.host, config_file=server.config_file, stdin_close_timeout=1.0)
        provider = AcpProvider(stub_agent_argv(scenario), cwd=repo, transport=transport)
        runner = transport.isolation_runner()
        floor_argv = [*transport.ssh_argv()[:-1], "exit 0"]
        figures: dict[str, list[float]] = {}
        for _ in range(runs):
            figures.setdefault("ssh floor (ssh HOST exit 0)", []).append(
                await timed(lambda: anyio.run_process(floor_argv, check=True))
            )
            figures.setdefault("one core operation over ssh", []).append(await timed(lambda: runner("host")))
            modes: tuple[IsolationMode | None, ...] = (None, "worktree")
            for isolation in modes:
                ready, whole = await one_run(provider, isolation)
                kind = "isolated" if isolation else "plain"
                figures.setdefault(f"{kind} run: to started()", []).append(ready)
                figures.setdefault(f"{kind} run: to disposed", []).append(whole)
        print(f"over loopback ssh, {runs} runs each (load average {os.getloadavg()[0]:.1f}):")
        for name, values in figures.items():
            print(line(name, values))
        extra = statistics.median(figures["isolated run: to started()"]) - statistics.median(
            figures["plain run: to started()"]
        )
        whole_extra = statistics.median(figures["isolated run: to disposed"]) - statistics.median(
            figures["plain run: to disposed"]
        )
        print(
            f"  isolation's start-up overhead: {extra * 1000:.0f} ms; whole run: {whole_extra * 1000:.0f} ms"
        )
        print("no targets: figures only")
        left = git(repo, "worktree", "list", "--porcelain").count("worktree ")
        branches = git(repo, "branch", "--format=%(refname:short)").splitlines()
        if left != 1 or branches != ["main"]:
            print(f"LEFT BEHIND: {left} worktrees, branches {branches}")
            return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=10)
    sys.exit(anyio.run(main, parser.parse_args().runs))
