"""Admission and prefill, a part of `Engine`: which waiting requests get a decode slot and
pages, how their prompts reach the cache (whole, or `prefill_chunk` tokens per step, after the
pages of a prefix the cache already holds), pages for rows that grow, and preemption when none
is left. A mixin over the engine's device state; slots and pages change only through its
`SlotTable` (`engine/slots.py`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from eejax.cache import pages_needed
from eejax.decode.buckets import MIN_PROMPT_BUCKET, bucket
from eejax.decode.penalties import TokenCounts
from eejax.decode.programs import MAPS_PER_PROGRAM, map_headroom
from eejax.decode.sampling import FILTERED, RowSampling, SamplingParams
from eejax.decode.steps import prefill_slots
from eejax.engine.sequence import Sequence
from eejax.options import StepOptions

log = logging.getLogger("eejax.serve")


class Admission:
    def _span(self, seq: Sequence) -> int:
        """Cache positions a running row may have written once the program about to be
        dispatched has run. The host reads a program's tokens after dispatching the next one, so
        beyond the prompt and the tokens read back the device may hold those of the program in
        flight (its decode steps; a speculation round d + 1) and, until the first read after
        admission, the prefill's token; the new program then writes its steps' tokens but the
        last, and up to d positions past it (a round's drafts). Never more than prompt + max
        tokens - 1: nothing past a row's limit is written."""
        d = self._span_drafts(seq)
        in_flight, steps = (1, 1) if seq.speculating else (self._steps_in_flight, self._next_steps)
        unread = in_flight * (d + 1) + (len(seq.tokens) == seq.offset)
        ahead = (steps - 1) * (d + 1) + d
        prompt = self._cache_prompt_len(seq.prompt)
        return min(prompt + len(seq.tokens) + unread + ahead, prompt + seq.max_new_tokens - 1)

    def _admit(self) -> None:
        free = self.slot_table.free()
        start = time.perf_counter()
        seqs = self.waiting.take(len(free), self.pages.num_free)
        self.counters["scheduler_s"] += time.perf_counter() - start
        for seq, slot in zip(seqs, free):
            seq.offset = len(seq.tokens)
            positions = self._cache_prompt_len(seq.prompt) + (seq.offset + 1 if self.grow else seq.max_new_tokens)
            self.slot_table.admit(seq, slot, positions)  # (admission counted every page as fresh)
            seq.spec_read = (0, 0)  # the prefill zeroes the slot's speculation counters
            seq.prefilled = seq.cached

    def _prefill_some(self) -> None:
        """Prefills the admitted rows' prompts: whole, or with `prefill_chunk`, that many tokens
        in all this step, the oldest admission first. A row whose prompt is then complete has
        sampled its first token and decodes from the next step."""
        budget = self.prefill_chunk or float("inf")
        work = []
        for seq in self.prefilling.values():
            if budget <= 0:
                break
            end = int(min(len(seq.prompt) + seq.offset, seq.prefilled + budget))
            budget -= end - seq.prefilled
            work.append((seq, end))

        # Options taken before any prefill runs: a prefill changes them (a scored prompt, once
        # scored, is not scored again), and a row must not join a second group.
        options = [self._prefill_options(seq) for seq, _ in work]
        for group in dict.fromkeys(options):
            members = [item for item, o in zip(work, options) if o == group]
            self.faults.guarded([seq for seq, _ in members], self._prefill, members, group)

    def _prefill_options(self, seq: Sequence) -> StepOptions:
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
    def _resume_width(self) -> int:
        """The page-table width of a prefill that starts after cached tokens (a shared prefix, an
        earlier chunk): that of the longest prompt `max_prompt_tokens`, whatever its own, so that
        such prefills compile one program per chunk bucket rather than one per (chunk, prompt)
        pair (their attention then reads a few more pages of the null page, masked)."""
        longest = min(self.max_prompt_tokens or self.max_len, self.max_len)
        return self._prefill_width(bucket(longest, MIN_PROMPT_BUCKET))

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
        width = self._prefill_width(longest)
        if any(seq.prefilled > 0 for seq, _ in work):
            width = max(width, self._resume_width)
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
                self.device.set_prompt(seq.slot, prompt)
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
        program, args = self._prefill_program(
            tokens, lengths, table, slots, keys, start, limit, sampling, offset, options, next_token, counts, targets
        )
        started = time.perf_counter()
        state, cache, *scores = program(*args)
        self.device.keep(state, cache)
        if scores:
            self._record_prompt_scores(work, jax.device_get(scores[0]))
        if self.batch_job:
            jax.block_until_ready(self.device.state)
            self.counters["prefill_s"] += time.perf_counter() - started
        self.device.clear_spec_counters(slots)
        for seq, end in work:
            self.prometheus.prefill_chunk.observe(end - seq.prefilled)
            seq.prefilled = end
            if end == len(seq.prompt) + seq.offset:  # the prompt is complete: the row decodes
                self.slot_table.start_decoding(seq)
                self.counters["prompt_tokens"] += end
                self.counters["prefix_cache_hit_tokens"] += seq.cached
                self.prometheus.prompt_tokens.inc(end)
                self.prometheus.prefix_hits.inc(seq.cached)
        self.counters["prefills"] += 1
        self.counters["padding_tokens"] += int(b * t - (lengths - offset).sum())

    @staticmethod
    def _record_prompt_scores(work: list[tuple[Sequence, int]], scores) -> None:
        """Appends to each row's prompt log-probs those of its positions prefilled..end-1 (host
        `PromptScores` [b, T]); the first prompt token gets None."""
        for j, (seq, end) in enumerate(work):
            if not seq.prompt_token_logprobs:
                seq.prompt_token_logprobs.append(None)
                seq.prompt_top_logprobs.append(None)
            for i in range(min(end, len(seq.prompt) - 1) - seq.prefilled):
                seq.prompt_token_logprobs.append(float(scores.chosen[j, i]))
                top = zip(scores.top_ids[j, i, : seq.prompt_logprobs], scores.top[j, i, : seq.prompt_logprobs])
                seq.prompt_top_logprobs.append([(int(a), float(b)) for a, b in top])

    def _prefill_width(self, prompt_bucket: int) -> int:
        return min(self.table_width, bucket(pages_needed(prompt_bucket, self.page_size)))

    def _prefill_program(
        self,
        tokens,
        lengths,
        table,
        slots,
        keys,
        start,
        limit,
        sampling: RowSampling,
        offset,
        options: StepOptions,
        next_token=None,
        counts: TokenCounts | None = None,
        targets=None,
    ):
        """The prefill program and its arguments; `next_token` [b] only matters with a draft head
        (`steps.prefill`), and is passed only then; `counts` (host `TokenCounts` [b]) only with
        `options.penalties` (default: none seen), `targets` [b, T] only with
        `options.prompt_logprobs` (default: none)."""
        b = len(lengths)
        extra = options.penalties or options.prompt_logprobs  # arguments after next_token
        if (self.model.params.get("draft") or extra) and next_token is None:
            next_token = np.full((b,), -1, np.int32)
        # A prefill reads the stacked weights whatever the layout: its matmuls have a row per
        # prompt token, so copying a layer's slice costs little beside them, and its layer loop
        # then compiles as a loop, not 30 unrolled layers (SmolLM2: ~2.5 s less compile).
        args = (
            self.model.params,
            self.device.cache,
            self.device.state_for(options),
            *map(jnp.asarray, (tokens, lengths, table, slots, keys, start, limit)),
            jax.tree.map(jnp.asarray, sampling),
            jnp.asarray(offset),
        )
        if self.model.params.get("draft") or extra:
            args += (jnp.asarray(next_token),)
        if options.penalties:
            counts = TokenCounts.zeros(b, self.config.vocab_size) if counts is None else counts
            args += (jax.tree.map(jnp.asarray, counts),)
        elif extra:
            args += (None,)
        if options.prompt_logprobs:
            args += (jnp.asarray(np.full(tokens.shape, -1, np.int32) if targets is None else targets),)
        return self.model.programs.get(prefill_slots, args, self.config, options, donate_argnums=(1,)), args

    def warmup(self, max_prompt_len: int | None = None, progress: bool = True, requests=()) -> int:
        """Compiles ahead of the first requests the programs they will need, for the engine's own
        options and for each of `requests` (dicts of `submit`'s options: exit, spec, temperature,
        top_k, top_p, logprobs, prompt_logprobs and the penalties; checked as `submit` checks them,
        and counted among the decoding options served): prefill for every batch bucket up to the
        slots x every prompt bucket up to `max_prompt_len` (default: the context), in its own
        table and, where a prefill may start after cached tokens (prefix caching, chunks), in the
        `_resume_width` one (prefill programs do not depend on sampling: `_prefill_options`);
        decode for every page-table width up to that prompt + max new tokens, of one step and of
        `steps_per_dispatch`, or every speculation round (`_compile_spec`). Nothing runs. Returns
        how many programs were new. Mind the count: each compiled program maps memory, and an
        XLA:CPU process here failed ("LLVM compilation error: Cannot allocate memory") at ~340
        SmolLM2 programs (vm.max_map_count 65530)."""
        from tqdm.auto import tqdm

        seqs = [self.submit([0], max_new_tokens=1, queue=False, **r) for r in ({}, *requests)]
        longest_prompt = self.max_prompt_tokens or self.max_len
        max_prompt_len = min(max_prompt_len or longest_prompt, longest_prompt)
        batches = sorted({bucket(n) for n in range(1, self.slots + 1)})
        prompts = sorted({bucket(n, MIN_PROMPT_BUCKET) for n in range(1, max_prompt_len + 1)})
        longest = min(self._cache_prompt_len(range(max_prompt_len)) + self.max_new_tokens - 1, self.max_len)
        widths = sorted({min(self.table_width, bucket(pages_needed(n, self.page_size))) for n in range(1, longest + 1)})
        group = jnp.zeros((self.slots,), bool)
        before = self.model.programs.num_programs

        def prefill(b, t, width, options):
            zeros = np.zeros((b,), np.int32)
            table = np.zeros((b, width), np.int32)
            args = (np.zeros((b, t), np.int32), zeros, table, zeros, np.zeros((b, 2), np.uint32), zeros, zeros)
            self._prefill_program(*args, RowSampling.of(self.sampling, b), zeros, options)

        def decode(width, options):
            table = jnp.zeros((self.slots, width), jnp.int32)
            if options.spec is None:
                self._decode_program(table, group, options, now=True)
            else:
                self._compile_spec(table, group, options)

        work = []
        prefill_options = {self._prefill_options(s): None for s in seqs}
        for options in prefill_options:
            # A prefill after cached tokens (a shared prefix, unless the prompt is scored; an
            # earlier chunk) writes into the wider `_resume_width` table.
            resumes = (self.pages.prefix_caching and not options.prompt_logprobs) or self.prefill_chunk is not None
            for b in batches:
                for t in prompts:
                    first = self._prefill_width(t)
                    for width in sorted({first, max(first, self._resume_width)} if resumes else {first}):
                        work.append(functools.partial(prefill, b, t, width, options))
        decode_options = {}
        for s in seqs:
            options = self._options(s)
            steps = {1, self.steps_per_dispatch} if options.spec is None else {1}
            decode_options.update({dataclasses.replace(options, num_steps=k): None for k in steps})
        prefills = len(work)
        work += [functools.partial(decode, w, options) for options in decode_options for w in widths]
        headroom = map_headroom() if jax.default_backend() == "cpu" else None
        # Prefills read the stacked weights in either layout; decode programs use the model's.
        maps = prefills * MAPS_PER_PROGRAM["stacked"] + (len(work) - prefills) * MAPS_PER_PROGRAM[self.model.layout]
        if headroom is not None and maps > headroom:
            log.warning(
                "warm-up compiles %d programs, ~%d memory maps in all (XLA:CPU): more than the %d this "
                "process has left under vm.max_map_count, and compiling then fails ('Cannot allocate memory'): "
                "raise it (sysctl -w vm.max_map_count=262144), warm fewer kinds of request, or use the "
                "stacked layer layout (a quarter of the maps)",
                len(work),
                maps,
                headroom,
            )
        for compile_one in tqdm(work, desc="compiling", disable=not progress):
            compile_one()
        return self.model.programs.num_programs - before

    def _grow(self) -> None:
        """Gives every running row the pages for the tokens it may hold after the step about to
        be dispatched (its known tokens, one in flight, one more), preempting when none is free."""
        for seq in sorted(self.running.values(), key=lambda s: (-s.priority, s.submitted_at)):
            if seq.slot is None:
                continue  # preempted in this loop
            need = pages_needed(self._span(seq), self.page_size)
            while seq.slot is not None and not self.pages.grow(seq, need):
                self._preempt(self.waiting.victim(self.running.values()))

    def _preempt(self, seq: Sequence) -> None:
        """Frees a running row's slot and pages; it waits again and is recomputed (its prompt and
        the tokens it has) when admitted."""
        self.delivery.release(seq)
        self.waiting.queue(seq)
        seq.preemptions += 1
        self.counters["preemptions"] += 1
        self.prometheus.preemptions.inc()
