"""Gated DeltaNet linear attention and gated softmax attention (Qwen3-Next, Qwen3.5).

A :class:`GatedDeltaNet` layer keeps no keys and values: its state is a short causal
convolution's last inputs and one ``[Dk, Dv]`` matrix per value head, updated by the gated delta
rule (the ``gated_delta`` kernel op) at every position, held in a
:class:`~mlxr_core.model.cache.RecurrentCache`. Per position::

    q, k, v = silu(causal_conv(in_proj(x)))          # one depthwise conv over q|k|v channels
    q, k = l2norm(q) / sqrt(Dk), l2norm(k)
    g = -exp(A_log) * softplus(a + dt_bias)          # log decay per value head
    S = exp(g) S + k (beta (v - S^T k))^T;  o = S^T q   # beta = sigmoid(b)
    out = out_proj(rms_norm(o) * weight * silu(z))

:class:`GatedAttention` is grouped-query attention whose ``q_proj`` also gives a sigmoid gate
over the attention's output channels.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import RecurrentCache
from mlxr_core.model.layers.attention import Attention
from mlxr_core.model.layers.norms import RMSNorm

# The element-wise chains of a step as compiled functions: one fused kernel each instead of one
# per op (a one-token step on a GPU is bound by the host's cost per kernel). Shapeless: one trace
# serves every batch size and prompt length.


@partial(mx.compile, shapeless=True)
def _gated_norm(x: mx.array, gate: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
    """``rms_norm(x) * weight * silu(gate)``, the gate in float32."""
    return (_rms(x, weight, eps) * nn.silu(gate.astype(mx.float32))).astype(x.dtype)


def _rms(x: mx.array, weight: mx.array | None, eps: mx.array) -> mx.array:
    """RMS norm with ``eps`` an array (a compiled function's arguments are arrays)."""
    x32 = x.astype(mx.float32)
    normed = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight if weight is not None else normed


@partial(mx.compile, shapeless=True)
def _decay_and_beta(A_log: mx.array, a: mx.array, dt_bias: mx.array, b: mx.array) -> tuple[mx.array, mx.array]:
    """``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, in float32."""
    g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a.astype(mx.float32) + dt_bias)
    return g, mx.sigmoid(b.astype(mx.float32))


@partial(mx.compile, shapeless=True)
def _unit_qk(
    q: mx.array, k: mx.array, eps: mx.array, q_scale: mx.array, k_scale: mx.array
) -> tuple[mx.array, mx.array]:
    """q and k RMS-normalized in float32 and scaled: ``l2norm(x) = rms_norm(x, eps / D) / sqrt(D)``,
    so with ``eps`` the l2 norm's over ``D``, ``q_scale = 1 / D`` gives ``l2norm(q) / sqrt(D)`` and
    ``k_scale = 1 / sqrt(D)`` gives ``l2norm(k)`` (the scales are arrays: a shapeless trace must
    not keep one model's ``D``)."""
    return _rms(q, None, eps) * q_scale, _rms(k, None, eps) * k_scale


def causal_conv(x: mx.array, state: mx.array | None, weight: mx.array) -> tuple[mx.array, mx.array]:
    """The causal depthwise convolution of ``x`` ``[B, L, C]`` by ``weight`` ``[C, K, 1]`` (MLX's
    depthwise layout) after the ``K - 1`` inputs in ``state`` (zeros when None); returns it and
    the new state (the last ``K - 1`` inputs)."""
    B, L, C = x.shape
    K = weight.shape[1]
    if state is None:
        state = mx.zeros((B, K - 1, C), dtype=x.dtype)
    window = mx.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K - 1 + L, C]
    if mx.default_device() == mx.gpu:
        # One grouped conv on a GPU: on an H100 (bf16, 8,192 channels) 0.076 ms for 131
        # positions and 0.111 ms for 32 rows of one step, against 0.151 and 0.139 ms as K
        # shifted products.
        return mx.conv1d(window, weight, groups=C), window[:, L:]
    # K shifted products on a CPU, half the time of the grouped conv on this one (2 cores,
    # bf16: 131 positions 7.9 vs 15.3 ms; 32 rows of one step 1.7 vs 2.7 ms).
    taps = weight[:, :, 0]  # [C, K]
    out = window[:, 0:L] * taps[:, 0]
    for i in range(1, K):
        out = out + window[:, i : i + L] * taps[:, i]
    return out, window[:, L:]


