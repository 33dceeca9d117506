"""The phi3 graph against transformers' ``Phi3ForCausalLM`` on tiny random weights, through every
format that holds it: the Hugging Face folder, a GGUF written as llama.cpp's converter writes one
(fused ``attn_qkv`` and ``ffn_up``, LongRoPE factors as tensors), and an MLX-native folder written
by ``mlxr convert``.

Two configs: ``plain`` (full rotary, no scaling, no window) and ``longrope`` (half the head rotated,
LongRoPE short factors and attention factor, a 6-position sliding window shorter than the prompts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import OPS, bind_kernels
from mlxr_core.model.loader import build_model
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.conformance import TINY_CONFIG, check_architecture
from mlxr_core.testing.tiny import write_gguf
from mlxr_plugins.archs.phi3 import Phi3Architecture, Phi3Args
from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat
from mlxr_plugins.formats.safetensors.checkpoint import SafetensorsFormat

ATOL = 1e-4
SHAPE = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {"max_position_embeddings": 128},
    "longrope": {
        "max_position_embeddings": 256,
        "original_max_position_embeddings": 64,
        "partial_rotary_factor": 0.5,
        "sliding_window": 6,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0, 1.3, 2.0, 4.5],  # rotary dims (8) / 2
            "long_factor": [3.0, 5.0, 7.0, 9.0],
        },
    },
}
#: Hugging Face module -> llama.cpp tensor, as ``convert_hf_to_gguf`` maps Phi-3.
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.fixture(scope="module", params=list(CONFIGS))
def reference(request, tmp_path_factory) -> dict[str, Any]:
    """A saved tiny ``Phi3ForCausalLM``, two prompts and transformers' logits for them."""
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    torch.manual_seed(0)
    config = transformers.Phi3Config(
        **SHAPE, **CONFIGS[request.param], pad_token_id=0, attn_implementation="eager"
    )
    model = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():  # O(1) logits: the default init's 0.02 std gives near-zero ones
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.copy_(torch.randn_like(parameter) / parameter.shape[-1] ** 0.5)
    folder = tmp_path_factory.mktemp(f"phi3_{request.param}")
    model.save_pretrained(folder)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, SHAPE["vocab_size"], n).tolist() for n in (30, 19)]
    with torch.no_grad():
        logits = [model(torch.tensor([ids])).logits[0].numpy() for ids in prompts]
    return {"name": request.param, "folder": folder, "prompts": prompts, "logits": logits}


