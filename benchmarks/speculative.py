"""Self-speculative decoding on SmolLM2-135M (fp32): tokens/s, acceptance, layers per token.

CNN/DM articles (first --prompt-tokens tokens, then "\\n\\nSummary:"), --new-tokens greedy tokens
per row with EOS ignored, batch 1 and 8. Measured in one run: eejax full-depth decoding, eejax
self-speculation at several (E, d) and adaptive d, and at batch 1 HF transformers `generate`
plain and with `assistant_early_exit=E` (HF's LayerSkip decoding, batch 1 only; on fewer
prompts since it is slow here). Every eejax speculation's tokens are checked against full
depth. eejax speeds are decode tokens/s (prefill excluded; medians over --repeats) against
eejax's own full depth timed just before and after each run, with the cost model's ideal
speed-up (weights read per token, `eejax.decode.cost`) and the machinery efficiency =
measured / ideal. Drafts use a reduced exit head of --vocab-size tokens (counted as `eejax
exit-vocab` does, over the model's continuations of other CNN/DM articles) except the row
marked "full head". Programs timed alone give the cost of one draft token (vs (E + 1) / L of
a full-depth step), a draft and a verify pass, and the predicted break-even acceptance rate
(see `eejax.decode.spec_policy`). Writes benchmarks/out/speculative.{json,md}.

    python benchmarks/speculative.py [--batches 1 8] [--prompts 4] [--model path/to/model]
        [--quantization gguf|int8] [--activations float32|int16|int8] [--prompt-activations int16]

SmolLM2 was not trained for early exit: its layer-E drafts rarely agree with its last layer,
so this measures the machinery and the honest curve, not a LayerSkip-trained model.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eejax  # noqa: E402
from benchmarks.common import (  # noqa: E402
    ROOT,
    add_quantization_args,
    hf_generate_tokens_per_s,
    load_hf_smollm2,
    paired_runs,
    with_exit_vocab,
    write_result,
)
from benchmarks.early_exit import summary_prompts  # noqa: E402
from eejax import LayerSkipSpec, SpecConfig  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser
from eejax.decode.spec_policy import break_even_acceptance, speedup  # noqa: E402
from eejax.options import StepOptions  # noqa: E402

# 15:2 with the full head and the bonus pass always on is how self-speculation ran before the
# reduced head; every other configuration drafts with the reduced head and lets the cost model
# decide the bonus pass.
SPECS = [
    LayerSkipSpec(15, 2, head="full", bonus=True),
    LayerSkipSpec(15, 2),
    LayerSkipSpec(8, 2),
    LayerSkipSpec(22, 2),
    LayerSkipSpec(22, 4),
    LayerSkipSpec(27, 3),
]
ADAPTIVE = [LayerSkipSpec(e, 2, adaptive=True) for e in (15, 22)]


def spec_label(spec: SpecConfig) -> str:
    return spec.spec + (" [full head, bonus]" if spec.head == "full" else "")


def program_costs(model, batch: int, prompt_tokens: int, exit_layers, ds=(1, 2, 4), repeats: int = 15):
    """Seconds of one full-depth decode step, of one draft token and one draft pass (per E) and
    of a verify pass (per E and d), as jitted programs on a cache holding `prompt_tokens` per
    row. The programs run in turn, `repeats` rounds, and each is reported as the median over
    rounds of its time over the full step's in the same round (times the full step's median),
    so the machine's drift does not enter the ratios."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from eejax.cache import init_cache
    from eejax.decode import speculative, steps

    c = model.config
    pages = -(-(prompt_tokens + 64) // 16)
    table = jnp.asarray(1 + np.arange(batch * pages).reshape(batch, pages), jnp.int32)
    cache = init_cache(c.num_layers, 1 + batch * pages, 16, c.num_kv_heads, c.head_dim, model.dtype)
    tokens = jnp.asarray(np.random.default_rng(0).integers(10, 1000, (batch, prompt_tokens)), jnp.int32)
    options = StepOptions(64)
    prefill = jax.jit(functools.partial(steps.prefill, config=c, options=options))

    state, cache = prefill(
        model.params, cache, tokens, jnp.full((batch,), prompt_tokens, jnp.int32), table, jax.random.PRNGKey(0)
    )

    def program(fn, options):
        return jax.jit(functools.partial(fn, config=c, options=options), donate_argnums=(1,))

    # name -> (f(cache) -> (output, cache), the cache donated and threaded through as in generate;
    # what the time is divided by)
    runs = {}
    decode = program(steps.decode, options)
    runs["full_step"] = (lambda ca: decode(model.params, ca, state, table), 1)
    counters = speculative.SpecCounters.zeros(batch)
    for e in exit_layers:
        # One draft token: 4 drafts without the bonus pass, per draft.
        token = program(speculative.draft, StepOptions(64, spec=LayerSkipSpec(e, 4)).round(4).drafting())
        runs[f"draft_token_{e}"] = (lambda ca, f=token: f(model.params, ca, state, table)[::2], 4)
        for d in ds:
            round_options = StepOptions(64, spec=LayerSkipSpec(e, d)).round(d, bonus=True)
            draft = program(speculative.draft, round_options.drafting())
            verify = program(speculative.verify, round_options.verifying())
            drafts, st, cache = draft(model.params, cache, state, table)
            if d == 1:
                runs[f"draft_pass_{e}"] = (lambda ca, f=draft: f(model.params, ca, state, table)[::2], d + 1)
            runs[f"verify_{e}_{d}"] = (
                lambda ca, f=verify, st=st, drafts=drafts: f(model.params, ca, st, drafts, counters, table)[:2],
                1,
            )
    times = {name: [] for name in runs}
    for round_ in range(repeats + 1):  # round 0 warms up (compiles)
        for name, (f, per) in runs.items():
            start = time.perf_counter()
            out, cache = jax.block_until_ready(f(cache))
            if round_:
                times[name].append((time.perf_counter() - start) / per)
    full = np.asarray(times["full_step"])
    return {name: float(np.median(np.asarray(t) / full) * np.median(full)) for name, t in times.items()}


def hf_assistant_tokens_per_s(hf, prompts, new_tokens, exit_layer):
    """HF `generate(assistant_early_exit=E)` one prompt at a time: (tokens/s, tokens)."""
    import torch

    tokens, total, elapsed = [], 0, 0.0
    for p in prompts:
        ids = torch.tensor([p])
        kw = dict(
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            assistant_early_exit=exit_layer,
            pad_token_id=0,
        )
        with torch.no_grad():
            start = time.perf_counter()
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            elapsed += time.perf_counter() - start
        tokens.append(out[0, len(p) :].tolist())
        total += len(tokens[-1])
    return total / elapsed, tokens


def main() -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--batches", type=int, nargs="+", action="extend", default=None, help="batch sizes (default 1 8)"
    )
    parser.add_argument("--prompts", type=int, default=4, help="prompts at batch 1 (batch b uses b prompts)")
    parser.add_argument("--hf-prompts", type=int, default=2, help="prompts for HF assistant_early_exit")
    parser.add_argument("--hf-exit-layers", type=int, nargs="*", action="extend", default=[15, 22])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", default="smollm2-135m", help="eejax model (e.g. one with trained exits)")
    parser.add_argument("--name", default="speculative", help="output name under benchmarks/out/")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed runs per configuration, each between two full-depth runs (median kept)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=8192,
        help="tokens of the reduced exit head the drafts use (0: none; SmolLM2 only)",
    )
    add_quantization_args(parser)
    args = parser.parse_args()

    model = eejax.load(
        args.model,
        quantization=args.quantization,
        activations=args.activations,
        prompt_activations=args.prompt_activations,
    )
    if args.vocab_size:
        model = with_exit_vocab(model, args.vocab_size)
    L = model.config.num_layers
    hf = load_hf_smollm2() if args.model == "smollm2-135m" else None
    results = {
        "model": args.model,
        "quantization": args.quantization,
        "activations": args.activations,
        "num_layers": L,
        "new_tokens": args.new_tokens,
        "prompt_tokens": args.prompt_tokens,
        "batches": {},
    }
    lines = [
        f"# Self-speculation on {args.model} ({L} layers"
        + (f", {args.quantization} weights, {args.activations} activations" if args.quantization else "")
        + f"), {args.new_tokens} new tokens, "
        f"{args.prompt_tokens}-token CNN/DM prompts\n"
    ]
    for batch in args.batches or [1, 8]:
        n = max(batch, args.prompts) if batch == 1 else batch
        prompts, _ = summary_prompts(model.tokenizer, n, args.prompt_tokens)
        specs = [s for s in SPECS + ADAPTIVE if s.exit_layer < L]

        def run(spec, prompts=prompts, batch=batch):
            return eejax.generate(
                model, prompts, max_new_tokens=args.new_tokens, ignore_eos=True, batch_size=batch, spec=spec
            )

        paired = paired_runs(run, specs, args.repeats)
        full, full_tps = paired.peer, paired.peer_speed
        rows = []
        out = {"full_depth": full.stats, "speculation": {}}
        if batch == 1 and hf is not None:
            pad = model.tokenizer.pad_token_id or 0
            # One prompt at a time (batch 1), as eejax runs them here.
            per_prompt = [hf_generate_tokens_per_s(hf, [p], args.new_tokens, pad) for p in prompts]
            hf_tps = len(per_prompt) / sum(1 / x for x in per_prompt)
            out["hf_tokens_per_s"] = hf_tps
            rows.append(("HF transformers generate (prefill included)", hf_tps, None, None, None, "yes"))
            for e in args.hf_exit_layers:
                tps, toks = hf_assistant_tokens_per_s(hf, prompts[: args.hf_prompts], args.new_tokens, e)
                same = toks == full.tokens[: args.hf_prompts]
                out[f"hf_assistant_early_exit_{e}"] = {"tokens_per_s": tps, "identical": same}
                rows.append(
                    (
                        f"HF assistant_early_exit={e} ({args.hf_prompts} prompts, prefill included)",
                        tps,
                        None,
                        None,
                        None,
                        "yes" if same else "no",
                    )
                )
        rows.append(("eejax full depth", full_tps, None, None, float(L), "-"))
        for spec, res, ratio, tps in zip(specs, paired.results, paired.speedups, paired.speeds):
            s = res.stats
            same = res.tokens == full.tokens
            efficiency = ratio / s["ideal_speedup"]
            out["speculation"][spec_label(spec)] = {
                **s,
                "identical": same,
                "speedup": ratio,
                "efficiency": efficiency,
                "median_decode_tokens_per_s": tps,
            }
            label = f"eejax spec {spec_label(spec)}" + (
                f" (mean d {s['mean_speculations']:.1f})" if spec.adaptive else ""
            )
            rows.append(
                (
                    label,
                    tps,
                    s["acceptance_rate"],
                    s["tokens_per_round"],
                    s["mean_layers_per_token"],
                    "yes" if same else "NO",
                    s["ideal_speedup"],
                    efficiency,
                    s["bonus_pass_rate"],
                    ratio,
                )
            )
            print(
                f"batch {batch} {spec_label(spec)}: {tps:.1f} tok/s ({ratio:.2f}x of full depth, "
                f"ideal {s['ideal_speedup']:.2f}x, efficiency {efficiency:.2f}), acceptance "
                f"{s['acceptance_rate']:.2f}, bonus rounds {s['bonus_pass_rate']:.0%}, identical {same}",
                flush=True,
            )
        # The cost model from programs timed alone (d = 1, 2, 4; the verify cost in between and
        # beyond is the line through them), with the acceptance each E measured.
        exit_layers = sorted({s.exit_layer for s in ADAPTIVE if s.exit_layer < L})
        timed = program_costs(model, batch, args.prompt_tokens, exit_layers)
        step_s = timed["full_step"]
        model_rows = []
        for e in exit_layers:
            verify_line = np.polyfit([2, 3, 5], [timed[f"verify_{e}_{d}"] for d in (1, 2, 4)], 1)
            c_verify = lambda d, line=verify_line: float(np.polyval(line, d + 1))  # noqa: E731
            c_draft = timed[f"draft_pass_{e}"]
            alpha = break_even_acceptance(c_draft, c_verify, step_s)
            measured = out["speculation"][spec_label(LayerSkipSpec(e, 2, adaptive=True))]["acceptance_rate"]
            best = max(speedup(1.0, d, c_draft, c_verify, step_s) for d in range(1, 9))
            model_rows.append(
                (
                    e,
                    c_draft / step_s,
                    c_verify(1) / step_s,
                    c_verify(4) / step_s,
                    alpha,
                    measured,
                    best,
                    timed[f"draft_token_{e}"] / step_s,
                    (e + 1) / L,
                )
            )
        out["cost_model"] = [
            dict(
                zip(
                    (
                        "exit_layer",
                        "draft_pass_over_step",
                        "verify_d1_over_step",
                        "verify_d4_over_step",
                        "break_even_acceptance",
                        "measured_acceptance",
                        "speedup_at_full_acceptance",
                        "draft_token_over_step",
                        "target_e_plus_1_over_l",
                    ),
                    r,
                )
            )
            for r in model_rows
        ]
        out["program_seconds"] = timed
        results["batches"][str(batch)] = out

        lines.append(f"\n## batch {batch} ({len(prompts)} prompts)\n")
        lines.append(
            "| decoding | decode tok/s | vs eejax full | ideal | efficiency | acceptance | tokens/round | "
            "bonus rounds | layers/token | identical |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for label, tps, acc, tpr, layers, same, *more in rows:
            f = lambda x, p: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
            ideal, eff, bonus, ratio = more or (None, None, None, tps / full_tps)
            lines.append(
                f"| {label} | {tps:.1f} | {ratio:.2f}x | {f(ideal, 2)} | {f(eff, 2)} | "
                f"{f(acc, 2)} | {f(tpr, 2)} | {f(bonus, 2)} | {f(layers, 1)} | {same} |"
            )
        lines.append(f"\nCost model (programs timed alone; full-depth decode step {step_s * 1e3:.1f} ms = 1):\n")
        lines.append(
            "| E | draft token (d=4, reduced head) | target (E+1)/L | draft pass (bonus) | verify d=1 | "
            "verify d=4 | break-even acceptance | measured acceptance | "
            "speed-up if all accepted (best d <= 8) |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for e, cd, cv1, cv4, alpha, measured, best, token, target in model_rows:
            lines.append(
                f"| {e} | {token:.3f} | {target:.3f} | {cd:.3f} | {cv1:.3f} | {cv4:.3f} | {alpha:.2f} | "
                f"{measured:.2f} | {best:.2f}x |"
            )
    path = write_result(args.name, results)
    md = ROOT / "benchmarks" / "out" / f"{args.name}.md"
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {path} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
