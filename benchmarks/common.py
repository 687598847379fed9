"""Shared pieces of the benchmarks: prompts, the HF peer, the machine's read bandwidth."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"


def cnndm_prompts(tokenizer, n: int, prompt_tokens: int) -> list[list[int]]:
    """The first `prompt_tokens` tokens of the first n CNN/DM test articles (cycled if n > 100)."""
    with (ROOT / "data" / "cnndm_test_dev100.jsonl").open() as f:
        articles = [json.loads(line)["article"] for line in f]
    return [tokenizer(articles[i % len(articles)])["input_ids"][:prompt_tokens] for i in range(n)]


def load_hf_smollm2():
    import torch
    from transformers import AutoModelForCausalLM

    from eejax.hub import fetch_original

    gguf = fetch_original("smollm2-135m")
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


def hf_generate_tokens_per_s(hf, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """HF `generate` (greedy, left-padded batch, exactly `new_tokens` each): generated tokens / wall s."""
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id)
    with torch.no_grad():
        hf.generate(ids[:, -8:], attention_mask=mask[:, -8:], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, **kw)
        elapsed = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    return len(prompts) * new_tokens / elapsed


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


def write_result(name: str, payload: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 and np.isfinite(a) else "n/a"


def with_exit_vocab(model, size: int = 8192, articles: range = range(20, 68), new_tokens: int = 64):
    """`model` with a reduced exit head of its `size` most frequent tokens, counted over its own
    greedy continuations of CNN/DM `articles` (not the benchmarks' prompts, which are the first
    ones) as `eejax exit-vocab` does; the ids are cached under the eejax cache directory."""
    from eejax.hub import cache_dir
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
        path.write_text(json.dumps({"ids": ids, "articles": [articles.start, articles.stop], "new_tokens": new_tokens,
                                    "coverage": float(counts[ids].sum() / counts.sum())}))
    return add_exit_vocab(model, ids)
