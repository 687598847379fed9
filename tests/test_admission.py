"""The engine's admission part (`engine/admission.py`) over real queue, slot, device, delivery
and faults parts, with no engine and no dispatch (a stand-in gives each row's span): free slots
go to the rows the scheduler picks, with their pages; a prompt prefills in chunks, oldest
admission first, and decodes once whole; rows that grow take pages and, when none are left, the
lowest-priority row is preempted and waits again."""

import types

import numpy as np
import pytest

from eejax.engine.admission import Admission
from eejax.engine.delivery import Delivery
from eejax.engine.device_slots import DeviceSlots
from eejax.engine.faults import Faults
from eejax.engine.metrics import ServeMetrics
from eejax.engine.scheduler import BucketScheduler
from eejax.engine.sequence import Request, Sequence
from eejax.engine.slots import SlotPages, SlotTable
from eejax.engine.waiting import WaitingQueue
from eejax.options import StepOptions

SLOTS, PAGE, N = 2, 4, 8


def admission(model, num_pages: int, grow: bool = False, prefill_chunk=None, span=None):
    waiting = WaitingQueue(BucketScheduler(33, PAGE, max_rows=SLOTS, margin=0.0), grow, len)
    table = SlotTable(SLOTS, SlotPages(num_pages, SLOTS, PAGE, 8, prefix_caching=False))
    device = DeviceSlots(model, SLOTS, N, num_pages, PAGE, max_len=32)
    prometheus = ServeMetrics(model.config.num_layers)
    delivery = Delivery(model.tokenizer, (), table, device, waiting, prometheus)
    faults = Faults(waiting, table, device, delivery, lambda: None)
    dispatch = types.SimpleNamespace(span=span)  # only a growing row's span is asked for
    part = Admission(
        model,
        StepOptions(N),
        waiting,
        table,
        device,
        dispatch,
        delivery,
        faults,
        prometheus,
        max_len=32,
        max_prompt_tokens=None,
        prefill_chunk=prefill_chunk,
        grow=grow,
        batch_job=False,
        prompt_positions=len,
    )
    return part, waiting, table, part.counts


def test_free_slots_go_to_the_rows_the_scheduler_picks_with_all_their_pages(tiny_model):
    part, waiting, table, _ = admission(tiny_model, num_pages=16)
    seqs = [Sequence(Request(i, [3] * 5, max_new_tokens=N)) for i in range(3)]
    for seq in seqs:
        waiting.queue(seq)
    part.admit()
    assert dict(table.prefilling) == {0: seqs[0], 1: seqs[1]} and waiting.values() == [seqs[2]]
    assert [len(s.pages) for s in seqs[:2]] == [-(-(5 + N) // PAGE)] * 2  # reserved: prompt + max tokens


@pytest.fixture(scope="module")
def chunked(tiny_model):
    return admission(tiny_model, num_pages=16, prefill_chunk=6)


def test_prompts_prefill_in_chunks_oldest_first_and_decode_once_whole(chunked):
    part, waiting, table, counters = chunked
    key = np.zeros((2,), np.uint32)
    first = Sequence(Request(0, list(range(3, 11)), max_new_tokens=N, key=key))
    second = Sequence(Request(1, [5, 6, 7], max_new_tokens=N, key=key))
    for seq in (first, second):
        waiting.queue(seq)
    part.admit()
    part.prefill_some()  # 6 tokens this step: all to the oldest
    assert (first.prefilled, second.prefilled) == (6, 0) and not table.running
    part.prefill_some()  # its last 2, then the other's 3
    assert (first.prefilled, second.prefilled) == (8, 3) and dict(table.running) == {0: first, 1: second}
    assert counters.prompt_tokens == 11 and counters.prefills == 2 and not first.finished


def test_a_growing_row_takes_pages_and_the_lowest_priority_is_preempted_when_none_are_left(tiny_model):
    spans = {}
    part, waiting, table, counters = admission(tiny_model, num_pages=6, grow=True, span=lambda seq: spans[seq.id])
    low, high = (
        Sequence(Request(0, [3] * 6, max_new_tokens=N, priority=0)),
        Sequence(Request(1, [4] * 6, max_new_tokens=N, priority=1)),
    )
    for seq in (low, high):
        waiting.queue(seq)
    part.admit()
    assert [len(s.pages) for s in (low, high)] == [2, 2]  # grow: the prompt and one token
    for seq in (low, high):
        table.start_decoding(seq)  # as if prefilled
    spans.update({0: 9, 1: 9})
    part.grow_pages()  # each needs 3 pages: 5 usable (page 0 is the null page) hold one more
    assert high.slot is not None and len(high.pages) == 3
    assert low.slot is None and low.pages == [] and waiting.values() == [low] and low.preemptions == 1
    assert counters.preemptions == 1