class GatedRMSNorm(nn.Module):
    """``rms_norm(x) * weight * silu(gate)`` over the last axis (the norm before the gate)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps
        self._eps = mx.array(eps, dtype=mx.float32)  # the compiled function's argument, made once

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return _gated_norm(x, gate, self.weight, self._eps)


class ConvolvedRecurrence(nn.Module):
    """What the recurrent mixers share: a causal depthwise convolution (``conv1d``, then SiLU)
    over ``channels``, then a recurrence (``_recurrence``, a kernel op with ``gated_delta``'s
    signature) over a state of :attr:`state_shape`; their cache, and the verification of a
    draft position by position."""

    conv1d: nn.Conv1d
    conv_kernel: int
    channels: int
    state_shape: tuple[int, ...]
    _recurrence: Any

    def make_cache(self) -> RecurrentCache:
        """This layer's state for one sequence: ``kernel - 1`` conv inputs and the recurrent state."""
        return RecurrentCache((self.conv_kernel - 1, self.channels), self.state_shape)

    def convolve(self, qkv: mx.array, state: mx.array | None) -> tuple[mx.array, mx.array]:
        """The causal depthwise convolution (then SiLU) of ``qkv`` ``[B, L, C]`` after the
        ``kernel - 1`` inputs in ``state`` (zeros when None); returns it and the new state."""
        out, state = causal_conv(qkv, state, self.conv1d.weight)
        return nn.silu(out), state

    def _verify(
        self, q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array | None,
        cache: Any, qkv: mx.array,
    ) -> tuple[mx.array, mx.array]:
        """A verified draft's positions one at a time (as decoding steps them), handing the cache
        the states after each (``keep_positions``: the convolution's last ``kernel - 1`` inputs
        and the recurrent state), so that a row's rejected positions can be undone."""
        B, L, C = qkv.shape
        K = self.conv_kernel
        before = cache.conv_state if cache.conv_state is not None else mx.zeros((B, K - 1, C), dtype=qkv.dtype)
        window = mx.concatenate([before.astype(qkv.dtype), qkv], axis=1)  # [B, K - 1 + L, C]
        outs, states, convs = [], [], []
        for j in range(L):
            out, state = self._recurrence(
                q[:, j : j + 1], k[:, j : j + 1], v[:, j : j + 1], g[:, j : j + 1], beta[:, j : j + 1], state
            )
            outs.append(out)
            states.append(state)
            convs.append(window[:, j + 1 : j + K])
        cache.keep_positions(convs, states)
        assert state is not None
        return mx.concatenate(outs, axis=1), state


