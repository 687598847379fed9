"""Learn-then-Test calibration: known answers, the guarantee's bookkeeping, bad input."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import eejax
from eejax.errors import EejaxError
from eejax.train.calibrate import binomial_p_value, hoeffding_bentkus_p_value, learn_then_test

THRESHOLDS = [0.99, 0.95, 0.9, 0.8, 0.7, 0.5]


def bernoulli_losses(rates, n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.random((len(rates), n)) < np.asarray(rates)[:, None]).astype(float)


def test_p_values_match_their_formulas():
    assert binomial_p_value(0.08, 1000, 0.1) == pytest.approx(stats.binom.cdf(80, 1000, 0.1))
    n, r, d = 500, 0.05, 0.1
    kl = r * math.log(r / d) + (1 - r) * math.log((1 - r) / (1 - d))
    want = min(math.exp(-n * kl), math.e * stats.binom.cdf(math.ceil(n * r), n, d))
    assert hoeffding_bentkus_p_value(r, n, d) == pytest.approx(want)
    assert hoeffding_bentkus_p_value(0.2, n, d) == 1.0  # risk above δ: no evidence at all


def test_known_answer_with_binary_losses():
    # True risks 0, 2%, 5%, 8%, 15%, 30% with δ = 10%: with 4000 examples the 8% threshold is
    # certified (p ~ 1e-5) and the 15% one can never be.
    losses = bernoulli_losses([0.0, 0.02, 0.05, 0.08, 0.15, 0.3], 4000)
    cal = learn_then_test(THRESHOLDS, losses, delta=0.1, epsilon=0.05)
    assert cal.method == "binomial" and cal.certified
    assert cal.index == 3 and cal.threshold == 0.8
    assert all(p <= 0.05 for p in cal.p_values[:4]) and cal.p_values[4] > 0.05
    assert "λ=0.8" in cal.certificate() and "0.95" in cal.certificate()


def test_known_answer_with_graded_losses():
    # 1 - ROUGE-like losses in [0, 1]: mean 0.03 per threshold step.
    rng = np.random.default_rng(1)
    means = np.array([0.01, 0.03, 0.06, 0.12, 0.2, 0.4])
    losses = np.clip(rng.beta(2, 2, size=(6, 3000)) * 2 * means[:, None], 0, 1)
    cal = learn_then_test(THRESHOLDS, losses, delta=0.1, epsilon=0.1)
    assert cal.method == "hb" and cal.index == 2 and cal.threshold == 0.9


def test_fixed_sequence_stops_at_the_first_failure():
    # The third threshold fails; the fourth would pass on its own but is never certified.
    losses = bernoulli_losses([0.0, 0.02, 0.3, 0.0, 0.0, 0.0], 2000)
    cal = learn_then_test(THRESHOLDS, losses, delta=0.1, epsilon=0.05)
    assert cal.index == 1 and cal.threshold == 0.95
    assert cal.p_values[3] <= 0.05


def test_nothing_certified_is_said_so():
    cal = learn_then_test([0.9, 0.8], bernoulli_losses([0.5, 0.6], 100), delta=0.1, epsilon=0.05)
    assert not cal.certified and cal.threshold is None and cal.index == -1
    assert cal.certificate().startswith("no threshold certified")
    # Too few examples to certify even a perfect threshold: (1 - δ)^n > ε.
    assert not learn_then_test([0.9], np.zeros((1, 20)), delta=0.1, epsilon=0.05).certified
    assert learn_then_test([0.9], np.zeros((1, 30)), delta=0.1, epsilon=0.05).certified


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    k=st.integers(1, 6),
    n=st.integers(1, 300),
    delta=st.floats(0.01, 0.5),
    epsilon=st.floats(0.01, 0.2),
    binary=st.booleans(),
)
def test_never_certifies_a_threshold_whose_calibration_risk_exceeds_delta(data, k, n, delta, epsilon, binary):
    values = st.sampled_from([0.0, 1.0]) if binary else st.floats(0.0, 1.0)
    losses = np.array(data.draw(st.lists(st.lists(values, min_size=n, max_size=n), min_size=k, max_size=k)))
    cal = learn_then_test(np.linspace(0.99, 0.5, k), losses, delta=delta, epsilon=epsilon)
    for j in range(cal.index + 1):
        assert losses[j].mean() <= delta
        assert cal.p_values[j] <= epsilon
    if cal.index + 1 < k:
        assert cal.p_values[cal.index + 1] > epsilon


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(thresholds=[0.8, 0.9], losses=np.zeros((2, 5))), "strictly decreasing"),
        (dict(thresholds=[0.9, 0.8], losses=np.zeros((3, 5))), "one row per threshold"),
        (dict(thresholds=[0.9], losses=np.full((1, 5), 1.5)), r"\[0, 1\]"),
        (dict(thresholds=[0.9], losses=np.zeros((1, 5)), delta=1.5), "delta and epsilon"),
        (dict(thresholds=[0.9], losses=np.full((1, 5), 0.5), method="binomial"), "0/1 losses"),
        (dict(thresholds=[0.9], losses=np.zeros((1, 5)), method="exact"), "unknown method"),
        (dict(thresholds=[], losses=np.zeros((0, 5))), "non-empty"),
    ],
)
def test_bad_input_is_named(kwargs, message):
    kwargs = {"delta": 0.1, "epsilon": 0.05, **kwargs}
    with pytest.raises(EejaxError, match=message):
        learn_then_test(**kwargs)


def test_token_disagreement():
    from eejax.train.calibrate import token_disagreement

    assert token_disagreement([1, 2, 3], [1, 2, 3]) == 0.0
    assert token_disagreement([1, 9, 3], [1, 2, 3]) == pytest.approx(1 / 3)
    assert token_disagreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert token_disagreement([], []) == 0.0


def test_calibrating_a_threshold_on_a_model(tiny_checkpoints):
    """Softmax thresholds on a tiny model: λ = 1 never exits (loss 0, certified with 40 prompts);
    the chosen λ's calibration risk is within δ, and later thresholds exit more."""
    from eejax.train.calibrate import calibrate_exit_threshold
    from tests.helpers import random_prompts

    model = eejax.load(tiny_checkpoints["gqa-untied"][2])
    prompts = random_prompts(40, [5, 9, 14], seed=4)
    thresholds = [1.0, 0.5, 0.2, 0.05, 0.0]
    cal, layers = calibrate_exit_threshold(
        model,
        prompts,
        measure="softmax",
        thresholds=thresholds,
        delta=0.3,
        epsilon=0.1,
        max_new_tokens=6,
        decay=None,
        batch_size=20,
    )
    assert cal.certified and cal.risks[0] == 0.0 and layers[1.0] == 3
    assert cal.risks[cal.index] <= 0.3
    assert layers[0.0] < 3  # λ = 0 exits whenever the margin is positive
    assert list(layers) == thresholds


def test_calibrate_command(tiny_checkpoints, capsys, monkeypatch):
    import json

    from eejax.cli import main

    path = str(tiny_checkpoints["gqa-untied"][2])
    model = eejax.load(path)
    monkeypatch.setattr(eejax, "load", lambda name, **kw: model)  # the two runs share compiled programs
    argv = [
        "calibrate",
        "--model",
        path,
        "--prompt",
        *[f"Officials said {i}" for i in range(30)],
        "--measure",
        "softmax",
        "--thresholds",
        "1.0",
        "0.5",
        "0.0",
        "--delta",
        "0.3",
        "--epsilon",
        "0.1",
        "--max-new-tokens",
        "4",
        "--exit-decay",
        "off",
        "--batch-size",
        "30",
    ]
    assert main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["certified"] and doc["risks"][0] == 0.0 and doc["n"] == 30 and len(doc["p_values"]) == 3
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "chosen λ" in out and "calibration examples" in out
    assert (
        main(["calibrate", "--model", path, "--prompt", "a", "--measure", "softmax", "--thresholds", "0.5", "0.9"]) == 2
    )
    assert "strictly decreasing" in capsys.readouterr().err
