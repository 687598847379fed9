"""What a partitioned program communicates: the collectives in its optimised HLO and their bytes
per execution, each multiplied by the trip counts of the loops around it.

Bytes are the collective's result size on one device (an all-reduce of x moves about 2x that
over a ring, an all-gather about that much); a loop without a known trip count (early exit's
segment loop) counts once and is reported, and both branches of a conditional count (an upper
bound).
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{\s*$")
_COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (" + "|".join(KINDS) + r")(?:-start)?\(")
_SHAPE = re.compile(r"(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_WHILE = re.compile(r"while\(.*condition=%(\S+?), body=%(\S+?)[,\s]")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"(?:calls|to_apply|branch_computations)=\{?([^}\n]*?)\}?(?:,\s|$)")
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}


@dataclasses.dataclass(frozen=True)
class Collectives:
    """bytes: {kind: bytes per execution of the program}; ops: how many collective instructions;
    largest: the largest one result in bytes; unknown_loops: loops whose trip count the compiler
    does not know (counted once)."""

    bytes: dict
    ops: int
    largest: int
    unknown_loops: int

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def collectives(hlo_text: str) -> Collectives:
    """The collectives of a compiled program's HLO text (`compiled.as_text()`)."""
    computations, entry = _computations(hlo_text)
    edges: dict[str, list[tuple[str, int]]] = {}
    unknown = 0
    for name, lines in computations.items():
        edges[name] = []
        for line in lines:
            loop = _WHILE.search(line)
            if loop:
                trips = _TRIPS.search(line)
                unknown += trips is None
                n = int(trips.group(1)) if trips else 1
                edges[name] += [(loop.group(1), n + 1), (loop.group(2), n)]
                continue
            for group in _CALLS.findall(line):
                edges[name] += [(callee, 1) for callee in re.findall(r"%([^,\s}]+)", group)]
    times = collections.Counter({entry: 1})
    for name in _callers_first(edges, entry):
        for callee, k in edges.get(name, ()):
            times[callee] += times[name] * k
    totals: collections.Counter = collections.Counter()
    sizes = []
    for name, lines in computations.items():
        for line in lines:
            hit = _COLLECTIVE.search(line)
            if hit and times[name]:
                sizes.append(_shape_bytes(hit.group(1)))
                totals[hit.group(2)] += times[name] * sizes[-1]
    return Collectives(dict(totals), len(sizes), max(sizes, default=0), unknown)


def _callers_first(edges: dict, entry: str) -> list[str]:
    """The computations reachable from `entry`, every caller before its callees."""
    done, order = set(), []

    def visit(name):
        if name in done:
            return
        done.add(name)
        for callee, _ in edges.get(name, ()):
            visit(callee)
        order.append(name)

    visit(entry)
    return order[::-1]


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    computations: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None:
            computations[current].append(line)
    return computations, entry


def _shape_bytes(shape: str) -> int:
    """Bytes of an HLO result shape; of its last element for an async start's tuple (operands,
    then the result)."""
    shapes = _SHAPE.findall(shape)
    if shape.startswith("("):
        shapes = shapes[-1:]
    return sum(_BYTES.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1])) for t, dims in shapes)
