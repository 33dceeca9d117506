"""Ministral (2024) against transformers' ``MinistralForCausalLM`` on tiny random weights: Mistral's
window only in the layers ``layer_types`` names ``sliding_attention``, the others attending to
every position (a window of 8 and 40-token prompts, so it matters). One pass, cached decoding, a
left-padded batch, prompts prefilled together and a prefix-cache hit
(:func:`~mlxr_core.testing.hf_reference.check_reference`); then what the graph cannot compute.
"""

from __future__ import annotations

import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.testing.hf_reference import check_reference, family_reference, load_reference_model

BASE = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "sliding_window": 8}
FAMILIES = {
    "mixed": ("MinistralForCausalLM", "MinistralConfig",
              {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "all sliding": ("MinistralForCausalLM", "MinistralConfig", {}),
}


@pytest.fixture(scope="module")
def registries():
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ministral_matches_transformers(family, registries, tmp_path):
    reference = family_reference(FAMILIES, BASE, family, tmp_path)
    check_reference(reference, registries)
    assert "native architecture 'ministral'" in load_reference_model(reference, registries).arch_reason


def test_a_layer_kind_the_graph_does_not_compute_is_named(registries, tmp_path):
    reference = family_reference(FAMILIES, BASE, "mixed", tmp_path)
    path = reference.folder / "config.json"
    path.write_text(path.read_text().replace('"full_attention"', '"chunked_attention"'))
    with pytest.raises(ModelLoadError, match="sliding_attention, full_attention per layer") as caught:
        load_reference_model(reference, registries)
    assert caught.value.key == "layer_types"
