"""The serving engine: continuous batching gives exactly `generate`'s tokens, and frees everything."""

import pytest

import eejax
from eejax.engine import dispatch as dispatch_module
from eejax.engine.engine import Engine
from tests.helpers import random_prompts


def test_engine_matches_generate_with_more_requests_than_slots(tiny_model):
    prompts = random_prompts(11, [3, 17, 9, 30, 1, 12], seed=5)
    max_new = [5, 12, 1, 8, 20, 3, 7, 12, 2, 9, 16]
    engine = Engine(tiny_model, max_slots=4, max_new_tokens=32, cache_budget="4MiB", page_size=8)
    seqs = [engine.submit(p, max_new_tokens=n) for p, n in zip(prompts, max_new)]
    engine.run()
    m = engine.metrics()
    assert m["kv_pages_used"] == 0 and m["running"] == 0 and m["waiting"] == 0
    assert m["generated_tokens"] == sum(len(s.tokens) for s in seqs)
    print(m)
    # Greedy token i depends only on the tokens before it, and a row not on its batch: one call
    # with the longest limit gives every request's tokens (and compiles once).
    alone = eejax.generate(tiny_model, prompts, max_new_tokens=max(max_new)).tokens
    for n, seq, want in zip(max_new, seqs, alone):
        assert seq.tokens == want[:n], (seq.id, seq.tokens, want[:n])
        assert seq.finish_reason in ("stop", "length")


def test_several_decode_steps_per_dispatch(tiny_model):
    """The engine runs `steps_per_dispatch` decode steps per program (tokens stream in groups)
    unless a waiting request could take a slot that a row's limit frees within it; tokens, exit
    layers, finish reasons and pages are those of one step per dispatch."""
    prompts = random_prompts(6, [3, 17, 9, 30], seed=2)
    max_new = [19, 7, 23, 2, 11, 16]
    results = {}
    for k in (1, 4):
        engine = Engine(
            tiny_model,
            max_slots=2,
            max_new_tokens=24,
            cache_budget="4MiB",
            page_size=8,
            steps_per_dispatch=k,
            exit="state:0.7",
            pages="grow",
        )
        seqs = [engine.submit(p, max_new_tokens=n) for p, n in zip(prompts, max_new)]
        engine.run()
        assert engine.metrics()["kv_pages_used"] == 0
        results[k] = [(s.tokens, s.exit_layers, s.finish_reason) for s in seqs], engine.counters["steps"]
    assert results[4][0] == results[1][0]
    assert results[4][1] < 0.6 * results[1][1]  # dispatches
    # One request alone: every token of a 4-step program reaches its stream.
    engine = Engine(tiny_model, max_slots=2, max_new_tokens=24, cache_budget="4MiB", page_size=8)
    seq = engine.submit(prompts[2], max_new_tokens=23)
    engine.run()
    assert list(seq.stream()) == seq.tokens == eejax.generate(tiny_model, [prompts[2]], max_new_tokens=23).tokens[0]


def test_requests_with_their_own_exit_options_share_the_slots(tiny_model):
    """Full depth, static:1 and softmax rows decode side by side; each gets what `generate` with
    its own option gives."""
    prompts = random_prompts(6, [5, 11, 2], seed=7)
    options = [None, "static:1", "softmax:0.1", "none", "static:2", "static:1"]
    engine = Engine(tiny_model, max_slots=4, max_new_tokens=16, cache_budget="4MiB", page_size=8)
    seqs = engine.generate_offline(prompts[:0], progress=False)
    assert seqs == []
    seqs = [engine.submit(p, max_new_tokens=10, exit=o) for p, o in zip(prompts, options)]
    engine.run()
    for p, o, seq in zip(prompts, options, seqs):
        want = eejax.generate(tiny_model, [p], max_new_tokens=10, exit=None if o == "none" else o)
        assert seq.tokens == want.tokens[0], (o, seq.tokens, want.tokens[0])
        assert seq.exit_layers == want.exit_layers[0], o
    assert engine.metrics()["kv_pages_used"] == 0


