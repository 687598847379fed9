"""LoRA on a Llama's stacked layer weights: low-rank factors trained unmerged, merged at load.

A factor pair of projection `name` (one of `TARGETS`) lives in the layer params next to it:
`name + "_a"` [L, D_in, r] (random, scaled by 1/sqrt(D_in)) and `name + "_b"` [L, r, D_out] (zeros, so an
untrained LoRA changes nothing). The layer computes x @ W + (x @ a) @ b (`llama.linear`); merging
adds a @ b to W, so the merged model's logits equal the unmerged forward's up to float rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from eejax.errors import EejaxError

TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def init_lora(layers: dict, rank: int, key) -> dict:
    """Factors for every target of the stacked `layers` (the params' "layers" dict)."""
    if rank < 1:
        raise EejaxError(f"the LoRA rank must be >= 1, got {rank}")
    factors = {}
    for name, k in zip(TARGETS, jax.random.split(key, len(TARGETS))):
        w = layers[name]
        n, d_in, d_out = w.shape
        if rank > min(d_in, d_out):
            raise EejaxError(f"the LoRA rank {rank} exceeds {name}'s smaller side {min(d_in, d_out)}")
        factors[name + "_a"] = (jax.random.normal(k, (n, d_in, rank), jnp.float32) / np.sqrt(d_in)).astype(w.dtype)
        factors[name + "_b"] = jnp.zeros((n, rank, d_out), w.dtype)
    return factors


def lora_rank(factors: dict) -> int:
    return int(factors[TARGETS[0] + "_a"].shape[-1])


def check_lora(factors: dict, layers: dict) -> None:
    """A named error unless `factors` hold an a/b pair of matching shapes for every target."""
    for name in TARGETS:
        a, b = factors.get(name + "_a"), factors.get(name + "_b")
        if a is None or b is None:
            raise EejaxError(f"the LoRA delta lacks {name}_a / {name}_b")
        n, d_in, d_out = layers[name].shape
        if a.shape[:2] != (n, d_in) or b.shape[0] != n or b.shape[2] != d_out or a.shape[2] != b.shape[1]:
            raise EejaxError(
                f"the LoRA factors of {name} ({a.shape} x {b.shape}) do not fit its weight {layers[name].shape}"
            )


@jax.jit
def _merged(w, a, b):
    return (w.astype(jnp.float32) + jnp.einsum("ldr,lro->ldo", a.astype(jnp.float32), b.astype(jnp.float32))).astype(
        w.dtype
    )


def merge_lora(params: dict, factors: dict) -> dict:
    """params with W + a @ b for every target (computed in float32, stored in W's dtype)."""
    check_lora(factors, params["layers"])
    layers = dict(params["layers"])
    for name in TARGETS:
        layers[name] = _merged(layers[name], factors[name + "_a"], factors[name + "_b"])
    return {**params, "layers": layers}


def with_lora(params: dict, factors: dict) -> dict:
    """params whose layers also carry the unmerged factors (the training forward)."""
    return {**params, "layers": {**params["layers"], **factors}}
