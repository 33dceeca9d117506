"""Every registered architecture passes the shared conformance check on tiny random weights."""

from __future__ import annotations

import pytest

from mlxr_core.kernels import OPS, bind_kernels
from mlxr_core.model.audio import ProvidesSpeech
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.conformance import TINY_CONFIG, check_architecture, tiny_config

REGISTRIES = load_plugins().registries


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
@pytest.mark.parametrize("model_type", REGISTRIES.archs.names())
def test_architecture_conforms(model_type, backend):
    arch = REGISTRIES.archs.get(model_type)
    if isinstance(arch, ProvidesSpeech):
        pytest.skip("a speech-to-text model continues no text prompt; tests/plugins/archs/test_whisper.py checks it")
    config = tiny_config(model_type)
    kernels = bind_kernels(
        REGISTRIES.kernels,
        dtype="float32",
        shapes=arch.kernel_context(config),
        choices=dict.fromkeys(OPS, backend),
    )
    check_architecture(arch, config, kernels)


def test_a_broken_cache_is_caught():
    """The check fails an architecture whose cache forgets positions."""
    from mlxr_core.model.cache import KVCache

    class Forgetful(KVCache):
        def update_and_fetch(self, keys, values):
            super().update_and_fetch(keys, values)
            return keys, values  # only the new positions

    arch = REGISTRIES.archs.get("llama")

    class Broken(type(arch)):  # type: ignore[misc]
        def make_cache(self, model):
            return [Forgetful() for _ in model.layers]

    config = {**TINY_CONFIG, "model_type": "llama"}
    kernels = bind_kernels(REGISTRIES.kernels, dtype="float32", shapes=arch.kernel_context(config))
    with pytest.raises(AssertionError, match="cached decoding"):
        check_architecture(Broken(), config, kernels)


def test_hidden_states_that_ignore_the_cache_are_caught():
    """The check fails an architecture whose hidden states forget earlier chunks."""
    arch = REGISTRIES.archs.get("llama")

    class Broken(type(arch)):  # type: ignore[misc]
        def hidden_states(self, model, inputs, cache=None):
            return super().hidden_states(model, inputs)  # each chunk alone

    config = {**TINY_CONFIG, "model_type": "llama"}
    kernels = bind_kernels(REGISTRIES.kernels, dtype="float32", shapes=arch.kernel_context(config))
    with pytest.raises(AssertionError, match="hidden states computed in chunks"):
        check_architecture(Broken(), config, kernels)
