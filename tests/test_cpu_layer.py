"""A decoder layer in one CPU call (`kernels.cpu_layer`): the bits of the same layer run op by op
(its h and both caches), for each block format and kind of activations, a decode step and a
batch's verify pass, with and without a window; a stack's layer read in place at a traced index;
and which layers take it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eejax import quantized as Q
from eejax.cache.paged import KVCache
from eejax.config import LlamaConfig
from eejax.kernels import cpu_layer, cpu_matmul
from eejax.models import llama
from tests.test_quantized import random_matrix

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="no C++ compiler for the kernel")

PAGE, PAGES = 4, 12
CONFIG = LlamaConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    tie_embeddings=True,
)
SHAPES = {  # a layer's matrices: (rows, cols), rows its outputs
    "wq": (64, 64),
    "wk": (32, 64),
    "wv": (32, 64),
    "wo": (64, 64),
    "w_gate": (96, 64),
    "w_up": (96, 64),
    "w_down": (64, 96),
}
FORMATS = {  # one format a layer, and a layer of several (its products in one call per matrix)
    "q4_1": dict.fromkeys(SHAPES, "q4_1"),
    "mixed": {**dict.fromkeys(SHAPES, "q4_0"), "wq": "q8_0", "w_up": "q4_1", "w_down": "int8"},
}


def layers(formats: dict, activations: str, seed: int = 0) -> dict:
    """Two layers' weights as per-layer buffers (the CPU's layout)."""
    rng = np.random.default_rng(seed)

    def one():
        lp = {k: random_matrix(formats[k], *shape, rng, activations) for k, shape in SHAPES.items()}
        lp = {k: dataclasses.replace(w, transposed=True) for k, w in lp.items()}
        norms = {k: jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32) for k in ("attn_norm", "mlp_norm")}
        return {**lp, **norms}

    per_layer = [one(), one()]
    return {k: [lp[k] for lp in per_layer] for k in per_layer[0]}


def token_batch(positions, block_table, config):
    valid = jnp.ones(positions.shape, bool)
    return llama.token_batch(config, positions, valid, block_table, positions[:, -1] + 1, PAGE)


def layer_step(params, h, cache, positions, block_table, config):
    return llama.decoder_layer(params, h, cache, 1, token_batch(positions, block_table, config), config)


def inputs(rows: int, new: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    shape = (CONFIG.num_layers, CONFIG.num_kv_heads, PAGES, PAGE, CONFIG.head_dim)
    cache = KVCache(*(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2)))
    h = jnp.asarray(rng.standard_normal((rows, new, 64)), jnp.float32)
    starts = np.array([13, 6, 9][:rows], np.int32)  # rows at different lengths (an earlier context in the cache)
    positions = jnp.asarray(starts[:, None] + np.arange(new, dtype=np.int32))
    block_table = jnp.asarray(1 + np.arange(rows * 5, dtype=np.int32).reshape(rows, 5) * 2 % (PAGES - 1))
    return h, cache, positions, block_table


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("formats", sorted(FORMATS))
@pytest.mark.parametrize("activations", Q.ACTIVATIONS)
def test_a_layer_in_one_call_has_the_op_by_op_layers_bits(monkeypatch, formats, activations, window):
    monkeypatch.setattr(cpu_layer, "MAX_ROWS", 64)  # the kernel's own limit: a batch's verify pass too
    config = dataclasses.replace(CONFIG, sliding_window=window)
    params = {"layers": layers(FORMATS[formats], activations)}
    one_call = jax.jit(lambda *a: layer_step(params, *a, config))
    assert "eejax_cpu_layer" in one_call.lower(*inputs(1, 1)).as_text()
    got = {(r, n): one_call(*inputs(r, n)) for r, n in ((1, 1), (3, 3))}  # a decode step; a batch's verify pass
    monkeypatch.setattr(llama, "_in_one_call", lambda *a: False)
    op_by_op = jax.jit(lambda *a: layer_step(params, *a, config))
    assert "eejax_cpu_layer" not in op_by_op.lower(*inputs(1, 1)).as_text()
    for (rows, new), (h, cache) in got.items():
        want_h, want_cache = op_by_op(*inputs(rows, new))
        assert np.array_equal(np.asarray(h), np.asarray(want_h)), (rows, new)
        assert np.array_equal(np.asarray(cache.k), np.asarray(want_cache.k)), (rows, new)
        assert np.array_equal(np.asarray(cache.v), np.asarray(want_cache.v)), (rows, new)
        assert not np.array_equal(np.asarray(cache.k), np.asarray(inputs(rows, new)[1].k))  # the new keys went in


@pytest.mark.skipif(not cpu_matmul.panel_products(), reason="the tiled loop is built where the CPU has AVX-512 VNNI")
@pytest.mark.parametrize("formats", sorted(FORMATS))
def test_a_layer_of_tiled_matrices_in_one_call_has_the_op_by_op_layers_bits(monkeypatch, formats):
    """The default load's layout (4-bit matrices in tiles, int16 x) through the one call: a decode
    step and a batch's verify pass give the op-by-op layer's bits, a stack's layer read in place
    those of its own buffers, and the untiled layer's values up to summation order."""
    monkeypatch.setattr(cpu_layer, "MAX_ROWS", 64)
    per_layer = layers(FORMATS[formats], "int16")
    tiled = {k: [Q.tile(w) if isinstance(w, Q.QuantizedMatrix) else w for w in v] for k, v in per_layer.items()}
    assert any(w.tiled for v in tiled.values() for w in v if isinstance(w, Q.QuantizedMatrix))
    one_call = jax.jit(lambda *a: layer_step({"layers": tiled}, *a, CONFIG))
    untiled = jax.jit(lambda *a: layer_step({"layers": per_layer}, *a, CONFIG))
    stacked = {"layers": {k: jax.tree.map(lambda *xs: jnp.stack(xs), *v) for k, v in tiled.items()}}
    in_place = jax.jit(lambda *a: layer_step(stacked, *a, CONFIG))
    assert "eejax_cpu_layer" in one_call.lower(*inputs(1, 1)).as_text()
    shapes = ((1, 1), (3, 3))  # a decode step; a batch's verify pass
    got = {(r, n): (one_call(*inputs(r, n)), untiled(*inputs(r, n))[0], in_place(*inputs(r, n))) for r, n in shapes}
    monkeypatch.setattr(llama, "_in_one_call", lambda *a: False)
    op_by_op = jax.jit(lambda *a: layer_step({"layers": tiled}, *a, CONFIG))
    for (rows, new), ((h, cache), h_untiled, (h_stack, cache_stack)) in got.items():
        want_h, want_cache = op_by_op(*inputs(rows, new))
        for have in ((h, cache), (h_stack, cache_stack)):
            assert np.array_equal(np.asarray(have[0]), np.asarray(want_h)), (rows, new)
            assert np.array_equal(np.asarray(have[1].k), np.asarray(want_cache.k)), (rows, new)
            assert np.array_equal(np.asarray(have[1].v), np.asarray(want_cache.v)), (rows, new)
        near = 1e-4 * np.abs(np.asarray(h)).max()
        np.testing.assert_allclose(np.asarray(h), np.asarray(h_untiled), rtol=0, atol=near)


