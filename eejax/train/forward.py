"""The training forward pass of a Llama: whole right-padded sequences through dense causal
attention, no KV cache, with optional layer dropout that skips the dropped layers' compute."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eejax.models import llama
from eejax.models.rope import inv_frequencies, rope_tables


def layer_states_and_count(params, tokens, lengths, config, skip=None):
    """(states [L, B, T, D], layers computed int32) of right-padded sequences tokens [B, T] with
    lengths [B]. states[l] is the hidden state after layer l. skip [L] bool: layer l passes its
    input through unchanged, and a `lax.cond` runs nothing else for it (LayerSkip's layer dropout,
    one decision per layer for the whole batch). The layers may carry LoRA factors."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    valid = positions < lengths[:, None]
    cos, sin = rope_tables(positions, inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling))
    if skip is None:
        skip = jnp.zeros((config.num_layers,), bool)

    def compute(h, lp):
        return llama.causal_layer(lp, h, cos, sin, valid, config), jnp.int32(1)

    def body(carry, xs):
        h, count = carry
        lp, skipped = xs
        h, ran = jax.lax.cond(skipped, lambda h, lp: (h, jnp.int32(0)), compute, h, lp)
        return (h, count + ran), h

    (_, count), states = jax.lax.scan(body, (llama.embed(params, tokens), jnp.int32(0)), (params["layers"], skip))
    return states, count


def layer_states(params, tokens, lengths, config, skip=None):
    """Hidden states after every layer, [L, B, T, D] (see `layer_states_and_count`)."""
    return layer_states_and_count(params, tokens, lengths, config, skip)[0]
