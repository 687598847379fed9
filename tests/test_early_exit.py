"""Early exit: the layer while_loop, KV fill, confidence measures, thresholds, exit modules."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eejax
from eejax.checkpoint import load_checkpoint, save_checkpoint
from eejax.decode import steps
from eejax.decode.early_exit import early_exit_layers
from eejax.errors import EejaxError
from eejax.models import llama
from eejax.options import ExitConfig, StepOptions
from tests.helpers import TINY_CONFIGS, prefilled, random_prompts

PROMPTS = random_prompts(3, [5, 14, 9], seed=3)  # a padded batch of 4 (3 rows + 1 padding row)
NEW = 10


def gen(model, batch=PROMPTS, **kw):
    return eejax.generate(model, batch, max_new_tokens=NEW, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def tiny_models(tiny_checkpoints):
    """kind -> model with untrained exit classifiers (so every measure can run)."""
    return {kind: eejax.init_exits(eejax.load(d)) for kind, (_, _, d) in tiny_checkpoints.items()}


# --- threshold = +inf, none, static at full depth: exactly the full-depth tokens --------------


@pytest.mark.parametrize(
    "kind,rows",
    [(k, 3) for k in TINY_CONFIGS] + [("gqa-untied", 1), ("llama3-rope", 1)],
    ids=[f"padded-batch4-{k}" for k in TINY_CONFIGS] + ["batch1-gqa-untied", "batch1-llama3-rope"],
)
def test_never_exiting_equals_full_depth(tiny_models, kind, rows):
    model = tiny_models[kind]
    L = model.config.num_layers
    full = gen(model, PROMPTS[:rows])
    specs = ["softmax:inf", f"static:{L}"]  # every architecture: the exit loop and head run, never exit
    if kind in ("gqa-untied", "llama3-rope"):  # every measure (they do not depend on the architecture)
        never = [ExitConfig(m, threshold=1.0, decay=None) for m in ("softmax", "classifier")]  # checked, never met
        specs += ["none", "state:inf", "classifier:inf", *never]
    for spec in specs:
        res = gen(model, PROMPTS[:rows], exit=spec)
        assert res.tokens == full.tokens, spec
        assert res.exit_layers == [[L] * NEW] * rows and res.stats["kv_fill_layers_per_token"] == 0


def test_minus_inf_exits_at_min_exit_layer(tiny_models):
    model = tiny_models["gqa-untied"]
    L = model.config.num_layers
    for measure in ("softmax", "state", "classifier"):
        for min_layer in (1, 2):
            res = gen(model, exit=ExitConfig(measure, threshold=-math.inf, min_exit_layer=min_layer))
            # The first token comes from the full-depth prefill.
            assert res.exit_layers == [[L] + [min_layer] * (NEW - 1)] * 3, (measure, min_layer)
            assert res.confident_layers == res.exit_layers
    res = gen(model, exit=ExitConfig("state", threshold=-math.inf, every=2))
    assert res.exit_layers == [[L] + [2] * (NEW - 1)] * 3
    s = res.stats
    assert s["mean_layers_per_token"] == pytest.approx((L + 2 * (NEW - 1)) / NEW)
    assert s["kv_fill_layers_per_token"] == pytest.approx(L - s["mean_layers_per_token"])


# --- one step, looked at directly ------------------------------------------------------------


def decode_step(model, state, cache, block_table, exit_config):
    return steps.decode(
        model.params, cache, state, block_table, config=model.config, options=StepOptions(8, exit=exit_config)
    )


def step_batch(model, state, block_table):
    active = ~state.done
    return llama.token_batch(
        model.config, state.seq_len[:, None], active[:, None], block_table, state.seq_len + active, 8
    )


def np_rms_norm(x, w, eps):
    x = np.asarray(x, np.float64)
    return np.asarray(w) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def np_rope(x, position, theta):
    """Rotate-half rotary for x [H, Dh] at one position."""
    dh = x.shape[-1]
    freqs = position / theta ** (np.arange(0, dh, 2) / dh)
    cos, sin = np.cos(np.concatenate([freqs, freqs])), np.sin(np.concatenate([freqs, freqs]))
    rotated = np.concatenate([-x[..., dh // 2 :], x[..., : dh // 2]], axis=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize(
    "spec,exit_at",
    [
        (ExitConfig("static", exit_layer=1), 1),
        (ExitConfig("static", exit_layer=2), 2),
        (ExitConfig("state", threshold=-math.inf, min_exit_layer=2), 2),
    ],
    ids=["static1", "static2", "state-min2"],
)
def test_kv_fill_writes_projections_of_the_exit_state(tiny_models, spec, exit_at):
    model = tiny_models["gqa-untied"]
    c, p = model.config, model.params
    state, cache, bt = prefilled(model, PROMPTS)
    full_state, full_cache = decode_step(model, state, cache, bt, None)
    ee_state, ee_cache = decode_step(model, state, cache, bt, spec)
    assert np.all(np.asarray(ee_state.exit_layers)[:, 1] == exit_at)

    batch = step_batch(model, state, bt)
    h_exit, _ = llama.run_layers(p, llama.embed(p, state.last_token[:, None]), cache, batch, c, 0, exit_at)
    h_exit = np.asarray(h_exit[:, 0], np.float64)
    layers = jax.tree.map(np.asarray, p["layers"])
    k_ee, v_ee, k_full, v_full = map(np.asarray, (ee_cache.k, ee_cache.v, full_cache.k, full_cache.v))
    written = np.zeros(k_ee.shape, bool)
    for row, pos in enumerate(np.asarray(state.seq_len)):
        page, slot = int(bt[row, pos // 8]), int(pos % 8)
        written[:, :, page, slot] = True
        for layer in range(c.num_layers):
            got_k, got_v = k_ee[layer, :, page, slot], v_ee[layer, :, page, slot]
            if layer < exit_at:  # the layers that ran hold what the full forward wrote
                np.testing.assert_array_equal(got_k, k_full[layer, :, page, slot])
                np.testing.assert_array_equal(got_v, v_full[layer, :, page, slot])
                continue
            x = np_rms_norm(h_exit[row], layers["attn_norm"][layer], c.rms_norm_eps)
            want_k = (x @ layers["wk"][layer]).reshape(c.num_kv_heads, c.head_dim)
            want_v = (x @ layers["wv"][layer]).reshape(c.num_kv_heads, c.head_dim)
            np.testing.assert_allclose(got_k, np_rope(want_k, pos, c.rope_theta), atol=1e-5)
            np.testing.assert_allclose(got_v, want_v, atol=1e-5)
    # Nothing else changed (the null page, which padding rows write into, aside).
    written[:, :, 0] = True
    np.testing.assert_array_equal(k_ee[~written], np.asarray(cache.k)[~written])


def test_static_step_equals_truncated_model(tiny_models):
    model = tiny_models["gqa-tied"]
    c, p = model.config, model.params
    state, cache, bt = prefilled(model, PROMPTS)
    batch = step_batch(model, state, bt)
    h0 = llama.embed(p, state.last_token[:, None])
    for e in range(1, c.num_layers + 1):
        out = early_exit_layers(
            steps.exit_fns(p, batch, c),
            h0,
            cache,
            ~state.done,
            jnp.zeros(3),
            batch.pages,
            batch.slots,
            config=ExitConfig("static", exit_layer=e),
            num_layers=c.num_layers,
            vocab_size=c.vocab_size,
        )
        h, _ = llama.run_layers(p, h0, cache, batch, c, 0, e)
        want = llama.lm_head(p, h[:, 0], c)
        assert int(out.exit_layer) == e
        np.testing.assert_allclose(out.logits, want, atol=1e-5)
        tokens = np.asarray(decode_step(model, state, cache, bt, ExitConfig("static", exit_layer=e))[0].last_token)
        np.testing.assert_array_equal(tokens, np.argmax(want, axis=-1))


def test_threshold_decay_moves_exits_earlier(tiny_models):
    """With decay, λ(t) falls over the generation, so exits can only come earlier than at constant λ."""
    model = tiny_models["gqa-untied"]
    const = gen(model, exit=ExitConfig("softmax", threshold=0.3, decay=None))
    decayed = gen(model, exit=ExitConfig("softmax", threshold=0.3, decay=8.0))
    assert decayed.stats["mean_layers_per_token"] <= const.stats["mean_layers_per_token"]


# --- exit modules in params["exits"] ----------------------------------------------------------


def test_identity_adapters_change_nothing_and_trained_ones_do(tiny_models):
    base = tiny_models["mha-untied"]
    spec = ExitConfig("static", exit_layer=1)
    want = gen(base, exit=spec).tokens
    adapted = eejax.init_exits(base, adapter_rank=8)
    assert gen(adapted, exit=spec).tokens == want
    e = dict(adapted.params["exits"])
    e["adapter_up"] = jax.random.normal(jax.random.PRNGKey(1), e["adapter_up"].shape) * 2.0
    changed = dataclasses.replace(adapted, params={**adapted.params, "exits": e}, programs=type(adapted.programs)())
    assert gen(changed, exit=spec).tokens != want
    # At full depth the model's own head is used: adapters never touch it.
    assert gen(changed, exit="none").tokens == gen(base).tokens


def test_exits_round_trip_through_a_checkpoint(tiny_models, tmp_path):
    model = eejax.init_exits(tiny_models["gqa-tied"], adapter_rank=4, seed=3)
    e = dict(model.params["exits"])
    e["classifier_b"] = jnp.array([-5.0, 5.0, 0.0])  # never after layer 1, always after layer 2
    model = dataclasses.replace(model, params={**model.params, "exits": e})
    save_checkpoint(tmp_path / "ck", model.config, model.params, model.tokenizer)
    config, params, _ = load_checkpoint(tmp_path / "ck")
    jax.tree.map(np.testing.assert_array_equal, params, model.params)
    loaded = eejax.load(tmp_path / "ck")
    res = gen(loaded, exit="classifier:0.5")
    assert res.exit_layers == [[3] + [2] * (NEW - 1)] * 3
    assert res.tokens == gen(model, exit="static:2").tokens


def test_bad_exit_settings_are_named(tiny_models):
    model = tiny_models["gqa-untied"]
    cases = [
        (lambda: ExitConfig("entropy", threshold=0.5), "unknown exit measure"),
        (lambda: ExitConfig("static"), "exit_layer"),
        (lambda: ExitConfig("static", exit_layer=0), "exit_layer"),
        (lambda: ExitConfig("softmax"), "needs a threshold"),
        (lambda: ExitConfig("softmax", threshold=float("nan")), "needs a threshold"),
        (lambda: ExitConfig("softmax", threshold=1.2), "[0, 1]"),
        (lambda: ExitConfig("state", threshold=-1.5), "[-1, 1]"),
        (lambda: ExitConfig("none", threshold=0.5), "takes no threshold"),
        (lambda: ExitConfig("softmax", threshold=0.5, exit_layer=2), "only for measure='static'"),
        (lambda: ExitConfig("softmax", threshold=0.5, decay=-1.0), "decay"),
        (lambda: ExitConfig("softmax", threshold=0.5, min_exit_layer=0), "min_exit_layer"),
        (lambda: ExitConfig("softmax", threshold=0.5, every=0), "every"),
        (lambda: ExitConfig.parse("softmax:high"), "as a number"),
        (lambda: ExitConfig.parse("static:"), "needs a value"),
        (lambda: gen(model, exit="static:4"), "deeper than the model"),
        (lambda: gen(model, exit=ExitConfig("state", threshold=0.5, min_exit_layer=9)), "deeper than the model"),
        (
            lambda: gen(
                dataclasses.replace(model, params={k: v for k, v in model.params.items() if k != "exits"}),
                exit="classifier:0.5",
            ),
            "init_exits",
        ),
        (
            lambda: gen(
                dataclasses.replace(
                    model,
                    params={**model.params, "exits": {"classifier_w": jnp.zeros((3, 7)), "classifier_b": jnp.zeros(3)}},
                ),
                exit="state:0.5",
            ),
            "shape",
        ),
        (lambda: eejax.init_exits(model, adapter_rank=65), "adapter_rank"),
    ]
    for make, needle in cases:
        with pytest.raises(EejaxError) as err:
            make()
        assert needle in str(err.value), (needle, str(err.value))
