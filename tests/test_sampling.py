"""Torch-free unit tests of sampling: top-k / top-p filtering against numpy, greedy rows, draws
that stay inside each row's filtered set, per-row keys independent of the batch, option checks,
penalties (off: the logits unchanged; a round's positions: as if emitted one by one)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eejax.decode.sampling import (
    FILTERED,
    GREEDY,
    TEMPERATURE,
    RowSampling,
    SamplingParams,
    filtered_logits,
    logprobs_of,
    row_keys,
    sample,
    seed_key,
    token_keys,
)
from eejax.errors import EejaxError

ROWS = [
    SamplingParams(0.7, 5, 1.0),
    SamplingParams(1.3, 0, 0.6),
    SamplingParams(1.0, 3, 0.5),
    SamplingParams(0.0, 0, 1.0),
    SamplingParams(2.0, 0, 1.0),
]


def numpy_kept(logits, p: SamplingParams) -> np.ndarray:
    """The tokens a row may draw: its top-k, then the smallest prefix of those whose
    probability mass reaches top_p (the most likely token always stays)."""
    scaled = logits / (p.temperature or 1.0)
    order = np.argsort(-scaled, kind="stable")
    k = p.top_k or len(logits)
    top = order[:k]
    probs = np.exp(scaled[top] - scaled[top].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    return np.sort(top[before < p.top_p])


def test_filtered_logits_keep_each_rows_top_k_and_top_p_set():
    logits = np.random.default_rng(0).normal(size=(len(ROWS), 40)).astype(np.float32) * 2
    got = np.asarray(filtered_logits(jnp.asarray(logits), RowSampling.of(ROWS), FILTERED))
    for row, p in enumerate(ROWS):
        kept = np.flatnonzero(np.isfinite(got[row]))
        if p.greedy:
            continue  # a greedy row draws nothing
        np.testing.assert_array_equal(kept, numpy_kept(logits[row], p))
        np.testing.assert_allclose(got[row, kept], logits[row, kept] / p.temperature, rtol=1e-6)
    scaled = np.asarray(filtered_logits(jnp.asarray(logits), RowSampling.of(ROWS), TEMPERATURE))
    assert np.isfinite(scaled).all()  # the temperature sampler filters nothing


def test_the_filtered_sampler_without_a_filtering_row_gives_the_scaled_logits():
    """Every prefill takes the filtered sampler; on a CPU it skips its sort when no row's top-k or
    top-p is on: the same values as the temperature sampler, and a row that filters still does."""
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(3, 40)).astype(np.float32))
    plain = RowSampling.of([SamplingParams(0.0, 0, 1.0), SamplingParams(0.8, 0, 1.0), SamplingParams(1.5, 0, 1.0)])
    filtered = jax.jit(filtered_logits, static_argnums=2)
    np.testing.assert_array_equal(filtered(logits, plain, FILTERED), filtered_logits(logits, plain, TEMPERATURE))
    one = dataclasses.replace(plain, top_k=np.asarray([0, 3, 0], np.int32))
    assert np.isfinite(np.asarray(filtered(logits, one, FILTERED))[1]).sum() == 3


def test_draws_stay_in_the_filtered_set_and_greedy_rows_take_the_argmax():
    logits = np.random.default_rng(1).normal(size=(len(ROWS), 40)).astype(np.float32) * 2
    rows = RowSampling.of(ROWS)
    keys = row_keys(seed_key(7), np.arange(len(ROWS)))
    seen = [set() for _ in ROWS]
    for t in range(200):
        drawn = np.asarray(sample(jnp.asarray(logits), token_keys(keys, jnp.full((len(ROWS),), t), 0), rows, FILTERED))
        for row, token in enumerate(drawn):
            seen[row].add(int(token))
    for row, p in enumerate(ROWS):
        if p.greedy:
            assert seen[row] == {int(np.argmax(logits[row]))}
        else:
            kept = set(numpy_kept(logits[row], p).tolist())
            assert seen[row] <= kept and (len(seen[row]) > 1 or len(kept) == 1)  # drawn, within the set
    greedy = np.asarray(sample(jnp.asarray(logits), keys, rows, GREEDY))
    np.testing.assert_array_equal(greedy, np.argmax(logits, axis=-1))


def test_logprobs_are_the_distribution_drawn_from():
    logits = np.random.default_rng(2).normal(size=(len(ROWS), 40)).astype(np.float32)
    got = np.asarray(logprobs_of(jnp.asarray(logits), RowSampling.of(ROWS), FILTERED))
    np.testing.assert_allclose(np.exp(got).sum(-1), 1.0, rtol=1e-5)
    model = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(got[3], model[3], rtol=1e-6)  # greedy: the model's own softmax
    assert np.isinf(got[2]).sum() == 40 - len(numpy_kept(logits[2], ROWS[2]))


def test_a_rows_key_does_not_depend_on_the_batch():
    key = seed_key(123)
    alone = np.asarray(row_keys(key, [5]))[0]
    in_batch = np.asarray(row_keys(key, [2, 9, 5]))[2]
    np.testing.assert_array_equal(alone, in_batch)
    assert not np.array_equal(np.asarray(seed_key(1)), np.asarray(seed_key(1 + 2**32)))  # all 64 bits count


def test_sampling_options_are_checked_and_pick_their_sampler():
    assert SamplingParams().sampler == GREEDY and SamplingParams(0.8, top_k=1).sampler == GREEDY
    assert SamplingParams(0.8).sampler == TEMPERATURE
    assert SamplingParams(0.8, top_p=0.9).sampler == FILTERED and SamplingParams(0.8, top_k=4).sampler == FILTERED
    for bad, match in [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(top_k=2.5), "top_k must be an integer"),
        (dict(temperature="hot"), "temperature must be a number"),
    ]:
        with pytest.raises(EejaxError, match=match):
            SamplingParams(**bad)
    default = SamplingParams(0.7)
    assert default.override(top_p=None, top_k=3) == SamplingParams(0.7, top_k=3) and default.override() is default
    with pytest.raises(EejaxError, match="unknown option 'temprature'; the sampling options are temperature, top_k"):
        default.override(temprature=0.5)
    with pytest.raises(EejaxError, match="vocabulary size 40"):
        SamplingParams(1.0, top_k=41).check_vocab(40)


def test_penalties_off_change_nothing_and_positions_count_the_drafts_before_them():
    from eejax.decode.penalties import TokenCounts, apply_penalties, apply_to_positions, count_tokens

    rng = np.random.default_rng(0)
    vocab, rows = (
        12,
        [SamplingParams(), SamplingParams(0.7, presence_penalty=0.5, frequency_penalty=-0.3, repetition_penalty=1.7)],
    )
    logits = jnp.asarray(rng.normal(size=(2, 3, vocab)) * 3, jnp.float32)
    sampling = jax.tree.map(jnp.asarray, RowSampling.of(rows))
    counts = jax.tree.map(jnp.asarray, TokenCounts.of([[1, 2, 2], [3, 4]], [[5, 5, 1], [3, 6, 6, 6]], vocab, 2))
    assert SamplingParams(0.7).penalized is False and rows[1].penalized
    off = apply_penalties(logits[:, 0], sampling, counts)
    assert np.array_equal(np.asarray(off[0]), np.asarray(logits[0, 0]))  # bit for bit
    drafts = jnp.asarray([[7, 7], [4, 8]], jnp.int32)
    at_positions = apply_to_positions(logits, sampling, counts, drafts)
    step = counts
    for j in range(3):  # position j: as if drafts[:, :j] had been emitted one by one
        want = apply_penalties(logits[:, j], sampling, step)
        np.testing.assert_array_equal(np.asarray(at_positions[:, j]), np.asarray(want))
        if j < 2:
            step = count_tokens(step, drafts[:, j : j + 1], jnp.ones((2, 1), bool))
    row = np.asarray(logits[1, 0])  # by hand: token 6 (3 times generated), 4 (prompt), 0 (unseen)
    got = np.asarray(off[1])
    assert np.isclose(got[0], row[0])
    assert np.isclose(got[4], row[4] / 1.7 if row[4] > 0 else row[4] * 1.7)
    rep6 = row[6] / 1.7 if row[6] > 0 else row[6] * 1.7
    assert np.isclose(got[6], rep6 + 0.3 * 3 - 0.5)


def test_argmax_gives_jnps_index_for_ties_nans_and_infinities():
    """`decode.argmax` (the library's one pass on a CPU) is `jnp.argmax` over the last axis: the
    first maximum, a NaN as the largest, whatever the leading axes and the row's length (whole
    vectors of 16 and a tail; ties and NaNs in either, -0 beside +0)."""
    from eejax.decode.argmax import argmax

    rows = np.array(
        [
            [1.0, 3.0, 3.0, 2.0],
            [np.nan, 5.0, np.nan, 1.0],
            [-np.inf] * 4,
            [0.0, np.inf, np.inf, 1.0],
            [2.0, 1.0, np.nan, 7.0],
        ],
        np.float32,
    )
    rng = np.random.default_rng(0)
    long = rng.integers(-3, 4, (6, 40)).astype(np.float32)
    long[1, 37] = long[2, 3] = long[2, 30] = np.nan
    long[3, :] = -np.inf
    long[4, :] = [-0.0, 0.0] * 20
    long[5, 35] = 9.0
    vocab = rng.standard_normal((3, 49152)).astype(np.float32)
    vocab[1, [7, 40000]] = 50.0
    vocab[2, 49151] = np.nan
    others = rng.standard_normal((2, 3, 257)).astype(np.float32), rng.integers(0, 3, (4, 9)).astype(np.float32)
    for x in (rows, long, vocab, *others):
        got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
        assert got.dtype == np.int32 and np.array_equal(got, np.asarray(jnp.argmax(x, axis=-1)))
