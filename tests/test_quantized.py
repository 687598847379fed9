"""Quantized weights (`eejax.quantized`, the CPU kernel's quantized products): GGUF's blocks read
as gguf-py reads them, products equal to the dequantised weights' up to summation order (int8
activations to their jnp equal), a quantized Llama that decodes as its dequantised float model
does, lossless modes token-identical to the quantized model's own full depth, checkpoints, and
clear refusals."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eejax
from eejax import quantized as Q
from eejax.config import LlamaConfig
from eejax.decode.programs import ProgramCache
from eejax.errors import EejaxError, UnsupportedModelError
from eejax.kernels import cpu_matmul
from eejax.kernels.backend import tracing_for
from eejax.models import llama
from eejax.options import LayerSkipSpec
from tests.helpers import random_prompts

gguf = pytest.importorskip("gguf")
GGML = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0"}


def ggml_blocks(w: np.ndarray, format: str, transposed: bool) -> Q.QuantizedMatrix:
    """A float matrix quantized by gguf-py (rows are outputs: a Linear's transposed) and read back
    by eejax's GGUF reader from its raw bytes."""
    rows = np.ascontiguousarray(np.swapaxes(w, -1, -2) if transposed else w, np.float32)
    qtype = gguf.GGMLQuantizationType[GGML[format]]
    raw = gguf.quants.quantize(rows.reshape(-1, rows.shape[-1]), qtype)
    return Q.from_ggml_blocks(raw, format, rows.shape[0], rows.shape[1], transposed)


def blocks_of(params, layer_format="q4_1", table_format="q8_0") -> dict:
    """A float Llama's params with GGUF blocks for its matrices (stacked per layer)."""

    def quantize(w, transposed):
        w = np.asarray(w)
        fmt = layer_format if transposed else table_format
        if w.ndim == 2:
            return jax.tree.map(jnp.asarray, ggml_blocks(w, fmt, transposed))
        per_layer = [ggml_blocks(w[i], fmt, transposed) for i in range(w.shape[0])]
        stacked = {k: np.stack([getattr(p, k) for p in per_layer]) for k in ("qs", "scales")}
        mins = None if per_layer[0].mins is None else np.stack([p.mins for p in per_layer])
        return Q.QuantizedMatrix(
            jnp.asarray(stacked["qs"]),
            jnp.asarray(stacked["scales"]),
            None if mins is None else jnp.asarray(mins),
            fmt,
            transposed,
        )

    return llama.quantize_weights(params, quantize)


def dequantized(params) -> dict:
    """The float32 model a quantized one stands for (its exact reference)."""
    return jax.tree.map(lambda x: Q.dequantize(x) if Q.is_quantized(x) else x, params, is_leaf=Q.is_quantized)


@pytest.fixture(scope="module")
def config():
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_embeddings=True,
    )


@pytest.fixture(scope="module")
def float_params(config):
    return llama.init_params(config, jax.random.PRNGKey(0), scale=0.3)  # peaked: few near-ties


@pytest.fixture(scope="module")
def blocks_model(config, float_params):
    return eejax.Model(config, blocks_of(float_params))


# --- formats and products ---------------------------------------------------------------------------


