"""Paged attention on a CPU: eejax's kernel (`cpu_attention.cc`, built into the CPU kernel
library with `cpu_matmul`) in place of the jnp reference's page gather and half a dozen ops over
the copy. "auto" attention takes it on one CPU device for float32 caches, no tree of drafts and no
T5 position bias; everything else stays on the reference. Each query is computed alone, keys in
order, so a verify pass and a decode step agree bit for bit, and so do a prompt prefilled whole,
in chunks or after a prefix-cache hit, in any program (the reference's batched matmuls and
softmax round otherwise in other shapes and fusions). A prefill's queries take it too, in tiles of
consecutive positions that share each key and value row: 256-token SmolLM2 prompts prefill as
fast as with the reference (0.99x, GGUF blocks, int16; 0.9x when each query read its keys alone)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from eejax.kernels import cpu_matmul


def applies(q, k_cache, tree, bias_table) -> bool:
    dh = q.shape[-1]
    return (
        tree is None
        and bias_table is None
        and dh % 8 == 0
        and q.dtype == jnp.float32
        and k_cache.dtype == jnp.float32
        and cpu_matmul.library_applies()
    )


def cpu_paged_attention(q, k_cache, v_cache, layer, block_table, q_positions, kv_len, *, scale=None, window=None):
    """As `attention.reference_paged_attention` (no tree, no bias; `window` as there):
    [B, T, Hq, Dh] float32. Needs the kernel library (`cpu_matmul.available()`)."""
    if not cpu_matmul.available():
        raise RuntimeError("eejax's CPU kernel library is not available (see the log)")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    call = jax.ffi.ffi_call("eejax_paged_attention", out, vmap_method="sequential")
    as_int = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return call(
        q,
        k_cache,
        v_cache,
        as_int(layer).reshape(()),
        as_int(block_table),
        as_int(q_positions),
        as_int(kv_len),
        scale=np.float32(scale),
        window=np.int64(window or 0),
    )
