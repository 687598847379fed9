"""The engine's dispatch part alone (`engine/dispatch.py`), on real slots and stand-ins for the
rest (no program runs): how many decode steps the next program runs, the cache positions a row
may have written once it ran (what its pages must cover), and the options rows share."""

import types

import numpy as np

import eejax.engine.dispatch as dispatch_module
from eejax.engine.dispatch import Dispatch
from eejax.engine.sequence import Request, Sequence
from eejax.engine.slots import SlotPages, SlotTable
from eejax.engine.speculation import Speculation
from eejax.options import SpecConfig, StepOptions

STEPS, N = 4, 32


def dispatch(batch_job: bool = False) -> tuple[Dispatch, SlotTable]:
    table = SlotTable(3, SlotPages(64, 3, 4, 16, prefix_caching=False))
    speculation = types.SimpleNamespace(span_drafts=Speculation.span_drafts)
    part = Dispatch(
        None,
        StepOptions(N),
        table,
        None,
        speculation,
        None,
        None,
        steps_per_dispatch=STEPS,
        batch_job=batch_job,
        prompt_positions=len,
    )
    return part, table


def decoding(table: SlotTable, slot: int, made: int, **kw) -> Sequence:
    seq = Sequence(Request(slot, [1] * 5, max_new_tokens=N, key=np.zeros((2,), np.uint32), **kw))
    table.admit(seq, slot, 5 + N)
    table.start_decoding(seq)
    seq.output.tokens = [7] * made
    return seq


def test_a_program_runs_several_steps_unless_a_row_would_idle_or_a_request_waits_on_it(monkeypatch):
    part, table = dispatch()
    part.choose_steps(waiting=False)
    assert part.next_steps == 1  # nothing running
    row = decoding(table, 0, made=2)
    part.choose_steps(waiting=False)
    assert part.next_steps == STEPS
    part.choose_steps(waiting=True)
    assert part.next_steps == STEPS  # far from its limit: no slot frees within the program
    row.output.tokens = [7] * (N - 3)
    part.choose_steps(waiting=True)
    assert part.next_steps == STEPS  # alone on a CPU: its program ends with it, no slot idles
    with monkeypatch.context() as gpu:
        gpu.setattr(dispatch_module, "ends_with_its_rows", lambda: False)  # a GPU's loop runs its trip count
        part.choose_steps(waiting=True)
    assert part.next_steps == 1  # the waiting request gets its slot at once
    part.choose_steps(waiting=False)
    assert part.next_steps == 1  # serving: its last tokens would wait for idle steps
    spec = decoding(table, 1, made=2, spec=SpecConfig.parse("2:3"))  # up to d + 1 = 4 tokens a round
    row.output.tokens = [7] * 2
    part.choose_steps(waiting=True)
    assert part.next_steps == STEPS  # 30 tokens to go: more than 1 + 4 rounds in flight and next make
    spec.output.tokens = [7] * (N - 4 * STEPS)
    part.choose_steps(waiting=True)
    assert part.next_steps == 1  # 16 to go: its limit may come within the rounds
    batch, batch_table = dispatch(batch_job=True)
    decoding(batch_table, 0, made=N - 3)
    batch.choose_steps(waiting=False)
    assert batch.next_steps == STEPS  # a batch job keeps its steps to the end


def test_a_rows_span_covers_the_program_in_flight_and_the_next_and_never_passes_its_limit():
    part, table = dispatch()
    plain = decoding(table, 0, made=3)
    part.steps_in_flight, part.next_steps = 4, 4
    # prompt 5 + 3 read + 4 in flight + 3 the next writes before its last token
    assert part.span(plain) == 5 + 3 + 4 + 3
    speculating = decoding(table, 1, made=3, spec=SpecConfig.parse("2:3"))
    part.steps_in_flight, part.next_steps = 2, 2
    # two rounds in flight (d + 1 = 4 each), the next program's first round and its second's d drafts
    assert part.span(speculating) == 5 + 3 + 2 * 4 + 4 + 3
    plain.output.tokens = [7] * (N - 2)
    assert part.span(plain) == 5 + N - 1  # nothing past the row's limit is written


def test_rows_alike_share_one_options_and_a_row_that_wants_more_gets_its_own():
    part, table = dispatch()
    a, b = decoding(table, 0, made=1), decoding(table, 1, made=1)
    scored = decoding(table, 2, made=1, logprobs=2)
    part.next_steps = STEPS
    assert part.options_of(a) is part.options_of(b) and part.options_of(a).num_steps == STEPS
    assert part.options_of(scored) != part.options_of(a) and part.options_of(scored).logprobs
    assert part.to_make(a) == N - 1  # nothing in flight: all but the one read


def test_a_plan_is_one_program_per_group_of_rows_alike_and_none_when_nothing_is_left_to_make():
    """`Dispatch.plan`'s `StepPlan`: the chosen steps, a (options, rows) group per program in
    the running rows' order; empty once every row has made its tokens."""
    part, table = dispatch()
    a, scored, b = decoding(table, 0, made=1), decoding(table, 1, made=1, logprobs=2), decoding(table, 2, made=1)
    part.choose_steps(waiting=False)
    plan = part.plan()
    assert plan.steps == STEPS and [rows for _, rows in plan.groups] == [(a, b), (scored,)]
    assert [options for options, _ in plan.groups] == [part.options_of(a), part.options_of(scored)]
    for seq in (a, scored, b):
        seq.output.tokens = [7] * N
    assert part.plan().groups == ()
