"""Torch-free unit tests of early exit's decisions: the confidence measures and thresholds
against numpy, the exit modules' arithmetic, and the batch's exit on a crafted confidence table."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eejax.cache import init_cache
from eejax.decode import early_exit
from eejax.decode.confidence import exit_threshold, softmax_margin, state_cosine
from eejax.decode.early_exit import ExitFns, early_exit_layers
from eejax.models import exits
from eejax.options import ExitConfig


@pytest.mark.parametrize("gpu_loops", [False, True], ids=["cpu", "gpu"])
def test_flags_are_monotone_and_the_batch_waits_for_its_least_confident_row(monkeypatch, gpu_loops):
    """A crafted 4-layer model whose per-row, per-layer classifier confidence is a table; with a
    GPU's loops (`static_loops`) KV fill is one batched projection and one write, which must fill
    the same slots."""
    monkeypatch.setattr(early_exit, "static_loops", lambda: gpu_loops)
    num_layers, b = 4, 3
    conf = jnp.array(
        [
            [0.9, 0.1, 0.1, 0.1],  # row 0: confident after layer 1, then not: must stay exited
            [0.1, 0.2, 0.9, 0.1],  # row 1: first confident after 3 layers: the batch waits for it
            [0.1, 0.1, 0.1, 0.1],  # row 2: padding (inactive): never blocks the batch
        ]
    )

    def head(h, run):
        return jnp.concatenate([h[:, -1, :1], jnp.full((b, 1), run, jnp.float32)], axis=-1)

    fns = ExitFns(
        run_layers=lambda h, cache, start, stop=None, length=None: (
            h + (length if stop is None else stop - start),
            cache,
        ),
        exit_logits=head,
        check_logits=head,
        emit_logits=head,
        exit_prob=lambda h, run: conf[jnp.arange(b), run - 1],
        layer_kv=lambda layer, h: ((100.0 + layer) * jnp.ones((b, 1, 1, 2)),) * 2,
        layers_kv=lambda start, stop, h: (
            ((100.0 + jnp.arange(start, stop))[:, None, None, None, None] * jnp.ones((1, b, 1, 1, 2)),) * 2
        ),
    )
    cache = init_cache(num_layers, 4, 2, 1, 2, jnp.float32)
    pages, slots = jnp.array([[1], [2], [0]]), jnp.array([[1], [0], [0]])
    out = early_exit_layers(
        fns,
        jnp.zeros((b, 1, 1)),
        cache,
        jnp.array([True, True, False]),
        jnp.full((b,), 0.5),
        pages,
        slots,
        config=ExitConfig("classifier", threshold=0.5),
        num_layers=num_layers,
        vocab_size=2,
    )
    assert int(out.exit_layer) == 3
    np.testing.assert_array_equal(out.confident_layer, [1, 3, 3])
    np.testing.assert_array_equal(out.logits, [[3, 3]] * 3)  # the head saw h after 3 layers
    k = np.asarray(out.cache.k)
    assert k[3, 0, 1, 1, 0] == 103 and k[3, 0, 2, 0, 0] == 103  # the skipped layer was filled
    assert not k[:3, :, 1:].any()  # layers that ran are not overwritten by the fill (a GPU's: page 0)


def test_measures_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 37)).astype(np.float32) * 3
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.sort(probs, -1)
    np.testing.assert_allclose(softmax_margin(jnp.asarray(logits)), top[:, -1] - top[:, -2], atol=1e-6)

    a, b = rng.normal(size=(2, 5, 16)).astype(np.float32)
    b[0] = 2.5 * a[0]  # parallel: cosine 1
    want = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    np.testing.assert_allclose(state_cosine(jnp.asarray(a), jnp.asarray(b)), want, atol=1e-6)

    e = exits.init_exits(3, 16, jax.random.PRNGKey(0), adapter_rank=4)
    e = {k: jnp.asarray(rng.normal(size=v.shape).astype(np.float32)) for k, v in e.items()}
    h = rng.normal(size=(5, 16)).astype(np.float32)
    normalised = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + exits.EPS)
    w, bias = np.asarray(e["classifier_w"][1]), float(e["classifier_b"][1])
    np.testing.assert_allclose(
        exits.classifier_prob(e, jnp.asarray(h), 1), 1 / (1 + np.exp(-(normalised @ w + bias))), atol=1e-6
    )
    x = normalised * np.asarray(e["adapter_norm"][2])
    want = h + x @ np.asarray(e["adapter_down"][2]) @ np.asarray(e["adapter_up"][2])
    np.testing.assert_allclose(exits.adapt(e, jnp.asarray(h), 2), want, atol=1e-4)


def test_decaying_threshold_matches_calm():
    t = jnp.arange(0, 64, 7)
    for lam, tau in [(0.9, 4.0), (0.5, 1.0), (1.0, 4.0), (0.0, 2.0)]:
        want = np.clip(0.9 * lam + 0.1 * np.exp(-tau * np.arange(0, 64, 7) / 64), 0, 1)
        got = exit_threshold(ExitConfig("softmax", threshold=lam, decay=tau), t, 64)
        np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_array_equal(
        exit_threshold(ExitConfig("state", threshold=0.7, decay=None), t, 64), np.float32(0.7)
    )
    for lam in (math.inf, -math.inf):
        np.testing.assert_array_equal(exit_threshold(ExitConfig("softmax", threshold=lam), t, 64), lam)