def test_warmup_compiles_every_program_the_requests_then_need(tiny_model):
    engine = Engine(tiny_model, max_slots=3, max_new_tokens=6, cache_budget="4MiB", page_size=8)
    # Batch buckets 1, 2, 3 x prompt buckets 16 and 24, each in its own table (2, 3 pages) and in that
    # of a prefill after a cached prefix (`_resume_width`) + decode widths 1, 2, 3, 4 pages (up to
    # 24 + 6 + 2 tokens) x 1 and 4 steps per program.
    assert engine.warmup(max_prompt_len=20, progress=False) == 3 * 2 * 2 + 4 * 2
    compiled = tiny_model.programs.num_programs
    prompts = random_prompts(7, [1, 20, 9, 14], seed=3)
    seqs = engine.generate_offline(prompts, max_new_tokens=6, progress=False)
    assert tiny_model.programs.num_programs == compiled  # nothing compiled while serving
    assert [s.tokens for s in seqs] == eejax.generate(tiny_model, prompts, max_new_tokens=6).tokens


def test_warmup_for_other_requests_compiles_what_they_need(tiny_model):
    """`warmup(requests=...)`: sampled and penalised, speculating and echo-scored requests, prompts
    after a cached prefix and in chunks, then compile nothing."""
    kinds = [dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2), dict(spec="1:2"), dict(prompt_logprobs=2)]
    engine = Engine(tiny_model, max_slots=1, max_new_tokens=4, cache_budget="4MiB", page_size=8, prefill_chunk=12)
    engine.warmup(max_prompt_len=16, progress=False, requests=kinds)
    compiled = tiny_model.programs.num_programs
    prefix = random_prompts(1, [8], seed=4)[0]
    prompts = [prefix + p for p in random_prompts(6, [1, 8, 5], seed=3)] + random_prompts(3, [16, 3], seed=5)
    seqs = [engine.submit(p, max_new_tokens=4, seed=i, **kinds[i % len(kinds)]) for i, p in enumerate(prompts)]
    engine.run()
    assert all(s.finish_reason in ("stop", "length") for s in seqs)
    assert engine.counters["prefix_cache_hit_tokens"] > 0
    assert tiny_model.programs.num_programs == compiled  # nothing compiled while serving


def test_generate_offline_keeps_the_order(tiny_model):
    prompts = random_prompts(5, [4, 9], seed=8)
    engine = Engine(tiny_model, max_slots=2, max_new_tokens=8, cache_budget="4MiB", page_size=8, policy="sjf")
    seqs = engine.generate_offline(prompts, max_new_tokens=6, progress=False)
    assert [s.tokens for s in seqs] == eejax.generate(tiny_model, prompts, max_new_tokens=6).tokens


def test_requests_with_their_own_sampling_share_the_slots(tiny_model):
    """Greedy rows stay exactly greedy beside rows sampled at a high temperature; top_k = 1 is greedy."""
    prompts = random_prompts(4, [6, 10], seed=9)
    engine = Engine(tiny_model, max_slots=4, max_new_tokens=16, cache_budget="4MiB", page_size=8, seed=3)
    greedy = engine.submit(prompts[0], max_new_tokens=12)
    hot = engine.submit(prompts[1], max_new_tokens=12, temperature=5.0)
    top1 = engine.submit(prompts[2], max_new_tokens=12, temperature=0.8, top_k=1)
    hot_copy = engine.submit(prompts[1], max_new_tokens=12, temperature=5.0)
    engine.run()
    want = eejax.generate(tiny_model, prompts[:3], max_new_tokens=12).tokens
    assert greedy.tokens == want[0] and top1.tokens == want[2]
    assert hot.tokens != want[1] and hot.tokens != hot_copy.tokens  # sampled, and not the same draw twice
    assert len(hot.tokens) == 12 or hot.finish_reason == "stop"


