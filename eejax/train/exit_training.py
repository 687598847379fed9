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
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eejax.decode.steps import exit_logits
from eejax.errors import EejaxError
from eejax.models.registry import model_module
from eejax.train.forward import layer_states

LAYER_WEIGHTS = ("calm", "layerskip", "uniform")


def layer_weights(kind: str, num_layers: int, exit_layers=None) -> np.ndarray:
    """Weights of the trained exits (layers run, default 1..L-1), summing to 1: "calm" w_l ∝ l,
    "layerskip" w_l ∝ sum_{i<=l} i, "uniform"."""
    exits = np.arange(1, num_layers, dtype=np.float64) if exit_layers is None else np.asarray(exit_layers, np.float64)
    if kind == "calm":
        w = exits
    elif kind == "layerskip":
        w = exits * (exits + 1) / 2
    elif kind == "uniform":
        w = np.ones_like(exits)
    else:
        raise EejaxError(f"unknown layer weights {kind!r}; choose one of: " + ", ".join(LAYER_WEIGHTS))
    return (w / w.sum()).astype(np.float32)


def check_exit_layers(exit_layers, num_layers: int) -> np.ndarray:
    """The exits to train as sorted distinct layers-run counts in [1, L); a named error otherwise."""
    e = np.unique(np.asarray(list(exit_layers), np.int64))
    if e.size == 0 or e[0] < 1 or e[-1] >= num_layers:
        raise EejaxError(f"exit layers must be layer counts in [1, {num_layers - 1}], got {list(exit_layers)}")
    return e.astype(np.int32)


def distillation_loss(exit_params, params, states, valid, exit_layers, weights, config, labels=None, ce_weight=0.0):
    """sum_k w_k [KL(p_L || q_k) + ce_weight * CE(q_k, labels)], each a mean over valid tokens
    [B, T]; q_k is the exit after exit_layers[k] layers; states [L, B, T, D] (constants);
    labels [B, T] next tokens (-1 where there is none)."""
    m = model_module(config)
    teacher = jax.nn.log_softmax(m.lm_head(params, states[-1], config))
    teacher_p = jnp.exp(teacher)
    with_exits = {**params, "exits": exit_params}
    count = jnp.maximum(valid.sum(), 1)
    if labels is None:
        labels = jnp.full(valid.shape, -1, jnp.int32)
    has_label = valid & (labels >= 0)
    label_count = jnp.maximum(has_label.sum(), 1)

    @jax.checkpoint  # one exit's [B, T, V] logits alive at a time
    def exit_loss(state, layers_run):
        student = jax.nn.log_softmax(exit_logits(with_exits, state, layers_run, config))
        kl = jnp.sum(jnp.where(valid, jnp.sum(teacher_p * (teacher - student), axis=-1), 0.0)) / count
        nll = -jnp.take_along_axis(student, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
        return kl + ce_weight * jnp.sum(jnp.where(has_label, nll, 0.0)) / label_count

    def body(total, xs):
        state, layers_run, w = xs
        return total + w * exit_loss(state, layers_run), None

    exit_layers = jnp.asarray(exit_layers, jnp.int32)
    total, _ = jax.lax.scan(body, jnp.float32(0.0), (states[exit_layers - 1], exit_layers, weights))
    return total


class SequenceBatch(NamedTuple):
    """Right-padded training sequences tokens [B, T] int32 with lengths [B] int32; `context`: an
    encoder-decoder's prompts (tokens [B, S], lengths [B]), whose decoder inputs the sequences
    are (None for a decoder-only model). A (tokens, lengths) pair reads as one with no context."""

    tokens: np.ndarray
    lengths: np.ndarray
    context: tuple | None = None


class ExitBatch(NamedTuple):
    """Right-padded sequences tokens [B, T] with lengths [B], and the positions [B, P] whose exits
    are trained (mask [B, P] False for padding): the exit heads cost far more than the backbone,
    so a step trains on a sample of each row's positions while the backbone sees whole rows.
    `context`: an encoder-decoder's prompts (tokens [B, S], lengths [B]); the sequences are then
    its decoder's inputs."""

    tokens: jax.Array
    lengths: jax.Array
    positions: jax.Array
    mask: jax.Array
    context: tuple | None = None


def next_tokens(tokens, lengths):
    """Labels [B, T]: the next token of each position, -1 at a row's last token and padding."""
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    return jnp.where(jnp.arange(tokens.shape[1])[None, :] < lengths[:, None] - 1, shifted, -1)


def sampled_states(params, batch: ExitBatch, config):
    """(states [L, B, P, D], labels [B, P]) at the batch's sampled positions."""
    states = jax.lax.stop_gradient(layer_states(params, batch.tokens, batch.lengths, config, context=batch.context))
    rows = jnp.arange(batch.tokens.shape[0])[:, None]
    labels = next_tokens(batch.tokens, batch.lengths)[rows, batch.positions]
    return states[:, rows, batch.positions], labels


@functools.partial(jax.jit, static_argnames=("config", "optimizer"))
def train_step(
    exit_params, opt_state, params, batch: ExitBatch, exit_layers, weights, ce_weight=0.0, *, config, optimizer
):
    """One optax step on the exit adapters of `exit_layers` [K] weighted by `weights` [K].
    Returns (exit_params, opt_state, loss)."""
    states, labels = sampled_states(params, batch, config)
    loss, grads = jax.value_and_grad(distillation_loss)(
        exit_params, params, states, batch.mask, exit_layers, weights, config, labels, ce_weight
    )
    updates, opt_state = optimizer.update(grads, opt_state, exit_params)
    return optax.apply_updates(exit_params, updates), opt_state, loss


def exit_agreement(model, batches, start: int = 0) -> np.ndarray:
    """Share [L - 1] of the valid positions >= `start` of `batches` (`SequenceBatch`es) where the
    exit after l = 1..L-1 layers picks the last layer's argmax."""
    config = model.config
    agree = np.zeros((config.num_layers - 1,), np.int64)
    total = 0
    for tokens, lengths, context in (SequenceBatch(*b) for b in batches):
        agree += np.asarray(_agreement_counts(model.params, tokens, lengths, start, context, config))
        total += int(np.sum(np.maximum(np.asarray(lengths) - start, 0)))
    return agree / max(total, 1)


@functools.partial(jax.jit, static_argnames=("config",))
def _agreement_counts(params, tokens, lengths, start, context, config):
    states = layer_states(params, tokens, lengths, config, context=context)
    positions = jnp.arange(tokens.shape[1])[None, :]
    valid = (positions < lengths[:, None]) & (positions >= start)
    final = jnp.argmax(model_module(config).lm_head(params, states[-1], config), axis=-1)

    def count(_, xs):
        state, layers_run = xs
        early = jnp.argmax(exit_logits(params, state, layers_run, config), axis=-1)
        return None, jnp.sum(valid & (early == final))

    return jax.lax.scan(count, None, (states[:-1], jnp.arange(1, config.num_layers, dtype=jnp.int32)))[1]


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
def classifier_train_step(exit_params, opt_state, params, tokens, lengths, context=None, *, config, optimizer):
    """One optax step on the exit classifiers (the adapters' gradients are zero); `context` as in
    `ExitBatch`. Returns (exit_params, opt_state, loss)."""
    states = jax.lax.stop_gradient(layer_states(params, tokens, lengths, config, context=context))
    valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    loss, grads = jax.value_and_grad(classifier_loss)(exit_params, params, states, valid, config)
    updates, opt_state = optimizer.update(grads, opt_state, exit_params)
    return optax.apply_updates(exit_params, updates), opt_state, loss
