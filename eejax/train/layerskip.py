"""LayerSkip's training recipe for full fine-tuning of an eejax Llama: layer dropout and the
early-exit loss through the shared LM head, with their curricula (LayerSkip paper, Sec. 4.1-4.2).

- Layer dropout, per sample: layer l (0-based) is skipped with p_l = S(t) D(l) p_max,
  D(l) = exp(l ln2 / (L-1)) - 1 (0 for the first layer, 1 for the last), S(t) = 1 for
  fine-tuning or exp(t ln2 / T) - 1 with the temporal curriculum.
- Early-exit loss: sum_l ẽ(t, l) CE(head(h_l), next token), ẽ = C(t, l) e(l) / sum_i C(t, i) e(i),
  e(l) = e_scale sum_{i<=l} i for l < L-1 and L-1 + e_scale sum_{i<=L-2} i for the last layer.
- Curriculum C(t, l): "rotational" (exits at every R-th layer, rotating by one each step),
  "gradual" (exits enabled from layer L-1 down to 0, one more every T / 2L steps) or "all". The
  last layer's loss is always on.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eejax.decode.steps import model_module
from eejax.errors import EejaxError
from eejax.train.exit_training import layer_states

CURRICULA = ("rotational", "gradual", "all")


@dataclasses.dataclass(frozen=True)
class LayerSkipConfig:
    p_max: float = 0.1
    e_scale: float = 0.2
    curriculum: str = "rotational"
    rotation: int = 8  # R of the rotational curriculum
    total_steps: int = 1000  # T
    dropout_curriculum: bool = False  # S(t) = exp(t ln2 / T) - 1 instead of 1

    def __post_init__(self):
        if not 0 <= self.p_max <= 1 or not 0 <= self.e_scale <= 1:
            raise EejaxError(f"p_max and e_scale must lie in [0, 1], got {self.p_max} and {self.e_scale}")
        if self.curriculum not in CURRICULA:
            raise EejaxError(f"unknown curriculum {self.curriculum!r}; choose one of: " + ", ".join(CURRICULA))
        if self.rotation < 1 or self.total_steps < 1:
            raise EejaxError("rotation and total_steps must be >= 1")


def dropout_rates(cfg: LayerSkipConfig, step: int, num_layers: int) -> np.ndarray:
    """p_l for l = 0..L-1 at training step `step`."""
    l = np.arange(num_layers)
    depth = np.exp(l * math.log(2) / max(num_layers - 1, 1)) - 1
    time = math.exp(step * math.log(2) / cfg.total_steps) - 1 if cfg.dropout_curriculum else 1.0
    return (time * depth * cfg.p_max).astype(np.float32)


def exit_loss_scales(cfg: LayerSkipConfig, step: int, num_layers: int) -> np.ndarray:
    """ẽ(t, l) for l = 0..L-1 (sums to 1)."""
    L = num_layers
    e = np.array([cfg.e_scale * l * (l + 1) / 2 for l in range(L)], np.float64)
    e[L - 1] = L - 1 + cfg.e_scale * (L - 2) * (L - 1) / 2
    layers = np.arange(L)
    if cfg.curriculum == "rotational":
        on = (layers - step) % cfg.rotation == 0
    elif cfg.curriculum == "gradual":
        every = max(cfg.total_steps / (2 * L), 1e-9)
        on = layers >= L - 1 - int(step // every)
    else:
        on = np.ones(L, bool)
    on[L - 1] = True
    scaled = np.where(on, e, 0.0)
    return (scaled / scaled.sum()).astype(np.float32)


def states_with_layer_dropout(params, tokens, lengths, rates, key, config):
    """Hidden states after every layer [L, B, T, D]; row b skips layer l with probability rates[l]."""
    drop = jax.random.uniform(key, (config.num_layers, tokens.shape[0])) < rates[:, None]
    return layer_states(params, tokens, lengths, config, skip=drop)


def layerskip_loss(params, tokens, lengths, rates, scales, key, config):
    """sum_l scales[l] CE(head(h_l), next token) over the valid next-token positions."""
    m = model_module(config)
    states = states_with_layer_dropout(params, tokens, lengths, rates, key, config)
    targets = jnp.roll(tokens, -1, axis=1)
    valid = jnp.arange(tokens.shape[1])[None, :] < (lengths - 1)[:, None]
    count = jnp.maximum(valid.sum(), 1)

    @jax.checkpoint
    def layer_ce(state):
        logp = jax.nn.log_softmax(m.lm_head(params, state, config))
        ce = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(valid, ce, 0.0)) / count

    def body(total, xs):
        state, scale = xs
        return total + jnp.where(scale > 0, scale * layer_ce(state), 0.0), None

    total, _ = jax.lax.scan(body, jnp.float32(0.0), (states, scales))
    return total


@functools.partial(jax.jit, static_argnames=("config", "optimizer"))
def layerskip_train_step(params, opt_state, tokens, lengths, rates, scales, key, *, config, optimizer):
    """One full fine-tuning step with layer dropout `rates` [L] and early-exit loss `scales` [L]
    (from `dropout_rates` / `exit_loss_scales` of the step). Returns (params, opt_state, loss)."""
    loss, grads = jax.value_and_grad(layerskip_loss)(params, tokens, lengths, rates, scales, key, config)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
