"""Fault isolation and admission: a failing step fails only its requests, the loop lives on,
lost device state is rebuilt, a shutdown deadline ends what still runs, and every request
the engine accepts can start (one that never could is refused with the numbers)."""

from __future__ import annotations

import time

import jax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eejax
from eejax.engine.engine import Engine
from eejax.errors import EejaxError
from tests.helpers import random_prompts


def greedy(model, prompt, n):
    return eejax.generate(model, [prompt], max_new_tokens=n).tokens[0]


def test_a_failing_program_fails_only_its_requests(tiny_model):
    """The decode program of the rows that record log-probs raises: those requests end with an
    error, the others decode exactly, every page comes back, and the next request is served."""
    engine = Engine(tiny_model, max_slots=4, max_new_tokens=12, cache_budget="4MiB", page_size=8)
    real = engine.dispatch.decode_program

    def failing(table, group, options):
        if options.logprobs:
            raise RuntimeError("injected fault")
        return real(table, group, options)

    engine.dispatch.decode_program = failing
    prompts = random_prompts(3, [5, 9, 3], seed=11)
    seqs = [
        engine.submit(prompts[0], max_new_tokens=10),
        engine.submit(prompts[1], max_new_tokens=10, logprobs=0),
        engine.submit(prompts[2], max_new_tokens=7),
    ]
    engine.run()
    assert seqs[1].finish_reason == "error" and "injected fault" in seqs[1].error
    for i in (0, 2):
        assert seqs[i].finish_reason in ("stop", "length")
        assert seqs[i].tokens == greedy(tiny_model, prompts[i], seqs[i].max_new_tokens)
    assert engine.metrics()["kv_pages_used"] == 0 and not engine.running and not engine.waiting
    after = engine.submit(prompts[1], max_new_tokens=6)
    engine.run()
    assert after.tokens == greedy(tiny_model, prompts[1], 6)


def test_lost_device_state_fails_the_running_requests_and_is_rebuilt(tiny_model):
    """A program that failed after its donated cache was consumed: every running request fails
    (their K/V is gone), a fresh cache and slot state are built, and later requests are exact."""
    engine = Engine(tiny_model, max_slots=2, max_new_tokens=12, cache_budget="4MiB", page_size=8)
    real, calls = engine.dispatch.dispatch, []

    def consuming(*args):
        calls.append(1)
        if len(calls) == 3:
            jax.tree.map(lambda x: x.delete(), engine.cache)
            raise RuntimeError("device fault")
        return real(*args)

    engine.dispatch.dispatch = consuming
    prompts = random_prompts(3, [6, 4, 8], seed=12)
    first = [engine.submit(p, max_new_tokens=10) for p in prompts[:2]]
    engine.run()
    assert [s.finish_reason for s in first] == ["error", "error"] and "device fault" in first[0].error
    assert engine.metrics()["kv_pages_used"] == 0
    later = engine.submit(prompts[2], max_new_tokens=9)
    engine.run()
    assert later.tokens == greedy(tiny_model, prompts[2], 9)


def test_the_background_loop_outlives_a_failing_step_and_reports_its_own_death(tiny_model):
    engine = Engine(tiny_model, max_slots=2, max_new_tokens=8, cache_budget="4MiB", page_size=8)
    real_admit, faults = engine.scheduler.admit, ["scheduler fault"]

    def admit(*args):
        if faults:
            raise RuntimeError(faults.pop())
        return real_admit(*args)

    engine.scheduler.admit = admit
    engine.start()
    try:
        doomed = engine.submit([5, 6, 7], max_new_tokens=4).result(timeout=60)
        assert doomed.finish_reason == "error" and "scheduler fault" in doomed.error
        assert engine.alive
        served = engine.submit([5, 6, 7], max_new_tokens=4).result(timeout=60)
        assert served.tokens == greedy(tiny_model, [5, 6, 7], 4)

        # A fault the loop cannot recover from: it dies, says so, and ends what waits.
        def unrecoverable(error):
            raise SystemError("unrecoverable")

        engine.recover = unrecoverable
        faults.append("scheduler fault")
        orphan = engine.submit([5, 6, 7], max_new_tokens=4).result(timeout=60)
        assert orphan.finish_reason == "error"
        deadline = time.time() + 10
        while engine.alive and time.time() < deadline:
            time.sleep(0.01)
        assert not engine.alive and isinstance(engine.error, SystemError)
    finally:
        engine.stop(timeout=10)


def test_abort_ends_what_still_runs(tiny_model):
    engine = Engine(tiny_model, max_slots=1, max_new_tokens=64, cache_budget="4MiB", page_size=8)
    seqs = [engine.submit(p, max_new_tokens=64) for p in random_prompts(3, [4], seed=2)]
    engine.step()
    assert engine.abort() == 3
    assert [s.finish_reason for s in seqs] == ["abort"] * 3 and all(s.finished for s in seqs)
    engine.run()  # reads the step still in flight: nothing of it is delivered
    assert engine.metrics()["kv_pages_used"] == 0 and not engine.busy
    assert all(len(s.tokens) <= 1 for s in seqs)


