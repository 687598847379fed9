"""The arguments of a slot program (decode steps, a speculation round, plain steps in a round's
place, a round's verify pass: over the engine's slots), by name. The engine builds them
(`DeviceSlots.program`), the programs take them in this order, donation names what it gives away
(`DONATED`), and a benchmark replays a captured call by name."""

from __future__ import annotations

from typing import Any, NamedTuple


class SlotArgs(NamedTuple):
    """params:        the weights the program reads (`Model.run_params`)
    cache:         the paged KV cache
    state:         the slots' `DecodeState`, without its prompts
    spec_counters: the slots' `SpecCounters` (a round's program updates them; others pass them on)
    prompt:        the slots' prompts for a prompt lookup (`PromptTokens`), or None
    inputs:        the program's own, in its order: block table and group mask (a verify pass:
                   its drafts first)"""

    params: Any
    cache: Any
    state: Any
    spec_counters: Any
    prompt: Any
    inputs: tuple


# What a slot program gives away: what it returns replaces them (XLA updates them in place).
DONATED = tuple(SlotArgs._fields.index(name) for name in ("cache", "state", "spec_counters"))
