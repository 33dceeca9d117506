"""Gemma 4 (text): Gemma 3's sandwich blocks, sliding-window and global layers with their own
head sizes, plus per-layer inputs (E2B, E4B), keys and values shared across layers, keys as
values on global layers (26B-A4B, 31B) and experts beside the dense MLP (26B-A4B). Unlike Gemma
3, norms scale by ``w`` (not ``1 + w``), attention is unscaled, values are RMS-normed without a
weight, global layers rotate a quarter of their pairs (``proportional`` RoPE), and each block
ends by scaling the residual stream by its ``layer_scalar``.

Two features reach across layers; both are carried so that every layer keeps an ordinary cache
(batching, the prefix cache and the compiled decode step need nothing special):

- Per-layer inputs are computed from the tokens at embedding time and ride along the residual
  stream, ``[B, L, hidden + layers_left * P]``: each block takes its ``P`` features off the front
  of the tail, so the last block hands on ``[B, L, hidden]``.
- A layer past ``L - num_kv_shared_layers`` attends over the keys and values of the last earlier
  layer of its type, which that layer leaves in a :class:`SharedKV` during the same pass. Its own
  cache holds a one-feature placeholder, so that its positions stay in step with the others.

The config and its per-layer rules are :mod:`mlxr_plugins.archs.gemma4_args`.
"""

from __future__ import annotations

import math
import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import KVCache
from mlxr_core.model.layers import (
    Attention,
    AttentionBlock,
    CausalLM,
    DecoderArchitecture,
    DecoderModel,
    GatedMLP,
    RMSNorm,
    Rotary,
    SwitchGLU,
    geglu,
    weighted_sum,
)
from mlxr_plugins.archs.gemma4_args import FULL, SLIDING, Gemma4Args, LayerRules

QKV = tuple[mx.array, mx.array, mx.array]


class SharedKV:
    """The keys and values a layer attended over in this pass, for the later layers sharing them
    (the last of which lets go of them: they may be a finished batch's whole cache)."""

    arrays: tuple[mx.array, mx.array] | None = None


class Gemma4Attention(Attention):
    """Per-head q/k norms, values RMS-normed without a weight, no ``1/sqrt(D)``; keys as values on
    global layers with ``attention_k_eq_v``. With ``shared``, the layer either leaves its keys and
    values there (a producer) or, if it shares another's, attends over those instead of its own."""

    def __init__(
        self, args: LayerRules, layer: int, kernels: KernelSet, rotary: Rotary, shared: SharedKV | None
    ):
        D, kv_heads = args.layer_shape(layer)
        sliding, reads = args.kind(layer) == SLIDING, args.kv_source(layer) is not None
        super().__init__(
            args.hidden_size, args.num_attention_heads, kv_heads, D,
            kernels=kernels, rotary=rotary, scale=1.0,
            qkv_bias=args.attention_bias, out_bias=args.attention_bias,
            head_norm_eps=args.rms_norm_eps, window=args.sliding_window if sliding else None,
        )  # fmt: skip
        if reads:
            del self.k_proj, self.v_proj, self.k_norm
        elif args.attention_k_eq_v and not sliding:
            del self.v_proj
        readers = [i for i in range(args.num_hidden_layers) if args.kv_source(i) == args.kv_source(layer)]
        self._shared, self._reads, self._last_reader = shared, reads, reads and layer == readers[-1]
        self._unit, self._eps, self._rms_norm = mx.ones((D,)), args.rms_norm_eps, kernels.rms_norm

    @property
    def reads_shared(self) -> bool:
        """Whether this layer attends over an earlier layer's keys and values, not its own."""
        return self._reads

    def attention_inputs(self, x: mx.array, offset: int | mx.array) -> QKV:
        B, L, _ = x.shape
        if self._reads:  # no keys of its own: its cache holds one feature of one head per position
            queries = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1))
            placeholder = mx.zeros((B, 1, L, 1), dtype=queries.dtype)
            return self._rotary(queries.transpose(0, 2, 1, 3), offset), placeholder, placeholder
        if "v_proj" in self or "qkv_proj" in self:
            queries, keys, values = self.project(x)
        else:  # keys as values
            queries = self.q_proj(x).reshape(B, L, self.n_heads, -1)
            keys = values = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        queries = self._rotary(self.q_norm(queries).transpose(0, 2, 1, 3), offset)
        keys = self._rotary(self.k_norm(keys).transpose(0, 2, 1, 3), offset)
        values = self._rms_norm(values, self._unit.astype(values.dtype), self._eps)  # no weight
        return queries, keys, values.transpose(0, 2, 1, 3)

    def attention(
        self, queries: mx.array, keys: mx.array, values: mx.array, mask: Any, cache: Any
    ) -> mx.array:
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        if self._reads:
            assert self._shared is not None and self._shared.arrays is not None
            keys, values = self._shared.arrays
            if self._last_reader:
                self._shared.arrays = None
        elif self._shared is not None:
            self._shared.arrays = keys, values
        return super().attention(queries, keys, values, mask, None)


