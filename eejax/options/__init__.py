"""Decoding options, by concern: what the user gives, frozen and checked (`ExitConfig` in
`early_exit`; `SpecConfig`, one record per method, in `speculation`), what a request's `exit` and
`spec` arguments ask for (`resolve`: "auto", a `spec` not given, the rule between the two), their string grammar
(`grammar`: "softmax:0.9", "draft:4:lookup", "auto", "none"), and the compile key of a program
(`StepOptions` in `step`). The names are re-exported here."""

from eejax.options.early_exit import HEADS, ExitConfig
from eejax.options.grammar import EXIT_MEASURES, MAX_SPECULATIONS, OFF, is_auto, is_off
from eejax.options.resolve import DEFAULT_SPEC, auto_spec, check_exit_or_spec, default_spec, resolve_spec
from eejax.options.speculation import (
    METHODS,
    DraftChainSpec,
    DraftLookupSpec,
    DraftStopSpec,
    DraftTreeSpec,
    LayerSkipSpec,
    SpecConfig,
)
from eejax.options.step import StepOptions

__all__ = [
    "DEFAULT_SPEC",
    "EXIT_MEASURES",
    "HEADS",
    "MAX_SPECULATIONS",
    "METHODS",
    "OFF",
    "DraftChainSpec",
    "DraftLookupSpec",
    "DraftStopSpec",
    "DraftTreeSpec",
    "ExitConfig",
    "LayerSkipSpec",
    "SpecConfig",
    "StepOptions",
    "auto_spec",
    "check_exit_or_spec",
    "default_spec",
    "is_auto",
    "is_off",
    "resolve_spec",
]
