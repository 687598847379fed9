"""The engine's life, a part of `Engine`: running steps (in this thread or a background one, or in
step with process 0 across processes), stopping, aborting, cancelling and deadlines; a step that
raises is recovered from (`Faults`), and a loop that dies says so. A mixin over the engine."""

from __future__ import annotations

import logging
import threading
import time

from eejax.engine import replicas
from eejax.engine.sequence import Sequence

log = logging.getLogger("eejax.serve")


class Lifecycle:
    def _recover(self, error: BaseException) -> None:
        """After a step raised outside any one program (`Faults.recover`)."""
        with self._lock:
            self.faults.recover(error)

    @property
    def alive(self) -> bool:
        """Whether the background loop is running (started, not stopped, not died)."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def abort(self, reason: str = "abort", lock_timeout: float = 1.0) -> int:
        """Ends every request now with finish reason `reason` (a server shutting down at its
        deadline); returns how many. If the loop is stuck inside a program for longer than
        `lock_timeout`, the requests still end for their callers (the engine is going away)."""
        locked = self._lock.acquire(timeout=lock_timeout)
        try:
            seqs = list(self.waiting.values()) + self.slot_table.rows()
            for seq in seqs:
                if seq.finished:
                    continue
                if locked:
                    self.waiting.remove(seq)
                    self.delivery.release(seq)
                self.delivery.finish(seq, reason)
            return len(seqs)
        finally:
            if locked:
                self._lock.release()

    def run(self) -> None:
        """Steps until every submitted request has finished."""
        while self.busy:
            self.step()

    def generate_offline(self, prompts, *, max_new_tokens: int = 64, progress: bool = True) -> list[Sequence]:
        """Runs a batch job to the end (in this thread) with a progress bar over finished requests;
        returns the Sequences in the prompts' order."""
        from tqdm.auto import tqdm

        seqs = [self.submit(p, max_new_tokens=max_new_tokens) for p in prompts]
        with tqdm(total=len(seqs), desc="requests", disable=not progress) as bar:
            while self.busy:
                self.step()
                bar.update(sum(s.finished for s in seqs) - bar.n)
        return seqs

    def start(self) -> None:
        """Runs the loop in a background thread (what the HTTP server uses) until `stop()`."""
        if self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="eejax-engine", daemon=True)
        self._thread.start()

    def stop(self, cancel: bool = False, timeout: float | None = None) -> bool:
        """Stops the background loop after finishing (or, with `cancel`, cancelling) all requests.
        Waits at most `timeout` seconds for the loop (None: until it ends); False if it did not end."""
        if cancel:
            with self._lock:
                seqs = list(self.waiting.values()) + self.slot_table.rows()
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
        with self._lock:
            if not seq.finished:
                self.replication.cancelled(seq)
            self._cancel_locked(seq)

    def _cancel_locked(self, seq: Sequence, reason: str = "cancelled") -> None:
        """`cancel` with the lock held: the request ends with finish reason `reason`."""
        if seq.finished:
            return
        if self.waiting.remove(seq):
            self.delivery.finish(seq, reason)
        elif seq.slot is not None and self.prefilling.get(seq.slot) is seq:  # no tokens in flight
            self.delivery.release(seq)
            self.delivery.finish(seq, reason)
        else:
            seq.ending = reason  # released after the step in flight, with the tokens it made

    def _expire_deadlines(self) -> None:
        """Ends the requests past their deadline (waiting ones too) with finish reason "length"
        and `timed_out`, like a cancellation (so replicas hear of it with this step's changes).
        Only the loop that serves calls it: replicas follow its decisions, never their clocks."""
        now = time.perf_counter()
        with self._lock:
            seqs = [*self.waiting.values(), *self.prefilling.values(), *self.running.values()]
            for seq in seqs:
                if seq.deadline is None or now < seq.deadline or seq.finished or seq.ending:
                    continue
                seq.timed_out = True
                self.replication.cancelled(seq)
                self._cancel_locked(seq, "length")

    def _step_or_recover(self) -> None:
        try:
            self.step()
        except Exception as e:  # noqa: BLE001 - the loop lives on for the other requests
            log.exception("an engine step failed")
            self._recover(e)

    def _forget_finished(self) -> None:
        """Drops finished requests from the id index the replicas keep (`replicas.ChangeLog`)."""
        with self._lock:
            self.replication.forget_finished()

    def _replicated_iteration(self) -> bool:
        """Process 0 of several: sends its changes to the replicas and steps with them (the lock
        held throughout, so no request slips in between); False once it has told them to stop."""
        self._expire_deadlines()
        with self._lock:
            changes = self.replication.take()
            busy = self.busy
            stopping = self._stopping.is_set() and not busy
            replicas.broadcast(replicas.STOP if stopping else (changes, busy))
            if stopping:
                return False
            if busy:
                self._step_or_recover()
        self._forget_finished()
        if not busy:
            self._wake.wait(replicas.HEARTBEAT_S)
            self._wake.clear()
        return True

    def _loop(self) -> None:
        try:
            while True:
                if self.replication.active:
                    if not self._replicated_iteration():
                        return
                    continue
                if self.busy:
                    self._expire_deadlines()
                    self._step_or_recover()
                    continue
                if self._stopping.is_set():
                    return
                self._wake.wait(0.05)
                self._wake.clear()
        except BaseException as e:  # the loop itself died: nothing will be served any more
            self.error = e
            log.critical("the engine loop died", exc_info=True)
            self.abort("error", lock_timeout=0)