@pytest.mark.parametrize("format", ["q4_0", "q4_1", "q8_0"])
def test_blocks_dequantise_as_gguf_py_does(format):
    w = np.random.default_rng(1).standard_normal((96, 64)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[GGML[format]]
    raw = gguf.quants.quantize(w, qtype)
    ours = Q.from_ggml_blocks(raw, format, 96, 64, transposed=False)
    np.testing.assert_array_equal(np.asarray(Q.dequantize(ours)), gguf.quants.dequantize(raw, qtype))
    assert ours.shape == (96, 64) and ours.nbytes == raw.nbytes
    transposed = Q.from_ggml_blocks(raw, format, 96, 64, transposed=True)
    assert transposed.shape == (64, 96)


def random_matrix(format, rows, cols, rng, activations="float32") -> Q.QuantizedMatrix:
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
    m = Q.quantize_int8(w, transposed=False) if format == "int8" else ggml_blocks(w, format, transposed=False)
    return dataclasses.replace(jax.tree.map(jnp.asarray, m), activations=activations)


@pytest.mark.parametrize("format", Q.FORMATS)
def test_products_equal_the_dequantised_weights_up_to_summation_order(format):
    rng = np.random.default_rng(2)
    w = random_matrix(format, 80, 96, rng)
    reference = np.asarray(Q.dequantize_rows(w), np.float64)
    for rows in (1, 3, 5, 8, 13, cpu_matmul.MAX_QUANTIZED_ROWS + 1):  # the kernel's groups, then XLA's product
        x = rng.standard_normal((rows, 96)).astype(np.float32)
        got = np.asarray(jax.jit(cpu_matmul.rows_product)(jnp.asarray(x), w))
        want = x.astype(np.float64) @ reference.T
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("activations", Q.ACTIVATIONS)
def test_matrices_in_one_call_give_their_own_products(activations):
    """A layer's q, k and v (its gate and up) go in one kernel call: each result is, bit for
    bit, its matrix's product alone, whatever the rows' split between the threads. 70 rows of x:
    a prefill's GEMM, whose panels of 32 weight rows span the matrices (200: a part-filled one)."""
    rng = np.random.default_rng(8)
    ws = [random_matrix("q4_1", rows, 96, rng, activations) for rows in (1024, 256, 200)]  # 2 parts
    for rows in (3, cpu_matmul.MAX_QUANTIZED_ROWS + 6):
        x = jnp.asarray(rng.standard_normal((rows, 96)).astype(np.float32))
        together = jax.jit(cpu_matmul.rows_products)(x, ws)
        for w, y in zip(ws, together):
            assert np.array_equal(np.asarray(jax.jit(cpu_matmul.rows_product)(x, w)), np.asarray(y))


@pytest.mark.parametrize("format", Q.FORMATS)
def test_the_library_dequantises_as_jnp_does(format):
    """A prefill's products run XLA's GEMM over the library's dequantised rows: they are
    `dequantize_rows`'s, bit for bit."""
    w = random_matrix(format, 70, 96, np.random.default_rng(7))
    got = np.asarray(jax.jit(cpu_matmul._dequantize)(w))
    np.testing.assert_array_equal(got, np.asarray(Q.dequantize_rows(w)))


@pytest.mark.parametrize("activations", Q.ACTIVATIONS)
def test_a_row_gives_the_same_bits_alone_and_in_a_group(activations):
    """What makes a verify pass (several rows) and a decode step (one) agree: each row's sums run
    in the same order whatever rows come with it. 17 blocks a row: whole vectors of block scales
    and an odd block past the last pair."""
    rng = np.random.default_rng(6)
    w = random_matrix("q4_1", 40, 544, rng, activations)
    x = jnp.asarray(rng.standard_normal((7, 544)).astype(np.float32))
    product = jax.jit(cpu_matmul.rows_product)
    together = np.asarray(product(x, w))
    for i in range(7):
        assert np.array_equal(np.asarray(product(x[i : i + 1], w))[0], together[i])


@pytest.mark.parametrize("format", ["q4_0", "q4_1", "q8_0"])
def test_tiles_permute_a_matrix_in_place_and_untile_back(format):
    """`tile` keeps a q4 or q8_0 matrix's shapes and permutes its values within each tile of 16
    rows (a stack's layers each on its own, numpy or jax arrays); `untile` gives the rows back, and
    whatever reads the values as rows (dequantising, saving) reads the untiled matrix; a table's
    tokens and a head's are gathered from the tiles. Only what `tileable` allows is tiled, and
    activations that do not keep the tiles untile them."""
    rng = np.random.default_rng(11)
    w = dataclasses.replace(random_matrix(format, 48, 96, rng, "int16"), transposed=True)
    stack = jax.tree.map(lambda *xs: jnp.stack(xs), w, dataclasses.replace(w, qs=w.qs[::-1]))
    as_numpy = jax.tree.map(np.asarray, w)
    for m in (w, stack, as_numpy):
        tiled = Q.tile(m)
        assert tiled.tiled and [a.shape for a in tiled.arrays()] == [a.shape for a in m.arrays()]
        assert not np.array_equal(np.asarray(tiled.qs), np.asarray(m.qs))
        assert not np.array_equal(np.asarray(tiled.scales), np.asarray(m.scales))
        back = Q.untile(tiled)
        assert not back.tiled and all(np.array_equal(a, b) for a, b in zip(back.arrays(), m.arrays()))
        np.testing.assert_array_equal(np.asarray(Q.dequantize_rows(tiled)), np.asarray(Q.dequantize_rows(m)))
    tiled = Q.tile(w)
    assert Q.tile(tiled) is tiled
    x = jnp.asarray(rng.standard_normal((3, 96)).astype(np.float32))
    want = np.asarray(Q.integer_activation_product(x, w))
    assert np.array_equal(np.asarray(Q.integer_activation_product(x, tiled)), want)  # XLA's path reads rows
    from eejax.models.exits import head_rows  # a head's tokens are its rows, tiled or not

    tokens = jnp.asarray([5, 0, 33, -1])
    for tied in (False, True):
        m = dataclasses.replace(w, transposed=not tied)
        picked, want_picked = head_rows(Q.tile(m), tokens, tied), head_rows(m, tokens, tied)
        assert not picked.tiled and all(np.array_equal(a, b) for a, b in zip(picked.arrays(), want_picked.arrays()))
    sixteen = jnp.arange(47, -1, -3)  # 16 rows: a whole tile, kept in tiles as the head is
    assert head_rows(Q.tile(w), sixteen, False).tiled
    assert np.array_equal(Q.dequantize_rows(head_rows(Q.tile(w), sixteen, False)), Q.dequantize_rows(w)[sixteen])
    table = Q.tile(dataclasses.replace(w, transposed=False))  # a tied table: its tokens' rows from the tiles
    assert table.tiled
    tokens = jnp.asarray([[3, 47, 0], [16, 16, -2]])
    want_rows = np.asarray(Q.dequantize_rows(w))[np.asarray(tokens)]
    assert np.array_equal(np.asarray(jax.jit(cpu_matmul.take_rows)(table, tokens)), want_rows)
    saved = Q.from_tree(Q.to_tree({"w": tiled}))["w"]
    assert not saved.tiled and all(np.array_equal(a, b) for a, b in zip(saved.arrays(), w.arrays()))
    for other in (
        dataclasses.replace(w, activations="float32"),
        dataclasses.replace(w, prompt_activations="float32"),
        dataclasses.replace(random_matrix(format, 40, 96, rng, "int16"), transposed=True),  # 40 rows: no whole tiles
        dataclasses.replace(random_matrix("int8", 48, 96, rng, "int16"), transposed=True),
    ):
        assert not Q.tile(other).tiled
    floats = Q.with_activations({"w": tiled}, "float32")["w"]
    assert not floats.tiled and all(np.array_equal(a, b) for a, b in zip(floats.arrays(), w.arrays()))
    assert Q.with_activations({"w": tiled}, "int16")["w"].tiled


@pytest.mark.skipif(not cpu_matmul.panel_products(), reason="the tiled loop is built where the CPU has AVX-512 VNNI")
@pytest.mark.parametrize(
    "format, activations",
    [("q4_0", "int16"), ("q4_1", "int16"), ("q8_0", "int16"), ("q4_0", "int8"), ("q4_1", "int8"), ("q8_0", "int8")],
)
def test_a_tiled_matrix_gives_a_row_the_prefill_gemms_bits_at_every_number_of_rows(format, activations):
    """What the CPU's default load holds: 4-bit layers and a q8_0 head in tiles, int16 x (int8 x
    too: one vpdpbusd per four values, x the signed operand). A decode step's row, a verify pass's,
    a batch's and a prompt's (the GEMM, 65 rows) get the same bits, which the GEMM also gives from
    the untiled rows; matrices in one call give their own products; the values are
    `integer_activation_product`'s up to summation order. 17 blocks a row, 5 tiles."""
    rng = np.random.default_rng(12)
    w = dataclasses.replace(random_matrix(format, 80, 544, rng, activations), transposed=True)
    tiled = Q.tile(w)
    product = jax.jit(cpu_matmul.rows_product)
    x = jnp.asarray(rng.standard_normal((cpu_matmul.MAX_QUANTIZED_ROWS + 1, 544)).astype(np.float32))
    gemm = np.asarray(product(x, dataclasses.replace(tiled, prompt=True)))
    assert np.array_equal(gemm, np.asarray(product(x, dataclasses.replace(w, prompt=True))))
    for rows in (1, 5, 8, 13, cpu_matmul.MAX_QUANTIZED_ROWS):
        assert np.array_equal(np.asarray(product(x[:rows], tiled)), gemm[:rows]), rows
    other = Q.tile(dataclasses.replace(random_matrix(format, 32, 544, rng, activations), transposed=True))
    together = jax.jit(cpu_matmul.rows_products)(x[:5], [tiled, other])
    assert np.array_equal(np.asarray(together[0]), gemm[:5])
    assert np.array_equal(np.asarray(together[1]), np.asarray(product(x[:5], other)))
    emulated = np.asarray(Q.integer_activation_product(x, w))
    np.testing.assert_allclose(gemm, emulated, rtol=0, atol=3e-6 * np.abs(emulated).max())


@pytest.mark.parametrize("activations, near", [("int8", 3e-2), ("int16", 3e-4)])
@pytest.mark.parametrize("format", Q.FORMATS)
def test_integer_activations_match_their_jnp_equal(format, activations, near):
    """The kernel's integer activations and `integer_activation_product` (their jnp equal, XLA's
    path off the CPU) agree up to summation order, for a decode step's few rows and a prefill's
    GEMM (65 rows: 10 groups of 6 and one of 5; 80 weight rows: two panels and a half-filled one);
    both stay `near` the float32 product."""
    rng = np.random.default_rng(3)
    w = random_matrix(format, 80, 544, rng, activations=activations)
    exact = np.asarray(Q.dequantize_rows(w), np.float64)
    for rows in (1, 4, 7, cpu_matmul.MAX_QUANTIZED_ROWS + 1):
        x = rng.standard_normal((rows, 544)).astype(np.float32)
        got = np.asarray(jax.jit(cpu_matmul.rows_product)(jnp.asarray(x), w))
        emulated = np.asarray(Q.integer_activation_product(jnp.asarray(x), w))
        scale = np.abs(emulated).max()
        np.testing.assert_allclose(got, emulated, rtol=0, atol=2e-6 * scale)
        np.testing.assert_allclose(got, x @ exact.T, rtol=0, atol=near * scale)


def test_q8_0_blocks_are_gguf_pys():
    """`quantize_q8_0` (a draft head beside GGUF blocks) makes the bytes gguf-py's quantizer makes,
    a block of zeros and a stack included."""
    w = np.random.default_rng(8).standard_normal((2, 96, 48)).astype(np.float32)
    w[0, :32, 0] = 0
    got = Q.quantize_q8_0(w, transposed=True)
    assert got.shape == w.shape and got.qs.shape == (2, 48, 3, 32)
    for i in range(2):
        want = ggml_blocks(w[i], "q8_0", transposed=True)
        assert np.array_equal(got.qs[i], want.qs) and np.array_equal(got.scales[i], want.scales)


def test_int8_per_channel_keeps_each_output_within_half_a_step():
    w = np.random.default_rng(4).standard_normal((3, 40, 24)).astype(np.float32)  # stacked [L, D_in, out]
    q = Q.quantize_int8(w, transposed=True)
    assert q.shape == w.shape and q.qs.dtype == np.int8 and q.scales.shape == (3, 24, 1)
    step = np.abs(w).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(np.asarray(Q.dequantize(q)) - w) <= step / 2 + 1e-7)


