"""Packed-weight quantized matmul for MLX's CPU backend, in C++ (:mod:`mlxr_plugins.kernels.native`).

Decode on a CPU is bound by the bytes of weight read per token. MLX's CPU ``quantized_matmul`` is
a plain loop, so ``cpu_blas`` dequantizes to float32 and streams 8x the bytes through BLAS. This
backend reads MLX's affine packing where it lies (2/3/4/5/6/8 bits, groups of 32/64/128, the
``transpose=True`` layout of linear layers), SIMD over the group, threads over output rows, and
runs inside MLX's graph as a custom primitive: the same arrays in and out as
``mx.quantized_matmul``. With it, ``quantization: auto`` keeps a model's weights packed on the CPU
(:mod:`mlxr_core.model.quantize`).

The extension is compiled on first use; where it cannot be (no compiler, no headers, not Linux),
``supports()`` says why and ``auto`` takes ``cpu_blas``. Calls it does not cover (other modes,
``transpose=False``, no biases) go to ``cpu_blas``'s path. The mixture-of-experts form
(``gather_matmul``) is the same kernel run once per row on the row's expert, read in place in the
stack; dense experts and the other cases go to ``mlx_fast``'s ``mx.gather_qmm`` / ``mx.gather_mm``.
"""

from __future__ import annotations

import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import FLOAT_DTYPES, KernelImpl, cpu_blas, mlx_fast, native

#: Widths and group sizes the C++ kernel reads (every affine format MLX makes).
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    *,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
) -> mx.array:
    """``mx.quantized_matmul`` for MLX's affine packing with ``transpose``, in C++; anything
    else through ``cpu_blas``."""
    module, _ = native.load()
    if (
        module is None
        or mode != "affine"
        or biases is None
        or not transpose
        or bits not in BITS
        or group_size not in GROUP_SIZES
    ):
        return cpu_blas.quantized_matmul(
            x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode
        )
    out: mx.array = module.quantized_matmul(x, w, scales, biases, group_size, bits)
    return out


def _support(ctx: KernelContext) -> list[str]:
    reasons = []
    if ctx.device != "cpu":
        reasons.append(f"for MLX's CPU backend (this context: {ctx.device} device)")
    if ctx.dtype not in FLOAT_DTYPES:
        reasons.append(f"activation dtype {ctx.dtype} is not one of {', '.join(FLOAT_DTYPES)}")
    if not reasons:  # build only where it would run
        _, why = native.load()
        if why:
            reasons.append(f"the native extension is unavailable: {why}")
    return reasons


def gather_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array | None = None,
    biases: mx.array | None = None,
    *,
    indices: mx.array,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
    sorted_indices: bool = False,
) -> mx.array:
    """``mx.gather_qmm(x, w, ..., rhs_indices=indices)`` for MLX's affine packing with
    ``transpose``, in C++ (each row's expert read in place); anything else through ``mlx_fast``."""
    module, _ = native.load()
    if (
        module is None
        or scales is None
        or biases is None
        or mode != "affine"
        or not transpose
        or bits not in BITS
        or group_size not in GROUP_SIZES
    ):
        return mlx_fast.gather_matmul(
            x, w, scales, biases, indices=indices, transpose=transpose, group_size=group_size,
            bits=bits, mode=mode, sorted_indices=sorted_indices,
        )
    batch = mx.broadcast_shapes(x.shape[:-2], indices.shape)
    x = mx.broadcast_to(x, (*batch, *x.shape[-2:]))
    indices = mx.broadcast_to(indices, batch).astype(mx.uint32)
    out: mx.array = module.gather_matmul(x, w, scales, biases, indices, group_size, bits)
    return out


#: Read by :func:`mlxr_core.kernels.bind_kernels`: this backend multiplies packed weights at least
#: as fast as dense ones, so ``quantization: auto`` keeps them packed on the CPU.
quantized_matmul_kernel = KernelImpl(
    quantized_matmul,
    _support,
    summary=(
        "packed affine weights read in place (C++ custom primitive, SIMD, threads over output "
        "rows); other modes via cpu_blas"
    ),
    keeps_packed=True,
)
gather_matmul_kernel = KernelImpl(
    gather_matmul,
    _support,
    summary="packed experts read in place, one row at a time on its expert (C++); dense via mlx_fast",
)
