"""The slots' arrays on the device, a part of the `Engine` that alone replaces them: the paged KV
cache, the decode state (`DecodeState`: each slot's tokens, limits, keys and done flags),
penalised rows' token counts, the speculation counters, the slots' prompts for a prompt lookup,
and the block tables and group masks uploaded for programs.

A program takes its arrays from here (`cache`, `state_for(options)`, `spec_counters`) and gives
its outputs back (`keep`): every program donates the cache (a decode program the state and
speculation counters too), so after it runs only what it returned is valid. Nothing else writes
them. Without a mesh a decode program also returns what the host reads of it, packed
(`transfers.reading`); `packed` is that vector while the state and counters are as that program
left them, None once anything else changed them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eejax.decode.lookup import PromptTokens
from eejax.decode.penalties import TokenCounts
from eejax.decode.slot_args import DONATED, SlotArgs
from eejax.decode.speculative import SpecCounters
from eejax.decode.state import empty_state
from eejax.engine.transfers import ReadLayout, Uploads, read_tree, reading
from eejax.models.registry import model_module
from eejax.options import StepOptions


@jax.jit
def _set_done(done, slot):
    """done [S] with slot's flag set: one small program (run eagerly, `.at[].set` took ~0.3-1 ms
    of dispatch per finished request on a CPU)."""
    return done.at[slot].set(True)


@jax.jit
def _zero_rows(counters: SpecCounters, slots) -> SpecCounters:
    """counters with rows `slots` [b] zeroed (an index past the rows is dropped): one program for
    every counter (eagerly, one scatter each: ~5 ms per admitted request on a CPU)."""
    return jax.tree.map(lambda x: x.at[slots].set(0, mode="drop"), counters)


class DeviceSlots:
    """`slots` rows of device state over a cache of `num_pages` pages of `page_size` tokens.
    `context_width`: an encoder-decoder's cross K/V per slot (its bucketed prompt width; None:
    decoder-only). `max_len`: the longest row, the width of the prompts kept for a lookup (kept
    only when the model has a draft head, the only speculation that looks prompts up)."""

    def __init__(
        self,
        model,
        slots: int,
        max_new_tokens: int,
        num_pages: int,
        page_size: int,
        max_len: int,
        context_width: int | None = None,
    ):
        self._model, self.slots, self.max_new_tokens = model, slots, max_new_tokens
        self.num_pages, self.page_size, self.context_width = num_pages, page_size, context_width
        self._uploads = Uploads()
        # (tokens [slots, max_len], lengths [slots]), what `PromptTokens` holds: written on the
        # host as a row's prompt is complete, sent when a program that looks them up next runs.
        self._prompts = None
        if model.params.get("draft"):
            self._prompts = np.zeros((slots, max_len), np.int32), np.zeros((slots,), np.int32)
        self.reset()

    def reset(self) -> None:
        """Fresh arrays: an empty cache and empty slots (after a program lost them)."""
        config = self._model.config
        self._cache = self._model.new_cache(self.num_pages, self.page_size)
        context = None
        if self.context_width is not None:
            context = model_module(config).empty_context(config, self.slots, self.context_width, self._model.dtype)
        draft = config.hidden_size if self._model.params.get("draft") else 0
        self._state = empty_state(self.slots, self.max_new_tokens, context, draft_width=draft)
        # Apart from the state (which every program returns anew): taken only by the programs
        # of penalised rows, which return them in their state (`state_for`, `keep`).
        self._counts = TokenCounts.zeros(self.slots, config.vocab_size)
        self._spec_counters = SpecCounters.zeros(self.slots)
        self._device_prompts: PromptTokens | None = None
        self._packed = None
        self._read_layout: ReadLayout | None = None

    @property
    def cache(self):
        """The paged KV cache (a program's argument 1, donated)."""
        return self._cache

    @property
    def state(self):
        """The slots' `DecodeState` as the last program left it (without counts or prompts)."""
        return self._state

    @property
    def counts(self) -> TokenCounts:
        """The slots' token counts [slots, vocab], for penalties."""
        return self._counts

    @property
    def spec_counters(self) -> SpecCounters:
        """The slots' speculation counters [slots] (drafted, accepted, rounds, ...)."""
        return self._spec_counters

    @property
    def packed(self):
        """The last program's packed read (`transfers.reading`) while the state and speculation
        counters are still as it left them; else None."""
        return self._packed

    @property
    def read_layout(self) -> ReadLayout:
        """How `packed` lays out `read_tree(state, spec_counters)` (their shapes never change)."""
        if self._read_layout is None:
            self._read_layout = ReadLayout(read_tree(self._state, self._spec_counters))
        return self._read_layout

    def program(self, fn, options: StepOptions, inputs: tuple, *, takes_counters: bool = False, now: bool = False):
        """(compiled program, its `SlotArgs`) of a slot program `fn(params, cache, state[, spec
        counters], *inputs)` over these slots (`transfers.reading`; `takes_counters`: a round's,
        which updates the counters), built with the state `options` read (`state_for`) and its
        prompts apart. It returns (state, cache, spec counters, packed read), which `keep`
        takes. Without a mesh the program packs its read itself and donates the state and
        counters as well as the cache (`slot_args.DONATED`): what it returns replaces them, so XLA
        updates them in place instead of copying each array in first (27 copies a dispatch, ~10% of
        the tiny model's decode program on a CPU; a kernel each on a GPU). On a mesh a separate
        program packs the read: this one keeps the collectives it has, donates the cache only,
        and copies. `now`: compile the split layout's program before it runs (`Model.program`)."""
        state = self.state_for(options)
        args = SlotArgs(
            self._model.run_params,
            self._cache,
            dataclasses.replace(state, prompt=None) if state.prompt is not None else state,
            self._spec_counters,
            state.prompt,
            tuple(inputs),
        )
        if self._model.mesh is not None:
            program = reading(fn, takes_counters, packs=False)
            return self._model.program(program, args, options, now, donate_argnums=(SlotArgs._fields.index("cache"),))
        return self._model.program(reading(fn, takes_counters), args, options, now, donate_argnums=DONATED)

    def state_for(self, options: StepOptions, counts: bool = True):
        """The state a program of `options` takes: with the token counts when it applies
        penalties (and `counts`), with the slots' prompts when its speculation looks them up."""
        state = self._state
        if counts and options.penalties:
            state = dataclasses.replace(state, counts=self._counts)
        if options.spec is not None and options.spec.lookup:
            if self._device_prompts is None:  # copies: `set_prompt` changes the host arrays in place
                self._device_prompts = PromptTokens(*(jnp.asarray(x.copy()) for x in self._prompts))
            state = dataclasses.replace(state, prompt=self._device_prompts)
        return state

    def keep(self, state=None, cache=None, spec_counters: SpecCounters | None = None, packed=None) -> None:
        """Takes what a program returned: its new state (and the token counts in it, when it
        returns them), cache, speculation counters and packed read (`program`); None: that one
        is unchanged (a new state or counters without a packed read: `packed` becomes None)."""
        if state is not None or spec_counters is not None:
            self._packed = packed
        if cache is not None:
            self._cache = cache
        if spec_counters is not None:
            self._spec_counters = spec_counters
        if state is not None:
            if state.counts is not None:
                self._counts, state = state.counts, dataclasses.replace(state, counts=None)
            self._state = state if state.prompt is None else dataclasses.replace(state, prompt=None)

    def stop(self, slot: int) -> None:
        """Marks a slot's row done on device: programs leave it as it is (a cancelled row)."""
        self._state = dataclasses.replace(self._state, done=_set_done(self._state.done, slot))
        self._packed = None

    def clear_spec_counters(self, slots) -> None:
        """Zeroes the speculation counters of `slots` [b] (rows just prefilled; an index of
        `self.slots` or more is dropped)."""
        self._spec_counters = _zero_rows(self._spec_counters, slots)
        self._packed = None

    def set_prompt(self, slot: int, tokens) -> None:
        """Keeps a row's whole prompt for a prompt lookup (nothing if none is ever looked up)."""
        if self._prompts is not None:
            self._prompts[0][slot, : len(tokens)], self._prompts[1][slot] = tokens, len(tokens)
            self._device_prompts = None

    def upload(self, key, array):
        """`array` on the device, sent only if the one last sent under `key` differs (`Uploads`)."""
        return self._uploads.get(key, array)

    def intact(self) -> bool:
        """Whether the arrays survived the last program (a failed one may have consumed them)."""
        try:
            jax.block_until_ready((self._cache, self._state, self._counts, self._spec_counters))
            return True
        except Exception:  # noqa: BLE001 - donated to a program that failed, or computed by one
            return False
