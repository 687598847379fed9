"""The engine's life, a part of `Engine`: its background loop (in step with process 0 across
processes), stopping it, and ending requests from outside the loop (cancel, abort, deadlines).
It owns the loop's thread, its stop and wake events and what killed the loop (`error`); it
steps the engine (`Engine.step`; a step that raises is recovered from, `Engine._recover`) and
ends requests through its parts (`Delivery`, `WaitingQueue`)."""

from __future__ import annotations

import logging
import threading
import time

from eejax.engine import replicas
from eejax.engine.sequence import Sequence

log = logging.getLogger("eejax.serve")


class Lifecycle:
    """The background loop of `engine`, which it steps (its `step`, `busy` and lock)."""

    def __init__(self, engine):
        self._engine = engine
        self.error: BaseException | None = None  # what stopped the background loop, if it died
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake = threading.Event()

    @property
    def alive(self) -> bool:
        """Whether the background loop is running (started, not stopped, not died)."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def wake(self) -> None:
        """Wakes an idle loop: a request came."""
        self._wake.set()

    def start(self) -> None:
        """Runs the loop in a background thread until `stop()`."""
        if self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="eejax-engine", daemon=True)
        self._thread.start()

    def stop(self, cancel: bool = False, timeout: float | None = None) -> bool:
        """Stops the background loop after finishing (or, with `cancel`, cancelling) all requests.
        Waits at most `timeout` seconds for the loop (None: until it ends); False if it did not end."""
        engine = self._engine
        if cancel:
            with engine._lock:
                seqs = engine.waiting.values() + engine.slot_table.rows()
            for seq in seqs:
                self.cancel(seq)
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the engine loop did not stop within %s s", timeout)
                return False
            self._thread = None
        return True

    def cancel(self, seq: Sequence) -> None:
        """Ends a request now (a client that went away): its slot and pages are freed."""
        engine = self._engine
        with engine._lock:
            if not seq.finished:
                engine.replication.cancelled(seq)
            engine.delivery.end(seq)

    def abort(self, reason: str = "abort", lock_timeout: float = 1.0) -> int:
        """Ends every request now with finish reason `reason` (a server shutting down at its
        deadline); returns how many. If the loop is stuck inside a program for longer than
        `lock_timeout`, the requests still end for their callers (the engine is going away)."""
        engine = self._engine
        locked = engine._lock.acquire(timeout=lock_timeout)
        try:
            seqs = engine.waiting.values() + engine.slot_table.rows()
            for seq in seqs:
                if seq.finished:
                    continue
                if locked:
                    engine.waiting.remove(seq)
                    engine.delivery.release(seq)
                engine.delivery.finish(seq, reason)
            return len(seqs)
        finally:
            if locked:
                engine._lock.release()

    def expire_deadlines(self) -> None:
        """Ends the requests past their deadline (waiting ones too) with finish reason "length"
        and `timed_out`, like a cancellation (so replicas hear of it with this step's changes).
        Only the loop that serves calls it: replicas follow its decisions, never their clocks."""
        engine = self._engine
        now = time.perf_counter()
        with engine._lock:
            for seq in [*engine.waiting.values(), *engine.slot_table.rows()]:
                if seq.deadline is None or now < seq.deadline or seq.finished or seq.ending:
                    continue
                seq.timed_out = True
                engine.replication.cancelled(seq)
                engine.delivery.end(seq, "length")

    def step_or_recover(self) -> None:
        """One engine step; if it raises, the loop lives on for the other requests."""
        try:
            self._engine.step()
        except Exception as e:  # noqa: BLE001 - the loop lives on for the other requests
            log.exception("an engine step failed")
            self._engine._recover(e)

    def _replicated_iteration(self) -> bool:
        """Process 0 of several: sends its changes to the replicas and steps with them (the lock
        held throughout, so no request slips in between); False once it has told them to stop."""
        engine = self._engine
        self.expire_deadlines()
        with engine._lock:
            changes = engine.replication.take()
            busy = engine.busy
            stopping = self._stopping.is_set() and not busy
            replicas.broadcast(replicas.STOP if stopping else (changes, busy))
            if stopping:
                return False
            if busy:
                self.step_or_recover()
        with engine._lock:
            engine.replication.forget_finished()
        if not busy:
            self._wake.wait(replicas.HEARTBEAT_S)
            self._wake.clear()
        return True

    def _loop(self) -> None:
        engine = self._engine
        try:
            while True:
                if engine.replication.active:
                    if not self._replicated_iteration():
                        return
                    continue
                if engine.busy:
                    self.expire_deadlines()
                    self.step_or_recover()
                    continue
                if self._stopping.is_set():
                    return
                self._wake.wait(0.05)
                self._wake.clear()
        except BaseException as e:  # the loop itself died: nothing will be served any more
            self.error = e
            log.critical("the engine loop died", exc_info=True)
            self.abort("error", lock_timeout=0)
