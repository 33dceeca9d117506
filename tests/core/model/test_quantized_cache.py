"""Quantized keys and values: attention over the packed cache against full precision, the
``start_after`` switch, and the cache protocol on a batch."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.model.cache import KVCache, batch_mask
from mlxr_core.model.quantized_cache import (
    BatchQuantizedKVCache,
    KVQuantization,
    QuantizedKVCache,
    quantize_caches,
    quantized_attention,
)

B, HQ, HKV, D = 2, 6, 2, 64
SCALE = D**-0.5
sdpa = mx.fast.scaled_dot_product_attention


def qkv(L: int, seed: int, rows: int = B) -> tuple[mx.array, mx.array, mx.array]:
    mx.random.seed(seed)
    return (
        mx.random.normal((rows, HQ, L, D)),
        mx.random.normal((rows, HKV, L, D)),
        mx.random.normal((rows, HKV, L, D)),
    )


def attend(cache, queries, keys, values, mask=None, **extra):
    if isinstance(cache, KVCache):
        keys, values = cache.update_and_fetch(keys, values)
        return sdpa(queries, keys, values, scale=SCALE, mask=mask, **extra)
    return cache.update_and_attend(
        queries, keys, values, scale=SCALE, mask=mask, window=None, attention=sdpa, **extra
    )


def relative_error(mine: mx.array, exact: mx.array) -> float:
    return float(mx.linalg.norm(mine - exact) / mx.linalg.norm(exact))


# Relative L2 error, measured on these normal(0, 1) heads: 8-bit up to ~0.008, 4-bit up to ~0.13.
@pytest.mark.parametrize(("bits", "tolerance"), [(8, 0.015), (4, 0.2)])
def test_attention_over_the_packed_cache_is_close_to_full_precision(bits, tolerance):
    exact, packed = KVCache(), QuantizedKVCache(KVQuantization(bits))
    for step, L in enumerate([40, 1, 1, 7]):
        queries, keys, values = qkv(L, step)
        mask = "causal" if L > 1 else None
        mine = attend(packed, queries, keys, values, mask)
        assert mine.shape == (B, HQ, L, D)
        assert relative_error(mine, attend(exact, queries, keys, values, mask)) < tolerance


@pytest.mark.parametrize("bits", [8, 4])
def test_packed_attention_equals_the_kernel_over_the_dequantized_cache(bits):
    """The reference twin: same scores, masks (boolean, additive, causal) and sinks as the kernel
    over the keys and values the packed arrays hold."""
    queries, keys, values = qkv(9, 1)
    kq, vq = mx.quantize(keys, 64, bits), mx.quantize(values, 64, bits)
    k, v = mx.dequantize(*kq, 64, bits), mx.dequantize(*vq, 64, bits)
    padding = mx.array([[True] * 9, [False] * 3 + [True] * 6])[:, None, None, :]
    additive = mx.random.normal((1, HQ, 9, 9))
    sinks = mx.array([0.5, -1.0, 2.0, 0.0, 1.0, -0.5])
    for mask, extra in [(None, {}), ("causal", {}), (padding, {}), (additive, {}), ("causal", {"sinks": sinks})]:
        mine = quantized_attention(queries, kq, vq, scale=SCALE, mask=mask, group_size=64, bits=bits, **extra)
        np.testing.assert_allclose(mine, sdpa(queries, k, v, scale=SCALE, mask=mask, **extra), atol=2e-5)


def test_start_after_keeps_the_first_positions_full_precision():
    N = 20
    exact, packed = KVCache(), QuantizedKVCache(KVQuantization(4, start_after=N))
    outs = []
    for step, L in enumerate([8, 1, 30, 1]):  # the third chunk crosses position N
        queries, keys, values = qkv(L, step)
        mask = "causal" if L > 1 else None
        outs.append((attend(packed, queries, keys, values, mask), attend(exact, queries, keys, values, mask)))
        assert (packed.rows.full is None) == (packed.offset >= N)
    for mine, full in outs[:2]:
        np.testing.assert_array_equal(mine, full)
    crossing, full = outs[2]
    np.testing.assert_allclose(crossing[:, :, : N - 9], full[:, :, : N - 9], atol=1e-5)  # positions 9..19
    assert relative_error(crossing[:, :, N - 9 :], full[:, :, N - 9 :]) > 1e-3  # quantized from N on


def test_a_quantized_cache_in_one_chunk_equals_one_in_many():
    spec = KVQuantization(4, group_size=32, start_after=5)
    queries, keys, values = qkv(12, 3, rows=1)
    whole = attend(QuantizedKVCache(spec), queries, keys, values, "causal")
    cache = QuantizedKVCache(spec)
    parts = [
        attend(cache, queries[:, :, a:b], keys[:, :, a:b], values[:, :, a:b], "causal" if b - a > 1 else None)
        for a, b in [(0, 3), (3, 4), (4, 9), (9, 12)]
    ]
    np.testing.assert_allclose(mx.concatenate(parts, axis=2), whole, atol=1e-5)


def prefilled(spec: KVQuantization, length: int, seed: int) -> QuantizedKVCache:
    cache = QuantizedKVCache(spec)
    attend(cache, *qkv(length, seed, rows=1), "causal")
    return cache


@pytest.mark.parametrize("start_after", [0, 10])
def test_batch_rows_decode_as_they_would_alone(start_after):
    """to_batch, extend (rows of different lengths: left padding), a decode step, filter, extract:
    every row's attention output equals its own single-sequence cache's."""
    spec = KVQuantization(8, start_after=start_after)
    lengths = [12, 5, 8]
    solo = [prefilled(spec, n, seed) for seed, n in enumerate(lengths)]
    batch = prefilled(spec, lengths[0], 0).to_batch()
    for seed, n in enumerate(lengths[1:], start=1):
        batch.extend(prefilled(spec, n, seed).to_batch())
    assert isinstance(batch, BatchQuantizedKVCache)
    assert batch.batch_size == 3 and batch.left_padding == [0, 7, 4]
    np.testing.assert_array_equal(batch.offset, lengths)
    for step in range(3):
        queries, keys, values = qkv(1, 10 + step, rows=3)
        out = batch.update_and_attend(
            queries, keys, values, scale=SCALE, mask=batch_mask([batch]),
            window=None, attention=sdpa,
        )
        for row, cache in enumerate(solo):
            alone = attend(cache, queries[row : row + 1], keys[row : row + 1], values[row : row + 1])
            np.testing.assert_allclose(out[row : row + 1], alone, atol=1e-5)
    batch.filter([2, 0])
    assert batch.left_padding == [4, 0] and batch.batch_size == 2
    for row, original in enumerate([2, 0]):
        alone = batch.extract(row)
        assert alone.offset == solo[original].offset
        queries, keys, values = qkv(1, 99, rows=1)
        np.testing.assert_allclose(
            attend(alone, queries, keys, values), attend(solo[original], queries, keys, values), atol=1e-5
        )


def test_snapshot_restore_and_trim():
    spec = KVQuantization(4, start_after=16)
    cache = prefilled(spec, 24, 0)
    arrays = cache.snapshot()
    assert len(arrays) == 6 and all(a.shape[2] == 24 for a in arrays)  # no copy kept past N
    short = prefilled(spec, 10, 0)
    assert len(short.snapshot()) == 8  # under N: the full-precision copy too
    for length in (24, 20):
        restored = QuantizedKVCache(spec)
        restored.restore(arrays, length)
        assert restored.offset == length and restored.rows.full is None
        queries, keys, values = qkv(1, 5, rows=1)
        reference = prefilled(spec, 24, 0)
        reference.trim(24 - length)
        np.testing.assert_allclose(
            attend(restored, queries, keys, values), attend(reference, queries, keys, values), atol=1e-5
        )
    # under N from a snapshot without the copy: rebuilt by dequantizing, close to exact
    restored = QuantizedKVCache(spec)
    restored.restore(arrays, 12)
    assert restored.rows.full is not None and restored.offset == 12
    exact = KVCache()
    exact.update_and_fetch(*qkv(24, 0, rows=1)[1:])
    exact.trim(12)
    queries, keys, values = qkv(1, 6, rows=1)
    assert relative_error(attend(restored, queries, keys, values), attend(exact, queries, keys, values)) < 0.2
    # under N from a snapshot with the copy: exact
    restored = QuantizedKVCache(spec)
    restored.restore(short.snapshot(), 10)
    np.testing.assert_array_equal(attend(restored, queries, keys, values), attend(short, queries, keys, values))
    assert cache.trim(30) == 24 and cache.offset == 0 and cache.is_trimmable()


def test_one_token_prompts_join_without_positions():
    spec = KVQuantization(8)
    batch = QuantizedKVCache(spec).to_batch()
    batch.extend(QuantizedKVCache(spec).to_batch())
    batch.extend(prefilled(spec, 3, 0).to_batch())
    assert batch.left_padding == [3, 3, 0] and batch.length == 3
    queries, keys, values = qkv(1, 1, rows=3)
    out = batch.update_and_attend(queries, keys, values, scale=SCALE, mask=batch_mask([batch]), window=None, attention=sdpa)
    assert out.shape == (3, HQ, 1, D) and not mx.any(mx.isnan(out)).item()


def test_packed_bytes_per_position_and_which_caches_are_replaced():
    assert KVQuantization(8, 64).bytes_per_position(HKV, D, 4) == 2 * HKV * (64 + 2 * 4)
    assert KVQuantization(4, 32).bytes_per_position(HKV, D, 2) == 2 * HKV * (32 + 2 * 2 * 2)
    cache = prefilled(KVQuantization(4), 264, 0)
    full = KVCache()
    full.update_and_fetch(*qkv(264, 0, rows=1)[1:])
    assert cache.nbytes == 264 * KVQuantization(4).bytes_per_position(HKV, D, 4)
    assert cache.nbytes / full.nbytes == pytest.approx((32 + 8) / 256)
    marker = object()
    replaced = quantize_caches([KVCache(), marker], KVQuantization(8))
    assert isinstance(replaced[0], QuantizedKVCache) and replaced[1] is marker
    assert math.isfinite(cache.nbytes)



def test_the_dequantizing_path_attends_as_the_packed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where quantized_matmul has no batched weights (CUDA), attention dequantizes the packed keys
    and values for the step: the same output as attending over them packed."""
    from mlxr_core.model import quantized_cache

    mx.random.seed(3)
    B, Hq, Hkv, L, S, D = 2, 4, 2, 3, 37, 64
    queries = mx.random.normal((B, Hq, L, D))
    keys = list(mx.quantize(mx.random.normal((B, Hkv, S, D)), group_size=64, bits=8))
    values = list(mx.quantize(mx.random.normal((B, Hkv, S, D)), group_size=64, bits=8))
    for mask in (None, "causal", mx.random.uniform(shape=(B, 1, L, S)) > 0.3):
        packed = quantized_cache.quantized_attention(queries, keys, values, scale=0.125, mask=mask, group_size=64, bits=8)
        monkeypatch.setattr(quantized_cache, "_no_batched_quantized_matmul", lambda: True)
        dequantized = quantized_cache.quantized_attention(queries, keys, values, scale=0.125, mask=mask, group_size=64, bits=8)
        monkeypatch.undo()
        assert mx.allclose(packed, dequantized, atol=1e-4).item()


