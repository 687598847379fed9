"""BucketServe's scheduler (host Python): length buckets that split and merge with load, admission
from free KV pages with a safety margin, FCFS / SJF / LJF inside a bucket, priorities.

A request's length S = prompt tokens + max new tokens (the most KV it can hold). Memory is counted
in pages of the one preallocated cache, so the paper's Eq. 5-6 become

    safe = floor(0.9 * free pages)                                  (Eq. 5, 10% kept back)
    N_max = max { N : sum_{i<=N} ceil(S_i / page_size) <= safe }    (Eq. 6, requests in order)

Buckets follow Algorithm 1 (AdjustBuckets): with fewer than N_max requests waiting, one bucket
[0, L_max); otherwise every bucket holding more than N_max requests of which more than θ lie
below its midpoint splits there, pass after pass until none does (before each admission). A
batch is drawn from one bucket: online, the bucket holding the earliest arrival; offline, the
fullest. Inside it, higher priority first, then the policy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from eejax.errors import EejaxError

POLICIES = ("fcfs", "sjf", "ljf")


@dataclasses.dataclass(eq=False)
class Request:
    """What the scheduler knows of a request: lengths, arrival time, priority (higher first)."""

    id: object
    prompt_len: int
    max_new_tokens: int
    arrival: float = 0.0
    priority: int = 0

    @property
    def length(self) -> int:
        return self.prompt_len + self.max_new_tokens


@dataclasses.dataclass(eq=False)
class Bucket:
    """Requests with low <= length < up."""

    low: int
    up: int
    requests: list[Request] = dataclasses.field(default_factory=list)

    @property
    def midpoint(self) -> int:
        return (self.low + self.up) // 2

    def holds(self, length: int) -> bool:
        return self.low <= length < self.up


def pages_for(length: int, page_size: int) -> int:
    return -(-length // page_size)


def safe_pages(free_pages: int, margin: float = 0.1) -> int:
    """Eq. 5: the pages admission may use, `margin` of the free ones kept back."""
    return math.floor((1.0 - margin) * free_pages)


def max_batch(lengths: Iterable[int], safe: int, page_size: int) -> int:
    """Eq. 6: the largest N whose first N requests (lengths in order) fit in `safe` pages."""
    used = n = 0
    for length in lengths:
        used += pages_for(length, page_size)
        if used > safe:
            break
        n += 1
    return n


class BucketScheduler:
    """Waiting requests in length buckets; `admit` picks the next requests to start.

    `bucketing=False` keeps one bucket (the FCFS baseline). `online` picks buckets by earliest
    arrival (latency), otherwise by size (throughput). `max_rows` (the decode slots) caps N_max:
    the batch is bounded by slots as well as by memory.
    """

    def __init__(
        self,
        max_len: int,
        page_size: int,
        *,
        policy: str = "fcfs",
        theta: float = 0.5,
        bucketing: bool = True,
        online: bool = True,
        margin: float = 0.1,
        max_rows: int | None = None,
    ):
        if policy not in POLICIES:
            raise EejaxError(f"unknown policy {policy!r}; choose one of: " + ", ".join(POLICIES))
        if max_len < 1 or page_size < 1 or not 0 <= theta < 1 or not 0 <= margin < 1:
            raise EejaxError("max_len and page_size must be >= 1, theta and margin in [0, 1)")
        self.max_len, self.page_size = max_len, page_size
        self.policy, self.theta, self.bucketing, self.online, self.margin = policy, theta, bucketing, online, margin
        self.max_rows = max_rows  # the engine's decode slots: N_max never exceeds them
        self.buckets = [Bucket(0, max_len)]
        self.splits = self.merges = 0

    # -- queue -------------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        if not 0 < request.length < self.max_len:
            raise EejaxError(
                f"request {request.id!r}: prompt + max new tokens = {request.length} must lie in [1, {self.max_len})"
            )
        next(b for b in self.buckets if b.holds(request.length)).requests.append(request)

    def remove(self, request: Request) -> bool:
        """Takes a waiting request out (a cancelled one); False if it was not waiting."""
        for b in self.buckets:
            if request in b.requests:
                b.requests.remove(request)
                return True
        return False

    @property
    def waiting(self) -> int:
        return sum(len(b.requests) for b in self.buckets)

    def order(self, requests: list[Request]) -> list[Request]:
        """Higher priority first, then the policy (FCFS: arrival; SJF / LJF: length), then arrival."""
        sign = {"fcfs": 0, "sjf": 1, "ljf": -1}[self.policy]
        return sorted(requests, key=lambda r: (-r.priority, sign * r.length, r.arrival))

    # -- Algorithm 1 ---------------------------------------------------------------------------
    def adjust(self, n_max: int) -> bool:
        """AdjustBuckets (one pass): merge everything when fewer than `n_max` wait, else split the
        buckets holding more than `n_max` requests with more than θ of them below the midpoint.
        True if a bucket split."""
        total = self.waiting
        if not self.bucketing or total < n_max:
            if len(self.buckets) > 1:
                merged = [r for b in self.buckets for r in b.requests]
                self.buckets = [Bucket(0, self.max_len, sorted(merged, key=lambda r: r.arrival))]
                self.merges += 1
            return False
        new = []
        for b in self.buckets:
            below = sum(r.length < b.midpoint for r in b.requests)
            if len(b.requests) > n_max and below / len(b.requests) > self.theta and b.up - b.low >= 2:
                mid = b.midpoint
                new.append(Bucket(b.low, mid, [r for r in b.requests if r.length < mid]))
                new.append(Bucket(mid, b.up, [r for r in b.requests if r.length >= mid]))
                self.splits += 1
            else:
                new.append(b)
        split = len(new) > len(self.buckets)
        self.buckets = new
        return split

    # -- admission -----------------------------------------------------------------------------
    def n_max(self, free_pages: int) -> int:
        waiting = self.order([r for b in self.buckets for r in b.requests])
        n = max(1, max_batch((r.length for r in waiting), safe_pages(free_pages, self.margin), self.page_size))
        return n if self.max_rows is None else min(n, self.max_rows)

    def pick_bucket(self) -> Bucket | None:
        full = [b for b in self.buckets if b.requests]
        if not full:
            return None
        if self.online:
            return min(full, key=lambda b: (-max(r.priority for r in b.requests), min(r.arrival for r in b.requests)))
        return max(full, key=lambda b: (max(r.priority for r in b.requests), len(b.requests)))

    def admit(self, free_slots: int, free_pages: int) -> list[Request]:
        """The requests to start now: from one bucket, in order, while a slot is free and their
        pages fit in the safe share of `free_pages`. They leave the queue."""
        if free_slots < 1 or not self.waiting:
            return []
        # "This process continues until all buckets are split": passes until none splits.
        n_max = self.n_max(free_pages)
        while self.adjust(n_max):
            pass
        bucket = self.pick_bucket()
        budget = safe_pages(free_pages, self.margin)
        chosen = []
        for r in self.order(bucket.requests):
            need = pages_for(r.length, self.page_size)
            if len(chosen) == free_slots or need > budget:
                break
            chosen.append(r)
            budget -= need
        for r in chosen:
            bucket.requests.remove(r)
        return chosen

    def requeue(self, request: Request) -> None:
        """A preempted request goes back with its arrival and priority (it is recomputed later)."""
        self.submit(request)


def preemption_victim(running: list[Request]) -> Request:
    """The running request to preempt when pages run out: lowest priority, then latest arrival."""
    if not running:
        raise EejaxError("nothing running to preempt")
    return min(running, key=lambda r: (r.priority, -r.arrival))
