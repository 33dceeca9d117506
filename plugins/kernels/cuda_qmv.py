"""``cuda_qmv``: the one-row (batch-1 decode) 4- and 8-bit affine matrix-vector product through
``mx.fast.cuda_kernel``; two or more rows go to ``cuda_qmm``.

A one-stream decode step reads every packed weight once for one input row: it is bound by memory
bandwidth, and MLX's own ``qmv`` kernel reached about 0.22 of an H100's 3.35 TB/s on the
Llama-3.2-1B shapes (4-bit, group 64: 953 us of a 1,675 us step, Nsight Compute;
``bench/results/roofline_h100_2026-12-07/README.md``). ``mlxr_qmv`` keeps more bytes in flight and
spends fewer instructions per weight:

1. A block of :data:`THREADS` threads first stages the input row in shared memory as float32 (16-byte
   chunks XOR-swizzled, so that the lanes of a warp, each reading its own 32 consecutive inputs,
   hit distinct banks) and the sum of each 16-byte weight vector's inputs.
2. Each warp owns ``rows_per_warp`` output rows and one of ``splits`` equal slices of the
   reduction; a lane reads 16-byte vectors of packed words (32 4-bit or 16 8-bit weights, within
   one group), consecutive lanes consecutive vectors. Blocks loop over rows (at most
   :data:`MAX_BLOCKS` blocks: the staging is paid once per block, not once per row), and a warp
   walks its rows in steps of a few vectors per lane, the next step's vectors, scales and biases
   loaded while the current one is computed (the first while the input is staged), so loads
   stay in flight from the kernel's start to its end.
3. A packed value ``q`` is moved to the top of a float's mantissa with one shift and one logic
   op: ``m = 1 + q / 2^bits`` exactly; the inner loop is one FMA per weight, ``A += m * x``. With
   the staged sum ``S`` of the vector's inputs, ``sum(q * x) = 2^bits (A - S)``, so the vector adds
   ``2^bits scale * (A - S) + bias * S``.
   float32 accumulation throughout; warp shuffles add the lanes, shared memory the splits.

:func:`one_row_plan` says which calls the kernel takes: one input row (any leading shape of
size 1), affine packing with biases, 4 or 8 bits, a group size of 32, 64 or 128, a reduction of at
most :data:`MAX_K` (its float32 copy fits the block's shared memory), scales, biases and input of
one floating dtype. Everything else runs ``cuda_qmm.quantized_matmul`` (its kernel for 2 to 32
rows, ``mx.quantized_matmul`` beyond). Written for MLX's CUDA backend; it cannot run elsewhere.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import KernelImpl, cuda_qmm, device_reasons

#: Threads per block (8 warps).
THREADS = 256
#: Longest reduction: the block's float32 copy of the input (32 KiB) stays in static shared memory.
MAX_K = 8192
#: Grid cap: blocks loop over rows past it (three per SM of an H100's 132, what the registers of
#: most instantiations leave room for: one wave), so the input row is staged a few hundred times
#: per call, not once per 8 rows.
MAX_BLOCKS = 396
#: Warps (rows times splits) from which a layer is not split further along its reduction.
TARGET_WARPS = 4096
#: Output rows from which a warp takes two rows (its inputs read once from shared memory for both).
TWO_ROWS_FROM = 8192
#: 16-byte vectors per lane, times rows per warp, per step (loaded a step ahead), by bit width:
#: 4 at 4 bits take 122 registers (2 blocks per SM), 2 take 45-50; 4 at 8 bits take 69-71
#: (nvcc 13, sm_90, ``bench/kernels/compile_check.py``).
IN_FLIGHT = {4: 2, 8: 4}
GROUP_SIZES = (32, 64, 128)
BITS = (4, 8)

_HEADER = r"""
// 16-byte chunk f of the staged input sits at f ^ ((f / 8) % 8): the 8 lanes of a quarter warp
// read chunks 8 (4-bit) or 4 (8-bit) apart, which would otherwise share their banks.
__device__ __forceinline__ int mlxr_qmv_swizzle(int f) { return f ^ ((f >> 3) & 7); }
"""

# Loads step ``STEP``'s chunk (U vectors of each of the warp's rows, with their groups' scale and
# bias) into nq / nsq / nbq: issued one step ahead of its use, and the first before the staging.
_LOAD = r"""{
      const int lrow0 = first + (STEP / CH) * stride;
      const int lc0 = (STEP % CH) * U;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = lc0 + u;
        const int v = split * VS + c * 32 + lane;
        const bool ok = c < NV && c * 32 + lane < VS;
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          const int row = lrow0 + slot * RPW + r;
          if (ok && row < N) {
            nq[u][r] = __ldg(reinterpret_cast<const uint4*>(w + (long long)row * WPR) + v);
            const long long g = (long long)row * GPR + (v * VW) / GS;
            const float scale = static_cast<float>(scales[g]);
            nsq[u][r] = QSCALE * scale;
            nbq[u][r] = static_cast<float>(biases[g]);
          } else {
            nq[u][r] = make_uint4(0u, 0u, 0u, 0u);
            nsq[u][r] = 0.f;
            nbq[u][r] = 0.f;
          }
        }
      }
    }"""

# Template: T (input dtype), QBITS (4 or 8), GS (group size), KDIM (reduction), SPLITS (warps per
# row: 1, 2, 4 or 8), RPW (rows per warp), U (vectors per lane and step), NT (threads).
# Inputs x [..., KDIM] (one row), w [N, KDIM * QBITS / 32] uint32, scales and biases
# [N, KDIM / GS]; output o [..., N]. A warp walks its rows in steps of U vectors per lane: CH
# steps per row, rows ``first``, ``first + stride``, ... (the block's RPI rows per iteration).
_SOURCE = r"""
  constexpr int NW = NT / 32;                     // warps per block
  constexpr int VW = 128 / QBITS;                 // weights per 16-byte vector: 32 or 16
  constexpr int EPW = 32 / QBITS;                 // weights per 32-bit word: 8 or 4
  constexpr int VPR = KDIM / VW;                  // vectors per row
  constexpr int VS = VPR / SPLITS;                // vectors per split
  constexpr int NV = (VS + 31) / 32;              // vectors per lane and split
  constexpr int CH = (NV + U - 1) / U;            // steps per row
  constexpr int WPR = KDIM * QBITS / 32;          // words per row
  constexpr int GPR = KDIM / GS;                  // groups per row
  constexpr int RPI = NW / SPLITS * RPW;          // rows per block and iteration
  constexpr int TOP = 23 - QBITS;                 // a value's place at the top of the mantissa
  constexpr unsigned int QMASK = ((1u << QBITS) - 1u) << TOP;
  constexpr float QSCALE = (float)(1 << QBITS);   // m = 1 + q / QSCALE
  const int N = w_shape[0];
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int split = warp % SPLITS;
  const int slot = warp / SPLITS;
  const int first = blockIdx.x * RPI;
  const int stride = gridDim.x * RPI;
  const int steps = first < N ? (N - first + stride - 1) / stride * CH : 0;   // same for the block

  __shared__ __align__(16) float xs[KDIM];        // the input row, float32, chunks swizzled
  __shared__ float xsum[VPR];                     // each vector's inputs, added up
  __shared__ float part[NW * RPW];                // the splits' partial sums

  uint4 nq[U][RPW];    // the next step's packed vectors
  float nsq[U][RPW];   // their QSCALE * scale
  float nbq[U][RPW];   // their bias
  if (steps > 0) /*LOAD(0)*/

  // Stage the row: 8 inputs per thread and pass; the VW / 8 neighbouring threads of one vector
  // add up its inputs by shuffles (the loop bound is the same for the whole block).
  float4* xs4w = reinterpret_cast<float4*>(xs);
  for (int e0 = 0; e0 < KDIM / 8; e0 += NT) {
    const int e = e0 + tid;
    const bool has = e < KDIM / 8;
    float v[8];
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = has ? static_cast<float>(x[e * 8 + i]) : 0.f;
      sum += v[i];
    }
