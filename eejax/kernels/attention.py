"""Attention over the paged KV cache.

One entry point, `paged_attention`, serves decode (q_len = 1) and multi-token steps (prefill,
chunked prefill, speculative verification): each query attends to the keys of its row at
positions `< kv_len` and `<= its own position` (causal), and with a `window` W only to the last W
of them (`> its position - W`: Mistral's sliding window). GQA: query head h reads KV head
h // group. A row with kv_len = 0 (padding) gets zeros.

Implementations: "reference" (jnp, runs everywhere), "cpu" (eejax's CPU kernel for a few
queries per row, `cpu_attention.py`; the reference where it does not apply) and "triton" (the
kernel in `triton_attention.py`: compiled through jax-triton on CUDA, run by Triton's
interpreter elsewhere: slow, for tests). "auto" picks the CPU kernel on a CPU and the reference
(XLA's) elsewhere: on an H100 (2026-11-27) the Triton kernel was 0.38-0.87x of XLA's attention
at batch 1-64, so a GPU takes it only when asked for ("triton"). The choice is made at trace
time. "triton" also asks a Llama's paged steps for the Triton layer: its float products as the
fused kernels of `triton_linear.py` (`llama.DecoderLayer.triton`).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from eejax.kernels import cpu_attention
from eejax.kernels.backend import backend
from eejax.kernels.head_parallel import head_mesh, on_head_shards, row_axis
from eejax.kernels.position_bias import RelativePositionBias, relative_position_bucket

IMPLS = ("auto", "reference", "cpu", "triton")
log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TreeMask:
    """Attention within a tree of drafts written at consecutive cache positions (`decode.tree`):
    a key at start <= p < start + W is visible to query t only where visible[t, p - start] (its
    ancestors and itself), keys from start + W on never, keys before `start` as usual.
    start [B] int32, visible [T, W] bool."""

    start: jax.Array
    visible: jax.Array

    def allows(self, key_pos):
        """key_pos [K] -> [B, T, K]: which keys the tree lets each query see."""
        rel = key_pos[None, :] - self.start[:, None]  # [B, K]
        width = self.visible.shape[1]
        inside = jnp.take(self.visible, jnp.clip(rel, 0, width - 1), axis=1).transpose(1, 0, 2)  # [B, T, K]
        return (rel < 0)[:, None, :] | ((rel < width)[:, None, :] & inside)


def resolve_impl(impl: str) -> str:
    """The implementation `impl` means on this process's default backend: auto is the CPU
    kernel on a CPU and the reference (XLA) elsewhere, never slower than Triton's where both
    were measured (module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose from {IMPLS}")
    if impl == "auto":
        return "cpu" if backend() == "cpu" else "reference"
    return impl


def paged_attention(
    q,
    k_cache,
    v_cache,
    layer,
    block_table,
    q_positions,
    kv_len,
    *,
    impl="auto",
    scale=None,
    bias_table=None,
    bias: RelativePositionBias | None = None,
    tree: TreeMask | None = None,
    window: int | None = None,
):
    """Attention of new queries against one layer of the paged cache.

    q:            [B, T, Hq, Dh]   queries (rotary already applied)
    k_cache/v_cache: [L, Hkv, P, S, Dh]  the whole cache (the new tokens already written)
    layer:        int32 scalar, may be traced
    block_table:  [B, M] int32     page ids of each row
    q_positions:  [B, T] int32     absolute position of each query
    kv_len:       [B] int32        valid keys of each row (after this step's writes)
    scale:        score scale (default Dh^-0.5; T5 uses 1.0)
    bias_table:   [num_buckets, Hq] T5 relative-position bias, bucketed as `bias` says
    tree:         a `TreeMask` over the queries (a tree of drafts; always the jnp reference)
    window:       a query sees only keys at positions > its own - window (static; None: all)
    returns       [B, T, Hq, Dh]
    """
    if (bias_table is None) != (bias is None):
        raise ValueError("bias_table and bias (the bucketing) go together")
    impl = resolve_impl(impl)
    mesh = head_mesh(k_cache.shape[1])
    if mesh is not None:
        return _head_parallel(
            mesh,
            impl,
            q,
            k_cache,
            v_cache,
            layer,
            block_table,
            q_positions,
            kv_len,
            scale=scale,
            bias_table=bias_table,
            bias=bias,
            tree=tree,
            window=window,
        )
    return _attend(
        impl,
        q,
        k_cache,
        v_cache,
        layer,
        block_table,
        q_positions,
        kv_len,
        scale=scale,
        bias_table=bias_table,
        bias=bias,
        tree=tree,
        window=window,
    )


def _head_parallel(
    mesh, impl, q, k_cache, v_cache, layer, block_table, q_positions, kv_len, *, scale, bias_table, bias, tree, window
):
    """Attention on each device's own heads (`head_parallel`), rows over `data` where it divides
    them; a tree mask (the same for every head) goes with its rows."""
    rows = row_axis(mesh, q.shape[0])
    heads, per_row, cache = P(rows, None, "tensor", None), P(rows), P(None, "tensor")
    in_specs = (
        heads,
        cache,
        cache,
        P(),
        per_row,
        per_row,
        per_row,
        None if bias_table is None else P(None, "tensor"),
        None if tree is None else TreeMask(start=per_row, visible=P()),
    )

    def local(q, k_cache, v_cache, layer, block_table, q_positions, kv_len, bias_table, tree):
        return _attend(
            impl,
            q,
            k_cache,
            v_cache,
            layer,
            block_table,
            q_positions,
            kv_len,
            scale=scale,
            bias_table=bias_table,
            bias=bias,
            tree=tree,
            window=window,
        )

    return on_head_shards(local, mesh, in_specs, heads)(
        q, k_cache, v_cache, layer, block_table, q_positions, kv_len, bias_table, tree
    )


def _attend(
    impl, q, k_cache, v_cache, layer, block_table, q_positions, kv_len, *, scale, bias_table, bias, tree, window
):
    extra = dict(scale=scale, bias_table=bias_table, bias=bias, window=window)
    if impl == "triton" and tree is None:  # the kernel has no tree mask
        from eejax.kernels.triton_attention import triton_paged_attention

        interpret = backend() != "gpu"
        if interpret:
            log.warning("attention impl 'triton' without a GPU: running the kernel in Triton's interpreter (slow)")
        return triton_paged_attention(
            q, k_cache, v_cache, layer, block_table, q_positions, kv_len, interpret=interpret, **extra
        )
    if impl == "cpu" and cpu_attention.applies(q, k_cache, tree, bias_table):
        args = (q, k_cache, v_cache, layer, block_table, q_positions, kv_len)
        return cpu_attention.cpu_paged_attention(*args, scale=scale, window=window)
    return reference_paged_attention(q, k_cache, v_cache, layer, block_table, q_positions, kv_len, tree=tree, **extra)


def reference_paged_attention(
    q,
    k_cache,
    v_cache,
    layer,
    block_table,
    q_positions,
    kv_len,
    *,
    scale=None,
    bias_table=None,
    bias: RelativePositionBias | None = None,
    tree: TreeMask | None = None,
    window: int | None = None,
):
    """jnp reference: gathers only the row's `M` pages of this layer (one gather, no layer copy).

    A step with few queries per row over many rows (decode, a verify pass) computes its scores
    and outputs as products summed over a gathered axis, which XLA fuses with the page gather
    into one loop over the keys; otherwise as batched matmuls (prefill), see `_few_queries`."""
    b, t, hq, dh = q.shape
    _, hkv, _, s, _ = k_cache.shape
    m = block_table.shape[1]
    group = hq // hkv
    # Batch dims (Hkv, B) lead and Dh is minor: [Hkv, B, M*S, Dh] keys, [Hkv, B, T*G, Dh] queries.
    k, v = _layer_pages(k_cache, layer, block_table), _layer_pages(v_cache, layer, block_table)
    qg = q.reshape(b, t, hkv, group, dh).transpose(2, 0, 1, 3, 4).reshape(hkv, b, t * group, dh)
    scale = dh**-0.5 if scale is None else scale
    few = _few_queries(b, t * group, k_cache.dtype)
    if few:
        scores = jnp.sum(qg[:, :, :, None] * k[:, :, None], axis=-1)
    else:
        scores = jnp.einsum("kbqd,kbsd->kbqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * scale
    key_pos = jnp.arange(m * s, dtype=jnp.int32)
    if bias_table is not None:
        buckets = relative_position_bucket(key_pos[None, None, :] - q_positions[:, :, None], bias)  # [B, T, K]
        per_head = bias_table.astype(jnp.float32)[buckets]  # [B, T, K, Hq]
        per_head = per_head.reshape(b, t, m * s, hkv, group).transpose(3, 0, 1, 4, 2)
        scores = scores + per_head.reshape(hkv, b, t * group, m * s)
    mask = (key_pos[None, None, :] < kv_len[:, None, None]) & (
        key_pos[None, None, :] <= q_positions[:, :, None]
    )  # [B, T, M*S]
    if window is not None:
        mask &= key_pos[None, None, :] > q_positions[:, :, None] - window
    if tree is not None:
        mask &= tree.allows(key_pos)
    if tree is not None or window is not None:
        has_key = mask.any(-1)
    else:  # key 0 is visible exactly when any is: no reduction over the keys (a kernel per layer on a GPU)
        has_key = (kv_len[:, None] > 0) & (q_positions >= 0)  # [B, T]
    mask = jnp.repeat(mask, group, axis=1)[None]  # [1, B, T*G, M*S], query rows t-major
    has_key = jnp.repeat(has_key, group, axis=1)[None, :, :, None]  # [1, B, T*G, 1]
    # Rows with no valid key would give NaN; they get zeros instead.
    scores = jnp.where(mask, scores, jnp.where(has_key, -jnp.inf, 0.0))
    probs = jax.nn.softmax(scores, axis=-1)
    if few:
        out = jnp.sum(probs[..., None] * v[:, :, None], axis=3)
    else:
        out = jnp.einsum("kbqs,kbsd->kbqd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = jnp.where(has_key, out, 0.0)
    return out.reshape(hkv, b, t, group, dh).transpose(1, 2, 0, 3, 4).reshape(b, t, hq, dh).astype(q.dtype)


def _layer_pages(cache, layer, block_table):
    """[L, Hkv, P, S, Dh] cache -> [Hkv, B, M*S, Dh]: the pages of `block_table` [B, M] in one
    layer, gathered as whole rows of a [L*Hkv*P, S*Dh] view (a row per page and head, which
    XLA copies ~1.4x faster on CPU than an index per axis)."""
    _, hkv, num_pages, s, dh = cache.shape
    b, m = block_table.shape
    rows = (layer * hkv + jnp.arange(hkv)[:, None, None]) * num_pages + block_table[None]  # [Hkv, B, M]
    return cache.reshape(-1, s * dh)[rows].reshape(hkv, b, m * s, dh)


def _few_queries(rows: int, queries_per_row: int, dtype) -> bool:
    """Whether scores and outputs are computed as summed products instead of batched matmuls:
    many rows with few queries each (query heads x tokens <= 16), float32. On a 2-core CPU
    (SmolLM2's 9/3 heads, 320 keys, 30 layers) that takes attention from 100 to 61 ms at 32
    rows, 28 to 19 ms at 8 and 12 to 10 at 4 (a decode step at batch 32 and 384 keys: 199 ->
    144 ms, `benchmarks/kernels.py --cpu-share`); the batched matmuls stay faster below 4 rows
    and for prefill. bf16 keeps the matmuls: with summed products its verify pass (3 queries)
    rounded differently for another table width, and a bf16 self-speculation test then left
    full depth's tokens."""
    return rows >= 4 and queries_per_row <= 16 and jnp.dtype(dtype) == jnp.float32
