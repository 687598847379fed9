"""Confidence measures of early exit (CALM) and the decaying threshold, per row."""

from __future__ import annotations

import math

import jax.numpy as jnp

from eejax.decode.argmax import argmax
from eejax.models.common import row_sum
from eejax.options import ExitConfig


def softmax_margin(logits):
    """Top-1 minus top-2 probability: logits [B, V] -> [B] float32 in [0, 1].

    From the two largest logits and the softmax normaliser, (1 - exp(l2 - l1)) / sum(exp(l - l1)):
    no probability vector and no `lax.top_k` (which is ~30x slower on CPU at batch 8).
    """
    x = logits.astype(jnp.float32)
    top1 = jnp.max(x, axis=-1, keepdims=True)
    first = argmax(x)[:, None]
    rest = jnp.where(jnp.arange(x.shape[-1]) == first, -jnp.inf, x)  # ties: top2 = top1, margin 0
    top2 = jnp.max(rest, axis=-1, keepdims=True)
    normaliser = row_sum(jnp.exp(x - top1))[:, None]
    return ((1.0 - jnp.exp(top2 - top1)) / normaliser)[:, 0]


def state_cosine(h_prev, h):
    """Cosine similarity of each row's hidden state before and after a layer: [B, D] -> [B]."""
    a, b = h_prev.astype(jnp.float32), h.astype(jnp.float32)
    dot = row_sum(a * b)
    norms = jnp.sqrt(row_sum(a * a) * row_sum(b * b))
    return dot / jnp.maximum(norms, 1e-12)


def exit_threshold(config: ExitConfig, t, max_new_tokens: int):
    """λ(t) per row, t [B] the generated position: CALM's clip(0.9·λ + 0.1·exp(-τ·t/N), 0, 1).

    A constant λ without decay; ±inf (never / always) are kept as they are.
    """
    lam = math.inf if config.threshold is None else float(config.threshold)
    t = jnp.asarray(t, jnp.float32)
    if config.decay is None or not math.isfinite(lam):
        return jnp.full(t.shape, lam, jnp.float32)
    decayed = 0.9 * lam + 0.1 * jnp.exp(-config.decay * t / max_new_tokens)
    return jnp.clip(decayed, 0.0, 1.0)
