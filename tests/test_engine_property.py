"""The engine under random request mixes (hypothesis): every row equals `generate` token for token
(greedy rows; sampled rows with their seed), whatever the prompt lengths, shared prompt prefixes
(the prefix cache), chunked prefill budgets, limits, decoding modes (plain, early exit,
self-speculation with d from 1 to 8, sampling), page modes, cache sizes (tiny ones force
preemption) and arrival times; and every page is free at the end."""

from __future__ import annotations

import functools
import os

import jax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eejax
from eejax.config import LlamaConfig
from eejax.engine.engine import Engine
from eejax.models import llama

PAGE = 8
NEW = 16  # the engine's max new tokens (and the most a request asks for)
EOS = 7
TEMPERATURE = 0.9


@functools.cache
def model() -> eejax.Model:
    """4 layers, layers 2-3 the identity (output projections zeroed): drafts after E = 2 or 3
    layers are always accepted, so speculation rounds run back to back at full length, and E = 1
    accepts some. EOS is token 7."""
    c = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        eos_token_ids=(EOS,),
    )
    params = llama.init_params(c, jax.random.PRNGKey(0), scale=0.3)
    layers = {**params["layers"], **{n: params["layers"][n].at[2:].set(0.0) for n in ("wo", "w_down")}}
    return eejax.Model(c, {**params, "layers": layers})


def reference(prompt: tuple[int, ...], limit: int, mode: str, option) -> list[int]:
    """`generate`'s tokens for a request. Token i depends only on the tokens before it, so the
    first `limit` of NEW tokens are what `generate` gives with that limit, except under a
    decaying exit threshold, which runs over the limit. (Fewer limits and one page-table width:
    fewer programs to compile.)"""
    if mode == "exit" and option.startswith("softmax"):
        return _generate(prompt, limit, option, None)
    return _generate(prompt, NEW, option if mode == "exit" else None, option if mode == "sampled" else None)[:limit]


@functools.cache
def _generate(prompt, max_new_tokens, exit, seed):  # noqa: A002
    kw = {} if seed is None else dict(temperature=TEMPERATURE, seed=seed)
    return eejax.generate(
        model(), [list(prompt)], max_new_tokens=max_new_tokens, exit=exit, page_size=64, cache_budget="1MiB", **kw
    ).tokens[0]


@pytest.fixture(autouse=True, scope="module")
def _forget_the_model_after_this_module():
    """The model and the reference outputs are cached for the module's examples, then freed
    (their compiled programs with them)."""
    yield
    model.cache_clear()
    _generate.cache_clear()


# A request: prompt, limit, and one decoding mode: self-speculation from E = 2 (every draft
# accepted) with d from 1 to 8 or from E = 1 (some rejected), a static exit (batch-independent),
# or sampling with the request's own seed. (Every (E, d) and block-table width compiles its own
# programs: the space is kept small enough for the suite.)
MODES = st.one_of(
    st.just(("plain", None)),
    st.tuples(st.just("spec"), st.one_of(st.integers(1, 8).map("2:{}".format), st.just("1:3"))),
    st.tuples(st.just("exit"), st.sampled_from(["static:1", "static:3"])),
    st.tuples(st.just("sampled"), st.integers(0, 2**31 - 1)),  # the request's seed
)
# Prompts: random, or one of two shared prefixes (1 and 2 pages; the prefix cache shares their
# pages once a prompt with them was prefilled) and a random rest.
PREFIXES = ([8 + i for i in range(PAGE)], [40 + i % 5 for i in range(2 * PAGE)])
PROMPT = st.one_of(
    st.lists(st.integers(8, 63), min_size=1, max_size=NEW),
    st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(8, 63), max_size=PAGE)).map(lambda p: p[0] + p[1]),
)
REQUEST = st.tuples(
    PROMPT, st.integers(1, NEW), MODES, st.integers(0, 3)
)  # the last: steps to run before this request arrives


