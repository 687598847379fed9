"""A decode layer's products as one Triton kernel each, with what surrounds them fused in, whose
rows get the same bits at any number of rows: launched through jax-triton on CUDA and through
Triton's interpreter on CPU (as `triton_attention`).

    fused_linear(x, w)                                  x @ w
    fused_linear(x, w, norm_weight=g)                   RMSNorm(x) * g @ w         (q/k/v, the head)
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
from eejax.kernels.triton_runtime import host_array, host_tensor, import_triton, interpreter_scalars

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
    u_ptr,
    r_ptr,
    M,
    K,
    N,
    eps,
    y_ptr,  # jax-triton passes the outputs after the arguments
    NORM: constexpr,
    GATED: constexpr,
    RESIDUAL: constexpr,
    UPCAST: constexpr,
    BLOCK_M: constexpr,
    BLOCK_N: constexpr,
    BLOCK_K: constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
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
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        a = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if NORM:
            g = tl.load(g_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            a = a * inv[:, None] * g[None, :]
        w_tile = (k0 + offs_k).to(tl.int64)[:, None] * N + offs_n[None, :]
        w_ok = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_ptr + w_tile, mask=w_ok, other=0.0)
        if UPCAST:  # Triton's interpreter multiplies bf16 bit patterns in tl.dot: use f32 there
            w = w.to(tl.float32)
        a = a.to(w.dtype)
        acc += tl.dot(a, w, input_precision="ieee")
        if GATED:
            up = tl.load(u_ptr + w_tile, mask=w_ok, other=0.0)
            if UPCAST:
                up = up.to(tl.float32)
            acc_up += tl.dot(a, up, input_precision="ieee")
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if RESIDUAL:
        acc += tl.load(r_ptr + out, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=ok)


@dataclasses.dataclass(frozen=True)
class LinearLaunch:
    """One launch: grid, scalars (M, K, N, eps) and the kernel's compile-time parameters."""

    grid: tuple[int, int]
    scalars: tuple
    constexprs: dict


def plan_linear(
    rows: int, k: int, n: int, *, norm: bool, gated: bool, residual: bool, upcast: bool, eps: float, weight_bytes: int
):
    """The launch of `fused_linear` over `rows` rows of x [rows, k] and w [k, n] of `weight_bytes`
    a value. A gated pair of fp32 tiles takes BLOCK_N / 2 columns (two accumulators and two fp32
    weight tiles of 64 columns spill on sm_80); the tile never depends on `rows`."""
    block_n = BLOCK_N // 2 if gated and weight_bytes == 4 else BLOCK_N
    grid = ((rows + BLOCK_M - 1) // BLOCK_M, (n + block_n - 1) // block_n)
    constexprs = dict(
        NORM=norm, GATED=gated, RESIDUAL=residual, UPCAST=upcast, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K
    )
    # eps as numpy float32: jax-triton types a Python float as fp64 (`aot.triton_type`)
    return LinearLaunch(grid, (rows, k, n, np.float32(eps)), constexprs)


@functools.cache
def _kernel(interpret: bool):
    """The kernel wrapped by `triton.jit`, compiled (GPU) or interpreted (CPU): a process runs one
    or the other (`triton_runtime`)."""
    global tl, constexpr
    triton = import_triton(interpret)
    tl, constexpr = triton.language, triton.language.constexpr
    return triton.jit(_fused_linear_kernel)


def _interpret_on_host(launch: LinearLaunch, out_dtype: str, x, g, w, u, r):
    """Runs the kernel in Triton's interpreter on torch CPU tensors (numpy in, numpy out)."""
    import torch

    y = torch.zeros((launch.scalars[0], launch.scalars[2]), dtype=getattr(torch, out_dtype))
    args = map(host_tensor, (x, g, w, u, r))
    _kernel(interpret=True)[launch.grid](*args, *interpreter_scalars(launch.scalars), y, **launch.constexprs)
    return host_array(y)


def fused_linear(x, w, *, norm_weight=None, eps: float = 1e-5, w_up=None, residual=None, interpret: bool = False):
    """x [..., K] against w [K, N] in one kernel (see the module's table): RMSNorm of x first
    when `norm_weight` [K] is given, silu(x @ w) * (x @ w_up) when `w_up` [K, N] is, + `residual`
    [..., N] when it is. float32 accumulation; the result in x's dtype. `interpret`: Triton's
    interpreter on the host (CPU), else jax-triton (CUDA)."""
    *lead, k = x.shape
    n = w.shape[-1]
    if w.shape != (k, n) or (w_up is not None and w_up.shape != w.shape):
        raise EejaxError(f"fused_linear: x [..., {k}] needs w [{k}, N] (and w_up alike), got {w.shape}")
    rows = int(np.prod(lead, dtype=np.int64))
    launch = plan_linear(
        rows,
        k,
        n,
        norm=norm_weight is not None,
        gated=w_up is not None,
        residual=residual is not None,
        upcast=interpret and w.dtype != jnp.float32,
        eps=eps,
        weight_bytes=jnp.dtype(w.dtype).itemsize,
    )
    absent = jnp.zeros((1,), jnp.float32)
    args = (
        x.reshape(rows, k),
        absent if norm_weight is None else norm_weight,
        w,
        absent if w_up is None else w_up,
        absent if residual is None else residual.reshape(rows, n),
    )
    out = jax.ShapeDtypeStruct((rows, n), x.dtype)
    if interpret:
        y = jax.pure_callback(functools.partial(_interpret_on_host, launch, jnp.dtype(x.dtype).name), out, *args)
    else:
        import jax_triton

        y = jax_triton.triton_call(
            *args,
            *launch.scalars,
            kernel=_kernel(interpret=False),
            out_shape=out,
            grid=launch.grid,
            num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
            **launch.constexprs,
        )
    return y.reshape(*lead, n)
