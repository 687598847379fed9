"""Speculation with a trained draft head (EAGLE, `spec="draft:d"`, `spec="auto"`) on SmolLM2-135M (fp32).

On each evaluation set of `benchmarks/eval_sets.py` (--sets; default cnndm: CNN/DM evaluation
articles, rows 0..19 of data/cnndm_test_dev100.jsonl, never trained on, the first --prompt-tokens
tokens ending in "\\n\\nSummary:"; mtbench, pydoc, code, chat), --new-tokens greedy tokens per
row, EOS ignored, at each batch size. In one run, each configuration is timed between two runs of eejax's
own full depth (same layer-buffer setting; `benchmarks.common.paired_runs`), and at batch 1 HF
transformers' full-depth `generate` is timed too. Every configuration's tokens are checked
against full depth. Reported: τ (tokens per round, the verified token included), acceptance,
decode tokens/s (prefill excluded), speed-up over eejax full depth and over HF, the cost model's
ideal speed-up at the measured τ (weights read per token, `eejax.decode.cost`), the machinery
efficiency = measured / ideal, and layers of the model run per token. Writes
benchmarks/out/<name>.{json,md}.

    python benchmarks/draft_head.py [--model smollm2-135m-eagle] [--batches 1 8] [--specs draft:4 auto ...] \
        [--sets cnndm mtbench pydoc code chat] \
        [--quantization gguf|int8] [--activations float32|int16|int8] [--prompt-activations int16]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eejax  # noqa: E402
from benchmarks.common import (  # noqa: E402
    OUT,
    add_quantization_args,
    hf_generate_tokens_per_s,
    load_hf_smollm2,
    load_model,
    paired_runs,
    write_result,
)
from benchmarks.eval_sets import SETS, prompts  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.options import resolve_spec  # noqa: E402

EVAL_ROWS = 20


def warm_every_round(run, specs) -> None:
    """An adaptive run compiles each d's round program the first time its policy picks that d,
    inside whichever run that happens in (seconds each on this CPU, against ~2 s for a whole
    run): so every d it may pick runs once first (a fixed d's round is the same program), and
    the timed runs measure decoding, as the first run of every setting does for the others."""
    for spec in specs:
        config = resolve_spec(spec, has_draft_head=True)
        if config is not None and config.adaptive:
            for d in range(1, config.max_speculations + 1):
                run(dataclasses.replace(config, num_speculations=d, adaptive=False))


def main() -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-eagle", help="an eejax model with a draft head")
    parser.add_argument(
        "--batches", type=int, nargs="+", action="extend", default=None, help="batch sizes (default 1 8)"
    )
    parser.add_argument(
        "--specs",
        nargs="+",
        action="extend",
        default=None,
        help="speculation settings (default draft:2 draft:3 draft:4 draft:4:adaptive)",
    )
    parser.add_argument("--sets", nargs="+", action="extend", choices=SETS, default=None, help="default cnndm")
    parser.add_argument("--prompts", type=int, default=4, help="prompts at batch 1 (batch b runs b prompts at once)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--layer-buffers",
        choices=("stacked", "split"),
        default="split",
        help="how every eejax run reads the layer weights (split: faster on a CPU at batch 1)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each configuration (median kept)")
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers' full depth")
    parser.add_argument("--name", default="draft_head", help="output name under benchmarks/out/")
    add_quantization_args(parser)
    args = parser.parse_args()
    batches = args.batches or [1, 8]
    specs = args.specs or ["draft:2", "draft:3", "draft:4", "draft:4:adaptive"]
    if max(args.prompts, *batches) > EVAL_ROWS:
        parser.error(f"at most {EVAL_ROWS} prompts: only rows 0..{EVAL_ROWS - 1} are held out of training")

    model = load_model(args, args.model)
    hf = None if args.no_hf else load_hf_smollm2()
    rows, lines = [], []
    for name, b in [(name, b) for name in args.sets or ["cnndm"] for b in batches]:
        asked = prompts(model.tokenizer, name, max(b, args.prompts if b == 1 else b), args.prompt_tokens)

        def run(spec, asked=asked, b=b):
            return eejax.generate(
                model, asked, max_new_tokens=args.new_tokens, ignore_eos=True, spec=spec, batch_size=b
            )

        warm_every_round(run, specs)
        paired = paired_runs(run, specs, args.repeats)
        hf_speed = None
        if hf is not None and b == 1:
            hf_speed = sum(hf_generate_tokens_per_s(hf, [p], args.new_tokens, 0) for p in asked) / len(asked)
        full = paired.peer
        for spec, res, speedup, speed in zip(specs, paired.results, paired.speedups, paired.speeds):
            assert res.tokens == full.tokens, f"{spec} at batch {b} parted from full depth"
            s = res.stats
            row = {
                "set": name,
                "batch": b,
                "spec": spec,
                "tau": s["tokens_per_round"],
                "acceptance": s["acceptance_rate"],
                "tokens_per_s": speed,
                "full_depth_tokens_per_s": paired.peer_speed,
                "speedup": speedup,
                "hf_tokens_per_s": hf_speed,
                "speedup_vs_hf": speed / hf_speed if hf_speed else None,
                "ideal_speedup": s["ideal_speedup"],
                "efficiency": speedup / s["ideal_speedup"],
                "layers_per_token": s["mean_layers_per_token"],
                "plain_step_rate": s["plain_step_rate"],
                "stats": s,
            }
            rows.append(row)
            vs_hf = f"{row['speedup_vs_hf']:.2f}x" if hf_speed else "-"
            lines.append(
                f"| {name} | {b} | {spec} | {row['tau']:.2f} | {row['acceptance']:.2f} | {speed:.1f} | "
                f"{paired.peer_speed:.1f} | {speedup:.2f}x | {vs_hf} | {row['ideal_speedup']:.2f}x | "
                f"{row['efficiency']:.2f} | {row['layers_per_token']:.1f} |"
            )
            print(lines[-1], flush=True)
    header = (
        "| set | batch | spec | τ | acceptance | tok/s | full depth tok/s | vs full depth | vs HF | ideal | "
        "efficiency | layers/token |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    table = "\n".join([header, *lines])
    write_result(args.name, {"args": vars(args), "rows": rows})
    (OUT / f"{args.name}.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
