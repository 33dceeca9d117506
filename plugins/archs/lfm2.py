"""LFM2 (Liquid AI): short gated convolutions interleaved with attention, SwiGLU feed-forward.

A ``conv`` layer's token mixer (Hugging Face's ``Lfm2ShortConv``) keeps no keys and values::

    B, C, x = split(in_proj(h), 3)        # channels of the layer's width each
    y = out_proj(C * causal_conv(B * x))  # depthwise, conv_L_cache taps, no activation

its state the convolution's last ``conv_L_cache - 1`` inputs, in a
:class:`~mlxr_core.model.cache.RecurrentCache` whose recurrent state is empty (so batching, the
prefix cache and a draft's rollback treat it as the other recurrent layers). A ``full_attention``
layer is grouped-query attention with per-head q/k norms. Each block is pre-norm
(``operator_norm``, ``ffn_norm``); the final norm is ``embedding_norm``. LFM3
(:mod:`mlxr_plugins.archs.lfm3`) builds on these pieces.

Hugging Face's names are kept where the graph's modules differ: the feed-forward's ``w1``,
``w3``, ``w2`` are read as ``gate_proj``, ``up_proj``, ``down_proj``, attention's ``out_proj``,
``q_layernorm``, ``k_layernorm`` as ``o_proj``, ``q_norm``, ``k_norm``, the final ``embedding_norm`` as ``norm``; the conv weight
``[channels, 1, taps]`` is stored in MLX's layout ``[channels, taps, 1]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import KVCache, RecurrentCache
from mlxr_core.model.layers import (
    Attention,
    CausalLM,
    DecoderArchitecture,
    DecoderModel,
    GatedMLP,
    RMSNorm,
    TransformerArgs,
    args_rotary,
)
from mlxr_core.model.layers.linear_attention import causal_conv

CONV, FULL = "conv", "full_attention"
#: Hugging Face's names -> the graph's (attention's names are LFM2's only: LFM3 has Qwen3's).
RENAMES = (
    (".feed_forward.w1.", ".feed_forward.gate_proj."),
    (".feed_forward.w3.", ".feed_forward.up_proj."),
    (".feed_forward.w2.", ".feed_forward.down_proj."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    ("model.embedding_norm.", "model.norm."),
    (".self_attn.g_proj.", ".self_attn.gate_proj."),  # LFM3's gate as transformers' module names it
)


class ShortConv(nn.Module):
    """``out_proj(C * causal_conv(B * x))`` with ``B, C, x`` from ``in_proj`` (see the module
    docstring), advancing a :class:`RecurrentCache` that holds the convolution's last inputs."""

    def __init__(self, hidden: int, taps: int, bias: bool):
        super().__init__()
        self.hidden, self.taps = hidden, taps
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.conv = nn.Conv1d(hidden, hidden, taps, groups=hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def make_cache(self) -> RecurrentCache:
        """``taps - 1`` inputs per sequence; the recurrent state is empty (``[B, 0]``)."""
        return RecurrentCache((self.taps - 1, self.hidden), (0,))

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        """``[B, L, hidden]`` -> ``[B, L, hidden]``, advancing ``cache`` (a :class:`RecurrentCache` or
        its batch form; ``mask`` is unused: a row sees only its own positions)."""
        B, L, _ = x.shape
        b, c, v = mx.split(self.in_proj(x), 3, axis=-1)
        gated = b * v
        before = cache.conv_state if cache is not None else None
        conv, after = causal_conv(gated, before, self.conv.weight)
        if "bias" in self.conv:
            conv = conv + self.conv.bias
        if cache is not None:
            empty = mx.zeros((B, 0), dtype=mx.float32)
            if getattr(cache, "keeps_positions", False) and L > 1:
                # A verified draft: the inputs after each position, for a row's rollback.
                K = self.taps
                start = before if before is not None else mx.zeros((B, K - 1, self.hidden), dtype=gated.dtype)
                window = mx.concatenate([start.astype(gated.dtype), gated], axis=1)
                cache.keep_positions([window[:, j + 1 : j + K] for j in range(L)], [empty] * L)
            cache.update(after, empty, L)
        out: mx.array = self.out_proj(c * conv)
        return out


class LfmBlock(nn.Module):
    """``h = x + post_operator_norm(mixer(operator_norm(x)));
    out = h + post_ffn_norm(feed_forward(ffn_norm(h)))``, the post-norms only with ``sandwich``
    (LFM3's), the mixer under Hugging Face's name (``conv`` or ``self_attn``)."""

    def __init__(
        self, name: str, mixer: nn.Module, feed_forward: nn.Module, hidden: int, eps: float,
        kernels: KernelSet, *, sandwich: bool = False,
    ):  # fmt: skip
        super().__init__()
        setattr(self, name, mixer)
        self.mixer_name = name
        self.feed_forward = feed_forward
        self.operator_norm = RMSNorm(hidden, eps, kernels)
        self.ffn_norm = RMSNorm(hidden, eps, kernels)
        self.sandwich = sandwich
        if sandwich:
            self.post_operator_norm = RMSNorm(hidden, eps, kernels)
            self.post_ffn_norm = RMSNorm(hidden, eps, kernels)

    def make_cache(self) -> Any:
        """The convolution's state, or keys and values (window layers mask, they do not evict)."""
        return self.conv.make_cache() if self.mixer_name == CONV else KVCache()

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: Any) -> mx.array:
        mixed = self[self.mixer_name](self.operator_norm(x), mask, cache)
        if self.sandwich:
            mixed = self.post_operator_norm(mixed)
        h, normed = self.ffn_norm.add_and_norm(mixed, x)
        delta = self.feed_forward(normed)
        if self.sandwich:
            delta = self.post_ffn_norm(delta)
        out: mx.array = h + delta
        return out


