"""Gemma 3n (text): Gemma 4's attention (q/k norms, values RMS-normed without a weight, no
``1/sqrt(D)``, keys and values shared by the last layers) and per-layer inputs, inside AltUp and
beside LAuReL, with a sparse MLP in the first layers.

- **AltUp** keeps ``altup_num_inputs`` streams of the hidden state (the embeddings and learned
  projections of them, rescaled to their magnitude). Each layer *predicts* every stream from all
  of them (coefficients from a router over the active stream, ``altup_active_idx``), runs on the
  active prediction only, then *corrects* every stream by the layer's change to it; the streams
  other than the first take the layer's per-layer input projection. At the end they are projected
  back, rescaled and averaged before the final norm.
- **LAuReL**: a rank-``laurel_rank`` residual beside attention: ``(x + attn + laurel(x)) / sqrt(2)``.
- **Activation sparsity**: where ``activation_sparsity_pattern`` gives a layer ``s > 0``, its MLP's
  gate keeps what lies above ``mean + std * Phi^-1(s)`` of the gate's features (the rest zeroed)
  before GeGLU.

The residual stream the blocks hand on is ``[B, L, N * hidden + layers_left * P]``: the ``N``
streams side by side, then the per-layer inputs still to be read (as in
:mod:`mlxr_plugins.archs.gemma4`), so that every layer keeps an ordinary cache and the compiled
decode step cuts the blocks as it cuts any other. Norms scale by ``w`` (not ``1 + w``).
"""

from __future__ import annotations

import dataclasses
from statistics import NormalDist
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.fuse import gate_and_up
from mlxr_core.model.layers import (
    AttentionBlock,
    CausalLM,
    DecoderModel,
    GatedMLP,
    RMSNorm,
    Rotary,
    TransformerArgs,
    args_rotary,
    geglu,
)
from mlxr_plugins.archs.gemma4 import Gemma4Architecture, Gemma4Attention, Gemma4Model, SharedKV
from mlxr_plugins.archs.gemma4_args import FULL, SLIDING, SharedKVLayers

#: Hugging Face's default: every 5th layer global.
GLOBAL_EVERY = 5
#: Global layers' RoPE (sliding ones rotate unscaled at ``rope_local_base_freq``), as Gemma 3's.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: transformers' names of the tanh approximation of GELU that Gemma 3n's GeGLU computes.
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")
#: Released checkpoints' sparse layers: the first 10 at 0.95 (when there are more than 10).
SPARSE_LAYERS, SPARSITY = 10, 0.95


