"""Hugging Face's block-scaled FP8 folders (``quant_method: fp8``), dequantized as they load; what
they can get wrong is named (the model end to end: tests/plugins/archs/test_deepseek_v3.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_plugins.formats.safetensors.checkpoint import SafetensorsFormat

torch = pytest.importorskip("torch", reason="float8 tensors are written with torch")

QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [4, 8]}


def write(folder: Path, tensors: dict[str, Any], **quantization: Any) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = {"model_type": "llama", "quantization_config": {**QUANTIZATION, **quantization}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def fp8_weight() -> tuple[Any, Any, np.ndarray]:
    """A 6 x 12 float8 weight (partial blocks of 4 x 8 at both edges), its 2 x 2 scales and the
    float32 weight they mean."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 12, generator=generator).to(torch.float8_e4m3fn)
    scales = torch.tensor([[0.5, 2.0], [0.25, 4.0]])
    expanded = scales.repeat_interleave(4, 0).repeat_interleave(8, 1)[:6, :12]
    return weight, scales, (weight.float() * expanded).numpy()


def test_weights_are_dequantized_block_by_block(tmp_path):
    weight, scales, expected = fp8_weight()
    norm = torch.ones(12)
    folder = write(tmp_path / "fp8", {"proj.weight": weight, "proj.weight_scale_inv": scales, "norm.weight": norm})
    checkpoint = SafetensorsFormat().load(folder, dtype="float32")
    assert set(checkpoint.weights) == {"proj.weight", "norm.weight"}
    np.testing.assert_array_equal(np.array(checkpoint.weights["proj.weight"]), expected)
    assert checkpoint.source_types == {"proj": "FP8 e4m3 4x8 blocks"}
    assert checkpoint.suggested_quantization["proj"].bits == 8


def test_bfloat16_weights_come_from_float32_scales(tmp_path):
    """The scales are not rounded to the model's dtype before they multiply (only the product is)."""
    weight, _, _ = fp8_weight()
    scales = torch.tensor([[1.011, 1.013], [0.989, 1.019]])  # rounded apart in bfloat16
    folder = write(tmp_path / "fp8", {"proj.weight": weight, "proj.weight_scale_inv": scales})
    loaded = SafetensorsFormat().load(folder, dtype="bfloat16").weights["proj.weight"]
    assert loaded.dtype == mx.bfloat16
    got = np.array(loaded.astype(mx.float32))
    expanded = scales.repeat_interleave(4, 0).repeat_interleave(8, 1)[:6, :12]
    want = (weight.float() * expanded).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(got, want)
    rounded_scales = (weight.float() * expanded.to(torch.bfloat16).float()).to(torch.bfloat16).float().numpy()
    assert (rounded_scales != want).any()  # the check tells the two apart


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weight_block_size": [4]}, r"quantization_config.weight_block_size \[4\] is not two positive integers"),
        ({"fmt": "e5m2"}, "quantization_config.fmt 'e5m2' is not supported"),
        ({"activation_scheme": "static"}, "quantization_config.activation_scheme 'static' is not supported"),
        ({"weight_block_size": [8, 8]}, r"weight_scale_inv of shape \[2, 2\] does not cover 6 x 12 in blocks of 8 x 8"),
    ],
)
def test_what_does_not_fit_is_named(tmp_path, change, message):
    weight, scales, _ = fp8_weight()
    folder = write(tmp_path / "fp8", {"proj.weight": weight, "proj.weight_scale_inv": scales}, **change)
    with pytest.raises(ModelLoadError, match=message):
        SafetensorsFormat().load(folder)


def test_a_float8_weight_without_scales_is_named(tmp_path):
    weight, scales, _ = fp8_weight()
    folder = write(tmp_path / "fp8", {"a.weight": weight, "a.weight_scale_inv": scales, "b.weight": weight.clone()})
    with pytest.raises(ModelLoadError, match="a float8 weight without its weight_scale_inv") as raised:
        SafetensorsFormat().load(folder)
    assert raised.value.tensor == "b.weight"
