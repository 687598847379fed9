"""`eejax train-exits`: exit adapters and classifiers trained by self-distillation on a frozen model."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from eejax.cli.args import add_model_and_prompts, layer_counts, positive_int, prompts_from_args
from eejax.errors import EejaxError


def cmd_train_exits(args: argparse.Namespace) -> int:

    import eejax
    from eejax.train.loop import fit_exit_adapters

    output = Path(args.output).expanduser()
    if output.exists() and not args.overwrite:
        raise EejaxError(f"{output} already exists (pass --overwrite to replace it)")
    if args.loss_plot:
        try:  # before the long work
            import matplotlib  # noqa: F401
        except ImportError:
            raise EejaxError('--loss-plot needs matplotlib: pip install "eejax[bench]"') from None
    texts = prompts_from_args(args)
    model = eejax.load(args.model, quantization=None)  # trains on float32 weights
    if model.tokenizer is None:
        raise EejaxError(f"{args.model} has no tokenizer to read the prompts with")
    suffix = model.tokenizer(args.suffix, add_special_tokens=False)["input_ids"] if args.suffix else []
    keep = args.max_len - args.continuation_tokens - len(suffix)
    if keep < 1:
        raise EejaxError(
            f"--max-len {args.max_len} leaves no room for a prompt after {args.continuation_tokens} "
            f"continuation tokens and a {len(suffix)}-token suffix"
        )
    prompts = [model.tokenizer(t)["input_ids"][:keep] + suffix for t in texts]
    t0 = time.perf_counter()
    model, losses = fit_exit_adapters(
        model,
        prompts,
        adapter_rank=args.adapter_rank,
        continuation_tokens=args.continuation_tokens,
        max_len=args.max_len,
        batch_size=args.batch_size,
        steps=args.steps,
        learning_rate=args.learning_rate,
        weights=args.weights,
        exit_layers=args.exit_layers,
        ce_weight=args.ce_weight,
        positions_per_row=args.positions_per_row or None,
        seed=args.seed,
        checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every,
        progress=not args.quiet,
    )
    seconds = time.perf_counter() - t0
    eejax.save(
        model,
        output,
        overwrite=args.overwrite,
        metadata={
            "exit_training": {
                "base": str(args.model),
                "steps": args.steps,
                "exit_layers": args.exit_layers,
                "weights": args.weights,
                "ce_weight": args.ce_weight,
                "prompts": len(prompts),
                "final_loss": float(losses[-1]),
            }
        },
    )
    if args.loss_plot:
        from eejax.train.plot import save_loss_plot

        save_loss_plot(losses, args.loss_plot)
    k = min(10, len(losses))
    print(
        f"trained exit adapters for {args.steps} steps on {len(prompts)} prompts in {seconds:.0f} s; "
        f"loss {losses[:k].mean():.4f} -> {losses[-k:].mean():.4f} (mean of the first / last {k} steps); "
        f"saved to {output}" + (f"; loss curve {args.loss_plot}" if args.loss_plot else "")
    )
    return 0


def add_parsers(sub) -> None:
    """Adds this module's command to the `eejax` subparsers."""
    tr = sub.add_parser(
        "train-exits",
        help="train exit adapters on a frozen model (self-distillation)",
        description="Make a model exit-capable: add an adapter before the shared final norm and LM head at each "
        "trained exit and train the adapters with optax (adam, cosine decay) so that each exit's next-token "
        "distribution matches the full model's (KL, per-layer weights; optionally plus cross-entropy on the "
        "data) while the backbone stays frozen. The data are the prompts followed by the model's own greedy "
        "continuations (a T5's rows are its decoder's start token and continuation, the encoder reading the "
        "prompt). Writes a new eejax checkpoint with the trained exits; with --checkpoint-dir, training "
        "state is saved every --save-every steps and a rerun resumes from it.",
    )
    add_model_and_prompts(
        tr, "training prompts", "eejax checkpoint directory or known model name (a Llama-family model or a T5)"
    )
    tr.add_argument("--output", required=True, metavar="DIR", help="where to write the model with trained exits")
    tr.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    tr.add_argument(
        "--suffix",
        default="",
        metavar="TEXT",
        help='appended to each (cut) prompt before the continuation, e.g. "\n\nSummary:"',
    )
    tr.add_argument(
        "--continuation-tokens",
        type=int,
        default=64,
        metavar="N",
        help="greedy tokens generated after each prompt (default 64; 0 = the prompts alone)",
    )
    tr.add_argument(
        "--max-len",
        type=positive_int,
        default=512,
        metavar="T",
        help="tokens per training sequence, prompt cut to fit (default 512)",
    )
    tr.add_argument(
        "--exit-layers",
        type=layer_counts,
        action="extend",
        metavar="E,E,...",
        help="the exits to train, as layers run, e.g. 3,6,9 (default: every layer 1..L-1)",
    )
    tr.add_argument(
        "--adapter-rank",
        type=positive_int,
        default=128,
        metavar="R",
        help="rank of each adapter's D x D map; the hidden size is a full map (default 128)",
    )
    tr.add_argument("--steps", type=positive_int, default=200, help="optimizer steps (default 200)")
    tr.add_argument("--batch-size", type=positive_int, default=4, help="sequences per step (default 4)")
    tr.add_argument(
        "--positions-per-row",
        type=int,
        default=64,
        metavar="P",
        help="positions of each sequence whose exits a step trains, drawn at random; 0 = all (default 64)",
    )
    tr.add_argument("--learning-rate", type=float, default=1e-3, help="peak adam learning rate (default 1e-3)")
    tr.add_argument(
        "--weights",
        choices=("calm", "layerskip", "uniform"),
        default="calm",
        help="per-exit loss weights: calm ∝ l, layerskip ∝ 1+...+l, uniform (default calm)",
    )
    tr.add_argument(
        "--ce-weight",
        type=float,
        default=0.0,
        help="weight of cross-entropy on the data's next tokens beside the KL (default 0)",
    )
    tr.add_argument(
        "--checkpoint-dir", metavar="DIR", help="orbax training checkpoints; a rerun resumes from the latest"
    )
    tr.add_argument("--save-every", type=positive_int, default=50, help="steps between checkpoints (default 50)")
    tr.add_argument("--loss-plot", metavar="F.png", help="save the loss curve as a PNG (needs matplotlib)")
    tr.add_argument("--seed", type=int, default=0, help="seed of the position sampling (default 0)")
    tr.add_argument("--quiet", action="store_true", help="no progress bars")
    tr.set_defaults(func=cmd_train_exits)
