"""`eejax train-layerskip`: LayerSkip training (layer dropout and an early-exit loss) with LoRA, resumable."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from eejax.cli.args import add_model_and_prompts, layer_counts, positive_int, read_prompts_file
from eejax.errors import EejaxError


def cmd_train_layerskip(args: argparse.Namespace) -> int:
    import numpy as np

    import eejax
    from eejax.train.layerskip import LayerSkipConfig
    from eejax.train.layerskip_run import RunSettings, export_run, train_layerskip

    for option, value in (
        ("--skip", args.skip),
        ("--sampled-every", args.sampled_every),
        ("--exit-vocab-size", args.exit_vocab_size),
    ):
        if value < 0:
            raise EejaxError(f"{option} must be >= 0, got {value}")
    if args.hours is not None and not 0 < args.hours < float("inf"):
        raise EejaxError(f"--hours must be a positive number, got {args.hours}")
    settings = RunSettings(
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lora_rank=args.lora_rank,
        exit_positions=args.exit_positions,
        seed=args.seed,
        layerskip=LayerSkipConfig(
            p_max=args.p_max,
            e_scale=args.e_scale,
            curriculum=args.curriculum,
            rotation=args.rotation,
            total_steps=args.steps,
            exit_layers=tuple(args.exit_layers) if args.exit_layers else None,
        ),
    )
    data_options = {
        "prompts": args.prompts_file or "--prompt",
        "skip": args.skip,
        "limit": args.limit,
        "window": args.window,
        "continuation_tokens": args.continuation_tokens,
        "sampled_every": args.sampled_every,
        "top_k": args.top_k,
        "suffix": args.suffix,
    }
    run = json.loads(
        json.dumps(
            {
                "model": str(args.model),
                "settings": settings.to_json(),
                "data": data_options,
                "exit_vocab_size": args.exit_vocab_size,
            }
        )
    )  # as run.json will hold it
    out = Path(args.output).expanduser()
    run_file = out / "run.json"
    if run_file.exists():
        before = json.loads(run_file.read_text())
        if before != run:
            changed = [k for k, v in _flat(run).items() if _flat(before).get(k) != v]
            raise EejaxError(
                f"{out} holds a run started with other settings ({', '.join(changed)}); "
                f"repeat its command (see {run_file}) or choose another --output"
            )
    elif out.exists() and any(out.iterdir()):
        raise EejaxError(f"{out} exists and is not a LayerSkip run directory; choose another --output")
    if args.loss_plot:
        try:  # before the long work
            import matplotlib  # noqa: F401
        except ImportError:
            raise EejaxError(
                'the loss plot needs matplotlib: pip install "eejax[bench]" (or pass --no-loss-plot)'
            ) from None
    texts = args.prompt if args.prompt is not None else read_prompts_file(args.prompts_file, args.prompt_field)
    texts = texts[args.skip :][: args.limit]  # the held-out rows first, then the limit
    if not texts:
        raise EejaxError(f"no prompts left after --skip {args.skip}")
    model = eejax.load(args.model, quantization=None)  # trains and distills on float32 weights
    from eejax.train.loop import check_decoder_only

    check_decoder_only(model.config, "LayerSkip training")
    settings.layerskip.eligible(model.config.num_layers)  # exit layers within the model
    if args.exit_vocab_size > model.config.vocab_size:
        raise EejaxError(f"--exit-vocab-size must lie in [0, {model.config.vocab_size}], got {args.exit_vocab_size}")
    if model.tokenizer is None:
        raise EejaxError(f"{args.model} has no tokenizer to read the prompts with")
    out.mkdir(parents=True, exist_ok=True)
    run_file.write_text(json.dumps(run, indent=2) + "\n")
    data = _layerskip_data(model, texts, out / "data.npz", args)
    t0 = time.perf_counter()
    trainable, log, done = train_layerskip(
        model,
        data,
        settings,
        out / "checkpoints",
        hours=args.hours,
        save_every=args.save_every,
        progress=not args.quiet,
    )
    hours = (time.perf_counter() - t0) / 3600
    steps_done = len(log["loss"])
    if args.loss_plot and steps_done:
        from eejax.train.plot import save_layerskip_plot, save_loss_plot

        save_loss_plot(log["loss"], out / "loss.png", title="LayerSkip training loss")
        save_layerskip_plot(log, out / "kl.png", model.config.num_layers)
    tokens = steps_done * settings.batch_size * data.tokens.shape[1]
    if not done:
        print(
            f"stopped after {hours:.2f} h at step {steps_done} of {settings.steps} (about {tokens} tokens so far); "
            f"run the same command again to continue from {out / 'checkpoints'}"
        )
        return 0
    path = export_run(
        model, trainable, settings, data, out, base_name=str(args.model), exit_vocab_size=args.exit_vocab_size
    )
    k = min(10, steps_done)
    print(
        f"trained {settings.steps} steps (about {tokens} tokens); loss {np.mean(log['loss'][:k]):.4f} -> "
        f"{np.mean(log['loss'][-k:]):.4f} (first / last {k} steps); model {path}"
        + (f", LoRA delta {out / 'delta.safetensors'}" if settings.lora_rank else "")
    )
    return 0


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested dict -> {"a.b": value}."""
    flat = {}
    for k, v in d.items():
        flat.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return flat


