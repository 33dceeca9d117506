"""The ``cuda`` and ``metal`` backends: what they accept, how they plan the fused decode kernel,
what they delegate, and (on their own hardware only) parity with the reference.

On this CPU machine the kernels themselves cannot run: their parity tests skip with the backend's
own reason. The CUDA parity run over every dtype, GQA ratio, head dim and layout happens on the
lent GPU (``bench/kernels/decode_attention.py``, output in ``bench/kernels/results/``).
Tolerances (``|fused - reference| <= atol + rtol * |reference|``) are those of test_parity.py.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.kernels import KernelContext, current_platform
from mlxr_plugins.kernels import cuda, cuda_qmm, cuda_qmv, metal, metal_qmv, reference

DEVICE, PLATFORM = current_platform()
ATTENTION_TOL = {
    mx.float32: (1e-5, 1e-5),
    mx.float16: (2e-3, 2.0**-9),
    mx.bfloat16: (1.6e-2, 2.0**-6),
}


def ctx(op: str, platform: str, dtype: str = "bfloat16", **shapes) -> KernelContext:
    device = "cpu" if platform == "cpu" else "gpu"
    return KernelContext(op=op, device=device, platform=platform, dtype=dtype, shapes=shapes)


def qkv(B=1, Hq=32, Hkv=8, L=1, S=100, D=128, dtype=mx.bfloat16, cache_view=True, seed=0):
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((B, Hq, L, D), key=keys[0]).astype(dtype)
    capacity = -(-(S + 1) // 256) * 256 if cache_view else S
    k = mx.random.normal((B, Hkv, capacity, D), key=keys[1]).astype(dtype)[..., :S, :]
    v = mx.random.normal((B, Hkv, capacity, D), key=keys[2]).astype(dtype)[..., :S, :]
    return q, k, v


CUDA_REASON = " ".join(cuda.attention_kernel.supports(ctx("attention", PLATFORM)))
METAL_REASON = " ".join(metal.attention_kernel.supports(ctx("attention", PLATFORM)))


# --------------------------------------------------------------------------------------------
# supports(): device-specific, and says why


@pytest.mark.parametrize("module, platform, needs", [
    (cuda, "cuda", "needs MLX's CUDA backend on an NVIDIA GPU (this machine: "),
    (metal, "metal", "needs Apple Silicon Metal (this machine: "),
])
def test_device_backends_run_only_on_their_platform_and_say_why(module, platform, needs):
    assert module.attention_kernel.supports(ctx("attention", platform, masks=("causal",))) == []
    for other in {"cpu", "cuda", "metal"} - {platform}:
        reasons = module.attention_kernel.supports(ctx("attention", other))
        assert len(reasons) == 1 and reasons[0].startswith(needs)
        assert f"{other} platform" in reasons[0]
    both = module.attention_kernel.supports(ctx("attention", "cpu", "float64", masks=("sliding",)))
    assert any("float64" in r for r in both) and any("sliding" in r for r in both)


def test_metal_rms_norm_support():
    assert metal.rms_norm_kernel.supports(ctx("rms_norm", "metal")) == []
    assert "needs Apple Silicon Metal" in metal.rms_norm_kernel.supports(ctx("rms_norm", "cuda"))[0]


# --------------------------------------------------------------------------------------------
# the decode plan: what is fused and how it is split


@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("D", cuda.FUSED_HEAD_DIMS)
def test_decode_with_no_mask_or_causal_is_fused(mask, D):
    q, k, v = qkv(D=D, S=1000)
    plan = cuda.decode_plan(q, k, v, scale=D**-0.5, mask=mask)
    assert isinstance(plan, cuda.DecodePlan)
    assert (plan.B, plan.Hq, plan.Hkv, plan.S, plan.D) == (1, 32, 8, 1000, D)
    # Enough chunks to fill the GPU, each at least one tile, never more than the merge holds.
    assert 1 <= plan.n_splits <= min(math.ceil(1000 / plan.layout.tile), cuda.MAX_SPLITS)
    blocks = plan.layout.blocks_per_split
    assert abs(plan.n_splits * blocks - cuda.TARGET_BLOCKS) <= blocks / 2 or (
        plan.n_splits == math.ceil(1000 / plan.layout.tile)
    )


def test_a_batch_with_enough_groups_runs_unsplit():
    """32 rows x 8 KV heads are 256 blocks without splitting the sequence: one launch that
    writes the output, no workspace to zero-fill; 8 rows split it in four."""
    q, k, v = qkv(B=32, D=64, S=150)
    plan = cuda.decode_plan(q, k, v, scale=0.125, mask=mx.ones((32, 1, 1, 150), dtype=mx.bool_))
    assert isinstance(plan, cuda.DecodePlan) and plan.layout.blocks_per_split == 256
    assert plan.n_splits == 1
    q, k, v = qkv(B=8, D=64, S=1000)
    plan = cuda.decode_plan(q, k, v, scale=0.125, mask=None)
    assert isinstance(plan, cuda.DecodePlan) and plan.n_splits == 4


@pytest.mark.parametrize("case, expected", [
    (dict(L=4), "4 query positions"),
    (dict(D=80), "head dim 80"),
    (dict(Hq=12, Hkv=8), "not a GQA layout"),
])
def test_what_the_fused_kernel_does_not_take_is_named(case, expected):
    q, k, v = qkv(**case)
    reason = cuda.decode_plan(q, k, v, scale=0.1, mask=None)
    assert isinstance(reason, str) and expected in reason


@pytest.mark.parametrize("shape", [(3, 1, 1, 100), (1, 1, 1, 100), (1, 100), (100,)])
@pytest.mark.parametrize("dtype", [mx.bool_, mx.bfloat16, mx.float32])
def test_masks_over_rows_and_keys_are_fused(shape, dtype):
    q, k, v = qkv(B=3)
    plan = cuda.decode_plan(q, k, v, scale=0.1, mask=mx.zeros(shape, dtype=dtype))
    assert isinstance(plan, cuda.DecodePlan) and (plan.B, plan.S) == (3, 100)


def test_masks_mixed_dtypes_and_odd_scales_the_kernel_does_not_take_are_named():
    q, k, v = qkv(B=3)

    def reason(*arrays: mx.array, scale: float = 0.1, mask: mx.array | None = None) -> str:
        plan = cuda.decode_plan(*arrays, scale=scale, mask=mask)
        assert isinstance(plan, str)
        return plan

    # Masks that differ per head or per query position, have the wrong length or batch, or no
    # truth value the kernel reads.
    for shape in [(3, 32, 1, 100), (1, 1, 2, 100), (1, 1, 1, 99), (2, 1, 1, 100), (3, 1, 1, 1, 100)]:
        assert "a mask of shape" in reason(q, k, v, mask=mx.zeros(shape, dtype=mx.bool_))
    assert "a mask of dtype int32" in reason(q, k, v, mask=mx.zeros((1, 100), dtype=mx.int32))
    assert "mask 'sliding'" in reason(q, k, v, mask="sliding")
    assert "dtypes" in reason(q.astype(mx.float32), k, v)
    assert "dtypes" in reason(*(a.astype(mx.int32) for a in (q, k, v)))
    assert "scale" in reason(q, k, v, scale=-1.0)


@pytest.mark.parametrize("ratio, dtype, cap, expected", [
    (1, mx.bfloat16, 8, 1), (4, mx.bfloat16, 8, 4), (8, mx.float16, 8, 8), (6, mx.bfloat16, 8, 6),
    (16, mx.bfloat16, 8, 8), (8, mx.float32, 8, 4), (6, mx.float32, 8, 3), (8, mx.bfloat16, 4, 4),
])
def test_gqa_heads_share_a_block_within_the_register_and_shared_memory_budget(
    ratio, dtype, cap, expected
):
    assert cuda.heads_per_block(ratio, dtype, cap) == expected


def test_a_gqa_ratio_above_the_cap_splits_heads_over_blocks():
    q, k, v = qkv(Hq=32, Hkv=2)
    plan = cuda.decode_plan(q, k, v, scale=0.1, mask=None)
    assert isinstance(plan, cuda.DecodePlan)
    assert plan.heads_per_block == 8 and plan.groups == 2
    assert plan.layout.blocks_per_split == 1 * 2 * 2


def test_the_layout_is_computed_once_per_model_shape():
    cuda.layout_for.cache_clear()
    for S in (10, 11, 12):
        q, k, v = qkv(S=S)
        cuda.decode_plan(q, k, v, scale=128**-0.5, mask=None)
    info = cuda.layout_for.cache_info()
    assert info.misses == 1 and info.hits == 2


@pytest.mark.parametrize("module", [cuda, metal])
@pytest.mark.parametrize("L, S, mask", [(4, 9, "causal"), (1, 9, "array"), (3, 3, None)])
def test_what_is_not_fused_is_exactly_mx_fast(module, L, S, mask):
    q, k, v = qkv(Hq=8, Hkv=2, L=L, S=S, D=64, dtype=mx.float32)
    # A mask per head: the fused kernel takes masks over batch rows and keys only.
    m = mx.random.normal((1, 8, L, S)) if mask == "array" else mask
    assert mx.array_equal(
        module.attention(q, k, v, scale=0.125, mask=m),
        mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m),
    )


@pytest.mark.parametrize("mask", [None, "causal"])
def test_cuda_hands_unmasked_decode_to_mx_fast(mask):
    """The backend's op fuses masked decode only: unmasked decode is exactly mx.fast (which runs
    here too, so this holds on any machine)."""
    q, k, v = qkv(Hq=8, Hkv=2, S=9, D=64, dtype=mx.float32)
    assert isinstance(cuda.decode_plan(q, k, v, scale=0.125, mask=mask), cuda.DecodePlan)
    assert mx.array_equal(
        cuda.attention(q, k, v, scale=0.125, mask=mask),
        mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask),
    )


def test_metal_rms_norm_delegates_mixed_dtypes_to_mx_fast():
    x = mx.random.normal((2, 3, 64))
    w = mx.random.normal((64,)).astype(mx.float16)
    assert mx.array_equal(metal.rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5))


# --------------------------------------------------------------------------------------------
# parity on the hardware itself (skipped here, with the backend's reason)


def close(actual: mx.array, expected: mx.array, dtype: mx.Dtype) -> None:
    atol, rtol = ATTENTION_TOL[dtype]
    np.testing.assert_allclose(
        np.array(actual.astype(mx.float32)), np.array(expected.astype(mx.float32)),
        atol=atol, rtol=rtol,
    )


DECODE_CASES = [
    (dtype, Hq, Hkv, D, S)
    for dtype in (mx.float32, mx.float16, mx.bfloat16)
    for Hq, Hkv in ((8, 8), (8, 2), (8, 1))
    for D in cuda.FUSED_HEAD_DIMS
    for S in (1, 37, 1000)
]


@pytest.mark.skipif(PLATFORM != "cuda", reason=CUDA_REASON or "needs CUDA")
@pytest.mark.parametrize("dtype, Hq, Hkv, D, S", DECODE_CASES, ids=str)
def test_cuda_decode_parity(dtype, Hq, Hkv, D, S):
    q, k, v = qkv(B=2, Hq=Hq, Hkv=Hkv, S=S, D=D, dtype=dtype, seed=S + D)
    assert isinstance(cuda.decode_plan(q, k, v, scale=D**-0.5, mask=None), cuda.DecodePlan)
    out = cuda.fused_attention(q, k, v, scale=D**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    close(out, reference.attention(q, k, v, scale=D**-0.5), dtype)


@pytest.mark.skipif(PLATFORM != "cuda", reason=CUDA_REASON or "needs CUDA")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["bool", "additive", "window", "one_row"])
@pytest.mark.parametrize("D, S", [(64, 37), (128, 1000)])
def test_cuda_masked_decode_parity(dtype, kind, D, S):
    """The backend's op fuses decode under a mask over rows and keys: a batch's padding (rows that
    joined at different steps, boolean or additive), a window shared by every row, one row's
    mask broadcast over the batch."""
    B = 3
    q, k, v = qkv(B=B, Hq=8, Hkv=2, S=S, D=D, dtype=dtype, seed=S + D + 1)
    visible = mx.arange(S)[None, :] >= mx.array([0, S // 3, S - 1])[:, None]  # [B, S]
    mask = {
        "bool": visible[:, None, None, :],
        "additive": mx.where(visible, 0.0, -math.inf).astype(dtype)[:, None, None, :],
        "window": (mx.arange(S) >= S - 16)[None, :],
        "one_row": (mx.arange(S) >= 5)[None, None, None, :],
    }[kind]
    assert isinstance(cuda.decode_plan(q, k, v, scale=D**-0.5, mask=mask), cuda.DecodePlan)
    out = cuda.attention(q, k, v, scale=D**-0.5, mask=mask)
    assert out.shape == q.shape and out.dtype == dtype
    close(out, reference.attention(q, k, v, scale=D**-0.5, mask=mask), dtype)


@pytest.mark.skipif(PLATFORM != "cuda", reason=CUDA_REASON or "needs CUDA")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
@pytest.mark.parametrize("B, S", [(32, 150), (32, 3000), (4, 1000)])
def test_cuda_padded_batch_parity(dtype, B, S):
    """A batch of rows that joined at different steps, as the engine decodes it: 32 rows unsplit
    (each block writes its output), 4 rows with the sequence split over blocks."""
    q, k, v = qkv(B=B, Hq=32, Hkv=8, S=S, D=64, dtype=dtype, seed=S)
    pads = mx.array([(row * 7) % (S // 2) for row in range(B)])
    mask = (mx.arange(S)[None, :] >= pads[:, None])[:, None, None, :]
    plan = cuda.decode_plan(q, k, v, scale=0.125, mask=mask)
    assert isinstance(plan, cuda.DecodePlan) and (plan.n_splits == 1) == (B == 32)
    out = cuda.attention(q, k, v, scale=0.125, mask=mask)
    close(out, reference.attention(q, k, v, scale=0.125, mask=mask), dtype)


@pytest.mark.skipif(PLATFORM != "metal", reason=METAL_REASON or "needs Metal")
@pytest.mark.parametrize("dtype, Hq, Hkv, D, S", DECODE_CASES, ids=str)
def test_metal_decode_parity(dtype, Hq, Hkv, D, S):
    q, k, v = qkv(B=2, Hq=Hq, Hkv=Hkv, S=S, D=D, dtype=dtype, seed=S + D)
    out = metal.attention(q, k, v, scale=D**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    close(out, reference.attention(q, k, v, scale=D**-0.5), dtype)


@pytest.mark.skipif(PLATFORM != "metal", reason=METAL_REASON or "needs Metal")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("dims", [64, 576, 4096])
def test_metal_rms_norm_parity(dtype, dims):
    eps = {mx.float32: 5e-6, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[dtype]
    x = (3 * mx.random.normal((2, 5, dims), key=mx.random.key(dims))).astype(dtype)
    w = mx.random.normal((dims,), key=mx.random.key(dims + 1)).astype(dtype)
    np.testing.assert_allclose(
        np.array(metal.rms_norm(x, w, 1e-5).astype(mx.float32)),
        np.array(reference.rms_norm(x, w, 1e-5).astype(mx.float32)), atol=eps, rtol=2 * eps,
    )


# --------------------------------------------------------------------------------------------
# cuda_norm: the residual add + RMS norm kernel


def test_cuda_norm_runs_only_on_cuda_and_says_why():
    from mlxr_plugins.kernels import cuda_norm

    assert cuda_norm.add_rms_norm_kernel.supports(ctx("add_rms_norm", "cuda")) == []
    for other in ("cpu", "metal"):
        reasons = cuda_norm.add_rms_norm_kernel.supports(ctx("add_rms_norm", other, "float64"))
        assert reasons[0].startswith("needs MLX's CUDA backend") and any("float64" in r for r in reasons)


def test_cuda_norm_hands_what_it_does_not_fuse_to_mx_fast(monkeypatch):
    """Mixed dtypes, a broadcast residual or a very wide row never reach the kernel."""
    from mlxr_plugins.kernels import cuda_norm, mlx_fast

    calls = []
    monkeypatch.setattr(cuda_norm, "_kernel", lambda: calls.append("kernel"))
    x = mx.ones((2, 1, 64), dtype=mx.bfloat16)
    for args in (
        (x, x.astype(mx.float32), mx.ones((64,), dtype=mx.bfloat16)),
        (x, mx.ones((64,), dtype=mx.bfloat16), mx.ones((64,), dtype=mx.bfloat16)),
        (x, x, mx.ones((64,), dtype=mx.float32)),
        (mx.ones((1, 40 * 256)), mx.ones((1, 40 * 256)), mx.ones((40 * 256,))),
    ):
        h, normed = cuda_norm.add_rms_norm(*args, 1e-5)
        want_h, want_n = mlx_fast.add_rms_norm(*args, 1e-5)
        np.testing.assert_array_equal(np.array(h.astype(mx.float32)), np.array(want_h.astype(mx.float32)))
        np.testing.assert_array_equal(np.array(normed.astype(mx.float32)), np.array(want_n.astype(mx.float32)))
    assert calls == []


@pytest.mark.skipif(PLATFORM != "cuda", reason=CUDA_REASON or "needs CUDA")
def test_cuda_norm_parity_and_identity_with_mx_fast():
    from mlxr_core.plugins import load_plugins
    from mlxr_core.testing.kernel_check import check_kernel_parity
    from mlxr_plugins.kernels import cuda_norm, mlx_fast

    report = check_kernel_parity(load_plugins().registries.kernels, "add_rms_norm", "cuda_norm")
    assert report.ran and not report.skipped
    # Rounded as the two-kernel version rounds: equal up to one rounding step of the dtype.
    for dtype in (mx.float16, mx.bfloat16):
        x, y = (mx.random.normal((3, 1, 2048), key=mx.random.key(s)).astype(dtype) for s in (1, 2))
        w = mx.random.normal((2048,), key=mx.random.key(3)).astype(dtype)
        for got, want in zip(cuda_norm.add_rms_norm(x, y, w, 1e-5), mlx_fast.add_rms_norm(x, y, w, 1e-5),
                             strict=True):
            np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                                       atol=2.0**-6, rtol=2.0**-7)


# --------------------------------------------------------------------------------------------
# cuda_qmm: packed matmul for a few rows


def packed_layer(n: int, k: int, group_size: int = 64, dtype=mx.bfloat16, seed: int = 0):
    w = (mx.random.normal((n, k), key=mx.random.key(seed)) / k**0.5).astype(dtype)
    return mx.quantize(w, group_size=group_size, bits=4)


@pytest.mark.parametrize("rows, n, k, allotted", [
    (2, 3072, 2048, 8), (8, 2048, 2048, 8), (9, 2048, 8192, 16), (32, 8192, 2048, 32),
])
def test_cuda_qmm_takes_a_few_rows_of_narrow_layers(rows, n, k, allotted):
    packed, scales, biases = packed_layer(n, k)
    plan = cuda_qmm.rows_plan(mx.zeros((rows, k), dtype=mx.bfloat16), packed, scales, biases)
    assert plan == allotted


@pytest.mark.parametrize("case, expected", [
    (dict(rows=1), "1 rows"),
    (dict(rows=33), "33 rows"),
    (dict(n=16384), "16384 outputs"),
    (dict(k=320), "reduction 320"),
    (dict(bits=8), "affine 8-bit"),
    (dict(group_size=16), "group size 16"),
    (dict(biases=False), "with biases"),
    (dict(transpose=False), "not transposed"),
    (dict(dtype=mx.float32), "one dtype"),
])
def test_what_cuda_qmm_does_not_take_is_named(case, expected):
    rows, n, k = case.get("rows", 4), case.get("n", 256), case.get("k", 512)
    group_size = case.get("group_size", 64)
    packed, scales, biases = packed_layer(n, k, group_size if group_size in (32, 64, 128) else 64)
    reason = cuda_qmm.rows_plan(
        mx.zeros((rows, k), dtype=case.get("dtype", mx.bfloat16)), packed, scales,
        biases if case.get("biases", True) else None,
        bits=case.get("bits", 4), group_size=group_size, transpose=case.get("transpose", True),
    )
    assert isinstance(reason, str) and expected in reason


@pytest.mark.parametrize("rows, n", [(1, 256), (3, 16384), (40, 256)])
def test_what_cuda_qmm_does_not_take_is_exactly_mx(rows, n):
    """One row, a wide layer, many rows: ``mx.quantized_matmul`` itself (it runs here too)."""
    packed, scales, biases = packed_layer(n, 512)
    x = mx.random.normal((rows, 512)).astype(mx.bfloat16)
    assert isinstance(cuda_qmm.rows_plan(x, packed, scales, biases), str)
    assert mx.array_equal(
        cuda_qmm.quantized_matmul(x, packed, scales, biases, group_size=64, bits=4),
        mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=64, bits=4),
    )


@pytest.mark.skipif(PLATFORM != "cuda", reason=CUDA_REASON or "needs CUDA")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [2, 5, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("n, k, group_size", [(100, 256, 64), (3072, 2048, 64), (2048, 8192, 32),
                                              (384, 1024, 128)])
def test_cuda_qmm_parity(dtype, rows, n, k, group_size):
    packed, scales, biases = packed_layer(n, k, group_size, dtype, seed=rows + n)
    x = mx.random.normal((rows, k), key=mx.random.key(rows)).astype(dtype)
    plan = cuda_qmm.rows_plan(x, packed, scales, biases, group_size=group_size)
    assert isinstance(plan, int), plan
    out = cuda_qmm.quantized_matmul(x, packed, scales, biases, group_size=group_size)
    assert out.shape == (rows, n) and out.dtype == dtype
    # float64 on the host: a float32 GPU matmul may round through TF32.
    dense = np.array(mx.dequantize(packed, scales, biases, group_size=group_size, bits=4)
                     .astype(mx.float32), dtype=np.float64)
    expected = np.array(x.astype(mx.float32), dtype=np.float64) @ dense.T
    atol, rtol = {mx.float32: (1e-4, 1e-4), mx.float16: (2e-3, 2e-3), mx.bfloat16: (1.6e-2, 1e-2)}[dtype]
    np.testing.assert_allclose(
        np.array(out.astype(mx.float32)), expected, atol=atol, rtol=rtol
    )


# --------------------------------------------------------------------------------------------
# cuda_qmv: the one-row (batch-1 decode) matrix-vector kernel


def emulate_qmv(x: np.ndarray, w: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                plan: cuda_qmv.OneRowPlan, visits: np.ndarray | None = None,
                worst_conflict: list[int] | None = None) -> np.ndarray:
    """``mlxr_qmv`` step by step in numpy, float32: the same staging (swizzled 16-byte chunks, one
    sum per vector by shuffles), the same block / iteration / warp / lane / vector walk, the same
    words, shifts and masks, the same float32 arithmetic (up to fused multiply-adds) and shuffle
    order. ``visits`` [N, vectors per row] counts the (row, vector) pairs read; ``worst_conflict``
    gets the most lanes of a quarter warp that read one shared-memory bank group at once."""
    f32 = np.float32
    NT, NW, K, N = cuda_qmv.THREADS, cuda_qmv.THREADS // 32, plan.k, plan.n
    bits, S, RPW, U = plan.bits, plan.splits, plan.rows_per_warp, plan.in_flight
    VW, EPW = 128 // bits, 32 // bits
    VPR = K // VW
    VS = VPR // S
    NV = -(-VS // 32)
    RPI = NW // S * RPW
    TOP = 23 - bits
    QMASK = np.uint32(((1 << bits) - 1) << TOP)
    QSCALE = f32(1 << bits)
    x = x.astype(f32).reshape(-1)
    words = w.reshape(N, VPR, 4)  # the 16-byte vectors of each row, word by word
    swizzle = lambda f: f ^ ((f >> 3) & 7)  # noqa: E731

    xs4 = np.full((K // 4, 4), np.nan, dtype=f32)
    xsum = np.full(VPR, np.nan, dtype=f32)
    for e0 in range(0, K // 8, NT):
        e = e0 + np.arange(NT)
        has = e < K // 8
        v = np.where(has[:, None], x[np.minimum(e, K // 8 - 1)[:, None] * 8 + np.arange(8)], f32(0))
        total = np.zeros(NT, dtype=f32)
        for i in range(8):
            total = total + v[:, i]
        off = 1
        while off < VW // 8:
            total = total + total[np.arange(NT) ^ off]
            off <<= 1
        for t in np.flatnonzero(has):
            assert np.isnan(xs4[swizzle(2 * e[t])]).all() and np.isnan(xs4[swizzle(2 * e[t] + 1)]).all()
            xs4[swizzle(2 * e[t])] = v[t, :4]
            xs4[swizzle(2 * e[t] + 1)] = v[t, 4:]
            if e[t] % (VW // 8) == 0:
                xsum[e[t] // (VW // 8)] = total[t]
    assert not np.isnan(xs4).any() and not np.isnan(xsum).any()

    out = np.full(N, np.nan, dtype=f32)
    lane = np.arange(32)
    CH = -(-NV // U)

    def load(block: int, warp: int, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Step ``t``'s vectors, scales and biases of one warp (the kernel's LOAD)."""
        split, slot = warp % S, warp // S
        first, stride = block * RPI, plan.blocks * RPI
        lrow0, lc0 = first + (t // CH) * stride, (t % CH) * U
        q = np.zeros((U, RPW, 32, 4), dtype=np.uint32)
        sq = np.zeros((U, RPW, 32), dtype=f32)
        bq = np.zeros((U, RPW, 32), dtype=f32)
        for u in range(U):
            c = lc0 + u
            v = split * VS + c * 32 + lane
            ok = (c < NV) & (c * 32 + lane < VS)
            for r in range(RPW):
                row = lrow0 + slot * RPW + r
                take = ok & (row < N)
                vv, safe = np.where(take, v, 0), min(row, N - 1)
                q[u, r] = np.where(take[:, None], words[safe, vv], 0)
                g = (vv * VW) // plan.group_size
                sq[u, r] = np.where(take, QSCALE * scales[safe, g], 0)
                bq[u, r] = np.where(take, biases[safe, g], 0)
                if visits is not None and take.any():
                    np.add.at(visits, (row, v[take]), 1)
        return q, sq, bq

    for block in range(plan.blocks):
        first, stride = block * RPI, plan.blocks * RPI
        steps = (N - first + stride - 1) // stride * CH if first < N else 0
        following = [load(block, warp, 0) if steps > 0 else None for warp in range(NW)]
        acc = np.zeros((NW, RPW, 32), dtype=f32)
        for t in range(steps):
            row0, c0 = first + (t // CH) * stride, (t % CH) * U
            for warp in range(NW):
                split, slot = warp % S, warp // S
                current = following[warp]
                assert current is not None
                q, sq, bq = current
                if t + 1 < steps:
                    following[warp] = load(block, warp, t + 1)
                for u in range(U):
                    c = c0 + u
                    v = split * VS + c * 32 + lane
                    ok = (c < NV) & (c * 32 + lane < VS)
                    vv = np.where(ok, v, 0)
                    a = np.zeros((RPW, 32), dtype=f32)
                    for f in range(VW // 4):
                        chunk = swizzle(vv * (VW // 4) + f)
                        if worst_conflict is not None:
                            for quarter in range(4):
                                lanes = slice(quarter * 8, (quarter + 1) * 8)
                                banks = (chunk % 8)[lanes][ok[lanes]]
                                if banks.size:
                                    worst_conflict[0] = max(worst_conflict[0], int(np.bincount(banks).max()))
                        xf = xs4[chunk]  # [32 lanes, 4]
                        j, i0 = f // (EPW // 4), (f % (EPW // 4)) * 4
                        for r in range(RPW):
                            word = q[u, r, :, j]
                            for i in range(4):
                                pos = (i0 + i) * bits
                                moved = word << np.uint32(TOP - pos) if pos <= TOP else word >> np.uint32(pos - TOP)
                                m = (np.uint32(0x3F800000) | (moved & QMASK)).view(f32)
                                a[r] = m * xf[:, i] + a[r]
                    s = xsum[vv]
                    for r in range(RPW):
                        acc[warp, r] = np.where(ok, sq[u, r] * (a[r] - s) + (bq[u, r] * s + acc[warp, r]),
                                                acc[warp, r])
            if t % CH != CH - 1:
                continue
            part = np.zeros(NW * RPW, dtype=f32)
            for warp in range(NW):
                slot = warp // S
                for r in range(RPW):
                    for off in (16, 8, 4, 2, 1):
                        acc[warp, r] = acc[warp, r] + acc[warp, r][lane ^ off]
                    row = row0 + slot * RPW + r
                    if S == 1 and row < N:
                        assert np.isnan(out[row]), "a row written twice"
                        out[row] = acc[warp, r][0]
                    part[warp * RPW + r] = acc[warp, r][0]
            if S > 1:
                for tid in range(RPI):
                    rows_slot, r = tid // RPW, tid % RPW
                    total = f32(0)
                    for sp in range(S):
                        total = total + part[(rows_slot * S + sp) * RPW + r]
                    row = row0 + rows_slot * RPW + r
                    if row < N:
                        assert np.isnan(out[row]), "a row written twice"
                        out[row] = total
            acc[:] = 0
    assert not np.isnan(out).any(), "rows never written"
    return out


QMV_EMULATED = [  # n, k, group size, bits, splits, rows per warp, max blocks, vectors per step
    (40, 512, 64, 4, None, None, cuda_qmv.MAX_BLOCKS, None),
    (37, 1024, 32, 4, 2, 1, 3, None),
    (24, 2048, 128, 4, 4, 2, 2, None),
    (50, 320, 64, 4, 1, 2, 4, None),     # 10 vectors a row: lanes past them idle
    (9, 64, 32, 4, 1, 1, cuda_qmv.MAX_BLOCKS, None),
    (33, 512, 32, 8, 2, 1, 2, None),
    (20, 1024, 128, 8, 8, 1, cuda_qmv.MAX_BLOCKS, None),
    (17, 768, 64, 8, 1, 4, 1, None),
    (20, 8192, 128, 4, 1, 2, 1, 2),     # 4 steps a row, 2 iterations: the loads run a step ahead
    (30, 2048, 64, 8, 1, 2, 1, None),
    (12, 5120, 64, 4, 1, 1, 2, 4),      # 5 vectors a lane in steps of 4: 3 past the row's end
]


@pytest.mark.parametrize("n, k, group_size, bits, splits, rows_per_warp, max_blocks, in_flight", QMV_EMULATED)
def test_cuda_qmv_walk_emulated_matches_mx_quantized_matmul(n, k, group_size, bits, splits,
                                                            rows_per_warp, max_blocks, in_flight):
    """The kernel's indexing, in numpy on this machine: every (row, vector) read once, every row
    written once, and the result is ``mx.quantized_matmul``'s (float32, up to summation order)."""
    w = mx.random.normal((n, k), key=mx.random.key(n + k)) / k**0.5
    packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    x = mx.random.normal((1, k), key=mx.random.key(bits))
    plan = cuda_qmv.one_row_plan(x, packed, scales, biases, group_size=group_size, bits=bits)
    assert isinstance(plan, cuda_qmv.OneRowPlan), plan
    if (splits, rows_per_warp, max_blocks, in_flight) != (None, None, cuda_qmv.MAX_BLOCKS, None):
        plan = cuda_qmv.layout(n, k, bits, group_size, splits, rows_per_warp, max_blocks, in_flight)
    visits = np.zeros((n, k * bits // 128), dtype=np.int64)
    got = emulate_qmv(np.array(x), np.array(packed), np.array(scales), np.array(biases), plan, visits)
    assert (visits == 1).all()
    expected = np.array(mx.quantized_matmul(x, packed, scales, biases, transpose=True,
                                            group_size=group_size, bits=bits))[0]
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)


def test_cuda_qmv_emulated_in_bfloat16_inputs():
    """bfloat16 inputs, scales and biases, read as float32 by the kernel: the float64 product of the
    weights dequantized in float32 (MLX's CPU kernel rounds them and adds up in bfloat16, about
    0.05 off here)."""
    n, k = 64, 1024
    w = (mx.random.normal((n, k), key=mx.random.key(1)) / k**0.5).astype(mx.bfloat16)
    packed, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((1, 1, k), key=mx.random.key(2)).astype(mx.bfloat16)
    plan = cuda_qmv.one_row_plan(x, packed, scales, biases)
    assert isinstance(plan, cuda_qmv.OneRowPlan)
    f32 = [np.array(a.astype(mx.float32)) for a in (x, scales, biases)]
    got = emulate_qmv(f32[0], np.array(packed), f32[1], f32[2], plan)
    np.testing.assert_allclose(got, qmv_expected(x, packed, scales, biases, 64, 4)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_qmv_shared_memory_reads_do_not_conflict(bits):
    """The swizzle: the 8 lanes of a quarter warp read 8 different 16-byte bank groups."""
    n, k = 8, 2048
    packed, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=64, bits=bits)
    worst = [0]
    plan = cuda_qmv.layout(n, k, bits, 64, 1, 1)
    emulate_qmv(np.ones(k, dtype=np.float32), np.array(packed), np.array(scales), np.array(biases),
                plan, worst_conflict=worst)
    assert worst == [1]


@pytest.mark.parametrize("n, k, bits, splits, rows_per_warp", [
    (3072, 2048, 4, 2, 1), (16384, 2048, 4, 1, 2), (2048, 8192, 4, 2, 1), (128256, 2048, 4, 1, 2),
    (512, 2048, 4, 2, 1), (512, 2048, 8, 4, 1), (64, 64, 4, 1, 1),
])
def test_cuda_qmv_layout_fills_the_gpu_and_keeps_lanes_busy(n, k, bits, splits, rows_per_warp):
    plan = cuda_qmv.layout(n, k, bits, 64)
    assert (plan.splits, plan.rows_per_warp) == (splits, rows_per_warp)
    assert plan.blocks <= cuda_qmv.MAX_BLOCKS
    rows_per_iteration = cuda_qmv.THREADS // 32 // plan.splits * plan.rows_per_warp
    iterations = -(-n // rows_per_iteration // plan.blocks)
    assert plan.blocks * iterations * rows_per_iteration >= n  # every row has a block
    assert plan.vectors_per_lane >= 1 and plan.in_flight * plan.rows_per_warp <= cuda_qmv.IN_FLIGHT[bits]


@pytest.mark.parametrize("case, expected", [
    (dict(rows=2), "(kernel: one row)"),
    (dict(bits=3), "affine 3-bit"),
    (dict(group_size=16), "group size 16"),
    (dict(biases=False), "without biases"),
    (dict(transpose=False), "not transposed"),
    (dict(dtype=mx.float16), "one floating dtype"),
    (dict(k=16384), "reduction 16384"),
    (dict(mode="mxfp4"), "mxfp4"),
])
def test_what_cuda_qmv_does_not_take_is_named(case, expected):
    k, group_size = case.get("k", 512), case.get("group_size", 64)
    bits = case.get("bits", 4)
    packed, scales, biases = mx.quantize(mx.random.normal((64, k)).astype(mx.bfloat16),
                                         group_size=group_size if group_size in (32, 64, 128) else 64,
                                         bits=bits)
    x = mx.zeros((case.get("rows", 1), k), dtype=mx.bfloat16)
    reason = cuda_qmv.one_row_plan(
        x.astype(case.get("dtype", mx.bfloat16)), packed, scales, biases if case.get("biases", True) else None,
        group_size=group_size, bits=bits, transpose=case.get("transpose", True),
        mode=case.get("mode", "affine"),
    )
    assert isinstance(reason, str) and expected in reason


@pytest.mark.parametrize("rows", [2, 40])
def test_cuda_qmv_hands_more_rows_to_cuda_qmm(monkeypatch, rows):
    """Two or more rows: ``cuda_qmm``'s op (here, where its kernel would not run either, it is
    exactly ``mx.quantized_matmul``)."""
    packed, scales, biases = packed_layer(256, 512)
    x = mx.random.normal((rows, 512)).astype(mx.bfloat16)
    monkeypatch.setattr(cuda_qmm, "rows_plan", lambda *args, **kwargs: "not here")
    monkeypatch.setattr(cuda_qmv, "_kernel", lambda: pytest.fail("the one-row kernel ran"))
    assert mx.array_equal(
        cuda_qmv.quantized_matmul(x, packed, scales, biases, group_size=64, bits=4),
        mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=64, bits=4),
    )


def test_cuda_qmv_runs_only_on_cuda_and_says_why():
    assert cuda_qmv.quantized_matmul_kernel.supports(ctx("quantized_matmul", "cuda")) == []
    for other in ("cpu", "metal"):
        reasons = cuda_qmv.quantized_matmul_kernel.supports(ctx("quantized_matmul", other))
        assert len(reasons) == 1 and reasons[0].startswith("needs MLX's CUDA backend")


QMV_CASES = [  # n, k, group size, bits
    (512, 2048, 64, 4), (3072, 2048, 64, 4), (2048, 8192, 64, 4), (8192, 2048, 32, 4),
    (16384, 2048, 128, 4), (1000, 4096, 128, 4), (100, 320, 64, 4), (4096, 4096, 32, 4),
    (512, 2048, 64, 8), (2048, 8192, 32, 8), (4096, 1024, 128, 8),
]
QMV_TOL = {mx.float32: (1e-4, 1e-4), mx.float16: (2e-3, 2e-3), mx.bfloat16: (1.6e-2, 1e-2)}


def qmv_expected(x: mx.array, packed: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                 bits: int) -> np.ndarray:
    """float64 on the host (a float32 GPU matmul may round through TF32), of the weights
    dequantized in float32 (the kernel does not round them to the input's dtype)."""
    dense = np.array(mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32),
                                   group_size=group_size, bits=bits), dtype=np.float64)
    return np.array(x.astype(mx.float32), dtype=np.float64).reshape(1, -1) @ dense.T


@pytest.mark.skipif(PLATFORM != "cuda", reason=CUDA_REASON or "needs CUDA")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("n, k, group_size, bits", QMV_CASES)
def test_cuda_qmv_parity(dtype, n, k, group_size, bits):
    w = (mx.random.normal((n, k), key=mx.random.key(n)) / k**0.5).astype(dtype)
    packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    x = mx.random.normal((1, k), key=mx.random.key(k)).astype(dtype)
    assert isinstance(cuda_qmv.one_row_plan(x, packed, scales, biases, group_size=group_size, bits=bits),
                      cuda_qmv.OneRowPlan)
    out = cuda_qmv.quantized_matmul(x, packed, scales, biases, group_size=group_size, bits=bits)
    assert out.shape == (1, n) and out.dtype == dtype
    atol, rtol = QMV_TOL[dtype]
    expected = qmv_expected(x, packed, scales, biases, group_size, bits)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), expected, atol=atol, rtol=rtol)
    # No further from the exact product than MLX's own kernel (which rounds the dequantized
    # weights to the input's dtype, and adds up 4-bit products in it).
    theirs = mx.quantized_matmul(x, packed, scales, biases, group_size=group_size, bits=bits)
    ours_off = np.abs(np.array(out.astype(mx.float32)) - expected).max()
    theirs_off = np.abs(np.array(theirs.astype(mx.float32)) - expected).max()
    assert ours_off <= 2 * theirs_off + atol / 4, (ours_off, theirs_off)


@pytest.mark.skipif(PLATFORM != "cuda", reason=CUDA_REASON or "needs CUDA")
@pytest.mark.parametrize("splits, rows_per_warp, max_blocks", [
    (1, 1, 528), (2, 1, 7), (4, 2, 3), (8, 1, 528), (1, 4, 2), (2, 2, 528),
])
@pytest.mark.parametrize("shape", [(1, 2048), (1, 1, 2048), (2048,)])
def test_cuda_qmv_every_layout_and_input_shape(splits, rows_per_warp, max_blocks, shape):
    n, k = 1000, 2048
    packed, scales, biases = packed_layer(n, k, 64, mx.bfloat16, seed=splits)
    x = mx.random.normal(shape, key=mx.random.key(rows_per_warp)).astype(mx.bfloat16)
    plan = cuda_qmv.layout(n, k, 4, 64, splits, rows_per_warp, max_blocks)
    out = cuda_qmv.one_row_matmul(x, packed, scales, biases, plan)
    assert out.shape == (*shape[:-1], n)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)).reshape(1, -1),
                               qmv_expected(x, packed, scales, biases, 64, 4), atol=1.6e-2, rtol=1e-2)


