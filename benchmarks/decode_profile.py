"""Where a full-depth decode step's time goes on a CPU: a per-op profile of eejax decoding
SmolLM2-135M (--dtype), from XLA:CPU's own trace events (`--xla_cpu_enable_xprof_traceme`, read
back with `jax.profiler.ProfileData`).

The same CNN/DM prompts as `full_depth.py`; untraced runs give the decode step's time, and two
traced runs (the prefill alone, then with --new-tokens) each op's time in the decode steps. Ops
are grouped by what they do (the op names XLA gives its kernels) and printed per generated token
as thread-milliseconds: XLA:CPU splits a large op over the cores, so the threads' time adds up
to about cores x wall time. "not in an op" is the rest of cores x the step's wall time: the
threads waiting on each other, dispatch, the host. Also the weight matmuls alone (every layer's
seven and the head as one jitted program, nothing else) against the bandwidth bound: the floor a
decode step can reach on this machine.

    python benchmarks/decode_profile.py [--batch 1] [--layer-buffers auto|stacked|split] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

# Per-op trace events: XLA reads its flags once, when the backend starts.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import eejax  # noqa: E402
from benchmarks.common import add_quantization_args, cnndm_prompts, load_model, read_bandwidth_gbs, write_result  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.models.llama import param_bytes_per_token  # noqa: E402

# (group, name prefixes of XLA:CPU's kernels), first match wins.
GROUPS = (
    ("weight slice copies (stacked layout)", ("dynamic-slice", "dynamic_slice")),
    ("matmuls (dot, eejax's CPU kernel)", ("dot", "ffi_call")),
    ("attention over the paged cache", ("ynn_fusion", "gather", "select_reduce", "subtract_exp")),
    ("cache writes", ("scatter", "dynamic-update", "dynamic_update")),
    ("reductions (norms, softmax, argmax)", ("reduce", "iota_reduce")),
    ("a thread waiting in XLA's pool", ("SlinkyThreadPool::Await",)),
)


def group_of(name: str) -> str:
    for group, prefixes in GROUPS:
        if name.startswith(prefixes) or any(p in name for p in prefixes if p in ("gather", "scatter")):
            return group
    return "other element-wise fusions and copies"


def op_times(trace_dir: Path) -> collections.Counter:
    """{op name: total ns over XLA's threads} from the trace under trace_dir."""
    from jax.profiler import ProfileData

    (path,) = trace_dir.glob("**/*.xplane.pb")
    total = collections.Counter()
    for plane in ProfileData.from_file(str(path)).planes:
        for line in plane.lines:
            if "XLAEigen" not in line.name and "PjRtCpuClient" not in line.name:
                continue
            for event in line.events:
                if not event.name.startswith("ThunkExecutor"):
                    total[event.name] += event.duration_ns
    return total


def weight_matmuls_ms(model, batch: int) -> float:
    """Best-of-20 time of every decode weight matmul (7 per layer and the head) at `batch` rows,
    one jitted program over the per-layer buffers, each product as the model computes it
    (`kernels.cpu_matmul`): the weights streamed once, nothing else."""
    from eejax.kernels.cpu_matmul import matmul, matmul_t
    from eejax.models.stack import split_stack

    layers = split_stack(model.params["layers"])
    names = [k for k, v in layers.items() if v[0].ndim == 2]
    c = model.config
    head = model.params["embed"] if c.tie_embeddings else model.params["lm_head"]
    head_matmul = matmul_t if c.tie_embeddings else matmul

    def matmuls(layers, head):
        total = jnp.zeros((batch,), jnp.float32)
        for i in range(c.num_layers):
            for k in names:
                w = layers[k][i]
                total += matmul(jnp.ones((batch, w.shape[0]), model.dtype), w).sum(-1)
        return total + head_matmul(jnp.ones((batch, c.hidden_size), model.dtype), head).sum(-1)

    program = jax.jit(matmuls)
    program(layers, head).block_until_ready()
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        program(layers, head).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens per row in the traced run")
    parser.add_argument("--layer-buffers", choices=("auto", "stacked", "split", "rows"), default="auto")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    add_quantization_args(parser)
    parser.add_argument("--top", type=int, default=0, help="also print the N costliest ops by name")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.new_tokens < 2:
        parser.error("--batch must be >= 1 and --new-tokens >= 2")

    model = load_model(args, dtype=jnp.dtype(args.dtype))
    prompts = cnndm_prompts(model.tokenizer, args.batch, args.prompt_tokens)
    kw = dict(max_new_tokens=args.new_tokens, ignore_eos=True)
    eejax.generate(model, prompts, **kw)  # compile
    runs = [eejax.generate(model, prompts, **kw).stats for _ in range(3)]
    decode_s = min(s.run_s - s.prefill_s for s in runs)
    step_ms = decode_s / (args.new_tokens - 1) * 1e3  # the first token comes from the prefill
    # Two traced calls, the prefill alone and the prefill with the decode steps: their difference
    # is the decode steps' ops.
    traced = []
    for new_tokens in (1, args.new_tokens):
        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp):
                eejax.generate(model, prompts, **{**kw, "max_new_tokens": new_tokens})
            traced.append(op_times(Path(tmp)))
    steps = args.new_tokens - 1
    decode_ops = {k: v for k, v in (traced[1] - traced[0]).items() if v > 0}
    groups = collections.Counter()
    for name, ns in decode_ops.items():
        groups[group_of(name)] += ns / 1e6 / steps
    cores = os.cpu_count() or 1
    busy = sum(groups.values())
    bw = read_bandwidth_gbs()
    weight_bytes = param_bytes_per_token(model.params, model.config)
    floor_ms = weight_matmuls_ms(model, args.batch)
    print(
        f"SmolLM2-135M {args.dtype}, batch {args.batch}, {args.prompt_tokens}-token prompts, layout {model.layout}: "
        f"decode step {step_ms:.1f} ms untraced; {cores} cores"
    )
    print(f"{'what':40s} {'thread-ms/step':>14s} {'share':>7s}")
    rows = []
    for group, ms in groups.most_common():
        rows.append(dict(group=group, thread_ms_per_step=ms))
        print(f"{group:40s} {ms:14.2f} {ms / (cores * step_ms):7.1%}")
    if args.top:
        for name, ns in sorted(decode_ops.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"   {name[:60]:60s} {ns / 1e6 / steps:8.3f} thread-ms/step  ({group_of(name)})")
    idle = max(cores * step_ms - busy, 0.0)
    print(f"{'not in an op (waits, dispatch, host)':40s} {idle:14.2f} {idle / (cores * step_ms):7.1%}")
    bound_ms = weight_bytes / (bw * 1e9) * 1e3
    print(
        f"weights {weight_bytes / 1e6:.0f} MB at {bw:.1f} GB/s: bound {bound_ms:.1f} ms per step; the weight "
        f"matmuls alone {floor_ms:.1f} ms ({bound_ms / floor_ms:.0%} of the bound); the step "
        f"{step_ms:.1f} ms ({bound_ms / step_ms:.0%} of the bound)"
    )
    path = write_result(
        "_".join(
            [f"decode_profile_b{args.batch}", model.layout]
            + ([args.dtype] if args.dtype != "float32" else [])
            + ([args.quantization, args.activations] if args.quantization else [])
        ),
        dict(
            batch=args.batch,
            layout=model.layout,
            step_ms=step_ms,
            cores=cores,
            groups=rows,
            not_in_an_op_thread_ms=idle,
            read_bandwidth_gbs=bw,
            weight_bytes=weight_bytes,
            bound_ms=bound_ms,
            weight_matmuls_ms=floor_ms,
            top_ops={k: v / 1e6 / steps for k, v in collections.Counter(decode_ops).most_common(15)},
        ),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
