"""DeepSeek-V4 as transformers 5.25 defines it (``DeepseekV4ForCausalLM``).

- Residual: ``hc_mult`` streams per position (manifold-constrained hyper-connections). Before each
  attention and each feed-forward, a projection of the RMS-normalized streams (``hc_*_fn``, scaled
  by ``hc_*_scale``, shifted by ``hc_*_base``) gives ``pre`` (sigmoid: the weights collapsing the
  streams into the block's input), ``post`` (2 sigmoid: the weights spreading its output back) and
  ``comb`` (softmax rows, then Sinkhorn-Knopp to a doubly stochastic matrix mixing the streams):
  ``h = post * block(norm(pre . h)) + comb^T h``. The model collapses the streams at the end the
  same way (``hc_head``) before the final norm.
- Attention: queries through a ``q_lora_rank`` bottleneck (``q_norm``), then RMS-normalized per head
  without a weight; one key per position that is also the value (``wkv``, ``norm``); RoPE on the
  trailing ``head_dim * partial_rotary_factor`` features in interleaved pairs, and the opposite
  rotation at the query's position on the output; a learned sink logit per head; a window of
  ``sliding_window`` positions; the output through ``o_groups`` block-diagonal projections
  (``wo_a``) then ``wo_b``. ``sliding_attention`` layers rotate with the ``main`` RoPE.
- Compressed layers add entries to every query's keys, each a softmax-gated sum of ``rate``
  positions' projections (``compressor.wkv``, ``wgate`` plus the per-slot bias ``ape``),
  RMS-normalized and rotated at the window's first position with the ``compress`` RoPE; a query
  sees the entries of windows it has completed. ``heavily_compressed_attention`` sums windows of
  ``compress_rates`` positions; ``compressed_sparse_attention`` sums two series over overlapping
  windows (a window's second half of the features with the previous window's first), of which a
  lightning indexer (``indexer``: entries of its own, scored by ``index_n_heads`` ReLU heads)
  lets each query see its ``index_topk`` best (all of them while it may see no more).
- Feed-forward: ``n_routed_experts`` SwiGLU experts with gate clamped above and up on both sides at
  ``swiglu_limit``, scored by ``sqrtsoftplus`` (or ``sigmoid``); ``moe`` layers choose the best of
  the scores plus ``gate.bias``, ``hash_moe`` layers the experts ``gate.tid2eid`` lists for the
  token; the chosen scores renormalized, times ``routed_scaling_factor``; one clamped shared expert.

The cache of a layer is a plain :class:`~mlxr_core.model.cache.KVCache`: the rotated key of every
position, and as values either the key again (sliding layers) or the compressors' per-position
projections (the indexer's too), from which the entries are summed at each step for every row at
its own windows. So batching, rollback and the prefix cache work as for any attention layer, at
the cost of summing every window again at each step (a cost of the order of the attention's own). Weights load under the
names transformers saves (DeepSeek's own: ``attn.wq_a``, ``ffn.experts.0.w1``, ``hc_attn_fn``).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import KVCache
from mlxr_core.model.layers import (
    CausalLM,
    DecoderArchitecture,
    RMSNorm,
    Rotary,
    SwitchGLU,
    rope_type,
    stack_experts,
    weighted_sum,
)
from mlxr_core.model.layers.rope import yarn_rope
from mlxr_plugins.archs.deepseek_v4_args import CSA, HASH, DeepseekV4Args

#: DeepSeek's expert tensors -> the stacked projections of :class:`SwitchGLU`.
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
#: A released checkpoint's top-level names -> transformers' (as it saves them).
TOP_LEVEL = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
             "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
             "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}


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


def clamped_swiglu(limit: float) -> Any:
    """``silu(min(gate, limit)) * clip(up, -limit, limit)``, one fused kernel."""

    @partial(mx.compile, shapeless=True)
    def activation(gate: mx.array, up: mx.array) -> mx.array:
        return nn.silu(mx.minimum(gate, limit)) * mx.clip(up, -limit, limit)

    return activation


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
        """Numbers a position takes in the cache: the key, and the key again or the projections."""
        if "compressor" not in self:
            return 2 * self.head_dim
        indexed = self.indexer.compressor.width if "indexer" in self else 0
        return self.head_dim + self.compressor.width + indexed

    def projections(self, x: mx.array, keys: mx.array) -> mx.array:
        """The cache's values of ``[B, L, hidden]``: the compressors' projections, else the keys."""
        if "compressor" not in self:
            return keys
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


class Router(nn.Module):
    """``gate``: ``weight [experts, hidden]``, and ``bias [experts]`` (learned choice) or
    ``tid2eid [vocab, top_k]`` (the experts of each token, ``hash_moe``)."""

    def __init__(self, args: DeepseekV4Args, hashed: bool):
        super().__init__()
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        if hashed:
            self.tid2eid = mx.zeros((args.vocab_size, args.num_experts_per_tok), dtype=mx.int32)
        else:
            self.bias = mx.zeros((args.n_routed_experts,))


class ClampedMLP(nn.Module):
    """The shared expert: ``w2(silu(min(w1 x, limit)) * clip(w3 x, -limit, limit))``."""

    def __init__(self, hidden: int, inner: int, limit: float):
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self._activation = clamped_swiglu(limit)

    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array = self.w2(self._activation(self.w1(x), self.w3(x)))
        return out


class DeepseekV4MoE(nn.Module):
    """``ffn``: routed experts (``switch_mlp``) and the shared one (``shared_experts``)."""

    def __init__(self, args: DeepseekV4Args, layer: int, kernels: KernelSet):
        super().__init__()
        assert args.mlp_layer_types is not None
        E, inner = args.n_routed_experts, args.intermediate_size
        self.gate = Router(args, args.mlp_layer_types[layer] == HASH)
        self.switch_mlp = SwitchGLU(args.hidden_size, inner, E, kernels=kernels,
                                    activation=clamped_swiglu(args.swiglu_limit), top_k=args.num_experts_per_tok)
        self.shared_experts = ClampedMLP(args.hidden_size, inner, args.swiglu_limit)
        self.top_k, self.scoring, self.scale = args.num_experts_per_tok, args.scoring_func, args.routed_scaling_factor

    def __call__(self, x: mx.array, ids: mx.array) -> mx.array:
        logits = x.astype(mx.float32) @ self.gate.weight.astype(mx.float32).T
        scores = mx.sqrt(mx.logaddexp(logits, 0.0)) if self.scoring == "sqrtsoftplus" else mx.sigmoid(logits)
        if "tid2eid" in self.gate:
            indices = self.gate.tid2eid[ids]
        else:
            choice = scores + self.gate.bias.astype(mx.float32)
            indices = mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        weights = mx.take_along_axis(scores, indices, axis=-1)
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20) * self.scale
        routed = weighted_sum(self.switch_mlp(x, indices.astype(mx.uint32)), weights)
        return routed + self.shared_experts(x)


def hyper_weights(h: mx.array, fn: mx.array, eps: float) -> mx.array:
    """The streams' mixing logits: RMS-normalized ``h [B, L, N, hidden]`` flattened, times ``fn``."""
    B, L = h.shape[:2]
    return unit_rms(h.reshape(B, L, -1).astype(mx.float32), eps) @ fn.astype(mx.float32).T


