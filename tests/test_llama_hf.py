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


def hf_greedy(hf, prompt, new_tokens, **kw):
    """HF generate's greedy tokens for one prompt, EOS ignored (`kw`: its logits processors)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            **kw,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ["gqa-tied", "llama3-rope"])
def test_greedy_generate_matches_hf(tiny_checkpoints, kind):
    hf, _, path = tiny_checkpoints[kind]
    model = eejax.load(path)
    prompts = random_prompts(5, [3, 20, 9, 14, 7], seed=3)
    res = eejax.generate(model, prompts, max_new_tokens=24, ignore_eos=True, page_size=8)
    for i, p in enumerate(prompts):
        assert res.tokens[i] == hf_greedy(hf, p, 24), f"row {i}"
        assert res.exit_layers[i] == [model.config.num_layers] * 24


def penalised_greedy(hf, prompt, steps, presence=0.0, frequency=0.0, repetition=1.0):
    """Greedy tokens under the penalties, each step's logits from HF, the penalties in numpy."""
    ids, out = list(prompt), []
    for _ in range(steps):
        logits = hf_logits(hf, ids)[-1]
        counts = np.bincount(np.asarray(out, np.int64), minlength=logits.shape[0])
        seen = (counts > 0) | np.isin(np.arange(logits.shape[0]), prompt)
        r = np.float32(repetition)
        logits = np.where(seen, np.where(logits > 0, logits / r, logits * r), logits)
        logits = logits - np.float32(frequency) * counts.astype(np.float32) - np.float32(presence) * (counts > 0)
        out.append(int(np.argmax(logits)))
        ids.append(out[-1])
    return out


def test_penalties_match_hf_and_a_reference(tiny_checkpoints):
    """The repetition penalty gives HF generate's tokens; with frequency and presence penalties
    too, a step-by-step reference's (HF logits, the penalties in numpy); self-speculation with
    them gives the same tokens (lossless); without them, other tokens (they act)."""
    hf, _, path = tiny_checkpoints["gqa-tied"]
    model = eejax.load(path)
    prompts = random_prompts(4, [3, 20, 9, 14], seed=3)
    kw = dict(max_new_tokens=20, ignore_eos=True, page_size=8)
    plain = eejax.generate(model, prompts, **kw).tokens
    rep = eejax.generate(model, prompts, repetition_penalty=1.3, **kw).tokens
    mixed = dict(presence_penalty=0.4, frequency_penalty=0.6, repetition_penalty=1.1)
    res = eejax.generate(model, prompts, **mixed, **kw).tokens
    spec = eejax.generate(model, prompts, spec="1:3", **mixed, **kw).tokens
    for i, p in enumerate(prompts):
        assert rep[i] == hf_greedy(hf, p, 20, repetition_penalty=1.3), f"row {i}"
        assert res[i] == penalised_greedy(hf, p, 20, 0.4, 0.6, 1.1), f"row {i}"
        assert spec[i] == res[i] and plain[i] != res[i] and plain[i] != rep[i], f"row {i}"


def test_prompt_logprobs_match_hf_across_prefill_chunks(tiny_checkpoints):
    """A request's prompt log-probs (`prompt_logprobs`, OpenAI's echo) equal HF's log-softmax at
    each position, its top alternatives HF's, with the prompt prefilled in chunks of 8 and a
    cached prefix that the scored request must not share."""
    from eejax.engine.engine import Engine

    hf, _, path = tiny_checkpoints["gqa-tied"]
    model = eejax.load(path)
    prompt = random_prompts(1, [37], seed=8)[0]
    engine = Engine(model, max_slots=2, max_new_tokens=8, cache_budget="4MiB", page_size=8, prefill_chunk=8)
    first = engine.submit(prompt, max_new_tokens=3)
    engine.run()
    seq = engine.submit(prompt, max_new_tokens=3, prompt_logprobs=3)
    engine.run()
    assert seq.cached == 0 and seq.tokens == first.tokens
    want = torch.log_softmax(torch.tensor(hf_logits(hf, prompt)), -1).numpy()
    assert len(seq.prompt_token_logprobs) == len(prompt) and seq.prompt_token_logprobs[0] is None
    assert seq.prompt_top_logprobs[0] is None
    for p in range(len(prompt) - 1):
        np.testing.assert_allclose(seq.prompt_token_logprobs[p + 1], want[p, prompt[p + 1]], atol=1e-4)
        top = seq.prompt_top_logprobs[p + 1]
        assert [t for t, _ in top] == np.argsort(-want[p], kind="stable")[:3].tolist()
        np.testing.assert_allclose([lp for _, lp in top], np.sort(want[p])[::-1][:3], atol=1e-4)
