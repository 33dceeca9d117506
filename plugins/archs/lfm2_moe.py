"""LFM2-MoE (Liquid AI): LFM2 (:mod:`mlxr_plugins.archs.lfm2`) with sparse experts after the
first ``num_dense_layers`` layers.

The router scores each expert by ``sigmoid(gate(h))``; with ``use_expert_bias`` the choice of
the ``num_experts_per_tok`` experts is made on the scores plus ``expert_bias`` (the weights stay
the unbiased scores), which ``norm_topk_prob`` rescales to sum to 1, then
``routed_scaling_factor`` multiplies. The dense layers' SwiGLU has ``intermediate_size`` (no
auto-adjustment, unlike LFM2's). Hugging Face's per-expert ``w1``, ``w3``, ``w2`` (or
transformers' fused ``gate_up_proj``, ``down_proj``) are stacked as ``switch_mlp``'s
``gate_proj``, ``up_proj``, ``down_proj``.
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

class BiasedSigmoidMoE(SparseMoE):
    """:class:`SparseMoE` with a sigmoid router whose choice adds ``expert_bias`` (a vector beside
    the ``gate`` linear layer, as both the checkpoint and mlx-lm's folders hold it, so that a
    packed ``gate`` loads packed)."""

    def __init__(self, *args: Any, expert_bias: bool, **kwargs: Any):
        super().__init__(*args, scoring="sigmoid", **kwargs)
        if expert_bias:
            self.expert_bias = mx.zeros((self.switch_mlp.experts,))

    def choose(self, x: mx.array) -> tuple[mx.array, mx.array]:
        extra = {"bias": self.expert_bias} if "expert_bias" in self else {}
        indices, weights = self._route(self.gate(x), top_k=self.top_k, scoring="sigmoid", normalize=self.normalize,
                                       **extra)  # fmt: skip
        return indices, weights * self.scale if self.scale != 1.0 else weights


def lfm2_moe_blocks(args: Lfm2MoeArgs, kernels: KernelSet) -> list[LfmBlock]:
    """LFM2's blocks, each past the first ``num_dense_layers`` with sparse experts."""

    def feed_forward(layer: int) -> nn.Module:
        if layer < args.num_dense_layers:
            return GatedMLP(args.hidden_size, args.intermediate_size)
        return BiasedSigmoidMoE(
            args.hidden_size, args.moe_intermediate_size, args.num_experts, args.num_experts_per_tok,
            kernels=kernels, normalize=args.norm_topk_prob, expert_bias=args.use_expert_bias,
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
        """LFM2's names, experts stacked."""
        args = self.args(config)
        weights = split_fused_experts(weights, "feed_forward.experts", "feed_forward.switch_mlp")
        weights = stack_experts(weights, "feed_forward.experts", "feed_forward.switch_mlp", EXPERT_NAMES,
                                args.num_experts)  # fmt: skip
        return super().sanitize(weights, config)

