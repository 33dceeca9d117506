"""Nemotron-H (Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano) as transformers 5.25 defines it.

A hybrid whose layers each hold one thing after an RMS norm, with a residual around it
(``h = x + mixer(norm(x))``), per ``layers_block_type`` (or the released configs'
``hybrid_override_pattern``: ``M`` ``*`` ``-`` ``E``):

- ``linear_attention``: Mamba-2 (:class:`~mlxr_core.model.layers.mamba2.Mamba2Mixer`), a conv
  state and an SSD state in a :class:`~mlxr_core.model.cache.RecurrentCache`;
- ``full_attention``: grouped-query attention **without RoPE**, a :class:`KVCache`;
- ``mlp``: ``down(relu(up(x)) ** 2)``;
- ``moe``: DeepSeek-V3's sigmoid router (correction bias, groups), experts that are that same
  ungated MLP, an optional latent projection around them, one shared expert.

Feed-forward layers hold no state; their cache is an empty :class:`RecurrentCache` (as LFM2's
convolutions hold an empty recurrent state) so that every layer pairs with a cache that batches,
stores in the prefix cache and rolls back a rejected draft like the others.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import KVCache, RecurrentCache
from mlxr_core.model.layers import (
    CausalLM,
    DecoderArchitecture,
    DecoderModel,
    RMSNorm,
    TransformerArgs,
)
from mlxr_core.model.layers.attention import Attention
from mlxr_core.model.layers.mamba2 import Mamba2Mixer
from mlxr_core.model.layers.moe import CorrectedRouter, SwitchLinear, gated_experts, weighted_sum

BLOCK_TYPES = ("linear_attention", "full_attention", "mlp", "moe")
#: The released configs' ``hybrid_override_pattern`` letters.
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


@dataclasses.dataclass
class NemotronHArgs(TransformerArgs):
    """The keys of ``NemotronHConfig`` this graph reads (its defaults), under either spelling."""

    family = "nemotron_h"
    aliases = {
        "rms_norm_eps": ("layer_norm_epsilon",),
        "n_groups": ("mamba_n_groups",),
        "conv_kernel": ("mamba_d_conv",),
        "expand": ("mamba_expand",),
        "time_step_limit": ("mamba_dt_limit",),
        "use_conv_bias": ("mamba_conv_bias",),
        "n_routed_experts": ("num_local_experts",),
    }
    limits = {
        **TransformerArgs.limits,
        "mamba_num_heads": (1, 1 << 14),
        "mamba_head_dim": (1, 1 << 14),
        "n_groups": (1, 1 << 14),
        "ssm_state_size": (1, 1 << 14),
        "conv_kernel": (1, 64),
        "n_routed_experts": (1, 1 << 14),
        "moe_shared_expert_intermediate_size": (1, 1 << 22),
        "moe_latent_size": (1, 1 << 20),
    }
    #: Only these activations are computed; another is refused, naming the key.
    computes = {**TransformerArgs.computes, "mlp_hidden_act": ("relu2",), "mamba_hidden_act": ("silu",)}

    hidden_size: int = 4096
    intermediate_size: int = 21504
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    vocab_size: int = 131072
    num_hidden_layers: int = 0  # transformers derives it from layers_block_type
    head_dim: int | None = 128
    rms_norm_eps: float = 1e-5
    layers_block_type: list[str] | None = None
    hybrid_override_pattern: str | None = None
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    n_groups: int = 8
    ssm_state_size: int = 128
    conv_kernel: int = 4
    #: ``[low, high]``; high may be infinite (transformers' default), so not checked as floats
    time_step_limit: list[Any] = dataclasses.field(default_factory=lambda: [0.0, math.inf])
    use_conv_bias: bool = True
    use_bias: bool = False
    mlp_bias: bool = False
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if self.layers_block_type is None and self.hybrid_override_pattern is not None:
            unknown = sorted(set(self.hybrid_override_pattern) - set(PATTERN))
            if unknown:
                raise ModelLoadError(f"unknown layer letters {unknown} (known: {' '.join(PATTERN)})",
                                     key="hybrid_override_pattern")
            self.layers_block_type = [PATTERN[letter] for letter in self.hybrid_override_pattern]
        if self.layers_block_type is None:
            self.layers_block_type = ["linear_attention", "moe", "full_attention", "mlp"]
        unknown = sorted(set(self.layers_block_type) - set(BLOCK_TYPES))
        if unknown or not self.layers_block_type:
            raise ModelLoadError(f"layers_block_type must name layers, each one of {', '.join(BLOCK_TYPES)}"
                                 f" (unknown: {', '.join(unknown) or 'none'})", key="layers_block_type")
        self.num_hidden_layers = len(self.layers_block_type)
        super().__post_init__()
        limit = self.time_step_limit
        if len(limit) != 2 or not all(isinstance(x, int | float) and not math.isnan(x) for x in limit) or limit[0] < 0:
            raise ModelLoadError(f"time_step_limit must be [low, high], not {self.time_step_limit}", key="time_step_limit")
        if self.mamba_num_heads % self.n_groups:
            raise ModelLoadError(f"mamba_num_heads {self.mamba_num_heads} is not a multiple of n_groups "
                                 f"{self.n_groups}", key="n_groups")
        if self.n_routed_experts % self.n_group:
            raise ModelLoadError(f"n_routed_experts {self.n_routed_experts} is not a multiple of n_group "
                                 f"{self.n_group}", key="n_group")

    def kernel_shapes(self) -> dict[str, Any]:
        """The attention shapes; no layer rotates."""
        return {**super().kernel_shapes(), "rope_dims": 0}


def no_rotation(x: mx.array, offset: int | mx.array) -> mx.array:
    """Nemotron-H's attention rotates nothing (the Mamba layers carry the order)."""
    return x


