"""Paged attention: the Triton kernel vs the jnp reference on a GPU, and the reference's share of
a SmolLM2 decode step on CPU.

    python benchmarks/kernels.py             # GPU: decode attention by batch, SmolLM2's shapes
                                             # (3 KV heads x 3, head_dim 64) at 512 keys per row,
                                             # achieved memory bandwidth as a share of the peak
    python benchmarks/kernels.py --sweep     # GPU: also 2k and 8k keys, and a Llama-8B layer's
                                             # shapes (8 KV heads x 4, head_dim 128)
    python benchmarks/kernels.py --cpu-share # CPU: reference decode attention as a share of a
                                             # SmolLM2 decode step, gathering the row's whole
                                             # allocation vs the bucketed pages it needs

The GPU part exits at once on a machine without a GPU; its data is drawn on the device (the first
version drew GBs of float64 normals on the host and did not finish in 64 s on an H100). Bytes
counted per decode-attention call: the K and V of every valid key (B x context x Hkv x Dh x 2
tensors) plus queries and outputs.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import write_result  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser

# Peak HBM bandwidth (GB/s) by `device_kind`; --peak-gbs overrides.
PEAK_GBS = {
    "NVIDIA H100 80GB HBM3": 3350,
    "NVIDIA H100 PCIe": 2000,
    "NVIDIA H200": 4800,
    "NVIDIA A100-SXM4-80GB": 2039,
    "NVIDIA A100-SXM4-40GB": 1555,
    "NVIDIA A100 80GB PCIe": 1935,
    "NVIDIA L4": 300,
    "NVIDIA GeForce RTX 4090": 1008,
}


def best_seconds(fn, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def in_one_program(attention, calls: int):
    """A program that runs `attention(q, ...)` `calls` times in a loop, each call's query nudged by
    the last output (so that XLA can neither hoist nor merge them): timing it and dividing by
    `calls` gives the device time of one call. Timed alone, a call took ~140 us on an H200
    (2026-11-28) whatever its size: the host's launch and synchronisation, not the attention."""

    def looped(q, *rest):
        def body(_, out):
            return attention(q + (out * 1e-30).astype(q.dtype), *rest)

        return jax.lax.fori_loop(0, calls, body, jnp.zeros_like(q))

    return jax.jit(looped)


CALLS = 100  # attention calls per timed program
SMOLLM2 = dict(num_kv_heads=3, group=3, head_dim=64)
LLAMA_8B = dict(num_kv_heads=8, group=4, head_dim=128)