class DeepseekV4Block(nn.Module):
    """A decoder layer over ``hc_mult`` residual streams ``[B, L, N, hidden]``."""

    def __init__(self, args: DeepseekV4Args, layer: int, kernels: KernelSet):
        super().__init__()
        H, N, eps = args.hidden_size, args.hc_mult, args.rms_norm_eps
        self.attn = DeepseekV4Attention(args, layer, kernels)
        self.ffn = DeepseekV4MoE(args, layer, kernels)
        self.attn_norm, self.ffn_norm = RMSNorm(H, eps, kernels), RMSNorm(H, eps, kernels)
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", mx.zeros(((2 + N) * N, N * H)))
            setattr(self, f"hc_{part}_base", mx.zeros(((2 + N) * N,)))
            setattr(self, f"hc_{part}_scale", mx.ones((3,)))
        self.streams, self.eps, self.hc_eps, self.iterations = N, eps, args.hc_eps, args.hc_sinkhorn_iters

    def connect(self, h: mx.array, part: str) -> tuple[mx.array, mx.array, mx.array]:
        """``(post [B, L, N], comb [B, L, N, N], the block's input [B, L, hidden])`` before ``part``."""
        N, eps = self.streams, self.hc_eps
        base, scale = self[f"hc_{part}_base"].astype(mx.float32), self[f"hc_{part}_scale"].astype(mx.float32)
        pre, post, comb = mx.split(hyper_weights(h, self[f"hc_{part}_fn"], self.eps), [N, 2 * N], axis=-1)
        pre = mx.sigmoid(pre * scale[0] + base[:N]) + eps
        post = 2 * mx.sigmoid(post * scale[1] + base[N : 2 * N])
        comb = mx.softmax(comb.reshape(*comb.shape[:-1], N, N) * scale[2] + base[2 * N :].reshape(N, N), axis=-1) + eps
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
        for _ in range(self.iterations - 1):  # Sinkhorn-Knopp: rows, then columns, sum to 1
            comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
            comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
        collapsed = (pre[..., None] * h).sum(axis=2).astype(h.dtype)
        return post.astype(h.dtype), comb.astype(h.dtype), collapsed

    def __call__(self, h: mx.array, mask: str | mx.array | None, cache: KVCache | None, ids: mx.array) -> mx.array:
        post, comb, x = self.connect(h, "attn")
        h = post[..., None] * self.attn(self.attn_norm(x), mask, cache)[:, :, None] + comb.swapaxes(-1, -2) @ h
        post, comb, x = self.connect(h, "ffn")
        return post[..., None] * self.ffn(self.ffn_norm(x), ids)[:, :, None] + comb.swapaxes(-1, -2) @ h


