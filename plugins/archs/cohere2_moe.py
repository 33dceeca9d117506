"""Cohere 2 MoE (Command A's mixture of experts) as transformers 5.25 defines ``cohere2_moe``.

Cohere 2's block, with experts: attention and feed-forward side by side on one norm of the input
(``out = x + attn(norm(x)) + mlp(norm(x))``), the norm Cohere's bias-free LayerNorm, or an RMS
norm where ``rms_norm_eps`` is set. Layers attend within ``sliding_window`` or over everything
(``layer_types``); only the sliding layers rotate (RoPE in interleaved pairs), the global ones
attend without positions, except the dense prefix layers when ``prefix_dense_sliding_window_pattern``
is 1 (transformers' ``force_rope``). The logits are multiplied by ``logit_scale``.

``mlp_layer_types`` says which layers are dense (a SwiGLU MLP of ``prefix_dense_intermediate_size``,
else ``intermediate_size``) and which sparse: ``num_experts`` SwiGLU experts of
``intermediate_size``, the ``num_experts_per_tok`` of highest router logit chosen and weighted by a
softmax over theirs (``expert_selection_fn: softmax``) or each one's sigmoid (``sigmoid``,
renormalized with ``norm_topk_prob``), plus ``num_shared_experts`` experts' worth of shared MLP on
every token, added (``shared_expert_combination_strategy: sum``) or averaged with the routed sum
(``average``). Configs without the per-layer lists get them as ``Cohere2MoeConfig`` derives them
from ``first_k_dense_replace`` and the two window patterns.

transformers saves one tensor per expert (``mlp.experts.E.gate_proj.weight``); ``sanitize``
stacks them (fused ``gate_up_proj`` tensors are split).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers import (
    Attention,
    CausalLM,
    DecoderArchitecture,
    DecoderModel,
    GatedMLP,
    LayerNorm,
    ParallelBlock,
    RMSNorm,
    SparseMoE,
    TransformerArgs,
    args_rotary,
    stack_experts,
)
from mlxr_core.model.layers.args import POSITIVE
from mlxr_core.model.layers.config_eras import FULL, SLIDING
from mlxr_core.model.layers.moe import split_fused_experts

EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
#: The values of the keys that choose among this graph's options.
CHOICES = {
    "expert_selection_fn": ("softmax", "sigmoid"),
    "shared_expert_combination_strategy": ("sum", "average"),
}


@dataclasses.dataclass
class Cohere2MoeArgs(TransformerArgs):
    """The keys ``Cohere2MoeConfig`` reads, with its defaults."""

    family = "cohere2_moe"
    limits = {
        **TransformerArgs.limits,
        "layer_norm_eps": (POSITIVE, 1.0),
        "logit_scale": (-1e6, 1e6),
        "num_shared_experts": (0, 1 << 8),
        "prefix_dense_intermediate_size": (1, 1 << 22),
        "prefix_dense_sliding_window_pattern": (1, 1 << 12),
        "sliding_window_pattern": (1, 1 << 12),
        "first_k_dense_replace": (0, 1 << 12),
    }

    head_dim: int | None = 128
    layer_norm_eps: float = 1e-5
    #: Set: RMS norms of this epsilon; None: Cohere's LayerNorm of ``layer_norm_eps``.
    rms_norm_eps: float | None = None  # type: ignore[assignment]
    logit_scale: float = 0.0625
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    sliding_window: int | None = 4096
    num_experts: int = 8
    num_experts_per_tok: int = 2
    num_shared_experts: int = 0
    shared_expert_combination_strategy: str = "average"
    expert_selection_fn: str = "softmax"
    norm_topk_prob: bool = True
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    prefix_dense_sliding_window_pattern: int = 1
    prefix_dense_intermediate_size: int | None = None
    sliding_window_pattern: int = 4
    first_k_dense_replace: int = 0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Cohere2MoeArgs:
        """Build from a ``cohere2_moe`` config. transformers 5 writes this family's ``rope_theta``
        field (its default, whatever the model's) beside ``rope_parameters``, and reads the base in
        ``rope_parameters`` (the field only fills one that has none): so does this graph."""
        rope = config.get("rope_parameters")
        if isinstance(rope, dict) and rope.get("rope_theta") is not None:
            config = {key: value for key, value in config.items() if key != "rope_theta"}
        return super().from_config(config)

    def __post_init__(self) -> None:
        self.rope_traditional = True  # Cohere rotates interleaved pairs
        super().__post_init__()
        if self.partial_rotary_factor != 1.0:  # transformers' Cohere RoPE rotates whole heads whatever it says
            raise ModelLoadError(
                f"{self.partial_rotary_factor}: the {self.family} graph rotates whole heads", key="partial_rotary_factor"
            )
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ModelLoadError(
                    f"{getattr(self, key)!r}: the {self.family} graph computes {' or '.join(allowed)}", key=key
                )
        n, dense = self.num_hidden_layers, min(self.first_k_dense_replace, self.num_hidden_layers)
        if self.layer_types is None:  # as Cohere2MoeConfig derives them
            prefix, every = self.prefix_dense_sliding_window_pattern, self.sliding_window_pattern
            self.layer_types = [SLIDING if (i + 1) % prefix else FULL for i in range(dense)]
            self.layer_types += [SLIDING if (i + 1) % every else FULL for i in range(n - dense)]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense"] * dense + ["sparse"] * (n - dense)
        for key, kinds, allowed in (
            ("layer_types", self.layer_types, (SLIDING, FULL)),
            ("mlp_layer_types", self.mlp_layer_types, ("dense", "sparse")),
        ):
            wrong = [kind for kind in kinds if kind not in allowed]
            if len(kinds) != n or wrong:
                raise ModelLoadError(
                    f"{kinds!r:.120} is not one of {' or '.join(allowed)} for each of the {n} layers", key=key
                )
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ModelLoadError("sliding_attention layers need a sliding_window", key="sliding_window")

    def is_sliding(self, layer: int) -> bool:
        assert self.layer_types is not None
        return self.layer_types[layer] == SLIDING

    def is_dense(self, layer: int) -> bool:
        assert self.mlp_layer_types is not None
        return self.mlp_layer_types[layer] == "dense"

    def rotates(self, layer: int) -> bool:
        """Sliding layers rotate; so do dense ones with ``prefix_dense_sliding_window_pattern`` 1."""
        return self.is_sliding(layer) or (self.is_dense(layer) and self.prefix_dense_sliding_window_pattern == 1)


def unrotated(x: mx.array, offset: int | mx.array) -> mx.array:
    """The global layers' queries and keys: no positions."""
    return x


class Cohere2MoeExperts(SparseMoE):
    """:class:`SparseMoE` whose output, with ``average``, is the mean of the routed sum and the
    shared experts' output (Cohere's ``shared_expert_combination_strategy``)."""

    def __init__(self, *args: Any, average: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._average = average and self.shared_name in self

    def __call__(self, x: mx.array) -> mx.array:
        out = super().__call__(x)
        return out * 0.5 if self._average else out


def feed_forward(args: Cohere2MoeArgs, layer: int, kernels: KernelSet) -> nn.Module:
    H, inner = args.hidden_size, args.intermediate_size
    if args.is_dense(layer):
        return GatedMLP(H, args.prefix_dense_intermediate_size or inner)
    softmax = args.expert_selection_fn == "softmax"
    return Cohere2MoeExperts(
        H,
        inner,
        args.num_experts,
        args.num_experts_per_tok,
        kernels=kernels,
        scoring=args.expert_selection_fn,
        normalize=softmax or args.norm_topk_prob,  # a softmax over the chosen logits sums to 1
        shared_expert=GatedMLP(H, inner * args.num_shared_experts) if args.num_shared_experts else None,
        shared_name="shared_experts",
        average=args.shared_expert_combination_strategy == "average",
    )


class Cohere2Moe(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``, the logits scaled."""

    def __init__(self, args: Cohere2MoeArgs, kernels: KernelSet):
        rotary = args_rotary(args, kernels, types=("default",))
        H = args.hidden_size

        def norm() -> RMSNorm | LayerNorm:
            eps = args.rms_norm_eps
            return RMSNorm(H, eps, kernels) if eps is not None else LayerNorm(H, args.layer_norm_eps)

        def block(index: int) -> ParallelBlock:
            attention = Attention(
                H,
                args.num_attention_heads,
                args.kv_heads,
                args.dims,
                kernels=kernels,
                rotary=rotary if args.rotates(index) else unrotated,
                qkv_bias=args.attention_bias,
                out_bias=args.attention_bias,
                window=args.sliding_window if args.is_sliding(index) else None,
            )
            return ParallelBlock(attention, feed_forward(args, index, kernels), norm())

        layers = [block(index) for index in range(args.num_hidden_layers)]
        super().__init__(DecoderModel(args.vocab_size, H, layers, norm()), tied=args.tie_word_embeddings)
        self.args = args
        self._logit_scale = args.logit_scale

    def lm_logits(self, h: mx.array) -> mx.array:
        return super().lm_logits(h) * self._logit_scale


class Cohere2MoeArchitecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``cohere2_moe``."""

    args_class = Cohere2MoeArgs

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Cohere2Moe(self.args(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Experts stacked (or split, where fused); rotary tables and a tied ``lm_head`` dropped."""
        count = self.args(config).num_experts
        split = split_fused_experts(weights, "mlp.experts", "mlp.switch_mlp")
        return super().sanitize(stack_experts(split, "mlp.experts", "mlp.switch_mlp", EXPERT_NAMES, count), config)
