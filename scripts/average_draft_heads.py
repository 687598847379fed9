"""Averages draft heads' weights (a "model soup", `eejax.train.draft_average`) into one head:

    python scripts/average_draft_heads.py HEAD.safetensors HEAD.safetensors [...] \
        --weights 0.5 0.5 --vocab-from 2 --output AVERAGE.safetensors [--model smollm2-135m]

The heads must have the same shapes and be trained on the same base model (--model, which writes
the new head's probe). --vocab-from says whose reduced head's tokens the average drafts from
(1-based). How the shipped chat head was made: docs/models.md, its model card.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eejax.cli.parsing import OneLineErrorParser  # noqa: E402


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("heads", nargs="+", help="draft head deltas (eejax train-draft's draft.safetensors)")
    parser.add_argument("--weights", nargs="+", type=float, required=True, help="one per head, >= 0, summing to 1")
    parser.add_argument("--vocab-from", type=int, default=1, help="whose reduced-head tokens to keep (1-based)")
    parser.add_argument("--output", required=True, help="the averaged head's file (must not exist)")
    parser.add_argument("--model", default="smollm2-135m", help="the base model the heads were trained on")
    args = parser.parse_args(argv)
    if Path(args.output).exists():
        parser.error(f"{args.output} exists; choose another --output")
    for head in args.heads:
        if not Path(head).is_file():
            parser.error(f"no draft head file {head}")

    import eejax
    from eejax.errors import EejaxError
    from eejax.train.draft_average import average_draft_heads

    try:
        model = eejax.load(args.model, quantization=None)
        path = average_draft_heads(model, args.heads, args.weights, args.vocab_from - 1, args.output)
    except EejaxError as e:
        parser.error(str(e))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
