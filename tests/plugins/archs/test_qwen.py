"""The qwen2 and qwen3 graphs on tiny random weights: structure, caches, kernels, config handling.

Correctness against transformers is in ``test_hf_reference.py``; this file checks behaviour.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import OPS, bind_kernels
from mlxr_core.plugins import load_plugins
from mlxr_plugins.archs.qwen2 import Qwen2Architecture
from mlxr_plugins.archs.qwen3 import Qwen3Architecture

BASE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 50,
    "max_position_embeddings": 1024,
}
QWEN2 = {**BASE, "model_type": "qwen2", "tie_word_embeddings": True, "rope_theta": 1e6}
QWEN3 = {**BASE, "model_type": "qwen3", "head_dim": 16}
ARCHS = {"qwen2": (Qwen2Architecture(), QWEN2), "qwen3": (Qwen3Architecture(), QWEN3)}


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


def build(
    registries, name: str, backend: str = "mlx_fast", config: dict | None = None
) -> nn.Module:
    """The graph with random O(1)-logit weights, the same for every backend (fixed key)."""
    arch, default = ARCHS[name]
    config = config or default
    kernels = bind_kernels(
        registries.kernels,
        dtype="float32",
        shapes=arch.kernel_context(config),
        choices=dict.fromkeys(OPS, backend),
    )
    model = arch.build(config, kernels)
    keys = iter(mx.random.split(mx.random.key(7), len(tree_flatten(model.parameters()))))
    model.update(
        tree_map(lambda p: mx.random.normal(p.shape, key=next(keys)) * 0.3, model.parameters())
    )
    mx.eval(model.parameters())
    return model


def parameter_names(model: nn.Module) -> set[str]:
    return {name for name, _ in tree_flatten(model.parameters())}


def test_registered_through_the_archs_plugin(registries):
    assert {"qwen2", "qwen3"} <= set(registries.archs.names())
    assert isinstance(registries.archs.get("qwen3"), Qwen3Architecture)


def test_qwen2_has_qkv_biases_and_no_output_bias(registries):
    names = parameter_names(build(registries, "qwen2"))
    attention = {
        n.removeprefix("model.layers.0.self_attn.") for n in names if "layers.0.self_attn" in n
    }
    assert attention == {
        "q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
        "v_proj.weight", "v_proj.bias", "o_proj.weight",
    }  # fmt: skip
    assert "lm_head.weight" not in names  # tied


def test_qwen3_has_per_head_norms_and_its_own_head_dim(registries):
    model = build(registries, "qwen3")
    attention = model.layers[0].self_attn
    assert attention.q_norm.weight.shape == (16,) and attention.k_norm.weight.shape == (16,)
    assert attention.q_proj.weight.shape == (4 * 16, 32) and "bias" not in attention.q_proj
    assert "lm_head.weight" in parameter_names(model)


def test_qwen3_attention_bias_puts_a_bias_on_all_four_projections(registries):
    model = build(registries, "qwen3", config={**QWEN3, "attention_bias": True})
    attention = model.layers[1].self_attn
    assert all("bias" in getattr(attention, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))


def test_qwen3_head_dim_defaults_to_128_as_in_transformers():
    config = {key: value for key, value in QWEN3.items() if key != "head_dim"}
    assert Qwen3Architecture().kernel_context(config)["head_dim"] == 128
    assert Qwen2Architecture().kernel_context(QWEN2)["head_dim"] == 8


@pytest.mark.parametrize("name", ARCHS)
def test_kernel_backends_give_the_same_logits(registries, name):
    ids = mx.array([[3, 17, 42, 5, 49, 0, 7, 8, 25, 11]])
    fast = build(registries, name, "mlx_fast")(ids)
    reference = build(registries, name, "reference")(ids)
    assert float(mx.abs(fast).max()) > 1.0  # the comparison is not between near-zero numbers
    np.testing.assert_allclose(np.array(fast), np.array(reference), atol=1e-4)


@pytest.mark.parametrize("name", ARCHS)
def test_cached_chunks_match_one_full_pass(registries, name):
    model = build(registries, name)
    arch, _ = ARCHS[name]
    ids = mx.array([[i % 50 for i in range(300)]])  # crosses the cache's 256-position step
    full = model(ids)
    cache = arch.make_cache(model)
    pieces, start = [], 0
    for size in (120, 1, 170, 1, 8):
        pieces.append(model(ids[:, start : start + size], cache=cache))
        start += size
    assert cache[0].offset == 300
    np.testing.assert_allclose(np.array(mx.concatenate(pieces, axis=1)), np.array(full), atol=2e-4)


def test_sanitize_drops_rotary_tables_and_a_tied_head():
    weights = {
        "model.layers.0.self_attn.rotary_emb.inv_freq": mx.ones((4,)),
        "lm_head.weight": mx.ones((50, 32)),
        "model.norm.weight": mx.ones((32,)),
    }
    assert list(Qwen2Architecture().sanitize(weights, QWEN2)) == ["model.norm.weight"]
    assert "lm_head.weight" in Qwen3Architecture().sanitize(weights, QWEN3)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, 1024),
        # transformers 4 wrote sliding_window even when it is off: it must not cap the context.
        ({"sliding_window": 128, "use_sliding_window": False}, 1024),
        ({"sliding_window": 128, "use_sliding_window": True, "max_window_layers": 1}, 128),
        ({"sliding_window": 128, "use_sliding_window": True, "max_window_layers": 28}, 1024),
        ({"sliding_window": 128, "layer_types": ["full_attention", "sliding_attention"]}, 128),
        ({"sliding_window": 128, "layer_types": ["full_attention", "full_attention"]}, 1024),
    ],
)
def test_context_length_counts_a_sliding_window_only_where_layers_use_it(extra, expected):
    for arch, config in ARCHS.values():
        assert arch.context_length({**config, **extra}) == expected


def test_missing_config_keys_are_named():
    config = {key: value for key, value in QWEN2.items() if key != "hidden_size"}
    with pytest.raises(ModelLoadError, match="lacks hidden_size"):
        Qwen2Architecture().context_length(config)


def test_unknown_config_keys_are_ignored(registries):
    model = build(
        registries, "qwen2", config={**QWEN2, "layer_types": ["full_attention"] * 2, "future": 1}
    )
    assert model(mx.array([[1, 2]])).shape == (1, 2, 50)
