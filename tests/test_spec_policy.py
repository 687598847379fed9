"""The speculation policy and its cost model (host Python, no model): expected tokens per round,
the best d, break-even acceptance, and the adaptive policy's choices from what it measures."""

import pytest

from eejax.decode.spec_policy import (
    PAYS_ABOVE,
    PRICED_TURN_OFF_MARGIN,
    PROBE_EVERY,
    RECHECK_BELOW,
    RECHECK_EVERY,
    REFRESH_EVERY,
    TURN_OFF_EVIDENCE,
    TURN_OFF_MARGIN,
    SpeculationPolicy,
    best_speculations,
    break_even_acceptance,
    expected_tokens,
    speedup,
)
from eejax.options import DraftChainSpec, LayerSkipSpec


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
    policy = SpeculationPolicy(LayerSkipSpec(2, 3, adaptive=True, max_speculations=8))
    assert policy.next_speculations() == 3 and policy.split  # the configured start, its draft pass timed apart
    for _ in range(10):
        policy.observe(4, accepted=32, rejected=0, draft_s=0.5, verify_s=2.25)  # 8 rows, all accepted
    assert policy.alpha > 0.95 and policy.c_draft == pytest.approx(0.1) and policy.c_verify(7) == 2.25
    assert policy.next_speculations() == 0  # then a plain step, to time one
    policy.observe_plain(1.0)
    assert policy.next_speculations() == 8
    # Verify time that grows with the tokens (a CPU), 1 + 0.25 (d + 1): two tried d's give the line.
    policy.observe(8, accepted=64, rejected=0, draft_s=0.9, verify_s=3.25)
    assert policy.c_verify(8) == pytest.approx(3.25) and policy.c_verify(2) == pytest.approx(1.75)
    policy.observe(6, accepted=48, rejected=0, draft_s=0.7, verify_s=0.5)  # a line below 0 at d = 0
    assert policy.c_verify(0) >= 0 and policy.c_verify(8) > policy.c_verify(2)
    for _ in range(120):  # the acceptance estimate forgets the past (FORGET per read)
        policy.observe(8, accepted=0, rejected=8, draft_s=0.9, verify_s=1.0)
    assert policy.alpha < 0.05 and best_speculations(policy.alpha, policy.c_draft, policy.c_verify, 8) == 1
    assert policy.next_speculations() == 0  # and even d = 1 does not pay: a plain step


def test_a_draft_heads_plain_step_is_the_verify_lines_d0_point():
    """Verifying d + 1 positions of 8 rows costs ~(d + 1) plain steps (a compute-bound CPU): from one
    round at d = 4 and one plain step the line says so, and no d pays (flat, d = 8 looked best)."""
    policy = SpeculationPolicy(DraftChainSpec(4, adaptive=True, max_speculations=8))
    assert policy.next_speculations() == 4 and policy.split
    policy.observe(4, accepted=20, rejected=4, draft_s=0.25, verify_s=5.0)
    assert policy.c_verify(8) == 5.0  # one point: flat
    assert policy.next_speculations() == 0
    policy.observe_plain(1.0)
    assert policy.c_verify(0) == pytest.approx(1.0) and policy.c_verify(8) == pytest.approx(9.0)
    assert policy.c_plain == pytest.approx(
        1.0 - 0.05
    )  # to beat: a plain step less the catch-up (a draft pass bounds it)
    assert max(policy.predicted_speedup(d) for d in range(1, 9)) < 1 and policy.next_speculations() == 0
    # a round predicted to beat plain steps by less than its timings' error runs plain steps
    even = SpeculationPolicy(DraftChainSpec(1, adaptive=True, max_speculations=1))
    even.observe(1, accepted=30, rejected=30, draft_s=0.0, verify_s=1.5 / 1.03)  # 1.5 tokens, 1.03x
    even.observe_plain(1.0)
    assert even.predicted_speedup(1) == pytest.approx(1.03, rel=0.01) and 1.03 < PAYS_ABOVE
    assert even.next_speculations() == 0
    layerskip = SpeculationPolicy(LayerSkipSpec(2, 4, adaptive=True))  # its verify runs L - E layers only
    layerskip.observe(4, accepted=20, rejected=4, draft_s=0.25, verify_s=5.0)
    layerskip.observe_plain(1.0)
    assert layerskip.c_verify(0) == 5.0 and layerskip.c_plain == 1.0


