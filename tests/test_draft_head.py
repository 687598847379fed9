"""Speculation with a trained draft head (EAGLE, `spec="draft:d"`): lossless greedy at batch 1 and
in padded batches, perfect drafts all accepted and counted, the draft's K/V after rounds and
after a chunked prefill equal to a prefill's of the same tokens, adaptive rounds and plain steps,
exact sampling, the engine with chunks and prefix caching, training, checkpoints, bad settings."""

import dataclasses
import hashlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eejax
from eejax.decode import feature_draft, speculative, steps
from eejax.decode.drafts import token_batch
from eejax.decode.lookup import PromptTokens
from eejax.decode.sampling import RowSampling, SamplingParams
from eejax.decode.stats import SPEC_COUNTERS
from eejax.engine.engine import Engine
from eejax.errors import EejaxError, UnsupportedModelError
from eejax.kernels import cpu_matmul
from eejax.loading.model import cast_floats
from eejax.models import draft_head, llama
from eejax.models.exits import set_exit_vocab
from eejax.models.modules import embed
from eejax.options import (
    DraftChainSpec,
    DraftLookupSpec,
    DraftStopSpec,
    DraftTreeSpec,
    SpecConfig,
    StepOptions,
    auto_spec,
    resolve_spec,
)
from eejax.quantized import formats, is_quantized, quantize_q8_0
from tests.helpers import fixed_policy_costs, prefilled
from tests.test_speculative import NEW, PROMPTS, chi_square_p, perfect_drafts, spec_round, tiny


def with_draft(model, seed=1):
    """`model` with a random draft head (its layer a copy of the model's last: drafts are poor)."""
    d = draft_head.init_draft(model.config, jax.random.PRNGKey(seed), params=model.params)
    return model.with_params({**model.params, "draft": d})


def perfect_head(model):
    """A model whose layers are the identity (its next token depends on the current token only:
    logits = norm(embed(x)) @ embed.T) and a draft head that passes the next token's embedding
    through (fc = [I; 0], its layer the identity): its logits are the model's up to the positive
    norm scale, so every draft is accepted."""
    base = perfect_drafts(model, 0)
    d = draft_head.init_draft(model.config, jax.random.PRNGKey(0))
    width = model.config.hidden_size
    d["fc"] = jnp.zeros((2 * width, width)).at[:width].set(jnp.eye(width))
    d["layer"] = {**d["layer"], "wo": d["layer"]["wo"] * 0, "w_down": d["layer"]["w_down"] * 0}
    return base.with_params({**base.params, "draft": d})


@pytest.fixture(scope="module")
def model():
    return with_draft(tiny())


# --- greedy: identical to full depth ----------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 8], ids=["batch1", "padded-batch8"])
def test_greedy_equals_full_depth(model, rows):
    prompts = PROMPTS[:rows]
    full = eejax.generate(model, prompts, max_new_tokens=NEW, ignore_eos=True, spec=None)
    reduced = model.with_params(
        set_exit_vocab(model.params, np.arange(0, 64, 3), model.config.tie_embeddings)
    )  # drafts from 22 tokens
    for m, spec in ((model, "draft:1"), (model, "draft:3"), (reduced, "draft:2")):
        res = eejax.generate(m, prompts, max_new_tokens=NEW, ignore_eos=True, spec=spec)
        assert res.tokens == full.tokens, spec
        assert res.stats["spec"] == spec and res.stats["rounds"] > 0
        if rows == 1:  # several rounds a program (`steps_per_dispatch` = 4; one would make 11-12 programs)
            assert 2 * res.stats["engine_steps"] < res.stats["rounds"], spec


def test_a_confidence_stop_drafts_less_and_stays_lossless(model):
    """draft:3:stop=0.7: rounds stop drafting at an unconfident draft (fewer drafts judged than 3
    per round, more than the first), the batch drafting on while a row does; full depth's tokens."""
    for rows in (1, 8):
        full = eejax.generate(model, PROMPTS[:rows], max_new_tokens=NEW, ignore_eos=True, spec=None)
        res = eejax.generate(model, PROMPTS[:rows], max_new_tokens=NEW, ignore_eos=True, spec="draft:3:stop=0.7")
        s = res.stats
        assert res.tokens == full.tokens and s["spec"] == "draft:3:stop=0.7"
        assert s["rounds"] < s["drafted_tokens"] < 0.7 * 3 * s["rounds"], rows


def test_prompt_lookup_copies_drafts_and_stays_lossless():
    """A prompt lookup with the perfect head (never wrong; its model's next token depends on the
    current one only): each prompt holds x, f(x), 4 other tokens, f(x)..f^8(x), 2 others, x (after
    8 tokens that all share, for the prefix cache), so the first round copies wrong tokens
    (rejected) and later ones copy the chain (accepted). In one row (draft:3:lookup) and in a
    batch (draft:2:lookup=5: copies longer than the head's chain after a 4-token match, some
    taken), also through an engine with
    chunks, prefix caching and a preempted row (its prompt then holds what it generated before):
    full depth's tokens, drafts rejected (only copies can be), and the head's d passes in every
    round but those where every row copied (`feature_draft._draft_with_lookup`)."""
    perfect = perfect_head(tiny())
    prompts = []
    for x in (3, 8, 21, 40, 52):
        chain = [x] + eejax.generate(perfect, [[x]], max_new_tokens=9, ignore_eos=True, spec=None).tokens[0]
        other = [t for t in range(60) if t not in chain][x % 7 : x % 7 + 6]
        prompts.append(PROMPTS[6][:8] + chain[:2] + other[:4] + chain[1:9] + other[4:] + [x])

    def lossless(engine, spec, rows):
        seqs = [engine.submit(p, max_new_tokens=NEW, spec=spec) for p in prompts[:rows]]
        engine.run()
        full = eejax.generate(perfect, prompts[:rows], max_new_tokens=NEW, ignore_eos=True, spec=None)
        assert [s.tokens for s in seqs] == full.tokens, spec
        total = {k: sum(s.spec_counters[k] for s in seqs) for k in SPEC_COUNTERS}
        d = SpecConfig.parse(spec).num_speculations
        assert total["accepted"] < total["drafted"], spec
        heads = [s.spec_counters["draft_heads"] for s in seqs]  # d a round, none where every row copied
        assert all(h % d == 0 for h in heads) and 0 < total["draft_heads"] < d * total["rounds"], spec
        for c in (s.spec_counters for s in seqs):  # by depth: the same drafts, each judged once a round
            judged, accepted = np.array(c["depth_judged"]), np.array(c["depth_accepted"])
            assert accepted.sum() == c["accepted"] and (judged - accepted).sum() == c["rejections"], spec
            assert c["rounds"] >= judged[0] and (judged[1:] <= accepted[:-1]).all(), spec
        past_chain = sum(sum(s.spec_counters["depth_accepted"][d:]) for s in seqs)
        assert (past_chain > 0) == (SpecConfig.parse(spec).lookup > d), spec  # a long match's copies

    for rows, spec in ((1, "draft:3:lookup"), (5, "draft:2:lookup=5")):
        lossless(Engine(perfect, max_slots=rows, max_new_tokens=NEW, ignore_eos=True), spec, rows)
    engine = chunked_engine(perfect, pages=10)
    lossless(engine, "draft:2:lookup=5", 3)
    assert engine.counters["preemptions"] > 0


