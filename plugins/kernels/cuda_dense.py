"""``cuda_dense``: packed-weight matmul for several rows as dequantize + dense matmul, on CUDA.
Opt-in (``kernels: {quantized_matmul: cuda_dense}``); ``mx.quantized_matmul`` is the default.

The idea: batched decode multiplies every packed weight by B rows (one per stream); from a few
rows on, dequantize the weight to the activation dtype (a temporary of one layer, freed after) and
run one dense matmul on the tensor cores. It was auto-selected on CUDA while batched 4-bit decode
handed ``mx.quantized_matmul`` a ``[B, 1, K]`` input, which MLX's CUDA backend runs as B one-row
products each reading the whole weight (H100, 32 rows, tied LM head 2048 -> 128256: 3,338 us
against 231 us as ``[B, K]``; ``bench/kernels/results/quantized_rows_pipelined_b1k_h100.json``).
Packed layers now always get ``[rows, K]`` (:class:`mlxr_core.model.quantize.KernelQuantizedLinear`),
and then the fused kernel is faster for every Llama-3.2-1B layer shape at 1, 8 and 32 rows (32
rows, device time of queued calls: qkv 72 vs 106 us, output 25 vs 70, gate/up 46 vs 241, down 58
vs 189, LM head 231 vs 1,375; ``python3 bench/kernels/quantized_rows.py --rows 32 --iters 10
--pipelined``). End to end on an H100 (``bench/gpu_decode.py --only q4 --rounds 3 --streams 8
32``, each kernel): 8 streams 1,053 tok/s here vs 1,684 fused, 32 streams 4,073 vs 3,959 (the
step is bound elsewhere there). Below :data:`MIN_ROWS` rows the fused kernel runs anyway.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import KernelImpl, device_reasons, reference

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
    return device_reasons(ctx, "cuda")


quantized_matmul_kernel = KernelImpl(
    quantized_matmul,
    _cuda_only,
    summary=f"mx.quantized_matmul below {MIN_ROWS} rows; from there dequantize + dense matmul (batched decode)",
)
