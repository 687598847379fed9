"""Torch-free unit tests of the shape buckets and byte sizes that bound the compiled programs."""

import pytest

from eejax.cache import parse_bytes
from eejax.decode.buckets import MIN_PROMPT_BUCKET, batch_bucket, bucket
from eejax.errors import EejaxError


def test_buckets_and_sizes():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 7, 9, 13, 17, 100)] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 128]
    assert all(bucket(n) >= n and bucket(n) <= max(2, 1.5 * n) for n in range(1, 3000))
    assert parse_bytes("1GiB") == 2**30 and parse_bytes("512MB") == 512 * 10**6 and parse_bytes(42) == 42
    with pytest.raises(EejaxError):
        parse_bytes("lots")


def test_batch_and_prompt_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 33)] == [1, 2, 4, 8, 8, 16, 64]
    assert bucket(1) < MIN_PROMPT_BUCKET == bucket(MIN_PROMPT_BUCKET)  # prompts start at their own bucket
