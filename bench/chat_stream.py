"""The OpenAI-compatible adapter's streaming cost: one completion of many text deltas, against the floor.

The loopback stub server (``subagent.testing.serve_chat_completions``) sends one pre-built answer
of ``--chunks`` deltas in 64 KiB pieces, in this process. Measured one after the other on the same
server, medians of ``--repeat`` rounds:

* **adapter**: ``OpenAiChatAdapter.stream`` to the final ``Completion`` (SSE framing, a typed
  decode of every chunk, the deltas handed out, the message assembled);
* **floor**: the same request with bare httpx, counting the ``data:`` lines (no decoding at all).

Both include the stub server's (small) cost, the same for both. Target: the adapter at most 3x
the floor. The floor decodes nothing, while the adapter must frame SSE events and decode every
chunk's JSON; at 3x it still takes hundreds of thousands of chunks a second, far past any model's
pace, so decoding is never what a long answer waits on.

    python bench/chat_stream.py [--chunks 20000] [--repeat 5] [--backend asyncio|trio]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import anyio
import httpx
from _common import BenchBroken, verdict

from subagent.runtime import Completion, CompletionRequest, Message, TextDelta
from subagent.runtime.openai import OpenAiChatAdapter
from subagent.testing import RawStream, serve_chat_completions

REQUEST = CompletionRequest(messages=(Message.user("Stream a long answer."),))


async def through_adapter(adapter: OpenAiChatAdapter, chunks: int) -> float:
    started = time.perf_counter()
    deltas = 0
    async for event in adapter.stream(REQUEST):
        if isinstance(event, TextDelta):
            deltas += 1
        elif isinstance(event, Completion) and len(event.message.content) != chunks * 2:
            raise BenchBroken(f"the assembled answer has {len(event.message.content)} characters")
    if deltas != chunks:
        raise BenchBroken(f"adapter: {deltas} deltas, expected {chunks}")
    return time.perf_counter() - started


async def floor(client: httpx.AsyncClient, base_url: str, chunks: int) -> float:
    started = time.perf_counter()
    lines = 0
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with client.stream("POST", f"{base_url}/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                lines += 1
    # the role chunk, the deltas, the finish chunk, [DONE]
    if lines != chunks + 3:
        raise BenchBroken(f"floor: {lines} data lines, expected {chunks + 3}")
    return time.perf_counter() - started


def sse_body(chunks: int) -> list[bytes]:
    """The answer as a server sends it: a role chunk, ``chunks`` deltas of "ab", the finish chunk and
    ``[DONE]``, in 64 KiB pieces (pre-built, so the stub server costs next to nothing)."""
    head = b'data: {"id":"c","object":"chat.completion.chunk","model":"stub-model","choices":[{"index":0,'
    events = [head + b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n']
    events += [head + b'"delta":{"content":"ab"},"finish_reason":null}]}\n\n'] * chunks
    events += [head + b'"delta":{},"finish_reason":"stop"}]}\n\n', b"data: [DONE]\n\n"]
    body = b"".join(events)
    return [body[i : i + 65536] for i in range(0, len(body), 65536)]


async def main(args: argparse.Namespace) -> int:
    reply = RawStream(sse_body(args.chunks))
    adapter_times, floor_times = [], []
    async with (
        serve_chat_completions([reply] * (2 * args.repeat + 2)) as server,
        # Made once, outside the timed rounds: what is measured is the stream, not a client's set-up.
        httpx.AsyncClient() as client,
        OpenAiChatAdapter(model="stub-model", base_url=server.base_url, api_key_env=None) as adapter,
    ):
        await through_adapter(adapter, args.chunks)  # warm-up: imports, decoders, the stub
        await floor(client, server.base_url, args.chunks)
        for _ in range(args.repeat):
            floor_times.append(await floor(client, server.base_url, args.chunks))
            adapter_times.append(await through_adapter(adapter, args.chunks))
    adapter_s, floor_s = statistics.median(adapter_times), statistics.median(floor_times)
    ratio = adapter_s / floor_s
    print(f"backend {args.backend}; one answer of {args.chunks:,} deltas; medians of {args.repeat}")
    for name, seconds in (("floor (bare httpx lines)", floor_s), ("OpenAiChatAdapter", adapter_s)):
        print(f"{name:26}{seconds * 1e3:8.1f} ms ({seconds / args.chunks * 1e6:.2f} us per chunk)")
    met = ratio <= 3.0
    print(verdict(met, "adapter / floor <= 3x", f"{ratio:.2f}x"))
    return 0 if met else 1


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=20000, help="deltas in the answer (default 20000)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; medians are reported (default 5)")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    args = parser.parse_args()
    try:
        return anyio.run(main, args, backend=args.backend)
    except BenchBroken as exc:
        print(f"BROKEN: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