@pytest.mark.parametrize("formats", sorted(FORMATS))
def test_a_stacks_layer_is_read_in_place_at_a_traced_index_with_its_own_buffers_bits(formats):
    """The stacked layout's loop: the call takes the whole stacks at a traced index (no layer's
    weights sliced out), a decode step and a batch's verify pass alike (`MAX_STACKED_ROWS`), and
    gives the bits of the layer's own buffers (at 3 x 3 rows, those of the op-by-op layer)."""
    per_layer = layers(FORMATS[formats], "int16")
    stacked = {"layers": {k: jax.tree.map(lambda *xs: jnp.stack(xs), *v) for k, v in per_layer.items()}}
    traced = jax.jit(
        lambda layer, *a: llama.decoder_layer(stacked, a[0], a[1], layer, token_batch(*a[2:], CONFIG), CONFIG)
    )
    for rows, new in ((1, 1), (3, 3)):
        text = traced.lower(jnp.int32(1), *inputs(rows, new)).compile().as_text()
        sliced = [
            line for line in text.splitlines() if "dynamic-slice(" in line and line.split("=")[1].strip()[:3] != "s32"
        ]
        assert "eejax_cpu_layer" in text and not sliced, rows  # the stacks go in whole: no layer's weights copied
        h0, cache0, positions, block_table = inputs(rows, new)
        for layer in (0, 1):
            h, cache = traced(jnp.int32(layer), *inputs(rows, new))
            batch = token_batch(positions, block_table, CONFIG)
            want_h, want_cache = llama.decoder_layer({"layers": per_layer}, h0, cache0, layer, batch, CONFIG)
            assert np.array_equal(np.asarray(h), np.asarray(want_h)), (rows, layer)
            assert np.array_equal(np.asarray(cache.k), np.asarray(want_cache.k)), (rows, layer)
            assert np.array_equal(np.asarray(cache.v), np.asarray(want_cache.v)), (rows, layer)


@pytest.mark.parametrize(
    "change",
    ["float weights", "prompt weights", "q/k/v biases", "a LoRA factor", "a traced layer", "two rows"],
)
def test_layers_the_call_cannot_take_run_op_by_op(change):
    params = {"layers": layers(FORMATS["q4_1"], "int16")}
    config, layer, rows = CONFIG, 1, 1
    if change == "float weights":
        params["layers"]["wq"] = [jnp.zeros((64, 64), jnp.float32)] * 2
    elif change == "prompt weights":
        params["layers"]["wo"] = [dataclasses.replace(w, prompt=True) for w in params["layers"]["wo"]]
    elif change == "q/k/v biases":
        config = dataclasses.replace(CONFIG, qkv_bias=True)
        for name, n in (("bq", 64), ("bk", 32), ("bv", 32)):
            params["layers"][name] = [jnp.zeros((n,), jnp.float32)] * 2
    elif change == "a LoRA factor":
        params["layers"]["wq_a"] = [jnp.zeros((64, 2), jnp.float32)] * 2
        params["layers"]["wq_b"] = [jnp.zeros((2, 64), jnp.float32)] * 2
    elif change == "a traced layer":
        layer = jnp.int32(1)
    else:
        rows = 2
    h, cache, positions, block_table = inputs(1, 1)
    h = jnp.zeros((rows, 1, 64), jnp.float32)
    positions, block_table = jnp.broadcast_to(positions, (rows, 1)), jnp.broadcast_to(block_table, (rows, 5))
    batch = token_batch(positions, block_table, config)
    assert not llama._in_one_call(params["layers"], h, cache, layer, batch, config)
    if change == "two rows":
        assert llama._in_one_call(params["layers"], h[:1], cache, layer, batch, config)
