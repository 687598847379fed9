"""Attention over the paged KV cache.

One entry point, `paged_attention`, serves decode (q_len = 1) and multi-token steps (prefill,
chunked prefill, speculative verification): each query attends to the keys of its row at
positions `< kv_len` and `<= its own position` (causal). GQA: query head h reads KV head
h // group. A row with kv_len = 0 (padding) gets zeros.

`impl="reference"` is the jnp implementation that runs everywhere. The Triton kernels come with
the kernels issue; until then "auto" resolves to the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "reference")


def paged_attention(q, k_cache, v_cache, layer, block_table, q_positions, kv_len, *, impl="auto"):
    """Attention of new queries against one layer of the paged cache.

    q:            [B, T, Hq, Dh]   queries (rotary already applied)
    k_cache/v_cache: [L, P, S, Hkv, Dh]  the whole cache (the new tokens already written)
    layer:        int32 scalar, may be traced
    block_table:  [B, M] int32     page ids of each row
    q_positions:  [B, T] int32     absolute position of each query
    kv_len:       [B] int32        valid keys of each row (after this step's writes)
    returns       [B, T, Hq, Dh]
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose from {IMPLS}")
    return reference_paged_attention(q, k_cache, v_cache, layer, block_table, q_positions, kv_len)


def reference_paged_attention(q, k_cache, v_cache, layer, block_table, q_positions, kv_len):
    """jnp reference: gathers only the row's `M` pages of this layer (one gather, no layer copy)."""
    b, t, hq, dh = q.shape
    _, _, s, hkv, _ = k_cache.shape
    m = block_table.shape[1]
    group = hq // hkv
    # [B, M, S, Hkv, Dh] -> [B, M*S, Hkv, Dh]; indexing with (layer, table) is a single gather.
    k = k_cache[layer, block_table].reshape(b, m * s, hkv, dh)
    v = v_cache[layer, block_table].reshape(b, m * s, hkv, dh)
    qg = q.reshape(b, t, hkv, group, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (dh**-0.5)
    key_pos = jnp.arange(m * s, dtype=jnp.int32)
    mask = (key_pos[None, None, :] < kv_len[:, None, None]) & (
        key_pos[None, None, :] <= q_positions[:, :, None]
    )  # [B, T, M*S]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    has_key = mask.any(-1)  # [B, T]
    # Rows with no valid key would give NaN; give them zeros instead.
    scores = jnp.where(has_key[:, None, None, :, None], scores, 0.0)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = jnp.where(has_key[:, :, None, None, None], out, 0.0)
    return out.reshape(b, t, hq, dh).astype(q.dtype)
