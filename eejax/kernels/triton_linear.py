"""A decode layer's products as one Triton kernel each, with what surrounds them fused in, whose
rows get the same bits at any number of rows: launched through jax-triton on CUDA and through
Triton's interpreter on CPU (as `triton_attention`).

    fused_linear(x, w)                                  x @ w
    fused_linear(x, w, norm_weight=g)                   RMSNorm(x) * g @ w
    fused_linear(x, e, norm_weight=g, transposed=True)  RMSNorm(x) * g @ e.T       (a tied head: e [V, D])
    fused_linears(x, [wq, wk, wv], norm_weight=g)       n @ wq, n @ wk, n @ wv     (q, k, v: one launch)
    fused_linears(x, [wq, wk, wv], norm_weight=g,       rope(n @ wq), rope(n @ wk), n @ wv
                  rope=(cos, sin))                      (q and k rotated per head: the rotary tables)
    fused_linear(x, w, norm_weight=g, w_up=u)           silu(n @ w) * (n @ u)      (gate/up + SiLU·mul)
    fused_linear(x, w, residual=h)                      h + x @ w                  (o, down)

Batch invariance (Thinking Machines' batch-invariant ops): a program owns a fixed tile of
BLOCK_M = 16 rows (the smallest `tl.dot`) by BLOCK_N output columns, and walks K in BLOCK_K steps
in one order; the norm's sum of squares also runs in BLOCK_K steps. A row's reductions depend on
K alone, never on how many rows the call has (masked rows are zeros that no other row reads), and
K is never split between programs. So a row decoded alone, as one of d + 1 verified positions or
in a batch of 8 gets the same bits; on a GPU the tile is the same MMA shape at any row count.

fp32 products use `input_precision="ieee"` (no TF32); bf16 weights are multiplied as bf16 with
fp32 accumulation (cuBLAS's rule, and `modules.Linear`'s). triton and jax_triton are imported
lazily: jax-triton only imports with a GPU jaxlib."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from eejax.errors import EejaxError
from eejax.kernels.triton_runtime import call_compiled, host_array, host_tensor, import_triton, interpreter_scalars

tl = None  # triton.language, bound by `_kernel`
constexpr = "constexpr"  # see triton_attention: triton reads the annotation's text

BLOCK_M = 16  # rows a program owns: fixed, so that a row's bits never depend on the row count
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3


def _fused_linear_kernel(
    x_ptr,
    g_ptr,
    w_ptr,
    w2_ptr,
    w3_ptr,
    u_ptr,
    r_ptr,
    cos_ptr,
    sin_ptr,
    kc_ptr,  # (the cache's inputs: its outputs alias them)
    vc_ptr,
    page_ptr,
    slot_ptr,
    layer_ptr,
    M,
    K,
    N,
    N2,
    N3,
    eps,
    stride_cl,
    stride_ch,
    stride_cp,
    stride_cs,
    y_ptr,  # jax-triton passes the outputs after the arguments
    y2_ptr,
    y3_ptr,
    kc_out_ptr,
    vc_out_ptr,
    NORM: constexpr,
    MATRICES: constexpr,
    GATED: constexpr,
    RESIDUAL: constexpr,
    TRANSPOSED: constexpr,
    ROPE: constexpr,
    CACHE: constexpr,
    UPCAST: constexpr,
    BLOCK_M: constexpr,
    BLOCK_N: constexpr,
    BLOCK_K: constexpr,
):
    # The column tiles of up to three matrices (q, k, v) in one grid: this program's matrix. With
    # ROPE a tile is a head: its two halves (BLOCK_N columns each), which the rotation pairs.
    COLUMNS = 2 * BLOCK_N if ROPE else BLOCK_N
    tile = tl.program_id(1)
    w_base, y_base, n, matrix = w_ptr, y_ptr, N, 0
    if MATRICES > 1:
        first, second = tl.cdiv(N, COLUMNS), tl.cdiv(N2, COLUMNS)
        if tile >= first + second:
            w_base, y_base, n, tile, matrix = w3_ptr, y3_ptr, N3, tile - first - second, 2
        elif tile >= first:
            w_base, y_base, n, tile, matrix = w2_ptr, y2_ptr, N2, tile - first, 1
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile * COLUMNS + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < n
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * K
    if NORM:  # each row's mean square, in BLOCK_K steps
        squares = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + offs_k < K
            a = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            a = a.to(tl.float32)
            squares += tl.sum(a * a, axis=1)
        inv = 1.0 / tl.sqrt(squares / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if GATED or ROPE:  # the up product, or the head's second half
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        a = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if NORM:
            g = tl.load(g_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            a = a * inv[:, None] * g[None, :]
        if TRANSPOSED:  # w [N, K]: column n of the product is row n of w
            w_tile = offs_n.to(tl.int64)[None, :] * K + (k0 + offs_k)[:, None]
        else:
            w_tile = (k0 + offs_k).to(tl.int64)[:, None] * n + offs_n[None, :]
        w_ok = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_base + w_tile, mask=w_ok, other=0.0)
        if UPCAST:  # Triton's interpreter multiplies bf16 bit patterns in tl.dot: use f32 there
            w = w.to(tl.float32)
        a = a.to(w.dtype)
        acc += tl.dot(a, w, input_precision="ieee")
        if GATED or ROPE:
            up = tl.load((u_ptr + w_tile) if GATED else (w_base + w_tile + BLOCK_N), mask=w_ok, other=0.0)
            if UPCAST:
                up = up.to(tl.float32)
            acc_up += tl.dot(a, up, input_precision="ieee")
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out = offs_m.to(tl.int64)[:, None] * n + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if ROPE:  # rotate half (HF Llama): q and k's halves x1, x2 -> x1 cos - x2 sin, x2 cos + x1 sin
        half = offs_m.to(tl.int64)[:, None] * (2 * BLOCK_N) + tl.arange(0, BLOCK_N)[None, :]
        rows_ok = m_ok[:, None]
        cos_lo = tl.load(cos_ptr + half, mask=rows_ok, other=0.0)
        sin_lo = tl.load(sin_ptr + half, mask=rows_ok, other=0.0)
        cos_hi = tl.load(cos_ptr + half + BLOCK_N, mask=rows_ok, other=0.0)
        sin_hi = tl.load(sin_ptr + half + BLOCK_N, mask=rows_ok, other=0.0)
        rotate = matrix < 2
        lo = tl.where(rotate, acc * cos_lo - acc_up * sin_lo, acc)
        hi = tl.where(rotate, acc_up * cos_hi + acc * sin_hi, acc_up)
        if CACHE:  # k and v straight into the paged cache: layer, this head, each row's page and slot
            page = tl.load(page_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
            slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
            base = tl.load(layer_ptr).to(tl.int64) * stride_cl + tile * stride_ch + page * stride_cp + slot * stride_cs
            at = base[:, None] + tl.arange(0, BLOCK_N)[None, :]
            if matrix == 1:
                tl.store(kc_out_ptr + at, lo.to(kc_out_ptr.dtype.element_ty), mask=rows_ok)
                tl.store(kc_out_ptr + at + BLOCK_N, hi.to(kc_out_ptr.dtype.element_ty), mask=rows_ok)
            elif matrix == 2:
                tl.store(vc_out_ptr + at, lo.to(vc_out_ptr.dtype.element_ty), mask=rows_ok)
                tl.store(vc_out_ptr + at + BLOCK_N, hi.to(vc_out_ptr.dtype.element_ty), mask=rows_ok)
            else:
                tl.store(y_base + out + BLOCK_N, hi.to(y_ptr.dtype.element_ty), mask=ok)
                tl.store(y_base + out, lo.to(y_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(y_base + out + BLOCK_N, hi.to(y_ptr.dtype.element_ty), mask=ok)
            tl.store(y_base + out, lo.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        if RESIDUAL:
            acc += tl.load(r_ptr + out, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_base + out, acc.to(y_ptr.dtype.element_ty), mask=ok)


@dataclasses.dataclass(frozen=True)
class LinearLaunch:
    """One launch: grid, scalars (M, K, N, N2, N3, eps, the cache's strides: layer, head, page,
    slot) and the kernel's compile-time parameters; `cache_shape` [L, Hkv, P, S, Dh] where k and v
    go into a paged cache."""

    grid: tuple[int, int]
    scalars: tuple
    constexprs: dict
    cache_shape: tuple[int, ...] | None = None


def plan_linear(
    rows: int,
    k: int,
    ns: tuple[int, ...],
    *,
    norm: bool,
    gated: bool,
    residual: bool,
    upcast: bool,
    eps: float,
    weight_bytes: int,
    transposed: bool = False,
    head_dim: int = 0,
    cache_shape: tuple[int, ...] | None = None,
):
    """The launch of `fused_linears` over `rows` rows of x [rows, k] and one to three matrices
    [k, n] (`ns`: their n; one [n, k] when `transposed`) of `weight_bytes` a value, their column
    tiles side by side in one grid. A gated pair of fp32 tiles, and a transposed fp32 tile, take
    BLOCK_N / 2 columns (with 64, ptxas spills on sm_80: 892 and 80 bytes); with `head_dim` (the
    rotation) a tile is a head, two halves of head_dim / 2 columns, and with `cache_shape` k and v
    go into that paged cache. The tile never depends on `rows`."""
    if not 1 <= len(ns) <= 3 or (len(ns) > 1 and (gated or residual or transposed)):
        raise EejaxError("fused_linears: one to three matrices, several only without w_up, a residual or transposed")
    if transposed and gated:
        raise EejaxError("fused_linears: a transposed matrix takes no w_up")
    if head_dim and (gated or residual or transposed or len(ns) != 3 or any(n % head_dim for n in ns)):
        raise EejaxError(f"fused_linears: rope takes q, k and v alone, each whole heads of {head_dim}, got {ns}")
    if head_dim and (head_dim < 32 or head_dim & (head_dim - 1)):
        raise EejaxError(f"fused_linears: rope needs a power-of-two head_dim >= 32 (tl.dot's halves), got {head_dim}")
    if cache_shape is not None and (not head_dim or tuple(cache_shape[1::3]) != (ns[1] // head_dim, head_dim)):
        raise EejaxError(f"fused_qkv_into_cache: a cache [L, Hkv, P, S, Dh] of k's heads, got {cache_shape} for {ns}")
    if head_dim:
        block_n, tiles = head_dim // 2, sum(n // head_dim for n in ns)
    else:
        block_n = BLOCK_N // 2 if (gated or transposed) and weight_bytes == 4 else BLOCK_N
        tiles = sum((n + block_n - 1) // block_n for n in ns)
    grid = ((rows + BLOCK_M - 1) // BLOCK_M, tiles)
    constexprs = dict(
        NORM=norm,
        MATRICES=len(ns),
        GATED=gated,
        RESIDUAL=residual,
        TRANSPOSED=transposed,
        ROPE=bool(head_dim),
        CACHE=cache_shape is not None,
        UPCAST=upcast,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
    )
    n, n2, n3 = (*ns, 0, 0)[:3]
    strides = tuple(int(np.prod(cache_shape[i + 1 :])) for i in range(4)) if cache_shape else (0, 0, 0, 0)
    # eps as numpy float32: jax-triton types a Python float as fp64 (`aot.triton_type`)
    return LinearLaunch(grid, (rows, k, n, n2, n3, np.float32(eps), *strides), constexprs, cache_shape)


@functools.cache
def _kernel(interpret: bool):
    """The kernel wrapped by `triton.jit`, compiled (GPU) or interpreted (CPU): a process runs one
    or the other (`triton_runtime`)."""
    global tl, constexpr
    triton = import_triton(interpret)
    tl, constexpr = triton.language, triton.language.constexpr
    return triton.jit(_fused_linear_kernel)


def _out_shapes(launch: LinearLaunch) -> list[tuple[int, ...]]:
    """The launch's five outputs: [rows, n] of each matrix, then the cache's k and v (aliasing its
    inputs); [1, 1] where there is none (never written), k and v's own where they go to the cache."""
    rows, _, *ns = launch.scalars[:5]
    into_cache = launch.cache_shape is not None
    mats = [(rows, n) if n and not (into_cache and i) else (1, 1) for i, n in enumerate(ns)]
    return mats + [launch.cache_shape or (1, 1)] * 2


