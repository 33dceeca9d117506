"""Qwen4-Exp's indexed attention (QSA): gated attention over the token blocks an indexer picks.

The positions a query sees (its own row's, itself included) are cut into blocks of
``indexer_compress_ratio`` from the row's first token; the last, incomplete block is the tail.
Each complete block is scored against the query by a small indexer of its own::

    q     = rope(q_layernorm(q_idx(x_t)), t)                       # [heads, Di]
    k_b   = rope(k_layernorm(mean(k_idx(x_j) for j in block b)), first position of b)
    score = sum over heads of relu(q . k_b) / sqrt(Di)

and the query attends over the tokens of its ``indexer_budget / indexer_compress_ratio``
best-scoring blocks and of the tail. Until a query sees more complete blocks than that, every
block is picked: plain causal attention, which is all a step computes then. Blocks whose scores
tie at the last place picked may be picked otherwise than by ``torch.topk`` (which names no
order for ties; a score is 0 wherever every head's product is negative).

The indexer's key of every position is cached with the layer's keys and values: it rides in
``ceil(Di / head_dim)`` extra key heads of the layer's :class:`~mlxr_core.model.cache.KVCache`
(their values zeros), so that batching, the prefix cache and rollback carry it as they carry the
keys, and the KV budget counts it (the cache's declared width).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.model.cache import KVCache
from mlxr_core.model.layers.linear_attention import GatedAttention
from mlxr_plugins.archs.qwen4_exp_ple import GroupRMSNorm


class Indexer(nn.Module):
    """``index_qk_proj`` (the query heads, then one key head), ``q_layernorm``, ``k_layernorm``."""

    def __init__(self, hidden: int, heads: int, head_dim: int, eps: float, budget: int, block: int):
        super().__init__()
        self.heads, self.head_dim, self.block, self.top = heads, head_dim, block, budget // block
        self.index_qk_proj = nn.Linear(hidden, (heads + 1) * head_dim, bias=False)
        self.q_layernorm = GroupRMSNorm(head_dim, head_dim, eps)
        self.k_layernorm = GroupRMSNorm(head_dim, head_dim, eps)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """``[B, L, hidden]`` -> queries ``[B, heads, L, Di]`` (normed, not rotated) and raw keys ``[B, L, Di]``."""
        B, L, _ = x.shape
        queries, keys = mx.split(self.index_qk_proj(x), [self.heads * self.head_dim], axis=-1)
        queries = self.q_layernorm(queries.reshape(B, L, self.heads, self.head_dim))
        return queries.transpose(0, 2, 1, 3), keys

    def picked(
        self, queries: mx.array, keys: mx.array, starts: mx.array, offset: mx.array, rotary: Any
    ) -> mx.array:
        """Boolean ``[B, 1, L, S]``: the buffer positions each query attends to. ``queries``
        ``[B, heads, L, Di]`` (rotated), ``keys`` ``[B, S, Di]`` every raw key in the buffer,
        ``starts`` ``[B]`` where each row's first token lies in it, ``offset`` ``[B]`` the
        position (in its row) of each row's first query."""
        B, _, L, Di = queries.shape
        S, c = keys.shape[1], self.block
        # Each row's keys from its first token on (rows differ in padding); past its end: unused.
        at = mx.minimum(starts[:, None] + mx.arange(S)[None, :], S - 1)
        own = mx.take_along_axis(keys, at[..., None], axis=1)
        blocks = S // c
        pooled = own[:, : blocks * c].reshape(B, blocks, c, Di).astype(mx.float32).mean(axis=2).astype(keys.dtype)
        pooled = self.k_layernorm(pooled)
        # RoPE at each block's first position: every position of the block rotated, the first kept.
        spread = mx.repeat(pooled, c, axis=1)[:, None]  # [B, 1, blocks * c, Di]
        block_keys = rotary(spread, 0)[:, 0, ::c]  # [B, blocks, Di]
        scores = mx.einsum("bhld,bnd->blnh", queries.astype(mx.float32), block_keys.astype(mx.float32))
        scores = nn.relu(scores).sum(axis=-1) / math.sqrt(Di)  # [B, L, blocks]
        position = offset[:, None] + mx.arange(L)[None, :]  # [B, L] each query's position in its row
        complete = (position + 1) // c  # complete blocks each query sees
        usable = mx.arange(blocks)[None, None, :] < complete[..., None]
        scores = mx.where(usable, scores, -math.inf)
        if blocks > self.top:
            best = mx.argpartition(-scores, kth=self.top - 1, axis=-1)[..., : self.top]
            picks = mx.ones(best.shape, dtype=mx.bool_)
            chosen = mx.put_along_axis(mx.zeros(scores.shape, dtype=mx.bool_), best, picks, axis=-1)
            chosen = chosen & usable
        else:
            chosen = usable
        token = mx.arange(S)[None, None, :]  # a position of the row
        block_of = mx.broadcast_to(mx.minimum(token // c, blocks - 1), (*chosen.shape[:2], S))
        in_block = mx.take_along_axis(chosen, block_of, axis=-1)
        tail = (token >= complete[..., None] * c) & (token <= position[..., None])
        seen = (in_block & (token < complete[..., None] * c)) | tail  # [B, L, S] by position in the row
        # Back to buffer positions: buffer index i holds the row's position i - start.
        back = mx.clip(mx.arange(S)[None, :] - starts[:, None], 0, S - 1)
        mask = mx.take_along_axis(seen, mx.broadcast_to(back[:, None, :], seen.shape), axis=-1)
        return (mask & (mx.arange(S)[None, None, :] >= starts[:, None, None]))[:, None]


class IndexedAttention(GatedAttention):
    """Gated attention whose queries attend over the tokens their :class:`Indexer` picks."""

    def __init__(self, *args: Any, indexer: Indexer, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.indexer = indexer
        #: Extra key heads carrying the indexer's key in the cache.
        self.index_heads = -(-indexer.head_dim // self.head_dim)

    def attention(self, *args: Any, **kwargs: Any) -> mx.array:
        """Not a step of its own: the indexer reads the keys the cache returns (:meth:`__call__`),
        so a cache storing them otherwise (quantized) cannot serve this layer."""
        raise NotImplementedError("IndexedAttention reads its cache itself")

    def make_cache(self) -> KVCache:
        return KVCache(width=(2 * (self.n_kv_heads + self.index_heads)) * self.head_dim)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        B, L, _ = x.shape
        H, Hkv, D, E = self.n_heads, self.n_kv_heads, self.head_dim, self.index_heads
        queries, gate = mx.split(self.q_proj(x).reshape(B, L, H, 2 * D), 2, axis=-1)
        keys = self.k_norm(self.k_proj(x).reshape(B, L, Hkv, D))
        values = self.v_proj(x).reshape(B, L, Hkv, D)
        offset = cache.offset if cache is not None else 0
        queries = self._rotary(self.q_norm(queries).transpose(0, 2, 1, 3), offset)
        keys = self._rotary(keys.transpose(0, 2, 1, 3), offset)
        index_queries, index_keys = self.indexer.project(x)
        Di = self.indexer.head_dim
        carried = mx.pad(index_keys, [(0, 0), (0, 0), (0, E * D - Di)]).reshape(B, L, E, D).transpose(0, 2, 1, 3)
        keys = mx.concatenate([keys, carried.astype(keys.dtype)], axis=1)
        values = mx.concatenate([values.transpose(0, 2, 1, 3), mx.zeros((B, E, L, D), dtype=values.dtype)], axis=1)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        S = keys.shape[2]
        pads = list(getattr(cache, "left_padding", None) or [0] * B)
        if (S - min(pads)) // self.indexer.block > self.indexer.top:  # some query may lose blocks
            starts = mx.array(pads)
            rows_offset = offset if isinstance(offset, mx.array) else mx.full((B,), offset)
            every = keys[:, Hkv:].transpose(0, 2, 1, 3).reshape(B, S, E * D)[..., :Di]
            mask = self.indexer.picked(self._rotary(index_queries, offset), every, starts, rows_offset, self._rotary)
        out = self._attention(queries, keys[:, :Hkv], values[:, :Hkv], scale=self.scale, mask=mask)
        merged = out.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate.reshape(B, L, -1))
        result: mx.array = self.o_proj(merged)
        return result
