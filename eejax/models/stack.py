"""Stacked layer weights: one layer's weights picked by a (possibly traced) index, and a range of
layers run in a loop; shared by the model modules.

A stack is a dict {name: weights of every layer}, in one of two layouts:
- stacked: each entry one array [L, ...] (the checkpoint's layout, training's, a GPU's);
- per-layer buffers (`split_stack`): each entry a tuple of L arrays. On CPU, XLA copies a
  dynamic slice of a weight before a matmul reads it, so a stacked decode step reads every
  weight three times (read, write the copy, read it); per-layer buffers are read in place: a
  static range of layers runs unrolled, a traced one with each layer's matmuls inside a
  `lax.switch` branch on the layer index. (SmolLM2-135M on a 2-core CPU, 256-token context:
  batch-1 decode 46 -> 32 ms per step on 2026-11-23, 1.04-1.23x faster at batch 1 to 32 on
  2026-11-25 and 1.01x / 1.27x at batch 1 / 8 on 2026-11-26, paired; ~3x a decode program's
  compile time, which "auto" spends in the background: `Model.compiles_split_later`.) On a CPU
  the per-layer buffers alias the stack's memory (`layer_views`): one copy of the weights.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding


def is_split(stack: dict) -> bool:
    """Whether `stack` holds per-layer buffers (tuples) rather than stacked arrays (a weight may
    be a `QuantizedMatrix`, a small pytree of arrays, in either layout)."""
    return isinstance(next(iter(stack.values())), (tuple, list))


def split_stack(stack: dict) -> dict:
    """Stacked arrays [L, ...] -> tuples of L arrays, each layer's weights in its own buffer
    (`layer_views`: on a CPU they share the stack's memory)."""
    if is_split(stack):
        return stack
    return {k: _layers_of(v) for k, v in stack.items()}


def _layers_of(weight) -> tuple:
    """A stacked weight (an array, or a pytree of arrays such as a `QuantizedMatrix`) -> a tuple of
    its L layers, each leaf a `layer_views` view."""
    leaves, treedef = jax.tree.flatten(weight)
    per_leaf = [layer_views(leaf) for leaf in leaves]
    return tuple(jax.tree.unflatten(treedef, [views[i] for views in per_leaf]) for i in range(len(per_leaf[0])))


def layer_views(x) -> tuple:
    """x [L, ...] -> L arrays [...]. For an array on one CPU device they are views of x's own
    memory, not copies: XLA:CPU takes a host buffer without copying it when its start is 64-byte
    aligned, as each layer's is when a layer's bytes are a multiple of 64 (a layer that is not is
    copied). The per-layer buffers then cost no memory beside the stack; they keep it alive."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, SingleDeviceSharding) and next(iter(sharding.device_set)).platform == "cpu":
        host = np.asarray(x)  # x's memory, read-only (no copy on a CPU device)
        return tuple(jax.device_put(host[i], x.sharding) for i in range(host.shape[0]))
    return tuple(x[i] for i in range(x.shape[0]))


def num_stacked(stack: dict) -> int:
    first = next(iter(stack.values()))
    return len(first) if is_split(stack) else jax.tree.leaves(first)[0].shape[0]


def on_layer(stack: dict, keys, layer, fn: Callable):
    """fn(weights of layer `layer`, {name: array} over `keys`). `layer` may be traced: stacked
    weights are then sliced dynamically; per-layer buffers are read in place inside a
    `lax.switch` branch per layer (keep what `fn` returns small: a switch copies its results)."""
    if not is_split(stack):
        return fn(
            {k: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), stack[k]) for k in keys}
        )
    if isinstance(layer, int):
        return fn({k: stack[k][layer] for k in keys})
    branches = [lambda i=i: fn({k: stack[k][i] for k in keys}) for i in range(num_stacked(stack))]
    return jax.lax.switch(layer, branches)


def on_layers(stack: dict, keys, start: int, stop: int, fn: Callable):
    """fn(weights of one layer, {name: array} over `keys`) for each layer in [start, stop)
    (static), its outputs stacked on a new leading axis [stop - start, ...]. Stacked weights are
    sliced once and `fn` is vmapped over the slice (each product one batched product); per-layer
    buffers run `fn` layer by layer, each reading its buffers in place."""
    if not is_split(stack):
        return jax.vmap(fn)({k: jax.tree.map(lambda a: a[start:stop], stack[k]) for k in keys})
    outs = [fn({k: stack[k][i] for k in keys}) for i in range(start, stop)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def run_layer_range(decoder_layer, params, h, cache, batch, config, start=0, stop=None, length: int | None = None):
    """Layers [start, stop) of `decoder_layer(params, h, cache, layer, batch, config) -> (h,
    cache)` in a `lax.fori_loop` (a traced layer index); with a static `length`, layers
    [start, start + length) (start may be traced), a loop of known trip count, which on GPU
    costs no host round trip per layer. Returns (h, cache)."""

    def body(layer, carry):
        h, cache = carry
        return decoder_layer(params, h, cache, layer, batch, config)

    if length is not None:
        return jax.lax.fori_loop(0, length, lambda j, carry: body(start + j, carry), (h, cache))
    stop = config.num_layers if stop is None else stop
    if isinstance(start, int) and isinstance(stop, int) and _has_layer_buffers(params):
        # A static range over per-layer buffers runs unrolled: no loop, no switch (a switch per
        # layer costs ~10% at batch 8 on CPU; unrolling costs compile time, ~3 s per program).
        for layer in range(start, stop):
            h, cache = body(layer, (h, cache))
        return h, cache
    return jax.lax.fori_loop(start, stop, body, (h, cache))


def _has_layer_buffers(params) -> bool:
    return any(isinstance(v, dict) and v and is_split(v) for v in params.values())


def scan_states(layer: Callable, h, stack: dict, skip):
    """The training forward's loop over stacked layers: h -> layer(h, one layer's weights) for
    each layer of `stack` ({name: [L, ...]}) in order. skip [L] bool: layer l passes its input
    through and a `lax.cond` runs nothing else for it (LayerSkip's layer dropout). Returns
    (states [L, ...h's shape], layers computed int32): states[l] is h after layer l."""

    def compute(h, lp):
        return layer(h, lp), jnp.int32(1)

    def body(carry, xs):
        h, count = carry
        lp, skipped = xs
        h, ran = jax.lax.cond(skipped, lambda h, lp: (h, jnp.int32(0)), compute, h, lp)
        return (h, count + ran), h

    if skip is None:
        skip = jnp.zeros((num_stacked(stack),), bool)
    (_, count), states = jax.lax.scan(body, (h, jnp.int32(0)), (stack, skip))
    return states, count
