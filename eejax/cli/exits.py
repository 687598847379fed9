"""`eejax calibrate` (an early-exit threshold with a guarantee) and `eejax exit-vocab` (the reduced head)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eejax.cli.args import add_model_and_prompts, number_or_off, positive_int, prompts_from_args
from eejax.errors import EejaxError


def cmd_calibrate(args: argparse.Namespace) -> int:
    import eejax
    from eejax.train.calibrate import calibrate_exit_threshold

    prompts = prompts_from_args(args)
    decay = None if args.exit_decay in ("off", "none") else number_or_off(args.exit_decay, "--exit-decay")
    model = eejax.load(args.model, quantization=None)  # calibrates float32 weights, as trained
    cal, layers = calibrate_exit_threshold(
        model,
        prompts,
        measure=args.measure,
        thresholds=args.thresholds,
        delta=args.delta,
        epsilon=args.epsilon,
        max_new_tokens=args.max_new_tokens,
        consistency=args.consistency,
        decay=decay,
        min_exit_layer=args.min_exit_layer,
        every=args.exit_every,
        batch_size=args.batch_size,
        progress=True,
    )
    num_layers = model.config.num_layers
    if args.json:
        json.dump(
            {
                "threshold": cal.threshold,
                "certified": cal.certified,
                "thresholds": cal.thresholds,
                "risks": cal.risks,
                "p_values": cal.p_values,
                "mean_layers_per_token": list(layers.values()),
                "num_layers": num_layers,
                "delta": cal.delta,
                "epsilon": cal.epsilon,
                "n": cal.n,
                "method": cal.method,
                "certificate": cal.certificate(),
            },
            sys.stdout,
        )
        sys.stdout.write("\n")
        return 0
    for t, r, p in zip(cal.thresholds, cal.risks, cal.p_values):
        mark = "certified" if cal.certified and t >= cal.threshold else ""
        print(f"λ={t:<8g} risk {r:.4f}  p-value {p:.3g}  layers/token {layers[t]:.2f} of {num_layers}  {mark}")
    if cal.certified:
        print(
            f"chosen λ = {cal.threshold:g}: mean layers per token {layers[cal.threshold]:.2f} of {num_layers} "
            f"(exit rate {1 - layers[cal.threshold] / num_layers:.1%} of the layers skipped)"
        )
    print(cal.certificate())
    return 0


def cmd_exit_vocab(args: argparse.Namespace) -> int:
    import eejax
    from eejax.checkpoint import check_destination
    from eejax.decode.prompts import prompt_token_ids
    from eejax.train.exit_vocab import add_exit_vocab, count_tokens, most_frequent

    output = Path(args.output).expanduser()
    check_destination(output, overwrite=args.overwrite)
    texts = prompts_from_args(args)
    model = eejax.load(args.model, quantization=None)  # writes the float32 model with its reduced head
    if not 1 <= args.size <= model.config.vocab_size:
        raise EejaxError(f"--size {args.size} must lie in [1, {model.config.vocab_size}] (the model's vocabulary)")
    prompts, _ = prompt_token_ids(model.tokenizer, texts)
    prompts = [p[: args.max_prompt_tokens] for p in prompts]
    counts = count_tokens(
        model,
        prompts,
        corpus=args.corpus,
        new_tokens=args.continuation_tokens,
        batch_size=args.batch_size,
        progress=not args.quiet,
    )
    ids = most_frequent(counts, args.size, always=model.eos_token_ids)
    covered = counts[ids].sum() / max(counts.sum(), 1)
    eejax.save(
        add_exit_vocab(model, ids),
        output,
        overwrite=args.overwrite,
        metadata={
            "exit_vocab": {
                "base": str(args.model),
                "size": args.size,
                "corpus": args.corpus,
                "prompts": len(prompts),
                "continuation_tokens": args.continuation_tokens,
                "tokens_counted": int(counts.sum()),
                "coverage": float(covered),
            }
        },
    )
    print(
        f"wrote {output}: a reduced exit head of {args.size} of {model.config.vocab_size} tokens, covering "
        f"{covered:.1%} of the {int(counts.sum())} tokens counted ({args.corpus} of {len(prompts)} prompts)"
    )
    return 0


def add_parsers(sub) -> None:
    """Adds this module's commands to the `eejax` subparsers."""
    cal = sub.add_parser(
        "calibrate",
        help="pick an early-exit threshold with a Learn-then-Test guarantee",
        description="Generate the prompts (the calibration set) at full depth and with each candidate threshold, "
        "measure each prompt's inconsistency with full depth, and certify thresholds in order (most conservative "
        "first) while the p-value of 'risk > delta' is <= epsilon (Learn then Test, fixed-sequence testing). "
        "Prints the smallest certified threshold, its layers per token and the certificate.",
    )
    add_model_and_prompts(cal, "calibration prompts", "eejax checkpoint directory or known model name")
    cal.add_argument("--measure", required=True, choices=("softmax", "state", "classifier"))
    cal.add_argument(
        "--thresholds",
        type=float,
        nargs="+",
        action="extend",
        required=True,
        metavar="λ",
        help="candidates, most conservative (largest) first, e.g. 0.99 0.95 0.9 0.8",
    )
    cal.add_argument("--delta", type=float, default=0.1, help="tolerated risk (mean inconsistency), default 0.1")
    cal.add_argument("--epsilon", type=float, default=0.05, help="risk level of the guarantee, default 0.05")
    cal.add_argument(
        "--consistency",
        choices=("tokens", "rouge"),
        default="tokens",
        help="tokens: share of full-depth tokens not reproduced; rouge: 1 - ROUGE-L to full depth",
    )
    cal.add_argument("--max-new-tokens", type=positive_int, default=64)
    cal.add_argument(
        "--batch-size",
        type=positive_int,
        default=1,
        help="rows decoded together (a batch exits when all its rows are confident: calibrate at the "
        "batch size you decode with; default 1)",
    )
    cal.add_argument("--exit-decay", default="4", metavar="τ", help="decaying threshold τ, or 'off' (default 4)")
    cal.add_argument("--min-exit-layer", type=positive_int, default=1, metavar="K")
    cal.add_argument("--exit-every", type=positive_int, default=1, metavar="k")
    cal.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    cal.set_defaults(func=cmd_calibrate)

    ev = sub.add_parser(
        "exit-vocab",
        help="add a reduced-vocabulary exit head (cheap exit checks and drafts)",
        description="Count token frequencies over a corpus (by default the model's own greedy continuations of "
        "the prompts) and store the --size most frequent tokens (EOS always among them) with the LM head's rows "
        "for them in a new checkpoint's exits. Softmax exit checks and self-speculation drafts then evaluate "
        "that reduced head (FR-Spec) instead of the whole vocabulary; verification and, by default, the emitted "
        "token of an early exit still use the full head, so self-speculation stays lossless.",
    )
    add_model_and_prompts(ev, "prompts of the corpus", "eejax checkpoint directory or known model name")
    ev.add_argument("--output", required=True, metavar="DIR", help="where to write the model with the reduced head")
    ev.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    ev.add_argument(
        "--size",
        type=positive_int,
        default=8192,
        metavar="K",
        help="tokens in the reduced vocabulary (default 8192; the vocabulary size gives the full head)",
    )
    ev.add_argument(
        "--corpus",
        choices=("continuations", "prompts", "both"),
        default="continuations",
        help="count the model's greedy continuations of the prompts (default), the prompts, or both",
    )
    ev.add_argument(
        "--continuation-tokens",
        type=positive_int,
        default=64,
        metavar="N",
        help="greedy tokens generated per prompt (default 64)",
    )
    ev.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=512,
        metavar="T",
        help="cut each prompt to its first T tokens (default 512)",
    )
    ev.add_argument("--batch-size", type=positive_int, default=8, help="rows generated together (default 8)")
    ev.add_argument("--quiet", action="store_true", help="no progress bar")
    ev.set_defaults(func=cmd_exit_vocab)
