"""What sampling costs per decoded token: `generate` greedy, at a temperature (no filter: no
sort), and with top-k / top-p (a per-row sort of the vocabulary), the same prompts in one process,
best of --repeats; ratios against greedy measured in the same run. Sampling options are traced
per-row values (`RowSampling`); the sampler (greedy / temperature / filtered) is static.

    python benchmarks/sampling.py [--model smollm2-135m] [--batch 8] [--prompt-tokens 160] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eejax  # noqa: E402
from benchmarks.common import cnndm_prompts, fmt_ratio, write_result  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402

SETTINGS = {
    "greedy": {},
    "temperature 0.7": dict(temperature=0.7),
    "temperature 0.7, top-k 50, top-p 0.9": dict(temperature=0.7, top_k=50, top_p=0.9),
}


def main() -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=160)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    model = eejax.load(args.model, quantization=None)
    prompts = cnndm_prompts(model.tokenizer, args.batch, args.prompt_tokens)
    results = {}
    for name, options in SETTINGS.items():

        def run(options=options):
            return eejax.generate(model, prompts, max_new_tokens=args.new_tokens, ignore_eos=True, seed=1, **options)

        run()  # compiled
        results[name] = max(run().stats["decode_tokens_per_s"] for _ in range(args.repeats))
        print(
            f"{name:<38} decode {results[name]:6.1f} tok/s ({fmt_ratio(results[name], results['greedy'])} of greedy)",
            flush=True,
        )
    write_result("sampling", {"batch": args.batch, "new_tokens": args.new_tokens, "decode_tokens_per_s": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
