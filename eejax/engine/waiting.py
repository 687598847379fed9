"""The requests waiting for a slot, a part of the `Engine` that alone changes them: each waiting
`Sequence` and the scheduler's `Request` for it (the positions admission must find pages for, its
priority and arrival), handed to the `BucketScheduler`, which picks the rows admitted. A row
keeps its `Request` while it holds a slot (preemption picks its victim among them) and drops it
when it finishes (`forget`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from eejax.engine.scheduler import BucketScheduler, Request, preemption_victim
from eejax.engine.sequence import Sequence


class WaitingQueue:
    """`grow`: a row needs the pages of its prompt and one token to start (pages handed out as it
    grows), else those of its prompt and every token it may make. `prompt_positions(prompt)`:
    the cache positions a prompt takes (an encoder-decoder's: its start token alone)."""

    def __init__(self, scheduler: BucketScheduler, grow: bool, prompt_positions: Callable[[list[int]], int]):
        self.scheduler, self.grow, self.prompt_positions = scheduler, grow, prompt_positions
        self._seqs: dict[int, Sequence] = {}  # id -> a waiting row
        self._requests: dict[int, Request] = {}  # id -> the Request of a row waiting or in a slot

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq: Sequence) -> bool:
        return self._seqs.get(seq.id) is seq

    def values(self) -> list[Sequence]:
        """The waiting rows, in the order they came (a preempted one: when it was preempted)."""
        return list(self._seqs.values())

    def queue(self, seq: Sequence) -> None:
        """Queues `seq`, new or preempted (its prompt then grows by the tokens it has)."""
        prompt_len = self.prompt_positions(seq.prompt) + len(seq.tokens)
        remaining = seq.max_new_tokens - len(seq.tokens)
        request = Request(
            seq.id, prompt_len, 1 if self.grow else remaining, arrival=seq.submitted_at, priority=seq.priority
        )
        self._requests[seq.id] = request
        self._seqs[seq.id] = seq
        self.scheduler.submit(request)

    def take(self, free_slots: int, free_pages: int) -> list[Sequence]:
        """The rows the scheduler admits into `free_slots` slots with `free_pages` pages, taken
        out of the queue (their Requests stay until they finish)."""
        return [self._seqs.pop(r.id) for r in self.scheduler.admit(free_slots, free_pages)]

    def remove(self, seq: Sequence) -> bool:
        """Takes a waiting row out (cancelled, failed); False if it was not waiting."""
        if seq not in self:
            return False
        self.scheduler.remove(self._requests[seq.id])
        del self._seqs[seq.id]
        return True

    def victim(self, running: Iterable[Sequence]) -> Sequence:
        """The row of `running` to preempt (`scheduler.preemption_victim`)."""
        by_id = {seq.id: seq for seq in running}
        return by_id[preemption_victim([self._requests[i] for i in by_id]).id]

    def request(self, seq: Sequence) -> Request:
        """The scheduler's Request for a row waiting or in a slot."""
        return self._requests[seq.id]

    def forget(self, seq: Sequence) -> None:
        """Drops a finished row's Request (one that finished while waiting leaves the queue)."""
        self.remove(seq)
        self._requests.pop(seq.id, None)
