"""LoRA on a Llama's stacked layer weights: low-rank factors trained unmerged, merged at load.

A factor pair of projection `name` (one of `TARGETS`) lives in the layer params next to it:
`name + "_a"` [L, D_in, r] (random, scaled by 1/sqrt(D_in)) and `name + "_b"` [L, r, D_out] (zeros, so an
untrained LoRA changes nothing). The layer computes x @ W + (x @ a) @ b (`llama.linear`); merging
adds a @ b to W, so the merged model's logits equal the unmerged forward's up to float rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from eejax.errors import EejaxError

TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def init_lora(layers: dict, rank: int, key) -> dict:
    """Factors for every target of the stacked `layers` (the params' "layers" dict)."""
    if rank < 1:
        raise EejaxError(f"the LoRA rank must be >= 1, got {rank}")
    factors = {}
    for name, k in zip(TARGETS, jax.random.split(key, len(TARGETS))):
        w = layers[name]
        n, d_in, d_out = w.shape
        if rank > min(d_in, d_out):
            raise EejaxError(f"the LoRA rank {rank} exceeds {name}'s smaller side {min(d_in, d_out)}")
        factors[name + "_a"] = (jax.random.normal(k, (n, d_in, rank), jnp.float32) / np.sqrt(d_in)).astype(w.dtype)
        factors[name + "_b"] = jnp.zeros((n, rank, d_out), w.dtype)
    return factors


def lora_rank(factors: dict) -> int:
    return int(factors[TARGETS[0] + "_a"].shape[-1])


def check_lora(factors: dict, layers: dict) -> None:
    """A named error unless `factors` hold an a/b pair of matching shapes for every target."""
    for name in TARGETS:
        a, b = factors.get(name + "_a"), factors.get(name + "_b")
        if a is None or b is None:
            raise EejaxError(f"the LoRA delta lacks {name}_a / {name}_b")
        n, d_in, d_out = layers[name].shape
        if a.shape[:2] != (n, d_in) or b.shape[0] != n or b.shape[2] != d_out or a.shape[2] != b.shape[1]:
            raise EejaxError(f"the LoRA factors of {name} ({a.shape} x {b.shape}) do not fit its weight "
                             f"{layers[name].shape}")


@jax.jit
def _merged(w, a, b):
    return (w.astype(jnp.float32) + jnp.einsum("ldr,lro->ldo", a.astype(jnp.float32),
                                               b.astype(jnp.float32))).astype(w.dtype)


def merge_lora(params: dict, factors: dict) -> dict:
    """params with W + a @ b for every target (computed in float32, stored in W's dtype)."""
    check_lora(factors, params["layers"])
    layers = dict(params["layers"])
    for name in TARGETS:
        layers[name] = _merged(layers[name], factors[name + "_a"], factors[name + "_b"])
    return {**params, "layers": layers}


def with_lora(params: dict, factors: dict) -> dict:
    """params whose layers also carry the unmerged factors (the training forward)."""
    return {**params, "layers": {**params["layers"], **factors}}


def save_delta(path, factors: dict, extra: dict | None = None, metadata: dict | None = None) -> None:
    """Writes the factors (and `extra` arrays, e.g. the exit vocabulary) as safetensors, with
    `metadata` as JSON under the "eejax" key; written to a temporary name, then renamed."""
    import json
    from pathlib import Path

    from safetensors.numpy import save_file

    path = Path(path)
    arrays = {k: np.asarray(v) for k, v in {**factors, **(extra or {})}.items()}
    tmp = path.with_name(path.name + ".partial")
    save_file(arrays, str(tmp), metadata={"eejax": json.dumps(metadata or {})})
    tmp.replace(path)


def load_delta(path) -> tuple[dict, dict, dict]:
    """(factors, other arrays, metadata) of a delta written by `save_delta`."""
    import json

    from safetensors import safe_open

    factors, extra = {}, {}
    with safe_open(str(path), framework="numpy") as f:
        metadata = json.loads((f.metadata() or {}).get("eejax", "{}"))
        for k in f.keys():
            (factors if k.rsplit("_", 1)[0] in TARGETS and k[-2:] in ("_a", "_b") else extra)[k] = f.get_tensor(k)
    return factors, extra, metadata


def apply_delta(model, path, *, check: bool = True):
    """`model` with a LayerSkip delta (`layerskip_run.export_run`) applied: the factors merged,
    the trained exits as the default check layers and the reduced exit head it names. With
    `check`, the probe's logits recorded at training time must come out again (within 1e-4 of
    the largest): a named error otherwise (a different base model, or a damaged delta)."""
    from eejax.models.exits import set_exit_vocab

    factors, extra, meta = load_delta(path)
    params = merge_lora({k: v for k, v in model.params.items() if k != "exits"}, factors)
    exit_layers = (meta.get("settings") or {}).get("layerskip", {}).get("exit_layers")
    if exit_layers:
        params["exits"] = {"exit_layers": jnp.asarray(exit_layers, jnp.int32)}
    if "exit_vocab_ids" in extra:
        params = set_exit_vocab(params, extra["exit_vocab_ids"], model.config.tie_embeddings)
    trained = model.with_params(params)
    if check and "probe_top_ids" in meta:
        from eejax.train.layerskip_run import probe_logits
        from eejax.train.runs import check_probe

        check_probe(path, meta, *probe_logits(trained), tolerance=1e-4)
    return trained
