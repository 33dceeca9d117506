"""Llama and Mistral: pre-norm decoder, GQA, RoPE, SwiGLU, and Mistral's optional sliding window.

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


class Llama(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: LlamaArgs, kernels: KernelSet):
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
                qkv_bias=args.attention_bias,
                out_bias=args.attention_bias,
                window=args.sliding_window or None,
            )
            mlp = GatedMLP(H, args.intermediate_size, bias=args.mlp_bias)
            return PreNormBlock(attention, mlp, H, eps, kernels)

        layers = [block() for _ in range(args.num_hidden_layers)]
        model = DecoderModel(args.vocab_size, H, layers, RMSNorm(H, eps, kernels))
        super().__init__(model, tied=args.tie_word_embeddings)
        self.args = args


class LlamaArchitecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``llama`` and ``mistral``."""

    args_class = LlamaArgs

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Llama(LlamaArgs.from_config(config), kernels)
