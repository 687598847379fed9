"""Per-layer exit modules (Flax): an adapter before the shared exit head, and an exit classifier.

Optional entries of `params["exits"]`, each stacked on a leading L axis; index l belongs to the
exit after l + 1 layers. The last index is never used: full depth runs the model's own head.

    adapter_norm [L, D], adapter_down [L, D, R], adapter_up [L, R, D]:
        h -> h + (rms_norm(h) * adapter_norm) @ adapter_down @ adapter_up   (R = D is a full map)
    classifier_w [L, D], classifier_b [L]:
        P(exit) = sigmoid(rms_normalise(h) . classifier_w + classifier_b)

The model's final norm and LM head are shared by all exits (LayerSkip, CALM). Functions take the
whole `exits` dict (or None) and a possibly traced index.

Entries that are not per layer:

    vocab_ids [K] int32, vocab_head: the reduced-vocabulary exit head (FR-Spec): the K most
        frequent token ids, increasing, and the head's rows for them in the head's own layout
        ([K, D] when tied to the embedding, [D, K] for an `lm_head`); see `set_exit_vocab`.
    exit_layers [n] int32: the exits the checkpoint was trained at (layers run): the default
        check points of early exit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from eejax.errors import EejaxError
from eejax.models import modules
from eejax.models.common import row_sum
from eejax.models.modules import share_scope, unboxed_init
from eejax.quantized import is_quantized, rows_at, tile, untile

ADAPTER_KEYS = ("adapter_norm", "adapter_down", "adapter_up")
CLASSIFIER_KEYS = ("classifier_w", "classifier_b")
VOCAB_KEYS = ("vocab_ids", "vocab_head")
EPS = 1e-6


def has_adapters(exits) -> bool:
    return bool(exits) and "adapter_up" in exits


def has_classifier(exits) -> bool:
    return bool(exits) and "classifier_w" in exits


def has_reduced_head(exits) -> bool:
    return bool(exits) and "vocab_ids" in exits


def trained_layers(exits) -> tuple[int, ...] | None:
    """The exits the checkpoint was trained at (layers run), if it records them."""
    if not exits or "exit_layers" not in exits:
        return None
    return tuple(int(e) for e in np.asarray(exits["exit_layers"]))


def head_weight(params, tied: bool):
    """The LM head's weight in its own layout: embed [V, D] when tied, lm_head [D, V]."""
    return params["embed"] if tied else params["lm_head"]


def set_exit_vocab(params, ids, tied: bool) -> dict:
    """A copy of `params` whose exits hold the reduced head of token `ids` [K] (any order; kept
    increasing): `vocab_ids` and the head's rows for them (see the module docstring)."""
    ids = np.unique(np.asarray(ids, np.int64))
    head = head_weight(params, tied)
    vocab = head.shape[0] if tied else head.shape[1]
    if ids.size == 0 or ids[0] < 0 or ids[-1] >= vocab:
        raise EejaxError(
            f"reduced vocabulary ids must lie in [0, {vocab}) and be at least one, "
            f"got {ids.size} ids in [{ids.min(initial=0)}, {ids.max(initial=0)}]"
        )
    rows = jnp.asarray(ids, jnp.int32)
    gathered = head_rows(head, rows, tied)
    return {**params, "exits": {**(params.get("exits") or {}), "vocab_ids": rows, "vocab_head": gathered}}


def head_rows(head, rows, tied: bool):
    """The head's weights for tokens `rows` in its own layout ([K, D] tied, [D, K] untied); a
    quantized head gives its blocks for them (its rows are tokens either way), in tiles where the
    head is in tiles and they fill whole tiles."""
    if is_quantized(head):
        picked = rows_at(head, rows)
        return tile(picked) if head.tiled else picked
    return head[rows] if tied else head[:, rows]


def check_reduced_head(params, tied: bool) -> None:
    """Raises EejaxError when the stored reduced head is not the head's rows for its ids (the
    head changed after `eejax exit-vocab`: run it again)."""
    e = params.get("exits")
    if not has_reduced_head(e):
        return
    want, have = head_rows(head_weight(params, tied), e["vocab_ids"], tied), e["vocab_head"]
    if is_quantized(want) and is_quantized(have):  # tiled or not, the same rows
        want, have = untile(want), untile(have)
    same = jax.tree.structure(want) == jax.tree.structure(have) and all(
        bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(have), strict=True)
    )
    if not same:
        raise EejaxError(
            "the reduced exit head does not match the model's head rows for its vocabulary ids "
            "(the head changed since eejax exit-vocab ran): run eejax exit-vocab again"
        )


