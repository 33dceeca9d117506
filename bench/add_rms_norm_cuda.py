"""A residual add fused with the RMSNorm after it, as one CUDA kernel (an experiment).

``h, n = add_rms_norm(x, y, weight, eps)`` gives ``h = x + y`` and ``n = rms_norm(h) * weight`` in
one launch instead of two (an elementwise add, then ``mx.fast.rms_norm``). A decoder block of a
Llama-style model has this pattern once inside the block (attention's residual, then the MLP's
norm), so a one-token decode step launches one kernel fewer per layer. Used by
``decode_profile.py``'s ``mlxr_add_norm`` variant; CUDA only.
"""

from __future__ import annotations

import functools
import struct
import types
from typing import Any

import mlx.core as mx

THREADS = 256

_SOURCE = r"""
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const float eps = __int_as_float(EPS_BITS);
  constexpr int PER = D / THREADS;
  float hv[PER];
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const long long at = (long long)row * D + tid + i * THREADS;
    const T s = static_cast<T>(static_cast<float>(x[at]) + static_cast<float>(y[at]));
    h[at] = s;
    hv[i] = static_cast<float>(s);
    acc += hv[i] * hv[i];
  }
  __shared__ float partial[THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
  if ((tid & 31) == 0) partial[tid >> 5] = acc;
  __syncthreads();
  if (tid < 32) {
    float v = tid < THREADS / 32 ? partial[tid] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    if (tid == 0) partial[0] = v;
  }
  __syncthreads();
  const float inv = rsqrtf(partial[0] / D + eps);
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = tid + i * THREADS;
    n[(long long)row * D + c] = static_cast<T>(static_cast<T>(hv[i] * inv) * w[c]);
  }
"""


@functools.cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="mlxr_add_rms_norm",
        input_names=["x", "y", "w"],
        output_names=["h", "n"],
        source=_SOURCE,
    )


def add_rms_norm(x: mx.array, y: mx.array, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    D = x.shape[-1]
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    if not on_cuda or D % THREADS or x.dtype != y.dtype or weight.dtype != x.dtype:
        h = x + y
        return h, mx.fast.rms_norm(h, weight, eps)
    rows = x.size // D
    bits = struct.unpack("<i", struct.pack("<f", eps))[0]
    h, n = _kernel()(
        inputs=[x, y, weight],
        template=[("T", x.dtype), ("D", D), ("THREADS", THREADS), ("EPS_BITS", bits)],
        grid=(rows * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape, x.shape],
        output_dtypes=[x.dtype, x.dtype],
    )
    return h, n


def patch_blocks(model: Any) -> int:
    """Give each Llama-style block of ``model`` an ``after_attention`` through :func:`add_rms_norm`."""
    count = 0
    for layer in model.layers:
        norm = getattr(layer, "post_attention_layernorm", None)
        if norm is None or not hasattr(layer, "mlp"):
            continue

        def after_attention(self: Any, x: mx.array, out: mx.array) -> mx.array:
            norm = self.post_attention_layernorm
            h, n = add_rms_norm(x, self.self_attn.output(out), norm.weight, norm.eps)
            result: mx.array = h + self.mlp(n)
            return result

        object.__setattr__(layer, "after_attention", types.MethodType(after_attention, layer))
        count += 1
    return count
