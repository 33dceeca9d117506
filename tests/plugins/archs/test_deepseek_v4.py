"""DeepSeek-V4 against transformers 5.25's ``DeepseekV4ForCausalLM`` on tiny random weights.

Three layers, one of each attention kind (a sliding window of 8, compressed-sparse entries of 4
positions, heavily compressed entries of 8), a hash-routed first layer, three residual streams,
grouped output projections. One pass, cached decoding across window boundaries, a left-padded
batch, prompts prefilled together and a prefix-cache hit (:func:`check_reference`): with an
``index_topk`` no query reaches, and with one that leaves each query its 3 best entries; YaRN on
the compressed layers as a released config spells it; released spellings of the per-layer lists;
what the graph does not compute refused naming the key.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.testing.hf_reference import (
    check_reference,
    engine_greedy,
    load_reference_model,
    o1_init,
    tiny_reference,
    transformers_greedy,
)

BASE: dict[str, Any] = {
    "vocab_size": 97, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 24,
    "partial_rotary_factor": 0.25, "n_routed_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8,
    "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 16,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe"], "hc_mult": 3, "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}


def init(model: Any, torch: Any) -> None:
    """O(1) weights (the hyper-connections' scales kept at 1), each token's hash experts distinct,
    a correction bias that moves the learned choice."""
    o1_init(model, torch, skip=lambda name: name.endswith(".scale") or name.endswith("hc_scale"))
    generator = torch.Generator().manual_seed(3)
    experts = model.config.n_routed_experts
    for name, buffer in model.named_buffers():
        if name.endswith("tid2eid"):
            rows = [torch.randperm(experts, generator=generator)[: buffer.shape[1]] for _ in buffer]
            buffer.copy_(torch.stack(rows))
        elif name.endswith("e_score_correction_bias"):
            buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))


def reference(folder: Any, **extra: Any) -> Any:
    pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    pytest.importorskip("transformers", reason="the reference needs transformers")
    return tiny_reference("DeepseekV4ForCausalLM", "DeepseekV4Config", {**BASE, **extra}, folder, init=init)


@pytest.fixture(scope="module")
def registries():
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("v4"))


def test_v4_matches_transformers(v4, registries):
    check_reference(v4, registries)
    loaded = load_reference_model(v4, registries)
    assert "native architecture 'deepseek_v4'" in loaded.arch_reason
    assert loaded.arch.context_length(v4.config) == 256


@pytest.mark.slow
def test_the_engine_serves_transformers_greedy_tokens(registries, tmp_path):
    """Four concurrent greedy streams of 12 tokens through the engine (continuous batching, prompts
    prefilled in chunks of 24, a one-token prompt, a prompt extending a cached one), the indexer
    choosing 3 entries a query, give transformers' tokens for each prompt. The hyper-connections'
    blocks do not take the compiled step's cut, so the engine decodes eagerly."""
    made = reference(tmp_path, index_topk=3, index_n_heads=8)
    prompts = [made.prompts[0], made.prompts[1], [7], [*made.prompts[0][:30], 5, 9]]
    want = transformers_greedy("DeepseekV4ForCausalLM", made.folder, prompts, 12)
    assert engine_greedy(made.folder, prompts, 12, compiled=False) == want


def test_the_kv_budget_and_info_count_what_each_layer_keeps(v4, registries):
    """A position's numbers: the sliding layer's key (32); the compressed-sparse layer's
    key, its compressor's two series of kv and gate (4 x 32) and its indexer's (4 x 16); the heavily
    compressed layer's key and its compressor's kv and gate (3 x 32). Quantized keys are refused."""
    from mlxr_core.cli.info import describe_model
    from mlxr_core.config.schema import KVCacheConfig, ModelConfig
    from mlxr_core.engine.batch import kv_bytes_per_token
    from mlxr_core.errors import ConfigError
    from mlxr_core.model.loader import load_model

    per_token = (32 + (32 + 4 * 32 + 4 * 16) + 3 * 32) * 4
    assert kv_bytes_per_token(load_reference_model(v4, registries)) == per_token
    facts = describe_model(str(v4.folder), dtype="float32")
    assert facts["architecture"] == "deepseek_v4" and facts["kv_bytes_per_token"] == per_token
    config = ModelConfig(path=str(v4.folder), dtype="float32", kv_cache=KVCacheConfig(bits=8))
    with pytest.raises(ConfigError, match="reads its cache itself"):
        load_model(config, registries)


def test_yarn_on_the_compressed_layers_from_a_released_config(registries, tmp_path):
    # A flat rope_scaling reaches the compress RoPE only, without YaRN's attention factor.
    made = reference(tmp_path, rope_parameters={**YARN, "rope_theta": 10000.0})
    assert made.config["rope_parameters"]["compress"]["rope_type"] == "yarn"
    check_reference(made, registries)


def test_released_spellings_read_as_transformers_folds_them(v4, registries):
    from mlxr_plugins.archs.deepseek_v4_args import DeepseekV4Args

    released = {key: value for key, value in v4.config.items()
                if key not in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters",
                               "partial_rotary_factor")}
    released.update(compress_ratios=[0, 4, 128], num_hash_layers=1, qk_rope_head_dim=8,
                    compress_rate_hca=8, rope_scaling={**{k: v for k, v in YARN.items() if k != "rope_type"}, "type": "yarn"})
    args = DeepseekV4Args.from_config(released)
    assert args.layer_types == BASE["layer_types"] and args.mlp_layer_types == BASE["mlp_layer_types"]
    assert args.compress_rates == BASE["compress_rates"] and args.rope_dims == 8
    compress = args.resolve_ropes()["compress"]
    assert compress["rope_type"] == "yarn" and compress["rope_theta"] == 160000.0
    assert compress["attention_factor"] == 1.0


def test_the_indexer_keeps_each_query_s_best_entries_as_transformers_does(registries, tmp_path):
    # 3 entries of 4 positions a query: from position 15 on, each query sees only its 3 best. Eight
    # heads, so that no two entries tie (with two, every head's ReLU was 0 for several entries of
    # one query, and which of the equal scores torch.topk keeps is its own affair).
    check_reference(reference(tmp_path, index_topk=3, index_n_heads=8), registries)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("scoring_func", "softmax", "not computed"),
        ("layer_types", ["sliding_attention", "full_attention", "sliding_attention"], "one of"),
        ("rope_parameters", {"main": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                             "compress": {"rope_type": "default", "rope_theta": 1.6e5}}, "linear"),
        ("n_shared_experts", 2, "integer in"),
        ("mlp_bias", True, "not computed"),
        ("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"}, "fp4"),
    ],
)
def test_what_the_graph_does_not_compute_is_named(v4, registries, key, value, match):
    path = v4.folder / "config.json"
    saved = path.read_text()
    config = json.loads(saved)
    config[key] = value
    path.write_text(json.dumps(config))
    try:
        with pytest.raises(ModelLoadError, match=match) as caught:
            load_reference_model(v4, registries)
        assert caught.value.key.startswith(key)
    finally:
        path.write_text(saved)
