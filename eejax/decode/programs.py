"""Ahead-of-time compiled programs, one per (function, model config, `StepOptions`, input shapes).

Shapes are drawn from bucketed sets (see `buckets.py`), so a session compiles a bounded number
of programs; `num_programs` and `compile_seconds` report how many and for how long. `get_soon`
compiles a program in a background thread and hands out a fallback until it is ready (the
split layer layout's decode programs, `Model.compiles_split_later`).

Each compiled program holds memory maps: an XLA:CPU executable of SmolLM2-135M ~256 (jaxlib
0.10.2, measured; ~1000 with its layers unrolled over per-layer buffers), so under Linux's
default vm.max_map_count of 65530 one process holds ~250 of them (~65 unrolled) before compiling
fails ("LLVM compilation error: Cannot allocate memory"). `map_headroom` says how many maps are
left, and `release_all` frees every compiled program of the process.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax

from eejax.kernels.backend import tracing_for
from eejax.options import StepOptions

# Memory maps one compiled SmolLM2-135M program holds on XLA:CPU, by layer layout (measured:
# the split layout's decode programs unroll the layers, ~4x the code).
MAPS_PER_PROGRAM = {"stacked": 256, "rows": 256, "split": 1024}

log = logging.getLogger(__name__)


def float32_matmuls():
    """The context eejax traces its programs in: a matmul or convolution over float32 operands
    computes in float32. JAX's default on a GPU (Ampere and later) rounds them to TF32, 10 bits of
    mantissa, and then float32 is no exact reference: on an H200 a lossless speculation test's
    tokens parted from full depth's, and a LayerSkip delta's probe missed its recorded logits by
    0.012. bfloat16 operands are not affected; a CPU computes float32 either way."""
    return jax.default_matmul_precision("float32")


IDLE_S = 0.5  # `get_soon` compiles in the background after this long without a program request,
BUSY_S = 10.0  # or this long after the program was first asked for, if no pause came by then
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
    """Programs are traced with float32 matmuls (`float32_matmuls`). `mesh` and `rules`: with that
    mesh and those logical axis rules in context too (`jax.set_mesh`, `flax.linen.logical_axis_rules`),
    so the models' logical sharding constraints apply (rows over `data`); none without a mesh."""

    def __init__(self, mesh=None, rules=()):
        self.mesh, self.rules = mesh, tuple(rules)
        self._compiled: dict[Any, Any] = {}
        self._sources: dict[Any, tuple] = {}  # key -> (fn, abstract args, static, donate_argnums)
        self._pending: dict[Any, threading.Thread] = {}  # key -> its background compilation (`get_soon`)
        self._weights = None  # (args[0], its leaves, its key): the weights, the same on every call
        self._lock = threading.Lock()
        self._closing = threading.Event()  # set: background compilations not yet started give up
        self._last_request = 0.0  # time.monotonic() of the last get, get_soon or in_use's end
        self._users = 0  # callers inside in_use()
        self.compile_seconds = 0.0  # compiling while the caller waited
        self.background_seconds = 0.0  # compiling in background threads
        _LIVE.add(self)

    @property
    def num_programs(self) -> int:
        return len(self._compiled)

    def get(self, fn: Callable, args: tuple, config, options: StepOptions, donate_argnums=()):
        """The compiled `fn(*args, config=config, options=options)`, compiling it on first use."""
        self._last_request = time.monotonic()
        key = self._key(fn, args, config, options)
        program = self._compiled.get(key)
        if program is None:
            start = time.perf_counter()
            program = self._compile(fn, args, config, options, donate_argnums)
            self.compile_seconds += time.perf_counter() - start
            self._add(key, program, fn, args, config, options, donate_argnums)
        return program

    def get_soon(self, fn: Callable, args: tuple, fallback: tuple, config, options: StepOptions, donate_argnums=()):
        """(compiled program, the args it takes): `fn` over `args` once it is compiled; until then
        `fn` over `fallback` (compiled now where need be), and the program over `args` compiles in
        a background thread once this cache has been idle for IDLE_S seconds (no program asked
        for, no caller `in_use`: so it does not slow the work that runs meanwhile, and a process
        that ends at once never compiles it), or BUSY_S seconds after it was first asked for (a
        loop of `generate` calls, or a server, that never pauses: the compile then runs beside
        the fallback for a few seconds, and the faster program serves the rest of the loop).
        For the split layer layout on a CPU: it decodes faster, but its unrolled layers compile
        ~3x slower than the stacked loop that `fallback` holds. The two compute the same tokens
        (float rounding aside: ~1e-5 in a log-probability)."""
        self._last_request = time.monotonic()
        key = self._key(fn, args, config, options)
        with self._lock:
            program = self._compiled.get(key)
            if program is None and key not in self._pending:
                abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_placed(x)), args)
                job = (key, fn, abstract, config, options, donate_argnums)
                self._pending[key] = threading.Thread(target=self._compile_when_idle, args=job, daemon=True)
                self._pending[key].start()
        if program is not None:
            return program, args
        return self.get(fn, fallback, config, options, donate_argnums), fallback

    def _key(self, fn, args, config, options) -> tuple:
        """What a program is compiled for: fn, config, options and its args' shapes, dtypes and
        placements. args[0] (the weights, the same arrays on every call) is keyed once per set of
        arrays: its key is reused while it is the very same tree (`Model.run_params`: params are
        never changed in place, `Model.with_params` makes new ones), or one whose leaves are the
        very same objects. Flattening the weights on every dispatch cost 0.1 ms (SmolLM2, 272
        leaves) to 0.36 ms (its GGUF blocks, 693) of host time."""
        kept = self._weights
        if kept is None or kept[0] is not args[0]:
            leaves = jax.tree.leaves(args[0])
            if kept is None or len(kept[1]) != len(leaves) or any(a is not b for a, b in zip(kept[1], leaves)):
                kept = (args[0], leaves, _arrays_key(args[0], self.mesh is not None))
            else:
                kept = (args[0], *kept[1:])
            self._weights = kept
        return (fn.__module__, fn.__qualname__, config, options, kept[2], _arrays_key(args[1:], self.mesh is not None))

    @contextlib.contextmanager
    def in_use(self):
        """Marks a caller running programs (an engine's step, which may wait long on the device):
        background compilations start once no caller is and IDLE_S seconds have passed (or
        BUSY_S after their program was first asked for)."""
        with self._lock:
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
            self._last_request = time.monotonic()

    def wait(self, timeout: float | None = None) -> bool:
        """Returns once every background compilation (`get_soon`) has ended (call it idle), or
        after `timeout` seconds; whether they all ended."""
        end = None if timeout is None else time.monotonic() + timeout
        for thread in list(self._pending.values()):
            thread.join(None if end is None else max(0.0, end - time.monotonic()))
        return not any(thread.is_alive() for thread in self._pending.values())

    def clear(self) -> int:
        """Drops this cache's compiled programs (they compile again on next use) and the background
        compilations not yet started, once those under way have ended; returns how many."""
        self._closing.set()
        self.wait()
        with self._lock:
            count = len(self._compiled)
            self._compiled.clear()
            self._sources.clear()
            self._pending.clear()
            self._weights = None
        self._closing.clear()
        return count

    def _compile(self, fn, args, config, options, donate_argnums):
        jitted = jax.jit(functools.partial(fn, config=config, options=options), donate_argnums=donate_argnums)
        with self._tracing():
            return jitted.lower(*args).compile()

    def _compile_when_idle(self, key, fn, abstract, config, options, donate_argnums):
        asked = time.monotonic()
        while True:
            now = time.monotonic()
            busy, idle = self._users, now - self._last_request
            if (not busy and idle >= IDLE_S) or now - asked >= BUSY_S:
                break
            wait = min(IDLE_S if busy else IDLE_S - idle, BUSY_S - (now - asked))
            if self._closing.wait(max(wait, 0.0)):
                return
        start = time.perf_counter()
        try:
            program = self._compile(fn, abstract, config, options, donate_argnums)
        except Exception as e:  # the fallback program keeps running; said once
            log.warning("compiling %s in the background failed (%s); its fallback keeps running", fn.__qualname__, e)
            return
        self.background_seconds += time.perf_counter() - start
        self._add(key, program, fn, abstract, config, options, donate_argnums)

    def _add(self, key, program, fn, args, config, options, donate_argnums) -> None:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
        with self._lock:
            self._compiled[key] = program
            self._sources[key] = (fn, abstract, dict(config=config, options=options), donate_argnums)

    def _tracing(self):
        """float32 matmuls, and the mesh and its axis rules where there is one."""
        stack = contextlib.ExitStack()
        stack.enter_context(float32_matmuls())
        if self.mesh is None:
            return stack
        import flax.linen as nn

        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(self.rules))
        return stack

    def compiled(self) -> list[tuple[str, jax.stages.Compiled]]:
        """[(function name, compiled program)] of every program compiled so far."""
        return [(name, program) for name, _, program in self.entries()]

    def entries(self) -> list[tuple[str, StepOptions, jax.stages.Compiled]]:
        """[(function name, its options, compiled program)] of every program compiled so far."""
        with self._lock:  # a background compilation may add one meanwhile
            sources = list(self._sources.items())
        return [(source[0].__qualname__, source[2]["options"], self._compiled[key]) for key, source in sources]

    def lower_for(self, platform: str) -> list[tuple[str, jax.stages.Lowered]]:
        """Every program compiled so far, lowered again for `platform` ("cuda", "rocm", "tpu",
        "cpu") without a device of that kind: [(function name, Lowered)]. Options that
        were resolved for this process's backend (attention "auto") keep their resolution."""
        lowered = []
        with self._lock:
            sources = list(self._sources.values())
        for fn, args, static, donate in sources:
            jitted = jax.jit(functools.partial(fn, **static), donate_argnums=donate)
            with self._tracing():
                lowered.append((fn.__qualname__, jitted.trace(*args).lower(lowering_platforms=(platform,))))
        return lowered

    def compile_for(self, device, names=None, attention: str | None = None) -> list[tuple[str, jax.stages.Compiled]]:
        """Every program compiled so far (of the functions `names`, where given), traced and
        compiled again for `device`, a compile-only device of another backend
        (`eejax.kernels.gpu_targets.compile_only_device`: an H100 on a machine without a GPU):
        [(function name, Compiled)]. Traced as that backend traces (`kernels.backend.tracing_for`:
        XLA's products and attention, the GPU's static loops, the device's compute capability
        for jax-triton), with `attention` in their options where given ("triton": the Triton
        layer's programs, which need not have run here). One device only: a mesh's
        programs are refused. The process's persistent compilation cache must be off (its
        entries would be executables no process can load: `scripts/gpu_compiler.sh`)."""
        if self.mesh is not None:
            raise ValueError("compile_for compiles one device's programs; this cache's are a mesh's")
        placed = jax.sharding.SingleDeviceSharding(device)
        compiled = []
        with self._lock:
            sources = list(self._sources.values())
        for fn, args, static, donate in sources:
            if names is not None and fn.__qualname__ not in names:
                continue
            if attention is not None:
                static = {**static, "options": dataclasses.replace(static["options"], attention=attention)}
            abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), args)
            jitted = jax.jit(functools.partial(fn, **static), donate_argnums=donate)
            with self._tracing(), tracing_for(device.platform, getattr(device, "compute_capability", None)):
                compiled.append((fn.__qualname__, jitted.trace(*abstract).lower().compile()))
        return compiled