#pragma unroll
    for (int off = 1; off < VW / 8; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (has) {
      xs4w[mlxr_qmv_swizzle(2 * e)] = make_float4(v[0], v[1], v[2], v[3]);
      xs4w[mlxr_qmv_swizzle(2 * e + 1)] = make_float4(v[4], v[5], v[6], v[7]);
      if (e % (VW / 8) == 0) xsum[e / (VW / 8)] = sum;
    }
  }
  __syncthreads();
  const float4* xs4 = reinterpret_cast<const float4*>(xs);

  float acc[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
  for (int t = 0; t < steps; ++t) {
    uint4 q[U][RPW];
    float sq[U][RPW];
    float bq[U][RPW];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        q[u][r] = nq[u][r];
        sq[u][r] = nsq[u][r];
        bq[u][r] = nbq[u][r];
      }
    }
    if (t + 1 < steps) /*LOAD(t + 1)*/
    const int row0 = first + (t / CH) * stride;
    const int c0 = (t % CH) * U;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u;
      const int v = split * VS + c * 32 + lane;
      if (c < NV && c * 32 + lane < VS) {
        float a[RPW];
#pragma unroll
        for (int r = 0; r < RPW; ++r) a[r] = 0.f;
#pragma unroll
        for (int f = 0; f < VW / 4; ++f) {   // the vector's inputs, 4 at a time
          const float4 xv = xs4[mlxr_qmv_swizzle(v * (VW / 4) + f)];
          const float xf[4] = {xv.x, xv.y, xv.z, xv.w};
          const int j = f / (EPW / 4);           // word of the vector
          const int i0 = (f % (EPW / 4)) * 4;    // first weight of the word for these inputs
#pragma unroll
          for (int r = 0; r < RPW; ++r) {
            const unsigned int word =
                j == 0 ? q[u][r].x : j == 1 ? q[u][r].y : j == 2 ? q[u][r].z : q[u][r].w;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int pos = (i0 + i) * QBITS;   // the value's bits in the word
              const unsigned int moved = pos <= TOP ? word << (TOP - pos) : word >> (pos - TOP);
              a[r] = fmaf(__uint_as_float(0x3f800000u | (moved & QMASK)), xf[i], a[r]);
            }
          }
        }
        const float s = xsum[v];
