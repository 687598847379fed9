"""Host-side page allocator for the paged KV cache.

Invariants (property-tested): page 0 is never handed out (it is the null page that padding
writes into); a page is owned by at most one holder at a time; free + allocated pages always
partition pages 1..num_pages-1; freeing a page that is not allocated is an error.
"""

from __future__ import annotations

from eejax.errors import OutOfPagesError

NULL_PAGE = 0


class PageAllocator:
    """Free-list allocator over pages 1..num_pages-1 (page 0 is the null page)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a paged cache needs at least 2 pages (1 null + 1 usable), got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps a batch's pages dense.
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

    def allocate(self, n: int) -> list[int]:
        """Hands out `n` distinct pages, or raises OutOfPagesError and hands out none."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise OutOfPagesError(n, len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        self._allocated.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Returns pages to the free list; every page must be currently allocated, once."""
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages freed twice in one call: {sorted(pages)}")
        stray = [p for p in pages if p not in self._allocated]
        if stray:
            raise ValueError(f"freeing pages that are not allocated: {stray}")
        self._allocated.difference_update(pages)
        self._free.extend(reversed(pages))