def test_a_quantized_table_gives_the_dequantised_rows():
    w = random_matrix("q4_1", 50, 64, np.random.default_rng(5))
    tokens = jnp.asarray([[3, 49, 0], [7, 7, 1]])
    np.testing.assert_array_equal(np.asarray(cpu_matmul.take_rows(w, tokens)), np.asarray(Q.dequantize_rows(w))[tokens])


# --- a quantized model ----------------------------------------------------------------------------------


def greedy(model, prompts, new=12, spec=None, **kw):
    """Full depth's greedy tokens unless `spec` says (a model with a draft head would speculate by default)."""
    return eejax.generate(model, prompts, max_new_tokens=new, ignore_eos=True, spec=spec, **kw)


PROMPTS = random_prompts(3, [9, 4, 17], vocab=120, seed=3)


def test_blocks_decode_as_their_dequantised_float_model(config, float_params, blocks_model):
    reference = eejax.Model(config, dequantized(blocks_model.params))
    assert blocks_model.quantization == "q4_1+q8_0" and blocks_model.dtype == jnp.float32
    assert greedy(blocks_model, PROMPTS).tokens == greedy(reference, PROMPTS).tokens
    assert eejax.Model(config, float_params).quantization is None


@pytest.mark.parametrize("layout", ["stacked", "split"])
def test_lossless_modes_equal_the_quantized_full_depth(blocks_model, layout):
    """Self-speculation (with and without the bonus pass) and early exit that never exits are
    token-identical to the same quantized model's full depth, in both layer layouts (float32
    activations: with int8 ones, rounding x to 8 bits turns the last-bit differences of XLA's ops
    between a verify pass and a decode step into different tokens; docs/quantization.md)."""
    model = dataclasses.replace(blocks_model, layer_buffers=layout)
    full = greedy(model, PROMPTS).tokens
    for spec in (LayerSkipSpec(2, 3, bonus=True), LayerSkipSpec(1, 2, bonus=False)):
        assert greedy(model, PROMPTS, spec=spec).tokens == full, spec
    assert greedy(model, PROMPTS, exit="softmax:inf").tokens == full


