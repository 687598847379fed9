"""RMS normalisation, the one piece of arithmetic every architecture shares (`modules.RMSNorm`
holds its weight)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps):
    """RMSNorm (HF Llama's, and T5LayerNorm: no mean, no bias): normalise in float32, cast back
    to x's dtype, then scale. x [..., D], weight [D]."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)
