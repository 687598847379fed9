"""The preallocated paged KV cache: one device pytree for all layers.

Layout: `k, v: [num_layers, num_kv_heads, num_pages, page_size, head_dim]` (heads before pages,
so a row's gathered keys `[Hkv, B, pages * page_size, Dh]` feed attention's batched matmuls
without a transpose). A sequence owns a row
of `block_table [batch, pages_per_seq] int32` (page ids; unused entries are the null page 0) and
a length `kv_len [batch]`. Token at position p of row b lives in page `block_table[b, p // S]`,
slot `p % S`. Rolling back is only lowering `kv_len`: stale slots are masked, later overwritten.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from eejax.cache.allocator import NULL_PAGE
from eejax.errors import EejaxError
from eejax.kernels.head_parallel import head_mesh, on_head_shards


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer, `[L, Hkv, num_pages, page_size, Dh]` each."""

    k: jax.Array
    v: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]


def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes of one page across all layers, keys and values."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def parse_bytes(size: int | str) -> int:
    """`1073741824`, `"512MiB"`, `"2GB"`, `"1.5GiB"` -> bytes."""
    if isinstance(size, (int, np.integer)):
        return int(size)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise EejaxError(f"cannot read {size!r} as a size (examples: 512MiB, 2GB, 1073741824)")
    unit = (m.group(2) or "").upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("I")]
    return int(float(m.group(1)) * base**power)


def pages_for_budget(budget: int | str, per_page_bytes: int) -> int:
    """How many pages (the null page included) a memory budget (bytes, or "512MiB") holds."""
    return parse_bytes(budget) // per_page_bytes


def pages_needed(num_tokens: int, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)


def init_cache(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype) -> KVCache:
    """Allocates the whole cache once, zero-filled."""
    if num_pages < 2:
        raise EejaxError(f"a KV cache needs at least 2 pages (1 null + 1 usable), got {num_pages}")
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def slot_indices(block_table, positions, valid, page_size):
    """Page id and in-page slot of each token; invalid tokens, and tokens past the row's block
    table, go to the null page (a write past the table is lost, never aliased onto a live page).

    block_table [B, M] int32, positions [B, T] int32, valid [B, T] bool -> (pages, slots) [B, T].
    """
    page_idx = positions // page_size
    valid = valid & (page_idx < block_table.shape[1])
    pages = jnp.take_along_axis(block_table, jnp.clip(page_idx, 0, block_table.shape[1] - 1), axis=1)
    pages = jnp.where(valid, pages, NULL_PAGE)
    slots = jnp.where(valid, positions % page_size, 0)
    return pages, slots


def write_layer_kv(cache: KVCache, layer, k, v, pages, slots) -> KVCache:
    """Writes one layer's new keys/values `[B, T, Hkv, Dh]` at (pages, slots) `[B, T]`; on a
    mesh that splits the cache by KV heads, each device writes its own heads (every row: the
    cache is the same on every data replica)."""
    mesh = head_mesh(cache.k.shape[1])
    if mesh is None:
        return _write_layer_kv(cache, layer, k, v, pages, slots)
    heads, cache_spec = P(None, None, "tensor", None), P(None, "tensor")
    in_specs = (KVCache(cache_spec, cache_spec), P(), heads, heads, P(), P())
    return on_head_shards(_write_layer_kv, mesh, in_specs, KVCache(cache_spec, cache_spec))(
        cache, layer, k, v, pages, slots
    )


def write_layers_kv(cache: KVCache, layers, k, v, pages, slots) -> KVCache:
    """Writes several layers' new keys/values `[n, B, T, Hkv, Dh]` in one scatter: layer
    `layers[i]` (int32 [n]) at (pages[i], slots) (pages [n, B, T], slots [B, T]); split by KV
    heads on a mesh as `write_layer_kv`."""
    mesh = head_mesh(cache.k.shape[1])
    if mesh is None:
        return _write_layers_kv(cache, layers, k, v, pages, slots)
    heads, cache_spec = P(None, None, None, "tensor", None), P(None, "tensor")
    in_specs = (KVCache(cache_spec, cache_spec), P(), heads, heads, P(), P())
    return on_head_shards(_write_layers_kv, mesh, in_specs, KVCache(cache_spec, cache_spec))(
        cache, layers, k, v, pages, slots
    )


def _write_layers_kv(cache: KVCache, layers, k, v, pages, slots) -> KVCache:
    heads = jnp.arange(cache.k.shape[1])[None, :, None, None]
    index = (layers[:, None, None, None], heads, pages[:, None], slots[None, None])  # [n, Hkv, B, T]
    return KVCache(
        k=scatter_set(cache.k, index, k.transpose(0, 3, 1, 2, 4)),
        v=scatter_set(cache.v, index, v.transpose(0, 3, 1, 2, 4)),
    )


def _write_layer_kv(cache: KVCache, layer, k, v, pages, slots) -> KVCache:
    index = (layer, jnp.arange(cache.k.shape[1])[:, None, None], pages, slots)
    return KVCache(
        k=scatter_set(cache.k, index, k.transpose(2, 0, 1, 3)),
        v=scatter_set(cache.v, index, v.transpose(2, 0, 1, 3)),
    )


def scatter_set(buffer: jax.Array, index, values: jax.Array) -> jax.Array:
    """`buffer.at[index].set(values)`, with a 16-bit float buffer (bf16, f16) written through its
    uint16 view: the same bits, but XLA:CPU scatters a bf16 buffer by converting all of it to
    float32 and back, which for the cache meant every layer's K/V twice per layer (a bf16 decode
    step at batch 8 spent 60% of its time there); it scatters integers in place."""
    values = values.astype(buffer.dtype)
    if not (jnp.issubdtype(buffer.dtype, jnp.floating) and buffer.dtype.itemsize == 2):
        return buffer.at[index].set(values)
    bits = jax.lax.bitcast_convert_type(buffer, jnp.uint16)
    bits = bits.at[index].set(jax.lax.bitcast_convert_type(values, jnp.uint16))
    return jax.lax.bitcast_convert_type(bits, buffer.dtype)
