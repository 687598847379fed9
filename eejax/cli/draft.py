"""`eejax train-draft`: a draft head (EAGLE) trained on a frozen model's cached features."""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

from eejax.cli.args import add_model_and_prompts, positive_int, prompts_from_args
from eejax.errors import EejaxError
from eejax.train.draft_run import SAMPLED_PROMPTS


def read_text_file(path: str) -> list[str]:
    """Texts of a .txt or .txt.gz file, separated by two or more blank lines (or the whole file)."""
    p = Path(path)
    if not p.is_file():
        raise EejaxError(f"text file not found: {path}")
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        text = f.read()
    texts = [t.strip() for t in text.split("\n\n\n") if t.strip()]
    if not texts:
        raise EejaxError(f"no text in {path}")
    return texts


def prompt_lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected prompt lengths like 128,256,384, got {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"prompt lengths must be >= 1, got {text!r}")
    return lengths


def cmd_train_draft(args: argparse.Namespace) -> int:
    import numpy as np

    import eejax
    from eejax.loading.deltas import apply_draft
    from eejax.models import draft_head
    from eejax.train.chat_corpus import read_instructions
    from eejax.train.draft_run import DraftRunSettings, draft_vocabulary, save_draft, training_data
    from eejax.train.draft_training import train_draft
    from eejax.train.exit_vocab import add_exit_vocab
    from eejax.train.token_sequences import load_sequences

    settings = DraftRunSettings(
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        noise=args.noise,
        feature_weight=args.feature_weight,
        unroll=args.unroll,
        seed=args.seed,
        window=args.window,
        continuation_tokens=args.continuation_tokens,
        prompt_tokens=args.prompt_lengths,
        window_prompts=args.window_prompts,
        sampled_copies=args.sampled_copies,
        sampled_prompts=args.sampled_prompts,
        vocab_size=args.vocab_size,
        self_questions=args.self_questions,
        answer_tokens=args.answer_tokens,
        answer_samples=args.answer_samples,
    )
    if args.learning_rate <= 0 or min(args.noise, args.feature_weight, args.sampled_copies) < 0:
        raise EejaxError("--learning-rate must be > 0, --noise, --feature-weight and --sampled-copies >= 0")
    if args.self_questions < 0 or args.answer_samples < 0:
        raise EejaxError("--self-questions and --answer-samples must be >= 0")
    if args.hours is not None and not 0 < args.hours < float("inf"):
        raise EejaxError(f"--hours must be a positive number, got {args.hours}")
    given = args.prompt is not None or args.prompts_file is not None
    texts = prompts_from_args(argparse.Namespace(**{**vars(args), "limit": None}))[args.skip :][: args.limit]
    if given and not texts:
        raise EejaxError(f"no texts left after --skip {args.skip}")
    other = [t for path in args.text_file or [] for t in read_text_file(path)]
    questions = [q for path in args.instructions_file or [] for q in read_instructions(path)]
    sequences, made = [], []
    for path in args.sequences_file or []:
        seqs, how = load_sequences(path)
        sequences, made = sequences + seqs, made + how
    if not (texts or other or questions or sequences or args.self_questions):
        raise EejaxError(
            "nothing to train on: give texts (--prompts-file or --prompt), --text-file, --instructions-file, "
            "--sequences-file or --self-questions"
        )
    if args.init is not None and not Path(args.init).is_file():
        raise EejaxError(f"--init: no such draft head file: {args.init}")
    run = {
        "model": str(args.model),
        "settings": settings.to_json(),
        "skip": args.skip,
        "limit": args.limit,
        "texts": args.prompts_file or ("--prompt" if args.prompt else None),
        "text_files": args.text_file or [],
        "instructions_files": args.instructions_file or [],
        "init": args.init,
    }
    if args.sequences_file:  # only where given: a run started before the option resumes as it was
        run["sequences_files"] = args.sequences_file
    out = Path(args.output).expanduser()
    run_file = out / "run.json"
    if run_file.exists():
        before = json.loads(run_file.read_text())
        if before != run:
            changed = sorted(k for k in run if before.get(k) != run[k])
            raise EejaxError(
                f"{out} holds a run started with other settings ({', '.join(changed)}); repeat its "
                f"command (see {run_file}) or choose another --output"
            )
    elif out.exists() and any(out.iterdir()):
        raise EejaxError(f"{out} exists and is not a draft-head run directory; choose another --output")
    if args.plot:
        from eejax.train.plot import _pyplot

        _pyplot()  # a missing matplotlib is named before the long work
    model = eejax.load(args.model, quantization=None)  # features and answers of the float32 weights
    draft_head.check_model(model.config)
    settings.check(model.config.vocab_size)
    past = max((max(s) for s in sequences if s), default=-1)
    if past >= model.config.vocab_size:
        vocab = model.config.vocab_size
        raise EejaxError(f"--sequences-file holds token id {past}, past {args.model}'s vocabulary of {vocab}")
    if model.tokenizer is None:
        raise EejaxError(f"{args.model} has no tokenizer to read the texts with")
    out.mkdir(parents=True, exist_ok=True)
    run_file.write_text(json.dumps(run, indent=2) + "\n")
    base = model.with_params({k: v for k, v in model.params.items() if k not in ("draft", "exits")})
    data = training_data(
        base,
        texts,
        other,
        out,
        settings,
        progress=not args.quiet,
        generate_batch_size=args.generate_batch_size,
        feature_batch_size=args.feature_batch_size,
        questions=questions,
        sequences=sequences,
    )
    ids = draft_vocabulary(data, settings.vocab_size, model.config.vocab_size, always=model.eos_token_ids)
    trainee = add_exit_vocab(model, ids)
    if args.init is not None:  # go on from a trained head (the reduced head's tokens are this data's)
        trainee = trainee.with_params({**trainee.params, "draft": apply_draft(model, args.init).params["draft"]})
    started = time.perf_counter()
    draft, losses, agree = train_draft(
        trainee,
        data,
        steps=settings.steps,
        batch_size=settings.batch_size,
        learning_rate=settings.learning_rate,
        noise=settings.noise,
        feature_weight=settings.feature_weight,
        unroll=settings.unroll,
        seed=settings.seed,
        hours=args.hours,
        checkpoint_dir=out / "checkpoints",
        save_every=args.save_every,
        progress=not args.quiet,
    )
    hours = (time.perf_counter() - started) / 3600
    if args.plot and len(losses):
        from eejax.train.plot import save_draft_plot

        save_draft_plot(losses, agree, out / "training.png")
    if len(losses) < settings.steps:
        print(
            f"stopped after {hours:.2f} h at step {len(losses)} of {settings.steps}; run the same command again "
            f"to continue from {out / 'checkpoints'}"
        )
        return 0
    trained = trainee.with_params({**trainee.params, "draft": draft})
    tokens = int(data["lengths"].sum())
    delta = save_draft(
        out / "draft.safetensors",
        trained,
        ids,
        {
            "base": str(args.model),
            "settings": settings.to_json(),
            "training_tokens": tokens,
            "data": {
                "texts": run["texts"],
                "skip": args.skip,
                "limit": args.limit,
                "text_files": run["text_files"],
                "instructions_files": run["instructions_files"],
                "self_questions": settings.self_questions,
                "sequences": made,
                "init": run["init"],
            },
            "top1_agreement_last_100": [float(x) for x in np.mean(agree[-100:], axis=0)],
        },
    )
    shipped = apply_draft(model, delta)  # the bf16 head as loading it gives it, its probe checked
    eejax.save(shipped, out / "model", overwrite=True, metadata={"draft_head": str(delta)})
    k = min(100, len(losses))
    print(
        f"trained {settings.steps} steps on {tokens} cached tokens; loss {np.mean(losses[:k]):.3f} -> "
        f"{np.mean(losses[-k:]):.3f}, top-1 agreement {np.mean(agree[:k, 0]):.2f} -> {np.mean(agree[-k:, 0]):.2f} "
        f"(first / last {k} steps); draft head {delta}, model {out / 'model'}"
    )
    return 0


