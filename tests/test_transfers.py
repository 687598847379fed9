"""What the engine moves between host and device per step (`engine/transfers.py`), and the program
cache's key, which the engine computes per dispatch (`ProgramCache._key`)."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eejax.decode.programs import ProgramCache
from eejax.engine.transfers import PackedRead, Uploads
from eejax.options import StepOptions


def test_packed_read_gives_back_every_array_as_it_was():
    rng = np.random.default_rng(0)
    tree = (
        jnp.asarray(rng.integers(-5, 9, (4,)), jnp.int32),
        jnp.asarray(rng.random((4,)) > 0.5),
        jnp.asarray(rng.integers(0, 50_000, (4, 7)), jnp.int32),
        {"a": jnp.asarray(rng.integers(0, 30, (4, 7)), jnp.int16), "b": jnp.zeros((0,), jnp.int32)},
    )
    out = PackedRead(tree).read()
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, np.asarray(want))


def test_packed_read_refuses_floats():
    with pytest.raises(TypeError, match="integer and bool"):
        PackedRead((jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.float32)))


def test_uploads_send_again_only_what_changed():
    uploads = Uploads(size=2)
    table = np.arange(12, dtype=np.int32).reshape(3, 4)
    first = uploads.get("table", table)
    assert uploads.get("table", table.copy()) is first  # same contents: the same device array
    table[1, 2] = 99  # changed in place: sent again, and the first copy keeps the old contents
    second = uploads.get("table", table)
    assert second is not first
    np.testing.assert_array_equal(np.asarray(second), table)
    assert np.asarray(first)[1, 2] == 6
    # On a CPU device_put may alias an array's memory (by its alignment: about half the time);
    # what is sent is the upload's own copy, so no later change of the caller's array reaches it.
    for i in range(20):
        fresh = np.arange(64, dtype=np.int32)
        sent = uploads.get(("fresh", i), fresh)
        fresh[0] = 99
        assert int(sent[0]) == 0, i
    assert uploads.get("table", table[:, :2]) is not second  # another shape
    uploads.get("a", table), uploads.get("b", table)  # at most 2 kept: "table" dropped
    assert uploads.get("table", table[:, :2]) is not second


def _double(weights, y, *, config, options):
    return {k: w * 2 + y for k, w in weights.items()}


def test_program_cache_keys_the_weights_by_their_arrays():
    """The weights' part of the key is reused while args[0] is the very same tree (never
    flattened again: params are not changed in place) or holds the very same arrays, and
    recomputed when any is another array (its shape may differ)."""
    cache = ProgramCache()
    options, weights = StepOptions(4), {"w": jnp.ones((3,))}
    key = cache._key(_double, (weights, jnp.ones((3,))), None, options)
    with mock.patch.object(jax.tree, "leaves", side_effect=AssertionError("flattened the same weights")):
        assert cache._key(_double, (weights, jnp.zeros((3,))), None, options) == key
    assert cache._key(_double, (dict(weights), jnp.zeros((3,))), None, options) == key
    assert cache._key(_double, ({"w": jnp.ones((5,))}, jnp.ones((3,))), None, options) != key
    assert cache._key(_double, ({"w": jnp.ones((3,))}, jnp.ones((3,))), None, options) == key
    assert cache._key(_double, ({"w": jnp.ones((3,))}, jnp.ones((4,))), None, options) != key
    program = cache.get(_double, ({"w": jnp.ones((3,))}, jnp.ones((3,))), None, options)
    np.testing.assert_array_equal(np.asarray(program({"w": jnp.ones((3,))}, jnp.ones((3,)))["w"]), [3, 3, 3])
