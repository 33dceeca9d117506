"""gpt-oss (OpenAI's gpt-oss-20b and gpt-oss-120b, text): attention with sinks and biases, sliding
window and full layers alternating, YaRN RoPE, and a sparse mixture of experts with a biased router
and clamped SwiGLU experts in every layer.

- Attention: grouped queries, biases on every projection, ``head_dim ** -0.5`` scaling, and one
  learned logit per head (``self_attn.sinks``) that joins each softmax and takes weight from the
  keys. ``layer_types`` says which layers see only their last ``sliding_window`` positions (by
  default the even ones).
- RoPE: YaRN as ``rope_scaling`` or transformers 5's ``rope_parameters`` give it (``GptOssConfig``'s
  own when neither does: factor 32 over 4096 positions, ``truncate: false``); the rotated features
  are scaled by the attention factor.
- Experts: a router with a bias picks ``num_experts_per_tok`` of ``num_local_experts``, weighted by
  the softmax of their logits; each expert is ``down((up + 1) * gate * sigmoid(alpha * gate))``
  with ``gate`` clamped above and ``up`` on both sides at ``swiglu_limit``, biases on all three.

Hugging Face checkpoints hold the experts stacked ``[experts, in, out]``, gate and up interleaved
in one ``gate_up_proj`` (``mlp.experts.gate_up_proj``, ``..._bias``); MXFP4 ones hold them packed
``[experts, out, in / 2]`` (the safetensors format hands them over as MLX ``mxfp4`` modules
``mlp.experts.gate_up_proj``). ``sanitize`` splits gate from up and names the layers as
:class:`~mlxr_core.model.layers.moe.SparseMoE` does (``mlp.gate``, ``mlp.switch_mlp.gate_proj``),
the names llama.cpp's GGUF files map to; packed experts stay packed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers import (
    Attention,
    CausalLM,
    DecoderArchitecture,
    DecoderModel,
    PreNormBlock,
    RMSNorm,
    SparseMoE,
    TransformerArgs,
    args_rotary,
)

#: ``GptOssConfig``'s rotary embedding when a config names none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
ROPE_TYPES = ("default", "linear", "yarn")


@dataclasses.dataclass
class GptOssArgs(TransformerArgs):
    """gpt-oss's config keys (Hugging Face names), defaulted as in ``GptOssConfig``."""

    family = "gpt_oss"
    mlp_kind = "sparse"
    head_dim: int | None = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150_000.0
    max_position_embeddings: int = 131_072
    sliding_window: int | None = 128
    #: Per layer ``"sliding_attention"`` or ``"full_attention"``; by default the even layers slide.
    layer_types: list[str] | None = None
    attention_bias: bool = True
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GptOssArgs:
        """Build from a config with ``rope_scaling`` and ``rope_theta``, transformers 5's
        ``rope_parameters`` (both in one dict) or neither (``GptOssConfig``'s YaRN)."""
        if config.get("rope_scaling") is None and config.get("rope_parameters") is None:
            config = {**config, "rope_scaling": dict(DEFAULT_ROPE)}
        return super().from_config(config)

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends within the sliding window (else over everything)."""
        if not self.sliding_window:
            return False
        if self.layer_types is not None:
            return self.layer_types[layer] == "sliding_attention"
        return layer % 2 == 0


def clamped_swiglu(alpha: float, limit: float) -> Callable[[mx.array, mx.array], mx.array]:
    """The experts' activation of ``(gate, up)``: ``(up + 1) * gate * sigmoid(alpha * gate)``,
    ``gate`` clamped above at ``limit``, ``up`` to ``[-limit, limit]``; one fused kernel."""

    @partial(mx.compile, shapeless=True)
    def activation(gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
        return (up + 1) * (gate * mx.sigmoid(alpha * gate))

    return activation


class GptOss(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: GptOssArgs, kernels: KernelSet):
        rotary = args_rotary(args, kernels, types=ROPE_TYPES)
        activation = clamped_swiglu(args.swiglu_alpha, args.swiglu_limit)
        H, eps = args.hidden_size, args.rms_norm_eps

        def block(index: int) -> PreNormBlock:
            attention = Attention(
                H,
                args.num_attention_heads,
                args.kv_heads,
                args.dims,
                kernels=kernels,
                rotary=rotary,
                qkv_bias=args.attention_bias,
                out_bias=args.attention_bias,
                window=args.sliding_window if args.is_sliding(index) else None,
                sinks=True,
            )
            moe = SparseMoE(
                H,
                args.intermediate_size,
                args.num_local_experts,
                args.num_experts_per_tok,
                kernels=kernels,
                router_bias=True,
                expert_bias=True,
                activation=activation,
            )
            return PreNormBlock(attention, moe, H, eps, kernels)

        layers = [block(index) for index in range(args.num_hidden_layers)]
        model = DecoderModel(args.vocab_size, H, layers, RMSNorm(H, eps, kernels))
        super().__init__(model, tied=args.tie_word_embeddings)
        self.args = args


#: Expert tensors (after ``mlp.experts.``) -> (the stacked tensors they become, whether the rows
#: interleave gate and up, whether the matrix is Hugging Face's dense ``[experts, in, out]``).
EXPERT_TENSORS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "gate_up_proj": (("gate_proj.weight", "up_proj.weight"), True, True),
    "gate_up_proj_bias": (("gate_proj.bias", "up_proj.bias"), True, False),
    "gate_up_proj.weight": (("gate_proj.weight", "up_proj.weight"), True, False),
    "gate_up_proj.scales": (("gate_proj.scales", "up_proj.scales"), True, False),
    "down_proj": (("down_proj.weight",), False, True),
    "down_proj_bias": (("down_proj.bias",), False, False),
    "down_proj.weight": (("down_proj.weight",), False, False),
    "down_proj.scales": (("down_proj.scales",), False, False),
}
#: llama.cpp's gate and up stacked in one tensor (``ffn_gate_up_exps``): gate rows, then up rows.
FUSED = ".mlp.switch_mlp.gate_up_proj"
ROUTER, GATE = ".mlp.router", ".mlp.gate"


class GptOssArchitecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``gpt_oss``."""

    args_class = GptOssArgs

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return GptOss(GptOssArgs.from_config(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Experts split into gate, up and down stacks ``[experts, out, in]``, the router named
        ``mlp.gate``, llama.cpp's ``attn_sinks.weight`` as ``sinks``; rotary tables dropped."""
        out: dict[str, mx.array] = {}
        for name, array in weights.items():
            layer, found, rest = name.partition(".mlp.experts.")
            module, _, kind = name.rpartition(".")
            if found and rest in EXPERT_TENSORS:
                targets, interleaved, dense = EXPERT_TENSORS[rest]
                if dense:
                    array = array.swapaxes(-1, -2)
                parts = [array[:, 0::2], array[:, 1::2]] if interleaved else [array]
                for target, part in zip(targets, parts, strict=True):
                    out[f"{layer}.mlp.switch_mlp.{target}"] = part
            elif module.endswith(FUSED):
                gate, up = self.sanitized_modules(module)
                out[f"{gate}.{kind}"], out[f"{up}.{kind}"] = mx.split(array, 2, axis=1)
            elif name.endswith(".self_attn.sinks.weight"):
                out[module] = array
            elif module.endswith(ROUTER):
                out[f"{module.removesuffix(ROUTER)}{GATE}.{kind}"] = array
            else:
                out[name] = array
        return super().sanitize(out, config)

    def sanitized_modules(self, module: str) -> list[str]:
        """The modules :meth:`sanitize` makes of checkpoint module ``module``: the loader moves
        a packed module's packing with them."""
        layer, found, rest = module.partition(".mlp.experts.")
        if found and f"{rest}.weight" in EXPERT_TENSORS:
            targets = EXPERT_TENSORS[f"{rest}.weight"][0]
            return [f"{layer}.mlp.switch_mlp.{target.removesuffix('.weight')}" for target in targets]
        if module.endswith(FUSED):
            stem = module.removesuffix("gate_up_proj")
            return [f"{stem}gate_proj", f"{stem}up_proj"]
        if module.endswith(ROUTER):
            return [module.removesuffix(ROUTER) + GATE]
        return [module]

    def kernel_context(self, config: dict[str, Any]) -> dict[str, Any]:
        """The common shapes, and attention sinks (not every attention backend takes them)."""
        return {**super().kernel_context(config), "sinks": True}

    def default_chat_template(self, config: dict[str, Any]) -> str | None:
        """The Harmony format, for checkpoints without a template (GGUF files converted without one)."""
        from mlxr_plugins.parsers.harmony_template import HARMONY_CHAT_TEMPLATE

        return HARMONY_CHAT_TEMPLATE
