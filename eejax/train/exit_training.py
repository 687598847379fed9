"""Training exits on a frozen backbone: adapters by self-distillation (EE-Tuning style) and
CALM's exit classifiers.

Every exit l < L (after l layers) is pulled towards the full model's next-token distribution:
loss = sum_l w_l KL(p_L || q_l) averaged over the valid tokens, with q_l the exit head (adapter
+ the shared final norm and LM head) on the layer-l hidden state. Gradients reach only
`params["exits"]`; the backbone and its hidden states are constants.

The classifier of exit l learns CALM's independent objective: label 1 when exit l's argmax
equals the last layer's, class-balanced binary cross-entropy, everything else frozen.

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


def classifier_loss(exit_params, params, states, valid, config):
    """Class-balanced BCE of every exit classifier l < L against "exit l's argmax equals the
    last layer's" over valid tokens; the adapters (if any) define exit l's argmax and stay fixed."""
    from eejax.models import exits as exit_modules

    m = model_module(config)
    frozen = {**params, "exits": jax.lax.stop_gradient(exit_params)}
    final = jnp.argmax(m.lm_head(params, states[-1], config), axis=-1)

    def body(total, xs):
        state, layers_run = xs
        label = jnp.argmax(exit_logits(frozen, state, layers_run, config), axis=-1) == final
        prob = exit_modules.classifier_prob(exit_params, state, layers_run - 1)
        pos = valid & label
        neg = valid & ~label
        # Each class weighs half, whatever its share (tokens of an absent class weigh nothing).
        pos_loss = -jnp.sum(jnp.where(pos, jnp.log(prob + 1e-7), 0.0)) / jnp.maximum(pos.sum(), 1)
        neg_loss = -jnp.sum(jnp.where(neg, jnp.log1p(-prob + 1e-7), 0.0)) / jnp.maximum(neg.sum(), 1)
        return total + 0.5 * (pos_loss + neg_loss), None

    exits_run = jnp.arange(1, config.num_layers, dtype=jnp.int32)
    total, _ = jax.lax.scan(body, jnp.float32(0.0), (states[:-1], exits_run))
    return total / (config.num_layers - 1)


@functools.partial(jax.jit, static_argnames=("config", "optimizer"))
def classifier_train_step(exit_params, opt_state, params, tokens, lengths, *, config, optimizer):
    """One optax step on the exit classifiers (the adapters' gradients are zero). Returns
    (exit_params, opt_state, loss)."""
    states = jax.lax.stop_gradient(layer_states(params, tokens, lengths, config))
    valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    loss, grads = jax.value_and_grad(classifier_loss)(exit_params, params, states, valid, config)
    updates, opt_state = optimizer.update(grads, opt_state, exit_params)
    return optax.apply_updates(exit_params, updates), opt_state, loss
