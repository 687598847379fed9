"""How many drafts per self-speculation round: fixed, or chosen per round from measurements.

Cost model. A round with d drafts costs `(d + 1) * c_draft + c_verify(d)` (d + 1 passes of the E
draft layers + exit head, one verify pass of the other layers over d + 1 tokens). If draft k is
accepted with probability α_k once the k - 1 before it were, a row emits `expected_tokens(α, d) =
1 + α_1 + α_1·α_2 + ...` tokens per round (accepted prefix + one). The adaptive policy picks the d
in [1, max_speculations] with the most expected tokens per second, using the α_k measured so far
(`depth_alphas`: per depth, the rounds that accepted draft k over those that judged it, from the
engine's `SpecCounters.depth_judged`, with exponential forgetting so they follow the text; a depth
never judged is priced as the one before it, the first from the pooled α = accepted / (accepted +
rejections)). A head guesses its drafts unalike by depth (the chat head with `draft:4` on the
CPU's default load, 2026-12-01: 0.47, 0.51, 0.48, 0.66 on chat, 0.57, 0.57, 0.48, 0.74 on Python's
docs), which a pooled α averages away. c_draft is the running mean of the draft program's time per
pass, and c_verify(d) a least-squares line a + b (d + 1) through the mean verify time of each d
tried (flat while only one d was tried: on a GPU a verify pass costs about the same for any small
d, on a CPU it grows with the tokens, which the line learns once a second d ran). With a draft
head, a plain step is the line's d = 0 point (the whole model over one position, then the draft's
catch-up: a verify with no drafts), so the line has a slope from the first round and plain step
on, and no d looks cheap for want of a second one (on a 2-core CPU at batch 8, where verifying 8
(d + 1) rows costs about d + 1 steps, the flat line made the largest d look best). Against plain
decoding (c_full a step) the speed-up is `expected_tokens(α, d) * c_full / ((d + 1) c_draft +
c_verify)`; `break_even_acceptance` solves it for 1.

**Plain steps.** When no d is predicted to beat plain decoding by `PAYS_ABOVE` (priced rounds: at
all, `pays_above`) at the measured acceptance (an exit that rarely agrees with the last layer:
untrained exits, text the early layers cannot guess), the adaptive policy answers d = 0: plain
full-depth steps, as many in one program as full depth runs (`steps_per_dispatch`: the pages a
speculating row holds cover that many rounds).
After `PROBE_EVERY` such programs a probe round runs instead, so the acceptance estimate keeps
following the text and speculation resumes once it pays; each probe after which rounds still
do not pay doubles the programs before the next (up to `MAX_PROBE_EVERY`), so text where
speculation never pays loses little to probing. A fixed d never falls back.

**Turning speculation off (draft heads).** A draft head's plain steps keep its K/V up to date (one
draft-layer pass over their positions, so a later round can draft), which costs ~1/31 of the
products per token: ~3.5% of a step on a CPU at batch 8, where the products are the cost; at batch
1 next to nothing on float32 weights, 3-5% of a step on a fast CPU's quantized blocks
(`benchmarks/round_costs.py`'s catch-up step). So a round must beat the plain step less that
catch-up (`c_plain`: c_full less a draft pass, which bounds it): what the rows would run with
speculation off. When no round would pay even at `TURN_OFF_MARGIN` more acceptance than measured
(`PRICED_TURN_OFF_MARGIN` where rounds are priced), the policy answers d = 0 with `turned_off` set:
the engine then runs the group's rows as plain full-depth rows for the rest of their lives
(`Speculation`), with no catch-up and no probes; rows that come later start with a policy of their
own, which measures again (a batch job's priced policy starts from its predecessor's acceptance:
`carried`). The acceptance must rest on `TURN_OFF_EVIDENCE` judged drafts first (at batch 1 a few
rounds say little, and off is for good), or, from `EARLY_EVIDENCE`, no round may pay even at two
standard errors more: before, speculation turns off only where not even every draft accepted would
pay, and a group whose rounds do not pay keeps running rounds at the best d rather than plain steps
between probes, which gathers that evidence sooner.
Measured costs win over the line: a d whose whole round was timed is costed at its own time
(a round has costs of its own beyond its positions' products, which the line through the plain
step understates for small d).

**What is timed.** Every cost above is measured, never guessed: first a round at the
configured d as two programs, a draft and a verify, timed apart (the host waits for each:
c_draft; one round only: at a batch of 8 a round can cost two plain steps), then plain steps
(c_full); then rounds run whole, several at one d in a program as a fixed d's do (no host
round trip between draft and verify; the policy picks d per program), and a round's cost less
its draft passes at c_draft is its verify's (c_full: a plain program's cost per step). The cost
of a plain step or a whole round is its program's cost in the engine's loop over its steps or
rounds, with nothing waited for: the wall time of the engine step that reads its tokens, end
to end, when it was the only program of its step and that step prefilled nothing
(`Speculation._time_program`). That counts the host's own work per
dispatch where it cannot hide behind the device (on a 2-core CPU the host's Python and XLA's
threads share the cores), costs a round and a plain step alike, and keeps the overlap of one
dispatch with the next that a timed program (the host waiting for it) loses; it also compiles
nothing: a step that compiled or prefilled is not counted. A program's first run is not counted
(one-time costs: 3x a round's time was seen). Every `REFRESH_EVERY` programs of rounds a plain
step and a split round measure c_full and c_draft again, so both follow the batch's size and
the machine's load as the verify times do; while rounds are predicted to pay less than
`RECHECK_BELOW`, plain steps run every `RECHECK_EVERY` programs of rounds, so that a marginal
round is weighed against a plain step timed at about the same moment (the machine's speed
drifts). (The policy picks d per program: `next_speculations` is asked once a program.)

**Priced rounds (a CPU, one row at a time).** Where a round's cost in plain steps is known for
every d the policy may pick (`prices`: `round_prices`, measured in the engine), nothing is timed:
c_full is one step, each d's round costs its price, and only the acceptance is measured. On a
2-core CPU at batch 1 the timed choices were noise: rounds there gain 1.1-1.4x, and the machine's
speed moves 10-40% between programs (the chat head on the GGUF blocks, 2026-12-01: `draft:2`
1.12-1.38x full depth on chat, docs, code and news; `draft:2:adaptive` timed, d up to 3,
1.05-1.23x, with 51% plain steps on the docs; priced, 1.23-1.37x). A priced policy's rows come one
at a time there, and rows differ (the chat head on Python's docs: the acceptance went 0.28, 0.69,
0.35 over the first rows): where the group's rows are all new, what the last ones measured counts
as `EARLY_EVIDENCE` judged drafts (`new_rows`), so that one poor row does not leave the rows after
it on plain steps. On float32 weights likewise (the chat head, 2026-12-01, a 2-core EPYC, medians of
3 paired runs): `spec="auto"` timed, d up to 4 with 4 copies, 1.21x full depth on chat, 1.45x on
Python's docs, 1.43x on code and 1.30x on news; priced, d up to 2 with 2 copies, 1.35x, 1.50x,
1.60x and 1.39x, and a fixed `draft:2:lookup` 1.37x, 1.48x, 1.69x and 1.42x in the same runs.

The bonus pass (the (d + 1)-th pass over x_d, see `speculative`) buys one token only when all
d drafts are accepted (probability α^d) and costs E layers every round. The policy turns it on
when it pays under the weights-read cost model (`eejax.decode.cost`), with the acceptance
measured so far: fixed-d rounds update α each time the host reads the counters. Greedy
tokens do not depend on the choice; sampled ones do (draws are keyed by position, and rounds
would start elsewhere), so a sampling run keeps the bonus pass on and a row's tokens stay
independent of the rest of its batch.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from eejax.kernels.backend import backend
from eejax.options import SpecConfig

FORGET = 0.95  # weight of the past per read of the counters in the acceptance estimate (~20 reads)
PROBE_EVERY = 8  # plain programs before a probe round while speculation does not pay ...
MAX_PROBE_EVERY = 64  # ... doubled after each probe that did not make it pay, up to this
PRIOR = (1.0, 1.0)  # pseudo-counts (accepted, rejected) before any round: α = 0.5
DEPTH_PRIOR = 2.0  # rounds' weight of the depth before's acceptance in a depth's (`depth_alphas`)
REFRESH_EVERY = 32  # programs of rounds between re-measurements of a draft pass (a split round) and a plain step
TURN_OFF_MARGIN = 0.05  # (draft heads) off when no round pays even at this much more acceptance: the
# shipped head's α on held-out CNN/DM rows 0..19 (`draft:2`) is 0.53 / 0.56 / 0.60 / 0.65 over rows
# 0-7 / 4-11 / 8-15 / 12-19 (0.44-0.98 per row), so a batch's text rarely moves it much more
PRICED_TURN_OFF_MARGIN = 0.02  # the same for priced rounds (`prices`: a CPU's rows one at a time): off
# costs one row (the next measures again: `new_rows`), and a row whose acceptance is in the margin runs
# rounds that lose up to margin / price (0.05 / 1.37: 3.6% of a step on the blocks); the news head on chat
# sat there (α ~0.33). The policy's choices counted and priced at `CPU_BLOCK_ROUND_STEPS` (2026-12-03,
# `benchmarks/priced_choices.py` with and without `--turn-off-margin 0.05`): the news head 0.981x ->
# 0.986x full depth on chat, 1.249x -> 1.261x on Python's docs, the chat head 1.327x -> 1.340x on the
# docs, no set of nine lower
TURN_OFF_EVIDENCE = 24  # (draft heads) ... once this many drafts were judged (accepted, or a round's
# rejection): the acceptance of a few rounds at batch 1 is too noisy to stop a row's speculation for good
# (its standard error at 24: ~0.1; per-row α of the shipped head spans 0.44-0.98)
EARLY_EVIDENCE = 8  # (draft heads) ... or from this many, where even two standard errors more would not
# pay (the news head on code requests at batch 1: α ~0.05; the first row's 24 judged drafts cost its
# job 5% of full depth's speed)
RECHECK_BELOW = 1.2  # rounds predicted to pay less than this ...
RECHECK_EVERY = 8  # ... give way to plain steps every this many programs, which time them again: a round's
# cost is timed every round, a plain step's only when one runs, and on a 2-core CPU the machine's speed
# drifts 10-40% within a run, so a plain step timed long ago made marginal rounds look paying (batch 8:
# plain steps timed at 62 ms in a slow minute, d = 2 rounds then run at 100 ms against 47 ms steps)
PAYS_ABOVE = 1.05  # a round is chosen over plain steps when predicted this much faster: the margin of
# its timings (2-core CPU timings move 10-40% within a minute). Priced rounds (`prices`) have no timings
# and need no margin: a round pays where it beats a plain step (`pays_above`). With the margin, `auto` on
# a CPU's blocks ran plain steps where a fixed `draft:2:lookup` still gained (the chat head, 2026-12-01,
# a 2-core EPYC, medians of 3 paired runs: 1.20x, 1.48x, 1.34x and 1.28x full depth on chat, docs, code
# and news; without it 1.13x, 1.47x, 1.43x and 1.47x; the fixed setting 1.10x, 1.43x, 1.47x and 1.47x).


AUTO_CPU_ROWS = 1  # spec="auto" speculates on a CPU when at most this many rows decode at once

# A round's cost in full-depth steps on a CPU's quantized blocks (GGUF q4_1 + q8_0, int16
# activations, the draft head's chain, batch 1), as the engine pays it: τ of a fixed `draft:d` over
# its speed-up against full depth. The price moves with the machine, and a round has a large fixed
# cost (its verify's products are compute-bound on two cores), so it weighs most where steps are
# fastest. On a 2-core Xeon with AVX-512 VNNI and AMX, 2026-12-01 (full depth 4-6.5 ms a token; the
# chat head, chat, docs, code and news, 8 prompts, 64 tokens, medians of 3 paired runs): d = 1
# 1.42-1.55, d = 2 1.37-1.67, d = 3 1.62-1.81, d = 4 1.82-2.10 (the medians were the table before);
# hours before, full depth at 7.1-7.5 ms, d = 2 cost 1.31-1.36. On the same kind of host with 3-5 ms
# steps (2026-12-02, five sets, 2 paired runs each): d = 1 1.29-1.53 (median 1.37), d = 2 1.45-1.62
# (1.56); the programs alone (`benchmarks/round_costs.py --quantization gguf --activations int16
# --per-program 4`, 40- and 400-token prompts, 2026-12-03): 1.25-1.29 and 1.53-1.54. The table takes
# the fast host's d = 1 and 2 (the dearest round of two) and the first sitting's 3 and 4: priced at a
# cheaper round of two, a head out of its domain keeps drafting where rounds lose (the news head on
# chat, its choices counted and priced at the fast host's costs by `benchmarks/priced_choices.py`:
# 0.942x full depth at 1.42 and 1.47, 0.986x at these), while priced dearer than they are, the policy
# merely drafts d = 1 more often or turns a poor row off sooner (the chat head, priced at either
# host's costs: within 2.4% of the old table on chat, MT-bench, docs and code; news 1.19x against
# 1.22x at the fast host's, 1.30x against 1.42x at the slow sitting's).
CPU_BLOCK_ROUND_STEPS = {1: 1.37, 2: 1.56, 3: 1.70, 4: 1.94}

# The same on float32 weights whose draft head drafts from Q8_0 blocks (`Model.drafts_in_blocks`: a CPU
# where the kernel's tiled loop runs; the chat head, batch 1, a 2-core AMD EPYC (Zen 4), 2026-12-02):
# τ of a fixed `draft:d:lookup` over its speed-up against full depth (8 prompts a set, 64 tokens, 2
# paired runs; `benchmarks/draft_head.py --specs draft:1:lookup draft:2:lookup draft:3:lookup
# draft:4:lookup`), the medians over MT-bench, chat, Python's docs, code and news: d = 1 1.05-1.07,
# d = 2 1.10-1.15, d = 3 1.17-1.22, d = 4 1.26-1.28.
CPU_FLOAT_ROUND_STEPS = {1: 1.07, 2: 1.12, 3: 1.20, 4: 1.27}

# The same where the draft head stays float (no tiled loop): τ of a fixed `draft:d:lookup` over its
# speed-up against full depth (8 prompts a set, 64 tokens, 2 paired runs; `benchmarks/draft_head.py
# --specs draft:1:lookup draft:2:lookup draft:3:lookup draft:4:lookup`), the medians over MT-bench,
# chat, Python's docs, code and news: d = 1 1.09-1.12, d = 2 1.18-1.22, d = 3 1.24-1.33, d = 4
# 1.33-1.44 (2026-12-02, once the library's float32 products prefetched their next rows; before, a
# verify pass's added positions were not free: 1.23, 1.33, 1.40, 1.58 on 2026-12-01).
CPU_FLOAT_DRAFT_ROUND_STEPS = {1: 1.10, 2: 1.19, 3: 1.27, 4: 1.39}


def auto_speculates(rows: int) -> bool:
    """Whether `spec="auto"` speculates when `rows` rows decode at once (an engine's slots). On a
    GPU, always: a verify pass over a few positions costs about a step there (H200, 2026-11-28:
    `draft:4:lookup` 1.75x full depth at batch 1, 1.41x at batch 8). On a CPU, for a single row:
    with more, the verify pass is compute-bound and costs ~d + 1 steps, and auto lost while its
    policy found that out (this 2-core CPU, 2026-11-29, 64 tokens: float32 weights at batch 8 0.89x
    on MT-bench and on CNN/DM). In one process only: across processes the adaptive policy's
    choices, each process's own, would differ (`Requests.checked_spec` refuses adaptive there)."""
    if jax.process_count() > 1:
        return False
    return backend() != "cpu" or rows <= AUTO_CPU_ROWS


def on_cpu() -> bool:
    """Whether models decode on a CPU, where `spec="auto"` runs `options.auto_spec(on_cpu=True)`
    and an adaptive draft head's rounds at batch 1 are priced (`round_prices`)."""
    return backend() == "cpu"


def round_prices(
    spec: SpecConfig, quantized: bool, rows: int = 1, float_draft: bool = False
) -> dict[int, float] | None:
    """A round's cost in plain steps for each d an adaptive `spec` may pick, where the policy
    prices rounds instead of timing them (see the module docstring): a draft head's chain on a
    CPU where at most `AUTO_CPU_ROWS` of `rows` (the engine's slots) decode at once, up to 4
    positions drafted, from `CPU_BLOCK_ROUND_STEPS` on `quantized` weights, else
    `CPU_FLOAT_ROUND_STEPS` (`CPU_FLOAT_DRAFT_ROUND_STEPS` where the head drafts from float
    weights, `float_draft`); else None (timed: the prices are one row's, and with more a verify
    pass costs ~d + 1 steps there). With a prompt lookup of k > d copies a round is priced as its
    chain's: it scores k + 1 positions only where a row copies past d (a match of 4 tokens, whose
    copies go on: `feature_draft._draft_with_lookup`), and those rounds pay for themselves."""
    if not (spec.adaptive and spec.draft_head and on_cpu() and rows <= AUTO_CPU_ROWS):
        return None
    table = (
        CPU_BLOCK_ROUND_STEPS if quantized else CPU_FLOAT_DRAFT_ROUND_STEPS if float_draft else CPU_FLOAT_ROUND_STEPS
    )
    if spec.method not in ("draft", "lookup") or spec.max_speculations > max(table):
        return None
    return {d: table[d] for d in range(1, spec.max_speculations + 1)}


def depth_chain(alpha, d: int) -> np.ndarray:
    """The acceptance of drafts 1..d, each given the ones before it: α (a number, every draft
    alike) or a sequence by depth (the last one stands for the depths past it) [d]."""
    a = np.atleast_1d(np.asarray(alpha, float))
    return np.concatenate([a[:d], np.full(max(d - len(a), 0), a[-1])])


def expected_tokens(alpha, d: int) -> float:
    """Tokens a row emits per round with d drafts, each accepted with probability α given the
    ones before it (`depth_chain`): 1 + α1 + α1·α2 + ..."""
    return float(1.0 + np.sum(np.cumprod(depth_chain(alpha, d))))


def all_accepted(alpha, d: int) -> float:
    """The probability that all d drafts of a round are accepted."""
    return float(np.prod(depth_chain(alpha, d)))


def _padded(counts, width: int) -> np.ndarray:
    """counts [k] as floats, zeros after them up to `width`."""
    counts = np.asarray(counts, float)
    return np.pad(counts, (0, width - len(counts)))


def _verify_cost(c_verify, d: int) -> float:
    """c_verify is a number (the same for every d) or a function of d."""
    return c_verify(d) if callable(c_verify) else c_verify


def best_speculations(alpha, c_draft: float, c_verify, max_speculations: int) -> int:
    """The d in [1, max_speculations] with the most expected tokens per unit of cost."""
    return max(
        range(1, max_speculations + 1),
        key=lambda d: expected_tokens(alpha, d) / ((d + 1) * c_draft + _verify_cost(c_verify, d)),
    )


def speedup(alpha, d: int, c_draft: float, c_verify, c_full: float, bonus: bool = True) -> float:
    """Predicted tokens/s of self-speculation over plain decoding; without the bonus pass a
    round runs d draft passes and loses the token after d accepted drafts."""
    tokens = expected_tokens(alpha, d) - (0.0 if bonus else all_accepted(alpha, d))
    return tokens * c_full / ((d + bonus) * c_draft + _verify_cost(c_verify, d))


def bonus_pays(alpha, d: int, pass_cost: float, head_cost: float, verify_cost: float) -> bool:
    """Whether the bonus pass raises expected tokens per cost: with it a round emits
    `expected_tokens(α, d)` for (d + 1) passes, without it `all_accepted(α, d)` fewer for d
    passes (each round also pays d draft heads and one verify)."""
    fixed = d * head_cost + verify_cost
    with_bonus = expected_tokens(alpha, d) / ((d + 1) * pass_cost + fixed)
    without = (expected_tokens(alpha, d) - all_accepted(alpha, d)) / (d * pass_cost + fixed)
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
    prices: dict[int, float] | None = None  # d -> a round's cost in plain steps: priced, not timed
    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]
    # by draft position (forgotten as `accepted` is): rounds that judged it and that accepted it
    depth_judged: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    depth_accepted: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    c_draft: float | None = None  # seconds per draft pass
    c_full: float | None = None  # seconds per plain full-depth step (adaptive, once one ran)
    plain_steps: int = 0  # plain programs chosen since the last speculation round
    probe_every: int = PROBE_EVERY  # plain programs before the next probe round
    turned_off: bool = False  # (draft head) its rows' speculation is off: plain steps, no catch-up, from now on
    observed: float = 0.0  # drafts accepted and rounds that rejected one, in all (the acceptance's evidence)
    split: bool = False  # the round just chosen runs as a draft and a verify program, timed apart
    since_refresh: int = 0  # rounds since the last split one
    rounds_since_plain: int = 0  # rounds since the last plain step
    plain_timed: int = 0  # plain steps timed
    verify_s: dict[int, float] = dataclasses.field(default_factory=dict)  # d -> mean seconds of a verify
    timed_rounds: dict[int, int] = dataclasses.field(default_factory=dict)  # d -> rounds timed
    whole_rounds: set[int] = dataclasses.field(default_factory=set)  # the d's timed as one program
    chosen: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # d -> times chosen
    bonuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # bonus pass -> rounds
    # (counts, not lists: a server's policy lives for as long as its rows keep coming)

    def __post_init__(self):
        if self.prices is not None:  # known costs, in plain steps: nothing is timed
            self.c_full, self.c_draft = 1.0, 0.0
            self.verify_s, self.whole_rounds = dict(self.prices), set(self.prices)

    @property
    def alpha(self) -> float:
        """The acceptance of a draft, all depths pooled."""
        return self.accepted / (self.accepted + self.rejected)

    @property
    def depth_alphas(self) -> tuple[float, ...]:
        """The acceptance of draft k + 1 given the k before it, for each k a round judged, each
        shrunk toward the one before it (the first toward `alpha`) by `DEPTH_PRIOR` rounds: a
        depth never tried is priced as the one before it, and one the head guesses worse or
        better (see the module docstring) as measured."""
        out, prior = [], self.alpha
        for judged, accepted in zip(self.depth_judged, self.depth_accepted):
            prior = float((accepted + DEPTH_PRIOR * prior) / (judged + DEPTH_PRIOR))
            out.append(prior)
        return tuple(out) or (self.alpha,)

    def c_verify(self, d: int) -> float:
        """Seconds of a verify pass over d + 1 tokens: measured, where a whole round of d was
        timed, else predicted by the line (see the module docstring)."""
        if d in self.whole_rounds and d in self.verify_s:
            return self.verify_s[d]
        points = dict(self.verify_s)
        if self.spec.draft_head and self.c_full is not None:
            points.setdefault(0, self.c_full)  # a plain step: a verify of no drafts
        if len(points) == 1:
            return next(iter(points.values()))
        xs = np.array([k + 1 for k in points], float)
        ys = np.array(list(points.values()))
        slope, intercept = np.polyfit(xs, ys, 1)
        if slope < 0:  # noise: more tokens never cost less
            slope, intercept = 0.0, float(ys.mean())
        elif intercept < 0:  # a fixed cost is never negative: proportional to the tokens
            slope, intercept = float(xs @ ys / (xs @ xs)), 0.0
        return float(intercept + slope * (d + 1))

    def next_speculations(self) -> int:
        """d for the next round; 0 (adaptive only): a plain full-depth step instead. `split` then
        says whether the round runs as two programs timed apart (see the module docstring)."""
        self.split = False
        if self.turned_off:
            d = 0
        elif not self.spec.adaptive:
            d = self.spec.num_speculations
        elif self.c_draft is None:
            d, self.split = self.spec.num_speculations, True  # measure a draft pass
        elif self.c_full is None or (self.timed and self.since_refresh >= REFRESH_EVERY and not self.plain_steps):
            d = 0  # measure a plain step (again)
        elif self.timed and self.since_refresh >= REFRESH_EVERY:
            d, self.split = self.spec.num_speculations, True  # measure a draft pass again
        else:
            d = best_speculations(self.depth_alphas, self.c_draft, self.c_verify, self.spec.max_speculations)
            predicted = self.predicted_speedup(d)
            if predicted >= self.pays_above:
                self.probe_every = PROBE_EVERY
                if self.timed and predicted < RECHECK_BELOW and self.rounds_since_plain >= RECHECK_EVERY:
                    d = 0  # a plain step again: its cost, next to the rounds' recent ones
            elif self.spec.draft_head and not self.pays_at(self._turn_off_alpha):
                d, self.turned_off = 0, True
            elif self.spec.draft_head and self.observed < TURN_OFF_EVIDENCE:
                pass  # a round at the best d: the evidence to turn off (or on) comes sooner than from probes
            elif self.plain_steps < self.probe_every:
                d = 0
            else:  # a probe round; if rounds still do not pay after it, the next waits longer
                self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
        self.plain_steps = self.plain_steps + 1 if d == 0 else 0
        self.since_refresh = 0 if self.split else self.since_refresh + (d > 0)
        self.rounds_since_plain = self.rounds_since_plain + 1 if d else 0
        self.chosen[d] += 1
        return d

    @property
    def _turn_off_alpha(self) -> float:
        """The acceptance at which no round may pay for a draft head's speculation to turn off:
        the measured one plus `TURN_OFF_MARGIN` (priced: `PRICED_TURN_OFF_MARGIN`) once
        `TURN_OFF_EVIDENCE` drafts were judged; from `EARLY_EVIDENCE` on, its upper bound at two
        standard errors (a head that drafts nothing the model takes turns off after ~8 drafts, not
        24); 1 before (off only where not even every draft accepted would pay)."""
        a, n = self.alpha, self.observed
        margin = TURN_OFF_MARGIN if self.timed else PRICED_TURN_OFF_MARGIN
        if n >= TURN_OFF_EVIDENCE:
            return min(a + margin, 1.0)
        if n >= EARLY_EVIDENCE:
            return min(a + max(margin, 2.0 * (a * (1.0 - a) / n) ** 0.5), 1.0)
        return 1.0

    def pays_at(self, alpha: float) -> bool:
        """Whether some round would beat plain steps by `pays_above` at acceptance α (pooled:
        every depth's acceptance raised as much as α is above `alpha`; the times measured so far)."""
        shift = alpha - self.alpha
        alphas = [min(a + shift, 1.0) for a in self.depth_alphas]
        best = best_speculations(alphas, self.c_draft, self.c_verify, self.spec.max_speculations)
        return speedup(alphas, best, self.c_draft, self.c_verify, self.c_plain) >= self.pays_above

    def predicted_speedup(self, d: int) -> float:
        """A round of d drafts (the bonus pass as `bonus` would choose it) over a plain step (`c_plain`),
        at the measured acceptance and times (a draft pass, a verify and a plain step measured)."""
        return speedup(self.depth_alphas, d, self.c_draft, self.c_verify, self.c_plain, bonus=self._bonus_choice(d))

    def carried(self, old: SpeculationPolicy) -> SpeculationPolicy:
        """This new policy with the acceptance `old` measured (its rows' speculation turned off),
        as the evidence of at most `EARLY_EVIDENCE` judged drafts (`_as_evidence_of`): where
        even two standard errors more acceptance would not pay (a head for other text: the news
        head on code requests), rows alike turn off from their first program; a row that merely
        drafted poorly leaves the next row to measure its own."""
        new = dataclasses.replace(self, accepted=old.accepted, rejected=old.rejected, observed=old.observed)
        new.depth_judged, new.depth_accepted = old.depth_judged.copy(), old.depth_accepted.copy()
        new._as_evidence_of(EARLY_EVIDENCE)
        return new

    def new_rows(self) -> None:
        """The group's rows are all new since its last program (a batch-1 job's next row): what
        the last rows' drafts were accepted at counts as at most `EARLY_EVIDENCE` judged drafts,
        and plain steps start over (no probe backlog), so the new rows measure their own. Rows'
        acceptance differs (the chat head on Python's docs: 0.28, 0.69, 0.35 over the first
        rows); kept whole, one poor row left the rows after it on plain steps between ever rarer
        probes (55% plain steps, 0.99x full depth, against a fixed `draft:2`'s 1.34x)."""
        self._as_evidence_of(EARLY_EVIDENCE)
        self.plain_steps, self.probe_every = 0, PROBE_EVERY

    def _as_evidence_of(self, judged: float) -> None:
        """The acceptance counts (pooled, and by depth) scaled to the weight of at most `judged`
        judged drafts each, and the evidence to as many: the estimates unchanged."""
        pooled = min(1.0, judged / (self.accepted + self.rejected))
        self.accepted, self.rejected = self.accepted * pooled, self.rejected * pooled
        by_depth = min(1.0, judged / max(float(np.sum(self.depth_judged)), 1.0))
        self.depth_judged, self.depth_accepted = self.depth_judged * by_depth, self.depth_accepted * by_depth
        self.observed = min(self.observed, judged)

    @property
    def pays_above(self) -> float:
        """How much faster than a plain step a round must be predicted to be chosen: `PAYS_ABOVE`
        where rounds are timed (the margin of their timings), 1 where they are priced."""
        return PAYS_ABOVE if self.timed else 1.0

    @property
    def timed(self) -> bool:
        """Whether costs are measured as rounds and steps run (not `prices`)."""
        return self.prices is None

    @property
    def c_plain(self) -> float:
        """Seconds of the plain step a round must beat: c_full, or with a draft head c_full less
        its draft's catch-up (which a draft pass bounds), as turning speculation off drops it."""
        return self.c_full - self.c_draft if self.spec.draft_head else self.c_full

    def bonus(self, d: int) -> bool:
        """Whether the next round runs the bonus pass: `spec.bonus` when set, else whether it
        pays at the acceptance measured so far (always, without unit costs)."""
        choice = self._bonus_choice(d)
        self.bonuses[choice] += 1
        return choice

    def _bonus_choice(self, d: int) -> bool:
        if self.spec.draft_head:  # its rounds always verify d + 1 positions (no pass to choose)
            return True
        if self.spec.bonus is not None:
            return self.spec.bonus
        if self.sampled:  # a sampled row's tokens depend on where rounds start: keep them batch-independent
            return True
        return self.unit_costs is None or bonus_pays(self.depth_alphas, d, *self.unit_costs)

    def observe_plain(self, seconds: float) -> None:
        """A plain full-depth step took `seconds` (running mean, the recent 4 weigh most: plain
        steps are timed rarely while rounds run, and the machine's speed drifts meanwhile); priced
        rounds keep their prices."""
        if not self.timed:
            return
        self.plain_timed += 1
        mean = seconds if self.c_full is None else self.c_full
        self.c_full = mean + (seconds - mean) / min(self.plain_timed, 4)

    def observe(
        self,
        d: int,
        accepted: int,
        rejected: int,
        draft_s: float | None = None,
        verify_s: float | None = None,
        passes: int | None = None,
        *,
        depth_judged=(),
        depth_accepted=(),
    ) -> None:
        """One round (or the rounds since the last call): drafts accepted and rows that rejected
        one (summed over the batch), and by draft position the rounds that judged it and that
        accepted it (`SpecCounters.depth_judged`; none: the depths are priced alike), and the wall
        times of its draft (`passes` draft passes, default d + 1) and verify programs (None when
        not timed)."""
        self.accepted = FORGET * self.accepted + accepted
        self.rejected = FORGET * self.rejected + rejected
        self.observed += accepted + rejected
        if len(depth_judged):
            width = max(len(depth_judged), len(self.depth_judged))
            self.depth_judged = FORGET * _padded(self.depth_judged, width) + _padded(depth_judged, width)
            self.depth_accepted = FORGET * _padded(self.depth_accepted, width) + _padded(depth_accepted, width)
        if draft_s is not None and verify_s is not None:
            self.observe_times(d, draft_s, verify_s, passes)

    def observe_times(
        self, d: int, draft_s: float, verify_s: float, passes: int | None = None, whole: bool = False
    ) -> None:
        """The wall times of a round's draft (`passes` draft passes, default d + 1) and verify
        programs (running means, the recent 16 weigh most). `whole`: the round ran as one
        program (`observe_round`); a verify timed in split rounds stands for its d only until a
        whole round of that d is timed (the host's wait between the two programs costs time that
        a whole round does not spend). Priced rounds keep their prices."""
        if not self.timed:
            return
        per_pass = draft_s / (d + 1 if passes is None else passes)
        total = sum(self.timed_rounds.values()) + 1
        self.c_draft = per_pass if self.c_draft is None else self.c_draft + (per_pass - self.c_draft) / min(total, 16)
        if whole and d not in self.whole_rounds:
            self.whole_rounds.add(d)
            self.timed_rounds.pop(d, None)
            self.verify_s.pop(d, None)
        elif not whole and d in self.whole_rounds:
            return
        n = self.timed_rounds[d] = self.timed_rounds.get(d, 0) + 1
        mean = self.verify_s.get(d, verify_s)
        self.verify_s[d] = mean + (verify_s - mean) / min(n, 16)  # running mean, recent 16 weigh most

    def observe_round(self, d: int, seconds: float, passes: int | None = None) -> None:
        """A round run as one program took `seconds`: its verify took what its `passes` draft
        passes (default d + 1) at the measured c_draft leave (priced rounds: nothing)."""
        if not self.timed:
            return
        draft_s = (d + 1 if passes is None else passes) * self.c_draft
        self.observe_times(d, draft_s, max(seconds - draft_s, 0.0), passes, whole=True)

    def bonus_choices(self) -> tuple[bool, ...]:
        """The values `bonus` may answer (the round programs a warm-up compiles)."""
        if self.spec.draft_head or self.sampled:
            return (True,)
        if self.spec.bonus is not None:
            return (self.spec.bonus,)
        return (True,) if self.unit_costs is None else (False, True)
