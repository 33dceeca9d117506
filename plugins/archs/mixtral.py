"""Mixtral (8x7B, 8x22B): Mistral's attention (an optional sliding window on every layer) and a
sparse mixture of SwiGLU experts in every layer, top-``num_experts_per_tok`` of
``num_local_experts`` per token, their softmax weights renormalized.

Hugging Face checkpoints name the layer ``block_sparse_moe`` and each expert's projections
``w1`` (gate), ``w3`` (up) and ``w2`` (down); ``sanitize`` renames and stacks them
(``mlp.switch_mlp.gate_proj.weight``). mlx-lm folders (``block_sparse_moe.switch_mlp``) load too.
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
    SparseMoE,
    TransformerArgs,
    args_rotary,
    stack_experts,
)

#: Hugging Face's per-expert projections -> the stacked ones.
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
#: ... and as older llama.cpp Mixtral files name them (one tensor per expert).
EXPERT_NAMES |= {name: name for name in EXPERT_NAMES.values()}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass
class MixtralArgs(TransformerArgs):
    """The common keys plus the experts' (defaults as in ``MixtralConfig``)."""

    family = "mixtral"
    mlp_kind = "sparse"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    num_local_experts: int = 8
    num_experts_per_tok: int = 2


class Mixtral(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: MixtralArgs, kernels: KernelSet):
        rotary = args_rotary(args, kernels, types=ROPE_TYPES)
        H, eps = args.hidden_size, args.rms_norm_eps

        def block() -> PreNormBlock:
            attention = Attention(
                H,
                args.num_attention_heads,
                args.kv_heads,
                args.dims,
                kernels=kernels,
                rotary=rotary,
                window=args.sliding_window or None,
            )
            moe = SparseMoE(
                H, args.intermediate_size, args.num_local_experts, args.num_experts_per_tok, kernels=kernels
            )
            return PreNormBlock(attention, moe, H, eps, kernels)

        layers = [block() for _ in range(args.num_hidden_layers)]
        model = DecoderModel(args.vocab_size, H, layers, RMSNorm(H, eps, kernels))
        super().__init__(model, tied=args.tie_word_embeddings)
        self.args = args


class MixtralArchitecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``mixtral``."""

    args_class = MixtralArgs

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Mixtral(MixtralArgs.from_config(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """``block_sparse_moe`` -> ``mlp``, per-expert ``w1``/``w3``/``w2`` stacked; rotary tables
        and a tied ``lm_head`` dropped."""
        renamed = {name.replace(".block_sparse_moe.", ".mlp."): array for name, array in weights.items()}
        count = MixtralArgs.from_config(config).num_local_experts
        stacked = stack_experts(renamed, "mlp.experts", "mlp.switch_mlp", EXPERT_NAMES, count)
        return super().sanitize(stacked, config)