class Router(nn.Module):
    """Scores the experts from the RMS-normed residual times ``scale / sqrt(hidden)``: the top
    ``top_k`` of a softmax, renormalized, times their ``per_expert_scale``."""

    def __init__(self, hidden: int, experts: int, top_k: int, eps: float, kernels: KernelSet):
        super().__init__()
        self.proj = nn.Linear(hidden, experts, bias=False)
        self.scale = mx.ones((hidden,))
        self.per_expert_scale = mx.ones((experts,))
        self.top_k, self.eps = top_k, eps
        self._rms_norm, self._route = kernels.rms_norm, kernels.route

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        normed = self._rms_norm(x, self.scale * x.shape[-1] ** -0.5, self.eps)
        indices, weights = self._route(self.proj(normed), top_k=self.top_k, scoring="softmax", normalize=True)
        return indices, weights * self.per_expert_scale[indices]


class Gemma4Block(AttentionBlock):
    """Sandwich norms around attention and the feed-forward part, the experts' branch (own norms,
    routed from the residual) added to the dense MLP's, then the per-layer input's gated
    projection, then ``layer_scalar`` on the whole stream. Its input is ``[B, L, hidden + tail]``
    (see the module); it hands on the tail without its first ``P`` features."""

    def __init__(self, args: Gemma4Args, layer: int, kernels: KernelSet, attention: Gemma4Attention):
        super().__init__()
        H, eps, P = args.hidden_size, args.rms_norm_eps, args.hidden_size_per_layer_input
        self.self_attn = attention
        wide = args.use_double_wide_mlp and layer >= args.first_shared
        self.mlp = GatedMLP(H, args.intermediate_size * (2 if wide else 1), activation=geglu)
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        E, inner, top_k = args.num_experts, args.moe_intermediate_size, args.top_k_experts
        if args.enable_moe_block and E and inner and top_k:
            self.router = Router(H, E, top_k, eps, kernels)
            self.experts = SwitchGLU(H, inner, E, kernels=kernels, activation=geglu, top_k=args.top_k_experts)
            norms += [f"post_feedforward_layernorm_{i}" for i in (1, 2)] + ["pre_feedforward_layernorm_2"]
        for name in norms:
            setattr(self, name, RMSNorm(H, eps, kernels))
        if P:
            self.per_layer_input_gate = nn.Linear(H, P, bias=False)
            self.per_layer_projection = nn.Linear(P, H, bias=False)
            self.post_per_layer_input_norm = RMSNorm(H, eps, kernels)
        self.layer_scalar = mx.ones((1,))
        self.hidden, self.per_layer = H, P

    def attention_inputs(self, x: mx.array, offset: int | mx.array) -> QKV:
        return super().attention_inputs(x[..., : self.hidden] if x.shape[-1] > self.hidden else x, offset)

    def feed_forward(self, h: mx.array, attended: mx.array) -> mx.array:
        """``h + post_ff(mlp(pre_ff(h')) [+ experts])`` where ``h' = h + attended``."""
        h, normed = self.pre_feedforward_layernorm.add_and_norm(h, attended)
        y = self.mlp(normed)
        if "experts" in self:
            indices, weights = self.router(h)
            chosen = self.experts(self.pre_feedforward_layernorm_2(h), indices)  # [..., k, hidden]
            mixed = weighted_sum(chosen, weights)
            y = self.post_feedforward_layernorm_1(y) + self.post_feedforward_layernorm_2(mixed)
        out: mx.array = h + self.post_feedforward_layernorm(y)
        return out

    def after_attention(self, x: mx.array, out: mx.array) -> mx.array:
        h, tail = x[..., : self.hidden], x[..., self.hidden :]
        h = self.feed_forward(h, self.post_attention_layernorm(self.self_attn.output(out)))
        if self.per_layer:
            own, tail = tail[..., : self.per_layer], tail[..., self.per_layer :]
            gated = geglu(self.per_layer_input_gate(h), own)
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        h = h * self.layer_scalar
        return mx.concatenate([h, tail], axis=-1) if tail.shape[-1] else h


