"""Ahead-of-time compiled programs, one per (function, model config, `StepOptions`, input shapes).

Shapes are drawn from bucketed sets (see `buckets.py`), so a session compiles a bounded number
of programs; `num_programs` and `compile_seconds` report how many and for how long.

Each compiled program holds memory maps: an XLA:CPU executable of SmolLM2-135M ~256 (jaxlib
0.10.2, measured; ~1000 with its layers unrolled over per-layer buffers), so under Linux's
default vm.max_map_count of 65530 one process holds ~250 of them (~65 unrolled) before compiling
fails ("LLVM compilation error: Cannot allocate memory"). `map_headroom` says how many maps are
left, and `release_all` frees every compiled program of the process.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax

from eejax.options import StepOptions

# Memory maps one compiled SmolLM2-135M program holds on XLA:CPU, by layer layout (measured:
# the split layout's decode programs unroll the layers, ~4x the code).
MAPS_PER_PROGRAM = {"stacked": 256, "split": 1024}

_LIVE: weakref.WeakSet[ProgramCache] = weakref.WeakSet()  # every ProgramCache not yet collected


def map_headroom() -> int | None:
    """How many more memory maps this process may create (vm.max_map_count minus the maps it
    holds); None where the system does not say (not Linux)."""
    try:
        limit = int(open("/proc/sys/vm/max_map_count").read())
        with open("/proc/self/maps") as f:
            return limit - sum(1 for _ in f)
    except (OSError, ValueError):
        return None


class ProgramCache:
    """`mesh` and `rules`: programs are traced with that mesh and those logical axis rules in
    context (`jax.set_mesh`, `flax.linen.logical_axis_rules`), so the models' logical sharding
    constraints apply (rows over `data`); none without a mesh."""

    def __init__(self, mesh=None, rules=()):
        self.mesh, self.rules = mesh, tuple(rules)
        self._compiled: dict[Any, Any] = {}
        self._sources: dict[Any, tuple] = {}  # key -> (fn, abstract args, static, donate_argnums)
        self.compile_seconds = 0.0
        _LIVE.add(self)

    @property
    def num_programs(self) -> int:
        return len(self._compiled)

    def get(self, fn: Callable, args: tuple, config, options: StepOptions, donate_argnums=()):
        """The compiled `fn(*args, config=config, options=options)`, compiling it on first use."""
        leaves, treedef = jax.tree.flatten(args)
        static = dict(config=config, options=options)
        key = (
            fn.__module__,
            fn.__qualname__,
            config,
            options,
            treedef,
            tuple((x.shape, str(x.dtype), _sharding(x)) for x in leaves),
        )
        program = self._compiled.get(key)
        if program is None:
            start = time.perf_counter()
            jitted = jax.jit(functools.partial(fn, **static), donate_argnums=donate_argnums)
            with self._placement():
                program = jitted.lower(*args).compile()
            self.compile_seconds += time.perf_counter() - start
            self._compiled[key] = program
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
            self._sources[key] = (fn, abstract, static, donate_argnums)
        return program

    def clear(self) -> int:
        """Drops this cache's compiled programs (they compile again on next use); returns how many."""
        count = len(self._compiled)
        self._compiled.clear()
        self._sources.clear()
        return count

    def _placement(self):
        if self.mesh is None:
            return contextlib.nullcontext()
        import flax.linen as nn

        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(self.rules))
        return stack

    def compiled(self) -> list[tuple[str, jax.stages.Compiled]]:
        """[(function name, compiled program)] of every program compiled so far."""
        return [(name, program) for name, _, program in self.entries()]

    def entries(self) -> list[tuple[str, StepOptions, jax.stages.Compiled]]:
        """[(function name, its options, compiled program)] of every program compiled so far."""
        return [
            (source[0].__qualname__, source[2]["options"], self._compiled[key]) for key, source in self._sources.items()
        ]

    def lower_for(self, platform: str) -> list[tuple[str, jax.stages.Lowered]]:
        """Every program compiled so far, lowered again for `platform` ("cuda", "rocm", "tpu",
        "cpu") without a device of that kind: [(function name, Lowered)]. Options that
        were resolved for this process's backend (attention "auto") keep their resolution."""
        lowered = []
        for fn, args, static, donate in self._sources.values():
            jitted = jax.jit(functools.partial(fn, **static), donate_argnums=donate)
            with self._placement():
                lowered.append((fn.__qualname__, jitted.trace(*args).lower(lowering_platforms=(platform,))))
        return lowered


def release_all() -> int:
    """Drops every compiled program of every model in this process, and JAX's own caches, so that
    their memory and memory maps are freed once nothing else holds them (a long-lived process that
    has compiled for many models or options: see `map_headroom`). Later calls compile again (from
    the persistent compilation cache where one is on). Returns how many programs were dropped."""
    count = sum(cache.clear() for cache in list(_LIVE))
    jax.clear_caches()
    gc.collect()
    return count


def _sharding(x):
    """A committed array's sharding on a mesh (programs are compiled for their inputs' placement);
    None for host arrays and single-device arrays."""
    sharding = getattr(x, "sharding", None)
    return sharding if isinstance(sharding, jax.sharding.NamedSharding) else None
