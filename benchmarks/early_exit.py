"""Early exit on SmolLM2-135M (fp32): speed, layers per token and ROUGE-L of each measure.

CNN/DM articles (first --prompt-tokens tokens, then "\\n\\nSummary:"), --new-tokens greedy tokens
per row with EOS ignored, batch 1 and 8. Measured in one run: HF transformers `generate`, eejax
full depth, eejax's exit loop that never exits (its overhead), the cost of each confidence check
(a threshold that can never be met, decay off), and every measure at several thresholds.
Quality as in Table 1 of the early-exit inference paper: ROUGE-L (rouge-score) of the early-exit
text against eejax's full-depth text ("to full") and against the reference highlights ("to
label"). The loop overhead and the check costs are decode-step speeds (prefill excluded), interleaved
best-of-N runs, since this machine's timings move by 10-15% between runs. Writes
benchmarks/out/early_exit.{json,md,png}.

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
from benchmarks.common import ROOT, fmt_ratio, hf_generate_tokens_per_s, load_hf_smollm2, write_result  # noqa: E402
from eejax import ExitConfig  # noqa: E402
from eejax.cli_parsing import OneLineErrorParser

# The paper's thresholds (softmax 0.85, state 0.96) at any layer; then, since SmolLM2's early
# layers look confident (softmax margin ~0.4, consecutive-state cosine ~0.97 from layer 3 on)
# while agreeing with the last layer on < 10% of tokens, the same measures from layer 21 on.
SWEEP = [
    ExitConfig("softmax", threshold=0.85),
    ExitConfig("softmax", threshold=0.9, min_exit_layer=21, every=3),
    ExitConfig("softmax", threshold=0.99, min_exit_layer=21, every=3),
    ExitConfig("state", threshold=0.96),
    ExitConfig("state", threshold=0.97, min_exit_layer=21),
    ExitConfig("state", threshold=0.99, min_exit_layer=21),
    *[ExitConfig("static", exit_layer=e) for e in (29, 27, 25, 20, 15)],
]
# Thresholds that can never be met (margin, cosine and probability are <= 1): the loop runs to
# full depth, evaluating the measure after every layer.
CHECK_COST = [ExitConfig(m, threshold=1.0, decay=None) for m in ("softmax", "state", "classifier")]


def summary_prompts(tokenizer, n: int, prompt_tokens: int) -> tuple[list[list[int]], list[str]]:
    """(prompt ids, reference highlights) of the first n CNN/DM articles."""
    with (ROOT / "data" / "cnndm_test_dev100.jsonl").open() as f:
        rows = [json.loads(line) for _, line in zip(range(n), f)]
    suffix = tokenizer("\n\nSummary:")["input_ids"]
    prompts = [tokenizer(r["article"])["input_ids"][: prompt_tokens - len(suffix)] + suffix for r in rows]
    return prompts, [r["highlights"] for r in rows]


def rouge_l(predictions: list[str], references: list[str]) -> float:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return sum(scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references)) / len(references)


def timed(model, prompts, batch, exit_config, new_tokens, repeats=2):
    """The fastest of `repeats` runs after a warm-up (compiling) run on the first batch."""
    kw = dict(max_new_tokens=new_tokens, ignore_eos=True, batch_size=batch, exit=exit_config)
    eejax.generate(model, prompts[:batch], **kw)
    return max((eejax.generate(model, prompts, **kw) for _ in range(repeats)), key=lambda r: r.stats["tokens_per_s"])


def decode_speeds(model, prompts, configs, new_tokens, repeats) -> list[float]:
    """Best decode-only tokens/s (prefill excluded) of each config on one batch; the runs are
    interleaved so that this machine's noise hits every config alike."""
    kws = [dict(max_new_tokens=new_tokens, ignore_eos=True, exit=c) for c in configs]
    for kw in kws:
        eejax.generate(model, prompts, **kw)
    best = [0.0] * len(configs)
    for _ in range(repeats):
        for i, kw in enumerate(kws):
            best[i] = max(best[i], eejax.generate(model, prompts, **kw).stats["decode_tokens_per_s"])
    return best


