"""Deltas a shipped model is built from at load: a base model's params plus a small safetensors file.

- A LayerSkip delta (`eejax train-layerskip`): LoRA factors (merged into the layer weights), the
  trained exits as the default check layers, the reduced exit head's token ids.
- A draft head (`eejax train-draft`, metadata kind `DRAFT_KIND`): the head's weights (bf16) and
  the reduced head's token ids.

Each records a probe: a fixed text's largest logits (full depth for LayerSkip, the draft head's
for a draft head) when it was trained. Applying it recomputes them, so a delta applied to another
base model, or a damaged one, is a named error instead of wrong text. Training writes deltas
(`eejax.train`); loading only reads them, so it needs nothing of the trainer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eejax.decode.programs import float32_matmuls
from eejax.errors import EejaxError
from eejax.models import draft_head, llama
from eejax.models.exits import set_exit_vocab
from eejax.models.lora import TARGETS, merge_lora
from eejax.models.modules import embed

DRAFT_KIND = "eejax-draft-head"
PROBE_TEXT = "The early-exit model read the news and wrote:"
DRAFT_PROBE_TEXT = "The city council met on Tuesday to discuss the new budget. Summary:"


def read_delta(path) -> tuple[dict, dict]:
    """(arrays as numpy, the JSON metadata under the "eejax" key) of a delta file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta = json.loads((f.metadata() or {}).get("eejax", "{}"))
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def write_delta(path, arrays: dict, metadata: dict) -> Path:
    """Writes `arrays` as safetensors with `metadata` as JSON under the "eejax" key, atomically
    (a temporary name, then renamed)."""
    from safetensors.numpy import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    save_file({k: np.asarray(v) for k, v in arrays.items()}, str(tmp), metadata={"eejax": json.dumps(metadata)})
    tmp.replace(path)
    return path


def save_delta(path, factors: dict, extra: dict | None = None, metadata: dict | None = None) -> None:
    """Writes LoRA factors (and `extra` arrays, e.g. the exit vocabulary) with `metadata`."""
    write_delta(path, {**factors, **(extra or {})}, metadata or {})


def load_delta(path) -> tuple[dict, dict, dict]:
    """(LoRA factors, other arrays, metadata) of a delta written by `save_delta`."""
    arrays, metadata = read_delta(path)
    factors = {k: v for k, v in arrays.items() if k.rsplit("_", 1)[0] in TARGETS and k[-2:] in ("_a", "_b")}
    return factors, {k: v for k, v in arrays.items() if k not in factors}, metadata


def is_draft_delta(path) -> bool:
    return read_delta(path)[1].get("kind") == DRAFT_KIND


def apply_delta(model, path, *, check: bool = True):
    """`model` with the delta at `path` applied, a LayerSkip delta or a draft head (by its kind)."""
    return (apply_draft if is_draft_delta(path) else apply_lora_delta)(model, path, check=check)


def apply_lora_delta(model, path, *, check: bool = True):
    """`model` with a LayerSkip delta applied: the factors merged, the trained exits as the default
    check layers and the reduced exit head it names. With `check`, the probe's logits must come out
    as recorded (within 1e-4 of the largest)."""
    factors, extra, meta = load_delta(path)
    params = merge_lora({k: v for k, v in model.params.items() if k != "exits"}, factors)
    exit_layers = (meta.get("settings") or {}).get("layerskip", {}).get("exit_layers")
    if exit_layers:
        params["exits"] = {"exit_layers": jnp.asarray(exit_layers, jnp.int32)}
    if "exit_vocab_ids" in extra:
        params = set_exit_vocab(params, extra["exit_vocab_ids"], model.config.tie_embeddings)
    trained = model.with_params(params)
    if check and "probe_top_ids" in meta:
        check_probe(path, meta, *probe_logits(trained), tolerance=1e-4)
    return trained


def apply_draft(model, path, *, check: bool = True):
    """`model` with the draft head of a delta written by `eejax train-draft`; with `check`, the
    probe's draft logits must come out as recorded (within 1e-3 of the largest)."""
    arrays, meta = read_delta(path)
    if meta.get("kind") != DRAFT_KIND:
        raise EejaxError(f"{path} is not an eejax draft head (kind {meta.get('kind')!r})")
    trained = apply_draft_arrays(model, arrays)
    if check:
        check_probe(path, meta, *draft_probe_logits(trained), tolerance=1e-3)
    return trained


