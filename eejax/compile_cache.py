"""JAX's persistent compilation cache for eejax's commands: the programs `eejax generate`,
`eejax serve` (its --warmup too) and the trainers compile are kept on disk, so the next run on the
machine loads them instead of compiling. Where: $EEJAX_COMPILE_CACHE, default
~/.cache/eejax/jax-compile (the test suite uses the same one, see tests/conftest.py); "off",
"none", "0" or "false" turn it off. An explicit $JAX_COMPILATION_CACHE_DIR wins."""

from __future__ import annotations

import os
from pathlib import Path

OFF = ("off", "none", "0", "false")
MIN_COMPILE_S = 0.2  # programs that compile faster are not worth a disk read
MAX_BYTES = 4 << 30  # a size cap also turns on JAX's file lock between processes sharing the cache


def compile_cache_dir(environ=os.environ) -> Path | None:
    """The cache directory $EEJAX_COMPILE_CACHE names (default ~/.cache/eejax/jax-compile), or None: off."""
    value = environ.get("EEJAX_COMPILE_CACHE") or str(Path.home() / ".cache" / "eejax" / "jax-compile")
    return None if value.strip().lower() in OFF else Path(value).expanduser()


def background_compile(environ=os.environ) -> bool:
    """Whether a CPU model whose "auto" layout is split starts decoding on the stacked programs
    while the split ones compile in the background (`eejax.Model.compiles_split_later`):
    $EEJAX_BACKGROUND_COMPILE, on unless "off", "none", "0" or "false" (then the split programs
    compile before their first step; the test suite turns it off, so that each test runs one layout)."""
    return switched_on("EEJAX_BACKGROUND_COMPILE", environ)


def switched_on(name: str, environ=os.environ) -> bool:
    """Whether the environment switch `name` is on: it is unless set to "off", "none", "0" or "false"."""
    return environ.get(name, "on").strip().lower() not in OFF


def enable_compile_cache(environ=os.environ) -> Path | None:
    """Turns the cache on in this process (call it before the first compile); returns its
    directory, or None when it is off."""
    import jax

    explicit = environ.get("JAX_COMPILATION_CACHE_DIR")
    path = Path(explicit) if explicit else compile_cache_dir(environ)
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in environ:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
