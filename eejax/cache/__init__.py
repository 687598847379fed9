"""Paged KV cache: the device pytree (`KVCache`) and the host `PageAllocator`."""

from eejax.cache.allocator import NULL_PAGE, PageAllocator, prefix_keys
from eejax.cache.paged import (
    KVCache,
    init_cache,
    page_bytes,
    pages_for_budget,
    pages_needed,
    parse_bytes,
    slot_indices,
    write_layer_kv,
    write_layers_kv,
)

__all__ = [
    "NULL_PAGE",
    "KVCache",
    "PageAllocator",
    "prefix_keys",
    "init_cache",
    "page_bytes",
    "parse_bytes",
    "pages_for_budget",
    "pages_needed",
    "slot_indices",
    "write_layer_kv",
    "write_layers_kv",
]
