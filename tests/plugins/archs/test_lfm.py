"""LFM2 and LFM3 against transformers on tiny random weights: short gated convolutions among
attention layers (LFM3: sliding-window and full attention with per-type RoPE, the proportional
kind on full layers, a sigmoid gate per head, sandwich norms).

Each folder is written by transformers, loaded through mlxr's safetensors format and loader and
compared on logits, cached decoding over more steps than the convolution's taps, a batch of rows
of different lengths and a prefix-cache hit (:func:`mlxr_core.testing.hf_reference.check_reference`),
then a draft's rollback per row, and configs that ask for math the graph does not compute.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.cache import RecurrentCache
from mlxr_core.testing.hf_reference import (
    check_reference,
    family_reference,
    load_reference_model,
    o1_init,
    tiny_reference,
)

BASE = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "lfm3": ("Lfm3ForCausalLM", "Lfm3Config", {
        "head_dim": 16, "sliding_window": 8, "conv_L_cache": 5,
        "layer_types": ["conv", "sliding_attention", "full_attention", "conv"],
    }),
    # Released LFM2 configs name the attention layers by index and auto-adjust the MLP's width.
    "lfm2": ("Lfm2ForCausalLM", "Lfm2Config", {
        "full_attn_idxs": [1, 3], "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.5, "conv_bias": True,
    }),
    # Sigmoid routing with a bias on the choice and a scale on the weights; the first layer dense.
    "lfm2_moe": ("Lfm2MoeForCausalLM", "Lfm2MoeConfig", {
        "layer_types": ["conv", "full_attention", "conv", "full_attention"], "num_dense_layers": 1,
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "routed_scaling_factor": 1.5,
    }),
}
ATOL = 1e-4


@pytest.fixture(scope="module")
def registries():
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


def biased_experts(model: Any, torch: Any) -> None:
    """O(1) weights, and LFM2-MoE's routing bias (a buffer, zeros as initialized) random, so that
    it changes which experts are chosen."""
    o1_init(model, torch)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(0.5 * torch.randn_like(buffer))


@pytest.fixture(scope="module", params=list(FAMILIES))
def reference(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param != "lfm2_moe":
        return family_reference(FAMILIES, BASE, request.param, folder)
    pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    model_class, config_class, extra = FAMILIES["lfm2_moe"]
    return tiny_reference(model_class, config_class, {**BASE, **extra}, folder, init=biased_experts)


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_the_family_matches_transformers(reference, registries, backend):
    check_reference(reference, registries, backend=backend, atol=ATOL)


def test_a_verified_draft_rolls_back_per_row(reference, registries):
    """Two rows verify a four-token draft together; row 0 keeps all four, row 1 keeps one: each
    row's next logits are transformers' after its kept tokens (the conv state rewound per row)."""
    from mlxr_core.model.cache import attending_layer, batch_mask, rolls_back

    loaded = load_reference_model(reference, registries)
    model, prompts, want = loaded.model, reference.prompts, reference.logits
    caches = []
    for ids in prompts:
        cache = loaded.make_cache()
        model(mx.array([ids[:12]]), cache=cache)
        caches.append([layer.to_batch() for layer in cache])
    batch = caches[0]
    for layer, other in zip(batch, caches[1], strict=True):
        layer.extend(other)
    assert any(isinstance(layer.template, RecurrentCache) for layer in batch)
    assert rolls_back(batch)
    recurrent = [layer for layer in batch if hasattr(layer, "keep_positions")]
    for layer in recurrent:
        layer.keeps_positions = True
    mask = batch[attending_layer(batch)].draft_mask(4)
    model(mx.array([ids[12:16] for ids in prompts]), cache=batch, mask=mask)
    for layer in recurrent:
        layer.keeps_positions = False
    for layer in batch:
        layer.rollback([0, 3])
    kept = [16, 13]
    tokens = mx.array([[ids[n]] for ids, n in zip(prompts, kept, strict=True)])
    out = np.array(model(tokens, cache=batch, mask=batch_mask(batch))[:, -1])
    for row, n in enumerate(kept):
        np.testing.assert_allclose(out[row], want[row][n], atol=ATOL)


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                              "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}}},
         "rope_parameters.full_attention.rope_type"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
         "rope_parameters.sliding_attention"),
        ({"layer_types": ["conv", "mamba", "full_attention", "conv"]}, "layer_types"),
        ({"layer_types": ["conv", "full_attention"]}, "layer_types"),
    ],
)
def test_lfm3_refuses_math_it_does_not_compute(registries, keys, named):
    arch = registries.archs.get("lfm3")
    config = {**BASE, "model_type": "lfm3", "head_dim": 16, "layer_types": ["conv", "sliding_attention",
              "full_attention", "conv"], **keys}  # fmt: skip
    with pytest.raises(ModelLoadError) as caught:
        arch.args(config)
    assert caught.value.key == named


def test_the_engine_serves_it_batched_as_transformers(reference):
    """Three concurrent greedy streams (continuous batching with conv rows joining and leaving,
    chunked prefill, a one-token prompt) give transformers' tokens."""
    from mlxr_core.testing.hf_reference import engine_greedy, transformers_greedy

    prompts = [reference.prompts[0], reference.prompts[1], [7]]
    model_class = FAMILIES[reference.config["model_type"]][0]
    want = transformers_greedy(model_class, reference.folder, prompts, 6)
    assert engine_greedy(reference.folder, prompts, 6, prefill_chunk=16, compiled=False) == want


