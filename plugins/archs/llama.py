"""Llama and Mistral: pre-norm decoder, GQA, RoPE, SwiGLU, and Mistral's optional sliding window.

Weights use the Hugging Face names (``model.layers.N.self_attn.q_proj.weight`` ...) and the Hugging
Face rotary layout (feature ``i`` pairs with ``i + head_dim / 2``); format plugins hand weights
over in that layout. Attention, RMS norm and RoPE go through the bound :class:`KernelSet`. With a
``sliding_window`` every layer attends to its last ``sliding_window`` positions, through the same
full caches and window masks as Gemma 3's window layers (see :mod:`mlxr_core.model.masks`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import KVCache
from mlxr_core.model.fuse import fuse_into, gate_and_up, swiglu
from mlxr_core.model.masks import window_mask


@dataclasses.dataclass
class LlamaArgs:
    """The config keys this graph reads (Hugging Face names); every other key is ignored."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    #: llama.cpp's per-frequency divisors (GGUF ``rope_freqs.weight``), the stored form of llama3 scaling.
    rope_freq_factors: list[float] | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LlamaArgs:
        """Build from a checkpoint config, ignoring keys this graph does not use."""
        fields = {field.name for field in dataclasses.fields(cls)}
        known = {key: value for key, value in config.items() if key in fields}
        missing = [
            field.name
            for field in dataclasses.fields(cls)
            if field.default is dataclasses.MISSING and field.name not in known
        ]
        if missing:
            raise ModelLoadError(f"the llama config lacks {', '.join(missing)}")
        return cls(**known)

    @property
    def rope_dims(self) -> int:
        assert self.head_dim is not None
        return int(self.head_dim * self.partial_rotary_factor)


def base_freqs(dims: int, base: float) -> mx.array:
    """Unscaled RoPE ``freqs``: ``base ** (2i / dims)``."""
    return base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)


