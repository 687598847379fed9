"""Calibrated exit thresholds with a guarantee: Learn then Test (Angelopoulos et al.), as CALM
uses it.

For candidate thresholds λ_1 > λ_2 > ... > λ_K (most conservative first) and n calibration
examples, `losses[j, i]` in [0, 1] is how inconsistent example i's early-exit output at λ_j is
with the full model's (1 - token agreement, 1 - ROUGE-L to full, or a 0/1 "any token differs").
Each λ_j gets a p-value for the null hypothesis "its risk E[loss] exceeds δ"; fixed-sequence
testing walks λ_1, λ_2, ... and certifies while p_j <= ε, stopping at the first failure. The
smallest certified λ is returned: with probability >= 1 - ε over the calibration set, its risk
is <= δ (for examples drawn like the calibration set).

p-values: exact binomial tail for 0/1 losses, P(Bin(n, δ) <= n R̂); Hoeffding-Bentkus for
losses in [0, 1], min(exp(-n h(min(R̂, δ), δ)), e P(Bin(n, δ) <= ceil(n R̂))) with
h(a, b) = a log(a/b) + (1-a) log((1-a)/(1-b)).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import stats

from eejax.errors import EejaxError


def binomial_p_value(risk: float, n: int, delta: float) -> float:
    """p-value of "risk > δ" for n 0/1 losses with empirical risk `risk`."""
    return float(stats.binom.cdf(round(risk * n), n, delta))


def _kl_bernoulli(a: float, b: float) -> float:
    def term(x, y):
        return 0.0 if x == 0 else x * math.log(x / y)

    return term(a, b) + term(1 - a, 1 - b)


def hoeffding_bentkus_p_value(risk: float, n: int, delta: float) -> float:
    """p-value of "risk > δ" for n losses in [0, 1] with empirical risk `risk`."""
    hoeffding = math.exp(-n * _kl_bernoulli(min(risk, delta), delta))
    bentkus = math.e * stats.binom.cdf(math.ceil(n * risk - 1e-9), n, delta)
    return float(min(hoeffding, bentkus, 1.0))


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The outcome of `learn_then_test`.

    threshold:  the smallest certified λ, or None when even the most conservative failed
    index:      its position in `thresholds` (-1 if none)
    thresholds, risks, p_values: per candidate, in the order tested
    delta, epsilon, n, method: the test's settings
    """

    threshold: float | None
    index: int
    thresholds: tuple[float, ...]
    risks: tuple[float, ...]
    p_values: tuple[float, ...]
    delta: float
    epsilon: float
    n: int
    method: str

    @property
    def certified(self) -> bool:
        return self.threshold is not None

    def certificate(self) -> str:
        """One paragraph saying what was certified."""
        if not self.certified:
            return (
                f"no threshold certified: the most conservative (λ={self.thresholds[0]:g}) has empirical risk "
                f"{self.risks[0]:.4f} and p-value {self.p_values[0]:.3g} > ε={self.epsilon:g} "
                f"(n={self.n}, δ={self.delta:g}, {self.method})"
            )
        j = self.index
        return (
            f"λ={self.threshold:g}: with probability >= {1 - self.epsilon:g} over the {self.n} calibration "
            f"examples, its risk is <= δ={self.delta:g} (empirical {self.risks[j]:.4f}, p-value "
            f"{self.p_values[j]:.3g}; {j + 1} of {len(self.thresholds)} thresholds certified in sequence, "
            f"{self.method} p-values)"
        )


