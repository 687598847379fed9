"""Self-speculation in the engine, a part of `Engine`: the rows of one speculation option and
sampler kind form a group with its own `SpeculationPolicy`, which picks each round's d (adaptive)
and whether the bonus pass runs, from the acceptance the engine reads back. A fixed d runs a
round as one program; an adaptive group runs draft and verify apart and times them (the policy
weighs their measured costs), or a plain full-depth step while no round pays. A mixin over the
engine's slots and device state."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from eejax.decode import cost
from eejax.decode.sampling import GREEDY
from eejax.decode.spec_policy import SpeculationPolicy
from eejax.decode.speculative import draft_slots, plain_step_slots, spec_round_slots, verify_slots
from eejax.engine.sequence import Sequence
from eejax.models import exits
from eejax.options import StepOptions


class Speculation:
    def _policy(self, options: StepOptions) -> SpeculationPolicy:
        """The policy of the rows speculating with `options.spec` and `options.sampler`."""
        key = (options.spec, options.sampler)
        if key not in self.policies:
            spec = options.spec
            reduced = spec.uses_reduced_head(exits.has_reduced_head(self.model.params.get("exits")))
            unit_costs = cost.spec_unit_weights(
                cost.WeightCounts.of(self.model.params, self.config), spec.exit_layer, reduced, spec.draft_head
            )
            self.policies[key] = SpeculationPolicy(spec, unit_costs=unit_costs, sampled=options.sampler != GREEDY)
        return self.policies[key]

    def _dispatch_round(self, table, group, options: StepOptions) -> None:
        """One speculation round of the slots in `group` (adaptive: or a plain step)."""
        policy = self._policy(options)
        d = policy.next_speculations()
        if d == 0:  # adaptive, and no round pays at the measured acceptance and costs
            plain, args = self._plain_program(table, group, options)
            start = time.perf_counter()
            state, self.cache, self.spec_counters = jax.block_until_ready(plain(*args))
            self._keep(state)
            policy.observe_plain(time.perf_counter() - start)
            return
        bonus = policy.bonus(d)
        round_options = options.round(d, bonus)
        if not options.spec.adaptive:
            program, args = self._round_program(table, group, round_options)
            state, self.cache, self.spec_counters = program(*args)
            self._keep(state)
            return
        draft, args = self._draft_program(table, group, round_options)
        start = time.perf_counter()
        drafts, self.cache = jax.block_until_ready(draft(*args))
        drafted_at = time.perf_counter()
        verify, args = self._verify_program(table, group, drafts, round_options)
        state, self.cache, self.spec_counters = jax.block_until_ready(verify(*args))
        self._keep(state)
        policy.observe_times(d, drafted_at - start, time.perf_counter() - drafted_at, passes=d + bonus)

    # Each returns (program, args); `now`: compile the split layout's program before it runs (warm-up),
    # not in the background while the stacked one runs (`Model.program`).
    def _plain_program(self, table, group, options: StepOptions, now: bool = False):
        args = (self.model.run_params, self.cache, self._with_counts(options), self.spec_counters, table, group)
        return self.model.program(plain_step_slots, args, options.plain(), now)

    def _round_program(self, table, group, round_options: StepOptions, now: bool = False):
        args = (self.model.run_params, self.cache, self._with_counts(round_options), self.spec_counters, table, group)
        return self.model.program(spec_round_slots, args, round_options, now)

    def _draft_program(self, table, group, round_options: StepOptions, now: bool = False):
        args = (self.model.run_params, self.cache, self.state, table, group)
        return self.model.program(draft_slots, args, round_options.drafting(), now)

    def _verify_program(self, table, group, drafts, round_options: StepOptions, now: bool = False):
        state = self._with_counts(round_options)
        args = (self.model.run_params, self.cache, state, drafts, self.spec_counters, table, group)
        return self.model.program(verify_slots, args, round_options.verifying(), now)

    def _compile_spec(self, table, group, options: StepOptions) -> None:
        """Compiles (runs nothing) the programs rows speculating with `options` may run at page-table
        width `table`: every round's (each d an adaptive policy may pick, with and without the
        bonus pass), and an adaptive group's plain step."""
        spec = options.spec
        if not spec.adaptive:
            for bonus in (False, True):
                self._round_program(table, group, options.round(spec.num_speculations, bonus), now=True)
            return
        self._plain_program(table, group, options, now=True)
        for d in range(1, spec.max_speculations + 1):
            for bonus in (False, True):
                round_options = options.round(d, bonus)
                draft, args = self._draft_program(table, group, round_options, now=True)
                shapes = jax.eval_shape(
                    functools.partial(draft_slots, config=self.config, options=round_options.drafting()), *args
                )
                drafts = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[0])
                self._verify_program(table, group, drafts, round_options, now=True)

    def _observe_acceptance(self, running: dict[int, Sequence], counters) -> None:
        """Gives each policy the drafts its rows accepted and the rounds that rejected one since
        the last read (counters: the host copy of a step's `SpecCounters`)."""
        seen: dict = {}
        for slot, seq in running.items():
            if seq.spec is None or self.running.get(slot) is not seq:
                continue
            accepted, rejections = int(counters.accepted[slot]), int(counters.rejections[slot])
            key = (seq.spec, seq.sampling.sampler)
            a, r = seen.get(key, (0, 0))
            seen[key] = (a + accepted - seq.spec_read[0], r + rejections - seq.spec_read[1])
            seq.spec_read = (accepted, rejections)
        for key, (accepted, rejections) in seen.items():
            if accepted or rejections:
                self.policies[key].observe(key[0].num_speculations, accepted, rejections)

    @staticmethod
    def _span_drafts(seq: Sequence) -> int:
        """The most drafts a round of `seq` writes ahead of its last token."""
        if seq.spec is None:
            return 0
        return seq.spec.max_speculations if seq.spec.adaptive else seq.spec.num_speculations
