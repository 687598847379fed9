"""Running a range of stacked layers with a traced layer index, shared by the model modules."""

from __future__ import annotations

import jax


def run_layer_range(decoder_layer, params, h, cache, batch, config, start=0, stop=None, length: int | None = None):
    """Layers [start, stop) of `decoder_layer(params, h, cache, layer, batch, config) -> (h,
    cache)` in a `lax.fori_loop` (a traced index into the stacked params); with a static
    `length`, layers [start, start + length) (start may be traced), a loop of known trip count,
    which on GPU costs no host round trip per layer. Returns (h, cache)."""

    def body(layer, carry):
        h, cache = carry
        return decoder_layer(params, h, cache, layer, batch, config)

    if length is not None:
        return jax.lax.fori_loop(0, length, lambda j, carry: body(start + j, carry), (h, cache))
    stop = config.num_layers if stop is None else stop
    return jax.lax.fori_loop(start, stop, body, (h, cache))
