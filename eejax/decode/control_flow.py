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

On a CPU a conditional has a cost of its own: XLA:CPU copies the KV cache into or out of a
`conditional`'s branches (16 MB, ~1.5 ms, in each round of SmolLM2 at 330 positions), while a
loop updates its carry in place. `run_if` and `one_of` are `lax.cond` and `lax.switch` written
as loops that run once or not at all, for the CPU's data-dependent branches (a GPU's programs
take none: `early_exit.static_loops`).
"""

from __future__ import annotations

import dataclasses
import re

import jax


@dataclasses.dataclass(frozen=True)
class ControlFlow:
    """While loops and conditionals of one program's optimised HLO."""

    dynamic_loops: int  # while loops without a known trip count: a host round trip per iteration on GPU
    static_loops: int  # with a known trip count: none
    conditionals: int  # a host round trip each time one runs


def run_if(pred, fn, operands: tuple) -> tuple:
    """fn(*operands) where pred (a scalar bool) holds, else operands unchanged (fn returns a tuple
    of what it takes), as one loop that runs once or not at all (see the module docstring)."""
    _, operands = jax.lax.while_loop(lambda carry: carry[0], lambda carry: (False, fn(*carry[1])), (pred, operands))
    return operands


def one_of(index, branches, *operands) -> tuple:
    """branches[index](*operands), as `lax.switch` computes it (each branch returns what it
    takes), as one `run_if` per branch."""
    for i, branch in enumerate(branches):
        operands = run_if(index == i, branch, operands)
    return operands


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


# Instructions that launch nothing on a GPU: views, tuples, constants (in the executable's data),
# and control flow (what it runs is counted through its computations).
_NO_KERNEL = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "after-all",
    "opt-barrier",
    "while",
    "conditional",
    "call",
}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_CALLED = re.compile(r"(?:condition|body|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16}
_IN_PLACE = ("scatter", "dynamic_update_slice", "dynamic-update-slice")  # write a slice of their output
_ALIASED = re.compile(
    r"output_to_operand_aliasing=\{(.*?)\}(?:, [a-z_]+=|$)"
)  # a custom call's outputs updated in place


def _written_bytes(name: str, op: str, shape: str, line: str = "") -> int:
    """Bytes an instruction of result type `shape` writes: all of it, but for an update in place
    (the op, or a fusion named after it) and a custom call's outputs that alias its operands
    (a Triton kernel writing the KV cache's new slots)."""
    if any(word in name or word == op for word in _IN_PLACE):
        return 0
    aliased = _ALIASED.search(line)
    skip = {int(i) for i in re.findall(r"\{(\d+)\}:", aliased.group(1))} if aliased else set()
    total = 0
    for index, (dtype, dims) in enumerate(_ARRAY.findall(shape)):
        if index in skip:
            continue
        elements = 1
        for n in filter(None, dims.split(",")):
            elements *= int(n)
        total += elements * _BITS.get(dtype, 32 if dtype[-2:] == "32" else 64) // 8
    return total


@dataclasses.dataclass(frozen=True)
class KernelLaunches:
    """The kernels one run of a program launches on a GPU, from XLA:GPU's optimised HLO."""

    total: int  # per run: loops' bodies times their trip counts, the larger branch of a conditional
    written_bytes: int  # per run, what those kernels write (updates in place, such as the cache's, left out)
    # each while loop, inner ones first: (trip count or None, kernels an iteration)
    loops: tuple[tuple[int | None, int], ...]
    dynamic_loops: int  # loops without a known trip count, counted as one iteration


def kernel_launches(hlo_text: str) -> KernelLaunches:
    """Counts the kernels a GPU program launches (`compiled.as_text()` of a program compiled for a
    GPU, `ProgramCache.compile_for`): each fusion, custom call (a GEMM, a Triton kernel), copy,
    or other unfused instruction outside fused computations is one launch. At batch 1 a small
    model's decode step is bound by their number (~720 a token measured on an H100), and what
    they write beyond their inputs (a product XLA left unfused, say) is memory traffic on top of
    reading the weights."""
    computations: dict[str, list[tuple[str, str, str, str]]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = computations.setdefault(m.group(1), [])
            entry = m.group(1) if line.startswith("ENTRY ") else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and (i := _INSTRUCTION.match(line)):
            current.append((i.group(1), i.group(2), i.group(3), line))
    loops: list[tuple[int | None, int]] = []

    def run(name: str) -> tuple[int, int]:
        """(kernels, bytes written) of one run of computation `name`."""
        count = written = 0
        for result, shape, op, line in computations.get(name, ()):
            if op not in _NO_KERNEL:
                count += 1
                written += _written_bytes(result, op, shape, line)
            elif op == "while":
                condition, body = _CALLED.findall(line)[:2]
                trips = _TRIP_COUNT.search(line)
                n = int(trips.group(1)) if trips else 1
                (c1, w1), (c2, w2) = run(condition), run(body)
                loops.append((int(trips.group(1)) if trips else None, c1 + c2))
                count, written = count + n * (c1 + c2) + c1, written + n * (w1 + w2) + w1
            elif op in ("conditional", "call"):
                branches = _BRANCHES.search(line)
                names = [n.strip() for n in branches.group(1).replace("%", "").split(",")] if branches else []
                runs = [run(n) for n in names or _CALLED.findall(line)]
                if op == "call":
                    count, written = count + sum(c for c, _ in runs), written + sum(w for _, w in runs)
                elif runs:
                    c, w = max(runs)
                    count, written = count + c, written + w
        return count, written

    total, written = run(entry) if entry else (0, 0)
    return KernelLaunches(total, written, tuple(loops), sum(trips is None for trips, _ in loops))