def test_rows_that_run_out_of_pages_are_preempted_and_recomputed(tiny_model):
    """With pages handed out as rows grow, 6 long requests through 4 slots outgrow a 16-page
    cache: rows are preempted and recomputed, and every one still gets exactly its greedy tokens."""
    budget = 16 * tiny_model.page_bytes(8)
    prompts = random_prompts(6, [9, 14, 5], seed=11)
    engine = Engine(tiny_model, max_slots=4, max_new_tokens=40, cache_budget=budget, page_size=8, pages="grow")
    seqs = [engine.submit(p, max_new_tokens=36, priority=i % 2) for i, p in enumerate(prompts)]
    engine.run()
    assert engine.counters["preemptions"] > 0
    want = eejax.generate(tiny_model, prompts, max_new_tokens=36, ignore_eos=False).tokens
    for seq, w in zip(seqs, want):
        assert seq.tokens == w, seq.id
    assert engine.metrics()["kv_pages_used"] == 0


def test_self_speculation_rows_beside_plain_rows_are_lossless(tiny_model, monkeypatch):
    """Rows speculating with different (E, d), fixed or adaptive, and plain rows in the same
    slots: every row's greedy tokens equal full depth, limits that are not multiples of d + 1
    included; each speculation option has its policy, and the rows' counters come back. Each
    step's outputs come back in one transfer (`PackedRead`), read once, whatever its programs."""
    prompts = random_prompts(6, [7, 13, 3], seed=12)
    specs = ["1:2", "2:3", None, "1:2:adaptive", "2:1", "2:2:adaptive"]
    limits = [11, 7, 9, 5, 13, 3]
    engine = Engine(tiny_model, max_slots=4, max_new_tokens=16, cache_budget="4MiB", page_size=8)
    seqs = [engine.submit(p, max_new_tokens=n, spec=s) for p, n, s in zip(prompts, limits, specs)]
    reads, read = [], dispatch_module.PackedRead.read
    monkeypatch.setattr(dispatch_module.PackedRead, "read", lambda packed: reads.append(packed) or read(packed))
    monkeypatch.setattr(dispatch_module, "to_host", lambda tree: pytest.fail("a step read arrays one by one"))
    steps = 0
    while engine.busy:
        engine.step()
        steps += 1
    assert len(reads) == len(set(map(id, reads))) and 0 < len(reads) <= steps
    alone = eejax.generate(tiny_model, prompts, max_new_tokens=max(limits)).tokens  # each row's first n: its own
    for n, s, seq, want in zip(limits, specs, seqs, alone):
        assert seq.tokens == want[:n], (s, n)
        if s is not None:
            c = seq.spec_counters
            assert c["rounds"] + c["plain_steps"] > 0 and 0 <= seq.accepted <= seq.drafted
            assert (c["plain_steps"] > 0) <= s.endswith("adaptive")
    assert engine.metrics()["kv_pages_used"] == 0
    assert sorted(spec.spec for spec, _ in engine.speculation.policies) == [
        "1:2",
        "1:2:adaptive",
        "2:1",
        "2:2:adaptive",
        "2:3",
    ]


def test_chunked_prefill_interleaves_a_long_prompt_with_decoding(tiny_model):
    """A 70-token prompt prefills 8 tokens per step while a short row decodes one token every
    step; both end with exactly their greedy tokens."""
    short, long = random_prompts(2, [4, 70], seed=21)
    engine = Engine(tiny_model, max_slots=2, max_new_tokens=24, cache_budget="4MiB", page_size=8, prefill_chunk=8)
    a = engine.submit(short, max_new_tokens=24)
    for _ in range(3):
        engine.step()
    b = engine.submit(long, max_new_tokens=5)
    seen = []
    while b.slot is None or engine.prefilling:
        engine.step()
        seen.append((b.prefilled, len(a.tokens)))
    assert [p for p, _ in seen] == list(range(8, 70, 8)) + [70]  # 8 prompt tokens per step
    assert all(n2 == n1 + 1 for (_, n1), (_, n2) in zip(seen, seen[1:]))  # the short row never waited
    engine.run()
    want = eejax.generate(tiny_model, [short, long], max_new_tokens=24).tokens
    assert a.tokens == want[0] and b.tokens == want[1][:5]
    assert engine.metrics()["kv_pages_used"] == 0


