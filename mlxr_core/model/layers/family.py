"""What an :class:`~mlxr_core.model.arch.Architecture` built on these layers shares."""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import KVCache
from mlxr_core.model.layers.args import TransformerArgs


class DecoderArchitecture:
    """An architecture whose config class is :attr:`args_class` and whose module is a
    :class:`~mlxr_core.model.layers.model.CausalLM`: a subclass gives :meth:`build` and
    overrides what its family does differently."""

    args_class: ClassVar[type[TransformerArgs]] = TransformerArgs

    def args(self, config: dict[str, Any]) -> Any:
        return self.args_class.from_config(config)

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        raise NotImplementedError

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Drop precomputed rotary tables and, with tied embeddings, a redundant ``lm_head``."""
        tied = self.args(config).tie_word_embeddings
        return {
            name: array
            for name, array in weights.items()
            if "rotary_emb.inv_freq" not in name and not (tied and name.startswith("lm_head."))
        }

    def make_cache(self, model: nn.Module) -> list[Any]:
        """One full :class:`KVCache` per layer (window layers mask, they do not evict)."""
        return [KVCache() for _ in model.layers]

    def hidden_states(
        self, model: nn.Module, inputs: mx.array, cache: list[Any] | None = None
    ) -> mx.array:
        """``[B, L, hidden_size]`` after the final norm, before the LM head."""
        hidden: mx.array = model.hidden_states(inputs, cache)  # type: ignore[operator]
        return hidden

    def context_length(self, config: dict[str, Any]) -> int:
        """``max_position_embeddings``: a sliding window masks older positions, it does not cap."""
        return int(self.args(config).max_position_embeddings)

    def kernel_context(self, config: dict[str, Any]) -> dict[str, Any]:
        """Shapes kernels check: head dim, head counts, rotary dims and the mask kinds used."""
        shapes: dict[str, Any] = self.args(config).kernel_shapes()
        return shapes
