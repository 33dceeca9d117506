"""TurboQuant decode attention read straight from the packed cache: two CUDA kernels
(``mx.fast.cuda_kernel``, MLX's CUDA backend).

The reference backend (:class:`~mlxr_plugins.kv_caches.codebooks.Codec`) looks every stored byte
up in a table, which materializes the keys' and values' levels as float32 (``[B, H, S, D]``, 8
times the packed bytes or more) before two matmuls: on an H100 that made a decode step cost 4-7x
full precision at 4k-16k tokens of context. Here a decode step (one query position) reads the
packed bytes once:

1. ``mlxr_tq_scores``: a thread per (batch row, KV head, position) unpacks its key's level codes
   and sign bits, and takes the dot products with every query head of its group (the rotated and
   the sketched query, staged in shared memory), times the key's norms.
2. ``mlxr_tq_values``: a block per (batch row, KV head, chunk of positions), a thread per
   coordinate, sums ``probability x norm x level`` over its chunk for every query head of the
   group; the chunks' partial sums are added by one ``sum``, and the rotation is undone once.

The softmax between them, the full-precision window and the masks stay the reference's (``mx``):
they are small next to the cache. Prompts (more than one query position) take the reference path.
Results equal the reference up to float32 summation order.

Writing positions (:func:`encode`, prompts too) is one kernel for the keys and one for the values:
normalize, rotate, pick the levels, sketch the residual, pack.

The launches (shapes, grids, template arguments) are shared with the Metal twin,
:mod:`mlxr_plugins.kv_caches.turboquant_metal`, in :mod:`mlxr_plugins.kv_caches.turboquant_fused`;
the Metal kernels are written but untested (never compiled or run: no Apple machine here).
"""

from __future__ import annotations

import mlx.core as mx

from mlxr_plugins.kv_caches import turboquant_fused as fused

#: Blocks to aim for in the values kernel (two per SM of an H100/H200).
TARGET_BLOCKS = 264

_HEADER = r"""
template <int W0, int W1, int D>
__device__ __forceinline__ int mlxr_tq_code(const uint8_t* row, int d) {
  constexpr int P0 = 8 / W0;
  int c = (row[d / P0] >> (W0 * (d % P0))) & ((1 << W0) - 1);
  if constexpr (W1 > 0) {
    constexpr int P1 = 8 / W1;
    c |= ((row[D * W0 / 8 + d / P1] >> (W1 * (d % P1))) & ((1 << W1) - 1)) << W0;
  }
  return c;
}
"""

_SCORES = r"""
  const int Hkv = codes_shape[1];
  const int S = codes_shape[2];
  const int bh = blockIdx.y;
  const int b = bh / Hkv, h = bh % Hkv;
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  __shared__ float sq[R * D];
  __shared__ float ss[SKETCH ? R * D : 1];
  __shared__ float lev[1 << (W0 + W1)];
  for (int i = threadIdx.x; i < R * D; i += blockDim.x) {
    sq[i] = q[(long long)bh * R * D + i];
    if constexpr (SKETCH) ss[i] = qs[(long long)bh * R * D + i];
  }
  for (int i = threadIdx.x; i < (1 << (W0 + W1)); i += blockDim.x) lev[i] = levels[i];
  __syncthreads();
  if (s >= S) return;
  const uint8_t* row = codes + b * codes_strides[0] + h * codes_strides[1] + s * codes_strides[2];
  const auto* scale = norms + b * norms_strides[0] + h * norms_strides[1] + s * norms_strides[2];
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int d = 0; d < D; ++d) {
    const float l = lev[mlxr_tq_code<W0, W1, D>(row, d)];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] += sq[r * D + d] * l;
  }
  const float n0 = static_cast<float>(scale[0]);
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] *= n0;
  if constexpr (SKETCH) {
    const uint8_t* bits = signs + b * signs_strides[0] + h * signs_strides[1] + s * signs_strides[2];
    float dot[R];
#pragma unroll
    for (int r = 0; r < R; ++r) dot[r] = 0.0f;
    for (int d = 0; d < D; ++d) {
      const float sign = ((bits[d >> 3] >> (d & 7)) & 1) ? 1.0f : -1.0f;
#pragma unroll
      for (int r = 0; r < R; ++r) dot[r] += ss[r * D + d] * sign;
    }
    const float weight = static_cast<float>(scale[norms_strides[3]]) * __int_as_float(SKETCH_SCALE_BITS);
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] += dot[r] * weight;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) out[((long long)bh * R + r) * S + s] = acc[r];
"""