def test_a_draft_heads_speculation_is_turned_off_where_no_round_would_pay_at_more_acceptance():
    """Plain steps keep a draft head's K/V up to date at a cost; where no round would pay even at
    TURN_OFF_MARGIN more acceptance than measured, the policy turns speculation off for good."""

    def measured(alpha, verify, n=1000):  # one split round at d = 2 (8 rows), then a plain step of 1 s
        policy = SpeculationPolicy(DraftChainSpec(2, adaptive=True, max_speculations=4))
        assert policy.next_speculations() == 2 and policy.split
        # n = 1000: a long-measured acceptance (no prior to speak of)
        policy.observe(2, accepted=alpha * n, rejected=(1 - alpha) * n, draft_s=0.0, verify_s=verify)
        assert policy.next_speculations() == 0
        policy.observe_plain(1.0)
        return policy

    # verifying 3 positions takes 1.8 steps, so 2 take 1.4 (the line): d = 1 pays 1.05x at α = 0.47
    off = measured(0.35, 1.8)
    assert not off.pays_at(off.alpha + TURN_OFF_MARGIN) and off.next_speculations() == 0 and off.turned_off
    assert [off.next_speculations() for _ in range(2 * PROBE_EVERY)] == [0] * 2 * PROBE_EVERY  # no probes
    # The same acceptance from a few judged drafts (a few rounds at batch 1) is not enough to stop
    # for good: rounds at the best d (no waits between probes) until TURN_OFF_EVIDENCE, then off.
    early = measured(0.3, 1.8, n=10)
    assert early.observed < TURN_OFF_EVIDENCE and early.next_speculations() == 1 and not early.turned_off
    early.observe(1, accepted=3, rejected=TURN_OFF_EVIDENCE - 13)
    assert early.next_speculations() == 0 and early.turned_off
    near = measured(0.44, 1.8)  # pays at 0.49: plain steps that keep the draft, and probe rounds
    assert near.predicted_speedup(2) < PAYS_ABOVE and near.pays_at(near.alpha + TURN_OFF_MARGIN)
    assert any(near.next_speculations() for _ in range(PROBE_EVERY)) and not near.turned_off
    layers = SpeculationPolicy(
        LayerSkipSpec(2, 2, adaptive=True, max_speculations=4)
    )  # their plain steps cost nothing extra
    layers.observe(2, accepted=0, rejected=1000, draft_s=0.3, verify_s=1.8)
    layers.observe_plain(1.0)
    assert any(layers.next_speculations() for _ in range(PROBE_EVERY + 1)) and not layers.turned_off


def test_a_timed_rounds_own_cost_wins_over_the_line():
    """A round costs more than its positions on the line through a plain step (its drafts, its
    acceptance): once a whole round of d was timed, d is costed at its own time."""
    policy = SpeculationPolicy(DraftChainSpec(4, adaptive=True, max_speculations=4))
    policy.observe(4, accepted=8, rejected=8, draft_s=0.0, verify_s=2.0)  # split: the line's point at d = 4
    policy.observe_plain(1.0)
    assert policy.c_verify(1) == pytest.approx(1.25)  # the line through (1, 1.0) and (5, 2.0)
    policy.observe_round(1, 1.6)
    assert policy.c_verify(1) == pytest.approx(1.6)  # the line through the three points: 1.38


