"""The Triton paged-attention kernel, run through Triton's interpreter, against the jnp reference."""

import importlib.util
import itertools
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import eejax
from eejax.kernels.attention import paged_attention, reference_paged_attention, resolve_impl
from eejax.kernels.position_bias import RelativePositionBias, relative_position_bucket
from eejax.kernels.triton_attention import merge_splits, plan_launch, triton_paged_attention
from tests.helpers import random_prompts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def attention_case(seed, *, page, group, head_dim, q_len, dtype, num_kv_heads=2, layers=2, pages_per_row=None):
    """Random cache and queries for 4 rows: a padding row (length 0), a row holding just the new
    tokens, one ending right after a page boundary, and a random ragged one."""
    rng = np.random.default_rng(seed)
    pages_per_row = pages_per_row or 4 + (q_len + page - 1) // page
    num_pages = 1 + 4 * pages_per_row
    max_keys = pages_per_row * page
    lengths = np.array([0, q_len, min(2 * page + 1, max_keys), rng.integers(q_len, max_keys + 1)], np.int32)
    positions = np.maximum(lengths - q_len, 0)[:, None] + np.arange(q_len, dtype=np.int32)
    table = (1 + rng.permutation(num_pages - 1)[: 4 * pages_per_row]).reshape(4, pages_per_row).astype(np.int32)
    shape = (layers, num_kv_heads, num_pages, page, head_dim)
    k, v = (jnp.asarray(rng.normal(size=shape), dtype) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(4, q_len, num_kv_heads * group, head_dim)), dtype)
    return q, k, v, jnp.asarray(table), jnp.asarray(positions), jnp.asarray(lengths)


def assert_close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.abs(got - want).max() <= TOLERANCE[dtype], np.abs(got - want).max()


CASES = list(itertools.product([8, 16], [1, 3, 8], [64, 128], [1, 4, 16]))


@pytest.mark.parametrize("page,group,head_dim,q_len", CASES)
def test_kernel_matches_reference_fp32(page, group, head_dim, q_len):
    q, k, v, table, pos, lengths = attention_case(
        hash((page, group, head_dim, q_len)) % 2**32,
        page=page,
        group=group,
        head_dim=head_dim,
        q_len=q_len,
        dtype=jnp.float32,
    )
    want = reference_paged_attention(q, k, v, 1, table, pos, lengths)
    got = triton_paged_attention(q, k, v, 1, table, pos, lengths, interpret=True)
    assert_close(got, want, jnp.float32)
    assert not np.asarray(got[0]).any()  # the length-0 row gives zeros


@pytest.mark.parametrize("page,group,q_len", [(8, 1, 1), (16, 3, 1), (16, 8, 16), (8, 3, 5)])
def test_kernel_matches_reference_bf16(page, group, q_len):
    q, k, v, table, pos, lengths = attention_case(
        7, page=page, group=group, head_dim=64, q_len=q_len, dtype=jnp.bfloat16
    )
    want = reference_paged_attention(q, k, v, 0, table, pos, lengths)
    got = triton_paged_attention(q, k, v, 0, table, pos, lengths, interpret=True)
    assert got.dtype == jnp.bfloat16
    assert_close(got, want, jnp.bfloat16)


@pytest.mark.parametrize("window", [1, 7])
def test_kernel_matches_reference_with_a_window(window):
    """Mistral's sliding window: a query sees only its last `window` positions."""
    q, k, v, table, pos, lengths = attention_case(5, page=8, group=3, head_dim=64, q_len=4, dtype=jnp.float32)
    want = reference_paged_attention(q, k, v, 1, table, pos, lengths, window=window)
    got = triton_paged_attention(q, k, v, 1, table, pos, lengths, interpret=True, window=window)
    assert_close(got, want, jnp.float32)
    assert (
        np.abs(np.asarray(want) - np.asarray(reference_paged_attention(q, k, v, 1, table, pos, lengths))).max() > 1e-3
    )


@pytest.mark.parametrize("keys_per_split", [64, 128, 192, 256])
def test_split_partials_merge_exactly(keys_per_split):
    q, k, v, table, pos, lengths = attention_case(
        3, page=16, group=3, head_dim=64, q_len=1, dtype=jnp.float32, pages_per_row=24
    )
    want = reference_paged_attention(q, k, v, 1, table, pos, lengths)
    got = triton_paged_attention(q, k, v, 1, table, pos, lengths, interpret=True, keys_per_split=keys_per_split)
    assert_close(got, want, jnp.float32)


