"""Per llama.cpp architecture, how a GGUF's metadata becomes a Hugging Face config: one table.

:func:`read_config` reads the keys every family shares (:data:`METADATA_KEYS`, the tensor shapes,
RoPE scaling); :data:`ARCHS` holds a row per llama.cpp architecture (``general.architecture``)
saying what else it needs: the Hugging Face ``model_type`` it is served as, its experts' routing,
constants llama.cpp hard-codes, its own settings function and weight fix-up
(:mod:`~mlxr_plugins.formats.gguf.family_settings`), how its norms and rows are stored. An
architecture without a row is read by the shared keys alone. A new family adds a row, as
transformers keeps its GGUF mapping as a table (``integrations/ggml.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import attrs
import gguf
import numpy as np

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.layers.args import TransformerArgs, check_value, field_types
from mlxr_plugins.formats.gguf.family_settings import (
    GEMMA4_KEYS,
    Config,
    Getter,
    Tensors,
    gemma3_settings,
    gemma4_settings,
    gemma4_weights,
    gpt_oss_settings,
    hybrid_settings,
    hybrid_weights,
    phi3_settings,
    qwen2moe_settings,
    qwen2vl_settings,
    qwen3vl_settings,
)
from mlxr_plugins.formats.gguf.reader import ReadTensors, field_value

#: Config keys read from ``{arch}.*`` metadata -> the key each is stored under (without the
#: ``{arch}.`` prefix), each checked as :class:`TransformerArgs` types it as soon as it is read.
METADATA_KEYS = {
    "num_hidden_layers": "block_count",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
    "sliding_window": "attention.sliding_window",
}
#: Other config keys and where they come from; errors about their values (raised when an
#: architecture reads them) name the metadata key.
OTHER_METADATA_KEYS = {
    "partial_rotary_factor": "rope.dimension_count",
    "rope_scaling": "rope.scaling",
    "rope_scaling.factor": "rope.scaling.factor",
    "rope_scaling.original_max_position_embeddings": "rope.scaling.original_context_length",
    "num_experts": "expert_count",
    "num_local_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
    "original_max_position_embeddings": "rope.scaling.original_context_length",
}


@attrs.frozen
class Experts:
    """A family's mixture of experts, as llama.cpp hard-codes it (the file does not say)."""

    #: The Hugging Face ``model_type`` of a file with experts (a ``llama`` file is a Mixtral).
    model_type: str
    #: Whether the router's top-k weights are renormalized.
    normalize: bool


@attrs.frozen
class ArchSettings:
    """One llama.cpp architecture's row: what its file needs beyond the keys every family shares.
    The config is read as: the shared keys; with ``expert_count``, :attr:`experts`
    (:func:`moe_settings`); :attr:`fixed`; :attr:`settings`; :attr:`model_type`; less :attr:`drops`."""

    #: The Hugging Face ``model_type`` it is served as, where that is not llama.cpp's name.
    model_type: str | None = None
    #: The family's own keys (a function of :mod:`~mlxr_plugins.formats.gguf.family_settings`).
    settings: Callable[[Config, Tensors, Getter], dict[str, Any]] | None = None
    #: Its experts' routing, where a file of it may hold experts.
    experts: Experts | None = None
    #: Config values the file does not carry, as llama.cpp hard-codes them.
    fixed: Mapping[str, Any] = attrs.field(factory=dict)
    #: Shared keys the family reads otherwise (its settings replace them).
    drops: tuple[str, ...] = ()
    #: Config key -> its metadata key under ``{arch}.``, where it is not :data:`METADATA_KEYS`'
    #: (and config key -> tensor, in :attr:`tensor_keys`): errors about a value name the file's key.
    keys: Mapping[str, str] = attrs.field(factory=dict)
    tensor_keys: Mapping[str, str] = attrs.field(factory=dict)
    #: :data:`METADATA_KEYS` that may hold one value per layer (read by its settings, not shared).
    per_layer: tuple[str, ...] = ()
    #: RMS norms that scale by ``1 + w``: llama.cpp's converter stores ``w + 1`` in the file (so
    #: ggml multiplies by it directly); we subtract it back to the Hugging Face form (not from the
    #: hybrids' DeltaNet output norm, which scales by ``w``: see :func:`shifted_norm`).
    norm_plus_one: bool = False
    #: Q/K rows llama.cpp permuted for its adjacent-pair ("NORM") RoPE. We restore the Hugging Face
    #: row order rather than switching the graph to traditional RoPE, so the arch never depends on
    #: which file format its weights came from (the same graph serves safetensors folders).
    permuted_rows: bool = False
    #: Fixes, in place, what llama.cpp's converter did to the family's tensors.
    weights: Callable[[ReadTensors, Config], None] | None = None


