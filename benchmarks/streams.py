"""Concurrent streams end when generation ends: N clients stream completions at once from an
Engine behind uvicorn on 127.0.0.1; reported, from the moment the requests are sent: when the
engine produced its last token (`generation`), when the last client read its final event
(`streams`), their ratio (target <= 1.2: tokens reach the event loop directly, no thread-pool
hop per token), and lost streams.

    python benchmarks/streams.py [--model smollm2-135m] [--streams 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eejax  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from benchmarks.serve import Server, workload  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402


async def stream(http, prompt, max_tokens) -> float | None:
    """Streams one completion; the time its final event arrived, or None if it failed."""
    async with http.stream(
        "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    ) as r:
        if r.status_code != 200:
            return None
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return time.perf_counter()
    return None


async def run_streams(port, prompts, max_tokens):
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as http:
        return await asyncio.gather(*(stream(http, p, max_tokens) for p in prompts))


def main() -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    args = p.parse_args()

    model = eejax.load(args.model, quantization=None)
    prompts = workload(model.tokenizer, args.streams, args.prompt_tokens, seed=0)
    server = Server(
        model,
        max(len(x) for x in prompts),
        max_slots=args.streams,
        max_new_tokens=args.max_tokens,
        cache_budget="512MiB",
    )
    try:
        asyncio.run(run_streams(server.port, prompts[:4], 2))  # the HTTP path warmed
        engine = server.engine
        before = engine.counters["generated_tokens"]
        stop, seen = threading.Event(), {}

        def watch():  # the last moment the engine's count of generated tokens moved: generation's end
            while not stop.is_set():
                now = engine.counters["generated_tokens"]
                if now != seen.get("n"):
                    seen["n"], seen["t"] = now, time.perf_counter()
                time.sleep(0.0005)

        watcher = threading.Thread(target=watch, daemon=True)
        start = time.perf_counter()
        watcher.start()
        ends = asyncio.run(run_streams(server.port, prompts, args.max_tokens))
        stop.set()
        watcher.join()
    finally:
        server.close()
    done = [t for t in ends if t is not None]
    generation = seen["t"] - start
    streams = max(done) - start
    tokens = seen["n"] - before
    result = {
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "generated_tokens": tokens,
        "generation_s": generation,
        "streams_s": streams,
        "ratio": streams / generation,
        "last_stream_lag_s": streams - generation,
        "lost": len(ends) - len(done),
    }
    print(
        f"{args.streams} concurrent streams, {tokens} tokens: generation ended at {generation:.2f} s, the last "
        f"stream at {streams:.2f} s: {result['ratio']:.3f}x (target <= 1.2), "
        f"{(streams - generation) * 1e3:.0f} ms later; lost {result['lost']}"
    )
    write_result("streams", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
