"""LFM2-MoE (Liquid AI): LFM2 (:mod:`mlxr_plugins.archs.lfm2`) with sparse experts after the
first ``num_dense_layers`` layers.

The router scores each expert by ``sigmoid(gate(h))``; with ``use_expert_bias`` the choice of
the ``num_experts_per_tok`` experts is made on the scores plus ``expert_bias`` (the weights stay
the unbiased scores), which ``norm_topk_prob`` rescales to sum to 1, then
``routed_scaling_factor`` multiplies. The dense layers' SwiGLU has ``intermediate_size`` (no
auto-adjustment, unlike LFM2's). Hugging Face's per-expert ``w1``, ``w3``, ``w2`` (or
transformers' fused ``gate_up_proj``, ``down_proj``) are stacked as ``switch_mlp``'s
``gate_proj``, ``up_proj``, ``down_proj``; ``expert_bias`` is read as the router's
``e_score_correction_bias``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers import GatedMLP, SparseMoE, stack_experts
from mlxr_core.model.layers.moe import split_fused_experts
from mlxr_plugins.archs.lfm2 import Lfm2Architecture, Lfm2Args, LfmBlock, lfm2_blocks, lfm_model

EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclasses.dataclass
class Lfm2MoeArgs(Lfm2Args):
    """The keys of ``Lfm2MoeConfig`` this graph reads (its defaults)."""

    family = "lfm2_moe"
    limits = {**Lfm2Args.limits, "num_dense_layers": (0, 1 << 12)}
    moe_intermediate_size: int = 1792
    num_dense_layers: int = 2
    num_experts: int = 32
    num_experts_per_tok: int = 4
    use_expert_bias: bool = True
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True

def lfm2_moe_blocks(args: Lfm2MoeArgs, kernels: KernelSet) -> list[LfmBlock]:
    """LFM2's blocks, each past the first ``num_dense_layers`` with sparse experts."""

    def feed_forward(layer: int) -> nn.Module:
        if layer < args.num_dense_layers:
            return GatedMLP(args.hidden_size, args.intermediate_size)
        return SparseMoE(
            args.hidden_size, args.moe_intermediate_size, args.num_experts, args.num_experts_per_tok,
            kernels=kernels, scoring="sigmoid", normalize=args.norm_topk_prob, corrected=args.use_expert_bias,
            scale=args.routed_scaling_factor,
        )  # fmt: skip

    return lfm2_blocks(args, kernels, feed_forward)


class Lfm2MoeArchitecture(Lfm2Architecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``lfm2_moe``."""

    args_class = Lfm2MoeArgs

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        args = self.args(config)
        return lfm_model(args, lfm2_moe_blocks(args, kernels), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """LFM2's names, experts stacked, ``expert_bias`` as the router's."""
        args = self.args(config)
        weights = {
            name.replace(".feed_forward.expert_bias", ".feed_forward.gate.e_score_correction_bias"): array
            for name, array in weights.items()
        }
        weights = split_fused_experts(weights, "feed_forward.experts", "feed_forward.switch_mlp")
        weights = stack_experts(weights, "feed_forward.experts", "feed_forward.switch_mlp", EXPERT_NAMES,
                                args.num_experts)  # fmt: skip
        return super().sanitize(weights, config)

