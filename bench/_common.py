"""Shared helpers of the ACP-children benchmarks (``fanout.py``, ``cancel_latency.py``, ``soak.py``).

Everything here reads Linux's ``/proc`` directly: the parent's resident memory, its open file
descriptors and its live descendants. Nothing is sampled in the background: a benchmark asks for a
figure at the moment it wants one, so no helper thread or task skews what it measures.
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from subagent.acp.client import AcpSession
from subagent.providers.acp import AcpProvider

__all__ = [
    "MIB",
    "BenchBroken",
    "Snapshot",
    "live_descendants",
    "make_provider",
    "median_p90_max",
    "open_fd_count",
    "peak_rss_bytes",
    "rss_bytes",
    "settle_descendants",
    "snapshot",
    "stub_command",
    "verdict",
    "write_scenario",
]

MIB = 1024 * 1024

STUB_AGENT = [sys.executable, "-m", "subagent.testing.stub_agent"]


class BenchBroken(Exception):
    """The run itself broke (a child did not complete, a leak): the script exits non-zero."""


# -- what a benchmark drives -------------------------------------------------------------------------------


def write_scenario(directory: str | os.PathLike[str], name: str, scenario: Mapping[str, Any]) -> Path:
    """Write ``scenario`` (the stub agent's JSON format) to ``directory/name.json`` and return the path."""
    path = Path(directory) / f"{name}.json"
    path.write_text(json.dumps(scenario))
    return path


def stub_command(scenario: Path) -> list[str]:
    """The argv of the bundled stub agent running ``scenario``."""
    return [*STUB_AGENT, "--scenario", str(scenario)]


def make_provider(
    command: Sequence[str], *, max_concurrent: int | None = None, **options: Any
) -> tuple[AcpProvider, str]:
    """An `AcpProvider` for ``command``, and a line saying how its concurrency limit was set.

    ``max_concurrent`` is passed only if this version of the provider takes it (the parameter is
    being added): a benchmark must run, and say so, either way.
    """
    if max_concurrent is not None:
        if "max_concurrent" in inspect.signature(AcpProvider).parameters:
            options["max_concurrent"] = max_concurrent
            note = f"AcpProvider(max_concurrent={max_concurrent})"
        else:
            note = "AcpProvider has no max_concurrent parameter yet: every run starts at once, unqueued"
    else:
        note = "AcpProvider with its default concurrency"
    return AcpProvider(command, **options), note


# -- what a benchmark measures -----------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def rss_bytes() -> int:
    """This process's resident set size now (``VmRSS``)."""
    return _status_kib("VmRSS:") * 1024


def peak_rss_bytes() -> int:
    """The highest resident set size this process has had (``VmHWM``)."""
    return _status_kib("VmHWM:") * 1024


def open_fd_count() -> int:
    """How many file descriptors this process has open (the one used to list them excluded)."""
    # listdir opens the directory with one descriptor of its own, which shows in the listing.
    return len(os.listdir("/proc/self/fd")) - 1


def _stat(pid: int) -> tuple[str, int] | None:
    """State letter and parent pid of ``pid`` from ``/proc/<pid>/stat``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read().decode(errors="replace")
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces or parentheses, so split after the last ")".
    fields = stat.rpartition(")")[2].split()
    return fields[0], int(fields[1])


def live_descendants() -> list[int]:
    """Pids of our running descendants, and of our own children that exited but were never reaped.

    A zombie further down is its own parent's business and is not counted.
    """
    me = os.getpid()
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            state, ppid = stat
            children.setdefault(ppid, []).append((int(entry), state))
    found: list[int] = []
    pending = [(pid, state, me) for pid, state in children.get(me, [])]
    while pending:
        pid, state, parent = pending.pop()
        if state not in ("Z", "X") or parent == me:
            found.append(pid)
        pending.extend((child, child_state, pid) for child, child_state in children.get(pid, []))
    return sorted(found)


def settle_descendants(keep: Collection[int] = (), *, timeout: float = 20.0) -> list[int]:
    """Wait until no descendant is left but those in ``keep``; return the others still alive then.

    A child's own children may end just after it (a remote agent's side of a closed ssh connection ends
    on its own): ``timeout`` is a hang guard, never a statement about speed.
    """
    deadline = time.monotonic() + timeout
    while True:
        others = [pid for pid in live_descendants() if pid not in keep]
        if not others or time.monotonic() >= deadline:
            return others
        time.sleep(0.02)  # A poll interval: the wait is bounded by the deadline.


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The leak-relevant state of this process at one moment."""

    fds: int
    processes: int
    rss: int


def snapshot() -> Snapshot:
    """Open descriptors, live descendants and resident memory, now."""
    return Snapshot(fds=open_fd_count(), processes=len(live_descendants()), rss=rss_bytes())


# -- how a benchmark reports -------------------------------------------------------------------------------


def median_p90_max(samples: Sequence[float]) -> tuple[float, float, float]:
    """The median, the 90th percentile (inclusive method: within the observed range) and the max."""
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    p90 = statistics.quantiles(samples, n=10, method="inclusive")[8]
    return statistics.median(samples), p90, max(samples)


def verdict(met: bool, target: str, figure: str) -> str:
    """One ``PASS``/``MISS`` line for a target."""
    return f"{'PASS' if met else 'MISS'}  {target}: {figure}"


if __name__ == "__main__":
    # `make bench` runs every bench/*.py: this module only holds helpers.
    print("helpers of the other benchmarks; nothing to measure here")


class PromptClock:
    """Notes when the provider's run calls ``AcpSession.prompt``, so that its turn is timed from
    the same point as the client path's (the run sends its prompt on its own task, as soon as the
    session is ready, which may be before ``started()`` returns to us)."""

    def __init__(self) -> None:
        self.sent_at: float | None = None
        self._original = AcpSession.prompt

    def __enter__(self) -> PromptClock:
        original = self._original

        async def timed_prompt(session: AcpSession, *args: Any, **kwargs: Any) -> Any:
            self.sent_at = time.perf_counter()
            return await original(session, *args, **kwargs)

        AcpSession.prompt = timed_prompt  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        AcpSession.prompt = self._original  # type: ignore[method-assign]
