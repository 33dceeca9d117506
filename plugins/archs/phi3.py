"""Phi-3 (and Phi-3.5, Phi-4-mini): Llama's block with fused projections and LongRoPE.

What differs from Llama: queries, keys and values come from one matrix (``qkv_proj``) and the
gate and up projections from another (``gate_up_proj``, gate first), as in the Hugging Face
checkpoints and in llama.cpp's ``attn_qkv`` / ``ffn_up``; the rotary embedding may cover only part
of each head (``partial_rotary_factor``) and may be LongRoPE-scaled (``rope_scaling`` of type
``longrope``, or ``su`` in older configs); a ``sliding_window``, when set, limits every layer.

LongRoPE has two sets of frequency factors: transformers uses the short ones while a sequence is
within ``original_max_position_embeddings`` and switches the whole sequence to the long ones past
it, re-encoding every cached key. A KV cache cannot follow that switch, so this graph uses the short
factors (exactly transformers' behaviour within that length) and reports that length as the
model's context.
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
    rope_type,
)

#: ``rope_scaling`` types of this graph: plain, linear and LongRoPE (``su`` is its older name).
ROPE_TYPES = ("default", "linear", "longrope", "su")
LONGROPE = ("longrope", "su")
#: Activations of the gated MLP this graph computes (SwiGLU).
ACTIVATIONS = ("silu", "swish")


@dataclasses.dataclass
class Phi3Args(TransformerArgs):
    """The common keys with Phi-3's defaults, plus its LongRoPE and activation keys."""

    family = "phi3"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int | None = None
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"phi3: hidden_act {self.hidden_act!r} is not supported (silu)")
        if self.attention_bias or self.mlp_bias:
            raise ModelLoadError("phi3: biased projections are not supported")

    @property
    def longrope_original(self) -> int:
        """The pre-training length LongRoPE extends (the context this graph serves with it)."""
        scaling = self.rope_scaling or {}
        original = scaling.get("original_max_position_embeddings")
        return int(original or self.original_max_position_embeddings or self.max_position_embeddings)


class Phi3(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: Phi3Args, kernels: KernelSet):
        rotary = args_rotary(
            args, kernels, types=ROPE_TYPES, original_max_positions=args.longrope_original
        )
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
                fused_qkv=True,
            )
            mlp = GatedMLP(H, args.intermediate_size, fused=True)
            return PreNormBlock(attention, mlp, H, eps, kernels)

        layers = [block() for _ in range(args.num_hidden_layers)]
        model = DecoderModel(args.vocab_size, H, layers, RMSNorm(H, eps, kernels))
        super().__init__(model, tied=args.tie_word_embeddings)
        self.args = args


class Phi3Architecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``phi3``."""

    args_class = Phi3Args

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Phi3(Phi3Args.from_config(config), kernels)

    def context_length(self, config: dict[str, Any]) -> int:
        """``max_position_embeddings``, or with LongRoPE the length its short factors serve."""
        args = Phi3Args.from_config(config)
        if rope_type(args.rope_scaling) in LONGROPE:
            return min(args.max_position_embeddings, args.longrope_original)
        return args.max_position_embeddings
