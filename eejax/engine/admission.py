"""Admission and prefill, a part of the `Engine`: which waiting requests get a decode slot and
pages, how their prompts reach the cache (whole, or `prefill_chunk` tokens per step, after the
pages of a prefix the cache already holds), pages for rows that grow, and preemption when none
is left. It owns no state: the queue, slots, pages and device arrays change through their parts
(`WaitingQueue`, `SlotTable`, `DeviceSlots`); it counts its own work (`AdmissionCounts`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from eejax.cache import pages_needed
from eejax.decode.buckets import MIN_PROMPT_BUCKET, bucket
from eejax.decode.penalties import TokenCounts
from eejax.decode.sampling import FILTERED, RowSampling, SamplingParams
from eejax.decode.slot_args import PREFILL_DONATED, PrefillArgs, PrefillChunk
from eejax.decode.steps import prefill_slots
from eejax.engine.delivery import Delivery
from eejax.engine.device_slots import DeviceSlots
from eejax.engine.dispatch import Dispatch
from eejax.engine.faults import Faults
from eejax.engine.metrics import ServeMetrics
from eejax.engine.sequence import Sequence
from eejax.engine.slots import SlotTable
from eejax.engine.waiting import WaitingQueue
from eejax.options import StepOptions

log = logging.getLogger("eejax.serve")


@dataclasses.dataclass
class AdmissionCounts:
    """What admission did, summed (`Engine.metrics`): prefill programs, rows preempted, prompt
    tokens prefilled, those shared from the prefix cache, padding in the prefills, and seconds in
    the scheduler and (a batch job's, which waits for each) in prefills."""

    prefills: int = 0
    preemptions: int = 0
    padding_tokens: int = 0
    prompt_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    scheduler_s: float = 0.0
    prefill_s: float = 0.0


class Admission:
    """`options`: the engine's programs' options (a prefill's are made from them); `max_len`: the
    longest row; `max_prompt_tokens`: an encoder-decoder's longest prompt (None: decoder-only);
    `prefill_chunk`: prompt tokens prefilled per step (None: whole prompts); `grow`: rows get
    pages as they grow (else all at admission); `batch_job`: prefills are timed (`prefill_s`);
    `prompt_positions(prompt)`: the cache positions a prompt takes."""

    def __init__(
        self,
        model,
        options: StepOptions,
        waiting: WaitingQueue,
        slot_table: SlotTable,
        device: DeviceSlots,
        dispatch: Dispatch,
        delivery: Delivery,
        faults: Faults,
        prometheus: ServeMetrics,
        *,
        max_len: int,
        max_prompt_tokens: int | None,
        prefill_chunk: int | None,
        grow: bool,
        batch_job: bool,
        prompt_positions: Callable[[list[int]], int],
    ):
        self.model, self.config, self.options = model, model.config, options
        self._waiting, self._slot_table, self._device, self._dispatch = waiting, slot_table, device, dispatch
        self._delivery, self._faults, self._prometheus = delivery, faults, prometheus
        self.counts = AdmissionCounts()
        self.slots, self.pages = slot_table.size, slot_table.pages
        self.page_size = self.pages.page_size
        self.max_len, self.max_prompt_tokens, self.prefill_chunk = max_len, max_prompt_tokens, prefill_chunk
        self.grow, self.batch_job = grow, batch_job
        self.prompt_positions = prompt_positions
        self.encoder_decoder = max_prompt_tokens is not None

    def admit(self) -> None:
        """Gives free slots, and their pages, to the waiting rows the scheduler picks."""
        free = self._slot_table.free()
        start = time.perf_counter()
        seqs = self._waiting.take(len(free), self.pages.num_free)
        self.counts.scheduler_s += time.perf_counter() - start
        for seq, slot in zip(seqs, free):
            seq.placement.offset = len(seq.tokens)
            positions = self.prompt_positions(seq.prompt) + (seq.offset + 1 if self.grow else seq.max_new_tokens)
            self._slot_table.admit(seq, slot, positions)  # (admission counted every page as fresh)
            seq.placement.prefilled = seq.cached

    def prefill_some(self) -> None:
        """Prefills the admitted rows' prompts: whole, or with `prefill_chunk`, that many tokens
        in all this step, the oldest admission first. A row whose prompt is then complete has
        sampled its first token and decodes from the next step."""
        budget = self.prefill_chunk or float("inf")
        work = []
        for seq in self._slot_table.prefilling.values():
            if budget <= 0:
                break
            end = int(min(len(seq.prompt) + seq.offset, seq.prefilled + budget))
            budget -= end - seq.prefilled
            work.append((seq, end))

        # Options taken before any prefill runs: a prefill changes them (a scored prompt, once
        # scored, is not scored again), and a row must not join a second group.
        options = [self.prefill_options(seq) for seq, _ in work]
        for group in dict.fromkeys(options):
            members = [item for item, o in zip(work, options) if o == group]
            self._faults.guarded([seq for seq, _ in members], self._prefill, members, group)

    def prefill_options(self, seq: Sequence) -> StepOptions:
        """The options of a row's prefill: one program for every sampler, log-prob and penalty
        setting (only the prompt's scoring has its own), since a prefill samples one token per
        row: the filtered sampler gives greedy rows their argmax, penalties at their off values
        change no logit, and the first token's log-prob record is cheap. (Each program a process
        holds costs memory maps: see `warmup`.)"""
        return dataclasses.replace(
            self.options.prefilling(),
            sampler=FILTERED,
            logprobs=True,
            penalties=True,
            prompt_logprobs=seq.scoring_prompt,
        )

    @property
    def resume_width(self) -> int:
        """The page-table width of a prefill that starts after cached tokens (a shared prefix, an
        earlier chunk): that of the longest prompt `max_prompt_tokens`, whatever its own, so that
        such prefills compile one program per chunk bucket rather than one per (chunk, prompt)
        pair (their attention then reads a few more pages of the null page, masked)."""
        longest = min(self.max_prompt_tokens or self.max_len, self.max_len)
        return self.prefill_width(bucket(longest, MIN_PROMPT_BUCKET))

    def _prefill(self, work: list[tuple[Sequence, int]], options: StepOptions) -> None:
        """One prefill program over rows (seq, end): positions seq.prefilled..end-1 of each. A row
        that ends its prompt there is written into its decode slot; the others only fill the
        cache (their slot index is out of range, so the row is dropped)."""
        b = bucket(len(work))  # 1, 2, 3, 4, 6, 8, ...: little row padding, few programs
        t = bucket(max(end - seq.prefilled for seq, end in work), MIN_PROMPT_BUCKET)
        longest = bucket(max(end for _, end in work), MIN_PROMPT_BUCKET)
        tokens = np.zeros((b, t), np.int32)
        lengths, start, limit, offset = (np.zeros((b,), np.int32) for _ in range(4))
        next_token = np.full((b,), -1, np.int32)  # a draft head's token after the chunk (-1: the prompt ends)
        keys = np.zeros((b, 2), np.uint32)
        slots = np.full((b,), self.slots, np.int32)  # padding rows and unfinished prompts: dropped
        width = self.prefill_width(longest)
        if any(seq.prefilled > 0 for seq, _ in work):
            width = max(width, self.resume_width)
        table = np.zeros((b, width), np.int32)
        sampling = RowSampling.of([seq.sampling for seq, _ in work] + [SamplingParams()] * (b - len(work)))
        for j, (seq, end) in enumerate(work):
            prompt = seq.prompt + seq.tokens[: seq.offset]
            tokens[j, : end - seq.prefilled] = prompt[seq.prefilled : end]
            lengths[j], start[j], limit[j] = end, seq.offset, seq.max_new_tokens - seq.offset
            keys[j], offset[j] = seq.key, seq.prefilled
            if end < len(prompt):
                next_token[j] = prompt[end]
            slots[j] = seq.slot if end == len(prompt) else self.slots
            if end == len(prompt):  # for a prompt lookup
                self._device.set_prompt(seq.slot, prompt)
            table[j] = self.pages.row(seq.slot, table.shape[1])
            # The prefill writes positions prefilled.. only, into pages no one shares.
            assert self.pages.writable(seq, seq.prefilled), seq.id
        targets = None
        if options.prompt_logprobs:  # each position scores the prompt's next token (-1: none)
            targets = np.full((b, t), -1, np.int32)
            for j, (seq, end) in enumerate(work):
                after = seq.prompt[seq.prefilled + 1 : end + 1]
                targets[j, : len(after)] = after
        counts = None
        if options.penalties:  # the whole prompt's tokens and those generated before a preemption
            # (an encoder-decoder's decoder has seen its start token, not the encoder's prompt: as HF)
            start_token = [self.config.decoder_start_token_id] if self.encoder_decoder else None
            history = [(start_token or seq.prompt, seq.tokens[: seq.offset]) for seq, _ in work]
            counts = TokenCounts.of(*zip(*history), self.config.vocab_size, b)
        chunk = PrefillChunk(
            tokens, lengths, table, slots, keys, start, limit, sampling, offset, next_token, counts, targets
        )
        program, args = self.prefill_program(chunk, options)
        started = time.perf_counter()
        state, cache, *scores = program(*args)
        self._device.keep(state, cache)
        if scores:
            self._delivery.record_prompt_scores(work, jax.device_get(scores[0]))
        if self.batch_job:
            jax.block_until_ready(self._device.state)
            self.counts.prefill_s += time.perf_counter() - started
        self._device.clear_spec_counters(slots)
        for seq, end in work:
            self._prometheus.prefill_chunk.observe(end - seq.prefilled)
            seq.placement.prefilled = end
            if end == len(seq.prompt) + seq.offset:  # the prompt is complete: the row decodes
                self._slot_table.start_decoding(seq)
                self.counts.prompt_tokens += end
                self.counts.prefix_cache_hit_tokens += seq.cached
                self._prometheus.prompt_tokens.inc(end)
                self._prometheus.prefix_hits.inc(seq.cached)
        self.counts.prefills += 1
        self.counts.padding_tokens += int(b * t - (lengths - offset).sum())

    def prefill_width(self, prompt_bucket: int) -> int:
        """The block-table width of a prefill of prompts of up to `prompt_bucket` tokens."""
        return self.pages.width(prompt_bucket)

    def prefill_program(self, chunk: PrefillChunk, options: StepOptions):
        """(the prefill program, its `PrefillArgs`) of a host `PrefillChunk`: its `next_token`
        matters only with a draft head (default there: the prompts end), its `counts` only with
        `options.penalties` (default: none seen), its `targets` only with
        `options.prompt_logprobs` (default: none); each is dropped (None) where it does not."""
        b = len(chunk.lengths)

        def read(value, used: bool, default):
            return None if not used else default() if value is None else value

        chunk = chunk._replace(
            next_token=read(
                chunk.next_token, bool(self.model.params.get("draft")), lambda: np.full((b,), -1, np.int32)
            ),
            counts=read(chunk.counts, options.penalties, lambda: TokenCounts.zeros(b, self.config.vocab_size)),
            targets=read(chunk.targets, options.prompt_logprobs, lambda: np.full(chunk.tokens.shape, -1, np.int32)),
        )
        # A prefill reads the stacked weights whatever the layout: its matmuls have a row per
        # prompt token, so copying a layer's slice costs little beside them, and its layer loop
        # then compiles as a loop, not 30 unrolled layers (SmolLM2: ~2.5 s less compile).
        args = PrefillArgs(
            self.model.params,
            self._device.cache,
            self._device.state_for(options),
            jax.tree.map(jnp.asarray, chunk),
        )
        program = self.model.programs.get(prefill_slots, args, self.config, options, donate_argnums=PREFILL_DONATED)
        return program, args

    def grow_pages(self) -> None:
        """Gives every running row the pages for the tokens it may hold after the step about to
        be dispatched (its known tokens, one in flight, one more), preempting when none is free."""
        running = self._slot_table.running
        for seq in sorted(running.values(), key=lambda s: (-s.priority, s.submitted_at)):
            if seq.slot is None:
                continue  # preempted in this loop
            need = pages_needed(self._dispatch.span(seq), self.page_size)
            while seq.slot is not None and not self.pages.grow(seq, need):
                self._preempt(self._waiting.victim(running.values()))

    def _preempt(self, seq: Sequence) -> None:
        """Frees a running row's slot and pages; it waits again and is recomputed (its prompt and
        the tokens it has) when admitted."""
        self._delivery.release(seq)
        self._waiting.queue(seq)
        seq.placement.preemptions += 1
        self.counts.preemptions += 1
        self._prometheus.preemptions.inc()
