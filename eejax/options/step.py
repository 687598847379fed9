"""The compile key of a generation program: `StepOptions`, all that a compiled program depends
on besides its input shapes and the model, and the views of it each program reads."""

from __future__ import annotations

import dataclasses
import functools

from eejax.errors import EejaxError
from eejax.options.early_exit import ExitConfig
from eejax.options.resolve import check_exit_or_spec
from eejax.options.speculation import DraftChainSpec, SpecConfig


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Everything a compiled generation program depends on besides its input shapes and the
    model: one frozen value, the key of the program cache (`ProgramCache.get`). Values that vary
    per row (sampling temperature / top-k / top-p, seeds, limits) are traced, not options.

    max_new_tokens: the width of the per-row token record (a row's own limit is traced).
    eos_ids:        the tokens that end a row.
    sampler:        "greedy", "temperature" or "filtered" (`sampling.sample`).
    exit:           early exit in decode steps (a resolved `ExitConfig`), None: full depth.
    spec:           speculation (a `SpecConfig` method's record); in a round's programs what the
                    round runs, `spec.at_depth(d)`, with d that round's (see `round`).
    spec_off:       (engine groups) rows of `spec` whose speculation the adaptive policy turned
                    off: plain steps without the draft's catch-up (`plain(catch_up=False)`).
    bonus:          a draft program runs the (d + 1)-th pass (`speculative.draft`).
    attention:      the attention implementation (`kernels.attention.IMPLS`).
    logprobs:       keep a log-prob record of the generated tokens.
    penalties:      apply the rows' repetition / frequency / presence penalties, over the
                    token counts the program then takes and returns in `DecodeState.counts`.
    prompt_logprobs: a prefill also scores the prompt's own tokens (`prompt_scores`).
    num_steps:      decode steps per program (`steps.decode_steps`); in a round's programs, the
                    rounds per program (`speculative.spec_round_slots`).

    Each program reads some of these; the views below keep those and reset the rest, so that
    options a program ignores never compile it twice.
    """

    max_new_tokens: int
    eos_ids: tuple[int, ...] = ()
    sampler: str = "greedy"
    exit: ExitConfig | None = None
    spec: SpecConfig | None = None
    spec_off: bool = False
    bonus: bool = False
    attention: str = "auto"
    logprobs: bool = False
    penalties: bool = False
    prompt_logprobs: bool = False
    num_steps: int = 1

    def __post_init__(self):
        object.__setattr__(self, "eos_ids", tuple(int(t) for t in self.eos_ids))
        check_exit_or_spec(self.exit, self.spec)
        if isinstance(self.num_steps, bool) or int(self.num_steps) != self.num_steps or self.num_steps < 1:
            raise EejaxError(f"num_steps (decode steps per program) must be an integer >= 1, got {self.num_steps}")
        if self.spec is not None:
            self.spec.check_sampling(self.sampler, self.penalties)

    def prefilling(self) -> StepOptions:
        """What a prefill reads: no early exit (prompts run at full depth), speculation or steps."""
        return dataclasses.replace(self, exit=None, spec=None, spec_off=False, bonus=False, num_steps=1)

    def decoding(self, num_steps: int = 1) -> StepOptions:
        """What `num_steps` decode steps read (no speculation)."""
        return dataclasses.replace(self, spec=None, spec_off=False, bonus=False, num_steps=num_steps)

    def round(self, num_speculations: int, bonus: bool = False, rounds: int = 1) -> StepOptions:
        """`rounds` speculation rounds (`num_steps`) of d = `num_speculations` drafts: only the
        draft layers, d, the draft head and `bonus` of `spec` matter to their programs (not
        adaptive, max, or bonus policy). Made once per (options, d, bonus, rounds): the engine
        asks for it every dispatch."""
        return _round(self, num_speculations, bonus, rounds)

    def plain(self, num_steps: int = 1, catch_up: bool = True) -> StepOptions:
        """What `num_steps` full-depth decode steps in place of a round read (`decoding`); with a
        draft head and `catch_up`, also that they end with the draft's catch-up
        (`speculative.plain_step`)."""
        if catch_up and self.spec is not None and self.spec.draft_head:  # (a plain step looks nothing up)
            return dataclasses.replace(self.round(1), spec=DraftChainSpec(1, head=self.spec.head), num_steps=num_steps)
        return self.decoding(num_steps)

    def drafting(self) -> StepOptions:
        """What a round's draft program reads: no limits, EOS or log-probs (`round` first)."""
        return StepOptions(0, sampler=self.sampler, spec=self.spec, bonus=self.bonus, attention=self.attention)

    def verifying(self) -> StepOptions:
        """What a round's verify program reads (the number of scored positions is a shape)."""
        return dataclasses.replace(self, bonus=False)


@functools.lru_cache(maxsize=256)
def _round(options: StepOptions, num_speculations: int, bonus: bool, rounds: int) -> StepOptions:
    spec = options.spec.at_depth(num_speculations)
    bonus = bonus and not spec.draft_head  # a draft head's round always scores d + 1 positions
    return dataclasses.replace(options, exit=None, spec=spec, bonus=bonus, num_steps=rounds)
