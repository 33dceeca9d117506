"""``cuda``: fused flash-decoding attention through ``mx.fast.cuda_kernel`` (MLX's CUDA backend).

One decode step reads the whole KV cache for ~2 FLOPs per byte, so decode attention is bound by
memory bandwidth, and only a kernel that keeps every SM streaming K and V gets near it. The fused
path here (one query position, ``L == 1``) is one launch of ``mlxr_flash_decode``:

1. The KV sequence is split into chunks, one thread block per (batch row, KV head, query-head
   group, chunk), so even B=1 with 8 KV heads fills the GPU. The query heads that share a KV head
   (GQA) are handled by the same block, so each K/V row is read once for all of them.
2. A K/V row is read by ``D / 8`` threads, 8 features each (16-byte loads); the next tile's rows
   are requested before the current tile is computed (a register double buffer), so loads stay in
   flight through the arithmetic. Warp shuffles finish the dot products, which feed an online
   softmax (running max and sum in float32, base-2 exponent, one rescale per tile).
3. The block merges its row groups in shared memory and writes one unnormalized partial (output,
   max, sum) per query head; the last block of a (batch row, KV head) group to finish, found with
   an atomic counter, merges all chunks and writes the output. One launch instead of a split and a
   reduce kernel matters as much as the GPU time: MLX spends a few microseconds of CPU per
   primitive, and a decode step is many small primitives.
   Where the batch alone gives the GPU enough blocks (32 rows x 8 KV heads), the sequence is not
   split: each block writes its output, and there is no workspace for MLX to zero-fill first (two
   fill kernels fewer per call).

K and V are read in place through their strides (``ensure_row_contiguous=False``): the KV cache
hands attention ``keys[..., :offset, :]``, a view of a larger pre-allocated buffer, and a
row-contiguous copy of it would cost as much traffic as the attention itself. Rows that are not
16-byte aligned with a unit feature stride fall back to scalar loads (same result, slower).

An array mask that varies over batch rows and keys only (``[B or 1, 1, 1, S]``, boolean or
additive) is read by the kernel as it goes: the padding mask of a batch whose rows joined at
different steps, or a sliding window. Everything else (prefill ``L > 1``, other masks, head dims
other than 64/128/256, mixed dtypes) is delegated to ``mx.fast.scaled_dot_product_attention``.
:func:`decode_plan` says for given arrays whether the fused path can run, or why not.

Which calls the backend's op fuses (:func:`attention`) follows the measurements. Measured on an
H100 with MLX 0.32.4 (bench/kernels/README.md): for unmasked decode, against mx.fast (its own
vector kernel, or cuDNN's) the fused kernel is 1.0-1.6x at short contexts but 0.74x at 32k, for
several times the host work per call, and gave no end-to-end decode gain; so unmasked calls go to
mx.fast. MLX's CUDA backend has no fused kernel for a decode query under an array mask (its vector
kernel takes none, and boolean masks none of its kernels): those calls are the fused kernel's.
With that split the backend ranks above ``mlx_fast`` and ``auto`` picks it on CUDA.
:func:`fused_attention` fuses whatever the kernel takes (for benchmarks and tests of the kernel).
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

import attrs
import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import FLOAT_DTYPES, KernelImpl, device_reasons

#: Head dims with a fused path: ``D / 8`` threads per row must be a power of two within a warp.
FUSED_HEAD_DIMS = (64, 128, 256)
#: Threads per block of the split kernel.
THREADS = 128
#: Aim for about this many blocks per launch (two per SM of an H100/H200's 132, which is what
#: their registers allow): fewer leave SMs idle at B=1, more only add partials to merge.
TARGET_BLOCKS = 264
#: The last block's merge keeps two floats per head and split in the shared merge buffer.
MAX_SPLITS = 512


_HEADER = r"""
#ifndef INFINITY  // NVRTC does not always see math.h
#define INFINITY __int_as_float(0x7f800000)
#endif

