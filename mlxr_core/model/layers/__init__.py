"""The building blocks of the built-in architectures: config classes, norms, rotary embeddings,
cached attention (and multi-head latent attention), gated MLPs, mixtures of experts, decoder
blocks and the causal LM on top.

An architecture file composes them (its config, its attention, its MLP or MoE, its block, its
model) and reads top to bottom; third-party architectures may use them too.
"""

from mlxr_core.model.layers.args import ConfigArgs, TransformerArgs
from mlxr_core.model.layers.attention import Attention
from mlxr_core.model.layers.block import AttentionBlock, ParallelBlock, PreNormBlock, SandwichBlock
from mlxr_core.model.layers.family import DecoderArchitecture
from mlxr_core.model.layers.latent_attention import LatentAttention
from mlxr_core.model.layers.mlp import GATED_ACTIVATIONS, GatedMLP, geglu
from mlxr_core.model.layers.model import CausalLM, DecoderModel
from mlxr_core.model.layers.moe import (
    SparseMoE,
    SwitchGLU,
    SwitchLinear,
    route,
    stack_experts,
    weighted_sum,
)
from mlxr_core.model.layers.norms import LayerNorm, RMSNorm
from mlxr_core.model.layers.rope import Rotary, args_rotary, base_freqs, make_rotary, rope_type

__all__ = [
    "GATED_ACTIVATIONS",
    "Attention",
    "AttentionBlock",
    "CausalLM",
    "ConfigArgs",
    "DecoderArchitecture",
    "DecoderModel",
    "GatedMLP",
    "LatentAttention",
    "LayerNorm",
    "ParallelBlock",
    "PreNormBlock",
    "RMSNorm",
    "Rotary",
    "SandwichBlock",
    "SparseMoE",
    "SwitchGLU",
    "SwitchLinear",
    "TransformerArgs",
    "args_rotary",
    "base_freqs",
    "geglu",
    "make_rotary",
    "rope_type",
    "route",
    "stack_experts",
    "weighted_sum",
]
