"""The safetensors format: Hugging Face and mlx-lm folders written by the tests with MLX."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxr_core.config.schema import ModelConfig
from mlxr_core.errors import ModelLoadError, UnknownArchitecture
from mlxr_core.kernels import OPS
from mlxr_core.model.checkpoint import QuantSpec
from mlxr_core.model.loader import load_model, pick_format
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny import write_tiny_llama_gguf
from mlxr_plugins.formats.safetensors.checkpoint import SafetensorsFormat
from mlxr_plugins.formats.safetensors.tokenizer import read_chat_template, tokenizer_spec

TINY_HF = Path(__file__).parents[2] / "fixtures" / "tiny_hf"
CONFIG = {"model_type": "llama", "hidden_size": 64, "vocab_size": 10}
KERNELS = dict.fromkeys(OPS, "mlx_fast")


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


def write_folder(
    folder: Path,
    weights: dict[str, mx.array] | None = None,
    config: dict[str, Any] | None = None,
    files: dict[str, Any] | None = None,
) -> Path:
    """A model folder: ``model.safetensors``, ``config.json`` and ``files`` (name -> bytes, text,
    or a dict written as JSON)."""
    folder.mkdir(parents=True, exist_ok=True)
    if weights is not None:
        mx.save_safetensors(str(folder / "model.safetensors"), weights)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    for name, content in (files or {}).items():
        if isinstance(content, bytes):
            (folder / name).write_bytes(content)
        else:
            (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


def small_weights() -> dict[str, mx.array]:
    return {
        "model.embed_tokens.weight": mx.arange(20, dtype=mx.float32)
        .reshape(10, 2)
        .astype(mx.bfloat16),
        "model.norm.weight": mx.ones((2,), dtype=mx.float16),
        "model.layers.0.self_attn.rotary_emb.inv_freq": mx.ones((1,)),
        "token_type_ids": mx.array([1, 2, 3], dtype=mx.int32),
    }


def test_detects_folders_and_weight_files_but_not_gguf(tmp_path):
    fmt = SafetensorsFormat()
    folder = write_folder(tmp_path / "m", small_weights(), CONFIG)
    assert fmt.detect(folder) and fmt.detect(folder / "model.safetensors")
    assert not fmt.detect(folder / "config.json")
    assert not fmt.detect(write_folder(tmp_path / "empty", config=CONFIG))
    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    assert not fmt.detect(gguf) and not fmt.detect(tmp_path / "missing")


def test_auto_detection_picks_safetensors_for_a_folder(tmp_path, registries):
    folder = write_folder(tmp_path / "m", small_weights(), CONFIG)
    assert pick_format(folder, registries)[0] == "safetensors"
    assert pick_format(write_tiny_llama_gguf(tmp_path / "t.gguf"), registries)[0] == "gguf"


def test_names_unchanged_floats_cast_integers_kept(tmp_path):
    folder = write_folder(tmp_path / "m", small_weights(), CONFIG)
    checkpoint = SafetensorsFormat().load(folder, dtype="float32")
    assert set(checkpoint.weights) == set(small_weights())
    assert checkpoint.weights["model.embed_tokens.weight"].dtype == mx.float32
    assert checkpoint.weights["model.norm.weight"].dtype == mx.float32
    assert checkpoint.weights["token_type_ids"].dtype == mx.int32
    assert checkpoint.weights["model.embed_tokens.weight"][3, 1].item() == 7.0
    assert checkpoint.format == "safetensors" and checkpoint.config == CONFIG
    assert checkpoint.tokenizer is None and checkpoint.chat_template is None
    assert (
        SafetensorsFormat().load(folder, dtype="bfloat16").weights["model.norm.weight"].dtype
        == mx.bfloat16
    )


def test_the_config_is_the_files_and_errors_name_its_keys(tmp_path, registries):
    """transformers 5's ``rope_parameters`` stay as written (each config class reads either era's
    spelling); an error about a value read from it names the file's key."""
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0}
    config = {**CONFIG, "num_hidden_layers": 1, "intermediate_size": 8, "num_attention_heads": 2,
              "rope_parameters": llama3, "some_future_key": [1]}
    folder = write_folder(tmp_path / "m", small_weights(), config)
    checkpoint = SafetensorsFormat().load(folder)
    assert checkpoint.config == config
    assert checkpoint.config_keys["rope_scaling"] == "rope_parameters"
    with pytest.raises(ModelLoadError, match=r"both 2\.0") as caught:
        load_model(ModelConfig(path=str(folder), kernels=KERNELS), registries)
    assert caught.value.key == "rope_parameters"


