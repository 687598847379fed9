"""The HTTP server under a mixed load with Poisson arrivals (BucketServe's evaluation, small).

Requests: CNN/DM articles cut to --long-tokens (long) and their first sentence (short), mixed
half and half, each asking --max-tokens tokens, streamed (so the client sees the first token).
With --shared-prefix N, every other request starts with the same N tokens (an article's: a long
system prompt) before its own. For each configuration (FCFS without buckets, BucketServe
bucketing, + chunked prefill, + early exit, without the prefix cache; --configs picks) and each
arrival rate, a fresh engine behind a uvicorn server on 127.0.0.1 takes the same request
sequence after the same requests at a high rate have compiled what it needs (`Engine.warmup`
first); the compile seconds left inside the measured run are reported. Reported: throughput
(completion tokens/s over the run), time to first token, time per output token (a request's
mean) and inter-token latency (every gap between two tokens of a stream: what chunked prefill
bounds), p50/p99, the share of requests within the SLO, the prefill padding waste (padding /
(prompt + padding) tokens), the share of prompt tokens the prefix cache gave, the scheduler's
share of step time, and lost requests (refused, or a stream that never said it finished; a
request whose first token is EOS streams no text and is finished, not lost: 3 of the default
96 do).

    pip install -e ".[serve,bench]"; python benchmarks/serve.py [--rates 2 4 16] [--requests 96]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import eejax  # noqa: E402
from benchmarks.common import ROOT, fmt_ratio, write_result  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser

CONFIGS = {
    "fcfs, no buckets": dict(bucketing=False),
    "bucketserve": dict(bucketing=True),
    "bucketserve + chunked prefill": dict(bucketing=True),  # prefill_chunk from --prefill-chunk
    "bucketserve + early exit": dict(bucketing=True, exit="softmax:0.9"),
    "bucketserve, no prefix cache": dict(bucketing=True, prefix_caching=False),
}
DEFAULT_CONFIGS = ["fcfs, no buckets", "bucketserve", "bucketserve + chunked prefill", "bucketserve + early exit"]


def workload(tokenizer, n: int, long_tokens: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    with (ROOT / "data" / "cnndm_test_dev100.jsonl").open() as f:
        articles = [json.loads(line)["article"] for line in f]
    rng = np.random.default_rng(seed)
    prefix = tokenizer(articles[-1])["input_ids"][:shared_prefix]  # (the last article: no request's own)
    prompts = []
    for i in range(n):
        text = articles[i % len(articles)]
        if rng.random() < 0.5:
            prompt = tokenizer(text)["input_ids"][:long_tokens]
        else:
            prompt = tokenizer(text.split(". ")[0] + ".")["input_ids"][:64]
        prompts.append(prefix + prompt if i % 2 else prompt)
    return prompts


class Server:
    """An Engine behind uvicorn on a free loopback port, in a thread."""

    def __init__(self, model, warmup_tokens: int, **engine_options):
        import uvicorn

        from eejax.engine.engine import Engine
        from eejax.serve.http import create_app

        self.engine = Engine(model, **engine_options)
        self.engine.warmup(warmup_tokens, progress=False)  # every program compiled before the clock starts
        self.engine.start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(
                create_app(self.engine, served_model_name="m", max_waiting=10**6),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def close(self):
        self.server.should_exit = True
        self.thread.join()
        self.engine.stop(cancel=True)


async def one_request(http, prompt, max_tokens, delay):
    await asyncio.sleep(delay)
    start = time.perf_counter()
    times, layers = [], None
    async with http.stream(
        "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    ) as r:
        if r.status_code != 200:
            return None
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"][0].get("finish_reason") is None:
                    times.append(time.perf_counter())
                else:
                    layers = chunk["eejax"]["exit_layers"]
    return None if layers is None else (start, times, layers)  # None: the stream never finished


async def drive(port, prompts, max_tokens, rate, seed):
    import httpx

    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(prompts))
    arrivals = np.cumsum(gaps) - gaps[0]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one_request(http, p, max_tokens, a) for p, a in zip(prompts, arrivals)))
        return out, time.perf_counter() - t0


def summarise(results, wall, engine, slo_ttft, slo_tpot) -> dict:
    finished = [r for r in results if r is not None]
    done = [r for r in finished if r[1]]  # with a streamed token (EOS first streams none)
    ttft = np.array([t[0] - s for s, t, _ in done])
    tpot = np.array([(t[-1] - t[0]) / (len(t) - 1) for s, t, _ in done if len(t) > 1])
    itl = np.array([b - a for _, t, _ in done for a, b in zip(t, t[1:])])  # every gap between two tokens
    tokens = sum(len(t) for _, t, _ in done)
    m = engine.metrics()
    within = sum(
        1 for s, t, _ in done if t[0] - s <= slo_ttft and (len(t) < 2 or (t[-1] - t[0]) / (len(t) - 1) <= slo_tpot)
    )
    return {
        "tokens_per_s": tokens / wall,
        "layers_per_token": float(np.mean([x for *_, ls in done for x in ls])),
        "completed": len(finished),
        "lost": len(results) - len(finished),
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p99": float(np.percentile(ttft, 99)),
        "tpot_p50": float(np.percentile(tpot, 50)),
        "tpot_p99": float(np.percentile(tpot, 99)),
        "itl_p50": float(np.percentile(itl, 50)),
        "itl_p99": float(np.percentile(itl, 99)),
        "slo_share": within / len(results),
        "padding_waste": m["padding_tokens"] / max(m["padding_tokens"] + m["prompt_tokens"], 1),
        "scheduler_share": m["scheduler_s"] / max(m["step_s"], 1e-9),
        "compiled_programs": m["compiled_programs"],
        "kv_pages_used_after": m["kv_pages_used"],
        "prefix_cache_hit_share": m["prefix_cache_hit_tokens"] / max(m["prompt_tokens"], 1),
    }


def offline(model, prompts, args) -> dict:
    """The same requests as one batch job (`Engine.generate_offline`, no HTTP): FCFS without
    buckets vs BucketServe's offline choice (the fullest bucket), FCFS and SJF inside buckets.
    Greedy outputs must be identical across configurations."""
    from eejax.engine.engine import Engine

    configs = {
        "fcfs, no buckets": dict(bucketing=False),
        "bucketserve offline, fcfs": dict(bucketing=True, online=False),
        "bucketserve offline, sjf": dict(bucketing=True, online=False, policy="sjf"),
    }
    out, tokens = {}, None
    for name, options in configs.items():
        engine = Engine(model, max_slots=args.slots, max_new_tokens=args.max_tokens, cache_budget="256MiB", **options)
        engine.warmup(max(len(p) for p in prompts), progress=False)
        start = time.perf_counter()
        seqs = engine.generate_offline(prompts, max_new_tokens=args.max_tokens, progress=False)
        wall = time.perf_counter() - start
        m = engine.metrics()
        assert tokens is None or [s.tokens for s in seqs] == tokens, f"{name}: outputs differ"
        tokens = [s.tokens for s in seqs]
        out[name] = {
            "tokens_per_s": sum(map(len, tokens)) / wall,
            "wall_s": wall,
            "prefills": m["prefills"],
            "padding_waste": m["padding_tokens"] / max(m["padding_tokens"] + m["prompt_tokens"], 1),
        }
        print(
            f"offline batch job, {name:<26}: {out[name]['tokens_per_s']:6.1f} tok/s "
            f"({fmt_ratio(out[name]['tokens_per_s'], out['fcfs, no buckets']['tokens_per_s'])}), "
            f"{m['prefills']} prefills, padding {out[name]['padding_waste']:.0%}",
            flush=True,
        )
    return out


def main() -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--rates", type=float, nargs="+", action="extend", default=[2.0, 4.0, 16.0], help="requests per second"
    )
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--long-tokens", type=int, default=384)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--slo-ttft", type=float, default=5.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.5, help="seconds per output token")
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="every other request starts with the same N tokens (default 0: none)",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        action="extend",
        choices=list(CONFIGS),
        default=None,
        help="configurations to run (default: all but 'bucketserve, no prefix cache')",
    )
    p.add_argument("--no-offline", action="store_true", help="skip the offline batch job comparison")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        metavar="TOKENS",
        help="prompt tokens per step of the chunked-prefill configuration (default 256)",
    )
    p.add_argument("--name", default="serve", help="the result file: benchmarks/out/NAME.json")
    args = p.parse_args()
    configs = args.configs or DEFAULT_CONFIGS

    model = eejax.load(args.model)
    prompts = workload(model.tokenizer, args.requests, args.long_tokens, seed=0, shared_prefix=args.shared_prefix)
    results: dict = {"requests": args.requests, "rates": args.rates, "shared_prefix": args.shared_prefix, "configs": {}}
    for name in configs:
        options = dict(CONFIGS[name], **({"prefill_chunk": args.prefill_chunk} if "chunked" in name else {}))
        results["configs"][name] = {}
        for rate in args.rates:
            server = Server(
                model,
                max(len(p) for p in prompts),
                max_slots=args.slots,
                max_new_tokens=args.max_tokens,
                cache_budget="256MiB",
                **options,
            )
            # The same requests at a high rate compile the shapes this workload needs (chunks and
            # shared prefixes give prefill shapes `warmup` does not cover) and warm the HTTP path.
            asyncio.run(drive(server.port, prompts, args.max_tokens, 100.0, seed=1))
            server.engine.pages.allocator.evict_idle()  # the measured run starts with an empty prefix cache
            for key in server.engine.counters:
                server.engine.counters[key] = 0 if isinstance(server.engine.counters[key], int) else 0.0
            compile_before = model.programs.compile_seconds
            out, wall = asyncio.run(drive(server.port, prompts, args.max_tokens, rate, seed=2))
            time.sleep(0.5)
            s = summarise(out, wall, server.engine, args.slo_ttft, args.slo_tpot)
            s["compile_s_in_run"] = model.programs.compile_seconds - compile_before
            server.close()
            results["configs"][name][str(rate)] = s
            print(
                f"{name:<26} rate {rate:>4}/s: {s['tokens_per_s']:6.1f} tok/s, {s['layers_per_token']:.1f} "
                f"layers/token, TTFT p50/p99 {s['ttft_p50']:.2f}/"
                f"{s['ttft_p99']:.2f} s, TPOT p50/p99 {s['tpot_p50'] * 1e3:.0f}/{s['tpot_p99'] * 1e3:.0f} ms, "
                f"ITL p50/p99 {s['itl_p50'] * 1e3:.0f}/{s['itl_p99'] * 1e3:.0f} ms, "
                f"SLO {s['slo_share']:.0%}, padding {s['padding_waste']:.0%}, scheduler "
                f"{s['scheduler_share']:.2%} of step time, prefix cache {s['prefix_cache_hit_share']:.0%} of "
                f"prompt tokens, compiling {s['compile_s_in_run']:.1f} s, lost {s['lost']}",
                flush=True,
            )
    base_name = configs[0]
    base = results["configs"][base_name]
    for name in configs[1:]:
        row = results["configs"][name]
        tput = [fmt_ratio(row[str(r)]["tokens_per_s"], base[str(r)]["tokens_per_s"]) for r in args.rates]
        tpot = [fmt_ratio(row[str(r)]["tpot_p99"], base[str(r)]["tpot_p99"]) for r in args.rates]
        itl = [fmt_ratio(row[str(r)]["itl_p99"], base[str(r)]["itl_p99"]) for r in args.rates]
        print(
            f"{name:<30} vs {base_name}: throughput {', '.join(tput)}; TPOT p99 {', '.join(tpot)}; "
            f"ITL p99 {', '.join(itl)}"
        )
    if not args.no_offline:
        results["offline"] = offline(model, prompts, args)
    results["compiled_programs"] = model.programs.num_programs
    print(f"programs compiled in all (every configuration, rate and shape): {model.programs.num_programs}")
    write_result(args.name, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
