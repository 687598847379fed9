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


@contextlib.contextmanager
def tracing_for(platform: str):
    """Within it, `backend()` is `platform` in this thread (JAX's names: "cpu", "gpu", "tpu")."""
    before = getattr(_target, "platform", None)
    _target.platform = platform
    try:
        yield
    finally:
        _target.platform = before