def test_deadlines_end_requests_with_what_they_have_and_free_their_pages(tiny_model):
    """A request past its deadline ends with finish reason "length" and `timed_out`: one still
    queued (its wait counts) with no tokens, one decoding with a prefix of its greedy tokens; every
    page comes back and a request without a deadline is untouched."""
    engine = Engine(tiny_model, max_slots=1, max_new_tokens=64, cache_budget="4MiB", page_size=8)
    real_step = engine.step

    def slow_step():  # ~20 ms a step, so that a 0.3 s deadline falls mid-generation
        time.sleep(0.02)
        real_step()

    engine.step = slow_step
    prompts = random_prompts(3, [5, 7, 4], seed=5)
    engine.start()
    try:
        cut = engine.submit(prompts[0], max_new_tokens=64, timeout=0.3)
        queued = engine.submit(prompts[1], max_new_tokens=8, timeout=0.1)  # behind `cut` in the one slot
        free = engine.submit(prompts[2], max_new_tokens=8)
        for seq in (cut, queued, free):
            seq.result(timeout=60)
    finally:
        engine.stop()
    assert (cut.finish_reason, cut.timed_out) == ("length", True) and 0 < len(cut.tokens) < 64
    assert cut.tokens == greedy(tiny_model, prompts[0], 64)[: len(cut.tokens)]
    assert (queued.finish_reason, queued.timed_out, queued.tokens) == ("length", True, [])
    assert not free.timed_out and free.tokens == greedy(tiny_model, prompts[2], 8)
    assert engine.metrics()["kv_pages_used"] == 0
    with pytest.raises(EejaxError, match="timeout"):
        engine.submit(prompts[2], timeout=0)


# --- admission: what is accepted can always start ---------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pages=st.integers(2, 40),
    page_size=st.sampled_from([1, 4, 8, 16]),
    prompt=st.integers(1, 300),
    new=st.integers(1, 64),
    grow=st.booleans(),
)
def test_every_accepted_request_can_start_on_an_empty_cache(tiny_model, pages, page_size, prompt, new, grow):
    """Over cache sizes, page sizes and request lengths: `submit` either refuses with the numbers
    or the scheduler admits the request (and, after a preemption, its recomputation) into the
    empty cache. Before, a request needing more than the 90% admission grants waited forever."""
    budget = pages * tiny_model.page_bytes(page_size)
    try:
        engine = Engine(
            tiny_model,
            max_slots=2,
            max_new_tokens=64,
            cache_budget=budget,
            page_size=page_size,
            pages="grow" if grow else "reserve",
        )
    except EejaxError as e:
        assert "holds no sequence" in str(e)
        return
    try:
        seq = engine.submit([3] * prompt, max_new_tokens=new)
    except EejaxError as e:
        assert f"prompt of {prompt} tokens + {new} new tokens exceeds" in str(e)
        assert prompt + new > engine.max_len
        return
    free = engine.pages.allocator.num_free
    assert engine.scheduler.admit(2, free)  # admitted now ...
    recomputed = engine.waiting.request(seq)
    recomputed.prompt_len, recomputed.max_new_tokens = prompt + new - 1, 1  # ... and after a late preemption
    engine.scheduler.submit(recomputed)
    assert engine.scheduler.admit(2, free)


def test_a_request_as_long_as_admission_allows_runs_to_the_end(tiny_model):

    budget = 11 * tiny_model.page_bytes(8)
    engine = Engine(tiny_model, max_slots=2, max_new_tokens=40, cache_budget=budget, page_size=8, pages="grow")
    assert engine.pages.allocator.num_free == 10 and engine.max_len == 9 * 8  # 90% of 10 pages
    with pytest.raises(EejaxError, match=r"exceeds the 72 tokens .*\(10 pages of 8 tokens"):
        engine.submit([3] * 40, max_new_tokens=33)
    prompt = random_prompts(1, [40], seed=4)[0]
    seq = engine.submit(prompt, max_new_tokens=32)
    engine.run()
    assert seq.tokens == eejax.generate(tiny_model, [prompt], max_new_tokens=32).tokens[0]


def test_distinct_exit_and_speculation_options_are_bounded(tiny_model):
    """Each early-exit / speculation option compiles its own programs: past the bound a new one
    is refused (naming those served), the ones served stay accepted."""
    engine = Engine(tiny_model, max_slots=2, max_new_tokens=8, cache_budget="4MiB", page_size=8, max_decoding_options=3)
    for option in ("softmax:0.5", "softmax:0.25"):
        engine.submit([5, 6], max_new_tokens=2, exit=option)
    with pytest.raises(EejaxError, match=r"at most 3 .* exit none, exit softmax:0.25, exit softmax:0.5"):
        engine.submit([5, 6], max_new_tokens=2, exit="softmax:0.125")
    with pytest.raises(EejaxError, match="at most 3"):
        engine.submit([5, 6], max_new_tokens=2, spec="1:2")
    engine.submit([5, 6], max_new_tokens=2, exit="softmax:0.5")
    engine.submit([5, 6], max_new_tokens=2, exit="none", temperature=0.7, top_k=9)  # sampling is not an option
    assert len(engine.waiting) == 4
