"""Nemotron-H against transformers 5.25 on tiny random weights: Mamba-2, attention (no RoPE),
relu² MLP and MoE layers (sigmoid router with correction bias and groups, latent projection,
shared expert), from the config transformers writes and the released spelling
(``hybrid_override_pattern``); logits, cached decoding, batched rows, a prefix-cache hit
(:func:`~mlxr_core.testing.hf_reference.check_reference`), prompts longer than a scan chunk; and
the config fields it does not compute, refused by name. Speculative decoding over its rows is
checked in tests/core/engine/test_speculation.py."""

from __future__ import annotations

from typing import Any

import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.cache import KVCache, RecurrentCache
from mlxr_core.testing.hf_reference import (
    check_reference,
    family_reference,
    load_reference_model,
    tiny_reference,
)

BASE = {
    "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 256, "tie_word_embeddings": False, "mamba_num_heads": 8,
    "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4, "chunk_size": 16,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48,
}  # fmt: skip
#: transformers' chunked scan and its one-token step differ in float32 by ~1e-5 on these weights.
ATOL = 1e-3
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "written": ("NemotronHForCausalLM", "NemotronHConfig",
                {"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "linear_attention"]}),
    "latent_groups": ("NemotronHForCausalLM", "NemotronHConfig",
                      {"hybrid_override_pattern": "M*EM-", "moe_latent_size": 24, "n_group": 2, "topk_group": 1,
                       "routed_scaling_factor": 2.5, "use_conv_bias": False, "mlp_bias": True}),
}  # fmt: skip


@pytest.fixture(scope="module")
def registries():
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


@pytest.fixture(scope="module", params=list(FAMILIES))
def reference(request, tmp_path_factory):
    return family_reference(FAMILIES, BASE, request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_nemotron_h_matches_transformers(reference, registries, backend):
    check_reference(reference, registries, backend=backend, atol=ATOL)


def test_caches_per_layer_kind(reference, registries):
    loaded = load_reference_model(reference, registries)
    kinds = reference.config["layers_block_type"]
    for kind, cache in zip(kinds, loaded.make_cache(), strict=True):
        assert isinstance(cache, KVCache if kind == "full_attention" else RecurrentCache)


def test_prompts_longer_than_a_scan_chunk(registries, tmp_path):
    """150 tokens: the SSD scan's chunks of 64 carry the state across two boundaries."""
    pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    model_class, config_class, extra = FAMILIES["written"]
    reference = tiny_reference(model_class, config_class, {**BASE, **extra}, tmp_path, lengths=(150, 70))
    check_reference(reference, registries, backend="mlx_fast", atol=ATOL)


def test_the_released_pattern_names_the_layers():
    from mlxr_plugins.archs.nemotron_h import NemotronHArgs

    args = NemotronHArgs.from_config({"hybrid_override_pattern": "M-M*E", "hidden_size": 64})
    assert args.layers_block_type == ["linear_attention", "mlp", "linear_attention", "full_attention", "moe"]
    assert args.num_hidden_layers == 5


@pytest.mark.parametrize(
    ("keys", "key"),
    [
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
        ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
        ({"hybrid_override_pattern": "M*X"}, "hybrid_override_pattern"),
        ({"layers_block_type": ["linear_attention", "sliding_attention"]}, "layers_block_type"),
        ({"time_step_limit": [0.0]}, "time_step_limit"),
        ({"mamba_num_heads": 6, "n_groups": 4}, "n_groups"),
    ],
)
def test_fields_it_does_not_compute_are_refused_by_name(keys, key):
    from mlxr_plugins.archs.nemotron_h import NemotronHArgs

    with pytest.raises(ModelLoadError) as caught:
        NemotronHArgs.from_config({"hidden_size": 64, **keys})
    assert caught.value.key == key


def test_the_engine_serves_it_batched_as_solo(tmp_path):
    """Three concurrent greedy streams (continuous batching with Mamba, attention and
    feed-forward rows joining and leaving, chunked prefill, a one-token prompt), then a prompt
    extending a served one: each stream gets its solo tokens, the extension from the prefix cache."""
    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
    from mlxr_core.plugins import load_plugins

    reference = family_reference(FAMILIES, BASE, "written", tmp_path)
    shared = reference.prompts[0][:24]
    prompts = [[*shared, 5], reference.prompts[1], [7], [*shared, 5, 9, 8]]

    def run(**engine: Any) -> tuple[list[list[int]], Any]:
        model = ModelConfig(path=str(reference.folder), name="nemotron", dtype="float32", context_length=128)
        eng = Engine(Config(models=[model], engine=EngineConfig(**engine)), load_plugins())
        eng.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=8, extra={"ignore_eos": True})
            requests = [GenerationRequest(model="nemotron", prompt_ids=p, params=params) for p in prompts[:3]]
            outputs = []
            for handle in [eng.submit(request) for request in requests]:
                events = list(handle)
                assert isinstance(events[-1], Finished), events[-1]
                outputs.append([t for e in events if isinstance(e, Delta) for t in e.token_ids])
            events = list(eng.submit(GenerationRequest(model="nemotron", prompt_ids=prompts[3], params=params)))
            outputs.append([t for e in events if isinstance(e, Delta) for t in e.token_ids])
            return outputs, eng.stats().get("prefix_cache", {}).get("nemotron")
        finally:
            eng.stop()

    solo, _ = run(max_batch_size=1, prefix_cache=PrefixCacheConfig(enabled=False))
    batched, stats = run(max_batch_size=4, prefill_chunk=16)
    assert [len(out) for out in solo] == [8] * 4
    assert batched == solo
    assert stats["hits"] >= 1 and stats["reused_tokens"] >= 24
