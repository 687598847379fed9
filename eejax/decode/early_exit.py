"""One decode step with early exit (Algorithm 1 of the early-exit inference framework paper).

The layers run in a `lax.while_loop` with a traced layer index. After each layer a row may turn
confident (flags only turn on); rows that are padding or finished count as confident from the
start. The loop stops when every row is confident or the last layer ran, so the whole batch
exits at one layer E: the batch waits for its least confident row. Then **KV fill** writes the
K/V of every skipped layer l >= E from the exit hidden state (proj_l(norm_l(h_E)) with rotary),
computed for all layers at once and masked, and the token comes from the exit head at E.

The loop is model-agnostic: a model supplies `ExitFns` (closures over its params and the step's
token batch), so Llama and T5 decoders share this code.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from eejax.cache import NULL_PAGE, KVCache, write_kv_all_layers
from eejax.config import ExitConfig
from eejax.decode.confidence import softmax_margin, state_cosine


class ExitFns(NamedTuple):
    """What the loop needs from a model, for hidden states h [B, T, D] of the new tokens.

    run_layer(layer, h, cache) -> (h, cache): layer `layer` (0-based, traced), writing its K/V.
    exit_logits(h, layers_run) -> [B, V] float32: the exit head after `layers_run` layers
        (last token of each row); the model's own head when layers_run = num_layers.
    exit_prob(h, layers_run) -> [B] float32: the exit classifier's P(exit) (classifier only).
    kv_all_layers(h) -> (k, v) [L, B, T, Hkv, Dh]: every layer's K/V of h (for KV fill).
    """

    run_layer: Callable
    exit_logits: Callable
    exit_prob: Callable | None
    kv_all_layers: Callable


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExitOutcome:
    """logits [B, V] f32 of the exit head; exit_layer int32 scalar (layers run, shared by the
    batch); confident_layer [B] int32 (each row's first confident layer, exit_layer if none)."""

    logits: jax.Array
    cache: KVCache
    exit_layer: jax.Array
    confident_layer: jax.Array


def may_exit(config: ExitConfig, layers_run, num_layers: int):
    """Whether a row may exit after `layers_run` layers (never at full depth: that is no exit)."""
    return (layers_run >= config.min_exit_layer) & (layers_run % config.every == 0) & (layers_run < num_layers)


def can_exit(config: ExitConfig, num_layers: int) -> bool:
    """False when the config statically never exits (none, threshold +inf, static at full depth)."""
    if config.measure == "static":
        return config.exit_layer < num_layers
    return config.checks_confidence


def confidence(config: ExitConfig, fns: ExitFns, h_prev, h, layers_run):
    """(confidence [B], exit logits [B, V] or None) after `layers_run` layers; h [B, T, D]."""
    if config.measure == "softmax":
        logits = fns.exit_logits(h, layers_run)
        return softmax_margin(logits), logits
    if config.measure == "state":
        return state_cosine(h_prev[:, -1], h[:, -1]), None
    if config.measure == "classifier":
        return fns.exit_prob(h, layers_run), None
    raise ValueError(f"measure {config.measure!r} has no confidence")


def early_exit_layers(fns: ExitFns, h, cache: KVCache, active, threshold, pages, slots, *,
                      config: ExitConfig, num_layers: int, vocab_size: int) -> ExitOutcome:
    """Runs layers until the whole batch is confident, fills the skipped layers' KV, and
    evaluates the exit head.

    h [B, T, D] embedded new tokens; active [B] bool (inactive rows count as confident);
    threshold [B] float32 (λ(t) per row); pages/slots [B, T] the new tokens' cache slots
    (the null page for inactive rows).
    """
    b = h.shape[0]
    # Softmax confidence computes the exit logits; keep them (and compute them at full depth
    # too) so the token needs no second head evaluation.
    reuse_logits = config.measure == "softmax" and config.checks_confidence

    def cond(carry):
        layer, _, _, exited, _, _ = carry
        return (layer < num_layers) & ~jnp.all(exited)

    def body(carry):
        layer, h, cache, exited, confident_at, logits = carry
        h_next, cache = fns.run_layer(layer, h, cache)
        run = layer + 1
        eligible = may_exit(config, run, num_layers)
        if config.measure == "static":
            newly = jnp.full((b,), run == config.exit_layer)
        elif config.checks_confidence:

            def check(_):
                conf, lg = confidence(config, fns, h, h_next, run)
                return conf > threshold, (lg if reuse_logits else logits)

            def skip(_):
                if reuse_logits:  # full depth: the model's own head gives the token
                    return jnp.zeros((b,), bool), jax.lax.cond(
                        run == num_layers, lambda: fns.exit_logits(h_next, run), lambda: logits
                    )
                return jnp.zeros((b,), bool), logits

            confident, logits = jax.lax.cond(eligible, check, skip, None)
            newly = confident & eligible
        else:
            newly = jnp.zeros((b,), bool)
        confident_at = jnp.where(newly & ~exited, run, confident_at)  # a row turns confident once
        return layer + 1, h_next, cache, exited | newly, confident_at, logits

    logits0 = jnp.zeros((b, vocab_size if reuse_logits else 0), jnp.float32)
    carry = (jnp.int32(0), h, cache, ~active, jnp.zeros((b,), jnp.int32), logits0)
    exit_layer, h, cache, _, confident_at, logits = jax.lax.while_loop(cond, body, carry)

    if can_exit(config, num_layers):
        cache = jax.lax.cond(
            exit_layer < num_layers,
            lambda c: kv_fill(c, fns.kv_all_layers(h), exit_layer, pages, slots),
            lambda c: c,
            cache,
        )
    if not reuse_logits:
        logits = fns.exit_logits(h, exit_layer)
    confident_layer = jnp.where(confident_at == 0, exit_layer, confident_at)
    return ExitOutcome(logits, cache, exit_layer, confident_layer)


def kv_fill(cache: KVCache, kv, exit_layer, pages, slots) -> KVCache:
    """Writes K/V `[L, B, T, Hkv, Dh]` of the layers >= exit_layer (0-based) at (pages, slots)
    `[B, T]`; the layers that ran keep what they wrote (masked to the null page)."""
    k, v = kv
    skipped = jnp.arange(k.shape[0]) >= exit_layer
    layer_pages = jnp.where(skipped[:, None, None], pages[None], NULL_PAGE)
    return write_kv_all_layers(cache, k, v, layer_pages, slots)