def qwen_hybrid(model_type: str, *, tiled_values: bool, dense: bool, experts: bool) -> ArchSettings:
    """A row of the Qwen hybrids (Gated DeltaNet and gated attention)."""
    return ArchSettings(
        model_type,
        partial(hybrid_settings, tiled_values=tiled_values, dense=dense),
        experts=Experts(model_type, normalize=True) if experts else None,
        norm_plus_one=True,
        weights=hybrid_weights,
    )


#: llama.cpp architecture -> its row. Architectures read by the shared keys alone (``qwen2``,
#: ``qwen3``, ``mistral`` ...) have none.
ARCHS = {
    "llama": ArchSettings(experts=Experts("mixtral", normalize=True), permuted_rows=True),
    # Every 6th layer global, local rope base 1e4.
    "gemma3": ArchSettings(
        settings=gemma3_settings,
        fixed={"sliding_window_pattern": 6, "rope_local_base_freq": 10000.0},
        norm_plus_one=True,
    ),
    "gemma4": ArchSettings(
        settings=gemma4_settings,
        drops=("rope_freq_factors",),  # read into rope_parameters
        keys=GEMMA4_KEYS,
        tensor_keys={"vocab_size_per_layer_input": "per_layer_token_embd.weight"},
        per_layer=("num_key_value_heads", "intermediate_size"),
        weights=gemma4_weights,
    ),
    "phi3": ArchSettings(settings=phi3_settings),
    "qwen2moe": ArchSettings(settings=qwen2moe_settings, experts=Experts("qwen2_moe", normalize=False)),
    "qwen3moe": ArchSettings(experts=Experts("qwen3_moe", normalize=True)),
    "gpt-oss": ArchSettings("gpt_oss", gpt_oss_settings),
    "qwen2vl": ArchSettings("qwen2_5_vl", qwen2vl_settings),
    "qwen3vl": ArchSettings("qwen3_vl", qwen3vl_settings),
    "qwen3next": qwen_hybrid("qwen3_next", tiled_values=False, dense=False, experts=True),
    "qwen35": qwen_hybrid("qwen3_5", tiled_values=True, dense=True, experts=False),
    "qwen35moe": qwen_hybrid("qwen3_5_moe", tiled_values=True, dense=False, experts=True),
}
#: The row of an architecture the table does not name.
SHARED_ONLY = ArchSettings()


def settings_of(arch: str) -> ArchSettings:
    """The row of llama.cpp architecture ``arch``."""
    return ARCHS.get(arch, SHARED_ONLY)


def shifted_norm(name: str, arch: str) -> bool:
    """Whether tensor ``name`` of an ``arch`` file holds a norm's ``1 + w``."""
    return settings_of(arch).norm_plus_one and name.endswith("norm.weight") and ".ssm_norm." not in name


def config_keys(arch: str) -> dict[str, str]:
    """Config key -> the GGUF metadata key (or tensor) it comes from, for error messages."""
    family = settings_of(arch)
    keys = {name: f"{arch}.{key}" for name, key in {**METADATA_KEYS, **OTHER_METADATA_KEYS}.items()}
    keys["vocab_size"] = "token_embd.weight"
    keys["rope_freq_factors"] = "rope_freqs.weight"
    keys.update({name: f"{arch}.{key}" for name, key in family.keys.items()})
    keys.update(family.tensor_keys)
    return keys


def moe_settings(experts: Experts, config: Config, tensors: Tensors, get: Getter) -> dict[str, Any]:
    """A mixture of experts' keys: expert counts and widths, the family's routing rule, and the
    Hugging Face ``model_type`` of a file with experts."""
    count = get("expert_count")
    settings: dict[str, Any] = {
        "model_type": experts.model_type,
        "num_experts": count,
        "num_local_experts": count,
        "num_experts_per_tok": get("expert_used_count"),
        "norm_topk_prob": experts.normalize,
    }
    width = get("expert_feed_forward_length")
    if width:
        settings["moe_intermediate_size"] = width
    shared = get("expert_shared_feed_forward_length")
    if shared:
        settings["shared_expert_intermediate_size"] = shared
    # Layers without a router are dense (Qwen's ``mlp_only_layers``). A valid file holds at least
    # one tensor per layer; a larger count is refused later, naming the key.
    layer_count = config.get("num_hidden_layers") or 0
    layers = range(layer_count if layer_count <= len(tensors) else 0)
    dense = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if dense:
        settings["mlp_only_layers"] = dense
    return settings