def llama3_rope_freqs(dims: int, base: float, scaling: dict[str, Any]) -> mx.array:
    """Llama 3.1 frequency scaling: long wavelengths stretched by ``factor``, short ones kept,
    the band between interpolated. Returns ``freqs`` as ``mx.fast.rope`` takes them (periods / 2pi)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))

    freqs = base_freqs(dims, base)
    wavelengths = 2 * math.pi * freqs
    low_freq_wavelength = original / low_freq_factor
    high_freq_wavelength = original / high_freq_factor
    smooth = (original / wavelengths - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = freqs / ((1 - smooth) / factor + smooth)
    freqs = mx.where(wavelengths > low_freq_wavelength, freqs * factor, freqs)
    in_band = (wavelengths > high_freq_wavelength) & (wavelengths < low_freq_wavelength)
    return mx.where(in_band, interpolated, freqs)


class Rotary:
    """RoPE settings of one model, applied through the bound rope kernel (holds no weights)."""

    def __init__(self, args: LlamaArgs, kernels: KernelSet):
        self.rope = kernels.rope
        self.dims = args.rope_dims
        self.traditional = args.rope_traditional
        self.base: float | None = args.rope_theta
        self.scale = 1.0
        self.freqs: mx.array | None = None
        scaling = args.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "linear":
            self.scale = 1.0 / float(scaling["factor"])
        elif kind == "llama3":
            self.freqs = llama3_rope_freqs(self.dims, args.rope_theta, scaling)
        elif kind not in ("default", None):
            raise ModelLoadError(
                f"rope_scaling type {kind!r} is not supported by the llama graph (default, linear, llama3)"
            )
        if args.rope_freq_factors is not None:
            factors = mx.array(args.rope_freq_factors, dtype=mx.float32)
            own = self.freqs if self.freqs is not None else base_freqs(self.dims, args.rope_theta)
            self.freqs = own * factors
        if self.freqs is not None:
            self.base = None

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return self.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=self.freqs,
        )


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float, kernels: KernelSet):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps
        self._rms_norm = kernels.rms_norm
        self._add_rms_norm = kernels.add_rms_norm

    def __call__(self, x: mx.array) -> mx.array:
        return self._rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: mx.array, residual: mx.array) -> tuple[mx.array, mx.array]:
        """``h = x + residual`` and this norm of ``h`` (the ``add_rms_norm`` kernel)."""
        h, normed = self._add_rms_norm(x, residual, self.weight, self.eps)
        return h, normed


class CachedAttention:
    """What the attention modules of the graphs built on these modules share: the query, key and
    value projections (three layers, or one ``qkv_proj`` once fused), RoPE at the cache's offset,
    the cache update, the sliding window's mask, the attention kernel and the output projection.
    A module mixing it in sets ``n_heads``, ``n_kv_heads``, ``head_dim``, ``scale``, ``window``,
    ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``_rotary`` and ``_attention``, and may
    override :meth:`queries_keys_values` (per-head norms).

    The forward pass is :meth:`attention_inputs`, then :meth:`attention` (the part that reads and
    writes the cache), then :meth:`output`: a compiled decode step runs the first and the last
    inside compiled graphs and the middle one eagerly (see :mod:`mlxr_core.model.compiled`)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    window: int | None
    o_proj: nn.Module
    #: Whether :meth:`queries_keys_values` norms queries and keys per head (Qwen3, Gemma 3).
    head_norms = False
    _rotary: Any
    _attention: Any

    def fused_heads(self, x: mx.array) -> mx.array:
        """``qkv_proj``'s output as ``[B, L, n_heads + 2 * n_kv_heads, head_dim]``: the query heads,
        then the key heads, then the value heads."""
        B, L, _ = x.shape
        module: Any = self
        heads: mx.array = module.qkv_proj(x).reshape(B, L, -1, self.head_dim)
        return heads

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``[B, L, hidden]`` -> queries, keys, values as ``[B, L, heads, head_dim]``."""
        B, L, _ = x.shape
        module: Any = self
        if "qkv_proj" in module:
            heads = self.fused_heads(x)
            q_end, k_end = self.n_heads, self.n_heads + self.n_kv_heads
            queries, keys, values = mx.split(heads, [q_end, k_end], axis=2)
            return queries, keys, values
        return (
            module.q_proj(x).reshape(B, L, self.n_heads, -1),
            module.k_proj(x).reshape(B, L, self.n_kv_heads, -1),
            module.v_proj(x).reshape(B, L, self.n_kv_heads, -1),
        )

    def fuse_projections(self) -> bool:
        """Replace ``q_proj``, ``k_proj`` and ``v_proj`` by one ``qkv_proj`` (see
        :mod:`mlxr_core.model.fuse`); False when they cannot be joined."""
        return fuse_into(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"))

    def queries_keys_values(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``[B, L, hidden]`` -> queries, keys, values as ``[B, heads, L, head_dim]``, before RoPE."""
        queries, keys, values = self.project(x)
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
        if not self.head_norms and "qkv_proj" in self:  # type: ignore[operator]
            B, L, _ = x.shape
            if L == 1:  # [B, 1, heads, D] and [B, heads, 1, D] have the same memory order
                module: Any = self
                heads = module.qkv_proj(x).reshape(B, -1, 1, self.head_dim)
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
        step does the merge inside its graph)."""
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        if self.window is not None:
            mask = window_mask(mask, queries.shape[2], keys.shape[2], self.window)
        out: mx.array = self._attention(queries, keys, values, scale=self.scale, mask=mask)
        return out

    def output(self, out: mx.array) -> mx.array:
        """Attention's ``[B, heads, L, D]`` -> ``[B, L, hidden]``: heads merged, projected."""
        B, _, L, _ = out.shape
        # One position: merging the heads is a reshape (see attention_inputs).
        merged = out.reshape(B, 1, -1) if L == 1 else out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        result: mx.array = self.o_proj(merged)
        return result

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: KVCache | None) -> mx.array:
        """``[B, L, hidden]`` -> ``[B, L, hidden]``, advancing ``cache``."""
        offset = cache.offset if cache is not None else 0
        return self.output(self.attention(*self.attention_inputs(x, offset), mask, cache))


