"""A whole draft-head training run (what `eejax train-draft` does), resumable in one directory:

OUTPUT/run.json              the settings and data it was started with (a rerun must match)
OUTPUT/continuations.json    the model's greedy continuations of summary prompts of the texts
OUTPUT/self_questions.json   questions the model wrote itself (`chat_corpus.self_questions`)
OUTPUT/answers*.json         its greedy and sampled answers to the chat questions
OUTPUT/features/             the feature cache (`draft_features`)
OUTPUT/checkpoints/          orbax checkpoints of the training (`draft_training`)
OUTPUT/draft.safetensors     the shipped delta: the draft head, the reduced head's token ids,
                             and a probe's logits to check it against at load (`eejax.loading.deltas.apply_draft`)
OUTPUT/model/                the eejax checkpoint of the model with its draft head
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from eejax.errors import EejaxError

SAMPLED_PROMPTS = ("summary", "all")


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
    sampled_prompts: str = "summary"  # "summary": the 256-token summary prompts; "all": every continued prompt
    vocab_size: int = 8192
    self_questions: int = 0  # user questions sampled from the model's chat template (Magpie), then answered
    answer_tokens: int = 160  # tokens of each answer to a chat question (greedy; it may end sooner)
    answer_samples: int = 1  # sampled answers (T=0.7) per chat question, besides the greedy one

    def check(self, vocab: int) -> None:
        if not 1 <= self.vocab_size <= vocab:
            raise EejaxError(f"the draft's reduced head must hold 1 to {vocab} tokens, got {self.vocab_size}")
        if self.continuation_tokens < 0 or not self.prompt_tokens or min(self.prompt_tokens) < 1:
            raise EejaxError("continuation tokens must be >= 0 and prompt lengths >= 1")
        if self.self_questions < 0 or self.answer_tokens < 1 or self.answer_samples < 0:
            raise EejaxError("self questions and answer samples must be >= 0, answer tokens >= 1")
        if self.sampled_prompts not in SAMPLED_PROMPTS:
            raise EejaxError(f"sampled prompts must be one of {SAMPLED_PROMPTS}, got {self.sampled_prompts!r}")

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


def training_data(
    model,
    texts: list[str],
    other_texts: list[str],
    out: Path,
    settings: DraftRunSettings,
    progress: bool = True,
    *,
    generate_batch_size: int = 32,
    feature_batch_size: int = 4,
    questions: list[str] = (),
    sequences: list[list[int]] = (),
) -> dict:
    """The feature cache of the model's continuations (`draft_corpus`: greedy ones of summary
    prompts of `texts` and of windows of `other_texts`, sampled ones of the 256-token summary
    prompts or of all of those), its answers to chat `questions` and to questions it wrote itself
    (`chat_corpus`), `sequences` the model wrote beforehand (`token_sequences`), then the `texts`
    and `other_texts` themselves. Built once in `out`, then loaded. The batch sizes set the speed
    only (a GPU takes far larger ones)."""
    from eejax.train import draft_corpus as dc
    from eejax.train.draft_features import build_feature_cache, load_feature_cache

    tok, n = model.tokenizer, settings.continuation_tokens
    generated, parts, greedy_prompts = [], [], []
    generated += chat_answers(model, list(questions), out, settings, parts, progress, generate_batch_size)
    if sequences:
        generated += [list(s) for s in sequences]
        parts.append(f"{len(sequences)} sequences made beforehand")
    continued = dict(new_tokens=n, progress=progress, batch_size=generate_batch_size)
    if n:
        summary = dc.summary_prompts(tok, texts, settings.prompt_tokens)
        generated += dc.continuations(model, summary, out / "continuations.json", **continued)
        greedy_prompts += summary
        parts.append(f"{len(summary)} summary prompts")
        if settings.window_prompts:
            later = dc.window_summary_prompts(tok, texts)
            generated += dc.continuations(model, later, out / "continuations_windows.json", **continued)
            windows = dc.text_prompts(tok, other_texts)
            generated += dc.continuations(model, windows, out / "continuations_texts.json", **continued)
            greedy_prompts += later + windows
            parts.append(f"{len(later)} later-window summary prompts, {len(windows)} document windows")
        first = dc.summary_prompts(tok, texts, (256,)) if settings.sampled_prompts == "summary" else greedy_prompts
        first = first * settings.sampled_copies
        if first:
            generated += dc.sampled_continuations(
                model,
                first,
                out / "continuations_sampled.json",
                new_tokens=n,
                batch_size=generate_batch_size,
                progress=progress,
            )
            parts.append(f"{len(first)} sampled (T=0.7)")
    human = [tok(t)["input_ids"] for t in texts + other_texts]
    cache = build_feature_cache(
        model,
        generated + human,
        out / "features",
        window=settings.window,
        batch_size=feature_batch_size,
        shard_rows=max(32, feature_batch_size),
        source=f"continuations ({n} tokens) of {', '.join(parts) or 'none'}; {len(texts)} + {len(other_texts)} texts",
        progress=progress,
    )
    return load_feature_cache(cache)


def chat_answers(model, questions: list[str], out: Path, settings: DraftRunSettings, parts: list, progress, batch):
    """The model's greedy answers (and `answer_samples` sampled ones each) to `questions` and to
    `settings.self_questions` questions it writes itself, as chat-template token sequences; what
    they were is appended to `parts`."""
    from eejax.train import chat_corpus as cc
    from eejax.train import draft_corpus as dc

    if settings.self_questions:
        own = cc.self_questions(model, settings.self_questions, out / "self_questions.json", batch_size=2 * batch)
        parts.append(f"{len(own)} questions the model wrote (of {settings.self_questions} sampled)")
        questions = questions + own
    if not questions:
        return []
    prompts = [cc.chat_prompt(model.tokenizer, q) for q in questions]
    n = settings.answer_tokens
    answers = dc.continuations(model, prompts, out / "answers.json", new_tokens=n, batch_size=batch, progress=progress)
    parts.append(f"greedy answers ({n} tokens) to {len(prompts)} chat questions")
    if settings.answer_samples:
        again = prompts * settings.answer_samples
        answers += dc.sampled_continuations(
            model, again, out / "answers_sampled.json", new_tokens=n, batch_size=batch, progress=progress
        )
        parts.append(f"{len(again)} sampled answers (T=0.7)")
    return answers


def draft_vocabulary(data: dict, size: int, vocab: int, always=()) -> np.ndarray:
    """The `size` most frequent tokens of the training text and of the model's top-1 next tokens
    on it (the tokens the draft must propose), increasing."""
    from eejax.train.exit_vocab import most_frequent

    counts = np.zeros(vocab, np.int64)
    valid = np.arange(data["tokens"].shape[1])[None, :] < data["lengths"][:, None]
    np.add.at(counts, data["tokens"][valid], 1)
    np.add.at(counts, data["top_ids"][..., 0][valid], 1)
    return most_frequent(counts, size, always=always)


def save_draft(path: str | Path, model, vocab_ids, metadata: dict) -> Path:
    """Writes `model`'s draft head (bf16) and the reduced head's ids as safetensors, with the
    probe's top-20 logits and `metadata` under the "eejax" key; atomically."""
    import ml_dtypes

    from eejax.loading.deltas import DRAFT_KIND, apply_draft_arrays, draft_probe_logits, probe_record, write_delta

    path = Path(path)
    flat = {"draft/fc": model.params["draft"]["fc"]}
    flat |= {f"draft/layer/{k}": v for k, v in model.params["draft"]["layer"].items()}
    arrays = {k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16) for k, v in flat.items()}
    arrays["vocab_ids"] = np.asarray(vocab_ids, np.int32)
    probe = probe_record(*draft_probe_logits(apply_draft_arrays(model, arrays)), top=20)
    return write_delta(path, arrays, {"kind": DRAFT_KIND, **metadata, **probe})