def test_a_gpus_programs_of_the_blocks_decode_as_the_cpus_and_stay_lossless(blocks_model):
    """The programs a GPU runs for block weights (traced for it: XLA's products of the dequantised
    blocks, its static loops), run here on XLA:CPU: the tokens of the CPU's programs (eejax's
    kernel), and speculation and early exit that never exits equal their full depth."""
    model = dataclasses.replace(blocks_model, layer_buffers="stacked", programs=ProgramCache())
    with tracing_for("gpu"):
        full = greedy(model, PROMPTS).tokens
        assert greedy(model, PROMPTS, spec=LayerSkipSpec(2, 3, bonus=True)).tokens == full
        assert greedy(model, PROMPTS, exit="softmax:inf").tokens == full
    assert full == greedy(blocks_model, PROMPTS).tokens
    assert not any("eejax_" in p.as_text() for _, p in model.programs.compiled())  # no CPU kernel ran


def test_prompt_activations_take_the_prefill_and_leave_decoding_exact(config, blocks_model):
    """int16 prompt activations with float32 ones: the prefill's products are the int16 model's
    (its prompt log-probs, bit for bit), decode steps are not (float32), and speculation stays
    token-identical to the same model's full depth."""
    from eejax.engine.engine import Engine

    def scored(params):
        engine = Engine(eejax.Model(config, params), max_slots=1, max_new_tokens=6, cache_budget="4MiB", page_size=8)
        seq = engine.submit(PROMPTS[2], max_new_tokens=6, prompt_logprobs=1, logprobs=0)
        engine.run()
        return seq.prompt_token_logprobs, seq.token_logprobs

    mixed = Q.with_activations(blocks_model.params, "float32", "int16")
    prompt, steps = scored(mixed)
    int16_prompt, int16_steps = scored(Q.with_activations(blocks_model.params, "int16"))
    float_prompt, _ = scored(blocks_model.params)
    assert prompt == int16_prompt and prompt != float_prompt
    assert steps[1:] != int16_steps[1:]  # the steps after the prefill's token multiply float32 x
    model = eejax.Model(config, mixed)
    assert greedy(model, PROMPTS, spec=LayerSkipSpec(2, 3)).tokens == greedy(model, PROMPTS).tokens