def _interpret_on_host(launch: LinearLaunch, out_dtype: str, cache_dtype: str, *args):
    """Runs the kernel in Triton's interpreter on torch CPU tensors (numpy in, numpy out); the
    cache's outputs start as its inputs (what jax-triton's aliases make them)."""
    import torch

    shapes = _out_shapes(launch)
    ys = [torch.zeros(shape, dtype=getattr(torch, out_dtype)) for shape in shapes[:3]]
    inputs = [host_tensor(a) for a in args]
    cache = (
        [inputs[9].clone(), inputs[10].clone()]
        if launch.cache_shape
        else [torch.zeros(shape, dtype=getattr(torch, cache_dtype)) for shape in shapes[3:]]
    )
    _kernel(interpret=True)[launch.grid](
        *inputs, *interpreter_scalars(launch.scalars), *ys, *cache, **launch.constexprs
    )
    return tuple(host_array(y) for y in ys + cache)


def _launch(launch: LinearLaunch, args: tuple, out_dtype, cache_dtype, interpret: bool) -> tuple:
    """The kernel over `args` (the 14 arrays it reads), its five outputs (`_out_shapes`)."""
    shapes = _out_shapes(launch)
    outs = tuple(jax.ShapeDtypeStruct(shape, out_dtype) for shape in shapes[:3]) + tuple(
        jax.ShapeDtypeStruct(shape, cache_dtype) for shape in shapes[3:]
    )
    if interpret:
        host = functools.partial(_interpret_on_host, launch, jnp.dtype(out_dtype).name, jnp.dtype(cache_dtype).name)
        return jax.pure_callback(host, outs, *args)
    return call_compiled(
        _kernel(interpret=False),
        args,
        launch.scalars,
        out_shape=outs,
        grid=launch.grid,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        constexprs=launch.constexprs,
        aliases={9: 3, 10: 4} if launch.cache_shape else None,  # the cache's k and v, updated in place
    )


