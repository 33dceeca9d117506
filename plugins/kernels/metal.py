"""``metal``: fused flash-decoding attention and a fused RMS norm through ``mx.fast.metal_kernel``.

The Metal twin of :mod:`mlxr_plugins.kernels.cuda`: the same algorithm, block for block, so a
review can read them side by side (CUDA block = Metal threadgroup, warp = SIMD-group, shuffle =
``simd_shuffle_xor``, ``__shared__`` = ``threadgroup``):

1. ``mlxr_flash_decode``: one threadgroup per (batch row, KV head, query-head group, chunk of the
   KV sequence); the GQA query heads of one KV head share the threadgroup so K/V are read once;
   ``D / 8`` threads per K/V row, 8 features each (16-byte loads), the next tile's rows requested
   before the current one is computed; SIMD shuffles finish the dot products; online softmax in
   float32 (base 2); row groups merged in threadgroup memory; one unnormalized partial (output,
   max, sum) per query head and chunk.
2. ``mlxr_flash_decode_reduce``: merges the chunks of each (batch row, query head). This is the
   one structural difference from the CUDA twin, which merges in the last block to finish (an
   atomic counter and ``__threadfence``): Metal offers no device-scope release/acquire fence that
   makes that pattern safe, and a second dispatch in the same command buffer is cheap there.

Plus ``mlxr_rms_norm``: one threadgroup per row, a SIMD-group then threadgroup sum of squares in
float32, and the scaled, weighted row written in one pass (mx.fast's own Metal rms_norm is fused
too; this one exists as the Metal counterpart of the reference and to share the build pattern).

Prefill, array masks and head dims other than 64/128/256 are delegated to ``mx.fast``, as in the
CUDA twin. These kernels only run on Apple Silicon: here ``supports()`` says so and their tests
skip with that reason.

And ``mlxr_gated_delta``, the gated delta rule (``gated_delta`` op): the twin of
:mod:`mlxr_plugins.kernels.cuda_delta`, line for line (one threadgroup per (batch row, value
head), the state in registers through every position, ``simd_shuffle_xor`` for the per-column
sums), for the same head dims; other shapes run the chunked ``mlx_fast`` form. UNTESTED: written
without an Apple GPU, it has never been compiled or run (the CUDA twin passes its parity tests on
an H100); its parity test skips without Metal. One thing to check first on a Mac: a pipeline's
``maxTotalThreadsPerThreadgroup`` may be below the ``Dv * Dk / 32`` threads it asks for (up to 512;
512 for 128 x 128) when the 32 state registers per thread press on the register file.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import KernelImpl, device_reasons
from mlxr_plugins.kernels.cuda import (
    THREADS,
    DecodePlan,
    _float_bits,
    decode_plan,
)
from mlxr_plugins.kernels.cuda_delta import call_reason, context_reasons, launch
from mlxr_plugins.kernels.delta_rule import gated_delta as chunked_gated_delta

#: Query heads per threadgroup: the merge buffer (THREADS * 8 * heads floats) must fit in Apple
#: GPUs' 32 KB of threadgroup memory.
MAX_HEADS_PER_BLOCK = 4
#: Threads per threadgroup of the RMS norm kernel.
NORM_THREADS = 256

_HEADER = r"""
// 8 consecutive features of one row, kept raw (as stored) in P = 8 * sizeof(T) / 16 registers of
// 16 bytes: 16-byte loads when the caller has checked that the feature stride is 1 and rows are
// 16-byte aligned, else 8 strided scalar loads packed the same way.
template <typename T, int P>
inline void load_raw(const device T* p, bool vec, int64_t step, thread uint4* raw) {
  if (vec) {
    for (int j = 0; j < P; ++j) raw[j] = reinterpret_cast<const device uint4*>(p)[j];
  } else {
    thread T* e = reinterpret_cast<thread T*>(raw);
    for (int i = 0; i < 8; ++i) e[i] = p[i * step];
  }
}

template <typename T, int P>
inline void to_float(const thread uint4* raw, thread float* out) {
  const thread T* e = reinterpret_cast<const thread T*>(raw);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(e[i]);
}

