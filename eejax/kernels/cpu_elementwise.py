"""RMSNorm, the rotary embedding (its tables and the rotation), SiLU(gate) * up and a row's argmax
on a CPU in eejax's kernel library (`cpu_elementwise.cc`, built with `cpu_matmul`): each element one
fixed expression of its inputs,
so a row's bits do not depend on the program it runs in, the rows beside it or its shape.

XLA:CPU contracts a multiply feeding an add into a fused multiply-add where its fusion of the
program lets it, so the same jnp arithmetic rounds differently in a one-step decode program, a
four-step one and a verify pass (docs/decoding.md, batch invariance). With the library, on one CPU
device, for float32 values, these functions call it; elsewhere (a GPU, a mesh, bf16, no compiler)
they are the jnp expressions. Gradients (training) go through the jnp expressions
(`jax.custom_vjp`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from eejax.kernels import cpu_matmul


def applies(*xs) -> bool:
    return all(x.dtype == jnp.float32 for x in xs) and cpu_matmul.library_applies()


def rms_norm_reference(x, weight, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rms_norm(x, weight, eps):
    """RMSNorm of x [..., D] scaled by weight [D] (see `rms_norm_reference`)."""
    if not applies(x, weight):
        return rms_norm_reference(x, weight, eps)
    return _rms_norm(x, weight, float(eps))


def rope_reference(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    if cos.ndim < x.ndim:  # one table row for a row's heads
        cos, sin = cos[..., None, :], sin[..., None, :]
    return x * cos + rotated * sin


def rope(x, cos, sin):
    """x * cos + rotate_half(x) * sin for float32 x [..., H, Dh] and tables cos, sin [..., Dh]
    (each row's heads rotated by its row of the tables; or tables of x's own shape)."""
    if not applies(x, cos, sin):
        return rope_reference(x, cos, sin)
    return _rope(x, cos, sin)


def rope_tables_reference(positions, inv_freq):
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rope_tables(positions, inv_freq):
    """cos, sin [..., Dh] (float32) of integer positions [...] and inverse frequencies [Dh / 2]
    (no gradient: positions are integers)."""
    if not cpu_matmul.library_applies():
        return rope_tables_reference(positions, inv_freq)
    out = jax.ShapeDtypeStruct((*positions.shape, 2 * len(inv_freq)), jnp.float32)
    call = jax.ffi.ffi_call("eejax_rope_tables", (out, out), vmap_method="broadcast_all")
    return call(positions.astype(jnp.int32), jnp.asarray(inv_freq, jnp.float32))


def silu_mul_reference(gate, up):
    return jax.nn.silu(gate) * up


def silu_mul(gate, up):
    """SiLU(gate) * up, elementwise (one shape)."""
    if not applies(gate, up):
        return silu_mul_reference(gate, up)
    return _silu_mul(gate, up)


def argmax(x):
    """The first index of the largest value along x's last axis (a NaN the largest) -> int32
    [...]: `jnp.argmax`'s index, one pass over each row in the library (float32 x, where it
    applies; None elsewhere: the caller's own reductions)."""
    if not applies(x) or x.shape[-1] == 0:
        return None
    out = jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32)
    return jax.ffi.ffi_call("eejax_argmax", out, vmap_method="broadcast_all")(x)


def _call(target, like, *args, vmap_method="broadcast_all", **attrs):
    out = jax.ShapeDtypeStruct(like.shape, jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method=vmap_method)(*args, **attrs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, weight, eps):
    # The kernel scales every row by one weight [D]: under vmap (a batch of layers' norms, KV
    # fill on a GPU's structure) each batch entry is a call of its own, never a broadcast weight.
    return _call("eejax_rms_norm", x, x, weight, vmap_method="sequential", eps=np.float32(eps))


@jax.custom_vjp
def _rope(x, cos, sin):
    return _call("eejax_rope", x, x, cos, sin)


@jax.custom_vjp
def _silu_mul(gate, up):
    return _call("eejax_silu_mul", gate, gate, up)


def _norm_fwd(x, weight, eps):
    return _rms_norm(x, weight, eps), (x, weight)


def _norm_bwd(eps, res, g):
    return jax.vjp(lambda x, w: rms_norm_reference(x, w, eps), *res)[1](g)


def _gradient_of(kernel, reference):
    """(fwd, bwd) for `kernel`'s custom_vjp: its own values forward, `reference`'s gradient."""

    def fwd(*args):
        return kernel(*args), args

    def bwd(args, g):
        return jax.vjp(reference, *args)[1](g)

    return fwd, bwd


_rms_norm.defvjp(_norm_fwd, _norm_bwd)
_rope.defvjp(*_gradient_of(_rope, rope_reference))
_silu_mul.defvjp(*_gradient_of(_silu_mul, silu_mul_reference))
