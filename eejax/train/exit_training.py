"""Training exit adapters on a frozen backbone by self-distillation (EE-Tuning style).

Every exit l < L (after l layers) is pulled towards the full model's next-token distribution:
loss = sum_l w_l KL(p_L || q_l) averaged over the valid tokens, with q_l the exit head (adapter
+ the shared final norm and LM head) on the layer-l hidden state. Gradients reach only
`params["exits"]`; the backbone and its hidden states are constants.

Layer weights (normalised to sum 1): "calm" w_l ∝ l (CALM's weighted average), "layerskip"
w_l ∝ sum_{i<=l} i (LayerSkip's e(l) scale, later exits weigh more), "uniform".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eejax.cache import init_cache
from eejax.decode.steps import exit_logits, model_module
from eejax.errors import EejaxError

LAYER_WEIGHTS = ("calm", "layerskip", "uniform")


def layer_weights(kind: str, num_layers: int) -> np.ndarray:
    """Weights [L - 1] of exits 1..L-1, summing to 1."""
    exits = np.arange(1, num_layers, dtype=np.float64)
    if kind == "calm":
        w = exits
    elif kind == "layerskip":
        w = np.cumsum(exits)
    elif kind == "uniform":
        w = np.ones_like(exits)
    else:
        raise EejaxError(f"unknown layer weights {kind!r}; choose one of: " + ", ".join(LAYER_WEIGHTS))
    return (w / w.sum()).astype(np.float32)


def layer_states(params, tokens, lengths, config, page_size: int = 16):
    """Hidden states after every layer, [L, B, T, D], of right-padded sequences tokens [B, T]
    (a causal pass over a scratch paged cache)."""
    m = model_module(config)
    b, t = tokens.shape
    pages = -(-t // page_size)
    cache = init_cache(config.num_layers, 1 + b * pages, page_size, config.num_kv_heads, config.head_dim,
                       params["embed"].dtype)
    table = 1 + jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    batch = m.token_batch(config, positions, positions < lengths[:, None], table, lengths, page_size)

    def body(carry, layer):
        h, cache = carry
        h, cache = m.decoder_layer(params, h, cache, layer, batch, config)
        return (h, cache), h

    _, states = jax.lax.scan(body, (m.embed(params, tokens), cache), jnp.arange(config.num_layers))
    return states


def distillation_loss(exit_params, params, states, valid, weights, config):
    """sum_l w_l KL(p_L || q_l) over valid tokens [B, T]; states [L, B, T, D] (constants)."""
    m = model_module(config)
    teacher = jax.nn.log_softmax(m.lm_head(params, states[-1], config))
    teacher_p = jnp.exp(teacher)
    with_exits = {**params, "exits": exit_params}
    count = jnp.maximum(valid.sum(), 1)

    @jax.checkpoint  # one exit's [B, T, V] logits alive at a time
    def exit_kl(state, layers_run):
        student = jax.nn.log_softmax(exit_logits(with_exits, state, layers_run, config))
        kl = jnp.sum(teacher_p * (teacher - student), axis=-1)
        return jnp.sum(jnp.where(valid, kl, 0.0)) / count

    def body(total, xs):
        state, layers_run, w = xs
        return total + w * exit_kl(state, layers_run), None

    exits_run = jnp.arange(1, config.num_layers, dtype=jnp.int32)
    total, _ = jax.lax.scan(body, jnp.float32(0.0), (states[:-1], exits_run, weights))
    return total


@functools.partial(jax.jit, static_argnames=("config", "optimizer"))
def train_step(exit_params, opt_state, params, tokens, lengths, weights, *, config, optimizer):
    """One optax step on the exits. Returns (exit_params, opt_state, loss)."""
    states = jax.lax.stop_gradient(layer_states(params, tokens, lengths, config))
    valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    loss, grads = jax.value_and_grad(distillation_loss)(exit_params, params, states, valid, weights, config)
    updates, opt_state = optimizer.update(grads, opt_state, exit_params)
    return optax.apply_updates(exit_params, updates), opt_state, loss
