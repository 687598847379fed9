"""Faults, a part of the `Engine`: a program that raises fails only the requests it ran for
(finish reason "error", their slots and pages freed) and the others go on; when the arrays on
the device did not survive it (a program that raised had taken the donated cache), they are
rebuilt and every row in a slot fails; a step that raised outside any one program fails its
rows, or the waiting ones if none ran, so that a fault in admission cannot repeat forever.
It owns no state: it changes the queue, slots and device arrays through their parts, and tells
the engine to drop the read it had in flight (`lost`) when the device arrays are rebuilt."""

from __future__ import annotations

import logging
from collections.abc import Callable

from eejax.engine.delivery import Delivery
from eejax.engine.device_slots import DeviceSlots
from eejax.engine.sequence import Sequence
from eejax.engine.slots import SlotTable
from eejax.engine.waiting import WaitingQueue

log = logging.getLogger("eejax.serve")


class Faults:
    def __init__(
        self,
        waiting: WaitingQueue,
        slot_table: SlotTable,
        device: DeviceSlots,
        delivery: Delivery,
        lost: Callable[[], None],
    ):
        self._waiting, self._slot_table, self._device, self._delivery = waiting, slot_table, device, delivery
        self._lost = lost

    def guarded(self, seqs: list[Sequence], work, *args) -> None:
        """Runs `work(*args)`, a program over the rows of `seqs` (or its read). If it raises, those
        requests fail and the others go on; if the device arrays did not survive, they are rebuilt
        and every row in a slot fails."""
        try:
            work(*args)
        except Exception as e:  # noqa: BLE001 - whatever a program raises fails its requests only
            log.exception("a step failed; failing requests %s", [seq.id for seq in seqs])
            self._rebuild_if_lost(e)
            self.fail(seqs, e)

    def failed(self, failures: list[tuple[Sequence, Exception]]) -> None:
        """Rows whose host-side work raised (`Delivery.deliver`'s): each fails alone."""
        for seq, error in failures:
            log.error("delivering to request %s failed", seq.id, exc_info=error)
            self.fail([seq], error)

    def recover(self, error: BaseException) -> None:
        """After a step raised outside any one program: its rows fail (those in slots; the
        waiting ones if none was), and the engine drops its read in flight."""
        victims = self._slot_table.rows() or self._waiting.values()
        self._rebuild_if_lost(error)
        self._lost()
        self.fail(victims, error)

    def fail(self, seqs: list[Sequence], error: BaseException) -> None:
        """Ends `seqs` (in slots or waiting) with finish reason "error" and the error's text."""
        for seq in seqs:
            if seq.finished:
                continue
            self._waiting.remove(seq)
            self._delivery.release(seq)
            self._delivery.finish(seq, "error", f"{type(error).__name__}: {error}")

    def _rebuild_if_lost(self, error: BaseException) -> None:
        if self._device.intact():
            return
        log.error("the device state was lost; failing %d running requests", len(self._slot_table.running))
        self._device.reset()
        self._lost()
        self.fail(self._slot_table.rows(), error)
