"""The engine's delivery and faults parts (`engine/delivery.py`, `engine/faults.py`) over real
queue, slot and device parts, without an engine: a read step's tokens reach their request and
its stream; a stop token, a stop string, EOS, the limit and a cancellation end it with their
finish reason, its slot and pages freed, the slot stopped on device and the waiting queue's
Request dropped. A failing program fails its rows only; one that lost the device arrays fails
every row in a slot, which are rebuilt; a step that failed elsewhere fails its rows, or the
waiting ones if no row held a slot."""

import jax
import numpy as np
import pytest

from eejax.decode.speculative import SpecCounters
from eejax.engine.delivery import Delivery
from eejax.engine.device_slots import DeviceSlots
from eejax.engine.dispatch import StepResult
from eejax.engine.faults import Faults
from eejax.engine.metrics import ServeMetrics
from eejax.engine.scheduler import BucketScheduler
from eejax.engine.sequence import Request, Sequence
from eejax.engine.slots import SlotPages, SlotTable
from eejax.engine.transfers import SlotsRead
from eejax.engine.waiting import WaitingQueue

SLOTS, N, EOS = 2, 6, 2


@pytest.fixture(scope="module")
def device(tiny_model):
    return DeviceSlots(tiny_model, SLOTS, max_new_tokens=N, num_pages=8, page_size=4, max_len=32)


def parts(tiny_model, device):
    table = SlotTable(SLOTS, SlotPages(8, SLOTS, 4, 8, prefix_caching=False))
    waiting = WaitingQueue(BucketScheduler(33, 4, max_rows=SLOTS), grow=False, prompt_positions=len)
    delivery = Delivery(tiny_model.tokenizer, (EOS,), table, device, waiting, ServeMetrics(4))
    return delivery, table, waiting, delivery


def running_row(table, waiting, slot: int, **kw) -> Sequence:
    seq = Sequence(Request(slot, [5, 6, 7], max_new_tokens=N, **kw))
    waiting.queue(seq)
    assert waiting.take(1, 8) == [seq]
    table.admit(seq, slot, 3 + N)
    table.start_decoding(seq)
    return seq


def result(seq: Sequence, slot: int, tokens: list[int], done: bool = False) -> StepResult:
    """A step's result for `seq` in `slot`, which made `tokens`."""
    num, flags = np.zeros((SLOTS,), np.int32), np.zeros((SLOTS,), bool)
    made = np.zeros((SLOTS, N), np.int32)
    num[slot], flags[slot], made[slot, : len(tokens)] = len(tokens), done, tokens
    counters = jax.tree.map(np.asarray, SpecCounters.zeros(SLOTS))
    return StepResult({slot: seq}, SlotsRead(num, flags, made, made * 0 + 4, made * 0 + 4, counters), None, 0.0)


def test_tokens_reach_the_request_and_its_stream_and_the_limit_ends_it(tiny_model, device):
    delivery, table, waiting, counters = parts(tiny_model, device)
    seq = running_row(table, waiting, 1)
    assert delivery.deliver(result(seq, 1, [9, 10])) == []  # no row failed
    assert seq.tokens == [9, 10] and seq.exit_layers == [4, 4] and not seq.finished
    assert counters.generated_tokens == 2
    delivery.deliver(result(seq, 1, [9, 10, 11, 12, 13, 14], done=True))
    assert seq.tokens == [9, 10, 11, 12, 13, 14] and seq.finish_reason == "length"
    assert list(seq.stream()) == seq.tokens
    assert not table.running and table.pages.metrics()["kv_pages_used"] == 0
    assert bool(device.state.done[1])
    with pytest.raises(KeyError):
        waiting.request(seq)


@pytest.mark.parametrize(
    "kw, made, reason, kept",
    [
        ({"stop_token_ids": (11,)}, [9, 11, 12], "stop", 2),  # tokens after a stop token are dropped
        ({}, [9, EOS], "stop", 2),
        ({}, [9, 10], "cancelled", 2),
    ],
)
def test_a_row_ends_with_its_finish_reason(tiny_model, device, kw, made, reason, kept):
    delivery, table, waiting, _ = parts(tiny_model, device)
    seq = running_row(table, waiting, 0, **kw)
    if reason == "cancelled":
        seq.output.ending = "cancelled"  # cancelled while its step was in flight
    delivery.deliver(result(seq, 0, made, done=made[-1] == EOS))
    assert seq.tokens == made[:kept] and seq.finish_reason == reason and seq.slot is None


