"""One decode step with early exit (Algorithm 1 of the early-exit inference framework paper).

Confidence is checked only at the check layers c_1 < ... < c_m (`ExitConfig.check_layers`):
a `lax.while_loop` runs one whole segment of layers [c_{i-1}, c_i) per iteration (a traced
`fori_loop` over the stacked params, no per-layer branch), then checks; its last segment is
[c_m, L). A row may turn confident at a check (flags only turn on); rows that are padding or
finished count as confident from the start. The loop stops once every row is confident, so the
whole batch exits at one layer E: the batch waits for its least confident row. Then **KV
fill** writes the K/V of every skipped layer l in [E, L) from the exit hidden state
(proj_l(norm_l(h_E)) with rotary), one layer at a time on a CPU (only the skipped layers' K/V
weights are read), in one batched product and one cache write on a GPU; the token comes from
the exit head at E.

On a GPU every iteration of a loop with a traced trip count, and every conditional, is a host
round trip (`decode.control_flow`); there (`static_loops`) the layers every segment has run go
in a loop of known trip count and KV fill in no loop at all, leaving the segment loop (and, when
the check layers are unevenly spaced, a loop over each segment's layers beyond the shortest
segment's).

The loop is model-agnostic: a model supplies `ExitFns` (closures over its params and the step's
token batch), so Llama and T5 decoders share this code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from eejax.cache import KVCache, write_layer_kv, write_layers_kv
from eejax.decode.confidence import softmax_margin, state_cosine
from eejax.kernels.backend import backend
from eejax.options import ExitConfig


class ExitFns(NamedTuple):
    """What the loop needs from a model, for hidden states h [B, T, D] of the new tokens.

    run_layers(h, cache, start, stop=None, length=None) -> (h, cache): layers [start, stop)
        (traced bounds), or [start, start + length) for a static length; each writes its K/V.
    exit_logits(h, layers_run) -> [B, V] float32: the full exit head after `layers_run` layers
        (last token of each row); the model's own head when layers_run = num_layers.
    check_logits(h, layers_run) -> [B, K] float32: the head of softmax checks (the reduced
        exit head, K < V, or `exit_logits`).
    emit_logits(h, layers_run) -> [B, V] float32: the head of the token at an early exit
        (`exit_logits`, or the reduced head with -inf outside its vocabulary).
    exit_prob(h, layers_run) -> [B] float32: the exit classifier's P(exit) (classifier only).
    layer_kv(layer, h) -> (k, v) [B, T, Hkv, Dh]: layer `layer`'s (traced) K/V of h (KV fill).
    layers_kv(start, stop, h) -> (k, v) [stop - start, B, T, Hkv, Dh]: the K/V of h in each layer
        of a static range, one batched product (a GPU's KV fill).
    """

    run_layers: Callable
    exit_logits: Callable
    check_logits: Callable
    emit_logits: Callable
    exit_prob: Callable | None
    layer_kv: Callable
    layers_kv: Callable


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExitOutcome:
    """logits [B, V] f32 of the exit head; exit_layer int32 scalar (layers run, shared by the
    batch); confident_layer [B] int32 (each row's first confident layer, exit_layer if none)."""

    logits: jax.Array
    cache: KVCache
    exit_layer: jax.Array
    confident_layer: jax.Array


def confidence(config: ExitConfig, fns: ExitFns, h_prev, h, layers_run):
    """(confidence [B], check logits [B, K] or None) after `layers_run` layers; h [B, T, D]."""
    if config.measure == "softmax":
        logits = fns.check_logits(h, layers_run)
        return softmax_margin(logits), logits
    if config.measure == "state":
        return state_cosine(h_prev[:, -1], h[:, -1]), None
    if config.measure == "classifier":
        return fns.exit_prob(h, layers_run), None
    raise ValueError(f"measure {config.measure!r} has no confidence")


def early_exit_layers(
    fns: ExitFns,
    h,
    cache: KVCache,
    active,
    threshold,
    pages,
    slots,
    *,
    config: ExitConfig,
    num_layers: int,
    vocab_size: int,
    reuse_check_logits: bool | None = None,
) -> ExitOutcome:
    """Runs layers until the whole batch is confident, fills the skipped layers' KV, and
    evaluates the exit head.

    h [B, T, D] embedded new tokens; active [B] bool (inactive rows count as confident);
    threshold [B] float32 (λ(t) per row); pages/slots [B, T] the new tokens' cache slots
    (the null page for inactive rows). Confidence is checked at `config.check_layers`.
    `reuse_check_logits` (static): the check head is the emitted token's head, so the last
    check's logits give the token (default: softmax checks, which then use the full head).
    """
    b = h.shape[0]
    if config.measure == "static" or not config.checks_confidence:
        stop = config.exit_layer if config.measure == "static" else num_layers
        h, cache = fns.run_layers(h, cache, 0, stop)
        logits = fns.exit_logits(h, stop) if stop == num_layers else fns.emit_logits(h, stop)
        cache = kv_fill(cache, fns, h, stop, num_layers, pages, slots, first=stop if static_loops() else None)
        return ExitOutcome(logits, cache, jnp.int32(stop), jnp.full((b,), stop, jnp.int32))

    points = config.check_layers(num_layers)
    # Segment i runs layers [bounds[i], bounds[i + 1]); the last one, [c_m, L), checks nothing.
    lengths = [b - a for a, b in zip((0,) + points, points + (num_layers,))]
    bounds = jnp.asarray((0,) + points + (num_layers,), jnp.int32)
    reuse = config.measure == "softmax" if reuse_check_logits is None else reuse_check_logits
    few_round_trips = static_loops()

    def run_segment(h, cache, start, stop, short: int = 0):
        """Layers [start, stop) of a segment less its last `short` layers (traced bounds). For
        fewer round trips, the layers every segment has run in a loop of known length, and the
        rest (none when all segments are as long) in a traced one."""
        if few_round_trips:
            common = min(lengths) - short
            if common > 0:
                h, cache = fns.run_layers(h, cache, start, length=common)
            if len(set(lengths)) == 1:
                return h, cache
            start = start + max(common, 0)
        return fns.run_layers(h, cache, start, stop)

    def check(h_prev, h, stop):
        # No reduced check at full depth (nothing to decide), except on GPU, where the conditional's
        # host round trip costs more than the check
        if config.measure == "softmax" and not reuse and not few_round_trips:
            width = jax.eval_shape(fns.check_logits, h, stop).shape[-1]
            return jax.lax.cond(
                stop < num_layers,
                lambda: confidence(config, fns, h_prev, h, stop),
                lambda: (jnp.zeros((b,), jnp.float32), jnp.zeros((b, width), jnp.float32)),
            )
        # The full head at full depth is the model's own: the token's logits when no row exited.
        return confidence(config, fns, h_prev, h, stop)

    def cond(carry):
        i, _, _, exited, _, _ = carry
        return (i <= len(points)) & ~jnp.all(exited)

    def body(carry):
        i, h, cache, exited, confident_at, logits = carry
        start, stop = bounds[i], bounds[i + 1]
        if config.measure == "state":  # the cosine compares the states around the segment's last layer
            h_prev, cache = run_segment(h, cache, start, stop - 1, short=1)
            h, cache = fns.run_layers(h_prev, cache, stop - 1, length=1)
        else:
            h_prev = None
            h, cache = run_segment(h, cache, start, stop)
        conf, checked = check(h_prev, h, stop)
        newly = (conf > threshold) & (stop < num_layers)
        confident_at = jnp.where(newly & ~exited, stop, confident_at)  # a row turns confident once
        return i + 1, h, cache, exited | newly, confident_at, (checked if reuse else logits)

    # One loop runs every layer that runs: a second loop over the layers after it would cost a
    # copy of what it reads (measured: half the speed at batch 8 on CPU), and a `lax.cond` over
    # the cache may copy the cache.
    logits0 = jnp.zeros((b, vocab_size if reuse else 0), jnp.float32)
    carry = (jnp.int32(0), h, cache, ~active, jnp.zeros((b,), jnp.int32), logits0)
    i, h, cache, _, confident_at, logits = jax.lax.while_loop(cond, body, carry)
    exit_layer = bounds[i]
    if not reuse:
        logits = jax.lax.cond(
            exit_layer < num_layers, lambda: fns.emit_logits(h, exit_layer), lambda: fns.exit_logits(h, num_layers)
        )
    cache = kv_fill(cache, fns, h, exit_layer, num_layers, pages, slots, first=points[0] if few_round_trips else None)
    confident_layer = jnp.where(confident_at == 0, exit_layer, confident_at)
    return ExitOutcome(logits, cache, exit_layer, confident_layer)


def static_loops() -> bool:
    """Whether the decode programs trade a little compute for host round trips: on a GPU a loop
    with a traced trip count reads its predicate back to the host every iteration and a
    conditional its branch (10-20 us each, `eejax.decode.control_flow`); on CPU they cost no
    round trip (though not always nothing: `feature_draft._draft_with_lookup`). Then KV fill is
    one batched product from the first check layer (projecting, and dropping, the K/V of the
    layers between it and the exit) and one write, and the reduced-head check runs at full depth
    too instead of behind a conditional; speculation drafts with fixed scans (a confidence
    stop's head passes run after the stop, masked; the head runs at the bonus pass, unused) and
    verifies every drafted position."""
    return backend() != "cpu"


def kv_fill(
    cache: KVCache, fns: ExitFns, h, exit_layer, num_layers: int, pages, slots, first: int | None = None
) -> KVCache:
    """Writes the K/V of layers [exit_layer, num_layers) (exit_layer traced; none at full depth)
    of hidden states h [B, T, D] at (pages, slots) [B, T]. Without `first`, one layer per loop
    iteration (`fns.layer_kv`: only the skipped layers' weights are read). With `first` (static,
    <= exit_layer; a GPU's structure) the K/V of every layer in [first, num_layers) come from one
    batched product over the stacked weights (`fns.layers_kv`) and go to the cache in one write,
    the layers below exit_layer to the null page (page 0), which no row reads."""
    if first is not None:
        if first >= num_layers:
            return cache
        layers = jnp.arange(first, num_layers, dtype=jnp.int32)
        k, v = fns.layers_kv(first, num_layers, h)
        to = jnp.where((layers >= exit_layer)[:, None, None], pages[None], 0)
        return write_layers_kv(cache, layers, k, v, to, slots)

    def body(layer, cache):
        k, v = fns.layer_kv(layer, h)
        return write_layer_kv(cache, layer, k, v, pages, slots)

    return jax.lax.fori_loop(exit_layer, num_layers, body, cache)
