"""DeepSeek-V3 (and R1, V3.1, Kimi K2's layout): multi-head latent attention, sigmoid-routed
experts in groups, shared experts, the first layers dense.

Attention is :class:`~mlxr_core.model.layers.latent_attention.LatentAttention`: queries through a
rank-``q_lora_rank`` bottleneck (or one ``q_proj`` without it), keys and values from one latent of
``kv_lora_rank`` per token plus a rotary key of ``qk_rope_head_dim`` shared by every head; the
cache holds those (``R + P`` numbers a layer), not per-head keys and values. RoPE rotates
interleaved pairs (``rope_interleave``, on by default) and may be stretched by YaRN; the softmax
scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` times YaRN's ``mscale`` squared
(``0.1 * mscale_all_dim * ln(factor) + 1``), as DeepSeek scales every dimension of the scores.

Layers from ``first_k_dense_replace`` on are mixtures of ``n_routed_experts`` SwiGLU experts: each
expert scored by a sigmoid; the choice made on the scores plus ``e_score_correction_bias``, among
the experts of the ``topk_group`` best of ``n_group`` groups (a group ranked by its two best
scores); the chosen experts' plain scores renormalized (``norm_topk_prob``) and scaled by
``routed_scaling_factor``; ``n_shared_experts`` experts' worth of shared MLP on every token.

Hugging Face checkpoints hold ``kv_b_proj`` whole and one tensor per expert; ``sanitize`` splits the
one per head and stacks the others (mlx-lm's layout, which loads as it is) and drops the
multi-token-prediction layers stored past ``num_hidden_layers`` (the ``mtp`` drafter reads the
first: :func:`mtp_head`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers import (
    CausalLM,
    DecoderArchitecture,
    DecoderModel,
    GatedMLP,
    PreNormBlock,
    RMSNorm,
    SparseMoE,
    TransformerArgs,
    args_rotary,
    rope_type,
    stack_experts,
)
from mlxr_core.model.layers.args import POSITIVE
from mlxr_core.model.layers.latent_attention import LatentAttention, latent_caches, split_kv_b_proj
from mlxr_core.model.layers.mtp import MtpHead, head_weights
from mlxr_core.model.layers.rope import PositionScale

#: The ``rope_scaling`` types DeepSeek-V3 checkpoints use (and transformers computes for them).
ROPE_TYPES = ("default", "linear", "yarn")
#: Hugging Face's per-expert projection names -> the stacked ones.
EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


@dataclasses.dataclass
class DeepseekV3Args(TransformerArgs):
    """The config keys this graph reads (defaults as in ``DeepseekV3Config``). MLA has no key/value
    heads of its own: ``num_key_value_heads`` (transformers 5 writes 128 whatever the head count)
    is ignored, and ``head_dim`` (which it writes as ``qk_rope_head_dim``) too."""

    family = "deepseek_v3"
    aliases = {"n_routed_experts": ("num_local_experts",)}
    #: The ``rope_type`` values this graph computes.
    rope_types: ClassVar[tuple[str, ...]] = ROPE_TYPES
    #: Keys whose other values this graph does not compute -> the value it does.
    fixed: ClassVar[dict[str, Any]] = {
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu", "moe_layer_freq": 1,
    }
    limits = {
        **TransformerArgs.limits,
        "kv_lora_rank": (1, 1 << 14),
        "q_lora_rank": (1, 1 << 16),
        "qk_rope_head_dim": (2, 1 << 12),
        "qk_nope_head_dim": (1, 1 << 12),
        "v_head_dim": (1, 1 << 12),
        "n_routed_experts": (1, 1 << 14),
        "n_shared_experts": (0, 1 << 8),
        "n_group": (1, 1 << 10),
        "topk_group": (1, 1 << 10),
        "first_k_dense_replace": (0, 1 << 12),
        "moe_layer_freq": (1, 1 << 12),
        "routed_scaling_factor": (POSITIVE, 1e6),
    }

    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    rope_interleave: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_attention_heads
        self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.rope_traditional = self.rope_interleave
        super().__post_init__()
        # Keys that change the math in ways this graph does not compute: refused, never ignored.
        for key, wanted in self.fixed.items():
            value = getattr(self, key)
            if value != wanted:
                raise ModelLoadError(
                    f"{key} {value!r} is not supported by the {self.family} graph ({wanted!r})", key=key
                )
        experts, groups = self.n_routed_experts, self.n_group
        if experts % groups:
            raise ModelLoadError(f"n_group = {groups} does not divide n_routed_experts = {experts}", key="n_group")
        group = experts // groups
        if groups > 1 and group < 2:
            raise ModelLoadError(
                f"n_group = {groups} leaves groups of one expert (a group is ranked by its best two)", key="n_group"
            )
        if self.topk_group > self.n_group or self.num_experts_per_tok > self.topk_group * group:
            raise ModelLoadError(
                f"num_experts_per_tok = {self.num_experts_per_tok} experts cannot be chosen from "
                f"topk_group = {self.topk_group} of {self.n_group} groups of {group}",
                key="topk_group",
            )

    @property
    def rope_dims(self) -> int:
        return self.qk_rope_head_dim

    def softmax_scale(self) -> float:
        """``(N + P) ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim)`` squared."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        scaling = self.rope_scaling or {}
        factor, all_dims = scaling.get("factor"), scaling.get("mscale_all_dim")
        if rope_type(scaling) != "default" and all_dims and factor and factor > 1:
            mscale = 0.1 * float(all_dims) * math.log(float(factor)) + 1.0
            scale *= mscale * mscale
        return scale

    def query_scale(self) -> PositionScale | None:
        """A factor of position on the queries (none in DeepSeek's configs)."""
        return None

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s feed-forward is the mixture of experts (else a dense MLP)."""
        return layer >= self.first_k_dense_replace

    def kernel_shapes(self) -> dict[str, Any]:
        """The decode step's attention shapes: the query heads over one shared head of the
        latent's width (the absorbed form; prompts attend over heads of ``N + P``)."""
        return {
            **super().kernel_shapes(),
            "head_dim": self.kv_lora_rank,
            "n_kv_heads": 1,
            "rope_dims": self.qk_rope_head_dim,
        }


