"""Models on a device mesh: params and the paged KV cache placed by the Flax modules' logical axes.

A mesh has two axes, `data` (rows) and `tensor` (heads, MLP columns, vocabulary). `RULES` maps
the logical axis names the modules declare (`Model.logical_axes()`) onto them, and Flax turns
them into shardings (`nn.logical_to_mesh_axes`). A dimension the mesh axis does not divide is
replicated instead: GQA's KV heads when the tensor axis exceeds them, an odd vocabulary. The KV
cache [L, Hkv, pages, page_size, Dh] is split by KV heads the same way, and the cache write and
attention run on each device's own heads (`kernels.head_parallel`). Programs are the
single-device programs, partitioned by XLA (GSPMD) from their inputs' shardings and the
models' logical constraints (rows over `data`): `generate` and the `Engine` run unchanged. Over
several processes (`initialize_distributed`), results are read with `to_host`."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eejax.errors import EejaxError

MESH_AXES = ("data", "tensor")
RULES = (
    ("batch", "data"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", None),
    ("fused", None),  # a draft head's [embedding ⊕ feature] input
    ("norm", None),
    ("layers", None),
    ("relpos_buckets", None),
    ("adapter", None),
)


def make_mesh(tensor: int = 1, data: int = 1, devices=None) -> Mesh:
    """A (data, tensor) mesh over the first data * tensor devices (`jax.devices()` by default)."""
    devices = list(jax.devices() if devices is None else devices)
    if tensor < 1 or data < 1:
        raise EejaxError(f"a mesh needs tensor >= 1 and data >= 1, got tensor={tensor} data={data}")
    if tensor * data > len(devices):
        raise EejaxError(
            f"a mesh of tensor {tensor} x data {data} needs {tensor * data} devices; "
            f"this process has {len(devices)} ({devices[0].platform})"
        )
    return Mesh(np.array(devices[: tensor * data]).reshape(data, tensor), MESH_AXES)


def check_fits(config, mesh: Mesh) -> None:
    """EejaxError unless the tensor axis divides the model's attention heads."""
    tensor = mesh.shape["tensor"]
    if config.num_heads % tensor:
        raise EejaxError(
            f"tensor parallelism {tensor} does not divide the model's {config.num_heads} attention "
            f"heads; use a divisor of {config.num_heads}"
        )


def param_shardings(model, mesh: Mesh, rules=RULES):
    """The sharding of every array in `model.params` (a tree like it). A dimension is split only
    where the mesh axis divides what it counts: attention heads for `heads` / `kv_heads` (a
    split never cuts a head), the size otherwise."""
    c = model.config
    counts = {"heads": c.num_heads, "kv_heads": c.num_kv_heads}
    specs = model.logical_axes()

    def place(x, logical: P):
        mesh_axes = nn.logical_to_mesh_axes(logical, rules)
        fixed = [
            axis if axis is None or counts.get(name, dim) % _size(mesh, axis) == 0 else None
            for name, axis, dim in zip(logical, mesh_axes, x.shape)
        ]
        return NamedSharding(mesh, P(*fixed))

    return jax.tree.map(place, model.params, specs)


def cache_sharding(config, mesh: Mesh) -> NamedSharding:
    """The paged KV cache's sharding: split by KV heads where the tensor axis divides them."""
    split = config.num_kv_heads % mesh.shape["tensor"] == 0
    return NamedSharding(mesh, P(None, "tensor" if split else None))


def to_host(tree):
    """numpy values of a tree of device arrays. An array that spans devices of several processes
    is gathered from all of them (`multihost_utils.process_allgather`: a collective, so every
    process reads the same arrays at the same point, as SPMD programs do)."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def initialize_distributed(coordinator: str, num_processes: int, process_id: int) -> None:
    """Joins this process to a multi-process JAX runtime (`jax.distributed.initialize`) before any
    device is used; on CPU, collectives between processes go through gloo."""
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise EejaxError(f"--process-id must be in [0, {num_processes}), got {process_id}")
    if ":" not in coordinator:
        raise EejaxError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def _size(mesh: Mesh, axis) -> int:
    names = axis if isinstance(axis, tuple) else (axis,)
    return int(np.prod([mesh.shape[n] for n in names]))
