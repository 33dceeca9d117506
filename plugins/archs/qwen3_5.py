"""Qwen3.5 (dense ``qwen3_5`` and sparse ``qwen3_5_moe``): Qwen3-Next's hybrid, the text model.

The layers are Qwen3-Next's (:mod:`mlxr_plugins.archs.qwen3_next`: Gated DeltaNet and gated
attention by ``layer_types``, norms scaling by ``1 + weight``) with two differences: DeltaNet's
projections are separate (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), and the
feed-forward layer is a dense MLP in every layer (``qwen3_5``) or sparse experts with a gated
shared expert in every layer, router weights renormalized (``qwen3_5_moe``).

Released checkpoints are the vision-language model: the text model's keys sit under
``text_config`` and its weights under ``model.language_model.`` (``language_model.model.`` in
folders mlx-lm wrote, whose norms hold ``1 + weight``: see
:func:`~mlxr_plugins.archs.qwen3_next.sanitize_hybrid`); the vision tower
(``model.visual.*``) is not read, the multi-token-prediction head (``mtp.*``) only by the
``mtp`` drafter (``models[].speculative``). Attention's
M-RoPE gives text tokens the same position on its three axes, which is ordinary RoPE over the
first ``partial_rotary_factor`` of each head.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers import CausalLM, DecoderModel, RMSNorm
from mlxr_plugins.archs.qwen3_next import (
    Qwen3NextArchitecture,
    Qwen3NextArgs,
    hybrid_layers,
    sanitize_hybrid,
)


@dataclasses.dataclass
class Qwen35Args(Qwen3NextArgs):
    """The keys of ``Qwen3_5TextConfig`` (dense: no experts)."""

    family = "qwen3_5"
    num_experts: int = 0


@dataclasses.dataclass
class Qwen35MoeArgs(Qwen3NextArgs):
    """The keys of ``Qwen3_5MoeTextConfig``: every layer sparse, weights renormalized."""

    family = "qwen3_5_moe"
    #: No layer has a dense MLP, so the config has no ``intermediate_size``.
    aliases = {"intermediate_size": ("moe_intermediate_size",)}
    num_experts: int = 256
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys: ``text_config``'s over the top level's."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


#: Where the language model's weights sit in the released checkpoints (``model.language_model.``)
#: and in folders mlx-lm wrote (``language_model.model.``, ``language_model.lm_head``).
PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.", ""),
)


def text_name(name: str) -> str:
    """A language-model weight's (or packed module's) name under ``model.`` and ``lm_head``."""
    return next((stem + name[len(prefix) :] for prefix, stem in PREFIXES if name.startswith(prefix)), name)


class Qwen35(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: Qwen3NextArgs, kernels: KernelSet):
        H = args.hidden_size
        layers = hybrid_layers(args, kernels, fused=False)  # Qwen3.5's projections are split
        model = DecoderModel(args.vocab_size, H, layers, RMSNorm(H, args.rms_norm_eps, kernels, offset=1.0))
        super().__init__(model, tied=args.tie_word_embeddings)
        self.args = args


class Qwen35Architecture(Qwen3NextArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``qwen3_5`` (and ``qwen3_5_text``)."""

    args_class: ClassVar[type[Qwen3NextArgs]] = Qwen35Args

    def args(self, config: dict[str, Any]) -> Any:
        return self.args_class.from_config(text_config(config))

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the text model from a tolerant config dict."""
        return Qwen35(self.args(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """The language model's weights under ``model.``; the vision tower and the
        multi-token-prediction heads dropped; then as Qwen3-Next's."""
        text: dict[str, mx.array] = {}
        for name, array in weights.items():
            if name.startswith(("model.visual.", "visual.", "vision_tower.", "mtp.", "language_model.mtp.")):
                continue
            text[text_name(name)] = array
        args = self.args(config)
        tied = args.tie_word_embeddings
        stacked = sanitize_hybrid(text, args.num_experts, args.num_hidden_layers)
        return {
            name: array
            for name, array in stacked.items()
            if "rotary_emb.inv_freq" not in name and not (tied and name.startswith("lm_head."))
        }


    def sanitized_modules(self, module: str) -> list[str]:
        """A packed module of the language model under the name :meth:`sanitize` gives it."""
        return [text_name(module)]


class Qwen35MoeArchitecture(Qwen35Architecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``qwen3_5_moe`` (and ``_text``)."""

    args_class = Qwen35MoeArgs
