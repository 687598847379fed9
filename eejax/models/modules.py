"""Flax (linen) building blocks the architectures share: a linear map, RMSNorm, the token
embedding and the LM head. Each declares its weight with a logical axis name per dimension
(MaxText's vocabulary: vocab, embed, heads, kv_heads, mlp, norm; `layers` is added by the stacking
transform), so a mesh maps them with Flax's own rules (`nn.logical_to_mesh_sharding`).

Layout. eejax's params are flat per layer ({"wq": [D, H*Dh], "attn_norm": [D], ...}): checkpoints,
conversion, LoRA factors, the cost model and the KV fill name weights so. A block therefore
names its one weight (`weight`) and shares its parent's scope (`share_scope`): a layer's params
stay one flat dict, and a method that runs part of a layer needs only the weights it reads
(KV fill passes a layer's norm, wk and wv, nothing else).

Models run these blocks with `Module.apply` on params they are given (one layer's slice inside a
traced layer loop); the blocks hold no state, and jit sees exactly the jnp it saw before Flax.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from eejax.kernels.cpu_matmul import RowsMatrix, matmul, matmul_t, matmuls, take_rows
from eejax.models.common import rms_norm
from eejax.quantized import QuantizedMatrix

Dtype = Any


def share_scope(parent: nn.Module, *children: nn.Module) -> None:
    """Children declare their weights in `parent`'s scope (call from `parent.setup`)."""
    for child in children:
        nn.share_scope(parent, child)


def held_weight(module: nn.Module, name: str) -> QuantizedMatrix | RowsMatrix | None:
    """The weight `name` when the params hold it as something other than its float array:
    quantized (`eejax.quantized`) or as its rows (`RowsMatrix`); else None (the module declares
    it with `param` as usual: Flax's shape check would refuse the others)."""
    if module.has_variable("params", name):
        w = module.get_variable("params", name)
        if isinstance(w, QuantizedMatrix | RowsMatrix):
            return w
    return None


def apply_linears(parent: nn.Module, x, *linears: Linear) -> tuple:
    """(linear(x) for linear in linears), Linears that share `parent`'s scope and their input: one
    product call (`cpu_matmul.matmuls`) when all hold quantized weights without LoRA factors (a
    layer's q, k and v; its gate and up), each Linear on its own otherwise."""
    ws = [held_weight(parent, linear.weight) for linear in linears]
    lora = any(parent.has_variable("params", linear.weight + "_a") for linear in linears)
    if lora or any(w is None for w in ws):
        return tuple(linear(x) for linear in linears)
    ys = matmuls(x, ws)
    biases = [None if linear.bias is None else parent.get_variable("params", linear.bias) for linear in linears]
    return tuple((y if b is None else y + b.astype(y.dtype)).astype(x.dtype) for y, b in zip(ys, biases))


def normal(scale: float, axes: tuple[str, ...]):
    return nn.with_logical_partitioning(nn.initializers.normal(scale), axes)


