"""Joining linear layers that read the same input (``mlxr_core.model.fuse``)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxr_core.config.schema import ModelConfig
from mlxr_core.kernels import bind_kernels
from mlxr_core.model.fuse import concat_linears, fuse_model
from mlxr_core.model.loader import load_model
from mlxr_core.model.quantize import route_quantized_linears
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.conformance import TINY_CONFIG, check_architecture, random_model


def linears(outs, bias=False, seed=0):
    mx.random.seed(seed)
    layers = [nn.Linear(64, out, bias=bias) for out in outs]
    for layer in layers:
        if bias:
            layer.bias = mx.random.normal(layer.bias.shape)
    return layers


def joined(layers, x):
    return mx.concatenate([layer(x) for layer in layers], axis=-1)


@pytest.mark.parametrize("bias", [False, True])
def test_dense_layers_join_into_one_with_the_same_outputs(bias):
    layers = linears([48, 16, 16], bias=bias)
    fused = concat_linears(layers)
    assert type(fused) is nn.Linear and fused.weight.shape == (80, 64)
    assert ("bias" in fused) == bias
    x = mx.random.normal((2, 3, 64))
    np.testing.assert_allclose(np.array(fused(x)), np.array(joined(layers, x)), atol=1e-5)


@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (8, 64)])
def test_packed_layers_join_and_keep_their_routed_kernel(bits, group_size):
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return mx.quantized_matmul(*args, **kwargs)

    holder = nn.Sequential(*linears([32, 64]))
    nn.quantize(holder, group_size=group_size, bits=bits)
    route_quantized_linears(holder, counting)
    layers = list(holder.layers)
    x = mx.random.normal((1, 2, 64))
    expected = np.array(joined(layers, x))
    fused = concat_linears(layers)
    assert type(fused) is type(layers[0]) and (fused.bits, fused.group_size) == (bits, group_size)
    calls.clear()
    np.testing.assert_allclose(np.array(fused(x)), expected, atol=1e-5)
    assert calls == [1]  # one matmul, through the kernel the originals were routed to
    assert "weight" not in dict(fused.trainable_parameters())  # frozen like the originals


def test_layers_that_cannot_join_are_refused():
    dense = linears([16, 16])
    assert concat_linears([dense[0], *linears([16], bias=True)]) is None  # bias on one only
    packed = nn.Sequential(*linears([16, 16]))
    nn.quantize(packed, group_size=32, bits=4)
    other = nn.Sequential(*linears([16]))
    nn.quantize(other, group_size=64, bits=4)
    assert concat_linears([packed.layers[0], other.layers[0]]) is None  # different packings
    assert concat_linears([packed.layers[0], dense[0]]) is None  # packed and dense


@pytest.fixture(scope="module")
def kernels():
    registries = load_plugins().registries
    return registries, lambda config: bind_kernels(
        registries.kernels, dtype="float32", shapes=registries.archs.get(config["model_type"]).kernel_context(config)
    )


@pytest.mark.parametrize(
    ("model_type", "expected"),
    # Two layers: attention and MLP each; phi3 is built fused already.
    [("llama", 4), ("mistral", 4), ("qwen2", 4), ("qwen3", 4), ("gemma3", 4), ("phi3", 0)],
)
def test_every_builtin_architecture_fuses_to_the_same_logits(kernels, model_type, expected):
    registries, bind = kernels
    config = {**TINY_CONFIG, "model_type": model_type}
    arch = registries.archs.get(model_type)
    plain = random_model(arch, config, bind(config))
    fused = random_model(arch, config, bind(config))
    assert fuse_model(fused) == expected
    if expected:
        names = {name for name, _ in fused.named_modules()}
        assert "model.layers.0.self_attn.qkv_proj" in names
        assert "model.layers.0.mlp.gate_up_proj" in names
        assert "model.layers.0.self_attn.q_proj" not in names
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 8, 9]])
    np.testing.assert_allclose(np.array(fused(prompt)), np.array(plain(prompt)), atol=1e-5)


def test_the_conformance_check_catches_a_broken_fused_path(kernels, monkeypatch):
    from mlxr_core.model.layers import Attention

    registries, bind = kernels
    config = {**TINY_CONFIG, "model_type": "llama"}
    original = Attention.attention_inputs

    def swapped(self, x, offset):
        queries, keys, values = original(self, x, offset)
        return (queries, values, keys) if "qkv_proj" in self else (queries, keys, values)

    monkeypatch.setattr(Attention, "attention_inputs", swapped)
    with pytest.raises(AssertionError, match="fused"):
        check_architecture(registries.archs.get("llama"), config, bind(config))


@pytest.mark.parametrize("setting", [None, True, False])
def test_the_loader_fuses_as_configured(tiny_gguf, setting):
    # By default it fuses, on every device.
    fused = setting if setting is not None else True
    extra = {} if setting is None else {"fuse_projections": setting}
    loaded = load_model(ModelConfig(path=str(tiny_gguf), dtype="float32", **extra), load_plugins().registries)
    attention = loaded.model.layers[0].self_attn
    assert ("qkv_proj" in attention) == fused and ("q_proj" in attention) != fused
    assert ("gate_up_proj" in loaded.model.layers[0].mlp) == fused
