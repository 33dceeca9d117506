"""KVCache: growth in steps, the valid prefix, trimming and accounting."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxr_core.model.cache import KVCache


def kv(length: int, start: int = 0, heads: int = 2, dim: int = 4) -> tuple[mx.array, mx.array]:
    positions = mx.arange(start, start + length, dtype=mx.float32)[None, None, :, None]
    keys = mx.broadcast_to(positions, (1, heads, length, dim))
    return keys, -keys[..., :3]  # values may have their own head dim


def test_update_returns_every_position_so_far():
    cache = KVCache()
    assert cache.offset == 0 and cache.state == [] and cache.nbytes == 0
    keys, values = cache.update_and_fetch(*kv(5))
    assert keys.shape == (1, 2, 5, 4) and values.shape == (1, 2, 5, 3)
    keys, values = cache.update_and_fetch(*kv(1, start=5))
    assert cache.offset == len(cache) == 6
    np.testing.assert_array_equal(np.array(keys[0, 0, :, 0]), np.arange(6))
    np.testing.assert_array_equal(np.array(values[0, 1, :, 0]), -np.arange(6))


def test_buffers_grow_in_steps_and_keep_their_contents():
    step = KVCache.step
    assert step % 8 == 0 and step % 256  # aligned rows; not a cuDNN decode capacity (see CACHE_STEP)
    cache = KVCache()
    cache.update_and_fetch(*kv(step - 6))
    assert cache.keys is not None and cache.keys.shape[2] == step
    first_buffer_bytes = cache.nbytes
    keys, _ = cache.update_and_fetch(*kv(10, start=step - 6))
    assert cache.keys.shape[2] == 2 * step and cache.nbytes == 2 * first_buffer_bytes
    np.testing.assert_array_equal(np.array(keys[0, 0, :, 0]), np.arange(step + 4))
    keys, _ = cache.update_and_fetch(*kv(600, start=step + 4))  # one update larger than a step
    assert cache.keys.shape[2] == 4 * step and keys.shape[2] == step + 604
    np.testing.assert_array_equal(np.array(keys[0, 1, :, 3]), np.arange(step + 604))


def test_trim_forgets_the_last_positions():
    cache = KVCache()
    cache.update_and_fetch(*kv(8))
    assert cache.is_trimmable()
    assert cache.trim(3) == 3 and cache.offset == 5
    keys, _ = cache.update_and_fetch(*kv(2, start=100))
    np.testing.assert_array_equal(np.array(keys[0, 0, :, 0]), [0, 1, 2, 3, 4, 100, 101])
    assert cache.trim(50) == 7 and cache.offset == 0
    assert cache.trim(-1) == 0


def test_state_is_what_a_prefill_chunk_must_evaluate():
    cache = KVCache()
    cache.update_and_fetch(*kv(3))
    mx.eval(cache.state)
    step = KVCache.step
    assert [a.shape for a in cache.state] == [(1, 2, step, 4), (1, 2, step, 3)]
    assert cache.nbytes == sum(a.nbytes for a in cache.state)


def test_an_empty_batch_row_takes_the_shape_of_its_layer():
    """The engine makes a one-token prompt's empty rows in one shape for every layer; a layer
    whose heads or head size differ (Gemma 4's global layers) still joins and decodes them."""
    from mlxr_core.model.cache import BatchKVCache

    def empty() -> BatchKVCache:
        return BatchKVCache(mx.zeros((1, 1, 0, 8)), mx.zeros((1, 1, 0, 8)), [0], 0)

    row = BatchKVCache.from_cache(KVCache.from_arrays(*kv(3)))  # 2 heads, keys 4 wide, values 3
    row.extend(empty())
    keys, values = row.update_and_fetch(*kv(1, start=3, heads=2, dim=4))
    assert keys.shape == (2, 2, 4, 4) and values.shape == (2, 2, 4, 3) and row.left_padding == [0, 3]
    alone = empty()  # a batch of only empty rows: the first update gives the shape
    keys, values = alone.update_and_fetch(*kv(1, heads=2, dim=4))
    assert keys.shape == (1, 2, 1, 4) and values.shape == (1, 2, 1, 3)
    alone.extend(BatchKVCache.from_cache(KVCache.from_arrays(*kv(2))))
    assert alone.keys.shape[:2] == (2, 2) and alone.left_padding == [1, 0]
