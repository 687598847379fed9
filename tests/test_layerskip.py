"""LayerSkip recipe: schedules against the paper's formulas, and early layers that predict better
than after plain fine-tuning for the same steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eejax.config import LlamaConfig
from eejax.errors import EejaxError
from eejax.models import llama
from eejax.train.exit_training import layer_states
from eejax.train.layerskip import LayerSkipConfig, dropout_rates, exit_loss_scales, layerskip_train_step


def test_dropout_rates_follow_the_formula():
    p = dropout_rates(LayerSkipConfig(p_max=0.2), 0, 5)
    np.testing.assert_allclose(p, 0.2 * (np.exp(np.arange(5) * np.log(2) / 4) - 1), rtol=1e-6)
    assert p[0] == 0 and p[-1] == pytest.approx(0.2)
    cfg = LayerSkipConfig(p_max=0.2, dropout_curriculum=True, total_steps=100)
    assert dropout_rates(cfg, 0, 5).sum() == 0 and dropout_rates(cfg, 100, 5)[-1] == pytest.approx(0.2)


def test_exit_loss_scales():
    # e(l) = e_scale * sum_{i<=l} i; the last layer L-1 + e_scale * sum_{i<=L-2} i.
    s = exit_loss_scales(LayerSkipConfig(e_scale=1.0, curriculum="all"), 0, 4)
    e = np.array([0, 1, 3, 3 + 3])
    np.testing.assert_allclose(s, e / e.sum(), rtol=1e-6)
    rot = [exit_loss_scales(LayerSkipConfig(e_scale=1.0, rotation=2), t, 4) > 0 for t in range(2)]
    assert rot[0].tolist() == [False, False, True, True] and rot[1].tolist() == [False, True, False, True]
    grad = [exit_loss_scales(LayerSkipConfig(e_scale=1.0, curriculum="gradual", total_steps=8), t, 4) > 0
            for t in (0, 1, 2, 3)]
    assert [g.sum() for g in grad] == [1, 2, 3, 3]  # layer 0 has e(0) = 0
    with pytest.raises(EejaxError, match="unknown curriculum"):
        LayerSkipConfig(curriculum="random")


def early_accuracy(params, config, tokens, lengths, layer):
    """Next-token accuracy of the shared head after `layer` layers."""
    states = layer_states(params, tokens, lengths, config)
    pred = np.asarray(jnp.argmax(llama.lm_head(params, states[layer - 1], config), -1))
    targets = np.roll(np.asarray(tokens), -1, axis=1)
    valid = np.arange(tokens.shape[1])[None] < (np.asarray(lengths) - 1)[:, None]
    return float(np.mean((pred == targets)[valid]))


def test_layerskip_raises_early_layer_accuracy_over_plain_fine_tuning():
    c = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                    head_dim=8, max_position_embeddings=64, tie_embeddings=True)
    params0 = llama.init_params(c, jax.random.PRNGKey(0), scale=0.1)
    # A learnable language: each next token is the sum of the previous two, mod 32.
    rng = np.random.default_rng(0)
    seqs = [[int(a), int(b)] for a, b in rng.integers(0, 32, size=(64, 2))]
    for seq in seqs:
        for _ in range(14):
            seq.append((seq[-1] + seq[-2]) % 32)
    tokens, lengths = jnp.asarray(seqs, jnp.int32), jnp.full((64,), 16, jnp.int32)

    def train(cfg):
        optimizer = optax.adam(3e-3)
        params, opt_state = params0, optimizer.init(params0)
        for step in range(60):
            rates = jnp.asarray(dropout_rates(cfg, step, 4))
            scales = jnp.asarray(exit_loss_scales(cfg, step, 4))
            params, opt_state, _ = layerskip_train_step(params, opt_state, tokens, lengths, rates, scales,
                                                        jax.random.PRNGKey(step), config=c, optimizer=optimizer)
        return params

    plain = train(LayerSkipConfig(p_max=0.0, e_scale=0.0, curriculum="all"))  # last-layer loss only
    layerskip = train(LayerSkipConfig(p_max=0.2, e_scale=1.0, curriculum="rotational", rotation=2, total_steps=60))
    # Measured: after 1 layer 0.24 vs 0.10, after 2 layers 0.87 vs 0.38.
    for layer, margin in ((1, 0.05), (2, 0.3)):
        assert early_accuracy(layerskip, c, tokens, lengths, layer) > early_accuracy(plain, c, tokens, lengths,
                                                                                      layer) + margin
    assert early_accuracy(layerskip, c, tokens, lengths, 4) > 0.9  # the last layer still learns the task
