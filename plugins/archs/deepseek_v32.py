"""DeepSeek-V3.2 (DeepSeek Sparse Attention) as transformers 5.25 defines it, served exactly while a
sequence is at most ``index_topk`` positions long.

V3.2 is DeepSeek-V3 (:mod:`mlxr_plugins.archs.deepseek_v3`: latent attention, the grouped sigmoid
router, shared experts) plus a lightning indexer in every layer (``layer_types``:
``indexed_attention``) that scores the positions up to each query and lets the latent attention
see only the ``index_topk`` best. Over ``index_topk`` positions or fewer it keeps every one, and the
attention is V3's: so this architecture builds V3's graph, sets the indexer's weights
(``self_attn.indexer.*``) aside and caps the context at ``index_topk`` (2048 in the released
config): a longer request is refused as too long, never answered with dense attention where
transformers attends sparsely. The indexer itself (its key cache and top-k mask) is what lifts the cap.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx

from mlxr_core.errors import ModelLoadError
from mlxr_plugins.archs.deepseek_v3 import DeepseekV3Architecture, DeepseekV3Args

#: The one attention kind of transformers' V3.2 layers.
INDEXED = "indexed_attention"


@dataclasses.dataclass
class DeepseekV32Args(DeepseekV3Args):
    """V3's keys, the indexer's and the per-layer lists transformers 5 writes (``mlp_layer_types``
    placing the dense layers, as transformers builds them). transformers' V3.2 always rotates interleaved
    pairs in the latent attention (its config has no ``rope_interleave``)."""

    family = "deepseek_v32"
    limits = {**DeepseekV3Args.limits, "index_topk": (1, 1 << 24), "index_n_heads": (1, 1 << 12),
              "index_head_dim": (1, 1 << 14)}

    index_topk: int = 2048
    index_n_heads: int = 64
    index_head_dim: int = 128
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        self.rope_interleave = True
        super().__post_init__()
        kinds = self.layer_types
        if kinds is not None and kinds != [INDEXED] * self.num_hidden_layers:
            raise ModelLoadError(
                f"the {self.family} graph computes {INDEXED} in each of its {self.num_hidden_layers} layers, "
                f"not {kinds!r:.120}", key="layer_types",
            )
        mlp = self.mlp_layer_types
        if mlp is not None:  # transformers builds the layers it lists, whatever first_k_dense_replace says
            dense = mlp.index("sparse") if "sparse" in mlp else len(mlp)
            if mlp != ["dense"] * dense + ["sparse"] * (len(mlp) - dense) or len(mlp) != self.num_hidden_layers:
                raise ModelLoadError(
                    f"the {self.family} graph takes dense layers, then experts, one a layer: not {mlp!r:.120}",
                    key="mlp_layer_types",
                )
            self.first_k_dense_replace = dense


class DeepseekV32Architecture(DeepseekV3Architecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``deepseek_v32``."""

    args_class = DeepseekV32Args

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """V3's, after setting the indexer's weights aside (they select every position within the cap)."""
        kept = {name: array for name, array in weights.items() if ".self_attn.indexer." not in name}
        return super().sanitize(kept, config)

    def context_length(self, config: dict[str, Any]) -> int:
        """At most ``index_topk``: up to there the indexer keeps every position."""
        args = self.args(config)
        assert isinstance(args, DeepseekV32Args)
        return min(super().context_length(config), args.index_topk)
