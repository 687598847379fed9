"""BucketServe's scheduler: Eq. 5-6 in pages, Algorithm 1's split and merge, policies, priorities."""

import pytest

from eejax.engine.scheduler import BucketScheduler, Request, max_batch, preemption_victim, safe_pages
from eejax.errors import EejaxError


def req(i, length, arrival=None, priority=0):
    return Request(
        i, prompt_len=length - 1, max_new_tokens=1, arrival=float(i if arrival is None else arrival), priority=priority
    )


def test_safe_pages_and_n_max():
    assert safe_pages(100) == 90 and safe_pages(9) == 8 and safe_pages(0) == 0
    # Pages of 16 tokens: lengths 16, 17, 40 take 1, 2, 3 pages.
    assert max_batch([16, 17, 40], safe=6, page_size=16) == 3
    assert max_batch([16, 17, 40], safe=5, page_size=16) == 2
    assert max_batch([40, 16], safe=2, page_size=16) == 0
    assert max_batch([], safe=10, page_size=16) == 0


def test_one_bucket_at_low_load_split_at_the_midpoint_under_load_merge_back():
    s = BucketScheduler(max_len=1024, page_size=16, theta=0.5)
    for i in range(3):
        s.submit(req(i, 100))
    s.adjust(n_max=4)  # 3 < N_max: one bucket
    assert [(b.low, b.up) for b in s.buckets] == [(0, 1024)]
    for i in range(3, 8):
        s.submit(req(i, 900 if i in (4, 7) else 100))  # 8 waiting, 6 of them below 512
    s.adjust(n_max=4)
    assert [(b.low, b.up) for b in s.buckets] == [(0, 512), (512, 1024)]
    assert [len(b.requests) for b in s.buckets] == [6, 2]
    s.adjust(n_max=4)  # [0, 512) holds 6 > 4, all 6 below 256: split again; [512, 1024) holds 2: kept
    assert [(b.low, b.up) for b in s.buckets] == [(0, 256), (256, 512), (512, 1024)]
    # Mostly long requests (not > θ below the midpoint): no split.
    t = BucketScheduler(max_len=1024, page_size=16)
    for i in range(8):
        t.submit(req(i, 100 if i < 3 else 700))
    t.adjust(n_max=4)
    assert len(t.buckets) == 1
    # Load falls below N_max: everything merges back into [0, L_max), no request lost.
    for b in s.buckets:
        del b.requests[1:]
    s.adjust(n_max=4)
    assert [(b.low, b.up) for b in s.buckets] == [(0, 1024)] and s.waiting == 2 and s.merges == 1


def test_admission_takes_one_bucket_within_the_safe_pages():
    s = BucketScheduler(max_len=1024, page_size=16)
    for i in range(6):
        s.submit(req(i, 600 if i in (1, 3) else 40))  # 4 short (3 pages), 2 long (38 pages)
    # 50 free pages -> 45 safe; N_max over the FCFS order: 3 + 38 + 3 = 44, so 3 < 6 waiting, and
    # 4 of 6 lie below 512: split; then the 4 shorts (> 3, all below the midpoints 256, 128, 64)
    # split the low bucket on until [0, 64) holds them (none lies below 32).
    batch = s.admit(free_slots=8, free_pages=50)
    assert [(b.low, b.up) for b in s.buckets] == [(0, 64), (64, 128), (128, 256), (256, 512), (512, 1024)]
    assert [r.id for r in batch] == [0, 2, 4, 5]  # the bucket of the earliest arrival, all shorts fit
    assert s.waiting == 2
    # 45 safe pages hold one 38-page request, not two.
    assert [r.id for r in s.admit(free_slots=8, free_pages=50)] == [1]
    assert s.admit(free_slots=0, free_pages=50) == []
    assert s.admit(free_slots=4, free_pages=20) == []  # 18 safe pages: nothing fits


@pytest.mark.parametrize("policy,want", [("fcfs", [0, 1, 2, 3]), ("sjf", [2, 0, 3, 1]), ("ljf", [1, 3, 0, 2])])
def test_policies_inside_a_bucket(policy, want):
    s = BucketScheduler(max_len=1024, page_size=16, policy=policy, bucketing=False)
    for i, length in enumerate([100, 300, 50, 200]):
        s.submit(req(i, length))
    assert [r.id for r in s.admit(free_slots=8, free_pages=1000)] == want


def test_priority_first_and_online_vs_offline_bucket_choice():
    s = BucketScheduler(max_len=1024, page_size=16, bucketing=False)
    s.submit(req(0, 100))
    s.submit(req(1, 100, priority=5))
    assert [r.id for r in s.admit(free_slots=1, free_pages=1000)] == [1]
    # Offline: the fullest bucket; online: the one holding the earliest arrival.
    for online, want in ((True, {0}), (False, {1, 2, 3})):
        s = BucketScheduler(max_len=1024, page_size=16, online=online)
        s.submit(req(0, 900, arrival=0))
        for i in (1, 2, 3):
            s.submit(req(i, 50, arrival=i))
        s.adjust(n_max=2)  # 4 > 2, 3 of 4 below 512: split
        assert {r.id for r in s.admit(free_slots=8, free_pages=1000)} == want


def test_preemption_victim_and_requeue_lose_nothing():
    running = [req(0, 100, priority=1), req(1, 100, arrival=5), req(2, 100, arrival=3)]
    assert preemption_victim(running).id == 1  # lowest priority, latest arrival
    s = BucketScheduler(max_len=1024, page_size=16)
    s.requeue(running[1])
    assert s.waiting == 1 and s.admit(1, 100)[0] is running[1]
    with pytest.raises(EejaxError, match="nothing running"):
        preemption_victim([])


def test_bad_requests_and_settings():
    s = BucketScheduler(max_len=128, page_size=16)
    with pytest.raises(EejaxError, match="must lie in"):
        s.submit(Request("x", prompt_len=100, max_new_tokens=100))
    with pytest.raises(EejaxError, match="unknown policy"):
        BucketScheduler(max_len=128, page_size=16, policy="random")


def test_n_max_is_capped_by_the_decode_slots():
    s = BucketScheduler(max_len=1024, page_size=16, max_rows=2)
    for i in range(5):
        s.submit(req(i, 50 if i < 4 else 900))
    assert s.n_max(free_pages=10_000) == 2
    s.admit(free_slots=2, free_pages=10_000)  # 5 waiting > 2, 4 of 5 below 512: split
    assert len(s.buckets) > 1
