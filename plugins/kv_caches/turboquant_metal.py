"""TurboQuant's fused kernels on Apple GPUs (``mx.fast.metal_kernel``, MLX's Metal backend): the
twin of :mod:`mlxr_plugins.kv_caches.turboquant_cuda`, kernel for kernel, so a review can read
them side by side (CUDA block = Metal threadgroup, warp = SIMD-group, ``__shared__`` =
``threadgroup``, ``__syncthreads`` = ``threadgroup_barrier``).

UNTESTED: written without an Apple machine, these kernels have never been compiled or run. The
CUDA twin passes its parity tests against the reference backend on an H200; these share its
launches (:mod:`mlxr_plugins.kv_caches.turboquant_fused`: inputs, template arguments, grids,
outputs) and run the same parity tests (``tests/plugins/kv_caches/test_turboquant_fused.py``),
which skip without Metal. Until they pass there, ``turboquant.FUSED = False`` keeps the reference.

1. ``mlxr_tq_encode``: a threadgroup of ``D`` threads per position normalizes, rotates, picks the
   levels, sketches the keys' residual and packs the bytes (SIMD-group sums, then threadgroup
   memory, for the norms).
2. ``mlxr_tq_scores``: a thread per (batch row, KV head, position) unpacks its key's codes and
   signs and takes the dot products with every query head of its group. The one difference from
   the CUDA twin: the queries are staged in threadgroup memory only where they fit in 16 KB (Apple
   GPUs have 32 KB, CUDA blocks 48 KB); larger groups read them from device memory, every thread
   of a threadgroup the same address at once.
3. ``mlxr_tq_values``: a threadgroup per (batch row, KV head, chunk of positions), a thread per
   coordinate, sums ``probability x norm x level``; the chunks' partial sums are added after.

Things to check first on a Mac: that MLX compiles without fast math (else the norms'
division may round differently from the reference: the parity tests would say), and the chunk
count (:data:`TARGET_BLOCKS`, a guess).
"""

from __future__ import annotations

import mlx.core as mx

from mlxr_plugins.kv_caches import turboquant_fused as fused

#: Threadgroups to aim for in the values kernel: a guess (four per core of a 32-core GPU), untuned.
TARGET_BLOCKS = 128

_HEADER = r"""
// Code d (W0 + W1 bits) of a row stored as a W0-bit plane then a W1-bit plane, low codes first.
template <int W0, int W1, int D>
inline int mlxr_tq_code(const device uint8_t* row, int d) {
  constexpr int P0 = 8 / W0;
  int c = (row[d / P0] >> (W0 * (d % P0))) & ((1 << W0) - 1);
  if constexpr (W1 > 0) {
    constexpr int P1 = 8 / W1;
    c |= ((row[D * W0 / 8 + d / P1] >> (W1 * (d % P1))) & ((1 << W1) - 1)) << W0;
  }
  return c;
}
"""

