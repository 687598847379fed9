"""The engine's waiting queue alone (`engine/waiting.py`): rows queue with the pages they need,
the scheduler's picks leave it in order, a waiting row is removed once, a preempted row comes
back needing its tokens' pages too, and the victim of a preemption is the lowest priority."""

import pytest

from eejax.engine.scheduler import BucketScheduler
from eejax.engine.sequence import Request, Sequence
from eejax.engine.waiting import WaitingQueue


def queue(grow: bool = False) -> WaitingQueue:
    scheduler = BucketScheduler(65, 4, policy="fcfs", bucketing=True, online=True, max_rows=4, margin=0.0)
    return WaitingQueue(scheduler, grow, len)


def test_rows_leave_in_the_order_the_scheduler_admits_and_keep_their_request_until_they_finish():
    waiting = queue()
    seqs = [Sequence(Request(i, [1] * 5, max_new_tokens=3)) for i in range(3)]
    for seq in seqs:
        waiting.queue(seq)
    assert len(waiting) == 3 and seqs[1] in waiting and waiting.values() == seqs
    assert waiting.request(seqs[0]).length == 5 + 3
    taken = waiting.take(free_slots=2, free_pages=100)
    assert taken == seqs[:2] and waiting.values() == [seqs[2]] and seqs[0] not in waiting
    assert waiting.request(seqs[0]).id == 0  # kept while it holds a slot
    waiting.forget(seqs[0])
    with pytest.raises(KeyError):
        waiting.request(seqs[0])
    assert waiting.remove(seqs[2]) and not waiting.remove(seqs[2]) and not waiting.remove(seqs[1])
    assert len(waiting) == 0 and waiting.take(2, 100) == []


def test_a_preempted_row_needs_its_tokens_pages_and_the_victim_is_the_lowest_priority():
    waiting = queue(grow=True)
    low, high = (
        Sequence(Request(0, [1] * 6, max_new_tokens=8, priority=0)),
        Sequence(Request(1, [2] * 6, max_new_tokens=8, priority=1)),
    )
    for seq in (low, high):
        waiting.queue(seq)
    assert waiting.request(low).length == 6 + 1  # grow: its prompt and one token to start
    running = waiting.take(2, 100)
    assert waiting.victim(running) is low
    low.output.tokens = [7, 7, 7]
    waiting.queue(low)  # preempted: recomputed from its prompt and the tokens it has
    assert waiting.request(low).prompt_len == 6 + 3 and waiting.values() == [low]
