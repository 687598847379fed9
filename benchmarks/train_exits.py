"""Exit adapters for SmolLM2-135M trained here, on CPU, then calibrated and measured.

The CNN/DM rows of data/ are split three ways: rows 0..7 are the evaluation prompts (the early-exit
and speculation benchmarks' prompts), rows 8..CAL_END-1 the calibration set, the rest the training
set. Training data: each training article cut to (--max-len - --continuation-tokens) tokens ending
in "\\n\\nSummary:", followed by SmolLM2's own greedy continuation (what decoding sees).

Stages (each reuses the previous one's output in benchmarks/out/):
  train      fit the adapters (time reported), loss curve PNG, save the model
  agreement  per exit, the share of evaluation tokens whose argmax equals the last layer's,
             untrained (the shared head alone) and trained
  calibrate  Learn then Test for the softmax measure (ROUGE-L-to-full consistency)
  speed      eejax full depth vs early exit at the calibrated and other thresholds (tokens/s,
             ROUGE-L to full) and self-speculation (identical output checked) at batch 1 and 8

    pip install -e ".[bench]"; python benchmarks/train_exits.py [--stages train agreement ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import eejax  # noqa: E402
from benchmarks.common import OUT, paired_runs, write_result  # noqa: E402
from benchmarks.early_exit import rouge_l, summary_prompts  # noqa: E402
from eejax import ExitConfig, SpecConfig  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser

EVAL_ROWS = 8
CAL_END = 50
STAGES = ("train", "agreement", "calibrate", "speed")


def article_prompts(tokenizer, rows: range, prompt_tokens: int) -> list[list[int]]:
    prompts, _ = summary_prompts(tokenizer, rows.stop, prompt_tokens)
    return prompts[rows.start :]


def stage_train(args, base) -> dict:
    from eejax.train.loop import fit_exit_adapters
    from eejax.train.plot import save_loss_plot

    prompts = article_prompts(base.tokenizer, range(CAL_END, 100), args.max_len - args.continuation_tokens)
    t0 = time.perf_counter()
    model, losses = fit_exit_adapters(
        base,
        prompts,
        adapter_rank=args.rank,
        continuation_tokens=args.continuation_tokens,
        max_len=args.max_len,
        batch_size=args.batch_size,
        steps=args.steps,
        learning_rate=args.lr,
        exit_layers=args.exit_layers,
        positions_per_row=args.positions_per_row,
        weights="calm",
        seed=0,
    )
    seconds = time.perf_counter() - t0
    eejax.save(
        model,
        OUT / "smollm2-exits",
        overwrite=True,
        metadata={"exit_training": {"exit_layers": args.exit_layers, "rank": args.rank, "steps": args.steps}},
    )
    save_loss_plot(losses, OUT / "train_exits_loss.png", title="SmolLM2-135M exit adapters: distillation loss")
    print(f"trained {args.steps} steps in {seconds:.0f} s; loss {losses[:10].mean():.3f} -> {losses[-10:].mean():.3f}")
    return {
        "train_s": seconds,
        "losses": losses.tolist(),
        "prompts": len(prompts),
        "steps": args.steps,
        "rank": args.rank,
        "exit_layers": args.exit_layers,
        "positions_per_row": args.positions_per_row,
        "batch_size": args.batch_size,
        "max_len": args.max_len,
        "learning_rate": args.lr,
    }


def eval_batches(model, prompt_tokens: int, new_tokens: int):
    from eejax.train.data import continued_sequences, sequence_batches

    prompts = article_prompts(model.tokenizer, range(0, EVAL_ROWS), prompt_tokens)
    return sequence_batches(continued_sequences(model, prompts, new_tokens, progress=False), 4, 10**6)


def stage_agreement(args, base, trained) -> dict:
    from eejax.train.exit_training import exit_agreement

    batches = eval_batches(base, args.prompt_tokens, args.new_tokens)
    untrained = {k: v for k, v in base.params.items() if k != "exits"}
    plain = eejax.Model(base.config, untrained, base.tokenizer)
    # Every position (article and continuation), and the generated continuations alone.
    before, after = exit_agreement(plain, batches), exit_agreement(trained, batches)
    gen_before = exit_agreement(plain, batches, start=args.prompt_tokens - 1)
    gen_after = exit_agreement(trained, batches, start=args.prompt_tokens - 1)
    print("exit layer | agreement with the last layer, all positions: untrained -> trained | generated: ...")
    for layer in args.exit_layers:
        i = layer - 1
        print(f"{layer:>10} | {before[i]:.3f} -> {after[i]:.3f} | {gen_before[i]:.3f} -> {gen_after[i]:.3f}")
    return {
        "before": before.tolist(),
        "after": after.tolist(),
        "generated_before": gen_before.tolist(),
        "generated_after": gen_after.tolist(),
    }


def exit_config(args, threshold: float) -> ExitConfig:
    return ExitConfig(
        "softmax",
        threshold=threshold,
        min_exit_layer=args.exit_layers[0],
        every=args.exit_layers[1] - args.exit_layers[0],
    )


def stage_calibrate(args, trained) -> dict:
    from eejax.train.calibrate import calibrate_exit_threshold

    prompts = article_prompts(trained.tokenizer, range(EVAL_ROWS, CAL_END), args.prompt_tokens)
    base = exit_config(args, 1.0)
    t0 = time.perf_counter()
    cal, layers = calibrate_exit_threshold(
        trained,
        prompts,
        measure="softmax",
        thresholds=args.thresholds,
        delta=args.delta,
        epsilon=args.epsilon,
        max_new_tokens=args.new_tokens,
        consistency="rouge",
        min_exit_layer=base.min_exit_layer,
        every=base.every,
        batch_size=1,
        progress=True,
    )
    print(f"calibration on {len(prompts)} prompts in {time.perf_counter() - t0:.0f} s")
    for t, r, pv in zip(cal.thresholds, cal.risks, cal.p_values):
        print(f"  λ={t:<5g} 1 - ROUGE-L to full {r:.3f}  p {pv:.3g}  layers/token {layers[t]:.2f}")
    print(cal.certificate())
    return {
        "threshold": cal.threshold,
        "thresholds": cal.thresholds,
        "risks": cal.risks,
        "p_values": cal.p_values,
        "layers_per_token": [layers[t] for t in cal.thresholds],
        "delta": cal.delta,
        "epsilon": cal.epsilon,
        "n": cal.n,
        "method": cal.method,
        "certificate": cal.certificate(),
    }


def stage_speed(args, base, trained, calibrated: float | None) -> dict:
    """Tokens/s (prefill included) of early exit and self-speculation, trained exits and not,
    against the trained model's full depth timed around each run (`paired_runs`)."""
    thresholds = sorted({*args.speed_thresholds, *([calibrated] if calibrated is not None else [])}, reverse=True)
    runs = [
        (
            f"early exit softmax:{t:g}" + (" (calibrated)" if t == calibrated else ""),
            trained,
            dict(exit=exit_config(args, t)),
        )
        for t in thresholds
    ]
    if calibrated is not None:
        runs.append(
            (f"early exit softmax:{calibrated:g}, untrained exits", base, dict(exit=exit_config(args, calibrated)))
        )
    runs += [(f"self-speculation {x}", trained, dict(spec=SpecConfig.parse(x))) for x in args.specs]
    runs += [
        (f"self-speculation {x}, untrained exits", base, dict(spec=SpecConfig.parse(x))) for x in args.untrained_specs
    ]
    out = {}
    for batch in args.batches:
        prompts = article_prompts(trained.tokenizer, range(0, max(batch, args.prompts_b1)), args.prompt_tokens)

        def run(i, prompts=prompts, batch=batch):
            model, kw = (trained, {}) if i is None else runs[i][1:]
            return eejax.generate(
                model, prompts, max_new_tokens=args.new_tokens, ignore_eos=True, batch_size=batch, **kw
            )

        paired = paired_runs(run, list(range(len(runs))), args.repeats, speed=lambda r: r.stats["tokens_per_s"])
        full = paired.peer
        rows = [
            {
                "decoding": "full depth",
                "tokens_per_s": paired.peer_speed,
                "speedup": 1.0,
                "layers_per_token": float(trained.config.num_layers),
            }
        ]
        print(f"batch {batch}: full depth {paired.peer_speed:.1f} tok/s", flush=True)
        for (name, _, kw), res, speedup, tps in zip(runs, paired.results, paired.speedups, paired.speeds):
            s = res.stats
            row = {
                "decoding": name,
                "tokens_per_s": tps,
                "speedup": speedup,
                "layers_per_token": s["mean_layers_per_token"],
            }
            if "spec" in kw:
                row.update(
                    acceptance=s["acceptance_rate"],
                    tokens_per_round=s["tokens_per_round"],
                    identical=res.tokens == full.tokens,
                )
            else:
                row.update(rouge_l_to_full=rouge_l(res.texts, full.texts))
            rows.append(row)
            print(
                f"  {name}: {speedup:.2f}x, {row['layers_per_token']:.1f} layers/token, "
                + (
                    f"acceptance {row['acceptance']:.2f}, identical {row['identical']}"
                    if "spec" in kw
                    else f"ROUGE-L to full {row['rouge_l_to_full']:.3f}"
                ),
                flush=True,
            )
        out[str(batch)] = rows
    return out