def test_a_prompt_chunk_on_a_cpu_attends_over_the_packed_cache_dequantized(monkeypatch) -> None:
    """A chunk of queries no longer goes through MLX's CPU quantized_matmul (a pass over the cache
    per query row: 3-5x slower prefill); the values are the same ones, so the output is too."""
    from mlxr_core.model import quantized_cache

    keys, values = (mx.quantize(mx.random.normal((1, 2, 300, 64)), group_size=64, bits=8) for _ in range(2))
    queries = mx.random.normal((1, 4, quantized_cache.DENSE_ROWS, 64))
    with monkeypatch.context() as patch:
        patch.setattr(quantized_cache, "DENSE_ROWS", 1 << 30)  # the packed path, as a reference
        packed = quantized_cache.quantized_attention(queries, keys, values, scale=0.125, mask="causal",
                                                     group_size=64, bits=8)  # fmt: skip
    with monkeypatch.context() as patch:
        def refused(*args, **kwargs):
            raise AssertionError("a prompt chunk went through quantized_matmul")

        patch.setattr(mx, "quantized_matmul", refused)
        dense = quantized_cache.quantized_attention(queries, keys, values, scale=0.125, mask="causal",
                                                    group_size=64, bits=8)  # fmt: skip
    assert mx.allclose(dense, packed, atol=1e-5).item()
    one_row = queries[:, :, :1]  # a decode step keeps the packed path
    with monkeypatch.context() as patch:
        calls = []
        original = mx.quantized_matmul
        patch.setattr(mx, "quantized_matmul", lambda *a, **k: calls.append(1) or original(*a, **k))
        quantized_cache.quantized_attention(one_row, keys, values, scale=0.125, mask=None, group_size=64, bits=8)
    assert calls


