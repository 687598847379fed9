"""Next-token choice from logits: greedy, or temperature with top-k / top-p filtering."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eejax.errors import EejaxError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise EejaxError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise EejaxError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise EejaxError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def filtered_logits(logits, params: SamplingParams):
    """Temperature-scaled logits `[B, V]` with tokens outside top-k / top-p set to -inf."""
    logits = logits.astype(jnp.float32) / params.temperature
    if params.top_k > 0:
        kth = jax.lax.top_k(logits, params.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if params.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        keep = (cum - jax.nn.softmax(sorted_logits, axis=-1)) < params.top_p
        cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def sample(logits, key, params: SamplingParams):
    """logits [B, V] -> token ids [B] int32."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits, params), axis=-1).astype(jnp.int32)