def test_a_round_where_every_row_copies_skips_the_head_on_float_weights_only():
    """`feature_draft._skips_idle_head`: on a CPU a float model skips the head's passes in a round
    where every row copies (its head may draft from Q8_0 blocks), a model on blocks runs them."""
    w = np.ones((64, 32), np.float32)
    assert feature_draft._skips_idle_head({"embed": w, "draft": {"fc": quantize_q8_0(w)}})
    assert not feature_draft._skips_idle_head({"embed": quantize_q8_0(w), "draft": {"fc": w}})


def test_perfect_drafts_are_all_accepted_and_counted():
    perfect = perfect_head(tiny())
    full = eejax.generate(perfect, PROMPTS[:3], max_new_tokens=11, ignore_eos=True, spec=None)
    res = eejax.generate(perfect, PROMPTS[:3], max_new_tokens=11, ignore_eos=True, spec="draft:4")
    s, L = res.stats, perfect.config.num_layers
    assert res.tokens == full.tokens
    # 10 decode tokens per row in rounds of 5 (4 drafts + the verified token): 2 rounds.
    assert (s["acceptance_rate"], s["rounds"], s["tokens_per_round"]) == (1.0, 6, 5.0)
    assert s.depth_acceptance == (1.0,) * 4
    assert res.exit_layers == [[L, 0, 0, 0, 0, L, 0, 0, 0, 0, L]] * 3  # drafts used none of the model's layers
    # One verify pass of L layers per round and the prefill's token.
    assert s["mean_layers_per_token"] == pytest.approx((2 * L + L) / 11)
    for new in (1, 4):  # never more tokens than asked, rounds cut at the row's limit
        short = eejax.generate(perfect, PROMPTS, max_new_tokens=new, ignore_eos=True, spec="draft:6")
        assert short.tokens == [
            t[:new] for t in eejax.generate(perfect, PROMPTS, max_new_tokens=new, ignore_eos=True, spec=None).tokens
        ]


# --- a tree of drafts ---------------------------------------------------------------------------


def test_tree_drafts_are_lossless_and_a_perfect_head_fills_the_chain(model):
    full = eejax.generate(model, PROMPTS, max_new_tokens=NEW, ignore_eos=True, spec=None)
    for spec in ("draft:3:tree", "draft:tree=0,00,000,1,10,2,20"):
        res = eejax.generate(model, PROMPTS, max_new_tokens=NEW, ignore_eos=True, spec=spec)
        assert res.tokens == full.tokens, spec
        assert res.stats["spec"] == spec and res.stats["rounds"] > 0
    perfect = perfect_head(tiny())
    full = eejax.generate(perfect, PROMPTS[:3], max_new_tokens=11, ignore_eos=True, spec=None)
    res = eejax.generate(perfect, PROMPTS[:3], max_new_tokens=11, ignore_eos=True, spec="draft:4:tree")
    # the likeliest chain sits where a chain's drafts would: the same rounds as draft:4
    assert res.tokens == full.tokens
    assert (res.stats["acceptance_rate"], res.stats["rounds"], res.stats["tokens_per_round"]) == (1.0, 6, 5.0)


def test_a_path_through_side_branches_leaves_what_a_chain_of_its_tokens_leaves(model):
    """Each row's greedy tokens g1, g2 sit on side branches of the tree 0,1,10,11 (wrong tokens at
    (0,) and (1, 0)): the round accepts both, moves their K/V to n+1, n+2, and leaves the state
    and cache (every layer, the draft's too, up to seq_len) that a chain round of g1, g2 leaves."""
    rows = PROMPTS[:4]
    state0, cache0, table = prefilled(model, rows, max_new_tokens=12, pages_per_row=6)
    greedy = np.asarray(eejax.generate(model, rows, max_new_tokens=3, ignore_eos=True, spec=None).tokens)  # x_n, g1, g2
    wrong = (greedy + 1) % model.config.vocab_size
    last = np.asarray(state0.last_token)
    results = []
    for spec, tokens in (
        (SpecConfig.parse("draft:tree=0,1,10,11"), [last, wrong[:, 1], greedy[:, 1], wrong[:, 2], greedy[:, 2]]),
        (SpecConfig.parse("draft:2"), [last, greedy[:, 1], greedy[:, 2]]),
    ):
        tokens = jnp.asarray(np.stack(tokens, axis=1), jnp.int32)
        drafts = speculative.Drafts(tokens, embed(model.params, tokens), jnp.zeros((len(rows), tokens.shape[1] - 1, 0)))
        options = StepOptions(12, spec=spec).round(spec.num_speculations).verifying()
        counters = speculative.SpecCounters.zeros(len(rows))
        results.append(
            speculative.verify(
                model.params, cache0, state0, drafts, counters, table, config=model.config, options=options
            )
        )
    (tree_state, tree_cache, tree_counters), (chain_state, chain_cache, _) = results
    assert np.asarray(tree_counters.accepted).tolist() == [2] * len(rows)
    np.testing.assert_array_equal(tree_state.tokens, chain_state.tokens)
    np.testing.assert_array_equal(tree_state.seq_len, chain_state.seq_len)
    # a tree's verify attends through the jnp reference, a chain's through the CPU kernel: float rounding
    np.testing.assert_allclose(tree_state.draft_hidden, chain_state.draft_hidden, atol=1e-4, rtol=1e-5)
    for row in range(len(rows)):
        n = int(chain_state.seq_len[row])
        for layer in range(model.cache_layers):
            np.testing.assert_allclose(
                _draft_kv(tree_cache, table, row, n, layer),
                _draft_kv(chain_cache, table, row, n, layer),
                atol=2e-5,
                rtol=1e-5,
                err_msg=f"row {row} layer {layer}",
            )


