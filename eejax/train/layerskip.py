"""LayerSkip's training recipe for an eejax Llama (LayerSkip paper, Sec. 4.1-4.2): layer dropout
and the early-exit loss through the shared LM head, with their curricula, on LoRA factors or on
the whole model.

- Layer dropout: layer l (0-based) is skipped with p_l = S(t) D(l) p_max, D(l) = exp(l ln2 / (L-1))
  - 1 (0 for the first layer, 1 for the last), S(t) = 1 for fine-tuning or exp(t ln2 / T) - 1 with
  the temporal curriculum. The paper draws per sample; here one draw per layer and step covers
  the whole batch (`skipped_layers`), so a dropped layer is skipped by a `lax.cond` and costs
  nothing, forward and backward. A per-sample draw inside a dense batch computes every layer for
  the rows that keep it, which saves no time. Over many small steps both give each layer the same
  expected dropout rate.
- Early-exit loss: sum_l ẽ(t, l) KL(target || head(h_l)) (the paper's CE less the target's
  entropy), ẽ = C(t, l) e(l) / sum_i C(t, i) e(i),
  e(l) = e_scale sum_{i<=l} i for l < L-1 and L-1 + e_scale sum_{i<=L-2} i for the last layer.
  Only the layers with ẽ > 0 evaluate the head (their count is static per step, their indices
  traced, so a run compiles one program per count).
- Curriculum C(t, l) over the eligible exits (`exit_layers`, default every layer): "rotational"
  (every R-th eligible exit, rotating by one each step), "gradual" (enabled from the deepest
  eligible exit down, one more every T / 2(n+1) steps) or "all". The last layer's loss is always on.
- Targets: a distribution per position (`DistillBatch`), e.g. the original model's top-k
  next-token probabilities (self-distillation), or the next token with probability 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eejax.errors import EejaxError
from eejax.models import llama
from eejax.train.forward import layer_states_and_count

CURRICULA = ("rotational", "gradual", "all")


@dataclasses.dataclass(frozen=True)
class LayerSkipConfig:
    p_max: float = 0.1
    e_scale: float = 0.2
    curriculum: str = "rotational"
    rotation: int = 8  # R of the rotational curriculum
    total_steps: int = 1000  # T
    dropout_curriculum: bool = False  # S(t) = exp(t ln2 / T) - 1 instead of 1
    exit_layers: tuple[int, ...] | None = None  # exits with a loss, as layers run in [1, L) (None: all)

    def __post_init__(self):
        if not 0 <= self.p_max <= 1 or not 0 <= self.e_scale <= 1:
            raise EejaxError(f"p_max and e_scale must lie in [0, 1], got {self.p_max} and {self.e_scale}")
        if self.curriculum not in CURRICULA:
            raise EejaxError(f"unknown curriculum {self.curriculum!r}; choose one of: " + ", ".join(CURRICULA))
        if self.rotation < 1 or self.total_steps < 1:
            raise EejaxError("rotation and total_steps must be >= 1")
        if self.exit_layers is not None:
            e = list(self.exit_layers)
            if not e or e != sorted(set(e)) or e[0] < 1:
                raise EejaxError(f"exit layers must be distinct increasing layer counts >= 1, got {e}")

    def eligible(self, num_layers: int) -> np.ndarray:
        """0-based layer indices that may carry an early-exit loss (the last layer excluded)."""
        if self.exit_layers is None:
            return np.arange(num_layers - 1)
        if self.exit_layers[-1] >= num_layers:
            raise EejaxError(f"exit layers must be layer counts in [1, {num_layers - 1}], got {list(self.exit_layers)}")
        return np.asarray(self.exit_layers) - 1


def dropout_rates(cfg: LayerSkipConfig, step: int, num_layers: int) -> np.ndarray:
    """p_l for l = 0..L-1 at training step `step`."""
    l = np.arange(num_layers)
    depth = np.exp(l * math.log(2) / max(num_layers - 1, 1)) - 1
    time = math.exp(step * math.log(2) / cfg.total_steps) - 1 if cfg.dropout_curriculum else 1.0
    return (time * depth * cfg.p_max).astype(np.float32)


def skipped_layers(cfg: LayerSkipConfig, step: int, num_layers: int, seed: int = 0) -> np.ndarray:
    """The layers dropped at `step` [L] bool: one draw per layer from (seed, step), so a resumed
    run drops what an uninterrupted one would."""
    draw = np.random.default_rng([seed, step, 7]).random(num_layers)
    return draw < dropout_rates(cfg, step, num_layers)


def exit_loss_scales(cfg: LayerSkipConfig, step: int, num_layers: int) -> np.ndarray:
    """ẽ(t, l) for l = 0..L-1 (sums to 1; 0 for the exits the curriculum leaves off)."""
    L = num_layers
    e = np.array([cfg.e_scale * l * (l + 1) / 2 for l in range(L)], np.float64)
    e[L - 1] = L - 1 + cfg.e_scale * (L - 2) * (L - 1) / 2
    eligible = cfg.eligible(L)
    n = len(eligible)
    if cfg.curriculum == "rotational":
        chosen = eligible[(np.arange(n) - step) % cfg.rotation == 0]
    elif cfg.curriculum == "gradual":
        every = max(cfg.total_steps / (2 * (n + 1)), 1e-9)
        chosen = eligible[np.arange(n) >= n - int(step // every)]
    else:
        chosen = eligible
    on = np.zeros(L, bool)
    on[chosen] = True
    on[L - 1] = True
    scaled = np.where(on, e, 0.0)
    return (scaled / scaled.sum()).astype(np.float32)


def enabled_exits(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(layer indices [n] int32, their scales [n]) of the heads a step evaluates: ẽ > 0."""
    index = np.flatnonzero(scales > 0).astype(np.int32)
    return index, scales[index].astype(np.float32)