@atexit.register
def _end_background() -> None:
    """At exit: background compilations not yet started give up, and those under way end first
    (a thread left inside XLA's compiler while the interpreter shuts down can crash it)."""
    for cache in list(_LIVE):
        cache._closing.set()
        cache.wait()


def release_all() -> int:
    """Drops every compiled program of every model in this process, and JAX's own caches, so that
    their memory and memory maps are freed once nothing else holds them (a long-lived process that
    has compiled for many models or options: see `map_headroom`). Later calls compile again (from
    the persistent compilation cache where one is on). Returns how many programs were dropped."""
    count = sum(cache.clear() for cache in list(_LIVE))
    jax.clear_caches()
    gc.collect()
    return count


def _arrays_key(tree, placed: bool = True) -> tuple:
    """Shapes, dtypes and (`placed`: a cache on a mesh) shardings of a tree's arrays."""
    leaves, treedef = jax.tree.flatten(tree)
    if not placed:  # one device: nothing to tell apart (a dispatch keys ~30 arrays)
        try:  # an array's aval (shape, dtype, weak type) is an attribute: 4x faster than shape and dtype
            return treedef, tuple(x.aval for x in leaves)
        except AttributeError:  # host arrays
            return treedef, tuple((x.shape, x.dtype) for x in leaves)
    return treedef, tuple((x.shape, x.dtype, _sharding(x)) for x in leaves)  # x.dtype, not str(x.dtype): 9x faster


def _placed(x):
    """The sharding an argument is placed with (None for a host array)."""
    return getattr(x, "sharding", None)


def _sharding(x):
    """A committed array's sharding on a mesh (programs are compiled for their inputs' placement);
    None for host arrays and single-device arrays."""
    sharding = getattr(x, "sharding", None)
    return sharding if isinstance(sharding, jax.sharding.NamedSharding) else None
