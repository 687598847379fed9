"""The arithmetic every architecture shares: RMS normalisation (`modules.RMSNorm` holds its
weight), and row sums and softmaxes whose bits do not depend on how many rows run."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eejax.kernels import cpu_elementwise
from eejax.kernels.backend import backend


def rms_norm(x, weight, eps):
    """RMSNorm (HF Llama's, and T5LayerNorm: no mean, no bias): normalise in float32, cast back
    to x's dtype, then scale. x [..., D], weight [D]. float32 on a CPU: eejax's kernel, whose
    bits do not depend on the program or the rows around x (`kernels.cpu_elementwise`)."""
    return cpu_elementwise.rms_norm(x, weight, eps)


def row_sum(x):
    """x [..., N] -> [...]: the sum over the last axis, each row's in one fixed order whatever
    the number of rows beside it (batch invariance: a row decoded alone, in a verify pass or in a
    batch of 8 gets the same bits).

    On a CPU, XLA's reduction vectorises across rows once there are 8 or more of them, which
    changes the order a row's terms are added in (576 terms: ~10% of rows differ in their last
    bit). Here the row is halved and its halves added, elementwise, until one term is left
    (zero-padded to a power of two): elementwise adds are exact per element however XLA vectorises
    them. A GPU and a mesh keep `jnp.sum` (one reduction; their invariance is the fused kernels')."""
    if backend() != "cpu" or not jax.sharding.get_abstract_mesh().empty:
        return jnp.sum(x, axis=-1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def log_softmax(x):
    """`jax.nn.log_softmax` over the last axis, its normaliser a `row_sum` (a row's log-probs do
    not depend on the rows beside it)."""
    x = x.astype(jnp.float32)
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - jnp.log(row_sum(jnp.exp(shifted)))[..., None]


def softmax(x):
    """`jax.nn.softmax` over the last axis, its normaliser a `row_sum`."""
    return jnp.exp(log_softmax(x))
