"""A mixed-length batch job on SmolLM2-135M (fp32): `generate(prompts, batch_size=B)` (continuous
batching: a row that ends frees its slot for the next) against running the same prompts in
chunks of B, one `generate` call per chunk (a chunk runs until its last row ends), measured in
the same run. Prompts are CNN/DM articles cut to random lengths in [--min-tokens, --max-tokens];
EOS ends a row unless --ignore-eos. Prints tokens/s of each, the ratio, and the engine steps.

    python benchmarks/offline_batch.py [--prompts 24] [--batch-size 8] [--new-tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import eejax  # noqa: E402
from benchmarks.common import cnndm_prompts, write_result  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each, alternating (median kept)")
    parser.add_argument("--ignore-eos", action="store_true", help="every row generates --new-tokens")
    args = parser.parse_args(argv)

    model = eejax.load("smollm2-135m")
    lengths = np.random.default_rng(0).integers(args.min_tokens, args.max_tokens + 1, args.prompts)
    prompts = [p[:n] for p, n in zip(cnndm_prompts(model.tokenizer, args.prompts, args.max_tokens), lengths)]
    kw = dict(max_new_tokens=args.new_tokens, ignore_eos=args.ignore_eos)
    b = args.batch_size

    def continuous():
        res = eejax.generate(model, prompts, batch_size=b, **kw)
        return res.tokens, res.stats.run_s, res.stats.engine_steps

    def chunked():
        tokens, seconds, steps = [], 0.0, 0
        for i in range(0, len(prompts), b):
            res = eejax.generate(model, prompts[i : i + b], **kw)
            tokens += res.tokens
            seconds += res.stats.run_s  # compilation excluded, as in `continuous`
            steps += res.stats.engine_steps
        return tokens, seconds, steps

    runs = {"continuous": continuous, "chunked": chunked}
    for run in runs.values():
        run()  # compile
    speeds, steps, outputs = {name: [] for name in runs}, {}, {}
    for _ in range(args.repeats):
        for name, run in runs.items():
            outputs[name], seconds, steps[name] = run()
            speeds[name].append(round(sum(map(len, outputs[name])) / seconds, 2))
    want = outputs["chunked"]
    assert outputs["continuous"] == want, "continuous batching changed the greedy tokens"
    median = {name: float(np.median(v)) for name, v in speeds.items()}
    ratio = median["continuous"] / median["chunked"]
    ended_early = sum(len(t) < args.new_tokens for t in want)
    print(
        f"{args.prompts} prompts of {lengths.min()}-{lengths.max()} tokens, batch {b}, {args.new_tokens} new "
        f"tokens ({ended_early} rows ended early at EOS):"
    )
    for name in runs:
        print(f"  {name:10s} {median[name]:6.1f} tok/s ({steps[name]} engine steps) runs {speeds[name]}")
    print(f"  continuous / chunked: {ratio:.2f}x")
    write_result(
        "offline_batch",
        {
            "args": vars(args),
            "tokens_per_s": median,
            "runs": speeds,
            "ratio": ratio,
            "engine_steps": steps,
            "rows_ended_early": ended_early,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
