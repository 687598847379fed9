"""The engine's device arrays part alone (`engine/device_slots.py`): programs take the counts and
prompts only where their options use them, their outputs replace only what they returned, a
slot is stopped or its speculation counters cleared alone, and lost arrays are noticed and
rebuilt."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eejax.decode.speculative import SpecCounters
from eejax.engine.device_slots import DeviceSlots
from eejax.engine.transfers import PackedRead, pack, read_tree
from eejax.options import SpecConfig, StepOptions

SLOTS = 3


@pytest.fixture(scope="module")
def slots(tiny_model):
    """Device slots of the tiny Llama as if it had a draft head (so that prompts are kept)."""
    model = types.SimpleNamespace(
        config=tiny_model.config, params={"draft": True}, new_cache=tiny_model.new_cache, dtype=tiny_model.dtype
    )
    return DeviceSlots(model, SLOTS, max_new_tokens=4, num_pages=6, page_size=4, max_len=16)


def test_a_program_takes_counts_and_prompts_only_where_its_options_use_them(slots):
    plain = StepOptions(4)
    assert slots.state_for(plain).counts is None and slots.state_for(plain).prompt is None
    penalised = dataclasses.replace(plain, penalties=True)
    assert slots.state_for(penalised).counts is slots.counts
    assert slots.state_for(penalised, counts=False).counts is None
    lookup = dataclasses.replace(plain, spec=SpecConfig.parse("draft:2:lookup"))
    slots.set_prompt(1, [5, 6, 7])
    prompt = slots.state_for(lookup).prompt
    assert np.asarray(prompt.tokens)[1, :4].tolist() == [5, 6, 7, 0] and np.asarray(prompt.lengths).tolist() == [
        0,
        3,
        0,
    ]
    assert slots.state_for(lookup).prompt is prompt  # sent once until a prompt changes
    slots.set_prompt(0, [9])
    assert np.asarray(slots.state_for(lookup).prompt.lengths).tolist() == [1, 3, 0]
    assert np.asarray(prompt.lengths).tolist() == [0, 3, 0]  # what a program in flight took is unchanged


def test_a_packed_read_is_kept_only_while_the_state_is_as_its_program_left_it(slots):
    state, counters = slots.state, slots.spec_counters
    packed = pack(read_tree(state, counters))  # what a program packs (`transfers.reading`)
    slots.keep(state, None, counters, packed)
    assert slots.packed is packed
    got, want = PackedRead.started(packed, slots.read_layout).read(), PackedRead(read_tree(state, counters)).read()
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
    slots.keep(cache=slots.cache)  # a draft pass leaves the state as it was
    assert slots.packed is packed
    for change in (lambda: slots.stop(0), lambda: slots.clear_spec_counters(np.array([1])), lambda: slots.keep(state)):
        slots.keep(state, None, counters, packed)
        change()  # a slot stopped, counters cleared, a prefill's state: the packed read is stale
        assert slots.packed is None


def test_a_programs_outputs_replace_only_what_it_returned(slots):
    cache, counts = slots.cache, slots.counts
    new_counts = jax.tree.map(lambda x: x + 1, counts)
    state = dataclasses.replace(slots.state, seq_len=slots.state.seq_len + 2, counts=new_counts)
    slots.keep(state)
    assert slots.counts is new_counts and slots.state.counts is None and slots.cache is cache
    assert np.asarray(slots.state.seq_len).tolist() == np.asarray(state.seq_len).tolist()
    new_cache = jax.tree.map(jnp.copy, cache)
    slots.keep(cache=new_cache)
    assert slots.cache is new_cache and slots.counts is new_counts


def test_a_slot_is_stopped_and_its_counters_cleared_alone(slots):
    slots.keep(dataclasses.replace(slots.state, done=jnp.zeros((SLOTS,), bool)))
    slots.stop(1)
    assert np.asarray(slots.state.done).tolist() == [False, True, False]
    slots.keep(spec_counters=jax.tree.map(lambda x: x + 5, SpecCounters.zeros(SLOTS)))
    slots.clear_spec_counters(np.array([2, SLOTS]))  # SLOTS: a padding row, dropped
    assert np.asarray(slots.spec_counters.drafted).tolist() == [5, 5, 0]


def test_lost_arrays_are_noticed_and_rebuilt(slots):
    assert slots.intact()
    jax.tree.map(lambda x: x.delete(), slots.cache)  # as a failed program that took them leaves them
    assert not slots.intact()
    slots.reset()
    assert slots.intact() and np.asarray(slots.state.done).all()