def test_launch_plan():
    small = plan_launch((1, 1, 9, 64), (30, 3, 100, 16, 64), (1, 32), jnp.float32)
    assert small.grid == (1, 3, 1) and small.keys_per_split == 512  # 512 keys: one split, the output itself
    assert small.constexprs["PRECISION"] == "ieee" and small.out_dtype == "float32"
    big = plan_launch((64, 1, 9, 64), (30, 3, 100, 16, 64), (64, 32), jnp.bfloat16)
    assert big.grid == (64, 3, 1) and big.constexprs["PRECISION"] is None and big.out_dtype == "bfloat16"
    wide = plan_launch((8, 5, 9, 64), (30, 3, 100, 16, 64), (8, 600), jnp.bfloat16)
    assert wide.grid == (8, 3, 19) and wide.out_dtype == "float32"  # 9,600 keys: 19 splits, merged in float32
    # every size but the grid's is the same at any batch, token count and table width
    sizes = {(p.keys_per_split, p.constexprs["BLOCK_M"], p.constexprs["BLOCK_N"]) for p in (small, big, wide)}
    assert sizes == {(512, 16, 64)}
    multi = plan_launch((2, 16, 8, 128), (2, 1, 10, 8, 128), (2, 4), jnp.float32)
    assert multi.constexprs["BLOCK_M"] == 16 and multi.grid == (2, 8, 1)  # 16 tokens x 8 heads = 8 blocks of 16
    assert min(multi.constexprs["BLOCK_M"], multi.constexprs["BLOCK_N"], 128) >= 16  # tl.dot on GPUs
    with pytest.raises(ValueError, match="head_dim"):
        plan_launch((1, 1, 4, 48), (1, 1, 4, 8, 48), (1, 2), jnp.float32)
    with pytest.raises(ValueError, match="multiple of the key block"):
        plan_launch((1, 1, 9, 64), (30, 3, 100, 16, 64), (1, 32), jnp.float32, keys_per_split=100)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_querys_bits_do_not_depend_on_the_batch_the_tokens_or_the_table(dtype):
    """Batch invariance: the last of 8 verified positions of a row over 3,000 keys gets the same
    bits alone, among 8 rows of other lengths (a batch), decoded as one token, and over a block
    table twice as wide; a short row the same over a table of one split as of eight. (Before the
    fixed split size, batch 1 split a 4k table 16 ways, batch 8 8 ways, and a verify pass of 8
    tokens took blocks of 32 queries by 32 keys: the bits differed.)"""
    rng = np.random.default_rng(0)
    page, hkv, group, dh, width, n = 16, 2, 3, 64, 256, 8
    shape = (1, hkv, 1 + 8 * 2 * width, page, dh)
    k, v = (jnp.asarray(rng.normal(size=shape), dtype) for _ in range(2))
    lengths = np.array([3000, 40, 700, 4096, 9, 900, 257, 1100], np.int32)
    tables = (1 + rng.permutation(8 * 2 * width)).reshape(8, 2 * width).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(8, n, hkv * group, dh)), dtype)
    pos = (lengths - n)[:, None] + np.arange(n, dtype=np.int32)

    def run(rows, tokens, table_width):
        t = slice(n - tokens, n)
        return np.asarray(
            triton_paged_attention(
                q[rows, t],
                k,
                v,
                0,
                jnp.asarray(tables[rows, :table_width]),
                jnp.asarray(pos[rows, t]),
                jnp.asarray(lengths[rows]),
                interpret=True,
            ),
            np.float32,
        )

    batch = run(slice(0, 8), n, width)
    alone = run(slice(0, 1), n, width)
    assert np.array_equal(batch[:1], alone)
    assert np.array_equal(run(slice(0, 1), 1, width)[0, 0], batch[0, -1])  # a decode step of the last position
    assert np.array_equal(run(slice(0, 1), n, 2 * width), alone)
    # a row of 40 keys: its one split's output, written by the kernel itself over a table of one
    # split (32 pages), merged with empty splits over 8
    assert np.array_equal(run(slice(1, 2), n, 32), batch[1:2])
    want = reference_paged_attention(q, k, v, 0, jnp.asarray(tables[:, :width]), jnp.asarray(pos), jnp.asarray(lengths))
    assert_close(batch, want, dtype)


def test_merge_of_rows_without_keys_is_zero():
    acc = jnp.ones((1, 2, 1, 2, 4))
    m = jnp.full((1, 2, 1, 2), -jnp.inf)
    assert not np.asarray(merge_splits(acc, m, jnp.zeros_like(m), jnp.float32)).any()


