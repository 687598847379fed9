"""Batch invariance on a CPU: a row's logits are the same bits whether its tokens run alone (one
a step), as the d + 1 positions of a verify pass, in a batch of 8, or as a batch's verify pass,
for float32 weights and GGUF blocks with each activation mode; the pieces that make it so
(`common.row_sum`, the products in calls of a few rows) for any number of rows; and speculation on
integer activations token-identical to full depth."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import eejax
from eejax import quantized as Q
from eejax.cache.paged import init_cache
from eejax.config import LlamaConfig
from eejax.kernels import cpu_matmul
from eejax.models import llama
from eejax.models.common import rms_norm, row_sum
from eejax.options import LayerSkipSpec
from tests.helpers import random_prompts
from tests.test_quantized import blocks_of, random_matrix

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="no C++ compiler for the kernel")

PROMPT, NEW, ROWS, PAGE = 20, 5, 8, 16


@pytest.fixture(scope="module")
def config():
    # 576 wide, as SmolLM2: XLA:CPU's own reduction over it gives some rows other last bits
    # in a batch of 8 than alone (64 wide does not show it).
    return LlamaConfig(
        vocab_size=256,
        hidden_size=576,
        intermediate_size=256,
        num_layers=2,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=128,
        tie_embeddings=True,
    )


@pytest.fixture(scope="module")
def float_params(config):
    return llama.init_params(config, jax.random.PRNGKey(1), scale=0.1)


def step_program(config, attention="auto"):
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache, tokens, positions, block_table):
        batch = llama.token_batch(
            config, positions, jnp.ones(tokens.shape, bool), block_table, positions[:, -1] + 1, PAGE, attention
        )
        h, cache = llama.run_layers(params, llama.embed(params, tokens), cache, batch, config)
        return llama.lm_head(params, h, config, triton=attention == "triton"), cache

    return step


def logits_four_ways(config, params, attention="auto", dtype=jnp.float32) -> dict:
    """{how: logits [ROWS, NEW, V]} of the same new tokens after the same prompts, each row's
    prompt prefilled alone: one token a step per row ("alone"), the NEW tokens of a row in one pass
    ("verify"), the ROWS rows a step ("batch"), and all of them in one pass ("batch verify"); a
    cache of `dtype`."""
    step = step_program(config, attention)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab_size, (ROWS, PROMPT)).astype(np.int32)
    new = rng.integers(0, config.vocab_size, (ROWS, NEW)).astype(np.int32)
    per_row = -(-(PROMPT + NEW) // PAGE)
    tables = np.arange(1, 1 + ROWS * per_row, dtype=np.int32).reshape(ROWS, per_row)
    c = config

    def prefilled():
        cache = init_cache(c.num_layers, 1 + ROWS * per_row, PAGE, c.num_kv_heads, c.head_dim, dtype)
        for r in range(ROWS):
            _, cache = step(
                params, cache, prompts[r : r + 1], np.arange(PROMPT, dtype=np.int32)[None], tables[r : r + 1]
            )
        return cache

    def run(row_groups, token_groups):
        cache, out = prefilled(), np.zeros((ROWS, NEW, c.vocab_size), np.float32)
        for rows in row_groups:
            for cols in token_groups:
                positions = np.broadcast_to(
                    PROMPT + np.arange(NEW, dtype=np.int32)[cols], (len(rows), len(range(NEW)[cols]))
                )
                logits, cache = step(params, cache, new[rows][:, cols], np.ascontiguousarray(positions), tables[rows])
                out[rows, cols] = np.asarray(logits)
        return out

    singles = [slice(j, j + 1) for j in range(NEW)]
    each_row = [np.arange(r, r + 1) for r in range(ROWS)]
    return {
        "alone": run(each_row, singles),
        "verify": run(each_row, [slice(0, NEW)]),
        "batch": run([np.arange(ROWS)], singles),
        "batch verify": run([np.arange(ROWS)], [slice(0, NEW)]),
    }


@pytest.mark.parametrize("weights", ["float32", *(f"blocks:{a}" for a in Q.ACTIVATIONS)])
def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(config, float_params, weights):
    params = float_params
    if weights != "float32":
        params = Q.with_activations(blocks_of(float_params), weights.split(":")[1])
    got = logits_four_ways(config, llama.with_layer_buffers(params))
    for how in ("verify", "batch", "batch verify"):
        differing = int((got[how] != got["alone"]).any(-1).sum())
        assert differing == 0, f"{weights}, {how}: {differing} of {ROWS * NEW} positions differ from alone"


@pytest.mark.parametrize("weights", ["float32", "blocks:int8", "blocks:int16"])
def test_a_prompts_last_token_has_the_bits_it_has_decoded(config, float_params, weights):
    """A prompt's last logits prefilled with the prompt (a prefill's products: the GEMM) equal that
    token's decoded one step after the rest (the few-row loops), head included: the blocks in tiles,
    as the default load holds them, sum a row in the GEMM's order (a preempted sequence prefilled
    again, a chunk's last row and a decode step agree). Prompts of 5 to 39 tokens."""
    params = float_params
    if weights != "float32":
        if not cpu_matmul.panel_products():
            pytest.skip("the tiled loop and the GEMM are built where the CPU has AVX-512 VNNI")
        params = cpu_matmul.tiled_for_kernel(Q.with_activations(blocks_of(float_params), weights.split(":")[1]))
        assert all(w.tiled for w in jax.tree.leaves(params, is_leaf=Q.is_quantized) if Q.is_quantized(w))
    params = llama.with_layer_buffers(params)
    step, prompt_params = step_program(config), Q.for_prompts(params)
    rng = np.random.default_rng(0)
    c, table = config, np.arange(1, 5, dtype=np.int32)[None]
    for length in (5, 21, 39):
        tokens = rng.integers(0, c.vocab_size, (1, length)).astype(np.int32)
        positions = np.arange(length, dtype=np.int32)[None]
        cache = init_cache(c.num_layers, 5, PAGE, c.num_kv_heads, c.head_dim, jnp.float32)
        whole, _ = step(prompt_params, cache, tokens, positions, table)
        cache = init_cache(c.num_layers, 5, PAGE, c.num_kv_heads, c.head_dim, jnp.float32)
        _, cache = step(prompt_params, cache, tokens[:, :-1], positions[:, :-1], table)
        last, _ = step(params, cache, tokens[:, -1:], positions[:, -1:], table)
        assert np.array_equal(np.asarray(whole)[0, -1], np.asarray(last)[0, -1]), (weights, length)


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 64), width=st.sampled_from([64, 576, 960, 2048]), seed=st.integers(0, 2**16))
def test_a_rows_norm_and_sum_are_its_bits_alone(rows, width, seed):
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32) * 4)
    weight = jnp.linspace(0.5, 1.5, width, dtype=jnp.float32)
    norm, total = jax.jit(lambda x: rms_norm(x, weight, 1e-5)), jax.jit(row_sum)
    together, sums = np.asarray(norm(x)), np.asarray(total(x))
    for i in {0, rows // 2, rows - 1}:
        assert np.array_equal(np.asarray(norm(x[i : i + 1]))[0], together[i])
        assert np.array_equal(np.asarray(total(x[i : i + 1]))[0], sums[i])
    np.testing.assert_allclose(sums, np.asarray(x, np.float64).sum(-1), rtol=0, atol=1e-4 * np.sqrt(width) * 4)


def test_layers_kv_under_vmap_are_each_layers_own_bits(config, float_params):
    """A GPU's KV fill projects a range of layers at once (`llama.kv_of_layers`: the layer norm and
    products vmapped over the stacked weights); on a CPU each layer's K/V are then the bits of
    that layer alone (`kv_of_layer`). The norm kernel once broadcast a batched weight and gave
    every layer the first one's."""
    norms = jnp.linspace(0.5, 1.5, 2 * config.hidden_size).reshape(2, config.hidden_size)
    params = {**float_params, "layers": {**float_params["layers"], "attn_norm": norms}}
    positions = jnp.asarray([[5], [9], [2]], jnp.int32)
    table = jnp.asarray(np.arange(1, 13).reshape(3, 4), jnp.int32)
    batch = llama.token_batch(config, positions, jnp.ones((3, 1), bool), table, positions[:, 0] + 1, 8)
    h = jax.random.normal(jax.random.PRNGKey(3), (3, 1, config.hidden_size))
    ks, vs = jax.jit(lambda h: llama.kv_of_layers(params, h, 0, 2, batch, config))(h)
    for layer in range(2):
        k, v = jax.jit(lambda h, layer=layer: llama.kv_of_layer(params, h, layer, batch, config))(h)
        assert np.array_equal(ks[layer], k) and np.array_equal(vs[layer], v), layer


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_the_rotation_shares_a_rows_tables_between_its_heads(heads):
    """`rope` takes x [B, T, H, Dh] against tables [B, T, Dh] (a row's heads share its row): the
    bits of tables broadcast to x's shape, a row's bits alone, the reference's values, its gradient."""
    from eejax.kernels import cpu_elementwise
    from eejax.models.rope import rope_tables

    rng = np.random.default_rng(heads)
    x = jnp.asarray(rng.standard_normal((2, 7, heads, 64)).astype(np.float32))
    cos, sin = rope_tables(jnp.asarray(rng.integers(0, 500, (2, 7)), jnp.int32), 1e4 ** -(np.arange(32) / 32))
    rope = jax.jit(cpu_elementwise.rope)
    got = np.asarray(rope(x, cos, sin))
    full = [jnp.broadcast_to(t[:, :, None, :], x.shape) for t in (cos, sin)]
    assert np.array_equal(got, np.asarray(rope(x, *full)))
    assert np.array_equal(got[1, 4], np.asarray(rope(x[1:2, 4:5], cos[1:2, 4:5], sin[1:2, 4:5]))[0, 0])
    np.testing.assert_allclose(got, np.asarray(cpu_elementwise.rope_reference(x, cos, sin)), atol=1e-5)
    grad = jax.grad(lambda x: jnp.sum(cpu_elementwise.rope(x, cos, sin) ** 2))(x)
    want = jax.grad(lambda x: jnp.sum(cpu_elementwise.rope_reference(x, cos, sin) ** 2))(x)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), atol=1e-5)


