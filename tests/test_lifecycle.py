"""The engine's loop part alone (`engine/lifecycle.py`) over a stand-in engine whose steps are
counted: the loop steps while there is work and idles without, a step that raises is recovered
from and the loop lives on, a loop that dies says so and ends what waits, deadlines end
waiting requests with "length", and stop ends the thread. And what process 0 tells its replicas
(`replicas.ChangeLog`)."""

import threading
import time

from eejax.engine import inbox, replicas
from eejax.engine.delivery import Delivery
from eejax.engine.lifecycle import Lifecycle, Loop
from eejax.engine.metrics import ServeMetrics
from eejax.engine.scheduler import BucketScheduler
from eejax.engine.sequence import Request, Sequence
from eejax.engine.slots import SlotPages, SlotTable
from eejax.engine.waiting import WaitingQueue


class StandIn:
    """An engine that is busy for its first `busy_steps` steps; step i raises if `fail(i)`;
    `recover` takes what a step raised (default: kept in `recovered`). Its loop functions are
    all the Lifecycle gets."""

    def __init__(self, busy_steps: int, fail=None, recover=None):
        self.waiting = WaitingQueue(BucketScheduler(33, 4, max_rows=1), grow=False, prompt_positions=len)
        self.slot_table = SlotTable(1, SlotPages(4, 1, 4, 2, prefix_caching=False))
        self.delivery = Delivery(None, (), self.slot_table, None, self.waiting, ServeMetrics(2))
        self.replication = replicas.ChangeLog(False)
        self.steps, self.busy_steps, self.fail, self.recovered = 0, busy_steps, fail, []
        self.recover = recover or self.recovered.append
        self.lifecycle = Lifecycle(
            Loop(self.step, self.busy, lambda e: self.recover(e), self.take_messages, self.live, self.delivery.finish),
            self.replication,
        )

    def busy(self) -> bool:
        return self.steps < self.busy_steps or bool(self.lifecycle.inbox)

    def take_messages(self) -> None:
        inbox.apply(self.lifecycle.inbox.take(), self.waiting, self.slot_table, self.delivery, self.replication)

    def live(self) -> list:
        return [s for s in self.waiting.values() + self.slot_table.rows() if not s.finished]

    def step(self) -> None:
        self.take_messages()
        self.steps += 1
        if self.fail is not None and self.fail(self.steps):
            raise RuntimeError(f"step {self.steps}")


def loop_over(busy_steps: int, **kw):
    engine = StandIn(busy_steps, **kw)
    return engine, engine.lifecycle


def wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.005)
    return condition()


def test_the_loop_steps_while_busy_lives_through_a_failing_step_and_stops():
    engine, life = loop_over(busy_steps=5, fail=lambda i: i == 2)
    life.start()
    assert wait_for(lambda: engine.steps == 5) and life.alive
    assert [str(e) for e in engine.recovered] == ["step 2"]
    time.sleep(0.1)
    assert engine.steps == 5  # idle: no step without work
    assert life.stop(timeout=5) and not life.alive


def test_a_loop_that_dies_says_so_and_ends_what_waits():
    def unrecoverable(error):
        raise SystemError("unrecoverable")

    engine, life = loop_over(busy_steps=3, fail=lambda i: True, recover=unrecoverable)
    queued = Sequence(Request(0, [1, 2], max_new_tokens=2))
    life.post(inbox.Submit(queued))  # no loop yet: queued at once
    assert engine.waiting.values() == [queued]
    life.start()
    assert wait_for(lambda: life.error is not None) and isinstance(life.error, SystemError)
    # The loop says it died first (so that the server refuses new requests), then ends what waits.
    assert wait_for(lambda: not life.alive) and wait_for(lambda: queued.finish_reason == "error")


def test_deadlines_end_waiting_requests_and_cancel_ends_one_now():
    engine, life = loop_over(busy_steps=0)
    now = time.perf_counter()
    deadlines = (now - 1, now + 60, None)
    late, early, other = (Sequence(Request(i, [1, 2], max_new_tokens=2, deadline=d)) for i, d in enumerate(deadlines))
    for seq in (late, early, other):
        life.post(inbox.Submit(seq))
    life.post(inbox.Expire())
    assert late.finish_reason == "length" and late.timed_out and not early.finished
    life.cancel(other)
    assert other.finish_reason == "cancelled" and engine.waiting.values() == [early]
    assert life.abort("shutdown") == 1 and early.finish_reason == "shutdown"


def test_a_running_loop_applies_what_other_threads_post_and_only_it_does():
    """While the loop runs, a message waits in the inbox for the loop's thread; a stuck loop's
    abort still ends the requests for their callers, and the loop frees them when it comes back."""
    engine = StandIn(busy_steps=0)
    applied_by, gate = [], threading.Event()
    gate.set()

    def take_messages_():
        applied_by.append(threading.current_thread().name)
        engine.take_messages()

    def step():
        gate.wait()  # a step stuck inside a program while the gate is shut
        take_messages_()
        engine.steps += 1

    loop = Loop(step, engine.busy, engine.recover, take_messages_, engine.live, engine.delivery.finish)
    life = Lifecycle(loop, engine.replication)
    engine.lifecycle = life
    life.start()
    try:
        seq = Sequence(Request(0, [1, 2], max_new_tokens=2))
        life.post(inbox.Submit(seq))
        assert wait_for(lambda: engine.waiting.values() == [seq])
        life.cancel(seq)
        assert wait_for(lambda: seq.finish_reason == "cancelled")
        stuck = Sequence(Request(1, [1, 2], max_new_tokens=2))
        life.post(inbox.Submit(stuck))
        assert wait_for(lambda: engine.waiting.values() == [stuck])
        gate.clear()
        assert life.abort("abort", wait=0.2) == 1 and stuck.finish_reason == "abort"
        assert set(applied_by) == {"eejax-engine"}
        gate.set()
        assert wait_for(lambda: not engine.waiting.values() and not engine.busy())
    finally:
        gate.set()
        assert life.stop(timeout=5)


def test_process_zeros_changes_are_taken_once_and_finished_requests_forgotten():
    log, alone = replicas.ChangeLog(True), replicas.ChangeLog(False)
    seq = Sequence(Request(4, [1, 2], max_new_tokens=2))
    for changes in (log, alone):
        changes.submitted(seq)
        changes.cancelled(seq)
    assert [kind for kind, _ in log.take()] == ["submit", "cancel"] and log.take() == [] and alone.take() == []
    assert log.find(4) is seq
    seq._done.set()  # finished
    log.forget_finished()
    assert log.find(4) is None
