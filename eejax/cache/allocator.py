"""Host-side page allocator for the paged KV cache, with reference counts and a prefix cache.

A page is *free*, *held* (reference count >= 1: rows whose block tables list it) or *idle*
(count 0, but its content is kept under a prefix key and can be shared again; idle pages are
evicted least recently used when fresh pages run out). A held page may also be keyed: its
content is a full page of prompt tokens, computed once and shared by every row whose prompt
starts with the same tokens (`match`).

Invariants (property-tested): page 0 is never handed out (it is the null page that padding
writes into); free, held and idle pages partition pages 1..num_pages-1; a fresh page has one
holder; freeing a page that is not held is an error; reference counts return to zero when every
holder has freed; eviction takes idle pages only; a page the allocator shares (`match`) or keys
(`publish`) is not `writable`: the engine writes only pages that are.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from eejax.errors import OutOfPagesError

NULL_PAGE = 0


def prefix_keys(tokens, page_size: int) -> list[bytes]:
    """Keys of the full pages of `tokens`: key i identifies tokens[: (i + 1) * page_size] (a
    SHA-256 chain over the pages, so equal keys mean equal prefixes)."""
    keys, parent = [], b""
    ids = np.asarray(tokens, np.int64)
    for i in range(len(ids) // page_size):
        parent = hashlib.sha256(parent + ids[i * page_size : (i + 1) * page_size].tobytes()).digest()
        keys.append(parent)
    return keys


class PageAllocator:
    """Pages 1..num_pages-1 (page 0 is the null page): a free list, reference counts, and the
    keyed pages of the prefix cache."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a paged cache needs at least 2 pages (1 null + 1 usable), got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps a batch's pages dense.
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._refs: dict[int, int] = {}  # held page -> holders
        self._by_key: dict[bytes, int] = {}  # prefix key -> page
        self._key_of: dict[int, bytes] = {}  # keyed page -> its key
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # keyed, unheld; LRU first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: free and idle (evictable) ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_allocated(self) -> int:
        """Held pages."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Keyed pages, held or idle."""
        return len(self._key_of)

    def allocate(self, n: int) -> list[int]:
        """Hands out `n` distinct fresh pages (one holder each, no key), evicting the least
        recently used idle pages when the free list runs short; or raises OutOfPagesError and
        hands out none."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self.num_free:
            raise OutOfPagesError(n, self.num_free)
        while len(self._free) < n:
            self._evict()
        pages = [self._free.pop() for _ in range(n)]
        self._refs.update((p, 1) for p in pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drops one hold on each page (a row's pages in order); a page no one holds becomes idle
        if keyed, else free."""
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages freed twice in one call: {sorted(pages)}")
        stray = [p for p in pages if p not in self._refs]
        if stray:
            raise ValueError(f"freeing pages that are not allocated: {stray}")
        # A row's pages are freed last-first, so that its prefix's tail is evicted before its head
        # (a prefix whose first page is gone cannot be matched).
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                del self._refs[page]
                if page in self._key_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def match(self, keys: list[bytes]) -> list[int]:
        """The pages holding the longest cached prefix of `keys` (`prefix_keys`), each with one
        more holder; the caller must not write them."""
        pages = []
        for key in keys:
            page = self._by_key.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if page in self._idle:
                del self._idle[page]
            self._refs[page] = self._refs.get(page, 0) + 1
        return pages

    def publish(self, page: int, key: bytes) -> None:
        """Records that held `page` holds the full page of tokens `key` names: later rows may
        share it, and no one may write it. A key already cached keeps its first page."""
        if page not in self._refs:
            raise ValueError(f"publishing page {page}, which is not allocated")
        if key in self._by_key or page in self._key_of:
            return
        self._by_key[key] = page
        self._key_of[page] = key

    def writable(self, page: int) -> bool:
        """Whether exactly one holder has `page` and it is not shared through the prefix cache."""
        return self._refs.get(page) == 1 and page not in self._key_of

    def evict_idle(self) -> int:
        """Evicts every idle page (an empty prefix cache, as far as no row holds it); returns how many."""
        n = len(self._idle)
        while self._idle:
            self._evict()
        return n

    def _evict(self) -> None:
        """The least recently used idle page loses its key and becomes free."""
        page, _ = self._idle.popitem(last=False)
        del self._by_key[self._key_of.pop(page)]
        self._free.append(page)
        self.evictions += 1
