"""Kimi Linear (Kimi-Linear-48B-A3B) as transformers 5.25 defines it: Kimi delta attention layers
interleaved with DeepSeek-V3's latent attention, DeepSeek-V3's experts.

Each layer's token mixer (``self_attn`` in either kind) is ``layer_types``' choice:
``linear_attention``, :class:`~mlxr_core.model.layers.kimi_delta.KimiDeltaAttention` (a recurrent
state, no keys and values, through the ``kimi_delta`` kernel op), or ``full_attention``,
:class:`~mlxr_core.model.layers.latent_attention.LatentAttention` **without RoPE** (transformers'
Kimi Linear has no rotary embedding: the ``qk_rope_head_dim`` part of the keys is still one key
shared by every head, unrotated), the softmax scale ``(qk_nope_head_dim + qk_rope_head_dim) **
-0.5``. The feed-forward is a SwiGLU MLP or DeepSeek-V3's mixture (sigmoid router with the
correction bias, ``num_expert_group`` groups, shared experts), per ``mlp_layer_types`` (else the
first ``first_k_dense_replace`` layers dense).

Configs: the released one (``linear_attn_config`` with 1-based ``kda_layers`` and
``full_attn_layers``, ``num_experts``, ``moe_renormalize``, ...) and transformers 5's (the same
names, ``layer_types``, ``linear_head_dim``, ...). The released weights (which transformers also
writes): ``block_sparse_moe`` with per-expert ``w1``/``w2``/``w3``, three convolutions, the
forget gate on the layer. Caches: a :class:`~mlxr_core.model.cache.RecurrentCache` per KDA layer,
a latent :class:`~mlxr_core.model.cache.KVCache` per attention layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers import CausalLM, DecoderModel, RMSNorm, stack_experts
from mlxr_core.model.layers.kimi_delta import KimiDeltaAttention, sanitize_kimi_delta
from mlxr_core.model.layers.latent_attention import LatentAttention, split_kv_b_proj
from mlxr_core.model.layers.linear_attention import MixerBlock
from mlxr_plugins.archs.deepseek_v3 import DeepseekV3Architecture, DeepseekV3Args, feed_forward

LAYER_TYPES = ("linear_attention", "full_attention")
MLP_TYPES = ("dense", "sparse")
#: The released per-expert names -> the stacked ones.
EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def no_rotation(x: mx.array, offset: int | mx.array) -> mx.array:
    """Kimi Linear's latent attention rotates nothing."""
    return x


