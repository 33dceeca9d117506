"""Decoder blocks as the compiled decode step cuts them (see :mod:`mlxr_core.model.compiled`).

A block is :meth:`AttentionBlock.attention_inputs` (input norm, projections, RoPE), then
:meth:`AttentionBlock.attention` (cache and kernel), then ``after_attention`` (the rest), and
``__call__`` composes them. The rest comes in two parts, ``after_attention_parts(x, out) ->
(residual, delta)`` whose sum is the block's output, so that a compiled step can fuse the add with
the next block's input norm (:meth:`AttentionBlock.add_attention_inputs`).
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.model.cache import KVCache
from mlxr_core.model.layers.norms import LayerNorm, RMSNorm


class SelfAttention(Protocol):
    """What a block needs of its ``self_attn``: the cut of
    :class:`~mlxr_core.model.layers.attention.Attention` (or of
    :class:`~mlxr_core.model.layers.latent_attention.LatentAttention`)."""

    def attention_inputs(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The three arrays :meth:`attention` takes, from the block's normed input."""
        ...

    def attention(
        self, queries: mx.array, keys: mx.array, values: mx.array, mask: str | mx.array | None, cache: Any, /
    ) -> mx.array:
        """The cache update and the attention kernel."""
        ...

    def output(self, out: mx.array) -> mx.array:
        """:meth:`attention`'s output -> ``[B, L, hidden]``."""
        ...


class AttentionBlock(nn.Module):
    """The attention half every block shares: ``input_layernorm`` (an :class:`RMSNorm`) and
    ``self_attn`` (a :class:`SelfAttention`). A subclass defines ``after_attention_parts``."""

    input_layernorm: RMSNorm | LayerNorm
    self_attn: SelfAttention

    def attention_inputs(
        self, x: mx.array, offset: int | mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        return self.self_attn.attention_inputs(self.input_layernorm(x), offset)

    def add_attention_inputs(
        self, residual: mx.array, delta: mx.array, offset: int | mx.array
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """``h = residual + delta`` (the previous block's output in its two parts) and
        :meth:`attention_inputs` of ``h``, as ``(h, queries, keys, values)``: the add and this
        block's input norm are one ``add_rms_norm`` kernel."""
        h, normed = self.input_layernorm.add_and_norm(delta, residual)
        queries, keys, values = self.self_attn.attention_inputs(normed, offset)
        return h, queries, keys, values

    def attention(self, *inputs: Any) -> mx.array:
        """``self_attn``'s :meth:`Attention.attention`."""
        return self.self_attn.attention(*inputs)

    def after_attention(self, x: mx.array, out: mx.array) -> mx.array:
        """The rest of the block: the sum of ``after_attention_parts``."""
        parts: Any = self
        residual, delta = parts.after_attention_parts(x, out)
        result: mx.array = residual + delta
        return result

    def __call__(
        self, x: mx.array, mask: str | mx.array | None, cache: KVCache | None, positions: mx.array | None = None
    ) -> mx.array:
        """The block; ``positions`` (M-RoPE's ``[3, B, L]``) rotate instead of the cache's offset."""
        offset = positions if positions is not None else cache.offset if cache is not None else 0
        return self.after_attention(x, self.attention(*self.attention_inputs(x, offset), mask, cache))


class PreNormBlock(AttentionBlock):
    """``h = x + attn(norm(x)); out = h + mlp(norm(h))`` (Llama and most families). ``mlp`` is
    any module ``[B, L, hidden] -> [B, L, hidden]``: a gated MLP or a mixture of experts."""

    def __init__(self, attention: SelfAttention, mlp: nn.Module, hidden: int, eps: float, kernels: Any):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, kernels)
        self.post_attention_layernorm = RMSNorm(hidden, eps, kernels)

    def after_attention_parts(self, x: mx.array, out: mx.array) -> tuple[mx.array, mx.array]:
        """The block's output as ``(residual, delta)``, their sum unformed."""
        h, normed = self.post_attention_layernorm.add_and_norm(x, self.self_attn.output(out))
        delta: mx.array = self.mlp(normed)
        return h, delta


class SandwichBlock(AttentionBlock):
    """Norms before and after both attention and feed-forward, the post-norm before the residual
    add (Gemma): ``h = x + post_attn(attn(in(x))); out = h + post_ff(mlp(pre_ff(h)))``. Norms
    scale by ``norm_offset + weight``."""

    def __init__(
        self,
        attention: SelfAttention,
        mlp: nn.Module,
        hidden: int,
        eps: float,
        kernels: Any,
        norm_offset: float = 0.0,
    ):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            setattr(self, name, RMSNorm(hidden, eps, kernels, offset=norm_offset))

    def after_attention_parts(self, x: mx.array, out: mx.array) -> tuple[mx.array, mx.array]:
        """The block's output as ``(residual, delta)``, their sum unformed."""
        attended = self.post_attention_layernorm(self.self_attn.output(out))
        h, normed = self.pre_feedforward_layernorm.add_and_norm(x, attended)
        delta: mx.array = self.post_feedforward_layernorm(self.mlp(normed))
        return h, delta


class ParallelBlock(AttentionBlock):
    """Attention and feed-forward side by side on one norm of the input (Cohere):
    ``out = x + attn(norm(x)) + mlp(norm(x))``. ``input_layernorm`` is an :class:`RMSNorm` or a
    :class:`LayerNorm`."""

    def __init__(self, attention: SelfAttention, mlp: nn.Module, norm: RMSNorm | LayerNorm):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = norm

    def after_attention_parts(self, x: mx.array, out: mx.array) -> tuple[mx.array, mx.array]:
        """``(x, attn + mlp)``; the norm of ``x`` is computed again here (one norm a layer), as the
        compiled step hands a block only ``x`` and the attention's output."""
        delta: mx.array = self.self_attn.output(out) + self.mlp(self.input_layernorm(x))
        return x, delta
