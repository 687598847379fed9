"""Training data for exits: the prompts followed by the model's own greedy continuations (what
decoding sees), cut into right-padded batches, and the positions each step trains on. An
encoder-decoder's sequences are its decoder's inputs (the start token, then the continuation),
each batch carrying the prompts its encoder reads."""

from __future__ import annotations

import numpy as np

from eejax.cache import pages_needed
from eejax.errors import EejaxError
from eejax.models.registry import model_module
from eejax.train.exit_training import ExitBatch, SequenceBatch


def cache_budget_for(model, prompts: list[list[int]], new_tokens: int, batch_size: int, page_size: int = 16) -> int:
    """KV-cache bytes for `batch_size` of `prompts` decoding at once, each with `new_tokens` more,
    and never less than `generate`'s default of 1 GiB: the batch a trainer asks for is the batch it
    gets (1 GiB holds ~47 SmolLM2 rows of 480 tokens, so a GPU's batch of 512 would run ~47 at a time)."""
    per_page = model.page_bytes(page_size)
    longest = max(map(len, prompts)) + new_tokens
    return max(1 << 30, (1 + min(batch_size, len(prompts)) * pages_needed(longest, page_size)) * per_page)


def greedy_continuations(
    model, prompts: list[list[int]], new_tokens: int, *, batch_size: int = 8, progress: bool = True
) -> list[list[int]]:
    """`new_tokens` greedy full-depth tokens of the model after each prompt (token ids; fewer when
    it ends at EOS), `batch_size` prompts at once (`cache_budget_for`)."""
    from tqdm.auto import tqdm

    from eejax.engine.generate import generate

    if new_tokens < 0:
        raise EejaxError(f"new_tokens must be >= 0, got {new_tokens}")
    if new_tokens == 0:
        return [[] for _ in prompts]
    continuations = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="generating continuations", disable=not progress):
        chunk = prompts[start : start + batch_size]
        budget = cache_budget_for(model, chunk, new_tokens, batch_size)
        res = generate(model, chunk, max_new_tokens=new_tokens, batch_size=batch_size, cache_budget=budget, spec=None)
        continuations += [list(t) for t in res.tokens]
    return continuations


def continued_sequences(
    model, prompts: list[list[int]], new_tokens: int, *, batch_size: int = 8, progress: bool = True
) -> list[list[int]]:
    """Each prompt (token ids) followed by its `greedy_continuations`."""
    made = greedy_continuations(model, prompts, new_tokens, batch_size=batch_size, progress=progress)
    return [list(p) + t for p, t in zip(prompts, made)]


def training_batches(
    model, prompts: list[list[int]], new_tokens: int, batch_size: int, max_len: int, *, progress: bool = True
) -> list[SequenceBatch]:
    """Exit training's data: each prompt and the model's greedy continuation of it, in
    `sequence_batches` of `batch_size` (at most `max_len` tokens a row). A decoder-only model's
    row is the prompt then the continuation; an encoder-decoder's is its decoder's input (the
    start token, then the continuation) with the prompt as the context its encoder reads."""
    if not model_module(model.config).ENCODER_DECODER:
        return sequence_batches(continued_sequences(model, prompts, new_tokens, progress=progress), batch_size, max_len)
    if new_tokens < 1:
        raise EejaxError("an encoder-decoder's exits train on its decoder's tokens: continuation tokens must be >= 1")
    made = greedy_continuations(model, prompts, new_tokens, progress=progress)
    start = [model.config.decoder_start_token_id]
    return sequence_batches([start + t for t in made], batch_size, max_len, contexts=prompts)


def _padded(rows: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded (tokens [B, T] int32, lengths [B] int32) of token-id rows."""
    tokens = np.full((len(rows), max(map(len, rows))), pad_id, np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return tokens, np.asarray([len(r) for r in rows], np.int32)


def sequence_batches(
    sequences: list[list[int]], batch_size: int, max_len: int, pad_id: int = 0, contexts: list[list[int]] | None = None
) -> list[SequenceBatch]:
    """Sequences (cut to their first `max_len` tokens; those under 2 tokens dropped) grouped in
    order into right-padded `SequenceBatch`es; the last batch may be smaller. `contexts`: each
    sequence's encoder prompt (an encoder-decoder's), padded likewise into the batch's context."""
    if batch_size < 1 or max_len < 2:
        raise EejaxError(f"batch_size must be >= 1 and max_len >= 2, got {batch_size} and {max_len}")
    if contexts is not None and len(contexts) != len(sequences):
        raise EejaxError(f"{len(contexts)} contexts for {len(sequences)} sequences")
    kept = [i for i, s in enumerate(sequences) if len(s) >= 2]
    if not kept:
        raise EejaxError("no training sequence has 2 or more tokens")
    batches = []
    for start in range(0, len(kept), batch_size):
        chunk = kept[start : start + batch_size]
        tokens, lengths = _padded([sequences[i][:max_len] for i in chunk], pad_id)
        context = None if contexts is None else _padded([contexts[i] for i in chunk], pad_id)
        batches.append(SequenceBatch(tokens, lengths, context))
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


def exit_batch(batch: SequenceBatch, positions_per_row: int | None, rng: np.random.Generator) -> ExitBatch:
    """An ExitBatch over every position (None) or `positions_per_row` sampled ones."""
    tokens, lengths, context = SequenceBatch(*batch)
    if positions_per_row is None:
        t = tokens.shape[1]
        positions = np.broadcast_to(np.arange(t, dtype=np.int32), tokens.shape).copy()
        mask = positions < np.asarray(lengths)[:, None]
    else:
        positions, mask = sample_positions(np.asarray(lengths), positions_per_row, rng)
    return ExitBatch(tokens, lengths, positions, mask, context)
