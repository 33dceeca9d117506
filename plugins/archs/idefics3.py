"""Idefics3 and SmolVLM (``idefics3``, ``smolvlm``): the Llama text graph
(:mod:`mlxr_plugins.archs.llama`) from the config's ``text_config``, and the vision side in
:mod:`mlxr_plugins.archs.idefics3_vision` (a SigLIP tower over image tiles, a pixel-shuffle
connector). Image tokens take the image's embeddings in place; positions and attention are the
text model's own (causal, ordinary RoPE).

Weights: the text model under ``model.text_model.`` and ``lm_head`` (transformers), or mlx-vlm's
``language_model.model.`` and ``language_model.lm_head``; ``tie_word_embeddings`` is the top
level's, as ``Idefics3ForConditionalGeneration`` reads it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.vision import VisionArchitecture
from mlxr_plugins.archs.llama import Llama, LlamaArchitecture, LlamaArgs
from mlxr_plugins.archs.qwen3_5 import text_config

#: Checkpoint prefixes of the language model -> the Llama graph's names.
TEXT_PREFIXES = (
    ("model.text_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
#: The vision tower and connector, loaded apart by the vision side.
VISION_PREFIXES = ("model.vision_model.", "model.connector.", "vision_model.", "connector.")


def text_name(name: str) -> str:
    """A language-model weight's (or packed module's) name under ``model.`` and ``lm_head``."""
    return next((stem + name[len(prefix) :] for prefix, stem in TEXT_PREFIXES if name.startswith(prefix)), name)


class Idefics3Architecture(LlamaArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``idefics3`` and ``smolvlm``, whose
    vision side :meth:`vision` gives (:class:`mlxr_core.model.vision.ProvidesVision`)."""

    def args(self, config: dict[str, Any]) -> LlamaArgs:
        """The Llama keys of ``text_config``, with the top level's ``tie_word_embeddings``."""
        text = text_config(config)
        if "tie_word_embeddings" in config:
            text = {**text, "tie_word_embeddings": config["tie_word_embeddings"]}
        return LlamaArgs.from_config(text)

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        return Llama(self.args(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """The language model's weights under the Llama graph's names; the vision side's dropped."""
        text = {text_name(name): array for name, array in weights.items() if not name.startswith(VISION_PREFIXES)}
        return super().sanitize(text, config)

    def sanitized_modules(self, module: str) -> list[str]:
        """A packed module of the language model under the name :meth:`sanitize` gives it."""
        return [text_name(module)]

    def vision(self, config: dict[str, Any]) -> VisionArchitecture | None:
        """The tower and connector of a checkpoint with a ``vision_config``; None for text only."""
        if not config.get("vision_config"):
            return None
        from mlxr_plugins.archs.idefics3_vision import Idefics3VisionArchitecture

        return Idefics3VisionArchitecture()
