"""DeepSeek-V4's config as transformers 5.25's ``DeepseekV4Config`` resolves it, from either era.

transformers writes per-layer lists (``layer_types`` of ``sliding_attention``,
``compressed_sparse_attention``, ``heavily_compressed_attention``; ``mlp_layer_types`` of ``hash_moe``
and ``moe``), ``compress_rates`` per attention kind and ``rope_parameters`` keyed ``main`` (the
sliding layers' RoPE) and ``compress`` (the compressed layers' and their compressors'). A released
config spells them ``compress_ratios`` (0, 4 or 128 a layer), ``compress_rate_csa`` /
``compress_rate_hca``, ``num_hash_layers``, ``qk_rope_head_dim`` and a flat ``rope_scaling`` that
applies to the ``compress`` RoPE only (YaRN there without its attention factor, which V4 never
applies). Each is read here as transformers' ``__post_init__`` folds it in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.layers import TransformerArgs, rope_type
from mlxr_core.model.layers.args import MAX_DIM, POSITIVE, check_rope_scaling

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH, ROUTED = "hash_moe", "moe"
#: A released config's per-layer ``compress_ratios`` -> the layer kind.
RATIO_KINDS = {0: SLIDING, 4: CSA, 128: HCA}
#: The router scores transformers computes (``ACT2FN[scoring_func]``).
SCORINGS = ("sqrtsoftplus", "sigmoid")
#: RoPE types this graph computes for ``main`` and ``compress``.
ROPE_TYPES = ("default", "yarn")


@dataclasses.dataclass
class DeepseekV4Args(TransformerArgs):
    """The keys the ``deepseek_v4`` graph reads, defaulted as ``DeepseekV4Config`` defaults them.
    ``num_key_value_heads`` is ignored (one key, which is also the value, serves every head), and
    so is ``norm_topk_prob`` (transformers always renormalizes the chosen experts' scores)."""

    family = "deepseek_v4"
    aliases = {"intermediate_size": ("moe_intermediate_size",), "n_routed_experts": ("num_local_experts",)}
    limits = {
        **TransformerArgs.limits,
        "q_lora_rank": (1, 1 << 16),
        "n_routed_experts": (1, 1 << 14),
        "n_shared_experts": (1, 1),
        "routed_scaling_factor": (POSITIVE, 1e6),
        "compress_rope_theta": (1.0, 1e15),
        "hc_mult": (1, 64),
        "hc_sinkhorn_iters": (1, 1000),
        "hc_eps": (0.0, 1.0),
        "swiglu_limit": (POSITIVE, 1e9),
        "sliding_window": (1, MAX_DIM),
        "o_groups": (1, 1 << 12),
        "o_lora_rank": (1, 1 << 16),
        "index_topk": (1, 1 << 24),
        "index_n_heads": (1, 1 << 12),
        "index_head_dim": (2, 1 << 14),
        "qk_rope_head_dim": (2, 1 << 14),
        "num_hash_layers": (0, 1 << 12),
    }

    head_dim: int | None = 512
    q_lora_rank: int = 1024
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    compress_rope_theta: float = 160000.0
    rope_parameters: dict[str, Any] | None = None
    partial_rotary_factor: float | None = None  # type: ignore[assignment]
    qk_rope_head_dim: int | None = None
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    compress_rates: dict[str, int] | None = None
    compress_ratios: list[int] | None = None
    compress_rate_csa: int | None = None
    compress_rate_hca: int | None = None
    num_hash_layers: int | None = None
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int | None = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_topk: int = 512
    index_n_heads: int = 64
    index_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    quantization_config: dict[str, Any] | None = None
    expert_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.partial_rotary_factor is None:
            rotated = self.qk_rope_head_dim if self.qk_rope_head_dim is not None else 64
            self.partial_rotary_factor = rotated / (self.head_dim or 512)
        self.num_key_value_heads = 1
        super().__post_init__()
        fixed: list[tuple[str, Any, tuple[Any, ...]]] = [
            ("scoring_func", self.scoring_func, SCORINGS),
            ("attention_bias", self.attention_bias, (False,)),
            ("mlp_bias", self.mlp_bias, (False,)),
        ]
        for key, value, allowed in fixed:
            if value not in allowed:
                raise ModelLoadError(
                    f"{value!r} is not computed by the {self.family} graph ({', '.join(map(repr, allowed))})", key=key
                )
        # Released V4 checkpoints may pack their experts as FP4 (two e2m1 codes a byte, one scale per
        # 32), which no format here unpacks: refused rather than read as FP8 or float.
        packing = (self.quantization_config or {}).get("expert_dtype", self.expert_dtype)
        if packing not in (None, "fp8", "bf16", "bfloat16"):
            raise ModelLoadError(
                f"experts stored as {packing!r} are not supported by the {self.family} graph (fp8 or float)",
                key="quantization_config.expert_dtype",
            )
        n = self.num_hidden_layers
        rates = {CSA: 4, HCA: 128, **(self.compress_rates or {})}
        if self.compress_rate_csa is not None:
            rates[CSA] = self.compress_rate_csa
        if self.compress_rate_hca is not None:
            rates[HCA] = self.compress_rate_hca
        if any(not isinstance(rates.get(kind), int) or rates[kind] < 1 for kind in (CSA, HCA)):
            raise ModelLoadError(f"compress rates must be positive integers, got {rates!r:.120}", key="compress_rates")
        self.compress_rates = rates
        kinds = self.layer_types
        if kinds is None and self.compress_ratios is not None:
            unknown = [r for r in self.compress_ratios if r not in RATIO_KINDS]
            if unknown:
                raise ModelLoadError(f"compress ratio {unknown[0]!r} is not one of 0, 4, 128", key="compress_ratios")
            kinds = [RATIO_KINDS[r] for r in self.compress_ratios]
        if kinds is None:  # V4-Pro's default: two heavily compressed layers, then alternating
            kinds = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp = self.mlp_layer_types
        if mlp is None:
            hashed = 3 if self.num_hash_layers is None else self.num_hash_layers
            mlp = [HASH] * min(n, hashed) + [ROUTED] * max(0, n - hashed)
        for key, listed, allowed in (("layer_types", kinds, (SLIDING, CSA, HCA)), ("mlp_layer_types", mlp, (HASH, ROUTED))):
            wrong = [kind for kind in listed[:n] if kind not in allowed]
            if len(listed) < n or wrong:
                raise ModelLoadError(
                    f"the {self.family} graph takes one of {', '.join(allowed)} for each of its {n} layers, "
                    f"not {listed!r:.120}", key=key,
                )
        self.layer_types, self.mlp_layer_types = list(kinds[:n]), list(mlp[:n])
        if (self.num_attention_heads * self.dims) % self.o_groups:
            raise ModelLoadError(
                f"o_groups = {self.o_groups} does not divide the {self.num_attention_heads} heads of {self.dims}",
                key="o_groups",
            )
        rotated = self.rope_dims_of(self.resolve_ropes()["compress"])
        if CSA in self.layer_types and rotated > self.index_head_dim:
            raise ModelLoadError(
                f"the indexer's heads of {self.index_head_dim} cannot take the {rotated} rotated features",
                key="index_head_dim",
            )

    def resolve_ropes(self) -> dict[str, dict[str, Any]]:
        """``main`` and ``compress`` as transformers reads them: given nested, or built from
        ``rope_theta`` (main, unscaled) and ``compress_rope_theta`` with the flat scaling (compress,
        YaRN's attention factor 1 unless given)."""
        given = self.rope_parameters if self.rope_parameters is not None else self.rope_scaling or {}
        if isinstance(given.get("main"), dict) and isinstance(given.get("compress"), dict):
            ropes = {"main": dict(given["main"]), "compress": dict(given["compress"])}
        else:
            flat = {key: value for key, value in given.items() if key not in ("main", "compress")}
            factor = self.partial_rotary_factor
            compress = {**flat, "rope_theta": self.compress_rope_theta, "partial_rotary_factor": factor}
            compress["rope_type"] = rope_type(compress)  # a released config's ``type`` too
            if rope_type(compress) == "yarn":
                compress.setdefault("attention_factor", 1.0)
            ropes = {
                "main": {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": factor},
                "compress": compress,
            }
        for name, rope in ropes.items():
            key = f"rope_parameters.{name}"
            if rope_type(rope) not in ROPE_TYPES:
                raise ModelLoadError(
                    f"rope_type {rope_type(rope)!r} is not computed by the {self.family} graph "
                    f"({', '.join(ROPE_TYPES)})", key=key,
                )
            check_rope_scaling(rope, key)
            dims = self.rope_dims_of(rope)
            if dims < 2 or dims % 2 or dims > self.dims:
                raise ModelLoadError(f"{key} rotates {dims} of {self.dims} features; RoPE needs an even number", key=key)
        return ropes

    def rope_dims_of(self, rope: dict[str, Any]) -> int:
        """The trailing features of a head one RoPE setting rotates (``head_dim * partial_rotary_factor``)."""
        return int(self.dims * float(rope.get("partial_rotary_factor", 1.0)))

    @property
    def rope_dims(self) -> int:
        return int(self.dims * (self.partial_rotary_factor or 1.0))

    def compress_rate(self, layer: int) -> int | None:
        """How many positions one compressed entry of ``layer`` sums (None: a sliding layer)."""
        assert self.layer_types is not None and self.compress_rates is not None
        kind = self.layer_types[layer]
        return None if kind == SLIDING else self.compress_rates[kind]

    def kernel_shapes(self) -> dict[str, Any]:
        """One shared key/value head of ``head_dim`` for every query head, interleaved RoPE."""
        return {**super().kernel_shapes(), "n_kv_heads": 1, "rope_traditional": True}