# 32 fixed examples in the suite (derandomized: the same each run; 1-3 s each on 2 cores);
# EEJAX_ENGINE_EXAMPLES=500 for a longer search.
@settings(
    max_examples=int(os.environ.get("EEJAX_ENGINE_EXAMPLES", "32")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    requests=st.lists(REQUEST, min_size=1, max_size=7),
    pages=st.sampled_from(["reserve", "grow"]),
    softmax_row=st.one_of(st.none(), st.integers(0, 6)),
    chunk=st.sampled_from([None, None, 5, 12]),
)
def test_engine_equals_generate_on_random_mixes(requests, pages, softmax_row, chunk):
    """3 slots over a cache of 8 pages of 8 tokens (a request needs up to 4): rows wait for pages
    (reserve) or are preempted and recomputed (grow); prompts prefill whole or in chunks of 5 or
    12 tokens per step. One slot count and cache size, as each compiles its own programs."""
    m = model()
    budget = 9 * m.page_bytes(PAGE)  # + the null page
    engine = Engine(
        m, max_slots=3, max_new_tokens=NEW, cache_budget=budget, page_size=PAGE, pages=pages, prefill_chunk=chunk
    )
    # One request (at most) decodes with a softmax exit and CALM's decaying threshold: alone in
    # its option group, so its exits depend on its own limit and positions only.
    submitted = []
    for i, (prompt, limit, (mode, option), wait) in enumerate(requests):
        if len(prompt) + limit > engine.max_len:
            continue
        for _ in range(wait):
            engine.step()
        kw: dict = {}
        if i == softmax_row and mode == "plain":
            mode, option = "exit", "softmax:0.2"
        if mode == "spec":
            kw["spec"] = option
        elif mode == "exit":
            kw["exit"] = option
        elif mode == "sampled":
            kw.update(temperature=TEMPERATURE, seed=option)
        submitted.append((engine.submit(prompt, max_new_tokens=limit, **kw), tuple(prompt), limit, mode, option))
    engine.run()
    assert engine.pages.allocator.num_allocated == 0 and not engine.running and not engine.waiting
    assert engine.pages.allocator.num_free == 8  # cached prefixes are idle, not held
    for seq, prompt, limit, mode, option in submitted:
        assert seq.finish_reason in ("stop", "length")
        assert 1 <= len(seq.tokens) <= limit and (len(seq.tokens) == limit or seq.tokens[-1] == EOS)
        if mode == "exit" and seq.preemptions:
            # A preempted early-exit row is recomputed at full depth, which its KV-filled
            # positions were not: it is not the same computation as `generate`.
            continue
        want = reference(prompt, limit, mode, option)
        assert seq.tokens == want, (mode, option, seq.preemptions, seq.tokens, want)


@pytest.mark.parametrize("pages", ["reserve", "grow"])
@pytest.mark.parametrize("d", [4, 8])
def test_back_to_back_speculation_rounds_match_generate(pages, d):
    """The reported case: every draft accepted, two prompts through two slots, a 1 MiB cache."""
    m = model()
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23]]
    engine = Engine(m, max_slots=2, max_new_tokens=60, cache_budget="1MiB", page_size=8, pages=pages)
    seqs = [engine.submit(p, max_new_tokens=60, spec=f"2:{d}") for p in prompts]
    engine.run()
    for p, seq in zip(prompts, seqs):
        assert seq.tokens == _generate(tuple(p), 60, None, None)
    assert engine.pages.allocator.num_allocated == 0


def test_threshold_schedule_uses_the_requests_own_limit():
    """λ(t) decays over the request's own max tokens, not the engine's: a softmax request decodes
    as `generate` with the same limit does, its exit layers included."""
    m = model()
    prompt = [9, 30, 41, 12]
    engine = Engine(m, max_slots=2, max_new_tokens=64, cache_budget="1MiB", page_size=8)
    seq = engine.submit(prompt, max_new_tokens=12, exit="softmax:0.2")
    engine.run()
    want = eejax.generate(m, [prompt], max_new_tokens=12, exit="softmax:0.2")
    assert seq.tokens == want.tokens[0] and seq.exit_layers == want.exit_layers[0]
    assert len(set(want.exit_layers[0][1:])) > 1  # the schedule matters here: exits vary with t


def test_a_recomputed_row_keeps_its_absolute_position_and_limit():
    """A preempted row is prefilled again from its prompt and the tokens it had (offset): its
    state counts positions from there (start = offset), so λ(t) and its seeded draws continue
    at the request's own positions, and its limit is what is left of its max tokens."""
    m = model()
    budget = 9 * m.page_bytes(PAGE)  # 8 pages: 64 tokens
    engine = Engine(m, max_slots=2, max_new_tokens=NEW, cache_budget=budget, page_size=PAGE, pages="grow")
    # Both start (3 pages each) and outgrow the cache (5 pages each): the lower priority yields.
    victim = engine.submit([9, 20, 31, 42] * 5, max_new_tokens=NEW, exit="softmax:0.2", priority=0)
    engine.submit([10, 21, 32, 43] * 5, max_new_tokens=NEW, priority=1)
    seen = []
    while engine.busy:
        engine.step()
        if victim.slot is not None and victim.preemptions:
            seen.append((victim.offset, int(engine.state.start[victim.slot]), int(engine.state.limit[victim.slot])))
    assert seen and all(offset > 0 for offset, _, _ in seen)
    assert all(start == offset and limit == NEW - offset for offset, start, limit in seen)
    assert len(victim.tokens) == NEW or victim.tokens[-1] == EOS
