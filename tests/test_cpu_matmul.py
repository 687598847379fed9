"""eejax's CPU kernel library (`kernels/cpu_matmul`): the products XLA computes, every row
computed alone as in a batch, gradients and vmap through it, XLA's product where it does not
apply, a build that fails leaving nothing behind; rows of a bf16 table as jnp reads them."""

import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eejax.kernels import cpu_matmul
from eejax.kernels.cpu_matmul import MAX_CALLED_ROWS, MAX_ROWS, matmul, matmul_t, take_rows

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="no C++ compiler for the kernel")


def _uses_kernel(fn, *args) -> bool:
    # a fresh function: jit would reuse an earlier trace, and the choice is made when tracing
    return "@eejax_" in jax.jit(lambda *a: fn(*a)).lower(*args).as_text()


@pytest.mark.parametrize(
    "rows, k, n, dtype",  # tails of every loop; N split (> 8192); bf16 weights and rows
    [(1, 576, 1536, "float32"), (3, 37, 50, "float32"), (8, 1536, 576, "float32"), (2, 64, 9000, "float32"),
     (1, 576, 1536, "bfloat16"), (5, 37, 50, "bfloat16")],
)  # fmt: skip
def test_products_equal_xlas(rows, k, n, dtype):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, k), dtype=np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32), dtype)
    assert _uses_kernel(matmul, x, w) and _uses_kernel(matmul_t, x, w.T)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)  # bf16 values are exact in float64
    tolerance = dict(rtol=1e-5, atol=1e-5 * np.sqrt(k))  # float32 sums of k unit products
    np.testing.assert_allclose(jax.jit(matmul)(x, w), want, **tolerance)
    np.testing.assert_allclose(jax.jit(matmul_t)(x, jnp.asarray(w.T)), want, **tolerance)


def test_a_row_alone_equals_that_row_in_a_batch():
    """Bit for bit: a verify pass over d + 1 rows, a batch's verify (more than one call's rows)
    and a decode step of one row agree (a weight big enough to be split between threads: each
    part's partial sum, added in a fixed order)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((MAX_CALLED_ROWS, 192), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((192, 384), dtype=np.float32))
    for fn, weight in ((matmul, w), (matmul_t, w.T)):
        for rows in (MAX_ROWS, 21, MAX_CALLED_ROWS):
            assert _uses_kernel(fn, x[:rows], weight)
            batch = np.asarray(jax.jit(fn)(x[:rows], weight))
            for i in (0, 5, rows - 1):
                np.testing.assert_array_equal(np.asarray(jax.jit(fn)(x[i : i + 1], weight))[0], batch[i])


def test_gradients_and_vmap_go_through_it():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 3, 24), dtype=np.float32))  # 6 rows over two axes
    w = jnp.asarray(rng.standard_normal((24, 40), dtype=np.float32))
    pairs = ((matmul, w, lambda x, w: x @ w), (matmul_t, w.T, lambda x, w: x @ w.T))
    for fn, weight, ref in pairs:
        got = jax.grad(lambda x, w, f=fn: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1))(x, weight)
        want = jax.grad(lambda x, w, f=ref: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1))(x, weight)
        for g, e in zip(got, want):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(jax.vmap(fn, in_axes=(0, None))(x, weight), ref(x, weight), rtol=1e-5, atol=1e-5)


def test_xlas_product_where_the_kernel_does_not_apply(monkeypatch):
    x = jnp.ones((MAX_CALLED_ROWS + 1, 16), jnp.float32)
    w = jnp.ones((16, 32), jnp.float32)
    assert not _uses_kernel(matmul, x, w)  # too many rows: a GEMM, XLA threads it
    assert not _uses_kernel(matmul, x[:1].astype(jnp.float16), w.astype(jnp.float16))
    assert _uses_kernel(matmul, x[:1], w)
    monkeypatch.setenv("EEJAX_CPU_MATMUL", "off")
    assert not _uses_kernel(matmul, x[:1], w)


def test_a_failed_build_raises_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    with pytest.raises(subprocess.CalledProcessError):
        cpu_matmul.build(tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(FileNotFoundError):
        cpu_matmul.build(tmp_path)


def test_a_build_starts_in_the_background_only_where_it_is_needed(monkeypatch):
    if cpu_matmul.available():  # built: nothing to start
        assert cpu_matmul.library_path().exists() and cpu_matmul.build_soon() is None
    monkeypatch.setenv("EEJAX_CPU_MATMUL", "off")  # not used: nothing to build
    monkeypatch.setenv("EEJAX_CACHE", "/nonexistent/eejax-cache")
    assert cpu_matmul.build_soon() is None


def test_rows_of_a_bf16_table_as_jnp_indexing_reads_them():
    table = jnp.asarray(np.random.default_rng(2).standard_normal((100, 24)), jnp.bfloat16)
    ids = jnp.asarray([[3, 99, 0], [150, -5, 7], [-150, 42, 42]], jnp.int32)  # outside, from the end, repeated
    assert _uses_kernel(take_rows, table, ids) and not _uses_kernel(take_rows, table.astype(jnp.float32), ids)
    np.testing.assert_array_equal(jax.jit(take_rows)(table, ids), table[ids])
    got, want = (
        jax.grad(lambda t, f=f: jnp.sum(f(t).astype(jnp.float32) ** 2))(table)
        for f in (lambda t: take_rows(t, ids), lambda t: t[ids])
    )
    np.testing.assert_array_equal(got, want)
