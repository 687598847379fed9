"""Is speculation lossless on SmolLM2-135M's GGUF blocks with integer activations? Token for
token against the same model's full depth, on held-out prompts.

For each --activations mode, the model with a draft head (`smollm2-135m-eagle`, its GGUF blocks)
decodes --new-tokens greedy tokens (EOS ignored) for --prompts prompts of each --sets set
(`benchmarks/eval_sets.py`: cnndm summaries, mtbench / chat questions), at batch 1 and at
--batch, with full depth and with each --specs setting. Every run's tokens are compared with
full depth at batch 1: a row is identical or parts from it at some token. Writes
benchmarks/out/<name>.json.

    python benchmarks/lossless.py [--activations float32 int16 int8] [--specs draft:2 draft:4:lookup 20:2 ...] \
        [--sets cnndm mtbench] [--prompts 8] [--new-tokens 64] [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eejax  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from benchmarks.eval_sets import prompts  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.quantized import ACTIVATIONS  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (or their shorter length), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_tokens(model, prompts, spec, size: int, new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens (EOS ignored), `size` prompts a `generate` call."""
    out = []
    for i in range(0, len(prompts), size):
        batch = prompts[i : i + size]
        out += eejax.generate(model, batch, max_new_tokens=new_tokens, ignore_eos=True, spec=spec).tokens
    return out


def main() -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-eagle", help="a model with a draft head")
    parser.add_argument("--activations", nargs="+", choices=ACTIVATIONS, default=list(ACTIVATIONS))
    parser.add_argument("--specs", nargs="+", default=["draft:2", "draft:4:lookup", "20:2"])
    parser.add_argument("--sets", nargs="+", default=["cnndm", "mtbench"])
    parser.add_argument("--prompts", type=int, default=8, help="prompts of each set")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="the batch size besides 1 (0: batch 1 only)")
    parser.add_argument("--name", default="lossless")
    args = parser.parse_args()

    rows = []
    for activations in args.activations:
        model = eejax.load(args.model, quantization="gguf", activations=activations)
        batch = [p for s in args.sets for p in prompts(model.tokenizer, s, args.prompts)]
        labels = [f"{s}[{i}]" for s in args.sets for i in range(args.prompts)]
        reference = greedy_tokens(model, batch, None, 1, args.new_tokens)
        for spec in [None, *args.specs]:
            for size in sorted({1, args.batch} - {0}):
                if spec is None and size == 1:
                    continue
                start = time.perf_counter()
                got = greedy_tokens(model, batch, spec, size, args.new_tokens)
                parted = {label: first_difference(g, r) for label, g, r in zip(labels, got, reference)}
                parted = {k: v for k, v in parted.items() if v is not None}
                seconds = round(time.perf_counter() - start, 1)
                row = dict(activations=activations, spec=spec or "full", batch=size, prompts=len(batch),
                           identical=len(batch) - len(parted), parted=parted, seconds=seconds)  # fmt: skip
                rows.append(row)
                print(f"{activations:8s} {row['spec']:16s} batch {size}: {row['identical']}/{len(batch)} identical"
                      + (f", parted at {parted}" if parted else ""), flush=True)  # fmt: skip
    path = write_result(args.name, dict(args=vars(args), rows=rows))
    print(f"wrote {path}")
    return 0 if all(r["identical"] == r["prompts"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