def test_preemption_with_chunked_prefill_and_shared_prefixes(tiny_model):
    """Pages handed out as rows grow over a 16-page cache, prompts that share a 3-page prefix,
    prefill in chunks of 12: rows are preempted and recomputed (sharing the cached prefix again),
    and every one gets exactly its greedy tokens; afterwards nothing is held."""
    budget = 16 * tiny_model.page_bytes(8)
    prefix = random_prompts(1, [24], seed=5)[0]
    prompts = [prefix + rest for rest in random_prompts(6, [3, 9, 1], seed=13)]
    engine = Engine(
        tiny_model, max_slots=4, max_new_tokens=40, cache_budget=budget, page_size=8, pages="grow", prefill_chunk=12
    )
    seqs = [engine.submit(p, max_new_tokens=30, priority=i % 2) for i, p in enumerate(prompts)]
    engine.run()
    assert engine.counters["preemptions"] > 0 and engine.counters["prefix_cache_hit_tokens"] >= 5 * 24
    want = eejax.generate(tiny_model, prompts, max_new_tokens=30).tokens
    for seq, w in zip(seqs, want):
        assert seq.tokens == w, seq.id
    assert engine.metrics()["kv_pages_used"] == 0 and engine.pages.allocator.num_cached >= 3


def test_penalised_rows_beside_plain_ones_through_preemption_chunks_and_speculation(tiny_model):
    """Rows with repetition / frequency / presence penalties share the slots with plain rows,
    are preempted and recomputed (their counts rebuilt from the host's tokens), prefill in chunks
    after a shared prefix, and speculate: each gets exactly the tokens `generate` gives it alone."""
    budget = 16 * tiny_model.page_bytes(8)
    prefix = random_prompts(1, [24], seed=5)[0]
    prompts = [prefix + rest for rest in random_prompts(6, [3, 9, 1], seed=14)]
    penalties = [
        dict(repetition_penalty=1.4),
        {},
        dict(frequency_penalty=0.7, presence_penalty=0.3),
        dict(repetition_penalty=0.8, presence_penalty=-0.5),
        dict(frequency_penalty=1.5),
        {},
    ]
    specs = [None, None, "1:2", None, "2:3:adaptive", "1:2"]
    engine = Engine(
        tiny_model, max_slots=4, max_new_tokens=40, cache_budget=budget, page_size=8, pages="grow", prefill_chunk=12
    )
    seqs = [
        engine.submit(p, max_new_tokens=30, priority=i % 2, spec=s, **kw)
        for i, (p, s, kw) in enumerate(zip(prompts, specs, penalties))
    ]
    engine.run()
    assert engine.counters["preemptions"] > 0 and engine.counters["prefix_cache_hit_tokens"] > 0
    plain = eejax.generate(tiny_model, prompts, max_new_tokens=30).tokens
    for seq, prompt, kw, want_plain in zip(seqs, prompts, penalties, plain):
        want = eejax.generate(tiny_model, [prompt], max_new_tokens=30, **kw).tokens[0] if kw else want_plain
        assert seq.tokens == want, (seq.id, kw)
        assert (seq.tokens != want_plain) == bool(kw), (seq.id, kw)  # the penalties changed something
    assert engine.metrics()["kv_pages_used"] == 0


def test_a_scored_prompt_and_a_plain_one_prefill_in_the_same_step(tiny_model):
    """A prompt whose log-probs are scored (echo) prefills in its own program beside plain ones in
    the same step, once each (scoring it must not move it into the plain group as well)."""
    prompts = random_prompts(3, [6, 11, 4], seed=31)
    engine = Engine(tiny_model, max_slots=3, max_new_tokens=5, cache_budget="4MiB", page_size=8)
    seqs = [engine.submit(p, max_new_tokens=5, prompt_logprobs=1 if i == 0 else None) for i, p in enumerate(prompts)]
    engine.run()
    assert [s.tokens for s in seqs] == eejax.generate(tiny_model, prompts, max_new_tokens=5).tokens
    assert len(seqs[0].prompt_token_logprobs) == len(prompts[0]) and not seqs[1].prompt_token_logprobs


