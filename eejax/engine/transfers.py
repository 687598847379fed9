"""What the engine moves between host and device each step, in as few transfers as it can: on a
GPU each transfer is a copy and a stream synchronisation, and the host's time between programs
is time the device idles (a SmolLM2 draft:4 round: 2.8 ms as one program, 7.0 ms in the engine
with 13 reads back and 2-3 uploads a dispatch; H100, 2026-11-27).

`PackedRead`: a step's integer outputs (tokens, counts, flags: `read_tree`) packed on device into
one int32 vector, its copy to the host started at once, unpacked on the host when read (one
dispatch later). The step's last program packs them itself (`reading`), so the read costs no
program of its own; otherwise (a mesh, a state changed outside a program) one small program packs
them. `Uploads`: host arrays that rarely change (the block table, a group's mask) sent again only
when their contents changed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eejax.sharding import to_host


class SlotsRead(NamedTuple):
    """What the host reads of the slots after a step (device arrays, or their host copies once
    read): each row's tokens made num_generated [S], done [S], tokens, exit_layers and
    confident_layers [S, N], and the speculation counters spec_counters [S] (`SpecCounters`)."""

    num_generated: Any
    done: Any
    tokens: Any
    exit_layers: Any
    confident_layers: Any
    spec_counters: Any


def read_tree(state, spec_counters) -> SlotsRead:
    """What the host reads of the slots after a step (`SlotsRead`) of the decode state."""
    return SlotsRead(
        state.num_generated, state.done, state.tokens, state.exit_layers, state.confident_layers, spec_counters
    )


def pack(tree) -> jax.Array:
    """A tree of integer (or bool) arrays as one int32 vector, leaf after leaf (traceable)."""
    return jnp.concatenate([jnp.ravel(x).astype(jnp.int32) for x in jax.tree.leaves(tree)])


_pack = jax.jit(pack)


@functools.cache
def reading(fn, takes_counters: bool, packs: bool = True):
    """A slot program over `SlotArgs` of `fn(params, cache, state[, spec counters], *inputs) ->
    (state, cache[, spec counters])` (`takes_counters`: a round's, which updates them): the
    state's prompts (a prompt lookup's) rejoin it for `fn` and leave it again, and it returns
    (state without its prompts, cache, spec counters[, packed]), the counters as `fn` left them
    or as they came. With `packs` it also packs what the host reads of it (`read_tree`, `pack`):
    one program, one transfer, no packing program after it. The state and counters may then be
    donated as the cache is (`DeviceSlots.program`): the prompts, which the next program reads
    again, come apart from them, and none is copied into an output. Named as `fn` (the program
    cache keys it apart by this module)."""

    def program(params, cache, state, spec_counters, prompt, inputs, *, config, options):
        if prompt is not None:
            state = dataclasses.replace(state, prompt=prompt)
        counters = (spec_counters,) if takes_counters else ()
        out = fn(params, cache, state, *counters, *inputs, config=config, options=options)
        state, cache = out[:2]
        if state.prompt is not None:
            state = dataclasses.replace(state, prompt=None)
        spec_counters = out[2] if takes_counters else spec_counters
        if not packs:
            return state, cache, spec_counters
        return state, cache, spec_counters, pack(read_tree(state, spec_counters))

    program.__name__, program.__qualname__, program.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    return program


class ReadLayout:
    """Where each array of a tree lies in its packed vector (`pack`): built once from the tree's
    shapes, it unpacks a host copy of the vector into numpy arrays of the tree's shapes and dtypes."""

    def __init__(self, tree):
        leaves, self.treedef = jax.tree.flatten(tree)
        for x in leaves:
            if x.dtype.kind not in "iub":
                raise TypeError(f"PackedRead takes integer and bool arrays, got {x.dtype}")
        self._slices, start = [], 0  # (start, end, shape, dtype or None where int32)
        for x in leaves:
            size, dtype = math.prod(x.shape), np.dtype(x.dtype)
            self._slices.append((start, start + size, x.shape, None if dtype == np.int32 else dtype))
            start += size
        self.size = start

    def unpack(self, flat: np.ndarray):
        """The tree from its packed host copy (read-only views where the arrays are int32)."""
        out = []
        for start, end, shape, dtype in self._slices:
            x = flat[start:end].reshape(shape)
            out.append(x if dtype is None else x.astype(dtype))
        return jax.tree.unflatten(self.treedef, out)


