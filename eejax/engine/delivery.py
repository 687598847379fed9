"""Reading a step's results, a part of `Engine`: what a dispatched step's state will give back
(`_outputs`: packed into one transfer, `engine/transfers.py`), and, one dispatch later, its tokens
delivered to their requests (`_read`, `_deliver`): stop tokens and strings checked, rows that ended
released (their slot and pages), requests finished. A mixin over the engine's slots and state."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from eejax.engine.sequence import Sequence
from eejax.engine.stops import first_stop
from eejax.engine.transfers import PackedRead
from eejax.sharding import to_host


class Delivery:
    def _outputs(self):
        """What `_read` takes of the state just dispatched: its tokens, counts and flags packed
        for one transfer, started now (`PackedRead`), and the log-probs if a row wants them."""
        state = self.device.state
        wanted = (state.num_generated, state.done, state.tokens, state.exit_layers, state.confident_layers)
        scored = any(seq.logprobs is not None for seq in self.running.values())
        return PackedRead((*wanted, self.device.spec_counters)), state.logprobs if scored else None

    def _read(self, outputs, running: dict[int, Sequence]) -> None:
        """Delivers the tokens a finished step produced; releases rows that ended (EOS, limit,
        stop token or string, cancelled). If the step failed on the device, its requests fail."""
        packed, logprobs = outputs
        out = {}

        def fetch():
            out["host"] = (*packed.read(), None if logprobs is None else to_host(logprobs))

        self._guarded(list(running.values()), fetch)
        if "host" not in out:
            return
        self._observe_acceptance(running, out["host"][5])
        now = time.perf_counter()
        for slot, seq in running.items():
            if not seq.finished and self.running.get(slot) is seq:  # else ended, or preempted (recomputed later)
                self._guarded([seq], self._deliver, seq, slot, *out["host"], now)

    def _deliver(self, seq: Sequence, slot: int, num, done, tokens, layers, confident, counters, record, now) -> None:
        """Appends a row's new tokens (and log-probs) to its Sequence; releases it if it ended."""
        n = min(seq.offset + int(num[slot]), seq.max_new_tokens)
        stopped = False
        for i in range(len(seq.tokens), n):
            j = i - seq.offset
            seq.tokens.append(int(tokens[slot, j]))
            seq.exit_layers.append(int(layers[slot, j]))
            seq.confident_layers.append(int(confident[slot, j]))
            if seq.logprobs is not None:
                seq.token_logprobs.append(float(record.chosen[slot, j]))
                seq.top_logprobs.append(
                    [
                        (int(t), float(x))
                        for t, x in zip(record.top_ids[slot, j, : seq.logprobs], record.top[slot, j, : seq.logprobs])
                        if np.isfinite(x)
                    ]
                )  # tokens that top-k / top-p filtered out cannot be drawn
            seq.token_times.append(now)
            seq._events.put(seq.tokens[-1])
            self.counters["generated_tokens"] += 1
            if self._stops_at(seq):
                stopped = True
                break
        seq._notify()
        if seq.ending or done[slot] or stopped:
            ended_at_eos = bool(seq.tokens) and seq.tokens[-1] in self.options.eos_ids
            seq.spec_counters = {f.name: int(getattr(counters, f.name)[slot]) for f in dataclasses.fields(counters)}
            self._release(seq)
            self._finish(seq, seq.ending or ("stop" if ended_at_eos or stopped else "length"))

    def _stops_at(self, seq: Sequence) -> bool:
        """Whether the request's newest token ends it: a stop token, or a stop string now in its text."""
        if seq.tokens[-1] in seq.stop_token_ids:
            return True
        if not seq.stop:
            return False
        text = self.model.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        return first_stop(text, seq.stop) is not None

    def _release(self, seq: Sequence) -> None:
        slot = seq.slot
        if self.slot_table.release(seq):
            # The slot is done on device after the step that ended it; a cancelled row is
            # stopped here.
            self.device.stop(slot)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.prometheus.finished(seq)
        self._requests.pop(seq.id, None)
        seq._events.put(None)
        seq._done.set()
        seq._notify()
