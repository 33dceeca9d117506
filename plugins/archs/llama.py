"""Llama, Mistral and Ministral: pre-norm decoder, GQA, RoPE, SwiGLU, and Mistral's optional
sliding window (Ministral's only in the layers ``layer_types`` names ``sliding_attention``).

Weights use the Hugging Face names (``model.layers.N.self_attn.q_proj.weight`` ...) and the Hugging
Face rotary layout (feature ``i`` pairs with ``i + head_dim / 2``); format plugins hand weights
over in that layout. Attention, RMS norm and RoPE go through the bound :class:`KernelSet`. With a
``sliding_window`` every layer attends to its last ``sliding_window`` positions, through the same
full caches and window masks as Gemma 3's window layers (see :mod:`mlxr_core.model.masks`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
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

#: The ``rope_scaling`` types Llama checkpoints use.
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass
class LlamaArgs(TransformerArgs):
    """The config keys this graph reads (Hugging Face names); every other key is ignored."""

    family = "llama"

    def window(self, layer: int) -> int | None:
        """The positions layer ``layer`` attends back over, or None: all of them."""
        return self.sliding_window or None


@dataclasses.dataclass
class MinistralArgs(LlamaArgs):
    """Ministral (2024): Mistral's window in the layers ``layer_types`` names sliding."""

    family = "ministral"
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        kinds = self.layer_types
        if kinds is not None and (
            len(kinds) != self.num_hidden_layers or not set(kinds) <= {"sliding_attention", "full_attention"}
        ):
            raise ModelLoadError(
                f"the ministral graph takes one of sliding_attention, full_attention per layer "
                f"({self.num_hidden_layers}), not {kinds!r:.120}", key="layer_types",
            )

    def window(self, layer: int) -> int | None:
        sliding = self.layer_types is None or self.layer_types[layer] == "sliding_attention"
        return (self.sliding_window or None) if sliding else None


class Llama(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: LlamaArgs, kernels: KernelSet):
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
                qkv_bias=args.attention_bias,
                out_bias=args.attention_bias,
                window=args.window(layer),
            )
            mlp = GatedMLP(H, args.intermediate_size, bias=args.mlp_bias)
            return PreNormBlock(attention, mlp, H, eps, kernels)

        layers = [block(layer) for layer in range(args.num_hidden_layers)]
        model = DecoderModel(args.vocab_size, H, layers, RMSNorm(H, eps, kernels))
        super().__init__(model, tied=args.tie_word_embeddings)
        self.args = args


class LlamaArchitecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``llama`` and ``mistral``."""

    args_class = LlamaArgs

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Llama(self.args(config), kernels)


class MinistralArchitecture(LlamaArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``ministral``."""

    args_class = MinistralArgs

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Llama(self.args(config), kernels)
