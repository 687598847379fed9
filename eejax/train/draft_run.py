"""A whole draft-head training run (what `eejax train-draft` does), resumable in one directory:

    OUTPUT/run.json              the settings and data it was started with (a rerun must match)
    OUTPUT/continuations.json    the model's greedy continuations of summary prompts of the texts
    OUTPUT/features/             the feature cache (`draft_features`)
    OUTPUT/checkpoints/          orbax checkpoints of the training (`draft_training`)
    OUTPUT/draft.safetensors     the shipped delta: the draft head, the reduced head's token ids,
                                 and a probe's logits to check it against at load (`apply_draft`)
    OUTPUT/model/                the eejax checkpoint of the model with its draft head
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from eejax.errors import EejaxError
from eejax.models import draft_head

PROBE_TEXT = "The city council met on Tuesday to discuss the new budget. Summary:"
KIND = "eejax-draft-head"


@dataclasses.dataclass(frozen=True)
class DraftRunSettings:
    """How a draft head is trained (see `draft_training.train_draft` for the optimisation ones)."""

    steps: int = 3000
    batch_size: int = 8
    learning_rate: float = 1e-3
    noise: float = 0.1
    feature_weight: float = 0.1
    unroll: int = 2
    seed: int = 0
    window: int = 512
    continuation_tokens: int = 96
    prompt_tokens: tuple[int, ...] = (128, 256, 384)
    window_prompts: bool = True
    sampled_copies: int = 2
    vocab_size: int = 8192

    def check(self, vocab: int) -> None:
        if not 1 <= self.vocab_size <= vocab:
            raise EejaxError(f"the draft's reduced head must hold 1 to {vocab} tokens, got {self.vocab_size}")
        if self.continuation_tokens < 0 or not self.prompt_tokens or min(self.prompt_tokens) < 1:
            raise EejaxError("continuation tokens must be >= 0 and prompt lengths >= 1")

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


def training_data(model, texts: list[str], other_texts: list[str], out: Path, settings: DraftRunSettings,
                  progress: bool = True) -> dict:
    """The feature cache of the model's continuations (`draft_corpus`: greedy ones of summary
    prompts of `texts` and of windows of `other_texts`, sampled ones of the summary prompts), then
    the `texts` and `other_texts` themselves. Built once in `out`, then loaded."""
    from eejax.train import draft_corpus as dc
    from eejax.train.draft_features import build_feature_cache, load_feature_cache

    tok, n = model.tokenizer, settings.continuation_tokens
    generated, parts = [], []
    if n:
        summary = dc.summary_prompts(tok, texts, settings.prompt_tokens)
        generated += dc.continuations(model, summary, out / "continuations.json", new_tokens=n, progress=progress)
        parts.append(f"{len(summary)} summary prompts")
        if settings.window_prompts:
            later = dc.window_summary_prompts(tok, texts)
            generated += dc.continuations(model, later, out / "continuations_windows.json", new_tokens=n,
                                          progress=progress)
            windows = dc.text_prompts(tok, other_texts)
            generated += dc.continuations(model, windows, out / "continuations_texts.json", new_tokens=n,
                                          progress=progress)
            parts.append(f"{len(later)} later-window summary prompts, {len(windows)} document windows")
        if settings.sampled_copies:
            first = dc.summary_prompts(tok, texts, (256,)) * settings.sampled_copies
            generated += dc.sampled_continuations(model, first, out / "continuations_sampled.json", new_tokens=n)
            parts.append(f"{len(first)} sampled (T=0.7)")
    human = [tok(t)["input_ids"] for t in texts + other_texts]
    cache = build_feature_cache(model, generated + human, out / "features", window=settings.window,
                                source=f"continuations ({n} tokens) of {', '.join(parts) or 'none'}; "
                                f"{len(texts)} + {len(other_texts)} texts", progress=progress)
    return load_feature_cache(cache)


def draft_vocabulary(data: dict, size: int, vocab: int, always=()) -> np.ndarray:
    """The `size` most frequent tokens of the training text and of the model's top-1 next tokens
    on it (the tokens the draft must propose), increasing."""
    from eejax.train.exit_vocab import most_frequent

    counts = np.zeros(vocab, np.int64)
    valid = np.arange(data["tokens"].shape[1])[None, :] < data["lengths"][:, None]
    np.add.at(counts, data["tokens"][valid], 1)
    np.add.at(counts, data["top_ids"][..., 0][valid], 1)
    return most_frequent(counts, size, always=always)


def probe_logits(model, text: str = PROBE_TEXT) -> tuple[list[int], np.ndarray]:
    """(token ids of `text`, the draft head's logits [V] for the token after the model's next
    one), computed densely: a fingerprint of base model and draft that a shipped delta records."""
    from eejax.models.llama import Llama
    from eejax.models.modules import embed

    ids = model.tokenizer(text)["input_ids"]
    params = {k: v for k, v in model.params.items() if k not in ("draft", "exits")}
    tokens, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32)
    feats = Llama(model.config).apply({"params": params}, tokens, lengths, method="features")
    nxt = jnp.argmax(Llama(model.config).apply({"params": params}, feats[:, -1], method="head"), axis=-1)
    following = jnp.concatenate([tokens[:, 1:], nxt[:, None].astype(jnp.int32)], axis=1)
    out = draft_head.dense_forward(model.config, model.params["draft"], feats, embed(params, following), lengths)
    return ids, np.asarray(draft_head.draft_logits(model.params, out[0, -1], model.config, reduced=False))


def save_draft(path: str | Path, model, vocab_ids, metadata: dict) -> Path:
    """Writes `model`'s draft head (bf16) and the reduced head's ids as safetensors, with the
    probe's top-20 logits and `metadata` under the "eejax" key; atomically."""
    from safetensors.numpy import save_file

    import ml_dtypes

    path = Path(path)
    flat = {"draft/fc": model.params["draft"]["fc"]}
    flat |= {f"draft/layer/{k}": v for k, v in model.params["draft"]["layer"].items()}
    arrays = {k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16) for k, v in flat.items()}
    arrays["vocab_ids"] = np.asarray(vocab_ids, np.int32)
    shipped = apply_arrays(model, arrays)
    ids, logits = probe_logits(shipped)
    top = np.argsort(-logits)[:20]
    meta = {"kind": KIND, **metadata, "probe_ids": ids, "probe_top_ids": top.tolist(),
            "probe_top_logits": logits[top].tolist()}
    tmp = path.with_name(path.name + ".partial")
    save_file(arrays, str(tmp), metadata={"eejax": json.dumps(meta)})
    tmp.replace(path)
    return path


