"""Mistral 4 (Mistral Small 4, text): DeepSeek-V3's graph with Mistral's router and Llama 4's
query scaling, as transformers 5.25 defines ``mistral4``.

The graph is :mod:`mlxr_plugins.archs.deepseek_v3`'s: multi-head latent attention with the
compressed latent cached, interleaved RoPE stretched by YaRN (the softmax scale times YaRN's
``mscale(factor, mscale_all_dim)`` squared), the first ``first_k_dense_replace`` layers dense, the
rest routed and shared SwiGLU experts. What differs:

- the router is DeepSeek-V2's: a softmax over the experts' logits (no correction bias), the
  choice limited to the experts of the ``topk_group`` best of ``n_group`` groups (a group ranked by
  its two best scores), the chosen scores renormalized (``norm_topk_prob``) and scaled by
  ``routed_scaling_factor``; transformers' Mistral 4 reads no ``scoring_func`` or ``topk_method``;
- the queries at position ``p`` are multiplied by ``1 + beta * ln(1 + floor(p / original))``, with
  ``beta`` the ``llama_4_scaling_beta`` and ``original`` the ``original_max_position_embeddings``
  of ``rope_parameters`` (:class:`~mlxr_core.model.layers.rope.PositionScale`);
- a config without RoPE settings means Mistral's YaRN (factor 128 over 8,192 positions, beta 0.1),
  as ``Mistral4Config`` fills it in; transformers' graph runs only YaRN (its default RoPE would
  rotate the whole head), so another ``rope_type`` is refused;
- transformers 5 saves the experts fused (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
  ``mlp.experts.down_proj``); ``sanitize`` splits them as the stacked projections.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import mlx.core as mx

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.layers.moe import split_fused_experts
from mlxr_core.model.layers.rope import PositionScale
from mlxr_plugins.archs.deepseek_v3 import DeepseekV3Architecture, DeepseekV3Args

#: ``Mistral4Config``'s RoPE when a config gives none.
DEFAULT_ROPE = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1,
}
#: The keys a config may carry RoPE settings under.
ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")


@dataclasses.dataclass
class Mistral4Args(DeepseekV3Args):
    """DeepSeek-V3's keys with ``Mistral4Config``'s defaults; the router's kind is fixed (see the
    module), and ``llama_4_scaling_beta`` is read from the RoPE settings."""

    family = "mistral4"
    rope_types: ClassVar[tuple[str, ...]] = ("yarn",)
    fixed: ClassVar[dict[str, Any]] = {"hidden_act": "silu"}

    kv_lora_rank: int = 256
    q_lora_rank: int | None = 1024
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 128
    n_shared_experts: int = 1
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 2048
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    max_position_embeddings: int = 1_048_576

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Mistral4Args:
        """Build from a ``mistral4`` config (Mistral's YaRN where it gives no RoPE settings)."""
        if all(config.get(key) is None for key in ROPE_KEYS):
            config = {**config, "rope_parameters": DEFAULT_ROPE}
        return super().from_config(config)

    def __post_init__(self) -> None:
        # transformers' Mistral 4 router: a softmax, group-limited, no correction bias; it reads
        # none of these keys, so neither does this graph.
        self.scoring_func, self.topk_method, self.moe_layer_freq = "softmax", "group_limited_greedy", 1
        super().__post_init__()
        head = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.partial_rotary_factor != 1.0 and int(head * self.partial_rotary_factor) != self.qk_rope_head_dim:
            raise ModelLoadError(
                f"partial_rotary_factor = {self.partial_rotary_factor} of the {head}-wide heads does not rotate "
                f"qk_rope_head_dim = {self.qk_rope_head_dim} dimensions", key="partial_rotary_factor",
            )
        beta = (self.rope_scaling or {}).get("llama_4_scaling_beta")
        if beta is not None and (not isinstance(beta, (int, float)) or not math.isfinite(beta)):
            raise ModelLoadError(f"{beta!r} is not a finite number", key="rope_parameters.llama_4_scaling_beta")

    def query_scale(self) -> PositionScale | None:
        """Llama 4's scaling where ``llama_4_scaling_beta`` is set (and not 0)."""
        scaling = self.rope_scaling or {}
        beta = scaling.get("llama_4_scaling_beta")
        if not beta:
            return None
        original = scaling.get("original_max_position_embeddings")
        if not original:
            raise ModelLoadError(
                "llama_4_scaling_beta needs original_max_position_embeddings (the positions between its steps)",
                key="rope_parameters.original_max_position_embeddings",
            )
        return PositionScale(float(beta), int(original))


class Mistral4Architecture(DeepseekV3Architecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``mistral4``."""

    args_class = Mistral4Args

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """transformers 5's fused experts split (folders with one tensor per expert load too),
        then DeepSeek-V3's."""
        return super().sanitize(split_fused_experts(weights, "mlp.experts", "mlp.switch_mlp"), config)