// 8 consecutive features of one row, kept raw (as stored) in P = 8 * sizeof(T) / 16 registers of
// 16 bytes: 16-byte loads when the caller has checked that the feature stride is 1 and rows are
// 16-byte aligned, else 8 strided scalar loads packed the same way.
template <typename T, int P>
__device__ __forceinline__ void load_raw(const T* p, bool vec, long long step, uint4 (&raw)[P]) {
  if (vec) {
#pragma unroll
    for (int j = 0; j < P; ++j) raw[j] = reinterpret_cast<const uint4*>(p)[j];
  } else {
    T* e = reinterpret_cast<T*>(raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = p[i * step];
  }
}

template <typename T, int P>
__device__ __forceinline__ void to_float(const uint4 (&raw)[P], float* out) {
  const T* e = reinterpret_cast<const T*>(raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(e[i]);
}

// Whether the rows of a [B, H, S, D] array can be read with 16-byte loads: unit feature stride,
// 16-byte aligned start and batch/head (and, with check_rows, row) strides.
template <typename T, typename Strides>
__device__ __forceinline__ bool vectorizable(const T* p, const Strides& st, bool check_rows) {
  const long long bytes = sizeof(T);
  return st[3] == 1 && (st[0] * bytes) % 16 == 0 && (st[1] * bytes) % 16 == 0 &&
      (!check_rows || (st[2] * bytes) % 16 == 0) &&
      (reinterpret_cast<unsigned long long>(p) % 16) == 0;
}
"""

# Template: T (dtype), D (head dim), HPB (query heads per block), NT (threads), U (K/V rows per
# row group per step), SCALE_BITS (the softmax scale's float32 bits: a float cannot be a template
# argument, and a model's scale never changes, so this costs one compilation per model), SPLIT
# (1: the sequence is split over several blocks, merged by the last to finish; 0: one block per
# group, which writes its output directly).
# Outputs: o [B, Hq, 1, D] and ws, a float32 workspace. Split, MLX zero-fills it (init_value=0):
# per query head and split the unnormalized output, max and sum (D + 2 floats), then one arrival
# counter per (batch row, KV head, head group). Unsplit, ws is one float, never read or written,
# and nothing is filled: the call is one launch, not three.
_SOURCE = r"""
  constexpr int EPT = 8;                    // features per thread
  constexpr int P = EPT * sizeof(T) / 16;   // 16-byte registers per row slice: 1, or 2 in float32
  constexpr int TPR = D / EPT;              // threads per K/V row: 8, 16 or 32, within one warp
  constexpr int RG = NT / TPR;              // row groups: K/V rows read side by side
  constexpr int TILE = RG * U;              // keys per block step
  constexpr float LOG2E = 1.4426950408889634f;

  const int Hq = q_shape[1];
  const int Hkv = k_shape[1];
  const int S = k_shape[2];
  const int R = Hq / Hkv;
  const int groups = R / HPB;
  const int n_splits = gridDim.x;
  const int split = blockIdx.x;
  const int group = blockIdx.y;             // (batch row, KV head, head group)
  const int g = group % groups;
  const int hkv = (group / groups) % Hkv;
  const int b = group / (groups * Hkv);
  const int hq0 = hkv * R + g * HPB;

  const int tid = threadIdx.x;
  const int rg = tid / TPR;
  const int d0 = (tid % TPR) * EPT;

  // Chunks are whole tiles; trailing blocks may get an empty chunk and write an empty partial.
  const int per_split = (S + n_splits - 1) / n_splits;
  const int chunk = (per_split + TILE - 1) / TILE * TILE;
  const int start = split * chunk;
  const int stop = min(start + chunk, S);

  // Uniform over the grid, so the branch in load_raw costs nothing. q has one position: its
  // row stride does not matter.
  const bool vec = vectorizable(k, k_strides, true) && vectorizable(v, v_strides, true);
  const bool q_vec = vectorizable(q, q_strides, false);
  const long long k_row = k_strides[2], v_row = v_strides[2];
  /*MASK_ROW*/
  const T* k_base = k + b * k_strides[0] + hkv * k_strides[1] + d0 * k_strides[3];
  const T* v_base = v + b * v_strides[0] + hkv * v_strides[1] + d0 * v_strides[3];

  // The queries of this block's heads, pre-scaled so scores come out in log2 units.
  const float q_scale = __int_as_float(SCALE_BITS) * LOG2E;
  float qr[HPB][EPT];
#pragma unroll
  for (int h = 0; h < HPB; ++h) {
    uint4 raw[P];
    load_raw<T, P>(q + b * q_strides[0] + (hq0 + h) * q_strides[1] + d0 * q_strides[3], q_vec,
                   q_strides[3], raw);
    to_float<T, P>(raw, qr[h]);
#pragma unroll
    for (int i = 0; i < EPT; ++i) qr[h][i] *= q_scale;
  }

  // Online softmax state of this thread's row group, per head.
  float m[HPB], l[HPB], acc[HPB][EPT];
#pragma unroll
  for (int h = 0; h < HPB; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int i = 0; i < EPT; ++i) acc[h][i] = 0.f;
  }

  // Software pipeline: the next tile's K/V rows are requested before the current tile is
  // computed, so loads stay in flight through the shuffles and exponentials.
  // Rows past the chunk are zeros, not stale registers: their weight is 0, and 0 * NaN is NaN.
  uint4 k_next[U][P], v_next[U][P];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int s = start + u * RG + rg;
    if (s < stop) {
      load_raw<T, P>(k_base + s * k_row, vec, k_strides[3], k_next[u]);
      load_raw<T, P>(v_base + s * v_row, vec, v_strides[3], v_next[u]);
    } else {
#pragma unroll
      for (int j = 0; j < P; ++j) k_next[u][j] = v_next[u][j] = make_uint4(0, 0, 0, 0);
    }
  }
  for (int s0 = start; s0 < stop; s0 += TILE) {
    uint4 k_tile[U][P], v_tile[U][P];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int j = 0; j < P; ++j) {
        k_tile[u][j] = k_next[u][j];
        v_tile[u][j] = v_next[u][j];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + TILE + u * RG + rg;
      if (s < stop) {
        load_raw<T, P>(k_base + s * k_row, vec, k_strides[3], k_next[u]);
        load_raw<T, P>(v_base + s * v_row, vec, v_strides[3], v_next[u]);
      } else {
#pragma unroll
        for (int j = 0; j < P; ++j) k_next[u][j] = v_next[u][j] = make_uint4(0, 0, 0, 0);
      }
    }

    float score[HPB][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[EPT];
      to_float<T, P>(k_tile[u], kf);
      const int key = s0 + u * RG + rg;
      bool valid = key < stop;
      float bias = 0.f;  // an additive mask's value, in log2 units
      /*MASK_LOAD*/
#pragma unroll
      for (int h = 0; h < HPB; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < EPT; ++i) dot += qr[h][i] * kf[i];
        // Every lane of the row group ends with the full dot product (the whole warp takes
        // part: the loop bounds are uniform over the block).
#pragma unroll
        for (int offset = TPR / 2; offset > 0; offset >>= 1)
          dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        score[h][u] = valid ? dot + bias : -INFINITY;
      }
    }
    // One rescale per tile rather than per key.
    float p[HPB][U];
