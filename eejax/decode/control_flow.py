"""Host round trips of compiled programs: the while loops and conditionals in their HLO.

On a GPU, XLA runs a `while` by reading its predicate back to the host after every iteration,
and a `conditional` by reading its branch index back, each a device-to-host copy and a stream
synchronisation (10-20 us, as much as a small layer) unless the loop's trip count is known at
compile time (XLA's trip-count analysis marks it `known_trip_count`). `control_flow` counts them
in a compiled program's optimised HLO (the trip-count analysis and the control flow it sees are
the same on CPU), so the CPU tests can keep the GPU's round trips bounded.

The early-exit step (`decode.early_exit`) has one data-dependent loop (the segments) with a
`lax.switch` per segment and one to finish (token head and KV fill): 2 s + 2 round trips for s
segments run, whatever the segments' lengths; its layer loops and KV fill have static bounds.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class ControlFlow:
    """While loops and conditionals of one program's optimised HLO."""

    dynamic_loops: int  # while loops without a known trip count: a host round trip per iteration on GPU
    static_loops: int  # with a known trip count: none
    conditionals: int  # a host round trip each time one runs


_WHILE = re.compile(r"\swhile\(%")  # an instruction: `%while.3 = (...) while(%tuple.2), condition=...`
_CONDITIONAL = re.compile(r"\sconditional\(%")


def control_flow(hlo_text: str) -> ControlFlow:
    """Counts the while loops (with and without a known trip count) and conditionals of a
    compiled program's HLO text (`compiled.as_text()`)."""
    lines = hlo_text.splitlines()
    loops = [line for line in lines if _WHILE.search(line)]
    known = sum("known_trip_count" in line for line in loops)
    conditionals = sum(bool(_CONDITIONAL.search(line)) for line in lines)
    return ControlFlow(len(loops) - known, known, conditionals)
