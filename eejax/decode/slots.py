"""Device programs over a fixed number of decode slots (the serving engine's): a prefill into
chosen slots, and one decode step or self-speculation round of a group of slots while the
others wait. Pure functions of (params, cache, state, ...), jitted by the engine's program cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eejax.decode import speculative, steps
from eejax.decode.sampling import RowSampling, SamplingParams
from eejax.options import StepOptions


def insert_rows(state: steps.DecodeState, new: steps.DecodeState, slots):
    """`new`'s rows written into `state` at `slots` (out-of-range slots, the prefill's padding
    rows, are dropped); a log-prob record only when `new` has one. A context (an encoder-decoder's
    cross K/V [B, H, S, Dk]) is padded to the slots' prompt length first: the positions past a
    row's encoder length are masked."""
    def put(old, fresh):
        pad = [(0, 0)] + [(0, o - f) for o, f in zip(old.shape[1:], fresh.shape[1:])]
        return old.at[slots].set(jnp.pad(fresh, pad) if any(p for _, p in pad) else fresh, mode="drop")

    rows = {f.name: jax.tree.map(put, getattr(state, f.name), getattr(new, f.name))
            for f in dataclasses.fields(state) if getattr(new, f.name) is not None}
    return dataclasses.replace(state, **rows)


def prefill_slots(params, cache, state, tokens, lengths, block_table, slots, keys, start, limit, sampling, offset,
                  *, config, options: StepOptions):
    """Prefills right-padded prompts into decode slots `slots` [b] of `state`: tokens [b, T] are
    positions offset..lengths-1 of each row (offset [b]: a shared prefix already cached), with
    the rows' keys [b, 2], start [b] (tokens generated before, recomputed), limit [b] (max new
    tokens from there) and sampling (`RowSampling` [b]). Returns (state, cache)."""
    new, cache = steps.prefill(params, cache, tokens, lengths, block_table, keys, start, limit, sampling, offset,
                               config=config, options=options)
    return insert_rows(state, new, slots), cache


def _only(state, group):
    """`state` with the rows outside `group` [S] bool marked done (they wait), and those rows."""
    waiting = ~group & ~state.done
    return dataclasses.replace(state, done=state.done | waiting), waiting


def _unmasked(new, waiting):
    return dataclasses.replace(new, done=jnp.where(waiting, False, new.done))


def decode_slots(params, cache, state, block_table, group, *, config, options: StepOptions):
    """`options.num_steps` decode steps of the slots in `group` [S] bool that are not done (the
    others wait: they run with their own options in another program)."""
    masked, waiting = _only(state, group)
    new, cache = steps.decode_steps(params, cache, masked, block_table, config=config, options=options)
    return _unmasked(new, waiting), cache


def plain_step_slots(params, cache, state, counters, block_table, group, *, config, options: StepOptions):
    """One full-depth decode step of the slots in `group` in place of a speculation round
    (`speculative.plain_step`: counted). Returns (state, cache, counters)."""
    masked, waiting = _only(state, group)
    new, cache, counters = speculative.plain_step(params, cache, masked, counters, block_table, config=config,
                                                  options=options)
    return _unmasked(new, waiting), cache, counters


def draft_slots(params, cache, state, block_table, group, *, config, options: StepOptions):
    """A round's drafts (`speculative.draft`) for the slots in `group`. Returns (drafts, cache)."""
    drafts, _, cache = speculative.draft(params, cache, _only(state, group)[0], block_table, config=config,
                                         options=options.drafting())
    return drafts, cache


def verify_slots(params, cache, state, drafts, counters, block_table, group, *, config, options: StepOptions):
    """A round's verification (`speculative.verify`) for the slots in `group`. Returns (state,
    cache, counters)."""
    masked, waiting = _only(state, group)
    new, cache, counters = speculative.verify(params, cache, masked, drafts, counters, block_table, config=config,
                                              options=options.verifying())
    return _unmasked(new, waiting), cache, counters


def spec_round_slots(params, cache, state, counters, block_table, group, *, config, options: StepOptions):
    """One self-speculation round (d drafts from layers [0, E), one verify pass of the rest) of
    the slots in `group` that are not done, in one program; the others wait. Returns (state,
    cache, counters)."""
    drafts, cache = draft_slots(params, cache, state, block_table, group, config=config, options=options)
    return verify_slots(params, cache, state, drafts, counters, block_table, group, config=config, options=options)


def empty_state(slots: int, max_new_tokens: int, context=None) -> steps.DecodeState:
    """Slots that are all done; `context`: the slots' (an encoder-decoder's `empty_context`)."""
    zeros = jnp.zeros((slots,), jnp.int32)
    record = jnp.zeros((slots, max_new_tokens), jnp.int32)
    return steps.DecodeState(last_token=zeros, seq_len=zeros, num_generated=zeros,
                             done=jnp.ones((slots,), bool), tokens=record, exit_layers=record,
                             confident_layers=record, keys=jnp.zeros((slots, 2), jnp.uint32), start=zeros,
                             limit=zeros, sampling=jax.tree.map(jnp.asarray, RowSampling.of(SamplingParams(), slots)),
                             logprobs=steps.LogprobRecord.zeros(slots, max_new_tokens), context=context)
