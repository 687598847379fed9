"""Self-speculative decoding: lossless greedy, exact sampling distribution, the cache after a
round, the adaptive policy, bad settings."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import eejax
from eejax.cache import init_cache
from eejax.config import LlamaConfig
from eejax.decode import speculative, steps
from eejax.decode.sampling import SamplingParams
from eejax.errors import EejaxError
from eejax.models import llama
from eejax.options import LayerSkipSpec, SpecConfig, StepOptions
from tests.helpers import fixed_policy_costs, prefilled, random_prompts

# 8 rows of different lengths (one a single token) as one padded batch.
PROMPTS = random_prompts(8, [5, 17, 1, 11, 3, 9, 24, 2], vocab=60, seed=7)
NEW = 13  # not a multiple of d + 1 for any d used below
# d = 1, E = L - 1 among them; with the bonus pass, without it, and as the policy decides
SPECS = [LayerSkipSpec(1, 1), LayerSkipSpec(2, 3, bonus=True), LayerSkipSpec(3, 4), LayerSkipSpec(2, 3, bonus=False)]


def tiny(num_layers=4, vocab=64, scale=0.3, seed=0, eos=()):
    """A small random Llama (no tokenizer) with peaked distributions (large weights)."""
    c = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        eos_token_ids=eos,
    )
    return eejax.Model(c, llama.init_params(c, jax.random.PRNGKey(seed), scale=scale))


def perfect_drafts(model, exit_layer):
    """The model with layers >= exit_layer made the identity (their output projections zeroed):
    the draft after exit_layer layers then is the full model, and every draft is accepted."""
    layers = dict(model.params["layers"])
    for name in ("wo", "w_down"):
        layers[name] = layers[name].at[exit_layer:].set(0.0)
    return dataclasses.replace(model, params={**model.params, "layers": layers})


def with_eos(model, eos):
    return dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=tuple(eos)))


@pytest.fixture(scope="module")
def model():
    return tiny()


# --- greedy: identical to full depth --------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 8], ids=["batch1", "padded-batch8"])
def test_greedy_equals_full_depth(model, rows):
    prompts = PROMPTS[:rows]
    full = eejax.generate(model, prompts, max_new_tokens=NEW, ignore_eos=True)
    accepted = 0
    for spec in SPECS:
        res = eejax.generate(model, prompts, max_new_tokens=NEW, ignore_eos=True, spec=spec)
        assert res.tokens == full.tokens, spec
        assert all(len(t) == NEW for t in res.tokens)
        accepted += res.stats["accepted_tokens"]
        e, L = spec.exit_layer, model.config.num_layers
        assert all(layer in (e, L) for row in res.exit_layers for layer in row)
        assert sum(layer == e for row in res.exit_layers for layer in row) == res.stats["accepted_tokens"]
    assert accepted > 0  # some drafts were right, some wrong: both paths ran


def test_greedy_equals_full_depth_with_a_tokenizer(tiny_checkpoints):
    model = eejax.load(tiny_checkpoints["gqa-untied"][2])
    texts = ["The president said", "A", "Officials in the city of London announced on Monday that"]
    full = eejax.generate(model, texts, max_new_tokens=NEW, ignore_eos=True)
    for spec in ("1:2", "2:4"):
        res = eejax.generate(model, texts, max_new_tokens=NEW, ignore_eos=True, spec=spec)
        assert res.tokens == full.tokens and res.texts == full.texts, spec


def test_eos_inside_a_draft_stops_the_row_exactly(model):
    """All drafts accepted (identity upper layers): a row's EOS arrives as an accepted draft in
    the middle of a round, and nothing after it is emitted."""
    perfect = perfect_drafts(model, 2)
    full = eejax.generate(perfect, PROMPTS, max_new_tokens=NEW, ignore_eos=True)
    # A token whose first appearance in some row is its 7th token: inside a round for d = 4.
    row, stop = next((i, t[6]) for i, t in enumerate(full.tokens) if t.index(t[6]) == 6)
    eos_model = with_eos(perfect, [stop])
    want = [row[: row.index(stop) + 1] if stop in row else row for row in full.tokens]
    for spec in (LayerSkipSpec(2, 4), LayerSkipSpec(2, 1), LayerSkipSpec(3, 3), LayerSkipSpec(2, 4, bonus=False)):
        res = eejax.generate(eos_model, PROMPTS, max_new_tokens=NEW, spec=spec)
        assert res.tokens == want, spec
    res = eejax.generate(eos_model, PROMPTS, max_new_tokens=NEW, spec=LayerSkipSpec(2, 4, bonus=True))
    assert res.stats["acceptance_rate"] == 1.0
    # That row emits its EOS at token 7 = 1 (prefill) + 5 (round 1) + 1: an accepted draft of round 2.
    assert res.exit_layers[row] == [4, 2, 2, 2, 2, 4, 2]


@pytest.mark.parametrize("new", [1, 5, 12])
def test_never_more_tokens_than_asked(model, new):
    perfect = perfect_drafts(model, 1)
    full = eejax.generate(perfect, PROMPTS, max_new_tokens=new, ignore_eos=True)
    for spec in (LayerSkipSpec(1, 4), LayerSkipSpec(3, 6)):
        res = eejax.generate(perfect, PROMPTS, max_new_tokens=new, ignore_eos=True, spec=spec)
        assert res.tokens == full.tokens and all(len(t) == new for t in res.tokens), (spec, new)


def test_perfect_drafts_are_all_accepted_and_counted(model):
    perfect = perfect_drafts(model, 1)
    res = eejax.generate(perfect, PROMPTS[:3], max_new_tokens=11, ignore_eos=True, spec=LayerSkipSpec(1, 4, bonus=True))
    s, L = res.stats, perfect.config.num_layers
    assert s["acceptance_rate"] == 1.0
    # 10 decode tokens per row in rounds of 5 (4 drafts + 1): 2 rounds, 8 drafts per row.
    assert (s["rounds"], s["drafted_tokens"], s["accepted_tokens"]) == (6, 24, 24)
    assert s["tokens_per_round"] == 5.0
    # Each round: 5 draft passes of 1 layer + 1 verify pass of 3; the prefill token: L.
    assert s["mean_layers_per_token"] == pytest.approx((2 * (5 * 1 + 3) + L) / 11)
    assert res.exit_layers == [[L, 1, 1, 1, 1, L, 1, 1, 1, 1, L]] * 3
    # Without the bonus pass a round of 4 accepted drafts emits those 4: rounds of 4, 4 and 2.
    res = eejax.generate(
        perfect, PROMPTS[:3], max_new_tokens=11, ignore_eos=True, spec=LayerSkipSpec(1, 4, bonus=False)
    )
    s = res.stats
    assert (s["rounds"], s["accepted_tokens"], s["bonus_pass_rate"]) == (9, 30, 0.0)  # every token a draft
    assert s["mean_layers_per_token"] == pytest.approx((3 * (4 * 1 + 3) + L) / 11)
    assert res.exit_layers == [[L] + [1] * 10] * 3


def test_rows_accept_different_counts_in_one_batch(model):
    res = eejax.generate(model, PROMPTS, max_new_tokens=NEW, ignore_eos=True, spec=LayerSkipSpec(3, 3))
    accepted_per_row = {sum(layer == 3 for layer in row) for row in res.exit_layers}
    assert len(accepted_per_row) > 1


def test_small_cache_budget_runs_rows_in_turn(model):
    full = eejax.generate(model, PROMPTS, max_new_tokens=NEW, ignore_eos=True)
    res = eejax.generate(
        model,
        PROMPTS,
        max_new_tokens=NEW,
        ignore_eos=True,
        spec="2:3",
        batch_size=3,
        cache_budget=2 * 4 * 16 * 2 * 8 * 4 * 8,
    )
    assert res.tokens == full.tokens


# --- the cache after a round ----------------------------------------------------------------


def spec_round(model, state, cache, table, spec, max_new_tokens, temperature=0.0, counters=None):
    options = StepOptions(max_new_tokens, sampler=SamplingParams(temperature).sampler, spec=spec).round(
        spec.num_speculations, bonus=True
    )
    drafts, state, cache = speculative.draft(
        model.params, cache, state, table, config=model.config, options=options.drafting()
    )
    counters = speculative.SpecCounters.zeros(state.done.shape[0]) if counters is None else counters
    return speculative.verify(
        model.params, cache, state, drafts, counters, table, config=model.config, options=options.verifying()
    )


@pytest.mark.parametrize("spec", [LayerSkipSpec(1, 5), LayerSkipSpec(3, 2)], ids=lambda s: s.spec)
def test_accepted_positions_hold_the_full_depth_kv(model, spec):
    state0, cache0, table = prefilled(model, PROMPTS, max_new_tokens=20, pages_per_row=6)
    state, cache = state0, cache0
    for _ in range(2):
        state, cache, _ = spec_round(model, state, cache, table, spec, max_new_tokens=20)
    # Full-depth decode of the same (greedy, hence equal) tokens, one at a time.
    full_state, full_cache = state0, cache0
    for _ in range(int(np.max(state.num_generated)) - 1):
        full_state, full_cache = steps.decode(
            model.params, full_cache, full_state, table, config=model.config, options=StepOptions(20)
        )
    seq_len = np.asarray(state.seq_len)
    gen = np.asarray(state.num_generated)
    np.testing.assert_array_equal(
        np.asarray(state.tokens)[:, : gen.min()], np.asarray(full_state.tokens)[:, : gen.min()]
    )
    assert gen.min() >= 3 and gen.max() > 3  # 1 + at least 1 per round; some drafts were accepted
    k, v, fk, fv = map(np.asarray, (cache.k, cache.v, full_cache.k, full_cache.v))
    e = spec.exit_layer
    for row, n in enumerate(seq_len):
        for pos in range(int(n)):
            page, slot = int(table[row, pos // 8]), pos % 8
            # Draft layers ran exactly as a decode step does; the verify layers ran on d + 1
            # tokens at once (a different matmul shape), so those agree to rounding.
            np.testing.assert_array_equal(k[:e, :, page, slot], fk[:e, :, page, slot])
            np.testing.assert_array_equal(v[:e, :, page, slot], fv[:e, :, page, slot])
            np.testing.assert_allclose(k[e:, :, page, slot], fk[e:, :, page, slot], atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(v[e:, :, page, slot], fv[e:, :, page, slot], atol=1e-5, rtol=1e-5)


def test_a_round_touches_only_the_rows_own_pages(model):
    """Rows near max_new_tokens draft past their room: those positions go to the null page."""
    state, cache, table = prefilled(model, PROMPTS, max_new_tokens=3, pages_per_row=1, page_size=32)
    before_k = np.asarray(cache.k).copy()
    state, cache, _ = spec_round(model, state, cache, table, LayerSkipSpec(2, 6), max_new_tokens=3)
    after_k = np.asarray(cache.k)
    changed_pages = set(np.nonzero((after_k != before_k).any(axis=(0, 1, 3, 4)))[0].tolist())
    assert changed_pages <= set(np.asarray(table).ravel().tolist()) | {0}
    for row, p in enumerate(PROMPTS):
        page = int(table[row, 0])
        # Only positions < prompt + max_new_tokens - 1 (the room of 2 more tokens) were written.
        untouched = slice(len(p) + 2, 32)
        np.testing.assert_array_equal(after_k[:, :, page, untouched], before_k[:, :, page, untouched])
    assert set(np.asarray(state.num_generated).tolist()) <= {2, 3}


# --- sampling: the output distribution is the full model's ----------------------------------


def chi_square_p(counts, probs):
    """p-value of observed counts against expected probabilities (bins with small expectation
    merged into one)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return scipy_stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def test_rejection_sampling_gives_the_target_distribution():
    """Synthetic p and q far apart: the first two emitted tokens follow p_0 and p_1 (given the
    first was the accepted draft), while always accepting the drafts (biased) fails the test."""
    rng = np.random.default_rng(0)
    v, d, n = 12, 3, 40000
    p = rng.dirichlet(np.full(v, 0.5), size=d + 1).astype(np.float32)
    q = rng.dirichlet(np.full(v, 0.5), size=d).astype(np.float32)
    key_draft, key_accept, key_resample = jax.random.split(jax.random.PRNGKey(1), 3)
    drafts = jax.random.categorical(key_draft, jnp.log(jnp.asarray(q))[None], shape=(n, d)).astype(jnp.int32)
    pb, qb = jnp.broadcast_to(p, (n, d + 1, v)), jnp.broadcast_to(q, (n, d, v))
    accept_keys, resample_keys = jax.random.split(key_accept, n), jax.random.split(key_resample, n)
    accepted, tokens = jax.jit(speculative.speculative_sample)(pb, qb, drafts, accept_keys, resample_keys)
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    assert 0.05 < np.mean(accepted >= 1) < 0.95
    assert chi_square_p(np.bincount(tokens[:, 0], minlength=v), p[0]) > 1e-3
    # Given the first token came from an accepted draft, the second follows p_1.
    second = tokens[accepted >= 1, 1]
    assert chi_square_p(np.bincount(second, minlength=v), p[1]) > 1e-3
    # The check can fail: drafts accepted without the min(1, p/q) test follow q.
    assert chi_square_p(np.bincount(np.asarray(drafts)[:, 0], minlength=v), p[0]) < 1e-6
    # ... and so does an acceptance that skips the resampling from max(0, p - q).
    rejected_resampled_from_p = np.where(accepted >= 1, tokens[:, 0], rng.choice(v, size=n, p=p[0] / p[0].sum()))
    assert chi_square_p(np.bincount(rejected_resampled_from_p, minlength=v), p[0]) < 1e-6


