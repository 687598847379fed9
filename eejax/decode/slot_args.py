"""The arguments of a slot program (decode steps, a speculation round, plain steps in a round's
place, a round's verify pass: over the engine's slots), of a prefill into the slots and of a
round's draft pass, by name.
The engine builds them (`DeviceSlots.program`, `Admission.prefill_program`), the programs take
them in this order, donation names what it gives away (`DONATED`, `PREFILL_DONATED`), and a
benchmark replays a captured call by name."""

from __future__ import annotations

from typing import Any, NamedTuple


class SlotArgs(NamedTuple):
    """params:        the weights the program reads (`Model.run_params`)
    cache:         the paged KV cache
    state:         the slots' `DecodeState`, without its prompts
    spec_counters: the slots' `SpecCounters` (a round's program updates them; others pass them on)
    prompt:        the slots' prompts for a prompt lookup (`PromptTokens`), or None
    inputs:        the program's own, in its order: block table and group mask (a verify pass:
                   its drafts first)"""

    params: Any
    cache: Any
    state: Any
    spec_counters: Any
    prompt: Any
    inputs: tuple


# What a slot program gives away: what it returns replaces them (XLA updates them in place).
DONATED = tuple(SlotArgs._fields.index(name) for name in ("cache", "state", "spec_counters"))


class DraftArgs(NamedTuple):
    """A round's draft program's arguments (`speculative.draft_slots`), when an adaptive policy
    times the drafts apart: the weights, the paged KV cache (given away: the drafts' K/V), the
    slots' `DecodeState` (without token counts), the block table and the group mask."""

    params: Any
    cache: Any
    state: Any
    block_table: Any
    group: Any


class PrefillChunk(NamedTuple):
    """What a prefill into the slots (`steps.prefill_slots`) writes, b rows of T positions:
    tokens:      [b, T] positions offset..lengths-1 of each row's prompt, right-padded
    lengths:     [b] each row's prompt positions once this chunk is in
    block_table: [b, W] each row's pages
    slots:       [b] the decode slot each row goes to (out of range: a row only fills the cache)
    keys:        [b, 2] the rows' PRNG keys
    start:       [b] tokens each row generated before (recomputed after a preemption)
    limit:       [b] new tokens each row may still make
    sampling:    the rows' `RowSampling` [b]
    offset:      [b] positions of each row already in the cache (a shared prefix, earlier chunks)
    next_token:  [b] with a draft head, the prompt token after the chunk (-1: the prompt ends),
                 else None
    counts:      with penalties, the rows' `TokenCounts` [b] so far, else None
    targets:     with prompt log-probs, [b, T] the token each position scores (-1: none), else None"""

    tokens: Any
    lengths: Any
    block_table: Any
    slots: Any
    keys: Any
    start: Any
    limit: Any
    sampling: Any
    offset: Any
    next_token: Any = None
    counts: Any = None
    targets: Any = None


class PrefillArgs(NamedTuple):
    """A prefill program's arguments: the weights, the paged KV cache (given away), the slots'
    `DecodeState` and the `PrefillChunk`."""

    params: Any
    cache: Any
    state: Any
    chunk: PrefillChunk


PREFILL_DONATED = (PrefillArgs._fields.index("cache"),)
