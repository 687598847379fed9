"""Pieces every architecture shares: RMS normalisation, the embedding lookup, the LM head's matmul."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps):
    """RMSNorm (HF Llama's, and T5LayerNorm: no mean, no bias): normalise in float32, cast back
    to x's dtype, then scale. x [..., D], weight [D]."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def embed(params, tokens):
    """tokens [B, T] int32 -> hidden [B, T, D] (rows of params["embed"] [V, D])."""
    return params["embed"][tokens]


def head_matmul(x, params, tied: bool, weight=None):
    """x [..., D] against the head (embed [V, D] when tied, lm_head [D, V]) or `weight` in the
    same layout: float32 [..., V]."""
    if tied:  # contract with embed's rows directly: `embed.T` would be copied
        w = params["embed"] if weight is None else weight
        return jnp.einsum("...d,vd->...v", x, w, preferred_element_type=jnp.float32)
    return jnp.matmul(x, params["lm_head"] if weight is None else weight, preferred_element_type=jnp.float32)
