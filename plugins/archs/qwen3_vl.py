"""Qwen3-VL (``qwen3_vl``): the Qwen3 text graph with interleaved M-RoPE and DeepStack, and its
vision side.

The language model is Qwen3's (:mod:`mlxr_plugins.archs.qwen3`: per-head query and key norms)
with M-RoPE whose height and width frequencies are interleaved with the temporal ones
(:class:`~mlxr_core.model.layers.mrope.MRotary`, ``interleaved``), positions as Qwen2.5-VL's
(:mod:`mlxr_plugins.archs.qwen2_5_vl`). DeepStack: the vision side gives each image token, beside
its input embedding, one feature per ``deepstack_visual_indexes`` block of the tower; the
``k``-th is added to the token's hidden state after the ``k``-th decoder layer. They travel as
the image rows' extra width (:func:`~mlxr_core.model.vision.merge_embeddings` leaves text
positions zero there, :class:`DeepStackDecoder` adds them), so the prefill that merges an
image adds them and nothing else changes.
The vision tower, mergers and image processor are in :mod:`mlxr_plugins.archs.qwen3_vl_vision`.

Config: the text keys under ``text_config`` with ``rope_parameters`` (``mrope_section``,
``mrope_interleaved``). Weights: the text model under ``model.language_model.``, ``lm_head``,
the tower under ``model.visual.``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers import DecoderModel, make_rotary
from mlxr_core.model.layers.mrope import MRotary
from mlxr_core.model.vision import VisionArchitecture
from mlxr_plugins.archs.qwen2_5_vl import VisionLanguageArchitecture, mrope_text_config
from mlxr_plugins.archs.qwen3 import Qwen3, Qwen3Architecture, Qwen3Args


@dataclasses.dataclass
class Qwen3VLArgs(Qwen3Args):
    """Qwen3's keys with Qwen3-VL's defaults, and the M-RoPE sections."""

    family = "qwen3_vl"
    max_position_embeddings: int = 128000
    rope_theta: float = 500000.0
    mrope_section: list[int] = dataclasses.field(default_factory=lambda: [24, 20, 20])

    @classmethod
    def read(cls, config: dict[str, Any]) -> Qwen3VLArgs:
        return cls.from_config(mrope_text_config(config, cls.family))


class DeepStackDecoder(DecoderModel):
    """The decoder stack, taking image rows wider than ``hidden``: the input embedding, then one
    ``hidden``-wide feature per early layer, added to that layer's output (zero at text positions)."""

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        mask: str | mx.array | None = None,
        embeddings: mx.array | None = None,
        positions: mx.array | None = None,
    ) -> mx.array:
        D = self.norm.weight.shape[0]
        if embeddings is None or embeddings.shape[-1] == D:
            return super().__call__(inputs, cache, mask, embeddings, positions)
        added = [embeddings[..., start : start + D] for start in range(D, embeddings.shape[-1], D)]
        normed: mx.array = self.norm(self.run_layers(embeddings[..., :D], cache, mask, positions, added))
        return normed


class Qwen3VLArchitecture(VisionLanguageArchitecture, Qwen3Architecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``qwen3_vl``, whose vision side
    :meth:`vision` gives (:class:`mlxr_core.model.vision.ProvidesVision`)."""

    args_class = Qwen3VLArgs

    def args(self, config: dict[str, Any]) -> Any:
        return Qwen3VLArgs.read(config)

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        args = Qwen3VLArgs.read(config)
        plain = make_rotary(kernels, args.rope_dims, args.rope_theta)
        rotary = MRotary(plain, args.rope_dims, args.rope_theta, args.mrope_section, interleaved=True)
        return Qwen3(args, kernels, rotary, DeepStackDecoder)

    def context_length(self, config: dict[str, Any]) -> int:
        return Qwen3VLArgs.read(config).context()

    def vision(self, config: dict[str, Any]) -> VisionArchitecture | None:
        """The tower and mergers of a checkpoint with a ``vision_config``; None for text only."""
        if not config.get("vision_config"):
            return None
        from mlxr_plugins.archs.qwen3_vl_vision import Qwen3VLVisionArchitecture

        return Qwen3VLVisionArchitecture()
