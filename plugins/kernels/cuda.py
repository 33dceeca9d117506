"""``cuda``: fused flash-decoding attention through ``mx.fast.cuda_kernel`` (MLX's CUDA backend).

One decode step reads the whole KV cache for ~2 FLOPs per byte, so decode attention is bound by
memory bandwidth, and only a kernel that keeps every SM streaming K and V gets near it. The fused
path here (one query position, ``L == 1``):

1. ``mlxr_flash_decode``: the KV sequence is split into chunks, one thread block per
   (batch row, KV head, query-head group, chunk) so even B=1 with 8 KV heads fills the GPU. The
   query heads that share a KV head (GQA) are handled by the same block, so each K/V row is read
   once for all of them. A K/V row is read by ``D / 8`` threads, 8 features each (16-byte loads);
   the dot product is finished with warp shuffles and folded into an online softmax (running max
   and sum in float32, base-2 exponent). The block merges its row groups in shared memory and
   writes one unnormalized partial output, max and sum per query head and chunk.
2. ``mlxr_flash_decode_reduce``: one block per (batch row, query head) rescales the chunks'
   partials to a common max and normalizes.

K and V are read in place through their strides (``ensure_row_contiguous=False``): the KV cache
hands attention ``keys[..., :offset, :]``, a view of a larger pre-allocated buffer, and a
row-contiguous copy of it would cost as much traffic as the attention itself. Rows that are not
16-byte aligned with a unit feature stride fall back to scalar loads (same result, slower).

Everything else (prefill ``L > 1``, array masks, head dims other than 64/128/256, mixed dtypes) is
delegated to ``mx.fast.scaled_dot_product_attention``. The backend therefore speaks for the
attention op as a whole: a model binds one callable per op and must prefill through it too, so a
decode-only backend could never be chosen with ``kernels: {attention: cuda}``. :func:`decode_plan`
says for given arrays whether the fused path runs, or why not.
"""

from __future__ import annotations

import functools
import math
import platform
import struct
from typing import Any

import attrs
import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import KernelImpl

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
#: Head dims with a fused path: ``D / 8`` threads per row must be a power of two within a warp.
FUSED_HEAD_DIMS = (64, 128, 256)
#: Threads per block of the split kernel.
THREADS = 128
#: Aim for about this many blocks per launch (a few waves over an H100/H200's 132 SMs): fewer
#: leave SMs idle at B=1, many more only add partial outputs to merge.
TARGET_BLOCKS = 528


# Shared by both kernels: 8 consecutive features of a row as float32.
_HEADER = r"""
#ifndef INFINITY  // NVRTC does not always see math.h
#define INFINITY __int_as_float(0x7f800000)
#endif

// 8 consecutive features of one row as float32: 16-byte loads when the caller has checked that
// the feature stride is 1 and rows are 16-byte aligned, else 8 strided scalar loads.
template <typename T>
__device__ __forceinline__ void load8(const T* p, bool vec, long long step, float* out) {
  if (vec) {
    constexpr int PER = 16 / sizeof(T);
#pragma unroll
    for (int j = 0; j < 8; j += PER) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p + j);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < PER; ++i) out[j + i] = static_cast<float>(e[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(p[i * step]);
  }
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

# Template: T (dtype), D (head dim), HPB (query heads per block), NT (threads), U (keys per row
# group per step), SCALE_BITS (the softmax scale's float32 bits: a float cannot be a template
# argument, and a model's scale never changes, so this costs one compilation per model).
_SPLIT_SOURCE = r"""
  constexpr int EPT = 8;              // features per thread
  constexpr int TPR = D / EPT;        // threads per K/V row: 8, 16 or 32, within one warp
  constexpr int RG = NT / TPR;        // row groups: K/V rows read side by side
  constexpr int TILE = RG * U;        // keys per block step
  constexpr float LOG2E = 1.4426950408889634f;

  const int Hq = q_shape[1];
  const int Hkv = k_shape[1];
  const int S = k_shape[2];
  const int R = Hq / Hkv;
  const int groups = R / HPB;
  const int n_splits = gridDim.x;
  const int split = blockIdx.x;
  const int g = blockIdx.y % groups;
  const int hkv = (blockIdx.y / groups) % Hkv;
  const int b = blockIdx.y / (groups * Hkv);
  const int hq0 = hkv * R + g * HPB;

  const int tid = threadIdx.x;
  const int rg = tid / TPR;
  const int d0 = (tid % TPR) * EPT;

  // Chunks are whole tiles; trailing blocks may get an empty chunk and write an empty partial.
  const int per_split = (S + n_splits - 1) / n_splits;
  const int chunk = (per_split + TILE - 1) / TILE * TILE;
  const int start = split * chunk;
  const int stop = min(start + chunk, S);

  // Uniform over the grid, so the branch in load8 costs nothing. q has one position: its row
  // stride does not matter.
  const bool vec = vectorizable(k, k_strides, true) && vectorizable(v, v_strides, true);
  const bool q_vec = vectorizable(q, q_strides, false);
  const long long k_row = k_strides[2], v_row = v_strides[2];
  const T* k_base = k + b * k_strides[0] + hkv * k_strides[1] + d0 * k_strides[3];
  const T* v_base = v + b * v_strides[0] + hkv * v_strides[1] + d0 * v_strides[3];

  // The queries of this block's heads, pre-scaled so scores come out in log2 units.
  const float q_scale = __int_as_float(SCALE_BITS) * LOG2E;
  float qr[HPB][EPT];
