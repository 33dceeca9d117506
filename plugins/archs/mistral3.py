"""Mistral 3 (``mistral3``: Mistral Small 3.1 and 3.2, Magistral, and Mistral Small 4 as Mistral
releases it): a Pixtral vision tower and projector beside a text model that ``text_config``'s
``model_type`` names — ``mistral`` (the default), ``ministral`` or ``mistral4``.

Served as text: the text model's native architecture, built from ``text_config`` (over the top
level's keys), its weights under ``model.language_model.`` (transformers 5) or
``language_model.model.`` / ``language_model.lm_head.`` (earlier folders and mlx-vlm) renamed to
the text graph's; the vision tower and projector are not loaded, so a request with an image gets
the 400 of a text-only model. A text model this package has no native graph for is refused naming
``text_config.model_type``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers.family import DecoderArchitecture
from mlxr_plugins.archs.llama import LlamaArchitecture, MinistralArchitecture
from mlxr_plugins.archs.mistral4 import Mistral4Architecture
from mlxr_plugins.archs.qwen3_5 import text_config

#: The language model's prefixes in the checkpoints -> the text graph's names.
TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
#: The vision side, not loaded.
VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


def text_name(name: str) -> str:
    """A language-model weight's (or packed module's) name under ``model.`` and ``lm_head``."""
    return next((stem + name[len(prefix) :] for prefix, stem in TEXT_PREFIXES if name.startswith(prefix)), name)


def text_keys(config: dict[str, Any]) -> dict[str, Any]:
    """``text_config``'s keys over the top level's, with the top level's ``tie_word_embeddings``
    (which ``Mistral3ForConditionalGeneration`` reads) where it has one."""
    text = text_config(config)
    if "tie_word_embeddings" in config:
        text = {**text, "tie_word_embeddings": config["tie_word_embeddings"]}
    return text


def text_architecture(family: type[DecoderArchitecture]) -> type[DecoderArchitecture]:
    """``family`` reading a ``mistral3`` config's text model and its checkpoint's names."""

    class TextOfMistral3(family):  # type: ignore[valid-type,misc]
        def args(self, config: dict[str, Any]) -> Any:
            return super().args(text_keys(config))

        def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
            text = {text_name(name): a for name, a in weights.items() if not name.startswith(VISION_PREFIXES)}
            return super().sanitize(text, config)

    TextOfMistral3.__name__ = TextOfMistral3.__qualname__ = f"Mistral3{family.__name__}"
    return TextOfMistral3


#: ``text_config.model_type`` -> the architecture of that text model, reading a ``mistral3`` folder.
TEXT_ARCHITECTURES = {
    "mistral": text_architecture(LlamaArchitecture),
    "ministral": text_architecture(MinistralArchitecture),
    "mistral4": text_architecture(Mistral4Architecture),
}


class Mistral3Architecture:
    """The :class:`mlxr_core.model.arch.Architecture` of ``mistral3``: each call goes to the
    architecture of the config's text model (:data:`TEXT_ARCHITECTURES`); the built module keeps
    it for the calls that get only the module."""

    def text(self, config: dict[str, Any]) -> DecoderArchitecture:
        inner = config.get("text_config")
        model_type = inner.get("model_type", "mistral") if isinstance(inner, dict) else "mistral"
        family = TEXT_ARCHITECTURES.get(model_type)
        if family is None:
            raise ModelLoadError(
                f"mistral3's text model {model_type!r} has no native graph here "
                f"(native: {', '.join(sorted(TEXT_ARCHITECTURES))})",
                key="text_config.model_type",
            )
        return family()

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        arch = self.text(config)
        model = arch.build(config, kernels)
        model.text_architecture = arch
        return model

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        return self.text(config).sanitize(weights, config)

    def sanitized_modules(self, module: str) -> list[str]:
        """A packed module of the language model under the name :meth:`sanitize` gives it."""
        return [text_name(module)]

    def make_cache(self, model: nn.Module) -> list[Any]:
        return model.text_architecture.make_cache(model)  # type: ignore[no-any-return]

    def hidden_states(self, model: nn.Module, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        return model.text_architecture.hidden_states(model, inputs, cache)  # type: ignore[no-any-return]

    def context_length(self, config: dict[str, Any]) -> int:
        return self.text(config).context_length(config)

    def kernel_context(self, config: dict[str, Any]) -> dict[str, Any]:
        return self.text(config).kernel_context(config)
