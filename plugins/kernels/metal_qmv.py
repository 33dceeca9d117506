"""``metal_qmv``: the Metal twin of :mod:`mlxr_plugins.kernels.cuda_qmv`, the one-row (batch-1
decode) 4- and 8-bit affine matrix-vector product, through ``mx.fast.metal_kernel``.

UNTESTED: written without an Apple GPU, it has never been compiled or run; its parity test skips
without Metal. Opt-in (``kernels: {quantized_matmul: metal_qmv}``); two or more rows, and
everything the kernel does not take, run ``mx.quantized_matmul``.

The same algorithm and work split as the CUDA twin (CUDA block = Metal threadgroup, warp =
SIMD-group of 32, shuffle = ``simd_shuffle_xor`` / ``simd_sum``, ``__shared__`` = ``threadgroup``),
from :func:`cuda_qmv.layout`: the input row staged as float32 in swizzled threadgroup memory with
each 16-byte vector's sum, 16-byte loads of packed words, a value moved to the top of a float's
mantissa so that ``m = 1 + q / 2^bits`` and the vector adds ``2^bits scale (A - S) + bias S``.
One difference: no loads a step ahead (the CUDA twin's register double buffer); a lane's vectors
are loaded and used in turn. Apple GPUs give a threadgroup 32 KB, so reductions stop at
:data:`MAX_K` (the float32 copy of the row takes 16 KB there).
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import KernelImpl, cuda_qmv, device_reasons

#: Longest reduction: the row's float32 copy (16 KB) and its sums in 32 KB of threadgroup memory.
MAX_K = 4096

_HEADER = r"""
// As the CUDA twin: 16-byte chunk f of the staged input sits at f ^ ((f / 8) % 8).
inline int mlxr_qmv_swizzle(int f) { return f ^ ((f >> 3) & 7); }
"""

# Template: as cuda_qmv's kernel (T, QBITS, GS, KDIM, SPLITS, RPW, U unused here, NT).
_SOURCE = r"""
  constexpr int NW = NT / 32;
  constexpr int VW = 128 / QBITS;
  constexpr int EPW = 32 / QBITS;
  constexpr int VPR = KDIM / VW;
  constexpr int VS = VPR / SPLITS;
  constexpr int NV = (VS + 31) / 32;
  constexpr int WPR = KDIM * QBITS / 32;
  constexpr int GPR = KDIM / GS;
  constexpr int RPI = NW / SPLITS * RPW;
  constexpr int TOP = 23 - QBITS;
  constexpr uint QMASK = ((1u << QBITS) - 1u) << TOP;
  constexpr float QSCALE = float(1 << QBITS);
  const int N = w_shape[0];
  const int tid = thread_index_in_threadgroup;
  const int lane = thread_index_in_simdgroup;
  const int warp = simdgroup_index_in_threadgroup;
  const int split = warp % SPLITS;
  const int slot = warp / SPLITS;

  threadgroup float4 xs4[KDIM / 4];
  threadgroup float xsum[VPR];
  threadgroup float part[NW * RPW];

  for (int e0 = 0; e0 < KDIM / 8; e0 += NT) {
    const int e = e0 + tid;
    const bool has = e < KDIM / 8;
    float v[8];
    float sum = 0.f;
    for (int i = 0; i < 8; ++i) {
      v[i] = has ? static_cast<float>(x[e * 8 + i]) : 0.f;
      sum += v[i];
    }
    for (int off = 1; off < VW / 8; off <<= 1) sum += simd_shuffle_xor(sum, ushort(off));
    if (has) {
      xs4[mlxr_qmv_swizzle(2 * e)] = float4(v[0], v[1], v[2], v[3]);
      xs4[mlxr_qmv_swizzle(2 * e + 1)] = float4(v[4], v[5], v[6], v[7]);
      if (e % (VW / 8) == 0) xsum[e / (VW / 8)] = sum;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (int row0 = int(threadgroup_position_in_grid.x) * RPI; row0 < N;
       row0 += int(threadgroups_per_grid.x) * RPI) {
    float acc[RPW];
    for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
    for (int c = 0; c < NV; ++c) {
      const int v = split * VS + c * 32 + lane;
      if (c * 32 + lane < VS) {
        const float s = xsum[v];
        for (int r = 0; r < RPW; ++r) {
          const int row = row0 + slot * RPW + r;
          if (row >= N) continue;
          const uint4 q = reinterpret_cast<const device uint4*>(w + int64_t(row) * WPR)[v];
          const int64_t g = int64_t(row) * GPR + (v * VW) / GS;
          const float scale = static_cast<float>(scales[g]);
          const float bias = static_cast<float>(biases[g]);
          float a = 0.f;
          for (int f = 0; f < VW / 4; ++f) {
            const float4 xv = xs4[mlxr_qmv_swizzle(v * (VW / 4) + f)];
            const uint word = q[f / (EPW / 4)];
            const int i0 = (f % (EPW / 4)) * 4;
            for (int i = 0; i < 4; ++i) {
              const int pos = (i0 + i) * QBITS;
              const uint moved = pos <= TOP ? word << (TOP - pos) : word >> (pos - TOP);
              a = fma(as_type<float>(0x3f800000u | (moved & QMASK)), xv[i], a);
            }
          }
          acc[r] = fma(QSCALE * scale, a - s, fma(bias, s, acc[r]));
        }
      }
    }
    for (int r = 0; r < RPW; ++r) acc[r] = simd_sum(acc[r]);
    if (SPLITS == 1) {
      if (lane == 0) {
        for (int r = 0; r < RPW; ++r) {
          const int row = row0 + slot * RPW + r;
          if (row < N) o[row] = static_cast<T>(acc[r]);
        }
      }
    } else {
      if (lane == 0) {
        for (int r = 0; r < RPW; ++r) part[warp * RPW + r] = acc[r];
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (tid < RPI) {
        const int rows_slot = tid / RPW;
        const int r = tid % RPW;
        float total = 0.f;
        for (int sp = 0; sp < SPLITS; ++sp) total += part[(rows_slot * SPLITS + sp) * RPW + r];
        const int row = row0 + rows_slot * RPW + r;
        if (row < N) o[row] = static_cast<T>(total);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
"""


@functools.cache
def _kernel() -> Any:
    return mx.fast.metal_kernel(
        name="mlxr_qmv",
        input_names=["x", "w", "scales", "biases"],
        output_names=["o"],
        source=_SOURCE,
        header=_HEADER,
    )


def one_row_plan(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None,
                 **packing: Any) -> cuda_qmv.OneRowPlan | str:
    """The CUDA twin's plan, for reductions up to :data:`MAX_K`."""
    plan = cuda_qmv.one_row_plan(x, w, scales, biases, **packing)
    if isinstance(plan, cuda_qmv.OneRowPlan) and plan.k > MAX_K:
        return f"reduction {plan.k} (Metal kernel: up to {MAX_K})"
    return plan


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
) -> mx.array:
    """The kernel for one row (untested, see the module docstring), else ``mx.quantized_matmul``."""
    plan = one_row_plan(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode)
    if isinstance(plan, str):
        return mx.quantized_matmul(
            x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode
        )
    (out,) = _kernel()(
        inputs=[x, w, scales, biases],
        template=plan.template(x.dtype),
        grid=(plan.blocks * cuda_qmv.THREADS, 1, 1),
        threadgroup=(cuda_qmv.THREADS, 1, 1),
        output_shapes=[(*x.shape[:-1], plan.n)],
        output_dtypes=[x.dtype],
    )
    return out


def _metal_only(ctx: KernelContext) -> list[str]:
    return device_reasons(ctx, "metal")


quantized_matmul_kernel = KernelImpl(
    quantized_matmul,
    _metal_only,
    summary=(
        f"UNTESTED Metal twin of cuda_qmv: 4- and 8-bit matrix-vector product for one row "
        f"(reductions up to {MAX_K}); the rest runs mx.quantized_matmul"
    ),
)
