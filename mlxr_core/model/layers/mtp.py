"""A multi-token-prediction head read from the checkpoint (Qwen3-Next / Qwen3.5 ``mtp.*``,
DeepSeek-V3's next-token layer ``model.layers.{num_hidden_layers}.*``).

The head guesses the token after next from the target's last hidden state ``h_i`` (its final,
normed output at position ``i``) and the embedding of the token that follows it, ``t_{i+1}``::

    x = proj(concat(embed_norm(embed(t_{i+1})), hidden_norm(h_i)))     # [2H] -> [H]
    g = block(x)             # one decoder layer, attending over the head's own cache
    logits(t_{i+2}) = lm_head(norm(g))                                 # the target's head

The embedding and LM head are the target's. Chained for a longer draft, the head reads its own
output as the next position's hidden state with the token it drafted: ``norm(g)`` for Qwen
(vLLM's Qwen3-Next MTP hands on the normed output), ``g`` for DeepSeek-V3 (its paper's
``h^k``, the block's output, before the output head's norm).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers.norms import RMSNorm


class MtpHead(nn.Module):
    """One MTP layer: ``embed_norm``, ``hidden_norm``, ``proj``, ``block`` and ``norm``, norms
    scaling by ``norm_offset + weight``; ``chain_normed`` picks what a chained step reads."""

    def __init__(
        self, block: nn.Module, hidden: int, eps: float, kernels: KernelSet, *, norm_offset: float, chain_normed: bool
    ):
        super().__init__()
        self.embed_norm = RMSNorm(hidden, eps, kernels, offset=norm_offset)
        self.hidden_norm = RMSNorm(hidden, eps, kernels, offset=norm_offset)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.norm = RMSNorm(hidden, eps, kernels, offset=norm_offset)
        self.chain_normed = chain_normed

    def __call__(
        self, embeddings: mx.array, hidden: mx.array, cache: Any, mask: str | mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """``embeddings`` of ``t_{i+1}`` and target ``hidden`` of positions ``i`` (``[B, L, H]``
        each) -> ``(normed, chained)``: what the LM head reads, and what a chained step reads as
        its hidden state."""
        x = self.proj(mx.concatenate([self.embed_norm(embeddings), self.hidden_norm(hidden)], axis=-1))
        if mask is None and x.shape[1] > 1:
            mask = "causal"
        g: mx.array = self.block(x, mask, cache)
        normed: mx.array = self.norm(g)
        return normed, normed if self.chain_normed else g

    def make_cache(self) -> Any:
        """The block's cache (keys and values of the positions the head has read): its own, or
        its attention's (a latent cache), or a plain one."""
        from mlxr_core.model.cache import KVCache

        for owner in (self.block, getattr(self.block, "self_attn", None)):
            make = getattr(owner, "make_cache", None)
            if callable(make):
                return make()
        return KVCache()


def head_weights(
    weights: dict[str, mx.array],
    prefixes: tuple[str, ...],
    names: Sequence[tuple[str, str]],
    *,
    rest: bool = False,
    skip: tuple[str, ...] = (),
) -> dict[str, mx.array]:
    """The checkpoint's weights under one of ``prefixes``, renamed for :class:`MtpHead`: the first
    of ``names``' ``(theirs, ours)`` that begins the rest of a name replaces that beginning; a
    name none begins goes under ``block.`` with ``rest``, else is left out, as are those ``skip``
    begins."""
    head: dict[str, mx.array] = {}
    for name, array in weights.items():
        prefix = next((start for start in prefixes if name.startswith(start)), None)
        if prefix is None or name[len(prefix) :].startswith(skip):
            continue
        stem = name[len(prefix) :]
        ours = next((mine + stem[len(theirs) :] for theirs, mine in names if stem.startswith(theirs)), None)
        if ours is None and rest:
            ours = "block." + stem
        if ours is not None:
            head[ours] = array
    return head


@runtime_checkable
class HasMtpHead(Protocol):
    """An optional capability of an :class:`~mlxr_core.model.arch.Architecture`: the MTP head its
    checkpoints carry beside the model (read only when ``models[].speculative.method`` is
    ``mtp``; the model's own :meth:`sanitize` drops those weights)."""

    def mtp_weights(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """The head's weights among the checkpoint's, under :class:`MtpHead`'s names (``proj``,
        ``block.*``, ...); empty when the checkpoint carries none."""
        ...

    def build_mtp(self, config: dict[str, Any], kernels: KernelSet) -> MtpHead:
        """The head of this checkpoint's shape, its weights not loaded."""
        ...