def feed_forward(args: DeepseekV3Args, layer: int, kernels: KernelSet) -> nn.Module:
    """A dense SwiGLU MLP for the first layers, the routed and shared experts for the rest."""
    H = args.hidden_size
    if not args.is_sparse(layer):
        return GatedMLP(H, args.intermediate_size)
    shared = args.moe_intermediate_size * args.n_shared_experts
    return SparseMoE(
        H,
        args.moe_intermediate_size,
        args.n_routed_experts,
        args.num_experts_per_tok,
        kernels=kernels,
        scoring=args.scoring_func,
        normalize=args.norm_topk_prob,
        shared_expert=GatedMLP(H, shared) if shared else None,
        shared_name="shared_experts",
        corrected=args.topk_method == "noaux_tc",
        groups=args.n_group,
        top_groups=args.topk_group,
        scale=args.routed_scaling_factor,
    )


def latent_attention(args: DeepseekV3Args, kernels: KernelSet, rotary: Any) -> LatentAttention:
    """A layer's multi-head latent attention."""
    return LatentAttention(
        args.hidden_size,
        args.num_attention_heads,
        kv_rank=args.kv_lora_rank,
        rope_dims=args.qk_rope_head_dim,
        nope_dims=args.qk_nope_head_dim,
        value_dims=args.v_head_dim,
        q_rank=args.q_lora_rank,
        kernels=kernels,
        rotary=rotary,
        scale=args.softmax_scale(),
        bias=args.attention_bias,
        query_scale=args.query_scale(),
    )