#pragma unroll
  for (int h = 0; h < HPB; ++h) {
    load8(q + b * q_strides[0] + (hq0 + h) * q_strides[1] + d0 * q_strides[3], q_vec,
          q_strides[3], qr[h]);
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

  for (int s0 = start; s0 < stop; s0 += TILE) {
    // All U rows of K and V are requested before any is used: that is what keeps enough bytes
    // in flight to approach the memory bandwidth.
    float kf[U][EPT], vf[U][EPT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u * RG + rg;
      if (s < stop) {
        load8(k_base + s * k_row, vec, k_strides[3], kf[u]);
        load8(v_base + s * v_row, vec, v_strides[3], vf[u]);
      } else {
#pragma unroll
        for (int i = 0; i < EPT; ++i) kf[u][i] = vf[u][i] = 0.f;
      }
    }
    float score[HPB][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool valid = s0 + u * RG + rg < stop;
#pragma unroll
      for (int h = 0; h < HPB; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < EPT; ++i) dot += qr[h][i] * kf[u][i];
        // Every lane of the row group ends with the full dot product (the whole warp takes
        // part: the loop bounds are uniform over the block).
#pragma unroll
        for (int offset = TPR / 2; offset > 0; offset >>= 1)
          dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        score[h][u] = valid ? dot : -INFINITY;
      }
    }
    // One rescale per tile rather than per key.
#pragma unroll
    for (int h = 0; h < HPB; ++h) {
      float tile_max = score[h][0];
#pragma unroll
      for (int u = 1; u < U; ++u) tile_max = fmaxf(tile_max, score[h][u]);
      const float m_new = fmaxf(m[h], tile_max);
      if (m_new == -INFINITY) continue;  // no key of this row group yet
      const float correction = exp2f(m[h] - m_new);  // 0 while m[h] is still -inf
      l[h] *= correction;
#pragma unroll
      for (int i = 0; i < EPT; ++i) acc[h][i] *= correction;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = exp2f(score[h][u] - m_new);  // 0 for keys past the chunk
        l[h] += p;
#pragma unroll
        for (int i = 0; i < EPT; ++i) acc[h][i] += p * vf[u][i];
      }
      m[h] = m_new;
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
    const long long row = (long long)(b * Hq + hq0 + h) * n_splits + split;
    o_part[row * D + d] = out;
    if (d == 0) {
      ml[row * 2] = block_max;
      ml[row * 2 + 1] = sum;
    }
  }
"""

# Template: T (output dtype), D. One block of D threads per (batch row, query head).
_REDUCE_SOURCE = r"""
  const int n_splits = ml_shape[2];
  const long long row = blockIdx.x;
  const int d = threadIdx.x;
  const float* row_ml = ml + row * n_splits * 2;
  float global_max = -INFINITY;
  for (int i = 0; i < n_splits; ++i) global_max = fmaxf(global_max, row_ml[2 * i]);
  float sum = 0.f, out = 0.f;
  for (int i = 0; i < n_splits; ++i) {
    const float m_i = row_ml[2 * i];
    if (m_i == -INFINITY) continue;  // an empty chunk
    const float w = exp2f(m_i - global_max);
    sum += w * row_ml[2 * i + 1];
    out += w * o_part[(row * n_splits + i) * D + d];
  }
  o[row * D + d] = static_cast<T>(out / sum);
