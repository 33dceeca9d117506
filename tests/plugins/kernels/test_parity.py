"""The ``mlx_fast`` kernels against the ``reference`` ones, and the reference against the math.

Tolerances (``|fast - reference| <= atol + rtol * |reference|``, inputs ~N(0, 1)):
- attention: float32 1e-5 + 1e-5; float16 2e-3 + 2^-9; bfloat16 1.6e-2 + 2^-6, i.e. about two
  roundings in the output dtype (the kernels round the softmax weights and sums at different points);
- rms_norm: ``rtol = 2 eps``, ``atol = eps`` (float16 eps 2^-10, bfloat16 2^-7, float32 5e-6);
- rope: ``rtol = 2 eps``, ``atol = 4 eps``: an output ``x1 cos - x2 sin`` that nearly cancels keeps
  the absolute rounding error of its inputs (here ~2), not one relative to itself.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.kernels import OPS, KernelContext, bind_kernels
from mlxr_core.plugins import load_plugins
from mlxr_plugins.kernels import cpu_blas, mlx_fast, reference

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
ATTENTION_TOL = {
    mx.float32: (1e-5, 1e-5),
    mx.float16: (2e-3, 2.0**-9),
    mx.bfloat16: (1.6e-2, 2.0**-6),
}
EPS = {mx.float32: 5e-6, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}


def close(actual: mx.array, expected: mx.array, *, atol: float, rtol: float = 0.0) -> None:
    a = np.array(actual.astype(mx.float32))
    e = np.array(expected.astype(mx.float32))
    np.testing.assert_allclose(a, e, atol=atol, rtol=rtol)


def make_mask(
    kind: str, B: int, Hq: int, L: int, S: int, dtype: mx.Dtype, key: mx.array
) -> str | mx.array | None:
    if kind in ("none", "causal"):
        return None if kind == "none" else "causal"
    if kind == "additive":
        return mx.random.normal((B, 1, L, S), key=key).astype(dtype)
    visible = mx.random.uniform(shape=(1, Hq, L, S), key=key) > 0.4
    # Every query must see at least one key: a fully masked row is undefined (NaN) in both.
    return mx.concatenate([mx.ones((1, Hq, L, 1), dtype=mx.bool_), visible[..., 1:]], axis=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa8"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("L,S", [(1, 1), (1, 37), (7, 7), (5, 33)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "additive", "bool"])
def test_attention_parity(dtype, heads, D, L, S, mask_kind):
    Hq, Hkv = heads
    B = 2
    keys = mx.random.split(mx.random.key(L * 1000 + S * 10 + D), 4)
    q = mx.random.normal((B, Hq, L, D), key=keys[0]).astype(dtype)
    k = mx.random.normal((B, Hkv, S, D), key=keys[1]).astype(dtype)
    v = mx.random.normal((B, Hkv, S, D), key=keys[2]).astype(dtype)
    mask = make_mask(mask_kind, B, Hq, L, S, dtype, keys[3])
    scale = D**-0.5
    expected = reference.attention(q, k, v, scale=scale, mask=mask)
    actual = mlx_fast.attention(q, k, v, scale=scale, mask=mask)
    assert actual.shape == expected.shape == (B, Hq, L, D)
    assert actual.dtype == expected.dtype == dtype
    atol, rtol = ATTENTION_TOL[dtype]
    close(actual, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa8"])
@pytest.mark.parametrize("S", [1, 255, 257])
def test_decode_attention_parity_on_kv_cache_views(dtype, heads, S):
    """Decode as the KV cache hands it over: K/V are ``[..., :S, :]`` views of a larger buffer."""
    Hq, Hkv = heads
    keys = mx.random.split(mx.random.key(S), 3)
    capacity = -(-(S + 1) // 256) * 256
    q = mx.random.normal((2, Hq, 1, 128), key=keys[0]).astype(dtype)
    k = mx.random.normal((2, Hkv, capacity, 128), key=keys[1]).astype(dtype)[..., :S, :]
    v = mx.random.normal((2, Hkv, capacity, 128), key=keys[2]).astype(dtype)[..., :S, :]
    expected = reference.attention(q, k, v, scale=128**-0.5, mask="causal")
    actual = mlx_fast.attention(q, k, v, scale=128**-0.5, mask="causal")
    atol, rtol = ATTENTION_TOL[dtype]
    close(actual, expected, atol=atol, rtol=rtol)


def naive_attention(q, k, v, scale, visible):
    """Head by head, with key head ``h // R`` for query head ``h``; ``visible`` is [L, S] or None."""
    q, k, v = (np.array(a, dtype=np.float64) for a in (q, k, v))
    B, Hq = q.shape[:2]
    R = Hq // k.shape[1]
    out = np.zeros(q.shape)
    for b in range(B):
        for h in range(Hq):
            scores = scale * q[b, h] @ k[b, h // R].T
            if visible is not None:
                scores = np.where(visible, scores, -np.inf)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, h] = (weights / weights.sum(-1, keepdims=True)) @ v[b, h // R]
    return out


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("L,S", [(1, 9), (4, 4), (3, 11)])
def test_reference_attention_is_the_math(heads, L, S):
    Hq, Hkv = heads
    keys = mx.random.split(mx.random.key(7), 3)
    q = mx.random.normal((2, Hq, L, 16), key=keys[0])
    k = mx.random.normal((2, Hkv, S, 16), key=keys[1])
    v = mx.random.normal((2, Hkv, S, 16), key=keys[2])
    causal = np.arange(S - L, S)[:, None] >= np.arange(S)[None, :]  # bottom-right aligned
    np.testing.assert_allclose(
        np.array(reference.attention(q, k, v, scale=0.25, mask="causal")),
        naive_attention(q, k, v, 0.25, causal),
        atol=1e-5,
    )
    np.testing.assert_allclose(
        np.array(reference.attention(q, k, v, scale=0.25)),
        naive_attention(q, k, v, 0.25, None),
        atol=1e-5,
    )
    additive = mx.where(mx.array(causal), 0.0, -math.inf)
    close(
        reference.attention(q, k, v, scale=0.25, mask=additive),
        reference.attention(q, k, v, scale=0.25, mask="causal"),
        atol=1e-6,
    )


def test_reference_attention_rejects_bad_heads_and_masks():
    q, k = mx.zeros((1, 3, 2, 8)), mx.zeros((1, 2, 2, 8))
    with pytest.raises(ValueError, match="multiple"):
        reference.attention(q, k, k, scale=1.0)
    with pytest.raises(ValueError, match="mask"):
        reference.attention(q, q, q, scale=1.0, mask="sliding")


def sink_attention(q, k, v, scale, visible, sinks):
    """Head by head, one extra logit ``sinks[h]`` per row joining the softmax, its weight dropped."""
    q, k, v = (np.array(a, dtype=np.float64) for a in (q, k, v))
    B, Hq, L = q.shape[:3]
    R = Hq // k.shape[1]
    out = np.zeros(q.shape)
    for b in range(B):
        for h in range(Hq):
            scores = scale * q[b, h] @ k[b, h // R].T
            if visible is not None:
                scores = np.where(visible, scores, -np.inf)
            scores = np.concatenate([scores, np.full((L, 1), float(sinks[h]))], axis=-1)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, h] = (weights / weights.sum(-1, keepdims=True))[:, :-1] @ v[b, h // R]
    return out


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("L,S", [(1, 9), (3, 11)])
def test_reference_attention_sinks_are_the_math(heads, L, S):
    Hq, Hkv = heads
    keys = mx.random.split(mx.random.key(11), 4)
    q = mx.random.normal((2, Hq, L, 16), key=keys[0])
    k = mx.random.normal((2, Hkv, S, 16), key=keys[1])
    v = mx.random.normal((2, Hkv, S, 16), key=keys[2])
    sinks = 2 * mx.random.normal((Hq,), key=keys[3])
    causal = np.arange(S - L, S)[:, None] >= np.arange(S)[None, :]
    got = reference.attention(q, k, v, scale=0.25, mask="causal", sinks=sinks)
    np.testing.assert_allclose(np.array(got), sink_attention(q, k, v, 0.25, causal, sinks), atol=1e-5)
    # A sink of -inf takes no weight: plain attention.
    none = reference.attention(q, k, v, scale=0.25, mask="causal", sinks=mx.full((Hq,), -math.inf))
    close(none, reference.attention(q, k, v, scale=0.25, mask="causal"), atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L,S", [(1, 37), (5, 33)])
@pytest.mark.parametrize("mask_kind", ["causal", "additive", "bool"])
def test_attention_sinks_parity(dtype, L, S, mask_kind):
    """mx.fast with sinks (float32 ones too: the backend casts them) against the reference."""
    keys = mx.random.split(mx.random.key(S), 5)
    q = mx.random.normal((2, 8, L, 64), key=keys[0]).astype(dtype)
    k = mx.random.normal((2, 2, S, 64), key=keys[1]).astype(dtype)
    v = mx.random.normal((2, 2, S, 64), key=keys[2]).astype(dtype)
    mask = make_mask(mask_kind, 2, 8, L, S, dtype, keys[3])
    sinks = 2 * mx.random.normal((8,), key=keys[4])
    expected = reference.attention(q, k, v, scale=0.125, mask=mask, sinks=sinks)
    actual = mlx_fast.attention(q, k, v, scale=0.125, mask=mask, sinks=sinks)
    assert actual.dtype == expected.dtype == dtype
    atol, rtol = ATTENTION_TOL[dtype]
    close(actual, expected, atol=atol, rtol=rtol)


def test_device_attention_backends_refuse_sinks():
    from mlxr_plugins.kernels import cuda, metal

    for backend in (cuda.attention_kernel, metal.attention_kernel):
        assert "sinks" in " ".join(backend.supports(ctx("attention", sinks=True)))
        assert "sinks" not in " ".join(backend.supports(ctx("attention")))
    assert mlx_fast.attention_kernel.supports(ctx("attention", sinks=True)) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", [64, 576, 4096])
def test_rms_norm_parity(dtype, dims):
    keys = mx.random.split(mx.random.key(dims), 2)
    x = (3 * mx.random.normal((2, 5, dims), key=keys[0])).astype(dtype)
    w = mx.random.normal((dims,), key=keys[1]).astype(dtype)
    expected = reference.rms_norm(x, w, 1e-5)
    close(mlx_fast.rms_norm_kernel.op(x, w, 1e-5), expected, atol=EPS[dtype], rtol=2 * EPS[dtype])
    x64 = np.array(x.astype(mx.float32), dtype=np.float64)
    manual = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * np.array(w.astype(mx.float32))
    np.testing.assert_allclose(
        np.array(expected.astype(mx.float32)), manual, atol=4 * EPS[dtype], rtol=4 * EPS[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 32])
@pytest.mark.parametrize("offset", [0, 13, "array"])
@pytest.mark.parametrize("with_freqs", [False, True])
def test_rope_parity(dtype, traditional, dims, offset, with_freqs):
    keys = mx.random.split(mx.random.key(dims + 1), 2)
    x = (2 * mx.random.normal((2, 3, 7, 64), key=keys[0])).astype(dtype)
    start = mx.array(21) if offset == "array" else offset
    freqs = mx.random.uniform(1.0, 5e4, (dims // 2,), key=keys[1]) if with_freqs else None
    kwargs = dict(
        traditional=traditional,
        base=None if with_freqs else 10000.0,
        scale=0.5,
        offset=start,
        freqs=freqs,
    )
    expected = reference.rope(x, dims, **kwargs)
    close(
        mlx_fast.rope_kernel.op(x, dims, **kwargs),
        expected,
        atol=4 * EPS[dtype],
        rtol=2 * EPS[dtype],
    )
    if dims < 64:  # features past dims pass through untouched
        assert mx.array_equal(expected[..., dims:], x[..., dims:])


def test_rope_per_batch_offsets():
    x = mx.random.normal((3, 2, 5, 32), key=mx.random.key(3))
    offsets = mx.array([0, 4, 100])
    batched = reference.rope(x, 32, traditional=False, base=1e4, scale=1.0, offset=offsets)
    for b, start in enumerate([0, 4, 100]):
        row = reference.rope(x[b : b + 1], 32, traditional=False, base=1e4, scale=1.0, offset=start)
        close(batched[b : b + 1], row, atol=1e-5)
    close(
        mx.fast.rope(x, 32, traditional=False, base=1e4, scale=1.0, offset=offsets),
        batched,
        atol=1e-5,
    )


def test_reference_rope_rotates_pairs_as_documented():
    # One feature pair at position 1 with freqs 1 rotates by exactly 1 radian.
    x = mx.array([[[1.0, 0.0], [1.0, 0.0]]])  # [1, L=2, D=2]
    out = reference.rope(
        x, 2, traditional=False, base=None, scale=1.0, offset=0, freqs=mx.array([1.0])
    )
    np.testing.assert_allclose(np.array(out[0, 1]), [math.cos(1.0), math.sin(1.0)], atol=1e-6)
    np.testing.assert_allclose(np.array(out[0, 0]), [1.0, 0.0], atol=1e-7)


def ctx(op: str, dtype: str = "float32", **shapes) -> KernelContext:
    return KernelContext(op=op, device="cpu", platform="cpu", dtype=dtype, shapes=shapes)


def test_mlx_fast_says_why_it_cannot_run():
    assert (
        mlx_fast.attention_kernel.supports(ctx("attention", head_dim=128, masks=("causal",))) == []
    )
    assert "float64" in " ".join(mlx_fast.attention_kernel.supports(ctx("attention", "float64")))
    assert "sliding" in " ".join(
        mlx_fast.attention_kernel.supports(ctx("attention", masks=("sliding",)))
    )
    assert "even" in " ".join(mlx_fast.rope_kernel.supports(ctx("rope", rope_dims=31)))
    assert reference.attention_kernel.supports(ctx("attention", "float64")) == []


def test_plugin_registers_both_backends_and_auto_binds_registered_ones():
    registries = load_plugins().registries
    for op in ("attention", "rms_norm", "add_rms_norm", "rope", "gated_activation", "quantized_matmul",
               "gated_delta"):
        assert f"{op}:reference" in registries.kernels
        assert f"{op}:mlx_fast" in registries.kernels
    shapes = {"head_dim": 64, "n_heads": 4, "n_kv_heads": 2, "rope_dims": 64, "masks": ("causal",)}
    auto = bind_kernels(registries.kernels, dtype="float32", shapes=shapes)
    # Which one auto takes for each op on this CPU is test_selection.py's table.
    assert set(auto.chosen) == set(OPS)
    assert all(f"{op}:{backend}" in registries.kernels for op, backend in auto.chosen.items())
    chosen = bind_kernels(
        registries.kernels, dtype="float32", shapes=shapes, choices={"attention": "reference"}
    )
    assert chosen.chosen["attention"] == "reference" and chosen.attention is reference.attention


# -- quantized matmul ---------------------------------------------------------------------------
# The reference dequantizes and accumulates in float32. MLX's fused kernel accumulates in the
# activation dtype on the CPU, so its error grows like eps * sqrt(K): the bound is on the RMS of
# the difference relative to the output's RMS, ``eps * sqrt(K) / 2`` (measured worst: 0.2x that).
# ``cpu_blas`` takes its dequantize + matmul path at 7 rows and the fused one at 1.
KERNELS = {"mlx_fast": mlx_fast, "cpu_blas": cpu_blas}


@pytest.mark.parametrize("backend", ["mlx_fast", "cpu_blas"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("L,K,N", [(1, 512, 384), (7, 1024, 256), (1, 4096, 64)])
def test_quantized_matmul_parity(backend, dtype, bits, group_size, L, K, N):
    mx.random.seed(L * K + N + bits + group_size)
    w, scales, biases = mx.quantize(mx.random.normal((N, K)).astype(dtype), group_size, bits)
    x = mx.random.normal((L, K)).astype(dtype)
    kwargs = {"transpose": True, "group_size": group_size, "bits": bits}
    fast = KERNELS[backend].quantized_matmul_kernel.op(x, w, scales, biases, **kwargs)
    ref = reference.quantized_matmul(x, w, scales, biases, **kwargs)
    assert fast.dtype == ref.dtype == dtype and fast.shape == ref.shape == (L, N)
    f, r = np.array(fast.astype(mx.float32)), np.array(ref.astype(mx.float32))
    rms = float(np.sqrt((r**2).mean()))
    error = float(np.sqrt(((f - r) ** 2).mean()))
    if dtype == mx.float32:
        assert error <= 1e-5 * rms
    else:
        assert error <= EPS[dtype] * math.sqrt(K) / 2 * rms


def test_reference_quantized_matmul_is_the_math():
    w = mx.random.normal((16, 64))
    packed, scales, biases = mx.quantize(w, 32, 8)
    x = mx.random.normal((3, 64))
    dense = np.array(mx.dequantize(packed, scales, biases, 32, 8))
    expected = np.array(x) @ dense.T
    got = reference.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=32, bits=8)
    np.testing.assert_allclose(np.array(got), expected, rtol=1e-5, atol=1e-5)
    # 8-bit affine groups are close to the original weights, so the result is close to x @ w.T:
    # each weight is off by at most half a step (range / 255 / 2), over 64 products.
    error = np.abs(np.array(got) - np.array(x @ w.T)).max()
    assert error < 0.5, error


# -- one-position RoPE on the CPU ---------------------------------------------------------------


def test_cpu_blas_rope_shares_one_rotation_per_step_and_never_reuses_a_stale_one():
    def check(x, offset):
        got = cpu_blas.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=offset)
        ref = reference.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=offset)
        np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-5, atol=1e-5)

    x = mx.random.normal((1, 4, 1, 64), key=mx.random.key(0))
    check(x, 5)
    first = cpu_blas._last_rotation
    check(2 * x, 5)  # the next layer of the same step: the same matrix
    assert cpu_blas._last_rotation is first
    check(x, 6)  # the next step
    assert cpu_blas._last_rotation is not first
    rows = mx.random.normal((2, 4, 1, 64), key=mx.random.key(1))
    check(rows, mx.array([1, 9]))
    check(rows, mx.array([1, 9]))  # equal values in a new array: made again, still right
    check(rows, mx.array([4, 2]))
    prompt = mx.random.normal((1, 4, 3, 64), key=mx.random.key(2))
    check(prompt, 6)  # several positions: mx.fast.rope


def test_cuda_dense_quantized_matmul_dequantizes_from_its_row_threshold_with_the_same_result():
    """Its math runs anywhere (it is only mx ops), though it registers for CUDA alone."""
    from mlxr_plugins.kernels import cuda_dense as cuda

    w = mx.random.normal((96, 256), key=mx.random.key(3))
    packed, scales, biases = mx.quantize(w, group_size=64, bits=4)
    for rows in (1, cuda.MIN_ROWS - 1, cuda.MIN_ROWS, 33):
        x = mx.random.normal((rows, 256), key=mx.random.key(rows))
        got = cuda.quantized_matmul(x, packed, scales, biases, group_size=64, bits=4)
        fused = mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=64, bits=4)
        np.testing.assert_allclose(np.array(got), np.array(fused), rtol=1e-4, atol=1e-4)
    assert "needs MLX's CUDA backend" in cuda.quantized_matmul_kernel.supports(ctx("quantized_matmul"))[0]
