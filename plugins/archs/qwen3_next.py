"""Qwen3-Next (Qwen3-Next-80B-A3B): Gated DeltaNet layers and gated attention, sparse experts.

Each layer's token mixer is either Gated DeltaNet linear attention (``layer_types`` entry
``linear_attention``: a recurrent state, no keys and values) or softmax attention with an output
gate (``full_attention``, every ``full_attention_interval``-th layer by default), from
:mod:`mlxr_core.model.layers.linear_attention`. Attention rotates the first
``partial_rotary_factor`` of each head (a quarter). Norms scale by ``1 + weight``. The
feed-forward layers are Qwen's sparse experts with a shared expert behind a sigmoid gate (dense
MLPs where :class:`~mlxr_plugins.archs.qwen3_moe.SparseLayers` says so).

Caches: a :class:`~mlxr_core.model.cache.RecurrentCache` per DeltaNet layer, a
:class:`~mlxr_core.model.cache.KVCache` per attention layer. Hugging Face's depthwise conv weight
``[channels, 1, kernel]`` is stored as MLX's ``[channels, kernel, 1]``; per-expert tensors are
stacked (:func:`~mlxr_core.model.layers.stack_experts`). llama.cpp's GGUF files (``qwen3next``,
``qwen35``, ``qwen35moe``) arrive from the GGUF reader in Hugging Face's names with DeltaNet's
projections split (``linear_attn_layout: split``) and, for Qwen3.5, the value heads in
llama.cpp's tiled order (``linear_value_order: tiled``), which the layer follows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers import (
    CausalLM,
    DecoderArchitecture,
    DecoderModel,
    RMSNorm,
    TransformerArgs,
    args_rotary,
    stack_experts,
)
from mlxr_core.model.layers.linear_attention import GatedAttention, GatedDeltaNet, MixerBlock
from mlxr_core.model.layers.mtp import MtpHead, head_weights
from mlxr_plugins.archs.qwen2 import ROPE_TYPES
from mlxr_plugins.archs.qwen3_moe import EXPERT_NAMES, SparseLayers, qwen_feed_forward

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass
class Qwen3NextArgs(SparseLayers):
    """The keys of ``Qwen3NextConfig`` this graph reads (its defaults)."""

    family = "qwen3_next"
    limits = {
        **TransformerArgs.limits,
        "linear_conv_kernel_dim": (1, 64),
        "linear_key_head_dim": (1, 1 << 12),
        "linear_value_head_dim": (1, 1 << 12),
        "linear_num_key_heads": (1, 1 << 12),
        "linear_num_value_heads": (1, 1 << 12),
        "full_attention_interval": (1, 1 << 12),
    }
    head_dim: int | None = 256
    partial_rotary_factor: float = 0.25
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)
    #: DeltaNet's projections: Qwen3-Next's ``fused`` (qkvz and ba grouped per key head) or
    #: ``split`` as Qwen3.5 has them (llama.cpp's files of either; set by the GGUF reader).
    linear_attn_layout: str = "fused"
    #: Order of the value heads: ``grouped`` (key head j serves value heads j*r .. j*r+r-1, as
    #: Hugging Face's) or llama.cpp's ``tiled`` (key head j serves j, j + Hk, ...).
    linear_value_order: str = "grouped"

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, allowed in (("linear_attn_layout", ("fused", "split")), ("linear_value_order", ("grouped", "tiled"))):
            if getattr(self, key) not in allowed:
                raise ModelLoadError(f"{key} must be one of {', '.join(allowed)}, not {getattr(self, key)!r}", key=key)
        if self.layer_types is None:
            every = self.full_attention_interval
            self.layer_types = [LAYER_TYPES[(i + 1) % every == 0] for i in range(self.num_hidden_layers)]
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown or len(self.layer_types) != self.num_hidden_layers:
            raise ModelLoadError(
                f"layer_types must name {self.num_hidden_layers} layers, each one of "
                f"{', '.join(LAYER_TYPES)} (got {len(self.layer_types)}: {', '.join(unknown) or 'ok'})",
                key="layer_types",
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelLoadError(
                f"linear_num_value_heads = {self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads = {self.linear_num_key_heads}",
                key="linear_num_value_heads",
            )

    def kernel_shapes(self) -> dict[str, Any]:
        """The attention shapes, and the DeltaNet head sizes the fused ``gated_delta`` kernels check."""
        return {
            **super().kernel_shapes(),
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
        }

    def is_linear(self, layer: int) -> bool:
        assert self.layer_types is not None
        return self.layer_types[layer] == "linear_attention"


def hybrid_layers(args: Qwen3NextArgs, kernels: KernelSet, *, fused: bool) -> list[MixerBlock]:
    """The blocks of a Qwen hybrid: DeltaNet (``fused`` projections: Qwen3-Next's) or gated
    attention per ``layer_types``, then Qwen's feed-forward (sparse experts with a shared one, or a
    dense MLP per :meth:`is_sparse`)."""
    rotary = args_rotary(args, kernels, types=ROPE_TYPES)
    H, eps = args.hidden_size, args.rms_norm_eps

    def mixer(layer: int) -> tuple[str, nn.Module]:
        if not args.is_linear(layer):
            return "self_attn", gated_attention(args, kernels, rotary)
        return "linear_attn", GatedDeltaNet(
            H,
            key_heads=args.linear_num_key_heads,
            value_heads=args.linear_num_value_heads,
            key_dim=args.linear_key_head_dim,
            value_dim=args.linear_value_head_dim,
            conv_kernel=args.linear_conv_kernel_dim,
            eps=eps,
            kernels=kernels,
            fused=fused,
            tiled=args.linear_value_order == "tiled",
        )

    shared = args.shared_expert_intermediate_size
    return [
        MixerBlock(*mixer(i), qwen_feed_forward(args, i, kernels, shared), H, eps, kernels, norm_offset=1.0)
        for i in range(args.num_hidden_layers)
    ]


def gated_attention(args: Qwen3NextArgs, kernels: KernelSet, rotary: Any) -> GatedAttention:
    """A ``full_attention`` layer's token mixer: gated attention, heads normed by ``1 + weight``."""
    return GatedAttention(
        args.hidden_size,
        args.num_attention_heads,
        args.kv_heads,
        args.dims,
        kernels=kernels,
        rotary=rotary,
        qkv_bias=args.attention_bias,
        out_bias=args.attention_bias,
        head_norm_eps=args.rms_norm_eps,
        norm_offset=1.0,
    )


