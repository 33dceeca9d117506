"""The ``models[].quantization`` policy: which weights stay packed, which are requantized or dense."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxr_core.config.schema import ModelConfig
from mlxr_core.model.checkpoint import QuantSpec
from mlxr_core.model.loader import load_model
from mlxr_core.model.quantize import apply_policy
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny import write_tiny_llama_gguf


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    return {
        q: write_tiny_llama_gguf(folder / f"{q}.gguf", quant=q) for q in ("f32", "q4_0", "q8_0")
    }


def load(path, registries, policy):
    # Unfused, so that each layer of the checkpoint is its own module to inspect.
    config = ModelConfig(path=str(path), dtype="float32", quantization=policy, fuse_projections=False)
    return load_model(config, registries)


def up_proj(loaded):
    return loaded.model.layers[0].mlp.up_proj


@pytest.mark.parametrize(
    ("quant", "policy", "bits", "group_size"),
    [
        ("q4_0", "keep", 4, 32),
        ("q4_0", "q4", 4, 32),
        ("q4_0", "q8", 8, 32),
        ("q4_0", "q4_g64", 4, 64),
        ("q8_0", "q4", 4, 32),
        ("f32", "q8", 8, 32),
        ("f32", "q4_g64", 4, 64),
    ],
)
def test_packed_policies(files, registries, quant, policy, bits, group_size):
    module = up_proj(load(files[quant], registries, policy))
    assert isinstance(module, nn.QuantizedLinear)
    assert (module.bits, module.group_size) == (bits, group_size)


@pytest.mark.parametrize(
    ("policy", "dtype"), [("dequantize", mx.float32), ("f16", mx.float16), ("bf16", mx.bfloat16)]
)
def test_dense_policies(files, registries, policy, dtype):
    module = up_proj(load(files["q4_0"], registries, policy))
    assert type(module) is nn.Linear and module.weight.dtype == dtype


def test_keep_leaves_float_weights_dense(files, registries):
    assert type(up_proj(load(files["f32"], registries, "keep"))) is nn.Linear


def test_a_matching_packed_format_is_not_rounded_twice(files, registries):
    kept = up_proj(load(files["q4_0"], registries, "keep"))
    again = up_proj(load(files["q4_0"], registries, "q4"))
    assert mx.array_equal(kept.weight, again.weight) and mx.array_equal(kept.scales, again.scales)


def test_the_load_reports_each_source_type_at_debug(files, registries, caplog):
    with caplog.at_level(logging.DEBUG, logger="mlxr_core.model.loader"):
        load(files["q4_0"], registries, "q8")
    lines = [r.getMessage() for r in caplog.records]
    assert any("Q4_0 -> MLX 8-bit g32 (requantized): 16 tensors" in line for line in lines), lines


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 8, bias=False)
        self.norm = nn.RMSNorm(64)


def test_keep_requantizes_dense_weights_to_their_suggested_format():
    """A block type with no exact layout (handed over dense) becomes the suggested MLX format."""
    w = mx.array(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32))
    weights = {"proj.weight": w, "norm.weight": mx.ones(64)}
    result = apply_policy(
        "keep",
        Tiny(),
        weights,
        {},
        {"proj": QuantSpec(8, 32)},
        {"proj": "Q6_K"},
        mx.float32,
        "gpu",
    )
    assert result.quantization == {"proj": QuantSpec(8, 32)}
    assert result.report == {"Q6_K -> MLX 8-bit g32 (requantized)": 1}
    restored = mx.dequantize(
        result.weights["proj.weight"],
        result.weights["proj.scales"],
        result.weights["proj.biases"],
        group_size=32,
        bits=8,
    )
    assert float(mx.abs(restored - w).max()) < 0.02
    assert result.weights["norm.weight"] is weights["norm.weight"]
    # ``auto`` on CPU: dense, the suggestion ignored.
    dense = apply_policy(
        "auto", Tiny(), weights, {}, {"proj": QuantSpec(8, 32)}, {"proj": "Q6_K"}, mx.float32, "cpu"
    )
    assert dense.quantization == {} and dense.report == {"Q6_K -> dense float32": 1}


def expected_linear(holder: nn.Module, x: mx.array) -> mx.array:
    """nn.QuantizedLinear's own result for ``holder.linear``."""
    layer = holder.linear
    out = mx.quantized_matmul(
        x, layer.weight, layer.scales, layer.biases, transpose=True, group_size=32, bits=4
    )
    return out + layer.bias


def expected_head(holder: nn.Module, x: mx.array) -> mx.array:
    """nn.QuantizedEmbedding.as_linear's own result for ``holder.embed``."""
    embed = holder.embed
    return mx.quantized_matmul(
        x, embed.weight, embed.scales, embed.biases, transpose=True, group_size=32, bits=4
    )


def test_packed_layers_and_a_tied_head_hand_the_kernel_rows():
    """Every packed matmul, the tied LM head's too, runs the routed kernel with a ``[rows, K]``
    input (a batched decode step's ``[B, 1, K]`` flattened), and gives nn's own result; an input
    that is one matrix already (one stream's ``[1, L, K]``) reaches the kernel as it is."""
    from mlxr_core.model.quantize import route_quantized_linears

    mx.random.seed(0)
    holder = nn.Module()
    holder.linear = nn.Linear(64, 96)
    holder.embed = nn.Embedding(96, 64)
    nn.quantize(holder, group_size=32, bits=4)
    x = mx.random.normal((3, 1, 64))
    expected = (holder.linear(x), holder.embed.as_linear(x))
    shapes = []

    def kernel(x, *args, **kwargs):
        shapes.append(tuple(x.shape))
        return mx.quantized_matmul(x, *args, **kwargs)

    assert route_quantized_linears(holder, kernel) == 2
    got = (holder.linear(x), holder.embed.as_linear(x))
    assert shapes == [(3, 64), (3, 64)]
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.shape == theirs.shape == (3, 1, 96)
        np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=1e-5)
    shapes.clear()
    one = mx.random.normal((1, 2, 64))
    got = (holder.linear(one), holder.embed.as_linear(one))
    assert shapes == [(1, 2, 64), (1, 2, 64)]
    for ours, theirs in zip(got, (expected_linear(holder, one), expected_head(holder, one)), strict=True):
        assert ours.shape == (1, 2, 96)
        np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=1e-5)
    # Embedding lookups stay as they were.
    ids = mx.array([[1, 5]])
    assert holder.embed(ids).shape == (1, 2, 64)
