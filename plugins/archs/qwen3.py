"""Qwen3 (dense): the Llama graph with an RMS norm over each query and key head before RoPE.

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
from mlxr_plugins.archs import llama
from mlxr_plugins.archs.llama import LlamaArgs, RMSNorm, Rotary
from mlxr_plugins.archs.qwen2 import Qwen2Architecture, Qwen2Args, sliding_window_context


@dataclasses.dataclass
class Qwen3Args(Qwen2Args):
    """Qwen2's config keys with Qwen3's default head size."""

    head_dim: int | None = 128


class Attention(llama.HeadNormedAttention, llama.Attention):
    """Llama attention whose queries and keys are RMS-normalized per head, before RoPE."""

    def __init__(self, args: LlamaArgs, kernels: KernelSet, rotary: Rotary):
        super().__init__(args, kernels, rotary)
        assert args.head_dim is not None
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, kernels)
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, kernels)


class Qwen3(llama.Llama):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``: Llama with Qwen3 attention."""

    def __init__(self, args: Qwen2Args, kernels: KernelSet):
        super().__init__(args, kernels)
        rotary = Rotary(args, kernels)
        # As in Qwen2: the replaced Llama attention's lazy weights are never evaluated.
        for layer in self.layers:
            layer.self_attn = Attention(args, kernels, rotary)


class Qwen3Architecture(Qwen2Architecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``qwen3``."""

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Qwen3(Qwen3Args.from_config(config), kernels)

    def context_length(self, config: dict[str, Any]) -> int:
        """``max_position_embeddings``; a ``sliding_window`` only counts when layers use it."""
        return sliding_window_context(Qwen3Args.from_config(config))

    def kernel_context(self, config: dict[str, Any]) -> dict[str, Any]:
        """Llama's shapes, with Qwen3's default ``head_dim`` when the config has none."""
        return super().kernel_context({"head_dim": 128, **config})
