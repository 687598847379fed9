"""The engine's slots part alone (`engine/slots.py`): rows take, grow and release pages, the block
table follows, prompt pages are shared through the prefix cache (SlotPages); rows hold slots while
they prefill and decode (SlotTable)."""

import numpy as np
import pytest

from eejax.engine.sequence import Request, Sequence
from eejax.engine.slots import SlotPages, SlotTable
from eejax.errors import OutOfPagesError

PAGE = 4


def row(i: int, prompt: list[int], **kw) -> Sequence:
    return Sequence(Request(i, prompt, max_new_tokens=8, **kw))


def test_a_row_takes_fresh_pages_and_its_table_row_lists_them():
    pages = SlotPages(num_pages=8, slots=2, page_size=PAGE, table_width=4, prefix_caching=True)
    seq = row(0, list(range(10)))
    pages.take(seq, slot=1, positions=10)
    assert seq.slot == 1 and len(seq.pages) == 3 and seq.cached == 0
    assert pages.table(4)[1].tolist() == [*seq.pages, 0] and pages.table(4)[0].tolist() == [0] * 4
    assert pages.row(1, 2).tolist() == seq.pages[:2]
    assert pages.writable(seq, 0) and pages.num_free == 7 - 3
    assert pages.metrics()["kv_pages_used"] == 3
    assert pages.width(5) == 2 and pages.width(100) == 4  # bucketed pages, at most the table's


def test_a_published_prompt_is_shared_by_the_next_that_starts_alike():
    pages = SlotPages(num_pages=16, slots=3, page_size=PAGE, table_width=4, prefix_caching=True)
    first = row(0, list(range(9)))
    pages.take(first, 0, 12)
    pages.publish(first)  # pages 0 and 1 are full prompt pages
    second = row(1, [*range(8), 99])
    pages.take(second, 1, 12)
    assert second.pages[:2] == first.pages[:2] and second.cached == 2 * PAGE
    assert second.pages[2] not in first.pages and pages.table(4)[1, :3].tolist() == second.pages
    assert not pages.writable(second, 0) and pages.writable(second, 2 * PAGE)
    # At least the prompt's last token is prefilled: a prompt of exactly two pages shares one.
    exact = row(2, list(range(8)))
    pages.take(exact, 2, 9)
    assert exact.cached == PAGE
    # A prompt that must be scored shares nothing: each position needs its logits.
    pages.release(exact, clear_row=True)
    scored = row(3, list(range(9)), prompt_logprobs=0)
    pages.take(scored, 2, 12)
    assert scored.cached == 0 and not set(scored.pages) & set(first.pages)


def two_rows_alike(prefix_caching: bool):
    """Pages where a row took 12 positions for a 9-token prompt and published it, and a second
    row with the same prompt took as many after it."""
    pages = SlotPages(num_pages=16, slots=2, page_size=PAGE, table_width=4, prefix_caching=prefix_caching)
    first, second = row(0, list(range(9))), row(1, list(range(9)))
    pages.take(first, 0, 12)
    pages.publish(first)
    pages.take(second, 1, 12)
    return pages, first, second


def test_without_prefix_caching_nothing_is_shared():
    pages, first, second = two_rows_alike(prefix_caching=False)
    assert second.cached == 0 and not set(second.pages) & set(first.pages)


def test_a_row_grows_until_no_page_is_left_and_keeps_what_it_got():
    pages = SlotPages(num_pages=5, slots=1, page_size=PAGE, table_width=8, prefix_caching=True)
    seq = row(0, [1, 2, 3])
    pages.take(seq, 0, 4)
    assert pages.grow(seq, 3) and len(seq.pages) == 3
    assert not pages.grow(seq, 6) and len(seq.pages) == 4 and pages.num_free == 0
    assert pages.table(8)[0].tolist() == [*seq.pages, 0, 0, 0, 0]


def test_release_frees_a_rows_pages_and_clears_its_row_only_if_asked():
    pages, first, second = two_rows_alike(prefix_caching=True)
    shared = first.pages[:2]
    pages.release(first, clear_row=False)  # its slot went to another row meanwhile
    assert first.pages == [] and pages.table(4)[0, :3].any()
    assert pages.metrics()["kv_pages_used"] == 3  # the shared pages stay with `second`
    pages.release(second, clear_row=True)
    assert pages.table(4)[1].tolist() == [0] * 4
    assert pages.metrics() == {
        "kv_pages_used": 0,
        "kv_pages_total": 15,
        "kv_pages_cached": 2,
        "prefix_cache_evictions": 0,
    }
    again = row(2, list(range(9)))
    pages.take(again, 0, 12)
    assert again.pages[:2] == shared  # idle prompt pages are shared again


def test_a_take_that_runs_out_holds_nothing():
    pages = SlotPages(num_pages=4, slots=2, page_size=PAGE, table_width=4, prefix_caching=True)
    first = row(0, list(range(9)))
    pages.take(first, 0, 9)
    pages.publish(first)
    before = pages.allocator.num_allocated
    with pytest.raises(OutOfPagesError):
        pages.take(row(1, list(range(9))), 1, 16)  # shares 2 pages, needs 2 fresh: 0 left
    assert pages.allocator.num_allocated == before and np.all(pages.table(4)[1] == 0)


def test_a_row_holds_its_slot_from_admission_to_release():
    table = SlotTable(3, SlotPages(num_pages=16, slots=3, page_size=PAGE, table_width=4, prefix_caching=True))
    first = row(0, list(range(9)))
    table.admit(first, 1, 12)
    assert dict(table.prefilling) == {1: first} and not table.running and table.free() == [0, 2]
    with pytest.raises(ValueError, match="slot 1 is held"):
        table.admit(row(1, [5]), 1, 4)
    table.start_decoding(first)
    assert dict(table.running) == {1: first} and not table.prefilling
    with pytest.raises(TypeError):
        table.running[0] = first  # the views are read-only: only the part's methods change them
    second = row(2, list(range(9)))
    table.admit(second, 0, 12)
    assert second.cached == 2 * PAGE  # start_decoding published the first row's prompt pages
    assert table.release(first) and first.slot is None and first.pages == [] and table.free() == [1, 2]
    assert not table.release(second)  # it was prefilling: nothing to stop on the device
    assert not table.release(second) and table.free() == [0, 1, 2]  # released twice: nothing held


def test_a_row_released_after_its_slot_moved_on_leaves_the_new_holders_table_row():
    table = SlotTable(1, SlotPages(num_pages=16, slots=1, page_size=PAGE, table_width=4, prefix_caching=False))
    old = row(0, [1, 2, 3])
    table.admit(old, 0, 4)
    stale = old.slot, list(old.pages)
    table.release(old)
    new = row(1, [4, 5, 6])
    table.admit(new, 0, 4)
    old.placement.slot, old.placement.pages = stale[0], []  # a stale record of the slot (a cancelled row read late)
    assert not table.release(old)
    assert table.pages.table(4)[0, 0] == new.pages[0] and dict(table.prefilling) == {0: new}