class DistillBatch(NamedTuple):
    """Right-padded sequences and a target distribution per position.

    tokens [B, T] int32, lengths [B] int32, weights [B, T] float32 (how much position t's loss
    counts; 0 for padding), target_ids / target_probs [B, T, K]: the next-token distribution
    to learn at position t: the probabilities of K token ids, and 1 - their sum on all the other
    tokens together (a teacher's top K keeps its tail's mass this way)."""

    tokens: jax.Array
    lengths: jax.Array
    weights: jax.Array
    target_ids: jax.Array
    target_probs: jax.Array


def label_batch(tokens, lengths) -> DistillBatch:
    """The data's own next tokens as targets (K = 1), on every position but a row's last."""
    tokens, lengths = np.asarray(tokens, np.int32), np.asarray(lengths, np.int32)
    ids = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)[..., None]
    weights = (np.arange(tokens.shape[1])[None] < lengths[:, None] - 1).astype(np.float32)
    return DistillBatch(tokens, lengths, weights, ids, np.ones(ids.shape, np.float32))


def merged_params(trainable: dict, frozen: dict) -> dict:
    """The params the forward runs on: `frozen` with `trainable` laid over it, layer by layer
    (full fine-tuning trains whole arrays; LoRA adds `name_a` / `name_b` factors to "layers")."""
    layers = {**frozen["layers"], **trainable.get("layers", {})}
    return {**frozen, **trainable, "layers": layers}


def distill_loss(logits, batch: DistillBatch):
    """Weighted mean over positions of KL(target || softmax(logits)) over K + 1 outcomes: the K
    target ids and "any other token" (the target's missing mass against the model's mass off
    the K ids), so a model that matches its targets scores 0 and a top-K target does not teach
    the model to drop its tail. logits [B, T, V] (any float), batch targets [B, T, K]."""
    logits = logits.astype(jnp.float32)
    norm = jax.nn.logsumexp(logits, axis=-1)
    p = batch.target_probs
    logq = jnp.take_along_axis(logits, batch.target_ids, axis=-1) - norm[..., None]
    kl = jnp.sum(p * (jnp.log(jnp.maximum(p, 1e-30)) - logq), -1)
    p_rest = jnp.maximum(1.0 - jnp.sum(p, -1), 0.0)
    others = jnp.put_along_axis(logits, batch.target_ids, -jnp.inf, axis=-1, inplace=False)
    logq_rest = jax.nn.logsumexp(others, axis=-1) - norm
    rest = jnp.where(p_rest > 1e-6, p_rest * (jnp.log(jnp.maximum(p_rest, 1e-30)) - logq_rest), 0.0)
    return jnp.sum((kl + rest) * batch.weights) / jnp.maximum(jnp.sum(batch.weights), 1e-9)


def at_positions(batch: DistillBatch, positions) -> DistillBatch:
    """The batch's targets at positions [B, P] of each row (tokens and lengths unchanged)."""
    rows = jnp.arange(positions.shape[0])[:, None]
    return batch._replace(
        weights=batch.weights[rows, positions],
        target_ids=batch.target_ids[rows, positions],
        target_probs=batch.target_probs[rows, positions],
    )


def layerskip_loss(trainable, frozen, batch: DistillBatch, skip, exit_index, exit_scale, config, exit_positions=None):
    """sum_i exit_scale[i] KL(targets || head(h after layer exit_index[i])), with the layers in
    `skip` [L] dropped. exit_index ends with the last layer, whose loss covers every position;
    the early exits' losses cover `exit_positions` [B, P] of each row (None: all), so a step
    evaluates the shared head on P instead of T positions per early exit. Returns (loss,
    (per-exit losses [n], layers computed, heads evaluated))."""
    params = merged_params(trainable, frozen)
    states, layers_run = layer_states_and_count(params, batch.tokens, batch.lengths, config, skip)

    def head_loss(state, targets):
        return distill_loss(llama.lm_head(params, state, config), targets)

    early = states[exit_index[:-1]]
    targets = batch
    if exit_positions is not None:
        early, targets = (
            early[:, jnp.arange(early.shape[1])[:, None], exit_positions],
            at_positions(batch, exit_positions),
        )

    def body(heads, state):  # one early head's logits alive at a time, forward and backward
        return heads + 1, jax.checkpoint(head_loss)(state, targets)

    heads, losses = jax.lax.scan(body, jnp.int32(1), early)
    losses = jnp.append(losses, head_loss(states[exit_index[-1]], batch))
    return jnp.sum(exit_scale * losses), (losses, layers_run, heads)


@functools.partial(jax.jit, static_argnames=("config", "optimizer"), donate_argnums=(0, 1))
def layerskip_train_step(
    trainable,
    opt_state,
    frozen,
    batch: DistillBatch,
    skip,
    exit_index,
    exit_scale,
    exit_positions=None,
    *,
    config,
    optimizer,
):
    """One optax step on `trainable` (LoRA factors or whole params, see `merged_params`) with
    layers `skip` [L] dropped and heads at `exit_index` [n] (ending with the last layer)
    weighted `exit_scale` [n] (`enabled_exits` of the step's `exit_loss_scales`); see
    `layerskip_loss` for `exit_positions`. Full fine-tuning passes the whole params as
    `trainable` and {"layers": {}} as `frozen`. Returns (trainable, opt_state, loss, (per-exit
    losses, layers computed, heads evaluated))."""
    (loss, aux), grads = jax.value_and_grad(layerskip_loss, has_aux=True)(
        trainable, frozen, batch, skip, exit_index, exit_scale, config, exit_positions
    )
    updates, opt_state = optimizer.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, loss, aux
