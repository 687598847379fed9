"""Cheap exits: the reduced-vocabulary exit head, check layers and the segment loop, KV fill over
the skipped layers only, the bonus draft pass, and the cost model."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eejax
from eejax import cli
from eejax.checkpoint import load_checkpoint
from eejax.decode import cost, steps
from eejax.decode.confidence import softmax_margin, state_cosine
from eejax.decode.early_exit import early_exit_layers, kv_fill
from eejax.errors import EejaxError
from eejax.models import exits, llama
from eejax.options import ExitConfig, LayerSkipSpec
from eejax.train.exit_vocab import add_exit_vocab, count_tokens, most_frequent
from tests.helpers import prefilled
from tests.test_early_exit import NEW, PROMPTS, gen  # a padded batch of 4 (3 rows + 1 padding row)


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    """kind -> model with untrained exit classifiers, for the tied and the untied head."""
    return {kind: eejax.init_exits(eejax.load(tiny_checkpoints[kind][2])) for kind in ("gqa-tied", "gqa-untied")}


def reduced(model, k):
    """The model with a reduced head of the k tokens its own continuations of PROMPTS use most."""
    counts = count_tokens(model, PROMPTS, new_tokens=NEW, progress=False)
    return add_exit_vocab(model, most_frequent(counts, k, always=model.eos_token_ids))


# --- the reduced head ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gqa-tied", "gqa-untied"])
def test_a_reduced_head_of_the_whole_vocabulary_is_bit_identical(models, kind):
    model = models[kind]
    whole = reduced(model, model.config.vocab_size)
    np.testing.assert_array_equal(whole.params["exits"]["vocab_ids"], np.arange(model.config.vocab_size))
    full = gen(model, exit=ExitConfig("softmax", threshold=0.005, decay=None))
    assert {e for row in full.exit_layers for e in row} != {3}  # some tokens exit early
    for head, emit in (("reduced", "full"), ("reduced", "reduced")):
        res = gen(whole, exit=ExitConfig("softmax", threshold=0.005, decay=None, head=head, emit=emit))
        assert (res.tokens, res.exit_layers, res.confident_layers) == (
            full.tokens,
            full.exit_layers,
            full.confident_layers,
        ), (head, emit)
    x = jax.random.normal(jax.random.PRNGKey(1), (4, model.config.hidden_size))
    np.testing.assert_array_equal(
        steps.reduced_logits(whole.params, x, 2, model.config), steps.exit_logits(whole.params, x, 2, model.config)
    )
    if kind == "gqa-tied":
        return  # drafts: the untied head is enough
    spec_full = gen(model, spec=LayerSkipSpec(1, 3, head="full"))
    spec_whole = gen(whole, spec=LayerSkipSpec(1, 3, head="reduced"))
    assert spec_whole.tokens == spec_full.tokens
    assert spec_whole.stats["accepted_tokens"] == spec_full.stats["accepted_tokens"]  # the same drafts


@pytest.mark.parametrize("kind", ["gqa-tied", "gqa-untied"])
@pytest.mark.parametrize("rows", [1, 3], ids=["batch1", "padded-batch4"])
def test_self_speculation_with_a_reduced_head_equals_full_depth(models, kind, rows):
    model = reduced(models[kind], 256)
    ids = set(np.asarray(model.params["exits"]["vocab_ids"]).tolist())
    full = gen(model, PROMPTS[:rows])
    accepted = 0
    for spec in (LayerSkipSpec(1, 2), LayerSkipSpec(2, 3, bonus=True), LayerSkipSpec(2, 3, bonus=False)):
        res = gen(model, PROMPTS[:rows], spec=spec)
        assert res.tokens == full.tokens, spec
        accepted += res.stats["accepted_tokens"]
        drafted = [t for row, layers in zip(res.tokens, res.exit_layers) for t, e in zip(row, layers) if e < 3]
        assert set(drafted) <= ids  # accepted drafts come from the reduced vocabulary
    assert accepted > 0


def test_sampled_self_speculation_with_a_reduced_head_runs_per_row(models):
    model = reduced(models["gqa-untied"], 256)
    one = eejax.generate(model, PROMPTS[:1], max_new_tokens=NEW, temperature=0.8, seed=5, spec="1:2")
    batch = eejax.generate(model, PROMPTS, max_new_tokens=NEW, temperature=0.8, seed=5, spec="1:2")
    assert len(one.tokens[0]) == NEW and batch.tokens[0] == one.tokens[0]  # row 0 of any batch draws alike


def test_emitting_from_the_reduced_head_stays_in_its_vocabulary(models):
    model = reduced(models["gqa-untied"], 64)
    ids = set(np.asarray(model.params["exits"]["vocab_ids"]).tolist())
    res = gen(model, exit=ExitConfig("softmax", threshold=0.001, decay=None, emit="reduced"))
    early = [t for row, layers in zip(res.tokens, res.exit_layers) for t, e in zip(row, layers) if e < 3]
    assert early and set(early) <= ids


def test_most_frequent_keeps_eos_and_breaks_ties_by_id():
    counts = np.array([0, 5, 0, 7, 5, 1])
    np.testing.assert_array_equal(most_frequent(counts, 3), [1, 3, 4])
    np.testing.assert_array_equal(most_frequent(counts, 3, always=(2,)), [1, 2, 3])
    np.testing.assert_array_equal(most_frequent(np.zeros(6), 2), [0, 1])
    with pytest.raises(EejaxError, match=r"size must lie in \[1, 6\]"):
        most_frequent(counts, 7)


# --- check layers and the segment loop --------------------------------------------------------


def reference_exit(model, state, cache, table, config: ExitConfig, checks, threshold, reduced_checks=False):
    """Layer by layer in Python: (exit layer, confident layers [B], token [B]) of one step."""
    c, p = model.config, model.params
    active = ~np.asarray(state.done)
    batch = llama.token_batch(
        c, state.seq_len[:, None], jnp.asarray(active)[:, None], table, state.seq_len + active, cache.page_size
    )
    h = llama.embed(p, state.last_token[:, None])
    confident_at = np.zeros(len(active), int)
    exited = ~active
    for layer in range(c.num_layers):
        h_prev = h
        h, cache = llama.decoder_layer(p, h, cache, layer, batch, c)
        run = layer + 1
        if run in checks and not exited.all():
            if config.measure == "softmax":
                head = steps.reduced_logits if reduced_checks else steps.exit_logits
                conf = np.asarray(softmax_margin(head(p, h[:, 0], run, c)))
            else:
                conf = np.asarray(state_cosine(h_prev[:, 0], h[:, 0]))
            newly = conf > threshold
            confident_at = np.where(newly & ~exited & (confident_at == 0), run, confident_at)
            exited = exited | newly
            if exited.all():
                token = np.argmax(np.asarray(steps.exit_logits(p, h[:, 0], run, c)), axis=-1)
                return run, np.where(confident_at == 0, run, confident_at), token
    token = np.argmax(np.asarray(llama.lm_head(p, h[:, 0], c)), axis=-1)
    return c.num_layers, np.where(confident_at == 0, c.num_layers, confident_at), token


@pytest.mark.parametrize(
    "measure,checks,reduced_checks",
    [
        ("softmax", (1, 2), False),
        ("softmax", (2,), False),
        ("softmax", (1, 2), True),
        ("state", (1, 2), False),
        ("state", (2,), False),
    ],
)
def test_the_segment_loop_exits_where_a_per_layer_loop_does(models, measure, checks, reduced_checks):
    model = reduced(models["gqa-untied"], 128) if reduced_checks else models["gqa-untied"]
    c = model.config
    state, cache, table = prefilled(model, PROMPTS + [[7, 8]])
    active = ~state.done
    batch = llama.token_batch(
        c, state.seq_len[:, None], active[:, None], table, state.seq_len + active, cache.page_size
    )
    h0 = llama.embed(model.params, state.last_token[:, None])
    fns = steps.exit_fns(model.params, batch, c, check_reduced=reduced_checks)
    # Thresholds between the confidences the rows reach, so the batch exits at every check and at none.
    outcomes = set()
    thresholds = (0.0005, 0.002, 0.004, 0.006, 0.01, 0.5) if measure == "softmax" else (-0.9, 0, 0.2, 0.4, 0.6, 0.9)
    for threshold in thresholds:
        config = ExitConfig(
            measure, threshold=threshold, decay=None, exit_layers=checks, head="reduced" if reduced_checks else "full"
        )
        out = early_exit_layers(
            fns,
            h0,
            cache,
            active,
            jnp.full(active.shape, threshold),
            batch.pages,
            batch.slots,
            config=config,
            num_layers=c.num_layers,
            vocab_size=c.vocab_size,
            reuse_check_logits=measure == "softmax" and not reduced_checks,
        )
        want_exit, want_confident, want_token = reference_exit(
            model, state, cache, table, config, checks, threshold, reduced_checks
        )
        assert int(out.exit_layer) == want_exit, threshold
        live = np.asarray(active)
        np.testing.assert_array_equal(np.asarray(out.confident_layer)[live], want_confident[live])
        np.testing.assert_array_equal(np.argmax(np.asarray(out.logits), -1)[live], want_token[live])
        outcomes.add(want_exit)
    assert len(outcomes) >= 2  # the thresholds did move the exit


def test_check_layers_default_to_the_trained_exits(models):
    model = models["gqa-untied"]
    assert ExitConfig("softmax", threshold=0.5).check_layers(30) == tuple(range(1, 30))
    assert ExitConfig("softmax", threshold=0.5, min_exit_layer=20, every=4).check_layers(30) == (20, 24, 28)
    assert ExitConfig("softmax", threshold=0.5, exit_layers=[8, 16]).check_layers(30) == (8, 16)
    assert ExitConfig("static", exit_layer=8).check_layers(30) == ()
    assert ExitConfig("softmax", threshold=float("inf")).check_layers(30) == ()
    trained = {**model.params, "exits": {**model.params["exits"], "exit_layers": jnp.array([2], jnp.int32)}}
    resolved, _ = exits.resolve_options(trained, model.config, ExitConfig("softmax", threshold=0.001, decay=None))
    assert resolved.exit_layers == (2,)
    res = gen(dataclasses.replace(model, params=trained), exit=ExitConfig("softmax", threshold=0.001, decay=None))
    assert 2 in {e for row in res.exit_layers for e in row[1:]} <= {2, 3}  # never at 1, which is not checked
    every = gen(model, exit=ExitConfig("softmax", threshold=0.001, decay=None, exit_layers=(1, 2)))
    assert 1 in {e for row in every.exit_layers for e in row[1:]}
    explicit, _ = exits.resolve_options(trained, model.config, ExitConfig("softmax", threshold=0.5, exit_layers=[1]))
    assert explicit.exit_layers == (1,)


# --- KV fill over [E, L) ------------------------------------------------------------------------


def test_kv_fill_of_the_skipped_layers_writes_what_the_masked_fill_wrote(models):
    model = models["gqa-untied"]
    c, p = model.config, model.params
    state, cache, table = prefilled(model, PROMPTS + [[7, 8]])
    active = ~state.done
    batch = llama.token_batch(
        c, state.seq_len[:, None], active[:, None], table, state.seq_len + active, cache.page_size
    )
    h = jax.random.normal(jax.random.PRNGKey(2), (4, 1, c.hidden_size))
    fns = steps.exit_fns(p, batch, c)
    # The masked fill this replaced: every layer's K/V of h, written where layer >= E. (Computed
    # per layer: a vmapped projection rounds differently in the last bit.)
    kv = [llama.kv_of_layer(p, h, layer, batch, c) for layer in range(c.num_layers)]
    k_all, v_all = [x[0] for x in kv], [x[1] for x in kv]
    heads = jnp.arange(c.num_kv_heads)[:, None, None]
    for e in range(c.num_layers + 1):
        want_k, want_v = np.array(cache.k), np.array(cache.v)
        for layer in range(e, c.num_layers):
            want_k[layer][heads, batch.pages, batch.slots] = np.asarray(k_all[layer]).transpose(2, 0, 1, 3)
            want_v[layer][heads, batch.pages, batch.slots] = np.asarray(v_all[layer]).transpose(2, 0, 1, 3)
        got = kv_fill(
            cache,
            fns,
            h,
            jnp.int32(e),
            c.num_layers,
            batch.pages,
            batch.slots,
        )
        np.testing.assert_allclose(got.k, want_k, rtol=1e-6, atol=1e-6)  # the loop's matmuls may round apart
        np.testing.assert_allclose(got.v, want_v, rtol=1e-6, atol=1e-6)
        # Exactly the slots of the skipped layers changed, nothing else.
        np.testing.assert_array_equal(np.asarray(got.k) != np.asarray(cache.k), want_k != np.asarray(cache.k))
        # The GPU's fill from layer `first`, one batched projection and one write: the same bits,
        # and the layers in [first, E) wrote to the null page only.
        first = min(e, 1)
        fixed = kv_fill(
            cache,
            fns,
            h,
            jnp.int32(e),
            c.num_layers,
            batch.pages,
            batch.slots,
            first=first,
        )
        np.testing.assert_array_equal(np.asarray(fixed.k)[:, :, 1:], np.asarray(got.k)[:, :, 1:])
        np.testing.assert_array_equal(np.asarray(fixed.v)[:, :, 1:], np.asarray(got.v)[:, :, 1:])


# --- the cost model against hand counts ----------------------------------------------------------


def test_weight_counts_and_ideal_speedups_by_hand(models):
    model = reduced(models["gqa-untied"], 256)  # L 3, D 64, F 128, 4 heads of 16, 2 KV heads, V 320, untied
    w = cost.WeightCounts.of(model.params, model.config)
    layer = 64 + 64 * 64 + 2 * 64 * 32 + 64 * 64 + 64 + 2 * 64 * 128 + 128 * 64
    assert (w.layer, w.kv, w.head, w.reduced_head) == (layer, 64 + 2 * 64 * 32, 320 * 64 + 64, 256 * 64 + 64)
    assert w.classifier == 64 + 1 and w.adapter == 0
    full = 3 * layer + 320 * 64 + 64
    assert w.full_depth == full
    soft = ExitConfig("softmax", threshold=0.5, exit_layers=(1, 2))
    # Exit after 1 layer: 1 layer, 2 layers of KV fill, one reduced check, the full head for the token.
    assert cost.exit_step_weights(w, soft, 1, (1, 2), True, False) == layer + 2 * w.kv + w.reduced_head + w.head
    # No exit: 3 layers, both checks, the model's head.
    assert cost.exit_step_weights(w, soft, 3, (1, 2), True, False) == 3 * layer + 2 * w.reduced_head + w.head
    # Full-head checks: the exit's token reuses the last check's logits.
    assert cost.exit_step_weights(w, soft, 2, (1, 2), False, False) == 2 * layer + w.kv + 2 * w.head
    # Static: no check.
    assert cost.exit_step_weights(w, ExitConfig("static", exit_layer=2), 2, (), True, False) == (
        2 * layer + w.kv + w.head
    )
    # Speculation E = 1: 5 draft passes, 4 draft heads (reduced), 2 verify passes of 2 layers + the head.
    assert cost.spec_weights(w, 1, 5, 4, 2, True) == 5 * layer + 4 * w.reduced_head + 2 * (2 * layer + w.head)
    # generate's stats by the same count: static:2 reads the same weights for every decode token.
    res = gen(model, exit="static:2")
    assert res.stats["weights_per_token"] == 2 * layer + w.kv + w.head
    assert res.stats["ideal_speedup"] == pytest.approx(full / (2 * layer + w.kv + w.head))
    assert gen(model).stats["ideal_speedup"] == 1.0
    res = gen(model, spec=LayerSkipSpec(1, 2, bonus=True))
    s = res.stats
    decoded = s["generated_tokens"] - 3
    want = cost.spec_weights(w, 1, 3 * s["rounds"], 2 * s["rounds"], s["rounds"], True) / decoded
    assert s["weights_per_token"] == pytest.approx(want)


# --- bad input ---------------------------------------------------------------------------------


def test_bad_check_layers_and_missing_reduced_heads_are_named(models):
    model = models["gqa-untied"]
    for layers, match in (([2, 1], "increasing"), ([1, 1], "increasing"), ([0], ">= 1"), ([], ">= 1"), ([1.5], ">= 1")):
        with pytest.raises(EejaxError, match=match):
            ExitConfig("softmax", threshold=0.5, exit_layers=layers)
    with pytest.raises(EejaxError, match="not both"):
        ExitConfig("softmax", threshold=0.5, exit_layers=[1], min_exit_layer=2)
    with pytest.raises(EejaxError, match="below the model's 3 layers"):
        gen(model, exit=ExitConfig("softmax", threshold=0.5, exit_layers=[1, 3]))
    for option in (
        dict(exit=ExitConfig("softmax", threshold=0.5, head="reduced")),
        dict(exit=ExitConfig("static", exit_layer=1, emit="reduced")),
        dict(spec=LayerSkipSpec(1, 2, head="reduced")),
    ):
        with pytest.raises(EejaxError, match="eejax exit-vocab"):
            gen(model, **option)
    with pytest.raises(EejaxError, match=r"lie in \[0, 320\)"):
        exits.set_exit_vocab(model.params, [0, 320], tied=False)
    with pytest.raises(EejaxError, match="head must be one of"):
        LayerSkipSpec(1, 2, head="small")


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_exit_vocab_command_end_to_end(tiny_checkpoints, tmp_path, capsys):
    src = str(tiny_checkpoints["gqa-tied"][2])
    out = tmp_path / "reduced"
    prompts = ["The president said", "Officials in the city of London announced on Monday that"]
    code, stdout, _ = run_cli(
        capsys,
        "exit-vocab",
        "--model",
        src,
        "--prompt",
        *prompts,
        "--size",
        "256",
        "--continuation-tokens",
        "12",
        "--output",
        str(out),
        "--quiet",
    )
    assert code == 0 and "256 of 320 tokens" in stdout
    model = eejax.load(out)
    ids = np.asarray(model.params["exits"]["vocab_ids"])
    assert ids.shape == (256,) and 2 in ids and np.all(np.diff(ids) > 0)  # EOS kept, increasing
    meta = json.loads((out / "eejax.json").read_text())
    assert meta["exit_vocab"]["size"] == 256 and meta["exit_vocab"]["corpus"] == "continuations"
    base = eejax.load(src)
    assert gen(model, prompts, spec="1:2").tokens == gen(base, prompts).tokens
    # Bad input: one line, status 2.
    for argv, match in (
        (["--size", "321", "--output", str(tmp_path / "other")], "--size 321 must lie in [1, 320]"),
        (["--output", str(out)], "already exists"),
    ):
        code, _, err = run_cli(capsys, "exit-vocab", "--model", src, "--prompt", "x", *argv)
        assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli(
        capsys, "generate", "--model", src, "--prompt", "x", "--exit", "softmax:0.5", "--exit-head", "reduced"
    )
    assert code == 2 and "eejax exit-vocab" in err
    code, _, err = run_cli(
        capsys, "generate", "--model", src, "--prompt", "x", "--exit", "softmax:0.5", "--exit-layers", "2,1"
    )
    assert code == 2 and "increasing" in err
    # A head changed after exit-vocab ran: the stale reduced head is refused at load.
    _, params, _ = load_checkpoint(out)
    stale = {**params, "embed": params["embed"] * 2}
    eejax.save(eejax.Model(model.config, stale, model.tokenizer), tmp_path / "stale")
    with pytest.raises(EejaxError, match="run eejax exit-vocab again"):
        eejax.load(tmp_path / "stale")