def test_an_mlx_lm_quantized_lfm2_moe_folder_loads_packed(registries, tmp_path):
    """mlx-lm's converted folder (8-bit, its names: dense ``gate_proj``, stacked ``switch_mlp``,
    attention ``out_proj`` packed), kept packed or dequantized, gives mlx-lm's logits on the same
    folder."""
    pytest.importorskip("torch", reason="the checkpoint is written by transformers")
    mlx_lm = pytest.importorskip("mlx_lm", reason="the folder is converted by mlx-lm")
    model_class, config_class, extra = FAMILIES["lfm2_moe"]
    shape = {**BASE, **extra, "tie_word_embeddings": True}  # mlx-lm's lfm2_moe ties the head
    reference = tiny_reference(model_class, config_class, shape, tmp_path / "hf", init=biased_experts)
    mlx_lm.convert(str(reference.folder), str(tmp_path / "mlx"), quantize=True, q_bits=8, q_group_size=32)
    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model

    ids = mx.array([reference.prompts[0]])
    theirs = np.array(mlx_lm.load(str(tmp_path / "mlx"))[0](ids)[0].astype(mx.float32))
    for policy in ("keep", "dequantize"):
        config = ModelConfig(path=str(tmp_path / "mlx"), dtype="float32", quantization=policy, compile_decode=False)
        ours = np.array(load_model(config, registries).model(ids)[0])
        np.testing.assert_allclose(ours, theirs, atol=1e-4, err_msg=policy)
        assert (ours.argmax(-1) == theirs.argmax(-1)).all(), policy


def test_lfm2_reads_the_released_config_keys(registries):
    """The released LFM2 configs' spellings: ``block_ff_dim`` (the MLP width before its
    adjustment), ``tie_embedding``, ``full_attn_idxs``; as ``Lfm2Config`` reads them."""
    transformers = pytest.importorskip("transformers", reason="the reference config is transformers'")
    released = {
        "model_type": "lfm2", "vocab_size": 97, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "block_ff_dim": 192, "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True, "tie_embedding": False,
        "full_attn_idxs": [2], "norm_eps": 1e-5, "conv_L_cache": 3,
    }
    args = registries.archs.get("lfm2").args(released)
    theirs = transformers.Lfm2Config(**{k: v for k, v in released.items() if k != "model_type"})
    mlp = transformers.models.lfm2.modeling_lfm2.Lfm2MLP(theirs)
    assert args.feed_forward_size == mlp.w1.out_features
    assert args.tie_word_embeddings == theirs.tie_word_embeddings is False
    assert args.layer_types == theirs.layer_types
