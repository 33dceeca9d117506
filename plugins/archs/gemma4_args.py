"""Gemma 4's text config: ``Gemma4TextConfig``'s keys and defaults, and what follows from them per
layer (its type, head shape, the layer whose keys and values it shares, its RoPE). The graph is
:mod:`mlxr_plugins.archs.gemma4`."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers import Rotary, TransformerArgs, make_rotary

SLIDING, FULL = "sliding_attention", "full_attention"
#: Hugging Face's defaults: five sliding layers, then a global one; RoPE per layer type.
GLOBAL_EVERY = 6
GEGLU = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


class LayerRules(Protocol):
    """What Gemma 4's attention and per-layer inputs read of a config: :class:`Gemma4Args`, and
    Gemma 3n's, which shares both (:mod:`mlxr_plugins.archs.gemma3n`)."""

    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    sliding_window: int | None
    attention_bias: bool
    vocab_size_per_layer_input: int
    hidden_size_per_layer_input: int

    @property
    def attention_k_eq_v(self) -> bool: ...

    def kind(self, layer: int) -> str: ...

    def layer_shape(self, layer: int) -> tuple[int, int]: ...

    def kv_source(self, layer: int) -> int | None: ...


class SharedKVLayers:
    """The rule of the Gemma families whose last ``num_kv_shared_layers`` layers attend over an
    earlier layer's keys and values (Gemma 3n, Gemma 4): each over the last layer of its type
    (``layer_types``) before the shared ones."""

    family = "gemma"
    layer_types: list[str] | None
    num_hidden_layers: int
    num_kv_shared_layers: int

    def kind(self, layer: int) -> str:
        assert self.layer_types is not None
        return self.layer_types[layer]

    @property
    def first_shared(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values ``layer`` attends over (None: its own): the last layer
        of its type before the shared ones."""
        if layer < self.first_shared:
            return None
        sources = [i for i in range(self.first_shared) if self.kind(i) == self.kind(layer)]
        if not sources:
            kind = self.kind(layer)
            raise ModelLoadError(
                f"{self.family} layer {layer} shares keys and values, no earlier {kind} layer",
                key="num_kv_shared_layers",
            )
        return sources[-1]


@dataclasses.dataclass
class Gemma4Args(SharedKVLayers, TransformerArgs):
    """``Gemma4TextConfig``'s keys and defaults. Global layers' head size and key/value heads come
    from ``global_head_dim`` / ``num_global_key_value_heads`` (hub configs) or ``per_layer_config``
    (saved by transformers 5, keyed by layer index strings)."""

    family = "gemma4"
    computes = {**TransformerArgs.computes, "hidden_act": GEGLU}
    head_dim: int | None = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    per_layer_config: dict[Any, dict[str, Any]] | None = None
    max_position_embeddings: int = 131_072
    sliding_window: int | None = 512
    layer_types: list[str] | None = None
    rope_parameters: dict[str, Any] | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    use_bidirectional_attention: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        L = self.num_hidden_layers
        types = self.layer_types or [SLIDING if (i + 1) % GLOBAL_EVERY else FULL for i in range(L)]
        if len(types) != L or set(types) - {SLIDING, FULL}:
            raise ModelLoadError(f"gemma4 layer_types must list {L} of {SLIDING}, {FULL}: {types}")
        self.layer_types = [*types[:-1], FULL]  # transformers forces the last layer global
        experts = (self.num_experts, self.top_k_experts, self.moe_intermediate_size)
        for wrong, why in (
            (self.hidden_activation not in GEGLU, f"hidden_activation {self.hidden_activation!r} is not GeGLU"),
            (self.use_bidirectional_attention == "all", "bidirectional attention is not a causal LM's"),
            (self.enable_moe_block and not all(experts), f"enable_moe_block with {experts} experts"),
        ):  # fmt: skip
            if wrong:
                raise ModelLoadError(f"gemma4 config: {why}")
        if self.per_layer_config is None:  # hub form: every global layer gets the global shape
            shape: dict[str, Any] = {"head_dim": self.global_head_dim}
            if self.attention_k_eq_v and self.num_global_key_value_heads:
                shape["num_key_value_heads"] = self.num_global_key_value_heads
            self.per_layer_config = {i: shape for i, kind in enumerate(self.layer_types) if kind == FULL}
        self.per_layer_config = {int(key): value for key, value in self.per_layer_config.items()}
        self.rope_parameters = self.rope_parameters or DEFAULT_ROPE
        for index in range(L):
            self.kv_source(index)  # refuses a shared layer without a producer of its type

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """``(head_dim, num_key_value_heads)`` of ``layer``: its override, else the global values."""
        own = (self.per_layer_config or {}).get(layer, {})
        return int(own.get("head_dim", self.dims)), int(own.get("num_key_value_heads", self.kv_heads))

    def rotary(self, layer: int, kernels: KernelSet) -> Rotary:
        """RoPE of ``layer``'s type (``proportional`` on global layers: see :mod:`~mlxr_core.model.layers.rope`)."""
        assert self.rope_parameters is not None
        kind, dims = self.kind(layer), self.layer_shape(layer)[0]
        params = dict(self.rope_parameters.get(kind) or DEFAULT_ROPE[kind])
        theta = float(params.get("rope_theta", DEFAULT_ROPE[kind]["rope_theta"]))
        return make_rotary(kernels, dims, theta, params, types=("default", "proportional"), family="gemma4")
