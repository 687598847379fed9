"""PageAllocator: no double allocation, no leak, null page never handed out (property tests)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from eejax.cache import NULL_PAGE, PageAllocator
from eejax.errors import OutOfPagesError


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(17)
        self.holders: list[list[int]] = []

    @rule(n=st.integers(0, 20))
    def allocate(self, n):
        free_before = self.alloc.num_free
        if n > free_before:
            with pytest.raises(OutOfPagesError) as e:
                self.alloc.allocate(n)
            assert (e.value.requested, e.value.available) == (n, free_before)
            assert self.alloc.num_free == free_before  # all or nothing
        else:
            pages = self.alloc.allocate(n)
            assert len(pages) == n
            self.holders.append(pages)

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
        with pytest.raises(ValueError):
            self.alloc.free(pages)
        self.holders[0] = self.alloc.allocate(len(pages))

    @invariant()
    def pages_are_partitioned(self):
        held = [p for h in self.holders for p in h]
        assert len(held) == len(set(held)), "a page is owned twice"
        assert NULL_PAGE not in held
        assert self.alloc.num_allocated == len(held)
        assert self.alloc.num_free + len(held) == 16, "a page leaked"


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


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