_ABSENT = np.zeros((1,), np.float32)  # an argument a launch does not read
_ABSENT_INT = np.zeros((1,), np.int32)


def _check(x, ws, transposed: bool) -> list[int]:
    """The matrices' N, or an EejaxError naming what does not contract with x [..., K]."""
    k = x.shape[-1]
    for w in ws:
        if w.ndim != 2 or w.shape[transposed] != k or w.dtype != ws[0].dtype:
            want = f"[N, {k}]" if transposed else f"[{k}, N]"
            raise EejaxError(f"fused_linears: x [..., {k}] needs matrices {want} of one dtype, got {w.shape}")
    return [w.shape[0] if transposed else w.shape[1] for w in ws]


def fused_linears(
    x,
    ws,
    *,
    norm_weight=None,
    eps: float = 1e-5,
    w_up=None,
    residual=None,
    transposed: bool = False,
    rope=None,
    out_dtype=None,
    interpret: bool = False,
) -> list:
    """x [..., K] against each of `ws` (one to three [K, N_i]: a layer's q, k and v) in one kernel
    launch (see the module's table): RMSNorm of x first when `norm_weight` [K] is given;
    silu(x @ w) * (x @ w_up) when `w_up` [K, N] is (one matrix); + `residual` [..., N] when it is
    (one matrix); `transposed`: one matrix held as [N, K] (a tied head's embedding); `rope`: the
    rotary tables (cos, sin) [..., Dh] of x's rows, which rotate the first two of three matrices'
    outputs (q and k) per head of Dh in float32, as `models.rope.apply_rope` does. float32
    accumulation; the results in `out_dtype` (default x's). A matrix's outputs are those it gets
    alone. `interpret`: Triton's interpreter on the host (CPU), else jax-triton (CUDA)."""
    *lead, k = x.shape
    ws = list(ws)
    n_of = _check(x, ws, transposed)
    if w_up is not None and w_up.shape != ws[0].shape:
        raise EejaxError(f"fused_linears: w_up must be w's shape {ws[0].shape}, got {w_up.shape}")
    rows = int(np.prod(lead, dtype=np.int64))
    launch = plan_linear(
        rows,
        k,
        tuple(n_of),
        norm=norm_weight is not None,
        gated=w_up is not None,
        residual=residual is not None,
        upcast=interpret and ws[0].dtype != jnp.float32,
        eps=eps,
        weight_bytes=jnp.dtype(ws[0].dtype).itemsize,
        transposed=transposed,
        head_dim=0 if rope is None else rope[0].shape[-1],
    )
    absent_w = np.zeros((1, 1), ws[0].dtype)  # (another matrix's pointer: never read)
    args = (
        x.reshape(rows, k),
        _ABSENT if norm_weight is None else norm_weight,
        *(ws + [absent_w] * 2)[:3],
        absent_w if w_up is None else w_up,
        _ABSENT if residual is None else residual.reshape(rows, -1),
        *((_ABSENT, _ABSENT) if rope is None else (t.reshape(rows, -1).astype(jnp.float32) for t in rope)),
        *(np.zeros((1, 1), x.dtype),) * 2,
        *(_ABSENT_INT,) * 3,
    )
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    ys = _launch(launch, args, out_dtype, x.dtype, interpret)
    return [y.reshape(*lead, n) for y, n in zip(ys, n_of)]