class PackedRead:
    """A tree of integer (or bool) device arrays, on its way to the host as one int32 vector:
    `read()` gives the tree as numpy arrays of the same shapes and dtypes (read-only views where
    they are int32). Arrays that span processes are read as they are (`to_host` gathers each).
    `PackedRead.started(packed, layout)`: a vector a program already packed (`reading`)."""

    def __init__(self, tree):
        self._layout = ReadLayout(tree)
        leaves = jax.tree.leaves(tree)
        self._packed, self._leaves = None, leaves
        if jax.process_count() == 1 or all(x.is_fully_addressable for x in leaves):
            try:
                self._packed, self._leaves = _pack(leaves), None
            except Exception:  # noqa: BLE001 (a failed step's arrays: `read` raises its error, where the engine guards it)
                self._packed, self._leaves = None, leaves
        if self._packed is not None:
            _start_copy(self._packed)

    @classmethod
    def started(cls, packed: jax.Array, layout: ReadLayout) -> PackedRead:
        """The read of `packed`, laid out as `layout` says; its copy to the host starts now."""
        if packed.shape != (layout.size,):
            raise ValueError(f"a packed read of {layout.size} values, got shape {packed.shape}")
        read = cls.__new__(cls)
        read._layout, read._packed, read._leaves = layout, packed, None
        _start_copy(packed)
        return read

    def read(self):
        if self._packed is None:
            return jax.tree.unflatten(self._layout.treedef, to_host(self._leaves))
        return self._layout.unpack(np.asarray(self._packed))


def _start_copy(packed: jax.Array) -> None:
    """Starts `packed`'s copy to the host. A failed program's output cannot be copied: `read`
    raises its error then, where the engine guards it."""
    with contextlib.suppress(Exception):
        packed.copy_to_host_async()


_copy = jax.jit(lambda x: x)  # a new buffer for each array (nothing donated): one program


def copied(tree):
    """A device copy of a tree's arrays, which stays readable once the arrays themselves are
    donated to a program (a state's log-probs, read one dispatch later: `Dispatch._outputs`)."""
    return _copy(tree)


def send(host: np.ndarray) -> jax.Array:
    """A host array on the default device, as `jax.device_put` puts it. In one process through a
    jitted copy, whose transfer runs in C++: ~16 µs on this project's CPU against device_put's
    ~125 µs of Python; across processes (jax.distributed) by device_put."""
    return _copy(host) if jax.process_count() == 1 else jax.device_put(host)


class Uploads:
    """Device copies of host arrays, sent again only when an array's contents changed; at most
    `size` kept, least recently used dropped. An array handed out must not be donated.

    What is sent is a private copy of the caller's array: on a CPU `jax.device_put` may alias a
    numpy array's memory (it did for about half the arrays tried, by alignment), and the caller
    changes its arrays in place (the block table), which would change the device array under a
    program in flight."""

    def __init__(self, size: int = 16):
        self._kept: collections.OrderedDict = collections.OrderedDict()  # key -> (host copy, device array)
        self._size = size

    def get(self, key, array: np.ndarray) -> jax.Array:
        kept = self._kept.get(key)
        same = kept is not None and kept[0].shape == array.shape and kept[0].dtype == array.dtype
        if same and kept[0].tobytes() == array.tobytes():  # ~4x faster than np.array_equal here
            self._kept.move_to_end(key)
            return kept[1]
        host = array.copy()  # never changed: safe for the device array to alias
        device = send(host)
        self._kept[key] = (host, device)
        self._kept.move_to_end(key)
        while len(self._kept) > self._size:
            self._kept.popitem(last=False)
        return device