#pragma unroll
    for (int h = 0; h < HPB; ++h) {
      float tile_max = score[h][0];
#pragma unroll
      for (int u = 1; u < U; ++u) tile_max = fmaxf(tile_max, score[h][u]);
      const float m_new = fmaxf(m[h], tile_max);
      // m_new is -inf only while this row group has seen no key: then nothing changes.
      const float correction = m_new == -INFINITY ? 1.f : exp2f(m[h] - m_new);
      l[h] *= correction;
#pragma unroll
      for (int i = 0; i < EPT; ++i) acc[h][i] *= correction;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        p[h][u] = m_new == -INFINITY ? 0.f : exp2f(score[h][u] - m_new);  // 0 past the chunk
        l[h] += p[h][u];
      }
      m[h] = m_new;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[EPT];
      to_float<T, P>(v_tile[u], vf);
#pragma unroll
      for (int h = 0; h < HPB; ++h) {
#pragma unroll
        for (int i = 0; i < EPT; ++i) acc[h][i] += p[h][u] * vf[i];
      }
    }
  }

  // Merge the row groups of the block: rescale each to the block's max per head.
  __shared__ float s_m[RG][HPB];
  __shared__ float s_l[RG][HPB];
  __shared__ __align__(16) float s_acc[RG][HPB][D];
  if (tid % TPR == 0) {
#pragma unroll
    for (int h = 0; h < HPB; ++h) {
      s_m[rg][h] = m[h];
      s_l[rg][h] = l[h];
    }
  }