class ExitAdapter(nn.Module):
    """One exit's adapter (Flax): h [..., D] -> h + (rms_normalise(h) * adapter_norm) @ adapter_down
    @ adapter_up. Initialised as the identity: adapter_up = 0, adapter_down normal(0, D^-1/2)."""

    rank: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, h):
        d = h.shape[-1]
        norm = self.param("adapter_norm", _init(nn.initializers.ones, ("norm",)), (d,), self.param_dtype)
        down = self.param(
            "adapter_down",
            _init(nn.initializers.normal(d**-0.5), ("embed", "adapter")),
            (d, self.rank),
            self.param_dtype,
        )
        up = self.param(
            "adapter_up", _init(nn.initializers.zeros, ("adapter", "embed")), (self.rank, d), self.param_dtype
        )
        x = (_normalise(h) * norm.astype(jnp.float32)).astype(h.dtype)
        return h + (x @ down) @ up


class ExitClassifier(nn.Module):
    """One exit's classifier (Flax): P(exit) = sigmoid(rms_normalise(h) . classifier_w + classifier_b),
    h [..., D] -> float32 [...]. Initialised to zeros: P(exit) = 0.5 everywhere."""

    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, h):
        w = self.param("classifier_w", _init(nn.initializers.zeros, ("embed",)), (h.shape[-1],), self.param_dtype)
        b = self.param("classifier_b", _init(nn.initializers.zeros, ()), (), self.param_dtype)
        return jax.nn.sigmoid(_normalise(h) @ w.astype(jnp.float32) + b.astype(jnp.float32))


