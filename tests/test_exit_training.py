"""Exit adapters trained by self-distillation on a frozen backbone."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eejax
from eejax.config import LlamaConfig
from eejax.decode.steps import exit_logits
from eejax.errors import EejaxError
from eejax.models import llama
from eejax.train.data import exit_batch
from eejax.train.exit_training import layer_states, layer_weights, train_step
from tests.helpers import random_prompts


def tiny_model():
    c = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    return eejax.init_exits(
        eejax.Model(c, llama.init_params(c, jax.random.PRNGKey(0), scale=0.3)), adapter_rank=32, classifier=False
    )


def batch(n=8, seed=0):
    rows = random_prompts(n, [12, 20, 7, 16], vocab=60, seed=seed)
    t = max(map(len, rows))
    tokens = np.zeros((n, t), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return jnp.asarray(tokens), jnp.asarray([len(r) for r in rows], jnp.int32)


def agreement(model, exit_params, tokens, lengths, layers_run):
    """Share of valid tokens where exit `layers_run` picks the last layer's argmax."""
    params = {**model.params, "exits": exit_params}
    states = layer_states(params, tokens, lengths, model.config)
    full = jnp.argmax(llama.lm_head(params, states[-1], model.config), -1)
    early = jnp.argmax(exit_logits(params, states[layers_run - 1], layers_run, model.config), -1)
    valid = np.arange(tokens.shape[1])[None] < np.asarray(lengths)[:, None]
    return float(np.mean(np.asarray(full == early)[valid]))


def test_layer_states_end_in_the_models_last_hidden_state():
    model = tiny_model()
    tokens, lengths = batch(4)
    states = layer_states(model.params, tokens, lengths, model.config)
    assert states.shape == (4, 4, tokens.shape[1], 32)
    # The prefill's logits of each row's last prompt token come from the same last state.
    logits = llama.lm_head(model.params, states[-1], model.config)
    res = eejax.generate(model, [list(map(int, tokens[i, : lengths[i]])) for i in range(4)], max_new_tokens=1)
    np.testing.assert_array_equal(
        np.argmax(np.asarray(logits)[np.arange(4), np.asarray(lengths) - 1], -1), [t[0] for t in res.tokens]
    )


def test_training_moves_only_the_exits_and_raises_agreement():
    model = tiny_model()
    tokens, lengths = batch(128)
    test_tokens, test_lengths = batch(32, seed=1)
    optimizer = optax.adam(1e-2)
    exit_params = model.params["exits"]
    opt_state = optimizer.init(exit_params)
    weights = jnp.asarray(layer_weights("calm", 4))
    exit_layers = jnp.arange(1, 4, dtype=jnp.int32)
    train_batch = exit_batch((tokens, lengths), None, None)
    backbone = jax.tree.map(np.asarray, {k: v for k, v in model.params.items() if k != "exits"})
    before = [agreement(model, exit_params, test_tokens, test_lengths, e) for e in (1, 2)]
    losses = []
    for _ in range(200):
        exit_params, opt_state, loss = train_step(
            exit_params,
            opt_state,
            model.params,
            train_batch,
            exit_layers,
            weights,
            config=model.config,
            optimizer=optimizer,
        )
        losses.append(float(loss))
    after = [agreement(model, exit_params, test_tokens, test_lengths, e) for e in (1, 2)]
    assert losses[-1] < 0.7 * losses[0]
    # Held-out sequences of a random model: exits 1 and 2 agree with the last layer more often
    # (measured 0.10 -> 0.17 and 0.24 -> 0.33).
    assert all(a > b + 0.05 for a, b in zip(after, before)), (before, after)
    for name, value in backbone.items():  # bit for bit
        jax.tree.map(np.testing.assert_array_equal, value, jax.tree.map(np.asarray, model.params[name]))
    assert not np.array_equal(np.asarray(exit_params["adapter_up"]), np.asarray(model.params["exits"]["adapter_up"]))


def test_cross_entropy_term_adds_the_exits_weighted_nll():
    from eejax.train.exit_training import distillation_loss, next_tokens

    model = tiny_model()
    tokens, lengths = batch(4)
    states = layer_states(model.params, tokens, lengths, model.config)
    valid = np.arange(tokens.shape[1])[None] < np.asarray(lengths)[:, None]
    labels = next_tokens(tokens, lengths)
    exit_layers, w = jnp.asarray([1, 3]), jnp.asarray([0.25, 0.75])
    args = (model.params["exits"], model.params, states, jnp.asarray(valid), exit_layers, w, model.config, labels)
    nll = 0.0
    for e, we in zip((1, 3), (0.25, 0.75)):
        logp = np.asarray(jax.nn.log_softmax(exit_logits(model.params, states[e - 1], e, model.config)))
        has = valid & (np.asarray(labels) >= 0)
        picked = np.take_along_axis(logp, np.maximum(np.asarray(labels), 0)[..., None], -1)[..., 0]
        nll += we * -picked[has].mean()
    assert has.sum() == valid.sum() - 4  # each row's last token has no next token
    diff = float(distillation_loss(*args, ce_weight=2.0)) - float(distillation_loss(*args, ce_weight=0.0))
    assert diff == pytest.approx(2.0 * nll, rel=1e-5)


def test_layer_weights():
    np.testing.assert_allclose(layer_weights("calm", 4), [1 / 6, 2 / 6, 3 / 6])
    np.testing.assert_allclose(layer_weights("layerskip", 4), [1 / 10, 3 / 10, 6 / 10])
    np.testing.assert_allclose(layer_weights("uniform", 3), [0.5, 0.5])
    np.testing.assert_allclose(layer_weights("calm", 30, [8, 16]), [1 / 3, 2 / 3])
    with pytest.raises(EejaxError, match="unknown layer weights"):
        layer_weights("linear", 4)