def mtp_head(args: Qwen3NextArgs, kernels: KernelSet) -> MtpHead:
    """The multi-token-prediction layer (``mtp.*``): a ``full_attention`` decoder layer with the
    feed-forward of the layer after the last (experts where the model's layers have them);
    norms scale by ``1 + weight``; a chained step reads the normed output."""
    H, eps, index = args.hidden_size, args.rms_norm_eps, args.num_hidden_layers
    rotary = args_rotary(args, kernels, types=ROPE_TYPES)
    feed_forward = qwen_feed_forward(args, index, kernels, args.shared_expert_intermediate_size)
    block = MixerBlock("self_attn", gated_attention(args, kernels, rotary), feed_forward, H, eps, kernels, norm_offset=1.0)
    return MtpHead(block, H, eps, kernels, norm_offset=1.0, chain_normed=True)


#: The checkpoint's MTP names (after ``mtp.``) -> :class:`MtpHead`'s.
MTP_NAMES = (("fc.", "proj."), ("pre_fc_norm_embedding.", "embed_norm."), ("pre_fc_norm_hidden.", "hidden_norm."),
             ("norm.", "norm."), ("layers.0.", "block."))


def mtp_weights(weights: dict[str, mx.array], count: int) -> dict[str, mx.array]:
    """The first MTP layer's weights (``mtp.*``, or ``language_model.mtp.*``) under
    :class:`MtpHead`'s names, experts stacked; empty when there are none. Further layers
    (``mtp.layers.1`` ...) are not read."""
    head = head_weights(weights, ("mtp.", "language_model.mtp."), MTP_NAMES)
    return sanitize_hybrid(head, count) if head else head


class Qwen3Next(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: Qwen3NextArgs, kernels: KernelSet):
        H = args.hidden_size
        layers = hybrid_layers(args, kernels, fused=args.linear_attn_layout == "fused")
        model = DecoderModel(args.vocab_size, H, layers, RMSNorm(H, args.rms_norm_eps, kernels, offset=1.0))
        super().__init__(model, tied=args.tie_word_embeddings)
        self.args = args


