"""Where a decode step's and a speculation round's time goes on a GPU: the engine's speed, each
program alone, and profiler traces of the engine, for full depth and draft-head speculation.

    python benchmarks/gpu_profile.py [--model smollm2-135m-eagle] [--dtype float32] [--batch 1]
        [--specs draft:2 draft:4 draft:4:lookup] [--layer-buffers stacked split]
        [--parts engine programs traces] [--trace-dir DIR] [--seconds 300] [--random-like DIR]

For each --layer-buffers layout, in the order of --parts (each skipped once --seconds are spent):
- engine: `eejax.generate` decode tokens/s of full depth and of each spec and exit, paired with full depth
  (`paired_runs`; 256-token summary prompts, --new-tokens, EOS ignored), the rounds, tokens per
  round and milliseconds per round, and whether the tokens equal full depth's;
- programs: one full-depth step, one 4-step dispatch and one round of each spec, each a single
  jitted program timed alone, blocking after it (`round_costs`): the device's work plus one launch;
- traces: one `jax.profiler` trace of short engine runs of full depth and of each spec (the
  .xplane.pb goes to --trace-dir), summarised per engine step (a dispatch of full depth's steps
  or a round): device kernels and copies and their busy time, and the host events that took
  longest.
`--random-like DIR` (a checkpoint's eejax.json and tokenizer/, no weights) runs random weights
with the shipped draft head (SmolLM2's, whatever --model says): the timings hold, the acceptance
does not. It runs on a CPU too, to try it out; its numbers mean something on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import eejax  # noqa: E402
from benchmarks.common import decoding_options, paired_runs, write_result  # noqa: E402
from benchmarks.early_exit import summary_prompts  # noqa: E402
from benchmarks.round_costs import median_seconds, prefilled, setting_programs, steps_program  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.options import SpecConfig  # noqa: E402

PARTS = ("engine", "programs", "traces")


def load(args, layer_buffers: str):
    if args.random_like is None:
        return eejax.load(args.model, dtype=jnp.dtype(args.dtype), layer_buffers=layer_buffers)
    from transformers import AutoTokenizer

    from eejax.checkpoint import read_config, read_metadata
    from eejax.loading.deltas import apply_delta
    from eejax.loading.hub import ASSETS
    from eejax.loading.model import Model, cast_floats
    from eejax.models.llama import init_params

    config = read_config(args.random_like, read_metadata(args.random_like))
    tokenizer = AutoTokenizer.from_pretrained(str(Path(args.random_like) / "tokenizer"))
    model = Model(config, init_params(config, jax.random.PRNGKey(0)), tokenizer, layer_buffers=layer_buffers)
    model = apply_delta(model, ASSETS / "smollm2-135m-eagle.safetensors", check=False)
    return model.with_params(cast_floats(model.params, jnp.dtype(args.dtype)))


def engine_part(model, prompts, args) -> list[dict]:
    settings = [*args.specs, *(f"exit:{e}" for e in args.exits)]

    def run(setting, new_tokens=args.new_tokens):
        kw = decoding_options(setting)
        return eejax.generate(model, prompts, max_new_tokens=new_tokens, ignore_eos=True, **kw)

    paired = paired_runs(run, settings, args.repeats)
    full = paired.peer.stats
    rows = [dict(setting="full depth", tok_s=paired.peer_speed, ms_per_step=_ms_per_step(full))]
    for spec, speed, ratio, result in zip(settings, paired.speeds, paired.speedups, paired.results):
        s = result.stats
        rounds = s.rounds or 1
        rows.append(
            dict(
                setting=spec,
                tok_s=speed,
                speedup=ratio,
                tokens_per_round=s.tokens_per_round,
                ms_per_round=1e3 * (s.run_s - s.prefill_s) / rounds,
                layers_per_token=s.mean_layers_per_token,
                engine_steps=s.engine_steps,
                identical=result.tokens == paired.peer.tokens,
                **agreement(result.tokens, paired.peer.tokens),
            )
        )
    for r in rows:
        print("  engine", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    return rows


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """How far each row's tokens follow the reference's (full depth's, same dtype): the rows equal
    to it, and the share of a row's tokens before its first difference, over all rows."""

    def followed(row, ref):
        return next((i for i, (a, b) in enumerate(zip(row, ref)) if a != b), min(len(row), len(ref)))

    rows_equal = sum(row == ref for row, ref in zip(tokens, reference))
    before = sum(followed(row, ref) for row, ref in zip(tokens, reference))
    return dict(rows_equal=rows_equal, rows=len(reference), shared=before / max(sum(map(len, reference)), 1))


def _ms_per_step(stats) -> float:
    return 1e3 * (stats.run_s - stats.prefill_s) / max(stats.engine_steps, 1)


def programs_part(model, prompts, args) -> dict[str, float]:
    state, cache, table = prefilled(model, prompts, 64)
    programs = setting_programs(model, [SpecConfig.parse(s) for s in args.specs], state, table, len(prompts))
    programs["4-step dispatch"] = (steps_program(model.config, table, 4), state)
    ms = {name: 1e3 * s for name, s in median_seconds(programs, model.run_params, cache, args.repeats * 5).items()}
    for name, v in ms.items():
        print(f"  program {name}: {v:.3f} ms", flush=True)
    return ms


def traces_part(model, prompts, args, tag: str) -> dict:
    """One trace over a short engine run of full depth and of each spec, one after another (a
    second trace in one process failed on an H100: CUDA_ERROR_LAUNCH_FAILED in the next program,
    with XLA's command buffers), summarised as a whole; the runs are told apart by their programs
    (`hlo_module`) when the .xplane.pb is read later."""
    settings = [None, *args.specs]
    kw = dict(max_new_tokens=args.trace_tokens, ignore_eos=True)
    for spec in settings:
        eejax.generate(model, prompts, spec=spec, **kw)  # compiled before the trace
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            runs = {spec or "full": eejax.generate(model, prompts, spec=spec, **kw).stats for spec in settings}
        (path,) = Path(tmp).glob("**/*.xplane.pb")
        if args.trace_dir is not None:
            args.trace_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, args.trace_dir / f"{tag}.xplane.pb")
        steps = sum(s.engine_steps for s in runs.values())
        summary = trace_summary(path, steps)
    summary["runs"] = {
        k: dict(decode_ms=1e3 * (s.run_s - s.prefill_s), engine_steps=s.engine_steps) for k, s in runs.items()
    }
    print(f"  trace {tag}: {json.dumps(summary)}", flush=True)
    return summary