def write_phi3_gguf(path: Path, folder: Path, quant: str = "f32") -> Path:
    """The folder as ``convert_hf_to_gguf`` writes a Phi-3 (its ``Phi3MiniModel``)."""
    import json

    config = json.loads((folder / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    weights = SafetensorsFormat().load(folder, dtype="float32").weights
    tensors: dict[str, np.ndarray] = {}
    for name, array in weights.items():
        data = np.array(array, dtype=np.float32)
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            tensors[f"blk.{index}.{GGUF_NAMES[module]}.{kind}"] = data
        else:
            tensors[TOP_NAMES[name]] = data
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    rotary = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    max_positions = config["max_position_embeddings"]
    original = config.get("original_max_position_embeddings", max_positions)
    metadata: dict[str, Any] = {
        "context_length": max_positions,
        "rope.scaling.original_context_length": original,
        "embedding_length": hidden,
        "feed_forward_length": config["intermediate_size"],
        "block_count": config["num_hidden_layers"],
        "attention.head_count": heads,
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
        "rope.dimension_count": int(rotary * hidden) // heads,
        "rope.freq_base": float(rope.get("rope_theta", 10000.0)),
        "attention.sliding_window": config.get("sliding_window") or 0,
    }
    if rope.get("rope_type") == "longrope":
        scale = max_positions / original
        metadata["rope.scaling.attn_factor"] = float(
            np.sqrt(1 + np.log(scale) / np.log(original)) if scale > 1 else 1.0
        )
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    return write_gguf(path, "phi3", metadata, tensors, quant=quant)  # type: ignore[arg-type]


def build(checkpoint: Any, registries: Any, backend: str = "mlx_fast") -> tuple[Any, Any]:
    """The checkpoint's model (packed matrices dequantized), as the loader builds it."""
    config = checkpoint.config
    arch = registries.archs.get(config["model_type"])
    kernels = bind_kernels(
        registries.kernels,
        dtype="float32",
        shapes=arch.kernel_context(config),
        choices=dict.fromkeys(OPS, backend),
    )
    return build_model(checkpoint, arch, kernels, "dequantize", "float32"), arch


def assert_matches(model: Any, reference: dict[str, Any], atol: float = ATOL) -> None:
    for ids, expected in zip(reference["prompts"], reference["logits"], strict=True):
        logits = np.array(model(mx.array([ids]))[0])
        assert float(np.abs(expected).max()) > 1.0  # not a comparison of near-zero numbers
        np.testing.assert_allclose(logits, expected, atol=atol)


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_folder_matches_transformers(reference, registries, backend):
    checkpoint = SafetensorsFormat().load(reference["folder"])
    assert checkpoint.config["model_type"] == "phi3"
    model, _ = build(checkpoint, registries, backend)
    assert_matches(model, reference)


def test_gguf_matches_transformers(reference, registries, tmp_path):
    checkpoint = GGUFFormat().load(write_phi3_gguf(tmp_path / "p.gguf", reference["folder"]))
    config = checkpoint.config
    assert config["model_type"] == "phi3"
    if reference["name"] == "longrope":
        assert config["partial_rotary_factor"] == 0.5 and config["sliding_window"] == 6
        assert config["rope_scaling"]["rope_type"] == "longrope"
        assert not any("rope_factors" in name for name in checkpoint.weights)
    model, _ = build(checkpoint, registries)
    assert_matches(model, reference)


def test_quantized_gguf_keeps_packed_fused_matrices(reference, registries, tmp_path):
    """Q8_0 fused matrices are repacked exactly; the logits stay within 8-bit error."""
    path = write_phi3_gguf(tmp_path / "q.gguf", reference["folder"], quant="q8_0")
    checkpoint = GGUFFormat().load(path)
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"} <= set(
        checkpoint.quantization
    )
    model, _ = build(checkpoint, registries)
    ids, expected = reference["prompts"][0], reference["logits"][0]
    logits = np.array(model(mx.array([ids]))[0])
    assert (logits.argmax(-1) == expected.argmax(-1)).mean() >= 0.9
    assert np.abs(logits - expected).max() < 0.05 * np.abs(expected).max()


def test_converted_mlx_folder_matches_transformers(reference, registries, tmp_path):
    """``mlxr convert`` (dense) writes an MLX folder that loads back to the same logits."""
    from mlxr_core.cli.convert import convert

    out = convert(str(reference["folder"]), tmp_path / "mlx", dtype="float32")
    model, _ = build(SafetensorsFormat().load(out), registries)
    assert_matches(model, reference)


def test_cached_decoding_matches_transformers(reference, registries):
    model, arch = build(SafetensorsFormat().load(reference["folder"]), registries)
    ids, expected = reference["prompts"][0], reference["logits"][0]
    cache = arch.make_cache(model)
    steps = [model(mx.array([ids[:9]]), cache=cache)]
    steps += [model(mx.array([[token]]), cache=cache) for token in ids[9:]]
    np.testing.assert_allclose(np.array(mx.concatenate(steps, axis=1)[0]), expected, atol=ATOL)


@pytest.mark.parametrize("extra", [{}, {"partial_rotary_factor": 0.5}])
def test_phi3_conforms(registries, extra):
    arch = registries.archs.get("phi3")
    assert isinstance(arch, Phi3Architecture)
    config = {**TINY_CONFIG, "model_type": "phi3", **extra}
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes=arch.kernel_context(config))
    check_architecture(arch, config, kernels)


def test_longrope_serves_its_original_length():
    config = {**SHAPE, **CONFIGS["longrope"]}
    assert Phi3Architecture().context_length(config) == 64
    assert Phi3Architecture().context_length({**SHAPE, **CONFIGS["plain"]}) == 128
    # transformers 5 keeps these inside rope_parameters (normalized to rope_scaling).
    nested = {**SHAPE, "rope_scaling": {"partial_rotary_factor": 0.75, "type": "default"}}
    assert Phi3Args.from_config(nested).partial_rotary_factor == 0.75


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, "short_factor must list 8"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_settings_are_refused_by_name(registries, extra, message):
    arch = Phi3Architecture()
    config = {**SHAPE, **extra}
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes={"head_dim": 16})
    with pytest.raises(ModelLoadError, match=message):
        arch.build(config, kernels)