def test_generation_config_gives_end_ids_and_sampling_defaults(tmp_path):
    generation = {"eos_token_id": [7, 3], "temperature": 0.6, "top_p": 0.95, "max_length": 9}
    folder = write_folder(
        tmp_path / "m",
        small_weights(),
        {**CONFIG, "eos_token_id": 2},
        files={"generation_config.json": generation},
    )
    metadata = SafetensorsFormat().load(folder).metadata
    assert metadata["eos_token_ids"] == [2, 3, 7]
    assert metadata["generation_defaults"] == {"temperature": 0.6, "top_p": 0.95}


def test_a_broken_generation_config_is_reported_and_skipped(tmp_path, caplog):
    folder = write_folder(
        tmp_path / "m", small_weights(), CONFIG, files={"generation_config.json": "{not json"}
    )
    with caplog.at_level(logging.WARNING):
        assert SafetensorsFormat().load(folder).metadata["eos_token_ids"] == []
    assert "generation_config.json" in caplog.text


def test_missing_config_json_is_named(tmp_path):
    folder = write_folder(tmp_path / "m", small_weights())
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        SafetensorsFormat().load(folder)


def test_invalid_config_json_names_file_and_line(tmp_path):
    folder = write_folder(tmp_path / "m", small_weights(), files={"config.json": '{\n"a": 1,\n}'})
    with pytest.raises(ModelLoadError, match=r"config\.json: invalid JSON \(line 3\)"):
        SafetensorsFormat().load(folder)


def test_truncated_safetensors_names_file_and_tensor(tmp_path):
    folder = write_folder(tmp_path / "m", {"a.weight": mx.ones((64, 64))}, CONFIG)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ModelLoadError, match="truncated") as error:
        SafetensorsFormat().load(folder)
    assert error.value.tensor == "a.weight" and error.value.path.endswith("model.safetensors")


def test_garbage_safetensors_names_the_file(tmp_path):
    folder = write_folder(tmp_path / "m", config=CONFIG, files={"model.safetensors": b"\xff" * 64})
    with pytest.raises(ModelLoadError, match="corrupt") as error:
        SafetensorsFormat().load(folder)
    assert error.value.path.endswith("model.safetensors")


def write_sharded(folder: Path) -> Path:
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "model-00001-of-00002.safetensors"), {"a": mx.ones((2,))})
    mx.save_safetensors(str(folder / "model-00002-of-00002.safetensors"), {"b": mx.zeros((3,))})
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    return write_folder(folder, config=CONFIG, files={"model.safetensors.index.json": index})


def test_sharded_folder_loads_every_shard(tmp_path):
    folder = write_sharded(tmp_path / "m")
    checkpoint = SafetensorsFormat().load(folder)
    assert sorted(checkpoint.weights) == ["a", "b"]
    assert checkpoint.metadata["files"] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert SafetensorsFormat().detect(folder / "model.safetensors.index.json")


def test_missing_shard_names_the_shard_and_a_tensor(tmp_path):
    folder = write_sharded(tmp_path / "m")
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing shard") as error:
        SafetensorsFormat().load(folder)
    assert (
        error.value.path.endswith("model-00002-of-00002.safetensors") and error.value.tensor == "b"
    )


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    folder = write_sharded(tmp_path / "m")
    mx.save_safetensors(str(folder / "model-00002-of-00002.safetensors"), {"c": mx.zeros((3,))})
    with pytest.raises(ModelLoadError, match="file lacks it") as error:
        SafetensorsFormat().load(folder)
    assert error.value.tensor == "b"


def quantized_weights(bits: int = 4, group_size: int = 32) -> dict[str, mx.array]:
    w = mx.random.normal((8, 64), key=mx.random.key(0))
    packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    return {
        "model.layers.0.mlp.up_proj.weight": packed,
        "model.layers.0.mlp.up_proj.scales": scales.astype(mx.float16),
        "model.layers.0.mlp.up_proj.biases": biases.astype(mx.float16),
        "model.layers.0.mlp.down_proj.weight": mx.ones((64, 8)),
    }