def test_adaptive_policy_falls_back_to_plain_steps_while_no_round_pays():
    policy = SpeculationPolicy(LayerSkipSpec(2, 2, adaptive=True, max_speculations=4), unit_costs=(1.0, 0.1, 1.0))
    for _ in range(10):  # nothing accepted; a draft pass 0.5 s and a verify 0.5 s: a round cannot pay
        policy.observe(2, accepted=0, rejected=8, draft_s=1.0, verify_s=0.5, passes=2)
    policy.observe_plain(0.9)
    assert policy.predicted_speedup(1) < 1
    chosen = [policy.next_speculations() for _ in range(3 * PROBE_EVERY + 2)]
    # probe rounds, each after twice as many plain steps as the one before
    assert chosen == [0] * PROBE_EVERY + [1] + [0] * 2 * PROBE_EVERY + [1]
    # what was chosen is counted, not listed (a server's policy lives as long as its rows come)
    assert policy.chosen == {0: 3 * PROBE_EVERY, 1: 2} and len(policy.chosen) <= 5
    policy.observe_plain(2.0)  # plain steps dearer than thought: rounds pay again
    for _ in range(10):
        policy.observe(1, accepted=8, rejected=0, draft_s=1.0, verify_s=0.5, passes=2)
    assert policy.predicted_speedup(4) > 1 and policy.next_speculations() >= 1
    fixed = SpeculationPolicy(LayerSkipSpec(2, 2), unit_costs=(1.0, 0.1, 1.0))
    fixed.observe(2, accepted=0, rejected=8)
    assert [fixed.next_speculations() for _ in range(3)] == [2, 2, 2]  # a fixed d never falls back


def test_rounds_run_whole_and_every_cost_is_measured_again():
    """A draft pass timed in a split round, then a plain step, then whole rounds whose verify time
    is what their draft passes leave; every REFRESH_EVERY rounds a plain step and a split round."""
    policy = SpeculationPolicy(LayerSkipSpec(2, 2, adaptive=True, max_speculations=4))
    chosen = []
    for _ in range(2 + 2 * (REFRESH_EVERY + 2)):
        d = policy.next_speculations()
        chosen.append(("split" if policy.split else "round") if d else "plain")
        if d == 0:
            policy.observe_plain(1.0)
        elif policy.split:
            policy.observe(d, accepted=8, rejected=0, draft_s=0.1 * (d + 1), verify_s=1.0)
        else:
            assert d == 4  # everything accepted, drafts cheap: the longest round
            policy.observe(d, accepted=16, rejected=0)
            policy.observe_round(d, 0.1 * (d + 1) + 1.0)  # its verify: 1.0, as in the split rounds
    cycle = ["round"] * REFRESH_EVERY + ["plain", "split"]
    assert chosen == ["split", "plain"] + cycle * 2
    assert policy.c_draft == pytest.approx(0.1) and policy.verify_s[4] == pytest.approx(1.0)
    assert policy.bonus_choices() == (True,)
    assert SpeculationPolicy(LayerSkipSpec(2, 2), unit_costs=(1.0, 0.1, 1.0)).bonus_choices() == (False, True)
    assert SpeculationPolicy(DraftChainSpec(2), unit_costs=(1.0, 0.1, 1.0)).bonus_choices() == (True,)


def test_a_whole_rounds_verify_time_replaces_a_split_rounds():
    policy = SpeculationPolicy(LayerSkipSpec(2, 2, adaptive=True, max_speculations=4))
    policy.observe(2, accepted=8, rejected=0, draft_s=0.3, verify_s=5.0)  # split: the host waited between
    policy.observe_round(2, 0.3 + 1.0)
    assert policy.verify_s == {2: pytest.approx(1.0)}  # not a mean with the split round's 5.0
    policy.observe(2, accepted=8, rejected=0, draft_s=0.3, verify_s=5.0)  # a refresh: c_draft only
    assert policy.verify_s == {2: pytest.approx(1.0)} and policy.c_draft == pytest.approx(0.1)


def test_a_programs_first_run_is_not_timed():
    """The engine times a program from its second run on: the first pays one-time costs."""
    import jax
    import jax.numpy as jnp

    from eejax.engine.speculation import run_timed

    program = jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile()
    args = (jnp.ones(3),)
    out, seconds = run_timed(program, args, True)
    assert seconds is None and float(out[0]) == 2.0
    assert run_timed(program, args, True)[1] > 0 and run_timed(program, args, False)[1] is None