# Template: R, D, W0, W1, SKETCH, SKETCH_SCALE_BITS (sqrt(pi/2) / D as float32 bits). q and qs:
# the rotated and sketched queries, [B * Hkv, R, D] float32, row-contiguous; codes, signs, norms:
# the stored keys, views [B, Hkv, S, *] (signs unread without the sketch). Output [B * Hkv, R, S].
_SCORES = r"""
  // Staged where R x D floats (twice with the sketch) fit in 16 KB of the 32 KB.
  constexpr bool STAGE = R * D * (SKETCH ? 2 : 1) <= 4096;
  const int Hkv = codes_shape[1];
  const int S = codes_shape[2];
  const int bh = threadgroup_position_in_grid.y;
  const int b = bh / Hkv, h = bh % Hkv;
  const int tid = thread_position_in_threadgroup.x;
  const int nt = threads_per_threadgroup.x;
  const int s = thread_position_in_grid.x;
  threadgroup float sq[STAGE ? R * D : 1];
  threadgroup float ss[STAGE && SKETCH ? R * D : 1];
  threadgroup float lev[1 << (W0 + W1)];
  const device float* gq = q + int64_t(bh) * R * D;
  const device float* gs = qs + int64_t(bh) * R * D;
  if constexpr (STAGE) {
    for (int i = tid; i < R * D; i += nt) {
      sq[i] = gq[i];
      if constexpr (SKETCH) ss[i] = gs[i];
    }
  }
  for (int i = tid; i < (1 << (W0 + W1)); i += nt) lev[i] = levels[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (s >= S) return;
  const device uint8_t* row =
      codes + b * int64_t(codes_strides[0]) + h * int64_t(codes_strides[1]) + s * int64_t(codes_strides[2]);
  const device float16_t* scale =
      norms + b * int64_t(norms_strides[0]) + h * int64_t(norms_strides[1]) + s * int64_t(norms_strides[2]);
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int d = 0; d < D; ++d) {
    const float l = lev[mlxr_tq_code<W0, W1, D>(row, d)];
    for (int r = 0; r < R; ++r) {
      const float qv = STAGE ? float(sq[r * D + d]) : float(gq[r * D + d]);
      acc[r] += qv * l;
    }
  }
  const float n0 = static_cast<float>(scale[0]);
  for (int r = 0; r < R; ++r) acc[r] *= n0;
  if constexpr (SKETCH) {
    const device uint8_t* bits =
        signs + b * int64_t(signs_strides[0]) + h * int64_t(signs_strides[1]) + s * int64_t(signs_strides[2]);
    float dot[R];
    for (int r = 0; r < R; ++r) dot[r] = 0.0f;
    for (int d = 0; d < D; ++d) {
      const float sign = ((bits[d >> 3] >> (d & 7)) & 1) ? 1.0f : -1.0f;
      for (int r = 0; r < R; ++r) {
        const float qv = STAGE ? float(ss[r * D + d]) : float(gs[r * D + d]);
        dot[r] += qv * sign;
      }
    }
    const float weight = static_cast<float>(scale[norms_strides[3]]) * as_type<float>(SKETCH_SCALE_BITS);
    for (int r = 0; r < R; ++r) acc[r] += dot[r] * weight;
  }
  for (int r = 0; r < R; ++r) out[(int64_t(bh) * R + r) * S + s] = acc[r];
"""

# Template: R, D, W0, W1. probs [B * Hkv, R, S] float32, row-contiguous; codes, norms: the stored
# values, views [B, Hkv, S, *]. Output: partial sums [chunks, B * Hkv, R, D], one per threadgroup.
_VALUES = r"""
  const int Hkv = codes_shape[1];
  const int S = codes_shape[2];
  const int chunks = threadgroups_per_grid.x;
  const int chunk = threadgroup_position_in_grid.x;
  const int bh = threadgroup_position_in_grid.y;
  const int b = bh / Hkv, h = bh % Hkv;
  const int d = thread_position_in_threadgroup.x;
  const int per = (S + chunks - 1) / chunks;
  const int first = chunk * per, last = min(S, first + per);
  threadgroup float lev[1 << (W0 + W1)];
  threadgroup float w[R * 32];
  for (int i = d; i < (1 << (W0 + W1)); i += D) lev[i] = levels[i];
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  const device uint8_t* base = codes + b * int64_t(codes_strides[0]) + h * int64_t(codes_strides[1]);
  const device float16_t* scale = norms + b * int64_t(norms_strides[0]) + h * int64_t(norms_strides[1]);
  for (int tile = first; tile < last; tile += 32) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = d; i < R * 32; i += D) {
      const int r = i / 32, s = tile + i % 32;
      w[i] = s < last
          ? probs[(int64_t(bh) * R + r) * S + s] * static_cast<float>(scale[s * int64_t(norms_strides[2])])
          : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int n = min(32, last - tile);
    for (int j = 0; j < n; ++j) {
      const float l = lev[mlxr_tq_code<W0, W1, D>(base + (tile + j) * int64_t(codes_strides[2]), d)];
      for (int r = 0; r < R; ++r) acc[r] += w[r * 32 + j] * l;
    }
  }
  const int64_t rows = threadgroups_per_grid.y;
  for (int r = 0; r < R; ++r) out[((int64_t(chunk) * rows + bh) * R + r) * D + d] = acc[r];
"""