def test_a_prompt_chunk_on_a_cpu_goes_through_the_layers_kernel(monkeypatch) -> None:
    """A chunk's dequantized keys and values go through the layer's own attention kernel (the
    fused one full precision runs; the grouped matmuls cost 2-6x it on a 512-token chunk), with
    the layer's mask and sinks: the same output as attending over the packed cache."""
    from mlxr_core.model import quantized_cache

    L = quantized_cache.DENSE_ROWS
    cache = QuantizedKVCache(KVQuantization(8))
    queries, keys, values = qkv(L, 5, rows=1)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0, 1.0, -0.5])
    calls = []

    def kernel(q, k, v, **kwargs):
        calls.append((k.shape, kwargs))
        return sdpa(q, k, v, **kwargs)

    mine = cache.update_and_attend(queries, keys, values, scale=SCALE, mask="causal", window=None,
                                   attention=kernel, sinks=sinks)  # fmt: skip
    assert calls == [((1, HKV, L, D), {"scale": SCALE, "mask": "causal", "sinks": sinks})]
    monkeypatch.setattr(quantized_cache, "DENSE_ROWS", 1 << 30)  # the packed path, as a reference
    kq, vq = mx.quantize(keys, 64, 8), mx.quantize(values, 64, 8)
    packed = quantized_attention(queries, kq, vq, scale=SCALE, mask="causal", group_size=64, bits=8, sinks=sinks)
    np.testing.assert_allclose(mine, packed, atol=2e-5)
