"""Shape buckets: prompt lengths, batch sizes and page counts are rounded up to a small set
of sizes (powers of two and 1.5x powers of two) so the number of compiled programs stays
bounded while padding wastes at most a third."""

from __future__ import annotations

MIN_PROMPT_BUCKET = 16  # the shortest prompt bucket: shorter prompts pad to 16 tokens


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest size in {2^k, 3*2^(k-1)} that is >= max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    p = 1
    while p < n:
        if p >= 2 and p + p // 2 >= n:
            return p + p // 2
        p *= 2
    return p


def batch_bucket(n: int) -> int:
    """Batch sizes are powers of two (1, 2, 4, 8, ...)."""
    p = 1
    while p < n:
        p *= 2
    return p