// Whether the rows of a [B, H, S, D] array can be read with 16-byte loads: unit feature stride
// and 16-byte multiples for the batch/head (and, with check_rows, row) strides. Unlike the CUDA
// twin it cannot test the start address (MSL has no pointer-to-integer cast); MLX buffers are
// page aligned and the views attention gets (slices along B, H or S) keep 16-byte row starts.
template <typename T, typename St>
inline bool vectorizable(const device T*, St st, bool check_rows) {
  const int64_t bytes = sizeof(T);
  return st[3] == 1 && (int64_t(st[0]) * bytes) % 16 == 0 && (int64_t(st[1]) * bytes) % 16 == 0 &&
      (!check_rows || (int64_t(st[2]) * bytes) % 16 == 0);
}
"""

# Template and layout as in the CUDA twin: T, D, HPB, NT, U, SCALE_BITS; HPB is capped at 4 here
# (threadgroup memory is 32 KB on Apple GPUs; s_acc takes NT * 8 * HPB floats). Output: ws, the
# partials [B * Hq, n_splits, D + 2] (unnormalized output, max, sum) that the reduce kernel merges.
_SPLIT_SOURCE = r"""
  constexpr int EPT = 8;                    // features per thread
  constexpr int P = EPT * sizeof(T) / 16;   // 16-byte registers per row slice: 1, or 2 in float32
  constexpr int TPR = D / EPT;              // threads per K/V row: 8, 16 or 32, in one SIMD-group
  constexpr int RG = NT / TPR;              // row groups: K/V rows read side by side
  constexpr int TILE = RG * U;              // keys per threadgroup step
  constexpr float LOG2E = 1.4426950408889634f;

  const int Hq = q_shape[1];
  const int Hkv = k_shape[1];
  const int S = k_shape[2];
  const int R = Hq / Hkv;
  const int groups = R / HPB;
  const int n_splits = threadgroups_per_grid.x;
  const int split = threadgroup_position_in_grid.x;
  const int group = threadgroup_position_in_grid.y;  // (batch row, KV head, head group)
  const int g = group % groups;
  const int hkv = (group / groups) % Hkv;
  const int b = group / (groups * Hkv);
  const int hq0 = hkv * R + g * HPB;

  const int tid = thread_index_in_threadgroup;
  const int rg = tid / TPR;
  const int d0 = (tid % TPR) * EPT;

  // Chunks are whole tiles; trailing threadgroups may get an empty chunk.
  const int per_split = (S + n_splits - 1) / n_splits;
  const int chunk = (per_split + TILE - 1) / TILE * TILE;
  const int start = split * chunk;
  const int stop = min(start + chunk, S);

  const bool vec = vectorizable(k, k_strides, true) && vectorizable(v, v_strides, true);
  const bool q_vec = vectorizable(q, q_strides, false);
  const int64_t k_row = k_strides[2], v_row = v_strides[2];
  const device T* k_base =
      k + b * int64_t(k_strides[0]) + hkv * int64_t(k_strides[1]) + d0 * int64_t(k_strides[3]);
  const device T* v_base =
      v + b * int64_t(v_strides[0]) + hkv * int64_t(v_strides[1]) + d0 * int64_t(v_strides[3]);

  // The queries of this threadgroup's heads, pre-scaled so scores come out in log2 units.
  const float q_scale = as_type<float>(SCALE_BITS) * LOG2E;
  float qr[HPB][EPT];
  for (int h = 0; h < HPB; ++h) {
    uint4 raw[P];
    load_raw<T, P>(q + b * int64_t(q_strides[0]) + (hq0 + h) * int64_t(q_strides[1]) +
                       d0 * int64_t(q_strides[3]),
                   q_vec, q_strides[3], raw);
    to_float<T, P>(raw, qr[h]);
    for (int i = 0; i < EPT; ++i) qr[h][i] *= q_scale;
  }

  // Online softmax state of this thread's row group, per head.
  float m[HPB], l[HPB], acc[HPB][EPT];
  for (int h = 0; h < HPB; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
    for (int i = 0; i < EPT; ++i) acc[h][i] = 0.f;
  }

  // Software pipeline: the next tile's K/V rows are requested before the current tile is
  // computed, so loads stay in flight through the shuffles and exponentials.
  // Rows past the chunk are zeros, not stale registers: their weight is 0, and 0 * NaN is NaN.
  uint4 k_next[U][P], v_next[U][P];
  for (int u = 0; u < U; ++u) {
    const int s = start + u * RG + rg;
    if (s < stop) {
      load_raw<T, P>(k_base + s * k_row, vec, k_strides[3], k_next[u]);
      load_raw<T, P>(v_base + s * v_row, vec, v_strides[3], v_next[u]);
    } else {
      for (int j = 0; j < P; ++j) k_next[u][j] = v_next[u][j] = uint4(0);
    }
  }
  for (int s0 = start; s0 < stop; s0 += TILE) {
    uint4 k_tile[U][P], v_tile[U][P];
    for (int u = 0; u < U; ++u) {
      for (int j = 0; j < P; ++j) {
        k_tile[u][j] = k_next[u][j];
        v_tile[u][j] = v_next[u][j];
      }
    }
    for (int u = 0; u < U; ++u) {
      const int s = s0 + TILE + u * RG + rg;
      if (s < stop) {
        load_raw<T, P>(k_base + s * k_row, vec, k_strides[3], k_next[u]);
        load_raw<T, P>(v_base + s * v_row, vec, v_strides[3], v_next[u]);
      } else {
        for (int j = 0; j < P; ++j) k_next[u][j] = v_next[u][j] = uint4(0);
      }
    }

    float score[HPB][U];
    for (int u = 0; u < U; ++u) {
      float kf[EPT];
      to_float<T, P>(k_tile[u], kf);
      const bool valid = s0 + u * RG + rg < stop;
      for (int h = 0; h < HPB; ++h) {
        float dot = 0.f;
        for (int i = 0; i < EPT; ++i) dot += qr[h][i] * kf[i];
        // Every lane of the row group ends with the full dot product (the loop bounds are
        // uniform over the threadgroup, so the whole SIMD-group takes part).
        for (ushort offset = TPR / 2; offset > 0; offset >>= 1)
          dot += simd_shuffle_xor(dot, offset);
        score[h][u] = valid ? dot : -INFINITY;
      }
    }
    // One rescale per tile rather than per key.
    float p[HPB][U];
    for (int h = 0; h < HPB; ++h) {
      float tile_max = score[h][0];
      for (int u = 1; u < U; ++u) tile_max = max(tile_max, score[h][u]);
      const float m_new = max(m[h], tile_max);
      // m_new is -inf only while this row group has seen no key: then nothing changes.
      const float correction = m_new == -INFINITY ? 1.f : exp2(m[h] - m_new);
      l[h] *= correction;
      for (int i = 0; i < EPT; ++i) acc[h][i] *= correction;
      for (int u = 0; u < U; ++u) {
        p[h][u] = m_new == -INFINITY ? 0.f : exp2(score[h][u] - m_new);  // 0 past the chunk
        l[h] += p[h][u];
      }
      m[h] = m_new;
    }
    for (int u = 0; u < U; ++u) {
      float vf[EPT];
      to_float<T, P>(v_tile[u], vf);
      for (int h = 0; h < HPB; ++h) {
        for (int i = 0; i < EPT; ++i) acc[h][i] += p[h][u] * vf[i];
      }
    }
  }

  // Merge the row groups of the threadgroup: rescale each to the threadgroup's max per head.
  threadgroup float s_m[RG][HPB];
  threadgroup float s_l[RG][HPB];
  threadgroup float s_acc[RG][HPB][D];
  if (tid % TPR == 0) {
    for (int h = 0; h < HPB; ++h) {
      s_m[rg][h] = m[h];
      s_l[rg][h] = l[h];
    }
  }
  for (int h = 0; h < HPB; ++h) {
    for (int i = 0; i < EPT; ++i) s_acc[rg][h][d0 + i] = acc[h][i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = tid; e < HPB * D; e += NT) {
    const int h = e / D;
    const int d = e % D;
    float block_max = -INFINITY;
    for (int r = 0; r < RG; ++r) block_max = max(block_max, s_m[r][h]);
    float sum = 0.f, out = 0.f;
    if (block_max != -INFINITY) {
      for (int r = 0; r < RG; ++r) {
        const float w = exp2(s_m[r][h] - block_max);
        sum += w * s_l[r][h];
        out += w * s_acc[r][h][d];
      }
    }
    device float* part = ws + (int64_t(b * Hq + hq0 + h) * n_splits + split) * (D + 2);
    part[d] = out;
    if (d == 0) {
      part[D] = block_max;
      part[D + 1] = sum;
    }
  }
"""

# The CUDA twin's last-block merge as its own launch: Metal has no device-scope release/acquire
# fence to make the last-threadgroup pattern safe. Template: T, D; one threadgroup of D threads
# per (batch row, query head); ws as the split kernel wrote it, shape [B * Hq, n_splits, D + 2].
_REDUCE_SOURCE = r"""
  const int n_splits = ws_shape[1];
  const int64_t row = threadgroup_position_in_grid.x;
  const int d = thread_index_in_threadgroup;
  const device float* part = ws + row * n_splits * (D + 2);
  float global_max = -INFINITY;
  for (int i = 0; i < n_splits; ++i) global_max = max(global_max, part[i * (D + 2) + D]);
  float sum = 0.f, out = 0.f;
  for (int i = 0; i < n_splits; ++i) {
    const float m_i = part[i * (D + 2) + D];
    if (m_i == -INFINITY) continue;  // an empty chunk
    const float w = exp2(m_i - global_max);
    sum += w * part[i * (D + 2) + D + 1];
    out += w * part[i * (D + 2) + d];
  }
  o[row * D + d] = static_cast<T>(out / sum);
"""

# Template: T, NT (threads), EPS_BITS (eps as float32 bits). x is row-contiguous [rows, N].
_RMS_NORM_SOURCE = r"""
  const int N = w_shape[0];
  const int64_t row = threadgroup_position_in_grid.x;
  const int tid = thread_index_in_threadgroup;
  const device T* xr = x + row * N;
  float squares = 0.f;
  for (int i = tid; i < N; i += NT) {
    const float xi = static_cast<float>(xr[i]);
    squares += xi * xi;
  }
  // SIMD-group sums, then one partial per SIMD-group through threadgroup memory.
  threadgroup float partial[NT / 32];
  squares = simd_sum(squares);
  if (thread_index_in_simdgroup == 0) partial[simdgroup_index_in_threadgroup] = squares;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.f;
  for (int i = 0; i < NT / 32; ++i) total += partial[i];
  const float inv = metal::precise::rsqrt(total / N + as_type<float>(EPS_BITS));
  device T* yr = y + row * N;
  for (int i = tid; i < N; i += NT) {
    // Rounded to T before the weight, as the reference does.
    yr[i] = w[i] * static_cast<T>(static_cast<float>(xr[i]) * inv);
  }
"""

# The CUDA twin's mlxr_gated_delta (cuda_delta.py; same template, layout and comments): T, DK, DV,
# ROWS; q, k [B, L, Hk, DK]; v [B, L, Hv, DV]; g, beta [B, L, Hv] float32; s0 [B, Hv, DK, DV]
# float32. Outputs: y [B, L, Hv, DV] in T, s [B, Hv, DK, DV] float32. One threadgroup of DV * P
# threads per (batch row, value head).
_GATED_DELTA_SOURCE = r"""
  constexpr int P = DK / ROWS;
  const int L = v_shape[1];
  const int Hv = v_shape[2];
  const int Hk = k_shape[2];
  const int bh = threadgroup_position_in_grid.x;
  const int b = bh / Hv;
  const int h = bh % Hv;
  const int hk = h / (Hv / Hk);
  const int tid = thread_index_in_threadgroup;
  const int dv = tid / P;
  const int p = tid % P;

  float st[ROWS];
  const device float* s_in = s0 + int64_t(bh) * DK * DV + dv;
  for (int i = 0; i < ROWS; ++i) st[i] = s_in[int64_t(i * P + p) * DV];

  threadgroup float sk[2][DK];
  threadgroup float sq[2][DK];
  for (int t = 0; t < L; ++t) {
    const int buf = t & 1;
    const int64_t qk_row = ((int64_t(b) * L + t) * Hk + hk) * DK;
    for (int i = tid; i < DK; i += DV * P) {
      sk[buf][i] = static_cast<float>(k[qk_row + i]);
      sq[buf][i] = static_cast<float>(q[qk_row + i]);
    }
    const int64_t gh = (int64_t(b) * L + t) * Hv + h;
    const float decay = metal::precise::exp(g[gh]);
    const float rate = beta[gh];
    const float v_t = static_cast<float>(v[gh * DV + dv]);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    float recalled = 0.f;
    for (int i = 0; i < ROWS; ++i) {
      st[i] *= decay;
      recalled += st[i] * sk[buf][i * P + p];
    }
    for (ushort offset = P / 2; offset > 0; offset >>= 1)
      recalled += simd_shuffle_xor(recalled, offset);
    const float delta = rate * (v_t - recalled);
    float o = 0.f;
    for (int i = 0; i < ROWS; ++i) {
      st[i] += sk[buf][i * P + p] * delta;
      o += st[i] * sq[buf][i * P + p];
    }
    for (ushort offset = P / 2; offset > 0; offset >>= 1) o += simd_shuffle_xor(o, offset);
    if (p == 0) y[gh * DV + dv] = static_cast<T>(o);
  }
  device float* s_out = s + int64_t(bh) * DK * DV + dv;
  for (int i = 0; i < ROWS; ++i) s_out[int64_t(i * P + p) * DV] = st[i];
"""


@functools.cache
def _split_kernel() -> Any:
    """The split kernel, built once; MLX compiles it once per template instantiation."""
    return mx.fast.metal_kernel(
        name="mlxr_flash_decode",
        input_names=["q", "k", "v"],
        output_names=["ws"],
        source=_SPLIT_SOURCE,
        header=_HEADER,
        ensure_row_contiguous=False,
    )


@functools.cache
def _reduce_kernel() -> Any:
    return mx.fast.metal_kernel(
        name="mlxr_flash_decode_reduce",
        input_names=["ws"],
        output_names=["o"],
        source=_REDUCE_SOURCE,
        ensure_row_contiguous=True,
    )


@functools.cache
def _rms_norm_kernel() -> Any:
    return mx.fast.metal_kernel(
        name="mlxr_rms_norm",
        input_names=["x", "w"],
        output_names=["y"],
        source=_RMS_NORM_SOURCE,
        ensure_row_contiguous=True,
    )


@functools.cache
def _gated_delta_kernel() -> Any:
    return mx.fast.metal_kernel(
        name="mlxr_gated_delta",
        input_names=["q", "k", "v", "g", "beta", "s0"],
        output_names=["y", "s"],
        source=_GATED_DELTA_SOURCE,
        ensure_row_contiguous=True,
    )


def flash_decode(q: mx.array, k: mx.array, v: mx.array, *, plan: DecodePlan) -> mx.array:
    """Run the split and reduce kernels for ``plan`` (the CUDA twin's :func:`decode_plan`)."""
    B, Hq, D, n_splits = plan.B, plan.Hq, plan.D, plan.n_splits
    (ws,) = _split_kernel()(
        inputs=[q, k, v],
        template=list(plan.layout.template),
        grid=(n_splits * THREADS, plan.layout.blocks_per_split, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B * Hq, n_splits, D + 2)],
        output_dtypes=[mx.float32],
    )
    (out,) = _reduce_kernel()(
        inputs=[ws],
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
    plan = decode_plan(q, k, v, scale=scale, mask=mask, max_heads_per_block=MAX_HEADS_PER_BLOCK)
    if isinstance(plan, str):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return flash_decode(q, k, v, plan=plan)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """Fused RMS norm over the last axis; mixed dtypes go to ``mx.fast.rms_norm``."""
    N = x.shape[-1]
    if x.dtype != weight.dtype or weight.shape != (N,) or x.size == 0 or not eps > 0:
        return mx.fast.rms_norm(x, weight, eps)
    rows = x.size // N
    (y,) = _rms_norm_kernel()(
        inputs=[x.reshape(rows, N), weight],
        template=[("T", x.dtype), ("NT", NORM_THREADS), ("EPS_BITS", _float_bits(eps))],
        grid=(rows * NORM_THREADS, 1, 1),
        threadgroup=(NORM_THREADS, 1, 1),
        output_shapes=[(rows, N)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(x.shape)


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """The fused recurrence (untested, see the module docstring) for the shapes the CUDA twin
    takes, else the chunked ``mlx_fast`` form."""
    if call_reason(q, k, v) is not None:
        return chunked_gated_delta(q, k, v, g, beta, state)
    return launch(_gated_delta_kernel(), q, k, v, g, beta, state)


def _metal_support(ctx: KernelContext) -> list[str]:
    reasons = device_reasons(ctx, "metal")
    return reasons


def _gated_delta_support(ctx: KernelContext) -> list[str]:
    return context_reasons(ctx, "metal")


def _attention_support(ctx: KernelContext) -> list[str]:
    reasons = _metal_support(ctx)
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
        "fused flash-decoding for decode (L=1, head dim 64/128/256, no mask or causal); "
        "prefill and other shapes run mx.fast"
    ),
)
rms_norm_kernel = KernelImpl(rms_norm, _metal_support, summary="fused one-pass RMS norm")
gated_delta_kernel = KernelImpl(
    gated_delta,
    _gated_delta_support,
    summary=(
        "UNTESTED (written without an Apple GPU): the CUDA twin's one threadgroup per "
        "(batch row, value head), the state in registers"
    ),
)
