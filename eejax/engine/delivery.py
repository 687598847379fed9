"""Delivery to requests, a part of the `Engine`: a read step's tokens (and log-probs) appended to
their `Sequence`s and streamed, stop tokens and strings checked, and the rows that ended released
(their slot and pages, `SlotTable`; a cancelled row stopped on device, `DeviceSlots`) and
finished (finish reason, Prometheus, the waiting queue's Request dropped, waiters woken). It
owns no state of its own; what it changes it changes through those parts' methods, and it adds
to its own count of tokens delivered (`generated_tokens`) and the Prometheus registry."""

from __future__ import annotations

import dataclasses

import numpy as np

from eejax.engine.device_slots import DeviceSlots
from eejax.engine.metrics import ServeMetrics
from eejax.engine.sequence import Sequence
from eejax.engine.slots import SlotTable
from eejax.engine.stops import first_stop
from eejax.engine.transfers import SlotsRead
from eejax.engine.waiting import WaitingQueue


def row_counts(x: np.ndarray) -> int | tuple[int, ...]:
    """A row's counter as the host keeps it: a count, or a tuple of counts (by depth)."""
    return int(x) if np.ndim(x) == 0 else tuple(int(v) for v in x)


class Delivery:
    """`tokenizer`: to find stop strings (None: the requests have none); `eos_ids`: the tokens
    that end a row with finish reason "stop" (none with `ignore_eos`)."""

    def __init__(
        self,
        tokenizer,
        eos_ids: tuple[int, ...],
        slot_table: SlotTable,
        device: DeviceSlots,
        waiting: WaitingQueue,
        prometheus: ServeMetrics,
    ):
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self._slot_table, self._device, self._waiting = slot_table, device, waiting
        self._prometheus = prometheus
        self.generated_tokens = 0  # tokens delivered, summed (`Engine.metrics`)

    def deliver(self, result) -> list[tuple[Sequence, Exception]]:
        """Delivers a finished program's `StepResult` (`dispatch.StepResult`) to each of its rows;
        returns the rows whose delivery raised, with what (a stop string the tokenizer failed on:
        `Faults` fails them alone)."""
        failed = []
        for slot, seq in result.rows.items():
            try:
                self._deliver_row(seq, slot, result.read, result.record, result.read_at)
            except Exception as e:  # noqa: BLE001 - one row's failure ends that row only
                failed.append((seq, e))
        return failed

    def _deliver_row(self, seq: Sequence, slot: int, read: SlotsRead, record, now: float) -> None:
        """Appends a row's new tokens (and log-probs) to its Sequence and ends it if it ended."""
        start = len(seq.tokens) - seq.offset
        n = min(seq.offset + int(read.num_generated[slot]), seq.max_new_tokens)
        new = read.tokens[slot, start : n - seq.offset].tolist()
        stop = self.stop_index(seq, new)
        if stop is not None:
            new = new[: stop + 1]
        end = start + len(new)
        out = seq.output
        out.tokens.extend(new)
        out.exit_layers.extend(read.exit_layers[slot, start:end].tolist())
        out.confident_layers.extend(read.confident_layers[slot, start:end].tolist())
        if seq.logprobs is not None:
            for j in range(start, end):
                out.token_logprobs.append(float(record.chosen[slot, j]))
                out.top_logprobs.append(
                    [
                        (int(t), float(x))
                        for t, x in zip(record.top_ids[slot, j, : seq.logprobs], record.top[slot, j, : seq.logprobs])
                        if np.isfinite(x)
                    ]
                )  # tokens that top-k / top-p filtered out cannot be drawn
        out.token_times.extend([now] * len(new))
        self.generated_tokens += len(new)
        seq.publish(new)
        if seq.ending or read.done[slot] or stop is not None:
            ended_at_eos = bool(seq.tokens) and seq.tokens[-1] in self.eos_ids
            counters = read.spec_counters
            out.spec_counters = {
                f.name: row_counts(getattr(counters, f.name)[slot]) for f in dataclasses.fields(counters)
            }
            self.release(seq)
            self.finish(seq, seq.ending or ("stop" if ended_at_eos or stop is not None else "length"))

    @staticmethod
    def record_prompt_scores(work: list[tuple[Sequence, int]], scores) -> None:
        """Appends to each row's prompt log-probs those of its positions prefilled..end-1 (host
        `PromptScores` [b, T]); the first prompt token gets None."""
        for j, (seq, end) in enumerate(work):
            out = seq.output
            if not out.prompt_token_logprobs:
                out.prompt_token_logprobs.append(None)
                out.prompt_top_logprobs.append(None)
            for i in range(min(end, len(seq.prompt) - 1) - seq.prefilled):
                out.prompt_token_logprobs.append(float(scores.chosen[j, i]))
                top = zip(scores.top_ids[j, i, : seq.prompt_logprobs], scores.top[j, i, : seq.prompt_logprobs])
                out.prompt_top_logprobs.append([(int(a), float(b)) for a, b in top])

    def stop_index(self, seq: Sequence, new: list[int]) -> int | None:
        """The index in `new`, a row's next tokens, of the first that ends the request: a stop
        token, or one that completes a stop string in its text (None: none does)."""
        if not seq.stop_token_ids and not seq.stop:
            return None
        for k, token in enumerate(new):
            if token in seq.stop_token_ids:
                return k
            if seq.stop:
                text = self.tokenizer.decode(seq.tokens + new[: k + 1], skip_special_tokens=True)
                if first_stop(text, seq.stop) is not None:
                    return k
        return None

    def end(self, seq: Sequence, reason: str = "cancelled", timed_out: bool = False) -> None:
        """Ends a request early (cancelled; past its deadline: "length" and `timed_out`): a
        waiting one leaves the queue and a prefilling one its slot now; a decoding one ends after
        the step in flight, with the tokens it made (`Sequence.ending`)."""
        if seq.finished:
            return
        if timed_out:
            seq.output.timed_out = True
        if self._waiting.remove(seq):
            self.finish(seq, reason)
        elif seq.slot is not None and self._slot_table.prefilling.get(seq.slot) is seq:  # no tokens in flight
            self.release(seq)
            self.finish(seq, reason)
        else:
            seq.output.ending = reason  # released after the step in flight, with the tokens it made

    def release(self, seq: Sequence) -> None:
        """Frees a row's slot and pages, if it holds them (ended, cancelled, preempted)."""
        slot = seq.slot
        if self._slot_table.release(seq):
            # The slot is done on device after the step that ended it; a cancelled row is
            # stopped here.
            self._device.stop(slot)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Ends a request with finish reason `reason` (its slot already released; "error": with the
        `error`'s text) and wakes whoever waits on it or streams it."""
        seq.output.finish_reason, seq.output.error = reason, error
        self._prometheus.finished(seq)
        self._waiting.forget(seq)
        seq.close()
