"""Triton, compiled (a GPU, through jax-triton) or interpreted (a CPU: the tests), for eejax's
Triton kernels (`triton_attention`, `triton_linear`).

Triton decides at import time whether its own library functions (tl.max, ...) are compiled or
interpreted, so a process runs one or the other: the interpreter needs TRITON_INTERPRET=1 before
triton is first imported, which `import_triton` sets when it imports triton itself. triton is
imported lazily: jax-triton only imports with a GPU jaxlib."""

from __future__ import annotations

import os
import sys

import numpy as np

from eejax.errors import EejaxError


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
    return triton


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