def test_training_resumes_from_a_checkpoint_to_the_same_state(tmp_path):
    from eejax.train.loop import train_exit_adapters

    model = tiny_model()
    batches = [batch(8, seed=s) for s in range(3)]
    opts = dict(steps=12, learning_rate=1e-2, exit_layers=[1, 3], positions_per_row=5, progress=False)
    whole, whole_losses, start = train_exit_adapters(model, batches, **opts)
    assert start == 0
    # Interrupted during step 10 (the last checkpoint, every 4 steps, is at 8), then rerun.
    ckpt = tmp_path / "ckpt"

    def interrupt(step, loss):
        if step == 9:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_exit_adapters(model, batches, **opts, checkpoint_dir=ckpt, save_every=4, on_step=interrupt)
    resumed, resumed_losses, start = train_exit_adapters(model, batches, **opts, checkpoint_dir=ckpt, save_every=4)
    assert start == 8  # it resumed, it did not start over
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, resumed), jax.tree.map(np.asarray, whole))
    np.testing.assert_array_equal(resumed_losses, whole_losses)
    assert not np.array_equal(np.asarray(whole["adapter_up"]), np.asarray(model.params["exits"]["adapter_up"]))


def gated_model(z: int = 5):
    """A 3-layer model whose upper two layers change the prediction only for even input tokens:
    the embedding's coordinate 0 is +20 for even tokens and -20 for odd ones (layer 0 never writes
    it), the upper layers' attention writes nothing and their MLP adds a push towards token z
    (odd) in proportion to silu(4 n_0) n_0, n_0 the normalised coordinate 0: large for even
    tokens, ~0 for odd ones. So exit 1 agrees with the last layer exactly on odd tokens, and a
    linear classifier on the normalised state can tell."""
    c = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    p = jax.tree.map(np.array, llama.init_params(c, jax.random.PRNGKey(3), scale=0.3))
    p["embed"][:, 0] = np.where(np.arange(64) % 2 == 0, 20.0, -20.0)
    lay = p["layers"]
    lay["wo"][0][:, 0] = 0
    lay["w_down"][0][:, 0] = 0
    push = p["lm_head"][:, z].copy()
    push[0] = 0
    for layer in (1, 2):
        lay["wo"][layer] = 0
        lay["w_gate"][layer] = 0
        lay["w_gate"][layer][0] = 4.0
        lay["w_up"][layer] = 0
        lay["w_up"][layer][0] = 1.0
        lay["w_down"][layer] = np.broadcast_to(push / 64, (64, 32))
    params = jax.tree.map(jnp.asarray, p)
    return eejax.init_exits(eejax.Model(c, params), adapter_rank=0, classifier=True)


def auc(scores, labels) -> float:
    """Area under the ROC curve (Mann-Whitney U over ranks)."""
    ranks = np.argsort(np.argsort(scores)) + 1
    pos = labels.sum()
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * (len(labels) - pos)))


def test_calm_classifier_learns_when_exit_agrees_and_exits_losslessly():
    from eejax.models import exits as exit_modules
    from eejax.train.exit_training import classifier_train_step

    model = gated_model()
    tokens, lengths = batch(64, seed=2)
    test_tokens, test_lengths = batch(32, seed=3)
    optimizer = optax.adam(5e-2)
    exit_params = model.params["exits"]
    opt_state = optimizer.init(exit_params)
    for _ in range(60):
        exit_params, opt_state, loss = classifier_train_step(
            exit_params, opt_state, model.params, tokens, lengths, config=model.config, optimizer=optimizer
        )
    trained = eejax.Model(model.config, {**model.params, "exits": exit_params})
    # Held-out tokens: the label of exit 1 is "its argmax equals the last layer's".
    states = layer_states(model.params, test_tokens, test_lengths, model.config)
    full = np.asarray(jnp.argmax(llama.lm_head(model.params, states[-1], model.config), -1))
    early = np.asarray(jnp.argmax(exit_logits(model.params, states[0], 1, model.config), -1))
    valid = np.arange(test_tokens.shape[1])[None] < np.asarray(test_lengths)[:, None]
    labels = (full == early)[valid]
    assert 0.3 < labels.mean() < 0.7  # both classes well represented
    prob = np.asarray(exit_modules.classifier_prob(exit_params, states[0], 0))[valid]
    untrained = np.asarray(exit_modules.classifier_prob(model.params["exits"], states[0], 0))[valid]
    assert np.all(untrained == 0.5) and auc(prob, labels) > 0.95, auc(prob, labels)
    # Only the classifiers moved.
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.tree.map(np.asarray, trained.params["layers"]),
        jax.tree.map(np.asarray, model.params["layers"]),
    )
    # Decoding with the trained classifier exits after 1 layer where the upper layers would not
    # change the token: the same tokens as full depth, with fewer layers.
    prompts = random_prompts(4, [6, 9, 3, 12], vocab=60, seed=4)
    full_res = eejax.generate(trained, prompts, max_new_tokens=12, batch_size=1)
    exit_res = eejax.generate(trained, prompts, max_new_tokens=12, batch_size=1, exit="classifier:0.9")
    assert exit_res.tokens == full_res.tokens
    assert exit_res.stats["mean_layers_per_token"] < 2.7, exit_res.stats
