"""What the engine moves between host and device each step, in as few transfers as it can: on a
GPU each transfer is a copy and a stream synchronisation, and the host's time between programs
is time the device idles (a SmolLM2 draft:4 round: 2.8 ms as one program, 7.0 ms in the engine
with 13 reads back and 2-3 uploads a dispatch; H100, 2026-11-27).

`PackedRead`: a step's integer outputs (tokens, counts, flags) packed on device into one int32
vector by one small program, its copy to the host started at once, unpacked on the host when
read (one dispatch later). `Uploads`: host arrays that rarely change (the block table, a group's
mask) sent again only when their contents changed.
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np

from eejax.sharding import to_host


@jax.jit
def _pack(leaves):
    return jnp.concatenate([jnp.ravel(x).astype(jnp.int32) for x in leaves])


class PackedRead:
    """A tree of integer (or bool) device arrays, on its way to the host as one int32 vector:
    `read()` gives the tree as numpy arrays of the same shapes and dtypes (read-only views where
    they are int32). Arrays that span processes are read as they are (`to_host` gathers each)."""

    def __init__(self, tree):
        leaves, self._treedef = jax.tree.flatten(tree)
        for x in leaves:
            if x.dtype.kind not in "iub":
                raise TypeError(f"PackedRead takes integer and bool arrays, got {x.dtype}")
        self._shapes = [(x.shape, math.prod(x.shape), x.dtype) for x in leaves]
        self._packed, self._leaves = None, leaves
        if jax.process_count() == 1 or all(x.is_fully_addressable for x in leaves):
            try:
                self._packed, self._leaves = _pack(leaves), None
                self._packed.copy_to_host_async()
            except Exception:  # noqa: BLE001 (a failed step's arrays: `read` raises its error, where the engine guards it)
                self._packed, self._leaves = None, leaves

    def read(self):
        if self._packed is None:
            return jax.tree.unflatten(self._treedef, to_host(self._leaves))
        flat = np.asarray(self._packed)
        out, start = [], 0
        for shape, size, dtype in self._shapes:
            out.append(flat[start : start + size].reshape(shape).astype(dtype, copy=False))
            start += size
        return jax.tree.unflatten(self._treedef, out)


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
        device = jax.device_put(host)
        self._kept[key] = (host, device)
        self._kept.move_to_end(key)
        while len(self._kept) > self._size:
            self._kept.popitem(last=False)
        return device
