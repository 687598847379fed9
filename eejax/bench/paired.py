"""Timing configurations against a peer on a machine whose speed drifts (shared cores: 10-40%
over minutes): every configuration is timed between two runs of the peer, and its ratio is
taken against their mean; the median over repeats is kept."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class PairedRuns:
    """The results of `paired_runs`: `warm[i]` config i's warm-up (compiling) run, `warm_peer`
    the peer's; `runs[i][r]` config i's result in repeat r, and `around[i][r]` the peer's two
    results around it (before, after); `peers` every timed run of the peer, in order."""

    warm_peer: Any
    warm: list
    runs: list[list]
    around: list[list[tuple]]
    peers: list

    def ratio(self, i: int, speed: Callable[[Any], float]) -> float:
        """Median over repeats of config i's `speed` over the mean of its two peers'."""
        pairs = zip(self.runs[i], self.around[i])
        return statistics.median(speed(run) / ((speed(before) + speed(after)) / 2) for run, (before, after) in pairs)

    def speed(self, i: int | None, speed: Callable[[Any], float]) -> float:
        """The median `speed` of config i's timed runs, or of the peer's (i None)."""
        return statistics.median(speed(r) for r in (self.peers if i is None else self.runs[i]))

    def last(self, i: int | None):
        """Config i's last timed result, or the peer's (i None)."""
        return self.peers[-1] if i is None else self.runs[i][-1]


def paired_runs(run: Callable[[Any], Any], configs: list, repeats: int, tick: Callable[[], None] = lambda: None):
    """Runs `run(None)` (the peer) and `run(c)` for each config c: one warm-up run each (it
    compiles), then `repeats` times peer, c_1, peer, c_2, ..., c_n, peer. `tick` is called after
    every run (a progress bar). Returns `PairedRuns`."""

    def timed(c):
        result = run(c)
        tick()
        return result

    warm_peer = timed(None)
    warm = [timed(c) for c in configs]
    runs: list[list] = [[] for _ in configs]
    around: list[list[tuple]] = [[] for _ in configs]
    peers: list = []
    for _ in range(repeats):
        peers.append(timed(None))
        for i, c in enumerate(configs):
            runs[i].append(timed(c))
            peers.append(timed(None))
            around[i].append((peers[-2], peers[-1]))
    return PairedRuns(warm_peer, warm, runs, around, peers)


def runs_count(configs: int, repeats: int) -> int:
    """How many runs `paired_runs` makes for `configs` configurations."""
    return 1 + configs + repeats * (2 * configs + 1)
