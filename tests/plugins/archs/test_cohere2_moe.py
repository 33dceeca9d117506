"""The cohere2_moe graph against transformers' ``Cohere2MoeForCausalLM`` on tiny random weights.

Two configs, 4 layers, a window of 8 under 40-token prompts: one as Command A's MoE is built
(Cohere's LayerNorm, a dense first layer that rotates though it attends globally, sliding and
global layers alternating, a shared expert averaged with the softmax-weighted routed ones, tied
embeddings) and one with the other options (RMS norms, a sigmoid router without renormalization,
two shared experts added, biased projections, two dense prefix layers of which the global one
does not rotate, an LM head of its own). Each folder is written by transformers and compared on
logits, cached decoding, a left-padded batch, prompts prefilled together and a prefix-cache hit;
then the config as older writers give it (no per-layer lists, ``rope_theta`` at the top), the
engine's greedy tokens and the refusals.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import numpy as np
import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.hf_reference import (
    Reference,
    check_reference,
    engine_greedy,
    family_reference,
    transformers_greedy,
)
from mlxr_plugins.archs.cohere2_moe import Cohere2MoeArgs

BASE: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
    "eos_token_id": 1,
}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "command": (
        "Cohere2MoeForCausalLM",
        "Cohere2MoeConfig",
        {"first_k_dense_replace": 1, "prefix_dense_intermediate_size": 48, "sliding_window_pattern": 2,
         "num_shared_experts": 1, "logit_scale": 0.5},
    ),
    "options": (
        "Cohere2MoeForCausalLM",
        "Cohere2MoeConfig",
        {"rms_norm_eps": 1e-5, "expert_selection_fn": "sigmoid", "norm_topk_prob": False, "num_shared_experts": 2,
         "shared_expert_combination_strategy": "sum", "attention_bias": True, "first_k_dense_replace": 2,
         "prefix_dense_sliding_window_pattern": 2, "logit_scale": 0.25, "tie_word_embeddings": False},
    ),
}


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.fixture(scope="module", params=list(FAMILIES))
def reference(request, tmp_path_factory) -> Reference:
    return family_reference(FAMILIES, BASE, request.param, tmp_path_factory.mktemp(f"cohere2_moe_{request.param}"))


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_the_family_matches_transformers(reference, registries, backend):
    """Logits, cached decoding, a left-padded batch, prompts prefilled together, a prefix hit."""
    config = reference.config
    assert config["layer_types"].count("sliding_attention") >= 1 and "full_attention" in config["layer_types"]
    assert np.abs(reference.logits[0]).max() > 0.5  # not a comparison of near-zero numbers
    check_reference(reference, registries, backend=backend)


def test_a_config_without_the_per_layer_lists_matches(reference, registries, tmp_path):
    """``first_k_dense_replace`` and the window patterns instead of ``layer_types`` and
    ``mlp_layer_types`` (derived as ``Cohere2MoeConfig`` does), ``rope_theta`` at the top."""
    folder = tmp_path / "older"
    shutil.copytree(reference.folder, folder)
    config = json.loads((folder / "config.json").read_text())
    dense = config["mlp_layer_types"].count("dense")
    for key in ("layer_types", "mlp_layer_types", "rope_parameters"):
        config.pop(key)
    config.update(first_k_dense_replace=dense, rope_theta=BASE["rope_parameters"]["rope_theta"])
    (folder / "config.json").write_text(json.dumps(config))
    check_reference(Reference(folder, reference.prompts, reference.logits, config), registries)


def test_packed_weights_stay_close(reference, registries):
    """``quantization: q8`` (the projections and experts packed where their widths allow; the norms
    stay float): near the float32 reference, nearly every greedy choice kept, prompt and cache."""
    import mlx.core as mx

    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model

    loaded = load_model(ModelConfig(path=str(reference.folder), dtype="float32", quantization="q8"), registries)
    packed = {type(module).__name__ for _, module in loaded.model.named_modules()}
    assert {"KernelQuantizedLinear", "QuantizedSwitchLinear"} <= packed
    for ids, want in zip(reference.prompts, reference.logits, strict=True):
        cache = loaded.make_cache()
        got = np.array(mx.concatenate([loaded.model(mx.array([ids[:8]]), cache=cache),
                                       loaded.model(mx.array([ids[8:]]), cache=cache)], axis=1)[0])
        assert np.abs(got - want).mean() < 0.03 * np.abs(want).max()
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8


@pytest.mark.slow
def test_the_engine_serves_transformers_greedy_tokens(reference):
    """Three concurrent greedy streams of 12 tokens through the engine (continuous batching, the
    compiled decode step through the parallel blocks, chunked prefill) give transformers' tokens."""
    prompts = [reference.prompts[0], reference.prompts[1], [7]]
    want = transformers_greedy("Cohere2MoeForCausalLM", reference.folder, prompts, 12)
    assert engine_greedy(reference.folder, prompts, 12) == want


@pytest.mark.parametrize(
    ("change", "key", "message"),
    [
        ({"expert_selection_fn": "sparsemax"}, "expert_selection_fn", "computes softmax or sigmoid"),
        ({"shared_expert_combination_strategy": "gate"}, "shared_expert_combination_strategy", "sum or average"),
        ({"layer_types": ["chunked_attention"] * 4}, "layer_types", "for each of the 4 layers"),
        ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types", "for each of the 4 layers"),
        ({"sliding_window": None}, "sliding_window", "need a sliding_window"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor", "rotates whole heads"),
        ({"hidden_act": "gelu"}, "hidden_act", "computes only 'silu'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_scaling",
         "'yarn' is not supported"),
    ],
)
def test_configs_it_does_not_compute_are_refused(change, key, message):
    from mlxr_core.kernels import bind_kernels
    from mlxr_plugins.archs.cohere2_moe import Cohere2MoeArchitecture

    config = {**BASE, **FAMILIES["command"][2], **change}
    arch = Cohere2MoeArchitecture()
    with pytest.raises(ModelLoadError, match=message) as raised:
        kernels = bind_kernels(load_plugins().registries.kernels, dtype="float32", shapes=arch.kernel_context(config))
        arch.build(config, kernels)
    assert raised.value.key == key


def test_the_defaults_are_cohere2_moe_configs():
    """A config of the required keys reads as ``Cohere2MoeConfig``'s defaults."""
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    required = {key: BASE[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads")}
    expected = transformers.Cohere2MoeConfig(**required)
    args = Cohere2MoeArgs.from_config(required)
    for key in ("head_dim", "layer_norm_eps", "rms_norm_eps", "logit_scale", "sliding_window", "num_experts",
                "num_experts_per_tok", "num_shared_experts", "shared_expert_combination_strategy",
                "expert_selection_fn", "layer_types", "mlp_layer_types", "tie_word_embeddings"):
        assert getattr(args, key) == getattr(expected, key), key
    assert args.rope_theta == expected.rope_parameters["rope_theta"]