class HeadNormedAttention(CachedAttention):
    """Queries and keys RMS-normalized per head before RoPE (Qwen3, Gemma 3): a module mixing it
    in sets ``q_norm`` and ``k_norm`` as well."""

    head_norms = True
    q_norm: Any
    k_norm: Any

    def queries_keys_values(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        queries, keys, values = self.project(x)
        queries = self.q_norm(queries).transpose(0, 2, 1, 3)
        keys = self.k_norm(keys).transpose(0, 2, 1, 3)
        return queries, keys, values.transpose(0, 2, 1, 3)


class Attention(CachedAttention, nn.Module):
    def __init__(
        self, args: LlamaArgs, kernels: KernelSet, rotary: Rotary, window: int | None = None
    ):
        super().__init__()
        assert args.head_dim is not None and args.num_key_value_heads is not None
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        D, bias = args.head_dim, args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * D, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * D, args.hidden_size, bias=bias)
        self.window = window
        self._rotary = rotary
        self._attention = kernels.attention


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        hidden, inner, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(*gate_and_up(self, x)))

    def fuse_projections(self) -> bool:
        """Replace ``gate_proj`` and ``up_proj`` by one ``gate_up_proj``."""
        return fuse_into(self, "gate_up_proj", ("gate_proj", "up_proj"))


class AttentionBlock:
    """A decoder block as :mod:`mlxr_core.model.compiled` cuts it: :meth:`attention_inputs` (the
    input norm, projections and RoPE), :meth:`attention` (cache and kernel) and
    ``after_attention`` (the rest), composed by ``__call__``. A block mixing it in holds
    ``input_layernorm`` (with ``add_and_norm``) and a :class:`CachedAttention` ``self_attn``, and
    defines ``after_attention_parts(x, out) -> (residual, delta)``, whose sum is
    :meth:`after_attention` and which lets a compiled step fuse the residual add with the next norm
    (:meth:`add_attention_inputs`); or it overrides ``after_attention`` alone."""

    input_layernorm: Any
    self_attn: Any

    def attention_inputs(
        self, x: mx.array, offset: int | mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        inputs: tuple[mx.array, mx.array, mx.array] = self.self_attn.attention_inputs(
            self.input_layernorm(x), offset
        )
        return inputs

    def add_attention_inputs(
        self, residual: mx.array, delta: mx.array, offset: int | mx.array
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """``h = residual + delta`` (the previous block's output in the two parts
        ``after_attention_parts`` gives) and :meth:`attention_inputs` of ``h``, as ``(h, queries,
        keys, values)``: the add and this block's input norm are one ``add_rms_norm`` kernel."""
        h, normed = self.input_layernorm.add_and_norm(delta, residual)
        queries, keys, values = self.self_attn.attention_inputs(normed, offset)
        return h, queries, keys, values

    def attention(self, *inputs: Any) -> mx.array:
        """``self_attn``'s :meth:`CachedAttention.attention`."""
        out: mx.array = self.self_attn.attention(*inputs)
        return out

    def after_attention(self, x: mx.array, out: mx.array) -> mx.array:
        """The rest of the block: the sum of ``after_attention_parts``, which a block defines
        (or it overrides this method instead)."""
        parts: Any = self
        residual, delta = parts.after_attention_parts(x, out)
        result: mx.array = residual + delta
        return result

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: KVCache | None) -> mx.array:
        offset = cache.offset if cache is not None else 0
        return self.after_attention(x, self.attention(*self.attention_inputs(x, offset), mask, cache))


class TransformerBlock(AttentionBlock, nn.Module):
    def __init__(
        self, args: LlamaArgs, kernels: KernelSet, rotary: Rotary, window: int | None = None
    ):
        super().__init__()
        self.self_attn = Attention(args, kernels, rotary, window)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)

    def after_attention_parts(self, x: mx.array, out: mx.array) -> tuple[mx.array, mx.array]:
        """The block's output as ``(residual, delta)``, their sum unformed (see
        :meth:`AttentionBlock.add_attention_inputs`)."""
        h, normed = self.post_attention_layernorm.add_and_norm(x, self.self_attn.output(out))
        delta: mx.array = self.mlp(normed)
        return h, delta


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs, kernels: KernelSet):
        super().__init__()
        rotary = Rotary(args, kernels)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [
            TransformerBlock(args, kernels, rotary, args.sliding_window or None)
            for _ in range(args.num_hidden_layers)
        ]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)

    def embed(self, inputs: mx.array) -> mx.array:
        """``[B, L]`` token ids -> ``[B, L, hidden]``."""
        h: mx.array = self.embed_tokens(inputs)
        return h

    def __call__(
        self, inputs: mx.array, cache: list[Any] | None = None, mask: str | mx.array | None = None
    ) -> mx.array:
        h = self.embed(inputs)
        if mask is None and h.shape[1] > 1:
            mask = "causal"
        layer_caches = cache if cache is not None else [None] * len(self.layers)
        for layer, layer_cache in zip(self.layers, layer_caches, strict=True):
            h = layer(h, mask, layer_cache)
        return self.norm(h)


