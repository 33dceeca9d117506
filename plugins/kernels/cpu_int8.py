"""``cpu_int8``: ``cpu_native``'s packed matmul with its input rounded to int8, as llama.cpp computes
on a CPU.

Every input row is rounded to int8 per 32-element block, each block with its own scale (max |x| /
127), and each block's dot product with a 4-, 5- or 8-bit weight's integers is one AVX-512 VNNI
instruction per 64 byte pairs instead of a conversion of the weight to floats and float
multiply-adds (``native/qmm_kernels.h``: ``tile_q4_int8``, ``tile_bytes_int8``, 4 weight rows by 3
input rows a tile; 5-bit fields are cut into bytes with AVX-512 VBMI, three instructions per 64,
where the CPU has it); the bias term stays exact (the float input's group sums). One row of a 4-bit
32768 x 2048 matrix on 2 threads: 1.6 ms against 3.2 ms; Gemma 3's 8-bit LM head (262144 x 640):
9.4 against 11.9 ms (``bench/cpu_qmm_scales.py --int8``); Gemma 3's 5-bit gate and up projections
(4096 x 640): 112 against 330 us.

Calls of 16 rows or more (a prompt) go through AMX's tile products where the CPU has them
(Sapphire Rapids and later) and Linux lets the process use them (``amx_rows``: one 32-element block
of 16 weight rows by 16 input rows an instruction, exact 32-bit block sums, then scaled by AVX-512);
elsewhere through the same tiles as a decode step. 128 rows of Gemma 3's 2048 x 640 4-bit product:
~0.8 ms against ~2.9 ms with float inputs; Gemma 3's 128-token prompt 2.1x faster end to end.

The price is the input's rounding: outputs move by about 1% of their largest value on random
inputs (the rounding llama.cpp's CPU backend applies to every matmul's input). A row's result does
not depend on the values of the rows beside it in the call (a prompt, a batch of streams, one
decode step), to the last bit; it depends on their number only through the path taken (fewer than
16 rows or AMX's), whose sums of the same integers differ in float rounding. Other widths (2/3/6 bits, and 5 without VBMI) keep
``cpu_native``'s float path, and so do CPUs without AVX-512 VNNI, where ``supports()`` says so.

It is ``auto``'s choice where it runs (its priority is above ``cpu_native``'s): the fastest path
whose answers were checked against llama.cpp's; ``kernels: {quantized_matmul: cpu_native}`` opts out.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import KernelImpl, cpu_native, native

#: The conformance check's tolerance: the rounding of ~N(0, 1) inputs (a step of up to 1/127 of a
#: block's largest value) over sums of K = 256..512 products of O(1) terms (outputs of O(20)): an
#: error of ~0.1 standard deviation; 1.0 bounds the largest of thousands of outputs.
#: The arithmetic after the rounding is checked exactly in test_cpu_int8.py.
PARITY_TOLERANCE = {"float32": (1.0, 2e-2), "float16": (1.0, 2e-2), "bfloat16": (3.0, 2e-2)}


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None = None, **packing: Any) -> mx.array:
    """``cpu_native``'s ``quantized_matmul`` with int8 inputs."""
    return cpu_native.quantized_matmul(x, w, scales, biases, int8=True, **packing)


def gather_matmul(x: mx.array, w: mx.array, scales: mx.array | None = None, biases: mx.array | None = None, **packing: Any) -> mx.array:
    """``cpu_native``'s ``gather_matmul`` with int8 inputs."""
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
    summary="the default where the CPU has AVX-512 VNNI: cpu_native with the input rounded to int8 per "
            "32-element block (prompts through AMX where the CPU has it), as llama.cpp; "
            "quantized_matmul: cpu_native keeps float inputs",
    keeps_packed=True,
    parity_tolerance=PARITY_TOLERANCE,
)
gather_matmul_kernel = KernelImpl(
    gather_matmul,
    _support,
    summary="cpu_native's packed experts with int8 inputs (AVX-512 VNNI)",
    parity_tolerance=PARITY_TOLERANCE,
)