class Gemma4Model(DecoderModel):
    """Gemma's scaled embeddings, then (with per-layer inputs, ``P > 0``) each layer's ``P``
    input features: ``(norm(proj(embeddings) / sqrt(hidden)) + table[ids] * sqrt(P)) / sqrt(2)``,
    ids past the table reading its row 0 (Gemma 3n's image and audio tokens)."""

    def __init__(self, args: LayerRules, layers: list[Any], kernels: KernelSet):
        H, eps, P = args.hidden_size, args.rms_norm_eps, args.hidden_size_per_layer_input
        super().__init__(args.vocab_size, H, layers, RMSNorm(H, eps, kernels), math.sqrt(H))
        if P:
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, len(layers) * P)
            self.per_layer_model_projection = nn.Linear(H, len(layers) * P, bias=False)
            self.per_layer_projection_norm = RMSNorm(P, eps, kernels)
        self.per_layer = P

    def embed(self, inputs: mx.array) -> mx.array:
        h = super().embed(inputs)
        if not self.per_layer:
            return h
        return mx.concatenate([h, self.per_layer_inputs(inputs, h)], axis=-1)

    def per_layer_inputs(self, inputs: mx.array, h: mx.array) -> mx.array:
        """``[B, L, layers * P]``: every layer's input features, from the ids and the embeddings."""
        B, L, P = *inputs.shape, self.per_layer
        rows = self.embed_tokens_per_layer.weight.shape[0]
        table = self.embed_tokens_per_layer(mx.where(inputs < rows, inputs, 0))
        tokens = (table * mx.array(math.sqrt(P), dtype=table.dtype)).reshape(B, L, -1, P)
        context = self.per_layer_model_projection(h) * h.shape[-1] ** -0.5
        context = self.per_layer_projection_norm(context.reshape(B, L, -1, P))
        per_layer: mx.array = (context + tokens) * 2**-0.5
        return per_layer.reshape(B, L, -1)


class Gemma4(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``, soft-capped when configured."""

    def __init__(self, args: Gemma4Args, kernels: KernelSet):
        shared = {kind: SharedKV() for kind in (SLIDING, FULL)}
        sources = {args.kv_source(i) for i in range(args.num_hidden_layers)} - {None}
        rotaries: dict[tuple[str, int], Rotary] = {}  # one per kind and head size

        def block(layer: int) -> Gemma4Block:
            kind, dims = args.kind(layer), args.layer_shape(layer)[0]
            if (kind, dims) not in rotaries:
                rotaries[kind, dims] = args.rotary(layer, kernels)
            reads = args.kv_source(layer) is not None
            share = shared[kind] if reads or layer in sources else None
            attention = Gemma4Attention(args, layer, kernels, rotaries[kind, dims], share)
            return Gemma4Block(args, layer, kernels, attention)

        model = Gemma4Model(args, [block(i) for i in range(args.num_hidden_layers)], kernels)
        super().__init__(model, tied=args.tie_word_embeddings, softcap=args.final_logit_softcapping)
        self.args = args


#: The multimodal checkpoints' towers and embedders: this graph is text-only.
MULTIMODAL_PARTS = ("vision_tower", "audio_tower", "embed_vision", "embed_audio", "multi_modal")
#: What shared layers do not use (hub checkpoints still hold it; transformers ignores it too).
SHARED_UNUSED = tuple(f"self_attn.{name}." for name in ("k_proj", "v_proj", "k_norm", "v_norm"))
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
#: Where multimodal checkpoints keep the language model.
TEXT_PREFIX = "model.language_model."


class Gemma4Architecture(DecoderArchitecture):
    """The :class:`~mlxr_core.model.arch.Architecture` of ``gemma4_text`` and ``gemma4`` (text)."""

    args_class = Gemma4Args

    def args(self, config: dict[str, Any]) -> Gemma4Args:
        return Gemma4Args.from_config({**config, **config.get("text_config", {})})

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict (a ``gemma4`` one's ``text_config``)."""
        return Gemma4(self.args(config), kernels)

    def make_cache(self, model: nn.Module) -> list[Any]:
        """One :class:`KVCache` per layer; a layer reading another's keys and values declares the
        two features a position of its placeholder takes, so the KV budget counts only those."""
        layers: Any = model.layers
        return [KVCache(width=2) if layer.self_attn.reads_shared else KVCache() for layer in layers]

    def sanitized_modules(self, module: str) -> list[str]:
        """A packed module under the name :meth:`sanitize` gives it (mlx-lm's multimodal folders)."""
        return ["model." + module.removeprefix(TEXT_PREFIX) if module.startswith(TEXT_PREFIX) else module]

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Text-model names for multimodal checkpoints (``model.language_model.``), the towers and
        shared layers' unused key/value weights dropped, each ``experts.gate_up_proj`` split into
        the stacked gate and up projections (mlx-lm's ``experts.switch_glu.*`` renamed)."""
        args = self.args(config)
        out: dict[str, mx.array] = {}
        for name, array in weights.items():
            if any(part in name for part in MULTIMODAL_PARTS):
                continue
            if name.startswith(TEXT_PREFIX):
                name = "model." + name.removeprefix(TEXT_PREFIX)
            name = name.replace(".experts.switch_glu.", ".experts.")
            layer = _LAYER.match(name)
            rest = name[layer.end() :] if layer else ""
            if layer and int(layer[1]) >= args.first_shared and rest.startswith(SHARED_UNUSED):
                continue
            if name.endswith(".experts.gate_up_proj"):
                gate, up = mx.split(array, 2, axis=1)
                out[name.replace("gate_up_proj", "gate_proj.weight")] = gate
                out[name.replace("gate_up_proj", "up_proj.weight")] = up
                continue
            if name.endswith(".experts.down_proj"):
                name += ".weight"
            out[name] = array
        return super().sanitize(out, config)
