"""Qwen2 (Qwen1.5, Qwen2, Qwen2.5): the Llama graph with biased query/key/value projections.

Everything but the attention's projections is Llama's: pre-norm decoder blocks, GQA, RoPE in the
Hugging Face rotary layout, SwiGLU, optionally tied embeddings. Qwen2 always adds a bias to the
query, key and value projections and never to the output projection. Weights keep the Hugging Face
names; attention, RMS norm and RoPE go through the bound :class:`KernelSet`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_plugins.archs import llama
from mlxr_plugins.archs.llama import LlamaArchitecture, LlamaArgs, Rotary


@dataclasses.dataclass
class Qwen2Args(LlamaArgs):
    """Llama's config keys with Qwen2's defaults, plus its (unmodelled) sliding-window keys."""

    max_position_embeddings: int = 32768
    use_sliding_window: bool = False
    max_window_layers: int = 28
    layer_types: list[str] | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Qwen2Args:
        """Build from a checkpoint config, ignoring keys this graph does not use."""
        args = super().from_config(config)
        assert isinstance(args, Qwen2Args)
        return args

    def sliding_layers(self) -> int:
        """How many layers attend only within ``sliding_window`` (as ``transformers`` decides)."""
        if self.layer_types is not None:
            return sum(kind == "sliding_attention" for kind in self.layer_types)
        if not (self.use_sliding_window and self.sliding_window):
            return 0
        return max(0, self.num_hidden_layers - self.max_window_layers)


class Attention(llama.Attention):
    """Llama attention with biases on q/k/v and none on the output projection."""

    def __init__(self, args: LlamaArgs, kernels: KernelSet, rotary: Rotary):
        super().__init__(dataclasses.replace(args, attention_bias=True), kernels, rotary)
        assert args.head_dim is not None
        D = args.head_dim
        self.o_proj = nn.Linear(args.num_attention_heads * D, args.hidden_size, bias=False)


class Qwen2(llama.Llama):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``: Llama with Qwen2 attention."""

    def __init__(self, args: Qwen2Args, kernels: KernelSet):
        super().__init__(args, kernels)
        rotary = Rotary(args, kernels)
        # Swapping the module is all that differs; the Llama attention it replaces never had its
        # (lazy) random weights evaluated, so this costs nothing.
        for layer in self.layers:
            layer.self_attn = Attention(args, kernels, rotary)


def sliding_window_context(args: Qwen2Args) -> int:
    """``max_position_embeddings``, capped at the sliding window when some layer uses one: this
    graph attends over everything, which matches the model only within the window."""
    if args.sliding_layers() and args.sliding_window:
        return min(args.max_position_embeddings, args.sliding_window)
    return args.max_position_embeddings


class Qwen2Architecture(LlamaArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``qwen2``; ``sanitize``, ``make_cache``
    and ``kernel_context`` are Llama's."""

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Qwen2(Qwen2Args.from_config(config), kernels)

    def context_length(self, config: dict[str, Any]) -> int:
        """``max_position_embeddings``; a ``sliding_window`` only counts when layers use it."""
        return sliding_window_context(Qwen2Args.from_config(config))
