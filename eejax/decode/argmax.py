"""`argmax`: the index of the largest value along the last axis, as `jnp.argmax` gives it (the
first maximum; a NaN counts as the largest), at XLA:CPU's speed for plain reductions.

XLA:CPU runs `jnp.argmax` as a variadic (value, index) reduce, element by element: ~245 µs over
SmolLM2's 49152 logits at batch 1 (~930 at batch 8). The maximum and then the first index that
holds it are two plain reductions that it vectorises: ~75 µs (~220). In a SmolLM2 decode step on
the GGUF blocks (int16 activations) that was 1.12x tokens/s at batch 1 and 1.05x at batch 8
(alternating pairs in one process). A GPU keeps `jnp.argmax` (one pass over the logits), and so
does a mesh: its partitioner exchanges each vocabulary shard's (max, index) pair for it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eejax.kernels.backend import backend


def argmax(x):
    """x [..., V] float -> int32 [...]: `jnp.argmax(x, axis=-1)`, the same index in every case."""
    if backend() != "cpu" or not jax.sharding.get_abstract_mesh().empty:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where((x == top) | jnp.isnan(x), index, x.shape[-1]), axis=-1)
