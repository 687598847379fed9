"""T5's relative-position bias: the bucket of (key position - query position), looked up in a
small `[num_buckets, heads]` table (the attention kernels compute it per score, so no
[B, H, q, k] bias tensor is ever made)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RelativePositionBias:
    """How positions map to buckets (static); the table itself is passed as an array."""

    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = False  # the encoder's self-attention; the decoder's is causal

    @property
    def half(self) -> int:
        """Buckets per direction."""
        return self.num_buckets // 2 if self.bidirectional else self.num_buckets

    @property
    def max_exact(self) -> int:
        """Distances below this get a bucket each; larger ones share log-spaced buckets."""
        return self.half // 2

    @property
    def log_scale(self) -> float:
        """(half - max_exact) / log(max_distance / max_exact): log-distance to bucket offset."""
        return (self.half - self.max_exact) / math.log(self.max_distance / self.max_exact)


def relative_position_bucket(relative, spec: RelativePositionBias):
    """HF T5's `_relative_position_bucket` for relative = key position - query position (int32)."""
    relative = jnp.asarray(relative, jnp.int32)
    if spec.bidirectional:
        bucket = jnp.where(relative > 0, spec.half, 0)
        distance = jnp.abs(relative)
    else:
        bucket = jnp.zeros_like(relative)
        distance = jnp.maximum(-relative, 0)
    far = jnp.maximum(distance, spec.max_exact).astype(jnp.float32)
    large = spec.max_exact + (jnp.log(far / spec.max_exact) * spec.log_scale).astype(jnp.int32)
    large = jnp.minimum(large, spec.half - 1)
    return bucket + jnp.where(distance < spec.max_exact, distance, large)
