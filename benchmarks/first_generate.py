"""The time of a fresh process's first `eejax.generate` (compilation included) on SmolLM2-135M,
per layer layout, with JAX's persistent compilation cache off (a first run) and on and warm (a
later one: what the eejax commands get, `eejax.compile_cache`). Each measurement is its own
process; prints the seconds and each layout's ratio to the stacked layout's, and the same
generate again once every background compilation has ended ("auto" on a CPU: stacked steps
while the split program compiles, `Model.compiles_split_later`).

    python benchmarks/first_generate.py [--layouts stacked split auto] [--batch 1] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import write_result  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402

CHILD = r"""
import json, sys, time
sys.path.insert(0, {root!r})
import eejax
from benchmarks.common import cnndm_prompts
model = eejax.load("smollm2-135m", layer_buffers={layout!r}, quantization=None)
prompts = cnndm_prompts(model.tokenizer, {batch}, 256)
start = time.perf_counter()
eejax.generate(model, prompts, max_new_tokens={new_tokens}, ignore_eos=True)
first = time.perf_counter() - start
compile_s = model.programs.compile_seconds
model.programs.wait()
start = time.perf_counter()
eejax.generate(model, prompts, max_new_tokens={new_tokens}, ignore_eos=True)
print("RESULT" + json.dumps(dict(first_s=first, compile_s=compile_s, then_s=time.perf_counter() - start,
                                 background_s=model.programs.background_seconds,
                                 programs=model.programs.num_programs)))
"""


def first_generate(layout: str, batch: int, new_tokens: int, cache_dir: str | None) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, EEJAX_BACKGROUND_COMPILE="on")  # what a user's process gets
    if cache_dir is None:
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    else:
        env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    code = CHILD.format(root=root, layout=layout, batch=batch, new_tokens=new_tokens)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.split("RESULT", 1)[1])


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", action="extend", choices=("stacked", "split", "auto"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    layouts = list(dict.fromkeys(args.layouts or ["stacked", "split", "auto"]))
    if "stacked" not in layouts:
        layouts.insert(0, "stacked")
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        for layout in layouts:
            cold = first_generate(layout, args.batch, args.new_tokens, None)
            first_generate(layout, args.batch, args.new_tokens, cache_dir)  # fills the cache
            warm = first_generate(layout, args.batch, args.new_tokens, cache_dir)
            rows.append(dict(layout=layout, cold=cold, warm=warm))
    base = rows[0]
    for row in rows:
        cold, warm = row["cold"], row["warm"]
        print(
            f"{row['layout']:8s} first generate: cold {cold['first_s']:5.1f} s "
            f"({cold['first_s'] / base['cold']['first_s']:.2f}x stacked; compile {cold['compile_s']:.1f} s, "
            f"{cold['programs']} programs, {cold['background_s']:.1f} s in the background), warm cache "
            f"{warm['first_s']:5.1f} s ({warm['first_s'] / base['warm']['first_s']:.2f}x stacked); "
            f"then {cold['then_s']:.2f} s ({cold['then_s'] / base['cold']['then_s']:.2f}x stacked)",
            flush=True,
        )
    print(f"wrote {write_result('first_generate', dict(batch=args.batch, new_tokens=args.new_tokens, rows=rows))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