def fused_qkv_into_cache(x, ws, *, norm_weight, eps: float, rope, k_cache, v_cache, layer, pages, slots,
                         interpret: bool = False):  # fmt: skip
    """`fused_linears(x, [wq, wk, wv], norm_weight=, rope=)` whose k and v go straight into the
    paged cache k_cache, v_cache [L, Hkv, P, S, Dh] at layer `layer` and each row's (pages, slots)
    [...] (`cache.slot_indices`: a padding row's go to the null page), as `cache.write_layer_kv`
    writes them: one launch for a layer's norm, products, rotation and cache write. Returns (q
    [..., Nq], k_cache, v_cache) (the caches updated in place on a GPU: jax-triton's aliases)."""
    *lead, k = x.shape
    ws = list(ws)
    n_of = _check(x, ws, False)
    rows = int(np.prod(lead, dtype=np.int64))
    launch = plan_linear(
        rows,
        k,
        tuple(n_of),
        norm=True,
        gated=False,
        residual=False,
        upcast=interpret and ws[0].dtype != jnp.float32,
        eps=eps,
        weight_bytes=jnp.dtype(ws[0].dtype).itemsize,
        head_dim=rope[0].shape[-1],
        cache_shape=tuple(k_cache.shape),
    )
    args = (
        x.reshape(rows, k),
        norm_weight,
        *ws,
        np.zeros((1, 1), ws[0].dtype),
        _ABSENT,
        *(t.reshape(rows, -1).astype(jnp.float32) for t in rope),
        k_cache,
        v_cache,
        pages.reshape(rows).astype(jnp.int32),
        slots.reshape(rows).astype(jnp.int32),
        jnp.asarray(layer, jnp.int32).reshape(1),
    )
    q, _, _, k_cache, v_cache = _launch(launch, args, x.dtype, k_cache.dtype, interpret)
    return q.reshape(*lead, n_of[0]), k_cache, v_cache


def fused_linear(x, w, **options):
    """`fused_linears` of one matrix w [K, N] (or [N, K] `transposed`) -> [..., N]."""
    return fused_linears(x, [w], **options)[0]
