"""TurboQuant-style keys and values: the rotation, the codebooks' error against theory, the
unbiased inner-product estimate, and the cache protocol (batches, chunks, snapshots, rollback)."""

from __future__ import annotations

import math

import attrs
import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.model.cache import KVCache, batch_mask
from mlxr_core.model.quantized_cache import quantize_caches
from mlxr_plugins.kv_caches.codebooks import layer_codec, lloyd_max, pack, unpack
from mlxr_plugins.kv_caches.turboquant import (
    TRIM_SLACK,
    BatchTurboQuantKVCache,
    TurboQuantKV,
    TurboQuantKVCache,
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


def attend(cache, queries, keys, values, mask=None):
    if isinstance(cache, KVCache):
        keys, values = cache.update_and_fetch(keys, values)
        return sdpa(queries, keys, values, scale=SCALE, mask=mask)
    return cache.update_and_attend(queries, keys, values, scale=SCALE, mask=mask, window=None, attention=sdpa)


def prefilled(spec: TurboQuantKV, length: int, seed: int) -> TurboQuantKVCache:
    cache = TurboQuantKVCache(spec, 0)
    attend(cache, *qkv(length, seed, rows=1), "causal")
    return cache


@pytest.mark.parametrize("dim", [64, 96, 256])
def test_the_rotation_is_orthogonal(dim):
    rotation = np.array(layer_codec(dim, 3, 5).rotation, dtype=np.float64)
    np.testing.assert_allclose(rotation @ rotation.T, np.eye(dim), atol=1e-6)
    signs_differ = layer_codec(dim, 3, 6).rotation
    assert not np.allclose(np.array(signs_differ), rotation)  # seeded per layer


def test_codes_pack_into_their_bits_and_back():
    codes = mx.random.randint(0, 16, (3, 2, 5, D)).astype(mx.uint32)
    for bits in (1, 2, 3, 4):
        packed = pack(codes % (1 << bits), bits)
        assert packed.dtype == mx.uint8 and packed.shape == (3, 2, 5, D * bits // 8)
        np.testing.assert_array_equal(unpack(packed, bits), codes % (1 << bits))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_stored_values_err_as_the_codebook_theory_says(bits):
    """For Gaussian heads the rotated directions are uniform on the sphere, so the mean squared
    error of a stored value's direction is the codebook's expected distortion (within sampling
    error), itself under TurboQuant's bound sqrt(3) pi / 2 * 4**-bits."""
    codec = layer_codec(D, bits, 0)
    mx.random.seed(bits)
    values = mx.random.normal((4000, D)) * 3.0
    decoded = codec.decode_values(*codec.encode_values(values))
    norms = mx.linalg.norm(values, axis=-1)
    errors = np.array(mx.sum((decoded - values) ** 2, axis=-1) / norms**2)
    _, expected = lloyd_max(D, bits)
    assert expected < math.sqrt(3) * math.pi / 2 * 4.0**-bits
    assert abs(errors.mean() - expected) < 4 * errors.std() / math.sqrt(errors.size) + 1e-4
    # the norm is kept: the direction's error is all there is
    np.testing.assert_allclose(np.array(mx.linalg.norm(decoded, axis=-1) / norms), 1.0, atol=0.2)


def test_the_key_inner_product_estimate_is_unbiased():
    """Over the draw of the sketch, the mean estimate of <q, k> is the true value within 4
    standard errors of the QJL estimator's variance, and the measured variance is that variance."""
    codec = layer_codec(D, 3, 0)
    mx.random.seed(1)
    query, key = mx.random.normal((1, D)), mx.random.normal((1, D)) * 2.0
    true = float((query @ key.T).item())
    norm = float(mx.linalg.norm(key).item())
    rotated = (key / norm) @ codec.rotation
    levels = codec.keys.nearest(rotated)
    residual, q_rotated = np.array(rotated - levels)[0], np.array(query @ codec.rotation)[0]
    variance = norm**2 * (math.pi / 2 * q_rotated @ q_rotated * residual @ residual - (q_rotated @ residual) ** 2) / D
    rng = np.random.default_rng(0)
    estimates = []
    for _ in range(3000):
        drawn = attrs.evolve(codec, sketch=mx.array(rng.standard_normal((D, D)).astype(np.float32)))
        estimates.append(drawn.scores(query[None], *drawn.encode_keys(key)).item())
    estimates = np.array(estimates)
    assert abs(estimates.mean() - true) < 4 * math.sqrt(variance / estimates.size)
    assert estimates.var() == pytest.approx(variance, rel=0.1)
    without_sketch = float(norm * (q_rotated @ np.array(levels)[0]))
    assert abs(without_sketch - true) > 4 * math.sqrt(variance / estimates.size)  # the levels alone are off


@pytest.mark.parametrize(("window", "sketch"), [(0, True), (8, True), (0, False)])
def test_attention_from_the_codes_is_near_full_precision(window, sketch):
    exact, packed = KVCache(), TurboQuantKVCache(TurboQuantKV(4, window, sketch=sketch), 0)
    for step, L in enumerate([40, 1, 1, 7]):
        queries, keys, values = qkv(L, step)
        mask = "causal" if L > 1 else None
        mine, full = attend(packed, queries, keys, values, mask), attend(exact, queries, keys, values, mask)
        assert mine.shape == (B, HQ, L, D)
        # measured on these normal(0, 1) heads at 4 bits: up to ~0.25 (keys at 3 bits + sketch)
        assert float(mx.linalg.norm(mine - full) / mx.linalg.norm(full)) < 0.35
    if window:  # the last position's window holds the full-precision copy, and only so much of it
        assert packed.rows.tail is not None and packed.rows.tail[0].shape[2] == 49


def test_within_the_window_attention_is_exact():
    queries, keys, values = qkv(6, 2, rows=1)
    mine = attend(TurboQuantKVCache(TurboQuantKV(2, window=6), 0), queries, keys, values, "causal")
    np.testing.assert_allclose(mine, attend(KVCache(), queries, keys, values, "causal"), atol=1e-5)


@pytest.mark.parametrize(("window", "sketch"), [(0, True), (5, True), (5, False)])
def test_one_chunk_equals_many(window, sketch):
    spec = TurboQuantKV(3, window, sketch=sketch)
    queries, keys, values = qkv(30, 3, rows=1)
    whole = attend(TurboQuantKVCache(spec, 0), queries, keys, values, "causal")
    cache = TurboQuantKVCache(spec, 0)
    parts = [
        attend(cache, queries[:, :, a:b], keys[:, :, a:b], values[:, :, a:b], "causal" if b - a > 1 else None)
        for a, b in [(0, 3), (3, 4), (4, 17), (17, 30)]
    ]
    np.testing.assert_allclose(mx.concatenate(parts, axis=2), whole, atol=1e-5)


@pytest.mark.parametrize(("window", "sketch"), [(0, True), (6, True), (6, False)])
def test_batch_rows_decode_as_they_would_alone(window, sketch):
    """to_batch, extend (rows of different lengths: left padding, tails of different lengths),
    decode steps, filter, extract: every row's output equals its own single-sequence cache's."""
    spec = TurboQuantKV(3, window, sketch=sketch)
    lengths = [12, 3, 8]
    solo = [prefilled(spec, n, seed) for seed, n in enumerate(lengths)]
    batch = BatchTurboQuantKVCache(spec, 0, rows=1)  # a one-token prompt's: no positions yet
    for seed, n in enumerate(lengths):
        batch.extend(prefilled(spec, n, seed).to_batch())
    batch.filter([1, 2, 3])
    assert batch.left_padding == [0, 9, 4]
    for step in range(3):
        queries, keys, values = qkv(1, 10 + step, rows=3)
        out = batch.update_and_attend(
            queries, keys, values, scale=SCALE, mask=batch_mask([batch]), window=None, attention=sdpa
        )
        for row, cache in enumerate(solo):
            alone = attend(cache, queries[row : row + 1], keys[row : row + 1], values[row : row + 1])
            np.testing.assert_allclose(out[row : row + 1], alone, atol=1e-5)
    batch.filter([2, 0])
    for row, original in enumerate([2, 0]):
        alone = batch.extract(row)
        assert alone.offset == solo[original].offset
        queries, keys, values = qkv(1, 99, rows=1)
        np.testing.assert_allclose(
            attend(alone, queries, keys, values), attend(solo[original], queries, keys, values), atol=1e-5
        )


def test_snapshot_restore_and_rollback():
    spec = TurboQuantKV(3, window=4)
    data = qkv(90, 0, rows=1)

    def first(length: int) -> TurboQuantKVCache:
        cache = TurboQuantKVCache(spec, 0)
        attend(cache, *(x[:, :, :length] for x in data), "causal")
        return cache

    arrays = first(90).snapshot()
    assert len(arrays) == 7 and arrays[5].shape[2] == 4 + TRIM_SLACK
    queries, keys, values = qkv(1, 5, rows=1)
    # a prefix-cache hit within the stored copy, and a draft rollback: exactly a shorter run's
    for length in (90, 40):
        restored = TurboQuantKVCache(spec, 0)
        restored.restore(arrays, length)
        rolled_back = first(90)
        assert rolled_back.trim(90 - length) == 90 - length
        for mine in (restored, rolled_back):
            np.testing.assert_allclose(
                attend(mine, queries, keys, values), attend(first(length), queries, keys, values), atol=1e-5
            )
    # past the copy: the window is rebuilt from the codes, close to the run that kept it
    restored = TurboQuantKVCache(spec, 0)
    restored.restore(arrays, 20)
    assert restored.rows.tail is not None and restored.rows.tail[0].shape[2] == 4
    mine, exact = attend(restored, queries, keys, values), attend(first(20), queries, keys, values)
    assert 0 < float(mx.linalg.norm(mine - exact) / mx.linalg.norm(exact)) < 0.3


def test_packed_bytes_per_position_and_which_caches_are_replaced():
    spec = TurboQuantKV(3)
    # keys: 2-bit codes (16 bytes), signs (8), two float16 norms; values: 3-bit codes (24), a norm
    assert spec.bytes_per_position(HKV, D, 4) == HKV * (16 + 8 + 4 + 24 + 2)
    assert TurboQuantKV(3, sketch=False).bytes_per_position(HKV, D, 4) == HKV * (24 + 2 + 24 + 2)
    cache = prefilled(spec, 264, 0)
    assert cache.nbytes == 264 * spec.bytes_per_position(HKV, D, 4)
    assert TurboQuantKV(3, window=8).full_precision_positions(1000) == 8 + TRIM_SLACK
    marker = object()
    replaced = quantize_caches([KVCache(), marker, KVCache()], spec)
    assert isinstance(replaced[0], TurboQuantKVCache) and replaced[1] is marker
    assert replaced[2].rows.layer == 2  # each layer its own rotation and sketch


@pytest.mark.parametrize(("window", "sketch"), [(0, True), (0, False), (5, True), (5, False)])
def test_a_prompt_chunk_on_a_cpu_goes_through_the_layers_kernel(window, sketch, monkeypatch):
    """A chunk's keys and values decoded from their codes (and, with a window, its exact
    positions beside them, a boolean mask picking each query's copy) go through the layer's kernel
    (the fused one full precision runs), with its mask and sinks: the same output, chunk after
    chunk, as the scores and sums over the codes."""
    from mlxr_core.model import quantized_cache

    spec = TurboQuantKV(4, window, sketch=sketch)
    rows = quantized_cache.DENSE_ROWS
    sinks = mx.array([0.5, -1.0, 2.0, 0.0, 1.0, -0.5])
    calls = []

    def kernel(q, k, v, **kwargs):
        calls.append(k.shape)
        return sdpa(q, k, v, **kwargs)

    def run(cache, L, seed):
        queries, keys, values = qkv(L, seed)
        return cache.update_and_attend(queries, keys, values, scale=SCALE, mask="causal", window=None,
                                       attention=kernel, sinks=sinks)  # fmt: skip

    cache = BatchTurboQuantKVCache(spec, 0, rows=B)
    mine = [run(cache, rows, 4), run(cache, rows + 4, 5)]
    # with a window the exact positions come beside the decoded ones: the tail's and the chunk's
    exact = [0, 0] if not window else [rows, min(rows, window + TRIM_SLACK) + rows + 4]
    assert calls == [(B, HKV, rows + exact[0], D), (B, HKV, 2 * rows + 4 + exact[1], D)]
    monkeypatch.setattr(quantized_cache, "DENSE_ROWS", 1 << 30)  # the codes' own path, as a reference
    cache = BatchTurboQuantKVCache(spec, 0, rows=B)
    for chunk, (L, seed) in zip(mine, [(rows, 4), (rows + 4, 5)], strict=True):
        np.testing.assert_allclose(chunk, run(cache, L, seed), atol=1e-4)
    assert len(calls) == 2


def test_a_windowed_chunk_with_an_additive_mask_keeps_the_codes_path():
    """The window's copy is picked by a boolean mask: an additive mask keeps the reference path."""
    from mlxr_core.model import quantized_cache

    queries, keys, values = qkv(quantized_cache.DENSE_ROWS, 6)
    additive = mx.zeros((1, 1, quantized_cache.DENSE_ROWS, quantized_cache.DENSE_ROWS))

    def refused(*args, **kwargs):
        raise AssertionError("the kernel took an additive mask with a window")

    out = BatchTurboQuantKVCache(TurboQuantKV(4, 5), 0, rows=B).update_and_attend(
        queries, keys, values, scale=SCALE, mask=additive, window=None, attention=refused
    )
    assert out.shape == queries.shape and bool(mx.all(mx.isfinite(out)).item())
