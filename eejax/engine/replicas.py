"""One engine over several processes (`jax.distributed`): process 0 serves HTTP and schedules;
every other process keeps a replica of its engine and runs the same steps, as SPMD programs need
(every process dispatches every program).

Before each step, process 0 broadcasts what changed its engine since the last one: requests
submitted (with their ids, seeds and arrival times) and cancelled, and whether to step. The
replicas apply the same changes and step with it. An engine decides from nothing else (no
clocks, no randomness of its own once a request's seed is drawn), so the replicas stay
identical; results spanning processes are read collectively (`sharding.to_host`) at the same
points of the same step. An idle process 0 sends a heartbeat every `HEARTBEAT_S`, and `STOP`
when it stops.
"""

from __future__ import annotations

import pickle

import jax
import numpy as np

HEARTBEAT_S = 0.5
STOP = "stop"


def submitted(seq) -> tuple:
    """The change `seq`'s submission made, as it travels to the replicas: what it asked."""
    return ("submit", seq.request)


def cancelled(seq) -> tuple:
    return ("cancel", seq.id)


class ChangeLog:
    """Process 0's changes to its engine since the last step, which the replicas apply before
    stepping with it, and the requests they name by id (submitted on process 0, applied on a
    replica; dropped once finished). It records nothing in one process (`active` False)."""

    def __init__(self, active: bool):
        self.active = active
        self._changes: list[tuple] = []
        self._by_id: dict = {}  # id -> Sequence

    def submitted(self, seq) -> None:
        if self.active:
            self._changes.append(submitted(seq))
            self._by_id[seq.id] = seq

    def cancelled(self, seq) -> None:
        if self.active:
            self._changes.append(cancelled(seq))

    def take(self) -> list[tuple]:
        """The changes since the last `take`."""
        changes, self._changes = self._changes, []
        return changes

    def applied(self, seq) -> None:
        """A replica holds `seq`, submitted on process 0."""
        self._by_id[seq.id] = seq

    def find(self, seq_id):
        """The request of id `seq_id` (None: finished and forgotten, or never seen)."""
        return self._by_id.get(seq_id)

    def forget_finished(self) -> None:
        for seq_id in [i for i, seq in self._by_id.items() if seq.finished]:
            del self._by_id[seq_id]


def broadcast(message=None):
    """Process 0's `message` (any picklable value), returned on every process. The payload is
    padded to a power of two, so the broadcast compiles once per size class."""
    from jax.experimental import multihost_utils

    source = jax.process_index() == 0
    data = pickle.dumps(message) if source else b""
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    buf = np.zeros(max(256, 1 << (n - 1).bit_length()), np.uint8)
    if source:
        buf[:n] = np.frombuffer(data, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return pickle.loads(buf[:n].tobytes())


def apply(engine, changes: list[tuple]) -> None:
    """Applies process 0's changes to a replica engine (in the thread that steps it)."""
    for kind, value in changes:
        if kind == "submit":
            seq = engine.requests.replicated(value)
            engine.replication.applied(seq)
            engine.waiting.queue(seq)
        else:
            seq = engine.replication.find(value)
            if seq is not None:
                engine.delivery.end(seq)


def follow(engine) -> None:
    """A replica's loop: applies process 0's changes and steps with it, until it stops."""
    while True:
        message = broadcast()
        if message == STOP:
            return
        changes, step = message
        apply(engine, changes)
        if step:
            engine.lifecycle.step_or_recover()
        engine.replication.forget_finished()