def read_config(reader: gguf.GGUFReader, tensors: dict[str, Any]) -> dict[str, Any]:
    """The model config in Hugging Face naming, from ``{arch}.*`` metadata and tensor shapes.

    Every value it computes with is checked first (type and range, as the architectures' config
    classes check them): a ModelLoadError names the metadata key and value."""
    arch = field_value(reader, "general.architecture")
    if not arch:
        raise ModelLoadError("general.architecture is missing", key="general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{arch!r} is not a string", key="general.architecture")

    def get(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{key}", default)

    types, limits = field_types(TransformerArgs), TransformerArgs.limits
    family = settings_of(arch)
    # Per-layer arrays (Gemma 4's key/value heads and MLP widths) are read by the family's settings.
    per_layer = family.per_layer
    values = {
        name: check_value(f"{arch}.{key}", get(key), types[name], limits.get(name))
        for name, key in METADATA_KEYS.items()
        if get(key) is not None and not (name in per_layer and isinstance(get(key), list))
    }
    heads = values.get("num_attention_heads")
    config: dict[str, Any] = {
        "model_type": arch,
        **values,
        "num_key_value_heads": values.get("num_key_value_heads", heads),
        "rms_norm_eps": values.get("rms_norm_eps", 1e-6),
        "rope_theta": values.get("rope_theta", 10000.0),
        "max_position_embeddings": values.get("max_position_embeddings", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    }
    if not config.get("sliding_window"):
        config.pop("sliding_window", None)
    kv_heads = config["num_key_value_heads"]
    if heads and kv_heads and heads % kv_heads:  # llama's rows are unpermuted per head below
        raise ModelLoadError(
            f"{kv_heads} key/value heads do not divide the {heads} attention heads",
            key=f"{arch}.{METADATA_KEYS['num_key_value_heads']}",
        )
    embedding = tensors.get("token_embd.weight")
    if embedding is not None:
        config["vocab_size"] = int(embedding.shape[-1])  # ggml shape: [hidden, vocab]
    elif get("vocab_size") is not None:
        config["vocab_size"] = get("vocab_size")
    head_dim = values.get("head_dim")
    if head_dim is None and heads and config.get("hidden_size"):
        head_dim = config["hidden_size"] // heads
    if head_dim:
        config["head_dim"] = head_dim
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and head_dim and rope_dims != head_dim:
        if type(rope_dims) is not int or not 2 <= rope_dims <= head_dim or rope_dims % 2:
            raise ModelLoadError(
                f"{rope_dims!r} rotary dimensions: expected an even number in [2, {head_dim}] "
                "(the head size)",
                key=f"{arch}.rope.dimension_count",
            )
        config["partial_rotary_factor"] = rope_dims / head_dim

    kind = get("rope.scaling.type")
    if kind and kind != "none":
        scaling: dict[str, Any] = {"rope_type": kind, "factor": get("rope.scaling.factor", 1.0)}
        original = get("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = original
        config["rope_scaling"] = scaling
    elif get("rope.scale_linear"):  # older files
        config["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scale_linear")}
    factors = tensors.get("rope_freqs.weight")
    if factors is not None:
        stored = np.asarray(factors.data, dtype=np.float32)
        if not (np.isfinite(stored) & (stored > 0)).all():
            raise ModelLoadError(
                "rope frequency factors must be finite and positive", tensor="rope_freqs.weight"
            )
        config["rope_freq_factors"] = [float(f) for f in stored]
    if get("expert_count") and family.experts is not None:
        config.update(moe_settings(family.experts, config, tensors, get))
    config.update(family.fixed)
    if family.settings is not None:
        config.update(family.settings(config, tensors, get))
    if family.model_type is not None:
        config["model_type"] = family.model_type
    for key in family.drops:
        config.pop(key, None)
    return {key: value for key, value in config.items() if value is not None}
