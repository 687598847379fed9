"""A Llama decoder layer's decode step in one call on a CPU (`cpu_layer.cc`, built into the kernel
library with `cpu_matmul`), for weights kept as their blocks (`QuantizedMatrix`, the CPU's default
load) and a batch-1 decode step or verify pass (the kernel takes up to 64 rows; `MAX_ROWS` and
`MAX_POSITIONS` say why so few), or in the stacked layout's loop any step of up to 64 rows
(`MAX_STACKED_ROWS`), the stacks read in place.

The call runs what the layer runs op by op, with the same loops: RMSNorm, the q/k/v products,
their rotation, the cache write, the CPU attention kernel, o and its residual, RMSNorm, gate/up,
SiLU x up, down and its residual. So its bits are the op-by-op layer's (tested), and a row's bits
still do not depend on the rows beside it. What it saves is XLA's ~15 small ops a layer between
the products: the default load's programs compile ~40% faster (a first generate 5.6 s against
9.4 s); a batch-1 step decodes at 0.95-1.02x op by op's speed, within a shared VM's noise
(`benchmarks/cpu_layer.py`). The caches are written in place (the results alias them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from eejax.kernels import cpu_matmul
from eejax.quantized import FORMATS, QuantizedMatrix

NORMS = ("attn_norm", "mlp_norm")
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the kernel's order
ACTIVATIONS = {"float32": 0, "int8": 1, "int16": 2}  # cpu_kernels.h's Activations
# Rows a step may have to take the call. The kernel takes up to 64 (tested), but XLA runs a program
# whose layers are each one call on a thread outside its intra-op pool (nothing in it runs side by
# side), where the products' helpers are scheduled: at 2-8 rows that caller beside the pool's
# threads overcommits the cores, and steps ran 3-22% slower than op by op (benchmarks/cpu_layer.py
# --max-rows 8). At one row a step runs as fast as op by op.
MAX_ROWS = 1
# Positions of one row a step may have to take the call all the same: a batch-1 verify pass. With the
# blocks in tiles (a block decoded once for the rows) a `draft:4` round ran 12.51 -> 11.83 ms in one
# call (1.76 -> 1.66 full-depth steps; both programs in one process, as benchmarks/round_costs.py
# times them), while a batch of 8 one call a layer ran 0.975x op by op (benchmarks/cpu_layer.py
# --max-rows 8 --batches 8; an Intel AMX host, 2026-12-01: docs/results/cpu-2026-11.md).
MAX_POSITIONS = 8
# Rows a step of the stacked layout's loop may have (a traced layer index): there op by op slices
# each layer's weights out of the stack, a copy a step, which the call, reading the stack in
# place, does not make (benchmarks/cpu_layer.py --layer-buffers stacked).
MAX_STACKED_ROWS = 64


def applies(weights: dict, h, k_cache, cos, *, attention: str, tree, max_rows: int | None = None) -> bool:
    """Whether one call can run a layer whose weights are `weights` ({name: one layer's array or
    QuantizedMatrix}, or a stack's: only static facts are read) on h [B, T, D]: every matrix kept
    as blocks of one kind of activations (no prompt's GEMM), float32 norms, h, tables and cache,
    at most `max_rows` rows (default `MAX_ROWS`; one row's up to `MAX_POSITIONS` positions
    whatever it is), the CPU attention kernel (`attention`: the resolved impl) and no tree of drafts."""
    if attention != "cpu" or tree is not None or not all(k in weights for k in (*NORMS, *MATRICES)):
        return False
    ms = [weights[k] for k in MATRICES]
    if not all(isinstance(w, QuantizedMatrix) and w.transposed and not w.prompt for w in ms):
        return False
    first = ms[0]
    rows = h.shape[0] * h.shape[1]
    limit = MAX_ROWS if max_rows is None else max_rows
    if h.ndim == 3 and h.shape[0] == 1:  # one row's positions: a verify pass
        limit = max(limit, MAX_POSITIONS)
    return (
        first.activations in ACTIVATIONS
        and all(w.activations == first.activations and w.cols % 32 == 0 for w in ms)
        and all(w.qs.ndim == ms[0].qs.ndim for w in ms)
        and all(jnp.dtype(weights[k].dtype) == jnp.float32 for k in NORMS)
        and h.ndim == 3
        and h.dtype == jnp.float32
        and k_cache.dtype == jnp.float32
        and cos.dtype == jnp.float32
        and cos.shape[-1] % 8 == 0
        and 0 < rows <= min(limit, cpu_matmul.MAX_QUANTIZED_ROWS)
        and cpu_matmul.library_applies()
    )


def decoder_layer(weights: dict, h, cos, sin, k_cache, v_cache, layer, pages, slots, block_table, positions, kv_len, *,
                  eps: float, window: int | None):  # fmt: skip
    """One layer (`weights`: its own arrays, or the stack's [L, ...] arrays, read at `layer` in
    place; where `applies`) over h [B, T, D] with rotary tables cos/sin [B, T, Dh], writing the
    new K/V at (pages, slots) [B, T] of layer `layer` of the caches [L, Hkv, P, S, Dh] and
    attending over them (block_table [B, M], positions [B, T], kv_len [B] as
    `attention.paged_attention` takes them). Returns (h [B, T, D], k_cache, v_cache)."""
    if not cpu_matmul.available():
        raise RuntimeError("eejax's CPU kernel library is not available (see the log)")
    b, t, d = h.shape
    dh = cos.shape[-1]
    ms = [weights[k] for k in MATRICES]
    buffers = []
    for w in ms:
        buffers += [w.qs, w.scales, w.mins if w.mins is not None else jnp.zeros((0,), jnp.float16)]
    formats = sum((FORMATS.index(w.format) | (8 if w.tiled else 0)) << (4 * j) for j, w in enumerate(ms))
    as_int = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    out = (
        jax.ShapeDtypeStruct((b * t, d), jnp.float32),
        jax.ShapeDtypeStruct(k_cache.shape, jnp.float32),
        jax.ShapeDtypeStruct(v_cache.shape, jnp.float32),
    )
    call = jax.ffi.ffi_call("eejax_cpu_layer", out, vmap_method="sequential", input_output_aliases={5: 1, 6: 2})
    h, k_cache, v_cache = call(
        h.reshape(b * t, d),
        cos.reshape(b * t, dh),
        sin.reshape(b * t, dh),
        weights["attn_norm"],
        weights["mlp_norm"],
        k_cache,
        v_cache,
        as_int(layer).reshape(()),
        as_int(pages),
        as_int(slots),
        as_int(block_table),
        as_int(positions),
        as_int(kv_len),
        *buffers,
        eps=np.float32(eps),
        scale=np.float32(dh**-0.5),
        window=np.int64(window or 0),
        activations=np.int64(ACTIVATIONS[ms[0].activations]),
        formats=np.int64(formats),
    )
    return h.reshape(b, t, d), k_cache, v_cache
