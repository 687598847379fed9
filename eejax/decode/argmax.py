"""`argmax`: the index of the largest value along the last axis, as `jnp.argmax` gives it (the
first maximum; a NaN counts as the largest), on a CPU in one pass of the kernel library.

XLA:CPU runs `jnp.argmax` as a variadic (value, index) reduce, element by element: ~245 µs over
SmolLM2's 49152 logits at batch 1 (~930 at batch 8). The maximum and then the first index that
holds it are two plain reductions that it vectorises: ~75 µs (~220); in a SmolLM2 decode step on
the GGUF blocks (int16 activations) that was 1.12x tokens/s at batch 1 and 1.05x at batch 8
(alternating pairs in one process). Over a verify pass's 5 rows they still took ~0.38 ms of a
`draft:4` round; the library's one pass (`kernels.cpu_elementwise.argmax`) takes their place where
it applies (float32 on one CPU device), the two reductions where the library is not built. A GPU
keeps `jnp.argmax` (one pass over the logits), and so does a mesh: its partitioner exchanges each
vocabulary shard's (max, index) pair for it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eejax.kernels import cpu_elementwise
from eejax.kernels.backend import backend


def argmax(x):
    """x [..., V] float -> int32 [...]: `jnp.argmax(x, axis=-1)`, the same index in every case."""
    if backend() != "cpu" or not jax.sharding.get_abstract_mesh().empty:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    if (index := cpu_elementwise.argmax(x)) is not None:
        return index
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where((x == top) | jnp.isnan(x), index, x.shape[-1]), axis=-1)
