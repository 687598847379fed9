"""What a request's `exit` and `spec` arguments ask for, as given (a config, a string or None):
the one rule between early exit and speculation (`check_exit_or_spec`), and the speculation a
`spec` runs (`resolve_spec`: "auto" is `auto_spec()` where it pays, "none" / "off" / "" none),
and what a `spec` that was not given means (`DEFAULT_SPEC`, `default_spec`: "auto" unless an exit
is asked)."""

from __future__ import annotations

import enum

import eejax.options.grammar as grammar
from eejax.errors import EejaxError
from eejax.options.speculation import DraftLookupSpec, SpecConfig

LONG_COPIES = 7  # a CPU's float32 `auto`: drafts copied after a match of 4 tokens (8 positions scored)


def auto_spec(on_cpu: bool = False, cheap_drafts: bool = False) -> SpecConfig:
    """What `spec="auto"` runs on a model with a draft head: the head's chain with prompt lookup
    (up to 4 copied drafts), d chosen per program by the adaptive policy from 1 to 4, plain
    full-depth steps where no round pays, and speculation turned off for the group's rows where
    none would (`decode.spec_policy`). Spelled `draft:2:adaptive:lookup=4` with max_speculations 4.

    `on_cpu`: rounds priced from a table rather than timed (`spec_policy.round_prices`), the head's
    chain with up to 2 copied drafts, d 1 or 2 (`draft:2:adaptive:lookup` with max_speculations 2):
    on a CPU a verify pass costs more per position it scores, and deeper rounds lost on the
    quantized blocks and on float32 weights with a float head (the chat head at batch 1 on a 2-core
    EPYC, 2026-12-01: docs/results/cpu-2026-11.md). With `cheap_drafts` (the head drafts from
    blocks beside float32 weights, `Model.drafts_in_blocks`: a round of 3 positions costs 1.20
    steps) the chain of up to 3 (d 1 to 3 or plain steps; on chat it picked 2 and 3 about
    equally), with up to 7 copies where a row's last 4 tokens occurred before and up to d after a
    shorter match (`draft:3:adaptive:lookup=7` with max_speculations 3; a long copy's round scores
    8 positions, the float32 kernels' most rows). Against the chain of 2 it gave 1.66x full depth
    on MT-bench against 1.58x, 1.92x on Python's docs against 1.88x, 2.04x on code against 1.86x
    (2026-12-02, 3 copies)."""
    if on_cpu and cheap_drafts:
        return DraftLookupSpec(3, adaptive=True, max_speculations=3, lookup=LONG_COPIES)
    if on_cpu:
        return DraftLookupSpec(2, adaptive=True, max_speculations=2, lookup=2)
    return DraftLookupSpec(2, adaptive=True, max_speculations=4, lookup=4)


class _Default(enum.Enum):
    SPEC = "auto unless an exit is asked"

    def __repr__(self) -> str:
        return "DEFAULT_SPEC"


DEFAULT_SPEC = _Default.SPEC  # `spec` not given (`generate`, `Engine`): see `default_spec`


def _asked(option) -> bool:
    """Whether an `exit` or `spec` as given asks for its kind of decoding (not None, "none", "off", "")."""
    return option is not None and not grammar.is_off(option)


def default_spec(exit, spec):  # noqa: A002
    """`spec` as given, or where it was not given (`DEFAULT_SPEC`): "auto" (the draft head where
    it pays, `resolve_spec`; full depth on a model without one) unless `exit` asks for early
    exit, then None (no speculation: the exit decodes)."""
    if spec is not DEFAULT_SPEC:
        return spec
    return None if _asked(exit) else "auto"


def check_exit_or_spec(exit, spec, names: tuple[str, str] = ("early exit (exit)", "self-speculation (spec)")) -> None:
    """The one rule between early exit and speculation: a request decodes with one of them at
    most. `exit` and `spec` as given (a config, a string or None): None and the strings "none",
    "off" and "" ask for neither; any config does (an `ExitConfig("none")` runs the early-exit
    loop); "auto" asks for speculation even where it would run full depth. `names`: how the
    caller spells the two (flags, keywords)."""
    if _asked(exit) and _asked(spec):
        raise EejaxError(f"choose {names[0]} or {names[1]}, not both")


def resolve_spec(
    spec: SpecConfig | str | None,
    has_draft_head: bool,
    speculate: bool = True,
    on_cpu: bool = False,
    cheap_drafts: bool = False,
) -> SpecConfig | None:
    """A `spec` argument as the SpecConfig it runs, or None for full depth: "auto" is
    `auto_spec(on_cpu, cheap_drafts)` on a model with a draft head where `speculate`
    (`spec_policy.auto_speculates`: the device and the rows decoding at once), else full depth;
    "none", "off" and "" are full depth; another string is `SpecConfig.parse`d."""
    if not isinstance(spec, str):
        return spec
    if grammar.is_auto(spec):
        return auto_spec(on_cpu, cheap_drafts) if has_draft_head and speculate else None
    if grammar.is_off(spec):
        return None
    return SpecConfig.parse(spec)