def learn_then_test(thresholds, losses, *, delta: float, epsilon: float, method: str = "auto") -> Calibration:
    """Fixed-sequence Learn then Test over `thresholds` [K] (most conservative first, strictly
    decreasing) with `losses` [K, n] in [0, 1]. method: "binomial" (0/1 losses), "hb"
    (Hoeffding-Bentkus, any losses in [0, 1]) or "auto" (binomial when every loss is 0 or 1)."""
    thresholds = np.asarray(thresholds, np.float64)
    losses = np.asarray(losses, np.float64)
    if not (0 < delta < 1 and 0 < epsilon < 1):
        raise EejaxError(f"delta and epsilon must lie in (0, 1), got delta={delta}, epsilon={epsilon}")
    if thresholds.ndim != 1 or thresholds.size == 0:
        raise EejaxError("thresholds must be a non-empty list of numbers")
    if np.any(np.diff(thresholds) >= 0):
        raise EejaxError("thresholds must be strictly decreasing (the most conservative first)")
    if losses.ndim != 2 or losses.shape[0] != thresholds.size or losses.shape[1] == 0:
        raise EejaxError(f"losses must be [{thresholds.size}, n >= 1] (one row per threshold), got {losses.shape}")
    if np.any(~np.isfinite(losses)) or np.any(losses < 0) or np.any(losses > 1):
        raise EejaxError("losses must lie in [0, 1]")
    binary = bool(np.all((losses == 0) | (losses == 1)))
    if method == "auto":
        method = "binomial" if binary else "hb"
    if method == "binomial" and not binary:
        raise EejaxError("the binomial p-value needs 0/1 losses; use method='hb' for losses in [0, 1]")
    if method not in ("binomial", "hb"):
        raise EejaxError(f"unknown method {method!r}; choose auto, binomial or hb")
    n = losses.shape[1]
    risks = losses.mean(axis=1)
    p_value = binomial_p_value if method == "binomial" else hoeffding_bentkus_p_value
    p_values = [p_value(float(r), n, delta) for r in risks]
    index = -1
    for j, p in enumerate(p_values):  # fixed-sequence testing: stop at the first failure
        if p > epsilon:
            break
        index = j
    return Calibration(
        threshold=float(thresholds[index]) if index >= 0 else None,
        index=index,
        thresholds=tuple(map(float, thresholds)),
        risks=tuple(map(float, risks)),
        p_values=tuple(p_values),
        delta=delta,
        epsilon=epsilon,
        n=n,
        method=method,
    )


def token_disagreement(early: list[int], full: list[int]) -> float:
    """1 - the share of the full-depth tokens that early exit reproduced at the same position
    (a missing or extra token counts as a disagreement), in [0, 1]."""
    n = max(len(early), len(full))
    if n == 0:
        return 0.0
    same = sum(a == b for a, b in zip(early, full))
    return 1.0 - same / n


def calibrate_exit_threshold(
    model,
    prompts,
    *,
    measure: str,
    thresholds,
    delta: float,
    epsilon: float,
    max_new_tokens: int = 64,
    consistency: str = "tokens",
    batch_size: int = 1,
    progress: bool = False,
    **exit_options,
):
    """Learn then Test for an early-exit threshold on `prompts` (the calibration set).

    Generates full depth once and with `ExitConfig(measure, threshold=λ, **exit_options)` for
    every λ in `thresholds` (most conservative first), `batch_size` rows at a time (a batch exits
    only when all its rows are confident, so calibrate at the batch size you decode with); the
    loss of a prompt is its token disagreement with full depth ("tokens") or 1 - ROUGE-L to the
    full-depth text ("rouge", needs rouge-score; identical outputs, empty ones included, lose 0).
    Returns (Calibration, {λ: mean layers per token}).
    """
    from eejax.engine import generate
    from eejax.options import ExitConfig

    if consistency not in ("tokens", "rouge"):
        raise EejaxError(f"unknown consistency {consistency!r}; choose tokens or rouge")
    configs = [ExitConfig(measure, threshold=float(t), **exit_options) for t in thresholds]
    from tqdm.auto import tqdm

    full = generate(model, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, spec=None)
    scorer = None
    if consistency == "rouge":
        try:
            from rouge_score import rouge_scorer
        except ImportError:
            raise EejaxError("consistency 'rouge' needs rouge-score: pip install 'eejax[bench]'") from None
        scorer = rouge_scorer.RougeScorer(["rougeL"])
    losses, layers = [], {}
    for config, threshold in tqdm(list(zip(configs, thresholds)), desc="calibrating thresholds", disable=not progress):
        res = generate(model, prompts, max_new_tokens=max_new_tokens, exit=config, batch_size=batch_size)
        layers[float(threshold)] = res.stats["mean_layers_per_token"]
        if scorer is None:
            losses.append([token_disagreement(e, f) for e, f in zip(res.tokens, full.tokens)])
        else:
            losses.append(
                [
                    0.0 if et == ft else 1.0 - scorer.score(f, e)["rougeL"].fmeasure
                    for e, f, et, ft in zip(res.texts, full.texts, res.tokens, full.tokens)
                ]
            )
    return learn_then_test(thresholds, np.asarray(losses), delta=delta, epsilon=epsilon), layers
