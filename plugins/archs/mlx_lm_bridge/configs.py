"""A checkpoint's config in the form an mlx-lm ``ModelArgs`` reads, or a refusal naming the key.

mlx-lm's ``ModelArgs.from_dict`` keeps the keys its dataclass declares and drops the rest without
a word, and most of its model files were written against configs as transformers 4 wrote them.
Before handing a config over, :func:`mlx_lm_config`:

- places transformers 5's spellings under the keys that ``ModelArgs`` declares, as mlxr's own
  config classes get them (:func:`~mlxr_core.model.layers.config_eras.current_config`:
  ``rope_parameters``, per-layer-type RoPE, expert counts, ``{"__float__": "Infinity"}``), and the
  other way round for a ``ModelArgs`` that reads ``rope_parameters`` (Ministral 3, LFM2);
- fills the few keys a family's ``ModelArgs`` names differently from transformers 5
  (:data:`RENAMED`), and a ``head_dim`` it requires from ``hidden_size / num_attention_heads``, as
  transformers' attention does where the config class has none (GLM-4.5's);
- refuses a config whose math ``ModelArgs`` would drop: a per-layer pattern (``layer_types``,
  ``mlp_layer_types``) it does not read and its own keys do not reproduce, RoPE scaling or a
  partial rotation it has no key for; and names the keys ``ModelArgs`` requires that the config
  does not give, instead of its ``TypeError``.
"""

from __future__ import annotations

import inspect
from typing import Any

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.layers.config_eras import FULL, PLAIN, current_config, rope_type

#: mlx-lm model module -> {``ModelArgs`` key: the config key transformers 5 writes for it}.
RENAMED: dict[str, dict[str, str]] = {
    "lfm2": {"block_dim": "hidden_size"},
}
#: ``ModelArgs`` keys that say how layers differ, in families that do not read ``layer_types``.
LAYER_KEYS = ("layer_types", "layers_block_type", "hybrid_override_pattern", "block_types",
              "sliding_window_pattern", "full_attn_idxs", "hybrid_layer_pattern")
#: ``ModelArgs`` keys that rotate only part of each head.
PARTIAL_KEYS = ("partial_rotary_factor", "rotary_dim", "rope_dim", "qk_rope_head_dim", "rope_parameters")


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
    for key, source in RENAMED.get(module, {}).items():
        if key in declared and config.get(key) is None and config.get(source) is not None:
            config[key] = config[source]
    if "rope_parameters" in declared and not isinstance(config.get("rope_parameters"), dict):
        rope = dict(config.get("rope_scaling") or {"rope_type": "default"})
        for key in ("rope_theta", "partial_rotary_factor"):
            if config.get(key) is not None:
                rope[key] = config[key]
        if "rope_theta" in rope:
            config["rope_parameters"] = rope
    if "rope_scaling" in declared:
        config.setdefault("rope_scaling", None)  # plain RoPE: ModelArgs' own default may be another
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
    if isinstance(mlp, list) and "mlp_layer_types" not in declared and any(kind != mlp[0] for kind in mlp):
        first = config.get("first_k_dense_replace")
        every = config.get("moe_layer_freq", 1)
        if not ("first_k_dense_replace" in declared and isinstance(first, int) and isinstance(every, int)
                and mlp == ["sparse" if i >= first and i % every == 0 else "dense" for i in range(len(mlp))]):
            raise ModelLoadError(
                f"mlx-lm's {module} model does not read mlp_layer_types, and its other keys do not "
                "give the same dense and sparse layers", key="mlp_layer_types",
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