def add_parsers(sub) -> None:
    """Adds `train-draft` to the `eejax` subparsers."""
    p = sub.add_parser(
        "train-draft",
        help="train a draft head (EAGLE) on a frozen model's cached features, resumable",
        description="Train a small draft head for lossless speculative decoding (spec draft:d): one fully connected "
        "layer over [next token's embedding, the model's feature] and one decoder layer, drafting through the "
        "model's own head (its reduced-vocabulary version). The model stays frozen: one pass over the training "
        "text caches its features and next-token distributions on disk, then only the draft head trains on them "
        "(soft cross-entropy to the model's distribution, a feature regression, input noise and a second pass on "
        "its own predictions). The text is the --prompts-file texts (after --skip), the model's greedy "
        "continuations of summary prompts made from them, any --text-file, and the model's own answers (greedy and "
        "sampled) to chat questions: those of --instructions-file and --self-questions that it writes itself, "
        "and any --sequences-file of its text made beforehand. "
        "Everything lives in --output: run "
        "the same command again to continue (--hours bounds one invocation). At the end it writes "
        "OUTPUT/draft.safetensors (the head, small, with a probe checked at load) and OUTPUT/model.",
    )
    add_model_and_prompts(
        p, "training texts (news articles, say)", "eejax checkpoint directory or known model name", required=False
    )
    p.add_argument("--output", required=True, metavar="DIR", help="the run directory (created; reused to resume)")
    p.add_argument(
        "--skip",
        type=int,
        default=0,
        metavar="N",
        help="leave out the first N texts (the rows you evaluate on; default 0)",
    )
    p.add_argument(
        "--text-file",
        action="append",
        metavar="F.txt[.gz]",
        help="more training text, documents separated by two blank lines (repeatable)",
    )
    p.add_argument(
        "--instructions-file",
        action="append",
        metavar="F.jsonl",
        help="chat questions, one JSON object per line (instruction, and input or context if any), which the "
        "model answers through its chat template (repeatable)",
    )
    p.add_argument(
        "--sequences-file",
        action="append",
        metavar="F.npz",
        help="token sequences the model wrote beforehand, trained on as they are: scripts/gpu_train_draft.py "
        "answer's answers (data/smollm2_chat_answers.npz) or its run's continuations.npz (repeatable)",
    )
    p.add_argument(
        "--self-questions",
        type=int,
        default=0,
        metavar="N",
        help="sample N user questions from the model's own chat template (the questions it was tuned on: "
        "Magpie) and train on its answers to those that it finished (default 0 = none)",
    )
    p.add_argument(
        "--answer-tokens",
        type=positive_int,
        default=160,
        metavar="N",
        help="tokens of each answer to a chat question; it may end sooner (default 160)",
    )
    p.add_argument(
        "--answer-samples",
        type=int,
        default=1,
        metavar="N",
        help="sampled answers (temperature 0.7) per chat question besides the greedy one (default 1; 0 = none)",
    )
    p.add_argument("--init", metavar="DRAFT.safetensors", help="a draft head delta to go on training from")
    p.add_argument("--hours", type=float, metavar="H", help="stop this invocation after H hours (resumable)")
    p.add_argument("--steps", type=positive_int, default=3000, help="optimizer steps of the whole run (default 3000)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="windows per step (default 8)")
    p.add_argument(
        "--learning-rate",
        type=float,
        default=1e-3,
        help="peak adamw learning rate, warm-up then cosine to 0 (default 1e-3)",
    )
    p.add_argument(
        "--noise",
        type=float,
        default=0.1,
        help="uniform noise on the input features, times their RMS (default 0.1; 0 = off)",
    )
    p.add_argument(
        "--feature-weight", type=float, default=0.1, help="weight of the feature regression (default 0.1; 0 = off)"
    )
    p.add_argument(
        "--unroll",
        type=int,
        choices=(1, 2, 3),
        default=2,
        help="passes per step, each after the first on the draft's own predictions (default 2)",
    )
    p.add_argument("--window", type=positive_int, default=512, help="tokens per cached window (default 512)")
    p.add_argument(
        "--continuation-tokens",
        type=int,
        default=96,
        metavar="N",
        help="greedy tokens of the model after each summary prompt (default 96; 0 = no continuations)",
    )
    p.add_argument(
        "--prompt-lengths",
        type=prompt_lengths,
        default=(128, 256, 384),
        metavar="N,N,...",
        help="summary prompts: the first N tokens of each text + 'Summary:' (default 128,256,384)",
    )
    p.add_argument(
        "--no-window-prompts",
        dest="window_prompts",
        action="store_false",
        help="only the summary prompts of --prompt-lengths: no later article windows, no windows of the "
        "--text-file documents continued",
    )
    p.add_argument(
        "--sampled-copies",
        type=int,
        default=2,
        metavar="N",
        help="sampled continuations (temperature 0.7) of each 256-token summary prompt (default 2; 0 = none)",
    )
    p.add_argument(
        "--sampled-prompts",
        choices=SAMPLED_PROMPTS,
        default="summary",
        help="which prompts --sampled-copies continues: the 256-token summary prompts (default) or all the "
        "greedily continued ones (later article windows and document windows too: more varied data)",
    )
    p.add_argument(
        "--generate-batch-size",
        type=positive_int,
        default=32,
        metavar="N",
        help="prompts continued at once (default 32; speed only: a GPU takes hundreds)",
    )
    p.add_argument(
        "--feature-batch-size",
        type=positive_int,
        default=4,
        metavar="N",
        help="windows per pass of the frozen model when caching features (default 4; speed only, but a "
        "resumed run keeps the cache's shards: give the same N)",
    )
    p.add_argument(
        "--vocab-size",
        type=positive_int,
        default=8192,
        help="tokens the draft proposes from: the most frequent of the data (default 8192)",
    )
    p.add_argument("--save-every", type=positive_int, default=100, help="steps between checkpoints (default 100)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="do not write OUTPUT/training.png")
    p.add_argument("--seed", type=int, default=0, help="seed of the batches and the noise (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_train_draft)
