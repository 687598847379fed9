"""Quantized SmolLM2-135M against its float32 model: quality, memory and speed, per format.

Settings: float32 (the GGUF dequantised: the exact reference of its blocks), the GGUF's own blocks
(Q4_1 layers, Q8_0 embedding and head) and int8 per output channel made from the float32 model,
each with float32, int16 and int8 activations (`eejax.load`), spelled weights:activations, and
weights:activations:prompt-activations for a prefill's own (gguf:float32:int16). For each:
  - quality: WikiText-2 perplexity (data/wikitext2_valid_test.txt.gz, --ppl-chunks chunks of 512
    tokens, each product as decoding computes it) and, on the same positions, the share whose
    greedy token equals float32's, where float32's top two logits are at least 1e-3 apart
    (below that a near-tie may go either way);
  - memory: the RSS a fresh process (JAX's runtime started, orbax and the tokenizer's code
    imported) adds by loading the model, and of it the anonymous memory (without the library code
    that loading pages in), against the weights' bytes;
  - speed, in the same run as float32: decode tokens/s at batch 1 and 8 (256-token CNN/DM
    prompts, --new-tokens greedy tokens, prefill excluded) and prefill tokens/s of one 256-token
    prompt, with their ratios to float32 and the batch-1 share of the bandwidth bound (bytes read).

    python benchmarks/quantized.py [--settings float32 gguf gguf:int16 ...] [--ppl-chunks 24]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import eejax  # noqa: E402
from benchmarks.common import ROOT, cnndm_prompts, read_bandwidth_gbs, write_result  # noqa: E402
from eejax import quantized  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.models import llama  # noqa: E402
from eejax.models.llama import param_bytes_per_token  # noqa: E402

SETTINGS = ("float32", "gguf", "gguf:int16", "gguf:int8", "gguf:float32:int16", "int8", "int8:int16", "int8:int8")
NEAR_TIE = 1e-3


def load(setting: str):
    quantization, activations, prompts = (setting.split(":") + ["", ""])[:3]
    return eejax.load(
        "smollm2-135m",
        quantization=None if quantization == "float32" else quantization,
        activations=activations or "float32",
        prompt_activations=prompts or None,
    )


def wikitext_chunks(tokenizer, n: int, length: int = 512) -> list[list[int]]:
    with gzip.open(ROOT / "data" / "wikitext2_valid_test.txt.gz", "rt") as f:
        documents = [d for d in f.read().split("\n\n\n") if d.strip()]
    chunks = []
    for doc in documents:
        ids = tokenizer(doc)["input_ids"]
        chunks += [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)]
        if len(chunks) >= n:
            break
    return chunks[:n]


def chunk_logits(model, chunk: list[int]) -> np.ndarray:
    """Next-token logits [T, V] of one chunk (the training forward: no cache), its products as a
    prefill computes them (the prompt activations)."""
    tokens = jnp.asarray([chunk], jnp.int32)
    params = quantized.for_prompts(model.params)
    states, _ = jax.jit(llama.forward_states, static_argnums=3)(
        params, tokens, jnp.asarray([len(chunk)], jnp.int32), model.config
    )
    return np.asarray(jax.jit(llama.lm_head, static_argnums=2)(params, states[-1, 0], model.config))


def quality(model, chunks, reference: list[np.ndarray] | None) -> tuple[dict, list[np.ndarray]]:
    nll, count, same, decided = 0.0, 0, 0, 0
    kept = []
    for i, chunk in enumerate(chunks):
        logits = chunk_logits(model, chunk)
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        nll -= float(logp[np.arange(len(chunk) - 1), chunk[1:]].sum())
        count += len(chunk) - 1
        if reference is None:
            kept.append(logits)
            continue
        ref = reference[i]
        top2 = np.sort(ref, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] >= NEAR_TIE
        same += int(((logits.argmax(-1) == ref.argmax(-1)) & clear).sum())
        decided += int(clear.sum())
    out = {"perplexity": float(np.exp(nll / count)), "positions": count}
    if reference is not None:
        out["greedy_agreement"] = same / decided
    return out, kept


def rss_added(setting: str) -> dict:
    """RSS a fresh process adds by loading `setting` (weights and tokenizer), of it the anonymous
    memory (RSS less the pages of library code that loading runs for the first time: file-backed,
    shared, dropped under pressure), the weights' bytes, and the RSS that loading the tokenizer
    alone adds (in a second fresh process)."""
    code = "\n".join(
        [
            "import json, sys",
            "sys.path.insert(0, sys.argv[1])",
            "import jax, jax.numpy as jnp",
            "from benchmarks.quantized import load",
            "jnp.zeros(1).block_until_ready()  # the runtime's own memory is not the model's,",
            "import orbax.checkpoint, transformers.models.auto.tokenization_auto  # nor the loaders' code",
            "def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096",
            "def anon(): return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if 'RssAnon' in l)",
            "before, anon_before = rss(), anon()",
            "m = load(sys.argv[2]); jax.block_until_ready(m.params); after, anon_after = rss(), anon()",
            "weights = sum(x.nbytes for x in jax.tree.leaves(m.params))",
            "out = {'rss_added': after - before, 'anon_added': anon_after - anon_before, 'weight_bytes': weights}",
            "print(json.dumps(out))",
        ]
    )
    tokenizer_code = "\n".join(
        [
            "import json, sys",
            "sys.path.insert(0, sys.argv[1])",
            "import jax, jax.numpy as jnp",
            "jnp.zeros(1).block_until_ready()",
            "import orbax.checkpoint, transformers.models.auto.tokenization_auto",
            "from transformers import AutoTokenizer",
            "from eejax.checkpoint import release_freed_memory",
            "from eejax.loading.hub import resolve",
            "def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096",
            "directory = resolve('smollm2-135m', sys.argv[2] == 'gguf')",
            "before = rss(); t = AutoTokenizer.from_pretrained(str(directory / 'tokenizer'))",
            "release_freed_memory(); print(json.dumps({'tokenizer_rss_added': rss() - before}))",
        ]
    )
    out = {}
    for source in (code, tokenizer_code):
        command = [sys.executable, "-c", source, str(ROOT), setting.partition(":")[0]]
        lines = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        out.update(json.loads(lines.strip().splitlines()[-1]))
    return out


def speed(model, prompts_by_batch: dict, new_tokens: int) -> dict:
    out = {}
    for b, prompts in prompts_by_batch.items():
        kw = dict(max_new_tokens=new_tokens, ignore_eos=True)
        eejax.generate(model, prompts, **kw)  # compile
        runs = [eejax.generate(model, prompts, **kw).stats for _ in range(2)]
        out[f"decode_b{b}"] = max(r.decode_tokens_per_s for r in runs)
        if b == 1:
            out["prefill"] = len(prompts[0]) / min(r.prefill_s for r in runs)
    return out


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--ppl-chunks", type=int, default=24, help="512-token WikiText-2 chunks (0: no quality)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--name", default="quantized")
    args = parser.parse_args(argv)
    settings = ["float32"] + [s for s in args.settings if s != "float32"]  # the reference first

    bw = read_bandwidth_gbs()
    rows, reference = {}, None
    for setting in settings:
        model = load(setting)
        row = {"bytes_per_token": param_bytes_per_token(model.params, model.config), **rss_added(setting)}
        if args.ppl_chunks:
            chunks = wikitext_chunks(model.tokenizer, args.ppl_chunks)
            q, kept = quality(model, chunks, reference)
            reference = reference or kept
            row.update(q)
        prompts = {b: cnndm_prompts(model.tokenizer, b, 256) for b in args.batches}
        row.update(speed(model, prompts, args.new_tokens))
        row["bound_b1"] = bw * 1e9 / row["bytes_per_token"]
        rows[setting] = row
        del model
        base = rows["float32"]
        line = [
            f"{setting:10s} {row['bytes_per_token'] / 1e6:5.0f} MB/token, RSS +{row['rss_added'] / 1e6:.0f} MB "
            f"({row['rss_added'] / row['weight_bytes']:.2f}x the weights; anonymous "
            f"+{row['anon_added'] / 1e6:.0f} MB, {row['anon_added'] / row['weight_bytes']:.2f}x; "
            f"the tokenizer alone +{row['tokenizer_rss_added'] / 1e6:.0f} MB)"
        ]
        if "perplexity" in row:
            line.append(f"ppl {row['perplexity']:.3f} ({row['perplexity'] / base['perplexity'] - 1:+.2%})")
            if "greedy_agreement" in row:
                line.append(f"greedy = float32 at {row['greedy_agreement']:.2%} of clear positions")
        for b in args.batches:
            line.append(f"b{b} {row[f'decode_b{b}']:.1f} tok/s ({row[f'decode_b{b}'] / base[f'decode_b{b}']:.2f}x)")
        if 1 in args.batches:  # batch 1's bandwidth bound and one prompt's prefill
            line.append(f"{row['decode_b1'] / row['bound_b1']:.0%} of the b1 bound")
            line.append(f"prefill {row['prefill']:.0f} tok/s ({row['prefill'] / base['prefill']:.2f}x)")
        print(" | ".join(line), flush=True)
    write_result(args.name, {"args": vars(args), "read_bandwidth_gbs": bw, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