@dataclasses.dataclass
class Lfm2Args(TransformerArgs):
    """The keys of ``Lfm2Config`` this graph reads (its defaults); ``full_attn_idxs`` (released
    configs) gives ``layer_types`` where a config has none."""

    family = "lfm2"
    aliases = {"rms_norm_eps": ("norm_eps",), "intermediate_size": ("block_ff_dim",),
               "tie_word_embeddings": ("tie_embedding",)}  # fmt: skip
    limits = {**TransformerArgs.limits, "conv_L_cache": (1, 64), "block_multiple_of": (1, 1 << 20),
              "block_ffn_dim_multiplier": (0.0, 1e3)}  # fmt: skip
    num_key_value_heads: int | None = 8
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 128_000
    tie_word_embeddings: bool = True
    conv_bias: bool = False
    conv_L_cache: int = 3
    block_multiple_of: int = 256
    block_ffn_dim_multiplier: float | None = 1.0
    block_auto_adjust_ff_dim: bool = True
    full_attn_idxs: list[int] | None = None
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            full = self.full_attn_idxs if self.full_attn_idxs is not None else range(self.num_hidden_layers)
            self.layer_types = [FULL if i in full else CONV for i in range(self.num_hidden_layers)]
        check_layer_types(self.layer_types, self.num_hidden_layers, (CONV, FULL), self.family)

    @property
    def feed_forward_size(self) -> int:
        """``intermediate_size``, auto-adjusted as ``Lfm2MLP`` does: two thirds, times the
        multiplier, rounded up to ``block_multiple_of``."""
        size = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            size = int(2 * size / 3)
            if self.block_ffn_dim_multiplier is not None:
                size = int(self.block_ffn_dim_multiplier * size)
                size = self.block_multiple_of * ((size + self.block_multiple_of - 1) // self.block_multiple_of)
        return size


def check_layer_types(layer_types: list[str], count: int, known: tuple[str, ...], family: str) -> None:
    unknown = sorted(set(layer_types) - set(known))
    if unknown or len(layer_types) != count:
        raise ModelLoadError(
            f"the {family} layer_types must name {count} layers, each one of {', '.join(known)} "
            f"(got {len(layer_types)}{': ' + ', '.join(unknown) if unknown else ''})",
            key="layer_types",
        )


def lfm_model(args: TransformerArgs, blocks: list[LfmBlock], kernels: KernelSet) -> CausalLM:
    """Embedding, ``blocks``, the final norm (Hugging Face's ``embedding_norm``) and the head."""
    H = args.hidden_size
    model = DecoderModel(args.vocab_size, H, blocks, RMSNorm(H, args.rms_norm_eps, kernels))
    return CausalLM(model, tied=args.tie_word_embeddings)


def lfm2_blocks(
    args: Lfm2Args, kernels: KernelSet, feed_forward: Callable[[int], nn.Module] | None = None
) -> list[LfmBlock]:
    """A block per ``layer_types`` entry; layer ``i``'s feed-forward is ``feed_forward(i)``
    (default: the SwiGLU of :attr:`Lfm2Args.feed_forward_size`)."""
    rotary = args_rotary(args, kernels, types=("default",))
    H, eps = args.hidden_size, args.rms_norm_eps
    assert args.layer_types is not None

    def mixer(kind: str) -> tuple[str, nn.Module]:
        if kind == CONV:
            return CONV, ShortConv(H, args.conv_L_cache, args.conv_bias)
        return "self_attn", Attention(H, args.num_attention_heads, args.kv_heads, args.dims, kernels=kernels,
                                      rotary=rotary, head_norm_eps=eps)  # fmt: skip

    def dense(layer: int) -> nn.Module:
        return GatedMLP(H, args.feed_forward_size)

    make = feed_forward or dense
    return [LfmBlock(*mixer(kind), make(i), H, eps, kernels) for i, kind in enumerate(args.layer_types)]


def renamed(name: str) -> str:
    """A checkpoint tensor's (or module's) name as the graph's (:data:`RENAMES`)."""
    for old, new in RENAMES:
        name = name.replace(old, new)
    return name


def sanitize_lfm(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Hugging Face's names as the graph's (:data:`RENAMES`), the conv weight in MLX's layout."""
    out: dict[str, mx.array] = {}
    for name, array in weights.items():
        name = renamed(name)
        if name.endswith(".conv.conv.weight") and array.ndim == 3 and array.shape[1] == 1 and array.shape[2] > 1:
            array = array.swapaxes(1, 2)  # [C, 1, K] -> [C, K, 1]
        out[name] = array
    return out


class Lfm2Architecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``lfm2``."""

    args_class: ClassVar[type[TransformerArgs]] = Lfm2Args

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        args = self.args(config)
        return lfm_model(args, lfm2_blocks(args, kernels), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Hugging Face's names and conv layout as the graph's, a tied ``lm_head`` dropped."""
        return super().sanitize(sanitize_lfm(weights), config)

    def sanitized_modules(self, module: str) -> list[str]:
        """A packed module (mlx-lm's quantized folders) under the name :meth:`sanitize` gives it."""
        return [renamed(module + ".")[:-1]]

    def make_cache(self, model: nn.Module) -> list[Any]:
        """The convolution's state per conv layer, keys and values per attention layer."""
        return [layer.make_cache() for layer in model.layers]