def test_speculative_sampling_on_a_model_matches_its_softmax():
    """Many identical rows, one round at temperature 1 on a model with a 16-token vocabulary:
    the first emitted token is distributed as the full model's next-token softmax."""
    model = tiny(vocab=16, scale=0.6, seed=3)
    rows, prompt = 4096, [3, 7, 1, 12, 5]
    spec = LayerSkipSpec(2, 2)
    state, cache, table = prefilled(model, [prompt] * rows, max_new_tokens=4, temperature=1.0, pages_per_row=2)
    x0 = 9
    keys = jax.random.split(jax.random.PRNGKey(5), rows)  # rows draw independently
    state = dataclasses.replace(state, last_token=jnp.full((rows,), x0, jnp.int32), keys=keys)
    new_state, _, counters = jax.jit(spec_round, static_argnums=(0, 4, 5, 6))(model, state, cache, table, spec, 4, 1.0)
    first = np.asarray(new_state.tokens)[:, 1]
    # The full model's distribution after prompt + [x0], and the draft's (exit after 2 layers).
    h, _ = _full_hidden(model, prompt + [x0])
    p = np.asarray(jax.nn.softmax(llama.lm_head(model.params, h, model.config)))
    h2, _ = _full_hidden(model, prompt + [x0], stop=2)
    q = np.asarray(jax.nn.softmax(llama.lm_head(model.params, h2, model.config)))
    assert 0.5 * np.abs(p - q).sum() > 0.2  # the draft is wrong often enough to matter
    acceptance = np.asarray(counters.accepted).sum() / np.asarray(counters.drafted).sum()
    assert 0.1 < acceptance < 0.95
    assert chi_square_p(np.bincount(first, minlength=16), p) > 1e-3
    assert chi_square_p(np.bincount(first, minlength=16), q) < 1e-6