def write_report(results: dict) -> None:
    lines = ["# SmolLM2-135M with exit adapters trained by eejax (CPU)\n"]
    if "train" in results:
        t = results["train"]
        lines.append(
            f"Training: {t['steps']} steps x {t['batch_size']} sequences of <= {t['max_len']} tokens "
            f"({t['prompts']} CNN/DM articles + SmolLM2's continuations), {t['positions_per_row']} positions "
            f"per row, rank {t['rank']} adapters at exits {t['exit_layers']}: {t['train_s']:.0f} s; "
            f"loss {np.mean(t['losses'][:10]):.3f} -> {np.mean(t['losses'][-10:]):.3f}\n"
        )
    if "agreement" in results:
        a = results["agreement"]
        layers = results.get("train", {}).get("exit_layers") or range(1, len(a["before"]) + 1)
        lines += [
            "| exit after | agreement with the last layer, all positions: untrained | trained | "
            "generated positions: untrained | trained |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {e} | {a['before'][e - 1]:.3f} | {a['after'][e - 1]:.3f} | {a['generated_before'][e - 1]:.3f} "
            f"| {a['generated_after'][e - 1]:.3f} |"
            for e in layers
        ]
    if "calibrate" in results:
        c = results["calibrate"]
        lines += [
            f"\nCalibration (n = {c['n']}, δ = {c['delta']}, ε = {c['epsilon']}, {c['method']}): chosen λ = "
            f"{c['threshold']}\n",
            "| λ | 1 - ROUGE-L to full | p-value | layers/token |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {t:g} | {r:.3f} | {p:.3g} | {n:.2f} |"
            for t, r, p, n in zip(c["thresholds"], c["risks"], c["p_values"], c["layers_per_token"])
        ]
    for batch, rows in results.get("speed", {}).items():
        lines += [
            f"\n## batch {batch}\n",
            "| decoding | tok/s | vs full depth | layers/token | ROUGE-L to full | acceptance | identical |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            f = lambda k, p, r=r: f"{r[k]:.{p}f}" if k in r else "-"  # noqa: E731
            same = "-" if "identical" not in r else ("yes" if r["identical"] else "NO")
            lines.append(
                f"| {r['decoding']} | {r['tokens_per_s']:.1f} | {f('speedup', 2)}x | {f('layers_per_token', 1)} "
                f"| {f('rouge_l_to_full', 3)} | {f('acceptance', 2)} | {same} |"
            )
    (OUT / "train_exits.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", nargs="+", action="extend", choices=STAGES, default=list(STAGES))
    p.add_argument("--exit-layers", type=int, nargs="+", action="extend", default=[3, 6, 9, 12, 15, 18, 21, 24, 27])
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--positions-per-row", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--continuation-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=256, help="evaluation prompts' tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="evaluation tokens per row")
    p.add_argument(
        "--repeats", type=int, default=1, help="timed runs per decoding, each between two full-depth runs (median kept)"
    )
    p.add_argument("--thresholds", type=float, nargs="+", action="extend", default=[0.99, 0.95, 0.9, 0.8, 0.6, 0.4])
    p.add_argument("--delta", type=float, default=0.2, help="tolerated 1 - ROUGE-L to full")
    p.add_argument("--epsilon", type=float, default=0.1)
    p.add_argument("--batches", type=int, nargs="+", action="extend", default=[1, 8])
    p.add_argument("--prompts-b1", type=int, default=4, help="prompts run one at a time at batch 1")
    p.add_argument("--speed-thresholds", type=float, nargs="*", action="extend", default=[0.9, 0.6, 0.3])
    p.add_argument(
        "--specs",
        nargs="*",
        action="extend",
        default=["6:2", "9:2", "12:2", "15:1", "15:2", "9:2:adaptive", "15:2:adaptive"],
    )
    p.add_argument("--untrained-specs", nargs="*", action="extend", default=["15:2:adaptive"])
    args = p.parse_args()

    results_path = OUT / "train_exits.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    base = eejax.load("smollm2-135m", quantization=None)
    if "train" in args.stages:
        results["train"] = stage_train(args, base)
        write_result("train_exits", results)
    trained = eejax.load(OUT / "smollm2-exits")
    if "agreement" in args.stages:
        results["agreement"] = stage_agreement(args, base, trained)
        write_result("train_exits", results)
    if "calibrate" in args.stages:
        results["calibrate"] = stage_calibrate(args, trained)
        write_result("train_exits", results)
    if "speed" in args.stages:
        results["speed"] = stage_speed(args, base, trained, results.get("calibrate", {}).get("threshold"))
        write_result("train_exits", results)
    write_report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
