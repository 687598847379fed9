"""The token loop's device state: `DecodeState` (every row's tokens, lengths, limits, keys,
sampling and context) and its log-prob record, and what is done to rows of it: EOS, prefilled
rows written into decode slots, empty slots, and a group of slots running while the rest wait."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from eejax.decode.lookup import PromptTokens
from eejax.decode.penalties import TokenCounts
from eejax.decode.sampling import RowSampling, SamplingParams, logprobs_of

TOP_LOGPROBS = 20  # the most alternatives a row's log-prob record keeps (OpenAI's bound)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LogprobRecord:
    """Per generated token (see `sampling.logprobs_of` for which distribution):
    chosen [B, N] f32: the token's log-probability; top_ids [B, N, K] int32 and top [B, N, K]
    f32: the K = TOP_LOGPROBS most likely tokens and their log-probabilities."""

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array

    @classmethod
    def zeros(cls, rows: int, max_new_tokens: int) -> LogprobRecord:
        shape = (rows, max_new_tokens)
        return cls(
            jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (TOP_LOGPROBS,), jnp.int32),
            jnp.zeros(shape + (TOP_LOGPROBS,), jnp.float32),
        )


def token_logprobs(logits, tokens, rows: RowSampling, sampler: str):
    """logits [B, T, V], tokens [B, T] -> (chosen [B, T], top_ids [B, T, K], top [B, T, K])."""
    shape = tokens.shape
    per_token = jax.tree.map(lambda x: jnp.repeat(x, shape[1]), rows)  # [B * T]
    lp = logprobs_of(logits.reshape(-1, logits.shape[-1]), per_token, sampler)
    chosen = jnp.take_along_axis(lp, tokens.reshape(-1, 1), axis=-1)[:, 0]
    top, top_ids = jax.lax.top_k(lp, min(TOP_LOGPROBS, lp.shape[-1]))
    pad = ((0, 0), (0, TOP_LOGPROBS - top.shape[-1]))  # a vocabulary smaller than the record
    top, top_ids = jnp.pad(top, pad, constant_values=-jnp.inf), jnp.pad(top_ids, pad)
    return (
        chosen.reshape(shape),
        top_ids.astype(jnp.int32).reshape(shape + (TOP_LOGPROBS,)),
        top.reshape(shape + (TOP_LOGPROBS,)),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Per-row generation state, all on device.

    last_token [B] int32: the newest token, not yet in the cache
    seq_len [B] int32:    tokens already in the cache
    num_generated [B]:    tokens produced so far (EOS included)
    done [B] bool:        row finished (EOS, its limit, or padding row)
    tokens [B, N] int32:  generated ids (N = max_new_tokens, the record's width)
    exit_layers [B, N]:   layers run for each token (the batch's exit layer)
    confident_layers [B, N]: the row's first confident layer (the exit layer if none)
    keys [B, 2] uint32:   each row's PRNG key; token t is drawn with `token_keys(keys, t, ...)`
    start [B] int32:      tokens the request generated before this state took it over (the
                          engine recomputes a preempted row; 0 in `generate`): the absolute
                          index of a row's token i is start + i
    limit [B] int32:      the row's own max new tokens counted from `start` (<= N); the
                          decaying exit threshold runs over start + limit
    sampling:             each row's temperature / top-k / top-p (`RowSampling`, traced)
    context:              per-row model state besides the KV cache (T5: `t5_attention.CrossKV`; Llama: None)
    logprobs:             a `LogprobRecord`, or None when nobody asks for log-probabilities
    draft_hidden [B, D] f32: with a draft head (`feature_draft`), its output at the row's last
                          cached position (its guess of the feature of last_token); else None
    counts:               with penalties (`StepOptions.penalties`), the rows' `TokenCounts`
                          (prompt tokens, and the generated ones, last_token included); else None
    prompt:               with a prompt lookup (`SpecConfig.lookup`), the rows' `PromptTokens`;
                          else None
    """

    last_token: jax.Array
    seq_len: jax.Array
    num_generated: jax.Array
    done: jax.Array
    tokens: jax.Array
    exit_layers: jax.Array
    confident_layers: jax.Array
    keys: jax.Array
    start: jax.Array
    limit: jax.Array
    sampling: RowSampling
    context: Any = None
    logprobs: LogprobRecord | None = None
    draft_hidden: jax.Array | None = None
    counts: TokenCounts | None = None
    prompt: PromptTokens | None = None

    @property
    def position(self):
        """[B] the absolute index of each row's next token."""
        return self.start + self.num_generated


def record_logprobs(state: DecodeState, logits, tokens, idx, emitted, sampler: str):
    """`state.logprobs` with the scores of tokens [B, T] (logits [B, T, V]) written at record
    indices idx [B, T] where `emitted` [B, T]; unchanged when there is no record."""
    if state.logprobs is None:
        return None
    idx = jnp.where(emitted, idx, state.tokens.shape[1])  # out of range: dropped
    rows = jnp.arange(tokens.shape[0])[:, None]
    scores = token_logprobs(logits, tokens, state.sampling, sampler)
    return jax.tree.map(
        lambda buf, new: buf.at[rows, idx].set(new, mode="drop"), state.logprobs, LogprobRecord(*scores)
    )


def is_eos(tokens, eos_ids: tuple[int, ...]):
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def insert_rows(state: DecodeState, new: DecodeState, slots):
    """`new`'s rows written into `state` at `slots` (out-of-range slots, the prefill's padding
    rows, are dropped); a log-prob record only when `new` has one. A context (an encoder-decoder's
    cross K/V [B, H, S, Dk]) is padded to the slots' prompt length first: the positions past a
    row's encoder length are masked."""

    def put(old, fresh):
        pad = [(0, 0)] + [(0, o - f) for o, f in zip(old.shape[1:], fresh.shape[1:])]
        return old.at[slots].set(jnp.pad(fresh, pad) if any(p for _, p in pad) else fresh, mode="drop")

    rows = {
        f.name: jax.tree.map(put, getattr(state, f.name), getattr(new, f.name))
        for f in dataclasses.fields(state)
        if getattr(new, f.name) is not None
    }
    return dataclasses.replace(state, **rows)


def empty_state(slots: int, max_new_tokens: int, context=None, draft_width: int = 0) -> DecodeState:
    """Slots that are all done; `context`: the slots' (an encoder-decoder's `empty_context`);
    `draft_width`: a draft head's feature width D (0: no draft head)."""
    zeros = jnp.zeros((slots,), jnp.int32)
    record = jnp.zeros((slots, max_new_tokens), jnp.int32)
    return DecodeState(
        last_token=zeros,
        seq_len=zeros,
        num_generated=zeros,
        done=jnp.ones((slots,), bool),
        tokens=record,
        exit_layers=record,
        confident_layers=record,
        keys=jnp.zeros((slots, 2), jnp.uint32),
        start=zeros,
        limit=zeros,
        sampling=jax.tree.map(jnp.asarray, RowSampling.of(SamplingParams(), slots)),
        logprobs=LogprobRecord.zeros(slots, max_new_tokens),
        context=context,
        draft_hidden=jnp.zeros((slots, draft_width), jnp.float32) if draft_width else None,
    )


def only_group(state, group):
    """`state` with the rows outside `group` [S] bool marked done (they wait), and those rows."""
    waiting = ~group & ~state.done
    return dataclasses.replace(state, done=state.done | waiting), waiting


def ungrouped(new, waiting):
    """`new` with the rows that waited (`only_group`) not done again."""
    return dataclasses.replace(new, done=jnp.where(waiting, False, new.done))
