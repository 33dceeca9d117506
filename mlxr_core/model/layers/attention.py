"""Self-attention over a KV cache, cut where a compiled decode step needs it.

The forward pass is :meth:`Attention.attention_inputs` (projections, per-head norms, RoPE), then
:meth:`Attention.attention` (the part that reads and writes the cache, and the kernel), then
:meth:`Attention.output` (heads merged, output projection): a compiled decode step runs the first
and the last inside compiled graphs and the middle one eagerly (see :mod:`mlxr_core.model.compiled`).
Where the attention kernel offers ``into_cache`` (a cache write and the attention as one primitive:
``cpu_native``'s) and the cache ``write_and_attend``, the middle part is that one call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import KVCache
from mlxr_core.model.fuse import fuse_into
from mlxr_core.model.layers.norms import RMSNorm
from mlxr_core.model.layers.rope import Rotary
from mlxr_core.model.masks import window_mask
from mlxr_core.model.quantized_cache import QUANTIZED_CACHES


class Attention(nn.Module):
    """Grouped-query attention with the Hugging Face module names: ``q_proj``, ``k_proj``,
    ``v_proj`` (or one ``qkv_proj``: built so with ``fused_qkv``, or joined after loading by
    :meth:`fuse_projections`), ``o_proj``, and with ``head_norm_eps`` an RMS norm over each query
    and key head before RoPE (``q_norm``, ``k_norm``). ``window`` limits every query to its last
    ``window`` positions; ``sinks`` adds one learned logit per head to the softmax (gpt-oss)."""

    #: Under tensor parallelism (:mod:`mlxr_core.model.tensor_parallel`), the ranks this layer's
    #: heads are split across: the output projection's partial sums are added up over them.
    tensor_group: Any = None

    def __init__(
        self,
        hidden: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        kernels: KernelSet,
        rotary: Rotary | Callable[[mx.array, int | mx.array], mx.array],
        scale: float | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        head_norm_eps: float | None = None,
        norm_offset: float = 0.0,
        window: int | None = None,
        fused_qkv: bool = False,
        sinks: bool = False,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        D = head_dim
        if fused_qkv:
            self.qkv_proj = nn.Linear(hidden, (n_heads + 2 * n_kv_heads) * D, bias=qkv_bias)
        else:
            self.q_proj = nn.Linear(hidden, n_heads * D, bias=qkv_bias)
            self.k_proj = nn.Linear(hidden, n_kv_heads * D, bias=qkv_bias)
            self.v_proj = nn.Linear(hidden, n_kv_heads * D, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * D, hidden, bias=out_bias)
        #: Whether queries and keys are RMS-normalized per head (Qwen3, Gemma 3).
        self.head_norms = head_norm_eps is not None
        if head_norm_eps is not None:
            self.q_norm = RMSNorm(D, head_norm_eps, kernels, offset=norm_offset)
            self.k_norm = RMSNorm(D, head_norm_eps, kernels, offset=norm_offset)
        if sinks:
            self.sinks = mx.zeros((n_heads,))
        self.window = window
        self._rotary = rotary
        self._attention = kernels.attention

    def fused_heads(self, x: mx.array) -> mx.array:
        """``qkv_proj``'s output as ``[B, L, n_heads + 2 * n_kv_heads, head_dim]``: the query heads,
        then the key heads, then the value heads."""
        B, L, _ = x.shape
        heads: mx.array = self.qkv_proj(x).reshape(B, L, -1, self.head_dim)
        return heads

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``[B, L, hidden]`` -> queries, keys, values as ``[B, L, heads, head_dim]``."""
        B, L, _ = x.shape
        if "qkv_proj" in self:
            heads = self.fused_heads(x)
            q_end, k_end = self.n_heads, self.n_heads + self.n_kv_heads
            queries, keys, values = mx.split(heads, [q_end, k_end], axis=2)
            return queries, keys, values
        return (
            self.q_proj(x).reshape(B, L, self.n_heads, -1),
            self.k_proj(x).reshape(B, L, self.n_kv_heads, -1),
            self.v_proj(x).reshape(B, L, self.n_kv_heads, -1),
        )

    def fuse_projections(self) -> bool:
        """Replace ``q_proj``, ``k_proj`` and ``v_proj`` by one ``qkv_proj`` (see
        :mod:`mlxr_core.model.fuse`); False when they cannot be joined."""
        return fuse_into(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"))

    def queries_keys_values(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``[B, L, hidden]`` -> queries, keys, values as ``[B, heads, L, head_dim]``, before RoPE."""
        queries, keys, values = self.project(x)
        if self.head_norms:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        return queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)

    def attention_inputs(
        self, x: mx.array, offset: int | mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Queries and keys rotated at ``offset`` (an int, or an array: scalar or one per row),
        and values, as ``[B, heads, L, head_dim]``. With one ``qkv_proj`` and no per-head norms,
        the query and key heads lie side by side in its output and are rotated by one RoPE call
        (one kernel fewer per layer).

        A decode step's graph is built with as few primitives as it can be, since a one-token step
        on a GPU is bound by the host's cost per primitive: one position's heads are a reshape of
        the projection (no transpose), and each cut is one split (one primitive, not a slice per
        part)."""
        if not self.head_norms and "qkv_proj" in self:
            B, L, _ = x.shape
            if L == 1:  # [B, 1, heads, D] and [B, heads, 1, D] have the same memory order
                heads = self.qkv_proj(x).reshape(B, -1, 1, self.head_dim)
            else:
                heads = self.fused_heads(x).transpose(0, 2, 1, 3)
            q_end, k_end = self.n_heads, self.n_heads + self.n_kv_heads
            rotate, values = mx.split(heads, [k_end], axis=1)
            queries, keys = mx.split(self._rotary(rotate, offset), [q_end], axis=1)
            return queries, keys, values
        queries, keys, values = self.queries_keys_values(x)
        return self._rotary(queries, offset), self._rotary(keys, offset), values

    def attention(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        mask: str | mx.array | None,
        cache: KVCache | None,
    ) -> mx.array:
        """The new positions' keys and values into ``cache``, then attention over all of it:
        ``[B, heads, L, D]`` -> ``[B, heads, L, D]`` (heads not yet merged, so that a compiled
        step does the merge inside its graph). A quantized cache
        (:mod:`mlxr_core.model.quantized_cache`) attends over its packed keys and values itself."""
        extra: dict[str, Any] = {"sinks": self["sinks"]} if "sinks" in self else {}
        if isinstance(cache, QUANTIZED_CACHES):
            return cache.update_and_attend(
                queries, keys, values, scale=self.scale, mask=mask, window=self.window,
                attention=self._attention, **extra,
            )  # fmt: skip
        if cache is not None:
            # A kernel that writes the cache and attends in one primitive (cpu_native's), for a
            # cache that hands it its buffers: a one-token step's fewest primitives.
            into_cache = getattr(self._attention, "into_cache", None)
            write_and_attend = getattr(cache, "write_and_attend", None)
            if into_cache is not None and write_and_attend is not None and not extra:
                out: mx.array | None = write_and_attend(
                    queries, keys, values, into_cache, scale=self.scale, mask=mask, window=self.window
                )
                if out is not None:
                    return out
            keys, values = cache.update_and_fetch(keys, values)
        if self.window is not None:
            mask = window_mask(mask, queries.shape[2], keys.shape[2], self.window)
        attended: mx.array = self._attention(queries, keys, values, scale=self.scale, mask=mask, **extra)
        return attended

    def weights(
        self, queries: mx.array, keys: mx.array, mask: str | None = None, heads: Sequence[int] | None = None
    ) -> mx.array:
        """Where the queries looked: ``softmax(scale * q @ k.T)`` as ``[B, heads, L, S]`` in
        float32, for the query ``heads`` asked (all by default; each reads its key head);
        ``"causal"`` is aligned bottom-right, as the kernels align it. A kernel returns only the
        weighted values, so a model that reports its weights (Whisper's word timings) asks for
        them beside the kernel's call, on the same queries and keys."""
        chosen = list(range(self.n_heads)) if heads is None else list(heads)
        group = self.n_heads // self.n_kv_heads
        L, S = queries.shape[2], keys.shape[2]
        picked = keys[:, [head // group for head in chosen]]
        scores = ((queries[:, chosen] * self.scale) @ picked.swapaxes(-1, -2)).astype(mx.float32)
        if mask == "causal":
            scores = mx.where(mx.arange(S - L, S)[:, None] >= mx.arange(S)[None, :], scores, -mx.inf)
        elif mask is not None:
            raise ValueError(f"attention weights take no mask or 'causal', not {mask!r}")
        return mx.softmax(scores, axis=-1)

    def output(self, out: mx.array) -> mx.array:
        """Attention's ``[B, heads, L, D]`` -> ``[B, L, hidden]``: heads merged, projected."""
        B, _, L, _ = out.shape
        # One position: merging the heads is a reshape (see attention_inputs).
        merged = out.reshape(B, 1, -1) if L == 1 else out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        result: mx.array = self.o_proj(merged)
        if self.tensor_group is not None:
            result = mx.distributed.all_sum(result, group=self.tensor_group)
        return result

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: KVCache | None) -> mx.array:
        """``[B, L, hidden]`` -> ``[B, L, hidden]``, advancing ``cache``."""
        offset = cache.offset if cache is not None else 0
        return self.output(self.attention(*self.attention_inputs(x, offset), mask, cache))