def _full_hidden(model, tokens, stop=None):
    """Hidden state of the last token after `stop` layers (all by default), computed densely."""
    c = model.config
    t = len(tokens)
    cache = init_cache(c.num_layers, 1 + 4, 16, c.num_kv_heads, c.head_dim, model.dtype)
    table = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    batch = llama.token_batch(c, positions, jnp.ones((1, t), bool), table, jnp.asarray([t]), 16)
    h, cache = llama.run_layers(
        model.params, llama.embed(model.params, jnp.asarray([tokens])), cache, batch, c, 0, stop
    )
    return h[0, -1], cache


def test_sampled_generation_is_seeded(model):
    a = eejax.generate(model, PROMPTS, max_new_tokens=NEW, temperature=0.8, seed=3, spec="2:3")
    b = eejax.generate(model, PROMPTS, max_new_tokens=NEW, temperature=0.8, seed=3, spec="2:3")
    c = eejax.generate(model, PROMPTS, max_new_tokens=NEW, temperature=0.8, seed=4, spec="2:3")
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert all(len(t) == NEW for t in a.tokens)


# --- adaptive speculation (the policy itself: tests/test_spec_policy.py) -------------------------


def test_adaptive_generation_is_lossless(model, monkeypatch):
    full = eejax.generate(model, PROMPTS, max_new_tokens=NEW, ignore_eos=True)
    res = eejax.generate(
        model, PROMPTS, max_new_tokens=NEW, ignore_eos=True, spec=LayerSkipSpec(3, 2, adaptive=True, max_speculations=5)
    )
    assert res.tokens == full.tokens
    assert 1 <= res.stats["mean_speculations"] <= 5
    # GPU-like costs (a draft pass 0.1, a verify 0.3 for any small d, a plain step 0.35): what
    # the policy chooses depends only on the acceptance the engine reads back.
    fixed_policy_costs(monkeypatch, draft_pass=0.1, verify=0.3, plain=0.35)
    perfect = perfect_drafts(model, 1)
    res = eejax.generate(
        perfect,
        PROMPTS,
        max_new_tokens=40,
        ignore_eos=True,
        spec=LayerSkipSpec(1, 1, adaptive=True, max_speculations=6),
    )
    assert res.stats["mean_speculations"] > 2  # all accepted: the policy lengthens the rounds
    # CPU-like costs where no round pays: plain full-depth steps, a probe round every few, same tokens.
    fixed_policy_costs(monkeypatch, draft_pass=1.0, verify=1.0, plain=1.0)
    res = eejax.generate(
        model, PROMPTS, max_new_tokens=NEW, ignore_eos=True, spec=LayerSkipSpec(3, 2, adaptive=True, max_speculations=5)
    )
    assert res.tokens == full.tokens
    s = res.stats
    assert 0.5 < s["plain_step_rate"] < 1 and s["rounds"] > 0
    decoded = s["generated_tokens"] - len(PROMPTS)
    assert s["tokens_per_round"] == pytest.approx(decoded * (1 - s["plain_step_rate"]) / s["rounds"])


