"""PageAllocator: no double allocation, no leak, null page never handed out (property tests)."""

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from eejax.cache import NULL_PAGE, PageAllocator, prefix_keys
from eejax.errors import OutOfPagesError


class AllocatorMachine(RuleBasedStateMachine):
    """Holders allocate fresh pages, share cached prefixes (`match`), publish full pages under
    prefix keys and free; the model below tracks who holds what."""

    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(17)
        self.holders: list[list[int]] = []
        # Prefix keys of 3 "prompts" of 6 pages each (two share their first 2 pages).
        prompts = [[1] * 12 + [2] * 12, [1] * 12 + [3] * 12, [4] * 24]
        self.keys = [prefix_keys(p, 4) for p in prompts]

    @rule(n=st.integers(0, 20))
    def allocate(self, n):
        free_before, idle_before = self.alloc.num_free, self.idle()
        held_before = {p for h in self.holders for p in h}
        if n > free_before:
            with pytest.raises(OutOfPagesError) as e:
                self.alloc.allocate(n)
            assert (e.value.requested, e.value.available) == (n, free_before)
            assert self.alloc.num_free == free_before  # all or nothing
        else:
            pages = self.alloc.allocate(n)
            assert len(pages) == n and not set(pages) & held_before  # eviction takes idle pages only
            assert all(self.alloc.writable(p) for p in pages)
            assert set(pages) - idle_before <= set(range(1, 17))
            self.holders.append(pages)

    @rule(prompt=st.integers(0, 2), n=st.integers(0, 6))
    def match(self, prompt, n):
        pages = self.alloc.match(self.keys[prompt][:n])
        assert len(pages) <= n and len(set(pages)) == len(pages)
        assert not any(self.alloc.writable(p) for p in pages)  # shared: never written
        self.holders.append(pages)

    @precondition(lambda self: any(self.holders))
    @rule(data=st.data(), prompt=st.integers(0, 2))
    def publish(self, data, prompt):
        # A holder writes a prompt's pages past its cached prefix into its writable pages and
        # publishes them; a key still cached past an evicted one keeps its page (and the
        # holder's page stays its own).
        holder = data.draw(st.sampled_from([h for h in self.holders if h]))
        cached = next((i for i, key in enumerate(self.keys[prompt]) if key not in self.alloc._by_key), 6)
        for page, key in zip([p for p in holder if self.alloc.writable(p)], self.keys[prompt][cached:]):
            self.alloc.publish(page, key)
            assert (self.alloc._by_key[key] == page) != self.alloc.writable(page)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free(self, data):
        pages = self.holders.pop(data.draw(st.integers(0, len(self.holders) - 1)))
        self.alloc.free(pages)

    @precondition(lambda self: self.holders and self.holders[0])
    @rule()
    def double_free_is_refused(self):
        pages = self.holders[0]
        self.alloc.free(pages)
        if not any(p in self.alloc._refs for p in pages):  # (a page another holder shares stays held)
            with pytest.raises(ValueError):
                self.alloc.free(pages)
        self.holders[0] = self.alloc.allocate(min(len(pages), self.alloc.num_free))

    def idle(self) -> set[int]:
        return set(self.alloc._idle)

    @invariant()
    def pages_are_partitioned_and_counted(self):
        held = collections.Counter(p for h in self.holders for p in h)
        assert NULL_PAGE not in held
        assert all(len(set(h)) == len(h) for h in self.holders)
        assert dict(held) == self.alloc._refs, "reference counts differ from the holders"
        idle = self.idle()
        assert not idle & set(held) and idle <= set(self.alloc._key_of)  # idle pages are keyed, unheld
        assert self.alloc.num_free + len(held) == 16, "a page leaked"
        assert self.alloc.num_allocated == len(held)
        assert set(self.alloc._key_of) <= set(held) | idle
        for page in held:
            assert self.alloc.writable(page) == (held[page] == 1 and page not in self.alloc._key_of)

    def teardown(self):
        for pages in self.holders:  # every holder frees: nothing stays held
            self.alloc.free(pages)
        assert self.alloc.num_allocated == 0 and self.alloc.num_free == 16


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(0, 5), max_size=10))
def test_allocate_all_then_free_all_restores_everything(sizes):
    alloc = PageAllocator(64)
    held = [alloc.allocate(n) for n in sizes]
    for pages in held:
        alloc.free(pages)
    assert alloc.num_free == 63 and alloc.num_allocated == 0
    assert sorted(alloc.allocate(63)) == list(range(1, 64))


def test_freeing_unknown_or_duplicate_pages_is_an_error():
    alloc = PageAllocator(4)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([2])
    pages = alloc.allocate(2)
    with pytest.raises(ValueError, match="twice"):
        alloc.free([pages[0], pages[0]])
    with pytest.raises(ValueError):
        PageAllocator(1)


def test_shared_prefix_pages_are_matched_and_evicted_tail_first():
    alloc = PageAllocator(6)  # 5 usable pages
    keys = prefix_keys(list(range(14)), 4)  # 3 full pages (the last 2 tokens are no page)
    assert len(keys) == 3 and prefix_keys(list(range(12)) + [99, 98], 4) == keys
    assert prefix_keys([7] + list(range(1, 14)), 4)[1] != keys[1]  # a key names the whole prefix
    row = alloc.allocate(4)
    for page, key in zip(row, keys):
        alloc.publish(page, key)
    assert [alloc.writable(p) for p in row] == [False, False, False, True]
    other = alloc.match(keys[:2] + [b"unknown"])
    assert other == row[:2] and alloc._refs[row[0]] == 2
    alloc.free(row)
    alloc.free(other)
    assert alloc.num_allocated == 0 and alloc.num_cached == 3 and alloc.num_free == 5
    fresh = alloc.allocate(3)  # 2 free pages, then the least recently used idle one: the tail
    assert row[2] in fresh and alloc.evictions == 1
    assert alloc.match(keys) == row[:2]
    alloc.free(row[:2])
    assert alloc.evict_idle() == 2 and alloc.num_cached == 0 and alloc.match(keys) == []
    assert alloc.num_free == 5 - len(fresh)
