"""The architecture contract: turn a :class:`Checkpoint` config into an MLX module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

    from mlxr_core.kernels import KernelSet


class Architecture(Protocol):
    """One ``model_type`` (or a family), registered through ``mlxr_register_archs``.

    The built module is called as ``model(inputs, cache=cache)`` with ``inputs`` of shape ``[B, L]``
    (int32 token ids) and returns logits of shape ``[B, L, vocab]``; ``cache`` is the list
    :meth:`make_cache` returned, one entry per layer, advanced in place.
    """

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the module from a tolerant config dict (unknown keys ignored)."""
        ...

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Drop or reshape checkpoint tensors the module does not hold (e.g. rotary inv_freq)."""
        ...

    def make_cache(self, model: nn.Module) -> list[Any]:
        """Fresh per-layer KV caches for one sequence."""
        ...

    def context_length(self, config: dict[str, Any]) -> int:
        """Maximum positions the model supports (``max_position_embeddings``)."""
        ...

    def kernel_context(self, config: dict[str, Any]) -> dict[str, Any]:
        """Shape facts kernels need to decide support: head_dim, n_heads, n_kv_heads, masks."""
        ...