@pytest.mark.parametrize("exit", ["static:2", "softmax:0.1"])
def test_early_exit_and_kv_fill_run_as_on_the_dequantised_model(config, blocks_model, exit):
    """Exits (the KV fill of the layers skipped reads the quantized K/V projections) give the
    tokens and exit layers of the same exits on the dequantised float model."""
    reference = eejax.Model(config, dequantized(blocks_model.params))
    ours, want = greedy(blocks_model, PROMPTS, exit=exit), greedy(reference, PROMPTS, exit=exit)
    assert (ours.tokens, ours.exit_layers) == (want.tokens, want.exit_layers)
    assert min(min(e) for e in ours.exit_layers) < config.num_layers  # something exited


def test_the_engine_serves_a_quantized_model_with_prefix_caching(blocks_model):
    """Chunked prefill, a shared prefix and continuous batching over quantized weights give the
    tokens of one plain generate per prompt."""
    from eejax.engine.engine import Engine

    shared = random_prompts(1, [20], vocab=120, seed=9)[0]
    prompts = [shared + p for p in random_prompts(3, [3, 6, 2], vocab=120, seed=10)]
    engine = Engine(
        blocks_model, max_slots=2, max_new_tokens=6, cache_budget="4MiB", page_size=8, prefill_chunk=8, ignore_eos=True
    )
    seqs = [engine.submit(p, max_new_tokens=6) for p in prompts]
    engine.run()
    assert engine.counters["prefix_cache_hit_tokens"] > 0
    assert [s.tokens for s in seqs] == greedy(blocks_model, prompts, new=6).tokens