_VALUES = r"""
  const int Hkv = codes_shape[1];
  const int S = codes_shape[2];
  const int chunks = gridDim.x;
  const int chunk = blockIdx.x;
  const int bh = blockIdx.y;
  const int b = bh / Hkv, h = bh % Hkv;
  const int d = threadIdx.x;
  const int per = (S + chunks - 1) / chunks;
  const int first = chunk * per, last = min(S, first + per);
  __shared__ float lev[1 << (W0 + W1)];
  __shared__ float w[R * 32];
  for (int i = threadIdx.x; i < (1 << (W0 + W1)); i += blockDim.x) lev[i] = levels[i];
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  const uint8_t* base = codes + b * codes_strides[0] + h * codes_strides[1];
  const auto* scale = norms + b * norms_strides[0] + h * norms_strides[1];
  for (int tile = first; tile < last; tile += 32) {
    __syncthreads();
    for (int i = threadIdx.x; i < R * 32; i += blockDim.x) {
      const int r = i / 32, s = tile + i % 32;
      w[i] = s < last ? probs[((long long)bh * R + r) * S + s] * static_cast<float>(scale[s * norms_strides[2]]) : 0.0f;
    }
    __syncthreads();
    const int n = min(32, last - tile);
    for (int j = 0; j < n; ++j) {
      const float l = lev[mlxr_tq_code<W0, W1, D>(base + (tile + j) * codes_strides[2], d)];
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] += w[r * 32 + j] * l;
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) out[(((long long)chunk * gridDim.y + bh) * R + r) * D + d] = acc[r];
"""


_ENCODE = r"""
  const int n = blockIdx.x;
  const int d = threadIdx.x;
  __shared__ float u[D];
  __shared__ float red[32];
  __shared__ int code[D];
  auto block_sum = [&](float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    __syncthreads();
    if ((d & 31) == 0) red[d >> 5] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < D / 32; ++w) total += red[w];
    return total;
  };
  const float xv = static_cast<float>(x[(long long)n * D + d]);
  const float norm = sqrtf(block_sum(xv * xv));
  u[d] = xv / fmaxf(norm, 1e-30f);
  __syncthreads();
  float rot = 0.0f;
  for (int k = 0; k < D; ++k) rot += u[k] * rotation[k * D + d];
  int c = 0;
  for (int e = 0; e < (1 << (W0 + W1)) - 1; ++e) c += rot > edges[e];
  code[d] = c;
#if SKETCH_ON
  __shared__ float res[D];
  __shared__ int bit[D];
  const float r = rot - levels[c];
  res[d] = r;
  const float residual_norm = sqrtf(block_sum(r * r));
  __syncthreads();
  float p = 0.0f;
  for (int k = 0; k < D; ++k) p += res[k] * sketch[d * D + k];
  bit[d] = p > 0.0f;
#endif
  __syncthreads();
  constexpr int B0 = D * W0 / 8;
  if (d < B0) {
    int byte = 0;
    for (int i = 0; i < 8 / W0; ++i) byte |= (code[d * (8 / W0) + i] & ((1 << W0) - 1)) << (W0 * i);
    codes[(long long)n * (D * (W0 + W1) / 8) + d] = static_cast<uint8_t>(byte);
  }
  if constexpr (W1 > 0) {
    if (d < D * W1 / 8) {
      int byte = 0;
      for (int i = 0; i < 8 / W1; ++i) byte |= ((code[d * (8 / W1) + i] >> W0) & ((1 << W1) - 1)) << (W1 * i);
      codes[(long long)n * (D * (W0 + W1) / 8) + B0 + d] = static_cast<uint8_t>(byte);
    }
  }
#if SKETCH_ON
  if (d < D / 8) {
    int byte = 0;
    for (int i = 0; i < 8; ++i) byte |= bit[d * 8 + i] << i;
    signs[(long long)n * (D / 8) + d] = static_cast<uint8_t>(byte);
  }
  if (d == 0) {
    norms[(long long)n * 2] = __float2half(norm);
    norms[(long long)n * 2 + 1] = __float2half(norm * residual_norm);
  }
#else
  if (d == 0) norms[n] = __float2half(norm);
#endif
"""


# The maker is looked up when a kernel is first built, not at import.
KERNELS = fused.Kernels(
    "CUDA",
    mx.cuda.is_available,
    lambda **kernel: mx.fast.cuda_kernel(**kernel),
    fused.Sources(encode=_ENCODE, encode_header="", scores=_SCORES, values=_VALUES, header=_HEADER),
    TARGET_BLOCKS,
)
reasons = KERNELS.reasons
encode_reasons = KERNELS.encode_reasons
encode = KERNELS.encode
scores = KERNELS.scores
weighted_values = KERNELS.weighted_values