@pytest.mark.skipif(PLATFORM != "cuda", reason=CUDA_REASON or "needs CUDA")
def test_cuda_qmv_through_the_registry_and_greedy_tokens_of_a_model(tmp_path, monkeypatch):
    """The op's parity harness, and a tiny 4-bit Llama decoding through ``cuda_qmv``: the same
    greedy tokens as through ``mlx_fast`` (MLX's own kernel), a decode step's logits close."""
    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model
    from mlxr_core.plugins import load_plugins
    from mlxr_core.testing.hf_reference import greedy_tokens
    from mlxr_core.testing.kernel_check import check_kernel_parity
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    pytest.importorskip("gguf", reason="the tiny model is written as a GGUF file")
    registries = load_plugins().registries
    assert check_kernel_parity(registries.kernels, "quantized_matmul", "cuda_qmv").ran
    path = write_tiny_llama_gguf(tmp_path / "q4.gguf", quant="q4_0", hidden=256, intermediate=512, heads=4,
                                 kv_heads=2)
    calls = []
    real = cuda_qmv.one_row_matmul

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    runs = {}
    for backend in ("mlx_fast", "cuda_qmv"):
        config = ModelConfig(path=str(path), dtype="float32", quantization="keep",
                             kernels={"quantized_matmul": backend})
        loaded = load_model(config, registries)
        assert loaded.kernels.chosen["quantized_matmul"] == backend
        if backend == "cuda_qmv":  # the op looks the kernel's function up at each call
            monkeypatch.setattr(cuda_qmv, "one_row_matmul", counted)
        tokens, _ = greedy_tokens(loaded, [3, 14, 15, 92, 65, 35], 12)
        cache = loaded.make_cache()
        loaded.model(mx.array([[3, 14, 15, 92, 65, 35]]), cache=cache)
        decoded = np.array(loaded.model(mx.array([[9]]), cache=cache)[0, -1])  # one row
        runs[backend] = (tokens, decoded)
    assert calls, "the one-row kernel never ran"
    assert runs["cuda_qmv"][0] == runs["mlx_fast"][0]
    np.testing.assert_allclose(runs["cuda_qmv"][1], runs["mlx_fast"][1], atol=1e-3, rtol=1e-3)


