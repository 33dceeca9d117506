"""The recurrent layer cache of the cache protocol: rows join, leave and come back out as the
engine moves them; a state is never trimmed and is restored only whole."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.model.cache import (
    BatchLayerCache,
    KVCache,
    LayerCache,
    RecurrentCache,
    attending_layer,
    batch_mask,
    reserve_bytes,
)

CONV, STATE = (3, 5), (2, 4, 4)


def filled(seed: int, length: int) -> RecurrentCache:
    cache = RecurrentCache(CONV, STATE)
    key = mx.random.key(seed)
    cache.update(mx.random.normal((1, *CONV), key=key), mx.random.normal((1, *STATE), key=key), length)
    return cache


def test_both_kinds_satisfy_the_protocol():
    for cache in (KVCache(), RecurrentCache(CONV, STATE)):
        assert isinstance(cache, LayerCache)
        assert isinstance(cache.to_batch(), BatchLayerCache)


def test_rows_join_leave_and_come_back_out():
    a, b = filled(0, 7), filled(1, 3)
    batch = a.to_batch()
    batch.extend(b.to_batch())
    assert batch.batch_size == 2 and isinstance(batch.offset, mx.array)
    batch.filter([1])
    row = batch.extract(0)
    assert row.offset == 3
    np.testing.assert_array_equal(np.array(row.recurrent_state), np.array(b.recurrent_state))
    np.testing.assert_array_equal(np.array(row.conv_state), np.array(b.conv_state))


def test_a_row_that_has_seen_nothing_joins_as_zeros():
    """A one-token prompt's row (no state yet) beside a prefilled one, in either order."""
    for first, second in ((RecurrentCache(CONV, STATE), filled(0, 4)), (filled(0, 4), RecurrentCache(CONV, STATE))):
        batch = first.to_batch()
        batch.extend(second.to_batch())
        assert batch.conv_state.shape == (2, *CONV) and batch.recurrent_state.shape == (2, *STATE)
        empty = 0 if first.offset == 0 else 1
        assert not np.any(np.array(batch.recurrent_state[empty]))
    nothing = RecurrentCache(CONV, STATE).to_batch()
    nothing.extend(RecurrentCache(CONV, STATE).to_batch())
    assert nothing.batch_size == 2 and nothing.state == []


def test_a_recurrent_state_is_not_trimmed_and_restores_whole():
    cache = filled(0, 5)
    assert not cache.is_trimmable() and cache.trim(0) == 0
    with pytest.raises(ValueError):
        cache.trim(1)
    fresh = RecurrentCache(CONV, STATE)
    fresh.restore(cache.snapshot(), 5)
    assert fresh.offset == 5 and not RecurrentCache.partial_reuse and KVCache.partial_reuse


def test_the_budget_counts_a_recurrent_state_once_per_sequence():
    caches = [RecurrentCache(CONV, STATE), KVCache()]
    per_sequence = 3 * 5 * 2 + 2 * 4 * 4 * 4  # conv in the activations' dtype, state in float32
    assert reserve_bytes(caches, 0, 100, itemsize=2) == per_sequence
    assert reserve_bytes(caches, 10, 100, itemsize=2) == per_sequence + 1000


def test_the_padding_mask_comes_from_the_first_attention_layer():
    keys = mx.zeros((1, 1, 3, 2))
    long_row, short_row = KVCache.from_arrays(keys, keys).to_batch(), KVCache.from_arrays(keys[:, :, :1], keys[:, :, :1]).to_batch()
    long_row.extend(short_row)
    recurrent = filled(0, 3).to_batch()
    recurrent.extend(filled(1, 1).to_batch())
    assert attending_layer([recurrent, long_row]) == 1
    mask = batch_mask([recurrent, long_row])
    assert mask is not None and mask.shape == (2, 1, 1, 4)
    assert batch_mask([recurrent]) is None
