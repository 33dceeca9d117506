"""``cuda_moe``: a mixture of experts' router on MLX's CUDA backend, through ``mx.fast.cuda_kernel``.

A decode step of a Qwen3-30B-A3B-shaped model (48 layers, 8 of 128 experts per token, 4-bit)
spends ~70-90 us per layer in the router's top-k as mx ops (softmax, ``argpartition``,
``take_along_axis``, a sum and a divide: H100, ``bench/kernels/moe_step.py``, 48 layers chained, one
token). ``mlxr_moe_route`` does it in one kernel, one warp per token: it scores the experts
(softmax or sigmoid, float32), picks the top ``k`` by ``k`` rounds of a warp-wide argmax and writes
their indices and (optionally renormalized) weights; 48-69 us per layer (one token, 8 tokens).
Up to :data:`MAX_EXPERTS` experts and :data:`MAX_TOP_K` picks; other routers run the mx ops.

The experts' packed matmuls stay on ``mx.gather_qmm``: a warp-per-output gather kernel written
for them was slower (H100, one token's 8 experts x 3 projections: ~120 us per layer against ~90;
8 tokens: ~680 against ~200; ``git show 8982ff0:bench/results/README.md``).

Written for and measured on MLX's CUDA backend; it cannot run elsewhere.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import KernelImpl, device_reasons
from mlxr_plugins.kernels.reference import route as mx_route

MAX_EXPERTS = 1024
MAX_TOP_K = 32
THREADS = 256

# logits [R, E]; indices [R, KP] uint32, weights [R, KP] float32. SIGMOID and NORM are 0/1.
_ROUTE_SOURCE = r"""
  constexpr int PER_LANE = (MAX_E + 31) / 32;
  const int lane = threadIdx.x & 31;
  const int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int R = logits_shape[0];
  const int E = logits_shape[1];
  if (r >= R) return;
  float score[PER_LANE];
  float best = -INFINITY;
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    const int e = lane + 32 * j;
    score[j] = e < E ? static_cast<float>(logits[(long long)r * E + e]) : -INFINITY;
    best = fmaxf(best, score[j]);
  }
  if (SIGMOID) {
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j)
      score[j] = lane + 32 * j < E ? 1.f / (1.f + expf(-score[j])) : -INFINITY;
  } else {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      best = fmaxf(best, __shfl_xor_sync(0xffffffff, best, offset));
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
      score[j] = lane + 32 * j < E ? expf(score[j] - best) : 0.f;
      sum += score[j];
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, offset);
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) score[j] = lane + 32 * j < E ? score[j] / sum : -INFINITY;
  }
  float picked_sum = 0.f;
  float mine = 0.f;      // lane t keeps pick t's weight
  unsigned int which = 0;
  for (int t = 0; t < KP; ++t) {
    float v = -INFINITY;
    int at = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
      if (score[j] > v) { v = score[j]; at = lane + 32 * j; }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffff, v, offset);
      const int oat = __shfl_xor_sync(0xffffffff, at, offset);
      if (ov > v || (ov == v && oat < at)) { v = ov; at = oat; }
    }
    if ((at & 31) == lane) score[at >> 5] = -INFINITY;   // taken
    picked_sum += v;
    if (lane == t) { mine = v; which = (unsigned int)at; }
  }
  if (lane < KP) {
    indices[(long long)r * KP + lane] = which;
    weights[(long long)r * KP + lane] = NORM ? mine / picked_sum : mine;
  }
"""


@functools.cache
def _route_kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="mlxr_moe_route",
        input_names=["logits"],
        output_names=["indices", "weights"],
        source=_ROUTE_SOURCE,
    )


def route(
    logits: mx.array,
    *,
    top_k: int,
    scoring: str = "softmax",
    normalize: bool = True,
    bias: mx.array | None = None,
    groups: int = 1,
    top_groups: int = 1,
) -> tuple[mx.array, mx.array]:
    """The fused router for up to :data:`MAX_EXPERTS` experts and :data:`MAX_TOP_K` picks, else
    the mx ops (and for DeepSeek's biased, group-limited choice)."""
    experts = logits.shape[-1]
    plain = bias is None and groups == 1
    if experts > MAX_EXPERTS or top_k > MAX_TOP_K or scoring not in ("softmax", "sigmoid") or not plain:
        return mx_route(
            logits, top_k, scoring=scoring, normalize=normalize, bias=bias, groups=groups, top_groups=top_groups
        )
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, experts)
    rows = flat.shape[0]
    max_e = 32 * -(-experts // 32)
    indices, weights = _route_kernel()(
        inputs=[flat],
        template=[("MAX_E", max_e), ("KP", top_k), ("SIGMOID", int(scoring == "sigmoid")),
                  ("NORM", int(normalize))],
        grid=(rows * 32, 1, 1),
        threadgroup=(min(THREADS, rows * 32), 1, 1),
        output_shapes=[(rows, top_k), (rows, top_k)],
        output_dtypes=[mx.uint32, mx.float32],
    )
    return indices.reshape(*lead, top_k), weights.reshape(*lead, top_k)


def _cuda_only(ctx: KernelContext) -> list[str]:
    return device_reasons(ctx, "cuda")


route_kernel = KernelImpl(
    route,
    _cuda_only,
    summary=f"softmax/sigmoid and top-k in one warp per token (up to {MAX_EXPERTS} experts)",
)