class DeepseekV3(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: DeepseekV3Args, kernels: KernelSet):
        rotary = args_rotary(args, kernels, types=args.rope_types)
        H, eps = args.hidden_size, args.rms_norm_eps
        layers = [
            PreNormBlock(latent_attention(args, kernels, rotary), feed_forward(args, index, kernels), H, eps, kernels)
            for index in range(args.num_hidden_layers)
        ]
        model = DecoderModel(args.vocab_size, H, layers, RMSNorm(H, eps, kernels))
        super().__init__(model, tied=args.tie_word_embeddings)
        self.args = args


def mtp_head(args: DeepseekV3Args, kernels: KernelSet) -> MtpHead:
    """The next-token layer stored as layer ``num_hidden_layers`` (DeepSeek-V3's MTP module):
    ``enorm``, ``hnorm``, ``eh_proj``, a decoder block as the model's later layers (experts),
    ``shared_head.norm``; a chained step reads the block's output before that norm (the
    paper's ``h^k``)."""
    rotary = args_rotary(args, kernels, types=args.rope_types)
    H, eps = args.hidden_size, args.rms_norm_eps
    attention = latent_attention(args, kernels, rotary)
    block = PreNormBlock(attention, feed_forward(args, args.num_hidden_layers, kernels), H, eps, kernels)
    return MtpHead(block, H, eps, kernels, norm_offset=0.0, chain_normed=False)


#: The next-token layer's own names (after ``model.layers.{N}.``) -> :class:`MtpHead`'s; the
#: rest is its decoder block's. Its copies of the embedding and LM head are the model's.
MTP_NAMES = (("enorm.", "embed_norm."), ("hnorm.", "hidden_norm."), ("eh_proj.", "proj."), ("shared_head.norm.", "norm."))
MTP_SHARED = ("embed_tokens.", "shared_head.head.")


def mtp_weights(weights: dict[str, mx.array], args: DeepseekV3Args) -> dict[str, mx.array]:
    """The first next-token layer's weights under :class:`MtpHead`'s names (``kv_b_proj``
    split, experts stacked); empty when the checkpoint has none."""
    head = head_weights(weights, (f"model.layers.{args.num_hidden_layers}.",), MTP_NAMES, rest=True, skip=MTP_SHARED)
    if not head:
        return head
    split = split_kv_b_proj(head, args.num_attention_heads, args.qk_nope_head_dim, args.v_head_dim)
    return stack_experts(split, "mlp.experts", "mlp.switch_mlp", EXPERT_NAMES, args.n_routed_experts)


class DeepseekV3Architecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``deepseek_v3``."""

    args_class = DeepseekV3Args

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return DeepseekV3(self.args(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Layers past ``num_hidden_layers`` (multi-token prediction) dropped, ``kv_b_proj``
        split per head, experts stacked; rotary tables and a tied ``lm_head`` dropped."""
        args = self.args(config)
        kept = {name: array for name, array in weights.items() if _layer(name) < args.num_hidden_layers}
        split = split_kv_b_proj(kept, args.num_attention_heads, args.qk_nope_head_dim, args.v_head_dim)
        stacked = stack_experts(split, "mlp.experts", "mlp.switch_mlp", EXPERT_NAMES, args.n_routed_experts)
        return super().sanitize(stacked, config)

    def mtp_weights(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """The next-token layer's weights (:class:`~mlxr_core.model.layers.mtp.HasMtpHead`)."""
        return mtp_weights(weights, self.args(config))

    def build_mtp(self, config: dict[str, Any], kernels: KernelSet) -> MtpHead:
        """The next-token layer of this shape (:func:`mtp_head`)."""
        return mtp_head(self.args(config), kernels)

    def make_cache(self, model: nn.Module) -> list[Any]:
        """One latent cache per layer: ``kv_lora_rank + qk_rope_head_dim`` numbers a position."""
        return latent_caches(model)


def _layer(name: str) -> int:
    """The decoder layer a weight belongs to (-1 for the embedding, final norm and head)."""
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else -1