def _layerskip_data(model, texts: list[str], path: Path, args: argparse.Namespace):
    """The run's self-distillation data: read from `path`, or built once and saved there."""
    from eejax.train.distill import DistillData, continue_windows, teacher_targets, text_windows

    if path.exists():
        return DistillData.load(path)
    ids = [model.tokenizer(t)["input_ids"] for t in texts]
    windows = text_windows(ids, args.window, args.windows_per_prompt)
    if args.suffix:  # and each text's beginning followed by the suffix, e.g. a summary request
        suffix = model.tokenizer(args.suffix, add_special_tokens=False)["input_ids"]
        windows += [t[: args.window] + suffix for t in ids]
    sequences = continue_windows(
        model,
        windows,
        args.continuation_tokens,
        sampled_every=args.sampled_every,
        seed=args.seed,
        progress=not args.quiet,
    )
    data = teacher_targets(model, sequences, top_k=args.top_k, progress=not args.quiet)
    data.save(path)
    return data


def add_parsers(sub) -> None:
    """Adds this module's command to the `eejax` subparsers."""
    ls = sub.add_parser(
        "train-layerskip",
        help="LayerSkip training (layer dropout + early-exit loss) with LoRA, resumable",
        description="Train a Llama for early exit with LayerSkip's recipe: layer dropout (rates rising with depth "
        "to --p-max; a dropped layer is skipped for the whole step) and an early-exit loss through the shared LM "
        "head at the exits the curriculum enables each step, on LoRA factors of every projection (or the whole "
        "model with --lora-rank 0). The data are windows of the prompts followed by the model's own continuations "
        "(greedy, and sampled for some), and every position's target is the original model's next-token "
        "distribution (self-distillation), so full depth stays close to the original. Everything lives in "
        "--output: run the same command again to continue an interrupted run (--hours bounds one invocation). "
        "At the end it writes OUTPUT/model (an eejax checkpoint whose trained exits are the default check layers, "
        "with a reduced exit head) and OUTPUT/delta.safetensors (the LoRA factors).",
    )
    add_model_and_prompts(ls, "training texts", "eejax checkpoint directory or known model name (a Llama)")
    ls.add_argument("--output", required=True, metavar="DIR", help="the run directory (created; reused to resume)")
    ls.add_argument(
        "--skip",
        type=int,
        default=0,
        metavar="N",
        help="leave out the first N prompts (e.g. the rows you evaluate on; default 0)",
    )
    ls.add_argument("--hours", type=float, metavar="H", help="stop this invocation after H hours (resumable)")
    ls.add_argument("--steps", type=positive_int, default=600, help="optimizer steps of the whole run (default 600)")
    ls.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step (default 8)")
    ls.add_argument(
        "--learning-rate",
        type=float,
        default=2e-4,
        help="peak adam learning rate, 5%% warm-up then cosine to 10%% (default 2e-4)",
    )
    ls.add_argument(
        "--lora-rank",
        type=int,
        default=16,
        metavar="R",
        help="rank of the LoRA factors on every projection; 0 = full fine-tuning (default 16)",
    )
    ls.add_argument(
        "--exit-layers",
        type=layer_counts,
        action="extend",
        metavar="E,E,...",
        help="exits with an early-exit loss, as layers run, e.g. 8,15,22 (default: every layer)",
    )
    ls.add_argument("--p-max", type=float, default=0.1, help="layer dropout rate of the last layer (default 0.1)")
    ls.add_argument("--e-scale", type=float, default=0.2, help="early-exit loss scale e_scale (default 0.2)")
    ls.add_argument(
        "--curriculum",
        choices=("rotational", "gradual", "all"),
        default="rotational",
        help="which exits carry a loss each step (default rotational)",
    )
    ls.add_argument(
        "--rotation",
        type=positive_int,
        default=8,
        metavar="R",
        help="the rotational curriculum enables every R-th exit (default 8)",
    )
    ls.add_argument(
        "--exit-positions",
        type=int,
        default=64,
        metavar="P",
        help="positions per sequence of the early exits' losses, drawn each step; 0 = all (default 64)",
    )
    ls.add_argument(
        "--window",
        type=positive_int,
        default=192,
        metavar="T",
        help="prompt tokens per training sequence: consecutive windows of each text (default 192)",
    )
    ls.add_argument(
        "--windows-per-prompt",
        type=positive_int,
        default=4,
        metavar="N",
        help="at most N windows of each text (default 4)",
    )
    ls.add_argument(
        "--continuation-tokens",
        type=positive_int,
        default=64,
        metavar="N",
        help="tokens of the model's own continuation after each window (default 64)",
    )
    ls.add_argument(
        "--suffix",
        default="",
        metavar="TEXT",
        help="also train on the first window of each text followed by TEXT and the continuation, "
        "e.g. a summary request (bash: --suffix $'\\n\\nSummary:')",
    )
    ls.add_argument(
        "--sampled-every",
        type=int,
        default=2,
        metavar="K",
        help="every K-th window also gets a sampled continuation (temperature 0.8, top-p 0.95); "
        "0 = greedy only (default 2)",
    )
    ls.add_argument(
        "--top-k",
        type=positive_int,
        default=32,
        metavar="K",
        help="the teacher distribution kept per position: its K most likely tokens (default 32)",
    )
    ls.add_argument(
        "--exit-vocab-size",
        type=int,
        default=8192,
        metavar="K",
        help="reduced exit head of the K most frequent training tokens; 0 = none (default 8192)",
    )
    ls.add_argument("--save-every", type=positive_int, default=25, help="steps between checkpoints (default 25)")
    ls.add_argument(
        "--no-loss-plot",
        dest="loss_plot",
        action="store_false",
        help="do not write OUTPUT/loss.png (it needs matplotlib)",
    )
    ls.add_argument("--seed", type=int, default=0, help="seed of the data order, dropout and sampling (default 0)")
    ls.add_argument("--quiet", action="store_true", help="no progress bars")
    ls.set_defaults(func=cmd_train_layerskip)
