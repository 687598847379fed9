"""The reduced-vocabulary exit head (FR-Spec, Zhao et al. 2025, applied to early exit).

An exit check or a draft evaluates the LM head: V x D weights, on SmolLM2 as many as 8 of its
30 layers. Most of that vocabulary is rarely emitted, so exits use the head's rows of the K most
frequent tokens only. Frequencies are counted once over a corpus (by default the model's own
greedy continuations of some prompts: the tokens it actually emits) and the ids, with the head
rows gathered for them, are stored in the checkpoint's exits (`models.exits.set_exit_vocab`).
"""

from __future__ import annotations

import numpy as np

from eejax.errors import EejaxError
from eejax.models import exits

CORPORA = ("continuations", "prompts", "both")


def count_tokens(
    model,
    prompts: list[list[int]],
    *,
    corpus: str = "continuations",
    new_tokens: int = 64,
    batch_size: int = 8,
    progress: bool = True,
) -> np.ndarray:
    """Token counts [V] over `corpus`: the model's greedy `new_tokens` continuations of the
    prompts (token ids), the prompts themselves, or both."""
    from eejax.train.data import continued_sequences

    if corpus not in CORPORA:
        raise EejaxError(f"corpus must be one of {', '.join(CORPORA)}, got {corpus!r}")
    counts = np.zeros((model.config.vocab_size,), np.int64)
    if corpus != "prompts":
        if new_tokens < 1:
            raise EejaxError(f"counting continuations needs new_tokens >= 1, got {new_tokens}")
        sequences = continued_sequences(model, prompts, new_tokens, batch_size=batch_size, progress=progress)
        for p, s in zip(prompts, sequences):
            np.add.at(counts, np.asarray(s[len(p) :], np.int64), 1)
    if corpus != "continuations":
        for p in prompts:
            np.add.at(counts, np.asarray(p, np.int64), 1)
    return counts


def most_frequent(counts: np.ndarray, size: int, always=()) -> np.ndarray:
    """The `size` most frequent token ids of counts [V], increasing; ids in `always` (EOS) are
    kept whatever their count, and ties (tokens never seen included) go to the lower id (for a
    BPE vocabulary, the earlier merge)."""
    vocab = counts.shape[0]
    if not 1 <= size <= vocab:
        raise EejaxError(f"the reduced vocabulary size must lie in [1, {vocab}] (the model's vocabulary), got {size}")
    keys = counts.astype(np.float64).copy()
    keys[[i for i in always if 0 <= i < vocab]] = np.inf
    order = np.lexsort((np.arange(vocab), -keys))  # by count, descending; then by id
    return np.sort(order[:size])


def add_exit_vocab(model, ids):
    """A copy of `model` with the reduced exit head of token `ids` (replacing any it had)."""
    params = exits.set_exit_vocab(model.params, ids, model.config.tie_embeddings)
    return model.with_params(params)
