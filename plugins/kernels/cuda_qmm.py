"""``cuda_qmm``: 4-bit packed matmul for a few rows (batched decode) through ``mx.fast.cuda_kernel``.

A batched decode step multiplies every packed weight by B rows, one per stream. MLX's CUDA
``quantized_matmul`` for a few rows (its ``qmm_sm80`` kernel) gives each block 128 outputs and the
whole reduction to walk: its time follows the reduction's length, not the layer's size (H100,
Llama-3.2-1B shape, 32 rows, Nsight Compute: 43 us for the q/k/v projection, the output
projection and the MLP's gate/up alike, 182 us for the down projection; 4.9 ms of a 6.4 ms step;
``bench/batched_step.py --ncu-steps``).

``mlxr_qmm_rows`` cuts the reduction too, inside each block, so narrow layers get many more warps:

1. A block of 256 threads owns 16 output columns. The reduction is walked in tiles of 256
   positions; the block stages each tile of the input rows in shared memory as float32 (threads
   of a column group then read the same addresses: broadcasts), and every thread takes one
   column and 16 positions (two packed words, loaded one tile ahead) of the tile.
   The next tile's inputs and words are loaded while the current one is computed.
2. A thread dequantizes its nibbles with their group's scale and bias and keeps one float32
   sum per input row (up to :data:`MAX_ROWS`).
3. At the end the block adds its 16 slices per column in shared memory and writes the outputs.
   One launch, no workspace, nothing for MLX to zero-fill.

The arithmetic runs on the CUDA cores (B FMAs per weight), so the kernel pays where MLX's kernel
is starved of blocks, not where it already fills the GPU: :func:`quantized_matmul` takes layers
with at most :data:`MAX_OUTPUTS` outputs and 2 to :data:`MAX_ROWS` rows, 4-bit affine packing with
biases, a group size of 32, 64 or 128 and a reduction that is a multiple of 256; everything else
(one row, the MLP's wide projection, the LM head) runs ``mx.quantized_matmul``. Written for and
measured on MLX's CUDA backend (``bench/kernels/quantized_rows.py``, ``bench/batched_step.py``);
it cannot run elsewhere.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import KernelImpl, device_reasons

#: Input rows the kernel takes (float32 accumulators per thread: one per row).
MAX_ROWS = 32
#: Layers with more outputs than this have blocks enough in MLX's own kernel.
MAX_OUTPUTS = 8192
#: Reduction tile: the input rows' slice staged in shared memory per step.
TILE = 256
#: Threads per block: :data:`COLUMNS` output columns times 16 slices of each tile.
THREADS = 256
COLUMNS = 16
GROUP_SIZES = (32, 64, 128)

# Template: T (input and output dtype), MT (rows allotted: 8, 16 or 32; rows past x's are zeros),
# G (group size), KT (tile), NT (threads), NC (columns per block). Inputs x [M, K], w [N, K / 8]
# uint32, scales and biases [N, K / G]; output o [M, N]. Thread t owns column t % NC of the
# block and, of every tile, the 16 reduction positions (two packed words) of slice t / NC.
_SOURCE = r"""
  constexpr int SLICES = NT / NC;           // 16: slices of a tile, one per thread of a column
  constexpr int SPAN = KT / SLICES;         // 16 positions (2 packed words) per slice
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = w_shape[0];
  const int tid = threadIdx.x;
  const int c = tid % NC;
  const int slice = tid / NC;
  const int n = blockIdx.x * NC + c;
  const bool active = n < N;
  const int tiles = K / KT;
  const unsigned int* w_row = w + (long long)(active ? n : 0) * (K / 8) + slice * (SPAN / 8);
  const long long group_row = (long long)(active ? n : 0) * (K / G);

  // Shared: the tile of inputs as float32 [MT][KT]; reused at the end to add up the slices.
  __shared__ __align__(16) float xs[MT * KT];
  float acc[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) acc[m] = 0.f;

  // The next tile's inputs (this thread's share of the staging) and packed words are loaded
  // while the current tile is computed: global loads stay in flight through the arithmetic.
  constexpr int STAGED = MT * KT / NT;      // inputs staged per thread and tile
  float staged[STAGED];
