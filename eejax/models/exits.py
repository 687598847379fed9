"""Per-layer exit modules: an adapter before the shared exit head, and an exit classifier.

Optional entries of `params["exits"]`, each stacked on a leading L axis; index l belongs to the
exit after l + 1 layers. The last index is never used: full depth runs the model's own head.

    adapter_norm [L, D], adapter_down [L, D, R], adapter_up [L, R, D]:
        h -> h + (rms_norm(h) * adapter_norm) @ adapter_down @ adapter_up   (R = D is a full map)
    classifier_w [L, D], classifier_b [L]:
        P(exit) = sigmoid(rms_normalise(h) . classifier_w + classifier_b)

The model's final norm and LM head are shared by all exits (LayerSkip, CALM). Functions take the
whole `exits` dict (or None) and a possibly traced index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eejax.errors import EejaxError

ADAPTER_KEYS = ("adapter_norm", "adapter_down", "adapter_up")
CLASSIFIER_KEYS = ("classifier_w", "classifier_b")
EPS = 1e-6


def has_adapters(exits) -> bool:
    return bool(exits) and "adapter_up" in exits


def has_classifier(exits) -> bool:
    return bool(exits) and "classifier_w" in exits


def init_exits(num_layers: int, hidden: int, key, *, adapter_rank: int = 0, classifier: bool = True,
               dtype=jnp.float32) -> dict:
    """Deterministic untrained exits: adapters are the identity (adapter_up = 0, adapter_down
    normal with std D^-1/2 from `key`), classifiers give P(exit) = 0.5 everywhere."""
    if adapter_rank < 0 or adapter_rank > hidden:
        raise EejaxError(f"adapter_rank must be in [0, {hidden}] (0 = no adapters), got {adapter_rank}")
    if not adapter_rank and not classifier:
        raise EejaxError("init_exits: nothing to add (adapter_rank is 0 and classifier is False)")
    exits = {}
    if adapter_rank:
        down = jax.random.normal(key, (num_layers, hidden, adapter_rank), jnp.float32) * hidden**-0.5
        exits["adapter_norm"] = jnp.ones((num_layers, hidden), dtype)
        exits["adapter_down"] = down.astype(dtype)
        exits["adapter_up"] = jnp.zeros((num_layers, adapter_rank, hidden), dtype)
    if classifier:
        exits["classifier_w"] = jnp.zeros((num_layers, hidden), dtype)
        exits["classifier_b"] = jnp.zeros((num_layers,), dtype)
    return exits


def check_exits(exits, num_layers: int, hidden: int) -> None:
    """Raises EejaxError naming the first entry whose shape does not fit the model."""
    if not exits:
        return
    unknown = set(exits) - set(ADAPTER_KEYS) - set(CLASSIFIER_KEYS)
    if unknown:
        raise EejaxError(f"unknown entries in params['exits']: {sorted(unknown)}")
    for group in (ADAPTER_KEYS, CLASSIFIER_KEYS):
        present = [k for k in group if k in exits]
        if present and len(present) != len(group):
            raise EejaxError(f"params['exits'] has {present} but not all of {list(group)}")
    rank = exits["adapter_down"].shape[-1] if has_adapters(exits) else 0
    want = {
        "adapter_norm": (num_layers, hidden), "adapter_down": (num_layers, hidden, rank),
        "adapter_up": (num_layers, rank, hidden), "classifier_w": (num_layers, hidden),
        "classifier_b": (num_layers,),
    }
    for name, x in exits.items():
        if tuple(x.shape) != want[name]:
            raise EejaxError(f"params['exits'][{name!r}] has shape {tuple(x.shape)}, the model needs {want[name]}")


def _normalise(h):
    hf = h.astype(jnp.float32)
    return hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + EPS)


def adapt(exits, h, index):
    """The adapter of exit `index` applied to hidden states h [..., D]; identity without adapters."""
    if not has_adapters(exits):
        return h
    pick = lambda k: jax.lax.dynamic_index_in_dim(exits[k], index, keepdims=False)  # noqa: E731
    x = (_normalise(h) * pick("adapter_norm").astype(jnp.float32)).astype(h.dtype)
    return h + (x @ pick("adapter_down")) @ pick("adapter_up")


def classifier_prob(exits, h, index):
    """P(exit) [...] float32 of exit `index` for hidden states h [..., D]."""
    w = jax.lax.dynamic_index_in_dim(exits["classifier_w"], index, keepdims=False)
    b = jax.lax.dynamic_index_in_dim(exits["classifier_b"], index, keepdims=False)
    return jax.nn.sigmoid(_normalise(h) @ w.astype(jnp.float32) + b.astype(jnp.float32))