class Exits(nn.Module):
    """Every layer's exit modules (Flax), stacked on a leading axis (logical axis `layers`):
    `init` creates `params["exits"]`' per-layer entries in the layout of the module docstring."""

    num_layers: int
    adapter_rank: int = 0
    classifier: bool = True
    param_dtype: Any = jnp.float32

    def setup(self):
        stack = functools.partial(
            nn.vmap,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=None,
            axis_size=self.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        self.adapters = stack(ExitAdapter)(self.adapter_rank, self.param_dtype) if self.adapter_rank else None
        self.classifiers = stack(ExitClassifier)(self.param_dtype) if self.classifier else None
        share_scope(self, *(m for m in (self.adapters, self.classifiers) if m is not None))

    def __call__(self, h):
        """Every exit applied to h [..., D]: (adapted [L, ..., D] or None, P(exit) [L, ...] or None)."""
        return (
            self.adapters(h) if self.adapters is not None else None,
            self.classifiers(h) if self.classifiers is not None else None,
        )


def _init(initializer, axes):
    return nn.with_logical_partitioning(initializer, axes)


def init_exits(
    num_layers: int, hidden: int, key, *, adapter_rank: int = 0, classifier: bool = True, dtype=jnp.float32
) -> dict:
    """Deterministic untrained exits (`Exits.init` from `key`): adapters are the identity,
    classifiers give P(exit) = 0.5 everywhere."""
    if adapter_rank < 0 or adapter_rank > hidden:
        raise EejaxError(f"adapter_rank must be in [0, {hidden}] (0 = no adapters), got {adapter_rank}")
    if not adapter_rank and not classifier:
        raise EejaxError("init_exits: nothing to add (adapter_rank is 0 and classifier is False)")
    module = Exits(num_layers, adapter_rank, classifier, dtype)
    return jax.jit(lambda key: unboxed_init(module, key, jnp.zeros((1, hidden), dtype)))(key)


def logical_axes(exits, tied: bool) -> dict:
    """The logical axis names of every entry of `exits` (PartitionSpecs, same keys): the exit
    modules' own, and the reduced head's in the head's layout."""
    specs = {}
    if has_adapters(exits) or has_classifier(exits):
        first = exits["adapter_norm"] if has_adapters(exits) else exits["classifier_w"]  # [L, D]
        rank = exits["adapter_down"].shape[-1] if has_adapters(exits) else 0
        module = Exits(first.shape[0], rank, has_classifier(exits))
        specs = modules.logical_axes(module, jnp.zeros((1, first.shape[1])))
    if has_reduced_head(exits):
        specs["vocab_ids"] = P("vocab")
        specs["vocab_head"] = P("vocab", "embed") if tied else P("embed", "vocab")
    if "exit_layers" in exits:
        specs["exit_layers"] = P(None)
    return specs


def check_exits(exits, config) -> None:
    """Raises EejaxError naming the first entry that does not fit the model `config`."""
    if not exits:
        return
    num_layers, hidden, vocab = config.num_layers, config.hidden_size, config.vocab_size
    unknown = set(exits) - set(ADAPTER_KEYS) - set(CLASSIFIER_KEYS) - set(VOCAB_KEYS) - {"exit_layers"}
    if unknown:
        raise EejaxError(f"unknown entries in params['exits']: {sorted(unknown)}")
    if "exit_layers" in exits:
        layers = np.asarray(exits["exit_layers"])
        if layers.ndim != 1 or not np.all((layers >= 1) & (layers < num_layers)) or np.any(np.diff(layers) <= 0):
            raise EejaxError(
                "params['exits']['exit_layers'] must be increasing layer counts in "
                f"[1, {num_layers - 1}], got {layers.tolist()}"
            )
    if has_reduced_head(exits) or "vocab_head" in exits:
        if set(VOCAB_KEYS) - set(exits):
            raise EejaxError(f"params['exits'] needs both {list(VOCAB_KEYS)} for a reduced head")
        ids = exits["vocab_ids"]
        k = ids.shape[0] if ids.ndim == 1 else -1
        if not 1 <= k <= vocab or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise EejaxError(
                f"params['exits']['vocab_ids'] must be 1 to {vocab} integer ids, got shape "
                f"{tuple(ids.shape)} {ids.dtype}"
            )
        values = np.asarray(ids)
        if values[0] < 0 or values[-1] >= vocab or np.any(np.diff(values) <= 0):
            raise EejaxError(f"params['exits']['vocab_ids'] must be increasing token ids in [0, {vocab})")
        shape = (k, hidden) if config.tie_embeddings else (hidden, k)
        if tuple(exits["vocab_head"].shape) != shape:
            raise EejaxError(
                f"params['exits']['vocab_head'] has shape {tuple(exits['vocab_head'].shape)}, "
                f"the model's head needs {shape} for {k} ids"
            )
    for group in (ADAPTER_KEYS, CLASSIFIER_KEYS):
        present = [k for k in group if k in exits]
        if present and len(present) != len(group):
            raise EejaxError(f"params['exits'] has {present} but not all of {list(group)}")
    rank = exits["adapter_down"].shape[-1] if has_adapters(exits) else 0
    want = {
        "adapter_norm": (num_layers, hidden),
        "adapter_down": (num_layers, hidden, rank),
        "adapter_up": (num_layers, rank, hidden),
        "classifier_w": (num_layers, hidden),
        "classifier_b": (num_layers,),
    }
    for name, x in exits.items():
        if name in want and tuple(x.shape) != want[name]:
            raise EejaxError(f"params['exits'][{name!r}] has shape {tuple(x.shape)}, the model needs {want[name]}")


def resolve_options(params, config, exit=None, spec=None):  # noqa: A002
    """Checks an early-exit `ExitConfig` and a speculation `SpecConfig` against this model (its
    exit modules included; EejaxError for what it cannot honour) and returns them, the exit's
    check layers made explicit from the checkpoint's trained exits when it asks for the default."""
    e = params.get("exits")
    check_exits(e, config)
    if exit is not None:
        exit.check_model(config.num_layers, has_classifier(e), has_reduced_head(e))
        trained = trained_layers(e)
        if (
            trained
            and exit.exit_layers is None
            and exit.checks_confidence
            and exit.measure != "static"
            and (exit.min_exit_layer, exit.every) == (1, 1)
        ):
            exit = dataclasses.replace(exit, exit_layers=trained)  # noqa: A001
    if spec is not None:
        spec.check_model(config.num_layers, has_reduced_head(e), bool(params.get("draft")))
    return exit, spec


def _normalise(h):
    hf = h.astype(jnp.float32)
    return hf * jax.lax.rsqrt(row_sum(hf * hf)[..., None] / hf.shape[-1] + EPS)


def adapt(exits, h, index):
    """The adapter of exit `index` applied to hidden states h [..., D]; identity without adapters."""
    if not has_adapters(exits):
        return h
    lp = {k: jax.lax.dynamic_index_in_dim(exits[k], index, keepdims=False) for k in ADAPTER_KEYS}
    return ExitAdapter(lp["adapter_down"].shape[-1]).apply({"params": lp}, h)


def classifier_prob(exits, h, index):
    """P(exit) [...] float32 of exit `index` for hidden states h [..., D]."""
    lp = {k: jax.lax.dynamic_index_in_dim(exits[k], index, keepdims=False) for k in CLASSIFIER_KEYS}
    return ExitClassifier().apply({"params": lp}, h)
