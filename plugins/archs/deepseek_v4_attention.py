"""DeepSeek-V4's attention (:mod:`mlxr_plugins.archs.deepseek_v4`): one key a position that is
also the value, rotated on its trailing features, a window, sinks, grouped output projections; in
compressed layers, the compressors' entries after the window's keys and, in compressed-sparse
ones, the lightning indexer choosing among them. It reads and writes its own cache (see
:meth:`DeepseekV4Attention.__call__`).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import KVCache
from mlxr_core.model.layers import RMSNorm, Rotary, rope_type
from mlxr_core.model.layers.rope import yarn_rope
from mlxr_plugins.archs.deepseek_v4_args import CSA, DeepseekV4Args


def make_rotary(args: DeepseekV4Args, kernels: KernelSet, name: str, scale: float = 1.0) -> Rotary:
    """The ``main`` or ``compress`` RoPE (interleaved pairs), positions times ``scale``. transformers
    reads YaRN's ``truncate`` from the top of ``rope_parameters``, where V4 has none: it truncates."""
    rope = args.resolve_ropes()[name]
    dims = args.rope_dims_of(rope)
    base = float(rope.get("rope_theta") or (args.rope_theta if name == "main" else args.compress_rope_theta))
    if rope_type(rope) == "yarn":
        scaling = {key: value for key, value in rope.items() if key != "truncate"}
        freqs, factor = yarn_rope(dims, base, scaling, args.max_position_embeddings)
        return Rotary(kernels, dims, freqs=freqs, scale=scale, traditional=True, factor=factor)
    return Rotary(kernels, dims, base=base, scale=scale, traditional=True)


def rotate_tail(rotary: Rotary, x: mx.array, offset: int | mx.array) -> mx.array:
    """RoPE on the last ``rotary.dims`` features of ``x [B, heads, L, D]`` (V4 puts them last)."""
    kept = x.shape[-1] - rotary.dims
    if kept == 0:
        return rotary(x, offset)
    return mx.concatenate([x[..., :kept], rotary(x[..., kept:], offset)], axis=-1)


