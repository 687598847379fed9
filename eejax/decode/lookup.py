"""Prompt lookup drafting (`draft:d:lookup`): where a row's last tokens occurred before in its
prompt or its output, the tokens that followed them there are its drafts. A summary copies
phrases of its article, code repeats its identifiers: such drafts cost no model pass, and the
draft head drafts the rows that have no match (`feature_draft.draft`). Pure functions on device.

A match is the latest earlier occurrence of the row's last n tokens, for the longest n in
[NGRAM_MIN, NGRAM_MAX] that has one (the n-gram sizes of the prompt-lookup and vLLM n-gram
proposers; on CNN/DM summaries 2..4 drafted best, docs/models.md). It drafts the up to k tokens that
followed it, fewer where the history ends first.

Long copies. A match of all NGRAM_MAX tokens goes on far more often than a shorter one: on the
full-depth greedy summaries of CNN/DM rows 0..7, a copy of up to 7 tokens after a 4-token match
was taken 5.3 tokens deep on average (14 of 21 matches whole), after a 2-token match 1.3; on
Python's docs 5.1 against 1.3. Where each position a round scores costs (a CPU), `short` caps the
copy of a shorter match at the head's chain (d), so only long matches pay for a longer round.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NGRAM_MIN, NGRAM_MAX = 2, 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptTokens:
    """Each row's prompt: tokens [B, W] int32 (left-aligned; with a preempted row, the tokens it
    had generated before too) and lengths [B] int32."""

    tokens: jax.Array
    lengths: jax.Array


def history(prompt: PromptTokens, generated, num_generated):
    """A row's tokens so far, its prompt then its generated ones (generated [B, N],
    num_generated [B]): (sequence [B, W + N] int32, -1 past its end, lengths [B])."""
    w, n = prompt.tokens.shape[1], generated.shape[1]
    j = jnp.arange(w + n, dtype=jnp.int32)[None]
    plen = prompt.lengths[:, None]
    source = jnp.where(j < plen, j, w + j - plen)  # index into [prompt | generated]
    both = jnp.concatenate([prompt.tokens, generated], axis=1)
    total = plen + num_generated[:, None]
    seq = jnp.take_along_axis(both, jnp.clip(source, 0, w + n - 1), axis=1)
    return jnp.where(j < total, seq, -1), total[:, 0]


def propose(prompt: PromptTokens, generated, num_generated, k: int, short: int | None = None):
    """Up to k drafts per row from its own history (see the module docstring), at most `short`
    where its match is shorter than NGRAM_MAX tokens: (drafts [B, k] int32, 0 past a row's count;
    count [B] int32, 0 where the row has no match)."""
    seq, total = history(prompt, generated, num_generated)
    b, width = seq.shape
    last = total - 1  # the row's newest token
    ends = jnp.arange(width, dtype=jnp.int32)[None]
    run = jnp.zeros((b, width), jnp.int32)  # matched tokens ending at each position, up to NGRAM_MAX
    matching = jnp.ones((b, width), bool)
    for i in range(NGRAM_MAX):
        earlier = jnp.pad(seq, ((0, 0), (i, 0)), constant_values=-1)[:, :width]  # seq[e - i]
        tail = jnp.where(last >= i, jnp.take_along_axis(seq, jnp.maximum(last - i, 0)[:, None], axis=1)[:, 0], -2)
        matching &= (earlier == tail[:, None]) & (earlier >= 0)
        run += matching
    candidate = (ends < last[:, None]) & (run >= NGRAM_MIN)  # a token follows the match
    score = jnp.where(candidate, run * width + ends, -1)  # the longest match, then the latest
    best = jnp.argmax(score, axis=1).astype(jnp.int32)
    most = jnp.full_like(best, k)
    if short is not None:
        matched = jnp.take_along_axis(run, best[:, None], axis=1)[:, 0]
        most = jnp.where(matched >= NGRAM_MAX, k, min(short, k))
    count = jnp.where(jnp.max(score, axis=1) >= 0, jnp.minimum(most, last - best), 0)
    offsets = jnp.arange(k, dtype=jnp.int32)[None]
    drafts = jnp.take_along_axis(seq, jnp.minimum(best[:, None] + 1 + offsets, width - 1), axis=1)
    return jnp.where(offsets < count[:, None], drafts, 0), count
