"""Multi-head latent attention (DeepSeek-V2/V3): keys and values compressed into one latent per
token, and cached compressed.

Per token, with ``R`` = ``kv_lora_rank``, ``P`` = ``qk_rope_head_dim`` and per head ``N`` =
``qk_nope_head_dim``, ``V`` = ``v_head_dim``::

    q_nope, q_pe = split(q_b_proj(norm(q_a_proj(x))) or q_proj(x), [N])   # per head, N + P
    c, k_pe = split(kv_a_proj_with_mqa(x), [R]);  c = kv_a_layernorm(c)  # k_pe: one key for all heads
    cache <- (c, rope(k_pe))                                              # R + P numbers a layer
    k_nope_h = W_UK_h c,  v_h = W_UV_h c                                  # kv_b_proj = [W_UK; W_UV]
    score_h = scale * (q_nope_h . k_nope_h + rope(q_pe_h) . rope(k_pe))

The cache is an ordinary :class:`~mlxr_core.model.cache.KVCache` holding the latent as its keys
(``[B, 1, S, R]``) and the rotary key as its values (``[B, 1, S, P]``), so batching, the prefix
cache and rollback treat it as any attention layer's; it declares ``R + P`` as its width, which
the KV budget and ``mlxr info`` count.

The same scores are computed in two forms, chosen by the number of new positions ``L``:

- expanded (a prompt chunk, ``L`` > :data:`ABSORBED_UP_TO`): every cached latent expanded into
  per-head keys ``[k_nope | k_pe]`` and values, then the attention kernel as for any layer
  (transformers' form: the expansion costs ``S * H * (N + V)`` per chunk, shared by ``L`` queries);
- absorbed (decode steps and short drafts): ``W_UK`` folded into the query (``q_nope_h W_UK_h``,
  width ``R``), so the kernel attends over the cached latents themselves, one key/value head
  shared by every query head; the rotary part of the scores, ``q_pe . k_pe``, enters as the
  kernel's additive mask (mlx-lm's form), and ``W_UV`` is applied to the output.

``kv_b_proj`` is held split per head, as mlx-lm stores it: ``embed_q`` (``W_UK`` transposed,
``[H, R, N]``) and ``unembed_out`` (``W_UV``, ``[H, V, R]``); :func:`split_kv_b_proj` splits a
Hugging Face checkpoint's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import KVCache
from mlxr_core.model.layers.norms import RMSNorm
from mlxr_core.model.layers.rope import Rotary

#: Up to this many new positions attend in the absorbed form, more in the expanded one: the
#: absorbed form costs about ``2R / (N + V)`` times the expanded one's attention per query, the
#: expanded one a pass over every cached latent per call.
ABSORBED_UP_TO = 16


def absorbed(length: int) -> bool:
    """Whether ``length`` new positions attend in the absorbed form (see the module)."""
    return length <= ABSORBED_UP_TO


class PerHeadLinear(nn.Module):
    """One ``[out, in]`` matrix per head, ``weight [heads, out, in]``: ``x [..., heads, L, in] ->
    [..., heads, L, out]`` (``transpose=False``: ``x [..., L, out]`` times each head's matrix,
    ``-> [..., heads, L, in]``)."""

    def __init__(self, in_dims: int, out_dims: int, heads: int):
        super().__init__()
        scale = math.sqrt(1.0 / in_dims)
        self.weight = mx.random.uniform(-scale, scale, (heads, out_dims, in_dims))

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        weight = self["weight"]
        return x @ (weight.swapaxes(-1, -2) if transpose else weight)


class LatentAttention(nn.Module):
    """Multi-head latent attention with the Hugging Face module names (``q_proj``, or ``q_a_proj``,
    ``q_a_layernorm`` and ``q_b_proj`` with a ``q_rank``; ``kv_a_proj_with_mqa``,
    ``kv_a_layernorm``, ``o_proj``) and ``kv_b_proj`` split into ``embed_q`` and ``unembed_out``.
    ``query_scale`` multiplies the rotated queries by a factor of their position (Mistral 4's
    :class:`~mlxr_core.model.layers.rope.PositionScale`).
    Cut as :class:`~mlxr_core.model.layers.attention.Attention` is (``attention_inputs``,
    ``attention``, ``output``), so the blocks and the compiled decode step take it as they take
    that; its cache is :meth:`make_cache`'s."""

    def __init__(
        self,
        hidden: int,
        n_heads: int,
        *,
        kv_rank: int,
        rope_dims: int,
        nope_dims: int,
        value_dims: int,
        q_rank: int | None,
        kernels: KernelSet,
        rotary: Rotary | Callable[[mx.array, int | mx.array], mx.array],
        scale: float,
        bias: bool = False,
        eps: float = 1e-6,
        query_scale: Callable[[mx.array, int | mx.array], mx.array] | None = None,
    ):
        super().__init__()
        self.n_heads, self.kv_rank, self.rope_dims = n_heads, kv_rank, rope_dims
        self.nope_dims, self.value_dims, self.scale = nope_dims, value_dims, scale
        q_width = n_heads * (nope_dims + rope_dims)
        if q_rank is None:
            self.q_proj = nn.Linear(hidden, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_rank, eps, kernels)
            self.q_b_proj = nn.Linear(q_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_rank + rope_dims, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_rank, eps, kernels)
        self.embed_q = PerHeadLinear(nope_dims, kv_rank, n_heads)
        self.unembed_out = PerHeadLinear(kv_rank, value_dims, n_heads)
        self.o_proj = nn.Linear(n_heads * value_dims, hidden, bias=bias)
        self._rotary = rotary
        self._query_scale = query_scale
        self._attention = kernels.attention

    def make_cache(self) -> KVCache:
        """A cache of one latent and one rotary key a position."""
        return KVCache(width=self.kv_rank + self.rope_dims)

    def attention_inputs(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``[B, L, hidden]`` -> the queries ``[B, H, L, N + P]`` (absorbed: ``[B, H, L, R + P]``),
        their rotary part last, rotated at ``offset``; the latents ``[B, 1, L, R]``; the rotary
        keys ``[B, 1, L, P]``, rotated."""
        B, L, _ = x.shape
        q = self.q_proj(x) if "q_proj" in self else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [self.nope_dims], axis=-1)
        latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_rank], axis=-1)
        latent = self.kv_a_layernorm(latent).reshape(B, 1, L, self.kv_rank)
        k_pe = self._rotary(k_pe.reshape(B, 1, L, self.rope_dims), offset)
        if absorbed(L):
            q_nope = self.embed_q(q_nope)
        queries = mx.concatenate([q_nope, self._rotary(q_pe, offset)], axis=-1)
        if self._query_scale is not None:  # a factor per position: it commutes with embed_q
            queries = self._query_scale(queries, offset)
        return queries, latent, k_pe

    def attention(
        self,
        queries: mx.array,
        latent: mx.array,
        k_pe: mx.array,
        mask: str | mx.array | None,
        cache: KVCache | None,
    ) -> mx.array:
        """The new positions' latents and rotary keys into ``cache``, then attention over all of
        them: ``[B, H, L, V]`` (absorbed: ``[B, H, L, R]``, which :meth:`output` expands)."""
        if cache is not None:
            latent, k_pe = cache.update_and_fetch(latent, k_pe)
        B, H, L, _ = queries.shape
        if not absorbed(L):
            k_pe = mx.broadcast_to(k_pe, (B, H, latent.shape[2], self.rope_dims))
            keys = mx.concatenate([self.embed_q(latent, transpose=False), k_pe], axis=-1)
            values = self.unembed_out(latent)
            expanded: mx.array = self._attention(queries, keys, values, scale=self.scale, mask=mask)
            return expanded
        q_latent, q_pe = mx.split(queries, [self.kv_rank], axis=-1)
        rotary_scores = with_mask((q_pe * self.scale) @ k_pe.swapaxes(-1, -2), mask)
        out: mx.array = self._attention(q_latent, latent, latent, scale=self.scale, mask=rotary_scores)
        return out

    def output(self, out: mx.array) -> mx.array:
        """Attention's output -> ``[B, L, hidden]``: the absorbed form's latents through
        ``W_UV``, heads merged, projected."""
        B, _, L, _ = out.shape
        if absorbed(L):
            out = self.unembed_out(out)
        merged = out.reshape(B, 1, -1) if L == 1 else out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        result: mx.array = self.o_proj(merged)
        return result

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: KVCache | None) -> mx.array:
        """``[B, L, hidden]`` -> ``[B, L, hidden]``, advancing ``cache``."""
        offset = cache.offset if cache is not None else 0
        return self.output(self.attention(*self.attention_inputs(x, offset), mask, cache))


def with_mask(scores: mx.array, mask: str | mx.array | None) -> mx.array:
    """Additive scores ``[B, H, L, S]`` with ``mask`` folded in (``"causal"`` bottom-right, a
    boolean or additive array): the attention kernel takes them as its one mask."""
    if mask is None:
        return scores
    L, S = scores.shape[-2:]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask kind {mask!r} (expected 'causal' or an array)")
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None, :]
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    return scores + mask.astype(scores.dtype)


def split_kv_b_proj(
    weights: dict[str, mx.array], heads: int, nope_dims: int, value_dims: int
) -> dict[str, mx.array]:
    """Every ``*.kv_b_proj.weight`` (``[heads * (N + V), R]``) as ``*.embed_q.weight``
    (``[heads, R, N]``) and ``*.unembed_out.weight`` (``[heads, V, R]``); folders that hold those
    already (mlx-lm's) pass through.

    :raises ModelLoadError: a packed ``kv_b_proj`` (``scales`` beside it), or one of another shape
        (named)."""
    out: dict[str, mx.array] = {}
    for name, array in weights.items():
        module, _, part = name.rpartition(".")
        if not module.endswith("kv_b_proj"):
            out[name] = array
            continue
        if part != "weight":
            raise ModelLoadError(
                f"a packed or biased kv_b_proj ({part}) is not supported; dequantize it", tensor=name
            )
        if array.ndim != 2 or array.shape[0] != heads * (nope_dims + value_dims):
            raise ModelLoadError(
                f"shape {list(array.shape)} is not "
                f"[{heads} heads x ({nope_dims} + {value_dims}), kv_lora_rank]",
                tensor=name,
            )
        per_head = array.reshape(heads, nope_dims + value_dims, -1)
        prefix = module.removesuffix("kv_b_proj")
        out[f"{prefix}embed_q.weight"] = mx.contiguous(per_head[:, :nope_dims].swapaxes(-1, -2))
        out[f"{prefix}unembed_out.weight"] = mx.contiguous(per_head[:, nope_dims:])
    return out


def latent_caches(model: Any) -> list[KVCache]:
    """One latent cache per layer of ``model`` (its ``layers``' ``self_attn``)."""
    return [layer.self_attn.make_cache() for layer in model.layers]
