"""Kernels for MLX's CPU backend that hand the work to one BLAS matmul.

Quantized matmul: dequantize, then one BLAS matmul, for several rows.

MLX's CPU ``quantized_matmul`` is a plain loop: with OpenBLAS loaded (see
:mod:`mlxr_core.blas`), dequantizing the weight and handing the product to BLAS is faster from a
few rows of input up, by far in prefill (measured on a 2-core x86_64 at 576 x 1536, 4-bit, MLX
0.32.4: 31.5 ms fused vs 1.7 ms dequantize + sgemm at 40 rows; 6.9 vs 2.2 ms at 8 rows; 1.0 vs
2.2 ms at one row). A single row (decode) keeps the fused loop, which reads 4 to 8 times fewer bytes.
The dequantized weight is a temporary of one layer, freed after the matmul: resident memory stays
the quantized size.

RoPE of a decode step: MLX's CPU ``mx.fast.rope`` is composed of ~29 ops (positions, frequencies,
cos, sin, slices, products, a concatenation), and a one-token decode step pays that twice per layer,
where the per-op cost, not the arithmetic, is what counts (4,100 ops in a SmolLM2-135M step, ~3 us
each). RoPE is linear in ``x``: for one position it is ``x @ R`` with ``R`` the ``head_dim`` square
rotation of that position. ``R`` is made once per step by ``mx.fast.rope`` itself (applied to the
identity, so its angles are MLX's own) and shared by every layer and by queries and keys, so each
application is one matmul. Measured with SmolLM2-135M (float32, 2-core x86_64, MLX 0.32.4): 10-25%
more decode tokens/s, greedy tokens unchanged. Prompts (more than one position) keep ``mx.fast.rope``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import KernelImpl, mlx_fast, reference

#: Input rows (batch x positions) from which dequantize + BLAS beats the fused CPU loop.
MIN_ROWS = 4


#: The reference's dequantize + float32 matmul from MIN_ROWS rows: float32 is what BLAS multiplies
#: (sgemm).
quantized_matmul = reference.fused_below(MIN_ROWS, reference.quantized_matmul)


#: The last rotation made: (key, the arrays it names by id, R); the layers of one step share it.
#: One tuple, replaced whole, so a reader never pairs one step's key with another step's matrix.
_last_rotation: tuple[tuple[Any, ...], Any, mx.array] | None = None


def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool = False,
    base: float | None = None,
    scale: float = 1.0,
    offset: int | mx.array = 0,
    freqs: mx.array | None = None,
) -> mx.array:
    """``mx.fast.rope``; for one position per sequence in float32, ``x @ R`` (see the module)."""
    if x.ndim != 4 or x.shape[2] != 1 or x.dtype != mx.float32:
        return mx.fast.rope(
            x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs
        )
    rotation = _rotation(x.shape[-1], dims, traditional, base, scale, offset, freqs)
    return x @ rotation


def _rotation(
    head_dim: int,
    dims: int,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None,
) -> mx.array:
    """``R`` with ``rope(x) == x @ R`` at ``offset``: ``[D, D]``, or ``[B, 1, D, D]`` for per-row
    offsets. Arrays (offsets, freqs) are matched by identity: the memo holds them, so while it
    names their ids no other array can have them."""
    global _last_rotation
    position = offset if isinstance(offset, int) else id(offset)
    key = (head_dim, dims, traditional, base, scale, id(freqs), position)
    last = _last_rotation
    if last is not None and last[0] == key:
        return last[2]
    identity = mx.eye(head_dim, dtype=mx.float32)[None, :, None, :]  # row i of R is rope(e_i)
    rows = 1 if isinstance(offset, int) or offset.ndim == 0 else offset.shape[0]
    if rows > 1:
        identity = mx.broadcast_to(identity, (rows, head_dim, 1, head_dim))
    rotated = mx.fast.rope(
        identity, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs
    )
    shape = (head_dim, head_dim) if rows == 1 else (rows, 1, head_dim, head_dim)
    rotation = rotated.reshape(shape)
    _last_rotation = (key, (offset, freqs), rotation)
    return rotation


def _cpu_only(ctx: KernelContext) -> list[str]:
    if ctx.device != "cpu":
        return [f"for MLX's CPU backend (this context: {ctx.device} device), where mx.fast is not fused"]
    return []


def _rope_support(ctx: KernelContext) -> list[str]:
    return _cpu_only(ctx) + mlx_fast.rope_kernel.supports(ctx)


rope_kernel = KernelImpl(
    rope,
    _rope_support,
    summary="one-position RoPE as one matmul with the step's rotation matrix, mx.fast.rope otherwise",
)

quantized_matmul_kernel = KernelImpl(
    quantized_matmul,
    _cpu_only,
    summary=f"dequantize + BLAS matmul from {MIN_ROWS} input rows, mx.quantized_matmul below",
)
