"""Paged attention as a Triton kernel, launched through jax-triton on CUDA and through Triton's
interpreter on CPU.

One kernel serves decode (q_len 1) and multi-token steps (speculative verification, chunked
prefill): a program owns one row, one KV head, a block of 16 query rows (new tokens x the GQA
group of that KV head, so each key block is loaded once for the whole group) and one split of
the keys (`KEYS_PER_SPLIT` of them, flash-decoding style). Keys are gathered page by page through
the block table (a key block may span several pages); masking is causal on absolute positions
and stops at the row's `kv_len`; online softmax in float32. Optionally T5's relative-position
bias: the bucket of (key - query) position is computed per score and looked up in a
[num_buckets, heads] table. Each program writes its split's normalised output (and the softmax's
running max m and sum l); a table of one split is the output itself, and otherwise
`merge_splits` weights the splits by their share of the softmax and sums them in key order (rows
without keys give zeros).

Batch invariance (Thinking Machines' batch-invariant attention: split by a fixed size, not a fixed
count): the query block (16 rows), the key block and the split's size are constants, never sized
from the batch, the tokens or the table, and the merge runs in one order, where a query whose
keys lie in one split gets that split's output exactly (weight l / l = 1). So a query's output
has the same bits alone, as one of d + 1 verified positions, among 8 rows, in a prefill chunk of
any length and over a wider block table.

`plan_launch` computes grid, block sizes and strides once for both paths, so the CPU tests
exercise the same launch arithmetic the GPU runs. triton and jax_triton are imported lazily:
jax-triton only imports with a GPU jaxlib.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from eejax.kernels.position_bias import RelativePositionBias
from eejax.kernels.triton_runtime import call_compiled, host_array, host_tensor, import_triton, interpreter_scalars

tl = None  # triton.language, bound by `_kernel` when the kernel is first needed
# The annotation of compile-time parameters: triton reads its text ("constexpr", which postponed
# annotations keep) to find them, and its compiler looks the name up, so `_kernel` rebinds it to
# `triton.language.constexpr` (a plain string is a global the compiler refuses).
constexpr = "constexpr"

MIN_DOT = 16  # tl.dot needs every dimension >= 16 on GPUs
BLOCK_M = MIN_DOT  # query rows a program owns, at any token count: the same MMA shape for every row
# Keys x head_dim per inner-loop step: 64 keys of 64 dims, 32 of 128, half that with T5's bias (a
# block may span several pages or part of one). The sizes come from `python -m eejax.kernels.aot`:
# with 4 warps, or 64 keys of 128 dims, ptxas needs 216-255 registers per thread and spills; with
# these it needs 80-190 and spills at most 8 bytes.
KEY_ELEMENTS = 4096
NUM_WARPS = 8
NUM_STAGES = 2
# Keys a program takes (a multiple of every key block): fixed, so that where a query's keys are
# split never depends on the batch or the table's width. A table of up to 512 keys is one split,
# whose program writes the output itself (no merge); at 2k keys a decode step at batch 1 runs 4
# programs a KV head.
KEYS_PER_SPLIT = 512


def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    layer_ptr,
    table_ptr,
    qpos_ptr,
    kvlen_ptr,
    bias_ptr,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kl,
    stride_kh,
    stride_kp,
    stride_ks,
    stride_tb,
    stride_pb,
    stride_ob,
    stride_os,
    stride_ot,
    stride_oh,
    stride_mb,
    stride_ms,
    stride_mt,
    num_tokens,
    keys_per_split,
    scale,
    bias_log_scale,
    out_ptr,
    m_ptr,
    l_ptr,
    GROUP: constexpr,
    PAGE: constexpr,
    HEAD_DIM: constexpr,
    M_BLOCKS: constexpr,
    BLOCK_M: constexpr,
    BLOCK_N: constexpr,
    PRECISION: constexpr,
    UPCAST_DOTS: constexpr,
    HAS_BIAS: constexpr,
    BIDIRECTIONAL: constexpr,
    HALF_BUCKETS: constexpr,
    MAX_EXACT: constexpr,
    NUM_HEADS: constexpr,
    WINDOW: constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1) // M_BLOCKS
    m_block = tl.program_id(1) % M_BLOCKS
    split = tl.program_id(2)

    layer = tl.load(layer_ptr)
    kv_len = tl.load(kvlen_ptr + row)
    # Query rows of this block: token t, group member g (query head kv_head * GROUP + g).
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = offs_m < num_tokens * GROUP
    q_pos = tl.load(qpos_ptr + row * stride_pb + tok, mask=row_ok, other=-1)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + row * stride_qb + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if UPCAST_DOTS:  # Triton's interpreter multiplies bf16 bit patterns in tl.dot: use f32 there
        q = q.to(tl.float32)

    start = split * keys_per_split
    # Keys of this split that some query may see: below kv_len and at most the last query position.
    stop = tl.minimum(tl.minimum(start + keys_per_split, kv_len), tl.max(q_pos, axis=0) + 1)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    cache_base = layer.to(tl.int64) * stride_kl + kv_head * stride_kh
    for n0 in range(start, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        page = tl.load(table_ptr + row * stride_tb + offs_n // PAGE, mask=n_ok, other=0)
        kv_off = cache_base + page.to(tl.int64) * stride_kp + (offs_n % PAGE) * stride_ks
        k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if UPCAST_DOTS:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if HAS_BIAS:  # T5: bucket of (key - query) position, looked up in a [buckets, heads] table
            relative = offs_n[None, :] - q_pos[:, None]
            if BIDIRECTIONAL:
                bucket = tl.where(relative > 0, HALF_BUCKETS, 0)
                distance = tl.abs(relative)
            else:
                bucket = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
                distance = tl.maximum(-relative, 0)
            far = tl.maximum(distance, MAX_EXACT).to(tl.float32)
            large = MAX_EXACT + (tl.log(far / MAX_EXACT) * bias_log_scale).to(tl.int32)
            bucket += tl.where(distance < MAX_EXACT, distance, tl.minimum(large, HALF_BUCKETS - 1))
            scores += tl.load(bias_ptr + bucket * NUM_HEADS + head[:, None], mask=row_ok[:, None], other=0.0)
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if WINDOW > 0:  # a sliding window: the query's last WINDOW positions
            visible = visible & (offs_n[None, :] > q_pos[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        p = p.to(v.dtype)  # the probabilities in the cache's dtype, as the GPU's dot takes them
        if UPCAST_DOTS:
            v, p = v.to(tl.float32), p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    out_off = row * stride_ob + split * stride_os + tok * stride_ot + head * stride_oh
    # The split's own output, normalised (0 where a query saw no key here), in the output's dtype:
    # the model's when the table is one split (no merge after it), else float32 for the merge.
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(out_ptr + out_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    ml_off = row * stride_mb + split * stride_ms + tok * stride_mt + head
    tl.store(m_ptr + ml_off, m_i, mask=row_ok)
    tl.store(l_ptr + ml_off, l_i, mask=row_ok)


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Grid, block sizes, strides (in elements, row-major) and scalars of one launch."""

    grid: tuple[int, int, int]
    num_splits: int
    keys_per_split: int
    scalars: tuple  # the kernel's scalar arguments in order: strides, num_tokens, keys_per_split, scale, bias_log_scale
    constexprs: dict
    out_shapes: tuple[tuple[int, ...], ...]  # out [B, S, T, Hq, Dh]; m, l [B, S, T, Hq] float32
    out_dtype: str  # out's: the inputs' with one split (the output itself; interpreted: float32), else float32


