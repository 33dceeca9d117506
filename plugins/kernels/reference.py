"""Reference kernels in plain ``mx`` ops: the definition every faster backend is tested against.

They favour clarity and numerical care over speed: softmax and normalization run in float32 and
nothing is fused. Signatures follow ``mlxr_core.kernels``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx

from mlxr_core.model.layers.moe import route
from mlxr_plugins.kernels import KernelImpl


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: str | mx.array | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """``softmax(scale * q @ k.T + mask) @ v`` with grouped-query heads.

    q ``[B, Hq, L, D]``, k/v ``[B, Hkv, S, D]``. Query heads ``h * R .. h * R + R - 1`` share key
    head ``h`` (``R = Hq // Hkv``); they are grouped by a reshape, so keys are never copied. The
    ``"causal"`` mask is aligned bottom-right: query ``i`` sees keys ``0 .. S - L + i``.
    ``sinks`` ``[Hq]`` (gpt-oss) is one more logit per head, never masked: a column joined to the
    scores before the softmax and dropped after it, so it only takes weight from the keys.
    """
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} key/value heads")
    R = Hq // Hkv
    queries = (q * scale).reshape(B, Hkv, R, L, D)
    scores = (queries @ k[:, :, None].swapaxes(-1, -2)).astype(mx.float32)  # [B, Hkv, R, L, S]

    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask kind {mask!r} (expected 'causal' or an array)")
        visible = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None, :]
        scores = mx.where(visible, scores, -math.inf)
    elif mask is not None:
        grouped = _group_heads(mask, Hkv, R)
        if grouped.dtype == mx.bool_:
            scores = mx.where(grouped, scores, -math.inf)
        else:
            scores = scores + grouped.astype(mx.float32)

    if sinks is not None:
        column = mx.broadcast_to(
            sinks.astype(mx.float32).reshape(1, Hkv, R, 1, 1), (*scores.shape[:-1], 1)
        )
        weights = mx.softmax(mx.concatenate([scores, column], axis=-1), axis=-1)[..., :S]
    else:
        weights = mx.softmax(scores, axis=-1)
    out = weights.astype(v.dtype) @ v[:, :, None]  # [B, Hkv, R, L, Dv]
    return out.reshape(B, Hq, L, v.shape[-1])


def _group_heads(mask: mx.array, Hkv: int, R: int) -> mx.array:
    """Reshape a mask broadcastable to ``[B, Hq, L, S]`` to broadcast to ``[B, Hkv, R, L, S]``."""
    while mask.ndim < 4:
        mask = mask[None]
    b, h, rows, cols = mask.shape
    if h == 1:
        return mask.reshape(b, 1, 1, rows, cols)
    return mask.reshape(b, Hkv, R, rows, cols)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last axis, normalized in float32."""
    x32 = x.astype(mx.float32)
    normed = x32 * mx.rsqrt(mx.mean(mx.square(x32), axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def add_rms_norm(
    x: mx.array, residual: mx.array, weight: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    """``h = x + residual`` and :func:`rms_norm` of ``h``: two ops, nothing fused."""
    h = x + residual
    return h, rms_norm(h, weight, eps)


def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
) -> mx.array:
    """Rotary position embedding of the first ``dims`` features of ``x`` (``[..., L, D]``).

    Position ``p = (offset + t) * scale`` rotates feature pair ``i`` by ``p / freqs[i]``, where
    ``freqs[i] = base ** (2i / dims)`` unless given. ``traditional`` pairs features ``(2i, 2i+1)``;
    otherwise ``(i, i + dims/2)`` (the Hugging Face layout).
    """
    if (base is None) == (freqs is None):
        raise ValueError("exactly one of base and freqs must be given")
    L, half = x.shape[-2], dims // 2
    if freqs is None:
        assert base is not None
        inv_freq = base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    else:
        inv_freq = 1.0 / freqs.astype(mx.float32)
    steps = mx.arange(L, dtype=mx.float32)
    if isinstance(offset, mx.array) and offset.ndim == 1:  # one offset per batch row
        positions = (steps[None, :] + offset.astype(mx.float32)[:, None]) * scale
        theta = positions[..., None] * inv_freq  # [B, L, dims/2]
        theta = theta.reshape(theta.shape[0], *([1] * (x.ndim - 3)), L, half)
    else:
        start = offset.astype(mx.float32) if isinstance(offset, mx.array) else float(offset)
        theta = ((steps + start) * scale)[:, None] * inv_freq[None, :]  # [L, dims/2]
    cos, sin = mx.cos(theta), mx.sin(theta)

    rotated, rest = x[..., :dims].astype(mx.float32), x[..., dims:]
    if traditional:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
    else:
        x1, x2 = rotated[..., :half], rotated[..., half:]
    y1 = x1 * cos - x2 * sin
    y2 = x1 * sin + x2 * cos
    if traditional:
        out = mx.stack([y1, y2], axis=-1).reshape(rotated.shape)
    else:
        out = mx.concatenate([y1, y2], axis=-1)
    out = out.astype(x.dtype)
    return mx.concatenate([out, rest], axis=-1) if dims < x.shape[-1] else out


def gated_activation(gate: mx.array, up: mx.array, *, activation: str) -> mx.array:
    """``act(gate) * up`` in float32 from the textbook formulas: ``silu(g) = g * sigmoid(g)``,
    ``gelu_tanh(g) = 0.5 * g * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 * g**3)))``."""
    g = gate.astype(mx.float32)
    if activation == "silu":
        act = g * mx.sigmoid(g)
    elif activation == "gelu_tanh":
        act = 0.5 * g * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
    else:
        raise ValueError(f"unknown gated activation {activation!r} (expected 'silu' or 'gelu_tanh')")
    return (act * up.astype(mx.float32)).astype(gate.dtype)


attention_kernel = KernelImpl(attention, summary="plain mx ops, float32 softmax: the ground truth")
rms_norm_kernel = KernelImpl(rms_norm, summary="plain mx ops in float32: the ground truth")
add_rms_norm_kernel = KernelImpl(add_rms_norm, summary="an add, then the reference rms_norm")
rope_kernel = KernelImpl(rope, summary="plain mx ops in float32: the ground truth")
gated_activation_kernel = KernelImpl(gated_activation, summary="plain mx ops in float32: the ground truth")


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    *,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
) -> mx.array:
    """Dequantize ``w``, then an ordinary matmul (``x @ w.T`` when ``transpose``), in float32.

    Affine groups: ``w_float = scale * q + bias`` per ``group_size`` consecutive input features.
    """
    dense = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode)
    dense = dense.astype(mx.float32)
    out = x.astype(mx.float32) @ (dense.T if transpose else dense)
    return out.astype(x.dtype)


quantized_matmul_kernel = KernelImpl(
    quantized_matmul, summary="mx.dequantize, then a dense matmul: the ground truth"
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
    """Each row's expert matrix taken out of the stack (dequantized when packed), then an
    ordinary batched matmul in float32: ``x [..., 1, in] @ w[indices].T -> [..., 1, out]``."""
    picked = w[indices]
    if scales is not None:
        picked = mx.dequantize(
            picked,
            scales[indices],
            None if biases is None else biases[indices],
            group_size=group_size,
            bits=bits,
            mode=mode,
        )
    picked = picked.astype(mx.float32)
    out = x.astype(mx.float32) @ (picked.swapaxes(-1, -2) if transpose else picked)
    return out.astype(x.dtype)


gather_matmul_kernel = KernelImpl(
    gather_matmul, summary="each row's expert taken out of the stack, then a matmul: the ground truth"
)


route_kernel = KernelImpl(route, summary="softmax or sigmoid, argpartition, take: the ground truth")


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """The gated delta rule one step at a time, in float32 (see ``mlxr_core.kernels``).

    q, k ``[B, L, Hk, Dk]`` (normalized and scaled by the caller), v ``[B, L, Hv, Dv]``, g and beta
    ``[B, L, Hv]``, state ``[B, Hv, Dk, Dv]`` or None. Key head ``j`` serves value heads
    ``j*r .. j*r + r - 1``: q and k are repeated per value head, so every step below is one head's
    formula, broadcast. Returns the outputs ``[B, L, Hv, Dv]`` in v's dtype and the final state.
    """
    B, L, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    if Hv % Hk:
        raise ValueError(f"{Hv} value heads are not a multiple of {Hk} key heads")
    r = Hv // Hk
    queries = mx.repeat(q.astype(mx.float32), r, axis=2)  # [B, L, Hv, Dk]
    keys = mx.repeat(k.astype(mx.float32), r, axis=2)
    values, decay, rate = v.astype(mx.float32), mx.exp(g.astype(mx.float32)), beta.astype(mx.float32)
    S = mx.zeros((B, Hv, Dk, Dv), dtype=mx.float32) if state is None else state.astype(mx.float32)
    outputs = []
    for t in range(L):
        S = S * decay[:, t, :, None, None]
        k_t = keys[:, t, :, :, None]  # [B, Hv, Dk, 1]
        remembered = (S * k_t).sum(axis=-2)  # S^T k: what the state recalls for k, [B, Hv, Dv]
        delta = rate[:, t, :, None] * (values[:, t] - remembered)
        S = S + k_t * delta[:, :, None, :]
        outputs.append((S * queries[:, t, :, :, None]).sum(axis=-2))  # S^T q
    return mx.stack(outputs, axis=1).astype(v.dtype), S


gated_delta_kernel = KernelImpl(
    gated_delta, summary="one step at a time in plain mx ops, float32: the ground truth"
)


def kimi_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """The Kimi delta rule one step at a time, in float32 (see ``mlxr_core.kernels``): the gated
    delta rule with ``g`` ``[B, L, H, Dk]`` decaying each key channel's row of the state on its
    own. q, k ``[B, L, H, Dk]``, v ``[B, L, H, Dv]``, beta ``[B, L, H]``, state ``[B, H, Dk, Dv]``
    or None. Returns the outputs ``[B, L, H, Dv]`` in v's dtype and the final state."""
    B, L, H, Dk = k.shape
    if v.shape[2] != H or g.shape[2:] != (H, Dk):
        raise ValueError(f"v {v.shape} and g {g.shape} must have the {H} heads of k (and g its {Dk} channels)")
    queries, keys, values = (x.astype(mx.float32) for x in (q, k, v))
    decay, rate = mx.exp(g.astype(mx.float32)), beta.astype(mx.float32)
    S = mx.zeros((B, H, Dk, v.shape[-1]), dtype=mx.float32) if state is None else state.astype(mx.float32)
    outputs = []
    for t in range(L):
        S = S * decay[:, t, :, :, None]  # each key channel's row by its own decay
        k_t = keys[:, t, :, :, None]  # [B, H, Dk, 1]
        delta = rate[:, t, :, None] * (values[:, t] - (S * k_t).sum(axis=-2))
        S = S + k_t * delta[:, :, None, :]
        outputs.append((S * queries[:, t, :, :, None]).sum(axis=-2))  # S^T q
    return mx.stack(outputs, axis=1).astype(v.dtype), S


kimi_delta_kernel = KernelImpl(
    kimi_delta, summary="one step at a time in plain mx ops, float32: the ground truth"
)


def ssd(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Mamba-2's SSD recurrence one step at a time, in float32 (see ``mlxr_core.kernels``): per
    head ``S = exp(g_t) S + beta_t v_t k_t^T``, ``out_t = S q_t``. q, k ``[B, L, H, N]``, v
    ``[B, L, H, P]``, g and beta ``[B, L, H]``, state ``[B, H, P, N]`` or None. Returns the outputs
    ``[B, L, H, P]`` in v's dtype and the final state."""
    B, L, H, N = k.shape
    if v.shape[:3] != (B, L, H) or q.shape != k.shape:
        raise ValueError(f"q {q.shape}, k {k.shape} and v {v.shape} must share batch, length and heads")
    queries, keys, values = (x.astype(mx.float32) for x in (q, k, v))
    decay, rate = mx.exp(g.astype(mx.float32)), beta.astype(mx.float32)
    S = mx.zeros((B, H, v.shape[-1], N), dtype=mx.float32) if state is None else state.astype(mx.float32)
    outputs = []
    for t in range(L):
        written = (rate[:, t, :, None] * values[:, t])[..., None] * keys[:, t, :, None, :]  # beta v k^T
        S = decay[:, t, :, None, None] * S + written
        outputs.append((S * queries[:, t, :, None, :]).sum(axis=-1))  # S q
    return mx.stack(outputs, axis=1).astype(v.dtype), S


ssd_kernel = KernelImpl(ssd, summary="one step at a time in plain mx ops, float32: the ground truth")


def fused_below(min_rows: int, dense: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """A quantized matmul that runs ``mx.quantized_matmul`` for fewer than ``min_rows`` input rows
    (batch x positions) and ``dense`` (same arguments) from there on; affine packing with biases
    only, other modes always fused. Backends whose dense path pays from a few rows build on it."""

    def quantized_matmul(
        x: mx.array,
        w: mx.array,
        scales: mx.array,
        biases: mx.array | None = None,
        transpose: bool = True,
        group_size: int = 64,
        bits: int = 4,
        mode: str = "affine",
    ) -> mx.array:
        rows = x.size // x.shape[-1] if x.ndim else 1
        if rows < min_rows or mode != "affine" or biases is None:
            return mx.quantized_matmul(
                x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode
            )
        out: mx.array = dense(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode)
        return out

    return quantized_matmul
