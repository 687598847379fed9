"""Stage 1 of draft-head training: one pass of the frozen model over the training text, cached on
disk, so that every epoch after it trains only the draft head (a few million weights).

For each window of tokens [T] the cache keeps:

    tokens [T] int32          the text
    features [T, D] bf16      the model's feature at each position (the final norm's output)
    top_ids [T, K] int32      the model's K most likely next tokens at each position ...
    top_probs [T, K] f16      ... and their probabilities (the rest's mass is 1 - their sum)
    states [T, n, D] bf16     with `layers`: the hidden states after those layers (EAGLE-3's
                              low and middle features, `draft_head.fused_feature`)

Windows are written in shards of `shard_rows` (`shard_00000.npz`, ...), each atomically, so an
interrupted pass resumes at the first missing shard; `meta.json` records what the cache was
made of, and a rerun with other settings is refused rather than mixed in.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from eejax.errors import EejaxError
from eejax.models.draft_head import check_model
from eejax.models.draft_head import features as draft_features
from eejax.models.llama import Llama, forward_states

TOP_K = 16
PAD_STEP = 32  # a batch pads to a multiple of this: 84% of the tokens computed are real on chat answers (128: 56%)


def windows(sequences: list[list[int]], length: int) -> list[list[int]]:
    """Token sequences cut into windows of at most `length` tokens (a sequence's tail shorter
    than 16 tokens is dropped, unless it is the whole sequence and has at least 2)."""
    if length < 2:
        raise EejaxError(f"the window length must be >= 2 tokens, got {length}")
    out = []
    for seq in sequences:
        for start in range(0, len(seq), length):
            piece = list(seq[start : start + length])
            if len(piece) >= 16 or (start == 0 and len(piece) >= 2):
                out.append(piece)
    return out


def _features_program(config, layers: tuple[int, ...] = ()):
    """jit: tokens [B, T], lengths [B] -> (features [B, T, D] bf16, top ids [B, T, K], top probs
    [B, T, K] f16), and with `layers` the hidden states after them [B, T, n, D] bf16."""

    def run(params, tokens, lengths):
        model = Llama(config)
        if layers:
            states, _ = forward_states(params, tokens, lengths, config)
            feats = draft_features(params, states[-1], config)
        else:
            feats = model.apply({"params": params}, tokens, lengths, method="features")
        logits = model.apply({"params": params}, feats, method="head")
        probs, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), TOP_K)
        out = (feats.astype(jnp.bfloat16), ids.astype(jnp.int32), probs.astype(jnp.float16))
        if layers:
            out += (jnp.stack([states[i - 1] for i in layers], axis=2).astype(jnp.bfloat16),)
        return out

    return jax.jit(run)


def build_feature_cache(
    model,
    sequences: list[list[int]],
    out_dir: str | Path,
    *,
    window: int = 512,
    batch_size: int = 4,
    shard_rows: int = 32,
    source: str = "",
    progress: bool = True,
    deadline: float | None = None,
    layers: tuple[int, ...] = (),
) -> Path:
    """Writes (or completes) the feature cache of `sequences` (token ids) in `out_dir`. Returns it.
    `layers` (1-based, increasing): also keep the hidden states after those layers.
    With a `deadline` (a `time.monotonic()` value) it stops after the shard in progress once that
    has passed (one shard at least is written): `load_feature_cache` reads the shards written, and
    a rerun completes the rest."""
    from tqdm.auto import tqdm

    check_model(model.config)
    if batch_size < 1 or shard_rows < 1:
        raise EejaxError(f"shard_rows and batch_size must be >= 1, got {shard_rows} and {batch_size}")
    layers = tuple(int(i) for i in layers)
    if list(layers) != sorted(set(layers)) or not all(1 <= i <= model.config.num_layers for i in layers):
        raise EejaxError(f"layers must be increasing, each 1 to {model.config.num_layers}, got {list(layers)}")
    rows = windows(sequences, window)
    if not rows:
        raise EejaxError("no training text: every sequence is shorter than 2 tokens")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "window": window,
        "rows": len(rows),
        "shard_rows": shard_rows,
        "top_k": TOP_K,
        "hidden_size": model.config.hidden_size,
        "vocab_size": model.config.vocab_size,
        "tokens": int(sum(map(len, rows))),
        "source": source,
    } | ({"layers": list(layers)} if layers else {})
    meta_path = out / "meta.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if {k: old.get(k) for k in meta | old} != meta:
            raise EejaxError(f"{out} holds a feature cache of other text or settings; use another directory")
    else:
        _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
    program = _features_program(model.config, layers)
    shards = range(0, len(rows), shard_rows)
    todo = [s for s in shards if not (out / f"shard_{s // shard_rows:05d}.npz").exists()]
    bar = tqdm(total=meta["tokens"], unit="tok", desc="features", disable=not progress)
    bar.update(sum(len(r) for s in shards if s not in todo for r in rows[s : s + shard_rows]))
    for start in todo:
        if deadline is not None and start != todo[0] and time.monotonic() > deadline:
            break
        chunk = rows[start : start + shard_rows]
        tokens, lengths, feats, ids, probs, *states = _shard_features(program, model.params, chunk, window, batch_size)
        bar.update(int(lengths.sum()))
        path = out / f"shard_{start // shard_rows:05d}.npz"
        tmp = path.with_suffix(".tmp.npz")
        extra = {"states": states[0].view(np.uint16)} if states else {}
        np.savez(
            tmp, tokens=tokens, lengths=lengths, features=feats.view(np.uint16), top_ids=ids, top_probs=probs, **extra
        )
        os.replace(tmp, path)
    bar.close()
    return out


def _shard_features(program, params, rows: list[list[int]], window: int, batch_size: int):
    """(tokens [R, window], lengths [R], features [R, window, D], top ids, top probs[, states]) of
    `rows`, in their order. Rows run `batch_size` at a time in order of length, each batch padded only to the
    next multiple of PAD_STEP tokens (window / 4 if smaller) past its longest row (a program per width, each
    compiled once): short chat answers cost what they hold, not a whole window."""
    step = max(1, min(PAD_STEP, window // 4))
    order = np.argsort([len(r) for r in rows], kind="stable")
    tokens = np.zeros((len(rows), window), np.int32)
    lengths = np.asarray([len(r) for r in rows], np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    outputs = None
    for b in range(0, len(rows), batch_size):
        picked = order[b : b + batch_size]
        width = min(window, -(-int(lengths[picked].max()) // step) * step)
        batch = np.zeros((batch_size, width), np.int32)
        batch[: len(picked)] = tokens[picked, :width]
        got = jax.device_get(program(params, batch, np.pad(lengths[picked], (0, batch_size - len(picked)))))
        if outputs is None:
            outputs = [np.zeros((len(rows), window, *x.shape[2:]), x.dtype) for x in got]
        for full, x in zip(outputs, got):
            full[picked, :width] = x[: len(picked)]
    return (tokens, lengths, *outputs)


def load_feature_cache(path: str | Path) -> dict[str, np.ndarray]:
    """Every complete shard of a feature cache, concatenated: tokens [N, T], lengths [N],
    features [N, T, D] bf16, top_ids [N, T, K], top_probs [N, T, K], and states [N, T, n, D] bf16
    where the cache keeps layers' hidden states."""
    path = Path(path)
    files = sorted(path.glob("shard_*.npz"))
    files = [f for f in files if not f.name.endswith(".tmp.npz")]
    if not files:
        raise EejaxError(f"{path} holds no feature shards; build them first (eejax train-draft does)")
    parts = [dict(np.load(f)) for f in files]
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    for k in ("features", "states"):
        if k in out:
            out[k] = out[k].view(ml_dtypes.bfloat16)
    return out


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