def test_a_draft_head_is_quantized_with_its_model_and_stays_lossless(config, float_params, blocks_model, tmp_path):
    """A quantized model's draft head is quantized with it (its norms stay float): Q8_0 blocks beside
    a GGUF file's blocks (in tiles where the tiled loop runs), int8 per output channel beside int8
    quantization at load; drafting on it gives the quantized model's full-depth tokens."""
    from eejax.models import draft_head

    draft = draft_head.init_draft(config, jax.random.PRNGKey(3), params=float_params)
    eejax.save(eejax.Model(config, {**blocks_model.params, "draft": draft}), tmp_path / "blocks")
    eejax.save(eejax.Model(config, {**float_params, "draft": draft}), tmp_path / "float")
    assert Q.formats(eejax.load(tmp_path / "blocks").params["draft"]) == set()  # as saved
    for directory, kind, format in ((tmp_path / "blocks", "gguf", "q8_0"), (tmp_path / "float", "int8", "int8")):
        model = eejax.load(directory, quantization=kind)
        d = model.params["draft"]
        assert d["fc"].format == d["layer"]["w_down"].format == format and not Q.is_quantized(d["layer"]["attn_norm"])
        assert greedy(model, PROMPTS, spec="draft:2").tokens == greedy(model, PROMPTS).tokens, kind
    # spec="auto" on a CPU's quantized weights: one row at a time, the head's chain and 2 copies with
    # priced rounds (`auto_spec(on_cpu=True)`), lossless; a batch decodes at full depth
    one = eejax.generate(model, PROMPTS[:1], max_new_tokens=8, ignore_eos=True, spec="auto")
    assert one.stats["spec"] == "draft:2:adaptive:lookup" and one.tokens == greedy(model, PROMPTS[:1], new=8).tokens
    batch = eejax.generate(model, PROMPTS[:2], max_new_tokens=4, ignore_eos=True, spec="auto")
    assert batch.stats["spec"] is None


def test_int8_from_a_float_checkpoint_saves_and_loads(tiny_checkpoints, tmp_path):
    directory = tiny_checkpoints["gqa-untied"][2]
    model = eejax.load(directory, quantization="int8")
    assert model.quantization == "int8"
    assert eejax.load(directory).quantization is None
    tokens = greedy(model, PROMPTS).tokens
    eejax.save(model, tmp_path / "int8")
    again = eejax.load(tmp_path / "int8")
    assert again.quantization == "int8" and greedy(again, PROMPTS).tokens == tokens
    assert eejax.load(tmp_path / "int8", quantization="int8").quantization == "int8"  # already int8: as it is


def test_convert_quantize_int8_writes_int8_matrices(tiny_checkpoints, tmp_path):
    from conversion import convert

    hf_dir = tiny_checkpoints["gqa-tied"][1]
    out = convert(hf_dir, tmp_path / "q", quantization="int8", progress=False)
    model = eejax.load(out)
    assert model.quantization == "int8" and model.params["layers"]["wq"].transposed
    assert not Q.is_quantized(model.params["layers"]["attn_norm"])
    reference = eejax.load(tiny_checkpoints["gqa-tied"][2], quantization="int8")
    assert greedy(model, PROMPTS).tokens == greedy(reference, PROMPTS).tokens


def test_bad_quantization_requests_are_refused_by_name(tiny_checkpoints, blocks_model, tmp_path):
    directory = tiny_checkpoints["gqa-tied"][2]
    with pytest.raises(EejaxError, match="unknown quantization 'int4'"):
        eejax.load(directory, quantization="int4")
    with pytest.raises(EejaxError, match="unknown activations"):
        eejax.load(directory, quantization="int8", activations="fp8")
    with pytest.raises(EejaxError, match="apply to quantized weights"):
        eejax.load(directory, activations="int8")
    with pytest.raises(EejaxError, match="unknown prompt activations 'int4'"):
        eejax.load(directory, quantization="int8", prompt_activations="int4")
    with pytest.raises(EejaxError, match="prompt activations 'int16' apply to quantized weights"):
        eejax.load(directory, prompt_activations="int16")
    with pytest.raises(EejaxError, match="keeps a GGUF file's own blocks"):
        eejax.load(directory, quantization="gguf")
    with pytest.raises(EejaxError, match="not a .gguf file"):
        eejax.convert(tiny_checkpoints["gqa-tied"][1], tmp_path / "x", quantization="gguf")
    assert not (tmp_path / "x").exists()
    with pytest.raises(UnsupportedModelError, match="cannot be placed on a mesh"):
        eejax.shard(blocks_model, eejax.make_mesh(tensor=1))
    assert eejax.load(directory, quantization="none").quantization is None


