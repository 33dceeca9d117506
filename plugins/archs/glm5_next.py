"""GLM-5-Next (GLM-5.3-Flash) text model as transformers 5.25 defines it, served exactly while a
sequence is at most ``index_topk`` positions long; images are not taken (the vision tower's
weights are set aside).

Each layer's token mixer (``self_attn``) is ``layer_types``' choice: ``linear_attention``,
:class:`~mlxr_core.model.layers.kimi_delta.KimiDeltaAttention` with GLM's bounded forget gate
(``g = linear_lower_bound * sigmoid(exp(A_log) * f)``), or ``indexed_attention``: latent attention
(:class:`~mlxr_core.model.layers.latent_attention.LatentAttention`, queries through ``q_lora_rank``)
with no RoPE at all (``qk_rope_head_dim`` 0), behind DeepSeek's sparse-attention indexer. The
indexer scores pools of ``index_kpool`` keys and keeps the ``index_topk / index_kpool`` best plus
the unfinished pool: over ``index_topk`` positions or fewer that is every position, so, as
:mod:`.deepseek_v32` does, the indexer's weights are set aside and the context is capped at
``index_topk`` (longer requests are refused as too long, never answered densely).

The residual is ``hc_mult`` streams (manifold-constrained hyper-connections, DeepSeek-V4's): around
each of a block's two halves, from the RMS-normed streams flattened, ``hc_*_fn`` gives per token
``pre`` (sigmoid), ``post`` (2 sigmoid) and a ``comb`` matrix (softmax, then Sinkhorn to doubly
stochastic); the half sees ``sum(pre * streams)`` and leaves ``post * out + comb^T streams``. The
streams start as copies of the embedding and end averaged before the final norm. Feed-forward: a
SwiGLU MLP or DeepSeek-V3's mixture, per ``mlp_layer_types``, gate and up clamped at
``swiglu_limit``.
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
    GatedMLP,
    RMSNorm,
    SparseMoE,
    TransformerArgs,
    stack_experts,
)
from mlxr_core.model.layers.kimi_delta import KimiDeltaAttention, sanitize_kimi_delta
from mlxr_core.model.layers.latent_attention import LatentAttention, split_kv_b_proj
from mlxr_plugins.archs.deepseek_v3 import EXPERT_NAMES
from mlxr_plugins.archs.deepseek_v4 import clamped_swiglu, hyper_connect
from mlxr_plugins.archs.kimi_linear import check_layer_lists, no_rotation, read_linear_attn_config
from mlxr_plugins.archs.qwen3_5 import text_config

LAYER_TYPES = ("linear_attention", "indexed_attention")
#: Where the text model's weights sit in the released vision-language checkpoints.
TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.", ""))


@dataclasses.dataclass
class Glm5NextArgs(TransformerArgs):
    """The keys of ``Glm5NextTextConfig`` this graph reads (its defaults)."""

    family = "glm5_next"
    aliases = {"n_routed_experts": ("num_local_experts", "num_experts")}
    limits = {
        **TransformerArgs.limits, "head_dim": (0, 1 << 14), "kv_lora_rank": (1, 1 << 14), "q_lora_rank": (1, 1 << 16), "qk_rope_head_dim": (0, 0),
        "qk_nope_head_dim": (1, 1 << 12), "v_head_dim": (1, 1 << 12), "n_routed_experts": (1, 1 << 14),
        "n_shared_experts": (0, 1 << 8), "n_group": (1, 1 << 10), "topk_group": (1, 1 << 10),
        "linear_head_dim": (1, 1 << 12), "linear_num_heads": (1, 1 << 12), "linear_conv_kernel_dim": (1, 64),
        "hc_mult": (1, 64), "hc_sinkhorn_iters": (1, 1000), "index_topk": (1, 1 << 24), "index_kpool": (1, 1 << 16),
        "swiglu_limit": (0.0, 1e9),
    }
    computes = {**TransformerArgs.computes, "scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)}

    hidden_size: int = 4096
    num_hidden_layers: int = 45
    intermediate_size: int = 12288
    num_attention_heads: int = 64
    vocab_size: int = 154880
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    n_routed_experts: int = 288
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    linear_attn_config: dict[str, Any] | None = None
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    index_topk: int = 2048
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        # No RoPE and no key/value heads of its own (TransformerArgs' checks are of those).
        self.num_key_value_heads, self.head_dim = self.num_attention_heads, self.kv_lora_rank
        released = self.linear_attn_config or {}
        read_linear_attn_config(self, released)
        if self.linear_attn_config is not None and released.get("safe_gate", True) and self.linear_lower_bound is None:
            self.linear_lower_bound = -5.0  # transformers' rule: a safe gate without its bound gets -5
        n = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = [LAYER_TYPES[i % 4 == 3] for i in range(n)]
        self.layer_types = ["indexed_attention" if kind == "full_attention" else kind for kind in self.layer_types]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense" if i < 3 else "sparse" for i in range(n)]
        check_layer_lists(self, n, LAYER_TYPES)
        if not self.index_kpool_always_select_tail:
            raise ModelLoadError("the unfinished pool left out of attention is not computed by this graph "
                                 "(it attends densely within index_topk)", key="index_kpool_always_select_tail")
        if self.index_topk % self.index_kpool:
            raise ModelLoadError(f"index_kpool = {self.index_kpool} does not divide index_topk = {self.index_topk}",
                                 key="index_kpool")
        experts, groups = self.n_routed_experts, self.n_group
        if experts % groups or self.topk_group > groups:
            raise ModelLoadError(f"n_group = {groups}, topk_group = {self.topk_group} do not split "
                                 f"{experts} experts", key="n_group")

    @property
    def rope_dims(self) -> int:
        return 0

    def is_linear(self, layer: int) -> bool:
        assert self.layer_types is not None
        return self.layer_types[layer] == "linear_attention"

    def kernel_shapes(self) -> dict[str, Any]:
        """The decode step's attention: every query head over one head of the latent's width."""
        return {"head_dim": self.kv_lora_rank, "n_heads": self.num_attention_heads, "n_kv_heads": 1,
                "rope_dims": 0, "rope_traditional": False, "masks": ("causal", "array"),
                "linear_head_dim": self.linear_head_dim}


class HyperBlock(nn.Module):
    """A pre-norm block over ``hc_mult`` streams (module docstring), the hyper-connections'
    tensors under the released names (``hc_attn_fn``, ``hc_ffn_base``, ...), mixed as DeepSeek-V4's
    (:func:`~mlxr_plugins.archs.deepseek_v4.hyper_connect`)."""

    def __init__(self, mixer: nn.Module, mlp: nn.Module, args: Glm5NextArgs, kernels: KernelSet):
        super().__init__()
        H, N, eps = args.hidden_size, args.hc_mult, args.rms_norm_eps
        self.self_attn, self.mlp = mixer, mlp
        self.input_layernorm = RMSNorm(H, eps, kernels)
        self.post_attention_layernorm = RMSNorm(H, eps, kernels)
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", mx.zeros(((2 + N) * N, N * H)))
            setattr(self, f"hc_{part}_base", mx.zeros(((2 + N) * N,)))
            setattr(self, f"hc_{part}_scale", mx.ones((3,)))
        self.streams, self.eps, self.hc_eps, self.iterations = N, eps, args.hc_eps, args.hc_sinkhorn_iters

    def __call__(self, h: mx.array, mask: str | mx.array | None, cache: Any) -> mx.array:
        post, comb, x = hyper_connect(self, h, "attn")
        h = post[..., None] * self.self_attn(self.input_layernorm(x), mask, cache)[:, :, None] + comb.swapaxes(-1, -2) @ h
        post, comb, x = hyper_connect(self, h, "ffn")
        return post[..., None] * self.mlp(self.post_attention_layernorm(x))[:, :, None] + comb.swapaxes(-1, -2) @ h


class StreamsModel(DecoderModel):
    """:class:`DecoderModel` whose layers run over ``streams`` copies of the embedding, averaged
    before the final norm."""

    def __init__(self, *args: Any, streams: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.streams = streams

    def run_layers(self, h: mx.array, cache: list[Any] | None = None, mask: str | mx.array | None = None,
                   positions: mx.array | None = None, added: Any = ()) -> mx.array:
        B, L, D = h.shape
        streams = mx.broadcast_to(h[:, :, None, :], (B, L, self.streams, D))
        out: mx.array = super().run_layers(streams, cache, mask, positions, added).mean(axis=2)
        return out


class Glm5Next(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: Glm5NextArgs, kernels: KernelSet):
        H, eps = args.hidden_size, args.rms_norm_eps
        activation = clamped_swiglu(args.swiglu_limit)
        assert args.mlp_layer_types is not None

        def mixer(layer: int) -> nn.Module:
            if args.is_linear(layer):
                return KimiDeltaAttention(H, heads=args.linear_num_heads, head_dim=args.linear_head_dim,
                                          conv_kernel=args.linear_conv_kernel_dim, eps=eps, kernels=kernels,
                                          lower_bound=args.linear_lower_bound)
            return LatentAttention(
                H, args.num_attention_heads, kv_rank=args.kv_lora_rank, rope_dims=0, nope_dims=args.qk_nope_head_dim,
                value_dims=args.v_head_dim, q_rank=args.q_lora_rank, kernels=kernels, rotary=no_rotation,
                scale=args.qk_nope_head_dim**-0.5, bias=args.attention_bias, eps=eps,
            )

        def feed_forward(layer: int) -> nn.Module:
            if args.mlp_layer_types[layer] == "dense":  # type: ignore[index]
                return GatedMLP(H, args.intermediate_size, activation=activation)
            shared = args.moe_intermediate_size * args.n_shared_experts
            return SparseMoE(
                H, args.moe_intermediate_size, args.n_routed_experts, args.num_experts_per_tok, kernels=kernels,
                scoring="sigmoid", normalize=args.norm_topk_prob, activation=activation,
                shared_expert=GatedMLP(H, shared, activation=activation) if shared else None,
                shared_name="shared_experts", corrected=True, groups=args.n_group, top_groups=args.topk_group,
                scale=args.routed_scaling_factor,
            )

        layers = [HyperBlock(mixer(i), feed_forward(i), args, kernels) for i in range(args.num_hidden_layers)]
        model = StreamsModel(args.vocab_size, H, layers, RMSNorm(H, eps, kernels), streams=args.hc_mult)
        super().__init__(model, tied=args.tie_word_embeddings)
        self.args = args


class Glm5NextArchitecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``glm5_next`` (its text model) and
    ``glm5_next_text``."""

    args_class = Glm5NextArgs

    def args(self, config: dict[str, Any]) -> Any:
        return self.args_class.from_config(text_config(config))

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Glm5Next(self.args(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """The text model's weights under plain names (the vision tower's, the indexer's, the
        multi-token-prediction layers past ``num_hidden_layers`` and their ``shared_head`` set
        aside), ``kv_b_proj`` split per head, experts stacked, KDA's tensors as its layer holds them."""
        args = self.args(config)
        kept: dict[str, mx.array] = {}
        for name, array in weights.items():
            for old, new in TEXT_PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            else:
                if not name.startswith(("model.", "lm_head.")) or name.startswith("model.visual."):
                    continue
            if name.startswith("model.visual.") or ".self_attn.indexer." in name or ".shared_head." in name:
                continue
            if name.startswith("model.layers.") and int(name.split(".")[2]) >= args.num_hidden_layers:
                continue
            kept[name] = array
        split = split_kv_b_proj(kept, args.num_attention_heads, args.qk_nope_head_dim, args.v_head_dim)
        stacked = stack_experts(split, "mlp.experts", "mlp.switch_mlp", EXPERT_NAMES, args.n_routed_experts)
        return {name: array for name, array in sanitize_kimi_delta(stacked).items()
                if not (args.tie_word_embeddings and name.startswith("lm_head."))}

    def make_cache(self, model: nn.Module) -> list[Any]:
        """A recurrent state per KDA layer, one latent a position per attention layer."""
        return [layer.self_attn.make_cache() for layer in model.layers]

    def context_length(self, config: dict[str, Any]) -> int:
        """At most ``index_topk``: up to there the indexer keeps every position."""
        args = self.args(config)
        return min(int(args.max_position_embeddings), int(args.index_topk))
