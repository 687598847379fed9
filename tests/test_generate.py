"""`eejax.generate`: input forms, stopping, sampling, batching, cache budget, program count."""

import dataclasses
import json

import numpy as np
import pytest

import eejax
from eejax.errors import EejaxError
from tests.helpers import random_prompts

PROMPTS = random_prompts(3, [4, 13, 9], seed=7)


def gen(model, batch=PROMPTS, **kw):
    kw.setdefault("max_new_tokens", 12)
    kw.setdefault("ignore_eos", True)
    return eejax.generate(model, batch, **kw)


def test_input_forms_agree(tiny_model):
    want = gen(tiny_model).tokens
    ids = np.zeros((3, 13), np.int32)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = p
    assert gen(tiny_model, (ids, np.array([4, 13, 9]))).tokens == want
    left = np.zeros((3, 13), np.int32)
    mask = np.zeros((3, 13), np.int32)
    for i, p in enumerate(PROMPTS):
        left[i, 13 - len(p) :], mask[i, 13 - len(p) :] = p, 1
    assert gen(tiny_model, {"input_ids": left, "attention_mask": mask}).tokens == want
    texts = [tiny_model.tokenizer.decode(p) for p in PROMPTS]
    res = gen(tiny_model, texts)
    assert res.prompts == texts and all(isinstance(t, str) for t in res.texts)
    assert res.tokens == gen(tiny_model, [tiny_model.tokenizer(t)["input_ids"] for t in texts]).tokens


def test_rows_do_not_depend_on_their_batch(tiny_model):
    together = gen(tiny_model).tokens
    alone = [gen(tiny_model, [p]).tokens[0] for p in PROMPTS]
    assert together == alone
    assert gen(tiny_model, batch_size=2).tokens == together


def test_eos_stops_a_row_and_is_kept(tiny_model):
    full = gen(tiny_model).tokens
    stop_token = full[1][5]
    model = dataclasses.replace(tiny_model, config=dataclasses.replace(tiny_model.config, eos_token_ids=(stop_token,)))
    res = gen(model, ignore_eos=False)
    for row, out in zip(full, res.tokens):
        n = row.index(stop_token) + 1 if stop_token in row else len(row)
        assert out == row[:n]
    assert gen(model, ignore_eos=True).tokens == full
    assert res.stats["generated_tokens"] == sum(map(len, res.tokens))


def test_max_new_tokens_one_and_stats(tiny_model):
    res = gen(tiny_model, max_new_tokens=1)
    assert [len(t) for t in res.tokens] == [1, 1, 1]
    assert res.tokens == [t[:1] for t in gen(tiny_model).tokens]
    res = gen(tiny_model)
    L = tiny_model.config.num_layers
    assert res.exit_layers == [[L] * 12] * 3
    s = res.stats
    assert s["generated_tokens"] == 36 and s["mean_layers_per_token"] == L and s["num_layers"] == L
    assert s["tokens_per_s"] > 0 and s["compile_s"] >= 0
    assert s["decode_tokens_per_s"] > 0 and 0 < s["prefill_s"] < s["run_s"] and s["exit"] == "full"
    assert s["engine_steps"] == 3  # 11 decode tokens: three 4-step programs, none after the one that ends them
    # A dataclass, read as attributes or as a mapping; the speculation fields only with spec=.
    assert isinstance(s, eejax.GenerateStats) and s.generated_tokens == s["generated_tokens"] == 36
    assert "acceptance_rate" not in s and s.acceptance_rate is None and json.loads(json.dumps(s.as_dict()))
    assert {**s} == dict(s) == s.as_dict() and len(s) == len(s.as_dict()) and s.get("rounds", 0) == 0
    with pytest.raises(KeyError, match="spec="):
        s["acceptance_rate"]
    spec = gen(tiny_model, spec="1:2").stats
    assert 0 <= spec["acceptance_rate"] == spec.acceptance_rate <= 1 and "draft_pass_s" not in spec


def test_sampling_is_seeded_and_filtered(tiny_model):
    a = gen(tiny_model, temperature=1.0, seed=1).tokens
    assert a == gen(tiny_model, temperature=1.0, seed=1).tokens
    assert a != gen(tiny_model, temperature=1.0, seed=2).tokens
    greedy = gen(tiny_model).tokens
    assert gen(tiny_model, temperature=0.7, top_k=1, seed=3).tokens == greedy
    assert gen(tiny_model, temperature=0.7, top_p=1e-6, seed=3).tokens == greedy
    with pytest.raises(EejaxError, match="top_p"):
        gen(tiny_model, temperature=1.0, top_p=0.0)
    with pytest.raises(EejaxError, match="temperature"):
        gen(tiny_model, temperature=-1.0)


def test_small_cache_budget_runs_rows_in_turn(tiny_model):
    c = tiny_model.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    want = gen(tiny_model).tokens
    # Room for the null page + one sequence of 13 + 12 tokens (2 pages of 16): rows go one by one.
    res = gen(tiny_model, cache_budget=3 * 16 * per_token)
    assert res.tokens == want and res.stats["kv_cache_pages"] == 3
    with pytest.raises(EejaxError, match="KV cache budget"):
        gen(tiny_model, cache_budget=2 * 16 * per_token)


def test_bad_input_is_named(tiny_model):
    with pytest.raises(EejaxError, match="no prompts"):
        gen(tiny_model, [])
    with pytest.raises(EejaxError, match="empty"):
        gen(tiny_model, ["ok", ""])
    with pytest.raises(EejaxError, match="max_new_tokens"):
        gen(tiny_model, max_new_tokens=0)
    with pytest.raises(EejaxError, match="context"):
        gen(tiny_model, [[5] * 250], max_new_tokens=10)
    with pytest.raises(EejaxError, match="vocabulary"):
        gen(tiny_model, [[5, 100000]])


def test_compiled_programs_are_bounded(tiny_model):
    model = dataclasses.replace(tiny_model, programs=type(tiny_model.programs)())
    gen(model, random_prompts(3, [9, 10, 12], seed=1))
    first = model.programs.num_programs
    # Other lengths in the same buckets, as many rows: nothing new.
    gen(model, random_prompts(3, [14, 16, 13], seed=2))
    assert model.programs.num_programs == first
    assert first <= 3  # prefill + at most two decode widths here
    # Another batch size with the same decode slots (4): its prefill only.
    gen(model, random_prompts(4, [14, 16, 11, 13], seed=2))
    assert model.programs.num_programs == first + 1