_ENCODE_HEADER = r"""
// The sum of v over a threadgroup of D threads (whole SIMD-groups of 32, the Apple GPU width):
// SIMD-group sums, then one partial each through red. Every thread gets the total.
template <int D>
inline float mlxr_tq_block_sum(float v, threadgroup float* red, uint lane, uint group) {
  v = simd_sum(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);  // red's previous sum read by every thread
  if (lane == 0) red[group] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (int w = 0; w < D / 32; ++w) total += red[w];
  return total;
}
"""

# Template: T (x's dtype), D, W0, W1; SKETCH_ON defined before the source (1: keys, with the
# sign sketch; 0: values). x [N, D] row-contiguous; a threadgroup of D threads per row n.
_ENCODE = r"""
  const int n = threadgroup_position_in_grid.x;
  const int d = thread_position_in_threadgroup.x;
  const uint lane = thread_index_in_simdgroup;
  const uint group = simdgroup_index_in_threadgroup;
  threadgroup float u[D];
  threadgroup float red[32];
  threadgroup int code[D];
#if SKETCH_ON
  threadgroup float res[D];
  threadgroup int bit[D];
#endif
  const float xv = static_cast<float>(x[int64_t(n) * D + d]);
  const float norm = metal::precise::sqrt(mlxr_tq_block_sum<D>(xv * xv, red, lane, group));
  u[d] = xv / max(norm, 1e-30f);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float rot = 0.0f;
  for (int k = 0; k < D; ++k) rot += u[k] * rotation[k * D + d];
  int c = 0;
  for (int e = 0; e < (1 << (W0 + W1)) - 1; ++e) c += rot > edges[e];
  code[d] = c;
#if SKETCH_ON
  const float r = rot - levels[c];
  res[d] = r;
  const float residual_norm = metal::precise::sqrt(mlxr_tq_block_sum<D>(r * r, red, lane, group));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float p = 0.0f;
  for (int k = 0; k < D; ++k) p += res[k] * sketch[d * D + k];
  bit[d] = p > 0.0f;
#endif
  threadgroup_barrier(mem_flags::mem_threadgroup);
  constexpr int B0 = D * W0 / 8;
  if (d < B0) {
    int byte = 0;
    for (int i = 0; i < 8 / W0; ++i) byte |= (code[d * (8 / W0) + i] & ((1 << W0) - 1)) << (W0 * i);
    codes[int64_t(n) * (D * (W0 + W1) / 8) + d] = static_cast<uint8_t>(byte);
  }
  if constexpr (W1 > 0) {
    if (d < D * W1 / 8) {
      int byte = 0;
      for (int i = 0; i < 8 / W1; ++i) byte |= ((code[d * (8 / W1) + i] >> W0) & ((1 << W1) - 1)) << (W1 * i);
      codes[int64_t(n) * (D * (W0 + W1) / 8) + B0 + d] = static_cast<uint8_t>(byte);
    }
  }
#if SKETCH_ON
  if (d < D / 8) {
    int byte = 0;
    for (int i = 0; i < 8; ++i) byte |= bit[d * 8 + i] << i;
    signs[int64_t(n) * (D / 8) + d] = static_cast<uint8_t>(byte);
  }
  if (d == 0) {
    norms[int64_t(n) * 2] = static_cast<half>(norm);
    norms[int64_t(n) * 2 + 1] = static_cast<half>(norm * residual_norm);
  }
#else
  if (d == 0) norms[n] = static_cast<half>(norm);
#endif
"""


# The maker is looked up when a kernel is first built, not at import.
KERNELS = fused.Kernels(
    "Metal",
    mx.metal.is_available,
    lambda **kernel: mx.fast.metal_kernel(**kernel),
    fused.Sources(encode=_ENCODE, encode_header=_ENCODE_HEADER, scores=_SCORES, values=_VALUES, header=_HEADER),
    TARGET_BLOCKS,
)
reasons = KERNELS.reasons
encode_reasons = KERNELS.encode_reasons
encode = KERNELS.encode
scores = KERNELS.scores
weighted_values = KERNELS.weighted_values
