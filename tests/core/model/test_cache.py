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


def reference_into_cache(q, k, v, k_buffer, v_buffer, start, *, scale, mask):
    """An ``into_cache`` made of the reference ops (slice updates, then attention)."""
    from mlxr_plugins.kernels import reference

    k_buffer[:, :, start : start + k.shape[2]] = k
    v_buffer[:, :, start : start + k.shape[2]] = v
    S = start + k.shape[2]
    return reference.attention(q, k_buffer[:, :, :S], v_buffer[:, :, :S], scale=scale, mask=mask), k_buffer, v_buffer


def test_write_and_attend_is_update_and_fetch_then_attention_with_the_window():
    """KVCache and BatchKVCache (left-padded rows) hand their buffers to an attention kernel's
    into_cache; the sliding window joins the mask as the attention layer makes it."""
    from mlxr_core.model.cache import BatchKVCache
    from mlxr_core.model.masks import window_mask
    from mlxr_plugins.kernels import reference

    mx.random.seed(3)
    for window in (None, 4):
        single, batch = KVCache(), BatchKVCache.empty()
        fetched_single, fetched_batch = KVCache(), BatchKVCache.empty()
        for length in (6, 1, 1, 1):  # a prompt, then decode steps past the window
            B = 1
            q = mx.random.normal((B, 4, length, 8))
            k, v = mx.random.normal((B, 2, length, 8)), mx.random.normal((B, 2, length, 8))
            mask = "causal" if length > 1 else None
            out = single.write_and_attend(q, k, v, reference_into_cache, scale=0.3, mask=mask, window=window)
            keys, values = fetched_single.update_and_fetch(k, v)
            full = window_mask(mask, length, keys.shape[2], window) if window else mask
            np.testing.assert_allclose(np.array(out), np.array(reference.attention(q, keys, values, scale=0.3, mask=full)), atol=1e-6)
            out = batch.write_and_attend(q, k, v, reference_into_cache, scale=0.3, mask=mask, window=window)
            keys, values = fetched_batch.update_and_fetch(k, v)
            np.testing.assert_allclose(np.array(out), np.array(reference.attention(q, keys, values, scale=0.3, mask=full)), atol=1e-6)
        assert single.offset == fetched_single.offset == batch.length == 9


def test_write_and_attend_writes_nothing_when_the_kernel_declines():
    cache = KVCache()
    cache.update_and_fetch(*kv(3))
    declined = cache.write_and_attend(*(mx.zeros((1, 2, 1, 4)),) * 3, lambda *a, **kw: None, scale=1.0, mask=None)
    assert declined is None and cache.offset == 3


def test_a_subclass_storing_positions_its_own_way_is_not_bypassed():
    class Doubling(KVCache):
        def update_and_fetch(self, keys, values):
            return super().update_and_fetch(keys * 2, values)

    cache = Doubling()
    assert cache.write_and_attend(*(mx.zeros((1, 2, 1, 4)),) * 3, reference_into_cache, scale=1.0, mask=None) is None
    assert cache.offset == 0
