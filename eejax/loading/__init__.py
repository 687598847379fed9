"""Loading: the `Model` handle (config, params, tokenizer, compiled programs, placement), known
models fetched and converted once (`hub`), and the deltas a shipped model applies at load."""

from eejax.loading.hub import load
from eejax.loading.model import Model, init_exits, save, shard

__all__ = ["Model", "init_exits", "load", "save", "shard"]