def test_mlx_lm_quantization_block_becomes_quant_specs(tmp_path):
    quantization = {
        "group_size": 64,
        "bits": 8,
        "model.layers.0.mlp.up_proj": {"group_size": 32, "bits": 4},
        "model.layers.0.mlp.down_proj": False,
    }
    folder = write_folder(
        tmp_path / "m", quantized_weights(), {**CONFIG, "quantization": quantization}
    )
    checkpoint = SafetensorsFormat().load(folder, dtype="float32")
    assert checkpoint.quantization == {
        "model.layers.0.mlp.up_proj": QuantSpec(bits=4, group_size=32)
    }
    assert checkpoint.weights["model.layers.0.mlp.up_proj.weight"].dtype == mx.uint32
    assert checkpoint.weights["model.layers.0.mlp.up_proj.scales"].dtype == mx.float32
    assert checkpoint.metadata["quantization"] == {"bits": 8, "group_size": 64}


def test_quantization_config_spelling_is_read_too(tmp_path):
    config = {**CONFIG, "quantization_config": {"group_size": 32, "bits": 4}}
    folder = write_folder(tmp_path / "m", quantized_weights(), config)
    assert SafetensorsFormat().load(folder).quantization["model.layers.0.mlp.up_proj"].bits == 4


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({}, "no quantization block"),
        ({"quantization": {"group_size": 64, "bits": 4}}, "does not fit 4-bit groups of 64"),
        ({"quantization": {"group_size": 32, "bits": 8}}, "does not fit 8-bit groups of 32"),
        (
            {"quantization": {"group_size": 32, "bits": 4, "model.layers.0.mlp.up_proj": False}},
            "marks this module unquantized",
        ),
        ({"quantization": {"bits": 4}}, "unusable quantization parameters"),
    ],
)
def test_inconsistent_packing_names_the_tensor(tmp_path, config, match):
    folder = write_folder(tmp_path / "m", quantized_weights(), {**CONFIG, **config})
    with pytest.raises(ModelLoadError, match=match) as error:
        SafetensorsFormat().load(folder)
    assert "model.layers.0.mlp.up_proj" in str(error.value)
    assert "model.safetensors" in str(error.value)


