"""Work on each device's own attention heads under tensor parallelism.

When a program is traced for a mesh (`ProgramCache` puts it in context) whose `tensor` axis
divides the KV heads, the paged cache [L, Hkv, P, S, Dh] is split by KV heads and every query
head's KV head sits on the same device. The cache write and the attention over the cache then
run per device on its heads (`jax.shard_map`): left to XLA's partitioner, their gathers and
scatters with an explicit head index become masked gathers plus an all-reduce of every page
they touch, and a Triton call cannot be partitioned at all. Without such a mesh, nothing changes.
"""

from __future__ import annotations

import jax


def head_mesh(num_kv_heads: int):
    """The mesh in context when its `tensor` axis (> 1) divides `num_kv_heads`, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    tensor = dict(zip(mesh.axis_names, mesh.axis_sizes)).get("tensor", 1)
    return mesh if tensor > 1 and num_kv_heads % tensor == 0 else None


def row_axis(mesh, rows: int):
    """ "data" when the mesh's data axis (> 1) divides `rows`, else None (rows replicated)."""
    data = dict(zip(mesh.axis_names, mesh.axis_sizes)).get("data", 1)
    return "data" if data > 1 and rows % data == 0 else None


def on_head_shards(fn, mesh, in_specs, out_specs):
    """`fn` run per device on its shards (`jax.shard_map` over the mesh in context)."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
