"""A checkpoint's config in the form an mlx-lm ``ModelArgs`` reads, or a refusal naming the key.

mlx-lm's ``ModelArgs.from_dict`` keeps the keys its dataclass declares and drops the rest without
a word, and most of its model files were written against configs as transformers 4 wrote them.
Before handing a config over, :func:`mlx_lm_config`:

- places transformers 5's spellings under the keys that ``ModelArgs`` declares, as mlxr's own
  config classes get them (:func:`~mlxr_core.model.layers.config_eras.current_config`:
  ``rope_parameters``, per-layer-type RoPE, expert counts, ``{"__float__": "Infinity"}``), and the
  other way round for a ``ModelArgs`` that reads ``rope_parameters`` (Ministral 3, LFM2);
- fills the few keys a family's ``ModelArgs`` names differently from transformers 5 or computes
  from others (:data:`FILLED`), a ``head_dim`` it requires from ``hidden_size / num_attention_heads``,
  as transformers' attention does where the config class has none (GLM-4.5's), the dense layers
  first (``first_k_dense_replace``) from ``mlp_layer_types`` where that is all transformers 5
  writes, or as a flag a layer (:data:`MLP_FLAGS`), and the ``rope_scaling`` of plain RoPE for a family whose model always reads one
  (:data:`PLAIN_SCALING`);
- refuses a family whose mlx-lm model computes otherwise than transformers'
  (:data:`UNLIKE_TRANSFORMERS`), and a config whose math ``ModelArgs`` would drop: a per-layer pattern (``layer_types``,
  ``mlp_layer_types``) it does not read and its own keys do not reproduce, RoPE scaling or a
  partial rotation it has no key for; and names the keys ``ModelArgs`` requires that the config
  does not give, instead of its ``TypeError``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.layers.config_eras import FULL, PLAIN, current_config, rope_type

Fill = Callable[[dict[str, Any]], Any]
#: mlx-lm model module -> {``ModelArgs`` key: its value from what transformers 5 writes}, where
#: transformers' model computes it so (a constant: transformers' model has no switch for it).
FILLED: dict[str, dict[str, Fill]] = {
    "lfm2": {"block_dim": lambda c: c.get("hidden_size")},
    "exaone": {"num_layers": lambda c: c.get("num_hidden_layers"), "layer_norm_epsilon": lambda c: c.get("rms_norm_eps")},
    "gpt_neox": {"rotary_pct": lambda c: c.get("partial_rotary_factor", 1.0), "rotary_emb_base": lambda c: c.get("rope_theta")},
    "apertus": {"mlp_bias": lambda c: False, "post_norm": lambda c: False, "qk_norm": lambda c: True},
    "minimax": {"shared_intermediate_size": lambda c: 0,
                "rotary_dim": lambda c: _product(c, "head_dim", "partial_rotary_factor", default=1.0)},
}
#: mlx-lm model module -> its ``ModelArgs`` key holding a flag a layer (1: sparse) for what
#: transformers 5 writes as ``mlp_layer_types``.
MLP_FLAGS: dict[str, str] = {"exaone_moe": "is_moe_layer", "mimo_v2_flash": "moe_layer_freq"}
#: mlx-lm model module -> the ``rope_scaling`` under which its RoPE class, built whatever the
#: config says, rotates as plain RoPE does (YaRN of factor 1; LongRoPE's factors of 1 with no
#: extension past the pre-training length), for a config with none.
PLAIN_SCALING: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "deepseek_v2": lambda config: {"type": "yarn", "factor": 1.0},
    "minicpm3": lambda config: {"original_max_position_embeddings": config.get("max_position_embeddings", 4096)},
}
#: ``ModelArgs`` keys that say how layers differ, in families that do not read ``layer_types``.
LAYER_KEYS = ("layer_types", "layers_block_type", "hybrid_override_pattern", "block_types",
              "sliding_window_pattern", "full_attn_idxs", "hybrid_layer_pattern")
#: mlx-lm model modules whose transformers twin slides ``sliding_window`` over every layer where
#: the config names no ``layer_types`` (Mistral's rule), while mlx-lm's reads the window only for
#: ``sliding_attention`` layers.
WINDOW_EVERY_LAYER = ("ministral3",)
#: mlx-lm model module -> where its model computes otherwise than transformers' twin: (``key`` or
#: ``tensor``, the config key or weight concerned, how it differs).
UNLIKE_TRANSFORMERS: dict[str, tuple[str, str, str]] = {
    "ernie4_5_moe": ("tensor", "mlp.gate.moe_statics.e_score_correction_bias",
                     "drops the correction bias transformers adds to the scores experts are chosen on"),
    "jamba": ("key", "num_experts_per_tok",
              "weighs the chosen experts by a softmax over them alone; transformers by the softmax over all experts"),
}
#: ``ModelArgs`` keys that rotate only part of each head.
PARTIAL_KEYS = ("partial_rotary_factor", "rotary_dim", "rope_dim", "qk_rope_head_dim", "rope_parameters", "rotary_pct")


def mlx_lm_config(config: dict[str, Any], args_class: type, module: str) -> dict[str, Any]:
    """``config`` as ``args_class`` (mlx-lm's ``ModelArgs`` of ``mlx_lm.models.<module>``) reads
    it; ModelLoadError naming the key for what it cannot carry (module docstring)."""
    parameters = inspect.signature(args_class).parameters
    declared = set(parameters)
    config = current_config(config, declared)
    for key in ("rope_scaling", "rope_parameters"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise ModelLoadError(f"{config[key]!r:.80} is not an object", key=key)
    head_dim = parameters.get("head_dim")
    if head_dim is not None and head_dim.default is inspect.Parameter.empty and config.get("head_dim") is None:
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            config["head_dim"] = hidden // heads  # transformers' attention where its config has none
    for key, fill in FILLED.get(module, {}).items():
        if key in declared and config.get(key) is None and (value := fill(config)) is not None:
            config[key] = value
    if "rope_parameters" in declared and not isinstance(config.get("rope_parameters"), dict):
        rope = dict(config.get("rope_scaling") or {"rope_type": "default"})
        for key in ("rope_theta", "partial_rotary_factor"):
            if config.get(key) is not None:
                rope[key] = config[key]
        if "rope_theta" in rope:
            config["rope_parameters"] = rope
    if "rope_scaling" in declared:
        config.setdefault("rope_scaling", None)  # plain RoPE: ModelArgs' own default may be another
        if config["rope_scaling"] is None and module in PLAIN_SCALING:
            config["rope_scaling"] = PLAIN_SCALING[module](config)
    mlp = config.get("mlp_layer_types")
    flags = MLP_FLAGS.get(module)
    if flags in declared and config.get(flags) is None and isinstance(mlp, list):
        config[flags] = [int(kind == "sparse") for kind in mlp]
    if "first_k_dense_replace" in declared and config.get("first_k_dense_replace") is None and isinstance(mlp, list):
        first = mlp.index("sparse") if "sparse" in mlp else len(mlp)
        if mlp == ["dense"] * first + ["sparse"] * (len(mlp) - first):
            config["first_k_dense_replace"] = first  # transformers 5 writes only the list (GLM-4.7-Flash)
    _check_dropped(config, declared, module)
    missing = [
        name for name, parameter in parameters.items()
        if parameter.default is inspect.Parameter.empty and name not in config
    ]
    if missing:
        raise ModelLoadError(
            f"mlx-lm's {module} model needs {', '.join(missing)}, which the config does not give "
            "(nor a transformers 5 spelling of it that mlxr knows)", key=missing[0],
        )
    return config


def _check_dropped(config: dict[str, Any], declared: set[str], module: str) -> None:
    """Refuse keys that change the math which ``ModelArgs`` does not declare (it drops them)."""
    layers = config.get("layer_types")
    if isinstance(layers, list) and not declared & set(LAYER_KEYS) and any(kind != FULL for kind in layers):
        raise ModelLoadError(
            f"mlx-lm's {module} model reads no per-layer pattern, and the layers differ "
            f"({', '.join(sorted(set(map(str, layers))))})", key="layer_types",
        )
    mlp = config.get("mlp_layer_types")
    flags = config.get(MLP_FLAGS.get(module, "mlp_layer_types"))
    if isinstance(flags, list) and isinstance(mlp, list) and [int(kind == "sparse") for kind in mlp] == flags:
        mlp = None  # the same layers, as flags ModelArgs reads
    if isinstance(mlp, list) and "mlp_layer_types" not in declared and any(kind != mlp[0] for kind in mlp):
        first = config.get("first_k_dense_replace")
        every = config.get("moe_layer_freq", 1)
        if not ("first_k_dense_replace" in declared and isinstance(first, int) and isinstance(every, int)
                and mlp == ["sparse" if i >= first and i % every == 0 else "dense" for i in range(len(mlp))]):
            raise ModelLoadError(
                f"mlx-lm's {module} model does not read mlp_layer_types, and its other keys do not "
                "give the same dense and sparse layers", key="mlp_layer_types",
            )
    if module in UNLIKE_TRANSFORMERS:
        kind, name, how = UNLIKE_TRANSFORMERS[module]
        raise ModelLoadError(f"mlx-lm's {module} model {how} ({name})", **{kind: name})
    window = config.get("sliding_window")
    if module in WINDOW_EVERY_LAYER and window is not None and not isinstance(config.get("layer_types"), list):
        raise ModelLoadError(
            f"transformers' {module} attends through a window of {window} in every layer; mlx-lm's "
            "only in layers layer_types names sliding_attention, and the config names none", key="sliding_window",
        )
    scaling = config.get("rope_scaling")
    if rope_type(scaling) not in PLAIN and not declared & {"rope_scaling", "rope_parameters"}:
        where = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
        raise ModelLoadError(f"mlx-lm's {module} model reads no RoPE scaling ({rope_type(scaling)})", key=where)
    partial = config.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0) and not declared & set(PARTIAL_KEYS):
        raise ModelLoadError(
            f"mlx-lm's {module} model rotates whole heads; the config rotates {partial} of each",
            key="partial_rotary_factor",
        )


def _product(config: dict[str, Any], *keys: str, default: float | None = None) -> int | None:
    """The product of ``keys``' values (``default`` for a missing one; None without one) as an int."""
    product = 1.0
    for key in keys:
        value = config.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        product *= value
    return int(product)
