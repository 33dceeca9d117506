"""Qwen2 (Qwen1.5, Qwen2, Qwen2.5): Llama's block with biased query/key/value projections.

Pre-norm decoder blocks, GQA, RoPE in the Hugging Face rotary layout, SwiGLU, optionally tied
embeddings. Qwen2 always adds a bias to the query, key and value projections and never to the
output projection. Weights keep the Hugging Face names; attention, RMS norm and RoPE go through
the bound :class:`KernelSet`.
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
    TransformerArgs,
    args_rotary,
)

#: The ``rope_scaling`` types Qwen checkpoints use (YaRN for long contexts).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass
class Qwen2Args(TransformerArgs):
    """The common keys with Qwen2's defaults, plus its (unmodelled) sliding-window keys."""

    family = "qwen2"
    max_position_embeddings: int = 32768
    use_sliding_window: bool = False
    max_window_layers: int = 28
    layer_types: list[str] | None = None

    def sliding_layers(self) -> int:
        """How many layers attend only within ``sliding_window`` (as ``transformers`` decides)."""
        if self.layer_types is not None:
            return sum(kind == "sliding_attention" for kind in self.layer_types)
        if not (self.use_sliding_window and self.sliding_window):
            return 0
        return max(0, self.num_hidden_layers - self.max_window_layers)

    def context(self) -> int:
        """``max_position_embeddings``, capped at the sliding window when some layer uses one:
        these graphs attend over everything, which matches the model only within the window."""
        if self.sliding_layers() and self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


class Qwen2(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``; ``rotary`` replaces the
    config's RoPE (Qwen2.5-VL's M-RoPE)."""

    def __init__(self, args: Qwen2Args, kernels: KernelSet, rotary: Any = None):
        rotary = rotary or args_rotary(args, kernels, types=ROPE_TYPES)
        H, eps = args.hidden_size, args.rms_norm_eps

        def block() -> PreNormBlock:
            attention = Attention(
                H,
                args.num_attention_heads,
                args.kv_heads,
                args.dims,
                kernels=kernels,
                rotary=rotary,
                qkv_bias=True,
                out_bias=False,
            )
            return PreNormBlock(attention, GatedMLP(H, args.intermediate_size), H, eps, kernels)

        layers = [block() for _ in range(args.num_hidden_layers)]
        model = DecoderModel(args.vocab_size, H, layers, RMSNorm(H, eps, kernels))
        super().__init__(model, tied=args.tie_word_embeddings)
        self.args = args


class Qwen2Architecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``qwen2``."""

    args_class = Qwen2Args

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Qwen2(Qwen2Args.from_config(config), kernels)

    def context_length(self, config: dict[str, Any]) -> int:
        """``max_position_embeddings``; a ``sliding_window`` only counts when layers use it."""
        return Qwen2Args.from_config(config).context()