#pragma unroll
        for (int r = 0; r < RPW; ++r) acc[r] = fmaf(sq[u][r], a[r] - s, fmaf(bq[u][r], s, acc[r]));
      }
    }
    if (t % CH != CH - 1) continue;   // the rows go on (the same for the whole block)

#pragma unroll
    for (int r = 0; r < RPW; ++r) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
    }
    if (SPLITS == 1) {
      if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          const int row = row0 + slot * RPW + r;
          if (row < N) o[row] = static_cast<T>(acc[r]);
        }
      }
    } else {
      if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) part[warp * RPW + r] = acc[r];
      }
      __syncthreads();
      if (tid < RPI) {
        const int rows_slot = tid / RPW;
        const int r = tid % RPW;
        float total = 0.f;
#pragma unroll
        for (int sp = 0; sp < SPLITS; ++sp) total += part[(rows_slot * SPLITS + sp) * RPW + r];
        const int row = row0 + rows_slot * RPW + r;
        if (row < N) o[row] = static_cast<T>(total);
      }
      __syncthreads();   // part is written again for the next rows
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
  }
""".replace("/*LOAD(0)*/", _LOAD.replace("STEP", "0")).replace("/*LOAD(t + 1)*/", _LOAD.replace("STEP", "(t + 1)"))


@functools.cache
def _kernel() -> Any:
    """The kernel, built once; MLX compiles it once per template instantiation."""
    return mx.fast.cuda_kernel(
        name="mlxr_qmv",
        input_names=["x", "w", "scales", "biases"],
        output_names=["o"],
        source=_SOURCE,
        header=_HEADER,
    )


_FLOATS = (mx.float16, mx.bfloat16, mx.float32)


@attrs.frozen
class OneRowPlan:
    """How the kernel runs one layer's product: the work split and the launch."""

    n: int
    k: int
    bits: int
    group_size: int
    splits: int  # warps sharing one row's reduction
    rows_per_warp: int
    in_flight: int  # vectors per lane loaded ahead (U)
    blocks: int

    @property
    def vectors_per_lane(self) -> int:
        """16-byte vectors of one row each lane reads (per split)."""
        return -(-(self.k * self.bits // 128 // self.splits) // 32)

    def template(self, dtype: mx.Dtype) -> list[tuple[str, Any]]:
        return [("T", dtype), ("QBITS", self.bits), ("GS", self.group_size), ("KDIM", self.k),
                ("SPLITS", self.splits), ("RPW", self.rows_per_warp), ("U", self.in_flight),
                ("NT", THREADS)]


@functools.lru_cache(maxsize=512)
def layout(
    n: int,
    k: int,
    bits: int,
    group_size: int,
    splits: int | None = None,
    rows_per_warp: int | None = None,
    max_blocks: int = MAX_BLOCKS,
    in_flight: int | None = None,
) -> OneRowPlan:
    """The work split for an ``[n, k]`` layer (cached: one per layer shape). ``splits``,
    ``rows_per_warp``, ``max_blocks`` and ``in_flight`` override the defaults (for benchmarks and
    tests)."""
    vectors = k * bits // 128  # 16-byte vectors per row
    if splits is not None and (splits not in (1, 2, 4, 8) or vectors % splits):
        raise ValueError(f"{splits} splits of {vectors} vectors (1, 2, 4 or 8 dividing them)")
    if rows_per_warp is not None and rows_per_warp not in (1, 2, 4):
        raise ValueError(f"{rows_per_warp} rows per warp (1, 2 or 4)")
    if rows_per_warp is None:
        rows_per_warp = 2 if n >= TWO_ROWS_FROM else 1
    if splits is None:
        # Narrow layers: more warps per row, each lane still with at least one vector.
        splits = 1
        while (splits < 8 and -(-n // rows_per_warp) * splits < TARGET_WARPS
               and vectors % (2 * splits) == 0 and vectors // (2 * splits) >= 32):
            splits *= 2
    per_lane = -(-(vectors // splits) // 32)
    if in_flight is None:
        in_flight = max(1, min(per_lane, IN_FLIGHT[bits] // rows_per_warp))
    rows_per_iteration = THREADS // 32 // splits * rows_per_warp
    needed = -(-n // rows_per_iteration)
    iterations = -(-needed // max_blocks)
    return OneRowPlan(n, k, bits, group_size, splits, rows_per_warp, in_flight, -(-needed // iterations))


def one_row_plan(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
) -> OneRowPlan | str:
    """How the kernel runs these arrays, or why it does not take them."""
    if x.ndim < 1 or x.size != x.shape[-1]:  # first: the cheapest answer for a prompt's rows
        return f"input of shape {tuple(x.shape)} (kernel: one row)"
    if mode != "affine" or biases is None or bits not in BITS or not transpose:
        return (f"{mode} {bits}-bit packing{'' if transpose else ', not transposed'}"
                f"{'' if biases is not None else ' without biases'} (kernel: affine 4- or 8-bit with biases)")
    if group_size not in GROUP_SIZES:
        return f"group size {group_size} (kernel: {', '.join(map(str, GROUP_SIZES))})"
    if x.dtype not in _FLOATS or scales.dtype != x.dtype or biases.dtype != x.dtype:
        return f"input {x.dtype}, scales {scales.dtype}, biases {biases.dtype} (kernel: one floating dtype)"
    k = x.shape[-1]
    n = w.shape[0]
    if w.ndim != 2 or w.dtype != mx.uint32 or w.shape[1] * 32 != k * bits or k % group_size:
        return f"reduction {k} with weights {tuple(w.shape)} {w.dtype} (kernel: [N, K * bits / 32] uint32, K a multiple of the group)"
    if not 0 < k <= MAX_K:
        return f"reduction {k} (kernel: 1 to {MAX_K})"
    if scales.shape != (n, k // group_size) or biases.shape != scales.shape:
        return f"scales {tuple(scales.shape)} and biases {tuple(biases.shape)} for weights {tuple(w.shape)}"
    return layout(n, k, bits, group_size)


def one_row_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, plan: OneRowPlan) -> mx.array:
    """``x @ dequantize(w).T`` for one row by the kernel, with ``plan`` from :func:`one_row_plan`."""
    (out,) = _kernel()(
        inputs=[x, w, scales, biases],
        template=plan.template(x.dtype),
        grid=(plan.blocks * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(*x.shape[:-1], plan.n)],
        output_dtypes=[x.dtype],
    )
    return out


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
    """The kernel for one row (module docstring), else ``cuda_qmm.quantized_matmul``."""
    plan = one_row_plan(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode)
    if isinstance(plan, str):
        return cuda_qmm.quantized_matmul(
            x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode
        )
    assert biases is not None
    return one_row_matmul(x, w, scales, biases, plan)


def _cuda_only(ctx: KernelContext) -> list[str]:
    return device_reasons(ctx, "cuda")


quantized_matmul_kernel = KernelImpl(
    quantized_matmul,
    _cuda_only,
    summary=(
        "4- and 8-bit packed matrix-vector product for one row (batch-1 decode, reductions up to "
        f"{MAX_K}); 2-{cuda_qmm.MAX_ROWS} rows as cuda_qmm; the rest runs mx.quantized_matmul"
    ),
)
