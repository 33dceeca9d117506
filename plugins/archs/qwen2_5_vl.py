"""Qwen2.5-VL (``qwen2_5_vl``): the Qwen2 text graph with M-RoPE, and its vision side.

The language model is Qwen2's (:mod:`mlxr_plugins.archs.qwen2`) but its rotary positions are
three per token (:mod:`mlxr_core.model.layers.mrope`, ``mrope_section`` of the config's
``rope_scaling``): a prompt with images is prefilled at the positions the images' grids give,
and decoded at its cache positions plus the sequence's delta. The vision tower, merger and image
processor are in :mod:`mlxr_plugins.archs.qwen2_5_vl_vision`.

Configs: the text keys at the top level with ``rope_scaling: {type: mrope, mrope_section}`` (the
released checkpoints), or under ``text_config`` with ``rope_parameters`` (transformers 5).
Weights: the text model under ``model.`` (or ``model.language_model.``, or mlx-vlm's
``language_model.model.``), ``lm_head``, the tower under ``visual.`` (or ``model.visual.``, or
mlx-vlm's ``vision_tower.``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers import DecoderArchitecture, make_rotary, rope_type
from mlxr_core.model.layers.mrope import MRotary
from mlxr_core.model.vision import VisionArchitecture
from mlxr_plugins.archs.qwen2 import Qwen2, Qwen2Architecture, Qwen2Args
from mlxr_plugins.archs.qwen3_5 import text_config, text_name


def mrope_text_config(config: dict[str, Any], family: str) -> dict[str, Any]:
    """The text model's keys (``text_config`` over the top level's) with ``mrope_section`` from
    ``rope_scaling`` or ``rope_parameters`` and no other rotary scaling: one other than M-RoPE is
    refused, naming it."""
    merged = text_config(config)
    scaling = merged.get("rope_scaling") or merged.get("rope_parameters") or {}
    kind = scaling.get("type", rope_type(scaling))
    if kind not in ("mrope", "default"):
        raise ModelLoadError(f"rope_scaling type {kind!r} is not supported by the {family} graph (mrope)",
                             key="rope_scaling")
    merged = {**merged, "rope_scaling": None}
    if "mrope_section" in scaling:
        merged["mrope_section"] = scaling["mrope_section"]
    return merged


@dataclasses.dataclass
class Qwen25VLArgs(Qwen2Args):
    """Qwen2's keys with Qwen2.5-VL's defaults, and the M-RoPE sections."""

    family = "qwen2_5_vl"
    max_position_embeddings: int = 128000
    rope_theta: float = 1000000.0
    mrope_section: list[int] = dataclasses.field(default_factory=lambda: [16, 24, 24])

    @classmethod
    def read(cls, config: dict[str, Any]) -> Qwen25VLArgs:
        """From either config layout (see the module)."""
        return cls.from_config(mrope_text_config(config, cls.family))


class VisionLanguageArchitecture(DecoderArchitecture):
    """What the Qwen vision-language families share: the language model's weights under
    ``model.`` and ``lm_head`` whatever the layout, the tower's left to the vision side."""

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """The language model's weights under ``model.`` and ``lm_head``; the tower dropped."""
        tower = ("visual.", "model.visual.", "vision_tower.")
        text = {text_name(name): array for name, array in weights.items() if not name.startswith(tower)}
        return super().sanitize(text, config)

    def sanitized_modules(self, module: str) -> list[str]:
        """A packed module of the language model under the name :meth:`sanitize` gives it."""
        return [text_name(module)]


class Qwen25VLArchitecture(VisionLanguageArchitecture, Qwen2Architecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``qwen2_5_vl``, whose vision side
    :meth:`vision` gives (:class:`mlxr_core.model.vision.ProvidesVision`)."""

    args_class = Qwen25VLArgs

    def args(self, config: dict[str, Any]) -> Any:
        return Qwen25VLArgs.read(config)

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        args = Qwen25VLArgs.read(config)
        plain = make_rotary(kernels, args.rope_dims, args.rope_theta)
        return Qwen2(args, kernels, MRotary(plain, args.rope_dims, args.rope_theta, args.mrope_section))

    def context_length(self, config: dict[str, Any]) -> int:
        return Qwen25VLArgs.read(config).context()

    def vision(self, config: dict[str, Any]) -> VisionArchitecture | None:
        """The tower and merger of a checkpoint with a ``vision_config``; None for text only."""
        if not config.get("vision_config"):
            return None
        from mlxr_plugins.archs.qwen2_5_vl_vision import Qwen25VisionArchitecture

        return Qwen25VisionArchitecture()
