"""Next-token choice from logits: greedy, or temperature with top-k / top-p filtering.

Randomness is per row and per position: the token a row generates at (absolute) index t is drawn
with `token_keys(keys, t, stream)`, the row's own key folded with t and a stream id. So a row's
sampled tokens depend only on its key and its inputs: not on the other rows of the batch, the
batch's size, or a preemption that makes the engine recompute the row."""

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


# Streams of random numbers a row draws at one position (see `token_keys`).
SAMPLE, DRAFT, ACCEPT, RESAMPLE = range(4)


def seed_key(seed: int):
    """The PRNG key of an integer seed, all 64 bits of it (`jax.random.PRNGKey` keeps only the low
    32 without x64): negative seeds are taken modulo 2^64."""
    seed = int(seed) % 2**64
    return jax.random.fold_in(jax.random.PRNGKey(seed & 0xFFFFFFFF), seed >> 32)


def row_keys(key, index):
    """Per-row PRNG keys [B, 2] from one key: row i of a call gets fold_in(key, index[i]), so a
    row draws the same whatever batch it runs in (and the engine's request with seed s and
    choice j draws what row j of `generate(seed=s)` draws)."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(index, jnp.uint32))


def token_keys(keys, index, stream: int):
    """keys [B, 2], index [B] (each row's absolute token index) -> the rows' keys [B, 2] for that
    token in `stream` (SAMPLE, DRAFT, ACCEPT or RESAMPLE)."""
    return jax.vmap(lambda k, i: jax.random.fold_in(jax.random.fold_in(k, i), stream))(keys, index)


def sample(logits, keys, params: SamplingParams):
    """logits [B, V], keys [B, 2] (one per row, see `token_keys`) -> token ids [B] int32."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filtered_logits(logits, params)
    return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)


def logprobs_of(logits, params: SamplingParams):
    """Log-probabilities [B, V] f32 of the distribution a token is drawn from: the model's softmax
    at temperature 0 (which draws nothing), else after temperature, top-k and top-p (tokens
    filtered out get -inf): vLLM's "processed" logprobs."""
    if params.temperature == 0:
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jax.nn.log_softmax(filtered_logits(logits, params), axis=-1)