def test_marginal_rounds_time_a_plain_step_again():
    """A plain step's cost is timed only when one runs, a round's every round: rounds predicted to
    pay less than RECHECK_BELOW give way to a plain step every RECHECK_EVERY rounds, whose new
    time (the machine sped up) then shows they do not pay; rounds that pay well never do."""

    def running(plain_s):
        policy = SpeculationPolicy(DraftChainSpec(2, adaptive=True, max_speculations=2))
        assert policy.next_speculations() == 2 and policy.split
        policy.observe(2, accepted=600, rejected=400, draft_s=0.0, verify_s=2.0)  # α 0.6, τ(d=2) 1.96
        assert policy.next_speculations() == 0
        policy.observe_plain(plain_s)
        policy.observe_round(2, 2.0)
        return policy

    marginal = running(1.15)  # 1.96 * 1.15 / 2.0: 1.13x
    best = best_speculations(marginal.alpha, marginal.c_draft, marginal.c_verify, 2)
    assert RECHECK_BELOW > marginal.predicted_speedup(best) >= PAYS_ABOVE
    chosen = [marginal.next_speculations() for _ in range(RECHECK_EVERY + 1)]
    assert chosen == [best] * RECHECK_EVERY + [0]
    marginal.observe_plain(0.7)  # the machine is faster now: the recent plain times weigh most
    assert marginal.c_full < 0.95 and marginal.next_speculations() == 0
    paying = running(1.5)
    assert all(paying.next_speculations() > 0 for _ in range(3 * RECHECK_EVERY))


def test_priced_rounds_are_chosen_from_the_acceptance_alone():
    """Rounds priced in plain steps (a CPU's quantized blocks): rounds from the first program on, no
    split round, no plain step to time; what the engine times changes nothing; d follows the
    acceptance, and a head whose drafts are never accepted is turned off once the evidence is in."""
    prices = {1: 1.23, 2: 1.39}
    policy = SpeculationPolicy(DraftChainSpec(2, adaptive=True, max_speculations=2), prices=prices)
    assert not policy.timed and policy.c_verify(2) == 1.39 and policy.c_plain == 1.0
    policy.observe(2, accepted=60, rejected=40)  # α ~0.6
    chosen = [policy.next_speculations() for _ in range(2 * REFRESH_EVERY + 2)]
    assert chosen == [2] * len(chosen) and not policy.split
    assert policy.predicted_speedup(2) == pytest.approx(expected_tokens(policy.alpha, 2) / 1.39)
    policy.observe_round(2, 100.0)  # a slow moment of the machine: not a cost
    policy.observe_plain(0.001)
    policy.observe_times(2, 50.0, 50.0)
    assert policy.c_full == 1.0 and policy.c_draft == 0.0 and policy.verify_s == prices
    assert policy.next_speculations() == 2
    for _ in range(60):  # the text changes: one draft in three accepted, d = 1 pays most
        policy.observe(2, accepted=1, rejected=2)
    assert 0.3 < policy.alpha < 0.36 and policy.next_speculations() == 1
    for _ in range(60):  # one in four: d = 1 beats its price (no margin: nothing was timed)
        policy.observe(1, accepted=1, rejected=3)
    assert policy.pays_above == 1.0 and policy.next_speculations() == 1
    for _ in range(60):  # 22 in 100: no round pays, plain steps and probes (0.02 more would pay)
        policy.observe(1, accepted=22, rejected=78)
    assert policy.next_speculations() == 0 and not policy.turned_off
    assert not policy.pays_at(policy.alpha) and policy.pays_at(policy.alpha + PRICED_TURN_OFF_MARGIN)
    for _ in range(60):  # one in five: not even 0.02 more would pay (a timed policy's 0.05 would): off for good
        policy.observe(1, accepted=1, rejected=4)
    assert policy.pays_at(policy.alpha + TURN_OFF_MARGIN)
    assert policy.next_speculations() == 0 and policy.turned_off