#: The norms that scale by ``1 + weight`` (DeltaNet's gated norm scales by ``weight``).
OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")


def sanitize_hybrid(weights: dict[str, mx.array], count: int, layers: int | None = None) -> dict[str, mx.array]:
    """Conv weights in MLX's layout; experts stacked, whether per expert or, as Qwen3.5's
    checkpoints hold them, as one ``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj``.

    A folder mlx-lm wrote (conv weights already ``[C, K, 1]``) holds its norms as ``1 + weight``
    (mlx-lm folds the offset in when it converts): they are unfolded, as the graph adds it."""
    if layers is not None:  # multi-token-prediction blocks a GGUF file appends, under its own names
        weights = {name: array for name, array in weights.items() if _layer(name) < layers}
    convs = [array for name, array in weights.items() if name.endswith("conv1d.weight")]
    folded = bool(convs) and all(array.ndim == 3 and array.shape[-1] == 1 for array in convs)
    out: dict[str, mx.array] = {}
    for name, array in weights.items():
        if name.endswith("conv1d.weight") and array.ndim == 3 and array.shape[1] == 1 and array.shape[2] > 1:
            array = array.swapaxes(1, 2)  # [C, 1, K] -> [C, K, 1]
        if folded and array.ndim == 1 and name.endswith(OFFSET_NORMS):
            array = array - 1.0
        if name.endswith("shared_expert_gate.weight") and array.ndim == 1:
            array = array[None]  # llama.cpp stores the shared expert's gate as a vector
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj.weight")):
            gate, up = mx.split(array, 2, axis=1)
            stem = name[: name.index("experts.gate_up_proj")]
            out[stem + "switch_mlp.gate_proj.weight"] = gate
            out[stem + "switch_mlp.up_proj.weight"] = up
            continue
        if name.endswith("mlp.experts.down_proj"):
            out[name[: -len("experts.down_proj")] + "switch_mlp.down_proj.weight"] = array
            continue
        out[name] = array
    return stack_experts(out, "mlp.experts", "mlp.switch_mlp", EXPERT_NAMES, count)


def _layer(name: str) -> int:
    """The decoder layer a weight belongs to (-1 for the embedding, final norm and head); GGUF
    names nothing maps (``blk.N.nextn.*``) count as past the last layer."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2])
    return 1 << 30 if name.startswith("blk.") else -1


class Qwen3NextArchitecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``qwen3_next``."""

    args_class = Qwen3NextArgs

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Qwen3Next(self.args(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Conv weights in MLX's layout, experts stacked, multi-token-prediction heads dropped
        (``mtp.*``: the ``mtp`` drafter reads them, :meth:`mtp_weights`), rotary tables and a tied
        ``lm_head`` dropped."""
        weights = {name: array for name, array in weights.items() if not name.startswith("mtp.")}
        args = self.args(config)
        return super().sanitize(sanitize_hybrid(weights, args.num_experts, args.num_hidden_layers), config)

    def mtp_weights(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """The multi-token-prediction layer's weights (:class:`~mlxr_core.model.layers.mtp.HasMtpHead`)."""
        return mtp_weights(weights, self.args(config).num_experts)

    def build_mtp(self, config: dict[str, Any], kernels: KernelSet) -> MtpHead:
        """The multi-token-prediction head of this shape (:func:`mtp_head`)."""
        return mtp_head(self.args(config), kernels)

    def make_cache(self, model: nn.Module) -> list[Any]:
        """A recurrent state per DeltaNet layer, keys and values per attention layer."""
        return [layer.make_cache() for layer in model.layers]

    def check_loaded(self, model: nn.Module) -> None:
        """Warm up: a two-token prefill and a one-token step, so the DeltaNet step's compiled
        functions are built before the first request (on MLX's CUDA backend the first call of
        one took 5.3 s on an H100: its kernels are compiled then)."""
        cache = self.make_cache(model)
        mx.eval(model(mx.array([[0, 0]]), cache=cache))
        mx.eval(model(mx.array([[0]]), cache=cache))