def test_warmup_warns_when_memory_maps_may_run_out(tiny_model, monkeypatch, caplog):
    """Each XLA:CPU program holds memory maps (~256 for SmolLM2): a warm-up larger than the
    process's headroom under vm.max_map_count says so, naming the sysctl, before it compiles."""
    from eejax.engine import warmup

    engine = Engine(tiny_model, max_slots=1, max_new_tokens=4, cache_budget="4MiB", page_size=8)
    monkeypatch.setattr(warmup, "map_headroom", lambda: 100)
    with caplog.at_level("WARNING", logger="eejax.serve"):
        engine.warmup(max_prompt_len=16, progress=False)
    assert "vm.max_map_count" in caplog.text and "sysctl" in caplog.text


def test_release_all_frees_compiled_programs_and_their_memory_maps(tiny_model):
    """`release_all` drops every model's compiled programs (their memory maps go with them); the
    model then compiles again and decodes the same tokens."""
    from eejax.decode.programs import map_headroom, release_all

    prompts = [[5, 6, 7], [8, 9]]
    before = eejax.generate(tiny_model, prompts, max_new_tokens=4, exit="softmax:0.5").tokens
    held = map_headroom()
    assert tiny_model.programs.num_programs > 0 and release_all() >= 2
    assert tiny_model.programs.num_programs == 0
    assert held is None or map_headroom() > held
    assert eejax.generate(tiny_model, prompts, max_new_tokens=4, exit="softmax:0.5").tokens == before


def test_token_log_probs_are_read_after_the_next_program_took_the_state(tiny_model):
    """Decode programs donate the state, and a row's log-probs are read one dispatch later: they
    come from a copy (`Dispatch._outputs`), one per token, beside a row without."""
    engine = Engine(tiny_model, max_slots=2, max_new_tokens=12, cache_budget="4MiB", page_size=8, ignore_eos=True)
    prompts = random_prompts(2, [5, 9], seed=3)
    scored, plain = (
        engine.submit(prompts[0], max_new_tokens=10, logprobs=1),
        engine.submit(prompts[1], max_new_tokens=9),
    )
    engine.run()
    assert scored.error is None and plain.error is None
    assert len(scored.token_logprobs) == len(scored.top_logprobs) == 10
    assert all(-50 < lp <= 0 for lp in scored.token_logprobs)
    want = eejax.generate(tiny_model, prompts, max_new_tokens=10, ignore_eos=True).tokens
    assert scored.tokens == want[0] and plain.tokens == want[1][:9]


def test_a_default_spec_decodes_requests_that_name_no_decoding_of_their_own(tiny_model):
    """`Engine(spec=...)` (`eejax serve --spec`): a request naming neither exit nor spec
    speculates with it, one naming either (spec "none" included) takes neither default; greedy
    tokens stay full depth's. A default exit and a default spec together are refused."""
    prompts = random_prompts(3, [5, 11, 8], seed=9)
    engine = Engine(tiny_model, max_slots=3, max_new_tokens=8, cache_budget="4MiB", page_size=8, spec="1:2")
    seqs = [
        engine.submit(prompts[0], max_new_tokens=8),
        engine.submit(prompts[1], max_new_tokens=8, spec="none"),
        engine.submit(prompts[2], max_new_tokens=8, exit="static:1"),
    ]
    engine.run()
    assert [s.spec is not None for s in seqs] == [True, False, False]
    assert [s.exit is not None for s in seqs] == [False, False, True]
    full = eejax.generate(tiny_model, prompts[:2], max_new_tokens=8).tokens
    assert [s.tokens for s in seqs[:2]] == full
    with pytest.raises(eejax.EejaxError, match="not both"):
        Engine(tiny_model, max_slots=1, max_new_tokens=4, cache_budget="4MiB", exit="static:1", spec="1:2")
    exiting = Engine(tiny_model, max_slots=1, max_new_tokens=4, cache_budget="4MiB", exit="static:1")
    assert exiting.submit(prompts[0], max_new_tokens=4, queue=False).exit is not None
    assert exiting.submit(prompts[0], max_new_tokens=4, spec="none", queue=False).exit is None
