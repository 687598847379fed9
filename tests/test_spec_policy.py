"""The speculation policy and its cost model (host Python, no model): expected tokens per round,
the best d, break-even acceptance, and the adaptive policy's choices from what it measures."""

import pytest

from eejax.decode.spec_policy import (
    PROBE_EVERY,
    SpeculationPolicy,
    best_speculations,
    break_even_acceptance,
    expected_tokens,
    speedup,
)
from eejax.options import SpecConfig


def test_cost_model():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    # Cheap drafts and high acceptance: long rounds; poor acceptance: d = 1.
    assert best_speculations(0.95, 0.1, 1.0, 8) == 8
    assert best_speculations(0.05, 0.5, 1.0, 8) == 1
    # Break-even: draft pass 0.3, verify 0.8, full step 1.0.
    alpha = break_even_acceptance(0.3, 0.8, 1.0)
    best = max(speedup(alpha, d, 0.3, 0.8, 1.0) for d in range(1, 9))
    assert best == pytest.approx(1.0, abs=1e-6) and 0 < alpha < 1
    assert break_even_acceptance(2.0, 2.0, 1.0) == 1.0  # drafts dearer than the full model: never


def test_policy_follows_acceptance_and_costs():
    policy = SpeculationPolicy(SpecConfig(2, 3, adaptive=True, max_speculations=8))
    assert policy.next_speculations() == 3  # untimed: the configured start
    for _ in range(10):
        policy.observe(4, accepted=32, rejected=0, draft_s=0.5, verify_s=2.25)  # 8 rows, all accepted
    assert policy.alpha > 0.95 and policy.c_draft == pytest.approx(0.1) and policy.c_verify(7) == 2.25
    assert policy.next_speculations() == 8
    # Verify time that grows with the tokens (a CPU), 1 + 0.25 (d + 1): two tried d's give the line.
    policy.observe(8, accepted=64, rejected=0, draft_s=0.9, verify_s=3.25)
    assert policy.c_verify(8) == pytest.approx(3.25) and policy.c_verify(2) == pytest.approx(1.75)
    policy.observe(6, accepted=48, rejected=0, draft_s=0.7, verify_s=0.5)  # a line below 0 at d = 0
    assert policy.c_verify(0) >= 0 and policy.c_verify(8) > policy.c_verify(2)
    for _ in range(30):
        policy.observe(8, accepted=0, rejected=8, draft_s=0.9, verify_s=1.0)
    assert policy.alpha < 0.05 and best_speculations(policy.alpha, policy.c_draft, policy.c_verify, 8) == 1
    assert policy.next_speculations() == 0  # and even d = 1 does not pay: a plain step


def test_adaptive_policy_falls_back_to_plain_steps_while_no_round_pays():
    policy = SpeculationPolicy(SpecConfig(2, 2, adaptive=True, max_speculations=4), unit_costs=(1.0, 0.1, 1.0))
    for _ in range(10):  # nothing accepted; a draft pass 0.5 s and a verify 0.5 s: a round cannot pay
        policy.observe(2, accepted=0, rejected=8, draft_s=1.0, verify_s=0.5, passes=2)
    assert policy.predicted_speedup(1) < 1
    chosen = [policy.next_speculations() for _ in range(2 * PROBE_EVERY + 2)]
    assert chosen == ([0] * PROBE_EVERY + [1]) * 2  # a probe round every PROBE_EVERY plain steps
    policy.observe_plain(2.0)  # plain steps dearer than thought: rounds pay again
    for _ in range(10):
        policy.observe(1, accepted=8, rejected=0, draft_s=1.0, verify_s=0.5, passes=2)
    assert policy.predicted_speedup(4) > 1 and policy.next_speculations() >= 1
    fixed = SpeculationPolicy(SpecConfig(2, 2), unit_costs=(1.0, 0.1, 1.0))
    fixed.observe(2, accepted=0, rejected=8)
    assert [fixed.next_speculations() for _ in range(3)] == [2, 2, 2]  # a fixed d never falls back
