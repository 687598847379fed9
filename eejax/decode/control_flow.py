"""Host round trips of compiled programs: the while loops and conditionals in their HLO (and, the
other costs a program can hide: copies of the whole KV cache, `cache_copies`, and of arguments
it was not given to update in place, `argument_copies`).

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


_COPY = re.compile(r"= [a-z0-9]+\[([0-9,]*)\]\S* copy(?:-start)?\(")  # `%copy.7 = f32[4,2,64,16,16]{...} copy(%p)`


def cache_copies(hlo_text: str, layer_elements: int) -> int:
    """How many copies in a compiled program's HLO text move at least `layer_elements` values
    (one layer's keys or values over all pages): a cache update XLA could not do in place copies
    the cache (1 GiB by default) on every step. The compiled decode programs must have none."""
    count = 0
    for dims in _COPY.findall(hlo_text):
        elements = 1
        for n in filter(None, dims.split(",")):
            elements *= int(n)
        count += elements >= layer_elements
    return count


_ENTRY_PARAMETER = re.compile(r"^\s*%([\w.\-]+) = \S+ parameter\(\d+\)")
_ENTRY_COPY = re.compile(r"^\s*%[\w.\-]+ = \S+ copy\(%([\w.\-]+)\)")


def argument_copies(hlo_text: str) -> int:
    """How many of a compiled program's arguments it copies before its work (copies of an ENTRY
    parameter): an argument that a loop updates and that is not donated is copied in first, on
    every run (a decode program's state and counters, unless donated: ~27 small copies, a kernel
    each on a GPU)."""
    start = hlo_text.find("\nENTRY ")
    end = hlo_text.find("\n}", start)
    entry = hlo_text[start : end if end >= 0 else None].splitlines()
    parameters = {m.group(1) for m in map(_ENTRY_PARAMETER.match, entry) if m}
    return sum(bool(m and m.group(1) in parameters) for m in map(_ENTRY_COPY.match, entry))
