"""Kernels from ``mx.fast``: fused where MLX has a fused kernel for the device, else MLX's fallback.

``mx.fast`` picks a fused Metal/CUDA kernel when one exists for the shape and falls back to
composed ops otherwise, so these backends run everywhere MLX runs; ``supports`` only refuses what
``mx.fast`` itself rejects.
"""

from __future__ import annotations

import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_core.model.layers.mlp import GATED_ACTIVATIONS
from mlxr_plugins.kernels import FLOAT_DTYPES, KernelImpl
from mlxr_plugins.kernels.delta_rule import gated_delta
from mlxr_plugins.kernels.kimi_delta import kimi_delta
from mlxr_plugins.kernels.reference import route
from mlxr_plugins.kernels.ssd import ssd


def _float_dtype(ctx: KernelContext) -> list[str]:
    if ctx.dtype not in FLOAT_DTYPES:
        return [f"activation dtype {ctx.dtype} is not one of {', '.join(FLOAT_DTYPES)}"]
    return []


def _attention_support(ctx: KernelContext) -> list[str]:
    reasons = _float_dtype(ctx)
    masks = ctx.shapes.get("masks", ())
    unknown = [kind for kind in masks if kind not in ("causal", "array")]
    if unknown:
        reasons.append(
            f"mask kinds {', '.join(map(str, unknown))} are not supported (causal, array)"
        )
    return reasons


def _rope_support(ctx: KernelContext) -> list[str]:
    reasons = _float_dtype(ctx)
    dims = ctx.shapes.get("rope_dims")
    if dims is not None and int(dims) % 2:
        reasons.append(f"rotary dims must be even, got {dims}")
    return reasons


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: str | mx.array | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` (GQA without tiling, bottom-right causal mask).
    Sinks are cast to the activations' dtype: MLX refuses float32 sinks with bfloat16 queries."""
    if sinks is not None:
        sinks = sinks.astype(q.dtype)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


attention_kernel = KernelImpl(
    attention, _attention_support, summary="mx.fast.scaled_dot_product_attention"
)
rms_norm_kernel = KernelImpl(mx.fast.rms_norm, _float_dtype, summary="mx.fast.rms_norm")


def add_rms_norm(
    x: mx.array, residual: mx.array, weight: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    """An add (fused with its neighbours inside ``mx.compile``), then ``mx.fast.rms_norm``."""
    h = x + residual
    return h, mx.fast.rms_norm(h, weight, eps)


add_rms_norm_kernel = KernelImpl(
    add_rms_norm, _float_dtype, summary="an add, then mx.fast.rms_norm (two kernels)"
)
rope_kernel = KernelImpl(mx.fast.rope, _rope_support, summary="mx.fast.rope")


def gated_activation(gate: mx.array, up: mx.array, *, activation: str) -> mx.array:
    """The MLP's own ``swiglu`` / ``geglu``: one ``mx.compile``'d elementwise kernel in the
    inputs' dtype (MLX has no ``mx.fast`` gated activation)."""
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"unknown gated activation {activation!r} (expected 'silu' or 'gelu_tanh')")
    return GATED_ACTIVATIONS[activation](gate, up)


gated_activation_kernel = KernelImpl(
    gated_activation, _float_dtype, summary="swiglu / geglu compiled into one elementwise kernel"
)
quantized_matmul_kernel = KernelImpl(
    mx.quantized_matmul, summary="mx.quantized_matmul (fused dequantize + matmul)"
)


def gather_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array | None = None,
    biases: mx.array | None = None,
    *,
    indices: mx.array,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
    sorted_indices: bool = False,
) -> mx.array:
    """``mx.gather_qmm`` for packed experts, ``mx.gather_mm`` for dense ones: no expert is
    copied out of the stack. MLX's CPU ``gather_mm`` runs float32 only: other dense dtypes on the
    CPU take each row's expert out of the stack, then multiply."""
    if scales is None:
        if x.dtype != mx.float32 and mx.default_device() == mx.cpu:
            picked = w[indices]
            return x @ (picked.swapaxes(-1, -2) if transpose else picked)
        return mx.gather_mm(
            x, w.swapaxes(-1, -2) if transpose else w, rhs_indices=indices, sorted_indices=sorted_indices
        )
    return mx.gather_qmm(
        x,
        w,
        scales,
        biases,
        rhs_indices=indices,
        transpose=transpose,
        group_size=group_size,
        bits=bits,
        mode=mode,
        sorted_indices=sorted_indices,
    )


gather_matmul_kernel = KernelImpl(
    gather_matmul, summary="mx.gather_qmm / mx.gather_mm (experts read in place)"
)

#: The router as plain mx ops (argpartition for the top-k): MLX has no fused router.
route_kernel = KernelImpl(route, summary="mx.softmax / mx.sigmoid, mx.argpartition")

#: MLX has no fused gated delta rule: one step of mx ops for decode, chunks of matmuls for a prompt
#: (see :mod:`mlxr_plugins.kernels.delta_rule`).
gated_delta_kernel = KernelImpl(
    gated_delta, summary="decode as one step of mx ops; prompts by chunks of 64 in matmuls (WY form)"
)

#: Nor a fused Kimi delta rule: one step of mx ops for decode, chunks of 8 for a prompt (see
#: :mod:`mlxr_plugins.kernels.kimi_delta`).
kimi_delta_kernel = KernelImpl(
    kimi_delta, summary="decode as one step of mx ops; prompts by chunks of 8 (per-channel decays, WY form)"
)

#: Mamba-2's SSD recurrence: one step of batched ops, or chunks of 64 in the quadratic form
#: (:mod:`mlxr_plugins.kernels.ssd`).
ssd_kernel = KernelImpl(ssd, summary="decode as one step of mx ops; prompts by chunks of 64 (quadratic form)")
