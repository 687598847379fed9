"""eejax Llama equals HF PyTorch: logits of a paged prefill + 8 decode steps, greedy tokens."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eejax
from eejax.cache import init_cache
from eejax.models import llama
from tests.helpers import TINY_CONFIGS, random_prompts

LENGTHS = [5, 17, 1, 11]
DECODE_STEPS = 8


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def eejax_logits(model, prompts, continuations, page_size):
    """Logits at every prompt position (one padded prefill) and after each decode token."""
    c = model.config
    b, t = len(prompts), max(map(len, prompts))
    total = t + DECODE_STEPS
    pages_per_row = -(-total // page_size)
    cache = init_cache(c.num_layers, 1 + b * pages_per_row, page_size, c.num_kv_heads, c.head_dim, jnp.float32)
    # Rows get interleaved pages, so a mix-up of rows or pages would show.
    table = (1 + np.arange(pages_per_row)[None, :] * b + np.arange(b)[:, None]).astype(np.int32)
    tokens = np.zeros((b, t), np.int32)
    lengths = np.array([len(p) for p in prompts], np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    batch = llama.token_batch(c, positions, positions < lengths[:, None], table, lengths, page_size)
    h, cache = llama.run_layers(model.params, llama.embed(model.params, tokens), cache, batch, c)
    prefill = np.asarray(llama.lm_head(model.params, h, c))
    steps = []
    seq_len = lengths.copy()
    for s in range(DECODE_STEPS):
        tok = np.array([[cont[s]] for cont in continuations], np.int32)
        batch = llama.token_batch(c, seq_len[:, None], np.ones((b, 1), bool), table, seq_len + 1, page_size)
        h, cache = llama.run_layers(model.params, llama.embed(model.params, tok), cache, batch, c)
        steps.append(np.asarray(llama.lm_head(model.params, h[:, 0], c)))
        seq_len = seq_len + 1
    return prefill, np.stack(steps, axis=1)


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
@pytest.mark.parametrize("page_size", [4, 16])
def test_logits_match_hf(tiny_checkpoints, kind, page_size):
    hf, _, path = tiny_checkpoints[kind]
    model = eejax.load(path)
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=1)
    rng = np.random.default_rng(2)
    continuations = [rng.integers(3, 300, DECODE_STEPS).tolist() for _ in prompts]
    prefill, decode = eejax_logits(model, prompts, continuations, page_size)
    for i, (p, cont) in enumerate(zip(prompts, continuations)):
        want = hf_logits(hf, p + cont)
        np.testing.assert_allclose(prefill[i, : len(p)], want[: len(p)], atol=1e-4, rtol=0, err_msg=f"prefill row {i}")
        np.testing.assert_allclose(
            decode[i], want[len(p) : len(p) + DECODE_STEPS], atol=1e-4, rtol=0, err_msg=f"decode row {i}"
        )


@pytest.mark.parametrize("kind", ["gqa-tied", "llama3-rope"])
def test_greedy_generate_matches_hf(tiny_checkpoints, kind):
    hf, _, path = tiny_checkpoints[kind]
    model = eejax.load(path)
    prompts = random_prompts(5, [3, 20, 9, 14, 7], seed=3)
    res = eejax.generate(model, prompts, max_new_tokens=24, ignore_eos=True, page_size=8)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=24,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert res.tokens[i] == out[0, len(p) :].tolist(), f"row {i}"
        assert res.exit_layers[i] == [model.config.num_layers] * 24
