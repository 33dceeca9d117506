"""``cpu_int8``: ``cpu_native``'s packed matmul with the decode step's input rounded to int8, as
llama.cpp computes on a CPU. Opt-in: ``kernels: {quantized_matmul: cpu_int8, gather_matmul:
cpu_int8}``.

A decode step's rows (fewer than 4 per call) are rounded to int8 per 32-element block, each block
with its own scale (max |x| / 127), and each block's dot product with a 4- or 8-bit weight's
integers is one AVX-512 VNNI instruction per 64 byte pairs instead of a conversion of the weight to
floats and float multiply-adds (``native/qmm_kernels.h``: ``tile_q4_int8``, ``tile_q8_int8``); the
bias term stays exact. One row of a 4-bit 32768 x 2048 matrix on 2 threads: 1.9 ms against 3.9 ms;
Gemma 3's 8-bit LM head (262144 x 640): 10.2 against 14.2 ms (``bench/cpu_qmm_scales.py --int8``).

The price is the input's rounding: outputs move by about 1% of their largest value on random
inputs (the same rounding llama.cpp's CPU backend applies to every matmul's input). Prompts (4 rows
or more per call) keep float32 inputs, so a position computed in a prompt and the same position
decoded alone differ by that rounding: greedy speculative decoding then matches plain decoding only
up to near-ties, not exactly. Other widths (2/3/5/6 bits) and CPUs without AVX-512 VNNI keep
``cpu_native``'s float path; ``supports()`` names a CPU without it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import KernelImpl, cpu_native, native


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None = None, **packing: Any) -> mx.array:
    """``cpu_native``'s ``quantized_matmul`` with int8 decode rows."""
    return cpu_native.quantized_matmul(x, w, scales, biases, int8=True, **packing)


def gather_matmul(x: mx.array, w: mx.array, scales: mx.array | None = None, biases: mx.array | None = None, **packing: Any) -> mx.array:
    """``cpu_native``'s ``gather_matmul`` with int8 decode rows."""
    return cpu_native.gather_matmul(x, w, scales, biases, int8=True, **packing)


def _support(ctx: KernelContext) -> list[str]:
    reasons = cpu_native.quantized_matmul_kernel.supports(ctx)
    if not reasons:
        module, _ = native.load()
        if module is not None and not module.int8_decode():
            reasons.append(
                f"this CPU has no AVX-512 VNNI integer dot products (the native kernels' SIMD here: {module.isa()})"
            )
    return reasons


quantized_matmul_kernel = KernelImpl(
    quantized_matmul,
    _support,
    summary="cpu_native with a decode step's rows rounded to int8 per 32-element block (AVX-512 VNNI), as llama.cpp",
    keeps_packed=True,
)
gather_matmul_kernel = KernelImpl(
    gather_matmul,
    _support,
    summary="cpu_native's packed experts with int8 decode rows (AVX-512 VNNI)",
)