@dataclasses.dataclass
class Gemma3nArgs(SharedKVLayers, TransformerArgs):
    """``Gemma3nTextConfig``'s keys and defaults. ``altup_coef_clip`` clamps the AltUp
    coefficients only while training; it does not change inference."""

    family = "gemma3n"
    computes = {**TransformerArgs.computes, "hidden_act": GELU_TANH}
    limits = {
        **TransformerArgs.limits,
        "altup_num_inputs": (1, 64),
        "altup_active_idx": (0, 63),
        "laurel_rank": (1, 1 << 16),
        "hidden_size_per_layer_input": (1, 1 << 14),
        "vocab_size_per_layer_input": (1, 1 << 24),
        "num_kv_shared_layers": (0, 1 << 12),
        "activation_sparsity_pattern": (0.0, 0.999999),
    }
    intermediate_size: int | list[int]  # type: ignore[assignment]  # one width per layer, or one for all
    head_dim: int | None = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    max_position_embeddings: int = 32_768
    sliding_window: int | None = 512
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = 30.0
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    altup_active_idx: int = 0
    altup_coef_clip: float | None = 120.0
    altup_correct_scale: bool = True
    altup_num_inputs: int = 4
    num_kv_shared_layers: int = 15
    laurel_rank: int = 64
    activation_sparsity_pattern: list[float] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        L = self.num_hidden_layers
        if self.hidden_activation not in GELU_TANH:
            raise ModelLoadError(
                f"{self.hidden_activation!r}: the gemma3n graph computes only {', '.join(GELU_TANH)}",
                key="hidden_activation",
            )
        widths = self.intermediate_size if isinstance(self.intermediate_size, list) else [self.intermediate_size] * L
        if len(widths) != L or not all(type(w) is int and 0 < w <= 1 << 22 for w in widths):
            raise ModelLoadError(f"gemma3n intermediate_size must be a width or {L} widths: {widths}", key="intermediate_size")
        self.intermediate_size = widths
        types = self.layer_types or [FULL if (i + 1) % GLOBAL_EVERY == 0 else SLIDING for i in range(L)]
        if len(types) != L or set(types) - {SLIDING, FULL}:
            raise ModelLoadError(f"gemma3n layer_types must list {L} of {SLIDING}, {FULL}: {types}", key="layer_types")
        self.layer_types = types
        sparse = SPARSE_LAYERS if L > SPARSE_LAYERS else 0
        pattern = self.activation_sparsity_pattern
        pattern = [SPARSITY] * sparse + [0.0] * (L - sparse) if pattern is None else pattern
        if len(pattern) != L:
            raise ModelLoadError(
                f"gemma3n activation_sparsity_pattern must give {L} values, one per layer: {pattern}",
                key="activation_sparsity_pattern",
            )
        self.activation_sparsity_pattern = pattern
        if self.altup_active_idx >= self.altup_num_inputs:
            raise ModelLoadError(
                f"altup_active_idx = {self.altup_active_idx} names no one of {self.altup_num_inputs} AltUp inputs",
                key="altup_active_idx",
            )
        if self.num_kv_shared_layers >= L:
            raise ModelLoadError(
                f"num_kv_shared_layers = {self.num_kv_shared_layers} leaves none of {L} layers its own keys",
                key="num_kv_shared_layers",
            )
        for index in range(L):
            self.kv_source(index)  # refuses a shared layer without a producer of its type

    @property
    def attention_k_eq_v(self) -> bool:
        """Every layer has its own values (Gemma 4's keys-as-values is not Gemma 3n's)."""
        return False

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """``(head_dim, num_key_value_heads)``: the same in every layer."""
        return self.dims, self.kv_heads

    def width(self, layer: int) -> int:
        assert isinstance(self.intermediate_size, list)
        return int(self.intermediate_size[layer])


class SparseGatedMLP(GatedMLP):
    """GeGLU whose gate first keeps only what lies above ``mean + std * Phi^-1(sparsity)`` of its
    features, less that cutoff (transformers' ``_gaussian_topk``): about ``1 - sparsity`` of them
    for Gaussian gates, with no sort."""

    def __init__(self, hidden: int, inner: int, sparsity: float):
        super().__init__(hidden, inner, activation=geglu)
        self._multiplier = NormalDist().inv_cdf(sparsity)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = gate_and_up(self, x)
        mean = gate.mean(axis=-1, keepdims=True)
        std = mx.sqrt(gate.var(axis=-1, keepdims=True))
        gate = nn.relu(gate - (mean + std * mx.array(self._multiplier, dtype=gate.dtype)))
        out: mx.array = self.down_proj(self._activation(gate, up))
        return out


class Laurel(nn.Module):
    """Learned augmented residual: ``x + norm(right(left(x)))`` through a rank-``rank`` bottleneck."""

    def __init__(self, hidden: int, rank: int, eps: float, kernels: KernelSet):
        super().__init__()
        self.linear_left = nn.Linear(hidden, rank, bias=False)
        self.linear_right = nn.Linear(rank, hidden, bias=False)
        self.post_laurel_norm = RMSNorm(hidden, eps, kernels)

    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array = x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))
        return out


class AltUp(nn.Module):
    """Predicts the ``N`` streams ``[B, L, N, hidden]`` before a layer and corrects them after
    it, with coefficients from ``tanh(router(norm(x) / hidden))`` of one stream."""

    def __init__(self, hidden: int, streams: int, active: int, eps: float, kernels: KernelSet):
        super().__init__()
        self.correct_output_scale = mx.zeros((hidden,))
        self.correction_coefs = nn.Linear(streams, streams, bias=False)
        self.prediction_coefs = nn.Linear(streams, streams * streams, bias=False)
        self.modality_router = nn.Linear(hidden, streams, bias=False)
        self.router_norm = RMSNorm(hidden, eps, kernels)
        self.streams, self.active = streams, active

    def modalities(self, x: mx.array) -> mx.array:
        routed = self.modality_router(self.router_norm(x) * (1.0 / x.shape[-1]))
        return mx.tanh(routed.astype(mx.float32)).astype(x.dtype)

    def predict(self, streams: mx.array) -> mx.array:
        """``out[j] = streams[j] + sum_i c[j, i] * streams[i]``."""
        B, L, N, _ = streams.shape
        coefs = self.prediction_coefs(self.modalities(streams[..., self.active, :])).reshape(B, L, N, N)
        out: mx.array = streams + coefs @ streams
        return out

    def correct(self, predictions: mx.array, activated: mx.array) -> mx.array:
        """``out[i] = predictions[i] + (c[i] + 1) * (activated - predictions[active])``."""
        coefs = self.correction_coefs(self.modalities(activated)) + 1.0
        innovation = activated - predictions[..., self.active, :]
        out: mx.array = predictions + coefs[..., None] * innovation[..., None, :]
        return out