def short_label(c: ExitConfig) -> str:
    """`0.9 ≥21/3`: the threshold (or static layer), min exit layer and stride when set."""
    text = c.spec.partition(":")[2]
    if c.min_exit_layer > 1:
        text += f" ≥{c.min_exit_layer}" + (f"/{c.every}" if c.every > 1 else "")
    return text


def label(c: ExitConfig) -> str:
    decay = "" if c.measure == "static" or c.decay is None else f" τ={c.decay:g}"
    return f"{c.measure}:{short_label(c)}{decay}"


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", action="extend", default=[1, 8])
    parser.add_argument("--prompts", type=int, default=8, help="CNN/DM articles (each batch size runs all of them)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5,
                        help="interleaved timed runs for the exit-loop overhead and check costs (best kept)")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args(argv)

    model = eejax.init_exits(eejax.load("smollm2-135m"))  # untrained classifiers: for the check cost only
    L = model.config.num_layers
    hf = None if args.skip_hf else load_hf_smollm2()
    prompts, highlights = summary_prompts(model.tokenizer, args.prompts, args.prompt_tokens)
    results = {"batches": {}, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
               "prompts": args.prompts, "num_layers": L}
    for b in args.batches:
        print(f"\n=== batch {b}: {args.prompts} articles, {args.new_tokens} new tokens ===", flush=True)
        rows = []
        hf_tps = float("nan")
        if hf is not None:
            hf_tps = max(hf_generate_tokens_per_s(hf, prompts[i:i + b], args.new_tokens, model.config.pad_token_id or 0)
                         for i in range(0, min(len(prompts), 2 * b), b))
        full = timed(model, prompts, b, None, args.new_tokens, repeats=3)
        base = full.stats["tokens_per_s"]
        print(f"HF {hf_tps:.1f} tok/s | eejax full depth {base:.1f} tok/s ({fmt_ratio(base, hf_tps)} HF)", flush=True)
        # Decode steps only, on one batch: plain full depth, the exit loop that never exits, and
        # the loop evaluating each measure after every layer.
        plain, loop, *checked = decode_speeds(
            model, prompts[:b], [None, ExitConfig("none"), *CHECK_COST], args.new_tokens, args.repeats
        )
        overhead = plain / loop - 1
        print(f"  decode steps: full depth {plain:.1f} tok/s, exit loop at full depth {loop:.1f} tok/s "
              f"(overhead {overhead:+.1%})", flush=True)
        for cfg, speed in zip(CHECK_COST, checked):
            checks = L - 1  # after every layer but the last
            per_check = (1 / speed - 1 / plain) / checks / (1 / plain / L)
            rows.append(dict(config=f"{cfg.measure} check cost", tokens_per_s=speed, speedup=speed / plain,
                             layers=float(L), check_cost_in_layers=per_check))
            print(f"  {cfg.measure:10s} checked after each of {checks} layers: {speed:.1f} tok/s; "
                  f"one check costs {per_check:.2f} layers' time", flush=True)
        for cfg in SWEEP:
            r = timed(model, prompts, b, cfg, args.new_tokens)
            s = r.stats
            row = dict(config=label(cfg), short=short_label(cfg), measure=cfg.measure, tokens_per_s=s["tokens_per_s"],
                       speedup=s["tokens_per_s"] / base, vs_hf=s["tokens_per_s"] / hf_tps,
                       decode_speedup=s["decode_tokens_per_s"] / full.stats["decode_tokens_per_s"],
                       layers=s["mean_layers_per_token"], kv_fill_layers=s["kv_fill_layers_per_token"],
                       exit_rate=sum(e < L for t in r.exit_layers for e in t) / s["generated_tokens"],
                       rouge_l_to_full=rouge_l(r.texts, full.texts), rouge_l_to_label=rouge_l(r.texts, highlights))
            rows.append(row)
            print(f"  {row['config']:28s} {row['tokens_per_s']:7.1f} tok/s  x{row['speedup']:.2f} full "
                  f"(decode x{row['decode_speedup']:.2f})  "
                  f"layers/token {row['layers']:5.1f} (+{row['kv_fill_layers']:4.1f} KV fill)  "
                  f"exit rate {row['exit_rate']:5.1%}  ROUGE-L to full {row['rouge_l_to_full']:.3f} "
                  f"to label {row['rouge_l_to_label']:.3f}", flush=True)
        results["batches"][b] = dict(
            hf_tokens_per_s=hf_tps, full_tokens_per_s=base, full_vs_hf=base / hf_tps,
            decode_tokens_per_s=plain, exit_loop_decode_tokens_per_s=loop, exit_loop_overhead=overhead,
            full_rouge_l_to_label=rouge_l(full.texts, highlights), rows=rows,
        )
    write_result("early_exit", results)
    write_table(results)
    plot(results)
    return 0


