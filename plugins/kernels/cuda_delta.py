"""``cuda_delta``: the gated delta rule (Gated DeltaNet) in one kernel on MLX's CUDA backend.

``mlxr_gated_delta`` runs the whole recurrence of ``mlxr_core.kernels``' ``gated_delta`` in one
launch: one thread block per (batch row, value head) walks the positions in order, its ``Dk x Dv``
float32 state held in registers from the first position to the last. Thread ``(dv, p)`` of the
block owns column ``dv`` of the state, rows ``p, p + P, p + 2P, ...`` (:data:`ROWS` of them, ``P =
Dk / ROWS`` threads per column, neighbouring lanes of one warp). Per position the block stages
``q_t`` and ``k_t`` in shared memory (double-buffered: one barrier per position) and each thread
decays its entries, sums its share of ``S^T k`` (finished with ``P``-lane shuffles), applies the
delta update and sums its share of ``S^T q``; lane ``p = 0`` writes ``out_t[dv]``. Nothing but
``q``, ``k``, ``v``, ``g``, ``beta`` and the output goes through memory inside the loop, and the
state is read once and written once.

Written for ``Dk`` in :data:`FUSED_KEY_DIMS` (``P`` a power of two up to a warp's 32 lanes, so a
column's threads share a warp) and ``Dv`` a multiple of 32 (whole warps, as the full-mask shuffles
need) with ``Dv * P <= MAX_THREADS``; Qwen3-Next and Qwen3.5 use 128 x 128 (512 threads). Other
shapes, and q/k/v of mixed dtypes, run the ``mlx_fast`` chunked form.

Parity with the reference (tests/plugins/kernels/test_gated_delta.py; float32, bfloat16, float16)
and timings on an H100 (MLX 0.32.4, bfloat16, Qwen3-Next's 16 key / 32 value heads of 128; median
``mx.eval`` of out and state per call, Python included)::

    python bench/kernels/gated_delta.py --heads 16 32 --dtype bfloat16 --cases 1:1 8:1 1:512 1:4096

    B=1 L=1:    reference 0.221 ms, mlx_fast 0.200 ms, cuda_delta 0.061 ms
    B=8 L=1:    reference 0.303 ms, mlx_fast 0.269 ms, cuda_delta 0.092 ms
    B=1 L=512:  reference 60.4 ms,  mlx_fast 3.13 ms,  cuda_delta 0.735 ms
    B=1 L=4096:                     mlx_fast 11.9 ms,  cuda_delta 5.58 ms

So the sequential kernel beats the chunked matmuls even for a 4k prompt, though only ``B * Hv``
blocks are busy through ``L`` steps there; a chunked CUDA kernel would be the next step for long
prompts. (The chunked form also loses precision on MLX's CUDA backend, whose float32 matmuls round
like TF32: state 5e-4 relative off after 512 positions, where this kernel stays at 1e-7.)
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import KernelImpl, device_reasons
from mlxr_plugins.kernels.delta_rule import gated_delta as chunked_gated_delta

#: State rows per thread (registers), for every key dim.
ROWS = 32
#: Key head dims the kernel is written for: ``P = Dk / ROWS`` threads per column, 2 to 8.
FUSED_KEY_DIMS = (64, 128, 256)
#: Threads per block at most. CUDA allows 1024, but then every thread must fit in 64 registers
#: and the 32 state entries alone take half: 1024 threads (Dk=256, Dv=128) failed to launch on an
#: H100, leaving the outputs unwritten.
MAX_THREADS = 512

# Template: T (q, k, v and out), DK, DV, ROWS. q, k [B, L, Hk, DK]; v [B, L, Hv, DV]; g, beta
# [B, L, Hv] float32; s0 [B, Hv, DK, DV] float32. Outputs: y [B, L, Hv, DV] in T, s [B, Hv, DK, DV]
# float32. One block of DV * P threads per (batch row, value head), blockIdx.x = b * Hv + h.
_SOURCE = r"""
  constexpr int P = DK / ROWS;
  const int L = v_shape[1];
  const int Hv = v_shape[2];
  const int Hk = k_shape[2];
  const int bh = blockIdx.x;
  const int b = bh / Hv;
  const int h = bh % Hv;
  const int hk = h / (Hv / Hk);
  const int tid = threadIdx.x;
  const int dv = tid / P;
  const int p = tid % P;

  // This thread's entries of the state: rows i * P + p of column dv (interleaved, so the P
  // threads of a column read neighbouring shared-memory words below: no bank conflicts).
  float st[ROWS];
  const float* s_in = s0 + (long long)bh * DK * DV + dv;
