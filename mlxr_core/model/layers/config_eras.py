"""Configs from both eras: what transformers 5 writes, read under the keys a config class declares.

Released checkpoints carry ``config.json`` as transformers 4 wrote it; transformers 5 writes the
same model's differently:

=====================================  ==========================================================
transformers 4                          transformers 5
=====================================  ==========================================================
``rope_theta``, ``rope_scaling``,       ``rope_parameters``: one dict (``rope_type``,
``partial_rotary_factor``               ``rope_theta``, ``partial_rotary_factor``, the scaling's keys)
``rope_local_base_freq`` (Gemma 3)      ``rope_parameters`` per layer type
                                        (``{"full_attention": {...}, "sliding_attention": {...}}``)
``num_experts`` (Qwen3-MoE)             ``num_local_experts`` (DeepSeek's families: ``n_routed_experts``)
``Infinity``, ``NaN`` (not JSON)        ``{"__float__": "Infinity"}`` (Nemotron-H's ``time_step_limit``)
=====================================  ==========================================================

:func:`current_config` places the second spelling under the first's keys, for the keys a config
class declares (a class that declares ``rope_parameters`` reads it as it is), so each family reads
one spelling; where both are present and disagree, or where a RoPE it cannot place would apply to
some layer, it refuses naming the key rather than pick one. :func:`file_spellings` says where the
file holds a placed value, so that an error about it names what the user can find.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from typing import Any

from mlxr_core.errors import ModelLoadError

log = logging.getLogger(__name__)

FULL, SLIDING = "full_attention", "sliding_attention"
#: The top-level keys ``rope_parameters`` folds in; the rest of it is the scaling.
ROPE_TOP = ("rope_theta", "partial_rotary_factor")
#: Names of the sliding-window layers' RoPE base (Gemma 3's, and mlx-lm's MiMo).
LOCAL_THETA = ("rope_local_base_freq", "swa_rope_theta")
#: Names one count goes by across transformers' families and releases.
SYNONYMS = (("num_experts", "num_local_experts", "n_routed_experts"),)
#: RoPE types that rotate as plain RoPE (``mrope`` only says how positions are laid out).
PLAIN = ("default", "mrope")
#: How transformers 5 writes the floats JSON has no numbers for.
FLOAT_TAG = "__float__"
SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def decode_floats(value: Any) -> Any:
    """``value`` with transformers 5's tagged floats (``{"__float__": "Infinity"}``) as floats."""
    if isinstance(value, dict):
        tag = value.get(FLOAT_TAG)
        if len(value) == 1 and isinstance(tag, str) and tag in SPECIAL_FLOATS:
            return SPECIAL_FLOATS[tag]
        return {key: decode_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [decode_floats(item) for item in value]
    return value


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The ``rope_type`` of a ``rope_scaling`` / ``rope_parameters`` dict (``default`` when none)."""
    scaling = scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")) or "default")


def per_layer_type(rope: dict[str, Any]) -> bool:
    """Whether ``rope_parameters`` is keyed by layer type rather than one setting for all."""
    return "rope_type" not in rope and "rope_theta" not in rope and any(isinstance(v, dict) for v in rope.values())


def current_config(config: dict[str, Any], declared: Collection[str]) -> dict[str, Any]:
    """``config`` with transformers 5's spellings also under the keys in ``declared`` that the
    file does not have (see the module docstring). Raises ModelLoadError naming the key where the
    two spellings disagree or a per-layer-type RoPE has no place in a graph that uses it."""
    config = decode_floats(config)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_parameters" not in declared:
        _place_rope(config, rope, declared)
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and "rope_parameters" not in declared:
        # transformers 5 reads rope_scaling as rope_parameters, the rotation's shape included.
        for key in ROPE_TOP:
            if scaling.get(key) is not None:
                _fill(config, key, scaling[key], f"rope_scaling.{key}")
    for names in SYNONYMS:
        given = {name: config[name] for name in names if config.get(name) is not None}
        if not given or not set(names) & set(declared):
            continue
        if len(set(map(repr, given.values()))) > 1:
            shown = " and ".join(f"{name} = {value!r}" for name, value in given.items())
            raise ModelLoadError(f"{shown} disagree; they name one count, give it once", key=next(iter(given)))
        value = next(iter(given.values()))
        for name in names:
            if name in declared:
                config.setdefault(name, value)
    return config


def _place_rope(config: dict[str, Any], rope: dict[str, Any], declared: Collection[str]) -> None:
    if not per_layer_type(rope):
        _place_entry(config, rope, "rope_parameters")
        return
    unknown = sorted(set(rope) - {FULL, SLIDING})
    if unknown:
        raise ModelLoadError(
            f"rope_parameters gives RoPE for {', '.join(unknown)} layers; these graphs know "
            f"{FULL} and {SLIDING} layers", key=f"rope_parameters.{unknown[0]}",
        )
    full, sliding = rope.get(FULL), rope.get(SLIDING)
    if isinstance(full, dict):
        _place_entry(config, full, f"rope_parameters.{FULL}")
        if isinstance(sliding, dict):
            _place_local(config, sliding, declared, full)
    elif isinstance(sliding, dict):
        _place_entry(config, sliding, f"rope_parameters.{SLIDING}")


def _place_entry(config: dict[str, Any], entry: dict[str, Any], where: str) -> None:
    """One RoPE setting as ``rope_theta``, ``partial_rotary_factor`` and ``rope_scaling``."""
    for key in ROPE_TOP:
        if entry.get(key) is not None:
            _fill(config, key, entry[key], f"{where}.{key}")
    scaling = {key: value for key, value in entry.items() if key not in ROPE_TOP}
    present = config.get("rope_scaling")
    if not isinstance(present, (dict, type(None))):
        return  # not an object: the config class's check names it
    if present is None:
        if rope_type(scaling) not in PLAIN:
            config["rope_scaling"] = scaling
        return
    kinds = {rope_type(present), rope_type(scaling)}
    differing = [key for key in scaling.keys() & present.keys() if key not in ("rope_type", "type") and scaling[key] != present[key]]
    if (len(kinds) > 1 and not kinds <= set(PLAIN)) or differing:
        what = f"{differing[0]} " if differing else ""
        raise ModelLoadError(
            f"rope_scaling and {where} give different RoPE {what}({present!r:.80} vs {scaling!r:.80}); "
            "transformers 5 reads one of them, give it once", key="rope_scaling",
        )


def _place_local(config: dict[str, Any], sliding: dict[str, Any], declared: Collection[str], full: dict[str, Any]) -> None:
    """The sliding-window layers' RoPE: its base under the name the class declares, if any. A
    scaled one, or a different one in a graph that rotates every layer alike, is refused when the
    config has sliding layers."""
    where = f"rope_parameters.{SLIDING}"
    name = next((name for name in LOCAL_THETA if name in declared), None)
    layers = config.get("layer_types")
    slides = not isinstance(layers, list) or SLIDING in layers  # no list: any layer may slide
    if rope_type(sliding) not in PLAIN and slides:
        raise ModelLoadError(f"{where} scales RoPE ({rope_type(sliding)}); the sliding layers rotate unscaled here", key=where)
    if name is not None:
        if sliding.get("rope_theta") is not None:
            _fill(config, name, sliding["rope_theta"], f"{where}.rope_theta")
        return
    differs = any(sliding.get(key) != full.get(key) for key in ROPE_TOP) or rope_type(sliding) != rope_type(full)
    if differs and slides:
        raise ModelLoadError(
            f"{where} differs from {FULL}'s, and this graph rotates every layer alike", key=where
        )


def _fill(config: dict[str, Any], key: str, value: Any, where: str) -> None:
    """``config[key]`` from ``rope_parameters``, which wins where both give one: transformers 5
    reads ``rope_parameters`` and ignores a top-level ``rope_theta`` (or local base) beside it,
    and its ``save_pretrained`` writes such stale keys for some families (cohere2_moe)."""
    present = config.get(key)
    if present is not None and present != value:
        log.warning("%s = %r is ignored: %s = %r, as transformers 5 reads it", key, present, where, value)
    config[key] = value


def file_spellings(stored: dict[str, Any]) -> dict[str, str]:
    """Key a config class reads -> where ``stored`` (a config file's contents) holds it, for the
    keys :func:`current_config` places (errors about them name the file's key)."""
    spelled: dict[str, str] = {}
    rope = stored.get("rope_parameters")
    if isinstance(rope, dict):
        main = "rope_parameters"
        if per_layer_type(rope):
            main = f"rope_parameters.{FULL if isinstance(rope.get(FULL), dict) else SLIDING}"
            for name in LOCAL_THETA:
                spelled[name] = f"rope_parameters.{SLIDING}.rope_theta"
        for key in ROPE_TOP:
            spelled[key] = f"{main}.{key}"
        spelled["rope_scaling"] = main
    for names in SYNONYMS:
        found = next((name for name in names if stored.get(name) is not None), None)
        if found is not None:
            spelled.update({name: found for name in names if name != found})
    return {key: at for key, at in spelled.items() if key not in stored}
