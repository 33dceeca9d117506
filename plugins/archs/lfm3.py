"""LFM3 (Liquid AI): LFM2's short convolutions (:mod:`mlxr_plugins.archs.lfm2`) among
sliding-window and full attention layers, with sandwich norms and a gate per attention head.

Per ``layer_types`` a layer's mixer is a ``conv`` (LFM2's ``ShortConv``), ``sliding_attention``
(within ``sliding_window`` positions) or ``full_attention``. Attention is Qwen3's (per-head q/k
norms, ``o_proj``), each head's output scaled by ``sigmoid(gate_proj(h))`` (``use_attention_gate``).
RoPE is per layer type (``rope_parameters``): ``default`` on sliding layers, ``proportional`` on
full ones (the first ``partial_rotary_factor`` of the pairs rotated at the frequencies of the
whole head, the rest never). With ``use_sandwich_norm`` the mixer's and the feed-forward's
outputs are normed before the residual adds them. The feed-forward is a dense SwiGLU
(``Lfm2MoeMLP`` at ``intermediate_size``, no auto-adjustment).
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
    GatedMLP,
    Rotary,
    TransformerArgs,
    make_rotary,
    rope_type,
)
from mlxr_plugins.archs.lfm2 import (
    CONV,
    Lfm2Architecture,
    LfmBlock,
    ShortConv,
    check_layer_types,
    lfm_model,
)

SLIDING, FULL = "sliding_attention", "full_attention"
#: ``Lfm3Config``'s RoPE per layer type when a config gives none.
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
}
ROPE_TYPES = ("default", "proportional")


@dataclasses.dataclass
class Lfm3Args(TransformerArgs):
    """The keys of ``Lfm3Config`` this graph reads (its defaults)."""

    family = "lfm3"
    aliases = {"rms_norm_eps": ("norm_eps",)}
    limits = {**TransformerArgs.limits, "conv_L_cache": (1, 64)}
    vocab_size: int = 128_000
    hidden_size: int = 2048
    intermediate_size: int = 7680
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    head_dim: int | None = 128
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 128_000
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] | None = None
    conv_bias: bool = False
    conv_L_cache: int = 7
    layer_types: list[str] | None = None
    sliding_window: int | None = 256
    use_sandwich_norm: bool = True
    use_attention_gate: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:  # Lfm3Config's: full every 4th from 2, sliding every 4th from 4
            self.layer_types = [
                FULL if i % 4 == 2 else SLIDING if i % 4 == 0 and i > 0 else CONV
                for i in range(self.num_hidden_layers)
            ]
        check_layer_types(self.layer_types, self.num_hidden_layers, (CONV, SLIDING, FULL), self.family)
        rope = self.rope_parameters or DEFAULT_ROPE
        for kind in {SLIDING, FULL} & set(self.layer_types):
            entry = rope.get(kind)
            if not isinstance(entry, dict) or entry.get("rope_theta") is None:
                raise ModelLoadError(f"no RoPE (rope_theta) for the {kind} layers", key=f"rope_parameters.{kind}")
            if rope_type(entry) not in ROPE_TYPES:
                raise ModelLoadError(
                    f"rope_type {rope_type(entry)!r} is not computed by the lfm3 graph ({', '.join(ROPE_TYPES)})",
                    key=f"rope_parameters.{kind}.rope_type",
                )
        self.rope_parameters = rope

    def rotary(self, kind: str, kernels: KernelSet) -> Rotary:
        """RoPE of ``kind``'s layers over the whole head (``proportional`` leaves pairs unrotated;
        ``default`` rotates all, as ``Lfm3RotaryEmbedding`` does whatever its other keys)."""
        assert self.rope_parameters is not None
        entry = dict(self.rope_parameters[kind])
        if rope_type(entry) == "default":
            entry = {}
        theta = float(self.rope_parameters[kind]["rope_theta"])
        return make_rotary(kernels, self.dims, theta, entry, types=ROPE_TYPES, family=self.family)


class GatedHeadAttention(Attention):
    """:class:`Attention` whose heads' outputs are each scaled by ``sigmoid(gate_proj(x))`` (one
    gate per head, from the layer's normed input) before ``o_proj``. The checkpoint's name:
    transformers' module is ``g_proj``, saved as ``gate_proj``."""

    def __init__(self, hidden: int, n_heads: int, *args: Any, **kwargs: Any):
        super().__init__(hidden, n_heads, *args, **kwargs)
        self.gate_proj = nn.Linear(hidden, n_heads, bias=False)

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: Any) -> mx.array:
        offset = cache.offset if cache is not None else 0
        out = self.attention(*self.attention_inputs(x, offset), mask, cache)  # [B, heads, L, D]
        gate = mx.sigmoid(self.gate_proj(x)).transpose(0, 2, 1)[..., None]  # [B, heads, L, 1]
        return self.output(out * gate.astype(out.dtype))


def lfm3_blocks(args: Lfm3Args, kernels: KernelSet) -> list[LfmBlock]:
    H, eps = args.hidden_size, args.rms_norm_eps
    assert args.layer_types is not None
    rotary = {kind: args.rotary(kind, kernels) for kind in {SLIDING, FULL} & set(args.layer_types)}

    def mixer(kind: str) -> tuple[str, nn.Module]:
        if kind == CONV:
            return CONV, ShortConv(H, args.conv_L_cache, args.conv_bias)
        attention = GatedHeadAttention if args.use_attention_gate else Attention
        window = args.sliding_window if kind == SLIDING else None
        return "self_attn", attention(
            H, args.num_attention_heads, args.kv_heads, args.dims, kernels=kernels, rotary=rotary[kind],
            qkv_bias=args.attention_bias, out_bias=args.attention_bias, head_norm_eps=eps, window=window,
        )  # fmt: skip

    return [
        LfmBlock(*mixer(kind), GatedMLP(H, args.intermediate_size), H, eps, kernels, sandwich=args.use_sandwich_norm)
        for kind in args.layer_types
    ]


class Lfm3Architecture(Lfm2Architecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``lfm3``."""

    args_class = Lfm3Args

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        args = self.args(config)
        return lfm_model(args, lfm3_blocks(args, kernels), kernels)
