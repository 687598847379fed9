"""Rotary position embeddings (the HF Llama "rotate half" layout), with Llama 3.x scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from eejax.config import RopeScaling
from eejax.kernels import cpu_elementwise


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies `[head_dim // 2]` (float32), scaled as the checkpoint says."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_tables(positions, inv_freq):
    """cos, sin `[B, T, head_dim]` (float32) for integer positions `[B, T]` (on a CPU by eejax's
    kernel: `kernels.cpu_elementwise.rope_tables`)."""
    return cpu_elementwise.rope_tables(positions, inv_freq)


def apply_rope(x, cos, sin):
    """Rotates `x [B, T, H, Dh]` by the tables `[B, T, Dh]`; computed in float32 (on a CPU by
    eejax's kernel: `kernels.cpu_elementwise.rope`)."""
    xf = x.astype(jnp.float32)
    out = cpu_elementwise.rope(xf, cos, sin)
    return out.astype(x.dtype)
