"""Mamba-2's selective state space layer (SSD), as Nemotron-H uses it.

Per position, with ``H`` heads of ``P`` channels, ``G`` groups of ``N`` state channels (head ``h``
reads group ``h // (H / G)``)::

    z, xBC, dt = in_proj(x)
    x, B, C = silu(causal_conv(xBC) + conv_bias)
    dt = clip(softplus(dt + dt_bias), *time_step_limit);  a = -exp(A_log) * dt   # log decay <= 0
    S = exp(a) S + dt * x B^T;  y = S C + D * x                                   # S [H, P, N]
    out = out_proj(group_rms_norm(y * silu(z)) * weight)

The recurrence is the ``ssd`` kernel op (``q = C``, ``k = B``, ``v = x``, ``g = a``, ``beta = dt``:
``gated_delta``'s signature), so
:class:`~mlxr_core.model.layers.linear_attention.ConvolvedRecurrence` keeps the states of a
verified draft position by position for a row's rollback.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import RecurrentCache
from mlxr_core.model.layers.linear_attention import ConvolvedRecurrence


class Mamba2Mixer(ConvolvedRecurrence):
    """Mamba-2 with Hugging Face's module names (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``,
    ``D``, ``norm``, ``out_proj``); ``conv1d.weight`` ``[channels, kernel, 1]`` (MLX's layout)."""

    def __init__(
        self,
        hidden: int,
        *,
        heads: int,
        head_dim: int,
        groups: int,
        state_size: int,
        conv_kernel: int,
        eps: float,
        conv_bias: bool,
        bias: bool,
        time_step_limit: tuple[float, float],
        kernels: KernelSet,
    ):
        super().__init__()
        if heads % groups:
            raise ValueError(f"mamba_num_heads {heads} is not a multiple of n_groups {groups}")
        self.heads, self.head_dim, self.groups, self.state_size = heads, head_dim, groups, state_size
        self.inner = heads * head_dim
        self.channels = self.inner + 2 * groups * state_size
        self.conv_kernel = conv_kernel
        self.in_proj = nn.Linear(hidden, self.inner + self.channels + heads, bias=bias)
        self.conv1d = nn.Conv1d(self.channels, self.channels, conv_kernel, groups=self.channels, bias=conv_bias)
        self.dt_bias = mx.ones((heads,))
        self.A_log = mx.zeros((heads,))
        self.D = mx.ones((heads,))
        self.norm = GroupGatedRMSNorm(self.inner, groups, eps)
        self.out_proj = nn.Linear(self.inner, hidden, bias=bias)
        self.state_shape = (heads, head_dim, state_size)
        self.time_step_limit = time_step_limit
        self._recurrence = kernels.ssd

    def convolve(self, qkv: mx.array, state: mx.array | None) -> tuple[mx.array, mx.array]:
        """The causal depthwise convolution with its bias, then SiLU."""
        from mlxr_core.model.layers.linear_attention import causal_conv

        out, state = causal_conv(qkv, state, self.conv1d.weight)
        if "bias" in self.conv1d:
            out = out + self.conv1d.bias
        return nn.silu(out), state

    def __call__(self, x: mx.array, mask: Any, cache: RecurrentCache | None) -> mx.array:
        """``[B, L, hidden]`` -> ``[B, L, hidden]``, advancing ``cache`` (``mask`` is unused: a
        recurrent layer sees only its own row's positions)."""
        Bsz, L, _ = x.shape
        H, P, G, N = self.heads, self.head_dim, self.groups, self.state_size
        z, xBC, dt = mx.split(self.in_proj(x), [self.inner, self.inner + self.channels], axis=-1)
        mixed, conv_state = self.convolve(xBC, cache.conv_state if cache is not None else None)
        v, k, q = mx.split(mixed, [self.inner, self.inner + G * N], axis=-1)
        v = v.reshape(Bsz, L, H, P)
        k = mx.repeat(k.reshape(Bsz, L, G, N), H // G, axis=2)
        q = mx.repeat(q.reshape(Bsz, L, G, N), H // G, axis=2)
        dt = nn.softplus(dt.astype(mx.float32) + self.dt_bias.astype(mx.float32))
        low, high = self.time_step_limit
        if low > 0.0 or high < math.inf:
            dt = mx.clip(dt, low, high)
        g = -mx.exp(self.A_log.astype(mx.float32)) * dt
        state = cache.recurrent_state if cache is not None else None
        if cache is not None and getattr(cache, "keeps_positions", False) and L > 1:
            out, state = self._verify(q, k, v, g, dt, state, cache, xBC)
        else:
            out, state = self._recurrence(q, k, v, g, dt, state)
        if cache is not None:
            cache.update(conv_state, state, L)
        y = out.astype(mx.float32) + v.astype(mx.float32) * self.D.astype(mx.float32)[:, None]
        result: mx.array = self.out_proj(self.norm(y.reshape(Bsz, L, H * P), z).astype(x.dtype))
        return result


class GroupGatedRMSNorm(nn.Module):
    """``rms_norm(x * silu(gate)) * weight``, the RMS taken over each of ``groups`` equal slices
    of the channels (the gate before the norm, unlike Qwen's), in float32."""

    def __init__(self, dims: int, groups: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.groups, self.eps = groups, eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        gated = x.astype(mx.float32) * nn.silu(gate.astype(mx.float32))
        parts = gated.reshape(*gated.shape[:-1], self.groups, -1)
        normed = parts * mx.rsqrt(mx.mean(parts * parts, axis=-1, keepdims=True) + self.eps)
        return self.weight * normed.reshape(gated.shape).astype(x.dtype)
