"""llama.cpp's LoRA GGUF (``general.type: adapter``, ``adapter.type: lora``, what
``convert_lora_to_gguf.py`` writes), read into an :class:`~mlxr_core.model.lora.AdapterCheckpoint`.

Each update is ``blk.N.<tensor>.weight.lora_a [r, in]`` and ``.lora_b [out, r]`` (numpy order),
scaled by ``adapter.lora.alpha / r`` (llama.cpp's scale). Where the converter reordered a base's
query and key rows for ggml's RoPE (:attr:`ArchSettings.permuted_rows`), it reordered ``lora_b``'s
rows alike; they are put back in the Hugging Face order with the base's head counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.lora import AdapterCheckpoint, LowRank, lora_scale, paired_tensors
from mlxr_plugins.formats.gguf.arch_settings import settings_of
from mlxr_plugins.formats.gguf.names import hf_name
from mlxr_plugins.formats.gguf.quants import unpermute_rows
from mlxr_plugins.formats.gguf.reader import detect, field_value, open_reader


def is_adapter(path: Path) -> bool:
    if not (path.is_file() and detect(path)):
        return False
    try:
        return field_value(open_reader(path), "general.type") == "adapter"
    except Exception:
        return False


def _array(tensor: Any) -> np.ndarray:
    if tensor.tensor_type in (QType.F32, QType.F16):
        return np.asarray(tensor.data, dtype=np.float32)
    if tensor.tensor_type == QType.BF16:
        return (np.asarray(tensor.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return dequantize(tensor.data, tensor.tensor_type).astype(np.float32)


def load(path: Path, base_config: Mapping[str, Any]) -> AdapterCheckpoint:
    reader = open_reader(path)
    kind = field_value(reader, "adapter.type")
    if kind != "lora":
        raise ModelLoadError(
            f"adapter.type {kind!r} is not served (LoRA adapters only)",
            path=str(path),
            key="adapter.type",
        )
    alpha = field_value(reader, "adapter.lora.alpha")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ModelLoadError(
            "adapter.lora.alpha is missing", path=str(path), key="adapter.lora.alpha"
        )
    arch = str(field_value(reader, "general.architecture", "llama"))
    permuted = settings_of(arch).permuted_rows
    heads = base_config.get("num_attention_heads")
    kv_heads = base_config.get("num_key_value_heads") or heads
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    updates: dict[str, LowRank] = {}
    for name, b_name in paired_tensors(tensors, ".lora_a", ".lora_b", path):
        a, b = _array(tensors[name]), _array(tensors[b_name])
        if a.ndim != 2 or b.ndim != 2:
            raise ModelLoadError(
                f"shape {a.shape}: per-expert LoRA is not served", path=str(path), tensor=name
            )
        weight = name.removesuffix(".lora_a")
        part = weight.split(".")[2] if weight.startswith("blk.") else ""
        if permuted and part in ("attn_q", "attn_k") and heads:
            try:
                b = unpermute_rows(b, int(heads if part == "attn_q" else kv_heads or heads))
            except ValueError as exc:
                raise ModelLoadError(
                    f"does not fit the base's heads: {exc}", path=str(path), tensor=b_name
                ) from exc
        module = hf_name(weight, arch).removesuffix(".weight")
        updates[module] = LowRank(a, b, lora_scale(float(alpha), a.shape[0]), (name, b_name))
    return AdapterCheckpoint(path, "gguf", updates, {"alpha": float(alpha), "architecture": arch})
