"""The mistral4 graph against transformers' ``Mistral4ForCausalLM`` on tiny random weights.

Two configs: one as Mistral Small 4 is built (a query bottleneck, interleaved RoPE stretched by
YaRN, 8 experts in 4 groups of which 2 are chosen from, the first layer dense, Llama 4's query
scaling stepping every 16 positions, so within the 40-token prompt) and one without the options
(``q_proj``, RoPE in halves, one group, no renormalization, every layer sparse, a smaller beta).
Each folder is written by transformers (experts fused, as it saves them) and compared on logits,
cached decoding, a left-padded batch and a prefix-cache hit; then the query scaling shown to
matter, the engine's greedy tokens, the defaults and the refusals.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.hf_reference import (
    Reference,
    check_reference,
    engine_greedy,
    family_reference,
    load_reference_model,
    transformers_greedy,
)
from mlxr_plugins.archs.mistral4 import Mistral4Args

BASE: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,  # transformers' eager attention repeats keys per this count
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 12,
    "v_head_dim": 10,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
}
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
    "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0, "llama_4_scaling_beta": 0.5,
}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "small4": (
        "Mistral4ForCausalLM",
        "Mistral4Config",
        {"q_lora_rank": 24, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
         "routed_scaling_factor": 2.0, "rope_parameters": YARN},
    ),
    "plain": (
        "Mistral4ForCausalLM",
        "Mistral4Config",
        {"q_lora_rank": None, "norm_topk_prob": False, "rope_interleave": False, "routed_scaling_factor": 1.5,
         "rope_parameters": {**YARN, "factor": 2.0, "original_max_position_embeddings": 12,
                             "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.2}},
    ),
}


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.fixture(scope="module", params=list(FAMILIES))
def reference(request, tmp_path_factory) -> Reference:
    return family_reference(FAMILIES, BASE, request.param, tmp_path_factory.mktemp(f"mistral4_{request.param}"))


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_the_family_matches_transformers(reference, registries, backend):
    """Logits, cached decoding, a left-padded batch, a prefix hit; the experts saved fused."""
    from safetensors import safe_open

    with safe_open(reference.folder / "model.safetensors", "np") as tensors:
        assert any(name.endswith("mlp.experts.gate_up_proj") for name in tensors.keys())  # noqa: SIM118
    assert np.abs(reference.logits[0]).max() > 1.0  # not a comparison of near-zero numbers
    check_reference(reference, registries, backend=backend)


def test_the_query_scaling_is_what_makes_it_match(reference, registries, tmp_path):
    """The same folder without ``llama_4_scaling_beta``: the logits past the first step (position
    ``original_max_position_embeddings``) move, those before it do not."""
    folder = tmp_path / "unscaled"
    shutil.copytree(reference.folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["llama_4_scaling_beta"] = 0.0
    original = config["rope_parameters"]["original_max_position_embeddings"]
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_reference_model(Reference(folder, reference.prompts, reference.logits, config), registries)
    got = np.array(loaded.model(mx.array([reference.prompts[0]]))[0])
    want = reference.logits[0]
    assert np.abs(got[:original] - want[:original]).max() < 1e-4
    assert np.abs(got[original:] - want[original:]).max() > 1e-2


def older_layout(reference: Reference, folder: Path) -> None:
    """``reference``'s folder as a converter writes it: ``rope_theta`` and ``rope_scaling`` (with
    ``type``) at the top, no ``head_dim``, and one tensor per expert and projection."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(reference.folder, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.pop("head_dim")
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling={**rope, "type": rope.pop("rope_type")})
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".mlp.experts.gate_up_proj")]:
        stem = name.removesuffix("gate_up_proj")
        fused, down = tensors.pop(name), tensors.pop(stem + "down_proj")
        width = fused.shape[1] // 2
        for e in range(fused.shape[0]):
            tensors[f"{stem}{e}.gate_proj.weight"] = np.ascontiguousarray(fused[e, :width])
            tensors[f"{stem}{e}.up_proj.weight"] = np.ascontiguousarray(fused[e, width:])
            tensors[f"{stem}{e}.down_proj.weight"] = np.ascontiguousarray(down[e])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_the_older_layout_matches_transformers(reference, registries, tmp_path):
    """The same model with the RoPE settings at the top and the experts one tensor each."""
    older_layout(reference, tmp_path / "older")
    check_reference(Reference(tmp_path / "older", reference.prompts, reference.logits, reference.config), registries)


@pytest.mark.slow
def test_the_engine_serves_transformers_greedy_tokens(reference):
    """Three concurrent greedy streams of 12 tokens through the engine (continuous batching, the
    compiled decode step with its per-row positions, chunked prefill) give transformers' tokens."""
    prompts = [reference.prompts[0], reference.prompts[1], [7]]
    want = transformers_greedy("Mistral4ForCausalLM", reference.folder, prompts, 12)
    assert engine_greedy(reference.folder, prompts, 12) == want


def test_a_config_without_rope_settings_is_mistrals_yarn():
    """No RoPE keys: ``Mistral4Config``'s YaRN and query scaling, as transformers fills them in."""
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    expected = transformers.Mistral4Config().rope_parameters
    args = Mistral4Args.from_config({key: BASE[key] for key in ("vocab_size", "hidden_size", "intermediate_size",
                                                                "num_hidden_layers", "num_attention_heads")})
    scaling = args.rope_scaling or {}
    for key in ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                "mscale", "mscale_all_dim", "llama_4_scaling_beta"):
        assert scaling[key] == expected[key], key
    assert args.rope_theta == expected["rope_theta"]
    scale = args.query_scale()
    assert scale is not None and (scale.beta, scale.original) == (0.1, 8192)
    assert (args.scoring_func, args.n_group, args.routed_scaling_factor) == ("softmax", 1, 1.0)


@pytest.mark.parametrize(
    ("change", "key", "message"),
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_scaling", "'default' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act", "hidden_act 'gelu' is not supported"),
        ({"rope_parameters": {**YARN, "partial_rotary_factor": 0.8}}, "partial_rotary_factor", "does not rotate"),
        ({"rope_parameters": {**YARN, "llama_4_scaling_beta": "x"}}, "rope_parameters.llama_4_scaling_beta",
         "not a finite number"),
        ({"n_group": 3}, "n_group", "does not divide"),
    ],
)
def test_configs_it_does_not_compute_are_refused(change, key, message):
    from mlxr_core.kernels import bind_kernels
    from mlxr_plugins.archs.mistral4 import Mistral4Architecture

    config = {**BASE, **FAMILIES["small4"][2], **change}
    arch = Mistral4Architecture()
    with pytest.raises(ModelLoadError, match=message) as raised:
        kernels = bind_kernels(load_plugins().registries.kernels, dtype="float32", shapes=arch.kernel_context(config))
        arch.build(config, kernels)
    assert raised.value.key == key
