"""Prompt lookup (`decode.lookup.propose`) against a plain-Python search of each row's history."""

import jax.numpy as jnp
import numpy as np

from eejax.decode.lookup import NGRAM_MAX, NGRAM_MIN, PromptTokens, propose


def searched(history: list[int], d: int, short: int | None = None) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix (NGRAM_MAX down to
    NGRAM_MIN tokens) that occurred before, at most d (at most `short` after a shorter suffix)."""
    for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
        suffix = history[len(history) - n :]
        for start in range(len(history) - n - 1, -1, -1):
            if len(suffix) == n and history[start : start + n] == suffix:
                most = d if short is None or n == NGRAM_MAX else min(d, short)
                return history[start + n : start + n + most]
    return []


def proposed(prompts, generated, d, width=12, new=8, short=None):
    tokens = np.zeros((len(prompts), width), np.int32)
    out = np.zeros((len(prompts), new), np.int32)
    for i, (p, g) in enumerate(zip(prompts, generated)):
        tokens[i, : len(p)], out[i, : len(g)] = p, g
    drafts, count = propose(
        PromptTokens(jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)),
        jnp.asarray(out),
        jnp.asarray([len(g) for g in generated], jnp.int32),
        d,
        short,
    )
    return [list(row[:n]) for row, n in zip(np.asarray(drafts), np.asarray(count))], np.asarray(drafts)


def test_lookup_finds_the_longest_latest_match_across_prompt_and_output():
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 3, rng.integers(0, 13))) for _ in range(200)]
    generated = [list(rng.integers(0, 3, rng.integers(0, 9))) for _ in range(200)]
    for d, short in ((1, None), (4, None), (7, 2)):
        got, drafts = proposed(prompts, generated, d, short=short)
        assert got == [searched(p + g, d, short) for p, g in zip(prompts, generated)]
        counts = np.array([len(g) for g in got])
        assert not drafts[np.arange(d)[None] >= counts[:, None]].any()  # 0 past a row's count
        if d == 4:  # rows of every kind: no match, a match near the end (fewer than d), d drafts
            assert {0, 1, 2, 3, 4} <= set(counts)
    # long copies only after a whole NGRAM_MAX match; a shorter match's capped at `short`
    assert {0, 1, 2} <= set(counts) and counts.max() > 2 and len(set(counts)) > 3


def test_lookup_prefers_a_longer_match_then_a_later_one():
    longer, _ = proposed([[4, 1, 2, 5, 6, 3, 1, 2, 8, 9]], [[4, 1, 2]], 3)  # "4 1 2" at 0; "1 2" at 6 too
    later, _ = proposed([[1, 2, 5, 0, 1, 2, 6]], [[1, 2]], 3)  # "1 2" at 0 and 4
    unique, _ = proposed([[1, 2, 3]], [[4, 5]], 3)
    assert (longer, later, unique) == ([[5, 6, 3]], [[6, 1, 2]], [[]])
