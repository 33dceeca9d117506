"""Gemma 3 (text): interleaved sliding-window and global attention, QK norm, GeGLU, four norms per
block, embeddings scaled by ``sqrt(hidden_size)``, per-layer RoPE bases, tied embeddings.

Weights use the Hugging Face names (``model.layers.N.pre_feedforward_layernorm.weight`` ...). RMS
norms hold ``w`` and scale by ``1 + w``, as in Hugging Face checkpoints; the GGUF format plugin
subtracts the 1 that llama.cpp's converter adds, so one graph serves both. Sliding-window layers
use ordinary caches and a window mask (see :mod:`mlxr_core.model.masks` for why).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers import (
    Attention,
    CausalLM,
    DecoderArchitecture,
    DecoderModel,
    GatedMLP,
    RMSNorm,
    SandwichBlock,
    TransformerArgs,
    args_rotary,
    geglu,
)
from mlxr_core.model.vision import VisionArchitecture

#: Hugging Face's default ``sliding_window_pattern``: every 6th layer attends globally.
GLOBAL_EVERY = 6
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: transformers' names of the activation Gemma's GeGLU computes.
GEGLU = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")


@dataclasses.dataclass
class Gemma3Args(TransformerArgs):
    """Gemma 3's config keys (Hugging Face names), defaulted as in ``Gemma3TextConfig``."""

    family = "gemma3"
    computes = {**TransformerArgs.computes, "hidden_act": GEGLU}
    head_dim: int | None = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    max_position_embeddings: int = 131_072
    sliding_window: int | None = 4096
    sliding_window_pattern: int = GLOBAL_EVERY
    #: Per layer ``"sliding_attention"`` or ``"full_attention"``; overrides the pattern when set.
    layer_types: list[str] | None = None
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attn_logit_softcapping:
            # The attention kernels compute softmax(q k^T) with no cap; Gemma 2 used one, Gemma 3 does not.
            raise ModelLoadError("attn_logit_softcapping is not supported by the gemma3 graph")
        if self.hidden_activation not in GEGLU:
            raise ModelLoadError(f"hidden_activation {self.hidden_activation!r} is not GeGLU")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Gemma3Args:
        """Build from a ``gemma3_text`` config, or a multimodal ``gemma3`` one's ``text_config``
        (transformers 5's per-layer-type ``rope_parameters`` give ``rope_theta``, ``rope_scaling``
        and ``rope_local_base_freq``: :mod:`~mlxr_core.model.layers.config_eras`)."""
        return super().from_config({**config, **config.get("text_config", {})})

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends within the sliding window (else over everything)."""
        if self.sliding_window is None:
            return False
        if self.layer_types is not None:
            return self.layer_types[layer] == "sliding_attention"
        return (layer + 1) % self.sliding_window_pattern != 0


class Gemma3(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``, logits soft-capped when the
    config says so."""

    def __init__(self, args: Gemma3Args, kernels: KernelSet):
        # Global layers: rope_theta and any rope_scaling; sliding ones: the local base, unscaled.
        global_rotary = args_rotary(args, kernels, types=ROPE_TYPES)
        local_rotary = args_rotary(
            args, kernels, base=args.rope_local_base_freq, scaling=None, freq_factors=None
        )
        H, eps = args.hidden_size, args.rms_norm_eps

        def block(index: int) -> SandwichBlock:
            sliding = args.is_sliding(index)
            attention = Attention(
                H,
                args.num_attention_heads,
                args.kv_heads,
                args.dims,
                kernels=kernels,
                rotary=local_rotary if sliding else global_rotary,
                scale=args.query_pre_attn_scalar**-0.5,
                qkv_bias=args.attention_bias,
                out_bias=args.attention_bias,
                head_norm_eps=eps,
                norm_offset=1.0,
                window=args.sliding_window if sliding else None,
            )
            mlp = GatedMLP(H, args.intermediate_size, activation=geglu)
            return SandwichBlock(attention, mlp, H, eps, kernels, norm_offset=1.0)

        layers = [block(index) for index in range(args.num_hidden_layers)]
        model = DecoderModel(
            args.vocab_size, H, layers, RMSNorm(H, eps, kernels, offset=1.0), math.sqrt(H)
        )
        super().__init__(model, tied=args.tie_word_embeddings, softcap=args.final_logit_softcapping)
        self.args = args


#: Gemma's turn format, as in the instruction-tuned checkpoints' ``tokenizer_config.json`` (text
#: parts only): a system message is prefixed to the first user turn, ``assistant`` is ``model``,
#: every turn ends with ``<end_of_turn>`` (a control token, so it ends generation).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

#: Prefixes of the multimodal ``gemma3`` checkpoints' language model -> the text model's names
#: (transformers < 4.52 and >= 4.52 layouts).
MULTIMODAL_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
}
#: The image tower and projector of multimodal checkpoints, loaded apart (see ``vision``).
VISION_PARTS = ("vision_tower", "multi_modal_projector")


class Gemma3Architecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``gemma3_text`` and ``gemma3``, whose
    vision side :meth:`vision` gives (:class:`mlxr_core.model.vision.ProvidesVision`)."""

    args_class = Gemma3Args

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Gemma3(Gemma3Args.from_config(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Text-model names for multimodal checkpoints; drop the vision tower, rotary tables and,
        with tied embeddings, a redundant ``lm_head``."""
        tied = Gemma3Args.from_config(config).tie_word_embeddings
        out = {}
        for name, array in weights.items():
            if any(part in name for part in VISION_PARTS) or "rotary_emb.inv_freq" in name:
                continue
            for prefix, replacement in MULTIMODAL_PREFIXES.items():
                if name.startswith(prefix):
                    name = replacement + name.removeprefix(prefix)
                    break
            if tied and name.startswith("lm_head."):
                continue
            out[name] = array
        return out

    def vision(self, config: dict[str, Any]) -> VisionArchitecture | None:
        """The SigLIP tower and projector of a multimodal ``gemma3`` checkpoint; None for text."""
        if not config.get("vision_config"):
            return None
        from mlxr_plugins.archs.gemma3_vision import Gemma3VisionArchitecture

        return Gemma3VisionArchitecture()

    def default_chat_template(self, config: dict[str, Any]) -> str | None:
        """Gemma's turn format, for checkpoints without a template (the 270M GGUF's base model)."""
        return CHAT_TEMPLATE
