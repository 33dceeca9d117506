"""Attention masks shared by architectures.

Sliding-window layers keep every position in an ordinary :class:`~mlxr_core.model.cache.KVCache`
(or :class:`~mlxr_core.model.cache.BatchKVCache`) and hide the keys that fell out of the window
with a mask. That costs the memory of a full cache on window layers, but it keeps one cache type
for every layer, so batching (rows joining, leaving, left padding), the prefix cache and
:meth:`KVCache.trim` for speculative decoding work unchanged; a rotating buffer would need its
own version of each.
"""

from __future__ import annotations

import math

import mlx.core as mx


def window_mask(
    mask: str | mx.array | None, queries: int, keys: int, window: int
) -> str | mx.array | None:
    """``mask`` further limited to the last ``window`` positions of each query (itself included).

    ``queries`` new positions are the last of ``keys`` cached ones, as the attention kernels'
    bottom-right ``"causal"`` mask assumes. Query ``i`` sits at index ``keys - queries + i`` and
    sees key ``j`` when ``0 <= (keys - queries + i) - j < window`` (Hugging Face's and llama.cpp's
    rule). The distance between indices is the same in a right-aligned batch cache, whatever a
    row's left padding, so a batch's boolean ``[B, 1, 1, S]`` padding mask combines with it. A
    mask with a row per query (``[..., L, S]``, L > 1) keeps the keys it lets a query see ahead of
    it (Gemma 3's image tokens, :func:`mlxr_core.model.vision.image_prefill_mask`).
    """
    if keys <= window:
        return mask  # every key is within the window of every query
    rows = mx.arange(keys - queries, keys)[:, None]
    cols = mx.arange(keys)[None, :]
    near = rows - cols < window
    # A mask with a row per query says itself which earlier or later keys each one sees (an
    # image's tokens see each other both ways): the window only bounds how far back.
    own_rows = isinstance(mask, mx.array) and queries > 1 and mask.ndim >= 2 and mask.shape[-2] == queries
    visible = near if own_rows else (cols <= rows) & near  # [L, S]
    if isinstance(mask, mx.array):
        if mask.dtype == mx.bool_:
            return mask & visible
        return mx.where(visible, mask, mx.array(-math.inf, dtype=mask.dtype))
    return visible  # None or "causal": ``visible`` is causal already