def test_tree_settings_are_refused_on_one_line(model):
    for spec, message in (
        ("draft:tree=00", r"\[\(0,\)\] are missing"),
        ("draft:tree=0,9", "ranks 0..7"),
        ("12:4:tree", "needs the draft head"),
        ("draft:tree=0,x", "ranks as digits"),
    ):
        with pytest.raises(EejaxError, match=message):
            SpecConfig.parse(spec)
    assert DraftTreeSpec([(1,), (0,)]) == SpecConfig.parse("draft:tree=0,1")
    assert DraftTreeSpec([(0,), (0, 0)]).num_speculations == 2  # d is the tree's depth
    with pytest.raises(EejaxError, match="common type: build one of LayerSkipSpec, DraftChainSpec"):
        SpecConfig(0, 2, draft_head=True, tree=[(0,), (1,)])  # the methods' fields are their own
    with pytest.raises(EejaxError, match="greedy rows without penalties"):
        StepOptions(8, sampler="temperature", spec=SpecConfig.parse("draft:2:tree"))
    for kw in (dict(temperature=0.7), dict(repetition_penalty=1.2)):  # refused before anything runs
        with pytest.raises(EejaxError, match="greedy rows without penalties"):
            eejax.generate(model, PROMPTS[:2], max_new_tokens=4, spec="draft:2:tree", **kw)
    assert SpecConfig.parse("draft:tree=1,0,00").tree == ((0,), (0, 0), (1,))


# --- the draft's K/V: always the model's features, however the tokens reached the cache -------