#pragma unroll
  for (int i = 0; i < ROWS; ++i) st[i] = s_in[(long long)(i * P + p) * DV];

  // q_t and k_t in float32, double-buffered: position t writes buffer t & 1 while no thread can
  // still read it (every thread passed position t - 1's barrier after finishing t - 2).
  __shared__ float sk[2][DK];
  __shared__ float sq[2][DK];
  for (int t = 0; t < L; ++t) {
    const int buf = t & 1;
    const long long qk_row = (((long long)b * L + t) * Hk + hk) * DK;
    for (int i = tid; i < DK; i += DV * P) {
      sk[buf][i] = static_cast<float>(k[qk_row + i]);
      sq[buf][i] = static_cast<float>(q[qk_row + i]);
    }
    const long long gh = ((long long)b * L + t) * Hv + h;
    const float decay = expf(g[gh]);
    const float rate = beta[gh];
    const float v_t = static_cast<float>(v[gh * DV + dv]);
    __syncthreads();

    float recalled = 0.f;  // (S^T k)[dv]
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      st[i] *= decay;
      recalled += st[i] * sk[buf][i * P + p];
    }
#pragma unroll
    for (int offset = P / 2; offset > 0; offset >>= 1)
      recalled += __shfl_xor_sync(0xffffffff, recalled, offset);
    const float delta = rate * (v_t - recalled);
    float o = 0.f;  // (S^T q)[dv]
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      st[i] += sk[buf][i * P + p] * delta;
      o += st[i] * sq[buf][i * P + p];
    }
#pragma unroll
    for (int offset = P / 2; offset > 0; offset >>= 1) o += __shfl_xor_sync(0xffffffff, o, offset);
    if (p == 0) y[gh * DV + dv] = static_cast<T>(o);
  }
  float* s_out = s + (long long)bh * DK * DV + dv;
#pragma unroll
  for (int i = 0; i < ROWS; ++i) s_out[(long long)(i * P + p) * DV] = st[i];
"""


def shape_reason(key_dim: int, value_dim: int) -> str | None:
    """Why the fused kernel (CUDA or its Metal twin) does not take these head dims, or None."""
    if key_dim not in FUSED_KEY_DIMS:
        return (
            f"key head dim {key_dim} is not one of {', '.join(map(str, FUSED_KEY_DIMS))} "
            f"(the kernel holds {ROWS} state rows per thread, a power of two threads per column)"
        )
    threads = value_dim * (key_dim // ROWS)
    if value_dim % 32 or threads > MAX_THREADS:
        return (
            f"value head dim {value_dim} with key head dim {key_dim}: the kernel takes multiples of "
            f"32 and blocks of at most {MAX_THREADS} threads ({value_dim} columns x "
            f"{key_dim // ROWS} threads per column = {threads})"
        )
    return None


def call_reason(q: mx.array, k: mx.array, v: mx.array) -> str | None:
    """Why one call goes to the chunked form instead of the fused kernel, or None."""
    if not q.dtype == k.dtype == v.dtype:
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    if v.shape[2] % k.shape[2]:
        return f"{v.shape[2]} value heads are not a multiple of {k.shape[2]} key heads"
    return shape_reason(k.shape[-1], v.shape[-1])


@functools.cache
def _kernel() -> Any:
    """The kernel, built once; MLX compiles it once per template instantiation."""
    return mx.fast.cuda_kernel(
        name="mlxr_gated_delta",
        input_names=["q", "k", "v", "g", "beta", "s0"],
        output_names=["y", "s"],
        source=_SOURCE,
    )


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """The fused recurrence for the shapes it is written for (module docstring), else the chunked
    ``mlx_fast`` form."""
    if call_reason(q, k, v) is not None:
        return chunked_gated_delta(q, k, v, g, beta, state)
    return launch(_kernel(), q, k, v, g, beta, state)


def launch(
    kernel: Any, q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array | None
) -> tuple[mx.array, mx.array]:
    """Run ``kernel`` (this module's source, or its Metal twin's) on the op's arguments: one
    block of ``Dv * Dk / ROWS`` threads per (row, value head)."""
    B, L, _, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    threads = Dv * (Dk // ROWS)
    if state is None:
        state = mx.zeros((B, Hv, Dk, Dv), dtype=mx.float32)
    y, s = kernel(
        inputs=[q, k, v, g.astype(mx.float32), beta.astype(mx.float32), state.astype(mx.float32)],
        template=[("T", v.dtype), ("DK", Dk), ("DV", Dv), ("ROWS", ROWS)],
        grid=(B * Hv * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, L, Hv, Dv), (B, Hv, Dk, Dv)],
        output_dtypes=[v.dtype, mx.float32],
    )
    return y, s


def context_reasons(ctx: KernelContext, platform_name: str) -> list[str]:
    """Why the fused gated delta kernel for ``platform_name`` cannot run in ``ctx``: another
    platform or dtype, or head dims (when the architecture gives them) it was not written for."""
    reasons = device_reasons(ctx, platform_name)
    key_dim = ctx.shapes.get("linear_key_head_dim")
    value_dim = ctx.shapes.get("linear_value_head_dim")
    if key_dim is not None and value_dim is not None:
        reason = shape_reason(int(key_dim), int(value_dim))
        if reason:
            reasons.append(reason)
    return reasons


def _support(ctx: KernelContext) -> list[str]:
    return context_reasons(ctx, "cuda")


gated_delta_kernel = KernelImpl(
    gated_delta,
    _support,
    summary=(
        "one block per (batch row, value head), the state in registers through every position "
        f"(key dims {'/'.join(map(str, FUSED_KEY_DIMS))}); other shapes run mlx_fast's"
    ),
)