def apply_arrays(model, arrays: dict):
    """`model` with the draft head and reduced head of a delta's arrays (cast to the model's dtype)."""
    from eejax.models.exits import set_exit_vocab

    dtype = model.dtype
    draft = {"fc": jnp.asarray(np.asarray(arrays["draft/fc"], np.float32), dtype),
             "layer": {k.split("/")[-1]: jnp.asarray(np.asarray(v, np.float32), dtype)
                       for k, v in arrays.items() if k.startswith("draft/layer/")}}
    draft_head.check_draft(draft, model.config)
    params = set_exit_vocab({**model.params, "draft": draft}, arrays["vocab_ids"], model.config.tie_embeddings)
    return model.with_params(params)


def apply_draft(model, path: str | Path, *, check: bool = True):
    """`model` with the draft head of a delta written by `save_draft`; with `check`, the probe's
    logits must come out as recorded (a named error otherwise: another base model, or damage)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta = json.loads((f.metadata() or {}).get("eejax", "{}"))
        arrays = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("kind") != KIND:
        raise EejaxError(f"{path} is not an eejax draft head (kind {meta.get('kind')!r})")
    trained = apply_arrays(model, arrays)
    if check:
        from eejax.train.runs import check_probe

        check_probe(path, meta, *probe_logits(trained), tolerance=1e-3)
    return trained


def is_draft_delta(path: str | Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return json.loads((f.metadata() or {}).get("eejax", "{}")).get("kind") == KIND