class HyperHead(nn.Module):
    """``hc_head``: the streams collapsed by sigmoid weights before the final norm."""

    def __init__(self, args: DeepseekV4Args):
        super().__init__()
        N = args.hc_mult
        self.hc_fn, self.hc_base, self.hc_scale = mx.zeros((N, N * args.hidden_size)), mx.zeros((N,)), mx.ones((1,))
        self.eps, self.hc_eps = args.rms_norm_eps, args.hc_eps

    def __call__(self, h: mx.array) -> mx.array:
        mixes = hyper_weights(h, self.hc_fn, self.eps) * self.hc_scale.astype(mx.float32)
        pre = mx.sigmoid(mixes + self.hc_base.astype(mx.float32)) + self.hc_eps
        return (pre[..., None] * h).sum(axis=2).astype(h.dtype)


class DeepseekV4Model(nn.Module):
    """``model.*``: token ids ``[B, L]`` -> final normed hidden states ``[B, L, hidden]``."""

    def __init__(self, args: DeepseekV4Args, kernels: KernelSet):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DeepseekV4Block(args, layer, kernels) for layer in range(args.num_hidden_layers)]
        self.hc_head = HyperHead(args)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
        self.streams = args.hc_mult

    def __call__(
        self, inputs: mx.array, cache: list[Any] | None = None, mask: str | mx.array | None = None,
        embeddings: mx.array | None = None,
    ) -> mx.array:
        x = self.embed_tokens(inputs) if embeddings is None else embeddings
        B, L, H = x.shape
        h = mx.broadcast_to(x[:, :, None], (B, L, self.streams, H))
        for layer, layer_cache in zip(self.layers, cache or [None] * len(self.layers), strict=True):
            h = layer(h, mask, layer_cache, inputs)
        normed: mx.array = self.norm(self.hc_head(h))
        return normed


class DeepseekV4(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: DeepseekV4Args, kernels: KernelSet):
        super().__init__(DeepseekV4Model(args, kernels), tied=args.tie_word_embeddings)  # type: ignore[arg-type]
        self.args = args


class DeepseekV4Architecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``deepseek_v4``."""

    args_class = DeepseekV4Args

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return DeepseekV4(self.args(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """A released checkpoint's top-level names as transformers saves them; the indexers' and
        the multi-token-prediction layers' weights set aside; experts stacked."""
        args = self.args(config)
        named: dict[str, mx.array] = {}
        for name, array in weights.items():
            bare = name.removeprefix("model.")
            name = TOP_LEVEL.get(bare, name if name.startswith(("model.", "lm_head.")) else f"model.{name}")
            parts = name.split(".")
            past = len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= args.num_hidden_layers
            if bare.startswith("mtp.") or past:
                continue
            named[name] = array
        stacked = stack_experts(named, "ffn.experts", "ffn.switch_mlp", EXPERT_NAMES, args.n_routed_experts)
        return super().sanitize(stacked, config)

    def make_cache(self, model: nn.Module) -> list[Any]:
        """One :class:`KVCache` a layer, declaring what a position takes (see the module docstring)."""
        return [KVCache(width=layer.attn.cache_width) for layer in model.layers]

    def kernel_context(self, config: dict[str, Any]) -> dict[str, Any]:
        """The common shapes, and attention sinks (not every attention backend takes them)."""
        return {**super().kernel_context(config), "sinks": True}