def trace_summary(path, per: int, top: int = 12) -> dict:
    """Per `per` (engine steps): the device's kernels and copies (count, busy ms), and the `top`
    device and host event names by total time, from a jax.profiler trace."""
    from jax.profiler import ProfileData

    device_time, device_count = collections.Counter(), collections.Counter()
    host_time, host_count = collections.Counter(), collections.Counter()
    lines = {}
    for plane in ProfileData.from_file(str(path)).planes:
        on_device = plane.name.startswith("/device:")
        if not on_device and not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            n = busy = 0
            for e in line.events:
                time_, count = (device_time, device_count) if on_device else (host_time, host_count)
                time_[e.name] += e.duration_ns
                count[e.name] += 1
                n += 1
                busy += e.duration_ns
            if on_device and n:
                lines[f"{plane.name} {line.name}"] = dict(events=n / per, busy_ms=busy / 1e6 / per)

    def table(time_, count):
        return [(name[:90], count[name] / per, ns / 1e6 / per) for name, ns in time_.most_common(top)]

    copies = {k: v for k, v in device_count.items() if "memcpy" in k.lower() or "copy" in k.lower()}
    return dict(
        per_step_lines=lines,
        device_copies_per_step={k[:60]: v / per for k, v in sorted(copies.items(), key=lambda kv: -kv[1])[:6]},
        top_device=table(device_time, device_count),
        top_host=table(host_time, host_count),
    )


def main() -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-eagle", help="an eejax model with a draft head")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--batch", type=int, default=1, help="rows (CNN/DM evaluation rows 0..)")
    parser.add_argument("--specs", nargs="+", action="extend", default=None, help="fixed speculation settings")
    parser.add_argument(
        "--exits", nargs="+", action="extend", default=[], help="early-exit settings for the engine part (softmax:0.9)"
    )
    parser.add_argument("--layer-buffers", nargs="+", action="extend", choices=("stacked", "split"), default=None)
    parser.add_argument("--parts", nargs="+", action="extend", choices=PARTS, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--trace-tokens", type=int, default=24, help="new tokens per row in a traced run")
    parser.add_argument("--repeats", type=int, default=2, help="paired engine repeats (programs: 5x as many)")
    parser.add_argument("--trace-dir", type=Path, help="where the traces' .xplane.pb files go")
    parser.add_argument("--seconds", type=float, default=600, help="no part starts after this many seconds")
    parser.add_argument("--random-like", type=Path, help="random weights of this checkpoint's config")
    parser.add_argument("--name", default="gpu_profile", help="output name under benchmarks/out/")
    args = parser.parse_args()
    args.specs = args.specs or ["draft:2", "draft:4", "draft:4:lookup"]
    for s in args.specs:
        if SpecConfig.parse(s).adaptive:
            parser.error(f"--specs takes fixed settings, got {s!r}")
    start = time.perf_counter()
    device = jax.devices()[0].device_kind
    print(f"gpu_profile: {device}, jax {jax.__version__}, {args.dtype}, batch {args.batch}", flush=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "device": device, "runs": {}}
    traced = False
    for layout in args.layer_buffers or ["stacked"]:
        model = load(args, layout)
        prompts, _ = summary_prompts(model.tokenizer, args.batch, args.prompt_tokens)
        tag = f"{args.dtype}-b{args.batch}-{layout}"
        run = result["runs"][tag] = {}
        for part in args.parts or PARTS:
            elapsed = time.perf_counter() - start
            if elapsed > args.seconds:
                print(f"gpu_profile: {tag} {part} skipped ({elapsed:.0f} s spent)", flush=True)
                continue
            if part == "traces" and traced:  # a second trace in one process failed (traces_part)
                print(f"gpu_profile: {tag} traces skipped (one trace per process)", flush=True)
                continue
            print(f"gpu_profile: {tag} {part} (at {elapsed:.0f} s)", flush=True)
            if part == "engine":
                run[part] = engine_part(model, prompts, args)
            elif part == "programs":
                run[part] = programs_part(model, prompts, args)
            else:
                run[part], traced = traces_part(model, prompts, args, tag), True
            write_result(args.name, result)
    print(f"gpu_profile: done in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
