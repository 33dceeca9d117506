"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention, sparse experts plus a
shared expert.

Attention is Qwen2's (biased q/k/v when ``qkv_bias``, the default). Each sparse layer's
feed-forward is a softmax router over ``num_experts`` SwiGLU experts (``num_experts_per_tok`` per
token, renormalized only when ``norm_topk_prob``) plus a shared SwiGLU expert of width
``shared_expert_intermediate_size`` run on every token and scaled by
``sigmoid(shared_expert_gate(x))``. Per-expert tensors are stacked by ``sanitize``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers import (
    Attention,
    CausalLM,
    DecoderArchitecture,
    DecoderModel,
    PreNormBlock,
    RMSNorm,
    args_rotary,
    stack_experts,
)
from mlxr_plugins.archs.qwen2 import ROPE_TYPES, Qwen2Args
from mlxr_plugins.archs.qwen3_moe import EXPERT_NAMES, SparseLayers, qwen_feed_forward


@dataclasses.dataclass
class Qwen2MoeArgs(Qwen2Args, SparseLayers):
    """Qwen2's keys plus the experts' (defaults as in ``Qwen2MoeConfig``)."""

    family = "qwen2_moe"
    qkv_bias: bool = True
    num_experts: int = 60
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)


class Qwen2Moe(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: Qwen2MoeArgs, kernels: KernelSet):
        rotary = args_rotary(args, kernels, types=ROPE_TYPES)
        H, eps = args.hidden_size, args.rms_norm_eps

        def block(layer: int) -> PreNormBlock:
            attention = Attention(
                H,
                args.num_attention_heads,
                args.kv_heads,
                args.dims,
                kernels=kernels,
                rotary=rotary,
                qkv_bias=args.qkv_bias,
            )
            shared = args.shared_expert_intermediate_size
            return PreNormBlock(attention, qwen_feed_forward(args, layer, kernels, shared), H, eps, kernels)

        layers = [block(index) for index in range(args.num_hidden_layers)]
        model = DecoderModel(args.vocab_size, H, layers, RMSNorm(H, eps, kernels))
        super().__init__(model, tied=args.tie_word_embeddings)
        self.args = args


class Qwen2MoeArchitecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``qwen2_moe``."""

    args_class = Qwen2MoeArgs

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Qwen2Moe(Qwen2MoeArgs.from_config(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Per-expert tensors stacked; the shared expert's gate as a ``[1, hidden]`` matrix
        (llama.cpp stores it as a vector); rotary tables and a tied ``lm_head`` dropped."""
        weights = {
            name: array[None] if name.endswith("shared_expert_gate.weight") and array.ndim == 1 else array
            for name, array in weights.items()
        }
        count = Qwen2MoeArgs.from_config(config).num_experts
        stacked = stack_experts(weights, "mlp.experts", "mlp.switch_mlp", EXPERT_NAMES, count)
        return super().sanitize(stacked, config)

    def context_length(self, config: dict[str, Any]) -> int:
        """``max_position_embeddings``; a ``sliding_window`` only counts when layers use it."""
        return Qwen2MoeArgs.from_config(config).context()
