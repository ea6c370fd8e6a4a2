"""A parent process for memory tests: one ACP run against a flooding stub agent, then its figures.

Run as ``python -m tests.memory_probe CONFIG_JSON``; it prints one JSON object. The parent's memory is
measured two ways, each from just before the big turn, after a small warm-up turn of the same shape
(so imports and first-use allocations are not counted):

* ``blocks``: the most small objects alive at once (``sys.getallocatedblocks()``, sampled every
  1,000 updates): what grows with every update kept, whatever the allocator does with freed memory;
* ``heap``: the most bytes in use in the C heap at once (glibc's ``mallinfo2``, sampled likewise):
  the larger allocations (buffers, long strings) that are not small objects;
* ``rss``: the peak resident set size (``VmHWM``) past the resident size before the turn: the
  whole cost, allocator fragmentation included. Not ``ru_maxrss``: that one keeps the peak of the
  process that spawned this one (exec inherits it), a test runner of any size.

The output is reported as its length and SHA-256, for the test to compare with the exact text.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import anyio

from subagent import SubagentRequest, SubagentService
from subagent.providers.acp import AcpProvider, AcpRun


def flood_turn(count: int, *, after_cancel: bool) -> list[dict[str, Any]]:
    """A turn of ``count`` message chunks ``"{i} "``; with ``after_cancel``, sent once the client
    has sent ``session/cancel`` (then answered ``cancelled``)."""
    flood = {"step": "flood", "count": count, "text": "{i} "}
    if not after_cancel:
        return [flood]
    return [
        {"step": "message", "text": "started "},
        {"step": "wait_for_cancel", "then": "continue"},
        flood,
        {"step": "stop", "reason": "cancelled"},
    ]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_libc = ctypes.CDLL(ctypes.util.find_library("c"))
_libc.mallinfo2.restype = _MallInfo2


def _heap_bytes() -> int:
    """Bytes in use in the C heap: allocated chunks, and the ones mapped on their own."""
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status``: ``VmRSS`` (resident now), ``VmHWM`` (its peak)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise LookupError(field)


async def _one_run(
    work: Path, count: int, *, after_cancel: bool, keep: int | None, peaks: list[int]
) -> dict[str, Any]:
    scenario = work / f"flood-{count}-{after_cancel}.json"
    scenario.write_text(json.dumps({"turns": [flood_turn(count, after_cancel=after_cancel)]}))
    provider = AcpProvider(
        [sys.executable, "-m", "subagent.testing.stub_agent", "--scenario", str(scenario)],
        cwd=work,
        cancel_grace=120.0,  # the flood after the cancel takes a while on a loaded machine
        max_kept_updates=keep,
    )
    async with SubagentService() as service:
        service.register_provider(provider)
        async with service.start(provider.name, SubagentRequest(prompt="go")) as run:
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)

            def sample(update: object) -> None:
                if acp_run.update_count % 1000 == 0:
                    peaks[0] = max(peaks[0], sys.getallocatedblocks())
                    peaks[1] = max(peaks[1], _heap_bytes())

            acp_run.on_update(sample)
            if after_cancel:
                first = anyio.Event()
                acp_run.on_update(lambda update: first.set())
                await run.started()
                await first.wait()
                await run.cancel()
            result = await run.result()
            return {
                "stopReason": result.stop_reason,
                "error": result.error,
                "outputLength": len(result.output),
                "outputSha256": hashlib.sha256(result.output.encode()).hexdigest(),
                "updateCount": acp_run.update_count,
                "kept": len(acp_run.updates),
                "dropped": acp_run.updates_dropped,
            }


async def main(config: dict[str, Any]) -> dict[str, Any]:
    work = Path(config["work"])
    keep = config.get("keep", 10_000)
    after_cancel = bool(config["afterCancel"])
    await _one_run(work, 2_000, after_cancel=after_cancel, keep=keep, peaks=[0, 0])  # warm-up
    gc.collect()
    rss_before = _status_kib("VmRSS")
    before = [sys.getallocatedblocks(), _heap_bytes()]
    peaks = list(before)
    figures = await _one_run(work, int(config["count"]), after_cancel=after_cancel, keep=keep, peaks=peaks)
    figures["blocksGrowth"] = peaks[0] - before[0]
    figures["heapGrowthKib"] = (peaks[1] - before[1]) // 1024
    figures["rssGrowthKib"] = _status_kib("VmHWM") - rss_before
    return figures


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    figures = anyio.run(main, settings, backend=settings.get("backend", "asyncio"))
    sys.stdout.write(json.dumps(figures) + "\n")
