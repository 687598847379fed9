"""How many drafts per self-speculation round: fixed, or chosen per round from measurements.

Cost model. A round with d drafts costs `(d + 1) * c_draft + c_verify(d)` (d + 1 passes of
the E draft layers + exit head, one verify pass of the other layers over d + 1 tokens). If each
draft is accepted with probability α independently, a row emits
`expected_tokens(α, d) = (1 - α^(d+1)) / (1 - α)` tokens per round (accepted prefix + one).
The adaptive policy picks the d in [1, max_speculations] with the most expected tokens per
second, using α measured so far (accepted / (accepted + rejections), both with exponential
forgetting so it follows the text), c_draft the running mean of the draft program's time per
pass, and c_verify(d) a least-squares line a + b (d + 1) through the mean verify time of each d
tried (flat while only one d was tried: on a GPU a verify pass costs about the same for any
small d, on a CPU it grows with the tokens, which the line learns once a second d ran).
Against plain decoding (c_full a step) the speed-up is
`expected_tokens(α, d) * c_full / ((d + 1) c_draft + c_verify)`; `break_even_acceptance`
solves it for 1.

**Plain steps.** When no d is predicted to beat plain decoding at the measured acceptance
(an exit that rarely agrees with the last layer: untrained exits, text the early layers cannot
guess), the adaptive policy answers d = 0, one plain full-depth step, whose time it measures
(c_full; until a plain step ran, a draft pass without its head plus a one-token verify stand
for it). Every `PROBE_EVERY`-th such step runs a speculation round instead, so the acceptance
estimate keeps following the text and speculation resumes once it pays. A fixed d never falls
back.

The bonus pass (the (d + 1)-th pass over x_d, see `speculative`) buys one token only when all
d drafts are accepted (probability α^d) and costs E layers every round. The policy turns it on
when it pays under the weights-read cost model (`eejax.decode.cost`), with the acceptance
measured so far: fixed-d rounds update α each time the host reads the counters. Greedy
tokens do not depend on the choice; sampled ones do (draws are keyed by position, and rounds
would start elsewhere), so a sampling run keeps the bonus pass on and a row's tokens stay
independent of the rest of its batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from eejax.options import SpecConfig

FORGET = 0.8  # weight of the past per round in the acceptance estimate
PROBE_EVERY = 8  # plain steps between speculation rounds while speculation does not pay
PRIOR = (1.0, 1.0)  # pseudo-counts (accepted, rejected) before any round: α = 0.5


def expected_tokens(alpha: float, d: int) -> float:
    """Tokens a row emits per round with d drafts and acceptance probability α."""
    if alpha >= 1.0:
        return d + 1.0
    return (1.0 - alpha ** (d + 1)) / (1.0 - alpha)


def _verify_cost(c_verify, d: int) -> float:
    """c_verify is a number (the same for every d) or a function of d."""
    return c_verify(d) if callable(c_verify) else c_verify


def best_speculations(alpha: float, c_draft: float, c_verify, max_speculations: int) -> int:
    """The d in [1, max_speculations] with the most expected tokens per unit of cost."""
    return max(
        range(1, max_speculations + 1),
        key=lambda d: expected_tokens(alpha, d) / ((d + 1) * c_draft + _verify_cost(c_verify, d)),
    )


def speedup(alpha: float, d: int, c_draft: float, c_verify, c_full: float, bonus: bool = True) -> float:
    """Predicted tokens/s of self-speculation over plain decoding; without the bonus pass a
    round runs d draft passes and loses the token after d accepted drafts (probability α^d)."""
    tokens = expected_tokens(alpha, d) - (0.0 if bonus else alpha**d)
    return tokens * c_full / ((d + bonus) * c_draft + _verify_cost(c_verify, d))


def bonus_pays(alpha: float, d: int, pass_cost: float, head_cost: float, verify_cost: float) -> bool:
    """Whether the bonus pass raises expected tokens per cost: with it a round emits
    `expected_tokens(α, d)` for (d + 1) passes, without it α^d fewer for d passes (each round
    also pays d draft heads and one verify)."""
    fixed = d * head_cost + verify_cost
    with_bonus = expected_tokens(alpha, d) / ((d + 1) * pass_cost + fixed)
    without = (expected_tokens(alpha, d) - alpha**d) / (d * pass_cost + fixed)
    return with_bonus > without


def break_even_acceptance(c_draft: float, c_verify, c_full: float, max_speculations: int = 8) -> float:
    """The smallest α at which the best d breaks even with plain decoding (1.0 if none does)."""
    lo, hi = 0.0, 1.0
    if max(speedup(hi, d, c_draft, c_verify, c_full) for d in range(1, max_speculations + 1)) < 1.0:
        return 1.0
    for _ in range(50):  # bisection: the best speed-up grows with α
        mid = (lo + hi) / 2
        best = max(speedup(mid, d, c_draft, c_verify, c_full) for d in range(1, max_speculations + 1))
        lo, hi = (mid, hi) if best < 1.0 else (lo, mid)
    return hi


@dataclasses.dataclass
class SpeculationPolicy:
    """Host-side choice of d per round (see the module docstring for the rule)."""

    spec: SpecConfig
    unit_costs: tuple[float, float, float] | None = None  # weights of a draft pass, a draft head, a verify
    sampled: bool = False  # rows sample: the bonus pass stays on (see `bonus`)
    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]
    c_draft: float | None = None  # seconds per draft pass
    c_full: float | None = None  # seconds per plain full-depth step (adaptive, once one ran)
    plain_steps: int = 0  # plain steps chosen since the last speculation round
    plain_timed: int = 0  # plain steps timed
    verify_s: dict[int, float] = dataclasses.field(default_factory=dict)  # d -> mean seconds of a verify
    timed_rounds: dict[int, int] = dataclasses.field(default_factory=dict)  # d -> rounds timed
    chosen: list[int] = dataclasses.field(default_factory=list)
    bonuses: list[bool] = dataclasses.field(default_factory=list)

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def c_verify(self, d: int) -> float:
        """Predicted seconds of a verify pass over d + 1 tokens (see the module docstring)."""
        if len(self.verify_s) == 1:
            return next(iter(self.verify_s.values()))
        xs = np.array([k + 1 for k in self.verify_s], float)
        ys = np.array(list(self.verify_s.values()))
        slope, intercept = np.polyfit(xs, ys, 1)
        if slope < 0:  # noise: more tokens never cost less
            slope, intercept = 0.0, float(ys.mean())
        elif intercept < 0:  # a fixed cost is never negative: proportional to the tokens
            slope, intercept = float(xs @ ys / (xs @ xs)), 0.0
        return float(intercept + slope * (d + 1))

    def next_speculations(self) -> int:
        """d for the next round; 0 (adaptive only): a plain full-depth step instead."""
        if not self.spec.adaptive or self.c_draft is None:
            d = self.spec.num_speculations
        else:
            d = best_speculations(self.alpha, self.c_draft, self.c_verify, self.spec.max_speculations)
            if self.predicted_speedup(d) < 1.0 and self.plain_steps < PROBE_EVERY:
                d = 0
        self.plain_steps = self.plain_steps + 1 if d == 0 else 0
        self.chosen.append(d)
        return d

    def predicted_speedup(self, d: int) -> float:
        """A round of d drafts (the bonus pass as `bonus` would choose it) over a plain step,
        at the measured acceptance and times."""
        c_full = self.c_full if self.c_full is not None else self.plain_step_estimate()
        return speedup(self.alpha, d, self.c_draft, self.c_verify, c_full, bonus=self._bonus_choice(d))

    def plain_step_estimate(self) -> float:
        """Seconds of a plain step before one ran: a draft pass without its head (the head's share
        by the unit costs' weights) plus a one-token verify."""
        head_share = 0.0 if self.unit_costs is None else self.unit_costs[1] / sum(self.unit_costs[:2])
        return self.c_draft * (1.0 - head_share) + self.c_verify(0)

    def bonus(self, d: int) -> bool:
        """Whether the next round runs the bonus pass: `spec.bonus` when set, else whether it
        pays at the acceptance measured so far (always, without unit costs)."""
        choice = self._bonus_choice(d)
        self.bonuses.append(choice)
        return choice

    def _bonus_choice(self, d: int) -> bool:
        if self.spec.draft_head:  # its rounds always verify d + 1 positions (no pass to choose)
            return True
        if self.spec.bonus is not None:
            return self.spec.bonus
        if self.sampled:  # a sampled row's tokens depend on where rounds start: keep them batch-independent
            return True
        return self.unit_costs is None or bonus_pays(self.alpha, d, *self.unit_costs)

    def observe_plain(self, seconds: float) -> None:
        """A plain full-depth step took `seconds` (running mean, recent 16 weigh most)."""
        self.plain_timed += 1
        mean = seconds if self.c_full is None else self.c_full
        self.c_full = mean + (seconds - mean) / min(self.plain_timed, 16)

    def observe(
        self,
        d: int,
        accepted: int,
        rejected: int,
        draft_s: float | None = None,
        verify_s: float | None = None,
        passes: int | None = None,
    ) -> None:
        """One round (or the rounds since the last call): drafts accepted and rows that rejected
        one (summed over the batch), and the wall times of its draft (`passes` draft passes,
        default d + 1) and verify programs (None when not timed)."""
        self.accepted = FORGET * self.accepted + accepted
        self.rejected = FORGET * self.rejected + rejected
        if draft_s is not None and verify_s is not None:
            self.observe_times(d, draft_s, verify_s, passes)

    def observe_times(self, d: int, draft_s: float, verify_s: float, passes: int | None = None) -> None:
        """The wall times of a round's draft (`passes` draft passes, default d + 1) and verify
        programs (running means, the recent 16 weigh most)."""
        per_pass = draft_s / (d + 1 if passes is None else passes)
        total = sum(self.timed_rounds.values()) + 1
        self.c_draft = per_pass if self.c_draft is None else self.c_draft + (per_pass - self.c_draft) / min(total, 16)
        n = self.timed_rounds[d] = self.timed_rounds.get(d, 0) + 1
        mean = self.verify_s.get(d, verify_s)
        self.verify_s[d] = mean + (verify_s - mean) / min(n, 16)  # running mean, recent 16 weigh most