@dataclasses.dataclass
class KimiLinearArgs(DeepseekV3Args):
    """The keys of ``KimiLinearConfig`` this graph reads (its defaults), under either spelling."""

    family = "kimi_linear"
    aliases = {
        "n_routed_experts": ("num_experts", "num_local_experts"),
        "num_experts_per_tok": ("num_experts_per_token",),
        "n_shared_experts": ("num_shared_experts",),
        "norm_topk_prob": ("moe_renormalize",),
        "n_group": ("num_expert_group",),
        "max_position_embeddings": ("model_max_length",),
    }
    limits = {**DeepseekV3Args.limits, "linear_head_dim": (1, 1 << 12), "linear_num_heads": (1, 1 << 12),
              "linear_conv_kernel_dim": (1, 64)}
    #: What the released config can ask for that transformers (and this graph) does not compute.
    computes = {**DeepseekV3Args.computes, "moe_router_activation_func": ("sigmoid",), "mla_use_nope": (True,),
                "mla_use_output_gate": (False,)}

    q_lora_rank: int | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.446
    first_k_dense_replace: int = 1
    rms_norm_eps: float = 1e-5
    linear_head_dim: int = 128
    linear_num_heads: int = 32
    linear_conv_kernel_dim: int = 4
    linear_attn_config: dict[str, Any] | None = None
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        released = self.linear_attn_config or {}
        read_linear_attn_config(self, released)
        if released.get("use_full_rank_gate"):  # a later Kimi's gate, not Kimi Linear's low-rank one
            raise ModelLoadError("a full-rank forget gate is not computed by this graph (low-rank only)",
                                 key="linear_attn_config.use_full_rank_gate")
        n = self.num_hidden_layers
        if self.layer_types is None and "kda_layers" in released and "full_attn_layers" in released:
            kinds: list[Any] = [None] * n  # the released lists count layers from 1
            for kind, key in (("full_attention", "full_attn_layers"), ("linear_attention", "kda_layers")):
                for layer in released[key]:
                    if not (isinstance(layer, int) and 1 <= layer <= n):
                        raise ModelLoadError(f"{layer!r} is not a layer in 1..{n}", key=f"linear_attn_config.{key}")
                    kinds[layer - 1] = kind
            self.layer_types = kinds
        if self.layer_types is None:
            self.layer_types = [LAYER_TYPES[bool(i and i % 4 == 0)] for i in range(n)]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense" if i < self.first_k_dense_replace else "sparse" for i in range(n)]
        check_layer_lists(self, n, LAYER_TYPES)

    def softmax_scale(self) -> float:
        """``(N + P) ** -0.5``: no RoPE, so no YaRN factor."""
        return float((self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5)

    def is_sparse(self, layer: int) -> bool:
        assert self.mlp_layer_types is not None
        return self.mlp_layer_types[layer] == "sparse"

    def is_linear(self, layer: int) -> bool:
        assert self.layer_types is not None
        return self.layer_types[layer] == "linear_attention"


#: ``linear_attn_config``'s keys (the released configs') -> the fields transformers 5 writes.
LINEAR_ATTN_KEYS = (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                    ("short_conv_kernel_size", "linear_conv_kernel_dim"), ("gate_lower_bound", "linear_lower_bound"))


def read_linear_attn_config(args: Any, released: dict[str, Any]) -> None:
    """The KDA sizes (and GLM's gate bound, where ``args`` has one) from a released config's
    ``linear_attn_config`` over the top-level fields."""
    for key, field in LINEAR_ATTN_KEYS:
        if key in released and hasattr(args, field):
            setattr(args, field, released[key])


def check_layer_lists(args: Any, layers: int, attention_kinds: tuple[str, ...]) -> None:
    """``layer_types`` and ``mlp_layer_types`` name ``layers`` layers, each a kind the graph builds."""
    for key, allowed in (("layer_types", attention_kinds), ("mlp_layer_types", MLP_TYPES)):
        value = getattr(args, key)
        if len(value) != layers or any(kind not in allowed for kind in value):
            raise ModelLoadError(f"{value!r:.120} must name {layers} layers, each one of {', '.join(allowed)}", key=key)


class KimiLinear(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: KimiLinearArgs, kernels: KernelSet):
        H, eps = args.hidden_size, args.rms_norm_eps

        def mixer(layer: int) -> nn.Module:
            if args.is_linear(layer):
                return KimiDeltaAttention(H, heads=args.linear_num_heads, head_dim=args.linear_head_dim,
                                          conv_kernel=args.linear_conv_kernel_dim, eps=eps, kernels=kernels)
            return LatentAttention(
                H, args.num_attention_heads, kv_rank=args.kv_lora_rank, rope_dims=args.qk_rope_head_dim,
                nope_dims=args.qk_nope_head_dim, value_dims=args.v_head_dim, q_rank=args.q_lora_rank,
                kernels=kernels, rotary=no_rotation, scale=args.softmax_scale(), bias=args.attention_bias,
            )

        layers = [
            MixerBlock("self_attn", mixer(i), feed_forward(args, i, kernels), H, eps, kernels)
            for i in range(args.num_hidden_layers)
        ]
        super().__init__(DecoderModel(args.vocab_size, H, layers, RMSNorm(H, eps, kernels)), tied=args.tie_word_embeddings)
        self.args = args


class KimiLinearArchitecture(DeepseekV3Architecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``kimi_linear``."""

    args_class = KimiLinearArgs

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return KimiLinear(self.args(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Layers past ``num_hidden_layers`` dropped, ``block_sparse_moe`` as ``mlp``, experts
        stacked, ``kv_b_proj`` split per head, KDA's tensors as its layer holds them."""
        args = self.args(config)
        kept = {name.replace(".block_sparse_moe.", ".mlp."): array for name, array in weights.items()
                if not name.startswith("model.layers.") or int(name.split(".")[2]) < args.num_hidden_layers}
        split = split_kv_b_proj(kept, args.num_attention_heads, args.qk_nope_head_dim, args.v_head_dim)
        stacked = stack_experts(split, "mlp.experts", "mlp.switch_mlp", EXPERT_NAMES, args.n_routed_experts)
        tied = args.tie_word_embeddings
        return {name: array for name, array in sanitize_kimi_delta(stacked).items()
                if not (tied and name.startswith("lm_head."))}

    def make_cache(self, model: nn.Module) -> list[Any]:
        """A recurrent state per KDA layer, one latent a position per attention layer."""
        return [layer.self_attn.make_cache() for layer in model.layers]
