"""Held-out acceptance of draft heads, without decoding: on each evaluation set of
`benchmarks/eval_sets.py` (--sets; default cnndm: rows 0..N-1 of data/cnndm_test_dev100.jsonl,
never trained on, each row's first --prompt-tokens tokens + "Summary:"), the model's
--new-tokens greedy tokens after each prompt (EOS ignored on cnndm and pydoc; a chat answer ends
at its EOS); the teacher-forced top-1
agreement of each draft position with the model's next token over the generated tokens
(`draft_training.heldout_agreement`: position k reads the draft's own features of the k - 1
before it). From it, the tokens per round a chain of d drafts would give if positions were
accepted independently: 1 + a1 + a1·a2 + ... (an estimate; benchmarks/draft_head.py measures τ).
Every head is measured on the same sequences and features, in one run.

    python benchmarks/draft_agreement.py [--heads eejax/assets/smollm2-135m-eagle.safetensors NEW.safetensors] \
        [--sets cnndm mtbench pydoc code chat] [--rows 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import eejax  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from benchmarks.eval_sets import SETS, prompts  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.loading.deltas import apply_draft  # noqa: E402
from eejax.train.draft_features import build_feature_cache, load_feature_cache  # noqa: E402
from eejax.train.draft_training import heldout_agreement  # noqa: E402

EVAL_ROWS = 20
SHIPPED = "eejax/assets/smollm2-135m-eagle.safetensors"


def chain_tau(agreement, d: int) -> float:
    """1 + a1 + a1·a2 + ... + a1···ad: tokens per round of d drafts, positions independent."""
    return float(1 + np.sum(np.cumprod(agreement[:d])))


def heldout_sequences(model, name: str, rows: int, prompt_tokens: int, new_tokens: int):
    """(the set's first `rows` prompts followed by the model's greedy tokens, the index of each
    one's first generated token): what agreement is measured on."""
    asked = prompts(model.tokenizer, name, rows, prompt_tokens)
    res = eejax.generate(model, asked, max_new_tokens=new_tokens, ignore_eos=name in ("cnndm", "pydoc"), spec=None)
    return [list(p) + list(t) for p, t in zip(asked, res.tokens)], [len(p) for p in asked]


def main() -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", action="extend", default=None, help=f"draft deltas (default {SHIPPED})")
    parser.add_argument("--model", default="smollm2-135m", help="the base model")
    parser.add_argument("--sets", nargs="+", action="extend", choices=SETS, default=None, help="default cnndm")
    parser.add_argument("--rows", type=int, default=EVAL_ROWS, help=f"prompts per set (at most {EVAL_ROWS})")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--positions", type=int, default=4, help="draft positions measured (default 4)")
    parser.add_argument("--name", default="draft_agreement", help="output name under benchmarks/out/")
    args = parser.parse_args()
    if not 1 <= args.rows <= EVAL_ROWS:
        parser.error(f"--rows must be 1 to {EVAL_ROWS}: only CNN/DM rows 0..{EVAL_ROWS - 1} are held out of training")
    heads = args.heads or [SHIPPED]
    model = eejax.load(args.model, quantization=None)
    rows, lines = [], []
    header = "| set | head | " + " | ".join(f"a{k + 1}" for k in range(args.positions)) + " | est. τ d=2 | est. τ d=4 |"
    lines += [header, "|" + "---|" * (args.positions + 4)]
    for name in args.sets or ["cnndm"]:
        sequences, first = heldout_sequences(model, name, args.rows, args.prompt_tokens, args.new_tokens)
        with tempfile.TemporaryDirectory() as tmp:
            data = load_feature_cache(build_feature_cache(model, sequences, tmp, progress=False))
        for head in heads:
            agree = heldout_agreement(apply_draft(model, head), data, unroll=args.positions, first=first)
            row = {"set": name, "head": head, "agreement": [round(float(a), 4) for a in agree]}
            row |= {"chain_tau_d2": round(chain_tau(agree, 2), 3), "chain_tau_d4": round(chain_tau(agree, 4), 3)}
            rows.append(row)
            cells = " | ".join(f"{a:.3f}" for a in agree)
            lines.append(f"| {name} | {head} | {cells} | {row['chain_tau_d2']:.2f} | {row['chain_tau_d4']:.2f} |")
    print("\n".join(lines))
    settings = {k: getattr(args, k) for k in ("model", "sets", "rows", "prompt_tokens", "new_tokens", "positions")}
    write_result(args.name, {"settings": settings, "rows": rows, "table": "\n".join(lines)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