class GatedDeltaNet(ConvolvedRecurrence):
    """Gated DeltaNet with Hugging Face's module names. ``fused`` projections are Qwen3-Next's
    (``in_proj_qkvz`` and ``in_proj_ba``, grouped per key head); otherwise Qwen3.5's
    (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). ``conv1d.weight`` is
    ``[channels, kernel, 1]`` (MLX's depthwise layout). ``tiled``: the value heads are in
    llama.cpp's order for Qwen3.5 files (key head j serves value heads j, j + Hk, ...), which
    every value-head weight follows, so only the pairing of q/k heads with value heads changes."""

    def __init__(
        self,
        hidden: int,
        *,
        key_heads: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        conv_kernel: int,
        eps: float,
        kernels: KernelSet,
        fused: bool,
        tiled: bool = False,
    ):
        super().__init__()
        if value_heads % key_heads:
            raise ValueError(f"linear_num_value_heads {value_heads} is not a multiple of linear_num_key_heads {key_heads}")
        self.key_heads, self.value_heads = key_heads, value_heads
        self.key_dim, self.value_dim = key_dim, value_dim
        self.conv_kernel = conv_kernel
        keys, values = key_heads * key_dim, value_heads * value_dim
        self.channels = 2 * keys + values
        self.fused = fused
        #: Value heads in llama.cpp's tiled order: key head j serves value heads j, j + Hk, ...
        self.tiled = tiled
        if fused:
            self.in_proj_qkvz = nn.Linear(hidden, 2 * keys + 2 * values, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * value_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden, self.channels, bias=False)
            self.in_proj_z = nn.Linear(hidden, values, bias=False)
            self.in_proj_b = nn.Linear(hidden, value_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.channels, self.channels, conv_kernel, groups=self.channels, bias=False)
        self.dt_bias = mx.ones((value_heads,))
        self.A_log = mx.zeros((value_heads,))
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = nn.Linear(values, hidden, bias=False)
        self.state_shape = (value_heads, key_dim, value_dim)
        self._recurrence = kernels.gated_delta
        # l2norm's epsilon over Dk (see _unit_qk), and the scales of q and k
        self._qk_constants = tuple(mx.array(x, dtype=mx.float32) for x in (1e-6 / key_dim, 1.0 / key_dim, key_dim**-0.5))

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """``[B, L, hidden]`` -> the conv's input ``[B, L, channels]`` (q, k, v heads in turn), the
        gate ``z`` ``[B, L, Hv, Dv]``, and ``b``, ``a`` ``[B, L, Hv]``."""
        B, L, _ = x.shape
        Hk, Hv, Dk, Dv = self.key_heads, self.value_heads, self.key_dim, self.value_dim
        if not self.fused:
            return (
                self.in_proj_qkv(x),
                self.in_proj_z(x).reshape(B, L, Hv, Dv),
                self.in_proj_b(x),
                self.in_proj_a(x),
            )
        r = Hv // Hk  # value heads per key head; Qwen3-Next groups every projection by key head
        qkvz = self.in_proj_qkvz(x).reshape(B, L, Hk, 2 * Dk + 2 * r * Dv)
        q, k, v, z = mx.split(qkvz, [Dk, 2 * Dk, 2 * Dk + r * Dv], axis=-1)
        b, a = mx.split(self.in_proj_ba(x).reshape(B, L, Hk, 2 * r), [r], axis=-1)
        qkv = mx.concatenate([q.reshape(B, L, -1), k.reshape(B, L, -1), v.reshape(B, L, -1)], axis=-1)
        return qkv, z.reshape(B, L, Hv, Dv), b.reshape(B, L, Hv), a.reshape(B, L, Hv)

    def __call__(self, x: mx.array, mask: Any, cache: RecurrentCache | None) -> mx.array:
        """``[B, L, hidden]`` -> ``[B, L, hidden]``, advancing ``cache`` (``mask`` is unused: a
        recurrent layer sees only its own row's positions)."""
        B, L, _ = x.shape
        Hk, Hv, Dk, Dv = self.key_heads, self.value_heads, self.key_dim, self.value_dim
        qkv, z, b, a = self.project(x)
        conv_state = cache.conv_state if cache is not None else None
        mixed, conv_state = self.convolve(qkv, conv_state)
        q, k, v = mx.split(mixed, [Hk * Dk, 2 * Hk * Dk], axis=-1)
        q, k = _unit_qk(q.reshape(B, L, Hk, Dk), k.reshape(B, L, Hk, Dk), *self._qk_constants)
        v = v.reshape(B, L, Hv, Dv)
        if self.tiled and Hv != Hk:  # one q/k head per value head, in the heads' order
            q, k = mx.tile(q, (1, 1, Hv // Hk, 1)), mx.tile(k, (1, 1, Hv // Hk, 1))
        g, beta = _decay_and_beta(self.A_log, a, self.dt_bias, b)
        state = cache.recurrent_state if cache is not None else None
        if cache is not None and getattr(cache, "keeps_positions", False) and L > 1:
            out, state = self._verify(q, k, v, g, beta, state, cache, qkv)
        else:
            out, state = self._recurrence(q, k, v, g, beta, state)
        if cache is not None:
            cache.update(conv_state, state, L)
        out = self.norm(out, z)
        result: mx.array = self.out_proj(out.reshape(B, L, Hv * Dv))
        return result


class GatedAttention(Attention):
    """:class:`Attention` whose ``q_proj`` gives each query head twice its width: the queries,
    then a gate over that head's output, ``o_proj(attention * sigmoid(gate))``. Per-head q/k
    norms are on (Qwen3-Next's, scaling by ``1 + weight``)."""

    def __init__(self, hidden: int, n_heads: int, *args: Any, qkv_bias: bool = False, **kwargs: Any):
        super().__init__(hidden, n_heads, *args, qkv_bias=qkv_bias, **kwargs)
        self.q_proj = nn.Linear(hidden, 2 * n_heads * self.head_dim, bias=qkv_bias)

    def fuse_projections(self) -> bool:
        """False: the gate rides in ``q_proj``, which stays its own matmul."""
        return False

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: Any) -> mx.array:
        B, L, _ = x.shape
        H, D = self.n_heads, self.head_dim
        queries, gate = mx.split(self.q_proj(x).reshape(B, L, H, 2 * D), 2, axis=-1)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, D)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, D)
        queries, keys = self.q_norm(queries), self.k_norm(keys)
        offset = cache.offset if cache is not None else 0
        queries = self._rotary(queries.transpose(0, 2, 1, 3), offset)
        keys = self._rotary(keys.transpose(0, 2, 1, 3), offset)
        out = self.attention(queries, keys, values.transpose(0, 2, 1, 3), mask, cache)
        merged = out.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate.reshape(B, L, -1))
        result: mx.array = self.o_proj(merged)
        return result


class MixerBlock(nn.Module):
    """A pre-norm block around either token mixer: ``h = x + mixer(norm(x)); out = h +
    mlp(norm(h))``, the mixer under Hugging Face's name (``self_attn`` or ``linear_attn``),
    norms scaling by ``norm_offset + weight``."""

    def __init__(
        self,
        name: str,
        mixer: nn.Module,
        mlp: nn.Module,
        hidden: int,
        eps: float,
        kernels: KernelSet,
        norm_offset: float = 0.0,
    ):
        super().__init__()
        setattr(self, name, mixer)
        self.mixer_name = name
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, kernels, offset=norm_offset)
        self.post_attention_layernorm = RMSNorm(hidden, eps, kernels, offset=norm_offset)

    @property
    def mixer(self) -> nn.Module:
        mixer: nn.Module = self[self.mixer_name]
        return mixer

    def make_cache(self) -> Any:
        """The cache this block's mixer needs (see :class:`~mlxr_core.model.cache.LayerCache`)."""
        from mlxr_core.model.cache import KVCache

        return self.mixer.make_cache() if isinstance(self.mixer, ConvolvedRecurrence) else KVCache()

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: Any) -> mx.array:
        mixed = self.mixer(self.input_layernorm(x), mask, cache)
        h, normed = self.post_attention_layernorm.add_and_norm(mixed, x)  # one add_rms_norm kernel
        out: mx.array = h + self.mlp(normed)
        return out