def relu2(x: mx.array) -> mx.array:
    return mx.square(nn.relu(x))


class ReluSquaredMLP(nn.Module):
    """``down_proj(relu(up_proj(x)) ** 2)``."""

    def __init__(self, hidden: int, inner: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array = self.down_proj(relu2(self.up_proj(x)))
        return out


class NemotronHMoE(nn.Module):
    """Routed ungated experts (in the latent space when ``fc1_latent_proj`` is there) plus the
    shared expert on every token; the router is DeepSeek-V3's (:func:`~mlxr_core.model.layers.moe.route`)."""

    def __init__(self, args: NemotronHArgs, kernels: KernelSet):
        super().__init__()
        H, inner, E = args.hidden_size, args.moe_intermediate_size, args.n_routed_experts
        width = args.moe_latent_size or H
        self.args = args
        self._route = kernels.route
        self.gate = CorrectedRouter(H, E)
        self.experts = ExpertStack(width, inner, E, kernels)
        self.shared_experts = ReluSquaredMLP(H, args.moe_shared_expert_intermediate_size, args.mlp_bias)
        if args.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(H, width, bias=args.mlp_bias)
            self.fc2_latent_proj = nn.Linear(width, H, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        a = self.args
        extra: dict[str, Any] = {"groups": a.n_group, "top_groups": a.topk_group} if a.n_group > 1 else {}
        indices, weights = self._route(self.gate(x), top_k=a.num_experts_per_tok, scoring="sigmoid",
                                       normalize=a.norm_topk_prob, bias=self.gate.e_score_correction_bias, **extra)
        if a.routed_scaling_factor != 1.0:
            weights = weights * a.routed_scaling_factor
        latent = self.fc1_latent_proj(x) if "fc1_latent_proj" in self else x
        routed = weighted_sum(self.experts(latent, indices), weights)
        if "fc2_latent_proj" in self:
            routed = self.fc2_latent_proj(routed)
        out: mx.array = routed + self.shared_experts(x)
        return out


class ExpertStack(nn.Module):
    """Every expert's ``down_proj(relu(up_proj(x)) ** 2)``, stacked (:class:`SwitchLinear`)."""

    def __init__(self, hidden: int, inner: int, experts: int, kernels: KernelSet):
        super().__init__()
        self.up_proj = SwitchLinear(hidden, inner, experts, kernels=kernels)
        self.down_proj = SwitchLinear(inner, hidden, experts, kernels=kernels)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        # gated_experts' gate is the up projection; its activation drops the (absent) up half
        return gated_experts(x, indices, self.up_proj, _no_projection, self.down_proj, _relu2_of_gate)


def _no_projection(rows: mx.array, picks: mx.array, sort: bool) -> mx.array:
    return rows


def _relu2_of_gate(gate: mx.array, up: mx.array) -> mx.array:
    return relu2(gate)


class NemotronHBlock(nn.Module):
    """``x + mixer(norm(x))``, the mixer of ``kind``; a cache for every kind (module docstring)."""

    def __init__(self, kind: str, args: NemotronHArgs, kernels: KernelSet):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.kind = kind
        self.norm = RMSNorm(H, eps, kernels)
        self.mixer: nn.Module
        if kind == "linear_attention":
            low, high = args.time_step_limit
            self.mixer = Mamba2Mixer(
                H, heads=args.mamba_num_heads, head_dim=args.mamba_head_dim, groups=args.n_groups,
                state_size=args.ssm_state_size, conv_kernel=args.conv_kernel, eps=eps,
                conv_bias=args.use_conv_bias, bias=args.use_bias, time_step_limit=(float(low), float(high)), kernels=kernels,
            )
        elif kind == "full_attention":
            self.mixer = Attention(H, args.num_attention_heads, args.kv_heads, args.dims, kernels=kernels,
                                   rotary=no_rotation)
        elif kind == "mlp":
            self.mixer = ReluSquaredMLP(H, args.intermediate_size, args.mlp_bias)
        else:
            self.mixer = NemotronHMoE(args, kernels)

    def make_cache(self) -> Any:
        if self.kind == "linear_attention":
            return self.mixer.make_cache()
        if self.kind == "full_attention":
            return KVCache()
        return RecurrentCache((0,), (0,))

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: Any) -> mx.array:
        normed = self.norm(x)
        if self.kind in ("linear_attention", "full_attention"):
            return x + self.mixer(normed, mask, cache)
        if cache is not None:  # no state: the empty one advances (and keeps its positions) in step
            B, L, _ = x.shape
            empty = mx.zeros((B, 0), dtype=mx.float32)
            if getattr(cache, "keeps_positions", False) and L > 1:
                cache.keep_positions([empty] * L, [empty] * L)
            cache.update(empty, empty, L)
        out: mx.array = x + self.mixer(normed)
        return out


class NemotronH(CausalLM):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: NemotronHArgs, kernels: KernelSet):
        assert args.layers_block_type is not None
        H = args.hidden_size
        layers = [NemotronHBlock(kind, args, kernels) for kind in args.layers_block_type]
        super().__init__(DecoderModel(args.vocab_size, H, layers, RMSNorm(H, args.rms_norm_eps, kernels)),
                         tied=args.tie_word_embeddings)
        self.args = args


