"""The engine's life, a part of `Engine`: its background loop (in step with process 0 across
processes), stopping it, and what other threads ask of the engine (submit, cancel, abort). It
owns the loop's thread, its stop and wake events, what killed the loop (`error`) and the inbox
(`engine/inbox.py`): other threads post messages there, and the thread that steps the engine
applies them. It is handed only the loop's functions (`Loop`), never the engine."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

from eejax.engine import replicas
from eejax.engine.inbox import Abort, Cancel, CancelAll, Expire, Inbox, Message
from eejax.engine.sequence import Sequence

log = logging.getLogger("eejax.serve")


@dataclasses.dataclass(frozen=True)
class Loop:
    """What the background loop drives (the engine's, `Engine.loop`).

    step:          one engine step, the inbox's messages first (across processes, the loop
                   applies them itself before it tells the replicas).
    busy:          whether a step has work (the inbox's messages count).
    recover:       after a step raised outside any one program (`Faults.recover`).
    take_messages: applies the inbox's messages (the stepping thread only).
    live:          the requests submitted and not yet finished (any thread may ask).
    finish:        ends a request for its caller (`Delivery.finish`), when the loop is stuck.
    """

    step: Callable[[], None]
    busy: Callable[[], bool]
    recover: Callable[[BaseException], None]
    take_messages: Callable[[], None]
    live: Callable[[], list[Sequence]]
    finish: Callable[[Sequence, str], None]


class Lifecycle:
    """The background loop over `loop`; `replication`: process 0's changes, which its replicas
    apply before stepping with it (inactive in one process)."""

    def __init__(self, loop: Loop, replication: replicas.ChangeLog):
        self._fns, self._replication = loop, replication
        self.inbox = Inbox()
        self.error: BaseException | None = None  # what stopped the background loop, if it died
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._inline = threading.Lock()  # messages applied by their poster: no loop runs

    @property
    def alive(self) -> bool:
        """Whether the background loop is running (started, not stopped, not died)."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def post(self, message: Message) -> None:
        """Asks the engine for `message`'s change: the loop applies it before its next step. With
        no loop running, the thread that owns the engine posts, and it is applied at once."""
        self.inbox.put(message)
        if self.alive:
            self._wake.set()
        else:
            with self._inline:
                self._fns.take_messages()

    def start(self) -> None:
        """Runs the loop in a background thread until `stop()`."""
        if self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="eejax-engine", daemon=True)
        self._thread.start()

    def stop(self, cancel: bool = False, timeout: float | None = None) -> bool:
        """Stops the background loop after finishing (or, with `cancel`, cancelling) all requests.
        Waits at most `timeout` seconds for the loop (None: until it ends); False if it did not end."""
        if cancel:
            self.post(CancelAll())
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
        self.post(Cancel(seq))

    def abort(self, reason: str = "abort", wait: float = 1.0) -> int:
        """Ends every request now with finish reason `reason` (a server shutting down at its
        deadline); returns how many. If the loop does not get to it within `wait` seconds (stuck
        inside a program), the requests still end for their callers (the engine is going away)."""
        message = Abort(reason)
        try:
            self.post(message)
        except Exception:  # noqa: BLE001 - applied at once on a broken engine: end them below
            log.exception("aborting the engine's requests failed")
        if message.done.wait(wait if self.alive else 0):
            return len(message.ended)
        unfinished = [seq for seq in self._fns.live() if not seq.finished]
        for seq in unfinished:
            self._fns.finish(seq, reason)
        return len(unfinished)

    def step_or_recover(self) -> None:
        """One engine step; if it raises, the loop lives on for the other requests."""
        try:
            self._fns.step()
        except Exception as e:  # noqa: BLE001 - the loop lives on for the other requests
            log.exception("an engine step failed")
            self._fns.recover(e)

    def _replicated_iteration(self) -> bool:
        """Process 0 of several: applies what was posted, sends the changes to the replicas and
        steps with them (nothing posted meanwhile joins this step); False once it has told them
        to stop."""
        self.inbox.put(Expire())
        self._fns.take_messages()
        busy = self._fns.busy()
        stopping = self._stopping.is_set() and not busy
        replicas.broadcast(replicas.STOP if stopping else (self._replication.take(), busy))
        if stopping:
            return False
        if busy:
            self.step_or_recover()
        self._replication.forget_finished()
        if not busy:
            self._wake.wait(replicas.HEARTBEAT_S)
            self._wake.clear()
        return True

    def _run(self) -> None:
        try:
            while True:
                if self._replication.active:
                    if not self._replicated_iteration():
                        return
                    continue
                if self._fns.busy():
                    self.inbox.put(Expire())
                    self.step_or_recover()
                    continue
                if self._stopping.is_set():
                    return
                self._wake.wait(0.05)
                self._wake.clear()
        except BaseException as e:  # the loop itself died: nothing will be served any more
            self.error = e
            log.critical("the engine loop died", exc_info=True)
            self.abort("error", wait=0)