class Gemma3nBlock(AttentionBlock):
    """One layer on the packed stream (see the module): predict, attention and LAuReL on the
    active prediction's norm, Gemma's sandwiched MLP, correct, then the per-layer input's gated
    projection added to every stream but the first. The attention's inputs and the rest are
    computed from the same prediction (made twice: once for each half of the cut)."""

    def __init__(self, args: Gemma3nArgs, layer: int, kernels: KernelSet, attention: Gemma4Attention):
        super().__init__()
        H, eps, P = args.hidden_size, args.rms_norm_eps, args.hidden_size_per_layer_input
        self.self_attn = attention
        assert args.activation_sparsity_pattern is not None
        sparsity = args.activation_sparsity_pattern[layer]
        width = args.width(layer)
        self.mlp = SparseGatedMLP(H, width, sparsity) if sparsity > 0 else GatedMLP(H, width, activation=geglu)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_per_layer_input_norm"):  # fmt: skip
            setattr(self, name, RMSNorm(H, eps, kernels))
        self.altup = AltUp(H, args.altup_num_inputs, args.altup_active_idx, eps, kernels)
        self.laurel = Laurel(H, args.laurel_rank, eps, kernels)
        self.per_layer_input_gate = nn.Linear(H, P, bias=False)
        self.per_layer_projection = nn.Linear(P, H, bias=False)
        self.hidden, self.per_layer, self.scaled = H, P, args.altup_correct_scale

    def predictions(self, x: mx.array) -> mx.array:
        """The AltUp prediction ``[B, L, N, hidden]`` from the packed stream."""
        B, L, _ = x.shape
        N = self.altup.streams
        return self.altup.predict(x[..., : N * self.hidden].reshape(B, L, N, self.hidden))

    def attention_inputs(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        active = self.predictions(x)[..., self.altup.active, :]
        return self.self_attn.attention_inputs(self.input_layernorm(active), offset)

    def after_attention(self, x: mx.array, out: mx.array) -> mx.array:
        B, L, _ = x.shape
        N, H, P = self.altup.streams, self.hidden, self.per_layer
        predictions = self.predictions(x)
        active = predictions[..., self.altup.active, :]
        normed = self.input_layernorm(active)
        attended = self.post_attention_layernorm(self.self_attn.output(out))
        h = (active + attended + self.laurel(normed)) * 2**-0.5
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        corrected = self.altup.correct(predictions, h)
        first = corrected[..., self.altup.active, :]
        if self.scaled:
            first = first * self.altup.correct_output_scale
        tail = x[..., N * H :]
        own, tail = tail[..., :P], tail[..., P:]
        added = self.post_per_layer_input_norm(self.per_layer_projection(geglu(self.per_layer_input_gate(first), own)))
        streams = mx.concatenate([corrected[..., :1, :], corrected[..., 1:, :] + added[..., None, :]], axis=2)
        return mx.concatenate([streams.reshape(B, L, N * H), tail], axis=-1)


def rescaled(x: mx.array, magnitude: mx.array) -> mx.array:
    """``x`` at the root-mean-square ``magnitude`` (its own floored at ``sqrt(1e-5)``)."""
    own = mx.sqrt(mx.maximum(mx.mean(x * x, axis=-1, keepdims=True), 1e-5))
    out: mx.array = x * magnitude / own
    return out


class Gemma3nModel(Gemma4Model):
    """Embeddings, per-layer inputs and the AltUp streams in; the streams projected back and
    averaged out, before the final norm."""

    def __init__(self, args: Gemma3nArgs, layers: list[Gemma3nBlock], kernels: KernelSet):
        super().__init__(args, layers, kernels)
        H, others = args.hidden_size, args.altup_num_inputs - 1
        self.altup_projections = [nn.Linear(H, H, bias=False) for _ in range(others)]
        self.altup_unembed_projections = [nn.Linear(H, H, bias=False) for _ in range(others)]
        self.hidden = H

    def embed(self, inputs: mx.array) -> mx.array:
        h = self.token_embeddings(inputs)
        return self.streams_in(h, self.per_layer_inputs(inputs, h))

    def token_embeddings(self, inputs: mx.array) -> mx.array:
        """``[B, L, hidden]``: the scaled token embeddings alone (what another modality's soft
        tokens replace before :meth:`__call__`)."""
        return DecoderModel.embed(self, inputs)

    def streams_in(self, h: mx.array, per_layer: mx.array) -> mx.array:
        """The packed stream from embeddings ``h`` and every layer's inputs."""
        magnitude = mx.sqrt(mx.mean(h * h, axis=-1, keepdims=True))
        streams = [h] + [rescaled(project(h), magnitude) for project in self.altup_projections]
        return mx.concatenate([*streams, per_layer], axis=-1)

    def streams_out(self, x: mx.array) -> mx.array:
        """The layers' packed output -> ``[B, L, hidden]`` (before the final norm)."""
        H = self.hidden
        first = x[..., :H]
        magnitude = mx.sqrt(mx.mean(first * first, axis=-1, keepdims=True))
        streams = [first] + [
            rescaled(project(x[..., (i + 1) * H : (i + 2) * H]), magnitude)
            for i, project in enumerate(self.altup_unembed_projections)
        ]
        out: mx.array = sum(streams[1:], streams[0]) / len(streams)
        return out

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        mask: str | mx.array | None = None,
        embeddings: mx.array | None = None,
        positions: mx.array | None = None,
    ) -> mx.array:
        """``embeddings``, when given, is :meth:`embed`'s packed stream, or ``[B, L, hidden]``
        embeddings with other modalities' soft tokens at their positions (the multimodal model's
        merge): the streams are made from those, the per-layer inputs from them and ``inputs``."""
        if embeddings is None:
            x = self.embed(inputs)
        elif embeddings.shape[-1] == self.hidden:
            x = self.streams_in(embeddings, self.per_layer_inputs(inputs, embeddings))
        else:
            x = embeddings
        normed: mx.array = self.norm(self.streams_out(self.run_layers(x, cache, mask, positions)))
        return normed


