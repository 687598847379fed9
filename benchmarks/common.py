"""Shared pieces of the benchmarks: prompts, the HF peer, the machine's read bandwidth."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"


def cnndm_prompts(tokenizer, n: int, prompt_tokens: int) -> list[list[int]]:
    """The first `prompt_tokens` tokens of the first n CNN/DM test articles (cycled if n > 100)."""
    with (ROOT / "data" / "cnndm_test_dev100.jsonl").open() as f:
        articles = [json.loads(line)["article"] for line in f]
    return [tokenizer(articles[i % len(articles)])["input_ids"][:prompt_tokens] for i in range(n)]


def load_hf_smollm2(dtype: str = "float32", device: str = "cpu"):
    """HF transformers' SmolLM2-135M from the same GGUF file (`eejax.bench.peers.load_hf`)."""
    from eejax.bench.peers import load_hf
    from eejax.loading.hub import fetch_original

    return load_hf(fetch_original("smollm2-135m"), dtype, device)


def hf_generate_seconds(hf, prompts: list[list[int]], new_tokens: int, pad_id: int, cache: str | None = None) -> float:
    """Wall seconds of HF `generate` (`eejax.bench.peers.hf_generate`)."""
    from eejax.bench.peers import hf_generate

    return hf_generate(hf, prompts, new_tokens, pad_id, cache)[0]


def hf_generate_tokens_per_s(hf, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """HF `generate` (greedy, left-padded batch, exactly `new_tokens` each): generated tokens / wall s."""
    return len(prompts) * new_tokens / hf_generate_seconds(hf, prompts, new_tokens, pad_id)


def hf_decode_tokens_per_s(
    hf, prompts: list[list[int]], new_tokens: int, pad_id: int, cache: str | None = None
) -> float:
    """HF's decode steps alone: tokens 2..new_tokens of each row over the time `generate` takes
    beyond a 1-token `generate` (the prefill and its token)."""
    full = hf_generate_seconds(hf, prompts, new_tokens, pad_id, cache)
    extra = full - hf_generate_seconds(hf, prompts, 1, pad_id, cache)
    return len(prompts) * (new_tokens - 1) / extra


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best-of-n read bandwidth of a jitted reduction over `nbytes` (what decode streams at)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(nbytes // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    del x
    return nbytes / best / 1e9


@dataclasses.dataclass
class Paired:
    """Speeds of configurations against a peer timed around each of them (see `paired_runs`).
    peer / results: the last repeat's results; speedups[i]: median over repeats of config i's
    speed over its peer's; speeds[i] and peer_speed: medians of the speeds themselves."""

    peer: Any
    results: list
    speedups: list[float]
    speeds: list[float]
    peer_speed: float


def paired_runs(
    run: Callable[[Any], Any],
    configs: list,
    repeats: int,
    speed: Callable[[Any], float] = lambda r: r.stats["decode_tokens_per_s"],
) -> Paired:
    """Times `run(c)` for every config c against `run(None)` (the peer: full depth, say), as
    `eejax bench` does (`eejax.bench.paired`): a warm-up run each, then every repeat runs peer,
    c_1, peer, c_2, ..., c_n, peer; c_i's speed-up is its speed over the mean of the two peer
    runs around it, the median over repeats."""
    from eejax.bench.paired import paired_runs as timed_pairs

    timed = timed_pairs(run, configs, repeats)
    n = range(len(configs))
    return Paired(
        timed.last(None),
        [timed.last(i) for i in n],
        [timed.ratio(i, speed) for i in n],
        [timed.speed(i, speed) for i in n],
        timed.speed(None, speed),
    )


def decoding_options(setting: str | None) -> dict:
    """`generate`'s keyword for a benchmark's setting: "full" or None (full depth), "exit:MEASURE"
    (early exit, e.g. exit:softmax:0.9) or a speculation spec ("draft:4", "15:2")."""
    if setting in (None, "full"):
        return {"spec": None}
    if setting.startswith("exit:"):
        return {"exit": setting[len("exit:") :]}
    return {"spec": setting}


def write_result(name: str, payload: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=lambda x: x.as_dict()) + "\n")  # as_dict: GenerateStats
    return path


def fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 and np.isfinite(a) else "n/a"


def with_exit_vocab(model, size: int = 8192, articles: range = range(20, 68), new_tokens: int = 64):
    """`model` with a reduced exit head of its `size` most frequent tokens, counted over its own
    greedy continuations of CNN/DM `articles` (not the benchmarks' prompts, which are the first
    ones) as `eejax exit-vocab` does; the ids are cached under the eejax cache directory."""
    from eejax.loading.hub import cache_dir
    from eejax.train.exit_vocab import add_exit_vocab, count_tokens, most_frequent

    path = cache_dir() / "exit-vocab" / f"smollm2-135m-{size}-{articles.start}-{articles.stop}-{new_tokens}.json"
    if path.exists():
        ids = json.loads(path.read_text())["ids"]
    else:
        with (ROOT / "data" / "cnndm_test_dev100.jsonl").open() as f:
            texts = [json.loads(line)["article"] for line in f]
        prompts = [model.tokenizer(texts[i])["input_ids"][:512] for i in articles]
        counts = count_tokens(model, prompts, new_tokens=new_tokens)
        ids = most_frequent(counts, size, always=model.eos_token_ids).tolist()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "ids": ids,
                    "articles": [articles.start, articles.stop],
                    "new_tokens": new_tokens,
                    "coverage": float(counts[ids].sum() / counts.sum()),
                }
            )
        )
    return add_exit_vocab(model, ids)