class Linear(nn.Module):
    """y = x @ W (+ b) for W [D_in, features] named `weight` and, where `bias` names one, b
    [features] (Qwen2's q/k/v) (`kernels.cpu_matmul.matmul`: eejax's own
    product for a few rows on a CPU, XLA's otherwise), plus LoRA's low-rank update
    x @ a @ b when the params carry `weight + "_a"` [D_in, r] and `weight + "_b"` [r, features]
    (training, before the update is merged). `accumulate`: accumulate in float32 and round once
    to x's dtype (bf16 weights: as cuBLAS does; Llama); otherwise x's dtype throughout (HF T5's
    products)."""

    weight: str
    features: int
    axes: tuple[str, str]
    init_scale: float = 0.02
    param_dtype: Dtype = jnp.float32
    accumulate: bool = True
    bias: str | None = None

    @nn.compact
    def __call__(self, x):
        w = held_weight(self, self.weight) or self.param(
            self.weight, normal(self.init_scale, self.axes), (x.shape[-1], self.features), self.param_dtype
        )
        y = matmul(x, w) if self.accumulate or x.dtype == jnp.float32 else x @ w
        if self.has_variable("params", self.weight + "_a"):
            a, b = (self.get_variable("params", self.weight + s) for s in ("_a", "_b"))
            y = y + (x @ a) @ b
        if self.bias is not None:
            init = nn.with_logical_partitioning(nn.initializers.zeros, self.axes[1:])
            y = y + self.param(self.bias, init, (self.features,), self.param_dtype).astype(y.dtype)
        return y.astype(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm (`common.rms_norm`) with its scale [D] named `weight`, initialised to ones."""

    weight: str
    eps: float
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param(
            self.weight, nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (x.shape[-1],), self.param_dtype
        )
        return rms_norm(x, scale, self.eps)


class Embedder(nn.Module):
    """The token embedding `embed` [V, D]; `attend` is the head tied to it."""

    vocab_size: int
    dim: int
    init_scale: float = 0.02
    param_dtype: Dtype = jnp.float32

    def setup(self):
        self.embed = held_weight(self, "embed") or self.param(
            "embed", normal(self.init_scale, ("vocab", "embed")), (self.vocab_size, self.dim), self.param_dtype
        )

    def __call__(self, tokens):
        """tokens [B, T] int32 -> hidden [B, T, D] (`kernels.cpu_matmul.take_rows`: a bf16 table
        on a CPU is read by eejax's row copy)."""
        return take_rows(self.embed, tokens)

    def attend(self, x, weight=None):
        """x [..., D] against the embedding's rows (or `weight` [K, D]): float32 [..., V or K].
        Contracts with the rows directly: `embed.T` would be copied."""
        w = self.embed if weight is None else weight
        return matmul_t(x, w)


class Unembed(nn.Module):
    """An untied LM head `lm_head` [D, V]: x [..., D] -> float32 [..., V]; `weight` [D, K]
    replaces it (a reduced head)."""

    vocab_size: int
    init_scale: float = 0.02
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, weight=None):
        w = held_weight(self, "lm_head") or self.param(
            "lm_head", normal(self.init_scale, ("embed", "vocab")), (x.shape[-1], self.vocab_size), self.param_dtype
        )
        return matmul(x, w if weight is None else weight)


def scan_layers(layer: nn.Module, h, *broadcast, length: int):
    """Runs `layer(h, *broadcast) -> h` once per stacked weight slice (a leading axis of
    `length`, logical axis `layers`): the no-cache forward, and how `init` creates the stack."""

    def body(module, h, *broadcast):
        return module(h, *broadcast), None

    scan = nn.scan(
        body,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=length,
        in_axes=nn.broadcast,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
    return scan(layer, h, *broadcast)[0]


def embed(params, tokens):
    """tokens [B, T] int32 -> hidden [B, T, D]: rows of params["embed"] [V, D] (`Embedder`),
    constrained to the logical axes (batch, -, embed)."""
    table = params["embed"]
    h = Embedder(*table.shape[-2:]).apply({"params": {"embed": table}}, tokens)
    # Rows are the `batch` axis: on a mesh with a data axis they split over it from here on
    # (a no-op without a mesh and rules in context: see `ProgramCache`).
    return nn.with_logical_constraint(h, ("batch", None, "embed"))


def unboxed_init(module: nn.Module, key, *args, **kwargs) -> dict:
    """`module.init(key, *args)`'s params as plain arrays (logical axis metadata dropped)."""
    return nn.unbox(module.init(key, *args, **kwargs)["params"])


def logical_axes(module: nn.Module, *args, **kwargs) -> dict:
    """The logical axis names of every param `module.init` creates, as a pytree of
    `PartitionSpec`s like the params (computed from shapes alone: nothing is initialised)."""
    boxed = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *args, **kwargs)["params"])
    return nn.get_partition_spec(boxed)