def test_a_stop_string_ends_the_row_at_the_token_that_completes_it(tiny_model, device):
    delivery, table, waiting, _ = parts(tiny_model, device)
    text = tiny_model.tokenizer.decode([40, 41, 42], skip_special_tokens=True)
    seq = running_row(table, waiting, 0, stop=(text[-2:],))
    delivery.deliver(result(seq, 0, [40, 41, 42, 43]))
    assert seq.tokens == [40, 41, 42] and seq.finish_reason == "stop"
    seq.output.tokens = [40]
    assert delivery.stop_index(seq, [41, 42, 43]) == 1 and delivery.stop_index(seq, [41]) is None


def test_a_row_whose_delivery_raises_is_returned_and_fails_alone(tiny_model, device):
    """`Delivery.deliver` hands back the rows it failed on; `Faults.failed` ends each with "error"
    and the others keep their tokens."""
    delivery, table, waiting, _ = parts(tiny_model, device)
    broken, fine = running_row(table, waiting, 0, stop=("x",)), running_row(table, waiting, 1)
    delivery.tokenizer = None  # a stop string's check now raises
    one = result(broken, 0, [40, 41]).read
    both = one._replace(num_generated=one.num_generated[[0, 0]], tokens=one.tokens[[0, 0]])
    failed = delivery.deliver(StepResult({0: broken, 1: fine}, both, None, 0.0))
    assert [seq for seq, _ in failed] == [broken] and fine.tokens == [40, 41]
    Faults(waiting, table, device, delivery, lambda: None).failed(failed)
    assert broken.finish_reason == "error" and "AttributeError" in broken.error and not fine.finished


def test_a_request_ended_early_ends_now_unless_a_step_in_flight_has_its_tokens(tiny_model, device):
    delivery, table, waiting, _ = parts(tiny_model, device)
    decoding = running_row(table, waiting, 0)
    prefilling = Sequence(Request(1, [5, 6], max_new_tokens=N))
    waiting.queue(prefilling)
    waiting.take(1, 8)
    table.admit(prefilling, 1, 2 + N)
    queued = Sequence(Request(2, [5], max_new_tokens=N))
    waiting.queue(queued)
    for seq in (decoding, prefilling, queued):
        delivery.end(seq, "length" if seq is queued else "cancelled")
    assert queued.finish_reason == "length" and len(waiting) == 0
    assert prefilling.finish_reason == "cancelled" and prefilling.slot is None and not table.prefilling
    assert not decoding.finished and decoding.ending == "cancelled" and table.rows() == [decoding]


def test_a_failing_program_fails_its_rows_only_and_one_that_lost_the_device_arrays_every_row(tiny_model, device):
    delivery, table, waiting, _ = parts(tiny_model, device)
    lost = []
    faults = Faults(waiting, table, device, delivery, lambda: lost.append(True))
    a, b = running_row(table, waiting, 0), running_row(table, waiting, 1)
    queued = Sequence(Request(7, [5], max_new_tokens=N))
    waiting.queue(queued)

    def fails():
        raise RuntimeError("bad program")

    faults.guarded([a], fails)
    assert a.finish_reason == "error" and a.error == "RuntimeError: bad program" and a.slot is None
    assert not b.finished and not lost and table.rows() == [b]

    def loses_the_cache():
        jax.tree.map(lambda x: x.delete(), device.cache)
        raise RuntimeError("lost")

    faults.guarded([], loses_the_cache)
    assert b.finish_reason == "error" and lost and device.intact() and table.rows() == []
    assert not queued.finished and waiting.values() == [queued]


def test_a_step_that_failed_outside_a_program_fails_the_rows_in_slots_or_else_the_waiting(tiny_model, device):
    delivery, table, waiting, _ = parts(tiny_model, device)
    lost = []
    faults = Faults(waiting, table, device, delivery, lambda: lost.append(True))
    row = running_row(table, waiting, 0)
    queued = Sequence(Request(7, [5], max_new_tokens=N))
    waiting.queue(queued)
    faults.recover(RuntimeError("admission"))
    assert row.finish_reason == "error" and not queued.finished and lost == [True]
    faults.recover(RuntimeError("admission"))
    assert queued.finish_reason == "error" and len(waiting) == 0