# --------------------------------------------------------------------------------------------
# metal_qmv: the one-row kernel's Metal twin (UNTESTED: no Apple GPU here)


def test_metal_qmv_runs_only_on_metal_and_takes_reductions_up_to_its_limit():
    assert metal_qmv.quantized_matmul_kernel.supports(ctx("quantized_matmul", "metal")) == []
    assert "needs Apple Silicon Metal" in metal_qmv.quantized_matmul_kernel.supports(ctx("quantized_matmul", "cuda"))[0]
    for k, takes in ((metal_qmv.MAX_K, True), (2 * metal_qmv.MAX_K, False)):
        packed, scales, biases = packed_layer(8, k)
        plan = metal_qmv.one_row_plan(mx.zeros((1, k), dtype=mx.bfloat16), packed, scales, biases)
        assert isinstance(plan, cuda_qmv.OneRowPlan) == takes, plan


def test_what_metal_qmv_does_not_take_is_exactly_mx():
    packed, scales, biases = packed_layer(64, 512)
    x = mx.random.normal((3, 512)).astype(mx.bfloat16)
    assert mx.array_equal(metal_qmv.quantized_matmul(x, packed, scales, biases),
                          mx.quantized_matmul(x, packed, scales, biases))


@pytest.mark.skipif(PLATFORM != "metal", reason=METAL_REASON or "needs Metal")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("n, k, group_size, bits", [case for case in QMV_CASES if case[1] <= metal_qmv.MAX_K])
def test_metal_qmv_parity(dtype, n, k, group_size, bits):
    w = (mx.random.normal((n, k), key=mx.random.key(n)) / k**0.5).astype(dtype)
    packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    x = mx.random.normal((1, k), key=mx.random.key(k)).astype(dtype)
    out = metal_qmv.quantized_matmul(x, packed, scales, biases, group_size=group_size, bits=bits)
    assert out.shape == (1, n) and out.dtype == dtype
    atol, rtol = QMV_TOL[dtype]
    np.testing.assert_allclose(np.array(out.astype(mx.float32)),
                               qmv_expected(x, packed, scales, biases, group_size, bits), atol=atol, rtol=rtol)
