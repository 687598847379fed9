"""Dispatch of programs and the one-behind read, a part of the `Engine`: each step, one program
per group of running rows with the same options (`StepOptions`: early exit, sampler, log-probs,
penalties, speculation) over the slots' block table; then the outputs of the program dispatched
one step earlier are read and delivered (`Delivery`) while the new one runs, so host work
overlaps device work. A decode program runs several steps (`steps_per_dispatch`) unless
admission would wait on them; a speculation group runs as many rounds (`Speculation`).

It owns what is in flight: the outputs on their way to the host and the rows they are for, the
decode steps of the program in flight and of the next, the options made for rows, and the
step's timing (which an adaptive speculation policy learns its costs from)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from eejax.decode.steps import decode_slots, ends_with_its_rows
from eejax.engine.delivery import Delivery
from eejax.engine.device_slots import DeviceSlots
from eejax.engine.faults import Faults
from eejax.engine.sequence import Sequence
from eejax.engine.slots import SlotTable
from eejax.engine.speculation import Speculation
from eejax.engine.transfers import PackedRead, SlotsRead, copied, read_tree
from eejax.options import StepOptions
from eejax.sharding import to_host


class StepPlan(NamedTuple):
    """What a step dispatches (`Dispatch.plan`), consumed by `Dispatch.dispatch_and_read`.

    steps:  decode steps (a speculation group: rounds) each program runs
    groups: one program per (options, rows) pair of the running rows alike (empty: nothing to
            dispatch: the program in flight ends every row at its limit)
    """

    steps: int
    groups: tuple[tuple[StepOptions, tuple[Sequence, ...]], ...]


class StepResult(NamedTuple):
    """What a finished program made, on the host (`Dispatch` reads it one step later), consumed
    by `Delivery.deliver`.

    rows:    slot -> the row the program ran for that still holds its slot, not finished
    read:    the host copies of the slots' tokens, counts and flags (`SlotsRead`)
    record:  their log-prob record (`LogProbRecord` of host arrays), or None
    read_at: when they were read (perf_counter): the time of each of the rows' new tokens
    """

    rows: dict[int, Sequence]
    read: SlotsRead
    record: Any
    read_at: float


class InFlight(NamedTuple):
    """The last dispatched program, not read yet.

    outputs: its outputs on their way to the host (`Dispatch._outputs`)
    rows:    slot -> the row it ran for (a row's slot may be another's by the time it is read)
    made:    slot -> the fewest tokens the row's program makes (its decode steps or rounds)
    """

    outputs: tuple
    rows: dict[int, Sequence]
    made: dict[int, int]


class Dispatch:
    """`options`: the engine's programs' options, which a group's replace; `steps_per_dispatch`:
    decode steps per program (1: always one); `batch_job`: every request is known (programs keep
    their steps to the end); `prompt_positions(prompt)`:
    the cache positions a prompt takes. `steps` counts the programs it dispatched."""

    def __init__(
        self,
        model,
        options: StepOptions,
        slot_table: SlotTable,
        device: DeviceSlots,
        speculation: Speculation,
        delivery: Delivery,
        faults: Faults,
        *,
        steps_per_dispatch: int,
        batch_job: bool,
        prompt_positions: Callable[[list[int]], int],
    ):
        self.model, self.options = model, options
        self._slot_table, self._device, self._speculation = slot_table, device, speculation
        self._delivery, self._faults = delivery, faults
        self.steps = 0  # programs dispatched, summed (`Engine.metrics`)
        self.steps_per_dispatch, self.batch_job = steps_per_dispatch, batch_job
        self.prompt_positions = prompt_positions
        self._running = slot_table.running  # read-only view
        self._pending: InFlight | None = None  # the last dispatched program, not read yet
        self._made: dict[int, int] = {}  # slot -> the fewest tokens, of the programs being dispatched
        # Decode steps of the program in flight (read after the next dispatch; 0: none), and of the next.
        self.steps_in_flight = self.next_steps = 1
        self._options_made: dict[tuple, StepOptions] = {}  # `options`' by what a row asks for
        self._last_step_end: float | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a program's outputs are still to be read."""
        return self._pending is not None

    def drop_in_flight(self) -> None:
        """Forgets the program in flight, whose outputs will never be read (`Faults`)."""
        self._pending = None

    # -- planning the next program -------------------------------------------------------------
    def step_started(self) -> float | None:
        """When the last step that completed ended (None: the last raised, or none ran)."""
        last_end, self._last_step_end = self._last_step_end, None
        return last_end

    def choose_steps(self, waiting: bool) -> None:
        """Decode steps (a speculation group: rounds) in the next program: `steps_per_dispatch`
        (one dispatch and one read per several tokens) unless a prompt is being prefilled (chunks
        come every step), or requests wait (`waiting`) and a row may reach its limit within the
        program (its slot and pages go to them at once), or (serving) no row has that many steps
        to go: its last tokens would wait for the program's idle steps. (A row ending at EOS
        inside a program keeps its slot to the program's end; a row running alone on a CPU does not:
        its program ends with it, `steps.ends_with_its_rows`.) A round makes up to d + 1 tokens."""
        self.next_steps = 1
        if self._slot_table.prefilling or not self._running:
            return
        to_go = [
            (seq.max_new_tokens - len(seq.tokens)) // (self._speculation.span_drafts(seq) + 1)
            for seq in self._running.values()
        ]
        enough = self.steps_per_dispatch + self.steps_in_flight
        if waiting:
            alone = len(to_go) == 1 and ends_with_its_rows()  # nothing idles in its slot
            self.next_steps = self.steps_per_dispatch if alone or min(to_go) > enough else 1
        elif self.batch_job or max(to_go) > enough:
            self.next_steps = self.steps_per_dispatch

    def span(self, seq: Sequence) -> int:
        """Cache positions a running row may have written once the program about to be
        dispatched has run. The host reads a program's tokens after dispatching the next one, so
        beyond the prompt and the tokens read back the device may hold those of the program in
        flight (its decode steps; a speculation round's d + 1 each) and, until the first read
        after admission, the prefill's token; the new program then writes its steps' tokens but
        the last, and up to d positions past it (a round's drafts). Never more than prompt + max
        tokens - 1: nothing past a row's limit is written."""
        d = self._speculation.span_drafts(seq)
        unread = self.steps_in_flight * (d + 1) + (len(seq.tokens) == seq.offset)
        ahead = (self.next_steps - 1) * (d + 1) + d
        prompt = self.prompt_positions(seq.prompt)
        return min(prompt + len(seq.tokens) + unread + ahead, prompt + seq.max_new_tokens - 1)

    def to_make(self, seq: Sequence) -> int:
        """Tokens a running row still has to make beyond those it surely has: read back, the
        prefill's first token, and those of the program in flight (its decode steps, at least
        one per speculation round)."""
        made = len(seq.tokens) + (len(seq.tokens) == seq.offset)
        pending = self._pending
        if self.steps_in_flight and pending is not None and pending.rows.get(seq.slot) is seq:
            made += pending.made.get(seq.slot, 0)
        return seq.max_new_tokens - made

    def options_of(self, seq: Sequence) -> StepOptions:
        """The options of a row's decode program; rows alike share one. (Greedy rows never share
        a program with sampled ones: their argmax runs alone; nor do rows that filter (top-k /
        top-p: a sort) with rows that only scale.) A speculation round's d and bonus pass come from
        its group's policy at dispatch (`Speculation`)."""
        sampler, logprobs, penalties = seq.sampling.sampler, seq.logprobs is not None, seq.sampling.penalized
        if seq.spec is not None:
            key = (sampler, logprobs, penalties, True, seq.spec, seq.spec_off)
        else:
            key = (sampler, logprobs, penalties, False, seq.exit, self.next_steps)
        options = self._options_made.get(key)  # made once: each row asks at every dispatch
        if options is None:
            if len(self._options_made) >= 256:  # a server's requests may ask for ever new exits
                self._options_made.clear()
            options = dataclasses.replace(self.options, sampler=sampler, logprobs=logprobs, penalties=penalties)
            if seq.spec is not None:
                options = dataclasses.replace(options, spec=seq.spec, spec_off=seq.spec_off)
            else:
                options = dataclasses.replace(options, exit=seq.exit, num_steps=self.next_steps)
            self._options_made[key] = options
        return options

    # -- dispatching and reading ---------------------------------------------------------------
    def plan(self) -> StepPlan:
        """The step's programs: one per option group of the running rows (usually one; the other
        rows wait through it), with `choose_steps`'s steps; none when the program in flight ends
        every row at its limit."""
        groups: dict[StepOptions, list[Sequence]] = {}
        if any(self.to_make(seq) > 0 for seq in self._running.values()):
            for seq in self._running.values():
                groups.setdefault(self.options_of(seq), []).append(seq)
        return StepPlan(self.next_steps, tuple((options, tuple(rows)) for options, rows in groups.items()))

    def dispatch_and_read(self, plan: StepPlan) -> None:
        """Dispatches `plan`'s programs, then reads the program dispatched before (`StepResult`)
        and delivers it."""
        pending = self._pending
        self._speculation.begin_step(len(plan.groups))
        self._made = {}
        if plan.groups:
            table = self.table()
            slots = self._slot_table.size
            for options, members in plan.groups:
                group = np.zeros((slots,), bool)
                group[[seq.slot for seq in members]] = True
                group = self._device.upload(("group", group.tobytes()), group)
                self._faults.guarded(members, self.dispatch, table, group, options, members, plan.steps)
        # Read next step even without a dispatch: a row's last tokens may be on device unread.
        self._pending = InFlight(self._outputs(), dict(self._running), self._made) if self._running else None
        self.steps_in_flight = plan.steps if plan.groups else 0  # 0: nothing in flight
        if pending is not None:
            self._read(pending.outputs, pending.rows)

    def step_ended(self, end: float, seconds: float | None) -> None:
        """The step ended at `end`; `seconds`: its wall time if it prefilled and compiled nothing
        (an adaptive policy's cost of the last step's program: `Speculation.end_step`)."""
        self._speculation.end_step(seconds)
        self._last_step_end = end

    def dispatch(self, table, group, options: StepOptions, members: tuple[Sequence, ...], steps: int) -> None:
        """Dispatches one program of `members`, the rows of the slots in `group`:
        `options.num_steps` decode steps, or speculation rounds (`steps` of them, the plan's)."""
        if options.spec is None:
            program, args = self.decode_program(table, group, options)
            self._device.keep(*program(*args))
            made = options.num_steps
        else:
            made = self._speculation.dispatch(table, group, options, members, steps)
        self._made.update((seq.slot, made) for seq in members)
        self.steps += 1

    def table(self):
        """The block table of the running rows, as wide as the longest needs (bucketed)."""
        longest = max(self.span(s) for s in self._running.values())
        width = self._slot_table.pages.width(longest)
        return self._device.upload(("table", width), self._slot_table.pages.table(width))

    def decode_program(self, table, group, options: StepOptions, now: bool = False):
        """The decode program of `options` and its arguments (`now`: compile the split layout's
        before it runs, as warm-up does; `Model.program`)."""
        return self._device.program(decode_slots, options, (table, group), now=now)

    def _outputs(self):
        """What `_read` takes of the state just dispatched: its tokens, counts and flags packed
        for one transfer, started now (`PackedRead`: as the last program packed them, else packed
        now), and a copy of the log-probs if a row wants them (the next program, dispatched
        before they are read, donates the state)."""
        device, state = self._device, self._device.state
        packed = device.packed
        if packed is not None and (jax.process_count() == 1 or packed.is_fully_addressable):
            read = PackedRead.started(packed, device.read_layout)
        else:
            read = PackedRead(read_tree(state, device.spec_counters))
        scored = any(seq.logprobs is not None for seq in self._running.values())
        return read, copied(state.logprobs) if scored else None  # the next program donates the state

    def _read(self, outputs, running: dict[int, Sequence]) -> None:
        """Reads a finished program's outputs (a `StepResult`) and delivers them (`Delivery`):
        rows that ended (EOS, limit, stop token or string, cancelled) are released. If the
        program failed on the device, its requests fail; a row whose delivery raised fails alone."""
        packed, logprobs = outputs
        out = {}

        def fetch():
            out["read"], out["record"] = packed.read(), None if logprobs is None else to_host(logprobs)

        self._faults.guarded(list(running.values()), fetch)
        if "read" not in out:
            return
        read = out["read"]
        self._speculation.observe_acceptance(running, self._running, read.spec_counters)
        # A row not running in its slot any more ended, or was preempted (recomputed later).
        rows = {slot: seq for slot, seq in running.items() if not seq.finished and self._running.get(slot) is seq}
        failed = self._delivery.deliver(StepResult(rows, read, out["record"], time.perf_counter()))
        if failed:
            self._faults.failed(failed)
