"""Turning what a user passes to `generate` into token-id lists, with clear errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from eejax.errors import EejaxError


def prompt_token_ids(tokenizer, batch: Any) -> tuple[list[list[int]], list[str | None]]:
    """Token ids and texts (None when given ids) of each prompt.

    `batch` is a list of strings, a tokenizer output (dict with `input_ids` and optionally
    `attention_mask`, left or right padded), a pair `(ids [B, T], lengths [B])` of right-padded
    ids, or a list of token-id lists.
    """
    if isinstance(batch, str):
        batch = [batch]
    if hasattr(batch, "keys") and "input_ids" in batch:
        ids = np.asarray(batch["input_ids"])
        if ids.ndim == 1:
            ids = ids[None]
        mask = np.asarray(batch.get("attention_mask", np.ones_like(ids))).reshape(ids.shape)
        rows = [[int(t) for t, m in zip(r, mr) if m] for r, mr in zip(ids, mask)]
        return _checked(rows), [None] * len(rows)
    if isinstance(batch, tuple) and len(batch) == 2 and not isinstance(batch[0], str):
        ids, lengths = np.asarray(batch[0]), np.asarray(batch[1])
        if ids.ndim != 2 or lengths.shape != (ids.shape[0],):
            raise EejaxError(f"expected (ids [B, T], lengths [B]); got shapes {ids.shape} and {lengths.shape}")
        if (lengths < 0).any() or (lengths > ids.shape[1]).any():
            raise EejaxError(f"lengths must lie in [0, {ids.shape[1]}], got {lengths.tolist()}")
        return _checked([ids[i, :n].tolist() for i, n in enumerate(lengths)]), [None] * len(lengths)
    if not isinstance(batch, Sequence):
        raise EejaxError(f"cannot use a {type(batch).__name__} as a batch of prompts")
    if len(batch) == 0:
        raise EejaxError("no prompts given")
    if all(isinstance(p, str) for p in batch):
        if tokenizer is None:
            raise EejaxError("this model has no tokenizer; pass token ids instead of strings")
        for i, p in enumerate(batch):
            if not p:
                raise EejaxError(f"prompt {i} is empty")
        rows = [list(tokenizer(p)["input_ids"]) for p in batch]
        return _checked(rows), list(batch)
    if all(isinstance(p, (list, tuple, np.ndarray)) for p in batch):
        return _checked([[int(t) for t in p] for p in batch]), [None] * len(batch)
    raise EejaxError("a batch must be strings, token-id lists, a tokenizer output or (ids, lengths)")


def _checked(rows: list[list[int]]) -> list[list[int]]:
    if not rows:
        raise EejaxError("no prompts given")
    for i, r in enumerate(rows):
        if not r:
            raise EejaxError(f"prompt {i} has no tokens")
    return rows


def validate_lengths(rows, max_new_tokens: int, context: int, vocab_size: int) -> None:
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise EejaxError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    for i, r in enumerate(rows):
        if len(r) + max_new_tokens > context:
            raise EejaxError(
                f"prompt {i} has {len(r)} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                f"the model's context of {context} tokens"
            )
        bad = [t for t in r if not 0 <= t < vocab_size]
        if bad:
            raise EejaxError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