def _strides(shape) -> tuple[int, ...]:
    return tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def plan_launch(
    q_shape,
    cache_shape,
    table_shape,
    dtype,
    *,
    interpret: bool = False,
    keys_per_split: int = KEYS_PER_SPLIT,
    scale: float | None = None,
    bias: RelativePositionBias | None = None,
    window: int | None = None,
) -> LaunchPlan:
    """The launch of `_paged_attention_kernel` for q [B, T, Hq, Dh] over a cache
    [L, Hkv, P, S, Dh] with a block table [B, M]; `interpret` for Triton's CPU interpreter;
    `scale` of the scores (default Dh^-0.5). The keys go in splits of `keys_per_split` (a
    multiple of the key block), as many as the table's keys need; only the grid depends on the
    shapes, never a block's size or where a split starts."""
    b, t, hq, dh = q_shape
    _, hkv, _, page, _ = cache_shape
    max_keys = table_shape[1] * page
    group = hq // hkv
    if dh < MIN_DOT or dh != _pow2(dh):
        raise ValueError(f"the Triton attention kernel needs a power-of-two head_dim >= {MIN_DOT}, got {dh}")
    block_n = max(MIN_DOT, KEY_ELEMENTS // dh // (2 if bias else 1))
    if keys_per_split < 1 or keys_per_split % block_n:
        raise ValueError(
            f"keys_per_split must be a positive multiple of the key block ({block_n}), got {keys_per_split}"
        )
    m_blocks = math.ceil(t * group / BLOCK_M)
    num_splits = max(1, math.ceil(max_keys / keys_per_split))
    acc_shape = (b, num_splits, t, hq, dh)
    ml_shape = (b, num_splits, t, hq)
    qs, cs, ts = _strides(q_shape), _strides(cache_shape), _strides(table_shape)
    os_, ms = _strides(acc_shape), _strides(ml_shape)
    scalars = (
        qs[0],
        qs[1],
        qs[2],
        cs[0],
        cs[1],
        cs[2],
        cs[3],
        ts[0],
        t,  # positions [B, T]: row stride T
        os_[0],
        os_[1],
        os_[2],
        os_[3],
        ms[0],
        ms[1],
        ms[2],
        t,
        keys_per_split,
        # float32 scalars: jax-triton types a Python float as fp64, which the kernel cannot take
        np.float32(dh**-0.5 if scale is None else scale),
        np.float32(bias.log_scale if bias else 0.0),
    )
    constexprs = dict(
        GROUP=group,
        PAGE=page,
        HEAD_DIM=dh,
        M_BLOCKS=m_blocks,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        # fp32 inputs: exact products (no TF32); bf16: tensor cores with the default
        PRECISION="ieee" if jnp.dtype(dtype) == jnp.float32 else None,
        UPCAST_DOTS=interpret and jnp.dtype(dtype) != jnp.float32,
        HAS_BIAS=bias is not None,
        BIDIRECTIONAL=bool(bias and bias.bidirectional),
        HALF_BUCKETS=bias.half if bias else 1,
        MAX_EXACT=bias.max_exact if bias else 1,
        NUM_HEADS=hq,
        WINDOW=window or 0,
    )
    grid = (b, hkv * m_blocks, num_splits)
    # One split writes the output in the inputs' dtype, cast as XLA casts a merge's (round to
    # nearest even), but for the interpreter, whose float32 -> bf16 conversion rounds otherwise:
    # interpreted, XLA casts it.
    out_dtype = jnp.dtype(dtype).name if num_splits == 1 and not interpret else "float32"
    return LaunchPlan(grid, num_splits, keys_per_split, scalars, constexprs, (acc_shape, ml_shape, ml_shape), out_dtype)


def merge_splits(out, m, l, dtype):
    """Combines the splits' normalised outputs: out [B, S, T, Hq, Dh], m/l [B, S, T, Hq] -> [B, T,
    Hq, Dh] in `dtype` (zeros where a query saw no key). A query whose keys all lie in one split
    gets that split's output itself (a select: exact), whatever the table's width; one with keys in
    several, their outputs weighted by each one's share of the softmax (l_s exp(m_s - max m) over
    their sum), summed in split order, the splits without its keys adding exact zeros. One split
    is the output itself, with no merge."""
    if out.shape[1] == 1:
        return out[:, 0].astype(dtype)
    seen = m != -jnp.inf
    alone = jnp.sum(jnp.where(seen[..., None], out, 0.0), axis=1)  # one non-zero term: that split's output
    top = jnp.max(m, axis=1, keepdims=True)
    shares = jnp.where(seen, l * jnp.exp(m - jnp.where(top == -jnp.inf, 0.0, top)), 0.0)
    total = shares[:, 0]
    for s in range(1, out.shape[1]):
        total = total + shares[:, s]
    weights = shares / jnp.where(total > 0, total, 1.0)[:, None]
    merged = weights[:, 0, ..., None] * out[:, 0]
    for s in range(1, out.shape[1]):
        merged = merged + weights[:, s, ..., None] * out[:, s]
    several = jnp.sum(seen, axis=1) > 1
    return jnp.where(several[..., None], merged, alone).astype(dtype)


@functools.cache
def _kernel(interpret: bool):
    """The kernel wrapped by `triton.jit`: compiled for the GPU, or run by Triton's interpreter (a
    process runs one or the other: `triton_runtime`)."""
    global tl, constexpr
    triton = import_triton(interpret)
    tl, constexpr = triton.language, triton.language.constexpr
    return triton.jit(_paged_attention_kernel)


def _interpret_on_host(plan: LaunchPlan, q, k, v, layer, table, q_pos, kv_len, bias):
    """Runs the kernel in Triton's interpreter on torch CPU tensors (numpy in, numpy out)."""
    import torch

    dtypes = (getattr(torch, plan.out_dtype), torch.float32, torch.float32)
    outs = [torch.zeros(s, dtype=t) for s, t in zip(plan.out_shapes, dtypes)]
    args = [host_tensor(x) for x in (q, k, v, np.asarray(layer, np.int32).reshape(1), table, q_pos, kv_len, bias)]
    _kernel(interpret=True)[plan.grid](*args, *interpreter_scalars(plan.scalars), *outs, **plan.constexprs)
    return tuple(host_array(o) for o in outs)


def triton_paged_attention(
    q,
    k_cache,
    v_cache,
    layer,
    block_table,
    q_positions,
    kv_len,
    *,
    interpret: bool,
    keys_per_split: int = KEYS_PER_SPLIT,
    scale=None,
    bias_table=None,
    bias: RelativePositionBias | None = None,
    window: int | None = None,
):
    """`paged_attention` (same arguments and result) through the Triton kernel; `interpret`
    runs it in Triton's interpreter on the host (CPU), otherwise through jax-triton (CUDA)."""
    plan = plan_launch(
        q.shape,
        k_cache.shape,
        block_table.shape,
        q.dtype,
        interpret=interpret,
        keys_per_split=keys_per_split,
        scale=scale,
        bias=bias,
        window=window,
    )
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    bias_table = np.zeros((1, q.shape[2]), np.float32) if bias_table is None else bias_table.astype(jnp.float32)
    args = (
        q,
        k_cache,
        v_cache,
        layer,
        block_table.astype(jnp.int32),
        q_positions.astype(jnp.int32),
        kv_len.astype(jnp.int32),
        bias_table,
    )
    out_shapes = tuple(
        jax.ShapeDtypeStruct(s, t) for s, t in zip(plan.out_shapes, (plan.out_dtype, jnp.float32, jnp.float32))
    )
    if interpret:
        acc, m, l = jax.pure_callback(functools.partial(_interpret_on_host, plan), out_shapes, *args)
    else:
        acc, m, l = call_compiled(
            _kernel(interpret=False),
            args,
            plan.scalars,
            out_shape=out_shapes,
            grid=plan.grid,
            num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
            constexprs=plan.constexprs,
        )
    return merge_splits(acc, m, l, q.dtype)
