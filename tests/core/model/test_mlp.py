"""Gated MLPs (``mlxr_core.model.layers.mlp``) and their activation through the bound kernel."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.config.schema import ModelConfig
from mlxr_core.model.layers import GatedMLP, geglu
from mlxr_core.model.layers.mlp import route_gated_activations
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins
from mlxr_plugins.kernels import reference


def recording(calls):
    def gated_activation(gate, up, *, activation):
        calls.append((activation, gate.shape, up.shape))
        return reference.gated_activation(gate, up, activation=activation)

    return gated_activation


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("activation", "kind"), [(None, "silu"), (geglu, "gelu_tanh")])
def test_a_routed_mlp_computes_its_activation_with_the_kernel(fused, activation, kind):
    mx.random.seed(3)
    kwargs = {} if activation is None else {"activation": activation}
    mlp = GatedMLP(32, 48, **kwargs)
    x = mx.random.normal((2, 3, 32))
    if fused:
        assert mlp.fuse_projections()
    want = np.array(mlp(x))
    calls = []
    assert route_gated_activations(mlp, recording(calls)) == 1
    np.testing.assert_allclose(np.array(mlp(x)), want, rtol=1e-5, atol=1e-6)
    # Fused or not, the kernel gets the two [.., inner] branches (halves of one output when fused).
    assert calls == [(kind, (2, 3, 48), (2, 3, 48))]


def test_an_architecture_s_own_activation_is_not_routed():
    def clamped(gate, up):
        return mx.clip(gate, None, 1.0) * up

    mlp = GatedMLP(16, 16, activation=clamped)
    calls = []
    assert route_gated_activations(mlp, recording(calls)) == 0
    mlp(mx.ones((1, 16)))
    assert calls == []


def test_the_loader_routes_every_mlp_through_the_bound_kernel(tiny_gguf):
    for choice in ("reference", "mlx_fast"):
        loaded = load_model(ModelConfig(path=str(tiny_gguf), dtype="float32"), load_plugins().registries,
                            kernel_choices={"gated_activation": choice})
        assert loaded.kernels.chosen["gated_activation"] == choice
        activations = [layer.mlp._activation for layer in loaded.model.layers]
        assert all(isinstance(act, partial) and act.func is loaded.kernels.gated_activation for act in activations)
        assert {act.keywords["activation"] for act in activations} == {"silu"}