def test_round_prices_are_for_a_draft_heads_adaptive_chain_on_a_cpu_one_row_at_a_time():
    from eejax.decode.spec_policy import (
        CPU_BLOCK_ROUND_STEPS,
        CPU_FLOAT_DRAFT_ROUND_STEPS,
        CPU_FLOAT_ROUND_STEPS,
        on_cpu,
        round_prices,
    )
    from eejax.options import DraftLookupSpec, auto_spec

    assert on_cpu()
    auto = auto_spec(on_cpu=True)
    assert auto.spec == "draft:2:adaptive:lookup" and auto.max_speculations == auto.lookup == 2
    # a d = 1 round copies 2 drafts only after a 4-token match: d's price; float weights have their own
    assert round_prices(auto, quantized=True) == {1: CPU_BLOCK_ROUND_STEPS[1], 2: CPU_BLOCK_ROUND_STEPS[2]}
    assert round_prices(auto, quantized=False) == {1: CPU_FLOAT_ROUND_STEPS[1], 2: CPU_FLOAT_ROUND_STEPS[2]}
    float_head = round_prices(auto, quantized=False, float_draft=True)  # a float head: dearer drafts
    assert float_head == {d: CPU_FLOAT_DRAFT_ROUND_STEPS[d] for d in (1, 2)}
    assert float_head[2] > CPU_FLOAT_ROUND_STEPS[2]
    deep = auto_spec(on_cpu=True, cheap_drafts=True)  # copies past d only after 4-token matches: d's price
    assert round_prices(deep, quantized=False) == {d: CPU_FLOAT_ROUND_STEPS[d] for d in (1, 2, 3)}
    assert CPU_FLOAT_ROUND_STEPS != CPU_BLOCK_ROUND_STEPS and set(CPU_FLOAT_ROUND_STEPS) == set(CPU_BLOCK_ROUND_STEPS)
    chain = DraftChainSpec(2, adaptive=True, max_speculations=3)
    assert round_prices(chain, quantized=True) == {d: CPU_BLOCK_ROUND_STEPS[d] for d in (1, 2, 3)}
    four = DraftLookupSpec(2, adaptive=True, max_speculations=4, lookup=4)
    assert round_prices(four, quantized=True) == {d: CPU_BLOCK_ROUND_STEPS[d] for d in (1, 2, 3, 4)}
    long_copies = DraftLookupSpec(2, adaptive=True, max_speculations=2, lookup=6)
    assert round_prices(long_copies, quantized=True) == {d: CPU_BLOCK_ROUND_STEPS[d] for d in (1, 2)}
    for rows in (1, 8):  # the prices are one row's: more rows at once are timed
        assert (round_prices(auto, quantized=True, rows=rows) is None) == (rows > 1)
    assert round_prices(DraftChainSpec(2), quantized=True) is None  # fixed d: nothing to choose
    assert round_prices(DraftChainSpec(2, adaptive=True, max_speculations=8), quantized=True) is None  # d 5-8 unpriced
    assert round_prices(LayerSkipSpec(2, 2, adaptive=True, max_speculations=2), quantized=True) is None


def test_a_carried_policy_starts_from_what_its_predecessor_measured():
    """A batch job's later rows (`Speculation._policy`): where the last policy turned off, its
    successor takes its acceptance as the evidence of EARLY_EVIDENCE judged drafts: it turns off
    from its first program where the head drafts nothing, and measures its own rows where the
    last ones merely drafted poorly."""
    from eejax.decode.spec_policy import EARLY_EVIDENCE

    prices = {1: 1.21, 2: 1.35}
    old = SpeculationPolicy(DraftChainSpec(2, adaptive=True, max_speculations=2), prices=prices)
    for _ in range(40):
        old.observe(1, accepted=0, rejected=2)
    assert old.next_speculations() == 0 and old.turned_off
    fresh = SpeculationPolicy(old.spec, prices=prices)
    assert fresh.next_speculations() == 2 and not fresh.turned_off  # α 0.5 before anything is measured
    new = SpeculationPolicy(old.spec, prices=prices).carried(old)
    assert new.alpha == pytest.approx(old.alpha) and new.observed == EARLY_EVIDENCE and new.verify_s == prices
    assert new.next_speculations() == 0 and new.turned_off
    poor = SpeculationPolicy(old.spec, prices=prices)
    for _ in range(60):  # one draft in seven accepted: no round pays, and 60 rounds say so
        poor.observe(1, accepted=1, rejected=6)
    assert poor.next_speculations() == 0 and poor.turned_off
    after = SpeculationPolicy(old.spec, prices=prices).carried(poor)
    assert after.alpha == pytest.approx(poor.alpha) and after.next_speculations() >= 1 and not after.turned_off


