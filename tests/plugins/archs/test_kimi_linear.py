"""Kimi Linear against transformers 5.25's ``KimiLinearForCausalLM`` on tiny random weights: KDA
layers (the ``kimi_delta`` op) between NoPE latent-attention layers, DeepSeek-V3's grouped
sigmoid router with shared experts, a dense first layer. The folder transformers writes is the
released layout (``block_sparse_moe``, per-expert ``w1``/``w2``/``w3``, three convolutions, the
forget gate on the layer); its config transformers 5's. One pass, cached decoding past the
convolution's window, a left-padded batch, a prefix-cache hit, on the reference and the fast
kernels (:func:`~mlxr_core.testing.hf_reference.check_reference`); the released config's spelling
(``linear_attn_config``); the engine's batched streams equal to solo; fields it does not compute
refused by name.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.testing.hf_reference import check_reference, family_reference, load_reference_model

BASE = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": None,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10, "num_local_experts": 8,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 0,
        "eos_token_id": 1, "linear_head_dim": 16, "linear_num_heads": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"]}
#: transformers' chunked and recurrent forms of the recurrence differ by ~1e-4 on such weights
#: (as Qwen3-Next's do: tests/plugins/archs/test_hybrid_reference.py).
ATOL = 1e-3
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "kimi_linear": ("KimiLinearForCausalLM", "KimiLinearConfig", {}),
    "q_lora": ("KimiLinearForCausalLM", "KimiLinearConfig", {"q_lora_rank": 24}),
}


@pytest.fixture(scope="module")
def registries():
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return family_reference(FAMILIES, BASE, "kimi_linear", tmp_path_factory.mktemp("kimi"))


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_kimi_linear_matches_transformers(reference, registries, backend):
    check_reference(reference, registries, backend=backend, atol=ATOL)
    loaded = load_reference_model(reference, registries, backend)
    assert "native architecture 'kimi_linear'" in loaded.arch_reason
    assert loaded.kernels.chosen["kimi_delta"] == backend


def test_queries_through_a_low_rank_bottleneck(registries, tmp_path):
    check_reference(family_reference(FAMILIES, BASE, "q_lora", tmp_path), registries, atol=ATOL)


def released_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config as the released checkpoint spells it: the linear layers in ``linear_attn_config``
    (1-based), no per-layer lists, the MoE keys under their released names."""
    config = {key: value for key, value in config.items()
              if key not in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads",
                             "linear_conv_kernel_dim")}
    kinds = BASE["layer_types"]
    config["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "linear_attention"],
        "full_attn_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "full_attention"],
        "head_dim": BASE["linear_head_dim"], "num_heads": BASE["linear_num_heads"], "short_conv_kernel_size": 4,
    }
    config.update(first_k_dense_replace=1, moe_router_activation_func="sigmoid", mla_use_nope=True,
                  rope_theta=10000.0, rope_scaling=None)
    return config


def test_the_released_config_spelling_loads(reference, registries, tmp_path):
    config = json.loads((reference.folder / "config.json").read_text())
    (reference.folder / "config.json").write_text(json.dumps(released_config(config)))
    try:
        check_reference(reference, registries, atol=ATOL)
    finally:
        (reference.folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"mla_use_output_gate": True}, "mla_use_output_gate"),
        ({"hidden_act": "situ"}, "hidden_act"),
        ({"linear_attn_config": {"use_full_rank_gate": True}}, "linear_attn_config.use_full_rank_gate"),
        ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention"]}, "layer_types"),
        ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
        ({"linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [4]}, "layer_types": None},
         "linear_attn_config.full_attn_layers"),
    ],
)
def test_what_the_graph_does_not_compute_is_refused_by_name(reference, change, key):
    from mlxr_plugins.archs.kimi_linear import KimiLinearArchitecture

    config = {**json.loads((reference.folder / "config.json").read_text()), **change}
    with pytest.raises(ModelLoadError) as caught:
        KimiLinearArchitecture().args(config)
    assert caught.value.key == key


@pytest.mark.slow  # ~60 s here: transformers' greedy tokens without a cache, KDA in torch
def test_the_engine_serves_concurrent_streams_as_transformers_decodes(reference):
    """Four greedy streams submitted together (continuous batching, prompts prefilled in chunks of
    16, a one-token prompt, two sharing a 24-token prefix): each stream's tokens are
    transformers'."""
    from mlxr_core.testing.hf_reference import engine_greedy, transformers_greedy

    shared = reference.prompts[0][:24]
    prompts = [[*shared, 5], reference.prompts[1], [7], [*shared, 5, 9, 8]]
    want = transformers_greedy("KimiLinearForCausalLM", reference.folder, prompts, 8)
    assert engine_greedy(reference.folder, prompts, 8, prefill_chunk=16, compiled=False) == want


def test_a_missing_convolution_is_named(reference, registries, tmp_path):
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(reference.folder / "model.safetensors"))
    del weights["model.layers.2.self_attn.k_conv1d.weight"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((reference.folder / name).read_bytes())
    save_file(weights, str(tmp_path / "model.safetensors"))
    broken = type(reference)(tmp_path, reference.prompts, reference.logits, reference.config)
    with pytest.raises(ModelLoadError) as caught:
        load_reference_model(broken, registries)
    assert caught.value.tensor == "model.layers.2.self_attn.k_conv1d.weight"
