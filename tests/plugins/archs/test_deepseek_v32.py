"""DeepSeek-V3.2 against transformers 5.25's ``DeepseekV32ForCausalLM`` on tiny random weights,
within ``index_topk`` positions (64 here; prompts of 40 and 19 tokens and their decoding): the
indexer keeps every position there, so V3's latent attention computes what transformers does. One
pass, cached decoding, a left-padded batch, a prefix-cache hit, YaRN and grouped routing
(:func:`~mlxr_core.testing.hf_reference.check_reference`); the context capped at ``index_topk``
(past it transformers attends sparsely: shown on the same weights with a smaller ``index_topk``);
the dense layers where ``mlp_layer_types`` puts them; a layer kind the graph does not compute
refused naming ``layer_types``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.testing.hf_reference import check_reference, family_reference, load_reference_model

BASE = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
        "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10, "head_dim": 8,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "first_k_dense_replace": 1, "max_position_embeddings": 256, "tie_word_embeddings": False,
        "index_n_heads": 2, "index_head_dim": 16}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
FAMILIES = {
    "within the cap": ("DeepseekV32ForCausalLM", "DeepseekV32Config", {"index_topk": 64, "rope_parameters": YARN}),
    "sparse": ("DeepseekV32ForCausalLM", "DeepseekV32Config", {"index_topk": 8, "rope_parameters": YARN}),
    # transformers builds the layers mlp_layer_types lists, whatever first_k_dense_replace says.
    "listed": ("DeepseekV32ForCausalLM", "DeepseekV32Config",
               {"index_topk": 64, "mlp_layer_types": ["dense", "dense", "sparse"]}),
}


@pytest.fixture(scope="module")
def registries():
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return family_reference(FAMILIES, BASE, "within the cap", tmp_path_factory.mktemp("v32"))


def test_v32_matches_transformers_within_index_topk(reference, registries):
    check_reference(reference, registries)
    loaded = load_reference_model(reference, registries)
    assert "native architecture 'deepseek_v32'" in loaded.arch_reason
    assert loaded.arch.context_length(reference.config) == 64


def test_the_dense_layers_are_those_mlp_layer_types_lists(registries, tmp_path):
    check_reference(family_reference(FAMILIES, BASE, "listed", tmp_path), registries)


def test_past_index_topk_transformers_attends_sparsely_so_the_context_stops_there(registries, tmp_path):
    import mlx.core as mx

    sparse = family_reference(FAMILIES, BASE, "sparse", tmp_path)
    loaded = load_reference_model(sparse, registries)
    assert loaded.arch.context_length(sparse.config) == 8
    ids = sparse.prompts[1]
    dense = np.array(loaded.model(mx.array([ids]))[0])
    np.testing.assert_allclose(dense[:8], sparse.logits[1][:8], atol=1e-4)
    assert np.abs(dense[8:] - sparse.logits[1][8:]).max() > 1e-2


def test_a_layer_kind_the_graph_does_not_compute_is_named(reference, registries):
    path = reference.folder / "config.json"
    saved = path.read_text()
    config = json.loads(saved)
    config["layer_types"][1] = "full_attention"
    path.write_text(json.dumps(config))
    try:
        with pytest.raises(ModelLoadError, match="indexed_attention in each of its 3 layers") as caught:
            load_reference_model(reference, registries)
        assert caught.value.key == "layer_types"
    finally:
        path.write_text(saved)