def test_a_head_that_drafts_nothing_is_turned_off_before_the_full_evidence():
    """From EARLY_EVIDENCE judged drafts a draft head's speculation turns off where even two
    standard errors more acceptance would not pay; the same evidence at α ~0.5 keeps rounds."""
    from eejax.decode.spec_policy import EARLY_EVIDENCE

    spec = DraftChainSpec(2, adaptive=True, max_speculations=2)
    poor, fair = SpeculationPolicy(spec, prices={1: 1.21, 2: 1.35}), SpeculationPolicy(spec, prices={1: 1.21, 2: 1.35})
    judged = 0
    while not poor.turned_off:
        assert poor.next_speculations() >= 1 or poor.turned_off
        poor.observe(1, accepted=0, rejected=1)
        fair.observe(1, accepted=1, rejected=1)
        judged += 1
    assert EARLY_EVIDENCE <= judged < TURN_OFF_EVIDENCE and poor.next_speculations() == 0
    assert fair.next_speculations() >= 1 and not fair.turned_off


def test_depths_are_priced_at_their_own_acceptance():
    """A head's later drafts guessed worse than its first: with each depth's acceptance counted
    (`SpecCounters.depth_judged`) the policy prices a round by them, where the pooled acceptance
    of the same drafts would overrate a deep round; a depth never judged is priced as the one
    before it, and with no depth counts at all every depth is the pooled α (as before)."""
    spec, prices = DraftChainSpec(3, adaptive=True, max_speculations=3), {1: 1.21, 2: 1.35, 3: 1.47}
    # 100 rounds of 3 drafts: the first two accepted at 0.7, the third at ~0.3.
    judged, accepted = [100, 70, 49], [70, 49, 15]
    rejected = sum(j - a for j, a in zip(judged, accepted))
    pooled, by_depth = SpeculationPolicy(spec, prices=prices), SpeculationPolicy(spec, prices=prices)
    pooled.observe(3, sum(accepted), rejected)
    by_depth.observe(3, sum(accepted), rejected, depth_judged=judged, depth_accepted=accepted)
    assert pooled.alpha == by_depth.alpha and pooled.depth_alphas == (pooled.alpha,)
    assert [round(a, 2) for a in by_depth.depth_alphas] == [0.7, 0.7, 0.32]
    assert pooled.next_speculations() == 3 and by_depth.next_speculations() == 2
    assert by_depth.predicted_speedup(2) == pytest.approx(expected_tokens(by_depth.depth_alphas, 2) / 1.35)
    assert expected_tokens([0.5, 0.2], 4) == pytest.approx(1 + 0.5 + 0.1 + 0.02 + 0.004)  # the last stands for deeper
    shallow = SpeculationPolicy(spec, prices=prices)  # only d = 1 measured: deeper ones priced as the first
    shallow.observe(1, 70, 30, depth_judged=[100], depth_accepted=[70])
    assert len(shallow.depth_alphas) == 1 and shallow.next_speculations() == 3
    carried = shallow.carried(by_depth).depth_alphas  # its depths, as a few rounds' evidence
    assert len(carried) == 3 and carried[2] < min(carried[:2])


def test_new_rows_measure_their_own_acceptance():
    """A batch-1 job's next row (`Speculation.dispatch`: a group's rows all new): the acceptance the
    last rows measured counts as EARLY_EVIDENCE judged drafts, and rounds run at once instead of the
    plain steps and rare probes that a poor row left behind."""
    from eejax.decode.spec_policy import EARLY_EVIDENCE

    spec, prices = DraftChainSpec(2, adaptive=True, max_speculations=3), {1: 1.42, 2: 1.47, 3: 1.70}
    policy = SpeculationPolicy(spec, prices=prices)
    for _ in range(30):  # a row whose drafts are accepted at ~0.35: rounds just below paying
        policy.observe(2, accepted=35, rejected=65, depth_judged=[80, 20], depth_accepted=[28, 6])
    assert [policy.next_speculations() for _ in range(4)] == [0] * 4 and not policy.turned_off
    alpha = policy.alpha
    policy.new_rows()
    assert policy.alpha == pytest.approx(alpha) and policy.observed == EARLY_EVIDENCE
    assert policy.accepted + policy.rejected == pytest.approx(EARLY_EVIDENCE)
    assert policy.next_speculations() == 2  # the new row's own rounds
    for _ in range(3):  # ... which draft well: rounds go on
        policy.observe(2, accepted=6, rejected=2, depth_judged=[4, 4], depth_accepted=[4, 2])
    assert policy.alpha > 0.5 and policy.next_speculations() >= 2
