"""Paged attention (the jnp reference and eejax's CPU kernel) against a dense numpy attention over
the same keys."""

import numpy as np
import pytest

from eejax.kernels import paged_attention


def dense_attention(q, keys, values, q_pos, kv_len, window=None):
    """q [T, Hq, D]; keys/values [N, Hkv, D] (row's tokens in order) -> [T, Hq, D] (numpy); with a
    window, each query sees its last `window` positions."""
    t, hq, d = q.shape
    group = hq // keys.shape[1]
    out = np.zeros_like(q)
    for i in range(t):
        n = min(kv_len, q_pos[i] + 1)
        lo = 0 if window is None else max(0, q_pos[i] - window + 1)
        for h in range(hq):
            if n <= lo:
                continue
            k, v = keys[lo:n, h // group], values[lo:n, h // group]
            s = k @ q[i, h] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v
    return out


def build_case(rng, lengths, q_len, page_size, hq, hkv, d, layers=2, layer=1):
    """Scatters each row's keys into random pages of a cache; returns everything needed."""
    b = len(lengths)
    max_pages = max(1, -(-max(lengths) // page_size))
    num_pages = 1 + b * max_pages + 3
    kc = rng.standard_normal((layers, hkv, num_pages, page_size, d)).astype(np.float32)
    vc = rng.standard_normal((layers, hkv, num_pages, page_size, d)).astype(np.float32)
    perm = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((b, max_pages), np.int32)
    rows_k, rows_v = [], []
    for i, n in enumerate(lengths):
        need = -(-n // page_size)
        table[i, :need] = perm[i * max_pages : i * max_pages + need]
        pos = np.arange(n)
        rows_k.append(kc[layer][:, table[i, pos // page_size], pos % page_size].transpose(1, 0, 2))
        rows_v.append(vc[layer][:, table[i, pos // page_size], pos % page_size].transpose(1, 0, 2))
    q = rng.standard_normal((b, q_len, hq, d)).astype(np.float32)
    # The new tokens are the last q_len of each row (fewer if the row is shorter).
    q_pos = np.array([[max(n - q_len, 0) + t for t in range(q_len)] for n in lengths], np.int32)
    return q, kc, vc, table, q_pos, rows_k, rows_v


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_paged_attention_matches_dense(page_size, hq, hkv, q_len, impl):
    """Six rows: up to 16 query heads x tokens per row take the summed products, 8 heads x 5
    tokens the batched matmuls (`attention._few_queries`), or the CPU kernel; a row of length 0
    gives zeros."""
    rng = np.random.default_rng(page_size * 100 + hq * 10 + q_len)
    lengths = [0, 1, page_size, page_size + 1, 3 * page_size - 1, 7]
    q, kc, vc, table, q_pos, rows_k, rows_v = build_case(rng, lengths, q_len, page_size, hq, hkv, 16)
    kv_len = np.array(lengths, np.int32)
    got = np.asarray(paged_attention(q, kc, vc, np.int32(1), table, q_pos, kv_len, impl=impl))
    for i, n in enumerate(lengths):
        want = dense_attention(q[i], rows_k[i], rows_v[i], q_pos[i], n)
        np.testing.assert_allclose(got[i], want, atol=1e-5, rtol=1e-5, err_msg=f"row {i} (length {n})")
    assert np.all(got[0] == 0), "a row of length 0 must give zeros"


def test_the_cpu_kernel_takes_many_queries_per_kv_head():
    """16 query heads on one KV head, 16 tokens a row: 256 queries share a head (the kernel once
    took at most 64, and "auto" gave the rest to the reference); enough keys that the queries
    are split between threads."""
    from eejax.kernels import cpu_attention

    rng = np.random.default_rng(12)
    lengths = [40, 70]
    q, kc, vc, table, q_pos, rows_k, rows_v = build_case(rng, lengths, 16, 8, 16, 1, 16)
    assert cpu_attention.applies(q, kc, None, None)
    got = np.asarray(paged_attention(q, kc, vc, np.int32(1), table, q_pos, np.array(lengths, np.int32), impl="cpu"))
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(
            got[i], dense_attention(q[i], rows_k[i], rows_v[i], q_pos[i], n), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 1, 24), (12, 1, 128)])
def test_the_cpu_kernels_prefill_tiles_give_each_query_its_bits_alone(hq, hkv, d):
    """A prefill's queries go in tiles (consecutive positions x heads of a KV head), each seeing
    its own number of keys: every query's output is the same bits as that query alone, whatever
    tile it fell in (positions past a tile's edge, a key count ending inside a block of 4)."""
    rng = np.random.default_rng(hq * 1000 + d)
    lengths = [37, 70]
    q, kc, vc, table, q_pos, rows_k, rows_v = build_case(rng, lengths, 23, 8, hq, hkv, d)
    kv_len = np.array(lengths, np.int32)
    together = np.asarray(paged_attention(q, kc, vc, np.int32(1), table, q_pos, kv_len, impl="cpu"))
    for t in (0, 1, 4, 10, 11, 22):
        alone = paged_attention(q[:, t : t + 1], kc, vc, np.int32(1), table, q_pos[:, t : t + 1], kv_len, impl="cpu")
        assert np.array_equal(np.asarray(alone)[:, 0], together[:, t]), f"position {t}"
    for i, n in enumerate(lengths):
        want = dense_attention(q[i], rows_k[i], rows_v[i], q_pos[i], n)
        np.testing.assert_allclose(together[i], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("window", [1, 5, 13])
def test_a_sliding_window_hides_keys_before_it(impl, window):
    """With a window W each query sees its last W positions (Mistral's sliding window): prefills
    of 23 positions (tiles of the CPU kernel whose queries start at different keys) and one-token
    steps equal a dense reference; the CPU kernel's query alone equals it in a tile, bit for bit."""
    rng = np.random.default_rng(window)
    lengths = [37, 9, 70]
    q, kc, vc, table, q_pos, rows_k, rows_v = build_case(rng, lengths, 23, 8, 6, 2, 64)
    kv_len = np.array(lengths, np.int32)
    got = np.asarray(paged_attention(q, kc, vc, np.int32(1), table, q_pos, kv_len, impl=impl, window=window))
    for i, n in enumerate(lengths):
        want = dense_attention(q[i], rows_k[i], rows_v[i], q_pos[i], n, window)
        np.testing.assert_allclose(got[i], want, atol=1e-5, rtol=1e-5, err_msg=f"row {i}")
    for t in (0, 7, 22):
        one = paged_attention(
            q[:, t : t + 1], kc, vc, np.int32(1), table, q_pos[:, t : t + 1], kv_len, impl=impl, window=window
        )
        if impl == "cpu":
            assert np.array_equal(np.asarray(one)[:, 0], got[:, t]), f"position {t}"
        else:
            np.testing.assert_allclose(np.asarray(one)[:, 0], got[:, t], atol=1e-6)


def test_causal_mask_hides_later_tokens():
    """Changing keys after a query's position must not change its output."""
    rng = np.random.default_rng(0)
    q, kc, vc, table, q_pos, *_ = build_case(rng, [12], 4, 4, 2, 2, 8)
    a = np.asarray(paged_attention(q, kc, vc, 1, table, q_pos, np.array([12], np.int32)))
    last_page, last_slot = table[0, 11 // 4], 11 % 4
    kc[1, :, last_page, last_slot] += 10.0
    b = np.asarray(paged_attention(q, kc, vc, 1, table, q_pos, np.array([12], np.int32)))
    np.testing.assert_array_equal(a[:, :3], b[:, :3])
    assert not np.allclose(a[:, 3], b[:, 3])


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="impl"):
        paged_attention(
            np.zeros((1, 1, 1, 4)),
            np.zeros((1, 1, 2, 4, 4)),
            np.zeros((1, 1, 2, 4, 4)),
            0,
            np.zeros((1, 1), np.int32),
            np.zeros((1, 1), np.int32),
            np.ones(1, np.int32),
            impl="cuda",
        )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cache_writes_set_the_same_bits_and_convert_nothing(dtype):
    """`scatter_set` writes a 16-bit float cache through its uint16 view: the bits `.at[].set`
    writes, without XLA:CPU's float32 round trip of the whole buffer (a bf16 scatter's)."""
    import jax
    import jax.numpy as jnp

    from eejax.cache.paged import scatter_set

    rng = np.random.default_rng(0)
    buffer = jnp.asarray(rng.normal(size=(3, 2, 5, 4, 8)), dtype)
    values = jnp.asarray(rng.normal(size=(2, 2, 3, 8)), jnp.float32)
    index = (1, jnp.arange(2)[:, None, None], jnp.array([[4, 0, 2], [1, 1, 3]]), jnp.array([[0, 3, 1], [2, 0, 3]]))
    got = jax.jit(scatter_set)(buffer, index, values)
    want = buffer.at[index].set(values.astype(dtype))
    assert got.dtype == buffer.dtype and np.array_equal(np.asarray(got), np.asarray(want))
    if dtype != "float32":
        text = jax.jit(scatter_set).lower(buffer, index, values).compile().as_text()
        assert "f32[3,2,5,4,8]" not in text  # the buffer never goes through float32


@pytest.mark.parametrize(
    "lengths,positions,hq,hkv,d",
    [([90, 230, 40], 5, 6, 2, 16), ([330], 3, 9, 3, 64), ([330], 4, 9, 3, 64), ([330], 5, 9, 3, 64)],
)
def test_the_cpu_kernel_computes_each_query_alone(lengths, positions, hq, hkv, d):
    """A query's output is the same bits whether it comes alone (a decode step, on the calling
    thread) or with others (a verify pass of 3-5 positions: scores of three queries as four, the
    values of up to five in one pass; split between threads), and "auto" on a CPU is the
    kernel."""
    import jax

    from eejax.kernels.attention import resolve_impl

    rng = np.random.default_rng(11)
    q, kc, vc, table, q_pos, _, _ = build_case(rng, lengths, positions, 4, hq, hkv, d)
    kv_len = np.array(lengths, np.int32)
    together = np.asarray(paged_attention(q, kc, vc, np.int32(1), table, q_pos, kv_len, impl="cpu"))
    for t in range(positions):
        alone = paged_attention(q[:, t : t + 1], kc, vc, np.int32(1), table, q_pos[:, t : t + 1], kv_len, impl="cpu")
        assert np.array_equal(np.asarray(alone)[:, 0], together[:, t])
    assert resolve_impl("auto") == ("cpu" if jax.default_backend() == "cpu" else resolve_impl("auto"))


def test_a_decode_steps_queries_split_by_head_give_their_bits_in_a_batch():
    """A batch-1 decode step with enough keys takes a tile per head (SmolLM2's shape: 3 tiles of
    KV heads would split 1:2 between two threads, 9 heads 4:5); in a batch of 4 rows the same query
    goes in a tile of its KV head's heads. Its output is the same bits either way."""
    rng = np.random.default_rng(12)
    lengths = [300, 120, 260, 40]
    q, kc, vc, table, q_pos, rows_k, rows_v = build_case(rng, lengths, 1, 16, 9, 3, 64)
    kv_len = np.array(lengths, np.int32)
    batch = np.asarray(paged_attention(q, kc, vc, np.int32(1), table, q_pos, kv_len, impl="cpu"))
    for i in (0, 2):
        alone = paged_attention(
            q[i : i + 1], kc, vc, np.int32(1), table[i : i + 1], q_pos[i : i + 1], kv_len[i : i + 1], impl="cpu"
        )
        assert np.array_equal(np.asarray(alone)[0], batch[i])
        want = dense_attention(q[i], rows_k[i], rows_v[i], q_pos[i], lengths[i])
        np.testing.assert_allclose(batch[i], want, atol=1e-5, rtol=1e-5)