#pragma unroll
  for (int j = 0; j < STAGED; ++j) {
    const int e = tid + j * NT;
    const int m = e / KT;
    staged[j] = m < M ? static_cast<float>(x[(long long)m * K + e % KT]) : 0.f;
  }
  uint2 next = *reinterpret_cast<const uint2*>(w_row);
  for (int t = 0; t < tiles; ++t) {
    const int k0 = t * KT;
    const uint2 packed = next;
    const long long group = group_row + (k0 + slice * SPAN) / G;
    const float scale = static_cast<float>(scales[group]);
    const float bias = static_cast<float>(biases[group]);
    __syncthreads();  // the previous tile's readers are done
#pragma unroll
    for (int j = 0; j < STAGED; ++j) xs[tid + j * NT] = staged[j];
    __syncthreads();
    if (t + 1 < tiles) {
      next = *reinterpret_cast<const uint2*>(w_row + (t + 1) * (KT / 8));
#pragma unroll
      for (int j = 0; j < STAGED; ++j) {
        const int e = tid + j * NT;
        const int m = e / KT;
        staged[j] = m < M ? static_cast<float>(x[(long long)m * K + k0 + KT + e % KT]) : 0.f;
      }
    }
#pragma unroll
    for (int word = 0; word < 2; ++word) {
      const unsigned int q = word == 0 ? packed.x : packed.y;
      float wf[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) wf[i] = static_cast<float>((q >> (4 * i)) & 0xFu) * scale + bias;
      const int kk = slice * SPAN + word * 8;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const float4 a = *reinterpret_cast<const float4*>(&xs[m * KT + kk]);
        const float4 b = *reinterpret_cast<const float4*>(&xs[m * KT + kk + 4]);
        float sum = acc[m];
        sum = fmaf(a.x, wf[0], sum);
        sum = fmaf(a.y, wf[1], sum);
        sum = fmaf(a.z, wf[2], sum);
        sum = fmaf(a.w, wf[3], sum);
        sum = fmaf(b.x, wf[4], sum);
        sum = fmaf(b.y, wf[5], sum);
        sum = fmaf(b.z, wf[6], sum);
        sum = fmaf(b.w, wf[7], sum);
        acc[m] = sum;
      }
    }
  }

  // Add up the slices: [SLICES][MT][NC] partial sums in the (now free) shared tile.
  __syncthreads();
#pragma unroll
  for (int m = 0; m < MT; ++m) xs[(slice * MT + m) * NC + c] = acc[m];
  __syncthreads();
  for (int e = tid; e < MT * NC; e += NT) {
    const int m = e / NC;
    const int col = e % NC;
    const int out_n = blockIdx.x * NC + col;
    if (m < M && out_n < N) {
      float total = 0.f;
#pragma unroll
      for (int s = 0; s < SLICES; ++s) total += xs[(s * MT + m) * NC + col];
      o[(long long)m * N + out_n] = static_cast<T>(total);
    }
  }
"""


@functools.cache
def _kernel() -> Any:
    """The kernel, built once; MLX compiles it once per template instantiation."""
    return mx.fast.cuda_kernel(
        name="mlxr_qmm_rows",
        input_names=["x", "w", "scales", "biases"],
        output_names=["o"],
        source=_SOURCE,
    )


_FLOATS = (mx.float16, mx.bfloat16, mx.float32)


def rows_plan(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
) -> int | str:
    """The rows the kernel allots for these arrays (8, 16 or 32), or why it does not take them."""
    if mode != "affine" or biases is None or bits != 4 or not transpose:
        return f"{mode} {bits}-bit packing{'' if transpose else ', not transposed'} (kernel: affine 4-bit with biases)"
    if group_size not in GROUP_SIZES:
        return f"group size {group_size} (kernel: {', '.join(map(str, GROUP_SIZES))})"
    if x.ndim != 2 or x.dtype not in _FLOATS:
        return f"input of shape {tuple(x.shape)} and dtype {x.dtype} (kernel: [rows, K], floating point)"
    if scales.dtype != x.dtype or biases.dtype != x.dtype:
        return f"scales and biases in {scales.dtype}, input in {x.dtype} (kernel: one dtype)"
    rows, k = x.shape
    n = w.shape[0]
    if not 2 <= rows <= MAX_ROWS:
        return f"{rows} rows (kernel: 2 to {MAX_ROWS})"
    if n > MAX_OUTPUTS:
        return f"{n} outputs (kernel: up to {MAX_OUTPUTS}; wider layers fill the GPU in mx)"
    if k % TILE or w.shape[1] * 8 != k or w.dtype != mx.uint32:
        return f"reduction {k} with weights {tuple(w.shape)} {w.dtype} (kernel: a multiple of {TILE})"
    return 8 if rows <= 8 else 16 if rows <= 16 else 32


def rows_matmul(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, rows_allotted: int
) -> mx.array:
    """``x @ dequantize(w).T`` by the kernel, with ``rows_allotted`` from :func:`rows_plan`."""
    rows, n = x.shape[0], w.shape[0]
    (out,) = _kernel()(
        inputs=[x, w, scales, biases],
        template=[("T", x.dtype), ("MT", rows_allotted), ("G", group_size), ("KT", TILE),
                  ("NT", THREADS), ("NC", COLUMNS)],
        grid=(-(-n // COLUMNS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, n)],
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
    """The kernel for the layers and row counts it pays on (module docstring), else
    ``mx.quantized_matmul``."""
    plan = rows_plan(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode)
    if isinstance(plan, str):
        return mx.quantized_matmul(
            x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode
        )
    assert biases is not None
    return rows_matmul(x, w, scales, biases, group_size=group_size, rows_allotted=plan)


def _cuda_only(ctx: KernelContext) -> list[str]:
    return device_reasons(ctx, "cuda")


quantized_matmul_kernel = KernelImpl(
    quantized_matmul,
    _cuda_only,
    summary=(
        f"4-bit packed matmul for 2-{MAX_ROWS} rows (batched decode) with a split reduction, for "
        f"layers of up to {MAX_OUTPUTS} outputs; the rest runs mx.quantized_matmul"
    ),
)
