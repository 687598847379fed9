"""LayerSkip recipe: schedules against the paper's formulas, the training forward against the
paged inference path, counted compute (dropped layers, heads evaluated), LoRA merging, early
layers that learn, and resumable runs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eejax
from eejax.config import LlamaConfig
from eejax.errors import EejaxError
from eejax.loading.deltas import load_delta, save_delta
from eejax.models import llama
from eejax.models.lora import init_lora, merge_lora, with_lora
from eejax.train.forward import layer_states, layer_states_and_count
from eejax.train.layerskip import (
    DistillBatch,
    LayerSkipConfig,
    distill_loss,
    dropout_rates,
    enabled_exits,
    exit_loss_scales,
    label_batch,
    layerskip_train_step,
    skipped_layers,
)


def test_dropout_rates_follow_the_formula():
    p = dropout_rates(LayerSkipConfig(p_max=0.2), 0, 5)
    np.testing.assert_allclose(p, 0.2 * (np.exp(np.arange(5) * np.log(2) / 4) - 1), rtol=1e-6)
    assert p[0] == 0 and p[-1] == pytest.approx(0.2)
    cfg = LayerSkipConfig(p_max=0.2, dropout_curriculum=True, total_steps=100)
    assert dropout_rates(cfg, 0, 5).sum() == 0 and dropout_rates(cfg, 100, 5)[-1] == pytest.approx(0.2)
    # One draw per layer and step: the last layer drops at rate p_max, the first never.
    drops = np.mean([skipped_layers(LayerSkipConfig(p_max=0.5), t, 5) for t in range(2000)], axis=0)
    assert drops[0] == 0 and abs(drops[-1] - 0.5) < 0.04
    assert (
        skipped_layers(LayerSkipConfig(p_max=0.5), 7, 5).tolist()
        == skipped_layers(LayerSkipConfig(p_max=0.5), 7, 5).tolist()
    )


def test_exit_loss_scales():
    # e(l) = e_scale * sum_{i<=l} i; the last layer L-1 + e_scale * sum_{i<=L-2} i.
    s = exit_loss_scales(LayerSkipConfig(e_scale=1.0, curriculum="all"), 0, 4)
    e = np.array([0, 1, 3, 3 + 3])
    np.testing.assert_allclose(s, e / e.sum(), rtol=1e-6)
    rot = [exit_loss_scales(LayerSkipConfig(e_scale=1.0, rotation=2), t, 4) > 0 for t in range(2)]
    assert rot[0].tolist() == [False, False, True, True] and rot[1].tolist() == [False, True, False, True]
    grad = [
        exit_loss_scales(LayerSkipConfig(e_scale=1.0, curriculum="gradual", total_steps=8), t, 4) > 0
        for t in (0, 1, 2, 3)
    ]
    assert [g.sum() for g in grad] == [1, 2, 3, 3]  # layer 0 has e(0) = 0
    # Eligible exits (as layers run): the curriculum rotates over them only.
    cfg = LayerSkipConfig(e_scale=1.0, rotation=2, exit_layers=(3, 6, 9))
    on = [np.flatnonzero(exit_loss_scales(cfg, t, 12)).tolist() for t in range(3)]
    assert on == [[2, 8, 11], [5, 11], [2, 8, 11]]
    index, scale = enabled_exits(exit_loss_scales(cfg, 1, 12))
    assert index.tolist() == [5, 11] and scale.sum() == pytest.approx(1.0)
    with pytest.raises(EejaxError, match="unknown curriculum"):
        LayerSkipConfig(curriculum="random")
    with pytest.raises(EejaxError, match="exit layers must be distinct increasing"):
        LayerSkipConfig(exit_layers=(6, 3))
    with pytest.raises(EejaxError, match=r"layer counts in \[1, 11\]"):
        LayerSkipConfig(exit_layers=(3, 12)).eligible(12)


def test_distill_loss_keeps_the_teachers_tail():
    # A top-3 target of a 10-token teacher, its missing mass one more outcome: the teacher itself
    # scores 0 (no pull to sharpen), and any student scores its KL over the 4 outcomes.
    teacher = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 10))
    logp = jax.nn.log_softmax(teacher)
    top_logp, ids = jax.lax.top_k(logp, 3)
    batch = DistillBatch(jnp.zeros((2, 5), jnp.int32), jnp.full((2,), 5), jnp.ones((2, 5)), ids, jnp.exp(top_logp))
    assert abs(float(distill_loss(teacher, batch))) < 1e-6
    assert float(jnp.abs(jax.grad(distill_loss)(teacher, batch)).max()) < 1e-6
    student = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 10))
    q = np.asarray(jax.nn.softmax(student))
    q_top = np.take_along_axis(q, np.asarray(ids), -1)
    p_top = np.exp(np.asarray(top_logp))
    p4 = np.concatenate([p_top, 1 - p_top.sum(-1, keepdims=True)], -1)
    q4 = np.concatenate([q_top, 1 - q_top.sum(-1, keepdims=True)], -1)
    assert float(distill_loss(student, batch)) == pytest.approx(
        float(np.mean(np.sum(p4 * np.log(p4 / q4), -1))), rel=1e-5
    )
    # Targets summing to 1 (labels, a full distribution) have no rest: the plain KL.
    labels = label_batch(np.ones((1, 4), np.int32), np.array([4]))
    assert float(distill_loss(student[:1, :4], labels)) == pytest.approx(float(-np.log(q[0, :3, 1]).mean()), rel=1e-5)


def tiny_config(**kw):
    return LlamaConfig(
        **{
            **dict(
                vocab_size=32,
                hidden_size=32,
                intermediate_size=64,
                num_layers=4,
                num_heads=4,
                num_kv_heads=2,
                head_dim=8,
                max_position_embeddings=64,
                tie_embeddings=True,
            ),
            **kw,
        }
    )


def test_training_forward_matches_hf_and_the_paged_inference_path(tiny_checkpoints):
    """The cache-free forward gives HF's logits on padded rows, and with LoRA factors merged
    the token that `generate` (the paged path) emits first."""
    import torch

    from tests.helpers import random_prompts

    hf, _, path = tiny_checkpoints["gqa-untied"]
    base = eejax.load(path)
    prompts = random_prompts(3, [9, 16, 5])
    tokens = np.zeros((3, 16), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)

    def last_logits(params):
        states = layer_states(params, jnp.asarray(tokens), jnp.asarray(lengths), base.config)
        return np.asarray(llama.lm_head(params, states[-1], base.config))

    logits = last_logits(base.params)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0].numpy()
        np.testing.assert_allclose(logits[i, : len(p)], want, rtol=1e-4, atol=1e-4)
    factors = jax.tree.map(lambda x: x + 0.05, init_lora(base.params["layers"], 4, jax.random.PRNGKey(1)))
    model = eejax.Model(base.config, merge_lora(base.params, factors), base.tokenizer)
    first = np.argmax(last_logits(model.params)[np.arange(3), lengths - 1], -1)
    assert first.tolist() == [t[0] for t in eejax.generate(model, prompts, max_new_tokens=1).tokens]
    assert first.tolist() != [t[0] for t in eejax.generate(base, prompts, max_new_tokens=1).tokens]


def test_lora_merged_weights_give_the_unmerged_forwards_logits():
    c = tiny_config()
    params = llama.init_params(c, jax.random.PRNGKey(0), scale=0.2)
    factors = init_lora(params["layers"], 4, jax.random.PRNGKey(1))
    assert not any(np.any(np.asarray(v)) for k, v in factors.items() if k.endswith("_b"))  # an untrained LoRA is 0
    factors = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.PRNGKey(2), x.shape), factors)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 12)), jnp.int32)
    lengths = jnp.asarray([12, 7], jnp.int32)

    def logits(p):
        return np.asarray(llama.lm_head(p, layer_states(p, tokens, lengths, c)[-1], c))

    unmerged, merged = logits(with_lora(params, factors)), logits(merge_lora(params, factors))
    # x @ (W + a b) and x @ W + (x @ a) @ b round apart in float32: equal to ~1e-6, same argmax.
    np.testing.assert_allclose(merged, unmerged, rtol=1e-5, atol=1e-5)
    assert np.array_equal(merged.argmax(-1), unmerged.argmax(-1))
    assert np.abs(merged - logits(params)).max() > 0.1  # the factors do change the model
    with pytest.raises(EejaxError, match="lacks wk_a"):
        merge_lora(params, {k: v for k, v in factors.items() if k != "wk_a"})


def test_delta_round_trip(tmp_path):
    c = tiny_config()
    factors = init_lora(llama.init_params(c, jax.random.PRNGKey(0))["layers"], 2, jax.random.PRNGKey(1))
    save_delta(tmp_path / "d.safetensors", factors, {"exit_vocab_ids": np.arange(5, dtype=np.int32)}, {"base": "x"})
    back, extra, meta = load_delta(tmp_path / "d.safetensors")
    assert set(back) == set(factors) and all(np.array_equal(back[k], factors[k]) for k in factors)
    assert extra["exit_vocab_ids"].tolist() == [0, 1, 2, 3, 4] and meta == {"base": "x"}


def test_dropped_layers_and_disabled_exits_are_not_computed():
    c = tiny_config(num_layers=6)
    params = llama.init_params(c, jax.random.PRNGKey(0), scale=0.2)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 8)), jnp.int32)
    lengths = jnp.asarray([8, 5], jnp.int32)
    skip = jnp.asarray([False, True, False, False, True, False])
    states, computed = layer_states_and_count(params, tokens, lengths, c, skip)
    assert int(computed) == 4
    np.testing.assert_array_equal(states[1], states[0])  # a dropped layer passes its input on
    np.testing.assert_array_equal(states[4], states[3])
    assert not np.array_equal(states[2], states[1])
    # The step evaluates the head at the exits its schedule enables, and nowhere else.
    cfg = LayerSkipConfig(e_scale=1.0, rotation=2, exit_layers=(2, 3, 4, 5))
    optimizer = optax.sgd(0.0)
    trainable = {"layers": init_lora(params["layers"], 2, jax.random.PRNGKey(1))}
    opt_state = optimizer.init(trainable)
    batch = jax.tree.map(jnp.asarray, label_batch(tokens, lengths))
    for step in range(2):
        index, scale = enabled_exits(exit_loss_scales(cfg, step, 6))
        trainable, opt_state, _, (losses, layers_run, heads) = layerskip_train_step(
            trainable,
            opt_state,
            params,
            batch,
            skip,
            jnp.asarray(index),
            jnp.asarray(scale),
            config=c,
            optimizer=optimizer,
        )
        assert int(heads) == len(index) == 3 and losses.shape == (3,) and int(layers_run) == 4


def sum_sequences(n=64, length=16, vocab=32, seed=0):
    """A learnable language: each next token is the sum of the previous two, mod `vocab`."""
    rng = np.random.default_rng(seed)
    seqs = [[int(a), int(b)] for a, b in rng.integers(0, vocab, size=(n, 2))]
    for seq in seqs:
        for _ in range(length - 2):
            seq.append((seq[-1] + seq[-2]) % vocab)
    return jnp.asarray(seqs, jnp.int32), jnp.full((n,), length, jnp.int32)


def early_accuracy(params, config, tokens, lengths, layer):
    """Next-token accuracy of the shared head after `layer` layers."""
    states = layer_states(params, tokens, lengths, config)
    pred = np.asarray(jnp.argmax(llama.lm_head(params, states[layer - 1], config), -1))
    targets = np.roll(np.asarray(tokens), -1, axis=1)
    valid = np.arange(tokens.shape[1])[None] < (np.asarray(lengths) - 1)[:, None]
    return float(np.mean((pred == targets)[valid]))


def test_layerskip_raises_early_layer_accuracy_over_plain_fine_tuning():
    c = tiny_config()
    params0 = llama.init_params(c, jax.random.PRNGKey(0), scale=0.1)
    tokens, lengths = sum_sequences()
    batch = jax.tree.map(jnp.asarray, label_batch(tokens, lengths))

    def train(cfg):  # full fine-tuning: the whole params train, nothing is frozen
        optimizer = optax.adam(3e-3)
        params = jax.tree.map(jnp.copy, params0)  # the step donates what it trains
        opt_state = optimizer.init(params)
        for step in range(60):
            index, scale = enabled_exits(exit_loss_scales(cfg, step, 4))
            params, opt_state, _, _ = layerskip_train_step(
                params,
                opt_state,
                {"layers": {}},
                batch,
                jnp.asarray(skipped_layers(cfg, step, 4)),
                jnp.asarray(index),
                jnp.asarray(scale),
                config=c,
                optimizer=optimizer,
            )
        return params

    plain = train(LayerSkipConfig(p_max=0.0, e_scale=0.0, curriculum="all"))  # last-layer loss only
    layerskip = train(LayerSkipConfig(p_max=0.2, e_scale=1.0, curriculum="rotational", rotation=2, total_steps=60))
    for layer, margin in ((1, 0.05), (2, 0.3)):
        assert (
            early_accuracy(layerskip, c, tokens, lengths, layer)
            > early_accuracy(plain, c, tokens, lengths, layer) + margin
        )
    assert early_accuracy(layerskip, c, tokens, lengths, 4) > 0.9  # the last layer still learns the task


def test_lora_layerskip_run_resumes_to_the_uninterrupted_result(tmp_path):
    """LoRA training through `train_layerskip`: exits learn on a frozen model's factors, and a run
    stopped midway and started again ends where an uninterrupted run ends, bit for bit."""
    from eejax.train.distill import DistillData
    from eejax.train.layerskip_run import RunSettings, train_layerskip

    c = tiny_config()
    model = eejax.Model(c, llama.init_params(c, jax.random.PRNGKey(0), scale=0.1))
    tokens, lengths = sum_sequences(32)
    b = label_batch(tokens, lengths)
    data = DistillData(b.tokens, b.lengths, b.target_ids, b.target_probs.astype(np.float16))
    settings = RunSettings(
        steps=40,
        batch_size=8,
        learning_rate=3e-2,
        lora_rank=4,
        exit_positions=8,
        layerskip=LayerSkipConfig(p_max=0.2, e_scale=1.0, rotation=2, exit_layers=(1, 2, 3)),
    )
    whole, log, done = train_layerskip(model, data, settings, tmp_path / "a", progress=False)
    assert done and len(log["loss"]) == 40 and log["heads"][:2] == [2, 2] and log["loss"][-1] < log["loss"][0]

    class Stop(Exception):
        pass

    def stop_at_27(step, loss):
        if step == 26:
            raise Stop

    with pytest.raises(Stop):
        train_layerskip(model, data, settings, tmp_path / "b", save_every=10, progress=False, on_step=stop_at_27)
    resumed, log_b, done_b = train_layerskip(model, data, settings, tmp_path / "b", save_every=10, progress=False)
    assert done_b and log_b["loss"] == log["loss"]
    for k in whole["layers"]:
        np.testing.assert_array_equal(resumed["layers"][k], whole["layers"][k])
    # The frozen model is untouched; the trained exits beat the untrained model's early layers.
    trained = merge_lora(model.params, whole["layers"])
    assert early_accuracy(trained, c, tokens, lengths, 2) > early_accuracy(model.params, c, tokens, lengths, 2) + 0.1


def test_exported_delta_rebuilds_the_trained_model(tiny_model, tmp_path):
    """`export_run` writes the trained checkpoint and the delta; applying the delta to the base
    model gives the same model (checked by the recorded probe logits), and a different base is
    refused by name."""
    from eejax.loading.deltas import apply_delta, probe_logits
    from eejax.train.distill import DistillData
    from eejax.train.layerskip_run import RunSettings, export_run, train_layerskip
    from tests.helpers import random_prompts

    rows = random_prompts(8, [12, 16])
    tokens = np.zeros((8, 16), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    b = label_batch(tokens, [len(r) for r in rows])
    data = DistillData(b.tokens, b.lengths, b.target_ids, b.target_probs.astype(np.float16))
    settings = RunSettings(
        steps=3, batch_size=4, learning_rate=1e-2, lora_rank=2, layerskip=LayerSkipConfig(exit_layers=(1, 2))
    )
    trainable, _, _ = train_layerskip(tiny_model, data, settings, tmp_path / "ckpt", progress=False)
    export_run(tiny_model, trainable, settings, data, tmp_path, base_name="tiny", exit_vocab_size=64)
    saved = eejax.load(tmp_path / "model")
    rebuilt = apply_delta(tiny_model, tmp_path / "delta.safetensors")
    assert np.asarray(rebuilt.params["exits"]["exit_layers"]).tolist() == [1, 2]
    assert rebuilt.params["exits"]["vocab_ids"].shape == (64,)
    np.testing.assert_array_equal(probe_logits(rebuilt)[1], probe_logits(saved)[1])
    assert not np.array_equal(probe_logits(rebuilt)[1], probe_logits(tiny_model)[1])
    other = eejax.Model(tiny_model.config, jax.tree.map(lambda x: x * 1.01, tiny_model.params), tiny_model.tokenizer)
    with pytest.raises(EejaxError, match="does not reproduce the logits"):
        apply_delta(other, tmp_path / "delta.safetensors")


def test_known_model_built_from_a_base_and_a_shipped_delta(tiny_checkpoints, tmp_path, monkeypatch):
    """A known name with a delta: `eejax.load(name)` applies the delta to its base once and caches
    the result like a converted model."""
    from eejax.loading import hub
    from eejax.loading.deltas import apply_delta, probe_logits

    base_dir = tiny_checkpoints["gqa-tied"][2]
    base = eejax.load(base_dir)
    factors = jax.tree.map(lambda x: x + 0.02, init_lora(base.params["layers"], 2, jax.random.PRNGKey(3)))
    trained = eejax.Model(base.config, merge_lora(base.params, factors), base.tokenizer)
    ids, logits = probe_logits(trained)
    top = np.argsort(-logits)[:64]
    save_delta(
        tmp_path / "tiny-layerskip.safetensors",
        factors,
        {"exit_vocab_ids": np.arange(3, 40, dtype=np.int32)},
        {
            "base": "tiny",
            "settings": {"layerskip": {"exit_layers": [2]}},
            "probe_ids": ids,
            "probe_top_ids": top.tolist(),
            "probe_top_logits": logits[top].tolist(),
        },
    )
    monkeypatch.setenv("EEJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub, "ASSETS", tmp_path)
    monkeypatch.setitem(
        hub.KNOWN_MODELS,
        "tiny-layerskip",
        hub.KnownModel(description="test", base=str(base_dir), delta="tiny-layerskip.safetensors"),
    )
    loaded = eejax.load("tiny-layerskip")
    assert (tmp_path / "cache" / "models" / "tiny-layerskip").is_dir()
    assert np.asarray(loaded.params["exits"]["exit_layers"]).tolist() == [2]
    np.testing.assert_array_equal(
        probe_logits(loaded)[1], probe_logits(apply_delta(base, tmp_path / "tiny-layerskip.safetensors"))[1]
    )
