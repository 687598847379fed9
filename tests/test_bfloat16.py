"""bf16 end to end on a tiny Llama: weights and KV cache in bf16 (norms, attention softmax,
matmul accumulation and logits in float32), logits close to float32, and self-speculation
token-identical to bf16 full-depth greedy up to rounding at a near-tie (see "bf16" in docs/benchmarks.md
for what lossless means)."""

import jax
import jax.numpy as jnp
import numpy as np

import eejax
from conversion import convert
from eejax.engine.engine import Engine
from tests.helpers import assert_equal_until_a_near_tie, random_prompts, sequence_logits

PROMPTS = random_prompts(4, [6, 19, 3, 11], seed=11)
NEAR_TIE = 0.01  # logits of this tiny random model have a std of ~0.9 (SmolLM2: ~7, and a tolerance of 0.1)


def test_bf16_checkpoint_decodes_with_a_bf16_cache_close_to_float32(tiny_checkpoints, tmp_path):
    _, hf_dir, f32_dir = tiny_checkpoints["gqa-untied"]
    f32 = eejax.load(f32_dir)
    bf16 = eejax.load(convert(hf_dir, tmp_path / "bf16", dtype="bfloat16", progress=False))
    assert {x.dtype for x in jax.tree.leaves(bf16.params)} == {jnp.dtype(jnp.bfloat16)}
    engine = Engine(bf16, max_slots=2, max_new_tokens=8, cache_budget="1MiB", page_size=8)
    assert engine.cache.k.dtype == engine.cache.v.dtype == jnp.bfloat16
    # Logits: bf16 rounds each weight and activation to 8 bits of mantissa (relative 2^-9).
    for ids in PROMPTS:
        want, got = sequence_logits(f32, ids), sequence_logits(bf16, ids)
        assert got.dtype == np.float32
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=0.03 * scale)  # measured: at most 1.6%
        assert np.abs(got - want).mean() < 0.006 * scale  # measured: 0.2-0.3%
    seqs = engine.generate_offline(PROMPTS, max_new_tokens=8, progress=False)
    want = eejax.generate(bf16, PROMPTS, max_new_tokens=8).tokens  # 4 rows at once, the engine 2
    assert_equal_until_a_near_tie(bf16, PROMPTS, [s.tokens for s in seqs], want, tol=NEAR_TIE)


def test_bf16_self_speculation_and_early_exit_run_in_bf16(tiny_checkpoints):
    bf16 = eejax.load(tiny_checkpoints["gqa-untied"][2], dtype=jnp.bfloat16)
    greedy = eejax.generate(bf16, PROMPTS, max_new_tokens=10, ignore_eos=True)
    for spec in ("1:2", "2:3"):
        res = eejax.generate(bf16, PROMPTS, max_new_tokens=10, ignore_eos=True, spec=spec)
        assert_equal_until_a_near_tie(bf16, PROMPTS, res.tokens, greedy.tokens, tol=NEAR_TIE)
    never = eejax.generate(bf16, PROMPTS, max_new_tokens=10, ignore_eos=True, exit="softmax:inf")
    assert_equal_until_a_near_tie(bf16, PROMPTS, never.tokens, greedy.tokens, tol=NEAR_TIE)