def test_auto_keeps_a_known_gguf_models_blocks_on_a_cpu_and_the_rest_as_stored(monkeypatch, tiny_checkpoints):
    """`eejax.load`'s default: a known GGUF model's own blocks with int16 activations on a CPU;
    a directory, another dtype or a GPU as stored (float32)."""
    from eejax.loading import hub

    gguf_model = hub.KnownModel(description="test", requirement="x==1", member="x/tiny.Q4_1.gguf")
    monkeypatch.setitem(hub.KNOWN_MODELS, "tiny-gguf", gguf_model)
    monkeypatch.setitem(hub.KNOWN_MODELS, "tiny-gguf-eagle", hub.KnownModel("test", base="tiny-gguf", delta="d"))
    monkeypatch.setitem(
        hub.KNOWN_MODELS, "tiny-gguf-layerskip", hub.KnownModel("test", base="tiny-gguf", delta="layerskip")
    )
    assert hub.default_quantization("tiny-gguf") == hub.default_quantization("tiny-gguf-eagle") == ("gguf", "int16")
    assert hub.default_quantization("tiny-gguf-layerskip") == (None, "float32")  # its LoRA changed the weights
    monkeypatch.setitem(hub.KNOWN_MODELS, "tiny-on-a-directory", hub.KnownModel("test", base="/x/y", delta="d"))
    assert hub.default_quantization("tiny-on-a-directory") == (None, "float32")
    assert hub.default_quantization("tiny-gguf", dtype=jnp.bfloat16) == (None, "float32")
    assert hub.default_quantization(tiny_checkpoints["gqa-tied"][2]) == (None, "float32")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert hub.default_quantization("tiny-gguf") == (None, "float32")
    assert eejax.load(tiny_checkpoints["gqa-tied"][2]).quantization is None


def test_the_cli_quantizes_and_refuses_bad_values(capsys, tiny_checkpoints, tmp_path):
    from tests.test_cli import run_cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"The river rose"\n')
    ckpt = tiny_checkpoints["gqa-untied"][2]
    common = ("generate", "--model", ckpt, "--prompts-file", prompts, "--max-new-tokens", 4, "--ignore-eos", "--json")
    code, out, _ = run_cli(capsys, *common, "--quantization", "int8", "--activations", "int8")
    assert code == 0 and len(json.loads(out)["outputs"][0]["tokens"]) == 4
    code, out, _ = run_cli(capsys, *common, "--quantization", "off")
    assert code == 0
    code, _, err = run_cli(capsys, *common, "--quantization", "int4")
    assert code == 2 and "expected auto, gguf, int8 or none, got 'int4'" in err
    code, _, err = run_cli(capsys, *common, "--activations", "int8")
    assert code == 2 and "apply to quantized weights" in err
    code, out, _ = run_cli(capsys, *common, "--quantization", "int8", "--prompt-activations", "int16")
    assert code == 0 and len(json.loads(out)["outputs"][0]["tokens"]) == 4
    convert = ["convert", tiny_checkpoints["gqa-untied"][1], tmp_path / "q", "--quantization", "int8", "--quiet"]
    code, out, err = run_cli(capsys, *convert)
    assert code == 0 and eejax.load(tmp_path / "q").quantization == "int8" and "deprecated" not in err
    # the old name still works, says so, and refuses to be given beside the new one
    code, out, err = run_cli(capsys, *convert[:2], tmp_path / "q2", "--quantize", "int8", "--quiet")
    assert code == 0 and "--quantize is deprecated; use --quantization" in err
    code, out, err = run_cli(capsys, *convert, "--quantize", "none")
    assert code == 2 and "given twice" in err
