"""Early exit on SmolLM2-135M (fp32): speed against its ideal, layers per token and ROUGE-L.

CNN/DM articles (first --prompt-tokens tokens, then "\\n\\nSummary:"), --new-tokens greedy tokens
per row with EOS ignored, batch 1 and 8, one process. For each configuration: decode speed
(prefill excluded) vs eejax's own full depth timed just before and after it (this machine's
speed drifts by 10-40% over minutes; the median over --repeats is kept), layers per token,
the ideal speed-up of the cost model (weights read per token: layers run, KV-fill
projections, exit heads full or reduced, classifiers; `eejax.decode.cost`) and the machinery
efficiency = measured / ideal.
Quality as in Table 1 of the early-exit inference paper: ROUGE-L (rouge-score) of the early-exit
text against eejax's full-depth text ("to full") and against the reference highlights ("to
label"). The reduced exit head (8192 tokens) is counted as `eejax exit-vocab` does, over the
model's continuations of other CNN/DM articles. Writes benchmarks/out/early_exit.{json,md,png}.

    pip install -e ".[bench]"; python benchmarks/early_exit.py [--batches 1 8] [--prompts 8]

SmolLM2 was not trained for early exit, so its exits are poor predictors of its last layer:
this measures the machinery and the honest quality/speed curve, not a trained early-exit model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eejax  # noqa: E402
from benchmarks.common import ROOT, Paired, paired_runs, with_exit_vocab, write_result  # noqa: E402
from eejax import ExitConfig  # noqa: E402
from eejax.bench.run import rouge_l  # noqa: E402  (mean ROUGE-L F1, stemmed)
from eejax.cli.parsing import OneLineErrorParser

# Each configuration runs with the reduced exit head (8192 tokens) unless it says "full head".
# softmax:0.9 after every layer with the full head is what this issue started from; then the same
# measure with the reduced head, with check layers where an exit can pay, and the other measures.
CHECKS = (8, 12, 16, 20, 24)
SWEEP = [
    ExitConfig("static", exit_layer=15),
    ExitConfig("static", exit_layer=22),
    ExitConfig("softmax", threshold=0.9, head="full"),
    ExitConfig("softmax", threshold=0.9),
    ExitConfig("softmax", threshold=0.9, exit_layers=CHECKS),
    ExitConfig("softmax", threshold=0.5, exit_layers=CHECKS),
    ExitConfig("softmax", threshold=0.9, exit_layers=(15, 22)),
    ExitConfig("state", threshold=0.97, exit_layers=CHECKS),
    ExitConfig("classifier", threshold=0.4, exit_layers=(15,)),  # untrained: P = 0.5, exits at 15
]


def summary_prompts(tokenizer, n: int, prompt_tokens: int) -> tuple[list[list[int]], list[str]]:
    """(prompt ids, reference highlights) of the first n CNN/DM articles."""
    with (ROOT / "data" / "cnndm_test_dev100.jsonl").open() as f:
        rows = [json.loads(line) for _, line in zip(range(n), f)]
    suffix = tokenizer("\n\nSummary:")["input_ids"]
    prompts = [tokenizer(r["article"])["input_ids"][: prompt_tokens - len(suffix)] + suffix for r in rows]
    return prompts, [r["highlights"] for r in rows]


def decode_runs(model, prompts, batch, configs, new_tokens, repeats) -> Paired:
    """Decode speed (prefill excluded) of each config against full depth, paired (`paired_runs`)."""

    def run(c):
        return eejax.generate(model, prompts, max_new_tokens=new_tokens, ignore_eos=True, batch_size=batch, exit=c)

    return paired_runs(run, configs, repeats)


def label(c: ExitConfig) -> str:
    """`softmax:0.9 @8,12,16` (check layers when given), `[full head]` when not reduced."""
    text = c.spec
    if c.exit_layers:
        text += " @" + ",".join(map(str, c.exit_layers))
    if c.measure == "softmax" and c.head == "full":
        text += " [full head]"
    return text


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--batches", type=int, nargs="+", action="extend", default=None, help="batch sizes (default 1 8)"
    )
    parser.add_argument("--prompts", type=int, default=8, help="CNN/DM articles (each batch size runs all of them)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=160)
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed runs per configuration, each between two full-depth runs (median kept)",
    )
    parser.add_argument("--vocab-size", type=int, default=8192, help="tokens of the reduced exit head")
    parser.add_argument(
        "--layer-buffers",
        choices=("stacked", "split"),
        default="stacked",
        help="how decode steps read the layer weights (see eejax.Model.run_params)",
    )
    parser.add_argument("--name", default="early_exit", help="the result files: benchmarks/out/NAME.{json,md,png}")
    args = parser.parse_args(argv)
    batches = args.batches or [1, 8]

    # Untrained classifiers (for the check cost only) and the reduced exit head.
    float_model = eejax.load("smollm2-135m", layer_buffers=args.layer_buffers, quantization=None)
    model = with_exit_vocab(eejax.init_exits(float_model), args.vocab_size)
    L = model.config.num_layers
    prompts, highlights = summary_prompts(model.tokenizer, args.prompts, args.prompt_tokens)
    results = {
        "batches": {},
        "new_tokens": args.new_tokens,
        "prompt_tokens": args.prompt_tokens,
        "prompts": args.prompts,
        "num_layers": L,
        "vocab_size": args.vocab_size,
        "layer_buffers": args.layer_buffers,
    }
    for b in batches:
        print(f"\n=== batch {b}: {args.prompts} articles, {args.new_tokens} new tokens ===", flush=True)
        paired = decode_runs(model, prompts, b, SWEEP, args.new_tokens, args.repeats)
        full, base = paired.peer, paired.peer_speed
        print(f"eejax full depth: {base:.1f} decode tok/s", flush=True)
        rows = []
        for cfg, r, speedup, tps in zip(SWEEP, paired.results, paired.speedups, paired.speeds):
            s = r.stats
            row = dict(
                config=label(cfg),
                measure=cfg.measure,
                decode_tokens_per_s=tps,
                speedup=speedup,
                ideal_speedup=s["ideal_speedup"],
                efficiency=speedup / s["ideal_speedup"],
                layers=s["mean_layers_per_token"],
                kv_fill_layers=s["kv_fill_layers_per_token"],
                exit_rate=sum(e < L for t in r.exit_layers for e in t[1:]) / sum(len(t) - 1 for t in r.tokens),
                rouge_l_to_full=rouge_l(r.texts, full.texts),
                rouge_l_to_label=rouge_l(r.texts, highlights),
            )
            rows.append(row)
            print(
                f"  {row['config']:36s} {row['decode_tokens_per_s']:7.1f} tok/s  x{speedup:.2f} full "
                f"(ideal x{row['ideal_speedup']:.2f}, efficiency {row['efficiency']:.2f})  "
                f"layers/token {row['layers']:5.1f}  exit rate {row['exit_rate']:5.1%}  "
                f"ROUGE-L to full {row['rouge_l_to_full']:.3f}",
                flush=True,
            )
        results["batches"][b] = dict(
            full_decode_tokens_per_s=base, rows=rows, full_rouge_l_to_label=rouge_l(full.texts, highlights)
        )
    write_result(args.name, results)
    write_table(results, args.name)
    plot(results, args.name)
    return 0


def write_table(results: dict, name: str = "early_exit") -> None:
    lines = [
        f"SmolLM2-135M fp32, {results['prompts']} CNN/DM articles ({results['prompt_tokens']}-token prompts), "
        f"{results['new_tokens']} new tokens, reduced exit head of {results['vocab_size']} tokens unless "
        f"marked, {time.strftime('%Y-%m-%d')}. Speeds are decode tokens/s (prefill excluded, "
        "medians); 'vs full' is the median ratio to eejax's full depth timed just before and after "
        "each run; the ideal speed-up is the cost model's (weights read per token, eejax/decode/cost.py); "
        "efficiency = measured / ideal.",
        "",
    ]
    for b, r in results["batches"].items():
        lines += [
            f"### batch {b}",
            "",
            f"Full depth {r['full_decode_tokens_per_s']:.1f} decode tok/s.",
            "",
            "| exit | tok/s | vs full | ideal | efficiency | layers/token | KV-fill layers | exit rate | "
            "ROUGE-L to full | to label |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in r["rows"]:
            lines.append(
                f"| {row['config']} | {row['decode_tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
                f"{row['ideal_speedup']:.2f}x | {row['efficiency']:.2f} | {row['layers']:.1f} | "
                f"{row['kv_fill_layers']:.1f} | {row['exit_rate']:.1%} | {row['rouge_l_to_full']:.3f} | "
                f"{row['rouge_l_to_label']:.3f} |"
            )
        lines.append("")
    path = ROOT / "benchmarks" / "out" / f"{name}.md"
    path.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {path}")


def plot(results: dict, name: str = "early_exit") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["batches"]), figsize=(6 * len(results["batches"]), 4.5), squeeze=False)
    markers = {"softmax": "o", "state": "s", "static": "^"}
    for ax, (b, r) in zip(axes[0], results["batches"].items()):
        for measure, marker in markers.items():
            pts = sorted(
                (row for row in r["rows"] if row.get("measure") == measure), key=lambda p: p["rouge_l_to_full"]
            )
            ax.plot([p["rouge_l_to_full"] for p in pts], [p["speedup"] for p in pts], marker=marker, label=measure)
            for p in pts:
                ax.annotate(p["config"], (p["rouge_l_to_full"], p["speedup"]), fontsize=6)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(
            title=f"SmolLM2-135M, batch {b}",
            xlabel="ROUGE-L to full depth",
            ylabel="decode speed-up vs eejax full depth",
            xlim=(0, 1.02),
        )
        ax.legend()
    fig.tight_layout()
    path = ROOT / "benchmarks" / "out" / f"{name}.png"
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
