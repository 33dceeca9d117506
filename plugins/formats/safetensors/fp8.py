"""Hugging Face's block-scaled FP8 folders (DeepSeek-V3, R1, Kimi K2), dequantized at load.

``config.json``'s ``quantization_config`` says ``quant_method: fp8``, ``fmt: e4m3`` and
``weight_block_size: [rows, columns]`` (128 x 128 for DeepSeek). A quantized linear layer ``P``
stores ``P.weight`` as float8 e4m3 (``F8_E4M3``, which MLX reads as its bytes, uint8) and
``P.weight_scale_inv`` as one float32 per block: the weight is ``fp8 * scale_inv`` block by block
(the last blocks of a side may be partial). Other tensors (embeddings, norms, the router) are
stored in float as usual.

MLX has no such packing, so each weight is dequantized into the model's dtype; it is also
suggested for MLX's 8-bit packing (groups of 32, finer than the source's blocks), which the
``keep`` policy (``auto`` on a GPU) applies, holding the model at about the source's size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.checkpoint import QuantSpec

#: MLX's packing the dequantized weights are suggested for (``Checkpoint.suggested_quantization``).
SUGGESTED = QuantSpec(bits=8, group_size=32)
#: The suffix of the per-block scales.
SCALES = ".weight_scale_inv"


def block_size(config: dict[str, Any], config_path: Path) -> tuple[int, int]:
    """``quantization_config.weight_block_size``, checked with the rest of the block: ``fmt``
    e4m3 and dynamic activations (weights are what is dequantized; static activation scales would
    change the math)."""
    block = config["quantization_config"]
    where = {"path": str(config_path)}
    fmt = block.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"quantization_config.fmt {fmt!r} is not supported (fp8: e4m3)", **where)
    scheme = block.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ModelLoadError(
            f"quantization_config.activation_scheme {scheme!r} is not supported (fp8: dynamic)", **where
        )
    size = block.get("weight_block_size")
    if not (isinstance(size, list) and len(size) == 2 and all(type(n) is int and n > 0 for n in size)):
        raise ModelLoadError(
            f"quantization_config.weight_block_size {size!r} is not two positive integers", **where
        )
    return size[0], size[1]


def dequantize_fp8(
    weights: dict[str, mx.array], origin: dict[str, Path], blocks: tuple[int, int], dtype: mx.Dtype
) -> dict[str, str]:
    """Every ``P.weight`` with a ``P.weight_scale_inv`` dequantized into ``weights`` (as ``dtype``,
    the scales removed); returns module -> source type, for the load report.

    :raises ModelLoadError: naming the tensor, where a scale has no float8 weight beside it or
        does not have one value per block of it."""
    rows_per_block, columns_per_block = blocks
    sources: dict[str, str] = {}
    for name in sorted(name for name in weights if name.endswith(SCALES)):
        module = name.removesuffix(SCALES)
        scales, weight = weights.pop(name), weights.get(f"{module}.weight")
        where = {"path": str(origin[name]), "tensor": f"{module}.weight"}
        if weight is None or weight.dtype != mx.uint8 or weight.ndim != 2:
            raise ModelLoadError("a weight_scale_inv needs a 2-D float8 (F8_E4M3) weight beside it", **where)
        rows, columns = weight.shape
        expected = (-(-rows // rows_per_block), -(-columns // columns_per_block))
        if tuple(scales.shape) != expected:
            raise ModelLoadError(
                f"weight_scale_inv of shape {list(scales.shape)} does not cover {rows} x {columns} in "
                f"blocks of {rows_per_block} x {columns_per_block} ({list(expected)})",
                **where,
            )
        per_block = mx.repeat(scales.astype(mx.float32), rows_per_block, axis=0)
        per_element = mx.repeat(per_block, columns_per_block, axis=1)
        dense = mx.from_fp8(weight, dtype=mx.float32) * per_element[:rows, :columns]
        weights[f"{module}.weight"] = dense.astype(dtype)
        sources[module] = f"FP8 e4m3 {rows_per_block}x{columns_per_block} blocks"
    for name, array in weights.items():
        scaled = name.removesuffix(".weight") in sources
        if array.dtype == mx.uint8 and name.endswith(".weight") and not scaled:
            raise ModelLoadError(
                "a float8 weight without its weight_scale_inv", path=str(origin[name]), tensor=name
            )
    return sources
