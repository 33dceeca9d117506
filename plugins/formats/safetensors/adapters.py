"""LoRA adapter folders: PEFT's (``adapter_config.json`` + ``adapter_model.safetensors``) and
mlx-lm's (``adapter_config.json`` + ``adapters.safetensors``), read into an
:class:`~mlxr_core.model.lora.AdapterCheckpoint`.

PEFT stores ``...q_proj.lora_A.weight [r, in]`` and ``lora_B.weight [out, r]`` under
``base_model.model.``, scaled by ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``; per module
``rank_pattern`` and ``alpha_pattern``). mlx-lm stores ``lora_a [in, r]`` and ``lora_b [r, out]``
under its module names and scales by ``lora_parameters.scale`` as it is. What would change the
math and is not a plain LoRA update (DoRA, biases, modules saved whole, transposed Conv1D weights)
is refused naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.lora import AdapterCheckpoint, LowRank, lora_scale, paired_tensors
from mlxr_plugins.formats.safetensors.files import read_json

#: The stored types of LoRA matrices read.
FLOAT_DTYPES = ("F16", "BF16", "F32")

CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
MLX_LM_WEIGHTS = "adapters.safetensors"
PEFT_PREFIX = "base_model.model."

#: PEFT settings that change the math when set to anything but these values.
PEFT_REFUSED = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "modules_to_save": (None, []),
    "layer_replication": (None, []),
    "trainable_token_indices": (None, [], {}),
    "target_parameters": (None, []),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None, []),
}


def detect(path: Path) -> bool:
    return (
        path.is_dir()
        and (path / CONFIG).is_file()
        and ((path / PEFT_WEIGHTS).is_file() or (path / MLX_LM_WEIGHTS).is_file())
    )


def load(path: Path) -> AdapterCheckpoint:
    config = read_json(path / CONFIG)
    if (path / PEFT_WEIGHTS).is_file():
        return load_peft(path, config)
    return load_mlx_lm(path, config)


def _load_tensors(file: Path) -> dict[str, np.ndarray]:
    """The file's tensors as host arrays (numpy: adapters are read off the engine thread),
    float16 and float32 as stored, bfloat16 widened to float32 (exactly); the header checked
    first, a tensor of another dtype or with non-finite values refused by name."""
    from mlxr_plugins.formats.safetensors.checkpoint import (  # it imports this module
        check_header,
        decode_stored,
    )

    header, start = check_header(file)
    try:
        data = np.fromfile(file, dtype=np.uint8)
    except OSError as exc:
        raise ModelLoadError(f"unreadable safetensors file: {exc}", path=str(file)) from exc
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in FLOAT_DTYPES:
            raise ModelLoadError(f"{entry['dtype']} is not a float type a LoRA update is stored in",
                                 path=str(file), tensor=name)  # fmt: skip
        begin, end = entry["data_offsets"]
        try:
            ((array, kind),) = decode_stored(entry["dtype"], data[start + begin : start + end], tuple(entry["shape"])).values()
        except ValueError as exc:
            raise ModelLoadError(str(exc), path=str(file), tensor=name) from exc
        tensors[name] = (array.astype(np.uint32) << 16).view(np.float32) if kind == "bf16" else array
    return tensors


def pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module value: the first pattern the module's name ends with (as a regex)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def load_peft(path: Path, config: dict[str, Any]) -> AdapterCheckpoint:
    where = str(path / CONFIG)
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise ModelLoadError(
            f"peft_type {kind!r} is not LoRA; only LoRA adapters are served",
            path=where,
            key="peft_type",
        )
    for key, allowed in PEFT_REFUSED.items():
        if config.get(key) not in allowed:
            raise ModelLoadError(f"{key} {config.get(key)!r} is not served (plain LoRA updates only)",
                                 path=where, key=key)  # fmt: skip
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(
            f"r and lora_alpha must be numbers: {exc}", path=where, key="r"
        ) from exc
    rslora = bool(config.get("use_rslora", False))
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    file = path / PEFT_WEIGHTS
    tensors = _load_tensors(file)
    updates: dict[str, LowRank] = {}
    for name, b_name in paired_tensors(tensors, ".lora_A.weight", ".lora_B.weight", file):
        module = name.removesuffix(".lora_A.weight").removeprefix(PEFT_PREFIX)
        r = int(pattern_value(ranks, module, rank))
        a, b = tensors[name], tensors[b_name]
        if a.ndim != 2 or a.shape[0] != r:
            raise ModelLoadError(
                f"shape {tuple(a.shape)} is not rank {r} (r, rank_pattern)",
                path=str(file),
                tensor=name,
            )
        scale = lora_scale(float(pattern_value(alphas, module, alpha)), r, rslora=rslora)
        updates[module] = LowRank(a, b, scale, (name, b_name))
    return AdapterCheckpoint(
        path, "peft", updates, {"rank": rank, "alpha": alpha, "rslora": rslora}
    )


def load_mlx_lm(path: Path, config: dict[str, Any]) -> AdapterCheckpoint:
    where = str(path / CONFIG)
    kind = config.get("fine_tune_type", "dora" if config.get("use_dora") else "lora")
    if kind != "lora":
        key = "fine_tune_type" if "fine_tune_type" in config else "use_dora"
        raise ModelLoadError(
            f"fine_tune_type {kind!r} is not served (LoRA adapters only)", path=where, key=key
        )
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or not isinstance(params.get("scale"), (int, float)):
        raise ModelLoadError(
            "lora_parameters.scale is missing", path=where, key="lora_parameters.scale"
        )
    scale = float(params["scale"])
    file = path / MLX_LM_WEIGHTS
    tensors = _load_tensors(file)
    updates: dict[str, LowRank] = {}
    for name, b_name in paired_tensors(tensors, ".lora_a", ".lora_b", file):
        a, b = tensors[name], tensors[b_name]
        if a.ndim != 2 or b.ndim != 2:
            raise ModelLoadError(
                f"shape {tuple(a.shape)}: per-expert LoRA is not served",
                path=str(file),
                tensor=name,
            )
        updates[name.removesuffix(".lora_a")] = LowRank(a.T, b.T, scale, (name, b_name))
    return AdapterCheckpoint(path, "mlx-lm", updates, {"rank": params.get("rank"), "scale": scale})
