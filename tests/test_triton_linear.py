"""The fused products (`kernels.triton_linear`), run through Triton's interpreter: each form against
the jnp reference, and a row's bits the same alone, among 5 verified positions and in a batch of 8."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eejax.errors import EejaxError
from eejax.kernels.triton_linear import BLOCK_K, BLOCK_M, fused_linear, fused_linears, plan_linear
from eejax.models.common import rms_norm

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

K, N = BLOCK_K + 16, 72  # a partial K step and a partial column tile
HIGHEST = jax.lax.Precision.HIGHEST


def weights(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    w, up = (jnp.asarray(rng.normal(size=(K, N)) * 0.1, dtype) for _ in range(2))
    return w, up, jnp.asarray(rng.normal(size=(K,)), jnp.float32)


def rows(n, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(n, K)), jnp.float32)


def forms(x, w, up, g, r):
    """Each form's kernel call and its reference."""
    normed = rms_norm(x, g, 1e-5)

    def dot(a, b):
        return jnp.dot(a, b.astype(jnp.float32), precision=HIGHEST)

    return {
        "plain": (dict(), dot(x, w)),
        "norm": (dict(norm_weight=g), dot(normed, w)),
        "norm+gated": (dict(norm_weight=g, w_up=up), jax.nn.silu(dot(normed, w)) * dot(normed, up)),
        "residual": (dict(residual=r), r + dot(x, w)),
    }


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_each_form_matches_the_reference(dtype):
    w, up, g = weights(dtype)
    x = rows(5, 1)
    r = jnp.asarray(np.random.default_rng(2).normal(size=(5, N)), jnp.float32)
    for name, (kw, want) in forms(x, w, up, g, r).items():
        got = fused_linear(x, w, interpret=True, **kw)
        assert got.shape == (5, N) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    """Alone, as one of d + 1 = 5 verified positions, in a batch of 8 and of 20 (two row tiles):
    the same bits for every form."""
    w, up, g = weights()
    x = rows(20, 3)
    r = jnp.asarray(np.random.default_rng(4).normal(size=(20, N)), jnp.float32)
    for name, (kw, _) in forms(x, w, up, g, r).items():

        def call(lo, hi, kw=kw):
            picked = {k: (v[lo:hi] if k == "residual" else v) for k, v in kw.items()}
            return np.asarray(fused_linear(x[lo:hi], w, interpret=True, **picked))

        alone, five, eight, twenty = call(3, 4), call(1, 6), call(0, 8), call(0, 20)
        for got in (five[2], eight[3], twenty[3]):
            np.testing.assert_array_equal(got, alone[0], err_msg=name)
        np.testing.assert_array_equal(twenty[17], call(17, 18)[0], err_msg=name)  # the second row tile
        last = call(15, 16)[0]  # the last row of a tile (numpy's BLAS gave rows 6-15 other bits)
        for got in (call(8, 16)[7], twenty[15]):
            np.testing.assert_array_equal(got, last, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_tied_head_reads_the_embeddings_rows_and_gives_float32_logits(dtype):
    """The final norm + a tied head: e [V, K] read as its rows (`transposed`), float32 logits from
    x of the model's dtype, the reference's values, and a row's bits the same alone, among 8 and
    as the last row of a 16-row tile."""
    w, _, g = weights(dtype)
    e = jnp.asarray(np.asarray(w, np.float32).T, dtype)  # [N, K]: the embedding's layout
    x = rows(20, 5).astype(dtype)

    def head(lo, hi):
        y = fused_linear(x[lo:hi], e, norm_weight=g, transposed=True, out_dtype=jnp.float32, interpret=True)
        assert y.dtype == jnp.float32 and y.shape == (hi - lo, N)
        return np.asarray(y)

    want = jnp.dot(rms_norm(x.astype(jnp.float32), g, 1e-5), e.astype(jnp.float32).T, precision=HIGHEST)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    twenty = head(0, 20)
    np.testing.assert_allclose(twenty, np.asarray(want), rtol=tol, atol=tol)
    for lo, hi, at in ((3, 4, 0), (0, 8, 3), (0, 20, 3)):
        np.testing.assert_array_equal(head(lo, hi)[at], twenty[3])
    np.testing.assert_array_equal(head(15, 16)[0], twenty[15])
    with pytest.raises(EejaxError, match=r"needs matrices \[N, 80\]"):
        fused_linear(x, w, transposed=True, interpret=True)
    with pytest.raises(EejaxError, match="takes no w_up"):
        fused_linear(x, e, w_up=e, transposed=True, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_q_and_k_rotated_in_the_launch_are_the_rotation_of_the_products(dtype):
    """rope=(cos, sin): q and k come out rotated per head (as `apply_rope` rotates the products),
    v as it is; a row's bits are its own alone, among 5 and as the last row of a tile."""
    from eejax.models.rope import apply_rope, inv_frequencies, rope_tables

    rng = np.random.default_rng(6)
    dh, k = 32, BLOCK_K + 16
    wq, wk, wv = (jnp.asarray(rng.normal(size=(k, n)) * 0.1, dtype) for n in (4 * dh, 2 * dh, 2 * dh))
    g = jnp.asarray(rng.normal(size=(k,)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(16, k)), jnp.float32)
    cos, sin = rope_tables(jnp.asarray(rng.integers(0, 500, (16,)), jnp.int32), inv_frequencies(dh, 10000.0, None))

    def call(lo, hi):
        outs = fused_linears(x[lo:hi], [wq, wk, wv], norm_weight=g, rope=(cos[lo:hi], sin[lo:hi]), interpret=True)
        return [np.asarray(o) for o in outs]

    q, kk, v = call(0, 16)
    plain = fused_linears(x, [wq, wk, wv], norm_weight=g, interpret=True)
    for got, want, heads in ((q, plain[0], 4), (kk, plain[1], 2)):
        rotated = apply_rope(want.astype(jnp.float32).reshape(16, 1, heads, dh), cos[:, None], sin[:, None])
        np.testing.assert_allclose(got, np.asarray(rotated).reshape(16, -1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(v, np.asarray(plain[2]))
    for lo, hi, at in ((3, 4, 0), (1, 6, 2), (0, 8, 3)):
        for got, whole in zip(call(lo, hi), (q, kk, v)):
            np.testing.assert_array_equal(got[at], whole[3])
    for got, whole in zip(call(15, 16), (q, kk, v)):
        np.testing.assert_array_equal(got[0], whole[15])
    with pytest.raises(EejaxError, match="rope takes q, k and v alone"):
        fused_linears(x, [wq, wk], rope=(cos, sin), interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_k_and_v_go_into_the_paged_cache_as_write_layer_kv_writes_them(dtype):
    """fused_qkv_into_cache: q as the rope launch gives it, and the cache as `write_layer_kv` of
    that launch's k and v leaves it (the other layers, pages and slots untouched; a padding row's
    to the null page), bit for bit."""
    from eejax.cache.paged import KVCache, slot_indices, write_layer_kv
    from eejax.kernels.triton_linear import fused_qkv_into_cache
    from eejax.models.rope import inv_frequencies, rope_tables

    rng = np.random.default_rng(8)
    dh, k, hkv, page = 32, BLOCK_K + 16, 2, 4
    wq, wk, wv = (jnp.asarray(rng.normal(size=(k, n)) * 0.1, dtype) for n in (4 * dh, hkv * dh, hkv * dh))
    g = jnp.asarray(rng.normal(size=(k,)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 3, k)), dtype)  # 2 rows of 3 tokens, the second's last is padding
    positions = jnp.asarray([[5, 6, 7], [0, 1, 2]], jnp.int32)
    valid = jnp.asarray([[True, True, True], [True, True, False]])
    table = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
    pages, slots = slot_indices(table, positions, valid, page)
    cos, sin = rope_tables(positions, inv_frequencies(dh, 10000.0, None))
    shape = (3, hkv, 7, page, dh)
    cache = KVCache(*(jnp.asarray(rng.normal(size=shape), dtype) for _ in range(2)))
    q, k_cache, v_cache = fused_qkv_into_cache(
        x, [wq, wk, wv], norm_weight=g, eps=1e-5, rope=(cos, sin), k_cache=cache.k, v_cache=cache.v, layer=1,
        pages=pages, slots=slots, interpret=True,
    )  # fmt: skip
    want_q, want_k, want_v = fused_linears(x, [wq, wk, wv], norm_weight=g, rope=(cos, sin), interpret=True)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(want_q))
    heads = (2, 3, hkv, dh)
    want = write_layer_kv(cache, 1, want_k.reshape(heads), want_v.reshape(heads), pages, slots)
    for got, ref in ((k_cache, want.k), (v_cache, want.v)):
        np.testing.assert_array_equal(np.asarray(got)[:, :, 1:], np.asarray(ref)[:, :, 1:])  # page 0: the null page
    with pytest.raises(EejaxError, match="a cache"):
        fused_qkv_into_cache(
            x, [wq, wk, wv], norm_weight=g, eps=1e-5, rope=(cos, sin), k_cache=cache.k[:, :1], v_cache=cache.v,
            layer=1, pages=pages, slots=slots, interpret=True,
        )  # fmt: skip


def test_three_matrices_in_one_launch_give_what_each_gives_alone():
    """q, k and v in one launch (their column tiles side by side): each output's bits are those of
    its matrix alone, with the norm fused in, at 1 and 5 rows."""
    w, up, g = weights()
    k_matrix = jnp.asarray(np.random.default_rng(5).normal(size=(K, 24)) * 0.1, jnp.float32)
    for n_rows in (1, 5):
        x = rows(n_rows, 6)
        together = fused_linears(x, [w, k_matrix, up], norm_weight=g, interpret=True)
        assert [y.shape for y in together] == [(n_rows, N), (n_rows, 24), (n_rows, N)]
        for y, matrix in zip(together, (w, k_matrix, up)):
            np.testing.assert_array_equal(
                np.asarray(y), np.asarray(fused_linear(x, matrix, norm_weight=g, interpret=True))
            )
    with pytest.raises(EejaxError, match="one to three matrices"):
        fused_linears(rows(2, 0), [w, w], residual=jnp.zeros((2, N)), interpret=True)


def test_the_tile_never_depends_on_the_row_count_and_shapes_are_checked():
    for n_rows in (1, 5, 8, 64):
        for gated, weight_bytes in ((False, 4), (True, 4), (True, 2)):
            plan = plan_linear(n_rows, K, (N,), norm=True, gated=gated, residual=False, upcast=False, eps=1e-5,
                               weight_bytes=weight_bytes)  # fmt: skip
            assert plan.constexprs["BLOCK_M"] == BLOCK_M and plan.grid[0] == -(-n_rows // BLOCK_M)
            assert plan.constexprs["BLOCK_N"] == (32 if gated and weight_bytes == 4 else 64)
            assert plan.scalars[5].dtype == np.float32  # eps: jax-triton would type a Python float as fp64
        for weight_bytes, block_n in ((4, 32), (2, 64)):  # a tied head's rows
            plan = plan_linear(n_rows, K, (N,), norm=True, gated=False, residual=False, upcast=False, eps=1e-5,
                               weight_bytes=weight_bytes, transposed=True)  # fmt: skip
            assert plan.constexprs["BLOCK_N"] == block_n and plan.constexprs["TRANSPOSED"]
    w, up, _ = weights()
    with pytest.raises(EejaxError, match="needs matrices"):
        fused_linear(rows(2, 0), w.T, interpret=True)
    with pytest.raises(EejaxError, match="w_up must be"):
        fused_linear(rows(2, 0), w, w_up=up[:, :8], interpret=True)
