"""SmolLM2-135M trained by `eejax train-layerskip`, against the original, on CNN/DM rows it never saw.

Rows of data/cnndm_test_dev100.jsonl: 0..7 evaluation (the other benchmarks' prompts too),
8..19 calibration, 20..99 training (the run's --skip 20). Stages:

  quality    perplexity of held-out article text (rows 0..19, first 512 tokens) and ROUGE-L of
             greedy summaries (rows 0..7, "Summary:" prompts) to the reference highlights, both models
  agreement  per exit layer, the share of generated positions where the exit's argmax equals the
             model's own last layer's (each model on its own continuations)
  calibrate  Learn then Test for the softmax exit threshold (δ, ε, ROUGE-L to full) on rows 8..19
  speed      full depth vs self-speculation (token-identical checked) and calibrated early exit,
             at batch 1 and 8, each configuration between two full-depth runs (`paired_runs`)

    python benchmarks/layerskip_model.py [--model smollm2-135m-layerskip | --run runs/DIR] [--stages ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import eejax  # noqa: E402
from benchmarks.common import OUT, ROOT, paired_runs  # noqa: E402
from benchmarks.early_exit import rouge_l, summary_prompts  # noqa: E402
from eejax import ExitConfig, SpecConfig  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402

STAGES = ("quality", "agreement", "calibrate", "speed")
EVAL, CALIBRATION = range(0, 8), range(8, 20)


def articles(rows: range) -> list[str]:
    with (ROOT / "data" / "cnndm_test_dev100.jsonl").open() as f:
        texts = [json.loads(line)["article"] for line in f]
    return [texts[i] for i in rows]


def perplexity(model, rows: range, max_tokens: int = 512) -> float:
    """exp(mean next-token NLL) over the first `max_tokens` tokens of each article."""
    from eejax.models import llama
    from eejax.train.forward import layer_states

    nll, count = 0.0, 0
    for text in articles(rows):
        ids = model.tokenizer(text)["input_ids"][:max_tokens]
        tokens = jnp.asarray([ids], jnp.int32)
        states = layer_states(model.params, tokens, jnp.asarray([len(ids)], jnp.int32), model.config)
        logp = np.asarray(jax.nn.log_softmax(llama.lm_head(model.params, states[-1, 0], model.config), -1))
        nll -= float(logp[np.arange(len(ids) - 1), ids[1:]].sum())
        count += len(ids) - 1
    return float(np.exp(nll / count))


def stage_quality(args, base, trained) -> dict:
    prompts, refs = summary_prompts(base.tokenizer, EVAL.stop, args.prompt_tokens)
    out = {}
    for name, model in (("original", base), ("trained", trained)):
        res = eejax.generate(model, prompts, max_new_tokens=args.new_tokens, batch_size=8)
        out[name] = {"perplexity": perplexity(model, range(0, 20)), "rouge_l": rouge_l(res.texts, refs)}
        print(f"{name}: perplexity {out[name]['perplexity']:.3f}, ROUGE-L to the highlights {out[name]['rouge_l']:.4f}")
    return out


def stage_agreement(args, base, trained) -> dict:
    from eejax.train.data import continued_sequences, sequence_batches
    from eejax.train.exit_training import exit_agreement

    prompts, _ = summary_prompts(base.tokenizer, EVAL.stop, args.prompt_tokens)
    out = {}
    for name, model in (("original", base), ("trained", trained)):
        plain = eejax.Model(model.config, {k: v for k, v in model.params.items() if k != "exits"}, model.tokenizer)
        batches = sequence_batches(continued_sequences(plain, prompts, args.new_tokens, progress=False), 4, 10**6)
        out[name] = exit_agreement(plain, batches, start=args.prompt_tokens - 1).tolist()
    print("exit layer | agreement with its own last layer on generated tokens: original -> trained")
    for layer in range(1, base.config.num_layers):
        print(f"{layer:>10} | {out['original'][layer - 1]:.3f} -> {out['trained'][layer - 1]:.3f}")
    return out


def stage_calibrate(args, trained) -> dict:
    from eejax.train.calibrate import calibrate_exit_threshold

    prompts, _ = summary_prompts(trained.tokenizer, CALIBRATION.stop, args.prompt_tokens)
    t0 = time.perf_counter()
    cal, layers = calibrate_exit_threshold(
        trained,
        prompts[CALIBRATION.start :],
        measure="softmax",
        thresholds=args.thresholds,
        delta=args.delta,
        epsilon=args.epsilon,
        max_new_tokens=args.new_tokens,
        consistency="rouge",
        batch_size=1,
        progress=True,
    )
    print(f"calibration on {len(prompts) - CALIBRATION.start} prompts in {time.perf_counter() - t0:.0f} s")
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
    }


def stage_speed(args, base, trained, calibrated) -> dict:
    runs = [(f"self-speculation {s}", trained, dict(spec=SpecConfig.parse(s))) for s in args.specs]
    runs += [(f"self-speculation {s}, original", base, dict(spec=SpecConfig.parse(s))) for s in args.original_specs]
    thresholds = sorted({*args.speed_thresholds, *([calibrated] if calibrated is not None else [])}, reverse=True)
    runs += [
        (
            f"early exit softmax:{t:g}" + (" (calibrated)" if t == calibrated else ""),
            trained,
            dict(exit=ExitConfig("softmax", threshold=t)),
        )
        for t in thresholds
    ]
    out = {}
    for batch in args.batches:
        prompts, _ = summary_prompts(trained.tokenizer, max(batch, args.prompts_b1), args.prompt_tokens)

        def run(i, prompts=prompts, batch=batch):
            model, kw = (trained, {}) if i is None else runs[i][1:]
            return eejax.generate(
                model, prompts, max_new_tokens=args.new_tokens, ignore_eos=True, batch_size=batch, **kw
            )

        paired = paired_runs(run, list(range(len(runs))), args.repeats, speed=lambda r: r.stats["tokens_per_s"])
        full = paired.peer
        print(f"batch {batch}: full depth {paired.peer_speed:.1f} tok/s", flush=True)
        rows = []
        for (name, model, kw), res, speedup in zip(runs, paired.results, paired.speedups):
            s = res.stats
            row = {
                "decoding": name,
                "speedup": speedup,
                "ideal_speedup": s["ideal_speedup"],
                "layers_per_token": s["mean_layers_per_token"],
            }
            if "spec" in kw:
                same = res.tokens == (full.tokens if model is trained else None)
                row.update(acceptance=s["acceptance_rate"], identical=same if model is trained else None)
            else:
                row.update(rouge_l_to_full=rouge_l(res.texts, full.texts))
            rows.append(row)
            print(
                f"  {name}: {speedup:.2f}x (ideal {row['ideal_speedup']:.2f}x, efficiency "
                f"{speedup / row['ideal_speedup']:.2f}), {row['layers_per_token']:.1f} layers/token, "
                + (
                    f"acceptance {row['acceptance']:.2f}"
                    + (f", identical {row['identical']}" if row["identical"] is not None else "")
                    if "spec" in kw
                    else f"ROUGE-L to full {row['rouge_l_to_full']:.3f}"
                ),
                flush=True,
            )
        out[str(batch)] = {"full_tokens_per_s": paired.peer_speed, "rows": rows}
    return out


def main() -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="smollm2-135m-layerskip", help="the trained model (name or directory)")
    src.add_argument("--run", help="a train-layerskip run directory: its latest checkpoint")
    p.add_argument("--base", default="smollm2-135m", help="the original model")
    p.add_argument("--stages", nargs="+", action="extend", choices=STAGES, default=None)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--specs",
        nargs="*",
        action="extend",
        default=None,
        help="self-speculation settings of the trained model (default 15:2 15:3 12:3 8:3 15:3:adaptive)",
    )
    p.add_argument("--original-specs", nargs="*", action="extend", default=None)
    p.add_argument(
        "--thresholds",
        type=float,
        nargs="+",
        action="extend",
        default=None,
        help="calibration thresholds (default 0.99 0.95 0.9 0.8 0.6 0.4)",
    )
    p.add_argument("--speed-thresholds", type=float, nargs="*", action="extend", default=None)
    p.add_argument("--delta", type=float, default=0.1, help="tolerated mean 1 - ROUGE-L to full depth")
    p.add_argument("--epsilon", type=float, default=0.1)
    p.add_argument("--batches", type=int, nargs="+", action="extend", default=None)
    p.add_argument("--prompts-b1", type=int, default=4, help="prompts run one at a time at batch 1")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--name", default="layerskip_model", help="output name under benchmarks/out/")
    args = p.parse_args()
    args.stages = args.stages or list(STAGES)
    args.specs = args.specs if args.specs is not None else ["15:2", "15:3", "12:3", "8:3", "15:3:adaptive"]
    args.original_specs = args.original_specs if args.original_specs is not None else ["15:3"]
    args.thresholds = args.thresholds or [0.99, 0.95, 0.9, 0.8, 0.6, 0.4]
    args.speed_thresholds = args.speed_thresholds if args.speed_thresholds is not None else []
    args.batches = args.batches or [1, 8]

    base = eejax.load(args.base, quantization=None)
    if args.run:
        from eejax.train.layerskip_run import load_run

        trained, step = load_run(args.run)
        print(f"{args.run} at step {step}")
    else:
        trained = eejax.load(args.model)
    results = {"model": args.run or args.model}
    if "quality" in args.stages:
        results["quality"] = stage_quality(args, base, trained)
    if "agreement" in args.stages:
        results["agreement"] = stage_agreement(args, base, trained)
    if "calibrate" in args.stages:
        results["calibrate"] = stage_calibrate(args, trained)
    if "speed" in args.stages:
        calibrated = results.get("calibrate", {}).get("threshold")
        results["speed"] = stage_speed(args, base, trained, calibrated)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {OUT / (args.name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