class Gemma3n(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``, soft-capped when configured."""

    def __init__(self, args: Gemma3nArgs, kernels: KernelSet):
        shared = {kind: SharedKV() for kind in (SLIDING, FULL)}
        sources = {args.kv_source(i) for i in range(args.num_hidden_layers)} - {None}
        rotaries: dict[str, Rotary] = {
            FULL: args_rotary(args, kernels, types=ROPE_TYPES),
            SLIDING: args_rotary(args, kernels, base=args.rope_local_base_freq, scaling=None, freq_factors=None),
        }

        def block(layer: int) -> Gemma3nBlock:
            kind = args.kind(layer)
            share = shared[kind] if args.kv_source(layer) is not None or layer in sources else None
            attention = Gemma4Attention(args, layer, kernels, rotaries[kind], share)
            return Gemma3nBlock(args, layer, kernels, attention)

        model = Gemma3nModel(args, [block(i) for i in range(args.num_hidden_layers)], kernels)
        super().__init__(model, tied=args.tie_word_embeddings, softcap=args.final_logit_softcapping)
        self.args = args

    def final_norm(self, h: mx.array) -> mx.array:
        model: Any = self.model
        normed: mx.array = model.norm(model.streams_out(h))
        return normed


class Gemma3nArchitecture(Gemma4Architecture):
    """The :class:`~mlxr_core.model.arch.Architecture` of ``gemma3n_text`` and ``gemma3n``
    (its language model: the image and audio towers and their embedders are set aside, as are
    the shared layers' unused key/value weights, by Gemma 4's :meth:`sanitize`)."""

    args_class = Gemma3nArgs  # type: ignore[assignment]

    def args(self, config: dict[str, Any]) -> Gemma3nArgs:  # type: ignore[override]
        return Gemma3nArgs.from_config({**config, **config.get("text_config", {})})

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict (a ``gemma3n`` one's ``text_config``)."""
        return Gemma3n(self.args(config), kernels)
