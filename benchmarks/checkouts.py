"""Two checkouts of eejax (a change and what it changes, e.g. a `git worktree` of the commit
before) timed against each other on the default load, paired: each checkout runs in its own
process (its own kernel library: two builds cannot share one process), both load the model and
warm up, then they take turns, one round each, the order alternating, and each round's ratio
is new / old. Prints every round and the median ratio of decode and end-to-end tokens/s. On a
machine whose speed drifts by 10-40% between minutes (a VM's memory bandwidth, shared), a
difference of a few percent shows only this way: one `eejax bench` per checkout does not.

    git worktree add /tmp/before HEAD~1
    python benchmarks/checkouts.py --old /tmp/before [--new .] [--data chat] [--batch 1] [--rounds 8]

A round is every prompt once (--prompts, batches of --batch rows), greedy, --new-tokens each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import write_result  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402

ROUND = "go"


def serve_rounds(data: str, batch: int, prompts: int, new_tokens: int, layer_buffers: str) -> None:
    """The side of one checkout (run with that checkout first on sys.path): loads, warms up, says
    "ready", then answers each line on stdin with a round's [decode tok/s, end-to-end tok/s]."""
    import eejax
    from eejax.bench.prompts import bench_prompts

    model = eejax.load("smollm2-135m", layer_buffers=layer_buffers)
    ids = bench_prompts(model.tokenizer, data, prompts, 256).ids

    def one_round() -> tuple[float, float]:
        tokens = decode_s = run_s = 0.0
        for i in range(0, len(ids), batch):
            result = eejax.generate(model, ids[i : i + batch], max_new_tokens=new_tokens, ignore_eos=True)
            tokens += sum(len(t) for t in result.tokens)
            decode_s += result.stats.run_s - result.stats.prefill_s
            run_s += result.stats.run_s
        return tokens / decode_s, tokens / run_s

    one_round()  # compiles
    print("ready", flush=True)
    for _ in sys.stdin:
        print(json.dumps(one_round()), flush=True)


def start(checkout: Path, args) -> subprocess.Popen:
    side = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--serve",
        *("--data", args.data, "--batch", str(args.batch), "--prompts", str(args.prompts)),
        *("--new-tokens", str(args.new_tokens), "--layer-buffers", args.layer_buffers),
    ]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    proc = subprocess.Popen(
        side, cwd=checkout, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    raise SystemExit(f"the checkout at {checkout} did not start (run its side alone to see why: --serve)")


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, help="the checkout to compare against (its repository root)")
    parser.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[1], help="default: this one")
    parser.add_argument("--data", default="chat", help="bench_prompts' set: chat, code, pydoc or a .jsonl")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--layer-buffers", default="split", choices=["split", "stacked", "auto"])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # one checkout's side
    args = parser.parse_args(argv)
    if min(args.batch, args.prompts, args.rounds) < 1 or args.new_tokens < 2:
        parser.error("--batch, --prompts and --rounds must be >= 1 and --new-tokens >= 2")
    if args.serve:
        serve_rounds(args.data, args.batch, args.prompts, args.new_tokens, args.layer_buffers)
        return 0
    if args.old is None:
        parser.error("give --old, the checkout to compare against")
    for checkout in (args.old, args.new):
        if not (checkout / "eejax" / "__init__.py").exists():
            parser.error(f"{checkout} is not an eejax checkout (no eejax/__init__.py)")
    sides = {"old": start(args.old.resolve(), args), "new": start(args.new.resolve(), args)}
    rounds = []
    try:
        for r in range(args.rounds):
            got = {}
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                sides[name].stdin.write(ROUND + "\n")
                sides[name].stdin.flush()
                got[name] = json.loads(sides[name].stdout.readline())
            rounds.append(dict(old=got["old"], new=got["new"]))
            print(
                f"round {r}: decode tok/s old {got['old'][0]:6.1f} new {got['new'][0]:6.1f} "
                f"({got['new'][0] / got['old'][0]:.3f}x)",
                flush=True,
            )
    finally:
        for proc in sides.values():
            proc.kill()
    decode = statistics.median(r["new"][0] / r["old"][0] for r in rounds)
    end_to_end = statistics.median(r["new"][1] / r["old"][1] for r in rounds)
    print(
        f"{args.data} batch {args.batch}: new / old, median of {len(rounds)} rounds: "
        f"decode {decode:.3f}x, end to end {end_to_end:.3f}x"
    )
    path = write_result(
        "checkouts",
        dict(old=str(args.old), new=str(args.new), data=args.data, batch=args.batch, rounds=rounds)
        | dict(decode_ratio=decode, end_to_end_ratio=end_to_end),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