def apply_draft_arrays(model, arrays: dict):
    """`model` with the draft head and reduced head of a delta's arrays ("draft/fc",
    "draft/layer/NAME", "vocab_ids"), cast to the model's dtype."""
    dtype = model.dtype
    draft = {
        "fc": jnp.asarray(np.asarray(arrays["draft/fc"], np.float32), dtype),
        "layer": {
            k.split("/")[-1]: jnp.asarray(np.asarray(v, np.float32), dtype)
            for k, v in arrays.items()
            if k.startswith("draft/layer/")
        },
    }
    draft_head.check_draft(draft, model.config)
    params = set_exit_vocab({**model.params, "draft": draft}, arrays["vocab_ids"], model.config.tie_embeddings)
    return model.with_params(params)


def probe_logits(model, text: str = PROBE_TEXT) -> tuple[list[int], np.ndarray]:
    """(token ids of `text`, full-depth logits [V] after its last token): the fingerprint of the
    model a LayerSkip delta records."""
    ids = model.tokenizer(text)["input_ids"]
    tokens, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32)
    with float32_matmuls():
        return ids, np.asarray(_full_depth_probe(model.params, tokens, lengths, config=model.config))


def draft_probe_logits(model, text: str = DRAFT_PROBE_TEXT) -> tuple[list[int], np.ndarray]:
    """(token ids of `text`, the draft head's logits [V] for the token after the model's next
    one), computed densely: the fingerprint of base model and draft head a draft delta records."""
    ids = model.tokenizer(text)["input_ids"]
    tokens, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32)
    with float32_matmuls():
        return ids, np.asarray(_draft_probe(model.params, tokens, lengths, config=model.config))


# The probes run once per delta applied, as one program each (op by op they took ~3x longer: 5.5 s
# for SmolLM2's draft probe on a 2-core CPU, against 1.9 s compiled and run).
@functools.partial(jax.jit, static_argnames="config")
def _full_depth_probe(params, tokens, lengths, config):
    states, _ = llama.forward_states(params, tokens, lengths, config)
    return llama.lm_head(params, states[-1, 0, -1], config)


@functools.partial(jax.jit, static_argnames="config")
def _draft_probe(all_params, tokens, lengths, config):
    params = {k: v for k, v in all_params.items() if k not in ("draft", "exits")}
    module = llama.Llama(config)
    feats = module.apply({"params": params}, tokens, lengths, method="features")
    nxt = jnp.argmax(module.apply({"params": params}, feats[:, -1], method="head"), axis=-1)
    following = jnp.concatenate([tokens[:, 1:], nxt[:, None].astype(jnp.int32)], axis=1)
    out = draft_head.dense_forward(config, all_params["draft"], feats, embed(params, following), lengths)
    return draft_head.draft_logits(all_params, out[0, -1], config, reduced=False)


def probe_record(ids: list[int], logits: np.ndarray, top: int) -> dict:
    """The metadata that records a probe: its token ids and its `top` largest logits with their ids."""
    best = np.argsort(-logits)[:top]
    return {"probe_ids": ids, "probe_top_ids": best.tolist(), "probe_top_logits": logits[best].tolist()}


def check_probe(path, meta: dict, ids: list[int], logits: np.ndarray, tolerance: float) -> None:
    """EejaxError unless the probe's logits (`ids` its tokens, logits [V]) reproduce those the
    delta at `path` recorded (`meta`, see `probe_record`) within `tolerance` x the largest."""
    want = np.asarray(meta["probe_top_logits"], np.float32)
    got = logits[np.asarray(meta["probe_top_ids"])]
    if ids != meta["probe_ids"] or not np.allclose(got, want, rtol=0, atol=tolerance * np.abs(want).max()):
        raise EejaxError(
            f"the delta {path} does not reproduce the logits recorded when it was trained "
            f"(largest difference {np.abs(got - want).max():.3g}): is the base model "
            f"{meta.get('base')!r}?"
        )
