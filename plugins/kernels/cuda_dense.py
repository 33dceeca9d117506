"""``cuda_dense``: packed-weight matmul for several rows as dequantize + dense matmul, on CUDA.

Batched decode multiplies every packed weight by B rows (one per stream). MLX's CUDA
``mx.quantized_matmul`` is built for one row; from a few rows on, dequantizing the weight to the
activation dtype (a temporary of one layer, freed after) and running one dense matmul on the
tensor cores is faster overall, although it moves more bytes. Measured on an H100 (MLX 0.32.4,
Llama-3.2-1B shape, 4-bit group 64, bf16 activations; ``bench/gpu_decode.py --only q4 --rounds 3
--streams 8 32``, with ``--kernels quantized_matmul=mlx_fast`` and without): aggregate decode 1,394
vs 1,167 tok/s at 8 streams and 3,598 vs 1,665 tok/s at 32. Below :data:`MIN_ROWS` rows
(single-stream decode) the fused ``mx.quantized_matmul`` runs, which reads 4x fewer bytes.

Per layer it is not a win everywhere (``bench/kernels/quantized_rows.py``, one call at a time, 32
rows): the down projection (8192 -> 2048) takes 137 us dense vs 269 us fused, but the LM head
(2048 -> 128256) 828 vs 286 us and gate/up (2048 -> 16384) 165 vs 89 us. Dequantizing only for
layers with a long reduction would likely gain more; that rule is not measured end to end yet.
"""

from __future__ import annotations

import platform
from typing import Any

import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import KernelImpl, reference

#: Input rows (batch x positions) from which the weight is dequantized first.
MIN_ROWS = 8


def dequantize_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    **packing: Any,
) -> mx.array:
    """``w`` dequantized to the activation dtype (a temporary of one layer), then one matmul."""
    transpose = packing.pop("transpose", True)
    dense = mx.dequantize(w, scales, biases, **packing).astype(x.dtype)
    return x @ (dense.T if transpose else dense)


#: ``mx.quantized_matmul`` below :data:`MIN_ROWS` input rows, else :func:`dequantize_matmul`.
quantized_matmul = reference.fused_below(MIN_ROWS, dequantize_matmul)


def _cuda_only(ctx: KernelContext) -> list[str]:
    if ctx.platform != "cuda":
        return [
            f"needs MLX's CUDA backend on an NVIDIA GPU (this machine: {platform.system()} "
            f"{platform.machine()}, MLX {ctx.device} device, {ctx.platform} platform)"
        ]
    return []


quantized_matmul_kernel = KernelImpl(
    quantized_matmul,
    _cuda_only,
    summary=f"mx.quantized_matmul below {MIN_ROWS} rows; from there dequantize + dense matmul (batched decode)",
)
