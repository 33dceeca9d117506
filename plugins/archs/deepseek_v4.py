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
position, and as values nothing (sliding layers: zero features) or the compressors' per-position
projections (the indexer's too), from which the entries are summed at each step for every row at
its own windows. So batching, rollback and the prefix cache work as for any attention layer, at
the cost of summing every window again at each step (a cost of the order of the attention's own). Weights load under the
names transformers saves (DeepSeek's own: ``attn.wq_a``, ``ffn.experts.0.w1``, ``hc_attn_fn``).
"""

from __future__ import annotations

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
    SwitchGLU,
    stack_experts,
    weighted_sum,
)
from mlxr_plugins.archs.deepseek_v4_args import HASH, DeepseekV4Args
from mlxr_plugins.archs.deepseek_v4_attention import DeepseekV4Attention, unit_rms

#: DeepSeek's expert tensors -> the stacked projections of :class:`SwitchGLU`.
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
#: A released checkpoint's top-level names -> transformers' (as it saves them).
TOP_LEVEL = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
             "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
             "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}

def clamped_swiglu(limit: float) -> Any:
    """``silu(min(gate, limit)) * clip(up, -limit, limit)``, one fused kernel."""

    @partial(mx.compile, shapeless=True)
    def activation(gate: mx.array, up: mx.array) -> mx.array:
        return nn.silu(mx.minimum(gate, limit)) * mx.clip(up, -limit, limit)

    return activation

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
        return hyper_connect(self, h, part)

    def __call__(self, h: mx.array, mask: str | mx.array | None, cache: KVCache | None, ids: mx.array) -> mx.array:
        post, comb, x = self.connect(h, "attn")
        h = post[..., None] * self.attn(self.attn_norm(x), mask, cache)[:, :, None] + comb.swapaxes(-1, -2) @ h
        post, comb, x = self.connect(h, "ffn")
        return post[..., None] * self.ffn(self.ffn_norm(x), ids)[:, :, None] + comb.swapaxes(-1, -2) @ h


def hyper_connect(block: Any, h: mx.array, part: str) -> tuple[mx.array, mx.array, mx.array]:
    """The hyper-connection of ``block`` before its ``part`` (``attn`` or ``ffn``), from its
    ``hc_{part}_fn``, ``_base`` and ``_scale`` and its ``streams``, ``eps`` (the RMS norm's),
    ``hc_eps`` and Sinkhorn ``iterations``: ``(post [B, L, N], comb [B, L, N, N], the part's input
    [B, L, hidden])``."""
    N, eps = block.streams, block.hc_eps
    base, scale = block[f"hc_{part}_base"].astype(mx.float32), block[f"hc_{part}_scale"].astype(mx.float32)
    pre, post, comb = mx.split(hyper_weights(h, block[f"hc_{part}_fn"], block.eps), [N, 2 * N], axis=-1)
    pre = mx.sigmoid(pre * scale[0] + base[:N]) + eps
    post = 2 * mx.sigmoid(post * scale[1] + base[N : 2 * N])
    comb = mx.softmax(comb.reshape(*comb.shape[:-1], N, N) * scale[2] + base[2 * N :].reshape(N, N), axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(block.iterations - 1):  # Sinkhorn-Knopp: rows, then columns, sum to 1
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    collapsed = (pre[..., None] * h).sum(axis=2).astype(h.dtype)
    return post.astype(h.dtype), comb.astype(h.dtype), collapsed


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
