"""A decoder layer in one CPU call (`kernels.cpu_layer`) against the same layer op by op, on the
default load (SmolLM2-135M's GGUF blocks, int16 activations, per-layer buffers), in one process:
two copies of the model, one whose programs trace with the one-call layer switched off
(`llama._in_one_call` patched to refuse while it traces), timed paired as `eejax bench` times
settings (the op-by-op runs are the peer). Prints decode and end-to-end speed and their ratio per
set and batch (decode and end to end each timed paired), checks the tokens are the same, and
times each copy's first generate (its programs compiled: a script runs without JAX's persistent
cache).

--max-rows lets the call take steps of more rows than `cpu_layer.MAX_ROWS` (as the kernel can, up
to 64), to measure what that limit avoids. --layer-buffers stacked times the stacked layout's loop
instead (a traced layer index: op by op slices each layer's weights out of the stack; the call
reads the stack in place, up to `cpu_layer.MAX_STACKED_ROWS` rows).

    python benchmarks/cpu_layer.py [--sets chat pydoc news] [--batches 1] [--max-rows N] [--repeats 3]
                                   [--layer-buffers split|stacked]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eejax  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from eejax.bench.paired import paired_runs  # noqa: E402
from eejax.bench.prompts import bench_prompts  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.kernels import cpu_layer  # noqa: E402
from eejax.models import llama  # noqa: E402

SETS = {  # name -> bench_prompts' data and suffix
    "chat": ("chat", ""),
    "code": ("code", ""),
    "pydoc": ("pydoc", ""),
    "news": ("data/cnndm_test_dev100.jsonl", "\n\nSummary:"),
}


class OpByOp:
    """While in it, `llama.decoder_layer` never takes the one-call layer (programs traced then keep it)."""

    def __enter__(self):
        self.kept = llama._in_one_call
        llama._in_one_call = lambda *args: False

    def __exit__(self, *exc):
        llama._in_one_call = self.kept


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", nargs="+", choices=sorted(SETS), default=["chat", "pydoc", "news"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1])
    parser.add_argument(
        "--max-rows", type=int, default=cpu_layer.MAX_ROWS, help="rows a step may have to take the call"
    )
    parser.add_argument("--layer-buffers", choices=["split", "stacked"], default="split")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.new_tokens < 2 or args.repeats < 1 or min(args.batches) < 1:
        parser.error("--prompts, --repeats and --batches must be >= 1 and --new-tokens >= 2")
    if not 1 <= args.max_rows <= 64:
        parser.error("--max-rows must be 1 to 64 (the kernel's limit)")
    cpu_layer.MAX_ROWS = args.max_rows

    models = {"one call": eejax.load("smollm2-135m", layer_buffers=args.layer_buffers)}
    models["op by op"] = eejax.load("smollm2-135m", layer_buffers=args.layer_buffers)
    rows, first_s = [], {}
    for set_name in args.sets:
        data, suffix = SETS[set_name]
        prompts = bench_prompts(models["one call"].tokenizer, data, args.prompts, 256, suffix=suffix).ids
        for batch in args.batches:

            def run(which, batch=batch, prompts=prompts):
                model = models["op by op" if which is None else "one call"]
                with OpByOp() if which is None else contextlib.nullcontext():
                    return merged(
                        eejax.generate(model, prompts[i : i + batch], max_new_tokens=args.new_tokens, ignore_eos=True)
                        for i in range(0, len(prompts), batch)
                    )

            if not first_s:  # each copy's first generate compiles its programs
                for which in ("one call", None):
                    start = time.perf_counter()
                    run(which)
                    first_s[which or "op by op"] = time.perf_counter() - start
            timed = paired_runs(run, ["one call"], args.repeats)
            row = dict(set=set_name, batch=batch, same_tokens=timed.last(0)["tokens"] == timed.last(None)["tokens"])
            for measure in ("decode_tokens_per_s", "tokens_per_s"):
                speed = lambda r, m=measure: r["stats"][m]  # noqa: E731
                row[measure], row[f"op_by_op_{measure}"] = timed.speed(0, speed), timed.speed(None, speed)
                row[f"{measure}_ratio"] = timed.ratio(0, speed)
            rows.append(row)
            print(
                f"{set_name:6s} b{batch}: decode {row['decode_tokens_per_s']:6.1f} tok/s one call, "
                f"{row['op_by_op_decode_tokens_per_s']:6.1f} op by op ({row['decode_tokens_per_s_ratio']:.3f}x); "
                f"end to end {row['tokens_per_s_ratio']:.3f}x{'' if row['same_tokens'] else '  TOKENS DIFFER'}",
                flush=True,
            )
    print("first generate, programs compiled: " + ", ".join(f"{k} {v:.1f} s" for k, v in first_s.items()))
    path = write_result(
        "cpu_layer",
        dict(
            rows=rows,
            first_generate_s=first_s,
            repeats=args.repeats,
            max_rows=args.max_rows,
            layer_buffers=args.layer_buffers,
        ),
    )
    print(f"wrote {path}")
    return 0


def merged(results) -> dict:
    """Tokens and speeds of several generates (a set's batches) as one run's."""
    results = list(results)
    tokens = [t for r in results for t in r.tokens]
    n = sum(len(t) for t in tokens)
    decode_s = sum(r.stats.run_s - r.stats.prefill_s for r in results)
    run_s = sum(r.stats.run_s for r in results)
    return dict(tokens=tokens, stats=dict(decode_tokens_per_s=n / decode_s, tokens_per_s=n / run_s))


if __name__ == "__main__":
    sys.exit(main())
