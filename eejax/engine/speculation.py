"""Self-speculation in the engine, a part of `Engine`: the rows of one speculation option and
sampler kind form a group with its own `SpeculationPolicy`, which picks the rounds' d (adaptive)
and whether the bonus pass runs, from the acceptance the engine reads back. A round program runs
several rounds, as many as a decode program runs steps (`Dispatch.plan`), at one d; an adaptive
group picks that d per program and costs a round as the wall time of the engine step that reads
the program over its rounds (`_time_program`; the policy weighs the measured costs), apart from
the single rounds that time the draft and the verify programs apart and the plain full-depth
steps taken while no round pays (`SpeculationPolicy`). Where the policy turns a draft head's
speculation off, its rows run as plain rows for good (`Sequence.spec_off`: their own group, plain
steps without the draft's catch-up, still counted as plain steps), and rows that come later get
a new policy. A priced policy whose group's rows are all new since its last program (a batch-1
job's next row) weighs what the last rows measured as a few drafts' evidence
(`SpeculationPolicy.new_rows`). It owns the policies and what it times of the programs it dispatched; the
programs take their arrays from `DeviceSlots` and give them back there."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eejax.decode import cost
from eejax.decode.sampling import GREEDY
from eejax.decode.slot_args import DraftArgs
from eejax.decode.spec_policy import SpeculationPolicy, round_prices
from eejax.decode.speculative import draft_slots, plain_step_slots, spec_round_slots, verify_slots
from eejax.engine.device_slots import DeviceSlots
from eejax.engine.sequence import Sequence
from eejax.models import exits
from eejax.options import StepOptions

PROGRAMS_RUN = weakref.WeakSet()  # the compiled programs this process has run (`run_timed`)


class Dispatched(NamedTuple):
    """An adaptive policy's program, for it to learn its cost from (`Speculation._time_program`):
    d (0: plain steps), draft passes per round, whether it ran for the first time, and its rounds
    or steps."""

    policy: SpeculationPolicy
    d: int
    passes: int
    first: bool
    count: int


def run_timed(program, args, timed: bool):
    """(program(*args), its wall seconds or None). Timed, it starts once what runs before it
    ended and the host waits for its end; untimed (also a program's first run in this
    process, which pays one-time costs: 3x a round's time was seen), it is dispatched
    asynchronously."""
    first = program not in PROGRAMS_RUN
    PROGRAMS_RUN.add(program)
    if not timed or first:
        return program(*args), None
    jax.block_until_ready(args)
    start = time.perf_counter()
    out = jax.block_until_ready(program(*args))
    return out, time.perf_counter() - start


class Speculation:
    """The speculating rows' policies and rounds. `batch_job`: the policies that turned their rows'
    speculation off are kept for the job's stats (`past_policies`); a server drops them.
    `steps_per_dispatch`: a decode program's steps (the plain programs warm-up compiles);
    `rows`: the engine's slots (a CPU's adaptive rounds are priced for one row: `round_prices`)."""

    def __init__(self, model, device: DeviceSlots, batch_job: bool, steps_per_dispatch: int, rows: int = 1):
        self.model, self.config, self._device, self.rows = model, model.config, device, rows
        # (row id, admission) -> its counts read: [accepted, rejections, *depth_judged, *depth_accepted]
        self._seen: dict[tuple[int, int], np.ndarray] = {}
        self.batch_job, self.steps_per_dispatch = batch_job, steps_per_dispatch
        self.policies: dict = {}  # (spec, sampler) -> the SpeculationPolicy of those rows
        self._rows: dict = {}  # (spec, sampler) -> the (row id, admission)s of its last program
        self.past_policies: list = []  # a batch job's that turned their rows' speculation off (stats)
        # Per speculation program of this step and of the last: a `Dispatched` (adaptive) or None;
        # and the programs (of any kind) this step and the last dispatched.
        self._dispatched: list = []
        self._last_dispatched: list = []
        self._programs_now = self._programs_last = 0

    def begin_step(self, programs: int) -> None:
        """A step is about to dispatch `programs` programs (decode programs and rounds)."""
        self._dispatched, self._programs_now = [], programs

    def end_step(self, seconds: float | None) -> None:
        """The step ended; `seconds`: its wall time, end to end, if it prefilled and compiled
        nothing (what the last step's program cost in the loop: `_time_program`)."""
        if seconds is not None:
            self._time_program(seconds)
        self._last_dispatched, self._programs_last = self._dispatched, self._programs_now

    def _policy(self, options: StepOptions) -> SpeculationPolicy:
        """The policy of the rows speculating with `options.spec` and `options.sampler` (a new
        one where the last turned its rows' speculation off: these rows came later; a batch job
        keeps the old one for its stats, a server drops it). In a batch job a priced policy's
        successor starts from the acceptance it measured, as a few drafts' evidence
        (`SpeculationPolicy.carried`): a batch's rows are often alike, and with each row measuring
        from nothing the news head's code requests ran 0.93-0.94x full depth on a CPU's blocks; a
        server's rows each measure again."""
        key = (options.spec, options.sampler)
        old = None
        if key in self.policies and self.policies[key].turned_off:
            old = self.policies.pop(key)
            if self.batch_job:
                self.past_policies.append(old)
        if key not in self.policies:
            spec = options.spec
            reduced = spec.uses_reduced_head(exits.has_reduced_head(self.model.params.get("exits")))
            unit_costs = cost.spec_unit_weights(
                cost.WeightCounts.of(self.model.params, self.config), spec.exit_layer, reduced, spec.draft_head
            )
            self.policies[key] = SpeculationPolicy(
                spec,
                unit_costs=unit_costs,
                sampled=options.sampler != GREEDY,
                prices=round_prices(
                    spec, self.model.quantization is not None, self.rows, float_draft=not self.model.drafts_in_blocks
                ),
            )
            if old is not None and self.batch_job and old.prices is not None:
                self.policies[key] = self.policies[key].carried(old)
        return self.policies[key]

    def dispatch(self, table, group, options: StepOptions, members: tuple[Sequence, ...], decode_steps: int) -> int:
        """Speculation rounds of `members`, the rows of the slots in `group`: as many as a decode
        program runs steps now (`decode_steps`), at the d the policy picks for this program (or
        plain steps in the rounds' place; one round where an adaptive policy times the draft
        passes apart). Returns the rounds or steps dispatched: the fewest tokens each row not
        done makes."""
        self._dispatched.append(None)
        if options.spec_off:
            self._dispatch_plain(table, group, options, decode_steps)
            return decode_steps
        policy = self._policy(options)
        key, rows = (options.spec, options.sampler), {(seq.id, seq.preemptions) for seq in members}
        if policy.prices is not None and key in self._rows and not rows & self._rows[key]:
            policy.new_rows()  # a batch-1 job's next row: it measures its own acceptance
        self._rows[key] = rows
        d = policy.next_speculations()
        if policy.turned_off:  # no round would pay even at a higher acceptance: off for good
            for seq in members:
                seq.spec_off = True
            # as many plain steps as the rounds would have run: the rows' pages cover more
            # (`Dispatch.span`: each round d + 1 positions)
            self._dispatch_plain(table, group, dataclasses.replace(options, spec_off=True), decode_steps)
            return decode_steps
        if d == 0:  # adaptive, and no round pays: plain steps in the rounds' place (as above)
            plain, args = self._plain_program(table, group, options, decode_steps)
            self._dispatched[-1] = Dispatched(policy, 0, decode_steps, plain not in PROGRAMS_RUN, decode_steps)
            outputs, seconds = run_timed(plain, args, self._must_wait(policy.c_full is not None))
            self._device.keep(*outputs)
            if seconds is not None:
                policy.observe_plain(seconds / decode_steps)
            return decode_steps
        bonus = policy.bonus(d)
        rounds = 1 if policy.split else decode_steps
        round_options = options.round(d, bonus, rounds)
        if policy.split:  # adaptive: time the draft passes apart from the verification (one round)
            draft, args = self._draft_program(table, group, round_options)
            (drafts, cache), draft_s = run_timed(draft, args, True)
            self._device.keep(cache=cache)
            verify, args = self._verify_program(table, group, drafts, round_options)
            outputs, verify_s = run_timed(verify, args, True)
            self._device.keep(*outputs)
            if draft_s is not None and verify_s is not None:
                policy.observe_times(d, draft_s, verify_s, passes=d + bonus)
            return 1
        program, args = self._round_program(table, group, round_options)
        timed = False
        if policy.spec.adaptive:
            self._dispatched[-1] = Dispatched(policy, d, d + bonus, program not in PROGRAMS_RUN, rounds)
            timed = self._must_wait(d in policy.whole_rounds)
        outputs, seconds = run_timed(program, args, timed)
        self._device.keep(*outputs)
        if seconds is not None:
            policy.observe_round(d, seconds / rounds, passes=d + bonus)
        return rounds

    def _must_wait(self, known: bool) -> bool:
        """Whether to time a program of an adaptive policy by waiting for it: where other
        programs run in the same step, its step's wall time is not its own (`_time_program`),
        so a cost the policy has no value for yet (not `known`) is timed alone."""
        return self._programs_now > 1 and not known

    def _time_program(self, seconds: float) -> None:
        """The previous step dispatched one program and this one prefilled and compiled nothing:
        this step's `seconds` (end to end) are that program's cost in the loop, as the host waited
        for it to read its tokens (with the host's own work that it could not hide). An adaptive
        policy learns its plain steps and whole rounds from these (a first run pays one-time
        costs: not counted)."""
        if self._programs_last != 1 or len(self._last_dispatched) != 1 or self._last_dispatched[0] is None:
            return
        last = self._last_dispatched[0]
        if last.first:
            return
        if last.d == 0:
            last.policy.observe_plain(seconds / last.count)
        else:
            last.policy.observe_round(last.d, seconds / last.count, passes=last.passes)

    def _dispatch_plain(self, table, group, options: StepOptions, steps: int) -> None:
        """`steps` plain full-depth steps of the slots in `group`, whose speculation is off, counted
        as the plain steps a round's place takes are (`speculative.plain_step`)."""
        plain, args = self._plain_program(table, group, options, steps)
        outputs, _ = run_timed(plain, args, False)
        self._device.keep(*outputs)

    # Each returns (program, args); `now`: compile the split layout's program before it runs (warm-up),
    # not in the background while the stacked one runs (`Model.program`).
    def _plain_program(self, table, group, options: StepOptions, steps: int, now: bool = False):
        plain = options.plain(steps, catch_up=not options.spec_off)
        return self._device.program(plain_step_slots, plain, (table, group), takes_counters=True, now=now)

    def _round_program(self, table, group, round_options: StepOptions, now: bool = False):
        return self._device.program(spec_round_slots, round_options, (table, group), takes_counters=True, now=now)

    def _draft_program(self, table, group, round_options: StepOptions, now: bool = False):
        state = self._device.state_for(round_options, counts=False)
        args = DraftArgs(self.model.run_params, self._device.cache, state, table, group)
        return self.model.program(draft_slots, args, round_options.drafting(), now)

    def _verify_program(self, table, group, drafts, round_options: StepOptions, now: bool = False):
        verifying = round_options.verifying()
        return self._device.program(verify_slots, verifying, (drafts, table, group), takes_counters=True, now=now)

    def compile(self, table, group, options: StepOptions) -> None:
        """Compiles (runs nothing) the programs rows speculating with `options` may run at page-table
        width `table`: every round's (with and without the bonus pass; one round and
        `steps_per_dispatch` rounds a program, at each d an adaptive policy may pick), and an
        adaptive group's plain steps (with a draft head, also those without its catch-up, once
        speculation is off), and the split round's draft and verify programs where it times costs."""
        spec = options.spec
        if not spec.adaptive:
            for bonus, rounds in itertools.product((False, True), {1, self.steps_per_dispatch}):
                self._round_program(table, group, options.round(spec.num_speculations, bonus, rounds), now=True)
            return
        for steps in {1, self.steps_per_dispatch}:
            self._plain_program(table, group, options, steps, now=True)
            if spec.draft_head:  # once the policy turns the rows' speculation off (`dispatch`)
                self._plain_program(table, group, dataclasses.replace(options, spec_off=True), steps, now=True)
        policy = self._policy(options)
        bonuses = policy.bonus_choices()
        for d, bonus, rounds in itertools.product(
            range(1, spec.max_speculations + 1), bonuses, {1, self.steps_per_dispatch}
        ):
            self._round_program(table, group, options.round(d, bonus, rounds), now=True)
        for bonus in bonuses if policy.timed else ():  # split rounds time a draft pass (priced: none)
            round_options = options.round(spec.num_speculations, bonus)
            draft, args = self._draft_program(table, group, round_options, now=True)
            shapes = jax.eval_shape(
                functools.partial(draft_slots, config=self.config, options=round_options.drafting()), *args
            )
            drafts = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[0])
            self._verify_program(table, group, drafts, round_options, now=True)

    def observe_acceptance(self, read: dict[int, Sequence], running, counters) -> None:
        """Gives each policy the drafts its rows accepted and the rounds that rejected one since
        the last read, and the same by draft position (`SpecCounters.depth_judged`): `read`,
        slot -> row of the step read; `running`, the rows decoding now (a row that left its slot
        since is skipped); counters: the host copy of the step's `SpecCounters`."""
        seen: dict = {}
        if self._seen:  # what it read of rows that left their slots is dropped
            live = {(seq.id, seq.preemptions) for seq in running.values()}
            self._seen = {admission: counts for admission, counts in self._seen.items() if admission in live}
        rows = [(slot, seq) for slot, seq in read.items() if seq.speculating and running.get(slot) is seq]
        if not rows:
            return
        slots = np.array([slot for slot, _ in rows])
        # Per row, one vector [accepted, rejections, *depth_judged, *depth_accepted], gathered at once.
        counts = np.concatenate(
            [
                counters.accepted[slots, None],
                counters.rejections[slots, None],
                counters.depth_judged[slots],
                counters.depth_accepted[slots],
            ],
            axis=1,
        ).astype(np.int64)
        for (_, seq), now in zip(rows, counts):
            # An admission's prefill zeroes its slot's counters: a row's reads count from there.
            admission = (seq.id, seq.preemptions)
            before = self._seen.get(admission, 0)
            self._seen[admission] = now
            key = (seq.spec, seq.sampling.sampler)
            seen[key] = seen.get(key, 0) + (now - before)
        depths = counters.depth_judged.shape[1]
        for (spec, sampler), new in seen.items():
            accepted, rejections = int(new[0]), int(new[1])
            if accepted or rejections:
                self.policies[spec, sampler].observe(
                    spec.num_speculations,
                    accepted,
                    rejections,
                    depth_judged=new[2 : 2 + depths],
                    depth_accepted=new[2 + depths :],
                )

    @staticmethod
    def span_drafts(seq: Sequence) -> int:
        """The most drafts a round of `seq` writes ahead of its last token."""
        if not seq.speculating:
            return 0
        return seq.spec.positions_ahead