def decode_case(batch, context, *, num_kv_heads=8, group=4, head_dim=128, page=16, dtype=jnp.bfloat16, seed=0):
    """A one-layer cache holding `context` keys per row and one query token per row, drawn on the
    default device."""
    kk, kv, kq, kt = jax.random.split(jax.random.PRNGKey(seed), 4)
    pages_per_row = -(-context // page)
    num_pages = 1 + batch * pages_per_row
    shape = (1, num_kv_heads, num_pages, page, head_dim)
    k = jax.random.normal(kk, shape, dtype)
    v = jax.random.normal(kv, shape, dtype)
    table = (1 + jax.random.permutation(kt, num_pages - 1).reshape(batch, pages_per_row)).astype(jnp.int32)
    q = jax.random.normal(kq, (batch, 1, num_kv_heads * group, head_dim), dtype)
    lengths = jnp.full((batch,), context, jnp.int32)
    return q, k, v, table, (lengths - 1)[:, None], lengths


def gpu_benchmark(args) -> int:
    if jax.default_backend() != "gpu":
        print(
            "benchmarks/kernels.py: no GPU here (JAX backend is "
            f"{jax.default_backend()!r}); the kernel benchmark needs CUDA. "
            "For the CPU measurement run: python benchmarks/kernels.py --cpu-share",
            file=sys.stderr,
        )
        return 2
    from eejax.kernels.attention import reference_paged_attention
    from eejax.kernels.triton_attention import triton_paged_attention

    device = jax.devices()[0]
    peak = args.peak_gbs or PEAK_GBS.get(device.device_kind)
    print(f"{device.device_kind}: peak {peak or '?'} GB/s (set --peak-gbs if unknown)")
    on_device = functools.partial(triton_paged_attention, interpret=False)
    kernel, reference = jax.jit(on_device), jax.jit(reference_paged_attention)
    kernel_loop = in_one_program(on_device, CALLS)
    reference_loop = in_one_program(reference_paged_attention, CALLS)
    rows = []
    shapes = {"smollm2": SMOLLM2, **({"llama-8b": LLAMA_8B} if args.sweep else {})}
    for (name, shape), b, ctx in itertools.product(shapes.items(), args.batches, args.contexts):
        q, k, v, table, pos, lengths = decode_case(b, ctx, **shape)
        nbytes = 2 * b * ctx * k.shape[1] * k.shape[-1] * k.dtype.itemsize + 2 * q.size * q.dtype.itemsize
        t_kernel = best_seconds(kernel_loop, q, k, v, 0, table, pos, lengths, repeats=args.repeats) / CALLS
        t_ref = best_seconds(reference_loop, q, k, v, 0, table, pos, lengths, repeats=args.repeats) / CALLS
        gbs = nbytes / t_kernel / 1e9
        err = float(
            jnp.abs(
                kernel(q, k, v, 0, table, pos, lengths).astype(jnp.float32)
                - reference(q, k, v, 0, table, pos, lengths).astype(jnp.float32)
            ).max()
        )
        rows.append(
            dict(
                shape=name,
                batch=b,
                context=ctx,
                kernel_us=t_kernel * 1e6,
                reference_us=t_ref * 1e6,
                speedup=t_ref / t_kernel,
                kernel_gbs=gbs,
                peak_fraction=gbs / peak if peak else None,
                max_abs_diff=err,
            )
        )
        share = f"{gbs / peak:.0%} of peak" if peak else "peak unknown"
        print(
            f"{name} batch {b:3d} context {ctx:5d}: kernel {t_kernel * 1e6:8.1f} us ({gbs:7.1f} GB/s, {share}) | "
            f"reference {t_ref * 1e6:8.1f} us | {t_ref / t_kernel:5.2f}x | max diff {err:.1e}",
            flush=True,
        )
    print(f"wrote {write_result('kernels_gpu', {'device': device.device_kind, 'peak_gbs': peak, 'rows': rows})}")
    return 0


def cpu_share(args) -> int:
    """Reference decode attention as a share of a SmolLM2 decode step, when it gathers the rows'
    whole allocation (prompt + all new tokens) vs only the bucketed pages the current length
    needs (what `generate` passes). The share is measured by ablation: the same step with the
    attention replaced by its queries, interleaved with the real one."""
    import eejax
    from eejax.cache import init_cache, pages_needed
    from eejax.decode import steps
    from eejax.decode.buckets import bucket
    from eejax.models import llama
    from eejax.options import StepOptions

    model = eejax.load("smollm2-135m", quantization=None)
    c = model.config
    rows = []
    for b in args.batches:
        allocation = pages_needed(args.prompt_tokens + args.new_tokens, 16)
        cache = init_cache(c.num_layers, 1 + b * allocation, 16, c.num_kv_heads, c.head_dim, model.dtype)
        table = jnp.asarray(1 + np.arange(b * allocation, dtype=np.int32).reshape(b, allocation))
        tokens = jnp.asarray(np.random.default_rng(0).integers(100, 10000, (b, args.prompt_tokens)), jnp.int32)
        lengths = jnp.full((b,), args.prompt_tokens, jnp.int32)
        static = dict(config=c, options=StepOptions(args.new_tokens))
        state, cache = jax.jit(functools.partial(steps.prefill, **static))(
            model.params, cache, tokens, lengths, table, jax.random.PRNGKey(0)
        )
        decode = jax.jit(functools.partial(steps.decode, **static), donate_argnums=(1,))
        real_attention = llama.paged_attention
        llama.paged_attention = lambda q, *a, **kw: q  # traced once, below, for the ablated step
        try:
            ablated = jax.jit(functools.partial(steps.decode, **static), donate_argnums=(1,))
            for w in {allocation, min(allocation, bucket(pages_needed(args.prompt_tokens + 1, 16)))}:
                _, cache = ablated(model.params, cache, state, table[:, :w])
        finally:
            llama.paged_attention = real_attention
        widths = {
            "whole allocation": allocation,
            "bucketed to need": min(allocation, bucket(pages_needed(args.prompt_tokens + 1, 16))),
        }
        result = {"batch": b}
        for name, width in widths.items():
            t = table[:, :width]
            times = {decode: [], ablated: []}
            _, cache = decode(model.params, cache, state, t)
            for _ in range(args.repeats):  # interleaved: the real step, then the ablated one
                for fn in times:
                    start = time.perf_counter()
                    _, cache = jax.block_until_ready(fn(model.params, cache, state, t))
                    times[fn].append(time.perf_counter() - start)
            step = float(np.median(times[decode]))
            attn = step - float(np.median(times[ablated]))
            result[name] = dict(pages=width, step_ms=step * 1e3, attention_ms=attn * 1e3, share=attn / step)
            print(
                f"batch {b:3d}, {name:16s} ({width:3d} pages): decode step {step * 1e3:6.1f} ms, "
                f"attention {attn * 1e3:6.1f} ms = {attn / step:.0%} of the step",
                flush=True,
            )
        rows.append(result)
    record = {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rows": rows}
    print(f"wrote {write_result('kernels_cpu_share', record)}")
    return 0


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-share", action="store_true", help="the CPU measurement instead of the GPU benchmark")
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        action="extend",
        default=None,
        help="batch sizes (default: 1 8 32 64 on GPU, 1 8 32 on CPU)",
    )
    parser.add_argument(
        "--contexts", type=int, nargs="+", action="extend", default=None, help="GPU: keys per row (default 512)"
    )
    parser.add_argument("--sweep", action="store_true", help="GPU: 512, 2k and 8k keys, and Llama-8B's shapes too")
    parser.add_argument("--peak-gbs", type=float, help="GPU: the device's peak memory bandwidth in GB/s")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="CPU: prompt length")
    parser.add_argument(
        "--new-tokens", type=int, default=768, help="CPU: new tokens each row's pages are allocated for"
    )
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    if args.cpu_share:
        args.batches = args.batches or [1, 8, 32]
        return cpu_share(args)
    args.batches = args.batches or [1, 8, 32, 64]
    args.contexts = args.contexts or ([512, 2048, 8192] if args.sweep else [512])
    return gpu_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
