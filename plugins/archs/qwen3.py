"""Qwen3 (dense): Llama's block with an RMS norm over each query and key head before RoPE.

Unlike Qwen2, the projections carry no bias (unless ``attention_bias`` says so, then all four do,
as in Llama), and ``head_dim`` is its own config key (128 by default), not ``hidden_size / heads``.
Weights keep the Hugging Face names (``self_attn.q_norm.weight`` ...); attention, RMS norm and
RoPE go through the bound :class:`KernelSet`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers import (
    Attention,
    CausalLM,
    DecoderArchitecture,
    DecoderModel,
    GatedMLP,
    PreNormBlock,
    RMSNorm,
    args_rotary,
)
from mlxr_plugins.archs.qwen2 import ROPE_TYPES, Qwen2Args


@dataclasses.dataclass
class Qwen3Args(Qwen2Args):
    """Qwen2's config keys with Qwen3's default head size."""

    family = "qwen3"
    head_dim: int | None = 128


def qwen3_attention(args: Qwen3Args, kernels: KernelSet, rotary: Any) -> Attention:
    """Qwen3's attention (dense and MoE): per-head q/k norms, biases only with ``attention_bias``."""
    return Attention(
        args.hidden_size,
        args.num_attention_heads,
        args.kv_heads,
        args.dims,
        kernels=kernels,
        rotary=rotary,
        qkv_bias=args.attention_bias,
        out_bias=args.attention_bias,
        head_norm_eps=args.rms_norm_eps,
    )


class Qwen3(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``; ``rotary`` replaces the
    config's RoPE and ``stack`` the decoder stack's class (Qwen3-VL's M-RoPE and DeepStack)."""

    def __init__(self, args: Qwen3Args, kernels: KernelSet, rotary: Any = None, stack: type[DecoderModel] = DecoderModel):
        rotary = rotary or args_rotary(args, kernels, types=ROPE_TYPES)
        H, eps = args.hidden_size, args.rms_norm_eps
        layers = [
            PreNormBlock(
                qwen3_attention(args, kernels, rotary), GatedMLP(H, args.intermediate_size), H, eps, kernels
            )
            for _ in range(args.num_hidden_layers)
        ]
        model = stack(args.vocab_size, H, layers, RMSNorm(H, eps, kernels))
        super().__init__(model, tied=args.tie_word_embeddings)
        self.args = args


class Qwen3Architecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``qwen3``."""

    args_class = Qwen3Args

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Qwen3(Qwen3Args.from_config(config), kernels)

    def context_length(self, config: dict[str, Any]) -> int:
        """``max_position_embeddings``; a ``sliding_window`` only counts when layers use it."""
        return Qwen3Args.from_config(config).context()
