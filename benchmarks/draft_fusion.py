"""Does EAGLE-3's feature fusion raise a draft head's agreement? One run, two arms from the same
start, the same data, steps and seed:

- control: the shipped head (--init), trained further as it is;
- fused: the same head with `draft_head.fused_feature`: its first draft also reads the hidden
  states after --layers (1-based; EAGLE-3 takes a low, a middle and a late one), RMS-normalised,
  through a new [n·D, D] matrix that starts at zero (so it starts as the control does).

Training data: the first --answers of the model's own chat answers (--sequences-file, in a fixed
random order already) and the first --texts of --text-file, through one feature cache that keeps
those layers' states (`draft_features.build_feature_cache(layers=)`). Then the held-out agreement
of the start, the control and the fused head on each set of `benchmarks/eval_sets.py`, measured
as `benchmarks/draft_agreement.py` does (teacher-forced; the fused head's first draft reads the
states of the same layers). Resumable: the cache and both trainings checkpoint under --out.

    python benchmarks/draft_fusion.py --out runs/fusion [--answers 2000 --texts 60 --steps 600]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import eejax  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from benchmarks.draft_agreement import chain_tau, heldout_sequences  # noqa: E402
from benchmarks.eval_sets import SETS  # noqa: E402
from eejax.cli.draft import read_text_file  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.loading.deltas import apply_draft  # noqa: E402
from eejax.models import draft_head  # noqa: E402
from eejax.train.draft_features import build_feature_cache, load_feature_cache  # noqa: E402
from eejax.train.draft_training import heldout_agreement, train_draft  # noqa: E402
from eejax.train.token_sequences import load_sequences  # noqa: E402

CHAT_HEAD = "eejax/assets/smollm2-135m-eagle-chat.safetensors"


def training_sequences(model, args) -> list[list[int]]:
    answers, _ = load_sequences(args.sequences_file)
    texts = read_text_file(args.text_file)[: args.texts]
    return answers[: args.answers] + [model.tokenizer(t)["input_ids"] for t in texts]


def trained(model, data, arm: str, args):
    """`model` with its draft head trained on `data` (resumed from --out/ARM/checkpoints)."""
    settings = dict(steps=args.steps, batch_size=8, learning_rate=args.learning_rate, unroll=3, seed=args.seed)
    draft, losses, agree = train_draft(model, data, checkpoint_dir=Path(args.out) / arm / "checkpoints", **settings)
    log = {"loss_first_last": [float(losses[0]), float(losses[-1])] if len(losses) else None}
    log["top1_last_50"] = float(np.mean(agree[-50:, 0])) if len(agree) else None
    (Path(args.out) / arm / "log.json").write_text(json.dumps(log))
    return model.with_params({**model.params, "draft": draft}), log


def main() -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the run's directory (resumable)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--init", default=CHAT_HEAD, help=f"the head both arms start from (default {CHAT_HEAD})")
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="1-based layers fused (default 2 15 27)")
    parser.add_argument("--sequences-file", default="data/smollm2_chat_answers.npz")
    parser.add_argument("--answers", type=int, default=2000, help="answers trained on (the file's first)")
    parser.add_argument("--text-file", default="data/python_stdlib_text.txt.gz")
    parser.add_argument("--texts", type=int, default=60, help="texts of --text-file trained on (its first)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--feature-batch-size", type=int, default=8)
    parser.add_argument("--sets", nargs="+", action="extend", choices=SETS, default=None, help="default all")
    parser.add_argument("--rows", type=int, default=8, help="prompts per set")
    parser.add_argument("--positions", type=int, default=4)
    parser.add_argument("--name", default="draft_fusion", help="output name under benchmarks/out/")
    args = parser.parse_args()
    layers = tuple(args.layers or (2, 15, 27))
    plain = eejax.load(args.model, quantization=None)
    start = apply_draft(plain, args.init)
    cache = build_feature_cache(
        start,
        training_sequences(start, args),
        Path(args.out) / "features",
        batch_size=args.feature_batch_size,
        shard_rows=32,
        source=f"{args.answers} answers of {args.sequences_file}, {args.texts} texts of {args.text_file}",
        layers=layers,
    )
    data = load_feature_cache(cache)
    print(f"{len(data['lengths'])} windows, {int(data['lengths'].sum())} tokens", flush=True)
    fuse = draft_head.init_fuse(start.config, len(layers))
    fused_start = start.with_params({**start.params, "draft": {**start.params["draft"], "fuse": fuse}})
    heads = {"start": (start, None)}
    heads["control"] = trained(start, data, "control", args)
    heads["fused"] = trained(fused_start, data, "fused", args)
    del data
    rows, lines = [], ["| set | head | " + " | ".join(f"a{k + 1}" for k in range(args.positions)) + " | est. τ d=4 |"]
    lines.append("|" + "---|" * (args.positions + 3))
    for name in args.sets or list(SETS):
        sequences, first = heldout_sequences(plain, name, args.rows, 256, 64)
        with tempfile.TemporaryDirectory() as tmp:
            held = load_feature_cache(build_feature_cache(plain, sequences, tmp, progress=False, layers=layers))
        for head, (model, log) in heads.items():
            agree = heldout_agreement(model, held, unroll=args.positions, first=first)
            rows.append({"set": name, "head": head, "agreement": [round(float(a), 4) for a in agree], "train": log})
            cells = " | ".join(f"{a:.3f}" for a in agree)
            lines.append(f"| {name} | {head} | {cells} | {chain_tau(agree, 4):.2f} |")
        print(lines[-3:], flush=True)
    print("\n".join(lines))
    settings = {k: v for k, v in vars(args).items() if k != "name"} | {"layers": list(layers)}
    write_result(args.name, {"settings": settings, "rows": rows, "table": "\n".join(lines)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
