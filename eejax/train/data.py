"""Training data for exits: the prompts followed by the model's own greedy continuations (what
decoding sees), cut into right-padded batches, and the positions each step trains on."""

from __future__ import annotations

import numpy as np

from eejax.cache import page_bytes, pages_needed
from eejax.errors import EejaxError
from eejax.train.exit_training import ExitBatch


def cache_budget_for(model, prompts: list[list[int]], new_tokens: int, batch_size: int, page_size: int = 16) -> int:
    """KV-cache bytes for `batch_size` of `prompts` decoding at once, each with `new_tokens` more,
    and never less than `generate`'s default of 1 GiB: the batch a trainer asks for is the batch it
    gets (1 GiB holds ~47 SmolLM2 rows of 480 tokens, so a GPU's batch of 512 would run ~47 at a time)."""
    config = model.config
    per_page = page_bytes(model.cache_layers, page_size, config.num_kv_heads, config.head_dim, model.dtype)
    longest = max(map(len, prompts)) + new_tokens
    return max(1 << 30, (1 + min(batch_size, len(prompts)) * pages_needed(longest, page_size)) * per_page)


def continued_sequences(
    model, prompts: list[list[int]], new_tokens: int, *, batch_size: int = 8, progress: bool = True
) -> list[list[int]]:
    """Each prompt (token ids) followed by `new_tokens` greedy full-depth tokens of the model (fewer
    when it ends at EOS), `batch_size` at once (`cache_budget_for`)."""
    from tqdm.auto import tqdm

    from eejax.engine.generate import generate

    if new_tokens < 0:
        raise EejaxError(f"new_tokens must be >= 0, got {new_tokens}")
    if new_tokens == 0:
        return [list(p) for p in prompts]
    sequences = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="generating continuations", disable=not progress):
        chunk = prompts[start : start + batch_size]
        budget = cache_budget_for(model, chunk, new_tokens, batch_size)
        res = generate(model, chunk, max_new_tokens=new_tokens, batch_size=batch_size, cache_budget=budget)
        sequences += [list(p) + list(t) for p, t in zip(chunk, res.tokens)]
    return sequences


def sequence_batches(sequences: list[list[int]], batch_size: int, max_len: int, pad_id: int = 0):
    """Sequences (cut to their first `max_len` tokens) grouped in order into right-padded
    (tokens [B, T] int32, lengths [B] int32) batches; the last batch may be smaller."""
    if batch_size < 1 or max_len < 2:
        raise EejaxError(f"batch_size must be >= 1 and max_len >= 2, got {batch_size} and {max_len}")
    rows = [s[:max_len] for s in sequences if len(s) >= 2]
    if not rows:
        raise EejaxError("no training sequence has 2 or more tokens")
    batches = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        t = max(map(len, chunk))
        tokens = np.full((len(chunk), t), pad_id, np.int32)
        for i, r in enumerate(chunk):
            tokens[i, : len(r)] = r
        batches.append((tokens, np.asarray([len(r) for r in chunk], np.int32)))
    return batches


def sample_positions(lengths: np.ndarray, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(positions [B, P], mask [B, P]): P = `count` distinct positions of each row drawn uniformly
    (all of a shorter row's positions, padded with position 0 masked out)."""
    positions = np.zeros((len(lengths), count), np.int32)
    mask = np.zeros((len(lengths), count), bool)
    for i, n in enumerate(lengths):
        n = int(n)
        pick = np.sort(rng.choice(n, size=count, replace=False)) if n > count else np.arange(n)
        positions[i, : len(pick)] = pick
        mask[i, : len(pick)] = True
    return positions, mask


def exit_batch(tokens, lengths, positions_per_row: int | None, rng: np.random.Generator) -> ExitBatch:
    """An ExitBatch over every position (None) or `positions_per_row` sampled ones."""
    if positions_per_row is None:
        t = tokens.shape[1]
        positions = np.broadcast_to(np.arange(t, dtype=np.int32), tokens.shape).copy()
        mask = positions < np.asarray(lengths)[:, None]
    else:
        positions, mask = sample_positions(np.asarray(lengths), positions_per_row, rng)
    return ExitBatch(tokens, lengths, positions, mask)