# --- bad settings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,message",
    [
        (dict(exit_layer=0), "exit_layer must be an integer >= 1"),
        (dict(exit_layer=2, num_speculations=0), "num_speculations must be an integer >= 1"),
        (dict(exit_layer=2.5), "exit_layer must be an integer"),
        (dict(exit_layer=2, num_speculations=6, adaptive=True, max_speculations=4), "below num_speculations"),
    ],
)
def test_bad_spec_config(spec, message):
    with pytest.raises(EejaxError, match=message):
        LayerSkipSpec(**spec)


@pytest.mark.parametrize(
    "text,message",
    [
        ("4", "expected E:d"),
        ("a:b", "must be integers"),
        ("2:3:fast", "expected E:d"),
        ("0:3", ">= 1"),
    ],
)
def test_bad_spec_strings(text, message):
    with pytest.raises(EejaxError, match=message):
        SpecConfig.parse(text)


def test_bad_spec_for_the_model(model):
    with pytest.raises(EejaxError, match="must be below the model's 4 layers"):
        eejax.generate(model, PROMPTS, spec="4:2")
    with pytest.raises(EejaxError, match="not both"):
        eejax.generate(model, PROMPTS, spec="2:2", exit="static:2")
    assert SpecConfig.parse("3:4:adaptive") == LayerSkipSpec(3, 4, adaptive=True)
    assert LayerSkipSpec(3, 4, adaptive=True).spec == "3:4:adaptive"