#pragma unroll
  for (int h = 0; h < HPB; ++h) {
    float4* dst = reinterpret_cast<float4*>(&s_acc[rg][h][d0]);
    dst[0] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
    dst[1] = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
  }
  __syncthreads();
  // Partials: [B * Hq, n_splits, D + 2] (output, then max and sum); counters after them.
  float* partials = ws;
  unsigned int* counters =
      reinterpret_cast<unsigned int*>(ws + (long long)q_shape[0] * Hq * n_splits * (D + 2));
  for (int e = tid; e < HPB * D; e += NT) {
    const int h = e / D;
    const int d = e % D;
    float block_max = -INFINITY;
#pragma unroll
    for (int r = 0; r < RG; ++r) block_max = fmaxf(block_max, s_m[r][h]);
    float sum = 0.f, out = 0.f;
    if (block_max != -INFINITY) {
#pragma unroll
      for (int r = 0; r < RG; ++r) {
        const float w = exp2f(s_m[r][h] - block_max);
        sum += w * s_l[r][h];
        out += w * s_acc[r][h][d];
      }
    }
    if (!SPLIT) {  // the block saw every key of its group: the output, normalized
      // A row that masks every key: 0, as the merge below writes.
      o[(long long)(b * Hq + hq0 + h) * D + d] = static_cast<T>(sum > 0.f ? out / sum : 0.f);
      continue;
    }
    float* part = partials + ((long long)(b * Hq + hq0 + h) * n_splits + split) * (D + 2);
    part[d] = out;
    if (d == 0) {
      part[D] = block_max;
      part[D + 1] = sum;
    }
  }

  if (!SPLIT) return;
  // The last block of the group to finish merges every split (threadFenceReduction pattern):
  // one launch, no second kernel.
  __threadfence();
  __syncthreads();
  __shared__ bool last;
  if (tid == 0) last = atomicAdd(&counters[group], 1u) == (unsigned int)(n_splits - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  // Every split's max and sum into shared memory (s_acc is free now; n_splits <= 512 keeps
  // 2 * HPB * n_splits within it). __ldcg reads L2: this SM's L1 holds nothing of other blocks.
  float* s_w = &s_acc[0][0][0];          // [HPB][n_splits]: max, then weight
  float* s_sum = s_w + HPB * n_splits;   // [HPB][n_splits]
  __shared__ float s_inv[HPB];
  const float* group_part = partials + (long long)(b * Hq + hq0) * n_splits * (D + 2);
  for (int e = tid; e < HPB * n_splits; e += NT) {
    s_w[e] = __ldcg(group_part + (long long)e * (D + 2) + D);
    s_sum[e] = __ldcg(group_part + (long long)e * (D + 2) + D + 1);
  }
  __syncthreads();
  // One warp per head: global max, each split's weight exp2(m_i - max), normalizer.
  for (int h = tid / 32; h < HPB; h += NT / 32) {
    const int lane = tid % 32;
    float global_max = -INFINITY;
    for (int i = lane; i < n_splits; i += 32) global_max = fmaxf(global_max, s_w[h * n_splits + i]);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      global_max = fmaxf(global_max, __shfl_xor_sync(0xffffffffu, global_max, offset));
    float sum = 0.f;
    for (int i = lane; i < n_splits; i += 32) {
      const float m_i = s_w[h * n_splits + i];
      const float w = m_i == -INFINITY ? 0.f : exp2f(m_i - global_max);  // empty chunks: 0
      s_w[h * n_splits + i] = w;
      sum += w * s_sum[h * n_splits + i];
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) s_inv[h] = sum > 0.f ? 1.f / sum : 0.f;  // a row that masks every key: 0
  }
  __syncthreads();
  for (int e = tid; e < HPB * D; e += NT) {
    const int h = e / D;
    const int d = e % D;
    const float* part = group_part + (long long)h * n_splits * (D + 2) + d;
    float out = 0.f;
#pragma unroll 8
    for (int i = 0; i < n_splits; ++i) out += s_w[h * n_splits + i] * __ldcg(part + i * (D + 2));
    o[(long long)(b * Hq + hq0 + h) * D + d] = static_cast<T>(out * s_inv[h]);
  }
"""


# The masked kernel's extra input: ``mask``, ``[B or 1, 1, 1, S]``, read through its strides;
# template MASK_KIND 1 for a boolean mask (false hides the key), 2 for an additive one (added to
# the score, so it is scaled to the scores' log2 units). Both branches compile for either type.
_MASK_ROW = r"""const long long mask_row = mask_shape[0] == 1 ? 0 : b * mask_strides[0];"""
_MASK_LOAD = r"""if (valid) {
        const auto mask_value = mask[mask_row + (long long)key * mask_strides[3]];
        if (MASK_KIND == 1) {
          valid = static_cast<bool>(mask_value);
        } else {
          bias = static_cast<float>(mask_value) * LOG2E;
        }
      }"""


@functools.cache
def _kernel(masked: bool = False) -> Any:
    """The fused kernel (with a mask input or without), built once; MLX compiles it once per
    template instantiation."""
    source = _SOURCE
    if masked:
        source = source.replace("/*MASK_ROW*/", _MASK_ROW).replace("/*MASK_LOAD*/", _MASK_LOAD)
    return mx.fast.cuda_kernel(
        name="mlxr_flash_decode_masked" if masked else "mlxr_flash_decode",
        input_names=["q", "k", "v", "mask"] if masked else ["q", "k", "v"],
        output_names=["o", "ws"],
        source=source,
        header=_HEADER,
        ensure_row_contiguous=False,
    )


_FLOAT_MX = (mx.float32, mx.float16, mx.bfloat16)


@attrs.frozen
class Layout:
    """The shape-only half of a plan (everything but the split count), computed once per model."""

    heads_per_block: int
    keys_per_step: int  # U: K/V rows per row group per step (and in flight for the next one)
    tile: int  # keys per block step
    blocks_per_split: int  # B * Hkv * head groups
    template: tuple[tuple[str, Any], ...]


@attrs.frozen
class DecodePlan:
    """How the fused kernel runs one call: its :class:`Layout` and how the sequence is split."""

    B: int
    Hq: int
    Hkv: int
    S: int
    D: int
    layout: Layout
    n_splits: int

    @property
    def heads_per_block(self) -> int:
        return self.layout.heads_per_block

    @property
    def groups(self) -> int:
        """Blocks sharing one KV head (more than one when the GQA ratio exceeds the block cap)."""
        return self.Hq // self.Hkv // self.layout.heads_per_block


def heads_per_block(ratio: int, dtype: mx.Dtype, cap: int = 8) -> int:
    """The largest divisor of the GQA ratio within ``cap`` and the register budget (at most 4
    heads in float32, whose K/V rows take twice the registers)."""
    cap = min(cap, 4) if dtype == mx.float32 else cap
    return max(h for h in range(1, min(ratio, cap) + 1) if ratio % h == 0)


@functools.lru_cache(maxsize=256)
def layout_for(
    B: int,
    Hq: int,
    Hkv: int,
    D: int,
    dtype: mx.Dtype,
    scale: float,
    max_heads_per_block: int,
    keys_per_step: int | None = None,
) -> Layout:
    """Block shape and template arguments for one model's decode shapes (cached: the per-token
    cost of the fused path is mostly this Python, since MLX runs the kernel asynchronously)."""
    hpb = heads_per_block(Hq // Hkv, dtype, max_heads_per_block)
    # Two buffers of U rows of K and V per thread: fewer in float32 or with many heads, to stay
    # within the registers (bench/kernels/compile_check.py shows no spills for these).
    if keys_per_step is None:
        keys_per_step = 2 if dtype == mx.float32 or hpb > 4 else 4
    template = (
        ("T", dtype),
        ("D", D),
        ("HPB", hpb),
        ("NT", THREADS),
        ("U", keys_per_step),
        ("SCALE_BITS", _float_bits(scale)),
    )
    return Layout(
        heads_per_block=hpb,
        keys_per_step=keys_per_step,
        tile=THREADS // (D // 8) * keys_per_step,
        blocks_per_split=B * Hkv * (Hq // Hkv // hpb),
        template=template,
    )


def decode_plan(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: str | mx.array | None,
    target_blocks: int = TARGET_BLOCKS,
    max_heads_per_block: int = 8,
    keys_per_step: int | None = None,
) -> DecodePlan | str:
    """The fused-kernel plan for these arrays, or why they go to ``mx.fast`` instead.

    ``target_blocks`` and ``keys_per_step`` override the tuned defaults (for benchmarks).
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return "inputs are not [B, H, L, D]"
    B, Hq, L, D = q.shape
    _, Hkv, S, _ = k.shape
    if L != 1:
        return f"{L} query positions (the fused kernel is for decode, L == 1)"
    if isinstance(mask, mx.array):
        reason = _mask_reason(mask, B, S)
        if reason is not None:
            return reason
    elif mask is not None and mask != "causal":
        return f"mask {mask!r} (fused: none, causal or an array)"
    if not q.dtype == k.dtype == v.dtype or q.dtype not in _FLOAT_MX:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (fused: one of {', '.join(FLOAT_DTYPES)})"
    if D not in FUSED_HEAD_DIMS or k.shape[3] != D or v.shape[3] != D:
        return f"head dim {D} (fused: {', '.join(map(str, FUSED_HEAD_DIMS))}, same for q, k, v)"
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or Hkv == 0 or Hq % Hkv:
        return f"shapes q{q.shape} k{k.shape} v{v.shape} are not a GQA layout"
    if S == 0:
        return "an empty KV sequence"
    if not (scale > 0 and math.isfinite(scale)):
        return f"scale {scale} (fused: positive and finite)"
    layout = layout_for(B, Hq, Hkv, D, q.dtype, scale, max_heads_per_block, keys_per_step)
    # Enough splits to give the GPU about target_blocks blocks (the nearest count: a batch of 32
    # rows with 8 KV heads has 256 groups, and runs unsplit in one launch), each at least one
    # tile of keys.
    wanted = max(1, (target_blocks + layout.blocks_per_split // 2) // layout.blocks_per_split)
    n_splits = min(-(-S // layout.tile), wanted, MAX_SPLITS)
    return DecodePlan(B, Hq, Hkv, S, D, layout, n_splits)


def _mask_reason(mask: mx.array, B: int, S: int) -> str | None:
    """Why the fused kernel cannot apply ``mask`` for ``B`` rows of ``S`` keys, or None."""
    if mask.dtype != mx.bool_ and mask.dtype not in _FLOAT_MX:
        return f"a mask of dtype {str(mask.dtype).rsplit('.', 1)[-1]} (fused: bool or floating point)"
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    if len(shape) != 4 or shape[1:3] != (1, 1) or shape[0] not in (1, B) or shape[3] != S:
        return f"a mask of shape {tuple(mask.shape)} (fused: [{B} or 1, 1, 1, {S}])"
    return None


def _float_bits(value: float) -> int:
    bits: int = struct.unpack("<i", struct.pack("<f", value))[0]
    return bits


def flash_decode(
    q: mx.array, k: mx.array, v: mx.array, *, plan: DecodePlan, mask: mx.array | None = None
) -> mx.array:
    """Run the fused kernel for ``plan`` (from :func:`decode_plan` on the same arrays and mask;
    a string mask is no mask here: ``"causal"`` hides nothing from the last position)."""
    B, Hq, D, n_splits = plan.B, plan.Hq, plan.D, plan.n_splits
    blocks_per_split = plan.layout.blocks_per_split
    inputs, template = [q, k, v], list(plan.layout.template)
    if mask is not None:
        if mask.ndim < 4:
            mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        inputs.append(mask)
        template.append(("MASK_KIND", 1 if mask.dtype == mx.bool_ else 2))
    if n_splits == 1:  # one block per group writes the output: no workspace to fill
        template.append(("SPLIT", 0))
        workspace, init = 1, None
    else:  # MLX zero-fills both outputs (init_value): the arrival counters must start at 0
        template.append(("SPLIT", 1))
        workspace, init = B * Hq * n_splits * (D + 2) + blocks_per_split, 0.0
    out, _ = _kernel(mask is not None)(
        inputs=inputs,
        template=template,
        grid=(n_splits * THREADS, blocks_per_split, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, Hq, 1, D), (workspace,)],
        output_dtypes=[q.dtype, mx.float32],
        init_value=init,
    )
    return out


def fused_attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: str | mx.array | None = None
) -> mx.array:
    """The fused kernel whenever :func:`decode_plan` allows it, else ``mx.fast``: for benchmarks
    and tests of the kernel itself (the backend's op is :func:`attention`)."""
    plan = decode_plan(q, k, v, scale=scale, mask=mask)
    if isinstance(plan, str):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return flash_decode(q, k, v, plan=plan, mask=mask if isinstance(mask, mx.array) else None)


def attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: str | mx.array | None = None
) -> mx.array:
    """The fused kernel for one query position under an array mask, ``mx.fast`` for the rest.

    Unmasked decode stays with ``mx.fast``, whose vector and cuDNN kernels are as fast at short
    contexts and faster at long ones, for a fraction of the host time per call (module docstring).
    """
    if isinstance(mask, mx.array):
        return fused_attention(q, k, v, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _attention_support(ctx: KernelContext) -> list[str]:
    reasons = device_reasons(ctx, "cuda")
    unknown = [kind for kind in ctx.shapes.get("masks", ()) if kind not in ("causal", "array")]
    if unknown:
        reasons.append(f"mask kinds {', '.join(map(str, unknown))} are not supported (causal, array)")
    if ctx.shapes.get("sinks"):
        reasons.append("attention sinks (one learned logit per head) are not supported")
    return reasons


attention_kernel = KernelImpl(
    attention,
    _attention_support,
    summary=(
        "fused flash-decoding for decode under an array mask (L=1, head dim 64/128/256: a batch "
        "of rows of different lengths, a sliding window); the rest runs mx.fast"
    ),
)