def write_table(results: dict) -> None:
    lines = [f"SmolLM2-135M fp32, {results['prompts']} CNN/DM articles ({results['prompt_tokens']}-token prompts), "
             f"{results['new_tokens']} new tokens, {time.strftime('%Y-%m-%d')}", ""]
    for b, r in results["batches"].items():
        lines += [f"### batch {b}", "",
                  f"HF {r['hf_tokens_per_s']:.1f} tok/s; eejax full depth {r['full_tokens_per_s']:.1f} tok/s "
                  f"({r['full_vs_hf']:.2f}x HF), ROUGE-L to label {r['full_rouge_l_to_label']:.3f}. Decode steps "
                  f"only: full depth {r['decode_tokens_per_s']:.1f} tok/s, the exit loop at full depth "
                  f"{r['exit_loop_decode_tokens_per_s']:.1f} tok/s (overhead {r['exit_loop_overhead']:+.1%}).", "",
                  "| exit | tok/s | vs full | decode vs full | vs HF | layers/token | KV-fill layers | exit rate | ROUGE-L to full | to label |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            if "rouge_l_to_full" not in row:
                lines.append(f"| {row['config']} (decode only) | {row['tokens_per_s']:.1f} | | {row['speedup']:.2f}x | | "
                             f"{row['layers']:.0f} | | | one check = {row['check_cost_in_layers']:.2f} layers | |")
                continue
            lines.append(f"| {row['config']} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
                         f"{row['decode_speedup']:.2f}x | {row['vs_hf']:.2f}x | "
                         f"{row['layers']:.1f} | {row['kv_fill_layers']:.1f} | {row['exit_rate']:.1%} | "
                         f"{row['rouge_l_to_full']:.3f} | {row['rouge_l_to_label']:.3f} |")
        lines.append("")
    path = ROOT / "benchmarks" / "out" / "early_exit.md"
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["batches"]), figsize=(6 * len(results["batches"]), 4.5), squeeze=False)
    markers = {"softmax": "o", "state": "s", "static": "^"}
    for ax, (b, r) in zip(axes[0], results["batches"].items()):
        for measure, marker in markers.items():
            pts = sorted((row for row in r["rows"] if row.get("measure") == measure), key=lambda p: p["rouge_l_to_full"])
            ax.plot([p["rouge_l_to_full"] for p in pts], [p["decode_speedup"] for p in pts], marker=marker, label=measure)
            for p in pts:
                ax.annotate(p["short"], (p["rouge_l_to_full"], p["decode_speedup"]), fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(title=f"SmolLM2-135M, batch {b}", xlabel="ROUGE-L to full depth", ylabel="decode speed-up vs eejax full depth",
               xlim=(0, 1.02))
        ax.legend()
    fig.tight_layout()
    path = ROOT / "benchmarks" / "out" / "early_exit.png"
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
