"""Triton, compiled (a GPU, through jax-triton) or interpreted (a CPU: the tests), for eejax's
Triton kernels (`triton_attention`, `triton_linear`).

Triton decides at import time whether its own library functions (tl.max, ...) are compiled or
interpreted, so a process runs one or the other: the interpreter needs TRITON_INTERPRET=1 before
triton is first imported, which `import_triton` sets when it imports triton itself. triton is
imported lazily: jax-triton only imports with a GPU jaxlib.

The interpreter's `tl.dot` is numpy's matmul, whose BLAS computes a tile's rows in micro-tiles
(OpenBLAS: a row's bits differ between rows 0-5 and 6-15 of a 16-row tile). A GPU's MMA computes
every row of a tile the same way, and the kernels' batch invariance rests on that. So the
interpreter's dot here is `rowwise_dot` (numpy's einsum without BLAS: each output a sum over K in
one order, whatever row it is in), and the CPU tests see the tile as a GPU computes it."""

from __future__ import annotations

import os
import sys

import numpy as np

from eejax.errors import EejaxError
from eejax.kernels.backend import compute_capability


def import_triton(interpret: bool):
    """The `triton` module, imported to run kernels interpreted (`interpret`) or compiled; an
    EejaxError where triton is missing or this process imported it the other way."""
    if interpret and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
        import triton.language  # noqa: F401 - binds triton.language
    except ImportError:
        raise EejaxError("eejax's Triton kernels need triton: pip install triton (or eejax[gpu])") from None
    if bool(triton.knobs.runtime.interpret) != interpret:
        mode = "interpreted (CPU)" if interpret else "compiled (GPU)"
        raise EejaxError(
            f"cannot run a Triton kernel {mode}: triton was imported with TRITON_INTERPRET="
            f"{os.environ.get('TRITON_INTERPRET', '')!r}; a process runs Triton either compiled or interpreted"
        )
    if interpret:
        _dot_by_rows()
    return triton


def rowwise_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc + a @ b ([..., M, K] @ [..., K, N]) with each output summed over K in one order,
    whatever its row (numpy's einsum, no BLAS), in acc's dtype."""
    return np.einsum("...mk,...kn->...mn", a, b, dtype=acc.dtype, optimize=False) + acc


def _dot_by_rows() -> None:
    """The interpreter's `tl.dot` as `rowwise_dot` (see the module docstring); 8-bit floats keep
    the interpreter's own conversion."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "rowwise", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, d, *args):
        if a.data.dtype.itemsize == 1 or b.data.dtype.itemsize == 1:
            return original(self, a, b, d, *args)
        return interpreter.TensorHandle(rowwise_dot(a.data, b.data, d.data), d.dtype.scalar)

    create_dot.rowwise = True
    builder.create_dot = create_dot


def call_compiled(kernel, args, scalars, *, out_shape, grid, num_warps, num_stages, constexprs, aliases=None):
    """`kernel` (compiled: `import_triton(False)`) launched through jax-triton over `args` then
    `scalars`, for the device being traced for: a compile-only device's compute capability
    (`backend.compute_capability`), else the device's own. `aliases`: {input index: output index}
    updated in place."""
    import jax_triton

    return jax_triton.triton_call(
        *args,
        *scalars,
        kernel=kernel,
        out_shape=out_shape,
        grid=grid,
        num_warps=num_warps,
        num_stages=num_stages,
        compute_capability=compute_capability(),
        input_output_aliases=aliases,
        **constexprs,
    )


def host_tensor(x):
    """A host array as a torch CPU tensor for the interpreter (a writable copy; bf16 kept)."""
    import torch

    x = np.array(x, order="C")
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def host_array(t) -> np.ndarray:
    """An interpreter's torch CPU tensor back as a numpy array (bf16 kept)."""
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def interpreter_scalars(scalars) -> list:
    """A launch's scalar arguments as the interpreter takes them (numpy floats as Python floats)."""
    return [float(v) if isinstance(v, np.floating) else v for v in scalars]
