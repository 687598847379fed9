"""The backend eejax traces a program for: JAX's default backend, or the one `tracing_for` names.

Every choice eejax makes by backend while tracing (the CPU kernels, attention "auto", the argmax,
the GPU's static loops) asks `backend()`, so a program can be traced here as another backend
would trace it: `ProgramCache.compile_for` compiles for a GPU on a machine without one.
"""

from __future__ import annotations

import contextlib
import threading

import jax

_target = threading.local()


def backend() -> str:
    """What the programs traced in this thread are for: "cpu", "gpu" or "tpu"."""
    return getattr(_target, "platform", None) or jax.default_backend()


def compute_capability() -> int | None:
    """The CUDA compute capability the programs traced in this thread are for (90 for "9.0")
    where `tracing_for` names one (a compile-only device: no GPU to ask), else None (jax-triton
    asks the device)."""
    return getattr(_target, "compute_capability", None)


@contextlib.contextmanager
def tracing_for(platform: str, compute_capability: str | None = None):
    """Within it, `backend()` is `platform` in this thread (JAX's names: "cpu", "gpu", "tpu") and
    `compute_capability()` that of `compute_capability` ("9.0", a CUDA device's), if given."""
    before = getattr(_target, "platform", None), getattr(_target, "compute_capability", None)
    _target.platform = platform
    _target.compute_capability = int(compute_capability.replace(".", "")) if compute_capability else None
    try:
        yield
    finally:
        _target.platform, _target.compute_capability = before