def _draft_kv(cache, table, row, n, layer):
    k = np.asarray(cache.k[layer])
    return np.stack([k[:, int(table[row, p // 8]), p % 8] for p in range(n)])


def test_draft_kv_after_rounds_and_plain_steps_equals_a_prefill_of_the_same_tokens(model):
    spec = DraftChainSpec(3)
    state, cache, table = prefilled(model, PROMPTS, max_new_tokens=16, pages_per_row=6)
    counters = speculative.SpecCounters.zeros(len(PROMPTS))
    plain = StepOptions(16, spec=spec).plain(3)  # 3 plain steps in one program: one draft catch-up
    for _ in range(2):
        state, cache, _ = spec_round(model, state, cache, table, spec, max_new_tokens=16)
        state, cache, _ = speculative.plain_step(
            model.params, cache, state, counters, table, config=model.config, options=plain
        )
    tokens, gen, L = np.asarray(state.tokens), np.asarray(state.num_generated), model.config.num_layers
    # A prefill of prompt + every emitted token but the last (whose greedy first token is that last one).
    texts = [p + tokens[i, : gen[i] - 1].tolist() for i, p in enumerate(PROMPTS)]
    ref_state, ref_cache, ref_table = prefilled(model, texts, max_new_tokens=4, pages_per_row=6)
    assert np.asarray(ref_state.last_token).tolist() == [tokens[i, gen[i] - 1] for i in range(len(PROMPTS))]
    for row, text in enumerate(texts):
        np.testing.assert_allclose(
            _draft_kv(cache, table, row, len(text), L),
            _draft_kv(ref_cache, ref_table, row, len(text), L),
            atol=2e-5,
            rtol=1e-5,
        )
    # rounds attend through the CPU kernel, a prefill through the jnp reference: float rounding
    np.testing.assert_allclose(np.asarray(state.draft_hidden), np.asarray(ref_state.draft_hidden), atol=1e-4, rtol=1e-5)


def test_a_chunked_prefill_writes_the_same_draft_kv(model):
    prompt = PROMPTS[6]  # 24 tokens, chunks of 10
    whole_state, whole_cache, table = prefilled(model, [prompt], pages_per_row=4)
    c, L = model.config, model.config.num_layers
    cache = model.new_cache(5, 8)
    options = StepOptions(8)
    state = None
    for start in range(0, len(prompt), 10):
        end = min(start + 10, len(prompt))
        nxt = jnp.asarray([prompt[end] if end < len(prompt) else -1], jnp.int32)
        state, cache = steps.prefill(
            model.params,
            cache,
            jnp.asarray([prompt[start:end]], jnp.int32),
            jnp.asarray([end], jnp.int32),
            table,
            jax.random.PRNGKey(0),
            offset=jnp.asarray([start], jnp.int32),
            next_token=nxt,
            config=c,
            options=options,
        )
    np.testing.assert_allclose(
        _draft_kv(cache, table, 0, len(prompt), L),
        _draft_kv(whole_cache, table, 0, len(prompt), L),
        atol=2e-5,
        rtol=1e-5,
    )
    # chunks of 10 and the whole prompt multiply matrices of other shapes, summed in other orders
    # (on an AVX-512 CPU a draft hidden state of ~1 differed by 3e-5)
    np.testing.assert_allclose(
        np.asarray(state.draft_hidden), np.asarray(whole_state.draft_hidden), atol=1e-4, rtol=1e-5
    )


def chunked_engine(model, pages=9):
    """Two slots, prompts prefilled 5 tokens per step, pages of 8 as rows grow (few: rows preempted)."""
    budget = model.cache_layers * 2 * 8 * 2 * 8 * 4 * pages
    return Engine(
        model,
        max_slots=2,
        max_new_tokens=NEW,
        page_size=8,
        prefill_chunk=5,
        pages="grow",
        cache_budget=budget,
        ignore_eos=True,
    )


def test_engine_with_chunks_and_prefix_caching_is_lossless(model):
    """Rows in turn through one slot, so later prompts share the first's cached pages, prompts
    prefilled 5 tokens per step, and a row preempted on the way: the same tokens as full depth."""
    prompts = [PROMPTS[6], PROMPTS[6][:20] + [5, 6, 7], PROMPTS[1]]
    full = eejax.generate(model, prompts, max_new_tokens=NEW, ignore_eos=True, spec=None)
    engine = chunked_engine(model)
    seqs = [engine.submit(p, max_new_tokens=NEW, spec="draft:3") for p in prompts]
    engine.run()
    assert [s.tokens for s in seqs] == full.tokens
    assert engine.counters["prefix_cache_hit_tokens"] > 0


# --- adaptive rounds, sampling -----------------------------------------------------------------


def test_adaptive_generation_is_lossless_and_turns_speculation_off(model, monkeypatch):
    """CPU-like costs where no round pays even with every draft accepted: a round and a plain step
    (its program ends with a draft catch-up) measure them, then the rows' speculation is off for
    good (plain steps, no catch-up, no probe rounds); a row that comes later gets a new policy."""
    full = eejax.generate(model, PROMPTS, max_new_tokens=NEW, ignore_eos=True, spec=None)
    fixed_policy_costs(monkeypatch, draft_pass=1.0, verify=1.0, plain=1.0)
    res = eejax.generate(model, PROMPTS, max_new_tokens=NEW, ignore_eos=True, spec="draft:2:adaptive")
    assert res.tokens == full.tokens
    assert res.stats["rounds"] > 0 and res.stats["plain_step_rate"] > 0.5
    longer = 3 * NEW  # time for a new engine's first runs (not timed) and its measurements
    engine = Engine(model, max_slots=2, max_new_tokens=longer, ignore_eos=True)
    first = engine.submit(PROMPTS[0], max_new_tokens=longer, spec="draft:2:adaptive")
    while not first.spec_off and engine.busy:  # costs from the steps' wall times (one program each)
        engine.step()
    assert first.spec_off and not first.finished
    (first_policy,) = engine.speculation.policies.values()
    later = engine.submit(PROMPTS[1], max_new_tokens=longer, spec="draft:2:adaptive")
    engine.run()
    full = eejax.generate(model, PROMPTS[:2], max_new_tokens=longer, ignore_eos=True, spec=None)
    assert [first.tokens, later.tokens] == full.tokens and later.spec_off
    (later_policy,) = (
        engine.speculation.policies.values()
    )  # the later row's own, also turned off (a server keeps no past ones)
    assert later_policy is not first_policy and later_policy.turned_off and not engine.speculation.past_policies


def test_auto_speculates_with_a_draft_head_one_row_at_a_time_on_a_cpu(model):
    """spec="auto": the draft head's adaptive chain with lookup where one row decodes at a time (a
    CPU's rule, `spec_policy.auto_speculates`), full depth for a batch on a CPU and without a head."""
    full = eejax.generate(model, PROMPTS[:2], max_new_tokens=NEW, ignore_eos=True, spec=None)
    res = eejax.generate(model, PROMPTS[:2], max_new_tokens=NEW, ignore_eos=True, spec="auto", batch_size=1)
    assert res.tokens == full.tokens and res.stats["rounds"] > 0
    # a float model whose head drafts from blocks (`drafts_in_blocks`: the tiled loop runs) drafts deeper
    cpu_auto = auto_spec(on_cpu=True, cheap_drafts=model.drafts_in_blocks)
    assert res.stats["spec"] == cpu_auto.spec
    assert cpu_auto.spec == ("draft:3:adaptive:lookup=7" if model.drafts_in_blocks else "draft:2:adaptive:lookup")
    default = eejax.generate(model, PROMPTS[:2], max_new_tokens=NEW, ignore_eos=True, batch_size=1)  # spec not given
    assert default.tokens == full.tokens and default.stats["spec"] == res.stats["spec"]
    assert auto_spec().spec == "draft:2:adaptive:lookup=4" and auto_spec().max_speculations == 4  # a GPU's
    batch = eejax.generate(model, PROMPTS[:2], max_new_tokens=NEW, ignore_eos=True, spec="auto")
    assert batch.tokens == full.tokens and batch.stats["spec"] is None
    assert eejax.generate(tiny(), PROMPTS[:1], max_new_tokens=2, spec="auto").stats["spec"] is None
    engine = Engine(model, max_slots=1, max_new_tokens=NEW, ignore_eos=True)
    assert engine.submit(PROMPTS[0], max_new_tokens=NEW, spec="auto").spec == cpu_auto
    # An engine's default when none is given: auto, unless a default exit is (then that exit alone).
    assert engine.submit(PROMPTS[0], max_new_tokens=NEW, queue=False).spec == cpu_auto
    exiting = Engine(model, max_slots=1, max_new_tokens=NEW, exit="softmax:0.9")
    seq = exiting.submit(PROMPTS[0], max_new_tokens=NEW, queue=False)
    assert seq.spec is None and seq.request.exit.measure == "softmax"
    assert exiting.submit(PROMPTS[0], max_new_tokens=NEW, spec="auto", queue=False).request.exit is None
    for off in ("none", "off", "", " Off "):
        assert resolve_spec(off, has_draft_head=True) is None
    assert resolve_spec("Auto", has_draft_head=True) == auto_spec()
    assert resolve_spec("auto", has_draft_head=True, speculate=False) is None
    assert resolve_spec("auto", has_draft_head=True, on_cpu=True) == auto_spec(on_cpu=True)
    deep = resolve_spec("auto", has_draft_head=True, on_cpu=True, cheap_drafts=True)
    assert deep == auto_spec(on_cpu=True, cheap_drafts=True) and (deep.max_speculations, deep.lookup) == (3, 7)
    assert resolve_spec("auto", has_draft_head=True, cheap_drafts=True) == auto_spec()  # a GPU's whatever the head
    with pytest.raises(EejaxError, match="not both"):  # whether auto would speculate or not
        eejax.generate(model, PROMPTS[:2], max_new_tokens=2, spec="auto", exit="softmax:0.9")
    assert resolve_spec("draft:2", has_draft_head=False) == SpecConfig.parse("draft:2")  # checked later


def test_priced_rounds_in_the_engine_are_lossless_and_time_nothing(model, monkeypatch):
    """A CPU's auto (`auto_spec(on_cpu=True)`) one row at a time, its rounds priced (float
    weights: `CPU_FLOAT_ROUND_STEPS` where the head drafts from blocks, else `CPU_FLOAT_DRAFT_ROUND_STEPS`):
    full depth's tokens, rounds from the first program, and nothing timed: no split round, no plain
    step, the prices kept; a row after another in one slot is new to the policy
    (`SpeculationPolicy.new_rows`)."""
    from eejax.decode.spec_policy import CPU_FLOAT_DRAFT_ROUND_STEPS, CPU_FLOAT_ROUND_STEPS, SpeculationPolicy

    table = CPU_FLOAT_ROUND_STEPS if model.drafts_in_blocks else CPU_FLOAT_DRAFT_ROUND_STEPS
    prices = {1: table[1], 2: table[2]}  # d's price: a d = 1 round copies 2 drafts only after a 4-token match
    renewed = []
    monkeypatch.setattr(SpeculationPolicy, "new_rows", lambda self: renewed.append(self))
    full = eejax.generate(model, PROMPTS[:2], max_new_tokens=NEW, ignore_eos=True, spec=None)
    engine = Engine(model, max_slots=1, max_new_tokens=NEW, ignore_eos=True)
    seqs = [engine.submit(p, max_new_tokens=NEW, spec=auto_spec(on_cpu=True)) for p in PROMPTS[:2]]
    engine.run()
    (policy,) = list(engine.speculation.policies.values()) + engine.speculation.past_policies
    assert [s.tokens for s in seqs] == full.tokens and policy.prices == prices and policy.verify_s == prices
    assert policy.plain_timed == 0 and policy.c_full == 1.0 and policy.chosen[2] >= 1
    assert renewed == [policy]  # the second row, alone in its slot after the first: all rows new


SAMPLED_PROMPT = [3, 7, 1, 12, 5]


def sampled_round(rows: int, spec, max_new_tokens: int, seed: int, lookup=None):
    """One round at temperature 1 of `rows` copies of SAMPLED_PROMPT (after a greedy prefill) on
    the perfect head of a 16-token model: (model, state before, state after, counters). `lookup`:
    a function of the first token giving the prompt a prompt lookup searches."""
    model = perfect_head(tiny(vocab=16, scale=0.6, seed=3))
    state, cache, table = prefilled(model, [SAMPLED_PROMPT] * rows, max_new_tokens=max_new_tokens, pages_per_row=2)
    state = dataclasses.replace(
        state,
        sampling=jax.tree.map(jnp.asarray, RowSampling.of(SamplingParams(1.0), rows)),
        keys=jax.random.split(jax.random.PRNGKey(seed), rows),
    )
    if lookup is not None:
        prompt = lookup(int(state.last_token[0]))
        tokens = jnp.tile(jnp.asarray([prompt], jnp.int32), (rows, 1))
        state = dataclasses.replace(state, prompt=PromptTokens(tokens, jnp.full((rows,), len(prompt), jnp.int32)))
    round_ = jax.jit(spec_round, static_argnums=(0, 4, 5, 6))
    new_state, _, counters = round_(model, state, cache, table, spec, max_new_tokens, 1.0)
    return model, state, new_state, counters


def test_speculative_sampling_with_a_draft_head_matches_the_models_softmax():
    """Many identical rows (a greedy prefill), one round at temperature 1 over a 16-token
    vocabulary: the first token the round emits is distributed as the model's next-token softmax,
    not as the draft's (the perfect head's drafts: the right argmax at another temperature)."""
    model, state, new_state, counters = sampled_round(4096, DraftChainSpec(2), 4, seed=5)
    first = np.asarray(new_state.tokens)[:, 1]
    p = np.asarray(jax.nn.softmax(_last_logits(model, SAMPLED_PROMPT + [int(state.last_token[0])])))
    q = np.asarray(jax.nn.softmax(draft_head.draft_logits(model.params, state.draft_hidden[0], model.config, False)))
    acceptance = np.asarray(counters.accepted).sum() / np.asarray(counters.drafted).sum()
    assert 0.5 * np.abs(p - q).sum() > 0.1  # the draft is wrong often enough to matter
    assert 0.1 < acceptance < 0.95
    assert chi_square_p(np.bincount(first, minlength=16), p) > 1e-3
    assert chi_square_p(np.bincount(first, minlength=16), q) < 1e-6


def test_sampling_after_a_confidence_stop_takes_the_next_token_from_the_model():
    """d = 3, η = 0.5 splits identical rows by their sampled first draft: 2 drafts count in some,
    3 in the others (which keep the batch drafting). A row that accepted both of its 2 drafts
    draws its third token from the model's softmax after them, not from a residual against the
    third draft that the batch made but the row never counted."""
    spec = DraftStopSpec(3, 0.5)
    model, state, new_state, counters = sampled_round(8192, spec, 5, seed=6)
    made = np.asarray(new_state.num_generated) - np.asarray(state.num_generated)
    drafted, tokens = np.asarray(counters.drafted), np.asarray(new_state.tokens)
    assert set(drafted) == {2, 3} and made[drafted == 2].max() == 3  # 2 drafts: at most 3 tokens
    both = (drafted == 2) & (made == 3)
    pair = tokens[:, 1] * 16 + tokens[:, 2]
    top = np.bincount(pair[both]).argmax()
    third = tokens[both & (pair == top), 3]
    p = np.asarray(
        jax.nn.softmax(_last_logits(model, SAMPLED_PROMPT + [int(state.last_token[0]), top // 16, top % 16]))
    )
    assert len(third) > 500 and chi_square_p(np.bincount(third, minlength=16), p) > 1e-3


def test_sampling_a_copied_draft_takes_the_models_softmax():
    """A prompt lookup's drafts (here 3: the tokens after an earlier occurrence of the row's last
    two) were drawn from a q all on them: the first token a round emits is distributed as the
    model's softmax, whether the copy is the model's likeliest next token or its least likely."""
    model = perfect_head(tiny(vocab=16, scale=0.6, seed=3))
    spec = DraftLookupSpec(3)

    def softmax_after(first):
        return np.asarray(jax.nn.softmax(_last_logits(model, SAMPLED_PROMPT + [first])))

    for rank, seed in ((-1, 7), (0, 8)):

        def prompt(first, rank=rank):
            copy = int(np.argsort(softmax_after(first))[rank])
            return SAMPLED_PROMPT + [first, copy, 9] + SAMPLED_PROMPT[-1:]  # history: ... 5 first copy 9 5 | first

        _, state, new_state, counters = sampled_round(8192, spec, 5, seed=seed, lookup=prompt)
        assert set(np.asarray(counters.drafted)) == {3}
        assert set(np.asarray(counters.draft_heads)) == {0}  # every row copied: no head pass ran
        first = np.asarray(new_state.tokens)[:, 1]
        p = softmax_after(int(state.last_token[0]))
        assert chi_square_p(np.bincount(first, minlength=16), p) > 1e-3, rank


def _last_logits(model, tokens):
    """The model's next-token logits after `tokens`, from its no-cache forward."""
    params = {k: v for k, v in model.params.items() if k != "draft"}
    return llama.Llama(model.config).apply({"params": params}, jnp.asarray([tokens]), jnp.asarray([len(tokens)]))[0, -1]


# --- training -----------------------------------------------------------------------------------


@pytest.mark.skipif(
    not cpu_matmul.tiled_loop_runs(), reason="a float model's head drafts from blocks where the tiled loop runs"
)
def test_a_float_models_draft_head_drafts_from_q8_0_blocks_its_layer_in_one_call(model, monkeypatch):
    """`Model.drafts_in_blocks`: the decode programs' draft head and reduced head are Q8_0 blocks
    taking int16 x while `params` keep them float; the draft layer then runs as one call, whose
    bits are its op-by-op layer's. (Greedy tokens stay full depth's: test_greedy_equals_full_depth.)"""
    m = model.with_params(set_exit_vocab(model.params, np.arange(0, 64, 3), model.config.tie_embeddings))
    assert m.drafts_in_blocks and not formats(m.params["draft"]) and m.quantization is None
    run = m.run_params
    blocks = [*jax.tree.leaves(run["draft"], is_leaf=is_quantized), run["exits"]["vocab_head"]]
    blocks = [w for w in blocks if is_quantized(w)]
    assert len(blocks) == 1 + len(llama.LINEAR_KEYS) + 1  # fc, the layer's Linears, the reduced head
    assert {(w.format, w.activations) for w in blocks} == {("q8_0", "int16")}
    assert not m.with_params(cast_floats(m.params, jnp.bfloat16)).drafts_in_blocks

    state, cache, table = prefilled(m, PROMPTS[:1])
    batch = token_batch(m.config, state, jnp.zeros((1,), jnp.int32), table, cache.page_size, "auto")
    assert llama.one_call_applies(run["draft"]["layer"], state.draft_hidden[:, None], cache, batch, m.config)
    x = (state.draft_hidden[:, None], embed(m.params, state.last_token[:, None]))
    one, one_cache = draft_head.draft_layer(run, *x, jax.tree.map(jnp.copy, cache), batch, m.config)
    monkeypatch.setattr(draft_head, "one_call_applies", lambda *a, **k: False)
    ops, ops_cache = draft_head.draft_layer(run, *x, jax.tree.map(jnp.copy, cache), batch, m.config)
    np.testing.assert_array_equal(one, ops)
    np.testing.assert_array_equal(one_cache.k, ops_cache.k)


def test_unrolled_passes_attend_as_a_round_of_drafts_does(model):
    """Pass k at p of the training forward is the (k+1)-th draft of a round from p - k: the same as
    the causal forward over the model's features up to p - k followed by the round's own drafts."""
    config, draft = model.config, model.params["draft"]
    b, t, d = 2, 9, config.hidden_size
    feature = jax.random.normal(jax.random.PRNGKey(3), (b, t, d))
    embeds = jax.random.normal(jax.random.PRNGKey(4), (b, t, d))
    lengths = jnp.asarray([t, 7])
    passes = draft_head.unrolled_forward(config, draft, feature, embeds, lengths, 3)
    np.testing.assert_allclose(passes[0], draft_head.dense_forward(config, draft, feature, embeds, lengths), atol=1e-5)
    for start in (0, 2, 4):
        x = feature[:, : start + 1]
        for k in range(3):  # the round's k-th draft: causal over the model's features, then its own
            out = draft_head.dense_forward(config, draft, x, embeds[:, : x.shape[1]], jnp.full((b,), x.shape[1]))
            p = start + k
            rows = np.asarray(p < lengths)
            np.testing.assert_allclose(passes[k][rows, p], out[rows, -1], atol=1e-4, err_msg=f"pass {k} at {p}")
            x = jnp.concatenate([x, out[:, -1:]], axis=1)


def test_training_on_cached_features_learns_the_next_token(tmp_path, monkeypatch):
    """The identity-layer model's next token is a function of the current one: a draft trained a
    few dozen steps on its cached features predicts it far better than chance; the feature cache
    resumes at a missing shard with the same content."""
    from eejax.train import draft_features, draft_training
    from eejax.train.draft_features import build_feature_cache, load_feature_cache
    from eejax.train.draft_training import heldout_agreement, train_draft

    base = perfect_drafts(tiny(vocab=32, scale=0.5, seed=2), 0)
    rng = np.random.default_rng(0)
    texts = [rng.integers(3, 32, size=40).tolist() for _ in range(16)]
    cache_dir = build_feature_cache(
        base, texts, tmp_path / "features", window=32, batch_size=4, shard_rows=8, progress=False
    )
    first = load_feature_cache(cache_dir)
    (cache_dir / "shard_00001.npz").unlink()
    build_feature_cache(base, texts, cache_dir, window=32, batch_size=4, shard_rows=8, progress=False)
    data = load_feature_cache(cache_dir)
    for k in first:
        np.testing.assert_array_equal(np.asarray(first[k]), np.asarray(data[k]), err_msg=k)
    # rows run in order of length, each batch padded to a multiple of min(PAD_STEP, window / 4): as one whole pass
    program = draft_features._features_program(base.config)
    rows = [texts[0][:5], texts[1][:32], texts[2][:7], texts[3][:20]]
    for pad_step in (draft_features.PAD_STEP, 3):  # batches of 2 padded to 8 and 32 tokens, then to 9 and 32
        monkeypatch.setattr(draft_features, "PAD_STEP", pad_step)
        tokens, lengths, *got = draft_features._shard_features(program, base.params, rows, 32, 2)
        whole = program(base.params, tokens, lengths)
        valid = np.arange(32)[None, :] < lengths[:, None]
        assert lengths.tolist() == [5, 32, 7, 20]
        for g, w in zip(got, whole):
            np.testing.assert_allclose(np.asarray(g, np.float32)[valid], np.asarray(w, np.float32)[valid], atol=0.02)
    with pytest.raises(EejaxError, match="other text or settings"):
        build_feature_cache(base, texts[:3], cache_dir, window=32, batch_size=4, shard_rows=8, progress=False)
    # past its deadline a pass writes one shard; the next pass completes the cache
    late = dict(window=32, batch_size=4, shard_rows=8, progress=False)
    build_feature_cache(base, texts, tmp_path / "late", deadline=time.monotonic(), **late)
    assert len(load_feature_cache(tmp_path / "late")["lengths"]) == 8
    build_feature_cache(base, texts, tmp_path / "late", **late)
    np.testing.assert_array_equal(load_feature_cache(tmp_path / "late")["features"], data["features"])
    draft, losses, agree = train_draft(
        base,
        data,
        steps=60,
        batch_size=8,
        learning_rate=3e-3,
        progress=False,
        checkpoint_dir=tmp_path / "run",
        save_every=30,
    )
    assert agree[:5, 0].mean() < 0.3 and agree[-5:, 0].mean() > 0.6, agree[:, 0]  # chance: 1/32
    assert losses[-5:].mean() < losses[:5].mean()
    # held out of the noise: agreement per draft position, the same whatever the batches
    trained = base.with_params({**base.params, "draft": draft})
    held = heldout_agreement(trained, data, unroll=2, batch_size=16)
    np.testing.assert_allclose(heldout_agreement(trained, data, unroll=2, batch_size=3), held, rtol=1e-6)
    assert held.shape == (2,) and held[0] > 0.6, held
    late_only = heldout_agreement(trained, data, unroll=1, first=data["lengths"] - 1)  # each window's last token
    assert 0 <= late_only[0] <= 1 and late_only[0] != held[0]
    counted = draft_training._counted({"lengths": jnp.asarray([5, 3]), "first": jnp.asarray([2, 0])}, 4)
    np.testing.assert_array_equal(counted, [[False, True, True, True], [True, True, False, False]])
    # resumes from its last checkpoint: nothing left to run
    _, again, _ = train_draft(
        base, data, steps=60, batch_size=8, learning_rate=3e-3, progress=False, checkpoint_dir=tmp_path / "run"
    )
    np.testing.assert_array_equal(again, losses)


def test_a_fusion_of_lower_layers_reads_their_cached_states_and_starts_as_the_head_it_extends(model, tmp_path):
    """EAGLE-3's fusion (training only): the cache keeps the states after the asked layers (those of
    the training forward), a cache of other layers is refused, a zero fusion changes no agreement,
    and a fused head trains with finite losses on windows with padding (the noise's scale is no
    gradient path: its sqrt at a padded zero feature would give NaN) and learns a fusion."""
    from eejax.train.draft_features import build_feature_cache, load_feature_cache
    from eejax.train.draft_training import heldout_agreement, train_draft

    rng = np.random.default_rng(3)
    texts = [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in (30, 9, 24, 17)]
    small = dict(window=32, batch_size=2, shard_rows=4, progress=False)
    data = load_feature_cache(build_feature_cache(model, texts, tmp_path / "fused", layers=(1, 2), **small))
    assert data["states"].shape == (4, 32, 2, model.config.hidden_size)
    states, _ = llama.forward_states(
        model.params, jnp.asarray(data["tokens"]), jnp.asarray(data["lengths"]), model.config
    )
    valid = np.arange(32)[None, :] < data["lengths"][:, None]
    for j, layer in enumerate((1, 2)):
        want = np.asarray(states[layer - 1], np.float32)[valid]
        np.testing.assert_allclose(np.asarray(data["states"][:, :, j], np.float32)[valid], want, rtol=0.02, atol=0.02)
    with pytest.raises(EejaxError, match="other text or settings"):
        build_feature_cache(model, texts, tmp_path / "fused", **small)
    with pytest.raises(EejaxError, match="layers must be increasing"):
        build_feature_cache(model, texts, tmp_path / "bad", layers=(2, 1), **small)
    fused = model.with_params(
        {**model.params, "draft": {**model.params["draft"], "fuse": draft_head.init_fuse(model.config, 2)}}
    )
    np.testing.assert_array_equal(heldout_agreement(fused, data, unroll=2), heldout_agreement(model, data, unroll=2))
    with pytest.raises(UnsupportedModelError, match="fuses lower layers' states"):
        draft_head.check_draft(fused.params["draft"], model.config)
    with pytest.raises(EejaxError, match="fuses lower layers' states"):
        eejax.generate(fused, [[5, 6, 7]], max_new_tokens=2, spec="draft:2")
    plain = {k: v for k, v in data.items() if k != "states"}
    with pytest.raises(EejaxError, match="fuses 2 layers' states; the feature cache keeps 0"):
        train_draft(fused, plain, steps=1, progress=False)
    draft, losses, _ = train_draft(fused, data, steps=3, batch_size=4, learning_rate=1e-2, progress=False)
    assert np.isfinite(losses).all() and float(jnp.abs(draft["fuse"]).max()) > 0, losses


def test_the_continuations_budget_holds_the_batch_asked_for(model):
    """A trainer's generation batch gets the KV cache it needs (`generate`'s default 1 GiB would
    decode only part of a GPU's batch at a time), and small batches keep the default."""
    from eejax.cache import pages_for_budget, pages_needed
    from eejax.train.data import cache_budget_for

    per_page = model.page_bytes(16)
    assert cache_budget_for(model, [[5] * 40] * 3, 24, 2) == 1 << 30
    rows = [[5] * 40] * 200_000
    need = 1 + len(rows) * pages_needed(40 + 24, 16)
    assert pages_for_budget(cache_budget_for(model, rows, 24, len(rows)), per_page) >= need
    assert pages_for_budget(1 << 30, per_page) < need


# --- checkpoints and bad settings ------------------------------------------------------------------


def test_a_checkpoint_keeps_the_draft_head(model, tmp_path):
    eejax.save(model, tmp_path / "m")
    back = eejax.load(tmp_path / "m")
    assert back.cache_layers == model.config.num_layers + 1
    for a, b in zip(jax.tree.leaves(model.params["draft"]), jax.tree.leaves(back.params["draft"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_draft_settings(model):
    plain = tiny()
    with pytest.raises(EejaxError, match="needs a draft head"):
        eejax.generate(plain, PROMPTS[:1], max_new_tokens=2, spec="draft:2")
    with pytest.raises(EejaxError, match="cannot read speculation"):
        SpecConfig.parse("draft:x")
    with pytest.raises(EejaxError, match=r"'draft:2' \(draft\) takes no bonus, exit_layer"):
        SpecConfig.parse("draft:2", exit_layer=3, bonus=True)  # a draft head drafts from the last features
    assert SpecConfig.parse("draft:4:adaptive") == DraftChainSpec(4, adaptive=True)
    assert SpecConfig.parse("draft:4").spec == "draft:4"
    assert SpecConfig.parse("draft:4:stop=0.5") == DraftStopSpec(4, 0.5)
    assert SpecConfig.parse("draft:4:stop=0.5").spec == "draft:4:stop=0.5"
    assert SpecConfig.parse("draft:4:stop=0") == SpecConfig.parse("draft:4")  # 0: off
    assert SpecConfig.parse("draft:4:lookup") == DraftLookupSpec(4)
    for spelled in ("draft:4:lookup", "draft:4:adaptive:lookup", "draft:2:lookup=8"):
        assert SpecConfig.parse(spelled).spec == spelled
    assert SpecConfig.parse("draft:4:lookup:adaptive").spec == "draft:4:adaptive:lookup"
    assert SpecConfig.parse("draft:2:lookup=8").positions_ahead == 8  # the pages a round may write
    assert SpecConfig.parse("draft:4:lookup=0") == SpecConfig.parse("draft:4")  # 0: off
    for spec, message in (
        ("draft:4:stop=1.5", r"must lie in \[0, 1\]"),
        ("draft:4:stop=x", "η a number"),
        ("12:4:stop=0.5", "cannot read speculation"),
        ("12:4:lookup", "takes a draft head's chain"),
        ("draft:4:tree:lookup", "takes a draft head's chain"),
        ("draft:4:stop=0.3:lookup", "takes a draft head's chain"),
        ("draft:4:lookup:lookup", "cannot read speculation"),
        ("draft:4:lookup=x", "k must be integers"),
        ("draft:4:lookup=99", r"must lie in \[0, 64\]"),
        ("draft:4:stop=0.3:stop=0.4", "cannot read speculation"),
    ):
        with pytest.raises(EejaxError, match=message):
            SpecConfig.parse(spec)
    with pytest.raises(EejaxError, match="fixed chain"):
        SpecConfig.parse("draft:4:adaptive:stop=0.5")
    with pytest.raises(UnsupportedModelError, match="Llama"):
        draft_head.check_model(dataclasses.replace(plain.config, architecture="t5"))
    bad = {**model.params["draft"], "fc": model.params["draft"]["fc"][:3]}
    with pytest.raises(EejaxError, match="fc"):
        draft_head.check_draft(bad, model.config)


# --- the command and the shipped delta -------------------------------------------------------------


def test_an_average_of_draft_heads_is_their_weighted_mean_with_one_heads_tokens(tiny_checkpoints, tmp_path, capsys):
    """scripts/average_draft_heads.py (`train.draft_average`): each array the weighted mean of the
    heads' (bf16 as written), the reduced head's tokens of the head named, a probe that checks at
    load, speculation lossless; heads of other shapes, a file of another kind and weights that do
    not sum to 1 refused by name, and nothing written."""
    from eejax.loading.deltas import DRAFT_KIND, apply_draft, read_delta, write_delta
    from eejax.train.draft_average import average_arrays
    from eejax.train.draft_run import save_draft
    from scripts.average_draft_heads import main

    base = eejax.load(tiny_checkpoints["gqa-untied"][2])
    heads = [
        save_draft(tmp_path / f"head{seed}.safetensors", with_draft(base, seed), np.arange(8 * seed, 8 * seed + 24), {})
        for seed in (1, 2)
    ]
    out = tmp_path / "average.safetensors"
    argv = [*map(str, heads), "--weights", "0.25", "0.75", "--vocab-from", "2", "--output", str(out)]
    assert main([*argv, "--model", str(tiny_checkpoints["gqa-untied"][2])]) == 0
    (a, _), (b, _), (got, meta) = read_delta(heads[0]), read_delta(heads[1]), read_delta(out)
    assert meta["kind"] == DRAFT_KIND and meta["weights"] == [0.25, 0.75] and got.keys() == a.keys()
    for k in a.keys() - {"vocab_ids"}:
        want = 0.25 * np.asarray(a[k], np.float32) + 0.75 * np.asarray(b[k], np.float32)
        np.testing.assert_array_equal(np.asarray(got[k], np.float32), np.asarray(want.astype(a[k].dtype), np.float32))
    np.testing.assert_array_equal(got["vocab_ids"], b["vocab_ids"])
    averaged = apply_draft(base, out)  # the probe reproduces
    full = eejax.generate(base, ["The storm hit the coast."], max_new_tokens=8, ignore_eos=True, spec=None)
    assert (
        eejax.generate(averaged, ["The storm hit the coast."], max_new_tokens=8, spec="draft:2").tokens == full.tokens
    )
    with pytest.raises(EejaxError, match="shapes"):
        average_arrays([a, {**a, "draft/fc": a["draft/fc"][:1]}], [0.5, 0.5])
    with pytest.raises(EejaxError, match="sum to 1"):
        average_arrays([a, b], [0.5, 0.6])
    other = write_delta(tmp_path / "other.safetensors", a, {"kind": "lora"})
    for bad, message in (([str(heads[0]), str(other)], "not an eejax draft head"), ([str(heads[0])], "at least two")):
        with pytest.raises(SystemExit):
            main([*bad, "--weights", "1", *(["0"] if len(bad) == 2 else []), "--output", str(tmp_path / "bad")])
        assert message in capsys.readouterr().err and not (tmp_path / "bad").exists(), message
    with pytest.raises(SystemExit):  # an output that exists is never overwritten
        main(argv)
    assert "exists" in capsys.readouterr().err


def test_train_draft_command_writes_a_checked_delta(tiny_checkpoints, tmp_path, capsys, monkeypatch):
    from eejax.cli import main
    from eejax.loading import hub
    from eejax.loading.deltas import apply_draft

    path = tiny_checkpoints["gqa-untied"][2]
    out = tmp_path / "run"
    texts = [
        "The president said on Monday that the talks would go on.",
        "Officials in London announced a plan.",
        "A storm hit the coast overnight, and thousands lost power across the region.",
    ]
    argv = [
        "train-draft",
        "--model",
        str(path),
        "--prompt",
        *texts,
        "--output",
        str(out),
        "--steps",
        "6",
        "--batch-size",
        "2",
        "--window",
        "64",
        "--continuation-tokens",
        "8",
        "--prompt-lengths",
        "8,16",
        "--sampled-copies",
        "1",
        "--sampled-prompts",
        "all",
        "--generate-batch-size",
        "3",
        "--feature-batch-size",
        "3",
        "--vocab-size",
        "64",
        "--no-plot",
        "--quiet",
    ]
    assert main(argv) == 0
    assert "trained 6 steps" in capsys.readouterr().out
    sampled = json.loads((out / "continuations_sampled.json").read_text())["prompts"]
    greedy = json.loads((out / "continuations.json").read_text())["prompts"]
    assert sampled[: len(greedy)] == greedy  # every greedily continued prompt is sampled too
    trained = eejax.load(out / "model")
    base = eejax.load(path)
    full = eejax.generate(base, texts, max_new_tokens=9, ignore_eos=True, spec=None)
    assert eejax.generate(trained, texts, max_new_tokens=9, ignore_eos=True, spec="draft:2").tokens == full.tokens
    applied = apply_draft(base, out / "draft.safetensors")
    for a, b in zip(jax.tree.leaves(applied.params["draft"]), jax.tree.leaves(trained.params["draft"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(EejaxError, match="does not reproduce"):  # another model of the same shape
        apply_draft(eejax.load(tiny_checkpoints["gqa-tied"][2]), out / "draft.safetensors")
    # shipped as a known model: the hub applies the delta to its base once, into the cache
    monkeypatch.setenv("EEJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub, "ASSETS", out)
    monkeypatch.setitem(
        hub.KNOWN_MODELS, "tiny-eagle", hub.KnownModel(description="test", base=str(path), delta="draft.safetensors")
    )
    known = eejax.load("tiny-eagle")
    assert (tmp_path / "cache" / "models" / "tiny-eagle").is_dir() and known.cache_layers == base.config.num_layers + 1
    # a cache built from another delta (an older shipped head) is built again from the current one
    cached = tmp_path / "cache" / "models" / "tiny-eagle" / "eejax.json"
    digest = hashlib.sha256((out / "draft.safetensors").read_bytes()).hexdigest()
    assert json.loads(cached.read_text())["delta_sha256"] == digest
    cached.write_text(json.dumps({**json.loads(cached.read_text()), "delta_sha256": "an older head"}))
    assert eejax.load("tiny-eagle").cache_layers == known.cache_layers
    assert json.loads(cached.read_text())["delta_sha256"] == digest
    # a rerun with other settings is refused, naming them
    assert main(argv[:-4] + ["--vocab-size", "32", "--no-plot", "--quiet"]) == 2
    assert "settings" in capsys.readouterr().err


def test_bf16_draft_head_speculates_in_bf16(tiny_checkpoints):
    from eejax.loading.model import cast_floats
    from tests.helpers import assert_equal_until_a_near_tie
    from tests.test_bfloat16 import NEAR_TIE
    from tests.test_bfloat16 import PROMPTS as TEXTS

    bf16 = eejax.load(tiny_checkpoints["gqa-untied"][2], dtype=jnp.bfloat16)
    bf16 = bf16.with_params(cast_floats(with_draft(bf16).params, jnp.bfloat16))
    greedy = eejax.generate(bf16, TEXTS, max_new_tokens=10, ignore_eos=True, spec=None)
    res = eejax.generate(bf16, TEXTS, max_new_tokens=10, ignore_eos=True, spec="draft:3")
    assert_equal_until_a_near_tie(bf16, TEXTS, res.tokens, greedy.tokens, tol=NEAR_TIE)