def test_other_quantization_methods_are_refused(tmp_path):
    config = {**CONFIG, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    folder = write_folder(tmp_path / "m", small_weights(), config)
    with pytest.raises(ModelLoadError, match="'gptq' is not supported"):
        SafetensorsFormat().load(folder)


def test_mxfp4_tensors_become_packed_mxfp4_modules(tmp_path):
    """Hugging Face's ``*_blocks`` / ``*_scales`` are MLX ``mxfp4`` bytes: handed over packed,
    dequantizing to e2m1 codes (low nibble first) times ``2 ** (scale - 127)``."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 3, 2, 16), dtype=np.uint8)  # [experts, rows, in / 32, 16]
    scales = rng.integers(120, 130, (2, 3, 2), dtype=np.uint8)
    config = {**CONFIG, "quantization_config": {"quant_method": "mxfp4"}}
    weights = {"experts.down_proj_blocks": mx.array(blocks), "experts.down_proj_scales": mx.array(scales)}
    checkpoint = SafetensorsFormat().load(write_folder(tmp_path / "m", weights, config))
    assert checkpoint.quantization == {"experts.down_proj": QuantSpec(4, 32, "mxfp4")}
    packed = checkpoint.weights["experts.down_proj.weight"]
    assert packed.dtype == mx.uint32 and packed.shape == (2, 3, 8)
    dense = mx.dequantize(packed, checkpoint.weights["experts.down_proj.scales"], group_size=32, bits=4,
                          mode="mxfp4", dtype=mx.float32)
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(2, 3, 2, 32)
    expected = np.ldexp(e2m1[codes], scales[..., None].astype(np.int32) - 127).reshape(2, 3, 64)
    np.testing.assert_array_equal(np.array(dense), expected)

    weights["experts.down_proj_scales"] = mx.array(scales[..., :1])
    with pytest.raises(ModelLoadError, match=r"MXFP4 blocks .* are not uint8") as error:
        SafetensorsFormat().load(write_folder(tmp_path / "bad", weights, config))
    assert "experts.down_proj_blocks" in str(error.value)


def test_tokenizer_kind_follows_the_files(tmp_path):
    assert tokenizer_spec(write_folder(tmp_path / "none")) is None
    hf = tokenizer_spec(
        write_folder(tmp_path / "hf", files={"tokenizer.json": "{}", "tokenizer.model": b"\n\x05"})
    )
    assert hf is not None and hf.kind == "hf"
    spm = tokenizer_spec(
        write_folder(tmp_path / "spm", files={"tokenizer.model": b"\n\x0b\n\x05<unk>"})
    )
    assert spm is not None and spm.kind == "sentencepiece"
    ranks = b"IQ== 0\nIg== 1\n"
    for name in ("tokenizer.model", "qwen.tiktoken"):
        spec = tokenizer_spec(write_folder(tmp_path / name, files={name: ranks}))
        assert spec is not None and spec.kind == "tiktoken" and spec.data["file"].endswith(name)


def test_tokenizer_spec_carries_config_and_end_ids(tmp_path):
    folder = write_folder(
        tmp_path / "m",
        files={"tokenizer.json": "{}", "tokenizer_config.json": {"eos_token": "</s>"}},
    )
    spec = tokenizer_spec(folder, eos_token_ids=[5, 2, 5], vocab_size=99)
    assert spec is not None
    assert spec.data["tokenizer_config"] == {"eos_token": "</s>"}
    assert spec.data["eos_token_ids"] == [2, 5] and spec.data["vocab_size"] == 99


def test_chat_template_sources_in_transformers_order(tmp_path):
    assert read_chat_template(write_folder(tmp_path / "a"), {"chat_template": "T"}) == "T"
    named = [{"name": "tool_use", "template": "U"}, {"name": "default", "template": "D"}]
    assert read_chat_template(tmp_path / "a", {"chat_template": named}) == "D"
    jinja = write_folder(
        tmp_path / "b",
        files={"chat_template.jinja": "J", "chat_template.json": {"chat_template": "X"}},
    )
    assert read_chat_template(jinja, {"chat_template": "T"}) == "J"
    (jinja / "chat_template.jinja").unlink()
    assert read_chat_template(jinja, {}) == "X"
    assert read_chat_template(tmp_path / "a", {}) is None


def test_a_tiny_qwen2_folder_is_served_end_to_end(registries):
    loaded = load_model(
        ModelConfig(path=str(TINY_HF / "qwen2"), dtype="float32", kernels=KERNELS), registries
    )
    assert loaded.format == "safetensors" and loaded.config["model_type"] == "qwen2"
    assert loaded.context_length == 512
    ids = loaded.tokenizer.encode("Hello world")
    assert loaded.model(mx.array([ids])).shape == (1, len(ids), 384)
    assert loaded.metadata["generation_defaults"]["top_k"] == 20


def test_unknown_model_type_lists_the_available_architectures(tmp_path, registries):
    folder = write_folder(tmp_path / "m", small_weights(), {**CONFIG, "model_type": "qwen9"})
    with pytest.raises(
        UnknownArchitecture, match=r"available: .*llama.*qwen2.*qwen3.*did you mean"
    ):
        load_model(ModelConfig(path=str(folder)), registries)


def test_weights_that_do_not_fit_the_graph_name_the_tensor(tmp_path, registries):
    source = TINY_HF / "qwen3"
    folder = tmp_path / "qwen3"
    folder.mkdir()
    for file in source.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    weights = dict(mx.load(str(folder / "model.safetensors")))
    weights["model.layers.1.self_attn.q_norm.weight"] = mx.ones((8,))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.q_norm\.weight"):
        load_model(ModelConfig(path=str(folder), kernels=KERNELS), registries)


def test_mlx_lm_folder_keeps_its_packing_through_the_loader(registries):
    config = ModelConfig(
        path=str(TINY_HF / "llama_mlx_q4"), dtype="float32", quantization="keep", kernels=KERNELS,
        fuse_projections=False,
    )
    loaded = load_model(config, registries)
    assert loaded.metadata["producer"] == "mlx-lm"
    layer = loaded.model.layers[0]
    assert isinstance(layer.mlp.down_proj, nn.QuantizedLinear)
    assert type(loaded.model.layers[1].mlp.down_proj).__name__ == "Linear"
    assert (layer.mlp.up_proj.bits, layer.mlp.up_proj.group_size) == (4, 32)
    assert loaded.model.lm_head.bits == 8
    np.testing.assert_array_equal(np.array(loaded.model(mx.array([[1, 2, 3]]))).shape, (1, 3, 384))