def test_auto_on_a_gpu_takes_xla(monkeypatch):
    """On a GPU, auto is XLA's attention (the reference): the Triton kernel measured slower on
    an H100 at every batch, and a CUDA jaxlib without jax-triton needs nothing more."""
    from eejax.kernels import attention

    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # importing it would raise ImportError
    assert resolve_impl("auto") == "reference"


def test_dispatch():
    assert resolve_impl("auto") == "cpu"  # no GPU here: the CPU kernel
    assert resolve_impl("triton") == "triton"
    with pytest.raises(ValueError, match="unknown attention impl"):
        resolve_impl("flash")
    q, k, v, table, pos, lengths = attention_case(1, page=8, group=3, head_dim=64, q_len=1, dtype=jnp.float32)
    assert_close(
        paged_attention(q, k, v, 0, table, pos, lengths, impl="triton"),
        paged_attention(q, k, v, 0, table, pos, lengths, impl="auto"),
        jnp.float32,
    )


def test_whole_model_with_triton_attention(tiny_model):
    """Prefill (multi-token), decode steps and self-speculation rounds of a tiny Llama give the
    same tokens with the interpreted kernel as with the reference."""
    prompts = random_prompts(3, [5, 12, 9], seed=11)
    kw = dict(max_new_tokens=4, ignore_eos=True)
    want = eejax.generate(tiny_model, prompts, attention="reference", **kw).tokens
    assert eejax.generate(tiny_model, prompts, attention="triton", **kw).tokens == want
    # Self-speculation: single-token draft passes and a (d + 1)-token verify pass.
    assert eejax.generate(tiny_model, prompts, attention="triton", spec="1:2", **kw).tokens == want
    with pytest.raises(eejax.EejaxError, match="unknown attention"):
        eejax.generate(tiny_model, prompts, attention="flash", **kw)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20)])
def test_relative_position_bucket_matches_hf_t5(bidirectional, num_buckets, max_distance):
    import torch
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = np.arange(-300, 301, dtype=np.int32)
    want = T5Attention._relative_position_bucket(
        torch.from_numpy(relative).long(),
        bidirectional=bidirectional,
        num_buckets=num_buckets,
        max_distance=max_distance,
    )
    spec = RelativePositionBias(num_buckets, max_distance, bidirectional)
    np.testing.assert_array_equal(relative_position_bucket(relative, spec), want.numpy())


def test_reference_bias_matches_dense_numpy():
    q, k, v, table, pos, lengths = attention_case(5, page=8, group=3, head_dim=64, q_len=4, dtype=jnp.float32)
    spec = RelativePositionBias(16, 40)
    bias_table = jnp.asarray(np.random.default_rng(0).normal(size=(16, q.shape[2])), jnp.float32)
    got = np.asarray(
        reference_paged_attention(q, k, v, 1, table, pos, lengths, scale=1.0, bias_table=bias_table, bias=spec)
    )
    kn, vn, qn = np.asarray(k[1]), np.asarray(v[1]), np.asarray(q)
    for row in range(1, 4):
        n = int(lengths[row])
        pages = np.asarray(table[row])
        keys = kn[:, pages].reshape(kn.shape[0], -1, 64)[:, :n]  # [Hkv, n, Dh]
        values = vn[:, pages].reshape(vn.shape[0], -1, 64)[:, :n]
        for t in range(4):
            p = int(pos[row, t])
            for h in range(q.shape[2]):
                s = keys[h // 3] @ qn[row, t, h]
                s = s + np.asarray(bias_table)[np.asarray(relative_position_bucket(np.arange(n) - p, spec)), h]
                s = np.where(np.arange(n) <= p, s, -np.inf)
                w = np.exp(s - s.max())
                np.testing.assert_allclose(got[row, t, h], (w / w.sum()) @ values[h // 3], atol=1e-5)


@pytest.mark.parametrize(
    "bidirectional,q_len,dtype",
    [(False, 1, jnp.float32), (False, 6, jnp.float32), (True, 3, jnp.float32), (False, 4, jnp.bfloat16)],
)
def test_kernel_with_t5_bias_matches_reference(bidirectional, q_len, dtype):
    q, k, v, table, pos, lengths = attention_case(
        9, page=16, group=1, head_dim=64, q_len=q_len, dtype=dtype, num_kv_heads=4
    )
    spec = RelativePositionBias(32, 128, bidirectional)
    bias_table = jnp.asarray(np.random.default_rng(1).normal(size=(32, 4)), jnp.float32)
    kw = dict(scale=1.0, bias_table=bias_table, bias=spec)
    want = reference_paged_attention(q, k, v, 0, table, pos, lengths, **kw)
    assert_close(triton_paged_attention(q, k, v, 0, table, pos, lengths, interpret=True, **kw), want, dtype)