#: transformers' names -> :class:`DecoderModel`'s.
RENAMES = (("model.embeddings.", "model.embed_tokens."), ("backbone.embeddings.", "model.embed_tokens."),
           ("model.norm_f.", "model.norm."), ("backbone.norm_f.", "model.norm."), ("backbone.", "model."))


class NemotronHArchitecture(DecoderArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``nemotron_h``."""

    args_class = NemotronHArgs

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return NemotronH(self.args(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Names as the graph holds them, conv weights in MLX's layout, per-expert tensors stacked,
        multi-token-prediction layers (``mtp.*``) dropped."""
        args = self.args(config)
        out: dict[str, mx.array] = {}
        experts: dict[str, dict[int, mx.array]] = {}
        for name, array in weights.items():
            if name.startswith("mtp."):
                continue
            for old, new in RENAMES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            if name.endswith("conv1d.weight") and array.ndim == 3 and array.shape[1] == 1:
                array = array.swapaxes(1, 2)  # [C, 1, K] -> [C, K, 1]
            if ".mixer.experts." in name and name.endswith(".weight") and name.split(".")[-3].isdigit():
                stem, index, projection = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
                experts.setdefault(f"{stem}.{projection}.weight", {})[index] = array
                continue
            if ".mixer.experts." in name and name.endswith(("up_proj", "down_proj")):
                name += ".weight"
            out[name] = array
        for name, stack in experts.items():
            if sorted(stack) != list(range(args.n_routed_experts)):
                raise ModelLoadError(f"{name}: experts {sorted(stack)[:8]} ..., not 0..{args.n_routed_experts - 1}")
            out[name] = mx.stack([stack[i] for i in range(args.n_routed_experts)])
        return super().sanitize(out, config)

    def make_cache(self, model: nn.Module) -> list[Any]:
        """A recurrent state per Mamba layer, keys and values per attention layer, an empty state
        per feed-forward layer."""
        return [layer.make_cache() for layer in model.layers]
