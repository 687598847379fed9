"""The engine's decode slots and their KV pages, a part of `Engine` that owns its state: which
row holds each slot (`SlotTable`: prefilling its prompt, or running), and the page allocator
(free pages, the prefix cache's keyed pages, pages several rows share) with the block table the
programs read, a row per slot (`SlotPages`). The engine's other parts read them and change them
only through these methods; a row's `Sequence` records its slot and pages (`slot`, `pages`,
`cached`), which only this part writes."""

from __future__ import annotations

from types import MappingProxyType

import numpy as np

from eejax.cache import PageAllocator, pages_needed, prefix_keys
from eejax.decode.buckets import bucket
from eejax.engine.sequence import Sequence
from eejax.errors import OutOfPagesError


class SlotPages:
    """`num_pages` pages of `page_size` positions (page 0 is the null page) for `slots` rows,
    whose block table rows are `table_width` pages wide. `prefix_caching`: full pages of prompt
    tokens are kept under a key of their prefix (`publish`) and shared by later prompts that
    start alike (`take`)."""

    def __init__(self, num_pages: int, slots: int, page_size: int, table_width: int, prefix_caching: bool):
        self.allocator = PageAllocator(num_pages)  # read its counts; change pages through this part
        self.page_size, self.prefix_caching = page_size, prefix_caching
        self._table = np.zeros((slots, table_width), np.int32)

    def width(self, positions: int) -> int:
        """The block-table width a program over rows of up to `positions` cache positions takes:
        their pages, bucketed (few programs), at most the table's."""
        return min(self._table.shape[1], bucket(pages_needed(positions, self.page_size)))

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free(self) -> int:
        """Pages a row can still get: free ones and the prefix cache's idle ones."""
        return self.allocator.num_free

    def take(self, seq: Sequence, slot: int, positions: int) -> None:
        """Gives `seq` slot `slot` and pages for `positions` cache positions: first those of the
        longest prefix of its prompt that the cache holds (`seq.cached` of its positions need no
        prefill; a row whose prompt is scored shares none: each position needs its logits), the
        rest fresh. At least the prompt's last token is left to prefill. Raises OutOfPagesError,
        holding nothing, if too few pages are free."""
        shared = []
        if self.prefix_caching and not seq.scoring_prompt:
            shareable = (len(seq.prompt) + seq.offset - 1) // self.page_size
            shared = self.allocator.match(prefix_keys(seq.prompt, self.page_size)[:shareable])
        try:  # (a shared page only lowers the need)
            fresh = self.allocator.allocate(pages_needed(positions, self.page_size) - len(shared))
        except BaseException:
            self.allocator.free(shared)
            raise
        placed = seq.placement
        placed.slot, placed.pages, placed.cached = slot, shared + fresh, len(shared) * self.page_size
        self._table[slot] = 0
        self._table[slot, : len(seq.pages)] = seq.pages

    def grow(self, seq: Sequence, pages: int) -> bool:
        """Adds fresh pages to a row until it holds `pages`; False if none is left (it keeps
        those it got)."""
        while len(seq.pages) < pages:
            try:
                (page,) = self.allocator.allocate(1)
            except OutOfPagesError:
                return False
            self._table[seq.slot, len(seq.pages)] = page
            seq.placement.pages.append(page)
        return True

    def release(self, seq: Sequence, clear_row: bool) -> None:
        """Frees the row's pages (a shared page stays with its other holders; a published one
        stays in the prefix cache) and, if `clear_row` (the slot is still the row's), points
        its block table row at the null page."""
        if clear_row:
            self._table[seq.slot] = 0
        if seq.pages:
            self.allocator.free(seq.pages)
            seq.placement.pages = []

    def publish(self, seq: Sequence) -> None:
        """Keys the row's full prompt pages, now written (prefills run in order on the device):
        later prompts that start alike share them. Only prompt pages, computed at full depth by
        the prefill, so they are valid for any early-exit or speculation setting."""
        if self.prefix_caching:
            for page, key in zip(seq.pages, prefix_keys(seq.prompt, self.page_size)):
                self.allocator.publish(page, key)

    def writable(self, seq: Sequence, position: int) -> bool:
        """Whether every page of the row from `position` on is the row's alone to write."""
        return all(self.allocator.writable(p) for p in seq.pages[position // self.page_size :])

    def table(self, width: int) -> np.ndarray:
        """The block table's first `width` pages of every slot [slots, width] (a view)."""
        return self._table[:, :width]

    def row(self, slot: int, width: int) -> np.ndarray:
        """A slot's first `width` pages [width] (a view)."""
        return self._table[slot, :width]

    def metrics(self) -> dict[str, int]:
        allocator = self.allocator
        return {
            "kv_pages_used": allocator.num_allocated,
            "kv_pages_total": allocator.num_free + allocator.num_allocated,
            "kv_pages_cached": allocator.num_cached,
            "prefix_cache_evictions": allocator.evictions,
        }


class SlotTable:
    """`size` decode slots, each free or held by one row: `prefilling` (admitted, its prompt not
    all in the cache yet) or `running` (decoding), both read-only views slot -> row. The rows'
    pages and block table are `pages`."""

    def __init__(self, size: int, pages: SlotPages):
        self.size, self.pages = size, pages
        self._prefilling: dict[int, Sequence] = {}
        self._running: dict[int, Sequence] = {}
        self.prefilling = MappingProxyType(self._prefilling)
        self.running = MappingProxyType(self._running)

    def rows(self) -> list[Sequence]:
        """The rows that hold a slot: decoding, then prefilling their prompt."""
        return [*self._running.values(), *self._prefilling.values()]

    def free(self) -> list[int]:
        """The slots no row holds, in order."""
        return [s for s in range(self.size) if s not in self._running and s not in self._prefilling]

    def admit(self, seq: Sequence, slot: int, positions: int) -> None:
        """`seq` takes free slot `slot` and pages for `positions` cache positions (`SlotPages.take`:
        a cached prefix shared), and prefills from the next prefill on."""
        if slot in self._running or slot in self._prefilling:
            raise ValueError(f"slot {slot} is held")
        self.pages.take(seq, slot, positions)
        self._prefilling[slot] = seq

    def start_decoding(self, seq: Sequence) -> None:
        """The row's prompt is all in the cache: it decodes from the next step, and its full
        prompt pages join the prefix cache."""
        del self._prefilling[seq.slot]
        self._running[seq.slot] = seq
        self.pages.publish(seq)

    def release(self, seq: Sequence) -> bool:
        """Frees the row's slot, if it still holds it, and its pages; whether it was running (its
        slot's device state must then stop it)."""
        running = seq.slot is not None and self._running.get(seq.slot) is seq
        prefilling = seq.slot is not None and self._prefilling.get(seq.slot) is seq
        if running:
            del self._running[seq.slot]
        elif prefilling:
            del self._prefilling[seq.slot]
        self.pages.release(seq, clear_row=running or prefilling)
        seq.placement.slot = None
        return running