"""


@functools.cache
def _split_kernel() -> Any:
    """The split kernel, built once; MLX compiles it once per template instantiation."""
    return mx.fast.cuda_kernel(
        name="mlxr_flash_decode",
        input_names=["q", "k", "v"],
        output_names=["o_part", "ml"],
        source=_SPLIT_SOURCE,
        header=_HEADER,
        ensure_row_contiguous=False,
    )


@functools.cache
def _reduce_kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="mlxr_flash_decode_reduce",
        input_names=["o_part", "ml"],
        output_names=["o"],
        source=_REDUCE_SOURCE,
        ensure_row_contiguous=True,
    )


@attrs.frozen
class DecodePlan:
    """How the fused path runs one call: block shape and how the sequence is split."""

    B: int
    Hq: int
    Hkv: int
    S: int
    D: int
    heads_per_block: int
    keys_per_step: int  # U: K/V rows each row group requests before using them
    n_splits: int

    @property
    def groups(self) -> int:
        """Blocks sharing one KV head (more than one only when a group exceeds the register cap)."""
        return self.Hq // self.Hkv // self.heads_per_block


def heads_per_block(ratio: int, dtype: mx.Dtype, cap: int = 8) -> int:
    """The largest divisor of the GQA ratio within ``cap`` and the register budget (at most 4
    heads in float32, whose K/V rows take twice the registers)."""
    cap = min(cap, 4) if dtype == mx.float32 else cap
    return max(h for h in range(1, min(ratio, cap) + 1) if ratio % h == 0)


def decode_plan(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: str | mx.array | None,
    target_blocks: int = TARGET_BLOCKS,
    max_heads_per_block: int = 8,
) -> DecodePlan | str:
    """The fused-kernel plan for these arrays, or why they go to ``mx.fast`` instead."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return "inputs are not [B, H, L, D]"
    B, Hq, L, D = q.shape
    _, Hkv, S, _ = k.shape
    if L != 1:
        return f"{L} query positions (the fused kernel is for decode, L == 1)"
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        return "an array mask (the fused kernel handles none or causal)"
    if not q.dtype == k.dtype == v.dtype or str(q.dtype).rpartition(".")[2] not in FLOAT_DTYPES:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (fused: one of {', '.join(FLOAT_DTYPES)})"
    if D not in FUSED_HEAD_DIMS or k.shape[3] != D or v.shape[3] != D:
        return f"head dim {D} (fused: {', '.join(map(str, FUSED_HEAD_DIMS))}, same for q, k, v)"
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or Hkv == 0 or Hq % Hkv:
        return f"shapes q{q.shape} k{k.shape} v{v.shape} are not a GQA layout"
    if S == 0:
        return "an empty KV sequence"
    if not (scale > 0 and math.isfinite(scale)):
        return f"scale {scale} (fused: positive and finite)"
    hpb = heads_per_block(Hq // Hkv, q.dtype, max_heads_per_block)
    keys_per_step = 4 if hpb <= 4 else 2
    tile = THREADS // (D // 8) * keys_per_step
    blocks = B * Hkv * (Hq // Hkv // hpb)
    n_splits = max(1, min(-(-S // tile), -(-target_blocks // blocks)))
    return DecodePlan(B, Hq, Hkv, S, D, hpb, keys_per_step, n_splits)


def _float_bits(value: float) -> int:
    bits: int = struct.unpack("<i", struct.pack("<f", value))[0]
    return bits


def flash_decode(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, plan: DecodePlan
) -> mx.array:
    """Run the two fused kernels for ``plan`` (from :func:`decode_plan` on the same arrays)."""
    B, Hq, D, n_splits = plan.B, plan.Hq, plan.D, plan.n_splits
    o_part, ml = _split_kernel()(
        inputs=[q, k, v],
        template=[
            ("T", q.dtype),
            ("D", D),
            ("HPB", plan.heads_per_block),
            ("NT", THREADS),
            ("U", plan.keys_per_step),
            ("SCALE_BITS", _float_bits(scale)),
        ],
        grid=(n_splits * THREADS, B * plan.Hkv * plan.groups, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, Hq, n_splits, D), (B, Hq, n_splits, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    (out,) = _reduce_kernel()(
        inputs=[o_part, ml],
        template=[("T", q.dtype), ("D", D)],
        grid=(B * Hq * D, 1, 1),
        threadgroup=(D, 1, 1),
        output_shapes=[(B, Hq, 1, D)],
        output_dtypes=[q.dtype],
    )
    return out


def attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: str | mx.array | None = None
) -> mx.array:
    """Fused flash-decoding for one query position, else ``mx.fast.scaled_dot_product_attention``."""
    plan = decode_plan(q, k, v, scale=scale, mask=mask)
    if isinstance(plan, str):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return flash_decode(q, k, v, scale=scale, plan=plan)


def machine() -> str:
    """This machine in a few words, for "cannot run here" reasons."""
    return f"{platform.system()} {platform.machine()}"


def _attention_support(ctx: KernelContext) -> list[str]:
    reasons = []
    if ctx.platform != "cuda":
        reasons.append(
            f"needs MLX's CUDA backend on an NVIDIA GPU (this machine: {machine()}, "
            f"MLX {ctx.device} device, {ctx.platform} platform)"
        )
    if ctx.dtype not in FLOAT_DTYPES:
        reasons.append(f"activation dtype {ctx.dtype} is not one of {', '.join(FLOAT_DTYPES)}")
    unknown = [kind for kind in ctx.shapes.get("masks", ()) if kind not in ("causal", "array")]
    if unknown:
        reasons.append(f"mask kinds {', '.join(map(str, unknown))} are not supported (causal, array)")
    return reasons


attention_kernel = KernelImpl(
    attention,
    _attention_support,
    summary=(
        "fused flash-decoding for decode (L=1, head dim 64/128/256, no mask or causal); "
        "prefill and other shapes run mx.fast"
    ),
)