class CausalLM:
    """The top of a decoder-only model built on these modules: ``model(inputs [B, L], cache=...)
    -> logits [B, L, vocab]`` as the backbone ``model`` (embedding, layers, final norm) followed by
    :meth:`lm_logits`, plus the pieces a compiled decode step calls (:meth:`embed`,
    :meth:`final_norm`, ``layers``). A module mixing it in sets ``args`` (with
    ``tie_word_embeddings``), ``model`` and, untied, ``lm_head``."""

    args: Any
    model: Any

    def __call__(
        self, inputs: mx.array, cache: list[Any] | None = None, mask: str | mx.array | None = None
    ) -> mx.array:
        return self.lm_logits(self.model(inputs, cache, mask))

    def embed(self, inputs: mx.array) -> mx.array:
        h: mx.array = self.model.embed(inputs)
        return h

    def final_norm(self, h: mx.array) -> mx.array:
        normed: mx.array = self.model.norm(h)
        return normed

    def add_final_norm(self, residual: mx.array, delta: mx.array) -> mx.array:
        """:meth:`final_norm` of ``residual + delta`` (the last block's output in parts), the add
        and the norm in one ``add_rms_norm`` kernel."""
        _, normed = self.model.norm.add_and_norm(delta, residual)
        result: mx.array = normed
        return result

    def lm_logits(self, h: mx.array) -> mx.array:
        """Logits from final (normed) hidden states."""
        head: Any = self.model.embed_tokens.as_linear if self.args.tie_word_embeddings else self.lm_head  # type: ignore[attr-defined]
        logits: mx.array = head(h)
        return logits

    @property
    def layers(self) -> list[Any]:
        layers: list[Any] = self.model.layers
        return layers


class Llama(CausalLM, nn.Module):
    """The whole model: ``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: LlamaArgs, kernels: KernelSet):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args, kernels)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)


def final_hidden_states(model: nn.Module, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
    """The backbone's output (``model.model``: after the final norm, before the LM head), which
    every architecture built on these modules shares; see ``Architecture.hidden_states``."""
    hidden: mx.array = model.model(inputs, cache)
    return hidden


class LlamaArchitecture:
    """The :class:`mlxr_core.model.arch.Architecture` of ``llama`` and ``mistral``."""

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Llama(LlamaArgs.from_config(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Drop precomputed rotary tables and, with tied embeddings, a redundant ``lm_head``."""
        tied = LlamaArgs.from_config(config).tie_word_embeddings
        return {
            name: array
            for name, array in weights.items()
            if "rotary_emb.inv_freq" not in name and not (tied and name.startswith("lm_head."))
        }

    def make_cache(self, model: nn.Module) -> list[Any]:
        """One :class:`KVCache` per layer."""
        return [KVCache() for _ in model.layers]

    def hidden_states(
        self, model: nn.Module, inputs: mx.array, cache: list[Any] | None = None
    ) -> mx.array:
        """``[B, L, hidden_size]`` after the final norm, before the LM head."""
        return final_hidden_states(model, inputs, cache)

    def context_length(self, config: dict[str, Any]) -> int:
        """``max_position_embeddings``: a sliding window masks older positions, it does not cap."""
        return LlamaArgs.from_config(config).max_position_embeddings

    def kernel_context(self, config: dict[str, Any]) -> dict[str, Any]:
        """Shapes kernels check: head dim, head counts, rotary dims and the mask kinds used."""
        args = LlamaArgs.from_config(config)
        return {
            "head_dim": args.head_dim,
            "n_heads": args.num_attention_heads,
            "n_kv_heads": args.num_key_value_heads,
            "rope_dims": args.rope_dims,
            "rope_traditional": args.rope_traditional,
            "masks": ("causal", "array"),
        }
