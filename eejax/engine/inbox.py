"""What other threads ask of the engine, as messages on a queue that the engine's loop drains at
the start of a step: a request submitted, one cancelled, every one cancelled or aborted, the
deadlines checked. No other thread changes the engine's parts: the HTTP handlers, a shutdown
timer and `Engine.stop` post here (`Lifecycle.post`), and only the thread that steps the engine
applies what they posted (`apply`)."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

from eejax.engine.delivery import Delivery
from eejax.engine.replicas import ChangeLog
from eejax.engine.sequence import Sequence
from eejax.engine.slots import SlotTable
from eejax.engine.waiting import WaitingQueue


@dataclasses.dataclass(frozen=True)
class Submit:
    """A request that passed `Requests.submit`'s checks, to queue."""

    seq: Sequence


@dataclasses.dataclass(frozen=True)
class Cancel:
    """End `seq` now (its client went away): finish reason "cancelled"."""

    seq: Sequence


@dataclasses.dataclass(frozen=True)
class CancelAll:
    """End every request now, finish reason "cancelled" (`Engine.stop(cancel=True)`)."""


@dataclasses.dataclass(frozen=True)
class Abort:
    """End every request now with finish reason `reason` (a shutdown's deadline); `done` is set
    once they have ended."""

    reason: str
    done: threading.Event = dataclasses.field(default_factory=threading.Event, compare=False)
    ended: list = dataclasses.field(default_factory=list, compare=False)  # the Sequences it ended


@dataclasses.dataclass(frozen=True)
class Expire:
    """End the requests past their deadline at `now` (perf_counter): finish reason "length",
    `timed_out`. Only the loop that serves posts it: replicas follow its decisions, never
    their clocks."""

    now: float = dataclasses.field(default_factory=time.perf_counter)


Message = Submit | Cancel | CancelAll | Abort | Expire


class Inbox:
    """A thread-safe queue of `Message`s: any thread puts, the engine's thread takes them all."""

    def __init__(self):
        self._messages: collections.deque = collections.deque()

    def put(self, message: Message) -> None:
        self._messages.append(message)

    def take(self) -> list[Message]:
        """Every message posted so far, oldest first (the others stay for the next take)."""
        if not self._messages:
            return []
        return [self._messages.popleft() for _ in range(len(self._messages))]

    def __bool__(self) -> bool:
        return bool(self._messages)


def apply(
    messages: list[Message],
    waiting: WaitingQueue,
    slot_table: SlotTable,
    delivery: Delivery,
    replication: ChangeLog,
) -> None:
    """Applies `messages` to the engine's parts, in order (the engine's thread, between steps).
    A cancel, abort or expiry reaches process 0's replicas through `replication` too."""
    for message in messages:
        if isinstance(message, Submit):
            waiting.queue(message.seq)
            replication.submitted(message.seq)
            continue
        held = [*waiting.values(), *slot_table.rows()]
        if isinstance(message, Cancel):
            if not message.seq.finished:
                replication.cancelled(message.seq)
            delivery.end(message.seq)
        elif isinstance(message, CancelAll):
            for seq in held:
                if not seq.finished:
                    replication.cancelled(seq)
                delivery.end(seq)
        elif isinstance(message, Abort):
            for seq in held:  # (a stuck loop's abort may have finished some already: `Lifecycle.abort`)
                waiting.remove(seq)
                delivery.release(seq)
                if not seq.finished:
                    delivery.finish(seq, message.reason)
                    message.ended.append(seq)
            message.done.set()
        elif isinstance(message, Expire):
            for seq in held:
                if seq.deadline is None or message.now < seq.deadline or seq.finished or seq.ending:
                    continue
                replication.cancelled(seq)
                delivery.end(seq, "length", timed_out=True)
        else:
            raise TypeError(f"not an engine message: {message!r}")