def _quantization(value: str) -> str | None:
    """--quantization's value: "gguf" or "int8", or None for float ("none", "off")."""
    import argparse

    if value in ("none", "off"):
        return None
    if value not in ("gguf", "int8"):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from gguf, int8, none)")
    return value


def add_quantization_args(parser) -> None:
    """--quantization, --activations and --prompt-activations, as `eejax.load` takes them."""
    from eejax.quantized import ACTIVATIONS

    parser.add_argument(
        "--quantization",
        type=_quantization,
        default=None,
        metavar="{gguf,int8,none}",
        help="eejax's weights quantized: the GGUF's own blocks, or int8 per channel; none or off: float (default)",
    )
    parser.add_argument("--activations", choices=ACTIVATIONS, default="float32", help="how quantized products take x")
    parser.add_argument(
        "--prompt-activations",
        choices=ACTIVATIONS,
        default=None,
        help="how a prefill's take x (default: --activations)",
    )


def load_model(args, name: str = "smollm2-135m", **kwargs):
    """`eejax.load(name)` with the benchmark's --layer-buffers, --quantization, --activations and
    --prompt-activations."""
    import eejax

    return eejax.load(
        name,
        layer_buffers=args.layer_buffers,
        quantization=args.quantization,
        activations=args.activations,
        prompt_activations=args.prompt_activations,
        **kwargs,
    )


def run_kernel_benchmark(name: str, args: list[str], kernel: str = "cpu_quantized.cc") -> int:
    """Compiles benchmarks/NAME.cc, which includes eejax/kernels/`kernel` (KERNEL_SOURCE), with
    the library's flags, and runs it with `args`; its exit status (1 without a C++ compiler)."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    import jax

    from eejax.kernels import cpu_matmul

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        print(f"{name}.py: no C++ compiler (set $CXX, or install g++)", file=sys.stderr)
        return 1
    source = cpu_matmul.SOURCE.with_name(kernel)
    flags = [f for f in cpu_matmul._flags() if f not in ("-shared", "-fPIC")]
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / name
        command = [compiler, *flags, "-I", jax.ffi.include_dir(), f'-DKERNEL_SOURCE="{source}"', "-pthread"]
        subprocess.run([*command, str(Path(__file__).resolve().parent / f"{name}.cc"), "-o", str(binary)], check=True)
        return subprocess.run([str(binary), *args], check=False).returncode


def vnni_kernel_main(name: str, doc: str, flag: str, default: int, help: str, argv=None) -> int:
    """The command line of a benchmark of the tiled loop (benchmarks/NAME.cc, `run_kernel_benchmark`)
    that takes one count (`flag`, at least 1): parsed, refused by name below 1, and refused where
    the CPU has no AVX-512 VNNI, which the loop needs."""
    import sys

    from eejax.cli.parsing import OneLineErrorParser
    from eejax.kernels import cpu_matmul

    parser = OneLineErrorParser(description=doc.split("\n\n")[0])
    parser.add_argument(flag, type=int, default=default, help=help)
    args = parser.parse_args(argv)
    count = getattr(args, flag.lstrip("-").replace("-", "_"))
    if count < 1:
        parser.error(f"{flag} must be at least 1, got {count}")
    if not cpu_matmul.panel_products():
        print(f"{name}.py: this CPU has no AVX-512 VNNI, which the tiled loop needs", file=sys.stderr)
        return 1
    return run_kernel_benchmark(name, [str(count)])