def unit_rms(x: mx.array, eps: float) -> mx.array:
    """RMS normalization over the last axis without a weight, in float32."""
    x32 = x.astype(mx.float32)
    return (x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class Compressor(nn.Module):
    """A compressed layer's entries from its per-position projections ``wkv`` and ``wgate``."""

    def __init__(self, args: DeepseekV4Args, rate: int, overlap: bool, kernels: KernelSet, head_dim: int):
        super().__init__()
        D = head_dim
        width = 2 * D if overlap else D
        self.wkv = nn.Linear(args.hidden_size, width, bias=False)
        self.wgate = nn.Linear(args.hidden_size, width, bias=False)
        self.ape = mx.zeros((rate, width))
        self.norm = RMSNorm(D, args.rms_norm_eps, kernels)
        self.rate, self.overlap, self.head_dim = rate, overlap, D
        self._rotary = make_rotary(args, kernels, "compress", scale=rate)  # entry w sits at w * rate

    @property
    def width(self) -> int:
        """Numbers a position's projections take (what the cache keeps of it)."""
        return 2 * int(self.wkv.weight.shape[0])

    def projections(self, x: mx.array) -> list[mx.array]:
        """``[B, L, hidden]`` -> what the cache keeps per position, ``[B, L, width]`` arrays."""
        return [self.wkv(x), self.wgate(x)]

    def __call__(self, rows: mx.array) -> mx.array:
        """Entries ``[B, 1, W, D]`` of the ``W`` windows in ``rows [B, W * rate, width]`` (each
        row's positions from its first on)."""
        B, T, _ = rows.shape
        D, m = self.head_dim, self.rate
        kv, gate = mx.split(rows.reshape(B, T // m, m, -1).astype(mx.float32), 2, axis=-1)
        gate = gate + self.ape.astype(mx.float32)
        if self.overlap:  # each entry also sums the previous window's first series (none before window 0)
            kv = mx.concatenate([_shift(kv[..., :D], 0.0), kv[..., D:]], axis=2)
            gate = mx.concatenate([_shift(gate[..., :D], -math.inf), gate[..., D:]], axis=2)
        pooled = (kv * mx.softmax(gate, axis=2, precise=True)).sum(axis=2).astype(rows.dtype)
        return rotate_tail(self._rotary, self.norm(pooled)[:, None], 0)


def _shift(series: mx.array, fill: float) -> mx.array:
    """``[B, W, m, D]`` moved one window later along axis 1, the first window filled with ``fill``."""
    first = mx.full((series.shape[0], 1, *series.shape[2:]), fill, dtype=series.dtype)
    return mx.concatenate([first, series[:, :-1]], axis=1)


class Indexer(nn.Module):
    """The lightning indexer of a compressed-sparse layer: entries of its own (``compressor``, of
    ``index_head_dim``) scored against ``index_n_heads`` queries from the query bottleneck
    (``wq_b``), ``sum_h weights_proj_h * relu(q_h . k)``; each query keeps the ``index_topk`` best
    of the entries it may see."""

    def __init__(self, args: DeepseekV4Args, rate: int, kernels: KernelSet):
        super().__init__()
        self.heads, self.head_dim, self.top_k = args.index_n_heads, args.index_head_dim, args.index_topk
        self.compressor = Compressor(args, rate, True, kernels, args.index_head_dim)
        self.wq_b = nn.Linear(args.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(args.hidden_size, self.heads, bias=False)
        self._rotary = make_rotary(args, kernels, "compress")

    def __call__(
        self, rows: mx.array, x: mx.array, q_residual: mx.array, offset: int | mx.array, seen: mx.array
    ) -> mx.array:
        """``seen [B, L, W]`` (the entries each query may see) narrowed to the ``index_topk`` each
        query scores best; ``rows`` the indexer's projections of the ``W`` windows."""
        if seen.shape[-1] <= self.top_k:
            return seen  # every entry a query may see is among its best
        B, L, _ = x.shape
        keys = self.compressor(rows)  # [B, 1, W, d]
        queries = self.wq_b(q_residual).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
        queries = rotate_tail(self._rotary, queries, offset).astype(mx.float32)
        scores = mx.maximum(queries @ keys.astype(mx.float32).swapaxes(-1, -2), 0.0) * self.head_dim**-0.5
        weights = self.weights_proj(x).astype(mx.float32).transpose(0, 2, 1)[..., None] * self.heads**-0.5
        total = mx.where(seen, (scores * weights).sum(axis=1), -math.inf)  # [B, L, W]
        best = mx.argpartition(-total, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        kept = mx.put_along_axis(mx.zeros(total.shape, dtype=mx.bool_), best, mx.array(True), axis=-1)
        return seen & kept


class GroupedLinear(nn.Module):
    """``groups`` independent projections of ``[..., groups, in]`` (``weight [groups * out, in]``)."""

    def __init__(self, in_dims: int, out_dims: int, groups: int):
        super().__init__()
        self.weight = mx.zeros((out_dims, in_dims))
        self.groups = groups

    def __call__(self, x: mx.array) -> mx.array:
        *lead, G, in_dims = x.shape
        w = self.weight.reshape(G, -1, in_dims)
        out = x.reshape(-1, G, in_dims).transpose(1, 0, 2) @ w.transpose(0, 2, 1)  # [G, N, out]
        return out.transpose(1, 0, 2).reshape(*lead, -1)


class DeepseekV4Attention(nn.Module):
    """One attention layer (see the module docstring), reading and writing its own cache."""

    def __init__(self, args: DeepseekV4Args, layer: int, kernels: KernelSet):
        super().__init__()
        H, D, hidden, eps = args.num_attention_heads, args.dims, args.hidden_size, args.rms_norm_eps
        self.wq_a = nn.Linear(hidden, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, eps, kernels)
        self.wq_b = nn.Linear(args.q_lora_rank, H * D, bias=False)
        self.wkv = nn.Linear(hidden, D, bias=False)
        self.norm = RMSNorm(D, eps, kernels)
        self.wo_a = GroupedLinear(H * D // args.o_groups, args.o_groups * args.o_lora_rank, args.o_groups)
        self.wo_b = nn.Linear(args.o_groups * args.o_lora_rank, hidden, bias=False)
        self.attn_sink = mx.zeros((H,))
        rate = args.compress_rate(layer)
        rope = "main" if rate is None else "compress"
        self._rotary, self._unrotary = make_rotary(args, kernels, rope), make_rotary(args, kernels, rope, -1.0)
        assert args.layer_types is not None
        sparse = args.layer_types[layer] == CSA
        if rate is not None:
            self.compressor = Compressor(args, rate, sparse, kernels, D)
        if sparse and rate is not None:
            self.indexer = Indexer(args, rate, kernels)
        self.heads, self.head_dim, self.eps, self.groups = H, D, eps, args.o_groups
        self.window = args.sliding_window or args.max_position_embeddings
        self.scale = D**-0.5
        self._attention = kernels.attention

    @property
    def cache_width(self) -> int:
        """Numbers a position takes in the cache: the key, and the compressors' projections."""
        if "compressor" not in self:
            return self.head_dim
        indexed = self.indexer.compressor.width if "indexer" in self else 0
        return self.head_dim + self.compressor.width + indexed

    def projections(self, x: mx.array, keys: mx.array) -> mx.array:
        """The cache's values of ``[B, L, hidden]``: the compressors' projections, else nothing (the
        keys are the values, and a sliding layer stores no more)."""
        if "compressor" not in self:
            return keys[..., :0]
        parts = self.compressor.projections(x)
        if "indexer" in self:
            parts += self.indexer.compressor.projections(x)
        return mx.concatenate(parts, axis=-1)[:, None]

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: KVCache | None) -> mx.array:
        B, L, _ = x.shape
        offset = cache.offset if cache is not None else 0
        q_residual = self.q_norm(self.wq_a(x))
        queries = self.wq_b(q_residual).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
        queries = rotate_tail(self._rotary, unit_rms(queries, self.eps), offset)
        keys = rotate_tail(self._rotary, self.norm(self.wkv(x))[:, None], offset)  # [B, 1, L, D]
        stored = self.projections(x, keys)
        if cache is not None:
            keys, stored = cache.update_and_fetch(keys, stored)
        S = keys.shape[2]
        rows, cols = mx.arange(S - L, S)[:, None], mx.arange(S)[None, :]
        visible = (cols <= rows) & (rows - cols < self.window)  # [L, S]
        if isinstance(mask, mx.array):
            visible = visible & (mask if mask.dtype == mx.bool_ else mask > -math.inf)
        if "compressor" in self and self.compressor.rate <= S:
            keys, visible = self.compressed(keys, visible, stored, offset, x, q_residual)
        out = self._attention(queries, keys, keys, scale=self.scale, mask=visible, sinks=self.attn_sink)
        out = rotate_tail(self._unrotary, out, offset).transpose(0, 2, 1, 3).reshape(B, L, self.groups, -1)
        result: mx.array = self.wo_b(self.wo_a(out))
        return result

    def compressed(
        self, keys: mx.array, visible: mx.array, stored: mx.array, offset: int | mx.array, x: mx.array,
        q_residual: mx.array,
    ) -> tuple[mx.array, mx.array]:
        """The keys with every row's compressed entries after them, and the mask letting a query at
        position ``t`` of its row see entry ``w`` when ``(w + 1) * rate <= t + 1`` (and, with an
        indexer, when it is among the query's best). A row of a batch starts after its left
        padding, ``S - L - offset`` positions: its windows start there."""
        B, _, S, _ = keys.shape
        L = x.shape[1]
        m = self.compressor.rate
        W = S // m  # the most any row has; a shorter row's extra windows are never visible
        steps = mx.arange(W * m)
        if isinstance(offset, int):
            rows = stored[:, 0, S - L - offset :][:, : W * m]
            W = rows.shape[1] // m
            rows = rows[:, : W * m]
        else:
            index = mx.minimum((S - L - offset)[:, None] + steps[None, :], S - 1)
            rows = mx.take_along_axis(stored[:, 0], index[..., None], axis=1)
        if W == 0:
            return keys, visible
        positions = mx.arange(L)[None, :] + (offset[:, None] if isinstance(offset, mx.array) else offset)
        seen = mx.arange(W)[None, None, :] < ((positions + 1) // m)[..., None]  # [B, L, W]
        rows, indexed = mx.split(rows, [self.compressor.width], axis=-1)
        if "indexer" in self:
            seen = self.indexer(indexed, x, q_residual, offset, seen)
        visible = mx.broadcast_to(visible, (B, 1, L, S))
        return (mx.concatenate([keys, self.compressor(rows)], axis=2),
                mx.concatenate([visible, seen[:, None]], axis=-1))
