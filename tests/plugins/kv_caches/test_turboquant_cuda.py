"""The fused TurboQuant decode kernels (:mod:`mlxr_plugins.kv_caches.turboquant_cuda`) against
the reference backend they replace: the scores and the weighted values from the same packed
bytes, and whole decode steps through the cache. They run on MLX's CUDA backend only."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxr_plugins.kv_caches import turboquant, turboquant_cuda
from mlxr_plugins.kv_caches.codebooks import layer_codec
from mlxr_plugins.kv_caches.turboquant import TurboQuantKV, TurboQuantKVCache

pytestmark = pytest.mark.skipif(
    not mx.cuda.is_available() or mx.default_device() != mx.gpu,
    reason="the fused TurboQuant kernels run on MLX's CUDA backend; this machine has none",
)


def test_prompts_are_left_to_the_reference_with_the_reason() -> None:
    assert turboquant_cuda.reasons(mx.zeros((1, 2, 3, 1, 64))) == []
    assert "more than one query position" in " ".join(turboquant_cuda.reasons(mx.zeros((1, 2, 3, 4, 64))))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("sketch", [True, False])
@pytest.mark.parametrize(("D", "R", "S"), [(64, 1, 1), (64, 4, 300), (128, 3, 1000), (128, 8, 77)])
def test_scores_and_values_equal_the_reference(bits: int, sketch: bool, D: int, R: int, S: int) -> None:
    B, H = 2, 3
    codec = layer_codec(D, bits, 1, sketch)
    mx.random.seed(bits * 100 + D + S)
    keys, values = mx.random.normal((B, H, S + 20, D)) * 2, mx.random.normal((B, H, S + 20, D))
    # views of longer buffers, as the cache hands them: strided, not copies
    stored_keys = [a[:, :, :S] for a in codec.encode_keys(keys)]
    stored_values = [a[:, :, :S] for a in codec.encode_values(values)]
    queries = mx.random.normal((B, H, R, 1, D))
    expected = codec.scores(queries, *stored_keys)
    got = turboquant_cuda.scores(codec, queries, *stored_keys)
    # the reference's float32 matmuls may run on tensor cores (TF32 inputs): ~1e-3 relative
    assert relative_error(got, expected) < 2e-3
    probs = mx.softmax(expected, axis=-1)
    expected_out = codec.weighted_values(probs, *stored_values)
    got_out = turboquant_cuda.weighted_values(codec, probs, *stored_values)
    assert relative_error(got_out, expected_out) < 2e-3


def relative_error(got: mx.array, expected: mx.array) -> float:
    assert got.shape == expected.shape
    return float(mx.linalg.norm(got - expected) / mx.linalg.norm(expected))


@pytest.mark.parametrize(("window", "sketch"), [(0, True), (16, True), (0, False)])
def test_decode_steps_through_the_cache_equal_the_reference(
    window: int, sketch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attention kernels over the same stored bytes (both runs encode on the reference: its
    TF32 matmuls flip a few sign bits against the fused encoder, tested on its own below)."""
    monkeypatch.setattr(turboquant_cuda, "encode_reasons", lambda keys: ["the reference's bytes"])
    spec = TurboQuantKV(3, window, sketch=sketch)
    B, HQ, HKV, D = 2, 8, 2, 64
    outputs = {}
    for fused in (True, False):
        turboquant.FUSED = fused
        try:
            mx.random.seed(0)
            cache = TurboQuantKVCache(spec, 0)
            rows = []
            for L in (50, 1, 1, 1):
                q, k, v = (mx.random.normal((B, h, L, D)) for h in (HQ, HKV, HKV))
                mask = "causal" if L > 1 else None
                rows.append(cache.update_and_attend(q, k, v, scale=D**-0.5, mask=mask, window=None,
                                                    attention=mx.fast.scaled_dot_product_attention))
            outputs[fused] = mx.concatenate(rows, axis=2)
        finally:
            turboquant.FUSED = True
    assert relative_error(outputs[True], outputs[False]) < 2e-3


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("sketch", [True, False])
@pytest.mark.parametrize("D", [64, 128])
def test_encoding_equals_the_reference(bits: int, sketch: bool, D: int) -> None:
    """The same bits as the reference, but where a coordinate lies within float rounding of a
    level boundary or a sketched residual near 0 (the reference's matmuls may round through TF32):
    measured 0.1-0.3% of the bits on an H200; at most 1% may differ."""
    codec = layer_codec(D, bits, 2, sketch)
    mx.random.seed(bits + D)
    keys, values = mx.random.normal((2, 3, 40, D)).astype(mx.bfloat16), mx.random.normal((2, 3, 40, D))
    got = turboquant_cuda.encode(codec, keys, values)
    expected = [*codec.encode_keys(keys), *codec.encode_values(values)]
    assert [(a.shape, a.dtype) for a in got] == [(a.shape, a.dtype) for a in expected]
    for mine, theirs in zip(got, expected, strict=True):
        if mine.dtype == mx.uint8:
            differ = np.mean(np.unpackbits(np.array(mine)) != np.unpackbits(np.array(theirs)))
            assert differ < 1e-2, differ
        else:
            assert relative_error(mine.astype(mx.float32), theirs.astype(mx.float32)) < 2e-3
