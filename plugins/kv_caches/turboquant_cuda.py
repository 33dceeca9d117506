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

Metal: not written (the reference backend runs there).
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

import mlx.core as mx

#: Threads per block of the scores kernel (one position each).
SCORE_THREADS = 128
#: Blocks to aim for in the values kernel (two per SM of an H100/H200).
TARGET_BLOCKS = 264
#: Fewest positions one block of the values kernel sums.
MIN_CHUNK = 64

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


def reasons(queries: mx.array) -> list[str]:
    """Why the fused kernels cannot take this attention call (empty: they can)."""
    found = []
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        found.append("MLX's CUDA backend is not the default device")
    if queries.shape[-2] != 1:
        found.append("more than one query position (a prompt)")
    return found


def _planes(bits: int) -> tuple[int, int]:
    from mlxr_plugins.kv_caches.codebooks import PLANES

    widths = PLANES[bits]
    return widths[0], widths[1] if len(widths) > 1 else 0


@functools.cache
def _encode_kernel(sketch: bool) -> Any:
    return mx.fast.cuda_kernel(
        name="mlxr_tq_encode" + ("_sketch" if sketch else ""),
        input_names=["x", "rotation", "sketch", "edges", "levels"],
        output_names=["codes", "signs", "norms"] if sketch else ["codes", "norms"],
        source=f"#define SKETCH_ON {int(sketch)}\n" + _ENCODE,
    )


def encode(codec: Any, keys: mx.array, values: mx.array) -> list[mx.array]:
    """:meth:`Codec.encode_keys` and :meth:`Codec.encode_values` of ``[B, H, L, D]`` keys and
    values, one kernel each: a block per (row, head, position) normalizes, rotates, finds each
    coordinate's level, sketches the keys' residual and packs the bytes (the reference spends
    some 40 small ops on it, which on a GPU cost more than the attention itself)."""
    *lead, D = keys.shape
    arrays = []
    for x, levels, sketch in ((keys, codec.keys, codec.sketch_keys), (values, codec.values, False)):
        N = x.size // D
        W0, W1 = _planes(levels.bits)
        shapes = [(N, D * levels.bits // 8)] + ([(N, D // 8), (N, 2)] if sketch else [(N, 1)])
        dtypes = [mx.uint8] + ([mx.uint8, mx.float16] if sketch else [mx.float16])
        outputs = _encode_kernel(sketch)(
            inputs=[x.reshape(N, D), codec.rotation, codec.sketch, levels.edges, levels.levels],
            template=[("T", x.dtype), ("D", D), ("W0", W0), ("W1", W1)],
            grid=(N * D, 1, 1),
            threadgroup=(D, 1, 1),
            output_shapes=shapes,
            output_dtypes=dtypes,
        )
        arrays += [out.reshape(*lead, out.shape[-1]) for out in outputs]
    return arrays


def encode_reasons(keys: mx.array) -> list[str]:
    """Why :func:`encode` cannot take these keys (empty: it can)."""
    found = []
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        found.append("MLX's CUDA backend is not the default device")
    if keys.size == 0:
        found.append("no positions")
    if keys.shape[-1] % 32 or keys.shape[-1] > 1024:
        found.append(f"head size {keys.shape[-1]} is not a multiple of 32 up to 1024")
    return found


@functools.cache
def _scores_kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="mlxr_tq_scores",
        input_names=["q", "qs", "codes", "signs", "norms", "levels"],
        output_names=["out"],
        source=_SCORES,
        header=_HEADER,
        ensure_row_contiguous=False,
    )


@functools.cache
def _values_kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="mlxr_tq_values",
        input_names=["probs", "codes", "norms", "levels"],
        output_names=["out"],
        source=_VALUES,
        header=_HEADER,
        ensure_row_contiguous=False,
    )


def scores(codec: Any, queries: mx.array, *keys: mx.array) -> mx.array:
    """:meth:`Codec.scores` for one query position: ``queries`` ``[B, Hkv, R, 1, D]``, the stored
    keys ``[B, Hkv, S, *]`` -> ``[B, Hkv, R, 1, S]`` float32."""
    B, Hkv, R, _, D = queries.shape
    if codec.sketch_keys:
        codes, signs, norms = keys
        rotated, sketched = codec.query_terms(queries.astype(mx.float32))
        kbits = codec.bits - 1
    else:
        codes, norms = keys
        rotated = queries.astype(mx.float32) @ codec.rotation
        sketched, signs = rotated, codes  # unread
        kbits = codec.bits
    S = codes.shape[2]
    W0, W1 = _planes(kbits)
    weight = math.sqrt(math.pi / 2) / D
    (out,) = _scores_kernel()(
        inputs=[mx.contiguous(rotated), mx.contiguous(sketched), codes, signs, norms, codec.keys.levels],
        template=[
            ("R", R), ("D", D), ("W0", W0), ("W1", W1), ("SKETCH", int(codec.sketch_keys)),
            ("SKETCH_SCALE_BITS", _float_bits(weight)),
        ],
        grid=(-(-S // SCORE_THREADS) * SCORE_THREADS, B * Hkv, 1),
        threadgroup=(SCORE_THREADS, 1, 1),
        output_shapes=[(B, Hkv, R, 1, S)],
        output_dtypes=[mx.float32],
    )
    return out


def weighted_values(codec: Any, probs: mx.array, codes: mx.array, norms: mx.array) -> mx.array:
    """:meth:`Codec.weighted_values` for one query position: ``probs`` ``[B, Hkv, R, 1, S]``
    -> ``[B, Hkv, R, 1, D]``, rotated back."""
    B, Hkv, R, _, S = probs.shape
    D = codec.dim
    W0, W1 = _planes(codec.bits)
    chunks = max(1, min(-(-S // MIN_CHUNK), -(-TARGET_BLOCKS // (B * Hkv))))
    (partial,) = _values_kernel()(
        inputs=[mx.contiguous(probs.astype(mx.float32)), codes, norms, codec.values.levels],
        template=[("R", R), ("D", D), ("W0", W0), ("W1", W1)],
        grid=(chunks * D, B * Hkv, 1),
        threadgroup=(D, 1, 1),
        output_shapes=[(chunks, B, Hkv, R, 1, D)],
        output_dtypes=[mx.float32],
    )
    return partial.sum(axis=0) @ codec.rotation.T


def _float_bits(value: float) -> int:
    return int(struct.unpack("<i", struct.pack("<f", value))[0])
