"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): Qwen3's attention, sparse experts.

Attention is Qwen3's (per-head q/k RMS norms, no biases). The feed-forward layer of every
``decoder_sparse_step``-th layer not listed in ``mlp_only_layers`` is a mixture of
``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, ``num_experts_per_tok`` chosen
per token by a softmax router (renormalized when ``norm_topk_prob``); the rest are dense MLPs.

Hugging Face checkpoints hold each expert's projections (``mlp.experts.E.gate_proj.weight``);
``sanitize`` stacks them as :class:`~mlxr_core.model.layers.moe.SwitchGLU` holds them
(``mlp.switch_mlp.gate_proj.weight``, mlx-lm's layout, which loads as it is).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers import (
    CausalLM,
    DecoderArchitecture,
    DecoderModel,
    GatedMLP,
    PreNormBlock,
    RMSNorm,
    SparseMoE,
    TransformerArgs,
    args_rotary,
    stack_experts,
)
from mlxr_plugins.archs.qwen2 import ROPE_TYPES
from mlxr_plugins.archs.qwen3 import Qwen3Args, qwen3_attention

#: Hugging Face's per-expert projection names -> the stacked ones.
EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


class SparseLayers(TransformerArgs):
    """Qwen's rule for which layers are sparse, over the config keys its MoE families share (a
    base of their config classes, before the family's own)."""

    num_experts: int
    decoder_sparse_step: int
    mlp_only_layers: list[int]

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s feed-forward is the mixture of experts (else a dense MLP)."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def layer_pattern(self, key: str) -> list[str] | None:
        """``mlp_layer_types`` by :meth:`is_sparse`, which a config's own list must agree with."""
        if key == "mlp_layer_types":
            return ["sparse" if self.is_sparse(i) else "dense" for i in range(self.num_hidden_layers)]
        return super().layer_pattern(key)


def qwen_feed_forward(args: Any, layer: int, kernels: KernelSet, shared: int | None = None) -> nn.Module:
    """The feed-forward of ``layer`` in Qwen's MoE families: a dense gated MLP where
    :meth:`SparseLayers.is_sparse` says so, else ``num_experts`` SwiGLU experts (softmax router,
    renormalized with ``norm_topk_prob``) and, with ``shared``, a shared expert of that width
    behind a sigmoid gate."""
    H = args.hidden_size
    if not args.is_sparse(layer):
        return GatedMLP(H, args.intermediate_size)
    return SparseMoE(
        H,
        args.moe_intermediate_size,
        args.num_experts,
        args.num_experts_per_tok,
        kernels=kernels,
        normalize=args.norm_topk_prob,
        shared_expert=GatedMLP(H, shared) if shared else None,
        shared_gate=bool(shared),
    )


@dataclasses.dataclass
class Qwen3MoeArgs(Qwen3Args, SparseLayers):
    """Qwen3's keys plus the experts' (defaults as in ``Qwen3MoeConfig``, which has no
    ``head_dim``: without one in the config, heads are ``hidden_size / num_attention_heads``)."""

    family = "qwen3_moe"
    head_dim: int | None = None
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)


class Qwen3Moe(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: Qwen3MoeArgs, kernels: KernelSet):
        rotary = args_rotary(args, kernels, types=ROPE_TYPES)
        H, eps = args.hidden_size, args.rms_norm_eps
        layers = [
            PreNormBlock(qwen3_attention(args, kernels, rotary), qwen_feed_forward(args, index, kernels), H, eps, kernels)
            for index in range(args.num_hidden_layers)
        ]
        model = DecoderModel(args.vocab_size, H, layers, RMSNorm(H, eps, kernels))
        super().__init__(model, tied=args.tie_word_embeddings)
        self.args = args


class Qwen3MoeArchitecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``qwen3_moe``."""

    args_class = Qwen3MoeArgs

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Qwen3Moe(Qwen3MoeArgs.from_config(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Per-expert tensors stacked; rotary tables and a tied ``lm_head`` dropped."""
        count = Qwen3MoeArgs.from_config(config).num_experts
        stacked = stack_experts(weights, "mlp.experts", "mlp.switch_mlp", EXPERT_NAMES, count)
        return super().sanitize(stacked, config)

    def context_length(self, config: dict[str, Any]) -> int:
        """``max_position_embeddings``; a ``sliding_window`` only counts when layers use it."""
        return Qwen3MoeArgs.from_config(config).context()
