"""GLM-5-Next's text model against transformers 5.25's ``Glm5NextForConditionalGeneration`` on tiny
random weights (text only), within ``index_topk`` positions (64 here; prompts of 40 and 19 tokens
and their decoding): KDA layers with the bounded forget gate, NoPE latent attention behind the
pooled indexer (pools of 4: every position kept within the cap), hyper-connections over 2 streams,
clamped SwiGLU, DeepSeek-V3's grouped router with shared experts. The folder transformers writes is
the released vision-language layout (``model.language_model.*``, the vision tower beside it). One
pass, cached decoding, a left-padded batch, a prefix-cache hit, on the reference and fast kernels
(:func:`~mlxr_core.testing.hf_reference.check_reference`); the unbounded gate; the context capped
at ``index_topk``; fields it does not compute refused by name.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.testing.hf_reference import check_reference, load_reference_model, tiny_reference

TEXT = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
        "q_lora_rank": 24, "qk_rope_head_dim": 0, "qk_nope_head_dim": 12, "v_head_dim": 10,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "max_position_embeddings": 256, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 1,
        "linear_head_dim": 16, "linear_num_heads": 4, "index_topk": 64, "index_n_heads": 2, "index_head_dim": 16,
        "index_kpool": 4, "hc_mult": 2, "hc_sinkhorn_iters": 5, "swiglu_limit": 2.0,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
          "projection_intermediate_size": 32}
#: transformers' chunked and recurrent KDA differ by ~1e-4 on such weights (test_kimi_linear.py).
ATOL = 1e-3


def reference_of(folder: Any, **text: Any) -> Any:
    pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    pytest.importorskip("transformers", reason="the reference needs transformers")
    shape = {"text_config": {**TEXT, **text}, "vision_config": VISION, "vocab_size": TEXT["vocab_size"]}
    return tiny_reference("Glm5NextForConditionalGeneration", "Glm5NextConfig", shape, folder)


@pytest.fixture(scope="module")
def registries():
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_of(tmp_path_factory.mktemp("glm5_next"))


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_glm5_next_matches_transformers_within_index_topk(reference, registries, backend):
    check_reference(reference, registries, backend=backend, atol=ATOL)
    loaded = load_reference_model(reference, registries, backend)
    assert "native architecture 'glm5_next'" in loaded.arch_reason
    assert loaded.arch.context_length(reference.config) == 64


def test_the_unbounded_forget_gate(registries, tmp_path):
    """``linear_lower_bound`` null: Kimi Linear's gate, ``-exp(A_log) * softplus(f)``."""
    check_reference(reference_of(tmp_path, linear_lower_bound=None), registries, atol=ATOL)


def test_a_flat_text_only_folder_loads(reference, registries, tmp_path):
    """The text fields at the top level (the linear layers' in ``linear_attn_config``) and the text
    model's weights under ``model.``, the vision tower's dropped: as a text-only checkpoint holds them."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((reference.folder / "config.json").read_text())
    flat = {**config.pop("text_config"), "model_type": "glm5_next_text"}
    lower = flat.pop("linear_lower_bound")
    flat["linear_attn_config"] = {"head_dim": flat.pop("linear_head_dim"), "num_heads": flat.pop("linear_num_heads"),
                                  "short_conv_kernel_size": flat.pop("linear_conv_kernel_dim"),
                                  "gate_lower_bound": lower}
    weights = {name.replace("model.language_model.", "model."): array
               for name, array in load_file(str(reference.folder / "model.safetensors")).items()
               if not name.startswith("model.visual.")}
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(flat))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((reference.folder / name).read_bytes())
    check_reference(type(reference)(tmp_path, reference.prompts, reference.logits, flat), registries, atol=ATOL)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"index_kpool_always_select_tail": False}, "index_kpool_always_select_tail"),
        ({"qk_rope_head_dim": 8}, "qk_rope_head_dim"),
        ({"index_kpool": 5}, "index_kpool"),
        ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "indexed_attention"]},
         "layer_types"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_what_the_graph_does_not_compute_is_refused_by_name(reference, change, key):
    from mlxr_plugins.archs.glm5_next import Glm5NextArchitecture

    config = json.loads((reference.folder / "config.json").read_text())
    config["text_config"].update(change)
    with pytest.raises(ModelLoadError) as caught:
        Glm5NextArchitecture().args(config)
    assert caught.value.key == key


@pytest.mark.slow  # ~60 s here: transformers' greedy tokens without a cache, KDA in torch
def test_the_engine_serves_concurrent_streams_as_transformers_decodes(reference):
    """Three greedy streams submitted together (continuous batching, prompts prefilled in chunks
    of 16, a one-token prompt): each stream's tokens are transformers'."""
    from mlxr_core.testing.hf_reference import engine_greedy, transformers_greedy

    prompts = [reference.prompts[0][:30], reference.prompts[1], [7]]
    want = transformers_greedy("Glm5NextForConditionalGeneration", reference.folder, prompts, 8)
    assert engine_greedy(reference.folder, prompts, 8, prefill_chunk=16, compiled=False) == want


def test_past_index_topk_transformers_attends_sparsely_so_the_context_stops_there(registries, tmp_path):
    """With ``index_topk`` 8 (two pools of 4), transformers' logits equal the dense graph's over the
    first 8 positions and move away once the indexer drops pools: the cap is needed."""
    import mlx.core as mx
    import numpy as np

    sparse = reference_of(tmp_path, index_topk=8)
    loaded = load_reference_model(sparse, registries)
    assert loaded.arch.context_length(sparse.config) == 8
    dense = np.array(loaded.model(mx.array([sparse.prompts[0]]))[0])
    np.testing.assert_allclose(dense[:8], sparse.logits[0][:8], atol=ATOL)
    assert np.abs(dense[12:] - sparse.logits[0][12:]).max() > 1e-2
