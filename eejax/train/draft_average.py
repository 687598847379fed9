"""A weighted average of draft heads' weights (a "model soup"): heads trained from one another on
different data often sit in one basin, where the average keeps what each gained (the chat head
of 2026-12-01 is the mean of two runs, the later of which drafted news worse: the mean drafts
every evaluation set at least as well as the earlier run; docs/models.md). The reduced head's
tokens are one head's, named; the average is written as `train-draft` writes a head, with a new
probe."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eejax.errors import EejaxError
from eejax.loading.deltas import DRAFT_KIND, apply_draft_arrays, read_delta


def average_arrays(heads: list[dict], weights: list[float]) -> dict:
    """The weighted mean of each draft array of `heads` (delta arrays: "draft/fc",
    "draft/layer/NAME"; "vocab_ids" left out), float32; the weights must be >= 0 and sum to 1."""
    if len(heads) != len(weights) or len(heads) < 2:
        raise EejaxError(f"average at least two heads with one weight each, got {len(heads)} and {len(weights)}")
    if min(weights) < 0 or not np.isclose(sum(weights), 1.0):
        raise EejaxError(f"the weights must be >= 0 and sum to 1, got {weights}")
    names = sorted(k for k in heads[0] if k != "vocab_ids")
    for i, head in enumerate(heads[1:], 1):
        other = sorted(k for k in head if k != "vocab_ids")
        if other != names or any(head[k].shape != heads[0][k].shape for k in names):
            raise EejaxError(f"head {i + 1} has other arrays or shapes than head 1: not the same draft head's shape")
    return {k: sum(w * np.asarray(h[k], np.float32) for h, w in zip(heads, weights)) for k in names}


def average_draft_heads(model, paths: list, weights: list[float], vocab_from: int, output) -> Path:
    """Writes to `output` the weighted average of the draft head deltas at `paths` on `model` (the
    base they were trained on), with the reduced head's tokens of `paths[vocab_from]`; its
    metadata records the heads and weights. Returns the path written."""
    from eejax.train.draft_run import save_draft

    deltas = [read_delta(p) for p in paths]
    for path, (_, meta) in zip(paths, deltas):
        if meta.get("kind") != DRAFT_KIND:
            raise EejaxError(f"{path} is not an eejax draft head (kind {meta.get('kind')!r})")
    if not 0 <= vocab_from < len(paths):
        raise EejaxError(f"vocab_from must name one of the {len(paths)} heads (0-based), got {vocab_from}")
    arrays = average_arrays([a for a, _ in deltas], weights)
    vocab_ids = deltas[vocab_from][0]["vocab_ids"]
    averaged = apply_draft_arrays(model, arrays | {"vocab_ids": vocab_ids})
    source = {"average_of": [str(p) for p in paths], "weights": list(weights), "vocab_from": str(paths[vocab_from])}
    return save_draft(output, averaged, vocab_ids, source)
