"""The fused TurboQuant kernels (:mod:`mlxr_plugins.kv_caches.turboquant_fused`) against the
reference backend they replace: encoding, the scores and the weighted values from the same packed
bytes, and whole decode steps through the cache. Each test runs for the backend this machine has,
CUDA (:mod:`~mlxr_plugins.kv_caches.turboquant_cuda`) or Metal
(:mod:`~mlxr_plugins.kv_caches.turboquant_metal`, never run yet), and skips for the other with
that module's own reason; which backend the cache picks and what the kernels refuse run anywhere."""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest

from mlxr_plugins.kv_caches import turboquant, turboquant_cuda, turboquant_fused, turboquant_metal
from mlxr_plugins.kv_caches.codebooks import layer_codec
from mlxr_plugins.kv_caches.turboquant import TurboQuantKV, TurboQuantKVCache

MODULES = [turboquant_cuda, turboquant_metal]


def device_reasons(module: ModuleType) -> list[str]:
    """Why ``module`` cannot run here, for a call whose shapes it takes."""
    return module.encode_reasons(mx.zeros((1, 1, 1, 64)))


@pytest.fixture(
    params=[
        pytest.param(m, id=m.__name__.rsplit("_", 1)[-1],
                     marks=pytest.mark.skipif(bool(device_reasons(m)), reason=" ".join(device_reasons(m))))
        for m in MODULES
    ]
)
def backend(request: pytest.FixtureRequest) -> ModuleType:
    """The fused kernels' module, CUDA or Metal, where this machine runs it."""
    module: ModuleType = request.param
    return module


@pytest.fixture
def metal_opt_in(monkeypatch: pytest.MonkeyPatch):
    """The untested Metal kernels taken, as ``MLXR_TURBOQUANT_METAL=1`` asks."""
    monkeypatch.setenv(turboquant.METAL_ENV, "1")
    turboquant.fused_backend.cache_clear()
    yield
    monkeypatch.undo()
    turboquant.fused_backend.cache_clear()


def test_the_cache_picks_the_backend_of_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(turboquant.METAL_ENV, raising=False)
    turboquant.fused_backend.cache_clear()
    try:  # the untested Metal kernels only when asked for
        assert turboquant.fused_backend() is (turboquant_cuda if mx.cuda.is_available() else None)
        monkeypatch.setenv(turboquant.METAL_ENV, "1")
        turboquant.fused_backend.cache_clear()
        expected = turboquant_cuda if mx.cuda.is_available() else turboquant_metal if mx.metal.is_available() else None
        assert turboquant.fused_backend() is expected
    finally:
        turboquant.fused_backend.cache_clear()


@pytest.mark.parametrize("module", MODULES)
def test_a_cpu_default_device_is_left_to_the_reference_with_the_reason(module: ModuleType) -> None:
    default = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        for found in (module.reasons(mx.zeros((1, 2, 3, 1, 64))), module.encode_reasons(mx.zeros((1, 2, 3, 64)))):
            assert len(found) == 1 and "backend is not the default device" in found[0], found
    finally:
        mx.set_default_device(default)


def test_shapes_the_kernels_refuse_are_named() -> None:
    assert turboquant_fused.call_reasons(mx.zeros((1, 2, 3, 1, 64))) == []
    assert "more than one query position" in " ".join(turboquant_fused.call_reasons(mx.zeros((1, 2, 3, 4, 64))))
    assert turboquant_fused.encode_shape_reasons(mx.zeros((1, 2, 3, 128))) == []
    assert "no positions" in " ".join(turboquant_fused.encode_shape_reasons(mx.zeros((1, 2, 0, 64))))
    assert "head size 80" in " ".join(turboquant_fused.encode_shape_reasons(mx.zeros((1, 2, 3, 80))))


def test_prompts_are_left_to_the_reference_with_the_reason(backend: ModuleType) -> None:
    assert backend.reasons(mx.zeros((1, 2, 3, 1, 64))) == []
    assert "more than one query position" in " ".join(backend.reasons(mx.zeros((1, 2, 3, 4, 64))))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("sketch", [True, False])
@pytest.mark.parametrize(("D", "R", "S"), [(64, 1, 1), (64, 4, 300), (128, 3, 1000), (128, 8, 77)])
def test_scores_and_values_equal_the_reference(
    backend: ModuleType, bits: int, sketch: bool, D: int, R: int, S: int
) -> None:
    B, H = 2, 3
    codec = layer_codec(D, bits, 1, sketch)
    mx.random.seed(bits * 100 + D + S)
    keys, values = mx.random.normal((B, H, S + 20, D)) * 2, mx.random.normal((B, H, S + 20, D))
    # views of longer buffers, as the cache hands them: strided, not copies
    stored_keys = [a[:, :, :S] for a in codec.encode_keys(keys)]
    stored_values = [a[:, :, :S] for a in codec.encode_values(values)]
    queries = mx.random.normal((B, H, R, 1, D))
    expected = codec.scores(queries, *stored_keys)
    got = backend.scores(codec, queries, *stored_keys)
    # the reference's float32 matmuls may run on tensor cores (TF32 inputs): ~1e-3 relative
    assert relative_error(got, expected) < 2e-3
    probs = mx.softmax(expected, axis=-1)
    expected_out = codec.weighted_values(probs, *stored_values)
    got_out = backend.weighted_values(codec, probs, *stored_values)
    assert relative_error(got_out, expected_out) < 2e-3


def relative_error(got: mx.array, expected: mx.array) -> float:
    assert got.shape == expected.shape
    return float(mx.linalg.norm(got - expected) / mx.linalg.norm(expected))


@pytest.mark.parametrize(("window", "sketch"), [(0, True), (16, True), (0, False)])
@pytest.mark.usefixtures("metal_opt_in")
def test_decode_steps_through_the_cache_equal_the_reference(
    backend: ModuleType, window: int, sketch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attention kernels over the same stored bytes (both runs encode on the reference: its
    TF32 matmuls flip a few sign bits against the fused encoder, tested on its own below)."""
    assert turboquant.fused_backend() is backend
    monkeypatch.setattr(backend, "encode_reasons", lambda keys: ["the reference's bytes"])
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
def test_encoding_equals_the_reference(backend: ModuleType, bits: int, sketch: bool, D: int) -> None:
    """The same bits as the reference, but where a coordinate lies within float rounding of a
    level boundary or a sketched residual near 0 (the reference's matmuls may round through TF32):
    measured 0.1-0.3% of the bits on an H200; at most 1% may differ."""
    codec = layer_codec(D, bits, 2, sketch)
    mx.random.seed(bits + D)
    keys, values = mx.random.normal((2, 3, 40, D)).astype(mx.bfloat16), mx.random.normal((2, 3, 40, D))
    got = backend.encode(codec, keys, values)
    expected = [*codec.encode_keys(keys), *codec.encode_values(values)]
    assert [(a.shape, a.dtype) for a in got] == [(a.shape, a.dtype) for a in expected]
    for mine, theirs in zip(got, expected, strict=True):
        if mine.dtype == mx.uint8:
            differ = np.mean(np.unpackbits(np.array(mine)) != np.unpackbits(np.array(theirs)))
            assert differ < 1e-2, differ
        else:
            assert relative_error(mine.astype(mx.float32), theirs.astype(mx.float32)) < 2e-3