@settings(max_examples=8, deadline=None)
@given(
    rows=st.integers(1, cpu_matmul.MAX_QUANTIZED_ROWS),
    activations=st.sampled_from(Q.ACTIVATIONS),
    seed=st.integers(0, 2**16),
)
def test_a_rows_quantized_product_is_its_bits_alone(rows, activations, seed):
    rng = np.random.default_rng(seed)
    w = random_matrix("q4_1", 48, 576, rng, activations)
    x = jnp.asarray(rng.standard_normal((rows, 576)).astype(np.float32))
    product = jax.jit(cpu_matmul.rows_product)
    together = np.asarray(product(x, w))
    for i in {0, rows // 2, rows - 1}:
        assert np.array_equal(np.asarray(product(x[i : i + 1], w))[0], together[i])


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_speculation_and_steps_per_program_on_integer_activations_are_full_depth(config, float_params, activations):
    """Self-speculation with and without the bonus pass, at batch 1 and 2, and full depth one
    step a program: the tokens of full depth four steps a program (int8's coarse rounding turns
    any last-bit difference between the programs into another token, so it shows one); and a
    prompt prefilled in chunks of 8 or after a prefix-cache hit gives the tokens it gives whole.
    (Two prompts together stay within 64 rows: a CPU without AVX-512 VNNI multiplies a prefill of
    more by XLA's GEMM, which rounds otherwise; docs/decoding.md.)"""
    from eejax.engine.engine import Engine

    params = Q.with_activations(blocks_of(float_params), activations)
    model = eejax.Model(config, cpu_matmul.tiled_for_kernel(params))  # in tiles, as the default load holds them
    tiled = [w.tiled for w in jax.tree.leaves(model.params, is_leaf=Q.is_quantized) if Q.is_quantized(w)]
    assert all(tiled) == cpu_matmul.panel_products()
    prompts = random_prompts(4, [17, 20, 19, 17], vocab=250, seed=5)

    def greedy(size, spec=None, steps=4):
        out = []
        for i in range(0, len(prompts), size):
            engine = Engine(model, max_slots=size, max_new_tokens=12, cache_budget="8MiB", page_size=8,
                            steps_per_dispatch=steps, ignore_eos=True, prefix_caching=False)  # fmt: skip
            seqs = [engine.submit(p, max_new_tokens=12, spec=spec) for p in prompts[i : i + size]]
            engine.run()
            out += [s.tokens for s in seqs]
        return out

    def greedy_one(prompt):
        return eejax.generate(model, [prompt], max_new_tokens=12, ignore_eos=True).tokens[0]

    full = greedy(1)
    assert greedy(1, steps=1) == full and greedy(2) == full
    for spec in (LayerSkipSpec(1, 3, bonus=True), LayerSkipSpec(1, 2, bonus=False)):
        assert greedy(1, spec) == full and greedy(2, spec) == full, spec
    shared = prompts[0][:16]
    chunked = Engine(model, max_slots=1, max_new_tokens=12, cache_budget="8MiB", page_size=8, prefill_chunk=8,
                     ignore_eos=True)  # fmt: skip
    sharing = (prompts[0], shared + prompts[1][16:])
    seqs = [chunked.submit(p, max_new_tokens=12) for p in sharing]
    chunked.run()
    assert chunked.counters["prefix_cache_hit_tokens"] > 0
    assert [s.tokens for s in seqs] == [greedy_one(p) for p in sharing]


@pytest.mark.skipif(not cpu_matmul.panel_products(), reason="the prefill GEMM needs AVX-512 VNNI")
def test_a_long_prompt_gives_its_tokens_whole_in_chunks_and_beside_a_short_one(config, float_params):
    """int8 activations (the most sensitive): a 70-token prompt prefilled whole (70 rows: the
    GEMM), in chunks of 16 and in a batch with a 9-token prompt gives the same tokens; the short
    prompt alone and beside it too. A prefill's rows take the GEMM however few they are."""
    from eejax.engine.engine import Engine

    model = eejax.Model(config, Q.with_activations(blocks_of(float_params), "int8"))
    long, short = random_prompts(2, [70, 9], vocab=250, seed=8)
    alone = [eejax.generate(model, [p], max_new_tokens=10, ignore_eos=True).tokens[0] for p in (long, short)]
    assert eejax.generate(model, [long, short], max_new_tokens=10, ignore_eos=True).tokens == alone
    engine = Engine(model, max_slots=1, max_new_tokens=10, cache_budget="8MiB", page_size=8, prefill_chunk=16,
                    ignore_eos=True)  # fmt: skip
    seq = engine.submit(long, max_new_tokens=10)
    engine.run()
    assert seq.tokens == alone[0]
