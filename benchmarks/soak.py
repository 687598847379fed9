"""A soak: `eejax serve` (its own process, loopback only) under a mixed load for --minutes.

The load, Poisson arrivals at --rate requests/s, each drawn from `MIX` (the first ones take each
kind once, so that a short run covers the whole mix whatever its speed): greedy and sampled
requests, streamed and not, early exit and self-speculation, n = 2, repetition and frequency
penalties, echo with the prompt's log-probs, prompts that share a long prefix (the prefix
cache), clients that hang up after their first token, hostile bodies (bad JSON, a lone
surrogate, n far too large, a wrong API key: each must get its 4xx), and requests past their
deadline (a 0.05 s `timeout`: a 504 or finish reason "length" with `timed_out`). The server
compiles the mix's programs before it listens (`--warmup-for`).
Every minute a greedy canary must return the tokens it returned on the unloaded server at the
start. Every --sample-s seconds it records the server's RSS, its KV pages in use and cached,
its compiled programs and the latency (end to end, p50 / p99) of the requests that ended in that
window; at the end, once idle, every page must be free.

Checked (and printed PASS / FAIL): every accepted request answered; canaries identical
throughout; no page in use when idle; compiled programs flat after the first --warm-minutes;
RSS at the end <= 1.1x RSS after --warm-minutes; p99 latency of the last ten minutes <= 1.2x
that of minutes 5-10. Writes benchmarks/out/soak.json and a plot (--plot, default
docs/soak.png).

    pip install -e ".[serve,bench]"; python benchmarks/soak.py --minutes 60 [--rate 0.5]
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.common import OUT, ROOT  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402

KEY = "sk-soak-" + os.urandom(8).hex()
MIX = {  # kind -> weight
    "greedy": 3,
    "sampled_stream": 3,
    "early_exit_stream": 2,
    "speculation": 2,
    "n2_sampled": 1,
    "shared_prefix": 2,
    "penalised": 1,
    "echo": 1,
    "hang_up": 1,
    "hostile": 1,
    "deadline": 1,
}
# The option sets of the mix's requests besides the server's defaults (greedy, full depth) and
# speculation (--spec).
WARMUP_FOR = (
    "temperature=0.8,top_p=0.95",
    "exit=softmax:0.9",
    "repetition_penalty=1.2,frequency_penalty=0.4",
    "logprobs=2,prompt_logprobs=2",
)
UNTIMED = ("hostile", "hang_up", "deadline")  # kinds whose time says nothing of the server's latency
CANARY = "The city council met on Tuesday to discuss"


def articles() -> list[str]:
    with (ROOT / "data" / "cnndm_test_dev100.jsonl").open() as f:
        return [json.loads(line)["article"] for line in f]


def server_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def prometheus_values(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class Load:
    """The mixed requests, each returning (kind, outcome, seconds); outcome "ok" or what went wrong."""

    def __init__(self, http, texts: list[str], rng: random.Random, spec: str, scale: float = 1.0):
        self.http, self.texts, self.rng, self.spec, self.scale = http, texts, rng, spec, scale
        self.prefix = texts[-1][: int(600 * scale)]  # ~130 tokens every "shared_prefix" request starts with

    def prompt(self) -> str:
        text = self.rng.choice(self.texts[20:80])
        start = self.rng.randrange(0, max(1, len(text) - 400))
        return text[start : start + int(self.rng.choice((80, 200, 400)) * self.scale)]

    async def completion(self, body: dict, *, stream: bool = False, hang_up: bool = False) -> tuple[str, dict | None]:
        body = {"model": "m", "max_tokens": self.rng.choice((8, 16, 32)), **body}
        if not stream:
            r = await self.http.post("/v1/completions", json=body)
            return ("ok" if r.status_code == 200 else f"status {r.status_code}"), r.json()
        async with self.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return f"status {r.status_code}", None
            finished = 0
            async for line in r.aiter_lines():
                if hang_up and line.startswith("data: {"):
                    return "ok", None  # closing the stream hangs up
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("finish_reason"):
                    finished += 1
                if line == "data: [DONE]":
                    return ("ok" if finished else "stream ended without a finish reason"), None
        return "stream cut off", None

    async def hostile(self) -> str:
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        cases = [
            (b'{"prompt": "x", ', 400, headers),
            (b'{"prompt": "\\ud800 lone", "max_tokens": 4}', 400, headers),
            (json.dumps({"prompt": "x", "n": 10**6}).encode(), 400, headers),
            (json.dumps({"prompt": "x", "max_tokens": 4}).encode(), 401, {**headers, "Authorization": "Bearer no"}),
        ]
        body, want, hdrs = self.rng.choice(cases)
        r = await self.http.post("/v1/completions", content=body, headers=hdrs)
        return "ok" if r.status_code == want else f"status {r.status_code}, wanted {want}"

    async def run(self, kind: str) -> tuple[str, str, float]:
        start = time.perf_counter()
        sampled = {"temperature": 0.8, "top_p": 0.95, "seed": self.rng.randrange(2**31)}
        try:
            if kind == "greedy":
                outcome, _ = await self.completion({"prompt": self.prompt()})
            elif kind == "sampled_stream":
                outcome, _ = await self.completion({"prompt": self.prompt(), **sampled}, stream=True)
            elif kind == "early_exit_stream":
                outcome, _ = await self.completion({"prompt": self.prompt(), "exit": "softmax:0.9"}, stream=True)
            elif kind == "speculation":
                outcome, _ = await self.completion({"prompt": self.prompt(), "spec": self.spec})
            elif kind == "n2_sampled":
                outcome, _ = await self.completion({"prompt": self.prompt(), "n": 2, **sampled})
            elif kind == "penalised":
                body = {"prompt": self.prompt(), "repetition_penalty": 1.2, "frequency_penalty": 0.4}
                outcome, _ = await self.completion(body, stream=True)
            elif kind == "echo":
                outcome, out = await self.completion({"prompt": self.prompt(), "echo": True, "logprobs": 2})
                if outcome == "ok" and out["choices"][0]["logprobs"]["token_logprobs"][0] is not None:
                    outcome = "echo: the first prompt token has a log-prob"
            elif kind == "shared_prefix":
                outcome, _ = await self.completion({"prompt": self.prefix + " " + self.prompt()}, stream=True)
            elif kind == "hang_up":
                outcome, _ = await self.completion({"prompt": self.prompt()}, stream=True, hang_up=True)
            elif kind == "hostile":
                outcome = await self.hostile()
            elif kind == "deadline":
                r = await self.http.post(
                    "/v1/completions", json={"model": "m", "prompt": self.prompt(), "max_tokens": 32, "timeout": 0.05}
                )
                timed_out = r.status_code == 504 or (r.status_code == 200 and r.json()["eejax"].get("timed_out"))
                outcome = "ok" if timed_out or r.status_code == 200 else f"status {r.status_code}"
            else:
                raise ValueError(kind)
        except Exception as e:  # noqa: BLE001 - a lost request is a finding, not a crash
            outcome = f"{type(e).__name__}: {e}"
        return kind, outcome, time.perf_counter() - start


async def canary_tokens(http) -> list[int]:
    r = await http.post("/v1/completions", json={"model": "m", "prompt": CANARY, "max_tokens": 24})
    r.raise_for_status()
    return r.json()["eejax"]["tokens"]


async def soak(args, pid: int, port: int) -> dict:
    import httpx

    rng = random.Random(args.seed)
    kinds, weights = zip(*MIX.items())
    first = list(kinds)  # each kind once, then draws
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=300) as http:
        load = Load(http, articles(), rng, args.spec, args.prompt_scale)
        want = await canary_tokens(http)  # the unloaded server's answer
        t0 = time.perf_counter()
        end = t0 + args.minutes * 60
        tasks: set[asyncio.Task] = set()
        done: list[tuple[float, str, str, float]] = []  # (end time, kind, outcome, seconds)
        samples, canaries = [], []
        next_sample, next_canary = t0, t0 + 60

        def finished(task):
            tasks.discard(task)
            kind, outcome, seconds = task.result()
            done.append((time.perf_counter() - t0, kind, outcome, seconds))

        while time.perf_counter() < end:
            now = time.perf_counter()
            if now >= next_canary:
                canaries.append((now - t0, await canary_tokens(http) == want))
                next_canary += 60
            if now >= next_sample:
                metrics = prometheus_values((await http.get("/metrics")).text)
                window = [d for d in done if d[0] > now - t0 - args.sample_s and d[1] not in UNTIMED]
                lat = [d[3] for d in window]
                samples.append(
                    {
                        "t": now - t0,
                        "rss_mb": server_rss_mb(pid),
                        "pages_used": metrics.get("eejax_kv_pages_used", float("nan")),
                        "pages_cached": metrics.get("eejax_kv_pages_cached", float("nan")),
                        "programs": metrics.get("eejax_compiled_programs", float("nan")),
                        "in_flight": len(tasks),
                        "p50_s": float(np.percentile(lat, 50)) if lat else None,
                        "p99_s": float(np.percentile(lat, 99)) if lat else None,
                    }
                )
                print(f"{samples[-1]['t'] / 60:5.1f} min  " + json.dumps(samples[-1]), flush=True)
                next_sample += args.sample_s
            kind = first.pop(0) if first else rng.choices(kinds, weights)[0]
            task = asyncio.create_task(load.run(kind))
            tasks.add(task)
            task.add_done_callback(finished)
            await asyncio.sleep(rng.expovariate(args.rate))
        if tasks:
            await asyncio.wait(tasks, timeout=600)
        await asyncio.sleep(2)  # let the engine release the last rows
        idle = prometheus_values((await http.get("/metrics")).text)
        canaries.append((time.perf_counter() - t0, await canary_tokens(http) == want))
    return {"samples": samples, "done": done, "canaries": canaries, "idle": idle, "unfinished": len(tasks)}


def verdicts(result: dict, args) -> dict[str, tuple[bool, str]]:
    samples, done = result["samples"], result["done"]
    warm = args.warm_minutes * 60
    after_warm = [s for s in samples if s["t"] >= warm]
    lost = [d for d in done if d[2] != "ok"]

    def p99(lo_min, hi_min):
        lat = [d[3] for d in done if lo_min * 60 <= d[0] < hi_min * 60 and d[1] not in UNTIMED]
        return float(np.percentile(lat, 99)) if lat else float("nan")

    second_five, last_ten = p99(5, 10), p99(args.minutes - 10, args.minutes)
    rss_warm = after_warm[0]["rss_mb"] if after_warm else float("nan")
    programs = [s["programs"] for s in after_warm]
    out = {
        "every accepted request answered": (
            not lost and not result["unfinished"],
            f"{len(done)} requests, {len(lost)} lost, {result['unfinished']} unfinished"
            + (f"; first lost: {lost[0]}" if lost else ""),
        ),
        "canaries identical": (all(ok for _, ok in result["canaries"]), f"{len(result['canaries'])} canaries"),
        "no page in use when idle": (
            result["idle"].get("eejax_kv_pages_used", 1) == 0,
            f"{result['idle'].get('eejax_kv_pages_used')} used, {result['idle'].get('eejax_kv_pages_cached')} cached",
        ),
        "compiled programs flat after warm-up": (
            len(set(programs)) <= 1,
            f"{programs[0] if programs else '?'} -> {programs[-1] if programs else '?'}",
        ),
        "RSS at the end <= 1.1x after warm-up": (
            samples[-1]["rss_mb"] <= 1.1 * rss_warm,
            f"{rss_warm:.0f} MB -> {samples[-1]['rss_mb']:.0f} MB",
        ),
        "p99 of the last ten minutes <= 1.2x minutes 5-10": (
            last_ten <= 1.2 * second_five,
            f"{second_five:.2f} s -> {last_ten:.2f} s",
        ),
    }
    return {k: (bool(ok), why) for k, (ok, why) in out.items()}


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    t = [x["t"] / 60 for x in s]
    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    axes[0].plot(t, [x["rss_mb"] for x in s])
    axes[0].set_ylabel("server RSS (MB)")
    axes[1].plot(t, [x["pages_used"] for x in s], label="in use")
    axes[1].plot(t, [x["pages_cached"] for x in s], label="prefix cache")
    axes[1].set_ylabel("KV pages")
    axes[1].legend()
    axes[2].plot(t, [x["programs"] for x in s])
    axes[2].set_ylabel("compiled programs")
    axes[3].plot(t, [x["p50_s"] for x in s], label="p50")
    axes[3].plot(t, [x["p99_s"] for x in s], label="p99")
    axes[3].set_ylabel("latency (s)")
    axes[3].set_xlabel("minutes")
    axes[3].legend()
    mix = ", ".join(f"{k} {v}" for k, v in MIX.items())
    fig.suptitle(f"eejax serve soak, requests by weight:\n{mix}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--minutes", type=float, default=60.0, help="how long the load runs (default 60)")
    p.add_argument("--rate", type=float, default=0.5, help="requests per second, Poisson (default 0.5)")
    p.add_argument("--warm-minutes", type=float, default=5.0, help="the warm-up the checks start after (default 5)")
    p.add_argument("--sample-s", type=float, default=30.0, help="seconds between samples (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=str(ROOT / "docs" / "soak.png"), help="the PNG written (default docs/soak.png)")
    p.add_argument("--spec", default="15:2", help="the speculation requests' spec (default 15:2, for SmolLM2)")
    p.add_argument(
        "--warmup", type=int, default=256, help="eejax serve --warmup TOKENS, for the mix's options (0: off)"
    )
    p.add_argument("--prompt-scale", type=float, default=1.0, help="prompt lengths x this (a small model's context)")
    p.add_argument("--out", default=str(OUT), help="the result (soak.json) and the server's log go here")
    args = p.parse_args()
    # The server warms ~260 programs of ~256 memory maps each (see eejax/decode/programs.py).
    maps = Path("/proc/sys/vm/max_map_count")
    if args.warmup and maps.exists() and int(maps.read_text()) < 100_000:
        print("note: vm.max_map_count is low for the warm-up; sysctl -w vm.max_map_count=262144", file=sys.stderr)
    if args.minutes < 15:
        print("note: with --minutes under 15 the p99 check compares overlapping windows", file=sys.stderr)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "eejax.cli", "serve", "--model", args.model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--max-tokens-limit", "64", "--api-key", KEY]
    if args.warmup:  # the mix's requests compile before the server listens
        cmd += ["--warmup", str(args.warmup)]
        for options in (*WARMUP_FOR, f"spec={args.spec}"):
            cmd += ["--warmup-for", options]
    cmd += ["--request-timeout", "120", "--log-format", "json", "--served-model-name", "m"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "soak-server.log", "w")  # the server's log, JSON access lines
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        import httpx

        while True:  # the model loads and --warmup compiles before the server listens
            if server.poll() is not None:
                raise SystemExit(f"eejax serve exited with {server.returncode}: see {log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(1)
        result = asyncio.run(soak(args, server.pid, port))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
        log.close()
    checks = verdicts(result, args)
    for name, (ok, why) in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {why}")
    kinds = {k: sum(d[1] == k for d in result["done"]) for k in MIX}
    payload = {"args": vars(args), "checks": checks, "requests": kinds, "samples": result["samples"]}
    payload["canaries"] = result["canaries"]
    path = out / "soak.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    plot(result, args.plot)
    print(f"wrote {args.plot}")
    return 0 if all(ok for ok, _ in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
