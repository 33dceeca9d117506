"""Kimi delta attention (KDA: Kimi Linear, GLM-5-Next's linear layers): Gated DeltaNet with a
decay per key channel, a low-rank forget gate and a sigmoid-gated output norm.

Like :class:`~mlxr_core.model.layers.linear_attention.GatedDeltaNet` it keeps no keys and values,
only a short convolution's last inputs and one ``[D, D]`` state per head, advanced by the
``kimi_delta`` kernel op. Per position, with ``H`` heads of ``D``::

    q, k, v = silu(causal_conv(q_proj(x) | k_proj(x) | v_proj(x)))   # one depthwise conv
    q, k = l2norm(q) / sqrt(D), l2norm(k)
    f = f_b_proj(f_a_proj(x)) + dt_bias                                # [H, D]: one gate a channel
    g = -exp(A_log) * softplus(f)        or, with a lower bound b < 0:  b * sigmoid(exp(A_log) * f)
    S = diag(exp(g)) S + k (beta (v - (diag(exp(g)) S)^T k))^T;  o = S^T q   # beta = sigmoid(b_proj(x))
    out = o_proj(rms_norm(o) * o_norm.weight * sigmoid(g_b_proj(g_a_proj(x))))

Module names are the released checkpoints' (``f_a_proj``, ``dt_bias``, ``A_log`` on the layer
itself; ``A_log`` held as ``[H]``); :func:`sanitize_kimi_delta` maps transformers' in-memory
names (``forget_gate.*``) and the released three convolutions onto them.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import RecurrentCache
from mlxr_core.model.layers.linear_attention import ConvolvedRecurrence, _rms, _unit_qk


@partial(mx.compile, shapeless=True)
def _sigmoid_gated_norm(x: mx.array, gate: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
    """``rms_norm(x) * weight * sigmoid(gate)`` in float32, out in x's dtype."""
    normed = _rms(x.astype(mx.float32), None, eps) * weight.astype(mx.float32)
    return (normed * mx.sigmoid(gate.astype(mx.float32))).astype(x.dtype)


class KimiDeltaAttention(ConvolvedRecurrence):
    """KDA with the released checkpoints' module names (see the module). ``lower_bound``: GLM-5-Next's
    bounded gate (``linear_lower_bound``), None for Kimi Linear's unbounded one."""

    def __init__(
        self,
        hidden: int,
        *,
        heads: int,
        head_dim: int,
        conv_kernel: int,
        eps: float,
        kernels: KernelSet,
        lower_bound: float | None = None,
    ):
        super().__init__()
        self.heads, self.head_dim, self.conv_kernel = heads, head_dim, conv_kernel
        width = heads * head_dim
        self.channels = 3 * width
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, width, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        self.conv1d = nn.Conv1d(self.channels, self.channels, conv_kernel, groups=self.channels, bias=False)
        self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, width, bias=False)
        self.dt_bias = mx.zeros((width,))
        self.A_log = mx.zeros((heads,))
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, width, bias=False)
        self.o_norm = nn.RMSNorm(head_dim)  # its weight; the norm is _sigmoid_gated_norm
        self.o_proj = nn.Linear(width, hidden, bias=False)
        self.lower_bound = lower_bound
        self.state_shape = (heads, head_dim, head_dim)
        self._recurrence = kernels.kimi_delta
        self._eps = mx.array(eps, dtype=mx.float32)
        self._qk_constants = tuple(mx.array(x, dtype=mx.float32) for x in (1e-6 / head_dim, 1.0 / head_dim, head_dim**-0.5))

    def forget(self, x: mx.array) -> mx.array:
        """The log decay of each key channel, ``[B, L, H, D]`` float32 (<= 0)."""
        B, L, _ = x.shape
        f = self.f_b_proj(self.f_a_proj(x)).astype(mx.float32) + self.dt_bias.astype(mx.float32)
        f = f.reshape(B, L, self.heads, self.head_dim)
        rate = mx.exp(self.A_log.astype(mx.float32))[:, None]  # [H, 1]
        if self.lower_bound is not None:
            return self.lower_bound * mx.sigmoid(rate * f)
        return -rate * nn.softplus(f)

    def __call__(self, x: mx.array, mask: Any, cache: RecurrentCache | None) -> mx.array:
        """``[B, L, hidden]`` -> ``[B, L, hidden]``, advancing ``cache`` (``mask`` is unused: a
        recurrent layer sees only its own row's positions)."""
        B, L, _ = x.shape
        H, D = self.heads, self.head_dim
        qkv = mx.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        mixed, conv_state = self.convolve(qkv, cache.conv_state if cache is not None else None)
        q, k, v = mx.split(mixed, 3, axis=-1)
        q, k = _unit_qk(q.reshape(B, L, H, D), k.reshape(B, L, H, D), *self._qk_constants)
        v = v.reshape(B, L, H, D)
        g, beta = self.forget(x), mx.sigmoid(self.b_proj(x).astype(mx.float32))
        state = cache.recurrent_state if cache is not None else None
        if cache is not None and getattr(cache, "keeps_positions", False) and L > 1:
            out, state = self._verify(q, k, v, g, beta, state, cache, qkv)
        else:
            out, state = self._recurrence(q, k, v, g, beta, state)
        if cache is not None:
            cache.update(conv_state, state, L)
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(B, L, H, D)
        out = _sigmoid_gated_norm(out, gate, self.o_norm.weight, self._eps)
        result: mx.array = self.o_proj(out.reshape(B, L, H * D))
        return result


#: transformers' in-memory names of the forget gate -> the released ones this layer holds.
FORGET_GATE = {f"forget_gate.{name}": name for name in ("f_a_proj", "f_b_proj", "dt_bias", "A_log")}


def sanitize_kimi_delta(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """KDA layers' tensors as :class:`KimiDeltaAttention` holds them: the released
    ``q_conv1d``/``k_conv1d``/``v_conv1d`` (``[C, 1, K]`` each) as one ``conv1d`` in MLX's layout
    (``[3C, K, 1]``), a fused ``conv1d`` moved likewise, ``forget_gate.*`` names without the
    prefix, ``A_log`` as ``[H]`` (Kimi Linear stores ``[1, 1, H, 1]``). Other tensors pass through."""
    out: dict[str, mx.array] = {}
    convs: dict[str, dict[str, mx.array]] = {}
    for name, array in weights.items():
        for old, new in FORGET_GATE.items():
            name = name.replace(f".{old}", f".{new}")
        stem, _, leaf = name.rpartition(".")
        if leaf == "weight" and stem.endswith(("q_conv1d", "k_conv1d", "v_conv1d")):
            convs.setdefault(stem[: -len("q_conv1d")], {})[stem[-len("q_conv1d") :][0]] = array
            continue
        if name.endswith(".A_log") and array.ndim == 4:
            array = array.reshape(-1)
        if name.endswith(".conv1d.weight") and array.ndim == 3 and array.shape[1] == 1 and array.shape[2] > 1:
            array = array.swapaxes(1, 2)
        out[name] = array
    for prefix, parts in convs.items():
        missing = [f"{prefix}{part}_conv1d.weight" for part in "qkv" if part not in parts]
        if missing:
            raise ModelLoadError("the checkpoint has the other convolutions of this layer but not this one",
                                 tensor=missing[0])
        fused = mx.concatenate([parts["q"], parts["k"], parts["v"]], axis=0)
        out[f"{prefix}conv1d.weight"] = fused.swapaxes(1, 2) if fused.shape[1] == 1 else fused
    return out
